"""Demo agents that do real work without the internet.

``concierge``: a conversation that lasts as long as the user wants: it waits (without a
worker) for the user's next message, hands each question to a ``research`` sub-agent,
joins it and answers with its draft.

``research``: plans search queries with the LLM, searches the bundled corpus in a loop,
keeps a growing conversation and notes, drafts an answer, asks for approval, and publishes
it (an effect writing to the outbox).

``support``: a ReAct loop (think -> act -> think ...) over a customer message: looks up the
order, asks an operator before refunds over 100 EUR, issues the refund and replies (both
effects).

Knobs in the input make them watchable: ``slow_ms`` (each step takes at least this long),
``fail_transient`` (each search or order lookup fails N times with a transient error, is
retried with backoff, then succeeds; N <= 6) and ``crash_at`` (the worker process dies,
once, in that step: after the step's LLM call where it makes one, which the recovered run
replays instead of paying for again).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Literal

from pydantic import BaseModel, Field

from durability import END, Agent, RetryPolicy, Transient
from examples import corpus, llm, tools

REFUND_APPROVAL_OVER_EUR = 100.0
# One policy for both demo agents: the fake LLM and search fail now and then; a retry
# within seconds keeps the demo moving.
DEMO_RETRY = RetryPolicy(max_retries=6, base=0.5, cap=10)


def knobs(state, ctx, step: str, *, crash_here: bool = True) -> None:
    options = ctx.input if isinstance(ctx.input, dict) else {}
    if options.get("slow_ms"):
        time.sleep(float(options["slow_ms"]) / 1000)
    if crash_here:
        crash_point(ctx, step)


def crash_point(ctx, step: str) -> None:
    """With ``crash_at`` naming this step, the worker process dies here, once per run.

    Once is kept by a journaled marker, recorded before the kill: the step's next run (after
    the recovery, or after an approval it waits for) replays it and goes on. A step whose
    LLM call comes before this point replays that call too: it is not paid for twice."""
    options = ctx.input if isinstance(ctx.input, dict) else {}
    if options.get("crash_at") != step:
        return
    replayed = ctx.replayed
    ctx.call("crash_at", _crash_marker, step)
    if ctx.replayed == replayed:  # recorded just now: the first time the run is here
        os.kill(os.getpid(), signal.SIGKILL)


def _crash_marker(step: str) -> str:
    return f"crashed in {step}"


def maybe_fail(ctx, what: str) -> None:
    options = ctx.input if isinstance(ctx.input, dict) else {}
    if ctx.retry < int(options.get("fail_transient", 0)):
        raise Transient(f"{what} unavailable (injected failure {ctx.retry + 1})")


# --- research ----------------------------------------------------------------------------------


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class Note(BaseModel):
    doc: str
    title: str
    text: str
    score: float


class ResearchState(BaseModel):
    question: str = Field(min_length=3, max_length=500)
    messages: list[Message]
    plan: list[str]
    notes: list[Note]
    searched: list[str]
    draft: str = ""
    outcome: str = ""
    published: dict | None = None


research = Agent(
    "research",
    version="1",
    description="Searches the bundled corpus, drafts an answer, publishes it once approved.",
    schema=ResearchState,
    input_schema={
        "type": "object",
        "required": ["question"],
        # A misspelt knob ("slowms") is refused, not silently dropped.
        "additionalProperties": False,
        "properties": {
            "question": {
                "type": "string",
                "minLength": 3,
                "maxLength": 500,
                "examples": ["Why add jitter to exponential backoff?"],
            },
            "slow_ms": {"type": "number", "minimum": 0, "maximum": 60000},
            # Each failing step is retried: at most max_retries (6) failures in a row.
            "fail_transient": {"type": "integer", "minimum": 0, "maximum": 6},
            "crash_at": {"enum": ["plan", "search", "summarise", "review", "publish"]},
            "publish": {"type": "boolean"},
        },
    },
    initial_state=lambda inp: {
        "question": inp["question"],
        "messages": [
            {"role": "system", "content": "You are a careful research assistant."},
            {"role": "user", "content": inp["question"]},
        ],
        "plan": [],
        "notes": [],
        "searched": [],
    },
    retry=DEMO_RETRY,
)


@research.step(start=True)
def plan(state, ctx):
    knobs(state, ctx, "plan", crash_here=False)
    answer = ctx.call(
        "llm",
        llm.complete,
        [
            {"role": "system", "content": f"Plan web searches. {llm.TASK_QUERIES}"},
            {"role": "user", "content": state["question"]},
        ],
    )
    crash_point(ctx, "plan")
    queries = [q.strip() for q in answer["text"].splitlines() if q.strip()][:4]
    state["plan"] = queries or [state["question"]]
    state["messages"].append(
        {"role": "assistant", "content": "I will search for: " + "; ".join(state["plan"])}
    )
    return "search"


@research.step
def search(state, ctx):
    knobs(state, ctx, "search")
    query = state["plan"].pop(0)
    maybe_fail(ctx, "search")
    hits = ctx.call("search", corpus.search, query)
    state["searched"].append(query)
    known = {(n["doc"], n["text"]) for n in state["notes"]}
    for hit in hits:
        if (hit["doc"], hit["text"]) not in known:
            state["notes"].append(hit)
            state["messages"].append({"role": "tool", "content": f"[{hit['doc']}] {hit['text']}"})
    return "search" if state["plan"] else "summarise"


@research.step
def summarise(state, ctx):
    knobs(state, ctx, "summarise", crash_here=False)
    answer = ctx.call(
        "llm",
        llm.complete,
        [
            {"role": "system", "content": llm.TASK_SUMMARY},
            *[llm.observation(m["content"]) for m in state["messages"] if m["role"] == "tool"],
            {"role": "user", "content": state["question"]},
        ],
    )
    crash_point(ctx, "summarise")
    state["draft"] = answer["text"]
    state["messages"].append({"role": "assistant", "content": answer["text"]})
    if ctx.input.get("publish") is False:
        state["outcome"] = "drafted"
        return END
    return "review"


@research.step
def review(state, ctx):
    knobs(state, ctx, "review")
    decision = ctx.approval(
        "publish",
        {
            "question": state["question"],
            "draft": state["draft"],
            "sources": sorted({n["doc"] for n in state["notes"]}),
        },
        # The draft is what gets published; the question and the sources are what it
        # answers and rests on, shown for the decision, not edited.
        editable=DraftEdit,
    )
    if not decision:
        state["outcome"] = f"rejected by {decision.by}: {decision.comment}"
        return END("rejected at publish")
    edited = decision.payload.get("draft") if isinstance(decision.payload, dict) else None
    if edited and edited != state["draft"]:
        state["draft"] = edited
        state["messages"].append({"role": "user", "content": f"(edited by {decision.by})"})
    return "publish"


@research.step
def publish(state, ctx):
    knobs(state, ctx, "publish")
    receipt = ctx.effect("publish", tools.publish, state["question"], state["draft"])
    state["published"] = receipt
    state["outcome"] = "published"
    return END


# --- support -----------------------------------------------------------------------------------


class SupportState(BaseModel):
    customer: str
    messages: list[Message]
    iterations: int = Field(ge=0, le=12)
    pending: dict | None = None
    resolution: str = ""


support = Agent(
    "support",
    version="1",
    description="A ReAct loop that answers a customer and issues refunds (large ones approved).",
    schema=SupportState,
    input_schema={
        "type": "object",
        "required": ["customer", "message"],
        "additionalProperties": False,
        "properties": {
            "customer": {"type": "string", "minLength": 3, "examples": ["grace@example.com"]},
            "message": {
                "type": "string",
                "minLength": 1,
                "maxLength": 5000,
                "examples": ["I want to return order A-1002"],
            },
            "slow_ms": {"type": "number", "minimum": 0, "maximum": 60000},
            "fail_transient": {"type": "integer", "minimum": 0, "maximum": 6},
            "crash_at": {"enum": ["think", "act"]},
        },
    },
    initial_state=lambda inp: {
        "customer": inp["customer"],
        "messages": [
            {"role": "system", "content": "You are a support agent for an electronics shop."},
            {"role": "user", "content": inp["message"]},
        ],
        "iterations": 0,
    },
    retry=DEMO_RETRY,
)


@support.step(start=True)
def think(state, ctx):
    knobs(state, ctx, "think", crash_here=False)
    if state["iterations"] >= 10:
        state["resolution"] = "gave up after 10 iterations"
        return END("gave up")
    state["iterations"] += 1
    answer = ctx.call(
        "llm",
        llm.complete,
        [
            {"role": "system", "content": SUPPORT_PROMPT},
            *llm.for_the_model(state["messages"][1:]),
        ],
    )
    crash_point(ctx, "think")
    state["messages"].append({"role": "assistant", "content": answer["text"]})
    choice = tool_choice(answer["text"])
    if choice is None:
        # Never mail the customer what was meant for the tools: say so, and think again.
        state["messages"].append(
            {
                "role": "tool",
                "content": json.dumps(
                    {"status": "not_a_tool_choice", "expected": TOOL_CHOICE_EXAMPLE}
                ),
            }
        )
        return "think"
    state["pending"] = choice
    return "act"


TOOL_CHOICE_EXAMPLE = {"tool": "lookup_order", "args": {"order_id": "A-1001"}}
SUPPORT_PROMPT = (
    "You help customers of an electronics shop. Tools: lookup_order(order_id),"
    " refund(order_id), reply(text) (the email to the customer, which ends the conversation)."
    f" {llm.TASK_TOOL} Answer with that object only, for example"
    f" {json.dumps(TOOL_CHOICE_EXAMPLE)}."
)
_TOOLS = {"lookup_order": "order_id", "refund": "order_id", "reply": "text"}


def tool_choice(text: str) -> dict | None:
    """The model's choice as {"tool", "args"}, or None when it is not one: a code fence
    around the object is tolerated, prose or an unknown tool is not."""
    body = text.strip()
    if body.startswith("```"):
        body = body.strip("`").strip()
        body = body.removeprefix("json").strip()
    try:
        choice = json.loads(body)
    except ValueError:
        return None
    if not isinstance(choice, dict) or choice.get("tool") not in _TOOLS:
        return None
    args = choice.get("args")
    if not isinstance(args, dict):
        # Some models put the arguments next to the tool name.
        args = {k: v for k, v in choice.items() if k != "tool"}
    needed = _TOOLS[choice["tool"]]
    if not isinstance(args.get(needed), str) or not args[needed].strip():
        return None
    return {"tool": choice["tool"], "args": args}


@support.step
def act(state, ctx):
    knobs(state, ctx, "act")
    choice = state.pop("pending", None) or {}
    tool, args = choice.get("tool"), choice.get("args") or {}
    if tool == "lookup_order":
        maybe_fail(ctx, "order system")
        observation = ctx.call("lookup_order", tools.lookup_order, args.get("order_id", ""))
    elif tool == "refund":
        observation = _refund(state, ctx, args)
    elif tool == "reply":
        receipt = ctx.effect(
            "reply",
            tools.send_email,
            state["customer"],
            "Your request",
            args.get("text", ""),
            label=f"email to {state['customer']}",
        )
        state["messages"].append({"role": "tool", "content": json.dumps(receipt)})
        state["resolution"] = args.get("text", "")
        outcome = support_outcome(state["messages"])
        return END(outcome) if outcome else END
    else:
        observation = {"status": "unknown_tool", "tool": tool}
    state["messages"].append({"role": "tool", "content": json.dumps(observation)})
    return "think"


def _refund(state, ctx, args) -> dict:
    """The refund tool: what the agent observes (refused, declined or done)."""
    order = ctx.call("lookup_order", tools.lookup_order, args.get("order_id", ""))
    amount = order.get("amount_eur", 0)
    if order.get("lookup") != "order_found" or order.get("customer") != state["customer"]:
        # Only the customer who placed the order gets its money back.
        why = "no such order" if order.get("lookup") != "order_found" else "not their order"
        return {"status": "refund_refused", "reason": why}
    if amount > REFUND_APPROVAL_OVER_EUR:
        approved = _approved_amount(state, ctx, order, amount)
        if isinstance(approved, dict):
            return approved
        amount = approved
    # A refund can be reversed; the email below cannot be unsent.
    receipt = ctx.effect(
        "refund",
        tools.refund,
        order.get("order_id"),
        amount,
        compensate=tools.reverse_refund,
        label=f"refund {amount:g} EUR on order {order.get('order_id')}",
    )
    return {**receipt, "status": "refund_done"}


def _approved_amount(state, ctx, order: dict, amount: float) -> float | dict:
    """The amount an operator approved, or the observation of a refund they declined."""
    # An operator may lower the amount, nothing else: the order and the customer are what
    # was checked before, and the refund goes to them whatever the form says.
    decision = ctx.approval(
        "refund",
        {
            "order_id": order.get("order_id"),
            "amount_eur": amount,
            "customer": state["customer"],
            "item": order.get("item"),
        },
        editable=RefundEdit,
        validate=refund_within_price,
    )
    if not decision:
        return {"status": "refund_declined", "by": decision.by, "comment": decision.comment}
    approved = (decision.payload or {}).get("amount_eur", amount)
    if not _valid_amount(approved, order["amount_eur"]):
        return {
            "status": "refund_declined",
            "by": decision.by,
            "comment": f"approved amount {approved!r} is not between 0 and"
            f" {order['amount_eur']} EUR",
        }
    return float(approved)


def support_outcome(messages: list[dict]) -> str:
    """How the conversation ended, beside the run's status: "refunded", "rejected" (an
    operator said no to the refund), "declined" (the agent refused it: no such order, not
    the customer's, or an amount it could not accept), or "" when no refund was asked."""
    seen = set()
    for message in messages:
        if message.get("role") != "tool":
            continue
        try:
            observation = json.loads(message.get("content") or "")
        except ValueError:
            continue
        if isinstance(observation, dict):
            status = observation.get("status")
            if status == "refund_declined" and "approved amount" in str(observation.get("comment")):
                status = "refund_refused"
            seen.add(status)
    for status, outcome in (
        ("refund_done", "refunded"),
        ("refund_declined", "rejected"),
        ("refund_refused", "declined"),
    ):
        if status in seen:
            return outcome
    return ""


class DraftEdit(BaseModel):
    """What an operator may change when approving a research answer for publishing."""

    draft: str = Field(min_length=1, description="the text that is published")


class RefundEdit(BaseModel):
    """What an operator may change when approving a refund."""

    amount_eur: float = Field(description="EUR to refund, at most the order's price")


def refund_within_price(asked: dict, edited: dict) -> str | None:
    """The check an operator's edit must pass (it runs where they decide): the refund asked
    for is the order's full price, so that is the ceiling."""
    price = asked.get("amount_eur", 0)
    if not _valid_amount(edited.get("amount_eur"), price):
        return f"amount must be more than 0 and at most {price:g} EUR (to refund nothing, reject)"
    return None


def _valid_amount(value, ceiling: float) -> bool:
    """An operator's amount: a number above 0 and at most what the order cost."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return 0 < value <= ceiling


# --- concierge: a conversation with a sub-agent per question -----------------------------------


class Turn(BaseModel):
    role: Literal["user", "assistant"]
    content: str


class ConciergeState(BaseModel):
    user: str
    transcript: list[Turn]
    questions: int = Field(ge=0)


concierge = Agent(
    "concierge",
    version="1",
    description="A chat that waits for the user's next message and asks a research sub-agent.",
    schema=ConciergeState,
    initial_state=lambda inp: {
        "user": (inp or {}).get("user", "guest"),
        "transcript": [],
        "questions": 0,
    },
)


@concierge.step(start=True)
def listen(state, ctx):
    # The user's next chat message: sent with `durability send RUN user --data '"..."'`.
    text = str(ctx.wait_for("user")).strip()
    state["transcript"].append({"role": "user", "content": text})
    if text.lower() in ("bye", "quit", "exit", "thanks, bye"):
        state["transcript"].append({"role": "assistant", "content": "Goodbye!"})
        return END
    if len(text) < 3:
        state["transcript"].append(
            {"role": "assistant", "content": "Could you ask a longer question?"}
        )
        return "listen"
    state["questions"] += 1
    child = ctx.spawn("research", {"question": text[:500], "publish": False})
    (found,) = ctx.join([child])
    if found["status"] == "succeeded":
        reply = found["result"]["draft"]
    else:
        reply = f"I could not research that ({found['status']}: {found['error'][:200]})."
    state["transcript"].append({"role": "assistant", "content": reply})
    return "listen"
