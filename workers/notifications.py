"""The notification beat task: thin, as tasks here are; the work is dashboard.notifications.

Registered when the dashboard app loads (dashboard/apps.py imports this module), scheduled by
beat when a channel is configured (config/settings.py, "Dashboard")."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="dashboard.notify", ignore_result=True)
def notify() -> dict:
    from dashboard import notifications

    return notifications.run_once()
