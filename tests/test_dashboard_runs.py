"""The runs list: status counts, filters, search, keyset pages and the live poll."""

from __future__ import annotations

import base64
import uuid
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from dashboard import queries
from durability import operations
from durability.models import Event, Run, RunStatus
from tests.dashboard_helpers import as_operator, dash_agents, operator, text_of, waiting_run

pytestmark = pytest.mark.django_db
__all__ = ["as_operator", "dash_agents", "operator"]

URL = reverse("dashboard:runs")


def start(question: str, **extra) -> Run:
    return operations.start("dash-chain", {"question": question, **extra}, by="t")


def ids_in(html: str, runs) -> list[str]:
    return [r.short_id for r in runs if r.short_id in html]


def test_empty_list_explains_how_to_start_a_demo_run(as_operator):
    html = text_of(as_operator.get(URL))
    assert "No runs yet." in html
    assert "python manage.py durability start research --input" in html
    assert "make up" in html


def test_counts_filters_and_row_contents(as_operator):
    a, b, c = start("alpha"), start("beta"), start("gamma")
    Run.objects.filter(pk=b.pk).update(status=RunStatus.FAILED, error="Boom: it broke")
    Run.objects.filter(pk=c.pk).update(created_at=timezone.now() - timedelta(days=3))
    response = as_operator.get(URL)
    html = text_of(response)
    assert ids_in(html, [a, b, c]) == [a.short_id, b.short_id, c.short_id]
    result = response.context["result"]
    assert result.counts["queued"] == 2 and result.counts["failed"] == 1
    assert "dash-chain" in html and "@2" in html and "Boom: it broke" in html

    failed = as_operator.get(URL, {"status": "failed"})
    assert ids_in(text_of(failed), [a, b, c]) == [b.short_id]
    # Counts ignore the status filter, so the chips still say what else there is.
    assert failed.context["result"].counts["queued"] == 2

    recent = as_operator.get(URL, {"since": "24h"})
    assert ids_in(text_of(recent), [a, b, c]) == [a.short_id, b.short_id]
    assert recent.context["result"].counts["queued"] == 1

    other = as_operator.get(URL, {"agent": "research"})
    assert ids_in(text_of(other), [a, b, c]) == []
    assert "No run matches these filters." in text_of(other)


def test_search_by_id_prefix_and_by_text_in_the_input(as_operator):
    runs = [start(f"question number {i}") for i in range(6)]
    target = runs[3]
    by_prefix = as_operator.get(URL, {"q": str(target.id)[:6]})
    assert ids_in(text_of(by_prefix), runs) == [target.short_id]
    by_full_id = as_operator.get(URL, {"q": str(target.id).upper()})
    assert ids_in(text_of(by_full_id), runs) == [target.short_id]
    by_text = as_operator.get(URL, {"q": "NUMBER 4"})
    assert ids_in(text_of(by_text), runs) == [runs[4].short_id]
    nothing = as_operator.get(URL, {"q": "no such words"})
    assert ids_in(text_of(nothing), runs) == []


def test_id_prefix_becomes_a_range_of_uuids():
    low, high = queries.id_prefix_range("8f2a")
    assert str(low) == "8f2a0000-0000-0000-0000-000000000000"
    assert str(high) == "8f2b0000-0000-0000-0000-000000000000"
    assert queries.id_prefix_range("ffffffff-ffff-ffff-ffff-ffffffffffff")[1] is None
    assert queries.id_prefix_range("what?") is None
    assert queries.id_prefix_range("abc") is None  # too short to be an id


def test_keyset_pages_cover_every_run_once_in_order(as_operator):
    runs = [start(f"q{i}") for i in range(120)]
    # Ties on created_at are broken by id, so no run is skipped or repeated.
    same = timezone.now() - timedelta(minutes=5)
    Run.objects.filter(pk__in=[r.pk for r in runs[40:60]]).update(created_at=same)
    seen: list[str] = []
    cursor = ""
    pages = 0
    while True:
        response = as_operator.get(URL, {"cursor": cursor} if cursor else {})
        result = response.context["result"]
        seen += [str(r.id) for r in result.rows]
        pages += 1
        cursor = result.next_cursor
        if not cursor:
            break
        assert f"cursor={cursor}" in text_of(response)
    expected = [str(r.id) for r in Run.objects.order_by("-created_at", "-id").only("id")]
    assert pages == 3 and seen == expected and len(set(seen)) == 120


def test_a_bad_cursor_or_filter_is_refused_with_a_sentence(as_operator):
    start("x")
    response = as_operator.get(URL, {"cursor": "not-a-cursor!"})
    assert response.status_code == 400 and "is not a position this list gave" in text_of(response)
    # A date past year 9999 once moved to UTC (it overflowed before: a 500).
    late = base64.urlsafe_b64encode(f"9999-12-31T23:59:59-05:00|{uuid.uuid4()}".encode())
    assert as_operator.get(URL, {"cursor": late.decode()}).status_code == 400
    unknown = as_operator.get(URL, {"status": "sleeping"})
    assert unknown.status_code == 400 and "sleeping" in text_of(unknown)
    assert as_operator.get(URL, {"since": "1y"}).status_code == 400
    nobody = as_operator.get(URL, {"agent": "no-such-agent"})
    assert nobody.status_code == 400 and "no agent" in text_of(nobody)


def test_live_poll_answers_204_until_something_changes(as_operator):
    run = start("watch me")
    first = as_operator.get(URL, HTTP_HX_REQUEST="true")
    assert first.status_code == 200 and "<html" not in text_of(first)
    token = first.context["token"]
    same = as_operator.get(URL, {"live": token}, HTTP_HX_REQUEST="true")
    assert same.status_code == 204 and same.content == b""
    Event.objects.create(run=run, kind="claimed", worker="w-1")
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)
    changed = as_operator.get(URL, {"live": token}, HTTP_HX_REQUEST="true")
    assert changed.status_code == 200
    html = text_of(changed)
    assert 'id="results"' in html and "running" in html and "<html" not in html
    assert changed.context["token"] != token


@pytest.mark.django_db(transaction=True)
def test_waiting_approval_shows_in_the_row(as_operator):
    run = waiting_run("approve me")
    html = text_of(as_operator.get(URL))
    assert run.short_id in html and "approval <strong>ship</strong>" in html


def test_text_search_pages_and_counts_in_one_scan(as_operator):
    hits = [start(f"needle number {i}") for i in range(60)]
    start("haystack only")
    Run.objects.filter(pk__in=[r.pk for r in hits[:10]]).update(status=RunStatus.FAILED)
    first = as_operator.get(URL, {"q": "NEEDLE"})
    result = first.context["result"]
    assert result.counts["queued"] == 50 and result.counts["failed"] == 10
    assert len(result.rows) == 50 and result.next_cursor
    second = as_operator.get(URL, {"q": "NEEDLE", "cursor": result.next_cursor})
    seen = {r.pk for r in result.rows} | {r.pk for r in second.context["result"].rows}
    assert seen == {r.pk for r in hits} and not second.context["result"].next_cursor
    failed = as_operator.get(URL, {"q": "needle", "status": "failed"}).context["result"]
    assert {r.pk for r in failed.rows} == {r.pk for r in hits[:10]}
    assert failed.counts["queued"] == 50  # the chips still count every status


def test_hex_looking_text_is_searched_when_no_run_id_starts_with_it(as_operator):
    run = start("the cafe is closed")
    taken = {str(r.id)[:4] for r in Run.objects.all()}
    word = "cafe" if "cafe" not in taken else "beef"
    if word == "beef":
        run = start("the beef is raw")
    assert ids_in(text_of(as_operator.get(URL, {"q": word})), [run]) == [run.short_id]


def test_text_search_can_use_the_trigram_index(as_operator):
    """Migration 0003's index is on the very expression Django writes for icontains, so the
    search in inputs does not have to read every run."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("the trigram index is PostgreSQL's")
    start("what is a write-ahead log?")
    # As the text-search page asks it: the matching runs, unordered (they are materialized).
    query = queries.filtered(queries.Filters(q="write-ahead")).order_by().values("id")
    sql, params = query.query.sql_with_params()
    with connection.cursor() as cur:
        # A handful of rows: leave the planner nothing but an index that can test the text.
        cur.execute("SET LOCAL enable_seqscan = off")
        cur.execute("SET LOCAL enable_indexscan = off")
        cur.execute("EXPLAIN " + sql, params)
        plan = "\n".join(row[0] for row in cur.fetchall())
    assert "run_input_trgm" in plan, plan
    assert ids_in(text_of(as_operator.get(URL, {"q": "write-ahead"})), Run.objects.all())
