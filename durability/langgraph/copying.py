"""LangGraph's ``copy_thread``: a thread's whole history made again under another thread id.

Each namespace's run of the source thread (a subgraph's a child run, as the saver makes them)
is copied into a new run of the saver's graph: every checkpoint with its patch and snapshot
as they are stored, its LangGraph ids and metadata, its timeline event, and the thread's
pending writes. The state hashes and the snapshots' digests do not depend on the run, so
they are kept; each checkpoint's chain hash names its run, so it is chained anew, and the
copy verifies on its own (``durability verify``). The source is left as it is. The copy is
a new conversation that starts where the source stands: the two go on apart.
"""

from __future__ import annotations

import uuid

from django.db import transaction
from django.utils import timezone

from durability import canonical, checkpoints
from durability.langgraph import options
from durability.langgraph.models import PendingWrite, SavedCheckpoint, Thread
from durability.langgraph.status import MID_RUN
from durability.models import Checkpoint, Event, EventKind, Run, RunStatus, Snapshot, WaitReason
from durability.store.base import write_checkpoint
from durability.store.langgraph import AGENT_VERSION
from durability.telemetry import current_traceparent

# The statuses a copy keeps; any other (a worker's run mid-step) becomes waiting for its
# graph to go on, as a thread the saver writes is.
_KEPT = (RunStatus.WAITING, RunStatus.SUCCEEDED, RunStatus.FAILED)


def copy_thread(source: str, target: str, *, graph: str) -> list[Thread]:
    """Copy thread ``source`` into thread ``target`` (new runs of ``graph``), all or none;
    the new thread rows, parents first. A source with no checkpoints, a ``target`` that
    exists already, or the source itself, is refused before anything changes
    (``ValueError``; LangGraph's conformance suite allows an error for the first)."""
    source, target = options.thread_id(source), options.thread_id(target)
    if source == target:
        raise ValueError(f"copy_thread: the source and the target are one thread ({source!r})")
    with transaction.atomic():
        # The source's runs locked first (in one order): a checkpoint stored meanwhile (its
        # statement updates its run) waits for the copy, which reads the thread as one.
        runs = Thread.objects.filter(thread_id=source).values("run_id")
        list(Run.objects.select_for_update().filter(pk__in=runs).order_by("pk"))
        rows = list(Thread.objects.select_related("run").filter(thread_id=source))
        if not rows:
            raise ValueError(
                f"copy_thread: thread {source!r} has no checkpoints here; nothing was copied"
            )
        if Thread.objects.filter(thread_id=target).exists():
            raise ValueError(
                f"copy_thread: thread {target!r} exists already; nothing was copied (delete"
                " it first, or copy into a new thread id)"
            )
        # Parents first: a subgraph's namespace extends its parent's with "|".
        rows.sort(key=lambda t: (t.checkpoint_ns.count("|"), t.checkpoint_ns))
        made: dict[str, Thread] = {}
        for old in rows:
            parent = made.get(old.checkpoint_ns.rpartition("|")[0]) if old.checkpoint_ns else None
            made[old.checkpoint_ns] = _copy_namespace(old, target, graph, parent)
        return list(made.values())


def _copy_namespace(old: Thread, target: str, graph: str, parent: Thread | None) -> Thread:
    src = old.run
    kept = src.status in _KEPT
    run = Run.objects.create(
        agent=graph,
        agent_version=AGENT_VERSION,
        status=src.status if kept else RunStatus.WAITING,
        durability=src.durability,
        wait_reason=src.wait_reason if kept else WaitReason.GRAPH,
        wait_detail=src.wait_detail if kept else MID_RUN,
        error=src.error if kept else "",
        error_code=src.error_code if kept else "",
        outcome=src.outcome if kept else "",
        input=canonical.dumps({"thread_id": target, "checkpoint_ns": old.checkpoint_ns}).decode(),
        head_seq=src.head_seq,
        started_at=src.started_at or timezone.now(),
        finished_at=src.finished_at if kept else None,
        parent_run=parent.run if parent else None,
        trace_parent=parent.run.trace_parent if parent else current_traceparent(),
    )
    thread = Thread.objects.create(thread_id=target, checkpoint_ns=old.checkpoint_ns, run=run)
    ids = _copy_checkpoints(src, run)
    _copy_events(old, thread, graph)
    SavedCheckpoint.objects.bulk_create(
        SavedCheckpoint(
            checkpoint_id=ids[s.checkpoint_id],
            thread=thread,
            lg_id=s.lg_id,
            lg_parent_id=s.lg_parent_id,
            metadata=s.metadata,
        )
        for s in SavedCheckpoint.objects.filter(thread=old)
    )
    PendingWrite.objects.bulk_create(
        PendingWrite(
            thread=thread,
            checkpoint_id=w.checkpoint_id,
            task_id=w.task_id,
            idx=w.idx,
            channel=w.channel,
            task_path=w.task_path,
            value=w.value,
        )
        for w in PendingWrite.objects.filter(thread=old)
    )
    return thread


def _copy_events(old: Thread, thread: Thread, graph: str) -> None:
    """The copy's timeline: its making, which names the source, and each checkpoint's."""
    made = {
        "agent": graph,
        "langgraph": {"thread_id": thread.thread_id, "checkpoint_ns": thread.checkpoint_ns},
        "copied_from": {"thread_id": old.thread_id, "run": str(old.run_id)},
    }
    steps = Event.objects.filter(run_id=old.run_id, kind=EventKind.CHECKPOINT).order_by("id")
    Event.objects.bulk_create(
        [
            Event(
                run=thread.run, kind=EventKind.CREATED, seq=0, data=canonical.dumps(made).decode()
            ),
            *(
                Event(run=thread.run, kind=e.kind, seq=e.seq, step=e.step, data=e.data)
                for e in steps
            ),
        ],
        run_checked=True,  # made by the caller
    )


def _copy_checkpoints(src: Run, run: Run) -> dict[int, int]:
    """Every checkpoint of ``src`` made again on ``run`` (``write_checkpoint``, with its
    patch and its snapshot if it has one), oldest first (a parent before its children),
    chained anew; the new ids by the old."""
    ids: dict[int, int] = {}
    chains: dict[int, str] = {}
    for cp in Checkpoint.objects.filter(run=src).select_related("mutation", "snapshot"):
        parent_id = ids[cp.parent_id] if cp.parent_id is not None else None
        # A compacted checkpoint's removed parent: its chain is what this one links on, in
        # the copy as in the source.
        linked_on = chains[parent_id] if parent_id is not None else cp.parent_chain
        snapshot = _snapshot_of(cp)
        new = write_checkpoint(
            ops=cp.mutation.ops,
            count=cp.mutation.count,
            snapshot=snapshot.state if snapshot is not None else None,
            digest=snapshot.digest if snapshot is not None else "",
            run=run,
            seq=cp.seq,
            parent_id=parent_id,
            reason=cp.reason,
            step=cp.step,
            next_step=cp.next_step,
            state_hash=cp.state_hash,
            chain_hash=checkpoints.chain_of(cp, linked_on, run_id=run.pk),
            schema_version=cp.schema_version,
            agent_version=cp.agent_version,
            config_hash=cp.config_hash,
            parent_chain=cp.parent_chain,
            parent_state=cp.parent_state,
            packages=cp.packages,
            size=cp.size,
            delta_size=cp.delta_size,
            delta_run=cp.delta_run,
            commit_id=uuid.uuid4(),
            created_by=cp.created_by,
        )
        ids[cp.id], chains[new.id] = new.id, new.chain_hash
    return ids


def _snapshot_of(cp: Checkpoint) -> Snapshot | None:
    """A checkpoint's snapshot row, None if it is stored as a patch only."""
    try:
        return cp.snapshot
    except Snapshot.DoesNotExist:
        return None
