"""What the API tests share: named users with each role, their tokens, and a small client
that talks to a live server over real HTTP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import requests
from django.contrib.auth import get_user_model

from api import tokens
from durability import END, Agent, registry
from tests.dashboard_helpers import make_user

GROUP = "finance"  # the policy group of approvals under test

# role -> the groups of its account ("superuser": a superuser; None: an inactive account)
ROLES: dict[str, Any] = {
    "no role": [],
    "policy group only": [GROUP],
    "viewer": ["viewers"],
    "operator outside the policy group": ["operators"],
    "operator in the policy group": ["operators", GROUP],
    "superuser": "superuser",
}
READERS = {
    "viewer",
    "operator outside the policy group",
    "operator in the policy group",
    "superuser",
}
ACTORS = {"operator outside the policy group", "operator in the policy group", "superuser"}


@pytest.fixture
def verdict_agent():
    """A second agent, besides dash-chain, that ends at once: with the outcome its input
    names, or failed when its input asks for it. Filters by agent and outcome, and figures
    per agent, need runs they must leave out."""
    agent = Agent("api-verdict", version="1")

    @agent.step(start=True)
    def judge(state: dict, ctx: Any) -> Any:
        if state.get("fail"):
            raise ValueError("the verdict service answered nonsense")
        return END(state["verdict"])

    yield agent.name
    registry.unregister(agent.name)


def user_with(role: str, username: str) -> Any:
    groups = ROLES[role]
    if groups == "superuser":
        return get_user_model().objects.create_superuser(username, f"{username}@example.com", "x")
    user = make_user(username, None)
    for group in groups:
        from django.contrib.auth.models import Group

        user.groups.add(Group.objects.get_or_create(name=group)[0])
    return user


@dataclass
class Api:
    """A caller of the live API with one token."""

    base: str
    secret: str = ""

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        headers = dict(kwargs.pop("headers", {}) or {})
        if self.secret:
            headers.setdefault("Authorization", f"Bearer {self.secret}")
        # A connection per request: a server thread left waiting on a kept-alive
        # connection would hold a database session open past the test.
        return requests.request(
            method, f"{self.base}/api/v1{path}", headers=headers, timeout=30, **kwargs
        )

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, json: Any = None, **kwargs: Any) -> requests.Response:
        return self.request("POST", path, json=json, **kwargs)


def api_for(live_server: Any, user: Any, name: str = "tests", **extra: Any) -> Api:
    _, secret = tokens.create(user, name, **extra)
    return Api(live_server.url, secret)


def problem(response: requests.Response, status: int, code: str = "") -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["Content-Type"].startswith("application/problem+json"), response.text
    body = response.json()
    assert body["status"] == status and body["detail"], body
    if code:
        assert body["code"] == code, body
    return body
