"""``durability show RUN [--json]``: a run's header, checkpoints, approvals, effects and
recent events, as text for a person or as JSON (with the head state) for a program."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from durability import approvals as edits
from durability import canonical, operations, presence, rollbacks, shapes
from durability.errors import IntegrityViolation
from durability.langgraph import workersteps
from durability.langgraph.describe import is_graph_checkpoint, registered_graph
from durability.management.cli.common import json_text
from durability.models import (
    Approval,
    Checkpoint,
    Effect,
    Event,
    JournalEntry,
    Run,
    RunStatus,
)
from durability.redact import redact
from durability.store.lg_sql import AGENT_VERSION

Say = Callable[[str], None]


def show(say: Say, ref: Any, *, as_json: bool) -> None:
    run = operations.get_run(ref)
    cps = list(Checkpoint.objects.filter(run=run).order_by("seq"))
    approvals = list(Approval.objects.filter(run=run).select_related("run").order_by("id"))
    effects = list(Effect.objects.filter(run=run).order_by("id"))
    events = list(Event.objects.filter(run=run).order_by("-id")[:20])
    branch = _branch(run, cps)
    if as_json:
        say(json_text(_as_json(run, cps, approvals, effects, branch)))
        return
    _header(say, run)
    _checkpoints(say, cps, _worker_steps(run, cps))
    _approvals(say, approvals, branch)
    _effects(say, effects)
    _events(say, events, graph=run.agent_version == AGENT_VERSION)


def _branch(run: Run, cps: list[Checkpoint]) -> set[int]:
    """The ids of the checkpoints the run's head descends from (its own included): an
    approval asked from a checkpoint off this branch was rolled back past, and decides
    nothing the run does now."""
    parents = {c.pk: c.parent_id for c in cps}
    head = next((c.pk for c in cps if c.seq == run.head_seq), None)
    found: set[int] = set()
    while head is not None and head not in found:
        found.add(head)
        head = parents.get(head)
    return found


# --- JSON ------------------------------------------------------------------------------------


def _as_json(
    run: Run, cps: list, approvals: list, effects: list, branch: set[int]
) -> dict[str, Any]:
    """The API's run (``GET /api/v1/runs/{id}``, the same names and meanings:
    ``durability.shapes``) with what the text shows beside it: the head state, every
    checkpoint, approval and effect, the count of journaled calls, the run's tree."""
    seqs, steps = _parent_seqs(cps), _worker_steps(run, cps)
    try:
        state, state_error = redact(operations.state_at(run))[0], None
    except IntegrityViolation as exc:
        # Shown as the text is: the run and its history, with why its state is not (verify
        # says which checkpoint).
        state, state_error = None, str(exc)
    return {
        **shapes.run_detail(run),
        "state": state,
        "state_error": state_error,
        "checkpoints": [_checkpoint_json(c, seqs, steps.get(c.seq)) for c in cps],
        "approvals": [_approval_json(a, branch) for a in approvals],
        "effects": [shapes.effect(e) for e in effects],
        "calls": JournalEntry.objects.filter(run=run).count(),
        # What-if: effects recorded as would have run (live: performed), children alike.
        "what_if": {"live": run.what_if_live} if run.what_if else None,
        "tree": operations.tree(run),
    }


def _checkpoint_json(
    c: Checkpoint, seqs: dict[int, int], step: workersteps.Ran | None
) -> dict[str, Any]:
    return {
        **shapes.checkpoint(c, seqs),
        # A graph the workers execute: the superstep this checkpoint is (else null).
        "superstep": (
            {"step": step.step, "nodes": step.nodes, "wrote": step.channels, "routes": step.routes}
            if step is not None
            else None
        ),
    }


def _approval_json(a: Approval, branch: set[int]) -> dict[str, Any]:
    return {
        **shapes.approval(a),
        # False: asked on a branch a rollback abandoned; its decision decides nothing now.
        "on_current_branch": a.base_id in branch,
        # What was decided, where it differs from what was asked, field by field.
        "changes": edits.stored_changes(a),
    }


# --- text ------------------------------------------------------------------------------------


def _what_if(run: Run) -> str:
    if not run.what_if:
        return ""
    if run.what_if_live:
        return " (what-if, live: its effects are performed)"
    return " (what-if: its effects are recorded as would have run, not performed)"


def _header(say: Say, run: Run) -> None:
    ended = f" · {run.outcome}" if run.status == RunStatus.SUCCEEDED and run.outcome else ""
    say(
        f"run {run.id}  {run.agent}@{run.agent_version}  {run.status.upper()}{ended}"
        + (f" ({run.wait_reason}: {run.wait_detail})" if run.wait_reason else "")
    )
    say(
        f"  created {run.created_at:%Y-%m-%d %H:%M:%S} by {run.created_by or '-'};"
        f" next step {run.step or '-'}; head #{run.head_seq}; version {run.lease_token}"
    )
    if run.lease_owner:
        say(f"  leased by {run.lease_owner} until {run.lease_expires_at:%H:%M:%S}")
    if run.status == RunStatus.QUEUED and not presence.live():
        say(
            f"  no worker is running (none announced itself in the last {presence.ttl():g} s,"
            " or its process is gone): the run starts once one is (see docs/operations.md)"
        )
    if run.legal_hold:
        say("  on legal hold: retention and deletion leave it alone")
    if owed := rollbacks.owed(run):
        say(f"  compensations owed (its next step performs them first): {'; '.join(owed)}")
    if run.forked_from_id:
        say(f"  forked from {run.forked_from_id} at #{run.forked_from_seq}{_what_if(run)}")
    elif run.what_if:
        say(f"  spawned by a what-if run{_what_if(run)}")
    if run.parent_run_id:
        spawned = f" (spawned as {run.spawn_key!r})" if run.spawn_key else ""  # a subgraph's: none
        say(f"  child of {run.parent_run_id}{spawned}")
    children = list(Run.objects.filter(parent_run=run).order_by("created_at"))
    if children:
        say("children:")
        for child in children:
            say(
                f"  {child.id}  {child.agent}@{child.agent_version}  {child.status}"
                + (f": {child.error[:80]}" if child.error else "")
            )
    if run.error:
        say(f"  error: {run.error}")


def _parent_seqs(cps: list[Checkpoint]) -> dict[int, int]:
    """Each checkpoint's parent's number, by the parent's id (one query for parents of
    another run: a fork's first checkpoint)."""
    seqs = {c.pk: c.seq for c in cps}
    elsewhere = {c.parent_id for c in cps if c.parent_id and c.parent_id not in seqs}
    if elsewhere:
        seqs.update(Checkpoint.objects.filter(pk__in=elsewhere).values_list("id", "seq"))
    return seqs


def _worker_steps(run: Run, cps: list[Checkpoint]) -> dict[int, workersteps.Ran]:
    """A graph the workers execute: each checkpoint's superstep (which nodes ran, what they
    wrote, where it went), from its patch; nothing for any other run."""
    if not registered_graph(run.agent):
        return {}
    return workersteps.of_run(run.pk, [c.seq for c in cps])


def _checkpoints(say: Say, cps: list[Checkpoint], steps: dict[int, workersteps.Ran]) -> None:
    say("checkpoints:")
    seqs = _parent_seqs(cps)
    for c in cps:
        up = seqs.get(c.parent_id) if c.parent_id else None
        parent = f" (parent #{up})" if up is not None and up != c.seq - 1 else ""
        # A LangGraph checkpoint names no next step (its supersteps are listed below it).
        graph = is_graph_checkpoint(c)
        after = c.next_step or ("-" if graph else "end")
        step = _graph_step(c.step) if graph else c.step
        say(
            f"  #{c.seq:<4} {c.reason:<9} {step or '-':<14} -> {after:<14}"
            f" {c.size:>9,} B  Δ {c.delta_size:>7,} B{parent}"
        )
        if c.seq in steps:
            say(f"        {steps[c.seq].title}: {steps[c.seq].summary}")


def _graph_step(stored: str) -> str:
    """A saver's checkpoint's step ("loop 3", "input -1") in LangGraph's words."""
    source, _, step = stored.partition(" ")
    words = {"input": "input", "update": "update_state", "fork": "fork"}
    return words.get(source) or (f"superstep {step}" if source == "loop" else stored)


def _approvals(say: Say, approvals: list[Approval], branch: set[int]) -> None:
    if not approvals:
        return
    say("approvals:")
    for a in approvals:
        who = f" by {a.decided_by}" if a.decided_by else ""
        say(f"  {a.name:<14} {a.status:<10}{who} {a.comment}".rstrip())
        if a.base_id not in branch and a.status != "superseded":
            say("    on a branch a rollback abandoned: this decision decides nothing now")
        if a.status == "pending":  # what the operator is asked to decide (secrets redacted)
            _asks(say, a.payload)
        changed = edits.describe(edits.stored_changes(a))
        if changed:
            say(f"    with edits: {changed}")


def _asks(say: Say, payload: str) -> None:
    """What a pending approval asks: an object field by field (a second decision's question
    and the arguments it would perform now each in full, up to a line's worth), else whole."""
    asked = canonical.loads(payload) if payload else None
    if not isinstance(asked, dict) or not asked:
        say(f"    asks: {_cut(payload, 300)}")
        return
    say("    asks:")
    for key, value in asked.items():
        text = value if isinstance(value, str) else canonical.dumps(value).decode()
        say(f"      {key}: {_cut(text, 600)}")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _effects(say: Say, effects: list[Effect]) -> None:
    if not effects:
        return
    say("effects:")
    for e in effects:
        say(
            f"  [{e.pk}] {e.key:<14} {e.status:<9} key={e.idempotency_key}"
            f" attempts={e.attempts} duplicates prevented={e.duplicates_prevented}"
        )


def _events(say: Say, events: list[Event], *, graph: bool) -> None:
    say("recent events:")
    for e in reversed(events):
        who = f" by {e.actor}" if e.actor else (f" on {e.worker}" if e.worker else "")
        why = f": {e.reason[:80]}" if e.reason else ""
        seq = f" #{e.seq}" if e.seq is not None else ""
        step = _graph_step(e.step) if graph and e.step else e.step
        say(f"  {e.created_at:%H:%M:%S} {e.kind}{seq} {step}{who}{why}")
