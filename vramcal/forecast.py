"""The run forecast (the shared DESIGN.md's "run forecast"): how long a training run takes on a card and what
it costs, from the card's profile; pure functions of profiles, a dataset, a number of epochs and prices.

At the run's batch size ``b`` (the conservative one, or the throughput knee: :func:`vramcal.sizing.size`),
with the rates the card's trials measured there, steady where it can
(:func:`vramcal.calibration.throughput.rate_for_run`):

    train_s   = train_samples / samples_per_s(b)             every training window once per epoch
    val_s     = val_samples × val_pass_s(b) / b               one validation pass, in chunks of b
    epoch_s   = train_s + val_s
    first_s   = max(0, first_step_s(b) − step_s(b))           once per run: the first step allocates AdamW's state
    run_s     = epochs × epoch_s + first_s
    cost      = price_per_hour × run_s / 3600

The first line is the shared definition (samples per epoch / samples/s: the epoch's last, partly filled batch
counts at the same rate per sample); the validation pass and the first step are what an epoch of ``vramcal
train`` holds besides (:mod:`vramcal.train.loop`, whose ``epoch_s`` is ``train_s + val_s`` timed the way a
trial times its steps). The interval of ``samples_per_s`` carries through to the times and the cost.

A card without a measured profile has no throughput: its row says so and has no times and no cost. Nothing
is extrapolated from another card, nor from a batch size outside the measured ones.

For ``N`` cards of a kind (:func:`world_forecast`, ``vramcal cost --world-size N``) a world's profile (``vramcal
probe --nproc``) is carried to ``N`` ranks (:func:`vramcal.sizing.sharding.carried`: under FSDP each rank's batch
grows as
its shard shrinks; under DDP it does not move), each rank trains its share of the windows (``ceil(samples / N)``) at
the rate its ranks measured at that batch (the ranks step together), so the times are one rank's, the world's
samples/s ``N`` × one rank's, and the cost ``N`` × the card's price × the run's hours. The rate at ``N`` ranks is the
calibration's world's: the collectives of more ranks are not measured.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from vramcal.calibration.throughput import (
    NEAR_FRACTION,
    NO_DIFFERENCE,
    Rate,
    measured_rates,
    overlap,
    rate_at,
    rate_for_run,
)
from vramcal.models.registry import describe
from vramcal.profile import Observation, Profile
from vramcal.records import World
from vramcal.sizing import THROUGHPUT, SizeFor, SizeRequest, SizingError, length_trials, size
from vramcal.sizing.sharding import carried

HOUR_S = 3600.0
DEFAULT_EPOCHS = 10  # as `vramcal train`'s --epochs (a test keeps them equal)
FAR_FRACTION = 0.25  # a run's epoch this far (either way) from its forecast is far from it
FAR = "far from the forecast"
BAND_Z = 2.0  # the step times' noise band of an epoch against its forecast: about 95 % (time_band)


@dataclass(frozen=True)
class Dataset:
    """What one epoch holds, in samples (windows of bars for the regressor).

    Attributes:
        train_samples: training samples per epoch.
        val_samples: validation samples per epoch (None: not known, so not counted: the forecast says so).
        source: where the counts come from, for people.
    """

    train_samples: int
    val_samples: int | None
    source: str

    def __post_init__(self) -> None:
        if self.train_samples < 1 or (self.val_samples is not None and self.val_samples < 0):
            raise ValueError(f"a dataset needs at least 1 training sample and no negative count, got "
                             f"{self.train_samples} and {self.val_samples}")


@dataclass(frozen=True)
class Price:
    """A card's rental price: ``name`` as given (``RTX 4090``), dollars (or any currency) per hour."""

    name: str
    price_per_hour: float


@dataclass(frozen=True)
class Forecast:
    """One card's run forecast (module docstring). Seconds, samples per second, currency units.

    Attributes:
        card: the row's name: the profile's device (and model, when the profiles' models differ), or a priced
            card without a profile.
        measured: the card has a profile; False: throughput, times and cost unknown.
        batch_size, batch_source: the run's batch size and why (``conservative``, ``knee``, ...).
        samples_per_s, low_samples_per_s, high_samples_per_s: the rate at the batch size and its 95 % interval.
        steady: the rate is a steady one (:mod:`vramcal.calibration.throughput`).
        step_spread: the coefficient of variation of the step times the rate rests on (sd / mean; None: one).
        n_steps: how many step times the rate rests on.
        train_s, val_s, epoch_s, first_s, run_s: the forecast's terms (module docstring); ``val_s`` None: the
            validation pass is not counted.
        run_low_s, run_high_s: ``run_s`` at the ends of the rate's interval (``run_low_s`` None: open).
        price_per_hour, cost, cost_low, cost_high: the price and the run's cost with its interval.
        epochs, dataset: what was forecast.
        fastest, cheapest: the shortest run, the lowest cost among the rows of its model that have one.
        notes: what people should know about the row (one sentence each).
        model: the profile's model (:func:`vramcal.models.registry.describe`); None for a card without a profile.
        ranks: the DDP ranks whose samples/s the rates are (:mod:`vramcal.train.timing`: the world's, ranks ×
            one rank's; the batch size and the dataset are then one rank's); 1: one process.
        tokens_per_s: a language model's training tokens per second (:mod:`vramcal.train.timing`); None else.
        step_fit: a run on documents of every length: its step-time fit ``(t0, t_token)``, seconds per step and
            per padded token (:func:`vramcal.train.timing.documents_forecast`); None else.
    """

    card: str
    measured: bool
    epochs: int
    dataset: Dataset | None
    batch_size: int | None = None
    batch_source: str | None = None
    samples_per_s: float | None = None
    low_samples_per_s: float | None = None
    high_samples_per_s: float | None = None
    steady: bool | None = None
    step_spread: float | None = None
    n_steps: int | None = None
    train_s: float | None = None
    val_s: float | None = None
    epoch_s: float | None = None
    first_s: float | None = None
    run_s: float | None = None
    run_low_s: float | None = None
    run_high_s: float | None = None
    price_per_hour: float | None = None
    cost: float | None = None
    cost_low: float | None = None
    cost_high: float | None = None
    fastest: bool = False
    cheapest: bool = False
    notes: tuple[str, ...] = ()
    model: str | None = None
    ranks: int = 1
    tokens_per_s: float | None = None
    step_fit: tuple[float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------ the arithmetic

def epoch_seconds(rate: Rate, dataset: Dataset) -> tuple[float, float | None]:
    """(train_s, val_s) of one epoch at ``rate`` (module docstring); ``val_s`` None when not countable."""
    train_s = dataset.train_samples / rate.samples_per_s
    if dataset.val_samples == 0:
        return train_s, 0.0
    if dataset.val_samples is None or rate.val_s is None:
        return train_s, None
    return train_s, dataset.val_samples * rate.val_s / rate.batch_size


def first_step_extra(rate: Rate) -> float:
    """What a run's first step takes beyond a steady one (0 when the trials did not time it)."""
    return 0.0 if rate.first_step_s is None else max(0.0, rate.first_step_s - rate.step_s)


def run_seconds(rate: Rate, dataset: Dataset, epochs: int, samples_per_s: float | None = None) -> float | None:
    """``epochs × epoch_s + first_s`` at ``samples_per_s`` (default the rate's own); None for an open end."""
    if samples_per_s is None:
        return None
    train_s, val_s = epoch_seconds(replace(rate, samples_per_s=samples_per_s), dataset)
    return epochs * (train_s + (val_s or 0.0)) + first_step_extra(rate)


def forecast_rate(rate: Rate, dataset: Dataset, epochs: int, price_per_hour: float | None = None) -> dict[str, Any]:
    """The forecast's figures at a measured rate: the times, the cost and their intervals (module docstring)."""
    train_s, val_s = epoch_seconds(rate, dataset)
    run_s = run_seconds(rate, dataset, epochs, rate.samples_per_s)
    low, high = (run_seconds(rate, dataset, epochs, rate.high_samples_per_s),
                 run_seconds(rate, dataset, epochs, rate.low_samples_per_s))

    def cost(seconds: float | None) -> float | None:
        return None if price_per_hour is None or seconds is None else price_per_hour * seconds / HOUR_S

    return {"samples_per_s": rate.samples_per_s, "low_samples_per_s": rate.low_samples_per_s,
            "high_samples_per_s": rate.high_samples_per_s, "steady": rate.steady, "step_spread": rate.spread,
            "n_steps": rate.n_steps, "train_s": train_s,
            "val_s": val_s, "epoch_s": train_s + (val_s or 0.0), "first_s": first_step_extra(rate), "run_s": run_s,
            "run_low_s": low, "run_high_s": high, "price_per_hour": price_per_hour, "cost": cost(run_s),
            "cost_low": cost(low), "cost_high": cost(high)}


def time_verdict(measured_s: float, forecast_s: float, band: float = FAR_FRACTION) -> str:
    """``within 25 %`` of the forecast, or :data:`FAR`: more than ``band`` (a fraction; default
    :data:`FAR_FRACTION`) off, either way: the measured time outside the forecast's band
    (:func:`vramcal.calibration.throughput.overlap`, the point against the band)."""
    inside = overlap((measured_s, measured_s), (forecast_s * (1 - band), forecast_s * (1 + band)))
    return f"within {band * 100:.0f} %" if inside else FAR


def observation_verdict(o: Observation) -> str:
    """:func:`time_verdict` of a recorded run's mean epoch against its forecast, by the band it recorded (older
    runs, which recorded none: :data:`FAR_FRACTION`). The observation has both times."""
    return time_verdict(o.epoch_s, o.forecast_epoch_s, o.time_band or FAR_FRACTION)


def time_band(forecast: Forecast, steps: int, slower: bool = True) -> float:
    """How far an epoch of ``steps`` steps may land from ``forecast`` by the spread the calibration measured, as a
    fraction, on the side it landed (``slower``: above the forecast): the wider of :func:`noise_band` and
    :func:`interval_band`, never less than :data:`FAR_FRACTION`. A miss inside it is no sign that the profile is
    wrong (:mod:`vramcal.train.timing`)."""
    return max(FAR_FRACTION, noise_band(forecast, steps), interval_band(forecast, slower))


def noise_band(forecast: Forecast, steps: int) -> float:
    """How far an epoch of ``steps`` steps may land from ``forecast`` by the step times' own noise, as a fraction:

        band = BAND_Z × spread × √(1/steps + 1/n_steps)

    ``spread`` is the coefficient of variation of the step times the forecast rests on and ``n_steps`` their
    number: the mean of ``steps`` new step times against the mean of those ``n_steps``, two independent means,
    whose difference has the variance σ²(1/steps + 1/n_steps) (Montgomery & Runger, *Applied Statistics and
    Probability for Engineers*, 6th ed., eq. 10-1); ``BAND_Z`` = 2, about 95 %. On a GPU whose steps repeat
    within 1 % it is far below 25 %; on a busy 2-core host (step times spread 20-30 %) an epoch of 3 steps may
    land 30 % off its forecast with nothing wrong. 0 without a spread."""
    if not forecast.step_spread or not forecast.n_steps or steps < 1:
        return 0.0
    return BAND_Z * forecast.step_spread * (1 / steps + 1 / forecast.n_steps) ** 0.5


def interval_band(forecast: Forecast, slower: bool) -> float:
    """The forecast epoch's own 95 % interval on one side, as a fraction of it: its training time at the rate's
    low end (``slower``) or high end (all of it where that end is open: two step times spread 11 % or more), the
    validation pass as forecast. Where t(0.975, n − 1) is large (12.7 for two step times) this is wider than
    :func:`noise_band`. 0 without an interval."""
    rate, low, high = forecast.samples_per_s, forecast.low_samples_per_s, forecast.high_samples_per_s
    if not forecast.epoch_s or not forecast.train_s or not rate or low is None:
        return 0.0
    share = forecast.train_s / forecast.epoch_s
    return share * (rate / low - 1) if slower else share * (1 - (rate / high if high else 0.0))


def rate_notes(rate: Rate, dataset: Dataset) -> list[str]:
    """What a row's rate rests on, when people should know it."""
    notes = []
    if rate.per_sample_from is not None:
        notes.append(f"samples/s of the steady trial at batch size {rate.per_sample_from}, read per sample (within "
                     f"{NEAR_FRACTION * 100:g} % of batch size {rate.batch_size}, where only short trials ran)")
    elif rate.interpolated_from:
        notes.append(f"samples/s interpolated between the measured batch sizes {rate.interpolated_from[0]} and "
                     f"{rate.interpolated_from[1]}")
    elif not rate.per_step:
        notes.append(f"samples/s from the median step time of {rate.n_trials} short trial{'s' * (rate.n_trials != 1)}"
                     f" (the profile predates per-step times: no interval)")
    elif not rate.steady:
        notes.append(f"samples/s from {rate.n_steps} timed step{'s' * (rate.n_steps != 1)} of short trials, not a "
                     f"steady trial")
    if epoch_seconds(rate, dataset)[1] is None:
        notes.append("the validation pass is not counted (" + ("its size is unknown" if dataset.val_samples is None
                     else "the profile's trials did not time it") + ")")
    return notes


# ------------------------------------------------------------------------------------------ one card

def forecast_batch(profile: Profile, batch_size: int, batch_source: str, dataset: Dataset, epochs: int, *,
                   price_per_hour: float | None = None, seq_len: int | None = None,
                   card: str | None = None) -> Forecast:
    """The forecast for a run of ``epochs`` over ``dataset`` at ``batch_size`` on the profile's card; a batch
    size without a measured rate at or around it gives a row without times."""
    card, model = card or profile.device.name, describe(profile.model)
    rate = rate_for_run(measured_rates(length_trials(profile, seq_len)), batch_size)
    if rate is None:
        return Forecast(card, True, epochs, dataset, batch_size, batch_source, price_per_hour=price_per_hour,
                        notes=(f"no throughput measured at or around batch_size {batch_size}: no forecast",),
                        model=model)
    return Forecast(card, True, epochs, dataset, batch_size, batch_source, notes=tuple(rate_notes(rate, dataset)),
                    model=model, **forecast_rate(rate, dataset, epochs, price_per_hour))


def forecast_profile(profile: Profile, dataset: Dataset | None, epochs: int, *, price_per_hour: float | None = None,
                     size_for: SizeFor = "memory", seq_len: int | None = None, card: str | None = None) -> Forecast:
    """The forecast at the batch size a run would take on the profile's card (:func:`vramcal.sizing.size`: the
    conservative one, or sizing for throughput the knee, with the sizing's reason in the notes), no more than the
    training samples, as the trainer takes it; without a dataset the rate alone."""
    card, model = card or profile.device.name, describe(profile.model)
    try:
        sizing = size(profile, SizeRequest(size_for=size_for, seq_len=seq_len))
    except SizingError as error:
        return Forecast(card, True, epochs, dataset, price_per_hour=price_per_hour, notes=(str(error),), model=model)
    batch, source = sizing.batch_size, sizing.label
    said = tuple(n for n in sizing.notices if n.startswith(THROUGHPUT))  # why the knee, or why not
    if dataset is None:
        rate = rate_at(measured_rates(length_trials(profile, seq_len)), batch)
        found = Forecast(card, True, epochs, None, batch, source, price_per_hour=price_per_hour,
                         samples_per_s=rate and rate.samples_per_s, low_samples_per_s=rate and rate.low_samples_per_s,
                         high_samples_per_s=rate and rate.high_samples_per_s, steady=rate and rate.steady,
                         notes=("no dataset: give one (--data, --bars or --samples) for the times",), model=model)
    else:
        if batch > dataset.train_samples:
            batch, source = dataset.train_samples, replace(sizing, capped_by_data=True).label
        found = forecast_batch(profile, batch, source, dataset, epochs, price_per_hour=price_per_hour,
                               seq_len=seq_len, card=card)
    found = replace(found, notes=(*found.notes, *said))
    return found if profile.verified else replace(found, notes=(UNVERIFIED, *found.notes))


UNVERIFIED = "the profile's limits were not verified by real trials: its batch size is an extrapolation"


def unknown_card(price: Price, epochs: int, dataset: Dataset | None) -> Forecast:
    """A priced card without a measured profile: throughput, times and cost unknown, and said so."""
    return Forecast(price.name, False, epochs, dataset, price_per_hour=price.price_per_hour,
                    notes=("no measured profile: throughput unknown (it depends on the card, not only its memory); "
                           "run `vramcal probe` on this card",))


def estimated_card(forecast: Forecast, batch_size: int, bound: str) -> Forecast:
    """A priced card without a profile, with its estimated batch size (:mod:`vramcal.estimated`: never measured,
    never verified; ``bound`` says how wrong such estimates were): throughput, times and cost stay unknown."""
    return replace(forecast, batch_size=batch_size, batch_source="estimated",
                   notes=(f"batch size {batch_size} {bound}", *forecast.notes))


# ------------------------------------------------------------------------------------------ several cards

def mark_best(forecasts: Sequence[Forecast]) -> list[Forecast]:
    """The rows sorted by run time (rows without one last, in their order), the fastest and the cheapest marked
    among the rows of each model (ties: every row at the minimum): another model is another run, not a card's
    speed or price. A row is marked only where its 95 % interval is apart from every other row's of its model
    (:func:`vramcal.calibration.throughput.overlap`); else none is, and the row with the least says
    :data:`~vramcal.calibration.throughput.NO_DIFFERENCE` from the rows it overlaps."""
    marked = list(forecasts)
    for flag, field, what in (("fastest", "run_s", "run time"), ("cheapest", "cost", "cost")):
        for model in dict.fromkeys(f.model for f in marked):
            rows = [i for i, f in enumerate(marked) if f.model == model and getattr(f, field) is not None]
            if not rows:
                continue
            least = min(getattr(marked[i], field) for i in rows)
            best = [i for i in rows if getattr(marked[i], field) == least]
            rivals = [j for j in rows if j not in best
                      and any(overlap(spread_of(marked[i], field), spread_of(marked[j], field)) for i in best)]
            if not rivals:
                marked = [replace(f, **{flag: True}) if i in best else f for i, f in enumerate(marked)]
                continue
            others = " and ".join(row_name(marked[j]) + (" (it has no interval)" if spread_of(marked[j], field)[1]
                                                         is None else "") for j in rivals)
            note = f"{NO_DIFFERENCE} in {what} from {others}: the 95 % intervals overlap, so none is marked {flag}"
            marked[best[0]] = replace(marked[best[0]], notes=(*marked[best[0]].notes, note))
    return sorted(marked, key=lambda f: (f.run_s is None, f.run_s or 0.0))


def spread_of(forecast: Forecast, field: str) -> tuple[float | None, float | None]:
    """The 95 % interval of a row's ``run_s`` or ``cost`` (an end None: open; both: no interval)."""
    if field == "run_s":
        return forecast.run_low_s, forecast.run_high_s
    return forecast.cost_low, forecast.cost_high


def row_name(forecast: Forecast) -> str:
    """A row's card and batch size, for the notes."""
    return f"{forecast.card} at batch size {forecast.batch_size}"


def card_key(name: str) -> str:
    """A card's name for matching prices: lower case, words only, without ``nvidia`` and ``geforce``
    (``NVIDIA GeForce RTX 4090`` and ``rtx-4090`` are both ``rtx 4090``)."""
    words = re.sub(r"[^a-z0-9]+", " ", name.lower()).split()
    return " ".join(w for w in words if w not in ("nvidia", "geforce"))


def match_price(price: Price, profiles: Sequence[Profile]) -> list[int]:
    """The indices of the profiles a price names: by the device's name (:func:`card_key`; ``host`` names every
    host profile), else by a whole-word prefix of exactly one device name (``H100`` for ``NVIDIA H100 80GB
    HBM3``); none when it names no profile's card or several different ones."""
    key = card_key(price.name)
    keys = [card_key(p.device.name) for p in profiles]
    exact = [i for i, (p, k) in enumerate(zip(profiles, keys))
             if k == key or (key == "host" and p.device.kind == "host")]
    if exact:
        return exact
    prefixed = [i for i, k in enumerate(keys) if k.startswith(key + " ")]
    return prefixed if len({keys[i] for i in prefixed}) == 1 else []


def parse_prices(text: str) -> list[Price]:
    """Parse ``--price "RTX 4090=0.59,RTX A4000=0.25"``: a card's name and its price per hour (any currency).

    Raises:
        ValueError: an entry without exactly one ``=``, or with a ``;`` (entries are separated by commas), an
            empty name, a price that is not a finite number >= 0, or a name
            given twice (any case); the message names the entry.
    """
    prices: list[Price] = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if ";" in entry:
            raise ValueError(f"--price entry {entry!r} holds a ';': entries are separated by commas, e.g. "
                             f"\"RTX 4090=0.59,host=0.05\"")
        name, sep, value = entry.partition("=")
        if not sep or not name.strip() or "=" in value:
            raise ValueError(f"--price entry {entry!r} is not NAME=PRICE (one = each; entries are separated by "
                             f"commas): write e.g. \"RTX 4090=0.59,RTX A4000=0.25\"")
        try:
            number = float(value.strip().lstrip("$"))
        except ValueError:
            number = -1.0
        if not (0 <= number < float("inf")):
            raise ValueError(f"--price entry {entry!r}: {value.strip()!r} is not a price per hour >= 0, e.g. 0.59")
        if any(card_key(p.name) == card_key(name) for p in prices):
            raise ValueError(f"--price entry {entry!r}: {name.strip()!r} is given twice; price each card once")
        prices.append(Price(name.strip(), number))
    return prices


def cost_table(profiles: Sequence[Profile], datasets: Sequence[Dataset | None], epochs: int,
               prices: Sequence[Price] = (), *, size_for: SizeFor = "memory", seq_len: int | None = None,
               labels: Sequence[str] | None = None, world_size: int | None = None) -> list[Forecast]:
    """One forecast per profile (with its dataset and, where a price names its card, its price; with ``world_size``
    the run on that many cards of each profile's kind, :func:`world_forecast`), one row per price naming no profile
    (unknown throughput), sorted and marked by :func:`mark_best`.

    Raises:
        SizingError: ``world_size`` and a profile of one process, or one the sharding model cannot carry.
    """
    if world_size is not None:
        return mark_best([world_forecast(p, d, epochs, world_size, price_per_hour=price_of, size_for=size_for,
                                         seq_len=seq_len, card=label)
                          for p, d, price_of, label in _priced(profiles, datasets, prices, labels)]
                         + [unknown_card(price, epochs, datasets[0] if datasets else None) for price in prices
                            if not match_price(price, profiles)])
    price_of: dict[int, float] = {}
    rows = []
    for price in prices:
        found = match_price(price, profiles)
        price_of.update({i: price.price_per_hour for i in found})
        if not found:
            rows.append(unknown_card(price, epochs, datasets[0] if datasets else None))
    labels = labels or [p.device.name for p in profiles]
    rows = [forecast_profile(p, d, epochs, price_per_hour=price_of.get(i), size_for=size_for, seq_len=seq_len,
                             card=label) for i, (p, d, label) in enumerate(zip(profiles, datasets, labels))] + rows
    return mark_best(rows)


def _priced(profiles: Sequence[Profile], datasets: Sequence[Dataset | None], prices: Sequence[Price],
            labels: Sequence[str] | None) -> list[tuple[Profile, Dataset | None, float | None, str]]:
    """Each profile with its dataset, the price that names its card (None: none does) and its row's name."""
    price_of = {i: price.price_per_hour for price in prices for i in match_price(price, profiles)}
    labels = labels or [p.device.name for p in profiles]
    return [(p, d, price_of.get(i), label) for i, (p, d, label) in enumerate(zip(profiles, datasets, labels))]


def world_forecast(profile: Profile, dataset: Dataset | None, epochs: int, nproc: int, *,
                   price_per_hour: float | None = None, size_for: SizeFor = "memory", seq_len: int | None = None,
                   card: str | None = None) -> Forecast:
    """The forecast of a run on ``nproc`` cards of the profile's kind (module docstring): the batch size per rank,
    the times of one rank's share of ``dataset``, the world's samples/s (``ranks`` = ``nproc``) and the cost of
    ``nproc`` cards at ``price_per_hour`` each.

    Raises:
        SizingError: a profile of one process (no world to carry), or one :func:`vramcal.sizing.sharding.carried`
        refuses.
    """
    world = profile.world
    if world is None:
        raise SizingError("a single-process profile has no world to carry to other world sizes: calibrate one with "
                          "`vramcal probe --nproc N` (and --strategy fsdp for a sharded one)")
    at = profile if world.nproc == nproc else carried(profile, World(**{**world.to_dict(), "nproc": nproc}))
    share = dataset and Dataset(-(-dataset.train_samples // nproc),
                                None if dataset.val_samples is None else -(-dataset.val_samples // nproc),
                                f"{dataset.source}; each of {nproc} ranks trains its share")
    found = forecast_profile(at, share, epochs, price_per_hour=None if price_per_hour is None else
                             nproc * price_per_hour, size_for=size_for, seq_len=seq_len, card=card)
    basis = "measured" if at is profile else f"computed from its {world.nproc}-rank fit by the sharding model"
    note = (f"{nproc} cards under {world.strategy.upper()}: the batch size is per rank "
            f"({basis}), the global batch {nproc} × it; samples/s the world's (the ranks' rate at the "
            f"{world.nproc}-rank calibration's, × {nproc}); the price {nproc} cards'")

    def world_rate(rate: float | None) -> float | None:
        return None if rate is None else rate * nproc

    return replace(found, ranks=nproc, samples_per_s=world_rate(found.samples_per_s),
                   low_samples_per_s=world_rate(found.low_samples_per_s),
                   high_samples_per_s=world_rate(found.high_samples_per_s), notes=(note, *found.notes))


def calibration_dataset(profile: Profile) -> Dataset | None:
    """The calibration's own data as a dataset (the windows its factory reported), or None when it reported none
    (a model without a dataset, such as the language model's random tokens)."""
    info = profile.model_info
    train = info.get("train_windows")
    if not isinstance(train, int) or train < 1:
        return None
    val = info.get("val_windows")
    return Dataset(train, val if isinstance(val, int) else None,
                   f"the calibration's data: {info.get('data', profile.data.get('source', 'unknown'))}")


def run_dataset(profile: Profile) -> Dataset | None:
    """The epoch of the latest training run recorded in the profile with the windows it counted (its own data and
    stride: :class:`vramcal.profile.Observation`), or None: none recorded them, or a profile over several lengths
    (a run's windows are of one)."""
    if profile.surface is not None:
        return None
    recorded = [o for o in profile.observations if o.train_samples]
    if not recorded:
        return None
    o = max(recorded, key=lambda o: o.recorded_utc)
    return Dataset(o.train_samples, o.val_samples,
                   f"the windows of the run recorded {o.recorded_utc}: {o.data_source or 'its data'}")


def default_dataset(profile: Profile) -> Dataset | None:
    """What a forecast of a run counts when no dataset is given: the latest recorded run's windows
    (:func:`run_dataset`: the run's stride, not the calibration's), else the calibration's own data
    (:func:`calibration_dataset`)."""
    return run_dataset(profile) or calibration_dataset(profile)


@dataclass(frozen=True)
class ForecastSettings:
    """What a report forecasts for its profile: ``epochs`` over ``dataset`` (None: the latest recorded run's
    windows, else the calibration's own data: :func:`default_dataset`) at ``seq_len`` (a profile over several
    lengths), with ``prices``."""

    epochs: int = DEFAULT_EPOCHS
    prices: tuple[Price, ...] = ()
    dataset: Dataset | None = None
    seq_len: int | None = None


def profile_forecasts(profile: Profile, settings: ForecastSettings = ForecastSettings()) -> list[Forecast]:
    """The report's forecast for one profile: at the conservative batch size and, when sizing for throughput takes
    another, at the throughput knee (else the conservative row says why not); with a row for every priced card
    that is not the profile's (unknown throughput)."""
    dataset = settings.dataset or default_dataset(profile)
    rows = cost_table([profile], [dataset], settings.epochs, settings.prices, seq_len=settings.seq_len)
    own = next(r for r in rows if r.measured)
    knee = forecast_profile(profile, dataset, settings.epochs, price_per_hour=own.price_per_hour, size_for="throughput",
                            seq_len=settings.seq_len)
    if knee.batch_size is not None and knee.batch_size != own.batch_size:
        rows.append(knee)
    else:  # no knee row: the reason sizing for throughput keeps the size (refused, no measurable difference)
        said = tuple(n for n in knee.notes if n.startswith(THROUGHPUT) and n not in own.notes)
        rows = [replace(r, notes=(*r.notes, *said)) if r is own else r for r in rows]
    return mark_best(rows)
