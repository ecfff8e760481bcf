"""Deleting a LangGraph thread's runs; LangGraph's ``keep_latest`` pruning, which hides all
but each namespace's latest checkpoint from LangGraph, and ``delete_for_runs``, which hides
the checkpoints of some of its invocations, while the store keeps the runs' history until
retention compacts it (a thread's states are patches on their parents: a checkpoint taken
out of the middle of a chain would leave its children nothing to be rebuilt from)."""

from __future__ import annotations

from collections.abc import Sequence

from django.db import transaction

from durability.deletion import delete_runs
from durability.errors import OnLegalHold
from durability.langgraph import delta, options
from durability.langgraph.models import PendingWrite, SavedCheckpoint, Thread
from durability.models import Run

# Who the audit log says deleted a thread's runs: the graph's own process, through its saver.
DELETER = "langgraph:delete_thread"


def delete_thread(thread_id: str) -> list[Thread]:
    """Delete every namespace's run of the thread, with all their checkpoints; the thread
    rows deleted. The runs are locked first: a checkpoint being stored meanwhile (its
    statement holds its run's row) is then deleted with the rest once it commits, and one
    after it finds its run gone (``ThreadDeleted``). A run on legal hold is refused
    (``OnLegalHold``), and nothing is deleted."""
    thread_id = options.thread_id(thread_id)
    with transaction.atomic():
        threads = list(Thread.objects.filter(thread_id=thread_id))
        locked = list(
            Run.objects.select_for_update()
            .filter(pk__in=[t.run_id for t in threads])
            .order_by("pk")
            .values_list("pk", "legal_hold")
        )
        if held := [str(pk) for pk, hold in locked if hold]:
            raise OnLegalHold(
                f"thread {thread_id!r} is on legal hold: nothing was deleted. Release the"
                f" hold first: python manage.py durability hold {held[0]} --release",
                run_id=held[0],
            )
        delete_runs(
            [pk for pk, _ in locked],
            by=DELETER,
            reason=f"thread {thread_id!r} deleted by its graph's process (delete_thread)",
        )
    return threads


def prune(thread_ids: Sequence[str], strategy: str) -> list[Thread]:
    """LangGraph's ``prune``; the thread rows deleted. Bad input, and ``keep_latest`` on a
    thread with a delta channel (``delta.uses``), are refused before anything changes."""
    if isinstance(thread_ids, str):
        raise TypeError("thread_ids must be a sequence of thread ids, not one string")
    if strategy not in ("keep_latest", "delete"):
        raise ValueError(f"unknown prune strategy {strategy!r}: keep_latest or delete")
    thread_ids = [options.thread_id(t) for t in thread_ids]
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


def delete_for_runs(run_ids: Sequence[str]) -> list[Thread]:
    """LangGraph's ``delete_for_runs``: the checkpoints whose metadata names one of
    ``run_ids`` (LangGraph's run id of the invocation that wrote them) and their pending
    writes, gone from what LangGraph reads (``get_tuple``, ``list``, the history); the
    threads they were in. Bad input, and threads with a delta channel (whose values are
    rebuilt from the writes of older checkpoints), are refused before anything changes."""
    if isinstance(run_ids, str):
        raise TypeError("run_ids must be a sequence of run ids, not one string")
    ids = [str(r) for r in run_ids]
    if not ids:
        return []
    with transaction.atomic():
        rows = SavedCheckpoint.objects.filter(metadata__run_id__in=ids)
        threads = list(Thread.objects.filter(pk__in=rows.values("thread_id")))
        if refused := delta.uses({t.thread_id for t in threads}):
            raise NotImplementedError(
                "delete_for_runs can't take checkpoints out of threads that use a"
                f" DeltaChannel (their values are rebuilt from older checkpoints' writes):"
                f" {', '.join(refused)}; nothing was deleted. delete_thread deletes such a"
                " thread whole."
            )
        for thread in threads:  # one statement a thread, not one a checkpoint
            gone = rows.filter(thread=thread).values("lg_id")
            PendingWrite.objects.filter(thread=thread, checkpoint_id__in=gone).delete()
        rows.delete()
    return threads
