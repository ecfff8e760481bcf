"""The run's timeline: one function per kind of event, so each kind's shape (which fields it
fills, what its data holds) is written once.

Each function returns an unsaved ``Event``; ``record`` writes them (checking their runs, see
``models.Event``), in the caller's transaction, with the change they describe. ``run`` is a
``Run`` (the event is placed at its head checkpoint and step unless told otherwise) or a run
id. ``at`` is where in the run and who: ``seq``, ``step``, ``worker``, ``commit_us``.

The step commit writes its own events inside its one statement (``checkpoints``).
"""

from __future__ import annotations

from collections import Counter
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


def replay_counts(run_id: Any) -> Counter[int]:
    """How many times each journaled call of the run was replayed (its recorded result
    served when its step ran again, after a crash or a retry), by journal entry id: counted
    from the events that close those steps, which name the calls they replayed
    (``replayed``), so that counting costs the step nothing."""
    counts: Counter[int] = Counter()
    rows = Event.objects.filter(run_id=run_id, data__contains='"replayed"')
    for data in rows.values_list("data", flat=True):
        found = canonical.loads_object(data).get("replayed")
        for pair in found if isinstance(found, list) else []:
            if isinstance(pair, list) and pair and isinstance(pair[0], int):
                counts[pair[0]] += 1
    return counts


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


# --- claims and the sweeper ------------------------------------------------------------------


def claimed(run: Run, *, worker: str) -> Event:
    return new(run, EventKind.CLAIMED, worker=worker, data={"attempt": run.attempts})


def recovered(
    run: Run,
    *,
    worker: str,
    recovery_ms: float | None,
    work_lost_ms: float | None,
    why: str = "",
) -> Event:
    """``why``: how the lost attempt was found lost ("process gone", "lease expired")."""
    data: dict[str, Any] = {
        "recovery_ms": recovery_ms,
        "work_lost_ms": work_lost_ms,
        "attempt": run.attempts,
    }
    if why:
        data["why"] = why
    return new(run, EventKind.RECOVERED, worker=worker, data=data)


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


# --- what a step did (``at``: seq, step and worker) --------------------------------------------


def checkpoint(run: Any, *, data: str, commit_us: int | None, **at: Any) -> Event:
    """A step's checkpoint; ``data``: its facts, already encoded; ``commit_us``: the latency
    of the commit before it (known only now when that one was sent ahead)."""
    return new(run, EventKind.CHECKPOINT, data=data, commit_us=commit_us, **at)


def diverged(run: Any, *, key: str, source: Any, **at: Any) -> Event:
    return new(run, EventKind.DIVERGED, data={"key": key, "source": str(source)}, **at)


def effect_reused(
    run: Any, *, effect: int, source: int, idempotency_key: str, key: str, **at: Any
) -> Event:
    data = {"effect": effect, "from": source, "idempotency_key": idempotency_key, "key": key}
    return new(run, EventKind.EFFECT_REUSED, data=data, **at)


def compensated(run: Any, *, what: str, compensation: dict, by: str = "", **at: Any) -> Event:
    """``compensation``: the compensating effect and the effect it undid (ids, function,
    keys, result); ``what``: the undone effect in the customer's words; ``by``: the
    operator who chose it (at the rollback)."""
    return new(run, EventKind.COMPENSATED, by=by, reason=f"{what} undone", data=compensation, **at)


def effect_in_doubt(run: Any, *, effect: int, key: str, idempotency_key: str, **at: Any) -> Event:
    data = {"effect": effect, "key": key, "idempotency_key": idempotency_key}
    return new(run, EventKind.EFFECT_IN_DOUBT, data=data, **at)


def message_consumed(run: Any, *, name: str, message: int, **at: Any) -> Event:
    return new(run, EventKind.MESSAGE_CONSUMED, data={"name": name, "message": message}, **at)


def approval_requested(run: Any, *, name: str, payload_bytes: int, **at: Any) -> Event:
    data = {"name": name, "payload_bytes": payload_bytes}
    return new(run, EventKind.APPROVAL_REQUESTED, data=data, **at)


def alarm(run: Any, *, why: str, **at: Any) -> Event:
    return new(run, EventKind.ALARM, reason=why, **at)


def commit_failed(run: Any, *, failed_commits: int, **at: Any) -> Event:
    return new(run, EventKind.COMMIT_FAILED, data={"failed_commits": failed_commits}, **at)


def commit_latency(run: Any, *, commit_us: int, **at: Any) -> Event:
    """The latency of an execution's last commit, which no later checkpoint event carries."""
    return new(run, EventKind.COMMIT_LATENCY, commit_us=commit_us, **at)


# --- retention --------------------------------------------------------------------------------


def legal_hold(run: Run, *, by: str, reason: str, on: bool) -> Event:
    return new(run, EventKind.HOLD, by=by, reason=reason, data={"hold": on})


def compacted(run: Run, *, removed: int) -> Event:
    return new(run, EventKind.COMPACTED, by="retention", data={"removed": removed})
