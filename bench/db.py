"""The benchmark's own PostgreSQL database: created, guarded, measured and dropped here.

The machine's server is shared: the benchmark never changes its configuration and never
touches a database other than its own (``durability_bench`` by default).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import psycopg

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/durability_bench"
# Used by the test suite, the product and other sessions on this machine.
FORBIDDEN = frozenset({"durability", "test_durability", "durability_dash", "test_durability_dash"})


def check_bench_database(name: str) -> None:
    """Refuse any database the benchmark may not own (it truncates and drops it)."""
    if name in FORBIDDEN or "bench" not in str(name):
        raise RuntimeError(
            f"refusing to benchmark in database {name!r}: the benchmark truncates and drops"
            " its database, so it only uses one whose name contains 'bench'"
            f" (never {', '.join(sorted(FORBIDDEN))})"
        )


def bench_url() -> str:
    url = os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL)
    check_bench_database(db_name(url))
    return url


def db_name(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def connect(url: str, **kwargs: object) -> psycopg.Connection:
    # psycopg does not accept the "postgres://" scheme dj-database-url uses in every case.
    return psycopg.connect(url.replace("postgres://", "postgresql://", 1), **kwargs)


class BenchDatabase:
    """Creates the benchmark database (dropping a leftover from a crashed run first) and
    drops it at the end. An advisory lock on the maintenance database keeps two benchmark
    runs from dropping each other's database."""

    LOCK_KEY = 0x6265_6E63_6864_62  # "benchdb"

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = db_name(url)
        check_bench_database(self.name)
        self.admin: psycopg.Connection | None = None

    def create(self) -> None:
        self.admin = connect(with_db(self.url, "postgres"), autocommit=True)
        locked = self.admin.execute("SELECT pg_try_advisory_lock(%s)", [self.LOCK_KEY]).fetchone()
        if not locked or not locked[0]:
            raise RuntimeError("another benchmark run holds the benchmark database; wait for it")
        self._drop()
        self.admin.execute(f'CREATE DATABASE "{self.name}"')

    def _drop(self) -> None:
        assert self.admin is not None
        check_bench_database(self.name)
        # WITH (FORCE): a worker killed by the benchmark may leave a backend for a moment.
        self.admin.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')

    def drop(self) -> None:
        if self.admin is None:
            return
        try:
            for attempt in range(5):
                try:
                    self._drop()
                    break
                except psycopg.errors.ObjectInUse:
                    time.sleep(0.5 * (attempt + 1))
        finally:
            with contextlib.suppress(Exception):
                self.admin.execute("SELECT pg_advisory_unlock(%s)", [self.LOCK_KEY])
            self.admin.close()
            self.admin = None


# --- what the server says -----------------------------------------------------------------


@dataclass(frozen=True)
class WalCounters:
    wal_sync: int
    wal_write: int
    wal_records: int


def read_wal(observer: psycopg.Connection) -> WalCounters:
    """pg_stat_wal, read on a connection of its own. On PostgreSQL 15 a backend keeps its
    WAL counters in local memory and publishes them at most once a second when it goes idle,
    so the writer must call ``pg_stat_force_next_flush()`` (see ``flush_stats``) first. The
    counters are cluster-wide: other sessions can only add to them, so a check that they
    rose by at least N is a lower bound, never flattered by this process's own numbers."""
    with observer.transaction():
        # stats_fetch_consistency=cache would keep the first snapshot for the transaction.
        observer.execute("SELECT pg_stat_clear_snapshot()")
        row = observer.execute(
            "SELECT wal_sync, wal_write, wal_records FROM pg_stat_wal"
        ).fetchone()
    assert row is not None
    return WalCounters(int(row[0]), int(row[1]), int(row[2]))


def flush_stats(execute: Callable[[str], object]) -> None:
    """Make the calling backend publish its pending statistics: the flag takes effect when
    the backend next goes idle, hence the second statement."""
    execute("SELECT pg_stat_force_next_flush()")
    execute("SELECT 1")


PRODUCT_TABLES_SQL = """
SELECT c.relname, pg_total_relation_size(c.oid)
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.relname LIKE 'durability\\_%'
 ORDER BY c.relname
"""
