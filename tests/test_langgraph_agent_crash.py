"""Registered LangGraph graphs executed by real Celery workers (prefork, separate
processes), whose pool processes are SIGKILLed at random moments while they execute a
graph, at least 30 times. Every run must end with the values of the same graph run
uninterrupted with LangGraph's InMemorySaver, and no journaled tool call whose result was
recorded may be executed again: the tools append a line to a ledger file each time they
really run (``tests.langgraph_agents``), and no line of a recorded call may come after its
record."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from durability import operations
from durability.models import Event, EventKind, JournalEntry, Run, RunStatus
from durability.testing import wait_until
from tests import langgraph_agents as graphs

pytestmark = pytest.mark.django_db(transaction=True)

KILLS = 30
BUSY = 4  # runs kept unfinished while the workers are being killed


@pytest.fixture(scope="module")
def running(cluster, tmp_path_factory):
    """Two workers of two pool processes each, a beat, the ledger file they append to."""
    ledger = tmp_path_factory.mktemp("lg-ledger") / "ledger"
    ledger.touch()
    cluster.env.update(
        DURABILITY_AGENT_MODULES="examples.agents,tests.agents,tests.langgraph_agents",
        LG_TOOL_LEDGER=str(ledger),
    )
    cluster.worker(concurrency=2, wait=False)
    cluster.worker(concurrency=2, wait=False)
    cluster.start_beat()
    return cluster, ledger


def reference() -> dict:
    graph = graphs.support_graph().compile(checkpointer=InMemorySaver())
    return graph.invoke(graphs.first_input(), {"configurable": {"thread_id": "reference"}})


def executing_pids(cluster) -> dict[int, Run]:
    """Pool processes of live workers executing a run, by pid, with the run (not one whose
    current superstep was already cut short twice: the poison-step guard would fail it)."""
    children = {pid for w in cluster.workers if w.alive() for pid in w.children()}
    found = {}
    busy = Run.objects.filter(status=RunStatus.RUNNING, agent="lg-support", attempts__lte=2)
    for run in busy.exclude(lease_owner=""):
        pid = int(run.lease_owner.rsplit(":", 1)[1])
        if pid in children:
            found[pid] = run
    return found


def kill_at_random(cluster, started: list) -> int:
    """SIGKILL pool processes in the middle of graphs until ``KILLS`` have died, keeping
    ``BUSY`` runs unfinished; the kills made."""
    rng = random.Random(os.environ.get("LG_CRASH_SEED", "19"))
    kills = 0
    give_up = time.monotonic() + 70
    while kills < KILLS and time.monotonic() < give_up:
        unfinished = Run.objects.filter(pk__in=started).exclude(
            status__in=[RunStatus.SUCCEEDED, RunStatus.FAILED]
        )
        for _ in range(BUSY - unfinished.count()):
            started.append(operations.start("lg-support", graphs.first_input()).id)
        time.sleep(rng.uniform(0.15, 0.7))
        victims = executing_pids(cluster)
        if not victims:
            continue
        pid = rng.choice(sorted(victims))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills += 1
    return kills


def test_workers_sigkilled_mid_graph_30_times_finish_every_run_paying_nothing_twice(running):
    cluster, ledger = running
    started: list = []
    kills = kill_at_random(cluster, started)
    assert kills >= KILLS

    def all_finished():
        runs = list(Run.objects.filter(pk__in=started))
        return runs if all(r.is_finished for r in runs) else None

    runs = wait_until(all_finished, timeout=90, what="every run to finish")
    expected = reference()
    for run in runs:
        assert run.status == RunStatus.SUCCEEDED, (run.id, run.error)
        assert graphs.values_of(run.id) == expected, run.id
        assert operations.verify(run.id)[0].ok
    recovered = Event.objects.filter(run_id__in=started, kind=EventKind.RECOVERED).count()
    assert recovered >= KILLS // 2, recovered
    assert_no_recorded_call_paid_again(ledger, started, kills)


def assert_no_recorded_call_paid_again(ledger, started: list, kills: int) -> None:
    paid: dict[tuple[str, str, str], list[float]] = {}
    for line in ledger.read_text().splitlines():
        thread, tool, arg, at = line.split()
        paid.setdefault((thread, tool, arg), []).append(float(at))
    entries = JournalEntry.objects.filter(run_id__in=started)
    assert entries.count() == len(started) * 2 * graphs.TURNS
    for entry in entries:
        result = operations.canonical.loads(entry.result)
        tool = "search" if entry.key == "tools/search" else "log"
        times = paid[(str(entry.run_id), tool, result.split()[-1])]
        # Paid before it was recorded (more than once only if a worker died between the
        # call and its record); never after.
        assert max(times) < entry.created_at.timestamp(), (entry.run_id, entry.key, times)
    # Every call was paid; again only when a kill cut it before its record (at most the
    # two tools of the superstep a kill interrupted).
    assert len(paid) == entries.count()
    repaid = sum(len(t) - 1 for t in paid.values())
    assert repaid <= 2 * kills, repaid


def test_started_from_the_cli_and_the_api_the_workers_run_it(running, live_server):
    import json

    from tests.api_helpers import api_for, user_with
    from tests.test_cli import cli

    cluster, _ledger = running
    body = json.dumps(graphs.first_input())
    done = cli(cluster, "start", "lg-support", "--input", body, "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"succeeded with {3 + 2 * graphs.TURNS} checkpoints" in done.stdout
    api = api_for(live_server, user_with("operator in the policy group", "ops"))
    started = api.post("/runs", {"agent": "lg-support", "input": graphs.first_input()})
    assert started.status_code == 201, started.text
    expected = reference()
    for run in Run.objects.filter(agent="lg-support"):
        finished = wait_until(
            lambda run=run: Run.objects.get(pk=run.id).is_finished or None, timeout=60
        )
        assert finished and Run.objects.get(pk=run.id).status == RunStatus.SUCCEEDED
        assert graphs.values_of(run.id) == expected
