"""The JSON API's performance: ``python -m bench.api [--runs N] ...``.

Seeds the same database as ``bench.dashboard`` (``--runs`` runs, about ``--checkpoints``
checkpoints, the ``--big`` largest with ~1 MB states, and a run whose two checkpoints are
~1 MB states 1,000 paths apart), serves the app with gunicorn on 127.0.0.1 and times at
least ``--requests`` requests per kind through the full HTTP stack with personal API tokens
(authentication and the rate limit's UPDATE included in every request):

- the runs list (filters, text search, id prefixes, later pages);
- one run (the largest included);
- a state of ~1 MB;
- the diff of two ~1 MB states.

Prints p50/p95/p99/max against the targets (p95: 50 ms, 50 ms, 50 ms, 150 ms). The database
is created and dropped here unless ``--keep-db``; ``--reuse-db`` skips seeding.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from bench import dashboard as seeded
from bench.common import module_part
from bench.db import check_bench_database, db_name
from bench.stats import percentile, table

TARGETS_MS = {"runs list": 50.0, "one run": 50.0, "state of 1 MB": 50.0, "diff of 1 MB": 150.0}
# Tokens the requests rotate through: each stays under the default rate limit (600 a
# minute), so the figures include the limit's bookkeeping without being refused by it.
TOKENS = 12
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/durability_api_bench"


class ApiClient:
    """One keep-alive connection, a token per request in turn."""

    def __init__(self, port: int, secrets: list[str]) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.secrets = secrets
        self.turn = 0

    def get(self, path: str) -> tuple[int, bytes]:
        self.turn += 1
        secret = self.secrets[self.turn % len(self.secrets)]
        self.conn.request("GET", path, headers={"Authorization": f"Bearer {secret}"})
        response = self.conn.getresponse()
        return response.status, response.read()

    def timed(self, path: str) -> float:
        t0 = time.perf_counter()
        status, body = self.get(path)
        elapsed = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"GET {path}: {status}\n{body[:2000]!r}")
        return elapsed


def list_paths(client: ApiClient, rnd: random.Random, runs: list[str], n: int):
    cursors = []
    path = "/api/v1/runs"
    for _ in range(6):
        _, body = client.get(path)
        cursor = json.loads(body).get("next_cursor")
        if not cursor:
            break
        cursors.append(cursor)
        path = "/api/v1/runs?" + urlencode({"cursor": cursor})
    q = "/api/v1/runs?"
    kinds = [
        ("all", lambda: "/api/v1/runs"),
        ("status", lambda: q + urlencode({"status": rnd.choice([s for s, _ in seeded.STATUSES])})),
        ("agent", lambda: q + urlencode({"agent": rnd.choice(["research", "support"])})),
        ("text search", lambda: q + urlencode({"q": " ".join(rnd.sample(seeded.WORDS, 2))})),
        ("id prefix", lambda: q + urlencode({"q": rnd.choice(runs)[:6]})),
        ("combined", lambda: q + urlencode({"status": "succeeded", "agent": "research"})),
    ]
    if cursors:
        kinds.append(("later page", lambda: q + urlencode({"cursor": rnd.choice(cursors)})))
    return [(kind, make()) for kind, make in (rnd.choice(kinds) for _ in range(n))]


def run_paths(rnd: random.Random, runs: list[str], largest: list[str], n: int):
    paths = []
    for i in range(n):
        run = largest[i // 5 % len(largest)] if i % 5 == 0 else rnd.choice(runs)
        paths.append(("largest run" if i % 5 == 0 else "any run", f"/api/v1/runs/{run}"))
    return paths


def measure(client: ApiClient, paths: list[tuple[str, str]]) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = defaultdict(list)
    for kind, path in paths:
        timings[kind].append(client.timed(path))
    return timings


def _pcts(values: list[float]) -> list[str]:
    return [f"{percentile(values, q) * 1000:.1f}" for q in (50, 95, 99)] + [
        f"{max(values) * 1000:.1f}"
    ]


def report(results: dict[str, dict[str, list[float]]]) -> tuple[list[list[Any]], bool]:
    rows, summary, ok = [], [], True
    for label, timings in results.items():
        everything = [t for values in timings.values() for t in values]
        p95 = percentile(everything, 95) * 1000
        target = TARGETS_MS[label]
        rows.append([label, len(everything), *_pcts(everything), f"{p95 / target:.2f}x"])
        if len(timings) > 1:
            rows += [[f"  {k}", len(v), *_pcts(v), ""] for k, v in sorted(timings.items())]
        good = p95 < target
        ok = ok and good
        summary.append(
            [f"{label} p95", f"{p95:.1f} ms", f"< {target:g} ms", "ok" if good else "MISS"]
        )
    print("\n== JSON API through HTTP (gunicorn, one client, keep-alive, token auth)")
    print(table(rows, ["request", "n", "p50 ms", "p95 ms", "p99 ms", "max ms", "p95/target"]))
    return summary, ok


def run(bench: Any) -> None:
    """The ``api`` part of ``make bench`` (``bench.checkpoint``)."""
    module_part(bench, "api", "bench.api")


def main(argv: list[str] | None = None) -> int:
    args = seeded.parse(argv)
    db_url = os.environ.get("BENCH_API_DATABASE_URL", DEFAULT_URL)
    check_bench_database(db_name(db_url))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.reuse_db:
        seeded.create_database(db_url)
    seeded.setup_django(db_url)
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection

    server = None
    try:
        call_command("migrate", verbosity=0)
        facts = _facts(args)
        from api import tokens

        user = get_user_model().objects.filter(username="bench").first()
        if user is None:
            user = get_user_model().objects.create_superuser("bench", "", seeded.PASSWORD)
        secrets = [tokens.create(user, f"bench-{time.time_ns()}-{i}")[1] for i in range(TOKENS)]
        connection.close()

        # The server runs as deployed: the product's default of persistent database
        # connections (CONN_MAX_AGE 60 s), not the seeding process's setting of 0.
        os.environ["CONN_MAX_AGE"] = "60"
        port = seeded._free_port()
        log = Path(tempfile.mkdtemp(prefix="api-bench-")) / "gunicorn.log"
        server = seeded.serve(port, log)
        client = ApiClient(port, secrets)
        rnd = random.Random(args.seed)
        n = max(args.requests, 200)
        state = f"/api/v1/runs/{facts['diff_run']}/checkpoints/1/state"
        diff = f"/api/v1/runs/{facts['diff_run']}/diff?from=0&to=1"
        size = len(client.get(state)[1])
        warm = list_paths(client, rnd, facts["runs"], 20)
        warm += run_paths(rnd, facts["runs"], facts["largest"], 20)
        measure(client, warm + [("s", state)] * 5 + [("d", diff)] * 5)
        results = {
            "runs list": measure(client, list_paths(client, rnd, facts["runs"], n)),
            "one run": measure(client, run_paths(rnd, facts["runs"], facts["largest"], n)),
            "state of 1 MB": measure(client, [(f"{size / 1e6:.2f} MB", state)] * n),
            "diff of 1 MB": measure(client, [("1,000 changes", diff)] * n),
        }
        summary, ok = report(results)
        print("\n== Summary")
        print(table(summary, ["figure", "measured", "target", ""]))
        return 0 if ok else 1
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        if not args.keep_db:
            from django.db import connections

            connections.close_all()
            seeded.drop_database(db_url)


def _facts(args: Any) -> dict[str, Any]:
    from durability.models import Run

    if not args.reuse_db:
        print(f"seeding {args.runs:,} runs, ~{args.checkpoints:,} checkpoints ...")
        facts = seeded.seed(args)
        seeded.analyze()
        seeded.check_seeded(facts)
        return facts
    diff_input = '{"question":"diff"}'
    largest = Run.objects.exclude(input=diff_input).order_by("-head_seq")
    return {
        "runs": [str(r) for r in Run.objects.values_list("id", flat=True)],
        "largest": [str(r) for r in largest.values_list("id", flat=True)[: args.big]],
        "diff_run": str(Run.objects.get(input=diff_input).id),
    }


if __name__ == "__main__":
    sys.exit(main())
