"""The connections a saver's hot calls run on (PostgreSQL), and the lock that keeps each
LangGraph thread's calls one at a time.

An asyncio server runs its conversations' graphs at once, and their ``put``, ``put_writes``
and ``get_tuple`` come to one saver from the threads ``asyncio.to_thread`` uses. Behind one
connection and one lock, every conversation would wait for every statement of every other,
and one slow call (a fresh saver's ``get_tuple`` of a long thread, a checkpoint waiting for a
row lock) would hold every superstep of the process. So each call takes a connection of its
own for its statement, opening one (up to ``size``) when none is idle, and the calls on one
thread's namespace wait only for each other: the saver keeps one encoder and one last
checkpoint per thread, which two calls at once would spoil.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from durability.langgraph.shared import Shared

T = TypeVar("T")

# Locks the threads' namespaces share, by hash: two namespaces on one lock wait for each
# other (a thread's calls are a few milliseconds), and their number stays bounded however
# many threads a process serves.
STRIPES = 256


class Pool:
    """Up to ``size`` connections of the saver's own (``Shared``), each used by one call at
    a time, opened as calls need them and kept open until ``close``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._slots = threading.BoundedSemaphore(size)
        self._guard = threading.Lock()
        self._idle: list[Shared] = []
        self._closed = False
        self._stripes = [threading.Lock() for _ in range(STRIPES)]

    def thread(self, thread_id: str, ns: str) -> threading.Lock:
        """The lock a thread's namespace's calls hold while they run."""
        return self._stripes[hash((thread_id, ns)) % STRIPES]

    def run(self, fn: Callable[[Any], T], *, retry: bool = False) -> T:
        """``fn(connection)`` on a connection no other call uses meanwhile; waits for one
        when ``size`` are busy. ``retry``: as ``Shared.use``."""
        with self._slots:
            with self._guard:
                db = self._idle.pop() if self._idle else Shared()
            drops = db.drops
            try:
                with db.lock:
                    return db.use(fn, retry=retry)
            finally:
                with self._guard:
                    # One connection found lost: the server likely ended them all (a
                    # restart, a failover), so the idle ones are not tried; the next calls
                    # connect again.
                    stale: list[Shared] = []
                    if db.drops != drops:
                        stale, self._idle = self._idle, []
                    if self._closed:
                        stale.append(db)
                    else:
                        self._idle.append(db)
                for old in stale:
                    with old.lock:
                        old.close()

    def close(self) -> None:
        """Close the idle connections; one still in use is closed when its call ends. A call
        made after this opens a connection for itself and closes it at its end."""
        with self._guard:
            self._closed = True
            idle, self._idle = self._idle, []
        for db in idle:
            with db.lock:
                db.close()
