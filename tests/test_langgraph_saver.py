"""The LangGraph checkpointer against LangGraph's contract: each documented pattern runs
with ``DurableSaver`` and with LangGraph's ``InMemorySaver``, and the results, the history
(``get_state_history``) and the pending writes must be the same."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections
from langchain_core.messages import RemoveMessage
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from durability import canonical, checkpoints, operations, redact
from durability.langgraph import DurableSaver, ThreadDeleted, memory, store
from durability.langgraph import cli as lg_cli
from durability.langgraph.models import PendingWrite, SavedCheckpoint, Thread
from durability.models import Checkpoint, Run, Snapshot
from durability.store import langgraph as lg_store
from tests import langgraph_graphs as graphs

# The whole contract runs on the embedded default too (the smoke subset), as the saver has a
# statement path per database.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]


def plain(result: dict) -> dict:
    """A result without interrupt ids (made from random checkpoint ids)."""
    out = dict(result)
    if "__interrupt__" in out:
        out["__interrupt__"] = [i.value for i in out["__interrupt__"]]
    return out


def config(thread: str | None = None) -> dict:
    return {"configurable": {"thread_id": thread or uuid.uuid4().hex}}


def history(graph, cfg) -> list:
    """What a user sees of a thread's history, without ids and timestamps."""
    return [
        (
            s.values,
            s.next,
            s.metadata.get("source"),
            s.metadata.get("step"),
            [(t.name, t.error is not None, [i.value for i in t.interrupts]) for t in s.tasks],
        )
        for s in graph.get_state_history(cfg)
    ]


def a_saved(saver, cfg) -> Callable[[], bool]:
    """True once ``saver`` holds branch ``a``'s write (for ``graphs.branches``)."""

    def check() -> bool:
        saved = saver.get_tuple(cfg)
        return saved is not None and any(w[1:] == ("log", ["a"]) for w in saved.pending_writes)

    return check


def both(builder, **compile_kwargs):
    return (
        builder.compile(checkpointer=DurableSaver(), **compile_kwargs),
        builder.compile(checkpointer=InMemorySaver(), **compile_kwargs),
    )


def run_of(cfg, ns: str = "") -> Run:
    return Thread.objects.get(thread_id=cfg["configurable"]["thread_id"], checkpoint_ns=ns).run


def test_tool_loop_matches_in_memory_and_verifies():
    ours, theirs = both(graphs.tool_loop())
    a, b = config(), config()
    assert ours.invoke(graphs.first_input(), a) == theirs.invoke(graphs.first_input(), b)
    assert history(ours, a) == history(theirs, b)
    run = run_of(a)
    # At its end: the run says so (durability.langgraph.status).
    assert run.agent == "agent" and run.status == "succeeded"
    assert run.head_seq == len(history(ours, a))  # one checkpoint each, after the start
    (report,) = operations.verify(run.id)
    assert report.ok, str(report)
    # A second turn on the same thread continues its conversation.
    more = {"messages": [graphs.HumanMessage("again", id="human-1")], "turns": 0}
    assert ours.invoke(more, a) == theirs.invoke(more, b)
    assert history(ours, a) == history(theirs, b)


def test_interrupt_and_resume():
    ours, theirs = both(graphs.approval())
    a, b = config(), config()
    first = plain(ours.invoke({"amount": 349, "decision": "", "done": False}, a))
    assert first == plain(theirs.invoke({"amount": 349, "decision": "", "done": False}, b))
    assert first["__interrupt__"] == [{"question": "refund?", "amount": 349}]
    assert ours.get_state(a).next == ("ask",)
    # The interrupt is a pending write of the checkpoint it happened on.
    latest = SavedCheckpoint.objects.filter(thread__run=run_of(a)).order_by("-lg_id").first()
    assert PendingWrite.objects.filter(
        thread=latest.thread, checkpoint_id=latest.lg_id, channel="__interrupt__"
    ).exists()
    done = ours.invoke(Command(resume="yes"), a)
    assert done == theirs.invoke(Command(resume="yes"), b)
    assert done["done"] is True
    assert history(ours, a) == history(theirs, b)


def test_update_state_and_time_travel():
    ours, theirs = both(graphs.tool_loop(turns=2))
    results = []
    for graph, cfg in ((ours, config()), (theirs, config())):
        graph.invoke(graphs.first_input(), cfg)
        # Back to the checkpoint before the first tool call ran, with an edited state.
        states = list(graph.get_state_history(cfg))
        target = next(s for s in states if s.next == ("tools",))
        edited = graph.update_state(target.config, {"turns": 5})
        results.append((graph.invoke(None, edited), history(graph, cfg)))
        # Replaying an older checkpoint as it was (no edit) forks from it too.
        replayed = graph.invoke(None, states[-2].config)
        results[-1] += (replayed, history(graph, cfg))
    assert results[0] == results[1]
    ours_cfg = results  # the fork keeps every checkpoint: the history only grows
    assert len(ours_cfg[0][3]) > len(ours_cfg[0][1])


def test_time_travel_run_verifies():
    graph = graphs.tool_loop(turns=2).compile(checkpointer=DurableSaver())
    cfg = config()
    graph.invoke(graphs.first_input(), cfg)
    old = list(graph.get_state_history(cfg))[-3]
    graph.invoke(None, graph.update_state(old.config, {"turns": 7}))
    (report,) = operations.verify(run_of(cfg).id)
    assert report.ok, str(report)


def test_subgraph_namespaces_are_child_runs():
    ours, theirs = both(graphs.with_subgraph())
    a, b = config(), config()
    assert plain(ours.invoke({"log": []}, a)) == plain(theirs.invoke({"log": []}, b))
    mine = ours.get_state(a, subgraphs=True)
    other = theirs.get_state(b, subgraphs=True)
    assert mine.tasks[0].state.values == other.tasks[0].state.values
    assert mine.tasks[0].state.next == other.tasks[0].state.next
    assert ours.invoke(Command(resume="blue"), a) == theirs.invoke(Command(resume="blue"), b)
    assert history(ours, a) == history(theirs, b)
    root = run_of(a)
    children = list(Run.objects.filter(parent_run=root))
    assert children and all(c.langgraph_thread.checkpoint_ns.startswith("sub:") for c in children)
    for run in [root, *children]:
        (report,) = operations.verify(run.id)
        assert report.ok, str(report)


def test_copy_thread_copies_every_namespace_and_the_copies_go_on_apart():
    """``copy_thread`` makes a thread's whole history again under a new thread id (every
    namespace, the pending writes, LangGraph's ids): the copy's history is the source's,
    each of its runs verifies on its own, and the two threads go on apart, as two threads
    with the same history do on ``InMemorySaver``. A target that exists, or the source
    itself, or a source with nothing stored, is refused and nothing changes."""
    ours, theirs = both(graphs.with_subgraph())
    saver = ours.checkpointer
    a, b, twin = config(), config(), config()
    assert plain(ours.invoke({"log": []}, a)) == plain(theirs.invoke({"log": []}, b))
    theirs.invoke({"log": []}, twin)
    copy = config()
    source_id, copy_id = a["configurable"]["thread_id"], copy["configurable"]["thread_id"]
    saver.copy_thread(source_id, copy_id)
    assert history(ours, copy) == history(ours, a)
    assert [t.checkpoint["id"] for t in saver.list(copy)] == [
        t.checkpoint["id"] for t in saver.list(a)
    ]
    assert saver.get_tuple(copy).pending_writes == saver.get_tuple(a).pending_writes
    assert ours.invoke(Command(resume="blue"), a) == theirs.invoke(Command(resume="blue"), b)
    assert ours.invoke(Command(resume="red"), copy) == theirs.invoke(Command(resume="red"), twin)
    assert history(ours, a) == history(theirs, b)
    assert history(ours, copy) == history(theirs, twin)
    root = run_of(copy)
    children = list(Run.objects.filter(parent_run=root))
    assert children and all(c.langgraph_thread.thread_id == copy_id for c in children)
    assert root.pk != run_of(a).pk
    # ``durability show`` (and ``--json``, the API) says where the copy came from.
    came_from = {"thread_id": source_id, "run": str(run_of(a).pk)}
    assert lg_cli.as_json(root)["copied_from"] == came_from
    shown: list[str] = []
    lg_cli.show(shown.append, root)
    assert f"  copied from thread {source_id} (run {run_of(a).pk})" in shown, shown
    for run in [root, *children]:
        (report,) = operations.verify(run.id)
        assert report.ok, str(report)
    counts = (Run.objects.count(), Checkpoint.objects.count(), PendingWrite.objects.count())
    with pytest.raises(ValueError, match="exists already; nothing was copied"):
        saver.copy_thread(source_id, copy_id)
    with pytest.raises(ValueError, match="the source and the target are one thread"):
        saver.copy_thread(source_id, source_id)
    with pytest.raises(ValueError, match="thread 'never-stored' has no checkpoints here"):
        saver.copy_thread("never-stored", "nor-this")
    assert (Run.objects.count(), Checkpoint.objects.count(), PendingWrite.objects.count()) == (
        counts
    )
    assert saver.get_tuple(config("nor-this")) is None


def test_delete_for_runs_takes_an_invocation_out_and_the_thread_goes_on_before_it():
    """``delete_for_runs`` takes the checkpoints one invocation wrote (LangGraph's run id,
    in the config's metadata) and their pending writes out of what LangGraph reads: the
    thread's history is as before that invocation, and the next one goes on from there,
    as on ``InMemorySaver`` without it. The runs keep their history and verify. Bad input,
    and threads with a delta channel, are refused and nothing changes."""
    ours, theirs = both(graphs.tool_loop())
    saver = ours.checkpointer
    a, b = config(), config()

    def turn(cfg: dict, run_id: str, text: str) -> dict:
        more = {"messages": [graphs.HumanMessage(text, id=f"human-{run_id}")], "turns": 0}
        return {**cfg, "metadata": {"run_id": run_id}}, more

    first = {**a, "metadata": {"run_id": "turn-1"}}
    assert ours.invoke(graphs.first_input(), first) == theirs.invoke(graphs.first_input(), b)
    after_first = history(ours, a)
    cfg, more = turn(a, "turn-2", "again")
    ours.invoke(more, cfg)
    assert len(history(ours, a)) > len(after_first)
    stored = [t.config for t in saver.list(a) if t.metadata.get("run_id") == "turn-2"]
    saver.delete_for_runs(["turn-2"])
    assert history(ours, a) == after_first
    assert saver.get_tuple(stored[0]) is None
    assert all(t.metadata.get("run_id") != "turn-2" for t in saver.list(a))
    assert not PendingWrite.objects.filter(
        checkpoint_id__in=[c["configurable"]["checkpoint_id"] for c in stored]
    ).exists()
    # The next invocation goes on from the end of the first, as without the second.
    cfg, more = turn(a, "turn-3", "and then?")
    assert ours.invoke(more, cfg) == theirs.invoke(more, b)
    assert history(ours, a) == history(theirs, b)
    (report,) = operations.verify(run_of(a).id)
    assert report.ok, str(report)
    counts = (SavedCheckpoint.objects.count(), PendingWrite.objects.count())
    saver.delete_for_runs([])
    saver.delete_for_runs(["no-such-run"])
    with pytest.raises(TypeError, match="not one string"):
        saver.delete_for_runs("turn-3")
    assert (SavedCheckpoint.objects.count(), PendingWrite.objects.count()) == counts


def test_parallel_branch_failure_keeps_the_other_branch_writes():
    outcomes = []
    for saver in (DurableSaver(), InMemorySaver()):
        cfg = config()
        graph = graphs.branches(a_saved(saver, cfg)).compile(checkpointer=saver)
        graphs.CALLS.clear()
        graphs.FAIL["b"] = 1
        with pytest.raises(RuntimeError, match="b failed"):
            # "sync": the history is compared, and a background ("async") save can record
            # the join's barrier as it is later (see tests/test_langgraph_crash.py).
            graph.invoke({"log": []}, cfg, durability="sync")
        state = graph.get_state(cfg)
        writes = sorted(
            (w[1], w[2]) for w in saver.get_tuple(cfg).pending_writes if w[1] != "__error__"
        )
        errors = [t.name for t in state.tasks if t.error is not None]
        final = graph.invoke(None, cfg, durability="sync")
        outcomes.append(
            (writes, errors, state.next, final, dict(graphs.CALLS), history(graph, cfg))
        )
    assert outcomes[0] == outcomes[1]
    # a's write was kept, so resuming ran only b again.
    assert outcomes[0][4]["a"] == 1 and outcomes[0][4]["b"] == 2


def test_a_saver_remembers_only_its_recent_threads_and_reads_the_others_again(monkeypatch):
    """A process serving many conversations keeps ``cached_threads`` threads' last
    checkpoints in memory, and four times as many threads' rows; a thread whose state it
    forgot goes on from the database, as with a saver that never forgot it, without looking
    its row up again; one whose row it forgot too, as well."""
    saver = DurableSaver(cached_threads=2)
    ours = graphs.approval().compile(checkpointer=saver)
    theirs = graphs.approval().compile(checkpointer=InMemorySaver())
    pairs = [(config(), config()) for _ in range(24)]
    for amount, (a, b) in enumerate(pairs, start=100):
        start = {"amount": amount, "decision": "", "done": False}
        assert plain(ours.invoke(start, a)) == plain(theirs.invoke(start, b))
    kept = saver._memory
    states, rows = (kept._last, kept._encoders), (kept._threads, kept._head_seq)
    assert [len(k) <= 2 for k in states] + [len(k) <= 8 for k in rows] == [True] * 4
    made = Thread.objects.count()
    for a, b in pairs:  # the first sixteen were forgotten whole, the next six in part
        assert ours.invoke(Command(resume="yes"), a) == theirs.invoke(Command(resume="yes"), b)
        assert history(ours, a) == history(theirs, b)
        assert run_of(a).status == "succeeded"
    assert Thread.objects.count() == made
    # A checkpoint put on a thread whose state is forgotten but whose row is known reads the
    # state only; on a thread forgotten whole, the row too.
    row_known, forgotten = pairs[18][0], pairs[0][0]
    heads = [DurableSaver().get_tuple(a).config for a in (row_known, forgotten)]
    looked_up = []
    real = store.thread_of
    monkeypatch.setattr(
        store, "thread_of", lambda tid, ns, **kw: looked_up.append(tid) or real(tid, ns, **kw)
    )
    for head in heads:
        saver.put(head, empty_checkpoint(), {"source": "update", "step": 99, "parents": {}}, {})
    assert looked_up == [forgotten["configurable"]["thread_id"]]
    assert [len(k) <= 2 for k in states] + [len(k) <= 8 for k in rows] == [True] * 4


def test_a_saver_keeps_states_up_to_cached_bytes_and_always_the_one_in_use():
    """The states kept add up to at most ``cached_bytes`` (as stored), the least recently
    used dropped first, whatever ``cached_threads`` allows; the thread just used keeps its
    state even when it alone is larger. Threads whose states were dropped go on from the
    database, as with a saver that kept them."""
    probe = DurableSaver()
    graphs.approval().compile(checkpointer=probe).invoke(
        {"amount": 1, "decision": "", "done": False}, config()
    )
    one = probe._memory._bytes  # one thread's state, as the saver weighs it
    for budget, most in ((one * 5 // 2, 2), (0, 1)):
        saver = DurableSaver(cached_threads=100, cached_bytes=budget)
        ours = graphs.approval().compile(checkpointer=saver)
        theirs = graphs.approval().compile(checkpointer=InMemorySaver())
        pairs = [(config(), config()) for _ in range(6)]
        kept = saver._memory
        for amount, (a, b) in enumerate(pairs, start=100):
            start = {"amount": amount, "decision": "", "done": False}
            assert plain(ours.invoke(start, a)) == plain(theirs.invoke(start, b))
            assert 1 <= len(kept._last) <= most
            assert kept._bytes == sum(memory.weight(s) for s in kept._last.values())
            assert len(kept._last) == 1 or kept._bytes <= budget
        last = Thread.objects.get(thread_id=pairs[-1][0]["configurable"]["thread_id"])
        assert list(kept._last)[-1] == last.pk
        for a, b in pairs:
            assert ours.invoke(Command(resume="yes"), a) == theirs.invoke(Command(resume="yes"), b)
            assert history(ours, a) == history(theirs, b)
            assert len(kept._last) <= most


def test_cached_threads_must_be_a_whole_number_of_at_least_one():
    for bad in (0, -1, 1.5, "10", True):
        with pytest.raises(ValueError, match="cached_threads must be a whole number >= 1"):
            DurableSaver(cached_threads=bad)
    for bad in (-1, 1.5, "10", True, None):
        with pytest.raises(ValueError, match="cached_bytes must be a whole number >= 0"):
            DurableSaver(cached_bytes=bad)


def test_a_new_saver_continues_from_the_last_checkpoint():
    """A crash between supersteps: another saver (another process) takes the thread up from
    its last checkpoint; the finished supersteps are not run again."""
    graphs.CALLS.clear()
    graphs.FAIL["b"] = 1
    cfg = config()
    saver = DurableSaver()
    graph = graphs.branches(a_saved(saver, cfg)).compile(checkpointer=saver)
    with pytest.raises(RuntimeError):
        graph.invoke({"log": []}, cfg)
    fresh = graphs.branches().compile(checkpointer=DurableSaver())
    assert fresh.invoke(None, cfg) == {"log": ["a", "b", "join"]}
    assert graphs.CALLS == {"a": 1, "b": 2, "join": 1}


def test_a_thread_another_saver_made_after_get_tuple_found_nothing_is_the_one_used():
    """A saver that found nothing for a thread makes it at its first ``put`` without looking
    for it first; if another saver (another process) made it meanwhile, making it fails
    whole and the saver stores on the thread that exists: one thread, one run."""
    cfg = config()
    late, early = DurableSaver(), DurableSaver()
    assert late.get_tuple(cfg) is None
    graphs.tool_loop().compile(checkpointer=early).invoke(graphs.first_input(), cfg)
    before = early.get_tuple(cfg)
    ours = empty_checkpoint()
    stored = late.put(before.config, ours, {"source": "update", "step": 99, "parents": {}}, {})
    (thread,) = Thread.objects.filter(thread_id=cfg["configurable"]["thread_id"])
    assert Run.objects.filter(agent="agent", input__contains=thread.thread_id).count() == 1
    assert stored["configurable"]["checkpoint_id"] == ours["id"]
    latest = DurableSaver().get_tuple(cfg)
    assert latest.checkpoint["id"] == ours["id"]
    assert latest.parent_config["configurable"]["checkpoint_id"] == before.checkpoint["id"]
    (report,) = operations.verify(thread.run_id)
    assert report.ok, str(report)


def test_a_thread_another_saver_deleted_starts_over_on_the_saver_that_was_serving_it():
    """Each process of a chat application has its saver. One deletes a conversation's
    thread (its user starts it over); the next message reaches another, which had been
    serving the thread: the graph starts the thread afresh there, as on a saver that never
    saw it, rather than failing on what it remembered of it."""
    ours_cfg, theirs_cfg = config(), config()
    serving, deleting = DurableSaver(), DurableSaver()
    ours = graphs.tool_loop().compile(checkpointer=serving)
    theirs = graphs.tool_loop().compile(checkpointer=InMemorySaver())
    ours.invoke(graphs.first_input(), ours_cfg)
    gone = run_of(ours_cfg)
    deleting.delete_thread(ours_cfg["configurable"]["thread_id"])
    again = ours.invoke(graphs.first_input(), ours_cfg)
    assert again == theirs.invoke(graphs.first_input(), theirs_cfg)
    assert history(ours, ours_cfg) == history(theirs, theirs_cfg)
    assert run_of(ours_cfg).pk != gone.pk
    (report,) = operations.verify(run_of(ours_cfg).id)
    assert report.ok, str(report)


def test_a_put_on_a_thread_deleted_meanwhile_says_so_and_the_next_one_starts_it_over():
    """The thread is deleted by another process between a graph's supersteps: the
    checkpoint is refused in plain words, nothing is stored, and the next ``put`` makes the
    thread again."""
    cfg = config()
    serving, deleting = DurableSaver(), DurableSaver()
    graphs.tool_loop().compile(checkpointer=serving).invoke(graphs.first_input(), cfg)
    latest = serving.get_tuple(cfg)
    deleting.delete_thread(cfg["configurable"]["thread_id"])
    md = {"source": "update", "step": 99, "parents": {}}
    with pytest.raises(ThreadDeleted, match="was deleted, by another process, while this graph"):
        serving.put(latest.config, empty_checkpoint(), md, {})
    assert not Thread.objects.filter(thread_id=cfg["configurable"]["thread_id"]).exists()
    stored = serving.put(latest.config, empty_checkpoint(), md, {})
    assert serving.get_tuple(cfg).config == stored
    (report,) = operations.verify(run_of(cfg).id)
    assert report.ok, str(report)


def test_async_matches_in_memory():
    async def go(graph, cfg):
        first = await graph.ainvoke({"amount": 20, "decision": "", "done": False}, cfg)
        second = await graph.ainvoke(Command(resume="no"), cfg)
        states = [s.values async for s in graph.aget_state_history(cfg)]
        loop = graphs.tool_loop().compile(checkpointer=graph.checkpointer)
        third = await loop.ainvoke(graphs.first_input(), config())
        return first["__interrupt__"][0].value, second, states, third

    ours, theirs = both(graphs.approval())
    assert in_own_loop(go(ours, config())) == in_own_loop(go(theirs, config()))


def in_own_loop(coroutine):
    """``asyncio.run`` on a thread of its own: the browser tests' Playwright (sync API) keeps
    an event loop running on this thread for the whole session, and asyncio.run refuses to
    start a second one there."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def test_list_filter_before_limit_and_delete():
    saver = DurableSaver()
    graph = graphs.tool_loop().compile(checkpointer=saver)
    cfg = config()
    graph.invoke(graphs.first_input(), cfg)
    every = list(saver.list(cfg))
    assert [t.metadata["step"] for t in every] == list(range(len(every) - 2, -2, -1))
    assert [t.metadata["step"] for t in saver.list(cfg, filter={"source": "input"})] == [-1]
    assert len(list(saver.list(cfg, limit=2))) == 2
    before = list(saver.list(cfg, before=every[2].config))
    assert [t.config for t in before] == [t.config for t in every[3:]]
    for listed in every:
        got = saver.get_tuple(listed.config)
        assert got.checkpoint == listed.checkpoint and got.metadata == listed.metadata
    run = run_of(cfg)
    saver.delete_thread(cfg["configurable"]["thread_id"])
    assert saver.get_tuple(cfg) is None and not list(saver.list(cfg))
    assert not Run.objects.filter(pk=run.pk).exists()
    assert not Checkpoint.objects.filter(run_id=run.pk).exists()


def test_prune_keep_latest_and_bad_input():
    saver = DurableSaver()
    graph = graphs.tool_loop().compile(checkpointer=saver)
    cfg = config()
    graph.invoke(graphs.first_input(), cfg)
    head = graph.get_state(cfg).values
    with pytest.raises(TypeError):
        saver.prune(cfg["configurable"]["thread_id"])
    with pytest.raises(ValueError, match="unknown prune strategy"):
        saver.prune([cfg["configurable"]["thread_id"]], strategy="most")
    saver.prune([cfg["configurable"]["thread_id"]])
    assert len(list(saver.list(cfg))) == 1
    assert DurableSaver().get_tuple(cfg).parent_config is None
    assert graph.get_state(cfg).values == head
    with pytest.raises(ValueError, match="graph must be"):
        DurableSaver(graph="")
    with pytest.raises(ValueError, match="durability must be 'strict' or 'relaxed'"):
        DurableSaver(durability="sync")


def test_appending_a_message_stores_about_one_message():
    graph = graphs.appender(40, size=1000).compile(checkpointer=DurableSaver())
    cfg = config()
    graph.invoke(graphs.first_input(), cfg)
    run = run_of(cfg)
    last = Checkpoint.objects.filter(run=run).order_by("-seq").first()
    assert last.size > 40_000
    assert last.delta_size < 2_500, last.delta_size
    (report,) = operations.verify(run.id)
    assert report.ok, str(report)
    values = graph.get_state(cfg).values
    assert [m.id for m in values["messages"]][-2:] == ["m-38", "m-39"]


def test_a_number_changing_type_is_stored_exactly():
    """[1, 2] -> [1.0, 2] -> [True, 2] are equal to Python's ``==``: the patch must still
    carry each change, or a new process would read back the wrong types."""
    ours, theirs = both(graphs.number_types())
    a, b = config(), config()
    assert ours.invoke({"nums": [1, 2], "step": 0}, a) == theirs.invoke(
        {"nums": [1, 2], "step": 0}, b
    )

    def typed(graph, cfg):
        return [
            [type(x).__name__ for x in s.values.get("nums", [])]
            for s in graph.get_state_history(cfg)
        ]

    fresh = graphs.number_types().compile(checkpointer=DurableSaver())
    assert typed(fresh, a) == typed(theirs, b)
    assert [type(x) for x in fresh.get_state(a).values["nums"]] == [int, float]
    (report,) = operations.verify(run_of(a).id)
    assert report.ok, str(report)


def test_each_checkpoint_s_size_is_its_state_s_bytes():
    """A checkpoint's size is counted from its patch, not measured on its state: it must
    be the length of the state it rebuilds to, whether the patch appended, removed, replaced
    or changed a number's type, and where a snapshot was written with it or after it."""
    saver = DurableSaver()
    grown, typed, edited = config(), config(), config()
    # 3 KB a superstep: past the size of a snapshot written in the commit itself.
    graphs.appender(40, size=3000).compile(checkpointer=saver).invoke(graphs.first_input(), grown)
    graphs.number_types().compile(checkpointer=saver).invoke({"nums": [1, 2], "step": 0}, typed)
    loop = graphs.tool_loop().compile(checkpointer=saver)
    loop.invoke(graphs.first_input(), edited)
    first = loop.get_state(edited).values["messages"][1]
    loop.update_state(edited, {"messages": [RemoveMessage(id=first.id)], "turns": 7})
    assert Snapshot.objects.filter(run_id=run_of(grown).id, seq__gt=1).exists()
    for cfg in (grown, typed, edited):
        stored = Checkpoint.objects.filter(run=run_of(cfg)).order_by("seq")
        sizes = [(cp.size, len(checkpoints.verified_state(cp)[1])) for cp in stored]
        assert [size for size, _ in sizes] == [length for _, length in sizes]
    saver.close()


def test_pending_writes_are_stored_as_sent_and_pass_the_redaction_gate():
    """A task's writes go to the database in one parameter: each value's canonical text must
    arrive unchanged (quotes, backslashes, control characters, any script), and a secret in
    one must meet the same redaction gate as any text the product writes."""
    saver = DurableSaver()
    thread = uuid.uuid4().hex
    cfg = {"configurable": {"thread_id": thread, "checkpoint_ns": "", "checkpoint_id": "1"}}
    tricky = 'a "quote", a back\\slash, a tab\t, a line\n, \u00e9, \U0001f600, </script>'
    secret = "sk-live-4f9c2d7e8a1b3c5d"
    with redact.scope({secret}):
        saver.put_writes(
            cfg, [("tricky", tricky), ("token", {"header": f"Bearer {secret}"})], "task", "~p"
        )
    rows = PendingWrite.objects.filter(thread__thread_id=thread).order_by("idx")
    assert [(w.idx, w.channel, w.task_id, w.task_path) for w in rows] == [
        (0, "tricky", "task", "~p"),
        (1, "token", "task", "~p"),
    ]
    assert rows[0].value == canonical.dumps(tricky).decode()
    assert secret not in rows[1].value
    assert canonical.loads(rows[1].value) == {"header": f"Bearer {redact.REDACTED}"}


def test_relaxed_durability_stores_the_same_checkpoints():
    ours = graphs.tool_loop().compile(checkpointer=DurableSaver(durability="relaxed"))
    theirs = graphs.tool_loop().compile(checkpointer=InMemorySaver())
    a, b = config(), config()
    assert ours.invoke(graphs.first_input(), a) == theirs.invoke(graphs.first_input(), b)
    fresh = graphs.tool_loop().compile(checkpointer=DurableSaver())
    assert history(fresh, a) == history(theirs, b)
    (report,) = operations.verify(run_of(a).id)
    assert report.ok, str(report)
    # The run says so, as the CLI, the API and the dashboard show it.
    assert run_of(a).durability == "relaxed"


def test_a_lost_connection_is_made_again():
    """The server drops every connection of the saver (a restart, a failover, an idle
    timeout): reads connect again and retry, and the graph goes on."""
    if connection.vendor != "postgresql":
        pytest.skip("ending another session's backend needs PostgreSQL")
    saver = DurableSaver()
    graph = graphs.tool_loop().compile(checkpointer=saver)
    cfg = config()
    graph.invoke(graphs.first_input(), cfg)
    before = len(list(saver.list(cfg)))

    def drop_all() -> None:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )

    drop_all()
    assert saver.get_tuple(cfg).metadata["step"] == before - 2
    assert len(list(saver.list(cfg))) == before
    drop_all()
    more = {"messages": [graphs.HumanMessage("again", id="human-1")], "turns": 0}
    theirs = graphs.tool_loop().compile(checkpointer=InMemorySaver())
    other = config()
    theirs.invoke(graphs.first_input(), other)
    assert graph.invoke(more, cfg) == theirs.invoke(more, other)
    assert history(graph, cfg) == history(theirs, other)


@pytest.mark.parametrize("prepared", [True, False])
def test_statements_prepared_or_not(settings, prepared):
    """With prepared statements (the default) the saver's own sessions plan its statements
    once, generically; without (a pooler in transaction mode) they are left as they are.
    Either way the saver stores and reads the same checkpoints."""
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's")
    settings.DURABILITY_PREPARED_STATEMENTS = prepared
    with connection.cursor() as cur:
        cur.execute("SHOW plan_cache_mode")
        default = cur.fetchone()[0]
    db = connections.create_connection(DEFAULT_DB_ALIAS)
    try:
        lg_store.for_connection(db).own_session()
        with db.cursor() as cur:
            cur.execute("SHOW plan_cache_mode")
            assert cur.fetchone()[0] == ("force_generic_plan" if prepared else default)
    finally:
        db.close()
    ours, theirs = both(graphs.tool_loop())
    a, b = config(), config()
    assert ours.invoke(graphs.first_input(), a) == theirs.invoke(graphs.first_input(), b)
    fresh = graphs.tool_loop().compile(checkpointer=DurableSaver())
    assert history(fresh, a) == history(theirs, b)
