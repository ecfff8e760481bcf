"""A LangGraph graph executed in its user's own process, on the dashboard, in headless
Chromium: marked on the runs list and on its page, its timeline told as supersteps, its
state readable at every checkpoint, the diff between two, the interrupt it waits for and
how to answer it from its process, and no action that needs a worker offered (a direct
POST is refused, DUR120, nothing changed). No worker runs here: the graph runs in this
test's process, the pages are served by gunicorn.

With DURABILITY_UPDATE_SCREENSHOTS=1 the run page is saved to docs/images/ for
docs/langgraph.md."""

from __future__ import annotations

import operator
import os
import re
import shutil
from typing import Annotated, TypedDict

import pytest
from django.test import Client
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command
from playwright.sync_api import expect

from durability.langgraph import DurableSaver
from durability.langgraph.models import Thread
from durability.langgraph.runs import BADGE
from durability.models import Event, Run
from examples import langgraph_support
from tests import conftest
from tests.procs import ROOT
from tests.test_browser_dashboard import TIMEOUT_MS, started_web, users, watching
from tests.test_langgraph_cli import interrupted_here

__all__ = ["users"]

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SHOT = ROOT / "docs" / "images" / "langgraph-run.png"


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker, tmp_path_factory):
    """The web server alone, on the test database: these runs need no worker."""
    var = tmp_path_factory.mktemp("lg-web-var")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": conftest.test_database_url(),
        "DURABILITY_VAR_DIR": str(var),
        "DEBUG": "0",
    }
    web = started_web(env)
    yield web
    web.stop()


@pytest.fixture
def web(browser, server, users):
    with watching(browser, server.url) as watched:
        yield watched


def shoot(page) -> None:
    if os.environ.get("DURABILITY_UPDATE_SCREENSHOTS") != "1":
        return
    SHOT.parent.mkdir(parents=True, exist_ok=True)
    path = conftest.Path(os.environ.get("DURABILITY_TEST_ARTIFACTS", "/tmp")) / SHOT.name
    page.screenshot(path=str(path))
    shutil.copy(path, SHOT)


def test_a_graph_run_on_the_list_and_its_page(web):
    run = interrupted_here("support-42")
    page = web.sign_in("olive")
    row = page.locator("table.runs tr", has=page.locator(f"a[href='/runs/{run.id}/']"))
    expect(row.locator(".tag.graph")).to_have_text(BADGE)
    expect(row).to_contain_text('an answer to: {"tool": "refund"')
    expect(page.locator("#filters select[name=agent] option[value=support-graph]")).to_have_count(1)
    page.goto(f"{web.base}/runs/{run.id}/")
    expect(page.locator("#run-graph")).to_have_text(BADGE)
    expect(page.locator("#run-status")).to_have_text("waiting")
    asked = page.locator("#graph-interrupt")
    expect(asked).to_contain_text('Waiting for an answer to: {"tool": "refund", "args"')
    expect(page.locator("#graph-resume")).to_contain_text(
        'graph.invoke(Command(resume=...), {"configurable": {"thread_id": "support-42"}})'
    )
    # No action that needs a worker, and why, where the buttons would be.
    actions = page.locator("#run-actions")
    expect(page.locator("#graph-no-actions")).to_contain_text("not offered here")
    offered = actions.locator("button, a.button, summary")
    for word in ("Resume", "Cancel", "Roll back", "Fork", "Send", "Continue"):
        expect(offered.filter(has_text=word)).to_have_count(0)
    expect(offered.filter(has_text="Compare checkpoints")).to_have_count(1)
    expect(page.locator("#inspector .cp-actions")).not_to_contain_text("Fork from here")
    # The timeline tells the supersteps with their nodes and writes.
    timeline = page.locator("#timeline-items")
    expect(timeline).to_contain_text("superstep 1")
    expect(timeline).to_contain_text("model wrote messages → tools")
    expect(timeline).to_contain_text("input wrote messages → model")
    shoot(page)
    # The state at a checkpoint, its messages readable.
    page.goto(f"{web.base}/runs/{run.id}/checkpoints/3/?tab=state")
    tree = page.locator("#inspector .tree")
    expect(tree).to_contain_text("values")
    page.locator("#inspector .tree").get_by_text("values", exact=True).first.click()
    expect(page.locator("#inspector")).to_contain_text("messages")
    # The diff between two checkpoints: the message the model added, readable.
    page.goto(f"{web.base}/runs/{run.id}/diff/?a=2&b=3")
    expect(page.locator("main")).to_contain_text("Let me look the order up.")
    expect(page.locator("main")).not_to_contain_text('"b64"')


def test_the_page_follows_the_graph_answered_in_its_process(web):
    run = interrupted_here("support-43")
    page = web.sign_in("olive")
    page.goto(f"{web.base}/runs/{run.id}/")
    expect(page.locator("#graph-interrupt")).to_be_visible()
    saver = DurableSaver(graph="support-graph")
    graph = langgraph_support.build().compile(checkpointer=saver)
    graph.invoke(Command(resume="yes"), {"configurable": {"thread_id": "support-43"}})
    saver.close()
    expect(page.locator("#run-status")).to_have_text("succeeded", timeout=TIMEOUT_MS)
    expect(page.locator("#graph-interrupt")).to_have_count(0)
    expect(page.locator("#timeline-items")).to_contain_text("reached its end")
    expect(page.locator("#timeline-items")).to_contain_text("answered")


def test_a_copied_thread_waits_where_its_source_did_and_says_where_it_came_from(web):
    source = interrupted_here("support-45")
    saver = DurableSaver(graph="support-graph")
    saver.copy_thread("support-45", "support-45-copy")
    saver.close()
    copy = Thread.objects.get(thread_id="support-45-copy", checkpoint_ns="").run
    page = web.sign_in("olive")
    page.goto(f"{web.base}/runs/{copy.id}/")
    expect(page.locator("#run-graph")).to_have_text(BADGE)
    expect(page.locator("#run-status")).to_have_text("waiting")
    expect(page.locator("#graph-interrupt")).to_contain_text(
        'Waiting for an answer to: {"tool": "refund"'
    )
    expect(page.locator("#graph-resume")).to_contain_text('{"thread_id": "support-45-copy"}')
    timeline = page.locator("#timeline-items")
    expect(timeline).to_contain_text("copied from thread")
    expect(timeline.locator(f"a[href='/runs/{source.id}/']")).to_have_count(1)
    expect(timeline).to_contain_text("model wrote messages → tools")


def test_a_direct_post_of_a_worker_action_is_refused_and_changes_nothing(users):
    run = interrupted_here("support-44")
    client = Client()
    client.force_login(users["operator"])
    before = Run.objects.filter(pk=run.pk).values().get(), Event.objects.filter(run=run).count()
    done = client.post(
        f"/runs/{run.id}/cancel/",
        {"cancel-reason": "stop", "cancel-version": str(run.lease_token)},
    )
    assert done.status_code == 409, done.status_code
    assert "DUR120" in done.text or re.search(r"executed in its own\s+process", done.text)
    after = Run.objects.filter(pk=run.pk).values().get(), Event.objects.filter(run=run).count()
    assert after == before
    for form in (f"/runs/{run.id}/fork/?from=2", f"/runs/{run.id}/rollback/?to=2"):
        shown = client.get(form)
        assert shown.status_code == 409 and "executed in its own" in shown.text, form


class Flaky(TypedDict):
    tries: int


def flaky_graph():
    """A node that raises on its first try: the run fails, and goes on when invoked again."""
    seen: list[int] = []

    def flaky(state: Flaky) -> dict:
        seen.append(1)
        if len(seen) == 1:
            raise ValueError("the shop's API timed out")
        return {"tries": len(seen)}

    builder = StateGraph(Flaky)
    builder.add_node("flaky", flaky)
    builder.add_edge(START, "flaky")
    builder.add_edge("flaky", END)
    return builder


def test_a_node_that_raised_fails_the_run_until_the_graph_goes_on(users):
    saver = DurableSaver(graph="flaky-graph")
    graph = flaky_graph().compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "flaky-1"}}
    with pytest.raises(ValueError):
        graph.invoke({"tries": 0}, config)
    run = Run.objects.get(pk=saver.run_of("flaky-1").pk)
    assert run.status == "failed" and run.error_code == "DUR501"
    assert run.error == "node flaky raised ValueError: the shop's API timed out", run.error
    client = Client()
    client.force_login(users["operator"])
    page = client.get(f"/runs/{run.id}/").text
    assert "the shop&#x27;s API timed out" in page and "graph.invoke(None," in page
    assert "Fork from checkpoint" not in page and "Roll back…" not in page
    assert graph.invoke(None, config) == {"tries": 2}
    saver.close()
    run.refresh_from_db()
    assert (run.status, run.error, run.error_code) == ("succeeded", "", "")


def test_parallel_interrupts_are_listed_each_with_its_node_and_id(web):
    from tests.test_langgraph_interrupts import fan_out

    saver = DurableSaver(graph="fan-out")
    try:
        graph = fan_out().compile(checkpointer=saver)
        config = {"configurable": {"thread_id": "fan-page"}}
        asked = graph.invoke({"answers": []}, config)["__interrupt__"]
        run = Run.objects.get(pk=saver.run_of("fan-page").pk)
    finally:
        saver.close()
    page = web.sign_in("olive")
    page.goto(f"{web.base}/runs/{run.id}/")
    listed = page.locator("#graph-interrupts li")
    expect(listed).to_have_count(2)
    for i in asked:
        node = "billing" if "billing" in i.value else "shipping"
        item = listed.filter(has_text=f"node {node} asks")
        expect(item).to_contain_text(i.id)
        expect(item).to_contain_text(i.value)
    resume = page.locator("#graph-resume")
    for i in asked:
        expect(resume).to_contain_text(f"{i.id!r}: ...")


class Batch(TypedDict):
    log: Annotated[list, operator.add]
    n: int


def test_tasks_sent_with_send_are_named_by_their_nodes(web):
    from langgraph.types import Send, interrupt

    builder = StateGraph(Batch)
    builder.add_node("work", lambda s: {"log": [s["n"] * 10]})
    builder.add_node("review", lambda s: {"log": [interrupt(f"may item {s['n']} ship?")]})
    sends = [Send("work", {"log": [], "n": 1}), Send("review", {"log": [], "n": 2})]
    builder.add_conditional_edges(START, lambda s: sends, ["work", "review"])
    builder.add_edge("work", END)
    builder.add_edge("review", END)
    saver = DurableSaver(graph="sent-review")
    config = {"configurable": {"thread_id": "sent-page"}}
    try:
        graph = builder.compile(checkpointer=saver)
        graph.invoke({"log": [], "n": 0}, config)
        run = Run.objects.get(pk=saver.run_of("sent-page").pk)
        page = web.sign_in("olive")
        page.goto(f"{web.base}/runs/{run.id}/")
        asked = page.locator("#graph-interrupt")
        expect(asked).to_contain_text("may item 2 ship?")
        expect(asked).to_contain_text("asked by node review")
        graph.invoke(Command(resume="shipped"), config)
    finally:
        saver.close()
    page.goto(f"{web.base}/runs/{run.id}/")
    expect(page.locator("#run-status")).to_have_text("succeeded")
    timeline = page.locator("#timeline-items")
    expect(timeline).to_contain_text("work wrote log")
    expect(timeline).to_contain_text("review wrote log")
    expect(timeline).not_to_contain_text("a sent task")
