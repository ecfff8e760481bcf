"""The Celery app, configured from Django settings under the CELERY_ namespace."""

import logging
import os
import sys

from billiard.exceptions import WorkerLostError
from celery import Celery, signals

from config import settings_check, telemetry

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
if sys.argv and sys.argv[0].endswith(("celery", os.path.join("celery", "__main__.py"))):
    # A worker or beat started with a bad environment: one line naming the variable, not
    # Celery's traceback of the lazy settings (``settings_check``).
    settings_check.load_or_exit()

app = Celery("durability")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Each app's tasks.py: the runs' tasks in workers, the notification task in dashboard.
app.autodiscover_tasks(["workers", "dashboard"])


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


class _WorkerLostInOneLine(logging.Filter):
    """A pool process that dies (the demo's deliberate crash, an OOM kill) is reported by
    the pool in one line ("Process 'ForkPoolWorker-1' pid:42 exited with 'signal 9
    (SIGKILL)'"); Celery then logs the same loss again with a traceback of its own pool code,
    never the task's, which only buries that line. The run itself is recovered by the
    sweeper and says so on its page."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(isinstance(arg, WorkerLostError) for arg in args)


logging.getLogger("celery.worker.request").addFilter(_WorkerLostInOneLine())
