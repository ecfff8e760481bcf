"""The store: one interface, the same answers on PostgreSQL and SQLite.

Each test runs on the database the suite is pointed at; the smoke subset runs them on the
embedded default (SQLite) too, so both implementations answer every question here."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import IntegrityError, OperationalError, connection, transaction
from django.utils import timezone

from durability import END, Agent, canonical, checkpoints, operations, registry
from durability.checkpoints import Head, StepCommit
from durability.errors import FencedOut
from durability.integrity import verify_run
from durability.models import (
    Checkpoint,
    Event,
    EventKind,
    JournalEntry,
    Mutation,
    Run,
    RunStatus,
    Snapshot,
)
from durability.retention import referenced_blobs
from durability.store import for_connection, reconnect, store
from durability.store import langgraph as lg_store
from durability.store.postgres import PostgresStore
from durability.store.sqlite import SqliteStore
from durability.testing import drive
from tests.commit_helpers import empty_commit

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]


@pytest.fixture(autouse=True)
def agents():
    registry.unregister("x-store")
    agent = Agent("x-store", initial_state=lambda inp: {"n": 0})

    @agent.step(start=True)
    def once(state, ctx):
        state["n"] = 1
        return END


def _leased(token: int = 7) -> Run:
    run = operations.start("x-store", {})
    Run.objects.filter(pk=run.pk).update(lease_token=token, status=RunStatus.RUNNING)
    return run


def _commit(run: Run, token: int) -> StepCommit:
    return empty_commit(run, token, "once")


def test_the_store_is_the_one_of_the_database_in_use():
    expected = {"postgresql": PostgresStore, "sqlite": SqliteStore}[connection.vendor]
    assert type(store()) is expected
    assert type(for_connection(connection)) is expected


def test_the_langgraph_saver_statements_are_the_ones_of_the_database_in_use():
    statements = lg_store.for_connection(connection)
    expected = {"postgresql": lg_store.PostgresLangGraph, "sqlite": lg_store.LangGraphStore}
    assert type(statements) is expected[connection.vendor]
    # One statement each on PostgreSQL; elsewhere the ORM, and no one-statement read.
    assert statements.one_statement == (connection.vendor == "postgresql")
    if not statements.one_statement:
        with pytest.raises(NotImplementedError, match="only on PostgreSQL"):
            statements.read("t", "", "", 0)


def test_an_unknown_database_is_a_clear_error():
    class Elsewhere:
        vendor = "oracle"

    with pytest.raises(NotImplementedError, match="PostgreSQL or SQLite, not on 'oracle'"):
        for_connection(Elsewhere())
    with pytest.raises(NotImplementedError, match="PostgreSQL or SQLite, not on 'oracle'"):
        lg_store.for_connection(Elsewhere())


def test_a_commit_on_a_stale_token_writes_nothing_and_names_the_lease():
    run = _leased(token=7)
    before = (Checkpoint.objects.count(), Event.objects.count())
    with pytest.raises(FencedOut) as caught:
        checkpoints.commit_step(_commit(run, token=6))
    assert caught.value.guard == "lease"
    assert (Checkpoint.objects.count(), Event.objects.count()) == before
    assert Run.objects.get(pk=run.pk).head_seq == 0


def test_a_commit_writes_its_checkpoint_mutation_and_event_together():
    run = _leased(token=7)
    checkpoint_id = checkpoints.commit_step(_commit(run, token=7))
    cp = Checkpoint.objects.get(pk=checkpoint_id)
    assert (cp.seq, cp.mutation.ops) == (1, "[]")
    assert Run.objects.get(pk=run.pk).head_seq == 1
    assert Event.objects.filter(run=run, kind=EventKind.CHECKPOINT, seq=1).count() == 1
    # The rebuild's one query reads it back through its snapshot ancestor.
    assert checkpoints.rebuild(checkpoint_id).deltas == 1


def test_a_lease_is_renewed_only_with_its_token():
    run = _leased(token=7)
    assert store().renew_lease(run.pk, 7, 30.0)
    assert not store().renew_lease(run.pk, 6, 30.0)
    expires = Run.objects.get(pk=run.pk).lease_expires_at
    assert expires > timezone.now() + timedelta(seconds=20)


def test_a_liveness_lock_shows_while_held_and_goes_with_its_release():
    run = _leased()
    lock = store().run_lock(run.pk)
    assert lock.acquire()
    try:
        assert str(run.pk) in store().lock_holders([run.pk])
        assert lock.on_connection() == isinstance(store(), PostgresStore)
    finally:
        lock.release()
    assert store().lock_holders([run.pk]) == {}


def test_the_journal_keeps_the_first_record_of_an_identity():
    run = operations.start("x-store", {})
    base = Checkpoint.objects.get(run=run, seq=0)

    def entry(result: str) -> JournalEntry:
        return JournalEntry(
            run_id=run.pk, base_id=base.pk, key="k", occurrence=0, kind="call", step="once",
            function="f", args_hash="a", result=result,
        )  # fmt: skip

    first = entry('"one"')
    assert store().insert_journal_if_absent(first) is first
    assert first.pk is not None and first.created_at is not None
    again = store().insert_journal_if_absent(entry('"two"'))
    assert (again.pk, again.result) == (first.pk, '"one"')
    assert JournalEntry.objects.filter(run=run).count() == 1


def test_existing_runs_and_the_clock():
    run = operations.start("x-store", {})
    missing = uuid.uuid4()
    assert store().existing_runs([run.pk, missing]) == {run.pk}
    assert abs((store().now() - timezone.now()).total_seconds()) < 5
    with transaction.atomic():  # both are statements a transaction may start with
        store().repeatable_read()
        store().lock_timeout(2.0)
        assert Run.objects.filter(pk=run.pk).exists()


def test_blob_references_are_found_in_any_state():
    digest = "ab" * 32
    run = operations.start("x-store", {"doc": {"$blob": digest, "size": 1}})
    Run.objects.filter(pk=run.pk).update(input=f'{{"doc":{{"$blob":"{digest}","size":1}}}}')
    assert digest in referenced_blobs()


def test_commit_figures_are_the_same_quantiles_on_both_databases():
    run = operations.start("x-store", {})
    for us in (1000, 2000, 3000, 4000):
        Event.objects.create(run=run, kind=EventKind.CHECKPOINT, seq=0, commit_us=us)
    since = timezone.now() - timedelta(minutes=1)
    commits, quantiles = store().commit_figures(since, (0.5, 0.99))
    assert commits >= 4
    assert quantiles[0.5] == pytest.approx(0.0025)
    assert quantiles[0.99] == pytest.approx(0.00397)


def test_only_a_lost_connection_is_retried_and_never_inside_a_transaction():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OperationalError("server closed the connection unexpectedly")
        return "written"

    assert reconnect.retrying(flaky, give_up_after=10) == "written"
    assert len(calls) == 3

    def refused():
        calls.append(1)
        raise IntegrityError("duplicate key")

    calls.clear()
    with pytest.raises(IntegrityError):
        reconnect.retrying(refused, give_up_after=10)
    assert len(calls) == 1

    calls.clear()
    with transaction.atomic(), pytest.raises(OperationalError):
        reconnect.retrying(flaky, give_up_after=10)
    assert len(calls) == 1


def test_a_snapshot_is_due_by_bytes_or_by_the_count_of_patches(settings):
    settings.DURABILITY_SNAPSHOT_MAX_DELTAS = 4
    # A state that only grows: its patches never outweigh it, the count decides.
    assert not checkpoints.needs_snapshot(delta_run=3_000, size=10_000, deltas=3)
    assert checkpoints.needs_snapshot(delta_run=4_000, size=10_000, deltas=4)
    # Patches heavier than the state: due however few they are.
    assert checkpoints.needs_snapshot(delta_run=10_001, size=10_000, deltas=1)
    cp = Checkpoint(id=1, seq=3, state_hash="h", chain_hash="c", size=1)
    assert Head.of(cp, deltas=3).deltas == 3 and Head.of(cp).deltas == 0


# --- a run's state: read by number, kept only if it hashes ----------------------------------


@pytest.fixture
def appending():
    """Eight steps, each appending a line: a state that grows, so that after its first
    snapshots the run's checkpoints are patches (its snapshots come by bytes)."""
    registry.unregister("x-store-append")
    agent = Agent("x-store-append", initial_state=lambda inp: {"lines": []})

    @agent.step(start=True)
    def append(state, ctx):
        state["lines"].append(f"line {len(state['lines'])} " + "x" * 2000)
        return "append" if len(state["lines"]) < 8 else END

    run = operations.start("x-store-append", {})
    drive(run.id)
    yield Run.objects.get(pk=run.pk)
    registry.unregister("x-store-append")


def _lines(n: int) -> list[str]:
    return [f"line {i} " + "x" * 2000 for i in range(n)]


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's compression")
def test_large_states_patches_results_and_writes_are_compressed_with_lz4(appending):
    # Each column a step may fill with hundreds of kilobytes (migration 0018 says why).
    with connection.cursor() as cur:
        cur.execute(
            "SELECT attrelid::regclass::text, attname FROM pg_attribute"
            " WHERE attcompression = 'l' ORDER BY 1, 2"
        )
        assert cur.fetchall() == [
            ("durability_journalentry", "result"),
            ("durability_langgraph_pendingwrite", "value"),
            ("durability_mutation", "ops"),
            ("durability_snapshot", "state"),
        ]
        # What PostgreSQL chose to compress of this run's (its larger values) is LZ4's.
        for table, column in (("durability_snapshot", "state"), ("durability_mutation", "ops")):
            cur.execute(
                f"SELECT DISTINCT pg_column_compression({column}) FROM {table}"
                f" WHERE run_id = %s AND pg_column_compression({column}) IS NOT NULL",
                [appending.id],
            )
            assert cur.fetchall() == [("lz4",)], table
    # Read back and proven whole, as any state.
    assert operations.state_at(appending.id) == {"lines": _lines(8)}
    assert verify_run(appending.id).ok


def test_a_run_state_is_its_nearest_snapshot_and_the_patches_numbered_after_it(appending):
    head, rows = store().head_chain(appending.id)
    cp = Checkpoint.objects.get(run=appending, seq=appending.head_seq)
    assert head[:3] == (cp.id, appending.id, 8)
    walked = store().chain(cp.id)
    assert len(rows) > 3  # a snapshot and several patches, not a snapshot of the head
    # The same snapshot and patches as the walk up the parents, in the same order.
    assert [row[:4] for row in rows] == [row[:4] for row in walked]
    assert rows[0][4] == walked[0][4]
    assert operations.state_at(appending.id) == {"lines": _lines(8)}


def test_a_rollback_head_is_stored_whole_and_one_stored_as_a_patch_only_is_walked(appending):
    # A snapshot of #6, then a rollback to #3: the new head (#9) is an empty patch on #3 and
    # a snapshot of its own, so its state is read from itself.
    six = Checkpoint.objects.get(run=appending, seq=6)
    state = operations.state_at(appending.id, 6)
    checkpoints.store_snapshot(six.id, six.state_hash, canonical.dumps(state))
    operations.rollback(appending.id, 3, by="test")
    head = Checkpoint.objects.get(run=appending, seq=9)
    assert head.parent.seq == 3 and Snapshot.objects.filter(checkpoint=head).exists()
    assert [row[0] for row in store().head_chain(appending.id)[1]] == [head.id]
    assert operations.state_at(appending.id) == {"lines": _lines(3)}
    # As a rollback of the version before stored it (a patch only): by number, its nearest
    # snapshot is #6, on the branch it left; those rows do not hash to its state, and its
    # parents are walked instead.
    Snapshot.objects.filter(checkpoint=head).delete()
    if isinstance(store(), PostgresStore):  # which reads by number
        assert store().head_chain(appending.id)[1][0][0] == six.id
    assert operations.state_at(appending.id) == {"lines": _lines(3)}
    assert operations.state_at(appending.id, 6) == {"lines": _lines(6)}
    operations.resume(appending.id, by="test")
    run = drive(appending.id)
    assert run.status == RunStatus.SUCCEEDED
    assert operations.state_at(run.id) == {"lines": _lines(8)}
    assert verify_run(run.id).ok


def test_the_run_and_number_copied_onto_history_rows_only_say_where_to_look(appending):
    five = Checkpoint.objects.get(run=appending, seq=5)
    Mutation.objects.filter(checkpoint=five).update(seq=500)
    Mutation.objects.filter(checkpoint__run=appending, checkpoint__seq=6).update(
        run_id=uuid.uuid4()
    )
    # As a worker of the version before these columns writes it, during a rolling deploy.
    Mutation.objects.filter(checkpoint__run=appending, checkpoint__seq=7).update(
        run_id=None, seq=None
    )
    # The patches found by number no longer hash to the head's state: its parents are
    # walked, and the state is the one its hashes commit to.
    assert operations.state_at(appending.id) == {"lines": _lines(8)}
    assert operations.state_at(appending.id, 6) == {"lines": _lines(6)}
    assert verify_run(appending.id).ok
