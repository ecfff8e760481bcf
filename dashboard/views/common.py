"""What every view shares: choosing the full page or its htmx fragment, and turning the
engine's coded errors into a status and a sentence."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from dashboard.permissions import is_operator, role_of
from durability.errors import (
    AgentDefinitionError,
    AlreadyDecided,
    DurabilityError,
    IntegrityViolation,
    InvalidTransition,
    SecretMissing,
    UnknownApproval,
    UnknownCheckpoint,
    UnknownEffect,
    UnknownRun,
)
from durability.store import store


def wants_fragment(request: HttpRequest) -> bool:
    htmx = getattr(request, "htmx", None)
    return bool(htmx) and not htmx.history_restore_request and not htmx.boosted


def page(
    request: HttpRequest,
    template: str,
    context: dict[str, Any],
    *,
    fragment: str | None = None,
    status: int = 200,
) -> TemplateResponse:
    """The whole page, or only its partial ``fragment`` for an htmx request: one view, one
    template, two shapes."""
    context.setdefault("operator", is_operator(request.user))
    context.setdefault("role", role_of(request.user))
    name = f"{template}#{fragment}" if fragment and wants_fragment(request) else template
    return TemplateResponse(request, name, context, status=status)


def status_for(exc: DurabilityError) -> int:
    if getattr(exc, "code", "") == "DUR111":  # NotAllowed: the approval's policy says no
        return 403
    if isinstance(exc, UnknownRun | UnknownCheckpoint | UnknownApproval | UnknownEffect):
        return 404
    if isinstance(exc, AlreadyDecided | InvalidTransition | IntegrityViolation):
        return 409
    if isinstance(exc, AgentDefinitionError | SecretMissing):
        return 500  # the agent's code on the server, not the operator's input (as the API)
    return 422


def explain(exc: DurabilityError) -> str:
    """The engine's message with its code, e.g. "approval 'refund' was already approved
    by alice ...; the first decision stands [DUR108]"."""
    return f"{exc.message} [{exc.code}]"


def nothing(request: HttpRequest) -> HttpResponse:
    """A poll that found nothing new: 204 leaves the page exactly as it is."""
    return HttpResponse(status=204)


@contextmanager
def snapshot() -> Iterator[None]:
    """Every query inside reads the database as of one moment: a page drawn from several
    queries (header, checkpoints, timeline, inspector) then shows one head, never a header
    that saw a commit the checkpoint list did not. PostgreSQL needs REPEATABLE READ for that
    (READ COMMITTED takes a new snapshot per statement); SQLite's read transaction already is
    one. Inside an outer transaction (tests) the outer one decides."""
    if connection.in_atomic_block:
        yield
        return
    with transaction.atomic():
        store().repeatable_read()
        yield


def rendered(response: HttpResponse) -> HttpResponse:
    """Render a template response now (inside a snapshot), not after the view returns."""
    render = getattr(response, "render", None)
    if render is not None:
        render()
    return response
