"""The run's state machine (``durability.lifecycle``): every transition its table allows
works, every other one is refused with DUR114 and changes nothing, and a stale fencing token
changes nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models import Q
from django.utils import timezone

from durability import END, Agent, lifecycle, operations, registry
from durability.errors import Stale, TransitionNotAllowed
from durability.models import Run, RunStatus, WaitReason

pytestmark = [pytest.mark.smoke, pytest.mark.django_db]

STATUSES = list(RunStatus.values)


@pytest.fixture(autouse=True)
def agent():
    registry.unregister("lifecycle-one")
    Agent("lifecycle-one", steps={"only": lambda state, ctx: END})
    yield
    registry.unregister("lifecycle-one")


def run_in(status: str, token: int = 7) -> Run:
    """A run put in ``status`` (held with ``token``) the way tests set a scene: directly."""
    run = operations.start("lifecycle-one", {})
    Run.objects.filter(pk=run.pk).update(
        status=status,
        lease_token=token,
        lease_owner="w1" if status == RunStatus.RUNNING else "",
        wait_reason=WaitReason.TIMER if status == RunStatus.WAITING else WaitReason.NONE,
    )
    run.refresh_from_db()
    return run


def row(run: Run) -> dict:
    return Run.objects.filter(pk=run.pk).values().get()


def later():
    return timezone.now() + timedelta(seconds=60)


# (operation, how to call it with a run and the token it is held with)
WORKER = {
    "suspend": lambda run, token: lifecycle.suspend(run.pk, token, WaitReason.TIMER, "t", later()),
    "release": lambda run, token: lifecycle.release(run.pk, token),
    "succeed": lambda run, token: lifecycle.succeed(run.pk, token),
    "fail": lambda run, token: lifecycle.fail(run.pk, token, error="boom", code="DUR501"),
}
OPERATOR = {
    "resume": lifecycle.resume,
    "cancel": lifecycle.cancel,
    "hold": lambda run: lifecycle.roll_back(run, seq=0, step="only", held=True, detail="h"),
    "restart": lambda run: lifecycle.roll_back(run, seq=0, step="only", held=False, detail=""),
    "end": lambda run: lifecycle.roll_back(run, seq=0, step="", held=False, detail=""),
}
CONDITIONAL = {
    "wake": lambda run: lifecycle.wake(run.pk),
    "park": lambda run: lifecycle.park(run.pk, WaitReason.CONCURRENCY, "full", later()),
    "requeue": lambda run: lifecycle.requeue(run.pk, run.lease_token, Q()),
    # A LangGraph graph executed in its own process reports what its checkpoints say.
    "graph_waits": lambda run: lifecycle.apply_graph(
        run.pk,
        lifecycle.graph_change(
            "graph_waits", detail="an answer to: refund?", wait=WaitReason.INTERRUPT
        ),
    ),
    "graph_ended": lambda run: lifecycle.apply_graph(run.pk, lifecycle.graph_change("graph_ended")),
    "graph_failed": lambda run: lifecycle.apply_graph(
        run.pk, lifecycle.graph_change("graph_failed", error="boom", code="DUR501")
    ),
}


def cases(ops: dict) -> list:
    return [(op, status) for op in ops for status in STATUSES]


def test_every_operation_is_in_the_table_and_tested():
    tested = set(WORKER) | set(OPERATOR) | set(CONDITIONAL) | {"claim", "checkpoint"}
    assert tested == set(lifecycle.TRANSITIONS)
    assert lifecycle.claimed()["status"] == lifecycle.TRANSITIONS["claim"].target
    assert lifecycle.after_step(False) == RunStatus.RUNNING
    assert lifecycle.after_step(True) == RunStatus.SUCCEEDED
    assert lifecycle.first_fields("only")["status"] == RunStatus.QUEUED
    assert lifecycle.first_fields("")["status"] == RunStatus.SUCCEEDED


@pytest.mark.parametrize("op, status", cases(WORKER))
def test_a_worker_transition_applies_only_where_the_table_allows(op, status):
    transition = lifecycle.TRANSITIONS[op]
    run = run_in(status)
    before = row(run)
    if status in transition.sources:
        assert WORKER[op](run, 7) is True
        after = row(run)
        assert after["status"] == transition.target
        assert after["lease_owner"] == "" and after["lease_token"] == 7
        return
    with pytest.raises(TransitionNotAllowed) as refused:
        WORKER[op](run, 7)
    assert refused.value.code == "DUR114" and f"a {status} run cannot {op}" in str(refused.value)
    assert row(run) == before


@pytest.mark.parametrize("op, status", cases(WORKER))
def test_a_stale_token_changes_nothing(op, status):
    run = run_in(status, token=8)
    before = row(run)
    assert WORKER[op](run, 7) is False
    assert row(run) == before


@pytest.mark.parametrize("op, status", cases(OPERATOR))
def test_an_operator_transition_applies_only_where_the_table_allows(op, status):
    transition = lifecycle.TRANSITIONS[op]
    run = run_in(status)
    before = row(run)
    if status in transition.sources:
        OPERATOR[op](run)
        after = row(run)
        assert after["status"] == transition.target == run.status
        assert after["lease_token"] == 8  # moved on: a worker still at it is fenced out
        return
    with pytest.raises(TransitionNotAllowed) as refused:
        OPERATOR[op](run)
    assert refused.value.code == "DUR114"
    assert row(run) == before


@pytest.mark.parametrize("op", list(OPERATOR))
def test_an_operator_transition_on_a_stale_read_changes_nothing(op):
    run = run_in(RunStatus.WAITING)
    Run.objects.filter(pk=run.pk).update(lease_token=9)  # moved on since ``run`` was read
    before = row(run)
    with pytest.raises(Stale):
        OPERATOR[op](run)
    assert row(run) == before


@pytest.mark.parametrize("op, status", cases(CONDITIONAL))
def test_a_conditional_transition_acts_only_on_the_status_it_expects(op, status):
    transition = lifecycle.TRANSITIONS[op]
    run = run_in(status)
    before = row(run)
    done = CONDITIONAL[op](run)
    assert done is (status in transition.sources)
    if not done:
        assert row(run) == before
        return
    assert row(run)["status"] == transition.target


def test_a_graph_failing_again_says_its_latest_error_and_the_same_one_changes_nothing():
    run = run_in(RunStatus.FAILED)
    Run.objects.filter(pk=run.pk).update(error="boom", error_code="DUR501")
    before = row(run)
    again = lifecycle.graph_change("graph_failed", error="boom", code="DUR501")
    assert lifecycle.apply_graph(run.pk, again) is False
    assert row(run) == before
    other = lifecycle.graph_change("graph_failed", error="timed out", code="DUR501")
    assert lifecycle.apply_graph(run.pk, other) is True
    assert (row(run)["status"], row(run)["error"]) == ("failed", "timed out")


def test_the_sweepers_requeue_is_fenced_on_the_token_it_read():
    run = run_in(RunStatus.RUNNING, token=8)
    before = row(run)
    assert lifecycle.requeue(run.pk, 7, Q()) is False
    assert row(run) == before
    assert lifecycle.requeue(run.pk, 8, Q()) is True
    after = row(run)
    assert (after["status"], after["lease_token"], after["lease_owner"]) == ("queued", 9, "")


def test_wake_for_another_reason_changes_nothing():
    run = run_in(RunStatus.WAITING)
    before = row(run)
    assert lifecycle.wake(run.pk, WaitReason.APPROVAL) is False
    assert row(run) == before
    assert lifecycle.wake(run.pk, WaitReason.TIMER) is True


def test_every_status_pair_allowed_comes_from_the_table():
    pairs = {(s, t.target) for t in lifecycle.TRANSITIONS.values() for s in t.sources}
    assert pairs == lifecycle.ALLOWED
    # A finished run goes nowhere but through an operator's rollback or resume, or (a
    # LangGraph graph executed in its own process) by its graph being invoked again.
    for finished in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED):
        ops = {op for op, t in lifecycle.TRANSITIONS.items() if finished in t.sources}
        graph = {"graph_waits", "graph_ended", "graph_failed"}
        assert ops <= {"resume", "hold", "restart", "end", *graph}
