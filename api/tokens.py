"""Making, listing, revoking and checking personal API tokens: what the token page and
``manage.py apitokens`` both call."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from api.models import PREFIX, ApiToken, digest, new_secret
from durability.errors import InvalidInput

MAX_NAME = 100


class TokenError(InvalidInput):
    """A token request that cannot be honoured (bad name, past expiry, unknown token)."""

    code = "API100"


def create(user: Any, name: str, *, expires_at: datetime | None = None) -> tuple[ApiToken, str]:
    """A new token for ``user``: (the row, the secret). The secret is not kept anywhere."""
    name = (name or "").strip()
    if not name or len(name) > MAX_NAME:
        raise TokenError(f"a token needs a name of 1 to {MAX_NAME} characters")
    if expires_at is not None and expires_at <= timezone.now():
        raise TokenError("the expiry must be in the future")
    secret = new_secret()
    try:
        with transaction.atomic():
            token = ApiToken.objects.create(
                user=user,
                name=name,
                hint=secret[: len(PREFIX) + 6],
                digest=digest(secret),
                expires_at=expires_at,
            )
    except IntegrityError:
        raise TokenError(
            f"{user.get_username()} already has a live token named {name!r}; revoke it or"
            " choose another name"
        ) from None
    return token, secret


def revoke(user: Any, token_id: int) -> ApiToken:
    """Revoke one of ``user``'s tokens (at once: the next request with it gets a 401)."""
    token = ApiToken.objects.filter(user=user, pk=token_id).first()
    if token is None:
        raise TokenError(f"{user.get_username()} has no token with id {token_id}")
    if token.revoked_at is None:
        ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        token.refresh_from_db()
    return token


def find(secret: str) -> ApiToken | None:
    """The live token whose secret this is (neither revoked nor expired), with its user."""
    if not secret.startswith(PREFIX) or len(secret) > 200:
        return None
    token = ApiToken.objects.select_related("user").filter(digest=digest(secret)).first()
    if token is None or token.state() != "active" or not token.user.is_active:
        return None
    return token
