"""One saver serving many conversations at once, as an asyncio server's does: calls on
different threads run at once on connections of the saver's own, so one that waits for the
database holds up no other thread, and the results are those of LangGraph's own saver."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from durability import operations
from durability.langgraph import DurableSaver, pool
from durability.langgraph.models import Thread
from durability.models import Checkpoint, Run
from tests import langgraph_graphs as graphs

pytestmark = pytest.mark.django_db(transaction=True)


def config() -> dict:
    return {"configurable": {"thread_id": uuid.uuid4().hex}}


def run_of(cfg: dict) -> Run:
    return Thread.objects.get(thread_id=cfg["configurable"]["thread_id"], checkpoint_ns="").run


def postgres_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("on SQLite a saver's calls run one at a time on its own thread")


class HeldRun:
    """Another session holding a run's row (as an operator's action does while it commits):
    a checkpoint of that run waits for it."""

    def __init__(self, run_id: object) -> None:
        self.db = connections.create_connection(DEFAULT_DB_ALIAS)
        self.db.set_autocommit(False)
        with self.db.cursor() as cur:
            cur.execute("SELECT 1 FROM durability_run WHERE id = %s FOR UPDATE", [run_id])

    def wait_for_a_waiter(self) -> None:
        """Until a statement waits for the row."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                )
                if cur.fetchone()[0]:
                    return
            time.sleep(0.02)
        raise AssertionError("no statement came to wait for the held row")

    def release(self) -> None:
        if self.db.connection is not None:
            self.db.rollback()
            self.db.close()

    def store_a_checkpoint(self, run_id: object) -> None:
        """What a checkpoint's statement does while it holds the row: number one more
        checkpoint, a child of the run's last, then commit."""
        columns = [f.column for f in Checkpoint._meta.concrete_fields if f.column != "id"]
        values = [
            {"seq": "c.seq + 1", "parent_id": "c.id", "commit_id": "gen_random_uuid()"}.get(
                column, f"c.{column}"
            )
            for column in columns
        ]
        with self.db.cursor() as cur:
            cur.execute("UPDATE durability_run SET head_seq = head_seq + 1 WHERE id = %s", [run_id])
            cur.execute(
                f"INSERT INTO durability_checkpoint ({', '.join(columns)})"
                f" SELECT {', '.join(values)} FROM durability_checkpoint c"
                " WHERE c.run_id = %s ORDER BY c.seq DESC LIMIT 1",
                [run_id],
            )
        self.db.commit()
        self.db.close()


MORE = {"messages": [HumanMessage("again", id="human-1")], "turns": 0}


def first_turns(saver: DurableSaver) -> tuple[Any, Any, dict, dict]:
    """A conversation's first turn on ``saver`` and on LangGraph's in-memory saver."""
    postgres_only()
    ours = graphs.tool_loop().compile(checkpointer=saver)
    theirs = graphs.tool_loop().compile(checkpointer=InMemorySaver())
    held, held_theirs = config(), config()
    ours.invoke(graphs.first_input(), held)
    theirs.invoke(graphs.first_input(), held_theirs)
    return ours, theirs, held, held_theirs


@contextmanager
def next_turn_waiting(graph: Any, cfg: dict) -> Iterator[tuple[ThreadPoolExecutor, Future]]:
    """The thread's next turn, on a thread of its own, its checkpoint waiting for the run's
    row, which is held until the block ends (whatever fails in it: the pool's end waits for
    its threads)."""
    row = HeldRun(run_of(cfg).id)
    with ThreadPoolExecutor(max_workers=2) as pool:
        try:
            waiting = pool.submit(graph.invoke, MORE, cfg)
            row.wait_for_a_waiter()
            yield pool, waiting
        finally:
            row.release()


def test_a_thread_waiting_for_the_database_holds_up_no_other_thread():
    ours, theirs, held, held_theirs = first_turns(DurableSaver())
    with next_turn_waiting(ours, held) as (pool, waiting):
        # Another conversation, start to end, while the first one's checkpoint waits.
        other = pool.submit(ours.invoke, graphs.first_input(), config())
        assert other.result(timeout=20) == theirs.invoke(graphs.first_input(), config())
        assert not waiting.done()
    assert waiting.result(timeout=20) == theirs.invoke(MORE, held_theirs)
    (report,) = operations.verify(run_of(held).id)
    assert report.ok, str(report)


@pytest.mark.smoke
def test_a_thread_s_calls_wait_for_each_other_and_for_no_other_thread():
    """While a call holds one namespace, a call on any other namespace goes on at once,
    whatever its id (none shares a lock with another), and one on the same namespace waits
    for it; a namespace no call uses keeps nothing in memory."""
    locks = pool.Pool(1)
    entered = threading.Event()

    def other_namespaces() -> None:
        for _ in range(2000):
            with locks.thread(uuid.uuid4().hex, ""):
                pass
        with locks.thread("held", "child:1"):
            pass

    def same_namespace() -> None:
        with locks.thread("held", ""):
            entered.set()

    with ThreadPoolExecutor(1) as other:
        with locks.thread("held", ""):
            other.submit(other_namespaces).result(timeout=10)
            waiting = other.submit(same_namespace)
            assert not entered.wait(0.2)
        waiting.result(timeout=5)
    assert entered.is_set()
    assert not locks._threads


def test_calls_wait_for_a_connection_beyond_the_saver_s_connections():
    ours, theirs, held, _ = first_turns(DurableSaver(connections=1))
    with next_turn_waiting(ours, held) as (pool, waiting):
        other = pool.submit(ours.invoke, graphs.first_input(), config())
        # Its only connection is the waiting checkpoint's.
        with pytest.raises(FutureTimeout):
            other.result(timeout=1)
    assert other.result(timeout=20) == theirs.invoke(graphs.first_input(), config())
    waiting.result(timeout=20)


@pytest.mark.smoke
@pytest.mark.parametrize("cached_threads", [2, 100])
def test_many_conversations_at_once_match_langgraph_s_own_saver(cached_threads):
    """Conversations with interrupts and resumes, all at once on one saver through
    LangGraph's async API (remembering all of them, or only two at a time), give what
    LangGraph's in-memory saver gives, and every run verifies."""
    ours = graphs.approval().compile(checkpointer=DurableSaver(cached_threads=cached_threads))
    theirs = graphs.approval().compile(checkpointer=InMemorySaver())

    async def conversation(graph, cfg: dict, amount: int) -> list:
        first = await graph.ainvoke({"amount": amount, "decision": "", "done": False}, cfg)
        second = await graph.ainvoke(Command(resume="yes" if amount % 2 else "no"), cfg)
        states = [s.values async for s in graph.aget_state_history(cfg)]
        return [first["__interrupt__"][0].value, second, states]

    async def all_of(graph) -> tuple[list, list[dict]]:
        cfgs = [config() for _ in range(24)]
        done = await asyncio.gather(
            *(conversation(graph, cfg, n) for n, cfg in enumerate(cfgs, start=100))
        )
        return done, cfgs

    with ThreadPoolExecutor(max_workers=1) as loop:  # Playwright's loop may hold this thread
        got, cfgs = loop.submit(asyncio.run, all_of(ours)).result()
        expected, _ = loop.submit(asyncio.run, all_of(theirs)).result()
    assert got == expected
    for cfg in cfgs:
        run = run_of(cfg)
        assert run.status == "succeeded"
        (report,) = operations.verify(run.id)
        assert report.ok, str(report)


@pytest.mark.smoke
def test_connections_must_be_a_whole_number_of_at_least_one():
    for bad in (0, -1, 1.5, "4", True):
        with pytest.raises(ValueError, match="connections must be a whole number >= 1"):
            DurableSaver(connections=bad)


def test_a_copy_waits_for_a_checkpoint_being_stored_on_its_source():
    """``copy_thread`` locks the source's runs before reading it: while another session
    holds the source's run (a checkpoint's statement does, until it commits), the copy waits,
    and once it is let go the copy has every checkpoint and verifies."""
    postgres_only()
    saver = DurableSaver()
    graph = graphs.tool_loop().compile(checkpointer=saver)
    cfg = config()
    graph.invoke(graphs.first_input(), cfg)
    held = HeldRun(run_of(cfg).id)
    copy = config()
    source_id, copy_id = cfg["configurable"]["thread_id"], copy["configurable"]["thread_id"]
    with ThreadPoolExecutor(1) as pool:
        try:
            copying = pool.submit(saver.copy_thread, source_id, copy_id)
            held.wait_for_a_waiter()
            with pytest.raises(FutureTimeout):
                copying.result(timeout=0.3)
        finally:
            held.release()
        copying.result(timeout=30)
    assert [t.checkpoint["id"] for t in saver.list(copy)] == [
        t.checkpoint["id"] for t in saver.list(cfg)
    ]
    (report,) = operations.verify(run_of(copy).id)
    assert report.ok, str(report)
    saver.close()


def test_a_thread_deleted_while_a_checkpoint_is_being_stored_goes_whole():
    """``delete_thread`` locks the thread's runs first: a checkpoint whose statement holds
    its run commits before the delete reads the run's checkpoints, and goes with them (no
    checkpoint left behind, no refusal of the delete for a checkpoint it did not see)."""
    postgres_only()
    saver = DurableSaver()
    cfg = config()
    graphs.tool_loop().compile(checkpointer=saver).invoke(graphs.first_input(), cfg)
    run = run_of(cfg)
    held = HeldRun(run.id)
    with ThreadPoolExecutor(1) as pool:
        try:
            deleting = pool.submit(saver.delete_thread, cfg["configurable"]["thread_id"])
            held.wait_for_a_waiter()
            with pytest.raises(FutureTimeout):
                deleting.result(timeout=0.3)
            held.store_a_checkpoint(run.id)
        finally:
            held.release()
        deleting.result(timeout=30)
    assert not Run.objects.filter(pk=run.id).exists()
    assert not Checkpoint.objects.filter(run_id=run.id).exists()
    assert saver.get_tuple(cfg) is None
    saver.close()
