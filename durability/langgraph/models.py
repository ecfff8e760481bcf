"""Where LangGraph's ids meet this product's store.

A LangGraph thread's namespace is a run (the root namespace "" a run of its own, a
subgraph's namespace a child run of its parent namespace's run); each LangGraph checkpoint
is one of the run's checkpoints, stored as a patch on its parent like every other. These
rows only index them by LangGraph's ids and keep what LangGraph writes beside a checkpoint
(pending writes), which is not part of any checkpoint's state.
"""

from __future__ import annotations

from django.db import models

from durability.models import Checkpoint, Run


class Thread(models.Model):
    """One namespace of one LangGraph thread, and the run that holds its checkpoints."""

    id = models.BigAutoField(primary_key=True)
    thread_id = models.CharField(max_length=255)
    checkpoint_ns = models.CharField(max_length=500, blank=True, default="")
    run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="langgraph_thread")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["thread_id", "checkpoint_ns"], name="lg_thread_ns"),
        ]

    def __str__(self) -> str:
        return f"thread {self.thread_id} {self.checkpoint_ns or '(root)'}"


class SavedCheckpoint(models.Model):
    """A LangGraph checkpoint: its id (uuid6, so ordered by time), its parent's, and its
    metadata as JSON (a queryable copy; the hashed one is in the checkpoint's state)."""

    # No database constraints, as on the engine's own history rows (see the note above
    # ``durability.models.Checkpoint``): the checkpoint is the row the same statement
    # inserted, on its UPDATE of the thread's run; the thread is one the saver read or made.
    # Each constraint cost a trigger and a row lock per superstep, and the thread's row was
    # locked by the checkpoint and the pending writes at once. Deletes cascade through
    # Django's collector. Indexed through the (thread, lg_id) constraint.
    checkpoint = models.OneToOneField(
        Checkpoint,
        primary_key=True,
        on_delete=models.CASCADE,
        related_name="langgraph",
        db_constraint=False,
    )
    thread = models.ForeignKey(
        Thread,
        on_delete=models.CASCADE,
        related_name="checkpoints",
        db_constraint=False,
        db_index=False,
    )
    lg_id = models.CharField(max_length=64)
    lg_parent_id = models.CharField(max_length=64, blank=True, default="")
    metadata = models.JSONField(default=dict)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["thread", "lg_id"], name="lg_checkpoint_id"),
        ]


class PendingWrite(models.Model):
    """A task's write against a checkpoint, kept until the next checkpoint applies it (and
    after, as LangGraph's savers do). Keyed by LangGraph's ids, not by a checkpoint row:
    LangGraph may send a checkpoint's writes while that checkpoint is still being stored."""

    id = models.BigAutoField(primary_key=True)
    # As ``SavedCheckpoint.thread``: unconstrained, indexed through ``lg_write_identity``.
    thread = models.ForeignKey(
        Thread,
        on_delete=models.CASCADE,
        related_name="writes",
        db_constraint=False,
        db_index=False,
    )
    checkpoint_id = models.CharField(max_length=64)
    task_id = models.CharField(max_length=64)
    idx = models.IntegerField()
    channel = models.CharField(max_length=255)
    task_path = models.CharField(max_length=500, blank=True, default="")
    value = models.TextField(help_text="canonical JSON (durability.langgraph.codec)")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["thread", "checkpoint_id", "task_id", "idx"], name="lg_write_identity"
            ),
        ]
