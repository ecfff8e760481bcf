"""Deleting a LangGraph thread's runs; LangGraph's ``keep_latest`` pruning, which hides all
but each namespace's latest checkpoint from LangGraph, and ``delete_for_runs``, which hides
the checkpoints of some of its invocations, while the store keeps the runs' history until
retention compacts it (a thread's states are patches on their parents: a checkpoint taken
out of the middle of a chain would leave its children nothing to be rebuilt from).

Hiding checkpoints is told on the run's timeline and in the audit log, as the graph's
process doing it (a ``rollback`` event: LangGraph goes back to the latest checkpoint it
still sees). When that is not the one it saw before (``delete_for_runs`` of its latest
invocation), the run's status is read back from it in the same transaction
(``status.read_back``): a thread sent back to an interrupt waits for its answer again,
rather than showing the end of the invocation LangGraph no longer has. The run's head stays the last
checkpoint stored; the graph's next one is a patch on the one LangGraph went back to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import connection, transaction

from durability import events
from durability.deletion import delete_runs
from durability.errors import OnLegalHold
from durability.langgraph import codec, delta, options, reader, status, store
from durability.langgraph.models import PendingWrite, SavedCheckpoint, Thread
from durability.models import Run
from durability.store import langgraph as lg_store

# Who the audit log says deleted a thread's runs, or hid checkpoints from LangGraph: the
# graph's own process, through its saver.
DELETER = "langgraph:delete_thread"
HIDER = "langgraph:delete_for_runs"
PRUNER = "langgraph:prune"


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
            threads = list(Thread.objects.filter(thread_id=thread_id))
            _lock(threads)
            for thread in threads:
                latest = _latest(thread)
                if latest is None:
                    continue
                rows = SavedCheckpoint.objects.filter(thread=thread)
                older = rows.exclude(lg_id=latest[0])
                hidden = list(older.values_list("checkpoint__seq", flat=True))
                older.delete()
                rows.filter(lg_id=latest[0]).update(lg_parent_id="")
                PendingWrite.objects.filter(thread=thread).exclude(checkpoint_id=latest[0]).delete()
                if hidden:
                    _hidden(thread, hidden, latest, moved=False, serde=None, by=PRUNER)
    return []


def delete_for_runs(run_ids: Sequence[str], serde: Any) -> list[Thread]:
    """LangGraph's ``delete_for_runs``: the checkpoints whose metadata names one of
    ``run_ids`` (LangGraph's run id of the invocation that wrote them) and their pending
    writes, gone from what LangGraph reads (``get_tuple``, ``list``, the history); the
    threads they were in. Bad input, and threads with a delta channel (whose values are
    rebuilt from the writes of older checkpoints), are refused before anything changes.
    ``serde``: the saver's, which decodes the checkpoint a thread's status is read back
    from."""
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
        _lock(threads)
        for thread in threads:  # a statement or two a thread, not one a checkpoint
            was = _latest(thread)
            gone = list(
                rows.filter(thread=thread).values_list(
                    "lg_id", "checkpoint__seq", "metadata__run_id"
                )
            )
            lg_ids = [lg_id for lg_id, _, _ in gone]
            PendingWrite.objects.filter(thread=thread, checkpoint_id__in=lg_ids).delete()
            SavedCheckpoint.objects.filter(thread=thread, lg_id__in=lg_ids).delete()
            now = _latest(thread)
            hidden, runs = [seq for _, seq, _ in gone], sorted({str(r) for _, _, r in gone})
            _hidden(thread, hidden, now, moved=now != was, serde=serde, by=HIDER, runs=runs)
    return threads


def _lock(threads: list[Thread]) -> None:
    """Lock the threads' runs, in one order: a checkpoint being stored meanwhile (its
    statement holds its run's row) commits first, and is seen."""
    pks = sorted({t.run_id for t in threads})
    list(Run.objects.select_for_update().filter(pk__in=pks).order_by("pk").values_list("pk"))


def _latest(thread: Thread) -> tuple[str, int] | None:
    """The LangGraph id and number of the latest checkpoint LangGraph sees of ``thread``."""
    found = SavedCheckpoint.objects.filter(thread=thread).order_by("-lg_id")
    return found.values_list("lg_id", "checkpoint__seq").first()


def _hidden(
    thread: Thread,
    seqs: list[int],
    latest: tuple[str, int] | None,
    *,
    moved: bool,
    serde: Any,
    by: str,
    runs: Sequence[str] = (),
) -> None:
    """Say on the run's timeline (and in the audit log) that checkpoints ``seqs`` were
    taken out of LangGraph's view; if the latest one it sees (``latest``, from ``_latest``)
    changed (``moved``), read the run's status back from that one. In the caller's
    transaction, the run locked."""
    run = Run.objects.get(pk=thread.run_id)
    data = {
        "to": latest[1] if latest else 0,
        "moved": moved,
        "hidden": len(seqs),
        "from": min(seqs),
        "through": max(seqs),
        "langgraph_runs": list(runs),
    }
    what = f"{len(seqs)} checkpoint(s) of thread {thread.thread_id!r} hidden from LangGraph"
    events.record(events.rollback(run, by=by, reason=what, seq=run.head_seq, data=data))
    if not moved:
        return
    if latest is None:  # nothing left: the graph starts the thread over
        kind, text = "wait", status.MID_RUN
    else:
        found = store.stored(thread, latest[0])
        if found is None:  # pragma: no cover - its run is locked
            return
        values = codec.decode(found.doc["values"], serde)
        kind, text = status.read_back(values, reader.task_writes(thread, latest[0], serde))
    change, event = status.change(run.pk, run.head_seq, kind, text)
    lg_store.for_connection(connection).report(run.pk, change, event)
