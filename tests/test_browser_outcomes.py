"""Outcomes and recoveries as an operator sees them, in headless Chromium against the demo
agents on real workers: a rejected run says so beside its status, in the list and on its
page; a run whose worker was killed is found from the list's recovered filter, and its page
says which call was replayed rather than paid again."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from durability.models import Run, RunStatus
from tests.test_browser_dashboard import TIMEOUT_MS, app, research, settled, users, web

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]
__all__ = ["app", "users", "web"]


def test_reject_an_approval_and_see_the_outcome_beside_the_status(web):
    run = settled(research("What does a write-ahead log guarantee?").id)
    other = settled(research("What is a fencing token?").id)
    assert run.wait_reason == other.wait_reason == "approval"
    page = web.sign_in("olive")
    web.go(f"/runs/{run.id}/")
    page.locator("#run-actions input[name=comment]").fill("not accurate enough")
    page.locator("#run-actions button[value=reject]").click()
    # The run ends as the agent says it does: succeeded, rejected at publish.
    expect(page.locator("#run-status")).to_have_text("succeeded", timeout=TIMEOUT_MS)
    expect(page.locator("#run-outcome")).to_have_text("rejected at publish")
    assert Run.objects.get(pk=run.pk).outcome == "rejected at publish"

    web.go("/")
    row = page.locator("tr", has=page.locator(f"a[title='{run.id}']"))
    expect(row.locator(".statuscell")).to_contain_text("rejected at publish")
    # The waiting run has no outcome yet; the badge filters the list by it.
    expect(page.locator("tr", has=page.locator(f"a[title='{other.id}']"))).not_to_contain_text(
        "rejected at publish"
    )
    row.locator("a.outcome").click()
    page.wait_for_url(re.compile(r".*outcome=rejected\+at\+publish.*"))
    expect(page.locator(f"a[title='{run.id}']")).to_be_visible()
    expect(page.locator(f"a[title='{other.id}']")).to_have_count(0)
    expect(page.locator("select[name=outcome]")).to_have_value("rejected at publish")
    web.shoot("runs-outcome")


def test_find_the_recovered_run_from_the_list_and_read_replayed_not_paid(web):
    # The worker process dies in summarise, right after its LLM call was journaled.
    crashed = research("Why add jitter to exponential backoff?", crash_at="summarise")
    calm = research("How do leases work?")
    crashed, calm = settled(crashed.id, timeout=90), settled(calm.id, timeout=90)
    assert crashed.recoveries == 1 and calm.recoveries == 0
    assert crashed.status == RunStatus.WAITING  # the recovered run went on to its approval

    page = web.sign_in("olive")
    page.locator("form.filters input[name=recovered]").check()
    page.wait_for_url(re.compile(r".*recovered=yes.*"))
    expect(page.locator(f"a[title='{calm.id}']")).to_have_count(0)
    link = page.locator(f"a[title='{crashed.id}']")
    expect(page.locator("tr", has=link).locator("a.recovered")).to_have_text("recovered")
    link.click()
    page.wait_for_url(f"{web.base}/runs/{crashed.id}/")
    recovered = page.locator("#run-recoveries")
    expect(recovered).to_contain_text("replayed from the journal (not paid again)")
    expect(recovered).to_contain_text("0 effects repeated")
    expect(recovered).to_contain_text("llm")
    replayed = page.locator("#timeline-items .item[data-kind=replayed]", has_text="call llm")
    expect(replayed).to_contain_text("replayed, not paid")
    web.shoot("run-recovered")
