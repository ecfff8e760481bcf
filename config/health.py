"""``/healthz`` for load balancers."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, HttpResponse


def health_view(request: HttpRequest) -> HttpResponse:
    """For load balancers: 200 when the database answers, 503 when it does not."""
    try:
        with connection.cursor() as cur:
            cur.execute("SELECT 1")
    except Exception as exc:  # any failure to reach the database is "unhealthy"
        return HttpResponse(
            f"database unreachable: {type(exc).__name__}\n", status=503, content_type="text/plain"
        )
    return HttpResponse("ok\n", content_type="text/plain")
