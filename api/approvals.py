"""Approvals: the inbox (with who may decide each) and decisions (approve, approve with
edits, reject with a comment), through ``operations.decide``, which checks the policy
group and the run's version under the run's lock."""

from __future__ import annotations

from typing import Literal

from django.http import HttpRequest, HttpResponse
from ninja import Header, Query, Router

from api import common, present
from api.runs import ACT, READ
from api.schemas import ApprovalOut, ApprovalPage, DecisionIn
from durability import operations
from durability.errors import UnknownApproval
from durability.models import Approval, ApprovalStatus

router = Router(tags=["approvals"])
ApprovalState = Literal[tuple(ApprovalStatus.values)]  # type: ignore[valid-type]


@router.get("/approvals", response={200: ApprovalPage, **READ}, summary="List approvals")
def list_approvals(
    request: HttpRequest,
    status: ApprovalState | None = Query("pending"),  # type: ignore[assignment]
    agent: str | None = Query(None, max_length=200),
    run: str | None = Query(None, max_length=64, description="a run id"),
    cursor: int | None = Query(None, ge=1, le=2**62, description="from next_cursor"),
    limit: int = Query(50, ge=1, le=200),
):
    """Newest first; ``may_decide`` says whether the caller may decide each."""
    user = common.reader(request)
    rows = Approval.objects.select_related("run")
    if status:
        rows = rows.filter(status=status)
    if agent:
        rows = rows.filter(run__agent=agent)
    if run:
        rows = rows.filter(run_id=operations.get_run(run).id)
    if cursor is not None:
        rows = rows.filter(id__lt=cursor)
    page = list(rows.order_by("-id")[: limit + 1])
    more = len(page) > limit
    page = page[:limit]
    return {
        "items": [present.approval(a, user) for a in page],
        "next_cursor": str(page[-1].id) if page and more else None,
    }


def _approval(approval_id: int) -> Approval:
    found = Approval.objects.select_related("run").filter(pk=approval_id).first()
    if found is None:
        raise UnknownApproval(f"no approval with id {approval_id}")
    return found


@router.get("/approvals/{approval_id}", response={200: ApprovalOut, **READ}, summary="One")
def get_approval(request: HttpRequest, approval_id: int, response: HttpResponse):
    user = common.reader(request)
    found = _approval(approval_id)
    response["ETag"] = common.etag(found.run.lease_token)
    return present.approval(found, user)


@router.post(
    "/approvals/{approval_id}/decision", response={200: ApprovalOut, **ACT}, summary="Decide"
)
def decide(
    request: HttpRequest,
    approval_id: int,
    body: DecisionIn,
    response: HttpResponse,
    if_match: str | None = Header(None, alias="If-Match", max_length=40),
):
    """Approve (``payload``: approve with edits, checked against the agent's editable
    schema and check) or reject (with a ``comment``). The first decision wins (409,
    DUR108); with ``If-Match`` (the run's version) a decision made on an older version is
    refused (409, DUR112)."""
    version = common.expected_version(if_match)
    with common.acting_as(request) as by:
        found = _approval(approval_id)
        decided = operations.decide(
            found.run_id,
            approve=body.approve,
            by=by,
            comment=body.comment,
            payload=body.payload,
            approval_id=found.pk,
            expected_version=version,
        )
    decided = _approval(decided.pk)
    response["ETag"] = common.etag(decided.run.lease_token)
    return present.approval(decided, request.user)
