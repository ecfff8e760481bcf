"""The checkpoint store: runs, checkpoints (snapshot or delta), the mutation log, the journal
of calls, effects, approvals and the event timeline.

State and patches are stored as canonical JSON text (never jsonb: the hashes are computed
over exactly these bytes). State transitions live in ``durability.operations`` and
``durability.executor``, not here; these classes hold data and small derived properties.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db import IntegrityError, connections, models, router, transaction
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


class CheckpointReason(models.TextChoices):
    START = "start", "start"
    STEP = "step", "step"
    ROLLBACK = "rollback", "rollback"
    FORK = "fork", "fork"


# A checkpoint's references to its run and its parent, and its mutation log's and snapshot's
# to it, carry no database constraint. The step commit, one statement, writes them all on its
# fenced UPDATE of the run: the run is the row it updated, the checkpoint the row it
# inserted, and the parent must be the run's head (a condition of the UPDATE itself, stronger
# than a foreign key). Every other writer holds the run's row lock (start and fork create the
# run in the same transaction; rollback, compaction and retention's deletes lock it first)
# or, the snapshot thread, the checkpoint's. A foreign key would check again what these
# prove, with a trigger and a row lock each: about 8% of the commit's server time. Deletes
# cascade through Django's collector. Events are written from many more places: those that
# are not the step commit check their run as they write (``Event.save``).


class Checkpoint(models.Model):
    """Immutable. Its full state is the nearest snapshot on its ancestor path with the
    mutations of every checkpoint after it applied in order."""

    id = models.BigAutoField(primary_key=True)
    # Indexed through the (run, seq) constraint; a second index would only slow commits.
    # No database constraint: see the note above.
    run = models.ForeignKey(
        Run,
        on_delete=models.CASCADE,
        related_name="checkpoints",
        db_index=False,
        db_constraint=False,
    )
    seq = models.IntegerField()
    parent = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="children",
        db_constraint=False,
    )
    reason = models.CharField(
        max_length=16, choices=CheckpointReason.choices, default=CheckpointReason.STEP
    )
    step = models.CharField(max_length=200, blank=True, default="", help_text="producing step")
    next_step = models.CharField(max_length=200, blank=True, default="")
    # SHA-256 of the canonical state for a checkpoint stored whole (a start, a fork); for
    # one stored as a patch, SHA-256 over its parent's state hash and the patch's bytes
    # (``canonical.patched``): it commits to the state at the cost of the change.
    state_hash = models.CharField(max_length=64)
    chain_hash = models.CharField(max_length=64)
    schema_version = models.IntegerField(default=1)
    agent_version = models.CharField(max_length=50)
    # What wrote it: a hash of the agent's definition and the versions of the packages the
    # agent declares, so a resume under other code is noticed.
    config_hash = models.CharField(max_length=64, blank=True, default="")
    # Set by compaction when it removed this checkpoint's parent: the parent's chain hash, so
    # the link can still be checked (the checkpoint then carries a snapshot of its own).
    parent_chain = models.CharField(max_length=64, blank=True, default="", db_default="")
    # And that parent's state hash, so that this checkpoint's patch can still be checked
    # against its own state hash (blank if compacted before it was kept).
    parent_state = models.CharField(max_length=64, blank=True, default="", db_default="")
    # Periodic level: a checkpoint forced in the middle of a period (before an effect or a
    # suspension) lets the step it interrupted keep its operations' identities: the base they
    # were recorded under and the occurrence counters as the step began.
    replay_base = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    replay_counters = models.TextField(blank=True, default="", db_default="")
    packages = models.TextField(blank=True, default="", help_text="canonical JSON")
    size = models.IntegerField(help_text="bytes of the full state")
    delta_size = models.IntegerField(default=0, help_text="bytes of this checkpoint's patch")
    # Patch bytes since the nearest snapshot ancestor, this one included: the snapshot
    # policy writes a new snapshot when this outweighs the state.
    delta_run = models.BigIntegerField(default=0)
    # Made by the worker before committing: after a connection drop during COMMIT, finding
    # this id at the head means the commit happened.
    commit_id = models.UUIDField(null=True, blank=True)
    created_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["run", "seq"], name="checkpoint_run_seq"),
        ]

    def __str__(self) -> str:
        return f"#{self.seq} of {self.run_id}"


class Mutation(models.Model):
    """The mutation log: one checkpoint's RFC 6902 operations, stored once. It is both the
    delta that rebuilds the state and the audit trail of how it changed."""

    # No database constraint: see the note above Checkpoint.
    checkpoint = models.OneToOneField(
        Checkpoint,
        primary_key=True,
        on_delete=models.CASCADE,
        related_name="mutation",
        db_constraint=False,
    )
    ops = models.TextField(help_text="canonical JSON: a list of RFC 6902 operations")
    count = models.IntegerField(default=0)


class Snapshot(models.Model):
    """A checkpoint's full state, written for the first checkpoint of a run and, off the hot
    path, whenever the patches since the last snapshot outweigh the state."""

    # No database constraint: see the note above Checkpoint.
    checkpoint = models.OneToOneField(
        Checkpoint,
        primary_key=True,
        on_delete=models.CASCADE,
        related_name="snapshot",
        db_constraint=False,
    )
    state = models.TextField(help_text="canonical JSON, exactly the bytes that were hashed")
    # ``canonical.seal``: these bytes bound to their checkpoint's state hash (an HMAC with
    # DURABILITY_HMAC_KEY). A checkpoint stored as a patch has a state hash chained over
    # patches, not over its whole state, so its snapshot needs a check of its own.
    digest = models.CharField(max_length=64, blank=True, default="", db_default="")


class CallKind(models.TextChoices):
    CALL = "call", "call"
    NOW = "now", "now"
    UUID = "uuid", "uuid"
    RANDOM = "random", "random"
    SLEEP = "sleep", "sleep"


class JournalEntry(models.Model):
    """A journaled call's result, keyed by the operation's identity: (base checkpoint, key,
    occurrence). Insert-if-absent: whoever loses a race uses the stored value."""

    id = models.BigAutoField(primary_key=True)
    # Indexed through (run, id): a run's calls in order, and its latest, without a scan.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="journal", db_index=False)
    # Indexed through the identity constraint, which starts with it.
    base = models.ForeignKey(Checkpoint, on_delete=models.CASCADE, related_name="+", db_index=False)
    key = models.CharField(max_length=200)
    occurrence = models.IntegerField(default=0)
    kind = models.CharField(max_length=8, choices=CallKind.choices, default=CallKind.CALL)
    step = models.CharField(max_length=200, blank=True, default="")
    function = models.CharField(max_length=300, blank=True, default="")
    args_hash = models.CharField(max_length=64, blank=True, default="")
    result = models.TextField(help_text="canonical JSON")
    duration_ms = models.FloatField(default=0)
    # What is known of an LLM call (model, tokens), for the timeline and traces.
    meta = models.TextField(blank=True, default="")
    replays = models.IntegerField(default=0)
    # In a what-if fork: the source run's record this one reused instead of calling again.
    reused_from = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(fields=["base", "key", "occurrence"], name="journal_identity"),
        ]
        indexes = [models.Index(fields=["run", "id"], name="journal_run")]


class EffectStatus(models.TextChoices):
    PENDING = "pending", "intent recorded"
    DONE = "done", "done"
    FAILED = "failed", "failed"
    IN_DOUBT = "in_doubt", "in doubt"
    RETRY = "retry", "to be retried"
    WOULD_RUN = "would_run", "would have run (what-if)"


class Effect(models.Model):
    """A side effect: intent committed before the call, outcome after."""

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="effects", db_index=False)
    # Indexed through the identity constraint, which starts with it.
    base = models.ForeignKey(Checkpoint, on_delete=models.CASCADE, related_name="+", db_index=False)
    key = models.CharField(max_length=200)
    occurrence = models.IntegerField(default=0)
    step = models.CharField(max_length=200, blank=True, default="")
    function = models.CharField(max_length=300, blank=True, default="")
    args = models.TextField(blank=True, default="", help_text="canonical JSON, redacted")
    args_hash = models.CharField(max_length=64, blank=True, default="")
    idempotency_key = models.CharField(max_length=255, unique=True)
    # What the effect does in the customer's terms ("refund 349 EUR on order A-1001"), as the
    # agent put it; rollback previews and questions say this instead of key and arguments.
    label = models.CharField(max_length=200, blank=True, default="")
    idempotent = models.BooleanField(default=False)
    status = models.CharField(
        max_length=16, choices=EffectStatus.choices, default=EffectStatus.PENDING
    )
    result = models.TextField(blank=True, default="")
    error = models.TextField(blank=True, default="")
    attempts = models.IntegerField(default=0)
    # Re-runs that found the effect done and returned its result instead of repeating it.
    duplicates_prevented = models.IntegerField(default=0)
    resolved_by = models.CharField(max_length=150, blank=True, default="")
    resolution_note = models.TextField(blank=True, default="")
    # How the agent said the effect is undone (``ctx.effect(..., compensate=fn)``): the
    # function's qualified name, imported at compensation time only from the agent's own
    # modules. Empty: it cannot be undone.
    compensate = models.CharField(max_length=300, blank=True, default="", db_default="")
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(fields=["base", "key", "occurrence"], name="effect_identity"),
        ]
        indexes = [models.Index(fields=["run", "id"], name="effect_run")]


class Repeat(models.TextChoices):
    """What a rollback said to do when the new branch reaches an effect with the key of one
    done on the branch it abandoned."""

    ASK = "ask", "ask again when the run gets there"
    REUSE = "reuse", "reuse the recorded outcome (same arguments only)"
    AGAIN = "again", "perform it again"
    COMPENSATE = "compensate", "compensate it now, then perform it again when reached"


class AbandonedEffect(models.Model):
    """An effect done on a branch a rollback abandoned, with the operator's decision for the
    new branch. The n-th effect with a key that the new branch reaches is matched to the n-th
    abandoned one with that key (``settled_*`` is that effect's identity, so a replay of the
    step finds the same match); until a decision says otherwise the run asks before it
    performs it again."""

    # One index serves every read (a run's rows, by key, a rollback's with its run): the
    # unique constraint below, led by the run. The table holds rows only for rollbacks past
    # done effects, so the deletes that reach it through ``rollback``, ``effect`` or
    # ``settled_base`` (a run's retention, a compaction) scan it rather than keep an index
    # each, which every deployment would carry, empty, in its storage.
    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+", db_index=False)
    # The head the rollback made: its descendants are the new branch.
    rollback = models.ForeignKey(
        Checkpoint, on_delete=models.CASCADE, related_name="+", db_index=False
    )
    effect = models.ForeignKey(Effect, on_delete=models.CASCADE, related_name="+", db_index=False)
    key = models.CharField(max_length=200)
    choice = models.CharField(max_length=16, choices=Repeat.choices, default=Repeat.ASK)
    decided_by = models.CharField(max_length=150, blank=True, default="")
    settled_base = models.ForeignKey(
        Checkpoint,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        db_index=False,
    )
    settled_occurrence = models.IntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            # Once per rollback and effect (the run and key are the effect's own).
            models.UniqueConstraint(
                fields=["run", "key", "rollback", "effect"], name="abandoned_effect_once"
            ),
        ]


class ApprovalStatus(models.TextChoices):
    PENDING = "pending", "pending"
    APPROVED = "approved", "approved"
    REJECTED = "rejected", "rejected"
    SUPERSEDED = "superseded", "superseded"


class Approval(models.Model):
    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="approvals")
    base = models.ForeignKey(Checkpoint, on_delete=models.CASCADE, related_name="+")
    name = models.CharField(max_length=200)
    occurrence = models.IntegerField(default=0)
    step = models.CharField(max_length=200, blank=True, default="")
    payload = models.TextField(help_text="canonical JSON, redacted")
    # A replay that asks with a different payload asks anew: approving a 50 EUR refund
    # never authorises 5,000.
    payload_hash = models.CharField(max_length=64)
    status = models.CharField(
        max_length=16, choices=ApprovalStatus.choices, default=ApprovalStatus.PENDING
    )
    decided_by = models.CharField(max_length=150, blank=True, default="")
    decided_at = models.DateTimeField(null=True, blank=True)
    comment = models.TextField(blank=True, default="")
    # Approve with edits: the payload as the operator corrected it (canonical JSON).
    edited_payload = models.TextField(blank=True, default="")
    # The fields an operator may edit, as a JSON Schema the agent gave (canonical JSON; empty:
    # the agent named none, and every field may be edited, typed by its asked value, as before
    # editable= existed). Checked again when the decision is recorded.
    editable = models.TextField(blank=True, default="")
    requested_at = models.DateTimeField(auto_now_add=True)
    # Policy: who may decide (a Django group; empty: any operator), and what happens when
    # nobody has by ``deadline`` (reject, approve, or escalate to another group once).
    group = models.CharField(max_length=150, blank=True, default="")
    timeout_seconds = models.FloatField(null=True, blank=True)
    on_timeout = models.CharField(max_length=16, blank=True, default="")
    escalate_to = models.CharField(max_length=150, blank=True, default="")
    deadline = models.DateTimeField(null=True, blank=True)
    escalations = models.IntegerField(default=0)

    class Meta:
        ordering = ["requested_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["base", "name", "occurrence"],
                condition=~Q(status="superseded"),
                name="approval_identity",
            ),
        ]
        indexes = [
            models.Index(fields=["status", "requested_at"], name="approval_status"),
            models.Index(fields=["status", "deadline"], name="approval_deadline"),
        ]

    @property
    def is_pending(self) -> bool:
        return self.status == ApprovalStatus.PENDING


class Message(models.Model):
    """A message to a run (a user's next chat turn, a webhook, another agent's reply), kept
    in arrival order until a step consumes it with ``ctx.wait_for(name)``. Consumption is
    recorded with the consuming operation's identity, so a replayed step gets the same
    message and a rollback can put it back in the inbox."""

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="messages")
    name = models.CharField(max_length=200)
    data = models.TextField(help_text="canonical JSON, redacted")
    # A send retried with the same key is delivered once.
    idempotency_key = models.CharField(max_length=255, blank=True, default="")
    sent_by = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    consumed_base = models.ForeignKey(
        Checkpoint, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    consumed_occurrence = models.IntegerField(null=True, blank=True)
    consumed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "idempotency_key"],
                condition=~Q(idempotency_key=""),
                name="message_idempotency_key",
            ),
            models.UniqueConstraint(
                fields=["consumed_base", "name", "consumed_occurrence"],
                name="message_consumer_identity",
            ),
        ]
        indexes = [models.Index(fields=["run", "name", "consumed_base"], name="message_inbox")]

    @property
    def is_pending(self) -> bool:
        return self.consumed_base_id is None


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


class EventQuerySet(models.QuerySet):
    def bulk_create(
        self, objs: Any, *args: Any, run_checked: bool = False, **kwargs: Any
    ) -> list[Event]:
        """``run_checked``: the caller's transaction has already updated (so locked) the
        runs' rows, as the step commit has."""
        objs = list(objs)
        if run_checked:
            return super().bulk_create(objs, *args, **kwargs)
        with transaction.atomic(using=self.db):
            _check_runs_exist({obj.run_id for obj in objs}, self.db)
            return super().bulk_create(objs, *args, **kwargs)


class Event(models.Model):
    """Append-only timeline of a run: the source of the dashboard's timeline, of the audit
    log (rows with an ``actor``) and of the SLO figures."""

    id = models.BigAutoField(primary_key=True)
    # Indexed through (run, id), which also serves the timeline's order. No database
    # constraint: its writers check the run (``_check_runs_exist``).
    run = models.ForeignKey(
        Run, on_delete=models.CASCADE, related_name="events", db_index=False, db_constraint=False
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
