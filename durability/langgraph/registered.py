"""LangGraph graphs executed by the workers: a registered graph is an ``Agent``.

    from durability.langgraph import agent, journaled

    @journaled("search")
    def search(q: str) -> list[str]: ...          # paid once, however often it is replayed

    support = agent("support", build_graph, version="3")   # build_graph() -> a StateGraph

Operators start ``support`` like any agent (dashboard, CLI, API: ``operations.start`` by
name); Celery workers execute it with the engine's claims, leases, fencing, sweeper and
recovery, because to the engine it *is* an agent.

How a graph maps onto the engine
--------------------------------

- **One LangGraph superstep is one step of the run.** The agent has a single step,
  ``graph``, which returns ``graph`` until the graph has nothing left to run, then ``END``.
  Each execution of the step runs exactly one superstep: the graph is compiled with a
  checkpointer that holds one checkpoint in memory (LangGraph's ``InMemorySaver``) and
  invoked with ``interrupt_before="*"``, which stops it before the superstep after the one
  it ran (the first execution also stores the input, as LangGraph does).
- **The run's state is the graph's checkpoint.** After the superstep, the step replaces the
  run's state with the latest LangGraph checkpoint, in the same shape ``DurableSaver``
  stores (``{"checkpoint", "values", "metadata"}``, values as JSON where they are JSON, the
  rest through LangGraph's serializer, ``durability.langgraph.codec``). The worker then
  commits it as it commits any step: a patch on the previous checkpoint (about one message
  per superstep), hash-chained, in the one fenced statement that checks the lease token, so
  a worker that lost its lease stores nothing. There is no second writer to fence: the
  in-memory checkpointer writes nothing durable, and the run's status moves only through
  the executor (``durability.lifecycle``).
- **Recovery is the engine's.** A worker SIGKILLed mid-superstep never committed it; the
  sweeper hands the run to another worker, which rebuilds the last committed checkpoint and
  runs that superstep again, as LangGraph itself re-runs a superstep whose checkpoint was
  not stored. Tasks of the interrupted superstep run again (nodes are at-least-once, as with
  any LangGraph checkpointer), but a call made through ``journaled`` is identified by (run,
  base checkpoint, key, occurrence), as ``ctx.call`` is, so a replayed superstep gets its
  recorded result instead of paying for it again.
- **``interrupt()`` is an approval.** A superstep that stops at ``interrupt()`` asks
  ``ctx.approval`` (named after the node, with the interrupt's value), which suspends the
  run without a worker; after the decision the superstep runs again, meets the same
  interrupt, finds the decision and resumes the node with ``Command(resume=...)`` before
  the step ends, so the committed checkpoint is the one after the resumed superstep.
- **Rollback and fork are LangGraph's time travel.** Every committed checkpoint of the run
  is a LangGraph checkpoint with ``graph`` as its next step, so the engine's rollback and
  fork (with their preview and the rules for effects done after the target) continue the
  graph from any superstep.

``effect`` is ``ctx.effect`` and ``wait_for`` is ``ctx.wait_for`` in the same way. Both, and
``journaled``, are called from LangGraph's task threads: each closes its thread's database
session when it returns, since those threads end with the superstep.

``journaled`` keys are prefixed with the node's name (``"model/search"``): calls of one
node are sequential, so their occurrences replay in the same order even when parallel
branches call the same tool.
"""

from __future__ import annotations

import contextvars
import functools
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from django.db import connection
from langgraph.channels import DeltaChannel
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import StateGraph
from langgraph.pregel import Pregel
from langgraph.types import Command, interrupt

from durability.agents import END, Agent
from durability.errors import AgentDefinitionError, SchemaViolation
from durability.langgraph import codec

F = TypeVar("F", bound=Callable[..., Any])

STEP = "graph"
# The current step's context, for ``journaled`` tools called from inside the graph's nodes
# (LangGraph copies the context into the threads that run parallel tasks).
_current: contextvars.ContextVar[Any] = contextvars.ContextVar("durability_graph_ctx")
# The thread executing the step: its database session is the execution's own and lives on
# with it (a worker of Celery's threads pool is not the main thread), so it is not closed
# after a call; other threads are LangGraph's task threads, which end with the superstep.
_step_thread: contextvars.ContextVar[threading.Thread | None] = contextvars.ContextVar(
    "durability_graph_thread", default=None
)


class StepSaver(InMemorySaver):
    """LangGraph's in-memory checkpointer, holding the one checkpoint a superstep starts
    from. Integer channel versions, as ``DurableSaver``'s: the run's checkpoints then patch
    only what changed, and two runs of one graph store the same bytes."""

    def get_next_version(self, current: Any, channel: None = None) -> int:  # type: ignore[override]
        if current is None:
            return 1
        if isinstance(current, str):
            return int(current.split(".")[0]) + 1
        return int(current) + 1


class GraphAgent(Agent):
    """An agent whose one step runs one superstep of a LangGraph graph (see the module's
    docstring). ``build()`` returns the graph: a ``StateGraph`` (compiled here) or a
    compiled graph (its checkpointer is replaced)."""

    # Its checkpoints hold the saver's document: the dashboard decodes them the same way.
    langgraph_state = True
    # The periodic level commits held steps from inside an effect or a wait, which a graph's
    # node may call from one of LangGraph's threads; and a superstep is the graph's own unit
    # of work: strict, relaxed or replicated, for the agent and for any run of it.
    refused_levels = {
        "periodic": "a graph checkpoints every superstep; durability 'periodic' is for native"
        " agents"
    }

    def __init__(
        self,
        name: str,
        build: Callable[[], Any],
        *,
        approvals: Mapping[str, Mapping[str, Any]] | None = None,
        **options: Any,
    ) -> None:
        if not callable(build):
            raise AgentDefinitionError(f"agent {name}: build must be a function making a graph")
        self.approvals = _approval_options(name, approvals or {})
        level = options.get("durability", "strict")
        if why := self.refused_levels.get(getattr(level, "level", level)):
            raise AgentDefinitionError(f"agent {name}: {why}")
        self.build = build
        self._graph: Any = None
        self._lock = threading.Lock()

        def superstep(state: dict, ctx: Any) -> str:
            return self._superstep(state, ctx)

        # The step is the graph's: an approval's check and an effect's compensation are
        # looked up in the modules that define an agent's steps, here the graph's module.
        superstep.__module__ = getattr(build, "__module__", None) or __name__
        super().__init__(name, steps={STEP: superstep}, initial_state=_initial_state, **options)

    def graph(self, checkpointer: Any) -> Any:
        """The graph compiled with ``checkpointer`` (``build()`` is called once)."""
        with self._lock:
            if self._graph is None:
                built = self.build()
                if not isinstance(built, (StateGraph, Pregel)):
                    raise AgentDefinitionError(
                        f"agent {self.name}: build() returned {type(built).__name__},"
                        " not a LangGraph StateGraph or compiled graph"
                    )
                if isinstance(built, Pregel) and (
                    built.interrupt_before_nodes or built.interrupt_after_nodes
                ):
                    # Each execution stops the graph after its one superstep, which would
                    # override these silently: say so rather than run past them.
                    raise AgentDefinitionError(
                        f"agent {self.name}: the graph is compiled with interrupt_before or"
                        " interrupt_after; a graph the workers execute asks a person with"
                        " interrupt() in the node instead (it becomes an approval)"
                    )
                self._graph = built
        if isinstance(self._graph, StateGraph):
            return self._graph.compile(checkpointer=checkpointer)
        return self._graph.copy(update={"checkpointer": checkpointer})

    def values(self, state: dict) -> Any:
        """The graph's state in a run's state (``operations.state_at``), as LangGraph's
        ``get_state().values`` gives it; None before the graph's first superstep."""
        if "checkpoint" not in state:
            return None
        saver = StepSaver()
        thread: Any = {"configurable": {"thread_id": "values", "checkpoint_ns": ""}}
        seed(saver, thread, state)
        return self.graph(saver).get_state(thread).values

    def initial_state(self, input: Any) -> dict:
        """The run's first state, once LangGraph has taken ``input`` as the graph's first
        values: the graph is invoked on it up to its first node (which does not run, so
        nothing of the graph's own runs), as the run's first superstep will be. Input the
        graph refuses (a value that is not its state's, a message its reducer cannot read)
        is refused here, before a run is made, rather than by the run's first step."""
        state = super().initial_state(input)
        thread: Any = {"configurable": {"thread_id": "input", "checkpoint_ns": ""}}
        graph = self.graph(StepSaver())
        self._check_keys(graph, state["input"])
        try:
            graph.invoke(state["input"], thread, interrupt_before="*")
        except AgentDefinitionError:
            raise  # the graph itself cannot be made: no input would do
        except Exception as exc:  # noqa: BLE001 - whatever LangGraph refuses the input with
            raise SchemaViolation(
                f"input of agent {self.name}: the graph does not take it ({_said(exc)})"
            ) from None
        return state

    def _check_keys(self, graph: Any, given: Any) -> None:
        """LangGraph drops the keys of an input it has no channel for, silently: a misspelt
        one would start a run whose first node finds its value missing. Refused here, naming
        the keys the graph takes."""
        if not isinstance(given, dict):
            return
        try:
            takes = set(graph.get_input_jsonschema().get("properties") or ())
        except Exception:  # noqa: BLE001 - a schema LangGraph cannot describe: not checked
            return
        unknown = sorted(set(given) - takes)
        if takes and unknown:
            raise SchemaViolation(
                f"input of agent {self.name}: the graph takes no {', '.join(map(repr, unknown))}"
                f" (it takes: {', '.join(sorted(takes))}); nothing was started"
            )

    def validate(self, state: Any) -> None:
        """The agent's checks, and the document's shape: an edited state (a fork, an
        approval's edits) that LangGraph could not load is refused before it is stored,
        not when a worker executes it."""
        super().validate(state)
        if "checkpoint" not in state and set(state) == {"input"}:
            return  # before the first superstep
        problem = document_problem(state)
        if problem:
            raise SchemaViolation(
                f"state of agent {self.name} is not a graph checkpoint: {problem}"
            )

    def validate_edit(self, state: Any) -> None:
        """An edited checkpoint must also load: every value decodes (a message's edited
        fields make a valid message)."""
        self.validate(state)
        if "checkpoint" not in state:
            return
        saver = StepSaver()
        # LangGraph loads a value of a channel the graph does not have and drops it at the
        # next superstep: a misspelt channel would be an edit that is never made.
        channels = set(self.graph(saver).channels)
        unknown = sorted(set(state["values"]) - channels)
        if unknown:
            names = sorted(c for c in channels if not c.startswith(("__", "branch:")))
            raise SchemaViolation(
                f"state of agent {self.name}: the graph has no channel"
                f" {', '.join(map(repr, unknown))} (its channels: {', '.join(names)})"
            )
        try:
            seed(saver, {"configurable": {"thread_id": "edit", "checkpoint_ns": ""}}, state)
        except Exception as exc:  # noqa: BLE001 - whatever LangGraph or a message refuses
            # Named down to the value at fault where it is one of the channels' values.
            where, problem = undecodable(state["values"], saver.serde)
            raise SchemaViolation(
                f"state of agent {self.name} is not a graph checkpoint LangGraph can load:"
                f" {where or 'the checkpoint'}: {problem or _said(exc)}"
            ) from None

    def _superstep(self, state: dict, ctx: Any) -> str:
        saver = StepSaver()
        graph = self.graph(saver)
        thread: Any = {"configurable": {"thread_id": str(ctx.run_id), "checkpoint_ns": ""}}
        if "checkpoint" in state:
            seed(saver, thread, state)
            graph_input = None
        else:
            graph_input = state.get("input")
        # Settled here, on the step's own thread: a journaled call made from a thread of
        # LangGraph's then finds the proof (the previous commit answered) in hand.
        ctx.settle()
        token = _current.set(ctx)
        thread_token = _step_thread.set(threading.current_thread())
        try:
            graph.invoke(graph_input, thread, interrupt_before="*")
            # A node may call interrupt() more than once: each resume may stop at the next.
            while resume := decisions(graph.get_state(thread), ctx, self.approvals):
                graph.invoke(Command(resume=resume), thread, interrupt_before="*")
        finally:
            _current.reset(token)
            _step_thread.reset(thread_token)
        latest = saver.get_tuple(thread)
        if latest is None:  # pragma: no cover - the input (never None) is always stored
            raise AgentDefinitionError(f"agent {self.name}: the graph stored no checkpoint")
        after = graph.get_state(latest.config)
        state.clear()
        state.update(document(latest, saver.serde, held(graph, after.values)))
        return STEP if after.next else END


# What ``agent(approvals={node: {...}})`` may say of a node's interrupts: ``ctx.approval``'s.
APPROVAL_OPTIONS = ("editable", "validate", "group", "timeout", "on_timeout", "escalate_to")


def _approval_options(name: str, given: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``approvals`` checked: by node name, ``ctx.approval``'s options (an unknown one is a
    typo that would leave every field editable, or any operator deciding)."""
    if not isinstance(given, Mapping):
        raise AgentDefinitionError(f"agent {name}: approvals must map node names to options")
    checked = {}
    for node, options in given.items():
        mapping = isinstance(options, Mapping)
        unknown = sorted(set(options) - set(APPROVAL_OPTIONS)) if mapping else []
        if not isinstance(node, str) or not mapping or unknown:
            raise AgentDefinitionError(
                f"agent {name}: approvals[{node!r}] takes {', '.join(APPROVAL_OPTIONS)}"
                + (f", not {', '.join(unknown)}" if unknown else "")
            )
        checked[node] = dict(options)
    return checked


def decisions(
    snapshot: Any, ctx: Any, options: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """The answers to the ``interrupt()`` calls the superstep stopped at, by interrupt id:
    each is an approval named after its node, asked with the interrupt's value and the
    node's ``options`` (``agent(approvals=...)``: the fields an operator may edit, a check of
    the edit, who decides, a deadline); the run waits, without a worker, until an operator
    decides; the superstep then runs again and finds the decision. An answer is
    ``{"approved", "value", "comment", "by"}``, ``value`` being the interrupt's value as the
    operator approved it (edited or not)."""
    answers = {}
    for task in snapshot.tasks:
        for waiting in task.interrupts:
            decision = ctx.approval(task.name, waiting.value, **(options or {}).get(task.name, {}))
            answers[waiting.id] = {
                "approved": decision.approved,
                "value": decision.payload,
                "comment": decision.comment,
                "by": decision.by,
            }
    return answers


def _initial_state(input: Any) -> dict:
    if input is None:
        # LangGraph takes an input of None for "go on from the last checkpoint": a new
        # thread has none, so the graph would do nothing at all.
        raise ValueError("a graph needs an input (its first values), not null")
    return {"input": input}


def agent(
    name: str,
    build: Callable[[], Any],
    *,
    version: str | int = "1",
    approvals: Mapping[str, Mapping[str, Any]] | None = None,
    **options: Any,
) -> GraphAgent:
    """Register the graph ``build()`` makes as the agent ``name``: operators start it like
    any agent and the workers execute it, one superstep per checkpoint. ``approvals``: by
    node name, what ``ctx.approval`` takes for that node's ``interrupt()`` (``editable=``,
    ``validate=``, ``group=``, ``timeout=``...); without, every field of the interrupt's
    value may be edited, typed as asked. ``options`` are ``Agent``'s (``retry=``,
    ``durability=``, ``limits=``, ``step_timeout=``, ...)."""
    return GraphAgent(name, build, version=version, approvals=approvals, **options)


def held(graph: Any, values: Any) -> dict[str, Any]:
    """The values of the graph's delta channels (``DeltaChannel``) among ``values`` (its
    ``get_state().values``). LangGraph keeps a delta channel's value out of most checkpoints
    and rebuilds it from older ones; a run's state is one checkpoint with no ancestors to
    rebuild from, so it holds their values whole, as LangGraph reads a channel's value
    stored before it became a delta channel. Kept as patches, they cost what they change,
    and the dashboard shows them at every superstep."""
    names = [name for name, ch in graph.channels.items() if isinstance(ch, DeltaChannel)]
    return {name: values[name] for name in names if isinstance(values, dict) and name in values}


def document(found: Any, serde: Any, whole: dict[str, Any] | None = None) -> dict:
    """A LangGraph checkpoint tuple as the run's state: the shape ``DurableSaver`` stores,
    with ``whole`` (delta channels' values, ``held``) in place of what the checkpoint holds
    of them (nothing, or at LangGraph's snapshots the value wrapped for its walk)."""
    fields = dict(found.checkpoint)
    values = {**fields.pop("channel_values"), **(whole or {})}
    return {
        "checkpoint": codec.Encoder(serde).encode(fields),
        "values": codec.Encoder(serde).encode(values),
        "metadata": codec.Encoder(serde).encode(dict(found.metadata)),
    }


def document_problem(state: dict) -> str:
    """What keeps ``state`` from being a checkpoint ``document`` ("" if nothing)."""
    for key in ("checkpoint", "values", "metadata"):
        if not isinstance(state.get(key), dict):
            return f"{key!r} must be a JSON object (it holds the graph's {key})"
    if set(state) - {"checkpoint", "values", "metadata"}:
        extra = sorted(set(state) - {"checkpoint", "values", "metadata"})
        return f"unknown keys {extra}: only 'checkpoint', 'values' and 'metadata' are kept"
    for key in ("channel_versions", "versions_seen"):
        if not isinstance(state["checkpoint"].get(key), dict):
            return f"checkpoint.{key} must be a JSON object"
    if not isinstance(state["checkpoint"].get("id"), str):
        return "checkpoint.id must be a string (LangGraph's checkpoint id)"
    return ""


def undecodable(values: dict, serde: Any) -> tuple[str, str]:
    """The first channel value (or list item) that does not decode, and why ("" if none)."""
    for channel, value in values.items():
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            try:
                codec.decode(item, serde)
            except Exception as exc:  # noqa: BLE001 - a message's class refusing its fields
                path = f"values.{channel}" + ("" if index is None else f"[{index}]")
                kind = item.get("class") if isinstance(item, dict) else None
                return f"{path}{f' ({kind})' if kind else ''}", _said(exc)
    return "", ""


def _said(exc: Exception) -> str:
    """An exception in a line or two: pydantic's name the field on their second line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' / '.join(lines[:3])}"[:400]


def seed(saver: StepSaver, config: Any, state: dict) -> Any:
    """Put the run's state (a checkpoint ``document``) into ``saver``; the config that
    names it."""
    checkpoint = codec.decode(state["checkpoint"], saver.serde)
    checkpoint["channel_values"] = codec.decode(state["values"], saver.serde)
    metadata = codec.decode(state["metadata"], saver.serde)
    return saver.put(config, checkpoint, metadata, dict(checkpoint["channel_versions"]))


def journaled(key: str) -> Callable[[F], F]:
    """Make a tool a journaled call of the run executing the graph: its JSON result is
    recorded as it returns and replayed, not paid again, when the superstep runs again.
    Outside a registered graph's step (a graph run by hand), the tool simply runs."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            ctx = _current.get(None)
            if ctx is None:
                return fn(*args, **kwargs)
            return _in_node(lambda: ctx.call(f"{_node()}/{key}", fn, *args, **kwargs))

        return call  # type: ignore[return-value]

    return wrap


def effect(key: str, **options: Any) -> Callable[[F], F]:
    """Make a tool a side effect of the run executing the graph (``ctx.effect``): called as
    ``fn(*args, idempotency_key=..., **kwargs)``, performed at most once per identity, shown
    in a rollback's preview and asked again, not repeated, on a branch that reaches it after
    a rollback. ``options`` are ``ctx.effect``'s (``idempotent=``, ``reconcile=``,
    ``compensate=``, ``label=``). Outside a registered graph's step the tool simply runs,
    with a key of its own."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            ctx = _current.get(None)
            if ctx is None:
                return fn(*args, idempotency_key=uuid.uuid4().hex, **kwargs)
            name = f"{_node()}/{key}"
            return _in_node(lambda: ctx.effect(name, fn, *args, **options, **kwargs))

        return call  # type: ignore[return-value]

    return wrap


def wait_for(name: str) -> Any:
    """Inside a node: the next message named ``name`` sent to the run
    (``operations.send``, the API, the CLI), the run waiting without a worker until one
    arrives; the superstep then runs again and this returns the message. Outside a
    registered graph's step it is LangGraph's ``interrupt({"wait_for": name})``: resume it
    with the message."""
    ctx = _current.get(None)
    if ctx is None:
        return interrupt({"wait_for": name})
    return _in_node(lambda: ctx.wait_for(name))


def _in_node(operation: Callable[[], Any]) -> Any:
    try:
        return operation()
    finally:
        if threading.current_thread() is not _step_thread.get():
            # LangGraph's task threads end with the superstep: so does their session.
            connection.close()


def _node() -> str:
    from langgraph.config import get_config

    try:
        return str(get_config().get("metadata", {}).get("langgraph_node", "")) or "graph"
    except RuntimeError:  # called outside a node
        return "graph"
