"""What every endpoint shares: who is calling, acting as them, If-Match, keyset cursors."""

from __future__ import annotations

import base64
import contextlib
import re
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from django.http import HttpRequest

from api.problems import Problem
from durability import acting, roles

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


def encode_cursor(created_at: datetime, run_id: Any) -> str:
    raw = f"{created_at.isoformat()}|{run_id}"
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(text: str | None) -> tuple[datetime, uuid.UUID] | None:
    if not text:
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
        when, _, ident = raw.partition("|")
        return datetime.fromisoformat(when), uuid.UUID(ident)
    except (ValueError, UnicodeDecodeError):
        raise Problem(
            422, "API422", "cursor is not one this list gave out", field="cursor"
        ) from None
