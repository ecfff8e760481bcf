"""The answer to a sign-in that is locked out by the throttle (django-axes): the sign-in page
again, with a sentence that says why and for how long, and 429 Too Many Requests."""

from __future__ import annotations

import ipaddress
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


def client_ip(request: HttpRequest) -> str | None:
    """The address a sign-in is counted against: the last one the proxy named in
    ``CLIENT_IP_HEADER`` (the one it appended; those before it the client could have
    written), else the peer's. Only an address: anything else would fail to be stored."""
    header = getattr(settings, "CLIENT_IP_HEADER", "")
    candidates = []
    if header:
        key = "HTTP_" + header.strip().upper().replace("-", "_")
        named = [part.strip() for part in request.META.get(key, "").split(",") if part.strip()]
        candidates += named[-1:]
    candidates.append(request.META.get("REMOTE_ADDR", ""))
    for candidate in candidates:
        try:
            return str(ipaddress.ip_address(candidate))
        except ValueError:
            continue
    return None


def username_of(request: HttpRequest, credentials: dict | None) -> str | None:
    """The username a sign-in is counted against, cut to what the attempts table stores
    (a longer one names no account anyway) and without NUL, which it cannot store."""
    source = credentials if credentials else getattr(request, "POST", {})
    username = source.get("username") if source else None
    if username is None:
        return None
    return str(username).replace("\x00", "")[:150]
