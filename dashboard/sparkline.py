"""Sparkline geometry: a series of values (None for "no data") to SVG polyline points."""

from __future__ import annotations


def points(
    series: list[float | None], width: int, height: int, pad: float = 2.0
) -> list[list[tuple[float, float]]]:
    """Polyline segments for ``series`` scaled into the box; a gap (None) splits the line,
    so an hour without data is not drawn as a trend."""
    known = [v for v in series if v is not None]
    if not known:
        return []
    low, high = min(known), max(known)
    span = (high - low) or 1.0
    step = (width - 2 * pad) / max(1, len(series) - 1)
    segments: list[list[tuple[float, float]]] = []
    current: list[tuple[float, float]] = []
    for i, value in enumerate(series):
        if value is None:
            if current:
                segments.append(current)
                current = []
            continue
        x = pad + i * step
        # Flat series sit in the middle rather than on the floor.
        y = height / 2 if high == low else height - pad - (value - low) / span * (height - 2 * pad)
        current.append((x, y))
    if current:
        segments.append(current)
    return segments
