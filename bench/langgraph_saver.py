"""LangGraph's own PostgresSaver against ``DurableSaver``, side by side on the same database:
the same graph (200 supersteps, each appending one ~1 KB message) with durability "sync".

Figures: per-superstep overhead (the graph's time minus the same graph without a
checkpointer; also with DurableSaver's relaxed durability, which does not wait for the
flush and so is shown without a target; and with a reference saver that only writes one
flushed 1 KB row per checkpoint, the least a saver that flushes each checkpoint pays, also
without a target), bytes stored for the thread after the run (every
row of it, as ``pg_column_size``), ``get_tuple`` of the latest checkpoint (a fresh saver
each time, so nothing is served from memory; also one saver called again and again, as
PostgresSaver's figure is taken, shown without a target) and ``list`` of every
checkpoint. And, without a target, a conversation's turns rather than one long run: the
overhead per invoke of a graph of three supersteps on a new thread, and as the next turn
of a thread; and many conversations at once on one saver, as an asyncio server has them
(against ``AsyncPostgresSaver``). Medians of repeats; the savers (and the graph without one)
take turns, so that a busy spell of a shared machine weighs on each of them alike.
"""

from __future__ import annotations

import secrets
import time
import uuid
from typing import Annotated, TypedDict

from bench.common import Bench, fmt_ratio
from bench.stats import median, ms, size, table

STEPS = 200
# Rounds of the long graph, each graph once per round. One round's ratio of the two savers'
# overheads varies by about a quarter either way on a shared two-core machine, so a median
# of five rounds moved from one run to the next by about the target's margin; a median of
# eleven moves about a third less.
ROUNDS = 11
# A turn of a conversation: the model, a tool, the model again.
SHORT_STEPS = 3
# Conversations in flight at once in one process (an asyncio server's).
CROWD = 200


def _graph(steps: int):
    from langchain_core.messages import AIMessage, AnyMessage
    from langgraph.graph import END, START, StateGraph
    from langgraph.graph.message import add_messages

    # Functional form: with postponed annotations, a class defined in a function would leave
    # LangGraph names it cannot resolve.
    Chat = TypedDict(  # noqa: UP013
        "Chat", {"messages": Annotated[list[AnyMessage], add_messages], "turns": int}
    )

    def step(state: dict) -> dict:
        n = state["turns"]
        # Incompressible, as a model's text is to TOAST's compression.
        text = secrets.token_urlsafe(750)
        return {"messages": [AIMessage(text, id=f"m-{n}")], "turns": n + 1}

    def route(state: dict) -> str:
        return "step" if state["turns"] < steps else END

    g = StateGraph(Chat)
    g.add_node("step", step)
    g.add_edge(START, "step")
    g.add_conditional_edges("step", route, ["step", END])
    return g


def _invoke(graph, thread: str, state: dict | None = None) -> float:
    # "sync": each checkpoint stored before the next superstep (without a checkpointer
    # there is nothing to wait for, and LangGraph refuses the option).
    extra = {"durability": "sync"} if graph.checkpointer else {}
    started = time.perf_counter()
    graph.invoke(
        state or {"messages": [], "turns": 0},
        {"configurable": {"thread_id": thread}, "recursion_limit": 10_000},
        **extra,
    )
    return time.perf_counter() - started


def _floor_saver(db_url: str):
    """A saver that keeps each checkpoint in memory as LangGraph hands it over (no
    serializing, no diff, no hash) and writes one ~1 KB row per checkpoint, flushed before
    ``put`` returns: what any saver that makes each checkpoint durable before the next
    superstep pays at least (LangGraph's own checkpointing work and one flushed round trip).
    A reference for the overhead target, not a saver: it cannot recover anything. Its table
    is an ordinary one: a temporary table is not written to the WAL, so nothing would be
    flushed."""
    import psycopg
    from langgraph.checkpoint.base import BaseCheckpointSaver, CheckpointTuple

    class FloorSaver(BaseCheckpointSaver):
        def __init__(self) -> None:
            super().__init__()
            self.conn = psycopg.connect(db_url, autocommit=True)
            self.conn.execute(f"DROP TABLE IF EXISTS {_FLOOR}")
            self.conn.execute(f"CREATE TABLE {_FLOOR} (id text PRIMARY KEY, body text)")
            self.latest: dict[str, CheckpointTuple] = {}

        def get_tuple(self, config):
            return self.latest.get(config["configurable"]["thread_id"])

        def put(self, config, checkpoint, metadata, new_versions):
            thread = config["configurable"]["thread_id"]
            ns = config["configurable"].get("checkpoint_ns", "")
            saved = {
                "configurable": {
                    "thread_id": thread,
                    "checkpoint_ns": ns,
                    "checkpoint_id": checkpoint["id"],
                }
            }
            self.conn.execute(f"INSERT INTO {_FLOOR} VALUES (%s, %s)", (checkpoint["id"], _KB))
            self.latest[thread] = CheckpointTuple(saved, checkpoint, metadata, config)
            return saved

        def put_writes(self, config, writes, task_id, task_path=""):
            pass

        def close(self) -> None:
            self.conn.execute(f"DROP TABLE {_FLOOR}")
            self.conn.close()

    return FloorSaver()


_KB = "x" * 1024
_FLOOR = "bench_floor_checkpoint"


def _time(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


_PG_BYTES = """
SELECT (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM checkpoints t WHERE thread_id = %(t)s)
     + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM checkpoint_blobs t
         WHERE thread_id = %(t)s)
     + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM checkpoint_writes t
         WHERE thread_id = %(t)s)
"""
_OUR_BYTES = """
SELECT (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM durability_run t WHERE id = %(r)s)
     + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM durability_checkpoint t
         WHERE run_id = %(r)s)
     + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM durability_mutation t
         JOIN durability_checkpoint c ON c.id = t.checkpoint_id WHERE c.run_id = %(r)s)
     + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM durability_snapshot t
         JOIN durability_checkpoint c ON c.id = t.checkpoint_id WHERE c.run_id = %(r)s)
     + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM durability_event t
         WHERE run_id = %(r)s)
     + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM durability_langgraph_thread t
         WHERE run_id = %(r)s)
     + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM durability_langgraph_savedcheckpoint t
         JOIN durability_checkpoint c ON c.id = t.checkpoint_id WHERE c.run_id = %(r)s)
     + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM durability_langgraph_pendingwrite t
         JOIN durability_langgraph_thread h ON h.id = t.thread_id WHERE h.run_id = %(r)s)
"""


def run(b: Bench) -> None:
    from langgraph.checkpoint.postgres import PostgresSaver

    from durability.langgraph import DurableSaver

    steps = 50 if b.quick else STEPS
    rounds, repeats = (3, 3) if b.quick else (ROUNDS, 5)
    print(f"\n== LangGraph: PostgresSaver against DurableSaver, {steps} supersteps of 1 KB")
    builder = _graph(steps)
    with PostgresSaver.from_conn_string(b.db_url) as pg:
        pg.setup()
        strict = DurableSaver(graph="bench-langgraph")
        relaxed = DurableSaver(graph="bench-langgraph", durability="relaxed")
        floor = _floor_saver(b.db_url)
        graphs = {
            "bare": builder.compile(),
            "pg": builder.compile(checkpointer=pg),
            "ours": builder.compile(checkpointer=strict),
            "relaxed": builder.compile(checkpointer=relaxed),
            "floor": builder.compile(checkpointer=floor),
        }
        # Round after round, each graph once per round, so that a busy spell of the machine
        # weighs on all of them alike.
        runs: dict[str, list[tuple[str, float]]] = {name: [] for name in graphs}
        for _ in range(rounds):
            for name, graph in graphs.items():
                thread = uuid.uuid4().hex
                runs[name].append((thread, _invoke(graph, thread)))
        strict.close()
        relaxed.close()
        floor.close()
        times = {name: median([t for _, t in done]) for name, done in runs.items()}
        stored = _bytes(pg, runs["pg"][-1][0], runs["ours"][-1][0])
        gets, lists = _reads(pg, runs["pg"][-1][0], runs["ours"][-1][0], repeats)
        short = _short(pg, 10 if b.quick else 30)
    crowd = _crowd(b.db_url, CROWD // 4 if b.quick else CROWD, 1 if b.quick else 3)
    _report(
        b,
        steps,
        times["bare"],
        (times["pg"], times["ours"], times["relaxed"], times["floor"]),
        stored,
        gets,
        lists,
    )
    _report_short(b, short)
    _report_crowd(b, crowd)


def _short(pg, rounds: int) -> dict[str, tuple[float, float]]:
    """A conversation's turns rather than one long run: per invoke of a graph of
    ``SHORT_STEPS`` supersteps, on a new thread and as the next turn of a thread (its
    history read, then its status waiting and ended again), the savers taking turns; medians
    in seconds by saver, bare included."""
    from langchain_core.messages import HumanMessage

    from durability.langgraph import DurableSaver

    builder = _graph(SHORT_STEPS)
    ours = DurableSaver(graph="bench-langgraph-short")
    graphs = {
        "bare": builder.compile(),
        "pg": builder.compile(checkpointer=pg),
        "ours": builder.compile(checkpointer=ours),
    }
    new: dict[str, list[float]] = {name: [] for name in graphs}
    turn: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            thread = uuid.uuid4().hex
            new[name].append(_invoke(graph, thread))
            # The graph without a checkpointer keeps nothing: its turn is its supersteps.
            more = {"messages": [HumanMessage("and then?")], "turns": 0}
            turn[name].append(_invoke(graph, thread, more))
    ours.close()
    return {name: (median(new[name]), median(turn[name])) for name in graphs}


def _report_short(b: Bench, short: dict[str, tuple[float, float]]) -> None:
    bare = short["bare"]
    rows = []
    for i, what in enumerate(("a new thread", "the next turn of a thread")):
        pg_over = max(short["pg"][i] - bare[i], 1e-9)
        our_over = max(short["ours"][i] - bare[i], 0.0)
        name = f"{what}, {SHORT_STEPS} supersteps: overhead per invoke"
        rows.append([name, ms(pg_over), ms(our_over), fmt_ratio(our_over / pg_over)])
        b.add("langgraph", f"{name} (vs PostgresSaver, info)", f"{ms(our_over)}, {rows[-1][3]}")
    print(table(rows, ["figure", "PostgresSaver", "DurableSaver", "ratio"]))


def _crowd(db_url: str, threads: int, rounds: int) -> tuple[int, float, float]:
    """Many conversations at once in one process, as an asyncio server has them: ``threads``
    threads each invoked (``ainvoke``, durability "sync") at once on one saver, then their
    next turns at once, timed; ``DurableSaver`` with its defaults against LangGraph's
    ``AsyncPostgresSaver`` on one connection, taking turns. Medians in seconds of the next
    turns of all threads."""
    import asyncio

    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    from durability.langgraph import DurableSaver

    builder = _graph(SHORT_STEPS)

    async def turns(graph) -> float:
        ids = [uuid.uuid4().hex for _ in range(threads)]
        configs = [{"configurable": {"thread_id": i}} for i in ids]
        first = {"messages": [], "turns": 0}
        await asyncio.gather(*(graph.ainvoke(first, c, durability="sync") for c in configs))
        more = {"messages": [HumanMessage("and then?")], "turns": 0}
        started = time.perf_counter()
        await asyncio.gather(*(graph.ainvoke(more, c, durability="sync") for c in configs))
        return time.perf_counter() - started

    async def theirs() -> float:
        async with AsyncPostgresSaver.from_conn_string(db_url) as pg:
            return await turns(builder.compile(checkpointer=pg))

    ours = DurableSaver(graph="bench-langgraph-crowd")
    graph = builder.compile(checkpointer=ours)
    times: dict[str, list[float]] = {"pg": [], "ours": []}
    for _ in range(rounds):
        times["pg"].append(asyncio.run(theirs()))
        times["ours"].append(asyncio.run(turns(graph)))
    ours.close()
    return threads, median(times["pg"]), median(times["ours"])


def _report_crowd(b: Bench, crowd: tuple[int, float, float]) -> None:
    threads, pg, ours = crowd
    name = f"{threads} threads' next turns at once, asyncio, one saver"
    ratio = fmt_ratio(ours / pg)
    print(
        table(
            [[name, ms(pg), ms(ours), ratio]],
            ["figure", "AsyncPostgresSaver", "DurableSaver", "ratio"],
        )
    )
    b.add("langgraph", f"{name} (vs AsyncPostgresSaver, info)", f"{ms(ours)}, {ratio}")


def _bytes(pg, pg_thread: str, our_thread: str) -> tuple[int, int]:
    from django.db import connection

    from durability.langgraph import DurableSaver

    with connection.cursor() as cur:
        cur.execute(_PG_BYTES, {"t": pg_thread})
        pg_bytes = int(cur.fetchone()[0])
        cur.execute(_OUR_BYTES, {"r": DurableSaver().run_of(our_thread).id})
        return pg_bytes, int(cur.fetchone()[0])


def _reads(pg, pg_thread: str, our_thread: str, repeats: int):
    """``get_tuple`` (PostgresSaver's on one saver; ours on a fresh saver each time, and on
    one saver again and again) and ``list``, the two savers taking turns."""
    from durability.langgraph import DurableSaver

    pg_cfg = {"configurable": {"thread_id": pg_thread}}
    cfg = {"configurable": {"thread_id": our_thread}}
    lister = DurableSaver()
    lister.get_tuple(cfg)  # it now holds the latest state, as a saver that wrote it does
    pg_gets, our_gets, our_warm = [], [], []
    for _ in range(20):
        pg_gets.append(_time(lambda: pg.get_tuple(pg_cfg)))
        fresh = DurableSaver()
        fresh.get_tuple({"configurable": {"thread_id": "warm-up"}})
        our_gets.append(_time(lambda s=fresh: s.get_tuple(cfg)))
        fresh.close()
        our_warm.append(_time(lambda: lister.get_tuple(cfg)))
    pg_lists, our_lists = [], []
    for _ in range(repeats):
        pg_lists.append(_time(lambda: list(pg.list(pg_cfg))))
        our_lists.append(_time(lambda: list(lister.list(cfg))))
    lister.close()
    gets = (median(pg_gets), median(our_gets), median(our_warm))
    return gets, (median(pg_lists), median(our_lists))


def _report(b: Bench, steps: int, bare: float, times, stored, gets, lists) -> None:
    pg_over = max(times[0] - bare, 1e-9) / steps
    our_over = max(times[1] - bare, 0.0) / steps
    figures = [
        ("overhead per superstep", ms(pg_over), ms(our_over), our_over / pg_over, 1 / 3, "<="),
        ("bytes stored", size(stored[0]), size(stored[1]), stored[1] / stored[0], 0.1, "<="),
        ("get_tuple, latest", ms(gets[0]), ms(gets[1]), gets[1] / gets[0], 1.0, "<="),
        (f"list of {steps + 1}", ms(lists[0]), ms(lists[1]), lists[1] / lists[0], 1.0, "<="),
    ]
    # Not the same promise as PostgresSaver's (the checkpoint is not flushed before the next
    # superstep), so shown without a target: what a graph gains by choosing it.
    loose = max(times[2] - bare, 0.0) / steps
    print(f"graph without a checkpointer: {ms(bare)} for {steps} supersteps")
    rows = [[name, a, o, fmt_ratio(r), f"<= {fmt_ratio(t)}"] for name, a, o, r, t, _ in figures]
    rows.append(
        ["overhead, DurableSaver relaxed", ms(pg_over), ms(loose), fmt_ratio(loose / pg_over), ""]
    )
    least = max(times[3] - bare, 0.0) / steps
    rows.append(
        ["overhead, one flushed 1 KB row", ms(pg_over), ms(least), fmt_ratio(least / pg_over), ""]
    )
    warm = gets[2] / gets[0]
    rows.append(["get_tuple, latest, same saver", ms(gets[0]), ms(gets[2]), fmt_ratio(warm), ""])
    print(table(rows, ["figure", "PostgresSaver", "DurableSaver", "ratio", "target"]))
    b.add(
        "langgraph",
        "overhead per superstep, durability relaxed (vs PostgresSaver)",
        f"{ms(loose)}, {fmt_ratio(loose / pg_over)}",
    )
    b.add(
        "langgraph",
        "overhead per superstep of a saver writing one flushed 1 KB row (the least, info)",
        f"{ms(least)}, {fmt_ratio(least / pg_over)}",
    )
    b.add("langgraph", "get_tuple, latest, same saver", f"{ms(gets[2])}, {fmt_ratio(warm)}")
    for name, _, ours, r, target, _ in figures:
        b.add(
            "langgraph",
            f"{name} (vs PostgresSaver)",
            f"{ours}, {fmt_ratio(r)}",
            f"<= {fmt_ratio(target)}",
            r <= target,
        )
