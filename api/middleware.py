"""Refusals the API's own handlers never see, in the API's format: a path under
``/api/v1/`` that names nothing (Django's URL resolver answers it, with the dashboard's page)
and a method an endpoint does not take (django-ninja answers it, in HTML)."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from api import problems

PREFIX = "/api/v1/"


def problem_replies(get_response: Callable[[HttpRequest], HttpResponse]):
    def middleware(request: HttpRequest) -> HttpResponse:
        reply = get_response(request)
        if not request.path.startswith(PREFIX) or reply.status_code not in (404, 405):
            return reply
        if reply.get("Content-Type", "").startswith(problems.MEDIA_TYPE):
            return reply
        if reply.status_code == 404:
            return problems.response(
                404, "API404", f"no such endpoint: {request.path} (see {PREFIX}docs)"
            )
        allowed = reply.get("Allow", "")
        return problems.response(
            405,
            "API405",
            f"{request.method} is not an action of {request.path}; it takes {allowed or 'none'}",
            headers={"Allow": allowed} if allowed else None,
        )

    return middleware
