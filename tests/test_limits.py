"""Limits every worker respects: at most K executing runs per agent, shared rate limits;
a run over a limit waits in the database, saying why."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from durability import END, Agent, Limits, operations, registry
from durability.errors import AgentDefinitionError
from durability.models import Event, EventKind, Run, RunStatus
from durability.testing import drive

pytestmark = pytest.mark.django_db(transaction=True)

STATE = {"in_flight": 0, "max": 0, "calls": []}
LOCK = threading.Lock()


def call_llm(n):
    with LOCK:
        STATE["calls"].append(time.monotonic())
    return {"n": n}


@pytest.fixture(autouse=True)
def agents():
    STATE.update(in_flight=0, max=0, calls=[])
    for name in ("x-slots", "x-rated"):
        registry.unregister(name)
    slots = Agent("x-slots", limits=Limits(max_concurrent=2))

    @slots.step(start=True)
    def busy(state, ctx):
        with LOCK:
            STATE["in_flight"] += 1
            STATE["max"] = max(STATE["max"], STATE["in_flight"])
        time.sleep(0.3)
        with LOCK:
            STATE["in_flight"] -= 1
        return END

    rated = Agent("x-rated", limits=Limits(calls={"llm": "x-llm"}))

    @rated.step(start=True)
    def ask(state, ctx):
        state["answer"] = ctx.call("llm", call_llm, state.get("n", 0))
        return END


def drive_all(run_ids, threads=6):
    def work(run_id):
        try:
            for _ in range(100):
                run = drive(run_id, max_wait=10)
                if run.is_finished:
                    return
                time.sleep(0.05)  # parked for a slot: try again
        finally:
            connection.close()

    pool = [threading.Thread(target=work, args=(r,)) for r in run_ids[:threads]]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)


def test_never_more_than_k_runs_of_an_agent_execute_at_once():
    runs = [operations.start("x-slots", {}).id for _ in range(6)]
    drive_all(runs)
    assert all(Run.objects.get(pk=r).status == RunStatus.SUCCEEDED for r in runs)
    assert STATE["max"] == 2


def test_a_run_over_the_limit_waits_in_the_database_saying_why():
    from durability.limits import agent_slot_taken

    first, second, third = (operations.start("x-slots", {}) for _ in range(3))
    Run.objects.filter(pk__in=[first.id, second.id]).update(status=RunStatus.RUNNING)
    from durability.runtime.executor import execute

    assert execute(third.id) == "skipped"
    parked = Run.objects.get(pk=third.id)
    assert (parked.status, parked.wait_reason) == (RunStatus.QUEUED, "concurrency")
    assert "2 of 2 x-slots runs are executing" in parked.wait_detail
    assert agent_slot_taken("x-slots", 2, third.id)


def test_a_shared_rate_limit_spaces_calls_and_waits_without_a_worker(settings):
    settings.DURABILITY_RATE_LIMITS = "x-llm=2/s"
    runs = [operations.start("x-rated", {"n": i}).id for i in range(6)]
    drive_all(runs)
    assert all(Run.objects.get(pk=r).status == RunStatus.SUCCEEDED for r in runs)
    calls = sorted(STATE["calls"])
    assert len(calls) == 6
    # Two at once (the bucket's capacity), then one every half second.
    assert calls[-1] - calls[0] >= 1.8
    waits = Event.objects.filter(kind=EventKind.SUSPENDED, data__contains="rate_limit")
    assert waits.count() >= 4


def test_undeclared_resources_and_bad_specs_are_clear_errors(settings):
    from durability import limits

    # Set in Django's settings, a bad spec is refused where it is used (the environment's
    # is refused at start, tests/test_settings.py).
    settings.DURABILITY_RATE_LIMITS = "x-llm=fast"
    with pytest.raises(AgentDefinitionError) as err:
        limits.take("x-llm")
    assert "'x-llm=fast' is not NAME=AMOUNT/PERIOD" in str(err.value)
    settings.DURABILITY_RATE_LIMITS = "x-llm=5/min"
    with pytest.raises(AgentDefinitionError):
        limits.take("other")
    with pytest.raises(AgentDefinitionError):
        Agent("x-bad", limits=Limits(max_concurrent=0), register=False)
