"""Retention and compaction: old finished runs go, old deltas fold into snapshots, and
nothing waiting, running or on hold is touched; every state a checkpoint rebuilds to is
the same before and after."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from durability import END, Agent, checkpoints, operations, registry
from durability.models import Checkpoint, Run, RunStatus, Snapshot
from durability.retention import hold, prune
from durability.testing import drive

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def agents():
    for name in ("x-keep", "x-compact", "x-compact-effects"):
        registry.unregister(name)
    keep = Agent("x-keep", keep_days=30, initial_state=lambda inp: {"n": 0})

    @keep.step(start=True)
    def once(state, ctx):
        if ctx.input.get("wait"):
            ctx.approval("go", {})
        state["n"] = 1
        return END

    compact = Agent(
        "x-compact",
        keep_checkpoints="snapshots",
        compact_after_days=7,
        initial_state=lambda inp: {"log": [], "n": 0},
    )

    @compact.step(start=True)
    def grow(state, ctx):
        state["n"] += 1
        state["log"].append("x" * 200)  # patches stay smaller than the state: deltas pile up
        return "grow" if state["n"] < 30 else END

    effects = Agent(
        "x-compact-effects",
        keep_checkpoints="snapshots",
        compact_after_days=7,
        initial_state=lambda inp: {"log": [], "n": 0},
    )

    @effects.step(start=True)
    def work(state, ctx):
        state["n"] += 1
        state["log"].append("x" * 200)
        if state["n"] == 5:
            state["said"] = ctx.wait_for("note")
        if state["n"] == 10:
            state["paid"] = ctx.effect("pay", lambda *, idempotency_key: {"ok": True})
        return "work" if state["n"] < 30 else END


def age(run_id, days: float) -> None:
    past = timezone.now() - timedelta(days=days)
    Run.objects.filter(pk=run_id).update(finished_at=past, created_at=past)
    Checkpoint.objects.filter(run_id=run_id).update(created_at=past)


def test_old_finished_runs_are_deleted_but_not_waiting_or_held_ones():
    old = operations.start("x-keep", {})
    drive(old.id)
    held = operations.start("x-keep", {})
    drive(held.id)
    hold(held.id, by="legal", reason="litigation")
    waiting = operations.start("x-keep", {"wait": True})
    drive(waiting.id)
    recent = operations.start("x-keep", {})
    drive(recent.id)
    for run in (old, held, waiting):
        age(run.id, 40)
    dry = prune(dry_run=True)
    assert dry.runs_deleted == [str(old.id)]
    assert Run.objects.filter(pk=old.id).exists()  # a dry run removes nothing
    report = prune()
    assert report.runs_deleted == [str(old.id)]
    assert not Run.objects.filter(pk=old.id).exists()
    assert set(Run.objects.values_list("pk", flat=True)) == {held.id, waiting.id, recent.id}
    assert Run.objects.get(pk=waiting.id).status == RunStatus.WAITING


def test_compaction_keeps_every_remaining_state_and_the_chain():
    run = operations.start("x-compact", {})
    drive(run.id)
    before = {cp.seq: cp.state_hash for cp in Checkpoint.objects.filter(run=run)}
    assert operations.verify(run.id)[0].ok
    age(run.id, 10)
    dry = prune(dry_run=True)
    removed = dry.compacted[str(run.id)]
    assert removed > 10 and Checkpoint.objects.filter(run=run).count() == len(before)
    report = prune()
    assert report.compacted[str(run.id)] == removed
    left = list(Checkpoint.objects.filter(run=run).order_by("seq"))
    assert len(left) == len(before) - removed
    for cp in left:
        state, data, _ = checkpoints.verified_state(cp)
        assert cp.state_hash == before[cp.seq]
        assert checkpoints.rebuild(cp.id).snapshot_id is not None
    assert operations.verify(run.id)[0].ok
    head = Checkpoint.objects.get(run=run, seq=30)
    assert Snapshot.objects.filter(checkpoint=head).exists() and head.parent_chain
    assert head.state_hash == before[30]


def test_a_compacted_checkpoints_patch_is_still_checked():
    """Its parent is gone, but the parent's state hash was kept: the mutation log, the audit
    trail of that step, cannot be rewritten unnoticed."""
    from durability.integrity import verify_run
    from tests.tampering import rewrite

    run = operations.start("x-compact", {})
    drive(run.id)
    age(run.id, 10)
    prune()
    head = Checkpoint.objects.get(run=run, seq=30)
    assert head.parent_chain and head.parent_state
    rewrite("mutation", head.pk, "xxx", "yyy")
    assert verify_run(run.id).first_bad == (
        30,
        "its state hash does not follow from its gone parent's and its patch",
    )


def test_a_held_run_is_never_compacted():
    run = operations.start("x-compact", {})
    drive(run.id)
    hold(run.id, by="legal")
    age(run.id, 10)
    assert prune().compacted == {}
    hold(run.id, on=False, by="legal")
    assert str(run.id) in prune().compacted


def test_compaction_keeps_the_checkpoints_effects_and_messages_belong_to():
    """Removing them would delete the record of a payment (and cascade its effect row away)
    or hand a consumed message back to the inbox: a resume would pay or deliver again."""
    from durability.models import Effect, EffectStatus, Message

    run = operations.start("x-compact-effects", {})
    operations.send(run.id, "note", {"hi": 1}, by="t")
    assert drive(run.id).status == RunStatus.SUCCEEDED
    effect = Effect.objects.get(run=run)
    message = Message.objects.get(run=run)
    bases = {effect.base_id, message.consumed_base_id}
    age(run.id, 10)
    report = prune()
    assert report.compacted[str(run.id)] > 10
    assert set(Checkpoint.objects.filter(pk__in=bases).values_list("pk", flat=True)) == bases
    assert Effect.objects.get(pk=effect.pk).status == EffectStatus.DONE
    assert Message.objects.get(pk=message.pk).consumed_base_id == message.consumed_base_id
    assert operations.verify(run.id)[0].ok
