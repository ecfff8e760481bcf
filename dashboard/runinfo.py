"""What the run page shows besides the timeline: pending approvals, effects in doubt, forks,
the checkpoint list, the inspector's tabs, and the tokens live updates compare."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from django.db.models import F

from dashboard import diffview, present, states
from dashboard.conf import conf
from durability import canonical
from durability.events import replay_counts
from durability.models import (
    FINISHED,
    Approval,
    ApprovalStatus,
    Checkpoint,
    CheckpointReason,
    Effect,
    EffectStatus,
    Event,
    EventKind,
    JournalEntry,
    Mutation,
    Run,
    RunStatus,
    WaitReason,
)
from durability.redact import REDACTED, is_secret_key

CHECKPOINT_PAGE = 30
INSPECTOR_CHANGES = 50
MUTATIONS_SHOWN = 200


@dataclass
class PayloadView:
    """An approval's payload as rows of key and value (or one value if not an object)."""

    rows: list[tuple[str, present.Shown]] = field(default_factory=list)
    whole: present.Shown | None = None


def payload_view(text: str) -> PayloadView:
    try:
        payload = json.loads(text) if text else None
    except ValueError:
        return PayloadView(whole=present.Shown("string", text[:2000]))
    if isinstance(payload, dict):
        rows = []
        for key, value in payload.items():
            if is_secret_key(key):
                rows.append((key, present.Shown("string", REDACTED, redacted=True)))
            else:
                rows.append((key, present.show(value, limit=2000, pretty=True)))
        return PayloadView(rows=rows)
    return PayloadView(whole=present.show(payload, limit=2000, pretty=True))


def pending_approvals(run: Run | None = None) -> list[Approval]:
    rows = Approval.objects.filter(status=ApprovalStatus.PENDING).select_related("run", "base")
    if run is not None:
        rows = rows.filter(run=run)
    found = list(rows.order_by("requested_at", "id"))
    for approval in found:
        approval.view = payload_view(approval.payload)  # type: ignore[attr-defined]
    return found


def in_doubt(run: Run) -> list[Effect]:
    return list(Effect.objects.filter(run=run, status=EffectStatus.IN_DOUBT).select_related("base"))


def checkpoint_rows(run: Run, before: int | None = None) -> tuple[list[Checkpoint], int | None]:
    """The newest checkpoints (below ``before``), with their parent's number, and where the
    next page starts."""
    rows = Checkpoint.objects.filter(run=run).annotate(parent_seq=F("parent__seq"))
    if before is not None:
        rows = rows.filter(seq__lt=before)
    found = list(
        rows.order_by("-seq").only(
            "id",
            "seq",
            "reason",
            "step",
            "next_step",
            "size",
            "delta_size",
            "created_at",
            "created_by",
            "parent_id",
        )[: CHECKPOINT_PAGE + 1]
    )
    more = found[CHECKPOINT_PAGE].seq + 1 if len(found) > CHECKPOINT_PAGE else None
    return found[:CHECKPOINT_PAGE], more


def checkpoints_after(run: Run, seq: int) -> list[Checkpoint]:
    """Checkpoints newer than ``seq``, newest first: what a poll prepends to the list."""
    rows = Checkpoint.objects.filter(run=run, seq__gt=seq).annotate(parent_seq=F("parent__seq"))
    return list(rows.order_by("-seq")[:CHECKPOINT_PAGE])


def header_token(run: Run) -> str:
    """Changes whenever the header would: status, head, lease, timings."""
    raw = "|".join(
        str(x)
        for x in (
            run.status,
            run.wait_reason,
            run.head_seq,
            run.updated_at.timestamp(),
            run.lease_owner,
            run.lease_expires_at.timestamp() if run.lease_expires_at else "",
            run.attempts,
            run.retries,
        )
    )
    return hashlib.sha1(raw.encode(), usedforsecurity=False).hexdigest()[:16]


def actions_token(run: Run, approvals: list[Approval], doubts: list[Effect]) -> str:
    """Changes only when the set of valid actions does: the action forms are replaced only
    then, so a reason being typed is not wiped by a poll."""
    raw = "|".join(
        [
            run.status,
            run.wait_reason,
            run.wait_detail,
            str(run.head_seq > 0),
            ",".join(f"{a.pk}:{getattr(a, 'group', '')}" for a in approvals),
            ",".join(str(e.pk) for e in doubts),
        ]
    )
    return hashlib.sha1(raw.encode(), usedforsecurity=False).hexdigest()[:16]


def can_resume(run: Run) -> bool:
    """As the engine allows: not a run waiting for what wakes it by itself (an approval, a
    message, a timer, its children). A run on hold after a rollback is "continued"."""
    from durability.operations import WAKES_BY_ITSELF

    if run.status == RunStatus.WAITING:
        return run.wait_reason not in WAKES_BY_ITSELF
    return run.status in (RunStatus.FAILED, RunStatus.CANCELLED)


def can_cancel(run: Run) -> bool:
    return run.status not in FINISHED


def to_compensate(run: Run) -> list[str]:
    """For a run on hold after a rollback: the compensations the operator ticked, which
    continuing performs first, in the agent's words ("refund 200 EUR on order A-1002, by
    reverse_refund")."""
    if run.status != RunStatus.WAITING or run.wait_reason != WaitReason.HOLD:
        return []
    from durability import rollbacks

    return rollbacks.owed(run)


# --- the inspector ----------------------------------------------------------------------------

TABS = ("changes", "state", "mutations", "calls")


@dataclass(frozen=True)
class Trace:
    """The run's trace: every step, call and effect of the run is a span in it."""

    id: str
    url: str = ""


def trace_of(run: Run) -> Trace | None:
    """From the traceparent stored when the run started ("00-<trace id>-<span id>-<flags>"),
    with a link where a trace viewer is configured (``DURABILITY_TRACE_URL``)."""
    parts = (getattr(run, "trace_parent", "") or "").split("-")
    if len(parts) != 4 or len(parts[1]) != 32:
        return None
    template = conf.TRACE_URL
    return Trace(parts[1], template.replace("{trace_id}", parts[1]) if template else "")


@dataclass
class Inspector:
    run: Run
    checkpoint: Checkpoint
    tab: str
    error: str = ""
    notice: str = ""
    nodes: list[present.Node] = field(default_factory=list)
    total: int = 0
    previous: tuple[Run, int] | None = None
    diff: diffview.Diff | None = None
    changes: list[tuple[str, list[present.ChangeView]]] = field(default_factory=list)
    mutations: list[tuple[str, str, present.Shown]] = field(default_factory=list)
    mutation_count: int = 0
    produced_by: list[JournalEntry] = field(default_factory=list)
    made_from: list[JournalEntry] = field(default_factory=list)
    trace: Trace | None = None
    effects_by: list[Effect] = field(default_factory=list)
    effects_from: list[Effect] = field(default_factory=list)
    approvals: list[Approval] = field(default_factory=list)

    @property
    def is_head(self) -> bool:
        return self.checkpoint.seq == self.run.head_seq

    @property
    def tabs(self) -> list[tuple[str, str]]:
        return [
            ("changes", "Changes"),
            ("state", "State"),
            ("mutations", "Mutation log"),
            ("calls", "Calls & effects"),
        ]

    @property
    def next_offset(self) -> int:
        return len(self.nodes)


def inspector(run: Run, cp: Checkpoint, tab: str) -> Inspector:
    previous = states.previous_of(run, cp)
    if tab not in TABS:
        tab = "changes" if previous else "state"
    view = Inspector(run, cp, tab, previous=previous, trace=trace_of(run))
    if tab == "state":
        loaded = states.load(cp)
        view.error = loaded.error
        if loaded.ok:
            view.nodes, view.total = present.tree_children(loaded.state, "")
    elif tab == "changes":
        if previous is None:
            view.notice = "This is the first checkpoint: there is nothing before it to compare."
            return view
        other_run, other_seq = previous
        other = Checkpoint.objects.filter(run=other_run, seq=other_seq).first()
        if other is None:
            view.error = f"checkpoint #{other_seq} of run {other_run.short_id} is gone"
            return view
        old, new = states.load_pair(other, cp)
        view.error = old.error or new.error
        if not view.error:
            view.diff = diffview.compare(old.state, new.state)
            view.changes = [
                (g.key, [present.change_view(c) for c in g.changes])
                for g in view.diff.groups(0, INSPECTOR_CHANGES)
            ]
    elif tab == "mutations":
        mutation = Mutation.objects.filter(checkpoint=cp).first()
        ops = json.loads(mutation.ops) if mutation else []
        view.mutation_count = len(ops)
        for op in ops[:MUTATIONS_SHOWN]:
            path = str(op.get("path", ""))
            if diffview.secret_path(path):
                shown = present.Shown("string", REDACTED, redacted=True)
            elif "value" in op:
                shown = present.show(op["value"])
            elif "from" in op:
                shown = present.Shown("string", f"from {op['from']}")
            else:
                shown = present.Shown("missing")
            view.mutations.append((str(op.get("op", "?")), path, shown))
    elif tab == "calls":
        journal = JournalEntry.objects.filter(run=run).defer("result").order_by("id")
        effects = Effect.objects.filter(run=run).defer("result", "args").order_by("id")
        if cp.parent_id and cp.reason == CheckpointReason.STEP:
            view.produced_by = list(journal.filter(base_id=cp.parent_id))
            view.effects_by = list(effects.filter(base_id=cp.parent_id))
        view.made_from = list(journal.filter(base=cp))
        view.effects_from = list(effects.filter(base=cp))
        replays = replay_counts(run.pk) if view.produced_by or view.made_from else {}
        for j in (*view.produced_by, *view.made_from):
            j.replays = replays.get(j.id, 0)  # type: ignore[attr-defined]
        view.approvals = list(Approval.objects.filter(run=run, base=cp).order_by("id"))
        for approval in view.approvals:
            approval.view = payload_view(approval.payload)  # type: ignore[attr-defined]
    return view


def effect_args(effect: Effect) -> Any:
    return payload_view(effect.args)


# --- what a recovery cost, and what a failure left ----------------------------------------------

# Events that end a step's execution and carry the calls it replayed (durability.runtime.executor).
_REPLAY_CARRIERS = (
    EventKind.CHECKPOINT,
    EventKind.SUSPENDED,
    EventKind.RETRY_SCHEDULED,
    EventKind.FAILED,
)
RECOVERIES_SHOWN = 5


def replayed_in(data: str) -> list[tuple[int, str]]:
    """The calls an event says were answered from the journal: (journal id, key)."""
    try:
        value = json.loads(data) if data else {}
    except ValueError:
        return []
    found = value.get("replayed") if isinstance(value, dict) else None
    if not isinstance(found, list):
        return []
    return [(int(p[0]), str(p[1])) for p in found if isinstance(p, list) and len(p) == 2]


@dataclass
class Recovery:
    """One take-over from a lost attempt, and what it cost."""

    at: Any
    worker: str
    seq: int
    recovery_ms: float | None
    work_lost_ms: float | None
    replayed: list[str] = field(default_factory=list)  # keys of the calls not paid again
    effects_repeated: int = 0

    @property
    def summary(self) -> str:
        from dashboard.timeline import human_ms

        n = len(self.replayed)
        calls = f"{n} call{'' if n == 1 else 's'} replayed from the journal (not paid again)"
        m = self.effects_repeated
        return (
            f"recovered after {human_ms(self.recovery_ms)}; {calls};"
            f" {m} effect{'' if m == 1 else 's'} repeated;"
            f" work lost {human_ms(self.work_lost_ms)}"
        )


def recoveries(run: Run) -> list[Recovery]:
    """The run's latest recoveries, newest first: each from its recovered event to the next
    claim (the execution that took over), with the calls that execution replayed and the
    effects it performed again."""
    if not run.recoveries:  # counted by the claim that recovers, before its event is written
        return []
    events = Event.objects.filter(run=run)
    found = list(events.filter(kind=EventKind.RECOVERED).order_by("-id")[:RECOVERIES_SHOWN])
    shown = []
    for r in found:
        data = canonical.loads_object(r.data)
        until = (
            events.filter(kind=EventKind.CLAIMED, id__gt=r.id)
            .order_by("id")
            .values_list("id", "created_at")
            .first()
        )
        window = events.filter(id__gt=r.id, kind__in=_REPLAY_CARRIERS).exclude(data="")
        if until is not None:
            window = window.filter(id__lt=until[0])
        keys = {}
        for text in window.values_list("data", flat=True)[:1000]:
            keys.update(dict(replayed_in(text)))
        repeated = Effect.objects.filter(run=run, attempts__gt=1, completed_at__gte=r.created_at)
        if until is not None:
            repeated = repeated.filter(completed_at__lt=until[1])
        shown.append(
            Recovery(
                at=r.created_at,
                worker=r.worker,
                seq=r.seq or 0,
                recovery_ms=data.get("recovery_ms"),
                work_lost_ms=data.get("work_lost_ms"),
                replayed=list(keys.values()),
                effects_repeated=repeated.count(),
            )
        )
    return shown


@dataclass
class Failure:
    """A failed run's error, its traceback (written through the redaction gate), and where
    the next actions start from."""

    code: str
    error: str
    step: str
    seq: int
    traceback: str = ""


def failure(run: Run) -> Failure | None:
    if run.status != RunStatus.FAILED:
        return None
    event = (
        Event.objects.filter(run=run, kind=EventKind.FAILED)
        .order_by("-id")
        .values_list("data", "step")
        .first()
    )
    data, step = (canonical.loads_object(event[0]), event[1]) if event else ({}, "")
    return Failure(
        code=run.error_code,
        error=run.error,
        step=step or run.step,
        seq=run.head_seq,
        traceback=str(data.get("traceback") or ""),
    )
