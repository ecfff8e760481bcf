"""``ctx.effect``: side effects performed at most once per identity, and what a rollback
asks of them (reuse the outcome, perform again, compensate, or ask an operator).

The intent is committed before the call and the outcome after; the idempotency key is passed
to the external system. An effect whose outcome is unknown (its process died between the two)
is repeated if declared idempotent, reconciled if it can be, and otherwise waits "in doubt"
for an operator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils import timezone

from durability import canonical, dispatch, events, telemetry
from durability import rollbacks as rollbacks
from durability.errors import EffectFailed, Suspend, Transient
from durability.models import (
    AbandonedEffect,
    Checkpoint,
    Effect,
    EffectStatus,
    Event,
    EventKind,
    Repeat,
    WaitReason,
)
from durability.redact import redact
from durability.runtime.faults import fault
from durability.runtime.records import ArgsHash, function_name, jsonable, outcome_recorded
from durability.runtime.waits import Suspension, Waits

if TYPE_CHECKING:
    from durability.runtime.records import Records, WhatIf
    from durability.runtime.sendahead import Settled

NOT_DONE = object()
"""What a ``reconcile`` function returns when it knows the effect did not happen."""

_PERFORM = object()


class Effects(Waits):
    """The effects half of ``context.Context``, which holds the state it reads (declared
    here, made there); an effect repeated after a rollback asks an approval (``Waits``)."""

    run_id: Any
    step: str
    seq: int
    worker: str
    agent: Any
    secrets: set[str]
    what_if: WhatIf | None
    _records: Records
    _occurrences: dict[tuple[str, str], int]

    if TYPE_CHECKING:

        def _check_same(
            self, what: str, key: str, occ: int, rec: Any, fn: str, ahash: ArgsHash
        ) -> None: ...

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
        key and the arguments (at most 200 characters). After a rollback, an effect with the
        key of one done on the abandoned branch is not performed again without a second
        decision (``_after_rollback``)."""
        proof = self._settled(durable=True)
        undo = rollbacks.compensation_name(compensate) if compensate is not None else ""
        occ = self._next("effect", key)
        fname = function_name(fn)
        ahash = ArgsHash(args, kwargs)
        rec: Effect | None = self._records.effects.get((key, occ))
        if rec is not None:
            return self._recorded(proof, rec, fn, ahash, args, kwargs, idempotent, reconcile)
        if self.what_if is not None and not self.what_if.live:
            return self._would_run(proof, key, occ, fname, ahash, args, kwargs)
        if not key.startswith(rollbacks.COMPENSATION_KEY):
            outcome = self._after_rollback(proof, key, occ, fname, ahash, args, kwargs, label)
            if outcome is not _PERFORM:
                return outcome
        rec = self._new_effect(
            proof,
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
        return self._perform(proof, rec, fn, args, kwargs)

    def _recorded(
        self,
        proof: Settled,
        rec: Effect,
        fn: Callable,
        ahash: ArgsHash,
        args: tuple,
        kwargs: dict,
        idempotent: bool,
        reconcile: Callable[[str], Any] | None,
    ) -> Any:
        """An effect this identity already recorded: its outcome, or (unknown) perform it
        again when that is safe, reconcile, or wait in doubt."""
        if rec.status == EffectStatus.WOULD_RUN:
            return None  # what a what-if fork that is not live would have run
        key = rec.key
        self._check_same("effect", key, rec.occurrence, rec, function_name(fn), ahash)
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
            known, value = self._reconcile(proof, rec, key, reconcile)
            if known:
                return value
        return self._perform(proof, rec, fn, args, kwargs)

    # --- after a rollback -----------------------------------------------------------------

    def _after_rollback(
        self,
        proof: Settled,
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
        match = self._abandoned_match(proof, key, occ)
        if match is None or match.choice in (Repeat.AGAIN, Repeat.COMPENSATE):
            return _PERFORM
        old = match.effect
        same = old.function == fname and ahash.matches(old.args_hash)
        if match.choice == Repeat.REUSE and same and old.status == EffectStatus.DONE:
            return self._reuse(proof, old, key, occ, fname, ahash, args, kwargs)
        now_args, _ = redact(jsonable([list(args), kwargs]), self.secrets)
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
        # Approved or rejected as asked: what is performed is what the question shows.
        decision = self.approval(rollbacks.REPEAT_APPROVAL + key, payload, editable=False)
        if decision:
            return _PERFORM
        raise EffectFailed(
            f"effect {key!r} was not performed again: {decision.by or 'an operator'} rejected"
            f" repeating what the abandoned branch did ({before})"
            f"{': ' + decision.comment if decision.comment else ''}",
            run_id=self.run_id,
        )

    def _abandoned_match(self, proof: Settled, key: str, occ: int) -> AbandonedEffect | None:
        """The abandoned effect this new one stands for: the one already matched to this
        identity (a replay), or the first unmatched one with this key whose rollback is on the
        run's current branch, matched now under the lease."""
        if key not in self._records.abandoned_keys:
            return None  # no effect with this key was left behind: no query
        base = proof.base_id
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
        branch: set[int] = set()
        cp: int | None = base
        while cp is not None and cp not in branch:
            branch.add(cp)
            cp = parents.get(cp)
        for row in rows:
            if row.rollback_id not in branch:
                continue
            with transaction.atomic():
                self._fence(proof)
                taken = AbandonedEffect.objects.filter(pk=row.pk, settled_base=None).update(
                    settled_base_id=base, settled_occurrence=occ
                )
            if taken:
                return row
        return None

    def _reuse(
        self,
        proof: Settled,
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
            event = events.effect_reused(
                self.run_id,
                effect=rec.pk,
                source=old.pk,
                idempotency_key=old.idempotency_key,
                key=key,
                **self._here(),
            )
            events.record(event)

        self._new_effect(
            proof,
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
        if not self._records.compensations:
            return
        self._settled()  # its events are written outside the effects
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
                compensation = {
                    "compensation": done.pk,
                    "effect": old.pk,
                    "function": old.compensate,
                    "idempotency_key": done.idempotency_key,
                    "key": old.key,
                    "result": value,
                }
                what = rollbacks.words_for(old)
                # The operator who ticked it at the rollback: the audit log's row is theirs.
                chooser = (
                    Event.objects.filter(
                        run_id=self.run_id, kind=EventKind.ROLLBACK, seq=row.rollback.seq
                    )
                    .values_list("actor", flat=True)
                    .first()
                )
                made = events.compensated(
                    self.run_id,
                    what=what,
                    compensation=compensation,
                    by=chooser or "",
                    **self._here(),
                )
                events.record(made)

    def _would_run(
        self,
        proof: Settled,
        key: str,
        occ: int,
        fname: str,
        ahash: ArgsHash,
        args: tuple,
        kwargs: dict,
    ) -> None:
        """A what-if fork that is not live records the effect it would have run, with its
        arguments, and runs nothing."""
        self._new_effect(proof, key, occ, fname, ahash, args, kwargs, EffectStatus.WOULD_RUN)
        telemetry.note("effect.would_run", key=key)
        return None

    def _new_effect(
        self,
        proof: Settled,
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
        args_json, _ = redact(jsonable([list(args), kwargs]), self.secrets)
        rec = Effect(
            run_id=self.run_id,
            base_id=proof.base_id,
            key=key,
            occurrence=occ,
            step=self.step,
            function=fname,
            args=canonical.dumps(args_json).decode(),
            args_hash=ahash.value,
            idempotency_key=f"{self.run_id}:{proof.base_id}:{key}:{occ}",
            idempotent=idempotent,
            status=status,
            compensate=compensate,
            **recorded,
        )
        with transaction.atomic():
            self._fence(proof)
            rec.save(force_insert=True)
            if then is not None:
                then(rec)
        self._records.effects[(key, occ)] = rec
        return rec

    def _perform(self, proof: Settled, rec: Effect, fn: Callable, args: tuple, kwargs: dict) -> Any:
        def begin() -> None:
            with transaction.atomic():
                self._fence(proof)
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
            data = outcome_recorded(stored.first) or ""  # "": the row went with its run
        else:
            # The outcome is recorded whoever holds the run now (unfenced: it happened). If
            # the run was meanwhile given to another worker that found the effect unfinished
            # and suspended it in doubt, nobody else would wake it: the outcome is known now.
            outcome_recorded(lambda: dispatch.wake(self.run_id, WaitReason.IN_DOUBT))
        rec.status, rec.result = EffectStatus.DONE, data
        return canonical.loads(data) if data else None

    def _reconcile(
        self, proof: Settled, rec: Effect, key: str, reconcile: Callable[[str], Any] | None
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
                doubt = events.effect_in_doubt(
                    self.run_id,
                    effect=effect_id,
                    key=key,
                    idempotency_key=rec.idempotency_key,
                    **self._here(),
                )
                events.record(doubt)

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
