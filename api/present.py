"""Rows as the API shows them: plain dicts matching ``api.schemas``, secrets redacted. Runs,
checkpoints and approvals take their shape from ``durability.shapes``, which ``durability
show --json`` shares; what only the API knows (who asks) is added here."""

from __future__ import annotations

from typing import Any

from durability import roles, shapes
from durability.models import Approval, ApprovalStatus, Message

run = shapes.run
run_detail = shapes.run_detail
checkpoint = shapes.checkpoint


def approval(a: Approval, user: Any) -> dict[str, Any]:
    return {
        **shapes.approval(a),
        "may_decide": a.status == ApprovalStatus.PENDING and roles.may_decide(user, a),
    }


def message(m: Message) -> dict[str, Any]:
    return {
        "id": m.id,
        "run_id": str(m.run_id),
        "name": m.name,
        "data": shapes.document(m.data),
        "sent_by": m.sent_by,
        "created_at": m.created_at,
        "consumed": m.consumed_base_id is not None,
    }
