"""Live workers are never declared dead: not by a sweep racing a fresh claim, not after a
database restart, and sweeps never wait behind run executions.

Counting is the assertion: sessions ended and runs handed away while their holder lives (in
process, against the real test PostgreSQL), and with real Celery workers against a throwaway
PostgreSQL restarted in immediate mode, LLM requests per prompt (a journaled call executed
twice), effect requests per idempotency key, effects in doubt, lease_lost events, and every
checkpoint an observer saw committed."""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta

import psycopg
import pytest
from django.db import DatabaseError, connection
from django.utils import timezone

from durability import Agent, leases, operations, recovery, registry
from durability.models import Event, EventKind, Run, RunStatus
from durability.testing import wait_until
from tests.conftest import Cluster
from tests.procs import ROOT, ThrowawayPostgres
from tests.servers import EffectReceiver, FakeLLM

pytestmark = pytest.mark.django_db(transaction=True)


# --- a sweep racing fresh claims (in process) ------------------------------------------------


def _alive(pids: list[int]) -> set[int]:
    with connection.cursor() as cur:
        cur.execute("SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", [pids])
        return {row[0] for row in cur.fetchall()}


def test_a_sweep_never_ends_nor_takes_a_run_a_worker_just_took(settings):
    """A queued run left unclaimed past the requeue interval: at that moment a free worker
    takes its message, its lock and its lease, while a sweep decides to ring it again and
    looks for stalled holders. 1,000 races: the worker is never ended, the run never given
    to another."""
    if connection.vendor != "postgresql":
        pytest.skip("session locks: PostgreSQL")
    settings.DURABILITY_REQUEUE_SECONDS = 1.0

    def step(state, ctx):
        state["done"] = True

    registry.unregister("x-race")
    Agent("x-race", steps=[step])
    width, rounds = 10, 100
    runs = [operations.start("x-race", {}).id for _ in range(width)]
    start, claimed, checked, released = (threading.Barrier(width + 1) for _ in range(4))
    taken: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        rng = random.Random(k)
        try:
            for _ in range(rounds):
                start.wait(30)
                time.sleep(rng.uniform(0, 0.012))
                keeper = leases.LeaseKeeper(runs[k], f"racer-{k}")
                try:
                    assert keeper.acquire(), "the run's lock was held by someone else"
                    claim = leases.claim(runs[k], f"racer-{k}", owner_dead=True, holder=keeper.pid)
                    assert claim is not None, "the claim failed"
                    keeper.start(claim.token)
                    taken[k] = (keeper.pid, claim.token)
                    claimed.wait(30)
                    checked.wait(30)
                    taken[k] = (*taken[k], keeper.pid, keeper.lost.is_set())
                finally:
                    keeper.stop()
                released.wait(30)
        except BaseException as exc:  # handed to the test
            errors.append(exc)
            for barrier in (start, claimed, checked, released):
                barrier.abort()
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(width)]
    for thread in threads:
        thread.start()
    ended = robbed = 0
    rng = random.Random(0)
    try:
        for _ in range(rounds):
            # Queued and unclaimed for longer than the requeue interval.
            Run.objects.filter(pk__in=runs).update(
                status=RunStatus.QUEUED,
                lease_owner="",
                lease_expires_at=None,
                rung_at=timezone.now() - timedelta(minutes=5),
            )
            start.wait(30)
            time.sleep(rng.uniform(0, 0.006))
            recovery.sweep()
            claimed.wait(30)
            # The next sweep, once an ending would have landed: a holder ended by the first
            # is "process gone" now.
            time.sleep(0.02)
            recovery.sweep()
            holders = [taken[k][0] for k in range(width)]
            alive = _alive(holders)
            ended += sum(1 for pid in holders if pid not in alive)
            rows = dict(
                Run.objects.filter(pk__in=runs, status=RunStatus.RUNNING).values_list(
                    "id", "lease_token"
                )
            )
            robbed += sum(1 for k in range(width) if rows.get(runs[k]) != taken[k][1])
            checked.wait(30)
            released.wait(30)
    except threading.BrokenBarrierError:
        pass
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert ended == 0, f"{ended} of {width * rounds} live holders had their session ended"
    assert robbed == 0, f"{robbed} of {width * rounds} runs were given away while held"
    assert not Event.objects.filter(run_id__in=runs, kind=EventKind.LEASE_LOST).exists()


def test_a_worker_takes_its_lock_back_as_soon_as_its_session_ends(settings):
    """A session ended under a live worker (as a database restart ends them all): the lock
    is taken back at once on a new session, not at the next heartbeat 30 s later, and the
    lease renewed; a run someone else holds by then is given up."""
    if connection.vendor != "postgresql":
        pytest.skip("session locks: PostgreSQL")
    settings.DURABILITY_HEARTBEAT_SECONDS = 30
    registry.unregister("x-retake")

    def step(state, ctx):
        state["done"] = True

    Agent("x-retake", steps=[step])
    run = operations.start("x-retake", {})
    keeper = leases.LeaseKeeper(run.id, "retaker")
    try:
        assert keeper.acquire()
        first = next(iter(leases.lock_holders([run.id])[str(run.id)]))
        claim = leases.claim(run.id, "retaker", owner_dead=True, holder=first)
        keeper.start(claim.token)
        with connection.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", [first])
        ended = time.monotonic()
        again = wait_until(
            lambda: (leases.lock_holders([run.id]).get(str(run.id)) or {first}) - {first},
            timeout=20,
            interval=0.01,
            what="the lock to be taken back",
        )
        assert time.monotonic() - ended < 2.0
        assert len(again) == 1 and not keeper.lost.is_set()
        # Someone else has the run now: at its next loss of session the worker gives it up.
        Run.objects.filter(pk=run.id).update(lease_token=claim.token + 1)
        with connection.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", [next(iter(again))])
        assert keeper.lost.wait(10)
    finally:
        keeper.stop()
    assert not leases.lock_holders([run.id])


def _drop_my_session() -> None:
    """The database ends this thread's session, as a restart would, while a call or an
    effect is in flight: the function still returns its result."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        pid = cur.fetchone()[0]
    db = connection.settings_dict
    with psycopg.connect(
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
        user=db["USER"] or "postgres",
        dbname=db["NAME"],
        autocommit=True,
    ) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    wait_until(lambda: pid not in _other_pids(db), timeout=10, interval=0.01)


def _other_pids(db) -> set[int]:
    with psycopg.connect(
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
        user=db["USER"] or "postgres",
        dbname=db["NAME"],
        autocommit=True,
    ) as other:
        return {row[0] for row in other.execute("SELECT pid FROM pg_stat_activity").fetchall()}


def test_a_result_in_hand_when_the_session_drops_is_recorded_not_asked_again():
    """A call and an effect whose session the database ended while they ran: their results
    are recorded once it answers again. The call is not made twice, the effect not put in
    doubt."""
    if connection.vendor != "postgresql":
        pytest.skip("session ended by the server: PostgreSQL")
    from durability.models import Effect, EffectStatus
    from durability.testing import drive

    made: Counter = Counter()

    def ask(prompt: str) -> dict:
        made[prompt] += 1
        _drop_my_session()
        return {"answer": prompt.upper()}

    def pay(amount: int, *, idempotency_key: str) -> dict:
        made[idempotency_key] += 1
        _drop_my_session()
        return {"paid": amount}

    def step(state, ctx):
        state["answer"] = ctx.call("ask", ask, "hello")
        state["receipt"] = ctx.effect("pay", pay, 5)

    registry.unregister("x-in-hand")
    Agent("x-in-hand", steps=[step])
    run = operations.start("x-in-hand", {})
    failure = None
    try:
        done = drive(run.id)
    except DatabaseError as exc:  # the result could not be recorded
        failure = exc
    finally:
        connection.close()  # whatever became of this thread's session
    assert made["hello"] == 1, (made, failure)
    assert failure is None, failure
    assert done.status == RunStatus.SUCCEEDED, (done.status, done.wait_reason)
    effect = Effect.objects.get(run=run)
    assert made[effect.idempotency_key] == 1
    assert effect.status == EffectStatus.DONE and effect.attempts == 1
    assert not Event.objects.filter(run=run, kind=EventKind.EFFECT_IN_DOUBT).exists()


# --- sweeps and busy run workers ---------------------------------------------------------------


def test_sweeps_do_not_wait_for_busy_run_workers(cluster, llm):
    """Every run slot executes a long step and more runs are queued behind it: a worker that
    died meanwhile is still recovered within a few sweeps, not after the long step."""
    if not cluster.workers:
        cluster.worker()
    if cluster.beat is None:
        cluster.start_beat()
    block = 12.0
    busy = [
        operations.start("test-loop", {"n": 1, "block_s": block, "block_at": 0, "tag": f"b{k}"})
        for k in range(3)
    ]
    wait_until(
        lambda: Run.objects.filter(pk__in=[r.id for r in busy], status=RunStatus.RUNNING).exists(),
        timeout=30,
        what="the only run slot to be busy",
    )
    # A run whose worker died: running, leased, and nobody holds its lock.
    dead = operations.start("test-loop", {"n": 1, "tag": "dead"})
    Run.objects.filter(pk=dead.id).update(
        status=RunStatus.RUNNING,
        lease_owner="ghost:1",
        lease_expires_at=timezone.now() + timedelta(minutes=5),
        heartbeat_at=timezone.now(),
        claimed_at=timezone.now() - timedelta(seconds=1),
    )
    died = time.monotonic()
    lost = Event.objects.filter(run=dead, kind=EventKind.LEASE_LOST)
    wait_until(lost.exists, timeout=3 * block, interval=0.05, what="the dead run's recovery")
    waited = time.monotonic() - died
    for run in [*busy, dead]:
        operations.cancel(run.id, by="test", reason="done")
    for worker in cluster.workers:
        worker.kill()  # rather than wait for the blocked step: nothing else runs here
    assert waited < 4.0, f"the sweep came {waited:.1f} s after the death, behind a {block} s step"


# --- PostgreSQL restarted under load (real workers) ----------------------------------------------


class SlowEffects(EffectReceiver):
    """The receiving side of an effect that takes a while to answer."""

    delay = 0.3

    def handle(self, path, headers, body):
        time.sleep(self.delay)
        return super().handle(path, headers, body)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    llm = FakeLLM().start()
    receiver = SlowEffects().start()
    pg = ThrowawayPostgres().init()
    pg.start()
    pg.psql("CREATE DATABASE durability")
    cluster = Cluster(
        "liveness-pg",
        tmp_path_factory.mktemp("liveness-pg"),
        llm.url,
        receiver.url,
        database_url=pg.url("durability"),
    )
    # Short heartbeats and sweeps (tests/settings.py), a tight margin after a restart, and a
    # lease that outlives the restarts: what is tested is the liveness lock, not the lease.
    cluster.env["DURABILITY_RECONNECT_MARGIN_SECONDS"] = "1"
    cluster.env["DURABILITY_LEASE_SECONDS"] = "15"
    cluster.migrate()
    cluster.pg, cluster.llm, cluster.receiver = pg, llm, receiver
    cluster.worker(concurrency=2, wait=False)
    cluster.worker(concurrency=2, wait=False)
    cluster.start_beat()
    try:
        yield cluster
    finally:
        for proc in [*cluster.workers, cluster.housekeeping, cluster.beat]:
            proc.kill()  # quicker than a warm shutdown; nothing is left to finish
        cluster.stop()
        pg.destroy()
        llm.stop()
        receiver.stop()


def _django(cluster, code: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-v", "0", "-c", code],
        cwd=ROOT,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


class Observer:
    """Reads every committed checkpoint, over and over, from its own session: what it saw
    once must still be there at the end."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: dict[tuple[str, int], str] = {}
        self.running = 0  # runs executing at the last look
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        conn = None
        while not self.stop.wait(0.1):
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                rows = conn.execute(
                    "SELECT run_id::text, seq, state_hash FROM durability_checkpoint"
                ).fetchall()
                for run_id, seq, state_hash in rows:
                    self.seen[(run_id, seq)] = state_hash
                self.running = conn.execute(
                    "SELECT count(*) FROM durability_run WHERE status = 'running'"
                ).fetchone()[0]
            except psycopg.Error:
                if conn is not None:
                    with contextlib.suppress(psycopg.Error):
                        conn.close()
                conn = None
        if conn is not None:
            conn.close()


def test_postgres_restarted_10_times_under_load_declares_no_live_worker_dead(restarted):
    """Ten restarts in immediate mode, each while the runs are in the middle of a step,
    alternately soon (up for less than a heartbeat and the margin, 1.5 s: the window where a
    missing lock is excused) and late (up for longer: where a lock still missing means the
    worker is dead). Each window is hit five times; twenty restarts at random uptimes hit
    the first only five times too, and the second fifteen times, for twice the time."""
    cluster, pg = restarted, restarted.pg
    cluster.llm.reset()
    cluster.llm.delay = 0.3  # a slow call, and (SlowEffects) a slow effect, in every step
    cluster.receiver.reset()
    n, runs = 50, 4  # steps of 0.6 s or more: every run outlasts the restarts
    started = _django(
        cluster,
        "from durability import operations\n"
        f"for k in range({runs}):\n"
        "    print(operations.start('test-loop', {"
        f"'n': {n}, 'effects': True, 'tag': f'r{{k}}-'"
        "}).id)\n",
    ).split()
    assert len(started) == runs
    observer = Observer(pg.url("durability"))
    observer.thread.start()
    rng = random.Random(15)
    wait_until(lambda: cluster.llm.total >= 4, timeout=60, what="the runs to be under way")
    in_flight: list[int] = []
    try:
        for k in range(10):
            time.sleep(rng.uniform(0.8, 1.4) if k % 2 == 0 else rng.uniform(1.6, 2.5))
            in_flight.append(observer.running)
            pg.stop("immediate")
            time.sleep(rng.uniform(0.05, 0.4))
            pg.start()
        seen_during = len(observer.seen)

        def settled() -> bool:
            # Finished, or waiting for a person (an effect in doubt): asserted on below.
            try:
                with psycopg.connect(pg.url("durability"), autocommit=True) as conn:
                    left = conn.execute(
                        "SELECT count(*) FROM durability_run WHERE status IN ('queued', 'running')"
                    ).fetchone()[0]
            except psycopg.Error:
                return False
            return left == 0

        with contextlib.suppress(AssertionError):  # what is left unfinished is shown below
            wait_until(settled, timeout=150, interval=0.5, what="every run to settle")
    finally:
        observer.stop.set()
        observer.thread.join(10)
    with psycopg.connect(pg.url("durability"), autocommit=True) as conn:
        statuses = Counter(
            f"{status} {reason} {detail}".strip()
            for status, reason, detail in conn.execute(
                "SELECT status, wait_reason, left(wait_detail, 80) FROM durability_run"
            ).fetchall()
        )
        events = Counter(
            row[0]
            for row in conn.execute(
                "SELECT kind || ':' || reason FROM durability_event"
                " WHERE kind IN ('lease_lost', 'recovered', 'effect_in_doubt')"
            ).fetchall()
        )
        in_doubt = conn.execute(
            "SELECT count(*) FROM durability_effect WHERE status = 'in_doubt'"
        ).fetchone()[0]
        now = {
            (run_id, seq): state_hash
            for run_id, seq, state_hash in conn.execute(
                "SELECT run_id::text, seq, state_hash FROM durability_checkpoint"
            ).fetchall()
        }
    # No process died: no owner may have been declared gone, nor any lease taken over.
    assert not events, events
    assert in_doubt == 0
    # Each journaled call executed once: one request per prompt at the LLM.
    prompts = cluster.llm.prompts
    assert sum(prompts.values()) == n * runs and max(prompts.values()) == 1, {
        p: c for p, c in prompts.items() if c > 1
    }
    # Each effect performed once: one request per idempotency key at the receiver.
    requests = cluster.receiver.requests
    assert len(requests) == n * runs and max(requests.values()) == 1, {
        k: c for k, c in requests.items() if c > 1
    }
    # Every checkpoint the observer saw committed is still there, unchanged.
    assert seen_during > 0
    lost = {key for key, digest in observer.seen.items() if now.get(key) != digest}
    assert not lost, sorted(lost)[:10]
    assert statuses == {"succeeded": runs}, statuses
    # Each restart hit runs in the middle of their steps (a slow call, a slow effect).
    assert len(in_flight) == 10 and min(in_flight) > 0, str(in_flight)
    verified = _django(
        cluster,
        "from django.core.management import call_command\n"
        + "".join(f"call_command('durability', 'verify', '{run_id}')\n" for run_id in started),
    )
    assert verified is not None
