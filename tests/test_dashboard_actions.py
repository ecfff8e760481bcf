"""Operator actions through the dashboard: resume, cancel, roll back, fork, resolve, decide.

Each is POSTed directly (not only through the page's buttons): a viewer is refused with 403
and nothing changes; CSRF is enforced; a double submit or a second operator is told what the
first did; bad input gets a clear error and changes nothing; every action is audited."""

from __future__ import annotations

import json
import re
from html import escape
from uuid import uuid4

import pytest
from django.test import Client
from django.urls import reverse

from durability import Agent, canonical, operations, registry
from durability.models import (
    Approval,
    ApprovalStatus,
    Effect,
    EffectStatus,
    Event,
    EventKind,
    Run,
    RunStatus,
)
from durability.testing import drive, state_of
from tests.dashboard_helpers import (
    as_operator,
    as_viewer,
    counts,
    csrf_from,
    dash_agents,
    finished_run,
    form_token,
    operator,
    text_of,
    viewer,
    waiting_run,
)

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["as_operator", "as_viewer", "dash_agents", "operator", "viewer"]


def url(name: str, *args) -> str:
    return reverse(f"dashboard:{name}", args=args)


def version(run: Run) -> int:
    """The run version a page showing the run now would post."""
    return Run.objects.get(pk=run.pk).lease_token


def form_version(html: str, prefix: str = "") -> str:
    name = f"{prefix}-version" if prefix else "version"
    match = re.search(rf'name="{name}" value="([^"]+)"', html)
    assert match, f"no run version {name!r} in the form"
    return match.group(1)


def landed(client: Client, response, run: Run) -> str:
    """A repeated or outdated submit lands on the run's page: the notice it shows there."""
    assert response.status_code == 302, (response.status_code, text_of(response)[:500])
    assert response["Location"] == url("run", run.id)
    page = text_of(client.get(response["Location"]))
    return page.split('id="messages"')[1].split("</ul>")[0]


def failed_run() -> Run:
    run = waiting_run("Will fail?")
    operations.cancel(run.id, by="seed", reason="setup")
    return Run.objects.get(pk=run.pk)


def in_doubt_run(faults) -> tuple[Run, Effect]:
    faults.set({"point": "after_effect", "action": "crash"})
    run = operations.start("dash-chain", {"question": "Doubt?"}, by="seed")
    run = drive(run.id)
    faults.clear()
    assert (run.status, run.wait_reason) == (RunStatus.WAITING, "in_doubt")
    return run, Effect.objects.get(run=run)


# --- permissions: every action, POSTed directly by a viewer --------------------------------------


def test_a_viewer_is_refused_every_action_and_nothing_changes(as_viewer, faults):
    run = waiting_run("Viewer?")
    doubt_run, effect = in_doubt_run(faults)
    approval = Approval.objects.get(run=run)
    cp = run.checkpoints.get(seq=1)
    before = counts()
    posts = [
        (url("resume", run.id), {"resume-reason": "x"}),
        (url("cancel", run.id), {"cancel-reason": "x"}),
        (url("rollback", run.id), {"checkpoint_id": cp.id, "expected_head": 2, "reason": "x"}),
        (url("fork", run.id), {"from_seq": 1, "state": "{}", "action": "fork"}),
        (url("resolve", doubt_run.id, effect.pk), {"outcome": "done", "result": "{}"}),
        (url("decide", approval.pk), {"decision": "approve"}),
        (url("decide", approval.pk), {"decision": "reject", "comment": "no"}),
        (url("approval", approval.pk), {"f0": "1", "comment": "x"}),
        (url("send", run.id), {"send-name": "reply", "send-data": "hi"}),
    ]
    for target, data in posts:
        response = as_viewer.post(target, data)
        assert response.status_code == 403, target
        assert "Only operators may" in text_of(response), target
        htmx = as_viewer.post(target, data, HTTP_HX_REQUEST="true")
        assert htmx.status_code == 403 and "<html" not in text_of(htmx), target
    assert counts() == before
    assert Effect.objects.get(pk=effect.pk).status == EffectStatus.IN_DOUBT


def test_csrf_is_enforced_on_actions(operator):
    run = waiting_run("CSRF?")
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    before = counts()
    refused = client.post(url("cancel", run.id), {"cancel-reason": "no token"})
    assert refused.status_code == 403 and "CSRF" in text_of(refused)
    assert counts() == before
    page = text_of(client.get(url("run", run.id)))
    token = csrf_from(page)
    accepted = client.post(
        url("cancel", run.id),
        {
            "cancel-reason": "with token",
            "cancel-version": version(run),
            "csrfmiddlewaretoken": token,
        },
    )
    assert accepted.status_code == 302
    assert Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED
    # htmx sends the token in a header (hx-headers on <body>).
    other = waiting_run("Header?")
    approval = Approval.objects.get(run=other)
    decided = client.post(
        url("decide", approval.pk),
        {"decision": "approve"},
        HTTP_X_CSRFTOKEN=client.cookies["csrftoken"].value,
        HTTP_HX_REQUEST="true",
    )
    assert decided.status_code == 200 and "approved" in text_of(decided)


# --- resume and cancel ------------------------------------------------------------------------


def test_resume_a_cancelled_run_and_it_is_audited(as_operator):
    run = failed_run()
    response = as_operator.post(
        url("resume", run.id), {"resume-reason": "try again", "resume-version": version(run)}
    )
    assert response.status_code == 302 and response["Location"] == url("run", run.id)
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    event = Event.objects.filter(run=run, kind=EventKind.RESUMED).get()
    assert (event.actor, event.reason) == ("olive", "try again")
    audit = text_of(as_operator.get(url("audit")))
    assert "olive" in audit and "try again" in audit and "resumed" in audit


def test_cancel_needs_a_reason_and_the_second_cancel_is_told_who_did_it(as_operator):
    run = waiting_run("Cancel?")
    before = counts()
    shown = version(run)
    missing = as_operator.post(
        url("cancel", run.id), {"cancel-reason": "", "cancel-version": shown}
    )
    assert missing.status_code == 422 and counts() == before
    first = as_operator.post(
        url("cancel", run.id), {"cancel-reason": "wrong customer", "cancel-version": shown}
    )
    assert first.status_code == 302
    assert Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED
    # On the version seen before the first: stale (a colleague acted), told who did what,
    # back on the run's page.
    second = as_operator.post(
        url("cancel", run.id), {"cancel-reason": "me too", "cancel-version": shown}, follow=True
    )
    html = text_of(second)
    assert "Nothing was done: the run moved on since you saw it" in html
    assert "last: cancelled by olive" in html
    # On the version it has now: already cancelled, said with the reason.
    again = as_operator.post(
        url("cancel", run.id), {"cancel-reason": "me too", "cancel-version": version(run)}
    )
    html = text_of(again)
    assert again.status_code == 409
    assert "already cancelled" in html and "cancelled by olive" in html
    assert "wrong customer" in html
    assert Event.objects.filter(run=run, kind=EventKind.CANCELLED).count() == 1


def test_the_same_form_submitted_twice_acts_once(as_operator):
    run = failed_run()
    page = text_of(as_operator.get(url("run", run.id)))
    token = form_token(page, "resume")
    data = {
        "resume-reason": "double click",
        "resume-token": token,
        "resume-version": form_version(page, "resume"),
    }
    assert as_operator.post(url("resume", run.id), data).status_code == 302
    again = as_operator.post(url("resume", run.id), data)
    # Not an error page: the run's page, with a notice of what happened the first time.
    assert "already submitted by olive" in landed(as_operator, again, run)
    assert Event.objects.filter(run=run, kind=EventKind.RESUMED).count() == 1


def test_unknown_run_is_404_and_changes_nothing(as_operator):
    before = counts()
    nobody = "00000000-0000-0000-0000-000000000000"
    for name in ("resume", "cancel", "rollback", "fork"):
        assert as_operator.post(url(name, nobody), {}).status_code == 404, name
    assert as_operator.post(url("decide", 999999), {"decision": "approve"}).status_code == 404
    assert counts() == before


# --- roll back ---------------------------------------------------------------------------------


def test_rollback_confirmation_lists_effects_done_after_the_target(as_operator):
    run = finished_run("Rollback?")
    page = as_operator.get(url("rollback", run.id), {"to": 1})
    html = text_of(page)
    assert page.status_code == 200
    assert "is put on hold: nothing runs until an operator continues it (next step: pay)" in html
    assert "was done and will not be undone (it cannot be undone); if the run reaches pay" in html
    form = {
        "checkpoint_id": run.checkpoints.get(seq=1).id,
        "expected_head": run.head_seq,
        "version": form_version(html),
        "token": form_token(html),
    }
    effect = run.effects.get().id
    # Previewing the choices needs no reason; rolling back does.
    before = counts()
    preview = as_operator.post(
        url("rollback", run.id), {**form, "action": "preview", f"effect-{effect}": "again"}
    )
    assert preview.status_code == 200 and "is performed again without asking" in text_of(preview)
    unsaid = as_operator.post(url("rollback", run.id), {**form, "action": "rollback"})
    assert unsaid.status_code == 422 and "say why you roll back" in text_of(unsaid)
    assert counts() == before
    response = as_operator.post(url("rollback", run.id), {**form, "reason": "the answer was wrong"})
    assert response.status_code == 302
    assert response["Location"] == url("checkpoint", run.id, run.head_seq + 1)
    old_head = run.head_seq
    run.refresh_from_db()
    assert (run.status, run.wait_reason) == ("waiting", "hold")
    assert run.head_seq == old_head + 1
    head = run.checkpoints.get(seq=run.head_seq)
    assert head.reason == "rollback" and head.parent.seq == 1
    event = Event.objects.get(run=run, kind=EventKind.ROLLBACK)
    assert (event.actor, event.reason) == ("olive", "the answer was wrong")
    assert len(json.loads(event.data)["done_not_undone"]) == 1
    assert state_of(run.id) == state_of(run.id, 1)


def test_a_double_submitted_or_stale_rollback_is_refused(as_operator, operator):
    run = finished_run("Twice?")
    html = text_of(as_operator.get(url("rollback", run.id), {"to": 1}))
    data = {
        "checkpoint_id": run.checkpoints.get(seq=1).id,
        "expected_head": run.head_seq,
        "version": form_version(html),
        "reason": "once",
        "token": form_token(html),
    }
    assert as_operator.post(url("rollback", run.id), data).status_code == 302
    again = as_operator.post(url("rollback", run.id), data)
    assert "already submitted by olive" in landed(as_operator, again, run)
    # A second operator with a confirmation made before the first acted.
    other = Client()
    other.force_login(operator)
    stale = other.post(
        url("rollback", run.id),
        {**data, "token": "11111111-2222-3333-4444-555555555555"},
    )
    assert "the run changed since this rollback was reviewed" in landed(other, stale, run)
    assert Event.objects.filter(run=run, kind=EventKind.ROLLBACK).count() == 1


def test_rollback_to_a_checkpoint_of_another_run_is_refused(as_operator):
    run = finished_run("Mine?")
    other = finished_run("Theirs?")
    before = counts()
    response = as_operator.post(
        url("rollback", run.id),
        {
            "checkpoint_id": other.checkpoints.get(seq=1).id,
            "expected_head": run.head_seq,
            "version": version(run),
            "reason": "cross-run",
            "token": "11111111-2222-3333-4444-555555555555",
        },
    )
    assert response.status_code == 422
    assert "belongs to run" in text_of(response) and "DUR100" in text_of(response)
    assert counts() == before


def test_rollback_to_the_head_or_a_missing_checkpoint_is_refused(as_operator):
    run = finished_run("Head?")
    head = as_operator.get(url("rollback", run.id), {"to": run.head_seq})
    assert head.status_code == 409 and "already the head" in text_of(head)
    missing = as_operator.get(url("rollback", run.id), {"to": 77})
    assert missing.status_code == 404 and "no checkpoint #77" in text_of(missing)


# --- fork ----------------------------------------------------------------------------------------


def test_fork_editor_shows_the_state_with_secrets_redacted(as_operator):
    run = waiting_run("Fork me?")
    html = text_of(as_operator.get(url("fork", run.id), {"from": 1}))
    assert "Fork me?" in html and "[redacted]" in html and "sk-very-secret" not in html
    assert "state schema" in html and "&quot;required&quot;" in html


def test_malformed_json_in_the_fork_editor_is_shown_inline_and_nothing_is_made(as_operator):
    run = waiting_run("Broken?")
    before = counts()
    response = as_operator.post(
        url("fork", run.id),
        {"from_seq": 1, "state": '{"question": "x",', "action": "fork", "token": ""},
    )
    assert response.status_code == 422
    html = text_of(response)
    assert "the state is not valid JSON" in html and "line 1" in html
    assert counts() == before


def test_a_state_that_fails_the_schema_is_shown_inline_and_nothing_is_made(as_operator):
    run = waiting_run("Schema?")
    state = state_of(run.id, 1)
    state["count"] = "three"
    before = counts()
    response = as_operator.post(
        url("fork", run.id),
        {"from_seq": 1, "state": json.dumps(state), "action": "fork", "token": str(uuid4())},
    )
    assert response.status_code == 422
    assert "fails the schema" in text_of(response) and "/count" in text_of(response)
    assert counts() == before


def test_a_fork_is_what_if_unless_a_live_one_is_confirmed(as_operator):
    run = finished_run("Effects again?")
    page = text_of(as_operator.get(url("fork", run.id), {"from": 1}))
    assert "After #1 this run performed" in page and "A live fork that takes the same" in page
    state = json.dumps(state_of(run.id, 1))
    before = counts()
    unconfirmed = as_operator.post(
        url("fork", run.id),
        {"from_seq": 1, "state": state, "action": "fork", "mode": "live", "token": str(uuid4())},
    )
    assert unconfirmed.status_code == 422
    assert "a live fork performs its effects for real" in text_of(unconfirmed)
    assert counts() == before
    what_if = as_operator.post(
        url("fork", run.id),
        {"from_seq": 1, "state": state, "action": "fork", "token": str(uuid4())},
    )
    assert what_if.status_code == 302
    forked = Run.objects.get(forked_from=run)
    assert forked.what_if and not forked.what_if_live
    live = as_operator.post(
        url("fork", run.id),
        {
            "from_seq": 1,
            "state": state,
            "action": "fork",
            "mode": "live",
            "perform": "on",
            "token": str(uuid4()),
        },
    )
    assert live.status_code == 302
    assert not Run.objects.filter(forked_from=run).exclude(pk=forked.pk).get().what_if


def test_check_asks_the_engine_without_forking(as_operator):
    run = waiting_run("Check?")
    state = state_of(run.id, 1)
    before = counts()
    response = as_operator.post(
        url("fork", run.id),
        {"from_seq": 1, "state": json.dumps(state), "action": "check"},
    )
    assert response.status_code == 200 and "The engine accepts this state" in text_of(response)
    assert counts() == before


def test_fork_with_an_edited_state_and_redacted_values_round_trip_unchanged(as_operator):
    run = waiting_run("Edit me?")
    page = text_of(as_operator.get(url("fork", run.id), {"from": 1}))
    shown = json.loads(_textarea(page))
    assert shown["api_key"] == "[redacted]"
    unchanged = as_operator.post(
        url("fork", run.id),
        {"from_seq": 1, "state": json.dumps(shown), "action": "fork", "token": form_token(page)},
    )
    assert unchanged.status_code == 302
    same = Run.objects.get(forked_from=run)
    assert json.loads(Event.objects.get(run=same, kind=EventKind.FORK).data)["edited"] is False
    # The fork starts from the same bytes (a start's state hash is its whole state's).
    source_bytes = canonical.dumps(state_of(run.id, 1))
    assert same.checkpoints.get(seq=0).state_hash == canonical.sha256_hex(source_bytes)

    page = text_of(as_operator.get(url("fork", run.id), {"from": 1}))
    edited = json.loads(_textarea(page))
    edited["question"] = "Edited question?"
    response = as_operator.post(
        url("fork", run.id),
        {
            "from_seq": 1,
            "state": json.dumps(edited),
            "action": "fork",
            "reason": "ask better",
            "token": form_token(page),
        },
    )
    new = Run.objects.filter(forked_from=run).exclude(pk=same.pk).get()
    assert response["Location"] == url("run", new.id)
    assert state_of(new.id, 0)["question"] == "Edited question?"
    assert (new.forked_from_seq, new.created_by) == (1, "olive")
    event = Event.objects.get(run=new, kind=EventKind.FORK)
    assert event.reason == "ask better" and json.loads(event.data)["edited"] is True
    # The same form again: told, not forked twice.
    again = as_operator.post(
        url("fork", run.id),
        {"from_seq": 1, "state": json.dumps(edited), "action": "fork", "token": form_token(page)},
    )
    assert str(new.id) in landed(as_operator, again, run)
    assert Run.objects.filter(forked_from=run).count() == 2


def _textarea(html: str) -> str:
    import html as html_lib
    import re

    match = re.search(r"<textarea[^>]*name=\"state\"[^>]*>(.*?)</textarea>", html, re.S)
    assert match
    return html_lib.unescape(match.group(1))


# --- effects in doubt -------------------------------------------------------------------------


def test_resolve_an_effect_in_doubt(as_operator, faults):
    run, effect = in_doubt_run(faults)
    page = as_operator.get(url("resolve", run.id, effect.pk))
    assert page.status_code == 200 and effect.idempotency_key in text_of(page)
    before = counts()
    shown = form_version(text_of(page))
    assert shown == str(version(run))
    bad = as_operator.post(
        url("resolve", run.id, effect.pk),
        {"outcome": "done", "result": "{not json", "version": shown},
    )
    assert bad.status_code == 422 and "the result is not valid JSON" in text_of(bad)
    assert counts() == before
    assert Effect.objects.get(pk=effect.pk).status == EffectStatus.IN_DOUBT
    done = as_operator.post(
        url("resolve", run.id, effect.pk),
        {
            "outcome": "done",
            "result": '{"sent": "money"}',
            "note": "checked the bank",
            "version": shown,
        },
    )
    assert done.status_code == 302
    effect.refresh_from_db()
    assert (effect.status, effect.resolved_by) == (EffectStatus.DONE, "olive")
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED
    twice = as_operator.post(
        url("resolve", run.id, effect.pk), {"outcome": "retry", "version": shown}
    )
    assert twice.status_code == 409 and "resolved by olive" in text_of(twice)
    other = as_operator.post(url("resolve", run.id, 999999), {"outcome": "retry", "version": shown})
    assert other.status_code == 404


# --- approvals ---------------------------------------------------------------------------------


def test_approve_from_the_inbox_then_a_second_decision_is_told_who_decided(as_operator, operator):
    run = waiting_run("Approve?")
    approval = Approval.objects.get(run=run)
    card = as_operator.post(
        url("decide", approval.pk),
        {"decision": "approve", "comment": "looks right"},
        HTTP_HX_REQUEST="true",
    )
    html = text_of(card)
    assert card.status_code == 200 and html.lstrip().startswith("<article")
    assert "approved" in html and "by olive" in html and "looks right" in html
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED
    other = Client()
    other.force_login(operator)
    second = other.post(
        url("decide", approval.pk),
        {"decision": "reject", "comment": "no!"},
        HTTP_HX_REQUEST="true",
    )
    assert second.status_code == 409
    assert "already approved by olive" in text_of(second)
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.APPROVED
    plain = other.post(url("decide", approval.pk), {"decision": "approve"})
    assert plain.status_code == 409 and "the first decision stands" in text_of(plain)
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["decision"] == {"approved": True, "by": "olive"}


def test_reject_needs_a_comment(as_operator):
    run = waiting_run("Reject?")
    approval = Approval.objects.get(run=run)
    before = counts()
    missing = as_operator.post(url("decide", approval.pk), {"decision": "reject", "comment": ""})
    assert missing.status_code == 422 and "say why you reject it" in text_of(missing)
    assert counts() == before
    rejected = as_operator.post(
        url("decide", approval.pk),
        {"decision": "reject", "comment": "too expensive", "next": url("run", run.id)},
    )
    assert rejected.status_code == 302 and rejected["Location"] == url("run", run.id)
    approval.refresh_from_db()
    assert (approval.status, approval.comment) == (ApprovalStatus.REJECTED, "too expensive")


def test_approve_with_edits_is_typed_and_keeps_secrets_unchanged(as_operator):
    run = waiting_run("Edit the payload?")
    approval = Approval.objects.get(run=run)
    page = text_of(as_operator.get(url("approval", approval.pk)))
    assert 'name="f0"' in page and 'type="number"' in page and "secret: kept as it is" in page
    assert "sk-live-secret" not in page
    keys = list(json.loads(approval.payload))
    fields = {f"f{i}": "" for i in range(len(keys))}
    values = {"amount_eur": "not a number", "order": "A-1", "note": "asap"}
    for i, key in enumerate(keys):
        if key in values:
            fields[f"f{i}"] = values[key]
    before = counts()
    bad = as_operator.post(url("approval", approval.pk), fields)
    assert bad.status_code == 422 and "Enter a number" in text_of(bad)
    assert counts() == before
    fields[f"f{keys.index('amount_eur')}"] = "120.5"
    # A secret field is disabled: whatever is posted for it, the original is kept.
    fields[f"f{keys.index('api_token')}"] = "attacker-value"
    response = as_operator.post(url("approval", approval.pk), {**fields, "comment": "cap it"})
    assert response.status_code == 302
    approval.refresh_from_db()
    edited = json.loads(approval.edited_payload)
    original = json.loads(approval.payload)
    assert edited["amount_eur"] == 120.5 and edited["api_token"] == original["api_token"]
    assert "attacker-value" not in approval.edited_payload
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["shipped"]["amount_eur"] == 120.5
    decided = as_operator.post(url("approval", approval.pk), fields)
    assert "already" in text_of(decided) and "approved" in text_of(decided)


def test_rollback_confirmation_names_children_cancelled_and_messages_returned(as_operator):
    from durability.models import Message

    run = finished_run("Branch?")
    base = run.checkpoints.get(seq=2)
    child = Run.objects.create(
        agent="dash-chain",
        agent_version="2",
        input="{}",
        parent_run=run,
        spawn_base=base,
        spawn_key="helper",
        spawn_occurrence=0,
    )
    Message.objects.create(run=run, name="reply", data='"hi"', consumed_base=base)
    html = text_of(as_operator.get(url("rollback", run.id), {"to": 1}))
    assert "1 child run started after #1 and still unfinished is cancelled" in html
    assert child.short_id in html
    assert "1 message consumed after #1 goes back to the inbox of the run" in html


@pytest.fixture
def asking():
    """An agent whose one step waits for a message named "reply"; a run of it, waiting."""

    def ask(state, ctx):
        state["reply"] = ctx.wait_for("reply")

    registry.unregister("dash-chat")
    Agent("dash-chat", steps=[ask])
    try:
        yield drive(operations.start("dash-chat", {}, by="seed").id)
    finally:
        registry.unregister("dash-chat")


def test_send_the_message_a_run_waits_for_once(as_operator, asking):
    from durability.models import Message

    run = asking
    assert (run.status, run.wait_reason, run.wait_detail) == ("waiting", "message", "reply")
    page = text_of(as_operator.get(url("run", run.id)))
    assert "waits for a message named" in page and url("send", run.id) in page
    data = {
        "send-name": "reply",
        "send-data": '{"text": "yes"}',
        "send-as_json": "on",
        "send-token": form_token(page, "send"),
        "send-version": form_version(page, "send"),
    }
    empty = as_operator.post(url("send", run.id), {**data, "send-data": "  ", "send-as_json": ""})
    assert empty.status_code == 422 and "the message is empty" in text_of(empty)
    assert not Message.objects.filter(run=run).exists()
    assert as_operator.post(url("send", run.id), data).status_code == 302
    assert as_operator.post(url("send", run.id), data).status_code == 302
    assert Message.objects.filter(run=run).count() == 1  # the double submit: once
    event = Event.objects.get(run=run, kind="message_received")
    assert event.actor == "olive"
    bad = as_operator.post(url("send", run.id), {**data, "send-data": "{nope"})
    assert bad.status_code == 422 and "not valid JSON" in text_of(bad)
    assert drive(run.id).status == RunStatus.SUCCEEDED
    assert state_of(run.id)["reply"] == {"text": "yes"}


def test_a_message_refused_because_the_run_moved_on_is_not_lost(as_operator, asking):
    """A send made on a page the run has left: nothing is sent, and what the operator typed
    is put back in the form while the run still waits for a message, or quoted in the
    notice once it no longer does."""
    from django.db.models import F

    from durability.models import Message

    run = asking
    page = text_of(as_operator.get(url("run", run.id)))
    typed = 'a long answer <with> "markup"\nover two lines'
    data = {
        "send-name": "reply",
        "send-data": typed,
        "send-token": form_token(page, "send"),
        "send-version": form_version(page, "send"),
    }
    # A colleague's decision moved the run on meanwhile; it still waits for a message.
    Run.objects.filter(pk=run.pk).update(lease_token=F("lease_token") + 1)
    refused = as_operator.post(url("send", run.id), data, follow=True)
    html = text_of(refused)
    assert "Nothing was sent" in html and "moved on" in html
    assert "What you typed is back in the form" in html
    box = re.search(r'<textarea name="send-data"[^>]*>(.*?)</textarea>', html, re.S)
    assert box is not None and box.group(1) == escape(typed)
    assert not Message.objects.filter(run=run).exists()
    # Shown once: the next drawing of the page has an empty form.
    again = text_of(as_operator.get(url("run", run.id)))
    box = re.search(r'<textarea name="send-data"[^>]*>(.*?)</textarea>', again, re.S)
    assert box is not None and box.group(1) == ""
    # Someone else answered and the run finished: the text is quoted in the notice.
    operations.send(run, "reply", "from a colleague", by="colleague")
    assert drive(run.id).status == RunStatus.SUCCEEDED
    late = text_of(as_operator.post(url("send", run.id), data, follow=True))
    assert "Nothing was sent" in late and "no longer waits for a message" in late
    assert escape(typed) in late
    assert Message.objects.filter(run=run).count() == 1


def test_a_nul_character_in_a_parameter_is_a_400_that_changes_nothing(as_operator):
    run = waiting_run("NUL?")
    for target, params in [
        (reverse("dashboard:runs"), {"q": "a\x00b"}),
        (reverse("dashboard:runs"), {"agent": "\x00"}),
        (reverse("dashboard:audit"), {"actor": "\x00"}),
        (reverse("dashboard:slo"), {"agent": "x\x00"}),
    ]:
        response = as_operator.get(target, params)
        assert response.status_code == 400, target
        assert "holds a NUL character" in text_of(response), target
    before = counts()
    response = as_operator.post(url("cancel", run.id), {"cancel-reason": "stop\x00now"})
    assert response.status_code == 400 and "cancel-reason" in text_of(response)
    assert counts() == before and Run.objects.get(pk=run.id).status == RunStatus.WAITING


def test_a_json_form_nested_too_deeply_is_a_form_error(as_operator):
    run = finished_run()
    deep = "[" * 200_000 + "]" * 200_000
    before = counts()
    response = as_operator.post(
        url("fork", run.id), {"from_seq": 1, "state": deep, "action": "check", "token": ""}
    )
    assert response.status_code == 422 and "nested too deeply" in text_of(response)
    # Deep enough to break the engine's recursive walks, shallow enough for the parser.
    deep = "[" * 960 + "]" * 960
    response = as_operator.post(
        url("fork", run.id), {"from_seq": 1, "state": deep, "action": "check", "token": ""}
    )
    assert response.status_code == 422 and "more than 100 levels" in text_of(response)
    assert counts() == before


def test_a_stale_rollback_or_resume_does_not_revive_a_run_cancelled_meanwhile(as_operator):
    run = waiting_run("Revive?")
    # On hold after a rollback: the page offers to continue it (a run waiting for its
    # approval offers no resume: the decision wakes it).
    operations.rollback(run.id, 1, by="seed")
    run.refresh_from_db()
    run_page = text_of(as_operator.get(url("run", run.id)))
    assert 'name="resume-status" value="waiting"' in run_page
    confirm = text_of(as_operator.get(url("rollback", run.id), {"to": 1}))
    operations.cancel(run.id, by="ann", reason="runaway, stop it")
    rollback = as_operator.post(
        url("rollback", run.id),
        {
            "checkpoint_id": run.checkpoints.get(seq=1).id,
            "expected_head": run.head_seq,
            "expected_status": "waiting",
            "version": form_version(confirm),
            "reason": "go back",
            "token": form_token(confirm),
        },
    )
    assert "it is cancelled now, not waiting" in landed(as_operator, rollback, run)
    resume = as_operator.post(
        url("resume", run.id),
        {
            "resume-status": "waiting",
            "resume-version": form_version(run_page, "resume"),
            "resume-token": form_token(run_page, "resume"),
        },
    )
    assert "it is cancelled now" in landed(as_operator, resume, run)
    assert Run.objects.get(pk=run.id).status == RunStatus.CANCELLED
    assert Event.objects.filter(run=run, kind="rollback").count() == 1  # the one that held it
    assert not Event.objects.filter(run=run, kind="resumed").exists()
    # A deliberate resume of the cancelled run, from a page showing it cancelled, works.
    fresh = text_of(as_operator.get(url("run", run.id)))
    assert 'name="resume-status" value="cancelled"' in fresh
    again = as_operator.post(
        url("resume", run.id),
        {
            "resume-status": "cancelled",
            "resume-version": form_version(fresh, "resume"),
            "resume-token": form_token(fresh, "resume"),
        },
    )
    assert again.status_code == 302 and Run.objects.get(pk=run.id).status == RunStatus.QUEUED


def test_a_stale_resolve_form_does_not_settle_an_effect_performed_again(as_operator, faults):
    from django.db.models import F

    run, effect = in_doubt_run(faults)
    page = text_of(as_operator.get(url("resolve", run.id, effect.pk)))
    assert f'name="attempts" value="{effect.attempts}"' in page
    shown = form_version(page)
    retry = as_operator.post(
        url("resolve", run.id, effect.pk),
        {"outcome": "retry", "attempts": effect.attempts, "version": shown},
    )
    assert retry.status_code == 302
    # The worker performs it again (what ctx.effect writes before calling it).
    Effect.objects.filter(pk=effect.pk).update(
        attempts=F("attempts") + 1, status=EffectStatus.PENDING, resolved_by=""
    )
    stale = as_operator.post(
        url("resolve", run.id, effect.pk),
        {
            "outcome": "done",
            "result": '{"fake": true}',
            "attempts": effect.attempts,
            "version": shown,
        },
    )
    assert "performed again since this was shown" in landed(as_operator, stale, run)
    assert Effect.objects.get(pk=effect.pk).status == EffectStatus.PENDING
