"""Bearer-token authentication: the token names a user, and the request acts as that user
(with that user's role, checked by the engine's rule) and counts against the token's rate
limit."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja.security import HttpBearer

from api import ratelimit, tokens


class TokenAuth(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str) -> Any:
        found = tokens.find(token)
        if found is None:
            return None
        ratelimit.spend(found)
        request.user = found.user
        return found
