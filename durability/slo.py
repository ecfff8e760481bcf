"""Durability SLOs computed from the event timeline and the run, effect and approval rows.

Each indicator is measured over a window (1 h, 24 h, 7 d), optionally for one agent, and set
against a target from settings (``DURABILITY_SLO_*``) with the error budget left:

- ratios (commit success, run success): the budget is the share of events allowed to be bad,
  ``total * (1 - target)``; what is left is ``1 - bad / allowed``;
- percentiles (commit latency p99, recovery time p95, work lost p95, approval wait p95): a p95
  under a threshold allows 5 % of events above it, a p99 1 %; the budget is counted the same
  way over the events above the threshold;
- effects in doubt: a ceiling on the number in doubt right now.

Percentiles interpolate linearly between ranks, like PostgreSQL's ``percentile_cont``, which
computes them in the database for commit latency (the one high-volume series); the other
series are small and computed here, which also serves SQLite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone

from durability import canonical
from durability.conf import conf
from durability.models import (
    Approval,
    ApprovalStatus,
    Effect,
    EffectStatus,
    Event,
    EventKind,
    Run,
    RunStatus,
)
from durability.store import store

WINDOWS: dict[str, timedelta] = {
    "1h": timedelta(hours=1),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
}
BUCKETS = 24


def targets() -> dict[str, float]:
    """Each indicator's target (``DURABILITY_SLO_*``, declared in durability/conf.py)."""
    return {
        # Share of checkpoint commits that succeed at the first attempt.
        "commit_success": conf.SLO_COMMIT_SUCCESS,
        # 99th percentile of checkpoint commit latency, in milliseconds.
        "commit_latency_p99_ms": conf.SLO_COMMIT_P99_MS,
        # 95th percentile of recovery time (lost lease to resumed), in seconds.
        "recovery_p95_s": conf.SLO_RECOVERY_P95_S,
        # 95th percentile of work lost per recovery (last checkpoint to failure), in seconds.
        "work_lost_p95_s": conf.SLO_WORK_LOST_P95_S,
        # Effects in doubt at any moment.
        "effects_in_doubt_max": conf.SLO_EFFECTS_IN_DOUBT_MAX,
        # 95th percentile of the wait for an approval decision, in minutes.
        "approval_wait_p95_min": conf.SLO_APPROVAL_WAIT_P95_MIN,
        # Share of finished runs (cancelled ones aside) that succeed.
        "run_success": conf.SLO_RUN_SUCCESS,
    }


# --- small maths ------------------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """Linear interpolation between closest ranks (PostgreSQL's percentile_cont)."""
    if not values:
        return None
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = math.ceil(position)
    if low == high:
        return float(ordered[low])
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def budget_left(total: int, bad: int, allowed_fraction: float) -> float | None:
    """Share of the error budget still unspent: 1 untouched, 0 spent, below 0 overspent."""
    if total == 0:
        return None
    allowed = total * allowed_fraction
    if allowed <= 0:
        return 1.0 if bad == 0 else -float(bad)
    return 1 - bad / allowed


# --- the report ---------------------------------------------------------------------------------


@dataclass
class Indicator:
    key: str
    label: str
    unit: str  # "ratio" | "ms" | "s" | "min" | "count"
    value: float | None
    target: float | None = None
    direction: str = "max"  # "min": the value must stay at or above the target
    total: int = 0
    bad: int = 0
    budget: float | None = None
    series: list[float | None] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None or self.target is None:
            return None
        if self.direction == "min":
            return self.value >= self.target
        return self.value <= self.target


@dataclass
class Recovery:
    run_id: Any
    agent: str
    at: datetime
    worker: str
    recovery_ms: float | None
    work_lost_ms: float | None
    why: str = ""


@dataclass
class Report:
    window: str
    start: datetime
    end: datetime
    agent: str | None
    indicators: list[Indicator]
    recoveries: list[Recovery] = field(default_factory=list)

    def get(self, key: str) -> Indicator:
        return next(i for i in self.indicators if i.key == key)


@dataclass
class Span:
    """The window and its buckets (for sparklines)."""

    start: datetime
    end: datetime
    buckets: int

    @property
    def width(self) -> timedelta:
        return (self.end - self.start) / max(1, self.buckets)

    def edges(self) -> list[tuple[datetime, datetime]]:
        return [
            (self.start + self.width * i, self.start + self.width * (i + 1))
            for i in range(self.buckets)
        ]

    def index(self, when: datetime) -> int | None:
        if not self.buckets or when < self.start or when >= self.end:
            return None
        return min(self.buckets - 1, int((when - self.start) / self.width))


def _events(span: Span, agent: str | None) -> QuerySet[Event]:
    rows = Event.objects.filter(created_at__gte=span.start, created_at__lt=span.end)
    return rows.filter(run__agent=agent) if agent else rows


def _bucketed_counts(rows: QuerySet, field_name: str, span: Span) -> list[int]:
    """One query, one filtered count per bucket."""
    if not span.buckets:
        return []
    aggregates = {
        f"b{i}": Count("pk", filter=Q(**{f"{field_name}__gte": lo, f"{field_name}__lt": hi}))
        for i, (lo, hi) in enumerate(span.edges())
    }
    found = rows.aggregate(**aggregates)
    return [found[f"b{i}"] for i in range(span.buckets)]


def _group(values: Iterable[tuple[datetime, float]], span: Span) -> list[list[float]]:
    groups: list[list[float]] = [[] for _ in range(span.buckets)]
    for when, value in values:
        i = span.index(when)
        if i is not None:
            groups[i].append(value)
    return groups


def report(
    window: str = "24h",
    *,
    agent: str | None = None,
    now: datetime | None = None,
    buckets: int = BUCKETS,
    recoveries: int = 20,
) -> Report:
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {', '.join(WINDOWS)}, not {window!r}")
    end = now or timezone.now()
    span = Span(end - WINDOWS[window], end, buckets)
    goal = targets()
    recovered = _recovered(span, agent)
    indicators = [
        _commit_success(span, agent, goal["commit_success"]),
        _commit_latency(span, agent, goal["commit_latency_p99_ms"]),
        _recovery_time(span, recovered, goal["recovery_p95_s"]),
        _work_lost(span, recovered, goal["work_lost_p95_s"]),
        _duplicates(span, agent),
        _in_doubt(span, agent, goal["effects_in_doubt_max"]),
        _approval_wait(span, agent, goal["approval_wait_p95_min"]),
        _run_success(span, agent, goal["run_success"]),
    ]
    return Report(window, span.start, span.end, agent, indicators, _recent(recovered, recoveries))


def _commit_success(span: Span, agent: str | None, target: float) -> Indicator:
    events = _events(span, agent)
    checkpoints = events.filter(kind=EventKind.CHECKPOINT)
    good = checkpoints.count()
    failures = [
        (e.created_at, float(canonical.loads_object(e.data).get("failed_commits", 1) or 1))
        for e in events.filter(kind=EventKind.COMMIT_FAILED).only("created_at", "data")
    ]
    bad = int(sum(v for _, v in failures))
    total = good + bad
    series: list[float | None] = []
    if span.buckets:
        ok = _bucketed_counts(checkpoints, "created_at", span)
        failed = [sum(g) for g in _group(failures, span)]
        series = [(o / (o + f)) if (o + f) else None for o, f in zip(ok, failed, strict=True)]
    return Indicator(
        "commit_success",
        "Commit success",
        "ratio",
        good / total if total else None,
        target,
        "min",
        total,
        bad,
        budget_left(total, bad, 1 - target),
        series,
        {"commits": good, "failed": bad},
        "checkpoint commits that succeeded at the first attempt",
    )


def _commit_latency(span: Span, agent: str | None, target_ms: float) -> Indicator:
    rows = _events(span, agent).filter(commit_us__isnull=False)
    total, bad, extra, series = store().commit_latency(rows, target_ms, span)
    return Indicator(
        "commit_latency",
        "Commit latency p99",
        "ms",
        extra["p99"],
        target_ms,
        "max",
        total,
        bad,
        budget_left(total, bad, 0.01),
        series,
        extra,
        "time to commit one checkpoint (fenced update, checkpoint, mutations, events),"
        " from sending it to the worker seeing the answer",
    )


def _recovered(span: Span, agent: str | None) -> list[tuple[Event, dict]]:
    rows = _events(span, agent).filter(kind=EventKind.RECOVERED).select_related("run")
    return [(e, canonical.loads_object(e.data)) for e in rows.order_by("id")]


def _timing(
    key: str,
    label: str,
    span: Span,
    recovered: list[tuple[Event, dict]],
    field_name: str,
    target_s: float,
    note: str,
) -> Indicator:
    pairs = [
        (e.created_at, float(d[field_name]) / 1000)
        for e, d in recovered
        if isinstance(d.get(field_name), int | float)
    ]
    values = [v for _, v in pairs]
    bad = sum(1 for v in values if v > target_s)
    series = [max(g) if g else None for g in _group(pairs, span)] if span.buckets else []
    return Indicator(
        key,
        label,
        "s",
        percentile(values, 0.95),
        target_s,
        "max",
        len(values),
        bad,
        budget_left(len(values), bad, 0.05),
        series,
        {
            "count": len(recovered),
            "p50": percentile(values, 0.5),
            "max": max(values) if values else None,
        },
        note,
    )


def _recovery_time(span: Span, recovered: list, target_s: float) -> Indicator:
    return _timing(
        "recovery_time",
        "Recovery time p95 (RTO)",
        span,
        recovered,
        "recovery_ms",
        target_s,
        "from a worker's failure (found gone, or its last sign of life when its lease"
        " expired) to another worker resuming the run",
    )


def _work_lost(span: Span, recovered: list, target_s: float) -> Indicator:
    return _timing(
        "work_lost",
        "Work lost p95 (RPO)",
        span,
        recovered,
        "work_lost_ms",
        target_s,
        "from the last checkpoint to the failure: the work a recovery redid",
    )


def _duplicates(span: Span, agent: str | None) -> Indicator:
    rows = Effect.objects.filter(created_at__gte=span.start, created_at__lt=span.end)
    if agent:
        rows = rows.filter(run__agent=agent)
    prevented = rows.filter(duplicates_prevented__gt=0)
    total = prevented.aggregate(n=Sum("duplicates_prevented"))["n"] or 0
    series: list[float | None] = []
    if span.buckets:
        pairs = [
            (at, float(n)) for at, n in prevented.values_list("created_at", "duplicates_prevented")
        ]
        series = [float(sum(g)) for g in _group(pairs, span)]
    return Indicator(
        "duplicates_prevented",
        "Duplicate effects prevented",
        "count",
        float(total),
        None,
        "max",
        rows.count(),
        0,
        None,
        series,
        {"effects": rows.count()},
        "re-runs that found an effect already done and returned its result instead",
    )


def _in_doubt(span: Span, agent: str | None, ceiling: float) -> Indicator:
    now_rows = Effect.objects.filter(status=EffectStatus.IN_DOUBT)
    if agent:
        now_rows = now_rows.filter(run__agent=agent)
    current = now_rows.count()
    entered = _events(span, agent).filter(kind=EventKind.EFFECT_IN_DOUBT)
    series: list[float | None] = [float(n) for n in _bucketed_counts(entered, "created_at", span)]
    return Indicator(
        "effects_in_doubt",
        "Effects in doubt",
        "count",
        float(current),
        float(ceiling),
        "max",
        current,
        max(0, current - int(ceiling)),
        None,
        series,
        {"entered": entered.count()},
        "effects whose outcome is unknown, waiting for an operator (now)",
    )


def _approval_wait(span: Span, agent: str | None, target_min: float) -> Indicator:
    decided = Approval.objects.filter(
        decided_at__gte=span.start,
        decided_at__lt=span.end,
        status__in=(ApprovalStatus.APPROVED, ApprovalStatus.REJECTED),
    )
    pending = Approval.objects.filter(status=ApprovalStatus.PENDING)
    if agent:
        decided = decided.filter(run__agent=agent)
        pending = pending.filter(run__agent=agent)
    pairs = [
        (done, (done - asked).total_seconds() / 60)
        for asked, done in decided.values_list("requested_at", "decided_at")
        if done is not None  # always: the query asks for a decided_at in the span
    ]
    waits = [v for _, v in pairs]
    # A pending approval already older than the target has missed it, decided or not.
    overdue = [
        (span.end - asked).total_seconds() / 60
        for asked in pending.values_list("requested_at", flat=True)
        if (span.end - asked).total_seconds() / 60 > target_min
    ]
    oldest = pending.order_by("requested_at").values_list("requested_at", flat=True).first()
    bad = sum(1 for v in waits if v > target_min) + len(overdue)
    total = len(waits) + len(overdue)
    series = [percentile(g, 0.95) for g in _group(pairs, span)] if span.buckets else []
    return Indicator(
        "approval_wait",
        "Approval wait p95",
        "min",
        percentile(waits, 0.95),
        target_min,
        "max",
        total,
        bad,
        budget_left(total, bad, 0.05),
        series,
        {
            "decided": len(waits),
            "p50": percentile(waits, 0.5),
            "pending": pending.count(),
            "oldest_pending_min": (span.end - oldest).total_seconds() / 60 if oldest else None,
        },
        "from an approval being asked to its decision",
    )


def _run_success(span: Span, agent: str | None, target: float) -> Indicator:
    rows = Run.objects.filter(
        finished_at__gte=span.start,
        finished_at__lt=span.end,
        status__in=(RunStatus.SUCCEEDED, RunStatus.FAILED),
    )
    if agent:
        rows = rows.filter(agent=agent)
    succeeded = rows.filter(status=RunStatus.SUCCEEDED)
    good, total = succeeded.count(), rows.count()
    series: list[float | None] = []
    if span.buckets:
        all_ = _bucketed_counts(rows, "finished_at", span)
        ok = _bucketed_counts(succeeded, "finished_at", span)
        series = [(o / a) if a else None for o, a in zip(ok, all_, strict=True)]
    return Indicator(
        "run_success",
        "Run success",
        "ratio",
        good / total if total else None,
        target,
        "min",
        total,
        total - good,
        budget_left(total, total - good, 1 - target),
        series,
        {"succeeded": good, "failed": total - good},
        "finished runs that succeeded (cancelled runs are an operator's choice, not counted)",
    )


def _recent(recovered: list[tuple[Event, dict]], limit: int) -> list[Recovery]:
    found = []
    for event, data in reversed(recovered[-limit:] if limit else []):
        found.append(
            Recovery(
                event.run_id,
                event.run.agent,
                event.created_at,
                event.worker,
                data.get("recovery_ms"),
                data.get("work_lost_ms"),
                _why(event),
            )
        )
    return found


def _why(recovered: Event) -> str:
    """What was lost: the sweeper's verdict when it declared the lease dead, or else the
    worker whose lease the new claim took over (a dead process is noticed at claim time)."""
    before = Event.objects.filter(run_id=recovered.run_id, id__lt=recovered.id)
    claims = list(before.filter(kind=EventKind.CLAIMED).order_by("-id").only("id", "worker")[:2])
    # The newest claim is the recovering one (written with this event); the one before it
    # is the attempt that was lost.
    lost_claim = claims[1] if len(claims) > 1 else None
    verdicts = before.filter(kind=EventKind.LEASE_LOST)
    if lost_claim is not None:
        verdicts = verdicts.filter(id__gt=lost_claim.id)
    verdict = verdicts.order_by("-id").only("reason", "worker").first()
    if verdict is not None:
        return f"{verdict.worker}: {verdict.reason}" if verdict.worker else verdict.reason
    how = str(canonical.loads_object(recovered.data).get("why") or "its lease was taken over")
    if lost_claim is not None and lost_claim.worker:
        return f"{lost_claim.worker}: {how}"
    return how


# --- per agent ----------------------------------------------------------------------------------


@dataclass
class AgentRow:
    agent: str
    indicators: dict[str, Indicator]


def per_agent(window: str = "24h", *, now: datetime | None = None) -> list[AgentRow]:
    """The same indicators for each agent with activity in the window (no sparklines)."""
    end = now or timezone.now()
    start = end - WINDOWS[window]
    agents = sorted(
        set(Run.objects.filter(updated_at__gte=start).values_list("agent", flat=True).distinct())
        | set(
            Run.objects.filter(status__in=(RunStatus.WAITING, RunStatus.RUNNING, RunStatus.QUEUED))
            .values_list("agent", flat=True)
            .distinct()
        )
    )
    rows = []
    for name in agents:
        result = report(window, agent=name, now=end, buckets=0, recoveries=0)
        rows.append(AgentRow(name, {i.key: i for i in result.indicators}))
    return rows
