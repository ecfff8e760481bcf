"""The dashboard's settings, declared once (see ``durability.conf`` for how a declaration is
read and how the environment is parsed).

Declared here, not in the engine, because only the dashboard reads them: its own address
and a trace viewer for links, and where and how notifications are sent. The beat schedule
in config/settings.py reads ``NOTIFY_SECONDS`` and whether a channel is set from here.
"""

from __future__ import annotations

from durability.conf import NAMES, NUMBER, TEXT, WHOLE, Choice, Declarations, Setting

__all__ = ["Dashboard", "conf"]


class Dashboard(Declarations):
    """The dashboard's settings (``DURABILITY_`` + the attribute's name)."""

    DASHBOARD_URL = Setting(
        TEXT, "http://127.0.0.1:8000", "the dashboard's own address, for links in notifications"
    )
    TRACE_URL = Setting(
        TEXT, "", "a run's trace link, e.g. http://127.0.0.1:16686/trace/{trace_id}"
    )
    NOTIFY_WEBHOOK_URL = Setting(TEXT, "", "webhook for notifications (empty: none)")
    NOTIFY_WEBHOOK_FORMAT = Setting(
        Choice("json", "slack"), "json", "json (the event) or slack (a {'text': ...} body)"
    )
    NOTIFY_EMAIL_TO = Setting(NAMES, (), "comma-separated addresses notifications go to")
    NOTIFY_MAX_ATTEMPTS = Setting(WHOLE, 8, "retries with backoff per notification")
    NOTIFY_APPROVAL_OVERDUE_MINUTES = Setting(
        NUMBER, 45.0, "an approval without a deadline is notified again after this long"
    )
    NOTIFY_APPROVAL_EXPIRING_MINUTES = Setting(
        NUMBER, 10.0, "an approval with a deadline is warned about this long before it"
    )
    NOTIFY_SECONDS = Setting(NUMBER, 10.0, "how often beat sends pending notifications")


conf = Dashboard()
