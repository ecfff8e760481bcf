"""Operations on runs, in the engine: each validates its input, refuses with a clear error
that changes nothing, and records who did it and why."""

from __future__ import annotations

import pytest
from django.db import connection

from durability import Agent, operations, registry
from durability.errors import (
    AlreadyDecided,
    IntegrityViolation,
    InvalidInput,
    InvalidTransition,
    SchemaViolation,
    StateNotJSON,
    StateTooLarge,
    UnknownAgent,
    UnknownCheckpoint,
    UnknownRun,
)
from durability.models import (
    Approval,
    ApprovalStatus,
    Checkpoint,
    Effect,
    Event,
    EventKind,
    JournalEntry,
    Run,
    RunStatus,
    Snapshot,
)
from durability.testing import drive, state_of

pytestmark = pytest.mark.django_db(transaction=True)

SENT: list[str] = []


def send(what, *, idempotency_key):
    SENT.append(idempotency_key)
    return {"sent": what}


def counts() -> dict[str, int]:
    return {
        model.__name__: model.objects.count()
        for model in (Run, Checkpoint, Event, Approval, Effect, JournalEntry)
    }


@pytest.fixture(autouse=True)
def agents():
    SENT.clear()
    registry.unregister("ops-chain")

    def first(state, ctx):
        state["trail"].append("first")
        state["mail"] = ctx.effect("mail", send, "hello")

    def second(state, ctx):
        state["trail"].append("second")
        state["receipt"] = ctx.effect("pay", send, "money")

    def third(state, ctx):
        decision = ctx.approval("ship", {"trail": state["trail"]})
        state["trail"].append(f"third:{decision.approved}")

    Agent(
        "ops-chain",
        steps=[first, second, third],
        schema={
            "type": "object",
            "required": ["trail"],
            "properties": {"trail": {"type": "array", "items": {"type": "string"}}},
        },
        initial_state=lambda inp: {"trail": [], "who": inp.get("who", "x")},
        input_schema={"type": "object", "properties": {"who": {"type": "string"}}},
    )
    yield


# --- bad input changes nothing ---------------------------------------------------------------


@pytest.mark.parametrize(
    "agent, payload, error, words",
    [
        ("nope", {}, UnknownAgent, "unknown agent 'nope'"),
        ("ops-chain", {"who": 3}, SchemaViolation, "/who: 3 is not of type 'string'"),
        ("ops-chain", {"who": float("nan")}, StateNotJSON, "nan"),
        ("ops-chain", {"who": "x" * 2_000_000}, StateTooLarge, "over the limit"),
    ],
)
def test_start_refuses_bad_input(agent, payload, error, words):
    before = counts()
    with pytest.raises(error) as err:
        operations.start(agent, payload)
    assert words in str(err.value)
    assert counts() == before


def test_unknown_run_and_checkpoint():
    run = operations.start("ops-chain", {})
    before = counts()
    with pytest.raises(UnknownRun):
        operations.resume("00000000-0000-0000-0000-000000000000")
    with pytest.raises(UnknownRun):
        operations.cancel("not-a-run")
    with pytest.raises(UnknownCheckpoint) as err:
        operations.rollback(run.id, 7)
    assert "checkpoints are #0 to #0" in str(err.value)
    with pytest.raises(UnknownCheckpoint):
        operations.fork(run.id, 3)
    assert counts() == before


def test_runs_are_found_by_a_unique_prefix():
    run = operations.start("ops-chain", {})
    assert operations.get_run(str(run.id)[:8]).pk == run.pk
    with pytest.raises(UnknownRun):
        operations.get_run("zz")


# --- rollback ------------------------------------------------------------------------------------


def test_rollback_makes_a_new_head_keeps_history_and_lists_effects_done():
    run = operations.start("ops-chain", {}, by="alice")
    drive(run.id)  # waits for "ship" after first and second ran
    assert state_of(run.id)["trail"] == ["first", "second"]
    plan = operations.plan_rollback(run.id, 1)
    assert [e.key for e in plan.done_not_undone] == ["pay"]
    assert plan.approvals_superseded == 1
    result = operations.rollback(run.id, 1, by="bob", reason="bad payment")
    assert result.checkpoint.seq == 3 and result.checkpoint.parent.seq == 1
    assert state_of(run.id) == state_of(run.id, 1)
    assert Checkpoint.objects.filter(run=run).count() == 4  # nothing deleted
    assert Approval.objects.get(run=run).status == ApprovalStatus.SUPERSEDED
    event = Event.objects.get(run=run, kind=EventKind.ROLLBACK)
    assert (event.actor, event.reason) == ("bob", "bad payment")
    assert "pay" in event.data
    # On hold until continued; then the new branch reaches "pay" again and asks first.
    assert drive(run.id).wait_reason == "hold" and len(SENT) == 2
    operations.resume(run.id, by="bob")
    assert drive(run.id).wait_detail == "repeat effect: pay" and len(SENT) == 2
    operations.decide(run.id, "repeat effect: pay", approve=True, by="carol")
    drive(run.id)
    # Performed again once approved: a new identity, a new idempotency key.
    assert len(SENT) == 3 and len(set(SENT)) == 3
    assert operations.verify(run.id)[0].ok


def test_rollback_to_a_checkpoint_of_another_run_is_refused():
    a = operations.start("ops-chain", {})
    b = operations.start("ops-chain", {})
    drive(a.id)
    other = Checkpoint.objects.get(run=b, seq=0)
    before = counts()
    with pytest.raises(InvalidInput) as err:
        operations.rollback(a.id, checkpoint_id=other.pk)
    assert f"belongs to run {b.id}" in str(err.value)
    assert counts() == before


def test_rollback_to_the_head_is_refused():
    run = operations.start("ops-chain", {})
    with pytest.raises(InvalidTransition):
        operations.rollback(run.id, 0)


def test_rollback_supersedes_an_approval_asked_at_the_target_itself():
    """At the periodic level an approval is recorded under the interrupted step's replay
    base, which can be the very checkpoint rolled back to; the new branch asks anew."""
    run = operations.start("ops-chain", {})
    drive(run.id)
    target = Checkpoint.objects.get(run=run, seq=1)
    Approval.objects.filter(run=run).update(base=target)
    assert operations.plan_rollback(run.id, 1).approvals_superseded == 1
    pay = Effect.objects.get(run=run, key="pay")
    operations.rollback(run.id, 1, and_continue=True, decisions={pay.pk: "again"})
    assert Approval.objects.get(run=run).status == ApprovalStatus.SUPERSEDED
    assert drive(run.id).wait_detail == "ship"
    assert Approval.objects.filter(run=run, status=ApprovalStatus.PENDING).count() == 1


def test_decision_on_an_approval_asked_before_a_rollback_is_refused():
    run = operations.start("ops-chain", {})
    drive(run.id)
    operations.rollback(run.id, 1)
    with pytest.raises(InvalidTransition) as err:
        operations.decide(run.id, "ship", approve=True, by="bob")
    assert "superseded" in str(err.value)


# --- fork ------------------------------------------------------------------------------------


def test_fork_with_edited_state_starts_a_new_run():
    run = operations.start("ops-chain", {})
    drive(run.id)
    fork = operations.fork(
        run.id, 1, state={"trail": ["edited"], "who": "y"}, by="dev", reason="what if"
    )
    assert fork.forked_from_id == run.id and fork.forked_from_seq == 1
    assert fork.step == "second"
    assert state_of(fork.id) == {"trail": ["edited"], "who": "y"}
    drive(fork.id)
    assert state_of(fork.id)["trail"] == ["edited", "second"]
    assert Event.objects.filter(run=run, kind=EventKind.FORK).exists()


def test_a_fork_of_a_final_checkpoint_begins_ended_and_retention_sees_when():
    run = drive(operations.start("ops-chain", {}).id)
    operations.decide(run.id, "ship", approve=True, by="dev")
    run = drive(run.id)
    assert run.status == "succeeded"
    fork = operations.fork(run.id, run.head_seq, by="dev")
    assert fork.status == "succeeded" and fork.finished_at is not None
    assert fork.step == ""
    queued = operations.fork(run.id, 1, by="dev")
    assert queued.status == "queued" and queued.finished_at is None


def test_fork_with_state_failing_the_schema_is_refused():
    run = operations.start("ops-chain", {})
    before = counts()
    with pytest.raises(SchemaViolation):
        operations.fork(run.id, 0, state={"trail": "not a list"})
    assert counts() == before


def test_fork_keeps_redacted_values_unchanged():
    run = operations.start("ops-chain", {"who": "x"})
    fork = operations.fork(run.id, 0, state={"trail": [], "who": "[redacted]"})
    assert state_of(fork.id)["who"] == "x"


# --- cancel, resume, decide -------------------------------------------------------------------


def test_cancel_and_resume():
    run = operations.start("ops-chain", {})
    operations.cancel(run.id, by="ops", reason="not needed")
    with pytest.raises(InvalidTransition):
        operations.cancel(run.id)
    resumed = operations.resume(run.id, by="ops")
    assert resumed.status == RunStatus.QUEUED
    drive(run.id)
    operations.decide(run.id, "ship", approve=True, by="ops")
    assert drive(run.id).status == RunStatus.SUCCEEDED
    with pytest.raises(InvalidTransition) as err:
        operations.resume(run.id)
    assert "nothing to resume" in str(err.value)


def test_decide_unknown_approval_and_rejection_with_payload():
    run = operations.start("ops-chain", {})
    drive(run.id)
    with pytest.raises(InvalidInput) as err:
        operations.decide(run.id, "launch", approve=True)
    assert "pending: ship" in str(err.value)
    with pytest.raises(InvalidInput):
        operations.decide(run.id, "ship", approve=False, payload={"x": 1}, comment="no")
    # A rejection says why: refused without, in the same words everywhere.
    for unsaid in ("", "   "):
        with pytest.raises(InvalidInput, match="say why you reject it"):
            operations.decide(run.id, "ship", approve=False, by="a", comment=unsaid)
    assert Approval.objects.get(run=run).status == ApprovalStatus.PENDING
    operations.decide(run.id, "ship", approve=False, by="a", comment="no")
    with pytest.raises(AlreadyDecided):
        operations.decide(run.id, "ship", approve=True, by="b")


# --- integrity ----------------------------------------------------------------------------------


def test_a_corrupted_checkpoint_is_named_and_never_rehydrated():
    run = operations.start("ops-chain", {})
    drive(run.id)
    bad = Checkpoint.objects.get(run=run, seq=1)
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE durability_mutation SET ops = replace(ops, 'first', 'FIRST')"
            " WHERE checkpoint_id = %s",
            [bad.pk],
        )
    report = operations.verify(run.id)[0]
    assert not report.ok and report.first_bad[0] == 1
    assert "#1" in str(report)
    # Now the head itself: whichever of its bytes a rebuild reads.
    head = Checkpoint.objects.get(run=run, seq=2)
    table = "snapshot" if Snapshot.objects.filter(checkpoint=head).exists() else "mutation"
    column = "state" if table == "snapshot" else "ops"
    with connection.cursor() as cur:
        cur.execute(
            f"UPDATE durability_{table} SET {column} = replace({column}, 'second', 'SECOND')"
            " WHERE checkpoint_id = %s",
            [head.pk],
        )
    operations.cancel(run.id)
    with pytest.raises(IntegrityViolation) as err:
        operations.resume(run.id)
    assert "does not verify" in str(err.value)
    assert Run.objects.get(pk=run.id).status == RunStatus.CANCELLED


def test_a_corrupted_snapshot_fails_the_run_when_rehydrated():
    run = operations.start("ops-chain", {"who": "z"})
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE durability_snapshot SET state = replace(state, '\"z\"', '\"q\"')"
            " WHERE checkpoint_id = %s",
            [Checkpoint.objects.get(run=run, seq=0).pk],
        )
    done = drive(run.id)
    assert done.status == RunStatus.FAILED and done.error_code == "DUR200"
    assert "checkpoint #0 does not verify" in done.error
    assert Event.objects.filter(run=run, kind=EventKind.INTEGRITY).exists()
    assert SENT == []  # nothing ran on a state that does not verify
