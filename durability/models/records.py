"""What a step records: the journal of calls, effects (and those abandoned by a rollback),
approvals and messages."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from durability.models.history import Checkpoint
from durability.models.runs import Run


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
    # Indexed through (run, id): a run's calls in order, and its latest, without a scan. No
    # database constraints on the run or the base, as on a checkpoint's (the note above
    # ``Checkpoint``, models/history.py): a call is recorded by the worker executing the run,
    # on the checkpoint its step started from, both read by that worker; each constraint was
    # a trigger and a lock on the run's row (which every commit updates) per call.
    run = models.ForeignKey(
        Run, on_delete=models.CASCADE, related_name="journal", db_index=False, db_constraint=False
    )
    # Indexed through the identity constraint, which starts with it.
    base = models.ForeignKey(
        Checkpoint,
        on_delete=models.CASCADE,
        related_name="+",
        db_index=False,
        db_constraint=False,
    )
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
    # Unconstrained, as a journal entry's run and base are.
    run = models.ForeignKey(
        Run, on_delete=models.CASCADE, related_name="effects", db_index=False, db_constraint=False
    )
    # Indexed through the identity constraint, which starts with it.
    base = models.ForeignKey(
        Checkpoint,
        on_delete=models.CASCADE,
        related_name="+",
        db_index=False,
        db_constraint=False,
    )
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

    @property
    def takes_edits(self) -> bool:
        """Whether it may be approved with edits (not asked with ``editable=False``)."""
        from durability.approvals import takes_edits

        return takes_edits(self.editable)


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
