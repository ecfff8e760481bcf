"""Reading what happened: a run's timeline (its events, in pages) and the durability SLO
figures (the same as the SLO page), per window and per agent."""

from __future__ import annotations

from typing import Literal

import orjson
from django.http import HttpRequest
from ninja import Query, Router

from api import common
from api.runs import READ
from api.schemas import EventPage, SloOut, SloPerAgentOut
from durability import operations, slo
from durability.models import Event
from durability.redact import redact

router = Router(tags=["observe"])
Window = Literal["1h", "24h", "7d"]


def _data(text: str):
    if not text:
        return None
    try:
        value, _ = redact(orjson.loads(text))
    except orjson.JSONDecodeError:
        return text
    return value


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
            "data": _data(e.data),
            "created_at": e.created_at,
        }
        for e in page
    ]
    return {"items": items, "next_cursor": str(page[-1].id) if page and more else None}


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
