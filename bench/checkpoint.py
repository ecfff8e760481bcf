"""The engine's benchmarks: ``python -m bench.checkpoint [--quick] [--only PARTS]``.

Parts (see docs/performance.md): overhead, storage, rebuild, recovery (a pool process
killed), node-recovery (a whole worker killed), throughput, tracing, langgraph-state (the
latest-state load against LangGraph's ``get_state``; needs the ``bench`` extra), langgraph
(``DurableSaver`` against LangGraph's ``PostgresSaver``), api (the JSON API through gunicorn
on 100,000 seeded runs: ``bench.api``, in a process and database of its own), dashboard (the
dashboard's pages the same way: ``bench.dashboard``), and the soak (``--soak SECONDS``).
Every figure is a ratio to a baseline measured in the same run, or a median/percentile: the
machine is shared and noisy, so no single timing means much.

The benchmark owns a database of its own (``durability_bench``; ``BENCH_DATABASE_URL``),
created at the start and dropped at the end, a Redis key prefix and Celery queue of its
own (``BENCH_REDIS_URL``, default db 5), and its subprocesses, each in its own process group
and killed at the end whatever happens. It changes no server's configuration.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

from bench.common import Bench
from bench.db import BenchDatabase, bench_url, connect
from bench.stats import table

PARTS = (
    "overhead",
    "storage",
    "rebuild",
    "recovery",
    "node-recovery",
    "throughput",
    "tracing",
    "langgraph-state",
    "langgraph",
    "api",
    "dashboard",
    "soak",
)
DEFAULT_SOAK_IF_SELECTED = 60.0


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__)
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated parts to run (default: all but soak): {', '.join(PARTS)}",
    )
    parser.add_argument("--quick", action="store_true", help="fewer samples: a smoke run")
    parser.add_argument(
        "--soak",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="run the oversubscribed-CPU soak this long (0: off; docs/performance.md quotes 600)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the engine loop and rebuild"
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument("--keep-db", action="store_true", help="do not drop the database")
    parser.add_argument("--keep-logs", action="store_true", help="keep the logs folder")
    args = parser.parse_args(argv)
    chosen = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s): {', '.join(unknown)} (known: {', '.join(PARTS)})")
    if not chosen:
        chosen = [p for p in PARTS if p != "soak" or args.soak > 0]
    elif "soak" in chosen and args.soak <= 0:
        args.soak = DEFAULT_SOAK_IF_SELECTED
    args.parts = [p for p in PARTS if p in chosen]
    return args


def configure(db_url: str, broker_url: str, queue: str, prefix: str) -> None:
    """This process's environment, set before Django reads it. Engine and Celery settings
    inherited from the caller's shell are dropped: the figures are for the defaults."""
    for name in list(os.environ):
        if name.startswith(("DURABILITY_", "CELERY_")) or name == "DATABASE_URL":
            del os.environ[name]
    os.environ.update(
        DJANGO_SETTINGS_MODULE="bench.settings",
        DATABASE_URL=db_url,
        CELERY_BROKER_URL=broker_url,
        CELERY_QUEUE=queue,
        CELERY_KEY_PREFIX=prefix,
        DURABILITY_AGENT_MODULES="bench.agents",
        LOG_LEVEL="WARNING",
    )


def _on_signal(signum: int, frame: object) -> None:
    # Unwind through every finally: subprocesses, Redis keys and the database go with it.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    run_id = uuid.uuid4().hex[:8]
    db_url = bench_url()
    broker_url = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/5")
    folder = Path(tempfile.mkdtemp(prefix=f"durability-bench-{run_id}-"))
    bench = Bench(
        quick=args.quick,
        folder=folder,
        db_url=db_url,
        broker_url=broker_url,
        queue=f"bench-{run_id}",
        key_prefix=f"bench-{run_id}:",
        soak_seconds=args.soak,
        profile=args.profile,
        seed=seed,
    )
    configure(db_url, broker_url, bench.queue, bench.key_prefix)
    signal.signal(signal.SIGTERM, _on_signal)
    database = BenchDatabase(db_url)
    crashed: list[str] = []
    started = time.monotonic()
    print(
        f"bench {run_id}: parts {', '.join(args.parts)}{' (quick)' if args.quick else ''};"
        f" seed {seed}; database {database.name}; logs {folder}"
    )
    if any(name.startswith("OTEL_EXPORTER_OTLP") and value for name, value in os.environ.items()):
        # Exporting spans costs time per step: say so, since the figures then include it.
        print("note: an OTLP endpoint is set, so workers export telemetry during the run")
    try:
        database.create()
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0, interactive=False)
        bench.observer = connect(db_url, autocommit=True)
        for part in args.parts:
            try:
                _part(part, bench)()
            except Exception:  # noqa: BLE001 - one broken part must not hide the others
                crashed.append(part)
                traceback.print_exc()
                bench.add(part, "part crashed (see the traceback above)", "error", "", False)
    finally:
        _cleanup(bench, database, keep_db=args.keep_db)
        if crashed or args.keep_logs:
            print(f"logs kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    _summary(bench, time.monotonic() - started)
    return 1 if crashed else 0


def _part(name: str, bench: Bench) -> Callable[[], None]:
    if name == "overhead":
        from bench import overhead

        return lambda: overhead.run(bench)
    if name == "langgraph":
        from bench import langgraph_saver

        return lambda: langgraph_saver.run(bench)
    if name == "storage":
        from bench import storage

        return lambda: storage.run(bench)
    if name == "rebuild":
        from bench import rebuild

        return lambda: rebuild.run(bench)
    if name == "recovery":
        from bench import recovery

        return lambda: recovery.run(bench)
    if name == "node-recovery":
        from bench import recovery

        return lambda: recovery.run_node(bench)
    if name == "throughput":
        from bench import throughput

        return lambda: throughput.run(bench)
    if name == "tracing":
        from bench import tracing

        return lambda: tracing.run(bench)
    if name == "langgraph-state":
        from bench import langgraph_state

        return lambda: langgraph_state.run(bench)

    if name == "api":
        from bench import api

        return lambda: api.run(bench)
    if name == "dashboard":
        from bench import dashboard

        return lambda: dashboard.run(bench)
    from bench import recovery

    return lambda: recovery.soak(bench, bench.soak_seconds)


def _cleanup(bench: Bench, database: BenchDatabase, *, keep_db: bool) -> None:
    from bench import procs

    procs.stop_all()
    try:
        import redis

        client = redis.Redis.from_url(bench.broker_url)
        # Only this run's keys: every key kombu wrote carries the run's prefix, and so do
        # the no-op task's; queues published to before a prefix applied would not, so
        # delete the plain queue names too.
        keys = list(client.scan_iter(match=f"{bench.key_prefix}*", count=1000))
        keys += [bench.queue, f"{bench.queue}-noop1", f"{bench.queue}-noop2"]
        if keys:
            client.delete(*keys)
    except Exception as exc:  # noqa: BLE001 - cleanup goes on
        print(f"cleanup: Redis keys not removed: {exc}")
    try:
        from django.db import connections

        connections.close_all()
    except Exception:  # noqa: BLE001 - Django may not be set up yet
        pass
    if bench.observer is not None:
        bench.observer.close()
    if keep_db:
        print(f"database {database.name} kept")
        if database.admin is not None:
            database.admin.close()
    else:
        database.drop()


def _summary(bench: Bench, seconds: float) -> None:
    verdict = {True: "PASS", False: "FAIL", None: "-"}
    rows = [[f.part, f.name, f.value, f.target, verdict[f.ok]] for f in bench.figures]
    print(f"\n== Summary ({seconds / 60:.1f} min, seed {bench.seed})")
    print(table(rows, ["part", "figure", "value", "target", "result"]))


if __name__ == "__main__":
    sys.exit(main())
