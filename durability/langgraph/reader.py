"""Many checkpoints of one run rebuilt at once, for ``list``: every patch and snapshot on
their paths read in two queries and applied in order, each patch checked against the state
hashes it chains, instead of one rebuild per checkpoint."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from langgraph.checkpoint.base import writes_sort_key

from durability import canonical, checkpoints, diff
from durability.errors import IntegrityViolation
from durability.langgraph import codec
from durability.langgraph.models import PendingWrite, Thread
from durability.models import Checkpoint, Mutation, Snapshot


def each_state(run_id: Any, wanted: set[int], emit: Callable[[int, Any], None]) -> None:
    """Call ``emit(checkpoint id, state)`` for each wanted checkpoint of the run, oldest
    first. The state is handed over before the next patch changes it in place: ``emit``
    must copy what it keeps."""
    rows = list(
        Checkpoint.objects.filter(run_id=run_id)
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


def pending_writes(thread: Thread, lg_ids: list[str], serde: Any) -> dict[str, list]:
    """The pending writes of a thread's checkpoints ``lg_ids``, by checkpoint, each as
    LangGraph hands them back (``decoded_writes``)."""
    rows: dict[str, list] = {}
    for lg_id, *row in PendingWrite.objects.filter(
        thread=thread, checkpoint_id__in=lg_ids
    ).values_list("checkpoint_id", "task_id", "idx", "channel", "task_path", "value"):
        rows.setdefault(lg_id, []).append(row)
    return {lg_id: decoded_writes(found, serde) for lg_id, found in sorted(rows.items())}


def decoded_writes(rows: list, serde: Any) -> list[tuple[str, str, Any]]:
    """Stored writes (task id, index, channel, task path, value) as LangGraph hands them
    back (task id, channel, value), in LangGraph's order."""
    return [
        (task_id, channel, codec.decode(canonical.loads(value), serde))
        for task_id, _idx, channel, _path, value in sorted(
            rows, key=lambda w: writes_sort_key(w[3], w[0], w[1])
        )
    ]
