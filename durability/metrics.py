"""``/metrics`` in the Prometheus text format, for scrapers.

Workers export their metrics over OTLP as they happen; a scraper of the web process would
see none of them, since each process keeps its own. So this endpoint reads the truth that
every process shares, the database: the current state of runs, effects and approvals as
gauges, and the last window of the event timeline (commits, their latency, failures,
recoveries and their time, work lost) as windowed figures, all computed at scrape time.

Access: open to whoever can reach it (keep it on the internal network) unless
``DURABILITY_METRICS_TOKEN`` is set, in which case a scraper sends
``Authorization: Bearer <token>``. A scrape reads up to a window of commit events, so its
answer is kept for ``DURABILITY_METRICS_CACHE_SECONDS`` and concurrent scrapes share one
computation: many scrapers (or one caller in a loop) cost the database one query set per
period, not one each.
"""

from __future__ import annotations

import hmac
import threading
import time
from datetime import timedelta

import orjson
from django.db import connection
from django.db.models import Count, Min
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from durability.conf import conf
from durability.store import store

QUANTILES = (0.5, 0.95, 0.99)


def _quantiles(values: list[float]) -> dict[float, float]:
    # The SLO page's definition (percentile_cont), so both show the same figures.
    from durability.slo import percentile

    # None only for no values: then no quantile at all.
    return {q: v for q in QUANTILES if (v := percentile(values, q)) is not None}


class DurabilityCollector:
    def __init__(self, window_seconds: float) -> None:
        self.window = window_seconds

    def collect(self):
        yield from self._current()
        yield from self._windowed()

    def _current(self):
        """Gauges of what is true now: runs, effects in doubt, pending approvals."""
        from durability.models import Approval, ApprovalStatus, Effect, EffectStatus, Run

        runs = GaugeMetricFamily(
            "durability_runs", "Runs by agent and status", labels=["agent", "status"]
        )
        for row in Run.objects.values("agent", "status").annotate(n=Count("id")):
            runs.add_metric([row["agent"], row["status"]], row["n"])
        yield runs

        yield GaugeMetricFamily(
            "durability_effects_in_doubt",
            "Effects whose outcome is unknown, waiting for an operator",
            value=Effect.objects.filter(status=EffectStatus.IN_DOUBT).count(),
        )
        pending = Approval.objects.filter(status=ApprovalStatus.PENDING).aggregate(
            n=Count("id"), oldest=Min("requested_at")
        )
        yield GaugeMetricFamily(
            "durability_approvals_pending",
            "Approvals waiting for a decision",
            value=pending["n"],
        )
        oldest = pending["oldest"]
        yield GaugeMetricFamily(
            "durability_approval_oldest_wait_seconds",
            "How long the oldest pending approval has waited",
            value=(timezone.now() - oldest).total_seconds() if oldest else 0.0,
        )

    def _windowed(self):
        """Figures over the last window of the event timeline."""
        since = timezone.now() - timedelta(seconds=self.window)
        label = [f"{int(self.window)}s"]
        commits, latency_quantiles = _commit_figures(since)
        failures, recoveries, work_lost = _failures_and_recoveries(since)
        yield _gauge(
            "durability_checkpoint_commits_window",
            "Checkpoints committed in the window",
            label,
            commits,
        )
        yield _gauge(
            "durability_checkpoint_commit_failures_window",
            "Checkpoint commits that failed in the window",
            label,
            failures,
        )
        yield _gauge(
            "durability_checkpoint_commit_success_ratio_window",
            "Share of checkpoint commits that succeeded at their first attempt",
            label,
            commits / (commits + failures) if commits + failures else 1.0,
        )
        for name, help_text, quantiles in (
            (
                "durability_checkpoint_commit_seconds",
                "Checkpoint commit latency",
                latency_quantiles,
            ),
            (
                "durability_recovery_seconds",
                "Recovery time (lost lease to resumed)",
                _quantiles(recoveries),
            ),
            ("durability_work_lost_seconds", "Work lost per recovery", _quantiles(work_lost)),
        ):
            family = GaugeMetricFamily(
                name, f"{help_text}, quantiles over the window", labels=["window", "quantile"]
            )
            for q, value in quantiles.items():
                family.add_metric([*label, str(q)], value)
            yield family
        yield _gauge(
            "durability_recoveries_window",
            "Runs recovered from a dead worker in the window",
            label,
            len(recoveries),
        )


def _failures_and_recoveries(since) -> tuple[int, list[float], list[float]]:
    """Failed commits, recovery times and work lost (seconds) in the window: rare rows, read
    whole."""
    from durability.models import Event, EventKind

    rows = Event.objects.filter(
        created_at__gte=since, kind__in=(EventKind.COMMIT_FAILED, EventKind.RECOVERED)
    ).values_list("kind", "data")
    failures = 0
    recoveries, work_lost = [], []
    for kind, data in rows:
        if kind == EventKind.COMMIT_FAILED and data:
            failures += int(orjson.loads(data).get("failed_commits", 1))
        elif kind == EventKind.RECOVERED and data:
            figures = orjson.loads(data)
            if figures.get("recovery_ms") is not None:
                recoveries.append(figures["recovery_ms"] / 1000)
            if figures.get("work_lost_ms") is not None:
                work_lost.append(figures["work_lost_ms"] / 1000)
    return failures, recoveries, work_lost


def _gauge(name: str, help_text: str, label: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=["window"])
    family.add_metric(label, value)
    return family


def _commit_figures(since) -> tuple[int, dict[float, float]]:
    """Commits in the window and their latency quantiles, aggregated by the database where it
    can (a busy window holds hundreds of thousands of commits)."""
    return store().commit_figures(since, QUANTILES)


_cache_lock = threading.Lock()
_cached: tuple[float, bytes] | None = None


def _render() -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DurabilityCollector(conf.METRICS_WINDOW_SECONDS))
    connection.ensure_connection()
    return generate_latest(registry)


def metrics_view(request: HttpRequest) -> HttpResponse:
    global _cached
    token = conf.METRICS_TOKEN
    if token:
        sent = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(sent.encode(), token.encode()):
            return HttpResponse(
                "a valid bearer token is required\n", status=401, content_type="text/plain"
            )
    keep = conf.METRICS_CACHE_SECONDS
    if keep <= 0:
        body = _render()
    else:
        # One scrape computes; those arriving meanwhile wait for it and share its answer.
        with _cache_lock:
            now = time.monotonic()
            if _cached is None or now - _cached[0] >= keep:
                _cached = (now, _render())
            body = _cached[1]
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
