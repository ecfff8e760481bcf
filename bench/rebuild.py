"""Rebuild, cold: the state of the latest and of a random older checkpoint of a run with a
1 MB state and 1,000 checkpoints, each measurement in a fresh process (``bench.probe``),
against fetching and parsing the same state stored whole in one row. Also the listing of
the run's 1,000 checkpoints without states."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from typing import Any

from bench.common import Bench, doorbell, execute_until_done, fmt_ratio, truncate_product_tables
from bench.procs import ROOT
from bench.stats import median, ms, percentile, ratio, size, table


def probe(b: Bench, op: str, arg: object) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.probe", op, str(arg)],
        env=b.child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"probe {op} {arg} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(b: Bench) -> None:
    from django.db import connection

    print("\n== Rebuild, cold (1 MB state, 1,000 checkpoints)")
    truncate_product_tables()
    run_id, ids, state_bytes = _build()
    with connection.cursor() as cur:
        cur.execute("DROP TABLE IF EXISTS bench_whole")
        cur.execute("CREATE TABLE bench_whole (id integer PRIMARY KEY, state text NOT NULL)")
        cur.execute("INSERT INTO bench_whole VALUES (1, %s)", [state_bytes.decode()])
    repeats = 5 if b.quick else 15
    rng = random.Random(b.seed)
    results = _measure(b, rng, ids, run_id, repeats)
    _report(b, results, state_bytes, repeats)
    if b.profile:
        profile_rebuild(ids[rng.randint(1, max(ids) - 1)])
    with connection.cursor() as cur:
        cur.execute("DROP TABLE IF EXISTS bench_whole")
    truncate_product_tables()


def _build() -> tuple[Any, dict[int, int], bytes]:
    """The run measured: (its id, checkpoint id per seq, its latest state's bytes)."""
    from durability import canonical, checkpoints, operations
    from durability.models import Checkpoint

    with doorbell(False):
        # 999 steps after the start checkpoint: 1,000 checkpoints in all.
        run_ = operations.start("bench-ring", {"kb": 1024, "n": 999}, by="bench")
        outcome = execute_until_done(run_.id)
    if outcome != "succeeded":
        raise RuntimeError(f"building the run ended {outcome}")
    ids = dict(Checkpoint.objects.filter(run=run_).values_list("seq", "id"))
    print(f"run {run_.id}: {len(ids)} checkpoints, snapshots at seq", end=" ")
    print(
        sorted(
            Checkpoint.objects.filter(run=run_, snapshot__isnull=False).values_list(
                "seq", flat=True
            )
        )
    )
    latest = checkpoints.rebuild(ids[max(ids)])
    return run_.id, ids, canonical.dumps(latest.state)


def _measure(
    b: Bench, rng: random.Random, ids: dict[int, int], run_id: Any, repeats: int
) -> dict[str, list[dict]]:
    latest_seq = max(ids)
    results: dict[str, list[dict]] = {"latest": [], "older": [], "whole": [], "list": []}
    for r in range(repeats):
        jobs = [
            ("latest", "rebuild", ids[latest_seq]),
            ("older", "rebuild", ids[rng.randint(1, latest_seq - 1)]),
            ("whole", "whole", 1),
            ("list", "list", run_id),
        ]
        rng.shuffle(jobs)  # no measurement always runs first, after the others, etc.
        for name, op, arg in jobs:
            results[name].append(probe(b, op, arg))
        print(f"  repeat {r + 1}/{repeats} done")
    return results


def _report(b: Bench, results: dict[str, list[dict]], state_bytes: bytes, repeats: int) -> None:
    whole_med = median([x["cold_s"] for x in results["whole"]])
    rows = []
    for name in ("latest", "older", "whole", "list"):
        cold = [x["cold_s"] for x in results[name]]
        warm = [x["warm_s"] for x in results[name]]
        read = [x.get("bytes_read", 0) for x in results[name]]
        rows.append(
            [
                name,
                ms(median(cold)),
                ms(percentile(cold, 90)),
                ms(median(warm)),
                size(max(read)) if any(read) else "-",
                fmt_ratio(ratio(median(cold), whole_med)) if name != "list" else "-",
            ]
        )
    print(f"state: {size(len(state_bytes))}; {repeats} cold processes per line")
    print(
        table(rows, ["what", "cold median", "cold p90", "warm median", "max bytes read", "/whole"])
    )
    older_reads = [x["bytes_read"] / len(state_bytes) for x in results["older"]]
    latest_read = results["latest"][0]["bytes_read"] / len(state_bytes)
    print(
        f"bytes read / state: latest {latest_read:.2f}x; older checkpoints median"
        f" {median(older_reads):.2f}x, max {max(older_reads):.2f}x"
    )
    worst_read = max([latest_read, *older_reads])
    b.add(
        "rebuild",
        "bytes read / state size (worst of latest and older)",
        f"{worst_read:.2f}x",
        "< 2x",
        worst_read < 2.0,
    )
    b.add("rebuild", "whole-row fetch + orjson parse, cold median", ms(whole_med))
    _rebuild_figures(b, results, whole_med)


def _rebuild_figures(b: Bench, results: dict[str, list[dict]], whole_med: float) -> None:
    for name in ("latest", "older"):
        cold = median([x["cold_s"] for x in results[name]])
        b.add(
            "rebuild",
            f"rebuild {name}, cold median",
            ms(cold),
            "<= 20 ms",
            cold <= 0.020,
        )
        rel = ratio(cold, whole_med)
        b.add(
            "rebuild",
            f"rebuild {name} / whole-row fetch",
            fmt_ratio(rel),
            "<= 3x",
            rel <= 3.0,
        )
    listing = median([x["cold_s"] for x in results["list"]])
    b.add(
        "rebuild",
        "list 1,000 checkpoints (no state), cold median",
        ms(listing),
        "<= 10 ms",
        listing <= 0.010,
    )
    b.add(
        "rebuild",
        "list 1,000 checkpoints, warm median (info)",
        ms(median([x["warm_s"] for x in results["list"]])),
    )


def profile_rebuild(checkpoint_id: int) -> None:
    """Where a rebuild's time goes (warm, in this process)."""
    import cProfile
    import io
    import pstats

    from durability import checkpoints

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        checkpoints.rebuild(checkpoint_id)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(15)
    print("\n-- profile: rebuild of an older checkpoint, 5 times, by inclusive time")
    print(out.getvalue())
