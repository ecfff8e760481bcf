"""A LangGraph run read for people (the dashboard and the CLI): its supersteps, what each
node wrote, what runs next, the interrupts waiting, and channel values as readable JSON.

A checkpoint's superstep is made by the tasks that ran from its parent checkpoint: their
writes are stored against the parent (``PendingWrite``), each with its task path, which
names its node. What runs next from a checkpoint is in its channel values
(``status.next_nodes``). An interrupt is a write on the ``__interrupt__`` channel of the
checkpoint it happened on; the answer given with ``Command(resume=...)`` a ``__resume__``
write beside it. Reading needs no LangGraph, but for values LangGraph serialised
(interrupts, messages stored by earlier versions): those are decoded with LangGraph's
serializer where it is installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from durability import canonical
from durability.agents import registry
from durability.errors import IntegrityViolation, UnknownAgent
from durability.langgraph import codec
from durability.langgraph.models import PendingWrite, SavedCheckpoint, Thread
from durability.langgraph.runs import continue_code, how_to_continue
from durability.langgraph.status import (
    BRANCH,
    ERROR,
    HANDLED,
    INTERRUPT,
    RESUME,
    named,
    node_of,
    sent_index,
    shown,
    stored_sends,
)
from durability.store.lg_sql import AGENT_VERSION

_JOIN = "join:"
_SPECIAL = (INTERRUPT, ERROR, RESUME)


@dataclass
class Task:
    """One task of a superstep: its node, the channels it wrote, where it routed."""

    node: str
    sent: int | None = None  # sent with ``Send``: where in its checkpoint's ``__pregel_tasks``
    channels: list[str] = field(default_factory=list)
    routes: list[str] = field(default_factory=list)
    error: str = ""
    handled: bool = False  # the node's error handler took ``error``
    interrupts: list[tuple[str, str]] = field(default_factory=list)  # (value as JSON, id)
    answers: list[str] = field(default_factory=list)

    @property
    def summary(self) -> str:
        """ "model wrote messages, turns → tools"."""
        node = "input" if self.node == "__start__" else self.node
        text = f"{node} wrote {', '.join(self.channels)}" if self.channels else node
        if self.routes:
            text += f" → {', '.join(self.routes)}"
        if self.error:
            handled = ", handled by its error handler" if self.handled else ""
            text += f" (raised {self.error}{handled})"
        return text


@dataclass
class Superstep:
    """A checkpoint of a LangGraph run, as LangGraph's metadata and writes tell it."""

    seq: int
    lg_id: str
    source: str
    step: Any
    tasks: list[Task] = field(default_factory=list)  # the ones that made this checkpoint

    @property
    def title(self) -> str:
        if self.source == "input":
            return "input"
        if self.source == "update":
            return "state updated (update_state)"
        if self.source == "fork":
            return "forked (time travel)"
        return f"superstep {self.step}"

    @property
    def summary(self) -> str:
        return "; ".join(t.summary for t in self.tasks)


@dataclass
class Waiting:
    """Where a LangGraph run's latest checkpoint leaves it."""

    thread: Thread | None
    next: list[str]
    # (node, the interrupt's value as JSON, LangGraph's id for it or "")
    interrupts: list[tuple[str, str, str]]
    errors: list[tuple[str, str]]

    @property
    def ended(self) -> bool:
        """The graph reached its end: no task to run, nothing asked, nothing failed."""
        return not (self.next or self.interrupts or self.errors)

    @property
    def how_to_continue(self) -> str:
        asked = bool(self.interrupts)
        return how_to_continue(self.thread, interrupted=asked, ids=self.ids, ended=self.ended)

    @property
    def code(self) -> str:
        asked = bool(self.interrupts)
        return continue_code(self.thread, interrupted=asked, ids=self.ids, ended=self.ended)

    @property
    def ids(self) -> list[str]:
        """The interrupts' ids when each needs its own answer (more than one waits, each
        with its id)."""
        ids = [i for _, _, i in self.interrupts]
        return ids if len(ids) > 1 and all(ids) else []


def is_graph_checkpoint(checkpoint: Any) -> bool:
    """Whether a checkpoint row was written by the saver (its state is a LangGraph doc)."""
    return getattr(checkpoint, "agent_version", "") == AGENT_VERSION


def is_graph_state(checkpoint: Any) -> bool:
    """Whether a checkpoint's state is a LangGraph document: the saver wrote it, or the
    workers did for a graph registered as an agent (``durability.langgraph.agent``), whose
    checkpoints keep the saver's shape."""
    return is_graph_checkpoint(checkpoint) or registered_graph(checkpoint.run.agent)


def registered_graph(agent: str) -> bool:
    """Whether ``agent`` names a graph registered as an agent (executed by the workers)."""
    try:
        return bool(getattr(registry.get(agent), "langgraph_state", False))
    except UnknownAgent:
        return False


def serde() -> Any:
    """LangGraph's default serializer, or None where LangGraph is not installed."""
    try:
        from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
    except ImportError:
        return None
    return JsonPlusSerializer()


def readable(doc: Any) -> Any:
    """A stored LangGraph state (``checkpoint``, ``values``, ``metadata``) with each
    serialised value decoded to readable JSON; as stored where LangGraph is missing."""
    found = serde()
    shown = doc if found is None else codec.readable(doc, found)
    if not isinstance(shown, dict):
        return shown
    # The channel values first: what a person opens a state or a diff for.
    first = {key: shown[key] for key in ("values", "metadata") if key in shown}
    return {**first, **{k: v for k, v in shown.items() if k not in first}}


def _value(text: str, found: Any) -> Any:
    value = canonical.loads(text)
    if found is None:
        return value
    try:
        return codec.decode(value, found)
    except Exception:  # noqa: BLE001 - a view must not fail on one bad value
        return value


def _tasks(rows: Iterable[tuple], found: Any) -> dict[str, list[Task]]:
    """Writes (checkpoint id, task id, task path, channel, value or None) grouped into the
    tasks of each checkpoint's superstep."""
    by_task: dict[tuple[str, str], Task] = {}
    for lg_id, task_id, path, channel, text in rows:
        task = by_task.get((lg_id, task_id))
        if task is None:
            task = by_task[lg_id, task_id] = Task(node_of(path), sent_index(path))
        if channel.startswith(BRANCH):
            task.routes.append(channel[len(BRANCH) :])
        elif channel.startswith(_JOIN):
            # A node waiting for several ("join:a+b:c"): the task routes to c, once all did.
            task.routes.append(channel.rsplit(":", 1)[-1])
        elif channel == INTERRUPT:
            asked = _value(text, found)
            task.interrupts += [
                (shown(getattr(i, "value", i)), str(getattr(i, "id", "") or ""))
                for i in asked or ()
            ]
        elif channel == RESUME:
            task.answers.append(shown(codec.json_view(_value(text, found))))
        elif channel == ERROR:
            error = _value(text, found)
            # Stored, an exception is its repr ("ValueError('...')"), as LangGraph stores it.
            said = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            task.error = shown(said, 300)
        elif channel == HANDLED:
            task.handled = True
        elif not channel.startswith("__"):
            task.channels.append(channel)
    grouped: dict[str, list[Task]] = {}
    for (lg_id, _), task in by_task.items():
        if task.node:
            grouped.setdefault(lg_id, []).append(task)
    return grouped


def writes_of(thread_pk: int, lg_ids: Iterable[str]) -> dict[str, list[Task]]:
    """The tasks that ran from each of ``lg_ids``, with what they wrote (values read only
    for interrupts, answers and errors)."""
    ids = list(lg_ids)
    rows = PendingWrite.objects.filter(thread_id=thread_pk, checkpoint_id__in=ids)
    cols = ("checkpoint_id", "task_id", "task_path", "channel")
    plain = rows.exclude(channel__in=_SPECIAL).order_by("task_id", "idx").values_list(*cols)
    special = rows.filter(channel__in=_SPECIAL).order_by("task_id", "idx")
    found = serde() if special.exists() else None
    return _tasks([(*r, "") for r in plain] + list(special.values_list(*cols, "value")), found)


def _name_sent(run_id: Any, thread_pk: int, tasks: dict[str, list[Task]]) -> None:
    """Name the tasks sent with ``Send`` after their nodes, which only the ``__pregel_tasks``
    channel of the checkpoint they ran from holds: the states of the checkpoints that sent
    tasks (those alone) are rebuilt, in one pass. Where LangGraph is missing, or a state
    does not rebuild (``durability verify`` says why), they stay "a sent task"."""
    sent = [lg for lg, found in tasks.items() if any(t.sent is not None for t in found)]
    found = serde() if sent else None
    if found is None:
        return
    from durability.langgraph import reader  # LangGraph is there: ``serde`` found it

    ids = dict(
        SavedCheckpoint.objects.filter(thread_id=thread_pk, lg_id__in=sent).values_list(
            "checkpoint_id", "lg_id"
        )
    )
    with contextlib.suppress(IntegrityViolation):
        reader.each_state(
            run_id,
            set(ids),
            lambda cp_id, state: _named(tasks[ids[cp_id]], state.get("values"), found),
        )


def _named(tasks: list[Task], values: Any, found: Any) -> None:
    """Name the sent ones of a checkpoint's ``tasks`` from its channel values as stored."""
    sends = stored_sends(values, found)
    for task in tasks:
        task.node = named(task.node, task.sent, sends)


def supersteps(run_id: Any, seqs: Iterable[int]) -> dict[int, Superstep]:
    """The supersteps of the run's checkpoints ``seqs`` (those the saver wrote)."""
    saved = list(
        SavedCheckpoint.objects.filter(checkpoint__run_id=run_id, checkpoint__seq__in=list(seqs))
        .values_list("checkpoint__seq", "lg_id", "lg_parent_id", "metadata", "thread_id")
        .order_by("checkpoint__seq")
    )
    if not saved:
        return {}
    tasks = writes_of(saved[0][4], [row[2] for row in saved if row[2]])
    _name_sent(run_id, saved[0][4], tasks)
    shown_steps = {}
    for seq, lg_id, parent, metadata, _ in saved:
        md = metadata if isinstance(metadata, dict) else {}
        source = str(md.get("source", ""))
        # Only a superstep is made by the tasks that ran from its parent. An update_state or
        # a fork from a checkpoint is not: that checkpoint's writes are the tasks of the
        # branch that went on from it before (time travel leaves them there).
        made_by = tasks.get(parent, []) if parent and source == "loop" else []
        shown_steps[seq] = Superstep(seq, lg_id, source, md.get("step"), made_by)
    return shown_steps


def waiting(run: Any, head_values: Any = None) -> Waiting:
    """What the run's latest checkpoint says: the nodes to run next (from its channel
    values, ``head_values``, when the caller read them), interrupts waiting, errors."""
    from durability.langgraph.status import next_nodes

    thread = Thread.objects.filter(run_id=run.pk).first()
    head = (
        SavedCheckpoint.objects.filter(checkpoint__run_id=run.pk, checkpoint__seq=run.head_seq)
        .values_list("lg_id", flat=True)
        .first()
    )
    tasks = writes_of(thread.pk, [head]).get(head, []) if thread and head else []
    if any(t.sent is not None for t in tasks) and (found := serde()) is not None:
        _named(tasks, head_values, found)
    answered = any(t.answers for t in tasks)
    interrupts = [] if answered else [(t.node, v, i) for t in tasks for v, i in t.interrupts]
    errors = [(t.node, t.error) for t in tasks if t.error and not t.handled]
    values = head_values if isinstance(head_values, dict) else {}
    return Waiting(thread, next_nodes(values), interrupts, errors)
