"""Rings the doorbell through Celery."""

from __future__ import annotations

# An ETA message sits unacknowledged in a worker; past the broker's visibility timeout it
# would be delivered twice. Longer waits are left to the sweeper, which wakes them when due.
MAX_COUNTDOWN_SECONDS = 60.0


def publish(run_id: str, delay: float | None = None) -> None:
    from django.conf import settings

    from durability import presence as who
    from workers.presence import direct_queue
    from workers.tasks import execute_run

    worker, why = who.route(run_id)
    if why:
        who.wait_for_a_worker(run_id, why)  # no live worker can continue it: it waits, visibly
        return
    queue = direct_queue(worker) if worker else settings.CELERY_TASK_DEFAULT_QUEUE
    options = {"queue": queue}
    if delay is not None and delay > 0:
        if delay > MAX_COUNTDOWN_SECONDS:
            return
        options["countdown"] = delay
    execute_run.apply_async((run_id,), **options)
