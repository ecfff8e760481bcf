"""The notification beat task: thin, as tasks here are; the work is dashboard.notifications.

Celery's autodiscovery imports this module (config/celery.py); beat schedules it when a
channel is configured and routes it to the housekeeping queue (config/settings.py)."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="dashboard.notify", ignore_result=True)
def notify() -> dict:
    from dashboard import notifications

    return notifications.run_once()
