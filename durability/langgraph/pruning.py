"""Deleting a LangGraph thread's runs, and LangGraph's ``keep_latest`` pruning, which hides
all but each namespace's latest checkpoint from LangGraph while the store keeps the runs'
history until retention compacts it."""

from __future__ import annotations

from collections.abc import Sequence

from django.db import transaction

from durability.langgraph import delta
from durability.langgraph.models import PendingWrite, SavedCheckpoint, Thread
from durability.models import Checkpoint, Run


def delete_thread(thread_id: str) -> list[Thread]:
    """Delete every namespace's run of the thread, with all their checkpoints; the thread
    rows deleted."""
    with transaction.atomic():
        threads = list(Thread.objects.filter(thread_id=str(thread_id)))
        runs = [t.run_id for t in threads]
        # Checkpoints protect their parents: unlink them before the cascade.
        Checkpoint.objects.filter(run_id__in=runs).update(parent=None)
        Run.objects.filter(pk__in=runs).delete()
    return threads


def prune(thread_ids: Sequence[str], strategy: str) -> list[Thread]:
    """LangGraph's ``prune``; the thread rows deleted. Bad input, and ``keep_latest`` on a
    thread with a delta channel (``delta.uses``), are refused before anything changes."""
    if isinstance(thread_ids, str):
        raise TypeError("thread_ids must be a sequence of thread ids, not one string")
    if strategy not in ("keep_latest", "delete"):
        raise ValueError(f"unknown prune strategy {strategy!r}: keep_latest or delete")
    thread_ids = [str(t) for t in thread_ids]
    if strategy == "delete":
        return [t for thread_id in thread_ids for t in delete_thread(thread_id)]
    if refused := delta.uses(thread_ids):
        raise NotImplementedError(
            "keep_latest can't prune threads that use a DeltaChannel (their latest values"
            f" are rebuilt from older checkpoints): {', '.join(refused)}; nothing was"
            " pruned. strategy='delete' deletes such a thread."
        )
    for thread_id in thread_ids:
        with transaction.atomic():
            for thread in Thread.objects.filter(thread_id=thread_id):
                rows = SavedCheckpoint.objects.filter(thread=thread)
                latest = rows.order_by("-lg_id").first()
                if latest is None:
                    continue
                rows.exclude(pk=latest.pk).delete()
                rows.filter(pk=latest.pk).update(lg_parent_id="")
                PendingWrite.objects.filter(thread=thread).exclude(
                    checkpoint_id=latest.lg_id
                ).delete()
    return []
