"""Approval policies: who may decide, timeouts decided by the sweeper exactly once, and
escalation; enforced in the engine, so every way in obeys them."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection
from django.utils import timezone

from durability import END, Agent, operations, registry
from durability.errors import NotAllowed
from durability.models import Approval, ApprovalStatus, Event, EventKind, RunStatus
from durability.recovery import sweep
from durability.testing import drive, state_of

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def agents():
    registry.unregister("x-policy")
    agent = Agent("x-policy", initial_state=lambda inp: dict(inp))

    @agent.step(start=True)
    def ask(state, ctx):
        decision = ctx.approval(
            "refund",
            {"eur": state["eur"]},
            group="finance",
            timeout=state.get("timeout"),
            on_timeout=state.get("on_timeout", "reject"),
            escalate_to=state.get("escalate_to", ""),
        )
        state["decision"] = [decision.approved, decision.by]
        return END


@pytest.fixture
def people():
    finance = Group.objects.create(name="finance")
    managers = Group.objects.create(name="managers")
    operators = Group.objects.create(name="operators")
    alice = User.objects.create_user("alice")
    alice.groups.add(finance, operators)
    User.objects.create_user("bob").groups.add(operators)
    carol = User.objects.create_user("carol")
    carol.groups.add(managers, operators)
    # In the group but not an operator: the group narrows who of the operators may decide.
    User.objects.create_user("dave").groups.add(finance)
    return {"finance": finance, "managers": managers}


def expire(run_id) -> None:
    Approval.objects.filter(run_id=run_id, status=ApprovalStatus.PENDING).update(
        deadline=timezone.now() - timedelta(seconds=1)
    )


def test_only_members_of_the_group_may_decide(people):
    run = operations.start("x-policy", {"eur": 500})
    drive(run.id)
    for outsider in ("bob", "dave"):  # an operator outside finance; a non-operator in it
        with pytest.raises(NotAllowed) as err:
            operations.decide(run.id, "refund", approve=True, by=outsider)
        assert "only operators in the group 'finance'" in str(err.value)
    assert Approval.objects.get(run=run).status == ApprovalStatus.PENDING
    operations.decide(run.id, "refund", approve=True, by="alice")
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["decision"] == [True, "alice"]


def test_a_timed_out_approval_is_decided_by_policy_exactly_once(people):
    run = operations.start("x-policy", {"eur": 50, "timeout": 60, "on_timeout": "approve"})
    drive(run.id)
    approval = Approval.objects.get(run=run)
    assert approval.deadline is not None and approval.on_timeout == "approve"
    sweep()
    assert Approval.objects.get(run=run).status == ApprovalStatus.PENDING  # not due yet
    expire(run.id)

    def sweeper():
        try:
            sweep()
        finally:
            connection.close()

    threads = [threading.Thread(target=sweeper) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    decided = Approval.objects.get(run=run)
    assert (decided.status, decided.decided_by) == (ApprovalStatus.APPROVED, "policy:timeout")
    events = Event.objects.filter(run=run, kind=EventKind.APPROVAL_DECIDED)
    assert events.count() == 1
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["decision"] == [True, "policy:timeout"]


def test_escalation_re_addresses_and_restarts_the_clock(people):
    run = operations.start(
        "x-policy",
        {"eur": 5000, "timeout": 3600, "on_timeout": "escalate", "escalate_to": "managers"},
    )
    drive(run.id)
    expire(run.id)
    sweep()
    escalated = Approval.objects.get(run=run)
    assert escalated.status == ApprovalStatus.PENDING and escalated.group == "managers"
    assert escalated.deadline > timezone.now() + timedelta(seconds=3500)
    assert Event.objects.filter(run=run, kind=EventKind.APPROVAL_ESCALATED).count() == 1
    with pytest.raises(NotAllowed):
        operations.decide(run.id, "refund", approve=True, by="alice")  # finance no longer
    # Nobody decides in time again: rejected.
    expire(run.id)
    sweep()
    assert Approval.objects.get(run=run).status == ApprovalStatus.REJECTED
    drive(run.id)
    assert state_of(run.id)["decision"] == [False, "policy:timeout"]
