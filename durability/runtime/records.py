"""What a step's operations are checked and replayed against: the records made from one
base checkpoint, the hash of a call's arguments, and what a what-if fork may reuse.

Every durable operation is identified by (base checkpoint, key, occurrence): the base is the
checkpoint the step execution started from and the occurrence counts repeats of a key within
that execution. A replay that reaches the same identity with another function or other
arguments raises ``NonDeterminismError`` rather than return the wrong result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from durability import canonical, events
from durability.models import (
    AbandonedEffect,
    Approval,
    ApprovalStatus,
    CallKind,
    Effect,
    Event,
    EventKind,
    JournalEntry,
    Message,
    Repeat,
    Run,
)
from durability.redact import accepted_hashes, keyed_hash

if TYPE_CHECKING:
    from durability.runtime.sendahead import Settled


def outcome_recorded[T](write: Callable[[], T]) -> T:
    """``write()``, which records what this process holds (a call's result, an effect's
    start or outcome), retried while the database is away (``store.reconnect``). A worker
    that can still record an outcome does: it is never asked for again, or left pending for
    an operator to call "in doubt". Every write passed here is safe to repeat
    (insert-if-absent, conditional updates)."""
    from durability.store import reconnect

    return reconnect.retrying(write)


def function_name(fn: Callable) -> str:
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(type(fn))
    return f"{module}.{name}" if module else name


def unhashable(value: Any) -> Any:
    # Clients, sessions and the like stand in by type: their identity is not the input.
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _args_bytes(args: tuple, kwargs: dict) -> bytes:
    import orjson

    return orjson.dumps(
        [list(args), kwargs],
        default=unhashable,
        option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS,
    )


def args_hash(args: tuple, kwargs: dict) -> str:
    """The stored hash of a call's arguments: keyed (``redact.keyed_hash``), so that it
    verifies no secret among them."""
    return ArgsHash(args, kwargs).value


class ArgsHash:
    """The arguments of one call or effect, hashed under the current key; ``matches`` also
    accepts what rows written under a fallback key or before hashes were keyed hold."""

    __slots__ = ("_data", "_accepted", "value")

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self._data = _args_bytes(args, kwargs)
        self._accepted: set[str] | None = None
        self.value = keyed_hash(self._data)

    def matches(self, stored: str) -> bool:
        if stored == self.value:
            return True
        if self._accepted is None:
            self._accepted = accepted_hashes(self._data)
        return stored in self._accepted


class WhatIf:
    """What a what-if fork may reuse: the source run's records after the fork point, each at
    most once, matched by key, function and arguments, in the order they were recorded. A
    what-if run spawned by one has no source (``source_id`` None): it reuses nothing and
    never diverges, and performs no effect unless ``live``, as its parent."""

    def __init__(self, run_id: Any, source_id: Any, from_seq: int, live: bool) -> None:
        self.run_id = run_id
        self.source_id = source_id
        self.from_seq = from_seq
        self.live = live
        self._pool: list[JournalEntry] | None = None
        self._diverged: bool | None = None

    def _candidates(self) -> list[JournalEntry]:
        if self._pool is None and self.source_id is None:
            self._pool = []
        if self._pool is None:
            used = set(
                JournalEntry.objects.filter(run_id=self.run_id)
                .exclude(reused_from=None)
                .values_list("reused_from", flat=True)
            )
            self._pool = [
                e
                for e in JournalEntry.objects.filter(
                    run_id=self.source_id, base__seq__gte=self.from_seq
                )
                .exclude(kind=CallKind.SLEEP)
                .order_by("id")
                if e.pk not in used
            ]
        return self._pool

    def take(self, key: str, function: str, ahash: ArgsHash) -> JournalEntry | None:
        pool = self._candidates()
        for i, entry in enumerate(pool):
            if entry.key == key and entry.function == function and ahash.matches(entry.args_hash):
                return pool.pop(i)
        return None

    def diverge(self, proof: Settled, ctx: Any, key: str) -> None:
        """The first call the source never made: mark where the fork diverged, once."""
        if self.source_id is None:
            return
        if self._diverged is None:
            self._diverged = Event.objects.filter(
                run_id=self.run_id, kind=EventKind.DIVERGED
            ).exists()
        if self._diverged:
            return
        self._diverged = True
        at = {"seq": ctx.seq, "step": ctx.step, "worker": ctx.worker}
        events.record(events.diverged(self.run_id, key=key, source=self.source_id, **at))


@dataclass
class Records:
    """The operations recorded from one base checkpoint, loaded once per step execution."""

    journal: dict[tuple[str, int], JournalEntry]
    effects: dict[tuple[str, int], Effect]
    approvals: dict[tuple[str, int], Approval]
    # Keyed by occurrence: the columns are nullable, but set on every row loaded here.
    messages: dict[tuple[str, int | None], Message]
    children: dict[tuple[str, int | None], Run]
    # When the base is a rollback's new head: the compensations the operator ticked.
    compensations: list[AbandonedEffect] = field(default_factory=list)
    # Keys of the run's effects done on branches a rollback abandoned: only a new effect with
    # one of them can need a second decision. Read once per execution and carried to later
    # bases: a rollback that adds some bumps the lease token, so this execution is fenced
    # out at its next write before it could miss them.
    abandoned_keys: frozenset[str] = frozenset()

    @classmethod
    def empty(cls, abandoned_keys: frozenset[str] = frozenset()) -> Records:
        return cls({}, {}, {}, {}, {}, abandoned_keys=abandoned_keys)

    @classmethod
    def load(cls, base_id: int, run_id: Any) -> Records:
        abandoned = list(
            AbandonedEffect.objects.filter(run_id=run_id)
            .select_related("effect")
            .order_by("effect_id")
        )
        return cls(
            journal={
                (e.key, e.occurrence): e for e in JournalEntry.objects.filter(base_id=base_id)
            },
            effects={(e.key, e.occurrence): e for e in Effect.objects.filter(base_id=base_id)},
            approvals={
                (a.name, a.occurrence): a
                for a in Approval.objects.filter(base_id=base_id).exclude(
                    status=ApprovalStatus.SUPERSEDED
                )
            },
            messages={
                (m.name, m.consumed_occurrence): m
                for m in Message.objects.filter(consumed_base_id=base_id)
            },
            children={
                (r.spawn_key, r.spawn_occurrence): r
                for r in Run.objects.filter(spawn_base_id=base_id).only(
                    "id", "spawn_key", "spawn_occurrence"
                )
            },
            compensations=[
                a for a in abandoned if a.rollback_id == base_id and a.choice == Repeat.COMPENSATE
            ],
            abandoned_keys=frozenset(a.key for a in abandoned),
        )


def jsonable(value: Any) -> Any:
    import orjson

    return orjson.loads(orjson.dumps(value, default=unhashable, option=orjson.OPT_NON_STR_KEYS))


def llm_meta(value: Any) -> str:
    """Model and token counts when a result looks like an OpenAI-style completion."""
    if isinstance(value, dict) and isinstance(value.get("usage"), dict):
        usage = value["usage"]
        meta = {
            "model": value.get("model"),
            "input_tokens": usage.get("prompt_tokens", usage.get("input_tokens")),
            "output_tokens": usage.get("completion_tokens", usage.get("output_tokens")),
        }
        return canonical.dumps(meta).decode()
    return ""
