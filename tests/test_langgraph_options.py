"""What a saver refuses, and how: options of the wrong kind, a registered agent's name,
thread ids and namespaces the store cannot hold, and any call once it is closed. Each is
refused with a message that says what is wrong, and nothing is read or stored."""

from __future__ import annotations

import asyncio
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

import pytest
from django.db import connection
from langgraph.checkpoint.base import empty_checkpoint

from durability import operations, retention
from durability.agents import Agent, registry
from durability.errors import ExecutedElsewhere, OnLegalHold
from durability.langgraph import DurableSaver
from durability.langgraph.models import Thread
from durability.langgraph.runs import outside_workers
from durability.models import Run
from tests import conftest
from tests import langgraph_graphs as graphs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]


def config(thread: object = None, ns: object = "") -> dict:
    return {"configurable": {"thread_id": thread or uuid.uuid4().hex, "checkpoint_ns": ns}}


@pytest.fixture
def registered():
    """An agent the workers execute, registered for the test only."""
    name = f"native-{uuid.uuid4().hex[:8]}"
    Agent(name, steps=[lambda state, ctx: None])
    yield name
    registry.unregister(name)


def test_a_graph_name_of_the_wrong_kind_is_refused_clearly():
    with pytest.raises(TypeError, match="graph must be a name \\(a string\\), not int"):
        DurableSaver(graph=123)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="graph must be a name of 1 to 200 characters"):
        DurableSaver(graph="x" * 201)


def test_a_registered_agents_name_is_refused(registered):
    """Its runs are the workers': runs of a graph in its own process under that name would be
    counted against its limits and listed as its runs."""
    with pytest.raises(ValueError, match=f"graph '{registered}' is the name of a registered"):
        DurableSaver(graph=registered)
    assert not Run.objects.filter(agent=registered).exists()


def test_a_run_the_saver_made_stays_outside_the_workers_whatever_is_registered_later():
    """How the run was made decides, not its name: an agent registered under the graph's
    name afterwards does not hand the run to the workers (a cancel would stop nothing, a
    resume would start a second writer)."""
    name = f"later-{uuid.uuid4().hex[:8]}"
    saver = DurableSaver(graph=name)
    cfg = config()
    graphs.tool_loop().compile(checkpointer=saver).invoke(graphs.first_input(), cfg)
    run = Thread.objects.get(thread_id=cfg["configurable"]["thread_id"]).run
    Agent(name, steps=[lambda state, ctx: None])
    try:
        assert outside_workers(run)
        with pytest.raises(ExecutedElsewhere):
            operations.cancel(run.id, by="op", reason="test")
        run.refresh_from_db()
        assert run.status != "cancelled"
    finally:
        registry.unregister(name)
        saver.close()


@pytest.mark.parametrize(
    "thread, said",
    [("t" * 256, "at most 255 characters"), ("a\x00b", "no NUL character")],
)
def test_a_thread_id_the_store_cannot_hold_is_refused_before_anything_is_stored(thread, said):
    saver = DurableSaver()
    graph = graphs.tool_loop().compile(checkpointer=saver)
    for call in (
        lambda: graph.invoke(graphs.first_input(), config(thread)),
        lambda: saver.put(config(thread), empty_checkpoint(), {}, {}),
        lambda: saver.get_tuple(config(thread)),
        lambda: saver.delete_thread(thread),
        lambda: saver.copy_thread(uuid.uuid4().hex, thread),
        lambda: saver.prune([thread], strategy="delete"),
    ):
        with pytest.raises(ValueError, match=f"thread_id must be {said}|{said}"):
            call()
    with pytest.raises(ValueError, match="checkpoint_ns must be text of at most 500"):
        saver.get_tuple(config(ns="n" * 501))
    assert not Thread.objects.exists()
    saver.close()


def test_a_thread_id_that_is_not_text_is_stored_as_its_text():
    """LangGraph's configs may hold a number or a UUID: the thread is the same either way."""
    saver = DurableSaver()
    graph = graphs.tool_loop().compile(checkpointer=saver)
    number = uuid.uuid4().int % 10**12
    graph.invoke(graphs.first_input(), config(number))
    assert saver.get_tuple(config(str(number))) is not None
    saver.close()


def test_every_call_on_a_closed_saver_is_refused_alike():
    saver = DurableSaver()
    graph = graphs.tool_loop().compile(checkpointer=saver)
    cfg = config()
    graph.invoke(graphs.first_input(), cfg)
    saver.close()
    saver.close()  # twice: nothing more to close
    thread = cfg["configurable"]["thread_id"]
    calls = {
        "invoke": lambda: graph.invoke(graphs.first_input(), config()),
        "get_tuple": lambda: saver.get_tuple(cfg),
        "list": lambda: list(saver.list(cfg)),
        "put_writes": lambda: saver.put_writes(
            {"configurable": {**cfg["configurable"], "checkpoint_id": "x"}}, [("a", 1)], "t"
        ),
        "delete_thread": lambda: saver.delete_thread(thread),
        "copy_thread": lambda: saver.copy_thread(thread, uuid.uuid4().hex),
        "prune": lambda: saver.prune([thread]),
        "aget_tuple": lambda: run_async(lambda: saver.aget_tuple(cfg)),
        "alist": lambda: run_async(lambda: _drain(saver.alist(cfg))),
        "adelete_thread": lambda: run_async(lambda: saver.adelete_thread(thread)),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="this DurableSaver is closed"):
            call()
            pytest.fail(f"{name} worked on a closed saver")
    fresh = DurableSaver()  # what was stored before the close is there
    assert list(fresh.list(cfg))
    fresh.close()


async def _drain(items) -> list:
    return [item async for item in items]


def run_async(make) -> object:
    """``make()``'s coroutine run to its end on a thread of its own (this one may be
    running an event loop: Playwright's sync API leaves one)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def test_a_thread_on_legal_hold_is_not_deleted():
    saver = DurableSaver()
    cfg = config()
    graphs.tool_loop().compile(checkpointer=saver).invoke(graphs.first_input(), cfg)
    thread = cfg["configurable"]["thread_id"]
    run = Thread.objects.get(thread_id=thread).run
    retention.hold(run.id, by="legal", reason="litigation")
    for delete in (
        lambda: saver.delete_thread(thread),
        lambda: saver.prune([thread], strategy="delete"),
    ):
        with pytest.raises(OnLegalHold, match=f"thread '{thread}' is on legal hold"):
            delete()
    assert Run.objects.filter(pk=run.id).exists() and saver.get_tuple(cfg) is not None
    retention.hold(run.id, on=False, by="legal", reason="settled")
    saver.delete_thread(thread)
    assert not Run.objects.filter(pk=run.id).exists() and saver.get_tuple(cfg) is None
    saver.close()
    # The hold and its release outlive the run in the audit log, with the deletion itself.
    from durability.models import Event

    kept = Event.objects.filter(run_id=run.id).order_by("id")
    assert [(e.kind, e.actor) for e in kept] == [
        ("hold", "legal"),
        ("hold", "legal"),
        ("deleted", "langgraph:delete_thread"),
    ]
    assert f"thread {thread!r} deleted by its graph's process" in kept.last().reason


@pytest.mark.parametrize("vendor", ["sqlite", "postgresql"])
def test_a_database_never_migrated_is_met_with_how_to_migrate_it(vendor, tmp_path):
    """A new user's first invoke on a database without the product's tables: the error
    names the command that makes them."""
    name = f"unmigrated_{uuid.uuid4().hex[:8]}"
    url = f"sqlite:///{tmp_path / 'db.sqlite3'}"  # a file no migration has run on
    if vendor == "postgresql":
        if connection.vendor != "postgresql":
            pytest.skip("PostgreSQL's own message: run on PostgreSQL")
        url = urlunsplit(urlsplit(conftest.test_database_url())._replace(path=f"/{name}"))
        with connection.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
    script = (
        "import django; django.setup()\n"
        "from durability.langgraph import DurableSaver\n"
        "DurableSaver().get_tuple({'configurable': {'thread_id': 't'}})\n"
    )
    try:  # the user's settings, not the tests'
        done = conftest.python_on_test_database(
            script,
            DJANGO_SETTINGS_MODULE="config.settings",
            DATABASE_URL=url,
            DURABILITY_VAR_DIR=str(tmp_path),
            SECRET_KEY=os.environ.get("SECRET_KEY", "x"),
        )
    finally:
        if vendor == "postgresql":
            with connection.cursor() as cur:
                cur.execute(f"DROP DATABASE IF EXISTS {name}")
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "durability_langgraph_thread" in last, last
    assert last.endswith(
        "this database has no tables of the product's; create them with python manage.py"
        " migrate (see docs/langgraph.md)"
    ), last
