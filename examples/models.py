"""The demo's outside world: an outbox that effects write to (publishing, emails, a refund
ledger). Each row is keyed by the idempotency key it was sent with, as a real provider
would keep it, so a repeated request is answered with the first one's outcome."""

from django.db import models


class OutboxMessage(models.Model):
    idempotency_key = models.CharField(max_length=255, unique=True)
    channel = models.CharField(max_length=50)
    recipient = models.CharField(max_length=200, blank=True, default="")
    subject = models.CharField(max_length=300, blank=True, default="")
    body = models.TextField(blank=True, default="")
    amount_eur = models.DecimalField(max_digits=10, decimal_places=2, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.channel}: {self.subject or self.body[:40]}"
