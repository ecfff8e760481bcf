"""A rollback never repays on its own (DESIGN: "A rollback never repays on its own"): it
leaves the run on hold unless told to continue; an effect done on the abandoned branch is
performed again only after a second decision (asked in the inbox, or said per effect in the
rollback); a compensation the agent declared runs as an effect of its own. Counting happens
on the receiving side (a real HTTP server keeping a ledger per idempotency key).

Runs in this process on PostgreSQL and, marked smoke, on the embedded default (SQLite)."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import CommandError, call_command

from dashboard import timeline
from durability import operations, rollbacks
from durability.approvals import EditRefused
from durability.errors import EffectFailed, InvalidInput, InvalidTransition
from durability.models import (
    AbandonedEffect,
    Approval,
    ApprovalStatus,
    Effect,
    EffectStatus,
    Event,
    EventKind,
    Run,
    RunStatus,
)
from durability.testing import drive, state_of

pytestmark = [pytest.mark.smoke, pytest.mark.django_db(transaction=True)]

REPEAT_REFUND = rollbacks.REPEAT_APPROVAL + "refund"
REPEAT_EMAIL = rollbacks.REPEAT_APPROVAL + "email"


@pytest.fixture
def receiver(effects, monkeypatch):
    monkeypatch.setenv("TEST_EFFECT_URL", effects.url)
    return effects


def sent(receiver, prefix: str) -> int:
    """Requests that reached the receiver for effects whose body starts with ``prefix``."""
    return sum(
        receiver.requests[key]
        for key, outcome in receiver.outcomes.items()
        if str(outcome.get("what", "")).startswith(prefix)
    )


@pytest.fixture
def price(tmp_path):
    path = tmp_path / "price"
    path.write_text("349")
    return path


@pytest.fixture
def refunded(receiver, price):
    """A finished refund run: #0 start, #1 amount looked up, #2 refunded, #3 emailed."""
    run = drive(operations.start("test-refund", {"price_file": str(price)}).id)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert (sent(receiver, "refund"), sent(receiver, "email")) == (1, 1)
    return run


def effect(run, key) -> Effect:
    return Effect.objects.filter(run=run, key=key, status=EffectStatus.DONE).order_by("id").first()


def test_a_rollback_leaves_the_run_on_hold_and_continue_runs_it(refunded, receiver):
    result = operations.rollback(refunded.id, 1, by="ann", reason="amount was wrong")
    run = Run.objects.get(pk=refunded.id)
    assert (run.status, run.wait_reason, result.held) == (RunStatus.WAITING, "hold", True)
    assert "rolled back to #1 by ann" in run.wait_detail
    assert drive(run.id).wait_reason == "hold"  # nothing runs by itself
    assert (sent(receiver, "refund"), sent(receiver, "email")) == (1, 1)
    operations.resume(run.id, by="ann", reason="continue")
    waiting = drive(run.id)
    # The new branch reached the refund: it stops and asks before refunding a second time.
    assert (waiting.status, waiting.wait_reason, waiting.wait_detail) == (
        RunStatus.WAITING,
        "approval",
        REPEAT_REFUND,
    )
    assert (sent(receiver, "refund"), sent(receiver, "email")) == (1, 1)


def test_an_effect_the_agent_labelled_is_previewed_and_asked_about_in_its_words(receiver, price):
    run = drive(operations.start("test-refund", {"price_file": str(price), "labelled": True}).id)
    said = operations.plan_rollback(run.id, 0).sentences()
    assert any(s.startswith("refund 349 EUR on order A1 was done") for s in said), said
    price.write_text("200")
    operations.rollback(run.id, 0, by="ann", and_continue=True)
    drive(run.id)
    asked = Approval.objects.get(run=run, name=REPEAT_REFUND, status=ApprovalStatus.PENDING)
    assert operations.canonical.loads(asked.payload)["question"] == (
        "refund 349 EUR on order A1 was done on the abandoned branch;"
        " perform refund 200 EUR on order A1?"
    )
    assert sent(receiver, "refund") == 1


def test_roll_back_and_continue_is_an_explicit_choice(refunded, receiver):
    result = operations.rollback(refunded.id, 1, by="ann", and_continue=True)
    assert not result.held and Run.objects.get(pk=refunded.id).status == RunStatus.QUEUED
    assert drive(refunded.id).wait_detail == REPEAT_REFUND
    assert sent(receiver, "refund") == 1


def test_approving_the_second_decision_performs_it_once_with_a_new_key(refunded, receiver, price):
    price.write_text("200")
    operations.rollback(refunded.id, 0, by="ann", and_continue=True)
    drive(refunded.id)
    asked = Approval.objects.get(run=refunded, name=REPEAT_REFUND, status=ApprovalStatus.PENDING)
    payload = operations.canonical.loads(asked.payload)
    # Both argument sets side by side, and the question in the customer's terms.
    assert payload["question"] == (
        "refund (A1, 349) was done on the abandoned branch; perform refund (A1, 200)?"
    )
    assert payload["done on the abandoned branch"]["arguments"] == [["A1", 349.0], {}]
    assert payload["to perform now"]["arguments"] == [["A1", 200.0], {}]
    operations.decide(refunded.id, name=REPEAT_REFUND, approve=True, by="bob")
    assert drive(refunded.id).wait_detail == REPEAT_EMAIL  # the email is asked about too
    operations.decide(refunded.id, name=REPEAT_EMAIL, approve=True, by="bob")
    assert drive(refunded.id).status == RunStatus.SUCCEEDED
    # Exactly one more of each, under new idempotency keys.
    assert (sent(receiver, "refund"), sent(receiver, "email")) == (2, 2)
    assert set(receiver.requests.values()) == {1}
    assert state_of(refunded.id)["amount"] == 200.0


def test_the_second_decision_is_approved_as_asked_never_edited(refunded, receiver, price):
    """What it performs is what it shows: an edit would be recorded and not performed."""
    price.write_text("200")
    operations.rollback(refunded.id, 0, by="ann", and_continue=True)
    drive(refunded.id)
    asked = Approval.objects.get(run=refunded, name=REPEAT_REFUND, status=ApprovalStatus.PENDING)
    assert not asked.takes_edits
    edit = {"to perform now": {"arguments": [["A1", 5000.0], {}]}}
    with pytest.raises(EditRefused, match="cannot be edited: approve it as asked, or reject"):
        operations.decide(refunded.id, name=REPEAT_REFUND, approve=True, by="bob", payload=edit)
    asked.refresh_from_db()
    assert asked.status == ApprovalStatus.PENDING and not asked.edited_payload
    # Sent back unchanged, it is no edit.
    same = operations.canonical.loads(asked.payload)
    operations.decide(refunded.id, name=REPEAT_REFUND, approve=True, by="bob", payload=same)
    asked.refresh_from_db()
    assert asked.status == ApprovalStatus.APPROVED and not asked.edited_payload


def test_rejecting_the_second_decision_fails_the_run_and_performs_nothing(refunded, receiver):
    operations.rollback(refunded.id, 1, by="ann", and_continue=True)
    drive(refunded.id)
    operations.decide(
        refunded.id, name=REPEAT_REFUND, approve=False, by="bob", comment="already refunded"
    )
    run = drive(refunded.id)
    assert run.status == RunStatus.FAILED
    assert run.error_code == EffectFailed.code
    assert "'refund' was not performed again: bob rejected" in run.error
    assert "already refunded" in run.error
    assert sent(receiver, "refund") == 1


def test_a_second_rollback_before_the_decision_still_asks(refunded, receiver):
    """The first rollback's question was left pending (or its run left on hold) and the run
    rolled back again: the email the first branch sent is no longer on the path being left,
    but it is still done and still undecided, so it is listed (and asked about) again."""
    refund = effect(refunded, "refund")
    operations.rollback(refunded.id, 1, by="ann", and_continue=True)
    assert drive(refunded.id).wait_detail == REPEAT_REFUND
    plan = operations.plan_rollback(refunded.id, 1)
    assert [e.id for e in plan.done_not_undone] == [refund.pk, effect(refunded, "email").pk]
    operations.rollback(refunded.id, 1, by="ann")  # on hold
    operations.rollback(refunded.id, 1, by="ann", and_continue=True)  # again, from the hold
    run = drive(refunded.id)
    assert run.wait_detail == REPEAT_REFUND
    asked = Approval.objects.get(run=refunded, name=REPEAT_REFUND, status=ApprovalStatus.PENDING)
    assert refund.idempotency_key in asked.payload
    assert sent(receiver, "refund") == 1


def test_reuse_with_the_same_arguments_returns_the_recorded_outcome(refunded, receiver):
    before = state_of(refunded.id)["refunds"][0]
    refund, email = effect(refunded, "refund"), effect(refunded, "email")
    operations.rollback(
        refunded.id,
        1,
        by="ann",
        and_continue=True,
        decisions={refund.pk: "reuse", email.pk: "reuse"},
    )
    assert drive(refunded.id).status == RunStatus.SUCCEEDED
    assert (sent(receiver, "refund"), sent(receiver, "email")) == (1, 1)
    assert state_of(refunded.id)["refunds"] == [before]
    reused = Effect.objects.filter(run=refunded, resolution_note__startswith="reused").count()
    assert reused == 2
    assert Event.objects.filter(run=refunded, kind=EventKind.EFFECT_REUSED).count() == 2


def test_reuse_with_other_arguments_is_refused_and_asked_instead(refunded, receiver, price):
    price.write_text("200")
    refund = effect(refunded, "refund")
    operations.rollback(refunded.id, 0, by="ann", and_continue=True, decisions={refund.pk: "reuse"})
    run = drive(refunded.id)
    assert run.wait_detail == REPEAT_REFUND
    asked = Approval.objects.get(run=refunded, name=REPEAT_REFUND, status=ApprovalStatus.PENDING)
    assert "the arguments differ" in asked.payload
    assert sent(receiver, "refund") == 1


def test_perform_again_does_not_ask(refunded, receiver):
    refund, email = effect(refunded, "refund"), effect(refunded, "email")
    operations.rollback(
        refunded.id, 1, and_continue=True, decisions={refund.pk: "again", email.pk: "again"}
    )
    assert drive(refunded.id).status == RunStatus.SUCCEEDED
    assert (sent(receiver, "refund"), sent(receiver, "email")) == (2, 2)


def test_a_ticked_compensation_runs_once_before_the_run_continues(refunded, receiver):
    refund = effect(refunded, "refund")
    plan = operations.plan_rollback(refunded.id, 1)
    done = {e.key: e for e in plan.done_not_undone}
    assert done["refund"].can_compensate and not done["email"].can_compensate
    operations.rollback(refunded.id, 1, by="ann", decisions={refund.pk: "compensate"})
    assert sent(receiver, "reverse") == 0  # on hold: nothing runs yet
    # Continuing says, before the click, that it compensates first.
    from dashboard import runinfo

    held = Run.objects.get(pk=refunded.id)
    assert runinfo.to_compensate(held) == ["refund (A1, 349), by reverse_refund"]
    operations.resume(refunded.id, by="ann")
    run = drive(refunded.id)
    assert sent(receiver, "reverse") == 1
    compensation = Effect.objects.get(run=refunded, key=f"__compensate__:{refund.pk}")
    assert compensation.status == EffectStatus.DONE
    assert receiver.requests[compensation.idempotency_key] == 1
    event = Event.objects.get(run=refunded, kind=EventKind.COMPENSATED)
    assert event.reason == "refund (A1, 349) undone"
    # The operator who chose it at the rollback: the audit log's row is theirs.
    assert event.actor == "ann"
    rolled = Event.objects.get(run=refunded, kind=EventKind.ROLLBACK)
    facts = dict(timeline._event_item(rolled).facts)
    assert facts["to compensate before it continues"] == "refund"
    # On the run's timeline, with what undid it.
    items = timeline.latest(Run.objects.get(pk=refunded.id)).items
    shown = [i for i in items if i.kind == event.kind]
    assert [(i.title, i.detail) for i in shown] == [
        ("effect refund compensated", "refund (A1, 349) undone")
    ]
    assert ("by", "reverse_refund") in shown[0].facts
    # Compensated, the refund is performed again without asking; the email is asked about.
    assert run.wait_detail == REPEAT_EMAIL
    assert sent(receiver, "refund") == 2
    # A second rollback offers no second compensation of the same refund.
    again = operations.plan_rollback(refunded.id, 1)
    first = next(e for e in again.done_not_undone if e.id == refund.pk)
    assert first.compensated and not first.can_compensate
    # The compensation itself is listed as done, with nothing to decide for it.
    undo = next(e for e in again.done_not_undone if e.is_compensation)
    assert f"the compensation of effect {refund.pk} was done and will not be undone" in (
        " ".join(again.sentences())
    )
    with pytest.raises(InvalidInput, match="is not reached again"):
        operations.rollback(refunded.id, 1, decisions={undo.id: "again"})


def test_a_cancel_before_the_compensation_ran_says_it_is_owed(refunded, receiver):
    """Cancelled on hold, before it continued: the compensation the rollback chose did not
    run. The CLI's cancel and show say so, and a resume performs it first."""
    refund = effect(refunded, "refund")
    operations.rollback(refunded.id, 1, by="ann", decisions={refund.pk: "compensate"})

    def cli(*args: str) -> str:
        out = io.StringIO()
        call_command("durability", *args, stdout=out)
        return out.getvalue()

    said = cli("--reason", "customer left", "cancel", str(refunded.id))
    owed = "refund (A1, 349), by reverse_refund"
    assert f"not performed: the compensation chosen at its rollback ({owed})" in said
    assert "resuming the run performs it first" in said
    assert f"compensations owed (its next step performs them first): {owed}" in cli(
        "show", str(refunded.id)
    )
    assert sent(receiver, "reverse") == 0
    operations.resume(refunded.id, by="ann")
    drive(refunded.id)
    assert sent(receiver, "reverse") == 1
    assert "compensations owed" not in cli("show", str(refunded.id))


def test_two_choices_for_one_effect_on_the_command_line_are_refused(refunded):
    refund = effect(refunded, "refund")
    head = Run.objects.get(pk=refunded.id).head_seq
    with pytest.raises(CommandError) as refused:
        call_command(
            "durability",
            "rollback",
            str(refunded.id),
            "--to",
            "1",
            "--effect",
            f"{refund.pk}=compensate",
            "--effect",
            "refund=again",
        )
    assert f"effect {refund.pk} was given 'compensate' already" in str(refused.value)
    assert Run.objects.get(pk=refunded.id).head_seq == head  # nothing rolled back


def test_decisions_that_do_not_fit_are_refused_and_change_nothing(refunded):
    email = effect(refunded, "email")
    head = Run.objects.get(pk=refunded.id).head_seq
    for decisions, words in [
        ({email.pk: "compensate"}, "the agent declared no compensation"),
        ({email.pk: "forget"}, "must be one of ask, reuse, again, compensate"),
        ({999999: "again"}, "was not done on the branch this rollback abandons"),
    ]:
        with pytest.raises(InvalidInput, match=words):
            operations.rollback(refunded.id, 1, decisions=decisions)
        assert Run.objects.get(pk=refunded.id).head_seq == head
        assert not AbandonedEffect.objects.exists()


def test_resume_refuses_runs_that_wake_by_themselves(receiver, llm, monkeypatch):
    monkeypatch.setenv("TEST_LLM_URL", llm.url)
    listening = drive(operations.start("test-chat", {}).id)
    assert listening.wait_reason == "message"
    with pytest.raises(InvalidTransition, match="waits for a message"):
        operations.resume(listening.id, by="ann")
    asking = drive(operations.start("test-loop", {"n": 2, "approve_at": 0}).id)
    assert asking.wait_reason == "approval"
    with pytest.raises(InvalidTransition, match="waits for an approval"):
        operations.resume(asking.id, by="ann")


def test_the_preview_says_in_words_what_will_happen(refunded):
    refund = effect(refunded, "refund")
    plan = operations.plan_rollback(refunded.id, 1)
    said = plan.sentences({refund.pk: "compensate"})
    assert said[0].startswith("The run goes back to checkpoint #1 (after step look) and is put")
    assert any("refund (A1, 349), undone by reverse_refund" in s for s in said)
    assert any(
        s.startswith("email (email about 349 EUR) was done and will not be undone (it cannot be")
        and "it stops and asks an operator before doing it a second time" in s
        for s in said
    )
    default = plan.sentences()
    assert any("(it can be compensated: choose compensate)" in s for s in default)
    assert "continues at once with step pay" in plan.sentences(hold=False)[0]
    # The CLI prints the same sentences.
    out = io.StringIO()
    call_command("durability", "rollback", str(refunded.id), "--to", "1", "--dry-run", stdout=out)
    for sentence in default:
        assert sentence in out.getvalue()


def test_roll_back_points_first_at_the_checkpoint_before_the_last_effect(refunded):
    # The email (the last effect) was sent by the step that started from #2.
    assert rollbacks.default_target(Run.objects.get(pk=refunded.id)) == 2


def test_a_compensation_is_only_found_in_the_agents_own_modules():
    from durability.agents import registry

    agent = registry.get("test-refund")
    assert rollbacks.compensation(agent, "tests.agents.reverse_refund").__name__ == (
        "reverse_refund"
    )
    with pytest.raises(LookupError, match="not in agent test-refund's own modules"):
        rollbacks.compensation(agent, "os.system")
    with pytest.raises(ValueError, match="top level of a module"):
        rollbacks.compensation_name(lambda *a, **k: None)


def test_show_says_which_decided_approvals_a_rollback_abandoned():
    """``durability show`` lists every approval of the run; one asked on a branch a rollback
    abandoned is said to decide nothing now (text), ``on_current_branch`` false (JSON), while
    the one asked again on the current branch is not. Checkpoints name their parents by
    number."""
    from durability import Agent, registry

    def prepare(state, ctx):
        state["ready"] = True

    def ask(state, ctx):
        state["approved"] = ctx.approval("go", {"amount": 5}).approved

    registry.unregister("show-branches")
    Agent("show-branches", steps=[prepare, ask])
    try:
        run = drive(operations.start("show-branches", {}).id)
        assert run.wait_reason == "approval"
        operations.decide(run.id, "go", approve=True, by="ann")
        assert drive(run.id).status == RunStatus.SUCCEEDED
        operations.rollback(run.id, 0, by="ann", reason="again", and_continue=True)
        run = drive(run.id)
        assert run.wait_reason == "approval"  # asked again, on the new branch

        def show(*extra: str) -> str:
            out = io.StringIO()
            call_command("durability", "show", str(run.id), *extra, stdout=out)
            return out.getvalue()

        text = show()
        first, again = text.split("approvals:")[1].split("\n  go")[1:3]
        assert "approved" in first and "decides nothing now" in first
        assert "pending" in again and "decides nothing now" not in again
        # Parents by number, as the API says them: the rollback's checkpoint #3 on #0.
        cps = json.loads(show("--json"))["checkpoints"]
        assert [(c["seq"], c["parent"]) for c in cps] == [(0, None), (1, 0), (2, 1), (3, 0), (4, 3)]
        assert "(parent #0)" in text
        shown = json.loads(show("--json"))["approvals"]
        assert [(a["status"], a["on_current_branch"]) for a in shown] == [
            ("approved", False),
            ("pending", True),
        ]
    finally:
        registry.unregister("show-branches")
