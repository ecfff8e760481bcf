"""The Celery app, configured from Django settings under the CELERY_ namespace."""

import os

from celery import Celery, signals

from config import telemetry

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("durability")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"])


# The SDK's export threads do not survive a fork: each pool process sets telemetry up.
@signals.worker_process_init.connect
def _telemetry_in_pool_process(**kwargs) -> None:
    telemetry.setup("worker")


@signals.worker_init.connect
def _telemetry_without_fork(sender=None, **kwargs) -> None:
    if "prefork" not in str(getattr(sender, "pool_cls", "prefork")).lower():
        telemetry.setup("worker")


@signals.beat_init.connect
def _telemetry_in_beat(**kwargs) -> None:
    telemetry.setup("beat")


@signals.task_postrun.connect
def _export_after_each_task(**kwargs) -> None:
    # A pool process can be SIGKILLed at any moment: what a finished execution traced is
    # exported before its message is acknowledged, not at some later flush.
    telemetry.flush(timeout_ms=5_000)


@signals.worker_process_shutdown.connect
def _telemetry_shutdown(**kwargs) -> None:
    telemetry.shutdown()
