"""Retention and compaction, per agent, run by beat (and ``durability prune``).

- A finished run is deleted ``keep_days`` after it ended (its checkpoints, journal, effects,
  approvals, messages and timeline with it; its operators' actions stay in the audit log,
  ``durability.deletion``).
- With ``keep_checkpoints="snapshots"``, a finished run's checkpoints older than
  ``compact_after_days`` that carry no snapshot and are the identity of no effect,
  approval, consumed message, child run or replay are removed; the first checkpoint kept after
  each removed stretch gets a snapshot of its own and remembers its removed parent's chain
  hash, so that every checkpoint left rebuilds to exactly the state it did before and still
  verifies. A run is verified before (a run that does not verify is left alone) and after
  (in the same transaction: a compaction that would break anything is rolled back).

Nothing here touches a run that is queued, running or waiting, a run on legal hold, or a
run whose parent or children are still going.

Then the blob store: a blob that no state, input, journaled result, effect, approval or
message refers to any more, and that was last stored more than
``DURABILITY_BLOB_GC_GRACE_SECONDS`` ago (a day by default; longer than any step, since a
step stores its blobs before its checkpoint commits), is deleted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from durability import blobs, checkpoints, events
from durability.agents import registry
from durability.conf import conf
from durability.deletion import delete_runs
from durability.errors import IntegrityViolation
from durability.integrity import verify_run
from durability.models import (
    FINISHED,
    Approval,
    Checkpoint,
    Effect,
    JournalEntry,
    Message,
    Mutation,
    Run,
    Snapshot,
)
from durability.store import store
from durability.store.base import write_snapshot


@dataclass
class PruneReport:
    dry_run: bool
    runs_deleted: list[str] = field(default_factory=list)
    compacted: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    blobs_deleted: list[str] = field(default_factory=list)
    blobs_note: str = ""

    def lines(self) -> list[str]:
        # What a dry run would do, or what was done.
        delete, compact = (
            ("would delete", "would compact") if self.dry_run else ("deleted", "compacted")
        )
        out = [f"{delete} run {r}" for r in self.runs_deleted]
        out += [f"{compact} run {r}: {n} checkpoint(s) removed" for r, n in self.compacted.items()]
        out += [f"left run {r} alone: {why}" for r, why in self.skipped.items()]
        out += [f"{delete} blob {d} (nothing refers to it)" for d in self.blobs_deleted]
        if self.blobs_note:
            out.append(f"left the blob store alone: {self.blobs_note}")
        return out


def _prunable() -> Q:
    return Q(status__in=FINISHED, legal_hold=False)


def _family_done(run: Run) -> bool:
    if (
        run.parent_run_id
        and not Run.objects.filter(pk=run.parent_run_id, status__in=FINISHED).exists()
    ):
        return False
    return not Run.objects.filter(parent_run=run).exclude(status__in=FINISHED).exists()


def prune(*, dry_run: bool = False, now: Any = None, limit: int = 1000) -> PruneReport:
    now = now or timezone.now()
    report = PruneReport(dry_run=dry_run)
    for agent in registry.all():
        if agent.keep_days is not None:
            cutoff = now - timedelta(days=agent.keep_days)
            old = Run.objects.filter(_prunable(), agent=agent.name, finished_at__lt=cutoff)
            for run in old.order_by("finished_at")[:limit]:
                if not _family_done(run):
                    report.skipped[str(run.id)] = "a parent or child run is still going"
                    continue
                run_id = str(run.id)  # a deleted instance forgets its id
                if not dry_run and not _delete(run, agent.keep_days):
                    report.skipped[run_id] = CHANGED
                    continue
                report.runs_deleted.append(run_id)
        if agent.keep_checkpoints == "snapshots":
            cutoff = now - timedelta(days=agent.compact_after_days)
            candidates = Run.objects.filter(_prunable(), agent=agent.name).exclude(
                pk__in=report.runs_deleted
            )
            for run in candidates[:limit]:
                removable = _removable(run, cutoff)
                if not removable:
                    continue
                if not verify_run(run.id).ok:
                    report.skipped[str(run.id)] = "it does not verify; compaction would hide that"
                    continue
                if not dry_run and not _compact(run, removable):
                    report.skipped[str(run.id)] = CHANGED
                    continue
                report.compacted[str(run.id)] = len(removable)
    collect_blobs(report, now=now)
    return report


# Every column that may hold canonical JSON with a blob reference in it.
_HOLDERS = (
    (Snapshot, "state"),
    (Mutation, "ops"),
    (Run, "input"),
    (JournalEntry, "result"),
    (Effect, "args"),
    (Effect, "result"),
    (Approval, "payload"),
    (Approval, "edited_payload"),
    (Message, "data"),
)
_REF = re.compile(r'"\$blob":"([0-9a-f]{64})"')


def referenced_blobs() -> set[str]:
    """The digests that some row refers to (canonical JSON writes a reference's ``$blob``
    key first and without spaces, so one pattern finds them all)."""
    found: set[str] = set()
    for model, column in _HOLDERS:
        found |= store().blob_references(model, column, _REF)
    return found


def collect_blobs(report: PruneReport, *, now: Any) -> None:
    ok, why = blobs.collectable_here()
    if not ok:
        report.blobs_note = why
        return
    grace = timedelta(seconds=conf.BLOB_GC_GRACE_SECONDS)
    # Listed before the references are read: a blob stored after the listing is not a
    # candidate, and one referenced before the reading is kept.
    candidates = [d for d, at in blobs.stored() if at is not None and at < now - grace]
    if not candidates:
        return
    live = referenced_blobs()
    for digest in candidates:
        if digest in live:
            continue
        if report.dry_run or blobs.delete_if_older(digest, now - grace):
            report.blobs_deleted.append(digest)


CHANGED = "an operator acted on it while it was being pruned (a rollback, a resume)"


def _still_as_decided(run: Run, tree: list[Any]) -> bool:
    """Lock the runs prune is about to change and check that none moved since it decided.

    An operator's rollback or resume makes a finished run active again and moves its head;
    it locks the run row first, and so does this: the two never interleave. (Nothing else
    would stop them: a rollback's new head may name a checkpoint compaction is removing.)"""
    locked = {r.id: r for r in Run.objects.select_for_update().filter(pk__in=tree).order_by("id")}
    current = locked.get(run.id)
    if current is None or current.head_seq != run.head_seq:
        return False
    return all(r.status in FINISHED and not r.legal_hold for r in locked.values())


# Who the audit log says deleted a run that retention deleted.
RETENTION = "retention"


def _delete(run: Run, keep_days: float) -> bool:
    """Delete a run and its children; False if one of them changed since prune chose it."""
    with transaction.atomic():
        tree, frontier = [run.id], [run.id]
        while frontier:  # child runs go with their parent
            frontier = list(
                Run.objects.filter(parent_run_id__in=frontier).values_list("id", flat=True)
            )
            tree.extend(frontier)
        if not _still_as_decided(run, tree):
            return False
        why = f"finished more than {keep_days:g} days ago (the agent's keep_days)"
        delete_runs(tree, by=RETENTION, reason=why)
    return True


def _removable(run: Run, cutoff: Any) -> list[int]:
    """Checkpoint ids that compaction may remove: older than the cutoff, not the head, no
    snapshot of their own, and not the identity of a record that must outlive it: an effect
    (what was done, and under which idempotency key), an approval (who decided), a message
    (consumed there, so a resume or a rollback does not deliver it again), a child run, or an
    interrupted step's replay. Journaled calls go with their checkpoint: a run re-executes
    only from its head, which stays."""
    kept = set(Snapshot.objects.filter(checkpoint__run=run).values_list("checkpoint_id", flat=True))
    kept |= set(Effect.objects.filter(run=run).values_list("base_id", flat=True))
    kept |= set(Approval.objects.filter(run=run).values_list("base_id", flat=True))
    kept |= set(
        Message.objects.filter(run=run)
        .exclude(consumed_base=None)
        .values_list("consumed_base_id", flat=True)
    )
    kept |= set(
        Checkpoint.objects.filter(run=run)
        .exclude(replay_base=None)
        .values_list("replay_base_id", flat=True)
    )
    kept |= set(
        Run.objects.filter(parent_run=run)
        .exclude(spawn_base=None)
        .values_list("spawn_base_id", flat=True)
    )
    return [
        cp_id
        for cp_id, seq in Checkpoint.objects.filter(run=run, created_at__lt=cutoff)
        .order_by("seq")
        .values_list("id", "seq")
        if seq != run.head_seq and cp_id not in kept
    ]


def _compact(run: Run, removable: list[int]) -> bool:
    """Remove ``removable``; False (nothing done) if the run changed since they were chosen."""
    gone = set(removable)
    with transaction.atomic():
        if not _still_as_decided(run, [run.id]):
            return False
        cps = {cp.id: cp for cp in Checkpoint.objects.filter(run=run)}
        survivors = [cp for cp in cps.values() if cp.id not in gone]
        # A survivor whose parent goes: snapshot it and link it to the nearest survivor up.
        for cp in survivors:
            if cp.parent_id not in gone:
                continue
            if not Snapshot.objects.filter(checkpoint=cp).exists():
                state, data, _ = checkpoints.verified_state(cp)
                write_snapshot(
                    cp.id,
                    cp.run_id,
                    cp.seq,
                    state=data.decode(),
                    digest=checkpoints.seal(cp.state_hash, data),
                )
            parent = cps[cp.parent_id]
            parent_chain = cp.parent_chain or parent.chain_hash
            parent_state = cp.parent_state if cp.parent_chain else parent.state_hash
            ancestor: Checkpoint | None = parent
            while ancestor is not None and ancestor.id in gone:
                ancestor = cps.get(ancestor.parent_id) if ancestor.parent_id else None
            Checkpoint.objects.filter(pk=cp.pk).update(
                parent=ancestor, parent_chain=parent_chain, parent_state=parent_state
            )
        Checkpoint.objects.filter(pk__in=gone).update(parent=None)
        Mutation.objects.filter(checkpoint_id__in=gone).delete()
        Checkpoint.objects.filter(pk__in=gone).delete()
        report = verify_run(run.id)
        if report.first_bad is not None:
            raise IntegrityViolation(
                f"compaction would break checkpoint #{report.first_bad[0]}: rolled back",
                run_id=run.id,
            )
        events.record(events.compacted(run, removed=len(gone)))
    return True


def hold(
    ref: Any,
    *,
    on: bool = True,
    by: str = "",
    reason: str = "",
    expected_version: int | None = None,
) -> Run:
    """Put a run on legal hold (never pruned or compacted) or release it. The run's version
    stays as it is: the hold is no transition, and a worker executing the run keeps its
    lease. ``expected_version``: refused (``Stale``) if the run moved on since."""
    from durability.operations._runs import _check_version, _locked

    with transaction.atomic():
        run = _locked(ref)
        _check_version(run, expected_version)
        if run.legal_hold == on:
            return run  # a repeat: nothing changes, and the audit log says nothing happened
        Run.objects.filter(pk=run.pk).update(legal_hold=on)
        run.legal_hold = on
        events.record(events.legal_hold(run, by=by, reason=reason, on=on))
    return run
