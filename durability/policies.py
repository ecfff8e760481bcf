"""An agent's policies: small frozen objects that group the options that belong together.

    Agent("research", retry=RetryPolicy(max_retries=6, base=0.5, cap=10),
          durability=DurabilityPolicy("periodic", every_steps=20),
          limits=Limits(max_concurrent=4, calls={"llm": "openai"}),
          retention=Retention(keep_days=30, keep_checkpoints="snapshots"))

Each is checked when it is made, and a bad value is refused with a sentence that names the
option (``RetryPolicy.max_retries must be a whole number >= 0, not -1``). Being frozen, one
policy can be shared by several agents and nothing changes it behind their back.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from durability.errors import AgentDefinitionError

DURABILITY_LEVELS = ("strict", "relaxed", "replicated", "periodic")
KEEP_CHECKPOINTS = ("all", "snapshots")


def _refuse(option: str, must: str, value: Any) -> AgentDefinitionError:
    return AgentDefinitionError(f"{option} must be {must}, not {value!r}")


def _whole(option: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise _refuse(option, f"a whole number >= {least}", value)


def _positive(option: str, value: Any, *, zero: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and not zero):
        raise _refuse(option, "a number >= 0" if zero else "a number > 0", value)


@dataclass(frozen=True)
class RetryPolicy:
    """How a step that raised a transient error is retried: up to ``max_retries`` times, after
    an exponential backoff from ``base`` seconds up to ``cap`` with jitter. ``Transient`` and
    ``RateLimited`` are always transient; ``transient`` names more exception types."""

    max_retries: int = 5
    base: float = 1.0
    cap: float = 300.0
    transient: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        _whole("RetryPolicy.max_retries", self.max_retries, 0)
        _positive("RetryPolicy.base", self.base)
        _positive("RetryPolicy.cap", self.cap)
        if self.cap < self.base:
            raise _refuse("RetryPolicy.cap", f"at least base ({self.base})", self.cap)
        transient = tuple(self.transient)
        for kind in transient:
            if not (isinstance(kind, type) and issubclass(kind, BaseException)):
                raise _refuse("RetryPolicy.transient", "a tuple of exception classes", kind)
        object.__setattr__(self, "transient", transient)

    def backoff(self, retries: int, retry_after: float | None = None) -> float:
        """Exponential backoff with "equal jitter": half fixed, half random, so that many
        runs failing together do not retry together."""
        ceiling = min(self.cap, self.base * (2**retries))
        delay = ceiling / 2 + random.uniform(0, ceiling / 2)
        if retry_after is not None:
            delay = max(delay, float(retry_after))
        return delay

    def is_transient(self, exc: BaseException) -> bool:
        from durability.errors import Transient

        if isinstance(exc, Transient):
            return True
        return bool(self.transient) and isinstance(exc, self.transient)


@dataclass(frozen=True)
class DurabilityPolicy:
    """The durability level (see docs/architecture.md): ``strict``, ``relaxed``,
    ``replicated`` or ``periodic``; ``periodic`` checkpoints every ``every_steps`` steps or
    ``every_seconds`` seconds, whichever comes first. ``Agent(durability="relaxed")`` is the
    short form of ``DurabilityPolicy("relaxed")``."""

    level: str = "strict"
    every_steps: int = 10
    every_seconds: float = 5.0

    def __post_init__(self) -> None:
        if self.level not in DURABILITY_LEVELS:
            raise _refuse("durability", f"one of {', '.join(DURABILITY_LEVELS)}", self.level)
        _whole("DurabilityPolicy.every_steps", self.every_steps, 1)
        _positive("DurabilityPolicy.every_seconds", self.every_seconds)


def _frozen_calls(calls: Any) -> Mapping[str, str]:
    if not isinstance(calls, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and k and v for k, v in calls.items()
    ):
        raise _refuse("Limits.calls", "a mapping of call key to resource name (text)", calls)
    return MappingProxyType(dict(calls))


@dataclass(frozen=True)
class Limits:
    """How much of the shared world the agent's runs take: at most ``max_concurrent`` runs
    execute at once across all workers (None: no limit); ``calls`` maps a call key to a
    rate-limited resource of ``DURABILITY_RATE_LIMITS`` (``{"llm": "openai"}``)."""

    max_concurrent: int | None = None
    calls: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_concurrent is not None:
            _whole("Limits.max_concurrent", self.max_concurrent, 1)
        object.__setattr__(self, "calls", _frozen_calls(self.calls))

    def get(self, key: str) -> str | None:
        """The resource that ``ctx.call(key, ...)`` takes a request from, if any."""
        return self.calls.get(key)


@dataclass(frozen=True)
class Retention:
    """How long a finished run is kept: deleted ``keep_days`` after it ends (None: never);
    with ``keep_checkpoints="snapshots"``, its checkpoints older than ``compact_after_days``
    are folded into snapshots."""

    keep_days: float | None = None
    keep_checkpoints: str = "all"
    compact_after_days: float = 7.0

    def __post_init__(self) -> None:
        if self.keep_days is not None:
            _positive("Retention.keep_days", self.keep_days, zero=True)
        if self.keep_checkpoints not in KEEP_CHECKPOINTS:
            raise _refuse(
                "Retention.keep_checkpoints", "'all' or 'snapshots'", self.keep_checkpoints
            )
        _positive("Retention.compact_after_days", self.compact_after_days, zero=True)


def policy(option: str, value: Any, kind: type, shorthand: type | None = None) -> Any:
    """``value`` as a ``kind`` policy: None gives the defaults, a ``shorthand`` value (a
    durability level's name) the policy it stands for; anything else is refused."""
    if value is None:
        return kind()
    if isinstance(value, kind):
        return value
    if shorthand is not None and isinstance(value, shorthand):
        return kind(value)
    raise _refuse(option, f"a {kind.__name__}", value)
