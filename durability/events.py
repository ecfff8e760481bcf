"""The run's timeline: one function per kind of event, so each kind's shape (which fields it
fills, what its data holds) is written once.

Each function returns an unsaved ``Event``; ``record`` writes them (checking their runs, see
``models.Event``), in the caller's transaction, with the change they describe. ``run`` is a
``Run`` (the event is placed at its head checkpoint and step unless told otherwise) or a run
id. ``at`` is where in the run and who: ``seq``, ``step``, ``worker``, ``commit_us``.

The step commit writes its own events inside its one statement (``checkpoints``).
"""

from __future__ import annotations

from typing import Any

from durability import acting, canonical
from durability.models import Event, EventKind, Run


def new(
    run: Any,
    kind: str,
    *,
    by: str = "",
    reason: str = "",
    data: Any = None,
    seq: int | None = None,
    step: str | None = None,
    worker: str = "",
    commit_us: int | None = None,
) -> Event:
    """An event of any kind; the functions below name each kind's fields. ``data``: a
    value to store as canonical JSON, or text already encoded."""
    run_id = run.pk if isinstance(run, Run) else run
    if by:
        # An operator's action names the channel it came through (an API token), if any.
        data = acting.with_channel(data)
    if isinstance(run, Run):
        seq = run.head_seq if seq is None else seq
        step = run.step if step is None else step
    if data is None:
        text = ""
    elif isinstance(data, str):
        text = data
    else:
        text = canonical.dumps(data).decode()
    return Event(
        run_id=run_id,
        kind=kind,
        seq=seq,
        step=step or "",
        actor=by,
        reason=reason,
        worker=worker,
        data=text,
        commit_us=commit_us,
    )


def record(*events: Event) -> list[Event]:
    """Write ``events`` (in the caller's transaction, if any)."""
    if len(events) == 1:
        events[0].save()
        return list(events)
    return Event.objects.bulk_create(events)


def _with_replays(data: dict, replayed: list | None) -> dict:
    if replayed:
        data["replayed"] = replayed
    return data


# --- operators and the engine's operations ---------------------------------------------------


def created(run: Run, *, by: str, reason: str, agent: str, version: str) -> Event:
    data = {"agent": agent, "version": version}
    return new(run, EventKind.CREATED, by=by, reason=reason, seq=0, data=data)


def spawned(parent: Run, *, child: Any, agent: str, key: str) -> Event:
    data = {"child": str(child), "agent": agent, "key": key}
    return new(parent, EventKind.SPAWNED, data=data)


def child_finished(parent: Run, child: Run) -> Event:
    data = {"child": str(child.id), "status": child.status, "error": child.error[:500]}
    return new(parent, EventKind.CHILD_FINISHED, data=data)


def resumed(run: Run, *, by: str, reason: str, previous: str) -> Event:
    return new(run, EventKind.RESUMED, by=by, reason=reason, data={"from": previous})


def cancelled(run: Run, *, by: str, reason: str) -> Event:
    return new(run, EventKind.CANCELLED, by=by, reason=reason)


def rollback(run: Run, *, by: str, reason: str, seq: int, data: dict) -> Event:
    return new(run, EventKind.ROLLBACK, by=by, reason=reason, seq=seq, data=data)


def fork(run: Run, *, by: str, reason: str, data: dict, seq: int | None = None) -> Event:
    """On the new run (at #0) and on its source (at its head)."""
    return new(run, EventKind.FORK, by=by, reason=reason, seq=seq, data=data)


def approval_decided(run: Run, *, by: str, reason: str, data: dict) -> Event:
    return new(run, EventKind.APPROVAL_DECIDED, by=by, reason=reason, data=data)


def approval_escalated(run: Run, *, by: str, reason: str, name: str, to: str) -> Event:
    data = {"name": name, "to": to}
    return new(run, EventKind.APPROVAL_ESCALATED, by=by, reason=reason, data=data)


def effect_resolved(
    run: Run, *, by: str, reason: str, effect: int, key: str, outcome: str
) -> Event:
    data = {"effect": effect, "key": key, "outcome": outcome}
    return new(run, EventKind.EFFECT_RESOLVED, by=by, reason=reason, data=data)


def message_received(
    run: Run, *, by: str, reason: str, name: str, size: int, message: int
) -> Event:
    data = {"name": name, "bytes": size, "message": message}
    return new(run, EventKind.MESSAGE_RECEIVED, by=by, reason=reason, data=data)


# --- the sweeper ------------------------------------------------------------------------------


def lease_lost(run_id: Any, *, worker: str, why: str, heartbeat: Any) -> Event:
    data = {"heartbeat_at": heartbeat.isoformat() if heartbeat else None}
    return new(run_id, EventKind.LEASE_LOST, worker=worker, reason=why, data=data)


# --- a worker's ways out of an execution ------------------------------------------------------


def suspended(
    run: Any, *, wait: str, detail: str, replayed: list | None = None, **at: Any
) -> Event:
    data = _with_replays({"reason": wait, "detail": detail}, replayed)
    return new(run, EventKind.SUSPENDED, data=data, **at)


def retry_scheduled(
    run: Any,
    *,
    delay: float,
    error: str,
    retry: int,
    replayed: list | None = None,
    **at: Any,
) -> Event:
    data = {"delay_s": round(delay, 3), "error": error[:2000], "retry": retry}
    return new(run, EventKind.RETRY_SCHEDULED, data=_with_replays(data, replayed), **at)


def failed(
    run: Any, *, message: str, detail: dict, replayed: list | None = None, **at: Any
) -> Event:
    data = _with_replays(dict(detail), replayed)
    return new(run, EventKind.FAILED, reason=message[:2000], data=data, **at)


def integrity(run: Any, *, message: str, detail: dict, **at: Any) -> Event:
    return new(run, EventKind.INTEGRITY, reason=message, data=detail, **at)


def released(run: Any, *, why: str, **at: Any) -> Event:
    return new(run, EventKind.RELEASED, reason=why, **at)


def succeeded(run: Any, **at: Any) -> Event:
    return new(run, EventKind.SUCCEEDED, **at)
