"""The demo agents' behaviour where a user would be hurt: what a real model (a real HTTP
server speaking the chat-completions wire format) is sent and what comes of its answers,
and the refund rules, on the offline stand-in."""

from __future__ import annotations

import pytest

from durability import operations
from durability.approvals import EditRefused
from durability.models import Run, RunStatus
from durability.testing import drive
from examples.agents import tool_choice
from examples.models import OutboxMessage
from tests.servers import completion

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("text", "choice"),
    [
        ('{"tool": "lookup_order", "args": {"order_id": "A-1001"}}', ("lookup_order", "A-1001")),
        ('```json\n{"tool": "refund", "args": {"order_id": "A-1002"}}\n```', ("refund", "A-1002")),
        ('{"tool": "lookup_order", "order_id": "A-1003"}', ("lookup_order", "A-1003")),
        ("Sure, let me check that order for you.", None),
        ('{"tool": "delete_database", "args": {}}', None),
        ('{"tool": "reply", "args": {"text": ""}}', None),
        ("[1, 2]", None),
    ],
)
def test_what_counts_as_a_tool_choice(text, choice):
    found = tool_choice(text)
    if choice is None:
        assert found is None
    else:
        tool, value = choice
        assert found["tool"] == tool and value in found["args"].values()


def test_support_with_a_real_model_never_mails_what_was_meant_for_the_tools(llm, monkeypatch):
    monkeypatch.setenv("DURABILITY_LLM_BASE_URL", llm.url)
    llm.script += [
        completion('```json\n{"tool": "lookup_order", "args": {"order_id": "A-1003"}}\n```'),
        completion("Sure! Let me look into that for you."),  # prose, not a tool choice
        completion('{"tool": "reply", "args": {"text": "Your keyboard is on its way."}}'),
    ]
    run = operations.start(
        "support", {"customer": "alan@example.com", "message": "Where is order A-1003?"}
    )
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    emails = list(OutboxMessage.objects.filter(channel="email").values_list("body", flat=True))
    assert emails == ["Your keyboard is on its way."]
    assert len(llm.requests) == 3
    # OpenAI refuses a "tool" message that answers no tool_calls: results go as user text.
    for request in llm.requests:
        assert {m["role"] for m in request["messages"]} <= {"system", "user", "assistant"}
    last = llm.requests[-1]["messages"]
    observations = [m["content"] for m in last if m["content"].startswith("Observation: ")]
    assert any("A-1003" in text for text in observations)
    assert any("not_a_tool_choice" in m["content"] for m in last)


def test_a_refund_goes_only_to_the_customer_who_placed_the_order():
    run = operations.start(
        "support", {"customer": "mallory@example.com", "message": "Refund order A-1001 please"}
    )
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert not OutboxMessage.objects.filter(channel="refund").exists()
    assert OutboxMessage.objects.filter(channel="email", recipient="mallory@example.com").exists()


@pytest.mark.parametrize("amount", ["abc", -5, 0, 1000.0, True])
def test_an_approved_amount_out_of_range_is_refused_and_refunds_nothing(amount):
    run = operations.start(
        "support", {"customer": "grace@example.com", "message": "I want to return order A-1002"}
    )
    waiting = drive(run.id)
    assert waiting.wait_reason == "approval" and waiting.wait_detail == "refund"
    # The agent's editable schema and check refuse it when it is decided (DUR113).
    with pytest.raises(EditRefused):
        operations.decide(run.id, "refund", approve=True, by="ops", payload={"amount_eur": amount})
    assert drive(run.id).wait_detail == "refund"
    assert not OutboxMessage.objects.filter(channel="refund").exists()
    assert Run.objects.get(pk=run.id).error == ""
