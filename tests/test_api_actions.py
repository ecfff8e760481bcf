"""The API's other operator actions and reads against a live server: rollback (its dry-run
preview changes nothing), fork with an edited state (validated), legal hold, resolving an
effect in doubt, each refused to a viewer; the timeline in pages, and the SLO figures, the
same as the SLO page's per window and per agent."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from durability import operations, slo
from durability.models import Approval, Checkpoint, Effect, Event, Run
from durability.testing import drive
from tests.api_helpers import api_for, problem, user_with, verdict_agent
from tests.dashboard_helpers import counts, dash_agents, finished_run, waiting_run

# The smoke subset too: the API makes the same promises on the embedded default (SQLite).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]
__all__ = ["dash_agents", "verdict_agent"]


@pytest.fixture
def ops(live_server):
    return api_for(live_server, user_with("operator in the policy group", "omar"), "ops")


@pytest.fixture
def viewer(live_server):
    return api_for(live_server, user_with("viewer", "vic"), "view")


def test_rollback_preview_changes_nothing_and_the_rollback_holds_the_run(ops, viewer):
    run = waiting_run("Roll?")
    before = counts()
    preview = ops.post(f"/runs/{run.id}/rollback", {"checkpoint": 1, "dry_run": True})
    assert preview.status_code == 200, preview.text
    plan = preview.json()
    assert plan["dry_run"] and plan["target"] == 1 and plan["sentences"]
    assert [e["key"] for e in plan["effects"]] == ["pay"]
    assert any("is put on hold" in line for line in plan["sentences"]), plan["sentences"]
    assert plan["held"], plan  # what the rollback it previews would do
    # The preview checks the decisions as the rollback does, and says what and_continue does.
    effect = plan["effects"][0]["id"]
    for bad, said in (
        ({str(effect): "explode"}, "must be one of ask, reuse, again, compensate"),
        ({"99": "compensate"}, "effect 99 was not done on the branch this rollback abandons"),
    ):
        refused = ops.post(
            f"/runs/{run.id}/rollback", {"checkpoint": 1, "dry_run": True, "decisions": bad}
        )
        assert said in problem(refused, 422, "DUR100")["detail"]
    going = ops.post(
        f"/runs/{run.id}/rollback", {"checkpoint": 1, "dry_run": True, "and_continue": True}
    ).json()
    assert any("continues at once" in line for line in going["sentences"]), going
    assert not any("put on hold" in line for line in going["sentences"]), going
    assert not going["held"]
    assert counts() == before
    problem(viewer.post(f"/runs/{run.id}/rollback", {"checkpoint": 1}), 403, "DUR111")
    stale = ops.post(f"/runs/{run.id}/rollback", {"checkpoint": 1}, headers={"If-Match": '"999"'})
    problem(stale, 409, "DUR112")
    problem(ops.post(f"/runs/{run.id}/rollback", {"checkpoint": 77}), 404, "DUR106")
    assert counts() == before
    version = ops.get(f"/runs/{run.id}").headers["ETag"]
    done = ops.post(
        f"/runs/{run.id}/rollback",
        {"checkpoint": 1, "reason": "wrong payment", "decisions": {}},
        headers={"If-Match": version},
    )
    assert done.status_code == 200, done.text
    body = done.json()
    assert body["held"] and body["new_head"] == 3 and body["run"]["waiting_for"] == "hold"
    event = Event.objects.get(run=run, kind="rollback")
    assert event.actor == "omar" and "api token 'ops'" in event.data


def test_fork_with_an_edited_state_is_validated(ops):
    run = waiting_run("Fork?")
    state = ops.get(f"/runs/{run.id}/checkpoints/1/state").json()
    before = counts()
    bad = ops.post(f"/runs/{run.id}/fork", {"checkpoint": 1, "state": {**state, "count": -1}})
    problem(bad, 422, "DUR102")
    assert counts() == before
    forked = ops.post(
        f"/runs/{run.id}/fork", {"checkpoint": 1, "state": {**state, "count": 5}, "reason": "try"}
    )
    assert forked.status_code == 201, forked.text
    child = forked.json()
    assert child["forked_from"] == str(run.id) and child["forked_from_seq"] == 1
    diff = ops.get(
        f"/runs/{run.id}/diff", params={"from": 1, "to": 0, "to_run": child["id"]}
    ).json()
    assert {"op": "replace", "path": "/count", "value": 5} in diff["changes"]


def test_hold_and_release(ops, viewer):
    run = waiting_run("Hold?")
    before = counts()
    problem(viewer.post(f"/runs/{run.id}/hold", {"hold": True}), 403, "DUR111")
    assert counts() == before
    assert ops.post(f"/runs/{run.id}/hold", {"hold": True, "reason": "audit"}).status_code == 200
    assert Run.objects.get(pk=run.id).legal_hold
    # A hold changes a run in place: the snapshot of refused calls must see it.
    assert counts()["runs"] != before["runs"]
    assert ops.post(f"/runs/{run.id}/hold", {"hold": False}).status_code == 200
    assert not Run.objects.get(pk=run.id).legal_hold


def test_resolve_an_effect_in_doubt(ops, viewer):
    run = waiting_run("Doubt?")
    effect = Effect.objects.get(run=run)
    Effect.objects.filter(pk=effect.pk).update(status="in_doubt")
    path = f"/runs/{run.id}/effects/{effect.id}/resolution"
    before = counts()
    problem(viewer.post(path, {"outcome": "done"}), 403, "DUR111")
    listed = ops.get(f"/runs/{run.id}/effects").json()["items"]
    assert [(e["id"], e["status"], e["key"]) for e in listed] == [(effect.id, "in_doubt", "pay")]
    problem(ops.post(path, {"outcome": "maybe"}), 422, "API422")
    problem(ops.post(f"/runs/{run.id}/effects/999999/resolution", {"outcome": "done"}), 404)
    assert counts() == before
    resolved = ops.post(path, {"outcome": "done", "result": {"sent": "money"}, "note": "bank ok"})
    assert resolved.status_code == 200, resolved.text
    assert resolved.json()["status"] == "done" and resolved.json()["resolved_by"] == "omar"


def test_timeline_pages_and_calls(viewer):
    run = waiting_run("Timeline?")
    first = viewer.get(f"/runs/{run.id}/timeline", params={"limit": 3}).json()
    assert len(first["items"]) == 3 and first["next_cursor"]
    rest = viewer.get(
        f"/runs/{run.id}/timeline", params={"limit": 500, "cursor": first["next_cursor"]}
    ).json()
    ids = [e["id"] for e in first["items"] + rest["items"]]
    assert ids == sorted(Event.objects.filter(run=run).values_list("id", flat=True), reverse=True)
    made = viewer.get(f"/runs/{run.id}/calls").json()["items"]
    assert [c["key"] for c in made] == ["llm"] and made[0]["result"]["model"] == "fake-model"
    assert Checkpoint.objects.filter(run=run).count() == 3


FIGURES = ("key", "label", "unit", "value", "target", "met", "total", "bad", "budget")


def _figures(indicators: list[dict]) -> dict[str, dict]:
    """The API's indicators by key."""
    return {i["key"]: {f: i[f] for f in FIGURES} for i in indicators}


def _engine(indicators) -> dict[str, dict]:
    """The engine's indicators (``durability.slo``), by key, with the fields the API shows."""
    return {i.key: {f: getattr(i, f) for f in FIGURES} for i in indicators}


def test_slo_figures_are_the_slo_pages_per_window_and_per_agent(viewer, verdict_agent):
    # Activity spread over the windows, so that each window counts something else: a run
    # that succeeded 3 h ago (its approval decided after 20 min), one that succeeded 2 days
    # ago (another agent), one that failed now, and one waiting now with its effect in doubt.
    earlier = timezone.now() - timedelta(hours=3)
    days_ago = timezone.now() - timedelta(days=2)
    done = finished_run("SLO, 3 h ago?")
    _move(done, earlier)
    Approval.objects.filter(run=done).update(
        requested_at=earlier - timedelta(minutes=20), decided_at=earlier
    )
    fine = drive(operations.start(verdict_agent, {"verdict": "fine"}).id)
    _move(fine, days_ago)
    failed = drive(operations.start(verdict_agent, {"fail": True}).id)
    waiting = waiting_run("SLO, now?")
    Effect.objects.filter(run=waiting).update(status="in_doubt")
    assert (done.status, fine.status, failed.status) == ("succeeded", "succeeded", "failed")

    # (total, bad) of run success: a figure each window must count differently.
    runs_by_window = {"1h": (1, 1), "24h": (2, 1), "7d": (3, 1)}
    overall: dict[str, dict] = {}
    for window, (total, bad) in runs_by_window.items():
        for agent in (None, "dash-chain", verdict_agent):
            params = {"window": window} | ({"agent": agent} if agent else {})
            reply = viewer.get("/slo", params=params)
            assert reply.status_code == 200, reply.text
            got = reply.json()
            assert (got["window"], got["agent"]) == (window, agent)
            # The engine's report up to the very moment the API measured to: the same figures.
            end = datetime.fromisoformat(got["end"])
            expected = slo.report(window, agent=agent, now=end, buckets=0, recoveries=0)
            assert datetime.fromisoformat(got["start"]) == expected.start
            assert _figures(got["indicators"]) == _engine(expected.indicators), params
            if agent is None:
                overall[window] = _figures(got["indicators"])
        run_success = overall[window]["run_success"]
        assert (run_success["total"], run_success["bad"]) == (total, bad), window
        assert overall[window]["effects_in_doubt"]["value"] == 1.0
        assert overall[window]["commit_success"]["total"] > 0

        per_agent = viewer.get("/slo/agents", params={"window": window})
        assert per_agent.status_code == 200, per_agent.text
        assert per_agent.json()["window"] == window
        rows = {r.agent: _engine(r.indicators.values()) for r in slo.per_agent(window)}
        agents = per_agent.json()["agents"]
        assert set(agents) == set(rows) == {"dash-chain", verdict_agent}, window
        assert {a: _figures(i) for a, i in agents.items()} == rows, window

    wait = overall["24h"]["approval_wait"]
    assert (wait["value"], wait["total"]) == (20.0, 1)
    assert overall["1h"]["approval_wait"]["total"] == 0
    problem(viewer.get("/slo", params={"window": "1y"}), 422, "API422")


def _move(run: Run, when: datetime) -> None:
    """Date a run and all it recorded back to ``when``."""
    Run.objects.filter(pk=run.pk).update(
        created_at=when, started_at=when, finished_at=when, updated_at=when
    )
    Event.objects.filter(run=run).update(created_at=when)
    Effect.objects.filter(run=run).update(created_at=when)
    Approval.objects.filter(run=run).update(requested_at=when, decided_at=when)
