"""Rolling deploys: workers announce the agent versions they can run, each run goes to a
worker that can continue it, and a run that no live worker can run waits visibly."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from durability import operations
from durability.models import Event, EventKind, Run, RunStatus, WorkerPresence
from durability.testing import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def fleet(cluster):
    old = cluster.worker(TEST_AGENT_VERSION="1", wait=False)
    new = cluster.worker(TEST_AGENT_VERSION="2", wait=False)
    cluster.start_beat()
    return cluster, old, new


def announced(names):
    return lambda: {p.name.split("@")[0] for p in WorkerPresence.objects.all()} >= set(names)


def test_runs_go_only_to_workers_that_can_continue_them(fleet):
    cluster, old, new = fleet
    wait_until(announced([old.name, new.name]), timeout=20, what="both workers to announce")
    runs = [operations.start("test-versioned", {}).id for _ in range(6)]  # version 1 here
    wait_until(
        lambda: all(Run.objects.get(pk=r).status == RunStatus.SUCCEEDED for r in runs),
        timeout=60,
        what="the runs",
    )
    workers = set(
        Event.objects.filter(run_id__in=runs, kind=EventKind.CLAIMED).values_list(
            "worker", flat=True
        )
    )
    assert workers and all(w.startswith(f"{old.name}@") for w in workers), workers


def test_a_run_no_live_worker_can_run_waits_visibly_until_one_can(fleet):
    cluster, old, new = fleet
    old.stop()  # the last worker with version 1 leaves (and withdraws its announcement)
    wait_until(lambda: not announced([old.name])(), timeout=20)
    run = operations.start("test-versioned", {})
    waiting = wait_until(
        lambda: (r := Run.objects.get(pk=run.id)).wait_reason == "version" and r,
        timeout=20,
        what="the run to wait for a worker",
    )
    assert waiting.status == RunStatus.QUEUED
    assert "no live worker can run test-versioned@1" in waiting.wait_detail
    assert "live workers run test-versioned@2" in waiting.wait_detail
    old.start()
    wait_until(
        lambda: Run.objects.get(pk=run.id).status == RunStatus.SUCCEEDED,
        timeout=60,
        what="the run to finish once a version-1 worker is back",
    )


def test_a_run_every_live_worker_can_continue_goes_to_the_shared_queue():
    """Not to one worker's own queue: a worker that died since its last announcement would
    hold the run there until the sweeper rang again (measured: recoveries of 10 s and 33 s
    after a whole worker was killed, instead of about 2 s)."""
    from durability import canonical, presence

    presence.announce("a@host")
    presence.announce("b@host")
    run = operations.start("test-loop", {"n": 1})
    assert presence.route(run.id) == (None, "")
    # A rolling deploy: b runs another version of the agent, so it may not take the run (the
    # module's real workers, when they are up, announce themselves too and may).
    caps = canonical.loads(WorkerPresence.objects.get(pk="b@host").capabilities)
    caps["test-loop"] = {**caps["test-loop"], "version": "99", "compatible": []}
    WorkerPresence.objects.filter(pk="b@host").update(capabilities=canonical.dumps(caps).decode())
    chosen = {presence.route(run.id) for _ in range(60)}
    assert ("a@host", "") in chosen
    assert all(worker not in (None, "b@host") and why == "" for worker, why in chosen)


def test_a_killed_worker_stops_counting_as_live_at_once(fleet):
    """Its announcement is still fresh, but the liveness lock its process held is gone: no
    run is routed to a queue nobody consumes any more."""
    from durability import presence

    cluster, old, new = fleet
    wait_until(announced([new.name]), timeout=20, what="the worker to announce")
    name = next(n for n in presence.live() if n.startswith(f"{new.name}@"))
    assert WorkerPresence.objects.get(pk=name).liveness_key == presence.liveness_key(name)
    new.kill()  # SIGKILL: no withdrawal, the row stays
    # As fresh as an announcement can be, so that only the lock can tell.
    fresh = timezone.now() + timedelta(hours=1)
    assert WorkerPresence.objects.filter(pk=name).update(seen_at=fresh) == 1
    wait_until(lambda: name not in presence.live(), timeout=10, what="the lock to be freed")
    new.start()
    wait_until(lambda: name in presence.live(), timeout=30, what="the restarted worker")


def test_routing_skips_an_announcement_whose_holder_is_gone():
    import threading

    from django.db import connection

    from durability import presence

    release = threading.Event()
    held = threading.Event()
    unlocked: list = []

    def worker(name: str, dies: bool) -> None:
        try:
            presence.announce(name, hold=True)
            if not dies:
                presence.announce(name, hold=True)  # renewing does not stack the lock
                with connection.cursor() as cur:
                    key = presence.liveness_key(name)
                    cur.execute(
                        "SELECT pg_advisory_unlock(%s, %s), pg_advisory_unlock(%s, %s)",
                        [presence._LOCK_NAMESPACE, key, presence._LOCK_NAMESPACE, key],
                    )
                    unlocked.append(cur.fetchone())
                presence.announce(name, hold=True)
                held.set()
                release.wait(30)
        finally:
            connection.close()  # a dead process's session ends: its lock is freed

    ghost = threading.Thread(target=worker, args=("ghost@host", True))
    ghost.start()
    ghost.join()
    alive = threading.Thread(target=worker, args=("alive@host", False))
    alive.start()
    try:
        assert held.wait(10)
        assert unlocked == [(True, False)]  # held once, however often it was announced
        run = operations.start("test-loop", {"n": 1})
        live = presence.live()
        assert "alive@host" in live and "ghost@host" not in live
        assert WorkerPresence.objects.filter(pk="ghost@host").exists()  # fresh, yet dead
        # Make it a rolling deploy (an announcement that cannot run the run), so that
        # routing chooses among the announcements that can.
        presence.announce("other@host")
        WorkerPresence.objects.filter(pk="other@host").update(capabilities="{}")
        chosen = {presence.route(run.id)[0] for _ in range(60)}
        assert "ghost@host" not in chosen and "alive@host" in chosen
    finally:
        release.set()
        alive.join()
