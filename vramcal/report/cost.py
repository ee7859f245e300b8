"""The run forecast as a Markdown table and file (its figure: :mod:`vramcal.report.cost_figure`), a pure function
of :class:`vramcal.forecast.Forecast` rows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vramcal.calibration.throughput import rate_text
from vramcal.report.table import MISSING, markdown_table
from vramcal.units import format_duration

if TYPE_CHECKING:
    from vramcal.forecast import Forecast

UNKNOWN = "unknown"


def _rate_text(f: Forecast) -> str:
    if f.samples_per_s is None:
        return UNKNOWN if not f.measured else MISSING
    return rate_text(f)  # a forecast carries its rate's interval as a Rate does


def _interval(value: float | None, low: float | None, high: float | None, render) -> str:
    if value is None:
        return MISSING
    if high is None:
        return render(value)
    ends = (render(low) if low is not None else "0", render(high))
    return render(value) if ends[0] == ends[1] else f"{render(value)} ({ends[0]}–{ends[1]})"


def _money(amount: float) -> str:
    return f"{amount:,.2f}" if amount >= 0.1 else f"{amount:.3g}"


def forecast_rows(forecasts: Sequence[Forecast], bold: bool = True) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows: card, batch size, samples/s, epoch, run, price per hour, cost, best."""
    mark = "**" if bold else ""
    epochs = forecasts[0].epochs if forecasts else 0
    header = ["card", "batch size", "samples/s (95 %)", "epoch", f"run ({epochs} epochs)", "price/h", "cost", "best"]
    rows = []
    for f in forecasts:
        best = ", ".join(word for word, on in (("fastest", f.fastest), ("cheapest", f.cheapest)) if on)
        batch = MISSING if f.batch_size is None else f"{f.batch_size:,} ({f.batch_source})"
        unknown_time = UNKNOWN if not f.measured else MISSING
        rows.append([
            f"{mark}{f.card}{mark}" if best else f.card, batch, _rate_text(f),
            format_duration(f.epoch_s) if f.epoch_s is not None else unknown_time,
            _interval(f.run_s, f.run_low_s, f.run_high_s, functools.partial(format_duration, like=f.run_s))
            if f.run_s is not None else unknown_time,
            MISSING if f.price_per_hour is None else _money(f.price_per_hour),
            _interval(f.cost, f.cost_low, f.cost_high, _money) if f.cost is not None
            else (UNKNOWN if f.price_per_hour is not None else MISSING),
            f"{mark}{best}{mark}" if best else ""])
    return header, rows


def forecast_table(forecasts: Sequence[Forecast], bold: bool = True) -> str:
    """The forecast as a Markdown table (readable as plain text; ``bold`` False for a terminal)."""
    header, rows = forecast_rows(forecasts, bold)
    return markdown_table(header, rows, right=[2, 3, 4, 5, 6])


def forecast_notes(forecasts: Sequence[Forecast]) -> list[str]:
    """What the numbers assume, and each row's own notes, as sentences."""
    lines = []
    datasets = list(dict.fromkeys(f.dataset for f in forecasts if f.dataset is not None and f.measured))
    for f in forecasts if len(datasets) > 1 else forecasts[:0]:
        if f.dataset is not None and f.measured:
            lines.append(f"{f.card}: each epoch {_epoch_text(f.dataset)}.")
    if len(datasets) == 1:
        lines.append(f"Each epoch: {_epoch_text(datasets[0])}.")
    lines.append("Epoch = training samples / samples/s + the validation pass at the trials' per-sample time; the "
                 "run adds the first step's extra time once (it allocates the optimizer's state); cost = price per "
                 "hour × run time. Intervals follow the 95 % interval of the measured step times; they do not "
                 "cover a busier machine or another software stack.")
    lines.append("Throughput is measured per card: a card without a profile has none (`unknown`), and is never "
                 "estimated from another card's memory or speed.")
    models = {f.model for f in forecasts if f.model is not None}
    if len(models) > 1:
        lines.append(f"The profiles are of {len(models)} models: the fastest and the cheapest are marked among each "
                     f"model's cards (another model is another run, not a card's speed or price).")
    shared = {f.card for f in forecasts if [g.card for g in forecasts].count(f.card) > 1}
    for f in forecasts:
        who = f"{f.card}, batch size {f.batch_size}" if f.card in shared else f.card
        lines += [f"{who}: {note}" for note in f.notes]
    return list(dict.fromkeys(lines))


def _epoch_text(dataset) -> str:
    val = "an unknown number of" if dataset.val_samples is None else f"{dataset.val_samples:,}"
    return f"{dataset.train_samples:,} training samples and {val} validation samples ({dataset.source})"


def render_cost_markdown(forecasts: Sequence[Forecast], png_name: str, title: str) -> str:
    """The whole ``vramcal cost`` Markdown file; ``png_name`` is its figure, relative to it."""
    lines = [f"# vramcal run forecast: {title}", "", "Made by `vramcal cost` from profile files only.", "",
             f"![Run time against cost per card]({png_name})", "", forecast_table(forecasts), ""]
    lines += [f"- {note}" for note in forecast_notes(forecasts)]
    return "\n".join(lines).rstrip() + "\n"
