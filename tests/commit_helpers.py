"""A step commit built by hand: an empty patch on a run's first checkpoint, for tests that
drive the store's commit directly."""

from __future__ import annotations

import uuid
from typing import Any

from durability.checkpoints import Head, StepCommit
from durability.models import Checkpoint, Run


def empty_commit(run: Run, token: int, step: str, **extra: Any) -> StepCommit:
    head = Head.of(Checkpoint.objects.get(run=run, seq=0))
    return StepCommit(
        run_id=run.pk,
        token=token,
        head=head,
        worker="t",
        step=step,
        next_step=step,
        ops_bytes=b"[]",
        ops_count=0,
        state_hash=head.state_hash,
        chain_hash="c" * 64,
        size=head.size,
        delta_run=2,
        schema_version=1,
        agent_version="1",
        commit_id=uuid.uuid4(),
        prev_commit_us=None,
        lease_seconds=30,
        **extra,
    )
