"""Sending messages to runs (``ctx.wait_for``)."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from durability import canonical, dispatch, events
from durability.conf import Engine
from durability.errors import IdempotencyConflict, InvalidInput, InvalidTransition
from durability.langgraph.runs import refuse_outside_workers
from durability.models import FINISHED, Message, RunStatus, WaitReason
from durability.operations._runs import _check_version, _encoded, _locked
from durability.redact import redact


def send(
    ref: Any,
    name: str,
    data: Any = None,
    *,
    idempotency_key: str = "",
    by: str = "",
    reason: str = "",
    expected_version: int | None = None,
) -> Message:
    """Deliver a message to a run, kept in order until a step takes it with
    ``ctx.wait_for(name)``. A send retried with the same ``idempotency_key`` is delivered
    once (and returns the first delivery); the same key with other contents is an error.

    ``expected_version``: the run version the sender saw. A send does not move the version
    (it must not fence out the worker executing the run), so without a key of its own the
    send's identity is that version with the message's name and contents: the same message
    sent again on the same version of the run (a double click, a retried request) is
    delivered once; sent again after the run moved on, it is refused as stale."""
    return delivered(
        ref,
        name,
        data,
        idempotency_key=idempotency_key,
        by=by,
        reason=reason,
        expected_version=expected_version,
    )[0]


def delivered(
    ref: Any,
    name: str,
    data: Any = None,
    *,
    idempotency_key: str = "",
    by: str = "",
    reason: str = "",
    expected_version: int | None = None,
) -> tuple[Message, bool]:
    """``send``, and whether this call delivered it (False: a send with its key did)."""
    text, idempotency_key = _message(name, data, idempotency_key, expected_version)
    with transaction.atomic():
        run = _locked(ref)
        refuse_outside_workers(run, "send it a message")
        if idempotency_key:
            first = Message.objects.filter(run=run, idempotency_key=idempotency_key).first()
            if first is not None:
                if (first.name, first.data) != (name, text):
                    raise IdempotencyConflict(
                        f"idempotency key {idempotency_key!r} was already used for another"
                        " message to this run",
                        run_id=run.id,
                    )
                return first, False
        if run.status in FINISHED:
            raise InvalidTransition(
                f"the run is {run.status}; it takes no more messages", run_id=run.id
            )
        _check_version(run, expected_version)
        message = Message.objects.create(
            run=run, name=name, data=text, idempotency_key=idempotency_key, sent_by=by
        )
        events.message_received(
            run, by=by, reason=reason, name=name, size=len(text), message=message.pk
        ).save()
        waits_for_it = run.wait_reason == WaitReason.MESSAGE and run.wait_detail == name
        if run.status == RunStatus.WAITING and waits_for_it:
            dispatch.wake(run.id)
    return message, True


def _message(
    name: str, data: Any, idempotency_key: str, expected_version: int | None
) -> tuple[str, str]:
    """A message's contents as stored, and its idempotency key; bad input refused."""
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise InvalidInput("a message needs a name of 1 to 200 characters")
    if len(idempotency_key) > 255:
        raise InvalidInput("an idempotency key is at most 255 characters")
    payload, _ = redact(canonical.loads(_encoded(data, "message data", Engine.MAX_INPUT_BYTES)))
    text = canonical.dumps(payload).decode()
    if not idempotency_key and expected_version is not None:
        digest = canonical.sha256_hex(name.encode() + b"\x1f" + text.encode())
        idempotency_key = f"version:{expected_version}:{digest}"
    return text, idempotency_key
