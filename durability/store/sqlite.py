"""The store on SQLite, the embedded default: the ORM for every write (one writer at a time),
file locks for liveness, figures computed in Python."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, transaction

from durability.conf import conf
from durability.store.base import RunLock, Store
from durability.store.reconnect import drop

if TYPE_CHECKING:
    from durability.checkpoints import StepCommit

# A level's promise, as on PostgreSQL. Connections open at synchronous=FULL
# (config/settings.py): in WAL mode each commit then syncs the WAL to disk before COMMIT
# returns, like PostgreSQL's default synchronous_commit=on, so every write that is not a
# relaxed checkpoint (strict and periodic checkpoints, effect intents, call records,
# decisions, operator actions) survives an OS crash or a power loss. A relaxed checkpoint
# commits under NORMAL, like synchronous_commit=off: the WAL is synced only when SQLite
# checkpoints it, so a killed process loses nothing while an OS crash or a power loss may lose
# the last relaxed commits (never corrupting the file). periodic saves commits, not flushes:
# its checkpoints stay at FULL as on PostgreSQL. replicated is refused on SQLite.
_SYNCHRONOUS = {"relaxed": "NORMAL"}


def lock_path(run_id: Any) -> str:
    folder = conf.LOCK_DIR
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{run_id}.lock")


class FileLock(RunLock):
    """An ``flock`` on a file of the run's own, freed by the OS when the process dies."""

    def __init__(self, run_id: Any) -> None:
        self.run_id = run_id
        self._fd: int | None = None

    def on_connection(self) -> bool:
        return False

    def acquire(self) -> bool:
        fd = os.open(lock_path(self.run_id), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        self.held = True
        return True

    def release(self) -> None:
        if not self.held or self._fd is None:
            return
        self.held = False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _file_locked(run_id: Any) -> bool:
    path = lock_path(run_id)
    if not os.path.exists(path):
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class SqliteStore(Store):
    @contextlib.contextmanager
    def synchronous(self, level: str) -> Iterator[None]:
        """Within the block, SQLite's ``synchronous`` setting for a commit at ``level``.
        SQLite refuses to change it inside a transaction: inside a caller's, the commit
        keeps the connection's (FULL, only ever stronger). The previous setting is put back
        after; if that fails, the connection is closed, so that the next one opens at FULL
        again."""
        lowered = _SYNCHRONOUS.get(level)
        if lowered is None or self.conn.in_atomic_block:
            yield
            return
        with self.conn.cursor() as cur:
            cur.execute("PRAGMA synchronous")
            previous = int(cur.fetchone()[0])
            cur.execute(f"PRAGMA synchronous = {lowered}")
        try:
            yield
        finally:
            try:
                with self.conn.cursor() as cur:
                    cur.execute(f"PRAGMA synchronous = {previous}")
            except DatabaseError:  # a broken connection: the next one opens at FULL again
                drop(self.conn)

    def commit_step(self, c: StepCommit, data: str, inside: Callable[[], None]) -> int | None:
        with self.synchronous(c.durability), transaction.atomic(using=self.conn.alias):
            checkpoint_id = self.orm_commit(c, data)
            if checkpoint_id is not None:
                inside()
        return checkpoint_id

    def run_lock(self, run_id: Any) -> RunLock:
        return FileLock(run_id)

    def lock_holders(self, run_ids: list[Any]) -> dict[str, set[int]]:
        return {str(run_id): set() for run_id in run_ids if _file_locked(run_id)}

    def private_files(self) -> list[str]:
        name = str(self.conn.settings_dict.get("NAME") or "")
        if not name or name == ":memory:" or name.startswith("file:"):
            return []
        return [name, f"{name}-wal", f"{name}-shm", f"{name}-journal"]
