"""A LangGraph graph executed in its user's own process (the runnable example,
examples/langgraph_support.py, run as a real process): its run's status as its checkpoints
say, the CLI's words for it, and every operation that needs a worker refused with DUR120,
changing nothing, from the engine, the CLI and the API."""

from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import sys
import uuid

import pytest
from django.core.management import CommandError, call_command

from durability import operations
from durability.errors import ExecutedElsewhere
from durability.langgraph import DurableSaver
from durability.langgraph.models import Thread
from durability.langgraph.runs import BADGE, outside_workers
from durability.models import Approval, Event, Message, Run
from examples import langgraph_support
from tests import conftest
from tests.api_helpers import api_for, problem, user_with
from tests.procs import ROOT

pytestmark = pytest.mark.django_db(transaction=True)


def example(thread: str, *args: str) -> str:
    """The example, as its user runs it: a process of its own on the product's settings."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": conftest.test_database_url(),
    }
    done = subprocess.run(
        [sys.executable, "-m", "examples.langgraph_support", "--thread", thread, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def interrupted_here(thread: str) -> Run:
    """The example's graph run in this process until its interrupt."""
    saver = DurableSaver(graph="support-graph")
    graph = langgraph_support.build().compile(checkpointer=saver)
    ask = {"messages": [langgraph_support.HumanMessage("broken", id="h-1")]}
    result = graph.invoke(ask, {"configurable": {"thread_id": thread}})
    assert "__interrupt__" in result
    run = saver.run_of(thread)
    saver.close()
    gc.collect()
    assert run is not None
    return Run.objects.get(pk=run.pk)


def command(*args: str) -> str:
    out = io.StringIO()
    call_command("durability", *args, stdout=out)
    return out.getvalue()


def test_the_example_runs_in_its_own_process_and_its_run_says_where_it_is():
    thread = f"example-{uuid.uuid4().hex[:8]}"
    out = example(thread)
    assert "waiting for an answer to: {'tool': 'refund'" in out
    run = Thread.objects.get(thread_id=thread).run
    assert outside_workers(run)
    assert run.agent == "support-graph" and run.status == "waiting"
    assert run.wait_detail.startswith('an answer to: {"tool": "refund"'), run.wait_detail
    listed = command("list")
    line = next(row for row in listed.splitlines() if row.startswith(run.short_id))
    assert BADGE in line and "an answer to:" in line, line
    assert line.split()[1:3] == ["support-graph@langgraph", "waiting"], line  # not cut
    # Filtered by the agent as the column shows it; a filter that matches nothing says so.
    assert run.short_id in command("list", "--agent", "support-graph@langgraph")
    assert run.short_id not in command("list", "--agent", "support-graph@2")
    none = command("list", "--agent", "no-such-graph", "--status", "failed")
    assert none.startswith("no runs match (agent no-such-graph, status failed)"), none
    shown = command("show", str(run.id))
    assert f"{BADGE}: thread {thread} of graph support-graph" in shown
    assert "Command(resume=...)" in shown and thread in shown
    assert "superstep 1    model wrote messages → tools" in shown, shown
    assert " -> end " not in shown  # a graph's checkpoint names no next step: "-"
    data = json.loads(command("show", str(run.id), "--json"))["langgraph"]
    assert data["thread_id"] == thread and data["next"] == ["tools"]
    assert data["interrupts"] == [
        {
            "node": "tools",
            "value": {"tool": "refund", "args": data["interrupts"][0]["value"]["args"]},
            "id": data["interrupts"][0]["id"],
        }
    ]
    assert len(data["interrupts"][0]["id"]) >= 16  # LangGraph's interrupt id
    assert "Command(resume=" in data["how_to_continue"]
    step1 = next(s for s in data["supersteps"] if s["title"] == "superstep 1")
    assert step1["tasks"] == [
        {"node": "model", "wrote": ["messages"], "routes": ["tools"], "error": None}
        | {"interrupts": [], "answers": []}
    ]
    out = example(thread, "--answer", "yes")
    assert "answer: Done: {'refunded': 349.0" in out
    run.refresh_from_db()
    assert run.status == "succeeded" and run.wait_detail == "" and run.finished_at
    done = json.loads(command("show", str(run.id), "--json"))["langgraph"]
    # At its end: what goes on is a new turn, with new input (never ``invoke(None)``).
    assert done["next"] == [] and done["how_to_continue"].startswith("graph.invoke(<new input>, ")
    with pytest.raises(ExecutedElsewhere) as refused:
        operations.cancel(run.id, by="ann")
    assert "It reached its end; a new turn invokes it again with new input" in str(refused.value)
    assert "invoke(None" not in str(refused.value)
    native = operations.start("research", {"question": "What is a fencing token?"}, by="ann")
    assert json.loads(command("show", str(native.id), "--json"))["langgraph"] is None
    kinds = list(Event.objects.filter(run=run).values_list("kind", flat=True).order_by("id"))
    assert kinds.count("suspended") == 2 and kinds[-1] == "succeeded", kinds


REFUSED = {
    "resume": lambda run: operations.resume(run.id, by="ann"),
    "cancel": lambda run: operations.cancel(run.id, by="ann", reason="stop"),
    "plan a rollback": lambda run: operations.plan_rollback(run.id, 1),
    "rollback": lambda run: operations.rollback(run.id, 1, by="ann"),
    "fork": lambda run: operations.fork(run.id, 1, by="ann"),
    "check a fork": lambda run: operations.check_fork(run.id, 1),
    "send": lambda run: operations.send(run.id, "user", "hi", by="ann"),
    "decide": lambda run: operations.decide(run.id, "refund", approve=True, by="ann"),
    "resolve": lambda run: operations.resolve_effect(run.id, 1, outcome="done", by="ann"),
}


def snapshot(run: Run) -> tuple:
    row = Run.objects.filter(pk=run.pk).values().get()
    counts = (
        Event.objects.filter(run=run).count(),
        Message.objects.filter(run=run).count(),
        Approval.objects.filter(run=run).count(),
        Run.objects.count(),
    )
    return row, counts


@pytest.mark.parametrize("what", list(REFUSED))
def test_every_operation_that_needs_a_worker_is_refused_and_changes_nothing(what):
    run = interrupted_here(f"refused-{uuid.uuid4().hex[:8]}")
    before = snapshot(run)
    with pytest.raises(ExecutedElsewhere) as refused:
        REFUSED[what](run)
    assert refused.value.code == "DUR120"
    text = str(refused.value)
    assert "executed in its own process" in text and "nothing was changed" in text, text
    # Waiting on an interrupt: the call that answers it, not one that would ask again.
    assert "graph.invoke(Command(resume=" in text and str(run.id) in text, text
    assert snapshot(run) == before


@pytest.mark.smoke
def test_the_cli_refuses_a_cancel_with_a_coded_line_and_changes_nothing():
    run = interrupted_here(f"cli-{uuid.uuid4().hex[:8]}")
    before = snapshot(run)
    with pytest.raises(CommandError) as refused:
        command("cancel", str(run.id), "--reason", "stop")
    assert refused.value.returncode == 2
    assert str(refused.value).startswith("[DUR120] cannot cancel it")
    assert snapshot(run) == before
    # Reading is no action: it works as on any run.
    assert operations.verify(run.id)[0].ok


def test_the_api_refuses_them_too_with_the_same_coded_error(live_server):
    """The API calls the same operations: a 409 problem with DUR120, nothing changed."""
    run = interrupted_here(f"api-{uuid.uuid4().hex[:8]}")
    ops = api_for(live_server, user_with("operator in the policy group", "omar"), "ops")
    before = snapshot(run)
    for action, body in (
        ("cancel", {"reason": "stop"}),
        ("resume", {}),
        ("rollback", {"checkpoint": 1}),
    ):
        answer = problem(ops.post(f"/runs/{run.id}/{action}", body), 409, "DUR120")
        assert "executed in its own process" in answer["detail"], answer
    assert snapshot(run) == before
    shown = ops.get(f"/runs/{run.id}").json()
    assert shown["status"] == "waiting", shown
    # What ``show --json`` says of the graph, for scripts: its thread, what it waits for
    # and the call that answers it.
    assert shown["langgraph"] == json.loads(command("show", str(run.id), "--json"))["langgraph"]
    assert shown["langgraph"]["interrupts"][0]["node"] == "tools"
    assert "Command(resume=" in shown["langgraph"]["how_to_continue"]
    native = operations.start("research", {"question": "What is a fencing token?"}, by="ann")
    assert ops.get(f"/runs/{native.id}").json()["langgraph"] is None


def test_a_subgraph_interrupted_waits_in_its_child_run_and_goes_on_with_its_thread():
    from langgraph.types import Command

    from tests import langgraph_graphs

    saver = DurableSaver(graph="sub-graph")
    graph = langgraph_graphs.with_subgraph().compile(checkpointer=saver)
    config = {"configurable": {"thread_id": f"sub-{uuid.uuid4().hex[:8]}"}}
    assert "__interrupt__" in graph.invoke({"log": []}, config)
    root = Run.objects.get(pk=saver.run_of(config["configurable"]["thread_id"]).pk)
    (child,) = Run.objects.filter(parent_run=root)
    assert outside_workers(root) and outside_workers(child)
    assert child.status == "waiting" and child.wait_detail.startswith("an answer to: ")
    shown = command("show", str(child.id))
    # The whole thread is invoked again, never the subgraph's namespace alone.
    thread = config["configurable"]["thread_id"]
    assert (
        f'graph.invoke(Command(resume=...), {{"configurable": {{"thread_id": "{thread}"}}}})'
        in (shown)
    ), shown
    graph.invoke(Command(resume="blue"), config)
    saver.close()
    for run in (root, child):
        run.refresh_from_db()
        assert run.status == "succeeded", (run.status, run.wait_detail)


@pytest.mark.smoke
def test_a_process_that_did_not_set_django_up_is_told_how():
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-c", "from durability.langgraph import DurableSaver"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "django.core.exceptions.ImproperlyConfigured: durability.langgraph keeps its"
        " checkpoints in this product's database, through its Django settings: set"
        " DJANGO_SETTINGS_MODULE (config.settings, with DATABASE_URL) and call django.setup()"
        " before using DurableSaver (see docs/langgraph.md)"
    )


def test_an_error_of_several_lines_is_one_row_of_the_list():
    """LangGraph's errors add a link on a second line: the list keeps one row a run."""
    run = operations.start("research", {"question": "What is a fencing token?"}, by="ann")
    error = "InvalidUpdateError: Expected dict, got hello\nFor troubleshooting, visit: https://x"
    Run.objects.filter(pk=run.pk).update(status="failed", error=error)
    rows = command("list").splitlines()
    line = next(row for row in rows if row.startswith(run.short_id))
    assert line.endswith("InvalidUpdateError: Expected dict, got hello For troubleshoo"), line
    assert not any(row.startswith("For troubleshooting") for row in rows)


def test_a_checkpoint_update_state_made_is_not_described_with_the_abandoned_branchs_tasks():
    """Time travel: answered, then ``update_state`` on the checkpoint that asked. The new
    checkpoint was made by the update, not by the tasks that ran from that checkpoint on the
    branch left behind (their writes stay on it): no node, no answer is named for it."""
    from langgraph.types import Command

    thread = f"travel-{uuid.uuid4().hex[:8]}"
    run = interrupted_here(thread)
    saver = DurableSaver(graph="support-graph")
    try:
        graph = langgraph_support.build().compile(checkpointer=saver)
        config = {"configurable": {"thread_id": thread}}
        asked_at = graph.get_state(config).config
        graph.invoke(Command(resume="yes"), config)
        graph.update_state(asked_at, {"messages": []}, as_node="model")
    finally:
        saver.close()
        gc.collect()
    steps = json.loads(command("show", str(run.id), "--json"))["langgraph"]["supersteps"]
    updated = [s for s in steps if s["source"] == "update"]
    assert len(updated) == 1 and updated[0]["title"] == "state updated (update_state)"
    assert updated[0]["tasks"] == [], updated[0]
    # The branch that went on from the question still says who answered what.
    answered = [t for s in steps for t in s["tasks"] if t["answers"]]
    assert answered and answered[0]["answers"] == [["yes"]]
    # The text's checkpoint table in LangGraph's words, not the stored "loop 1".
    table = command("show", str(run.id)).split("checkpoints:")[1]
    assert " input " in table and " superstep 1 " in table and " update_state " in table
    assert " loop " not in table and "input -1" not in table
