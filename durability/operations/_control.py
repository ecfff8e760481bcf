"""Resuming and cancelling runs."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from durability import checkpoints, dispatch, events, lifecycle
from durability.errors import InvalidTransition
from durability.langgraph.runs import refuse_outside_workers
from durability.models import FINISHED, Approval, ApprovalStatus, Run, RunStatus, WaitReason
from durability.operations._runs import _check_status, _check_version, _checkpoint_of, _locked
from durability.operations._start import wake_parent

# Waits that end by themselves or by someone's decision, never by a resume: what ends each.
WAKES_BY_ITSELF: dict[str, str] = {
    WaitReason.APPROVAL: "an approval: it continues once someone decides it in the inbox",
    WaitReason.MESSAGE: "a message: it continues when the message arrives (send it)",
    WaitReason.TIMER: "a timer: it continues by itself when the time is due",
    WaitReason.RATE_LIMIT: "a shared rate limit: it continues by itself when a slot frees",
    WaitReason.CHILDREN: "its child runs: it continues by itself when they have finished",
}


def resume(
    ref: Any,
    *,
    by: str = "",
    reason: str = "",
    expected_status: str | None = None,
    expected_version: int | None = None,
) -> Run:
    """Queue a failed, cancelled or held run (on hold after a rollback: "continue") again
    from its head checkpoint, which must verify first. A run waiting for what wakes it by
    itself or by a decision (``WAKES_BY_ITSELF``: an approval, a message, a timer, its
    children) is refused with what it waits for. ``expected_status`` and
    ``expected_version``: the status and version the operator saw; refused (``Stale``) if
    either changed."""
    with transaction.atomic():
        run = _locked(ref)
        refuse_outside_workers(run, "resume it")
        _check_status(run, expected_status)
        # Before the status's own refusals: a retried request (the run queued by its first
        # copy) is stale, as documented, not "already queued".
        _check_version(run, expected_version)
        if run.status == RunStatus.SUCCEEDED:
            raise InvalidTransition(
                "the run succeeded; there is nothing to resume (roll back or fork it to run"
                " part of it again)",
                run_id=run.id,
            )
        if run.status in (RunStatus.QUEUED, RunStatus.RUNNING):
            raise InvalidTransition(f"the run is already {run.status}", run_id=run.id)
        if run.status == RunStatus.WAITING and run.wait_reason in WAKES_BY_ITSELF:
            raise InvalidTransition(
                f"the run waits for {WAKES_BY_ITSELF[run.wait_reason]}"
                f"{' (' + run.wait_detail + ')' if run.wait_detail else ''}; resuming it would"
                " only run the step to the same wait again",
                run_id=run.id,
            )
        head = _checkpoint_of(run, run.head_seq)
        checkpoints.verified_state(head)  # refuse to queue what cannot be rehydrated
        previous = run.status
        lifecycle.resume(run)
        events.record(events.resumed(run, by=by, reason=reason, previous=previous))
        dispatch.ring(run.id)
    return run


def cancel(
    ref: Any,
    *,
    by: str = "",
    reason: str = "",
    expected_status: str | None = None,
    expected_version: int | None = None,
) -> Run:
    """Stop a run for good, and its unfinished child runs with it. A worker executing it is
    fenced out at its next write. ``expected_status`` and ``expected_version``: the status
    and version the operator saw; refused (``Stale``) if either changed, e.g. a colleague
    resumed the run after this cancel landed."""
    with transaction.atomic():
        run = _cancel_tree(
            ref,
            by=by,
            reason=reason,
            expected_status=expected_status,
            expected_version=expected_version,
        )
    wake_parent(run)
    return run


def _cancel_tree(
    ref: Any,
    *,
    by: str,
    reason: str,
    expected_status: str | None = None,
    expected_version: int | None = None,
) -> Run:
    """Cancel a run and every unfinished descendant, inside the caller's transaction."""
    run = _cancel_one(
        ref,
        by=by,
        reason=reason,
        expected_status=expected_status,
        expected_version=expected_version,
    )
    pending = [run.id]
    while pending:
        children = list(Run.objects.filter(parent_run_id__in=pending).exclude(status__in=FINISHED))
        for child in children:
            _cancel_one(child.id, by=by, reason=f"ancestor {run.id} cancelled")
        pending = [c.id for c in children]
    return run


def _cancel_one(
    ref: Any,
    *,
    by: str,
    reason: str,
    expected_status: str | None = None,
    expected_version: int | None = None,
) -> Run:
    """Inside the caller's transaction."""
    run = _locked(ref)
    refuse_outside_workers(run, "cancel it")
    _check_status(run, expected_status)
    _check_version(run, expected_version)
    if run.status in FINISHED:
        raise InvalidTransition(f"the run is already {run.status}", run_id=run.id)
    lifecycle.cancel(run)
    Approval.objects.filter(run=run, status=ApprovalStatus.PENDING).update(
        status=ApprovalStatus.SUPERSEDED, comment="run cancelled"
    )
    events.record(events.cancelled(run, by=by, reason=reason))
    return run
