"""What the embedded default's strict level costs: SQLite's synchronous=FULL against NORMAL.

``python -m bench.sqlite_sync [--quick]``. In WAL mode, FULL syncs the WAL to disk at every
commit (strict, and every write that is not a relaxed checkpoint); NORMAL syncs it only when
SQLite checkpoints the WAL (relaxed checkpoints). Two figures, medians, FULL over NORMAL:

- floor: one INSERT of 1 KB and its COMMIT, on a connection of its own, in alternating
  blocks of each setting so that a noisy neighbour weighs on both;
- engine: the engine's checkpoint commit (fenced UPDATE, checkpoint, mutation and event rows
  in one transaction), as the worker times it (each checkpoint event carries its
  predecessor's commit latency), for a loop appending 1 KB per step at strict (FULL) and at
  relaxed (NORMAL), alternating runs, executed in this process.

The database lives in a temporary folder (``BENCH_SQLITE_DIR``, default the system's), on
whatever disk that is: a sync costs what the disk and its cache make it cost.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from bench.stats import median, ratio, table


def floor(folder: Path, blocks: int, per_block: int) -> dict[str, list[float]]:
    path = folder / "floor-bench.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE floor (id INTEGER PRIMARY KEY, data TEXT)")
    payloads = [os.urandom(512).hex() for _ in range(64)]  # 1 KB each, all different
    samples: dict[str, list[float]] = {"FULL": [], "NORMAL": []}
    for block in range(blocks):
        for setting in ("FULL", "NORMAL") if block % 2 == 0 else ("NORMAL", "FULL"):
            db.execute(f"PRAGMA synchronous = {setting}")  # not allowed inside a transaction
            for i in range(per_block):
                started = time.perf_counter()
                db.execute("BEGIN IMMEDIATE")
                db.execute("INSERT INTO floor (data) VALUES (?)", (payloads[i % 64],))
                db.execute("COMMIT")
                samples[setting].append(time.perf_counter() - started)
    db.close()
    return samples


def engine(runs: int, steps: int) -> dict[str, list[float]]:
    from django.core.management import call_command

    from bench.common import doorbell, execute_until_done
    from durability import operations
    from durability.models import Event, EventKind

    call_command("migrate", verbosity=0)
    samples: dict[str, list[float]] = {"strict": [], "relaxed": []}
    with doorbell(False):
        for i in range(runs):
            for level in ("strict", "relaxed") if i % 2 == 0 else ("relaxed", "strict"):
                run = operations.start("bench-append", {"n": steps}, durability=level)
                outcome = execute_until_done(run.id)
                if outcome != "succeeded":
                    raise RuntimeError(f"run {run.id} at {level}: {outcome}")
                latencies = Event.objects.filter(
                    run=run, kind=EventKind.CHECKPOINT, commit_us__isnull=False
                ).values_list("commit_us", flat=True)
                samples[level].extend(us / 1e6 for us in latencies)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sqlite_sync", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples: a smoke run")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="bench-sqlite-", dir=os.environ.get("BENCH_SQLITE_DIR")))
    try:
        # The product's settings on a SQLite file of this run's own (bench.settings refuses
        # any database whose name does not say "bench").
        for name in list(os.environ):
            if name.startswith(("DURABILITY_", "DATABASE_", "CELERY_")):
                del os.environ[name]
        os.environ.update(
            DJANGO_SETTINGS_MODULE="bench.settings",
            DATABASE_URL=f"sqlite:///{folder / 'bench.sqlite3'}",
            DURABILITY_VAR_DIR=str(folder / "var"),
            CELERY_BROKER_URL="memory://",
        )
        import django

        django.setup()
        quick = args.quick
        raw = floor(folder, blocks=4 if quick else 20, per_block=50 if quick else 200)
        steps = engine(runs=2 if quick else 10, steps=50 if quick else 200)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = [
        [
            "1 KB INSERT + COMMIT (floor)",
            f"{median(raw['FULL']) * 1e3:.3f} ms",
            f"{median(raw['NORMAL']) * 1e3:.3f} ms",
            f"{ratio(median(raw['FULL']), median(raw['NORMAL'])):.1f}x",
            f"{len(raw['FULL'])} / {len(raw['NORMAL'])}",
        ],
        [
            "checkpoint commit, 1 KB per step (engine)",
            f"{median(steps['strict']) * 1e3:.3f} ms",
            f"{median(steps['relaxed']) * 1e3:.3f} ms",
            f"{ratio(median(steps['strict']), median(steps['relaxed'])):.1f}x",
            f"{len(steps['strict'])} / {len(steps['relaxed'])}",
        ],
    ]
    print(f"SQLite in WAL mode, in {folder.parent}:")
    header = ["commit", "FULL (strict)", "NORMAL (relaxed)", "FULL / NORMAL", "samples"]
    print(table(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
