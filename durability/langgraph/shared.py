"""A database connection a saver owns and uses from whichever thread LangGraph calls it on
(one at a time): Django's connections belong to the thread that opened them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections

T = TypeVar("T")


class Shared:
    """A database connection of the saver's own, used from any thread, one at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._db: Any = None

    def run(self, fn: Callable[[Any], T]) -> T:
        """``fn(connection)``, with this connection's lock held."""
        with self.lock:
            return self.use(fn)

    def use(self, fn: Callable[[Any], T]) -> T:
        """``fn(connection)``; the caller holds the lock."""
        if self._db is None:
            self._db = connections.create_connection(DEFAULT_DB_ALIAS)
            self._db.inc_thread_sharing()
        try:
            return fn(self._db)
        except DatabaseError:
            if self._db.connection is None or not self._db.is_usable():
                # Lost (or never made): the next call connects again.
                self.close()
            raise

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
