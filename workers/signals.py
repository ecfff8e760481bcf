"""Celery signal handlers: graceful shutdown and a sweep at start-up."""

from __future__ import annotations

import logging

from celery import signals

from workers import presence, shutdown

log = logging.getLogger(__name__)


@signals.worker_init.connect
def _prepare(**kwargs) -> None:
    shutdown.prepare()


@signals.worker_shutting_down.connect
def _shutting_down(**kwargs) -> None:
    shutdown.announce()
    presence.stop()


@signals.celeryd_after_setup.connect
def _listen_on_own_queue(sender=None, instance=None, **kwargs) -> None:
    # Runs routed to this worker (it announced it can run them) arrive on a queue of its own.
    instance.app.amqp.queues.select_add(presence.direct_queue(sender))


@signals.worker_ready.connect
def _announce(sender=None, **kwargs) -> None:
    try:
        presence.start(sender.hostname)
    except Exception:
        log.warning("could not announce this worker's agents", exc_info=True)


@signals.worker_ready.connect
def _sweep_at_start(**kwargs) -> None:
    # The broker may have lost messages while no worker ran (a Redis restart without
    # persistence): look at the database once now rather than at the next beat.
    from workers.tasks import sweep

    try:
        sweep.apply_async(expires=60)
    except Exception:
        log.warning("could not queue the start-up sweep", exc_info=True)


@signals.task_prerun.connect
def _install_child_handler(**kwargs) -> None:
    shutdown.install_child_handler()
