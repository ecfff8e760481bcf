"""Per-token rate limit: a fixed window counted on the token's row by one conditional
UPDATE, so every web process (gunicorn workers, machines) shares one count and a burst
cannot slip between a read and a write."""

from __future__ import annotations

import math
from datetime import timedelta

from django.db import transaction
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from api.conf import conf
from api.models import ApiToken
from api.problems import Problem
from durability.store import store


def limits() -> tuple[int, float]:
    """(requests, per seconds), from ``DURABILITY_API_RATE_LIMIT`` (e.g. ``"600/60"``)."""
    text = conf.API_RATE_LIMIT
    count, _, seconds = text.strip().partition("/")
    return int(count), float(seconds or 60)


def spend(token: ApiToken) -> None:
    """Count one request on ``token``; refuse with 429 and ``Retry-After`` past the limit."""
    allowed, window = limits()
    now = timezone.now()
    cutoff = now - timedelta(seconds=window)
    fresh = Q(window_start__isnull=True) | Q(window_start__lte=cutoff)
    with transaction.atomic():
        # A count lost in a database crash only lets a few requests more through: it need
        # not wait for the disk, on every request.
        store().unflushed_commit()
        counted = (
            ApiToken.objects.filter(pk=token.pk)
            .filter(fresh | Q(window_count__lt=allowed))
            .update(
                window_start=Case(When(fresh, then=Value(now)), default=F("window_start")),
                window_count=Case(When(fresh, then=Value(1)), default=F("window_count") + 1),
                last_used_at=now,
            )
        )
    if counted:
        return
    start = ApiToken.objects.filter(pk=token.pk).values_list("window_start", flat=True).first()
    wait = window if start is None else (start + timedelta(seconds=window) - now).total_seconds()
    seconds = max(1, math.ceil(wait))
    raise Problem(
        429,
        "API429",
        f"this token made more than {allowed} requests in {window:g} seconds; retry in {seconds} s",
        headers={"Retry-After": str(seconds)},
    )
