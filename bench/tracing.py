"""Tracing cost: time per step through Celery (a real worker, strict level) with the
OpenTelemetry SDK exporting every span to a local OTLP/HTTP receiver, against tracing off,
alternating in the same run; and whether any span was dropped (the receiver counts them).

Target (issue #5): at most 1.10x, no span dropped.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Any

from bench import procs
from bench.common import Bench, doorbell, truncate_product_tables
from bench.stats import table


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
    from tests.otlp import OTLPReceiver

    print("\n== Tracing on (exporting to a local OTLP receiver) vs off, through Celery")
    receiver = OTLPReceiver().start()
    runs, steps, rounds = (2, 150, 2) if b.quick else (2, 500, 3)
    agent = "bench-ring-call"  # a journaled call per step: step, call and commit spans
    per_mode: dict[str, list[float]] = {"off": [], "on": []}
    expected_steps = 0
    try:
        for round_no in range(rounds):
            for mode in ("off", "on"):
                truncate_product_tables()
                extra = {}
                if mode == "on":
                    extra = {
                        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                    }
                worker = procs.Worker(
                    f"tracing-{mode}-{round_no}",
                    b.child_env(**extra),
                    b.folder,
                    queues=[b.queue],
                ).start()
                try:
                    per_mode[mode].append(_batch(b, agent, runs, steps))
                finally:
                    worker.stop()  # a warm stop: the pool processes flush their exporters
                if mode == "on":
                    expected_steps += runs * steps
                print(
                    f"  round {round_no + 1}/{rounds}, tracing {mode}:"
                    f" {per_mode[mode][-1] * 1000:.3f} ms per step"
                )
        give_up = time.monotonic() + 30
        while time.monotonic() < give_up:
            got = sum(1 for s in receiver.spans() if s.name.startswith("step "))
            if got >= expected_steps:
                break
            time.sleep(0.2)
        spans = receiver.spans()
    finally:
        receiver.stop()
        truncate_product_tables()
    off, on = statistics.median(per_mode["off"]), statistics.median(per_mode["on"])
    step_spans = sum(1 for s in spans if s.name.startswith("step "))
    call_spans = sum(1 for s in spans if s.name.startswith("call "))
    commit_spans = sum(1 for s in spans if s.name == "checkpoint commit")
    print(
        table(
            [
                ["off", f"{off * 1000:.3f} ms", "-"],
                ["on", f"{on * 1000:.3f} ms", f"{on / off:.2f}x"],
            ],
            ["tracing", "per step (median of rounds)", "vs off"],
        )
    )
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
        "per step through Celery, tracing on / off",
        f"{on * 1000:.3f} / {off * 1000:.3f} ms = {on / off:.2f}x",
        "<= 1.10x",
        on / off <= 1.10,
    )
    dropped = expected_steps - min(step_spans, call_spans, commit_spans)
    b.add(
        "tracing",
        "step, call and commit spans received for traced steps",
        f"{step_spans} / {call_spans} / {commit_spans} of {expected_steps}",
        "none dropped",
        dropped <= 0,
    )
