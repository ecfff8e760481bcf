"""The LangGraph saver's writes that are one statement each on PostgreSQL (a new thread, a
change of its run's status) against the ORM's writes of the same rows, which SQLite and a
caller's transaction use: the same rows, the same answers, nothing half written."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction

from durability import canonical, checkpoints, events, operations
from durability.langgraph import store
from durability.langgraph.models import Thread
from durability.langgraph.status import MID_RUN
from durability.lifecycle import graph_change
from durability.models import Checkpoint, Event, Mutation, Run, Snapshot
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
        "wait": lambda: graph_change("graph_waits", detail=text),
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
