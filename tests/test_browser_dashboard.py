"""The dashboard end to end in headless Chromium: the app served by gunicorn on 127.0.0.1,
real Celery workers executing the demo agents, a real sign-in.

One Chromium for the session (the ``browser`` fixture, in conftest.py, shared by every
browser test module); every test fails on a console error, a page error, a dialog or
a CSP violation. Screenshots of the main pages go to the test artifacts folder for reviewers
(and to docs/screenshots/, for the README, with DURABILITY_UPDATE_SCREENSHOTS=1)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from playwright.sync_api import Browser, Page, expect

from durability import operations
from durability.models import Approval, Checkpoint, Effect, Run, RunStatus
from durability.testing import wait_until
from tests.dashboard_helpers import HOSTILE_KEY, HOSTILE_VALUES, PASSWORD
from tests.procs import ARTIFACTS, ROOT, Proc, free_port

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SHOTS = ROOT / "docs" / "screenshots"
TIMEOUT_MS = 30_000

# Recorded in the page before any of its scripts: CSP violations and unexpected script runs.
WATCH = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__csp.push(e.violatedDirective + " " + (e.blockedURI || "inline"));
});
"""


# --- the app, served for real ---------------------------------------------------------------


class WebServer(Proc):
    def __init__(self, env: dict[str, str], port: int) -> None:
        argv = [
            sys.executable,
            "-m",
            "gunicorn",
            "config.wsgi",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            "1",
            "--threads",
            "8",
            "--access-logfile",
            "-",
        ]
        super().__init__("browser-web", argv, env)
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> WebServer:
        super().start()
        give_up = time.monotonic() + 30
        while time.monotonic() < give_up:
            try:
                with urllib.request.urlopen(self.url + "/accounts/login/", timeout=2):
                    return self
            except OSError:
                if not self.alive():
                    raise AssertionError(f"gunicorn exited:\n{self.text()[-3000:]}") from None
                time.sleep(0.1)
        raise AssertionError(f"gunicorn did not answer:\n{self.text()[-3000:]}")


@pytest.fixture(scope="module")
def app(cluster, tmp_path_factory):
    """Workers, a beat (the sweeper recovers killed workers) and the web server, all on the
    module's queue and the test database."""
    cluster.worker(concurrency=2, wait=False)
    cluster.start_beat()
    var = tmp_path_factory.mktemp("web-var")
    server = started_web({**cluster.env, "DURABILITY_VAR_DIR": str(var), "DEBUG": "0"})
    yield server
    server.stop()


def started_web(env: dict[str, str]) -> WebServer:
    """gunicorn on ``env``, its static files collected into its var folder first, as
    ``make up`` does (DEBUG off serves them through WhiteNoise)."""
    subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "-v0"],
        cwd=ROOT,
        env=env,
        check=True,
    )
    return WebServer(env, free_port()).start()


@pytest.fixture
def users(db):
    operators = Group.objects.get_or_create(name="operators")[0]
    viewers = Group.objects.get_or_create(name="viewers")[0]
    users = get_user_model()
    olive = users.objects.create_user("olive", "", PASSWORD)
    olive.groups.add(operators)
    victor = users.objects.create_user("victor", "", PASSWORD)
    victor.groups.add(viewers)
    return {"operator": olive, "viewer": victor}


class Watched:
    """A page with everything that must not happen collected as it happens."""

    def __init__(self, browser: Browser, base: str) -> None:
        self.base = base
        self.context = browser.new_context(viewport={"width": 1400, "height": 900})
        self.context.set_default_timeout(TIMEOUT_MS)
        self.context.add_init_script(WATCH)
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("dialog", self._dialog)

    def _console(self, message) -> None:
        if message.type == "error" or "Content Security Policy" in message.text:
            self.problems.append(f"console {message.type}: {message.text}")

    def _dialog(self, dialog) -> None:
        self.problems.append(f"dialog: {dialog.message}")
        dialog.dismiss()

    def go(self, path: str) -> Page:
        self.page.goto(self.base + path)
        return self.page

    def sign_in(self, username: str) -> Page:
        page = self.go("/accounts/login/")
        page.fill("input[name=username]", username)
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url(self.base + "/")
        return page

    def check(self) -> None:
        violations = self.page.evaluate("window.__csp || []")
        pwned = self.page.evaluate("window.__pwned")
        assert not violations, f"CSP violations: {violations}"
        assert pwned is None, "agent content ran as script"
        assert not self.problems, "\n".join(self.problems)

    def shoot(self, name: str) -> None:
        # Into the test artifacts folder every run; into the README's docs/screenshots only
        # when asked (DURABILITY_UPDATE_SCREENSHOTS=1), so a test run leaves the tree clean.
        folder = Path(os.environ.get("DURABILITY_TEST_ARTIFACTS") or ARTIFACTS) / "screenshots"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        if os.environ.get("DURABILITY_UPDATE_SCREENSHOTS") == "1":
            SHOTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, SHOTS / path.name)


@contextmanager
def watching(browser, url: str) -> Iterator[Watched]:
    """A browser context on ``url`` whose console errors and CSP violations fail the test
    once it is done."""
    watched = Watched(browser, url)
    yield watched
    try:
        watched.check()
    finally:
        watched.context.close()


@pytest.fixture
def web(browser, app, users):
    with watching(browser, app.url) as watched:
        yield watched


def settled(run_id, *, reasons=("approval", "in_doubt"), timeout: float = 60.0) -> Run:
    def check():
        run = Run.objects.get(pk=run_id)
        return run if run.is_finished or run.wait_reason in reasons else None

    return wait_until(check, timeout=timeout, what=f"run {run_id} to settle")


def research(question: str, **knobs) -> Run:
    return operations.start("research", {"question": question, **knobs}, by="test")


# --- the journeys ------------------------------------------------------------------------------


def test_sign_in_and_watch_a_run_advance_live(web):
    page = web.sign_in("olive")
    expect(page.locator("h1")).to_have_text("Runs")
    expect(page.locator(".empty")).to_contain_text("python manage.py durability start research")
    run = research("What is a fencing token?", slow_ms=700)
    # The list updates by itself: the new run appears without a reload.
    page.evaluate("window.__marker = 'still here'")
    expect(page.locator(f"a[title='{run.id}']")).to_be_visible(timeout=TIMEOUT_MS)
    page.locator(f"a[title='{run.id}']").click()
    page.wait_for_url(f"{web.base}/runs/{run.id}/")
    # Open a panel and mark the page: live updates must keep both.
    page.evaluate("window.__marker = 'still here'")
    page.locator("#inspector nav.tabs a", has_text="State").click()
    expect(page.locator("#inspector .tabs a[aria-current=page]")).to_have_text("State")
    page.locator("#inspector details summary").first.click()
    expect(page.locator("#inspector details[open] .children li").first).to_be_visible()
    expect(page.locator("#run-status")).to_have_text("waiting", timeout=TIMEOUT_MS)
    expect(page.locator("#timeline-items")).to_contain_text("approval requested")
    checkpoints = Run.objects.get(pk=run.pk).head_seq
    assert checkpoints >= 3
    expect(
        page.locator("#timeline-items .ckpt", has_text=f"checkpoint #{checkpoints}")
    ).to_be_visible()
    expect(page.locator("#checkpoint-rows")).to_contain_text(f"#{checkpoints}")
    assert page.evaluate("window.__marker") == "still here", "the page reloaded"
    assert page.locator("#inspector details[open]").count() >= 1, "a live update closed a panel"
    web.shoot("run")
    web.go("/")
    expect(page.locator("#results")).to_contain_text("approval publish")
    web.shoot("runs")


def test_open_a_diff_between_two_checkpoints_and_see_the_appended_message(web):
    run = research("How do leases work?")
    run = settled(run.id)
    page = web.sign_in("olive")
    web.go(f"/runs/{run.id}/")
    # Pick a checkpoint from the timeline: the inspector shows its changes in place.
    page.locator("#timeline-items a.ckpt", has_text="checkpoint #2").click()
    page.wait_for_url(f"{web.base}/runs/{run.id}/checkpoints/2/")
    expect(page.locator("#inspector h2")).to_contain_text("Checkpoint #2")
    expect(page.locator("#inspector .bubble.role-tool").first).to_be_visible()
    # The diff between two checkpoints: the search's findings appended as messages.
    page.locator("#inspector a", has_text="Diff with previous").click()
    page.fill("input[name=a]", "1")
    page.fill("input[name=b]", str(run.head_seq))
    page.locator("form.filters button[type=submit]").click()
    expect(page.locator("#diff-result .diffhead")).to_contain_text(f"#{run.head_seq}")
    bubble = page.locator("#diff-result .change-added .bubble.role-assistant").first
    expect(bubble).to_be_visible()
    draft = Run.objects.get(pk=run.pk)
    expect(page.locator("#diff-result")).to_contain_text("/messages/")
    assert draft.head_seq >= 3
    # A long text changed: its word diff loads when expanded.
    words = page.locator("#diff-result details.words")
    if words.count():
        words.first.locator("summary").click()
        expect(words.first.locator(".worddiff")).to_be_visible()
    web.shoot("diff")
    web.go(f"/runs/{run.id}/checkpoints/{run.head_seq}/?tab=changes")
    expect(page.locator("#inspector .change-added").first).to_be_visible()
    web.shoot("run-diff")


def test_approve_a_waiting_run_and_watch_it_finish(web):
    run = settled(research("What does a write-ahead log guarantee?").id)
    assert run.wait_reason == "approval"
    page = web.sign_in("olive")
    web.go("/approvals/")
    card = page.locator(f"#approval-{Approval.objects.get(run=run).pk}")
    expect(card).to_contain_text("publish")
    expect(card).to_contain_text("draft")
    web.shoot("approvals")
    web.go(f"/runs/{run.id}/")
    page.evaluate("window.__marker = 'still here'")
    page.locator("#run-actions input[name=comment]").fill("reads well")
    page.locator("#run-actions button[value=approve]").click()
    expect(page.locator("#run-status")).to_have_text("succeeded", timeout=TIMEOUT_MS)
    decided = page.locator("#timeline-items .item[data-kind=approval_decided]")
    expect(decided).to_contain_text("publish approved")
    expect(decided).to_contain_text("by olive")
    expect(decided).to_contain_text("reads well")
    expect(page.locator("#timeline-items")).to_contain_text("effect publish done")
    assert page.evaluate("window.__marker") == "still here"
    assert Run.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED


def test_roll_back_a_run_and_see_the_new_head(web):
    run = settled(research("Why add jitter to backoff?").id)
    operations.decide(run.id, "publish", approve=True, by="seed")
    run = settled(run.id)
    assert run.status == RunStatus.SUCCEEDED
    head = run.head_seq
    page = web.sign_in("olive")
    web.go(f"/runs/{run.id}/")
    page.locator("#run-actions a", has_text="Roll back").click()
    expect(page.locator("h1")).to_contain_text(f"to checkpoint #{head - 1}")
    preview = page.locator("#rollback-preview")
    expect(preview).to_contain_text("was done and will not be undone")
    expect(preview).to_contain_text("publish")
    page.fill("input[name=reason]", "publish it again after review")
    # Publish again without being asked, and continue at once (the default is to hold).
    publish = Effect.objects.get(run=run, key="publish")
    page.select_option(f"select[name=effect-{publish.pk}]", "again")
    page.check("input[name=then][value=continue]")
    page.locator("button", has_text=f"Roll back to #{head - 1}").click()
    page.wait_for_url(f"{web.base}/runs/{run.id}/checkpoints/{head + 1}/")
    expect(page.locator("#messages")).to_contain_text(f"new head #{head + 1}")
    expect(page.locator("#run-head")).to_have_text(f"#{head + 1}")
    expect(page.locator("#inspector h2")).to_contain_text(f"Checkpoint #{head + 1}")
    # The run continues from the rolled-back state, live: publish runs again (a new branch,
    # so a new idempotency key) and the run finishes on a newer head.
    expect(page.locator("#run-status")).to_have_text("succeeded", timeout=TIMEOUT_MS)
    expect(page.locator("#run-head")).to_have_text(f"#{head + 2}")
    expect(page.locator("#timeline-items")).to_contain_text(f"rolled back to #{head - 1}")
    cp = Checkpoint.objects.get(run=run, seq=head + 1)
    assert cp.reason == "rollback" and cp.parent.seq == head - 1
    keys = set(Effect.objects.filter(run=run, key="publish").values_list("idempotency_key"))
    assert len(keys) == 2


def test_a_viewer_is_refused_an_action(web):
    run = settled(research("Can a viewer cancel?").id)
    page = web.sign_in("victor")
    web.go(f"/runs/{run.id}/")
    expect(page.locator(".role")).to_have_text("viewer")
    expect(page.locator("#run-actions button", has_text="Cancel run")).to_be_disabled()
    expect(page.locator("#run-actions")).to_contain_text("actions need the operator role")
    # Straight to the server, bypassing the disabled button: refused all the same.
    token = next(c["value"] for c in web.context.cookies() if c["name"] == "csrftoken")
    response = page.request.post(
        f"{web.base}/runs/{run.id}/cancel/",
        form={"cancel-reason": "I should not be able to"},
        headers={"X-CSRFToken": token, "Referer": web.base + "/"},
    )
    assert response.status == 403
    assert "Only operators may" in response.text()
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING


def test_hostile_state_runs_no_script(web):
    hostile = {
        "failures": 0,
        HOSTILE_KEY: HOSTILE_VALUES,
        "<script>window.__pwned=1</script>": {"javascript:window.__pwned=1": HOSTILE_VALUES[1]},
        "link": HOSTILE_VALUES[2],
        "long": HOSTILE_VALUES[0] * 40,
    }
    run = operations.start("test-flaky", hostile, by=HOSTILE_VALUES[1])
    run = settled(run.id)
    assert run.status == RunStatus.SUCCEEDED
    page = web.sign_in("olive")
    for path in (
        f"/runs/{run.id}/",
        f"/runs/{run.id}/checkpoints/1/?tab=changes",
        f"/runs/{run.id}/checkpoints/1/?tab=mutations",
        f"/runs/{run.id}/diff/?a=0&b=1",
        f"/?q={HOSTILE_VALUES[0]}",
        "/audit/",
    ):
        web.go(path)
        assert page.evaluate("window.__pwned") is None, path
    web.go(f"/runs/{run.id}/checkpoints/0/?tab=state")
    for summary in page.locator("#inspector details > summary").all():
        summary.click()
    expect(page.locator("#inspector")).to_contain_text("<script>window.__pwned=1</script>")
    expect(page.locator("#inspector")).to_contain_text(HOSTILE_KEY)
    # Every node is open, the long text loaded whole: all of it shown as text.
    expect(page.locator("#inspector .full pre")).to_contain_text("</script><script>")
    expect(page.locator("#inspector details[open] .children li").first).to_be_visible()
    assert page.locator("a[href^='javascript:']").count() == 0
    assert page.locator("#inspector img").count() == 0
    assert page.evaluate("window.__pwned") is None


def test_the_slo_page_after_a_worker_was_killed(web):
    crashed = research("Why add jitter to exponential backoff?", crash_at="summarise")
    calm = research("What is a fencing token?")
    for run in (crashed, calm):
        settled(run.id, timeout=90)
    operations.decide(calm.id, "publish", approve=True, by="olive", comment="good")
    settled(calm.id)
    support = operations.start(
        "support", {"customer": "ada@example.com", "message": "Refund order A-1001 please"}
    )
    settled(support.id)
    page = web.sign_in("olive")
    web.go("/slo/?window=1h")
    expect(page.locator(".tile[data-indicator=commit_latency] .value")).not_to_have_text("no data")
    expect(page.locator(".tile[data-indicator=recovery_time] .value")).not_to_have_text("no data")
    expect(page.locator("table").last).to_contain_text("browser_dashboard-w1")
    assert page.locator("svg.spark polyline").count() >= 3
    web.shoot("slo")
    data = json.loads(
        page.request.get(f"{web.base}/runs/{crashed.id}/checkpoints/0/state.json").text()
    )
    assert data["question"].startswith("Why add jitter")


def test_start_a_run_from_the_runs_list_and_land_on_its_page(web):
    page = web.sign_in("olive")
    page.get_by_role("link", name="Start a run").first.click()
    page.wait_for_url(f"{web.base}/runs/new/")
    page.select_option("#id_agent", "research")
    # The picker redraws only what depends on the agent: the sentence above the button
    # follows it, and what is typed in the input box stays.
    expect(page.locator("#start-consequence")).to_contain_text("Starts a new run of research")
    page.fill("#id_input", json.dumps({"question": "Started from the dashboard?"}))
    page.fill("#id_reason", "tried from the browser")
    web.shoot("start")
    page.get_by_role("button", name="Start the run").click()
    page.wait_for_url(re.compile(r"/runs/[0-9a-f-]{36}/$"))
    run = Run.objects.get(created_by="olive")
    assert page.url == f"{web.base}/runs/{run.id}/"
    assert run.agent == "research" and json.loads(run.input)["question"].startswith("Started")
    expect(page.locator("body")).to_contain_text(f"Started run {run.short_id} of research")
