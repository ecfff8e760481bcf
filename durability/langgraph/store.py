"""Reading and writing a LangGraph thread's checkpoints in this product's store.

A LangGraph checkpoint is written like a step's: a patch (RFC 6902) on its parent
checkpoint's state, its state hash chained over the patch, its chain hash over its parent's,
a timeline event, and a snapshot now and then (written off the hot path). On PostgreSQL it
is one statement, data-modifying CTEs chained on the UPDATE of the run that allocates the
checkpoint's number; elsewhere, the ORM in one transaction. Pending writes are a statement
of their own that does not wait for the WAL flush: the checkpoint after them does, and
flushing it flushes them; a database crash in between costs a task re-run, which LangGraph
does for any task without writes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from durability import canonical, checkpoints, diff
from durability.errors import IntegrityViolation
from durability.langgraph.latest import Stored
from durability.langgraph.models import PendingWrite, SavedCheckpoint, Thread
from durability.models import (
    Checkpoint,
    CheckpointReason,
    Event,
    EventKind,
    Mutation,
    Run,
    RunStatus,
    Snapshot,
)

AGENT_VERSION = "langgraph"
SCHEMA_VERSION = 1
WAIT_DETAIL = "a LangGraph thread: it goes on when its graph is invoked again"


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


def thread_of(thread_id: str, ns: str, *, graph: str, create: bool) -> Thread | None:
    """The namespace's thread row and run; made (with the run and its empty first
    checkpoint) when ``create``. A subgraph's namespace is a child run of its parent's."""
    found = Thread.objects.select_related("run").filter(thread_id=thread_id, checkpoint_ns=ns)
    thread = found.first()
    if thread is not None or not create:
        return thread
    parent = None
    if ns:
        parent = thread_of(thread_id, ns.rpartition("|")[0], graph=graph, create=True)
    try:
        with transaction.atomic():
            run = Run.objects.create(
                agent=graph,
                agent_version=AGENT_VERSION,
                status=RunStatus.WAITING,
                wait_detail=WAIT_DETAIL,
                input=canonical.dumps({"thread_id": thread_id, "checkpoint_ns": ns}).decode(),
                parent_run=parent.run if parent else None,
            )
            checkpoints.write_snapshot_checkpoint(
                run,
                canonical.dumps({}),
                seq=0,
                parent=None,
                reason=CheckpointReason.START,
                step="",
                next_step="",
                schema_version=SCHEMA_VERSION,
                agent_version=AGENT_VERSION,
            )
            Event.objects.create(
                run=run,
                kind=EventKind.CREATED,
                seq=0,
                data=canonical.dumps(
                    {"agent": graph, "langgraph": {"thread_id": thread_id, "checkpoint_ns": ns}}
                ).decode(),
            )
            return Thread.objects.create(thread_id=thread_id, checkpoint_ns=ns, run=run)
    except Exception:
        # Another process made it first (the unique thread and namespace).
        thread = found.first()
        if thread is None:
            raise
        return thread


def start_of(thread: Thread) -> Stored:
    cp = Checkpoint.objects.get(run_id=thread.run_id, seq=0)
    return Stored(cp.id, 0, "", cp.state_hash, cp.chain_hash, 0, cp.size, {}, b"{}")


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


def exact_patch(parent: Stored, doc: Any) -> tuple[bytes, int, bytes, Any]:
    """The patch that turns ``parent``'s state into ``doc`` (its bytes and number of
    operations), ``doc``'s canonical bytes and
    the parent's state with the patch applied, proven to be those bytes (as the worker
    proves a step's patch before its commit). The parent's own document is patched in
    place: the caller forgets it if the commit fails."""
    if parent.data is None:
        parent.data = canonical.dumps(parent.doc)
    state_bytes = canonical.dumps(doc)
    ops = diff.diff(parent.doc, doc)
    ops_bytes = canonical.dumps(ops)
    patched = diff.apply_own(parent.doc, canonical.loads(ops_bytes))
    if canonical.dumps(patched) != state_bytes:
        # The fast walk missed a change of number type (1 -> 1.0 -> True): diff exactly.
        base = canonical.loads(parent.data)
        ops = diff.diff(base, doc, strict=True)
        ops_bytes = canonical.dumps(ops)
        patched = diff.apply_own(canonical.loads(parent.data), canonical.loads(ops_bytes))
        if canonical.dumps(patched) != state_bytes:  # pragma: no cover - a bug if reached
            raise IntegrityViolation("a LangGraph checkpoint's patch does not reproduce it")
    return ops_bytes, len(ops), state_bytes, patched


def commit(
    new: NewCheckpoint, snapshots: checkpoints.SnapshotWriter, db: Any, *, relaxed: bool = False
) -> Stored:
    """Store ``new`` as a patch on its parent, on the connection ``db``. The run's
    checkpoint number is taken in the same statement: if another writer took it meanwhile,
    the chain is made again on the number it left. ``relaxed``: without waiting for the
    flush to disk (the product's relaxed durability level)."""
    ops_bytes, count, state_bytes, doc = exact_patch(new.parent, new.doc)
    state_hash = canonical.patched(new.parent.state_hash, ops_bytes)
    delta_run = new.parent.delta_run + len(ops_bytes)
    snapshot = needs_snapshot(delta_run, len(state_bytes))
    inline = snapshot and len(state_bytes) <= checkpoints.INLINE_SNAPSHOT_BYTES
    row = _row(new, ops_bytes, count, state_bytes, state_hash, delta_run, inline)
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
        checkpoint_id = _insert(row, db, relaxed)
        if checkpoint_id is not None:
            break
        seq = _head_seq(db, new.thread.run_id) + 1
    else:  # pragma: no cover - a hundred writers on one thread at once
        raise IntegrityViolation("could not number the checkpoint", run_id=new.thread.run_id)
    if snapshot and not inline:
        snapshots.submit(checkpoint_id, state_hash, state_bytes)
    return Stored(
        checkpoint_id,
        seq,
        new.lg_id,
        state_hash,
        chain,
        0 if snapshot else delta_run,
        len(state_bytes),
        doc,
        state_bytes,
    )


def _row(
    new: NewCheckpoint,
    ops_bytes: bytes,
    count: int,
    state_bytes: bytes,
    state_hash: str,
    delta_run: int,
    inline: bool,
) -> dict[str, Any]:
    """The commit statement's parameters, but the number and the chain hash."""
    return {
        "run": new.thread.run_id,
        "parent": new.parent.id,
        "step": new.step,
        "state_hash": state_hash,
        "size": len(state_bytes),
        "delta_size": len(ops_bytes),
        "delta_run": delta_run,
        "ops": ops_bytes.decode(),
        "count": count,
        "thread": new.thread.pk,
        "lg_id": new.lg_id,
        "lg_parent": new.parent_lg_id,
        "metadata": canonical.dumps(new.metadata).decode(),
        "data": canonical.dumps(
            {"bytes": len(state_bytes), "delta": len(ops_bytes), "ops": count}
        ).decode(),
        "snapshot": state_bytes.decode() if inline else None,
        "digest": checkpoints.seal(state_hash, state_bytes) if inline else "",
    }


def _head_seq(db: Any, run_id: Any) -> int:
    if db.vendor != "postgresql":
        return Run.objects.filter(pk=run_id).values_list("head_seq", flat=True)[0]
    with db.cursor() as cur:
        cur.execute(f"SELECT head_seq FROM {Run._meta.db_table} WHERE id = %s", [run_id])
        return cur.fetchone()[0]


def _insert(row: dict[str, Any], db: Any, relaxed: bool) -> int | None:
    """Write one checkpoint; None if the run's head moved (another writer numbered one)."""
    if db.vendor == "postgresql" and not db.in_atomic_block:
        with db.cursor() as cur:
            cur.execute(_SQL[(row["snapshot"] is not None, relaxed)], row)
            found = cur.fetchone()
        return int(found[0]) if found else None
    with checkpoints.sqlite_synchronous("relaxed" if relaxed else "strict"):
        return _insert_orm(row)


def _insert_orm(row: dict[str, Any]) -> int | None:
    with transaction.atomic():
        updated = Run.objects.filter(pk=row["run"], head_seq=row["head_seq"]).update(
            head_seq=row["head_seq"] + 1
        )
        if not updated:
            return None
        cp = Checkpoint.objects.create(
            run_id=row["run"],
            seq=row["head_seq"] + 1,
            parent_id=row["parent"],
            reason=CheckpointReason.STEP,
            step=row["step"],
            state_hash=row["state_hash"],
            chain_hash=row["chain_hash"],
            schema_version=SCHEMA_VERSION,
            agent_version=AGENT_VERSION,
            size=row["size"],
            delta_size=row["delta_size"],
            delta_run=row["delta_run"],
            commit_id=row["commit_id"],
        )
        Mutation.objects.create(checkpoint=cp, ops=row["ops"], count=row["count"])
        if row["snapshot"] is not None:
            Snapshot.objects.create(checkpoint=cp, state=row["snapshot"], digest=row["digest"])
        SavedCheckpoint.objects.create(
            checkpoint=cp,
            thread_id=row["thread"],
            lg_id=row["lg_id"],
            lg_parent_id=row["lg_parent"],
            metadata=canonical.loads(row["metadata"]),
        )
        Event.objects.create(
            run_id=row["run"],
            kind=EventKind.CHECKPOINT,
            seq=cp.seq,
            step=row["step"],
            data=row["data"],
        )
        return cp.id


_COMMIT = """
WITH cfg AS (SELECT {lowered} AS v), r AS (
    UPDATE {run} SET head_seq = head_seq + 1, updated_at = now()
     WHERE id = %(run)s::uuid AND head_seq = %(head_seq)s::integer
       AND (SELECT v FROM cfg) IS NOT NULL
 RETURNING id, head_seq
), c AS (
    INSERT INTO {checkpoint}
        (run_id, seq, parent_id, reason, step, next_step, state_hash, chain_hash,
         schema_version, agent_version, size, delta_size, delta_run, commit_id,
         config_hash, packages, replay_counters, created_by, created_at)
    SELECT r.id, r.head_seq, %(parent)s::bigint, 'step', %(step)s::text, '',
           %(state_hash)s::text, %(chain_hash)s::text, {schema}, '{version}',
           %(size)s::integer, %(delta_size)s::integer, %(delta_run)s::bigint,
           %(commit_id)s::uuid, '', '', '', '', now()
      FROM r
 RETURNING id
), m AS (
    INSERT INTO {mutation} (checkpoint_id, ops, count)
    SELECT c.id, %(ops)s::text, %(count)s::integer FROM c
), l AS (
    INSERT INTO {saved} (checkpoint_id, thread_id, lg_id, lg_parent_id, metadata)
    SELECT c.id, %(thread)s::bigint, %(lg_id)s::text, %(lg_parent)s::text,
           %(metadata)s::jsonb FROM c
){snapshot}, e AS (
    INSERT INTO {event} (run_id, kind, seq, step, actor, reason, worker, data, created_at)
    SELECT r.id, 'checkpoint', r.head_seq, %(step)s::text, '', '', '', %(data)s::text, now()
      FROM r
)
SELECT id FROM c
"""
_SNAPSHOT = """, s AS (
    INSERT INTO {snapshot} (checkpoint_id, state, digest)
    SELECT c.id, %(snapshot)s::text, %(digest)s::text FROM c
)"""


def _commit_sql(with_snapshot: bool, relaxed: bool) -> str:
    snap = _SNAPSHOT.format(snapshot=Snapshot._meta.db_table) if with_snapshot else ""
    # relaxed: this statement's transaction does not wait for the WAL flush (the
    # product's relaxed level; see docs/architecture.md).
    lowered = "set_config('synchronous_commit', 'off', true)" if relaxed else "''"
    return _COMMIT.format(
        lowered=lowered,
        run=Run._meta.db_table,
        checkpoint=Checkpoint._meta.db_table,
        mutation=Mutation._meta.db_table,
        saved=SavedCheckpoint._meta.db_table,
        event=Event._meta.db_table,
        snapshot=snap,
        schema=SCHEMA_VERSION,
        version=AGENT_VERSION,
    )


_SQL = {
    (snapshot, relaxed): _commit_sql(snapshot, relaxed)
    for snapshot in (False, True)
    for relaxed in (False, True)
}


_WRITES = """
WITH cfg AS (SELECT set_config('synchronous_commit', 'off', true) AS v)
INSERT INTO {table} (thread_id, checkpoint_id, task_id, idx, channel, task_path, value)
SELECT %(thread)s::bigint, %(checkpoint)s::text, %(task)s::text, u.idx, u.channel,
       %(path)s::text, u.value
  FROM cfg, unnest(%(idx)s::integer[], %(channel)s::text[], %(value)s::text[])
       AS u(idx, channel, value)
 WHERE cfg.v IS NOT NULL
ON CONFLICT (thread_id, checkpoint_id, task_id, idx) DO {conflict}
"""
_WRITES_SQL = {
    replace: _WRITES.format(
        table=PendingWrite._meta.db_table,
        conflict="UPDATE SET channel = EXCLUDED.channel, value = EXCLUDED.value,"
        " task_path = EXCLUDED.task_path"
        if replace
        else "NOTHING",
    )
    for replace in (False, True)
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
    rows = list(rows)
    if db.vendor == "postgresql" and not db.in_atomic_block:
        # Its own implicit transaction, not flushed before answering (see the module's
        # docstring); inside a caller's transaction the caller's setting stays.
        with db.cursor() as cur:
            cur.execute(
                _WRITES_SQL[replace],
                {
                    "thread": thread,
                    "checkpoint": checkpoint_id,
                    "task": task_id,
                    "path": task_path,
                    "idx": [r[0] for r in rows],
                    "channel": [r[1] for r in rows],
                    "value": [r[2].decode() for r in rows],
                },
            )
        return
    objs = [
        PendingWrite(
            thread_id=thread,
            checkpoint_id=checkpoint_id,
            task_id=task_id,
            idx=idx,
            channel=channel,
            task_path=task_path,
            value=value.decode(),
        )
        for idx, channel, value in rows
    ]
    unique = ["thread", "checkpoint_id", "task_id", "idx"]
    with transaction.atomic():
        if replace:
            PendingWrite.objects.bulk_create(
                objs,
                update_conflicts=True,
                unique_fields=unique,
                update_fields=["channel", "value", "task_path"],
            )
        else:
            PendingWrite.objects.bulk_create(objs, ignore_conflicts=True)
