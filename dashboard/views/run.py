"""A run: header, actions, timeline, checkpoints and the inspector of one checkpoint, live."""

from __future__ import annotations

from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_GET

from dashboard import diffview, drafts, graphruns, params, present, runinfo, states, timeline
from dashboard.forms import ReasonForm, SendForm
from dashboard.permissions import mark_deciders
from dashboard.views.common import nothing, page, rendered, snapshot
from durability.models import Checkpoint, Run, RunStatus
from durability.redact import redact


def _context(request: HttpRequest, run: Run, seq: int | None, tab: str) -> dict:
    try:
        cp = states.checkpoint_or_404(run, run.head_seq if seq is None else seq)
    except Http404:
        if seq is not None:
            raise
        cp = None  # a run whose first checkpoint is not written yet: the page still shows it
    approvals = mark_deciders(request.user, runinfo.pending_approvals(run))
    doubts = runinfo.in_doubt(run)
    rows, more_checkpoints = runinfo.checkpoint_rows(run)
    items = timeline.latest(run)
    graphruns.annotate(run, items.items)
    graph = graphruns.graph_run(run)
    return {
        "run": run,
        "head": next((c for c in rows if c.seq == run.head_seq), None),
        "approvals": approvals,
        "doubts": doubts,
        "checkpoints": rows,
        "more_checkpoints": more_checkpoints,
        "timeline": items,
        "inspector": runinfo.inspector(run, cp, tab) if cp is not None else None,
        "forks": _forks(run),
        "source": _source(run),
        "children": _children(run),
        "parent": _parent(run),
        "trace": runinfo.trace_of(run),
        "recoveries": runinfo.recoveries(run),
        # A graph executed in its own process: no worker action is offered (graphruns).
        "failure": runinfo.failure(run) if graph is None else None,
        "graph": graph,
        "header_token": runinfo.header_token(run),
        "actions_token": runinfo.actions_token(run, approvals, doubts),
        **_actions(run),
        "send_draft": drafts.take(request, run) if drafts.waits_for_message(run) else None,
        "cursor": items.cursor.encode(),
        # On the run's own address the inspector follows the head as it moves; a checkpoint
        # the reader picked (its address, a click) stays put and only its head mark changes.
        "follow": seq is None,
    }


@require_GET
def run_detail(request: HttpRequest, ref: str) -> HttpResponse:
    run = states.run_or_404(ref)
    if ref != str(run.id):
        # A prefix finds the run; the page lives at its full id, a stable link to share.
        return redirect("dashboard:run", ref=str(run.id))
    tab = _tab(request)
    with snapshot():
        # One moment of the database for every region, so they all show the same head.
        run = Run.objects.get(pk=run.pk)
        if "live" in request.GET:
            return rendered(_live(request, run))
        return rendered(page(request, "dashboard/run.html", _context(request, run, None, tab)))


def _tab(request: HttpRequest) -> str:
    return params.choice(request.GET, "tab", runinfo.TABS)


@require_GET
def checkpoint_detail(request: HttpRequest, ref: str, seq: int) -> HttpResponse:
    """A run page with checkpoint ``seq`` in the inspector; for htmx, the inspector alone."""
    run = states.run_or_404(ref)
    tab = _tab(request)
    with snapshot():
        run = Run.objects.get(pk=run.pk)
        if request.htmx and request.htmx.target == "inspector":
            cp = states.checkpoint_or_404(run, seq)
            context = {
                "run": run,
                "inspector": runinfo.inspector(run, cp, tab),
                "follow": False,
                "graph": graphruns.graph_run(run),
            }
            return rendered(page(request, "dashboard/run.html", context, fragment="inspector"))
        return rendered(page(request, "dashboard/run.html", _context(request, run, seq, tab)))


def _actions(run: Run) -> dict[str, Any]:
    """What the action bar is drawn from, on the page and in a poll alike."""
    return {
        "can_resume": runinfo.can_resume(run),
        "can_cancel": runinfo.can_cancel(run),
        "to_compensate": runinfo.to_compensate(run),
        "resume_form": ReasonForm(prefix="resume"),
        "cancel_form": ReasonForm(prefix="cancel", reason_required=True),
        "send_form": _send_form(run),
        "poll_seconds": _poll_seconds(run),
    }


def _live(request: HttpRequest, run: Run) -> HttpResponse:
    """A poll: compare what the page shows with what is, and send only the regions that
    changed, each as an out-of-band swap drawn from the same snapshot. The page says which
    head it shows; when the head moved, every region that depends on it is sent together
    (header, actions, new checkpoint rows, the inspector or its head mark, the timeline's
    new items), so no region is left on the old head. Timeline items are appended, not
    replaced, and the action forms' typed text and open panels are kept by the page."""
    header = runinfo.header_token(run)
    shown_head = params.integer(request.GET, "head", run.head_seq)
    cursor = None
    if request.GET.get("cursor"):
        cursor = timeline.Cursor.decode(request.GET["cursor"])
        if cursor is None:
            raise params.BadParameter("cursor", "is not a position this page gave; reload it")
    approvals = mark_deciders(request.user, runinfo.pending_approvals(run))
    doubts = runinfo.in_doubt(run)
    actions = runinfo.actions_token(run, approvals, doubts)
    head_moved = shown_head != run.head_seq
    changed_header = head_moved or request.GET.get("live") != header
    changed_actions = head_moved or request.GET.get("acts") != actions
    news = cursor is not None and timeline.has_news(run, cursor)
    if not (changed_header or changed_actions or news):
        return nothing(request)
    appended = timeline.newer(run, cursor) if news and cursor is not None else None
    graphruns.annotate(run, appended.items if appended else [])
    graph = graphruns.graph_run(run) if changed_header or changed_actions else None
    context = {
        "run": run,
        "approvals": approvals,
        "doubts": doubts,
        "header_token": header,
        "actions_token": actions,
        "cursor": (appended.cursor if appended else cursor or timeline.Cursor()).encode(),
        "appended": appended,
        "send_header": changed_header,
        "send_actions": changed_actions,
        **_actions(run),
        "graph": graph,
        "oob": True,
    }
    if changed_header:
        context.update(
            new_checkpoints=runinfo.checkpoints_after(run, shown_head) if head_moved else [],
            head=Checkpoint.objects.filter(run=run, seq=run.head_seq).only("size").first(),
            forks=_forks(run),
            source=_source(run),
            children=_children(run),
            parent=_parent(run),
            trace=runinfo.trace_of(run),
            recoveries=runinfo.recoveries(run),
            failure=runinfo.failure(run) if graph is None else None,
        )
    if head_moved:
        context.update(_inspector_update(request, run))
    return page(request, "dashboard/run.html", context, fragment="live")


def _inspector_update(request: HttpRequest, run: Run) -> dict:
    """The inspector after the head moved: a following inspector moves to the new head (in
    the tab it had); one showing a checkpoint the reader chose keeps it, open panels and
    all, and only its head mark changes."""
    shown = params.integer(request.GET, "inspect", run.head_seq)
    follow = request.GET.get("follow") == "1"
    if follow and shown != run.head_seq:
        cp = Checkpoint.objects.filter(run=run, seq=run.head_seq).first()
        if cp is not None:
            return {
                "inspector": runinfo.inspector(run, cp, _tab(request)),
                "follow": True,
                "send_inspector": True,
            }
    return {"inspected_seq": shown, "send_headmark": True}


def _send_form(run: Run) -> SendForm | None:
    """Offered while the run waits for a message, named as the run asked."""
    if not drafts.waits_for_message(run):
        return None
    return SendForm(prefix="send", initial={"name": run.wait_detail})


def _poll_seconds(run: Run) -> int:
    """Poll fast while the run moves, slower while it waits for someone, slowest once it
    is finished (an operator may still resume or roll it back)."""
    if run.status in (RunStatus.QUEUED, RunStatus.RUNNING):
        return 2
    return 5 if run.status == RunStatus.WAITING else 10


def _forks(run: Run) -> list[Run]:
    return list(
        Run.objects.filter(forked_from=run)
        .only("id", "status", "forked_from_seq", "created_at")
        .order_by("created_at")[:20]
    )


def _children(run: Run) -> list[Run]:
    return list(
        Run.objects.filter(parent_run=run)
        .only("id", "agent", "status", "created_at")
        .order_by("created_at")[:50]
    )


def _parent(run: Run) -> Run | None:
    if not run.parent_run_id:
        return None
    return Run.objects.filter(pk=run.parent_run_id).only("id", "agent").first()


def _source(run: Run) -> Run | None:
    if not run.forked_from_id:
        return None
    return Run.objects.filter(pk=run.forked_from_id).only("id", "agent").first()


@require_GET
def timeline_earlier(request: HttpRequest, ref: str) -> HttpResponse:
    run = states.run_or_404(ref)
    before = timeline.decode_before(request.GET.get("before", ""))
    if before is None:
        raise params.BadParameter(
            "before", "must be the position of an earlier page, as the run's page gave it"
        )
    earlier = timeline.latest(run, before=before)
    graphruns.annotate(run, earlier.items)
    context = {"run": run, "timeline": earlier}
    return page(request, "dashboard/run.html", context, fragment="earlier")


@require_GET
def checkpoint_list(request: HttpRequest, ref: str) -> HttpResponse:
    run = states.run_or_404(ref)
    before = params.integer(request.GET, "before")
    rows, more = runinfo.checkpoint_rows(run, before)
    context = {"run": run, "checkpoints": rows, "more_checkpoints": more, "older": True}
    return page(request, "dashboard/run.html", context, fragment="checkpoint_rows")


@require_GET
def tree(request: HttpRequest, ref: str, seq: int) -> HttpResponse:
    """The children of one node of the state tree (a page of them), loaded on expand."""
    run = states.run_or_404(ref)
    cp = states.checkpoint_or_404(run, seq)
    loaded = states.load(cp)
    pointer = request.GET.get("path", "")
    offset = params.integer(request.GET, "offset", 0)
    context: dict = {"run": run, "checkpoint": cp, "error": loaded.error, "pointer": pointer}
    if loaded.ok:
        value = diffview.resolve(loaded.state, pointer)
        if value is diffview.MISSING:
            raise Http404(f"checkpoint #{cp.seq} has nothing at “{params.shown(pointer)}”")
        if diffview.secret_path(pointer):
            value = None
        if type(value) in (dict, list):
            nodes, total = present.tree_children(value, pointer, offset=offset)
            context.update(nodes=nodes, total=total, next_offset=offset + len(nodes))
        else:
            context["full"] = present.full_text(value)
    if not request.htmx:
        url = reverse("dashboard:checkpoint", args=[run.id, cp.seq])
        return redirect(f"{url}?tab=state")
    return page(request, "dashboard/tree.html", context)


@require_GET
def state_json(request: HttpRequest, ref: str, seq: int) -> HttpResponse:
    """The whole state at a checkpoint as a JSON download (secret values redacted)."""
    run = states.run_or_404(ref)
    cp = states.checkpoint_or_404(run, seq)
    loaded = states.load(cp)
    if not loaded.ok:
        return JsonResponse({"error": loaded.error}, status=409)
    state, _ = redact(loaded.state)
    response = JsonResponse(state, safe=False, json_dumps_params={"indent": 2})
    response["Content-Disposition"] = f'attachment; filename="run-{run.short_id}-{cp.seq}.json"'
    return response
