"""Forking: a new run from a checkpoint of another, its state edited or not."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models.functions import Now

from durability import canonical, checkpoints, dispatch, events, lifecycle, telemetry
from durability.agents import registry
from durability.conf import Engine
from durability.langgraph.runs import refuse_outside_workers
from durability.models import Checkpoint, CheckpointReason, Run
from durability.operations._runs import _checkpoint_of, _encoded, get_run
from durability.redact import redact, restore_placeholders


def check_fork(ref: Any, from_seq: int, state: Any = None) -> bytes:
    """Validate a fork exactly as ``fork`` would, writing nothing: the canonical bytes of the
    state the new run would start from."""
    return _fork_input(ref, from_seq, state)[2]


def _fork_input(ref: Any, from_seq: int, state: Any) -> tuple[Run, Checkpoint, bytes, bool]:
    source = get_run(ref)
    refuse_outside_workers(source, "fork it")
    target = _checkpoint_of(source, from_seq)
    definition = registry.get(source.agent)
    original, original_bytes, _ = checkpoints.verified_state(target)
    if state is None:
        return source, target, original_bytes, False
    canonical.check_json(state, what="edited state")
    state = restore_placeholders(state, original)
    state, _ = redact(state)
    if target.schema_version == definition.schema_version:
        definition.validate_edit(state)
    state_bytes = _encoded(state, "edited state", Engine.MAX_STATE_BYTES)
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
        run = _forked_run(source, target, what_if=what_if, live=live, by=by)
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
        told = {"fork": str(run.id), "from": target.seq, "edited": edited}
        events.record(
            events.fork(run, by=by, reason=reason, seq=0, data=data),
            events.fork(source, by=by, reason=reason, data=told),
        )
        if target.next_step:
            dispatch.ring(run.id)
    return run


def _forked_run(source: Run, target: Checkpoint, *, what_if: bool, live: bool, by: str) -> Run:
    return Run.objects.create(
        agent=source.agent,
        agent_version=registry.get(source.agent).version,
        **lifecycle.first_fields(target.next_step),
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
