"""What the processes' console shows: the product's work, not its heartbeat.

Beat sends a sweep every ``DURABILITY_SWEEP_SECONDS`` (2 s by default) and a worker executes
it: Celery logs three INFO lines for each (beat's "Sending due task", the worker's
"received" and "succeeded"), which buried everything else ``make up`` printed. A sweep that
does something (a run recovered, a timer due, a doorbell rung again) says so itself
(``durability.recovery``), so these lines carry nothing; they are left out of the console.
Warnings and errors about a sweep (it failed, it was refused) are kept."""

from __future__ import annotations

import logging

ROUTINE = frozenset({"durability.sweep"})
# Celery's loggers for a task received, a task's result, and beat sending one.
_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace")
_BEAT_LOGGER = "celery.beat"


class QuietHousekeeping(logging.Filter):
    """Drops Celery's INFO lines about routine housekeeping tasks (``ROUTINE``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        return task_of(record) not in ROUTINE


def task_of(record: logging.LogRecord) -> str | None:
    """The task a Celery log record is about, if it is one of those lines."""
    args = record.args
    if record.name in _TASK_LOGGERS and isinstance(args, dict):
        name = args.get("name")
        return name if isinstance(name, str) else None
    if record.name == _BEAT_LOGGER and isinstance(args, tuple) and len(args) == 2:
        return args[1] if isinstance(args[1], str) else None
    return None
