"""The event timeline, workers' presence and rate buckets."""

from __future__ import annotations

import uuid
from typing import Any

from django.db import IntegrityError, connections, models, router, transaction
from django.db.models import Q

from durability.models.runs import Run


class EventKind(models.TextChoices):
    CREATED = "created", "created"
    CLAIMED = "claimed", "claimed"
    CHECKPOINT = "checkpoint", "checkpoint"
    RETRY_SCHEDULED = "retry_scheduled", "retry scheduled"
    SUSPENDED = "suspended", "suspended"
    LEASE_LOST = "lease_lost", "lease lost"
    RECOVERED = "recovered", "recovered"
    RELEASED = "released", "released"
    APPROVAL_REQUESTED = "approval_requested", "approval requested"
    APPROVAL_DECIDED = "approval_decided", "approval decided"
    APPROVAL_ESCALATED = "approval_escalated", "approval escalated"
    EFFECT_IN_DOUBT = "effect_in_doubt", "effect in doubt"
    EFFECT_RESOLVED = "effect_resolved", "effect resolved"
    DIVERGED = "diverged", "diverged from the source run"
    SPAWNED = "spawned", "child spawned"
    CHILD_FINISHED = "child_finished", "child finished"
    MESSAGE_RECEIVED = "message_received", "message received"
    MESSAGE_CONSUMED = "message_consumed", "message consumed"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"
    RESUMED = "resumed", "resumed"
    ROLLBACK = "rollback", "rollback"
    FORK = "fork", "fork"
    COMMIT_FAILED = "commit_failed", "commit failed"
    COMMIT_LATENCY = "commit_latency", "commit latency"
    INTEGRITY = "integrity", "integrity violation"
    ALARM = "alarm", "alarm"
    HOLD = "hold", "legal hold"
    COMPACTED = "compacted", "compacted"
    COMPENSATED = "compensated", "effect compensated"
    EFFECT_REUSED = "effect_reused", "recorded outcome reused"
    # The run was deleted (retention, a LangGraph thread deleted): an audit row that outlives
    # it, with the run's other operator actions (``durability.deletion``).
    DELETED = "deleted", "run deleted"


class WorkerPresence(models.Model):
    """A worker's announcement of the agent versions it can run, renewed while it lives, so
    that a run is sent only to a worker that can continue it (a rolling deploy)."""

    name = models.CharField(max_length=200, primary_key=True)
    capabilities = models.TextField(help_text="canonical JSON: agent -> what it continues")
    started_at = models.DateTimeField()
    seen_at = models.DateTimeField(db_index=True)
    # The advisory lock the worker holds while it lives (PostgreSQL): freed by the database
    # the moment the process dies, so a killed worker stops being chosen at once instead of
    # after the announcement's time to live. Empty: the announcement's age alone tells.
    liveness_key = models.IntegerField(null=True, blank=True)


class RateBucket(models.Model):
    """A token bucket shared by every worker for one named resource (an LLM provider's
    requests or tokens per minute): taken from with one conditional UPDATE."""

    resource = models.CharField(max_length=100, primary_key=True)
    capacity = models.FloatField()
    per_second = models.FloatField()
    tokens = models.FloatField()
    updated_at = models.DateTimeField()


def _check_runs_exist(run_ids: set[Any], using: str) -> None:
    """An event's foreign key, kept by its writers instead of a trigger on every insert.

    The step commit writes its event on the run its fenced UPDATE returned, so it needs no
    check. Every other writer comes here, inside its transaction: on PostgreSQL the run rows
    are locked as a foreign key would lock them (FOR KEY SHARE: a delete waits for the
    event's transaction, or the event sees the run gone); SQLite runs one writer at a time."""
    from durability.store import for_connection

    ids = [uuid.UUID(str(run_id)) for run_id in run_ids]
    found = for_connection(connections[using]).existing_runs(ids)
    missing = sorted(str(run_id) for run_id in ids if run_id not in found)
    if missing:
        raise IntegrityError(f"no run {', '.join(missing)}: an event needs its run")


class EventQuerySet(models.QuerySet["Event"]):
    # django-stubs types ``self`` inside a QuerySet subclass as generic in its model rather
    # than as QuerySet[Event], so super() answers list[_Model]: hence the ignores below.
    def bulk_create(  # type: ignore[override]
        self, objs: Any, *args: Any, run_checked: bool = False, **kwargs: Any
    ) -> list[Event]:
        """``run_checked``: the caller's transaction has already updated (so locked) the
        runs' rows, as the step commit has."""
        objs = list(objs)
        if run_checked:
            return super().bulk_create(objs, *args, **kwargs)  # type: ignore[return-value]
        with transaction.atomic(using=self.db):
            _check_runs_exist({obj.run_id for obj in objs}, self.db)
            return super().bulk_create(objs, *args, **kwargs)  # type: ignore[return-value]


class Event(models.Model):
    """Append-only timeline of a run: the source of the dashboard's timeline, of the audit
    log (rows with an ``actor``) and of the SLO figures."""

    id = models.BigAutoField(primary_key=True)
    # Indexed through (run, id), which also serves the timeline's order. No database
    # constraint: its writers check the run (``_check_runs_exist``). Not deleted with its
    # run by Django: an operator's action (a row with an ``actor``) outlives the run in the
    # audit log, and the rest goes with it through ``durability.deletion``, the one way runs
    # are deleted.
    run = models.ForeignKey(
        Run, on_delete=models.DO_NOTHING, related_name="events", db_index=False, db_constraint=False
    )
    kind = models.CharField(max_length=32, choices=EventKind.choices)
    seq = models.IntegerField(null=True, blank=True, help_text="checkpoint it concerns")
    step = models.CharField(max_length=200, blank=True, default="")
    actor = models.CharField(max_length=150, blank=True, default="", help_text="operator")
    reason = models.TextField(blank=True, default="")
    worker = models.CharField(max_length=200, blank=True, default="")
    data = models.TextField(blank=True, default="", help_text="canonical JSON")
    # Latency of the commit before this row: a checkpoint cannot carry its own.
    commit_us = models.IntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index(fields=["run", "id"], name="event_run"),
            # The audit log: operator actions only, a small part of a large table.
            models.Index(fields=["-id"], name="event_audit", condition=~Q(actor="")),
        ]

    objects = EventQuerySet.as_manager()

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:  # append-only: only an insert needs its run
            super().save(*args, **kwargs)
            return
        using = kwargs.get("using") or router.db_for_write(Event, instance=self)
        with transaction.atomic(using=using):
            _check_runs_exist({self.run_id}, using)
            super().save(*args, **kwargs)
