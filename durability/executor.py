"""Executing a run: claim it, rehydrate its head, run steps and checkpoint after each.

The worker keeps two copies of the state: ``live``, which the steps mutate, and
``pristine``, the last committed state. After a step the structural diff of the two is the
checkpoint's patch; applying a copy of that patch to ``pristine`` brings it forward without
re-parsing the whole state, and its canonical bytes are checked against ``live``'s (the
fast diff treats 1 == 1.0 == True; on a mismatch the exact diff is used). A failed attempt
never leaks: the next one starts from the committed bytes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from django.conf import settings
from django.db import (
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connection,
    transaction,
)
from django.db.models import F
from django.utils import timezone

from durability import (
    blobs,
    canonical,
    checkpoints,
    diff,
    dispatch,
    events,
    leases,
    lifecycle,
    telemetry,
)
from durability.agents import Agent, Ending, registry
from durability.checkpoints import Head, SnapshotWriter, StepCommit
from durability.context import Context, Records, Suspension, WhatIf
from durability.errors import (
    Abandon,
    DurabilityError,
    FencedOut,
    IncompatibleVersion,
    IntegrityViolation,
    LeaseLost,
    PoisonStep,
    RetriesExhausted,
    StateNotJSON,
    StateTooLarge,
    StepError,
    StepTimeout,
    Suspend,
    UnknownAgent,
)
from durability.faults import fault
from durability.models import (
    Checkpoint,
    Durability,
    Event,
    EventKind,
    Run,
    RunStatus,
    WaitReason,
)
from durability.redact import contains_secret, is_secret_key, redact
from durability.redact import scope as secrets_scope

log = logging.getLogger(__name__)

DB_DOWN = (OperationalError, InterfaceError)


_AGAIN = object()  # run the same step again from its base (see Execution._attempt)


@dataclass
class InFlight:
    """A step's commit, sent; its answer not taken yet."""

    commit: StepCommit
    seq: int
    sent_at: float
    span: Any
    snapshot_bytes: bytes | None  # a snapshot to write off the hot path once its id is known
    # When the worker first saw the answer in (polled at the next step's start): the commit's
    # latency ends there, not when the worker got round to taking it.
    answered_at: float | None = None
    interrupted: bool = False


class Outcome(StrEnum):
    BUSY = "busy"  # another live process holds the run
    SKIPPED = "skipped"  # not runnable now (finished, waiting, not due)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SUSPENDED = "suspended"
    RETRY = "retry"
    YIELDED = "yielded"  # handed back to the queue (time slice, shutdown)
    LOST = "lost"  # the lease went to someone else


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def execute(
    run_id: Any,
    *,
    worker: str | None = None,
    should_stop: Callable[[], bool] | None = None,
    slice_seconds: float | None = None,
) -> Outcome:
    """Run ``run_id`` on this process until it finishes, waits, fails, or yields.

    Safe to call for any run at any time: a delivery for a run that is finished, waiting,
    or leased by a live worker is answered ``SKIPPED``/``BUSY`` without running anything.
    """
    worker = worker or worker_name()
    keeper = leases.LeaseKeeper(run_id, worker)
    if not keeper.acquire():
        keeper.stop()
        _ring_again_if_handed_back(run_id)
        return Outcome.BUSY
    try:
        claim = leases.claim(run_id, worker, owner_dead=True, holder=keeper.pid)
        if claim is None:
            return Outcome.SKIPPED
        keeper.start(claim.token)
        if slice_seconds is None:
            slice_seconds = float(getattr(settings, "DURABILITY_SLICE_SECONDS", 60.0))
        execution = Execution(claim, keeper, worker, should_stop or _never, slice_seconds)
        # Whatever this execution writes, wherever, passes the redaction gate with the
        # secrets its steps read (durability/redact.py); its span ends inside the scope too.
        with (
            secrets_scope(execution.secrets),
            telemetry.execution(claim.run, worker, claim.run.trace_exec) as span,
        ):
            _trace_claim(claim, span)
            try:
                outcome = execution.run()
            finally:
                execution.close()
            telemetry.set_attributes(span, **{"durability.outcome": str(outcome)})
            if outcome == Outcome.FAILED:
                telemetry.failed(span, execution.failure or "failed")
            if outcome in (Outcome.SUCCEEDED, Outcome.FAILED):
                telemetry.count("runs_finished", status=str(outcome), agent=claim.run.agent)
                if claim.run.parent_run_id:
                    _tell_parent(claim.run.id)
            if leases.concurrency_limit(claim.run.agent):
                _free_slot(claim.run.agent)
            return outcome
    finally:
        keeper.stop()


def _drop_session_cut_short() -> None:
    """``Abandon`` (a signal) raised while a query of the step waited for its answer leaves
    Django's session busy with that query: psycopg cancels it only on KeyboardInterrupt and
    SystemExit, and every later statement would fail with "another command is already in
    progress". Cancel it on the server and close the session; the next use opens a new one."""
    raw = connection.connection
    if raw is None or connection.vendor != "postgresql":
        return
    from psycopg import pq

    if raw.pgconn.transaction_status != pq.TransactionStatus.ACTIVE:
        return
    try:
        raw.cancel_safe(timeout=2.0)
    except Exception as exc:  # the close below ends the session either way
        log.warning("could not cancel the query a shutdown cut short: %s", exc)
    connection.close()


BUSY_RETRY_SECONDS = 0.5
BUSY_RING_WINDOW_SECONDS = 2.0


def _ring_again_if_handed_back(run_id: Any) -> None:
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
        connection.close()
        return
    if handed_back:
        dispatch.ring(run_id, delay=BUSY_RETRY_SECONDS)


def _free_slot(agent: str) -> None:
    from durability.limits import next_in_line

    try:
        waiting = next_in_line(agent)
    except DB_DOWN:
        connection.close()  # the parked run's wake_at brings it back anyway
        return
    if waiting is not None:
        dispatch.ring(waiting)


def _tell_parent(run_id: Any) -> None:
    from durability.operations import wake_parent

    try:
        wake_parent(Run.objects.get(pk=run_id))
    except DB_DOWN:
        connection.close()  # the sweeper delivers the wake-up instead


def _trace_claim(claim: leases.Claim, span: Any) -> None:
    """Remember this execution's span on the run (the next execution links to it) and
    record a recovery's figures."""
    if span is None:
        return
    Run.objects.filter(pk=claim.run.id, lease_token=claim.token).update(
        trace_exec=telemetry.current_traceparent()
    )
    if claim.recovered:
        try:
            _stand_in_for_the_lost_execution(claim)
        except Exception:  # a span is never worth a recovery
            log.warning("could not write the lost execution's span", exc_info=True)
        telemetry.note("recovered", recovery_ms=claim.recovery_ms, work_lost_ms=claim.work_lost_ms)
        telemetry.count("recoveries", agent=claim.run.agent)
        if claim.recovery_ms is not None:
            telemetry.observe("recovery_duration", claim.recovery_ms / 1000)
        if claim.work_lost_ms is not None:
            telemetry.observe("work_lost", claim.work_lost_ms / 1000)


def _stand_in_for_the_lost_execution(claim: leases.Claim) -> None:
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


def _never() -> bool:
    return False


@contextmanager
def step_deadline(seconds: float | None, step: str) -> Iterator[None]:
    """Raise ``StepTimeout`` in the step after ``seconds`` (main thread only: signals)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise StepTimeout(f"step {step!r} ran past its {seconds:g} s timeout")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def _timeout_paused() -> Iterator[None]:
    """Stop the step's timer (``step_deadline``) for the duration, then let it go on with
    the time it had left."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        yield
    finally:
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, left)


class Execution:
    def __init__(
        self,
        claim: leases.Claim,
        keeper: leases.LeaseKeeper,
        worker: str,
        should_stop: Callable[[], bool],
        slice_seconds: float,
    ) -> None:
        self.row = claim.run
        self.run_id = claim.run.id
        self.token = claim.token
        self.attempts = claim.attempts
        self.retries = claim.run.retries
        self.keeper = keeper
        self.worker = worker
        self.should_stop = should_stop
        self.deadline = time.monotonic() + slice_seconds
        self.snapshots = SnapshotWriter()
        self.secrets: set[str] = set()
        self.prev_commit_us: int | None = None
        self.latency_unreported = False
        self.latency_seq: int | None = None  # the checkpoint prev_commit_us is the latency of
        self.commits_uncounted = 0
        self.failed_commits = 0
        self.max_state = int(getattr(settings, "DURABILITY_MAX_STATE_BYTES", 16 << 20))
        self.agent: Agent | None = None
        self.head: Head | None = None
        self.data = b""
        self.pristine: Any = None
        self.live: Any = None
        self.input: Any = None
        # The bytes each step attempt starts from: the committed state, or its upgrade.
        self.start_bytes = b""
        self.upgraded_from: int | None = None
        self.db_errors = 0
        self.failure: str = ""
        # Calls answered from the journal since the last event that ends a step (id -> key),
        # written into that event; and the outcome the run's last step named.
        self.replayed: dict[int, str] = {}
        self.ending = ""
        # The previous step's commit, sent and not answered yet (see _settle).
        self.inflight: InFlight | None = None
        row = claim.run
        self.fingerprint: tuple[str, str] = ("", "")
        self.pc = ""
        self.base_id, self.base_seq = 0, 0
        self.identity = 0  # bumped with each new base (whose id may not be known yet)
        self.counters = {}
        self.step_start_counters: dict = {}
        self.pending = 0
        self.period_started = time.monotonic()
        self.boundary_bytes = b""
        self.boundary_step = ""
        self.what_if = (
            WhatIf(row.id, row.forked_from_id, row.forked_from_seq or 0, row.what_if_live)
            if row.what_if and row.forked_from_id
            else None
        )

    def close(self) -> None:
        if self.inflight is not None:
            try:
                self._settle()
            except (Exception, LeaseLost) as exc:
                # The outcome is decided; a commit that failed wrote nothing.
                log.warning("run %s: the last commit sent ahead did not land: %s", self.run_id, exc)
        if self.agent is not None:
            telemetry.commits_made(self.agent.name, self.commits_uncounted)
            self.commits_uncounted = 0
        self.snapshots.close()
        if self.latency_unreported and self.prev_commit_us is not None:
            try:
                Event.objects.create(
                    run_id=self.run_id,
                    kind=EventKind.COMMIT_LATENCY,
                    # Not the head's: a last commit that failed is the head in memory.
                    seq=self.latency_seq,
                    worker=self.worker,
                    commit_us=self.prev_commit_us,
                )
            except DB_DOWN:
                connection.close()
            except IntegrityError:  # the run was deleted under us: nothing left to report on
                pass

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        try:
            self.agent = registry.get(self.row.agent)
        except UnknownAgent:
            # A worker from another deploy (without this agent): not this one's to run, nor
            # to fail. Hand it back; a worker that has the agent takes it.
            return self._wait_for_version(
                IncompatibleVersion(
                    f"worker {self.worker} has no agent {self.row.agent!r}", run_id=self.run_id
                )
            )
        poison = int(getattr(settings, "DURABILITY_POISON_ATTEMPTS", 5))
        if self.attempts > poison:
            return self._fail(
                PoisonStep(
                    f"step {self.row.step!r} was claimed {self.attempts - 1} times in a row"
                    " and each time its worker died before finishing it; not trying again",
                    run_id=self.run_id,
                )
            )
        self.fingerprint = self.agent.fingerprint()
        fault("claimed", run=self.run_id, step=self.row.step, seq=self.row.head_seq)
        try:
            self._rehydrate()
        except IncompatibleVersion as exc:
            return self._wait_for_version(exc)
        except IntegrityViolation as exc:
            return self._fail(exc, integrity=True)
        except DurabilityError as exc:
            return self._fail(exc)
        records = Records.load(self.base_id, self.run_id)
        while True:
            step = self.pc
            if not step:
                return self._finish_without_step()
            if self.keeper.lost.is_set():
                return Outcome.LOST
            if self.should_stop() or time.monotonic() > self.deadline:
                if (lost := self._settle_for_exit()) is not None:
                    return lost
                if self.pending:
                    # Between steps, the live state is the period's: keep it before leaving.
                    try:
                        self._commit(self.boundary_step, self.pc)
                    except (FencedOut, LeaseLost):
                        return Outcome.LOST
                    self._new_identity(self.head.id, self.head.seq)
                return self._yield()
            fn = self.agent.steps.get(step)
            if fn is None:
                if (lost := self._settle_for_exit()) is not None:
                    return lost
                return self._fail(
                    StepError(
                        f"agent {self.agent.name}@{self.agent.version} has no step {step!r}",
                        run_id=self.run_id,
                    )
                )
            self.step_start_counters = dict(self.counters)
            ctx = Context(
                run_id=self.run_id,
                agent=self.agent,
                step=step,
                base_id=self.base_id,
                base_seq=self.base_seq,
                token=self.token,
                worker=self.worker,
                input=self.input,
                attempt=self.attempts,
                retry=self.retries,
                records=records,
                what_if=self.what_if,
                occurrences=self.counters,
                before_durable=self._flush_period if self.periodic else None,
                settle=self._settled_base if self.inflight is not None else None,
            )
            ctx.secrets = self.secrets
            fault("before_step", run=self.run_id, step=step, seq=self.head.seq)
            try:
                self._poll_answer()
            except Abandon:
                return self._settle_for_exit() or self._yield()
            identity_before = self.identity
            with telemetry.step(step, self.head.seq, self.attempts) as span:
                outcome = self._attempt(step, fn, ctx, span)
            if outcome is _AGAIN:
                self.live = canonical.loads(self.start_bytes)
                self.counters.clear()
                self.counters.update(self.step_start_counters)
                records = Records.load(self.base_id, self.run_id)
                continue
            if outcome is not None:
                return outcome
            if self.identity != identity_before:
                # A new base: nothing recorded against it yet.
                records = Records.empty(records.abandoned_keys)

    @property
    def periodic(self) -> bool:
        return self.row.durability == Durability.PERIODIC

    def _new_identity(self, base_id: int | None, base_seq: int) -> None:
        """The checkpoint the next steps' operations are identified by, with fresh counters.
        (Its id is None while its commit is in flight.)"""
        self.identity += 1
        self.base_id, self.base_seq = base_id, base_seq
        self.counters: dict[tuple[str, str], int] = {}
        self.pending = 0
        self.period_started = time.monotonic()

    def _settle(self) -> None:
        """Take the answer of the commit in flight. Until it is in, the next step only
        computes: its context settles before any call, effect, suspension or write, every
        way out of the loop settles before it writes, and the next commit settles before it
        is sent (its parent is this one). So no step acts on a checkpoint that is not
        durable, and a commit that failed discards what ran ahead of it."""
        pending = self.inflight
        if pending is None:
            return
        recovered = pending.interrupted
        try:
            if pending.interrupted:
                # A signal cut the last wait short, and the channel was closed under it.
                checkpoint_id = self._recover_commit(pending.commit, failed=False)
            else:
                try:
                    checkpoint_id = checkpoints.step_answer(pending.commit)
                except FencedOut as exc:
                    log.warning("%s", exc)
                    raise
                except DB_DOWN:
                    checkpoint_id = self._recover_commit(pending.commit)
                    recovered = True
        except (FencedOut, LeaseLost, DatabaseError) as exc:
            # Answered, and not with a checkpoint: the step that ran ahead is void.
            self.inflight = None
            telemetry.end_commit(pending.span, exc)
            raise
        except BaseException:
            pending.interrupted = True
            raise
        self.inflight = None
        if recovered:
            # The answer that arrived was an error (or was never read): the commit is done
            # only now, and its latency and span run until now.
            pending.answered_at = None
            telemetry.note_recovered(pending.span)
        self._committed(pending, checkpoint_id)

    def _settle_for_exit(self) -> Outcome | None:
        """Settle where the loop ends the execution itself: LOST if the commit failed. The
        end of the shutdown grace period (``Abandon``) cutting the wait short does not skip
        the hand-back: the commit is then recovered without the channel."""
        try:
            try:
                self._settle()
            except Abandon:
                self._settle()
        except (FencedOut, LeaseLost, DatabaseError):
            return Outcome.LOST
        return None

    def _settle_before_leaving(self) -> None:
        """``_settle`` on the way out of a step that raised: a commit that failed outranks
        the step's exception, except the process's own exit, which always goes on."""
        if self.inflight is None:
            return
        leaving = sys.exc_info()[1]
        try:
            self._settle()
        except (FencedOut, LeaseLost, DatabaseError):
            if isinstance(leaving, SystemExit | KeyboardInterrupt):
                return
            raise

    def _poll_answer(self) -> None:
        """Note when the answer of the commit in flight arrived, if it has, without waiting."""
        pending = self.inflight
        if pending is None or pending.answered_at is not None or pending.interrupted:
            return
        try:
            if checkpoints.step_ready():
                pending.answered_at = time.perf_counter()
        except DB_DOWN:
            pass  # the channel is closed; settling finds out what happened
        except BaseException:
            pending.interrupted = True  # a signal: the channel was closed under the commit
            raise

    def _settled_base(self) -> int:
        """For the next step's context: settle, then the checkpoint its operations hang from.

        Raised inside the step, whatever ended the commit leaves as ``LeaseLost``: a step
        that catches ``Exception`` around a call must not carry on past its void base."""
        try:
            with _timeout_paused():  # the wait is the previous step's, not this one's
                self._settle()
        except (FencedOut, DatabaseError) as exc:
            raise LeaseLost(f"the previous step's commit failed: {exc}") from None
        if self.base_id is None:  # that commit failed, and this step's outcome with it
            raise LeaseLost("the previous step's commit did not land")
        return self.base_id

    def _committed(self, pending: InFlight, checkpoint_id: int) -> None:
        answered_at = pending.answered_at or time.perf_counter()
        self._record_latency(answered_at - pending.sent_at, pending.seq)
        telemetry.end_commit(pending.span)
        if self.head is not None and self.head.seq == pending.seq:
            self.head.id = checkpoint_id
        if self.base_id is None:
            self.base_id = checkpoint_id
        if pending.snapshot_bytes is not None:
            self.snapshots.submit(checkpoint_id, pending.commit.state_hash, pending.snapshot_bytes)
        if self.failed_commits:
            self._report_failed_commits(pending.seq)

    def _step_done(self, step: str, next_step: str) -> None:
        """A step returned: checkpoint it, or at the periodic level keep it in memory until
        the period is over (N steps, T seconds, or the run's end)."""
        if self.periodic and next_step:
            self.pending += 1
            due = self.pending >= self.agent.periodic_steps or (
                time.monotonic() - self.period_started >= self.agent.periodic_seconds
            )
            if not due:
                self.boundary_bytes = self._encode(self.live, step)
                self.boundary_step = step
                self.start_bytes = self.boundary_bytes
                self.pc = next_step
                return
        self._commit(step, next_step, ahead=bool(next_step) and not self.periodic)
        self.pc = next_step
        self._new_identity(self.head.id, self.head.seq)

    def _flush_period(self) -> None:
        """Checkpoint the steps kept in memory (the state as the previous step left it)
        before an effect, a suspension or a spawn. The interrupted step goes on under its
        base and counters, which the checkpoint records for a resumption."""
        if not self.pending:
            return
        replay = canonical.dumps(
            [[table, key, n] for (table, key), n in sorted(self.step_start_counters.items())]
        ).decode()
        current = self.live
        try:
            self.live = canonical.loads(self.boundary_bytes)
            self._commit(self.boundary_step, self.pc, replay=(self.base_id, replay))
        except FencedOut as exc:
            raise LeaseLost(str(exc), guard=exc.guard) from None
        finally:
            self.live = current
        self.pending = 0
        self.period_started = time.monotonic()

    def _attempt(self, step: str, fn: Callable, ctx: Context, span: Any) -> Any:
        """Run one step and commit it. Returns None to go on with the next step, ``_AGAIN``
        to run this step again from its base, or the outcome that ends the execution."""
        try:
            try:
                try:
                    with step_deadline(self.agent.step_timeout, step):
                        # After a rollback: the compensations its operator ticked, before
                        # the run goes on (nothing to do otherwise).
                        ctx.run_compensations()
                        returned = fn(self.live, ctx)
                finally:
                    self.replayed.update(ctx.replayed_calls)
                next_step = self.agent.successor(step, returned)
                if not next_step:
                    self.ending = returned.outcome if isinstance(returned, Ending) else ctx.ending
                self._step_done(step, next_step)
            except BaseException:
                # However this step ended, the previous step's commit is answered first: if
                # it failed, that failure is the outcome (this step only ran ahead of it).
                self._settle_before_leaving()
                raise
        except Suspend as exc:
            telemetry.note("suspended", reason=exc.suspension.reason, detail=exc.suspension.detail)
            outcome = self._suspend(exc.suspension)
            # None: the wake condition was met before we could suspend; run the step again.
            return _AGAIN if outcome is None else outcome
        except (LeaseLost, FencedOut) as exc:
            telemetry.note("lease_lost", reason=str(exc))
            return Outcome.LOST
        except Abandon:
            _drop_session_cut_short()
            return self._yield()
        except (SystemExit, KeyboardInterrupt):
            # The process is going away: hand the run back first, unless the commit in
            # flight is still unresolved (it could land after the release); then the lease
            # runs out and the sweeper hands it on.
            if self.inflight is None:
                try:
                    self._yield()
                except DatabaseError as exc:  # the exit goes on; the lease runs out instead
                    log.warning("run %s: not handed back on the way out: %s", self.run_id, exc)
            raise
        except DB_DOWN as exc:
            self.db_errors += 1
            if self.db_errors > 5:  # not an outage but an error that repeats: back off
                return self._retry(step, exc)
            if self.base_id is None:
                # The commit sent ahead failed with the database: whether it landed is for
                # the next execution to find out, from what the database holds.
                return Outcome.LOST
            if not self._wait_for_database() or not self._still_ours():
                return Outcome.LOST
            return _AGAIN
        except Exception as exc:
            telemetry.failed(span, exc)
            if self.agent.is_transient(exc):
                return self._retry(step, exc)
            return self._fail(exc)
        self.db_errors = 0
        telemetry.set_attributes(span, **{"durability.step.next": next_step or "(end)"})
        return None if next_step else Outcome.SUCCEEDED

    # --- rehydration --------------------------------------------------------------------------

    def _rehydrate(self) -> None:
        cp = Checkpoint.objects.select_related("parent").get(
            run_id=self.run_id, seq=self.row.head_seq
        )
        if not self.agent.can_continue(cp.agent_version, cp.schema_version):
            raise IncompatibleVersion(
                f"checkpoint #{cp.seq} was written by {self.agent.name}@{cp.agent_version}"
                f" (schema v{cp.schema_version}); this worker runs"
                f" {self.agent.name}@{self.agent.version} (schema v{self.agent.schema_version}),"
                " which has no upgrade from it and does not declare it compatible",
                run_id=self.run_id,
            )
        state, data, rebuilt = checkpoints.verified_state(cp)
        self.head = Head.of(cp)
        self.pc = cp.next_step
        self._new_identity(cp.id, cp.seq)
        if cp.replay_base_id is not None:
            # Forced in the middle of a period: the interrupted step keeps its identities.
            base_seq = (
                Checkpoint.objects.filter(pk=cp.replay_base_id)
                .values_list("seq", flat=True)
                .first()
            )
            self._new_identity(cp.replay_base_id, base_seq or 0)
            for table, key, n in canonical.loads(cp.replay_counters or "[]"):
                self.counters[(table, key)] = n
        self.input = canonical.loads(self.row.input)
        if rebuilt.deltas and rebuilt.bytes_read > 2 * len(data):
            # A snapshot the policy asked for was lost with its process: write it now.
            self.snapshots.submit(cp.id, cp.state_hash, data)
            self.head.delta_run = 0
        self.data = data
        self.pristine = state
        self.start_bytes = data
        if cp.schema_version != self.agent.schema_version:
            # Upgrade in memory: the next checkpoint carries the new version and is written
            # as a snapshot. Records made from this head stay valid (same base).
            upgraded = self.agent.upgrade(canonical.loads(data), cp.schema_version)
            self.agent.validate(upgraded)
            self.start_bytes = canonical.dumps(upgraded, what="upgraded state")
            self.upgraded_from = cp.schema_version
        self.live = canonical.loads(self.start_bytes)

    # --- committing -----------------------------------------------------------------------------

    def _commit(
        self,
        step: str,
        next_step: str,
        replay: tuple[int, str] | None = None,
        ahead: bool = False,
    ) -> None:
        """Checkpoint the live state. ``ahead``: send the commit and return before its
        answer, which ``_settle`` takes (the head's id is unknown until then)."""
        self._poll_answer()
        agent, head = self.agent, self.head
        live = self.live
        if not isinstance(live, dict):
            from durability.errors import SchemaViolation

            raise SchemaViolation(
                f"step {step!r} left the state as {type(live).__name__}, not a JSON object",
                run_id=self.run_id,
            )
        new_bytes = self._encode(live, step)
        ops = diff.diff(self.pristine, live)
        limit = blobs.threshold()
        if any("value" in op and blobs.needs_offload(op["value"], limit) for op in ops):
            # Large values go to the blob store before the checkpoint that refers to them,
            # and after the commit in flight: nothing leaves for a step that may be void.
            self._settle()
            blobs.offload(live, limit)
            new_bytes = self._encode(live, step)
            ops = diff.diff(self.pristine, live)
        if self._redact_changes(ops):
            redact(live, self.secrets)
            new_bytes = canonical.dumps(live, what=f"state after step {step!r}")
            ops = diff.diff(self.pristine, live)
        if self.secrets and contains_secret(new_bytes, self.secrets):
            # Only a key can still hold one: keys are not redacted, and the gate would change
            # these bytes after they were hashed.
            raise StepError(
                f"step {step!r} put a secret read with ctx.secret in a key of the state;"
                " keys are never redacted: keep secrets out of state",
                run_id=self.run_id,
            )
        if len(new_bytes) > self.max_state:
            raise StateTooLarge(
                f"state after step {step!r} is {len(new_bytes):,} bytes, over the limit of"
                f" {self.max_state:,} (DURABILITY_MAX_STATE_BYTES)",
                run_id=self.run_id,
            )
        agent.validate(live)
        ops_bytes = canonical.dumps(ops)
        pristine = diff.apply_own(self.pristine, canonical.loads(ops_bytes))
        if canonical.dumps(pristine) != new_bytes:
            # The fast walk missed a change of number type (1 -> 1.0 -> True): diff exactly.
            before = canonical.loads(self.data)
            ops = diff.diff(before, live, strict=True)
            ops_bytes = canonical.dumps(ops)
            # Proven with the function rehydration rebuilds with.
            pristine = diff.apply_own(before, canonical.loads(ops_bytes))
            if canonical.dumps(pristine) != new_bytes:  # pragma: no cover - a bug if reached
                raise IntegrityViolation(
                    f"the patch of step {step!r} does not reproduce its state",
                    run_id=self.run_id,
                )
        state_hash = canonical.patched(head.state_hash, ops_bytes)
        seq = head.seq + 1
        chain = checkpoints.link(
            head.chain_hash,
            state_hash,
            run_id=self.run_id,
            seq=seq,
            step=step,
            next_step=next_step,
            schema_version=agent.schema_version,
            agent_version=agent.version,
        )
        delta_run = head.delta_run + len(ops_bytes)
        snapshot_now = self.upgraded_from is not None or checkpoints.needs_snapshot(
            delta_run, len(new_bytes)
        )
        inline = snapshot_now and (
            self.upgraded_from is not None or len(new_bytes) <= checkpoints.INLINE_SNAPSHOT_BYTES
        )
        commit = StepCommit(
            run_id=self.run_id,
            token=self.token,
            head=head,
            worker=self.worker,
            step=step,
            next_step=next_step,
            ops_bytes=ops_bytes,
            ops_count=len(ops),
            state_hash=state_hash,
            chain_hash=chain,
            size=len(new_bytes),
            delta_run=delta_run,
            schema_version=agent.schema_version,
            agent_version=agent.version,
            commit_id=uuid.uuid4(),
            prev_commit_us=None,  # the commit in flight's, known once it is answered
            lease_seconds=leases.lease_seconds(),
            upgraded_from=self.upgraded_from,
            snapshot=new_bytes if inline else None,
            snapshot_digest=checkpoints.seal(state_hash, new_bytes) if inline else "",
            durability=self.row.durability,
            config_hash=self.fingerprint[0],
            packages=self.fingerprint[1],
            replay_base_id=replay[0] if replay else None,
            replay_counters=replay[1] if replay else "",
            outcome="" if next_step else self.ending,
            replayed=self._take_replays(),
        )
        ahead = ahead and checkpoints.can_send_ahead(commit)
        # Converted for the wire while the commit in flight is still on the server: between
        # its answer and this send, the server waits for the worker.
        bound = checkpoints.bind_step(commit) if ahead else None
        self._settle()  # the commit in flight, if any, is this one's parent
        commit.prev_commit_us = self.prev_commit_us
        if bound is not None:
            span = telemetry.start_commit(self.run_id, seq, len(new_bytes), len(ops_bytes), inline)
            sent_at = time.perf_counter()
            try:
                checkpoints.send_step(commit, bound)
            except DB_DOWN:
                # Nothing may have reached the server: the usual recovery decides, and the
                # span covers it (it ends with the commit's fate, not the send's).
                self.inflight = None
                try:
                    checkpoint_id = self._recover_commit(commit)
                except BaseException as exc:
                    telemetry.end_commit(span, exc)
                    raise
                telemetry.note_recovered(span)
                telemetry.end_commit(span)
                self._record_latency(time.perf_counter() - sent_at, seq)
                self._report_failed_commits(seq)
            except BaseException as exc:
                telemetry.end_commit(span, exc)
                raise
            else:
                self.inflight = InFlight(
                    commit=commit,
                    seq=seq,
                    sent_at=sent_at,
                    span=span,
                    snapshot_bytes=new_bytes if snapshot_now and not inline else None,
                )
                checkpoint_id = None
        else:
            started = time.perf_counter()
            with telemetry.commit(self.run_id, seq, len(new_bytes), len(ops_bytes), inline):
                checkpoint_id = self._commit_with_recovery(commit)
            self._record_latency(time.perf_counter() - started, seq)
        self.pristine = pristine
        self.data = new_bytes
        self.start_bytes = new_bytes
        self.retries = 0
        self.attempts = 1  # the next step's first attempt (as the commit recorded)
        self.head = Head(
            id=checkpoint_id,
            seq=seq,
            chain_hash=chain,
            state_hash=state_hash,
            size=len(new_bytes),
            delta_run=delta_run,
            schema_version=agent.schema_version,
            agent_version=agent.version,
            step=step,
            next_step=next_step,
        )
        # The first checkpoint after a schema upgrade is a snapshot (written inline above).
        self.upgraded_from = None
        if snapshot_now:
            if not inline and checkpoint_id is not None:
                self.snapshots.submit(checkpoint_id, state_hash, new_bytes)
            self.head.delta_run = 0
        if checkpoint_id is not None:
            fault("after_commit", run=self.run_id, step=step, seq=seq)

    def _record_latency(self, seconds: float, seq: int) -> None:
        self.prev_commit_us = int(seconds * 1_000_000)
        self.latency_seq = seq
        self.commits_uncounted += 1
        telemetry.record_commit(self.agent.name, seconds)
        self.latency_unreported = True

    def _encode(self, live: dict, step: str) -> bytes:
        what = f"state after step {step!r}"
        try:
            return canonical.dumps(live, what=what)
        except StateNotJSON:
            canonical.check_json(live, what=what)  # names the path
            raise

    def _redact_changes(self, ops: list[dict]) -> bool:
        """Redact secrets inside the changed values; True if the live state itself must be
        redacted too (a secret-looking key was set, or a scalar held a secret)."""
        whole = False
        for op in ops:
            if "value" not in op:
                continue
            value = op["value"]
            canonical.check_json(value, what="state", path=op["path"])
            last = op["path"].rsplit("/", 1)[-1]
            if last and is_secret_key(diff.unescape(last)):
                whole = True
                continue
            if type(value) in (dict, list):
                _, changed = redact(value, self.secrets)  # in place, so ``live`` too
                whole = whole or changed
            elif type(value) is str and self.secrets:
                whole = whole or any(s in value for s in self.secrets)
        return whole

    def _commit_with_recovery(self, commit: StepCommit) -> int:
        """Commit; if the connection drops during COMMIT, find out whether it happened."""
        try:
            checkpoint_id = checkpoints.commit_step(commit)
        except FencedOut as exc:
            log.warning("%s", exc)
            raise
        except DB_DOWN:
            checkpoint_id = self._recover_commit(commit)
        if self.failed_commits:
            self._report_failed_commits(commit.head.seq + 1)
        return checkpoint_id

    def _recover_commit(self, commit: StepCommit, failed: bool = True) -> int:
        """The connection failed during this commit: wait for the database, then look for
        the commit's id; if it is not there and the run is still ours, commit again."""
        while True:
            if failed:
                self.failed_commits += 1
                telemetry.count("commit_failures")
            failed = True
            if not self._wait_for_database():
                raise LeaseLost("the database stayed unreachable") from None
            found = checkpoints.committed_id(self.run_id, commit.commit_id)
            if found is not None:
                return found
            if not self._still_ours(commit.head.seq):
                # This very commit, still running on the server when it was looked up,
                # may have moved the head since.
                found = checkpoints.committed_id(self.run_id, commit.commit_id)
                if found is not None:
                    return found
                raise LeaseLost("the lease expired while the database was away") from None
            try:
                return checkpoints.commit_step(commit)
            except FencedOut as exc:
                # Fenced by this very commit, sent earlier and finished meanwhile?
                found = checkpoints.committed_id(self.run_id, commit.commit_id)
                if found is not None:
                    return found
                log.warning("%s", exc)
                raise
            except DB_DOWN:
                continue

    def _report_failed_commits(self, seq: int) -> None:
        Event.objects.create(
            run_id=self.run_id,
            kind=EventKind.COMMIT_FAILED,
            seq=seq,
            worker=self.worker,
            data=canonical.dumps({"failed_commits": self.failed_commits}).decode(),
        )
        self.failed_commits = 0

    def _wait_for_database(self) -> bool:
        """Poll until the database answers again (True) or the wait is too long (False)."""
        give_up = time.monotonic() + float(getattr(settings, "DURABILITY_DB_WAIT_SECONDS", 300))
        delay = 0.05
        try:
            # Only the commit's own session may have failed: this one is kept if it still
            # answers.
            with connection.cursor() as cur:
                cur.execute("SELECT 1")
            return True
        except DB_DOWN:
            pass
        while time.monotonic() < give_up:
            connection.close()
            try:
                with connection.cursor() as cur:
                    cur.execute("SELECT 1")
                return True
            except DB_DOWN:
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        connection.close()
        return False

    def _still_ours(self, head_seq: int | None = None) -> bool:
        """After the database was away: the lease is still ours, and the head we hold in
        memory is still the run's. A server that crashed loses the commits it had not
        flushed yet (the relaxed level): continuing from memory would build on checkpoints
        that are gone. Then this execution ends, and the next one starts from what survived."""
        ours = Run.objects.filter(pk=self.run_id, lease_token=self.token)
        if head_seq is None and self.head is not None:
            head_seq = self.head.seq
        if head_seq is not None:
            ours = ours.filter(head_seq=head_seq)
        return ours.exists()

    # --- the ways an execution ends -------------------------------------------------------------

    def _take_replays(self) -> list[list] | None:
        """The calls replayed since the last step-ending event, for the next one to carry."""
        if not self.replayed:
            return None
        taken = [[ident, key] for ident, key in self.replayed.items()]
        self.replayed.clear()
        return taken

    def _with_replays(self, data: dict) -> str:
        replayed = self._take_replays()
        if replayed:
            data["replayed"] = replayed
        return canonical.dumps(data).decode()

    def _event(self, kind: Callable[..., Event], **fields: Any) -> Event:
        """An event of ``kind`` (a function of ``durability.events``) at this execution's
        place in the run, carrying the last commit's latency if no event has yet."""
        fields.setdefault("seq", self.head.seq if self.head else self.row.head_seq)
        fields.setdefault("step", self.pc or (self.head.next_step if self.head else self.row.step))
        if self.latency_unreported:
            fields.setdefault("commit_us", self.prev_commit_us)
            self.latency_unreported = False
        return kind(self.run_id, worker=self.worker, **fields)

    def _suspend(self, s: Suspension) -> Outcome | None:
        with transaction.atomic():
            mine = Run.objects.select_for_update().filter(pk=self.run_id, lease_token=self.token)
            if not mine.exists():
                return Outcome.LOST
            if s.ready is not None and s.ready():
                return None
            if s.write is not None:
                s.write()
            lifecycle.suspend(self.run_id, self.token, s.reason, s.detail, s.wake_at)
            events.record(
                self._event(
                    events.suspended,
                    wait=s.reason,
                    detail=s.detail,
                    replayed=self._take_replays(),
                )
            )
        if s.wake_at is not None:
            dispatch.ring(self.run_id, delay=(s.wake_at - timezone.now()).total_seconds())
        fault("suspended", run=self.run_id, step=self.pc, reason=s.reason)
        return Outcome.SUSPENDED

    def _retry(self, step: str, exc: BaseException) -> Outcome:
        agent = self.agent
        error = f"{type(exc).__name__}: {exc}"
        if self.retries >= agent.max_retries:
            return self._fail(
                RetriesExhausted(
                    f"step {step!r} failed {self.retries + 1} times with transient errors;"
                    f" last: {error}",
                    run_id=self.run_id,
                )
            )
        delay = agent.backoff(self.retries, getattr(exc, "retry_after", None))
        with transaction.atomic():
            if not lifecycle.release(
                self.run_id,
                self.token,
                wait=WaitReason.RETRY,
                detail=error,
                until=leases.db_now_plus(delay),
                retries=F("retries") + 1,
            ):
                return Outcome.LOST
            events.record(
                self._event(
                    events.retry_scheduled,
                    delay=delay,
                    error=error,
                    retry=self.retries + 1,
                    replayed=self._take_replays(),
                )
            )
            dispatch.ring(self.run_id, delay=delay + 0.05)
        return Outcome.RETRY

    def _fail(self, exc: BaseException, *, integrity: bool = False) -> Outcome:
        code = getattr(exc, "code", "") or StepError.code
        if isinstance(exc, DurabilityError):
            message = exc.message
        else:
            message = f"{type(exc).__name__}: {exc}"
        # Secrets in the message or the traceback are scrubbed by the gate as they are
        # written (run, events, log, span): this runs inside the execution's scope.
        self.failure = message
        detail = {"error": message, "type": type(exc).__name__}
        if not isinstance(exc, DurabilityError):
            detail["traceback"] = "".join(traceback.format_exception(exc)[-12:])
        with transaction.atomic():
            if not lifecycle.fail(self.run_id, self.token, error=message, code=code):
                return Outcome.LOST
            timeline = []
            if integrity:
                timeline.append(self._event(events.integrity, message=message, detail=detail))
            timeline.append(
                self._event(
                    events.failed, message=message, detail=detail, replayed=self._take_replays()
                )
            )
            events.record(*timeline)
        log.info("run %s failed: %s", self.run_id, message)
        return Outcome.FAILED

    def _yield(self) -> Outcome:
        with transaction.atomic():
            if not lifecycle.release(self.run_id, self.token):
                return Outcome.LOST
            events.record(self._event(events.released, why="handed back to the queue"))
            dispatch.ring(self.run_id)
        return Outcome.YIELDED

    def _wait_for_version(self, exc: IncompatibleVersion) -> Outcome:
        """Not this worker's to run: hand the run back, waiting visibly, so that a worker with
        a version that can continue it (during a rolling deploy) takes it instead."""
        delay = float(getattr(settings, "DURABILITY_VERSION_RETRY_SECONDS", 30.0))
        with transaction.atomic():
            if not lifecycle.release(
                self.run_id,
                self.token,
                wait=WaitReason.VERSION,
                detail=exc.message,
                until=leases.db_now_plus(delay),
            ):
                return Outcome.LOST
            events.record(self._event(events.released, why=exc.message))
        log.warning("%s", exc)
        return Outcome.YIELDED

    def _finish_without_step(self) -> Outcome:
        """A head with no next step (e.g. rolled back to the final checkpoint)."""
        with transaction.atomic():
            if not lifecycle.succeed(self.run_id, self.token):
                return Outcome.LOST
            events.record(self._event(events.succeeded))
        return Outcome.SUCCEEDED


__all__ = ["Outcome", "execute", "step_deadline", "worker_name"]
