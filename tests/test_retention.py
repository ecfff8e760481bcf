"""Retention and compaction: old finished runs go, old deltas fold into snapshots, and
nothing waiting, running or on hold is touched; every state a checkpoint rebuilds to is
the same before and after."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from durability import END, Agent, Retention, checkpoints, operations, registry
from durability.models import Checkpoint, Run, RunStatus, Snapshot
from durability.retention import hold, prune
from durability.testing import drive

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def agents():
    for name in ("x-keep", "x-compact", "x-compact-effects"):
        registry.unregister(name)
    keep = Agent("x-keep", retention=Retention(keep_days=30), initial_state=lambda inp: {"n": 0})

    @keep.step(start=True)
    def once(state, ctx):
        if ctx.input.get("wait"):
            ctx.approval("go", {})
        state["n"] = 1
        return END

    compact = Agent(
        "x-compact",
        retention=Retention(keep_checkpoints="snapshots", compact_after_days=7),
        initial_state=lambda inp: {"log": [], "n": 0},
    )

    @compact.step(start=True)
    def grow(state, ctx):
        state["n"] += 1
        state["log"].append("x" * 200)  # patches stay smaller than the state: deltas pile up
        return "grow" if state["n"] < 30 else END

    effects = Agent(
        "x-compact-effects",
        retention=Retention(keep_checkpoints="snapshots", compact_after_days=7),
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
    hold(old.id, by="legal", reason="a claim")
    hold(old.id, on=False, by="legal", reason="settled")
    report = prune()
    assert report.runs_deleted == [str(old.id)]
    assert not Run.objects.filter(pk=old.id).exists()
    # Its operators' actions outlive it in the audit log, with who deleted it and why; its
    # other rows (checkpoints, its timeline) went with it.
    from durability.models import Event

    kept = Event.objects.filter(run_id=old.id).order_by("id")
    assert [(e.kind, e.actor) for e in kept] == [
        ("hold", "legal"),
        ("hold", "legal"),
        ("deleted", "retention"),
    ]
    assert "finished more than 30 days ago" in kept.last().reason
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


# --- an operator acting on a run while prune works on it -----------------------------------


def test_a_run_rolled_back_after_prune_chose_it_is_neither_compacted_nor_deleted():
    from durability import retention

    run = drive(operations.start("x-compact", {}).id)
    age(run.id, 40)
    chosen = Run.objects.get(pk=run.id)  # as prune read it
    removable = retention._removable(chosen, timezone.now() - timedelta(days=7))
    target = Checkpoint.objects.get(pk=removable[len(removable) // 2])
    operations.rollback(run.id, target.seq, by="op", reason="look again")
    assert retention._compact(chosen, removable) is False
    assert retention._delete(chosen, 30) is False
    run.refresh_from_db()
    head = Checkpoint.objects.get(run=run, seq=run.head_seq)
    assert head.parent_id == target.id and Checkpoint.objects.filter(pk=target.id).exists()
    assert operations.verify(run.id)[0].ok and operations.state_at(run.id)["n"] == target.seq


def test_a_rollback_waits_for_a_compaction_in_progress_and_never_names_a_removed_parent():
    """Compaction holds the run's row until it commits; a rollback to a checkpoint it removes
    then fails clearly instead of making a head whose parent is gone."""
    import threading

    from django.db import connection

    from bench.db import connect
    from durability import retention
    from durability.errors import UnknownCheckpoint
    from durability.testing import wait_until

    run = drive(operations.start("x-compact", {}).id)
    age(run.id, 40)
    chosen = Run.objects.get(pk=run.id)
    removable = retention._removable(chosen, timezone.now() - timedelta(days=7))
    target = Checkpoint.objects.get(pk=removable[len(removable) // 2])
    outcome: dict[str, object] = {}

    def in_thread(name, fn):
        def target_fn():
            try:
                outcome[name] = fn()
            except Exception as exc:
                outcome[name] = exc
            finally:
                connection.close()

        return threading.Thread(target=target_fn, name=name)

    url = "postgresql://{USER}@{HOST}:{PORT}/{NAME}".format(**connection.settings_dict)
    with connect(url) as holder, connect(url, autocommit=True) as watcher:
        # A real lock pauses compaction where it reads snapshots, with what it did so far
        # uncommitted and before it writes its event (whose run check would lock the run's
        # row on its own). Without compaction's lock on the run's row, the rollback would
        # take it here, link its new head to the target, and commit before the target goes.
        holder.execute("LOCK TABLE durability_snapshot IN ACCESS EXCLUSIVE MODE")
        compactor = in_thread("compactor", lambda: retention._compact(chosen, removable))
        compactor.start()
        wait_until(
            lambda: watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database()"
            ).fetchone()[0],
            timeout=10,
            what="compaction waiting for the snapshot table",
        )
        roller = in_thread("roller", lambda: operations.rollback(run.id, target.seq, by="op"))
        roller.start()
        roller.join(0.5)
        assert roller.is_alive()  # waiting for the run's row (or, without it, the table)
        holder.rollback()  # releases the table
    compactor.join(10)
    roller.join(10)
    assert outcome["compactor"] is True
    assert isinstance(outcome["roller"], UnknownCheckpoint)
    assert f"no checkpoint #{target.seq}" in str(outcome["roller"])
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED and operations.verify(run.id)[0].ok


def test_the_snapshot_thread_gives_a_removed_checkpoint_no_snapshot():
    checkpoints.store_snapshot(10**12, "0" * 64, b"{}")
    assert not Snapshot.objects.filter(checkpoint_id=10**12).exists()


def test_an_event_for_a_run_that_is_gone_is_refused():
    """Events carry no foreign key: the writers other than the step commit check the run."""
    from django.db import IntegrityError

    from durability.deletion import delete_runs
    from durability.models import Event, EventKind

    run = drive(operations.start("x-keep", {}).id)
    run_id = run.id
    delete_runs([run_id], by="ops", reason="test")
    kept = list(Event.objects.filter(run_id=run_id).values_list("kind", flat=True))
    assert kept == [EventKind.DELETED]  # the audit row of the deletion, nothing else
    with pytest.raises(IntegrityError, match="an event needs its run"):
        Event.objects.create(run_id=run_id, kind=EventKind.COMMIT_LATENCY, commit_us=5)
    with pytest.raises(IntegrityError, match=str(run_id)):
        Event.objects.bulk_create([Event(run_id=run_id, kind=EventKind.ALARM)])
    assert list(Event.objects.filter(run_id=run_id).values_list("kind", flat=True)) == kept
