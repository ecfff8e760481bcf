"""The audit log's filter: it offers operator actions only, and filters by them."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from durability import operations
from tests.dashboard_helpers import as_operator, dash_agents, operator, text_of, waiting_run

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["as_operator", "dash_agents", "operator"]


def test_the_filter_lists_only_operator_actions(as_operator):
    run = waiting_run("Audit?")
    operations.decide(run.id, "ship", approve=True, by="olive", comment="fine")
    html = text_of(as_operator.get(reverse("dashboard:audit")))
    select = html.split('<select name="kind">')[1].split("</select>")[0]
    offered = re.findall(r'<option value="([^"]*)"', select)
    assert offered[0] == "" and "approval_decided" in offered and "rollback" in offered
    for engine_only in ("checkpoint", "claimed", "commit_latency", "lease_lost", "succeeded"):
        assert engine_only not in offered, engine_only
    assert "decided an approval" in select  # in an operator's words
    # Filtering by one of them: that action only.
    decided = text_of(as_operator.get(reverse("dashboard:audit"), {"kind": "approval_decided"}))
    rows = decided.split('id="audit-rows"')[1]
    assert "ship approved" in rows and "fine" in rows
    started = text_of(as_operator.get(reverse("dashboard:audit"), {"kind": "created"}))
    assert "ship approved" not in started.split('id="audit-rows"')[1]


def test_an_engine_event_is_not_a_filter_and_says_so(as_operator):
    response = as_operator.get(reverse("dashboard:audit"), {"kind": "checkpoint"})
    assert response.status_code == 400
    assert "approval_decided" in text_of(response)
