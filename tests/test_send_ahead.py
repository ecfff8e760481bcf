"""Commits sent ahead: a step's checkpoint goes to PostgreSQL and the next step starts
before the answer is in. These tests hold that answer back with a row lock taken by
another session, so the next step really runs while its base commit is in flight, and
check that nothing it does leaves the process before that commit is durable."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from django.db import connection, connections

from durability import END, Agent, RetryPolicy, operations, registry
from durability.models import Checkpoint, Event, EventKind, JournalEntry, RunStatus
from durability.runtime.executor import Outcome, execute
from durability.runtime.faults import SimulatedCrash
from durability.testing import drive, state_of

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql", reason="commits are sent ahead on PostgreSQL only"
    ),
]

CALLS: Counter = Counter()


@pytest.fixture(autouse=True)
def _reset_calls():
    CALLS.clear()


@pytest.fixture
def side():
    """Another session, in a transaction of its own."""
    wrapper = connections.create_connection("default")
    wrapper.ensure_connection()
    raw = wrapper.connection
    raw.autocommit = False
    yield raw
    raw.rollback()
    wrapper.close()


def tool(name: str) -> dict:
    CALLS[name] += 1
    return {"tool": name}


def agent(name: str, **options) -> Agent:
    registry.unregister(name)
    return Agent(name, **options)


def lock_run(side, run_id) -> None:
    side.execute("SELECT 1 FROM durability_run WHERE id = %s FOR UPDATE", [run_id])


def locked_first(name: str, side, second) -> Agent:
    """An agent whose first step leaves the run's row locked by ``side``: that step's
    commit, sent ahead, waits for the lock while ``second`` runs."""
    a = agent(name)

    @a.step(start=True)
    def first(state, ctx):
        state["n"] = 1
        lock_run(side, ctx.run_id)
        return "second"

    a.step()(second)
    return a


def wait_for_blocked_commit(side) -> int:
    """The pid of the session whose commit waits for the row lock ``side`` holds."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        row = side.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        ).fetchone()
        if row:
            return row[0]
        time.sleep(0.01)
    raise AssertionError("no commit waited for the run's row lock")


def test_the_next_step_runs_while_its_base_commit_is_in_flight(side):
    seen: dict = {}

    def second(state, ctx):
        # Runs although the first step's commit cannot finish yet.
        seen["blocked"] = wait_for_blocked_commit(side)
        seen["committed_before_call"] = Checkpoint.objects.filter(run_id=ctx.run_id, seq=1).exists()
        side.rollback()  # let it through
        ctx.call("after", tool, "after")
        seen["committed_at_call"] = Checkpoint.objects.filter(run_id=ctx.run_id, seq=1).exists()
        state["n"] += 1
        return END

    locked_first("x-ahead", side, second)
    run = operations.start("x-ahead", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert seen["blocked"] and seen["committed_before_call"] is False
    assert seen["committed_at_call"] is True
    assert CALLS["after"] == 1
    # The call hangs from the checkpoint the step started from, as if nothing ran ahead.
    entry = JournalEntry.objects.get(run=run, key="after")
    assert entry.base_id == Checkpoint.objects.get(run=run, seq=1).id
    assert state_of(run.id) == {"n": 2}
    assert operations.verify(run.id)[0].ok
    latencies = list(
        Event.objects.filter(run=run, kind=EventKind.CHECKPOINT)
        .exclude(commit_us=None)
        .values_list("commit_us", flat=True)
    )
    assert latencies and all(us > 0 for us in latencies)


def test_a_commit_s_latency_ends_when_its_answer_arrives_not_when_the_next_step_looks():
    """A step working a while without passing ``ctx`` (CPU, a sleep, a client of its own)
    does not look at the commit in flight: its latency is still the commit's own."""
    a = agent("x-slow-next")

    @a.step(start=True)
    def first(state, ctx):
        state["n"] = 1
        return "slow"

    @a.step()
    def slow(state, ctx):
        time.sleep(1.5)
        return END

    run = operations.start("x-slow-next", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    first_commit = Event.objects.filter(run=run, kind=EventKind.CHECKPOINT, seq=2).get()
    # Carried by the next commit; a fraction of the 1.5 s the next step took.
    assert first_commit.commit_us is not None and first_commit.commit_us < 500_000


def test_a_commit_fenced_in_flight_stops_the_step_that_ran_ahead_before_its_call(side):
    def second(state, ctx):
        wait_for_blocked_commit(side)
        # Another worker takes the run while the first step's commit waits.
        side.execute(
            "UPDATE durability_run SET lease_token = lease_token + 1 WHERE id = %s", [ctx.run_id]
        )
        side.commit()
        ctx.call("never", tool, "never")
        return END

    locked_first("x-ahead-fenced", side, second)
    run = operations.start("x-ahead-fenced", {})
    assert execute(run.id, worker="test-worker") == Outcome.LOST
    assert CALLS["never"] == 0
    assert list(Checkpoint.objects.filter(run=run).values_list("seq", flat=True)) == [0]
    assert not JournalEntry.objects.filter(run=run).exists()


def test_a_step_that_catches_everything_cannot_go_on_past_a_fenced_commit(side):
    seen: list[str] = []

    def second(state, ctx):
        wait_for_blocked_commit(side)
        side.execute(
            "UPDATE durability_run SET lease_token = lease_token + 1 WHERE id = %s", [ctx.run_id]
        )
        side.commit()
        try:
            ctx.call("never", tool, "never")
        except Exception as exc:  # an agent's blanket handler
            seen.append(f"swallowed {type(exc).__name__}")
        seen.append("went on")
        return END

    locked_first("x-ahead-swallow", side, second)
    run = operations.start("x-ahead-swallow", {})
    assert execute(run.id, worker="test-worker") == Outcome.LOST
    assert seen == [] and CALLS["never"] == 0
    assert list(Checkpoint.objects.filter(run=run).values_list("seq", flat=True)) == [0]


def test_a_commit_whose_session_dies_in_flight_is_looked_up_and_sent_again(side):
    def second(state, ctx):
        pid = wait_for_blocked_commit(side)
        side.execute("SELECT pg_terminate_backend(%s)", [pid])
        side.rollback()
        ctx.call("once", tool, "once")
        state["n"] += 1
        return END

    locked_first("x-ahead-killed", side, second)
    run = operations.start("x-ahead-killed", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert CALLS["once"] == 1
    seqs = Checkpoint.objects.filter(run=run).order_by("seq").values_list("seq", flat=True)
    assert list(seqs) == [0, 1, 2]
    assert state_of(run.id) == {"n": 2}
    assert operations.verify(run.id)[0].ok
    failed = Event.objects.get(run=run, kind=EventKind.COMMIT_FAILED)
    assert failed.seq == 1


def test_a_step_that_raises_waits_for_the_commit_before_its_failure_is_written(side):
    def second(state, ctx):
        wait_for_blocked_commit(side)
        side.rollback()
        raise ValueError("permanent")

    locked_first("x-ahead-raises", side, second)
    run = operations.start("x-ahead-raises", {})
    done = drive(run.id)
    assert done.status == RunStatus.FAILED and "permanent" in done.error
    # The failure belongs to the second step: the first one's checkpoint is there.
    assert done.head_seq == 1
    assert Checkpoint.objects.filter(run=run, seq=1).exists()
    assert operations.verify(run.id)[0].ok


def test_a_commit_session_ended_while_idle_is_replaced_without_a_failed_commit(side):
    from durability.runtime import inflight

    def step(state, ctx):
        state["n"] = state.get("n", 0) + 1
        return "step" if state["n"] < 3 else END

    a = agent("x-ahead-idle")
    a.step(start=True)(step)
    first = operations.start("x-ahead-idle", {})
    assert drive(first.id).status == RunStatus.SUCCEEDED
    pid = inflight.channel().connection.connection.info.backend_pid
    side.execute("SELECT pg_terminate_backend(%s)", [pid])
    side.commit()
    deadline = time.monotonic() + 10
    while side.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone():
        side.commit()
        assert time.monotonic() < deadline, "the session did not end"
        time.sleep(0.01)

    second = operations.start("x-ahead-idle", {})
    assert drive(second.id).status == RunStatus.SUCCEEDED
    assert state_of(second.id) == {"n": 3}
    assert inflight.channel().connection.connection.info.backend_pid != pid
    assert not Event.objects.filter(run=second, kind=EventKind.COMMIT_FAILED).exists()


def test_the_wait_for_the_previous_commit_is_not_charged_to_the_next_steps_timeout(side):
    a = agent("x-ahead-timeout", step_timeout=1.0, retry=RetryPolicy(max_retries=0))

    @a.step(start=True)
    def first(state, ctx):
        state["n"] = 1
        lock_run(side, ctx.run_id)  # this step's commit waits 2 s for the lock
        threading.Timer(2.0, side.rollback).start()
        return "second"

    @a.step()
    def second(state, ctx):
        ctx.call("t", tool, "t")  # the step itself takes no time
        state["n"] += 1
        return END

    run = operations.start("x-ahead-timeout", {})
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert not Event.objects.filter(run=run, kind=EventKind.RETRY_SCHEDULED).exists()
    assert CALLS["t"] == 1


def test_an_error_when_the_commit_commits_voids_it(request):
    """The statement's row comes before its transaction commits: a failure then (here a
    deferred constraint trigger) arrives after the row, and the commit did not happen."""
    a = agent("x-ahead-deferred")

    @a.step(start=True)
    def first(state, ctx):
        state["n"] = 1
        return "second"

    @a.step()
    def second(state, ctx):
        ctx.call("after", tool, "after")  # must not run: its base never committed
        return END

    run = operations.start("x-ahead-deferred", {})
    with connection.cursor() as cur:
        cur.execute(
            "CREATE FUNCTION x_reject() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            f" IF NEW.run_id = '{run.id}'::uuid AND NEW.seq = 1 THEN"
            " RAISE EXCEPTION 'rejected at commit'; END IF; RETURN NULL; END $$"
        )
        cur.execute(
            "CREATE CONSTRAINT TRIGGER x_reject AFTER INSERT ON durability_checkpoint"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION x_reject()"
        )

    def drop() -> None:
        with connection.cursor() as cur:
            cur.execute("DROP TRIGGER IF EXISTS x_reject ON durability_checkpoint")
            cur.execute("DROP FUNCTION IF EXISTS x_reject()")

    request.addfinalizer(drop)
    execute(run.id, worker="test-worker")
    assert CALLS["after"] == 0
    assert list(Checkpoint.objects.filter(run=run).values_list("seq", flat=True)) == [0]


def commit_span(exporter, seq: int):
    """The span of the step whose commit made checkpoint ``seq``, and the commit's event."""
    found = [
        (s, e)
        for s in exporter.get_finished_spans()
        for e in s.events
        if e.name == "checkpoint.commit" and e.attributes["durability.checkpoint.seq"] == seq
    ]
    assert len(found) == 1, f"{len(found)} events for the commit of checkpoint {seq}"
    return found[0]


def test_a_commit_recovered_in_flight_ends_its_span_with_the_recovery(side, memory_spans):
    from opentelemetry.trace import StatusCode

    seen: dict = {}

    def second(state, ctx):
        pid = wait_for_blocked_commit(side)
        side.execute("SELECT pg_terminate_backend(%s)", [pid])
        side.rollback()
        seen["killed_at"] = time.time_ns()
        ctx.call("once", tool, "once")
        return END

    locked_first("x-ahead-span-recovered", side, second)
    run = operations.start("x-ahead-span-recovered", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    span, event = commit_span(memory_spans, 1)
    assert event.attributes["durability.checkpoint.recovered"] is True
    assert span.status.status_code != StatusCode.ERROR
    # It ends when the commit is done (sent again), not when its first session died.
    latency_ns = event.attributes["durability.checkpoint.latency_ms"] * 1e6
    assert event.timestamp + latency_ns > seen["killed_at"]
    _, later = commit_span(memory_spans, 2)
    assert later.attributes.get("durability.checkpoint.recovered") is None


def test_a_commit_fenced_in_flight_ends_its_span_as_an_error(side, memory_spans):
    from opentelemetry.trace import StatusCode

    def second(state, ctx):
        wait_for_blocked_commit(side)
        side.execute(
            "UPDATE durability_run SET lease_token = lease_token + 1 WHERE id = %s", [ctx.run_id]
        )
        side.commit()
        ctx.call("never", tool, "never")
        return END

    locked_first("x-ahead-span-fenced", side, second)
    run = operations.start("x-ahead-span-fenced", {})
    assert execute(run.id, worker="test-worker") == Outcome.LOST
    span, event = commit_span(memory_spans, 1)
    assert span.status.status_code == StatusCode.ERROR
    error = event.attributes["durability.checkpoint.error"]
    assert "fenc" in error.lower() or "lease" in error


def test_leaving_the_process_past_a_fenced_commit_lets_the_exit_go_on(side):
    """A worker told to exit while the commit in flight is fenced: the exit is not replaced
    by the commit's failure, and nothing of the run is written (it is no longer ours)."""

    def second(state, ctx):
        wait_for_blocked_commit(side)
        side.execute(
            "UPDATE durability_run SET lease_token = lease_token + 1 WHERE id = %s", [ctx.run_id]
        )
        side.commit()
        raise SystemExit(0)

    locked_first("x-ahead-exit-fenced", side, second)
    run = operations.start("x-ahead-exit-fenced", {})
    before = set(Event.objects.filter(run=run).values_list("pk", flat=True))
    with pytest.raises(SystemExit):
        execute(run.id, worker="test-worker")
    assert list(Checkpoint.objects.filter(run=run).values_list("seq", flat=True)) == [0]
    written = Event.objects.filter(run=run).exclude(pk__in=before)
    assert not written.exclude(kind=EventKind.CLAIMED).exists()


def test_leaving_the_process_waits_for_the_commit_in_flight_then_hands_the_run_back(side):
    def second(state, ctx):
        pid = wait_for_blocked_commit(side)
        side.execute("SELECT pg_terminate_backend(%s)", [pid])
        side.rollback()
        raise SystemExit(0)

    locked_first("x-ahead-exit", side, second)
    run = operations.start("x-ahead-exit", {})
    with pytest.raises(SystemExit):
        execute(run.id, worker="test-worker")
    run.refresh_from_db()
    # The first step's commit was recovered (sent again) before the run was handed back.
    assert run.head_seq == 1 and run.status == RunStatus.QUEUED
    assert Event.objects.filter(run=run, kind=EventKind.RELEASED).exists()
    assert operations.verify(run.id)[0].ok


def test_fault_points_keep_commits_sent_ahead_and_a_crash_there_has_one_in_flight(faults):
    """A fault point does not switch sending ahead off: killed in the commit of a step that
    only computed, the worker had its parent's commit in flight (the marker says so). That
    one lands, this one was never sent; the re-run makes every checkpoint once."""
    a = agent("x-ahead-crash")

    @a.step(start=True)
    def count(state, ctx):
        state["n"] = state.get("n", 0) + 1
        return "count" if state["n"] < 5 else END

    faults.set({"point": "in_commit", "when": {"seq": 3, "in_flight": True}, "action": "crash"})
    run = operations.start("x-ahead-crash", {})
    with pytest.raises(SimulatedCrash):
        execute(run.id, worker="test-worker")
    [seen] = faults.records()
    assert (seen["point"], seen["seq"], seen["in_flight"]) == ("in_commit", "3", True)
    # The parent (#2) was in flight when the process "died": it landed; #3 was never sent.
    assert list(Checkpoint.objects.filter(run=run).values_list("seq", flat=True)) == [0, 1, 2]
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    seqs = Checkpoint.objects.filter(run=run).order_by("seq").values_list("seq", flat=True)
    assert list(seqs) == [0, 1, 2, 3, 4, 5]
    assert state_of(run.id) == {"n": 5}
    assert operations.verify(run.id)[0].ok


def test_after_the_commit_means_once_its_answer_is_in(side, faults):
    """A commit sent ahead: "after the commit" fires when the next step's call waits for its
    answer, not before; the call has not run, and the re-run makes it once."""

    ran: list[int] = []

    def second(state, ctx):
        if not ran:  # the first time, with the first step's commit held back
            ran.append(1)
            wait_for_blocked_commit(side)
            side.rollback()
        ctx.call("after", tool, "after")
        state["n"] += 1
        return END

    locked_first("x-ahead-after-commit", side, second)
    faults.set({"point": "after_commit", "when": {"seq": 1}, "action": "crash"})
    run = operations.start("x-ahead-after-commit", {})
    with pytest.raises(SimulatedCrash):
        execute(run.id, worker="test-worker")
    [seen] = faults.records()
    assert (seen["seq"], seen["step"], seen["in_flight"]) == ("1", "first", False)
    assert CALLS["after"] == 0
    assert Checkpoint.objects.filter(run=run, seq=1).exists()
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert CALLS["after"] == 1 and state_of(run.id) == {"n": 2}
