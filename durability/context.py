"""The ``ctx`` a step receives: journaled calls, effects, approvals, timers and secrets.

Every durable operation is identified by (base checkpoint, key, occurrence): the base is the
checkpoint the step execution started from and the occurrence counts repeats of a key within
that execution. A replay that reaches the same identity with another function or other
arguments raises ``NonDeterminismError`` rather than return the wrong result.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils import timezone

from durability import approvals, canonical, dispatch, journal, telemetry
from durability import rollbacks as rollbacks
from durability.errors import (
    EffectFailed,
    LeaseLost,
    NonDeterminismError,
    SecretMissing,
    Suspend,
    Transient,
)
from durability.faults import fault
from durability.models import (
    AbandonedEffect,
    Approval,
    ApprovalStatus,
    CallKind,
    Checkpoint,
    Effect,
    EffectStatus,
    Event,
    EventKind,
    JournalEntry,
    Message,
    Repeat,
    Run,
    WaitReason,
)
from durability.redact import MIN_SECRET_CHARS, accepted_hashes, keyed_hash, redact, remember

NOT_DONE = object()
"""What a ``reconcile`` function returns when it knows the effect did not happen."""

_PERFORM = object()


def outcome_recorded[T](write: Callable[[], T]) -> T:
    """``write()``, which records what this process holds (a call's result, an effect's
    start or outcome), retried with backoff while the database is away, for up to
    ``DURABILITY_DB_WAIT_SECONDS``. A worker that can still record an outcome does: it is
    never asked for again, or left pending for an operator to call "in doubt". Every write
    passed here is safe to repeat (insert-if-absent, conditional updates)."""
    from django.conf import settings
    from django.db import InterfaceError, OperationalError, connection

    give_up = time.monotonic() + float(getattr(settings, "DURABILITY_DB_WAIT_SECONDS", 300))
    delay = 0.05
    while True:
        try:
            return write()
        except (OperationalError, InterfaceError):
            if connection.in_atomic_block or time.monotonic() >= give_up:
                raise
            connection.close()  # a new session at the next try
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


@dataclass(frozen=True)
class Decision:
    """An operator's answer to ``ctx.approval``. Truthy when approved."""

    approved: bool
    by: str
    comment: str
    payload: Any
    at: datetime | None

    def __bool__(self) -> bool:
        return self.approved


@dataclass
class Suspension:
    """What the executor does when a step suspends: ``write`` runs inside the suspension's
    fenced transaction, ``ready`` re-checks the wake condition under the run's lock."""

    reason: str
    detail: str
    write: Callable[[], None] | None = None
    ready: Callable[[], bool] | None = None
    wake_at: datetime | None = None


def function_name(fn: Callable) -> str:
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(type(fn))
    return f"{module}.{name}" if module else name


def _unhashable(value: Any) -> Any:
    # Clients, sessions and the like stand in by type: their identity is not the input.
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _args_bytes(args: tuple, kwargs: dict) -> bytes:
    import orjson

    return orjson.dumps(
        [list(args), kwargs],
        default=_unhashable,
        option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS,
    )


def args_hash(args: tuple, kwargs: dict) -> str:
    """The stored hash of a call's arguments: keyed (``redact.keyed_hash``), so that it
    verifies no secret among them."""
    return ArgsHash(args, kwargs).value


class ArgsHash:
    """The arguments of one call or effect, hashed under the current key; ``matches`` also
    accepts what rows written under a fallback key or before hashes were keyed hold."""

    __slots__ = ("_data", "_accepted", "value")

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self._data = _args_bytes(args, kwargs)
        self._accepted: set[str] | None = None
        self.value = keyed_hash(self._data)

    def matches(self, stored: str) -> bool:
        if stored == self.value:
            return True
        if self._accepted is None:
            self._accepted = accepted_hashes(self._data)
        return stored in self._accepted


class Context:
    """Handed to every step as its second argument."""

    def __init__(
        self,
        *,
        run_id: Any,
        agent: Any,
        step: str,
        base_id: int,
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
        settle: Callable[[], int] | None = None,
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
        self._base = base_id
        # The previous step's commit may still be in flight: ``settle`` waits for it and
        # returns its checkpoint's id, this step's base.
        self._settle = settle
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

    @property
    def _base_id(self) -> int:
        """The base checkpoint, durable: anything that leaves the process (a call, an
        effect, a record, a suspension) asks for it first."""
        self._settled()
        return self._base

    def _settled(self) -> None:
        """Before anything leaves the process: the previous step's commit is durable."""
        if self._settle is not None:
            self._base = self._settle()
            self._settle = None

    def _durable_point(self) -> None:
        """Before an effect, a suspension or a spawn: at the periodic level, the steps kept in
        memory so far are checkpointed first."""
        if self._before_durable is not None:
            self._before_durable()

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
        self._settled()
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
                return self._record_reused(reused, kind, key, occ)
            self.what_if.diverge(self, key)
        resource = self.agent.limits.get(key) if self.agent is not None else None
        if resource:
            self._take(resource)
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
            base_id=self._base_id,
            key=key,
            occurrence=occ,
            kind=kind,
            step=self.step,
            function=fname,
            args_hash=ahash.value,
            result=data.decode(),
            duration_ms=duration_ms,
            meta=meta or _llm_meta(value),
        )
        stored = self._record(entry)
        if stored is not entry:
            self._check_same("call", key, occ, stored, fname, ahash)
            data = stored.result.encode()
        return canonical.loads(data)

    def _take(self, resource: str) -> None:
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

    def _record(self, entry: JournalEntry) -> JournalEntry:
        """Insert-if-absent: the entry, or the one a worker that lost its lease recorded
        first (every replay must see the same answer). Kept in this step's records. The
        result is in hand: it is recorded once the database answers, not asked for again."""
        stored = outcome_recorded(lambda: journal.insert_if_absent(entry))
        if stored is entry:
            self.journal_writes += 1
        self._records.journal[(stored.key, stored.occurrence)] = stored
        return stored

    def _record_reused(self, source: JournalEntry, kind: str, key: str, occ: int) -> Any:
        entry = JournalEntry(
            run_id=self.run_id,
            base_id=self._base_id,
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
        entry = self._record(entry)
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

    # --- durable timers ---------------------------------------------------------------------

    def sleep(self, seconds: float, *, key: str = "sleep") -> None:
        """Wait ``seconds`` without holding a worker: the run is suspended and woken by the
        sweeper when the time is due; the step then runs again and this returns."""
        self._settled()
        self._durable_point()
        occ = self._next("journal", f"__sleep__:{key}")
        rec = self._records.journal.get((f"__sleep__:{key}", occ))
        if rec is None:
            wake_at = timezone.now() + timedelta(seconds=float(seconds))
            entry = JournalEntry(
                run_id=self.run_id,
                base_id=self._base_id,
                key=f"__sleep__:{key}",
                occurrence=occ,
                kind=CallKind.SLEEP,
                step=self.step,
                function="sleep",
                args_hash=args_hash((float(seconds),), {}),
                result=canonical.dumps({"wake_at": wake_at.isoformat()}).decode(),
            )
            rec = self._record(entry)
        wake_at = datetime.fromisoformat(canonical.loads(rec.result)["wake_at"])
        if wake_at <= timezone.now():
            return
        raise Suspend(
            Suspension(reason=WaitReason.TIMER, detail=f"sleep {key}", wake_at=wake_at),
        )

    # --- effects ----------------------------------------------------------------------------

    def effect(
        self,
        key: str,
        fn: Callable[..., Any],
        /,
        *args: Any,
        idempotent: bool = False,
        reconcile: Callable[[str], Any] | None = None,
        compensate: Callable[..., Any] | None = None,
        label: str = "",
        **kwargs: Any,
    ) -> Any:
        """Perform a side effect at most once per identity.

        ``fn`` is called as ``fn(*args, idempotency_key=..., **kwargs)``; pass the key on to
        the external system. The intent is committed before the call and the outcome after.
        If the process died in between, the outcome is unknown: an ``idempotent`` effect is
        simply repeated with the same key; otherwise ``reconcile(idempotency_key)`` is asked
        (return the result, ``NOT_DONE``, or ``None`` for "cannot tell"); failing that the
        run waits for an operator to say what happened ("in doubt").

        ``compensate``: how the effect is undone, offered when an operator rolls the run back
        past it. A function at the top level of one of the agent's own modules (it is stored
        by name), called as ``compensate(result, *args, idempotency_key=..., **kwargs)``
        with the effect's recorded result and arguments; it runs as an effect of its own.

        ``label``: what the effect does in the customer's terms ("refund 349 EUR on order
        A-1001"); rollback previews and the second-decision question say it instead of the
        key and the arguments (at most 200 characters).

        After a rollback, an effect with the key of one done on the abandoned branch is not
        performed again without a second decision (``_after_rollback``)."""
        self._settled()
        self._durable_point()
        undo = rollbacks.compensation_name(compensate) if compensate is not None else ""
        occ = self._next("effect", key)
        fname = function_name(fn)
        ahash = ArgsHash(args, kwargs)
        rec: Effect | None = self._records.effects.get((key, occ))
        if rec is not None and rec.status == EffectStatus.WOULD_RUN:
            return None
        if rec is None and self.what_if is not None and not self.what_if.live:
            return self._would_run(key, occ, fname, ahash, args, kwargs)
        if rec is not None:
            self._check_same("effect", key, occ, rec, fname, ahash)
            if rec.status == EffectStatus.DONE:
                Effect.objects.filter(pk=rec.pk).update(
                    duplicates_prevented=F("duplicates_prevented") + 1
                )
                telemetry.note("effect.not_repeated", key=key, idempotency_key=rec.idempotency_key)
                telemetry.count("duplicates_prevented")
                return canonical.loads(rec.result) if rec.result else None
            if rec.status == EffectStatus.FAILED and rec.resolved_by:
                raise EffectFailed(
                    f"effect {key!r} was marked failed by {rec.resolved_by}:"
                    f" {rec.resolution_note or rec.error}",
                    run_id=self.run_id,
                )
            if rec.status in (EffectStatus.PENDING, EffectStatus.IN_DOUBT) and not (
                rec.idempotent or idempotent
            ):
                known, value = self._reconcile(rec, key, reconcile)
                if known:
                    return value
            return self._perform(rec, fn, args, kwargs)
        if not key.startswith(rollbacks.COMPENSATION_KEY):
            outcome = self._after_rollback(key, occ, fname, ahash, args, kwargs, label)
            if outcome is not _PERFORM:
                return outcome
        rec = self._new_effect(
            key,
            occ,
            fname,
            ahash,
            args,
            kwargs,
            EffectStatus.PENDING,
            idempotent=idempotent,
            compensate=undo,
            label=str(label)[:200],
        )
        fault("after_intent", run=self.run_id, step=self.step, key=key, seq=self.seq)
        return self._perform(rec, fn, args, kwargs)

    # --- after a rollback -----------------------------------------------------------------

    def _after_rollback(
        self,
        key: str,
        occ: int,
        fname: str,
        ahash: ArgsHash,
        args: tuple,
        kwargs: dict,
        label: str = "",
    ) -> Any:
        """A new effect: if a rollback abandoned one with this key, do what it said (reuse the
        recorded outcome, perform again) or ask an operator, with both argument sets side by
        side. ``_PERFORM``: go on and perform it. A rejection raises ``EffectFailed`` into the
        step (uncaught, the run fails with it): the operator said not to do it again."""
        match = self._abandoned_match(key, occ)
        if match is None or match.choice in (Repeat.AGAIN, Repeat.COMPENSATE):
            return _PERFORM
        old = match.effect
        same = old.function == fname and ahash.matches(old.args_hash)
        if match.choice == Repeat.REUSE and same and old.status == EffectStatus.DONE:
            return self._reuse(old, key, occ, fname, ahash, args, kwargs)
        now_args, _ = redact(_jsonable([list(args), kwargs]), self.secrets)
        then_args = canonical.loads(old.args) if old.args else None
        before = old.label or rollbacks.describe(key, then_args)
        after = label or rollbacks.describe(key, now_args)
        done = "was done" if old.status == EffectStatus.DONE else "may have been done"
        question = f"{before} {done} on the abandoned branch; perform {after}?"
        if match.choice == Repeat.REUSE:
            question += " (The rollback said to reuse its outcome, but the arguments differ.)"
        payload = {
            "question": question,
            "done on the abandoned branch": {
                "arguments": then_args,
                "result": canonical.loads(old.result) if old.result else None,
                "idempotency key": old.idempotency_key,
            },
            "to perform now": {"arguments": now_args},
            "if approved": "it is performed again, with a new idempotency key",
            "if rejected": "it is not performed; the step gets an error (the run fails"
            " unless the agent handles it)",
        }
        decision = self.approval(rollbacks.REPEAT_APPROVAL + key, payload)
        if decision:
            return _PERFORM
        raise EffectFailed(
            f"effect {key!r} was not performed again: {decision.by or 'an operator'} rejected"
            f" repeating what the abandoned branch did ({before})"
            f"{': ' + decision.comment if decision.comment else ''}",
            run_id=self.run_id,
        )

    def _abandoned_match(self, key: str, occ: int) -> AbandonedEffect | None:
        """The abandoned effect this new one stands for: the one already matched to this
        identity (a replay), or the first unmatched one with this key whose rollback is on the
        run's current branch, matched now under the lease."""
        if key not in self._records.abandoned_keys:
            return None  # no effect with this key was left behind: no query
        base = self._base_id
        rows = list(
            AbandonedEffect.objects.filter(run_id=self.run_id, key=key)
            .filter(Q(settled_base=None) | Q(settled_base_id=base, settled_occurrence=occ))
            .select_related("effect")
            .order_by("id")
        )
        if not rows:
            return None
        for row in rows:
            if row.settled_base_id == base:
                return row
        parents = dict(Checkpoint.objects.filter(run_id=self.run_id).values_list("id", "parent_id"))
        branch, cp = set(), base
        while cp is not None and cp not in branch:
            branch.add(cp)
            cp = parents.get(cp)
        for row in rows:
            if row.rollback_id not in branch:
                continue
            with transaction.atomic():
                self._fence()
                taken = AbandonedEffect.objects.filter(pk=row.pk, settled_base=None).update(
                    settled_base_id=base, settled_occurrence=occ
                )
            if taken:
                return row
        return None

    def _reuse(
        self,
        old: Effect,
        key: str,
        occ: int,
        fname: str,
        ahash: ArgsHash,
        args: tuple,
        kwargs: dict,
    ) -> Any:
        """Record the abandoned effect's outcome as this one's, performing nothing."""

        def reused(rec: Effect) -> None:
            Event.objects.create(
                run_id=self.run_id,
                kind=EventKind.EFFECT_REUSED,
                seq=self.seq,
                step=self.step,
                worker=self.worker,
                data=canonical.dumps(
                    {
                        "effect": rec.pk,
                        "from": old.pk,
                        "idempotency_key": old.idempotency_key,
                        "key": key,
                    }
                ).decode(),
            )

        self._new_effect(
            key,
            occ,
            fname,
            ahash,
            args,
            kwargs,
            EffectStatus.DONE,
            compensate=old.compensate,
            then=reused,
            result=old.result,
            completed_at=timezone.now(),
            resolution_note=f"reused the recorded outcome of effect {old.pk} (abandoned branch)",
        )
        telemetry.note("effect.reused", key=key, source=old.pk)
        return canonical.loads(old.result) if old.result else None

    def run_compensations(self) -> None:
        """Before the first step after a rollback: the compensations the operator ticked,
        each an effect of its own (journaled under this base, its own idempotency key, in
        doubt if the process dies mid-call), in the order the undone effects were done."""
        for row in self._records.compensations:
            old = row.effect
            try:
                fn = rollbacks.compensation(self.agent, old.compensate)
            except LookupError as exc:
                raise EffectFailed(
                    f"effect {old.key!r} cannot be compensated: {exc}", run_id=self.run_id
                ) from None
            args, kwargs = canonical.loads(old.args) if old.args else ([], {})
            result = canonical.loads(old.result) if old.result else None
            key = f"{rollbacks.COMPENSATION_KEY}{old.pk}"
            value = self.effect(key, fn, result, *args, **kwargs)
            done = self._records.effects[(key, self._occurrences[("effect", key)] - 1)]
            marker = f'"compensation":{done.pk},'
            if not Event.objects.filter(
                run_id=self.run_id, kind=EventKind.COMPENSATED, data__contains=marker
            ).exists():
                Event.objects.create(
                    run_id=self.run_id,
                    kind=EventKind.COMPENSATED,
                    seq=self.seq,
                    step=self.step,
                    worker=self.worker,
                    reason=f"{old.label or rollbacks.describe(old.key, [args, kwargs])} undone",
                    data=canonical.dumps(
                        {
                            "compensation": done.pk,
                            "effect": old.pk,
                            "function": old.compensate,
                            "idempotency_key": done.idempotency_key,
                            "key": old.key,
                            "result": value,
                        }
                    ).decode(),
                )

    def _would_run(
        self, key: str, occ: int, fname: str, ahash: ArgsHash, args: tuple, kwargs: dict
    ) -> None:
        """A what-if fork that is not live records the effect it would have run, with its
        arguments, and runs nothing."""
        self._new_effect(key, occ, fname, ahash, args, kwargs, EffectStatus.WOULD_RUN)
        telemetry.note("effect.would_run", key=key)
        return None

    def _new_effect(
        self,
        key: str,
        occ: int,
        fname: str,
        ahash: ArgsHash,
        args: tuple,
        kwargs: dict,
        status: str,
        *,
        idempotent: bool = False,
        compensate: str = "",
        then: Callable[[Effect], None] | None = None,
        **recorded: Any,
    ) -> Effect:
        """Record an effect (its intent, what a what-if fork would have run, or an outcome
        reused: ``recorded`` fields), fenced: a worker that lost its lease records nothing.
        ``then`` writes in the same transaction, once the row has its id."""
        args_json, _ = redact(_jsonable([list(args), kwargs]), self.secrets)
        rec = Effect(
            run_id=self.run_id,
            base_id=self._base_id,
            key=key,
            occurrence=occ,
            step=self.step,
            function=fname,
            args=canonical.dumps(args_json).decode(),
            args_hash=ahash.value,
            idempotency_key=f"{self.run_id}:{self._base_id}:{key}:{occ}",
            idempotent=idempotent,
            status=status,
            compensate=compensate,
            **recorded,
        )
        with transaction.atomic():
            self._fence()
            rec.save(force_insert=True)
            if then is not None:
                then(rec)
        self._records.effects[(key, occ)] = rec
        return rec

    def _fence(self) -> None:
        """Inside a transaction: lock the run row and check the lease is still ours."""
        if (
            not Run.objects.select_for_update()
            .filter(pk=self.run_id, lease_token=self._token)
            .exists()
        ):
            raise LeaseLost(f"run {self.run_id}: lease lost before an effect", guard="lease")

    def _perform(self, rec: Effect, fn: Callable, args: tuple, kwargs: dict) -> Any:
        def begin() -> None:
            with transaction.atomic():
                self._fence()
                Effect.objects.filter(pk=rec.pk).update(
                    attempts=F("attempts") + 1, status=EffectStatus.PENDING
                )

        # Waited out here, a database outage cannot leave the effect pending in this
        # process's records as if it had been called: it has not been, yet.
        outcome_recorded(begin)
        with telemetry.effect(rec.key, rec.idempotency_key, rec.function) as span:
            try:
                value = fn(*args, idempotency_key=rec.idempotency_key, **kwargs)
            except BaseException as exc:
                if isinstance(exc, Exception):
                    retry = isinstance(exc, Transient) or self.agent.is_transient(exc)

                    def record_failure(exc: BaseException = exc) -> None:
                        Effect.objects.filter(pk=rec.pk, status=EffectStatus.PENDING).update(
                            status=EffectStatus.RETRY if retry else EffectStatus.FAILED,
                            error=f"{type(exc).__name__}: {exc}"[:2000],
                        )

                    outcome_recorded(record_failure)
                    telemetry.set_attributes(
                        span, **{"durability.effect.outcome": "retry" if retry else "failed"}
                    )
                raise
            telemetry.set_attributes(span, **{"durability.effect.outcome": "done"})
        fault("after_effect", run=self.run_id, step=self.step, key=rec.key, seq=self.seq)
        canonical.check_json(value, what=f"result of effect {rec.key!r}")
        value, _ = redact(value, self.secrets)
        data = canonical.dumps(value).decode()
        # The outcome is in hand: recorded once the database answers (an outage is waited
        # out), never left for the next attempt to find pending and put in doubt.
        unfinished = Effect.objects.filter(pk=rec.pk).exclude(status=EffectStatus.DONE)
        updated = outcome_recorded(
            lambda: unfinished.update(
                status=EffectStatus.DONE, result=data, completed_at=Now(), error=""
            )
        )
        if not updated:
            stored = Effect.objects.filter(pk=rec.pk).values_list("result", flat=True)
            data = outcome_recorded(stored.first)
        else:
            # The outcome is recorded whoever holds the run now (unfenced: it happened). If
            # the run was meanwhile given to another worker that found the effect unfinished
            # and suspended it in doubt, nobody else would wake it: the outcome is known now.
            outcome_recorded(lambda: dispatch.wake(self.run_id, WaitReason.IN_DOUBT))
        rec.status, rec.result = EffectStatus.DONE, data
        return canonical.loads(data) if data else None

    def _reconcile(
        self, rec: Effect, key: str, reconcile: Callable[[str], Any] | None
    ) -> tuple[bool, Any]:
        """An effect whose outcome is unknown: ``(True, result)`` when reconciling found it
        done, ``(False, None)`` when it surely did not happen; otherwise suspend in doubt."""
        if reconcile is not None:
            outcome = reconcile(rec.idempotency_key)
            if outcome is NOT_DONE:
                return False, None
            if outcome is not None:
                canonical.check_json(outcome, what=f"reconciled result of effect {key!r}")
                data = canonical.dumps(outcome).decode()
                Effect.objects.filter(pk=rec.pk).exclude(status=EffectStatus.DONE).update(
                    status=EffectStatus.DONE,
                    result=data,
                    completed_at=Now(),
                    resolution_note="reconciled",
                )
                rec.status, rec.result = EffectStatus.DONE, data
                return True, canonical.loads(data)
        effect_id = rec.pk

        def mark_in_doubt() -> None:
            Effect.objects.filter(pk=effect_id, status=EffectStatus.PENDING).update(
                status=EffectStatus.IN_DOUBT
            )
            if rec.status != EffectStatus.IN_DOUBT:
                telemetry.count("in_doubt")
                telemetry.note("effect.in_doubt", key=key, idempotency_key=rec.idempotency_key)
                Event.objects.create(
                    run_id=self.run_id,
                    kind=EventKind.EFFECT_IN_DOUBT,
                    seq=self.seq,
                    step=self.step,
                    worker=self.worker,
                    data=canonical.dumps(
                        {"effect": effect_id, "key": key, "idempotency_key": rec.idempotency_key}
                    ).decode(),
                )

        def resolved() -> bool:
            return (
                Effect.objects.filter(
                    pk=effect_id, status__in=(EffectStatus.DONE, EffectStatus.RETRY)
                ).exists()
                or Effect.objects.filter(pk=effect_id, status=EffectStatus.FAILED)
                .exclude(resolved_by="")
                .exists()
            )

        raise Suspend(
            Suspension(
                reason=WaitReason.IN_DOUBT,
                detail=f"effect {key} in doubt",
                write=mark_in_doubt,
                ready=resolved,
            ),
        )

    # --- messages -------------------------------------------------------------------------

    def wait_for(self, name: str) -> Any:
        """The next message named ``name`` sent to this run (in arrival order), waiting for it
        without holding a worker if none has arrived. A replay gets the same message."""
        self._settled()
        self._durable_point()
        occ = self._next("message", name)
        rec = self._records.messages.get((name, occ))
        if rec is not None:
            return canonical.loads(rec.data)
        with transaction.atomic():
            self._fence()  # the run's row lock also orders this against send()
            message = (
                Message.objects.select_for_update()
                .filter(run_id=self.run_id, name=name, consumed_base=None)
                .order_by("id")
                .first()
            )
            if message is not None:
                Message.objects.filter(pk=message.pk).update(
                    consumed_base_id=self._base_id, consumed_occurrence=occ, consumed_at=Now()
                )
                Event.objects.create(
                    run_id=self.run_id,
                    kind=EventKind.MESSAGE_CONSUMED,
                    seq=self.seq,
                    step=self.step,
                    worker=self.worker,
                    data=canonical.dumps({"name": name, "message": message.pk}).decode(),
                )
        if message is not None:
            self._records.messages[(name, occ)] = message
            return canonical.loads(message.data)
        run_id = self.run_id

        def arrived() -> bool:
            return Message.objects.filter(run_id=run_id, name=name, consumed_base=None).exists()

        raise Suspend(Suspension(reason=WaitReason.MESSAGE, detail=name, ready=arrived))

    # --- child runs ---------------------------------------------------------------------------

    def spawn(self, agent: str, input: Any = None, *, key: str | None = None) -> str:
        """Start a child run of ``agent`` and return its id. The child's row is the spawn's
        record, created under this run's lease: a re-run of the step finds it, so a crash
        between spawning and recording never makes two children."""
        self._settled()
        self._durable_point()
        key = key or agent
        occ = self._next("spawn", key)
        child = self._records.children.get((key, occ))
        if child is None:
            from durability import operations

            with transaction.atomic():
                self._fence()
                parent = Run.objects.get(pk=self.run_id)
                child = operations.spawn_child(
                    parent, self._base_id, key, occ, agent, input, by=f"run:{self.run_id}"
                )
            self._records.children[(key, occ)] = child
            fault("after_spawn", run=self.run_id, step=self.step, key=key, seq=self.seq)
        return str(child.id)

    def join(self, children: list[str] | tuple[str, ...], *, key: str = "join") -> list[dict]:
        """Wait, without holding a worker, until every child has finished; returns one
        ``{"run", "agent", "status", "result", "error"}`` per child, in the order given
        (``result`` is a succeeded child's final state). Recorded once all have finished,
        so a replay sees the same answer even if a child is later resumed."""
        self._settled()
        self._durable_point()
        ids = [str(c) for c in children]
        record_key = f"__join__:{key}"
        recorded = (record_key, self._occurrences.get(("journal", record_key), 0)) in (
            self._records.journal
        )
        if recorded or _all_finished(ids):
            try:
                return self._journaled(CallKind.CALL, record_key, _join_results, (ids,), {})
            except ChildrenPending:
                pass  # a child was resumed between the two looks: wait again

        def finished() -> bool:
            return _all_finished(ids)

        raise Suspend(
            Suspension(reason=WaitReason.CHILDREN, detail=f"{len(ids)} child runs", ready=finished)
        )

    # --- approvals --------------------------------------------------------------------------

    def approval(
        self,
        name: str,
        payload: Any = None,
        *,
        editable: Any = None,
        validate: Callable[[Any, Any], str | None] | None = None,
        group: str = "",
        timeout: float | None = None,
        on_timeout: str = "reject",
        escalate_to: str = "",
    ) -> Decision:
        """Suspend the run until an operator approves or rejects; returns the ``Decision``.

        The step runs again after the decision, with its records replayed. Asking again with
        a different payload asks anew. Policy: only members of ``group`` may decide (any
        operator when empty); after ``timeout`` seconds without a decision the sweeper
        rejects, approves, or (``"escalate"``) re-addresses it to ``escalate_to`` and
        restarts the clock, rejecting if that group does not decide in time either.

        Approve with edits: ``editable`` (a pydantic model or a JSON Schema of an object)
        names the payload fields an operator may edit and their types; the others are
        read-only. ``validate(asked, edited)`` returns an error sentence or None and runs
        when the decision is recorded, in the process that records it: a module-level
        function in one of the agent's modules (see ``durability.approvals``). An edit that
        fails either is refused and nothing is recorded. ``Decision.payload`` is what was
        decided."""
        self._settled()
        self._durable_point()
        if on_timeout not in ("reject", "approve", "escalate"):
            raise ValueError(f"on_timeout must be reject, approve or escalate, not {on_timeout!r}")
        if on_timeout == "escalate" and not escalate_to:
            raise ValueError("on_timeout='escalate' needs escalate_to (a group)")
        occ = self._next("approval", name)
        canonical.check_json(payload, what=f"payload of approval {name!r}")
        spec = approvals.spec_for(
            name, payload, editable, validate, approvals.agent_modules(self.agent)
        )
        payload, _ = redact(payload, self.secrets)
        data = canonical.dumps(payload).decode()
        phash = canonical.sha256_hex(data.encode())
        rec: Approval | None = self._records.approvals.get((name, occ))
        if rec is not None and rec.payload_hash == phash:
            if rec.status in (ApprovalStatus.APPROVED, ApprovalStatus.REJECTED):
                if rec.pk not in self._waits_drawn:
                    self._waits_drawn.add(rec.pk)
                    telemetry.approval_wait(
                        name,
                        rec.requested_at,
                        rec.decided_at,
                        rec.status == ApprovalStatus.APPROVED,
                    )
                edited = canonical.loads(rec.edited_payload) if rec.edited_payload else payload
                return Decision(
                    approved=rec.status == ApprovalStatus.APPROVED,
                    by=rec.decided_by,
                    comment=rec.comment,
                    payload=edited,
                    at=rec.decided_at,
                )
            existing_id = rec.pk

            def decided() -> bool:
                return (
                    Approval.objects.filter(pk=existing_id)
                    .exclude(status=ApprovalStatus.PENDING)
                    .exists()
                )

            raise Suspend(Suspension(reason=WaitReason.APPROVAL, detail=name, ready=decided))
        superseded = rec.pk if rec is not None else None
        base_id, run_id, step, seq, worker = (
            self._base_id,
            self.run_id,
            self.step,
            self.seq,
            self.worker,
        )

        def ask() -> None:
            if superseded is not None:
                Approval.objects.filter(pk=superseded).update(status=ApprovalStatus.SUPERSEDED)
            Approval.objects.create(
                run_id=run_id,
                base_id=base_id,
                name=name,
                occurrence=occ,
                step=step,
                payload=data,
                payload_hash=phash,
                group=group,
                timeout_seconds=timeout,
                on_timeout=on_timeout if timeout else "",
                escalate_to=escalate_to,
                deadline=timezone.now() + timedelta(seconds=timeout) if timeout else None,
                editable=spec,
            )
            Event.objects.create(
                run_id=run_id,
                kind=EventKind.APPROVAL_REQUESTED,
                seq=seq,
                step=step,
                worker=worker,
                data=canonical.dumps({"name": name, "payload_bytes": len(data)}).decode(),
            )

        raise Suspend(Suspension(reason=WaitReason.APPROVAL, detail=name, write=ask))


class WhatIf:
    """What a what-if fork may reuse: the source run's records after the fork point, each at
    most once, matched by key, function and arguments, in the order they were recorded."""

    def __init__(self, run_id: Any, source_id: Any, from_seq: int, live: bool) -> None:
        self.run_id = run_id
        self.source_id = source_id
        self.from_seq = from_seq
        self.live = live
        self._pool: list[JournalEntry] | None = None
        self._diverged: bool | None = None

    def _candidates(self) -> list[JournalEntry]:
        if self._pool is None:
            used = set(
                JournalEntry.objects.filter(run_id=self.run_id)
                .exclude(reused_from=None)
                .values_list("reused_from", flat=True)
            )
            self._pool = [
                e
                for e in JournalEntry.objects.filter(
                    run_id=self.source_id, base__seq__gte=self.from_seq
                )
                .exclude(kind=CallKind.SLEEP)
                .order_by("id")
                if e.pk not in used
            ]
        return self._pool

    def take(self, key: str, function: str, ahash: ArgsHash) -> JournalEntry | None:
        pool = self._candidates()
        for i, entry in enumerate(pool):
            if entry.key == key and entry.function == function and ahash.matches(entry.args_hash):
                return pool.pop(i)
        return None

    def diverge(self, ctx: Context, key: str) -> None:
        """The first call the source never made: mark where the fork diverged, once."""
        if self._diverged is None:
            self._diverged = Event.objects.filter(
                run_id=self.run_id, kind=EventKind.DIVERGED
            ).exists()
        if self._diverged:
            return
        self._diverged = True
        Event.objects.create(
            run_id=self.run_id,
            kind=EventKind.DIVERGED,
            seq=ctx.seq,
            step=ctx.step,
            worker=ctx.worker,
            data=canonical.dumps({"key": key, "source": str(self.source_id)}).decode(),
        )


@dataclass
class Records:
    """The operations recorded from one base checkpoint, loaded once per step execution."""

    journal: dict[tuple[str, int], JournalEntry]
    effects: dict[tuple[str, int], Effect]
    approvals: dict[tuple[str, int], Approval]
    messages: dict[tuple[str, int], Message]
    children: dict[tuple[str, int], Run]
    # When the base is a rollback's new head: the compensations the operator ticked.
    compensations: list[AbandonedEffect] = field(default_factory=list)
    # Keys of the run's effects done on branches a rollback abandoned: only a new effect with
    # one of them can need a second decision. Read once per execution and carried to later
    # bases: a rollback that adds some bumps the lease token, so this execution is fenced
    # out at its next write before it could miss them.
    abandoned_keys: frozenset[str] = frozenset()

    @classmethod
    def empty(cls, abandoned_keys: frozenset[str] = frozenset()) -> Records:
        return cls({}, {}, {}, {}, {}, abandoned_keys=abandoned_keys)

    @classmethod
    def load(cls, base_id: int, run_id: Any) -> Records:
        abandoned = list(
            AbandonedEffect.objects.filter(run_id=run_id)
            .select_related("effect")
            .order_by("effect_id")
        )
        return cls(
            journal={
                (e.key, e.occurrence): e for e in JournalEntry.objects.filter(base_id=base_id)
            },
            effects={(e.key, e.occurrence): e for e in Effect.objects.filter(base_id=base_id)},
            approvals={
                (a.name, a.occurrence): a
                for a in Approval.objects.filter(base_id=base_id).exclude(
                    status=ApprovalStatus.SUPERSEDED
                )
            },
            messages={
                (m.name, m.consumed_occurrence): m
                for m in Message.objects.filter(consumed_base_id=base_id)
            },
            children={
                (r.spawn_key, r.spawn_occurrence): r
                for r in Run.objects.filter(spawn_base_id=base_id).only(
                    "id", "spawn_key", "spawn_occurrence"
                )
            },
            compensations=[
                a for a in abandoned if a.rollback_id == base_id and a.choice == Repeat.COMPENSATE
            ],
            abandoned_keys=frozenset(a.key for a in abandoned),
        )


class ChildrenPending(BaseException):  # noqa: N818 - a signal, not an error
    """Raised by ``_join_results`` inside the journaled call: nothing is recorded, and the
    step suspends until the children finish."""


def _all_finished(ids: list[str]) -> bool:
    from durability.models import FINISHED

    return not Run.objects.filter(pk__in=ids).exclude(status__in=FINISHED).exists()


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


def _jsonable(value: Any) -> Any:
    import orjson

    return orjson.loads(orjson.dumps(value, default=_unhashable, option=orjson.OPT_NON_STR_KEYS))


def _llm_meta(value: Any) -> str:
    """Model and token counts when a result looks like an OpenAI-style completion."""
    if isinstance(value, dict) and isinstance(value.get("usage"), dict):
        usage = value["usage"]
        meta = {
            "model": value.get("model"),
            "input_tokens": usage.get("prompt_tokens", usage.get("input_tokens")),
            "output_tokens": usage.get("completion_tokens", usage.get("output_tokens")),
        }
        return canonical.dumps(meta).decode()
    return ""
