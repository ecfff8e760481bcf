"""Runs: list, one, start, resume, cancel, send a message. Every action goes through the
engine's operation (``durability.operations``), which re-checks under the run's lock."""

from __future__ import annotations

import uuid
from datetime import datetime

from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from ninja import Header, Query, Router, Status

from api import common, present, schemas
from api.schemas import (
    ActIn,
    MessageIn,
    MessageOut,
    ProblemOut,
    RunDetailOut,
    RunPage,
    StartIn,
)
from durability import operations
from durability.errors import (
    DurabilityError,
    IdempotencyConflict,
    InvalidInput,
    SchemaViolation,
    StateNotJSON,
    StateTooLarge,
    UnknownAgent,
)
from durability.models import Run, RunStatus

router = Router(tags=["runs"])

# The request field each engine refusal of these actions is about (``common.fields``).
START_FIELDS: dict[type[DurabilityError], str] = {
    UnknownAgent: "agent",
    SchemaViolation: "input",
    StateNotJSON: "input",
    StateTooLarge: "input",
    IdempotencyConflict: "Idempotency-Key",
    InvalidInput: "durability",  # the one plain refusal left once the key's length is checked
}
SEND_FIELDS: dict[type[DurabilityError], str] = {
    IdempotencyConflict: "Idempotency-Key",
    StateNotJSON: "data",
    StateTooLarge: "data",
}

READ = {401: ProblemOut, 403: ProblemOut, 404: ProblemOut, 422: ProblemOut, 429: ProblemOut}
# 400: a body that is not JSON at all (one that is JSON but not of the schema is a 422).
ACT = {**READ, 400: ProblemOut, 409: ProblemOut}


@router.get("/runs", response={200: RunPage, **READ}, summary="List runs, newest first")
def list_runs(
    request: HttpRequest,
    agent: str | None = Query(None, max_length=200),
    status: schemas.RunState | None = None,
    outcome: str | None = Query(None, max_length=120),
    since: datetime | None = Query(
        None, description="created at or after (ISO 8601; without an offset: UTC)"
    ),
    q: str | None = Query(None, max_length=200, description="a run id prefix, or input text"),
    recovered: bool | None = Query(
        None, description="true: only runs resumed elsewhere after their worker died"
    ),
    waiting_for: schemas.WaitingFor | None = Query(
        None, description="only waiting runs that wait for this (as a run's waiting_for says)"
    ),
    cursor: str | None = Query(None, max_length=200),
    limit: int = Query(50, ge=1, le=200),
):
    common.reader(request)
    runs = Run.objects.all()
    if recovered is not None:
        runs = runs.filter(recoveries__gt=0) if recovered else runs.filter(recoveries=0)
    if agent:
        runs = runs.filter(agent=agent)
    if status:
        runs = runs.filter(status=status)
    if waiting_for:
        runs = runs.filter(status=RunStatus.WAITING, wait_reason=waiting_for)
    if outcome:
        runs = runs.filter(outcome=outcome, status=RunStatus.SUCCEEDED)
    if since is not None:
        runs = runs.filter(created_at__gte=common.instant(since, "since"))
    if q:
        runs = runs.filter(_search(q.strip()))
    after = common.decode_cursor(cursor)
    if after is not None:
        at, ident = after
        runs = runs.filter(Q(created_at__lt=at) | Q(created_at=at, id__lt=ident))
    page = list(runs.order_by("-created_at", "-id")[: limit + 1])
    more = len(page) > limit
    page = page[:limit]
    last = page[-1] if page and more else None
    return {
        "items": [present.run(r) for r in page],
        "next_cursor": common.encode_cursor(last.created_at, last.id) if last else None,
    }


def _search(text: str) -> Q:
    """A run id prefix walks the primary key (as a range of UUIDs); other text is looked
    for in the runs' input."""
    hexed = text.lower().replace("-", "")
    if 4 <= len(hexed) <= 32 and all(c in "0123456789abcdef" for c in hexed):
        shift = 4 * (32 - len(hexed))
        low, high = int(hexed, 16) << shift, (int(hexed, 16) + 1) << shift
        by_id = Q(id__gte=uuid.UUID(int=low))
        if high < 1 << 128:
            by_id &= Q(id__lt=uuid.UUID(int=high))
        return by_id | Q(input__icontains=text)
    return Q(input__icontains=text)


@router.get("/runs/{run_id}", response={200: RunDetailOut, **READ}, summary="One run")
def get_run(request: HttpRequest, run_id: str, response: HttpResponse):
    common.reader(request)
    run = operations.get_run(run_id[:64])
    response["ETag"] = common.etag(run.lease_token)
    return present.run_detail(run)


@router.post("/runs", response={200: RunDetailOut, 201: RunDetailOut, **ACT}, summary="Start")
def start_run(
    request: HttpRequest,
    body: StartIn,
    response: HttpResponse,
    idempotency_key: str | None = Header(None, alias="Idempotency-Key", max_length=255),
):
    """Start a run. With an ``Idempotency-Key``, a retry returns the run that key started
    (200); the same key with another agent or input is refused (409, DUR115)."""
    key = common.idempotency_key(idempotency_key)
    with common.acting_as(request) as by, common.fields(START_FIELDS):
        run, made = operations.started(
            body.agent,
            body.input,
            by=by,
            reason=body.reason,
            idempotency_key=key,
            durability=body.durability or None,
        )
    response["ETag"] = common.etag(run.lease_token)
    response["Location"] = f"{request.path.rstrip('/')}/{run.id}"
    return Status(201 if made else 200, present.run_detail(run))


def _acted(response: HttpResponse, run: Run):
    run.refresh_from_db()
    response["ETag"] = common.etag(run.lease_token)
    return present.run_detail(run)


@router.post("/runs/{run_id}/resume", response={200: RunDetailOut, **ACT}, summary="Resume")
def resume_run(
    request: HttpRequest,
    run_id: str,
    body: ActIn,
    response: HttpResponse,
    if_match: str | None = Header(None, alias="If-Match", max_length=40),
):
    """Queue a failed, cancelled or held run again from its head checkpoint. With
    ``If-Match`` (the run's ``ETag``) or ``expected_status``, refused (409, DUR112) if the
    run moved on."""
    version = common.expected_version(if_match)
    with common.acting_as(request) as by:
        run = operations.resume(
            run_id[:64],
            by=by,
            reason=body.reason,
            expected_status=body.expected_status,
            expected_version=version,
        )
    return _acted(response, run)


@router.post("/runs/{run_id}/cancel", response={200: RunDetailOut, **ACT}, summary="Cancel")
def cancel_run(
    request: HttpRequest,
    run_id: str,
    body: ActIn,
    response: HttpResponse,
    if_match: str | None = Header(None, alias="If-Match", max_length=40),
):
    """Stop a run for good, with its unfinished child runs. With ``If-Match`` or
    ``expected_status``, refused (409, DUR112) if the run moved on."""
    version = common.expected_version(if_match)
    with common.acting_as(request) as by:
        run = operations.cancel(
            run_id[:64],
            by=by,
            reason=body.reason,
            expected_status=body.expected_status,
            expected_version=version,
        )
    return _acted(response, run)


@router.post(
    "/runs/{run_id}/messages", response={200: MessageOut, 201: MessageOut, **ACT}, summary="Send"
)
def send_message(
    request: HttpRequest,
    run_id: str,
    body: MessageIn,
    response: HttpResponse,
    idempotency_key: str | None = Header(None, alias="Idempotency-Key", max_length=255),
    if_match: str | None = Header(None, alias="If-Match", max_length=40),
):
    """Deliver a message to a run (taken by ``ctx.wait_for(name)``). A retry with the same
    ``Idempotency-Key`` is delivered once (200); the key with another message is refused
    (409, DUR115)."""
    key = common.idempotency_key(idempotency_key)
    version = common.expected_version(if_match)
    with common.acting_as(request) as by, common.fields(SEND_FIELDS):
        run = operations.get_run(run_id[:64])
        message, made = operations.delivered(
            run.id,
            body.name,
            body.data,
            idempotency_key=key,
            by=by,
            reason=body.reason,
            expected_version=version,
        )
    return Status(201 if made else 200, present.message(message))
