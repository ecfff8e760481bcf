"""Approve with edits, checked and kept: the agent names the fields an operator may edit and
their schema, and a check that runs when the decision is recorded; a refused edit records
nothing and the run still waits; an accepted one is kept beside what was asked, listed in
the decision's event, and is what the agent (and every replay of its step) receives."""

from __future__ import annotations

import io
import json
import re

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse
from pydantic import BaseModel

from dashboard import notifications
from dashboard.models import Notification
from durability import Agent, RetryPolicy, Transient, canonical, operations, registry
from durability.approvals import EditRefused
from durability.models import Approval, ApprovalStatus, Event, EventKind, Run, RunStatus
from durability.testing import drive, state_of
from examples.models import OutboxMessage
from tests.dashboard_helpers import as_operator, dash_agents, operator  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)

PRICE = 349.0
ATTEMPTS: list[float] = []


class AmountEdit(BaseModel):
    amount_eur: float


def within_price(asked: dict, edited: dict) -> str | None:
    if not 0 < edited["amount_eur"] <= asked["amount_eur"]:
        return f"amount must be between 0 and {asked['amount_eur']:g} EUR"
    return None


def refund(state, ctx):
    decision = ctx.approval(
        "refund",
        {"order_id": "A-1", "amount_eur": PRICE, "customer": "grace@example.com"},
        editable=AmountEdit,
        validate=within_price,
    )
    ATTEMPTS.append(decision.payload["amount_eur"])
    if len(ATTEMPTS) == 1:
        # One failure after the decision: the retry replays the approval from its record.
        raise Transient("refund service hiccup")
    state["refunded"] = decision.payload["amount_eur"]
    state["payload"] = decision.payload


@pytest.fixture(autouse=True)
def edits_agent():
    ATTEMPTS.clear()
    registry.unregister("x-edits")
    Agent("x-edits", steps=[refund], retry=RetryPolicy(base=0.01, cap=0.05))
    yield
    registry.unregister("x-edits")


def _waiting() -> Run:
    run = operations.start("x-edits", {})
    waiting = drive(run.id)
    assert (waiting.status, waiting.wait_reason) == (RunStatus.WAITING, "approval")
    return waiting


def _nothing_recorded(run: Run) -> None:
    approval = Approval.objects.get(run=run)
    assert approval.status == ApprovalStatus.PENDING and approval.edited_payload == ""
    assert not Event.objects.filter(run=run, kind=EventKind.APPROVAL_DECIDED).exists()
    again = Run.objects.get(pk=run.pk)
    assert (again.status, again.wait_reason) == (RunStatus.WAITING, "approval")


@pytest.mark.smoke
def test_the_editable_schema_is_stored_with_the_approval():
    run = _waiting()
    spec = json.loads(Approval.objects.get(run=run).editable)
    assert spec["properties"]["amount_eur"]["type"] == "number"
    assert spec["x-durability-check"] == "tests.test_approval_edits:within_price"


@pytest.mark.smoke
def test_an_edit_that_fails_the_schema_is_refused_and_nothing_is_recorded():
    run = _waiting()
    with pytest.raises(EditRefused) as refused:
        operations.decide(run.id, "refund", approve=True, by="ops", payload={"amount_eur": "abc"})
    assert refused.value.code == "DUR113" and refused.value.field == "amount_eur"
    assert "'abc' is not of type 'number'" in refused.value.message
    _nothing_recorded(run)


@pytest.mark.smoke
def test_an_edit_the_agents_check_refuses_is_refused_with_its_sentence():
    run = _waiting()
    with pytest.raises(EditRefused) as refused:
        operations.decide(run.id, "refund", approve=True, by="ops", payload={"amount_eur": 500})
    assert refused.value.message == "amount must be between 0 and 349 EUR"
    assert "[DUR113]" in str(refused.value)
    _nothing_recorded(run)
    assert ATTEMPTS == []


@pytest.mark.smoke
def test_a_read_only_field_cannot_be_changed():
    run = _waiting()
    with pytest.raises(EditRefused, match="customer is read-only; the agent lets you edit only"):
        operations.decide(
            run.id,
            "refund",
            approve=True,
            by="ops",
            payload={"amount_eur": 100, "customer": "mallory@example.com"},
        )
    _nothing_recorded(run)


@pytest.mark.smoke
def test_an_accepted_edit_is_kept_beside_what_was_asked_and_replays_as_decided():
    run = _waiting()
    # Only the editable field given: the others keep their asked values.
    operations.decide(run.id, "refund", approve=True, by="ops", payload={"amount_eur": 200})
    approval = Approval.objects.get(run=run)
    assert json.loads(approval.payload)["amount_eur"] == PRICE
    assert json.loads(approval.edited_payload) == {
        "order_id": "A-1",
        "amount_eur": 200,
        "customer": "grace@example.com",
    }
    event = Event.objects.get(run=run, kind=EventKind.APPROVAL_DECIDED)
    assert json.loads(event.data)["changes"] == [
        {"field": "amount_eur", "asked": "349.0", "decided": "200"}
    ]
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    # The step ran twice after the decision (one transient failure): both times the
    # replayed approval returned the edited payload, never the asked one.
    assert ATTEMPTS == [200, 200]
    assert state_of(run.id)["refunded"] == 200


@pytest.mark.smoke
@pytest.mark.parametrize(
    "ref",
    [
        "os:system",
        # Reachable from the agent's module but defined elsewhere: a row names only the
        # agent's own functions.
        "tests.test_approval_edits:json.dumps",
        "tests.test_approval_edits:within_price.__call__",
        "tests.test_approval_edits:missing",
    ],
)
def test_an_unknown_check_refuses_the_edit_and_says_why(ref):
    run = _waiting()
    Approval.objects.filter(run=run).update(
        editable=json.dumps(
            {
                "type": "object",
                "properties": {"amount_eur": {"type": "number"}},
                "x-durability-check": ref,
            }
        )
    )
    with pytest.raises(EditRefused, match="cannot be found among the modules of agent x-edits"):
        operations.decide(run.id, "refund", approve=True, by="ops", payload={"amount_eur": 1})
    _nothing_recorded(run)


@pytest.mark.smoke
def test_a_check_that_is_not_a_module_level_function_is_refused_when_asked():
    def step(state, ctx):
        ctx.approval("go", {"n": 1}, validate=lambda asked, edited: None)

    registry.unregister("x-lambda")
    Agent("x-lambda", steps=[step])
    try:
        run = operations.start("x-lambda", {})
        done = drive(run.id)
    finally:
        registry.unregister("x-lambda")
    assert done.status == RunStatus.FAILED
    assert "validate must be a function defined at the top level of a module" in done.error
    assert not Approval.objects.filter(run=run).exists()


# --- the demo support agent ----------------------------------------------------------------


def _refund_waiting() -> Run:
    run = operations.start(
        "support", {"customer": "grace@example.com", "message": "I want to return order A-1002"}
    )
    waiting = drive(run.id)
    assert waiting.wait_reason == "approval" and waiting.wait_detail == "refund"
    return waiting


@pytest.mark.parametrize("amount", ["abc", -5, 0, 500, True])
def test_the_demo_refuses_an_amount_outside_the_orders_price(amount):
    run = _refund_waiting()
    with pytest.raises(EditRefused):
        operations.decide(run.id, "refund", approve=True, by="ops", payload={"amount_eur": amount})
    _nothing_recorded(run)


def test_the_demo_refunds_the_amount_the_operator_lowered_it_to():
    run = _refund_waiting()
    operations.decide(run.id, "refund", approve=True, by="ops", payload={"amount_eur": 200})
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    refunds = list(
        OutboxMessage.objects.filter(channel="refund").values_list("amount_eur", flat=True)
    )
    assert refunds == [200]


# --- where an operator sees it: the form, inbox, audit log, timeline, CLI, notifications ----


def test_the_form_offers_only_the_editable_field_and_refuses_with_the_agents_sentence(
    as_operator,  # noqa: F811
    settings,
):
    settings.DURABILITY_NOTIFY_EMAIL_TO = ["oncall@example.com"]
    run = _waiting()
    approval = Approval.objects.get(run=run)
    edit = reverse("dashboard:approval", args=[approval.pk])
    page = as_operator.get(edit).content.decode()
    # amount_eur is the stored payload's first key (f0; canonical JSON sorts keys), typed
    # from the schema; the others are shown, not offered.
    assert re.search(r'<input type="number" name="f0" value="349.0" step="any"', page), page
    assert 'name="f1"' not in page and 'name="f2"' not in page
    assert "Read-only" in page and "grace@example.com" in page

    before = _counts()
    # The command line is refused alike: one coded line, exit 2 (bad input).
    with pytest.raises(CommandError) as cli:
        call_command(
            "durability", "approve", str(run.id), "refund", "--payload", '{"amount_eur": 500}'
        )
    assert str(cli.value).startswith("[DUR113] amount must be between 0 and 349 EUR")
    assert cli.value.returncode == 2
    refused = as_operator.post(edit, {"f0": "500", "comment": "too much"})
    assert refused.status_code == 422
    assert "amount must be between 0 and 349 EUR" in refused.content.decode()
    assert _counts() == before
    _nothing_recorded(run)

    done = as_operator.post(edit, {"f0": "200", "comment": "partial refund"})
    assert done.status_code == 302
    shown = "amount_eur 349.0 → 200.0"
    inbox = as_operator.get(reverse("dashboard:approvals")).content.decode()
    assert shown in inbox
    audit = as_operator.get(reverse("dashboard:audit")).content.decode()
    assert shown in audit and "refund approved with edits" in audit
    timeline = as_operator.get(reverse("dashboard:run", args=[run.id])).content.decode()
    assert shown in timeline

    out = io.StringIO()
    call_command("durability", "show", str(run.id), "--json", stdout=out)
    asked = json.loads(out.getvalue())["approvals"][0]
    assert asked["payload"]["amount_eur"] == PRICE and asked["edited_payload"]["amount_eur"] == 200
    assert asked["changes"] == [{"field": "amount_eur", "asked": "349.0", "decided": "200.0"}]
    out = io.StringIO()
    call_command("durability", "show", str(run.id), stdout=out)
    assert f"with edits: {shown}" in out.getvalue()

    assert notifications.collect() >= 1
    note = Notification.objects.get(kind=notifications.APPROVAL_EDITED)
    assert note.subject.endswith(f"approved by olive with edits: {shown}")
    assert json.loads(note.body)["changes"][0]["decided"] == "200.0"


def _counts() -> tuple[int, int, int]:
    return (
        Event.objects.count(),
        Approval.objects.exclude(status=ApprovalStatus.PENDING).count(),
        Approval.objects.exclude(edited_payload="").count(),
    )


def test_the_form_types_each_editable_field_from_its_schema():
    from dashboard.forms import PayloadForm

    schema = {
        "type": "object",
        "properties": {
            "speed": {"enum": ["slow", "fast", 3]},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
            "urgent": {"type": "boolean"},
            "tags": {"anyOf": [{"type": "array"}, {"type": "null"}]},
        },
    }
    payload = {"count": 2, "note": "keep", "speed": "slow", "tags": ["a"], "urgent": False}
    editable = json.dumps(schema)
    form = PayloadForm(payload, editable=editable)
    assert form.read_only == ["note"]
    html = form.as_p()
    assert 'type="number" name="f0" value="2" min="1" max="9"' in html
    assert '<option value="3">3</option>' in html and 'type="checkbox" name="f4"' in html
    posted = PayloadForm(
        payload, {"f0": "4", "f2": "3", "f3": '["a", "b"]', "f4": "on"}, editable=editable
    )
    assert posted.is_valid(), posted.errors
    assert posted.cleaned_data["edited"] == {
        "count": 4,
        "speed": 3,
        "tags": ["a", "b"],
        "urgent": True,
    }


def ask_plainly(state, ctx):
    """An approval with no editable schema, as a LangGraph ``interrupt()`` asks one."""
    decision = ctx.approval("refund", {"order_id": "A-1", "amount_eur": PRICE, "note": None})
    state["payload"] = decision.payload


@pytest.fixture
def plain_agent():
    registry.unregister("x-plain")
    Agent("x-plain", steps=[ask_plainly])
    yield
    registry.unregister("x-plain")


@pytest.mark.smoke
def test_without_a_schema_an_edit_may_give_only_what_it_changes_and_keeps_the_types(plain_agent):
    """Every field is editable, typed by its asked value: a partial edit keeps the rest (it
    replaced the whole payload, so that a graph's node found its other fields missing), and a
    field asked as a number is not approved as text."""
    run = operations.start("x-plain", {})
    assert drive(run.id).wait_reason == "approval"
    for bad, said in (
        ({"amount_eur": "lots"}, "'amount_eur' was asked as a number, so it must stay a number"),
        ({"order_id": 7}, "'order_id' was asked as text, so it must stay text, not a number"),
        (["A-1"], "the payload was asked as an object, so it must stay an object"),
    ):
        with pytest.raises(EditRefused, match=said):
            operations.decide(run.id, "refund", approve=True, by="ops", payload=bad)
        _nothing_recorded(run)
    operations.decide(
        run.id, "refund", approve=True, by="ops", payload={"amount_eur": 50, "note": "partial"}
    )
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED
    assert state_of(done)["payload"] == {"order_id": "A-1", "amount_eur": 50, "note": "partial"}


def test_show_says_what_a_pending_approval_asks():
    run = _waiting()
    out = io.StringIO()
    call_command("durability", "show", str(run.id), stdout=out)
    lines = out.getvalue().splitlines()
    at = lines.index("approvals:")
    assert lines[at + 1].split() == ["refund", "pending"]
    # Field by field, each in full up to a line's worth (a second decision's question and
    # the arguments it would perform now were cut off at 300 characters of the whole).
    assert lines[at + 2] == "    asks:" and lines[at + 3] == "      amount_eur: 349.0", lines
    long = "x" * 500
    Approval.objects.filter(run=run).update(payload=canonical.dumps({"question": long}).decode())
    out = io.StringIO()
    call_command("durability", "show", str(run.id), stdout=out)
    assert f"      question: {long}" in out.getvalue()


def ask_in_words(state, ctx):
    state["approved"] = ctx.approval("go", "refund 349 EUR to order A-1?").approved


def test_the_edit_page_shows_a_question_asked_as_text(as_operator):  # noqa: F811
    """A payload that is not an object (a LangGraph ``interrupt("...")``'s question) is shown
    as it was asked, on the edit page as on the inbox's card."""
    registry.unregister("x-words")
    Agent("x-words", steps=[ask_in_words])
    try:
        run = drive(operations.start("x-words", {}).id)
        approval = Approval.objects.get(run=run)
        page = as_operator.get(reverse("dashboard:approval", args=[approval.pk]))
        asked = page.content.decode().split("As the agent asked</summary>")[1]
        assert "refund 349 EUR to order A-1?" in asked.split("</details>")[0]
    finally:
        registry.unregister("x-words")
