"""LangGraph's ``DeltaChannel`` (beta in LangGraph) on this store.

A ``DeltaChannel`` keeps its value out of most checkpoints: LangGraph stores it whole every
``snapshot_frequency`` updates and, in between, rebuilds it from the nearest ancestor that
holds it (the seed) and the writes of the checkpoints since, which it asks the saver for
(``get_delta_channel_history``) each time it loads a thread. LangGraph's default answer
reads the ancestors one ``get_tuple`` at a time, each a query and a rebuild here; this one
reads their ids in one query per page, their states in one pass (``reader.each_state``)
and their writes in one query, with the default's answer exactly (the tests hold the two
side by side).

With this store a ``DeltaChannel`` saves nothing: every checkpoint is already a patch on its
parent, so a plain ``add_messages`` channel costs one message per superstep too, and the
dashboard shows its value at every checkpoint rather than only at LangGraph's snapshots.

``keep_latest`` pruning would cut a kept checkpoint off the ancestors its delta channels are
rebuilt from, so that they would read as empty: it is refused for threads that use one, as
LangGraph's own ``PostgresSaver`` refuses it (``uses``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from django.db import connection
from langgraph.checkpoint.base import DeltaChannelHistory

from durability import canonical
from durability.langgraph import codec, reader
from durability.langgraph.models import SavedCheckpoint, Thread
from durability.store import langgraph as lg_store

# LangGraph's metadata of a checkpoint of a graph with a delta channel: its counters since
# the channel's last snapshot (every checkpoint but one right after all were snapshotted).
COUNTERS = "counters_since_delta_snapshot"
# Ancestors read per page, growing: a seed is usually within ``snapshot_frequency`` (100
# by default) checkpoints, and a page costs a few queries, whatever its length, and a
# little per state rebuilt.
FIRST_PAGE, LAST_PAGE = 128, 4096


def history(
    thread: Thread, lg_id: str, channels: Sequence[str], serde: Any
) -> dict[str, DeltaChannelHistory]:
    """For each of ``channels``: the writes of checkpoint ``lg_id``'s ancestors (the latest
    checkpoint's when empty) since the nearest one holding the channel's value, oldest
    first, and that value as ``seed`` (none if no ancestor holds it)."""
    collected: dict[str, list[Any]] = {ch: [] for ch in channels}
    seeds: dict[str, Any] = {}
    remaining = set(channels)
    statements = lg_store.for_connection(connection)
    start = lg_id or _latest(thread)
    page = FIRST_PAGE
    while remaining and start:
        rows = statements.ancestors(thread.pk, start, page)
        chain = rows[1:]  # the first is ``start``: the target, or the last page's end
        if not chain:
            break
        held = _held(thread, chain, remaining)
        writes = reader.pending_writes(thread, [lg for _, lg in chain], serde, remaining)
        for cp_id, lg in chain:  # nearest first, as LangGraph's default walks
            for write in reversed(writes.get(lg, ())):
                if write[1] in remaining:
                    collected[write[1]].append(write)
            for ch in [ch for ch in remaining if ch in held.get(cp_id, {})]:
                seeds[ch] = codec.decode(held[cp_id][ch], serde)
                remaining.discard(ch)
            if not remaining:
                break
        start = chain[-1][1] if len(rows) > page else ""
        page = min(page * 4, LAST_PAGE)
    result: dict[str, DeltaChannelHistory] = {}
    for ch in channels:
        entry: DeltaChannelHistory = {"writes": list(reversed(collected[ch]))}
        if ch in seeds:
            entry["seed"] = seeds[ch]
        result[ch] = entry
    return result


def uses(thread_ids: Iterable[str]) -> list[str]:
    """Which of ``thread_ids`` have a checkpoint of a graph with a delta channel."""
    found = SavedCheckpoint.objects.filter(
        thread__thread_id__in=[str(t) for t in thread_ids], metadata__has_key=COUNTERS
    ).values_list("thread__thread_id", flat=True)
    return sorted(set(found))


def _latest(thread: Thread) -> str:
    found = SavedCheckpoint.objects.filter(thread=thread).order_by("-lg_id")
    return found.values_list("lg_id", flat=True).first() or ""


def _held(thread: Thread, chain: list[tuple[int, str]], wanted: set[str]) -> dict[int, dict]:
    """The values of ``wanted`` channels that the chain's checkpoints hold, by checkpoint
    (copies: ``each_state`` patches its states in place)."""
    held: dict[int, dict] = {}

    def emit(cp_id: int, state: Any) -> None:
        values = state.get("values", {})
        if found := {ch: values[ch] for ch in wanted if ch in values}:
            held[cp_id] = canonical.loads(canonical.dumps(found))

    reader.each_state(thread.run_id, {cp_id for cp_id, _ in chain}, emit)
    return held
