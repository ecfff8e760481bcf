"""The approvals inbox and deciding: approve, approve with edits, reject with a comment.

The engine makes the first decision win under the run's lock; a second one (a double click,
another operator) is refused with who decided and when, and that is what the card shows."""

from __future__ import annotations

import json

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from django_htmx.http import trigger_client_event

from dashboard import runinfo, states
from dashboard.forms import DecisionForm, PayloadForm
from dashboard.permissions import decider_required, mark_deciders, why_not_decide
from dashboard.views.common import explain, page, status_for
from durability import approvals as edits
from durability import operations
from durability.approvals import EditRefused
from durability.errors import DurabilityError
from durability.models import Approval, ApprovalStatus


def _approval(pk: int) -> Approval:
    approval = states.approval_or_404(pk)
    approval.view = runinfo.payload_view(approval.payload)  # type: ignore[attr-defined]
    return approval


@require_GET
def inbox(request: HttpRequest) -> HttpResponse:
    recent = list(
        Approval.objects.exclude(status=ApprovalStatus.PENDING)
        .select_related("run")
        .order_by("-decided_at", "-id")[:15]
    )
    for approval in recent:
        # What the operator changed, asked -> decided: the inbox says it, not just "edited".
        approval.changes = edits.describe(edits.stored_changes(approval))  # type: ignore[attr-defined]
    context = {
        "nav": "approvals",
        "approvals": mark_deciders(request.user, runinfo.pending_approvals()),
        "recent": recent,
    }
    return page(request, "dashboard/approvals.html", context)


def _card(request: HttpRequest, approval: Approval, *, error: str = "", status: int = 200):
    approval.view = runinfo.payload_view(approval.payload)  # type: ignore[attr-defined]
    approval.changes = edits.describe(edits.stored_changes(approval))  # type: ignore[attr-defined]
    mark_deciders(request.user, [approval])
    # Decided from the inbox: its heading's count changes too.
    shown_on = request.htmx.current_url_abs_path if request.htmx else None
    inbox = (shown_on or "").split("?")[0] == reverse("dashboard:approvals")
    context = {"approval": approval, "error": error, "inbox": inbox}
    return page(request, "dashboard/approval_card.html", context, status=status)


def _back(request: HttpRequest) -> str:
    target = request.POST.get("next", "")
    if target and url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return target
    return "dashboard:approvals"


@require_POST
@decider_required
def decide(request: HttpRequest, pk: int) -> HttpResponse:
    approval = _approval(pk)
    form = DecisionForm(request.POST)
    if not form.is_valid():
        error = " ".join(" ".join(e) for e in form.errors.values())
        if request.htmx:
            return _card(request, approval, error=error, status=422)
        return _refused(request, approval, error, 422)
    approve = form.cleaned_data["decision"] == "approve"
    try:
        decided = operations.decide(
            approval.run,
            approval_id=approval.pk,
            approve=approve,
            by=request.user.get_username(),
            comment=form.cleaned_data["comment"],
        )
    except DurabilityError as exc:
        approval.refresh_from_db()
        if request.htmx:
            return _card(request, approval, error=explain(exc), status=status_for(exc))
        return _refused(request, approval, explain(exc), status_for(exc))
    decided.run, decided.base = approval.run, approval.base
    if request.htmx:
        # The run page polls at once instead of at its next tick: the run moves now.
        return trigger_client_event(_card(request, decided), "run-changed")
    verdict = "Approved" if approve else "Rejected"
    messages.success(request, f"{verdict} {decided.name!r}; the run continues.")
    return redirect(_back(request))


def _refused(request: HttpRequest, approval: Approval, message: str, status: int):
    context = {"title": "Refused", "message": message, "back": "/approvals/"}
    return page(request, "dashboard/error.html", context, fragment="message", status=status)


@require_http_methods(["GET", "POST"])
@decider_required
def approve_with_edits(request: HttpRequest, pk: int) -> HttpResponse:
    """A form with one typed field per key of the payload; the edited payload goes to the
    agent instead of the one it asked with (secret values unchanged)."""
    approval = _approval(pk)
    if not approval.takes_edits:
        return _refused(
            request,
            approval,
            f"approval {approval.name!r} takes no edits: approve it as asked, or reject it,"
            " from the inbox",
            409,
        )
    payload = json.loads(approval.payload) if approval.payload else None
    form = PayloadForm(payload, request.POST or None, editable=approval.editable)
    mark_deciders(request.user, [approval])
    context = {
        "nav": "approvals",
        "approval": approval,
        "form": form,
        "read_only": [(k, v) for k, v in approval.view.rows if k in form.read_only],
        "why_not": "" if approval.may_decide else why_not_decide(request.user, approval),
    }
    if request.method == "GET" or approval.status != ApprovalStatus.PENDING:
        return page(request, "dashboard/approval_edit.html", context)
    if not form.is_valid():
        return page(request, "dashboard/approval_edit.html", context, status=422)
    try:
        operations.decide(
            approval.run,
            approval_id=approval.pk,
            approve=True,
            by=request.user.get_username(),
            comment=form.cleaned_data["comment"],
            payload=form.cleaned_data["edited"],
        )
    except EditRefused as exc:
        # The agent's own sentence, by the field it is about when the engine knows it.
        name = form.field_name(exc.field)
        if name:
            form.add_error(name, exc.message)
        context["error"] = explain(exc)
        return page(request, "dashboard/approval_edit.html", context, status=422)
    except DurabilityError as exc:
        approval.refresh_from_db()
        context["error"] = explain(exc)
        return page(request, "dashboard/approval_edit.html", context, status=status_for(exc))
    messages.success(request, f"Approved {approval.name!r} with your edits; the run continues.")
    return redirect("dashboard:run", ref=str(approval.run_id))
