"""Resolving an effect in doubt."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models.functions import Now

from durability import canonical, dispatch, events
from durability.errors import InvalidInput, InvalidTransition, Stale, UnknownEffect
from durability.langgraph.runs import refuse_outside_workers
from durability.models import Effect, EffectStatus, Run, RunStatus, WaitReason
from durability.operations._runs import _check_version, _locked


def resolve_effect(
    ref: Any,
    effect_id: int,
    *,
    outcome: str,
    result: Any = None,
    by: str = "",
    note: str = "",
    expected_attempts: int | None = None,
    expected_version: int | None = None,
) -> Effect:
    """Say what happened to an effect in doubt: ``done`` (with its result), ``failed``
    (raised into the step as ``EffectFailed``) or ``retry`` (perform it again, same key).
    ``expected_attempts``: the attempts the operator saw; if the effect was performed again
    since (a colleague chose retry), what they checked is out of date and it is refused.
    ``expected_version``: the run version the operator saw; a retry is performed by a new
    claim, which moves it on, so a repeated resolve never settles the next attempt."""
    if outcome not in ("done", "failed", "retry"):
        raise InvalidInput(f"outcome must be done, failed or retry, not {outcome!r}")
    if outcome != "done" and result is not None:
        # Dropped silently, the operator would believe the step receives it.
        raise InvalidInput(
            f"a result goes with done only: an effect marked {outcome} returns none to its"
            " step; nothing was changed"
        )
    with transaction.atomic():
        run = _locked(ref)
        refuse_outside_workers(run, "resolve an effect of it")
        effect = _resolvable(run, effect_id, expected_attempts)
        _check_version(run, expected_version)
        fields: dict[str, Any] = {"resolved_by": by, "resolution_note": note}
        if outcome == "done":
            canonical.check_json(result, what="effect result")
            fields.update(
                status=EffectStatus.DONE,
                result=canonical.dumps(result).decode(),
                completed_at=Now(),
            )
        elif outcome == "failed":
            fields.update(status=EffectStatus.FAILED, error=note or "marked failed")
        else:
            fields.update(status=EffectStatus.RETRY)
        Effect.objects.filter(pk=effect.pk).update(**fields)
        events.effect_resolved(
            run, by=by, reason=note, effect=effect.pk, key=effect.key, outcome=outcome
        ).save()
        if run.status == RunStatus.WAITING and run.wait_reason == WaitReason.IN_DOUBT:
            dispatch.wake(run.id)
        effect.refresh_from_db()
    return effect


def _resolvable(run: Run, effect_id: int, expected_attempts: int | None) -> Effect:
    """The run's effect ``effect_id``, if an operator may say what happened to it now."""
    effect = Effect.objects.filter(run=run, pk=effect_id).first()
    if effect is None:
        raise UnknownEffect(f"run has no effect {effect_id}", run_id=run.id)
    if effect.status not in (EffectStatus.IN_DOUBT, EffectStatus.PENDING):
        raise InvalidTransition(
            f"effect {effect.key!r} is {effect.status}; only an effect in doubt can be resolved",
            run_id=run.id,
        )
    if effect.status == EffectStatus.PENDING and run.status == RunStatus.RUNNING:
        # Pending with its worker gone (the run queued again, not yet claimed) is in doubt
        # in all but name; pending while the run runs is being performed now, and the
        # worker's own outcome would overwrite the operator's.
        worker = f" by {run.lease_owner}" if run.lease_owner else ""
        raise InvalidTransition(
            f"effect {effect.key!r} is being performed now{worker}; only an effect in doubt"
            " can be resolved: nothing was changed (if its worker is dead, the run is"
            " recovered and the effect found in doubt within the lease)",
            run_id=run.id,
        )
    if expected_attempts is not None and effect.attempts != expected_attempts:
        raise Stale(
            f"effect {effect.key!r} was performed again since this was shown (attempt"
            f" {effect.attempts}, not {expected_attempts}); review it again",
            run_id=run.id,
        )
    return effect
