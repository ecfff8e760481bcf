"""What each kind of event says on a run's timeline (dashboard.timeline), and the units it
says it in: ``DESCRIBE[kind](item, event, data)`` fills the item's title, detail and facts."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from durability import approvals
from durability.models import Event, EventKind

if TYPE_CHECKING:
    from dashboard.timeline import Item


def human_ms(ms: Any) -> str:
    if ms is None:
        return "?"
    try:
        ms = float(ms)
    except (TypeError, ValueError):
        return "?"
    if ms == 0:
        return "0 ms"
    if ms < 1:
        return f"{ms:.2f} ms"
    if ms < 1000:
        return f"{ms:.0f} ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def human_bytes(n: Any) -> str:
    try:
        n = int(n)
    except (TypeError, ValueError):
        return "?"
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KB" if n < 10 * 1024 else f"{n // 1024} KB"
    return f"{n / (1024 * 1024):.1f} MB"


def _checkpoint(item: Item, e: Event, d: dict) -> None:
    item.title = f"checkpoint #{e.seq}"
    item.detail = f"after {e.step}" if e.step else ""
    if "bytes" in d:
        item.facts.append(("state", human_bytes(d["bytes"])))
    if "delta" in d:
        item.facts.append(("patch", f"{human_bytes(d['delta'])}, {d.get('ops', '?')} ops"))
    if d.get("upgraded_from") is not None:
        item.facts.append(("upgraded from schema", str(d["upgraded_from"])))


def _created(item: Item, e: Event, d: dict) -> None:
    item.detail = f"{d.get('agent', '')}@{d.get('version', '')}"
    copied = d.get("copied_from")
    if isinstance(copied, dict):  # a LangGraph thread's copy (``copy_thread``)
        item.facts.append(("copied from thread", str(copied.get("thread_id", ""))))
        item.link_run = str(copied.get("run", ""))


def _claimed(item: Item, e: Event, d: dict) -> None:
    item.title = "claimed"
    item.detail = f"by {e.worker}" if e.worker else ""
    if d.get("attempt"):
        item.facts.append(("attempt", str(d["attempt"])))


def _retry_scheduled(item: Item, e: Event, d: dict) -> None:
    item.title = f"retry {d.get('retry', '')} scheduled"
    item.detail = str(d.get("error", ""))
    if "delay_s" in d:
        item.facts.append(("in", human_ms(float(d["delay_s"]) * 1000)))


def _suspended(item: Item, e: Event, d: dict) -> None:
    item.title = "waiting"
    item.detail = " ".join(str(x) for x in (d.get("reason", ""), d.get("detail", "")) if x)


def _lease_lost(item: Item, e: Event, d: dict) -> None:
    item.title = "lease lost"
    item.detail = f"worker {e.worker}: {e.reason}" if e.worker else e.reason


def _recovered(item: Item, e: Event, d: dict) -> None:
    item.title = "recovered"
    item.detail = f"on {e.worker}" if e.worker else ""
    item.facts.append(("after", human_ms(d.get("recovery_ms"))))
    item.facts.append(("work lost", human_ms(d.get("work_lost_ms"))))


def _approval_requested(item: Item, e: Event, d: dict) -> None:
    item.title = "approval requested"
    item.detail = str(d.get("name", ""))


def _approval_decided(item: Item, e: Event, d: dict) -> None:
    verdict = "approved" if d.get("approved") else "rejected"
    edited = " with edits" if d.get("edited") else ""
    timed_out = " (timed out)" if d.get("timeout") else ""
    item.title = f"{d.get('name', 'approval')} {verdict}{edited}{timed_out}"
    changes = d.get("changes")
    if isinstance(changes, list) and changes:
        # What the operator changed, asked -> decided (values as the event keeps them).
        item.detail = approvals.describe([c for c in changes if isinstance(c, dict)])


def _approval_escalated(item: Item, e: Event, d: dict) -> None:
    item.title = f"{d.get('name', 'approval')} escalated"
    item.detail = f"to {d.get('to', '?')}"


def _effect_in_doubt(item: Item, e: Event, d: dict) -> None:
    item.title = "effect in doubt"
    item.detail = str(d.get("key", ""))


def _effect_resolved(item: Item, e: Event, d: dict) -> None:
    item.title = f"effect {d.get('key', '')} resolved: {d.get('outcome', '')}"


# What the operator chose at a rollback for each effect done on the branch left behind.
_ROLLBACK_CHOICES = {
    "compensate": "to compensate before it continues",
    "again": "to perform again without asking",
    "reuse": "to reuse the recorded outcome of",
}


def _rollback(item: Item, e: Event, d: dict) -> None:
    if "langgraph_runs" in d:
        _langgraph_hid(item, e, d)
        return
    item.title = f"rolled back to #{d.get('to', '?')}"
    item.detail = f"new head #{d.get('new_head', e.seq)}"
    undone = d.get("done_not_undone") or []
    if undone:
        item.facts.append(("effects done, not undone", str(len(undone))))
    chosen: dict[str, list[str]] = {}
    for effect in undone:
        if isinstance(effect, dict):
            chosen.setdefault(str(effect.get("decision", "ask")), []).append(
                str(effect.get("key", ""))
            )
    for choice, words in _ROLLBACK_CHOICES.items():
        if chosen.get(choice):
            item.facts.append((words, ", ".join(chosen[choice])))
    if d.get("held"):
        item.facts.append(("then", "on hold until continued"))


def _langgraph_hid(item: Item, e: Event, d: dict) -> None:
    """Checkpoints a LangGraph graph's process took out of LangGraph's view (its saver's
    ``delete_for_runs`` or ``prune``): the store keeps them, the graph goes on from the
    latest one it still sees."""
    to, first, last = d.get("to", "?"), d.get("from", "?"), d.get("through", "?")
    item.title = f"LangGraph went back to #{to}" if d.get("moved") else "LangGraph pruned"
    span = f"#{first}" if first == last else f"#{first} to #{last}"
    item.detail = (
        f"{d.get('hidden', '?')} checkpoint(s) ({span}) taken out of what the graph reads;"
        f" it goes on from #{to}. They stay here until retention compacts them."
    )
    if runs := d.get("langgraph_runs"):
        item.facts.append(("LangGraph runs", ", ".join(str(r) for r in runs)))


def _compensated(item: Item, e: Event, d: dict) -> None:
    item.title = f"effect {d.get('key', '')} compensated"
    item.detail = e.reason
    item.facts.append(("by", str(d.get("function", "")).rsplit(".", 1)[-1]))
    item.facts.append(("idempotency key", str(d.get("idempotency_key", ""))))


def _effect_reused(item: Item, e: Event, d: dict) -> None:
    item.title = f"effect {d.get('key', '')}: recorded outcome reused"
    item.detail = "the abandoned branch's outcome, same arguments: nothing sent again"


def _fork(item: Item, e: Event, d: dict) -> None:
    if "fork" in d:
        item.title = f"forked from #{d.get('from', '?')}"
        item.link_run = str(d["fork"])
        item.detail = "into a new run" + (" with edited state" if d.get("edited") else "")
    else:
        item.title = f"fork of #{d.get('from', '?')}"
        item.link_run = str(d.get("source", ""))
        item.detail = "with edited state" if d.get("edited") else "same state"
    if d.get("what_if"):
        item.facts.append(("what-if", "effects run" if d.get("live") else "effects only recorded"))


def _diverged(item: Item, e: Event, d: dict) -> None:
    item.title = "diverged from the source run"
    item.detail = f"first new call: {d.get('key', '?')} (the calls before it were reused)"


def _spawned(item: Item, e: Event, d: dict) -> None:
    item.title = f"spawned a {d.get('agent', '')} child"
    item.link_run = str(d.get("child", ""))
    item.detail = str(d.get("key", ""))


def _child_finished(item: Item, e: Event, d: dict) -> None:
    item.title = f"child {d.get('status', 'finished')}"
    item.link_run = str(d.get("child", ""))
    item.detail = str(d.get("error", ""))


def _message(item: Item, e: Event, d: dict) -> None:
    item.title = f"message {d.get('name', '')} {e.kind.rsplit('_', 1)[1]}"
    if d.get("bytes") is not None:
        item.facts.append(("size", human_bytes(d["bytes"])))


def _reason(item: Item, e: Event, d: dict) -> None:
    item.detail = e.reason


def _succeeded(item: Item, e: Event, d: dict) -> None:
    if d.get("outcome"):
        item.detail = str(d["outcome"])


def _resumed(item: Item, e: Event, d: dict) -> None:
    item.detail = f"from {d.get('from', '?')}"


def _commit_failed(item: Item, e: Event, d: dict) -> None:
    item.detail = f"{d.get('failed_commits', '?')} commit attempt(s) failed, then succeeded"


def _deleted(item: Item, e: Event, d: dict) -> None:
    item.title = "run deleted"
    item.detail = f"a run of {d['agent']}" if d.get("agent") else ""


DESCRIBE: dict[str, Callable[[Item, Event, dict], None]] = {
    EventKind.CHECKPOINT: _checkpoint,
    EventKind.CREATED: _created,
    EventKind.CLAIMED: _claimed,
    EventKind.RETRY_SCHEDULED: _retry_scheduled,
    EventKind.SUSPENDED: _suspended,
    EventKind.LEASE_LOST: _lease_lost,
    EventKind.RECOVERED: _recovered,
    EventKind.APPROVAL_REQUESTED: _approval_requested,
    EventKind.APPROVAL_DECIDED: _approval_decided,
    "approval_escalated": _approval_escalated,
    EventKind.EFFECT_IN_DOUBT: _effect_in_doubt,
    EventKind.EFFECT_RESOLVED: _effect_resolved,
    EventKind.ROLLBACK: _rollback,
    EventKind.COMPENSATED: _compensated,
    EventKind.EFFECT_REUSED: _effect_reused,
    EventKind.FORK: _fork,
    "diverged": _diverged,
    "spawned": _spawned,
    "child_finished": _child_finished,
    "message_received": _message,
    "message_consumed": _message,
    "alarm": _reason,
    EventKind.FAILED: _reason,
    EventKind.SUCCEEDED: _succeeded,
    EventKind.RESUMED: _resumed,
    EventKind.COMMIT_FAILED: _commit_failed,
    EventKind.INTEGRITY: _reason,
    EventKind.DELETED: _deleted,
}
