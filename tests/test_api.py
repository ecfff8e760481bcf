"""The JSON API against a live server over real HTTP, on the real database: who may do what
(every role against every operation, refusals changing nothing), tokens (expiry,
revocation), idempotent starts and sends, stale If-Match, the audit trail, the runs list's
filters, problem documents for bad input, the rate limit, and the docs served from the
product itself."""

from __future__ import annotations

import io
import json
import uuid
from datetime import timedelta

import pytest
import requests
from django.core.management import call_command
from django.utils import timezone

from api.models import ApiToken
from durability import operations
from durability.models import Approval, Effect, Event, Message, Run
from durability.testing import drive
from tests.api_helpers import (
    ACTORS,
    GROUP,
    READERS,
    ROLES,
    Api,
    api_for,
    problem,
    user_with,
    verdict_agent,
)
from tests.dashboard_helpers import counts, dash_agents, finished_run, waiting_run

# The smoke subset too: the API makes the same promises on the embedded default (SQLite).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]
__all__ = ["dash_agents", "verdict_agent"]


def scene(group: str = "", *, cancelled: bool = False) -> Run:
    run = waiting_run("API?")
    assert run.status == "waiting", (run.status, run.error)
    Approval.objects.filter(run=run).update(group=group)
    if cancelled:
        operations.cancel(run, by="seed", reason="to resume it")
    run.refresh_from_db()
    return run


@pytest.fixture
def operator_api(live_server):
    return api_for(live_server, user_with("operator in the policy group", "olga"), "ci")


@pytest.fixture
def viewer_api(live_server):
    return api_for(live_server, user_with("viewer", "vera"), "reader")


# --- the document and its page ------------------------------------------------------------


def test_openapi_document_and_docs_page_are_served_from_the_product(live_server):
    anonymous = Api(live_server.url)
    doc = anonymous.get("/openapi.json")
    assert doc.status_code == 200
    spec = doc.json()
    assert spec["openapi"].startswith("3.")
    assert (
        "/api/v1/runs" in spec["paths"]
        and "/api/v1/approvals/{approval_id}/decision" in (spec["paths"])
    )
    page = anonymous.get("/docs")
    assert page.status_code == 200
    html = page.text
    assert "/static/ninja/swagger-ui-bundle.js" in html
    assert "https://" not in html and "cdn" not in html.lower()
    # The assets themselves come from this server.
    bundle = requests.get(f"{live_server.url}/static/ninja/swagger-ui-bundle.js", timeout=30)
    assert bundle.status_code == 200 and len(bundle.content) > 100_000


# --- tokens ---------------------------------------------------------------------------------


def test_no_token_a_wrong_one_a_revoked_one_and_an_expired_one_get_401(live_server):
    user = user_with("operator in the policy group", "tina")
    api = api_for(live_server, user, "laptop")
    assert api.get("/runs").status_code == 200
    for caller in (Api(live_server.url), Api(live_server.url, "dur_not-a-token")):
        body = problem(caller.get("/runs"), 401, "API401")
        assert body["field"] == "Authorization"
    token = ApiToken.objects.get(user=user, name="laptop")
    assert len(token.digest) == 64 and api.secret not in token.digest  # stored hashed
    from api import tokens

    tokens.revoke(user, token.id)
    reply = api.get("/runs")
    problem(reply, 401, "API401")
    assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    soon = api_for(live_server, user, "short", expires_at=timezone.now() + timedelta(hours=1))
    assert soon.get("/runs").status_code == 200
    ApiToken.objects.filter(name="short").update(expires_at=timezone.now() - timedelta(seconds=1))
    problem(soon.get("/runs"), 401, "API401")
    before = counts()
    problem(soon.post("/runs", {"agent": "dash-chain", "input": {}}), 401)
    assert counts() == before


def test_an_inactive_users_token_is_refused(live_server):
    user = user_with("superuser", "gone")
    api = api_for(live_server, user)
    user.is_active = False
    user.save()
    problem(api.get("/runs"), 401)


# --- every role against every operation ---------------------------------------------------


def _reads(api: Api, run: Run) -> dict[str, object]:
    approval = Approval.objects.get(run=run)
    ref = run.id
    return {
        "list runs": api.get("/runs", params={"agent": "dash-chain"}),
        "one run": api.get(f"/runs/{ref}"),
        "checkpoints": api.get(f"/runs/{ref}/checkpoints"),
        "one checkpoint": api.get(f"/runs/{ref}/checkpoints/1"),
        "state": api.get(f"/runs/{ref}/checkpoints/1/state"),
        "mutations": api.get(f"/runs/{ref}/checkpoints/1/mutations"),
        "diff": api.get(f"/runs/{ref}/diff", params={"from": 0, "to": 2}),
        "verification": api.get(f"/runs/{ref}/verification"),
        "timeline": api.get(f"/runs/{ref}/timeline"),
        "calls": api.get(f"/runs/{ref}/calls"),
        "effects": api.get(f"/runs/{ref}/effects"),
        "slo": api.get("/slo"),
        "slo per agent": api.get("/slo/agents"),
        "list approvals": api.get("/approvals"),
        "one approval": api.get(f"/approvals/{approval.id}"),
    }


@pytest.mark.parametrize("role", list(ROLES))
def test_each_role_against_each_operation(live_server, role):
    api = api_for(live_server, user_with(role, "someone"))
    run = scene(GROUP)
    for what, reply in _reads(api, run).items():
        if role in READERS:
            assert reply.status_code == 200, (what, reply.text)
        else:
            problem(reply, 403, "DUR111")

    def decision(group: str, approve: bool):
        approval = Approval.objects.get(run=scene(group))
        body = {"approve": approve, "comment": "matrix"}
        return lambda: api.post(f"/approvals/{approval.id}/decision", body)

    def on(path: str, body: dict, **made):
        run = scene(**made)
        return lambda: api.post(f"/runs/{run.id}{path}", body)

    def in_doubt():
        run = scene()
        effect = Effect.objects.get(run=run)
        Effect.objects.filter(pk=effect.pk).update(status="in_doubt")
        path = f"/runs/{run.id}/effects/{effect.id}/resolution"
        return lambda: api.post(path, {"outcome": "done", "result": {"ok": True}})

    actions = {
        "start": lambda: lambda: api.post("/runs", {"agent": "dash-chain", "input": {}}),
        "rollback": lambda: on("/rollback", {"checkpoint": 1, "reason": "matrix"}),
        "fork": lambda: on("/fork", {"checkpoint": 1}),
        "hold": lambda: on("/hold", {"hold": True}),
        "resolve": in_doubt,
        "send": lambda: on("/messages", {"name": "nudge", "data": 1}),
        "cancel": lambda: on("/cancel", {"reason": "matrix"}),
        "resume": lambda: on("/resume", {}, cancelled=True),
        "decide": lambda: decision(GROUP, True),
        "decide, no group": lambda: decision("", False),
    }
    for what, prepare in actions.items():
        act = prepare()
        before = counts()
        reply = act()
        allowed = role in ACTORS and not (
            what == "decide" and role == "operator outside the policy group"
        )
        if allowed:
            assert reply.status_code in (200, 201), (what, reply.text)
        else:
            problem(reply, 403, "DUR111")
            assert counts() == before, what


# --- start, idempotency, audit ----------------------------------------------------------------


def test_start_is_idempotent_by_key_and_a_reused_key_is_a_409(operator_api):
    body = {"agent": "dash-chain", "input": {"question": "once"}, "reason": "nightly"}
    key = {"Idempotency-Key": f"nightly-{uuid.uuid4()}"}
    first = operator_api.post("/runs", body, headers=key)
    assert first.status_code == 201, first.text
    run = first.json()
    assert run["status"] == "queued" and run["agent"] == "dash-chain"
    assert first.headers["ETag"] == f'"{run["version"]}"'
    assert first.headers["Location"].endswith(run["id"])
    again = operator_api.post("/runs", body, headers=key)
    assert again.status_code == 200 and again.json()["id"] == run["id"]
    before = counts()
    other = operator_api.post("/runs", {**body, "input": {"question": "twice"}}, headers=key)
    assert "already started run" in problem(other, 409, "DUR115")["detail"]
    # Another agent: the conflict, not that agent's opinion of the input.
    agent = operator_api.post("/runs", {**body, "agent": "api-verdict"}, headers=key)
    assert "another agent (dash-chain)" in problem(agent, 409, "DUR115")["detail"]
    level = operator_api.post("/runs", {**body, "durability": "relaxed"}, headers=key)
    assert "another durability level" in problem(level, 409, "DUR115")["detail"]
    assert counts() == before
    assert Run.objects.filter(agent="dash-chain").count() == 1
    created = Event.objects.get(run_id=run["id"], kind="created")
    assert created.actor == "olga" and created.reason == "nightly"
    assert '"via":"api token \'ci\'"' in created.data


def test_retries_racing_with_one_key_make_one_run_and_one_201(operator_api):
    from concurrent.futures import ThreadPoolExecutor

    body = {"agent": "dash-chain", "input": {"question": "racing"}}
    key = {"Idempotency-Key": f"race-{uuid.uuid4()}"}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: operator_api.post("/runs", body, headers=key), range(8)))
    assert sorted(a.status_code for a in answers) == [200] * 7 + [201], [a.text for a in answers]
    assert len({a.json()["id"] for a in answers}) == 1
    run = scene()
    send = {"Idempotency-Key": "race-send"}
    url = f"/runs/{run.id}/messages"
    with ThreadPoolExecutor(8) as pool:
        sent = list(
            pool.map(lambda _: operator_api.post(url, {"name": "reply"}, headers=send), range(8))
        )
    assert sorted(a.status_code for a in sent) == [200] * 7 + [201], [a.text for a in sent]


def test_send_is_idempotent_by_key_and_a_reused_key_is_a_409(operator_api):
    run = scene()
    key = {"Idempotency-Key": "hook-1"}
    first = operator_api.post(f"/runs/{run.id}/messages", {"name": "reply", "data": 1}, headers=key)
    assert first.status_code == 201, first.text
    again = operator_api.post(f"/runs/{run.id}/messages", {"name": "reply", "data": 1}, headers=key)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    before = counts()
    other = operator_api.post(f"/runs/{run.id}/messages", {"name": "reply", "data": 2}, headers=key)
    problem(other, 409, "DUR115")
    assert counts() == before
    assert Message.objects.filter(run=run).count() == 1
    event = Event.objects.get(run=run, kind="message_received")
    assert event.actor == "olga" and "api token" in event.data


# --- If-Match ---------------------------------------------------------------------------------


def test_a_stale_if_match_is_a_409_and_changes_nothing(operator_api):
    run = scene(cancelled=True)
    seen = operator_api.get(f"/runs/{run.id}")
    etag = seen.headers["ETag"]
    assert etag == f'"{seen.json()["version"]}"'
    resumed = operator_api.post(
        f"/runs/{run.id}/resume", {"reason": "go"}, headers={"If-Match": etag}
    )
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["status"] == "queued" and resumed.headers["ETag"] != etag
    before = counts()
    # The same decision again, made on what the caller saw before: refused, nothing done.
    stale = operator_api.post(f"/runs/{run.id}/cancel", {}, headers={"If-Match": etag})
    assert "moved on" in problem(stale, 409, "DUR112")["detail"]
    # The resume sent again (a retry): stale too, not "already queued".
    again = operator_api.post(f"/runs/{run.id}/resume", {}, headers={"If-Match": etag})
    assert "moved on" in problem(again, 409, "DUR112")["detail"]
    assert counts() == before
    bad = operator_api.post(f"/runs/{run.id}/cancel", {}, headers={"If-Match": "yesterday"})
    assert problem(bad, 422, "API422")["field"] == "If-Match"
    assert counts() == before
    current = operator_api.get(f"/runs/{run.id}").headers["ETag"]
    cancelled = operator_api.post(f"/runs/{run.id}/cancel", {}, headers={"If-Match": current})
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"


# --- approvals --------------------------------------------------------------------------------


def test_approve_with_edits_then_the_run_finishes_with_them(operator_api):
    run = scene()
    # The agent lets an operator edit the amount, as a number up to 500.
    editable = {"type": "object", "properties": {"amount_eur": {"type": "number", "maximum": 500}}}
    Approval.objects.filter(run=run).update(editable=json.dumps(editable))
    inbox = operator_api.get("/approvals", params={"status": "pending"}).json()["items"]
    card = next(a for a in inbox if a["run_id"] == str(run.id))
    assert card["may_decide"] and card["payload"]["amount_eur"] == 250.0
    assert card["editable"] == ["amount_eur"]
    assert card["payload"]["api_token"] != "sk-live-secret"  # redacted
    before = counts()
    wrong = operator_api.post(
        f"/approvals/{card['id']}/decision",
        {"approve": True, "payload": {**card["payload"], "amount_eur": "lots"}},
        headers={"If-Match": f'"{card["run_version"]}"'},
    )
    assert problem(wrong, 422, "DUR113")["field"] == "amount_eur"
    # A payload that is not an object reaches the engine, which says why it is refused.
    flat = operator_api.post(
        f"/approvals/{card['id']}/decision", {"approve": True, "payload": "ship it"}
    )
    assert "must be an object" in problem(flat, 422, "DUR113")["detail"]
    assert counts() == before
    decided = operator_api.post(
        f"/approvals/{card['id']}/decision",
        {"approve": True, "comment": "capped", "payload": {**card["payload"], "amount_eur": 200}},
        headers={"If-Match": f'"{card["run_version"]}"'},
    )
    assert decided.status_code == 200, decided.text
    assert decided.json()["status"] == "approved" and decided.json()["decided_by"] == "olga"
    assert decided.json()["edited_payload"]["amount_eur"] == 200
    unsaid = operator_api.post(f"/approvals/{card['id']}/decision", {"approve": False})
    # A rejection says why, before anything is looked at.
    assert problem(unsaid, 422, "DUR100")["field"] == "comment"
    assert "say why you reject it" in unsaid.text
    twice = operator_api.post(
        f"/approvals/{card['id']}/decision", {"approve": False, "comment": "too late"}
    )
    problem(twice, 409, "DUR108")
    event = Event.objects.get(run=run, kind="approval_decided")
    assert event.actor == "olga" and event.reason == "capped" and "api token 'ci'" in event.data
    done = drive(run.id)
    assert done.status == "succeeded"
    state = operator_api.get(f"/runs/{run.id}/checkpoints/{done.head_seq}/state").json()
    assert state["shipped"]["amount_eur"] == 200


def test_an_operator_outside_the_policy_group_is_refused_by_the_engine(live_server):
    api = api_for(live_server, user_with("operator outside the policy group", "otto"))
    run = scene(GROUP)
    approval = Approval.objects.get(run=run)
    card = api.get(f"/approvals/{approval.id}").json()
    assert card["may_decide"] is False and card["group"] == GROUP
    before = counts()
    problem(api.post(f"/approvals/{approval.id}/decision", {"approve": True}), 403, "DUR111")
    assert counts() == before


# --- reading ----------------------------------------------------------------------------------


def test_runs_list_filters_and_keyset_pages(viewer_api):
    runs = [scene() for _ in range(3)]
    operations.cancel(runs[0], by="seed")
    page = viewer_api.get("/runs", params={"limit": 2}).json()
    assert len(page["items"]) == 2 and page["next_cursor"]
    rest = viewer_api.get("/runs", params={"limit": 2, "cursor": page["next_cursor"]}).json()
    seen = [r["id"] for r in page["items"] + rest["items"]]
    assert seen == [str(r.id) for r in reversed(runs)] and rest["next_cursor"] is None
    cancelled = viewer_api.get("/runs", params={"status": "cancelled"}).json()["items"]
    assert [r["id"] for r in cancelled] == [str(runs[0].id)]
    by_prefix = viewer_api.get("/runs", params={"q": str(runs[1].id)[:8]}).json()["items"]
    assert str(runs[1].id) in [r["id"] for r in by_prefix]
    one = viewer_api.get(f"/runs/{runs[1].id}").json()
    assert one["waiting_for"] == "approval" and one["head"] == 2
    assert one["pending_approvals"] and one["lease"]["owner"] == ""
    diff = viewer_api.get(f"/runs/{runs[1].id}/diff", params={"from": 0, "to": 2}).json()
    assert {c["path"] for c in diff["changes"]} >= {"/count"}
    assert viewer_api.get(f"/runs/{runs[1].id}/verification").json()["ok"] is True


def test_runs_list_filters_by_agent_outcome_since_and_input_text(viewer_api, verdict_agent):
    # Each filter has a run it must leave out: another agent, another outcome, one started
    # before `since`, an input without the text.
    old = waiting_run("Where is the invoice for order A-17?")
    Run.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(hours=2))
    late = waiting_run("How late is the courier?")
    approved = drive(
        operations.start(verdict_agent, {"verdict": "approved", "note": "Invoice ok"}).id
    )
    declined = drive(operations.start(verdict_agent, {"verdict": "declined"}).id)
    assert (approved.status, approved.outcome) == ("succeeded", "approved"), approved.error
    assert (declined.status, declined.outcome) == ("succeeded", "declined"), declined.error

    def ids(**params) -> list[str]:
        reply = viewer_api.get("/runs", params=params)
        assert reply.status_code == 200, (params, reply.text)
        return [r["id"] for r in reply.json()["items"]]

    def of(*runs: Run) -> list[str]:
        return [str(r.id) for r in runs]

    assert ids() == of(declined, approved, late, old)
    assert ids(agent="dash-chain") == of(late, old)
    assert ids(agent=verdict_agent) == of(declined, approved)
    assert ids(agent="no-such-agent") == []
    assert ids(outcome="approved") == of(approved)
    assert ids(outcome="declined", agent=verdict_agent) == of(declined)
    assert ids(outcome="declined", agent="dash-chain") == []
    Run.objects.filter(pk=late.pk).update(recoveries=1)
    assert ids(recovered="true") == of(late)
    assert ids(recovered="false") == of(declined, approved, old)
    assert ids(waiting_for="approval") == of(late, old)
    assert ids(waiting_for="approval", agent=verdict_agent) == ids(waiting_for="message") == []
    refused = viewer_api.get("/runs", params={"waiting_for": "a person"})
    assert refused.status_code == 422 and "waiting_for" in refused.text
    hour_ago = timezone.now() - timedelta(hours=1)
    assert ids(since=hour_ago.isoformat()) == of(declined, approved, late)
    # The same instant written with another UTC offset is the same filter.
    east = hour_ago.astimezone(timezone.get_fixed_timezone(5 * 60 + 30))
    assert ids(since=east.isoformat()) == of(declined, approved, late)
    assert ids(since=(timezone.now() + timedelta(minutes=5)).isoformat()) == []
    # Input text, matched without regard to case, in the question of one agent and the note
    # of the other.
    assert ids(q="INVOICE") == of(approved, old)
    assert ids(q="courier") == of(late)
    assert ids(q="invoice", agent="dash-chain") == of(old)
    assert ids(q="invoice", since=hour_ago.isoformat()) == of(approved)
    assert ids(q="nobody wrote this") == []


# --- bad input ------------------------------------------------------------------------------


def test_bad_input_is_a_problem_document_and_changes_nothing(operator_api):
    run = scene()
    before = counts()
    cases = [
        (operator_api.post("/runs", {"agent": "no-such-agent"}), 422, "DUR101", ""),
        (operator_api.post("/runs", {"input": {}}), 422, "API422", "agent"),
        (
            operator_api.request(
                "POST", "/runs", data=b"{not json", headers={"Content-Type": "application/json"}
            ),
            400,
            "API400",
            "",
        ),
        (operator_api.get("/runs", params={"limit": 0}), 422, "API422", "limit"),
        (operator_api.get("/runs", params={"agent": "a\x00b"}), 422, "API422", "agent"),
        (operator_api.post("/runs", {"agent": "dash-chain", "reason": "\x00"}), 422, "", "reason"),
        (operator_api.get("/runs", params={"status": "nope"}), 422, "API422", "status"),
        (operator_api.get("/runs", params={"cursor": "garbage!"}), 422, "API422", "cursor"),
        (operator_api.get(f"/runs/{uuid.uuid4()}"), 404, "DUR105", ""),
        (operator_api.get("/runs/zz"), 404, "DUR105", ""),
        (operator_api.get(f"/runs/{run.id}/checkpoints/99"), 404, "DUR106", ""),
        (operator_api.get("/approvals/999999"), 404, "DUR109", ""),
        (operator_api.post(f"/runs/{run.id}/resume", {}), 409, "DUR107", ""),
        (operator_api.post(f"/runs/{run.id}/messages", {"name": ""}), 422, "API422", "name"),
        (
            operator_api.post(
                "/runs", {"agent": "dash-chain", "input": {}, "durability": "sloppy"}
            ),
            422,
            "DUR100",
            "",
        ),
    ]
    for reply, status, code, field in cases:
        body = problem(reply, status, code)
        if field:
            assert body["field"] == field, body
    assert counts() == before


# --- rate limit -------------------------------------------------------------------------------


def test_over_the_rate_limit_is_a_429_with_retry_after(live_server, settings):
    settings.DURABILITY_API_RATE_LIMIT = "3/60"
    api = api_for(live_server, user_with("viewer", "busy"))
    other = api_for(live_server, user_with("viewer", "calm"))
    assert [api.get("/runs").status_code for _ in range(3)] == [200, 200, 200]
    refused = api.get("/runs")
    problem(refused, 429, "API429")
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert other.get("/runs").status_code == 200  # per token


# --- token page and command ------------------------------------------------------------------


def test_token_page_makes_shows_once_and_revokes(client):
    user = user_with("viewer", "paula")
    client.force_login(user)
    page = client.post("/api/tokens/", {"action": "create", "name": "ci", "expires_in_days": "30"})
    assert page.status_code == 200
    secret = page.context["secret"]
    assert secret.startswith("dur_") and secret in page.content.decode()
    token = ApiToken.objects.get(user=user)
    assert (
        token.expires_at is not None and secret not in client.get("/api/tokens/").content.decode()
    )
    bad = client.post("/api/tokens/", {"action": "create", "name": "x", "expires_in_days": "-1"})
    assert bad.status_code == 422 and ApiToken.objects.count() == 1
    client.post("/api/tokens/", {"action": "revoke", "token": str(token.id)})
    token.refresh_from_db()
    assert token.state() == "revoked"


def test_management_command_creates_lists_and_revokes(capsys):
    from django.core.management import call_command

    user_with("operator in the policy group", "cleo")
    call_command("apitokens", "create", "cleo", "deploy", "--expires-in-days", "7")
    secret = capsys.readouterr().out.strip()
    assert secret.startswith("dur_")
    token = ApiToken.objects.get(name="deploy")
    call_command("apitokens", "list", "cleo")
    assert "deploy" in capsys.readouterr().out
    call_command("apitokens", "revoke", "cleo", str(token.id))
    token.refresh_from_db()
    assert token.state() == "revoked"


def test_show_and_list_json_speak_the_apis_names_with_the_same_values(viewer_api):
    """A script may read a run from the API or from ``durability show --json`` (and ``list
    --json``): the same names, the same values, the same time format; show adds what it
    prints beside them."""
    run = waiting_run("Same names?")
    out = io.StringIO()
    call_command("durability", "show", str(run.id), "--json", stdout=out)
    shown = json.loads(out.getvalue())

    detail = viewer_api.get(f"/runs/{run.id}").json()
    assert detail["waiting_for"] == "approval" and detail["pending_approvals"]
    assert {k: shown[k] for k in detail} == detail
    assert "wait" not in shown and "parent" not in shown  # the names show used to have

    checkpoints = viewer_api.get(f"/runs/{run.id}/checkpoints").json()["items"]
    assert len(checkpoints) == 3
    assert [{k: c[k] for k in checkpoints[0]} for c in shown["checkpoints"]] == checkpoints
    assert all("superstep" in c for c in shown["checkpoints"])

    approvals = viewer_api.get("/approvals", params={"run": str(run.id)}).json()["items"]
    assert [a.pop("may_decide") for a in approvals] == [False]  # a viewer decides nothing
    assert [{k: a[k] for k in approvals[0]} for a in shown["approvals"]] == approvals
    assert [a["on_current_branch"] for a in shown["approvals"]] == [True]
    assert not any("may_decide" in a for a in shown["approvals"])  # who asks: the API's

    effects = viewer_api.get(f"/runs/{run.id}/effects").json()["items"]
    assert len(effects) == 1 and effects[0]["duplicates_prevented"] == 0
    assert shown["effects"] == effects
    assert shown["calls"] == 1 and shown["state"] is not None

    out = io.StringIO()
    call_command("durability", "list", "--json", "--limit", "1", stdout=out)
    listed = json.loads(out.getvalue())["items"]
    assert listed == viewer_api.get("/runs", params={"limit": 1}).json()["items"]
    assert [r["id"] for r in listed] == [str(run.id)]

    # Decided: when, by whom, with what comment.
    done = finished_run("Decided names?")
    out = io.StringIO()
    call_command("durability", "show", str(done.id), "--json", stdout=out)
    shown = json.loads(out.getvalue())
    params = {"run": str(done.id), "status": "approved"}
    approvals = viewer_api.get("/approvals", params=params).json()["items"]
    assert [a.pop("may_decide") for a in approvals] == [False]
    assert approvals[0]["decided_by"] == "seed" and approvals[0]["decided_at"]
    assert [{k: a[k] for k in approvals[0]} for a in shown["approvals"]] == approvals
