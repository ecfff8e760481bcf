"""The answer to a sign-in that is locked out by the throttle (django-axes): the sign-in page
again, with a sentence that says why and for how long, and 429 Too Many Requests."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render


def locked_out(
    request: HttpRequest, original_response: Any = None, credentials: dict | None = None
) -> HttpResponse:
    minutes = max(1, round(settings.AXES_COOLOFF_TIME.total_seconds() / 60))
    username = (credentials or {}).get("username") or request.POST.get("username", "")
    context = {
        "locked": (
            f"Too many failed sign-ins for this username from your address"
            f" ({settings.AXES_FAILURE_LIMIT} in a row): signing in is blocked for"
            f" {minutes} minute{'s' if minutes != 1 else ''}. Wait, or ask an administrator"
            " to lift the block (python manage.py axes_reset_username <name>)."
        ),
        "username": str(username)[:150],
    }
    return render(request, "registration/login.html", context, status=429)


def client_ip(request: HttpRequest) -> str:
    """The address a sign-in is counted against: the last one the proxy named in
    ``CLIENT_IP_HEADER`` (the one it appended; those before it the client could have
    written), else the peer's."""
    header = getattr(settings, "CLIENT_IP_HEADER", "")
    if header:
        key = "HTTP_" + header.strip().upper().replace("-", "_")
        named = [part.strip() for part in request.META.get(key, "").split(",") if part.strip()]
        if named:
            return named[-1][:100]
    return request.META.get("REMOTE_ADDR", "")
