"""A LangGraph ReAct agent kept on this product's store (docs/langgraph.md).

A support agent with two tools: ``lookup_order`` (safe) and ``refund`` (risky: the graph
stops with ``interrupt()`` and waits for a person's answer before it runs). The model is a
plain Python stand-in, so the example runs offline and the same every time.

    python -m examples.langgraph_support --thread t-1            # runs until the interrupt
    python -m examples.langgraph_support --thread t-1 --answer yes   # answers it: refunds

Uses the product's Django settings (DATABASE_URL...), as every process using DurableSaver
does. The run shows up in the dashboard under the agent "support-graph".
"""

from __future__ import annotations

import argparse
import os
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command, interrupt

ORDERS = {"A-1042": {"item": "espresso machine", "price_eur": 349.0}}


class Chat(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def lookup_order(order_id: str) -> dict:
    return {"order_id": order_id, **ORDERS.get(order_id, {"item": "?", "price_eur": 0.0})}


def refund(order_id: str, amount_eur: float) -> dict:
    return {"refunded": amount_eur, "order_id": order_id}


def fake_model(messages: list[AnyMessage]) -> AIMessage:
    """What an LLM with these two tools would answer, decided by the last message."""
    n, last = len(messages), messages[-1]
    if isinstance(last, HumanMessage):
        call = {"name": "lookup_order", "args": {"order_id": "A-1042"}, "id": f"call-{n}"}
        return AIMessage("Let me look the order up.", id=f"ai-{n}", tool_calls=[call])
    if isinstance(last, ToolMessage) and last.name == "lookup_order":
        args = {"order_id": "A-1042", "amount_eur": ORDERS["A-1042"]["price_eur"]}
        call = {"name": "refund", "args": args, "id": f"call-{n}"}
        return AIMessage("The order qualifies: refunding it.", id=f"ai-{n}", tool_calls=[call])
    return AIMessage(f"Done: {last.content}", id=f"ai-{n}")


def model(state: Chat) -> dict:
    return {"messages": [fake_model(state["messages"])]}


def tools(state: Chat) -> dict:
    out = []
    for call in state["messages"][-1].tool_calls:
        if call["name"] == "refund":
            # The risky tool: a person answers first (the graph stops here until then).
            answer = interrupt({"tool": "refund", "args": call["args"]})
            if answer != "yes":
                result: Any = f"refund not approved ({answer})"
            else:
                result = refund(**call["args"])
        else:
            result = lookup_order(**call["args"])
        content = str(result)
        out.append(ToolMessage(content, tool_call_id=call["id"], name=call["name"]))
    return {"messages": out}


def route(state: Chat) -> str:
    return "tools" if state["messages"][-1].tool_calls else END


def build() -> StateGraph:
    builder = StateGraph(Chat)
    builder.add_node("model", model)
    builder.add_node("tools", tools)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", route, ["tools", END])
    builder.add_edge("tools", "model")
    return builder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thread", default="support-1")
    parser.add_argument("--answer", help="the answer to the refund question (yes or no)")
    args = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    from durability.langgraph import DurableSaver

    saver = DurableSaver(graph="support-graph")  # was: InMemorySaver()
    graph = build().compile(checkpointer=saver)
    config = {"configurable": {"thread_id": args.thread}}
    if args.answer is None:
        ask = {"messages": [HumanMessage("My espresso machine arrived broken: order A-1042.")]}
        result = graph.invoke(ask, config)
    else:
        result = graph.invoke(Command(resume=args.answer), config)
    for asked in result.get("__interrupt__", []):
        print(f"waiting for an answer to: {asked.value}")
    if "__interrupt__" not in result:
        print(f"answer: {result['messages'][-1].content}")
    print(f"run: {saver.run_of(args.thread).id}")
    saver.close()


if __name__ == "__main__":
    main()
