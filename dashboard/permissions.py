"""Roles: viewers read; operators (members of the "operators" group, and superusers) act.
A signed-in account in neither group sees no page at all, only whom to ask.

Checked server-side on every request, whatever the page showed: a hidden button is a
courtesy, this is the rule.

Deciding an approval needs the operator role; an approval whose policy names a group is
decided only by the operators in that group (the group narrows, it never grants: a viewer in
the group may not decide). Superusers may decide every approval. The engine checks the same
under the run's lock (``durability.operations.check_may_decide``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

# The rule itself lives in the engine, so the JSON API applies the same one.
from durability.roles import OPERATORS, VIEWERS, is_operator, is_reader, may_decide

DENIED = (
    "Only operators may approve, reject, resume, roll back, fork, cancel or resolve. "
    "Your account can view runs but not change them; ask an administrator to add you to "
    'the "operators" group.'
)


def no_role_message(user: Any) -> str:
    return (
        f"Your account “{user.get_username()}” has no role on this dashboard yet, so it"
        " cannot see runs. Ask an administrator (or one of your operators, who know who"
        f' administers it) to add you to the "{VIEWERS}" group to read runs, or to the'
        f' "{OPERATORS}" group to act on them.'
    )


def why_not_decide(user: Any, approval: Any) -> str:
    """The sentence shown to someone who may not decide ``approval``."""
    group = getattr(approval, "group", "")
    if not group:
        return DENIED
    if is_operator(user):
        return (
            f"Only operators in the group {group!r} may decide this approval (its policy"
            f" says so); ask an administrator to add you to {group!r}, or ask one of its"
            " members to decide."
        )
    return (
        f"Only operators in the group {group!r} may decide this approval (its policy says"
        f" so), and your account is not an operator; ask an administrator to add you to"
        f' the "{OPERATORS}" group and to {group!r}.'
    )


def mark_deciders(user: Any, approvals: Any) -> Any:
    """Set ``may_decide`` on each approval, for the cards' buttons."""
    for approval in approvals:
        approval.may_decide = may_decide(user, approval)
    return approvals


def role_of(user: Any) -> str:
    if is_operator(user):
        return "operator"
    return "viewer" if is_reader(user) else "none"


def reader_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Refuse every request from a signed-in account with no role, with a page that says
    whom to ask (the login comes first: an anonymous caller is sent to sign in)."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not is_reader(request.user):
            return denied(request, no_role_message(request.user), role="none")
        return view(request, *args, **kwargs)

    return wrapper


def operator_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Refuse every non-GET request from a non-operator with 403 and a clear message; GET
    (the confirmation pages) stays open to viewers, who see why they cannot act."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method not in ("GET", "HEAD") and not is_operator(request.user):
            return denied(request)
        return view(request, *args, **kwargs)

    return wrapper


def denied(request: HttpRequest, message: str = DENIED, *, role: str = "") -> HttpResponse:
    template = "dashboard/denied.html"
    if getattr(request, "htmx", False):
        template += "#message"
    context = {"message": message, "role": role or role_of(request.user)}
    return TemplateResponse(request, template, context, status=403)


def decider_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """For decisions: refuse a POST from anyone the approval's policy does not let decide
    (``pk`` names the approval)."""

    @wraps(view)
    def wrapper(request: HttpRequest, pk: int, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method not in ("GET", "HEAD"):
            if not is_operator(request.user):
                return denied(request)
            from dashboard.states import approval_or_404

            approval = approval_or_404(pk)
            if not may_decide(request.user, approval):
                return denied(request, why_not_decide(request.user, approval))
        return view(request, pk, *args, **kwargs)

    return wrapper
