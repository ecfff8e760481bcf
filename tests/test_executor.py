"""The engine in this process: steps, checkpoints, journaled calls, effects, approvals,
retries, timeouts, validation, secrets, upgrades, poison steps. Crashes are simulated with
the ``crash`` fault, which unwinds the execution like a dying process (no cleanup)."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from django.db import connection
from pydantic import BaseModel

from durability import END, NOT_DONE, Agent, RetryPolicy, Transient, operations, registry
from durability.errors import SchemaViolation
from durability.models import (
    Approval,
    Checkpoint,
    Effect,
    EffectStatus,
    Event,
    EventKind,
    JournalEntry,
    Run,
    RunStatus,
    Snapshot,
)
from durability.testing import drive, state_of, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

CALLS: Counter = Counter()


@pytest.fixture(autouse=True)
def _reset_calls():
    CALLS.clear()


def tool(name: str, value=None):
    CALLS[name] += 1
    return {"tool": name, "value": value}


def effect_fn(what: str, *, idempotency_key: str):
    CALLS[f"effect:{what}"] += 1
    CALLS[f"key:{idempotency_key}"] += 1
    return {"sent": what}


def agent(name: str, **kwargs) -> Agent:
    registry.unregister(name)
    return Agent(name, **kwargs)


# --- pipelines, checkpoints and the journal ---------------------------------------------------


def test_pipeline_checkpoints_every_step_and_verifies():
    def first(state, ctx):
        state["log"] = ["first"]

    def second(state, ctx):
        state["log"].append("second")

    def third(state, ctx):
        state["log"].append("third")

    agent("x-pipe", steps=[first, second, third])
    run = operations.start("x-pipe", {"topic": "t"}, by="alice", reason="test")
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED
    assert state_of(run.id) == {"topic": "t", "log": ["first", "second", "third"]}
    cps = list(Checkpoint.objects.filter(run=run).order_by("seq"))
    assert [(c.step, c.next_step) for c in cps] == [
        ("", "first"),
        ("first", "second"),
        ("second", "third"),
        ("third", ""),
    ]
    assert operations.verify(run.id)[0].ok
    assert Event.objects.get(run=run, kind=EventKind.CREATED).actor == "alice"


@pytest.mark.smoke
def test_a_snapshot_that_fails_after_its_commit_does_not_rerun_the_step(faults):
    """The checkpoint committed; only its snapshot (written after it, and on the step's own
    path on SQLite) failed. Running the step again would apply it twice."""

    def grow(state, ctx):
        CALLS["grow"] += 1
        state["n"] += 1
        state["blob"] = f"{state['n']}" * 70_000  # past the inline size: a separate write
        return "grow" if state["n"] < 4 else None

    agent("snapshot-fails", steps={"grow": grow}, initial_state=lambda i: {"n": 0, "blob": ""})
    faults.set({"point": "in_snapshot", "action": "raise"})
    run = drive(operations.start("snapshot-fails", {}).id)
    assert faults.fired() == 1
    assert run.status == RunStatus.SUCCEEDED
    assert state_of(run.id)["n"] == 4 and CALLS["grow"] == 4
    assert [cp.step for cp in Checkpoint.objects.filter(run=run).order_by("seq")][1:] == [
        "grow"
    ] * 4


def test_crash_after_a_call_before_its_record_reruns_only_that_call(faults):
    def step(state, ctx):
        state["a"] = ctx.call("a", tool, "a")
        state["b"] = ctx.call("b", tool, "b")
        state["c"] = ctx.call("c", tool, "c")

    agent("x-journal", steps=[step])
    faults.set({"point": "after_call", "when": {"key": "b"}, "action": "crash"})
    run = operations.start("x-journal", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    # "a" was recorded before the crash and replayed; "b" ran, died unrecorded, ran again.
    assert Counter({"a": 1, "b": 2, "c": 1}) == CALLS
    assert faults.fired() == 1
    recovered = Event.objects.filter(run=run, kind=EventKind.RECOVERED).count()
    assert recovered == 1


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="a process found gone by its liveness lock"
)
def test_work_lost_runs_to_the_failure_not_to_the_last_heartbeat(faults, settings):
    """Heartbeats a third of a lease apart: a crash 1.5 s into a step whose last heartbeat
    was at its claim lost those 1.5 s, and the run was resumed at once."""
    settings.DURABILITY_HEARTBEAT_SECONDS = 3.5

    def slow(name: str) -> str:
        time.sleep(1.5)
        return name

    def step(state, ctx):
        state["a"] = ctx.call("a", slow, "a")

    agent("x-lost-work", steps=[step])
    faults.set({"point": "after_call", "when": {"key": "a"}, "action": "crash"})
    run = operations.start("x-lost-work", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    recovered = json.loads(Event.objects.get(run=run, kind=EventKind.RECOVERED).data)
    assert 1300 < recovered["work_lost_ms"] < 5000, recovered
    assert recovered["recovery_ms"] < 1000, recovered
    assert recovered["why"] == "process gone"


def test_repeated_keys_in_one_step_are_separate_records_and_loops_do_not_replay():
    a = agent("x-loop")

    @a.step(start=True)
    def again(state, ctx):
        state.setdefault("seen", []).append(
            [ctx.call("q", tool, "q", "q1")["value"], ctx.call("q", tool, "q", "q2")["value"]]
        )
        return "again" if len(state["seen"]) < 3 else END

    run = operations.start("x-loop", {})
    drive(run.id)
    assert state_of(run.id)["seen"] == [["q1", "q2"]] * 3
    assert CALLS["q"] == 6
    assert JournalEntry.objects.filter(run=run).count() == 6


def test_replay_with_other_arguments_is_a_nondeterminism_error(faults):
    flips = iter(["first", "second"])

    def step(state, ctx):
        ctx.call("lookup", tool, "lookup", next(flips))
        ctx.call("after", tool, "after")

    agent("x-nondet", steps=[step])
    faults.set({"point": "after_call", "when": {"key": "after"}, "action": "crash"})
    run = operations.start("x-nondet", {})
    done = drive(run.id)
    assert done.status == RunStatus.FAILED
    assert done.error_code == "DUR400"
    assert "different arguments" in done.error


def test_number_type_changes_are_committed_exactly():
    def step(state, ctx):
        state["flags"]["on"] = True
        state["vals"][0] = 1.0

    agent("x-types", steps=[step])
    run = operations.start("x-types", {"flags": {"on": 1}, "vals": [1]})
    drive(run.id)
    state = state_of(run.id)
    assert state["flags"]["on"] is True and isinstance(state["vals"][0], float)
    assert operations.verify(run.id)[0].ok


# --- effects --------------------------------------------------------------------------------------


def test_effect_runs_once_and_a_rerun_returns_its_result(faults):
    def step(state, ctx):
        state["receipt"] = ctx.effect("send", effect_fn, "mail")
        state["after"] = ctx.call("after", tool, "after")

    agent("x-effect", steps=[step])
    faults.set({"point": "after_call", "when": {"key": "after"}, "action": "crash"})
    run = operations.start("x-effect", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert CALLS["effect:mail"] == 1
    effect = Effect.objects.get(run=run)
    assert effect.status == EffectStatus.DONE and effect.duplicates_prevented == 1
    assert CALLS[f"key:{effect.idempotency_key}"] == 1


def test_effect_whose_outcome_is_unknown_waits_in_doubt_until_resolved(faults):
    def step(state, ctx):
        state["receipt"] = ctx.effect("charge", effect_fn, "card")

    agent("x-doubt", steps=[step])
    faults.set({"point": "after_effect", "action": "crash"})
    run = operations.start("x-doubt", {})
    waiting = drive(run.id)
    assert (waiting.status, waiting.wait_reason) == (RunStatus.WAITING, "in_doubt")
    effect = Effect.objects.get(run=run)
    assert effect.status == EffectStatus.IN_DOUBT
    assert CALLS["effect:card"] == 1
    operations.resolve_effect(
        run.id,
        effect.pk,
        outcome="done",
        result={"sent": "card"},
        by="ops",
        note="checked the provider",
    )
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert CALLS["effect:card"] == 1
    assert state_of(run.id)["receipt"] == {"sent": "card"}


def test_an_effect_being_performed_cannot_be_resolved():
    """Pending while its run runs is not in doubt: a worker performs it now, and its outcome
    would overwrite the operator's. Refused, nothing changed; the worker's outcome stands."""
    from durability.errors import InvalidTransition

    refused: list[str] = []

    def charge(what: str, *, idempotency_key: str):
        run_id = idempotency_key.split(":")[0]
        effect = Effect.objects.get(run_id=run_id)
        assert effect.status == EffectStatus.PENDING
        try:
            operations.resolve_effect(run_id, effect.pk, outcome="failed", by="ops")
        except InvalidTransition as exc:
            refused.append(str(exc))
        return {"charged": what}

    def step(state, ctx):
        state["receipt"] = ctx.effect("charge", charge, "card")

    agent("x-busy", steps=[step])
    run = operations.start("x-busy", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert len(refused) == 1 and "'charge' is being performed now by " in refused[0], refused
    assert "nothing was changed" in refused[0]
    assert Effect.objects.get(run=run).status == EffectStatus.DONE
    assert not Event.objects.filter(run=run, kind="effect_resolved").exists()
    assert state_of(run.id)["receipt"] == {"charged": "card"}


def test_an_outcome_recorded_after_the_run_was_suspended_in_doubt_wakes_it():
    """The worker doing the effect lost the run meanwhile (a heartbeat that failed), and the
    worker that took it over found the effect unfinished and suspended the run in doubt.
    The first worker's late result is the outcome: it wakes the run, which goes on with it."""
    from django.db.models import F

    def charge(what: str, *, idempotency_key: str):
        CALLS["charge"] += 1
        run_id = idempotency_key.split(":")[0]
        # What the worker that took the run over writes, while this call is in flight.
        Run.objects.filter(pk=run_id).update(
            status=RunStatus.WAITING,
            wait_reason="in_doubt",
            lease_token=F("lease_token") + 1,
            lease_owner="",
        )
        Effect.objects.filter(run_id=run_id).update(status=EffectStatus.IN_DOUBT)
        return {"charged": what}

    def step(state, ctx):
        state["receipt"] = ctx.effect("charge", charge, "card")

    agent("x-late", steps=[step])
    run = operations.start("x-late", {})
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, (done.status, done.wait_reason)
    assert CALLS["charge"] == 1 and state_of(run.id)["receipt"] == {"charged": "card"}
    assert Effect.objects.get(run=run).status == EffectStatus.DONE


def test_the_sweeper_wakes_a_run_in_doubt_whose_outcome_became_known(faults):
    from durability import recovery

    def step(state, ctx):
        state["receipt"] = ctx.effect("charge", effect_fn, "card")

    agent("x-doubt-late", steps=[step])
    faults.set({"point": "after_effect", "action": "crash"})
    run = operations.start("x-doubt-late", {})
    assert drive(run.id).wait_reason == "in_doubt"
    recovery.sweep()
    assert Run.objects.get(pk=run.id).wait_reason == "in_doubt"  # still unknown: stays
    # A late write of the outcome whose wake-up did not get through.
    Effect.objects.filter(run=run).update(status=EffectStatus.DONE, result='{"sent":"card"}')
    recovery.sweep()
    assert Run.objects.get(pk=run.id).status == RunStatus.QUEUED
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert CALLS["effect:card"] == 1 and state_of(run.id)["receipt"] == {"sent": "card"}


def test_idempotent_effect_is_repeated_with_the_same_key(faults):
    def step(state, ctx):
        state["receipt"] = ctx.effect("put", effect_fn, "doc", idempotent=True)

    agent("x-idem", steps=[step])
    faults.set({"point": "after_effect", "action": "crash"})
    run = operations.start("x-idem", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    key = Effect.objects.get(run=run).idempotency_key
    assert CALLS["effect:doc"] == 2 and CALLS[f"key:{key}"] == 2


def test_reconcile_settles_an_unknown_outcome(faults):
    def step(state, ctx):
        state["r"] = ctx.effect("pay", effect_fn, "x", reconcile=lambda key: {"found": key})

    agent("x-reconcile", steps=[step])
    faults.set({"point": "after_effect", "action": "crash"})
    run = operations.start("x-reconcile", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["r"]["found"] == Effect.objects.get(run=run).idempotency_key
    assert CALLS["effect:x"] == 1


def test_reconcile_not_done_performs_the_effect(faults):
    def step(state, ctx):
        state["r"] = ctx.effect("pay", effect_fn, "y", reconcile=lambda key: NOT_DONE)

    agent("x-notdone", steps=[step])
    faults.set({"point": "after_intent", "action": "crash"})
    run = operations.start("x-notdone", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert CALLS["effect:y"] == 1


# --- approvals ----------------------------------------------------------------------------------


def _approval_agent(name):
    def ask(state, ctx):
        state["draft"] = ctx.call("draft", tool, "draft", "d")["value"]
        decision = ctx.approval("send", {"amount": state["amount"]})
        state["decision"] = [decision.approved, decision.by, decision.comment, decision.payload]

    return agent(name, steps=[ask])


def test_approval_suspends_without_a_worker_and_the_decision_replays():
    _approval_agent("x-approve")
    run = operations.start("x-approve", {"amount": 50})
    waiting = drive(run.id)
    assert (waiting.status, waiting.wait_reason, waiting.lease_owner) == (
        RunStatus.WAITING,
        "approval",
        "",
    )
    assert waiting.head_seq == 0  # nothing committed by a suspension
    operations.decide(run.id, "send", approve=True, by="bob", comment="fine")
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["decision"] == [True, "bob", "fine", {"amount": 50}]
    assert CALLS["draft"] == 1


def test_approve_with_edits_returns_the_edited_payload():
    _approval_agent("x-edit")
    run = operations.start("x-edit", {"amount": 50})
    drive(run.id)
    operations.decide(run.id, "send", approve=True, by="bob", payload={"amount": 40})
    drive(run.id)
    assert state_of(run.id)["decision"][3] == {"amount": 40}


def test_a_different_payload_asks_anew():
    def ask(state, ctx):
        amount = ctx.call("amount", tool, "a")  # recorded; then the state decides the payload
        decision = ctx.approval("refund", {"eur": state["eur"], "n": amount["tool"]})
        state["ok"] = decision.approved

    agent("x-anew", steps=[ask])
    run = operations.start("x-anew", {"eur": 50})
    drive(run.id)
    first = Approval.objects.get(run=run)
    # An operator forks with a bigger amount: the old decision must not carry over.
    operations.decide(run.id, "refund", approve=True, by="bob")
    fork = operations.fork(run.id, 0, state={"eur": 5000})
    assert drive(fork.id).status == RunStatus.WAITING
    assert Approval.objects.get(run=fork).payload != first.payload


def test_second_decision_is_refused_and_changes_nothing():
    _approval_agent("x-twice")
    run = operations.start("x-twice", {"amount": 1})
    drive(run.id)
    operations.decide(run.id, "send", approve=False, by="bob", comment="no")
    before = Approval.objects.get(run=run)
    with pytest.raises(Exception) as err:
        operations.decide(run.id, "send", approve=True, by="eve")
    assert "already rejected by bob" in str(err.value)
    after = Approval.objects.get(run=run)
    assert (after.status, after.decided_by) == (before.status, before.decided_by)


# --- retries, failures, timeouts ----------------------------------------------------------------


def test_transient_errors_are_retried_with_backoff_without_a_sleeping_worker():
    def step(state, ctx):
        CALLS["attempt"] += 1
        if ctx.retry < 2:
            raise Transient("503")
        state["ok"] = True

    agent("x-flaky", steps=[step], retry=RetryPolicy(base=0.05, cap=0.1))
    run = operations.start("x-flaky", {})
    execute_once = __import__("durability.runtime.executor", fromlist=["execute"]).execute
    assert execute_once(run.id) == "retry"
    queued = Run.objects.get(pk=run.id)
    assert (queued.status, queued.wait_reason, queued.lease_owner) == ("queued", "retry", "")
    assert queued.wake_at is not None
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert CALLS["attempt"] == 3
    assert Event.objects.filter(run=run, kind=EventKind.RETRY_SCHEDULED).count() == 2


def test_retries_exhausted_fail_the_run_with_the_last_error():
    def step(state, ctx):
        raise Transient("still down")

    agent("x-exhaust", steps=[step], retry=RetryPolicy(max_retries=2, base=0.01, cap=0.02))
    run = operations.start("x-exhaust", {})
    done = drive(run.id)
    assert done.status == RunStatus.FAILED and done.error_code == "DUR502"
    assert "failed 3 times" in done.error and "still down" in done.error


def test_agent_declared_transient_types_are_retried():
    def step(state, ctx):
        if ctx.retry == 0:
            raise ConnectionResetError("reset")
        state["ok"] = True

    agent("x-typed", steps=[step], retry=RetryPolicy(transient=(ConnectionError,), base=0.01))
    run = operations.start("x-typed", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED


def test_permanent_error_fails_with_traceback_recorded():
    def step(state, ctx):
        raise ValueError("bad plan")

    agent("x-perm", steps=[step])
    run = operations.start("x-perm", {})
    done = drive(run.id)
    assert done.status == RunStatus.FAILED
    assert done.error == "ValueError: bad plan"
    event = Event.objects.get(run=run, kind=EventKind.FAILED)
    assert "traceback" in event.data and "bad plan" in event.data


def test_step_timeout_is_transient():
    def step(state, ctx):
        if ctx.retry == 0:
            time.sleep(5)
        state["ok"] = True

    agent("x-timeout", steps=[step], step_timeout=0.2, retry=RetryPolicy(base=0.01))
    run = operations.start("x-timeout", {})
    started = time.monotonic()
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert time.monotonic() - started < 4
    assert "StepTimeout" in Event.objects.get(run=run, kind=EventKind.RETRY_SCHEDULED).data


# --- validation, limits, secrets ----------------------------------------------------------------


class Counted(BaseModel):
    count: int


def test_invalid_state_is_never_committed():
    def step(state, ctx):
        state["count"] = "many"

    agent("x-schema", steps=[step], schema=Counted)
    run = operations.start("x-schema", {"count": 1})
    done = drive(run.id)
    assert done.status == RunStatus.FAILED and done.error_code == "DUR102"
    assert "count" in done.error
    assert done.head_seq == 0 and Checkpoint.objects.filter(run=run).count() == 1


@pytest.mark.parametrize(
    "poison, code",
    [
        (float("nan"), "DUR103"),
        ({1, 2}, "DUR103"),
    ],
)
def test_state_that_is_not_json_fails_the_run(poison, code):
    def step(state, ctx):
        state["x"] = poison

    agent("x-notjson", steps=[step])
    run = operations.start("x-notjson", {})
    done = drive(run.id)
    assert (done.status, done.error_code) == (RunStatus.FAILED, code)
    assert "/x" in done.error


def test_oversized_state_fails_the_run(settings):
    settings.DURABILITY_MAX_STATE_BYTES = 10_000

    def step(state, ctx):
        state["blob"] = "x" * 20_000

    agent("x-big", steps=[step])
    run = operations.start("x-big", {})
    done = drive(run.id)
    assert done.error_code == "DUR104" and "20,0" in done.error


def test_secrets_never_reach_the_database(monkeypatch):
    monkeypatch.setenv("X_TOKEN", "sk-live-0123456789")

    def step(state, ctx):
        key = ctx.secret("X_TOKEN")
        state["config"] = {"api_key": key, "endpoint": "https://example"}
        state["note"] = f"called with Bearer {key}"
        state["echo"] = ctx.call("echo", tool, key)

    agent("x-secret", steps=[step])
    run = operations.start("x-secret", {"password": "hunter2"})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    state = state_of(run.id)
    assert state["config"]["api_key"] == "[redacted]"
    assert state["note"] == "called with Bearer [redacted]"
    assert state["password"] == "[redacted]"
    with connection.cursor() as cur:
        for table in (
            "durability_run",
            "durability_snapshot",
            "durability_mutation",
            "durability_journalentry",
            "durability_event",
        ):
            cur.execute(f"SELECT * FROM {table}")  # noqa: S608 - fixed table names
            text = repr(cur.fetchall())
            assert "sk-live-0123456789" not in text, table
            assert "hunter2" not in text, table


def test_missing_secret_fails_clearly():
    def step(state, ctx):
        ctx.secret("NOT_SET_ANYWHERE")

    agent("x-nosecret", steps=[step])
    run = operations.start("x-nosecret", {})
    done = drive(run.id)
    assert done.error_code == "DUR601" and "NOT_SET_ANYWHERE" in done.error


# --- schema upgrades, poison steps, timers, snapshots ---------------------------------------------


def test_older_checkpoint_is_upgraded_when_rehydrated_by_newer_code():
    def ask(state, ctx):
        ctx.approval("go", {})
        state["done"] = True

    agent("x-upgrade", steps=[ask], schema_version=1)
    run = operations.start("x-upgrade", {"name": "a"})
    drive(run.id)
    agent(
        "x-upgrade",
        steps=[ask],
        schema_version=2,
        version="2",
        upgrades={1: lambda s: {"names": [s["name"]]}},
    )
    operations.decide(run.id, "go", approve=True, by="bob")
    assert drive(run.id).status == RunStatus.SUCCEEDED
    upgraded = Checkpoint.objects.get(run=run, seq=1)
    assert upgraded.schema_version == 2 and Snapshot.objects.filter(checkpoint=upgraded).exists()
    assert Approval.objects.filter(run=run).count() == 1  # the decision carried over
    assert state_of(run.id) == {"names": ["a"], "done": True}
    assert operations.verify(run.id)[0].ok


def test_missing_upgrade_is_refused_by_name():
    def ask(state, ctx):
        ctx.approval("go", {})

    agent("x-noupgrade", steps=[ask], schema_version=1)
    run = operations.start("x-noupgrade", {})
    drive(run.id)
    agent("x-noupgrade", steps=[ask], schema_version=3, upgrades={2: lambda s: s})
    operations.decide(run.id, "go", approve=True, by="bob")
    done = drive(run.id)
    assert done.status == RunStatus.FAILED
    assert "no upgrade from schema version 1 to 2" in done.error


def test_a_step_that_keeps_killing_its_worker_fails_as_poison(faults, settings):
    settings.DURABILITY_POISON_ATTEMPTS = 3

    def step(state, ctx):
        CALLS["tries"] += 1

    agent("x-poison", steps=[step])
    faults.set({"point": "before_step", "action": "crash", "repeat": True})
    run = operations.start("x-poison", {})
    done = drive(run.id)
    assert done.status == RunStatus.FAILED and done.error_code == "DUR500"
    assert "claimed 3 times" in done.error


def test_durable_sleep_releases_the_worker_and_wakes_when_due():
    agent_def = registry.get("test-sleeper")
    assert agent_def is not None
    run = operations.start("test-sleeper", {"seconds": 0.3})
    from durability.runtime.executor import execute

    assert execute(run.id) == "suspended"
    waiting = Run.objects.get(pk=run.id)
    assert (waiting.status, waiting.wait_reason, waiting.lease_owner) == ("waiting", "timer", "")
    assert execute(run.id) == "skipped"  # not due yet
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["woke"] is True


def test_snapshots_keep_rebuilds_under_twice_the_state():
    def grow(state, ctx):
        state["items"].append("x" * 500)
        state["items"] = state["items"][-10:]  # the state stays small; deltas pile up
        return "grow" if len(state["log"]) < 60 and not state["log"].append(1) else END

    a = agent("x-snap", start="grow")
    a.step(grow)
    run = operations.start("x-snap", {"items": [], "log": []})
    drive(run.id)
    from durability import checkpoints

    snapped = Snapshot.objects.filter(checkpoint__run=run).count()
    assert snapped > 2
    for cp in Checkpoint.objects.filter(run=run):
        rebuilt = checkpoints.rebuild(cp.id)
        assert rebuilt.bytes_read < 2 * cp.size + 600, (cp.seq, rebuilt.bytes_read, cp.size)
    assert operations.verify(run.id)[0].ok


def test_cancel_fences_out_the_worker_at_its_next_commit():
    import threading

    release = threading.Event()

    def wait_for_cancel(state, ctx):
        release.wait(10)
        state["late"] = True

    agent("x-cancel", steps=[wait_for_cancel])
    run = operations.start("x-cancel", {})
    from durability.runtime.executor import execute

    outcome = []

    def work():
        try:
            outcome.append(execute(run.id))
        finally:
            connection.close()

    worker = threading.Thread(target=work)
    worker.start()
    from durability.testing import wait_until

    wait_until(lambda: Run.objects.get(pk=run.id).status == RunStatus.RUNNING)
    operations.cancel(run.id, by="ops", reason="stop")
    release.set()
    worker.join(10)
    assert outcome == ["lost"]
    assert Run.objects.get(pk=run.id).status == RunStatus.CANCELLED
    assert Checkpoint.objects.filter(run=run).count() == 1


def test_schema_violation_type_is_exported():
    assert issubclass(SchemaViolation, Exception)


def test_a_crash_after_earlier_commits_counts_as_an_attempt(faults):
    seen = []

    def one(state, ctx):
        seen.append(("one", ctx.attempt))

    def two(state, ctx):
        seen.append(("two", ctx.attempt))

    def three(state, ctx):
        seen.append(("three", ctx.attempt))

    agent("x-attempts", steps=[one, two, three])
    faults.set({"point": "before_step", "when": {"step": "three"}, "action": "crash"})
    run = operations.start("x-attempts", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    # The same execution ran one and two; three died once and was attempt 2 on recovery.
    assert seen == [("one", 1), ("two", 1), ("three", 2)]


def test_checkpoints_record_what_wrote_them():
    def step(state, ctx):
        state["x"] = 1

    agent("x-fingerprint", steps=[step], packages=["pydantic", "no-such-package"])
    run = operations.start("x-fingerprint", {})
    drive(run.id)
    cps = list(Checkpoint.objects.filter(run=run).order_by("seq"))
    assert all(len(cp.config_hash) == 16 for cp in cps)
    assert len({cp.config_hash for cp in cps}) == 1
    import pydantic

    assert f'"pydantic":"{pydantic.VERSION}"' in cps[-1].packages
    assert '"no-such-package":"missing"' in cps[-1].packages


def test_a_version_that_cannot_continue_a_checkpoint_hands_the_run_back():
    def ask(state, ctx):
        ctx.approval("go", {})
        state["done"] = True

    agent("x-versions", steps=[ask], version="1")
    run = operations.start("x-versions", {})
    drive(run.id)
    operations.decide(run.id, "go", approve=True, by="ops")
    agent("x-versions", steps=[ask], version="2")  # same schema, no compatibility declared
    from durability.runtime.executor import execute

    assert execute(run.id) == "yielded"
    waiting = Run.objects.get(pk=run.id)
    assert (waiting.status, waiting.wait_reason) == (RunStatus.QUEUED, "version")
    assert "x-versions@1" in waiting.wait_detail and "x-versions@2" in waiting.wait_detail
    assert waiting.wake_at is not None and Checkpoint.objects.filter(run=run).count() == 1
    # Declaring version 1 compatible lets version 2 continue it.
    agent("x-versions", steps=[ask], version="2", compatible_versions=["1"])
    Run.objects.filter(pk=run.id).update(wake_at=None)
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert Checkpoint.objects.get(run=run, seq=1).agent_version == "2"


def test_a_worker_without_the_agent_hands_the_run_back_instead_of_failing_it():
    def step(state, ctx):
        state["ok"] = True

    agent("x-elsewhere", steps=[step])
    run = operations.start("x-elsewhere", {})
    registry.unregister("x-elsewhere")  # this process now plays an older deploy's worker
    from durability.runtime.executor import execute

    assert execute(run.id) == "yielded"
    waiting = Run.objects.get(pk=run.id)
    assert (waiting.status, waiting.wait_reason) == (RunStatus.QUEUED, "version")
    assert "has no agent 'x-elsewhere'" in waiting.wait_detail
    agent("x-elsewhere", steps=[step])
    assert drive(run.id).status == RunStatus.SUCCEEDED


def test_a_delivery_that_finds_the_lock_of_a_run_handed_back_rings_again():
    """The worker that yielded a slice rang before letting go of the run's lock: the
    delivery that lands in between must not be dropped until the sweeper rings again."""
    import threading

    from django.db import connection as thread_connection

    from durability import dispatch, leases
    from durability.runtime import executor
    from workers.dispatcher import publish

    def step(state, ctx):
        state["done"] = True

    agent("x-busy", steps=[step])
    run = operations.start("x-busy", {})
    rung: list = []
    locked, release = threading.Event(), threading.Event()

    def holder():
        lock = leases.LivenessLock(run.id)
        try:
            assert lock.acquire()
            locked.set()
            release.wait(30)
            lock.release()
        finally:
            thread_connection.close()

    thread = threading.Thread(target=holder)
    thread.start()
    dispatch.set_dispatcher(lambda run_id, delay: rung.append((run_id, delay)))
    try:
        assert locked.wait(10)
        assert executor.execute(run.id) == executor.Outcome.BUSY
        assert rung == [(str(run.id), 0.5)]
        # A live worker holding the lease: the delivery is a duplicate, dropped.
        Run.objects.filter(pk=run.id).update(status=RunStatus.RUNNING, lease_owner="w:1")
        assert executor.execute(run.id) == executor.Outcome.BUSY
        assert len(rung) == 1
    finally:
        dispatch.set_dispatcher(publish)
        release.set()
        thread.join()


def test_the_sweeper_ends_a_session_that_keeps_a_queued_run_locked(settings):
    """Queued and unclaimed for longer than the requeue interval, yet its lock is held: the
    holder stalled (an ending at recovery that failed, a stop between lock and claim)."""
    import threading
    from datetime import timedelta

    from django.db import connection as thread_connection
    from django.utils import timezone

    from durability import leases, recovery

    def step(state, ctx):
        state["done"] = True

    agent("x-locked", steps=[step])
    run = operations.start("x-locked", {})
    locked, release = threading.Event(), threading.Event()
    seen: list = []

    def stalled():
        lock = leases.LivenessLock(run.id)
        try:
            assert lock.acquire()
            locked.set()
            release.wait(30)
            with thread_connection.cursor() as cur:
                cur.execute("SELECT 1")
        except Exception as exc:  # its session was ended under it
            seen.append(type(exc).__name__)
        finally:
            thread_connection.close()

    thread = threading.Thread(target=stalled)
    thread.start()
    try:
        assert locked.wait(10)
        Run.objects.filter(pk=run.id).update(rung_at=timezone.now() - timedelta(minutes=5))
        assert leases.live_owners([run.id]) == {str(run.id)}
        # Stalled means idle past a heartbeat interval and a margin: a holder that took the
        # lock a moment ago is about to claim, and is never ended (tests/test_liveness.py).
        settings.DURABILITY_RECONNECT_MARGIN_SECONDS = 0.5
        time.sleep(leases.settle_seconds() + 0.2)
        recovery.sweep()
        # pg_terminate_backend signals the session; the lock goes when it has exited.
        wait_until(lambda: not leases.live_owners([run.id]), timeout=10, what="the lock")
    finally:
        release.set()
        thread.join()
    assert seen == ["OperationalError"]
    assert drive(run.id).status == RunStatus.SUCCEEDED


def test_commits_the_server_lost_in_a_crash_are_not_built_on():
    """The relaxed level: a server that crashed lost the commits it had not flushed. The
    worker, once the database answers again, must not go on from the head it holds in
    memory (its journal records would point at a checkpoint that is gone)."""
    from django.db import OperationalError

    crashed: list = []

    def step(state, ctx):
        state["n"] = state.get("n", 0) + 1
        if state["n"] == 3 and not crashed:
            crashed.append(True)
            run_id = ctx.run_id
            # The previous step's commit may still be on its way (sent ahead): the crash
            # loses it once it has landed.
            wait_until(
                lambda: Checkpoint.objects.filter(run_id=run_id, seq=ctx.seq).exists(),
                what="the previous step's checkpoint",
            )
            lost = Checkpoint.objects.filter(run_id=run_id).order_by("-seq").first()
            Event.objects.filter(run_id=run_id, seq=lost.seq).delete()
            Checkpoint.objects.filter(pk=lost.pk).delete()
            Run.objects.filter(pk=run_id).update(head_seq=lost.seq - 1)
            raise OperationalError("server closed the connection unexpectedly")
        ctx.call(f"llm-{state['n']}", tool, state["n"])
        return "step" if state["n"] < 5 else None

    agent("x-lost-commits", steps={"step": step}, initial_state=lambda i: {})
    run = operations.start("x-lost-commits", {})
    done = drive(run.id)
    assert done.status == RunStatus.SUCCEEDED, (done.status, done.error)
    assert state_of(run.id)["n"] == 5
    assert operations.verify(run.id)[0].ok


@pytest.mark.skipif(connection.vendor != "postgresql", reason="psycopg's session state")
def test_a_step_abandoned_in_a_query_hands_the_run_back_on_a_new_session():
    """The shutdown grace period ends (``Abandon``, raised by a signal) while the step waits
    on a query: the query is cancelled, not left running on a busy session, and the run is
    handed back all the same."""
    import os
    import signal
    import threading

    from durability.runtime.executor import Outcome, execute
    from workers import shutdown

    a = agent("x-abandon-in-query")

    @a.step(start=True)
    def slow(state, ctx):
        with connection.cursor() as cur:
            cur.execute("SELECT pg_sleep(30)")
        return END

    run = operations.start("x-abandon-in-query", {})
    previous = signal.signal(signal.SIGUSR2, shutdown._on_grace_over)
    timer = threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGUSR2))
    started = time.monotonic()
    try:
        timer.start()
        with shutdown.executing():
            outcome = execute(run.id, worker="test-worker")
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR2, previous)
    assert outcome == Outcome.YIELDED
    assert time.monotonic() - started < 10
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    assert Event.objects.filter(run=run, kind=EventKind.RELEASED).exists()

    def sleeping() -> bool:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)'"
                " AND state = 'active'"
            )
            return cur.fetchone()[0] == 0

    wait_until(sleeping, timeout=5)
