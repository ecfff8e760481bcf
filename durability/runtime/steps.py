"""Running one step of an execution: its deadline, how it ends, what it leaves in memory
until it is checkpointed (the periodic level), and the head it starts from (rehydration).

A failed attempt never leaks: the next one starts from the committed bytes.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError

from durability import canonical, checkpoints, telemetry
from durability.agents import Ending
from durability.checkpoints import Head
from durability.errors import (
    Abandon,
    FencedOut,
    IncompatibleVersion,
    LeaseLost,
    StepTimeout,
    Suspend,
)
from durability.models import Checkpoint, Run
from durability.runtime.checkpointing import encode
from durability.runtime.commits import Commits
from durability.runtime.context import Context
from durability.store import reconnect, store

if TYPE_CHECKING:
    from durability.agents import Agent
    from durability.runtime.waits import Suspension

log = logging.getLogger(__name__)

DB_DOWN = reconnect.DB_DOWN

AGAIN = object()  # run the same step again from its base (see Stepping._attempt)


class Outcome(StrEnum):
    BUSY = "busy"  # another live process holds the run
    SKIPPED = "skipped"  # not runnable now (finished, waiting, not due)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SUSPENDED = "suspended"
    RETRY = "retry"
    YIELDED = "yielded"  # handed back to the queue (time slice, shutdown)
    LOST = "lost"  # the lease went to someone else


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
def timeout_paused() -> Iterator[None]:
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


def drop_session_cut_short() -> None:
    """``Abandon`` (a signal) raised while a query of the step waited for its answer leaves
    Django's session busy with that query: psycopg cancels it only on KeyboardInterrupt and
    SystemExit, and every later statement would fail with "another command is already in
    progress". Cancel it on the server and close the session; the next use opens a new one."""
    store().cancel_cut_short()


class Stepping:
    """The step-level half of ``executor.Execution``, which holds the state it reads and
    writes and the ways an execution ends (declared here, made there)."""

    run_id: Any
    row: Run
    commits: Commits
    # The head's state: committed bytes, ``pristine`` parsed, ``live`` as the steps change it,
    # the bytes each attempt starts from, and the schema version it was upgraded from.
    data: bytes
    pristine: Any
    live: Any
    input: Any
    start_bytes: bytes
    upgraded_from: int | None
    db_errors: int
    replayed: dict[int, str]
    ending: str
    pc: str
    counters: dict[tuple[str, str], int]
    step_start_counters: dict[tuple[str, str], int]
    held: int
    period_started: float
    boundary_bytes: bytes
    boundary_step: str

    if TYPE_CHECKING:
        head: Head

        @property
        def agent(self) -> Agent: ...
        @property
        def base_id(self) -> int | None: ...
        @property
        def periodic(self) -> bool: ...
        def _settled_base(self) -> int: ...
        def _new_identity(self, base_id: int | None, base_seq: int) -> None: ...
        def _commit(
            self,
            step: str,
            next_step: str,
            replay: tuple[int, str] | None = None,
            ahead: bool = False,
        ) -> None: ...
        def _suspend(self, s: Suspension) -> Outcome | None: ...
        def _retry(self, step: str, exc: BaseException) -> Outcome: ...
        def _fail(self, exc: BaseException, *, integrity: bool = False) -> Outcome: ...
        def _yield(self) -> Outcome: ...

    def _attempt(self, step: str, fn: Callable, ctx: Context, span: Any) -> Any:
        """Run one step and commit it. Returns None to go on with the next step, ``AGAIN``
        to run this step again from its base, or the outcome that ends the execution.
        However the step ends, the previous step's commit is answered first: if it failed,
        that failure is the outcome (this step only ran ahead of it)."""
        try:
            with self.commits.ahead.leaving():
                next_step = self._run_step(step, fn, ctx)
        except Suspend as exc:
            telemetry.note("suspended", reason=exc.suspension.reason, detail=exc.suspension.detail)
            outcome = self._suspend(exc.suspension)
            # None: the wake condition was met before we could suspend; run the step again.
            return AGAIN if outcome is None else outcome
        except (LeaseLost, FencedOut) as exc:
            telemetry.note("lease_lost", reason=str(exc))
            return Outcome.LOST
        except Abandon:
            drop_session_cut_short()
            return self._yield()
        except (SystemExit, KeyboardInterrupt):
            # The process is going away: hand the run back first, unless the commit in
            # flight is still unresolved (it could land after the release); then the lease
            # runs out and the sweeper hands it on.
            if self.commits.ahead.pending is None:
                try:
                    self._yield()
                except DatabaseError as exc:  # the exit goes on; the lease runs out instead
                    log.warning("run %s: not handed back on the way out: %s", self.run_id, exc)
            raise
        except DB_DOWN as exc:
            return self._database_away(step, exc)
        except Exception as exc:
            telemetry.failed(span, exc)
            if self.agent.is_transient(exc):
                return self._retry(step, exc)
            return self._fail(exc)
        self.db_errors = 0
        telemetry.set_attributes(span, **{"durability.step.next": next_step or "(end)"})
        return None if next_step else Outcome.SUCCEEDED

    def _run_step(self, step: str, fn: Callable, ctx: Context) -> str:
        try:
            with step_deadline(self.agent.step_timeout, step):
                # After a rollback: the compensations its operator ticked, before the run
                # goes on (nothing to do otherwise).
                ctx.run_compensations()
                returned = fn(self.live, ctx)
        finally:
            self.replayed.update(ctx.replayed_calls)
        next_step = self.agent.successor(step, returned)
        if not next_step:
            self.ending = returned.outcome if isinstance(returned, Ending) else ctx.ending
        self._step_done(step, next_step)
        return next_step

    def _database_away(self, step: str, exc: BaseException) -> Any:
        self.db_errors += 1
        if self.db_errors > 5:  # not an outage but an error that repeats: back off
            return self._retry(step, exc)
        if self.base_id is None:
            # The commit sent ahead failed with the database: whether it landed is for the
            # next execution to find out, from what the database holds.
            return Outcome.LOST
        if not reconnect.wait_for_database() or not self.commits.still_ours(self.head.seq):
            return Outcome.LOST
        return AGAIN

    def _step_done(self, step: str, next_step: str) -> None:
        """A step returned: checkpoint it, or at the periodic level keep it in memory until
        the period is over (N steps, T seconds, or the run's end)."""
        if self.periodic and next_step:
            self.held += 1
            due = self.held >= self.agent.periodic_steps or (
                time.monotonic() - self.period_started >= self.agent.periodic_seconds
            )
            if not due:
                self.boundary_bytes = encode(self.live, step)
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
        if not self.held:
            return
        replay = canonical.dumps(
            [[table, key, n] for (table, key), n in sorted(self.step_start_counters.items())]
        ).decode()
        current = self.live
        try:
            self.live = canonical.loads(self.boundary_bytes)
            self._commit(self.boundary_step, self.pc, replay=(self._settled_base(), replay))
        except FencedOut as exc:
            raise LeaseLost(str(exc), guard=exc.guard) from None
        finally:
            self.live = current
        self.held = 0
        self.period_started = time.monotonic()

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
        self.head = Head.of(cp, deltas=rebuilt.deltas)
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
            self.commits.snapshots.submit(cp.id, cp.state_hash, data)
            self.head.delta_run = self.head.deltas = 0
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
