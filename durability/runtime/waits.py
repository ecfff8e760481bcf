"""The ``ctx`` operations that may suspend a run: timers, messages, child runs, approvals.

A suspension records the wait and releases the worker; no state is committed. On wake the
step runs again from its base checkpoint with its records replayed, so the operation that
suspended returns its answer (the message, the children's results, the decision).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models.functions import Now
from django.utils import timezone

from durability import approvals, canonical, events, telemetry
from durability.errors import Suspend
from durability.models import (
    Approval,
    ApprovalStatus,
    CallKind,
    JournalEntry,
    Message,
    Run,
    WaitReason,
)
from durability.redact import redact
from durability.runtime.faults import fault
from durability.runtime.records import args_hash

if TYPE_CHECKING:
    from durability.runtime.records import Records
    from durability.runtime.sendahead import Settled


@dataclass(frozen=True)
class Decision:
    """An operator's answer to ``ctx.approval``. Truthy when approved."""

    approved: bool
    by: str
    comment: str
    payload: Any
    at: datetime | None

    def __bool__(self) -> bool:
        return self.approved


@dataclass
class Suspension:
    """What the executor does when a step suspends: ``write`` runs inside the suspension's
    fenced transaction, ``ready`` re-checks the wake condition under the run's lock."""

    reason: str
    detail: str
    write: Callable[[], None] | None = None
    ready: Callable[[], bool] | None = None
    wake_at: datetime | None = None


class Waits:
    """The suspending half of ``context.Context``, which holds the state it reads and the
    gate and records it goes through (declared here, made there)."""

    run_id: Any
    step: str
    seq: int
    worker: str
    agent: Any
    secrets: set[str]
    _records: Records
    _occurrences: dict[tuple[str, str], int]
    _waits_drawn: set[int]

    if TYPE_CHECKING:

        def _here(self) -> dict[str, Any]: ...
        def _settled(self, *, durable: bool = False) -> Settled: ...
        def _fence(self, proof: Settled) -> None: ...
        def _next(self, table: str, key: str) -> int: ...
        def _record(self, proof: Settled, entry: JournalEntry) -> JournalEntry: ...
        def _journaled(
            self, kind: str, key: str, fn: Callable, args: tuple, kwargs: dict, meta: str = ""
        ) -> Any: ...

    # --- durable timers ---------------------------------------------------------------------

    def sleep(self, seconds: float, *, key: str = "sleep") -> None:
        """Wait ``seconds`` without holding a worker: the run is suspended and woken by the
        sweeper when the time is due; the step then runs again and this returns."""
        proof = self._settled(durable=True)
        occ = self._next("journal", f"__sleep__:{key}")
        rec = self._records.journal.get((f"__sleep__:{key}", occ))
        if rec is None:
            wake_at = timezone.now() + timedelta(seconds=float(seconds))
            entry = JournalEntry(
                run_id=self.run_id,
                base_id=proof.base_id,
                key=f"__sleep__:{key}",
                occurrence=occ,
                kind=CallKind.SLEEP,
                step=self.step,
                function="sleep",
                args_hash=args_hash((float(seconds),), {}),
                result=canonical.dumps({"wake_at": wake_at.isoformat()}).decode(),
            )
            rec = self._record(proof, entry)
        wake_at = datetime.fromisoformat(canonical.loads(rec.result)["wake_at"])
        if wake_at <= timezone.now():
            return
        raise Suspend(
            Suspension(reason=WaitReason.TIMER, detail=f"sleep {key}", wake_at=wake_at),
        )

    # --- messages -------------------------------------------------------------------------

    def wait_for(self, name: str) -> Any:
        """The next message named ``name`` sent to this run (in arrival order), waiting for it
        without holding a worker if none has arrived. A replay gets the same message."""
        proof = self._settled(durable=True)
        occ = self._next("message", name)
        rec = self._records.messages.get((name, occ))
        if rec is not None:
            return canonical.loads(rec.data)
        with transaction.atomic():
            self._fence(proof)  # the run's row lock also orders this against send()
            message = (
                Message.objects.select_for_update()
                .filter(run_id=self.run_id, name=name, consumed_base=None)
                .order_by("id")
                .first()
            )
            if message is not None:
                Message.objects.filter(pk=message.pk).update(
                    consumed_base_id=proof.base_id, consumed_occurrence=occ, consumed_at=Now()
                )
                consumed = events.message_consumed(
                    self.run_id, name=name, message=message.pk, **self._here()
                )
                events.record(consumed)
        if message is not None:
            self._records.messages[(name, occ)] = message
            return canonical.loads(message.data)
        run_id = self.run_id

        def arrived() -> bool:
            return Message.objects.filter(run_id=run_id, name=name, consumed_base=None).exists()

        raise Suspend(Suspension(reason=WaitReason.MESSAGE, detail=name, ready=arrived))

    # --- child runs ---------------------------------------------------------------------------

    def spawn(self, agent: str, input: Any = None, *, key: str | None = None) -> str:
        """Start a child run of ``agent`` and return its id. The child's row is the spawn's
        record, created under this run's lease: a re-run of the step finds it, so a crash
        between spawning and recording never makes two children."""
        proof = self._settled(durable=True)
        key = key or agent
        occ = self._next("spawn", key)
        child = self._records.children.get((key, occ))
        if child is None:
            from durability import operations

            with transaction.atomic():
                self._fence(proof)
                parent = Run.objects.get(pk=self.run_id)
                child = operations.spawn_child(
                    parent, proof.base_id, key, occ, agent, input, by=f"run:{self.run_id}"
                )
            self._records.children[(key, occ)] = child
            fault("after_spawn", run=self.run_id, step=self.step, key=key, seq=self.seq)
        return str(child.id)

    def join(self, children: list[str] | tuple[str, ...], *, key: str = "join") -> list[dict]:
        """Wait, without holding a worker, until every child has finished; returns one
        ``{"run", "agent", "status", "result", "error"}`` per child, in the order given
        (``result`` is a succeeded child's final state). Recorded once all have finished,
        so a replay sees the same answer even if a child is later resumed."""
        # Recorded under the function's name: it stays where the journal says it is.
        from durability.runtime.context import ChildrenPending, _join_results

        self._settled(durable=True)
        ids = [str(c) for c in children]
        record_key = f"__join__:{key}"
        recorded = (record_key, self._occurrences.get(("journal", record_key), 0)) in (
            self._records.journal
        )
        if recorded or _all_finished(ids):
            try:
                return self._journaled(CallKind.CALL, record_key, _join_results, (ids,), {})
            except ChildrenPending:
                pass  # a child was resumed between the two looks: wait again

        def finished() -> bool:
            return _all_finished(ids)

        raise Suspend(
            Suspension(reason=WaitReason.CHILDREN, detail=f"{len(ids)} child runs", ready=finished)
        )

    # --- approvals --------------------------------------------------------------------------

    def approval(
        self,
        name: str,
        payload: Any = None,
        *,
        editable: Any = None,
        validate: Callable[[Any, Any], str | None] | None = None,
        group: str = "",
        timeout: float | None = None,
        on_timeout: str = "reject",
        escalate_to: str = "",
    ) -> Decision:
        """Suspend the run until an operator approves or rejects; returns the ``Decision``.

        The step runs again after the decision, with its records replayed. Asking again with
        a different payload asks anew. Policy: only members of ``group`` may decide (any
        operator when empty); after ``timeout`` seconds without a decision the sweeper
        rejects, approves, or (``"escalate"``) re-addresses it to ``escalate_to`` and
        restarts the clock, rejecting if that group does not decide in time either.

        Approve with edits: ``editable`` (a pydantic model or a JSON Schema of an object)
        names the payload fields an operator may edit and their types; the others are
        read-only; ``False``: none (approved or rejected as asked). ``validate(asked,
        edited)`` returns an error sentence or None and runs when the decision is recorded,
        in the process that records it: a module-level function in one of the agent's
        modules (see ``durability.approvals``). An edit that
        fails either is refused and nothing is recorded. ``Decision.payload`` is what was
        decided."""
        proof = self._settled(durable=True)
        if on_timeout not in ("reject", "approve", "escalate"):
            raise ValueError(f"on_timeout must be reject, approve or escalate, not {on_timeout!r}")
        if on_timeout == "escalate" and not escalate_to:
            raise ValueError("on_timeout='escalate' needs escalate_to (a group)")
        occ = self._next("approval", name)
        canonical.check_json(payload, what=f"payload of approval {name!r}")
        spec = approvals.spec_for(
            name, payload, editable, validate, approvals.agent_modules(self.agent)
        )
        payload, _ = redact(payload, self.secrets)
        data = canonical.dumps(payload).decode()
        phash = canonical.sha256_hex(data.encode())
        rec: Approval | None = self._records.approvals.get((name, occ))
        if rec is not None and rec.payload_hash == phash:
            return self._asked(rec, name, payload)
        policy = {
            "group": group,
            "timeout_seconds": timeout,
            "on_timeout": on_timeout if timeout else "",
            "escalate_to": escalate_to,
            "editable": spec,
        }
        superseded = rec.pk if rec is not None else None
        raise Suspend(
            Suspension(
                reason=WaitReason.APPROVAL,
                detail=name,
                write=self._asking(proof, name, occ, data, phash, policy, superseded),
            )
        )

    def _asked(self, rec: Approval, name: str, payload: Any) -> Decision:
        """The approval asked with this payload: its decision, or wait for one."""
        if rec.status in (ApprovalStatus.APPROVED, ApprovalStatus.REJECTED):
            if rec.pk not in self._waits_drawn:
                self._waits_drawn.add(rec.pk)
                telemetry.approval_wait(
                    name, rec.requested_at, rec.decided_at, rec.status == ApprovalStatus.APPROVED
                )
            edited = canonical.loads(rec.edited_payload) if rec.edited_payload else payload
            return Decision(
                approved=rec.status == ApprovalStatus.APPROVED,
                by=rec.decided_by,
                comment=rec.comment,
                payload=edited,
                at=rec.decided_at,
            )
        existing_id = rec.pk

        def decided() -> bool:
            return (
                Approval.objects.filter(pk=existing_id)
                .exclude(status=ApprovalStatus.PENDING)
                .exists()
            )

        raise Suspend(Suspension(reason=WaitReason.APPROVAL, detail=name, ready=decided))

    def _asking(
        self,
        proof: Settled,
        name: str,
        occ: int,
        data: str,
        phash: str,
        policy: dict[str, Any],
        superseded: int | None,
    ) -> Callable[[], None]:
        """What the suspension writes to ask: the approval (superseding one asked with
        another payload) and its event."""
        base_id, run_id, step, seq, worker = (
            proof.base_id,
            self.run_id,
            self.step,
            self.seq,
            self.worker,
        )
        timeout = policy["timeout_seconds"]

        def ask() -> None:
            if superseded is not None:
                Approval.objects.filter(pk=superseded).update(status=ApprovalStatus.SUPERSEDED)
            Approval.objects.create(
                run_id=run_id,
                base_id=base_id,
                name=name,
                occurrence=occ,
                step=step,
                payload=data,
                payload_hash=phash,
                deadline=timezone.now() + timedelta(seconds=timeout) if timeout else None,
                **policy,
            )
            at = {"seq": seq, "step": step, "worker": worker}
            asked = events.approval_requested(run_id, name=name, payload_bytes=len(data), **at)
            events.record(asked)

        return ask


def _all_finished(ids: list[str]) -> bool:
    from durability.models import FINISHED

    return not Run.objects.filter(pk__in=ids).exclude(status__in=FINISHED).exists()
