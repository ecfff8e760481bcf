"""``verify``: walk a run's checkpoints and check every stored byte against the hashes.

Each checkpoint is checked against what it was made from:

- stored as a patch on its parent: its state hash must be the parent's chained with the
  patch's bytes (``canonical.patched``), and the patch must apply;
- stored whole (a start, a fork): its state hash must be its snapshot's SHA-256;
- a snapshot must match its digest (``canonical.seal``), and where the parent's state and
  the patch also give the state, the two must be the same bytes, so a snapshot that drifted
  from its history is found even where its digest was recomputed;
- its chain hash must link its contents to its parent's chain hash.

The first checkpoint that does not verify is named, with why.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from durability import canonical, diff
from durability.checkpoints import chain_of, seal
from durability.models import Checkpoint, Mutation, Snapshot


class Verified(NamedTuple):
    state: Any
    chain: str
    state_hash: str


@dataclass
class Report:
    run_id: Any
    checked: int = 0
    first_bad: tuple[int, str] | None = None
    problems: list[tuple[int, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.first_bad is None

    def __str__(self) -> str:
        if self.first_bad is None:
            return f"run {self.run_id}: {self.checked} checkpoints verify"
        seq, why = self.first_bad
        return f"run {self.run_id}: checkpoint #{seq} does not verify: {why}"


def verify_run(run_id: Any, *, upto: int | None = None) -> Report:
    report = Report(run_id=run_id)
    rows = Checkpoint.objects.filter(run_id=run_id).order_by("seq")
    if upto is not None:
        rows = rows.filter(seq__lte=upto)
    checkpoints = list(rows)
    children = Counter(cp.parent_id for cp in checkpoints if cp.parent_id)
    ops_of = dict(
        Mutation.objects.filter(checkpoint__run_id=run_id).values_list("checkpoint_id", "ops")
    )
    snapshot_ids = set(
        Snapshot.objects.filter(checkpoint__run_id=run_id).values_list("checkpoint_id", flat=True)
    )
    # States still needed by a later child; a linear run keeps only one in memory.
    states: dict[int, Verified] = {}
    for cp in checkpoints:
        report.checked += 1
        shared = cp.parent_id is not None and children.get(cp.parent_id, 0) > 1
        problem, verified = _check(cp, states, ops_of, snapshot_ids, shared)
        if problem:
            report.problems.append((cp.seq, problem))
            if report.first_bad is None:
                report.first_bad = (cp.seq, problem)
        if cp.parent_id and cp.parent_id in states:
            children[cp.parent_id] -= 1
            if children[cp.parent_id] <= 0:
                states.pop(cp.parent_id, None)
        if verified is not None and children.get(cp.id):
            states[cp.id] = verified
    return report


def _check(
    cp: Checkpoint,
    states: dict[int, Verified],
    ops_of: dict[int, str],
    snapshot_ids: set[int],
    shared: bool,
) -> tuple[str, Verified | None]:
    """Returns (the problem or "", what later checkpoints may build on)."""
    # A compacted checkpoint's patch was made on a parent that is gone: its snapshot is it.
    # Its recorded parent chain is then the gone parent's, never its present parent's: one
    # that names its present parent's chain claims a compaction that did not happen, and
    # its patch is checked like any other.
    verified_parent = states.get(cp.parent_id) if cp.parent_id else None
    compacted = bool(cp.parent_chain) and (
        verified_parent is None or verified_parent.chain != cp.parent_chain
    )
    parent = verified_parent if not compacted else None
    problem, from_parent = "", None
    if compacted and cp.parent_state:
        problem = _patch_of_gone_parent(cp, ops_of)
    if parent is not None and not problem:
        problem, from_parent = _patched(cp, parent, ops_of.get(cp.id), shared)
    snapshot_state = None
    if cp.id in snapshot_ids and not problem:
        problem, snapshot_state = _snapshot(cp, from_parent)
    if problem:
        return problem, None
    state = from_parent if from_parent is not None else snapshot_state
    if state is None:
        if cp.parent_id and not compacted:
            return "its parent could not be verified, so neither can it", None
        return "it has no snapshot to rebuild it from", None
    chain = chain_of(cp, _parent_chain(cp, compacted, parent))
    if chain != cp.chain_hash:
        return "its chain hash does not match its contents", None
    return "", Verified(state, chain, cp.state_hash)


def _patch_of_gone_parent(cp: Checkpoint, ops_of: dict[int, str]) -> str:
    # The gone parent's state hash was kept: the patch, the audit trail of this step, is
    # still checked against this checkpoint's state hash.
    text = ops_of.get(cp.id)
    if text is None:
        return "its mutation log is missing"
    if canonical.patched(cp.parent_state, text.encode()) != cp.state_hash:
        return "its state hash does not follow from its gone parent's and its patch"
    return ""


def _patched(cp: Checkpoint, parent: Verified, text: str | None, shared: bool) -> tuple[str, Any]:
    """(problem or "", the state the checkpoint's patch makes of its verified parent's)."""
    if text is None:
        return "its mutation log is missing", None
    if canonical.patched(parent.state_hash, text.encode()) != cp.state_hash:
        return "its state hash does not follow from its parent's and its patch", None
    try:
        base = parent.state
        if shared:  # the parent's state serves another child too (after a rollback)
            base = canonical.loads(canonical.dumps(base))
        return "", diff.apply(base, canonical.loads(text))
    except Exception as exc:
        return f"its patch does not apply ({type(exc).__name__}: {exc})", None


def _snapshot(cp: Checkpoint, from_parent: Any) -> tuple[str, Any]:
    """(problem or "", the checkpoint's state as its snapshot holds it)."""
    raw, digest = Snapshot.objects.filter(checkpoint_id=cp.id).values_list("state", "digest")[0]
    data = raw.encode()
    if not cp.parent_id and canonical.sha256_hex(data) != cp.state_hash:
        return "its snapshot does not match its state hash", None
    if seal(cp.state_hash, data) != digest:
        if canonical.sha256_hex(data) == cp.state_hash:
            # Its content is the state its hash names: the seal, not the state, differs.
            return (
                "its snapshot does not match its digest, although its content matches its"
                " state hash: it was sealed with another DURABILITY_HMAC_KEY (a database"
                " restored elsewhere needs the key it was written with)"
            ), None
        return "its snapshot does not match its digest", None
    try:
        state = canonical.loads(data)
    except Exception as exc:
        return f"its snapshot does not parse ({type(exc).__name__})", None
    if from_parent is not None and canonical.dumps(from_parent) != data:
        return "its snapshot differs from the state its patch produces", None
    return "", state


def _parent_chain(cp: Checkpoint, compacted: bool, parent: Verified | None) -> str:
    if compacted:
        return cp.parent_chain
    if parent is not None:
        return parent.chain
    if cp.parent is not None:
        # After an earlier failure: trust nothing above, but the row's own link can still
        # be checked against its stored parent.
        return cp.parent.chain_hash
    return ""
