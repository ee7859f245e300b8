"""The run forecast's figure: run time per card, and run time against cost (cards named in the legend, whiskers
for the intervals). matplotlib loads only to draw; the PNG is deterministic (no metadata).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vramcal.report.cost import UNKNOWN
from vramcal.report.figure import COLORS, png_bytes
from vramcal.report.table import MISSING
from vramcal.units import format_duration

if TYPE_CHECKING:
    from vramcal.forecast import Forecast

FIGSIZE_IN = (13.0, 5.6)  # the least: taller where the cards' names take more lines (row_label)
LINE_IN = 0.19  # inches a label line takes in the rows' axis (8.5 pt text and its spacing), and a row's margin
DPI = 100
LABEL_WIDTH = 34  # characters a card's name wraps at beside its bar
MARKERS = ("o", "s", "^", "D", "v", "P")  # a point's marker, one per round of the colours


def render_cost_png(forecasts: Sequence[Forecast], title: str) -> bytes:
    """The figure as PNG bytes, taller where the cards' names take more lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lines = sum(row_label(f).count("\n") + 2 for f in forecasts)
    figure = Figure(figsize=(FIGSIZE_IN[0], max(FIGSIZE_IN[1], 1.6 + LINE_IN * lines)), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    time_ax, cost_ax = figure.subplots(1, 2, width_ratios=[1, 1.2])
    unit = time_unit([f.run_s for f in forecasts if f.run_s is not None])
    _draw_times(time_ax, forecasts, unit)
    _draw_costs(cost_ax, forecasts, unit)
    figure.suptitle(title, fontsize=12)
    return png_bytes(figure, DPI)


def row_label(f: Forecast) -> str:
    """A bar's name: the card wrapped at :data:`LABEL_WIDTH` characters, then its batch size."""
    batch = f"batch {f.batch_size or MISSING}" if f.measured else "no profile"
    return f"{textwrap.fill(f.card, LABEL_WIDTH)}\n{batch}"


def time_unit(seconds: Sequence[float]) -> tuple[str, float]:
    """(name, seconds per unit) for an axis of run times: hours from 2 h, minutes from 2 min, else seconds."""
    longest = max(seconds, default=0.0)
    return ("hours", 3600.0) if longest >= 7200 else ("minutes", 60.0) if longest >= 120 else ("seconds", 1.0)


def _run(f: Forecast, unit: tuple[str, float]) -> tuple[float, list[float]]:
    """The run in ``unit`` and its whiskers [below, above] (an open rate leaves the run's lower end at 0)."""
    run = f.run_s / unit[1]
    if f.run_high_s is None:
        return run, [0.0, 0.0]
    low = (f.run_low_s or 0.0) / unit[1]
    return run, [run - low, f.run_high_s / unit[1] - run]


def _draw_times(ax: Any, forecasts: Sequence[Forecast], unit: tuple[str, float]) -> None:
    rows = list(reversed(forecasts))  # the fastest on top
    longest = 0.0
    for y, f in enumerate(rows):
        if f.run_s is None:
            ax.text(0, y, f"  {UNKNOWN}: {'no measured profile' if not f.measured else 'no forecast'}",
                    va="center", fontsize=9, color="#888888")
            continue
        run, whisker = _run(f, unit)
        longest = max(longest, run + whisker[1])
        color = COLORS[forecasts.index(f) % len(COLORS)]
        ax.barh(y, run, height=0.6, color=color, alpha=0.8, xerr=[[whisker[0]], [whisker[1]]], capsize=3)
        ax.text(run + whisker[1], y, f"  {format_duration(f.run_s)}", va="center", fontsize=8.5)
    ax.set_yticks(range(len(rows)), [row_label(f) for f in rows], fontsize=8.5)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    epochs = f"{forecasts[0].epochs} epochs, " if forecasts else ""
    ax.set_xlabel(f"run time, {epochs}{unit[0]}")
    ax.set_title("Run time per card", fontsize=11)
    ax.set_xlim(0, max(longest, 1e-9) * 1.3)
    ax.grid(True, axis="x", color="#dddddd", lw=0.6)


def _draw_costs(ax: Any, forecasts: Sequence[Forecast], unit: tuple[str, float]) -> None:
    priced = [f for f in forecasts if f.cost is not None]
    for f in priced:
        run, whisker = _run(f, unit)
        cost_whisker = ([[0.0], [0.0]] if f.cost_high is None else
                        [[f.cost - (f.cost_low or 0.0)], [f.cost_high - f.cost]])
        row = forecasts.index(f)  # its bar's colour; past the colours, another marker tells it apart in the legend
        marker = MARKERS[row // len(COLORS) % len(MARKERS)]
        best = ", ".join(w for w, on in (("fastest", f.fastest), ("cheapest", f.cheapest)) if on)
        ax.errorbar([f.cost], [run], xerr=cost_whisker, yerr=[[whisker[0]], [whisker[1]]], fmt=marker, ms=8,
                    color=COLORS[row % len(COLORS)], capsize=3,
                    label=textwrap.fill(f.card, 70) + (f" ({best})" if best else ""))
    missing = [f"{textwrap.shorten(f.card, 40)}: " + ("no measured profile" if not f.measured else "no price (--price)"
                                                      if f.price_per_hour is None else "no forecast")
               for f in forecasts if f.cost is None]
    if missing:
        reason = "no cost" if priced else "no prices given: --price NAME=PRICE"
        # lower right: dear and quick, where a card rarely lies
        ax.text(0.98, 0.02, f"not placed ({reason}):\n" + "\n".join(missing), transform=ax.transAxes, fontsize=8.5,
                color="#666666", va="bottom", ha="right", bbox={"facecolor": "white", "edgecolor": "#dddddd"})
    if priced:  # below the axes, as the probe report's legends
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8.5, frameon=False)
    costs = [f.cost_high if f.cost_high is not None else f.cost for f in priced]
    runs = [(f.run_high_s if f.run_high_s is not None else f.run_s) / unit[1] for f in priced]
    ax.set_xlim(0, max(costs, default=1.0) * 1.35 or 1.0)
    ax.set_ylim(0, max(runs, default=1.0) * 1.2 or 1.0)
    ax.set_xlabel("cost of the run (price per hour × run time)")
    ax.set_ylabel(f"run time ({unit[0]})")
    ax.set_title("Run time against cost", fontsize=11)
    ax.grid(True, color="#dddddd", lw=0.6)
