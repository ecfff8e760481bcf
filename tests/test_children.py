"""Child runs: ctx.spawn and ctx.join, in the engine."""

from __future__ import annotations

import pytest

from durability import END, Agent, operations, registry
from durability.models import Event, EventKind, Run, RunStatus
from durability.testing import drive, state_of

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def agents():
    for name in ("x-parent", "x-child"):
        registry.unregister(name)
    child = Agent("x-child", initial_state=lambda inp: {"n": inp["n"]})

    @child.step(start=True)
    def work(state, ctx):
        if state["n"] < 0:
            raise ValueError(f"negative: {state['n']}")
        if state["n"] == 99:
            ctx.approval("hold", {})
        state["square"] = state["n"] ** 2
        return END

    parent = Agent("x-parent", initial_state=lambda inp: {"ns": inp["ns"]})

    @parent.step(start=True)
    def fan_out(state, ctx):
        kids = [
            ctx.spawn("x-child", {"n": n}, key=f"square-{i}") for i, n in enumerate(state["ns"])
        ]
        state["results"] = ctx.join(kids)
        return END


@pytest.fixture
def picky_parent():
    """Joins only the first of the children it spawns."""
    registry.unregister("x-picky")
    parent = Agent("x-picky", initial_state=lambda inp: {"ns": inp["ns"]})

    @parent.step(start=True)
    def fan_out(state, ctx):
        kids = [ctx.spawn("x-child", {"n": n}, key=f"k-{i}") for i, n in enumerate(state["ns"])]
        state["first"] = ctx.join(kids[:1])
        return END

    yield parent
    registry.unregister("x-picky")


def drive_tree(run_id):
    """Drive the parent and its children in this process until the parent settles."""
    for _ in range(20):
        parent = drive(run_id)
        for child in Run.objects.filter(parent_run_id=run_id):
            drive(child.id)
        parent = Run.objects.get(pk=run_id)
        if parent.is_finished or parent.wait_reason not in ("children", ""):
            return parent
    return Run.objects.get(pk=run_id)


def test_join_waits_without_a_worker_and_returns_results_in_order():
    run = operations.start("x-parent", {"ns": [2, 3]})
    waiting = drive(run.id)
    assert (waiting.status, waiting.wait_reason, waiting.lease_owner) == (
        RunStatus.WAITING,
        "children",
        "",
    )
    children = list(Run.objects.filter(parent_run=run).order_by("spawn_key"))
    assert [c.spawn_key for c in children] == ["square-0", "square-1"]
    done = drive_tree(run.id)
    assert done.status == RunStatus.SUCCEEDED
    results = state_of(run.id)["results"]
    assert [r["result"]["square"] for r in results] == [4, 9]
    assert {r["status"] for r in results} == {"succeeded"}
    assert Event.objects.filter(run=run, kind=EventKind.CHILD_FINISHED).count() == 2


def test_a_crash_between_spawning_and_recording_makes_one_child(faults):
    faults.set({"point": "after_spawn", "when": {"key": "square-0"}, "action": "crash"})
    run = operations.start("x-parent", {"ns": [5]})
    drive_tree(run.id)
    assert faults.fired() == 1
    assert Run.objects.filter(parent_run=run).count() == 1
    assert state_of(run.id)["results"][0]["result"]["square"] == 25


def test_a_child_failure_is_visible_on_the_parent():
    run = operations.start("x-parent", {"ns": [1, -1]})
    done = drive_tree(run.id)
    assert done.status == RunStatus.SUCCEEDED
    failed = state_of(run.id)["results"][1]
    assert failed["status"] == "failed" and "negative: -1" in failed["error"]
    events = Event.objects.filter(run=run, kind=EventKind.CHILD_FINISHED)
    assert any('"status":"failed"' in e.data and "negative" in e.data for e in events)


def test_cancelling_a_parent_cancels_its_children():
    run = operations.start("x-parent", {"ns": [99, 4]})
    drive_tree(run.id)
    operations.cancel(run.id, by="ops")
    statuses = set(Run.objects.filter(parent_run=run).values_list("status", flat=True))
    assert statuses <= {RunStatus.CANCELLED, RunStatus.SUCCEEDED}
    assert RunStatus.CANCELLED in statuses
    tree = operations.tree(run.id)
    assert tree["status"] == "cancelled" and len(tree["children"]) == 2


def test_rollback_cancels_unfinished_children_of_the_abandoned_branch():
    registry.unregister("x-parent2")
    parent = Agent("x-parent2", initial_state=lambda inp: {"ns": inp["ns"]})

    @parent.step(start=True)
    def prepare(state, ctx):
        state["prepared"] = True
        return "fan_out"

    @parent.step
    def fan_out(state, ctx):
        state["results"] = ctx.join([ctx.spawn("x-child", {"n": n}) for n in state["ns"]])
        return END

    run = operations.start("x-parent2", {"ns": [99]})
    drive_tree(run.id)
    first_child = Run.objects.get(parent_run=run)
    assert first_child.wait_reason == "approval"
    operations.rollback(run.id, 0, by="ops", reason="start over", and_continue=True)
    assert Run.objects.get(pk=first_child.pk).status == RunStatus.CANCELLED
    drive_tree(run.id)
    second_child = Run.objects.filter(parent_run=run).exclude(pk=first_child.pk).get()
    assert second_child.wait_reason == "approval"
    operations.decide(second_child.id, "hold", approve=True, by="ops")
    assert drive_tree(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["results"][0]["result"]["square"] == 99 * 99


def test_a_lost_wake_up_of_a_parent_joined_on_some_children_is_delivered(picky_parent, faults):
    from durability import recovery

    run = operations.start("x-picky", {"ns": [2, 99]})  # the second child waits for a person
    assert drive(run.id).wait_reason == "children"
    first = Run.objects.get(parent_run=run, spawn_key="k-0")
    # The child's last commit happens, then its worker dies before telling the parent.
    faults.set({"point": "after_commit", "when": {"run": str(first.id)}, "action": "crash"})
    assert drive(first.id).status == RunStatus.SUCCEEDED
    assert faults.fired() == 1
    assert Run.objects.get(pk=run.id).status == RunStatus.WAITING
    recovery.sweep()
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED
    assert [r["result"]["square"] for r in state_of(run.id)["first"]] == [4]
    second = Run.objects.get(parent_run=run, spawn_key="k-1")
    assert not second.is_finished  # the parent did not wait for it
    # Spurious wake-ups do not happen: a parent still waiting on what it joined stays put.
    again = operations.start("x-picky", {"ns": [99, 2]})
    assert drive(again.id).wait_reason == "children"
    for child in Run.objects.filter(parent_run=again):
        drive(child.id)
    recovery.sweep()
    assert drive(again.id).wait_reason == "children"


def test_rolling_a_child_back_to_its_end_wakes_its_parent():
    run = operations.start("x-parent", {"ns": [3]})
    drive(run.id)
    child = Run.objects.get(parent_run=run)
    assert drive(child.id).status == RunStatus.SUCCEEDED  # checkpoints #0 and #1 (the end)
    operations.rollback(child.id, 0, reason="again")
    assert drive(run.id).wait_reason == "children"  # its child is not finished any more
    operations.rollback(child.id, 1, reason="it was right")  # finished again, by rollback
    assert Run.objects.get(pk=run.id).status == RunStatus.QUEUED
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["results"][0]["result"]["square"] == 9
