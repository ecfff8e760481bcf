"""The API's edges, against a live server: times a client may send that the database cannot
hold, refusals that name the field at fault, actions that take the state the caller saw
(status, head, version) and the token an action was taken with, shown in the audit log."""

from __future__ import annotations

import base64
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from durability import operations
from durability.models import Event, Run
from tests.api_helpers import api_for, problem, user_with
from tests.dashboard_helpers import counts, dash_agents, waiting_run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]
__all__ = ["dash_agents"]


@pytest.fixture
def operator_user(live_server):
    return user_with("operator in the policy group", "omar")


@pytest.fixture
def ops(live_server, operator_user):
    return api_for(live_server, operator_user, "deploy-bot")


@pytest.mark.parametrize(
    "since",
    [
        "2024-01-01T00:00:00+23:59",  # Python takes it; PostgreSQL refuses beyond 15:59
        "2024-01-01T00:00:00-16:00",
        "0001-01-01T00:00:00+01:00",  # before year 1 once in UTC
        "9999-12-31T23:59:59-01:00",  # after year 9999 once in UTC
    ],
)
def test_a_since_the_database_cannot_hold_is_a_422_naming_it(ops, since):
    waiting_run()
    body = problem(ops.get("/runs", params={"since": since}), 422, "API422")
    assert body["field"] == "since", body


def test_since_filters_and_a_time_without_offset_is_utc(ops):
    old = waiting_run("old")
    new = waiting_run("new")
    Run.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=3))
    cut = (timezone.now() - timedelta(days=1)).astimezone(timezone.UTC)
    for since in (cut.isoformat(), cut.replace(tzinfo=None).isoformat()):
        listed = ops.get("/runs", params={"since": since})
        assert listed.status_code == 200, listed.text
        assert [r["id"] for r in listed.json()["items"]] == [str(new.id)], since
    far_east = cut.astimezone(timezone.get_fixed_timezone(14 * 60)).isoformat()
    listed = ops.get("/runs", params={"since": far_east})
    assert [r["id"] for r in listed.json()["items"]] == [str(new.id)]


def test_a_forged_cursor_is_a_422_naming_it(ops):
    waiting_run()
    for raw in ("0001-01-01T00:00:00+01:00|" + "0" * 32, "not a time|x", "\xff"):
        cursor = base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")
        body = problem(ops.get("/runs", params={"cursor": cursor}), 422, "API422")
        assert body["field"] == "cursor", body


def test_engine_refusals_name_the_field_at_fault(ops):
    run = waiting_run("fields")
    key = {"Idempotency-Key": "k"}
    first = ops.post("/runs", {"agent": "dash-chain", "input": {}}, headers=key)
    assert first.status_code == 201, first.text
    before = counts()
    unknown = ops.post("/runs", {"agent": "no-such-agent", "input": {}})
    assert problem(unknown, 422, "DUR101")["field"] == "agent"
    level = ops.post("/runs", {"agent": "dash-chain", "input": {}, "durability": "replicated"})
    assert problem(level, 422)["field"] == "durability"
    other = ops.post("/runs", {"agent": "dash-chain", "input": {"question": "?"}}, headers=key)
    assert problem(other, 409, "DUR115")["field"] == "Idempotency-Key"
    state = ops.get(f"/runs/{run.id}/checkpoints/1/state").json()
    bad = ops.post(f"/runs/{run.id}/fork", {"checkpoint": 1, "state": {**state, "count": -1}})
    assert problem(bad, 422, "DUR102")["field"] == "state"
    gone = ops.post(f"/runs/{run.id}/fork", {"checkpoint": 99})
    assert problem(gone, 404, "DUR106")["field"] == "checkpoint"
    back = ops.post(f"/runs/{run.id}/rollback", {"checkpoint": 99})
    assert problem(back, 404, "DUR106")["field"] == "checkpoint"
    decided = ops.post(f"/runs/{run.id}/rollback", {"checkpoint": 1, "decisions": {"x": "again"}})
    assert problem(decided, 422, "DUR100")["field"] == "decisions"
    effect = run.effects.get().id
    unknown_choice = ops.post(
        f"/runs/{run.id}/rollback", {"checkpoint": 1, "decisions": {str(effect): "later"}}
    )
    assert problem(unknown_choice, 422, "DUR100")["field"] == "decisions"
    assert counts() == before


def test_actions_take_the_status_the_caller_saw(ops):
    run = waiting_run("status")
    before = counts()
    stale = ops.post(f"/runs/{run.id}/cancel", {"expected_status": "running"})
    assert "waiting" in problem(stale, 409, "DUR112")["detail"]
    assert counts() == before
    cancelled = ops.post(f"/runs/{run.id}/cancel", {"expected_status": "waiting"})
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    before = counts()
    problem(ops.post(f"/runs/{run.id}/resume", {"expected_status": "failed"}), 409, "DUR112")
    assert counts() == before
    resumed = ops.post(f"/runs/{run.id}/resume", {"expected_status": "cancelled"})
    assert resumed.status_code == 200 and resumed.json()["status"] == "queued", resumed.text
    problem(ops.post(f"/runs/{run.id}/cancel", {"expected_status": "nonsense"}), 422, "API422")


def test_a_rollback_confirms_the_preview_it_was_shown(ops):
    run = waiting_run("preview")
    preview = ops.post(f"/runs/{run.id}/rollback", {"checkpoint": 1, "dry_run": True}).json()
    assert preview["preview_head"] == run.head_seq == 2
    # The run moves on after the preview: a confirmation of that preview is refused.
    operations.rollback(run.id, 1, by="someone else")
    before = counts()
    stale = ops.post(
        f"/runs/{run.id}/rollback", {"checkpoint": 0, "expected_head": preview["preview_head"]}
    )
    assert "#2" in problem(stale, 409, "DUR112")["detail"]
    assert counts() == before
    again = ops.post(f"/runs/{run.id}/rollback", {"checkpoint": 0, "dry_run": True}).json()
    done = ops.post(
        f"/runs/{run.id}/rollback",
        {"checkpoint": 0, "expected_head": again["preview_head"], "expected_status": "waiting"},
    )
    assert done.status_code == 200, done.text
    assert done.json()["preview_head"] is None and done.json()["new_head"] == 4


def test_a_hold_takes_the_version_the_caller_saw_and_leaves_it(ops):
    run = waiting_run("hold")
    version = ops.get(f"/runs/{run.id}").headers["ETag"]
    stale = ops.post(f"/runs/{run.id}/hold", {"hold": True}, headers={"If-Match": '"999"'})
    problem(stale, 409, "DUR112")
    assert not Run.objects.get(pk=run.pk).legal_hold
    held = ops.post(f"/runs/{run.id}/hold", {"hold": True}, headers={"If-Match": version})
    assert held.status_code == 200 and held.json()["legal_hold"], held.text
    # No transition: a worker executing the run keeps its lease (its version).
    assert ops.get(f"/runs/{run.id}").headers["ETag"] == version
    assert held.headers["ETag"] == version
    again = ops.post(f"/runs/{run.id}/hold", {"hold": True}, headers={"If-Match": version})
    assert again.status_code == 200 and again.json()["legal_hold"]
    # A repeat changes nothing, and the audit log does not say it did.
    assert Event.objects.filter(run=run, kind="hold").count() == 1


def test_the_audit_log_names_the_token_an_action_was_taken_with(ops, operator_user):
    run = waiting_run("audit")
    assert ops.post(f"/runs/{run.id}/cancel", {"reason": "duplicate"}).status_code == 200
    page = Client()
    page.force_login(operator_user)
    html = page.get("/audit/").content.decode()
    row = html[html.index("duplicate") - 2000 : html.index("duplicate")]
    assert "omar" in row and "via api token &#x27;deploy-bot&#x27;" in row, row
    timeline = page.get(f"/runs/{run.id}/").content.decode()
    assert "api token &#x27;deploy-bot&#x27;" in timeline


def test_a_database_that_does_not_answer_is_a_503_to_retry_and_a_bug_a_500_without_traceback():
    from django.db import OperationalError
    from django.test import RequestFactory

    from api.api import api

    request = RequestFactory().get("/api/v1/runs")
    away = api.on_exception(request, OperationalError("connection refused"))
    assert away.status_code == 503 and away["Retry-After"] == "5"
    assert away["Content-Type"] == "application/problem+json"
    assert b'"code":"API503"' in away.content
    bug = api.on_exception(request, KeyError("secret-looking detail"))
    assert bug.status_code == 500 and b'"code":"API500"' in bug.content
    assert b"secret-looking" not in bug.content and b"Traceback" not in bug.content
