"""LangGraph's strict msgpack mode (``LANGGRAPH_STRICT_MSGPACK=true``, read when LangGraph is
imported, so in a process of its own): the graph is compiled and invoked with a copy of its
saver (``with_allowlist``), and the saver a user passed to ``compile`` and dropped must keep
serving it."""

from __future__ import annotations

import json
import uuid

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from durability.langgraph.models import Thread
from tests import conftest
from tests import langgraph_graphs as graphs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

# The refund graph as a user writes it: the saver made inside ``compile`` and kept nowhere
# else. Prints what the interrupt asked and the answered graph's end, as JSON.
CHILD = """
import gc, json, sys
import django
django.setup()
from langgraph.types import Command
from durability.langgraph import DurableSaver
from tests import langgraph_graphs as graphs

graph = graphs.approval().compile(checkpointer=DurableSaver())
gc.collect()
cfg = {"configurable": {"thread_id": sys.argv[1]}}
asked = graph.invoke({"amount": 349, "decision": "", "done": False}, cfg)
done = graph.invoke(Command(resume="yes"), cfg)
print(json.dumps([[i.value for i in asked["__interrupt__"]], done]))
"""


def test_a_graph_in_strict_msgpack_mode_keeps_its_saver():
    thread = uuid.uuid4().hex
    # LangGraph reads the variable when it is imported: in a process of its own.
    done = conftest.python_on_test_database(CHILD, thread, LANGGRAPH_STRICT_MSGPACK="true")
    assert done.returncode == 0, done.stderr[-3000:]
    asked, answered = json.loads(done.stdout.strip().splitlines()[-1])
    graph = graphs.approval().compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "reference"}}
    reference = graph.invoke({"amount": 349, "decision": "", "done": False}, cfg)
    assert asked == [i.value for i in reference["__interrupt__"]]
    assert answered == graph.invoke(Command(resume="yes"), cfg)
    assert Thread.objects.get(thread_id=thread).run.status == "succeeded"
