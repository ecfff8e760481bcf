"""Helpers for testing agents and the engine: drive a run in this process, wait for a
condition, read states. Public so that agent authors' tests need no internals."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from django.utils import timezone

from durability import operations
from durability.models import FINISHED, TIMED_WAITS, Run, RunStatus
from durability.runtime.executor import Outcome, execute
from durability.runtime.faults import SimulatedCrash


def wait_until(
    condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout``."""
    give_up = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what or condition}")
        time.sleep(interval)


def drive(
    run_id: Any,
    *,
    max_executions: int = 50,
    max_wait: float = 30.0,
    worker: str = "test-worker",
    crashes: bool = True,
) -> Run:
    """Execute ``run_id`` in this process until it finishes or waits for a person (an
    approval, an effect in doubt). Retries and timers are waited for (up to ``max_wait``
    seconds each); a ``SimulatedCrash`` fault is survived like a process dying."""
    for _ in range(max_executions):
        run = Run.objects.get(pk=run_id)
        if run.status in FINISHED:
            return run
        if run.status == RunStatus.WAITING and run.wait_reason not in TIMED_WAITS:
            return run
        if run.wake_at is not None:
            delay = (run.wake_at - timezone.now()).total_seconds()
            if delay > max_wait:
                raise AssertionError(f"run {run_id} would wait {delay:.1f} s")
            if delay > 0:
                time.sleep(delay + 0.01)
        try:
            outcome = execute(run_id, worker=worker)
        except SimulatedCrash:
            if not crashes:
                raise
            continue
        if outcome == Outcome.BUSY:
            time.sleep(0.05)
    raise AssertionError(f"run {run_id} did not settle after {max_executions} executions")


def state_of(run_id: Any, seq: int | None = None) -> Any:
    return operations.state_at(run_id, seq)
