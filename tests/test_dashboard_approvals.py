"""The approvals inbox and the audit log pages."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from durability import operations
from durability.models import Approval
from tests.dashboard_helpers import (
    HOSTILE_VALUES,
    as_operator,
    as_viewer,
    dash_agents,
    operator,
    text_of,
    viewer,
    waiting_run,
)

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["as_operator", "as_viewer", "dash_agents", "operator", "viewer"]

INBOX = reverse("dashboard:approvals")


def test_empty_inbox_explains_where_approvals_come_from(as_operator):
    html = text_of(as_operator.get(INBOX))
    assert "No approval is waiting." in html and "durability start research" in html


def test_inbox_lists_waiting_approvals_oldest_first_with_wait_and_payload(as_operator):
    newer, older = waiting_run("Newer?"), waiting_run("Older?")
    Approval.objects.filter(run=older).update(requested_at=timezone.now() - timedelta(hours=2))
    html = text_of(as_operator.get(INBOX))
    assert html.index(older.short_id) < html.index(newer.short_id)
    assert "2 waiting, oldest first" in html
    assert "waiting <strong" in html and "2 h 0 min" in html
    # The payload, readable: keys and values, numbers as numbers, secrets redacted.
    assert ">amount_eur<" in html and ">250.0<" in html and ">A-1<" in html
    assert "sk-live-secret" not in html and "[redacted]" in html
    assert "checkpoint #2" in html and "in step <strong>confirm</strong>" in html
    assert "Approve with edits" in html and 'value="reject"' in html


def test_decided_approvals_leave_the_inbox_for_the_recent_list(as_operator):
    run = waiting_run("Decide?")
    operations.decide(run.id, "ship", approve=False, by="olive", comment="not today")
    html = text_of(as_operator.get(INBOX))
    assert "0 waiting" in html and "Recently decided" in html and "not today" in html


def test_an_approval_asked_without_edits_offers_none(as_operator):
    run = waiting_run("As asked?")
    approval = Approval.objects.get(run=run)
    Approval.objects.filter(pk=approval.pk).update(editable='{"x-durability-read-only":true}')
    html = text_of(as_operator.get(INBOX))
    assert "approved or rejected as asked: it takes no edits" in html
    assert f'href="{reverse("dashboard:approval", args=[approval.pk])}"' not in html
    form = as_operator.get(reverse("dashboard:approval", args=[approval.pk]))
    assert form.status_code == 409 and "takes no edits" in text_of(form)
    posted = as_operator.post(reverse("dashboard:approval", args=[approval.pk]), {"f0": "x"})
    assert posted.status_code == 409
    approval.refresh_from_db()
    assert approval.is_pending and not approval.edited_payload


def test_viewer_sees_the_inbox_without_buttons_that_act(as_viewer):
    waiting_run("Viewer?")
    html = text_of(as_viewer.get(INBOX))
    assert "deciding needs the operator role" in html
    assert 'name="decision" value="approve"' not in html


def test_payload_content_is_escaped(as_operator):
    run = waiting_run("Hostile?")
    Approval.objects.filter(run=run).update(
        payload=json.dumps({"note": HOSTILE_VALUES[0], HOSTILE_VALUES[2]: 1})
    )
    html = text_of(as_operator.get(INBOX))
    assert "<script>window" not in html and "&lt;script&gt;window.__pwned=1" in html


def test_audit_log_lists_operator_actions_newest_first_and_filters(as_operator):
    first, second = waiting_run("One?"), waiting_run("Two?")
    operations.decide(first.id, "ship", approve=True, by="olive", comment="ok")
    operations.cancel(second.id, by="bob", reason="duplicate request")
    html = text_of(as_operator.get(reverse("dashboard:audit")))
    assert html.index("duplicate request") < html.index("ship approved")
    assert ">bob<" in html and ">olive<" in html
    only_bob = text_of(as_operator.get(reverse("dashboard:audit"), {"actor": "bob"}))
    assert "duplicate request" in only_bob and "ship approved" not in only_bob
    by_run = text_of(as_operator.get(reverse("dashboard:audit"), {"run": first.short_id}))
    assert "ship approved" in by_run and "duplicate request" not in by_run
    by_kind = text_of(as_operator.get(reverse("dashboard:audit"), {"kind": "cancelled"}))
    assert "duplicate request" in by_kind and "ship approved" not in by_kind
    # "seed" started the runs: the audit log holds who created them too.
    assert "seed" in html
    # Append-only: the page offers no way to change or remove an entry.
    assert '<form method="post"' not in html.split('id="audit-rows"')[1]
    assert as_operator.post(reverse("dashboard:audit")).status_code == 405
    # A deleted run's actions stay, marked deleted, with who deleted it.
    from durability.deletion import delete_runs

    operations.cancel(first.id, by="bob", reason="gone")  # finished, as retention deletes
    delete_runs([first.id], by="retention", reason="finished more than 30 days ago")
    html = text_of(as_operator.get(reverse("dashboard:audit"), {"run": first.short_id}))
    assert "ship approved" in html and "finished more than 30 days ago" in html
    assert f'{first.short_id} <span class="muted">deleted</span>' in html
    assert "run deleted" in html and ">retention<" in html


def test_an_approval_for_a_group_is_decided_by_the_operators_in_it_only(as_operator, operator):
    from django.contrib.auth.models import Group
    from django.test import Client

    from tests.dashboard_helpers import counts, make_user

    run = waiting_run("Finance?")
    approval = Approval.objects.get(run=run)
    deadline = timezone.now() + timedelta(minutes=30)
    Approval.objects.filter(pk=approval.pk).update(
        group="finance",
        deadline=deadline,
        on_timeout="escalate",
        escalate_to="cfo",
        timeout_seconds=1800,
    )
    html = text_of(as_operator.get(INBOX))
    assert "operators in <strong>finance</strong>" in html
    assert "it goes to <strong>cfo</strong>" in html and "in 29 min" in html
    assert "only operators in finance may decide" in html  # olive is not in finance
    before = counts()
    refused = as_operator.post(
        reverse("dashboard:decide", args=[approval.pk]), {"decision": "approve"}
    )
    assert refused.status_code == 403 and "group &#x27;finance&#x27;" in text_of(refused)
    # A member of finance who is a viewer, not an operator, may not decide it either: the
    # group narrows who of the operators may, it does not make a viewer one.
    fay = make_user("fay", "viewers")
    fay.groups.add(Group.objects.get_or_create(name="finance")[0])
    as_fay = Client()
    as_fay.force_login(fay)
    assert 'value="approve"' not in text_of(as_fay.get(INBOX))
    for url in ("dashboard:decide", "dashboard:approval"):
        no = as_fay.post(reverse(url, args=[approval.pk]), {"decision": "approve"})
        assert no.status_code == 403 and "operators" in text_of(no), url
    assert counts() == before
    # An operator in finance may.
    fred = make_user("fred", "operators")
    fred.groups.add(Group.objects.get(name="finance"))
    client = Client()
    client.force_login(fred)
    assert 'value="approve"' in text_of(client.get(INBOX))
    done = client.post(
        reverse("dashboard:decide", args=[approval.pk]),
        {"decision": "approve"},
        HTTP_HX_REQUEST="true",
    )
    assert done.status_code == 200 and "by fred" in text_of(done)
    assert "run-changed" in done["HX-Trigger"]


def test_timeouts_and_escalations_show_in_the_timeline(as_operator):
    from durability.models import Event

    run = waiting_run("Timeout?")
    Event.objects.create(
        run=run,
        kind="approval_escalated",
        actor="policy:timeout",
        data=json.dumps({"name": "ship", "to": "cfo"}),
    )
    Event.objects.create(
        run=run,
        kind="approval_decided",
        actor="policy:timeout",
        data=json.dumps({"name": "ship", "approved": False, "timeout": True}),
    )
    html = text_of(as_operator.get(reverse("dashboard:run", args=[run.id])))
    assert "ship escalated" in html and "to cfo" in html
    assert "ship rejected (timed out)" in html
