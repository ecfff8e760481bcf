"""Personal API tokens: a user's key to the JSON API, carrying that user's role.

The secret is shown once, when the token is made; only its SHA-256 is stored (the secret
is 256 random bits, so a plain hash is as good as a slow one and costs nothing per
request). A token may expire; a revoked one stays, for the audit trail's sake."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

PREFIX = "dur_"


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class ApiToken(models.Model):
    id = models.BigAutoField(primary_key=True)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100)
    # The first characters of the secret, to tell tokens apart in lists; never enough to use.
    hint = models.CharField(max_length=16)
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # Rate limit: requests counted in the current fixed window (one conditional UPDATE).
    window_start = models.DateTimeField(null=True, blank=True)
    window_count = models.IntegerField(default=0)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "name"],
                condition=Q(revoked_at__isnull=True),
                name="api_token_live_name",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.hint}…)"

    @property
    def label(self) -> str:
        """How the audit trail names the channel: the token's name."""
        return f"api token {self.name!r}"

    def state(self, now: datetime | None = None) -> str:
        now = now or timezone.now()
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"


def new_secret() -> str:
    return PREFIX + secrets.token_urlsafe(32)
