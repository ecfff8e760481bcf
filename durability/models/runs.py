"""Runs: their status, what they wait for, their durability level, and the run row."""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q


class RunStatus(models.TextChoices):
    QUEUED = "queued", "queued"
    RUNNING = "running", "running"
    WAITING = "waiting", "waiting"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"


FINISHED = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)


class WaitReason(models.TextChoices):
    NONE = "", "-"
    APPROVAL = "approval", "approval"
    TIMER = "timer", "timer"
    IN_DOUBT = "in_doubt", "effect in doubt"
    RETRY = "retry", "retry backoff"
    MESSAGE = "message", "message"
    CHILDREN = "children", "child runs"
    VERSION = "version", "a worker with a compatible agent version"
    CONCURRENCY = "concurrency", "a free slot (the agent's concurrency limit)"
    RATE_LIMIT = "rate_limit", "a shared rate limit"
    # Left by a rollback (unless the operator chose "roll back and continue"): nothing runs
    # until an operator continues the run.
    HOLD = "hold", "an operator to continue it (on hold)"
    # A LangGraph graph executed in its own process (``durability.langgraph``): nothing here
    # ends these waits, the graph's process does when it invokes the graph again.
    GRAPH = "graph", "its graph to go on, in its own process"
    INTERRUPT = "interrupt", "an answer to an interrupt, from the graph's own process"


# Waits that end by themselves at ``wake_at``.
TIMED_WAITS = (WaitReason.TIMER, WaitReason.RATE_LIMIT)


class Durability(models.TextChoices):
    """How a checkpoint commit waits (effects, decisions and operator actions always commit
    synchronously, whatever the level)."""

    STRICT = "strict", "strict: flushed to disk before the next step"
    RELAXED = "relaxed", "relaxed: the flush is not waited for"
    REPLICATED = "replicated", "replicated: applied on a synchronous standby"
    PERIODIC = "periodic", "periodic: a checkpoint every N steps or T seconds"


RECOVERY_POINTS = {
    "strict": "nothing committed is lost",
    "relaxed": "a database crash may lose the last fraction of a second of checkpoints",
    "periodic": "a crash re-executes the steps since the last checkpoint, calls replayed",
    "replicated": "committed on a synchronous standby too",
}


class Run(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Indexed through the composite indexes below, which lead with it: single-column indexes
    # (and their LIKE twins) would only add writes to every change of status.
    agent = models.CharField(max_length=200)
    agent_version = models.CharField(max_length=50)
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    wait_reason = models.CharField(
        max_length=16, choices=WaitReason.choices, default=WaitReason.NONE, blank=True
    )
    wait_detail = models.CharField(max_length=500, blank=True, default="")
    # The program counter at the head: the step to run next (empty once finished).
    step = models.CharField(max_length=200, blank=True, default="")
    input = models.TextField(help_text="canonical JSON")
    head_seq = models.IntegerField(default=0)
    # Fencing: every claim, cancel and operator action bumps the token; every fenced write
    # carries the token it was given and changes nothing if it no longer matches.
    lease_token = models.BigIntegerField(default=0)
    lease_owner = models.CharField(max_length=200, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    # Claims in a row that did not end cleanly (a crash); reset by any clean ending.
    attempts = models.IntegerField(default=0)
    # Transient failures in a row of the current step; reset by a checkpoint.
    retries = models.IntegerField(default=0)
    # Not runnable before this time (a retry backoff or a durable timer).
    wake_at = models.DateTimeField(null=True, blank=True)
    # When the doorbell was last rung; the sweeper rings again for runs left unclaimed.
    rung_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    error_code = models.CharField(max_length=32, blank=True, default="")
    # How the run ended in the agent's words ("declined", "rejected at publish"); empty
    # means its status says it all. An outcome is not a status: a run that declined succeeded.
    outcome = models.CharField(max_length=120, blank=True, default="")
    # Times a claim took the run over from a dead or lost attempt (the list marks and filters
    # recovered runs without reading their events).
    recoveries = models.IntegerField(default=0)
    # Set when a lease is found dead: the heartbeat and checkpoint time of the lost attempt,
    # from which the next claim computes recovery time and work lost.
    lost_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # When the lost attempt's process was found gone (its liveness lock free: by a sweep, or
    # by the claim of its redelivered task), which is within a sweep of its death; null when
    # only its lease expired (a stall, which began after its last heartbeat).
    lost_seen_at = models.DateTimeField(null=True, blank=True)
    forked_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="forks"
    )
    forked_from_seq = models.IntegerField(null=True, blank=True)
    # A what-if fork reuses the source run's recorded calls that match (key, function and
    # arguments) instead of calling again; unless live, its effects are only recorded.
    what_if = models.BooleanField(default=False)
    what_if_live = models.BooleanField(default=False)
    created_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # W3C traceparents: the span that started the run (every execution is parented there,
    # so a run is one trace) and the latest execution's span (the next one links to it).
    trace_parent = models.CharField(max_length=64, blank=True, default="")
    trace_exec = models.CharField(max_length=64, blank=True, default="")
    durability = models.CharField(
        max_length=16, choices=Durability.choices, default=Durability.STRICT
    )
    # A run on legal hold is never pruned nor compacted, whatever the retention policy.
    legal_hold = models.BooleanField(default=False)
    # Starting again with the same key returns this run instead of starting a second one.
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    input_hash = models.CharField(max_length=64, blank=True, default="")
    # A child run is its own record of the spawn that made it: (base checkpoint, key,
    # occurrence) of the parent's ctx.spawn, unique, so a re-run never makes a second child.
    parent_run = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="children"
    )
    spawn_base = models.ForeignKey(
        "Checkpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    spawn_key = models.CharField(max_length=200, blank=True, default="")
    spawn_occurrence = models.IntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["idempotency_key"],
                condition=~Q(idempotency_key=""),
                name="run_idempotency_key",
            ),
            models.UniqueConstraint(
                fields=["spawn_base", "spawn_key", "spawn_occurrence"],
                name="run_spawn_identity",
            ),
        ]
        indexes = [
            # The sweeper's scans: runnable or dead, oldest first.
            # (No index on lease_expires_at: every commit extends the lease, and an index on
            # it would turn each commit's UPDATE of the run from HOT into a full one.)
            models.Index(fields=["status", "wake_at"], name="run_status_wake"),
            # The runs list: filtered by status or agent, newest first, keyset pages.
            models.Index(fields=["status", "-created_at", "-id"], name="run_status_created"),
            models.Index(fields=["agent", "-created_at", "-id"], name="run_agent_created"),
            models.Index(fields=["agent", "status"], name="run_agent_status"),
        ]

    def __str__(self) -> str:
        return f"{self.agent}@{self.agent_version} {self.short_id} {self.status}"

    @property
    def short_id(self) -> str:
        return str(self.id)[:8]

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    @property
    def recovery_point(self) -> str:
        """What a crash can cost this run, by its durability level."""
        return RECOVERY_POINTS.get(self.durability, "")
