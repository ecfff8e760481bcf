"""What a rollback does to effects, in words and in code.

A rollback never repays on its own (DESIGN: "A rollback never repays on its own"). This
module holds what the rollback preview, the CLI's ``rollback --dry-run`` and the engine share:

- ``sentences``: the plain-words preview, one function for the dashboard and the CLI;
- ``default_target``: where "Roll back" points by default (the last checkpoint before the
  last effect, not the head's parent);
- ``compensation``: the function an effect declared with ``compensate=``, resolved by its
  qualified name and imported only from the agent's own modules, so a name stored in the
  database can never make a worker import and call arbitrary code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from durability import canonical

# The approval a run asks before it performs again an effect done on an abandoned branch:
# its name is this prefix and the effect's key. Agents should not name approvals so.
REPEAT_APPROVAL = "repeat effect: "
# The effect key under which a compensation is journaled (with the undone effect's id).
COMPENSATION_KEY = "__compensate__:"

CHOICES = ("ask", "reuse", "again", "compensate")


@dataclass
class EffectDone:
    """An effect done (or perhaps done) on the branch a rollback would abandon."""

    key: str
    idempotency_key: str
    step: str
    seq: int
    status: str
    id: int = 0
    function: str = ""
    args: Any = None
    result: Any = None
    compensate: str = ""
    # The agent's words for it (``ctx.effect(label=...)``), when it gave some.
    label: str = ""
    # A compensation of this effect already ran (an earlier rollback): not offered again.
    compensated: bool = False

    @property
    def can_compensate(self) -> bool:
        return bool(self.compensate) and not self.compensated and self.status == "done"

    @property
    def is_compensation(self) -> bool:
        """A compensation an earlier rollback ran: the new branch never reaches it again, so
        there is nothing to decide for it."""
        return self.key.startswith(COMPENSATION_KEY)

    @property
    def what(self) -> str:
        if self.is_compensation:
            return f"the compensation of effect {self.key.removeprefix(COMPENSATION_KEY)}"
        return self.label or describe(self.key, self.args)

    @property
    def choices(self) -> list[tuple[str, str]]:
        """The decisions an operator may take for it, as (value, label)."""
        options = [("ask", "ask before doing it again")]
        if self.status == "done":
            options.append(("reuse", "reuse the recorded outcome (same arguments only)"))
        options.append(("again", "perform it again without asking"))
        if self.can_compensate:
            options.append(("compensate", "compensate it now"))
        return options


@dataclass
class Preview:
    """What the preview needs besides the effects."""

    target_seq: int
    target_step: str
    will_run_from: str
    effects: list[EffectDone] = field(default_factory=list)
    children: list[tuple[str, str, str]] = field(default_factory=list)  # (id, agent, status)
    messages_back: int = 0
    approvals_superseded: int = 0


def describe(key: str, args: Any) -> str:
    """An effect in the operator's terms: its key and its arguments, short:
    ``refund (A1001, 349 EUR)`` reads better than an idempotency key."""
    shown: list[str] = []
    if isinstance(args, list) and len(args) == 2:
        positional, named = args
        shown += [_short(v) for v in positional if v is not None]
        if isinstance(named, dict):
            shown += [f"{k}={_short(v)}" for k, v in named.items()]
    return f"{key} ({', '.join(shown)})" if shown else key


def words_for(effect: Any) -> str:
    """A recorded effect (an ``Effect`` row) in the operator's terms: the agent's label, else
    its key and arguments (``describe``)."""
    return effect.label or describe(
        effect.key, canonical.loads(effect.args) if effect.args else None
    )


def owed(run: Any) -> list[str]:
    """The compensations the operator ticked at the rollback that made the run's head and
    that have not run yet, in the agent's words ("refund 200 EUR on order A-1002, by
    reverse_refund"): the run's next step performs them first, whenever it goes on (continued
    from hold, or resumed after a cancel). Empty for any other run."""
    from durability.models import AbandonedEffect, Effect, Repeat

    ticked = list(
        AbandonedEffect.objects.filter(
            run=run, rollback__seq=run.head_seq, choice=Repeat.COMPENSATE
        ).select_related("effect")
    )
    if not ticked:
        return []
    keys = [f"{COMPENSATION_KEY}{a.effect_id}" for a in ticked]
    done = set(Effect.objects.filter(run=run, key__in=keys).values_list("key", flat=True))
    return [
        f"{words_for(a.effect)}, by {a.effect.compensate.rsplit('.', 1)[-1]}"
        for a in ticked
        if f"{COMPENSATION_KEY}{a.effect_id}" not in done
    ]


def _short(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        text = value
    else:
        text = canonical.dumps(value).decode() if value is not None else "null"
    return text if len(text) <= 40 else text[:39] + "…"


def sentences(
    preview: Preview, decisions: dict[int, str] | None = None, *, hold: bool = True
) -> list[str]:
    """The preview in plain words: what happens to the run, to each effect done after the
    target, to children, messages and approvals. ``decisions``: effect id -> choice (default
    "ask"); ``hold``: the run is left on hold (the default) rather than continued."""
    decisions = decisions or {}
    said = [_the_run(preview, hold)]
    if not preview.effects:
        said.append(
            f"Nothing was done outside the system after checkpoint #{preview.target_seq}:"
            " no effect to undo or to ask about."
        )
    compensated = [e for e in preview.effects if decisions.get(e.id) == "compensate"]
    if compensated:
        when = "when the run is continued" if hold else "at once"
        said.append(
            f"Compensated {when}, before any step runs: "
            + "; ".join(
                f"{e.what}, undone by {e.compensate.rsplit('.', 1)[-1]}" for e in compensated
            )
            + ". Each compensation is journaled and sent once, with its own idempotency key."
        )
    for e in preview.effects:
        if decisions.get(e.id) != "compensate":
            said.append(_kept_effect(e, decisions.get(e.id, "ask")))
    return said + _the_rest(preview)


def _the_run(preview: Preview, hold: bool) -> str:
    after = f" (after step {preview.target_step})" if preview.target_step else ""
    if not preview.will_run_from:
        return (
            f"The run goes back to checkpoint #{preview.target_seq}{after}, which is its end:"
            " it is marked succeeded and nothing runs."
        )
    if hold:
        return (
            f"The run goes back to checkpoint #{preview.target_seq}{after} and is put on hold:"
            f" nothing runs until an operator continues it (next step: {preview.will_run_from})."
        )
    return (
        f"The run goes back to checkpoint #{preview.target_seq}{after} and continues at once"
        f" with step {preview.will_run_from}."
    )


def _kept_effect(e: EffectDone, choice: str) -> str:
    """An effect done after the target and not compensated: what it did, and what happens
    if the new branch reaches it again."""
    if e.status != "done":
        done = f"{e.what} may have been done (its outcome is unknown) and is not undone"
    elif e.compensate and not e.compensated:
        done = (
            f"{e.what} was done and will not be undone (it can be compensated: choose compensate)"
        )
    elif e.compensated:
        done = f"{e.what} was done and was already compensated by an earlier rollback"
    else:
        done = f"{e.what} was done and will not be undone (it cannot be undone)"
    if e.is_compensation:
        return f"{done}."
    if choice == "reuse":
        then = (
            f"if the run reaches {e.key} again with the same arguments, the recorded outcome"
            " is used and nothing is sent; with other arguments it stops and asks"
        )
    elif choice == "again":
        then = f"if the run reaches {e.key} again, it is performed again without asking"
    else:
        then = (
            f"if the run reaches {e.key} again, it stops and asks an operator before doing it"
            " a second time"
        )
    return f"{done}; {then}."


def _the_rest(preview: Preview) -> list[str]:
    """Children cancelled, messages back to the inbox, approvals withdrawn."""
    said = []
    if preview.children:
        names = ", ".join(
            f"{agent} {cid[:8]} ({status})" for cid, agent, status in preview.children
        )
        n = len(preview.children)
        said.append(
            f"{n} child run{'s' if n != 1 else ''} started after #{preview.target_seq} and still"
            f" unfinished {'are' if n != 1 else 'is'} cancelled: {names}."
        )
    if preview.messages_back:
        n = preview.messages_back
        said.append(
            f"{n} message{'s' if n != 1 else ''} consumed after #{preview.target_seq}"
            f" go{'es' if n == 1 else ''} back to the inbox of the run, in the order"
            f" {'they' if n != 1 else 'it'} arrived."
        )
    if preview.approvals_superseded:
        n = preview.approvals_superseded
        said.append(
            f"{n} pending approval{'s' if n != 1 else ''} on the abandoned branch"
            f" {'are' if n != 1 else 'is'} withdrawn (superseded)."
        )
    return said


def check_decisions(effects: list[EffectDone], decisions: dict[Any, Any]) -> dict[int, str]:
    """The per-effect decisions of a rollback, checked: each names an effect of this plan
    and a choice it allows. Raises ``ValueError`` with a sentence otherwise."""
    by_id = {e.id: e for e in effects}
    checked: dict[int, str] = {}
    for raw_id, choice in (decisions or {}).items():
        try:
            effect_id = int(raw_id)
        except (TypeError, ValueError):
            raise ValueError(f"{raw_id!r} is not an effect id") from None
        effect = by_id.get(effect_id)
        if effect is None:
            raise ValueError(
                f"effect {effect_id} was not done on the branch this rollback abandons"
            )
        if effect.is_compensation:
            raise ValueError(f"{effect.what} is not reached again: there is nothing to decide")
        if choice not in CHOICES:
            raise ValueError(
                f"the decision for {effect.key} must be one of {', '.join(CHOICES)}, not {choice!r}"
            )
        if choice == "compensate" and not effect.can_compensate:
            why = (
                "it was already compensated"
                if effect.compensated
                else "its outcome is not known"
                if effect.status != "done"
                else "the agent declared no compensation for it"
            )
            raise ValueError(f"{effect.what} cannot be compensated: {why}")
        if choice == "reuse" and effect.status != "done":
            raise ValueError(
                f"{effect.what} has no recorded outcome to reuse (it is {effect.status})"
            )
        checked[effect_id] = choice
    return checked


# --- compensation functions ---------------------------------------------------------------------


def compensation_name(fn: Callable) -> str:
    """The name ``compensate=`` is stored under: a module-level function, so that the worker
    that compensates (perhaps days later, after a deploy) finds it by name."""
    module = getattr(fn, "__module__", "") or ""
    qualname = getattr(fn, "__qualname__", "") or ""
    if not module or not qualname or "<" in qualname or "." in qualname:
        raise ValueError(
            f"compensate= must be a function defined at the top level of a module (got"
            f" {module}.{qualname or fn!r}): it is stored by name and found again at"
            " compensation time"
        )
    return f"{module}.{qualname}"


def agent_modules(agent: Any) -> set[str]:
    """The modules an agent's steps are defined in, and their package's siblings: the only
    places a stored compensation name may be imported from."""
    modules = {getattr(fn, "__module__", "") for fn in agent.steps.values()}
    modules.discard("")
    packages = {m.rsplit(".", 1)[0] for m in modules if "." in m}
    return modules | packages


def compensation(agent: Any, name: str) -> Callable:
    """The function stored as ``name``, if it lives in the agent's own modules (or a module
    of the same package); ``LookupError`` with a sentence otherwise."""
    module_name, _, attr = name.rpartition(".")
    allowed = agent_modules(agent)
    parent = module_name.rsplit(".", 1)[0] if "." in module_name else module_name
    if module_name not in allowed and parent not in allowed:
        raise LookupError(
            f"compensation {name} is not in agent {agent.name}'s own modules"
            f" ({', '.join(sorted(allowed))}); it is not imported"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        raise LookupError(f"compensation {name} is not found in this worker's code") from None
    if not callable(fn):
        raise LookupError(f"compensation {name} is not a function")
    return fn


def default_target(run: Any) -> int | None:
    """Where "Roll back" points first: the checkpoint the run's last effect (on its current
    branch) was done from, i.e. the last one before it, so that undoing the run's most recent
    outside action is one click; without effects, the head's parent. None: nothing to go
    back to."""
    from durability.models import Checkpoint, Effect, EffectStatus

    rows = list(Checkpoint.objects.filter(run=run).values_list("id", "parent_id", "seq"))
    parents = {i: p for i, p, _ in rows}
    seq_of = {i: s for i, _, s in rows}
    head = next((i for i, _, s in rows if s == run.head_seq), None)
    branch = []
    cp = head
    while cp is not None:
        branch.append(cp)
        cp = parents.get(cp)
    if len(branch) < 2:
        return None
    on_branch = set(branch)
    # Filtered here, not with thousands of query parameters (a run's effects are few).
    bases = (
        Effect.objects.filter(run=run)
        .exclude(status__in=(EffectStatus.FAILED, EffectStatus.WOULD_RUN, EffectStatus.RETRY))
        .exclude(key__startswith=COMPENSATION_KEY)
        .order_by("-id")
        .values_list("base_id", flat=True)
    )
    last = next((b for b in bases if b in on_branch), None)
    if last is not None and last != head:
        return seq_of[last]
    return seq_of[branch[1]]
