"""The demo's tools and effects. Effects take the ``idempotency_key`` the engine passes and
hand it to the outside system (here: the outbox table), which keeps the first outcome."""

from __future__ import annotations

import json
from decimal import Decimal
from functools import lru_cache
from pathlib import Path

from django.db import IntegrityError, transaction

ORDERS = Path(__file__).parent / "data" / "orders.json"


@lru_cache(maxsize=1)
def _orders() -> dict:
    return json.loads(ORDERS.read_text())


def lookup_order(order_id: str) -> dict:
    order = _orders().get(order_id)
    if order is None:
        return {"lookup": "order_missing", "order_id": order_id}
    return {**order, "lookup": "order_found", "order_id": order_id}


def _deliver(idempotency_key: str, **fields) -> dict:
    from examples.models import OutboxMessage

    try:
        with transaction.atomic():
            message = OutboxMessage.objects.create(idempotency_key=idempotency_key, **fields)
        created = True
    except IntegrityError:
        message = OutboxMessage.objects.get(idempotency_key=idempotency_key)
        created = False
    return {"outbox_id": message.pk, "channel": message.channel, "first_delivery": created}


def publish(subject: str, body: str, *, idempotency_key: str) -> dict:
    return _deliver(idempotency_key, channel="publish", subject=subject[:300], body=body)


def send_email(recipient: str, subject: str, body: str, *, idempotency_key: str) -> dict:
    return _deliver(
        idempotency_key, channel="email", recipient=recipient, subject=subject[:300], body=body
    )


def refund(order_id: str, amount_eur: float, *, idempotency_key: str) -> dict:
    result = _deliver(
        idempotency_key,
        channel="refund",
        subject=f"refund {order_id}",
        amount_eur=Decimal(str(amount_eur)),
    )
    return {**result, "order_id": order_id, "amount_eur": amount_eur}


def reverse_refund(
    receipt: dict, order_id: str, amount_eur: float, *, idempotency_key: str
) -> dict:
    """How a refund is undone (its ``compensate=``): a reversal for the same amount, written
    to the ledger (its own channel) as a negative amount and keyed by its own idempotency key."""
    result = _deliver(
        idempotency_key,
        channel="reversal",
        subject=f"reversal of refund {order_id}",
        amount_eur=-Decimal(str(amount_eur)),
    )
    return {**result, "order_id": order_id, "reversed_eur": amount_eur}
