"""What the dashboard tests share: named users (an operator, a viewer), a small agent that
checkpoints, performs effects and asks for approval, and helpers to drive it in this process.

Runs are real: started with the engine's operations and executed by the engine in this
process (``durability.testing.drive``), against the test PostgreSQL database."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client

from dashboard.permissions import OPERATORS, VIEWERS
from durability import END, Agent, operations, registry
from durability.models import Approval, Checkpoint, Effect, Event, JournalEntry, Message, Run
from durability.testing import drive

PASSWORD = "correct horse battery staple"
SENT: list[str] = []

HOSTILE_KEY = '<img src=x onerror="window.__pwned=1">'
HOSTILE_VALUES = [
    "<script>window.__pwned=1</script>",
    '<img src=x onerror="window.__pwned=1">',
    "javascript:window.__pwned=1",
]


def send(what: str, *, idempotency_key: str) -> dict:
    SENT.append(idempotency_key)
    return {"sent": what, "key": idempotency_key}


def _gather(state: dict, ctx: Any) -> str:
    answer = ctx.call("llm", _fake_llm, state["question"])
    state["messages"].append({"role": "assistant", "content": answer["text"]})
    state["count"] += 1
    return "pay"


def _fake_llm(question: str) -> dict:
    # Shaped like an OpenAI completion so the engine records model and tokens.
    return {
        "text": f"An answer to: {question}",
        "model": "fake-model",
        "usage": {"prompt_tokens": 12, "completion_tokens": 30},
    }


def _pay(state: dict, ctx: Any) -> str:
    state["receipt"] = ctx.effect("pay", send, "money")
    state["messages"].append({"role": "tool", "content": "paid"})
    state["count"] += 1
    return "confirm"


def _confirm(state: dict, ctx: Any) -> str:
    decision = ctx.approval(
        "ship",
        {"amount_eur": 250.0, "order": "A-1", "api_token": "sk-live-secret", "note": "asap"},
    )
    state["decision"] = {"approved": decision.approved, "by": decision.by}
    state["shipped"] = decision.payload if decision.approved else None
    state["count"] += 1
    return END


SCHEMA = {
    "type": "object",
    "required": ["question", "messages", "count"],
    "properties": {
        "question": {"type": "string"},
        "count": {"type": "integer", "minimum": 0},
        "messages": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    },
}


def register_agents() -> None:
    registry.unregister("dash-chain")
    agent = Agent(
        "dash-chain",
        version="2",
        schema=SCHEMA,
        initial_state=lambda inp: {
            "question": inp.get("question", "why?"),
            "messages": [{"role": "user", "content": inp.get("question", "why?")}],
            "count": 0,
            "api_key": "sk-very-secret",
            **inp.get("extra", {}),
        },
    )
    agent.step(_gather, name="gather", start=True)
    agent.step(_pay, name="pay")
    agent.step(_confirm, name="confirm")


@pytest.fixture(autouse=True)
def dash_agents(settings):
    # WhiteNoise warns (an error here) when the static root is missing; the suite does not
    # run collectstatic, and the pages under test only need it to exist.
    Path(settings.STATIC_ROOT).mkdir(parents=True, exist_ok=True)
    SENT.clear()
    register_agents()
    yield
    registry.unregister("dash-chain")


def make_user(username: str, group: str | None) -> Any:
    users = get_user_model()
    user = users.objects.create_user(username, f"{username}@example.com", PASSWORD)
    if group:
        user.groups.add(Group.objects.get_or_create(name=group)[0])
    return user


@pytest.fixture
def operator(db):
    return make_user("olive", OPERATORS)


@pytest.fixture
def viewer(db):
    return make_user("victor", VIEWERS)


@pytest.fixture
def as_operator(operator) -> Client:
    client = Client()
    client.force_login(operator)
    return client


@pytest.fixture
def as_viewer(viewer) -> Client:
    client = Client()
    client.force_login(viewer)
    return client


def waiting_run(question: str = "What is a fencing token?", **extra: Any) -> Run:
    """A dash-chain run driven to its approval: checkpoints #0-#2, one call, one effect."""
    run = operations.start("dash-chain", {"question": question, **extra}, by="seed")
    return drive(run.id)


def finished_run(question: str = "What is a lease?") -> Run:
    run = waiting_run(question)
    operations.decide(run.id, "ship", approve=True, by="seed")
    return drive(run.id)


def counts() -> dict[str, Any]:
    """Rows the engine keeps, and what an action changes in place; an action that was refused
    must leave them all as they were. Row counts alone would miss a hold set, an effect
    resolved or a run's version bumped without a new row."""
    models = (Run, Checkpoint, Event, Approval, Effect, JournalEntry, Message)
    runs = Run.objects.values_list(
        "id", "status", "wait_reason", "head_seq", "lease_token", "legal_hold"
    )
    return {m.__name__: m.objects.count() for m in models} | {
        "runs": sorted(runs),
        "effects": sorted(Effect.objects.values_list("id", "status")),
        "approvals": sorted(Approval.objects.values_list("id", "status")),
    }


def text_of(response: Any) -> str:
    return response.content.decode()


def csrf_from(html: str) -> str:
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    assert match, "no CSRF token in the form"
    return match.group(1)


def form_token(html: str, prefix: str = "") -> str:
    name = f"{prefix}-token" if prefix else "token"
    match = re.search(rf'name="{name}" value="([^"]+)"', html)
    assert match, f"no one-time token {name!r} in the form"
    return match.group(1)
