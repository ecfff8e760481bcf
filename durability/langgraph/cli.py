"""The CLI's words for a LangGraph graph executed in its own process (``durability list``
and ``durability show``): the mark, what it waits for, how to continue it, its supersteps."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from durability import canonical, operations
from durability.errors import DurabilityError
from durability.langgraph import describe
from durability.langgraph.runs import BADGE, outside_workers, outside_workers_among
from durability.langgraph.status import ANSWER
from durability.models import Checkpoint, Event, EventKind, Run

SUPERSTEPS_SHOWN = 50


def marks(rows: list[Run]) -> dict[Any, str]:
    """For ``list``: the mark of each run executed outside the workers."""
    return dict.fromkeys(outside_workers_among(rows), BADGE)


def _waiting(run: Run) -> describe.Waiting:
    try:
        head = operations.state_at(run)
    except DurabilityError:  # a head that does not verify: say what the rows say
        head = {}
    return describe.waiting(run, head.get("values") if isinstance(head, dict) else None)


def _supersteps(run: Run) -> dict[int, describe.Superstep]:
    seqs = Checkpoint.objects.filter(run=run).order_by("-seq").values_list("seq", flat=True)
    return describe.supersteps(run.pk, list(seqs[:SUPERSTEPS_SHOWN]))


def as_json(run: Run) -> dict[str, Any] | None:
    """For ``show --json``: the graph's thread, what it waits for, how to continue it and
    its latest supersteps, if the run is a graph executed outside the workers (else None)."""
    if not outside_workers(run):
        return None
    waiting = _waiting(run)
    thread = waiting.thread
    return {
        "executed_by": "its own process (DurableSaver), not the workers",
        "thread_id": thread.thread_id if thread else None,
        "checkpoint_ns": thread.checkpoint_ns if thread else None,
        "copied_from": _copied_from(run),
        "next": list(waiting.next),
        "interrupts": [
            {"node": n, "value": _json(v), "id": i or None} for n, v, i in waiting.interrupts
        ],
        "errors": [{"node": n, "error": e} for n, e in waiting.errors],
        # At its end: the call that starts a new turn.
        "how_to_continue": waiting.code,
        "supersteps": [
            {
                "seq": seq,
                "title": step.title,
                "source": step.source,
                "step": step.step,
                "checkpoint_id": step.lg_id,
                "tasks": [
                    {
                        "node": t.node,
                        "wrote": t.channels,
                        "routes": t.routes,
                        "error": t.error or None,
                        "interrupts": [_json(v) for v, _ in t.interrupts],
                        "answers": [_json(a) for a in t.answers],
                    }
                    for t in step.tasks
                ],
            }
            for seq, step in sorted(_supersteps(run).items())
        ],
    }


def _copied_from(run: Run) -> dict[str, Any] | None:
    """The thread and run this one was copied from (``copy_thread``), if it is a copy."""
    data = (
        Event.objects.filter(run=run, kind=EventKind.CREATED).values_list("data", flat=True).first()
    )
    found = canonical.loads_object(data or "").get("copied_from")
    return found if isinstance(found, dict) else None


def _json(text: str) -> Any:
    """An interrupt's value or an answer, stored as JSON text where it could be encoded."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def show(say: Callable[[str], None], run: Run) -> None:
    """For ``show``: the run as its graph's, if it is executed outside the workers."""
    if not outside_workers(run):
        return
    waiting = _waiting(run)
    thread = waiting.thread
    say(f"{BADGE}: thread {thread.thread_id if thread else '?'} of graph {run.agent}")
    if copied := _copied_from(run):
        say(f"  copied from thread {copied.get('thread_id')} (run {copied.get('run')})")
    if run.wait_detail.startswith(ANSWER):
        say(f"  waiting for {run.wait_detail}")
    elif waiting.next:
        say(f"  next: {', '.join(waiting.next)}")
    if run.status != "succeeded":
        say(f"  {waiting.how_to_continue}")
    say("  resume, cancel, rollback, fork, approve, resolve and send are refused: they need a")
    say("  worker, and no worker executes this run (DUR120)")
    steps = _supersteps(run)
    say("supersteps:")
    for seq in sorted(steps):
        step = steps[seq]
        say(f"  #{seq:<4} {step.title:<14} {step.summary}".rstrip())
