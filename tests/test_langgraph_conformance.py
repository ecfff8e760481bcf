"""LangGraph's own conformance suite for checkpointers (``langgraph-checkpoint-conformance``)
against ``DurableSaver``: every capability it checks passes (``put``, ``put_writes``,
``get_tuple``, ``list``, ``delete_thread``, ``prune``, ``copy_thread``,
``delete_for_runs``), on PostgreSQL and on the embedded default."""

from __future__ import annotations

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.report import ProgressCallbacks

from durability.langgraph import DurableSaver
from tests.test_langgraph_saver import in_own_loop

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]


@checkpointer_test(name="DurableSaver")
async def durable_saver():
    saver = DurableSaver()
    yield saver
    await saver.aclose()


def test_langgraphs_conformance_suite_passes():
    report = in_own_loop(validate(durable_saver, progress=ProgressCallbacks.quiet()))
    failures = {name: result.failures for name, result in report.results.items() if result.failures}
    assert report.passed_all(), failures
    assert report.passed_all_base()
    checked = {name for name, result in report.results.items() if result.passed}
    assert checked == {
        "put",
        "put_writes",
        "get_tuple",
        "list",
        "delete_thread",
        "prune",
        "copy_thread",
        "delete_for_runs",
    }
    assert report.conformance_level() == "FULL"
