"""Operations on runs: start, resume, roll back, fork, cancel, decide, resolve.

Each validates its input first and changes nothing when it refuses; each locks the run row,
decides, writes the change with an event naming who and why in the same transaction, and
only then rings the doorbell (after commit).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, F, OuterRef, Q
from django.db.models.functions import Now

from durability import (
    acting,
    approvals,
    blobs,
    canonical,
    checkpoints,
    dispatch,
    leases,
    rollbacks,
    telemetry,
)
from durability.agents import registry
from durability.errors import (
    AlreadyDecided,
    IdempotencyConflict,
    InvalidInput,
    InvalidTransition,
    NotAllowed,
    Stale,
    StateTooLarge,
    UnknownApproval,
    UnknownCheckpoint,
    UnknownEffect,
    UnknownRun,
)
from durability.integrity import Report, verify_run
from durability.models import (
    FINISHED,
    AbandonedEffect,
    Approval,
    ApprovalStatus,
    Checkpoint,
    CheckpointReason,
    Durability,
    Effect,
    EffectStatus,
    Event,
    EventKind,
    Message,
    Mutation,
    Repeat,
    Run,
    RunStatus,
    WaitReason,
)
from durability.redact import redact, restore_placeholders
from durability.rollbacks import EffectDone

_HEX = re.compile(r"^[0-9a-f-]{4,36}$")


# --- finding things ------------------------------------------------------------------------


def get_run(ref: Any) -> Run:
    """A run by its id, or by a unique prefix of at least 4 characters."""
    if isinstance(ref, Run):
        return ref
    text = str(ref).strip().lower()
    try:
        return Run.objects.get(pk=uuid.UUID(text))
    except ValueError:
        pass
    except Run.DoesNotExist:
        raise UnknownRun(f"no run {text}") from None
    if not _HEX.match(text):
        raise UnknownRun(f"{ref!r} is not a run id")
    matches = list(Run.objects.filter(id__startswith=text).only("id")[:2])
    if not matches:
        raise UnknownRun(f"no run whose id starts with {text}")
    if len(matches) > 1:
        raise UnknownRun(f"more than one run id starts with {text}; give more characters")
    return Run.objects.get(pk=matches[0].pk)


def _locked(ref: Any) -> Run:
    run = get_run(ref)
    return Run.objects.select_for_update().get(pk=run.pk)


def _checkpoint_of(run: Run, seq: int | None = None, checkpoint_id: int | None = None):
    if checkpoint_id is not None:
        cp = Checkpoint.objects.filter(pk=checkpoint_id).select_related("parent").first()
        if cp is None:
            raise UnknownCheckpoint(f"no checkpoint with id {checkpoint_id}", run_id=run.id)
        if cp.run_id != run.id:
            raise InvalidInput(
                f"checkpoint id {checkpoint_id} belongs to run {cp.run_id}, not to this one;"
                " a run can only be rolled back to its own checkpoints (fork the other run"
                " instead)",
                run_id=run.id,
            )
        return cp
    try:
        seq = int(seq)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise UnknownCheckpoint(f"{seq!r} is not a checkpoint number", run_id=run.id) from None
    cp = Checkpoint.objects.filter(run=run, seq=seq).select_related("parent").first()
    if cp is None:
        raise UnknownCheckpoint(
            f"run has no checkpoint #{seq} (its checkpoints are #0 to #{run.head_seq})",
            run_id=run.id,
        )
    return cp


def state_at(ref: Any, seq: int | None = None) -> Any:
    """The verified state of a run at checkpoint ``seq`` (default: the head)."""
    run = get_run(ref)
    cp = _checkpoint_of(run, run.head_seq if seq is None else seq)
    state, _, _ = checkpoints.verified_state(cp)
    return state


def _event(run: Run, kind: str, *, by: str, reason: str, data: Any = None, seq=None) -> Event:
    data = acting.with_channel(data)
    return Event.objects.create(
        run=run,
        kind=kind,
        seq=run.head_seq if seq is None else seq,
        step=run.step,
        actor=by,
        reason=reason,
        data=canonical.dumps(data).decode() if data is not None else "",
    )


# --- start -----------------------------------------------------------------------------------


def _encoded(value: Any, what: str, limit_setting: str, default: int) -> bytes:
    canonical.check_json(value, what=what)
    data = canonical.dumps(value, what=what)
    limit = int(getattr(settings, limit_setting, default))
    if len(data) > limit:
        raise StateTooLarge(
            f"{what} is {len(data):,} bytes, over the limit of {limit:,} ({limit_setting})"
        )
    return data


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
    timeout) returns the run that key started; the same key with another agent or input is
    an error."""
    definition, input_bytes, state_bytes, input_hash = _prepared(agent, input)
    first = definition.first_step
    level = check_durability(durability or definition.durability)
    if idempotency_key:
        if len(idempotency_key) > 255:
            raise InvalidInput("an idempotency key is at most 255 characters")
        existing = _started_with(idempotency_key, input_hash)
        if existing is not None:
            return existing
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
        existing = _started_with(idempotency_key, input_hash) if idempotency_key else None
        if existing is None:
            raise
        return existing
    return run


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
    input, _ = redact(
        canonical.loads(_encoded(input, "input", "DURABILITY_MAX_INPUT_BYTES", 1 << 20))
    )
    input_bytes = canonical.dumps(input)
    state = definition.initial_state(input)
    canonical.check_json(state, what="initial state")
    blobs.offload(state, blobs.threshold())
    state_bytes = _encoded(state, "initial state", "DURABILITY_MAX_STATE_BYTES", 16 << 20)
    state, _ = redact(canonical.loads(state_bytes))
    definition.validate(state)
    input_hash = canonical.sha256_hex(definition.name.encode() + b"\x1f" + input_bytes)
    return definition, input_bytes, canonical.dumps(state), input_hash


def spawn_child(
    parent: Run, base_id: int, key: str, occurrence: int, agent: str, input: Any, *, by: str
) -> Run:
    """A child run for ``ctx.spawn``; the caller holds the transaction and the parent's
    lease. The child row is the spawn's record: its identity is unique."""
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
    )
    _event(
        parent,
        EventKind.SPAWNED,
        by="",
        reason="",
        data={"child": str(child.id), "agent": definition.name, "key": key},
    )
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
        Event.objects.create(
            run=parent,
            kind=EventKind.CHILD_FINISHED,
            seq=parent.head_seq,
            step=parent.step,
            data=canonical.dumps(
                {"child": str(child.id), "status": child.status, "error": child.error[:500]}
            ).decode(),
        )
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


def _started_with(key: str, input_hash: str) -> Run | None:
    run = Run.objects.filter(idempotency_key=key).first()
    if run is not None and run.input_hash != input_hash:
        raise IdempotencyConflict(
            f"idempotency key {key!r} already started run {run.id} with another agent or"
            " input; use a new key for a new run"
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
        status=RunStatus.QUEUED,
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
    _event(
        run,
        EventKind.CREATED,
        by=by,
        reason=reason,
        seq=0,
        data={"agent": definition.name, "version": definition.version},
    )
    dispatch.ring(run.id)
    return run


# --- resume and cancel ------------------------------------------------------------------------


def _check_status(run: Run, expected_status: str | None) -> None:
    """A decision made on a page showing the run in one state must not act on another: an
    operator resuming a waiting run must not revive one a colleague cancelled meanwhile."""
    if expected_status is not None and run.status != expected_status:
        raise Stale(
            f"the run changed since this was shown: it is {run.status} now, not"
            f" {expected_status}{_last_change(run)}; review it again",
            run_id=run.id,
        )


def _check_version(run: Run, expected_version: int | None) -> None:
    """Once per decision. The version of a run is its fencing token (``lease_token``), which
    every operator transition (resume, cancel, rollback), every claim by a worker and every
    requeue by the sweeper advances in the same statement as its change. A decision names the
    version it was made on and is checked here under the run's row lock, so a second copy of
    it (a double click without the form's token, a retried request, a script run twice) finds
    the version moved and changes nothing, even after the run came back to the status the
    decision expects (resumed, claimed and failed again). None: the caller decides on what
    it reads inside this same locked transaction (the CLI without ``--expect-version``)."""
    if expected_version is None or run.lease_token == expected_version:
        return
    raise Stale(
        f"the run moved on since this was decided: it was at version {expected_version}, it is"
        f" at {run.lease_token} now ({run.status}{_last_change(run)}); review it again",
        run_id=run.id,
    )


def _last_change(run: Run) -> str:
    """What changed the run last, for a refused decision: ", last: resumed by ann at ..."."""
    event = (
        Event.objects.filter(run=run)
        .order_by("-id")
        .only("kind", "actor", "worker", "created_at")
        .first()
    )
    if event is None:
        return ""
    who = f" by {event.actor}" if event.actor else (f" on {event.worker}" if event.worker else "")
    return f"; last: {event.get_kind_display()}{who} at {event.created_at:%H:%M:%S} UTC"


# Waits that end by themselves or by someone's decision, never by a resume: what ends each.
WAKES_BY_ITSELF = {
    WaitReason.APPROVAL: "an approval: it continues once someone decides it in the inbox",
    WaitReason.MESSAGE: "a message: it continues when the message arrives (send it)",
    WaitReason.TIMER: "a timer: it continues by itself when the time is due",
    WaitReason.RATE_LIMIT: "a shared rate limit: it continues by itself when a slot frees",
    WaitReason.CHILDREN: "its child runs: it continues by itself when they have finished",
}


def resume(
    ref: Any,
    *,
    by: str = "",
    reason: str = "",
    expected_status: str | None = None,
    expected_version: int | None = None,
) -> Run:
    """Queue a failed, cancelled or held run (on hold after a rollback: "continue") again
    from its head checkpoint, which must verify first. A run waiting for what wakes it by
    itself or by a decision (``WAKES_BY_ITSELF``: an approval, a message, a timer, its
    children) is refused with what it waits for. ``expected_status`` and
    ``expected_version``: the status and version the operator saw; refused (``Stale``) if
    either changed."""
    with transaction.atomic():
        run = _locked(ref)
        _check_status(run, expected_status)
        if run.status == RunStatus.SUCCEEDED:
            raise InvalidTransition(
                "the run succeeded; there is nothing to resume (roll back or fork it to run"
                " part of it again)",
                run_id=run.id,
            )
        if run.status in (RunStatus.QUEUED, RunStatus.RUNNING):
            raise InvalidTransition(f"the run is already {run.status}", run_id=run.id)
        if run.status == RunStatus.WAITING and run.wait_reason in WAKES_BY_ITSELF:
            raise InvalidTransition(
                f"the run waits for {WAKES_BY_ITSELF[run.wait_reason]}"
                f"{' (' + run.wait_detail + ')' if run.wait_detail else ''}; resuming it would"
                " only run the step to the same wait again",
                run_id=run.id,
            )
        _check_version(run, expected_version)
        head = _checkpoint_of(run, run.head_seq)
        checkpoints.verified_state(head)  # refuse to queue what cannot be rehydrated
        previous = run.status
        Run.objects.filter(pk=run.pk).update(
            status=RunStatus.QUEUED,
            wait_reason=WaitReason.NONE,
            wait_detail="",
            wake_at=None,
            error="",
            error_code="",
            finished_at=None,
            attempts=0,
            retries=0,
            lease_token=F("lease_token") + 1,
            lease_owner="",
            lease_expires_at=None,
            rung_at=Now(),
            updated_at=Now(),
        )
        run.refresh_from_db()
        _event(run, EventKind.RESUMED, by=by, reason=reason, data={"from": previous})
        dispatch.ring(run.id)
    return run


def cancel(
    ref: Any,
    *,
    by: str = "",
    reason: str = "",
    expected_version: int | None = None,
) -> Run:
    """Stop a run for good, and its unfinished child runs with it. A worker executing it is
    fenced out at its next write. ``expected_version``: the version the operator saw; refused
    (``Stale``) if it moved on, e.g. a colleague resumed the run after this cancel landed."""
    with transaction.atomic():
        run = _cancel_tree(ref, by=by, reason=reason, expected_version=expected_version)
    wake_parent(run)
    return run


def _cancel_tree(ref: Any, *, by: str, reason: str, expected_version: int | None = None) -> Run:
    """Cancel a run and every unfinished descendant, inside the caller's transaction."""
    run = _cancel_one(ref, by=by, reason=reason, expected_version=expected_version)
    pending = [run.id]
    while pending:
        children = list(Run.objects.filter(parent_run_id__in=pending).exclude(status__in=FINISHED))
        for child in children:
            _cancel_one(child.id, by=by, reason=f"ancestor {run.id} cancelled")
        pending = [c.id for c in children]
    return run


def _cancel_one(ref: Any, *, by: str, reason: str, expected_version: int | None = None) -> Run:
    """Inside the caller's transaction."""
    run = _locked(ref)
    if run.status in FINISHED:
        raise InvalidTransition(f"the run is already {run.status}", run_id=run.id)
    _check_version(run, expected_version)
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.CANCELLED,
        lease_token=F("lease_token") + 1,
        lease_owner="",
        lease_expires_at=None,
        wait_reason=WaitReason.NONE,
        wait_detail="",
        wake_at=None,
        finished_at=Now(),
        updated_at=Now(),
    )
    Approval.objects.filter(run=run, status=ApprovalStatus.PENDING).update(
        status=ApprovalStatus.SUPERSEDED, comment="run cancelled"
    )
    run.refresh_from_db()
    _event(run, EventKind.CANCELLED, by=by, reason=reason)
    return run


# --- rollback and fork --------------------------------------------------------------------------


@dataclass
class RollbackPlan:
    run: Run
    target: Checkpoint
    # Effects done (or perhaps done) on the branch being left: not undone unless compensated.
    done_not_undone: list[EffectDone] = field(default_factory=list)
    approvals_superseded: int = 0
    will_run_from: str = ""
    # Checkpoints of the branch being left (their operations are not replayed again).
    abandoned: set[int] = field(default_factory=set)
    # Unfinished children the abandoned branch started: (id, agent, status).
    children: list[tuple[str, str, str]] = field(default_factory=list)
    messages_back: int = 0
    message_ids: list[int] = field(default_factory=list)

    @property
    def preview(self) -> rollbacks.Preview:
        return rollbacks.Preview(
            target_seq=self.target.seq,
            target_step=self.target.step,
            will_run_from=self.will_run_from,
            effects=self.done_not_undone,
            children=self.children,
            messages_back=self.messages_back,
            approvals_superseded=self.approvals_superseded,
        )

    def sentences(self, decisions: dict[int, str] | None = None, *, hold: bool = True) -> list[str]:
        """The preview in plain words (the same for the dashboard and the CLI)."""
        return rollbacks.sentences(self.preview, decisions, hold=hold)


@dataclass
class RollbackResult(RollbackPlan):
    checkpoint: Checkpoint | None = None
    held: bool = False
    decisions: dict[int, str] = field(default_factory=dict)


def _ancestors(cp_id: int | None, parents: dict[int, int | None]) -> list[int]:
    path = []
    while cp_id is not None:
        path.append(cp_id)
        cp_id = parents.get(cp_id)
    return path


def plan_rollback(
    ref: Any, to_seq: int | None = None, *, checkpoint_id: int | None = None
) -> RollbackPlan:
    """What a rollback would do, for a confirmation: the effects already done after the
    target (each with whether it can be compensated), the children it cancels, the messages
    it puts back and where the run would continue."""
    run = get_run(ref)
    target = _checkpoint_of(run, to_seq, checkpoint_id)
    if target.seq == run.head_seq:
        raise InvalidTransition(f"checkpoint #{target.seq} is already the head", run_id=run.id)
    rows = list(Checkpoint.objects.filter(run=run).values_list("id", "parent_id", "seq"))
    parents = {i: p for i, p, _ in rows}
    seq_of = {i: s for i, _, s in rows}
    head_id = next(i for i, _, s in rows if s == run.head_seq)
    on_branch = _ancestors(head_id, parents)
    if target.id not in on_branch and Message.objects.filter(run=run).exists():
        # A message keeps only its latest delivery: which of them the target's own branch
        # consumed is no longer known, so going there could deliver one a second time.
        raise InvalidInput(
            f"checkpoint #{target.seq} is not on the run's current branch, and the run has"
            " messages whose delivery along that branch is no longer recorded; roll back to a"
            " checkpoint on the current branch, or fork from this one",
            run_id=run.id,
        )
    abandoned = set(on_branch) - set(_ancestors(target.parent_id, parents))
    # The run's rows, filtered here rather than by the database: the branch left behind can
    # hold thousands of checkpoints, and as many query parameters cost more than the rows.
    done = list(
        Effect.objects.filter(run=run)
        .exclude(status__in=(EffectStatus.FAILED, EffectStatus.RETRY, EffectStatus.WOULD_RUN))
        .order_by("id")
    )
    found = [e for e in done if e.base_id in abandoned]
    found += _still_open(run, abandoned, done, {e.pk for e in found})
    found.sort(key=lambda e: e.pk)
    compensated = _compensated(run, [e.pk for e in found if e.compensate])
    effects = [
        EffectDone(
            e.key,
            e.idempotency_key,
            e.step,
            seq_of.get(e.base_id, -1),
            e.status,
            id=e.pk,
            function=e.function,
            args=canonical.loads(e.args) if e.args else None,
            result=canonical.loads(e.result) if e.result else None,
            compensate=e.compensate,
            label=e.label,
            compensated=e.pk in compensated,
        )
        for e in found
    ]
    # Every pending approval, the target's own included: the new head is a checkpoint of its
    # own, so whatever the new branch asks, it asks anew under that identity.
    pending = Approval.objects.filter(run=run, status=ApprovalStatus.PENDING).count()
    children = [
        (str(c.id), c.agent, c.status)
        for c in Run.objects.filter(parent_run=run)
        .exclude(status__in=FINISHED)
        .only("id", "agent", "status", "spawn_base_id")
        .order_by("created_at")
        if c.spawn_base_id in abandoned
    ]
    consumed = Message.objects.filter(run=run).exclude(consumed_base=None)
    messages = [
        pk for pk, base in consumed.values_list("id", "consumed_base_id") if base in abandoned
    ]
    return RollbackPlan(
        run=run,
        target=target,
        done_not_undone=effects,
        approvals_superseded=pending,
        will_run_from=target.next_step,
        abandoned=abandoned,
        children=children,
        messages_back=len(messages),
        message_ids=messages,
    )


def _still_open(
    run: Run, abandoned: set[int], done: list[Effect], listed: set[int]
) -> list[Effect]:
    """Effects an earlier rollback left to be asked about whose new branch is abandoned now
    before it performed them again (a rollback on hold rolled back again, a question left
    pending): still done, still to be decided, so the new branch asks about them too."""
    performed = {(e.base_id, e.key, e.occurrence) for e in done}
    by_id = {e.pk: e for e in done}
    still = []
    for row in AbandonedEffect.objects.filter(run=run).only(
        "rollback_id", "effect_id", "key", "settled_base_id", "settled_occurrence"
    ):
        if row.rollback_id not in abandoned or row.effect_id in listed:
            continue  # its rollback is still on the branch (it still applies), or listed
        if (row.settled_base_id, row.key, row.settled_occurrence) in performed:
            continue  # decided and performed again: that effect is listed in its place
        effect = by_id.get(row.effect_id)
        if effect is not None and effect.pk not in listed:
            listed.add(effect.pk)
            still.append(effect)
    return [e for e in still if e.pk not in _compensated(run, [e.pk])]


def _compensated(run: Run, effect_ids: list[int]) -> set[int]:
    """Of these effects, those a compensation was already started for (by an earlier
    rollback): a second one would undo twice."""
    if not effect_ids:
        return set()
    keys = {f"{rollbacks.COMPENSATION_KEY}{i}": i for i in effect_ids}
    started = (
        Effect.objects.filter(run=run, key__in=keys)
        .exclude(status=EffectStatus.FAILED)
        .values_list("key", flat=True)
    )
    return {keys[k] for k in started}


def rollback(
    ref: Any,
    to_seq: int | None = None,
    *,
    checkpoint_id: int | None = None,
    by: str = "",
    reason: str = "",
    and_continue: bool = False,
    decisions: dict[int, str] | None = None,
    expected_head: int | None = None,
    expected_status: str | None = None,
    expected_version: int | None = None,
) -> RollbackResult:
    """Make a new head whose state equals checkpoint ``to_seq``. History is kept; effects
    done after the target are not undone and never performed again without a second
    decision (DESIGN: "A rollback never repays on its own").

    The run is left on hold (waiting, ``WaitReason.HOLD``) until an operator continues it
    (``resume``), unless ``and_continue``. ``decisions``: effect id -> what to do when the
    new branch reaches an effect with its key: ``ask`` (the default: the run stops and asks
    in the inbox), ``reuse`` (return the recorded outcome if the arguments are the same; ask
    otherwise), ``again`` (perform it again without asking) or ``compensate`` (run the
    compensation the effect declared before the run continues; then perform it again
    without asking when reached).

    ``expected_head``, ``expected_status`` and ``expected_version``: the head, status and
    version the operator's confirmation was made for; if any changed since (another operator
    cancelled it, the run moved on), the rollback is refused (``Stale``)."""
    with transaction.atomic():
        run = _locked(ref)
        _check_status(run, expected_status)
        if expected_head is not None and run.head_seq != expected_head:
            raise Stale(
                f"the run changed since this rollback was reviewed: its head moved from"
                f" #{expected_head} to #{run.head_seq}; review it again",
                run_id=run.id,
            )
        _check_version(run, expected_version)
        plan = plan_rollback(run, to_seq, checkpoint_id=checkpoint_id)
        try:
            chosen = rollbacks.check_decisions(plan.done_not_undone, decisions or {})
        except ValueError as exc:
            raise InvalidInput(str(exc), run_id=run.id) from None
        target = plan.target
        checkpoints.verified_state(target)
        seq = run.head_seq + 1
        chain = checkpoints.link(
            target.chain_hash,
            target.state_hash,
            run_id=run.id,
            seq=seq,
            step=target.step,
            next_step=target.next_step,
            schema_version=target.schema_version,
            agent_version=target.agent_version,
        )
        # An empty patch on the target: the new head rebuilds to exactly its state.
        cp = Checkpoint.objects.create(
            run=run,
            seq=seq,
            parent=target,
            reason=CheckpointReason.ROLLBACK,
            step=target.step,
            next_step=target.next_step,
            state_hash=target.state_hash,
            chain_hash=chain,
            schema_version=target.schema_version,
            agent_version=target.agent_version,
            config_hash=target.config_hash,
            packages=target.packages,
            size=target.size,
            delta_size=2,
            delta_run=target.delta_run + 2,
            created_by=by,
        )
        Mutation.objects.create(checkpoint=cp, ops="[]", count=0)
        Approval.objects.filter(run=run, status=ApprovalStatus.PENDING).update(
            status=ApprovalStatus.SUPERSEDED, comment="rolled back"
        )
        # Matches an earlier rollback's decisions made on the branch now left are undone: the
        # new branch meets those effects afresh (they are asked about again).
        unsettled = [
            pk
            for pk, base in AbandonedEffect.objects.filter(run=run)
            .exclude(settled_base=None)
            .values_list("id", "settled_base_id")
            if base in plan.abandoned
        ]
        AbandonedEffect.objects.filter(pk__in=unsettled).update(
            settled_base=None, settled_occurrence=None
        )
        AbandonedEffect.objects.bulk_create(
            AbandonedEffect(
                run=run,
                rollback=cp,
                effect_id=e.id,
                key=e.key,
                choice=chosen.get(e.id, Repeat.ASK),
                decided_by=by,
            )
            for e in plan.done_not_undone
            if not e.key.startswith(rollbacks.COMPENSATION_KEY)
        )
        # Unfinished children the abandoned branch spawned are cancelled; the new branch
        # spawns its own when it gets there.
        for child_id, _, _ in plan.children:
            _cancel_tree(child_id, by=by, reason=f"parent {run.id} rolled back")
        # Messages the abandoned branch consumed go back to the inbox, in arrival order.
        returned = (
            Message.objects.filter(pk__in=plan.message_ids)
            .exclude(consumed_base=None)
            .update(consumed_base=None, consumed_occurrence=None, consumed_at=None)
        )
        finished = not target.next_step
        held = not finished and not and_continue
        if finished:
            status, wait = RunStatus.SUCCEEDED, WaitReason.NONE
        else:
            status = RunStatus.WAITING if held else RunStatus.QUEUED
            wait = WaitReason.HOLD if held else WaitReason.NONE
        Run.objects.filter(pk=run.pk).update(
            head_seq=seq,
            step=target.next_step,
            status=status,
            lease_token=F("lease_token") + 1,
            lease_owner="",
            lease_expires_at=None,
            wait_reason=wait,
            wait_detail=(f"rolled back to #{target.seq} by {by or 'an operator'}" if held else ""),
            wake_at=None,
            error="",
            error_code="",
            attempts=0,
            retries=0,
            finished_at=Now() if finished else None,
            rung_at=Now(),
            updated_at=Now(),
        )
        run.refresh_from_db()
        _event(
            run,
            EventKind.ROLLBACK,
            by=by,
            reason=reason,
            seq=seq,
            data={
                "to": target.seq,
                "new_head": seq,
                "held": held,
                "done_not_undone": [
                    {
                        "key": e.key,
                        "idempotency_key": e.idempotency_key,
                        "step": e.step,
                        "seq": e.seq,
                        "status": e.status,
                        "id": e.id,
                        "decision": chosen.get(e.id, "ask"),
                    }
                    for e in plan.done_not_undone
                ],
                "messages_returned": returned,
            },
        )
        if finished:
            # A child rolled back to its end has finished: its parent may go on. After the
            # commit, in a transaction of its own: locking the parent while holding the
            # child would deadlock with an operator acting on the parent (parent, then child).
            transaction.on_commit(lambda: wake_parent(Run.objects.get(pk=run.pk)))
        elif not held:
            dispatch.ring(run.id)
    return RollbackResult(
        run=run,
        target=target,
        done_not_undone=plan.done_not_undone,
        approvals_superseded=plan.approvals_superseded,
        will_run_from=target.next_step,
        abandoned=plan.abandoned,
        children=plan.children,
        messages_back=plan.messages_back,
        message_ids=plan.message_ids,
        checkpoint=cp,
        held=held,
        decisions=chosen,
    )


def check_fork(ref: Any, from_seq: int, state: Any = None) -> bytes:
    """Validate a fork exactly as ``fork`` would, writing nothing: the canonical bytes of the
    state the new run would start from."""
    return _fork_input(ref, from_seq, state)[2]


def _fork_input(ref: Any, from_seq: int, state: Any) -> tuple[Run, Checkpoint, bytes, bool]:
    source = get_run(ref)
    target = _checkpoint_of(source, from_seq)
    definition = registry.get(source.agent)
    original, original_bytes, _ = checkpoints.verified_state(target)
    if state is None:
        return source, target, original_bytes, False
    canonical.check_json(state, what="edited state")
    state = restore_placeholders(state, original)
    state, _ = redact(state)
    if target.schema_version == definition.schema_version:
        definition.validate(state)
    state_bytes = _encoded(state, "edited state", "DURABILITY_MAX_STATE_BYTES", 16 << 20)
    return source, target, state_bytes, state_bytes != original_bytes


def fork(
    ref: Any,
    from_seq: int,
    *,
    state: Any = None,
    what_if: bool = False,
    live: bool = False,
    by: str = "",
    reason: str = "",
) -> Run:
    """Start a new run from a checkpoint of ``ref``, optionally with an edited state
    (validated against the agent's schema; redacted placeholders mean "unchanged").

    A ``what_if`` fork reuses the source run's recorded calls whose key, function and
    arguments match (so only what the edit changed is paid for again) and, unless ``live``,
    records the effects it would have run instead of running them."""
    source, target, state_bytes, edited = _fork_input(ref, from_seq, state)
    with (
        telemetry.run_root(f"fork {source.agent}", **{"durability.fork.source": str(source.id)}),
        transaction.atomic(),
    ):
        run = Run.objects.create(
            agent=source.agent,
            agent_version=registry.get(source.agent).version,
            status=RunStatus.QUEUED if target.next_step else RunStatus.SUCCEEDED,
            step=target.next_step,
            input=source.input,
            forked_from=source,
            forked_from_seq=target.seq,
            durability=source.durability,
            what_if=what_if,
            what_if_live=what_if and live,
            created_by=by,
            rung_at=Now(),
            trace_parent=telemetry.current_traceparent(),
        )
        checkpoints.write_snapshot_checkpoint(
            run,
            state_bytes,
            seq=0,
            parent=None,
            reason=CheckpointReason.FORK,
            step=target.step,
            next_step=target.next_step,
            schema_version=target.schema_version,
            agent_version=target.agent_version,
            by=by,
            fingerprint=(target.config_hash, target.packages),
        )
        data = {
            "source": str(source.id),
            "from": target.seq,
            "edited": edited,
            "what_if": what_if,
            "live": live,
        }
        _event(run, EventKind.FORK, by=by, reason=reason, seq=0, data=data)
        _event(
            source,
            EventKind.FORK,
            by=by,
            reason=reason,
            data={"fork": str(run.id), "from": target.seq, "edited": edited},
        )
        if target.next_step:
            dispatch.ring(run.id)
    return run


# --- approvals and effects ---------------------------------------------------------------------


def decide(
    ref: Any,
    name: str | None = None,
    *,
    approve: bool,
    by: str = "",
    comment: str = "",
    payload: Any = None,
    approval_id: int | None = None,
    expected_version: int | None = None,
) -> Approval:
    """Record the decision on a pending approval. The first decision wins; a second one is
    refused with who decided and when. An approval named by ``approval_id`` is decided once
    by its own status; one named by ``name`` may be asked again under that name after the
    run went on, so ``expected_version`` (the run version the decision was made on) keeps a
    repeated decision from settling the new question too. An edited ``payload`` must pass
    the agent's editable schema and check (``EditRefused``, nothing recorded); both the
    asked and the decided payload are kept, and the decision's event lists what changed."""
    with transaction.atomic():
        run = _locked(ref)
        asked = Approval.objects.filter(run=run)
        asked = asked.filter(pk=approval_id) if approval_id is not None else asked.filter(name=name)
        pending = asked.filter(status=ApprovalStatus.PENDING).order_by("-id").first()
        if pending is None:
            last = asked.order_by("-id").first()
            if last is None:
                waiting = (
                    ", ".join(
                        Approval.objects.filter(run=run, status=ApprovalStatus.PENDING).values_list(
                            "name", flat=True
                        )
                    )
                    or "none"
                )
                raise UnknownApproval(
                    f"no approval {name or approval_id!r} was asked (pending: {waiting})",
                    run_id=run.id,
                )
            if last.status == ApprovalStatus.SUPERSEDED:
                raise InvalidTransition(
                    f"approval {last.name!r} was superseded ({last.comment or 'asked anew'});"
                    " it can no longer be decided",
                    run_id=run.id,
                )
            raise AlreadyDecided(
                f"approval {last.name!r} was already {last.status} by {last.decided_by or '?'}"
                f" at {last.decided_at:%Y-%m-%d %H:%M:%S} UTC; the first decision stands",
                run_id=run.id,
            )
        _check_version(run, expected_version)
        check_may_decide(pending, by)
        edited = ""
        changes: list[dict[str, Any]] = []
        if payload is not None:
            if not approve:
                raise InvalidInput("a rejection cannot carry an edited payload", run_id=run.id)
            canonical.check_json(payload, what="edited payload")
            asked_payload = canonical.loads(pending.payload)
            payload = approvals.complete(pending.editable, asked_payload, payload)
            payload = restore_placeholders(payload, asked_payload)
            payload, _ = redact(payload)
            edited = canonical.dumps(payload).decode()
            if edited == pending.payload:
                edited = ""
            else:
                # The agent's schema and check, before anything is written: a refused edit
                # leaves the approval pending and the run waiting.
                approvals.check_edit(pending, run.agent, asked_payload, payload)
                changes = approvals.changes(asked_payload, payload)
        updated = Approval.objects.filter(pk=pending.pk, status=ApprovalStatus.PENDING).update(
            status=ApprovalStatus.APPROVED if approve else ApprovalStatus.REJECTED,
            decided_by=by,
            decided_at=Now(),
            comment=comment,
            edited_payload=edited,
        )
        if not updated:  # pragma: no cover - the run lock makes this unreachable
            raise AlreadyDecided("the approval was decided meanwhile", run_id=run.id)
        _event(
            run,
            EventKind.APPROVAL_DECIDED,
            by=by,
            reason=comment,
            data={
                "name": pending.name,
                "approved": approve,
                "edited": bool(edited),
                **({"changes": changes} if changes else {}),
            },
        )
        if run.status == RunStatus.WAITING and run.wait_reason == WaitReason.APPROVAL:
            dispatch.wake(run.id)
        pending.refresh_from_db()
    return pending


# The role that decides approvals (the dashboard's "operators" group).
OPERATORS_GROUP = "operators"


def check_may_decide(approval: Approval, by: str) -> None:
    """An approval whose policy names a group is decided only by operators in that group
    (or superusers): the group narrows who of the operators may, it grants nothing to
    someone who is not one."""
    if not approval.group:
        return
    from django.contrib.auth import get_user_model

    users = get_user_model()
    memberships = users.groups.through.objects.filter(user_id=OuterRef("pk"))
    member = users.objects.filter(username=by, is_active=True).filter(
        Q(is_superuser=True)
        | (
            Exists(memberships.filter(group__name=approval.group))
            & Exists(memberships.filter(group__name=OPERATORS_GROUP))
        )
    )
    if not member.exists():
        raise NotAllowed(
            f"{by or 'an anonymous caller'} may not decide approval {approval.name!r}: only"
            f" operators in the group {approval.group!r} may",
            run_id=approval.run_id,
        )


def expire_approvals(limit: int = 200) -> list[int]:
    """Decide (or escalate) approvals whose deadline passed, as their policy says. Each is
    a conditional update on a still-pending approval, so it happens once however many
    sweepers run. Returns the ids acted on."""
    acted = []
    due = list(
        Approval.objects.filter(status=ApprovalStatus.PENDING, deadline__lte=Now())
        .order_by("deadline")
        .values_list("pk", "run_id")[:limit]
    )
    for approval_id, run_id in due:
        with transaction.atomic():
            run = Run.objects.select_for_update().get(pk=run_id)
            approval = Approval.objects.filter(
                pk=approval_id, status=ApprovalStatus.PENDING, deadline__lte=Now()
            ).first()
            if approval is None:
                continue  # decided meanwhile, or another sweeper got there first
            if approval.on_timeout == "escalate" and approval.escalations == 0:
                Approval.objects.filter(pk=approval.pk).update(
                    group=approval.escalate_to,
                    escalations=F("escalations") + 1,
                    deadline=leases.db_now_plus(approval.timeout_seconds or 0),
                )
                _event(
                    run,
                    EventKind.APPROVAL_ESCALATED,
                    by="policy:timeout",
                    reason=f"no decision from {approval.group or 'operators'} in time",
                    data={"name": approval.name, "to": approval.escalate_to},
                )
            else:
                approve = approval.on_timeout == "approve" and approval.escalations == 0
                Approval.objects.filter(pk=approval.pk, status=ApprovalStatus.PENDING).update(
                    status=ApprovalStatus.APPROVED if approve else ApprovalStatus.REJECTED,
                    decided_by="policy:timeout",
                    decided_at=Now(),
                    comment=f"no decision within {approval.timeout_seconds:g} s",
                )
                _event(
                    run,
                    EventKind.APPROVAL_DECIDED,
                    by="policy:timeout",
                    reason="timed out",
                    data={"name": approval.name, "approved": approve, "timeout": True},
                )
                if run.status == RunStatus.WAITING and run.wait_reason == WaitReason.APPROVAL:
                    dispatch.wake(run.id)
            acted.append(approval_id)
    return acted


def resolve_effect(
    ref: Any,
    effect_id: int,
    *,
    outcome: str,
    result: Any = None,
    by: str = "",
    note: str = "",
    expected_attempts: int | None = None,
    expected_version: int | None = None,
) -> Effect:
    """Say what happened to an effect in doubt: ``done`` (with its result), ``failed``
    (raised into the step as ``EffectFailed``) or ``retry`` (perform it again, same key).
    ``expected_attempts``: the attempts the operator saw; if the effect was performed again
    since (a colleague chose retry), what they checked is out of date and it is refused.
    ``expected_version``: the run version the operator saw; a retry is performed by a new
    claim, which moves it on, so a repeated resolve never settles the next attempt."""
    if outcome not in ("done", "failed", "retry"):
        raise InvalidInput(f"outcome must be done, failed or retry, not {outcome!r}")
    with transaction.atomic():
        run = _locked(ref)
        effect = Effect.objects.filter(run=run, pk=effect_id).first()
        if effect is None:
            raise UnknownEffect(f"run has no effect {effect_id}", run_id=run.id)
        if effect.status not in (EffectStatus.IN_DOUBT, EffectStatus.PENDING):
            raise InvalidTransition(
                f"effect {effect.key!r} is {effect.status}; only an effect in doubt can be"
                " resolved",
                run_id=run.id,
            )
        if expected_attempts is not None and effect.attempts != expected_attempts:
            raise Stale(
                f"effect {effect.key!r} was performed again since this was shown (attempt"
                f" {effect.attempts}, not {expected_attempts}); review it again",
                run_id=run.id,
            )
        _check_version(run, expected_version)
        fields: dict[str, Any] = {"resolved_by": by, "resolution_note": note}
        if outcome == "done":
            canonical.check_json(result, what="effect result")
            fields.update(
                status=EffectStatus.DONE,
                result=canonical.dumps(result).decode(),
                completed_at=Now(),
            )
        elif outcome == "failed":
            fields.update(status=EffectStatus.FAILED, error=note or "marked failed")
        else:
            fields.update(status=EffectStatus.RETRY)
        Effect.objects.filter(pk=effect.pk).update(**fields)
        _event(
            run,
            EventKind.EFFECT_RESOLVED,
            by=by,
            reason=note,
            data={"effect": effect.pk, "key": effect.key, "outcome": outcome},
        )
        if run.status == RunStatus.WAITING and run.wait_reason == WaitReason.IN_DOUBT:
            dispatch.wake(run.id)
        effect.refresh_from_db()
    return effect


# --- messages ------------------------------------------------------------------------------


def send(
    ref: Any,
    name: str,
    data: Any = None,
    *,
    idempotency_key: str = "",
    by: str = "",
    reason: str = "",
    expected_version: int | None = None,
) -> Message:
    """Deliver a message to a run, kept in order until a step takes it with
    ``ctx.wait_for(name)``. A send retried with the same ``idempotency_key`` is delivered
    once (and returns the first delivery); the same key with other contents is an error.

    ``expected_version``: the run version the sender saw. A send does not move the version
    (it must not fence out the worker executing the run), so without a key of its own the
    send's identity is that version with the message's name and contents: the same message
    sent again on the same version of the run (a double click, a retried request) is
    delivered once; sent again after the run moved on, it is refused as stale."""
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise InvalidInput("a message needs a name of 1 to 200 characters")
    if len(idempotency_key) > 255:
        raise InvalidInput("an idempotency key is at most 255 characters")
    payload, _ = redact(
        canonical.loads(_encoded(data, "message data", "DURABILITY_MAX_INPUT_BYTES", 1 << 20))
    )
    text = canonical.dumps(payload).decode()
    if not idempotency_key and expected_version is not None:
        digest = canonical.sha256_hex(name.encode() + b"\x1f" + text.encode())
        idempotency_key = f"version:{expected_version}:{digest}"
    with transaction.atomic():
        run = _locked(ref)
        if idempotency_key:
            first = Message.objects.filter(run=run, idempotency_key=idempotency_key).first()
            if first is not None:
                if (first.name, first.data) != (name, text):
                    raise IdempotencyConflict(
                        f"idempotency key {idempotency_key!r} was already used for another"
                        " message to this run",
                        run_id=run.id,
                    )
                return first
        if run.status in FINISHED:
            raise InvalidTransition(
                f"the run is {run.status}; it takes no more messages", run_id=run.id
            )
        _check_version(run, expected_version)
        message = Message.objects.create(
            run=run, name=name, data=text, idempotency_key=idempotency_key, sent_by=by
        )
        _event(
            run,
            EventKind.MESSAGE_RECEIVED,
            by=by,
            reason=reason,
            data={"name": name, "bytes": len(text), "message": message.pk},
        )
        if (
            run.status == RunStatus.WAITING
            and run.wait_reason == WaitReason.MESSAGE
            and run.wait_detail == name
        ):
            dispatch.wake(run.id)
    return message


def verify(ref: Any | None = None) -> list[Report]:
    """Verify one run's checkpoints, or every run's."""
    if ref is not None:
        return [verify_run(get_run(ref).id)]
    return [
        verify_run(run_id)
        for run_id in Run.objects.order_by("created_at").values_list("id", flat=True)
    ]
