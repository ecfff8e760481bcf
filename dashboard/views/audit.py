"""The audit log: every operator action (events with an actor), newest first. Read-only:
the rows are the engine's append-only events; nothing here can change or remove one."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

from dashboard import params, queries, timeline
from dashboard.conf import conf
from dashboard.models import Notification
from dashboard.views.common import page
from durability.models import Event, EventKind, Run

PAGE = 100

# What an operator (or a person at the CLI) does to a run: the audit log's "what" filter
# offers these only, not the engine's own events (checkpoints, claims, commits) that never
# appear in a log of operator actions.
OPERATOR_KINDS = (
    EventKind.CREATED,
    EventKind.APPROVAL_DECIDED,
    EventKind.MESSAGE_RECEIVED,
    EventKind.EFFECT_RESOLVED,
    EventKind.RESUMED,
    EventKind.CANCELLED,
    EventKind.ROLLBACK,
    EventKind.COMPENSATED,
    EventKind.FORK,
    EventKind.HOLD,
    EventKind.COMPACTED,
    EventKind.DELETED,
)


def _before(request: HttpRequest) -> int | None:
    return params.integer(request.GET, "before", maximum=params.ID_MAX)


# In an operator's words: what they did, not the event's name.
_KIND_LABELS = {
    EventKind.CREATED: "started a run",
    EventKind.APPROVAL_DECIDED: "decided an approval",
    EventKind.MESSAGE_RECEIVED: "sent a message",
    EventKind.EFFECT_RESOLVED: "resolved an effect in doubt",
    EventKind.RESUMED: "resumed or continued",
    EventKind.CANCELLED: "cancelled",
    EventKind.ROLLBACK: "rolled back",
    EventKind.COMPENSATED: "compensated an effect",
    EventKind.FORK: "forked",
    EventKind.HOLD: "legal hold",
    EventKind.COMPACTED: "compacted",
    EventKind.DELETED: "deleted a run",
}


@require_GET
def audit(request: HttpRequest) -> HttpResponse:
    actor = params.text(request.GET, "actor", 150)
    kind = params.choice(request.GET, "kind", [k.value for k in OPERATOR_KINDS])
    run_ref = params.text(request.GET, "run", 36)
    # Not joined to the runs: a deleted run's actions stay in the log (durability.deletion).
    rows = Event.objects.exclude(actor="")
    if actor:
        rows = rows.filter(actor=actor)
    if kind:
        rows = rows.filter(kind=kind)
    if run_ref:
        bounds = queries.id_prefix_range(run_ref)
        if bounds is None:
            raise params.BadParameter(
                "run", "takes a run id or its first characters (4 to 32 hexadecimal digits)"
            )
        low, high = bounds
        rows = rows.filter(run_id__gte=low)
        if high is not None:
            rows = rows.filter(run_id__lt=high)
    before = _before(request)
    if before is not None:
        rows = rows.filter(id__lt=before)
    found = list(rows.order_by("-id")[: PAGE + 1])
    runs = Run.objects.only("id", "agent").in_bulk({e.run_id for e in found[:PAGE]})
    entries = [(e, timeline._event_item(e), runs.get(e.run_id)) for e in found[:PAGE]]
    context = {
        "nav": "audit",
        "entries": entries,
        "next_before": found[PAGE - 1].id if len(found) > PAGE else None,
        "actor": actor,
        "kind": kind,
        "run_ref": run_ref,
        "kinds": [(k.value, _KIND_LABELS.get(k, k.label)) for k in OPERATOR_KINDS],
        "query": {k: v for k, v in {"actor": actor, "kind": kind, "run": run_ref}.items() if v},
    }
    return page(request, "dashboard/audit.html", context, fragment="rows")


@require_GET
def notifications(request: HttpRequest) -> HttpResponse:
    rows = Notification.objects.all()
    before = _before(request)
    if before is not None:
        rows = rows.filter(id__lt=before)
    found = list(rows.order_by("-id")[: PAGE + 1])
    context = {
        "nav": "notifications",
        "rows": found[:PAGE],
        "next_before": found[PAGE - 1].id if len(found) > PAGE else None,
        "webhook": bool(conf.NOTIFY_WEBHOOK_URL),
        "webhook_format": conf.NOTIFY_WEBHOOK_FORMAT,
        "emails": len(conf.NOTIFY_EMAIL_TO),
    }
    return page(request, "dashboard/notifications.html", context)
