"""Throughput: steps per second through Celery with one and two worker processes, against a
Celery no-op task rate measured with the same worker in the same run.

The engine executes a run's steps in one task until the run ends, waits or its time slice
is over, so steps per second are bounded by the commit path, not by Celery's per-task cost.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from bench import procs
from bench.common import Bench, doorbell, truncate_product_tables
from bench.stats import ratio, table


def noop_rate(b: Bench, client: redis.Redis, key: str, count: int, timeout: float) -> float:
    """Tasks per second between the first and the last no-op of a batch (published before
    the worker started, so publishing speed does not limit the rate)."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        first, last = client.get(f"{key}:0"), client.get(f"{key}:{count - 1}")
        if first and last:
            return (count - 1) / (float(last) - float(first))
        time.sleep(0.05)
    raise RuntimeError(f"the no-op batch {key} did not finish within {timeout} s")


def run(b: Bench) -> None:
    from config.celery import app

    print("\n== Throughput through Celery")
    client = redis.Redis.from_url(b.broker_url)
    noops = 500 if b.quick else 3000
    # 3,000 steps a run: with 750 a line timed about a second of work, and on a shared
    # 2-core machine the ratio of one run then ranged from 1.7x to 3.0x for the same code.
    runs_n, steps_n = 4, (150 if b.quick else 3000)
    rows = []
    for concurrency in (1, 2):
        truncate_product_tables()
        noop_queue = f"{b.queue}-noop{concurrency}"
        key = f"{b.key_prefix}noop{concurrency}"
        with app.producer_or_acquire() as producer:
            for i in range(noops):
                app.send_task(
                    "bench.noop",
                    args=(i, noops - 1, key),
                    queue=noop_queue,
                    producer=producer,
                )
        worker = procs.Worker(
            f"throughput-worker-c{concurrency}",
            b.child_env(),
            b.folder,
            queues=[b.queue, noop_queue],
            concurrency=concurrency,
            include="bench.tasks",
        ).start()
        try:
            tasks_per_s = noop_rate(b, client, key, noops, timeout=300)
            elapsed = _run_through(runs_n, steps_n)
        finally:
            worker.stop()
        steps_per_s = runs_n * steps_n / elapsed
        rows.append(
            [
                concurrency,
                f"{tasks_per_s:.0f}/s",
                f"{steps_per_s:.0f}/s",
                f"{ratio(steps_per_s, tasks_per_s):.2f}x",
            ]
        )
        b.add(
            "throughput",
            f"{concurrency} worker process(es): steps/s vs no-op tasks/s",
            f"{steps_per_s:.0f} vs {tasks_per_s:.0f} = {ratio(steps_per_s, tasks_per_s):.2f}x",
        )
    print(f"{runs_n} runs x {steps_n} steps (1 KB state) per line; {noops} no-op tasks")
    print(table(rows, ["processes", "no-op tasks", "engine steps", "steps / no-op"]))
    truncate_product_tables()


def _run_through(runs_n: int, steps_n: int) -> float:
    """Seconds for ``runs_n`` runs of ``steps_n`` steps to succeed through the workers."""
    from durability import operations
    from durability.models import Run, RunStatus

    ids: list[Any] = []
    started = time.perf_counter()
    with doorbell(True):
        for _ in range(runs_n):
            ids.append(operations.start("bench-ring", {"kb": 1, "n": steps_n}).id)
    give_up = time.monotonic() + 600
    while Run.objects.filter(pk__in=ids).exclude(status=RunStatus.SUCCEEDED).exists():
        if time.monotonic() > give_up:
            raise RuntimeError("throughput runs did not finish within 600 s")
        time.sleep(0.02)
    return time.perf_counter() - started
