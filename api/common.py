"""What every endpoint shares: who is calling, acting as them, If-Match, keyset cursors."""

from __future__ import annotations

import base64
import contextlib
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from django.http import HttpRequest

from api.problems import Problem
from durability import acting, roles
from durability.errors import DurabilityError

_ETAG = re.compile(r'^\s*(?:W/)?"?(\d{1,18})"?\s*$')


def reader(request: HttpRequest) -> Any:
    roles.require_reader(request.user)
    return request.user


def operator(request: HttpRequest) -> Any:
    roles.require_operator(request.user)
    return request.user


@contextlib.contextmanager
def acting_as(request: HttpRequest) -> Iterator[str]:
    """An operator acting through their token: yields the name the engine records as the
    actor, and has every event written meanwhile name the token."""
    user = operator(request)
    with acting.via(request.auth.label):
        yield user.get_username()


@contextlib.contextmanager
def fields(by_error: dict[type[DurabilityError], str]) -> Iterator[None]:
    """Name the request field an engine refusal is about, by the refusal's exact class: the
    engine is called by the CLI and the pages too, and knows its parameters, not this
    endpoint's fields."""
    try:
        yield
    except DurabilityError as exc:
        if not exc.field and type(exc) in by_error:
            exc.field = by_error[type(exc)]
        raise


def expected_version(if_match: str | None) -> int | None:
    """The run version an ``If-Match`` header names (``"7"``, ``W/"7"`` or ``7``)."""
    if if_match is None or not if_match.strip():
        return None
    found = _ETAG.match(if_match)
    if found is None:
        raise Problem(
            422,
            "API422",
            'If-Match must be the run\'s version as its ETag shows it (e.g. "7")',
            field="If-Match",
        )
    return int(found.group(1))


def etag(version: int) -> str:
    return f'"{version}"'


def idempotency_key(value: str | None) -> str:
    key = (value or "").strip()
    if len(key) > 255:
        raise Problem(
            422, "API422", "an Idempotency-Key is at most 255 characters", field="Idempotency-Key"
        )
    return key


def instant(value: datetime, field: str) -> datetime:
    """``value`` in UTC (a time without an offset is taken as UTC). Python accepts offsets
    up to 23:59 and any year from 1 to 9999 in any zone; PostgreSQL refuses offsets beyond
    15:59, and the year may leave that range once moved to UTC: both are a 422, not a 500."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    offset = value.utcoffset()
    if offset is not None and abs(offset.total_seconds()) > 15 * 3600 + 59 * 60:
        raise Problem(
            422, "API422", f"{field}: a UTC offset is at most 15:59 either way", field=field
        )
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise Problem(
            422, "API422", f"{field}: the time is outside years 1 to 9999 in UTC", field=field
        ) from None


def encode_cursor(created_at: datetime, run_id: Any) -> str:
    raw = f"{created_at.isoformat()}|{run_id}"
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(text: str | None) -> tuple[datetime, uuid.UUID] | None:
    if not text:
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
        when, _, ident = raw.partition("|")
        return instant(datetime.fromisoformat(when), "cursor"), uuid.UUID(ident)
    except (ValueError, UnicodeDecodeError):
        raise Problem(
            422, "API422", "cursor is not one this list gave out", field="cursor"
        ) from None
