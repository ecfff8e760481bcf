"""Celery signal handlers: graceful shutdown and a sweep at start-up.

Two kinds of worker run the same code: run workers (they consume the runs' queue) and the
housekeeping worker (started with ``-Q <queue>.housekeeping`` only), which executes sweeps
and the other beat tasks and never a run: it neither announces agents nor listens on a
queue of its own."""

from __future__ import annotations

import logging

from celery import signals
from django.conf import settings

from workers import presence, shutdown

log = logging.getLogger(__name__)

_runs_here: list[bool] = [False]


@signals.worker_init.connect
def _prepare(**kwargs) -> None:
    shutdown.prepare()


@signals.worker_shutting_down.connect
def _shutting_down(**kwargs) -> None:
    shutdown.announce()
    presence.stop()


@signals.celeryd_after_setup.connect
def _listen_on_own_queue(sender=None, instance=None, **kwargs) -> None:
    queues = instance.app.amqp.queues
    _runs_here[0] = settings.CELERY_TASK_DEFAULT_QUEUE in queues.consume_from
    if not _runs_here[0]:
        return
    # Runs routed to this worker (it announced it can run them) arrive on a queue of its own.
    queues.select_add(presence.direct_queue(sender))
    # Housekeeping too, when a slot is free: a deployment without the housekeeping worker
    # still sweeps. With it, sweeps never wait for a slot here.
    queues.select_add(settings.DURABILITY_HOUSEKEEPING_QUEUE)


@signals.worker_ready.connect
def _announce(sender=None, **kwargs) -> None:
    if not _runs_here[0]:
        return
    try:
        presence.start(sender.hostname)
    except Exception:
        log.warning("could not announce this worker's agents", exc_info=True)


@signals.worker_ready.connect
def _sweep_at_start(sender=None, **kwargs) -> None:
    # The broker may have lost messages while no worker ran (a Redis restart without
    # persistence): look at the database once now rather than at the next beat. On this
    # worker's own queue: this worker sweeps, whether a housekeeping worker runs or not.
    if not _runs_here[0]:
        return
    from workers.tasks import sweep

    try:
        sweep.apply_async(expires=60, queue=presence.direct_queue(sender.hostname))
    except Exception:
        log.warning("could not queue the start-up sweep", exc_info=True)


@signals.task_prerun.connect
def _install_child_handler(**kwargs) -> None:
    shutdown.install_child_handler()
