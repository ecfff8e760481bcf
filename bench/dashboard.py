"""The dashboard's performance: ``python -m bench.dashboard [--runs N] ...``.

1. Seeds a database of its own with ``--runs`` runs (default 100,000) and about
   ``--checkpoints`` checkpoints (default 1,000,000), checkpoints per run Zipf-distributed;
   the ``--big`` largest runs append 1 KB messages per step, so they reach 1,000+
   checkpoints and ~1 MB states. Rows are written with COPY, hashes and chain hashes are real
   (pages verify every state they show), snapshots follow the engine's policy. Then VACUUM
   and ANALYZE.
2. Times the structural diff of two ~1 MB states that differ in 1,000 paths (messages
   inserted at the front, appended, edited) against parsing both states' JSON.
3. Serves the app with gunicorn on 127.0.0.1 (no cache anywhere) and times at least
   ``--requests`` random requests per page kind through the full HTTP stack, signed in:
   the runs list (filters, text search, id prefixes, later pages), a run's page (the
   largest runs included) and the diff page of the two 1 MB states.

Prints p50/p95/p99 and each against its target (p95 under 150 ms; diff at most 5x parsing).
The database (``durability_dash_bench``, or ``BENCH_DASHBOARD_DATABASE_URL``) is created and
dropped here unless ``--keep-db``; ``--reuse-db`` skips seeding a database kept before.
"""

from __future__ import annotations

import argparse
import http.client
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from bench.common import module_part
from bench.dashboard_seed import STATUSES, WORDS, analyze, check_seeded, seed
from bench.db import check_bench_database, connect, db_name, with_db
from bench.stats import percentile, table

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/durability_dash_bench"
TARGET_MS = 150.0
DIFF_RATIO = 5.0
PASSWORD = "bench-password-not-secret"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__)
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--checkpoints", type=int, default=1_000_000)
    parser.add_argument("--big", type=int, default=3, help="runs with ~1 MB states")
    parser.add_argument("--big-checkpoints", type=int, default=1_000)
    parser.add_argument("--requests", type=int, default=200, help="per page kind")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep-db", action="store_true")
    parser.add_argument("--reuse-db", action="store_true", help="use a kept, seeded database")
    return parser.parse_args(argv)


# --- the database -------------------------------------------------------------------------------


def setup_django(db_url: str) -> None:
    os.environ.update(
        DJANGO_SETTINGS_MODULE="bench.settings",
        DATABASE_URL=db_url,
        DURABILITY_AGENT_MODULES="examples.agents",
        LOG_LEVEL="WARNING",
        CONN_MAX_AGE="0",
    )
    import django

    django.setup()


def create_database(db_url: str) -> None:
    name = db_name(db_url)
    check_bench_database(name)
    with connect(with_db(db_url, "postgres"), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')


def drop_database(db_url: str) -> None:
    name = db_name(db_url)
    check_bench_database(name)
    with connect(with_db(db_url, "postgres"), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- the diff against parsing -------------------------------------------------------------------


def time_diff(diff_run: str, samples: int = 25) -> list[list[Any]]:
    import orjson

    from dashboard import diffview
    from durability.models import Snapshot

    texts = list(
        Snapshot.objects.filter(checkpoint__run_id=diff_run)
        .order_by("checkpoint__seq")
        .values_list("state", flat=True)
    )
    parse_t, diff_t = [], []
    result = None
    for _ in range(samples):
        t0 = time.perf_counter()
        old, new = orjson.loads(texts[0]), orjson.loads(texts[1])
        t1 = time.perf_counter()
        result = diffview.compare(old, new)
        t2 = time.perf_counter()
        parse_t.append(t1 - t0)
        diff_t.append(t2 - t1)
    assert result is not None
    ratio = percentile(diff_t, 50) / percentile(parse_t, 50)
    print(
        f"\n== Structural diff of two states ({len(texts[0]) / 1e6:.2f} MB,"
        f" {len(texts[1]) / 1e6:.2f} MB): {len(result.changes)} changes"
        f" (+{result.added} -{result.removed} ~{result.changed})"
    )
    print(
        table(
            [
                ["parse both (orjson)", f"{percentile(parse_t, 50) * 1000:.2f} ms"],
                ["diff (dashboard.diffview)", f"{percentile(diff_t, 50) * 1000:.2f} ms"],
            ],
            ["median of " + str(samples), "time"],
        )
    )
    ok = ratio <= DIFF_RATIO and len(result.changes) == 1000
    return [["diff / parse both", f"{ratio:.2f}x", f"<= {DIFF_RATIO:g}x", "ok" if ok else "MISS"]]


# --- through HTTP -------------------------------------------------------------------------------


class Client:
    """One keep-alive connection with a session cookie: one user clicking around."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.cookies: dict[str, str] = {}

    def request(self, method: str, path: str, body: str | None = None, **headers: str):
        headers = {k.replace("_", "-"): v for k, v in headers.items()}
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        if body is not None:
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        self.conn.request(method, path, body=body, headers=headers)
        response = self.conn.getresponse()
        data = response.read()
        for value in response.headers.get_all("Set-Cookie") or []:
            name, _, rest = value.partition("=")
            self.cookies[name] = rest.split(";", 1)[0]
        return response.status, data.decode(errors="replace"), response

    def sign_in(self, username: str) -> None:
        _, html, _ = self.request("GET", "/accounts/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html).group(1)
        body = urlencode({"username": username, "password": PASSWORD, "csrfmiddlewaretoken": token})
        status, _, _ = self.request(
            "POST", "/accounts/login/", body, Referer=f"http://127.0.0.1:{self.port}/"
        )
        if status != 302:
            raise RuntimeError(f"sign-in failed ({status})")

    def timed(self, path: str) -> float:
        t0 = time.perf_counter()
        status, html, _ = self.request("GET", path)
        elapsed = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"GET {path}: {status}\n{html[:2000]}")
        return elapsed


def serve(port: int, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABILITY_")}
    env.update(DJANGO_SETTINGS_MODULE="bench.settings", DEBUG="0", PYTHONUNBUFFERED="1")
    env["DURABILITY_VAR_DIR"] = tempfile.mkdtemp(prefix="dash-bench-var-")
    env["DURABILITY_AGENT_MODULES"] = "examples.agents"
    Path(env["DURABILITY_VAR_DIR"], "static").mkdir()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "config.wsgi",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            "2",
            "--threads",
            "2",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up:
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).request("GET", "/")
            return process
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"gunicorn did not start; see {log}")


def list_paths(
    client: Client, rnd: random.Random, runs: list[str], n: int
) -> list[tuple[str, str]]:
    """The runs list as people use it: filters, searches, later pages."""
    cursors = []
    path = "/"
    for _ in range(6):
        _, html, _ = client.request("GET", path)
        found = re.search(r'href="/\?cursor=([^"&]+)"', html)
        if not found:
            break
        cursors.append(found.group(1))
        path = f"/?cursor={found.group(1)}"
    kinds = [
        ("all", lambda: "/"),
        ("status", lambda: "/?" + urlencode({"status": rnd.choice([s for s, _ in STATUSES])})),
        ("agent", lambda: "/?" + urlencode({"agent": rnd.choice(["research", "support"])})),
        ("since", lambda: "/?" + urlencode({"since": rnd.choice(["1h", "24h", "7d"])})),
        ("text search", lambda: "/?" + urlencode({"q": " ".join(rnd.sample(WORDS, 2))})),
        ("id prefix", lambda: "/?" + urlencode({"q": rnd.choice(runs)[:6]})),
        (
            "combined",
            lambda: "/?" + urlencode({"status": "succeeded", "agent": "research", "since": "7d"}),
        ),
    ]
    if cursors:
        kinds.append(("later page", lambda: f"/?cursor={rnd.choice(cursors)}"))
    return [(kind, make()) for kind, make in (rnd.choice(kinds) for _ in range(n))]


def run_paths(rnd: random.Random, runs: list[str], largest: list[str], n: int):
    paths = []
    for i in range(n):
        if i % 5 == 0:
            run = largest[i // 5 % len(largest)]
            paths.append(("largest run", f"/runs/{run}/"))
        else:
            paths.append(("any run", f"/runs/{rnd.choice(runs)}/"))
    return paths


def measure(client: Client, paths: list[tuple[str, str]]) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = defaultdict(list)
    for kind, path in paths:
        timings[kind].append(client.timed(path))
    return timings


def summarize(label: str, timings: dict[str, list[float]]) -> list[list[Any]]:
    everything = [t for values in timings.values() for t in values]
    rows = []
    for kind, values in sorted(timings.items()):
        rows.append([f"  {kind}", len(values), *_pcts(values), ""])
    p95 = percentile(everything, 95) * 1000
    rows.insert(
        0,
        [label, len(everything), *_pcts(everything), f"{p95 / TARGET_MS:.2f}x of 150 ms"],
    )
    return rows


def _pcts(values: list[float]) -> list[str]:
    return [f"{percentile(values, q) * 1000:.1f}" for q in (50, 95, 99)] + [
        f"{max(values) * 1000:.1f}"
    ]


def run(bench: Any) -> None:
    """The ``dashboard`` part of ``make bench`` (``bench.checkpoint``)."""
    module_part(bench, "dashboard", "bench.dashboard")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    db_url = os.environ.get("BENCH_DASHBOARD_DATABASE_URL", DEFAULT_URL)
    check_bench_database(db_name(db_url))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.reuse_db:
        create_database(db_url)
    setup_django(db_url)
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    server = None
    try:
        call_command("migrate", verbosity=0)
        facts = _seeded(args)
        users = get_user_model()
        if not users.objects.filter(username="bench").exists():
            users.objects.create_superuser("bench", "", PASSWORD)
        from django.db import connection

        _describe_database()
        check_seeded(facts)
        summary = time_diff(facts["diff_run"])
        connection.close()

        port = _free_port()
        log = Path(tempfile.mkdtemp(prefix="dash-bench-")) / "gunicorn.log"
        server = serve(port, log)
        summary += _through_http(Client(port), args, facts, log)
        print("\n== Summary")
        print(table(summary, ["figure", "measured", "target", ""]))
        return 0 if all(row[3] == "ok" for row in summary) else 1
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        if not args.keep_db:
            from django.db import connections

            connections.close_all()
            drop_database(db_url)


def _seeded(args: argparse.Namespace) -> dict[str, Any]:
    """Seed the database, or find what a kept one holds (--reuse-db)."""
    if not args.reuse_db:
        print(f"seeding {args.runs:,} runs, ~{args.checkpoints:,} checkpoints ...")
        facts = seed(args)
        analyze()
        return facts
    from durability.models import Run

    runs = [str(r) for r in Run.objects.values_list("id", flat=True)]
    largest = [
        str(r)
        for r in Run.objects.exclude(input='{"question":"diff"}')
        .order_by("-head_seq")
        .values_list("id", flat=True)[: args.big]
    ]
    diff_run = str(Run.objects.get(input='{"question":"diff"}').id)
    return {"runs": runs, "largest": largest, "diff_run": diff_run}


def _describe_database() -> None:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*), (SELECT count(*) FROM durability_checkpoint),"
            " (SELECT max(head_seq) + 1 FROM durability_run),"
            " (SELECT max(size) FROM durability_checkpoint) FROM durability_run"
        )
        n_runs, n_cps, most, biggest = cur.fetchone()
    print(
        f"database: {n_runs:,} runs, {n_cps:,} checkpoints; the largest run has {most:,}"
        f" checkpoints; the largest state is {biggest / 1e6:.2f} MB"
    )


def _through_http(
    client: Client, args: argparse.Namespace, facts: dict[str, Any], log: Path
) -> list[list[Any]]:
    """Time the pages through gunicorn; print them, return their summary lines."""
    client.sign_in("bench")
    rnd = random.Random(args.seed)
    warm = list_paths(client, rnd, facts["runs"], 20) + run_paths(
        rnd, facts["runs"], facts["largest"], 20
    )
    measure(client, warm)
    n = args.requests
    lists = measure(client, list_paths(client, rnd, facts["runs"], n))
    pages = measure(client, run_paths(rnd, facts["runs"], facts["largest"], n))
    diff_path = f"/runs/{facts['diff_run']}/diff/?a=0&b=1"
    diffs = measure(client, [("1 MB / 1,000 changes", diff_path)] * max(n, 200))
    rows = summarize("runs list", lists) + summarize("run page", pages)
    rows += summarize("diff page", diffs)
    print(f"\n== Through HTTP (gunicorn, one client, keep-alive, signed in; log {log})")
    print(table(rows, ["page", "n", "p50 ms", "p95 ms", "p99 ms", "max ms", "p95 vs target"]))
    summary = []
    for label, timings in (("runs list", lists), ("run page", pages), ("diff page", diffs)):
        everything = [t for values in timings.values() for t in values]
        p95 = percentile(everything, 95) * 1000
        summary.append(
            [f"{label} p95", f"{p95:.1f} ms", "< 150 ms", "ok" if p95 < TARGET_MS else "MISS"]
        )
    return summary


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
