"""The smoke subset: it also runs on the embedded default (SQLite and Celery's filesystem
broker), with the demo agents: start, recover after a kill, approve, roll back."""

from __future__ import annotations

import pytest

from durability import operations
from durability.models import Event, EventKind, Run, RunStatus
from durability.testing import state_of, wait_until
from examples.models import OutboxMessage

pytestmark = [pytest.mark.smoke, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def workers(cluster):
    cluster.worker(concurrency=2, wait=False)
    cluster.start_beat()
    return cluster


def settled(run_id, timeout=90.0) -> Run:
    def check():
        run = Run.objects.get(pk=run_id)
        return run if run.is_finished or run.wait_reason in ("approval", "in_doubt") else None

    return wait_until(check, timeout=timeout, what=f"run {run_id} to settle")


def test_research_demo_runs_to_its_approval_and_publishes_once(workers):
    run = operations.start("research", {"question": "How do fencing tokens make leases safe?"})
    waiting = settled(run.id)
    assert (waiting.status, waiting.wait_reason) == (RunStatus.WAITING, "approval")
    state = state_of(run.id)
    assert state["notes"] and "fencing" in state["draft"].lower()
    operations.decide(run.id, "publish", approve=True, by="smoke", comment="ok")
    done = settled(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert OutboxMessage.objects.filter(channel="publish").count() == 1
    assert operations.verify(run.id)[0].ok


def test_recovers_after_its_worker_process_is_killed(workers):
    run = operations.start(
        "support",
        {"customer": "ada@example.com", "message": "Refund order A-1001 please", "crash_at": "act"},
    )
    done = settled(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert Event.objects.filter(run=run, kind=EventKind.RECOVERED).exists()
    # One refund and one reply, each delivered once, although a worker died mid-run.
    assert OutboxMessage.objects.filter(channel="refund").count() == 1
    assert OutboxMessage.objects.filter(channel="email").count() == 1
    assert operations.verify(run.id)[0].ok


def test_the_crash_knob_kills_once_even_across_an_approval(workers):
    """``crash_at`` names the step whose worker dies: once per run, although the step runs
    again after its recovery and again after the approval it waits for."""
    run = operations.start(
        "research", {"question": "How do fencing tokens make leases safe?", "crash_at": "review"}
    )
    waiting = settled(run.id)
    assert waiting.wait_reason == "approval", waiting.error
    operations.decide(run.id, "publish", approve=True, by="smoke")
    done = wait_until(
        lambda: (r := Run.objects.get(pk=run.id)).is_finished and r, timeout=90, what="the end"
    )
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert Event.objects.filter(run=run, kind=EventKind.RECOVERED).count() == 1
    assert OutboxMessage.objects.filter(channel="publish").count() == 1


def test_large_refund_waits_for_approval_with_edits(workers):
    run = operations.start(
        "support",
        {"customer": "grace@example.com", "message": "I want to return order A-1002"},
    )
    waiting = settled(run.id)
    assert waiting.wait_reason == "approval" and waiting.wait_detail == "refund"
    operations.decide(
        run.id,
        "refund",
        approve=True,
        by="smoke",
        payload={
            "order_id": "A-1002",
            "amount_eur": 300.0,
            "customer": "grace@example.com",
            "item": "27-inch monitor",
        },
    )
    assert settled(run.id).status == RunStatus.SUCCEEDED
    refund = OutboxMessage.objects.get(channel="refund")
    assert float(refund.amount_eur) == 300.0


def test_rollback_runs_the_branch_again(workers):
    run = operations.start("research", {"question": "Why add jitter to backoff?"})
    settled(run.id)
    operations.decide(run.id, "publish", approve=False, by="smoke", comment="weak draft")
    assert settled(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["outcome"].startswith("rejected by smoke")
    summarised = Run.objects.get(pk=run.id).head_seq - 1
    result = operations.rollback(
        run.id, summarised, by="smoke", reason="ask again", and_continue=True
    )
    assert result.checkpoint.parent.seq == summarised
    waiting = settled(run.id)
    assert waiting.wait_reason == "approval"
    operations.decide(run.id, "publish", approve=True, by="smoke")
    assert settled(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["outcome"] == "published"
    assert operations.verify(run.id)[0].ok


def test_concierge_conversation_with_a_research_sub_agent(workers):
    run = operations.start("concierge", {"user": "smoke"})
    operations.send(run.id, "user", "How do fencing tokens make leases safe?")
    wait_until(
        lambda: (
            len(state_of(run.id)["transcript"]) >= 2
            and Run.objects.get(pk=run.id).wait_reason == "message"
        ),
        timeout=90,
        what="the first answer",
    )
    child = Run.objects.get(parent_run=run)
    assert child.agent == "research" and child.status == RunStatus.SUCCEEDED
    answer = state_of(run.id)["transcript"][1]
    assert answer["role"] == "assistant" and "fencing" in answer["content"].lower()
    operations.send(run.id, "user", "bye")
    assert settled(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["transcript"][-1]["content"] == "Goodbye!"
