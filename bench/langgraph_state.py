"""Loading a run's latest state, against LangGraph's ``get_state``, on the same PostgreSQL.

The same history on both sides: 200 steps, each appending a ~1 KB message of incompressible
text (a ~200 KB state at the end). Ours: a ``bench-append`` run, then ``state_at(run)``, the
call behind the CLI's ``show`` and the run page (find the head, rebuild it from the nearest
snapshot and its deltas, verify its hash). LangGraph: a one-node graph that loops 200 times
on ``langgraph-checkpoint-postgres``'s ``PostgresSaver``, then ``graph.get_state(config)``.
Both are timed warm in this process, alternately, so a noisy moment hits both; medians, p95
and the ratio are printed, with the rebuild of our head checkpoint alone (no lookups, no
verification) for where the time goes. Needs the ``bench`` extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import operator
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, TypedDict

from bench.common import Bench, doorbell, execute_until_done, fmt_ratio, truncate_product_tables
from bench.stats import median, ms, percentile, ratio, size, table

STEPS = 200


class _GraphState(TypedDict):
    i: int
    messages: Annotated[list, operator.add]


def _append(state: _GraphState) -> dict[str, Any]:
    # The same change as bench.agents.append: one ~1 KB message of incompressible text.
    from bench.agents import random_text

    return {"i": state["i"] + 1, "messages": [{"role": "user", "content": random_text(1024)}]}


def _langgraph_run(db_url: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    """A graph run of STEPS steps on PostgresSaver: its ``get_state`` and a closer."""
    try:
        from langgraph.checkpoint.postgres import PostgresSaver
        from langgraph.graph import END, START, StateGraph
    except ImportError as exc:
        raise RuntimeError(
            f"the langgraph-state part needs the bench extra: pip install -e '.[bench]' ({exc})"
        ) from None
    manager = PostgresSaver.from_conn_string(db_url.replace("postgres://", "postgresql://", 1))
    saver = manager.__enter__()
    saver.setup()
    builder = StateGraph(_GraphState)
    builder.add_node("append", _append)
    builder.add_edge(START, "append")
    builder.add_conditional_edges("append", lambda s: "append" if s["i"] < STEPS else END)
    graph = builder.compile(checkpointer=saver)
    config = {"configurable": {"thread_id": uuid.uuid4().hex}, "recursion_limit": STEPS + 10}
    graph.invoke({"i": 0, "messages": []}, config, durability="sync")
    return (lambda: graph.get_state(config)), (lambda: manager.__exit__(None, None, None))


def _our_run() -> tuple[Callable[[], Any], Callable[[], Any]]:
    """A bench-append run of STEPS steps: its latest-state load, and the rebuild of its head
    alone (no lookup of the run and its head, no verification: where the time goes)."""
    from durability import checkpoints, operations

    with doorbell(False):
        run_ = operations.start("bench-append", {"n": STEPS}, by="bench")
        outcome = execute_until_done(run_.id)
    if outcome != "succeeded":
        raise RuntimeError(f"building the run ended {outcome}")
    run_.refresh_from_db()
    head = checkpoints.checkpoint(run_.id, run_.head_seq)
    return (lambda: operations.state_at(run_.id)), (lambda: checkpoints.rebuild(head.id))


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run(b: Bench) -> None:
    from durability import canonical

    print(f"\n== Latest state: state_at vs LangGraph get_state ({STEPS} steps of ~1 KB)")
    truncate_product_tables()
    ours, rebuild = _our_run()
    theirs, close = _langgraph_run(b.db_url)
    try:
        ours_state, their_state = ours(), theirs().values
        if len(ours_state["messages"]) != STEPS or len(their_state["messages"]) != STEPS:
            raise RuntimeError("a side did not end with one message per step")
        print(
            f"state: ours {size(len(canonical.dumps(ours_state)))},"
            f" LangGraph {size(len(canonical.dumps(their_state)))}"
        )
        repeats = 40 if b.quick else 300
        for _ in range(5):  # connections, statement caches, imports
            ours(), theirs()
        times: dict[str, list[float]] = {"state_at": [], "get_state": [], "rebuild": []}
        for _ in range(repeats):
            times["state_at"].append(_timed(ours))
            times["get_state"].append(_timed(theirs))
            times["rebuild"].append(_timed(rebuild))
    finally:
        close()
    _report(b, times, repeats)
    truncate_product_tables()


def _report(b: Bench, times: dict[str, list[float]], repeats: int) -> None:
    base = median(times["get_state"])
    rows = [
        [
            name,
            ms(median(values)),
            ms(percentile(values, 95)),
            fmt_ratio(ratio(median(values), base)),
        ]
        for name, values in times.items()
    ]
    print(f"{repeats} loads per line, alternating, warm, in this process")
    print(table(rows, ["what", "median", "p95", "/get_state"]))
    ours = median(times["state_at"])
    b.add("langgraph-state", "state_at median", ms(ours))
    b.add("langgraph-state", "LangGraph get_state median", ms(base))
    rel = ratio(ours, base)
    b.add("langgraph-state", "state_at / get_state (median)", fmt_ratio(rel), "<= 1x", rel <= 1.0)
    p95 = ratio(percentile(times["state_at"], 95), percentile(times["get_state"], 95))
    b.add("langgraph-state", "state_at / get_state (p95)", fmt_ratio(p95))
    b.add("langgraph-state", "rebuild of the head alone (info)", ms(median(times["rebuild"])))
