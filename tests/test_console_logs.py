"""The processes' console: Celery's lines about the sweep beat sends every two seconds are
left out (a sweep that does something says so itself); every other task's lines, and any
warning about a sweep, are kept. Checked on the console handler the settings configure, with
the records Celery's own loggers make from its own message formats."""

from __future__ import annotations

import io
import logging

import pytest
from celery.app.trace import LOG_RECEIVED, LOG_SUCCESS

from config.logs import QuietHousekeeping

pytestmark = pytest.mark.smoke


def console() -> logging.Handler:
    found = [
        h
        for h in logging.getLogger().handlers
        if any(isinstance(f, QuietHousekeeping) for f in h.filters)
    ]
    assert len(found) == 1, "the settings' console handler filters housekeeping"
    return found[0]


def printed(*records: logging.LogRecord) -> str:
    handler = console()
    stream = io.StringIO()
    assert isinstance(handler, logging.StreamHandler)
    previous = handler.setStream(stream)
    try:
        for record in records:
            handler.handle(record)
    finally:
        handler.setStream(previous)
    return stream.getvalue()


def celery_record(logger: str, level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.getLogger(logger).makeRecord(logger, level, __file__, 1, msg, args, None)


def task_lines(task: str, level: int = logging.INFO) -> list[logging.LogRecord]:
    received = {"name": task, "id": "d2f1", "args": "()", "kwargs": "{}"}
    success = {"name": task, "id": "d2f1", "runtime": 0.004, "return_value": "{'recovered': 0}"}
    return [
        celery_record("celery.beat", level, "Scheduler: Sending due task %s (%s)", "x", task),
        celery_record("celery.worker.strategy", level, LOG_RECEIVED, received),
        celery_record("celery.app.trace", level, LOG_SUCCESS, success),
    ]


def test_routine_sweeps_stay_out_of_the_console():
    assert printed(*task_lines("durability.sweep")) == ""


def test_other_tasks_and_warnings_about_sweeps_are_kept():
    shown = printed(*task_lines("durability.execute"), *task_lines("durability.prune"))
    assert shown.count("durability.execute") == 3 and shown.count("durability.prune") == 3
    warned = printed(*task_lines("durability.sweep", logging.WARNING))
    assert warned.count("durability.sweep") == 3
    said = printed(
        celery_record("durability.recovery", logging.INFO, "sweep: %d recovered", 2),
    )
    assert "sweep: 2 recovered" in said
