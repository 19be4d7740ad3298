"""Server-rendered SVG charts for pinflow's pages: nothing is loaded from the internet, no JavaScript.

Each function returns one ``<svg>`` element (class ``chart``, a ``<title>`` for screen readers and tests) sized
by its ``width`` and ``height``. Text is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf"]
# Outcomes keep the same colour on every chart.
OUTCOME_COLOURS = {
    "SUCCEEDED": "#2ca02c", "success": "#2ca02c", "FAILED:INFRA": "#ff7f0e", "FAILED:USER": "#d62728",
    "FAILED:DATA": "#9467bd", "FAILED:OOM": "#8c564b", "FAILED": "#d62728", "failed": "#d62728",
    "STALLED": "#e377c2", "QUEUE_TIMEOUT": "#bcbd22", "CANCELLED": "#7f7f7f", "LOST": "#17becf",
    "ABANDONED": "#c7c7c7",
}
FONT = 'font-family="sans-serif" font-size="11"'


def colour(name: str, index: int) -> str:
    if name in OUTCOME_COLOURS:
        return OUTCOME_COLOURS[name]
    if ":" in name and name.split(":", 1)[0] in OUTCOME_COLOURS:
        return OUTCOME_COLOURS[name.split(":", 1)[0]]
    return PALETTE[index % len(PALETTE)]


def nice_max(value: float) -> float:
    """A round axis maximum at or above ``value``."""
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * exp:
            return step * exp
    return 10 * exp


def fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:  # ticks of a nice maximum: 1.25, 3.75, 12.5
        return f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{value:.3g}"


def _frame(width: int, height: int, title: str, body: list[str]) -> str:
    return (f'<svg class="chart" role="img" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}"><title>{escape(title)}</title>' + "".join(body) + "</svg>")


def _legend(names: Sequence[str], x: int, y: int) -> list[str]:
    out = []
    for i, name in enumerate(names):
        yy = y + 15 * i
        out.append(f'<rect x="{x}" y="{yy}" width="10" height="10" fill="{colour(name, i)}"/>'
                   f'<text x="{x + 14}" y="{yy + 9}" {FONT}>{escape(name)}</text>')
    return out


def _axes(left: int, top: int, plot_w: int, plot_h: int, ymax: float, unit: str) -> list[str]:
    out = [f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#888"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#888"/>']
    for i in range(5):
        value = ymax * i / 4
        y = top + plot_h - plot_h * i / 4
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" {FONT}>{fmt(value)}</text>')
    if unit:
        out.append(f'<text x="{left}" y="{top - 6}" {FONT} fill="#555">{escape(unit)}</text>')
    return out


def _no_data(width: int, height: int, title: str, message: str) -> str:
    return _frame(width, height, title, [
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fafafa" stroke="#ddd"/>',
        f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" {FONT} fill="#777">{escape(message)}</text>'])


def stacked_bars(categories: Sequence[str], series: Mapping[str, Sequence[float]], *, title: str, unit: str = "",
                 width: int = 640, height: int = 240, empty: str = "no data yet") -> str:
    """Bars per category (e.g. a day), stacked by series (e.g. a team or an outcome)."""
    totals = [sum(values[i] for values in series.values()) for i in range(len(categories))]
    if not categories or not any(totals):
        return _no_data(width, height, title, empty)
    left, top, legend_w = 48, 18, 150
    plot_w, plot_h = width - left - legend_w - 10, height - top - 36
    ymax = nice_max(max(totals))
    body = _axes(left, top, plot_w, plot_h, ymax, unit)
    slot = plot_w / len(categories)
    bar_w = min(40.0, max(2.0, slot * 0.7))
    label_every = max(1, math.ceil(len(categories) / 10))
    for i, category in enumerate(categories):
        x = left + slot * i + (slot - bar_w) / 2
        base = float(top + plot_h)
        for j, (name, values) in enumerate(series.items()):
            value = values[i]
            if value <= 0:
                continue
            h = plot_h * value / ymax
            base -= h
            body.append(f'<rect class="bar" x="{x:.1f}" y="{base:.1f}" width="{bar_w:.1f}" height="{h:.1f}" '
                        f'fill="{colour(name, j)}"><title>{escape(category)} {escape(name)}: {fmt(value)} '
                        f'{escape(unit)}</title></rect>')
        if (len(categories) - 1 - i) % label_every == 0:  # the newest category always has its label
            body.append(f'<text x="{x + bar_w / 2:.1f}" y="{top + plot_h + 14}" text-anchor="middle" {FONT}>'
                        f'{escape(category[5:] if len(category) == 10 else category)}</text>')
    body += _legend(list(series), left + plot_w + 16, top)
    return _frame(width, height, title, body)


def lines(series: Mapping[str, Sequence[tuple[float, float]]], *, title: str, unit: str = "", x_label: str = "",
          width: int = 640, height: int = 240, empty: str = "no data yet", x_ticks: Sequence[str] | None = None,
          x_range: tuple[float, float] | None = None) -> str:
    """Line per series over a numeric x (``x_ticks``: labels of x = 0, 1, ... instead of numbers; ``x_range``: the
    x axis, default the data's)."""
    points = [p for values in series.values() for p in values]
    if not points:
        return _no_data(width, height, title, empty)
    left, top, legend_w = 52, 18, 150 if len(series) > 1 else 10
    plot_w, plot_h = width - left - legend_w - 10, height - top - 36
    xmin, xmax = x_range or (min(p[0] for p in points), max(p[0] for p in points))
    ymin = min(0.0, min(p[1] for p in points))
    ymax = nice_max(max(p[1] for p in points))
    span_x = (xmax - xmin) or 1.0
    body = _axes(left, top, plot_w, plot_h, ymax, unit)

    def xy(p: tuple[float, float]) -> tuple[float, float]:
        return (left + plot_w * (p[0] - xmin) / span_x,
                top + plot_h - plot_h * (p[1] - ymin) / ((ymax - ymin) or 1.0))

    for j, (name, values) in enumerate(series.items()):
        if not values:
            continue
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in map(xy, sorted(values)))
        body.append(f'<polyline class="line" fill="none" stroke="{colour(name, j)}" stroke-width="1.8" '
                    f'points="{path}"><title>{escape(name)}</title></polyline>')
        if len(values) <= 40:
            body += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.2" fill="{colour(name, j)}"/>'
                     for x, y in map(xy, values)]
    whole = all(float(p[0]).is_integer() for p in points) and span_x >= 4  # steps: whole-number ticks
    for k in range(5):
        xv = xmin + span_x * k / 4
        label = x_ticks[int(round(xv))] if x_ticks and 0 <= int(round(xv)) < len(x_ticks) else (
            f"{round(xv):,}" if whole else fmt(xv))
        if x_ticks and len(label) == 10:
            label = label[5:]
        body.append(f'<text x="{left + plot_w * k / 4:.1f}" y="{top + plot_h + 14}" text-anchor="middle" {FONT}>'
                    f'{escape(label)}</text>')
    if x_label:
        body.append(f'<text x="{left + plot_w}" y="{height - 4}" text-anchor="end" {FONT} fill="#555">'
                    f'{escape(x_label)}</text>')
    if len(series) > 1:
        body += _legend(list(series), left + plot_w + 16, top)
    return _frame(width, height, title, body)


def usage_bars(rows: Sequence[tuple[str, float, float | None]], *, title: str, width: int = 420) -> str:
    """One horizontal bar per ``(label, used, limit)``: the used share of the limit (no limit: used alone)."""
    height = 18 + 26 * max(1, len(rows))
    left, bar_w = 150, width - 150 - 70
    body = []
    for i, (label, used, limit) in enumerate(rows):
        y = 10 + 26 * i
        share = (used / limit) if limit else 0.0
        fill = "#d62728" if limit and used >= limit else ("#ff7f0e" if share >= 0.8 else "#2ca02c")
        body.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end" {FONT}>{escape(label)}</text>'
                    f'<rect x="{left}" y="{y}" width="{bar_w}" height="18" fill="#f0f0f0" stroke="#ccc"/>')
        filled = bar_w * min(1.0, share) if limit else (bar_w if used else 0)
        body.append(f'<rect class="bar" x="{left}" y="{y}" width="{filled:.1f}" height="18" '
                    f'fill="{fill if limit else "#1f77b4"}"><title>{escape(label)}: {fmt(used)} of '
                    f'{fmt(limit) if limit else "no limit"}</title></rect>')
        body.append(f'<text x="{left + bar_w + 6}" y="{y + 13}" {FONT}>{fmt(used)} / '
                    f'{fmt(limit) if limit is not None else "∞"}</text>')
    return _frame(width, height, title, body)


def progress_bar(percent: float, *, title: str = "progress", width: int = 520) -> str:
    percent = max(0.0, min(100.0, percent))
    return _frame(width, 22, title, [
        f'<rect x="0" y="2" width="{width}" height="18" rx="3" fill="#eee" stroke="#ccc"/>',
        f'<rect class="bar" x="0" y="2" width="{width * percent / 100:.1f}" height="18" rx="3" fill="#1f77b4"/>',
        f'<text x="{width / 2}" y="15" text-anchor="middle" {FONT} fill="#000">{percent:.1f}%</text>'])
