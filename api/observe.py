"""Reading what happened: a run's timeline (its events, in pages) and the durability SLO
figures (the same as the SLO page), per window and per agent."""

from __future__ import annotations

from typing import Literal

from django.http import HttpRequest
from ninja import Query, Router

from api import common
from api.runs import READ
from api.schemas import CallPage, EffectPage, EventPage, SloOut, SloPerAgentOut
from durability import events, operations, shapes, slo
from durability.models import Effect, Event, JournalEntry

router = Router(tags=["observe"])
Window = Literal["1h", "24h", "7d"]


@router.get("/runs/{run_id}/timeline", response={200: EventPage, **READ}, summary="Timeline")
def timeline(
    request: HttpRequest,
    run_id: str,
    cursor: int | None = Query(None, ge=1, le=2**62, description="from next_cursor"),
    limit: int = Query(100, ge=1, le=500),
):
    """The run's events (started, steps, checkpoints, calls' retries, leases, recoveries,
    approvals, operator actions), newest first."""
    common.reader(request)
    run = operations.get_run(run_id[:64])
    rows = Event.objects.filter(run=run)
    if cursor is not None:
        rows = rows.filter(id__lt=cursor)
    page = list(rows.order_by("-id")[: limit + 1])
    more = len(page) > limit
    page = page[:limit]
    items = [
        {
            "id": e.id,
            "kind": e.kind,
            "seq": e.seq,
            "step": e.step,
            "actor": e.actor,
            "reason": e.reason,
            "worker": e.worker,
            "data": shapes.document(e.data),
            "created_at": e.created_at,
        }
        for e in page
    ]
    return {"items": items, "next_cursor": str(page[-1].id) if page and more else None}


def _page(rows, cursor: int | None, limit: int, shape) -> dict:
    if cursor is not None:
        rows = rows.filter(id__lt=cursor)
    page = list(rows.order_by("-id")[: limit + 1])
    more = len(page) > limit
    page = page[:limit]
    return {
        "items": [shape(row) for row in page],
        "next_cursor": str(page[-1].id) if page and more else None,
    }


@router.get("/runs/{run_id}/effects", response={200: EffectPage, **READ}, summary="Effects")
def effects(
    request: HttpRequest,
    run_id: str,
    cursor: int | None = Query(None, ge=1, le=2**62, description="from next_cursor"),
    limit: int = Query(100, ge=1, le=500),
):
    """The run's effects, newest first: status (done, in doubt, ...), arguments and
    outcome (secrets redacted); an effect in doubt is resolved by its ``id``."""
    common.reader(request)
    run = operations.get_run(run_id[:64])
    return _page(Effect.objects.filter(run=run), cursor, limit, shapes.effect)


@router.get("/runs/{run_id}/calls", response={200: CallPage, **READ}, summary="Calls")
def calls(
    request: HttpRequest,
    run_id: str,
    cursor: int | None = Query(None, ge=1, le=2**62, description="from next_cursor"),
    limit: int = Query(100, ge=1, le=500),
):
    """The run's journaled calls (LLM and tool results), newest first, secrets redacted."""
    common.reader(request)
    run = operations.get_run(run_id[:64])
    replays = events.replay_counts(run.pk)

    def shape(j: JournalEntry) -> dict:
        return {
            "id": j.id,
            "key": j.key,
            "occurrence": j.occurrence,
            "kind": j.kind,
            "step": j.step,
            "function": j.function,
            "result": shapes.document(j.result),
            "duration_ms": j.duration_ms,
            "replays": replays[j.id],
            "reused_from": j.reused_from,
            "created_at": j.created_at,
        }

    return _page(JournalEntry.objects.filter(run=run), cursor, limit, shape)


def _indicators(indicators) -> list[dict]:
    return [
        {
            "key": i.key,
            "label": i.label,
            "unit": i.unit,
            "value": i.value,
            "target": i.target,
            "met": i.met,
            "total": i.total,
            "bad": i.bad,
            "budget": i.budget,
        }
        for i in indicators
    ]


@router.get("/slo", response={200: SloOut, **READ}, summary="SLO figures")
def slo_report(
    request: HttpRequest,
    window: Window = "24h",
    agent: str | None = Query(None, max_length=200),
):
    common.reader(request)
    report = slo.report(window, agent=agent or None, buckets=0, recoveries=0)
    return {
        "window": report.window,
        "agent": report.agent,
        "start": report.start,
        "end": report.end,
        "indicators": _indicators(report.indicators),
    }


@router.get("/slo/agents", response={200: SloPerAgentOut, **READ}, summary="SLOs per agent")
def slo_per_agent(request: HttpRequest, window: Window = "24h"):
    common.reader(request)
    rows = slo.per_agent(window)
    return {"window": window, "agents": {r.agent: _indicators(r.indicators.values()) for r in rows}}
