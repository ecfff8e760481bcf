"""Tracing cost: time per step through Celery (a real worker, strict level) with the
OpenTelemetry SDK exporting every span to a local OTLP/HTTP receiver, against tracing off,
in the same run; and whether any span was dropped (the receiver counts them).

Two workers run side by side, one traced and one not, each on its own queue, and short
batches go to one then the other, many times over (the order alternating from pair to
pair). The host's speed drifts by tens of percent within a minute, so each traced batch is
compared with the untraced batch next to it, and the figure is the median of those ratios.
The worker's CPU time per step (its pool process, every thread, from /proc) is printed too.

Target: at most 1.10x, no span dropped.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from typing import Any

from bench import procs
from bench.common import Bench, doorbell, truncate_product_tables
from bench.stats import table


def _cpu_seconds(pids: list[int]) -> float:
    """User and system CPU time of these processes, every thread included."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _batch(b: Bench, agent: str, runs: int, steps: int) -> float:
    """Seconds per step for ``runs`` runs of ``steps`` steps, from the first start to the
    last finish."""
    from durability import operations
    from durability.models import Run, RunStatus

    ids: list[Any] = []
    started = time.perf_counter()
    with doorbell(True):
        for _ in range(runs):
            ids.append(operations.start(agent, {"kb": 1, "n": steps}).id)
    give_up = time.monotonic() + 600
    while Run.objects.filter(pk__in=ids).exclude(status=RunStatus.SUCCEEDED).exists():
        if time.monotonic() > give_up:
            raise RuntimeError("tracing runs did not finish within 600 s")
        time.sleep(0.02)
    return (time.perf_counter() - started) / (runs * steps)


def run(b: Bench) -> None:
    from django.conf import settings

    from tests.otlp import OTLPReceiver

    print("\n== Tracing on (exporting to a local OTLP receiver) vs off, through Celery")
    receiver = OTLPReceiver().start()
    runs, steps, pairs = (2, 100, 4) if b.quick else (2, 250, 15)
    agent = "bench-ring-call"  # a journaled call per step: step, call and commit spans
    per_mode: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    workers: dict[str, procs.Worker] = {}
    default_queue = settings.CELERY_TASK_DEFAULT_QUEUE
    try:
        for mode in ("off", "on"):
            extra = {}
            if mode == "on":
                extra = {
                    "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                }
            env = b.child_env(**extra)
            env["CELERY_QUEUE"] = f"{b.queue}-{mode}"
            workers[mode] = procs.Worker(
                f"tracing-{mode}", env, b.folder, queues=[env["CELERY_QUEUE"]]
            ).start()
        # One batch each before measuring: imports, prepared statements, exporter session.
        for mode in ("off", "on"):
            settings.CELERY_TASK_DEFAULT_QUEUE = f"{b.queue}-{mode}"
            _batch(b, agent, runs, steps)
        for pair in range(pairs):
            for mode in ("off", "on") if pair % 2 == 0 else ("on", "off"):
                truncate_product_tables()
                settings.CELERY_TASK_DEFAULT_QUEUE = f"{b.queue}-{mode}"
                pool = workers[mode].pool()
                cpu_before = _cpu_seconds(pool)
                per_mode[mode].append(_batch(b, agent, runs, steps))
                cpu[mode].append((_cpu_seconds(pool) - cpu_before) / (runs * steps))
            print(
                f"  pair {pair + 1}/{pairs}: off {per_mode['off'][-1] * 1000:.3f} ms,"
                f" on {per_mode['on'][-1] * 1000:.3f} ms per step"
                f" ({per_mode['on'][-1] / per_mode['off'][-1]:.2f}x); worker CPU"
                f" {cpu['off'][-1] * 1000:.3f} / {cpu['on'][-1] * 1000:.3f} ms"
            )
        for worker in workers.values():
            worker.stop()  # a warm stop: the pool processes flush their exporters
        expected_steps = (pairs + 1) * runs * steps
        give_up = time.monotonic() + 30
        while time.monotonic() < give_up:
            got = sum(1 for s in receiver.spans() if s.name.startswith("step "))
            if got >= expected_steps:
                break
            time.sleep(0.2)
        spans = receiver.spans()
    finally:
        settings.CELERY_TASK_DEFAULT_QUEUE = default_queue
        for worker in workers.values():
            worker.stop()
        receiver.stop()
        truncate_product_tables()
    ratios = [on / off for off, on in zip(per_mode["off"], per_mode["on"], strict=True)]
    ratio = statistics.median(ratios)
    off, on = statistics.median(per_mode["off"]), statistics.median(per_mode["on"])
    cpu_off, cpu_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    step_spans = sum(1 for s in spans if s.name.startswith("step "))
    call_spans = sum(1 for s in spans if s.name.startswith("call "))
    commit_spans = sum(1 for s in spans if s.name == "checkpoint commit")
    print(
        table(
            [
                ["off", f"{off * 1000:.3f} ms", "-", f"{cpu_off * 1000:.3f} ms"],
                ["on", f"{on * 1000:.3f} ms", f"{ratio:.2f}x", f"{cpu_on * 1000:.3f} ms"],
            ],
            ["tracing", "per step (median)", "on / off (median of pairs)", "worker CPU per step"],
        )
    )
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"pair ratios: quartiles {quartiles[0]:.2f} / {quartiles[1]:.2f} / {quartiles[2]:.2f}")
    print(
        f"spans received: {len(spans)} ({step_spans} step, {call_spans} call,"
        f" {commit_spans} commit) for {expected_steps} traced steps"
    )
    by_name = Counter(s.name.split(" ", 1)[0] for s in spans)
    print(
        "per traced step: "
        + ", ".join(f"{name} {n / max(expected_steps, 1):.2f}" for name, n in by_name.most_common())
    )
    b.add(
        "tracing",
        "per step through Celery, tracing on / off (median of paired batches)",
        f"{on * 1000:.3f} / {off * 1000:.3f} ms, {ratio:.2f}x",
        "<= 1.10x",
        ratio <= 1.10,
    )
    dropped = expected_steps - min(step_spans, call_spans, commit_spans)
    b.add(
        "tracing",
        "step, call and commit spans received for traced steps",
        f"{step_spans} / {call_spans} / {commit_spans} of {expected_steps}",
        "none dropped",
        dropped <= 0,
    )
