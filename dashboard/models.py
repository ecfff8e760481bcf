"""What the dashboard keeps of its own: notifications sent (or being retried) and the one-time
tokens that make action forms safe against a double click.

Runs, checkpoints and the audit trail are the engine's; nothing here changes them."""

from __future__ import annotations

import uuid

from django.db import models


class NotificationStatus(models.TextChoices):
    PENDING = "pending", "pending"
    SENT = "sent", "sent"
    FAILED = "failed", "failed"


class NotificationKind(models.TextChoices):
    APPROVAL_REQUESTED = "approval.requested", "approval requested"
    APPROVAL_OVERDUE = "approval.overdue", "approval waiting too long"
    RUN_FAILED = "run.failed", "run failed"
    EFFECT_IN_DOUBT = "effect.in_doubt", "effect in doubt"


class Channel(models.TextChoices):
    WEBHOOK = "webhook", "webhook"
    EMAIL = "email", "email"


class Notification(models.Model):
    """One message for one event on one channel. The unique key is what makes it "once per
    event": scanning the same event again inserts nothing."""

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=200, help_text="what it is about, e.g. event:123")
    channel = models.CharField(max_length=16, choices=Channel.choices)
    kind = models.CharField(max_length=32, choices=NotificationKind.choices)
    run_id = models.UUIDField(null=True, blank=True)
    subject = models.CharField(max_length=300)
    body = models.TextField(help_text="the JSON document sent (redacted)")
    status = models.CharField(
        max_length=16, choices=NotificationStatus.choices, default=NotificationStatus.PENDING
    )
    attempts = models.IntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(fields=["key", "channel"], name="notification_once"),
        ]
        indexes = [
            models.Index(fields=["status", "next_attempt_at"], name="notification_due"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} via {self.channel}: {self.status}"


class Submission(models.Model):
    """A form's one-time token, spent when the action it carries succeeds. A second submit
    of the same form (a double click, a resent request) finds it spent and is told what the
    first one did, instead of doing it again."""

    token = models.UUIDField(primary_key=True, default=uuid.uuid4)
    action = models.CharField(max_length=32)
    username = models.CharField(max_length=150)
    run_id = models.UUIDField(null=True, blank=True)
    outcome = models.TextField(blank=True, default="")
    result_run_id = models.UUIDField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.action} by {self.username}"
