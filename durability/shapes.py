"""Runs, checkpoints, approvals and effects as JSON-ready dicts: the one vocabulary of the
JSON API (``api.present``, ``api.observe``) and of ``durability show --json``, so that a
script reading either finds the same names with the same meaning. Values are the model's
own: datetimes stay datetimes, which both write with Django's JSON encoder (RFC 3339 to the
millisecond, UTC as ``Z``). JSON documents stored as text (input, payloads, arguments,
results) are parsed and their secrets redacted, as everything shown outside the process
is."""

from __future__ import annotations

from typing import Any

import orjson

from durability import approvals as approval_specs
from durability.langgraph import cli as langgraph
from durability.models import Approval, ApprovalStatus, Checkpoint, Effect, Run, RunStatus
from durability.redact import redact


def document(text: str) -> Any:
    """A stored JSON document, secrets redacted (None for an empty column; a text that is
    not JSON, as an old row may hold, as it is)."""
    if not text:
        return None
    try:
        value, _ = redact(orjson.loads(text))
    except orjson.JSONDecodeError:
        return text
    return value


def trace_id(run: Run) -> str | None:
    # Stored as a W3C traceparent: "00-<trace id>-<span id>-<flags>".
    parts = (run.trace_parent or "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def run(r: Run) -> dict[str, Any]:
    """A run as a list shows it."""
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
    """One run: its list fields, its input, lease, children and pending approvals, and for a
    LangGraph graph executed in its own process, its thread and supersteps."""
    children = Run.objects.filter(parent_run=r).order_by("created_at").values_list("id", flat=True)
    pending = Approval.objects.filter(run=r, status=ApprovalStatus.PENDING).values_list(
        "id", flat=True
    )
    return {
        **run(r),
        "input": document(r.input),
        "lease": {
            "owner": r.lease_owner,
            "expires_at": r.lease_expires_at,
            "heartbeat_at": r.heartbeat_at,
        },
        "children": [str(c) for c in children[:1000]],
        "pending_approvals": list(pending),
        "langgraph": langgraph.as_json(r),
    }


def checkpoint(c: Checkpoint, parents: dict[int, int]) -> dict[str, Any]:
    """``parents``: checkpoint numbers by id, for the parent's number (a fork's first
    checkpoint's parent is in the run it came from)."""
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


def approval(a: Approval) -> dict[str, Any]:
    """What an approval asks and how it was decided (whether a given person may decide it is
    the caller's to add: the API knows who asks, the CLI does not)."""
    return {
        "id": a.id,
        "run_id": str(a.run_id),
        "agent": a.run.agent,
        "name": a.name,
        "step": a.step,
        "status": a.status,
        "payload": document(a.payload),
        "edited_payload": document(a.edited_payload),
        "editable": approval_specs.editable_fields(a.editable),
        "group": a.group,
        "run_version": a.run.lease_token,
        "requested_at": a.requested_at,
        "deadline": a.deadline,
        "decided_by": a.decided_by,
        "decided_at": a.decided_at,
        "comment": a.comment,
    }


def effect(e: Effect) -> dict[str, Any]:
    return {
        "id": e.id,
        "key": e.key,
        "occurrence": e.occurrence,
        "step": e.step,
        "function": e.function,
        "label": e.label,
        "status": e.status,
        "idempotency_key": e.idempotency_key,
        "args": document(e.args),
        "result": document(e.result),
        "error": e.error,
        "attempts": e.attempts,
        "duplicates_prevented": e.duplicates_prevented,
        "idempotent": e.idempotent,
        "resolved_by": e.resolved_by,
        "created_at": e.created_at,
        "completed_at": e.completed_at,
    }
