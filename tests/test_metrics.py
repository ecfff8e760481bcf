"""/metrics in the Prometheus text format, computed from the database every process shares,
against seeded rows with known answers; /healthz."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from prometheus_client.parser import text_string_to_metric_families

from durability import canonical, operations
from durability.models import Approval, Effect, EffectStatus, Event, EventKind, Run, RunStatus
from durability.testing import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def scrape(client, **headers) -> dict:
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_from_seeded_rows():
    run = operations.start("test-ticker", {"n": 1})
    Run.objects.filter(pk=run.pk).update(status=RunStatus.WAITING)
    for us in (1000, 2000, 3000, 4000):
        Event.objects.create(run=run, kind=EventKind.CHECKPOINT, commit_us=us)
    Event.objects.create(
        run=run, kind=EventKind.COMMIT_FAILED, data=canonical.dumps({"failed_commits": 1}).decode()
    )
    Event.objects.create(
        run=run,
        kind=EventKind.RECOVERED,
        data=canonical.dumps({"recovery_ms": 1500, "work_lost_ms": 200}).decode(),
    )
    checkpoint = run.checkpoints.get()
    Effect.objects.create(
        run=run, base=checkpoint, key="pay", idempotency_key="k", status=EffectStatus.IN_DOUBT
    )
    Approval.objects.create(run=run, base=checkpoint, name="go", payload="{}", payload_hash="h")
    m = scrape(Client())
    assert m[("durability_runs", (("agent", "test-ticker"), ("status", "waiting")))] == 1
    assert m[("durability_effects_in_doubt", ())] == 1
    assert m[("durability_approvals_pending", ())] == 1
    window = (("window", "300s"),)
    assert m[("durability_checkpoint_commits_window", window)] == 4
    assert m[("durability_checkpoint_commit_failures_window", window)] == 1
    assert m[("durability_checkpoint_commit_success_ratio_window", window)] == 0.8
    assert m[("durability_recoveries_window", window)] == 1
    p50 = (("quantile", "0.5"), ("window", "300s"))
    assert m[("durability_checkpoint_commit_seconds", p50)] == pytest.approx(0.0025)
    assert m[("durability_recovery_seconds", p50)] == 1.5
    assert m[("durability_work_lost_seconds", p50)] == 0.2


def test_an_empty_window(settings):
    m = scrape(Client())
    window = (("window", "300s"),)
    assert m[("durability_checkpoint_commits_window", window)] == 0
    assert m[("durability_checkpoint_commit_success_ratio_window", window)] == 1.0
    assert not any(name == "durability_checkpoint_commit_seconds" for name, _ in m)


def test_a_metrics_token_is_required_when_set(settings):
    settings.DURABILITY_METRICS_TOKEN = "s3cret"
    client = Client()
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer nope").status_code == 401
    scrape(client, HTTP_AUTHORIZATION="Bearer s3cret")


def test_an_answer_is_kept_for_the_cache_period(settings):
    from durability import metrics

    metrics._cached = None
    settings.DURABILITY_METRICS_CACHE_SECONDS = 0.5
    window = ("durability_checkpoint_commits_window", (("window", "300s"),))
    assert scrape(Client())[window] == 0
    run = operations.start("test-ticker", {"n": 1})
    Event.objects.bulk_create(Event(run=run, kind=EventKind.CHECKPOINT) for _ in range(3))
    # Within the period the computed answer is served again, without touching the database.
    with CaptureQueriesContext(connection) as queries:
        assert scrape(Client())[window] == 0
    assert len(queries) == 0
    wait_until(lambda: scrape(Client())[window] == 3, timeout=10, what="a fresh answer")
    metrics._cached = None


def test_health():
    response = Client().get("/healthz")
    assert response.status_code == 200 and response.content == b"ok\n"
