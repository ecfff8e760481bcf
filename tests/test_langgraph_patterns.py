"""More of LangGraph's documented patterns with ``DurableSaver`` beside ``InMemorySaver``:
map-reduce with ``Send``, a node's error handler, the functional API, the durability modes
and a subgraph with a history of its own. The same results and history, and the run's
status says what the graph did (a finished map-reduce ended, a handled error is no
failure)."""

from __future__ import annotations

import uuid

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.errors import NodeError
from langgraph.func import entrypoint, task
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from durability.langgraph import DurableSaver, describe
from durability.langgraph.models import Thread
from durability.models import Event, Run
from tests import langgraph_graphs as graphs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

START_VALUES = {"log": [], "n": 0}


def config() -> dict:
    return {"configurable": {"thread_id": uuid.uuid4().hex}}


def history(graph, cfg) -> list:
    return [
        (s.values, s.next, s.metadata.get("source"), s.metadata.get("step"), len(s.tasks))
        for s in graph.get_state_history(cfg)
    ]


def run_of(cfg) -> Run:
    return Thread.objects.get(thread_id=cfg["configurable"]["thread_id"], checkpoint_ns="").run


def side_by_side(builder, call) -> tuple[dict, list]:
    """``call(graph, config)`` with each saver: what it answered and the history, which
    must be the same; the config of ``DurableSaver``'s thread."""
    done = []
    for saver in (DurableSaver(), InMemorySaver()):
        graph, cfg = builder.compile(checkpointer=saver), config()
        done.append((call(graph, cfg), history(graph, cfg), cfg))
    (ours, our_history, cfg), (theirs, their_history, _) = done
    assert ours == theirs
    assert our_history == their_history
    return cfg


def test_a_map_reduce_with_send_ends_its_run():
    cfg = side_by_side(graphs.fan_out(), lambda g, c: g.invoke(START_VALUES, c))
    run = run_of(cfg)
    # Its last checkpoint keeps the sent tasks' channel, empty: nothing runs next.
    assert run.status == "succeeded", run.wait_detail
    assert describe.waiting(run, {"__pregel_tasks": [], "log": [0, 10, 20]}).next == []


def summaries(run: Run) -> list[str]:
    steps = describe.supersteps(run.id, range(run.head_seq + 1))
    return [t.summary for step in steps.values() for t in step.tasks]


def test_sent_tasks_are_named_after_the_node_they_were_sent_to():
    # Two nodes sent to at once: each task's node is read from the checkpoint it ran from
    # (its path gives only its index there), and the order of the sends is kept.
    from langgraph.types import Send

    builder = StateGraph(graphs.Tally)
    builder.add_node("work", lambda s: {"log": [s["n"] * 10]})
    builder.add_node("audit", lambda s: {"log": [f"audit {s['n']}"]})
    sends = [Send("audit", {"log": [], "n": 0}), Send("work", {"log": [], "n": 1})]
    builder.add_conditional_edges(START, lambda s: sends, ["work", "audit"])
    builder.add_edge("work", END)
    builder.add_edge("audit", END)
    cfg = side_by_side(builder, lambda g, c: g.invoke(START_VALUES, c))
    said = summaries(run_of(cfg))
    assert "audit wrote log" in said and "work wrote log" in said, said
    assert not [s for s in said if "sent task" in s], said


@pytest.mark.parametrize("mode", ["sync", "async", "exit"])
def test_a_sent_task_that_fails_or_asks_is_named_by_its_node(mode):
    # "async": a task's writes may reach the saver before the checkpoint it ran from.
    from langgraph.types import Send

    tries: list[int] = []

    def check(state: graphs.Tally) -> dict:
        if state["n"] == 2:
            tries.append(1)
            raise ValueError(f"item {state['n']} is malformed (try {len(tries)})")
        return {"log": [state["n"]]}

    builder = StateGraph(graphs.Tally)
    builder.add_node("check", check)
    builder.add_conditional_edges(
        START, lambda s: [Send("check", {"log": [], "n": i}) for i in range(3)], ["check"]
    )
    builder.add_edge("check", END)
    graph, cfg = builder.compile(checkpointer=DurableSaver()), config()
    with pytest.raises(ValueError, match="malformed"):
        graph.invoke(START_VALUES, cfg, durability=mode)
    run = run_of(cfg)
    assert run.status == "failed"
    assert run.error == "node check raised ValueError: item 2 is malformed (try 1)", run.error
    # Taken up again by a saver that has put nothing (another process): named from the
    # checkpoint it read.
    again = builder.compile(checkpointer=DurableSaver())
    with pytest.raises(ValueError, match="malformed"):
        again.invoke(None, cfg, durability=mode)
    run = run_of(cfg)
    assert run.error == "node check raised ValueError: item 2 is malformed (try 2)", run.error

    def review(state: graphs.Tally) -> dict:
        return {"log": [interrupt(f"may item {state['n']} ship?")]}

    builder = StateGraph(graphs.Tally)
    builder.add_node("review", review)
    builder.add_conditional_edges(
        START, lambda s: [Send("review", {"log": [], "n": 7})], ["review"]
    )
    builder.add_edge("review", END)
    graph, cfg = builder.compile(checkpointer=DurableSaver()), config()
    graph.invoke(START_VALUES, cfg, durability=mode)
    run = run_of(cfg)
    head = graph.get_state(cfg)
    assert run.status == "waiting" and head.next == ("review",)
    found = describe.waiting(run, _stored_values(run))
    assert [(node, value) for node, value, _ in found.interrupts] == [
        ("review", "may item 7 ship?")
    ]
    graph.invoke(Command(resume="yes"), cfg, durability=mode)
    # "exit" stores no task's writes but the special ones: the node, without its channels.
    assert ("review" if mode == "exit" else "review wrote log") in summaries(run_of(cfg))


def _stored_values(run: Run):
    """The run's latest channel values as stored (what the dashboard hands ``waiting``)."""
    from durability import checkpoints

    cp = run.checkpoints.get(seq=run.head_seq)
    return checkpoints.verified_state(cp)[0]["values"]


def test_an_error_a_node_handler_takes_is_no_failure_of_the_run():
    cfg = side_by_side(graphs.handled_failure(), lambda g, c: g.invoke(START_VALUES, c))
    run = run_of(cfg)
    assert run.status == "succeeded"
    assert not Event.objects.filter(run=run, kind="failed").exists()
    steps = describe.supersteps(run.id, range(run.head_seq + 1))
    said = [t.summary for step in steps.values() for t in step.tasks]
    assert "risky (raised ValueError('the tool is down'), handled by its error handler)" in said
    assert "risky's error handler wrote log → after" in said


def test_a_failing_error_handler_fails_the_run():
    def broken(state: graphs.Tally, error: NodeError) -> dict:
        raise RuntimeError("the handler broke too")

    builder = StateGraph(graphs.Tally)
    builder.add_node("risky", lambda s: 1 / 0, error_handler=broken)
    builder.add_edge(START, "risky")
    builder.add_edge("risky", END)
    graph, cfg = builder.compile(checkpointer=DurableSaver()), config()
    with pytest.raises(RuntimeError, match="handler broke"):
        graph.invoke(START_VALUES, cfg)
    run = run_of(cfg)
    assert run.status == "failed" and "handler broke" in run.error


def functional(saver):
    @task
    def double(x: int) -> int:
        return 2 * x

    @entrypoint(checkpointer=saver)
    def workflow(x: int) -> dict:
        doubled = double(x).result()
        answer = interrupt({"publish": doubled})
        return {"doubled": doubled, "answer": answer}

    return workflow


def test_the_functional_api_with_an_interrupt():
    answers, runs = [], []
    for saver in (DurableSaver(), InMemorySaver()):
        workflow, cfg = functional(saver), config()
        asked = workflow.invoke(3, cfg)
        statuses = [run_of(cfg).wait_detail] if isinstance(saver, DurableSaver) else []
        done = workflow.invoke(Command(resume="yes"), cfg)
        answers.append(([i.value for i in asked["__interrupt__"]], done, history(workflow, cfg)))
        runs.append((statuses, cfg))
    assert answers[0] == answers[1]
    assert answers[0][1] == {"doubled": 6, "answer": "yes"}
    (asked_for,), cfg = runs[0]
    assert asked_for == 'an answer to: {"publish": 6}'
    assert run_of(cfg).status == "succeeded"
    # A task's call is named by its caller: its own name is in no checkpoint.
    assert "a task called by workflow" in summaries(run_of(cfg)), summaries(run_of(cfg))


@pytest.mark.parametrize("mode", ["exit", "async"])
def test_the_durability_modes(mode):
    cfg = side_by_side(
        graphs.tool_loop(turns=3),
        lambda g, c: g.invoke(graphs.first_input(), c, durability=mode),
    )
    assert run_of(cfg).status == "succeeded"


def test_a_subgraph_with_a_history_of_its_own():
    inner = StateGraph(graphs.Tally)
    inner.add_node("count", lambda s: {"log": [f"inner {s['n']}"], "n": s["n"] + 1})
    inner.add_edge(START, "count")
    inner.add_edge("count", END)
    # ``checkpointer=True``: the subgraph keeps one history per thread across calls.
    kept = inner.compile(checkpointer=True)
    outer = StateGraph(graphs.Tally)
    outer.add_node("call", lambda s: {"log": kept.invoke({"log": [], "n": s["n"]})["log"]})
    outer.add_edge(START, "call")
    outer.add_edge("call", END)

    def two_calls(graph, cfg):
        first = graph.invoke(START_VALUES, cfg)
        second = graph.invoke({"log": [], "n": 5}, cfg)
        return first, second, graph.get_state(cfg, subgraphs=True).values

    side_by_side(outer, two_calls)
