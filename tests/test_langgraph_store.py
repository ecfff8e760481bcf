"""The LangGraph saver's writes that are one statement each on PostgreSQL (a new thread, a
change of its run's status) against the ORM's writes of the same rows, which SQLite and a
caller's transaction use: the same rows, the same answers, nothing half written."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest
from django.db import DataError, IntegrityError, connection, transaction

from durability import canonical, checkpoints, events, operations, redact
from durability.langgraph import store
from durability.langgraph.models import Thread
from durability.langgraph.status import ANSWER, MID_RUN
from durability.lifecycle import GraphChange, graph_change
from durability.models import Checkpoint, Event, Mutation, Run, Snapshot, WaitReason
from durability.store import langgraph as lg_store

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]


def _rows(run_id) -> dict:
    """A new thread's rows, without what differs from thread to thread (ids, times, the
    thread's name, the hash chained on the run's id)."""
    run = Run.objects.filter(pk=run_id).values().get()
    run["finished_at"] = run["finished_at"] is not None
    skip = ("id", "input", "created_at", "updated_at", "started_at")
    return {
        "run": _without(run, *skip),
        "checkpoint": _without(
            Checkpoint.objects.filter(run_id=run_id).values().get(),
            *("id", "run_id", "chain_hash", "created_at"),
        ),
        "mutation": _without(
            Mutation.objects.filter(run_id=run_id).values().get(), "checkpoint_id", "run_id"
        ),
        "snapshot": _without(
            Snapshot.objects.filter(run_id=run_id).values().get(), "checkpoint_id", "run_id"
        ),
        # The created event names the thread.
        "events": [
            _without(
                e, "id", "run_id", "created_at", *(("data",) if e["kind"] == "created" else ())
            )
            for e in Event.objects.filter(run_id=run_id).values()
        ],
        "thread": _without(
            Thread.objects.filter(run_id=run_id).values().get(),
            *("id", "thread_id", "run_id", "created_at"),
        ),
    }


def _without(row: dict, *keys: str) -> dict:
    return {k: v for k, v in row.items() if k not in keys}


def test_a_new_thread_is_made_all_at_once_as_the_orm_makes_it():
    """On PostgreSQL a new thread's rows (its run, first checkpoint, event, thread row) are
    one statement; in a caller's transaction, and on SQLite, the ORM writes them. Both write
    the same rows; the first checkpoint comes back as stored; and making a thread that
    another process made meanwhile changes nothing."""
    one, start = store.thread_of("made-at-once", "", graph="g", create=True)
    with transaction.atomic():
        orm, _ = store.thread_of("made-by-the-orm", "", graph="g", create=True)
    assert _rows(one.run_id) == _rows(orm.run_id)
    first = Checkpoint.objects.get(run_id=one.run_id)
    assert (start.id, start.seq, start.state_hash, start.chain_hash, start.size) == (
        first.id,
        0,
        first.state_hash,
        first.chain_hash,
        first.size,
    )
    assert canonical.loads(Run.objects.get(pk=one.run_id).input) == {
        "thread_id": "made-at-once",
        "checkpoint_ns": "",
    }
    (report,) = operations.verify(one.run_id)
    assert report.ok, str(report)
    if connection.vendor == "postgresql":
        # Its statement does not wait for the flush, and only its own transaction: the
        # thread's first checkpoint, next on this connection, must.
        with connection.cursor() as cur:
            cur.execute("SHOW synchronous_commit")
            assert cur.fetchone()[0] == "on"
    one.run.save()  # the instances it made are stored ones: saved again, they are updated
    one.save()
    # Again: the thread is found, and nothing is made.
    counts = (Run.objects.count(), Checkpoint.objects.count(), Event.objects.count())
    again, none = store.thread_of("made-at-once", "", graph="g", create=True)
    assert (again.pk, none) == (one.pk, None)
    # Made meanwhile by another process: the statement fails whole.
    run = Run(agent="g", input="{}")
    fields = checkpoints.whole_checkpoint(
        run.id,
        b"{}",
        seq=0,
        parent_chain="",
        reason="start",
        step="",
        next_step="",
        schema_version=1,
        agent_version="langgraph",
    )
    late = Thread(thread_id="made-at-once", checkpoint_ns="", run=run)
    with pytest.raises(IntegrityError):
        lg_store.for_connection(connection).make_thread(
            run, fields, Event(run=run, kind="created"), late
        )
    assert (Run.objects.count(), Checkpoint.objects.count(), Event.objects.count()) == counts


def _report(run_id, kind: str, text: str = "") -> bool:
    change = {
        "wait": lambda: graph_change(
            "graph_waits",
            detail=text,
            wait=WaitReason.INTERRUPT if text.startswith(ANSWER) else WaitReason.GRAPH,
        ),
        "end": lambda: graph_change("graph_ended"),
        "fail": lambda: graph_change("graph_failed", error=text, code="DUR501"),
    }[kind]()
    event = {
        "wait": lambda: events.suspended(run_id, wait="", detail=text, seq=0),
        "end": lambda: events.succeeded(run_id, seq=0),
        "fail": lambda: events.failed(run_id, message=text, detail={}, seq=0),
    }[kind]()
    return lg_store.for_connection(connection).report(run_id, change, event)


def test_a_status_report_is_one_statement_as_the_orm_makes_it():
    """Each report (waiting, at its end, failed) changes the run and adds its event as the
    ORM does in a transaction (``lifecycle.apply_graph``); a report that is said already, or
    that the run's status does not allow, changes nothing and adds no event."""
    one, _ = store.thread_of("reported-at-once", "", graph="g", create=True)
    orm, _ = store.thread_of("reported-by-the-orm", "", graph="g", create=True)
    steps = [
        ("wait", MID_RUN, False),  # a new thread's run waits for its graph already
        ("end", "", True),
        ("end", "", False),
        ("fail", "node a raised ValueError: no", False),  # only a waiting graph fails
        ("wait", "an answer to: refund?", True),
        ("wait", "an answer to: refund?", False),
        ("wait", "an answer to: refund? and ship?", True),
        ("fail", "node a raised ValueError: no", True),
        ("wait", MID_RUN, True),
        ("end", "", True),
    ]
    for kind, text, changes in steps:
        assert _report(one.run_id, kind, text) is changes, (kind, text)
        with transaction.atomic():
            assert _report(orm.run_id, kind, text) is changes, (kind, text)
        assert _rows(one.run_id) == _rows(orm.run_id), (kind, text)
    run = Run.objects.get(pk=one.run_id)
    assert (run.status, run.finished_at is not None, run.error) == ("succeeded", True, "")
    kinds = list(Event.objects.filter(run_id=one.run_id).values_list("kind", flat=True))
    assert kinds == [
        "created",
        "succeeded",
        "suspended",
        "suspended",
        "failed",
        "suspended",
        "succeeded",
    ]


def _new_thread(name: str):
    """A new thread's row (its run waits for the graph) and its run's first checkpoint."""
    thread, start = store.thread_of(name, "", graph="g", create=True)
    assert start is not None
    return thread, start


def test_a_secret_in_a_new_threads_rows_is_written_nowhere():
    """A new thread's rows go to the database as one JSON object each, and the run's input
    and the event's data are JSON texts inside it: a secret the execution read (here with
    a quote and a backslash, which JSON escapes, twice there) is scrubbed from them as from
    any statement's parameters."""
    secret = 'pa"ss\\word-4f9c2d7e8a1b'
    with redact.scope({secret}):
        thread, _ = store.thread_of(f"user {secret}", "", graph="g", create=True)
    assert thread is not None
    stored = [
        *Run.objects.filter(pk=thread.run_id).values_list("input", flat=True),
        *Event.objects.filter(run_id=thread.run_id).values_list("data", flat=True),
        *Thread.objects.filter(pk=thread.pk).values_list("thread_id", flat=True),
    ]
    assert len(stored) == 3
    for text in stored:
        assert "pa" not in text.replace(redact.REDACTED, ""), text
        assert redact.REDACTED in text, text
    assert canonical.loads(stored[0])["thread_id"] == f"user {redact.REDACTED}"


def _checkpoint_with(thread, start, report, *, head_seq: int | None = None):
    """The thread's first LangGraph checkpoint stored with ``report`` (a status change and
    its event) through the saver's statements; its id, or None when the head had moved
    (``head_seq``: the number the statement takes the head to be at)."""
    new = store.NewCheckpoint(
        thread=thread,
        parent=start,
        seq=1,
        lg_id="1f0-0001",
        parent_lg_id="",
        doc={"checkpoint": {"id": "1f0-0001"}, "values": {"turns": 1}, "metadata": {}},
        metadata={},
        step="loop 0",
    )
    if head_seq is None:
        return store.commit(new, checkpoints.SnapshotWriter(), connection, report=report).id
    ops, count, size = store.exact_patch(start, new.doc)
    row = store._row(new, ops, count, size, "h" * 64, len(ops), None)
    row.update(head_seq=head_seq, chain_hash="c" * 64, commit_id=uuid.uuid4())
    return lg_store.for_connection(connection).insert_checkpoint(row, False, report)


def _ended(run_id):
    return graph_change("graph_ended"), events.succeeded(run_id, seq=0)


def _rows_after(run_id) -> dict:
    run = Run.objects.filter(pk=run_id).values().get()
    run["finished_at"] = run["finished_at"] is not None
    return {
        "run": _without(run, "id", "input", "created_at", "updated_at", "started_at"),
        "events": [
            _without(e, "id", "run_id", "created_at", "data")
            for e in Event.objects.filter(run_id=run_id).order_by("id").values()
        ],
    }


def test_a_status_report_goes_with_its_checkpoint_as_the_orm_writes_them():
    """The change of a run's status a checkpoint makes is written in the checkpoint's
    transaction (on PostgreSQL its statement after the checkpoint's, in one round trip), its
    event numbered as the checkpoint: the same rows as the ORM writes in one transaction."""
    one, one_start = _new_thread("riding-at-once")
    orm, orm_start = _new_thread("riding-by-the-orm")
    assert _checkpoint_with(one, one_start, _ended(one.run_id)) is not None
    with transaction.atomic():
        assert _checkpoint_with(orm, orm_start, _ended(orm.run_id)) is not None
    run = Run.objects.get(pk=one.run_id)
    assert (run.status, run.head_seq, run.finished_at is not None) == ("succeeded", 1, True)
    assert Event.objects.get(run_id=one.run_id, kind="succeeded").seq == 1
    assert _rows_after(one.run_id) == _rows_after(orm.run_id)
    # In time order as in id order: the checkpoint, then what it changed (the dashboard's
    # timeline merges events with calls and effects by time).
    for run_id in (one.run_id, orm.run_id):
        timed = Event.objects.filter(run_id=run_id).order_by("created_at", "id")
        assert list(timed.values_list("kind", flat=True)) == ["created", "checkpoint", "succeeded"]


def test_a_status_report_changes_nothing_when_its_checkpoint_is_not_stored():
    """Another writer took the checkpoint's number: the checkpoint is not stored, and
    neither is the report that came with it."""
    thread, start = _new_thread("riding-late")
    assert _checkpoint_with(thread, start, _ended(thread.run_id), head_seq=5) is None
    run = Run.objects.get(pk=thread.run_id)
    assert (run.status, run.head_seq) == ("waiting", 0)
    assert not Event.objects.filter(run_id=thread.run_id, kind="succeeded").exists()


def _waits(run_id):
    return graph_change("graph_waits", detail=MID_RUN), events.suspended(
        run_id, wait="", detail=MID_RUN, seq=0
    )


@pytest.mark.parametrize(("status", "report"), [("cancelled", _ended), ("waiting", _waits)])
def test_a_status_report_that_does_not_apply_stores_its_checkpoint_alone(status, report):
    """A graph's end does not end a run an operator cancelled meanwhile, and a run already
    waiting as the report says gets no second event: the checkpoint is stored, the run's
    status and its timeline are left as they were, the same rows as the ORM writes."""
    one, one_start = _new_thread(f"not-applying-{status}")
    orm, orm_start = _new_thread(f"not-applying-{status}-by-the-orm")
    Run.objects.filter(pk__in=[one.run_id, orm.run_id]).update(status=status)
    assert _checkpoint_with(one, one_start, report(one.run_id)) is not None
    with transaction.atomic():
        assert _checkpoint_with(orm, orm_start, report(orm.run_id)) is not None
    run = Run.objects.get(pk=one.run_id)
    assert (run.status, run.head_seq, run.finished_at) == (status, 1, None)
    kinds = Event.objects.filter(run_id=one.run_id).order_by("id").values_list("kind", flat=True)
    assert list(kinds) == ["created", "checkpoint"]
    assert _rows_after(one.run_id) == _rows_after(orm.run_id)


def test_a_status_report_reads_the_run_as_it_is_once_another_change_commits():
    """An operator's cancel holds the run's row when the graph's last checkpoint arrives:
    the checkpoint waits for it, then is stored without ending the cancelled run. (Read as
    it was when the statement began, the run would have looked waiting, and the graph's end
    would have overwritten the cancel.)"""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite writes one transaction at a time")
    thread, start = _new_thread("riding-after-a-cancel")
    stored: list = []
    with psycopg.connect(_libpq_url(), autocommit=False) as operator:
        operator.execute(
            "UPDATE durability_run SET status = 'cancelled' WHERE id = %s", [thread.run_id]
        )

        def last_checkpoint() -> None:
            try:
                stored.append(_checkpoint_with(thread, start, _ended(thread.run_id)))
            finally:
                connection.close()

        graph = threading.Thread(target=last_checkpoint)
        graph.start()
        _wait_for_lock_wait(thread.run_id)
        operator.commit()
        graph.join(30)
    assert stored and stored[0] is not None
    run = Run.objects.get(pk=thread.run_id)
    assert (run.status, run.head_seq) == ("cancelled", 1)
    assert not Event.objects.filter(run_id=thread.run_id, kind="succeeded").exists()


def _libpq_url() -> str:
    settings = connection.settings_dict
    return (
        f"postgresql://{settings['USER']}@{settings['HOST']}:{settings['PORT']}/{settings['NAME']}"
    )


def _wait_for_lock_wait(run_id, timeout: float = 30.0) -> None:
    """Until a session waits for a lock (the checkpoint's statement, on the run's row)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(_libpq_url(), autocommit=True) as watcher:
        while time.monotonic() < deadline:
            waiting = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE %s",
                ["%durability_run%"],
            ).fetchone()[0]
            if waiting:
                return
            time.sleep(0.02)
    raise AssertionError(f"no statement waited for run {run_id}'s row")


def test_a_checkpoint_and_its_report_are_stored_together_or_not_at_all():
    """A report the database refuses (a wait detail past its column) takes its checkpoint
    with it: the two statements sent at once are one transaction."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite does not refuse an over-long text")
    thread, start = _new_thread("riding-refused")
    refused = GraphChange("graph_waits", {"wait_detail": "x" * 501}, {})
    event = events.suspended(thread.run_id, wait="", detail="", seq=0)
    with pytest.raises(DataError):
        _checkpoint_with(thread, start, (refused, event))
    assert Run.objects.get(pk=thread.run_id).head_seq == 0
    assert not Checkpoint.objects.filter(run_id=thread.run_id, seq=1).exists()
    # The same statements again, now accepted: the session's prepared statements survived.
    accepted = GraphChange("graph_waits", {"wait_detail": "x" * 500}, {})
    assert _checkpoint_with(thread, start, (accepted, event)) is not None
    assert Run.objects.get(pk=thread.run_id).wait_detail == "x" * 500
