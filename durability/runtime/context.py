"""The ``ctx`` a step receives: journaled calls, effects, approvals, timers and secrets.

Every durable operation is identified by (base checkpoint, key, occurrence): the base is the
checkpoint the step execution started from and the occurrence counts repeats of a key within
that execution. A replay that reaches the same identity with another function or other
arguments raises ``NonDeterminismError`` rather than return the wrong result.

Nothing a step does leaves the process before the previous step's commit is answered (it
may have been sent ahead, ``durability.sendahead``): every operation that reaches the outside
world takes the proof ``_settled`` returns, and the base checkpoint a record needs comes only
with it. Effects are in ``durability.effects``, the operations that may suspend in
``durability.waits``, records and argument hashes in ``durability.records``.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from durability import canonical, telemetry
from durability.errors import LeaseLost, NonDeterminismError, SecretMissing, Suspend
from durability.models import CallKind, JournalEntry, Run, WaitReason
from durability.redact import MIN_SECRET_CHARS, redact, remember
from durability.runtime import journal
from durability.runtime.effects import NOT_DONE, Effects
from durability.runtime.faults import fault
from durability.runtime.records import (
    ArgsHash,
    Records,
    WhatIf,
    args_hash,
    function_name,
    llm_meta,
    outcome_recorded,
)
from durability.runtime.waits import Decision, Suspension, Waits

if TYPE_CHECKING:
    from durability.runtime.sendahead import Settled


class Context(Effects, Waits):
    """Handed to every step as its second argument."""

    def __init__(
        self,
        *,
        run_id: Any,
        agent: Any,
        step: str,
        base_seq: int,
        token: int,
        worker: str,
        input: Any,
        attempt: int,
        records: Records,
        retry: int = 0,
        what_if: WhatIf | None = None,
        occurrences: dict | None = None,
        before_durable: Callable[[], None] | None = None,
        gate: Callable[[], Settled],
    ) -> None:
        self.run_id = run_id
        self.agent = agent
        self.step = step
        self.seq = base_seq
        # Starts of this step from this checkpoint, the current one included (crashes count).
        self.attempt = attempt
        # Transient failures of this step so far.
        self.retry = retry
        self.input = input
        self.worker = worker
        # The previous step's commit may still be in flight: ``gate`` waits for its answer
        # and returns the proof (``Settled``) that carries this step's base.
        self._gate = gate
        self._proof: Settled | None = None
        self._token = token
        self._records = records
        # Shared across the steps of a period at the periodic level (one base for all).
        self._occurrences: dict[tuple[str, str], int] = (
            occurrences if occurrences is not None else defaultdict(int)
        )
        self._before_durable = before_durable
        self.secrets: set[str] = set()
        self.journal_writes = 0
        self.replayed = 0
        # Calls answered from the journal in this step (id, key): the executor writes them
        # into the event that ends the step, so a recovery can say what it did not pay again.
        self.replayed_calls: list[tuple[int, str]] = []
        self.ending = ""  # ctx.outcome(...)
        self._waits_drawn: set[int] = set()
        self._blobs: dict[str, Any] = {}
        self.what_if = what_if

    # --- identity ---------------------------------------------------------------------------

    def _here(self) -> dict[str, Any]:
        """Where this step is, for the timeline events it writes (``durability.events``)."""
        return {"seq": self.seq, "step": self.step, "worker": self.worker}

    def _settled(self, *, durable: bool = False) -> Settled:
        """The gate every operation that leaves the process goes through: the previous
        step's commit is answered (``SendAhead.settle``), and the proof carries the base
        checkpoint every durable operation is identified by: there is no other way to it.
        ``durable``: an effect, a suspension or a spawn, before which the periodic level
        checkpoints the steps it kept in memory."""
        proof = self._proof
        if proof is None:
            proof = self._proof = self._gate()
        if durable and self._before_durable is not None:
            self._before_durable()
        return proof

    def settle(self) -> None:
        """Wait here, now, for the previous step's commit to be answered. A step that hands
        ``ctx`` to threads of its own (a LangGraph graph's tasks) calls it first, so that the
        answer is taken on the step's thread and those threads find the proof in hand."""
        self._settled()

    def _fence(self, proof: Settled) -> None:
        """Inside a transaction: lock the run row and check the lease is still ours."""
        if (
            not Run.objects.select_for_update()
            .filter(pk=self.run_id, lease_token=self._token)
            .exists()
        ):
            raise LeaseLost(f"run {self.run_id}: lease lost before an effect", guard="lease")

    def _next(self, table: str, key: str) -> int:
        occurrence = self._occurrences.get((table, key), 0)
        self._occurrences[(table, key)] = occurrence + 1
        return occurrence

    def _check_same(
        self, what: str, key: str, occ: int, rec: Any, fn: str, ahash: ArgsHash
    ) -> None:
        if rec.function != fn or not ahash.matches(rec.args_hash):
            changed = "function" if rec.function != fn else "arguments"
            raise NonDeterminismError(
                f"step {self.step!r} replayed {what} {key!r} (occurrence {occ}) after"
                f" checkpoint #{self.seq} with different {changed}: recorded"
                f" {rec.function} but now {fn}",
                run_id=self.run_id,
            )

    # --- how the run ends -------------------------------------------------------------------

    def outcome(self, text: str) -> None:
        """Name how the run ends ("rejected at publish"), if it ends with this step: shown
        beside its status, filterable in the runs list. ``return END(text)`` does the same."""
        from durability.agents import checked_outcome

        self.ending = checked_outcome(text)

    # --- journaled calls --------------------------------------------------------------------

    def call(self, key: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once: its JSON result is recorded as soon as it
        returns and replayed, not re-run, when this step runs again."""
        return self._journaled(CallKind.CALL, key, fn, args, kwargs)

    def _journaled(
        self, kind: str, key: str, fn: Callable, args: tuple, kwargs: dict, meta: str = ""
    ) -> Any:
        proof = self._settled()
        occ = self._next("journal", key)
        fname = function_name(fn)
        ahash = ArgsHash(args, kwargs)
        rec = self._records.journal.get((key, occ))
        if rec is not None:
            self._check_same("call", key, occ, rec, fname, ahash)
            self.replayed += 1
            if kind == CallKind.CALL:
                self.replayed_calls.append((rec.id, key))
            telemetry.note("call.replayed", key=key, occurrence=occ)
            return canonical.loads(rec.result)
        if self.what_if is not None and kind != CallKind.SLEEP:
            reused = self.what_if.take(key, fname, ahash)
            if reused is not None:
                return self._record_reused(proof, reused, kind, key, occ)
            self.what_if.diverge(proof, self, key)
        resource = self.agent.limits.get(key) if self.agent is not None else None
        if resource:
            self._take(proof, resource)
        fault("before_call", run=self.run_id, step=self.step, key=key, seq=self.seq, occ=occ)
        started = time.perf_counter()
        with telemetry.call(key, fname, kind) as span:
            value = fn(*args, **kwargs)
            telemetry.describe_result(span, value)
        duration_ms = (time.perf_counter() - started) * 1000
        canonical.check_json(value, what=f"result of call {key!r}")
        value, _ = redact(value, self.secrets)
        data = canonical.dumps(value, what=f"result of call {key!r}")
        fault("after_call", run=self.run_id, step=self.step, key=key, seq=self.seq, occ=occ)
        entry = JournalEntry(
            run_id=self.run_id,
            base_id=proof.base_id,
            key=key,
            occurrence=occ,
            kind=kind,
            step=self.step,
            function=fname,
            args_hash=ahash.value,
            result=data.decode(),
            duration_ms=duration_ms,
            meta=meta or llm_meta(value),
        )
        stored = self._record(proof, entry)
        if stored is not entry:
            self._check_same("call", key, occ, stored, fname, ahash)
            data = stored.result.encode()
        return canonical.loads(data)

    def _take(self, proof: Settled, resource: str) -> None:
        """One request from a shared rate limit, or wait for it without a worker."""
        from durability import limits

        wait = limits.take(resource)
        if wait <= 0:
            return
        capacity, per_second = limits.configured()[resource]
        raise Suspend(
            Suspension(
                reason=WaitReason.RATE_LIMIT,
                detail=f"{resource}: {per_second * 60:g}/min, next slot in {wait:.1f} s",
                wake_at=timezone.now() + timedelta(seconds=wait),
            )
        )

    def _record(self, proof: Settled, entry: JournalEntry) -> JournalEntry:
        """Insert-if-absent: the entry, or the one a worker that lost its lease recorded
        first (every replay must see the same answer). Kept in this step's records. The
        result is in hand: it is recorded once the database answers, not asked for again."""
        stored = outcome_recorded(lambda: journal.insert_if_absent(entry))
        if stored is entry:
            self.journal_writes += 1
        self._records.journal[(stored.key, stored.occurrence)] = stored
        return stored

    def _record_reused(
        self, proof: Settled, source: JournalEntry, kind: str, key: str, occ: int
    ) -> Any:
        entry = JournalEntry(
            run_id=self.run_id,
            base_id=proof.base_id,
            key=key,
            occurrence=occ,
            kind=kind,
            step=self.step,
            function=source.function,
            args_hash=source.args_hash,
            result=source.result,
            meta=source.meta,
            reused_from=source.pk,
        )
        entry = self._record(proof, entry)
        telemetry.note("call.reused", key=key, source=source.pk)
        return canonical.loads(entry.result)

    def now(self) -> datetime:
        """The current time, journaled: a replay sees the same instant."""
        value = self._journaled(CallKind.NOW, "__now__", _now_iso, (), {})
        return datetime.fromisoformat(value)

    def uuid(self) -> uuid.UUID:
        return uuid.UUID(self._journaled(CallKind.UUID, "__uuid__", _uuid_str, (), {}))

    def random(self) -> float:
        return self._journaled(CallKind.RANDOM, "__random__", random.random, (), {})

    def secret(self, name: str) -> str:
        """A credential from the environment. Never put it in state: anything that contains
        it is redacted before it is written."""
        value = os.environ.get(name)
        if not value:
            raise SecretMissing(
                f"step {self.step!r} needs the secret {name}, which is not set in the"
                " worker's environment",
                run_id=self.run_id,
            )
        if len(value) < MIN_SECRET_CHARS:
            # Every written string is scrubbed of it: a short one would also rewrite
            # identifiers and names that happen to contain it.
            raise SecretMissing(
                f"step {self.step!r} reads the secret {name}, which is {len(value)} characters"
                f" long: a secret must have at least {MIN_SECRET_CHARS} to be redacted"
                " reliably",
                run_id=self.run_id,
            )
        self.secrets.add(value)
        remember(value)
        return value

    # --- large values -------------------------------------------------------------------------

    def put_blob(self, data: str | bytes) -> dict:
        """Store a large value once, by content, and return the reference to keep in state.
        (Strings over ``DURABILITY_BLOB_BYTES`` are moved there at commit anyway.)"""
        self._settled()
        from durability import blobs

        return blobs.put(data)

    def blob(self, value: Any) -> Any:
        """The value behind a blob reference (read now, checked against its hash), or
        ``value`` itself when it is not a reference: read large state values through it."""
        self._settled()
        from durability import blobs

        if not blobs.is_ref(value):
            return value
        digest = value[blobs.KEY]
        if digest not in self._blobs:
            self._blobs[digest] = blobs.get(value)
        return self._blobs[digest]


class ChildrenPending(BaseException):  # noqa: N818 - a signal, not an error
    """Raised by ``_join_results`` inside the journaled call: nothing is recorded, and the
    step suspends until the children finish."""


# The functions below are journaled by name (``module.function``): they stay in this module,
# or replays of the records made with them would find another function.


def _join_results(ids: list[str]) -> list[dict]:
    from durability import checkpoints
    from durability.models import FINISHED, RunStatus

    runs = {str(r.id): r for r in Run.objects.filter(pk__in=ids)}
    missing = [i for i in ids if i not in runs]
    if missing:
        raise ValueError(f"join: no run {missing[0]}")
    if any(runs[i].status not in FINISHED for i in ids):
        raise ChildrenPending(ids)
    results = []
    for i in ids:
        run = runs[i]
        result = None
        if run.status == RunStatus.SUCCEEDED:
            head = checkpoints.checkpoint(run.id, run.head_seq)
            result, _, _ = checkpoints.verified_state(head)
        results.append(
            {
                "run": i,
                "agent": run.agent,
                "status": run.status,
                "result": result,
                "error": run.error,
            }
        )
    return results


def _now_iso() -> str:
    return timezone.now().isoformat()


def _uuid_str() -> str:
    return str(uuid.uuid4())


__all__ = [
    "NOT_DONE",
    "ArgsHash",
    "ChildrenPending",
    "Context",
    "Decision",
    "Records",
    "Suspension",
    "WhatIf",
    "args_hash",
    "function_name",
    "outcome_recorded",
]
