"""Notifications: a webhook (JSON, or a Slack-compatible body) and email when an approval is
requested, is about to time out (or, without a deadline, has waited too long), is approved
with edits (what was asked and what was decided), a run fails, or an effect goes in doubt.

Two passes, each safe to run from several beats at once:

1. ``collect``: turn recent events into ``Notification`` rows, one per event and channel. The
   unique key makes a second scan of the same event insert nothing: once per event.
2. ``deliver``: send what is due, one row locked at a time (``SKIP LOCKED``); a failure is
   recorded and retried with exponential backoff, a permanent one (a 4xx other than 408/429)
   is not retried. A webhook carries an ``Idempotency-Key`` header, so a receiver can drop the
   rare repeat when a process dies between sending and recording.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.db.models import Q
from django.urls import reverse
from django.utils import timezone

from dashboard.conf import conf
from dashboard.models import Channel, Notification, NotificationKind, NotificationStatus
from durability import approvals, canonical
from durability.models import Approval, ApprovalStatus, Event, EventKind, Run

log = logging.getLogger(__name__)

# Events a scan looks back over: wide enough for a transaction that wrote an event a while
# before committing, and for a beat that was down for a moment.
LOOKBACK = timedelta(hours=1)
# An approval decided with edits: the operator changed what the agent asked, which the
# people watching should hear about. Not (yet) among NotificationKind's choices: adding it
# there needs a migration of its own (choices only, no table change).
APPROVAL_EDITED = "approval.edited"
KINDS = {
    EventKind.APPROVAL_REQUESTED: NotificationKind.APPROVAL_REQUESTED,
    EventKind.APPROVAL_DECIDED: APPROVAL_EDITED,
    EventKind.FAILED: NotificationKind.RUN_FAILED,
    EventKind.EFFECT_IN_DOUBT: NotificationKind.EFFECT_IN_DOUBT,
}
TIMEOUT_SECONDS = 10


def channels() -> list[str]:
    found = []
    if conf.NOTIFY_WEBHOOK_URL:
        found.append(Channel.WEBHOOK)
    if conf.NOTIFY_EMAIL_TO:
        found.append(Channel.EMAIL)
    return found


def run_url(run_id: Any) -> str:
    base = conf.DASHBOARD_URL.rstrip("/")
    return base + reverse("dashboard:run", args=[run_id])


@dataclass
class Message:
    key: str
    kind: str
    run: Run
    text: str
    detail: dict[str, Any]

    def document(self) -> dict[str, Any]:
        return {
            "id": self.key,
            "event": self.kind,
            "text": self.text,
            "url": run_url(self.run.id),
            "run": {
                "id": str(self.run.id),
                "agent": self.run.agent,
                "version": self.run.agent_version,
                "status": self.run.status,
                "step": self.run.step,
            },
            **self.detail,
        }


def _from_event(event: Event) -> Message | None:
    run = event.run
    data = canonical.loads_object(event.data)
    who = f"{run.agent}@{run.agent_version} run {run.short_id}"
    kind = KINDS[event.kind]
    if kind == APPROVAL_EDITED:
        changes = [c for c in data.get("changes") or [] if isinstance(c, dict)]
        if not changes:
            return None  # decided as asked: nothing the watchers did not already know
        text = (
            f"Approval {data.get('name', '?')!r} of {who} approved by {event.actor or '?'}"
            f" with edits: {approvals.describe(changes)}"
        )
        detail = {
            "approval": {"name": data.get("name"), "decided_by": event.actor},
            "changes": changes,
        }
    elif kind == NotificationKind.APPROVAL_REQUESTED:
        text = f"Approval {data.get('name', '?')!r} requested by {who}"
        detail = {"approval": {"name": data.get("name"), "step": event.step}}
    elif kind == NotificationKind.RUN_FAILED:
        text = f"{who} failed in step {event.step!r}: {event.reason[:300]}"
        detail = {"error": event.reason[:2000]}
    else:
        text = f"Effect {data.get('key', '?')!r} of {who} is in doubt and waits for an operator"
        detail = {
            "effect": {"key": data.get("key"), "idempotency_key": data.get("idempotency_key")}
        }
    return Message(
        f"event:{event.pk}", kind, run, text, {"at": event.created_at.isoformat(), **detail}
    )


def _overdue(approval: Approval, minutes: float) -> Message:
    run = approval.run
    waited = (timezone.now() - approval.requested_at).total_seconds() / 60
    text = (
        f"Approval {approval.name!r} of {run.agent}@{run.agent_version} run {run.short_id}"
        f" has waited {waited:.0f} min (over {minutes:g} min)"
    )
    detail = {
        "at": timezone.now().isoformat(),
        "approval": {
            "name": approval.name,
            "requested_at": approval.requested_at.isoformat(),
            "waited_minutes": round(waited, 1),
        },
    }
    return Message(
        f"approval-overdue:{approval.pk}", NotificationKind.APPROVAL_OVERDUE, run, text, detail
    )


def _expiring(approval: Approval) -> Message:
    run = approval.run
    left = max(0.0, (approval.deadline - timezone.now()).total_seconds() / 60)
    if approval.on_timeout == "escalate" and not approval.escalations:
        then = f"it goes to {approval.escalate_to}"
    elif approval.on_timeout == "approve" and not approval.escalations:
        then = "it is approved"
    else:
        then = "it is rejected"
    text = (
        f"Approval {approval.name!r} of {run.agent}@{run.agent_version} run {run.short_id}"
        f" times out in {left:.0f} min; then {then}"
    )
    detail = {
        "at": timezone.now().isoformat(),
        "approval": {
            "name": approval.name,
            "group": approval.group,
            "deadline": approval.deadline.isoformat(),
            "on_timeout": approval.on_timeout,
        },
    }
    # Keyed by the escalation too: an escalated approval has a new deadline to warn about.
    key = f"approval-expiring:{approval.pk}:{approval.escalations}"
    return Message(key, NotificationKind.APPROVAL_OVERDUE, run, text, detail)


def collect(now: Any = None) -> int:
    """Create the notifications recent events call for; returns how many were new."""
    targets = channels()
    if not targets:
        return 0
    now = now or timezone.now()
    events = (
        Event.objects.filter(created_at__gte=now - LOOKBACK, kind__in=list(KINDS))
        .select_related("run")
        .order_by("id")
    )
    messages = [m for m in map(_from_event, events) if m is not None]
    minutes = conf.NOTIFY_APPROVAL_OVERDUE_MINUTES
    # Without a deadline: a second word once it has waited too long. With one: a warning
    # shortly before the policy decides on the operators' behalf.
    overdue = Approval.objects.filter(
        status=ApprovalStatus.PENDING,
        deadline__isnull=True,
        requested_at__lte=now - timedelta(minutes=minutes),
    ).select_related("run")
    messages += [_overdue(a, minutes) for a in overdue]
    warn = conf.NOTIFY_APPROVAL_EXPIRING_MINUTES
    expiring = Approval.objects.filter(
        status=ApprovalStatus.PENDING, deadline__lte=now + timedelta(minutes=warn)
    ).select_related("run")
    messages += [_expiring(a) for a in expiring]
    if not messages:
        return 0
    before = Notification.objects.count()
    Notification.objects.bulk_create(
        [
            Notification(
                key=m.key,
                channel=channel,
                kind=m.kind,
                run_id=m.run.id,
                subject=one_line(m.text)[:300],
                body=json.dumps(m.document(), sort_keys=True),
                next_attempt_at=now,
            )
            for m in messages
            for channel in targets
        ],
        ignore_conflicts=True,
    )
    return Notification.objects.count() - before


# --- delivery ---------------------------------------------------------------------------------


class DeliveryError(Exception):
    def __init__(self, message: str, *, permanent: bool = False) -> None:
        self.permanent = permanent
        super().__init__(message)


def one_line(text: str) -> str:
    """Agent text (an error message) may hold line breaks; a mail header may not."""
    return " ".join(text.split())


def slack_escape(text: str) -> str:
    """Slack's mrkdwn gives &, < and > meaning; agent names are untrusted."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def webhook_body(note: Notification) -> bytes:
    document = json.loads(note.body)
    if conf.NOTIFY_WEBHOOK_FORMAT == "slack":
        text = f"{slack_escape(document['text'])} <{document['url']}|Open the run>"
        return json.dumps(
            {
                "text": text,
                "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}],
            }
        ).encode()
    return json.dumps(document).encode()


def _send_webhook(note: Notification) -> None:
    request = urllib.request.Request(
        conf.NOTIFY_WEBHOOK_URL,
        data=webhook_body(note),
        headers={
            "Content-Type": "application/json",
            "User-Agent": "durability-dashboard",
            "Idempotency-Key": f"durability-notification-{note.key}",
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
            response.read(1024)
    except urllib.error.HTTPError as exc:
        permanent = 400 <= exc.code < 500 and exc.code not in (408, 429)
        raise DeliveryError(f"HTTP {exc.code} {exc.reason}", permanent=permanent) from None
    except (urllib.error.URLError, OSError) as exc:
        raise DeliveryError(f"{type(exc).__name__}: {exc}") from None


def _send_email(note: Notification) -> None:
    document = json.loads(note.body)
    body = f"{document['text']}\n\nOpen the run: {document['url']}\n"
    try:
        send_mail(
            one_line(f"[durability] {note.subject}")[:250],
            body,
            settings.DEFAULT_FROM_EMAIL,
            list(conf.NOTIFY_EMAIL_TO),
        )
    except OSError as exc:  # smtplib's errors are OSErrors
        raise DeliveryError(f"{type(exc).__name__}: {exc}") from None


SENDERS = {Channel.WEBHOOK: _send_webhook, Channel.EMAIL: _send_email}


def backoff(attempts: int) -> timedelta:
    return timedelta(seconds=min(3600, 5 * 2 ** max(0, attempts - 1)))


def deliver(limit: int = 100) -> dict[str, int]:
    """Send the notifications that are due; returns counts by outcome."""
    counts = {"sent": 0, "retry": 0, "failed": 0}
    max_attempts = conf.NOTIFY_MAX_ATTEMPTS
    for _ in range(limit):
        with transaction.atomic():
            note = (
                Notification.objects.select_for_update(skip_locked=True)
                .filter(status=NotificationStatus.PENDING)
                .filter(Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=timezone.now()))
                .order_by("id")
                .first()
            )
            if note is None:
                break
            note.attempts += 1
            try:
                try:
                    SENDERS[note.channel](note)
                except DeliveryError:
                    raise
                except Exception as exc:
                    # Whatever a sender trips on stays with this row: raised from here, it
                    # would roll back the attempt and leave the row first in line forever,
                    # holding back every notification after it.
                    log.exception("notification %s via %s", note.key, note.channel)
                    raise DeliveryError(f"{type(exc).__name__}: {exc}") from None
            except DeliveryError as exc:
                note.last_error = str(exc)[:2000]
                if exc.permanent or note.attempts >= max_attempts:
                    note.status = NotificationStatus.FAILED
                    counts["failed"] += 1
                else:
                    note.next_attempt_at = timezone.now() + backoff(note.attempts)
                    counts["retry"] += 1
                log.warning("notification %s via %s: %s", note.key, note.channel, exc)
            else:
                note.status = NotificationStatus.SENT
                note.sent_at = timezone.now()
                note.last_error = ""
                counts["sent"] += 1
            note.save(
                update_fields=["attempts", "status", "sent_at", "last_error", "next_attempt_at"]
            )
    return counts


def run_once() -> dict[str, int]:
    """One beat's worth: collect new notifications, deliver what is due."""
    if not channels():
        return {"new": 0}
    return {"new": collect(), **deliver()}
