"""Deciding approvals: by an operator, or by the policy when the deadline passes."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q
from django.db.models.functions import Now

from durability import approvals, canonical, dispatch, events, leases, lifecycle
from durability.errors import (
    AlreadyDecided,
    InvalidInput,
    InvalidTransition,
    NotAllowed,
    UnknownApproval,
)
from durability.langgraph.runs import refuse_outside_workers
from durability.models import Approval, ApprovalStatus, Run, RunStatus, WaitReason
from durability.operations._runs import _check_version, _locked
from durability.redact import redact, restore_placeholders


def decide(
    ref: Any,
    name: str | None = None,
    *,
    approve: bool,
    by: str = "",
    comment: str = "",
    payload: Any = None,
    approval_id: int | None = None,
    expected_version: int | None = None,
) -> Approval:
    """Record the decision on a pending approval. The first decision wins; a second one is
    refused with who decided and when. An approval named by ``approval_id`` is decided once
    by its own status; one named by ``name`` may be asked again under that name after the
    run went on, so ``expected_version`` (the run version the decision was made on) keeps a
    repeated decision from settling the new question too. An edited ``payload`` must pass
    the agent's editable schema and check (``EditRefused``, nothing recorded); both the
    asked and the decided payload are kept, and the decision's event lists what changed. A
    rejection says why (``comment``): the step that asked reads it, and so does the audit
    trail; the dashboard, the CLI and the API alike."""
    if not approve and not str(comment or "").strip():
        raise InvalidInput(
            "say why you reject it (a comment): the step that asked and the audit trail get"
            " the reason; nothing was decided",
            field="comment",
        )
    with transaction.atomic():
        run = _locked(ref)
        refuse_outside_workers(run, "decide an approval on it")
        pending = _pending(run, name, approval_id)
        _check_version(run, expected_version)
        check_may_decide(pending, by)
        edited, changes = _edited(run, pending, approve, payload)
        updated = Approval.objects.filter(pk=pending.pk, status=ApprovalStatus.PENDING).update(
            status=ApprovalStatus.APPROVED if approve else ApprovalStatus.REJECTED,
            decided_by=by,
            decided_at=Now(),
            comment=comment,
            edited_payload=edited,
        )
        if not updated:  # pragma: no cover - the run lock makes this unreachable
            raise AlreadyDecided("the approval was decided meanwhile", run_id=run.id)
        decided = {"name": pending.name, "approved": approve, "edited": bool(edited)}
        if changes:
            decided["changes"] = changes
        events.record(events.approval_decided(run, by=by, reason=comment, data=decided))
        lifecycle.decided(run.id)
        if run.status == RunStatus.WAITING and run.wait_reason == WaitReason.APPROVAL:
            dispatch.wake(run.id)
        pending.refresh_from_db()
    return pending


def _pending(run: Run, name: str | None, approval_id: int | None) -> Approval:
    """The pending approval a decision names; refused, saying why, if there is none."""
    asked = Approval.objects.filter(run=run)
    asked = asked.filter(pk=approval_id) if approval_id is not None else asked.filter(name=name)
    pending = asked.filter(status=ApprovalStatus.PENDING).order_by("-id").first()
    if pending is not None:
        return pending
    last = asked.order_by("-id").first()
    if last is None:
        waiting = Approval.objects.filter(run=run, status=ApprovalStatus.PENDING)
        names = ", ".join(waiting.values_list("name", flat=True)) or "none"
        raise UnknownApproval(
            f"no approval {name or approval_id!r} was asked (pending: {names})", run_id=run.id
        )
    if last.status == ApprovalStatus.SUPERSEDED:
        raise InvalidTransition(
            f"approval {last.name!r} was superseded ({last.comment or 'asked anew'});"
            " it can no longer be decided",
            run_id=run.id,
        )
    raise AlreadyDecided(
        f"approval {last.name!r} was already {last.status} by {last.decided_by or '?'}"
        f" at {last.decided_at:%Y-%m-%d %H:%M:%S} UTC; the first decision stands",
        run_id=run.id,
    )


def _edited(
    run: Run, pending: Approval, approve: bool, payload: Any
) -> tuple[str, list[dict[str, Any]]]:
    """The edited payload as stored ("" if unchanged) and what the edit changed."""
    if payload is None:
        return "", []
    if not approve:
        raise InvalidInput(
            "a rejection cannot carry an edited payload", run_id=run.id, field="payload"
        )
    canonical.check_json(payload, what="edited payload")
    asked_payload = canonical.loads(pending.payload)
    payload = approvals.complete(pending.editable, asked_payload, payload)
    payload = restore_placeholders(payload, asked_payload)
    payload, _ = redact(payload)
    edited = canonical.dumps(payload).decode()
    if edited == pending.payload:
        return "", []
    # The agent's schema and check, before anything is written: a refused edit leaves the
    # approval pending and the run waiting.
    approvals.check_edit(pending, run.agent, asked_payload, payload)
    return edited, approvals.changes(asked_payload, payload)


# The role that decides approvals (the dashboard's "operators" group).
OPERATORS_GROUP = "operators"


def check_may_decide(approval: Approval, by: str) -> None:
    """An approval whose policy names a group is decided only by operators in that group
    (or superusers): the group narrows who of the operators may, it grants nothing to
    someone who is not one."""
    if not approval.group:
        return
    from django.contrib.auth import get_user_model

    users = get_user_model()
    memberships = users.groups.through.objects.filter(user_id=OuterRef("pk"))
    member = users.objects.filter(username=by, is_active=True).filter(
        Q(is_superuser=True)
        | (
            Exists(memberships.filter(group__name=approval.group))
            & Exists(memberships.filter(group__name=OPERATORS_GROUP))
        )
    )
    if not member.exists():
        raise NotAllowed(
            f"{by or 'an anonymous caller'} may not decide approval {approval.name!r}: only"
            f" operators in the group {approval.group!r} may",
            run_id=approval.run_id,
        )


def expire_approvals(limit: int = 200) -> list[int]:
    """Decide (or escalate) approvals whose deadline passed, as their policy says. Each is
    a conditional update on a still-pending approval, so it happens once however many
    sweepers run. Returns the ids acted on."""
    acted = []
    due = list(
        Approval.objects.filter(status=ApprovalStatus.PENDING, deadline__lte=Now())
        .order_by("deadline")
        .values_list("pk", "run_id")[:limit]
    )
    for approval_id, run_id in due:
        with transaction.atomic():
            run = Run.objects.select_for_update().get(pk=run_id)
            approval = Approval.objects.filter(
                pk=approval_id, status=ApprovalStatus.PENDING, deadline__lte=Now()
            ).first()
            if approval is None:
                continue  # decided meanwhile, or another sweeper got there first
            if approval.on_timeout == "escalate" and approval.escalations == 0:
                Approval.objects.filter(pk=approval.pk).update(
                    group=approval.escalate_to,
                    escalations=F("escalations") + 1,
                    deadline=leases.db_now_plus(approval.timeout_seconds or 0),
                )
                events.approval_escalated(
                    run,
                    by="policy:timeout",
                    reason=f"no decision from {approval.group or 'operators'} in time",
                    name=approval.name,
                    to=approval.escalate_to,
                ).save()
            else:
                approve = approval.on_timeout == "approve" and approval.escalations == 0
                Approval.objects.filter(pk=approval.pk, status=ApprovalStatus.PENDING).update(
                    status=ApprovalStatus.APPROVED if approve else ApprovalStatus.REJECTED,
                    decided_by="policy:timeout",
                    decided_at=Now(),
                    comment=f"no decision within {approval.timeout_seconds:g} s",
                )
                events.approval_decided(
                    run,
                    by="policy:timeout",
                    reason="timed out",
                    data={"name": approval.name, "approved": approve, "timeout": True},
                ).save()
                lifecycle.decided(run.id)
                if run.status == RunStatus.WAITING and run.wait_reason == WaitReason.APPROVAL:
                    dispatch.wake(run.id)
            acted.append(approval_id)
    return acted
