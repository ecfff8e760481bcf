"""A graph in its user's own process, stopped on interrupts of parallel branches: its run
names every question, the CLI gives the call that answers each by its id, and the answers
finish it as they finish the same graph on InMemorySaver. And a graph stored under the
user's span: its run links to that trace, as the runs the workers execute do."""

from __future__ import annotations

import gc
import io
import json
import operator
import uuid
from typing import Annotated, TypedDict

import pytest
from django.core.management import call_command
from django.urls import reverse
from django.utils.html import escape
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from api import present
from dashboard.runinfo import trace_of
from durability.langgraph import DurableSaver
from durability.models import Run
from tests.dashboard_helpers import as_viewer, viewer  # noqa: F401 - fixtures

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]


class Approvals(TypedDict):
    answers: Annotated[list, operator.add]


def _asks(name: str):
    def node(state: Approvals) -> dict:
        return {"answers": [f"{name}: {interrupt(f'may {name} go on?')}"]}

    return node


def fan_out():
    builder = StateGraph(Approvals)
    for name in ("billing", "shipping"):
        builder.add_node(name, _asks(name))
        builder.add_edge(START, name)
        builder.add_edge(name, END)
    return builder


def command(*args: str) -> str:
    out = io.StringIO()
    call_command("durability", *args, stdout=out)
    return out.getvalue()


def _run_of(saver: DurableSaver, thread: str) -> Run:
    run = saver.run_of(thread)
    assert run is not None
    return Run.objects.get(pk=run.pk)


def test_parallel_interrupts_are_all_named_and_answered_each_by_its_id(as_viewer):  # noqa: F811
    thread = f"fan-{uuid.uuid4().hex[:8]}"
    config = {"configurable": {"thread_id": thread}}
    saver = DurableSaver(graph="fan-out")
    try:
        graph = fan_out().compile(checkpointer=saver)
        asked = graph.invoke({"answers": []}, config)["__interrupt__"]
        assert sorted(i.value for i in asked) == ["may billing go on?", "may shipping go on?"]
        run = _run_of(saver, thread)
        assert run.status == "waiting"
        # Both questions, not the last one stored.
        assert "may billing go on?" in run.wait_detail, run.wait_detail
        assert "may shipping go on?" in run.wait_detail, run.wait_detail
        data = json.loads(command("show", str(run.id), "--json"))["langgraph"]
        assert sorted(i["value"] for i in data["interrupts"]) == [
            "may billing go on?",
            "may shipping go on?",
        ]
        assert sorted(i["node"] for i in data["interrupts"]) == ["billing", "shipping"]
        # LangGraph refuses one value for two interrupts: the call given answers each.
        for i in asked:
            assert f"{i.id!r}: ..." in data["how_to_continue"], data["how_to_continue"]
        shown = command("show", str(run.id))
        assert "Answer each interrupt, by its id" in shown
        page = as_viewer.get(reverse("dashboard:run", args=[run.id])).content.decode()
        listed = page.split('id="graph-interrupts"')[1].split("</ul>")[0]
        for i in asked:
            # Each question with its node and the id its answer is given under.
            node = "billing" if "billing" in i.value else "shipping"
            assert f"node <strong>{node}</strong>" in listed and i.id in listed, listed
            assert escape(i.value) in listed
        resume = page.split('id="graph-resume">')[1].split("</pre>")[0]
        assert all(escape(repr(i.id)) in resume for i in asked), resume
        answers = {i.id: f"yes ({i.value})" for i in asked}
        done = graph.invoke(Command(resume=answers), config)
        run.refresh_from_db()
        assert run.status == "succeeded" and run.wait_detail == ""
    finally:
        saver.close()
        gc.collect()
    reference = fan_out().compile(checkpointer=InMemorySaver())
    first = reference.invoke({"answers": []}, config)["__interrupt__"]
    expected = reference.invoke(Command(resume={i.id: f"yes ({i.value})" for i in first}), config)
    assert sorted(done["answers"]) == sorted(expected["answers"])
    assert sorted(done["answers"]) == [
        "billing: yes (may billing go on?)",
        "shipping: yes (may shipping go on?)",
    ]


class _Count(TypedDict):
    n: int


def _child():
    builder = StateGraph(_Count)
    builder.add_node("inc", lambda s: {"n": s["n"] + 1})
    builder.add_edge(START, "inc")
    builder.add_edge("inc", END)
    return builder.compile()


def _parent():
    builder = StateGraph(_Count)
    builder.add_node("child", _child())
    builder.add_edge(START, "child")
    builder.add_edge("child", END)
    return builder


@pytest.mark.parametrize("memory_spans", ["sdk"], indirect=True)
def test_a_graph_stored_under_a_span_links_its_run_and_its_subgraph_to_that_trace(
    memory_spans,
):
    from opentelemetry import trace

    thread = f"traced-{uuid.uuid4().hex[:8]}"
    saver = DurableSaver(graph="traced")
    try:
        graph = _parent().compile(checkpointer=saver)
        with trace.get_tracer("the user's app").start_as_current_span("handle request") as span:
            assert graph.invoke({"n": 0}, {"configurable": {"thread_id": thread}}) == {"n": 1}
        run = _run_of(saver, thread)
    finally:
        saver.close()
        gc.collect()
    trace_id = format(span.get_span_context().trace_id, "032x")
    shown = trace_of(run)
    assert shown is not None and shown.id == trace_id
    children = list(Run.objects.filter(parent_run=run))
    assert children, "the subgraph's namespace is a child run"
    assert all(trace_of(child).id == trace_id for child in children)
    # Outside any span: no trace, and no made-up link.
    untraced = f"untraced-{uuid.uuid4().hex[:8]}"
    saver = DurableSaver(graph="traced")
    try:
        _parent().compile(checkpointer=saver).invoke(
            {"n": 0}, {"configurable": {"thread_id": untraced}}
        )
        assert trace_of(_run_of(saver, untraced)) is None
    finally:
        saver.close()
        gc.collect()


def test_a_report_made_before_one_already_written_never_overwrites_it():
    """Checkpoints and writes reach the saver on several threads and their reports are
    written later, on the saver's thread: "going on" made before an interrupt but written
    after it must not hide the interrupt."""
    from langgraph.types import Interrupt

    from durability.langgraph.models import Thread
    from durability.langgraph.status import ANSWER, MID_RUN, Reporter

    thread_id = f"late-{uuid.uuid4().hex[:8]}"
    saver = DurableSaver(graph="late-reports")
    try:
        _parent().compile(checkpointer=saver).invoke(
            {"n": 0}, {"configurable": {"thread_id": thread_id}}
        )
        run = _run_of(saver, thread_id)
    finally:
        saver.close()
        gc.collect()
    assert run.status == "succeeded"
    thread = Thread.objects.get(run=run)
    reporter = Reporter()
    going_on = reporter.put(thread, "z1", {"branch:to:tools": None}, run.head_seq)
    asked = reporter.writes(
        thread,
        "z1",
        [("__interrupt__", [Interrupt(value="may I refund?", id="i-1")])],
        "~__pregel_pull, tools",
        run.head_seq,
        "task-1",
    )
    assert going_on is not None and asked is not None
    asked()
    going_on()  # late
    run.refresh_from_db()
    assert run.status == "waiting" and run.wait_detail == f"{ANSWER}may I refund?"
    assert run.wait_reason == "interrupt"
    # In order, each is written.
    again = Reporter()
    later = again.put(thread, "z2", {"branch:to:model": None}, run.head_seq)
    assert later is not None
    later()
    run.refresh_from_db()
    assert run.wait_reason == "graph" and run.wait_detail == MID_RUN


def test_an_interrupt_is_reported_after_a_checkpoint_that_failed_to_be_stored():
    """A ``put`` whose statement failed (the database went away mid-superstep) told the
    saver's reporter of a checkpoint that may not exist. The next invocation reads the
    thread's latest checkpoint, whose task asks a question: that report is written, not
    taken for one about a checkpoint older than the one that failed."""
    from langgraph.types import Interrupt

    from durability.langgraph import store
    from durability.langgraph.status import ANSWER, Reporter

    thread, _ = store.thread_of(f"failed-{uuid.uuid4().hex[:8]}", "", graph="g", create=True)
    reporter = Reporter()
    reporter.known(thread)
    reporter.put(thread, "z2", {"branch:to:tools": None}, 2)  # its statement failed
    reporter.not_stored(thread)
    asked = reporter.writes(
        thread,
        "z1",
        [("__interrupt__", [Interrupt(value="may I refund?", id="i-1")])],
        "~__pregel_pull, tools",
        1,
        "task-1",
        stored=True,
    )
    assert asked is not None
    asked()
    run = Run.objects.get(pk=thread.run_id)
    assert run.status == "waiting" and run.wait_detail == f"{ANSWER}may I refund?"


def test_a_saver_that_never_saw_the_thread_reports_its_status_as_the_one_that_made_it():
    """Another process answers the interrupts: its saver learns the thread by reading it
    (on PostgreSQL with the run's agent, so that it knows without a query that no worker
    executes the run) and reports the run going on and then succeeding."""
    thread = f"fan-{uuid.uuid4().hex[:8]}"
    config = {"configurable": {"thread_id": thread}}
    first, other = DurableSaver(graph="fan-out"), DurableSaver(graph="fan-out")
    try:
        asked = fan_out().compile(checkpointer=first).invoke({"answers": []}, config)
        run = _run_of(first, thread)
        assert run.status == "waiting" and "may billing go on?" in run.wait_detail
        # What the API says it waits for.
        assert present.run(run)["waiting_for"] == "interrupt"
        answers = {i.id: "yes" for i in asked["__interrupt__"]}
        graph = fan_out().compile(checkpointer=other)
        assert sorted(graph.invoke(Command(resume=answers), config)["answers"]) == [
            "billing: yes",
            "shipping: yes",
        ]
        run.refresh_from_db()
        assert run.status == "succeeded" and run.wait_detail == "" and run.wait_reason == ""
        assert present.run(run)["waiting_for"] is None
        kinds = list(run.events.order_by("id").values_list("kind", flat=True))
        assert kinds[-1] == "succeeded" and kinds.count("succeeded") == 1, kinds
    finally:
        first.close()
        other.close()
        gc.collect()


def test_a_static_breakpoint_shows_as_waiting_for_the_graph_to_go_on():
    """``interrupt_before`` stores no interrupt, only the next tasks: the run waits for its
    graph to go on, and ``invoke(None)`` continues it to its end."""
    from durability.langgraph.status import MID_RUN

    thread_id = f"breakpoint-{uuid.uuid4().hex[:8]}"
    config = {"configurable": {"thread_id": thread_id}}
    saver = DurableSaver(graph="breakpoints")
    try:
        graph = _parent().compile(checkpointer=saver, interrupt_before=["child"])
        assert graph.invoke({"n": 0}, config) == {"n": 0}
        run = _run_of(saver, thread_id)
        assert run.status == "waiting" and run.wait_detail == MID_RUN
        assert present.run(run)["waiting_for"] == "graph"
        shown = json.loads(command("show", str(run.id), "--json"))["langgraph"]
        assert shown["next"] == ["child"] and shown["interrupts"] == []
        assert "graph.invoke(None, " in shown["how_to_continue"]
        assert graph.invoke(None, config) == {"n": 1}
        run.refresh_from_db()
        assert run.status == "succeeded"
    finally:
        saver.close()
        gc.collect()
