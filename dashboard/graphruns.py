"""LangGraph graphs executed in their own process (``durability.langgraph.runs``), on the
dashboard: the mark on the runs list and on the run page, what the graph waits for and how
to continue it from its process, and the run's timeline told as supersteps.

No worker executes these runs, so the page offers none of the actions that need one; it
says why where they would be (the engine refuses them too, DUR120).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dashboard.timeline import Item
from durability import operations
from durability.errors import DurabilityError, ExecutedElsewhere
from durability.langgraph import describe, workersteps
from durability.langgraph.runs import (
    BADGE,
    continue_code,
    outside_workers,
    outside_workers_among,
    refuse_outside_workers,
)
from durability.langgraph.status import ANSWER
from durability.models import EventKind, Run
from durability.store.lg_sql import AGENT_VERSION

NO_ACTIONS = (
    "This run is a LangGraph graph executed by its own process with DurableSaver, not by the"
    " workers: resuming, cancelling, rolling back, forking and sending it a message need a"
    " worker to carry them out, so they are not offered here. Its process continues it."
)


@dataclass
class GraphRun:
    """What the run page says of a graph executed in its own process."""

    run: Run
    waiting: describe.Waiting
    badge: str = BADGE
    no_actions: str = NO_ACTIONS

    @property
    def thread_id(self) -> str:
        return self.waiting.thread.thread_id if self.waiting.thread else ""

    @property
    def namespace(self) -> str:
        return self.waiting.thread.checkpoint_ns if self.waiting.thread else ""

    @property
    def asked(self) -> str:
        """The interrupt's value the graph waits for an answer to ("" if none)."""
        if self.run.wait_detail.startswith(ANSWER):
            return self.run.wait_detail[len(ANSWER) :]
        return ""

    @property
    def code(self) -> str:
        """The call that continues the graph (with an answer, when it waits for one)."""
        asked = bool(self.asked or self.waiting.interrupts)
        ended = self.waiting.ended and not asked
        return continue_code(
            self.waiting.thread, interrupted=asked, ids=self.waiting.ids, ended=ended
        )


def graph_run(run: Run) -> GraphRun | None:
    """The run as a graph executed in its own process, or None if it is not one."""
    if not outside_workers(run):
        return None
    try:
        head = operations.state_at(run)
    except DurabilityError:  # the inspector names a checkpoint that does not verify
        head = {}
    values = head.get("values") if isinstance(head, dict) else None
    return GraphRun(run, describe.waiting(run, values))


def refusal(run: Run, action: str) -> ExecutedElsewhere | None:
    """The engine's refusal of ``action`` on a run executed outside the workers, for a
    page that would otherwise offer a form for it; None for any other run."""
    try:
        refuse_outside_workers(run, action)
    except ExecutedElsewhere as exc:
        return exc
    return None


def graph_agents() -> list[str]:
    """The names LangGraph graphs stored runs under (for the runs list's agent filter)."""
    rows = Run.objects.filter(langgraph_thread__isnull=False).order_by()
    return list(rows.values_list("agent", flat=True).distinct())


def mark_rows(rows: Iterable[Run]) -> None:
    """Mark the runs of a list page that are executed outside the workers (``graph``)."""
    found = list(rows)
    outside = outside_workers_among(found)
    for run in found:
        run.graph = BADGE if run.pk in outside else ""  # type: ignore[attr-defined]


def annotate(run: Run, items: Iterable[Item]) -> None:
    """Tell a LangGraph run's timeline in LangGraph's words: each checkpoint as its
    superstep (which node wrote which channels, where it routed), waits and endings."""
    if run.agent_version != AGENT_VERSION:
        if describe.registered_graph(run.agent):
            _annotate_worker_steps(run, list(items))
        return
    shown = list(items)
    seqs = {i.seq for i in shown if i.kind == EventKind.CHECKPOINT and i.seq is not None}
    steps = describe.supersteps(run.pk, seqs) if seqs else {}
    for item in shown:
        if item.source != "event":
            continue
        if item.kind == EventKind.CHECKPOINT and item.seq in steps:
            step = steps[item.seq]
            item.title = f"checkpoint #{item.seq} · {step.title}"
            item.detail = step.summary
            for task in step.tasks:
                for answer in task.answers:
                    item.facts.append(("answered", answer))
        elif item.kind == EventKind.CREATED:
            item.detail = f"LangGraph graph {run.agent}"
        elif item.kind == EventKind.SUSPENDED:
            item.title = "waiting"
        elif item.kind == EventKind.SUCCEEDED:
            item.title = "reached its end"
            item.detail = "the graph's latest checkpoint has no task to run"


def _annotate_worker_steps(run: Run, shown: list[Item]) -> None:
    """A worker-executed graph's checkpoints as their supersteps: which nodes ran, what
    they wrote, where the graph went (``workersteps``, from each checkpoint's patch)."""
    seqs = {i.seq for i in shown if i.kind == EventKind.CHECKPOINT and i.seq is not None}
    steps = workersteps.of_run(run.pk, seqs) if seqs else {}
    for item in shown:
        if item.source == "event" and item.kind == EventKind.CHECKPOINT and item.seq in steps:
            step = steps[item.seq]
            item.title = f"checkpoint #{item.seq} · {step.title}"
            item.detail = step.summary
