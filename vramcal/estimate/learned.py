"""Limits estimated, not measured: batch sizes on a card you do not have, with an error bound learned from the
calibrations you have (DESIGN.md, "Estimates: a card you do not have").

    estimated_peak(b) = baseline + data_bytes + trace_overhead + trace_slope × b
    safe = floor((usable × (1 + min(low, 0)) − baseline − data_bytes − trace_overhead) / trace_slope)

The trace is :func:`vramcal.estimate.estimate_step`'s; the baseline the median over verified profiles of
``fit.overhead − pool_data_bytes − trace_overhead``; ``low`` the bound's lowest leave-one-out error.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramcal.calibration.limits import LimitSettings
from vramcal.calibration.search import Aim
from vramcal.environment import shown_setting, software_versions, worker_setting
from vramcal.estimate import EstimateError, StepEstimate
from vramcal.estimate.cache import cached_trace, key
from vramcal.estimate.constants import CONTEXT, MIB
from vramcal.estimate.result import line
from vramcal.models.mamba2 import mamba_ssm_available
from vramcal.models.registry import describe
from vramcal.profile import Profile, profiles_under
from vramcal.records import Device, Kind
from vramcal.sizing.staleness import recorded_software
from vramcal.sizing.terms import trials_spread
from vramcal.units import format_bytes
from vramcal.workload import ModelRef, WorkloadError


@dataclass(frozen=True)
class Baseline:
    """What a process holds that a fake trace cannot see (bytes), its source for people, and the
    :data:`BASELINE_SETTINGS` a stated default was measured under."""

    bytes: int
    source: str
    settings: Mapping[str, str | None] = field(default_factory=dict)


# What a baseline moves with besides its device, weightiest first (measured: DESIGN.md, "Estimates")
BASELINE_SETTINGS: dict[Kind, tuple[str, ...]] = {Kind.HOST: ("torch", "OMP_NUM_THREADS"), Kind.CUDA: ("torch",)}


def baseline_settings(kind: Kind) -> dict[str, str | None]:
    """The :data:`BASELINE_SETTINGS` of ``kind`` a worker started now runs with."""
    return {name: software_versions()["torch"] if name == "torch" else worker_setting(name)
            for name in BASELINE_SETTINGS[kind]}


def settings_of(profile: Profile) -> dict[str, str | None]:
    """The :data:`BASELINE_SETTINGS` ``profile``'s trials recorded."""
    torch = recorded_software(profile).get("torch")
    made = {**profile.environment, **({"torch": torch} if torch else {})}
    return {name: made[name] for name in BASELINE_SETTINGS[profile.device.kind] if name in made}


# The median of the project's host calibrations, 497-632 MiB (`python -m bench.estimate --bound`)
HOST_BASELINE = Baseline(569 * MIB, "the project's host calibrations (no host profile here to learn from)",
                         {"torch": "2.13.0+cpu", "OMP_NUM_THREADS": None})
# A host worker of torch's CUDA build holds about twice the CPU build's (its CUDA libraries): the median of this
# project's host calibrations under 2.13.0+cu130 (bench/results/estimate-builds)
HOST_CUDA_BUILD_BASELINE = Baseline(1045 * MIB, "the project's host calibrations under torch's CUDA build (no host "
                                                "profile of this build here to learn from)",
                                    {"torch": "2.13.0+cu130", "OMP_NUM_THREADS": None})
CUDA_BASELINE = Baseline(CONTEXT, f"the CUDA context, {CONTEXT // MIB} MiB with lazy module loading (published "
                                  f"figures: vramcal/estimate/constants.py; no GPU profile here to learn from)")
DEFAULT_BASELINES = {(Kind.HOST, False): HOST_BASELINE, (Kind.HOST, True): HOST_CUDA_BUILD_BASELINE,  # no profile:
                     (Kind.CUDA, False): CUDA_BASELINE, (Kind.CUDA, True): CUDA_BASELINE}  # (kind, torch's CUDA build)


@dataclass(frozen=True)
class ErrorBound:
    """The smallest and largest ``estimated / measured − 1`` of the peak at the safe size over ``n`` calibrations."""

    low: float
    high: float
    n: int
    source: str

    def says(self) -> str:
        """The bound for people."""
        return (f"estimated, not measured: on {self.source} this estimate was {self.low:+.1%} to {self.high:+.1%} "
                f"of the measured peak at the safe size")

    def worst(self, estimated_bytes: float) -> float:
        """The largest measured peak the bound allows for an estimate (bytes): ``estimated / (1 + min(low, 0))``."""
        return estimated_bytes / (1 + min(self.low, 0.0))


# Fewer than two calibrations to learn from: the leave-one-out errors of the project's host calibrations
BENCH_BOUND = ErrorBound(-0.038, 0.043, 9, "the project's benchmark (9 host calibrations of 5 models; "
                                           "`python -m bench.estimate --bound`)")
# A card with fewer than two GPU profiles: bench/README.md, "Estimates on a card"
GPU_BOUND = ErrorBound(-0.028, -0.004, 5, "5 published GPU runs (BERT-large on a V100; `python -m bench.published`)")
DEFAULT_BOUNDS = {Kind.HOST: BENCH_BOUND, Kind.CUDA: GPU_BOUND}


@dataclass(frozen=True)
class Calibrated:
    """One verified profile held against the trace of its own model (bytes; batch sizes in samples); ``device``:
    its name ("" unknown); ``settings``: the :data:`BASELINE_SETTINGS` its trials ran with."""

    path: str
    kind: Kind
    overhead_bytes: float
    data_bytes: int
    safe_batch_size: int
    safe_peak_bytes: int
    trace_overhead_bytes: float
    trace_slope_bytes_per_sample: float
    device: str = ""
    settings: Mapping[str, str | None] = field(default_factory=dict)
    repeat: float = 0.0  # the widest relative spread of its repeated trials at one batch size

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))

    @property
    def baseline_bytes(self) -> float:
        """``overhead − data − trace_overhead``."""
        return self.overhead_bytes - self.data_bytes - self.trace_overhead_bytes

    def error(self, baseline_bytes: float) -> float:
        """``estimated_peak(safe) / measured_peak(safe) − 1`` with ``baseline_bytes`` (module docstring)."""
        estimated = (baseline_bytes + self.data_bytes + self.trace_overhead_bytes
                     + self.trace_slope_bytes_per_sample * self.safe_batch_size)
        return estimated / self.safe_peak_bytes - 1


def learned_baseline(calibrated: Sequence[Calibrated], kind: Kind, leave_out: str | None = None,
                     device: str | None = None, settings: Mapping[str, str | None] | None = None) -> Baseline:
    """The median baseline of the ``calibrated`` of ``kind`` (but ``leave_out``) made under the weightiest of
    ``settings`` (torch's build: :func:`_same_build`), on ``device`` first, then under the rest of ``settings``; with
    none, :data:`HOST_BASELINE`, :data:`HOST_CUDA_BUILD_BASELINE` or :data:`CUDA_BASELINE`. Its source names the
    settings it was learned under that differ from ``settings``."""
    wanted = dict(settings or {})
    pool = [c for c in _same_build(calibrated, kind, wanted) if c.path != leave_out]
    if not pool:
        default = DEFAULT_BASELINES[kind, "+cu" in str(wanted.get("torch"))]
        others = sorted({shown_setting(c.settings.get("torch")) for c in calibrated if c.kind == kind})
        unlike = _unlike([default.settings], wanted) + (
            f"; the profiles of torch {' and '.join(others)} here left out: another build's process holds another "
            f"amount" if others and default is not CUDA_BASELINE else "")
        return Baseline(default.bytes, default.source + unlike, default.settings) if unlike else default

    def rank(c: Calibrated) -> tuple[bool, ...]:  # the weightiest setting, the device, the other settings
        alike = [c.settings.get(name) == value for name, value in wanted.items()]
        return (*alike[:1], bool(device) and c.device == device, *alike[1:])

    best = max(map(rank, pool))
    chosen = [c for c in pool if rank(c) == best]
    where = "of this device" if device and chosen[0].device == device else "of this kind of device"
    source = f"the median of {len(chosen)} calibration{'s' * (len(chosen) != 1)} {where} here"
    return Baseline(int(statistics.median([c.baseline_bytes for c in chosen])),
                    source + _unlike([c.settings for c in chosen], wanted))


def _same_build(calibrated: Sequence[Calibrated], kind: Kind, wanted: Mapping[str, str | None]) -> list[Calibrated]:
    """The ``calibrated`` of ``kind`` made under the weightiest of ``wanted`` (its first :data:`BASELINE_SETTINGS`,
    torch's build) where ``wanted`` names it: another build's process holds another amount (a CUDA build's host
    worker twice a CPU build's), which no bound learned from them covers (bench/results/estimate-builds: −41 %)."""
    first = BASELINE_SETTINGS[kind][0]
    return [c for c in calibrated if c.kind == kind and (first not in wanted or c.settings.get(first) == wanted[first])]


def _unlike(made: Sequence[Mapping[str, str | None]], wanted: Mapping[str, str | None]) -> str:
    """``, made with torch '2.13.0+cpu' where a worker now gets ...`` for each of ``wanted`` recorded otherwise."""
    differ = [f"{name} {' or '.join(sorted(unlike))} where a worker now gets {shown_setting(value)}"
              for name, value in wanted.items()
              if (unlike := {shown_setting(m[name]) for m in made if name in m and m[name] != value})]
    return (f", made with {' and '.join(differ)}: a process's baseline moves with them (not in the bound)"
            if differ else "")


def leave_one_out(calibrated: Sequence[Calibrated], kind: Kind) -> list[tuple[Calibrated, float]]:
    """Each profile of ``kind`` with its error against the baseline the others give it (:func:`learned_baseline`)."""
    mine = [c for c in calibrated if c.kind == kind]
    return [(c, c.error(learned_baseline(mine, kind, leave_out=c.path, device=c.device, settings=c.settings).bytes))
            for c in mine]


# The fewest calibrations a bound is learned from: two leave-one-out errors are two numbers, not a spread (two
# learners taught −0.20 % to −0.02 % and a held-out trial landed at +0.07 %: bench/results/estimate-builds)
LEARNED_FROM = 3


def learned_bound(calibrated: Sequence[Calibrated], kind: Kind,
                  settings: Mapping[str, str | None] | None = None) -> ErrorBound:
    """The bound of :func:`leave_one_out`'s errors over the calibrations of ``settings``' build (:func:`_same_build`),
    never narrower than their repeated trials spread (a held-out trial repeats with that noise: bench/results/
    estimate-builds); with fewer than :data:`LEARNED_FROM`, :data:`BENCH_BOUND` or :data:`GPU_BOUND`."""
    pool = _same_build(calibrated, kind, dict(settings or {}))
    errors = [error for _, error in leave_one_out(pool, kind)]
    if len(errors) < LEARNED_FROM:
        return DEFAULT_BOUNDS[kind]
    noise = max(c.repeat for c in pool)
    return ErrorBound(min(*errors, -noise), max(*errors, noise), len(errors), f"the {len(errors)} calibrations here")


@dataclass(frozen=True)
class EstimatedLimits:
    """A card's estimated limits (bytes; batch sizes in samples, 0: none fits): ``peak_bytes`` at the safe size and
    ``worst_bytes`` the bound allows there; ``fixed_bytes = baseline + data + trace_overhead``; ``path``: a card row's
    kernel path ("" host or a user's factory); ``asked``: :func:`peak_at` the batch size asked, or None."""

    card: str
    total_bytes: int
    usable_bytes: int
    safe_batch_size: int
    conservative_batch_size: int
    peak_bytes: int
    worst_bytes: int
    fixed_bytes: int
    slope_bytes_per_sample: float
    baseline: Baseline
    bound: ErrorBound
    path: str = ""
    asked: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"card": self.card, "path": self.path, "at_batch_size": self.asked, "total_bytes": self.total_bytes,
                "usable_bytes": self.usable_bytes,
                "safe_batch_size": self.safe_batch_size, "conservative_batch_size": self.conservative_batch_size,
                "peak_bytes": self.peak_bytes, "worst_bytes": self.worst_bytes, "fixed_bytes": self.fixed_bytes,
                "slope_bytes_per_sample": self.slope_bytes_per_sample, "measured": False, "verified": False,
                "baseline": {"bytes": self.baseline.bytes, "source": self.baseline.source},
                "bound": {"low": self.bound.low, "high": self.bound.high, "n": self.bound.n,
                          "source": self.bound.source, "says": self.bound.says()}}


def estimated_limits(card: str, total_bytes: int, trace: tuple[float, float], data_bytes: int,
                     settings: LimitSettings, baseline: Baseline, bound: ErrorBound) -> EstimatedLimits:
    """The estimated limits (module docstring) on a card of ``total_bytes`` for ``trace``, ``(overhead_bytes,
    slope_bytes_per_sample)``, and ``data_bytes`` in the measured memory.

    Raises:
        ValueError: a line that does not rise (no limit follows from it).
    """
    overhead, slope = trace
    if slope <= 0:
        raise ValueError(f"the traced step's memory does not rise with the batch size ({slope:.0f} bytes per sample): "
                         f"no limit follows from it")
    usable = settings.usable_bytes(total_bytes)
    fixed = baseline.bytes + data_bytes + overhead
    budget = usable * (1 + min(bound.low, 0.0))
    safe = max(0, math.floor((budget - fixed) / slope))
    peak = fixed + slope * safe
    return EstimatedLimits(card, total_bytes, usable, safe, math.floor(settings.conservative_fraction * safe),
                           int(peak), int(bound.worst(peak)), int(fixed), slope, baseline, bound)


def peak_at(estimate: StepEstimate, batch_size: int, baseline: Baseline, data_bytes: int, usable_bytes: int,
            bound: ErrorBound) -> dict[str, Any]:
    """The predicted peak at ``batch_size`` in parts (bytes): the step's allocated and reserved lines, baseline and
    data; ``peak_bytes`` their sum, ``worst_bytes`` the bound's largest, ``fits``: ``worst_bytes <= usable_bytes``."""
    sizes = [p.batch_size for p in estimate.points]
    allocated = line(sizes, [p.allocated_peak_bytes if estimate.device_kind.cuda_kernels else p.peak_bytes
                             for p in estimate.points])
    reserved = estimate.predict(batch_size)
    peak = baseline.bytes + data_bytes + reserved
    return {"batch_size": batch_size, "allocated_bytes": int(allocated[0] + allocated[1] * batch_size),
            "reserved_bytes": int(reserved), "baseline_bytes": baseline.bytes, "data_bytes": data_bytes,
            "peak_bytes": int(peak), "worst_bytes": int(bound.worst(peak)), "usable_bytes": usable_bytes,
            "fits": bound.worst(peak) <= usable_bytes}


Trace = Callable[..., StepEstimate]  # (ref, options, kind=Kind.HOST, card=None) -> StepEstimate
_TRACED: dict[str, StepEstimate] = {}  # this process's traces (the disk's are vramcal.estimate.cache's)


# What a GPU-only model (bf16 autocast) is checked against for an estimate; each card gives its total
ANY_GPU = Device(kind="cuda", name="a GPU (estimated)", total_bytes=0, total_source="none: an estimate's stand-in")


def _trace(ref: ModelRef, options: dict[str, Any], kind: Kind = Kind.HOST, card: Any = None) -> StepEstimate:
    found = key(ref, options, kind, card)
    if found not in _TRACED:
        _TRACED[found] = cached_trace(ref, options, kind, card)
    return _TRACED[found]


def held_against(profiles: Iterable[tuple[Path | str, Profile]], trace: Trace = _trace,
                 cache: dict[str, StepEstimate] | None = None) -> tuple[list[Calibrated], list[str]]:
    """The profiles that can teach the estimate, each held against its model's trace (one per model and card or
    host, kept in ``cache``; a GPU profile's as its card), and a notice for each one passed over."""
    cache = {} if cache is None else cache
    found, notices = [], []
    for path, profile in profiles:
        why = _unusable(profile)
        if why:
            notices.append(f"{path}: not learned from ({why})")
            continue
        key = f"{profile.model.key()}-{profile.device.name if profile.device.kind == 'cuda' else 'host'}"
        try:
            if key not in cache:
                cache[key] = trace(profile.model, traced_options(profile), profile.device.kind, _card(profile.device))
        except (EstimateError, WorkloadError, ValueError) as error:
            notices.append(f"{path}: not learned from ({error})")
            continue
        overhead, slope = cache[key].overhead_bytes, cache[key].slope_bytes_per_sample
        check = profile.verification["safe"]
        found.append(Calibrated(str(path), profile.device.kind, profile.fit.overhead_bytes, profile.pool_data_bytes,
                                check.batch_size, check.peak_bytes, overhead, slope, profile.device.name,
                                settings_of(profile), trials_spread(profile.trials) or 0.0))
    return found, notices


def _unusable(profile: Profile) -> str | None:
    """Why a profile cannot teach the estimate, or None."""
    check = profile.verification.get("safe")
    if profile.fit is None or profile.limits is None or check is None or not check.passed or not check.peak_bytes:
        return "no verified safe size"
    if profile.world is not None or profile.surface is not None:
        return "a DDP world or several lengths: the estimate is of one process at one length"
    if not profile.device.kind.cuda_kernels and profile.model.params.get("dtype", "fp32") != "fp32":
        return f"{profile.model.params.get('dtype')} on the host: the host trains in fp32"
    return None


def traced_options(profile: Profile) -> dict[str, Any]:
    """The factory options of ``profile``'s trials, synthetic bars for the data (the shapes, not the file)."""
    options = dict(profile.data.get("options", {}))
    if "data" in options:
        options["data"] = None
    return options


def describe_estimate(estimate: StepEstimate, baseline: Baseline, data_bytes: int) -> str:
    """``peak ≈ 0.53 GiB + 14.37 MiB × batch_size (baseline ...; data ...; the step's own ...)``."""
    overhead, slope = estimate.overhead_bytes, estimate.slope_bytes_per_sample
    return (f"peak ≈ {format_bytes(baseline.bytes + data_bytes + overhead)} + {format_bytes(slope)} × batch_size "
            f"(baseline {format_bytes(baseline.bytes)}: {baseline.source}; data {format_bytes(data_bytes)}; the step's "
            f"own {format_bytes(overhead)})")


@dataclass(frozen=True)
class CardEstimate:
    """A model's estimate on several cards (:func:`estimate_cards`): the traces (one per kernel path, then the
    host's), a row per card and path (the host last), the formulas for people and the notices."""

    estimates: tuple[StepEstimate, ...]
    rows: tuple[EstimatedLimits, ...]
    formulas: tuple[str, ...]
    notices: tuple[str, ...]

    @property
    def estimate(self) -> StepEstimate:
        return self.estimates[0]

    def describe(self) -> str:
        """The traced model, for people."""
        return describe(self.estimate.model.without("implementation"))

    def to_dict(self) -> dict[str, Any]:
        return {"estimated": True, "verified": False, "model": self.estimate.model.to_dict(),
                "kernel_path": self.estimate.kernel_path, "traces": [e.to_dict() for e in self.estimates],
                "cards": [row.to_dict() for row in self.rows], "notices": list(self.notices)}


def profiles_in(profiles_dir: Path | str) -> tuple[list[tuple[Path, Profile]], list[str]]:
    """The readable profiles under ``profiles_dir`` with their paths, and a notice for each file that is not one."""
    found, unreadable = profiles_under(profiles_dir)
    return [(p.path, p) for p in found], [f"{path}: not learned from ({why})" for path, why in unreadable]


def _card(device: Any) -> Any:
    from vramcal.estimate.card import Card  # loads torch: only when called

    return Card.of(device)


def paths(ref: ModelRef) -> list[ModelRef]:
    """The kernel paths a card's rows show: both of a family's, or ``ref`` alone (a user's factory)."""
    if ref.params.get("implementation") not in ("transformers", "mamba_ssm", "auto"):
        return [ref]
    return [ref.replace(implementation="transformers"), ref.replace(implementation="mamba_ssm")]


def installed_path() -> str:
    """The path ``--impl auto`` runs with this install (:func:`vramcal.models.mamba2.mamba_ssm_available`)."""
    return "mamba_ssm" if mamba_ssm_available() else "transformers"


def estimate_cards(ref: ModelRef, options: dict[str, Any], *, cards: Sequence[Any], host: Any = None,
                   settings: LimitSettings = LimitSettings(), profiles_dir: Path | str = Path("profiles"),
                   trace: Trace = _trace, batch_size: int | None = None,
                   refs: Sequence[ModelRef] | None = None) -> CardEstimate:
    """The estimated limits of ``ref`` on each of ``cards`` (:class:`vramcal.report.catalogue.GpuModel`) per kernel
    path (``refs``, default :func:`paths`) and on ``host`` (a :class:`~vramcal.records.Device`, or None), learned
    from the profiles under ``profiles_dir``; with ``batch_size``, each row's :func:`peak_at` there.

    Raises:
        EstimateError: no path can be traced (one line; probe it instead). ValueError: a step whose traced memory
            does not rise with the batch size.
    """
    loaded, notices = profiles_in(profiles_dir)
    calibrated, passed_over = held_against(loaded, trace, {})
    estimates, rows, formulas = [], [], []
    for each in (refs or paths(ref)) if cards else []:
        try:
            traced, found, said = _gpu_rows(each, options, cards, calibrated, settings, batch_size, trace)
        except EstimateError as error:
            if each.params.get("implementation") != "mamba_ssm":
                raise
            notices.append(f"mamba_ssm: {error}")
            continue
        estimates, rows, formulas = estimates + traced, rows + found, formulas + said
    if host is not None:
        estimate = trace(ref.replace(implementation="transformers") if ref.params.get("implementation") else ref,
                         options)
        made_as = baseline_settings(Kind.HOST)
        baseline = learned_baseline(calibrated, Kind.HOST, device=host.name, settings=made_as)
        bound = learned_bound(calibrated, Kind.HOST, made_as)
        rows += _rows(estimate, Kind.HOST, [(f"host: {host.name}", host.total_bytes)], settings, batch_size, "",
                      baseline, bound)
        estimates.append(estimate)
        formulas += [f"the host: {describe_estimate(estimate, baseline, estimate.data_bytes)}", f"  {bound.says()}"]
    if cards and not any(c.kind.cuda_kernels for c in calibrated):
        notices.append("no GPU profile to learn from: the GPU rows' baseline is the CUDA context's published size (the "
                       "kernels a step loads into the context are not in it) and their bound the published GPU runs'")
    return CardEstimate(tuple(estimates), tuple(rows), tuple(formulas), tuple(notices + passed_over))


def _gpu_rows(ref: ModelRef, options: dict[str, Any], cards: Sequence[Any], calibrated: list[Calibrated],
              settings: LimitSettings, batch_size: int | None,
              trace: Trace) -> tuple[list[StepEstimate], list[EstimatedLimits], list[str]]:
    """One kernel path's traces (:func:`_card_traces`), its rows in the order of ``cards`` and its formulas.

    Raises:
        EstimateError: the path cannot be traced.
    """
    path = ref.params.get("implementation") if ref.params.get("implementation") in ("transformers", "mamba_ssm") else ""
    runs = " (this install runs it)" if path and path == installed_path() else ""
    traced, rows, formulas = _card_traces(ref, options, cards, trace), [], []
    made_as = baseline_settings(Kind.CUDA)
    baseline = learned_baseline(calibrated, Kind.CUDA, settings=made_as)
    bound = learned_bound(calibrated, Kind.CUDA, made_as)
    for estimate, group in traced:
        label = f"{path}{runs}" if path else estimate.kernel_path
        rows += _rows(estimate, Kind.CUDA, [(c.label, c.total_bytes) for c in group], settings, batch_size, path,
                      baseline, bound)
        named = "a GPU" if len(traced) == 1 else ", ".join(c.label for c in group)
        formulas += [f"{named}, {label}: {describe_estimate(estimate, baseline, 0)}",
                     *(f"  as the card runs it: {choice}" for choice in estimate.choices), f"  {bound.says()}"]
    order = [c.label for c in cards]
    return [e for e, _ in traced], sorted(rows, key=lambda row: order.index(row.card)), formulas


def _card_traces(ref: ModelRef, options: dict[str, Any], cards: Sequence[Any],
                 trace: Trace) -> list[tuple[StepEstimate, list[Any]]]:
    """``ref`` traced as each of ``cards`` runs it, once per group of cards that answer alike what the trace asked
    of its card (``StepEstimate.traits``: the cuBLAS workspace, the compute capability, the SM count): each trace
    with its cards, in their order."""
    found, left = [], list(cards)
    while left:
        card = _card(left[0])
        estimate = trace(ref, options, Kind.CUDA, card)
        group = [c for c in left if card.traces_as(_card(c), estimate.traits)]
        found.append((estimate, group))
        left = [c for c in left if c not in group]
    return found


def _rows(estimate: StepEstimate, kind: Kind, targets: list[tuple[str, int]], settings: LimitSettings,
          batch_size: int | None, path: str, baseline: Baseline, bound: ErrorBound) -> list[EstimatedLimits]:
    """One row per target (label, total bytes) of a trace on ``kind``, with the baseline and bound learned for it."""
    data = estimate.data_bytes if kind.holds_data else 0
    found = []
    for label, total in targets:
        row = estimated_limits(label, total, (estimate.overhead_bytes, estimate.slope_bytes_per_sample), data,
                               settings, baseline, bound)
        asked = None if batch_size is None else peak_at(estimate, batch_size, baseline, data, row.usable_bytes, bound)
        found.append(dataclasses.replace(row, path=path, asked=asked))
    return found


def aim_for(ref: ModelRef, options: dict[str, Any], device: Device, profiles_dir: Path | str,
            trace: Trace = _trace, listed: Any = None) -> tuple[Aim | None, str | None]:
    """The :class:`Aim` a calibration of ``device`` may take for its growth (the traced slope, as that card runs it,
    its SM count ``listed``'s where the catalogue has the card, and the bound learned under ``profiles_dir``), or
    ``(None, why not)``: the search then climbs from batch size 1."""
    kind = device.kind
    try:
        estimate = trace(ref, options, kind, _card(device if listed is None else listed))
    except (EstimateError, WorkloadError, ValueError) as error:
        return None, f"not aimed (the search climbs from batch size 1): {error}"
    bound = learned_bound(held_against(profiles_in(profiles_dir)[0], trace)[0], kind, baseline_settings(kind))
    slope = estimate.slope_bytes_per_sample
    if slope <= 0:
        return None, "not aimed: the traced step's memory does not rise with the batch size"
    return Aim(slope, bound.low, bound.high, f"the fake-tensor trace; its bound learned on {bound.source}"), None
