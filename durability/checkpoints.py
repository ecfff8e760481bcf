"""The checkpoint store: committing a step, rebuilding any checkpoint's state, snapshots.

The hot path (one commit per step) is one hand-written statement on PostgreSQL: data-modifying
CTEs chained on the fenced UPDATE of the run, so the fencing check and every write are one
atomic statement (measured at ~1.1x a plain INSERT + COMMIT, against ~2.9x for the same
writes as four ORM statements). Elsewhere, and on SQLite, it is the ORM.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from django.conf import settings
from django.db import DatabaseError, IntegrityError, OperationalError, connection, transaction
from django.utils import timezone

from durability import canonical, diff, inflight, redact
from durability.errors import FencedOut, IntegrityViolation, UnknownCheckpoint
from durability.faults import fault, faults_armed
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

log = logging.getLogger(__name__)


def hmac_key() -> bytes:
    return (getattr(settings, "DURABILITY_HMAC_KEY", "") or "").encode()


@dataclass(slots=True)
class Head:
    """What a worker keeps in memory about the run's head checkpoint."""

    id: int
    seq: int
    chain_hash: str
    state_hash: str
    size: int
    delta_run: int
    schema_version: int
    agent_version: str
    step: str
    next_step: str

    @classmethod
    def of(cls, cp: Checkpoint) -> Head:
        return cls(
            id=cp.id,
            seq=cp.seq,
            chain_hash=cp.chain_hash,
            state_hash=cp.state_hash,
            size=cp.size,
            delta_run=cp.delta_run,
            schema_version=cp.schema_version,
            agent_version=cp.agent_version,
            step=cp.step,
            next_step=cp.next_step,
        )


def link(
    parent_chain: str,
    state_hash: str,
    *,
    run_id: Any,
    seq: int,
    step: str,
    next_step: str,
    schema_version: int,
    agent_version: str,
) -> str:
    return canonical.chain_hash(
        parent_chain,
        state_hash,
        run_id=str(run_id),
        seq=seq,
        step=step,
        next_step=next_step,
        schema_version=schema_version,
        agent_version=agent_version,
        key=hmac_key(),
    )


def seal(state_hash: str, state_bytes: bytes) -> str:
    """The digest a snapshot of the state ``state_hash`` is stored with."""
    return canonical.seal(state_hash, state_bytes, hmac_key())


def chain_of(cp: Checkpoint, parent_chain: str) -> str:
    return link(
        parent_chain,
        cp.state_hash,
        run_id=cp.run_id,
        seq=cp.seq,
        step=cp.step,
        next_step=cp.next_step,
        schema_version=cp.schema_version,
        agent_version=cp.agent_version,
    )


# --- writing ---------------------------------------------------------------------------------


def write_snapshot_checkpoint(
    run: Run,
    state_bytes: bytes,
    *,
    seq: int,
    parent: Checkpoint | None,
    reason: str,
    step: str,
    next_step: str,
    schema_version: int,
    agent_version: str,
    by: str = "",
    fingerprint: tuple[str, str] = ("", ""),
) -> Checkpoint:
    """Write a checkpoint stored whole (a run's start, a fork): its state hash is its
    canonical bytes' hash. The caller holds the transaction and has fenced the run."""
    state_hash = canonical.sha256_hex(state_bytes)
    chain = link(
        parent.chain_hash if parent else "",
        state_hash,
        run_id=run.id,
        seq=seq,
        step=step,
        next_step=next_step,
        schema_version=schema_version,
        agent_version=agent_version,
    )
    cp = Checkpoint.objects.create(
        run=run,
        seq=seq,
        parent=parent,
        reason=reason,
        step=step,
        next_step=next_step,
        state_hash=state_hash,
        chain_hash=chain,
        schema_version=schema_version,
        agent_version=agent_version,
        config_hash=fingerprint[0],
        packages=fingerprint[1],
        size=len(state_bytes),
        delta_size=len(canonical.EMPTY_PATCH),
        delta_run=0,
        created_by=by,
    )
    Mutation.objects.create(checkpoint=cp, ops=canonical.EMPTY_PATCH.decode(), count=0)
    Snapshot.objects.create(
        checkpoint=cp, state=state_bytes.decode(), digest=seal(state_hash, state_bytes)
    )
    return cp


@dataclass(slots=True)
class StepCommit:
    run_id: Any
    token: int
    head: Head
    worker: str
    step: str
    next_step: str
    ops_bytes: bytes
    ops_count: int
    state_hash: str
    chain_hash: str
    size: int
    delta_run: int
    schema_version: int
    agent_version: str
    commit_id: uuid.UUID
    prev_commit_us: int | None
    lease_seconds: float
    upgraded_from: int | None = None
    # The full state, when this checkpoint is written as a snapshot in the same statement,
    # and the digest that seals it.
    snapshot: bytes | None = None
    snapshot_digest: str = ""
    durability: str = "strict"
    config_hash: str = ""
    packages: str = ""
    replay_base_id: int | None = None
    replay_counters: str = ""
    # The run's last step: how it ended, in the agent's words ("" for its status alone).
    outcome: str = ""
    # Calls the step(s) of this checkpoint took from the journal instead of paying again,
    # as [id, key] (written into the checkpoint event: no statement of their own).
    replayed: list | None = None

    @property
    def finished(self) -> bool:
        return not self.next_step


_PG_COMMIT = """
WITH {cfg}r AS (
    UPDATE durability_run
       SET head_seq = head_seq + 1,
           step = %(next_step)s::text,
           retries = 0,
           status = %(status)s::text,
           heartbeat_at = now(),
           {lease}
           updated_at = now()
     WHERE id = %(run)s::uuid AND lease_token = %(token)s::bigint
       AND head_seq = %(head_seq)s::integer{cfg_ref}
       AND EXISTS (SELECT FROM durability_checkpoint p
                    WHERE p.run_id = %(run)s::uuid AND p.seq = %(head_seq)s::integer
                      AND p.id = %(parent)s::bigint)
 RETURNING id, head_seq
), c AS (
    INSERT INTO durability_checkpoint
        (run_id, seq, parent_id, reason, step, next_step, state_hash, chain_hash,
         schema_version, agent_version, size, delta_size, delta_run, commit_id,
         config_hash, packages, replay_base_id, replay_counters, created_by, created_at)
    SELECT r.id, r.head_seq, %(parent)s::bigint, 'step', %(step)s::text, %(next_step)s::text,
           %(state_hash)s::text, %(chain_hash)s::text, %(schema_version)s::integer,
           %(agent_version)s::text, %(size)s::integer, %(delta_size)s::integer,
           %(delta_run)s::bigint, %(commit_id)s::uuid, %(config_hash)s::text,
           %(packages)s::text, %(replay_base)s::bigint, %(replay_counters)s::text, '', now()
      FROM r
 RETURNING id
), m AS (
    INSERT INTO durability_mutation (checkpoint_id, ops, count)
    SELECT c.id, %(ops)s::text, %(count)s::integer FROM c
){snapshot}, e AS (
    INSERT INTO durability_event
        (run_id, kind, seq, step, actor, reason, worker, data, commit_us, created_at)
    SELECT r.id, v.kind, r.head_seq, %(step)s::text, '', '', %(worker)s::text, v.data,
           %(prev_us)s::integer, now()
      FROM r CROSS JOIN (VALUES {events}) AS v(kind, data)
)
SELECT id FROM c
"""
# Going on, the execution's next step is its first attempt: a crash from here on counts as
# one when the run is claimed again (the poison-step counter).
_LEASE_KEEP = "lease_expires_at = now() + %(lease)s::float8 * interval '1 second', attempts = 1,"
_LEASE_END = (
    "lease_expires_at = NULL, lease_owner = '', finished_at = now(), attempts = 0,"
    " outcome = %(outcome)s::text,"
)
_SNAPSHOT = """, s AS (
    INSERT INTO durability_snapshot (checkpoint_id, state, digest)
    SELECT c.id, %(snapshot)s::text, %(digest)s::text FROM c
)"""
_EVENTS_CONTINUE = "('checkpoint', %(data)s::text)"
_EVENTS_FINISH = "('checkpoint', %(data)s::text), ('succeeded', %(end)s::text)"
# Relaxed and replicated levels set synchronous_commit for this statement's own (implicit)
# transaction only; the fenced UPDATE refers to the setting so that it is evaluated first.
_CFG = "cfg AS (SELECT set_config('synchronous_commit', %(sync)s::text, true) AS v), "
_CFG_REF = "\n       AND (SELECT v FROM cfg) IS NOT NULL"
# (finished, with a snapshot, level sets synchronous_commit) -> statement
_SQL = {
    (finished, snapshot, configured): _PG_COMMIT.format(
        cfg=_CFG if configured else "",
        cfg_ref=_CFG_REF if configured else "",
        lease=_LEASE_END if finished else _LEASE_KEEP,
        events=_EVENTS_FINISH if finished else _EVENTS_CONTINUE,
        snapshot=_SNAPSHOT if snapshot else "",
    )
    for finished in (False, True)
    for snapshot in (False, True)
    for configured in (False, True)
}
_SYNCHRONOUS_COMMIT = {"relaxed": "off", "replicated": "remote_apply"}

# SQLite's counterpart, so that a level promises the same on both databases. Connections
# open at synchronous=FULL (config/settings.py): in WAL mode each commit then syncs the WAL
# to disk before COMMIT returns, like PostgreSQL's default synchronous_commit=on, so every
# write that is not a relaxed checkpoint (strict and periodic checkpoints, effect intents,
# call records, decisions, operator actions) survives an OS crash or a power loss. A relaxed
# checkpoint commits under NORMAL, like synchronous_commit=off: the WAL is synced only when
# SQLite checkpoints it, so a killed process loses nothing while an OS crash or a power loss
# may lose the last relaxed commits (never corrupting the file). periodic saves commits, not
# flushes: its checkpoints stay at FULL as on PostgreSQL. replicated is refused on SQLite.
_SQLITE_SYNCHRONOUS = {"relaxed": "NORMAL"}


@contextlib.contextmanager
def sqlite_synchronous(level: str) -> Iterator[None]:
    """Within the block, SQLite's ``synchronous`` setting for a commit at ``level``. SQLite
    refuses to change it inside a transaction: inside a caller's, the commit keeps the
    connection's (FULL, only ever stronger). The previous setting is put back after; if
    that fails, the connection is closed, so that the next one opens at FULL again."""
    lowered = _SQLITE_SYNCHRONOUS.get(level)
    if lowered is None or connection.vendor != "sqlite" or connection.in_atomic_block:
        yield
        return
    with connection.cursor() as cur:
        cur.execute("PRAGMA synchronous")
        previous = int(cur.fetchone()[0])
        cur.execute(f"PRAGMA synchronous = {lowered}")
    try:
        yield
    finally:
        try:
            with connection.cursor() as cur:
                cur.execute(f"PRAGMA synchronous = {previous}")
        except DatabaseError:  # a broken connection: the next one opens at FULL again
            connection.close()


def synchronous_standby() -> tuple[bool, str]:
    """Whether this database has a synchronous standby to wait for, and if not, why."""
    if connection.vendor != "postgresql":
        return False, "the database is not PostgreSQL"
    with connection.cursor() as cur:
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


def commit_step(c: StepCommit) -> int:
    """Commit one step's checkpoint, fenced on the lease token and the head. Returns the new
    checkpoint's id; raises ``FencedOut`` naming the guard that failed."""
    data = _facts(c)
    if connection.vendor != "postgresql":
        with sqlite_synchronous(c.durability), transaction.atomic():
            checkpoint_id = _commit_orm(c, data)
            fault("in_commit", run=c.run_id, step=c.step, seq=c.head.seq + 1)
        return checkpoint_id
    if c.durability == "replicated":
        return _commit_replicated(c, data)
    return _commit_pg_transaction(c, data)


def _facts(c: StepCommit) -> str:
    """The checkpoint event's data."""
    facts = {"bytes": c.size, "delta": len(c.ops_bytes), "ops": c.ops_count}
    if c.upgraded_from is not None:
        facts["upgraded_from"] = c.upgraded_from
    if c.replayed:
        facts["replayed"] = c.replayed
    return canonical.dumps(facts).decode()


def _ending(c: StepCommit) -> str:
    """The succeeded event's data: the outcome, when the agent named one."""
    return canonical.dumps({"outcome": c.outcome}).decode() if c.outcome else ""


def _commit_pg_transaction(c: StepCommit, data: str) -> int:
    if faults_armed() or connection.in_atomic_block:
        # A named fault point inside the transaction needs an explicit one.
        with transaction.atomic():
            checkpoint_id = _commit_pg(c, data)
            fault("in_commit", run=c.run_id, step=c.step, seq=c.head.seq + 1)
        return checkpoint_id
    # One statement in autocommit mode is its own transaction: one round trip, one flush.
    return _commit_pg(c, data)


def _commit_replicated(c: StepCommit, data: str) -> int:
    """A lost standby would block every commit: past the timeout, the wait is cancelled (the
    commit stays, durable on the primary but not confirmed by the standby) and an alarm is
    raised, instead of the run hanging."""
    connection.ensure_connection()
    raw = connection.connection
    gave_up = threading.Event()

    def give_up() -> None:
        gave_up.set()
        raw.cancel()

    timer = threading.Timer(
        float(getattr(settings, "DURABILITY_REPLICATION_TIMEOUT_SECONDS", 10.0)), give_up
    )
    timer.daemon = True
    timer.start()
    try:
        checkpoint_id = _commit_pg_transaction(c, data)
    except OperationalError:
        if not gave_up.is_set():
            raise
        # Cancelled before its commit record: nothing was written, the caller retries.
        found = committed_id(c.run_id, c.commit_id)
        if found is None:
            raise
        checkpoint_id = found
    finally:
        timer.cancel()
    if gave_up.is_set():
        # Cancelling the wait for the standby ends it with a warning, not an error.
        log.error(
            "run %s: checkpoint #%s not confirmed by the synchronous standby in time",
            c.run_id,
            c.head.seq + 1,
        )
        with transaction.atomic():
            with connection.cursor() as cur:  # the alarm must not wait for that standby
                cur.execute("SET LOCAL synchronous_commit = local")
            Event.objects.create(
                run_id=c.run_id,
                kind=EventKind.ALARM,
                seq=c.head.seq + 1,
                step=c.step,
                worker=c.worker,
                reason="the synchronous standby did not confirm the commit in time",
            )
    return checkpoint_id


def fetch_one_prepared(sql: str, params: dict[str, Any]) -> tuple | None:
    """Run one of the engine's hot statements on Django's psycopg connection and return its
    first row. A server-side-binding cursor prepares the statement once per connection
    instead of parsing and planning it on every step."""
    connection.ensure_connection()
    raw = connection.connection
    prepare = bool(getattr(settings, "DURABILITY_PREPARED_STATEMENTS", True))
    if prepare and raw.prepare_threshold is None:
        # Django opens connections with preparation off, and psycopg then ignores
        # prepare=True. A threshold no query reaches turns it back on for explicit requests
        # only: Django's own queries stay unprepared.
        raw.prepare_threshold = 2**31 - 1
    # A cursor of psycopg's own passes no execute wrapper: the redaction gate, here.
    params = redact.scrub(params)
    with connection.wrap_database_errors, psycopg.Cursor(raw) as cur:
        cur.execute(sql, params, prepare=prepare or None)
        return cur.fetchone()


def _commit_pg(c: StepCommit, data: str) -> int:
    row = fetch_one_prepared(_statement(c), _params(c, data))
    if row is None:
        raise _fenced(c.run_id, c.token, c.head.seq, c.head.id)
    return row[0]


def _statement(c: StepCommit) -> str:
    return _SQL[(c.finished, c.snapshot is not None, c.durability in _SYNCHRONOUS_COMMIT)]


def _params(c: StepCommit, data: str, raw: bool = False) -> dict[str, Any]:
    """The statement's parameters; ``raw`` keeps the patch and the snapshot as the bytes
    they are (the channel sends bytes as they are)."""
    values = {
        "sync": _SYNCHRONOUS_COMMIT.get(c.durability),
        "run": c.run_id,
        "token": c.token,
        "head_seq": c.head.seq,
        "next_step": c.next_step,
        "status": RunStatus.SUCCEEDED if c.finished else RunStatus.RUNNING,
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
        values["end"] = _ending(c)
    return values


# --- commits in flight ---------------------------------------------------------------------


def can_send_ahead(c: StepCommit) -> bool:
    """Whether this commit may be sent without waiting for its answer: PostgreSQL, outside
    any transaction of the caller's, and a level with nothing to wait for besides the local
    flush (a replicated commit has its own timeout). Fault points keep it: they fire where
    a crash with a commit in flight would happen (``durability.sendahead``)."""
    return (
        bool(getattr(settings, "DURABILITY_SEND_AHEAD", True))
        and connection.vendor == "postgresql"
        and c.durability in ("strict", "relaxed")
        and not connection.in_atomic_block
    )


def bind_step(c: StepCommit) -> inflight.Bound:
    """The commit of one step, ready to send as soon as its parent's id and the previous
    commit's latency are known (``send_step``): the rest is converted while the previous
    commit is still in flight, not after its answer."""
    return inflight.channel().bind(_statement(c), _params(c, _facts(c), raw=True))


def send_step(c: StepCommit, bound: inflight.Bound | None = None) -> None:
    """Send the commit of one step; ``step_answer`` takes its outcome."""
    if bound is None:
        bound = bind_step(c)
    bound.set("parent", c.head.id)
    bound.set("prev_us", c.prev_commit_us)
    inflight.channel().send_bound(bound)


def step_ready() -> bool:
    """Whether the answer of the commit in flight is in (without waiting for it)."""
    return inflight.channel().ready()


def step_answer(c: StepCommit) -> int:
    """The id of the checkpoint ``send_step(c)`` wrote; ``FencedOut`` naming the guard
    that failed; Django's database errors if the connection failed on the way."""
    row = inflight.channel().answer()
    if row is None:
        raise _fenced(c.run_id, c.token, c.head.seq, c.head.id)
    return int(row[0])


def _commit_orm(c: StepCommit, data: str) -> int:
    from datetime import timedelta

    from django.db.models import Exists
    from django.db.models.functions import Now

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
            status=RunStatus.SUCCEEDED,
            lease_owner="",
            lease_expires_at=None,
            finished_at=now,
            outcome=c.outcome,
        )
    else:
        fields.update(
            status=RunStatus.RUNNING,
            lease_expires_at=now + timedelta(seconds=c.lease_seconds),
        )
    is_head = Checkpoint.objects.filter(run_id=c.run_id, seq=c.head.seq, pk=c.head.id)
    updated = (
        Run.objects.filter(pk=c.run_id, lease_token=c.token, head_seq=c.head.seq)
        .filter(Exists(is_head))
        .update(**fields)
    )
    if not updated:
        raise _fenced(c.run_id, c.token, c.head.seq, c.head.id)
    cp = Checkpoint.objects.create(
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
    )
    Mutation.objects.create(checkpoint=cp, ops=c.ops_bytes.decode(), count=c.ops_count)
    if c.snapshot is not None:
        Snapshot.objects.create(checkpoint=cp, state=c.snapshot.decode(), digest=c.snapshot_digest)
    events = [
        Event(
            run_id=c.run_id,
            kind=EventKind.CHECKPOINT,
            seq=cp.seq,
            step=c.step,
            worker=c.worker,
            data=data,
            commit_us=c.prev_commit_us,
        )
    ]
    if c.finished:
        events.append(
            Event(
                run_id=c.run_id,
                kind=EventKind.SUCCEEDED,
                seq=cp.seq,
                step=c.step,
                worker=c.worker,
                data=_ending(c),
            )
        )
    Event.objects.bulk_create(events, run_checked=True)  # the fenced UPDATE above
    return cp.id


def _fenced(run_id: Any, token: int, head_seq: int, parent: int | None = None) -> FencedOut:
    current = Run.objects.filter(pk=run_id).values("lease_token", "head_seq", "status").first()
    if current is None:
        return FencedOut("the run no longer exists", run_id=run_id, guard="run")
    if current["lease_token"] != token:
        return FencedOut(
            f"lease token {token} is stale (now {current['lease_token']}, status"
            f" {current['status']}): another worker or an operator took the run",
            run_id=run_id,
            guard="lease",
        )
    if current["head_seq"] == head_seq and parent is not None:
        head = Checkpoint.objects.filter(run_id=run_id, seq=head_seq).values_list("id", flat=True)
        return FencedOut(
            f"checkpoint id {parent} is not the run's head #{head_seq}"
            f" (that is checkpoint id {head.first()})",
            run_id=run_id,
            guard="parent",
        )
    return FencedOut(
        f"head moved from #{head_seq} to #{current['head_seq']} under this worker",
        run_id=run_id,
        guard="head",
    )


def committed_id(run_id: Any, commit_id: uuid.UUID) -> int | None:
    """After a connection dropped during COMMIT: the checkpoint id if the commit happened."""
    return (
        Checkpoint.objects.filter(run_id=run_id, commit_id=commit_id)
        .values_list("id", flat=True)
        .first()
    )


# --- reading ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Rebuilt:
    state: Any
    bytes_read: int
    deltas: int
    snapshot_id: int
    # What ``verified_state`` checks the rebuild against: the snapshot's bytes, its digest
    # and its checkpoint's state hash, and the patches applied after it, in order.
    snapshot: str = ""
    digest: str = ""
    base_hash: str = ""
    patches: list[str] = field(default_factory=list)


_CHAIN_SQL = """
WITH RECURSIVE chain(id, parent_id, depth, snap, state_hash) AS (
    SELECT c.id, c.parent_id, 0,
           (SELECT 1 FROM durability_snapshot s WHERE s.checkpoint_id = c.id), c.state_hash
      FROM durability_checkpoint c WHERE c.id = %s
    UNION ALL
    SELECT p.id, p.parent_id, chain.depth + 1,
           (SELECT 1 FROM durability_snapshot s WHERE s.checkpoint_id = p.id), p.state_hash
      FROM durability_checkpoint p JOIN chain ON p.id = chain.parent_id
     WHERE chain.snap IS NULL
)
SELECT chain.id, chain.snap,
       CASE WHEN chain.snap IS NULL
            THEN (SELECT m.ops FROM durability_mutation m WHERE m.checkpoint_id = chain.id)
            ELSE (SELECT s.state FROM durability_snapshot s WHERE s.checkpoint_id = chain.id)
       END,
       CASE WHEN chain.snap IS NULL THEN NULL
            ELSE (SELECT s.digest FROM durability_snapshot s WHERE s.checkpoint_id = chain.id)
       END,
       chain.state_hash
  FROM chain ORDER BY chain.depth DESC
"""


def rebuild(checkpoint_id: int) -> Rebuilt:
    """The full state of a checkpoint: its nearest snapshot ancestor with every later patch
    on the path applied, read in one query."""
    with connection.cursor() as cur:
        cur.execute(_CHAIN_SQL, [checkpoint_id])
        rows = cur.fetchall()
    if not rows:
        raise UnknownCheckpoint(f"checkpoint id {checkpoint_id} does not exist")
    first_id, snap, text, digest, base_hash = rows[0]
    if snap is None or text is None:
        raise IntegrityViolation(
            f"checkpoint id {first_id} has no snapshot ancestor; its history is incomplete"
        )
    state = canonical.loads(text)
    read = len(text)
    ops: list = []
    patches: list[str] = []
    for _, _, patch, _, _ in rows[1:]:
        if patch is None:
            raise IntegrityViolation(f"a checkpoint on the path to {checkpoint_id} lost its patch")
        read += len(patch)
        patches.append(patch)
        ops.extend(canonical.loads(patch))
    # The patches' own shape (add, remove, replace with explicit indices) applied directly:
    # building jsonpatch's objects for a thousand deltas dominated a large run's page. The
    # same function proved, when each patch was written, that it reproduces its state byte
    # for byte; ``verified_state`` checks the bytes read here against the hashes.
    state = diff.apply_own(state, ops)
    return Rebuilt(
        state=state,
        bytes_read=read,
        deltas=len(rows) - 1,
        snapshot_id=first_id,
        snapshot=text,
        digest=digest or "",
        base_hash=base_hash,
        patches=patches,
    )


def checkpoint(run_id: Any, seq: int) -> Checkpoint:
    try:
        return Checkpoint.objects.get(run_id=run_id, seq=seq)
    except Checkpoint.DoesNotExist:
        raise UnknownCheckpoint(f"run has no checkpoint #{seq}", run_id=run_id) from None


def verified_state(cp: Checkpoint) -> tuple[Any, bytes, Rebuilt]:
    """Rebuild a checkpoint and check it against its hashes before anyone uses it: the
    snapshot it starts from against its digest, each patch after it through the state
    hashes they chain, the result against the checkpoint's state hash, and that hash
    against the chain.

    Raises ``IntegrityViolation`` naming the first checkpoint that does not verify."""
    try:
        rebuilt = rebuild(cp.id)
        data = canonical.dumps(rebuilt.state)
    except IntegrityViolation:
        raise
    except Exception as exc:  # a patch that no longer applies, bytes that no longer parse
        raise _first_bad(cp, f"cannot be rebuilt ({type(exc).__name__}: {exc})") from None
    if seal(rebuilt.base_hash, rebuilt.snapshot.encode()) != rebuilt.digest:
        raise _first_bad(cp, "the snapshot it is rebuilt from does not match its digest")
    state_hash = rebuilt.base_hash
    for patch in rebuilt.patches:
        state_hash = canonical.patched(state_hash, patch.encode())
    if state_hash != cp.state_hash:
        raise _first_bad(cp, "the patches it is rebuilt from do not lead to its state hash")
    parent_chain = cp.parent_chain or (cp.parent.chain_hash if cp.parent_id else "")
    if chain_of(cp, parent_chain) != cp.chain_hash:
        raise _first_bad(cp, "its chain hash does not match its contents")
    return rebuilt.state, data, rebuilt


def _first_bad(cp: Checkpoint, fallback: str) -> IntegrityViolation:
    from durability.integrity import verify_run

    report = verify_run(cp.run_id, upto=cp.seq)
    if report.first_bad is not None:
        seq, why = report.first_bad
        return IntegrityViolation(
            f"checkpoint #{seq} does not verify: {why}", run_id=cp.run_id, seq=seq
        )
    return IntegrityViolation(
        f"checkpoint #{cp.seq} does not verify: {fallback}", run_id=cp.run_id, seq=cp.seq
    )


# --- snapshots off the hot path -------------------------------------------------------------


def needs_snapshot(delta_run: int, size: int) -> bool:
    """Policy by bytes: once the patches since the last snapshot outweigh the state, the
    next rebuild would read more than twice the state, so write a snapshot."""
    return delta_run > size


# A snapshot this small rides in the commit statement itself (no second transaction, no
# second flush); a larger one is written by a thread, off the step's path.
INLINE_SNAPSHOT_BYTES = 64 * 1024


def store_snapshot(checkpoint_id: int, state_hash: str, state_bytes: bytes) -> None:
    fault("in_snapshot", checkpoint=checkpoint_id)
    try:
        with transaction.atomic():
            # Locked, so that a checkpoint compaction or retention is removing is not given
            # a snapshot after it is gone.
            exists = Checkpoint.objects.select_for_update().filter(pk=checkpoint_id)
            if exists.values_list("pk", flat=True).first() is None:
                return
            Snapshot.objects.create(
                checkpoint_id=checkpoint_id,
                state=state_bytes.decode(),
                digest=seal(state_hash, state_bytes),
            )
    except IntegrityError:
        pass  # already there


class SnapshotWriter:
    """Writes snapshots on a thread of its own, so the step loop never waits for them.

    A snapshot that is lost (the process dies first) costs only a longer rebuild, which
    writes the missing snapshot itself (see ``executor``)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[int, str, bytes] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, checkpoint_id: int, state_hash: str, state_bytes: bytes) -> None:
        """Store ``state_bytes`` as the snapshot of the checkpoint whose state hash is
        ``state_hash`` (sealing it hashes the whole state: here, off the step's path)."""
        if connection.vendor != "postgresql":
            # One writer at a time on SQLite: written here, after the commit. A failure must
            # not reach the step loop, which would take the committed step for a failed one
            # and run it again on its own output; the next rebuild writes what is missing.
            try:
                store_snapshot(checkpoint_id, state_hash, state_bytes)
            except Exception:
                log.warning("snapshot of checkpoint %s not written", checkpoint_id, exc_info=True)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="snapshots", daemon=True)
            self._thread.start()
        self._queue.put((checkpoint_id, state_hash, state_bytes))

    def _loop(self) -> None:
        from django.db import connection as thread_connection

        try:
            while (item := self._queue.get()) is not None:
                try:
                    store_snapshot(*item)
                except Exception:
                    log.warning("snapshot of checkpoint %s not written", item[0], exc_info=True)
                    thread_connection.close()
                finally:
                    self._queue.task_done()
            self._queue.task_done()
        finally:
            thread_connection.close()

    def close(self) -> None:
        """Wait for pending snapshots, then stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
