"""Agents the benchmarks run, in this process and in Celery workers (``bench.settings``
loads this module through ``DURABILITY_AGENT_MODULES``).

Everything a run needs comes from its input, since workers are other processes. Steps do
not use ``ctx`` unless they measure it, so the same functions can be called in a plain loop
(the baseline the engine's overhead is measured against).
"""

from __future__ import annotations

import base64
import os
import time
from typing import Any

from durability import END, Agent

# Step entry times (perf_counter) of the steps run in this process: consecutive differences
# are the time per step, the step function included.
STAMPS: list[float] = []
# Steps started in this process, for ``should_stop`` callbacks that pause a run at a count.
COUNTER = [0]

CONTENT_CHARS = 1000  # a message's text; with its JSON wrapping a message is about 1 KB


def random_text(chars: int = CONTENT_CHARS) -> str:
    """Incompressible text (base64 of random bytes), so TOAST compression flatters nothing."""
    raw = os.urandom((chars * 3) // 4 + 3)
    return base64.b64encode(raw).decode()[:chars]


# A small pool of texts so steps do not pay os.urandom on every call; each use is made
# unique by a prefix, so every step really changes its message.
_POOL = [random_text() for _ in range(64)]


def ring_state(inp: dict[str, Any]) -> dict[str, Any]:
    """A state of about ``kb`` KB: ``kb`` messages of about 1 KB each."""
    count = max(1, int(inp["kb"]))
    return {
        "i": 0,
        "n": int(inp["n"]),
        "messages": [{"role": "user", "content": random_text()} for _ in range(count)],
    }


def rotate(state: dict[str, Any], ctx: Any) -> str:
    """Change about 1 KB, keeping the size constant: a ring buffer of messages in which
    each step overwrites the oldest. One step = one ~1 KB change whatever the state size."""
    STAMPS.append(time.perf_counter())
    i = state["i"]
    messages = state["messages"]
    messages[i % len(messages)] = {
        "role": "assistant" if i % 2 else "user",
        "content": f"{i:09d}" + _POOL[i % len(_POOL)][9:],
    }
    state["i"] = i + 1
    return "rotate" if i + 1 < state["n"] else END


ring = Agent(
    "bench-ring",
    version="1",
    steps={"rotate": rotate},
    initial_state=ring_state,
    description="ring buffer of ~1 KB messages; each step replaces one",
)


def slide(state: dict[str, Any], ctx: Any) -> str:
    """A sliding window: append a ~1 KB message and drop the oldest, as agents trimming their
    history do. The same ~1 KB change as ``rotate``, expressed as a shift of the list."""
    STAMPS.append(time.perf_counter())
    i = state["i"]
    messages = state["messages"]
    messages.pop(0)
    messages.append({"role": "user", "content": f"{i:09d}" + _POOL[i % len(_POOL)][9:]})
    state["i"] = i + 1
    return "slide" if i + 1 < state["n"] else END


window = Agent(
    "bench-window",
    version="1",
    steps={"slide": slide},
    initial_state=ring_state,
    description="sliding window of ~1 KB messages; each step appends one, drops the oldest",
)


def fake_llm(prompt: str) -> dict[str, Any]:
    return {"text": f"answer to {prompt}", "usage": {"prompt_tokens": 10, "completion_tokens": 5}}


def rotate_with_call(state: dict[str, Any], ctx: Any) -> str:
    """``rotate`` plus one journaled call, whose result is written when it returns (its own
    transaction): the cost of ``ctx.call`` on top of a step."""
    STAMPS.append(time.perf_counter())
    reply = ctx.call("llm", fake_llm, f"turn {state['i']}")
    i = state["i"]
    messages = state["messages"]
    messages[i % len(messages)] = {
        "role": "assistant",
        "content": reply["text"][:40] + _POOL[i % len(_POOL)][40:],
    }
    state["i"] = i + 1
    return "rotate_with_call" if i + 1 < state["n"] else END


ring_call = Agent(
    "bench-ring-call",
    version="1",
    steps={"rotate_with_call": rotate_with_call},
    initial_state=ring_state,
    description="bench-ring with one journaled call per step",
)


def append(state: dict[str, Any], ctx: Any) -> str:
    """Append 1 KB of incompressible text: storage grows by the change, or it should."""
    COUNTER[0] += 1
    state["messages"].append({"role": "user", "content": random_text(1024)})
    state["i"] += 1
    return "append" if state["i"] < state["n"] else END


appender = Agent(
    "bench-append",
    version="1",
    steps={"append": append},
    initial_state=lambda inp: {"i": 0, "n": int(inp["n"]), "messages": []},
    description="appends 1 KB of incompressible text per step",
)


def tick(state: dict[str, Any], ctx: Any) -> str:
    """A long-running step loop for the recovery and soak figures. Each step appends its
    start time and process id to a file (a side channel outside the engine and its
    database), so the benchmark sees when a step runs again after a kill."""
    inp = ctx.input
    log = inp.get("log")
    if log:
        line = f"{time.time():.6f} {os.getpid()} {state['i']}\n".encode()
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write(2) in append mode: lines never interleave
        finally:
            os.close(fd)
    spin = float(inp.get("spin_s", 0))
    if spin:
        until = time.perf_counter() + spin
        while time.perf_counter() < until:  # CPU work, for the oversubscribed soak
            pass
    pause = float(inp.get("sleep_s", 0))
    if pause:
        time.sleep(pause)  # stands for an LLM or tool call in flight
    state["i"] += 1
    return "tick" if state["i"] < int(inp.get("n", 10**9)) else END


ticker = Agent(
    "bench-tick",
    version="1",
    steps={"tick": tick},
    initial_state=lambda inp: {"i": 0},
    description="endless loop of short steps that log their start to a file",
)
