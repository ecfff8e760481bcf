"""The checkpoint store: committing a step, rebuilding any checkpoint's state, snapshots.

The statements themselves belong to the store (``durability.store``): on PostgreSQL the hot
path (one commit per step) is one hand-written statement, the fencing check and every write
in one atomic statement; on SQLite, the ORM.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, connection, transaction

from durability import canonical, diff
from durability.conf import conf
from durability.errors import FencedOut, IntegrityViolation, UnknownCheckpoint
from durability.models import Checkpoint, Run
from durability.runtime import inflight
from durability.runtime.faults import fault
from durability.store import reconnect, store
from durability.store.base import HEAD_COLUMNS, write_checkpoint, write_snapshot

log = logging.getLogger(__name__)


def hmac_key() -> bytes:
    return conf.HMAC_KEY.encode()


@dataclass(slots=True)
class Head:
    """What a worker keeps in memory about the run's head checkpoint."""

    id: int | None  # None while its commit is in flight (sent ahead)
    seq: int
    chain_hash: str
    state_hash: str
    size: int
    delta_run: int
    schema_version: int
    agent_version: str
    step: str
    next_step: str
    # Patches since the nearest snapshot (``needs_snapshot``'s ``deltas``), when known: a
    # head read back from the database passes what its rebuild walked.
    deltas: int = 0

    @classmethod
    def of(cls, cp: Checkpoint, deltas: int = 0) -> Head:
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
            deltas=deltas,
        )

    @property
    def committed_id(self) -> int:
        """The id, once the commit that made this head is answered."""
        if self.id is None:
            raise RuntimeError(f"checkpoint #{self.seq}: its commit is still in flight")
        return self.id


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


def chain_of(cp: Checkpoint, parent_chain: str, *, run_id: Any = None) -> str:
    """``cp``'s chain hash on ``parent_chain``; ``run_id``: as a checkpoint of that run
    rather than of its own (a copy of it in another run)."""
    return link(
        parent_chain,
        cp.state_hash,
        run_id=cp.run_id if run_id is None else run_id,
        seq=cp.seq,
        step=cp.step,
        next_step=cp.next_step,
        schema_version=cp.schema_version,
        agent_version=cp.agent_version,
    )


# --- writing ---------------------------------------------------------------------------------


def write_snapshot_checkpoint(
    run: Run, state_bytes: bytes, *, parent: Checkpoint | None, **how: Any
) -> Checkpoint:
    """Write a checkpoint stored whole (a run's start, a fork): its state hash is its
    canonical bytes' hash. ``how``: ``whole_checkpoint``'s keywords (its number, reason,
    step...). The caller holds the transaction and has fenced the run."""
    chain = parent.chain_hash if parent else ""
    fields = whole_checkpoint(run.id, state_bytes, parent_chain=chain, **how)
    return write_checkpoint(run=run, parent=parent, **fields)


def whole_checkpoint(
    run_id: Any,
    state_bytes: bytes,
    *,
    seq: int,
    parent_chain: str,
    reason: str,
    step: str,
    next_step: str,
    schema_version: int,
    agent_version: str,
    by: str = "",
    fingerprint: tuple[str, str] = ("", ""),
) -> dict[str, Any]:
    """The fields of a checkpoint stored whole (``write_checkpoint``'s, but its run and
    parent), chained on ``parent_chain``."""
    state_hash = canonical.sha256_hex(state_bytes)
    chain = link(
        parent_chain,
        state_hash,
        run_id=run_id,
        seq=seq,
        step=step,
        next_step=next_step,
        schema_version=schema_version,
        agent_version=agent_version,
    )
    return {
        "seq": seq,
        "reason": reason,
        "step": step,
        "next_step": next_step,
        "state_hash": state_hash,
        "chain_hash": chain,
        "schema_version": schema_version,
        "agent_version": agent_version,
        "config_hash": fingerprint[0],
        "packages": fingerprint[1],
        "size": len(state_bytes),
        "delta_size": len(canonical.EMPTY_PATCH),
        "delta_run": 0,
        "created_by": by,
        "ops": canonical.EMPTY_PATCH.decode(),
        "count": 0,
        "snapshot": state_bytes.decode(),
        "digest": seal(state_hash, state_bytes),
    }


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

    @property
    def ending(self) -> str:
        """The succeeded event's data: the outcome, when the agent named one."""
        return canonical.dumps({"outcome": self.outcome}).decode() if self.outcome else ""


@contextlib.contextmanager
def sqlite_synchronous(level: str) -> Iterator[None]:
    """Within the block, the ``synchronous`` setting of SQLite for a commit at ``level``
    (nothing to do on PostgreSQL, whose commit statement sets its own)."""
    with store().synchronous(level):
        yield


def synchronous_standby() -> tuple[bool, str]:
    """Whether this database has a synchronous standby to wait for, and if not, why."""
    return store().synchronous_standby()


def fetch_one_prepared(sql: str, params: dict[str, Any]) -> tuple | None:
    """Run one of the store's hot PostgreSQL statements, prepared once per session."""
    return store().fetch_one_prepared(sql, params)


def commit_step(c: StepCommit) -> int:
    """Commit one step's checkpoint, fenced on the lease token and the head. Returns the new
    checkpoint's id; raises ``FencedOut`` naming the guard that failed."""

    def inside() -> None:
        fault("in_commit", run=c.run_id, step=c.step, seq=c.head.seq + 1)

    checkpoint_id = store().commit_step(c, _facts(c), inside)
    if checkpoint_id is None:
        raise _fenced(c.run_id, c.token, c.head.seq, c.head.id)
    return checkpoint_id


def _facts(c: StepCommit) -> str:
    """The checkpoint event's data."""
    facts: dict[str, Any] = {"bytes": c.size, "delta": len(c.ops_bytes), "ops": c.ops_count}
    if c.upgraded_from is not None:
        facts["upgraded_from"] = c.upgraded_from
    if c.replayed:
        facts["replayed"] = c.replayed
    return canonical.dumps(facts).decode()


# --- commits in flight ---------------------------------------------------------------------


def can_send_ahead(c: StepCommit) -> bool:
    """Whether this commit may be sent without waiting for its answer: PostgreSQL, outside
    any transaction of the caller's, and a level with nothing to wait for besides the local
    flush (a replicated commit has its own timeout). Fault points keep it: they fire where
    a crash with a commit in flight would happen (``durability.runtime.sendahead``)."""
    return (
        conf.SEND_AHEAD
        and store().sends_ahead
        and c.durability in ("strict", "relaxed")
        and not connection.in_atomic_block
    )


def bind_step(c: StepCommit) -> inflight.Bound:
    """The commit of one step, ready to send as soon as its parent's id and the previous
    commit's latency are known (``send_step``): the rest is converted while the previous
    commit is still in flight, not after its answer."""
    return store().bind_step(c, _facts(c))


def send_step(c: StepCommit, bound: inflight.Bound | None = None) -> None:
    """Send the commit of one step; ``step_answer`` takes its outcome."""
    if bound is None:
        bound = bind_step(c)
    bound.set("parent", c.head.id)
    bound.set("prev_us", c.prev_commit_us)
    inflight.channel().send_bound(bound)


def step_arrived_at() -> float | None:
    """When the answer of the commit sent last reached this process (``time.perf_counter``),
    None while it has not (without waiting for it)."""
    return inflight.channel().arrived_at()


def step_answer(c: StepCommit) -> int:
    """The id of the checkpoint ``send_step(c)`` wrote; ``FencedOut`` naming the guard
    that failed; Django's database errors if the connection failed on the way."""
    row = inflight.channel().answer()
    if row is None:
        raise _fenced(c.run_id, c.token, c.head.seq, c.head.id)
    return int(row[0])


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


def rebuild(checkpoint_id: int) -> Rebuilt:
    """The full state of a checkpoint: its nearest snapshot ancestor with every later patch
    on the path applied, read in one query."""
    return _rebuilt(checkpoint_id, store().chain(checkpoint_id))


def _rebuilt(checkpoint_id: int, rows: list[tuple]) -> Rebuilt:
    if not rows:
        raise UnknownCheckpoint(f"checkpoint id {checkpoint_id} does not exist")
    first_id, snap, text, _, _ = rows[0]
    if snap is None or text is None:
        raise IntegrityViolation(
            f"checkpoint id {first_id} has no snapshot ancestor; its history is incomplete"
        )
    state = canonical.loads(text)
    read = len(text)
    ops: list = []
    for _, _, patch, _, _ in rows[1:]:
        if patch is None:
            raise IntegrityViolation(f"a checkpoint on the path to {checkpoint_id} lost its patch")
        read += len(patch)
        ops.extend(canonical.loads(patch))
    # The patches' own shape (add, remove, replace with explicit indices) applied directly:
    # building jsonpatch's objects for a thousand deltas dominated a large run's page. The
    # same function proved, when each patch was written, that it reproduces its state byte
    # for byte. A verified read (``run_state``, ``verified_state``) checks these bytes
    # against the hashes before this parses them (``_hash_problem``).
    state = diff.apply_own(state, ops)
    return Rebuilt(state=state, bytes_read=read, deltas=len(rows) - 1, snapshot_id=first_id)


def checkpoint(run_id: Any, seq: int) -> Checkpoint:
    try:
        return Checkpoint.objects.get(run_id=run_id, seq=seq)
    except Checkpoint.DoesNotExist:
        raise UnknownCheckpoint(f"run has no checkpoint #{seq}", run_id=run_id) from None


def verified_state(cp: Checkpoint) -> tuple[Any, bytes, Rebuilt]:
    """Rebuild a checkpoint and check it against its hashes before anyone uses it: the
    snapshot it starts from against its digest, each patch after it through the state
    hashes they chain, the result against the checkpoint's state hash, and that hash
    against the chain. Returns the state, its canonical bytes and the rebuild.

    Raises ``IntegrityViolation`` naming the first checkpoint that does not verify."""
    parent_chain = cp.parent_chain or (cp.parent.chain_hash if cp.parent is not None else "")
    rebuilt = _verified(cp, parent_chain)
    try:
        data = canonical.dumps(rebuilt.state)
    except Exception as exc:
        raise _first_bad(cp, f"cannot be encoded ({type(exc).__name__}: {exc})") from None
    return rebuilt.state, data, rebuilt


def run_state(run_id: Any, seq: int | None = None) -> Rebuilt | None:
    """The verified rebuild of a run's head checkpoint, or of its checkpoint ``seq`` (None if
    there is no such run or checkpoint): what ``verified_state`` checks, with the checkpoint,
    its parent's chain hash and the rows it is rebuilt from read in one statement, and
    without encoding the state again (its bytes are not asked for)."""
    head, rows = store().head_chain(run_id, seq)
    if head is None:
        return None
    *fields, parent_chain = head
    cp = Checkpoint(**dict(zip(HEAD_COLUMNS[:-1], fields, strict=True)))
    if _hash_problem(cp, rows) is not None:
        # Rows found by number that are not its path: a LangGraph branch, or a rollback
        # stored by an older version (an empty patch on an older checkpoint, no snapshot),
        # lies between it and its nearest snapshot by number, or some rows lack their copies
        # (written before them) or had them changed.
        # Its parents, walked, are the path (and name what does not verify, if anything).
        return _verified(cp, parent_chain)
    return _rebuilt_checked(cp, parent_chain, rows)


def _verified(cp: Checkpoint, parent_chain: str, rows: list[tuple] | None = None) -> Rebuilt:
    """The rebuild from ``rows`` (default: the walk up ``cp``'s parents), checked before a
    byte of it is parsed: the snapshot against its digest and the patches after it, by their
    hashes, against the checkpoint's state hash (``_hash_problem``); then the checkpoint
    against its chain hash."""
    if rows is None:
        rows = store().chain(cp.id)
    problem = _hash_problem(cp, rows)
    if problem is not None:
        raise _first_bad(cp, problem)
    return _rebuilt_checked(cp, parent_chain, rows)


def _rebuilt_checked(cp: Checkpoint, parent_chain: str, rows: list[tuple]) -> Rebuilt:
    """The rebuild from rows whose hashes are checked; the checkpoint against its chain."""
    try:
        rebuilt = _rebuilt(cp.id, rows)
    except IntegrityViolation:
        raise
    except Exception as exc:  # a patch that no longer applies, bytes that no longer parse
        raise _first_bad(cp, f"cannot be rebuilt ({type(exc).__name__}: {exc})") from None
    if chain_of(cp, parent_chain) != cp.chain_hash:
        raise _first_bad(cp, "its chain hash does not match its contents")
    return rebuilt


def _hash_problem(cp: Checkpoint, rows: list[tuple]) -> str | None:
    """Why ``rows`` (``CHAIN_SQL``'s shape) do not rebuild ``cp``'s state, or None.

    The rebuilt state's hash, without hashing the rebuilt state: a checkpoint stored as a
    patch hashes its parent's hash and the patch's bytes, so chaining the snapshot's
    (sealed) hash through the bytes of the patches gives the hash of the state they produce.
    Just as strong as hashing the result: the patches applied are exactly those hashed, and
    applying them is deterministic (each was proven, when written, to reproduce its state
    byte for byte)."""
    if not rows:
        return "it has no snapshot to be rebuilt from"
    _, snap, text, digest, base_hash = rows[0]
    if snap is None or text is None:
        return "it has no snapshot ancestor; its history is incomplete"
    if seal(base_hash, text.encode()) != (digest or ""):
        return "the snapshot it is rebuilt from does not match its digest"
    state_hash = base_hash
    for _, _, patch, _, _ in rows[1:]:
        if patch is None:
            return "a checkpoint on its path lost its patch"
        state_hash = canonical.patched(state_hash, patch.encode())
    if state_hash != cp.state_hash:
        return "the patches it is rebuilt from do not lead to its state hash"
    return None


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


def needs_snapshot(delta_run: int, size: int, deltas: int = 0) -> bool:
    """Whether the checkpoint about to be written gets a snapshot (off the step's path, on
    the snapshot thread, unless it is small enough to ride in the commit). By bytes: once
    the patches since the last snapshot (``delta_run``) outweigh the state, the next
    rebuild would read more than twice the state. By count: a state that only grows
    outweighs its patches almost never, and every patch costs a rebuild a row, a parse and
    a hash whatever its size; so ``deltas``, the patches since the last snapshot including
    this one, never exceeds ``DURABILITY_SNAPSHOT_MAX_DELTAS``."""
    return delta_run > size or deltas >= conf.SNAPSHOT_MAX_DELTAS


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
            found = exists.values_list("run_id", "seq").first()
            if found is None:
                return
            write_snapshot(
                checkpoint_id,
                *found,
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
        self._starting = threading.Lock()  # a LangGraph saver submits from many threads

    def submit(self, checkpoint_id: int, state_hash: str, state_bytes: bytes) -> None:
        """Store ``state_bytes`` as the snapshot of the checkpoint whose state hash is
        ``state_hash`` (sealing it hashes the whole state: here, off the step's path)."""
        if not store().snapshots_on_thread:
            # One writer at a time (SQLite): written here, after the commit. A failure must
            # not reach the step loop, which would take the committed step for a failed one
            # and run it again on its own output; the next rebuild writes what is missing.
            try:
                store_snapshot(checkpoint_id, state_hash, state_bytes)
            except Exception:
                log.warning("snapshot of checkpoint %s not written", checkpoint_id, exc_info=True)
            return
        with self._starting:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="snapshots", daemon=True)
                self._thread.start()
        self._queue.put((checkpoint_id, state_hash, state_bytes))

    def _loop(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                try:
                    store_snapshot(*item)
                except Exception:
                    log.warning("snapshot of checkpoint %s not written", item[0], exc_info=True)
                    reconnect.drop()
                finally:
                    self._queue.task_done()
            self._queue.task_done()
        finally:
            reconnect.drop()

    def close(self) -> None:
        """Wait for pending snapshots, then stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
