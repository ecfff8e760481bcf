"""What a saver is given, checked before anything is read or stored: its constructor's
options, and the thread ids and namespaces its calls name. A bad one is refused with a
``ValueError`` (a ``TypeError`` for a value of the wrong kind) that says what is wrong.

A thread id is stored as text of at most 255 characters, a namespace of at most 500, and
PostgreSQL's text holds no NUL character: LangGraph's own in-memory saver takes any value,
so the limits are said here, at the call, rather than by the database's error after it.
"""

from __future__ import annotations

from typing import Any

from durability.agents import registry
from durability.errors import UnknownAgent

THREAD_ID_MAX = 255  # ``Thread.thread_id``
NAMESPACE_MAX = 500  # ``Thread.checkpoint_ns``


def check(
    graph: Any, durability: Any, cached_threads: Any, cached_bytes: Any, connections: Any
) -> None:
    """``DurableSaver``'s options. ``graph`` may not be a registered agent's name: that
    agent's runs are executed by the workers, and runs of a graph in its own process under
    the same name would be counted against its concurrency limit, listed and filtered with
    its runs and measured with them."""
    if not isinstance(graph, str):
        raise TypeError(f"graph must be a name (a string), not {type(graph).__name__}")
    if not graph or len(graph) > 200:
        raise ValueError("graph must be a name of 1 to 200 characters")
    if durability not in ("strict", "relaxed"):
        raise ValueError(f"durability must be 'strict' or 'relaxed', not {durability!r}")
    for name, value, least in (
        ("cached_threads", cached_threads, 1),
        ("cached_bytes", cached_bytes, 0),
        ("connections", connections, 1),
    ):
        if type(value) is not int or value < least:
            raise ValueError(f"{name} must be a whole number >= {least}, not {value!r}")
    try:
        registry.get(graph)
    except UnknownAgent:
        return
    raise ValueError(
        f"graph {graph!r} is the name of a registered agent, whose runs the workers execute:"
        " a graph run in its own process with DurableSaver needs a name of its own (for"
        f" example {graph + '-graph'!r}), so that its runs are not taken for that agent's"
    )


def thread_id(value: Any) -> str:
    """A thread id as stored: its text (LangGraph's configs may hold a number or a UUID)."""
    text = str(value)
    if len(text) > THREAD_ID_MAX or "\x00" in text:
        raise ValueError(
            f"thread_id must be at most {THREAD_ID_MAX} characters with no NUL character"
            f" (got {len(text)} characters starting {text[:40]!r}); nothing was read or stored"
        )
    return text


def key(config: Any) -> tuple[str, str]:
    """The thread id and namespace a call's config names."""
    conf = config["configurable"]
    ns = conf.get("checkpoint_ns", "")
    if not isinstance(ns, str) or len(ns) > NAMESPACE_MAX or "\x00" in ns:
        raise ValueError(
            f"checkpoint_ns must be text of at most {NAMESPACE_MAX} characters with no NUL"
            f" character, not {ns!r:.60}; nothing was read or stored"
        )
    return thread_id(conf["thread_id"]), ns
