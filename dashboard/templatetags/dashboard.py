"""Template helpers: human times, durations and sizes, query strings, sparklines.

Only server-made values (times, numbers) are ever put into markup here; agent data reaches
templates as text and is escaped by the template engine."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from django import template
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from dashboard import timeline
from dashboard.sparkline import points

register = template.Library()


def ago(when: datetime, now: datetime | None = None) -> str:
    seconds = int(((now or timezone.now()) - when).total_seconds())
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 5:
        text = "just now" if not future else "now"
        return text
    if seconds < 60:
        text = f"{seconds} s"
    elif seconds < 3600:
        text = f"{seconds // 60} min"
    elif seconds < 86400:
        text = f"{seconds // 3600} h {seconds % 3600 // 60} min"
    else:
        text = f"{seconds // 86400} d {seconds % 86400 // 3600} h"
    return f"in {text}" if future else f"{text} ago"


@register.simple_tag
def when(value: datetime | None, empty: str = "-") -> str:
    """A relative time ("4 min ago") with the absolute time on hover; app.js keeps it fresh."""
    if value is None:
        return empty
    absolute = value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return format_html(
        '<time datetime="{}" title="{}" data-rel>{}</time>', value.isoformat(), absolute, ago(value)
    )


@register.filter
def seconds(value: Any) -> str:
    """A duration in seconds, in words: "2 min 13 s"."""
    if value is None or value == "":
        return "-"
    return timeline.human_ms(float(value) * 1000)


@register.filter
def ms(value: Any) -> str:
    if value is None or value == "":
        return "-"
    return timeline.human_ms(value)


@register.filter
def nbytes(value: Any) -> str:
    if value is None or value == "":
        return "-"
    return timeline.human_bytes(value)


@register.simple_tag
def span(start: datetime | None, end: datetime | None = None) -> str:
    """How long from ``start`` to ``end`` (or now)."""
    if start is None:
        return "-"
    return timeline.human_ms(((end or timezone.now()) - start).total_seconds() * 1000)


@register.simple_tag
def qs(base: dict | None = None, **overrides: Any) -> str:
    """A query string from ``base`` with ``overrides``; empty values are dropped."""
    values = dict(base or {})
    values.update(overrides)
    values = {k: v for k, v in values.items() if v not in (None, "")}
    return "?" + urlencode(values) if values else "?"


@register.filter
def percent(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{float(value) * 100:.{int(digits)}f}%"


@register.filter
def number(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    value = float(value)
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:,.{int(digits)}f}"


@register.filter
def short(value: Any) -> str:
    return str(value)[:8]


@register.simple_tag
def sparkline(series: list[float | None], width: int = 120, height: int = 28) -> str:
    """A server-rendered SVG line of ``series`` (gaps where there is no data)."""
    segments = points(series, width, height)
    if not segments:
        return format_html(
            '<svg class="spark" viewBox="0 0 {} {}" width="{}" height="{}" role="img"'
            ' aria-label="no data"><line x1="0" y1="{}" x2="{}" y2="{}" class="spark-empty"/>'
            "</svg>",
            width,
            height,
            width,
            height,
            height - 1,
            width,
            height - 1,
        )
    lines = format_html_join(
        "",
        '<polyline points="{}" class="spark-line"/>',
        ((" ".join(f"{x:.1f},{y:.1f}" for x, y in seg),) for seg in segments),
    )
    dots = format_html_join(
        "",
        '<circle cx="{}" cy="{}" r="1.6" class="spark-dot"/>',
        ((f"{x:.1f}", f"{y:.1f}") for seg in segments if len(seg) == 1 for x, y in seg),
    )
    return format_html(
        '<svg class="spark" viewBox="0 0 {} {}" width="{}" height="{}" role="img"'
        ' aria-label="trend">{}{}</svg>',
        width,
        height,
        width,
        height,
        lines,
        dots,
    )


PREVIEW_CHARS = 90
# "key": value pairs in the first characters of a canonical JSON input, which may be cut
# anywhere: a pair cut short is shown as far as it goes.
_PAIR = re.compile(r'"((?:[^"\\]|\\.){1,60})"\s*:\s*("(?:[^"\\]|\\.)*"?|[^,{}\[\]]+)')


@register.filter
def preview(head: Any) -> str:
    """A run's input in one short line ("question: Why add jitter?"), from the first
    characters of its JSON, with secret fields redacted. Plain text: the template escapes it."""
    from durability.redact import REDACTED, is_secret_key

    text = str(head or "")
    parts = []
    for key, value in _PAIR.findall(text):
        if is_secret_key(key):
            value = REDACTED
        elif value.startswith('"'):
            value = value.strip('"').replace('\\"', '"')
        parts.append(f"{key}: {value.strip()}")
    shown = ", ".join(parts) if parts else text.strip("{}[]")
    if len(shown) > PREVIEW_CHARS:
        shown = shown[: PREVIEW_CHARS - 1].rstrip() + "…"
    return shown


@register.simple_tag
def pending_count() -> int:
    """Approvals waiting for a decision, for the navigation badge (one index probe)."""
    from durability.models import Approval, ApprovalStatus

    return Approval.objects.filter(status=ApprovalStatus.PENDING).count()


DEMO_COMMAND = (
    "python manage.py durability start research --input "
    '\'{"question": "What is a fencing token?"}\''
)


@register.simple_tag
def demo_command() -> str:
    return DEMO_COMMAND


def _slo_amount(value: float | None, unit: str) -> str:
    if value is None:
        return "no data"
    if unit == "ratio":
        return f"{value * 100:.3g}%" if value < 1 else "100%"
    if unit == "ms":
        return timeline.human_ms(value)
    if unit == "s":
        return timeline.human_ms(value * 1000)
    if unit == "min":
        return timeline.human_ms(value * 60_000)
    return f"{value:,.0f}"


@register.filter
def slo_value(indicator: Any) -> str:
    return _slo_amount(indicator.value, indicator.unit)


@register.simple_tag
def slo_amount(value: float | None, unit: str) -> str:
    return _slo_amount(value, unit)


@register.filter
def slo_target(indicator: Any) -> str:
    if indicator.target is None:
        return "no target"
    sign = "≥" if indicator.direction == "min" else "≤"
    if indicator.unit == "ratio":
        return f"{sign} {indicator.target * 100:g}%"
    return f"{sign} {_slo_amount(indicator.target, indicator.unit)}"


@register.filter
def budget_text(budget: float | None) -> str:
    if budget is None:
        return "-"
    if budget < 0:
        return f"overspent ({budget * 100:.0f}%)"
    return f"{budget * 100:.0f}% left"


@register.simple_tag
def budget_bar(budget: float | None, width: int = 120, height: int = 8) -> str:
    """The error budget left as a bar (SVG attributes, not inline styles: the CSP forbids
    those)."""
    if budget is None:
        return ""
    filled = max(0.0, min(1.0, budget)) * width
    tone = "ok" if budget >= 0.5 else "warn" if budget > 0 else "bad"
    return format_html(
        '<svg class="budget budget-{}" viewBox="0 0 {} {}" width="{}" height="{}" role="img"'
        ' aria-label="error budget left"><rect x="0" y="0" width="{}" height="{}"'
        ' class="budget-track"/><rect x="0" y="0" width="{}" height="{}" class="budget-fill"/>'
        "</svg>",
        tone,
        width,
        height,
        width,
        height,
        width,
        height,
        f"{filled:.1f}",
        height,
    )
