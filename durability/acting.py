"""Through what an operator acts (a personal API token, by its name), so that the audit
event an operation writes, in the same transaction as its change, names it.

The caller sets it around the operation (``with acting.via("api token 'ci'"):``); the
engine adds it to the event's data as ``via``. Unset (the dashboard, the CLI), events are
written exactly as before."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

_channel: ContextVar[str] = ContextVar("durability_acting_via", default="")


@contextlib.contextmanager
def via(channel: str) -> Iterator[None]:
    token = _channel.set(channel)
    try:
        yield
    finally:
        _channel.reset(token)


def channel() -> str:
    return _channel.get()


def with_channel(data: Any) -> Any:
    """``data`` with ``via`` added when a channel is set (a dict, or a new one for none)."""
    current = _channel.get()
    if not current:
        return data
    if data is None:
        return {"via": current}
    if isinstance(data, dict):
        return {**data, "via": current}
    return data
