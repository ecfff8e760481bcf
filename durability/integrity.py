"""``verify``: walk a run's checkpoints, rebuild each state and recompute both hashes.

The first checkpoint whose bytes do not match is named, with why. A snapshot is checked
against its own hash and against the state its parent's patches produce, so a corrupted
snapshot and a corrupted patch are both found.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from durability import canonical, diff
from durability.checkpoints import chain_of
from durability.models import Checkpoint, Mutation, Snapshot


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
        if self.ok:
            return f"run {self.run_id}: {self.checked} checkpoints verify"
        seq, why = self.first_bad  # type: ignore[misc]
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
    states: dict[int, tuple[Any, str]] = {}
    for cp in checkpoints:
        report.checked += 1
        shared = bool(cp.parent_id) and children.get(cp.parent_id, 0) > 1
        problem, state, chain = _check(cp, states, ops_of, snapshot_ids, shared)
        if problem:
            report.problems.append((cp.seq, problem))
            if report.first_bad is None:
                report.first_bad = (cp.seq, problem)
        if cp.parent_id and cp.parent_id in states:
            children[cp.parent_id] -= 1
            if children[cp.parent_id] <= 0:
                states.pop(cp.parent_id, None)
        if state is not None and children.get(cp.id):
            states[cp.id] = (state, chain)
    return report


def _check(
    cp: Checkpoint,
    states: dict[int, tuple[Any, str]],
    ops_of: dict[int, str],
    snapshot_ids: set[int],
    shared: bool,
) -> tuple[str, Any, str]:
    """Returns (problem or "", the verified state or None, the recomputed chain hash)."""
    # A compacted checkpoint's patch was made on a parent that is gone: its snapshot is it.
    parent = states.get(cp.parent_id) if cp.parent_id and not cp.parent_chain else None
    from_parent = None
    if parent is not None:
        text = ops_of.get(cp.id)
        if text is None:
            return "its mutation log is missing", None, ""
        try:
            base = parent[0]
            if shared:  # the parent's state serves another child too (after a rollback)
                base = canonical.loads(canonical.dumps(base))
            from_parent = diff.apply(base, canonical.loads(text))
        except Exception as exc:
            return f"its patch does not apply ({type(exc).__name__}: {exc})", None, ""
    snapshot_state = None
    if cp.id in snapshot_ids:
        raw = Snapshot.objects.filter(checkpoint_id=cp.id).values_list("state", flat=True).first()
        try:
            data = raw.encode()
            if canonical.sha256_hex(data) != cp.state_hash:
                return "its snapshot does not match its state hash", None, ""
            snapshot_state = canonical.loads(data)
        except Exception as exc:
            return f"its snapshot does not parse ({type(exc).__name__})", None, ""
    state = from_parent if from_parent is not None else snapshot_state
    if state is None:
        return "its parent could not be verified, so neither can it", None, ""
    if from_parent is not None and canonical.sha256_hex(canonical.dumps(from_parent)) != (
        cp.state_hash
    ):
        return "the state its patch produces does not match its state hash", None, ""
    parent_chain = parent[1] if parent is not None else ""
    if cp.parent_chain:
        parent_chain = cp.parent_chain
    elif cp.parent_id and parent is None:
        # Verifying from the middle (``upto``) or after an earlier failure: trust nothing
        # above, but the row's own link can still be checked against its stored parent.
        parent_chain = cp.parent.chain_hash
    chain = chain_of(cp, parent_chain)
    if chain != cp.chain_hash:
        return "its chain hash does not match its contents", None, ""
    return "", state, chain
