"""Limits estimated, not measured: a model's batch sizes on a card you do not have, with an error bound learned from
the calibrations you do have.

The step is traced on fake tensors (:func:`vramcal.estimate.estimate_step`: no GPU, no real tensors), which gives
the step's own bytes as a line, ``trace_overhead + trace_slope × batch_size`` (model states; activations and
temporaries per sample). What fake tensors cannot see is the process's own baseline (libraries, allocator arenas,
on a GPU the CUDA context and workspaces) and the dataset a process holds in the measured memory, so::

    estimated_peak(b) = baseline + data_bytes + trace_overhead + trace_slope × b

On a CUDA card the step is traced as the card runs it (:mod:`vramcal.estimate.card`, :mod:`vramcal.estimate.fused`),
in the caching allocator's reserved bytes, its cuBLAS workspaces included; on the host, in live bytes. A card has a
row per kernel path of a family's model (``transformers``, ``mamba_ssm``), the one this install runs named.

**The baseline** is learned from the profiles at hand: for each verified profile,
``fit.overhead − pool_data_bytes − trace_overhead`` of its own model; the estimate takes their median over the same
device where some were made there (another machine's libraries and allocator hold another amount), else over the
same kind of device. Before the device come the profiles made under the settings a baseline moves with
(:data:`BASELINE_SETTINGS`: torch's build; on the host the thread setting a worker gets), and a baseline learned
under others, or a stated default where there is none
(:data:`HOST_BASELINE`; on a card its CUDA context, :data:`CUDA_BASELINE`), says so.

**The bound.** Each such profile is held against the estimate of its own model with the baseline learned from the
*other* profiles (leave-one-out): ``error = estimated_peak(safe) / measured_peak(safe) − 1`` at its verified safe
size. The spread of those errors is the bound an estimate carries ("on the 4 calibrations here this estimate was
−3.1 % to +2.2 % of the measured peak at the safe size"); with fewer than two profiles to learn from it is the
project's benchmark's, said as such: the host's (:data:`BENCH_BOUND`) for the host, a GPU's
(:data:`GPU_BOUND`) for a card: a GPU row never carries the host's bound.

**Estimated limits** (:func:`estimated_limits`) hold the worst error against the estimate: the measured peak may
be as much as ``estimated / (1 + low)`` where ``low`` is the bound's lowest error (the estimate's largest
under-prediction; an estimate that only ever over-predicted is not lowered), so::

    safe = floor((usable × (1 + min(low, 0)) − baseline − data_bytes − trace_overhead) / trace_slope)
    conservative = floor(conservative_fraction × safe)

with ``usable`` as a calibration's (:meth:`vramcal.calibration.limits.LimitSettings.usable_bytes`). An estimate is
never verified: every line that shows one says it is an estimate and gives its bound.
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
from vramcal.estimate.constants import CONTEXT
from vramcal.estimate.result import line
from vramcal.models.mamba2 import mamba_ssm_available
from vramcal.models.registry import describe
from vramcal.profile import Profile, profiles_under
from vramcal.records import Device, DeviceKind
from vramcal.sizing.staleness import recorded_software
from vramcal.units import format_bytes
from vramcal.workload import ModelRef, WorkloadError

MIB = 2**20


@dataclass(frozen=True)
class Baseline:
    """What a process of a kind of device holds that a fake trace cannot see (bytes), and where the figure comes
    from, for people; ``settings``: the :data:`BASELINE_SETTINGS` a stated default was measured under."""

    bytes: int
    source: str
    settings: Mapping[str, str | None] = field(default_factory=dict)


# What a process's baseline moves with besides its device, weightiest first (the tiny spec's worker at batch_size 1):
# torch's build (CUDA build 1.00 GiB, CPU build 0.48 GiB on the host; a card's CUDA context moves with its CUDA), and
# on the host OMP_NUM_THREADS (each OpenMP thread's arena and stack: 484 MiB with two threads, 402 MiB with one).
BASELINE_SETTINGS: dict[DeviceKind, tuple[str, ...]] = {"host": ("torch", "OMP_NUM_THREADS"), "cuda": ("torch",)}


def baseline_settings(kind: DeviceKind) -> dict[str, str | None]:
    """The :data:`BASELINE_SETTINGS` of ``kind`` a worker started now runs with (torch: its version with its build)."""
    return {name: software_versions()["torch"] if name == "torch" else worker_setting(name)
            for name in BASELINE_SETTINGS[kind]}


def settings_of(profile: Profile) -> dict[str, str | None]:
    """The :data:`BASELINE_SETTINGS` of ``profile``'s kind of device its trials ran with, those it recorded."""
    torch = recorded_software(profile).get("torch")
    made = {**profile.environment, **({"torch": torch} if torch else {})}
    return {name: made[name] for name in BASELINE_SETTINGS[profile.device.kind] if name in made}


# The host: the median over the project's own host calibrations (the profiles of examples/measured/profiles/ and the
# vramcal rounds of bench/results/; `python -m bench.estimate --bound`): 497-632 MiB, torch 2.13's CPU build.
HOST_BASELINE = Baseline(569 * MIB, "the project's host calibrations (no host profile here to learn from)",
                         {"torch": "2.13.0+cpu", "OMP_NUM_THREADS": None})
# A CUDA card without a GPU profile to learn from: its CUDA context, outside the trace (the workspaces are in it)
CUDA_BASELINE = Baseline(CONTEXT, f"the CUDA context, {CONTEXT // MIB} MiB with lazy module loading (published "
                                  f"figures: vramcal/estimate/constants.py; no GPU profile here to learn from)")


@dataclass(frozen=True)
class ErrorBound:
    """How wrong the estimate was where it could be held against measurements: ``low`` and ``high`` are the
    smallest and largest ``estimated / measured − 1`` of the peak at the safe size, over ``n`` calibrations;
    ``source`` says which."""

    low: float
    high: float
    n: int
    source: str

    def says(self) -> str:
        """The bound for people: ``estimated, not measured: on ... this estimate was −3.1 % to +2.2 % ...``."""
        return (f"estimated, not measured: on {self.source} this estimate was {self.low:+.1%} to {self.high:+.1%} "
                f"of the measured peak at the safe size")

    def worst(self, estimated_bytes: float) -> float:
        """The largest measured peak the bound allows for an estimate (bytes): ``estimated / (1 + min(low, 0))``."""
        return estimated_bytes / (1 + min(self.low, 0.0))


# With fewer than two calibrations to learn from: the leave-one-out errors over the project's own host calibrations
# (the same 9 as HOST_BASELINE, of 5 models: `python -m bench.estimate --bound`).
BENCH_BOUND = ErrorBound(-0.038, 0.043, 9, "the project's benchmark (9 host calibrations of 5 models; "
                                           "`python -m bench.estimate --bound`)")


# A card with fewer than two GPU profiles to learn from: the errors of the estimate against published GPU measurements
# of fully specified training runs (`python -m bench.published`: 5 runs of BERT-large on a V100, transformers' docs,
# nvidia-smi, each row's published CUDA context as its baseline: -2.8 % to -0.4 %; bench/README.md, "Estimates on a
# card"). The rows test the trace and the allocator's model, not the context a card's row assumes without a profile.
GPU_BOUND = ErrorBound(-0.028, -0.004, 5, "5 published GPU runs (BERT-large on a V100; `python -m bench.published`)")


@dataclass(frozen=True)
class Calibrated:
    """One verified profile held against the estimate of its own model (bytes; batch sizes in samples).

    Attributes:
        path: the profile's file. kind: its device kind.
        overhead_bytes: its fit's overhead. data_bytes: the data its trials held in the measured memory.
        safe_batch_size, safe_peak_bytes: its verified safe size and that verification's measured peak.
        trace_overhead_bytes, trace_slope_bytes_per_sample: the traced line of its model (on its kind of device).
        device: the device's name ("" when unknown): a baseline is learned from the same device where it can be.
        settings: the :data:`BASELINE_SETTINGS` its trials ran with (``OMP_NUM_THREADS`` None: unset).
    """

    path: str
    kind: DeviceKind
    overhead_bytes: float
    data_bytes: int
    safe_batch_size: int
    safe_peak_bytes: int
    trace_overhead_bytes: float
    trace_slope_bytes_per_sample: float
    device: str = ""
    settings: Mapping[str, str | None] = field(default_factory=dict)

    @property
    def baseline_bytes(self) -> float:
        """What its process held beyond the trace and the data: ``overhead − data − trace_overhead``."""
        return self.overhead_bytes - self.data_bytes - self.trace_overhead_bytes

    def error(self, baseline_bytes: float) -> float:
        """``estimated_peak(safe) / measured_peak(safe) − 1`` with ``baseline_bytes`` (module docstring)."""
        estimated = (baseline_bytes + self.data_bytes + self.trace_overhead_bytes
                     + self.trace_slope_bytes_per_sample * self.safe_batch_size)
        return estimated / self.safe_peak_bytes - 1


def learned_baseline(calibrated: Sequence[Calibrated], kind: DeviceKind, leave_out: str | None = None,
                     device: str | None = None, settings: Mapping[str, str | None] | None = None) -> Baseline:
    """The median baseline of ``calibrated`` (without the one at ``leave_out``) of ``kind`` that match best: made under
    the weightiest of ``settings`` (:data:`BASELINE_SETTINGS`; None: not compared), then on ``device``, then under
    the rest; with none, the stated default of ``kind`` (:data:`HOST_BASELINE`, :data:`CUDA_BASELINE`). The source
    names the settings it was learned under that differ from ``settings`` (module docstring)."""
    wanted = dict(settings or {})
    pool = [c for c in calibrated if c.kind == kind and c.path != leave_out]
    if not pool:
        default = HOST_BASELINE if kind == "host" else CUDA_BASELINE
        unlike = _unlike([default.settings], wanted)
        return Baseline(default.bytes, default.source + unlike, default.settings) if unlike else default

    def rank(c: Calibrated) -> tuple[bool, ...]:  # the weightiest setting, the device, the other settings
        alike = [c.settings.get(name) == value for name, value in wanted.items()]
        return (*alike[:1], bool(device) and c.device == device, *alike[1:])

    best = max(map(rank, pool))
    chosen = [c for c in pool if rank(c) == best]
    where = "of this device" if device and chosen[0].device == device else "of this kind of device"
    source = f"the median of {_count(len(chosen), 'calibration')} {where} here"
    return Baseline(int(statistics.median([c.baseline_bytes for c in chosen])),
                    source + _unlike([c.settings for c in chosen], wanted))


def _unlike(made: Sequence[Mapping[str, str | None]], wanted: Mapping[str, str | None]) -> str:
    """``, made with torch '2.13.0+cpu' where a worker now gets '2.13.0+cu130': ...`` for each of ``wanted`` that
    some of ``made`` recorded otherwise ("": none)."""
    differ = [f"{name} {' or '.join(sorted(unlike))} where a worker now gets {shown_setting(value)}"
              for name, value in wanted.items()
              if (unlike := {shown_setting(m[name]) for m in made if name in m and m[name] != value})]
    return (f", made with {' and '.join(differ)}: a process's baseline moves with them (not in the bound)"
            if differ else "")


def leave_one_out(calibrated: Sequence[Calibrated], kind: DeviceKind) -> list[tuple[Calibrated, float]]:
    """Each profile of ``kind`` with its leave-one-out error (module docstring): the estimate with the baseline the
    others give it (:func:`learned_baseline`: those of its own settings and device first)."""
    mine = [c for c in calibrated if c.kind == kind]
    return [(c, c.error(learned_baseline(mine, kind, leave_out=c.path, device=c.device, settings=c.settings).bytes))
            for c in mine]


def learned_bound(calibrated: Sequence[Calibrated], kind: DeviceKind) -> ErrorBound:
    """The leave-one-out errors (module docstring) of the profiles of ``kind``: each held against the estimate
    with the baseline of the others; with fewer than two, :data:`BENCH_BOUND` (host) or :data:`GPU_BOUND` (card)."""
    errors = [error for _, error in leave_one_out(calibrated, kind)]
    if len(errors) < 2:
        return BENCH_BOUND if kind == "host" else GPU_BOUND
    return ErrorBound(min(errors), max(errors), len(errors), f"the {len(errors)} calibrations here")


@dataclass(frozen=True)
class EstimatedLimits:
    """A card's estimated limits (module docstring): bytes; batch sizes in samples.

    Attributes:
        card, total_bytes, usable_bytes: the card and its memory.
        safe_batch_size, conservative_batch_size: the estimated limits (0: not one sample fits).
        peak_bytes: the estimated peak at the safe size; worst_bytes: the largest the bound allows there.
        fixed_bytes: ``baseline + data_bytes + trace_overhead``; slope_bytes_per_sample: the trace's slope.
        baseline, bound: what the estimate rests on.
        path: the kernel path of a card's row (``transformers``, ``mamba_ssm``; "" for the host or a user's factory).
        asked: the predicted peak at the batch size asked (:func:`peak_at`), or None.
    """

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
    """The estimated limits on a card of ``total_bytes`` (module docstring) for a traced line ``trace``
    (``(overhead_bytes, slope_bytes_per_sample)``) and ``data_bytes`` held in the card's measured memory.

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
    """The predicted peak at ``batch_size`` (bytes), its parts apart: the step's allocated and reserved bytes (the
    lines through the traced points' ``allocated_peak_bytes`` and ``peak_bytes``: on a card the caching allocator's,
    its cuBLAS workspaces in them), the baseline (on a card its CUDA context) and the data; ``peak_bytes`` their sum,
    ``worst_bytes`` the largest the bound allows, ``fits``: ``worst_bytes <= usable_bytes``."""
    sizes = [p.batch_size for p in estimate.points]
    allocated = line(sizes, [p.allocated_peak_bytes if estimate.device_kind == "cuda" else p.peak_bytes
                             for p in estimate.points])
    reserved = estimate.predict(batch_size)
    peak = baseline.bytes + data_bytes + reserved
    return {"batch_size": batch_size, "allocated_bytes": int(allocated[0] + allocated[1] * batch_size),
            "reserved_bytes": int(reserved), "baseline_bytes": baseline.bytes, "data_bytes": data_bytes,
            "peak_bytes": int(peak), "worst_bytes": int(bound.worst(peak)), "usable_bytes": usable_bytes,
            "fits": bound.worst(peak) <= usable_bytes}


Trace = Callable[..., StepEstimate]  # (ref, options, kind="host", card=None) -> StepEstimate
_TRACED: dict[str, StepEstimate] = {}  # this process's traces (the disk's are vramcal.estimate.cache's)


# The device a GPU-only model (bf16 autocast) is checked against for an estimate: a CUDA GPU of unknown compute
# capability (every catalogued card has 8.0 or more, where bf16 runs), with no memory of its own (each card gives
# its total)
ANY_GPU = Device(kind="cuda", name="a GPU (estimated)", total_bytes=0, total_source="none: an estimate's stand-in")


def _trace(ref: ModelRef, options: dict[str, Any], kind: DeviceKind = "host", card: Any = None) -> StepEstimate:
    found = key(ref, options, kind, card)
    if found not in _TRACED:
        _TRACED[found] = cached_trace(ref, options, kind, card)
    return _TRACED[found]


def held_against(profiles: Iterable[tuple[Path | str, Profile]], trace: Trace = _trace,
                 cache: dict[str, StepEstimate] | None = None) -> tuple[list[Calibrated], list[str]]:
    """The profiles that can teach the estimate (verified, a fitted line, the torch path in fp32, a model that
    traces), each held against the trace of its model (one trace per model, kept in ``cache``), and a notice for
    each one passed over.

    The regressor's data file is replaced by synthetic bars of the same shape in the trace (the data do not change
    the step's bytes, and the profile says what its trials held); a profile made on a GPU is traced as its card.
    """
    cache = {} if cache is None else cache
    found, notices = [], []
    for path, profile in profiles:
        why = _unusable(profile)
        if why:
            notices.append(f"{path}: not learned from ({why})")
            continue
        key = f"{profile.model.key()}-{profile.device.kind}"
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
                                settings_of(profile)))
    return found, notices


def _unusable(profile: Profile) -> str | None:
    """Why a profile cannot teach the estimate, or None."""
    check = profile.verification.get("safe")
    if profile.fit is None or profile.limits is None or check is None or not check.passed or not check.peak_bytes:
        return "no verified safe size"
    if profile.world is not None or profile.surface is not None:
        return "a DDP world or several lengths: the estimate is of one process at one length"
    if profile.device.kind == "host" and profile.model.params.get("dtype", "fp32") != "fp32":
        return f"{profile.model.params.get('dtype')} on the host: the host trains in fp32"
    return None


def traced_options(profile: Profile) -> dict[str, Any]:
    """The factory options a trace of ``profile``'s model takes: its trials' own, synthetic bars for the data."""
    options = dict(profile.data.get("options", {}))
    if "data" in options:
        options["data"] = None  # synthetic bars: the trace needs the shapes, not the file (module docstring)
    return options


def describe_estimate(estimate: StepEstimate, baseline: Baseline, data_bytes: int) -> str:
    """``peak ≈ 0.53 GiB + 14.37 MiB × batch_size (baseline 512 MiB: ..., data ..., the step's own ...)``."""
    overhead, slope = estimate.overhead_bytes, estimate.slope_bytes_per_sample
    return (f"peak ≈ {format_bytes(baseline.bytes + data_bytes + overhead)} + {format_bytes(slope)} × batch_size "
            f"(baseline {format_bytes(baseline.bytes)}: {baseline.source}; data {format_bytes(data_bytes)}; the step's "
            f"own {format_bytes(overhead)})")


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


@dataclass(frozen=True)
class CardEstimate:
    """A model's estimate on several cards (:func:`estimate_cards`).

    Attributes:
        estimates: the traces, one per kernel path on the cards and one for the host, in the rows' order.
        rows: one per card and kernel path, the host last when asked.
        formulas: the estimated peak per trace, its choices and its bound, for people.
        notices: profiles not learned from, a path not estimated, which path this install runs.
    """

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
    """The readable profiles under ``profiles_dir`` (:func:`vramcal.profile.profiles_under`) with their paths, and
    a notice for each file that is not one."""
    found, unreadable = profiles_under(profiles_dir)
    return [(p.path, p) for p in found], [f"{path}: not learned from ({why})" for path, why in unreadable]


def _card(device: Any) -> Any:
    from vramcal.estimate.card import Card  # loads torch: only when called

    return Card.of(device)


def paths(ref: ModelRef) -> list[ModelRef]:
    """The kernel paths a card's rows show for ``ref``: both of a family's (``transformers``, ``mamba_ssm``), or the
    one a model names (a user's factory decides its own)."""
    if ref.params.get("implementation") not in ("transformers", "mamba_ssm", "auto"):
        return [ref]
    return [ref.replace(implementation="transformers"), ref.replace(implementation="mamba_ssm")]


def installed_path() -> str:
    """Which path a card would run with this install (``--impl auto``): mamba_ssm where it and causal_conv1d's CUDA
    build import (:func:`vramcal.models.mamba2.mamba_ssm_available`), else transformers."""
    return "mamba_ssm" if mamba_ssm_available() else "transformers"


def estimate_cards(ref: ModelRef, options: dict[str, Any], *, cards: Sequence[Any], host: Any = None,
                   settings: LimitSettings = LimitSettings(), profiles_dir: Path | str = Path("profiles"),
                   trace: Trace = _trace, batch_size: int | None = None,
                   refs: Sequence[ModelRef] | None = None) -> CardEstimate:
    """The estimated limits of ``ref`` on each of ``cards`` (:class:`vramcal.report.catalogue.GpuModel`: a label,
    ``total_bytes`` and the card's traits), for each kernel path (``refs``, default :func:`paths`), and on ``host`` (a
    host :class:`~vramcal.records.Device` at its budget, or None), learned from the profiles under ``profiles_dir``
    (module docstring); with ``batch_size``, each row's predicted peak there (:func:`peak_at`).

    Raises:
        EstimateError: no path can be traced (one line; probe it instead). ValueError: a step whose traced memory
            does not rise with the batch size.
    """
    loaded, notices = profiles_in(profiles_dir)
    calibrated, passed_over = held_against(loaded, trace, {})
    estimates, rows, formulas = [], [], []
    card = _card(cards[0]) if cards else None
    runs = installed_path()
    for each in (refs or paths(ref)) if cards else []:
        path = each.params.get("implementation", "") if each.params.get("implementation") in ("transformers",
                                                                                                "mamba_ssm") else ""
        try:
            estimate = trace(each, options, "cuda", card)
        except EstimateError as error:
            if path != "mamba_ssm":
                raise
            notices.append(f"mamba_ssm: {error}")
            continue
        label = f"{path}{' (this install runs it)' if path == runs else ''}" if path else estimate.kernel_path
        rows += _rows(estimate, "cuda", [(c.label, c.total_bytes) for c in cards], calibrated, settings, batch_size,
                      path)
        estimates.append(estimate)
        baseline = learned_baseline(calibrated, "cuda", settings=baseline_settings("cuda"))
        formulas += [f"a GPU, {label}: {describe_estimate(estimate, baseline, 0)}",
                     *(f"  as the card runs it: {choice}" for choice in estimate.choices),
                     f"  {learned_bound(calibrated, 'cuda').says()}"]
    if host is not None:
        estimate = trace(ref.replace(implementation="transformers") if ref.params.get("implementation") else ref,
                         options)
        baseline = learned_baseline(calibrated, "host", device=host.name, settings=baseline_settings("host"))
        rows += _rows(estimate, "host", [(f"host: {host.name}", host.total_bytes)], calibrated, settings, batch_size,
                      "", baseline)
        estimates.append(estimate)
        formulas += [f"the host: {describe_estimate(estimate, baseline, estimate.data_bytes)}",
                     f"  {learned_bound(calibrated, 'host').says()}"]
    if cards and not any(c.kind == "cuda" for c in calibrated):
        notices.append("no GPU profile to learn from: the GPU rows' baseline is the CUDA context's published size (the "
                       "kernels a step loads into the context are not in it) and their bound the published GPU runs'")
    return CardEstimate(tuple(estimates), tuple(rows), tuple(formulas), tuple(notices + passed_over))


def _rows(estimate: StepEstimate, kind: DeviceKind, targets: list[tuple[str, int]], calibrated: list[Calibrated],
          settings: LimitSettings, batch_size: int | None, path: str,
          baseline: Baseline | None = None) -> list[EstimatedLimits]:
    """One row per target (label, total bytes) of a trace on ``kind``."""
    baseline = baseline or learned_baseline(calibrated, kind, settings=baseline_settings(kind))
    bound, data = learned_bound(calibrated, kind), estimate.data_bytes if kind == "host" else 0
    found = []
    for label, total in targets:
        row = estimated_limits(label, total, (estimate.overhead_bytes, estimate.slope_bytes_per_sample), data,
                               settings, baseline, bound)
        asked = None if batch_size is None else peak_at(estimate, batch_size, baseline, data, row.usable_bytes, bound)
        found.append(dataclasses.replace(row, path=path, asked=asked))
    return found


def aim_for(ref: ModelRef, options: dict[str, Any], kind: DeviceKind, profiles_dir: Path | str,
            trace: Trace = _trace) -> tuple[Aim | None, str | None]:
    """What a calibration of ``ref`` on a device of ``kind`` may aim its growth with (:class:`Aim`: the traced
    slope and the bound learned from the profiles under ``profiles_dir``), or ``(None, why not)`` when the step
    cannot be traced: the search then climbs from batch size 1, as without an aim. A CUDA device's slope is the
    step traced as an H100 runs it, in the caching allocator's reserved bytes."""
    try:
        estimate = trace(ref, options, kind, _card(None) if kind == "cuda" else None)
    except (EstimateError, WorkloadError, ValueError) as error:
        return None, f"not aimed (the search climbs from batch size 1): {error}"
    bound = learned_bound(held_against(profiles_in(profiles_dir)[0], trace)[0], kind)
    slope = estimate.slope_bytes_per_sample
    if slope <= 0:
        return None, "not aimed: the traced step's memory does not rise with the batch size"
    return Aim(slope, bound.low, bound.high, f"the fake-tensor trace; its bound learned on {bound.source}"), None
