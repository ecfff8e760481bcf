"""Rings the doorbell through Celery."""

from __future__ import annotations

import contextvars
import threading

from durability.conf import conf

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
    _within_deadline(lambda: execute_run.apply_async((run_id,), **options))


class BrokerTimeout(Exception):
    pass


def _within_deadline(send) -> None:
    """Publish on a thread of its own and wait at most DURABILITY_RING_TIMEOUT_SECONDS.

    A broker that accepts connections and never answers would otherwise hold the caller (a
    dashboard request, the CLI, a worker) through kombu's and redis-py's retries for minutes.
    A ring that does not go out in time is left to the sweeper, which rings again for runs
    left unclaimed; the thread is a daemon, so a process on its way out does not wait for it."""
    timeout = conf.RING_TIMEOUT_SECONDS
    done = threading.Event()
    failure: list[BaseException] = []

    # The caller's context (its active span) goes along: the publish stays in its trace.
    context = contextvars.copy_context()

    def run() -> None:
        try:
            context.run(send)
        except BaseException as exc:  # handed to the caller
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="doorbell", daemon=True).start()
    if not done.wait(timeout):
        raise BrokerTimeout(f"the broker did not take the message within {timeout:g} s")
    if failure:
        raise failure[0]
