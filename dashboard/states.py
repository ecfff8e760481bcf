"""Reading runs and checkpoint states for the pages, with the engine's integrity check.

A state is rebuilt and verified against its hashes before it is shown: a tampered or
corrupted checkpoint is named, never displayed as if it were true."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.http import Http404

from dashboard.params import ID_MAX, INT_MAX, shown
from durability import canonical, checkpoints, diff, operations
from durability.errors import IntegrityViolation, InvalidInput
from durability.langgraph import describe
from durability.models import Approval, Checkpoint, Mutation, Run


def run_or_404(ref: Any) -> Run:
    try:
        return operations.get_run(ref)
    except InvalidInput as exc:
        raise Http404(shown(exc.message, 200)) from None


def checkpoint_or_404(run: Run, seq: Any) -> Checkpoint:
    text = str(seq).strip()
    try:
        if not text.lstrip("-").isdigit() or len(text) > 1000:
            raise ValueError(text)
        number = int(text)
    except (TypeError, ValueError):
        raise Http404(
            f"run {run.short_id} has no checkpoint “{shown(seq)}”: that is not a checkpoint number"
        ) from None
    # A number past the column's range names nothing (and the database would refuse it).
    cp = None
    if 0 <= number <= INT_MAX:
        cp = Checkpoint.objects.filter(run=run, seq=number).select_related("parent").first()
    if cp is None:
        raise Http404(
            f"run {run.short_id} has no checkpoint #{shown(number)}"
            f" (its checkpoints are #0 to #{run.head_seq})"
        )
    return cp


def approval_or_404(pk: Any) -> Approval:
    approval = None
    if 0 < int(pk) <= ID_MAX:
        approval = Approval.objects.select_related("run", "base").filter(pk=pk).first()
    if approval is None:
        raise Http404(f"there is no approval {pk}")
    return approval


@dataclass
class Loaded:
    checkpoint: Checkpoint
    state: Any = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def load(cp: Checkpoint) -> Loaded:
    """The verified state of a checkpoint, or the integrity error that refuses it."""
    try:
        state, _, _ = checkpoints.verified_state(cp)
    except IntegrityViolation as exc:
        return Loaded(cp, error=str(exc))
    return Loaded(cp, _for_people(cp, state))


def _for_people(cp: Checkpoint, state: Any) -> Any:
    """A LangGraph checkpoint's state with the values LangGraph serialised (messages,
    interrupts) decoded to readable JSON; any other state as it is."""
    return describe.readable(state) if describe.is_graph_state(cp) else state


def load_pair(older: Checkpoint, newer: Checkpoint) -> tuple[Loaded, Loaded]:
    """Two checkpoints' verified states. When ``newer`` is the child of ``older`` (a diff
    with the previous checkpoint), the child is made from the parent's state and its own
    patch instead of a second rebuild from the snapshot, then checked against its state and
    chain hashes like any rebuild; anything that does not check out goes the engine's way,
    which names the checkpoint at fault."""
    try:
        old_state, data, _ = checkpoints.verified_state(older)
    except IntegrityViolation as exc:
        return Loaded(older, error=str(exc)), load(newer)
    first = Loaded(older, _for_people(older, old_state))
    if newer.parent_id != older.id:
        return first, load(newer)
    try:
        ops = Mutation.objects.filter(checkpoint=newer).values_list("ops", flat=True).first()
        # A second copy from the verified bytes: patching must not touch the older state.
        state = diff.apply_own(canonical.loads(data), canonical.loads(ops or "[]"))
        same_state = canonical.patched(older.state_hash, (ops or "[]").encode()) == (
            newer.state_hash
        )
        same_chain = checkpoints.chain_of(newer, older.chain_hash) == newer.chain_hash
    except Exception:  # a patch that does not apply: let the engine say why
        return first, load(newer)
    if not (same_state and same_chain):
        return first, load(newer)
    return first, Loaded(newer, _for_people(newer, state))


def previous_of(run: Run, cp: Checkpoint) -> tuple[Run, int] | None:
    """What "the previous checkpoint" means for a diff: the one before in the same run, or
    for the first checkpoint of a fork, the checkpoint it was forked from."""
    if cp.seq > 0:
        return run, cp.seq - 1
    if run.forked_from_id and run.forked_from_seq is not None:
        source = Run.objects.filter(pk=run.forked_from_id).first()
        if source is not None:
            return source, run.forked_from_seq
    return None
