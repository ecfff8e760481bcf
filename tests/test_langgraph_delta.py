"""LangGraph's delta channels (``DeltaChannel``, beta in LangGraph) with ``DurableSaver``: the
same results and history as ``InMemorySaver``; ``get_delta_channel_history`` answers what
LangGraph's default answers through ``get_tuple`` (``durability.langgraph.delta``); and
``keep_latest`` pruning and ``delete_for_runs``, which would cut such a thread off what it
is rebuilt from, are refused."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from django.test import Client
from django.urls import reverse
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver

from durability import operations
from durability.langgraph import DurableSaver, delta
from durability.langgraph.models import PendingWrite, SavedCheckpoint, Thread
from tests import langgraph_graphs as graphs
from tests.dashboard_helpers import OPERATORS, make_user
from tests.test_langgraph_saver import in_own_loop

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

CHANNELS = ["messages", "log", "turns", "no-such-channel"]


def config(thread: str | None = None) -> dict:
    return {"configurable": {"thread_id": thread or uuid.uuid4().hex}}


def first() -> dict:
    return {"messages": [HumanMessage("hello", id="human-0")], "log": ["start"], "turns": 0}


def history(graph, cfg) -> list:
    return [
        (s.values, s.next, s.metadata.get("source"), s.metadata.get("step"))
        for s in graph.get_state_history(cfg)
    ]


def converse(graph, cfg) -> list:
    """Two turns, an edit of an older checkpoint and a replay from another: every way a
    thread's history branches. What each call answered."""
    out = [graph.invoke(first(), cfg)]
    more = {"messages": [HumanMessage("and then?", id="human-1")], "log": ["more"], "turns": 0}
    out.append(graph.invoke(more, cfg))
    states = list(graph.get_state_history(cfg))
    edited = graph.update_state(states[4].config, {"log": ["edited"], "turns": 2}, as_node="model")
    out.append(graph.invoke(None, edited))
    out.append(graph.invoke(None, states[9].config))
    return out


def test_a_delta_channel_graph_matches_in_memory_and_verifies():
    builder = graphs.delta_chat(turns=4)
    ours = builder.compile(checkpointer=DurableSaver())
    theirs = builder.compile(checkpointer=InMemorySaver())
    a, b = config(), config()
    assert converse(ours, a) == converse(theirs, b)
    assert history(ours, a) == history(theirs, b)
    # A new process (a new saver) loads the thread's channels from what is stored.
    other = builder.compile(checkpointer=DurableSaver())
    assert other.get_state(a).values == theirs.get_state(b).values
    assert history(other, a) == history(theirs, b)
    thread = Thread.objects.get(thread_id=a["configurable"]["thread_id"])
    (report,) = operations.verify(thread.run_id)
    assert report.ok, str(report)


def same_as_default(saver, cfg) -> dict:
    """The saver's answer for ``cfg``, checked against LangGraph's default walk."""
    ours = saver.get_delta_channel_history(config=cfg, channels=CHANNELS)
    default = BaseCheckpointSaver.get_delta_channel_history(saver, config=cfg, channels=CHANNELS)
    assert ours == default, cfg
    return ours


def test_delta_history_is_what_langgraphs_default_walk_answers():
    saver = DurableSaver()
    graph = graphs.delta_chat(turns=6).compile(checkpointer=saver)
    cfg = config()
    converse(graph, cfg)
    walks = [same_as_default(saver, s.config)["messages"] for s in graph.get_state_history(cfg)]
    assert any("seed" in walk for walk in walks) and any("seed" not in walk for walk in walks)
    # Without a checkpoint id: the latest's. The async form answers the same.
    latest = saver.get_delta_channel_history(config=cfg, channels=CHANNELS)
    assert latest["messages"] == walks[0]
    assert in_own_loop(saver.aget_delta_channel_history(config=cfg, channels=CHANNELS)) == latest
    # Nothing to walk for an unknown thread, or for no channel.
    unknown = saver.get_delta_channel_history(config=config(), channels=["messages"])
    assert unknown == {"messages": {"writes": []}}
    assert saver.get_delta_channel_history(config=cfg, channels=[]) == {}


def test_a_long_walk_reads_the_ancestors_page_after_page():
    # More supersteps since the last snapshot than a page holds (``delta.FIRST_PAGE``).
    turns = delta.FIRST_PAGE + 6
    saver = DurableSaver()
    graph = graphs.delta_chat(turns=turns, every=2 * turns).compile(checkpointer=saver)
    cfg = config()
    graph.invoke(first(), cfg)
    states = list(graph.get_state_history(cfg))
    walk = same_as_default(saver, states[0].config)
    assert len(walk["messages"]["writes"]) > delta.FIRST_PAGE
    assert "seed" not in walk["messages"]  # never snapshotted: the walk reached the root
    same_as_default(saver, states[len(states) // 2].config)


def test_an_async_graph_with_delta_channels():
    builder = graphs.delta_chat(turns=5)
    ours = builder.compile(checkpointer=DurableSaver())
    theirs = builder.compile(checkpointer=InMemorySaver())
    a, b = config(), config()

    async def two_turns(graph, cfg):
        done = [await graph.ainvoke(first(), cfg)]
        more = {"messages": [HumanMessage("more", id="human-1")], "turns": 0}
        done.append(await graph.ainvoke(more, cfg))
        return done, [s.values async for s in graph.aget_state_history(cfg)]

    assert in_own_loop(two_turns(ours, a)) == in_own_loop(two_turns(theirs, b))


def test_keep_latest_refuses_threads_with_delta_channels_and_changes_nothing():
    saver = DurableSaver()
    delta_graph = graphs.delta_chat(turns=4).compile(checkpointer=saver)
    plain_graph = graphs.tool_loop(turns=2).compile(checkpointer=saver)
    with_delta, plain = config(), config()
    delta_graph.invoke(first(), with_delta)
    plain_graph.invoke(graphs.first_input(), plain)
    before = (SavedCheckpoint.objects.count(), PendingWrite.objects.count())
    values = delta_graph.get_state(with_delta).values
    ids = [plain["configurable"]["thread_id"], with_delta["configurable"]["thread_id"]]
    with pytest.raises(NotImplementedError, match=f"DeltaChannel.*{ids[1]}.*nothing was pruned"):
        saver.prune(ids)
    assert (SavedCheckpoint.objects.count(), PendingWrite.objects.count()) == before
    # Nor are an invocation's checkpoints taken out of such a thread (``delete_for_runs``).
    delta_graph.invoke(first(), {**with_delta, "metadata": {"run_id": "delta-turn"}})
    before = (SavedCheckpoint.objects.count(), PendingWrite.objects.count())
    values = delta_graph.get_state(with_delta).values
    with pytest.raises(NotImplementedError, match=f"DeltaChannel.*{ids[1]}.*nothing was deleted"):
        saver.delete_for_runs(["delta-turn"])
    assert (SavedCheckpoint.objects.count(), PendingWrite.objects.count()) == before
    assert delta_graph.get_state(with_delta).values == values
    # A thread without one is pruned as before; ``delete`` takes either.
    saver.prune(ids[:1])
    assert len(list(plain_graph.get_state_history(plain))) == 1
    saver.prune(ids[1:], strategy="delete")
    assert delta_graph.get_state(with_delta).values == {}
    assert not Thread.objects.filter(thread_id=ids[1]).exists()


def test_the_dashboard_shows_a_delta_channel_run(settings):
    Path(settings.STATIC_ROOT).mkdir(parents=True, exist_ok=True)
    graph = graphs.delta_chat(turns=4).compile(checkpointer=DurableSaver())
    cfg = config()
    graph.invoke(first(), cfg)
    run = Thread.objects.get(thread_id=cfg["configurable"]["thread_id"]).run
    client = Client()
    client.force_login(make_user("olive", OPERATORS))
    assert client.get(reverse("dashboard:run", args=[run.id])).status_code == 200
    held = {}
    for seq in range(1, run.head_seq + 1):
        page = client.get(reverse("dashboard:checkpoint", args=[run.id, seq]), {"tab": "state"})
        assert page.status_code == 200
        state = client.get(reverse("dashboard:state_json", args=[run.id, seq])).json()
        if "messages" in state["values"]:
            held[seq] = state["values"]["messages"]
    # Where LangGraph stored the channel whole, its messages read as JSON.
    assert held, "LangGraph stored no snapshot of the channel"
    messages = list(held.values())[-1]
    assert messages["value"][1] == {"type": "ai", "content": "answer 0", "id": "ai-0-1"}
    diff = client.get(reverse("dashboard:diff", args=[run.id]), {"a": 1, "b": run.head_seq})
    assert diff.status_code == 200
