"""One-time form tokens: the first submit of a form acts, a repeat is told what happened.

Spend the token in the same transaction as the action: a concurrent duplicate waits on the
unique key until the first commits, then finds the token spent. If the action is refused
the transaction rolls back and the token can be used again once the input is fixed."""

from __future__ import annotations

import uuid
from typing import Any

from django.db import IntegrityError, transaction

from dashboard.models import Submission
from durability.errors import InvalidInput


class AlreadySubmitted(Exception):  # noqa: N818 - an outcome, not a failure
    def __init__(self, first: Submission) -> None:
        self.first = first
        super().__init__(f"this form was already submitted by {first.username}")


def new_token() -> str:
    return str(uuid.uuid4())


def spend(token: Any, *, action: str, username: str, run_id: Any = None) -> Submission:
    """Record the token as used; call inside ``transaction.atomic()``."""
    try:
        value = uuid.UUID(str(token))
    except ValueError:
        raise InvalidInput(
            "the form has no valid one-time token; reload the page and try again"
        ) from None
    try:
        with transaction.atomic():
            return Submission.objects.create(
                token=value, action=action, username=username, run_id=run_id
            )
    except IntegrityError:
        raise AlreadySubmitted(Submission.objects.get(pk=value)) from None
