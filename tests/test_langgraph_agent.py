"""A LangGraph graph registered as an agent, executed by the engine in this process: one
superstep per checkpoint, the same final state as LangGraph's InMemorySaver, journaled
tools replayed instead of paid again, and bad definitions refused with a clear error."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from langgraph.checkpoint.memory import InMemorySaver

from dashboard import runinfo, timeline
from durability import events, operations, registry
from durability.errors import AgentDefinitionError, InvalidInput, SchemaViolation, UnknownAgent
from durability.langgraph import agent, journaled
from durability.models import (
    Approval,
    ApprovalStatus,
    Checkpoint,
    JournalEntry,
    Run,
    RunStatus,
)
from durability.runtime import inflight
from durability.testing import drive
from tests import langgraph_agents as graphs
from tests import langgraph_graphs
from tests.dashboard_helpers import OPERATORS, make_user

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger"
    path.touch()
    monkeypatch.setenv("LG_TOOL_LEDGER", str(path))
    monkeypatch.setattr(graphs, "PAUSE", 0.0)
    return path


def reference_config() -> dict:
    return {"configurable": {"thread_id": "reference"}}


def reference(turns: int = graphs.TURNS) -> dict:
    """The graph run uninterrupted by LangGraph alone."""
    graph = graphs.support_graph(turns).compile(checkpointer=InMemorySaver())
    return graph.invoke(graphs.first_input(), {"configurable": {"thread_id": "reference"}})


def paid(ledger, run_id) -> list[tuple[str, str]]:
    lines = [line.split() for line in ledger.read_text().splitlines()]
    return sorted((tool, arg) for thread, tool, arg, _ts in lines if thread == str(run_id))


@pytest.mark.smoke
def test_a_registered_graph_runs_one_superstep_per_checkpoint(ledger):
    run = operations.start("lg-support", graphs.first_input())
    assert run.status == RunStatus.QUEUED
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    expected = reference()
    assert graphs.values_of(run.id) == expected
    # The input and the first superstep, then one checkpoint per superstep: model, then
    # tools beside audit, five times, and the last model turn.
    assert done.head_seq == 1 + 1 + 2 * graphs.TURNS
    steps = set(Checkpoint.objects.filter(run=run, seq__gt=0).values_list("next_step", flat=True))
    assert steps == {"graph", ""}
    assert operations.verify(run.id)[0].ok
    # Each tool call paid once and journaled under its node's name.
    keys = sorted(JournalEntry.objects.filter(run=run).values_list("key", flat=True))
    assert keys == sorted(["tools/search"] * graphs.TURNS + ["audit/log"] * graphs.TURNS)
    assert paid(ledger, run.id) == sorted(
        [("search", f"q{i}") for i in range(graphs.TURNS)]
        + [("log", f"t{i + 1}") for i in range(graphs.TURNS)]
    )


@pytest.mark.smoke
def test_a_superstep_run_again_replays_its_journaled_tools(ledger, faults):
    # The process dies while committing the superstep that ran both tools (checkpoint #3):
    # its tools' results were journaled; running the superstep again replays them.
    faults.set({"point": "in_commit", "when": {"seq": 3}, "action": "crash"})
    run = operations.start("lg-support", graphs.first_input())
    done = drive(run.id)
    assert faults.fired() == 1
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert graphs.values_of(run.id) == reference()
    assert len(paid(ledger, run.id)) == 2 * graphs.TURNS
    # Each journaled call of that superstep was served from its record once: what the API's
    # calls and the timeline's "replayed" say (counted from the events that name them).
    replays = events.replay_counts(run.id)
    tools = JournalEntry.objects.filter(run=run, step="graph", kind="call")
    again = [j for j in tools if replays[j.id]]
    assert again and all(replays[j.id] == 1 for j in again), replays
    items = timeline.latest(run).items
    assert any(("replayed", "1x") in item.facts for item in items)
    # And the checkpoint page's calls tab, on the checkpoint the superstep started from.
    base = Checkpoint.objects.get(pk=again[0].base_id)
    shown = runinfo.inspector(run, base, "calls").made_from
    assert [j.replays for j in shown if j.id == again[0].id] == [1]


def test_a_journaled_tool_outside_a_worker_just_runs():
    calls = []

    @journaled("ping")
    def ping(x: int) -> int:
        calls.append(x)
        return x + 1

    assert ping(1) == 2 and calls == [1]


def test_bad_definitions_and_inputs_are_refused_with_a_clear_error_writing_nothing():
    with pytest.raises(AgentDefinitionError, match="build must be a function"):
        agent("lg-bad", 42, register=False)  # type: ignore[arg-type]
    with pytest.raises(UnknownAgent):
        operations.start("lg-nobody", {})
    with pytest.raises(SchemaViolation, match="a graph needs an input"):
        operations.start("lg-support", None)
    with pytest.raises(InvalidInput):
        operations.start("lg-support", {"messages": {1, 2}})
    assert not Run.objects.exists()


def test_a_build_that_makes_no_graph_is_refused_naming_why():
    agent("lg-not-a-graph", lambda: {"nodes": []})
    try:
        with pytest.raises(AgentDefinitionError, match="not a LangGraph StateGraph or compiled"):
            operations.start("lg-not-a-graph", {})
        assert not Run.objects.filter(agent="lg-not-a-graph").exists()
        # A run started before its build broke (a deploy in between) fails at its step.
        agent("lg-not-a-graph", lambda: graphs.support_graph(1))
        run = operations.start("lg-not-a-graph", graphs.first_input())
        agent("lg-not-a-graph", lambda: {"nodes": []})
        done = drive(run.id)
        assert done.status == RunStatus.FAILED
        assert "not a LangGraph StateGraph or compiled graph" in done.error
    finally:
        registry.unregister("lg-not-a-graph")


def refund_reference(answer: dict) -> dict:
    from langgraph.types import Command

    graph = graphs.refund_graph().compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "reference"}}
    graph.invoke({"amount": 50, "paid": 0, "answer": {}}, cfg)
    (waiting,) = graph.get_state(cfg).interrupts
    return graph.invoke(Command(resume={waiting.id: answer}), cfg)


@pytest.mark.smoke
@pytest.mark.parametrize(
    "approve, edited, paid_amount",
    [(True, None, 50), (True, {"question": "refund?", "amount": 20}, 20), (False, None, 0)],
    ids=["approve", "approve with edits", "reject"],
)
def test_an_interrupt_is_an_approval_whose_decision_resumes_the_graph(
    ledger, approve, edited, paid_amount
):
    run = operations.start("lg-refund", {"amount": 50, "paid": 0, "answer": {}})
    waiting = drive(run.id)
    assert waiting.status == RunStatus.WAITING and waiting.wait_reason == "approval"
    asked = Approval.objects.get(run=run, status=ApprovalStatus.PENDING)
    assert asked.name == "ask"
    assert operations.canonical.loads(asked.payload) == {"question": "refund?", "amount": 50}
    operations.decide(run.id, "ask", approve=approve, by="ops", comment="ok", payload=edited)
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    answer = {
        "approved": approve,
        "value": edited or {"question": "refund?", "amount": 50},
        "comment": "ok",
        "by": "ops",
    }
    assert graphs.values_of(run.id) == refund_reference(answer)
    assert graphs.values_of(run.id)["paid"] == paid_amount
    assert paid(ledger, run.id) == ([("pay", str(paid_amount))] if approve else [])


def test_a_message_reaches_a_graph_waiting_for_it():
    run = operations.start("lg-chat", {"got": [], "ticks": 0})
    waiting = drive(run.id)
    assert waiting.status == RunStatus.WAITING and waiting.wait_reason == "message"
    operations.send(run.id, "reply", {"text": "hi"}, by="user")
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert graphs.values_of(run.id) == {"got": [{"text": "hi"}, "answered 1"], "ticks": 1}


def test_a_message_sent_before_the_graph_waits_is_kept_for_it():
    run = operations.start("lg-chat", {"got": [], "ticks": 0})
    operations.send(run.id, "reply", "early", by="user")
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert graphs.values_of(run.id)["got"] == ["early", "answered 1"]


def test_outside_a_worker_wait_for_is_an_interrupt_resumed_with_the_message():
    from langgraph.types import Command

    graph = graphs.chat_graph().compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "by-hand"}}
    graph.invoke({"got": [], "ticks": 0}, cfg)
    (waiting,) = graph.get_state(cfg).interrupts
    assert waiting.value == {"wait_for": "reply"}
    assert graph.invoke(Command(resume="hi"), cfg)["got"] == ["hi", "answered 1"]


def test_a_graph_refuses_the_periodic_level():
    with pytest.raises(AgentDefinitionError, match="periodic"):
        agent("lg-periodic", graphs.chat_graph, durability="periodic", register=False)
    # Nor can one run of it be started at that level (it was, and stored a checkpoint for
    # several supersteps).
    before = Run.objects.count()
    with pytest.raises(InvalidInput, match="agent lg-refund: a graph checkpoints every"):
        operations.start("lg-refund", {"amount": 50, "paid": 0}, durability="periodic")
    assert Run.objects.count() == before


def test_input_the_graph_does_not_take_is_refused_before_a_run_is_made():
    """LangGraph reads the input as the run's first superstep will, up to its first node
    (which does not run): a run made of it failed on the worker instead."""
    before = Run.objects.count()
    for bad in ("hello", [1, 2]):
        with pytest.raises(SchemaViolation, match="input of agent lg-refund: the graph does not"):
            operations.start("lg-refund", bad)
    # A key the graph has no channel for, which LangGraph itself would drop silently.
    with pytest.raises(SchemaViolation) as misspelt:
        operations.start("lg-refund", {"amount": 50, "payed": 0})
    assert str(misspelt.value) == (
        "[DUR102] input of agent lg-refund: the graph takes no 'payed' (it takes: amount,"
        " answer, paid); nothing was started"
    )
    assert Run.objects.count() == before
    run = operations.start("lg-refund", {"amount": 50, "paid": 0, "answer": {}})
    assert run.status == RunStatus.QUEUED


def test_a_graphs_interrupt_takes_only_the_edits_its_agent_allows(ledger):
    """``agent(approvals={node: ...})``: the interrupt's approval takes ``ctx.approval``'s
    options; an edit outside them is refused, nothing recorded, and the one allowed is what
    the graph pays."""
    from durability.approvals import EditRefused

    run = operations.start("lg-guarded-refund", {"amount": 50, "paid": 0, "answer": {}})
    assert drive(run.id).wait_reason == "approval"
    for edit, said in (
        ({"amount": -5}, "amount"),
        ({"amount": 80}, "the refund is at most the 50 asked"),
        ({"question": "more?", "amount": 20}, "question"),
    ):
        with pytest.raises(EditRefused, match=said):
            operations.decide(run.id, "ask", approve=True, by="ops", payload=edit)
    assert Approval.objects.get(run=run).status == ApprovalStatus.PENDING
    operations.decide(run.id, "ask", approve=True, by="ops", payload={"amount": 20})
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert graphs.values_of(run.id)["paid"] == 20
    assert paid(ledger, run.id) == [("pay", "20")]


def test_approval_options_of_a_graph_are_checked_when_it_is_registered():
    for approvals, said in (
        ({"ask": {"editabel": False}}, "not editabel"),
        ({"ask": False}, "takes editable, validate, group"),
        (["ask"], "approvals must map node names to options"),
    ):
        with pytest.raises(AgentDefinitionError, match=said):
            agent("lg-misspelt", graphs.support_graph, approvals=approvals)
    assert "lg-misspelt" not in {a.name for a in registry.all()}


def refunded(approve: bool = True):
    run = operations.start("lg-refund", {"amount": 50, "paid": 0, "answer": {}})
    drive(run.id)
    operations.decide(run.id, "ask", approve=approve, by="ops")
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    return done


def test_rollback_to_a_superstep_previews_the_effect_and_asks_before_paying_again(ledger):
    run = refunded()
    # #1 the input, #2 the resumed ask, #3 act (the refund paid): back to #2.
    assert run.head_seq == 3
    plan = operations.plan_rollback(run.id, 2)
    assert [e.key for e in plan.done_not_undone] == ["act/pay"]
    operations.rollback(run.id, 2, by="ops", reason="pay again?", and_continue=True)
    waiting = drive(run.id)
    assert waiting.status == RunStatus.WAITING and waiting.wait_reason == "approval"
    asked = Approval.objects.get(run=run, status=ApprovalStatus.PENDING)
    assert asked.name.endswith("act/pay")
    assert paid(ledger, run.id) == [("pay", "50")]
    operations.decide(run.id, asked.name, approve=False, by="ops", comment="no")
    failed = drive(run.id)
    assert failed.status == RunStatus.FAILED and "not performed again" in failed.error
    assert paid(ledger, run.id) == [("pay", "50")]


@pytest.mark.smoke
def test_rollback_and_continue_reusing_the_outcome_resumes_the_graph_without_paying(ledger):
    run = refunded()
    plan = operations.plan_rollback(run.id, 2)
    (done,) = plan.done_not_undone
    operations.rollback(
        run.id, 2, by="ops", reason="again", and_continue=True, decisions={done.id: "reuse"}
    )
    again = drive(run.id)
    assert again.status == RunStatus.SUCCEEDED, again.error
    assert again.head_seq == 5  # the rollback's new head, then act once more
    assert graphs.values_of(run.id)["paid"] == 50
    assert paid(ledger, run.id) == [("pay", "50")]


def test_a_fork_from_a_superstep_continues_the_graph_in_a_new_run(ledger):
    run = operations.start("lg-support", graphs.first_input())
    drive(run.id)
    fork = operations.fork(run.id, 4, by="ops", reason="try again from turn 2")
    done = drive(fork.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert graphs.values_of(fork.id) == reference()
    # The fork's calls are its own: #3 ran the first turn's tools, the other four turns'
    # ran again in the fork (a run, and a thread, of its own).
    assert paid(ledger, fork.id) == sorted(
        [("search", f"q{i}") for i in range(1, graphs.TURNS)]
        + [("log", f"t{i + 1}") for i in range(1, graphs.TURNS)]
    )


@pytest.mark.smoke
def test_a_graph_with_delta_channels_keeps_their_values_at_every_superstep():
    # LangGraph keeps a delta channel's value out of most checkpoints and rebuilds it from
    # older ones; the run's state is one checkpoint, so it holds their values whole.
    start = {
        "messages": [{"type": "human", "content": "hello", "id": "human-0"}],
        "log": ["start"],
        "turns": 0,
    }
    graph = langgraph_graphs.delta_chat(turns=7).compile(checkpointer=InMemorySaver())
    expected = graph.invoke(start, {"configurable": {"thread_id": "reference"}})
    run = operations.start("lg-delta", start)
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert graphs.values_of(run.id) == expected
    # Each superstep's checkpoint shows them as JSON, one more turn each.
    states = [operations.state_at(run, seq) for seq in range(2, done.head_seq + 1)]
    assert [len(state["values"]["log"]) for state in states] == list(range(3, 17, 2))
    assert all(m["__lg__"] == "message" for m in states[-1]["values"]["messages"])
    # A fork from the middle goes on from the values that superstep held.
    fork = operations.fork(run.id, 4, by="ops", reason="again from turn 2")
    assert drive(fork.id).status == RunStatus.SUCCEEDED
    assert graphs.values_of(fork.id) == expected


@pytest.mark.smoke
@pytest.mark.parametrize(
    "name, build",
    [("lg-fan-out", langgraph_graphs.fan_out), ("lg-handled", langgraph_graphs.handled_failure)],
)
def test_map_reduce_and_a_handled_error_run_as_langgraph_runs_them(name, build):
    start = {"log": [], "n": 0}
    expected = build().compile(checkpointer=InMemorySaver()).invoke(start, reference_config())
    run = operations.start(name, start)
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert graphs.values_of(run.id) == expected


def test_rollback_compensating_the_effect_runs_its_compensation_then_pays_again(ledger):
    run = refunded()
    (done,) = operations.plan_rollback(run.id, 2).done_not_undone
    operations.rollback(
        run.id, 2, by="ops", reason="undo", and_continue=True, decisions={done.id: "compensate"}
    )
    again = drive(run.id)
    assert again.status == RunStatus.SUCCEEDED, again.error
    assert paid(ledger, run.id) == [("pay", "50"), ("pay", "50"), ("unpay", "50")]


def test_a_node_asking_twice_asks_one_approval_after_the_other():
    run = operations.start("lg-questions", {"first": None, "second": None})
    drive(run.id)
    operations.decide(run.id, "ask", approve=True, by="ops")
    waiting = drive(run.id)
    assert waiting.status == RunStatus.WAITING and waiting.wait_reason == "approval"
    second = Approval.objects.get(run=run, status=ApprovalStatus.PENDING)
    assert operations.canonical.loads(second.payload) == {"question": "second?"}
    operations.decide(run.id, "ask", approve=False, by="ops", comment="not the second")
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert graphs.values_of(run.id) == {"first": True, "second": False}
    assert Approval.objects.filter(run=run).count() == 2


def test_an_interrupt_inside_a_subgraph_is_an_approval_too():
    from langgraph.types import Command

    from tests import langgraph_graphs

    run = operations.start("lg-nested", {"log": [], "answer": ""})
    waiting = drive(run.id)
    assert waiting.status == RunStatus.WAITING and waiting.wait_reason == "approval"
    operations.decide(run.id, "sub", approve=True, by="ops", comment="the red one")
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    graph = langgraph_graphs.with_subgraph().compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "reference"}}
    graph.invoke({"log": [], "answer": ""}, cfg)
    (asked,) = graph.get_state(cfg).interrupts
    answer = {"approved": True, "value": "which?", "comment": "the red one", "by": "ops"}
    assert graphs.values_of(run.id) == graph.invoke(Command(resume={asked.id: answer}), cfg)


def test_an_interrupt_whose_value_is_not_json_fails_the_run_naming_it():
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import interrupt

    def build() -> StateGraph:
        def ask(state: dict) -> dict:
            return {"answer": interrupt({"choices": {1, 2}})}

        g = StateGraph(dict)
        g.add_node("ask", ask)
        g.add_edge(START, "ask")
        g.add_edge("ask", END)
        return g

    agent("lg-not-json", build)
    try:
        run = operations.start("lg-not-json", {"answer": None})
        done = drive(run.id)
        assert done.status == RunStatus.FAILED
        assert "payload of approval 'ask'" in done.error, done.error
        assert not Approval.objects.filter(run=run).exists()
    finally:
        registry.unregister("lg-not-json")


def test_a_graph_executed_off_the_main_thread_runs_the_same(ledger):
    # As in a worker of Celery's threads pool: the step's thread is not the main thread, and
    # journaled calls run on it as well as on LangGraph's task threads.
    run = operations.start("lg-support", graphs.first_input())
    outcome = {}

    def execute() -> None:
        try:
            outcome["run"] = drive(run.id)
        finally:
            # The thread's sessions: Django's and the one its commits were sent ahead on.
            inflight.channel().close()
            connection.close()

    thread = threading.Thread(target=execute)
    thread.start()
    thread.join(60)
    assert outcome["run"].status == RunStatus.SUCCEEDED, outcome["run"].error
    assert graphs.values_of(run.id) == reference()
    assert len(paid(ledger, run.id)) == 2 * graphs.TURNS


@pytest.mark.parametrize("where", ["interrupt_before", "interrupt_after"])
def test_a_graph_compiled_with_static_breakpoints_is_refused_naming_why(where):
    """Each execution runs one superstep and stops: a static breakpoint would be passed by
    silently. Starting a run is refused, saying what to use instead; nothing is made."""
    agent("lg-breakpoints", lambda: graphs.support_graph(1).compile(**{where: ["tools"]}))
    try:
        with pytest.raises(AgentDefinitionError) as refused:
            operations.start("lg-breakpoints", graphs.first_input())
        assert "compiled with interrupt_before or interrupt_after" in str(refused.value)
        assert "interrupt() in the node" in str(refused.value)
        assert not Run.objects.filter(agent="lg-breakpoints").exists()
        # The deployment's to fix, not the caller's input: the API and the dashboard say it
        # alike (500, with the code and the sentence above).
        from api.problems import status_of
        from dashboard.views.common import status_for

        assert status_of(refused.value) == status_for(refused.value) == 500
    finally:
        registry.unregister("lg-breakpoints")


def test_a_compiled_graph_is_registered_too():
    agent("lg-compiled", lambda: graphs.support_graph(1).compile())
    try:
        run = operations.start("lg-compiled", graphs.first_input())
        assert drive(run.id).status == RunStatus.SUCCEEDED
        assert graphs.values_of(run.id) == reference(turns=1)
    finally:
        registry.unregister("lg-compiled")


def test_the_dashboard_shows_a_registered_graphs_state_decoded(ledger, settings):
    """Its checkpoints hold the saver's document: the state tab shows the channel values
    first, messages as their type and fields, as for a graph run in its own process."""
    Path(settings.STATIC_ROOT).mkdir(parents=True, exist_ok=True)
    run = operations.start("lg-support", graphs.first_input())
    assert drive(run.id).status == RunStatus.SUCCEEDED
    client = Client()
    client.force_login(make_user("olive", OPERATORS))
    url = reverse("dashboard:checkpoint", args=[run.id, 3])
    top = client.get(f"{url}?tab=state").content.decode()
    assert top.index("values") < top.index("checkpoint</")
    tree = reverse("dashboard:tree", args=[run.id, 3])
    message = client.get(tree, {"path": "/values/messages/2"}, HTTP_HX_REQUEST="true")
    shown = message.content.decode()
    assert "tool_call_id" in shown and "call-0" in shown and '"type"' not in shown, shown
    # The timeline tells each checkpoint as its superstep: which nodes ran, what they wrote,
    # where the graph went (a rollback or fork target is picked by them, not by number).
    items = {i.seq: i for i in timeline.latest(run).items if i.kind == "checkpoint"}
    from dashboard import graphruns

    graphruns.annotate(run, items.values())
    assert (items[1].title, items[1].detail) == (
        "checkpoint #1 · superstep 0",
        "input wrote messages → model",
    )
    assert items[2].title == "checkpoint #2 · superstep 1"
    assert items[2].detail == "model wrote messages, turns → tools, audit", items[2].detail
    assert items[3].detail == "audit, tools wrote messages, notes → model", items[3].detail
    page = client.get(reverse("dashboard:run", args=[run.id])).content.decode()
    assert "model wrote messages, turns → tools, audit" in page
    # And the CLI's show, text and JSON.
    out = io.StringIO()
    call_command("durability", "show", str(run.id), stdout=out)
    assert "superstep 1: model wrote messages, turns → tools, audit" in out.getvalue()
    out = io.StringIO()
    call_command("durability", "show", str(run.id), "--json", stdout=out)
    second = json.loads(out.getvalue())["checkpoints"][2]["superstep"]
    assert second == {
        "step": 1,
        "nodes": ["model"],
        "wrote": ["messages", "turns"],
        "routes": ["tools", "audit"],
    }
