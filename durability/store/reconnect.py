"""The one policy for a lost database connection.

A session that failed is never used again: ``drop`` closes it (the database frees every lock
it held) and the next use opens a new one. A write that is safe to repeat (insert-if-absent,
a conditional update) is retried with backoff while the database is away (``retrying``);
anything else lets the error reach its caller, which decides. Only the errors of a lost
connection count (``DB_DOWN``): a constraint or a syntax error is never retried.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from django.db import InterfaceError, OperationalError
from django.db import connection as _default

from durability.conf import conf

DB_DOWN = (OperationalError, InterfaceError)


def wait_seconds() -> float:
    """How long a repeatable write waits for the database to come back."""
    return conf.DB_WAIT_SECONDS


def drop(conn: Any = None) -> None:
    """End the session of ``conn`` (this thread's default connection if not given) after a
    failure; closing a broken session may itself fail, which changes nothing."""
    with contextlib.suppress(Exception):
        (conn or _default).close()


def retrying[T](
    write: Callable[[], T], *, give_up_after: float | None = None, conn: Any = None
) -> T:
    """``write()``, retried with backoff on a new session while the database is away, for up
    to ``give_up_after`` seconds (``DURABILITY_DB_WAIT_SECONDS``). Inside a transaction
    nothing is retried: the transaction is lost with its session, and its owner decides."""
    conn = conn or _default
    give_up = time.monotonic() + (wait_seconds() if give_up_after is None else give_up_after)
    delay = 0.05
    while True:
        try:
            return write()
        except DB_DOWN:
            if conn.in_atomic_block or time.monotonic() >= give_up:
                raise
            drop(conn)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def wait_for_database(conn: Any = None) -> bool:
    """After a failure: True as soon as the database answers again (on this session if it
    still answers: only another session may have failed), False once the wait is longer
    than ``DURABILITY_DB_WAIT_SECONDS``."""
    conn = conn or _default
    give_up = time.monotonic() + wait_seconds()
    delay = 0.05
    while True:
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT 1")
            return True
        except DB_DOWN:
            drop(conn)
            if time.monotonic() >= give_up:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


__all__ = ["DB_DOWN", "drop", "retrying", "wait_for_database", "wait_seconds"]
