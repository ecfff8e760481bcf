"""Recovery time after SIGKILL of the worker's pool process or of a whole worker, and the
oversubscribed soak.

Real processes: a prefork Celery worker (Celery's default concurrency: one pool process per
CPU) and beat on Redis, with the product's default settings (30 s lease, 10 s heartbeat,
2 s sweep, 10 s requeue). A long-running agent logs each step's start (wall clock and pid)
to a file, outside the engine; the time from a kill to the next step start by another
process is the recovery time, whatever path the engine took (Celery redelivery, the
sweeper, or both).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench import procs
from bench.common import Bench, doorbell, truncate_product_tables
from bench.stats import median, percentile, table


def _executing_pid(run_id: Any, worker: Any, timeout: float = 30.0) -> int:
    """The pool process executing the run now (from its lease), not just any pool process."""
    from durability.models import Run

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        owner = Run.objects.filter(pk=run_id).values_list("lease_owner", flat=True).first()
        pool = worker.pool()
        if owner and ":" in owner:
            pid = int(owner.rsplit(":", 1)[1])
            if pid in pool:
                return pid
        time.sleep(0.01)
    raise RuntimeError("no pool process holds the run's lease")


@dataclass
class Entry:
    at: float  # wall clock, seconds
    pid: int
    i: int


class SideChannel:
    """Reads the step log as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.entries: list[Entry] = []
        self._partial = b""

    def poll(self) -> list[Entry]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        new = []
        for line in lines:
            at, pid, i = line.split()
            new.append(Entry(float(at), int(pid), int(i)))
        self.entries += new
        return new

    def wait_for(self, test: Any, timeout: float) -> Entry | None:
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            for entry in self.poll():
                if test(entry):
                    return entry
            time.sleep(0.002)
        return None


_EXITED = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): ERROR/MainProcess\] Process '[^']+'"
    r" pid:(\d+) exited"
)


def noticed_deaths(log_text: str) -> dict[int, float]:
    """When Celery's main process noticed each pool child's death (its log line, local
    time with milliseconds), by pid: splits a recovery into "Celery noticed the child was
    gone" and "the run was claimed and its step started again"."""
    found = {}
    for stamp, millis, pid in _EXITED.findall(log_text):
        at = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp() + int(millis) / 1000
        found[int(pid)] = at
    return found


def _events(run_ids: list[Any], kind: str, since: Any = None) -> list[Any]:
    from durability.models import Event

    query = Event.objects.filter(run_id__in=run_ids, kind=kind)
    if since is not None:
        query = query.filter(created_at__gte=since)
    return list(query.values_list("data", flat=True))


def _cancel(runs: list[Any]) -> None:
    """Cancel the benchmark's endless runs (fencing out their worker) before it stops."""
    from durability import operations
    from durability.errors import InvalidTransition

    for run_id in runs:
        with contextlib.suppress(InvalidTransition):
            operations.cancel(run_id, by="bench", reason="benchmark over")


def _start_tick(runs: list[Any], log: Path) -> None:
    """Start the endless run whose steps log their start (time, pid) to ``log``."""
    from durability import operations

    with doorbell(True):
        runs.append(operations.start("bench-tick", {"log": str(log), "sleep_s": 0.1}).id)


def _missed(runs: list[Any], log: Path, k: int) -> None:
    """Kill ``k`` was not followed by a step within the limit: say so, and start a new run
    if that one ended (so the next kills still measure something)."""
    from durability.models import Run, RunStatus

    status = Run.objects.get(pk=runs[-1]).status
    print(f"  kill {k + 1}: no step within 120 s (run {status})")
    if status in (RunStatus.FAILED, RunStatus.SUCCEEDED, RunStatus.CANCELLED):
        _start_tick(runs, log)


def run(b: Bench) -> None:
    print("\n== Recovery after SIGKILL of the pool process (default settings)")
    truncate_product_tables()
    kills = 10 if b.quick else 30
    rng = random.Random(b.seed)
    env = b.child_env()
    # Celery's default concurrency. With one pool process, a kill leaves no process free until
    # Celery notices the death (its pool maintenance runs on a 5 s timer), whatever the
    # sweeper finds; with the default, the sweeper's re-queue reaches the other process.
    worker = procs.Worker(
        "recovery-worker", env, b.folder, queues=[b.queue], concurrency=os.cpu_count() or 2
    ).start()
    beat = procs.Beat("recovery-beat", env, b.folder).start()
    log = b.folder / "recovery-steps.log"
    channel = SideChannel(log)
    times: list[float] = []
    kills_at: list[tuple[int, float, float]] = []  # victim, kill time, step again
    failures = 0
    runs: list[Any] = []
    try:
        _start_tick(runs, log)
        if channel.wait_for(lambda e: True, timeout=60) is None:
            raise RuntimeError(f"no step started within 60 s; see {worker.log_path}")
        for k in range(kills):
            # A random moment: inside a step, its commit, the claim, between steps...
            time.sleep(rng.uniform(0.05, 2.0))
            victim = _executing_pid(runs[-1], worker)
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            entry = channel.wait_for(lambda e, t=killed_at, v=victim: e.at > t and e.pid != v, 120)
            if entry is None:
                failures += 1
                _missed(runs, log, k)
                continue
            times.append(entry.at - killed_at)
            kills_at.append((victim, killed_at, entry.at))
            print(f"  kill {k + 1}/{kills}: step running again after {times[-1] * 1000:.0f} ms")
    finally:
        _cancel(runs)
        worker.stop()
        beat.stop()
    _report_pool(b, worker.text(), runs, times, kills_at, (kills, failures))


def _report_pool(
    b: Bench,
    worker_log: str,
    runs: list[Any],
    times: list[float],
    kills_at: list[tuple[int, float, float]],
    counts: tuple[int, int],
) -> None:
    import orjson

    kills, failures = counts
    noticed = noticed_deaths(worker_log)
    detect = [noticed[v] - k for v, k, _ in kills_at if v in noticed]
    resume = [s - noticed[v] for v, _, s in kills_at if v in noticed]
    lost = _events(runs, "lease_lost")
    recovered = [orjson.loads(d) for d in _events(runs, "recovered")]
    product_ms = [d["recovery_ms"] for d in recovered if d.get("recovery_ms") is not None]
    p50, p95 = median(times), percentile(times, 95)
    rows = [
        _line("kill -> step running again (side channel)", times),
        _line("  kill -> Celery logs the pool child's death", detect),
        _line("  death logged -> step running again", resume),
        _line("product's recovered events (last sign -> claim)", [x / 1000 for x in product_ms]),
    ]
    print(table(rows, _HEADER))
    print(f"lease_lost events (the sweeper found the process gone): {len(lost)}; runs: {len(runs)}")
    b.add(
        "recovery",
        "kills / recovered / not recovered in 120 s",
        f"{kills} / {len(times)} / {failures}",
        ">= 30 kills, all recovered",
        kills >= 30 and failures == 0 if not b.quick else failures == 0,
    )
    b.add("recovery", "recovery time p50", f"{p50:.3f} s")
    b.add("recovery", "recovery time p95", f"{p95:.3f} s", "<= 5 s", p95 <= 5.0)
    if detect:
        b.add(
            "recovery",
            "  kill -> Celery notices the dead child, p50 / p95",
            f"{median(detect):.3f} s / {percentile(detect, 95):.3f} s",
        )


def _line(name: str, values: list[float]) -> list[object]:
    return [
        name,
        len(values),
        f"{median(values):.3f} s",
        f"{percentile(values, 95):.3f} s",
        f"{max(values, default=0):.3f} s",
    ]


def run_node(b: Bench) -> None:
    """Recovery after SIGKILL of a whole worker (its main process and its pool, as when a
    node or container dies): nothing of that worker is left to notice anything, Celery's
    unacknowledged message stays invisible for the broker's visibility timeout (an hour),
    and only the sweeper, reading the database, can hand the run to the other worker."""

    print("\n== Recovery after SIGKILL of a whole worker, main process and pool (2 workers)")
    truncate_product_tables()
    kills = 5 if b.quick else 20
    rng = random.Random(b.seed + 1)
    env = b.child_env()
    generation = 0

    def new_worker() -> procs.Worker:
        nonlocal generation
        generation += 1
        return procs.Worker(f"node-{generation}", env, b.folder, queues=[b.queue]).start()

    workers = [new_worker(), new_worker()]
    beat = procs.Beat("node-beat", env, b.folder).start()
    log = b.folder / "node-steps.log"
    times: list[float] = []
    runs: list[Any] = []
    try:
        _start_tick(runs, log)
        channel = SideChannel(log)
        if channel.wait_for(lambda e: True, timeout=60) is None:
            raise RuntimeError(f"no step started within 60 s; see {workers[0].log_path}")
        failures = _kill_nodes(kills, rng, (workers, new_worker), runs, channel, times)
    finally:
        _cancel(runs)
        for w in workers:
            w.stop()
        beat.stop()
    print(table([_line("kill -> step running again on the other worker", times)], _HEADER))
    b.add(
        "recovery",
        "whole worker killed: kills / recovered / not recovered in 120 s",
        f"{kills} / {len(times)} / {failures}",
        "all recovered",
        failures == 0,
    )
    b.add(
        "recovery",
        "whole worker killed: recovery time p50 / p95",
        f"{median(times):.3f} s / {percentile(times, 95):.3f} s",
        "p95 <= 5 s",
        percentile(times, 95) <= 5.0,
    )


_HEADER = ["figure", "n", "p50", "p95", "max"]


def _kill_nodes(
    kills: int,
    rng: random.Random,
    pool: tuple[list[procs.Worker], Any],
    runs: list[Any],
    channel: SideChannel,
    times: list[float],
) -> int:
    """Kill the worker executing the run ``kills`` times, replacing it each time (``pool``:
    the workers and the function that starts one); appends each recovery time to
    ``times``, returns how many kills were not recovered."""
    workers, new_worker = pool
    failures = 0
    for k in range(kills):
        time.sleep(rng.uniform(0.05, 2.0))
        executing = _executing_pid(runs[-1], _AnyPool(workers))
        victim = next(w for w in workers if executing in w.pool())
        gone = {victim.pid, *victim.pool()}
        killed_at = time.time()
        os.killpg(victim.pid, signal.SIGKILL)
        entry = channel.wait_for(lambda e, t=killed_at, g=gone: e.at > t and e.pid not in g, 120)
        victim.stop(grace=0)  # reap it
        workers.remove(victim)
        if entry is None:
            failures += 1
            _missed(runs, channel.path, k)
        else:
            times.append(entry.at - killed_at)
            print(f"  kill {k + 1}/{kills}: step running again after {times[-1] * 1000:.0f} ms")
        workers.append(new_worker())  # back to two, for the next kill
    return failures


class _AnyPool:
    """The pool processes of several workers, as ``_executing_pid`` asks one worker's."""

    def __init__(self, workers: list[procs.Worker]) -> None:
        self.workers = workers

    def pool(self) -> list[int]:
        return [pid for w in self.workers for pid in w.pool()]


def soak(b: Bench, seconds: float) -> None:
    """No false lease expiry while the CPU is oversubscribed twice over."""
    from django.utils import timezone

    from durability import operations

    cores = os.cpu_count() or 2
    print(f"\n== Soak: {seconds:.0f} s, {2 * cores} CPU burners on {cores} cores")
    truncate_product_tables()
    env = b.child_env()
    # One pool process per run: a run's task keeps its process for a whole time slice, so
    # fewer processes would leave a run queued rather than exercise its lease.
    worker = procs.Worker("soak-worker", env, b.folder, queues=[b.queue], concurrency=3).start()
    beat = procs.Beat("soak-beat", env, b.folder).start()
    burners: list[procs.Proc] = []
    runs: list[Any] = []
    since = timezone.now()
    margins: list[float] = []
    try:
        with doorbell(True):
            # Two runs busy on the CPU, and one whose steps block longer than the lease TTL
            # (an LLM call in flight): only heartbeats keep that one's lease alive.
            runs.append(operations.start("bench-tick", {"spin_s": 0.05}).id)
            runs.append(operations.start("bench-tick", {"spin_s": 0.05}).id)
            runs.append(operations.start("bench-tick", {"sleep_s": 40}).id)
        burners = procs.burners(2 * cores, b.child_env(), b.folder)
        margins = _lease_margins(runs, seconds)
    finally:
        for p in burners:
            p.stop(grace=0)
        _cancel(runs)
        worker.stop()
        beat.stop()
    _report_soak(b, runs, since, margins, seconds)
    truncate_product_tables()


def _lease_margins(runs: list[Any], seconds: float) -> list[float]:
    """Every second for ``seconds``: how long the nearest lease of the runs still has."""
    from django.db import connection

    margins: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT extract(epoch FROM min(lease_expires_at - now()))"
                " FROM durability_run WHERE id = ANY(%s) AND status = 'running'",
                [runs],
            )
            margin = cur.fetchone()[0]
        if margin is not None:
            margins.append(float(margin))
        time.sleep(1.0)
    return margins


def _report_soak(
    b: Bench, runs: list[Any], since: datetime, margins: list[float], seconds: float
) -> None:
    from durability.models import Run

    lost = _events(runs, "lease_lost", since)
    recovered = _events(runs, "recovered", since)
    heads = dict(Run.objects.filter(pk__in=runs).values_list("id", "head_seq"))
    steps = [heads[r] for r in runs]
    print(
        f"steps committed (spin, spin, 40 s call): {steps}; lease_lost events: {len(lost)};"
        f" recovered events: {len(recovered)}; smallest lease margin seen:"
        f" {min(margins, default=float('nan')):.1f} s of 30 s"
    )
    b.add(
        "soak",
        f"lease_lost events, {seconds:.0f} s at 2x CPU oversubscription",
        str(len(lost)),
        "0",
        len(lost) == 0 and len(recovered) == 0,
    )
    b.add(
        "soak",
        "smallest lease margin seen (lease 30 s, heartbeat 10 s)",
        f"{min(margins, default=float('nan')):.1f} s",
    )
