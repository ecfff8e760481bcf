"""Redis is only the doorbell: flushed or restarted mid-run, it loses messages, and the
sweeper (which reads PostgreSQL) rings again for every run left unclaimed."""

from __future__ import annotations

import subprocess
import time

import pytest
from celery import Celery

from durability import dispatch, operations
from durability.models import Run, RunStatus
from durability.testing import wait_until
from tests.conftest import Cluster
from tests.procs import ThrowawayRedis

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def redis_cluster(django_db_setup, django_db_blocker, llm_server, effect_server, tmp_path_factory):
    redis = ThrowawayRedis().start()
    with django_db_blocker.unblock():
        cluster = Cluster(
            "broker",
            tmp_path_factory.mktemp("broker"),
            llm_server.url,
            effect_server.url,
            broker_url=redis.url,
        )
    cluster.redis = redis
    cluster.worker(wait=False)
    cluster.start_beat()
    # This process rings the doorbell on the throwaway Redis too. Celery prefers the
    # CELERY_BROKER_URL environment variable (the machine's Redis, in this process) to any
    # configured broker, so the connection is named explicitly.
    app = Celery("ring")
    ring = app.connection_for_write(redis.url)

    def publish(run_id: str, delay: float | None) -> None:
        app.send_task(
            "durability.execute_run",
            args=[run_id],
            queue=cluster.queue,
            countdown=delay if delay and delay <= 60 else None,
            retry_policy={"max_retries": 1, "interval_start": 0},
            connection=ring,
        )

    dispatch.set_dispatcher(publish)
    try:
        yield cluster
    finally:
        from workers.dispatcher import publish as default

        dispatch.set_dispatcher(default)
        ring.release()
        cluster.stop()
        redis.stop()


def redis_cli(redis: ThrowawayRedis, *args: str) -> str:
    return subprocess.run(
        ["redis-cli", "-p", str(redis.port), *args], capture_output=True, text=True, timeout=10
    ).stdout


def start_runs(n: int, tag: str) -> list:
    return [
        operations.start("test-loop", {"n": 6, "slow_ms": 120, "tag": f"{tag}{k}-"}).id
        for k in range(n)
    ]


def all_succeed(run_ids, timeout=60.0):
    def done():
        return all(Run.objects.get(pk=r).status == RunStatus.SUCCEEDED for r in run_ids)

    wait_until(done, timeout=timeout, what="every run to succeed")


def test_redis_flushed_mid_run(redis_cluster, llm):
    runs = start_runs(4, "flush")
    wait_until(lambda: Run.objects.filter(status=RunStatus.RUNNING).exists(), timeout=20)
    queues = redis_cli(redis_cluster.redis, "keys", f"{redis_cluster.queue}*").split()
    waiting = sum(int(redis_cli(redis_cluster.redis, "llen", q).strip() or 0) for q in queues)
    assert waiting >= 1  # messages for the runs not started yet, which the flush loses
    redis_cli(redis_cluster.redis, "flushall")
    all_succeed(runs)
    assert llm.total == 24 and set(llm.prompts.values()) == {1}


def test_redis_restarted_mid_run(redis_cluster, llm):
    runs = start_runs(3, "restart")
    wait_until(lambda: Run.objects.filter(status=RunStatus.RUNNING).exists(), timeout=20)
    redis = redis_cluster.redis
    redis.kill()  # no persistence: every queued message is gone
    time.sleep(1.0)
    redis.start()
    all_succeed(runs, timeout=90)
    assert llm.total == 18 and set(llm.prompts.values()) == {1}


def test_a_broker_that_hangs_does_not_hold_an_operator(tmp_path, redis_cluster):
    """A Redis that accepts connections and never answers: starting a run still returns
    (the run is queued in PostgreSQL, its doorbell left to the sweeper) instead of hanging
    in kombu's and redis-py's retries. The module's sweeper, on a broker that works, then
    rings it and it runs."""
    import os
    import socket
    import sys

    from tests.conftest import test_database_url
    from tests.procs import ROOT

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)  # connections complete in the kernel; nothing ever reads or answers
    try:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DATABASE_URL": test_database_url(),
            "CELERY_BROKER_URL": f"redis://127.0.0.1:{hung.getsockname()[1]}/0",
            "DURABILITY_RING_TIMEOUT_SECONDS": "1",
        }
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "manage.py", "durability", "start", "test-ticker", "--input", "{}"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        took = time.monotonic() - started
    finally:
        hung.close()
    assert done.returncode == 0, done.stderr
    assert "the broker did not take the message within 1 s" in done.stderr
    assert took < 30  # the ring's own limit and the process's start-up, not minutes
    run = Run.objects.get()  # in PostgreSQL, though no broker ever took its message
    all_succeed([run.id])
