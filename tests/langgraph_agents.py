"""LangGraph graphs registered as agents, for the tests of graphs executed by the workers
(loaded by the workers through ``DURABILITY_AGENT_MODULES``).

``lg-support`` is a ReAct-shaped loop whose tool calls are journaled: each turn the model
asks for a search, and a parallel ``audit`` branch logs the turn, each through a tool wrapped
with ``journaled``. Every time a tool is really executed it appends a line to the ledger
file named by ``LG_TOOL_LEDGER`` (the run, the tool, its argument, the time): the count of
what was paid, kept outside any process that may be killed."""

from __future__ import annotations

import operator
import os
import time
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langgraph.config import get_config
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import interrupt

from durability import operations, registry
from durability.langgraph import agent, effect, journaled, wait_for
from durability.models import Run
from tests import langgraph_graphs

TURNS = 5
PAUSE = float(os.environ.get("LG_NODE_PAUSE", "0.08"))


class Support(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    turns: int
    notes: Annotated[list[str], operator.add]


def _pay(tool: str, arg: str, thread: str = "") -> None:
    ledger = os.environ.get("LG_TOOL_LEDGER")
    if not ledger:
        return
    thread = thread or get_config()["configurable"]["thread_id"]
    with open(ledger, "a") as f:
        f.write(f"{thread} {tool} {arg} {time.time():.6f}\n")


@journaled("search")
def search(q: str) -> str:
    _pay("search", q)
    time.sleep(PAUSE)
    return f"result of {q}"


@journaled("log")
def log_turn(turn: str) -> str:
    _pay("log", turn)
    time.sleep(PAUSE / 2)
    return f"logged {turn}"


def support_graph(turns: int = TURNS) -> StateGraph:
    def model(state: Support) -> dict:
        time.sleep(PAUSE)
        n, k = state.get("turns", 0), len(state["messages"])
        if n >= turns:
            return {"messages": [AIMessage("done", id=f"ai-{k}")]}
        call = {"name": "search", "args": {"q": f"q{n}"}, "id": f"call-{n}"}
        return {"messages": [AIMessage("", id=f"ai-{k}", tool_calls=[call])], "turns": n + 1}

    def tools(state: Support) -> dict:
        last = state["messages"][-1]
        out = [
            ToolMessage(search(c["args"]["q"]), tool_call_id=c["id"], id=f"tool-{c['id']}")
            for c in last.tool_calls
        ]
        return {"messages": out}

    def audit(state: Support) -> dict:
        return {"notes": [log_turn(f"t{state['turns']}")]}

    def route(state: Support) -> Any:
        return ["tools", "audit"] if state["messages"][-1].tool_calls else END

    g = StateGraph(Support)
    g.add_node("model", model)
    g.add_node("tools", tools)
    g.add_node("audit", audit)
    g.add_edge(START, "model")
    g.add_conditional_edges("model", route, ["tools", "audit", END])
    g.add_edge("tools", "model")
    g.add_edge("audit", "model")
    return g


def values_of(run_id: Any) -> Any:
    """The graph's state at a run's head, as LangGraph's ``get_state().values``."""
    run = Run.objects.get(pk=run_id)
    return registry.get(run.agent).values(operations.state_at(run))


def first_input() -> dict:
    return {"messages": [{"role": "user", "content": "where is my parcel?", "id": "h-0"}]}


support = agent("lg-support", support_graph, version="1", description="a test graph")


class Refund(TypedDict):
    amount: int
    paid: int
    answer: dict


def unpay(result: int, amount: int, *, idempotency_key: str) -> int:
    """The refund's compensation (an operator may run it when rolling back past it). It runs
    before the graph goes on, outside its nodes: the run is named by the effect's key."""
    _pay("unpay", str(amount), thread=idempotency_key.split(":")[0])
    return -amount


@effect("pay", label="refund", compensate=unpay)
def pay(amount: int, *, idempotency_key: str) -> int:
    _pay("pay", str(amount))
    return amount


def refund_graph() -> StateGraph:
    """``interrupt()`` before a risky tool: the answer says whether, and how much, to pay."""

    def ask(state: Refund) -> dict:
        answer = interrupt({"question": "refund?", "amount": state["amount"]})
        return {"answer": answer}

    def act(state: Refund) -> dict:
        answer = state["answer"]
        if not answer["approved"]:
            return {"paid": 0}
        return {"paid": pay(answer["value"]["amount"])}

    g = StateGraph(Refund)
    g.add_node("ask", ask)
    g.add_node("act", act)
    g.add_edge(START, "ask")
    g.add_edge("ask", "act")
    g.add_edge("act", END)
    return g


refund = agent("lg-refund", refund_graph)


def at_most_asked(asked: dict, edited: dict) -> str | None:
    """An operator may lower the refund, never raise it."""
    if edited["amount"] > asked["amount"]:
        return f"the refund is at most the {asked['amount']} asked"
    return None


# The same graph with its interrupt's edits constrained, as a native agent's approval is:
# only the amount may change, over 0, and never above what was asked.
guarded_refund = agent(
    "lg-guarded-refund",
    refund_graph,
    approvals={
        "ask": {
            "editable": {
                "type": "object",
                "properties": {"amount": {"type": "number", "exclusiveMinimum": 0}},
            },
            "validate": at_most_asked,
        }
    },
)


class Chat(TypedDict):
    got: Annotated[list, operator.add]
    ticks: Annotated[int, operator.add]


def chat_graph() -> StateGraph:
    """Waits for a user's next message in one branch while another runs beside it."""

    def listen(state: Chat) -> dict:
        return {"got": [wait_for("reply")]}

    def tick(state: Chat) -> dict:
        return {"ticks": 1}

    def answer(state: Chat) -> dict:
        return {"got": [f"answered {len(state['got'])}"]}

    g = StateGraph(Chat)
    g.add_node("listen", listen)
    g.add_node("tick", tick)
    g.add_node("answer", answer)
    g.add_edge(START, "listen")
    g.add_edge(START, "tick")
    g.add_edge(["listen", "tick"], "answer")
    g.add_edge("answer", END)
    return g


chat = agent("lg-chat", chat_graph)


class Questions(TypedDict):
    first: Any
    second: Any


def questions_graph() -> StateGraph:
    """One node asking two questions in a row."""

    def ask(state: Questions) -> dict:
        first = interrupt({"question": "first?"})
        second = interrupt({"question": "second?"})
        return {"first": first["approved"], "second": second["approved"]}

    g = StateGraph(Questions)
    g.add_node("ask", ask)
    g.add_edge(START, "ask")
    g.add_edge("ask", END)
    return g


questions = agent("lg-questions", questions_graph)


# A parent graph whose node is a subgraph that interrupts (tests.langgraph_graphs).
nested = agent("lg-nested", langgraph_graphs.with_subgraph)

# Delta channels (``langgraph_graphs.delta_chat``): their values are in a few checkpoints only.
delta_chat = agent("lg-delta", lambda: langgraph_graphs.delta_chat(turns=7))

# Map-reduce with Send, and a node whose error handler takes its error.
fan_out = agent("lg-fan-out", langgraph_graphs.fan_out)
handled = agent("lg-handled", langgraph_graphs.handled_failure)
