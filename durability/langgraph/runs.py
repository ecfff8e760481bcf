"""Which runs are executed outside the workers: decided here, in one function.

A LangGraph graph compiled with ``DurableSaver`` in its user's own process stores each
namespace of a thread as a run (``durability.langgraph.models.Thread``), but no worker ever
executes it: the graph goes on only when that process invokes it again. Such a run is shown
like any other, and every action that needs a worker to carry it out (resume, cancel, roll
back, fork, decide an approval, resolve an effect, send a message) is refused on it
(``ExecutedElsewhere``, DUR120) and not offered by the dashboard.

``outside_workers`` is the one place that decides it; the dashboard, the CLI and the
engine's operations ask it. It goes by how the run was made, not by its name: a graph
registered as an agent is executed by the workers in runs of its own, which hold no thread
(``registered``), and a saver refuses a registered agent's name (``options.check``), so
that a run the saver made is never handed to a worker, whatever the registry says later.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from durability.errors import ExecutedElsewhere
from durability.langgraph.models import Thread
from durability.models import Run

# How such a run is marked, on the runs list, on its page and in the CLI.
BADGE = "LangGraph · runs in your process"


def outside_workers(run: Run, *, has_thread: bool | None = None) -> bool:
    """Whether ``run`` is executed outside the workers: whether it holds a LangGraph thread
    (``has_thread``, when the caller already knows)."""
    if has_thread is None:
        has_thread = Thread.objects.filter(run_id=run.pk).exists()
    return has_thread


def outside_workers_among(runs: Iterable[Run]) -> set[Any]:
    """The ids of those of ``runs`` executed outside the workers (one query for all)."""
    found = list(runs)
    threads = set(
        Thread.objects.filter(run_id__in=[r.pk for r in found]).values_list("run_id", flat=True)
    )
    return {r.pk for r in found if outside_workers(r, has_thread=r.pk in threads)}


def refuse_outside_workers(run: Run, action: str) -> None:
    """Raise ``ExecutedElsewhere`` if ``run`` is executed outside the workers: ``action``
    (resume, cancel...) needs a worker. The message says how to go on instead."""
    if not outside_workers(run):
        return
    # Where its last checkpoint left it: an interrupt waiting is answered, not invoked on.
    from durability.langgraph.describe import waiting

    raise ExecutedElsewhere(
        f"cannot {action}: this run is the LangGraph graph {run.agent!r} executed in its own"
        " process with DurableSaver, not by the workers, so no worker can carry that out;"
        f" nothing was changed. {waiting(run).how_to_continue}",
        run_id=run.pk,
    )


def thread_config(thread: Thread | None) -> str:
    """The graph's config for the thread, as Python source. A subgraph's namespace goes on
    with its whole thread: the root graph is invoked, never the namespace."""
    return json.dumps({"configurable": {"thread_id": thread.thread_id if thread else "..."}})


def continue_code(
    thread: Thread | None,
    *,
    interrupted: bool = False,
    ids: Sequence[str] = (),
    ended: bool = False,
) -> str:
    """The call that continues the graph on its thread, as Python source. ``ids``: the
    interrupts waiting, when there are several: LangGraph then wants one answer per
    interrupt id, and refuses a single value. ``ended``: the graph reached its end, and goes
    on only with new input (a new turn)."""
    if ended:
        given = "<new input>"
    elif ids:
        given = "Command(resume={" + ", ".join(f"{i!r}: ..." for i in ids) + "})"
    else:
        given = "Command(resume=...)" if interrupted else "None"
    return f"graph.invoke({given}, {thread_config(thread)})"


def how_to_continue(
    thread: Thread | None,
    *,
    interrupted: bool = False,
    ids: Sequence[str] = (),
    ended: bool = False,
) -> str:
    """One sentence: what continues the graph, in its own process."""
    code = continue_code(thread, interrupted=interrupted, ids=ids, ended=ended)
    if ended:
        return f"It reached its end; a new turn invokes it again with new input: {code}"
    if ids:
        return f"Answer each interrupt, by its id, from the graph's own process: {code}"
    if interrupted:
        return f"Answer it from the graph's own process: {code}"
    return f"Continue it from the graph's own process: {code} goes on from its last checkpoint"
