"""Around one execution's claim: its trace (linked to the execution it recovered from, whose
span it writes when that one died with it open), and the runs it tells when it cannot start
(a hand-back just made) or when it ends (a parent waiting on it, a run waiting for a slot).
"""

from __future__ import annotations

import logging
from typing import Any

from durability import dispatch, leases, telemetry
from durability.models import Event, EventKind, Run, RunStatus
from durability.store import reconnect

log = logging.getLogger(__name__)

DB_DOWN = reconnect.DB_DOWN


BUSY_RETRY_SECONDS = 0.5
BUSY_RING_WINDOW_SECONDS = 2.0


def ring_again_if_handed_back(run_id: Any) -> None:
    """The run's lock is held, yet nobody holds its lease: the worker that had it handed it
    back (a yielded slice, a retry) and rang before letting go of the lock. Dropping this
    delivery would leave the run to the sweeper's next ring, seconds later; ring again in
    a moment instead, for a couple of seconds at most. (A worker claiming it right now
    takes the next delivery as a duplicate.)"""
    try:
        # Only just after a hand-back (which sets rung_at): a lock that stays held after
        # that is the sweeper's to deal with, not a reason to ring on and on.
        handed_back = Run.objects.filter(
            pk=run_id,
            status=RunStatus.QUEUED,
            lease_owner="",
            rung_at__gte=leases.db_now_plus(-BUSY_RING_WINDOW_SECONDS),
        ).exists()
    except DB_DOWN:
        reconnect.drop()
        return
    if handed_back:
        dispatch.ring(run_id, delay=BUSY_RETRY_SECONDS)


def free_slot(agent: str) -> None:
    from durability.limits import next_in_line

    try:
        waiting = next_in_line(agent)
    except DB_DOWN:
        reconnect.drop()  # the parked run's wake_at brings it back anyway
        return
    if waiting is not None:
        dispatch.ring(waiting)


def tell_parent(run_id: Any) -> None:
    from durability.operations import wake_parent

    try:
        wake_parent(Run.objects.get(pk=run_id))
    except DB_DOWN:
        reconnect.drop()  # the sweeper delivers the wake-up instead


def trace_claim(claim: leases.Claim, span: Any) -> None:
    """Remember this execution's span on the run (the next execution links to it) and
    record a recovery's figures."""
    if span is None:
        return
    Run.objects.filter(pk=claim.run.id, lease_token=claim.token).update(
        trace_exec=telemetry.current_traceparent()
    )
    if claim.recovered:
        try:
            stand_in_for_the_lost_execution(claim)
        except Exception:  # a span is never worth a recovery
            log.warning("could not write the lost execution's span", exc_info=True)
        telemetry.note("recovered", recovery_ms=claim.recovery_ms, work_lost_ms=claim.work_lost_ms)
        telemetry.count("recoveries", agent=claim.run.agent)
        if claim.recovery_ms is not None:
            telemetry.observe("recovery_duration", claim.recovery_ms / 1000)
        if claim.work_lost_ms is not None:
            telemetry.observe("work_lost", claim.work_lost_ms / 1000)


def stand_in_for_the_lost_execution(claim: leases.Claim) -> None:
    """The execution this claim recovered from died with its span unended: write it, from
    that execution's claim to its last sign of life."""
    previous = (
        Event.objects.filter(run_id=claim.run.id, kind=EventKind.CLAIMED)
        .order_by("-id")
        .values_list("created_at", "worker")[1:2]
    )
    row = next(iter(previous), None)
    if row is None or not claim.run.trace_exec:
        return
    started, worker = row
    ended = claim.lost_at or started
    telemetry.lost_execution(
        claim.run,
        claim.run.trace_exec,
        worker=worker,
        attempt=claim.attempts - 1,
        started_ns=int(started.timestamp() * 1e9),
        ended_ns=int(ended.timestamp() * 1e9),
    )
