"""The status of a LangGraph run executed in its own process, from what its saver stores.

No worker holds such a run (``durability.langgraph.runs``), so the saver says where the
graph is, from the checkpoints and writes it stores, through the run's state machine
(``lifecycle.graph_change``) with an event on the timeline. The product's statuses are kept
(none is added for LangGraph):

- the latest checkpoint has tasks to run (it names them in its ``branch:to:<node>``,
  ``__start__`` or ``__pregel_tasks`` channels) and no interrupt: ``waiting``, for the
  graph to go on (it is running in its process, or stopped there mid-run);
- a node called ``interrupt()``: ``waiting``, for "an answer to: <the interrupt's value>";
- the latest checkpoint has no task to run: ``succeeded`` (the graph reached its end;
  invoked again on its thread, it waits again);
- a node raised (LangGraph's error write): ``failed``, with the error, unless the node's
  error handler takes the error (the graph goes on).

Only changes are written: the saver remembers per thread what it reported last, so a
superstep that changes nothing (the usual case) costs nothing here. A checkpoint's report
(a turn starting, the graph ending) is written in the checkpoint's own transaction, so the
two are stored together or not at all, and a turn pays no statement of its own for them; on
PostgreSQL it is part of the checkpoint's statement (the UPDATE of the run that numbers the
checkpoint changes its status too). A report of a task's writes (an interrupt, an error) is
written after them on the saver's thread; one that cannot be written is logged and said
again at the next checkpoint.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from django.db import DatabaseError, connection

from durability import events, lifecycle
from durability.errors import StepError
from durability.langgraph import codec
from durability.langgraph.models import Thread
from durability.models import Event, RunStatus, WaitReason
from durability.redact import redact
from durability.store import langgraph as lg_store
from durability.store.reconnect import drop

if TYPE_CHECKING:  # reading a run for people needs no LangGraph (``describe``)
    from langgraph.checkpoint.base import CheckpointTuple

log = logging.getLogger(__name__)

MID_RUN = (
    "its graph to go on, in its own process (running there, or stopped mid-run: it goes on"
    " when the graph is invoked again on its thread)"
)
ANSWER = "an answer to: "
INTERRUPT, ERROR, RESUME = "__interrupt__", "__error__", "__resume__"
# Written beside a task's error when a node's error handler takes it: the graph goes on.
HANDLED = "__error_source_node__"
_START, _SENT = "__start__", "__pregel_tasks"
# LangGraph's channel that sends the graph to a node: "branch:to:<node>".
BRANCH = "branch:to:"


def next_nodes(values: Mapping[str, Any]) -> list[str]:
    """The nodes a checkpoint's channel values say run next (empty: the graph's end).
    ``__pregel_tasks`` stands for tasks sent with ``Send``: the channel stays, empty, in
    the checkpoints after they ran."""
    found = [key[len(BRANCH) :] for key in values if key.startswith(BRANCH)]
    return found + [_START] * (_START in values) + [_SENT] * bool(values.get(_SENT))


def node_of(task_path: str) -> str:
    """The node a task ran, from LangGraph's task path ("~__pregel_pull, model"; a node's
    error handler's: "~__pregel_pull, model, node_error_handler, ..."; a functional API
    ``@task`` call's nests its caller's: "~__pregel_push, ~__pregel_pull, flow, ..."). A
    task sent with ``Send`` ("~__pregel_push, 0000000002, ...") is named by its checkpoint's
    channel values, not its path (``sent_index``, ``named``): "a sent task" here."""
    parts = [p.strip() for p in task_path.split(",")]
    if len(parts) >= 3 and parts[0] == "~__pregel_pull" and parts[2] == "node_error_handler":
        return f"{parts[1]}'s error handler"
    if len(parts) >= 2 and parts[0] == "~__pregel_pull":
        return parts[1]
    if len(parts) >= 3 and parts[0] == "~__pregel_push" and parts[1] == "~__pregel_pull":
        return f"a task called by {parts[2]}"
    return "a sent task" if parts[0] == "~__pregel_push" else ""


def sent_index(task_path: str) -> int | None:
    """Where a task sent with ``Send`` is in the ``__pregel_tasks`` channel of the
    checkpoint it ran from (LangGraph's path "~__pregel_push, 0000000002, ..."); None for
    any other task."""
    parts = task_path.split(",", 2)
    if len(parts) >= 2 and parts[0].strip() == "~__pregel_push" and parts[1].strip().isdigit():
        return int(parts[1])
    return None


def stored_sends(values: Any, serde: Any) -> tuple[str, ...]:
    """``_sends_of`` a checkpoint's channel values as stored: "" for a packet that does not
    decode (a name for people: the generic one will do)."""
    packets = values.get(_SENT) if isinstance(values, dict) else None
    if not isinstance(packets, list):
        return ()
    decoded = []
    for packet in packets:
        try:
            decoded.append(codec.decode(packet, serde))
        except Exception:  # noqa: BLE001
            decoded.append(None)
    return _sends_of({_SENT: decoded})


def named(node: str, sent: int | None, sends: Sequence[str]) -> str:
    """A task's node: a sent task's by its place among its checkpoint's sends (``sends``,
    ``_sends_of``), where they name it; else ``node``, its path's (``node_of``)."""
    if sent is not None and 0 <= sent < len(sends) and sends[sent]:
        return sends[sent]
    return node


def shown(value: Any, limit: int = 400) -> str:
    """A value as one line of JSON (redacted; a copy, the caller's object is untouched)."""
    try:
        copy = json.loads(json.dumps(value, default=repr))
    except (TypeError, ValueError):
        copy = repr(value)
    copy, _ = redact(copy)
    text = copy if isinstance(copy, str) else json.dumps(copy, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Reporter:
    """What one saver last reported per thread, and the reports still to write.

    LangGraph may store a task's writes before the checkpoint they belong to (its
    checkpoints are put in order, its writes beside them, in the background): an interrupt
    or an error is kept by its checkpoint's id and counts once that checkpoint is the
    latest put, never for an older one.

    Checkpoints and writes arrive on several threads at once, and each report is written
    later on the saver's thread: reports are made one at a time, numbered, and one made
    before a report already written is dropped, so a late "going on" never overwrites the
    interrupt that came after it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made = itertools.count()
        self._written: dict[int, int] = {}  # thread -> number of the last report written
        self._said: dict[int, str] = {}
        self._latest: dict[int, tuple[str, int]] = {}  # thread -> (checkpoint id, seq)
        # thread -> checkpoint id -> task id -> what it stopped on: every task of a
        # superstep may stop it (parallel branches each calling ``interrupt()``).
        self._stops: dict[int, dict[str, dict[str, Stop]]] = {}
        # thread -> (checkpoint id, the nodes its sent tasks run, in order): a sent task's
        # path gives only its place among them (``sent_index``).
        self._sends: dict[int, tuple[str, tuple[str, ...]]] = {}

    def known(self, thread: Thread) -> None:
        """What ``thread``'s run (loaded with it) says, so that a report that would change
        nothing (a new thread's first checkpoint: its run was made waiting for the graph to
        go on) costs no transaction."""
        run = thread.run
        with self._lock:
            if thread.pk in self._said:
                return
            if (
                run.status == RunStatus.WAITING
                and run.wait_reason == WaitReason.GRAPH
                and run.wait_detail == MID_RUN
            ):
                self._said[thread.pk] = f"wait:{MID_RUN}"
            elif run.status == RunStatus.SUCCEEDED:
                self._said[thread.pk] = "end:"

    def forget(self, threads: Iterable[int]) -> None:
        """Drop what is kept of ``threads`` (their saver forgot them): a report for one made
        later is written, whether or not it changes anything."""
        with self._lock:
            for pk in threads:
                for kept in (self._written, self._said, self._latest, self._stops, self._sends):
                    kept.pop(pk, None)

    def put(self, thread: Thread, lg_id: str, values: Any, seq: int) -> Report | None:
        """For checkpoint ``lg_id`` (``values``: its channel values), numbered ``seq``: the
        report to write, if any, with it (``Report.riding``) or after it."""
        with self._lock:
            return self._put(thread, lg_id, values, seq)

    def _put(self, thread: Thread, lg_id: str, values: Any, seq: int) -> Report | None:
        self._latest[thread.pk] = (lg_id, seq)
        self._sent(thread.pk, lg_id, values)
        stops = self._stops.setdefault(thread.pk, {})
        for old in [k for k in stops if k < lg_id]:
            del stops[old]
        if lg_id in stops:
            return self._report(thread, seq, *self._combined(thread.pk, lg_id, stops[lg_id]))
        if next_nodes(values):
            return self._report(thread, seq, "wait", MID_RUN)
        return self._report(thread, seq, "end", "")

    def read(self, thread: Thread, read: CheckpointTuple) -> CheckpointTuple:
        """A checkpoint of ``thread`` was read (returned as it is): the sent tasks of a
        graph taken up again from it are named by it."""
        lg_id = read.config["configurable"]["checkpoint_id"]
        with self._lock:
            if self._latest.get(thread.pk, ("",))[0] <= lg_id:  # not an older one looked at
                self._sent(thread.pk, lg_id, read.checkpoint["channel_values"])
        return read

    def _sent(self, thread: int, lg_id: str, values: Any) -> None:
        if nodes := _sends_of(values):
            self._sends[thread] = (lg_id, nodes)
        else:
            self._sends.pop(thread, None)

    def unsaid(self, thread: Thread) -> None:
        """What was last said of ``thread``'s run was not written: said again at the next
        checkpoint."""
        with self._lock:
            self._said.pop(thread.pk, None)

    def not_stored(self, thread: Thread) -> None:
        """A checkpoint ``put`` was told of may not have been stored (its statement failed):
        what was kept of the thread followed it, so it is all dropped, and the thread's next
        report is written whatever it says (an interrupt on the checkpoint before, read
        again by the next invocation, included)."""
        self.forget({thread.pk})

    def writes(
        self,
        thread: Thread,
        lg_id: str,
        writes: Iterable[tuple[str, Any]],
        task_path: str,
        seq: int,
        task_id: str = "",
        stored: bool = False,
    ) -> Report | None:
        """After a task's writes on checkpoint ``lg_id``: a report for an interrupt or an
        error, if any, once that checkpoint is the latest. ``seq``: the run's head as the
        saver knows it; ``stored``: ``lg_id`` is the checkpoint the saver last read or put
        on this thread (a graph taken up again, in a process that has put nothing yet)."""
        stop = _stop(writes, task_path)
        if stop is None:
            return None
        with self._lock:
            return self._writes(thread, lg_id, stop, seq, task_id or task_path, stored)

    def _writes(
        self, thread: Thread, lg_id: str, stop: Stop, seq: int, task: str, stored: bool
    ) -> Report | None:
        if thread.pk not in self._latest and stored:
            self._latest[thread.pk] = (lg_id, seq)
        # Else, with nothing put yet, the writes may be ahead of their checkpoint (LangGraph's
        # "async" durability puts checkpoints behind the supersteps): they count once it is.
        latest, seq = self._latest.get(thread.pk, ("", seq))
        if lg_id < latest:
            return None
        found = self._stops.setdefault(thread.pk, {}).setdefault(lg_id, {})
        found[task] = stop
        if lg_id != latest:
            return None
        return self._report(thread, seq, *self._combined(thread.pk, lg_id, found))

    def _combined(self, thread: int, lg_id: str, stops: Mapping[str, Stop]) -> tuple[str, str]:
        # A sent task is named by the sends of the checkpoint it ran from, if put or read.
        sent_from, nodes = self._sends.get(thread, ("", ()))
        return _combined(stops, nodes if sent_from == lg_id else ())

    def _report(self, thread: Thread, seq: int, kind: str, text: str) -> Report | None:
        said = f"{kind}:{text}"
        if self._said.get(thread.pk) == said:
            return None
        self._said[thread.pk] = said
        return Report(self, thread, next(self._made), seq, kind, text)


class Report:
    """A change of a run's status that a checkpoint or a task's writes made, numbered as
    it was made. Written either with the checkpoint it follows from, in the same
    transaction (``riding``), or after it on the saver's thread (calling it)."""

    def __init__(
        self, reporter: Reporter, thread: Thread, number: int, seq: int, kind: str, text: str
    ) -> None:
        self.reporter, self.thread, self.number = reporter, thread, number
        self.seq, self.kind, self.text = seq, kind, text

    def __call__(self) -> None:
        """Write it, on the saver's thread, one at a time; nothing if one made after it was
        written already. One that cannot be written is logged and said again at the next
        checkpoint: the checkpoint is stored already."""
        thread = self.thread
        if not self._first():
            return
        try:
            lg_store.for_connection(connection).report(thread.run_id, *self.change())
        except DatabaseError as exc:
            self.unsaid()
            if connection.connection is None or not connection.is_usable():
                drop(connection)  # lost: the saver's next call connects again
            log.warning("run %s: its status was not updated (%s)", thread.run_id, str(exc))
            _forget(exc)

    def riding(self) -> tuple[lifecycle.GraphChange, Event] | None:
        """What to write in the transaction of the checkpoint it follows from (its thread's
        calls one at a time): None if one made after it was written already."""
        if not self._first():
            return None
        return self.change()

    def unsaid(self) -> None:
        """Not written: said again at the next checkpoint."""
        self.reporter.unsaid(self.thread)

    def change(self) -> tuple[lifecycle.GraphChange, Event]:
        """The change through the run's state machine (``lifecycle.graph_change``) and its
        event."""
        return change(self.thread.run_id, self.seq, self.kind, self.text)

    def _first(self) -> bool:
        with self.reporter._lock:
            written = self.reporter._written
            if written.get(self.thread.pk, -1) > self.number:
                return False  # made before one already written: that one is newer
            written[self.thread.pk] = self.number
            return True


class Stop(NamedTuple):
    """What a task stopped its superstep on: ``kind`` "wait" (``text``: what its interrupt
    asks) or "fail" (``text``: its error); its node as its path names it, and, for a task
    sent with ``Send``, its place among its checkpoint's sends, which name it instead."""

    kind: str
    text: str
    node: str = ""
    sent: int | None = None


def _stop(writes: Iterable[tuple[str, Any]], task_path: str) -> Stop | None:
    """What an interrupt or an error among a task's writes says of the run, if any: a
    failure's message, or what the interrupt asks. An error the node's error handler takes
    (LangGraph writes ``HANDLED`` beside it) stops nothing: the graph goes on to the
    handler."""
    writes = list(writes)
    if any(channel == HANDLED for channel, _ in writes):
        return None
    for channel, value in writes:
        if channel == INTERRUPT:
            asked = [getattr(i, "value", i) for i in (value or ())]
            return Stop("wait", "; ".join(shown(v) for v in asked) or "(no value)")
        if channel == ERROR:
            node = node_of(task_path) or "a task"
            # Read back, an error is the text LangGraph stored of it (its repr).
            said = value if isinstance(value, str) else f"{type(value).__name__}: {value}"
            return Stop("fail", said, node, sent_index(task_path))
    return None


def change(run_id: Any, seq: int, kind: str, text: str) -> tuple[lifecycle.GraphChange, Event]:
    """A report (``kind`` "wait", "end" or "fail", and what it says) as the change it makes
    through the run's state machine (``lifecycle.graph_change``) and its event at ``seq``."""
    if kind == "wait":
        wait = WaitReason.INTERRUPT if text.startswith(ANSWER) else WaitReason.GRAPH
        graph_waits = lifecycle.graph_change("graph_waits", detail=text, wait=wait)
        return graph_waits, events.suspended(run_id, wait="", detail=text, seq=seq)
    if kind == "end":
        return lifecycle.graph_change("graph_ended"), events.succeeded(run_id, seq=seq)
    failed = lifecycle.graph_change("graph_failed", error=text, code=StepError.code)
    return failed, events.failed(run_id, message=text, detail={}, seq=seq)


def read_back(values: Any, writes: Iterable[tuple[str, str, str, Any]]) -> tuple[str, str]:
    """What a stored checkpoint says of its run, as ``Reporter`` says it of one being put
    (for a checkpoint LangGraph goes back to: ``pruning``): ``values``, its channel values,
    and ``writes``, its tasks' (task id, task path, channel, value), decoded, in LangGraph's
    order. An interrupt answered already (a ``__resume__`` write beside it) stops nothing:
    the graph goes on with the answer."""
    tasks: dict[str, tuple[str, list[tuple[str, Any]]]] = {}
    for task_id, path, channel, value in writes:
        tasks.setdefault(task_id, (path, []))[1].append((channel, value))
    answered = any(channel == RESUME for _, found in tasks.values() for channel, _ in found)
    stops = {}
    for task_id, (path, found) in tasks.items():
        stop = _stop(found, path)
        if stop is not None and not (answered and stop.kind == "wait"):
            stops[task_id] = stop
    if stops:
        return _combined(stops, _sends_of(values))
    return ("wait", MID_RUN) if next_nodes(values) else ("end", "")


def _combined(stops: Mapping[str, Stop], sends: Sequence[str]) -> tuple[str, str]:
    """One status for what a superstep's tasks stopped on. A failure wins: the graph
    cannot go on before it is dealt with. Interrupts of parallel tasks are all named (each
    needs its answer), in the order their tasks were stored. ``sends``: the nodes of the
    checkpoint's sent tasks, which name them (``_sends_of``)."""
    for stop in stops.values():
        if stop.kind == "fail":
            node = named(stop.node, stop.sent, sends)
            return "fail", shown(f"node {node} raised {stop.text}", 2000)
    return "wait", ANSWER + "; ".join(stop.text for stop in stops.values())


def _sends_of(values: Any) -> tuple[str, ...]:
    """The nodes a checkpoint's ``Send`` packets (its channel values, decoded) go to, in
    order; "" for one that names none."""
    packets = values.get(_SENT) if isinstance(values, dict) else None
    nodes = (getattr(p, "node", "") for p in packets or ())
    return tuple(node if isinstance(node, str) else "" for node in nodes)


def _forget(exc: BaseException | None) -> None:
    """Drop the tracebacks of a handled error and its causes: the connection keeps the error
    it rolled back for (Django's ``rollback_exc``), and its frames would keep the saver,
    and with it its connections, alive."""
    while exc is not None:
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
