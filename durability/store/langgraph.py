"""What the LangGraph saver (``durability.langgraph``) needs from a database, for one Django
connection: insert a checkpoint, store a task's pending writes, read a run's head number,
and read one checkpoint with everything its state is rebuilt from.

On PostgreSQL each is one statement (``lg_sql``), run on a connection the saver owns from
whichever thread LangGraph calls it on (``one_statement``); on SQLite the ORM writes them in
one transaction on the saver's own thread, and the saver reads through the ORM.
``for_connection`` chooses, as the store's own ``for_connection`` does.
"""

from __future__ import annotations

from typing import Any, cast

import orjson
from django.db import transaction

from durability import canonical, lifecycle
from durability.conf import conf
from durability.langgraph.models import PendingWrite, SavedCheckpoint, Thread
from durability.models import (
    Checkpoint,
    CheckpointReason,
    Event,
    EventKind,
    Mutation,
    Run,
    Snapshot,
)
from durability.store import for_connection as store_for
from durability.store import lg_sql
from durability.store.base import write_checkpoint
from durability.store.lg_sql import AGENT_VERSION, SCHEMA_VERSION
from durability.store.postgres import PostgresStore

# A change of a run's status and its event (``lifecycle.graph_change``, ``events``).
Report = tuple[lifecycle.GraphChange, Event]


class LangGraphStore:
    """The saver's statements through the ORM, on the thread's default connection (the
    saver's own thread): SQLite's, and PostgreSQL's inside a caller's transaction."""

    # Whether ``put``, ``put_writes`` and ``get_tuple`` are one statement each, run on the
    # saver's own connections from the caller's thread (with ``read`` and ``start``).
    one_statement = False

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def own_session(self) -> None:
        """Set up a connection the saver owns for its statements, once it is connected."""

    def insert_checkpoint(
        self, row: dict[str, Any], relaxed: bool, report: Report | None = None
    ) -> int | None:
        """Write one checkpoint numbered ``row["head_seq"] + 1`` (its patch, its LangGraph
        ids, its event, its inline snapshot if any); its id, or None if the run's head
        moved (another writer numbered one), or if another transaction changed the run as
        the statement read it (sent again, it reads the run anew). ``relaxed``: without
        waiting for the flush. ``report``: a change of the run's status and its event,
        written with the checkpoint in its transaction (as ``report``), numbered as it is."""
        level = "relaxed" if relaxed else "strict"
        with store_for(self.conn).synchronous(level), transaction.atomic():
            cp_id = _insert_orm(row)
            if cp_id is not None and report is not None:
                change, event = report
                event.seq = row["head_seq"] + 1
                self.report(row["run"], change, event)
            return cp_id

    def make_thread(self, run: Run, start: dict[str, Any], created: Event, thread: Thread) -> int:
        """Insert a new thread's run, its first checkpoint (``start``: ``write_checkpoint``'s
        fields but the run and parent), its event and its thread row, all or none; the
        checkpoint's id. ``IntegrityError`` if another process made the thread first."""
        with transaction.atomic(using=self.conn.alias):
            run.save(force_insert=True)
            cp = write_checkpoint(run=run, parent=None, **start)
            Event.objects.bulk_create([created], run_checked=True)  # its run is made above
            thread.save(force_insert=True)
        return cp.id

    def report(self, run_id: Any, change: lifecycle.GraphChange, event: Event) -> bool:
        """A graph's report on its run (``lifecycle.graph_change``) and, if it changed the
        run, its event; False if it changed nothing."""
        with transaction.atomic(using=self.conn.alias):
            if not lifecycle.apply_graph(run_id, change):
                return False
            Event.objects.bulk_create([event], run_checked=True)  # the UPDATE locked its run
            return True

    def head_seq(self, run_id: Any) -> int | None:
        """The run's last checkpoint number; None if the run is gone (deleted)."""
        return Run.objects.filter(pk=run_id).values_list("head_seq", flat=True).first()

    def put_writes(
        self,
        thread: int,
        checkpoint_id: str,
        task_id: str,
        task_path: str,
        rows: list[tuple[int, str, bytes]],
        *,
        replace: bool,
    ) -> None:
        """Store a task's writes (index, channel, the value's canonical bytes); a write
        already stored is kept, unless ``replace``."""
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

    def read(self, thread_id: str, ns: str, lg_id: str, have: int) -> list[tuple]:
        """The namespace's checkpoint ``lg_id`` (the latest when empty): one row per
        checkpoint its state is rebuilt from, oldest first (id, state hash, snapshot or
        patch text, snapshot digest), the last one carrying the thread, the run and the
        checkpoint (``lg_sql.READ``). ``have``: the id of a checkpoint whose state the
        caller holds, where the rebuild may start (0: none). Only where ``one_statement``."""
        raise NotImplementedError("the saver reads one statement only on PostgreSQL")

    def ancestors(self, thread: int, lg_id: str, depth: int) -> list[tuple[int, str]]:
        """Checkpoint ``lg_id`` of the thread row ``thread`` and its LangGraph ancestors up
        to ``depth`` generations back, nearest first, through each one's parent id: (the
        checkpoint's id, its LangGraph id). Empty if there is no such checkpoint."""
        with self.conn.cursor() as cur:
            cur.execute(lg_sql.ANCESTORS, [thread, lg_id, thread, depth])
            return [(int(cp_id), lg) for cp_id, lg in cur.fetchall()]

    def start(self, run_id: Any) -> tuple[int, str, str, int] | None:
        """The id, state hash, chain hash and size of the run's empty first checkpoint;
        None if the run is gone (deleted). Only where ``one_statement``."""
        raise NotImplementedError("the saver reads one statement only on PostgreSQL")


class PostgresLangGraph(LangGraphStore):
    one_statement = True

    def _prepared(self) -> PostgresStore:
        """The store's statements prepared once per session (``PREPARED_STATEMENTS``)."""
        return cast(PostgresStore, store_for(self.conn))

    def own_session(self) -> None:
        # The saver's statements are prepared (the store's ``fetch_*_prepared``); planned
        # once, at their first call, rather than at each of a session's first five calls
        # as PostgreSQL does by default: a saver made for one ``get_tuple`` would plan its
        # recursive read every time. Every statement names its rows by key, so the plan
        # made without the values is the one the values would get. Without prepared
        # statements (a pooler in transaction mode) the session is left as it is.
        if not conf.PREPARED_STATEMENTS:
            return
        with self.conn.cursor() as cur:
            cur.execute("SET plan_cache_mode = force_generic_plan")

    def insert_checkpoint(
        self, row: dict[str, Any], relaxed: bool, report: Report | None = None
    ) -> int | None:
        if self.conn.in_atomic_block:
            return super().insert_checkpoint(row, relaxed, report)
        sql = lg_sql.COMMIT[(row["snapshot"] is not None, relaxed)]
        params = row
        if report is not None:
            # In the checkpoint's own statement: a turn's start and end cost no statement
            # of their own.
            sql, values = lg_sql.commit_reporting(
                self.conn, row["snapshot"] is not None, relaxed, *report
            )
            params = {**row, **values}
        found = self._prepared().fetch_one_prepared(sql, params)
        return int(found[0]) if found else None

    def make_thread(self, run: Run, start: dict[str, Any], created: Event, thread: Thread) -> int:
        if self.conn.in_atomic_block:
            return super().make_thread(run, start, created, thread)
        # One statement rather than the ORM's transaction of six INSERTs: a new thread's
        # first checkpoint waits for it, and a graph of a few supersteps paid more for it
        # than for its checkpoints.
        fields = dict(start)
        seq = fields["seq"]
        mutation = Mutation(
            run_id=run.id, seq=seq, ops=fields.pop("ops"), count=fields.pop("count")
        )
        snapshot = Snapshot(
            run_id=run.id, seq=seq, state=fields.pop("snapshot"), digest=fields.pop("digest")
        )
        cp = Checkpoint(run=run, parent=None, **fields)
        sql, params = lg_sql.new_thread(self.conn, run, cp, mutation, snapshot, created, thread)
        # Bound and prepared by the server like the saver's other statements: bound into its
        # text by the client, this statement of six INSERTs cost about 1 ms of CPU a thread.
        cp_id, thread.pk = cast(tuple, self._prepared().fetch_one_prepared(sql, params))
        for saved in (run, thread):  # as ``save()`` leaves them: stored, in this database
            saved._state.adding = False
            saved._state.db = self.conn.alias
        return cp_id

    def report(self, run_id: Any, change: lifecycle.GraphChange, event: Event) -> bool:
        if self.conn.in_atomic_block:
            return super().report(run_id, change, event)
        # One statement: the report at a graph's end is on the path of its last ``put``.
        sql, params = lg_sql.report(self.conn, run_id, change, event)
        return bool(cast(tuple, self._prepared().fetch_one_prepared(sql, params))[0])

    def head_seq(self, run_id: Any) -> int | None:
        with self.conn.cursor() as cur:
            cur.execute(lg_sql.HEAD_SEQ, [run_id])
            row = cur.fetchone()
            return row[0] if row else None

    def put_writes(
        self,
        thread: int,
        checkpoint_id: str,
        task_id: str,
        task_path: str,
        rows: list[tuple[int, str, bytes]],
        *,
        replace: bool,
    ) -> None:
        if self.conn.in_atomic_block:
            # Inside a caller's transaction the caller's flush setting stays.
            super().put_writes(thread, checkpoint_id, task_id, task_path, rows, replace=replace)
            return
        # Its own implicit transaction, not flushed before answering: the checkpoint after
        # the writes is, and flushing it flushes them.
        self._prepared().fetch_all_prepared(
            lg_sql.WRITES[replace],
            {
                "thread": thread,
                "checkpoint": checkpoint_id,
                "task": task_id,
                "path": task_path,
                # Each value's canonical bytes go in as they are (``orjson.Fragment``), so
                # they are escaped once, as the redaction gate expects of a text.
                "rows": orjson.dumps([[i, c, orjson.Fragment(v)] for i, c, v in rows]).decode(),
            },
        )

    def read(self, thread_id: str, ns: str, lg_id: str, have: int) -> list[tuple]:
        params = {"thread": thread_id, "ns": ns, "lg": lg_id, "have": have}
        return self._prepared().fetch_all_prepared(lg_sql.READ[bool(lg_id)], params)

    def start(self, run_id: Any) -> tuple[int, str, str, int] | None:
        with self.conn.cursor() as cur:
            cur.execute(lg_sql.START, {"run": run_id})
            return cur.fetchone()


_by_dialect: dict[str, type[LangGraphStore]] = {
    "postgresql": PostgresLangGraph,
    "sqlite": LangGraphStore,
}


def for_connection(conn: Any) -> LangGraphStore:
    """The saver's statements on one Django connection."""
    try:
        return _by_dialect[conn.vendor](conn)
    except KeyError:
        raise NotImplementedError(
            f"the engine runs on PostgreSQL or SQLite, not on {conn.vendor!r}"
        ) from None


def _insert_orm(row: dict[str, Any]) -> int | None:
    updated = Run.objects.filter(pk=row["run"], head_seq=row["head_seq"]).update(
        head_seq=row["head_seq"] + 1
    )
    if not updated:
        return None
    cp = write_checkpoint(
        ops=row["ops"],
        count=row["count"],
        snapshot=row["snapshot"],
        digest=row["digest"],
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


__all__ = ["AGENT_VERSION", "SCHEMA_VERSION", "LangGraphStore", "for_connection"]
