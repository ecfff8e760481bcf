"""Checkpoints a graph's process takes out of LangGraph's view (``delete_for_runs``,
``prune(strategy="keep_latest")``): the run says so on its timeline and in the audit log,
and when LangGraph goes back to an earlier checkpoint the run's status is read back from
it (an answered interrupt goes on, an invocation taken out leaves the one before it), in
the same transaction. The store keeps every checkpoint: the run verifies, and the graph's
next checkpoint is a patch on the one LangGraph went back to."""

from __future__ import annotations

import uuid

import pytest
from django.urls import reverse
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from durability import canonical, operations
from durability.langgraph import DurableSaver
from durability.langgraph.models import Thread
from durability.langgraph.pruning import HIDER, PRUNER
from durability.langgraph.status import MID_RUN
from durability.models import Event, EventKind, Run
from tests import langgraph_graphs as graphs
from tests.dashboard_helpers import as_viewer, viewer  # noqa: F401 - fixtures

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

REFUND = {"amount": 30, "decision": "", "done": False}


def invocation(thread: str, run_id: str) -> dict:
    """LangGraph's config for one invocation: its run id goes into each checkpoint's
    metadata, which ``delete_for_runs`` selects by."""
    return {"configurable": {"thread_id": thread}, "metadata": {"run_id": run_id}}


def run_of(thread: str) -> Run:
    return Thread.objects.get(thread_id=thread, checkpoint_ns="").run


def hidings(run: Run) -> list[tuple[str, dict]]:
    found = Event.objects.filter(run=run, kind=EventKind.ROLLBACK).order_by("id")
    return [(e.actor, canonical.loads(e.data)) for e in found]


def test_an_answer_taken_out_leaves_the_run_where_the_graph_goes_on_from(as_viewer):  # noqa: F811
    saver, thread = DurableSaver(graph="refunds"), uuid.uuid4().hex
    graph = graphs.approval().compile(checkpointer=saver)
    asked = graph.invoke(REFUND, invocation(thread, "ask-1"))
    assert "__interrupt__" in asked
    interrupted = run_of(thread).head_seq
    graph.invoke(Command(resume="yes"), invocation(thread, "answer-1"))
    run = run_of(thread)
    assert run.status == "succeeded"
    head = run.head_seq

    saver.delete_for_runs(["answer-1", "of-another-thread"])
    run = run_of(thread)
    # The answer stays on the interrupted checkpoint (LangGraph's pending write), so the
    # graph goes on with it, not asking again: waiting for the graph, not for an answer.
    assert (run.status, run.wait_reason, run.wait_detail) == ("waiting", "graph", MID_RUN)
    assert run.head_seq == head  # nothing stored is gone
    ((actor, data),) = hidings(run)
    assert actor == HIDER and data["moved"] is True and data["to"] == interrupted
    assert (data["hidden"], data["through"], data["langgraph_runs"]) == (
        head - interrupted,
        head,
        ["answer-1"],
    )
    assert Event.objects.filter(run=run, kind="suspended").order_by("-id")[0].actor == ""
    page = as_viewer.get(reverse("dashboard:run", args=[run.id])).content.decode()
    assert f"LangGraph went back to #{interrupted}" in page
    assert "taken out of what the graph reads" in page
    audit = as_viewer.get(reverse("dashboard:audit")).content.decode()
    assert HIDER in audit

    # The graph goes on from there with the answer, as LangGraph has it.
    done = graph.invoke(None, invocation(thread, "again-1"))
    assert (done["decision"], done["done"]) == ("yes", True)
    run = run_of(thread)
    assert run.status == "succeeded" and run.head_seq > head
    (report,) = operations.verify(run.id)
    assert report.ok, str(report)
    saver.close()


def test_an_interrupted_turn_taken_out_leaves_the_turn_before_it_ended():
    saver, thread = DurableSaver(graph="refunds"), uuid.uuid4().hex
    graph = graphs.approval().compile(checkpointer=saver)
    graph.invoke(REFUND, invocation(thread, "first"))
    graph.invoke(Command(resume="no"), invocation(thread, "first-answer"))
    graph.invoke(REFUND, invocation(thread, "second"))
    run = run_of(thread)
    assert run.status == "waiting" and run.wait_reason == "interrupt"
    saver.delete_for_runs(["second"])
    run = run_of(thread)
    assert (run.status, run.wait_reason, run.error) == ("succeeded", "", "")
    assert graph.get_state(invocation(thread, "look")).values["decision"] == "no"
    # Taken out of a thread whose latest checkpoint LangGraph still sees (an older
    # invocation's): said on the timeline, its status as it was.
    graph.invoke(REFUND, invocation(thread, "third"))
    saver.delete_for_runs(["first-answer"])
    run = run_of(thread)
    assert run.status == "waiting" and run.wait_reason == "interrupt"
    assert [d["moved"] for _, d in hidings(run)] == [True, False]
    saver.close()


def test_keep_latest_says_what_it_hid_and_changes_no_status():
    saver, thread = DurableSaver(graph="refunds"), uuid.uuid4().hex
    graph = graphs.approval().compile(checkpointer=saver)
    graph.invoke(REFUND, invocation(thread, "first"))
    before = run_of(thread)
    saver.prune([thread])
    run = run_of(thread)
    assert (run.status, run.wait_detail) == (before.status, before.wait_detail)
    ((actor, data),) = hidings(run)
    assert actor == PRUNER and data["moved"] is False and data["hidden"] == run.head_seq - 1
    saver.prune([thread])  # nothing more to hide: nothing said
    assert len(hidings(run)) == 1
    saver.close()


def test_a_subgraph_s_run_follows_its_graph_back_too():
    # Each namespace is a run of its own (a subgraph's, a child run): each says what was
    # taken out of it, and each status is read back from what LangGraph sees of it.
    saver, thread = DurableSaver(graph="nested"), uuid.uuid4().hex
    graph = graphs.with_subgraph().compile(checkpointer=saver)
    graph.invoke({"log": [], "answer": ""}, invocation(thread, "ask"))
    graph.invoke(Command(resume="left"), invocation(thread, "answer"))
    runs = Run.objects.filter(langgraph_thread__thread_id=thread)
    assert {r.status for r in runs} == {"succeeded"}
    saver.delete_for_runs(["answer"])
    runs = {t.checkpoint_ns == "": t.run for t in Thread.objects.filter(thread_id=thread)}
    assert runs[True].status == "waiting" and runs[False].status == "waiting"
    for run in runs.values():
        assert [(actor, d["moved"]) for actor, d in hidings(run)] == [(HIDER, True)]
    # The answer stayed with the subgraph's interrupt: the graph ends as it did with it.
    reference = graphs.with_subgraph().compile(checkpointer=InMemorySaver())
    reference.invoke({"log": [], "answer": ""}, invocation(thread, "ask"))
    expected = reference.invoke(Command(resume="left"), invocation(thread, "answer"))
    assert graph.invoke(None, invocation(thread, "again")) == expected
    saver.close()
