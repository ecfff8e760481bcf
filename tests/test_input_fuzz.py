"""Malformed values sent to every parameter of every dashboard route and form: the answer is
always a page with a status below 500 (a 4xx with a sentence for what is wrong), never an
exception (the test client raises a view's exception, so a would-be 500 fails here with its
traceback).

The routes come from the URLconf, their query parameters from the table below (checked
against the parameters the views read, so a new one cannot be forgotten), the form fields
from the form classes themselves. Values: huge and negative numbers, dates outside what can
be stored, cursors built around them, control characters, bytes that are not UTF-8, very
long strings, enum values nobody offers, fields left out."""

from __future__ import annotations

import base64
import json
import re
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote_from_bytes, urlencode

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dashboard.forms import (
    DecisionForm,
    ForkForm,
    PayloadForm,
    ReasonForm,
    ResolveForm,
    RollbackForm,
    SendForm,
    StartForm,
)
from dashboard.urls import urlpatterns
from durability.models import Run
from tests.dashboard_helpers import PASSWORD, dash_agents
from tests.test_access_matrix import ROUTES, scene

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["dash_agents"]

# The query parameters each route reads (its path parameters come from the URLconf).
QUERY: dict[str, list[str]] = {
    "runs": ["status", "agent", "since", "q", "outcome", "recovered", "cursor", "live"],
    "run": ["tab", "live", "cursor", "acts", "head", "inspect", "follow"],
    "checkpoints": ["before"],
    "checkpoint": ["tab"],
    "tree": ["path", "offset"],
    "state_json": [],
    "timeline": ["before"],
    "diff": ["a_run", "a", "b_run", "b", "view", "offset"],
    "diff_words": ["a_run", "a", "b_run", "b", "path"],
    "resume": [],
    "cancel": [],
    "rollback": ["to"],
    "fork": ["from", "from_seq"],
    "send": [],
    "resolve": [],
    "approvals": [],
    "approval": [],
    "decide": [],
    "slo": ["window", "agent"],
    "audit": ["actor", "kind", "run", "before"],
    "notifications": ["before"],
    "start": ["agent"],
}


def form_fields(form: Any, *extra: str) -> list[str]:
    return [form.add_prefix(name) for name in form.fields] + list(extra)


# The fields each form posts, read from the form classes (plus what the views read beside
# the form: the fork's check button, the decision's way back, the run version).
FORMS: dict[str, list[str]] = {
    "resume": form_fields(ReasonForm(prefix="resume"), "resume-version"),
    "cancel": form_fields(ReasonForm(prefix="cancel"), "cancel-version"),
    "rollback": form_fields(RollbackForm(), "version", "action"),
    "fork": form_fields(ForkForm(), "action"),
    "send": form_fields(SendForm(prefix="send"), "send-version"),
    "resolve": form_fields(ResolveForm(), "version"),
    "decide": form_fields(DecisionForm(), "next"),
    "start": form_fields(StartForm()),
    # PayloadForm's fields are the approval's payload keys by position (f0..f3) and a comment
    # (checked against the form made for the approval under test, below).
    "approval": ["f0", "f1", "f2", "f3", "comment"],
}


def test_the_tables_cover_every_route_and_every_parameter_the_views_read():
    names = {p.name for p in urlpatterns}
    assert set(QUERY) == names and set(ROUTES) == names
    assert {n for n, r in ROUTES.items() if r.post} == set(FORMS)
    read = set()
    root = Path(__file__).resolve().parent.parent / "dashboard"
    for path in [*(root / "views").glob("*.py"), root / "queries.py"]:
        text = path.read_text()
        read |= set(re.findall(r'(?:GET|source)(?:\.get\(|\[|, )"(\w+)"', text))
        read |= set(re.findall(r'params\.\w+\(data, "(\w+)"', text))
        # Helpers that read one parameter, named by a default (known_agent, known_outcome).
        read |= set(re.findall(r'def \w+\(data: Any, name: str = "(\w+)"\)', text))
    offered = {name for names in QUERY.values() for name in names}
    assert read - {"from", "from_seq"} <= offered, read - offered


# --- values -------------------------------------------------------------------------------

NASTY_DATES = [
    "9999-12-31T23:59:59-05:00",
    "0001-01-01T00:00:00+05:00",
    "9999-12-31T23:59:59.999999-23:59",
    "2020-13-45T00:00:00",
    "2020-02-30T25:61:61+00:00",
    "2026-01-01T00:00:00",
    "99999-01-01T00:00:00+00:00",
    "",
]
BIG = ["9" * 30, str(2**63), str(2**63 - 1), str(2**31), "-1", "-" + "9" * 25, "1e9", "0x10"]


def b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


cursors = st.one_of(
    st.builds(lambda d: b64(f"{d}|{uuid.uuid4()}"), st.sampled_from(NASTY_DATES)),
    st.builds(lambda d, i: b64(f"{d}|{i}"), st.sampled_from(NASTY_DATES), st.text(max_size=40)),
    st.builds(
        lambda n, d: ".".join([n, n, n, n, d]), st.sampled_from(BIG), st.sampled_from(NASTY_DATES)
    ),
    st.builds(
        lambda d, n: f"{d}|{n}|{n}", st.sampled_from(NASTY_DATES), st.sampled_from([*BIG, "1"])
    ),
    st.builds(lambda dt: f"{dt.isoformat()}|1|1", st.datetimes()),
)
values = st.one_of(
    st.sampled_from(BIG + NASTY_DATES),
    st.integers(min_value=-(2**80), max_value=2**80).map(str),
    cursors,
    st.text(max_size=50),
    st.text(alphabet=st.characters(max_codepoint=0x1F), max_size=20),  # control characters
    st.sampled_from(["sleeping", "RUNNING", "running ", "1y", "split2", "nope", "approve "]),
    st.builds(
        lambda c, n: c * n,
        st.sampled_from(["a", "é", "9", "/", "<", "🙂"]),
        st.integers(1000, 200_000),
    ),
    st.sampled_from(["/messages/0/content", "/~2/x", "/" + "a/" * 2000, "[]", "{}", "null"]),
    st.sampled_from(["[" * 5000, '{"a":' * 300, json.dumps({"question": 1})]),
)
# Bytes that are not UTF-8 (and NUL), sent percent-encoded as they are.
raw_bytes = st.binary(min_size=1, max_size=40)


@pytest.fixture
def world(db):
    users = get_user_model()
    admin = users.objects.create_superuser("fuzz", "", PASSWORD)
    client = Client()
    client.force_login(admin)
    return client, scene(), scene(cancelled=True)


def url_and_query(name: str, world: Any) -> tuple[str, dict]:
    _, shared, cancelled = world
    route = ROUTES[name]
    s = cancelled if route.cancelled else shared
    s.run.refresh_from_db()
    return route.url(s), route.query(s)


def check(response: Any, where: str) -> None:
    assert response.status_code < 500, (where, response.status_code)
    if 400 <= response.status_code < 500:
        # A sentence that says what was wrong, not a bare status.
        body = response.content.decode()
        assert 'role="alert"' in body, (where, response.status_code, body[:300])


FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


def fixed_values() -> list[str]:
    """The values every parameter gets in turn, before the random ones."""
    found = [*BIG, *NASTY_DATES, "sleeping", "x" * 5000, "\x01\x7f", "ÿ" * 3]
    for date in NASTY_DATES[:4]:
        found += [b64(f"{date}|{uuid.uuid4()}"), f"1.1.1.1.{date}", f"{date}|1|1"]
    return found + [f"{n}.{n}.{n}.{n}." for n in BIG[:3]] + [f"2026-01-01T00:00:00|{BIG[0]}|1"]


def test_every_form_field_with_each_fixed_value(world):
    client, shared, cancelled = world
    payload = json.loads(shared.approval.payload)
    assert FORMS["approval"] == form_fields(PayloadForm(payload))
    for name, fields in FORMS.items():
        route = ROUTES[name]
        for field in fields:
            for value in [*BIG[:4], NASTY_DATES[0], "x" * 5000, "\x01", "[" * 5000, None]:
                s = cancelled if route.cancelled else shared
                s.run.refresh_from_db()
                form = {k: str(v) for k, v in route.form(s).items()}
                if value is None:
                    form.pop(field, None)
                else:
                    form[field] = value
                check(client.post(route.url(s), form), f"POST {name} {field}={value!r:.40}")


def test_every_query_parameter_with_each_fixed_value(world):
    client = world[0]
    for name, names in QUERY.items():
        if not ROUTES[name].get:
            continue
        url, query = url_and_query(name, world)
        for param in names:
            for value in fixed_values():
                check(client.get(url, {**query, param: value}), f"GET {name} {param}={value!r}")


@FUZZ
@given(data=st.data())
def test_query_parameters_never_answer_5xx(world, data):
    client = world[0]
    name = data.draw(st.sampled_from(sorted(n for n in QUERY if ROUTES[n].get)))
    url, query = url_and_query(name, world)
    params = data.draw(st.sampled_from(QUERY[name] or ["unknown"]))
    query = dict(query)
    if data.draw(st.booleans()):
        query[params] = data.draw(values)
        qs = urlencode(query)
    else:
        qs = urlencode(query) + "&" + params + "=" + quote_from_bytes(data.draw(raw_bytes))
    htmx = {"HTTP_HX_REQUEST": "true"} if data.draw(st.booleans()) else {}
    check(client.get(f"{url}?{qs}", **htmx), f"GET {name} {params}")


@FUZZ
@given(data=st.data())
def test_form_fields_never_answer_5xx(world, data):
    client = world[0]
    name = data.draw(st.sampled_from(sorted(FORMS)))
    _, shared, cancelled = world
    route = ROUTES[name]
    s = cancelled if route.cancelled else shared
    s.run.refresh_from_db()
    form = {k: str(v) for k, v in route.form(s).items()}
    for field in data.draw(st.lists(st.sampled_from(FORMS[name]), max_size=3, unique=True)):
        if data.draw(st.booleans()):
            form.pop(field, None)  # left out
        else:
            form[field] = data.draw(values)
    htmx = {"HTTP_HX_REQUEST": "true"} if data.draw(st.booleans()) else {}
    if data.draw(st.booleans()):
        check(client.post(route.url(s), form, **htmx), f"POST {name} {sorted(form)}")
        return
    # A body with bytes that are not UTF-8 in one field, as a browser could not send it.
    field = data.draw(st.sampled_from(FORMS[name]))
    form.pop(field, None)
    body = urlencode(form) + f"&{field}=" + quote_from_bytes(data.draw(raw_bytes))
    kind = "application/x-www-form-urlencoded"
    check(client.post(route.url(s), body, content_type=kind, **htmx), f"POST {name} {field}")


PATH_NUMBERS = [*BIG, "0", "1", "007"]


def hit_every_route(client: Client, ref: str, number: str) -> None:
    for pattern in urlpatterns:
        route = str(pattern.pattern)
        path = "/" + route
        path = path.replace("<str:ref>", quote_from_bytes(ref.encode()[:3000], safe="") or "x")
        for converter in ("<int:seq>", "<int:pk>", "<int:effect_id>"):
            path = path.replace(converter, number)
        check(client.get(path), f"GET {path[:100]}")
        if pattern.name in FORMS:
            check(client.post(path, {"decision": "approve"}), f"POST {path[:100]}")


def test_path_parameters_of_a_real_run_with_each_fixed_number(world):
    """The seeded run's own id, so that every view gets past finding its run, with each
    number in every integer parameter of the path."""
    client, shared, _ = world
    for number in PATH_NUMBERS:
        hit_every_route(client, str(shared.run.id), number)


# Each example requests every route (about thirty requests): fifty random references, after
# the fixed numbers above with a real one.
@settings(FUZZ, max_examples=50)
@given(ref=values, number=st.sampled_from(PATH_NUMBERS))
def test_path_parameters_never_answer_5xx(world, ref, number):
    assert Run.objects.exists()
    hit_every_route(world[0], ref, number)


@FUZZ
@given(username=values, password=values, following=values, address=values)
def test_the_sign_in_form_never_answers_5xx(db, username, password, following, address):
    client = Client(HTTP_X_FORWARDED_FOR=address[:1000])
    form = {"username": username, "password": password, "next": following}
    response = client.post("/accounts/login/?" + urlencode({"next": following}), form)
    assert response.status_code in (200, 302, 400, 429), response.status_code


def test_the_sign_in_form_with_fields_left_out_or_nul(db, settings):
    settings.CLIENT_IP_HEADER = "X-Forwarded-For"
    forms = [{}, {"username": "x"}, {"password": "x"}, {"username": "x", "password": "y"}]
    for form in forms:
        assert Client().post("/accounts/login/", form).status_code == 200
    nul = {"username": "bob", "password": "y", "next": "a\x00b", "x\x00": "1"}
    assert Client().post("/accounts/login/?q=%00", nul).status_code in (200, 400)
    forged = Client(HTTP_X_FORWARDED_FOR="1.2.3.4, not-an-address")
    assert (
        forged.post("/accounts/login/", {"username": "x" * 300, "password": "y"}).status_code == 200
    )
