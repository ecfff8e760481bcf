"""``list``: the checkpoints it chooses, many of one run rebuilt at once (every patch and
snapshot on their paths read in two queries and applied in order, each patch checked
against the state hashes it chains, instead of one rebuild per checkpoint), with their
pending writes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    Checkpoint,
    CheckpointTuple,
    get_checkpoint_id,
    writes_sort_key,
)

from durability import canonical, checkpoints, diff
from durability.errors import IntegrityViolation
from durability.langgraph import codec
from durability.langgraph.models import PendingWrite, SavedCheckpoint, Thread
from durability.langgraph.shared import lg_config
from durability.models import Checkpoint as StoredCheckpoint
from durability.models import Mutation, Snapshot


def listed(
    config: RunnableConfig | None,
    filter: dict[str, Any] | None,
    before: RunnableConfig | None,
    limit: int | None,
    serde: Any,
) -> list[CheckpointTuple]:
    """LangGraph's ``list``: the checkpoints of ``config``'s thread (every thread's if
    None; one namespace's if it names one), newest first, whose metadata has ``filter``'s
    values, older than ``before``, at most ``limit`` of them."""
    threads = Thread.objects.all()
    if config is not None:
        conf = config["configurable"]
        threads = threads.filter(thread_id=str(conf["thread_id"]))
        if conf.get("checkpoint_ns") is not None:
            threads = threads.filter(checkpoint_ns=conf["checkpoint_ns"])
    rows = SavedCheckpoint.objects.filter(thread__in=threads).select_related("thread")
    if config is not None and (wanted := get_checkpoint_id(config)):
        rows = rows.filter(lg_id=wanted)
    if before is not None and (before_id := get_checkpoint_id(before)):
        rows = rows.filter(lg_id__lt=before_id)
    chosen: list[SavedCheckpoint] = []
    for row in rows.order_by("-lg_id"):
        if limit is not None and len(chosen) >= limit:
            break
        if filter:
            md = codec.decode(row.metadata, serde)
            if not all(md.get(key) == value for key, value in filter.items()):
                continue
        chosen.append(row)
    return _tuples(chosen, serde)


def _tuples(chosen: list[SavedCheckpoint], serde: Any) -> list[CheckpointTuple]:
    by_run: dict[Any, set[int]] = {}
    for row in chosen:
        by_run.setdefault(row.thread.run_id, set()).add(row.checkpoint_id)
    decoded: dict[int, tuple[Any, Any, Any]] = {}
    memo = codec.Memo(serde)

    def emit(cp_id: int, doc: Any) -> None:
        decoded[cp_id] = (
            memo.decode(doc["checkpoint"]),
            memo.decode(doc["values"]),
            codec.decode(doc["metadata"], serde),
        )

    for run_id, ids in by_run.items():
        each_state(run_id, ids, emit)
    writes: dict[tuple[int, str], list] = {}
    for thread_pk in {row.thread_id for row in chosen}:
        thread = next(row.thread for row in chosen if row.thread_id == thread_pk)
        lg_ids = [row.lg_id for row in chosen if row.thread_id == thread_pk]
        for lg_id, found in pending_writes(thread, lg_ids, serde).items():
            writes[(thread_pk, lg_id)] = found
    result = []
    for row in chosen:
        fields, values, md = decoded[row.checkpoint_id]
        thread_id, ns = row.thread.thread_id, row.thread.checkpoint_ns
        result.append(
            CheckpointTuple(
                config=lg_config(thread_id, ns, row.lg_id),
                checkpoint=cast(Checkpoint, {**fields, "channel_values": values}),
                metadata=md,
                parent_config=lg_config(thread_id, ns, row.lg_parent_id)
                if row.lg_parent_id
                else None,
                pending_writes=writes.get((row.thread_id, row.lg_id), []),
            )
        )
    return result


def each_state(run_id: Any, wanted: set[int], emit: Callable[[int, Any], None]) -> None:
    """Call ``emit(checkpoint id, state)`` for each wanted checkpoint of the run, oldest
    first. The state is handed over before the next patch changes it in place: ``emit``
    must copy what it keeps."""
    rows = list(
        StoredCheckpoint.objects.filter(run_id=run_id)
        .order_by("seq")
        .values_list("id", "parent_id", "state_hash", "seq")
    )
    parent_of = {row[0]: row[1] for row in rows}
    needed: set[int] = set()
    snapshots = dict(
        Snapshot.objects.filter(checkpoint__run_id=run_id).values_list("checkpoint_id", "digest")
    )
    for first in wanted:
        cp_id: int | None = first
        while cp_id is not None and cp_id not in needed:
            needed.add(cp_id)
            if cp_id in snapshots:
                break
            cp_id = parent_of.get(cp_id)
    ops_of = dict(
        Mutation.objects.filter(checkpoint_id__in=needed - snapshots.keys()).values_list(
            "checkpoint_id", "ops"
        )
    )
    texts = dict(
        Snapshot.objects.filter(checkpoint_id__in=needed & snapshots.keys()).values_list(
            "checkpoint_id", "state"
        )
    )
    pending = Counter(parent_of[cp] for cp in needed if cp not in texts)
    states: dict[int, tuple[Any, str]] = {}
    for cp_id, parent_id, state_hash, seq in rows:
        if cp_id not in needed:
            continue
        if cp_id in texts:
            state = _snapshot(run_id, seq, state_hash, texts[cp_id], snapshots[cp_id])
        else:
            base, base_hash = states[parent_id]
            pending[parent_id] -= 1
            if pending[parent_id] > 0:  # another child still needs the parent's state
                base = canonical.loads(canonical.dumps(base))
            else:
                del states[parent_id]
            patch = ops_of[cp_id]
            if canonical.patched(base_hash, patch.encode()) != state_hash:
                raise IntegrityViolation(
                    f"checkpoint #{seq} does not verify: its state hash does not follow from"
                    " its parent's and its patch",
                    run_id=run_id,
                    seq=seq,
                )
            state = diff.apply_own(base, canonical.loads(patch))
        if cp_id in wanted:
            emit(cp_id, state)
        if pending.get(cp_id):
            states[cp_id] = (state, state_hash)


def _snapshot(run_id: Any, seq: int, state_hash: str, text: str, digest: str) -> Any:
    """A snapshot's state, once its bytes are checked against its digest."""
    if checkpoints.seal(state_hash, text.encode()) != digest:
        raise IntegrityViolation(
            f"checkpoint #{seq} does not verify: its snapshot does not match its digest",
            run_id=run_id,
            seq=seq,
        )
    return canonical.loads(text)


def pending_writes(
    thread: Thread, lg_ids: list[str], serde: Any, channels: Iterable[str] | None = None
) -> dict[str, list]:
    """The pending writes of a thread's checkpoints ``lg_ids`` (to ``channels`` only, if
    given), by checkpoint, each as LangGraph hands them back (``decoded_writes``)."""
    found = PendingWrite.objects.filter(thread=thread, checkpoint_id__in=lg_ids)
    if channels is not None:
        found = found.filter(channel__in=list(channels))
    rows: dict[str, list] = {}
    for lg_id, *row in found.values_list(
        "checkpoint_id", "task_id", "idx", "channel", "task_path", "value"
    ):
        rows.setdefault(lg_id, []).append(row)
    return {lg_id: decoded_writes(found, serde) for lg_id, found in sorted(rows.items())}


def decoded_writes(rows: list, serde: Any) -> list[tuple[str, str, Any]]:
    """Stored writes (task id, index, channel, task path, value) as LangGraph hands them
    back (task id, channel, value), in LangGraph's order."""
    return [(task_id, channel, value) for task_id, _, channel, value in _in_order(rows, serde)]


def _in_order(rows: Iterable[tuple], serde: Any) -> Iterator[tuple[str, str, str, Any]]:
    """Stored writes (task id, index, channel, task path, value) in LangGraph's order, as
    (task id, task path, channel, value decoded)."""
    for task_id, _idx, channel, path, value in sorted(
        rows, key=lambda w: writes_sort_key(w[3], w[0], w[1])
    ):
        yield task_id, path, channel, codec.decode(canonical.loads(value), serde)


def task_writes(thread: Thread, lg_id: str, serde: Any) -> list[tuple[str, str, str, Any]]:
    """A checkpoint's pending writes with their tasks' paths, which name the tasks' nodes:
    (task id, task path, channel, value decoded), in LangGraph's order."""
    rows = PendingWrite.objects.filter(thread=thread, checkpoint_id=lg_id).values_list(
        "task_id", "idx", "channel", "task_path", "value"
    )
    return list(_in_order(rows, serde))
