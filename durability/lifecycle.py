"""A run's state machine: every change of a run's status goes through this module.

``TRANSITIONS``, just below, is all of it: each operation names the statuses it applies to
and the status it leads to; nothing else changes a run's status. Start and fork create a run
queued (or, a fork at a checkpoint with no next step, succeeded: ``first_fields``).

Each operation is one conditional UPDATE through ``Run.objects``: its WHERE clause names
the statuses the table allows and, for a worker or an operator, the fencing token the caller
holds (``lease_token``), so a worker that lost its lease changes nothing (False). A caller
whose token still matches but whose run is in a status the table does not allow the
operation from gets ``TransitionNotAllowed`` (DUR114), and nothing is changed. Operator
transitions (resume, cancel, hold, restart, end) and the sweeper's requeue advance the token,
fencing out any worker still executing the run.

Three operations are conditional by nature: ``wake`` and ``park`` hold no token, and
``requeue`` holds only the one the sweeper read (so are the ``graph_*`` reports of a LangGraph
graph executed in its own process, which no worker ever holds). Each acts on a run still as
its caller saw it; a run that moved on meanwhile (woken already, claimed, finished) is no
error: they return False and change nothing.

``claim`` (``leases.claim``), the step commit (``checkpoints``, ``checkpoint`` and
``succeed`` in one statement) and, on PostgreSQL, a LangGraph graph's reports with their
events (``store.lg_sql.report``) are written where they are for speed; they take their
statuses and fields from here (``claimed``, ``after_step``, ``graph_change``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import F, Q
from django.db.models.functions import Coalesce, Now

from durability.errors import Stale, TransitionNotAllowed
from durability.models import Run, RunStatus, WaitReason

QUEUED, RUNNING, WAITING = RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING
SUCCEEDED, FAILED, CANCELLED = RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED
ANY = frozenset(RunStatus.values)


@dataclass(frozen=True)
class Transition:
    sources: frozenset[str]
    target: str


def _t(sources: Any, target: str) -> Transition:
    return Transition(frozenset(sources), target)


# fmt: off
TRANSITIONS: dict[str, Transition] = {
    # operation   from                               to          when
    "claim":      _t({QUEUED, WAITING, RUNNING},     RUNNING),   # a worker takes the lease
    "checkpoint": _t({RUNNING},                      RUNNING),   # a step commits, goes on
    "park":       _t({QUEUED},                       QUEUED),    # no slot or able worker yet
    "suspend":    _t({RUNNING},                      WAITING),   # approval, message, timer...
    "release":    _t({RUNNING},                      QUEUED),    # handed back: slice, retry
    "requeue":    _t({RUNNING},                      QUEUED),    # the sweeper: worker gone
    "wake":       _t({WAITING},                      QUEUED),    # what it waited for came
    "resume":     _t({FAILED, CANCELLED, WAITING},   QUEUED),    # an operator continues it
    "succeed":    _t({RUNNING},                      SUCCEEDED), # its last step committed
    "fail":       _t({RUNNING},                      FAILED),    # a step failed for good
    "cancel":     _t({QUEUED, RUNNING, WAITING},     CANCELLED), # an operator stops it
    "hold":       _t(ANY,                            WAITING),   # rolled back, on hold
    "restart":    _t(ANY,                            QUEUED),    # rolled back and continued
    "end":        _t(ANY,                            SUCCEEDED), # rolled back to the end
    # A LangGraph graph executed in its own process (durability.langgraph.status) reports
    # what its latest checkpoint says: no worker holds such a run, so never running/queued.
    "graph_waits":  _t({WAITING, SUCCEEDED, FAILED}, WAITING),   # mid-run or interrupted
    "graph_ended":  _t({WAITING, FAILED},            SUCCEEDED), # no next task: at its end
    "graph_failed": _t({WAITING, FAILED},            FAILED),    # a node raised (again)
}
# fmt: on

# Every (from, to) pair some operation allows.
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    (source, t.target) for t in TRANSITIONS.values() for source in t.sources
)

# What giving the lease back clears.
_UNLEASED: dict[str, Any] = {"lease_owner": "", "lease_expires_at": None}


def _apply(
    op: str,
    run_id: Any,
    *,
    token: int | None = None,
    bump: bool = False,
    touch: bool = True,
    where: Q | None = None,
    **fields: Any,
) -> bool:
    """The one conditional UPDATE every operation is. With a ``token``: a run still held
    with it but in a status ``op`` does not apply to raises, changing nothing."""
    transition = TRANSITIONS[op]
    rows = Run.objects.filter(pk=run_id, status__in=transition.sources)
    if token is not None:
        rows = rows.filter(lease_token=token)
    if where is not None:
        rows = rows.filter(where)
    if bump:
        fields["lease_token"] = F("lease_token") + 1
    if touch:
        fields.setdefault("updated_at", Now())
    if rows.update(status=transition.target, **fields):
        return True
    if token is not None:
        _refuse_if_not_allowed(op, run_id, token)
    return False


def _refuse_if_not_allowed(op: str, run_id: Any, token: int) -> None:
    status = Run.objects.filter(pk=run_id, lease_token=token).values_list("status", flat=True)
    current = status.first()
    sources = TRANSITIONS[op].sources
    if current is not None and current not in sources:
        raise TransitionNotAllowed(
            f"a {current} run cannot {op}: that applies only to a run"
            f" {' or '.join(sorted(sources))}; nothing was changed",
            run_id=run_id,
        )


# --- new runs, and the two hot paths written elsewhere ---------------------------------------


def first_fields(next_step: str) -> dict[str, Any]:
    """A new run's status, and, for one that begins ended (a fork of a final checkpoint), when
    it ended: retention and the lists go by that."""
    status = QUEUED if next_step else SUCCEEDED
    return {"status": status, "finished_at": Now() if status == SUCCEEDED else None}


def claimed() -> dict[str, Any]:
    """The fields a claim (``leases.claim``) sets besides its lease."""
    return {
        "status": TRANSITIONS["claim"].target,
        "wait_reason": WaitReason.NONE,
        "wait_detail": "",
        "wake_at": None,
    }


def after_step(finished: bool) -> str:
    """The status a step commit leaves: ``succeed`` if it was the last step."""
    return TRANSITIONS["succeed" if finished else "checkpoint"].target


# --- a worker's ways out: fenced by its token ------------------------------------------------


def suspend(
    run_id: Any, token: int, reason: str, detail: str, wake_at: datetime | None = None
) -> bool:
    """The step waits; the worker gives the lease back. False if the lease is lost."""
    fields: dict[str, Any] = {"wait_reason": reason, "wait_detail": detail[:500], "attempts": 0}
    if wake_at is not None:
        fields["wake_at"] = wake_at
    return _apply("suspend", run_id, token=token, **_UNLEASED, **fields)


def release(
    run_id: Any,
    token: int,
    *,
    wait: str | None = None,
    detail: str = "",
    until: Any = None,
    **fields: Any,
) -> bool:
    """Hand the run back to the queue: at once, or ``until`` a time (waiting for ``wait``,
    saying ``detail``). False if the lease is lost."""
    if wait is not None:
        fields.update(wait_reason=wait, wait_detail=detail[:500])
    if until is not None:
        fields.update(wake_at=until, rung_at=until)
    else:
        fields["rung_at"] = Now()
    return _apply("release", run_id, token=token, attempts=0, **_UNLEASED, **fields)


def succeed(run_id: Any, token: int) -> bool:
    """The run ends well with no step of its own to end it (its head has no next step)."""
    return _apply(
        "succeed",
        run_id,
        token=token,
        finished_at=Now(),
        attempts=0,
        # No step ended it here: whatever ending was named before is not this one's.
        outcome="",
        **_UNLEASED,
    )


def fail(run_id: Any, token: int, *, error: str, code: str) -> bool:
    """The run ends with ``error`` recorded. False if the lease is lost."""
    return _apply(
        "fail",
        run_id,
        token=token,
        error=error[:10000],
        error_code=code,
        finished_at=Now(),
        attempts=0,
        outcome="",  # a run that failed ended as its status says
        wait_reason=WaitReason.NONE,
        wait_detail="",
        **_UNLEASED,
    )


# --- conditional on the status the caller saw ------------------------------------------------


def wake(run_id: Any, reason: str | None = None) -> bool:
    """A run waiting (for ``reason``, if given) goes back to the queue. False if it was not
    waiting (for that). The caller rings the doorbell (``dispatch.wake`` does both)."""
    where = Q(wait_reason=reason) if reason is not None else None
    return _apply(
        "wake", run_id, where=where, wait_reason=WaitReason.NONE, wait_detail="", rung_at=Now()
    )


def decided(run_id: Any) -> None:
    """A decision on the run's approval moves its version, as an operator's transition does
    (an action sent with the version seen before it is refused as stale), unless a worker
    executes the run: its lease is fenced with that token, and the decision reaches its step
    without taking the lease."""
    Run.objects.filter(pk=run_id).exclude(status=RunStatus.RUNNING).update(
        lease_token=F("lease_token") + 1, updated_at=Now()
    )


def park(run_id: Any, reason: str, detail: str, until: datetime) -> bool:
    """Leave a queued run queued until ``until``, saying why it does not start now."""
    return _apply(
        "park",
        run_id,
        wait_reason=reason,
        wait_detail=detail[:500],
        wake_at=until,
        rung_at=until,
        touch=False,
    )


def requeue(run_id: Any, token: int, where: Q, **fields: Any) -> bool:
    """The sweeper's: a run still running at ``token`` whose worker is proven gone (``where``)
    goes back to the queue, and the token moves on. False if it moved on meanwhile."""
    rows = Q(lease_token=token) & where
    return _apply("requeue", run_id, where=rows, bump=True, rung_at=Now(), **_UNLEASED, **fields)


# --- a LangGraph graph executed in its own process: conditional on what is stored --------------


class At(enum.Enum):
    """A time a graph's report sets: the database's now, or now unless one is set already."""

    NOW = "now"
    FIRST = "first"


@dataclass(frozen=True)
class GraphChange:
    """A report of a graph executed in its own process as data: its operation, the fields
    it sets besides the status (values, or ``At``), and the fields that, all as said here
    already, make it change nothing. ``apply_graph`` applies one through ``Run.objects``;
    the LangGraph saver's store sends it, with its event, as one statement."""

    op: str
    fields: dict[str, Any]
    unless: dict[str, Any]


def graph_change(
    op: str,
    *,
    detail: str = "",
    error: str = "",
    code: str = "",
    wait: str = WaitReason.GRAPH,
) -> GraphChange:
    """``graph_waits``: the graph's latest checkpoint has tasks still to run (it is running in
    its process, or stopped there: ``wait`` is ``WaitReason.GRAPH``) or an interrupt waiting
    for an answer (``WaitReason.INTERRUPT``); ``detail`` says what. ``graph_ended``: it has
    no task to run, the graph reached its end (invoking it again on the thread makes it wait
    again). ``graph_failed``: a node raised, ``error`` is what LangGraph stored beside the
    checkpoint; on a failed run too (a graph taken up again where it failed, failing again:
    the run says its latest error), unless it is the same error."""
    cleared = {"wait_reason": WaitReason.NONE, "error": "", "error_code": "", "updated_at": At.NOW}
    if op == "graph_waits":
        detail = detail[:500]
        fields = {
            **cleared,
            "wait_reason": wait,
            "wait_detail": detail,
            "wake_at": None,
            "finished_at": None,
            "outcome": "",
            "started_at": At.FIRST,  # the graph's first invocation
        }
        unless = {"status": WAITING, "wait_reason": wait, "wait_detail": detail}
        return GraphChange(op, fields, unless)
    if op == "graph_ended":
        return GraphChange(op, {**cleared, "wait_detail": "", "finished_at": At.NOW}, {})
    if op == "graph_failed":
        fields = {
            **cleared,
            "wait_detail": "",
            "error": error[:10000],
            "error_code": code,
            "finished_at": At.NOW,
        }
        return GraphChange(op, fields, {"status": FAILED, "error": error[:10000]})
    raise ValueError(f"not a graph's report: {op!r}")


def apply_graph(run_id: Any, change: GraphChange) -> bool:
    """``change`` on the run. False if the run already said so, or is not a graph's run in
    a status its operation applies to."""
    fields: dict[str, Any] = {
        name: Now() if value is At.NOW else Coalesce(name, Now()) if value is At.FIRST else value
        for name, value in change.fields.items()
    }
    where = ~Q(**change.unless) if change.unless else None
    return _apply(change.op, run_id, where=where, **fields)


# --- an operator's, on a run whose row the caller has locked ------------------------------


def _operator(op: str, run: Run, **fields: Any) -> None:
    """Fenced on the token read under the lock, which moves on. The caller checked the
    status in words of its own, so a refusal here means a check was left out; a token that
    moved on means the caller read the run without its lock."""
    if not _apply(op, run.pk, token=run.lease_token, bump=True, **_UNLEASED, **fields):
        raise Stale(
            f"the run moved on from version {run.lease_token} before it could {op};"
            " nothing was changed",
            run_id=run.pk,
        )
    run.refresh_from_db()


def resume(run: Run) -> None:
    """Queue a failed, cancelled or held run again from its head."""
    _operator(
        "resume",
        run,
        wait_reason=WaitReason.NONE,
        wait_detail="",
        wake_at=None,
        error="",
        error_code="",
        outcome="",  # it has not ended: no ending is its outcome
        finished_at=None,
        attempts=0,
        retries=0,
        rung_at=Now(),
    )


def cancel(run: Run) -> None:
    """Stop the run for good; a worker executing it is fenced out at its next write."""
    _operator(
        "cancel",
        run,
        wait_reason=WaitReason.NONE,
        wait_detail="",
        wake_at=None,
        finished_at=Now(),
    )


def roll_back(run: Run, *, seq: int, step: str, held: bool, detail: str) -> None:
    """Move the head to checkpoint ``seq`` (made by the rollback): ``end`` if it has no
    next ``step``, else ``hold`` (waiting for an operator, saying ``detail``) or
    ``restart``."""
    finished = not step
    op = "end" if finished else ("hold" if held else "restart")
    # A run taken back before its ending has no outcome until it ends again.
    ending = {} if finished else {"outcome": ""}
    _operator(
        op,
        run,
        **ending,
        head_seq=seq,
        step=step,
        wait_reason=WaitReason.HOLD if op == "hold" else WaitReason.NONE,
        wait_detail=detail if op == "hold" else "",
        wake_at=None,
        error="",
        error_code="",
        attempts=0,
        retries=0,
        finished_at=Now() if finished else None,
        rung_at=Now(),
    )


__all__ = [
    "ALLOWED",
    "TRANSITIONS",
    "At",
    "GraphChange",
    "Transition",
    "after_step",
    "apply_graph",
    "cancel",
    "claimed",
    "fail",
    "first_fields",
    "graph_change",
    "park",
    "release",
    "requeue",
    "resume",
    "roll_back",
    "succeed",
    "suspend",
    "wake",
]
