"""A LangGraph graph's process SIGKILLed between and during supersteps: each time, a new
process takes the thread up from its last checkpoint in the store, and the thread ends
with the same final state and history as an uninterrupted run with ``InMemorySaver``."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from durability import operations
from durability.langgraph import DurableSaver
from durability.langgraph.models import Thread
from tests import conftest
from tests import langgraph_graphs as graphs
from tests.procs import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

TURNS = 6
PAUSE = 0.05  # node a takes this long, node b twice as long; they run side by side
# The line a node prints as it starts, and how long after it the process is killed: in
# both nodes, after a finished (its writes stored) and before b did, as b finishes (its
# writes, the checkpoint after them), and in the supersteps after.
KILLS = [
    ("node a 0", 0.0),
    ("node b 1", 0.02),
    ("node a 2", 0.08),
    ("node b 3", 0.105),
    ("node a 4", 0.13),
    ("node b 5", 0.2),
]


class Child:
    """``tests.langgraph_child`` in a process of its own; its lines read by a thread."""

    def __init__(self, thread: str) -> None:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DATABASE_URL": conftest.test_database_url(),
            "PYTHONPATH": str(ROOT),
        }
        argv = [sys.executable, "-m", "tests.langgraph_child", thread, str(TURNS), str(PAUSE)]
        self.popen = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put("")  # the end

    def wait_for(self, wanted: str, timeout: float = 60.0) -> bool:
        """Read lines until ``wanted``; False if the process ended first."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            self.seen.append(line)
            if line == wanted:
                return True
            if line == "":
                return False

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.kill()
        self.reader.join(timeout=10)  # the pipe's end, once the process is gone
        self.popen.stdout.close()


def history(graph, cfg) -> list:
    return [
        (s.values, s.next, s.metadata.get("source"), s.metadata.get("step"))
        for s in graph.get_state_history(cfg)
    ]


def test_sigkilled_graph_process_continues_from_its_last_checkpoint():
    thread = uuid.uuid4().hex
    cfg = {"configurable": {"thread_id": thread}}
    for line, delay in KILLS:
        child = Child(thread)
        try:
            assert child.wait_for(line), f"ended before {line!r}: {child.seen}"
            time.sleep(delay)
            child.kill()
        finally:
            child.stop()
        assert child.popen.returncode == -signal.SIGKILL, child.seen
        # Whatever the moment, what was committed verifies.
        runs = Thread.objects.filter(thread_id=thread).values_list("run_id", flat=True)
        for run_id in runs:
            (report,) = operations.verify(run_id)
            assert report.ok, str(report)
    last = Child(thread)
    try:
        assert last.wait_for("finished"), last.seen
        assert last.popen.wait(timeout=30) == 0
    finally:
        last.stop()

    theirs = graphs.pairs(TURNS).compile(checkpointer=InMemorySaver())
    other = {"configurable": {"thread_id": "uninterrupted"}}
    # As the children run: with LangGraph's default ("async") durability a checkpoint is
    # saved in the background after the next superstep has begun, and the join's barrier
    # is saved by reference, so on a loaded machine the reference history could record a
    # superstep's barrier already passed (``count`` among a step's next tasks).
    expected = theirs.invoke(graphs.first_input(), other, durability="sync")
    ours = graphs.pairs(TURNS).compile(checkpointer=DurableSaver())
    assert ours.get_state(cfg).values == expected
    assert len(expected["messages"]) == 1 + 2 * TURNS
    assert history(ours, cfg) == history(theirs, other)
    (report,) = operations.verify(Thread.objects.get(thread_id=thread, checkpoint_ns="").run_id)
    assert report.ok, str(report)
