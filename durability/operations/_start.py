"""Starting runs: from the API or the CLI, and as a parent's child (``ctx.spawn``)."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.db.models.functions import Now

from durability import blobs, canonical, checkpoints, dispatch, events, lifecycle, telemetry
from durability.agents import registry
from durability.conf import Engine
from durability.errors import IdempotencyConflict, InvalidInput
from durability.models import CheckpointReason, Durability, Run, RunStatus, WaitReason
from durability.operations._runs import _encoded, get_run
from durability.redact import redact


def start(
    agent: str,
    input: Any = None,
    *,
    by: str = "",
    reason: str = "",
    idempotency_key: str = "",
    durability: str | None = None,
) -> Run:
    """Start a run of ``agent`` on ``input``. Unknown agents, input that is not JSON or
    fails the schema, and oversized input or state are refused before anything is written.

    With an ``idempotency_key``, starting again with the same key (a client retrying after a
    timeout) returns the run that key started; the same key with another agent, input or
    durability level is an error."""
    return started(
        agent, input, by=by, reason=reason, idempotency_key=idempotency_key, durability=durability
    )[0]


def started(
    agent: str,
    input: Any = None,
    *,
    by: str = "",
    reason: str = "",
    idempotency_key: str = "",
    durability: str | None = None,
) -> tuple[Run, bool]:
    """``start``, and whether this call made the run (False: the key's earlier start made
    it, however many retries raced)."""
    if idempotency_key:
        if len(idempotency_key) > 255:
            raise InvalidInput("an idempotency key is at most 255 characters")
        # Before the input is checked against this agent's schema: a key reused for
        # another agent is the conflict, whatever that agent thinks of the input.
        _started_with(idempotency_key, agent=agent)
    definition, input_bytes, state_bytes, input_hash = _prepared(agent, input)
    first = definition.first_step
    level = check_durability(durability or definition.durability)
    if why := definition.refused_levels.get(level):
        raise InvalidInput(f"agent {definition.name}: {why}; nothing was started")
    if idempotency_key:
        existing = _started_with(idempotency_key, input_hash=input_hash, durability=durability)
        if existing is not None:
            return existing, False
    try:
        with (
            telemetry.run_root(f"start {agent}", **{"durability.agent.name": agent}),
            transaction.atomic(),
        ):
            run = _create_run(
                definition,
                first,
                input_bytes,
                input_hash,
                state_bytes,
                idempotency_key,
                by,
                reason,
                durability=level,
            )
    except IntegrityError:
        # Two starts with one key raced: the other one won.
        existing = (
            _started_with(idempotency_key, input_hash=input_hash, durability=durability)
            if idempotency_key
            else None
        )
        if existing is None:
            raise
        return existing, False
    return run, True


def check_durability(level: str) -> str:
    """Refuse a level this database cannot honour, naming why."""
    if level not in Durability.values:
        raise InvalidInput(
            f"durability must be one of {', '.join(Durability.values)}, not {level!r}"
        )
    if level == Durability.REPLICATED:
        from durability.checkpoints import synchronous_standby

        ok, why = synchronous_standby()
        if not ok:
            raise InvalidInput(f"durability 'replicated' is not available here: {why}")
    return level


def _prepared(agent: str, input: Any) -> tuple[Any, bytes, bytes, str]:
    """Validate a start: (definition, input bytes, initial state bytes, input hash)."""
    definition = registry.get(agent)
    input, _ = redact(canonical.loads(_encoded(input, "input", Engine.MAX_INPUT_BYTES)))
    input_bytes = canonical.dumps(input)
    state = definition.initial_state(input)
    canonical.check_json(state, what="initial state")
    blobs.offload(state, blobs.threshold())
    state_bytes = _encoded(state, "initial state", Engine.MAX_STATE_BYTES)
    state, _ = redact(canonical.loads(state_bytes))
    definition.validate(state)
    input_hash = canonical.sha256_hex(definition.name.encode() + b"\x1f" + input_bytes)
    return definition, input_bytes, canonical.dumps(state), input_hash


def spawn_child(
    parent: Run, base_id: int, key: str, occurrence: int, agent: str, input: Any, *, by: str
) -> Run:
    """A child run for ``ctx.spawn``; the caller holds the transaction and the parent's
    lease. The child row is the spawn's record: its identity is unique. A what-if run's
    child is a what-if run too: what the parent would have started performs no effect
    either (nor, unless the parent is live, do its children's)."""
    definition, input_bytes, state_bytes, input_hash = _prepared(agent, input)
    existing = Run.objects.filter(
        spawn_base_id=base_id, spawn_key=key, spawn_occurrence=occurrence
    ).first()
    if existing is not None:
        return existing
    child = _create_run(
        definition,
        definition.first_step,
        input_bytes,
        input_hash,
        state_bytes,
        "",
        by,
        f"spawned by {parent.id}",
        parent_run=parent,
        spawn_base_id=base_id,
        spawn_key=key,
        spawn_occurrence=occurrence,
        what_if=parent.what_if,
        what_if_live=parent.what_if_live,
    )
    events.record(events.spawned(parent, child=child.id, agent=definition.name, key=key))
    return child


def wake_parent(child: Run) -> None:
    """A child finished: tell its parent (an event), and wake it if it waits on children.
    The parent's step re-checks what it joined; the sweeper repeats this for any wake-up a
    dying worker did not deliver."""
    if child.parent_run_id is None:
        return
    with transaction.atomic():
        parent = Run.objects.select_for_update().filter(pk=child.parent_run_id).first()
        if parent is None:
            return
        events.record(events.child_finished(parent, child))
        if parent.status == RunStatus.WAITING and parent.wait_reason == WaitReason.CHILDREN:
            dispatch.wake(parent.id)


def tree(ref: Any) -> dict:
    """The run and its descendants, as nested dicts (id, agent, status, children)."""
    root = get_run(ref)
    rows = {root.id: root}
    frontier = [root.id]
    while frontier:
        found = list(Run.objects.filter(parent_run_id__in=frontier))
        frontier = [r.id for r in found]
        rows.update({r.id: r for r in found})

    def node(run: Run) -> dict:
        kids = sorted(
            (r for r in rows.values() if r.parent_run_id == run.id), key=lambda r: r.created_at
        )
        return {
            "id": str(run.id),
            "agent": run.agent,
            "status": run.status,
            "error": run.error,
            "children": [node(k) for k in kids],
        }

    return node(root)


def _started_with(
    key: str, *, agent: str = "", input_hash: str = "", durability: str | None = None
) -> Run | None:
    """The run ``key`` started, if any; a conflict if it was started with another agent,
    input (``input_hash``) or durability level than given (those not given are not
    compared: a start that names no level takes the agent's)."""
    run = Run.objects.filter(idempotency_key=key).first()
    if run is None:
        return None
    other = ""
    if agent and run.agent != agent:
        other = f"agent ({run.agent})"
    elif input_hash and run.input_hash != input_hash:
        other = "input"
    elif durability and run.durability != durability:
        other = f"durability level ({run.durability})"
    if other:
        raise IdempotencyConflict(
            f"idempotency key {key!r} already started run {run.id} with another {other};"
            " use a new key for a new run"
        )
    return run


def _create_run(
    definition: Any,
    first: str,
    input_bytes: bytes,
    input_hash: str,
    state_bytes: bytes,
    key: str,
    by: str,
    reason: str,
    **extra: Any,
) -> Run:
    run = Run.objects.create(
        **extra,
        agent=definition.name,
        agent_version=definition.version,
        **lifecycle.first_fields(first),
        step=first,
        input=input_bytes.decode(),
        created_by=by,
        rung_at=Now(),
        trace_parent=telemetry.current_traceparent(),
        idempotency_key=key,
        input_hash=input_hash,
    )
    checkpoints.write_snapshot_checkpoint(
        run,
        state_bytes,
        seq=0,
        parent=None,
        reason=CheckpointReason.START,
        step="",
        next_step=first,
        schema_version=definition.schema_version,
        agent_version=definition.version,
        by=by,
        fingerprint=definition.fingerprint(),
    )
    events.record(
        events.created(run, by=by, reason=reason, agent=definition.name, version=definition.version)
    )
    dispatch.ring(run.id)
    return run
