"""Small statistics and formatting helpers (no numpy on purpose: one less dependency)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks,
    the same definition numpy uses by default, so figures compare with other tools."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def ms(seconds: float) -> str:
    """Seconds as milliseconds, with enough digits for sub-millisecond figures."""
    if math.isnan(seconds) or math.isinf(seconds):
        return str(seconds)
    value = seconds * 1000
    if abs(value) < 10:
        return f"{value:.3f} ms"
    if abs(value) < 1000:
        return f"{value:.1f} ms"
    return f"{value / 1000:.2f} s"


def size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"  # pragma: no cover - the loop always returns


def ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """A plain fixed-width text table (benchmarks print to terminals and CI logs)."""
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
