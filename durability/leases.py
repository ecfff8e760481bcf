"""Leases with fencing, heartbeats, and a liveness lock that dies with its process.

A worker advances a run only while it holds the lease; every claim bumps the fencing token
and every fenced write carries it. The lease TTL is long (30 s by default) so that a paused
or partitioned worker is not declared dead too eagerly, yet a *dead* worker is noticed at
once: while it executes a run, a worker holds a lock that the operating system or the
database frees the moment its process dies (a session advisory lock on PostgreSQL, freed
~6 ms after SIGKILL; an ``flock`` on a file for the embedded SQLite default). The sweeper
treats "running, but nobody holds its lock" as dead.

Heartbeats run on their own thread and database connection, so a step blocked in a 60 s
call keeps its lease. Lease times use the database clock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import Case, DateTimeField, ExpressionWrapper, F, Q, When
from django.db.models.functions import Coalesce, Now

from durability.models import (
    TIMED_WAITS,
    Checkpoint,
    Event,
    EventKind,
    Run,
    RunStatus,
    WaitReason,
)

log = logging.getLogger(__name__)


def lease_seconds() -> float:
    return float(getattr(settings, "DURABILITY_LEASE_SECONDS", 30.0))


def heartbeat_seconds() -> float:
    return float(getattr(settings, "DURABILITY_HEARTBEAT_SECONDS", lease_seconds() / 3))


def db_now_plus(seconds: float) -> ExpressionWrapper:
    return ExpressionWrapper(Now() + timedelta(seconds=seconds), output_field=DateTimeField())


# --- the liveness lock -------------------------------------------------------------------------


def advisory_key(run_id: Any) -> int:
    """A run's advisory-lock key: the first 8 bytes of its UUID as a signed bigint."""
    raw = run_id.bytes if hasattr(run_id, "bytes") else __import__("uuid").UUID(str(run_id)).bytes
    return int.from_bytes(raw[:8], "big", signed=True)


def _lock_path(run_id: Any) -> str:
    folder = getattr(settings, "DURABILITY_LOCK_DIR", "var/locks")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{run_id}.lock")


class LivenessLock:
    """Held by the process executing a run, on the connection (or file) of the thread that
    creates it; released by the OS or the database if the process dies."""

    def __init__(self, run_id: Any) -> None:
        self.run_id = run_id
        self._fd: int | None = None
        self.held = False

    def acquire(self) -> bool:
        if connection.vendor == "postgresql":
            with connection.cursor() as cur:
                cur.execute("SELECT pg_try_advisory_lock(%s)", [advisory_key(self.run_id)])
                self.held = bool(cur.fetchone()[0])
            return self.held
        fd = os.open(_lock_path(self.run_id), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        self.held = True
        return True

    def on_connection(self) -> bool:
        """Held by a database session (which a dropped connection frees), not by a file."""
        return self._fd is None

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
            return
        try:
            with connection.cursor() as cur:
                cur.execute("SELECT pg_advisory_unlock(%s)", [advisory_key(self.run_id)])
        except DatabaseError:
            connection.close()  # closing the session frees the lock as well


# Advisory locks granted in this database, as (classid, objid, objsubid, pid): objsubid 1 for
# a single bigint key (a run's), 2 for a pair of integers (a worker's presence).
HELD_ADVISORY_LOCKS = (
    "SELECT classid::bigint, objid::bigint, objsubid, pid FROM pg_locks"
    " WHERE locktype = 'advisory' AND granted"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def end_stalled_holder(run_id: Any, pids: set[int]) -> int:
    """End the database session that still holds the liveness lock of a run whose lease
    expired: a process stopped or cut off from its workers while its session lives on
    (SIGSTOP, a paused VM, a partition the server has not noticed). Until that session ends,
    every worker the run is sent to would find it held and leave it alone. The stalled
    process, if it ever resumes, finds its connection gone and its token outdated.

    Only ``pids``, the sessions seen holding the lock when the lease was judged expired,
    and only while they still hold it: a worker that took the run since is never touched.
    Returns the number of sessions ended (PostgreSQL; elsewhere the lock dies with the
    process)."""
    if connection.vendor != "postgresql" or not pids:
        return 0
    key = advisory_key(run_id) & 0xFFFFFFFFFFFFFFFF
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))"
            f" FROM ({HELD_ADVISORY_LOCKS}) held WHERE objsubid = 1 AND classid = %s"
            " AND objid = %s AND pid = ANY(%s) AND pid <> pg_backend_pid()",
            [key >> 32, key & 0xFFFFFFFF, sorted(pids)],
        )
        return int(cur.fetchone()[0])


def lock_holders(run_ids: list[Any]) -> dict[str, set[int]]:
    """Of ``run_ids``, those whose liveness lock some process holds now, with the database
    sessions (pids) holding it (none known outside PostgreSQL)."""
    if not run_ids:
        return {}
    if connection.vendor == "postgresql":
        wanted = {}
        for run_id in run_ids:
            key = advisory_key(run_id) & 0xFFFFFFFFFFFFFFFF
            wanted[(key >> 32, key & 0xFFFFFFFF)] = str(run_id)
        with connection.cursor() as cur:
            cur.execute(
                f"SELECT classid, objid, pid FROM ({HELD_ADVISORY_LOCKS}) held WHERE objsubid = 1"
            )
            holders: dict[str, set[int]] = {}
            for a, b, pid in cur.fetchall():
                run = wanted.get((int(a), int(b)))
                if run is not None:
                    holders.setdefault(run, set()).add(int(pid))
        return holders
    return {run_id: set() for run_id in _flock_held(run_ids)}


def live_owners(run_ids: list[Any]) -> set[str]:
    """Of ``run_ids``, those whose liveness lock some process holds now."""
    return set(lock_holders(run_ids))


def _flock_held(run_ids: list[Any]) -> set[str]:
    alive = set()
    for run_id in run_ids:
        path = _lock_path(run_id)
        if not os.path.exists(path):
            continue
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            alive.add(str(run_id))
        finally:
            os.close(fd)
    return alive


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


def claim(run_id: Any, worker: str, *, owner_dead: bool) -> Claim | None:
    """Take the lease with one conditional UPDATE; ``None`` when the run is not ours to run
    (finished, waiting, not due, or leased by a live worker).

    ``owner_dead``: this worker holds the run's liveness lock, so any "running" lease
    belongs to a process that died."""
    runnable = Q(status=RunStatus.QUEUED) & (Q(wake_at__isnull=True) | Q(wake_at__lte=Now()))
    timer_due = Q(status=RunStatus.WAITING, wait_reason__in=TIMED_WAITS, wake_at__lte=Now())
    if owner_dead:
        stale = Q(status=RunStatus.RUNNING)
    else:
        stale = Q(status=RunStatus.RUNNING) & (
            Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=Now())
        )
    with transaction.atomic():
        busy = _over_concurrency(run_id)
        if busy:
            from durability.limits import park

            park(run_id, busy)
            return None
        updated = (
            Run.objects.filter(pk=run_id)
            .filter(runnable | timer_due | stale)
            .update(
                lease_token=F("lease_token") + 1,
                lease_owner=worker,
                lease_expires_at=db_now_plus(lease_seconds()),
                # A lease taken over from a dead process: remember its last sign of life.
                lost_heartbeat_at=Case(
                    When(status=RunStatus.RUNNING, then=Coalesce("heartbeat_at", "claimed_at")),
                    default=F("lost_heartbeat_at"),
                ),
                # Taken over here, or requeued by the sweeper from a dead attempt.
                recoveries=Case(
                    When(
                        Q(status=RunStatus.RUNNING) | Q(lost_heartbeat_at__isnull=False),
                        then=F("recoveries") + 1,
                    ),
                    default=F("recoveries"),
                ),
                heartbeat_at=Now(),
                claimed_at=Now(),
                status=RunStatus.RUNNING,
                attempts=F("attempts") + 1,
                started_at=Coalesce("started_at", Now()),
                wait_reason=WaitReason.NONE,
                wait_detail="",
                wake_at=None,
                updated_at=Now(),
            )
        )
        if not updated:
            return None
        run = Run.objects.get(pk=run_id)
        recovered = run.lost_heartbeat_at is not None
        events = [
            Event(
                run=run,
                kind=EventKind.CLAIMED,
                seq=run.head_seq,
                step=run.step,
                worker=worker,
                data=f'{{"attempt":{run.attempts}}}',
            )
        ]
        figures: dict[str, float | None] = {}
        lost_at = run.lost_heartbeat_at
        if recovered:
            event, figures = _recovered_event(run, worker)
            events.append(event)
            Run.objects.filter(pk=run_id).update(lost_heartbeat_at=None)
            run.lost_heartbeat_at = None
        Event.objects.bulk_create(events)
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
    if not limit:
        return ""
    from durability.limits import agent_slot_taken

    return agent_slot_taken(agent, limit, run_id)


def _recovered_event(run: Run, worker: str) -> tuple[Event, dict[str, float | None]]:
    """Recovery time runs from the lost attempt's last sign of life to this claim; work
    lost from the last checkpoint to that same moment."""
    from durability import canonical

    lost_at = run.lost_heartbeat_at
    claimed_at = run.claimed_at
    head_at = (
        Checkpoint.objects.filter(run=run, seq=run.head_seq)
        .values_list("created_at", flat=True)
        .first()
    )
    recovery_ms = max(0.0, (claimed_at - lost_at).total_seconds() * 1000) if lost_at else None
    lost_ms = max(0.0, (lost_at - head_at).total_seconds() * 1000) if lost_at and head_at else None
    data = {"recovery_ms": recovery_ms, "work_lost_ms": lost_ms, "attempt": run.attempts}
    event = Event(
        run=run,
        kind=EventKind.RECOVERED,
        seq=run.head_seq,
        step=run.step,
        worker=worker,
        data=canonical.dumps(data).decode(),
    )
    return event, {"recovery_ms": recovery_ms, "work_lost_ms": lost_ms}


# --- keeping the lease ----------------------------------------------------------------------


class LeaseKeeper:
    """A thread that holds the run's liveness lock and renews its lease.

    ``acquire()`` takes the lock (before the claim, so a claimed lease always has a live
    lock behind it); ``start(token)`` begins heartbeats; ``lost`` is set when a heartbeat
    finds the token changed; ``stop()`` releases the lock and closes the connection."""

    def __init__(self, run_id: Any, worker: str) -> None:
        self.run_id = run_id
        self.worker = worker
        self.lost = threading.Event()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._token: int | None = None
        self._token_set = threading.Event()
        self._locked = False
        self._error: BaseException | None = None
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
        self._token_set.set()

    def stop(self) -> None:
        self._stop.set()
        self._token_set.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _main(self) -> None:
        lock = LivenessLock(self.run_id)
        try:
            try:
                self._locked = lock.acquire()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self._error = exc
            finally:
                self._ready.set()
            if not self._locked:
                return
            self._token_set.wait()
            interval = heartbeat_seconds()
            while not self._stop.wait(interval):
                if self._token is None:
                    break
                if not self._beat(lock):
                    self.lost.set()
                    break
        finally:
            try:
                lock.release()
            finally:
                connection.close()

    def _beat(self, lock: LivenessLock) -> bool:
        try:
            if not lock.held and not lock.acquire():
                return False  # after a reconnect someone else holds the run
            return renew(self.run_id, self._token)
        except DatabaseError:
            # A dropped session freed the advisory lock: until it is taken again the sweeper
            # sees a dead worker and gives the run away, so take it back at once, not a
            # heartbeat later. If the database is unreachable, keep trying.
            log.warning("heartbeat for run %s failed; retrying", self.run_id, exc_info=True)
            connection.close()
            if lock.on_connection():
                lock.held = False
                try:
                    if not lock.acquire():
                        return False  # someone else holds the run now
                except DatabaseError:
                    connection.close()
            return True


_RENEW = """
WITH cfg AS (SELECT set_config('synchronous_commit', 'local', true) AS v)
UPDATE durability_run
   SET lease_expires_at = now() + %s * interval '1 second', heartbeat_at = now()
 WHERE id = %s AND lease_token = %s AND (SELECT v FROM cfg) IS NOT NULL
"""


def renew(run_id: Any, token: int) -> bool:
    """A heartbeat: extend the lease if it is still ours. It waits for no standby (a row lock
    held by a heartbeat stuck on a lost standby would block the run's own commits)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute(_RENEW, [lease_seconds(), run_id, token])
            return cur.rowcount > 0
    return bool(
        Run.objects.filter(pk=run_id, lease_token=token).update(
            lease_expires_at=db_now_plus(lease_seconds()), heartbeat_at=Now()
        )
    )


def release(run_id: Any, token: int, **fields: Any) -> bool:
    """Give the lease back (fenced) while setting ``fields``; False if it was not ours."""
    fields.setdefault("updated_at", Now())
    return bool(
        Run.objects.filter(pk=run_id, lease_token=token).update(
            lease_owner="", lease_expires_at=None, **fields
        )
    )


__all__ = [
    "HELD_ADVISORY_LOCKS",
    "Claim",
    "end_stalled_holder",
    "lock_holders",
    "LeaseKeeper",
    "LivenessLock",
    "advisory_key",
    "claim",
    "live_owners",
    "release",
]
