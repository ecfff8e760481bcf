"""LangGraph's documented patterns as plain Python graphs (no LLM), for the checkpointer's
contract tests and its benchmark. Message ids are fixed, so two runs compare equal."""

from __future__ import annotations

import operator
import time
from collections import Counter
from collections.abc import Callable
from typing import Annotated, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage
from langgraph.channels import DeltaChannel
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import _messages_delta_reducer, add_messages
from langgraph.types import interrupt

CALLS: Counter[str] = Counter()


class Chat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    turns: int


def tool_loop(turns: int = 3) -> StateGraph:
    """A ReAct-shaped loop: the model asks for a tool until it has asked ``turns`` times."""

    def model(state: Chat) -> dict:
        n, k = state.get("turns", 0), len(state["messages"])
        CALLS["model"] += 1
        if n >= turns:
            return {"messages": [AIMessage("done", id=f"ai-{k}")]}
        call = {"name": "search", "args": {"q": f"q{n}"}, "id": f"call-{k}"}
        return {"messages": [AIMessage("", id=f"ai-{k}", tool_calls=[call])], "turns": n + 1}

    def tools(state: Chat) -> dict:
        CALLS["tools"] += 1
        last = state["messages"][-1]
        out = [
            ToolMessage(f"result of {c['args']['q']}", tool_call_id=c["id"], id=f"tool-{c['id']}")
            for c in last.tool_calls
        ]
        return {"messages": out}

    def route(state: Chat) -> str:
        return "tools" if state["messages"][-1].tool_calls else END

    g = StateGraph(Chat)
    g.add_node("model", model)
    g.add_node("tools", tools)
    g.add_edge(START, "model")
    g.add_conditional_edges("model", route, ["tools", END])
    g.add_edge("tools", "model")
    return g


class Refund(TypedDict):
    amount: int
    decision: str
    done: bool


def approval() -> StateGraph:
    """``interrupt()`` before a risky action, resumed with ``Command(resume=...)``."""

    def ask(state: Refund) -> dict:
        CALLS["ask"] += 1
        answer = interrupt({"question": "refund?", "amount": state["amount"]})
        return {"decision": answer}

    def act(state: Refund) -> dict:
        CALLS["act"] += 1
        return {"done": state["decision"] == "yes"}

    g = StateGraph(Refund)
    g.add_node("ask", ask)
    g.add_node("act", act)
    g.add_edge(START, "ask")
    g.add_edge("ask", "act")
    g.add_edge("act", END)
    return g


class Fan(TypedDict):
    log: Annotated[list[str], operator.add]


FAIL = {"b": 0}


def branches(a_saved: Callable[[], bool] | None = None) -> StateGraph:
    """Two branches in one superstep; ``b`` fails (once per FAIL["b"]) after ``a`` wrote.

    LangGraph cancels a superstep's other tasks when one fails, so on a loaded machine ``b``
    could fail before ``a`` finished; given ``a_saved`` (true once the checkpointer holds
    ``a``'s write), ``b`` waits for it before failing."""

    def a(state: Fan) -> dict:
        CALLS["a"] += 1
        return {"log": ["a"]}

    def b(state: Fan) -> dict:
        CALLS["b"] += 1
        if FAIL["b"] > 0:
            deadline = time.monotonic() + 30
            while a_saved is not None and not a_saved() and time.monotonic() < deadline:
                time.sleep(0.005)
            FAIL["b"] -= 1
            raise RuntimeError("b failed")
        return {"log": ["b"]}

    def join(state: Fan) -> dict:
        CALLS["join"] += 1
        return {"log": ["join"]}

    g = StateGraph(Fan)
    g.add_node("a", a)
    g.add_node("b", b)
    g.add_node("join", join)
    g.add_edge(START, "a")
    g.add_edge(START, "b")
    g.add_edge(["a", "b"], "join")
    g.add_edge("join", END)
    return g


class Outer(TypedDict):
    log: Annotated[list[str], operator.add]
    answer: str


def with_subgraph() -> StateGraph:
    """A parent graph whose node is a subgraph that interrupts (its own namespace)."""

    def inner_ask(state: Outer) -> dict:
        CALLS["inner_ask"] += 1
        return {"answer": interrupt("which?"), "log": ["inner"]}

    inner = StateGraph(Outer)
    inner.add_node("inner_ask", inner_ask)
    inner.add_edge(START, "inner_ask")
    inner.add_edge("inner_ask", END)

    def before(state: Outer) -> dict:
        return {"log": ["before"]}

    def after(state: Outer) -> dict:
        return {"log": [f"after {state['answer']}"]}

    g = StateGraph(Outer)
    g.add_node("before", before)
    g.add_node("sub", inner.compile())
    g.add_node("after", after)
    g.add_edge(START, "before")
    g.add_edge("before", "sub")
    g.add_edge("sub", "after")
    g.add_edge("after", END)
    return g


def appender(steps: int, size: int = 1000) -> StateGraph:
    """``steps`` supersteps, each appending one message of about ``size`` bytes."""
    text = "x" * size

    def step(state: Chat) -> dict:
        n = state.get("turns", 0)
        return {"messages": [AIMessage(text, id=f"m-{n}")], "turns": n + 1}

    def route(state: Chat) -> str:
        return "step" if state["turns"] < steps else END

    g = StateGraph(Chat)
    g.add_node("step", step)
    g.add_edge(START, "step")
    g.add_conditional_edges("step", route, ["step", END])
    return g


def first_input() -> dict:
    return {"messages": [HumanMessage("hello", id="human-0")], "turns": 0}


class Numbers(TypedDict):
    nums: list
    step: int


def number_types() -> StateGraph:
    """Each superstep keeps a list that compares equal in Python but changes its numbers'
    types (1 -> 1.0 -> True): only an exact patch stores the change."""
    values = [[1, 2], [1.0, 2], [True, 2], [1, 2.0]]

    def step(state: Numbers) -> dict:
        n = state["step"] + 1
        return {"nums": list(values[n]), "step": n}

    def route(state: Numbers) -> str:
        return "step" if state["step"] < len(values) - 1 else END

    g = StateGraph(Numbers)
    g.add_node("step", step)
    g.add_edge(START, "step")
    g.add_conditional_edges("step", route, ["step", END])
    return g


def pairs(turns: int, pause: float = 0.0, announce: bool = False) -> StateGraph:
    """Supersteps of two parallel nodes (``a``, then a slower ``b``), each appending a
    message of about 1 KB, and a ``count`` node between them, for ``turns`` rounds. With
    ``announce``, each node prints a line as it starts (the crash tests kill on them)."""

    def node(name: str, wait: float):
        def run(state: Chat) -> dict:
            n = state.get("turns", 0)
            if announce:  # one write, so that the two nodes' lines never interleave
                print(f"node {name} {n}\n", end="", flush=True)
            time.sleep(wait)
            text = f"{name}{n} " * 250
            return {"messages": [AIMessage(text, id=f"{name}-{n}")]}

        return run

    def count(state: Chat) -> dict:
        return {"turns": state.get("turns", 0) + 1}

    def route(state: Chat) -> list[str] | str:
        return ["a", "b"] if state["turns"] < turns else END

    g = StateGraph(Chat)
    g.add_node("a", node("a", pause))
    g.add_node("b", node("b", 2 * pause))
    g.add_node("count", count)
    g.add_edge(START, "a")
    g.add_edge(START, "b")
    g.add_edge(["a", "b"], "count")
    g.add_conditional_edges("count", route, ["a", "b", END])
    return g


def extend(state: list, writes: list) -> list:
    """A delta channel's reducer: every write's items appended (batching-invariant)."""
    return [*state, *(item for write in writes for item in write)]


def delta_chat(turns: int, every: int = 3) -> StateGraph:
    """A chat whose ``messages`` (LangGraph's delta reducer for messages, as its docs show)
    and ``log`` are LangGraph delta channels: stored whole every ``every`` (and ``every +
    2``) updates, rebuilt from the writes since in between. ``turns`` supersteps, each of
    two tasks that both write to ``log``."""
    # Functional form: the channels' settings are this call's.
    state = TypedDict(  # noqa: UP013
        "DeltaChat",
        {
            "messages": Annotated[
                list[AnyMessage], DeltaChannel(_messages_delta_reducer, snapshot_frequency=every)
            ],
            "log": Annotated[list, DeltaChannel(extend, snapshot_frequency=every + 2)],
            "turns": int,
        },
    )

    def model(state: dict) -> dict:
        n = state.get("turns", 0)
        return {
            "messages": [AIMessage(f"answer {n}", id=f"ai-{n}-{len(state['messages'])}")],
            "log": [f"turn {n}"],
            "turns": n + 1,
        }

    def note(state: dict) -> dict:
        return {"log": [f"note {state.get('turns', 0)}"]}

    def route(state: dict) -> list[str] | str:
        return ["model", "note"] if state["turns"] < turns else END

    g = StateGraph(state)
    g.add_node("model", model)
    g.add_node("note", note)
    g.add_edge(START, "model")
    g.add_edge(START, "note")
    g.add_conditional_edges("model", route, ["model", "note", END])
    return g


class Tally(TypedDict):
    log: Annotated[list, operator.add]
    n: int


def fan_out(width: int = 3) -> StateGraph:
    """Map-reduce: the start sends one ``work`` task per item (``Send``), whose results the
    ``log`` channel gathers."""
    from langgraph.types import Send

    def sends(state: Tally) -> list:
        return [Send("work", {"log": [], "n": i}) for i in range(width)]

    g = StateGraph(Tally)
    g.add_node("work", lambda state: {"log": [state["n"] * 10]})
    g.add_conditional_edges(START, sends, ["work"])
    g.add_edge("work", END)
    return g


def handled_failure() -> StateGraph:
    """``risky`` raises; its error handler (given LangGraph's ``NodeError``) notes it and
    sends the graph on to ``after``."""
    from langgraph.errors import NodeError
    from langgraph.types import Command

    def risky(state: Tally) -> dict:
        raise ValueError("the tool is down")

    def handler(state: Tally, error: NodeError) -> Command:
        return Command(
            update={"log": [f"recovered from {error.node}: {error.error}"]}, goto="after"
        )

    g = StateGraph(Tally)
    g.add_node("risky", risky, error_handler=handler)
    g.add_node("after", lambda state: {"log": ["after"], "n": state["n"] + 1})
    g.add_edge(START, "risky")
    g.add_edge("risky", "after")
    g.add_edge("after", END)
    return g
