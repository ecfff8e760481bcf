"""Login for every dashboard page, htmx-aware; no NUL character in any parameter; and a
page that says what was wrong with a request (a parameter, something not found) instead of
a bare status.

Applied per view (dashboard/urls.py wraps every pattern) rather than as a global middleware, so
endpoints that other apps expose for machines (a metrics scrape, a health check) are not
sent to a sign-in page."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import resolve_url
from django_htmx.http import HttpResponseClientRedirect


def login_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Like Django's, except that an htmx request (a poll, a panel) whose session expired
    sends the whole page to the sign-in form instead of swapping the form into a fragment."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.user.is_authenticated:
            return view(request, *args, **kwargs)
        htmx = getattr(request, "htmx", None)
        here = (htmx.current_url_abs_path if htmx else None) or request.get_full_path()
        response = redirect_to_login(here, resolve_url(settings.LOGIN_URL))
        if htmx:
            return HttpResponseClientRedirect(response["Location"])
        return response

    return wrapper


def no_nul(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """A NUL character in a filter or a form field cannot be stored or compared by
    PostgreSQL (a text value may not hold one): refused with a 400 that names the field,
    instead of the database error it would otherwise become."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        for where, params in (("query", request.GET), ("form", request.POST)):
            for name, values in params.lists():
                if "\x00" in name or any("\x00" in v for v in values):
                    from dashboard.views.common import page

                    shown = name.replace("\x00", "\\0")[:100]
                    context = {
                        "title": "Bad request",
                        "message": f"the {where} parameter “{shown}” holds a NUL character.",
                    }
                    return page(
                        request, "dashboard/error.html", context, fragment="message", status=400
                    )
        return view(request, *args, **kwargs)

    return wrapper


def answered(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """A parameter the view refused (400) or something it did not find (404) answered with
    the sentence that says which, on the dashboard's own page (Django's bare 404 page would
    not say what was missing)."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        from dashboard.params import BadParameter
        from dashboard.views.common import page

        try:
            response = view(request, *args, **kwargs)
        except BadParameter as exc:
            title, message, status = "Bad request", str(exc), 400
        except Http404 as exc:
            title, message, status = "Not found", str(exc) or "nothing at this address", 404
        else:
            if response.status_code != 405 or response.content:
                return response
            # Django's method check answers with an empty body: say which methods it takes.
            allowed = response["Allow"]
            title, message, status = (
                "Method not allowed",
                f"this address takes {allowed.replace(', ', ' or ')}, not {request.method}",
                405,
            )
            answer = page(
                request,
                "dashboard/error.html",
                {"title": title, "message": message + "."},
                fragment="message",
                status=status,
            )
            answer["Allow"] = allowed
            return answer
        context = {"title": title, "message": message.rstrip(".") + "."}
        return page(request, "dashboard/error.html", context, fragment="message", status=status)

    return wrapper
