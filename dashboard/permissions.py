"""Roles: viewers read; operators (members of the "operators" group, and superusers) act.

Checked server-side on every POST, whatever the page showed: a hidden button is a courtesy,
this is the rule."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

OPERATORS = "operators"
VIEWERS = "viewers"

DENIED = (
    "Only operators may approve, reject, resume, roll back, fork, cancel or resolve. "
    "Your account can view runs but not change them; ask an administrator to add you to "
    'the "operators" group.'
)


def is_operator(user: Any) -> bool:
    if not getattr(user, "is_authenticated", False) or not user.is_active:
        return False
    if user.is_superuser:
        return True
    # Cached on the user object: templates ask once per button.
    cached = getattr(user, "_dashboard_is_operator", None)
    if cached is None:
        cached = user.groups.filter(name=OPERATORS).exists()
        user._dashboard_is_operator = cached
    return cached


def may_decide(user: Any, approval: Any) -> bool:
    """Whether ``user`` may decide ``approval``: its policy's group when it names one (the
    engine checks the same under the run's lock), any operator otherwise."""
    if not getattr(user, "is_authenticated", False) or not user.is_active:
        return False
    group = getattr(approval, "group", "")
    if not group:
        return is_operator(user)
    return bool(user.is_superuser or user.groups.filter(name=group).exists())


def mark_deciders(user: Any, approvals: Any) -> Any:
    """Set ``may_decide`` on each approval, for the cards' buttons."""
    for approval in approvals:
        approval.may_decide = may_decide(user, approval)
    return approvals


def role_of(user: Any) -> str:
    return "operator" if is_operator(user) else "viewer"


def operator_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Refuse every non-GET request from a non-operator with 403 and a clear message; GET
    (the confirmation pages) stays open to viewers, who see why they cannot act."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method not in ("GET", "HEAD") and not is_operator(request.user):
            return denied(request)
        return view(request, *args, **kwargs)

    return wrapper


def denied(request: HttpRequest, message: str = DENIED) -> HttpResponse:
    template = "dashboard/denied.html"
    if getattr(request, "htmx", False):
        template += "#message"
    return TemplateResponse(request, template, {"message": message}, status=403)


def decider_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """For decisions: refuse a POST from anyone the approval's policy does not let decide
    (``pk`` names the approval)."""

    @wraps(view)
    def wrapper(request: HttpRequest, pk: int, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method not in ("GET", "HEAD"):
            from durability.models import Approval

            approval = Approval.objects.filter(pk=pk).only("group").first()
            if approval is not None and not may_decide(request.user, approval):
                if approval.group:
                    return denied(
                        request,
                        f"Only members of the group {approval.group!r} may decide this"
                        " approval (its policy says so).",
                    )
                return denied(request)
        return view(request, pk, *args, **kwargs)

    return wrapper
