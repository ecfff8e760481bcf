"""One LangGraph checkpoint of a thread read in one statement, on PostgreSQL (the store's,
``durability.store.langgraph``): the thread's run, the checkpoint (the latest, or one by its
LangGraph id), every snapshot and patch its state is rebuilt from, and its pending writes.
``get_tuple`` and a ``put`` on a parent the saver does not hold in memory need nothing
else, so a new saver pays one round trip where the ORM took five.

The state is checked as ``checkpoints.verified_state`` checks it (the snapshot against its
digest, each patch through the state hashes they chain, the result against the
checkpoint's state hash, that hash against the chain), without dumping the rebuilt state
again to hash it: the chained hashes cover the patches' bytes, and the snapshot's digest
its bytes. A rebuild may start from a checkpoint whose state the saver already holds
(proven when it was written or read), instead of from a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from durability import canonical, checkpoints, diff
from durability.errors import IntegrityViolation
from durability.store import langgraph as lg_store


class ThreadDeleted(LookupError):
    """A thread the saver held in memory was deleted meanwhile (``delete_thread`` in
    another process, say): its run is gone."""


@dataclass(slots=True)
class Stored:
    """What a saver keeps in memory of a stored checkpoint, to patch the next one on it.
    ``doc`` is never changed: it shares its messages with the saver's encoder and with the
    next checkpoint's document, so patches are applied to copies of what they change
    (``diff.apply_own(shared=True)``)."""

    id: int
    seq: int
    lg_id: str
    state_hash: str
    chain_hash: str
    delta_run: int
    size: int
    doc: Any
    # ``doc``'s canonical bytes where they were made (a snapshot was due), for the exact
    # diff when the fast one misses, which makes them otherwise.
    data: bytes | None


@dataclass(slots=True)
class Found:
    thread: int
    run_id: Any
    head_seq: int
    stored: Stored | None
    lg_parent: str
    writes: list[tuple[str, int, str, str, str]]  # task id, idx, channel, task path, value


def read(db: Any, thread_id: str, ns: str, lg_id: str, have: Stored | None) -> Found | None:
    """The namespace's checkpoint ``lg_id`` (the latest when empty) on the connection
    ``db``; None when the namespace was never stored. ``have``: a checkpoint whose state
    the caller holds, used (left as it is) when the wanted one descends from it."""
    rows = lg_store.for_connection(db).read(thread_id, ns, lg_id, have.id if have else 0)
    if not rows:
        return None
    # Oldest first: the snapshot (or the state held), its patches, then the checkpoint
    # itself, whose row carries the rest.
    thread, run_id, head_seq, lg, lg_parent, *head = rows[-1][4:]
    path = [row[:4] for row in rows]
    writes = [(w[0], int(w[1]), w[2], w[3], w[4]) for w in head[-1] or []]
    stored = _rebuilt(run_id, lg, head[:-1], path, have)
    return Found(thread, run_id, head_seq, stored, lg_parent or "", writes)


def start(db: Any, run_id: Any) -> Stored:
    """The empty first checkpoint of a thread's run (the parent of its first ``put``);
    ``ThreadDeleted`` if the run is gone."""
    found = lg_store.for_connection(db).start(run_id)
    if found is None:
        raise ThreadDeleted(f"run {run_id} was deleted")
    return first(*found)


def first(cp_id: int, state_hash: str, chain_hash: str, size: int) -> Stored:
    """A thread's run's empty first checkpoint, as the saver keeps it."""
    return Stored(cp_id, 0, "", state_hash, chain_hash, 0, size, {}, b"{}")


def _rebuilt(run_id: Any, lg_id: str, head: list, path: list, have: Stored | None) -> Stored:
    seq, state_hash, chain_hash, step, next_step, schema, version, delta_run, size = head[:9]
    parent_chain = head[9]
    ids = [row[0] for row in path]
    if have is not None and ids == [have.id] and have.state_hash == state_hash:
        return have  # the saver's own last checkpoint: proven when it was written
    hashes, texts, digests = ([row[i] for row in path] for i in (1, 2, 3))
    if texts[0] is None and (have is None or ids[0] != have.id):
        raise _bad(run_id, seq, "it has no snapshot to be rebuilt from")
    try:
        held = False  # the caller's document, which is patched on a copy
        if have is not None and ids[0] == have.id:
            doc, base_hash, held = have.doc, have.state_hash, True
        else:
            if checkpoints.seal(hashes[0], texts[0].encode()) != digests[0]:
                raise _bad(run_id, seq, "the snapshot it is rebuilt from does not match its digest")
            doc, base_hash = canonical.loads(texts[0]), hashes[0]
        ops: list = []
        for patch in texts[1:]:
            base_hash = canonical.patched(base_hash, patch.encode())
            ops.extend(canonical.loads(patch))
        if base_hash != state_hash:
            raise _bad(run_id, seq, "the patches it is rebuilt from do not lead to its state hash")
        doc = diff.apply_own(doc, ops, shared=held)
    except IntegrityViolation:
        raise
    except Exception as exc:  # a patch that no longer applies, bytes that no longer parse
        raise _bad(run_id, seq, f"cannot be rebuilt ({type(exc).__name__}: {exc})") from None
    linked = checkpoints.link(
        parent_chain,
        state_hash,
        run_id=run_id,
        seq=seq,
        step=step,
        next_step=next_step,
        schema_version=schema,
        agent_version=version,
    )
    if linked != chain_hash:
        raise _bad(run_id, seq, "its chain hash does not match its contents")
    # Patches since the last snapshot: none when the checkpoint has its own.
    rebuilt_delta = delta_run if len(ids) > 1 else 0
    return Stored(ids[-1], seq, lg_id, state_hash, chain_hash, rebuilt_delta, size, doc, None)


def _bad(run_id: Any, seq: int, why: str) -> IntegrityViolation:
    return IntegrityViolation(f"checkpoint #{seq} does not verify: {why}", run_id=run_id, seq=seq)
