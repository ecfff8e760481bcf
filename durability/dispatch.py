"""The doorbell. The engine marks runs queued in the database; whoever runs the workers
registers a dispatcher that tells them, after the transaction commits. A lost or failed
ring loses nothing: the sweeper rings again for runs left unclaimed."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from django.db import transaction

log = logging.getLogger(__name__)

Dispatcher = Callable[[str, float | None], None]
_dispatcher: Dispatcher | None = None
Unrung = Callable[[str, Exception], None]
_unrung: Unrung | None = None


def set_dispatcher(fn: Dispatcher | None) -> None:
    global _dispatcher
    _dispatcher = fn


def wake(run_id: object, reason: str | None = None) -> bool:
    """A run waiting (for ``reason``, if given) goes back to the queue, and the doorbell
    rings for it once the transaction commits. False if it was not waiting (for that)."""
    from durability import lifecycle

    if not lifecycle.wake(run_id, reason):
        return False
    ring(run_id)
    return True


def ring(run_id: object, delay: float | None = None) -> None:
    """Ask a worker to execute ``run_id`` (after ``delay`` seconds) once the current
    transaction commits; at once outside a transaction."""
    if _dispatcher is None:
        return
    transaction.on_commit(lambda: _send(str(run_id), delay))


@contextlib.contextmanager
def reporting_unrung(report: Unrung) -> Iterator[None]:
    """Within the block, a ring the broker did not take is handed to ``report`` (the CLI
    says so in one line) instead of the log's warning."""
    global _unrung
    previous, _unrung = _unrung, report
    try:
        yield
    finally:
        _unrung = previous


def why(exc: BaseException) -> str:
    """An error in one short line: a broker's errors can span lines (and tracebacks)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:199] + "…"


def _send(run_id: str, delay: float | None) -> None:
    try:
        _dispatcher(run_id, delay)  # type: ignore[misc]
    except Exception as exc:  # the broker is a doorbell: its failures are the sweeper's to repair
        if _unrung is not None:
            _unrung(run_id, exc)
            return
        # One line: a broker that is down fails every ring the same way, and a traceback per
        # ring would bury everything else in the log (it stays available at DEBUG).
        log.warning(
            "could not ring the doorbell for run %s (%s); the sweeper rings it at its next sweep",
            run_id,
            why(exc),
        )
        log.debug("the broker's error for run %s", run_id, exc_info=True)
