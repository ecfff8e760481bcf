"""The API's pages in headless Chromium under the product's Content-Security-Policy: the
Swagger UI reference renders from the product's own static files (no CDN, no inline script,
no CSP violation), and the token page makes a token and shows it once."""

from __future__ import annotations

import pytest

from api.models import ApiToken
from tests.api_helpers import user_with
from tests.test_browser_dashboard import Watched

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def watched(browser, live_server):
    page = Watched(browser, live_server.url)
    requests: list[str] = []
    page.page.on("request", lambda r: requests.append(r.url))
    page.requests = requests
    yield page
    try:
        page.check()
    finally:
        page.context.close()


def test_the_reference_renders_from_local_files_under_the_csp(watched, live_server):
    page = watched.go("/api/v1/docs")
    page.wait_for_selector("#swagger-ui .info .title")
    assert "Durability API" in page.inner_text("#swagger-ui .info .title")
    page.wait_for_selector(".opblock-summary-path")
    assert "/api/v1/runs" in page.inner_text("#swagger-ui")
    outside = [u for u in watched.requests if not u.startswith(live_server.url)]
    assert not outside, outside


def test_the_token_page_makes_a_token_and_shows_it_once(watched):
    user_with("viewer", "wendy")
    page = watched.sign_in("wendy")
    page = watched.go("/api/tokens/")
    page.fill("input[name=name]", "laptop")
    page.click("text=Make token")
    secret = page.inner_text("#token-secret")
    assert secret.startswith("dur_")
    assert ApiToken.objects.get(name="laptop").hint == secret[:10]
    page = watched.go("/api/tokens/")
    assert secret not in page.content() and "laptop" in page.content()
