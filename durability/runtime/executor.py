"""Executing a run: claim it, rehydrate its head, run steps and checkpoint after each.

The parts: ``steps`` runs one step and decides how it ends; ``checkpointing`` computes what
its checkpoint holds; ``commits`` makes the commit (or sends it ahead, ``sendahead``, whose
``settle`` is the one gate between a step that ran ahead and the outside world); the ways an
execution ends are written here.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from durability import canonical, checkpoints, dispatch, events, leases, lifecycle, telemetry
from durability.agents import Agent, registry
from durability.checkpoints import Head
from durability.conf import conf
from durability.errors import (
    Abandon,
    DurabilityError,
    FencedOut,
    IncompatibleVersion,
    IntegrityViolation,
    LeaseLost,
    PoisonStep,
    RetriesExhausted,
    StepError,
    UnknownAgent,
)
from durability.models import Durability, Event, Run, WaitReason
from durability.redact import scope as secrets_scope
from durability.runtime import checkpointing
from durability.runtime.claims import free_slot, ring_again_if_handed_back, tell_parent, trace_claim
from durability.runtime.commits import Commits
from durability.runtime.context import Context, Records, Suspension, WhatIf
from durability.runtime.faults import fault
from durability.runtime.sendahead import Settled
from durability.runtime.steps import AGAIN, Outcome, Stepping, step_deadline, timeout_paused

log = logging.getLogger(__name__)


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
        ring_again_if_handed_back(run_id)
        return Outcome.BUSY
    try:
        claim = leases.claim(run_id, worker, owner_dead=True, holder=keeper.pid)
        if claim is None:
            return Outcome.SKIPPED
        keeper.start(claim.token)
        if slice_seconds is None:
            slice_seconds = conf.SLICE_SECONDS
        execution = Execution(claim, keeper, worker, should_stop or _never, slice_seconds)
        # Whatever this execution writes, wherever, passes the redaction gate with the
        # secrets its steps read (durability/redact.py); its span ends inside the scope too.
        with (
            secrets_scope(execution.secrets),
            telemetry.execution(claim.run, worker, claim.run.trace_exec) as span,
        ):
            trace_claim(claim, span)
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
                    tell_parent(claim.run.id)
            if leases.concurrency_limit(claim.run.agent):
                free_slot(claim.run.agent)
            return outcome
    finally:
        keeper.stop()


def _never() -> bool:
    return False


class Execution(Stepping):
    def __init__(
        self,
        claim: leases.Claim,
        keeper: leases.LeaseKeeper,
        worker: str,
        should_stop: Callable[[], bool],
        slice_seconds: float,
    ) -> None:
        row = self.row = claim.run
        self.run_id = claim.run.id
        self.token = claim.token
        self.attempts = claim.attempts
        self.retries = claim.run.retries
        self.keeper = keeper
        self.worker = worker
        self.should_stop = should_stop
        self.deadline = time.monotonic() + slice_seconds
        # The commits: made or sent ahead, answered, timed (and the base of the next step).
        self.commits = Commits(self.run_id, self.token, worker)
        self.secrets: set[str] = set()
        self.max_state = conf.MAX_STATE_BYTES
        self._agent: Agent | None = None
        self.fingerprint: tuple[str, str] = ("", "")
        # The head in memory, its state (committed bytes, ``pristine`` parsed, ``live`` as
        # the steps change it) and the bytes each step attempt starts from (or its upgrade).
        self._head: Head | None = None
        self.data = b""
        self.pristine: Any = None
        self.live: Any = None
        self.input: Any = None
        self.start_bytes = b""
        self.upgraded_from: int | None = None
        self.db_errors = 0
        self.failure: str = ""
        # Calls answered from the journal since the last event that ends a step (id -> key),
        # written into that event; and the outcome the run's last step named.
        self.replayed: dict[int, str] = {}
        self.ending = ""
        # The identity of the next steps' operations: the base (``base_id``, kept by the
        # commits, None while its commit is in flight), bumped with each new base.
        self.pc = ""
        self.base_seq = 0
        self.identity = 0
        self.counters: dict[tuple[str, str], int] = {}
        self.step_start_counters: dict[tuple[str, str], int] = {}
        # The periodic level: steps kept in memory since the last checkpoint.
        self.held = 0
        self.period_started = time.monotonic()
        self.boundary_bytes = b""
        self.boundary_step = ""
        # A what-if fork reuses its source's calls; a what-if run's child has no source.
        self.what_if = (
            WhatIf(row.id, row.forked_from_id, row.forked_from_seq or 0, row.what_if_live)
            if row.what_if
            else None
        )

    # What the ways out read and write (their latency bookkeeping is the commits').

    @property
    def latency_unreported(self) -> bool:
        return self.commits.latency_unreported

    @latency_unreported.setter
    def latency_unreported(self, value: bool) -> None:
        self.commits.latency_unreported = value

    @property
    def prev_commit_us(self) -> int | None:
        return self.commits.prev_commit_us

    @property
    def base_id(self) -> int | None:
        return self.commits.ahead.base_id

    @property
    def periodic(self) -> bool:
        return self.row.durability == Durability.PERIODIC

    # Loaded by ``_begin`` before the first step: a step never runs without them.

    @property
    def agent(self) -> Agent:
        if self._agent is None:
            raise RuntimeError(f"run {self.run_id}: its agent is not loaded yet")
        return self._agent

    @property
    def head(self) -> Head:
        if self._head is None:
            raise RuntimeError(f"run {self.run_id}: its head checkpoint is not loaded yet")
        return self._head

    @head.setter
    def head(self, head: Head) -> None:
        self._head = head

    def _settled_base(self) -> int:
        """The running step's base: known once the commit in flight is answered, which a
        step's first operation (and every ``AGAIN``) waits for."""
        base_id = self.base_id
        if base_id is None:
            raise RuntimeError(f"run {self.run_id}: no settled base checkpoint")
        return base_id

    def close(self) -> None:
        self.commits.close()

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        outcome = self._begin()
        if outcome is not None:
            return outcome
        records = Records.load(self._settled_base(), self.run_id)
        while True:
            step = self.pc
            if not step:
                return self._finish_without_step()
            if self.keeper.lost.is_set():
                return Outcome.LOST
            if self.should_stop() or time.monotonic() > self.deadline:
                return self._leave(self._hand_back)
            fn = self.agent.steps.get(step)
            if fn is None:
                missing = StepError(
                    f"agent {self.agent.name}@{self.agent.version} has no step {step!r}",
                    run_id=self.run_id,
                )
                return self._leave(partial(self._fail, missing))
            ctx = self._context(step, records)
            fault("before_step", run=self.run_id, step=step, seq=self.head.seq)
            try:
                self.commits.ahead.poll()
            except Abandon:
                return self._leave(self._yield)
            identity_before = self.identity
            with telemetry.step(step, self.head.seq, self.attempts) as span:
                outcome = self._attempt(step, fn, ctx, span)
            if outcome is AGAIN:
                self.live = canonical.loads(self.start_bytes)
                self.counters.clear()
                self.counters.update(self.step_start_counters)
                records = Records.load(self._settled_base(), self.run_id)
                continue
            if outcome is not None:
                return outcome
            if self.identity != identity_before:
                # A new base: nothing recorded against it yet.
                records = Records.empty(records.abandoned_keys)

    def _begin(self) -> Outcome | None:
        """Load the agent and the head; an outcome if this execution ends before a step."""
        try:
            self._agent = registry.get(self.row.agent)
        except UnknownAgent:
            # A worker from another deploy (without this agent): not this one's to run, nor
            # to fail. Hand it back; a worker that has the agent takes it.
            return self._wait_for_version(
                IncompatibleVersion(
                    f"worker {self.worker} has no agent {self.row.agent!r}", run_id=self.run_id
                )
            )
        self.commits.agent = self.agent.name
        poison = conf.POISON_ATTEMPTS
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
        return None

    def _context(self, step: str, records: Records) -> Context:
        self.step_start_counters = dict(self.counters)
        ctx = Context(
            run_id=self.run_id,
            agent=self.agent,
            step=step,
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
            gate=self._gate,
        )
        ctx.secrets = self.secrets
        return ctx

    def _gate(self) -> Settled:
        """For the step's context: the previous step's commit answered. The wait is the
        previous step's, not this one's: it is not charged to the step's timeout."""
        ahead = self.commits.ahead
        if ahead.pending is None:
            return ahead.settle()
        with timeout_paused():
            return ahead.settle()

    def _leave(self, write: Callable[[], Outcome]) -> Outcome:
        """The loop ends the execution itself: once the commit in flight is answered."""
        outcome = self.commits.ahead.leave(write)
        return Outcome.LOST if outcome is None else outcome

    def _hand_back(self) -> Outcome:
        if self.held:
            # Between steps, the live state is the period's: keep it before leaving.
            try:
                self._commit(self.boundary_step, self.pc)
            except (FencedOut, LeaseLost):
                return Outcome.LOST
            self._new_identity(self.head.id, self.head.seq)
        return self._yield()

    def _new_identity(self, base_id: int | None, base_seq: int) -> None:
        """The checkpoint the next steps' operations are identified by, with fresh counters.
        (Its id is None while its commit is in flight.)"""
        self.identity += 1
        self.commits.ahead.base_id, self.base_seq = base_id, base_seq
        self.counters = {}
        self.held = 0
        self.period_started = time.monotonic()

    # --- committing -----------------------------------------------------------------------------

    def _commit(
        self,
        step: str,
        next_step: str,
        replay: tuple[int, str] | None = None,
        ahead: bool = False,
    ) -> None:
        """Checkpoint the live state. ``ahead``: send the commit and return before its
        answer, which ``SendAhead.settle`` takes (the head's id is unknown until then)."""
        ahead_of = self.commits.ahead
        ahead_of.poll()
        change = checkpointing.change(
            self.live,
            self.pristine,
            self.data,
            step,
            agent=self.agent,
            secrets=self.secrets,
            max_state=self.max_state,
            run_id=self.run_id,
            gate=ahead_of.settle,
        )
        planned = checkpointing.plan(self, change, step, next_step, replay, self._take_replays())
        commit, head = planned.commit, planned.head
        ahead = ahead and checkpoints.can_send_ahead(commit)
        # Converted for the wire while the commit in flight is still on the server: between
        # its answer and this send, the server waits for the worker.
        bound = checkpoints.bind_step(commit) if ahead else None
        if bound is not None:
            # Made and not sent: a crash here loses it as a crash before COMMIT does, with
            # its parent's commit perhaps still in flight.
            fault("in_commit", run=self.run_id, step=step, seq=head.seq)
        proof = ahead_of.settle()  # the commit in flight, if any, is this one's parent
        commit.prev_commit_us = self.commits.prev_commit_us
        sizes = (len(change.data), len(change.ops_bytes), planned.inline)
        if bound is not None:
            span = telemetry.start_commit(self.run_id, head.seq, *sizes)
            later = planned.snapshot_now and not planned.inline
            head.id = self.commits.send(
                proof, commit, bound, head, span, change.data if later else None
            )
        else:
            started = time.perf_counter()
            with telemetry.commit(self.run_id, head.seq, *sizes):
                head.id = self.commits.now(commit)
            self.commits.record_latency(time.perf_counter() - started, head.seq)
        self._advance(change, head, planned)

    def _advance(self, change: checkpointing.Change, head: Head, planned: Any) -> None:
        """The head in memory moves to the checkpoint just made (or sent)."""
        self.pristine = change.pristine
        self.data = self.start_bytes = change.data
        self.retries = 0
        self.attempts = 1  # the next step's first attempt (as the commit recorded)
        self.head = head
        # The first checkpoint after a schema upgrade is a snapshot (written inline).
        self.upgraded_from = None
        if head.id is None:
            return  # in flight: the rest once its answer is in
        if planned.snapshot_now and not planned.inline:
            self.commits.snapshots.submit(head.id, head.state_hash, change.data)
        fault("after_commit", run=self.run_id, step=head.step, seq=head.seq)

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
        head = self._head
        fields.setdefault("seq", head.seq if head else self.row.head_seq)
        fields.setdefault("step", self.pc or (head.next_step if head else self.row.step))
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
        delay = conf.VERSION_RETRY_SECONDS
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
