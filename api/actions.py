"""Operator actions beyond start, resume and cancel: roll back (with a dry-run preview),
fork (with an edited state), legal hold, and resolving an effect in doubt. Each is the
engine's operation, which validates first and changes nothing when it refuses."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from ninja import Header, Router, Status

from api import common, present
from api.runs import ACT
from api.schemas import (
    EffectOut,
    ForkIn,
    HoldIn,
    ResolveIn,
    RollbackIn,
    RollbackOut,
    RunDetailOut,
)
from durability import operations, retention, rollbacks
from durability.errors import (
    DurabilityError,
    InvalidInput,
    SchemaViolation,
    StateNotJSON,
    StateTooLarge,
    UnknownCheckpoint,
    UnknownEffect,
)
from durability.models import Effect, Run

router = Router(tags=["actions"])

# The request field each engine refusal is about (``common.fields``); a refused decision
# names its field itself.
ROLLBACK_FIELDS: dict[type[DurabilityError], str] = {
    UnknownCheckpoint: "checkpoint",
    InvalidInput: "checkpoint",  # off the current branch, with messages it cannot replay
}
FORK_FIELDS: dict[type[DurabilityError], str] = {
    UnknownCheckpoint: "checkpoint",
    SchemaViolation: "state",
    StateNotJSON: "state",
    StateTooLarge: "state",
}


def _decisions(raw: dict[str, str]) -> dict[int, str]:
    decided = {}
    for key, choice in raw.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 18:
            raise InvalidInput(f"decisions: {key!r} is not an effect id", field="decisions")
        decided[int(key)] = choice
    return decided


def _plan_out(plan: Any, *, dry_run: bool, decisions: dict[int, str], run: Run | None, hold: bool):
    return {
        "run_id": str(plan.run.id),
        "target": plan.target.seq,
        # What a confirmation passes back as expected_head: the preview's own head.
        "preview_head": plan.run.head_seq if dry_run else None,
        "dry_run": dry_run,
        "will_run_from": plan.will_run_from,
        "effects": [
            {
                "id": e.id,
                "key": e.key,
                "what": e.what,
                "status": e.status,
                "seq": e.seq,
                "can_compensate": e.can_compensate,
                "choices": [value for value, _ in e.choices],
            }
            for e in plan.done_not_undone
        ],
        # Held or continued at once, as the request asks (``and_continue``).
        "sentences": plan.sentences(decisions, hold=hold),
        # A preview: whether the rollback it previews would hold the run.
        "held": bool(plan.will_run_from) and hold if dry_run else bool(plan.held),
        "new_head": plan.checkpoint.seq if getattr(plan, "checkpoint", None) else None,
        "run": present.run_detail(run) if run is not None else None,
    }


@router.post("/runs/{run_id}/rollback", response={200: RollbackOut, **ACT}, summary="Roll back")
def rollback(
    request: HttpRequest,
    run_id: str,
    body: RollbackIn,
    response: HttpResponse,
    if_match: str | None = Header(None, alias="If-Match", max_length=40),
):
    """Make a new head equal to checkpoint ``checkpoint`` (nothing is deleted). With
    ``dry_run``, only the preview: what will not be undone, what is compensated, what will
    be asked again. Effects done after the target are never performed again without a
    second decision (``decisions``)."""
    version = common.expected_version(if_match)
    decisions = _decisions(body.decisions)
    with common.acting_as(request) as by, common.fields(ROLLBACK_FIELDS):
        if body.dry_run:
            plan = operations.plan_rollback(run_id[:64], body.checkpoint)
            # Checked as the rollback itself checks them: a preview of decisions it would
            # refuse is no preview.
            try:
                decisions = rollbacks.check_decisions(plan.done_not_undone, decisions)
            except ValueError as exc:
                raise InvalidInput(str(exc), run_id=plan.run.id, field="decisions") from None
            return _plan_out(
                plan, dry_run=True, decisions=decisions, run=None, hold=not body.and_continue
            )
        done = operations.rollback(
            run_id[:64],
            body.checkpoint,
            by=by,
            reason=body.reason,
            and_continue=body.and_continue,
            decisions=decisions,
            expected_head=body.expected_head,
            expected_status=body.expected_status,
            expected_version=version,
        )
    run = Run.objects.get(pk=done.run.pk)
    response["ETag"] = common.etag(run.lease_token)
    return _plan_out(done, dry_run=False, decisions=done.decisions, run=run, hold=done.held)


@router.post("/runs/{run_id}/fork", response={201: RunDetailOut, **ACT}, summary="Fork")
def fork(request: HttpRequest, run_id: str, body: ForkIn, response: HttpResponse):
    """A new run from a checkpoint, optionally with an edited state (validated against the
    agent's schema; redacted values mean "unchanged"). ``what_if`` reuses recorded calls
    the edit did not change and records effects instead of running them."""
    with common.acting_as(request) as by, common.fields(FORK_FIELDS):
        run = operations.fork(
            run_id[:64],
            body.checkpoint,
            state=body.state,
            what_if=body.what_if,
            by=by,
            reason=body.reason,
        )
    response["Location"] = f"/api/v1/runs/{run.id}"
    response["ETag"] = common.etag(run.lease_token)
    return Status(201, present.run_detail(run))


@router.post("/runs/{run_id}/hold", response={200: RunDetailOut, **ACT}, summary="Legal hold")
def hold(
    request: HttpRequest,
    run_id: str,
    body: HoldIn,
    response: HttpResponse,
    if_match: str | None = Header(None, alias="If-Match", max_length=40),
):
    """Put a run on legal hold (never pruned or compacted), or release it. The request says
    which, so a repeat changes nothing. A hold leaves the run's version as it was: a worker
    executing the run holds that version and keeps working. With ``If-Match``, refused (409,
    DUR112) if the run moved on."""
    version = common.expected_version(if_match)
    with common.acting_as(request) as by:
        run = retention.hold(
            run_id[:64], on=body.hold, by=by, reason=body.reason, expected_version=version
        )
    run = Run.objects.get(pk=run.pk)
    response["ETag"] = common.etag(run.lease_token)
    return present.run_detail(run)


@router.post(
    "/runs/{run_id}/effects/{effect_id}/resolution",
    response={200: EffectOut, **ACT},
    summary="Resolve an effect in doubt",
)
def resolve(
    request: HttpRequest,
    run_id: str,
    effect_id: int,
    body: ResolveIn,
    if_match: str | None = Header(None, alias="If-Match", max_length=40),
):
    """Say what happened to an effect in doubt: ``done`` (with its ``result``), ``failed``,
    or ``retry`` (perform it again with the same idempotency key)."""
    version = common.expected_version(if_match)
    with common.acting_as(request) as by:
        run = operations.get_run(run_id[:64])
        if not Effect.objects.filter(run=run, pk=effect_id).exists():
            raise UnknownEffect(f"the run has no effect with id {effect_id}", run_id=run.id)
        effect = operations.resolve_effect(
            run.id,
            effect_id,
            outcome=body.outcome,
            result=body.result,
            by=by,
            note=body.note,
            expected_version=version,
        )
    return {
        "id": effect.id,
        "run_id": str(effect.run_id),
        "key": effect.key,
        "status": effect.status,
        "attempts": effect.attempts,
        "resolved_by": effect.resolved_by,
        "resolution_note": effect.resolution_note,
    }
