"""A message an operator typed that was not sent, kept for the run's page to show again.

A send refused because the run moved on since the page was drawn (a colleague answered, the
run went on, it was rolled back) lands the operator back on the run's page as it is now: what
they typed is put back in the form rather than lost, or, when the run no longer waits for a
message, quoted in the notice. Kept in the operator's session, one draft
per run, taken by the next drawing of that run's page.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from durability.models import Run, RunStatus, WaitReason

_KEY = "dashboard-send-drafts"
# At most this many runs' drafts in one session: an operator's tabs, not a store.
_KEPT = 20
# How much of a draft a notice quotes when there is no form to put it back in.
QUOTED = 500


def waits_for_message(run: Run) -> bool:
    """Whether the run's page offers the send form."""
    return run.status == RunStatus.WAITING and run.wait_reason == WaitReason.MESSAGE


def keep(request: HttpRequest, run: Run, text: str, as_json: bool) -> None:
    """Keep ``text`` for the next drawing of ``run``'s page."""
    drafts = dict(request.session.get(_KEY, {}))
    drafts.pop(str(run.pk), None)
    drafts[str(run.pk)] = {"text": text, "as_json": as_json}
    while len(drafts) > _KEPT:
        drafts.pop(next(iter(drafts)))
    request.session[_KEY] = drafts


def take(request: HttpRequest, run: Run) -> dict[str, Any] | None:
    """The draft kept for ``run``, if any; it is shown once."""
    drafts = request.session.get(_KEY)
    if not drafts or str(run.pk) not in drafts:
        return None
    drafts = dict(drafts)
    draft = drafts.pop(str(run.pk))
    request.session[_KEY] = drafts
    return draft


def quoted(text: str) -> str:
    """``text`` as a notice quotes it."""
    return text if len(text) <= QUOTED else text[: QUOTED - 1] + "…"
