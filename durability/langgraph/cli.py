"""The CLI's words for a LangGraph graph executed in its own process (``durability list``
and ``durability show``): the mark, what it waits for, how to continue it, its supersteps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from durability import operations
from durability.errors import DurabilityError
from durability.langgraph import describe
from durability.langgraph.runs import BADGE, outside_workers, outside_workers_among
from durability.langgraph.status import ANSWER
from durability.models import Checkpoint, Run

SUPERSTEPS_SHOWN = 50


def marks(rows: list[Run]) -> dict[Any, str]:
    """For ``list``: the mark of each run executed outside the workers."""
    return dict.fromkeys(outside_workers_among(rows), BADGE)


def show(say: Callable[[str], None], run: Run) -> None:
    """For ``show``: the run as its graph's, if it is executed outside the workers."""
    if not outside_workers(run):
        return
    try:
        head = operations.state_at(run)
    except DurabilityError:
        head = {}
    waiting = describe.waiting(run, head.get("values") if isinstance(head, dict) else None)
    thread = waiting.thread
    say(f"{BADGE}: thread {thread.thread_id if thread else '?'} of graph {run.agent}")
    if run.wait_detail.startswith(ANSWER):
        say(f"  waiting for {run.wait_detail}")
    elif waiting.next:
        say(f"  next: {', '.join(waiting.next)}")
    if run.status != "succeeded":
        say(f"  {waiting.how_to_continue}")
    say("  resume, cancel, rollback, fork, approve, resolve and send are refused: they need a")
    say("  worker, and no worker executes this run (DUR120)")
    seqs = Checkpoint.objects.filter(run=run).order_by("-seq").values_list("seq", flat=True)
    steps = describe.supersteps(run.pk, list(seqs[:SUPERSTEPS_SHOWN]))
    say("supersteps:")
    for seq in sorted(steps):
        step = steps[seq]
        say(f"  #{seq:<4} {step.title:<14} {step.summary}".rstrip())
