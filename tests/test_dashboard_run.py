"""A run's page: header, timeline, checkpoints, the inspector's tabs, the state tree, the
JSON download, live polling, and untrusted content rendered inert."""

from __future__ import annotations

import json
import re

import pytest
from django.urls import reverse

from dashboard import timeline
from durability import operations
from durability.models import Event, Run
from durability.testing import drive
from tests.dashboard_helpers import (
    HOSTILE_KEY,
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


def run_url(run: Run) -> str:
    return reverse("dashboard:run", args=[run.id])


def cp_url(run: Run, seq: int, tab: str = "") -> str:
    url = reverse("dashboard:checkpoint", args=[run.id, seq])
    return f"{url}?tab={tab}" if tab else url


def test_run_page_shows_header_timeline_checkpoints_and_approval(as_operator):
    run = waiting_run("What is a fencing token?")
    html = text_of(as_operator.get(run_url(run)))
    assert "dash-chain" in html and run.short_id in html
    assert 'id="run-status">waiting<' in html
    assert "approval: ship" in html  # why it waits
    # The timeline: the LLM call with its model and tokens, the effect, the checkpoints.
    assert "call llm" in html and "fake-model" in html and "42 (12 in, 30 out)" in html
    assert "effect pay" in html and "checkpoint #2" in html and "approval requested" in html
    # The checkpoint list and the pending approval with its decision buttons.
    assert html.count('hx-target="#inspector"') >= 3
    assert 'value="approve"' in html and 'value="reject"' in html
    # The inspector opens on the head with its changes.
    assert "Checkpoint #2" in html and "/messages/2" in html


def test_a_run_is_found_by_an_id_prefix_and_lives_at_its_full_id(as_operator):
    run = waiting_run()
    response = as_operator.get(reverse("dashboard:run", args=[str(run.id)[:8]]))
    assert response.status_code == 302 and response["Location"] == run_url(run)


def test_unknown_run_and_checkpoint_are_404_with_a_clear_message(as_operator):
    run = waiting_run()
    missing = as_operator.get(
        reverse("dashboard:run", args=["00000000-0000-0000-0000-000000000000"])
    )
    assert missing.status_code == 404
    nonsense = as_operator.get(reverse("dashboard:run", args=["not-a-run"]))
    assert nonsense.status_code == 404
    beyond = as_operator.get(cp_url(run, 99))
    assert beyond.status_code == 404
    # Each says what was not found.
    assert "no run 00000000-0000-0000-0000-000000000000" in text_of(missing)
    assert "no checkpoint #99 (its checkpoints are #0 to #2)" in text_of(beyond)
    huge = as_operator.get(cp_url(run, 10**30))
    assert huge.status_code == 404 and "no checkpoint #" in text_of(huge)
    nowhere = as_operator.get(f"/runs/{run.id}/checkpoints/abc/")
    assert nowhere.status_code == 404 and "There is no page at" in text_of(nowhere)
    approval = as_operator.get(reverse("dashboard:approval", args=[10**25]))
    assert approval.status_code == 404 and "there is no approval" in text_of(approval)


def test_inspector_tabs(as_operator):
    run = waiting_run("Tabs?")
    state = text_of(as_operator.get(cp_url(run, 1, "state")))
    assert ">messages<" in state and "[…] 2 items" in state and ">count<" in state
    # Secret values are shown redacted, never in clear.
    assert "sk-very-secret" not in state and "[redacted]" in state

    changes = text_of(as_operator.get(cp_url(run, 1, "changes")))
    assert "+1 added" in changes and "~1 changed" in changes
    assert "An answer to: Tabs?" in changes and 'class="bubble role-assistant"' in changes

    mutations = text_of(as_operator.get(cp_url(run, 2, "mutations")))
    assert "/messages/2" in mutations and "/count" in mutations and "replace" in mutations

    calls = text_of(as_operator.get(cp_url(run, 1, "calls")))
    assert "Made by the step that produced #1" in calls and ">llm<" in calls
    calls2 = text_of(as_operator.get(cp_url(run, 2, "calls")))
    assert ">pay<" in calls2 and "idempotency key" in calls2

    first = text_of(as_operator.get(cp_url(run, 0, "changes")))
    assert "first checkpoint" in first


def test_htmx_asks_for_the_inspector_alone(as_operator):
    run = waiting_run()
    response = as_operator.get(
        cp_url(run, 1, "state"), HTTP_HX_REQUEST="true", HTTP_HX_TARGET="inspector"
    )
    html = text_of(response)
    assert html.lstrip().startswith('<section id="inspector"')
    assert "<html" not in html and "Timeline" not in html


def test_state_tree_loads_children_on_demand(as_operator):
    run = waiting_run("Deep?", extra={"nested": {"a/b": {"c~d": [1, 2, 3]}}})
    tree = reverse("dashboard:tree", args=[run.id, 1])
    response = as_operator.get(tree, {"path": "/nested"}, HTTP_HX_REQUEST="true")
    html = text_of(response)
    assert ">a/b<" in html and "path=/nested/a~1b" in html
    leaf = as_operator.get(tree, {"path": "/nested/a~1b/c~0d"}, HTTP_HX_REQUEST="true")
    assert re.findall(r'class="k">(\d)<', text_of(leaf)) == ["0", "1", "2"]
    secret = as_operator.get(tree, {"path": "/api_key"}, HTTP_HX_REQUEST="true")
    assert "sk-very-secret" not in text_of(secret)
    gone = as_operator.get(tree, {"path": "/nope"}, HTTP_HX_REQUEST="true")
    assert gone.status_code == 404


def test_long_lists_are_paged_in_the_tree(as_operator):
    run = waiting_run("Many?", extra={"items": list(range(250))})
    tree = reverse("dashboard:tree", args=[run.id, 0])
    first = text_of(as_operator.get(tree, {"path": "/items"}, HTTP_HX_REQUEST="true"))
    assert first.count('class="node"') == 100 and "100 of 250 shown" in first
    rest = as_operator.get(tree, {"path": "/items", "offset": 200}, HTTP_HX_REQUEST="true")
    assert text_of(rest).count('class="node"') == 50


def test_state_download_is_json_with_secrets_redacted(as_operator):
    run = waiting_run("Download?")
    response = as_operator.get(reverse("dashboard:state_json", args=[run.id, 2]))
    assert response["Content-Type"] == "application/json"
    assert "attachment" in response["Content-Disposition"]
    state = json.loads(response.content)
    assert state["question"] == "Download?" and state["api_key"] == "[redacted]"
    assert state["count"] == 2


def test_live_poll_sends_nothing_until_something_changes_then_appends(as_operator):
    run = waiting_run("Live?")
    page = as_operator.get(run_url(run))
    context = page.context
    params = {
        "live": context["header_token"],
        "acts": context["actions_token"],
        "head": run.head_seq,
        "cursor": context["cursor"],
    }
    quiet = as_operator.get(run_url(run), params, HTTP_HX_REQUEST="true")
    assert quiet.status_code == 204
    # An operator approves: the header changes, the actions change, new items arrive.
    operations.decide(run.id, "ship", approve=True, by="olive", comment="fine")
    drive(run.id)
    live = as_operator.get(run_url(run), params, HTTP_HX_REQUEST="true")
    html = text_of(live)
    assert live.status_code == 200 and "<html" not in html
    assert 'id="run-header" class="runhead" hx-swap-oob="true"' in html
    assert 'hx-swap-oob="beforeend:#timeline-items"' in html
    assert 'hx-swap-oob="afterbegin:#checkpoint-rows"' in html and "#3" in html
    assert "ship approved" in html and "succeeded" in html
    # Only what is new is appended: the approval request is already on the page.
    appended = html.split('hx-swap-oob="beforeend:#timeline-items"')[1]
    assert "approval requested" not in appended
    # The next poll continues from the new cursor: nothing new, nothing sent.
    again = as_operator.get(
        run_url(run),
        {
            "live": live.context["header_token"],
            "acts": live.context["actions_token"],
            "head": 3,
            "cursor": live.context["cursor"],
        },
        HTTP_HX_REQUEST="true",
    )
    assert again.status_code == 204


def test_poll_cursor_never_skips_rows():
    cursor = timeline.Cursor(5, 7, 2, "2026-01-01T00:00:00+00:00", 3)
    assert timeline.Cursor.decode(cursor.encode()) == cursor
    assert timeline.Cursor.decode("garbage") is None
    # The right shape, a date that does not exist.
    assert timeline.Cursor.decode("0.0.0.0.2020-13-45T00:00:00") is None
    assert timeline.decode_before("2020-13-45T00:00:00|0|0") is None


def test_cursors_with_dates_that_do_not_exist_are_refused_with_a_sentence(as_operator):
    run = waiting_run("Odd dates?")
    for before in ("2020-13-45T00:00:00|0|0", "9999-12-31T23:59:59-05:00|0|0", "x"):
        earlier = as_operator.get(reverse("dashboard:timeline", args=[run.id]), {"before": before})
        assert earlier.status_code == 400 and "before" in text_of(earlier), before
    for cursor in ("0.0.0.0.2020-13-45T00:00:00", "0.0.0.0.9999-12-31T23:59:59-05:00"):
        poll = as_operator.get(
            run_url(run),
            {"live": "x", "acts": "y", "head": 0, "cursor": cursor},
            HTTP_HX_REQUEST="true",
        )
        assert poll.status_code == 400 and "reload" in text_of(poll), cursor


def test_timeline_pages_back_in_time(as_operator):
    run = waiting_run("Long?")
    for i in range(160):
        Event.objects.create(run=run, kind="claimed", worker=f"w-{i}")
    page = as_operator.get(run_url(run))
    items = page.context["timeline"]
    assert len(items.items) == timeline.PAGE and items.earlier
    assert "Show earlier" in text_of(page)
    earlier = as_operator.get(
        reverse("dashboard:timeline", args=[run.id]),
        {"before": items.earlier},
        HTTP_HX_REQUEST="true",
    )
    html = text_of(earlier)
    assert "w-0" in html and ">created<" in html and "w-159" not in html


def test_hostile_state_is_escaped_everywhere(as_operator):
    extra = {HOSTILE_KEY: HOSTILE_VALUES, "<script>alert(1)</script>": {"x": HOSTILE_VALUES[0]}}
    run = waiting_run(HOSTILE_VALUES[0], extra=extra)
    urls = [
        run_url(run),
        cp_url(run, 0, "state"),
        cp_url(run, 1, "changes"),
        cp_url(run, 1, "mutations"),
        reverse("dashboard:diff", args=[run.id]) + "?a=0&b=2",
        reverse("dashboard:runs"),
        reverse("dashboard:approvals"),
    ]
    for url in urls:
        html = text_of(as_operator.get(url))
        assert "<script>window" not in html and "<script>alert" not in html, url
        assert "<img src=x onerror" not in html, url
        assert "javascript:window" not in html or 'href="javascript:' not in html, url
    for url in urls[1:5]:
        assert "&lt;script&gt;" in text_of(as_operator.get(url)), url
    tree = text_of(
        as_operator.get(
            reverse("dashboard:tree", args=[run.id, 0]),
            {"path": "/" + HOSTILE_KEY},
            HTTP_HX_REQUEST="true",
        )
    )
    assert "&lt;img src=x onerror=&quot;window.__pwned=1&quot;&gt;" in tree
    assert 'href="javascript:' not in tree


def test_viewer_reads_everything(as_viewer):
    run = waiting_run()
    for url in (run_url(run), cp_url(run, 1, "state"), cp_url(run, 2, "calls")):
        assert as_viewer.get(url).status_code == 200


def test_parents_children_and_their_events_are_linked(as_operator, settings):
    settings.DURABILITY_TRACE_URL = "http://jaeger.local/trace/{trace_id}"
    parent = waiting_run("Parent?")
    child = Run.objects.create(
        agent="dash-chain", agent_version="2", input="{}", parent_run=parent, spawn_key="helper"
    )
    Event.objects.create(
        run=parent,
        kind="spawned",
        data=json.dumps({"child": str(child.id), "agent": "dash-chain", "key": "helper"}),
    )
    Run.objects.filter(pk=parent.pk).update(
        trace_parent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    )
    html = text_of(as_operator.get(run_url(parent)))
    assert "children" in html and child.short_id in html
    assert "spawned a dash-chain child" in html
    assert 'href="http://jaeger.local/trace/4bf92f3577b34da6a3ce929d0e0e4736"' in html
    child_html = text_of(as_operator.get(run_url(child)))
    assert "child of" in child_html and parent.short_id in child_html and "(helper)" in child_html


def test_a_tampered_checkpoint_is_named_never_shown(as_operator):
    run = waiting_run("Tamper?")
    # Someone with database access rewrites what checkpoint #2 says it holds.
    type(run.checkpoints.get(seq=2)).objects.filter(run=run, seq=2).update(state_hash="0" * 64)
    for tab in ("changes", "state"):
        html = text_of(as_operator.get(cp_url(run, 2, tab)))
        assert "checkpoint #2 does not verify" in html, tab
        assert 'class="tree"' not in html and "+1 added" not in html, tab
    diff = text_of(as_operator.get(reverse("dashboard:diff", args=[run.id]), {"a": 1, "b": 2}))
    assert "does not verify" in diff and "diffsum" not in diff
    # The checkpoint before it still reads fine.
    assert "does not verify" not in text_of(as_operator.get(cp_url(run, 1, "state")))


def test_the_trace_id_is_shown_with_or_without_a_viewer_link(as_operator, settings):
    """The run's trace id, to paste into any tracing backend; with a viewer configured, a
    link from the run and from each checkpoint (its step's spans are in that trace)."""
    run = waiting_run()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    settings.DURABILITY_TRACE_URL = ""
    html = text_of(as_operator.get(run_url(run)))
    assert trace_id not in html  # not traced: nothing to show
    Run.objects.filter(pk=run.pk).update(trace_parent=f"00-{trace_id}-00f067aa0ba902b7-01")
    html = text_of(as_operator.get(run_url(run)))
    assert trace_id in html and "open the trace" not in html
    inspector = text_of(as_operator.get(cp_url(run, 1, "state")))
    assert trace_id[:16] in inspector and "open the step's trace" not in inspector
    settings.DURABILITY_TRACE_URL = "https://tempo.example/explore?traceId={trace_id}"
    link = f'href="https://tempo.example/explore?traceId={trace_id}"'
    assert link in text_of(as_operator.get(run_url(run)))
    inspector = as_operator.get(
        cp_url(run, 1, "state"), HTTP_HX_REQUEST="true", HTTP_HX_TARGET="inspector"
    )
    assert link in text_of(inspector) and "open the step's trace" in text_of(inspector)
    # A traceparent that is not one shows nothing rather than a broken link.
    Run.objects.filter(pk=run.pk).update(trace_parent="garbage")
    assert "tempo.example" not in text_of(as_operator.get(run_url(run)))


# --- one page, one truth -----------------------------------------------------------------------


def _poll(client, run: Run, page, **extra) -> str:
    params = {
        "live": page.context["header_token"],
        "acts": page.context["actions_token"],
        "head": run.head_seq,
        "cursor": page.context["cursor"],
        **extra,
    }
    response = client.get(run_url(run), params, HTTP_HX_REQUEST="true")
    assert response.status_code == 200
    return text_of(response)


def test_a_poll_after_the_head_moved_sends_every_region_on_the_new_head(as_operator):
    run = waiting_run("One truth?")
    assert run.head_seq == 2
    page = as_operator.get(run_url(run))
    html = text_of(page)
    assert 'name="follow" value="1"' in html and 'name="inspect" value="2"' in html
    operations.decide(run.id, "ship", approve=True, by="olive")
    drive(run.id)
    following = _poll(as_operator, run, page, inspect=2, follow=1, tab="state")
    # The new checkpoint rows travel in a <template>: a bare <tbody> after other elements is
    # dropped by the HTML parser, which left the table on the old head.
    rows = following.split('<template><tbody hx-swap-oob="afterbegin:#checkpoint-rows">')[1]
    assert ">#3</a>" in rows.split("</template>")[0]
    assert '<a id="run-head"' in following and ">#3</a>" in following.split('id="run-head"')[1]
    # The inspector that followed the head moves to it, in the tab it had, marked head.
    inspector = following.split('<section id="inspector"')[1].split("</section>")[0]
    assert 'hx-swap-oob="true"' in inspector and "Checkpoint #3" in inspector
    assert '<span class="tag head"' in inspector and 'value="state"' in inspector
    assert 'id="run-actions"' in following  # the actions follow the head too
    assert 'id="nav-approvals"' in following and 'hx-swap-oob="true"' in following
    # An inspector on a checkpoint the reader picked keeps it: only its head mark changes.
    pinned = _poll(as_operator, run, page, inspect=2, follow=0)
    assert '<section id="inspector"' not in pinned
    mark = pinned.split('<span id="inspector-head" hx-swap-oob="true">')[1].split("</span>")[0]
    assert "head is #3" in mark
    # Drawn again from the new state, the page asks nothing more.
    fresh = as_operator.get(run_url(run))
    again = as_operator.get(
        run_url(run),
        {
            "live": fresh.context["header_token"],
            "acts": fresh.context["actions_token"],
            "head": 3,
            "cursor": fresh.context["cursor"],
            "inspect": 3,
            "follow": 1,
        },
        HTTP_HX_REQUEST="true",
    )
    assert again.status_code == 204


def _actions(client, run: Run) -> str:
    html = text_of(client.get(run_url(run)))
    return html.split('id="run-actions"')[1].split("</section>")[0]


def test_resume_is_offered_only_where_it_does_something(as_operator):
    run = waiting_run("Which actions?")
    resume = reverse("dashboard:resume", args=[run.id])
    assert resume not in _actions(as_operator, run)  # waiting for an approval
    for reason, detail in (("message", "user"), ("timer", ""), ("children", "")):
        Run.objects.filter(pk=run.pk).update(wait_reason=reason, wait_detail=detail)
        assert resume not in _actions(as_operator, run), reason
    Run.objects.filter(pk=run.pk).update(wait_reason="hold", wait_detail="")
    held = _actions(as_operator, run)
    assert resume in held and ">Continue</button>" in held and ">Resume</button>" not in held
    Run.objects.filter(pk=run.pk).update(status="failed", wait_reason="")
    failed = _actions(as_operator, run)
    assert resume in failed and ">Resume</button>" in failed
    assert 'data-keep="cancel"' not in failed  # a finished run cannot be cancelled


def test_resuming_a_cancelled_run_and_cancelling_ask_for_confirmation(as_operator):
    run = waiting_run("Confirm?")
    waiting = _actions(as_operator, run)
    cancel = waiting.split('<details class="confirm" data-keep="cancel">')[1].split("</details>")[0]
    assert "Cancelling stops this run at checkpoint #2" in cancel
    assert "Nothing runs again unless an operator resumes it" in cancel
    assert "Its 1 pending approval (ship) is superseded" in cancel
    assert ">Cancel the run</button>" in cancel and 'name="cancel-reason"' in cancel
    operations.cancel(run.id, by="seed", reason="setup")
    cancelled = _actions(as_operator, run)
    resume = cancelled.split('<details class="confirm" data-keep="resume">')[1]
    assert "This run was cancelled. Resuming it queues it again from checkpoint #2" in resume
    assert "step <strong>confirm</strong> runs again" in resume
    assert ">Resume the cancelled run</button>" in resume


def test_a_repeated_or_outdated_submit_lands_on_the_run_page_with_a_notice(as_operator):
    run = waiting_run("Twice?")
    operations.cancel(run.id, by="seed", reason="setup")
    html = text_of(as_operator.get(run_url(run)))
    token = re.search(r'name="resume-token" value="([^"]+)"', html).group(1)
    shown = re.search(r'name="resume-version" value="([^"]+)"', html).group(1)
    form = {"resume-token": token, "resume-version": shown, "resume-status": "cancelled"}
    resume = reverse("dashboard:resume", args=[run.id])
    assert as_operator.post(resume, form).status_code == 302
    again = as_operator.post(resume, form, follow=True)
    assert again.status_code == 200 and again.redirect_chain == [(run_url(run), 302)]
    notice = text_of(again).split('id="messages"')[1].split("</ul>")[0]
    assert "already submitted by olive" in notice and "done once" in notice
    assert Event.objects.filter(run=run, kind="resumed").count() == 1
    # A copy of the form without its token, made on a version the run has left.
    stale = as_operator.post(resume, {**form, "resume-token": ""}, follow=True)
    assert stale.status_code == 200 and stale.redirect_chain == [(run_url(run), 302)]
    notice = text_of(stale).split('id="messages"')[1].split("</ul>")[0]
    assert "Nothing was done" in notice and "DUR112" in notice
    assert Event.objects.filter(run=run, kind="resumed").count() == 1


# --- pages to share and read -------------------------------------------------------------------


def test_compare_puts_the_pair_in_the_address(as_operator):
    run = waiting_run("Share the diff?")
    diff = reverse("dashboard:diff", args=[run.id])
    response = as_operator.get(diff, {"a": "0", "b": "2"}, HTTP_HX_REQUEST="true")
    pushed = response["HX-Push-Url"]
    assert pushed == f"{diff}?a_run={run.id}&a=0&b_run={run.id}&b=2&view=unified"
    # Defaults are named too: the address opens the same pair for whoever gets it.
    defaulted = as_operator.get(diff, {"view": "split"}, HTTP_HX_REQUEST="true")
    assert defaulted["HX-Push-Url"].endswith(f"&a=1&b_run={run.id}&b=2&view=split")


def test_the_runs_list_previews_each_input_short_escaped_and_redacted(as_operator):
    waiting_run("<b>Why</b> add jitter to backoff " * 10, extra={"api_token": "sk-live-123"})
    html = text_of(as_operator.get(reverse("dashboard:runs")))
    preview = html.split('<div class="preview"')[1].split("</div>")[0]
    assert "question: &lt;b&gt;Why&lt;/b&gt; add jitter" in preview
    assert "<b>" not in preview and "sk-live-123" not in html
    assert len(preview.split(">", 1)[1]) < 200


def test_the_approvals_badge_follows_a_decision_without_a_reload(as_operator):
    run = waiting_run("Badge?")
    approval = run.approvals.get()
    page = text_of(as_operator.get(run_url(run)))
    assert re.search(r'<span class="count" id="nav-approvals"[^>]*>1</span>', page)
    decided = as_operator.post(
        reverse("dashboard:decide", args=[approval.pk]),
        {"decision": "approve", "comment": "ok"},
        HTTP_HX_REQUEST="true",
        HTTP_HX_TARGET=f"approval-{approval.pk}",
    )
    html = text_of(decided)
    badge = re.search(r'<span class="count" id="nav-approvals"([^>]*)>(\d+)</span>', html)
    assert badge and badge.group(2) == "0"
    assert "hidden" in badge.group(1) and 'hx-swap-oob="true"' in badge.group(1)
