"""The run forecast (DESIGN.md, "Throughput, time and cost"): how long a training run takes on a card and what it
costs, from the card's profile. At the run's batch size ``b`` (:func:`vramcal.sizing.size`), with the rates the
card's trials measured there (:func:`vramcal.calibration.throughput.rate_for_run`):

    train_s   = train_samples / samples_per_s(b)             every training window once per epoch
    val_s     = val_samples × val_pass_s(b) / b               one validation pass, in chunks of b
    epoch_s   = train_s + val_s
    first_s   = max(0, first_step_s(b) − step_s(b))           once per run: the first step allocates AdamW's state
    run_s     = epochs × epoch_s + first_s
    cost      = price_per_hour × run_s / 3600

The rate's interval carries to the times and the cost. A card without a profile has no throughput: nothing is
extrapolated. ``N`` cards (:func:`world_forecast`): the profile carried to ``N`` ranks
(:func:`vramcal.sizing.sharding.carried`), each training ``ceil(samples / N)`` at its calibration's rank rate.
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
from vramcal.records import Kind, World
from vramcal.sizing import THROUGHPUT, SizeFor, SizeRequest, SizingError, length_trials, size
from vramcal.sizing.sharding import carried, world_of

HOUR_S = 3600.0
DEFAULT_EPOCHS = 10  # as `vramcal train`'s --epochs (a test keeps them equal)
FAR_FRACTION = 0.25  # a run's epoch this far (either way) from its forecast is far from it
FAR = "far from the forecast"
BAND_Z = 2.0  # the step times' noise band of an epoch against its forecast: about 95 % (time_band)


@dataclass(frozen=True)
class Dataset:
    """What one epoch holds: training and validation samples (None: unknown, not counted) and, for people, where
    the counts come from. Raises: ValueError: no training sample, or a negative count."""

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
        card: the row's name (the profile's device, or a priced card). measured: the card has a profile.
        batch_size, batch_source: the run's batch size and why (``conservative``, ``knee``, ...).
        samples_per_s, low_samples_per_s, high_samples_per_s: the rate at the batch size and its 95 % interval.
        steady: a steady rate (:mod:`vramcal.calibration.throughput`). step_spread: the step times' sd / mean
            (None: one). n_steps: how many step times the rate rests on.
        train_s, val_s, epoch_s, first_s, run_s: the module docstring's terms (``val_s`` None: not counted).
        run_low_s, run_high_s: ``run_s`` at the ends of the rate's interval (None: open).
        price_per_hour, cost, cost_low, cost_high: the price and the run's cost with its interval.
        fastest, cheapest: marked among the rows of its model (:func:`mark_best`). notes: one sentence each.
        model: :func:`vramcal.models.registry.describe` of the profile's model; None without a profile.
        ranks: the ranks whose samples/s the rates are (the batch size and dataset are then one rank's).
        tokens_per_s, step_fit: a language model's tokens/s and step-time fit ``(t0, t_token)`` (seconds per step
            and per padded token: :mod:`vramcal.train.timing`); None else.
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
    """``within 25 %`` of the forecast, or :data:`FAR`: more than ``band`` (a fraction) off either way."""
    inside = overlap((measured_s, measured_s), (forecast_s * (1 - band), forecast_s * (1 + band)))
    return f"within {band * 100:.0f} %" if inside else FAR


def observation_verdict(o: Observation) -> str:
    """:func:`time_verdict` of a recorded run's mean epoch, by the band it recorded (else :data:`FAR_FRACTION`)."""
    return time_verdict(o.epoch_s, o.forecast_epoch_s, o.time_band or FAR_FRACTION)


def time_band(forecast: Forecast, steps: int, slower: bool = True) -> float:
    """How far (a fraction) an epoch of ``steps`` steps may land from ``forecast`` on the side it landed
    (``slower``: above) with nothing wrong: the wider of :func:`noise_band` and :func:`interval_band`, at least
    :data:`FAR_FRACTION`."""
    return max(FAR_FRACTION, noise_band(forecast, steps), interval_band(forecast, slower))


def noise_band(forecast: Forecast, steps: int) -> float:
    """How far an epoch of ``steps`` steps may land from ``forecast`` by the step times' own noise, as a fraction:

        band = BAND_Z × spread × √(1/steps + 1/n_steps)

    ``spread``: the step times' coefficient of variation, ``n_steps`` their number; two independent means differ
    with variance σ²(1/steps + 1/n_steps) (Montgomery & Runger, *Applied Statistics and Probability for
    Engineers*, 6th ed., eq. 10-1). 0 without a spread."""
    if not forecast.step_spread or not forecast.n_steps or steps < 1:
        return 0.0
    return BAND_Z * forecast.step_spread * (1 / steps + 1 / forecast.n_steps) ** 0.5


def interval_band(forecast: Forecast, slower: bool) -> float:
    """The forecast epoch's own 95 % interval on one side, as a fraction of it: the training time at the rate's low
    end (``slower``) or high end (all of it where that end is open). 0 without an interval."""
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
    """The forecast at the batch size a run would take (:func:`vramcal.sizing.size`, at most the training samples,
    as the trainer takes it); without a dataset the rate alone."""
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
    """A priced card without a profile, with its estimated batch size (:mod:`vramcal.estimate.learned`; ``bound``
    says how wrong such estimates were): throughput, times and cost stay unknown."""
    return replace(forecast, batch_size=batch_size, batch_source="estimated",
                   notes=(f"batch size {batch_size} {bound}", *forecast.notes))


def mark_best(forecasts: Sequence[Forecast]) -> list[Forecast]:
    """The rows sorted by run time (rows without one last), the fastest and the cheapest of each model marked (ties:
    each) where its 95 % interval is apart from every other row's of the model; else the least says
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
            others = " and ".join(f"{marked[j].card} at batch size {marked[j].batch_size}"
                                  + (" (it has no interval)" if spread_of(marked[j], field)[1] is None else "")
                                  for j in rivals)
            note = f"{NO_DIFFERENCE} in {what} from {others}: the 95 % intervals overlap, so none is marked {flag}"
            marked[best[0]] = replace(marked[best[0]], notes=(*marked[best[0]].notes, note))
    return sorted(marked, key=lambda f: (f.run_s is None, f.run_s or 0.0))


def spread_of(forecast: Forecast, field: str) -> tuple[float | None, float | None]:
    """The 95 % interval of a row's ``run_s`` or ``cost`` (an end None: open; both: no interval)."""
    if field == "run_s":
        return forecast.run_low_s, forecast.run_high_s
    return forecast.cost_low, forecast.cost_high


def card_key(name: str) -> str:
    """A card's name for matching prices: lower case, words only, without ``nvidia`` and ``geforce``
    (``NVIDIA GeForce RTX 4090`` and ``rtx-4090`` are both ``rtx 4090``)."""
    words = re.sub(r"[^a-z0-9]+", " ", name.lower()).split()
    return " ".join(w for w in words if w not in ("nvidia", "geforce"))


def match_price(price: Price, profiles: Sequence[Profile]) -> list[int]:
    """The indices of the profiles a price names: by :func:`card_key` (``host`` names every host profile), else by
    a whole-word prefix of exactly one device name (``H100``); none when it names none or several."""
    key = card_key(price.name)
    keys = [card_key(p.device.name) for p in profiles]
    exact = [i for i, (p, k) in enumerate(zip(profiles, keys))
             if k == key or (key == "host" and p.device.kind is Kind.HOST)]
    if exact:
        return exact
    prefixed = [i for i, k in enumerate(keys) if k.startswith(key + " ")]
    return prefixed if len({keys[i] for i in prefixed}) == 1 else []


def parse_prices(text: str) -> list[Price]:
    """Parse ``--price "RTX 4090=0.59,RTX A4000=0.25"``: a card's name and its price per hour (any currency).

    Raises:
        ValueError: an entry without exactly one ``=`` or with a ``;``, an empty name, a price not a finite
            number >= 0, or a name given twice (any case); the message names the entry.
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
    """One forecast per profile (with its dataset and the price naming its card; with ``world_size`` on that many
    cards, :func:`world_forecast`), one row per price naming no profile, sorted and marked by :func:`mark_best`.

    Raises:
        SizingError: ``world_size`` and a profile of one process, or one the sharding model cannot carry.
    """
    price_of = {i: price.price_per_hour for price in prices for i in match_price(price, profiles)}
    labels = labels or [p.device.name for p in profiles]
    rows = [forecast_profile(p, d, epochs, price_per_hour=price_of.get(i), size_for=size_for, seq_len=seq_len,
                             card=label) if world_size is None else
            world_forecast(p, d, epochs, world_size, price_per_hour=price_of.get(i), size_for=size_for,
                           seq_len=seq_len, card=label)
            for i, (p, d, label) in enumerate(zip(profiles, datasets, labels))]
    return mark_best(rows + [unknown_card(price, epochs, datasets[0] if datasets else None) for price in prices
                             if not match_price(price, profiles)])


def world_forecast(profile: Profile, dataset: Dataset | None, epochs: int, nproc: int, *,
                   price_per_hour: float | None = None, size_for: SizeFor = "memory", seq_len: int | None = None,
                   card: str | None = None) -> Forecast:
    """The forecast of a run on ``nproc`` cards of the profile's kind (module docstring): the batch size and times
    one rank's, the samples/s the world's (``ranks`` = ``nproc``), the cost ``nproc`` cards'.

    Raises:
        SizingError: a profile of one process, or one :func:`vramcal.sizing.sharding.carried` refuses.
    """
    world = world_of(profile)
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
    """The calibration's own data as a dataset (the windows its factory reported), or None when it reported none."""
    info = profile.model_info
    train = info.get("train_windows")
    if not isinstance(train, int) or train < 1:
        return None
    val = info.get("val_windows")
    return Dataset(train, val if isinstance(val, int) else None,
                   f"the calibration's data: {info.get('data', profile.data.get('source', 'unknown'))}")


def run_dataset(profile: Profile) -> Dataset | None:
    """The epoch of the latest recorded run that counted its windows, or None (none did; a profile over lengths)."""
    if profile.surface is not None:
        return None
    recorded = [o for o in profile.observations if o.train_samples]
    if not recorded:
        return None
    o = max(recorded, key=lambda o: o.recorded_utc)
    return Dataset(o.train_samples, o.val_samples,
                   f"the windows of the run recorded {o.recorded_utc}: {o.data_source or 'its data'}")


def default_dataset(profile: Profile) -> Dataset | None:
    """The dataset a forecast counts when none is given: :func:`run_dataset`, else :func:`calibration_dataset`."""
    return run_dataset(profile) or calibration_dataset(profile)


@dataclass(frozen=True)
class ForecastSettings:
    """What a report forecasts for its profile: ``epochs`` over ``dataset`` (None: :func:`default_dataset`) at
    ``seq_len``, with ``prices``."""

    epochs: int = DEFAULT_EPOCHS
    prices: tuple[Price, ...] = ()
    dataset: Dataset | None = None
    seq_len: int | None = None


def profile_forecasts(profile: Profile, settings: ForecastSettings = ForecastSettings()) -> list[Forecast]:
    """The report's forecast for one profile: at the conservative batch size, at the throughput knee when sizing for
    throughput takes another (else the conservative row says why not), and every other priced card's row."""
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
