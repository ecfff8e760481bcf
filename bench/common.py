"""What every part of the benchmark shares: its settings, its figures, and helpers to run
the engine in this process."""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg


@dataclass
class Figure:
    """One line of the final summary. ``ok`` is None for figures without a target."""

    part: str
    name: str
    value: str
    target: str = ""
    ok: bool | None = None


@dataclass
class Bench:
    quick: bool
    folder: Path  # logs and side-channel files of this run
    db_url: str
    broker_url: str
    queue: str  # the Celery queue of this run's workers (unique per run)
    key_prefix: str  # Redis key prefix of this run, so cleanup deletes exactly its keys
    soak_seconds: float
    profile: bool
    seed: int
    figures: list[Figure] = field(default_factory=list)
    observer: psycopg.Connection | None = None  # reads pg_stat_wal from outside the engine

    def add(
        self, part: str, name: str, value: str, target: str = "", ok: bool | None = None
    ) -> None:
        self.figures.append(Figure(part, name, value, target, ok))

    def child_env(self, **extra: str) -> dict[str, str]:
        """Environment for worker and probe subprocesses: the product's defaults for every
        engine and Celery setting (a value inherited from the caller's shell could shorten
        the lease and flatter recovery), this run's database, broker, queue and agents."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("DURABILITY_", "CELERY_", "DATABASE_"))
        }
        env.update(
            DJANGO_SETTINGS_MODULE="bench.settings",
            DATABASE_URL=self.db_url,
            CELERY_BROKER_URL=self.broker_url,
            CELERY_QUEUE=self.queue,
            CELERY_KEY_PREFIX=self.key_prefix,
            DURABILITY_AGENT_MODULES="bench.agents",
            LOG_LEVEL="WARNING",
            PYTHONUNBUFFERED="1",
            **extra,
        )
        return env


@contextlib.contextmanager
def doorbell(enabled: bool) -> Iterator[None]:
    """In-process parts execute runs themselves: ringing Celery for them would only leave
    messages nobody consumes. Parts with workers need the real dispatcher."""
    from durability import dispatch
    from workers.dispatcher import publish

    dispatch.set_dispatcher(publish if enabled else None)
    try:
        yield
    finally:
        dispatch.set_dispatcher(publish)


def execute_until_done(run_id: Any, should_stop: Callable[[], bool] | None = None) -> str:
    """Execute a run in this process; a yielded slice is executed again (the engine hands a
    long run back every DURABILITY_SLICE_SECONDS)."""
    from durability.runtime import executor

    while True:
        outcome = executor.execute(run_id, should_stop=should_stop)
        if outcome != executor.Outcome.YIELDED or should_stop is not None:
            return str(outcome)


def truncate_product_tables() -> None:
    """A clean slate between parts: TRUNCATE gives every table new, empty files, so sizes
    measured afterwards hold only what the next part writes."""
    from django.db import OperationalError, connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            " AND tablename LIKE 'durability\\_%'"
        )
        names = [row[0] for row in cur.fetchall()]
        if not names:
            return
        statement = "TRUNCATE " + ", ".join(f'"{n}"' for n in names) + " RESTART IDENTITY CASCADE"
        # A worker's background thread may still be writing what the last batch left (a
        # snapshot): TRUNCATE locks table after table and can deadlock with it; the server
        # then aborts one of the two, and this side simply tries again.
        for attempt in range(5):
            try:
                cur.execute(statement)
                return
            except OperationalError as exc:
                if getattr(exc.__cause__, "sqlstate", "") != "40P01" or attempt == 4:
                    raise


def fmt_ratio(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


# A line of a module's "== Summary" table: figure, measured, target, ok or MISS.
_SUMMARY_LINE = re.compile(
    r"^(.+?)\s{2,}(\S+(?: ms)?)\s{2,}([<>=]+ [\d.]+(?: ms|x)?)\s+(ok|MISS)\s*$"
)


def module_part(bench: Bench, part: str, module: str) -> None:
    """A benchmark that seeds a database of its own (``python -m <module>``) as a part of
    ``make bench``: run in a process of its own (its own database and Django settings), its
    output printed, the lines of its summary added to the figures."""
    own = ("DJANGO_SETTINGS_MODULE", "DATABASE_URL")
    env = {k: v for k, v in os.environ.items() if k not in own}
    done = subprocess.run(
        [sys.executable, "-m", module], env=env, capture_output=True, text=True, check=False
    )
    print(done.stdout, done.stderr, sep="\n")
    for line in done.stdout.rpartition("== Summary")[2].splitlines():
        found = _SUMMARY_LINE.match(line)
        if found:
            name, value, target, verdict = found.groups()
            bench.add(part, name, value, target, verdict == "ok")
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{module} exited with {done.returncode}")
