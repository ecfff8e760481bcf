"""The diff between any two checkpoints: of one run, or of a run and its fork."""

from __future__ import annotations

from urllib.parse import urlencode

from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_GET

from dashboard import diffview, params, present, states
from dashboard.views.common import page
from durability.models import Checkpoint, Run

SHOWN = 200


def _sides(request: HttpRequest, run: Run) -> tuple[Run, Checkpoint, Run, Checkpoint]:
    """The two checkpoints asked for: ``b`` (default the head) and ``a`` (default the one
    before ``b``, or for a fork's first checkpoint the one it was forked from)."""
    b_run = states.run_or_404(request.GET["b_run"]) if request.GET.get("b_run") else run
    b_seq = request.GET.get("b") or b_run.head_seq
    b_cp = states.checkpoint_or_404(b_run, b_seq)
    if request.GET.get("a", "") != "":
        a_run = states.run_or_404(request.GET["a_run"]) if request.GET.get("a_run") else run
        a_cp = states.checkpoint_or_404(a_run, request.GET["a"])
        return a_run, a_cp, b_run, b_cp
    previous = states.previous_of(b_run, b_cp)
    if previous is None:
        return b_run, b_cp, b_run, b_cp
    a_run, a_seq = previous
    return a_run, states.checkpoint_or_404(a_run, a_seq), b_run, b_cp


def _query(a_run: Run, a_cp: Checkpoint, b_run: Run, b_cp: Checkpoint) -> dict[str, str]:
    return {"a_run": str(a_run.id), "a": str(a_cp.seq), "b_run": str(b_run.id), "b": str(b_cp.seq)}


@require_GET
def diff(request: HttpRequest, ref: str) -> HttpResponse:
    run = states.run_or_404(ref)
    a_run, a_cp, b_run, b_cp = _sides(request, run)
    layout = params.choice(request.GET, "view", ("unified", "split"), "unified")
    offset = params.integer(request.GET, "offset", 0)
    old, new = states.load_pair(a_cp, b_cp)
    error = old.error or new.error
    result = diffview.compare(old.state, new.state) if not error else None
    base = _query(a_run, a_cp, b_run, b_cp)
    here = reverse("dashboard:diff", args=[run.id])
    context = {
        "nav": "runs",
        "run": run,
        "a_run": a_run,
        "a_cp": a_cp,
        "b_run": b_run,
        "b_cp": b_cp,
        "layout": layout,
        "error": error,
        "diff": result,
        "groups": [
            (g.key, [present.change_view(c) for c in g.changes])
            for g in (result.groups(offset, SHOWN) if result else [])
        ],
        "offset": offset,
        "shown_to": min(offset + SHOWN, len(result.changes)) if result else 0,
        "next_url": (
            f"{here}?{urlencode({**base, 'view': layout, 'offset': offset + SHOWN})}"
            if result and offset + SHOWN < len(result.changes)
            else ""
        ),
        "words_url": f"{reverse('dashboard:diff_words', args=[run.id])}?{urlencode(base)}",
        "unified_url": f"{here}?{urlencode({**base, 'view': 'unified'})}",
        "split_url": f"{here}?{urlencode({**base, 'view': 'split'})}",
        "swap_url": f"{here}?{urlencode(_swapped(base, layout))}",
        "related": _related(a_run, b_run),
    }
    response = page(request, "dashboard/diff.html", context, fragment="result")
    if request.htmx:
        # The address bar names the pair compared (defaults filled in), so the address
        # after "Compare" opens this same diff for whoever it is sent to.
        shared = {**base, "view": layout, **({"offset": str(offset)} if offset else {})}
        response["HX-Push-Url"] = f"{here}?{urlencode(shared)}"
    return response


def _swapped(base: dict[str, str], layout: str) -> dict[str, str]:
    return {
        "a_run": base["b_run"],
        "a": base["b"],
        "b_run": base["a_run"],
        "b": base["a"],
        "view": layout,
    }


def _related(*runs: Run) -> list[Run]:
    """Runs worth comparing with: the sources and forks of the runs on screen."""
    ids = {r.id for r in runs}
    sources = {r.forked_from_id for r in runs if r.forked_from_id}
    found = Run.objects.filter(forked_from_id__in=ids) | Run.objects.filter(pk__in=sources)
    return [
        r
        for r in found.only("id", "agent", "head_seq", "forked_from_id", "forked_from_seq")[:20]
        if r.id not in ids
    ]


@require_GET
def diff_words(request: HttpRequest, ref: str) -> HttpResponse:
    """Word-level marks for one long text that changed, loaded when its row is expanded."""
    run = states.run_or_404(ref)
    a_run, a_cp, b_run, b_cp = _sides(request, run)
    pointer = request.GET.get("path", "")
    old, new = states.load(a_cp), states.load(b_cp)
    context: dict = {"error": old.error or new.error}
    if not context["error"]:
        before = diffview.resolve(old.state, pointer)
        after = diffview.resolve(new.state, pointer)
        if diffview.secret_path(pointer):
            context["error"] = "a secret value: not shown"
        elif type(before) is not str or type(after) is not str:
            context["error"] = "both sides must be text for a word diff"
        else:
            context["segments"] = diffview.word_diff(before, after)
    return page(request, "dashboard/words.html", context)
