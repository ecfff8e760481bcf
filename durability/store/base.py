"""The store's interface, and what both dialects share: the ORM's writes of a checkpoint, the
rebuild's one query, the journal's insert-if-absent through the model's manager.

A method a dialect has no counterpart for says so in its docstring and returns the neutral
answer (no lock held, nothing to wait for), so callers never ask which database they run on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef, Q, Subquery, Value
from django.db.models.functions import Coalesce, Now, NullIf
from django.utils import timezone

from durability import events, lifecycle
from durability.models import (
    Checkpoint,
    CheckpointReason,
    Event,
    EventKind,
    JournalEntry,
    Mutation,
    Run,
    Snapshot,
)

if TYPE_CHECKING:
    from durability.checkpoints import StepCommit
    from durability.runtime.inflight import Bound


class RunLock:
    """A run's liveness lock, held by this process: freed by the database or the operating
    system the moment the process dies."""

    held: bool = False
    pid: int | None = None  # the database session holding it, if a session holds it

    def on_connection(self) -> bool:
        """Held by a database session (which a dropped connection frees), not by a file."""
        raise NotImplementedError

    def session_socket(self) -> int | None:
        """The socket of the session holding the lock: readable when the server ends it."""
        return None

    def acquire(self) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError


# The rebuild's one query: the checkpoint's ancestors back to the nearest snapshot, oldest
# first, each with its patch (or the snapshot's state and digest) and its state hash.
# The recursive step of the walk from a checkpoint up to its nearest snapshot, and the
# columns each row of it yields: shared with ``pg_sql.HEAD_CHAIN``, which starts the same walk
# from a run's head.
CHAIN_STEP = """
    SELECT p.id, p.parent_id, chain.depth + 1,
           (SELECT 1 FROM durability_snapshot s WHERE s.checkpoint_id = p.id), p.state_hash
      FROM durability_checkpoint p JOIN chain ON p.id = chain.parent_id
     WHERE chain.snap IS NULL
"""
CHAIN_COLUMNS = """
SELECT chain.id, chain.snap,
       CASE WHEN chain.snap IS NULL
            THEN (SELECT m.ops FROM durability_mutation m WHERE m.checkpoint_id = chain.id)
            ELSE (SELECT s.state FROM durability_snapshot s WHERE s.checkpoint_id = chain.id)
       END,
       CASE WHEN chain.snap IS NULL THEN NULL
            ELSE (SELECT s.digest FROM durability_snapshot s WHERE s.checkpoint_id = chain.id)
       END,
       chain.state_hash"""
CHAIN_SQL = f"""
WITH RECURSIVE chain(id, parent_id, depth, snap, state_hash) AS (
    SELECT c.id, c.parent_id, 0,
           (SELECT 1 FROM durability_snapshot s WHERE s.checkpoint_id = c.id), c.state_hash
      FROM durability_checkpoint c WHERE c.id = %s
    UNION ALL{CHAIN_STEP})
{CHAIN_COLUMNS}
  FROM chain ORDER BY chain.depth DESC
"""


# ``Store.head``'s columns: what verifying a checkpoint's state needs of it, the last its
# parent's chain hash (the one its own chain hash is linked to).
HEAD_COLUMNS = (
    "id",
    "run_id",
    "seq",
    "step",
    "next_step",
    "schema_version",
    "agent_version",
    "state_hash",
    "chain_hash",
    "parent_chain",
)


def write_checkpoint(
    *, ops: str, count: int, snapshot: str | None = None, digest: str = "", **fields: Any
) -> Checkpoint:
    """The one ORM writer of a checkpoint: its row, its mutation row, and its snapshot row if
    it is stored whole. The caller holds the transaction and has fenced the run."""
    cp = Checkpoint.objects.create(**fields)
    Mutation.objects.create(checkpoint=cp, run_id=cp.run_id, seq=cp.seq, ops=ops, count=count)
    if snapshot is not None:
        write_snapshot(cp.id, cp.run_id, cp.seq, state=snapshot, digest=digest)
    return cp


def write_snapshot(checkpoint_id: int, run_id: Any, seq: int, *, state: str, digest: str) -> None:
    """The one ORM writer of a snapshot row, with its checkpoint's run and number (what a
    run's nearest snapshot is found by)."""
    Snapshot.objects.create(
        checkpoint_id=checkpoint_id, run_id=run_id, seq=seq, state=state, digest=digest
    )


class Store:
    """Every statement that differs by database, for one Django connection."""

    # Whether snapshots are written by a thread of their own (a second writer at a time).
    snapshots_on_thread = False
    # Whether a session holds advisory locks that die with it (a worker's presence).
    session_locks = False
    # Whether the runs' input has a trigram index for text search (``text_page``).
    indexed_text_search = False
    # Whether a step's commit can be sent on a channel of its own and its answer taken
    # later (``durability.runtime.sendahead``): the next step computes meanwhile.
    sends_ahead = False

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    # --- the step commit -----------------------------------------------------------------

    def commit_step(self, c: StepCommit, data: str, inside: Callable[[], None]) -> int | None:
        """Commit one step's checkpoint, fenced on the lease token and the head; the new
        checkpoint's id, or None if a guard failed. ``inside`` runs inside the commit's
        transaction (a named fault point), when it has one."""
        raise NotImplementedError

    def bind_step(self, c: StepCommit, data: str) -> Bound:
        """The commit of one step converted for sending ahead (PostgreSQL only)."""
        raise NotImplementedError("only PostgreSQL sends a commit ahead of its answer")

    @contextlib.contextmanager
    def synchronous(self, level: str) -> Iterator[None]:
        """Within the block, the session's flush setting for a commit at durability
        ``level`` (where the commit statement sets its own, nothing to do)."""
        yield

    def fetch_one_prepared(self, sql: str, values: dict[str, Any]) -> tuple | None:
        """Run one hot statement prepared once per session; its first row (PostgreSQL)."""
        raise NotImplementedError("prepared hot statements are PostgreSQL's")

    def synchronous_standby(self) -> tuple[bool, str]:
        """Whether this database has a synchronous standby to wait for, and if not, why."""
        return False, "the database is not PostgreSQL"

    def orm_commit(self, c: StepCommit, data: str) -> int | None:
        """The step commit as ORM statements, inside the caller's transaction."""
        if not self._advance(c):
            return None
        cp = write_checkpoint(
            run_id=c.run_id,
            seq=c.head.seq + 1,
            parent_id=c.head.id,
            reason=CheckpointReason.STEP,
            step=c.step,
            next_step=c.next_step,
            state_hash=c.state_hash,
            chain_hash=c.chain_hash,
            schema_version=c.schema_version,
            agent_version=c.agent_version,
            config_hash=c.config_hash,
            packages=c.packages,
            replay_base_id=c.replay_base_id,
            replay_counters=c.replay_counters,
            size=c.size,
            delta_size=len(c.ops_bytes),
            delta_run=c.delta_run,
            commit_id=c.commit_id,
            ops=c.ops_bytes.decode(),
            count=c.ops_count,
            snapshot=None if c.snapshot is None else c.snapshot.decode(),
            digest=c.snapshot_digest,
        )
        self._commit_events(c, cp.seq, data)
        return cp.id

    def _advance(self, c: StepCommit) -> bool:
        """The fenced UPDATE of the run: the lease token, the head's number and its id."""
        now = timezone.now()
        fields: dict[str, Any] = {
            "head_seq": c.head.seq + 1,
            "step": c.next_step,
            "attempts": 0 if c.finished else 1,
            "retries": 0,
            "heartbeat_at": Now(),
            "updated_at": now,
        }
        if c.finished:
            fields.update(
                status=lifecycle.after_step(True),
                lease_owner="",
                lease_expires_at=None,
                finished_at=now,
                outcome=c.outcome,
            )
        else:
            fields.update(
                status=lifecycle.after_step(False),
                lease_expires_at=now + timedelta(seconds=c.lease_seconds),
            )
        is_head = Checkpoint.objects.filter(run_id=c.run_id, seq=c.head.seq, pk=c.head.committed_id)
        fenced = Run.objects.filter(pk=c.run_id, lease_token=c.token, head_seq=c.head.seq)
        return bool(fenced.filter(Exists(is_head)).update(**fields))

    def _commit_events(self, c: StepCommit, seq: int, data: str) -> None:
        at = {"seq": seq, "step": c.step, "worker": c.worker}
        made = [events.checkpoint(c.run_id, data=data, commit_us=c.prev_commit_us, **at)]
        if c.finished:
            made.append(events.succeeded(c.run_id, data=c.ending, **at))
        Event.objects.bulk_create(made, run_checked=True)  # the fenced UPDATE locked it

    # --- reading checkpoints and the journal ----------------------------------------------

    def chain(self, checkpoint_id: int) -> list[tuple]:
        """``CHAIN_SQL``'s rows for one checkpoint."""
        with self.conn.cursor() as cur:
            cur.execute(CHAIN_SQL, [checkpoint_id])
            return cur.fetchall()

    def head(self, run_id: Any, seq: int | None = None) -> tuple | None:
        """A run's head checkpoint (or its checkpoint ``seq``) as ``HEAD_COLUMNS``; None if
        there is no such run or checkpoint."""
        head_seq = Run.objects.filter(pk=run_id).values("head_seq")[:1]
        parent_chain = Checkpoint.objects.filter(pk=OuterRef("parent_id")).values("chain_hash")[:1]
        return (
            Checkpoint.objects.using(self.conn.alias)
            .filter(run_id=run_id, seq=Subquery(head_seq) if seq is None else seq)
            .annotate(
                parent_chain_=Coalesce(
                    NullIf("parent_chain", Value("")), Subquery(parent_chain), Value("")
                )
            )
            .values_list(*HEAD_COLUMNS[:-1], "parent_chain_")
            .first()
        )

    def head_chain(self, run_id: Any, seq: int | None = None) -> tuple[tuple | None, list[tuple]]:
        """``head`` and rows shaped as ``chain``'s that rebuild it, or may: a store may read
        them by number, and the caller keeps them only if they hash to the head's state hash
        (else it reads ``chain``). (None, []) if there is no such run or checkpoint. Here,
        the walk up the parents itself."""
        head = self.head(run_id, seq)
        return (head, self.chain(head[0])) if head is not None else (None, [])

    def insert_journal_if_absent(self, entry: JournalEntry) -> JournalEntry:
        """Store ``entry`` unless its operation identity is recorded already; the stored one."""
        try:
            with transaction.atomic(using=self.conn.alias):
                entry.save(force_insert=True, using=self.conn.alias)
            return entry
        except IntegrityError:
            pass
        return JournalEntry.objects.using(self.conn.alias).get(
            base_id=entry.base_id, key=entry.key, occurrence=entry.occurrence
        )

    # --- liveness locks and leases ---------------------------------------------------------

    def run_lock(self, run_id: Any) -> RunLock:
        raise NotImplementedError

    def lock_holders(self, run_ids: list[Any]) -> dict[str, set[int]]:
        """Of ``run_ids``, those whose liveness lock some process holds now, with the
        database sessions holding it (none known where a file holds it)."""
        raise NotImplementedError

    def end_stalled_holders(self, runs: list[tuple[Any, int]], settle: float) -> int:
        """End the sessions holding the lock of these (run, token) pairs whose holder is
        proven stalled (see ``leases.end_stalled_holders``). None where locks are files."""
        return 0

    def lock_loss_unexplained(self, settle: float, lease: float) -> Q | None:
        """A filter over runs: a missing lock is not explained by a lost session. None where
        no session holds a lock (a missing file lock always means death)."""
        return None

    def lock_gone(self, run_id: Any, settle: float, lease: float) -> Q:
        """A filter: nobody holds the run's lock now, and a lost session cannot explain it
        (always true where the caller looked at a file lock just before)."""
        return Q()

    def lock_held_by(self, run_id: Any, holder: int | None) -> Q:
        """A filter: the run's lock is held by session ``holder`` (true where unknown)."""
        return Q()

    def renew_lease(self, run_id: Any, token: int, seconds: float) -> bool:
        """A heartbeat: extend the lease if it is still ours."""
        expires = Now() + timedelta(seconds=seconds)
        return bool(
            Run.objects.using(self.conn.alias)
            .filter(pk=run_id, lease_token=token)
            .update(lease_expires_at=expires, heartbeat_at=Now())
        )

    def lock_agent_slots(self, agent: str) -> None:
        """Inside a claim's transaction: concurrent claims of ``agent`` count one after the
        other (where writers already go one at a time, nothing to do)."""

    def hold_worker_lock(self, namespace: int, key: int) -> None:
        """Take, on this session, the lock that tells a worker is alive (once per session)."""

    def held_worker_keys(self, namespace: int) -> set[int]:
        """The keys of the workers' locks held now."""
        return set()

    # --- transactions, time, and the rest --------------------------------------------------

    def ping(self) -> None:
        """One round trip on the session: raises the database's error if it has ended."""
        with self.conn.cursor() as cur:
            cur.execute("SELECT 1")

    def now(self) -> datetime:
        """The database's clock (this process's where the database is in-process)."""
        return timezone.now()

    def lock_timeout(self, seconds: float) -> None:
        """Inside a transaction: wait at most ``seconds`` for a row lock."""

    def repeatable_read(self) -> None:
        """First in a transaction: every query of it reads one snapshot of the database."""

    def unflushed_commit(self) -> None:
        """Inside a transaction: its commit need not wait for the disk (a count that a crash
        may lose, such as a rate limit's). Where commits cost no flush wait, nothing."""

    def cancel_cut_short(self) -> None:
        """After a signal interrupted a query while it waited for its answer: cancel that
        query on the server and close the session, so the next use opens a new one. Where
        the database is in-process there is no such query."""

    def existing_runs(self, ids: Iterable[Any]) -> set[Any]:
        """Of ``ids``, the runs that exist, locked as a foreign key would lock them."""
        runs = Run.objects.using(self.conn.alias).filter(pk__in=ids)
        return set(runs.values_list("pk", flat=True))

    def blob_references(self, model: Any, column: str, pattern: Any) -> set[str]:
        """The blob digests that ``column`` of ``model``'s rows refer to (``pattern``: a
        compiled regular expression whose first group is a digest)."""
        found: set[str] = set()
        rows = model.objects.filter(**{f"{column}__contains": '"$blob"'}).values_list(
            column, flat=True
        )
        for text in rows.iterator(chunk_size=100):
            found.update(pattern.findall(text))
        return found

    def commit_figures(self, since: datetime, quantiles: tuple[float, ...]) -> tuple[int, dict]:
        """Checkpoint commits since ``since`` and their latency quantiles, in seconds."""
        from durability.slo import percentile

        kinds = (EventKind.CHECKPOINT, EventKind.COMMIT_LATENCY)
        rows = Event.objects.filter(created_at__gte=since, kind__in=kinds).values_list(
            "kind", "commit_us"
        )
        commits, latencies = 0, []
        for kind, us in rows:
            commits += kind == EventKind.CHECKPOINT
            if us is not None:
                latencies.append(us / 1e6)
        if not latencies:
            return commits, {}
        return commits, {q: percentile(latencies, q) for q in quantiles}

    def commit_latency(
        self, rows: Any, threshold_ms: float, span: Any
    ) -> tuple[int, int, dict[str, float | None], list[float | None]]:
        """Over events ``rows`` with a commit latency: how many, how many above the
        threshold, p50/p95/p99 in ms, and the p99 of each of ``span``'s buckets."""
        from durability.slo import percentile

        pairs = [(at, us / 1000) for at, us in rows.values_list("created_at", "commit_us")]
        values = [v for _, v in pairs]
        extra = {
            name: percentile(values, fraction)
            for name, fraction in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
        }
        groups: list[list[float]] = [[] for _ in range(span.buckets)]
        for when, value in pairs:
            i = span.index(when)
            if i is not None:
                groups[i].append(value)
        series = [percentile(g, 0.99) for g in groups]
        return len(values), sum(1 for v in values if v > threshold_ms), extra, series

    def text_page(
        self, matching: Any, status: str, after: tuple | None, size: int
    ) -> tuple[dict[str, int], list[Any]]:
        """Runs whose input holds a text, in one pass (where ``indexed_text_search``)."""
        raise NotImplementedError("text search in one pass needs PostgreSQL's trigram index")

    def private_files(self) -> list[str]:
        """The files of the database kept on this machine (for their permissions)."""
        return []
