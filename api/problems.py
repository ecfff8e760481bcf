"""Errors as RFC 9457 problem details (``application/problem+json``): the engine's error
code, a sentence saying what was wrong and what to do, and the field at fault.

Every refusal here happened before anything was written (the engine validates first and
refuses with a coded error that changed nothing), so a client may correct and retry."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import InterfaceError, OperationalError
from django.http import Http404, HttpRequest, HttpResponse
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.parser import Parser

from durability.errors import (
    AlreadyDecided,
    DatabaseUnavailable,
    DurabilityError,
    IdempotencyConflict,
    IntegrityViolation,
    InvalidTransition,
    NotAllowed,
    UnknownApproval,
    UnknownCheckpoint,
    UnknownEffect,
    UnknownRun,
)

MEDIA_TYPE = "application/problem+json"
log = logging.getLogger(__name__)

# Most specific first: the first class an error is an instance of gives its status.
STATUS: list[tuple[type[DurabilityError], int]] = [
    (NotAllowed, 403),
    (UnknownRun, 404),
    (UnknownCheckpoint, 404),
    (UnknownApproval, 404),
    (UnknownEffect, 404),
    (IdempotencyConflict, 409),
    (AlreadyDecided, 409),
    (InvalidTransition, 409),  # Stale included: the run moved on since the caller saw it
    (IntegrityViolation, 409),
    (DatabaseUnavailable, 503),
]

TITLES = {
    400: "Bad request",
    401: "Not signed in",
    403: "Not allowed",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    413: "Body too large",
    415: "Not JSON",
    422: "Invalid input",
    429: "Too many requests",
    500: "Engine error",
    503: "Unavailable",
}


class Problem(Exception):
    """A refusal the API makes itself (not the engine): status, code, sentence, field."""

    def __init__(
        self, status: int, code: str, detail: str, *, field: str = "", headers=None
    ) -> None:
        self.status = status
        self.code = code
        self.detail = detail
        self.field = field
        self.headers = headers or {}
        super().__init__(detail)


def response(
    status: int,
    code: str,
    detail: str,
    *,
    field: str = "",
    run_id: Any = None,
    headers: dict[str, str] | None = None,
) -> HttpResponse:
    body: dict[str, Any] = {
        "type": f"about:blank#{code}",
        "title": TITLES.get(status, "Error"),
        "status": status,
        "code": code,
        "detail": detail,
    }
    if field:
        body["field"] = field
    if run_id:
        body["run_id"] = str(run_id)
    reply = HttpResponse(orjson.dumps(body), status=status, content_type=MEDIA_TYPE)
    for name, value in (headers or {}).items():
        reply[name] = value
    if status == 401:
        reply["WWW-Authenticate"] = 'Bearer realm="api"'
    return reply


def status_of(exc: DurabilityError) -> int:
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 422 if exc.code.startswith(("DUR1", "API1")) else 500


def from_engine(request: HttpRequest, exc: DurabilityError) -> HttpResponse:
    return response(
        status_of(exc),
        exc.code,
        exc.message,
        field=exc.field,
        run_id=exc.run_id,
    )


def from_problem(request: HttpRequest, exc: Problem) -> HttpResponse:
    return response(exc.status, exc.code, exc.detail, field=exc.field, headers=exc.headers)


def _field_of(error: dict[str, Any]) -> str:
    # ("body", "payload", "input") -> "input"; ("query", "limit") -> "limit";
    # ("header", "if-match") -> "If-Match".
    loc = [str(part) for part in error.get("loc", ())]
    if loc and loc[0] == "header":
        return "-".join(p.capitalize() for p in loc[-1].split("-"))
    if loc and loc[0] == "body":
        # ("body", <the parameter's name>, field, ...): the field inside the request body.
        parts = loc[2:] if len(loc) > 2 else []
    else:
        parts = loc[1:] if loc and loc[0] in ("query", "path") else loc
    return ".".join(parts)


def from_validation(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    first = exc.errors[0] if exc.errors else {}
    field = _field_of(first)
    if first.get("type") == "extra_forbidden":
        # A misspelt name is the likely cause: ignoring it would do something else than asked.
        detail = f"unknown field {field!r}: nothing was done; see the OpenAPI document's schema"
        return response(422, "API422", detail, field=field)
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "missing" and len(loc) == 2 and loc[0] == "body":
        detail = (
            "this request needs a JSON object as its body ({} takes every field's default);"
            " nothing was done"
        )
        return response(422, "API422", detail)
    message = str(first.get("msg", "invalid input"))
    detail = f"{field}: {message}" if field else message
    return response(422, "API422", detail, field=field)


class JsonBody(Parser):
    """A request body is a JSON object sent as JSON: another media type (a form, plain
    text) is refused rather than read as JSON by chance, and so is a list or a number,
    with a sentence saying which (``from_http`` answers with the ``Problem`` raised here)."""

    def parse_body(self, request: HttpRequest) -> dict[str, Any]:
        media = request.content_type or ""
        if media != "application/json" and not media.endswith("+json"):
            raise Problem(
                415,
                "API415",
                f"the body must be JSON, sent with Content-Type: application/json (it came"
                f" as {media or 'no content type'}); nothing was done",
                field="Content-Type",
            )
        try:
            data = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            raise Problem(400, "API400", f"the body is not JSON ({exc}); nothing was done") from exc
        if not isinstance(data, dict):
            raise Problem(
                422,
                "API422",
                f"the body must be a JSON object of named fields, not {_json_kind(data)};"
                " nothing was done",
            )
        return data


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool) or value is None:
        return orjson.dumps(value).decode()
    return "a number"


def body_limit() -> int:
    """The largest request body read, in bytes (Django's ``DATA_UPLOAD_MAX_MEMORY_SIZE``)."""
    return int(settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 0)


def from_too_big(request: HttpRequest, exc: RequestDataTooBig) -> HttpResponse:
    return response(
        413,
        "API413",
        f"the body is larger than this server reads ({body_limit():,} bytes); nothing was done",
    )


def from_auth(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return response(
        401,
        "API401",
        "This API needs a personal API token: send it as “Authorization: Bearer <token>”."
        " The token given (if any) is unknown, revoked or expired.",
        field="Authorization",
    )


def from_http(request: HttpRequest, exc: HttpError) -> HttpResponse:
    if isinstance(exc.__cause__, Problem):  # the body refused by ``JsonBody``
        return from_problem(request, exc.__cause__)
    if isinstance(exc.__cause__, RequestDataTooBig):
        return from_too_big(request, exc.__cause__)
    return response(exc.status_code, f"API{exc.status_code}", str(exc))


def from_404(request: HttpRequest, exc: Http404) -> HttpResponse:
    return response(404, "API404", "no such resource")


def from_unexpected(request: HttpRequest, exc: Exception) -> HttpResponse:
    """A bug, not the caller's fault: logged whole, and answered in the format every other
    reply has, without the traceback (it may quote data the caller may not see)."""
    log.exception("API %s %s failed", request.method, request.path)
    return response(
        500,
        "API500",
        "The server failed to answer this request; nothing is known to have changed, but check"
        " before retrying an action. The failure is in the server's log.",
    )


def from_database(request: HttpRequest, exc: Exception) -> HttpResponse:
    """The database away or not answering in time: the caller's to retry, not a bug."""
    log.warning("API %s %s: the database did not answer: %s", request.method, request.path, exc)
    return response(
        503,
        "API503",
        "The database cannot be reached or did not answer in time; retry in a moment. An"
        " action retried with the same If-Match or Idempotency-Key happens at most once.",
        headers={"Retry-After": "5"},
    )


def install(api: Any) -> None:
    api.add_exception_handler(Exception, from_unexpected)
    api.add_exception_handler(OperationalError, from_database)
    api.add_exception_handler(InterfaceError, from_database)
    api.add_exception_handler(DurabilityError, from_engine)
    api.add_exception_handler(Problem, from_problem)
    api.add_exception_handler(ValidationError, from_validation)
    api.add_exception_handler(AuthenticationError, from_auth)
    api.add_exception_handler(HttpError, from_http)
    api.add_exception_handler(Http404, from_404)
    api.add_exception_handler(RequestDataTooBig, from_too_big)
