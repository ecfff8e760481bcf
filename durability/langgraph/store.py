"""Reading and writing a LangGraph thread's checkpoints in this product's store.

A LangGraph checkpoint is written like a step's: a patch (RFC 6902) on its parent
checkpoint's state, its state hash chained over the patch, its chain hash over its parent's,
a timeline event, and a snapshot now and then (written off the hot path). On PostgreSQL it
is one statement, data-modifying CTEs chained on the UPDATE of the run that allocates the
checkpoint's number; elsewhere, the ORM in one transaction. Pending writes are a statement
of their own that does not wait for the WAL flush: the checkpoint after them does, and
flushing it flushes them; a database crash in between costs a task re-run, which LangGraph
does for any task without writes. A new thread (its run, the run's empty first checkpoint,
its event, its thread row) is one statement on PostgreSQL too, all or none, not flushed
before answering either: its first checkpoint's flush, next, covers it. The statements
are the store's (``durability.store.langgraph``); this module makes what they write.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import connection
from django.utils import timezone

from durability import canonical, checkpoints, diff
from durability.errors import IntegrityViolation
from durability.langgraph.latest import Stored, ThreadDeleted, first
from durability.langgraph.models import Thread
from durability.langgraph.status import MID_RUN
from durability.models import (
    Checkpoint,
    CheckpointReason,
    Durability,
    Event,
    EventKind,
    Run,
    RunStatus,
    WaitReason,
)
from durability.store import langgraph as lg_store
from durability.store.langgraph import AGENT_VERSION, SCHEMA_VERSION
from durability.telemetry import current_traceparent

# A new thread's run waits for its graph to go on (``status``: what the saver reports).
WAIT_DETAIL = MID_RUN


@dataclass(slots=True)
class NewCheckpoint:
    thread: Thread
    parent: Stored
    seq: int
    lg_id: str
    parent_lg_id: str
    doc: Any
    metadata: Any
    step: str


def thread_of(
    thread_id: str,
    ns: str,
    *,
    graph: str,
    create: bool,
    absent: bool = False,
    durability: str = Durability.STRICT,
) -> tuple[Thread | None, Stored | None]:
    """The namespace's thread row and run; made (with the run and its empty first
    checkpoint) when ``create``. A subgraph's namespace is a child run of its parent's.
    Second: the first checkpoint, if this call made it (the parent of the thread's first
    ``put``, which need not read it back). ``absent``: the caller read the namespace a
    moment ago and found nothing, so it is made without being looked up first (if another
    process made it meanwhile, making it fails and it is read, as below). ``durability``:
    the saver's, which a run made here shows."""
    found = Thread.objects.select_related("run").filter(thread_id=thread_id, checkpoint_ns=ns)
    thread = None if create and absent else found.first()
    if thread is not None or not create:
        return thread, None
    parent = None
    if ns:
        parent, _ = thread_of(
            thread_id, ns.rpartition("|")[0], graph=graph, create=True, durability=durability
        )
    try:
        return new_thread(
            thread_id, ns, graph=graph, parent=parent, db=connection, durability=durability
        )
    except Exception:
        # Another process made it first (the unique thread and namespace).
        thread = found.first()
        if thread is None:
            raise
        return thread, None


def new_thread(
    thread_id: str,
    ns: str,
    *,
    graph: str,
    parent: Thread | None,
    db: Any,
    durability: str = Durability.STRICT,
) -> tuple[Thread, Stored]:
    """Make the namespace's thread row, its run (a child of ``parent``'s, a subgraph's) and
    the run's empty first checkpoint, on the connection ``db``, all or none; and that
    checkpoint (the parent of the thread's first ``put``). ``IntegrityError`` if another
    process made the thread first."""
    run = Run(
        agent=graph,
        agent_version=AGENT_VERSION,
        status=RunStatus.WAITING,
        wait_reason=WaitReason.GRAPH,
        durability=durability,
        wait_detail=WAIT_DETAIL,
        started_at=timezone.now(),  # made by the graph's first checkpoint
        input=canonical.dumps({"thread_id": thread_id, "checkpoint_ns": ns}).decode(),
        parent_run=parent.run if parent else None,
        # The span the graph's first checkpoint was stored under, if the user's process
        # traces: the run page links to its trace, as it does for runs the workers
        # execute. A subgraph's run is in its parent's trace.
        trace_parent=parent.run.trace_parent if parent else current_traceparent(),
    )
    start = checkpoints.whole_checkpoint(
        run.id,
        canonical.dumps({}),
        seq=0,
        parent_chain="",
        reason=CheckpointReason.START,
        step="",
        next_step="",
        schema_version=SCHEMA_VERSION,
        agent_version=AGENT_VERSION,
    )
    created = Event(
        run=run,
        kind=EventKind.CREATED,
        seq=0,
        data=canonical.dumps(
            {"agent": graph, "langgraph": {"thread_id": thread_id, "checkpoint_ns": ns}}
        ).decode(),
    )
    thread = Thread(thread_id=thread_id, checkpoint_ns=ns, run=run)
    start_id = lg_store.for_connection(db).make_thread(run, start, created, thread)
    return thread, first(start_id, start["state_hash"], start["chain_hash"], start["size"])


def start_of(thread: Thread) -> Stored:
    cp = Checkpoint.objects.filter(run_id=thread.run_id, seq=0).first()
    if cp is None:
        raise ThreadDeleted(f"run {thread.run_id} was deleted")
    return first(cp.id, cp.state_hash, cp.chain_hash, cp.size)


def stored(thread: Thread, lg_id: str) -> Stored | None:
    """A stored checkpoint by its LangGraph id, rebuilt and verified."""
    cp = (
        Checkpoint.objects.filter(langgraph__thread=thread, langgraph__lg_id=lg_id)
        .select_related("parent")
        .first()
    )
    if cp is None:
        return None
    doc, data, rebuilt = checkpoints.verified_state(cp)
    return Stored(
        cp.id,
        cp.seq,
        lg_id,
        cp.state_hash,
        cp.chain_hash,
        cp.delta_run if rebuilt.deltas else 0,
        cp.size,
        doc,
        data,
    )


def needs_snapshot(delta_run: int, size: int) -> bool:
    """A thread's latest checkpoint is rebuilt by every invocation of its graph
    (``get_tuple``), so its snapshot is kept closer than a native run's: once the patches
    since the last one outweigh half the state, not all of it (a rebuild reads at most one
    and a half states; the snapshots of a growing thread add up to about three)."""
    return 2 * delta_run > size


def exact_patch(parent: Stored, doc: Any) -> tuple[bytes, int, int]:
    """The patch that turns ``parent``'s state into ``doc`` (its bytes and number of
    operations) and the length of ``doc``'s canonical bytes, proven: the patch applied to
    the parent's state gives ``doc``, the same types and values everywhere
    (``diff.same``), which is the same canonical bytes (as the worker proves a step's patch
    before its commit). Neither state is serialized: ``doc`` shares with the parent's
    document the messages the encoder kept, the patched copy shares the rest of it
    (``diff.apply_own(shared=True)``), so the proof, like the diff and the size
    (``diff.apply_sized``), costs what changed, not the state. The parent's document is
    left as it is; ``doc`` becomes the next parent's."""
    ops = diff.diff(parent.doc, doc)
    ops_bytes = canonical.dumps(ops)
    patched, size = diff.apply_sized(
        parent.doc, canonical.loads(ops_bytes), parent.size, shared=True
    )
    if diff.same(patched, doc):
        return ops_bytes, len(ops), size
    # The fast walk missed a change of number type (1 -> 1.0 -> True): diff exactly, and
    # prove it byte for byte (a rare path: the bytes cost what the shared walk saves).
    if parent.data is None:
        parent.data = canonical.dumps(parent.doc)
    state_bytes = canonical.dumps(doc)
    base = canonical.loads(parent.data)
    ops = diff.diff(base, doc, strict=True)
    ops_bytes = canonical.dumps(ops)
    # ``base`` is ours (parsed here) and the operations' values are their own copies:
    # patched in place, as the engine's proof does (``checkpointing.proven``).
    patched = diff.apply_own(base, canonical.loads(ops_bytes))
    if canonical.dumps(patched) != state_bytes:  # pragma: no cover - a bug if reached
        raise IntegrityViolation("a LangGraph checkpoint's patch does not reproduce it")
    return ops_bytes, len(ops), len(state_bytes)


def commit(
    new: NewCheckpoint,
    snapshots: checkpoints.SnapshotWriter,
    db: Any,
    *,
    relaxed: bool = False,
    report: lg_store.Report | None = None,
) -> Stored:
    """Store ``new`` as a patch on its parent, on the connection ``db``. The run's
    checkpoint number is taken in the same statement: if another writer took it meanwhile,
    the chain is made again on the number it left. ``relaxed``: without waiting for the
    flush to disk (the product's relaxed durability level). ``report``: a change of the
    run's status written with the checkpoint, in its transaction."""
    ops_bytes, count, size = exact_patch(new.parent, new.doc)
    doc = new.doc
    state_hash = canonical.patched(new.parent.state_hash, ops_bytes)
    delta_run = new.parent.delta_run + len(ops_bytes)
    snapshot = needs_snapshot(delta_run, size)
    # The state's bytes only where a snapshot is due (every few checkpoints, see
    # ``needs_snapshot``): the patch and its proof need none.
    state_bytes = canonical.dumps(doc) if snapshot else None
    inline = state_bytes is not None and size <= checkpoints.INLINE_SNAPSHOT_BYTES
    row = _row(new, ops_bytes, count, size, state_hash, delta_run, state_bytes if inline else None)
    statements = lg_store.for_connection(db)
    seq = new.seq
    for _ in range(100):
        chain = checkpoints.link(
            new.parent.chain_hash,
            state_hash,
            run_id=new.thread.run_id,
            seq=seq,
            step=new.step,
            next_step="",
            schema_version=SCHEMA_VERSION,
            agent_version=AGENT_VERSION,
        )
        row.update(head_seq=seq - 1, chain_hash=chain, commit_id=uuid.uuid4())
        checkpoint_id = statements.insert_checkpoint(row, relaxed, report)
        if checkpoint_id is not None:
            break
        head = statements.head_seq(new.thread.run_id)
        if head is None:
            raise ThreadDeleted(f"run {new.thread.run_id} was deleted")
        seq = head + 1
    else:  # pragma: no cover - a hundred writers on one thread at once
        raise IntegrityViolation("could not number the checkpoint", run_id=new.thread.run_id)
    if state_bytes is not None and not inline:
        snapshots.submit(checkpoint_id, state_hash, state_bytes)
    return Stored(
        checkpoint_id,
        seq,
        new.lg_id,
        state_hash,
        chain,
        0 if snapshot else delta_run,
        size,
        doc,
        state_bytes,
    )


def _row(
    new: NewCheckpoint,
    ops_bytes: bytes,
    count: int,
    size: int,
    state_hash: str,
    delta_run: int,
    inline: bytes | None,
) -> dict[str, Any]:
    """The commit statement's parameters, but the number and the chain hash. ``inline``:
    the state's bytes, when its snapshot is written with it."""
    return {
        "run": new.thread.run_id,
        "parent": new.parent.id,
        "step": new.step,
        "state_hash": state_hash,
        "size": size,
        "delta_size": len(ops_bytes),
        "delta_run": delta_run,
        "ops": ops_bytes.decode(),
        "count": count,
        "thread": new.thread.pk,
        "lg_id": new.lg_id,
        "lg_parent": new.parent_lg_id,
        "metadata": canonical.dumps(new.metadata).decode(),
        "data": canonical.dumps({"bytes": size, "delta": len(ops_bytes), "ops": count}).decode(),
        "snapshot": inline.decode() if inline is not None else None,
        "digest": checkpoints.seal(state_hash, inline) if inline is not None else "",
    }


def put_writes(
    thread: int,
    checkpoint_id: str,
    task_id: str,
    task_path: str,
    rows: Iterable[tuple[int, str, bytes]],
    *,
    replace: bool,
    db: Any,
) -> None:
    """Store a task's writes; a write already stored is kept, unless all of them are
    LangGraph's special writes (an error, an interrupt, a resume value), which replace."""
    statements = lg_store.for_connection(db)
    statements.put_writes(thread, checkpoint_id, task_id, task_path, list(rows), replace=replace)
