"""The last hour of a lane as small charts, drawn as inline SVG on the server: no script, no CDN, and
they read the same with JavaScript off. This module only turns numbers into coordinates; the
templates draw them (templates/_charts.html), so every label goes through Jinja2's escaping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

WIDTH, HEIGHT = 360, 90  # the drawing area of one chart, in SVG units (the viewBox adds the margins)


@dataclass(frozen=True)
class Line:
    name: str  # shown in the legend
    css: str  # the class that colours it (static/pglane.css)
    values: tuple[float | None, ...]  # one per minute, oldest first; None: nothing to draw that minute
    dots: bool = False  # sparse values (a wait exists only in minutes where an attempt started): mark each

    def xy(self, top: float) -> list[tuple[float, float]]:
        """Each value's point, scaled so that ``top`` reaches the top of the chart."""
        step = WIDTH / max(len(self.values) - 1, 1)
        return [(round(i * step, 1), round(HEIGHT - (v / top) * HEIGHT, 1))
                for i, v in enumerate(self.values) if v is not None]

    def points(self, top: float) -> str:
        """The polyline's points attribute."""
        return " ".join(f"{x},{y}" for x, y in self.xy(top))

    @property
    def total(self) -> float:
        return sum(v for v in self.values if v is not None)

    @property
    def peak(self) -> float:
        return max((v for v in self.values if v is not None), default=0.0)


@dataclass(frozen=True)
class Chart:
    title: str
    unit: str
    lines: tuple[Line, ...]
    first: datetime | None  # the first and last minute drawn, for the axis labels
    last: datetime | None
    sums: bool = False  # the legend gives each line's total over the hour (else its peak)

    def legend(self, line: Line) -> str:
        if self.sums:
            return f"{line.name} {line.total:.0f}"
        return f"{line.name}, peak {round(line.peak, 1):g}{' ' + self.unit if self.unit else ''}"

    @property
    def top(self) -> float:
        """A round number at or above every value (at least 1), for the y axis."""
        peak = max((line.peak for line in self.lines), default=0.0)
        if peak <= 1:
            return 1.0
        magnitude = 10.0 ** math.floor(math.log10(peak))
        return float(next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= peak))


def lane_charts(rows: Sequence[dict[str, Any]]) -> dict[str, list[Chart]]:
    """Three charts per lane from pglane.web.queries.LAST_HOUR's rows (ordered by lane and minute)."""
    by_lane: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_lane.setdefault(row["lane"], []).append(row)
    charts = {}
    for lane, minutes in by_lane.items():
        first, last = minutes[0]["minute"], minutes[-1]["minute"]

        def column(name: str, minutes: list[dict[str, Any]] = minutes) -> tuple[float | None, ...]:
            return tuple(None if m[name] is None else float(m[name]) for m in minutes)

        charts[lane] = [
            Chart("attempts per minute", "", (Line("started", "started", column("started")),
                                              Line("finished", "finished", column("finished")),
                                              Line("failed", "failed", column("failed"))), first, last, sums=True),
            Chart("queue depth", "", (Line("queued", "depth", column("depth")),), first, last),
            Chart("wait before start", "s", (Line("mean", "wait", column("wait_avg"), dots=True),
                                             Line("max", "waitmax", column("wait_max"), dots=True)), first, last),
        ]
    return charts
