"""Rows as the API shows them: plain dicts matching ``api.schemas``, secrets redacted."""

from __future__ import annotations

from typing import Any

import orjson

from durability import approvals as approval_specs
from durability import roles
from durability.langgraph import cli as langgraph
from durability.models import Approval, ApprovalStatus, Checkpoint, Message, Run, RunStatus
from durability.redact import redact


def _json(text: str) -> Any:
    if not text:
        return None
    value, _ = redact(orjson.loads(text))
    return value


def trace_id(run: Run) -> str | None:
    # Stored as a W3C traceparent: "00-<trace id>-<span id>-<flags>".
    parts = (run.trace_parent or "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def run(r: Run) -> dict[str, Any]:
    waiting = r.wait_reason if r.status == RunStatus.WAITING and r.wait_reason else None
    return {
        "id": str(r.id),
        "agent": r.agent,
        "agent_version": r.agent_version,
        "status": r.status,
        "version": r.lease_token,
        "head": r.head_seq,
        "step": r.step,
        "waiting_for": waiting,
        "wait_detail": r.wait_detail,
        "outcome": r.outcome,
        "error": r.error,
        "error_code": r.error_code,
        "attempts": r.attempts,
        "recoveries": r.recoveries,
        "durability": r.durability,
        "legal_hold": r.legal_hold,
        "created_by": r.created_by,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
        "started_at": r.started_at,
        "finished_at": r.finished_at,
        "parent_run": str(r.parent_run_id) if r.parent_run_id else None,
        "forked_from": str(r.forked_from_id) if r.forked_from_id else None,
        "forked_from_seq": r.forked_from_seq,
        "trace_id": trace_id(r),
    }


def run_detail(r: Run) -> dict[str, Any]:
    children = Run.objects.filter(parent_run=r).order_by("created_at").values_list("id", flat=True)
    pending = Approval.objects.filter(run=r, status=ApprovalStatus.PENDING).values_list(
        "id", flat=True
    )
    return {
        **run(r),
        "input": _json(r.input),
        "lease": {
            "owner": r.lease_owner,
            "expires_at": r.lease_expires_at,
            "heartbeat_at": r.heartbeat_at,
        },
        "children": [str(c) for c in children[:1000]],
        "pending_approvals": list(pending),
        "langgraph": langgraph.as_json(r),  # what ``durability show --json`` says
    }


def approval(a: Approval, user: Any) -> dict[str, Any]:
    return {
        "id": a.id,
        "run_id": str(a.run_id),
        "agent": a.run.agent,
        "name": a.name,
        "step": a.step,
        "status": a.status,
        "payload": _json(a.payload),
        "edited_payload": _json(a.edited_payload),
        "editable": approval_specs.editable_fields(a.editable),
        "group": a.group,
        "may_decide": a.status == ApprovalStatus.PENDING and roles.may_decide(user, a),
        "run_version": a.run.lease_token,
        "requested_at": a.requested_at,
        "deadline": a.deadline,
        "decided_by": a.decided_by,
        "decided_at": a.decided_at,
        "comment": a.comment,
    }


def message(m: Message) -> dict[str, Any]:
    return {
        "id": m.id,
        "run_id": str(m.run_id),
        "name": m.name,
        "data": _json(m.data),
        "sent_by": m.sent_by,
        "created_at": m.created_at,
        "consumed": m.consumed_base_id is not None,
    }


def checkpoint(c: Checkpoint, parents: dict[int, int]) -> dict[str, Any]:
    return {
        "seq": c.seq,
        "parent": parents.get(c.parent_id) if c.parent_id else None,
        "reason": c.reason,
        "step": c.step,
        "next_step": c.next_step,
        "state_hash": c.state_hash,
        "chain_hash": c.chain_hash,
        "schema_version": c.schema_version,
        "agent_version": c.agent_version,
        "size": c.size,
        "delta_size": c.delta_size,
        "created_by": c.created_by,
        "created_at": c.created_at,
    }
