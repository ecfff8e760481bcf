"""The rollback preview's cost: ``python -m bench.rollback_preview [--requests N]``.

Makes a run with 1,000 checkpoints and 100 effects (one every tenth step) through the engine,
in a database of its own, then serves the app with gunicorn on 127.0.0.1 and times the
rollback page through HTTP, signed in: rolled back to #1 (all 100 effects are on the branch
left behind: each is listed with its choice, the picker lists 999 checkpoints) and the
default target ("Roll back…", the last checkpoint before the last effect). Prints p50/p95
against the target: p95 under 150 ms.

The database (``durability_rollback_bench``, or ``BENCH_ROLLBACK_DATABASE_URL``) is created
and dropped here. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

from bench.dashboard import PASSWORD, Client, _free_port, create_database, drop_database, serve
from bench.db import check_bench_database, db_name
from bench.stats import percentile, table

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/durability_rollback_bench"
TARGET_MS = 150.0
CHECKPOINTS = 1_000
EFFECT_EVERY = 10


def notify(i: int, *, idempotency_key: str) -> dict:
    return {"notified": i, "key": idempotency_key}


def seed() -> str:
    """One run of 1,000 steps (so 1,000 checkpoints after the start), an effect every tenth."""
    from durability import END, Agent, operations
    from durability.testing import drive

    agent = Agent("bench-rollback", version="1", initial_state=lambda inp: {"i": 0})

    @agent.step(start=True)
    def tick(state, ctx):
        state["i"] += 1
        if state["i"] % EFFECT_EVERY == 0:
            state["last"] = ctx.effect("notify", notify, state["i"])
        return END if state["i"] >= CHECKPOINTS else "tick"

    run = operations.start("bench-rollback", {})
    done = drive(run.id, max_executions=10_000)
    if done.status != "succeeded":
        raise RuntimeError(f"seeding failed: {done.status} {done.error}")
    return str(run.id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rollback_preview", description=__doc__)
    parser.add_argument("--requests", type=int, default=200, help="per page")
    args = parser.parse_args(argv)
    db_url = os.environ.get("BENCH_ROLLBACK_DATABASE_URL", DEFAULT_URL)
    check_bench_database(db_name(db_url))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    create_database(db_url)
    os.environ.update(
        DJANGO_SETTINGS_MODULE="bench.settings",
        DATABASE_URL=db_url,
        DURABILITY_AGENT_MODULES="examples.agents",
        LOG_LEVEL="WARNING",
    )
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connections

    from durability.models import Checkpoint, Effect

    server = None
    try:
        call_command("migrate", verbosity=0)
        run_id = seed()
        cps = Checkpoint.objects.filter(run_id=run_id).count()
        effects = Effect.objects.filter(run_id=run_id).count()
        print(f"run {run_id}: {cps:,} checkpoints, {effects} effects")
        get_user_model().objects.create_superuser("bench", "", PASSWORD)
        connections.close_all()

        port = _free_port()
        log = Path(tempfile.mkdtemp(prefix="rollback-bench-")) / "gunicorn.log"
        server = serve(port, log)
        return _measure(Client(port), run_id, effects, args.requests, log)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        connections.close_all()
        drop_database(db_url)


def _measure(client: Client, run_id: str, effects: int, requests: int, log: Path) -> int:
    """Check what the preview lists, then time both pages; 0 when both meet the target."""
    client.sign_in("bench")
    pages = {
        "to #1 (100 effects, 999 choices)": f"/runs/{run_id}/rollback/?to=1",
        "default target": f"/runs/{run_id}/rollback/",
    }
    for path in pages.values():  # warm up, and check what is shown
        status, html, _ = client.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status}\n{html[:2000]}")
    _, html, _ = client.request("GET", pages["to #1 (100 effects, 999 choices)"])
    listed = html.count("cannot be undone</td>")
    if listed != effects:
        raise RuntimeError(f"the preview lists {listed} effects, not {effects}")
    rows, ok = [], True
    for label, path in pages.items():
        timings = [client.timed(path) for _ in range(requests)]
        p50, p95 = (percentile(timings, q) * 1000 for q in (50, 95))
        ok = ok and p95 < TARGET_MS
        verdict = "ok" if p95 < TARGET_MS else "MISS"
        rows.append([label, len(timings), f"{p50:.1f}", f"{p95:.1f}", f"< {TARGET_MS:g}", verdict])
    print(f"\n== Rollback preview through HTTP (gunicorn, signed in; log {log})")
    print(table(rows, ["page", "n", "p50 ms", "p95 ms", "target ms", ""]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
