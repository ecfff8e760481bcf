"""Reading a page's parameters: each one is parsed here or refused with a 400 that says which
parameter was wrong and what it takes, never a silent default and never a 500.

A value that is the wrong shape (a number too big for the database's column, a date past
year 9999 once moved to UTC, a filter value nobody offers) would otherwise reach the database
or the datetime library and fail there."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from django.utils.dateparse import parse_datetime

# The database's integer columns: a checkpoint number, an attempt count (32-bit) and a row id
# (64-bit). A larger number cannot name anything and PostgreSQL refuses to compare with it.
INT_MAX = 2**31 - 1
ID_MAX = 2**63 - 1
# Free text in a filter (an agent's name, a search, an actor).
TEXT_MAX = 200


class BadParameter(Exception):
    """A parameter the page cannot use; ``str()`` is the sentence shown with the 400."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"the parameter “{shown(name)}” {message}")
        self.name = name


def shown(value: Any, limit: int = 60) -> str:
    """A value quoted in a message: short, so a 100 KB parameter is not echoed back."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "…"


def integer(
    data: Any,
    name: str,
    default: int | None = None,
    *,
    minimum: int = 0,
    maximum: int = INT_MAX,
) -> int | None:
    """A whole number between ``minimum`` and ``maximum``; ``default`` when absent or empty."""
    raw = data.get(name, "")
    if raw is None or str(raw).strip() == "":
        return default
    return bounded(raw, name, minimum=minimum, maximum=maximum)


def bounded(raw: Any, name: str, *, minimum: int = 0, maximum: int = INT_MAX) -> int:
    text = str(raw).strip()
    if len(text) > 20 or not text.lstrip("-").isdigit():
        raise BadParameter(name, f"must be a whole number, not “{shown(text)}”")
    number = int(text)
    if not minimum <= number <= maximum:
        raise BadParameter(name, f"must lie between {minimum} and {maximum:,}, not {number:,}")
    return number


def choice(data: Any, name: str, choices: Iterable[str], default: str = "") -> str:
    """One of ``choices``, or ``default`` when absent or empty."""
    raw = data.get(name, "")
    if raw in ("", None):
        return default
    allowed = list(choices)
    if raw not in allowed:
        raise BadParameter(
            name, f"takes one of {', '.join(allowed)}; “{shown(raw)}” is not one of them"
        )
    return raw


def text(data: Any, name: str, limit: int = TEXT_MAX) -> str:
    """Free text up to ``limit`` characters, stripped."""
    raw = (data.get(name) or "").strip()
    if len(raw) > limit:
        raise BadParameter(name, f"is {len(raw):,} characters long; {limit} at most")
    return raw


def moment(value: str) -> datetime | None:
    """A time a page wrote into one of its cursors (ISO 8601), as an aware UTC datetime, or
    None for one that does not exist (month 13) or is outside what can be stored: a time
    in year 9999 with a negative offset is past the last representable instant once moved
    to UTC (OverflowError), and PostgreSQL would refuse it anyway."""
    try:
        at = parse_datetime(value)
        if at is None:
            return None
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        return at.astimezone(UTC)
    except (ValueError, OverflowError):
        return None
