"""What one step's checkpoint holds, computed from the state the step left.

The worker keeps two copies of the state: ``live``, which the steps mutate, and
``pristine``, the last committed state. After a step the structural diff of the two is the
checkpoint's patch; applying a copy of that patch to ``pristine`` brings it forward without
re-parsing the whole state, and its canonical bytes are checked against ``live``'s (the
fast diff treats 1 == 1.0 == True; on a mismatch the exact diff is used).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from durability import blobs, canonical, checkpoints, diff, leases
from durability.checkpoints import Head, StepCommit
from durability.errors import (
    IntegrityViolation,
    SchemaViolation,
    StateNotJSON,
    StateTooLarge,
    StepError,
)
from durability.redact import contains_secret, is_secret_key, redact
from durability.runtime.sendahead import Settled


@dataclass
class Change:
    """The state after a step: its bytes, its patch on the last committed state, and that
    state brought forward (proven to reproduce the bytes)."""

    data: bytes
    ops: list[dict]
    ops_bytes: bytes
    pristine: Any


def encode(live: Any, step: str) -> bytes:
    what = f"state after step {step!r}"
    try:
        return canonical.dumps(live, what=what)
    except StateNotJSON:
        canonical.check_json(live, what=what)  # names the path
        raise


def change(
    live: Any,
    pristine: Any,
    committed: bytes,
    step: str,
    *,
    agent: Any,
    secrets: set[str],
    max_state: int,
    run_id: Any,
    gate: Callable[[], Settled],
) -> Change:
    """The checked change a step made: large values moved to the blob store (after
    ``gate``: nothing leaves for a step that may be void), secrets redacted, size and schema
    checked, the patch proven."""
    if not isinstance(live, dict):
        raise SchemaViolation(
            f"step {step!r} left the state as {type(live).__name__}, not a JSON object",
            run_id=run_id,
        )
    data = encode(live, step)
    ops = diff.diff(pristine, live)
    limit = blobs.threshold()
    if any("value" in op and blobs.needs_offload(op["value"], limit) for op in ops):
        offload(gate(), live, limit)
        data = encode(live, step)
        ops = diff.diff(pristine, live)
    if redact_changes(ops, secrets):
        redact(live, secrets)
        data = canonical.dumps(live, what=f"state after step {step!r}")
        ops = diff.diff(pristine, live)
    if secrets and contains_secret(data, secrets):
        # Only a key can still hold one: keys are not redacted, and the gate would change
        # these bytes after they were hashed.
        raise StepError(
            f"step {step!r} put a secret read with ctx.secret in a key of the state;"
            " keys are never redacted: keep secrets out of state",
            run_id=run_id,
        )
    if len(data) > max_state:
        raise StateTooLarge(
            f"state after step {step!r} is {len(data):,} bytes, over the limit of"
            f" {max_state:,} (DURABILITY_MAX_STATE_BYTES)",
            run_id=run_id,
        )
    agent.validate(live)
    return proven(pristine, committed, live, data, ops, step, run_id)


def offload(proof: Settled, live: dict, limit: int) -> None:
    """Large values to the blob store, before the checkpoint that refers to them."""
    blobs.offload(live, limit)


def redact_changes(ops: list[dict], secrets: set[str]) -> bool:
    """Redact secrets inside the changed values; True if the live state itself must be
    redacted too (a secret-looking key was set, or a scalar held a secret)."""
    whole = False
    for op in ops:
        if "value" not in op:
            continue
        value = op["value"]
        canonical.check_json(value, what="state", path=op["path"])
        last = op["path"].rsplit("/", 1)[-1]
        if last and is_secret_key(diff.unescape(last)):
            whole = True
            continue
        if type(value) in (dict, list):
            _, changed = redact(value, secrets)  # in place, so ``live`` too
            whole = whole or changed
        elif type(value) is str and secrets:
            whole = whole or any(s in value for s in secrets)
    return whole


def proven(
    pristine: Any, committed: bytes, live: Any, data: bytes, ops: list[dict], step: str, run_id: Any
) -> Change:
    """The patch, applied to a copy of the last committed state, reproduces ``data`` byte for
    byte; the fast walk missed a change of number type (1 -> 1.0 -> True): diff exactly."""
    ops_bytes = canonical.dumps(ops)
    after = diff.apply_own(pristine, canonical.loads(ops_bytes))
    if canonical.dumps(after) != data:
        before = canonical.loads(committed)
        ops = diff.diff(before, live, strict=True)
        ops_bytes = canonical.dumps(ops)
        # Proven with the function rehydration rebuilds with.
        after = diff.apply_own(before, canonical.loads(ops_bytes))
        if canonical.dumps(after) != data:  # pragma: no cover - a bug if reached
            raise IntegrityViolation(
                f"the patch of step {step!r} does not reproduce its state", run_id=run_id
            )
    return Change(data=data, ops=ops, ops_bytes=ops_bytes, pristine=after)


@dataclass
class Planned:
    """The commit of one step and the head it makes."""

    commit: StepCommit
    head: Head
    snapshot_now: bool  # the policy asks for a snapshot of this checkpoint
    inline: bool  # written in the commit itself


def plan(
    ex: Any,
    change: Change,
    step: str,
    next_step: str,
    replay: tuple[int, str] | None,
    replayed: list[list] | None,
) -> Planned:
    """The checkpoint statement's contents: hashes, chain, snapshot policy. ``ex``: the
    execution (its head, agent, run and what it keeps across steps)."""
    agent, head = ex.agent, ex.head
    state_hash = canonical.patched(head.state_hash, change.ops_bytes)
    seq = head.seq + 1
    chain = checkpoints.link(
        head.chain_hash,
        state_hash,
        run_id=ex.run_id,
        seq=seq,
        step=step,
        next_step=next_step,
        schema_version=agent.schema_version,
        agent_version=agent.version,
    )
    size, upgraded = len(change.data), ex.upgraded_from
    delta_run = head.delta_run + len(change.ops_bytes)
    snapshot_now = upgraded is not None or checkpoints.needs_snapshot(
        delta_run, size, head.deltas + 1
    )
    inline = snapshot_now and (upgraded is not None or size <= checkpoints.INLINE_SNAPSHOT_BYTES)
    commit = StepCommit(
        run_id=ex.run_id,
        token=ex.token,
        head=head,
        worker=ex.worker,
        step=step,
        next_step=next_step,
        ops_bytes=change.ops_bytes,
        ops_count=len(change.ops),
        state_hash=state_hash,
        chain_hash=chain,
        size=size,
        delta_run=delta_run,
        schema_version=agent.schema_version,
        agent_version=agent.version,
        commit_id=uuid.uuid4(),
        prev_commit_us=None,  # the commit in flight's, known once it is answered
        lease_seconds=leases.lease_seconds(),
        upgraded_from=upgraded,
        snapshot=change.data if inline else None,
        snapshot_digest=checkpoints.seal(state_hash, change.data) if inline else "",
        durability=ex.row.durability,
        config_hash=ex.fingerprint[0],
        packages=ex.fingerprint[1],
        replay_base_id=replay[0] if replay else None,
        replay_counters=replay[1] if replay else "",
        outcome="" if next_step else ex.ending,
        replayed=replayed,
    )
    return Planned(commit, _head_of(commit, snapshot_now), snapshot_now, inline)


def _head_of(commit: StepCommit, snapshot_now: bool) -> Head:
    """The head ``commit`` makes; its id is known once the commit is answered."""
    return Head(
        id=None,
        seq=commit.head.seq + 1,
        chain_hash=commit.chain_hash,
        state_hash=commit.state_hash,
        size=commit.size,
        delta_run=0 if snapshot_now else commit.delta_run,
        deltas=0 if snapshot_now else commit.head.deltas + 1,
        schema_version=commit.schema_version,
        agent_version=commit.agent_version,
        step=commit.step,
        next_step=commit.next_step,
    )
