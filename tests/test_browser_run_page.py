"""The run page agrees with itself after live updates, and every page fits a phone.

Same setup as test_browser_dashboard (gunicorn, real Celery workers, one Chromium for the
session, a failure on any console error, page error, dialog or CSP violation)."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from durability import operations
from durability.models import Approval, Run, RunStatus
from durability.testing import wait_until
from tests.test_browser_dashboard import (
    TIMEOUT_MS,
    Watched,
    app,
    research,
    settled,
    users,
    web,
)

__all__ = ["app", "users", "web"]

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def waiting_for(run_id, reason: str, head_above: int = -1) -> Run:
    def check():
        run = Run.objects.get(pk=run_id)
        return run if run.wait_reason == reason and run.head_seq > head_above else None

    return wait_until(check, timeout=60, what=f"run {run_id} to wait for {reason}")


def regions(page) -> dict[str, str]:
    """The head as each region of the run page shows it, read as a person would."""
    header = page.locator("#run-head").inner_text()
    first_row = page.locator("#checkpoint-rows tr").first.locator("td").first.inner_text()
    inspector = page.locator("#inspector h2").inner_text()
    last_ckpt = page.locator("#timeline-items .item[data-kind=checkpoint] .ckpt").last.inner_text()
    return {
        "header": header.strip(),
        "table": first_row.split()[0],
        "inspector": inspector,
        "timeline": last_ckpt,
    }


def test_a_message_sent_with_the_page_open_moves_every_region_to_the_new_head(web):
    run = operations.start("test-chat", {}, by="test")
    run = waiting_for(run.id, "message")
    before = run.head_seq
    page = web.sign_in("olive")
    web.go(f"/runs/{run.id}/")
    expect(page.locator("#inspector h2")).to_contain_text(f"Checkpoint #{before}")
    page.evaluate("window.__marker = 'still here'")
    # A reason typed into the cancel confirmation, left open: a live update must keep both.
    page.locator("#run-actions summary", has_text="Cancel run").click()
    page.locator("#run-actions input[name=cancel-reason]").fill("half typed")
    operations.send(run.id, "user", "hello", by="test")
    after = waiting_for(run.id, "message", head_above=before).head_seq
    head = f"#{after}"
    expect(page.locator("#run-head")).to_have_text(head, timeout=TIMEOUT_MS)
    expect(page.locator("#checkpoint-rows tr").first.locator("td").first).to_contain_text(head)
    expect(page.locator("#inspector h2")).to_contain_text(f"Checkpoint {head}")
    expect(page.locator("#inspector h2 .tag.head")).to_have_text("head")
    ckpts = page.locator("#timeline-items .item[data-kind=checkpoint] .ckpt")
    expect(ckpts.last).to_contain_text(f"checkpoint {head}")
    seen = regions(page)
    assert seen["header"] == head and seen["table"] == head, seen
    assert f"Checkpoint {head}" in seen["inspector"] and "head" in seen["inspector"], seen
    assert f"checkpoint {head}" in seen["timeline"], seen
    # Every row of the table is there once, newest first, none missing.
    rows = [
        r.split()[0] for r in page.locator("#checkpoint-rows tr td:first-child").all_inner_texts()
    ]
    assert rows == [f"#{n}" for n in range(after, -1, -1)], rows
    assert page.evaluate("window.__marker") == "still here", "the page reloaded"
    assert page.locator("#run-actions details[open] input[name=cancel-reason]").input_value() == (
        "half typed"
    )
    # A checkpoint the reader picked stays in the inspector; only its head mark changes.
    page.locator("#checkpoint-rows a", has_text=f"#{before}").first.click()
    expect(page.locator("#inspector h2")).to_contain_text(f"Checkpoint #{before}")
    expect(page.locator("#inspector h2 .tag.head")).to_have_count(0)
    operations.send(run.id, "user", "bye", by="test")
    wait_until(lambda: Run.objects.get(pk=run.id).is_finished, timeout=60, what="chat to end")
    final = f"#{Run.objects.get(pk=run.id).head_seq}"
    expect(page.locator("#run-head")).to_have_text(final, timeout=TIMEOUT_MS)
    expect(page.locator("#checkpoint-rows tr").first.locator("td").first).to_contain_text(final)
    expect(page.locator("#inspector h2")).to_contain_text(f"Checkpoint #{before}")
    expect(page.locator("#inspector-head")).to_contain_text(f"head is {final}")
    expect(ckpts.last).to_contain_text(f"checkpoint {final}")
    web.shoot("run-live")


PAGES = (
    "/",
    "/runs/{run}/",
    "/runs/{run}/checkpoints/1/?tab=state",
    "/runs/{run}/diff/?a=0&b={head}",
    "/runs/{run}/rollback/",
    "/runs/{run}/fork/?from=1",
    "/approvals/",
    "/approvals/{approval}/",
    "/audit/",
    "/slo/",
    "/notifications/",
)


def test_every_page_fits_a_phone_without_a_console_error(browser, app, users):
    run = settled(research("Does every page fit a phone?").id)
    assert run.status == RunStatus.WAITING
    approval = Approval.objects.get(run=run)
    phone = Watched(browser, app.url)
    try:
        phone.page.set_viewport_size({"width": 390, "height": 844})
        phone.sign_in("olive")
        wide = []
        for template in PAGES:
            path = template.format(run=run.id, head=run.head_seq, approval=approval.pk)
            response = phone.page.goto(app.url + path)
            assert response is not None and response.status == 200, path
            overflow = phone.page.evaluate(
                "document.documentElement.scrollWidth - document.documentElement.clientWidth"
            )
            if overflow > 0:
                wide.append(f"{path}: {overflow}px wider than the screen")
            name = path.strip("/").split("?")[0].replace("/", "-").replace(str(run.id), "run")
            phone.shoot(f"phone-{name or 'runs'}")
            phone.check()
        assert not wide, "\n".join(wide)
    finally:
        phone.context.close()
