"""A compensation under SIGKILL: real Celery worker processes on PostgreSQL and Redis, killed
at each named fault point around the compensation a rollback asked for. Counting is the
assertion: the effect receiver (a real HTTP server) sees exactly one compensation request
per idempotency key, and one compensation in all; a worker that died mid-call leaves it in
doubt for an operator, never repeated blindly."""

from __future__ import annotations

import pytest

from durability import operations, rollbacks
from durability.models import (
    Effect,
    EffectStatus,
    Event,
    EventKind,
    Run,
    RunStatus,
)
from durability.testing import wait_until

pytestmark = [pytest.mark.smoke, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def running(cluster):
    cluster.worker(wait=False)
    cluster.worker(wait=False)
    cluster.start_beat()
    return cluster


def settled(run_id, timeout=60.0) -> Run:
    def check():
        run = Run.objects.get(pk=run_id)
        waiting = run.status == RunStatus.WAITING and run.wait_reason in ("approval", "in_doubt")
        return run if run.is_finished or waiting else None

    return wait_until(check, timeout=timeout, what=f"run {run_id} to settle")


def alive(cluster) -> None:
    for worker in cluster.workers:
        if not worker.alive():
            worker.start()


@pytest.mark.parametrize(
    "point",
    ["claimed", "before_step", "after_intent", "after_effect", "in_commit", "after_commit"],
)
def test_a_compensation_killed_at_each_fault_point_is_sent_once(
    running, effects, cluster_faults, point
):
    run = operations.start("test-refund", {})
    assert settled(run.id).status == RunStatus.SUCCEEDED
    refund = Effect.objects.get(run=run, key="refund")
    key = f"{rollbacks.COMPENSATION_KEY}{refund.pk}"
    head = Run.objects.get(pk=run.id).head_seq
    # The rollback's head is head + 1; the step after it (pay, with the compensation before
    # it) commits head + 2.
    when = {
        "claimed": {"run": str(run.id), "seq": head + 1},
        "before_step": {"run": str(run.id), "seq": head + 1},
        "after_intent": {"run": str(run.id), "key": key},
        "after_effect": {"run": str(run.id), "key": key},
        "in_commit": {"run": str(run.id), "seq": head + 2},
        "after_commit": {"run": str(run.id), "seq": head + 2},
    }[point]
    cluster_faults.set({"point": point, "when": when, "action": "kill"})
    operations.rollback(run.id, 1, by="ops", and_continue=True, decisions={refund.pk: "compensate"})
    run = settled(run.id)
    assert cluster_faults.fired() == 1
    compensation = Effect.objects.get(run=run, key=key)
    if point in ("after_intent", "after_effect"):
        # The worker died between the compensation's intent and its outcome: in doubt.
        assert (run.wait_reason, compensation.status) == ("in_doubt", EffectStatus.IN_DOUBT)
        sent = effects.requests[compensation.idempotency_key]
        assert sent == (1 if point == "after_effect" else 0)
        if sent:  # the operator checks the receiving side and records what it did
            outcome = effects.outcomes[compensation.idempotency_key]
            operations.resolve_effect(
                run.id, compensation.pk, outcome="done", result=outcome, by="ops"
            )
        else:
            operations.resolve_effect(run.id, compensation.pk, outcome="retry", by="ops")
        run = settled(run.id)
    # Compensated once; the refund performed again without asking; the email asked about.
    assert run.wait_reason == "approval", run.error
    assert run.wait_detail == rollbacks.REPEAT_APPROVAL + "email"
    compensation.refresh_from_db()
    assert compensation.status == EffectStatus.DONE
    reversals = {k: n for k, n in effects.requests.items() if k.endswith(f"{key}:0")}
    assert reversals == {compensation.idempotency_key: 1}
    assert Event.objects.filter(run=run, kind=EventKind.COMPENSATED).count() == 1
    assert sorted(effects.requests.values()) == [1, 1, 1, 1]  # refund, email, reversal, refund
    alive(running)
