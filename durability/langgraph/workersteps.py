"""The supersteps of a graph the workers execute, read for people from what each checkpoint
changed.

Such a run's checkpoints are the engine's (its one step, ``graph``, runs one superstep), so no
pending writes name the tasks that made them, as the saver's do (``describe``). The patch of
each checkpoint says it instead, for the cost of reading the patch: the nodes that ran are
those whose ``versions_seen`` entry changed, the channels written those whose version moved,
where the graph goes the ``branch:to:<node>`` channels given a value, and the superstep's
number is its metadata's ``step``. Which of several nodes wrote which channel is not in a
checkpoint: a superstep of parallel nodes names them together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from durability import canonical, diff
from durability.langgraph.status import BRANCH
from durability.models import Mutation

# LangGraph's own entries of ``versions_seen``: not nodes a person wrote.
_NOT_NODES = ("__interrupt__", "__input__")


@dataclass
class Ran:
    """What one superstep of a worker-executed graph did, as its checkpoint's patch says."""

    step: Any = None
    nodes: list[str] = field(default_factory=list)
    channels: list[str] = field(default_factory=list)
    routes: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return "input" if self.step == -1 else f"superstep {self.step}"

    @property
    def summary(self) -> str:
        """ "model wrote messages, turns → tools, audit"."""
        nodes = ["input" if n == "__start__" else n for n in self.nodes]
        text = ", ".join(nodes) or "the graph"
        if self.channels:
            text += f" wrote {', '.join(self.channels)}"
        if self.routes:
            text += f" → {', '.join(self.routes)}"
        return text


def ran(ops: list[dict]) -> Ran:
    """What a checkpoint's patch (RFC 6902 operations on the graph's document) says ran."""
    found = Ran()
    for op in ops:
        parts = diff.split_path(str(op.get("path", "")))
        value = op.get("value")
        if parts == ["checkpoint"] and isinstance(value, dict):  # the first: whole
            _seen(found, value.get("versions_seen") or {}, value.get("channel_versions") or {})
        elif parts == ["metadata"] and isinstance(value, dict):
            found.step = value.get("step")
        elif parts == ["metadata", "step"]:
            found.step = value
        elif parts[:2] == ["checkpoint", "versions_seen"] and len(parts) >= 3:
            _seen(found, {parts[2]: None}, {})
        elif parts[:2] == ["checkpoint", "channel_versions"] and op.get("op") != "remove":
            # A version moved: the channel was written (a branch's moves when it is consumed
            # too: where the graph goes is read from the values instead).
            _seen(found, {}, {parts[2]: None} if len(parts) == 3 else {})
        elif parts == ["values"] and isinstance(value, dict):
            _routes(found, value)
        elif len(parts) == 2 and parts[0] == "values" and op.get("op") != "remove":
            _routes(found, {parts[1]: None})
    return found


def _seen(found: Ran, nodes: Iterable[str], channels: Iterable[str]) -> None:
    for node in nodes:
        if node not in _NOT_NODES and node not in found.nodes:
            found.nodes.append(node)
    for channel in channels:
        if not channel.startswith(("__", BRANCH)) and channel not in found.channels:
            found.channels.append(channel)


def _routes(found: Ran, values: Iterable[str]) -> None:
    """A ``branch:to:<node>`` channel that holds a value: the graph goes to that node."""
    for channel in values:
        target = channel[len(BRANCH) :] if channel.startswith(BRANCH) else ""
        if target and target not in found.routes:
            found.routes.append(target)


def of_run(run_id: Any, seqs: Iterable[int]) -> dict[int, Ran]:
    """The supersteps of a worker-executed graph's checkpoints ``seqs``, by number (those
    whose patch is kept: a snapshot-only checkpoint, a compacted one, says nothing)."""
    rows = Mutation.objects.filter(run_id=run_id, seq__in=list(seqs)).values_list("seq", "ops")
    shown: dict[int, Ran] = {}
    for seq, text in rows:
        try:
            ops = canonical.loads(text)
        except ValueError:
            continue
        if isinstance(ops, list) and ops and seq is not None:
            shown[seq] = ran(ops)
    return shown
