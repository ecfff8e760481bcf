"""The checkpoint commits of one execution: made (waited for) or sent ahead, recovered when
the connection fails during one, timed, and counted.

A commit carries an id made by the worker: if the connection drops during COMMIT, the worker
waits for the database and looks for that id; its own id at the head means success, and a
commit not found is sent again only while the lease and the head are still its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from django.db import IntegrityError

from durability import checkpoints, events, telemetry
from durability.checkpoints import Head, SnapshotWriter, StepCommit
from durability.errors import FencedOut, LeaseLost
from durability.models import Run
from durability.runtime import inflight
from durability.runtime.sendahead import InFlight, SendAhead, Settled
from durability.store import reconnect

log = logging.getLogger(__name__)

DB_DOWN = reconnect.DB_DOWN


class Commits:
    """Commits for one run under one lease token, from one worker."""

    def __init__(self, run_id: Any, token: int, worker: str) -> None:
        self.run_id = run_id
        self.token = token
        self.worker = worker
        self.agent = ""
        self.snapshots = SnapshotWriter()
        self.ahead = SendAhead(self)
        # The last commit's latency, the checkpoint it is the latency of, and whether an
        # event still has to carry it (the next commit, or an event that ends the step).
        self.prev_commit_us: int | None = None
        self.latency_seq: int | None = None
        self.latency_unreported = False
        self.uncounted = 0
        self.failed = 0

    # --- making one --------------------------------------------------------------------------

    def now(self, commit: StepCommit) -> int:
        """Commit and wait for it; if the connection drops during COMMIT, find out whether
        it happened."""
        try:
            checkpoint_id = checkpoints.commit_step(commit)
        except FencedOut as exc:
            log.warning("%s", exc)
            raise
        except DB_DOWN:
            checkpoint_id = self.recover(commit)
        if self.failed:
            self.report_failed(commit.head.seq + 1)
        return checkpoint_id

    def send(
        self,
        proof: Settled,
        commit: StepCommit,
        bound: inflight.Bound,
        head: Head,
        span: Any,
        snapshot_bytes: bytes | None,
    ) -> int | None:
        """Send ``commit`` without waiting for its answer (``SendAhead.settle`` takes it);
        ``proof``: its parent is answered. Returns the checkpoint's id when the send failed
        and the recovery committed it, None when it is in flight."""
        sent_at = time.perf_counter()
        try:
            checkpoints.send_step(commit, bound)
        except DB_DOWN:
            # Nothing may have reached the server: the usual recovery decides, and the span
            # covers it (it ends with the commit's fate, not the send's).
            try:
                checkpoint_id = self.recover(commit)
            except BaseException as exc:
                telemetry.end_commit(span, exc)
                raise
            telemetry.note_recovered(span)
            telemetry.end_commit(span)
            self.record_latency(time.perf_counter() - sent_at, head.seq)
            self.report_failed(head.seq)
            return checkpoint_id
        except BaseException as exc:
            telemetry.end_commit(span, exc)
            raise
        self.ahead.sent(InFlight(commit, head, sent_at, span, snapshot_bytes))
        return None

    def answered(self, pending: InFlight, checkpoint_id: int) -> None:
        """The commit sent ahead is in: its latency, span, snapshot and failed attempts."""
        answered_at = pending.answered_at or time.perf_counter()
        self.record_latency(answered_at - pending.sent_at, pending.seq)
        telemetry.end_commit(pending.span)
        if pending.snapshot_bytes is not None:
            self.snapshots.submit(checkpoint_id, pending.commit.state_hash, pending.snapshot_bytes)
        if self.failed:
            self.report_failed(pending.seq)

    def record_latency(self, seconds: float, seq: int) -> None:
        self.prev_commit_us = int(seconds * 1_000_000)
        self.latency_seq = seq
        self.uncounted += 1
        telemetry.record_commit(self.agent, seconds)
        self.latency_unreported = True

    # --- when the connection fails -----------------------------------------------------------

    def recover(self, commit: StepCommit, failed: bool = True) -> int:
        """The connection failed during this commit: wait for the database, then look for
        the commit's id; if it is not there and the run is still ours, commit again."""
        while True:
            if failed:
                self.failed += 1
                telemetry.count("commit_failures")
            failed = True
            if not reconnect.wait_for_database():
                raise LeaseLost("the database stayed unreachable") from None
            found = checkpoints.committed_id(self.run_id, commit.commit_id)
            if found is not None:
                return found
            if not self.still_ours(commit.head.seq):
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

    def report_failed(self, seq: int) -> None:
        at = {"seq": seq, "worker": self.worker}
        events.record(events.commit_failed(self.run_id, failed_commits=self.failed, **at))
        self.failed = 0

    def still_ours(self, head_seq: int | None) -> bool:
        """After the database was away: the lease is still ours, and the head we hold in
        memory is still the run's. A server that crashed loses the commits it had not
        flushed yet (the relaxed level): continuing from memory would build on checkpoints
        that are gone. Then this execution ends, and the next one starts from what survived."""
        ours = Run.objects.filter(pk=self.run_id, lease_token=self.token)
        if head_seq is not None:
            ours = ours.filter(head_seq=head_seq)
        return ours.exists()

    # --- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Take the last answer, count the commits, write the last latency nobody carried."""
        try:
            self.ahead.close(self.run_id)  # a fault point may fire there ("after_commit")
        finally:
            self.snapshots.close()
        if self.agent:
            telemetry.commits_made(self.agent, self.uncounted)
            self.uncounted = 0
        if not (self.latency_unreported and self.prev_commit_us is not None):
            return
        try:
            # At the latency's own seq, not the head's: a last commit that failed is the
            # head in memory.
            at = {"seq": self.latency_seq, "worker": self.worker}
            events.record(events.commit_latency(self.run_id, commit_us=self.prev_commit_us, **at))
        except DB_DOWN:
            reconnect.drop()
        except IntegrityError:  # the run was deleted under us: nothing left to report on
            pass
