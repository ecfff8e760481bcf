"""Leases with fencing, heartbeats, and a liveness lock that dies with its process.

A worker advances a run only while it holds the lease; every claim bumps the fencing token
and every fenced write carries it. The lease TTL is long (30 s by default) so that a paused
or partitioned worker is not declared dead too eagerly, yet a *dead* worker is noticed at
once: while it executes a run, a worker holds a lock that the operating system or the
database frees the moment its process dies (a session advisory lock on PostgreSQL, freed
~6 ms after SIGKILL; an ``flock`` on a file for the embedded SQLite default). The sweeper
treats "running, but nobody holds its lock" as dead, unless a lost session explains it: a
database restart drops every session, and so every lock, at once. Then a missing lock means
death only once the server has been up longer than a heartbeat interval plus a margin (the
holder, if alive, has reconnected and taken its lock back by then) or the holder's heartbeat
is older than a whole lease.

Heartbeats run on their own thread and database connection, so a step blocked in a 60 s
call keeps its lease; that thread watches its session and takes the lock back as soon as
the database answers again. Lease times use the database clock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, transaction
from django.db.models import Case, DateTimeField, ExpressionWrapper, F, Q, When
from django.db.models.functions import Coalesce, Now

from durability import events, lifecycle
from durability.conf import conf
from durability.models import (
    TIMED_WAITS,
    Checkpoint,
    Event,
    Run,
    RunStatus,
)
from durability.store import reconnect, store
from durability.store.postgres import advisory_key

log = logging.getLogger(__name__)


def lease_seconds() -> float:
    return conf.LEASE_SECONDS


def heartbeat_seconds() -> float:
    return conf.HEARTBEAT_SECONDS


def reconnect_margin_seconds() -> float:
    return conf.RECONNECT_MARGIN_SECONDS


def settle_seconds() -> float:
    """How long a live holder may go without its lock after the database restarted, or
    without any sign of activity on its session: a heartbeat interval plus a margin."""
    return heartbeat_seconds() + reconnect_margin_seconds()


def db_now_plus(seconds: float) -> ExpressionWrapper:
    return ExpressionWrapper(Now() + timedelta(seconds=seconds), output_field=DateTimeField())


# --- the liveness lock -------------------------------------------------------------------------


class LivenessLock:
    """Held by the process executing a run, on the connection (or file) of the thread that
    creates it; released by the OS or the database if the process dies. The lock itself is
    the store's (a session advisory lock on PostgreSQL, an ``flock`` on SQLite)."""

    def __init__(self, run_id: Any) -> None:
        self.run_id = run_id
        self._lock = store().run_lock(run_id)

    @property
    def held(self) -> bool:
        return self._lock.held

    @held.setter
    def held(self, value: bool) -> None:
        self._lock.held = value

    @property
    def pid(self) -> int | None:
        """The database session holding it (None where a file holds it)."""
        return self._lock.pid

    def acquire(self) -> bool:
        return self._lock.acquire()

    def on_connection(self) -> bool:
        """Held by a database session (which a dropped connection frees), not by a file."""
        return self._lock.on_connection()

    def session_socket(self) -> int | None:
        """The socket of the session holding the lock: readable when the server ends it."""
        return self._lock.session_socket()

    def release(self) -> None:
        self._lock.release()


def end_stalled_holders(runs: list[tuple[Any, int]]) -> int:
    """End the database sessions that still hold the liveness lock of these runs, each
    given with the token the sweep saw, where the holder is proven stalled: a process stopped
    or cut off while its session lives on (SIGSTOP, a paused VM, a partition the server has
    not noticed, a worker that stopped between taking the lock and claiming). Until that
    session ends, every worker the run is sent to would find it held and leave it alone. The
    stalled process, if it ever resumes, finds its connection gone and its token outdated.

    The proof is checked in the statement that ends the session (see ``_END_STALLED``), so a
    worker that took the run since the sweep decided is never touched. Returns the number of
    sessions ended (PostgreSQL; elsewhere the lock dies with the process)."""
    return store().end_stalled_holders(runs, settle_seconds())


def proven_dead(run_id: Any, why: str) -> Q:
    """A filter for the UPDATE that takes a running run from its holder: true only if, when
    that statement runs, the holder is gone (``"process gone"``: nobody holds its lock and
    a lost session cannot explain it) or its lease ran out (``"lease expired"``). The
    caller also fences on the token it read, so the claim is older than its decision."""
    if why == "lease expired":
        return Q(lease_expires_at__lt=Now())
    # Where a file holds the lock, it cannot be read in SQL: the caller looked just before.
    return store().lock_gone(run_id, settle_seconds(), lease_seconds())


def lock_holders(run_ids: list[Any]) -> dict[str, set[int]]:
    """Of ``run_ids``, those whose liveness lock some process holds now, with the database
    sessions (pids) holding it (none known where a file holds it)."""
    return store().lock_holders(run_ids)


def live_owners(run_ids: list[Any]) -> set[str]:
    """Of ``run_ids``, those whose liveness lock some process holds now."""
    return set(lock_holders(run_ids))


# --- claiming ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Claim:
    run: Run
    token: int
    attempts: int
    recovered: bool
    recovery_ms: float | None = None
    work_lost_ms: float | None = None
    # The lost attempt's last sign of life (set when ``recovered``).
    lost_at: datetime | None = None


def claim(run_id: Any, worker: str, *, owner_dead: bool, holder: int | None = None) -> Claim | None:
    """Take the lease with one conditional UPDATE; ``None`` when the run is not ours to run
    (finished, waiting, not due, or leased by a live worker).

    ``owner_dead``: this worker holds the run's liveness lock, so a "running" lease belongs
    to a process that died, unless the database restarted a moment ago (its owner may not
    have taken its lock back yet: see ``proven_dead``). ``holder``: the session that holds
    the lock for this worker (PostgreSQL); the claim is made only while it still does, so a
    lease is never taken on a lock lost to a restart in between."""
    with transaction.atomic():
        busy = _over_concurrency(run_id)
        if busy:
            from durability.limits import park

            park(run_id, busy)
            return None
        updated = (
            Run.objects.filter(pk=run_id)
            .filter(_claimable(owner_dead))
            .filter(store().lock_held_by(run_id, holder))
            .update(**_CLAIMED, lease_owner=worker, lease_expires_at=db_now_plus(lease_seconds()))
        )
        if not updated:
            return None
        return _claimed(run_id, worker)


def _claimable(owner_dead: bool) -> Q:
    """Which runs a claim may take: due, a timer due, or a lease whose holder is gone."""
    runnable = Q(status=RunStatus.QUEUED) & (Q(wake_at__isnull=True) | Q(wake_at__lte=Now()))
    timer_due = Q(status=RunStatus.WAITING, wait_reason__in=TIMED_WAITS, wake_at__lte=Now())
    expired = Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=Now())
    stale = Q(status=RunStatus.RUNNING) & expired
    if owner_dead:
        unexplained = store().lock_loss_unexplained(settle_seconds(), lease_seconds())
        # Where no session holds the lock, a free one always means its holder died.
        dead = Q() if unexplained is None else expired | unexplained
        stale = Q(status=RunStatus.RUNNING) & dead
    return runnable | timer_due | stale


# What a claim sets (the lease's expiry is computed per claim).
_CLAIMED: dict[str, Any] = {
    "lease_token": F("lease_token") + 1,
    # A lease taken over from a dead process: remember its last sign of life.
    "lost_heartbeat_at": Case(
        When(status=RunStatus.RUNNING, then=Coalesce("heartbeat_at", "claimed_at")),
        default=F("lost_heartbeat_at"),
    ),
    # Taken over before its lease expired: its lock was free, its process gone just now.
    "lost_seen_at": Case(
        When(status=RunStatus.RUNNING, lease_expires_at__gt=Now(), then=Now()),
        When(status=RunStatus.RUNNING, then=None),
        default=F("lost_seen_at"),
        output_field=DateTimeField(),
    ),
    # Taken over here, or requeued by the sweeper from a dead attempt.
    "recoveries": Case(
        When(
            Q(status=RunStatus.RUNNING) | Q(lost_heartbeat_at__isnull=False),
            then=F("recoveries") + 1,
        ),
        default=F("recoveries"),
    ),
    "heartbeat_at": Now(),
    "claimed_at": Now(),
    "attempts": F("attempts") + 1,
    "started_at": Coalesce("started_at", Now()),
    "updated_at": Now(),
    **lifecycle.claimed(),
}


def _claimed(run_id: Any, worker: str) -> Claim:
    """After the claim's UPDATE, in its transaction: its events, and the claim."""
    run = Run.objects.get(pk=run_id)
    recovered = run.lost_heartbeat_at is not None
    made = [events.claimed(run, worker=worker)]
    figures: dict[str, float | None] = {}
    lost_at = run.lost_heartbeat_at
    if recovered:
        event, figures = _recovered_event(run, worker)
        made.append(event)
        Run.objects.filter(pk=run_id).update(lost_heartbeat_at=None, lost_seen_at=None)
        run.lost_heartbeat_at = run.lost_seen_at = None
    events.record(*made)
    return Claim(
        run=run,
        token=run.lease_token,
        attempts=run.attempts,
        recovered=recovered,
        recovery_ms=figures.get("recovery_ms"),
        work_lost_ms=figures.get("work_lost_ms"),
        lost_at=lost_at,
    )


def concurrency_limit(agent: str) -> int | None:
    from durability.agents import registry
    from durability.errors import UnknownAgent

    try:
        return registry.get(agent).max_concurrent
    except UnknownAgent:
        return None


def _over_concurrency(run_id: Any) -> str:
    """Why ``run_id`` may not start now under its agent's concurrency limit ("" if it may)."""
    agent = Run.objects.filter(pk=run_id).values_list("agent", flat=True).first()
    limit = concurrency_limit(agent) if agent else None
    if not agent or not limit:
        return ""
    from durability.limits import agent_slot_taken

    return agent_slot_taken(agent, limit, run_id)


def _recovered_event(run: Run, worker: str) -> tuple[Event, dict[str, float | None]]:
    """Recovery time runs from the failure to this claim; work lost from the last
    checkpoint to the failure. The failure: when the lost attempt's process was found gone
    (within a sweep of its death; its last heartbeat may be a third of a lease older, and
    the work of a long step since then is lost too), else, when only its lease expired, its
    last sign of life (its last heartbeat or checkpoint: it stalled after that)."""
    claimed_at = run.claimed_at
    if claimed_at is None:  # the claim sets it
        raise RuntimeError(f"run {run.id}: claimed without a claim time")
    head_at = (
        Checkpoint.objects.filter(run=run, seq=run.head_seq)
        .values_list("created_at", flat=True)
        .first()
    )
    lost_at = run.lost_seen_at
    if lost_at is None and run.lost_heartbeat_at is not None:
        lost_at = max(run.lost_heartbeat_at, head_at) if head_at else run.lost_heartbeat_at
    recovery_ms = max(0.0, (claimed_at - lost_at).total_seconds() * 1000) if lost_at else None
    lost_ms = max(0.0, (lost_at - head_at).total_seconds() * 1000) if lost_at and head_at else None
    why = "process gone" if run.lost_seen_at is not None else "lease expired"
    event = events.recovered(
        run, worker=worker, recovery_ms=recovery_ms, work_lost_ms=lost_ms, why=why
    )
    return event, {"recovery_ms": recovery_ms, "work_lost_ms": lost_ms}


# --- keeping the lease ----------------------------------------------------------------------


class LeaseKeeper:
    """A thread that holds the run's liveness lock and renews its lease.

    ``acquire()`` takes the lock (before the claim, so a claimed lease always has a live
    lock behind it); ``pid`` is the session holding it; ``start(token)`` begins heartbeats;
    ``lost`` is set when the run turns out to be someone else's; ``stop()`` releases the
    lock and closes the connection.

    A database restart ends the session and frees the lock while the run goes on: the
    thread waits on its session's socket as well as on the clock, so it notices at once,
    and takes the lock back (then renews) as soon as the database answers again. If another
    process holds the run by then, the run is lost."""

    def __init__(self, run_id: Any, worker: str) -> None:
        self.run_id = run_id
        self.worker = worker
        self.lost = threading.Event()
        self.pid: int | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._token: int | None = None
        self._locked = False
        self._error: BaseException | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._main, name=f"lease-{run_id}", daemon=True)

    def acquire(self, timeout: float = 30.0) -> bool:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"could not reach the database to lock run {self.run_id}")
        if self._error is not None:
            raise self._error
        return self._locked

    def start(self, token: int) -> None:
        self._token = token
        self._poke()

    def stop(self) -> None:
        self._stop.set()
        self._poke()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if not self._thread.is_alive() and self._wake_w >= 0:
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_r = self._wake_w = -1

    def _poke(self) -> None:
        with contextlib.suppress(OSError):  # closed: the thread is gone already
            os.write(self._wake_w, b"x")

    def _main(self) -> None:
        lock = LivenessLock(self.run_id)
        try:
            try:
                self._locked = lock.acquire()
                self.pid = lock.pid
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self._error = exc
            finally:
                self._ready.set()
            if not self._locked:
                return
            interval = heartbeat_seconds()
            due: float | None = None
            while not self._stop.is_set():
                timeout = None if due is None else max(0.0, due - time.monotonic())
                dropped = self._wait(lock, timeout)
                if self._stop.is_set():
                    break
                if due is None and self._token is not None:
                    due = time.monotonic() + interval
                if dropped:
                    if not self._take_back(lock):
                        self.lost.set()
                        break
                    if self._token is not None:
                        due = time.monotonic() + interval
                elif due is not None and time.monotonic() >= due:
                    if not self._beat(lock):
                        self.lost.set()
                        break
                    due = time.monotonic() + interval
        finally:
            try:
                lock.release()
            finally:
                reconnect.drop()

    def _wait(self, lock: LivenessLock, timeout: float | None) -> bool:
        """Sleep until poked, the timeout, or the session's socket turns readable (the
        server sent something unasked: it is ending the session). True if it ended."""
        sock = lock.session_socket()
        poller = select.poll()  # not select(): no limit on descriptor numbers
        poller.register(self._wake_r, select.POLLIN)
        if sock is not None:
            poller.register(sock, select.POLLIN)
        try:
            events = poller.poll(None if timeout is None else timeout * 1000)
        except OSError:
            return lock.on_connection()
        readable = {fd for fd, _ in events}
        if self._wake_r in readable:
            os.read(self._wake_r, 512)
        if sock is None or sock not in readable:
            return False
        try:
            store().ping()
            return False  # a notice, not an ending
        except DatabaseError:
            return True

    def _take_back(self, lock: LivenessLock) -> bool:
        """The session holding the lock ended: take the lock again on a new one as soon as
        the database answers, and renew the lease at once. False if the run is someone
        else's now."""
        log.warning("run %s: lost the session holding its lock; taking it back", self.run_id)
        lock.held = False
        delay = 0.05
        while not self._stop.is_set():
            reconnect.drop()
            try:
                if lock.acquire():
                    self.pid = lock.pid
                    if self._token is None:
                        return True  # the claim checks which session holds the lock
                    return renew(self.run_id, self._token)
                # Held by another session: a delivery about to find the run leased, or the
                # process that has the run now.
                if self._token is None or not still_ours(self.run_id, self._token):
                    return False
            except DatabaseError:
                pass
            if self._stop.wait(delay):
                break
            delay = min(delay * 2, 0.5)
        return True

    def _beat(self, lock: LivenessLock) -> bool:
        try:
            if not lock.held:
                return self._take_back(lock)
            if self._token is None:  # the beat starts once the claim's token is known
                raise RuntimeError(f"run {self.run_id}: heartbeat before the claim")
            return renew(self.run_id, self._token)
        except DatabaseError:
            # The session is gone with no word from the server (a partition, a reset): it
            # freed the lock, and until it is taken again the sweeper may see a dead worker.
            log.warning("heartbeat for run %s failed; retrying", self.run_id, exc_info=True)
            if not lock.on_connection():
                return True  # a file lock lives as long as this process
            return self._take_back(lock)


def still_ours(run_id: Any, token: int) -> bool:
    return Run.objects.filter(pk=run_id, lease_token=token).exists()


def renew(run_id: Any, token: int) -> bool:
    """A heartbeat: extend the lease if it is still ours. It waits for no standby (a row lock
    held by a heartbeat stuck on a lost standby would block the run's own commits)."""
    return store().renew_lease(run_id, token, lease_seconds())


def release(run_id: Any, token: int, **fields: Any) -> bool:
    """Give the lease back (fenced) while setting ``fields``; False if it was not ours."""
    fields.setdefault("updated_at", Now())
    return bool(
        Run.objects.filter(pk=run_id, lease_token=token).update(
            lease_owner="", lease_expires_at=None, **fields
        )
    )


__all__ = [
    "Claim",
    "end_stalled_holders",
    "lock_holders",
    "LeaseKeeper",
    "LivenessLock",
    "advisory_key",
    "claim",
    "live_owners",
    "proven_dead",
    "release",
    "still_ours",
]
