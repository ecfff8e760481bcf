"""Who may do what on the dashboard, walked as a matrix: every role against every route of
the dashboard's URLconf (read from it, so a new route fails here until it is given a row),
with GET and POST each, POSTs made directly with a valid form rather than through buttons.

The rule, as docs/security.md states it: an anonymous caller is sent to sign in; a signed-in
account with neither role (a member of a policy group only, too) gets a 403 that says whom to
ask; viewers read every page; operators and superusers act; deciding an approval needs the
operator role, and an approval whose policy names a group is decided only by the operators in
that group (a viewer in the group may not), superusers always. Every refused call changes
nothing: the engine's rows and the dashboard's are compared before and after."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client
from django.urls import reverse

from dashboard import states, timeline
from dashboard.models import Submission
from dashboard.submissions import new_token
from dashboard.urls import urlpatterns
from durability import operations
from durability.models import Approval, Checkpoint, Effect, Message, Run
from tests.dashboard_helpers import PASSWORD, counts, dash_agents, text_of, waiting_run

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["dash_agents"]

GROUP = "finance"  # the policy group of the approvals under test

ROLES: dict[str, Any] = {
    "anonymous": None,
    "no role": [],
    "policy group only": [GROUP],
    "viewer": ["viewers"],
    "viewer in the policy group": ["viewers", GROUP],
    "operator outside the policy group": ["operators"],
    "operator in the policy group": ["operators", GROUP],
    "superuser": "superuser",
}
READERS = {
    "viewer",
    "viewer in the policy group",
    "operator outside the policy group",
    "operator in the policy group",
    "superuser",
}
ACTORS = {"operator outside the policy group", "operator in the policy group", "superuser"}


def may_decide(role: str, group: str) -> bool:
    return role in ACTORS and (not group or role != "operator outside the policy group")


@dataclass
class Scene:
    """A run waiting at its approval (policy group ``group``), with checkpoints #0-#2, a
    call and an effect done."""

    run: Run
    approval: Approval
    effect: Effect

    @property
    def ref(self) -> str:
        return str(self.run.id)


def scene(group: str = GROUP, *, cancelled: bool = False) -> Scene:
    run = waiting_run("Matrix?")
    assert run.status == "waiting", (run.status, run.error)
    approval = Approval.objects.get(run=run)
    Approval.objects.filter(pk=approval.pk).update(group=group)
    if cancelled:
        operations.cancel(run, by="seed", reason="to resume it")
    run.refresh_from_db()
    return Scene(run, Approval.objects.get(pk=approval.pk), Effect.objects.get(run=run))


def version(s: Scene) -> int:
    s.run.refresh_from_db()
    return s.run.lease_token


def fork_state(s: Scene) -> str:
    loaded = states.load(Checkpoint.objects.get(run=s.run, seq=1))
    return json.dumps(loaded.state)


def rollback_form(s: Scene) -> dict:
    s.run.refresh_from_db()
    return {
        "checkpoint_id": Checkpoint.objects.get(run=s.run, seq=1).id,
        "expected_head": s.run.head_seq,
        "expected_status": s.run.status,
        "reason": "matrix",
        "token": new_token(),
        "version": version(s),
    }


@dataclass
class Route:
    """How to reach one route: its URL for a scene, a GET query, and for a route that acts,
    the form a POST sends and what it needs (``act``: an operator's action on the run;
    ``decide``: a decision on the approval)."""

    url: Callable[[Scene], str]
    query: Callable[[Scene], dict] = lambda s: {}
    htmx: bool = False
    get: bool = True  # answers GET (the others answer 405)
    post: str = ""  # "" (answers 405), "act" or "decide"
    form: Callable[[Scene], dict] = lambda s: {}
    cancelled: bool = False  # the action needs a cancelled run (resume)
    engine_may_refuse: bool = False  # past the access check, the engine has its own say


def _earlier(s: Scene) -> dict:
    page = timeline.latest(s.run, limit=2)
    return {"before": timeline.encode_before(page.items[-1])}


ROUTES: dict[str, Route] = {
    "runs": Route(lambda s: reverse("dashboard:runs")),
    "run": Route(lambda s: reverse("dashboard:run", args=[s.ref])),
    "checkpoints": Route(lambda s: reverse("dashboard:checkpoints", args=[s.ref])),
    "checkpoint": Route(lambda s: reverse("dashboard:checkpoint", args=[s.ref, 1])),
    "tree": Route(
        lambda s: reverse("dashboard:tree", args=[s.ref, 1]),
        lambda s: {"path": "/messages"},
        htmx=True,
    ),
    "state_json": Route(lambda s: reverse("dashboard:state_json", args=[s.ref, 1])),
    "timeline": Route(lambda s: reverse("dashboard:timeline", args=[s.ref]), _earlier),
    "diff": Route(lambda s: reverse("dashboard:diff", args=[s.ref])),
    "diff_words": Route(
        lambda s: reverse("dashboard:diff_words", args=[s.ref]),
        lambda s: {"a": 0, "b": 1, "path": "/question"},
    ),
    "resume": Route(
        lambda s: reverse("dashboard:resume", args=[s.ref]),
        get=False,
        post="act",
        cancelled=True,
        form=lambda s: {
            "resume-reason": "matrix",
            "resume-token": new_token(),
            "resume-version": version(s),
        },
    ),
    "cancel": Route(
        lambda s: reverse("dashboard:cancel", args=[s.ref]),
        get=False,
        post="act",
        form=lambda s: {
            "cancel-reason": "matrix",
            "cancel-token": new_token(),
            "cancel-version": version(s),
        },
    ),
    "rollback": Route(
        lambda s: reverse("dashboard:rollback", args=[s.ref]),
        lambda s: {"to": 1},
        post="act",
        form=rollback_form,
    ),
    "fork": Route(
        lambda s: reverse("dashboard:fork", args=[s.ref]),
        lambda s: {"from": 1},
        post="act",
        form=lambda s: {
            "from_seq": 1,
            "state": fork_state(s),
            "reason": "matrix",
            "token": new_token(),
        },
    ),
    "send": Route(
        lambda s: reverse("dashboard:send", args=[s.ref]),
        get=False,
        post="act",
        form=lambda s: {
            "send-name": "note",
            "send-data": "hello",
            "send-token": new_token(),
            "send-version": version(s),
        },
    ),
    "resolve": Route(
        lambda s: reverse("dashboard:resolve", args=[s.ref, s.effect.pk]),
        post="act",
        # The effect is done, not in doubt: past the access check the engine refuses (409).
        engine_may_refuse=True,
        form=lambda s: {
            "outcome": "failed",
            "note": "matrix",
            "token": new_token(),
            "attempts": s.effect.attempts,
            "version": version(s),
        },
    ),
    "start": Route(
        lambda s: reverse("dashboard:start"),
        lambda s: {"agent": "dash-chain"},
        post="act",
        form=lambda s: {
            "agent": "dash-chain",
            "input": '{"question": "Matrix?"}',
            "reason": "matrix",
            "token": new_token(),
        },
    ),
    "approvals": Route(lambda s: reverse("dashboard:approvals")),
    "approval": Route(
        lambda s: reverse("dashboard:approval", args=[s.approval.pk]),
        post="decide",
        form=lambda s: {"f0": "240.5", "f1": "A-1", "f3": "asap", "comment": "edited"},
    ),
    "decide": Route(
        lambda s: reverse("dashboard:decide", args=[s.approval.pk]),
        get=False,
        post="decide",
        form=lambda s: {"decision": "approve", "comment": "ok"},
    ),
    "slo": Route(lambda s: reverse("dashboard:slo")),
    "audit": Route(lambda s: reverse("dashboard:audit")),
    "notifications": Route(lambda s: reverse("dashboard:notifications")),
}


def test_every_route_of_the_urlconf_is_in_the_matrix():
    names = {p.name for p in urlpatterns}
    assert names == set(ROUTES), (
        f"routes missing from the matrix: {sorted(names - set(ROUTES))};"
        f" rows for routes that are gone: {sorted(set(ROUTES) - names)}"
    )


def everything() -> dict:
    return counts() | {
        "messages": Message.objects.count(),
        "submissions": Submission.objects.count(),
        "approvals": sorted(
            Approval.objects.values_list("status", "decided_by", "edited_payload", "group")
        ),
    }


def client_for(role: str) -> Client:
    client = Client()
    spec = ROLES[role]
    if spec is None:
        return client
    users = get_user_model()
    name = role.replace(" ", "-")
    if spec == "superuser":
        user = users.objects.create_superuser(name, "", PASSWORD)
    else:
        user = users.objects.create_user(name, "", PASSWORD)
        for group in spec:
            user.groups.add(Group.objects.get_or_create(name=group)[0])
    client.force_login(user)
    return client


def assert_refused_for_role(role: str, response: Any, where: str) -> None:
    if role == "anonymous":
        # htmx: the whole page goes to the sign-in form (HX-Redirect), not a fragment.
        location = response.get("HX-Redirect") or response["Location"]
        assert response.status_code in (200 if "HX-Redirect" in response else 302,), where
        assert location.startswith(reverse("login")), where
    else:
        assert response.status_code == 403, where
        assert "Not allowed" in response.content.decode(), where


def expected_post(role: str, route: Route, group: str) -> str:
    """ "ok", "refused" (403 or the sign-in page) or "405" (a page that only reads)."""
    if role not in READERS:
        return "refused"
    if not route.post:
        return "405"
    if route.post == "act":
        return "ok" if role in ACTORS else "refused"
    return "ok" if may_decide(role, group) else "refused"


@pytest.mark.parametrize("role", list(ROLES))
def test_role_against_every_route(role):
    client = client_for(role)
    shared = scene()
    cancelled = scene(cancelled=True)
    # Reading: every page, as the rule says.
    for name, route in ROUTES.items():
        s = cancelled if route.cancelled else shared
        url = route.url(s)
        headers = {"HTTP_HX_REQUEST": "true"} if route.htmx else {}
        response = client.get(url, route.query(s), **headers)
        where = f"{role}: GET {name}"
        if role not in READERS:
            assert_refused_for_role(role, response, where)
            if role != "anonymous":
                assert "has no role" in response.content.decode(), where
        elif not route.get:
            assert response.status_code == 405, where
        else:
            assert response.status_code == 200, (where, response.status_code)
        if name == "approval" and role in READERS:
            # The button is offered only to those who may decide; the others see why not.
            offered = 'type="submit" class="primary">Approve with these values' in text_of(response)
            assert offered == may_decide(role, GROUP), where
    # Acting: a valid form, posted directly, on each route and for both kinds of approval.
    for name, route in ROUTES.items():
        for group in [GROUP, ""] if route.post == "decide" else [GROUP]:
            expected = expected_post(role, route, group)
            s = scene(group, cancelled=route.cancelled) if expected == "ok" else shared
            if route.cancelled and expected != "ok":
                s = cancelled
            where = f"{role}: POST {name} (approval group {group!r})"
            before = everything()
            response = client.post(route.url(s), route.form(s))
            if expected == "refused":
                assert_refused_for_role(role, response, where)
                assert everything() == before, where
            elif expected == "405":
                assert response.status_code == 405, where
                assert everything() == before, where
            elif route.engine_may_refuse:
                assert response.status_code not in (302, 403), (where, response.status_code)
            else:
                assert response.status_code == 302, (where, response.status_code)
                assert not response["Location"].startswith(reverse("login")), where
                assert everything() != before, where  # it did act
