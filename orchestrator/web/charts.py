"""Inline SVG charts as numbers for the templates (sparkline, histogram, curve): the
templates draw them, so no user text ever reaches the markup unescaped."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    w: float
    h: float
    lo: float
    hi: float
    n: int


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    points: str = ""  # polyline points
    bars: tuple[Bar, ...] = ()
    lo: float = 0.0  # value range shown, for the axis labels
    hi: float = 0.0


def polyline(values: np.ndarray, width: int = 160, height: int = 32) -> Chart:
    """A line through ``values`` (NaN left out), scaled to the box."""
    v = np.asarray(values, np.float64)
    ok = np.isfinite(v)
    if not ok.any():
        return Chart(width, height)
    lo, hi = float(v[ok].min()), float(v[ok].max())
    span = hi - lo or 1.0
    xs = np.linspace(1, width - 1, len(v)) if len(v) > 1 else np.array([width / 2])
    ys = height - 1 - (v - lo) / span * (height - 2)
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y, k in zip(xs, ys, ok, strict=True) if k)
    return Chart(width, height, points=pts, lo=lo, hi=hi)


def histogram(values: np.ndarray, bins: int = 30, width: int = 480, height: int = 120) -> Chart:
    """Bars of a histogram of the finite ``values`` (bin indices and one bincount: a
    million rewards in a few ms)."""
    v = np.asarray(values)
    if v.dtype.kind != "f":
        v = v.astype(np.float64)
    if len(v) and not np.isfinite(v.sum()):
        v = v[np.isfinite(v)]
    if not len(v):
        return Chart(width, height)
    lo, hi = float(v.min()), float(v.max())
    span = (hi - lo) or 1.0
    idx = ((v - np.float32(lo)) * np.float32(bins / span)).astype(np.int32)
    counts = np.bincount(np.minimum(idx, bins - 1), minlength=bins)
    top = max(int(counts.max()), 1)
    bw, step = width / bins, span / bins
    bars = tuple(
        Bar(
            i * bw,
            height - c / top * height,
            max(bw - 1, 1),
            c / top * height,
            lo + i * step,
            lo + (i + 1) * step,
            int(c),
        )
        for i, c in enumerate(counts.tolist())
    )
    return Chart(width, height, bars=bars, lo=lo, hi=lo + span)


def rate(timestamps: np.ndarray, now: float, window_s: float = 3600, bins: int = 30) -> Chart:
    """Steps stored per bin over the last ``window_s`` seconds, as a sparkline."""
    t = np.asarray(timestamps, np.float64)
    t = t[(t > now - window_s) & (t <= now)]
    counts, _ = np.histogram(t, bins=bins, range=(now - window_s, now))
    chart = polyline(counts.astype(np.float64))
    return Chart(chart.width, chart.height, chart.points, lo=0.0, hi=float(counts.max()))


PALETTE = ("#2a6fdb", "#d9622b", "#2e9e5b", "#9b4dca", "#c9a227", "#d64b7f", "#3aa3b8", "#777")


@dataclass(frozen=True)
class Line:
    label: str
    color: str
    points: str
    last: float  # the newest value (the legend shows it)


def bins(counts: list[int], lo: float, hi: float, width: int = 320, height: int = 90) -> Chart:
    """Bars of counts already binned over [lo, hi] (a quality pass's fixed bins)."""
    n = len(counts)
    if not n or not any(counts):
        return Chart(width, height, lo=lo, hi=hi)
    top, bw, step = max(counts), width / n, (hi - lo) / n
    bars = tuple(
        Bar(
            i * bw,
            height - c / top * height,
            max(bw - 1, 1),
            c / top * height,
            lo + i * step,
            lo + (i + 1) * step,
            int(c),
        )
        for i, c in enumerate(counts)
    )
    return Chart(width, height, bars=bars, lo=lo, hi=hi)


def lines(
    series: dict[str, list[float | None]],
    width: int = 480,
    height: int = 120,
    lo: float | None = None,
    hi: float | None = None,
) -> tuple[Chart, list[Line]]:
    """One polyline per series over a shared scale (None values left out), up to 8."""
    vals = [v for s in series.values() for v in s if v is not None and np.isfinite(v)]
    if not vals:
        return Chart(width, height), []
    lo = min(vals) if lo is None else lo
    hi = max(vals) if hi is None else hi
    span = (hi - lo) or 1.0
    out = []
    for k, (label, s) in enumerate(list(series.items())[: len(PALETTE)]):
        xs = np.linspace(1, width - 1, len(s)) if len(s) > 1 else np.array([width / 2])
        pts = " ".join(
            f"{x:.1f},{height - 1 - (v - lo) / span * (height - 2):.1f}"
            for x, v in zip(xs, s, strict=True)
            if v is not None and np.isfinite(v)
        )
        last = next((v for v in reversed(s) if v is not None), float("nan"))
        out.append(Line(label, PALETTE[k], pts, float(last)))
    return Chart(width, height, lo=lo, hi=lo + span), out
