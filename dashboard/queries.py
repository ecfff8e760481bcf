"""The runs list: filters, search, status counts and keyset pagination.

Keyset, not OFFSET: the next page starts after the last row shown (created_at, id), so page
500 costs what page 1 costs, with 100,000 runs or ten million."""

from __future__ import annotations

import base64
import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Max, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Substr
from django.utils import timezone

from dashboard import params
from durability.models import Approval, ApprovalStatus, Checkpoint, Event, Run, RunStatus
from durability.store import store

SINCE = {
    "1h": timedelta(hours=1),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
    "30d": timedelta(days=30),
}
PAGE_SIZE = 50
# The outcome filter offers the outcomes of this many newest runs (an index walk on
# created_at): listing every outcome ever named would read the whole table on each page.
OUTCOMES_FROM = 1000
RECOVERED = "yes"
_HEX = re.compile(r"^[0-9a-f]{4,32}$")


@dataclass
class Filters:
    agent: str = ""
    status: str = ""
    since: str = ""
    q: str = ""
    outcome: str = ""
    recovered: str = ""

    def as_query(self, **extra: str) -> dict[str, str]:
        values = {
            "agent": self.agent,
            "status": self.status,
            "since": self.since,
            "q": self.q,
            "outcome": self.outcome,
            "recovered": self.recovered,
        }
        values.update(extra)
        return {k: v for k, v in values.items() if v}


def id_prefix_range(text: str) -> tuple[uuid.UUID, uuid.UUID | None] | None:
    """A run id prefix as a range of UUIDs, so the search walks the primary key index
    instead of casting every id to text."""
    hexed = text.strip().lower().replace("-", "")
    if not _HEX.match(hexed):
        return None
    shift = 4 * (32 - len(hexed))
    low = int(hexed, 16) << shift
    high = (int(hexed, 16) + 1) << shift
    return uuid.UUID(int=low), (uuid.UUID(int=high) if high < 1 << 128 else None)


def filtered(f: Filters, *, with_status: bool = True) -> QuerySet[Run]:
    runs = Run.objects.all()
    if f.agent:
        runs = runs.filter(agent=f.agent)
    if with_status and f.status:
        runs = runs.filter(status=f.status)
    if f.since in SINCE:
        runs = runs.filter(created_at__gte=timezone.now() - SINCE[f.since])
    if f.outcome:
        # Only a run that succeeded has its outcome (one resumed or rolled back since may
        # still carry the last one).
        runs = runs.filter(outcome=f.outcome, status=RunStatus.SUCCEEDED)
    if f.recovered:
        runs = runs.filter(recoveries__gt=0)
    if f.q:
        by_id = id_query(f.q)
        # An id prefix walks the primary key. Text in the input is the fallback when no run
        # id starts with what was typed: a trigram index on PostgreSQL (migration 0003), a
        # scan where there is none.
        if by_id is not None and Run.objects.filter(by_id).exists():
            runs = runs.filter(by_id)
        else:
            runs = runs.filter(input__icontains=f.q)
    return runs


def id_query(text: str) -> Q | None:
    bounds = id_prefix_range(text)
    if bounds is None:
        return None
    low, high = bounds
    return Q(id__gte=low) & (Q(id__lt=high) if high is not None else Q())


def is_text_search(f: Filters) -> bool:
    by_id = id_query(f.q) if f.q else None
    return bool(f.q) and (by_id is None or not Run.objects.filter(by_id).exists())


def encode_cursor(run: Run) -> str:
    raw = f"{run.created_at.isoformat()}|{run.id}"
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(text: str) -> tuple[datetime, uuid.UUID] | None:
    """The position a ``cursor`` names; None for none (the first page). A cursor this list
    did not write is refused: paging from a guessed position would show a page that looks
    like the list but is not where the user was."""
    if not text:
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
        when, ident = raw.split("|", 1)
        at = params.moment(when)
        if at is not None:
            return at, uuid.UUID(ident)
    except (ValueError, UnicodeDecodeError):
        pass
    raise params.BadParameter(
        "cursor",
        "is not a position this list gave (follow “Older” from the first page instead)",
    )


@dataclass
class RunsPage:
    rows: list[Run]
    next_cursor: str = ""
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _annotated(runs: QuerySet[Run]) -> QuerySet[Run]:
    head = Checkpoint.objects.filter(run=OuterRef("pk"), seq=OuterRef("head_seq"))
    pending = Approval.objects.filter(run=OuterRef("pk"), status=ApprovalStatus.PENDING).order_by(
        "requested_at"
    )
    return (
        runs.order_by("-created_at", "-id")
        .defer("input", "error")
        .annotate(
            state_size=Subquery(head.values("size")[:1]),
            approval_name=Subquery(pending.values("name")[:1]),
            approval_since=Subquery(pending.values("requested_at")[:1]),
            # The input's first characters for a preview: never the whole of a large input.
            input_head=Substr("input", 1, 300),
        )
    )


def page(f: Filters, cursor: str = "", size: int = PAGE_SIZE) -> RunsPage:
    after = decode_cursor(cursor)
    if store().indexed_text_search and is_text_search(f):
        return _text_page(f, after, size)
    runs = filtered(f)
    if after is not None:
        at, ident = after
        # The first condition lets the created_at index bound the scan; the second breaks
        # ties between runs created in the same microsecond.
        runs = runs.filter(Q(created_at__lte=at) & (Q(created_at__lt=at) | Q(id__lt=ident)))
    rows = list(_annotated(runs)[: size + 1])
    more = len(rows) > size
    rows = rows[:size]
    return RunsPage(rows, encode_cursor(rows[-1]) if more and rows else "", counts(f))


def _text_page(f: Filters, after: tuple[datetime, uuid.UUID] | None, size: int) -> RunsPage:
    """Text in the input: the status counts and the page come from one pass over the
    matching runs (found through the trigram index on ``upper(input)``, migration 0003, and
    materialized once) instead of one pass each."""
    matching = filtered(f, with_status=False).order_by().values_list("id", "status", "created_at")
    tally, ids = store().text_page(matching, f.status, after, size)
    rows = list(_annotated(Run.objects.filter(pk__in=ids[:size])))
    more = len(ids) > size
    return RunsPage(
        rows,
        encode_cursor(rows[-1]) if more and rows else "",
        {status: tally.get(status, 0) for status in RunStatus.values},
    )


def counts(f: Filters) -> dict[str, int]:
    found = dict(
        filtered(f, with_status=False)
        .order_by()
        .values_list("status")
        .annotate(n=Count("id"))
        .values_list("status", "n")
    )
    return {status: found.get(status, 0) for status in RunStatus.values}


def change_token() -> str:
    """Cheap signal that something changed in any run: every state change writes an event,
    and the newest event id is one index probe."""
    newest = Event.objects.aggregate(m=Max("id"))["m"] or 0
    return str(newest)


def agents_in_use() -> list[str]:
    from durability.agents import registry

    return sorted({a.name for a in registry.all()})


def known_agent(data: Any, name: str = "agent") -> str:
    """An agent filter: a registered agent, or one some run was started with (its code may
    be gone); anything else is refused, not silently matched with nothing."""
    agent = params.text(data, name)
    if agent and agent not in agents_in_use() and not Run.objects.filter(agent=agent).exists():
        raise params.BadParameter(
            name, f"names no agent: no agent “{params.shown(agent)}” is registered or has runs"
        )
    return agent


def outcomes_in_use(also: str = "") -> list[str]:
    """The outcomes named by the newest runs, for the filter's menu (and ``also``, the one
    a link chose, which may be older)."""
    newest = Run.objects.order_by("-created_at").values_list("outcome", flat=True)
    found = {o for o in newest[:OUTCOMES_FROM] if o}
    if also:
        found.add(also)
    return sorted(found)


def known_outcome(data: Any, name: str = "outcome") -> str:
    """An outcome filter: one some run ended with; anything else is refused, not silently
    matched with nothing."""
    outcome = params.text(data, name)
    if outcome and not Run.objects.filter(outcome=outcome).exists():
        raise params.BadParameter(
            name, f"names no outcome: no run ended with “{params.shown(outcome)}”"
        )
    return outcome


def parse_filters(data: Any) -> Filters:
    return Filters(
        agent=known_agent(data),
        status=params.choice(data, "status", RunStatus.values),
        since=params.choice(data, "since", SINCE),
        q=params.text(data, "q"),
        outcome=known_outcome(data),
        recovered=params.choice(data, "recovered", [RECOVERED]),
    )
