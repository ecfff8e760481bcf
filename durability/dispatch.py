"""The doorbell. The engine marks runs queued in the database; whoever runs the workers
registers a dispatcher that tells them, after the transaction commits. A lost or failed
ring loses nothing: the sweeper rings again for runs left unclaimed."""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import transaction

log = logging.getLogger(__name__)

Dispatcher = Callable[[str, float | None], None]
_dispatcher: Dispatcher | None = None


def set_dispatcher(fn: Dispatcher | None) -> None:
    global _dispatcher
    _dispatcher = fn


def wake(run_id: object, reason: str | None = None) -> bool:
    """A run waiting (for ``reason``, if given) goes back to the queue, and the doorbell
    rings for it once the transaction commits. False if it was not waiting (for that)."""
    from django.db.models.functions import Now

    from durability.models import Run, RunStatus, WaitReason

    waiting = Run.objects.filter(pk=run_id, status=RunStatus.WAITING)
    if reason is not None:
        waiting = waiting.filter(wait_reason=reason)
    if not waiting.update(
        status=RunStatus.QUEUED,
        wait_reason=WaitReason.NONE,
        wait_detail="",
        rung_at=Now(),
        updated_at=Now(),
    ):
        return False
    ring(run_id)
    return True


def ring(run_id: object, delay: float | None = None) -> None:
    """Ask a worker to execute ``run_id`` (after ``delay`` seconds) once the current
    transaction commits; at once outside a transaction."""
    if _dispatcher is None:
        return
    transaction.on_commit(lambda: _send(str(run_id), delay))


def _send(run_id: str, delay: float | None) -> None:
    try:
        _dispatcher(run_id, delay)  # type: ignore[misc]
    except Exception:  # the broker is a doorbell: its failures are the sweeper's to repair
        log.warning(
            "could not ring the doorbell for run %s; the sweeper will", run_id, exc_info=True
        )
