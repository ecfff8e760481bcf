"""A graph registered as an agent, forked from one of its supersteps with its state edited:
the fork goes on from the edit as LangGraph's own time travel (``update_state`` on that
checkpoint, then ``invoke(None)``) goes on, pays only for what it runs itself, and leaves
its source as it was. An edit LangGraph could not load is refused, creating nothing."""

from __future__ import annotations

import copy

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from durability import operations
from durability.errors import SchemaViolation
from durability.models import Run, RunStatus
from durability.testing import drive
from tests import langgraph_agents as graphs
from tests.test_langgraph_agent import ledger, paid, reference  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db(transaction=True)

FORKED_AT = 4  # the checkpoint after superstep 3: the model asked for search q1


def time_travel(turns: int) -> dict:
    """LangGraph alone: the same superstep's checkpoint, ``turns`` set, run to the end."""
    graph = graphs.support_graph().compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "time-travel"}}
    graph.invoke(graphs.first_input(), config)
    at = next(s for s in graph.get_state_history(config) if s.metadata.get("step") == 3)
    edited = graph.update_state(at.config, {"turns": turns}, as_node="model")
    return graph.invoke(None, edited)


def test_a_fork_with_an_edited_channel_goes_on_as_langgraphs_time_travel(ledger):  # noqa: F811
    run = operations.start("lg-support", graphs.first_input())
    assert drive(run.id).status == RunStatus.SUCCEEDED
    source_values = graphs.values_of(run.id)
    state = operations.state_at(run.id, FORKED_AT)
    assert state["values"]["turns"] == 2
    state["values"]["turns"] = 4  # skip two turns
    fork = operations.fork(run.id, FORKED_AT, state=state, by="ops", reason="skip two turns")
    done = drive(fork.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert graphs.values_of(fork.id) == time_travel(4)
    assert graphs.values_of(fork.id)["notes"] == ["logged t1", "logged t4", "logged t5"]
    # Its own calls only: the superstep it starts with (search q1, log t4), then one turn.
    assert paid(ledger, fork.id) == [
        ("log", "t4"),
        ("log", "t5"),
        ("search", "q1"),
        ("search", "q4"),
    ]
    assert graphs.values_of(run.id) == source_values == reference()


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda s: s.pop("checkpoint"), "'checkpoint' must be a JSON object"),
        (lambda s: s.update(values=[1, 2]), "'values' must be a JSON object"),
        (lambda s: s.update(extra=1), "unknown keys ['extra']"),
        (lambda s: s["checkpoint"].update(id=7), "checkpoint.id must be a string"),
        (lambda s: s["checkpoint"].pop("versions_seen"), "checkpoint.versions_seen must be"),
    ],
)
def test_an_edit_langgraph_could_not_load_is_refused_creating_nothing(ledger, edit, said):  # noqa: F811
    run = operations.start("lg-support", graphs.first_input())
    drive(run.id)
    state = copy.deepcopy(operations.state_at(run.id, FORKED_AT))
    edit(state)
    before = Run.objects.count()
    with pytest.raises(SchemaViolation, match="is not a graph checkpoint: ") as refused:
        operations.fork(run.id, FORKED_AT, state=state, by="ops")
    assert said in str(refused.value)
    assert Run.objects.count() == before


def test_an_edit_of_a_channel_the_graph_does_not_have_is_refused_creating_nothing(ledger):  # noqa: F811
    """LangGraph would load it and drop it at the next superstep: a misspelt channel would
    be an edit the operator believes was made."""
    run = operations.start("lg-support", graphs.first_input())
    drive(run.id)
    state = copy.deepcopy(operations.state_at(run.id, FORKED_AT))
    state["values"]["turn"] = 4  # the graph's channel is "turns"
    before = Run.objects.count()
    with pytest.raises(SchemaViolation) as refused:
        operations.fork(run.id, FORKED_AT, state=state, by="ops")
    said = str(refused.value)
    assert "the graph has no channel 'turn' (its channels: " in said and "turns" in said, said
    assert Run.objects.count() == before


def test_an_edited_message_that_is_no_longer_a_message_is_refused_creating_nothing(ledger):  # noqa: F811
    """Messages are stored as their fields, which an operator may edit; an edit the
    message's class refuses is refused at the fork, not when a worker loads it."""
    run = operations.start("lg-support", graphs.first_input())
    drive(run.id)
    state = copy.deepcopy(operations.state_at(run.id, FORKED_AT))
    asked = next(m for m in state["values"]["messages"] if m.get("class") == "AIMessage")
    asked["fields"]["tool_calls"] = "search everything"
    before = Run.objects.count()
    with pytest.raises(SchemaViolation, match="not a graph checkpoint LangGraph can load") as no:
        operations.fork(run.id, FORKED_AT, state=state, by="ops")
    index = state["values"]["messages"].index(asked)
    assert f"values.messages[{index}] (AIMessage): " in str(no.value), str(no.value)
    assert Run.objects.count() == before
    # The same message edited within its schema is a fork like any other.
    asked["fields"]["tool_calls"] = []
    asked["fields"]["content"] = "no search needed"
    fork = operations.fork(run.id, FORKED_AT, state=state, by="ops")
    assert Run.objects.count() == before + 1 and fork.status == RunStatus.QUEUED
