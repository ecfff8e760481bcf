"""Sending a checkpoint's statement without waiting for its answer.

A commit costs a round trip plus the server's WAL flush, and a worker that waits for it
sits idle through both; on this kind of host the wait even grows after CPU work (the
server's process has gone to sleep). Sending the statement, then preparing the next step's
checkpoint while the server flushes, hides most of that wait (``bench.overhead``).

What keeps it correct is the caller's rule, not this module: nothing the next step does
may leave the process before the answer is in (see ``durability.sendahead``).

The statement goes over a connection of its own, one per thread, kept across executions,
and driven through libpq's asynchronous calls as psycopg documents them (``psycopg.pq``):
Django's connection must stay free for the step, since a query in flight on it would block
every other use until answered.

Why not psycopg's pipeline mode (``Connection.pipeline()``): it has no public way to send a
sync point without waiting for it, and the statement's implicit transaction commits only
there. The closest form, the statement between an explicit ``BEGIN`` and ``COMMIT`` in a
pipeline kept open, a flush request after it and ``Pipeline.sync()`` to collect the answer,
passes the same tests but measured slower on the hot commit (``bench.checkpoint --only
overhead``, 3,000 steps per state size, same machine, runs interleaved): 10 KB state median
1.687 ms = 4.27x and 1.894 ms = 3.27x the floor in two runs, against 1.397 ms = 2.33x and
0.615 ms = 1.93x with this module in the runs just before them (1 KB: 3.76x and 3.27x,
against 1.45x and 2.83x).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import threading
import time
import weakref
from typing import Any

from django.db import DEFAULT_DB_ALIAS, OperationalError, connections
from psycopg import errors, pq

from durability import redact
from durability.conf import conf

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def numbered(sql: str) -> tuple[bytes, list[str]]:
    """``%(name)s`` placeholders as libpq's ``$n``, and the names in their order."""
    names: list[str] = []

    def number(match: re.Match) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return _PLACEHOLDER.sub(number, sql).encode(), names


def _wait(fd: int, events: int) -> None:
    """Until ``fd`` is ready, or a second has passed (poll, not select: a worker's
    descriptors may number over 1024)."""
    poller = select.poll()
    poller.register(fd, events | select.POLLERR | select.POLLHUP)
    poller.poll(1000)


def _text(value: Any) -> bytes | None:
    # Every parameter of the statements sent here carries an explicit cast, so the server
    # takes them all as text.
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, int | float):
        return repr(value).encode()
    return str(value).encode()


class Bound:
    """A statement with its parameters converted for the wire."""

    __slots__ = ("names", "query", "values")

    def __init__(self, query: bytes, names: list[str], values: list[bytes | None]) -> None:
        self.query, self.names, self.values = query, names, values

    def set(self, name: str, value: Any) -> None:
        self.values[self.names.index(name)] = _text(redact.scrub(value))


class _Arrival:
    """When the answer of the statement in flight reached the process. The worker sees an
    answer when it next looks, at the next step's checkpoint: a step working four seconds
    without passing ``ctx`` would make a commit of two milliseconds count as one of four
    seconds. So a daemon thread looks too: ``LOOK_SECONDS`` after a statement is sent, if
    the worker has not seen its answer yet, it waits for the socket to turn readable (it
    reads nothing: libpq does, on the worker's thread) and notes the time. It does not wake
    for each answer, which would cost the busy worker a hand-over of the interpreter's lock
    per step, but once per ``LOOK_SECONDS`` while statements are in flight; a latency is
    then late by at most two of those (a statement sent during a look waits for the next),
    plus the lock's switch interval (5 ms by default): far below the commit latency
    objective's 100 ms."""

    LOOK_SECONDS = 0.01

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._fd = -1  # the socket of the statement in flight; -1: none unanswered
        self._ticket = 0  # one per statement sent
        self._seen: tuple[int, float] = (0, 0.0)  # (ticket, when its answer arrived)
        self._idle = False
        self._thread: threading.Thread | None = None

    def expect(self, fd: int) -> int:
        """Watch ``fd`` for the answer of a statement just sent; its ticket."""
        with self._cond:
            self._ticket += 1
            self._fd = fd
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="durability-commit-answer", daemon=True
                )
                self._thread.start()
            elif self._idle:
                self._cond.notify()
            return self._ticket

    def seen(self, ticket: int, at: float | None = None) -> float | None:
        """When the answer of ``ticket`` arrived, if known; ``at``: the worker saw it in then
        (kept unless the thread saw it first), and the watch ends."""
        with self._cond:
            if at is not None and self._ticket == ticket:
                if self._seen[0] != ticket:
                    self._seen = (ticket, at)
                self._fd = -1
            number, when = self._seen
        return when if number == ticket else None

    def _watch(self) -> None:
        while True:
            with self._cond:
                while self._fd < 0:
                    self._idle = True
                    self._cond.wait()
                self._idle = False
                ticket = self._ticket
                # Not woken by the worker meanwhile: a statement sent since is looked at
                # on the next round.
                self._cond.wait(self.LOOK_SECONDS)
                if self._fd < 0 or self._ticket != ticket:
                    continue  # answered in time, or another statement sent since
                fd = self._fd
            self._await(fd, ticket)

    def _await(self, fd: int, ticket: int) -> None:
        """Until the answer of ``ticket`` is readable on ``fd`` (noting when), or the worker
        took it, or the socket closed."""
        while True:
            poller = select.poll()
            try:
                poller.register(fd, select.POLLIN)
                events = poller.poll(1000)
            except (OSError, ValueError):  # closed meanwhile
                events = [(fd, select.POLLNVAL)]
            when = time.perf_counter()
            with self._cond:
                if self._ticket != ticket or self._fd < 0:
                    return
                if events:
                    if events[0][1] & select.POLLIN:
                        self._seen = (ticket, when)
                    self._fd = -1
                    return


class Channel:
    """One connection, at most one statement in flight on it."""

    def __init__(self) -> None:
        self._wrapper: Any = None
        self._raw: Any = None
        self._prepared: dict[bytes, bytes] = {}
        self._statements: dict[str, tuple[bytes, list[str]]] = {}
        self.busy = False
        self.pid = os.getpid()
        self._arrival = _Arrival()
        self._ticket = 0

    @property
    def connection(self) -> Any:
        """The Django connection wrapper of this channel's session, if it has one; for
        reading the session's own settings and statistics, never while a commit is in
        flight."""
        return self._wrapper if self._raw is not None and not self.busy else None

    def _pgconn(self) -> pq.abc.PGconn:
        if self._wrapper is None:
            self._wrapper = connections.create_connection(DEFAULT_DB_ALIAS)
        wrapper = self._wrapper
        with wrapper.wrap_database_errors:
            wrapper.ensure_connection()
        if wrapper.connection is not self._raw:  # a new session: nothing prepared on it
            self._raw = wrapper.connection
            self._prepared.clear()
            self.busy = False
        return self._raw.pgconn

    def bind(self, sql: str, params: dict[str, Any]) -> Bound:
        """``sql`` (written with ``%(name)s`` placeholders) and its parameters as they go on
        the wire, to send later; a parameter known only then is set with ``Bound.set``."""
        numbered_sql = self._statements.get(sql)
        if numbered_sql is None:
            numbered_sql = self._statements[sql] = numbered(sql)
        query, names = numbered_sql
        # Not a Django cursor, so no execute wrapper: the redaction gate, here.
        params = redact.scrub(params)
        return Bound(query, names, [_text(params[name]) for name in names])

    def send(self, sql: str, params: dict[str, Any]) -> None:
        """Queue ``sql`` and flush it to the server."""
        self.send_bound(self.bind(sql, params))

    def send_bound(self, bound: Bound) -> None:
        """Queue a bound statement and flush it to the server.

        A session found dead before the statement was wholly sent is replaced once: the
        server runs nothing it did not receive whole, so sending again cannot run it twice."""
        if self.busy:  # an answer nobody took (an execution cut short): read it away first
            self.discard()
        self._drop_if_dead()
        query, values = bound.query, bound.values
        try:
            self._send(query, values)
        except errors.OperationalError:
            with self._wrapper.wrap_database_errors:
                self._send(query, values)  # a new session (the failure closed the old one)
        self.busy = True

    def _send(self, query: bytes, values: list[bytes | None]) -> None:
        """Raises psycopg's OperationalError as it is (``send`` may try again), any other
        database error as Django's."""
        try:
            pgconn = self._pgconn()
            if conf.PREPARED_STATEMENTS:
                name = self._prepared.get(query)
                if name is None:
                    name = f"durability_inflight_{len(self._prepared)}".encode()
                    self._check(pgconn.prepare(name, query))
                    self._prepared[query] = name
                pgconn.send_query_prepared(name, values)
            else:
                pgconn.send_query_params(query, values)
            while pgconn.flush():
                _wait(pgconn.socket, select.POLLOUT)
            self._ticket = self._arrival.expect(pgconn.socket)
        except BaseException as exc:
            self.close()
            if isinstance(exc, errors.OperationalError):
                raise
            with self._wrapper.wrap_database_errors:
                raise

    def _drop_if_dead(self) -> None:
        """A session the server ended while it sat idle (a restart, an idle timeout) has
        left its farewell, or an end of file, on the socket: read it without waiting."""
        if self._raw is None:
            return
        pgconn = self._raw.pgconn
        poller = select.poll()
        poller.register(pgconn.socket, select.POLLIN)
        try:
            # The farewell and the end of file may take a read each.
            for _ in range(3):
                if not poller.poll(0):
                    break
                pgconn.consume_input()
        except errors.OperationalError:
            self.close()
            return
        if pgconn.status != pq.ConnStatus.OK:
            self.close()

    def arrived_at(self) -> float | None:
        """When the answer of the statement sent last reached this process
        (``time.perf_counter``); None while it has not, looking without waiting."""
        when = self._arrival.seen(self._ticket)
        if when is None and self.busy and self.ready():
            when = self._arrival.seen(self._ticket, time.perf_counter())
        return when

    def ready(self) -> bool:
        """Whether the answer is in, without waiting for it."""
        if not self.busy:
            return True
        pgconn = self._raw.pgconn
        with self._wrapper.wrap_database_errors:
            try:
                pgconn.consume_input()
            except BaseException:
                self.close()
                raise
        return not pgconn.is_busy()

    def answer(self) -> tuple | None:
        """Wait for the statement's answer: its first row, or None if it returned none.
        Raises Django's database errors; after any error the connection is closed."""
        if not self.busy:  # closed by an error since it was sent: its fate is unknown here
            raise OperationalError("the session of the statement in flight was closed")
        pgconn = self._raw.pgconn
        with self._wrapper.wrap_database_errors:
            try:
                pgconn.consume_input()
                while pgconn.is_busy():
                    _wait(pgconn.socket, select.POLLIN)
                    pgconn.consume_input()
                self._arrival.seen(self._ticket, time.perf_counter())
                # Every result, not only the first: the statement's implicit transaction
                # commits after its row is sent, and a failure there (a deferred
                # constraint, a serialization failure, the session dying) comes as a
                # second result that voids the row.
                result = pgconn.get_result()
                if result is None:
                    raise errors.OperationalError("the server sent no answer")
                self._check(result)
                while (more := pgconn.get_result()) is not None:
                    self._check(more)
                if pgconn.status != pq.ConnStatus.OK:
                    raise errors.OperationalError("the session ended before its commit was done")
                self.busy = False
            except BaseException:
                self.close()
                raise
        if result.ntuples == 0:
            return None
        return tuple(result.get_value(0, i) for i in range(result.nfields))

    def discard(self) -> None:
        # On an error answer() has closed the session: the next send opens a new one.
        with contextlib.suppress(Exception):
            self.answer()

    def _check(self, result: pq.abc.PGresult) -> None:
        if result.status == pq.ExecStatus.FATAL_ERROR:
            raise errors.error_from_result(result, encoding="utf-8")

    def close(self) -> None:
        self.busy = False
        self._raw = None
        if self._wrapper is not None:
            with contextlib.suppress(Exception):  # already broken: nothing left to release
                self._wrapper.close()


class _PerThread(threading.local):
    channel: Channel | None = None
    pid: int = 0


_local = _PerThread()
_all: weakref.WeakSet[Channel] = weakref.WeakSet()
_all_lock = threading.Lock()


def channel() -> Channel:
    """This thread's channel. A forked child never uses (or closes) its parent's session."""
    pid = os.getpid()
    if _local.channel is None or _local.pid != pid:
        _local.channel = Channel()
        _local.pid = pid
        with _all_lock:
            _all.add(_local.channel)
    return _local.channel


def close_all() -> None:
    """Close every thread's session (before dropping a test database, or at shutdown)."""
    pid = os.getpid()
    with _all_lock:
        channels = list(_all)
    for ch in channels:
        raw = ch._raw
        ch.busy = False
        ch._raw = None
        if raw is not None and ch.pid == pid:
            with contextlib.suppress(Exception):
                raw.close()
