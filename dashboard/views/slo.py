"""The durability SLO page: tiles against targets, per agent, recent recoveries."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

from dashboard import params, queries
from dashboard.views.common import page
from durability import slo


@require_GET
def slo_page(request: HttpRequest) -> HttpResponse:
    window = params.choice(request.GET, "window", slo.WINDOWS, "24h")
    agent = queries.known_agent(request.GET) or None
    result = slo.report(window, agent=agent)
    context = {
        "nav": "slo",
        "window": window,
        "windows": list(slo.WINDOWS),
        "agent": agent or "",
        "report": result,
        "per_agent": slo.per_agent(window, now=result.end) if agent is None else [],
        "has_data": any(i.total or i.value for i in result.indicators),
    }
    return page(request, "dashboard/slo.html", context, fragment="body")
