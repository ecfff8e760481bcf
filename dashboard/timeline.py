"""A run's timeline: events, journaled calls and effects merged in time order.

The sources are append-only (events, journal entries, effect intents; an effect's outcome is
shown as its own item when it completes), so a page that polls asks only for what came after
its cursor and appends it: nothing already on the screen is replaced, and nothing the reader
opened or scrolled to moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.utils.dateparse import parse_datetime

from dashboard import params
from dashboard.timeline_events import DESCRIBE, human_bytes, human_ms  # noqa: F401 (template filters)
from durability import canonical
from durability.events import replay_counts
from durability.models import (
    CallKind,
    Effect,
    EffectStatus,
    Event,
    EventKind,
    JournalEntry,
    Run,
)

PAGE = 100

# Events that end a step's execution and name the calls it replayed.
_REPLAY_CARRIERS = {
    EventKind.CHECKPOINT,
    EventKind.SUSPENDED,
    EventKind.RETRY_SCHEDULED,
    EventKind.FAILED,
}

# Kinds shown small: bookkeeping an operator rarely needs, kept for the full story.
QUIET = {EventKind.CLAIMED, EventKind.RELEASED, EventKind.COMMIT_LATENCY}
ALERT = {
    "alarm",
    EventKind.LEASE_LOST,
    EventKind.FAILED,
    EventKind.EFFECT_IN_DOUBT,
    EventKind.COMMIT_FAILED,
    EventKind.INTEGRITY,
}


@dataclass
class Cursor:
    """The last item of each source a page has; the next poll asks for what is newer."""

    event: int = 0
    call: int = 0
    effect: int = 0
    done_at: str = ""  # completion time of the newest finished effect shown, ISO
    done_id: int = 0

    def encode(self) -> str:
        return f"{self.event}.{self.call}.{self.effect}.{self.done_id}.{self.done_at}"

    @classmethod
    def decode(cls, text: str) -> Cursor | None:
        parts = (text or "").split(".", 4)
        if len(parts) != 5:
            return None
        try:
            ids = [params.bounded(p, "cursor", maximum=params.ID_MAX) for p in parts[:4]]
        except params.BadParameter:
            return None
        # A time that does not exist (month 13) or cannot be stored (past year 9999 in UTC)
        # is no cursor this page wrote.
        done_at = params.moment(parts[4]) if parts[4] else None
        if parts[4] and done_at is None:
            return None
        return cls(ids[0], ids[1], ids[2], done_at.isoformat() if done_at else "", ids[3])


@dataclass
class Item:
    at: datetime
    order: int  # ties at the same instant: events after the calls that led to them
    ident: int
    source: str  # "event" | "call" | "effect" | "effect_done"
    kind: str
    title: str
    detail: str = ""
    seq: int | None = None
    step: str = ""
    actor: str = ""
    reason: str = ""
    worker: str = ""
    tone: str = ""  # "quiet" | "alert" | "operator" | "done" | ""
    effect: Effect | None = None
    facts: list[tuple[str, str]] = field(default_factory=list)
    link_run: str = ""  # a fork's other run

    @property
    def key(self) -> tuple:
        return (self.at, self.order, self.ident)


def _event_item(e: Event) -> Item:
    item = Item(
        e.created_at,
        1,
        e.id,
        "event",
        e.kind,
        e.get_kind_display(),
        seq=e.seq,
        step=e.step,
        actor=e.actor,
        reason=e.reason,
        worker=e.worker,
    )
    data = canonical.loads_object(e.data)
    describe = DESCRIBE.get(e.kind)
    if describe is not None:
        describe(item, e, data)
    if isinstance(data.get("via"), str) and data["via"]:
        # An action taken through the API names the token it was taken with.
        item.facts.append(("via", data["via"]))
    _commit_latency(item, e)
    item.tone = _tone(e)
    return item


def _commit_latency(item: Item, e: Event) -> None:
    if e.commit_us is not None and e.kind != EventKind.COMMIT_LATENCY:
        item.facts.append(("previous commit", human_ms(e.commit_us / 1000)))
    elif e.kind == EventKind.COMMIT_LATENCY:
        item.title = "commit latency"
        item.detail = human_ms((e.commit_us or 0) / 1000)


def _tone(e: Event) -> str:
    if e.actor:
        return "operator"
    if e.kind in ALERT:
        return "alert"
    if e.kind in QUIET:
        return "quiet"
    return "done" if e.kind == EventKind.SUCCEEDED else ""


def _event_items(e: Event) -> list[Item]:
    """An event's item, after one item per call the step took from the journal instead of
    paying again (the event that ended the step names them: see durability.runtime.executor)."""
    event = _event_item(e)
    carrier = e.kind in _REPLAY_CARRIERS and '"replayed"' in e.data
    replayed = canonical.loads_object(e.data).get("replayed") if carrier else None
    if not isinstance(replayed, list):
        return [event]
    items = []
    for pair in replayed:
        if not (isinstance(pair, list) and len(pair) == 2):
            continue
        # Same place in time as the event (same key): a page boundary never splits them
        # from it in a way that skips one, and they sort before it (stable sort).
        items.append(
            Item(
                e.created_at,
                event.order,
                e.id,
                "replay",
                "replayed",
                f"call {pair[1]}",
                detail="replayed, not paid: the journal's recorded answer was used",
                seq=e.seq,
                step=e.step,
                tone="done",
            )
        )
    return [*items, event]


def _call_item(j: JournalEntry, replays: int = 0) -> Item:
    """``replays``: how many times its step ran again and was served its record."""
    meta = canonical.loads_object(j.meta)
    title = f"call {j.key}" if j.kind == CallKind.CALL else f"{j.get_kind_display()}()"
    item = Item(
        j.created_at,
        0,
        j.id,
        "call",
        j.kind,
        title,
        detail=j.function,
        step=j.step,
        tone="" if j.kind == CallKind.CALL else "quiet",
    )
    if j.reused_from is not None:
        # A what-if fork: the source run's recorded answer, not a new call.
        item.facts.append(("reused", "from the source run, not called again"))
    elif j.kind == CallKind.CALL:
        item.facts.append(("took", human_ms(j.duration_ms)))
    if meta.get("model"):
        item.facts.append(("model", str(meta["model"])))
    tokens = [meta.get("input_tokens"), meta.get("output_tokens")]
    if any(t is not None for t in tokens):
        total = sum(int(t) for t in tokens if isinstance(t, int | float))
        item.facts.append(("tokens", f"{total} ({tokens[0]} in, {tokens[1]} out)"))
    if replays:
        item.facts.append(("replayed", f"{replays}x"))
    return item


def _effect_item(f: Effect) -> Item:
    item = Item(
        f.created_at,
        0,
        f.id,
        "effect",
        f.status,
        f"effect {f.key}",
        detail=f.function,
        step=f.step,
        effect=f,
        tone="alert" if f.status == EffectStatus.IN_DOUBT else "",
    )
    item.facts.append(("now", f.get_status_display()))
    return item


def _effect_done_item(f: Effect) -> Item:
    item = Item(
        f.completed_at,  # type: ignore[arg-type]
        0,
        f.id,
        "effect_done",
        f.status,
        f"effect {f.key} done",
        step=f.step,
        effect=f,
        tone="done",
    )
    if f.duplicates_prevented:
        item.facts.append(("duplicates prevented", str(f.duplicates_prevented)))
    if f.resolved_by:
        item.actor = f.resolved_by
        item.facts.append(("marked done by", f.resolved_by))
    return item


@dataclass
class Page:
    items: list[Item]
    cursor: Cursor
    earlier: str = ""  # ISO time to ask for older items; empty when there are none


def _advance(cursor: Cursor, ev: list, jl: list, ef: list, done: list) -> Cursor:
    """The cursor after the rows just read: derived from what was read, never from a second
    query, so a row written in between is not skipped."""
    moved = Cursor(
        max([cursor.event, *(e.id for e in ev)]),
        max([cursor.call, *(j.id for j in jl)]),
        max([cursor.effect, *(f.id for f in ef)]),
        cursor.done_at,
        cursor.done_id,
    )
    finished = [(f.completed_at, f.id) for f in done if f.completed_at is not None]
    if finished:
        at, ident = max(finished)
        moved.done_at, moved.done_id = at.isoformat(), ident
    return moved


def encode_before(item: Item) -> str:
    return f"{item.at.isoformat()}|{item.order}|{item.ident}"


def decode_before(text: str) -> tuple[datetime, int, int] | None:
    parts = (text or "").split("|")
    if len(parts) != 3:
        return None
    at = params.moment(parts[0])
    try:
        order = params.bounded(parts[1], "before", maximum=1)
        ident = params.bounded(parts[2], "before", maximum=params.ID_MAX)
    except params.BadParameter:
        return None
    return (at, order, ident) if at is not None else None


def _older(field: str, order: int, before: tuple[datetime, int, int]):
    """Rows of one source that sort before ``before`` by (time, order, id): a time alone
    would lose the rows that share the boundary's instant."""
    from django.db.models import Q

    at, b_order, b_ident = before
    if order < b_order:
        same_instant = Q(**{field: at})
    elif order == b_order:
        same_instant = Q(**{field: at, "id__lt": b_ident})
    else:
        same_instant = Q(pk__in=[])
    return Q(**{f"{field}__lt": at}) | same_instant


def latest(run: Run, limit: int = PAGE, before: tuple[datetime, int, int] | None = None) -> Page:
    """The newest ``limit`` items (older than ``before``), oldest first, and the cursor a
    poll continues from."""
    events = Event.objects.filter(run=run)
    calls = JournalEntry.objects.filter(run=run).defer("result")
    effects = Effect.objects.filter(run=run).defer("result", "args")
    done_rows = Effect.objects.filter(
        run=run, status=EffectStatus.DONE, completed_at__isnull=False
    ).defer("result", "args")
    cursor = Cursor()
    if before is None:
        # The cursor is read first and the page stops at it: a row written meanwhile is
        # left for the next poll instead of being skipped by it.
        cursor = current_cursor(run)
        events = events.filter(id__lte=cursor.event)
        calls = calls.filter(id__lte=cursor.call)
        effects = effects.filter(id__lte=cursor.effect)
        if cursor.done_at:
            done_rows = done_rows.filter(completed_at__lte=cursor.done_at)
        else:
            done_rows = done_rows.none()
    else:
        events = events.filter(_older("created_at", 1, before))
        calls = calls.filter(_older("created_at", 0, before))
        effects = effects.filter(_older("created_at", 0, before))
        done_rows = done_rows.filter(_older("completed_at", 0, before))
    ev = list(events.order_by("-created_at", "-id")[: limit + 1])
    jl = list(calls.order_by("-created_at", "-id")[: limit + 1])
    ef = list(effects.order_by("-created_at", "-id")[: limit + 1])
    done = list(done_rows.order_by("-completed_at", "-id")[: limit + 1])
    replays = replay_counts(run.pk) if jl else {}
    items = [i for e in ev for i in _event_items(e)]
    items += [_call_item(j, replays.get(j.id, 0)) for j in jl]
    items += [_effect_item(f) for f in ef] + [_effect_done_item(f) for f in done]
    items.sort(key=lambda i: i.key)
    more = len(items) > limit
    items = items[-limit:]
    earlier = encode_before(items[0]) if more and items else ""
    return Page(items, cursor, earlier)


def current_cursor(run: Run) -> Cursor:
    from django.db.models import F, Max

    # max(id + 0), not max(id): with only an index on run_id, PostgreSQL answers max(id) by
    # walking the primary key backwards until it meets the run (18 ms on a big table,
    # against 0.3 ms for the run's own rows). Events have an index on (run, id).
    event = Event.objects.filter(run=run).aggregate(m=Max("id"))["m"] or 0
    call = JournalEntry.objects.filter(run=run).aggregate(m=Max(F("id") + 0))["m"] or 0
    effect = Effect.objects.filter(run=run).aggregate(m=Max(F("id") + 0))["m"] or 0
    done = (
        Effect.objects.filter(run=run, status=EffectStatus.DONE, completed_at__isnull=False)
        .order_by("-completed_at", "-id")
        .values_list("completed_at", "id")
        .first()
    )
    if done is None:
        return Cursor(event, call, effect)
    return Cursor(event, call, effect, done[0].isoformat(), done[1])


def newer(run: Run, cursor: Cursor) -> Page:
    """Items that arrived after ``cursor``, oldest first (what a poll appends)."""
    from django.db.models import Q

    ev = list(Event.objects.filter(run=run, id__gt=cursor.event).order_by("id")[:PAGE])
    jl = list(
        JournalEntry.objects.filter(run=run, id__gt=cursor.call)
        .defer("result")
        .order_by("id")[:PAGE]
    )
    ef = list(
        Effect.objects.filter(run=run, id__gt=cursor.effect)
        .defer("result", "args")
        .order_by("id")[:PAGE]
    )
    done = Effect.objects.filter(run=run, status=EffectStatus.DONE, completed_at__isnull=False)
    since = parse_datetime(cursor.done_at) if cursor.done_at else None
    if since is not None:
        done = done.filter(Q(completed_at__gt=since) | Q(completed_at=since, id__gt=cursor.done_id))
    finished = list(done.defer("result", "args").order_by("completed_at", "id")[:PAGE])
    items = [i for e in ev for i in _event_items(e)] + [_call_item(j) for j in jl]
    items += [_effect_item(f) for f in ef] + [_effect_done_item(f) for f in finished]
    items.sort(key=lambda i: i.key)
    return Page(items, _advance(cursor, ev, jl, ef, finished))


def has_news(run: Run, cursor: Cursor) -> bool:
    """Whether anything arrived after ``cursor``: a few index probes, for polls."""
    from django.db.models import Q

    if Event.objects.filter(run=run, id__gt=cursor.event).exists():
        return True
    if JournalEntry.objects.filter(run=run, id__gt=cursor.call).exists():
        return True
    if Effect.objects.filter(run=run, id__gt=cursor.effect).exists():
        return True
    done = Effect.objects.filter(run=run, status=EffectStatus.DONE, completed_at__isnull=False)
    since = parse_datetime(cursor.done_at) if cursor.done_at else None
    if since is not None:
        done = done.filter(Q(completed_at__gt=since) | Q(completed_at=since, id__gt=cursor.done_id))
    return done.exists()
