"""Tracing cost: time per step through Celery (a real worker, strict level) with the
OpenTelemetry SDK exporting every span to a local OTLP/HTTP receiver, against tracing off,
in the same run; and whether any span was dropped (the receiver counts them).

Two workers run side by side, one traced and one not, each on its own queue, and short
batches go to one then the other, many times over (the order alternating from pair to
pair). The host's speed drifts by tens of percent within a minute, so each traced batch is
compared with the untraced batch next to it, and the figure is the median of those ratios.
The worker's CPU time per step (its pool process, every thread, from /proc) is printed too.
Every span is the SDK's, from its tracer, exported by the stock OTLP/HTTP exporter behind its
batch span processor; a checkpoint commit is an event of its step's span.

Target: at most 1.15x, no span dropped (every traced step's span, its call's span and its
commit's event counted at the receiver).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
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


@dataclass
class _Samples:
    """Seconds and worker CPU seconds per step, by mode ("off", "on"), batch after batch."""

    per_step: dict[str, list[float]] = field(default_factory=lambda: {"off": [], "on": []})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {"off": [], "on": []})


def _workers(b: Bench, receiver_url: str) -> dict[str, procs.Worker]:
    """An untraced and a traced worker, each on a queue of its own."""
    workers: dict[str, procs.Worker] = {}
    for mode in ("off", "on"):
        extra = {}
        if mode == "on":
            extra = {
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver_url,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            }
        env = b.child_env(**extra)
        env["CELERY_QUEUE"] = f"{b.queue}-{mode}"
        workers[mode] = procs.Worker(
            f"tracing-{mode}", env, b.folder, queues=[env["CELERY_QUEUE"]]
        ).start()
    return workers


def _pairs(b: Bench, workers: dict[str, procs.Worker], shape: tuple[int, int, int]) -> _Samples:
    from django.conf import settings

    runs, steps, pairs = shape
    samples = _Samples()
    # One batch each before measuring: imports, prepared statements, exporter session.
    for mode in ("off", "on"):
        settings.CELERY_TASK_DEFAULT_QUEUE = f"{b.queue}-{mode}"
        _batch(b, AGENT, runs, steps)
    for pair in range(pairs):
        for mode in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            truncate_product_tables()
            settings.CELERY_TASK_DEFAULT_QUEUE = f"{b.queue}-{mode}"
            pool = workers[mode].pool()
            cpu_before = _cpu_seconds(pool)
            samples.per_step[mode].append(_batch(b, AGENT, runs, steps))
            samples.cpu[mode].append((_cpu_seconds(pool) - cpu_before) / (runs * steps))
        off, on = samples.per_step["off"][-1], samples.per_step["on"][-1]
        print(
            f"  pair {pair + 1}/{pairs}: off {off * 1000:.3f} ms, on {on * 1000:.3f} ms per step"
            f" ({on / off:.2f}x); worker CPU {samples.cpu['off'][-1] * 1000:.3f} /"
            f" {samples.cpu['on'][-1] * 1000:.3f} ms"
        )
    return samples


def _received(receiver: Any, expected_steps: int) -> list:
    """The spans the receiver got, once every traced step's span is in (or 30 s passed)."""
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up:
        if sum(1 for s in receiver.spans() if s.name.startswith("step ")) >= expected_steps:
            break
        time.sleep(0.2)
    return receiver.spans()


AGENT = "bench-ring-call"  # a journaled call per step: a step span, a call span, a commit event


def run(b: Bench) -> None:
    from django.conf import settings

    from tests.otlp import OTLPReceiver

    print("\n== Tracing on (exporting to a local OTLP receiver) vs off, through Celery")
    receiver = OTLPReceiver().start()
    shape = (2, 100, 4) if b.quick else (2, 250, 15)
    workers: dict[str, procs.Worker] = {}
    default_queue = settings.CELERY_TASK_DEFAULT_QUEUE
    try:
        workers = _workers(b, receiver.url)
        samples = _pairs(b, workers, shape)
        for worker in workers.values():
            worker.stop()  # a warm stop: the pool processes flush their exporters
        expected_steps = (shape[2] + 1) * shape[0] * shape[1]
        spans = _received(receiver, expected_steps)
    finally:
        settings.CELERY_TASK_DEFAULT_QUEUE = default_queue
        for worker in workers.values():
            worker.stop()
        receiver.stop()
        truncate_product_tables()
    _report_time(b, samples)
    _report_spans(b, spans, expected_steps)


def _report_time(b: Bench, samples: _Samples) -> None:
    per_step, cpu = samples.per_step, samples.cpu
    ratios = [on / off for off, on in zip(per_step["off"], per_step["on"], strict=True)]
    ratio = statistics.median(ratios)
    off, on = statistics.median(per_step["off"]), statistics.median(per_step["on"])
    cpu_off, cpu_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
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
    b.add(
        "tracing",
        "per step through Celery, tracing on / off (median of paired batches)",
        f"{on * 1000:.3f} / {off * 1000:.3f} ms, {ratio:.2f}x",
        "<= 1.15x",
        ratio <= 1.15,
    )


def _report_spans(b: Bench, spans: list, expected_steps: int) -> None:
    steps = [s for s in spans if s.name.startswith("step ")]
    step_spans = len(steps)
    call_spans = sum(1 for s in spans if s.name.startswith("call "))
    commits = sum(1 for s in steps for name, _ in s.events if name == "checkpoint.commit")
    print(
        f"spans received: {len(spans)}; of the traced steps' {2 * expected_steps} expected"
        f" (a step and a call each), {step_spans + call_spans} ({step_spans} step,"
        f" {call_spans} call), with {commits} of {expected_steps} commit events"
    )
    by_name = Counter(s.name.split(" ", 1)[0] for s in spans)
    print(
        "per traced step: "
        + ", ".join(f"{name} {n / max(expected_steps, 1):.2f}" for name, n in by_name.most_common())
    )
    dropped = expected_steps - min(step_spans, call_spans, commits)
    b.add(
        "tracing",
        "step spans, call spans and commit events received for traced steps",
        f"{step_spans} / {call_spans} / {commits} of {expected_steps}",
        "none dropped",
        dropped <= 0,
    )
