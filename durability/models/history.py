"""A run's history: checkpoints (snapshot or delta), the mutation log, snapshots."""

from __future__ import annotations

from django.db import models

from durability.models.runs import Run


class CheckpointReason(models.TextChoices):
    START = "start", "start"
    STEP = "step", "step"
    ROLLBACK = "rollback", "rollback"
    FORK = "fork", "fork"


# A checkpoint's references to its run, its parent and its replay base, and its mutation
# log's and snapshot's to it, carry no database constraint. The step commit, one statement,
# writes them all on its fenced UPDATE of the run: the run is the row it updated, the
# checkpoint the row it inserted, the parent must be the run's head (a condition of the
# UPDATE itself, stronger than a foreign key) and the replay base is one of the run's
# checkpoints the step read. Every other writer holds the run's row lock (start and fork create the
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
    # Seldom set, so indexed only where set. No database constraint: see the note above.
    replay_base = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        db_constraint=False,
        db_index=False,
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
        indexes = [
            models.Index(
                fields=["replay_base"],
                condition=models.Q(replay_base__isnull=False),
                name="checkpoint_replay_base",
            )
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
    # Its checkpoint's run and number, copied (neither ever changes): the patches after a
    # run's nearest snapshot up to its head are one range of this index instead of a walk up
    # the parents, a probe of three indexes per checkpoint. The copies are only where to
    # look: what they find is used only if it hashes to the checkpoint's state hash
    # (``checkpoints.run_state``); else (a LangGraph branch, a rollback stored by an older
    # version as a patch only) the parents are walked. Nullable: workers of the version
    # before these columns, still running during a rolling deploy, write none.
    run_id = models.UUIDField(null=True)
    seq = models.IntegerField(null=True)

    class Meta:
        indexes = [models.Index(fields=["run_id", "seq"], name="mutation_run_seq")]


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
    # Copied from its checkpoint, as on ``Mutation`` (and nullable, as there): a run's nearest
    # snapshot at or before a checkpoint is one index probe.
    run_id = models.UUIDField(null=True)
    seq = models.IntegerField(null=True)

    class Meta:
        indexes = [models.Index(fields=["run_id", "seq"], name="snapshot_run_seq")]
