"""The sweeper: PostgreSQL is the truth and the broker only a doorbell, so something must
find the runs the broker forgot. Run periodically (Celery beat) and once at worker start.

1. Runs marked running whose process is gone (nobody holds their liveness lock, and a
   session lost to a database restart cannot explain it) or whose lease expired are put
   back in the queue. The statement that does it checks that again, and is fenced on the
   token that was read: a run claimed since the sweep decided is never touched.
2. Durable timers that are due are queued.
3. Runs queued and unclaimed for longer than ``DURABILITY_REQUEUE_SECONDS`` (a message lost
   with a Redis restart, a worker SIGKILLed with its message unacked) are rung again.

Every change is a conditional UPDATE, so several sweepers at once are harmless; rows are
picked with ``SKIP LOCKED``. A session is ended only when its holder is proven stalled, in
the statement that ends it (``leases.end_stalled_holders``). Sweeps run on a queue of their
own (beat's housekeeping), never behind run executions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, OperationalError, transaction
from django.db.models import Q
from django.db.models.functions import Coalesce, Now

from durability import dispatch, events, leases, lifecycle
from durability.conf import conf
from durability.models import TIMED_WAITS, Run, RunStatus, WaitReason
from durability.runtime.faults import fault
from durability.store import store

log = logging.getLogger(__name__)


@dataclass
class SweepReport:
    recovered: list[str] = field(default_factory=list)
    timers: list[str] = field(default_factory=list)
    rung: list[str] = field(default_factory=list)
    approvals: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.recovered or self.timers or self.rung or self.approvals)


def _db_now() -> Any:
    return store().now()


def sweep(limit: int = 500) -> SweepReport:
    report = SweepReport()
    _recover_dead(report, limit)
    _wake_timers(report, limit)
    _wake_parents(report, limit)
    _wake_resolved_doubts(report, limit)
    _expire_approvals(report, limit)
    _ring_forgotten(report, limit)
    if report:
        log.info(
            "sweep: %d recovered, %d timers due, %d rung again",
            len(report.recovered),
            len(report.timers),
            len(report.rung),
        )
    return report


def _recover_dead(report: SweepReport, limit: int) -> None:
    # Read the runs first and the locks second: a claim takes its lock before its UPDATE,
    # so every lease seen here that still has a live owner shows in the lock table read next.
    # Only claims older than this decision are candidates; the UPDATE below checks again.
    decision = _db_now()
    running = list(
        Run.objects.filter(status=RunStatus.RUNNING, claimed_at__lt=decision).values_list(
            "id", "lease_token", "lease_expires_at", "lease_owner", "heartbeat_at"
        )[:limit]
    )
    if not running:
        return
    holders = leases.lock_holders([r[0] for r in running])
    dead = []
    for run_id, token, expires, owner, heartbeat in running:
        gone = str(run_id) not in holders
        expired = expires is not None and expires < decision
        if gone or expired:
            dead.append(
                (run_id, token, owner, heartbeat, "process gone" if gone else "lease expired")
            )
    for run_id, token, owner, heartbeat, why in dead:
        fault("sweep", run=run_id)
        try:
            requeued = _requeue(run_id, token, owner, heartbeat, why, decision)
        except OperationalError:
            # Its row is locked by a transaction that does not end: a worker stalled inside
            # one. The next sweep tries again, and the server ends such sessions if
            # idle_in_transaction_session_timeout is set.
            log.warning("run %s: its row stays locked; retried at the next sweep", run_id)
            requeued = False
        if why == "lease expired":
            # Its lock is held still: end the holder's session if it is stalled, or every
            # worker the run is sent to would find it locked.
            _end_stalled([(run_id, token + 1 if requeued else token)])
        if requeued:
            report.recovered.append(str(run_id))


def _requeue(run_id: Any, token: int, owner: str, heartbeat: Any, why: str, decision: Any) -> bool:
    with transaction.atomic():
        store().lock_timeout(2.0)  # never wait long on a stalled row lock
        dead = Q(claimed_at__lt=decision) & leases.proven_dead(run_id, why)
        lost = Coalesce("heartbeat_at", "claimed_at")
        seen = Now() if why == "process gone" else None  # ``Run.lost_seen_at``
        if not lifecycle.requeue(run_id, token, dead, lost_heartbeat_at=lost, lost_seen_at=seen):
            # It moved on meanwhile (claimed, finished, another sweeper), or its holder is
            # not proven gone: the database restarted a moment ago, and a live holder takes
            # its lock back as soon as it reconnects.
            return False
        events.record(events.lease_lost(run_id, worker=owner, why=why, heartbeat=heartbeat))
        dispatch.ring(run_id)
    return True


def _end_stalled(runs: list[tuple[Any, int]]) -> None:
    """Runs (with the token the sweep saw) whose lock is held although they are queued and
    unclaimed, or their lease expired: end the sessions of the holders proven stalled."""
    try:
        ended = leases.end_stalled_holders(runs)
    except DatabaseError:
        log.warning("could not end the sessions of stalled workers", exc_info=True)
        return
    if ended:
        log.warning("ended the sessions of %d stalled worker(s)", ended)


def _pick(query: Q, limit: int) -> list:
    return list(
        Run.objects.select_for_update(skip_locked=True)
        .filter(query)
        .values_list("id", flat=True)[:limit]
    )


def _wake_timers(report: SweepReport, limit: int) -> None:
    with transaction.atomic():
        due = _pick(
            Q(status=RunStatus.WAITING, wait_reason__in=TIMED_WAITS, wake_at__lte=Now()), limit
        )
        for run_id in due:
            dispatch.wake(run_id)
    report.timers.extend(str(r) for r in due)


def _wake_parents(report: SweepReport, limit: int) -> None:
    """Parents waiting on child runs, one of which finished since the parent suspended: the
    wake-up that a worker dying right after its child's last commit never delivered. The
    parent's step checks what it joined again (it may have joined only some of them) and
    suspends anew if it must wait on."""
    from durability.models import FINISHED

    with transaction.atomic():
        waiting = _pick(Q(status=RunStatus.WAITING, wait_reason=WaitReason.CHILDREN), limit)
        since = dict(Run.objects.filter(pk__in=waiting).values_list("id", "updated_at"))
        done = [
            run_id
            for run_id in waiting
            if Run.objects.filter(
                parent_run_id=run_id, status__in=FINISHED, finished_at__gte=since[run_id]
            ).exists()
            or not Run.objects.filter(parent_run_id=run_id).exclude(status__in=FINISHED).exists()
        ]
        for run_id in done:
            dispatch.wake(run_id)
    report.timers.extend(str(r) for r in done)


def _wake_resolved_doubts(report: SweepReport, limit: int) -> None:
    """Runs waiting in doubt whose effects all have a known outcome now: recorded late by
    a worker that had lost the run, whose own wake-up did not get through."""
    from durability.models import Effect, EffectStatus

    with transaction.atomic():
        waiting = _pick(Q(status=RunStatus.WAITING, wait_reason=WaitReason.IN_DOUBT), limit)
        unknown = set(
            Effect.objects.filter(
                run_id__in=waiting, status__in=(EffectStatus.IN_DOUBT, EffectStatus.PENDING)
            ).values_list("run_id", flat=True)
        )
        known = [run_id for run_id in waiting if run_id not in unknown]
        for run_id in known:
            dispatch.wake(run_id)
    report.timers.extend(str(r) for r in known)


def _expire_approvals(report: SweepReport, limit: int) -> None:
    from durability.operations import expire_approvals

    report.approvals.extend(expire_approvals(limit))


def _ring_forgotten(report: SweepReport, limit: int) -> None:
    quiet = conf.REQUEUE_SECONDS
    with transaction.atomic():
        forgotten = list(
            Run.objects.select_for_update(skip_locked=True)
            .filter(
                Q(status=RunStatus.QUEUED)
                & (Q(wake_at__isnull=True) | Q(wake_at__lte=Now()))
                & (Q(rung_at__isnull=True) | Q(rung_at__lt=leases.db_now_plus(-quiet)))
            )
            .values_list("id", "lease_token")[:limit]
        )
        if not forgotten:
            return
        Run.objects.filter(pk__in=[run_id for run_id, _ in forgotten]).update(rung_at=Now())
        for run_id, _ in forgotten:
            dispatch.ring(run_id)  # once this commits: a claim never waits on these rows
    report.rung.extend(str(run_id) for run_id, _ in forgotten)
    # Queued and unclaimed this long, yet locked: a claim takes the lock and the lease within
    # moments, so a holder whose session has been idle since is stalled (an ending that failed
    # at recovery, or a worker that stopped between the two). Every delivery would find it
    # locked until it goes. A worker that took the message just now is left alone: the
    # statement that ends a session checks the run is still unclaimed at the token read here
    # and the holder idle, at that very moment.
    held = leases.lock_holders([run_id for run_id, _ in forgotten])
    if held:
        _end_stalled([(run_id, token) for run_id, token in forgotten if str(run_id) in held])
