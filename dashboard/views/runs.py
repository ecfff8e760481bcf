"""The runs list: counts by status, filters, search, keyset pages, live updates."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

from dashboard import graphruns, queries
from dashboard.views.common import nothing, page
from durability.models import RunStatus


@require_GET
def runs(request: HttpRequest) -> HttpResponse:
    filters = queries.parse_filters(request.GET)
    token = queries.change_token()
    # A poll carries the token its table was rendered at: nothing new, nothing sent.
    if request.GET.get("live") and request.GET["live"] == token:
        return nothing(request)
    cursor = request.GET.get("cursor", "")
    result = queries.page(filters, cursor)
    graphruns.mark_rows(result.rows)
    context = {
        "filters": filters,
        "query": filters.as_query(),
        "result": result,
        "cursor": cursor,
        "token": token,
        "statuses": RunStatus.values,
        # Registered agents, and LangGraph graphs whose runs come from their own process.
        "agents": lambda: sorted(
            {*queries.agents_in_use(), *graphruns.graph_agents(), filters.agent} - {""}
        ),
        # Called by the template only where the filter form is drawn: a poll of the table
        # does not read it.
        "outcomes": lambda: queries.outcomes_in_use(filters.outcome),
        "since_choices": [("", "all time"), *[(k, f"last {k}") for k in queries.SINCE]],
        "filtered": bool(filters.as_query()),
    }
    # The filter form and the poller ask for the table; a poll also refreshes the counts.
    return page(request, "dashboard/runs.html", context, fragment="results")
