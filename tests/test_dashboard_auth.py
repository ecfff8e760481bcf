"""Sign-in and the rules every page follows: a login for everything, a Content-Security-
Policy without inline script, htmx without eval, no inline script or style in any page."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from durability.models import Approval
from tests.dashboard_helpers import PASSWORD, dash_agents, operator, text_of, viewer, waiting_run

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["dash_agents", "operator", "viewer"]


def pages(run, approval) -> list[str]:
    r = str(run.id)
    return [
        reverse("dashboard:runs"),
        reverse("dashboard:run", args=[r]),
        reverse("dashboard:checkpoint", args=[r, 1]) + "?tab=state",
        reverse("dashboard:checkpoint", args=[r, 1]) + "?tab=changes",
        reverse("dashboard:checkpoint", args=[r, 1]) + "?tab=mutations",
        reverse("dashboard:checkpoint", args=[r, 1]) + "?tab=calls",
        reverse("dashboard:diff", args=[r]),
        reverse("dashboard:rollback", args=[r]) + "?to=1",
        reverse("dashboard:fork", args=[r]) + "?from=1",
        reverse("dashboard:approvals"),
        reverse("dashboard:approval", args=[approval.pk]),
        reverse("dashboard:slo"),
        reverse("dashboard:audit"),
        reverse("dashboard:notifications"),
    ]


def test_every_page_needs_a_login(operator):
    run = waiting_run()
    approval = Approval.objects.get(run=run)
    anonymous = Client()
    for url in pages(run, approval):
        response = anonymous.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith(reverse("login")), url
    # A poll whose session expired sends the whole page to sign in, not a fragment.
    response = anonymous.get(reverse("dashboard:runs"), HTTP_HX_REQUEST="true")
    assert response.status_code == 200
    assert response["HX-Redirect"].startswith(reverse("login"))
    # POSTs too: nothing is done for someone who is not signed in.
    response = anonymous.post(reverse("dashboard:cancel", args=[run.id]), {"cancel-reason": "x"})
    assert response.status_code == 302
    run.refresh_from_db()
    assert run.status == "waiting"


def test_sign_in_with_the_form_then_sign_out(operator):
    client = Client()
    page = client.get(reverse("login"))
    assert page.status_code == 200 and "Sign in" in text_of(page)
    wrong = client.post(reverse("login"), {"username": "olive", "password": "nope"})
    assert "do not match" in text_of(wrong)
    right = client.post(reverse("login"), {"username": "olive", "password": PASSWORD})
    assert right.status_code == 302 and right["Location"] == reverse("dashboard:runs")
    home = client.get(reverse("dashboard:runs"))
    assert "olive" in text_of(home) and "operator" in text_of(home)
    out = client.post(reverse("logout"))
    assert out.status_code == 302
    assert client.get(reverse("dashboard:runs")).status_code == 302


def test_pages_carry_a_strict_csp_and_no_inline_script_or_style(operator, viewer):
    run = waiting_run()
    approval = Approval.objects.get(run=run)
    for user in (operator, viewer):
        client = Client()
        client.force_login(user)
        for url in pages(run, approval):
            response = client.get(url)
            assert response.status_code == 200, url
            policy = response["Content-Security-Policy"]
            assert "script-src 'self'" in policy and "style-src 'self'" in policy
            assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
            html = text_of(response)
            # Every <script> loads a file; no inline handlers, styles or hx-on.
            for tag in re.findall(r"<script\b[^>]*>", html):
                assert " src=" in tag, (url, tag)
            assert not re.search(r"<script\b[^>]*>\s*[^<\s]", html), url
            assert not re.search(r"\son[a-z]+\s*=", html), url
            assert not re.search(r"\sstyle\s*=", html), url
            assert "hx-on" not in html, url
            assert '"allowEval":false' in html and '"allowScriptTags":false' in html
            assert "django_htmx/htmx-2.min.js" in html
            assert "X-CSRFToken" in html  # the token rides on every htmx request


def test_viewer_sees_disabled_actions_with_the_reason(as_viewer_client):
    client, run = as_viewer_client
    html = text_of(client.get(reverse("dashboard:run", args=[run.id])))
    assert "viewer" in html and "actions need the operator role" in html
    assert 'disabled title="operators only">Fork' in html
    assert reverse("dashboard:fork", args=[run.id]) not in html


@pytest.fixture
def as_viewer_client(viewer):
    client = Client()
    client.force_login(viewer)
    return client, waiting_run()
