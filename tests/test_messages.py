"""Messages to a run (ctx.wait_for / send) and run idempotency keys, in the engine."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from durability import END, Agent, operations, registry
from durability.errors import InvalidInput, InvalidTransition
from durability.models import Message, Run, RunStatus
from durability.testing import drive, state_of

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def chat():
    registry.unregister("x-chat")
    agent = Agent("x-chat", initial_state=lambda inp: {"turns": []})

    @agent.step(start=True)
    def listen(state, ctx):
        said = ctx.wait_for("user")
        state["turns"].append(said)
        return END if said == "bye" else "listen"

    return agent


def test_messages_sent_before_the_wait_are_kept_in_order():
    run = operations.start("x-chat", {})
    for text in ("hello", "how are you", "bye"):
        operations.send(run.id, "user", text, by="alice")
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert state_of(run.id)["turns"] == ["hello", "how are you", "bye"]


def test_wait_for_releases_the_worker_and_a_send_wakes_the_run():
    run = operations.start("x-chat", {})
    waiting = drive(run.id)
    assert (waiting.status, waiting.wait_reason, waiting.wait_detail) == (
        RunStatus.WAITING,
        "message",
        "user",
    )
    assert waiting.lease_owner == ""
    operations.send(run.id, "user", {"text": "hi"})
    assert Run.objects.get(pk=run.id).status == RunStatus.QUEUED
    drive(run.id)
    operations.send(run.id, "user", "bye")
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["turns"] == [{"text": "hi"}, "bye"]


def test_a_send_retried_with_its_key_is_delivered_once():
    run = operations.start("x-chat", {})
    first = operations.send(run.id, "user", "hello", idempotency_key="k1")
    again = operations.send(run.id, "user", "hello", idempotency_key="k1")
    assert first.pk == again.pk and Message.objects.count() == 1
    with pytest.raises(InvalidInput) as err:
        operations.send(run.id, "user", "something else", idempotency_key="k1")
    assert "already used" in str(err.value)
    assert Message.objects.count() == 1


def test_bad_sends_change_nothing():
    run = operations.start("x-chat", {})
    with pytest.raises(InvalidInput):
        operations.send(run.id, "", "x")
    with pytest.raises(InvalidInput):
        operations.send(run.id, "user", float("nan"))
    operations.cancel(run.id)
    with pytest.raises(InvalidTransition) as err:
        operations.send(run.id, "user", "late")
    assert "takes no more messages" in str(err.value)
    assert Message.objects.count() == 0


def test_a_replayed_step_gets_the_same_message(faults):
    run = operations.start("x-chat", {})
    operations.send(run.id, "user", "one")
    operations.send(run.id, "user", "two")
    faults.set({"point": "in_commit", "when": {"seq": 1}, "action": "crash"})
    drive(run.id)
    # The crash undid the first checkpoint but not the consumption: the re-run took "one"
    # again, not "two".
    assert state_of(run.id)["turns"] == ["one", "two"]


def test_rollback_puts_consumed_messages_back_in_order():
    run = operations.start("x-chat", {})
    for text in ("a", "b", "c"):
        operations.send(run.id, "user", text)
    drive(run.id)
    assert state_of(run.id)["turns"] == ["a", "b", "c"]
    result = operations.rollback(run.id, 1, by="ops", and_continue=True)
    assert Message.objects.filter(run=run, consumed_base=None).count() == 2
    assert result.run.status == RunStatus.QUEUED
    drive(run.id)
    assert state_of(run.id)["turns"] == ["a", "b", "c"]


def test_rollback_off_the_current_branch_is_refused_when_messages_could_repeat():
    run = operations.start("x-chat", {})
    operations.send(run.id, "user", "m1")
    drive(run.id)  # #1 holds m1, waits for the next message
    operations.rollback(run.id, 0, by="ops", and_continue=True)  # m1 back to the inbox
    drive(run.id)  # consumed again on the new branch
    assert state_of(run.id)["turns"] == ["m1"]
    head = Run.objects.get(pk=run.id).head_seq
    with pytest.raises(InvalidInput) as err:
        operations.rollback(run.id, 1, by="ops")  # #1 is on the abandoned branch
    assert "not on the run's current branch" in str(err.value) and "fork" in str(err.value)
    assert Run.objects.get(pk=run.id).head_seq == head
    assert Message.objects.get(run=run).consumed_base_id is not None
    # Going back along the current branch still works.
    operations.rollback(run.id, 0, by="ops")
    assert Message.objects.get(run=run).consumed_base_id is None


def test_a_start_retried_with_its_key_returns_the_same_run():
    first = operations.start("x-chat", {"topic": 1}, idempotency_key="order-7")
    again = operations.start("x-chat", {"topic": 1}, idempotency_key="order-7")
    assert first.pk == again.pk and Run.objects.count() == 1
    with pytest.raises(InvalidInput) as err:
        operations.start("x-chat", {"topic": 2}, idempotency_key="order-7")
    assert f"already started run {first.pk}" in str(err.value)
    assert Run.objects.count() == 1


def test_concurrent_starts_with_one_key_make_one_run():
    got = []

    def start():
        try:
            got.append(operations.start("x-chat", {"same": True}, idempotency_key="race").pk)
        finally:
            connection.close()

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and Run.objects.count() == 1
