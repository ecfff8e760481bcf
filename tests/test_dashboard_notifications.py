"""Notifications: once per event and channel, retried with backoff, recorded; delivered to a
real HTTP receiver (JSON or a Slack-compatible body) and by email; and through a real Celery
worker running the beat task."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core import mail
from django.urls import reverse
from django.utils import timezone

from dashboard import notifications
from dashboard.models import Notification, NotificationStatus
from dashboard.tasks import notify
from durability import operations
from durability.models import Approval, Event, EventKind, Run
from durability.testing import drive, wait_until
from tests.dashboard_helpers import as_operator, dash_agents, operator, text_of, waiting_run

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["as_operator", "dash_agents", "operator"]


class Receiver:
    """A webhook endpoint that records what it gets and answers with scripted statuses."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict, dict]] = []
        self.statuses: list[int] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with outer.lock:
                    status = outer.statuses.pop(0) if outer.statuses else 200
                    if status == 200:
                        outer.requests.append((dict(self.headers), json.loads(body)))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture
def channels(settings, receiver):
    settings.DURABILITY_NOTIFY_WEBHOOK_URL = receiver.url
    settings.DURABILITY_NOTIFY_WEBHOOK_FORMAT = "json"
    settings.DURABILITY_NOTIFY_EMAIL_TO = ["oncall@example.com"]
    settings.DURABILITY_DASHBOARD_URL = "https://durability.example.com"
    return receiver


def test_nothing_happens_without_a_channel(settings):
    settings.DURABILITY_NOTIFY_WEBHOOK_URL = ""
    settings.DURABILITY_NOTIFY_EMAIL_TO = []
    waiting_run()
    assert notifications.run_once() == {"new": 0}
    assert Notification.objects.count() == 0


def test_an_approval_request_goes_out_once_per_channel(channels):
    run = waiting_run("Notify me?")
    first = notifications.run_once()
    assert first == {"new": 2, "sent": 2, "retry": 0, "failed": 0}
    # Scanning again finds the same event: nothing new, nothing sent again.
    assert notifications.run_once() == {"new": 0, "sent": 0, "retry": 0, "failed": 0}
    assert len(channels.requests) == 1 and len(mail.outbox) == 1
    headers, body = channels.requests[0]
    assert body["event"] == "approval.requested" and body["approval"]["name"] == "ship"
    assert body["run"]["id"] == str(run.id) and body["run"]["agent"] == "dash-chain"
    assert body["url"] == f"https://durability.example.com/runs/{run.id}/"
    assert headers["Idempotency-Key"] == f"durability-notification-{body['id']}"
    assert mail.outbox[0].to == ["oncall@example.com"]
    assert "ship" in mail.outbox[0].subject and body["url"] in mail.outbox[0].body
    rows = Notification.objects.all()
    assert {(n.channel, n.status, n.attempts) for n in rows} == {
        ("webhook", "sent", 1),
        ("email", "sent", 1),
    }


def test_failed_runs_and_effects_in_doubt_notify_too(channels, faults):
    run = waiting_run("Cancel then fail?")
    operations.cancel(run.id, by="olive", reason="x")
    faults.set({"point": "after_effect", "action": "crash"})
    doubt = drive(operations.start("dash-chain", {"question": "Doubt?"}).id)
    faults.clear()
    assert doubt.wait_reason == "in_doubt"
    Event.objects.create(run=run, kind=EventKind.FAILED, step="pay", reason="Boom: <b>bad</b>")
    notifications.run_once()
    kinds = sorted(b["event"] for _, b in channels.requests)
    assert kinds == ["approval.requested", "effect.in_doubt", "run.failed"]
    failed = next(b for _, b in channels.requests if b["event"] == "run.failed")
    assert failed["error"] == "Boom: <b>bad</b>"


def test_an_error_message_over_several_lines_makes_a_one_line_subject(channels):
    run = waiting_run("Multi-line?")
    operations.cancel(run.id, by="olive", reason="x")
    Event.objects.create(
        run=run, kind=EventKind.FAILED, step="pay", reason="RateLimitError: 429\nretry\r\n in 20s"
    )
    counts = notifications.run_once()
    assert counts["failed"] == 0 and counts["retry"] == 0
    failed = next(m for m in mail.outbox if "RateLimitError" in m.subject)
    assert "\n" not in failed.subject and "\r" not in failed.subject
    assert "RateLimitError: 429 retry in 20s" in failed.subject
    # The webhook keeps the message as it was.
    body = next(b for _, b in channels.requests if b["event"] == "run.failed")
    assert body["error"] == "RateLimitError: 429\nretry\r\n in 20s"


def test_a_sender_that_breaks_holds_back_only_its_own_notification(channels, monkeypatch):
    waiting_run("First?")
    waiting_run("Second?")

    def broken(note):
        raise ValueError("the mail backend broke")

    monkeypatch.setitem(notifications.SENDERS, "email", broken)
    counts = notifications.run_once()
    assert counts == {"new": 4, "sent": 2, "retry": 2, "failed": 0}
    emails = Notification.objects.filter(channel="email")
    assert {(n.status, n.attempts) for n in emails} == {("pending", 1)}
    assert all("ValueError: the mail backend broke" in n.last_error for n in emails)
    assert all(n.next_attempt_at > timezone.now() for n in emails)


def test_a_failing_webhook_is_retried_with_backoff_then_sent(channels, settings):
    settings.DURABILITY_NOTIFY_EMAIL_TO = []
    waiting_run()
    channels.statuses = [503]
    assert notifications.run_once()["retry"] == 1
    note = Notification.objects.get()
    assert note.status == NotificationStatus.PENDING and note.attempts == 1
    assert "503" in note.last_error and note.next_attempt_at > timezone.now()
    # Not due yet: nothing is sent.
    assert notifications.deliver() == {"sent": 0, "retry": 0, "failed": 0}
    Notification.objects.update(next_attempt_at=timezone.now() - timedelta(seconds=1))
    assert notifications.deliver()["sent"] == 1
    note.refresh_from_db()
    assert (note.status, note.attempts, note.last_error) == ("sent", 2, "")
    assert len(channels.requests) == 1


def test_a_permanent_refusal_is_not_retried_and_attempts_are_capped(channels, settings):
    settings.DURABILITY_NOTIFY_EMAIL_TO = []
    settings.DURABILITY_NOTIFY_MAX_ATTEMPTS = 2
    waiting_run("One?")
    channels.statuses = [400]
    assert notifications.run_once()["failed"] == 1
    assert Notification.objects.get().status == NotificationStatus.FAILED
    waiting_run("Two?")
    channels.statuses = [500, 500]
    notifications.run_once()
    Notification.objects.update(next_attempt_at=timezone.now())
    assert notifications.deliver()["failed"] == 1
    assert Notification.objects.filter(status="failed").count() == 2


def test_slack_compatible_body_escapes_agent_text(channels, settings):
    settings.DURABILITY_NOTIFY_EMAIL_TO = []
    settings.DURABILITY_NOTIFY_WEBHOOK_FORMAT = "slack"
    run = waiting_run()
    Approval.objects.filter(run=run).update(name="<!channel> & ship")
    Event.objects.filter(run=run, kind=EventKind.APPROVAL_REQUESTED).update(
        data=json.dumps({"name": "<!channel> & ship"})
    )
    notifications.run_once()
    _, body = channels.requests[0]
    assert set(body) == {"text", "blocks"}
    assert "&lt;!channel&gt; &amp; ship" in body["text"] and "<!channel>" not in body["text"]
    assert f"/runs/{run.id}/|Open the run>" in body["text"]


def test_an_approval_waiting_too_long_notifies_once_more(channels, settings):
    settings.DURABILITY_NOTIFY_EMAIL_TO = []
    settings.DURABILITY_NOTIFY_APPROVAL_OVERDUE_MINUTES = 30
    run = waiting_run()
    notifications.run_once()
    Approval.objects.filter(run=run).update(requested_at=timezone.now() - timedelta(minutes=31))
    notifications.run_once()
    notifications.run_once()
    kinds = [b["event"] for _, b in channels.requests]
    assert kinds == ["approval.requested", "approval.overdue"]
    assert channels.requests[1][1]["approval"]["waited_minutes"] >= 31


def test_the_notifications_page_lists_deliveries(channels, as_operator):
    waiting_run()
    channels.statuses = [500]
    notifications.run_once()
    html = text_of(as_operator.get(reverse("dashboard:notifications")))
    assert "Approval &#x27;ship&#x27; requested" in html and "HTTP 500" in html
    assert "webhook (json)" in html and "1 email address" in html


def test_the_beat_task_runs_in_a_real_worker(cluster, receiver):
    cluster.worker(
        DURABILITY_NOTIFY_WEBHOOK_URL=receiver.url,
        DURABILITY_NOTIFY_EMAIL_TO="",
        DURABILITY_DASHBOARD_URL="https://durability.example.com",
    )
    # A run the worker itself executes up to an approval (the loop agent asks at i == 0).
    run = operations.start("test-loop", {"n": 2, "approve_at": 0, "tag": "notify "})
    wait_until(
        lambda: Run.objects.get(pk=run.pk).wait_reason == "approval",
        timeout=30,
        what="the run to wait for its approval",
    )
    notify.apply_async(queue=cluster.queue)  # the module's queue, not the app default
    wait_until(lambda: receiver.requests, timeout=30, what="the webhook to be called")
    _, body = receiver.requests[0]
    assert body["run"]["id"] == str(run.id) and body["event"] == "approval.requested"
    # The worker marks the row sent once the receiver has answered: a moment after the
    # request arrived here.
    note = wait_until(
        lambda: Notification.objects.filter(status="sent").first(),
        timeout=30,
        what="the notification to be marked sent",
    )
    assert note.channel == "webhook" and Notification.objects.count() == 1


def test_an_approval_about_to_time_out_is_warned_once_per_deadline(channels, settings):
    settings.DURABILITY_NOTIFY_EMAIL_TO = []
    settings.DURABILITY_NOTIFY_APPROVAL_EXPIRING_MINUTES = 10
    run = waiting_run()
    approval = Approval.objects.get(run=run)
    Approval.objects.filter(pk=approval.pk).update(
        deadline=timezone.now() + timedelta(minutes=30), on_timeout="reject"
    )
    notifications.run_once()
    assert [b["event"] for _, b in channels.requests] == ["approval.requested"]
    Approval.objects.filter(pk=approval.pk).update(deadline=timezone.now() + timedelta(minutes=5))
    notifications.run_once()
    notifications.run_once()
    events = [b for _, b in channels.requests]
    assert [b["event"] for b in events] == ["approval.requested", "approval.overdue"]
    assert "times out in 5 min; then it is rejected" in events[1]["text"]
    # Escalated: a new deadline, a new warning.
    Approval.objects.filter(pk=approval.pk).update(escalations=1)
    notifications.run_once()
    assert len(channels.requests) == 3
