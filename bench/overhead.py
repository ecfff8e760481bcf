"""Overhead per step: the engine's step loop minus the same step functions in a plain loop.

Definitions: everything the engine does per step is included
(context, serialise, diff, hash, validate, commit, snapshot policy), at the strict level
(synchronous_commit on). The floor is one INSERT + COMMIT of 1 KB on the same database,
measured in the same run, interleaved with the engine runs so that a noisy neighbour
weighs on both.

How a step is timed inside the engine: the step function records ``perf_counter()`` at
entry; consecutive differences are one step function plus one trip round the engine loop.
The plain loop's per-step median for the same function and state is subtracted.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import random
import time
from dataclasses import dataclass, field
from typing import Any

from bench import agents
from bench.common import Bench, doorbell, execute_until_done, fmt_ratio, truncate_product_tables
from bench.db import connect, flush_stats, read_wal
from bench.stats import median, ms, percentile, ratio, size, table

SIZES_KB = (1, 10, 100, 1024)
WARM_DIFFS = 10  # the first steps of an execution warm caches; not a steady state
FLOOR_BLOCK = 300


@dataclass
class Samples:
    engine: list[float] = field(default_factory=list)
    plain: list[float] = field(default_factory=list)
    state_bytes: int = 0
    steps: int = 0
    patch_bytes: list[int] = field(default_factory=list)  # each step's stored patch
    wal_syncs: int = 0
    wal_short: list[tuple[int, int]] = field(default_factory=list)  # runs with syncs < steps


class Floor:
    """One single-row INSERT of 1 KB, committed, on its own connection: the least a durable
    commit can cost on this server. Two shapes: autocommit (one round trip, the stricter
    floor, used for the ratios) and an explicit transaction (INSERT, then COMMIT)."""

    def __init__(self, url: str) -> None:
        self.auto = connect(url, autocommit=True)
        self.tx = connect(url)
        self.auto.execute(
            "CREATE TABLE IF NOT EXISTS bench_floor (id bigserial PRIMARY KEY, data text)"
        )
        # Distinct payloads, so nothing could be deduplicated or cached on the way.
        self.payloads = [agents.random_text(1024) for _ in range(64)]
        self.samples: list[float] = []
        self.tx_samples: list[float] = []

    def measure(self, count: int, keep: bool = True) -> None:
        auto, tx = [], []
        sql = "INSERT INTO bench_floor (data) VALUES (%s)"
        for i in range(count):
            payload = self.payloads[i % len(self.payloads)]
            started = time.perf_counter()
            self.auto.execute(sql, [payload])
            auto.append(time.perf_counter() - started)
            started = time.perf_counter()
            self.tx.execute(sql, [payload])
            self.tx.commit()
            tx.append(time.perf_counter() - started)
        if keep:
            self.samples += auto
            self.tx_samples += tx

    def close(self) -> None:
        self.auto.execute("DROP TABLE IF EXISTS bench_floor")
        self.auto.close()
        self.tx.close()


class PlainCtx:
    """What a plain loop gives a step in place of the engine's ``ctx``: calls run directly."""

    input: dict[str, Any] = {}

    def call(self, key: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


def plain_loop(agent_name: str, kb: int, n: int) -> list[float]:
    """The same step function, on the same kind of state, in a bare ``while`` loop."""
    from durability import END
    from durability.agents import registry

    agent = registry.get(agent_name)
    fn = agent.steps[agent.first_step]
    state = agents.ring_state({"kb": kb, "n": n})
    ctx = PlainCtx()
    agents.STAMPS.clear()
    while fn(state, ctx) != END:
        pass
    stamps = list(agents.STAMPS)
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)][WARM_DIFFS:]


def engine_loop(
    b: Bench,
    agent_name: str,
    kb: int,
    n: int,
    samples: Samples,
    durability: str | None = None,
    send_ahead: bool = True,
) -> None:
    """Start a run and execute it here; collect its per-step times and its WAL flushes."""
    from django.db import connection
    from django.test.utils import override_settings

    from durability import operations
    from durability.models import Checkpoint
    from durability.runtime import inflight

    run = operations.start(agent_name, {"kb": kb, "n": n}, by="bench", durability=durability)
    with connection.cursor() as cur:
        flush_stats(cur.execute)
    assert b.observer is not None
    before = read_wal(b.observer)
    agents.STAMPS.clear()
    with override_settings(DURABILITY_SEND_AHEAD=send_ahead):
        outcome = execute_until_done(run.id)
    stamps = list(agents.STAMPS)
    with connection.cursor() as cur:
        flush_stats(cur.execute)
    sent_ahead = inflight.channel().connection  # the session most commits went over
    if sent_ahead is not None:
        with sent_ahead.cursor() as cur:
            flush_stats(cur.execute)
    # The lease keeper's and snapshot writer's sessions publish their counters on exit.
    time.sleep(0.05)
    after = read_wal(b.observer)
    if outcome != "succeeded":
        raise RuntimeError(f"run {run.id} ended {outcome}, not succeeded")
    if len(stamps) != n:
        raise RuntimeError(f"expected {n} step starts, saw {len(stamps)} (a step ran twice?)")
    samples.engine += [b_ - a for a, b_ in zip(stamps, stamps[1:], strict=False)][WARM_DIFFS:]
    samples.steps += n
    syncs = after.wal_sync - before.wal_sync
    samples.wal_syncs += syncs
    if syncs < n and durability in (None, "strict"):  # the other levels flush less, by design
        samples.wal_short.append((syncs, n))
    samples.state_bytes = (
        Checkpoint.objects.filter(run=run).order_by("-seq").values_list("size", flat=True).first()
        or 0
    )
    samples.patch_bytes += list(
        Checkpoint.objects.filter(run=run, seq__gt=0).values_list("delta_size", flat=True)
    )


@dataclass
class Results:
    """Every loop's samples: the strict level per state size, then the other lines."""

    sizes: dict[int, Samples] = field(default_factory=lambda: {kb: Samples() for kb in SIZES_KB})
    with_call: Samples = field(default_factory=Samples)
    window: Samples = field(default_factory=Samples)
    relaxed: Samples = field(default_factory=Samples)
    periodic: Samples = field(default_factory=Samples)
    waited: Samples = field(default_factory=Samples)


LABELS = {
    "call": "10 KB + 1 ctx.call (info)",
    "window": "1 MB sliding window (info)",
    "relaxed": "10 KB, relaxed level",
    "periodic": "10 KB, periodic level (10 steps)",
    "waited": "10 KB, commits waited for",
}


def run(b: Bench) -> None:
    print("\n== Overhead per step (strict level)")
    _engine_settings(b)
    floor = Floor(b.db_url)
    r = Results()
    try:
        with doorbell(False):
            # Warm-up: connections, imports, the server's caches for these tables.
            floor.measure(200, keep=False)
            engine_loop(b, "bench-ring", 10, 100, Samples())
            _measure(b, floor, r)
            if b.profile:
                profile(b)
    finally:
        floor.close()
        truncate_product_tables()
    report(b, floor, r)


def _engine_settings(b: Bench) -> None:
    from django.db import connection

    from durability.conf import conf

    with connection.cursor() as cur:
        cur.execute("SHOW synchronous_commit")
        sync_commit = cur.fetchone()[0]
        cur.execute("SHOW fsync")
        fsync = cur.fetchone()[0]
        cur.execute("SHOW wal_sync_method")
        sync_method = cur.fetchone()[0]
    prepared = conf.PREPARED_STATEMENTS
    ahead = conf.SEND_AHEAD
    print(
        f"engine session: synchronous_commit={sync_commit}, fsync={fsync},"
        f" wal_sync_method={sync_method}; commit statement prepared: {prepared};"
        f" commits sent ahead of the next step: {ahead}"
    )
    b.add(
        "overhead",
        "synchronous_commit / fsync (engine session)",
        f"{sync_commit} / {fsync}",
        "on / on",
        sync_commit == "on" and fsync == "on",
    )


def _measure(b: Bench, floor: Floor, r: Results) -> None:
    rounds = 1 if b.quick else 3
    steps = {1: 200, 10: 200, 100: 150, 1024: 100} if b.quick else dict.fromkeys(SIZES_KB, 1000)
    rng = random.Random(b.seed)
    for n in range(rounds):
        order = list(SIZES_KB)
        rng.shuffle(order)  # no size always runs right after the same neighbour
        for kb in order:
            floor.measure(FLOOR_BLOCK)
            r.sizes[kb].plain += plain_loop("bench-ring", kb, steps[kb])
            engine_loop(b, "bench-ring", kb, steps[kb], r.sizes[kb])
            print(f"  round {n + 1}/{rounds}: {kb} KB state, {steps[kb]} steps done")
    # Informational: the same 10 KB loop with one journaled call per step.
    n_call = 100 if b.quick else 500
    floor.measure(FLOOR_BLOCK)
    r.with_call.plain += plain_loop("bench-ring-call", 10, n_call)
    engine_loop(b, "bench-ring-call", 10, n_call, r.with_call)
    # The "relaxed" level: the same 10 KB loop, not waiting for the WAL flush.
    for _ in range(rounds):
        floor.measure(FLOOR_BLOCK)
        r.relaxed.plain += plain_loop("bench-ring", 10, steps[10])
        engine_loop(b, "bench-ring", 10, steps[10], r.relaxed, durability="relaxed")
        r.periodic.plain += plain_loop("bench-ring", 10, steps[10])
        engine_loop(b, "bench-ring", 10, steps[10], r.periodic, durability="periodic")
        # Each commit waited for where it is made (DURABILITY_SEND_AHEAD off).
        r.waited.plain += plain_loop("bench-ring", 10, steps[10])
        engine_loop(b, "bench-ring", 10, steps[10], r.waited, send_ahead=False)
    # Informational: the same 1 KB change per step on a 1 MB state, as a sliding
    # window (append one message, drop the oldest) instead of a ring buffer.
    n_window = 30 if b.quick else 100
    floor.measure(FLOOR_BLOCK)
    r.window.plain += plain_loop("bench-window", 1024, n_window)
    engine_loop(b, "bench-window", 1024, n_window, r.window)


def report(b: Bench, floor: Floor, r: Results) -> None:
    f_med, f_p99 = median(floor.samples), percentile(floor.samples, 99)
    t_med, t_p99 = median(floor.tx_samples), percentile(floor.tx_samples, 99)
    print(
        f"floor, INSERT 1 KB autocommit (the ratios' base): median {ms(f_med)}, p99 {ms(f_p99)}"
        f"  ({len(floor.samples)} samples)"
    )
    print(f"floor, INSERT 1 KB + explicit COMMIT (info): median {ms(t_med)}, p99 {ms(t_p99)}")
    all_samples = [
        *((kb, r.sizes[kb]) for kb in SIZES_KB),
        ("relaxed", r.relaxed),
        ("periodic", r.periodic),
        ("waited", r.waited),
        ("call", r.with_call),
        ("window", r.window),
    ]
    figures = _table(all_samples, f_med, f_p99)
    b.add("overhead", "floor INSERT+COMMIT 1 KB, median / p99", f"{ms(f_med)} / {ms(f_p99)}")
    _size_figures(b, figures, f_med, f_p99)
    _level_figures(b, r, figures, f_med)
    _wal_figure(b, all_samples)


def _table(
    all_samples: list[tuple[Any, Samples]], f_med: float, f_p99: float
) -> dict[int, tuple[float, float]]:
    """Print one line per loop; returns the strict level's (median, p99) overhead per size."""
    rows = []
    figures: dict[int, tuple[float, float]] = {}
    for kb, s in all_samples:
        plain_med = median(s.plain)
        over_med = median(s.engine) - plain_med
        over_p99 = percentile(s.engine, 99) - plain_med
        if isinstance(kb, int):
            figures[kb] = (over_med, over_p99)
        rows.append(
            [
                f"{kb} KB" if isinstance(kb, int) else LABELS[kb],
                size(s.state_bytes),
                size(median(s.patch_bytes)),
                len(s.engine),
                ms(plain_med),
                ms(median(s.engine)),
                ms(over_med),
                fmt_ratio(ratio(over_med, f_med)),
                ms(over_p99),
                fmt_ratio(ratio(over_p99, f_p99)),
                f"{s.wal_syncs}/{s.steps}",
            ]
        )
    header = ["state", "bytes", "patch/step", "samples", "plain/step", "engine/step"]
    header += ["overhead med", "/floor med", "overhead p99", "/floor p99", "wal_sync/steps"]
    print(table(rows, header))
    return figures


def _size_figures(
    b: Bench, figures: dict[int, tuple[float, float]], f_med: float, f_p99: float
) -> None:
    for kb in SIZES_KB:
        over_med, over_p99 = figures[kb]
        r_med, r_p99 = ratio(over_med, f_med), ratio(over_p99, f_p99)
        targeted = kb <= 10
        b.add(
            "overhead",
            f"{kb} KB state: median overhead / floor median",
            f"{ms(over_med)} = {fmt_ratio(r_med)}",
            "<= 1.5x" if targeted else "(report)",
            r_med <= 1.5 if targeted else None,
        )
        b.add(
            "overhead",
            f"{kb} KB state: p99 overhead / floor p99",
            f"{ms(over_p99)} = {fmt_ratio(r_p99)}",
            "<= 3x" if targeted else "(report)",
            r_p99 <= 3.0 if targeted else None,
        )
    big_med = ratio(figures[1024][0], figures[10][0])
    big_p99 = ratio(figures[1024][1], figures[10][1])
    b.add(
        "overhead",
        "1 MB median overhead / 10 KB median overhead",
        fmt_ratio(big_med),
        "<= 2x",
        big_med <= 2.0,
    )
    b.add("overhead", "1 MB p99 overhead / 10 KB p99 overhead (info)", fmt_ratio(big_p99))


def _level_figures(
    b: Bench, r: Results, figures: dict[int, tuple[float, float]], f_med: float
) -> None:
    relaxed, periodic, waited = r.relaxed, r.periodic, r.waited
    over_relaxed = median(relaxed.engine) - median(relaxed.plain)
    b.add(
        "overhead",
        "10 KB state, relaxed level: median overhead / floor median",
        f"{ms(over_relaxed)} = {fmt_ratio(ratio(over_relaxed, f_med))}"
        f" (strict: {fmt_ratio(ratio(figures[10][0], f_med))});"
        f" WAL syncs {relaxed.wal_syncs} for {relaxed.steps} steps",
    )
    # Periodic: nine steps in ten commit nothing; the mean is the per-step cost it amortises.
    per_mean = sum(periodic.engine) / len(periodic.engine) - median(periodic.plain)
    b.add(
        "overhead",
        "10 KB state, periodic level (every 10 steps): mean overhead / floor median",
        f"{ms(per_mean)} = {fmt_ratio(ratio(per_mean, f_med))};"
        f" WAL syncs {periodic.wal_syncs} for {periodic.steps} steps",
    )
    over_waited = median(waited.engine) - median(waited.plain)
    b.add(
        "overhead",
        "10 KB state, each commit waited for (DURABILITY_SEND_AHEAD=0): median / floor median",
        f"{ms(over_waited)} = {fmt_ratio(ratio(over_waited, f_med))}"
        f" (sent ahead: {fmt_ratio(ratio(figures[10][0], f_med))})",
    )
    b.add("overhead", "replicated level", "not measured: this server has no synchronous standby")
    over_call = median(r.with_call.engine) - median(r.with_call.plain)
    b.add(
        "overhead",
        "10 KB + 1 journaled call per step (info)",
        f"{ms(over_call)} = {fmt_ratio(ratio(over_call, f_med))} floor",
    )
    over_window = median(r.window.engine) - median(r.window.plain)
    b.add(
        "overhead",
        "1 MB sliding window, 1 KB change per step (info)",
        f"{ms(over_window)} = {fmt_ratio(ratio(over_window, f_med))} floor,"
        f" patch {size(median(r.window.patch_bytes))}/step",
    )


def _wal_figure(b: Bench, all_samples: list[tuple[Any, Samples]]) -> None:
    strict_samples = [s for name, s in all_samples if name not in ("relaxed", "periodic")]
    steps = sum(s.steps for s in strict_samples)
    syncs = sum(s.wal_syncs for s in strict_samples)
    short = [x for s in strict_samples for x in s.wal_short]
    b.add(
        "overhead",
        "pg_stat_wal.wal_sync rose by >= steps, every strict run",
        f"{syncs} syncs / {steps} steps, {len(short)} runs short {short[:3]}",
        ">= 1 per step",
        not short,
    )


def profile(b: Bench) -> None:
    """Where the engine's time goes, per state size: cProfile over one more execution
    (cProfile slows pure-Python code more than C and I/O: shares, not absolute times)."""
    from durability import operations

    wanted = (
        ("durability.runtime.executor", "run"),
        ("durability.runtime.executor", "_commit"),
        ("durability.checkpoints", "commit_step"),
        ("durability.canonical", "dumps"),
        ("durability.canonical", "loads"),
        ("durability.canonical", "sha256_hex"),
        ("durability.canonical", "check_json"),
        ("durability.diff", "diff"),
        ("durability.diff", "apply"),
        ("durability.runtime.checkpointing", "redact_changes"),
        ("durability.runtime.context", "__init__"),
        ("durability.checkpoints", "link"),
        ("durability.checkpoints", "submit"),
        ("durability.agents", "validate"),
    )
    for kb, n in ((1, 400), (10, 400), (1024, 150)):
        run_ = operations.start("bench-ring", {"kb": kb, "n": n}, by="bench")
        profiler = cProfile.Profile()
        profiler.enable()
        execute_until_done(run_.id)
        profiler.disable()
        stats = pstats.Stats(profiler)
        total = max(stats.total_tt, 1e-9)  # type: ignore[attr-defined]
        print(f"\n-- profile: {kb} KB state, {n} steps, {ms(total / n)} per step under cProfile")
        rows = []
        for (path, _line, func), (_cc, ncalls, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            module = os.path.splitext(os.path.relpath(path))[0].replace(os.sep, ".")
            if (module, func) in wanted:
                rows.append([f"{module}.{func}", ncalls, ms(ct / n), f"{100 * ct / total:.1f}%"])
        rows.sort(key=lambda r: -float(r[3].rstrip("%")))
        print(table(rows, ["function (inclusive)", "calls", "per step", "share"]))
        own = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]  # type: ignore[attr-defined]
        print(
            table(
                [
                    [_where(path, line, func), ncalls, ms(tt / n), f"{100 * tt / total:.1f}%"]
                    for (path, line, func), (_cc, ncalls, tt, _ct, _callers) in own
                ],
                ["top 15 by own time", "calls", "per step", "share"],
            )
        )


def _where(path: str, line: int, func: str) -> str:
    if path == "~":
        return func  # a C function, e.g. "<method 'execute' of 'psycopg...' objects>"
    parts = path.split(os.sep)
    tail = parts[-2:] if "site-packages" not in parts else parts[parts.index("site-packages") + 1 :]
    return f"{'/'.join(tail)}:{line}({func})"
