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


def test_an_account_with_no_role_sees_a_403_that_says_whom_to_ask(operator):
    from tests.dashboard_helpers import make_user

    run = waiting_run()
    approval = Approval.objects.get(run=run)
    nobody = Client()
    nobody.force_login(make_user("nora", None))
    for url in pages(run, approval):
        response = nobody.get(url)
        html = text_of(response)
        assert response.status_code == 403, url
        assert "has no role" in html and "administrator" in html, url
        assert "&quot;viewers&quot; group" in html and "&quot;operators&quot; group" in html
        assert "Approvals" not in html  # no navigation to pages it may not see
    fragment = nobody.get(reverse("dashboard:runs"), HTTP_HX_REQUEST="true")
    assert fragment.status_code == 403 and "<html" not in text_of(fragment)
    refused = nobody.post(reverse("dashboard:cancel", args=[run.id]), {"cancel-reason": "x"})
    assert refused.status_code == 403
    run.refresh_from_db()
    assert run.status == "waiting"


def test_sign_in_is_locked_after_five_failures_for_that_username_and_address(operator):
    client = Client()
    for _ in range(4):
        wrong = client.post(reverse("login"), {"username": "olive", "password": "guess"})
        assert wrong.status_code == 200 and "do not match" in text_of(wrong)
    fifth = client.post(reverse("login"), {"username": "olive", "password": "guess"})
    assert fifth.status_code == 429 and "Too many failed sign-ins" in text_of(fifth)
    assert "15 minutes" in text_of(fifth)
    # Locked: even the right password is refused now, and no session is opened.
    right = client.post(reverse("login"), {"username": "olive", "password": PASSWORD})
    assert right.status_code == 429 and "blocked" in text_of(right)
    assert client.get(reverse("dashboard:runs")).status_code == 302
    # Another address is counted on its own.
    other = Client(REMOTE_ADDR="10.1.2.3")
    ok = other.post(reverse("login"), {"username": "olive", "password": PASSWORD})
    assert ok.status_code == 302


def test_ensure_admin_refuses_a_weak_password_with_the_validators_sentences(db, tmp_path, settings):
    from io import StringIO

    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.core.management import CommandError, call_command

    settings.VAR_DIR = tmp_path
    users = get_user_model()
    for weak, sentence in (
        ("password", "This password is too common."),
        ("12345678901", "This password is entirely numeric."),
        ("short1x", "This password is too short."),
        ("rootadmin1", "too similar to the username"),
    ):
        with pytest.raises(CommandError) as err:
            call_command("ensure_admin", "--username", "rootadmin", "--password", weak)
        assert sentence in str(err.value) and "nothing was changed" in str(err.value), weak
        assert not users.objects.exists() and not Group.objects.exists()
    out = StringIO()
    call_command("ensure_admin", stdout=out)  # a random one passes and is kept 0600
    kept = tmp_path / "admin-password"
    assert kept.read_text().strip() in out.getvalue()
    assert kept.stat().st_mode & 0o777 == 0o600
    admin = users.objects.get(username="admin")
    with pytest.raises(CommandError):
        call_command("ensure_admin", "--password", "password")
    admin.refresh_from_db()
    assert admin.check_password(kept.read_text().strip())  # a refused change changes nothing


def _start_embedded(var, **env: str):
    """A fresh process on the embedded default (no SECRET_KEY, SQLite under ``var``) under a
    permissive umask, which writes to its database (so SQLite makes its -wal and -shm
    files) and prints its SECRET_KEY."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import django; django.setup(); from django.conf import settings;"
        " from django.db import connection;"
        " connection.cursor().execute('create table if not exists t (x int)');"
        " connection.cursor().execute('insert into t values (1)');"
        # While the connection is open, SQLite's -wal and -shm files exist: their modes.
        " import os, glob;"
        " print(sorted((p[-3:], oct(os.stat(p).st_mode & 0o777))"
        " for p in glob.glob(str(settings.VAR_DIR / 'db.sqlite3-*'))));"
        " print(settings.SECRET_KEY)"
    )
    drop = {"DATABASE_URL", "SECRET_KEY", "DATABASE_TEST_NAME", "CELERY_BROKER_URL", "DEBUG"}
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    environ.update(DJANGO_SETTINGS_MODULE="config.settings", DURABILITY_VAR_DIR=str(var), **env)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=environ,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        preexec_fn=lambda: os.umask(0o022),
        timeout=60,
    )


def test_the_embedded_default_makes_its_own_secret_key_and_keeps_its_files_private(tmp_path):
    var = tmp_path / "var"
    first = _start_embedded(var)
    assert first.returncode == 0, first.stderr
    modes, key = first.stdout.split()[:-1], first.stdout.split()[-1]
    assert " ".join(modes) == "[('shm', '0o600'), ('wal', '0o600')]"
    assert len(key) >= 50 and key != "insecure-embedded-default-change-me"
    assert (var / "secret-key").read_text().strip() == key
    again = _start_embedded(var)
    assert again.stdout.split()[-1] == key  # reused: sessions survive a restart
    assert var.stat().st_mode & 0o777 == 0o700
    for name in ("secret-key", "db.sqlite3"):
        assert (var / name).stat().st_mode & 0o777 == 0o600, name
    # Another var dir, another key: nothing constant is shared between installations.
    assert _start_embedded(tmp_path / "other").stdout.split()[-1] != key
    # A var dir and database made world-readable by an older version are tightened.
    var.chmod(0o755)
    (var / "db.sqlite3").chmod(0o644)
    assert _start_embedded(var).returncode == 0
    assert var.stat().st_mode & 0o777 == 0o700
    assert (var / "db.sqlite3").stat().st_mode & 0o777 == 0o600


def test_a_server_database_still_requires_a_secret_key(tmp_path):
    refused = _start_embedded(
        tmp_path / "var", DATABASE_URL="postgres://postgres@127.0.0.1:5432/none"
    )
    assert refused.returncode != 0 and "SECRET_KEY is required" in refused.stderr
    assert not (tmp_path / "var" / "secret-key").exists()
