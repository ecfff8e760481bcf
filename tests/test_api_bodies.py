"""Request bodies as the API reads them, against a live server: a field it does not know
and a value of another JSON type are refused, not ignored or coerced (a misspelt ``dry_run``
would roll back for real, ``"approve": "yes"`` approve a refund); a body that is not a JSON
object, not sent as JSON or too large is refused saying which; paths and methods the API
does not have answer in its format; and a decision moves the run's version."""

from __future__ import annotations

import pytest
import requests

from durability.models import Approval, Run
from tests.api_helpers import api_for, problem, user_with
from tests.dashboard_helpers import counts, dash_agents, waiting_run

pytestmark = [pytest.mark.django_db(transaction=True)]
__all__ = ["dash_agents"]


@pytest.fixture
def ops(live_server):
    return api_for(live_server, user_with("operator in the policy group", "omar"), "bot")


def test_a_misspelt_field_is_refused_and_nothing_happens(ops):
    run = waiting_run("typo")
    approval = Approval.objects.get(run=run)
    before = counts()
    typo = ops.post(f"/runs/{run.id}/rollback", {"checkpoint": 1, "dryRun": True})
    body = problem(typo, 422, "API422")
    assert body["field"] == "dryRun" and "unknown field 'dryRun'" in body["detail"], body
    edit = ops.post(
        f"/approvals/{approval.id}/decision", {"approve": True, "paylod": {"sources": 1}}
    )
    assert problem(edit, 422, "API422")["field"] == "paylod"
    start = ops.post("/runs", {"agent": "dash-chain", "input": {}, "durabilty": "relaxed"})
    assert problem(start, 422, "API422")["field"] == "durabilty"
    assert counts() == before


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("decision", {"approve": "yes"}, "approve"),
        ("decision", {"approve": 1}, "approve"),
        ("rollback", {"checkpoint": "1"}, "checkpoint"),
        ("rollback", {"checkpoint": 1, "dry_run": "yes"}, "dry_run"),
        ("hold", {"hold": "false"}, "hold"),
    ],
)
def test_a_value_of_another_json_type_is_refused_not_coerced(ops, path, body, field):
    run = waiting_run("types")
    approval = Approval.objects.get(run=run)
    url = f"/approvals/{approval.id}/decision" if path == "decision" else f"/runs/{run.id}/{path}"
    before = counts()
    assert problem(ops.post(url, body), 422, "API422")["field"] == field
    assert counts() == before


def test_a_body_that_is_not_a_json_object_sent_as_json_is_refused_saying_which(ops):
    run = waiting_run("bodies")
    url = f"/runs/{run.id}/cancel"
    before = counts()
    plain = ops.request(
        "POST", url, data=b'{"reason": "x"}', headers={"Content-Type": "text/plain"}
    )
    assert problem(plain, 415, "API415")["field"] == "Content-Type"
    form = ops.request("POST", url, data={"reason": "x"})  # a form, as curl -d sends it
    assert "application/x-www-form-urlencoded" in problem(form, 415, "API415")["detail"]
    listed = ops.request("POST", url, data=b"[1]", headers={"Content-Type": "application/json"})
    assert "not a list" in problem(listed, 422, "API422")["detail"]
    broken = ops.request("POST", url, data=b"{no", headers={"Content-Type": "application/json"})
    problem(broken, 400, "API400")
    missing = ops.request("POST", url)
    assert "needs a JSON object as its body" in problem(missing, 422, "API422")["detail"]
    assert counts() == before
    done = ops.post(url, {})  # every field's default
    assert done.status_code == 200 and done.json()["status"] == "cancelled", done.text


def test_a_body_larger_than_the_server_reads_is_a_413(ops, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    before = counts()
    big = ops.post("/runs", {"agent": "dash-chain", "input": {"question": "x" * 20_000}})
    assert "10,000 bytes" in problem(big, 413, "API413")["detail"]
    assert counts() == before


def test_the_server_reads_a_body_as_large_as_the_largest_state():
    from django.conf import settings

    from durability.conf import conf

    assert settings.DATA_UPLOAD_MAX_MEMORY_SIZE > conf.MAX_STATE_BYTES


def test_paths_and_methods_the_api_does_not_have_answer_as_problems(ops, live_server):
    run = waiting_run("paths")
    problem(ops.get("/nonexistent"), 404, "API404")
    problem(ops.get(f"/runs/{run.id}/effects/1"), 404, "API404")
    wrong = ops.request("DELETE", f"/runs/{run.id}")
    assert "GET" in problem(wrong, 405, "API405")["detail"] and "GET" in wrong.headers["Allow"]
    # The dashboard's pages keep their own answers.
    page = requests.get(f"{live_server.url}/no-such-page/", timeout=30)
    assert page.status_code == 404 and "problem+json" not in page.headers["Content-Type"]


def test_a_decision_moves_the_version_so_an_action_on_the_older_one_is_refused(ops):
    run = waiting_run("colleague")
    seen = ops.get(f"/runs/{run.id}").headers["ETag"]
    approval = Approval.objects.get(run=run)
    decided = ops.post(f"/approvals/{approval.id}/decision", {"approve": True})
    assert decided.status_code == 200, decided.text
    assert decided.headers["ETag"] != seen
    assert decided.json()["run_version"] == Run.objects.get(pk=run.pk).lease_token
    late = ops.post(
        f"/runs/{run.id}/cancel", {"reason": "I saw it waiting"}, headers={"If-Match": seen}
    )
    assert "approval decided by omar" in problem(late, 409, "DUR112")["detail"]
    assert Run.objects.get(pk=run.pk).status == "queued"


def test_a_rejection_with_an_edited_payload_is_refused_naming_it(ops):
    run = waiting_run("reject with edits")
    approval = Approval.objects.get(run=run)
    before = counts()
    both = ops.post(
        f"/approvals/{approval.id}/decision",
        {"approve": False, "comment": "no", "payload": {"sources": 1}},
    )
    assert problem(both, 422, "DUR100")["field"] == "payload"
    assert counts() == before
