"""Charts as inline SVG text (a histogram, a line over time), so a report is one file that needs no libraries."""

import math
from collections.abc import Sequence
from html import escape

WIDTH = 640
HEIGHT = 280
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 44  # margins around the plot area, in pixels
NUM_TICKS = 5
NUM_BINS = 30
BAR_COLOUR = "#4c78a8"
LINE_COLOUR = "#e45756"
MARKER_COLOUR = "#555"


def histogram(values: Sequence[float], title: str, x_label: str, y_label: str,
              markers: dict[str, float] | None = None) -> str:  # fmt: skip
    """Counts of `values` in NUM_BINS equal bins; `markers` draws a labelled dashed line at each value."""
    if not values:
        return _empty(title)
    low, high = min(values), max(values)
    if high == low:  # all alike: one bar in a range around it
        low, high = low - 0.5, high + 0.5
    bin_width = (high - low) / NUM_BINS
    counts = [0] * NUM_BINS
    for value in values:
        counts[min(int((value - low) / bin_width), NUM_BINS - 1)] += 1
    plot = _Plot(low, high, 0, max(counts))
    parts = [plot.axes(x_label, y_label)]
    for index, count in enumerate(counts):
        x0, x1 = plot.x(low + index * bin_width), plot.x(low + (index + 1) * bin_width)
        y = plot.y(count)
        parts.append(f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0 - 1, 1):.1f}" '
                     f'height="{plot.y(0) - y:.1f}" fill="{BAR_COLOUR}"/>')  # fmt: skip
    for row, (label, value) in enumerate((markers or {}).items()):
        x = plot.x(value)
        # Each label on a row of its own: markers close together (p50 and p99 of a tight spread) would overlap.
        parts.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{plot.y(0):.1f}" stroke="{MARKER_COLOUR}" '
                     f'stroke-dasharray="4 3"/><text x="{x + 3:.1f}" y="{TOP + 10 + 11 * row}" font-size="10">'
                     f"{escape(label)}</text>")  # fmt: skip
    return _svg(title, parts)


def line_chart(points: Sequence[tuple[float, float]], title: str, x_label: str, y_label: str,
               x_max: float | None = None, y_max: float | None = None) -> str:  # fmt: skip
    """A line through (x, y) points in x order. Both axes start at 0 (time since the start, a rate or a share);
    they end at `x_max` / `y_max`, or at the largest value."""
    if not points:
        return _empty(title)
    right = x_max if x_max is not None else max(x for x, _ in points)
    top = y_max if y_max is not None else max(y for _, y in points)
    plot = _Plot(0, right, 0, top)
    coordinates = " ".join(f"{plot.x(x):.1f},{plot.y(y):.1f}" for x, y in points)
    parts = [plot.axes(x_label, y_label),
             f'<polyline points="{coordinates}" fill="none" stroke="{LINE_COLOUR}" stroke-width="1.5"/>']  # fmt: skip
    if len(points) == 1:
        x, y = points[0]
        parts.append(f'<circle cx="{plot.x(x):.1f}" cy="{plot.y(y):.1f}" r="3" fill="{LINE_COLOUR}"/>')
    return _svg(title, parts)


def nice_ticks(low: float, high: float) -> list[float]:
    """About NUM_TICKS round values (steps of 1, 2, 2.5 or 5 times a power of ten) from low to high."""
    raw_step = (high - low) / NUM_TICKS if high > low else 1.0
    magnitude = 10 ** math.floor(math.log10(raw_step))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw_step)
    first = math.ceil(low / step)
    return [i * step for i in range(first, math.floor(high / step + 1e-9) + 1)]


class _Plot:
    """Maps data coordinates onto the plot area."""

    def __init__(self, x_low: float, x_high: float, y_low: float, y_high: float) -> None:
        # An empty range (one value, or all zero) is widened so the scale does not divide by zero.
        self.x_low, self.x_high = x_low, x_high if x_high > x_low else x_low + 1
        self.y_low, self.y_high = y_low, y_high if y_high > y_low else y_low + 1

    def x(self, value: float) -> float:
        return LEFT + (value - self.x_low) / (self.x_high - self.x_low) * (WIDTH - LEFT - RIGHT)

    def y(self, value: float) -> float:
        return HEIGHT - BOTTOM - (value - self.y_low) / (self.y_high - self.y_low) * (HEIGHT - TOP - BOTTOM)

    def axes(self, x_label: str, y_label: str) -> str:
        bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
        parts = [f'<line x1="{LEFT}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>',
                 f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bottom}" stroke="black"/>']  # fmt: skip
        for tick in nice_ticks(self.x_low, self.x_high):
            x = self.x(tick)
            parts.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="black"/>'
                         f'<text x="{x:.1f}" y="{bottom + 16}" font-size="11" text-anchor="middle">'
                         f"{_number(tick)}</text>")  # fmt: skip
        for tick in nice_ticks(self.y_low, self.y_high):
            y = self.y(tick)
            parts.append(f'<line x1="{LEFT - 4}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#ddd"/>'
                         f'<text x="{LEFT - 7}" y="{y + 4:.1f}" font-size="11" text-anchor="end">'
                         f"{_number(tick)}</text>")  # fmt: skip
        parts.append(f'<text x="{(LEFT + right) / 2:.1f}" y="{HEIGHT - 8}" font-size="12" text-anchor="middle">'
                     f"{escape(x_label)}</text>")  # fmt: skip
        parts.append(f'<text transform="translate(14 {(TOP + bottom) / 2:.1f}) rotate(-90)" font-size="12" '
                     f'text-anchor="middle">{escape(y_label)}</text>')  # fmt: skip
        return "".join(parts)


def _number(value: float) -> str:
    return f"{value:.0f}" if value == round(value) else f"{value:.3g}"


def _svg(title: str, parts: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
            f'height="{HEIGHT}" role="img" font-family="sans-serif"><title>{escape(title)}</title>'
            f'<text x="{WIDTH / 2}" y="18" font-size="14" text-anchor="middle">{escape(title)}</text>'
            f"{''.join(parts)}</svg>")  # fmt: skip


def _empty(title: str) -> str:
    return _svg(title, [f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" font-size="13" text-anchor="middle" '
                        'fill="#777">no data</text>'])  # fmt: skip
