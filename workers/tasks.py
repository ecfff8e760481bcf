"""Thin Celery tasks: take an id, call the engine."""

from __future__ import annotations

import logging
import os

from celery import shared_task

from durability import recovery
from durability.runtime import executor
from durability.runtime.faults import fault
from durability.store.reconnect import DB_DOWN, drop
from workers import shutdown

log = logging.getLogger(__name__)


@shared_task(
    name="durability.execute_run",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
)
def execute_run(self, run_id: str) -> str:
    worker = f"{self.request.hostname or 'worker'}:{os.getpid()}"
    with shutdown.executing():
        outcome = executor.execute(run_id, worker=worker, should_stop=shutdown.requested)
    fault("before_ack", run=run_id, outcome=outcome)
    return str(outcome)


@shared_task(name="durability.sweep", ignore_result=True)
def sweep() -> dict:
    try:
        report = recovery.sweep()
    except DB_DOWN as exc:
        # The database away: the next sweep, two seconds on, tries again. One line each,
        # not a traceback every two seconds for the length of an outage.
        drop()
        log.warning("sweep skipped: the database did not answer (%s)", str(exc).strip())
        return {"skipped": 1}
    return {
        "recovered": len(report.recovered),
        "timers": len(report.timers),
        "rung": len(report.rung),
    }


@shared_task(name="durability.prune", ignore_result=True)
def prune() -> dict:
    from durability.retention import prune as apply_retention

    report = apply_retention()
    return {
        "deleted": len(report.runs_deleted),
        "compacted": len(report.compacted),
        "blobs_deleted": len(report.blobs_deleted),
    }
