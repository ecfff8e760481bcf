"""Durability levels: what each commit waits for, and what each refuses."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from durability import END, Agent, DurabilityPolicy, checkpoints, operations, registry
from durability.errors import AgentDefinitionError, InvalidInput
from durability.models import Checkpoint, Run, RunStatus
from durability.testing import drive, state_of
from tests.commit_helpers import empty_commit

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def agents():
    registry.unregister("x-relaxed")
    agent = Agent("x-relaxed", durability="relaxed", initial_state=lambda inp: {"n": 0})

    @agent.step(start=True)
    def count(state, ctx):
        state["n"] += 1
        return "count" if state["n"] < 5 else END


def _commit_in_a_transaction(run: Run, level: str) -> str:
    """Commit one checkpoint at ``level`` inside a transaction and read the setting the
    commit will be made with."""
    Run.objects.filter(pk=run.pk).update(lease_token=7, status=RunStatus.RUNNING)
    commit = empty_commit(run, 7, "count", durability=level)
    with transaction.atomic():
        checkpoints.commit_step(commit)
        with connection.cursor() as cur:
            cur.execute("SHOW synchronous_commit")
            return cur.fetchone()[0]


def test_relaxed_commits_do_not_wait_for_the_flush_and_strict_ones_do():
    if connection.vendor != "postgresql":
        pytest.skip("synchronous_commit is PostgreSQL's")
    relaxed = operations.start("x-relaxed", {})
    assert relaxed.durability == "relaxed"
    assert _commit_in_a_transaction(relaxed, "relaxed") == "off"
    strict = operations.start("x-relaxed", {}, durability="strict")
    assert _commit_in_a_transaction(strict, "strict") == "on"


def test_a_relaxed_run_checkpoints_and_verifies():
    run = operations.start("x-relaxed", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id) == {"n": 5}
    assert operations.verify(run.id)[0].ok


def test_replicated_without_a_standby_is_refused_clearly():
    before = Run.objects.count()
    with pytest.raises(InvalidInput) as err:
        operations.start("x-relaxed", {}, durability="replicated")
    assert "durability 'replicated' is not available here" in str(err.value)
    assert "standby" in str(err.value) or "not PostgreSQL" in str(err.value)
    assert Run.objects.count() == before


def test_unknown_levels_are_refused():
    with pytest.raises(InvalidInput):
        operations.start("x-relaxed", {}, durability="eventually")
    with pytest.raises(AgentDefinitionError):
        Agent("x-bad-level", durability="sometimes", register=False)


# --- periodic ---------------------------------------------------------------------------------

CALLS: dict[str, int] = {}


def tool(name: str) -> dict:
    CALLS[name] = CALLS.get(name, 0) + 1
    return {"name": name}


def send(what: str, *, idempotency_key: str) -> dict:
    CALLS[f"effect {what}"] = CALLS.get(f"effect {what}", 0) + 1
    return {"sent": what}


@pytest.fixture
def periodic():
    CALLS.clear()
    registry.unregister("x-periodic")
    agent = Agent(
        "x-periodic",
        durability=DurabilityPolicy("periodic", every_steps=3, every_seconds=60),
        initial_state=lambda inp: {"i": 0, "seen": []},
    )

    @agent.step(start=True)
    def work(state, ctx):
        i = state["i"]
        state["seen"].append(ctx.call("look", tool, f"look {i}")["name"])
        if i == ctx.input.get("effect_at"):
            ctx.effect("send", send, f"at {i}")
            ctx.call("after", tool, f"after {i}")
        if i == ctx.input.get("approve_at"):
            state["approved"] = ctx.approval("go", {"i": i}).approved
        state["i"] = i + 1
        return "work" if state["i"] < 7 else END

    return agent


def test_periodic_checkpoints_every_n_steps(periodic):
    run = operations.start("x-periodic", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["i"] == 7
    # #0 the start, then after steps 3 and 6, and the end.
    assert Checkpoint.objects.filter(run=run).count() == 4
    assert all(n == 1 for n in CALLS.values()) and len(CALLS) == 7
    assert operations.verify(run.id)[0].ok


def test_a_crash_mid_period_re_executes_the_steps_in_memory_with_calls_replayed(periodic, faults):
    # #1 is written after steps 0-2; steps 3 and 4 then run in memory under #1 (their calls
    # are occurrences 0 and 1 of "look"); the worker dies in step 5 after its call returned.
    faults.set(
        {"point": "after_call", "when": {"key": "look", "seq": 1, "occ": 2}, "action": "crash"}
    )
    run = operations.start("x-periodic", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert faults.fired() == 1
    assert Checkpoint.objects.get(run=run, seq=1).step == "work"
    assert state_of(run.id)["seen"] == [f"look {i}" for i in range(7)]
    # Steps 3 and 4 ran again with their calls replayed; only step 5's unrecorded call ran twice.
    assert CALLS["look 3"] == CALLS["look 4"] == 1
    assert CALLS["look 5"] == 2


def test_an_effect_forces_a_checkpoint_and_runs_once_across_a_crash(periodic, faults):
    faults.set({"point": "after_call", "when": {"key": "after"}, "action": "crash"})
    run = operations.start("x-periodic", {"effect_at": 4})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    forced = Checkpoint.objects.filter(run=run).exclude(replay_base=None)
    assert forced.count() == 1  # steps 3 (in memory) checkpointed before the effect of step 4
    assert CALLS["effect at 4"] == 1
    assert CALLS["look 4"] == 1  # recorded before the flush, replayed after the crash
    assert CALLS["after 4"] == 2  # the one call whose record the crash prevented
    assert operations.verify(run.id)[0].ok


def test_a_suspension_keeps_the_steps_in_memory(periodic):
    run = operations.start("x-periodic", {"approve_at": 4})
    waiting = drive(run.id)
    assert waiting.wait_reason == "approval"
    assert waiting.head_seq == 2  # #1 after steps 0-2, #2 forced before the approval
    operations.decide(run.id, "go", approve=True, by="ops")
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["approved"] is True
    assert all(n == 1 for n in CALLS.values()), CALLS


# --- the same promises on SQLite (the embedded default) -------------------------------------

FULL, NORMAL = 2, 1  # PRAGMA synchronous


def _pragma_recorder(seen: list[tuple[str, int, bool]]):
    """An execute wrapper: at each write the engine makes, the ``synchronous`` setting of the
    connection and whether a transaction is open (what COMMIT will run under), read on the
    same connection below Django (its own cursor would call this wrapper again)."""

    def record(execute, sql, params, many, context):
        if sql.startswith("INSERT INTO"):
            raw = context["connection"].connection
            table = sql.split('"')[1]
            value = raw.execute("PRAGMA synchronous").fetchone()[0]
            seen.append((table, value, raw.in_transaction))
        return execute(sql, params, many, context)

    return record


@pytest.mark.smoke
@pytest.mark.parametrize("level", ["strict", "relaxed", "periodic"])
def test_on_sqlite_each_level_commits_under_the_synchronous_setting_it_promises(level):
    if connection.vendor != "sqlite":
        pytest.skip("PRAGMA synchronous is SQLite's (PostgreSQL: the test above)")

    def pay(what: str, *, idempotency_key: str) -> dict:
        return {"paid": what}

    registry.unregister("x-levels")
    agent = Agent(
        "x-levels", durability=DurabilityPolicy(every_steps=2), initial_state=lambda inp: {"n": 0}
    )

    @agent.step(start=True)
    def count(state, ctx):
        state["n"] += 1
        if state["n"] == 2:
            ctx.effect("pay", pay, "once")
        return "count" if state["n"] < 4 else END

    seen: list[tuple[str, int, bool]] = []
    try:
        with connection.execute_wrapper(_pragma_recorder(seen)):
            run = operations.start("x-levels", {}, durability=level)
            assert drive(run.id).status == RunStatus.SUCCEEDED
    finally:
        registry.unregister("x-levels")
    step_commits = [v for table, v, _ in seen if table == "durability_checkpoint"][1:]
    assert step_commits, seen
    # Checkpoints commit under their level's setting, inside their transaction; the start
    # (an operator action) and the effect's intent always under FULL.
    assert set(step_commits) == {NORMAL if level == "relaxed" else FULL}, seen
    assert all(in_tx for _, _, in_tx in seen), seen
    outside = [(t, v) for t, v, _ in seen if t in ("durability_run", "durability_effect")]
    assert {t for t, _ in outside} == {"durability_run", "durability_effect"}, seen
    assert {v for _, v in outside} == {FULL}, seen
    assert [v for t, v, _ in seen if t == "durability_checkpoint"][0] == FULL  # the start
    with connection.cursor() as cur:  # and the connection is back at FULL afterwards
        cur.execute("PRAGMA synchronous")
        assert cur.fetchone()[0] == FULL
