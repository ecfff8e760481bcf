"""Deleting runs, the one way: retention's prune and LangGraph's ``delete_thread`` both come
here.

A run's rows go with it, but for its operators' actions: the audit log keeps every event
with an actor (who approved, cancelled, held, released...) after the run is gone, with one
more saying who deleted it and why. Nothing else refers to a deleted run, so those rows name
its id only (the audit page says the run was deleted).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from durability import events
from durability.models import Checkpoint, Event, EventKind, Run


def delete_runs(run_ids: Sequence[Any], *, by: str, reason: str) -> None:
    """Delete ``run_ids`` with all their rows but their audit log's, recording who deleted
    each (``by``) and why. The caller holds the transaction and has locked the runs."""
    ids = list(run_ids)
    if not ids:
        return
    # The agent is said too: the audit log names a deleted run's agent from its own rows.
    agents = Run.objects.filter(pk__in=ids).values_list("pk", "agent")
    events.record(
        *(
            events.new(run_id, EventKind.DELETED, by=by, reason=reason, data={"agent": agent})
            for run_id, agent in agents
        )
    )
    Event.objects.filter(run_id__in=ids, actor="").delete()
    # Checkpoints protect their parents: unlink them before the cascade.
    Checkpoint.objects.filter(run_id__in=ids).update(parent=None)
    Run.objects.filter(pk__in=ids).delete()
