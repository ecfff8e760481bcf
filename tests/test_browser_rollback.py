"""Rolling back the demo refund run in headless Chromium, as an operator would: from the runs
list to the run, "Roll back…", a checkpoint picked before the refund. The demo outbox is the
customer's side: no second refund and no second email happens until an operator makes the
second decision in the inbox, and then exactly one of each.

Uses the app, workers and Chromium of the dashboard's browser tests (one Chromium for the
session, a failure on any console error or CSP violation)."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from durability import operations, rollbacks
from durability.models import Approval, ApprovalStatus, Effect, Run, RunStatus
from durability.testing import wait_until
from examples.models import OutboxMessage
from tests import test_browser_dashboard as dashboard
from tests.test_browser_dashboard import settled

# The dashboard's browser fixtures: the app (gunicorn, workers, beat) for this module, its
# users, and a watched page in the session's one Chromium.
app, users, web = dashboard.app, dashboard.users, dashboard.web

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def outbox() -> tuple[int, int]:
    """(refunds, emails) the customer received."""
    return (
        OutboxMessage.objects.filter(channel="refund").count(),
        OutboxMessage.objects.filter(channel="email").count(),
    )


def asked(run: Run, key: str) -> Approval:
    name = rollbacks.REPEAT_APPROVAL + key

    def pending():
        return Approval.objects.filter(run=run, name=name, status=ApprovalStatus.PENDING).first()

    return wait_until(pending, timeout=60, what=f"the run to ask about {key}")


def test_roll_back_the_refund_run_and_nothing_is_paid_twice_without_a_second_decision(web):
    run = operations.start(
        "support", {"customer": "ada@example.com", "message": "Refund order A-1001 please"}
    )
    run = settled(run.id)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert outbox() == (1, 1)
    refund = Effect.objects.get(run=run, key="refund")
    before_refund = refund.base.seq  # the checkpoint the refunding step started from

    page = web.sign_in("olive")
    page.locator(f"a[title='{run.id}']").click()
    page.wait_for_url(f"{web.base}/runs/{run.id}/")
    page.locator("#run-actions a", has_text="Roll back").click()
    # It points first at the last checkpoint before the last effect (the email); the
    # operator picks the one before the refund instead.
    page.select_option("#rollback-to", str(before_refund))
    page.locator("#rollback-picker button").click()
    expect(page.locator("h1")).to_contain_text(f"to checkpoint #{before_refund}")
    table = page.locator("table.effects-undo")
    expect(table.locator("tr", has_text="refund 89 EUR on order A-1001")).to_contain_text(
        "can be compensated"
    )
    expect(table.locator("tr", has_text="email to ada@example.com")).to_contain_text(
        "cannot be undone"
    )
    preview = page.locator("#rollback-preview")
    expect(preview).to_contain_text("is put on hold: nothing runs until an operator continues")
    expect(preview).to_contain_text(
        "if the run reaches refund again, it stops and asks an operator before doing it a second"
    )
    web.shoot("rollback")
    page.fill("input[name=reason]", "refund amount was wrong; redo")
    page.locator("button", has_text=f"Roll back to #{before_refund}").click()
    expect(page.locator("#messages")).to_contain_text("The run is on hold")
    expect(page.locator("#run-status")).to_contain_text("waiting")
    held = Run.objects.get(pk=run.pk)
    assert (held.status, held.wait_reason) == (RunStatus.WAITING, "hold")

    # Continue: the new branch reaches the refund and stops to ask, paying nothing.
    page.locator("#run-actions button", has_text="Continue").click()
    again = asked(run, "refund")
    assert outbox() == (1, 1)
    web.go("/approvals/")
    card = page.locator(f"#approval-{again.pk}")
    expect(card).to_contain_text("refund 89 EUR on order A-1001 was done on the abandoned branch;")
    expect(card).to_contain_text("perform refund 89 EUR on order A-1001?")
    expect(card).to_contain_text("to perform now")
    # Approved or rejected as asked: what it performs is what it shows.
    expect(card).to_contain_text("approved or rejected as asked: it takes no edits")
    expect(card.locator("a", has_text="Approve with edits")).to_have_count(0)
    assert outbox() == (1, 1)

    # The second decision: exactly one more refund, then the email is asked about too.
    card.locator("button[value=approve]").click()
    expect(card).to_contain_text("approved")
    email = asked(run, "reply")
    assert outbox() == (2, 1)
    web.go("/approvals/")
    page.locator(f"#approval-{email.pk} button[value=approve]").click()
    expect(page.locator(f"#approval-{email.pk}")).to_contain_text("approved")
    done = settled(run.id, reasons=())
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert outbox() == (2, 2)
    keys = set(OutboxMessage.objects.filter(channel="refund").values_list("idempotency_key"))
    assert len(keys) == 2
