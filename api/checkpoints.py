"""Checkpoints: list, one's metadata, its state, its mutation log, the diff between any two
(of a run, or of a run and another, e.g. its fork), and verification of a run's chain.
States are rebuilt and verified by the engine before they are shown, secrets redacted."""

from __future__ import annotations

from typing import Any

import orjson
from django.http import HttpRequest, HttpResponse
from ninja import Query, Router

from api import common, present
from api.runs import READ
from api.schemas import JSON, CheckpointOut, CheckpointPage, DiffOut, MutationsOut, VerifyOut
from durability import checkpoints, diff, operations
from durability.errors import UnknownCheckpoint
from durability.integrity import verify_run
from durability.models import Checkpoint, Mutation, Run
from durability.redact import redact

router = Router(tags=["checkpoints"])
SEQ_MAX = 2**31 - 1


def _one(run: Run, seq: int) -> Checkpoint:
    cp = Checkpoint.objects.filter(run=run, seq=seq).first()
    if cp is None:
        raise UnknownCheckpoint(
            f"run has no checkpoint #{seq} (its checkpoints are #0 to #{run.head_seq})",
            run_id=run.id,
        )
    return cp


def _json(value: Any) -> HttpResponse:
    return HttpResponse(orjson.dumps(value), content_type="application/json")


def _state(cp: Checkpoint) -> Any:
    state, _, _ = checkpoints.verified_state(cp)
    redacted, _ = redact(state)
    return redacted


def _state_bytes(cp: Checkpoint) -> bytes:
    """The state as JSON: the verified canonical bytes themselves when redaction (run again
    here: patterns may have grown since it was written) found nothing to replace."""
    state, data, _ = checkpoints.verified_state(cp)
    redacted, changed = redact(state)
    return orjson.dumps(redacted) if changed else data


@router.get(
    "/runs/{run_id}/checkpoints", response={200: CheckpointPage, **READ}, summary="Checkpoints"
)
def list_checkpoints(
    request: HttpRequest,
    run_id: str,
    cursor: int | None = Query(None, ge=0, le=SEQ_MAX, description="from next_cursor"),
    limit: int = Query(100, ge=1, le=500),
):
    """Oldest first, ``limit`` at a time."""
    common.reader(request)
    run = operations.get_run(run_id[:64])
    rows = Checkpoint.objects.filter(run=run).order_by("seq")
    if cursor is not None:
        rows = rows.filter(seq__gt=cursor)
    page = list(rows[: limit + 1])
    more = len(page) > limit
    page = page[:limit]
    parents = dict(
        Checkpoint.objects.filter(pk__in={c.parent_id for c in page if c.parent_id}).values_list(
            "pk", "seq"
        )
    )
    return {
        "items": [present.checkpoint(c, parents) for c in page],
        "next_cursor": str(page[-1].seq) if page and more else None,
    }


@router.get(
    "/runs/{run_id}/checkpoints/{seq}", response={200: CheckpointOut, **READ}, summary="One"
)
def get_checkpoint(request: HttpRequest, run_id: str, seq: int):
    common.reader(request)
    cp = _one(operations.get_run(run_id[:64]), _seq(seq))
    parents = {cp.parent_id: cp.parent.seq} if cp.parent_id else {}
    return present.checkpoint(cp, parents)


def _seq(seq: int) -> int:
    if not 0 <= seq <= SEQ_MAX:
        raise UnknownCheckpoint(f"{seq} is not a checkpoint number")
    return seq


@router.get(
    "/runs/{run_id}/checkpoints/{seq}/state", response={200: JSON, **READ}, summary="Its state"
)
def get_state(request: HttpRequest, run_id: str, seq: int):
    """The whole state at the checkpoint, verified against its hashes (409, DUR200, if it
    does not verify), secret values redacted."""
    common.reader(request)
    cp = _one(operations.get_run(run_id[:64]), _seq(seq))
    return HttpResponse(_state_bytes(cp), content_type="application/json")


@router.get(
    "/runs/{run_id}/checkpoints/{seq}/mutations",
    response={200: MutationsOut, **READ},
    summary="Its mutation log",
)
def get_mutations(request: HttpRequest, run_id: str, seq: int):
    common.reader(request)
    run = operations.get_run(run_id[:64])
    cp = _one(run, _seq(seq))
    row = Mutation.objects.filter(checkpoint=cp).first()
    ops = orjson.loads(row.ops) if row is not None else []
    redacted, _ = redact(ops)
    return _json({"run_id": str(run.id), "seq": cp.seq, "ops": redacted})


@router.get("/runs/{run_id}/diff", response={200: DiffOut, **READ}, summary="Diff two")
def get_diff(
    request: HttpRequest,
    run_id: str,
    from_seq: int = Query(..., alias="from", ge=0, le=SEQ_MAX),
    to_seq: int = Query(..., alias="to", ge=0, le=SEQ_MAX),
    to_run: str | None = Query(None, max_length=64, description="another run (e.g. a fork)"),
):
    """The RFC 6902 operations that turn the state at ``from`` into the state at ``to``
    (of ``to_run`` when given: compare a run with its fork)."""
    common.reader(request)
    run = operations.get_run(run_id[:64])
    other = operations.get_run(to_run) if to_run else run
    old, new = _state(_one(run, from_seq)), _state(_one(other, to_seq))
    body = {
        "run_id": str(run.id),
        "from_seq": from_seq,
        "to_seq": to_seq,
        "to_run_id": str(other.id),
        "changes": diff.diff(old, new),
    }
    return _json(body)


@router.get("/runs/{run_id}/verification", response={200: VerifyOut, **READ}, summary="Verify")
def verify(request: HttpRequest, run_id: str):
    """Check every checkpoint of the run against its hashes (read-only)."""
    common.reader(request)
    run = operations.get_run(run_id[:64])
    report = verify_run(run.id)
    return {
        "run_id": str(run.id),
        "ok": report.ok,
        "checked": report.checked,
        "problems": [f"#{seq}: {why}" for seq, why in report.problems],
    }
