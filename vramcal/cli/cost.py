"""``vramcal cost``: a thin click command over :mod:`vramcal.forecast` and :mod:`vramcal.report`, and the
forecast options it shares with ``vramcal report``.

It reads profile files only: each card's throughput is what its own trials measured.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

import click

from vramcal.cli.options import group, load_profiles, one_line
from vramcal.cli.types import CommaList, FiniteFloat
from vramcal.estimate import EstimateError
from vramcal.estimate.learned import estimate_cards, installed_path, traced_options
from vramcal.files import os_advice
from vramcal.forecast import (
    DEFAULT_EPOCHS,
    Dataset,
    ForecastSettings,
    Price,
    cost_table,
    default_dataset,
    estimated_card,
    parse_prices,
    world_forecast,
)
from vramcal.models.registry import differences
from vramcal.report import write_cost_report
from vramcal.report.catalogue import catalogued
from vramcal.report.cost import forecast_notes, forecast_table
from vramcal.sizing import SizingError, length_model
from vramcal.units import format_bytes


class PriceList(CommaList):
    """``--price "NAME=PRICE,..."``, parsed by :func:`vramcal.forecast.parse_prices`."""

    name = "NAME=PRICE,..."
    example = '"RTX 4090=0.59,host=0.05"'

    def read(self, text: str, param, ctx) -> list[Price]:
        return parse_prices(text)


forecast_options = group(
    click.option("--epochs", type=click.IntRange(1), default=DEFAULT_EPOCHS, show_default=True,
                 help="epochs of the run forecast"),
    click.option("--data", type=click.Path(dir_okay=False), default=None,
                 help="OHLCV parquet whose windows (at each profile's seq_len, --stride, --val-fraction) make an epoch "
                      "[default: the windows of the latest run recorded in the profile, else the calibration's own "
                      "data]"),
    click.option("--bars", type=click.IntRange(1), default=None,
                 help="or a number of bars without gaps, cut into windows the same way"),
    click.option("--samples", type=click.IntRange(1), default=None, help="or the training samples of an epoch"),
    click.option("--val-samples", type=click.IntRange(0), default=None,
                 help="with --samples: the validation samples of an epoch [default: not counted]"),
    click.option("--stride", type=click.IntRange(1), default=None, help="bars between windows [default: seq_len // 2]"),
    click.option("--val-fraction", type=FiniteFloat(0, 1, min_open=True, max_open=True), default=0.2,
                 show_default=True, help="the last fraction of rows, for validation"),
    click.option("--seq-len", type=click.IntRange(1), default=None,
                 help="the run's length, for a profile calibrated over several [default: each profile's own]"),
    click.option("--price", "prices", type=PriceList(), default=[],
                 help='price per hour of each card, e.g. "RTX 4090=0.59,RTX A4000=0.25" (matched to the profiles\' '
                      'devices by name; a card without a profile gets a row with unknown throughput)'),
)


def forecastable(paths: tuple[Path, ...], options: dict[str, Any], world_size: int | None = None,
                 lengths: bool = True) -> tuple[list, list[Dataset | None], list[str]]:
    """The profiles PATHS hold that the forecast options can forecast (:func:`vramcal.cli.options.load_profiles`),
    each profile's dataset (module docstring of :mod:`vramcal.forecast`; without --data, --bars or --samples
    :func:`vramcal.forecast.default_dataset`: the latest recorded run's windows, else the calibration's data), and
    one line per profile of a folder left out: a length it does not cover (``lengths``: --seq-len, or none given
    for a profile over several), a world it cannot carry to ``world_size``, no seq_len to cut windows with.

    Raises:
        click.BadParameter: more than one of --data, --bars and --samples, or --val-samples without --samples.
        click.ClickException: a named file the options cannot forecast (one line naming it); unreadable data;
            nothing left to forecast.
    """
    given = [name for name in ("data", "bars", "samples") if options[name] is not None]
    if len(given) > 1:
        raise click.BadParameter(f"give one of --data, --bars and --samples, not {' and '.join(given)}",
                                 param_hint=f"--{given[1]}")
    if options["val_samples"] is not None and options["samples"] is None:
        raise click.BadParameter("--val-samples goes with --samples", param_hint="--val-samples")
    datasets: dict[Path, Dataset | None] = {}
    bars = None
    if options["data"] is not None:
        from vramcal.models.regressor.bars import load_bars  # loads numpy: only when called

        with one_line():
            bars = load_bars(options["data"])  # read once; each profile cuts its own windows

    def why_not(profile) -> str | None:
        try:
            if lengths:
                length_model(profile, options["seq_len"])
            if world_size is not None:
                world_forecast(profile, None, 1, world_size)
            datasets[profile.path] = _dataset(profile, options, bars)
        except SizingError as error:
            return str(error)
        return None

    profiles, left_out = load_profiles(paths, why_not)
    return profiles, [datasets[p.path] for p in profiles], left_out


def _dataset(profile, options: dict[str, Any], bars: Any) -> Dataset | None:
    """The profile's dataset (:func:`forecastable`); ``bars``: --data's, read.

    Raises:
        SizingError: windows asked of a profile whose model has no seq_len, or too few bars for a window at it.
    """
    from vramcal.models.regressor.bars import DataError  # loads numpy: only when called
    from vramcal.models.regressor.windows import make_windows, window_counts  # loads numpy: only when called

    if options["samples"] is not None:
        return Dataset(options["samples"], options["val_samples"], "--samples")
    if options["data"] is None and options["bars"] is None:
        return default_dataset(profile)
    seq_len = options["seq_len"] or profile.model.params.get("seq_len")
    if not isinstance(seq_len, int):
        raise SizingError("its model has no seq_len to cut windows with: give --samples")
    stride, fraction = options["stride"], options["val_fraction"]
    where = f"seq_len {seq_len}, stride {stride or max(1, seq_len // 2)}, val_fraction {fraction:g}"
    if options["bars"] is not None:
        train, val = window_counts(options["bars"], seq_len, stride, fraction)
        if train < 1:
            raise SizingError(f"{options['bars']} bars give no training window of {seq_len} bars: give more --bars")
        return Dataset(train, val, f"{options['bars']:,} bars without gaps: {where}")
    try:
        windows = make_windows(bars, seq_len, stride, fraction, source=options["data"])
    except DataError as error:
        raise SizingError(str(error)) from None
    return Dataset(len(windows.train_starts), len(windows.val_starts), f"{options['data']}: {where}")


def forecast_settings(datasets: list[Dataset | None], options: dict[str, Any]) -> ForecastSettings:
    """The report's :class:`vramcal.forecast.ForecastSettings` from the forecast options and the profiles' datasets
    (:func:`forecastable`; the first profile's when one is given: a report of several profiles forecasts each over
    its own calibration data unless one is given)."""
    given = any(options[name] is not None for name in ("data", "bars", "samples"))
    return ForecastSettings(epochs=options["epochs"], prices=tuple(options["prices"]),
                            dataset=datasets[0] if given else None, seq_len=options["seq_len"])


@click.command("cost")
@click.argument("profiles", nargs=-1, required=True, type=click.Path(path_type=Path))
@forecast_options
@click.option("--size-for", type=click.Choice(("memory", "throughput")), default="memory", show_default=True,
              help="each card's batch size: memory = the conservative one; throughput = the throughput knee below it")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"),
              show_default=True, help="folder for the PNG and the Markdown")
@click.option("--name", default=None, help="file stem [default: cost-<hash of the profiles and settings>]")
@click.option("--world-size", type=click.IntRange(2), default=None,
              help="a world's profiles (`vramcal probe --nproc`): the run on this many cards of each kind, its batch "
                   "per rank computed by the sharding model, its price that many cards'")
@click.option("--json", "as_json", is_flag=True, help="print the forecast as JSON for programs")
def cost_command(profiles: tuple[Path, ...], size_for: str, out_dir: Path, name: str | None, world_size: int | None,
                 as_json: bool, **options: Any) -> None:
    """Forecast a training run's time and cost on each card of PROFILES (files or folders).

    Each card's batch size, samples/s, epoch time, run time and (with --price) cost; the fastest and the cheapest
    marked. Throughput is each card's own measurement: a priced card without a profile is shown as unknown. With
    --world-size N, a world's profile forecasts the run on N cards of its kind: per-rank batch (FSDP: carried by the
    sharding model), each rank its share of the samples, the world's samples/s, the price of N cards.
    """

    loaded, datasets, left_out = forecastable(profiles, options, world_size)
    paths = [p.path for p in loaded]
    for line in left_out:
        click.echo(line, err=True)
    try:
        forecasts = cost_table(loaded, datasets, options["epochs"], options["prices"], size_for=size_for,
                               seq_len=options["seq_len"], labels=_labels(loaded), world_size=world_size)
    except SizingError as error:
        raise click.ClickException(str(error)) from None
    forecasts = forecasts if world_size else _estimated(forecasts, loaded)
    title = f"{options['epochs']} epochs, {'throughput knee' if size_for == 'throughput' else 'conservative'} batch"
    stem = name or "cost-" + hashlib.sha256(json.dumps([sorted(map(str, paths)), size_for, options, world_size],
                                                       sort_keys=True,
                                                       default=str).encode()).hexdigest()[:8]
    try:
        png, markdown = write_cost_report(forecasts, out_dir, stem, title)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--name") from None
    except OSError as error:
        raise click.ClickException(f"cannot write to {out_dir} ({error.strerror}): {os_advice(error, '--out')}") \
            from None
    if as_json:
        click.echo(json.dumps({"png": str(png), "markdown": str(markdown), "profiles": [str(p) for p in paths],
                               "left_out": left_out, "size_for": size_for,
                               "forecasts": [f.to_dict() for f in forecasts]},
                              indent=2, sort_keys=True))
        return
    click.echo(forecast_table(forecasts, bold=False))
    for note in forecast_notes(forecasts):
        click.echo(click.wrap_text(note, width=110, initial_indent="- ", subsequent_indent="  "))
    click.echo(f"forecast: {markdown} and {png}")


def _estimated(forecasts: list, profiles: list) -> list:
    """The priced cards without a profile, with the estimated conservative batch size of the profiles' model when
    they share one and the card is catalogued (:mod:`vramcal.estimate.learned`); the rows stay unknown otherwise, and on
    a failed trace."""
    import dataclasses


    cards = {}
    for f in forecasts:
        with contextlib.suppress(ValueError):
            cards[f.card] = None if f.measured else catalogued(f.card)
    cards = {name: card for name, card in cards.items() if card is not None}
    models = {p.model for p in profiles}
    if not cards or len(models) != 1 or profiles[0].world is not None or profiles[0].surface is not None:
        return forecasts
    try:
        model = profiles[0].model
        runs = [model.replace(implementation=installed_path())] if model.params.get("implementation") else [model]
        found = estimate_cards(model, traced_options(profiles[0]), cards=list(cards.values()), refs=runs)
    except (EstimateError, ValueError) as error:
        return [dataclasses.replace(f, notes=(*f.notes, f"not estimated: {error}")) if f.card in cards else f
                for f in forecasts]
    rows = dict(zip(cards, found.rows))
    return [estimated_card(f, rows[f.card].conservative_batch_size, rows[f.card].bound.says()) if f.card in rows
            else f for f in forecasts]


def _labels(profiles: list) -> list[str]:
    """Each row's card: the device's name, its memory when two profiles share the name and not the memory, and the
    model's differences where the models differ (:func:`vramcal.models.registry.differences`)."""

    names = [p.device.name for p in profiles]
    totals = len(set(names)) < len(names) and len({p.device.total_bytes for p in profiles}) > 1
    return [" · ".join(x for x in (name, format_bytes(p.device.total_bytes) if totals else "", *model) if x)
            for name, p, model in zip(names, profiles, differences([p.model for p in profiles]))]
