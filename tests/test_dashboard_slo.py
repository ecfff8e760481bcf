"""Durability SLO math against seeded rows with known answers, empty windows included, and
the SLO page that shows it."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from durability import slo
from durability.models import (
    Approval,
    ApprovalStatus,
    Checkpoint,
    Effect,
    EffectStatus,
    Event,
    EventKind,
    Run,
    RunStatus,
)
from tests.dashboard_helpers import as_operator, dash_agents, operator, text_of

pytestmark = pytest.mark.django_db
__all__ = ["as_operator", "dash_agents", "operator"]

NOW = timezone.now().replace(microsecond=0)


@pytest.fixture(autouse=True)
def _now():
    # Each test measures from its own "now": the module may be imported long before a test
    # runs, and the SLO page measures from the real clock.
    global NOW
    NOW = timezone.now().replace(microsecond=0)


def make_run(agent: str = "alpha", status: str = RunStatus.SUCCEEDED, finished=None) -> Run:
    run = Run.objects.create(
        agent=agent, agent_version="1", status=status, input="{}", finished_at=finished
    )
    return run


def event(run: Run, kind: str, ago: timedelta, **fields) -> Event:
    data = fields.pop("data", None)
    row = Event.objects.create(
        run=run, kind=kind, data=json.dumps(data) if data is not None else "", **fields
    )
    Event.objects.filter(pk=row.pk).update(created_at=NOW - ago)
    return row


def close(a: float | None, b: float, tolerance: float = 1e-6) -> bool:
    return a is not None and abs(a - b) <= tolerance * max(1.0, abs(b))


@pytest.fixture
def seeded():
    """Known answers, all inside the last hour unless said otherwise."""
    alpha = make_run("alpha")
    beta = make_run("beta")
    minute = timedelta(minutes=1)
    # 100 commits of 1 ms .. 100 ms (commit_us carries the previous commit's latency).
    for i in range(1, 101):
        event(alpha, EventKind.CHECKPOINT, minute * (i % 50 + 1), commit_us=i * 1000, seq=i)
    # Two commits failed before succeeding: 1 and 3 failed attempts.
    event(alpha, EventKind.COMMIT_FAILED, minute * 5, data={"failed_commits": 1})
    event(alpha, EventKind.COMMIT_FAILED, minute * 6, data={"failed_commits": 3})
    # Recoveries: 1 s, 2 s and 40 s to recover; 0.1 s, 0.2 s, 0.3 s of work lost.
    event(alpha, EventKind.LEASE_LOST, minute * 4, worker="w-1", reason="process gone")
    for recovery, lost in ((1000, 100), (2000, 200), (40000, 300)):
        event(
            alpha,
            EventKind.RECOVERED,
            minute * 3,
            worker="w-2",
            data={"recovery_ms": recovery, "work_lost_ms": lost},
        )
    # Outside the last hour but inside 24 h: one more slow commit and a recovery.
    event(beta, EventKind.CHECKPOINT, timedelta(hours=5), commit_us=500_000, seq=1)
    event(beta, EventKind.RECOVERED, timedelta(hours=5), data={"recovery_ms": 9000})
    # Older than 7 days: never counted.
    event(beta, EventKind.CHECKPOINT, timedelta(days=9), commit_us=9_000_000, seq=2)
    # Effects: duplicates prevented 2 + 3; one in doubt now.
    base = Checkpoint.objects.create(
        run=alpha, seq=0, state_hash="x", chain_hash="y", agent_version="1", size=2
    )
    for i, (status, dups) in enumerate(
        ((EffectStatus.DONE, 2), (EffectStatus.DONE, 3), (EffectStatus.IN_DOUBT, 0))
    ):
        Effect.objects.create(
            run=alpha,
            base=base,
            key=f"e{i}",
            idempotency_key=f"k{i}",
            status=status,
            duplicates_prevented=dups,
        )
    Effect.objects.update(created_at=NOW - minute * 2)
    event(alpha, EventKind.EFFECT_IN_DOUBT, minute * 2)
    # Approvals decided after 10, 20 and 30 minutes, and one pending for 90 minutes.
    for i, wait in enumerate((10, 20, 30)):
        a = Approval.objects.create(
            run=alpha,
            base=base,
            name=f"a{i}",
            occurrence=i,
            payload="{}",
            payload_hash="h",
            status=ApprovalStatus.APPROVED,
            decided_by="ops",
        )
        Approval.objects.filter(pk=a.pk).update(
            requested_at=NOW - timedelta(minutes=wait + 1), decided_at=NOW - timedelta(minutes=1)
        )
    pending = Approval.objects.create(
        run=beta, base=base, name="late", payload="{}", payload_hash="h"
    )
    Approval.objects.filter(pk=pending.pk).update(requested_at=NOW - timedelta(minutes=90))
    # Runs finished in the last hour: 3 succeeded, 1 failed, 1 cancelled (not counted).
    for status in ["succeeded"] * 3 + ["failed", "cancelled"]:
        make_run("alpha", status, NOW - minute * 10)
    return alpha, beta


def test_percentile_interpolates_like_postgresql():
    values = [float(v) for v in range(1, 101)]
    assert slo.percentile(values, 0.5) == 50.5
    assert close(slo.percentile(values, 0.95), 95.05)
    assert close(slo.percentile(values, 0.99), 99.01)
    assert slo.percentile([], 0.5) is None
    assert slo.percentile([7.0], 0.99) == 7.0
    with connection.cursor() as cur:
        cur.execute(
            "SELECT percentile_cont(0.95) WITHIN GROUP (ORDER BY v)"
            " FROM unnest(ARRAY[3, 1, 40, 2, 9]::float[]) AS v"
        )
        assert close(slo.percentile([3, 1, 40, 2, 9], 0.95), cur.fetchone()[0])


def test_budget_left():
    assert slo.budget_left(0, 0, 0.01) is None
    assert slo.budget_left(1000, 0, 0.01) == 1.0
    assert close(slo.budget_left(1000, 5, 0.01), 0.5)
    assert close(slo.budget_left(1000, 20, 0.01), -1.0)
    assert slo.budget_left(10, 0, 0.0) == 1.0 and slo.budget_left(10, 2, 0.0) == -2.0


def test_the_last_hour(seeded):
    report = slo.report("1h", now=NOW)
    commits = report.get("commit_success")
    assert (commits.total, commits.bad) == (104, 4)
    assert close(commits.value, 100 / 104)
    assert close(commits.budget, 1 - 4 / (104 * (1 - 0.999)))
    assert commits.met is False

    latency = report.get("commit_latency")
    assert latency.total == 100 and latency.bad == 0  # none over 100 ms
    assert close(latency.extra["p50"], 50.5) and close(latency.extra["p95"], 95.05)
    assert close(latency.value, 99.01) and latency.met is True and latency.budget == 1.0

    recovery = report.get("recovery_time")
    assert recovery.total == 3 and recovery.bad == 1  # 40 s > 30 s
    assert close(recovery.value, 2 + 0.9 * 38)  # p95 of 1, 2, 40 s
    assert close(recovery.budget, 1 - 1 / (3 * 0.05)) and recovery.met is False
    assert recovery.extra["max"] == 40.0

    lost = report.get("work_lost")
    assert close(lost.value, 0.2 + 0.9 * 0.1) and lost.met is True

    assert report.get("duplicates_prevented").value == 5
    doubt = report.get("effects_in_doubt")
    assert doubt.value == 1 and doubt.met is False and doubt.extra["entered"] == 1

    wait = report.get("approval_wait")
    assert close(wait.value, 29.0)  # p95 of 10, 20, 30 min
    assert (wait.total, wait.bad) == (4, 1)  # the 90-minute one is already late
    assert wait.extra["pending"] == 1 and close(wait.extra["oldest_pending_min"], 90)

    runs = report.get("run_success")
    assert (runs.total, runs.bad) == (4, 1) and close(runs.value, 0.75) and runs.met is False

    assert [r.recovery_ms for r in report.recoveries] == [40000, 2000, 1000]
    assert report.recoveries[0].why == "w-1: process gone"


def test_wider_windows_take_in_older_rows_but_never_older_than_the_window(seeded):
    day = slo.report("24h", now=NOW)
    assert day.get("commit_latency").total == 101
    assert day.get("commit_latency").bad == 1  # the 500 ms commit
    assert day.get("recovery_time").extra["count"] == 4
    week = slo.report("7d", now=NOW)
    assert week.get("commit_latency").total == 101  # the 9-day-old one stays out


def test_one_agent(seeded):
    beta = slo.report("24h", agent="beta", now=NOW)
    assert beta.get("commit_success").total == 1
    assert beta.get("recovery_time").extra["count"] == 1
    assert beta.get("run_success").total == 0 and beta.get("run_success").value is None
    rows = {row.agent: row for row in slo.per_agent("24h", now=NOW)}
    assert set(rows) >= {"alpha", "beta"}
    assert rows["alpha"].indicators["commit_latency"].total == 100


def test_sparkline_buckets(seeded):
    report = slo.report("1h", now=NOW)
    series = report.get("commit_success").series
    assert len(series) == slo.BUCKETS
    # Commits sit 1..50 minutes ago: the oldest buckets (over 50 minutes ago) are empty.
    assert series[0] is None and series[-1] is not None
    assert all(v is None or 0 <= v <= 1 for v in series)
    doubt = report.get("effects_in_doubt").series
    assert sum(doubt) == 1


def test_an_empty_window_has_no_data_and_no_budget_spent():
    report = slo.report("1h", now=NOW)
    for indicator in report.indicators:
        if indicator.key in ("duplicates_prevented", "effects_in_doubt"):
            assert indicator.value == 0
            continue
        assert indicator.value is None, indicator.key
        assert indicator.total == 0 and indicator.budget is None, indicator.key
        assert indicator.met is None
        assert all(v is None for v in indicator.series), indicator.key
    assert report.recoveries == []
    with pytest.raises(ValueError):
        slo.report("2h")


def test_the_slo_page(as_operator, seeded):
    html = text_of(as_operator.get(reverse("dashboard:slo"), {"window": "1h"}))
    assert "Commit success" in html and "96.2%" in html and "target ≥ 99.9%" in html
    assert "Recovery time p95 (RTO)" in html and "missed" in html and "met" in html
    assert 'class="spark"' in html and "<polyline" in html and "budget" in html
    assert "Per agent" in html and ">alpha<" in html
    assert "Recent recoveries" in html and "process gone" in html
    one = text_of(as_operator.get(reverse("dashboard:slo"), {"window": "24h", "agent": "beta"}))
    assert "for beta" in one and "Per agent" not in one
    fragment = as_operator.get(reverse("dashboard:slo"), {"window": "7d"}, HTTP_HX_REQUEST="true")
    assert text_of(fragment).lstrip().startswith('<div id="slo-body"')


def test_the_slo_page_when_nothing_happened(as_operator):
    html = text_of(as_operator.get(reverse("dashboard:slo")))
    assert "No activity in this window." in html and "no data" in html
    assert "python manage.py durability start research" in html
