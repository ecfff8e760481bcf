"""The connections a saver's hot calls run on (PostgreSQL), and the lock that keeps each
LangGraph thread's calls one at a time.

An asyncio server runs its conversations' graphs at once, and their ``put``, ``put_writes``
and ``get_tuple`` come to one saver from the threads ``asyncio.to_thread`` uses. Behind one
connection and one lock, every conversation would wait for every statement of every other,
and one slow call (a fresh saver's ``get_tuple`` of a long thread, a checkpoint waiting for a
row lock) would hold every superstep of the process. So each call takes a connection of its
own for its statement, opening one (up to ``size``) when none is idle, and the calls on one
thread's namespace wait only for each other: the saver keeps one encoder and one last
checkpoint per thread, which two calls at once would spoil. Each namespace has a lock of its
own while calls use it (never one shared with others by hash: a checkpoint waiting for an
operator's row lock would hold up every conversation that happened to share it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from durability.langgraph.shared import Shared

T = TypeVar("T")


class Pool:
    """Up to ``size`` connections of the saver's own (``Shared``), each used by one call at
    a time, opened as calls need them and kept open until ``close``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._slots = threading.BoundedSemaphore(size)
        self._guard = threading.Lock()
        self._idle: list[Shared] = []
        self._closed = False
        # (thread id, namespace) -> [its lock, how many calls hold or wait for it]: kept
        # only while calls use it, so their number is bounded by the calls at once.
        self._threads: dict[tuple[str, str], list[Any]] = {}

    @contextmanager
    def thread(self, thread_id: str, ns: str) -> Iterator[None]:
        """Held by a call on a thread's namespace while it runs: the calls on one namespace
        run one at a time, and wait for no other namespace's."""
        key = (thread_id, ns)
        with self._guard:
            entry = self._threads.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._guard:
                entry[1] -= 1
                if not entry[1]:
                    del self._threads[key]

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
