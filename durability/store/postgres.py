"""The store on PostgreSQL: the hot statements prepared once per session, session advisory
locks for liveness, aggregates computed by the server."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import OperationalError, transaction
from django.db.models import Aggregate, BooleanField, Count, FloatField, Q
from django.db.models.expressions import RawSQL

from durability import events, lifecycle, redact
from durability.conf import conf
from durability.models import EventKind, JournalEntry
from durability.runtime import inflight
from durability.runtime.faults import faults_armed
from durability.store import pg_sql
from durability.store.base import CHAIN_SQL, RunLock, Store
from durability.store.reconnect import drop

if TYPE_CHECKING:
    from durability.checkpoints import StepCommit

log = logging.getLogger(__name__)


class PercentileCont(Aggregate):
    """PostgreSQL's ordered-set aggregate; ``filter=`` becomes ``FILTER (WHERE ...)``."""

    function = "percentile_cont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)%(filter)s"
    output_field = FloatField()
    allow_filter = True

    def __init__(self, expression: Any, fraction: float, **extra: Any) -> None:
        super().__init__(expression, fraction=float(fraction), **extra)


def advisory_key(run_id: Any) -> int:
    """A run's advisory-lock key: the first 8 bytes of its UUID as a signed bigint."""
    import uuid

    raw = run_id.bytes if hasattr(run_id, "bytes") else uuid.UUID(str(run_id)).bytes
    return int.from_bytes(raw[:8], "big", signed=True)


def key_parts(run_id: Any) -> tuple[int, int]:
    """A run's advisory key as pg_locks shows it: (classid, objid), each 32 unsigned bits."""
    key = advisory_key(run_id) & 0xFFFFFFFFFFFFFFFF
    return key >> 32, key & 0xFFFFFFFF


def _held_by(run_id: Any, pid: int | None = None) -> str:
    """SQL: the run's liveness lock is held (by session ``pid`` if given)."""
    hi, lo = key_parts(run_id)
    by = f" AND pid = {int(pid)}" if pid is not None else ""
    return (
        f"EXISTS (SELECT 1 FROM ({pg_sql.HELD_ADVISORY_LOCKS}) held"
        f" WHERE objsubid = 1 AND classid = {hi} AND objid = {lo}{by})"
    )


class SessionLock(RunLock):
    """A session advisory lock on the connection of the thread that takes it."""

    def __init__(self, conn: Any, run_id: Any) -> None:
        self.conn, self.run_id = conn, run_id

    def on_connection(self) -> bool:
        return True

    def session_socket(self) -> int | None:
        if not self.held or self.conn.connection is None:
            return None
        try:
            return self.conn.connection.fileno()
        except Exception:  # closed under us
            return None

    def acquire(self) -> bool:
        with self.conn.cursor() as cur:
            cur.execute(
                "SELECT pg_try_advisory_lock(%s), pg_backend_pid()", [advisory_key(self.run_id)]
            )
            got, pid = cur.fetchone()
        self.held = bool(got)
        self.pid = int(pid) if self.held else None
        return self.held

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            with self.conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_unlock(%s)", [advisory_key(self.run_id)])
        except Exception:
            drop(self.conn)  # closing the session frees the lock as well


def params(c: StepCommit, data: str, raw: bool = False) -> dict[str, Any]:
    """The commit statement's parameters; ``raw`` keeps the patch and the snapshot as the
    bytes they are (a commit sent ahead sends bytes as they are)."""
    values = {
        "sync": pg_sql.SYNCHRONOUS_COMMIT.get(c.durability),
        "run": c.run_id,
        "token": c.token,
        "head_seq": c.head.seq,
        "next_step": c.next_step,
        "status": lifecycle.after_step(c.finished),
        "lease": c.lease_seconds,
        "parent": c.head.id,
        "step": c.step,
        "state_hash": c.state_hash,
        "chain_hash": c.chain_hash,
        "schema_version": c.schema_version,
        "agent_version": c.agent_version,
        "config_hash": c.config_hash,
        "packages": c.packages,
        "replay_base": c.replay_base_id,
        "replay_counters": c.replay_counters,
        "size": c.size,
        "delta_size": len(c.ops_bytes),
        "delta_run": c.delta_run,
        "commit_id": c.commit_id,
        "ops": c.ops_bytes if raw else c.ops_bytes.decode(),
        "count": c.ops_count,
        "worker": c.worker,
        "data": data,
        "prev_us": c.prev_commit_us,
        "snapshot": c.snapshot if raw or c.snapshot is None else c.snapshot.decode(),
        "digest": c.snapshot_digest,
    }
    if c.finished:
        values["outcome"] = c.outcome
        values["end"] = c.ending
    return values


def statement(c: StepCommit) -> str:
    return pg_sql.COMMITS[
        (c.finished, c.snapshot is not None, c.durability in pg_sql.SYNCHRONOUS_COMMIT)
    ]


class PostgresStore(Store):
    snapshots_on_thread = True
    session_locks = True
    indexed_text_search = True
    sends_ahead = True

    # --- the step commit -----------------------------------------------------------------

    def fetch_one_prepared(self, sql: str, values: dict[str, Any]) -> tuple | None:
        """Run one of the engine's hot statements and return its first row. A
        server-side-binding cursor prepares the statement once per session instead of
        parsing and planning it on every step."""
        return self._prepared(sql, values, all_rows=False)

    def fetch_all_prepared(self, sql: str, values: Any) -> list[tuple]:
        """``fetch_one_prepared``, every row."""
        return self._prepared(sql, values, all_rows=True)

    def _prepared(self, sql: str, values: Any, *, all_rows: bool) -> Any:
        raw, prepare = self._raw()
        # A cursor of psycopg's own passes no execute wrapper: the redaction gate, here.
        values = redact.scrub(values)
        with self.conn.wrap_database_errors, psycopg.Cursor(raw) as cur:
            cur.execute(sql, values, prepare=prepare)
            return cur.fetchall() if all_rows else cur.fetchone()

    def _raw(self) -> tuple[Any, bool | None]:
        """The connection's psycopg connection, and the ``prepare`` argument the engine's
        hot statements are executed with."""
        self.conn.ensure_connection()
        raw = self.conn.connection
        prepare = conf.PREPARED_STATEMENTS
        if prepare and raw.prepare_threshold is None:
            # Django opens connections with preparation off, and psycopg then ignores
            # prepare=True. A threshold no query reaches turns it back on for explicit
            # requests only: Django's own queries stay unprepared.
            raw.prepare_threshold = 2**31 - 1
        return raw, prepare or None

    # --- reading checkpoints ---------------------------------------------------------------

    def chain(self, checkpoint_id: int) -> list[tuple]:
        """``CHAIN_SQL``'s rows, prepared: its recursive plan is made once per session."""
        return self.fetch_all_prepared(CHAIN_SQL, [checkpoint_id])

    def head_chain(self, run_id: Any, seq: int | None = None) -> tuple[tuple | None, list[tuple]]:
        """In one prepared statement (``pg_sql.HEAD_PATH``): the patches numbered after the
        nearest snapshot, which are the path unless a branch lies between
        (``checkpoints.run_state`` then walks). An empty chain when there is no snapshot by
        number."""
        rows = self.fetch_all_prepared(pg_sql.HEAD_PATH, {"run": run_id, "seq": seq})
        head = next((row for row in rows if row[1] is not None), None)
        if head is None:
            return None, []
        if head[10] is None:
            return head[:10], []
        patches = sorted((row for row in rows if row[1] is None), key=lambda row: row[2])
        base = (head[10], 1, head[11], head[12], head[13])
        return head[:10], [base, *((row[0], None, row[3], None, None) for row in patches)]

    def commit_step(self, c: StepCommit, data: str, inside: Callable[[], None]) -> int | None:
        if c.durability == "replicated":
            return self._commit_replicated(c, data, inside)
        return self._commit(c, data, inside)

    def _commit(self, c: StepCommit, data: str, inside: Callable[[], None]) -> int | None:
        if faults_armed() or self.conn.in_atomic_block:
            # A named fault point inside the transaction needs an explicit one.
            with transaction.atomic(using=self.conn.alias):
                row = self.fetch_one_prepared(statement(c), params(c, data))
                if row is not None:
                    inside()
        else:
            # One statement in autocommit mode is its own transaction: one round trip, one
            # flush.
            row = self.fetch_one_prepared(statement(c), params(c, data))
        return None if row is None else int(row[0])

    def _commit_replicated(
        self, c: StepCommit, data: str, inside: Callable[[], None]
    ) -> int | None:
        """A lost standby would block every commit: past the timeout, the wait is cancelled
        (the commit stays, durable on the primary but not confirmed by the standby) and an
        alarm is raised, instead of the run hanging."""
        from durability.checkpoints import committed_id

        self.conn.ensure_connection()
        raw = self.conn.connection
        gave_up = threading.Event()

        def give_up() -> None:
            gave_up.set()
            raw.cancel()

        timeout = conf.REPLICATION_TIMEOUT_SECONDS
        timer = threading.Timer(timeout, give_up)
        timer.daemon = True
        timer.start()
        try:
            checkpoint_id = self._commit(c, data, inside)
        except OperationalError:
            # Cancelled before its commit record: nothing was written, the caller retries.
            found = committed_id(c.run_id, c.commit_id) if gave_up.is_set() else None
            if found is None:
                raise
            checkpoint_id = found
        finally:
            timer.cancel()
        if gave_up.is_set():
            self._unconfirmed(c)
        return checkpoint_id

    def _unconfirmed(self, c: StepCommit) -> None:
        # Cancelling the wait for the standby ends it with a warning, not an error.
        log.error(
            "run %s: checkpoint #%s not confirmed by the synchronous standby in time",
            c.run_id,
            c.head.seq + 1,
        )
        with transaction.atomic(using=self.conn.alias):
            with self.conn.cursor() as cur:  # the alarm must not wait for that standby
                cur.execute("SET LOCAL synchronous_commit = local")
            why = "the synchronous standby did not confirm the commit in time"
            at = {"seq": c.head.seq + 1, "step": c.step, "worker": c.worker}
            events.record(events.alarm(c.run_id, why=why, **at))

    def bind_step(self, c: StepCommit, data: str) -> inflight.Bound:
        return inflight.channel().bind(statement(c), params(c, data, raw=True))

    def synchronous_standby(self) -> tuple[bool, str]:
        with self.conn.cursor() as cur:
            cur.execute("SHOW synchronous_standby_names")
            names = cur.fetchone()[0]
            if not names:
                return False, "synchronous_standby_names is empty (no synchronous standby)"
            cur.execute(
                "SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')"
            )
            if not cur.fetchone()[0]:
                return False, f"no standby named in {names!r} is connected and in sync"
        return True, ""

    def insert_journal_if_absent(self, entry: JournalEntry) -> JournalEntry:
        """One prepared ``INSERT ... ON CONFLICT DO NOTHING`` in autocommit: one round trip
        and one flush, where ``save()`` in a transaction took three (a ``ctx.call`` is on
        every agent's hot path). Inside a transaction, the manager does it."""
        if self.conn.in_atomic_block:
            return super().insert_journal_if_absent(entry)
        fields = {
            "run": entry.run_id,
            "base": entry.base_id,
            "key": entry.key,
            "occurrence": entry.occurrence,
            "kind": entry.kind,
            "step": entry.step,
            "function": entry.function,
            "args_hash": entry.args_hash,
            "result": entry.result,
            "duration_ms": entry.duration_ms,
            "meta": entry.meta,
            "reused_from": entry.reused_from,
        }
        row = self.fetch_one_prepared(pg_sql.JOURNAL_INSERT, fields)
        if row is None:  # recorded already: the earlier record stands
            return JournalEntry.objects.using(self.conn.alias).get(
                base_id=entry.base_id, key=entry.key, occurrence=entry.occurrence
            )
        # The caller's own entry, as the manager's save() leaves it: its id and time filled in
        # (callers tell a new record from an earlier one by identity).
        entry.pk, entry.created_at = row[0], row[1]
        return entry

    # --- liveness locks and leases ---------------------------------------------------------

    def run_lock(self, run_id: Any) -> RunLock:
        return SessionLock(self.conn, run_id)

    def lock_holders(self, run_ids: list[Any]) -> dict[str, set[int]]:
        if not run_ids:
            return {}
        wanted = {key_parts(run_id): str(run_id) for run_id in run_ids}
        holders: dict[str, set[int]] = {}
        with self.conn.cursor() as cur:
            cur.execute(
                f"SELECT classid, objid, pid FROM ({pg_sql.HELD_ADVISORY_LOCKS}) held"
                " WHERE objsubid = 1"
            )
            for a, b, pid in cur.fetchall():
                run = wanted.get((int(a), int(b)))
                if run is not None:
                    holders.setdefault(run, set()).add(int(pid))
        return holders

    def end_stalled_holders(self, runs: list[tuple[Any, int]], settle: float) -> int:
        if not runs:
            return 0
        parts = [key_parts(run_id) for run_id, _ in runs]
        with self.conn.cursor() as cur:
            cur.execute(
                pg_sql.END_STALLED,
                [
                    [str(run_id) for run_id, _ in runs],
                    [hi for hi, _ in parts],
                    [lo for _, lo in parts],
                    [int(token) for _, token in runs],
                    settle,
                ],
            )
            return int(cur.fetchone()[0])

    def lock_loss_unexplained(self, settle: float, lease: float) -> Q | None:
        sql = f"NOT {pg_sql.LOSS_EXPLAINED}"
        return Q(RawSQL(sql, [settle, lease], output_field=BooleanField()))

    def lock_gone(self, run_id: Any, settle: float, lease: float) -> Q:
        sql = f"(NOT {_held_by(run_id)} AND NOT {pg_sql.LOSS_EXPLAINED})"
        return Q(RawSQL(sql, [settle, lease], output_field=BooleanField()))

    def lock_held_by(self, run_id: Any, holder: int | None) -> Q:
        if holder is None:
            return Q()
        return Q(RawSQL(_held_by(run_id, holder), [], output_field=BooleanField()))

    def renew_lease(self, run_id: Any, token: int, seconds: float) -> bool:
        with self.conn.cursor() as cur:
            cur.execute(pg_sql.RENEW, [seconds, run_id, token])
            return cur.rowcount > 0

    def lock_agent_slots(self, agent: str) -> None:
        with self.conn.cursor() as cur:
            # The two-key form: a lock space apart from the runs' own bigint locks.
            cur.execute("SELECT pg_advisory_xact_lock(4207, hashtext(%s))", [agent])

    def hold_worker_lock(self, namespace: int, key: int) -> None:
        with self.conn.cursor() as cur:
            cur.execute(pg_sql.HOLD_WORKER_LOCK, [namespace, key, namespace, key])

    def held_worker_keys(self, namespace: int) -> set[int]:
        with self.conn.cursor() as cur:
            cur.execute(
                f"SELECT objid FROM ({pg_sql.HELD_ADVISORY_LOCKS}) held"
                " WHERE objsubid = 2 AND classid = %s",
                [namespace],
            )
            return {int(row[0]) for row in cur.fetchall()}

    # --- transactions, time, and the rest --------------------------------------------------

    def now(self) -> datetime:
        with self.conn.cursor() as cur:
            cur.execute("SELECT now()")
            return cur.fetchone()[0]

    def lock_timeout(self, seconds: float) -> None:
        with self.conn.cursor() as cur:
            cur.execute("SELECT set_config('lock_timeout', %s, true)", [f"{int(seconds * 1000)}ms"])

    def repeatable_read(self) -> None:
        # READ COMMITTED takes a new snapshot per statement.
        with self.conn.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")

    def unflushed_commit(self) -> None:
        with self.conn.cursor() as cur:
            cur.execute("SET LOCAL synchronous_commit TO OFF")

    def cancel_cut_short(self) -> None:
        # psycopg cancels a query only on KeyboardInterrupt and SystemExit; any other
        # exception leaves the session busy ("another command is already in progress").
        raw = self.conn.connection
        if raw is None or raw.pgconn.transaction_status != psycopg.pq.TransactionStatus.ACTIVE:
            return
        try:
            raw.cancel_safe(timeout=2.0)
        except Exception as exc:  # the close below ends the session either way
            log.warning("could not cancel the query a shutdown cut short: %s", exc)
        self.conn.close()

    def existing_runs(self, ids: Iterable[Any]) -> set[Any]:
        # Locked as a foreign key would lock them (FOR KEY SHARE): a delete waits for the
        # caller's transaction, or the caller sees the run gone.
        with self.conn.cursor() as cur:
            cur.execute(
                "SELECT id FROM durability_run WHERE id = ANY(%s) FOR KEY SHARE", [list(ids)]
            )
            return {row[0] for row in cur.fetchall()}

    def blob_references(self, model: Any, column: str, pattern: Any) -> set[str]:
        # Matched in the database: only digests cross the wire, not whole states.
        table = model._meta.db_table
        with self.conn.cursor() as cur:
            cur.execute(
                f"SELECT DISTINCT (regexp_matches({column}, %s, 'g'))[1] FROM {table}"
                f" WHERE strpos({column}, '\"$blob\"') > 0",
                [pattern.pattern],
            )
            return {row[0] for row in cur.fetchall()}

    def commit_figures(self, since: datetime, quantiles: tuple[float, ...]) -> tuple[int, dict]:
        # Aggregated by the server: a busy window holds hundreds of thousands of commits.
        kinds = (EventKind.CHECKPOINT, EventKind.COMMIT_LATENCY)
        with self.conn.cursor() as cur:
            cur.execute(pg_sql.COMMIT_FIGURES, [list(quantiles), since, *kinds])
            commits, values = cur.fetchone()
        found = {}
        if values:
            found = {q: v / 1e6 for q, v in zip(quantiles, values, strict=True) if v is not None}
        return commits, found

    def commit_latency(
        self, rows: Any, threshold_ms: float, span: Any
    ) -> tuple[int, int, dict[str, float | None], list[float | None]]:
        aggregates: dict[str, Any] = {
            "n": Count("pk"),
            "bad": Count("pk", filter=Q(commit_us__gt=threshold_ms * 1000)),
            "p50": PercentileCont("commit_us", 0.5),
            "p95": PercentileCont("commit_us", 0.95),
            "p99": PercentileCont("commit_us", 0.99),
        }
        for i, (lo, hi) in enumerate(span.edges() if span.buckets else []):
            aggregates[f"b{i}"] = PercentileCont(
                "commit_us", 0.99, filter=Q(created_at__gte=lo, created_at__lt=hi)
            )
        found = rows.aggregate(**aggregates)
        ms = {k: (v / 1000 if v is not None else None) for k, v in found.items()}
        extra = {name: ms[name] for name in ("p50", "p95", "p99")}
        return found["n"], found["bad"], extra, [ms[f"b{i}"] for i in range(span.buckets)]

    def text_page(
        self, matching: Any, status: str, after: tuple | None, size: int
    ) -> tuple[dict[str, int], list[Any]]:
        """The status counts and one page of ids from one pass over ``matching`` (a
        queryset of (id, status, created_at), found through the trigram index on
        ``upper(input)``) materialized once, instead of one pass each."""
        sql, values = matching.query.sql_with_params()
        conditions, extra = [], []
        if status:
            conditions.append("status = %s")
            extra.append(status)
        if after is not None:
            conditions.append("(created_at, id) < (%s, %s)")
            extra += [after[0], after[1]]
        where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
        query = (
            f"WITH m AS MATERIALIZED ({sql})"
            " SELECT status, count(*)::int, NULL::uuid FROM m GROUP BY status"
            f" UNION ALL (SELECT NULL, NULL, id FROM m {where}"
            f" ORDER BY created_at DESC, id DESC LIMIT {int(size) + 1})"
        )
        with self.conn.cursor() as cur:
            cur.execute(query, [*values, *extra])
            found = cur.fetchall()
        tally = {status: n for status, n, _ in found if status is not None}
        return tally, [ident for status, _, ident in found if status is None]
