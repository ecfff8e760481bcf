"""The personal API tokens page: make a token (its secret shown this once), see yours,
revoke one. Every signed-in account may have tokens; a token can do what its user's role
allows, nothing more."""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from api import tokens
from api.models import ApiToken
from durability import roles
from durability.errors import DurabilityError

MAX_DAYS = 3650


def _expiry(raw: str) -> timedelta | None:
    raw = raw.strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_DAYS:
        raise tokens.TokenError(f"expiry must be a whole number of days from 1 to {MAX_DAYS}")
    return timedelta(days=int(raw))


@login_required
@require_http_methods(["GET", "POST"])
def tokens_page(request: HttpRequest) -> HttpResponse:
    context: dict = {"nav": "tokens", "role": roles.role_of(request.user)}
    status = 200
    if request.method == "POST":
        try:
            if request.POST.get("action") == "revoke":
                raw = request.POST.get("token", "")
                if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
                    raise tokens.TokenError("no such token")
                revoked = tokens.revoke(request.user, int(raw))
                context["notice"] = f"Token “{revoked.name}” is revoked."
            else:
                days = _expiry(request.POST.get("expires_in_days", ""))
                token, secret = tokens.create(
                    request.user,
                    request.POST.get("name", ""),
                    expires_at=timezone.now() + days if days else None,
                )
                context.update(created=token, secret=secret)
        except DurabilityError as exc:
            context["error"] = exc.message
            status = 422
    context["tokens"] = ApiToken.objects.filter(user=request.user)
    context["now"] = timezone.now()
    return TemplateResponse(request, "api/tokens.html", context, status=status)
