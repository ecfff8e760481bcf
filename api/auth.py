"""Bearer-token authentication: the token names a user, and the request acts as that user
(with that user's role, checked by the engine's rule) and counts against the token's rate
limit."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja.security import HttpBearer

from api import ratelimit, tokens
from api.problems import Problem

CHECKED_HEADERS = ("Idempotency-Key", "If-Match")


class TokenAuth(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str) -> Any:
        found = tokens.find(token)
        if found is None:
            return None
        ratelimit.spend(found)
        request.user = found.user
        _refuse_nul(request)
        return found


def _refuse_nul(request: HttpRequest) -> None:
    """Query parameters and headers end up in text columns and SQL parameters, which cannot
    hold NUL: refuse it with the parameter's name rather than fail in the database."""
    for name, values in request.GET.lists():
        if "\x00" in name or any("\x00" in v for v in values):
            raise Problem(422, "API422", f"{name}: text may not contain NUL characters", field=name)
    for name in CHECKED_HEADERS:
        if "\x00" in request.headers.get(name, ""):
            raise Problem(422, "API422", f"{name} may not contain NUL characters", field=name)
