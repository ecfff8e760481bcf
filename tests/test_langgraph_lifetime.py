"""When a LangGraph saver's threads and connections are closed (``durability.langgraph.
lifetime``): ``close()`` at once, and a saver the garbage collector frees on the reaper's
thread, even when the collection starts inside ``ThreadPoolExecutor.submit``, whose lock
closing it there would wait on for ever."""

from __future__ import annotations

import gc
import time
import uuid

import pytest
from django.db import connection

from durability.langgraph import DurableSaver, lifetime
from tests import conftest
from tests import langgraph_graphs as graphs
from tests.test_langgraph_saver import in_own_loop

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

# A saver only the cycle collector frees, collected by the first allocation inside
# ``submit`` (a threshold of 1): before the fix, the process hung there at once.
CHILD = """
import gc
import django
django.setup()
from concurrent.futures import ThreadPoolExecutor
from durability.langgraph import DurableSaver, lifetime
from tests import langgraph_graphs as graphs

pool = ThreadPoolExecutor(max_workers=4)
for turn in range(3):
    gc.disable()
    saver = DurableSaver()
    graph = graphs.tool_loop().compile(checkpointer=saver)
    graph.invoke(graphs.first_input(), {"configurable": {"thread_id": f"gc-{turn}"}})
    saver.cycle = saver
    del saver, graph
    work = print
    gc.set_threshold(1)
    gc.enable()
    pool.submit(work, end="").result()
    gc.set_threshold(700)
print("closed" if lifetime.wait_collected() else "not closed", flush=True)
"""


def test_a_saver_collected_inside_an_executors_submit_is_closed_without_hanging():
    done = conftest.python_on_test_database(CHILD)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "closed"


def backends() -> set[int]:
    """The server processes of this database's sessions."""
    with connection.cursor() as cur:
        cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        return {pid for (pid,) in cur.fetchall()}


def test_a_collected_saver_closes_its_connections():
    if connection.vendor != "postgresql":
        pytest.skip("counting the database's sessions needs PostgreSQL")
    before = backends()
    saver = DurableSaver()
    graph = graphs.tool_loop().compile(checkpointer=saver)
    graph.invoke(graphs.first_input(), {"configurable": {"thread_id": uuid.uuid4().hex}})
    opened = backends() - before  # its own connections
    assert opened
    saver.cycle = saver  # garbage only the cycle collector frees
    del saver, graph
    gc.collect()
    assert lifetime.wait_collected()
    # Closed by the client; the server's processes end a moment later.
    deadline = time.monotonic() + 10
    while backends() & opened and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not backends() & opened


def test_close_is_at_once_and_once():
    saver = DurableSaver()
    saver.get_tuple({"configurable": {"thread_id": "nothing"}})
    saver.close()
    saver.close()  # closed already: nothing to do


def test_an_async_app_closes_its_saver_either_way():
    # Django refuses to close a connection on a thread that runs an event loop: close()
    # does it on a thread of its own there, and aclose() off the loop.
    cfg = {"configurable": {"thread_id": uuid.uuid4().hex}}

    async def shutdown() -> None:
        for closing in ("close", "aclose"):
            saver = DurableSaver()
            graph = graphs.tool_loop().compile(checkpointer=saver)
            await graph.ainvoke(graphs.first_input(), cfg)
            if closing == "close":
                saver.close()
            else:
                await saver.aclose()

    in_own_loop(shutdown())
