"""The API's other operator actions and reads against a live server: rollback (its dry-run
preview changes nothing), fork with an edited state (validated), legal hold, resolving an
effect in doubt, the timeline in pages, and the SLO figures; each refused to a viewer."""

from __future__ import annotations

import pytest

from durability.models import Checkpoint, Effect, Event, Run
from tests.api_helpers import api_for, problem, user_with
from tests.dashboard_helpers import counts, dash_agents, waiting_run

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["dash_agents"]


@pytest.fixture
def ops(live_server):
    return api_for(live_server, user_with("operator in the policy group", "omar"), "ops")


@pytest.fixture
def viewer(live_server):
    return api_for(live_server, user_with("viewer", "vic"), "view")


@pytest.mark.smoke
def test_rollback_preview_changes_nothing_and_the_rollback_holds_the_run(ops, viewer):
    run = waiting_run("Roll?")
    before = counts()
    preview = ops.post(f"/runs/{run.id}/rollback", {"checkpoint": 1, "dry_run": True})
    assert preview.status_code == 200, preview.text
    plan = preview.json()
    assert plan["dry_run"] and plan["target"] == 1 and plan["sentences"]
    assert [e["key"] for e in plan["effects"]] == ["pay"]
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
    problem(viewer.post(f"/runs/{run.id}/hold", {"hold": True}), 403, "DUR111")
    assert ops.post(f"/runs/{run.id}/hold", {"hold": True, "reason": "audit"}).status_code == 200
    assert Run.objects.get(pk=run.id).legal_hold
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


def test_timeline_pages_and_slo_figures(viewer):
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
    report = viewer.get("/slo", params={"window": "24h"}).json()
    keys = {i["key"] for i in report["indicators"]}
    assert "commit_success" in keys and "run_success" in keys
    per_agent = viewer.get("/slo/agents", params={"window": "1h"}).json()
    assert "dash-chain" in per_agent["agents"]
    problem(viewer.get("/slo", params={"window": "1y"}), 422, "API422")
    assert Checkpoint.objects.filter(run=run).count() == 3
