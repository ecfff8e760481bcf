"""Rolling a run back to one of its checkpoints: the plan shown for a confirmation, and
the rollback itself, which makes a new head and settles what the branch left behind left
open (effects, approvals, children, messages)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from django.db import transaction

from durability import canonical, checkpoints, dispatch, events, lifecycle, rollbacks
from durability.errors import InvalidInput, InvalidTransition, Stale
from durability.langgraph.runs import refuse_outside_workers
from durability.models import (
    FINISHED,
    AbandonedEffect,
    Approval,
    ApprovalStatus,
    Checkpoint,
    CheckpointReason,
    Effect,
    EffectStatus,
    Message,
    Repeat,
    Run,
)
from durability.operations._control import _cancel_tree
from durability.operations._runs import (
    _check_status,
    _check_version,
    _checkpoint_of,
    _locked,
    get_run,
)
from durability.operations._start import wake_parent
from durability.rollbacks import EffectDone
from durability.store.base import write_checkpoint


@dataclass
class RollbackPlan:
    run: Run
    target: Checkpoint
    # Effects done (or perhaps done) on the branch being left: not undone unless compensated.
    done_not_undone: list[EffectDone] = field(default_factory=list)
    approvals_superseded: int = 0
    will_run_from: str = ""
    # Checkpoints of the branch being left (their operations are not replayed again).
    abandoned: set[int] = field(default_factory=set)
    # Unfinished children the abandoned branch started: (id, agent, status).
    children: list[tuple[str, str, str]] = field(default_factory=list)
    messages_back: int = 0
    message_ids: list[int] = field(default_factory=list)

    @property
    def preview(self) -> rollbacks.Preview:
        return rollbacks.Preview(
            target_seq=self.target.seq,
            target_step=self.target.step,
            will_run_from=self.will_run_from,
            effects=self.done_not_undone,
            children=self.children,
            messages_back=self.messages_back,
            approvals_superseded=self.approvals_superseded,
        )

    def sentences(self, decisions: dict[int, str] | None = None, *, hold: bool = True) -> list[str]:
        """The preview in plain words (the same for the dashboard and the CLI)."""
        return rollbacks.sentences(self.preview, decisions, hold=hold)


@dataclass
class RollbackResult(RollbackPlan):
    checkpoint: Checkpoint | None = None
    held: bool = False
    decisions: dict[int, str] = field(default_factory=dict)


def _ancestors(cp_id: int | None, parents: dict[int, int | None]) -> list[int]:
    path = []
    while cp_id is not None:
        path.append(cp_id)
        cp_id = parents.get(cp_id)
    return path


def plan_rollback(
    ref: Any, to_seq: int | None = None, *, checkpoint_id: int | None = None
) -> RollbackPlan:
    """What a rollback would do, for a confirmation: the effects already done after the
    target (each with whether it can be compensated), the children it cancels, the messages
    it puts back and where the run would continue."""
    run = get_run(ref)
    refuse_outside_workers(run, "roll it back")
    target = _checkpoint_of(run, to_seq, checkpoint_id)
    if target.seq == run.head_seq:
        raise InvalidTransition(f"checkpoint #{target.seq} is already the head", run_id=run.id)
    # Refused as the rollback refuses it (``IntegrityViolation``): a preview of a rollback
    # that cannot happen is no preview.
    checkpoints.verified_state(target)
    abandoned, seq_of = _branch_left(run, target)
    # Every pending approval, the target's own included: the new head is a checkpoint of its
    # own, so whatever the new branch asks, it asks anew under that identity.
    pending = Approval.objects.filter(run=run, status=ApprovalStatus.PENDING).count()
    children = [
        (str(c.id), c.agent, c.status)
        for c in Run.objects.filter(parent_run=run)
        .exclude(status__in=FINISHED)
        .only("id", "agent", "status", "spawn_base_id")
        .order_by("created_at")
        if c.spawn_base_id in abandoned
    ]
    consumed = Message.objects.filter(run=run).exclude(consumed_base=None)
    messages = [
        pk for pk, base in consumed.values_list("id", "consumed_base_id") if base in abandoned
    ]
    return RollbackPlan(
        run=run,
        target=target,
        done_not_undone=_effects_left(run, abandoned, seq_of),
        approvals_superseded=pending,
        will_run_from=target.next_step,
        abandoned=abandoned,
        children=children,
        messages_back=len(messages),
        message_ids=messages,
    )


def _branch_left(run: Run, target: Checkpoint) -> tuple[set[int], dict[int, int]]:
    """The checkpoints a rollback to ``target`` leaves behind, and every checkpoint's
    number by id."""
    rows = list(Checkpoint.objects.filter(run=run).values_list("id", "parent_id", "seq"))
    parents: dict[int, int | None] = {i: p for i, p, _ in rows}
    seq_of = {i: s for i, _, s in rows}
    head_id = next(i for i, _, s in rows if s == run.head_seq)
    on_branch = _ancestors(head_id, parents)
    if target.id not in on_branch and Message.objects.filter(run=run).exists():
        # A message keeps only its latest delivery: which of them the target's own branch
        # consumed is no longer known, so going there could deliver one a second time.
        raise InvalidInput(
            f"checkpoint #{target.seq} is not on the run's current branch, and the run has"
            " messages whose delivery along that branch is no longer recorded; roll back to a"
            " checkpoint on the current branch, or fork from this one",
            run_id=run.id,
        )
    return set(on_branch) - set(_ancestors(target.parent_id, parents)), seq_of


def _effects_left(run: Run, abandoned: set[int], seq_of: dict[int, int]) -> list[EffectDone]:
    """Effects done (or perhaps done) on the branch being left, oldest first."""
    # The run's rows, filtered here rather than by the database: the branch left behind can
    # hold thousands of checkpoints, and as many query parameters cost more than the rows.
    done = list(
        Effect.objects.filter(run=run)
        .exclude(status__in=(EffectStatus.FAILED, EffectStatus.RETRY, EffectStatus.WOULD_RUN))
        .order_by("id")
    )
    found = [e for e in done if e.base_id in abandoned]
    found += _still_open(run, abandoned, done, {e.pk for e in found})
    found.sort(key=lambda e: e.pk)
    compensated = _compensated(run, [e.pk for e in found if e.compensate])
    return [
        EffectDone(
            e.key,
            e.idempotency_key,
            e.step,
            seq_of.get(e.base_id, -1),
            e.status,
            id=e.pk,
            function=e.function,
            args=canonical.loads(e.args) if e.args else None,
            result=canonical.loads(e.result) if e.result else None,
            compensate=e.compensate,
            label=e.label,
            compensated=e.pk in compensated,
        )
        for e in found
    ]


def _still_open(
    run: Run, abandoned: set[int], done: list[Effect], listed: set[int]
) -> list[Effect]:
    """Effects an earlier rollback left to be asked about whose new branch is abandoned now
    before it performed them again (a rollback on hold rolled back again, a question left
    pending): still done, still to be decided, so the new branch asks about them too."""
    performed = {(e.base_id, e.key, e.occurrence) for e in done}
    by_id = {e.pk: e for e in done}
    still = []
    for row in AbandonedEffect.objects.filter(run=run).only(
        "rollback_id", "effect_id", "key", "settled_base_id", "settled_occurrence"
    ):
        if row.rollback_id not in abandoned or row.effect_id in listed:
            continue  # its rollback is still on the branch (it still applies), or listed
        if (row.settled_base_id, row.key, row.settled_occurrence) in performed:
            continue  # decided and performed again: that effect is listed in its place
        effect = by_id.get(row.effect_id)
        if effect is not None and effect.pk not in listed:
            listed.add(effect.pk)
            still.append(effect)
    return [e for e in still if e.pk not in _compensated(run, [e.pk])]


def _compensated(run: Run, effect_ids: list[int]) -> set[int]:
    """Of these effects, those a compensation was already started for (by an earlier
    rollback): a second one would undo twice."""
    if not effect_ids:
        return set()
    keys = {f"{rollbacks.COMPENSATION_KEY}{i}": i for i in effect_ids}
    started = (
        Effect.objects.filter(run=run, key__in=keys)
        .exclude(status=EffectStatus.FAILED)
        .values_list("key", flat=True)
    )
    return {keys[k] for k in started}


def rollback(
    ref: Any,
    to_seq: int | None = None,
    *,
    checkpoint_id: int | None = None,
    by: str = "",
    reason: str = "",
    and_continue: bool = False,
    decisions: dict[int, str] | None = None,
    expected_head: int | None = None,
    expected_status: str | None = None,
    expected_version: int | None = None,
) -> RollbackResult:
    """Make a new head whose state equals checkpoint ``to_seq``. History is kept; effects
    done after the target are not undone and never performed again without a second
    decision (DESIGN: "A rollback never repays on its own").

    The run is left on hold (waiting, ``WaitReason.HOLD``) until an operator continues it
    (``resume``), unless ``and_continue``. ``decisions``: effect id -> what to do when the
    new branch reaches an effect with its key: ``ask`` (the default: the run stops and asks
    in the inbox), ``reuse`` (return the recorded outcome if the arguments are the same; ask
    otherwise), ``again`` (perform it again without asking) or ``compensate`` (run the
    compensation the effect declared before the run continues; then perform it again
    without asking when reached).

    ``expected_head``, ``expected_status`` and ``expected_version``: the head, status and
    version the operator's confirmation was made for; if any changed since (another operator
    cancelled it, the run moved on), the rollback is refused (``Stale``)."""
    with transaction.atomic():
        run = _locked(ref)
        refuse_outside_workers(run, "roll it back")
        _check_status(run, expected_status)
        _check_head(run, expected_head)
        _check_version(run, expected_version)
        plan = plan_rollback(run, to_seq, checkpoint_id=checkpoint_id)
        try:
            chosen = rollbacks.check_decisions(plan.done_not_undone, decisions or {})
        except ValueError as exc:
            raise InvalidInput(str(exc), run_id=run.id, field="decisions") from None
        cp = _new_head(run, plan.target, by)
        returned = _leave_branch(run, plan, cp, chosen, by)
        finished = not plan.target.next_step
        held = not finished and not and_continue
        detail = f"rolled back to #{plan.target.seq} by {by or 'an operator'}"
        lifecycle.roll_back(run, seq=cp.seq, step=plan.target.next_step, held=held, detail=detail)
        data = _rollback_data(plan, cp, held, chosen, returned)
        events.record(events.rollback(run, by=by, reason=reason, seq=cp.seq, data=data))
        if finished:
            # A child rolled back to its end has finished: its parent may go on. After the
            # commit, in a transaction of its own: locking the parent while holding the
            # child would deadlock with an operator acting on the parent (parent, then child).
            transaction.on_commit(lambda: wake_parent(Run.objects.get(pk=run.pk)))
        elif not held:
            dispatch.ring(run.id)
    kept = {f.name: getattr(plan, f.name) for f in fields(RollbackPlan)}
    return RollbackResult(**kept, checkpoint=cp, held=held, decisions=chosen)


def _check_head(run: Run, expected_head: int | None) -> None:
    if expected_head is not None and run.head_seq != expected_head:
        raise Stale(
            f"the run changed since this rollback was reviewed: its head moved from"
            f" #{expected_head} to #{run.head_seq}; review it again",
            run_id=run.id,
        )


def _new_head(run: Run, target: Checkpoint, by: str) -> Checkpoint:
    """The rollback's checkpoint: an empty patch on the target, so the new head rebuilds to
    exactly its state, stored whole as well. A rollback is rare and its run is the one an
    operator looks at next: the new head's state is then one snapshot, not the target's
    path, which a read by number (``checkpoints.run_state``) would miss for the patches of
    the branch just left, numbered in between."""
    _, data, _ = checkpoints.verified_state(target)
    seq = run.head_seq + 1
    chain = checkpoints.link(
        target.chain_hash,
        target.state_hash,
        run_id=run.id,
        seq=seq,
        step=target.step,
        next_step=target.next_step,
        schema_version=target.schema_version,
        agent_version=target.agent_version,
    )
    return write_checkpoint(
        run=run,
        seq=seq,
        parent=target,
        reason=CheckpointReason.ROLLBACK,
        step=target.step,
        next_step=target.next_step,
        state_hash=target.state_hash,
        chain_hash=chain,
        schema_version=target.schema_version,
        agent_version=target.agent_version,
        config_hash=target.config_hash,
        packages=target.packages,
        size=target.size,
        delta_size=len(canonical.EMPTY_PATCH),
        delta_run=0,
        created_by=by,
        ops=canonical.EMPTY_PATCH.decode(),
        count=0,
        snapshot=data.decode(),
        digest=checkpoints.seal(target.state_hash, data),
    )


def _leave_branch(
    run: Run, plan: RollbackPlan, cp: Checkpoint, chosen: dict[int, str], by: str
) -> int:
    """Settle what the abandoned branch left open; the number of messages put back."""
    Approval.objects.filter(run=run, status=ApprovalStatus.PENDING).update(
        status=ApprovalStatus.SUPERSEDED, comment="rolled back"
    )
    # Matches an earlier rollback's decisions made on the branch now left are undone: the
    # new branch meets those effects afresh (they are asked about again).
    unsettled = [
        pk
        for pk, base in AbandonedEffect.objects.filter(run=run)
        .exclude(settled_base=None)
        .values_list("id", "settled_base_id")
        if base in plan.abandoned
    ]
    AbandonedEffect.objects.filter(pk__in=unsettled).update(
        settled_base=None, settled_occurrence=None
    )
    AbandonedEffect.objects.bulk_create(
        AbandonedEffect(
            run=run,
            rollback=cp,
            effect_id=e.id,
            key=e.key,
            choice=chosen.get(e.id, Repeat.ASK),
            decided_by=by,
        )
        for e in plan.done_not_undone
        if not e.key.startswith(rollbacks.COMPENSATION_KEY)
    )
    # Unfinished children the abandoned branch spawned are cancelled; the new branch
    # spawns its own when it gets there.
    for child_id, _, _ in plan.children:
        _cancel_tree(child_id, by=by, reason=f"parent {run.id} rolled back")
    # Messages the abandoned branch consumed go back to the inbox, in arrival order.
    return (
        Message.objects.filter(pk__in=plan.message_ids)
        .exclude(consumed_base=None)
        .update(consumed_base=None, consumed_occurrence=None, consumed_at=None)
    )


def _rollback_data(
    plan: RollbackPlan, cp: Checkpoint, held: bool, chosen: dict[int, str], returned: int
) -> dict[str, Any]:
    return {
        "to": plan.target.seq,
        "new_head": cp.seq,
        "held": held,
        "done_not_undone": [
            {
                "key": e.key,
                "idempotency_key": e.idempotency_key,
                "step": e.step,
                "seq": e.seq,
                "status": e.status,
                "id": e.id,
                "decision": chosen.get(e.id, "ask"),
            }
            for e in plan.done_not_undone
        ],
        "messages_returned": returned,
    }
