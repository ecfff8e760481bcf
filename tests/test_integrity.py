"""The state hash chained over patches, sealed snapshots, and what ``verify`` and
rehydration make of bytes changed in the database (and of the migration that re-seals
checkpoints written under the old rule)."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from durability import END, Agent, canonical, checkpoints, operations, registry
from durability.errors import FencedOut, IntegrityViolation, UnknownCheckpoint, UnknownRun
from durability.integrity import verify_run
from durability.models import Checkpoint, Event, Mutation, Run, RunStatus, Snapshot
from durability.testing import drive, state_of
from tests.tampering import rewrite

pytestmark = pytest.mark.django_db(transaction=True)

BIG = 70 * 1024  # over INLINE_SNAPSHOT_BYTES: the snapshot thread writes these states


@pytest.fixture(autouse=True)
def agents():
    registry.unregister("hash-grow")
    registry.unregister("hash-big")
    # The padding keeps the patches lighter than the state: no snapshot but the first.
    grow = Agent("hash-grow", initial_state=lambda inp: {"log": [], "n": 0, "pad": "p" * 5000})

    @grow.step(start=True)
    def add(state, ctx):
        state["n"] += 1
        state["log"].append(f"line {state['n']} " + "x" * 100)
        return "add" if state["n"] < int(ctx.input.get("n", 6)) else END

    big = Agent("hash-big", initial_state=lambda inp: {"blob": "b" * BIG, "n": 0, "log": []})

    @big.step(start=True)
    def churn(state, ctx):
        state["n"] += 1
        # Each patch is about a third of the state: a snapshot is due every few steps.
        state["log"] = [f"{state['n']}" + "y" * (BIG // 3)]
        return "churn" if state["n"] < 8 else END


def hashes(run):
    rows = Checkpoint.objects.filter(run=run).order_by("seq")
    return {cp.seq: cp for cp in rows}


def ops_of(cp) -> bytes:
    return Mutation.objects.get(checkpoint=cp).ops.encode()


def test_the_state_hash_follows_the_patches_from_the_starting_state():
    run = operations.start("hash-grow", {"n": 6})
    drive(run.id)
    cps = hashes(run)
    start = Snapshot.objects.get(checkpoint=cps[0]).state.encode()
    assert cps[0].state_hash == canonical.sha256_hex(start)
    for seq in range(1, 7):
        expected = canonical.patched(cps[seq - 1].state_hash, ops_of(cps[seq]))
        assert cps[seq].state_hash == expected
        # Not the whole state's hash: that would cost the state's size on every step.
        whole = canonical.sha256_hex(canonical.dumps(state_of(run.id, seq)))
        assert cps[seq].state_hash != whole
    assert verify_run(run.id).ok


def test_a_rollback_keeps_its_targets_state_hash_and_verifies():
    run = operations.start("hash-grow", {"n": 4})
    drive(run.id)
    operations.rollback(run.id, 2, by="op", reason="try again", and_continue=True)
    cps = hashes(run)
    assert cps[5].state_hash == cps[2].state_hash and ops_of(cps[5]) == b"[]"
    drive(run.id)
    assert verify_run(run.id).ok
    assert state_of(run.id) == state_of(run.id, 4)


def test_a_snapshot_written_off_the_step_path_is_sealed_and_rebuilds_verify():
    run = operations.start("hash-big", {})
    drive(run.id)
    snapped = Snapshot.objects.filter(checkpoint__run=run, checkpoint__seq__gt=0)
    assert snapped.exists()  # the policy asked for some, and the thread wrote them
    for snap in snapped.select_related("checkpoint"):
        cp = snap.checkpoint
        assert snap.digest == checkpoints.seal(cp.state_hash, snap.state.encode())
        state, data, rebuilt = checkpoints.verified_state(cp)
        assert rebuilt.snapshot_id == cp.id and data == snap.state.encode()
    head = Checkpoint.objects.get(run=run, seq=8)
    state, _, rebuilt = checkpoints.verified_state(head)
    assert state["n"] == 8 and verify_run(run.id).ok


def corrupt_snapshot(run) -> Checkpoint:
    """Change the snapshot the run's head is rebuilt from (one the thread wrote)."""
    head = Checkpoint.objects.get(run=run, seq=run.head_seq)
    snap = Snapshot.objects.select_related("checkpoint").get(
        checkpoint_id=checkpoints.rebuild(head.id).snapshot_id
    )
    assert snap.checkpoint.seq > 0
    rewrite("snapshot", snap.checkpoint_id, '"n":', '"N":')
    return snap.checkpoint


def test_a_changed_snapshot_is_named_and_never_rehydrated():
    run = drive(operations.start("hash-big", {}).id)
    bad = corrupt_snapshot(run)
    report = verify_run(run.id)
    assert report.first_bad == (bad.seq, "its snapshot does not match its digest")
    # Rehydrating anything rebuilt from that snapshot names it, and nothing runs.
    Run.objects.filter(pk=run.id).update(status=RunStatus.FAILED)
    with pytest.raises(IntegrityViolation) as err:
        operations.resume(run.id)
    assert f"checkpoint #{bad.seq} does not verify" in str(err.value)
    assert Run.objects.get(pk=run.id).status == RunStatus.FAILED


def test_a_snapshot_forged_with_its_digest_still_differs_from_its_history(settings):
    """Without the HMAC key anyone with the database can recompute a digest; the
    snapshot still has to be the state its parent and its patch give."""
    run = drive(operations.start("hash-big", {}).id)
    bad = corrupt_snapshot(run)
    forged = Snapshot.objects.get(checkpoint=bad)
    forged.digest = checkpoints.seal(bad.state_hash, forged.state.encode())
    forged.save(update_fields=["digest"])
    report = verify_run(run.id)
    assert report.first_bad == (bad.seq, "its snapshot differs from the state its patch produces")


def test_with_the_hmac_key_a_recomputed_digest_does_not_pass(settings):
    settings.DURABILITY_HMAC_KEY = "kept-outside-the-database"
    run = drive(operations.start("hash-big", {}).id)
    assert verify_run(run.id).ok
    bad = corrupt_snapshot(run)
    forged = Snapshot.objects.get(checkpoint=bad)
    # What someone without the key can compute:
    forged.digest = canonical.seal(bad.state_hash, forged.state.encode())
    forged.save(update_fields=["digest"])
    assert verify_run(run.id).first_bad == (bad.seq, "its snapshot does not match its digest")


def test_a_database_read_with_another_hmac_key_says_so(settings):
    settings.DURABILITY_HMAC_KEY = "the key it was written with"
    run = drive(operations.start("hash-big", {}).id)
    settings.DURABILITY_HMAC_KEY = "another key, after a restore"
    seq, why = verify_run(run.id).first_bad
    assert seq == 0 and "sealed with another DURABILITY_HMAC_KEY" in why


def test_a_changed_patch_is_named_at_its_own_checkpoint():
    run = operations.start("hash-grow", {"n": 6})
    drive(run.id)
    rewrite("mutation", Checkpoint.objects.get(run=run, seq=3).pk, "line 3", "line 9")
    report = verify_run(run.id)
    assert report.first_bad == (3, "its state hash does not follow from its parent's and its patch")
    with pytest.raises(IntegrityViolation) as err:
        checkpoints.verified_state(Checkpoint.objects.get(run=run, seq=5))
    assert "checkpoint #3 does not verify" in str(err.value)
    # The checkpoints before it still rebuild.
    checkpoints.verified_state(Checkpoint.objects.get(run=run, seq=2))
    # A rollback to a checkpoint that does not verify is refused by its preview already.
    with pytest.raises(IntegrityViolation, match="checkpoint #3 does not verify"):
        operations.plan_rollback(run.id, 4)
    operations.plan_rollback(run.id, 2)


def test_the_latest_state_load_makes_every_check_of_a_rebuild():
    """``state_at`` (the CLI's ``show``) finds the checkpoint and its chain in one statement
    and checks what ``verified_state`` checks: a changed patch, a changed head hash, a changed
    parent chain hash or a changed snapshot each stop it, naming the checkpoint."""
    run = operations.start("hash-grow", {"n": 6})
    drive(run.id)
    assert operations.state_at(run.id) == operations.state_at(str(run.id)[:8])
    assert operations.state_at(run.id)["n"] == 6
    third = checkpoints.verified_state(Checkpoint.objects.get(run=run, seq=3))[0]
    assert operations.state_at(run.id, 3) == operations.state_at(str(run.id), "3") == third
    assert operations.state_at(run.id, 3)["n"] == 3
    with pytest.raises(UnknownCheckpoint, match="run has no checkpoint #9 "):
        operations.state_at(run.id, 9)
    with pytest.raises(UnknownRun):
        operations.state_at(uuid.uuid4())
    head = Checkpoint.objects.get(run=run, seq=6)
    parent = Checkpoint.objects.get(run=run, seq=5)
    for change in (
        lambda: rewrite("mutation", head.pk, "line 6", "line 7"),
        lambda: Checkpoint.objects.filter(pk=head.pk).update(state_hash="0" * 64),
        lambda: Checkpoint.objects.filter(pk=parent.pk).update(chain_hash="0" * 64),
        lambda: rewrite("snapshot", Snapshot.objects.get(checkpoint__run=run).pk, '"n":', '"N":'),
    ):
        saved = (
            list(Checkpoint.objects.filter(run=run).values_list("pk", "state_hash", "chain_hash")),
            list(Mutation.objects.filter(checkpoint__run=run).values_list("pk", "ops")),
            list(Snapshot.objects.filter(checkpoint__run=run).values_list("pk", "state")),
        )
        change()
        with pytest.raises(IntegrityViolation, match=r"checkpoint #\d does not verify"):
            operations.state_at(run.id)
        for pk, state_hash, chain_hash in saved[0]:
            Checkpoint.objects.filter(pk=pk).update(state_hash=state_hash, chain_hash=chain_hash)
        for pk, ops in saved[1]:
            Mutation.objects.filter(pk=pk).update(ops=ops)
        for pk, state in saved[2]:
            Snapshot.objects.filter(pk=pk).update(state=state)
        assert operations.state_at(run.id)["n"] == 6


# --- the migration that re-seals checkpoints written under the old rule ---------------------

BEFORE = [("durability", "0005_run_composite_indexes_only")]


def migrate(target=None):
    """To ``target``, or to the latest migration of every app (0006 re-seals, and the code
    under test needs every later one too; going back also unapplies the apps whose
    migrations depend on the engine's, such as the LangGraph saver's)."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(target or executor.loader.graph.leaf_nodes())


def whole_hashes(run) -> dict[int, str]:
    return {
        seq: canonical.sha256_hex(canonical.dumps(state_of(run.id, seq)))
        for seq in Checkpoint.objects.filter(run=run).values_list("seq", flat=True)
    }


@pytest.fixture
def latest_schema_after():
    yield
    migrate()


def test_the_migration_reseals_both_ways_and_leaves_a_tampered_run_named(latest_schema_after):
    good = operations.start("hash-big", {})
    drive(good.id)
    tampered = operations.start("hash-grow", {"n": 6})
    drive(tampered.id)
    states = {run.id: whole_hashes(run) for run in (good, tampered)}
    rolled = operations.start("hash-grow", {"n": 3})
    drive(rolled.id)
    operations.rollback(rolled.id, 1, by="op")
    drive(rolled.id)

    migrate(BEFORE)  # back to the old rule: every state hash the whole state's
    with connection.cursor() as cur:
        cur.execute(
            "SELECT run_id, seq, state_hash FROM durability_checkpoint WHERE run_id IN (%s, %s)",
            [good.id, tampered.id],
        )
        for run_id, seq, state_hash in cur.fetchall():
            assert state_hash == states[run_id][seq], (run_id, seq)
        # Written under the old rule, then changed in the database:
        cur.execute(
            "UPDATE durability_mutation SET ops = replace(ops, 'line 4', 'line 8')"
            " WHERE checkpoint_id = (SELECT id FROM durability_checkpoint"
            " WHERE run_id = %s AND seq = 4)",
            [tampered.id],
        )

    migrate()
    assert verify_run(good.id).ok and verify_run(rolled.id).ok
    assert state_of(good.id)["n"] == 8
    # The migration rewrote only what checked out: the change is still found where it is.
    report = verify_run(tampered.id)
    assert report.first_bad is not None and report.first_bad[0] == 4
    assert verify_run(tampered.id, upto=3).ok


# --- what the commit statement checks in place of foreign keys ------------------------------


def step_commit(run: Run, cp: Checkpoint, **overrides) -> checkpoints.StepCommit:
    """A commit of one step on ``cp``, as a worker holding lease token 7 would send it."""
    ops = canonical.dumps([{"op": "replace", "path": "/n", "value": 99}])
    fields = {
        "run_id": run.pk,
        "token": 7,
        "head": checkpoints.Head.of(cp),
        "worker": "t",
        "step": "add",
        "next_step": "add",
        "ops_bytes": ops,
        "ops_count": 1,
        "state_hash": canonical.patched(cp.state_hash, ops),
        "chain_hash": "c" * 64,
        "size": cp.size,
        "delta_run": len(ops),
        "schema_version": 1,
        "agent_version": cp.agent_version,
        "commit_id": uuid.uuid4(),
        "prev_commit_us": None,
        "lease_seconds": 30,
    }
    fields.update(overrides)
    return checkpoints.StepCommit(**fields)


@pytest.mark.smoke
def test_a_commit_on_a_checkpoint_that_is_not_the_head_writes_nothing():
    run = operations.start("hash-grow", {"n": 3})
    drive(run.id)
    Run.objects.filter(pk=run.pk).update(lease_token=7, status=RunStatus.RUNNING)
    run.refresh_from_db()
    head = Checkpoint.objects.get(run=run, seq=run.head_seq)
    older = Checkpoint.objects.get(run=run, seq=1)
    before = (Checkpoint.objects.count(), Mutation.objects.count(), Event.objects.count())
    # The worker's idea of the head is wrong (same seq, another checkpoint's id).
    wrong = checkpoints.Head.of(head)
    wrong.id = older.id
    with pytest.raises(FencedOut) as err:
        checkpoints.commit_step(step_commit(run, head, head=wrong))
    assert err.value.guard == "parent"
    assert f"checkpoint id {older.id} is not the run's head #{head.seq}" in str(err.value)
    # A checkpoint id that does not exist at all.
    missing = checkpoints.Head.of(head)
    missing.id = 10**12
    with pytest.raises(FencedOut):
        checkpoints.commit_step(step_commit(run, head, head=missing))
    after = (Checkpoint.objects.count(), Mutation.objects.count(), Event.objects.count())
    assert after == before and Run.objects.get(pk=run.pk).head_seq == head.seq
    # The right head commits.
    checkpoints.commit_step(step_commit(run, head))
    assert Run.objects.get(pk=run.pk).head_seq == head.seq + 1


def test_deleting_a_run_leaves_no_row_behind_but_its_audit_log():
    from durability.deletion import delete_runs

    run = operations.start("hash-big", {})
    drive(run.id)
    operations.rollback(run.id, 2, by="op")
    ids = list(Checkpoint.objects.filter(run=run).values_list("id", flat=True))
    assert Snapshot.objects.filter(checkpoint_id__in=ids).count() > 1
    delete_runs([run.pk], by="retention", reason="old")  # as retention does
    assert not Checkpoint.objects.filter(id__in=ids).exists()
    assert not Mutation.objects.filter(checkpoint_id__in=ids).exists()
    assert not Snapshot.objects.filter(checkpoint_id__in=ids).exists()
    kept = Event.objects.filter(run_id=run.pk).order_by("id")
    assert [(e.kind, e.actor) for e in kept] == [("rollback", "op"), ("deleted", "retention")]


def test_a_compaction_that_did_not_happen_does_not_excuse_a_changed_patch():
    """A compacted checkpoint's patch cannot be checked (its parent is gone); naming the
    present parent's chain as the gone one's must not turn that off for any other."""
    run = drive(operations.start("hash-big", {}).id)
    snap = (
        Snapshot.objects.filter(checkpoint__run=run, checkpoint__seq__gt=0)
        .select_related("checkpoint__parent")
        .first()
    )
    cp = snap.checkpoint
    Checkpoint.objects.filter(pk=cp.pk).update(parent_chain=cp.parent.chain_hash)
    rewrite("mutation", cp.pk, "yyy", "zzz")
    report = verify_run(run.id)
    assert report.first_bad == (
        cp.seq,
        "its state hash does not follow from its parent's and its patch",
    )


def test_show_json_of_a_run_that_does_not_verify_still_shows_the_run():
    """``show`` is for looking, text or JSON: the run, its checkpoints and why its state is
    not shown (``verify`` says which checkpoint), not one error line instead of the JSON."""
    import io
    import json

    from django.core.management import call_command

    run = operations.start("hash-grow", {"n": 3})
    drive(run.id)
    rewrite("mutation", hashes(run)[2].pk, "line 2", "line 9")
    out = io.StringIO()
    call_command("durability", "show", str(run.id), "--json", stdout=out)
    shown = json.loads(out.getvalue())
    assert shown["state"] is None and shown["state_error"].startswith("[DUR200]")
    assert [c["seq"] for c in shown["checkpoints"]] == [0, 1, 2, 3]
