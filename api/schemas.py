"""The API's typed shapes (pydantic, through django-ninja): what the OpenAPI document
publishes and what every request body is validated against before the engine is called."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ninja import Field, Schema

JSON = Any  # any JSON value


class ProblemOut(Schema):
    """RFC 9457 problem details, with the engine's error code and the field at fault."""

    type: str
    title: str
    status: int
    code: str = Field(..., description="the engine's error code, e.g. DUR112 (stale)")
    detail: str
    field: str | None = None
    run_id: str | None = None


class LeaseOut(Schema):
    owner: str
    expires_at: datetime | None
    heartbeat_at: datetime | None


class RunOut(Schema):
    id: str
    agent: str
    agent_version: str
    status: str
    version: int = Field(..., description="the run's version: send it back as If-Match")
    head: int = Field(..., description="the number of the head checkpoint")
    step: str
    waiting_for: str | None = Field(None, description="approval, message, timer, ...")
    wait_detail: str
    outcome: str
    error: str
    error_code: str
    attempts: int
    recoveries: int
    durability: str
    created_by: str
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    parent_run: str | None
    forked_from: str | None
    forked_from_seq: int | None
    trace_id: str | None


class RunDetailOut(RunOut):
    input: JSON
    lease: LeaseOut
    children: list[str]
    pending_approvals: list[int]


class RunPage(Schema):
    items: list[RunOut]
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page")


class StartIn(Schema):
    agent: str = Field(..., min_length=1, max_length=200)
    input: JSON = None
    reason: str = Field("", max_length=2000)
    durability: str | None = Field(None, max_length=20)


class ReasonIn(Schema):
    reason: str = Field("", max_length=2000)


class ApprovalOut(Schema):
    id: int
    run_id: str
    agent: str
    name: str
    step: str
    status: str
    payload: JSON
    edited_payload: JSON = None
    editable: list[str] | None = Field(None, description="fields an edit may change")
    group: str = Field(..., description="the policy group that decides (empty: operators)")
    may_decide: bool = Field(..., description="whether the caller may decide it")
    run_version: int = Field(..., description="send it back as If-Match to decide")
    requested_at: datetime
    deadline: datetime | None
    decided_by: str
    decided_at: datetime | None
    comment: str


class ApprovalPage(Schema):
    items: list[ApprovalOut]
    next_cursor: str | None = None


class DecisionIn(Schema):
    approve: bool
    comment: str = Field("", max_length=2000)
    payload: dict[str, JSON] | None = Field(
        None, description="approve with edits: the corrected payload (its editable fields)"
    )


class MessageIn(Schema):
    name: str = Field(..., min_length=1, max_length=200)
    data: JSON = None
    reason: str = Field("", max_length=2000)


class MessageOut(Schema):
    id: int
    run_id: str
    name: str
    data: JSON
    sent_by: str
    created_at: datetime
    consumed: bool


class CheckpointOut(Schema):
    seq: int
    parent: int | None
    reason: str
    step: str
    next_step: str
    state_hash: str
    chain_hash: str
    schema_version: int
    agent_version: str
    size: int
    delta_size: int
    created_by: str
    created_at: datetime


class CheckpointPage(Schema):
    items: list[CheckpointOut]
    next_cursor: str | None = None


class DiffOp(Schema):
    op: str
    path: str
    value: JSON = None


class DiffOut(Schema):
    run_id: str
    from_seq: int
    to_seq: int
    to_run_id: str
    changes: list[DiffOp]


class MutationsOut(Schema):
    run_id: str
    seq: int
    ops: list[DiffOp] = Field(..., description="the RFC 6902 operations from its parent")


class VerifyOut(Schema):
    run_id: str
    ok: bool
    checked: int
    problems: list[str]
