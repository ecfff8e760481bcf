"""Real Celery workers (prefork, separate processes) on Redis and PostgreSQL, killed with
SIGKILL at named fault points. Counting is the assertion: LLM calls arrive at a real HTTP
server speaking the chat-completions format, effects at a receiver keeping a ledger per
idempotency key."""

from __future__ import annotations

import os
import signal
import time

import pytest

from durability import operations
from durability.models import (
    Effect,
    EffectStatus,
    Event,
    EventKind,
    JournalEntry,
    Run,
    RunStatus,
)
from durability.testing import wait_until
from tests.procs import CeleryWorker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def running(cluster):
    """Two single-process workers and a beat for the module."""
    cluster.worker(wait=False)
    cluster.worker(wait=False)
    cluster.start_beat()
    return cluster


def finished(run_id, timeout=60.0) -> Run:
    def done():
        run = Run.objects.get(pk=run_id)
        return run if run.is_finished else None

    return wait_until(done, timeout=timeout, what=f"run {run_id} to finish")


def alive_workers(cluster):
    # Started together: a worker's start-up is seconds on a loaded machine.
    dead = [worker.start(wait=False) for worker in cluster.workers if not worker.alive()]
    for worker in dead:
        worker.ready()


def assert_each_prompt_once(llm, n):
    assert llm.total == n, dict(llm.prompts)
    assert set(llm.prompts) == {f"iteration {i}" for i in range(n)}


def test_a_run_goes_through_celery(running, llm):
    run = operations.start("test-loop", {"n": 5})
    assert finished(run.id).status == RunStatus.SUCCEEDED
    assert_each_prompt_once(llm, 5)
    assert operations.verify(run.id)[0].ok


def test_sigkill_at_iteration_37_of_50_makes_exactly_50_llm_calls(running, llm, cluster_faults):
    # Killed inside the checkpoint transaction of iteration 37: its LLM call was already
    # journaled, so the re-run replays it instead of paying for it again.
    cluster_faults.set({"point": "in_commit", "when": {"seq": 38}, "action": "kill"})
    run = operations.start("test-loop", {"n": 50})
    done = finished(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert cluster_faults.fired() == 1
    assert_each_prompt_once(llm, 50)
    recovered = Event.objects.filter(run=run, kind=EventKind.RECOVERED)
    assert recovered.count() == 1
    assert operations.verify(run.id)[0].ok
    alive_workers(running)


KILL_POINTS = [
    # (fault point, filter, LLM calls expected beyond one per iteration)
    ("before_call", {"key": "llm", "seq": 3}, 0),
    ("after_call", {"key": "llm", "seq": 3}, 1),  # the one call that had no record yet
    ("in_commit", {"seq": 4}, 0),
    ("after_commit", {"seq": 4}, 0),
    ("before_ack", {}, 0),
]


@pytest.mark.parametrize("action", ["kill", "kill-worker"])
@pytest.mark.parametrize("point, when, extra", KILL_POINTS)
def test_every_run_finishes_after_sigkill_and_nothing_runs_twice(
    running, llm, effects, cluster_faults, point, when, extra, action
):
    cluster_faults.set({"point": point, "when": when, "action": action})
    run = operations.start("test-loop", {"n": 6, "effects": True})
    if action == "kill-worker":
        # The whole worker died with its message unacked: only the sweeper can notice.
        wait_until(lambda: cluster_faults.fired() == 1, timeout=30, what="the fault")
        wait_until(lambda: not all(w.alive() for w in running.workers), timeout=10)
        alive_workers(running)
    done = finished(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    # before_ack fires after the final commit has made the run succeed: wait for it.
    wait_until(lambda: cluster_faults.fired() == 1, timeout=30, what="the fault")
    assert llm.total == 6 + extra, dict(llm.prompts)
    assert max(llm.prompts.values()) <= 1 + extra
    # Effects: one request per idempotency key, one key per iteration.
    assert len(effects.requests) == 6 and set(effects.requests.values()) == {1}
    assert operations.verify(run.id)[0].ok
    alive_workers(running)


def test_sigkill_with_a_commit_in_flight_loses_nothing_and_repeats_nothing(
    running, llm, effects, cluster_faults
):
    # The worker dies as the step after checkpoint #4 starts, #4's commit sent and not
    # answered (the marker records it): the server decides its fate, the run goes on from it.
    cluster_faults.set(
        {"point": "before_step", "when": {"seq": 4, "in_flight": True}, "action": "kill"}
    )
    run = operations.start("test-loop", {"n": 6, "effects": True})
    done = finished(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    [seen] = cluster_faults.records()
    assert (seen["point"], seen["in_flight"]) == ("before_step", True)
    assert Event.objects.filter(run=run, kind=EventKind.RECOVERED).count() == 1
    assert_each_prompt_once(llm, 6)
    assert len(effects.requests) == 6 and set(effects.requests.values()) == {1}
    assert operations.verify(run.id)[0].ok
    alive_workers(running)


def test_an_effect_whose_worker_died_mid_call_is_in_doubt_until_resolved(
    running, llm, effects, cluster_faults
):
    cluster_faults.set({"point": "after_effect", "when": {"seq": 2}, "action": "kill"})
    run = operations.start("test-loop", {"n": 4, "effects": True})

    def in_doubt():
        r = Run.objects.get(pk=run.id)
        return r.status == RunStatus.WAITING and r.wait_reason == "in_doubt"

    wait_until(in_doubt, timeout=30, what="the run to wait in doubt")
    effect = Effect.objects.get(run=run, status=EffectStatus.IN_DOUBT)
    assert effects.requests[effect.idempotency_key] == 1
    # The operator checks the receiving side and records what it did.
    outcome = effects.outcomes[effect.idempotency_key]
    operations.resolve_effect(run.id, effect.pk, outcome="done", result=outcome, by="ops")
    assert finished(run.id).status == RunStatus.SUCCEEDED
    assert len(effects.requests) == 4 and set(effects.requests.values()) == {1}
    alive_workers(running)


@pytest.mark.parametrize("action", ["kill", "kill-worker"])
def test_sigkill_while_waiting_for_approval(running, llm, cluster_faults, action):
    cluster_faults.set({"point": "suspended", "action": action})
    run = operations.start("test-loop", {"n": 4, "approve_at": 2})
    wait_until(lambda: cluster_faults.fired() == 1, timeout=30, what="the fault")
    if action == "kill-worker":
        wait_until(lambda: not all(w.alive() for w in running.workers), timeout=10)
        alive_workers(running)
    wait_until(lambda: Run.objects.get(pk=run.id).wait_reason == "approval", timeout=10)
    operations.decide(run.id, "go", approve=True, by="ops")
    done = finished(run.id)
    assert done.status == RunStatus.SUCCEEDED
    assert_each_prompt_once(llm, 4)
    alive_workers(running)


def test_sigkill_inside_the_sweeper(running, llm, cluster_faults):
    # The first sweep that finds a dead run dies before fixing it; the next one does.
    cluster_faults.set(
        {"point": "after_commit", "when": {"seq": 2}, "action": "kill-worker"},
        {"point": "sweep", "action": "kill"},
    )
    run = operations.start("test-loop", {"n": 5})
    wait_until(lambda: cluster_faults.fired() >= 1, timeout=30, what="the first fault")
    wait_until(lambda: not all(w.alive() for w in running.workers), timeout=10)
    alive_workers(running)
    done = finished(run.id)
    assert done.status == RunStatus.SUCCEEDED
    assert cluster_faults.fired() == 2
    assert_each_prompt_once(llm, 5)
    alive_workers(running)


def test_the_same_message_delivered_twice_at_once_runs_once(running, llm):
    from workers.tasks import execute_run

    run = operations.start("test-loop", {"n": 5, "slow_ms": 200})
    for _ in range(3):  # duplicates, as a redelivery or a second sweep would make
        execute_run.apply_async((str(run.id),), queue=running.queue)
    assert finished(run.id).status == RunStatus.SUCCEEDED
    assert_each_prompt_once(llm, 5)
    claims = Event.objects.filter(run=run, kind=EventKind.CLAIMED).count()
    assert claims == 1


def test_a_step_blocked_for_ten_leases_in_a_call_keeps_its_lease(running, llm, settings):
    """A call that blocks for ten times the lease: the heartbeat keeps renewing it, the
    module's sweeper (beat, every 0.5 s) never takes the run, and the call runs once, to
    the end, on the worker that began it. That worker has a lease of 2.5 s (it beats every
    0.5 s, as the module's workers do) and a queue of its own, so ten leases take 25 s
    rather than the 40 s the module's 4 s lease would."""
    lease = 2.5
    queue = f"{running.queue}-short-lease"
    env = {**running.env, "CELERY_QUEUE": queue, "DURABILITY_LEASE_SECONDS": str(lease)}
    short = CeleryWorker(f"{running.name}-short-lease", env).start()
    settings.CELERY_TASK_DEFAULT_QUEUE = queue
    try:
        run = operations.start("test-loop", {"n": 2, "block_s": 10 * lease, "block_at": 0})
        done = finished(run.id, timeout=120)
    finally:
        short.stop()
    assert done.status == RunStatus.SUCCEEDED
    claims = Event.objects.filter(run=run, kind=EventKind.CLAIMED)
    assert claims.exists() and all(short.name in e.worker for e in claims), list(claims)
    assert not Event.objects.filter(run=run, kind=EventKind.LEASE_LOST).exists()
    assert not Event.objects.filter(run=run, kind=EventKind.RECOVERED).exists()
    block = JournalEntry.objects.get(run=run, key="block")
    assert block.duration_ms >= 10 * lease * 1000  # ran once, to the end
    assert_each_prompt_once(llm, 2)


def test_sigterm_finishes_the_step_and_hands_the_run_over(running, llm):
    run = operations.start("test-loop", {"n": 12, "slow_ms": 300})
    wait_until(lambda: Run.objects.get(pk=run.id).head_seq >= 2, timeout=30)
    owner = Run.objects.get(pk=run.id).lease_owner
    victim = next(w for w in running.workers if w.name in owner)
    victim.terminate(timeout=30)  # warm shutdown of the main process
    released = Event.objects.filter(run=run, kind=EventKind.RELEASED)
    wait_until(released.exists, timeout=10, what="the lease to be handed back")
    assert finished(run.id).status == RunStatus.SUCCEEDED
    assert_each_prompt_once(llm, 12)
    assert not Event.objects.filter(run=run, kind=EventKind.LEASE_LOST).exists()
    alive_workers(running)


def test_sigterm_to_the_worker_abandons_a_long_step_after_the_grace_period(running, llm):
    run = operations.start("test-loop", {"n": 3, "block_s": 20, "block_at": 1})
    wait_until(lambda: Run.objects.get(pk=run.id).head_seq >= 1, timeout=30)
    owner = Run.objects.get(pk=run.id).lease_owner
    victim = next(w for w in running.workers if w.name in owner)
    time.sleep(0.5)  # inside the 20 s call now (the grace period is 2 s)
    stopped_at = time.monotonic()
    victim.terminate(timeout=30)  # warm shutdown of the main process
    # Stopped after the grace period, not after the step: the run was handed over.
    assert time.monotonic() - stopped_at < 12
    assert Event.objects.filter(run=run, kind=EventKind.RELEASED).exists()
    assert finished(run.id, timeout=90).status == RunStatus.SUCCEEDED
    assert not Event.objects.filter(run=run, kind=EventKind.LEASE_LOST).exists()
    alive_workers(running)


def test_sigterm_to_the_pool_process_abandons_a_long_step_cleanly(running, llm):
    run = operations.start("test-loop", {"n": 3, "block_s": 8, "block_at": 1})
    wait_until(lambda: Run.objects.get(pk=run.id).head_seq >= 1, timeout=30)
    owner = Run.objects.get(pk=run.id).lease_owner
    child = int(owner.rsplit(":", 1)[1])
    time.sleep(0.5)  # inside the 8 s call now (the grace period is 2 s)
    os.kill(child, signal.SIGTERM)
    released = Event.objects.filter(run=run, kind=EventKind.RELEASED)
    wait_until(released.exists, timeout=15, what="the abandoned step to hand the run back")
    done = finished(run.id, timeout=90)
    assert done.status == RunStatus.SUCCEEDED
    assert not Event.objects.filter(run=run, kind=EventKind.LEASE_LOST).exists()
    # Told to stop, the pool process stopped once it had handed the run back (living on, it
    # would hand back every run it was given); the pool replaced it.
    worker = next(w for w in running.workers if w.name in owner)
    wait_until(
        lambda: worker.children() and child not in worker.children(),
        timeout=15,
        what="the pool process to be replaced",
    )
    alive_workers(running)


def test_a_solo_pool_worker_stops_on_sigterm(running, llm):
    """``--pool solo`` runs tasks in the worker's main process: SIGTERM must stay Celery's
    warm shutdown there (finish the step, hand the run back, exit), idle or busy."""
    for worker in running.workers:  # every one told at once, each waited for
        os.kill(worker.pid, signal.SIGTERM)
    for worker in running.workers:
        worker.popen.wait(timeout=30)
    solo = CeleryWorker(f"{running.name}-solo", running.env, pool="solo").start()
    try:
        run = operations.start("test-loop", {"n": 12, "slow_ms": 300})
        wait_until(lambda: Run.objects.get(pk=run.id).head_seq >= 2, timeout=30)
        assert solo.name in Run.objects.get(pk=run.id).lease_owner
        assert solo.terminate(timeout=30) == 0
        assert Event.objects.filter(run=run, kind=EventKind.RELEASED).exists()
        # After a task has run in it (a run of one tick; the console leaves routine sweeps
        # out), idle or busy with the run handed back: it stops all the same.
        solo.start()
        quick = operations.start("test-ticker", {"n": 1})
        wait_until(lambda: Run.objects.get(pk=quick.id).status == RunStatus.SUCCEEDED, timeout=30)
        solo.wait_for_log("succeeded")
        assert solo.terminate(timeout=30) == 0
    finally:
        solo.stop()
        alive_workers(running)  # the module's workers, stopped above, for the next tests too
    assert finished(run.id).status == RunStatus.SUCCEEDED
    assert_each_prompt_once(llm, 12)
    assert not Event.objects.filter(run=run, kind=EventKind.LEASE_LOST).exists()


def test_a_stalled_worker_whose_session_lives_on_is_taken_over(running, llm):
    """SIGSTOP: the process neither dies nor beats, and its database session (holding the
    run's liveness lock) stays open. Once the lease expires the sweeper ends that session,
    so another worker can take the run instead of finding it locked forever."""
    run = operations.start("test-loop", {"n": 6, "slow_ms": 300})
    wait_until(lambda: Run.objects.get(pk=run.id).head_seq >= 2, timeout=30)
    owner = Run.objects.get(pk=run.id).lease_owner
    stalled = int(owner.rsplit(":", 1)[1])
    os.kill(stalled, signal.SIGSTOP)
    try:
        done = finished(run.id, timeout=60)
        assert done.status == RunStatus.SUCCEEDED
        lost = (
            Event.objects.filter(run=run, kind=EventKind.LEASE_LOST, reason="lease expired")
            .order_by("id")
            .first()
        )
        assert lost is not None and lost.worker == owner
        claims = Event.objects.filter(run=run, kind=EventKind.CLAIMED).order_by("id")
        assert claims.last().worker != owner
    finally:
        os.kill(stalled, signal.SIGCONT)
    # Woken up, the stalled process finds its session ended and its token outdated: nothing
    # it does from then on reaches the run.
    time.sleep(2)
    late = Event.objects.filter(run=run, id__gt=lost.id, worker=owner).exclude(
        kind=EventKind.LEASE_LOST
    )
    assert not late.filter(kind=EventKind.CHECKPOINT).exists()
    assert operations.verify(run.id)[0].ok
    alive_workers(running)


def test_sigkill_between_spawning_and_recording_makes_one_child(running, llm, cluster_faults):
    cluster_faults.set({"point": "after_spawn", "when": {"key": "child-1"}, "action": "kill"})
    run = operations.start("test-parent", {"sizes": [2, 3]})
    done = finished(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert cluster_faults.fired() == 1
    children = Run.objects.filter(parent_run=run)
    assert children.count() == 2
    assert {c.spawn_key for c in children} == {"child-0", "child-1"}
    assert operations.state_at(run.id)["results"] == [
        {"status": "succeeded", "i": 2},
        {"status": "succeeded", "i": 3},
    ]
    assert llm.total == 5
    alive_workers(running)
