"""PostgreSQL stopped with ``-m immediate`` (a crash, as far as the database knows) and
started again mid-run: runs resume and every checkpoint verifies. A throwaway cluster, so
the machine's own server keeps running."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from durability.testing import wait_until
from tests.conftest import Cluster
from tests.procs import ROOT, ThrowawayPostgres


@pytest.fixture(scope="module")
def pg_cluster(llm_server, effect_server, tmp_path_factory):
    pg = ThrowawayPostgres().init()
    pg.start()
    pg.psql("CREATE DATABASE durability")
    cluster = Cluster(
        "pgfault",
        tmp_path_factory.mktemp("pgfault"),
        llm_server.url,
        effect_server.url,
        database_url=pg.url("durability"),
    )
    cluster.migrate()
    cluster.pg = pg
    cluster.env["DURABILITY_REPLICATION_TIMEOUT_SECONDS"] = "1"
    cluster.worker(wait=False)
    cluster.start_beat()
    try:
        yield cluster
    finally:
        cluster.stop()
        pg.destroy()


def cli(cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "durability", *args],
        cwd=ROOT,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def show(cluster, run_id: str) -> dict | None:
    done = cli(cluster, "show", run_id, "--json")
    return json.loads(done.stdout) if done.returncode == 0 else None


def test_postgres_crash_mid_run(pg_cluster, llm):
    started = cli(pg_cluster, "start", "test-loop", "--input", '{"n": 40, "slow_ms": 60}')
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.split()[-1]
    wait_until(lambda: (show(pg_cluster, run_id) or {}).get("head", 0) >= 8, timeout=30)
    pg_cluster.pg.stop("immediate")
    time.sleep(2)
    pg_cluster.pg.start()

    def succeeded():
        data = show(pg_cluster, run_id)
        return data if data and data["status"] == "succeeded" else None

    data = wait_until(succeeded, timeout=120, interval=0.5, what="the run to succeed")
    assert data["state"]["i"] == 40
    # A call whose result was lost with the connection may be asked once more; no other.
    assert 40 <= llm.total <= 41 and max(llm.prompts.values()) <= 2
    verified = cli(pg_cluster, "verify", run_id)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def psql(cluster, sql: str) -> str:
    done = subprocess.run(
        ["psql", cluster.pg.url("durability"), "-qAtc", sql],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_a_relaxed_run_resumes_from_the_last_flushed_checkpoint(pg_cluster, llm):
    started = cli(
        pg_cluster,
        "start",
        "test-loop",
        "--durability",
        "relaxed",
        "--input",
        '{"n": 40, "slow_ms": 30, "tag": "relaxed-"}',
    )
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.split()[-1]
    wait_until(lambda: (show(pg_cluster, run_id) or {}).get("head", 0) >= 8, timeout=30)
    pg_cluster.pg.stop("immediate")  # what was not flushed yet is gone
    time.sleep(1)
    pg_cluster.pg.start()

    def succeeded():
        data = show(pg_cluster, run_id)
        return data if data and data["status"] == "succeeded" else None

    data = wait_until(succeeded, timeout=120, interval=0.5, what="the relaxed run")
    assert data["durability"] == "relaxed" and data["state"]["i"] == 40
    # Call records are written synchronously whatever the level: steps lost with unflushed
    # checkpoints ran again with their calls replayed; only a call in flight may repeat.
    assert 40 <= llm.total <= 41
    assert cli(pg_cluster, "verify", run_id).returncode == 0


def test_replicated_commits_raise_an_alarm_when_the_standby_is_gone(pg_cluster):
    worker = pg_cluster.workers[0]
    worker.stop()
    started = cli(pg_cluster, "start", "test-ticker", "--input", '{"n": 6, "slow_ms": 700}')
    run_id = started.stdout.split()[-1]
    # A start refuses "replicated" without a standby in sync; this run got it while one was.
    psql(pg_cluster, f"UPDATE durability_run SET durability = 'replicated' WHERE id = '{run_id}'")
    worker.start()
    wait_until(lambda: (show(pg_cluster, run_id) or {}).get("head", 0) >= 1, timeout=30)
    # Now the standby is gone: each commit would wait for it forever.
    psql(pg_cluster, "ALTER SYSTEM SET synchronous_standby_names = 'phantom'")
    psql(pg_cluster, "SELECT pg_reload_conf()")
    try:
        data = wait_until(
            lambda: (d := show(pg_cluster, run_id)) and d["status"] == "succeeded" and d,
            timeout=60,
            interval=0.5,
            what="the replicated run to finish despite the standby",
        )
        assert data["state"]["i"] == 6
        alarms = int(
            psql(
                pg_cluster,
                "SELECT count(*) FROM durability_event"
                f" WHERE run_id = '{run_id}' AND kind = 'alarm'",
            )
        )
        assert alarms >= 2  # the commits made after the standby went away
    finally:
        # Writes that are not checkpoints still wait for a lost standby (the database's own
        # rule): release them.
        subprocess.run(
            [
                "psql",
                pg_cluster.pg.url("durability"),
                "-qc",
                "ALTER SYSTEM RESET synchronous_standby_names",
            ],
            check=True,
        )
        subprocess.run(
            ["psql", pg_cluster.pg.url("durability"), "-qc", "SELECT pg_reload_conf()"], check=True
        )
    assert cli(pg_cluster, "verify", run_id).returncode == 0
