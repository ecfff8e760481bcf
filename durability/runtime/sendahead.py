"""Sending a step's commit ahead, and the rule that keeps it correct, kept by type.

A worker sends step N's checkpoint and starts step N+1 before the answer is in, so the
server's WAL flush overlaps the next step's work (``durability.inflight``). Until the answer
is in, step N+1 may only compute: the commit it builds on may still fail (fenced out, its
session gone), and then step N+1 never happened. So nothing it does may leave the process
before the answer: no call, no effect, no record, no suspension, no blob, no write that ends
the execution, not the next commit (whose parent this one is).

``SendAhead`` owns the commit in flight, and ``settle`` is the one place its answer is
taken. It alone makes ``Settled``, the proof that no commit is in flight, carrying the base
checkpoint the running step's operations hang from. Whatever reaches the outside world takes
that proof: ``ctx``'s operations (every durable one is identified by its base, which only the
proof carries), the next commit, the blob store, the ways out of an execution.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from django.db import DatabaseError

from durability import checkpoints, telemetry
from durability.checkpoints import Head, StepCommit
from durability.errors import Abandon, FencedOut, LeaseLost
from durability.runtime.faults import fault
from durability.store import reconnect

if TYPE_CHECKING:
    from durability.runtime.commits import Commits

log = logging.getLogger(__name__)

DB_DOWN = reconnect.DB_DOWN

_GATE = object()


class Settled:
    """Proof that no commit of this execution is in flight, and the checkpoint the running
    step's operations hang from. Only ``SendAhead.settle`` makes one."""

    __slots__ = ("base_id",)

    def __init__(self, base_id: int, gate: object) -> None:
        if gate is not _GATE:
            raise TypeError("a Settled comes from SendAhead.settle only")
        self.base_id = base_id


@dataclass
class InFlight:
    """A step's commit, sent; its answer not taken yet."""

    commit: StepCommit
    head: Head  # the head this commit makes (its id is known with the answer)
    sent_at: float
    span: Any
    snapshot_bytes: bytes | None  # a snapshot to write off the hot path once its id is known
    # When the answer reached the process (``inflight``'s watch, or the worker seeing it
    # in): the commit's latency ends there, not when the worker got round to taking it.
    answered_at: float | None = None
    interrupted: bool = False

    @property
    def seq(self) -> int:
        return self.head.seq


class SendAhead:
    """The commit in flight of one execution, and the base of its running step."""

    def __init__(self, commits: Commits) -> None:
        self.commits = commits
        self.pending: InFlight | None = None
        # The checkpoint the running step's operations hang from: None while its commit is
        # in flight (or after that commit failed).
        self.base_id: int | None = None
        self._leaving = _Leaving(self)

    def sent(self, pending: InFlight) -> None:
        self.pending = pending

    def settle(self) -> Settled:
        """The gate: wait for the answer of the commit in flight, if any, and return the
        proof that none is. A commit that failed voids the step that ran ahead of it:
        ``LeaseLost``, which a step catching ``Exception`` cannot swallow."""
        pending = self.pending
        if pending is not None:
            checkpoint_id = self._answer(pending)
            pending.head.id = checkpoint_id
            if self.base_id is None:
                self.base_id = checkpoint_id
            self.commits.answered(pending, checkpoint_id)
            # "After the commit" is after its answer is in: a crash here shows what a
            # process dying at that moment leaves.
            fault(
                "after_commit", run=pending.commit.run_id, step=pending.commit.step, seq=pending.seq
            )
        if self.base_id is None:
            raise LeaseLost("the previous step's commit did not land")
        return Settled(self.base_id, _GATE)

    def _answer(self, pending: InFlight) -> int:
        recovered = pending.interrupted
        try:
            if pending.interrupted:
                # A signal cut the last wait short, and the channel was closed under it.
                checkpoint_id = self.commits.recover(pending.commit, failed=False)
            else:
                try:
                    checkpoint_id = checkpoints.step_answer(pending.commit)
                    pending.answered_at = checkpoints.step_arrived_at()
                except FencedOut as exc:
                    log.warning("%s", exc)
                    raise
                except DB_DOWN:
                    checkpoint_id = self.commits.recover(pending.commit)
                    recovered = True
        except (FencedOut, LeaseLost, DatabaseError) as exc:
            # Answered, and not with a checkpoint: the step that ran ahead is void.
            self.pending = None
            telemetry.end_commit(pending.span, exc)
            if isinstance(exc, LeaseLost):
                raise
            guard = getattr(exc, "guard", "lease")
            raise LeaseLost(f"the previous step's commit failed: {exc}", guard=guard) from None
        except BaseException:
            pending.interrupted = True
            raise
        self.pending = None
        if recovered:
            # The answer that arrived was an error (or was never read): the commit is done
            # only now, and its latency and span run until now.
            pending.answered_at = None
            telemetry.note_recovered(pending.span)
        return checkpoint_id

    def poll(self) -> None:
        """Note when the answer of the commit in flight arrived, if it has, without waiting."""
        pending = self.pending
        if pending is None or pending.answered_at is not None or pending.interrupted:
            return
        try:
            pending.answered_at = checkpoints.step_arrived_at()
        except DB_DOWN:
            pass  # the channel is closed; settling finds out what happened
        except BaseException:
            pending.interrupted = True  # a signal: the channel was closed under the commit
            raise

    def leave(self, write: Callable[[], Any]) -> Any:
        """Where the execution ends itself: settle, then ``write`` (its ending); ``None``
        without writing if the commit failed (the execution is lost). The end of the
        shutdown grace period (``Abandon``) cutting the wait short does not skip the
        ending: the commit is then recovered without the channel."""
        try:
            try:
                self.settle()
            except Abandon:
                self.settle()
        except LeaseLost:
            return None
        return write()

    def leaving(self) -> _Leaving:
        """Around a step: however it ends, the commit in flight is answered first. A commit
        that failed outranks the step's exception (``LeaseLost``), except the process's own
        exit, which always goes on."""
        return self._leaving

    def close(self, run_id: Any) -> None:
        if self.pending is None:
            return
        try:
            self.settle()
        except (Exception, LeaseLost) as exc:
            # The outcome is decided; a commit that failed wrote nothing.
            log.warning("run %s: the last commit sent ahead did not land: %s", run_id, exc)


class _Leaving:
    """``SendAhead.leaving`` (a class, not a generator: it wraps every step)."""

    __slots__ = ("ahead",)

    def __init__(self, ahead: SendAhead) -> None:
        self.ahead = ahead

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is not None and self.ahead.pending is not None:
            try:
                self.ahead.settle()
            except LeaseLost:
                if not isinstance(exc, SystemExit | KeyboardInterrupt):
                    raise
        return False
