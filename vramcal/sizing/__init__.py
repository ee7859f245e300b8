"""Sizing: from a profile to the batch size a run uses and what the profile predicts for it — decided once.

Pure functions over a :class:`~vramcal.profile.Profile`; ``vramcal train``, ``vramcal tune``, the
Lightning callback and the public API all size through :func:`size`, and pass its :class:`Sizing` on.

The data term. A profile records the bytes of data its trials held in the measured memory
(``Profile.pool_data_bytes``: on the host, the whole dataset; on a GPU, only data placed on the device).
A run that holds more there has that much less for everything else, so every prediction adds
``delta = run's bytes − calibration's bytes``; when the safe size's verification peak plus ``delta`` no
longer fits, the safe size moves down until it does — along the fit from its verified peak (which measured
what the safe size holds; the fit, what a sample adds), or to where the fit's upper bound fits, whichever is
larger — and never above the profile's verified sizes:

    predicted(b) = max(overhead + slope × b, verified peak at b) + delta
    upper(b) = max(fit.upper(b), verified peak at b) + delta
    safe = min(profile safe, max(largest b with verified_peak − (predicted(safe) − predicted(b)) + delta ≤ usable,
                                 largest b with upper(b) ≤ usable))          conservative = ⌊fraction × safe⌋

(Before, only the upper bound's rule: 11.6 MiB more in a Lightning process took a profile's safe 152 to 117,
where the verified peak moved along the fit allows 149.)

The process term. A process that was not made like the trials' (a Lightning, Hugging Face or Accelerate
run; another allocator, more imports, loggers, a framework's own tensors) holds a different amount when
training starts. Its ``process_bytes`` — what it holds then, measured in it
(:func:`vramcal.measure.meters.attach_meter`) — against what the trials' processes held at the same point
(``Profile.held_bytes``, after the step was built) is ``delta`` the same way; it includes any data the process
holds, so it replaces the data term.

The gradient term. A trial frees the gradients after the optimizer step, before the next forward pass. A run
whose forward passes run beside gradients holds them on top of what the trials measured: accumulation (every
micro-batch after the first of an optimizer step) and Lightning's automatic optimization (it zeroes the
gradients between the forward and the backward pass of the next step). The profile records their bytes
(``model_info["gradient_bytes"]``, counted in the trial: every parameter that requires a gradient); such a run
adds them to ``delta`` the same way. The peak rises by at most that (the gradients are freed before the
backward pass allocates them again): an upper bound, measured on the host at +26 to +36 MiB for 25.5 MiB of
gradients in a Lightning step (a 6.7 M-parameter language model at batch 16, against its manual optimization).

An effective batch. A requested number of samples per optimizer step (``effective_batch_size``) is kept: the
micro-batch is the largest the profile allows (the ``limit``, or a request, within its bounds), and the
accumulation steps reach the effective batch (``ceil(effective / micro)``, the last micro-batch smaller;
``exact``: a micro-batch that divides it, as ``gradient_accumulation_steps`` frameworks need).

The gate. A profile describes its budget as it was; other processes may have taken memory since. Given what the
device has free before the run (``free_bytes``), ``missing = total − reserve − free``, when positive, is added to
the limits' delta (not to the prediction, which is of the run's own memory), so the limits come down along the
fit and a notice says how much is missing (the reserve covers what a driver and the system normally hold).

The warning line. The upper 95 % bound is the fit's: with points on a straight line it is a fraction of a percent
above the prediction, and correct runs cross it (measured: the trainer −0.7 to +0.5 %, the frameworks up to
+2.5 %). A run is warned above ``predicted × (1 + spread)`` instead (never below the upper bound), where the
spread is the widest of what repeats of the same run were measured to spread by: repeated trials of one batch
size in the calibration, the runs recorded in the profile (the range of their errors: a profile that
under-predicts every run by the same amount is still warned), and, as a floor, :data:`BENCH_SPREAD`, the
project's benchmark figure (said as such). :func:`repeat_spread`. A run whose process term was measured (a
framework's, :func:`extra_bytes`) is held against that line plus what the term itself may be off by
(:func:`process_spread`): the trials' own held bytes' range and how far repeats of one script held apart.

Sizing for throughput (``size_for="throughput"``): a run without a requested batch size takes the throughput
knee (:func:`throughput_choice`) when it lies below the limit and its rate differs measurably from the limit's
(their 95 % intervals apart), the limit otherwise; the memory limit stays the default.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from vramcal.calibration.fit2d import safe_batch_size_2d
from vramcal.calibration.limits import Limits, LimitSettings, safe_batch_size
from vramcal.calibration.surface import answer_at, limits_at, longest_at
from vramcal.calibration.throughput import NO_DIFFERENCE, find_knee, measured_rates, overlap, rate_at, rate_text
from vramcal.profile import Profile
from vramcal.records import Trial
from vramcal.units import format_bytes, format_rate
from vramcal.words import Info, given, word

Limit = Literal["conservative", "safe"]  # which of the profile's limits a run takes
LIMITS: tuple[str, ...] = ("conservative", "safe")
SizeFor = Literal["memory", "throughput"]  # what a run without a requested batch size is sized for
SIZE_FOR: tuple[str, ...] = ("memory", "throughput")
# where a batch size comes from: a limit of the profile, the throughput knee, the caller's request within the
# bounds, or the caller's request moved into them
Source = Literal["conservative", "safe", "knee", "requested", "clamped"]
# How far correct runs spread around their prediction in the project's benchmarks, rounded up: the trainer over
# 1,000 steps -0.7 to +0.5 % (bench.survival), Lightning, HF Trainer, Accelerate and plain PyTorch up to +2.5 %
# (bench.frameworks); the floor of the warning line (module docstring).
BENCH_SPREAD = 0.03
# How far what one framework script's process holds as training starts differs between repeats, rounded up: 3
# repeats each of Lightning, HF Trainer, Accelerate and plain PyTorch on the host held within 4-100 KiB of each
# other (bench.process_term, bench/results/process-term); a term of the warning line (process_spread).
PROCESS_REPEAT_BYTES = 2**20


class SizingError(ValueError):
    """No usable profile or batch size; the one-line message says which command or option fixes it."""


class NoLimitsError(SizingError):
    """A profile without usable limits (nothing fitted, or nothing fits its budget): calibrating it again at the same
    budget gives the same (README "Exit codes": 3, as the calibration that wrote it)."""

    NO_LIMITS = "the profile has no usable limits (nothing fitted or nothing fits)"


def check_counts(**counts: object) -> None:
    """Each of ``counts`` None or a whole number (byte counts, ``*_bytes``, >= 0; the others >= 1), named in the
    caller's words (``request=`` or ``--batch-size``: :func:`vramcal.words.word`).

    Raises:
        TypeError: a count that is no whole number (a float, a bool, a string). SizingError: one out of range.
    """
    for name, value in counts.items():
        if value is None:
            continue
        in_bytes = name.endswith("_bytes")
        setting = "batch_size" if name == "request" else name
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            spoken = f"{name}=" if in_bytes else word(setting)
            raise TypeError(f"{spoken} takes a whole number, not {type(value).__name__} {value!r:.40}")
        low = 0 if in_bytes else 1
        if value < low:
            shown = f"{name}={value}" if in_bytes else given(setting, value)
            raise SizingError(f"{shown} is below {low}: give a whole number >= {low}")


def check_profile(profile: object) -> None:
    """Raise TypeError unless ``profile`` is a :class:`~vramcal.profile.Profile` (what the sizing functions take)."""
    if not isinstance(profile, Profile):
        raise TypeError(f"profile= takes a vramcal.Profile, not {type(profile).__name__} {profile!r:.40}: read a file "
                        f"with vramcal.load_profile(path)")


class GradientsHeld(enum.Enum):
    """Why a run's forward passes run beside the previous step's gradients: the gradient term (module docstring).

    ``ACCUMULATION``: every micro-batch after the first of an optimizer step (:func:`size` adds it by itself);
    ``AUTOMATIC_OPTIMIZATION``: Lightning's, which zeroes the gradients inside its closure, after the next
    forward pass; ``LOOP``: a loop of the caller's own that zeroes them after the forward pass.
    """

    ACCUMULATION = "accumulation"
    AUTOMATIC_OPTIMIZATION = "automatic_optimization"
    LOOP = "loop"

    def says(self, accumulation_steps: int = 1) -> str:
        """The reason, for people (the gradient term's notice)."""
        if self is GradientsHeld.ACCUMULATION:
            return (f"accumulation: the micro-batches after the first of each of its {accumulation_steps} run beside "
                    f"the gradients accumulated so far")
        if self is GradientsHeld.AUTOMATIC_OPTIMIZATION:
            return "Lightning's automatic optimization zeroes them after the next forward pass"
        return "this loop zeroes them after the next forward pass"


@dataclass(frozen=True)
class SizeRequest:
    """What a run asks of a profile: the one record :func:`size` takes, built once by each caller (the trainer,
    the integrations, the API) and checked when it is made, in the caller's words (``request=`` or
    ``--batch-size``: :func:`vramcal.words.word`). A resize is a :meth:`replace`.

    Attributes:
        limit: which of the profile's limits a run takes when nothing is requested (:data:`LIMITS`).
        batch_size_min: the smallest batch size acceptable (samples, >= 1).
        request: the caller's batch size (samples, >= 1), clamped to ``[batch_size_min, safe]``; None: ``limit``.
        effective_batch_size: samples per optimizer step to keep (>= 1; module docstring): the batch size found
            is then the micro-batch. ``exact``: a micro-batch that divides it.
        size_for: ``memory`` takes ``limit``; ``throughput`` the throughput knee when it lies below the limit
            (:func:`throughput_choice`).
        seq_len: the run's sequence length (tokens, >= 1), for a profile calibrated over several.
        gradients: why the run's forward passes run beside the previous step's gradients (None: they do not;
            accumulation adds the term by itself).

    Raises:
        TypeError: a count that is no whole number (a float, a bool, a string), ``gradients`` no
            :class:`GradientsHeld`. SizingError: a limit, a count or ``size_for`` out of range.
    """

    limit: Limit = "conservative"
    batch_size_min: int = 1
    request: int | None = None
    effective_batch_size: int | None = None
    exact: bool = False
    size_for: SizeFor = "memory"
    seq_len: int | None = None
    gradients: GradientsHeld | None = None

    def __post_init__(self) -> None:
        if self.limit not in LIMITS:
            raise SizingError(f"limit={self.limit!r} is not a limit: use one of {', '.join(map(repr, LIMITS))}")
        if self.size_for not in SIZE_FOR:
            raise SizingError(f"size_for={self.size_for!r} is not a choice: use one of "
                              f"{', '.join(map(repr, SIZE_FOR))}")
        check_counts(batch_size_min=self.batch_size_min, request=self.request, seq_len=self.seq_len,
                     effective_batch_size=self.effective_batch_size)
        if not isinstance(self.exact, bool):
            raise TypeError(f"exact= takes True or False, not {type(self.exact).__name__} {self.exact!r:.40}")
        if self.gradients is not None and not isinstance(self.gradients, GradientsHeld):
            raise TypeError(f"gradients= takes a vramcal.sizing.GradientsHeld or None, not "
                            f"{type(self.gradients).__name__} {self.gradients!r:.40}")

    def replace(self, **changes: Any) -> SizeRequest:
        """This request with ``changes`` (checked again, as any new request)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Sizing:
    """The batch size a run uses, why, and what the profile predicts for it. Bytes are integers.

    Attributes:
        batch_size: samples per micro-batch (per optimizer step when ``accumulation_steps`` is 1).
        source: ``conservative`` or ``safe`` (the profile's), ``knee`` (the throughput knee, sizing for
            throughput: :func:`throughput_choice`), ``requested`` (the caller's, within bounds) or ``clamped``
            (the caller's, moved into [batch_size_min, safe]) (:data:`Source`).
        capped_by_data: the batch was lowered to the training samples there are (the trainer: a step needs a
            full batch); ``source`` is where it came from before. :attr:`label` says both, and accumulation.
        missing_bytes: what the device was missing against the profile's budget when the run was sized (the
            gate, :func:`size`'s ``free_bytes``); the limits are lowered by it, the prediction is not.
        safe_batch_size, conservative_batch_size: the limits in force (after the data term).
        predicted_peak_bytes, upper_bytes: point prediction and upper 95 % bound of the run's peak (at a size a
            verification trial measured, never below its peak, step creep included: the evidence).
        warn_bytes, warn_basis: the warning line a run's peak is held against (module docstring; 0 in run
            records made before it: :attr:`line_bytes`), and what widened it, for people.
        usable_bytes, total_bytes: the profile's memory figures.
        data_delta_bytes: the run's data bytes in the measured memory minus the calibration's.
        process_delta_bytes: what the run's process held at the start of training minus what the trials'
            processes held (the process term); 0 when not measured.
        verified: the profile's limits were verified by real trials.
        notices: one line each, for people: clamping, the data term, an unverified profile; information marked
            :class:`~vramcal.words.Info`, the rest warnings.
        fitted_from: the smallest batch size of the fitted points (None: a 2-D model); below it the
            prediction is an extrapolation (:func:`verdict`).
        accumulation_steps: micro-batches per optimizer step (``batch_size`` is the micro-batch).
        effective_batch_size: samples per optimizer step, ``batch_size × accumulation_steps`` (the last
            micro-batch may be smaller: then the requested effective batch).
        gradient_delta_bytes: the gradient term (module docstring): the gradients' bytes when the run's forward
            passes run beside them, else 0.
    """

    batch_size: int
    source: Source
    safe_batch_size: int
    conservative_batch_size: int
    predicted_peak_bytes: int
    upper_bytes: int
    usable_bytes: int
    total_bytes: int
    data_delta_bytes: int
    verified: bool
    notices: tuple[str, ...] = ()
    fitted_from: int | None = None
    process_delta_bytes: int = 0
    accumulation_steps: int = 1
    effective_batch_size: int | None = None
    gradient_delta_bytes: int = 0
    capped_by_data: bool = False
    missing_bytes: int = 0
    warn_bytes: int = 0
    warn_basis: str = ""

    @property
    def line_bytes(self) -> int:
        """The warning line (bytes): ``warn_bytes``, or the upper bound in a record made before it."""
        return self.warn_bytes or self.upper_bytes

    @property
    def label(self) -> str:
        """Where the batch size comes from, for people and records: ``source``, ``+accumulated`` when micro-batches
        accumulate, ``+data`` when capped by the training samples (``conservative+accumulated``)."""
        return self.source + "+accumulated" * (self.accumulation_steps > 1) + "+data" * self.capped_by_data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sizing:
        """The sizing a run record holds (``dataclasses.asdict``); a record written before ``capped_by_data``
        holds the label in ``source`` (``conservative+data``)."""
        source, *marks = data["source"].split("+")
        return cls(**{**data, "source": source, "notices": tuple(data["notices"]),
                      "capped_by_data": data.get("capped_by_data", "data" in marks)})


@dataclass(frozen=True)
class LengthModel:
    """What sizing needs from a profile at one sequence length.

    Attributes:
        predict, upper: point prediction and upper 95 % bound of the peak at a batch size (bytes).
        safe_for: the largest batch size whose upper bound fits in a given number of bytes.
        limits: the limits at this length.
        safe_peak_bytes: the safe size's verification peak (None: not verified at this length).
        verified: both limits verified by real trials at this length.
        basis: a note when the limits are not a calibrated length's own (an interpolation).
        fitted_from: the smallest batch size of the one-length fit's points (None: the 2-D model).
    """

    predict: Callable[[int], float]
    upper: Callable[[int], float]
    safe_for: Callable[[int], int]
    limits: Limits
    safe_peak_bytes: int | None
    verified: bool
    basis: str | None = None
    fitted_from: int | None = None
    verified_peaks: dict[int, int] = field(default_factory=dict)

    def expected(self, batch_size: int) -> float:
        """The prediction at ``batch_size``: the line, or the verified peak there when that is higher (never
        below the evidence: a verification trial measured that size, its step creep included)."""
        return max(self.predict(batch_size), self.verified_peaks.get(batch_size, 0))


def length_model(profile: Profile, seq_len: int | None = None) -> LengthModel:
    """The profile's model at the run's ``seq_len``: the one-length fit (a profile of one length: ``seq_len``
    is its own, or None), or, for a profile calibrated over several lengths, the 2-D model there
    (:mod:`vramcal.calibration.surface`), which needs the length.

    Raises:
        SizingError: no limits; a one-length profile asked about another length; a several-length profile
            asked without a length, or at one outside its range or not a multiple of chunk_size.
    """
    limits, fit, surface = profile.limits, profile.fit, profile.surface
    if limits is None or fit is None or limits.safe_batch_size < 1:
        raise NoLimitsError(f"{NoLimitsError.NO_LIMITS}: re-run `vramcal probe` with a larger budget")
    own = profile.model.params.get("seq_len")
    if surface is None and seq_len is not None and own is not None and seq_len != own:
        raise SizingError(f"the profile was calibrated at seq_len {own}, not {seq_len}: calibrate {seq_len} (`vramcal "
                          f"probe --seq-len {seq_len}`, or several lengths: `--seq-len {min(own, seq_len)},"
                          f"{max(own, seq_len)}`)")
    if surface is not None and seq_len is None:
        raise SizingError(f"the profile covers seq_len {min(surface.seq_lens)}-{max(surface.seq_lens)}: give the "
                          f"run's {word('seq_len')} (its memory depends on it)")
    if surface is None or seq_len == surface.reference_seq_len:
        check = profile.verification.get("safe")
        peaks = {v.batch_size: v.peak_bytes for v in profile.verification.values() if v.passed and v.peak_bytes}
        return LengthModel(fit.predict, fit.upper, lambda usable: safe_batch_size(fit, usable), limits,
                           check.peak_bytes if check is not None and check.passed else None, profile.verified,
                           fitted_from=fitted_from(profile), verified_peaks=peaks)

    try:
        at = limits_at(surface, seq_len, limits.total_bytes, profile.settings)
        basis = answer_at(surface, seq_len, at.usable_bytes, profile.settings.conservative_fraction)[2]
    except ValueError as error:
        raise SizingError(str(error)) from None
    entry, fit2, widen = surface.at(seq_len), surface.fit, surface.widening(seq_len)
    return LengthModel(lambda b: fit2.predict(b, seq_len), lambda b: surface.upper(b, seq_len),
                       lambda usable: safe_batch_size_2d(fit2, usable, seq_len, widen), at,
                       entry.safe_peak_bytes if entry else None, bool(entry and entry.verified),
                       None if entry else basis)


@dataclass(frozen=True)
class Answer:
    """A profile's answer at a sequence length or a batch size (``vramcal limits --seq-len/--batch-size``).

    Attributes:
        seq_len: the length answered at (for ``--batch-size``: the longest that fits).
        batch_size: the batch size answered at (for ``--seq-len``: the safe one).
        safe_batch_size, conservative_batch_size: the limits at ``seq_len``.
        basis: ``verified`` (a calibrated length), ``not verified``, or an interpolation note.
        predicted_peak_bytes, upper_bytes, usable_bytes: the model's figures at (batch_size, seq_len).
        sentence: the answer in words, for people: what was asked, the answer, and what it rests on (a calibrated
            length or one between two, verified or interpolated).
    """

    seq_len: int
    batch_size: int
    safe_batch_size: int
    conservative_batch_size: int
    basis: str
    predicted_peak_bytes: int
    upper_bytes: int
    usable_bytes: int
    sentence: str = ""


def answer(profile: Profile, *, seq_len: int | None = None, batch_size: int | None = None) -> Answer:
    """The safe and conservative batch sizes at ``seq_len``, or the longest seq_len at ``batch_size``
    (a multiple of chunk_size inside the calibrated range whose upper 95 % bound fits in usable memory).

    Raises:
        SizingError: both or neither given, or one below 1 (each named in the caller's words); the profile covers
            one length only and ``seq_len`` is another (or ``batch_size`` is asked); a length outside the
            calibrated range or not a multiple of chunk_size; no length fits ``batch_size``. TypeError: a value
            that is no whole number.
    """

    check_profile(profile)
    check_counts(seq_len=seq_len, answer_batch_size=batch_size)
    if (seq_len is None) == (batch_size is None):
        raise SizingError(f"give {word('seq_len')} or {word('answer_batch_size')} (one of them)")
    surface, usable = profile.surface, profile.settings.usable_bytes(profile.device.total_bytes)
    own = profile.model.params.get("seq_len")
    if surface is None and (batch_size is not None or seq_len != own):
        raise SizingError(f"the profile was calibrated at seq_len {own} only: calibrate several lengths "
                          f"(vramcal probe --seq-len {own},{seq_len or 2 * own}) to answer at others")
    if batch_size is not None:
        seq_len = longest_at(surface, batch_size, usable)
        if seq_len < 1:
            raise SizingError(f"no seq_len in {min(surface.seq_lens)}-{max(surface.seq_lens)} fits batch_size "
                              f"{batch_size} within usable memory")
    model = length_model(profile, seq_len)
    sizing = size(profile, SizeRequest(limit="safe", seq_len=seq_len)) if batch_size is None else None
    batch = batch_size if batch_size is not None else sizing.batch_size
    basis = "verified" if model.verified else (model.basis or "not verified")
    found = Answer(seq_len, batch, model.limits.safe_batch_size, model.limits.conservative_batch_size, basis,
                   int(model.predict(batch)), int(model.upper(batch)), model.limits.usable_bytes)
    return dataclasses.replace(found, sentence=_in_words(found, surface, by_batch=batch_size is not None))


def _in_words(found: Answer, surface, by_batch: bool) -> str:
    """:attr:`Answer.sentence`: the answer, where its length sits among the calibrated ones, and what its limits
    rest on (``surface``: the profile's :class:`~vramcal.calibration.surface.Surface`, None for one length)."""
    length, lengths = found.seq_len, surface.seq_lens if surface is not None else (found.seq_len,)
    if length in lengths:
        where = "the profile's one calibrated length" if surface is None else "a calibrated length"
        rests = "its limits verified by real trials" if found.basis == "verified" else "its limits not verified"
    else:
        where = (f"between the calibrated lengths {max(n for n in lengths if n < length)} and "
                 f"{min(n for n in lengths if n > length)}")
        rests = "interpolated by the 2-D fit, not verified at this length"
    if not by_batch:
        return (f"at seq_len {length} ({where}; {rests}) the safe batch_size is {found.safe_batch_size} and the "
                f"conservative {found.conservative_batch_size}")
    said = f"the longest seq_len at batch_size {found.batch_size} is {length}"
    if length == max(lengths):  # the range ends before memory does
        said += (f", the longest calibrated length ({rests}): its upper 95 % bound fits usable memory there, and "
                 f"longer lengths are outside the calibrated range (calibrate them to ask about them)")
    else:
        said += (f" ({where}; {rests}): the longest multiple of chunk_size {surface.chunk_size} whose upper 95 % "
                 f"bound at that batch size fits usable memory")
    if found.safe_batch_size < found.batch_size:
        said += (f"; but the safe batch_size at {length} is {found.safe_batch_size}, below {found.batch_size}: train "
                 f"at most {found.safe_batch_size} there")
    return said


def limits_for_data(model: LengthModel, profile: Profile, delta: int, cause: str = "the data hold",
                    seq_len: int | None = None) -> tuple[int, int, list[str]]:
    """(safe, conservative, notices) with ``delta`` bytes more (or less) in the measured memory than the
    calibration held (module docstring: the data term, the process term); ``cause`` names where they are. Runs
    recorded out of memory cap both (:func:`run_failure_cap`, at ``seq_len``).

    Raises:
        SizingError: ``delta`` leaves no room for one sample; no trial ran below a recorded failure.
    """
    limits = model.limits
    safe, conservative, notices = limits.safe_batch_size, limits.conservative_batch_size, []
    still_fits = model.safe_peak_bytes is not None and model.safe_peak_bytes + delta <= limits.usable_bytes
    if delta > 0 and not still_fits:  # the safe size's own trial, plus the extra bytes, no longer fits
        safe = min(safe, max(model.safe_for(limits.usable_bytes - delta), _moved_down(model, delta)))
        if safe < 1:
            raise SizingError(f"{cause} {format_bytes(delta)} more than the calibration's, which leaves no room for "
                              f"one sample in {format_bytes(limits.usable_bytes)}: calibrate the way this run holds "
                              f"it, or hold less")
        conservative = min(conservative, math.floor(profile.settings.conservative_fraction * safe))
        if safe < limits.safe_batch_size:
            notices.append(Info(f"{cause} {format_bytes(delta)} more than the calibration's: safe batch size "
                                f"{limits.safe_batch_size} -> {safe}, conservative {limits.conservative_batch_size} "
                                f"-> {conservative}"))
    cap, why = run_failure_cap(profile, seq_len)
    if cap is not None and cap < safe:
        safe, conservative = cap, min(conservative, cap)
        notices.append(why)
    if model.basis:
        notices.append(basis_notice(model.basis))
    elif not model.verified:
        notices.append("the profile's limits were not verified by real trials: they are extrapolations; "
                       "re-run `vramcal probe` to verify them")
    return safe, conservative, notices


def run_failure_cap(profile: Profile, seq_len: int | None = None) -> tuple[int | None, str]:
    """(cap, notice): after training runs of the profile ran out of memory (its observations marked
    ``out_of_memory``), the largest batch size below the smallest of them that a trial of the profile ran and fitted
    in (at ``seq_len``): the evidence a run may take; (None, "") when no run did.

    Raises:
        SizingError: no trial ran below it (one line: the size a run failed at, and what to do).
    """
    failed = [o for o in profile.observations if o.out_of_memory]
    if not failed:
        return None, ""
    first = min(failed, key=lambda o: o.batch_size)
    usable = profile.settings.usable_bytes(profile.device.total_bytes)
    below = [t.batch_size for t in length_trials(profile, seq_len)
             if t.fits(usable) and t.batch_size < first.batch_size]
    if not below:
        raise SizingError(f"a run ran out of memory at batch_size {first.batch_size} (step {first.steps}) and no trial "
                          f"of the profile ran below it: train at a batch size below {first.batch_size} unchecked, or "
                          f"calibrate with less held beside the model")
    return max(below), (f"a run ran out of memory at batch_size {first.batch_size} (step {first.steps}, peak "
                        f"{format_bytes(first.peak_bytes)}, predicted {format_bytes(first.predicted_peak_bytes)}): "
                        f"batch sizes up to {max(below)}, the largest below it that a trial ran")


def basis_notice(basis: str) -> str:
    """The notice of limits read at a length the profile did not verify as such (``basis``: the surface's,
    :func:`vramcal.calibration.surface.answer_at`)."""
    return f"the profile's limits at this seq_len are {basis}"


def _moved_down(model: LengthModel, delta: int) -> int:
    """The largest batch size up to the verified safe size whose verification peak, moved down the fit and
    ``delta`` added, fits in usable memory (0: none; the safe size not verified)."""
    top = model.limits.safe_batch_size
    if model.safe_peak_bytes is None:
        return 0
    excess = model.safe_peak_bytes + delta - model.limits.usable_bytes
    # predict() rises with b: the largest b whose prediction lies at least `excess` below the safe size's
    return bisect.bisect_right(range(top + 1), -excess, key=lambda b: model.predict(b) - model.predict(top)) - 1


def extra_bytes(profile: Profile, pool_data_bytes: int | None, process_bytes: int | None) -> tuple[int, int, str]:
    """(data delta, process delta, what holds them) for :func:`size` (module docstring). The process term, when
    measured, covers the data the process holds, so the data term is then 0. A process that holds less than the
    trials' is credited all of it: a run's own model calibrated in trials that imported more than the run (the
    worker server's pandas and pyarrow: 40 MiB) peaked within 0.4 % of the prediction so credited, 4.7 % under it
    with no credit (bench/README.md, "The process term and the late threads"); the warning line keeps the term's
    own spread (:func:`process_spread`)."""
    if process_bytes is not None:
        held = profile.held_bytes
        if held is None:
            return 0, 0, "this process holds"
        return 0, process_bytes - held, "this process holds"
    return (0 if pool_data_bytes is None else pool_data_bytes - profile.pool_data_bytes), 0, "the data hold"


def process_spread(profile: Profile) -> int:
    """What a measured process term may be off by (bytes): the range of the trials' own held bytes
    (:func:`held_spread`), the side it is measured against, plus :data:`PROCESS_REPEAT_BYTES`, how far repeats of
    one framework script held apart."""
    return held_spread(profile) + PROCESS_REPEAT_BYTES


def held_spread(profile: Profile) -> int:
    """The range (bytes) of what the trials' processes held when their step was built (0 with fewer than two)."""
    held = [t.held_bytes for t in profile.trials if t.ok and t.held_bytes is not None and t.purpose != "steady"]
    return max(held) - min(held) if len(held) > 1 else 0


def size(profile: Profile, ask: SizeRequest = SizeRequest(), *, pool_data_bytes: int | None = None,
         process_bytes: int | None = None, free_bytes: int | None = None, free_source: str = "free now") -> Sizing:
    """The batch size for a run and the profile's prediction for it.

    Args:
        profile: a checked profile (:func:`vramcal.profile.load_profile`).
        ask: what the run asks (:class:`SizeRequest`: the limit, a requested batch size clamped to
            ``[batch_size_min, safe]``, an effective batch, sizing for throughput, the run's seq_len, why its
            gradients stay alive).
        pool_data_bytes: the run's data bytes in the measured memory (None: as in the calibration).
        process_bytes: what the run's process holds at the start of training (the process term; module
            docstring); it replaces ``pool_data_bytes``.
        free_bytes: what the device has free before the run starts (the gate; ``free_source`` says whose
            figure): when other processes took memory since the calibration, the run has that much less, so
            ``missing = total − reserve − free_bytes`` (the reserve covers what a driver and the system
            normally hold), when positive, lowers the limits as the data term does (the prediction, of this
            run's own memory, stays).

    The seed documents clamp the user's batch size to [min, max] before any allocation; here max is the
    profile's safe batch size (the largest whose upper prediction bound fits in usable memory).

    Raises:
        SizingError: no limits, min above the safe batch size, the ``limit`` below min, or a ``seq_len`` the
            profile does not cover; a byte count below 0. TypeError: a profile that is no Profile, an ``ask``
            that is no SizeRequest, a byte count that is no whole number.
    """
    check_profile(profile)
    if not isinstance(ask, SizeRequest):
        raise TypeError(f"ask= takes what the run asks as a vramcal.SizeRequest, not {type(ask).__name__} "
                        f"{ask!r:.40}: size(profile, SizeRequest(request=64)) for a batch size")
    check_counts(pool_data_bytes=pool_data_bytes, process_bytes=process_bytes, free_bytes=free_bytes)
    if not isinstance(free_source, str):
        raise TypeError(f"free_source= takes where free_bytes came from, as a str, not {type(free_source).__name__} "
                        f"{free_source!r:.40}")
    model = length_model(profile, ask.seq_len)
    extra = extra_bytes(profile, pool_data_bytes, process_bytes)
    gone = missing(model.limits, profile.settings, free_bytes, free_source)
    sizing = _size(profile, model, extra, process_bytes, ask, gone=gone)
    if ask.gradients is None and sizing.accumulation_steps > 1:
        sizing = _size(profile, model, extra, process_bytes, ask.replace(gradients=GradientsHeld.ACCUMULATION),
                       sizing.accumulation_steps, gone)
    return sizing


def missing(limits: Limits, settings: LimitSettings, free_bytes: int | None, source: str) -> tuple[int, str | None]:
    """(bytes the device is missing against the profile's budget now, notice): ``total − reserve − free`` when
    positive (:func:`size`, ``free_bytes``), else (0, None)."""
    if free_bytes is None:
        return 0, None
    gone = limits.total_bytes - settings.reserve_bytes - free_bytes
    if gone <= 0:
        return 0, None
    return gone, (f"the device has {format_bytes(free_bytes)} free now ({source}): {format_bytes(gone)} less than "
                  f"the profile's {format_bytes(limits.total_bytes)} budget leaves beyond its reserve (other processes "
                  f"took it since the calibration)")


def _size(profile: Profile, model: LengthModel, extra: tuple[int, int, str], process_bytes: int | None,
          ask: SizeRequest, accumulation_steps: int = 1, gone: tuple[int, str | None] = (0, None)) -> Sizing:
    """:func:`size` with the deltas found (a second time with the gradient term, when accumulation needs it:
    ``accumulation_steps``, for its notice); ``gone``: the memory the device is missing now (:func:`missing`)."""
    data_delta, process_delta, cause = extra
    gradient_delta, gradient_notice = gradient_term(profile, ask.gradients, accumulation_steps)
    terms = [(size, name) for size, name in ((data_delta, "data"), (process_delta, "process"),
                                              (gradient_delta, "gradient"), (gone[0], "missing memory")) if size]
    if len(terms) > 1:  # name each term that moved the limits, not the last one alone
        cause = "this run holds (" + ", ".join(f"{name} term {size / 2**20:+.1f} MiB" for size, name in terms) + ")"
    elif gradient_delta:
        cause = "with the gradients held through the forward pass, this run holds"
    elif gone[0]:
        cause = "with the memory missing now, this run needs"
    safe, conservative, notices = limits_for_data(model, profile, data_delta + process_delta + gradient_delta + gone[0],
                                                  cause, ask.seq_len)
    if gone[1]:
        notices.insert(0, gone[1])
    if gradient_notice:
        notices.insert(0, gradient_notice)
    if process_bytes is not None:
        notices.insert(0, process_notice(profile, process_bytes, process_delta))
    batch, source = _chosen(ask.request, ask.limit, safe, conservative, ask.batch_size_min, notices)
    if ask.request is None and ask.size_for == "throughput":
        batch, source, why = throughput_choice(profile, ask.seq_len, batch, source, ask.batch_size_min, safe)
        notices.append(Info(why))
    steps = 1
    if ask.effective_batch_size is not None:
        batch, steps = accumulation(ask.effective_batch_size, batch, ask.exact)
    if model.fitted_from is not None and batch < model.fitted_from:
        notices.append(f"batch_size {batch} is below the fitted range (from batch_size {model.fitted_from}): its "
                       f"predicted peak extrapolates a line fitted near the limit, and small batches can peak above it")
    delta = data_delta + process_delta + gradient_delta
    expected = model.expected(batch)
    upper = max(model.upper(batch), expected)
    spread, basis = repeat_spread(profile, ask.seq_len)
    term = process_spread(profile) if process_bytes is not None and profile.held_bytes is not None else 0
    if term:
        basis += f", plus {format_bytes(term)}: what the process term may be off by"
    return Sizing(batch_size=batch, source=source, safe_batch_size=safe, conservative_batch_size=conservative,
                  predicted_peak_bytes=int(expected + delta), upper_bytes=int(upper + delta),
                  warn_bytes=int(max(upper + delta, (expected + delta) * (1 + spread)) + term), warn_basis=basis,
                  usable_bytes=model.limits.usable_bytes, total_bytes=model.limits.total_bytes,
                  data_delta_bytes=data_delta, verified=model.verified, notices=tuple(notices),
                  fitted_from=model.fitted_from, process_delta_bytes=process_delta, accumulation_steps=steps,
                  effective_batch_size=batch * steps if ask.effective_batch_size is None else ask.effective_batch_size,
                  gradient_delta_bytes=gradient_delta, missing_bytes=gone[0])


def repeat_spread(profile: Profile, seq_len: int | None = None) -> tuple[float, str]:
    """(fraction, basis): how far repeats of the same run were measured to spread (module docstring, the warning
    line): the widest of repeated trials of one batch size at the run's length, ``(max − min) / min``; the runs
    recorded in the profile, the range of their relative errors (two or more); and :data:`BENCH_SPREAD`."""
    found = [(BENCH_SPREAD, f"{BENCH_SPREAD:.0%}: how far correct runs spread in vramcal's benchmark")]
    peaks: dict[int, list[int]] = {}
    for trial in length_trials(profile, seq_len):
        if trial.ok and trial.peak_bytes and trial.purpose != "steady":
            peaks.setdefault(trial.batch_size, []).append(trial.peak_bytes)
    repeated = [(max(p) - min(p)) / min(p) for p in peaks.values() if len(p) > 1]
    if repeated:
        found.append((max(repeated), f"{max(repeated):.1%}: repeated trials of one batch size in the calibration"))
    errors = [o.peak_bytes / o.predicted_peak_bytes - 1 for o in profile.observations
              if o.predicted_peak_bytes > 0 and o.peak_unseen is None and not o.out_of_memory]  # bounds spread nothing
    if len(errors) > 1:
        found.append((max(errors) - min(errors), f"{max(errors) - min(errors):.1%}: the spread of the "
                                                 f"{len(errors)} runs recorded in the profile"))
    return max(found)


def gradient_term(profile: Profile, held: GradientsHeld | None, accumulation_steps: int = 1) -> tuple[int, str | None]:
    """(bytes, notice) of the gradient term (module docstring) for a run whose forward passes run beside the
    gradients for the reason ``held`` (None: they do not: (0, None)); ``accumulation_steps`` for its notice."""
    if held is None:
        return 0, None
    why = held.says(accumulation_steps)
    counted = profile.model_info.get("gradient_bytes")
    if not isinstance(counted, int) or counted <= 0:
        return 0, (f"the gradients are held through the forward pass ({why}), but the profile does not record "
                   f"their bytes: re-run `vramcal probe` to count them; the prediction leaves them out")
    return counted, Info(f"the gradients are held through the forward pass ({why}): a gradient term of "
                         f"+{format_bytes(counted)} in the prediction and the limits")


def _chosen(request: int | None, limit: Limit, safe: int, conservative: int, batch_size_min: int,
            notices: list[str]) -> tuple[int, Source]:
    """The batch size and its source: the ``limit``, or ``request`` within ``[batch_size_min, safe]``.

    Raises:
        SizingError: the bounds are empty, or the limit is below ``batch_size_min``.
    """
    if batch_size_min > safe:
        raise SizingError(f"{given('batch_size_min', batch_size_min)} is above the profile's safe batch size "
                          f"{safe}: lower {word('batch_size_min')}, or use a smaller model or a larger device")
    if request is None:
        batch, source = (conservative, "conservative") if limit == "conservative" else (safe, "safe")
        if batch < batch_size_min:
            raise SizingError(f"the profile's {limit} batch size {batch} is below "
                              f"{given('batch_size_min', batch_size_min)}: ask for a batch size "
                              f"({word('batch_size')}) between {batch_size_min} and {safe}")
        return batch, source
    batch = min(max(request, batch_size_min), safe)
    if batch != request:
        notices.insert(0, f"{given('batch_size', request)} is outside [{batch_size_min}, {safe}] "
                          f"({word('batch_size_min')}, the profile's safe batch size): using {batch}")
    return batch, "requested" if batch == request else "clamped"


def accumulation(effective_batch_size: int, micro_limit: int, exact: bool = False) -> tuple[int, int]:
    """(micro-batch, accumulation steps) that reach ``effective_batch_size`` samples per optimizer step with
    micro-batches of at most ``micro_limit`` (module docstring): the fewest steps, ``ceil(effective / limit)``;
    ``exact``: the largest micro-batch that divides the effective batch.

    Raises:
        SizingError: an effective batch below 1.
    """
    if effective_batch_size < 1:
        raise SizingError(f"the effective batch size must be >= 1, got {effective_batch_size}")
    if effective_batch_size <= micro_limit:
        return effective_batch_size, 1
    if exact:
        micro = max(d for d in range(1, micro_limit + 1) if effective_batch_size % d == 0)
        return micro, effective_batch_size // micro
    steps = math.ceil(effective_batch_size / micro_limit)
    return math.ceil(effective_batch_size / steps), steps


def process_notice(profile: Profile, process_bytes: int, delta: int) -> str:
    """The process term, for people (module docstring)."""
    if profile.held_bytes is None:
        return (f"this process holds {format_bytes(process_bytes)} as training starts, but the profile does not record "
                f"what its trials held (it predates the process term): recalibrate to size this process")
    return Info(f"this process holds {format_bytes(process_bytes)} as training starts, the profile's trials held "
                f"{format_bytes(profile.held_bytes)}: a process term of {delta / 2**20:+.1f} MiB in the prediction and "
                f"the limits")


def length_trials(profile: Profile, seq_len: int | None = None) -> list[Trial]:
    """The trials at the run's length: all of them for a one-length profile; for a profile over several
    lengths those at ``seq_len`` (the reference length's when None)."""
    if profile.surface is None:
        return list(profile.trials)
    wanted = seq_len or profile.surface.reference_seq_len
    return [t for t in profile.trials
            if t.seq_len == wanted or (t.seq_len is None and wanted == profile.surface.reference_seq_len)]


THROUGHPUT = "sizing for throughput"  # how throughput_choice's reason begins (the forecast's notes carry it)


def throughput_choice(profile: Profile, seq_len: int | None, limit_batch: int, limit_name: str,
                      batch_size_min: int = 1, safe: int | None = None) -> tuple[int, str, str]:
    """(batch size, source, why) sizing for throughput: the throughput knee
    (:func:`vramcal.calibration.throughput.find_knee`, among the measured sizes a run may use: ``[batch_size_min,
    safe]``, ``safe`` default the profile's) when it is below ``limit_batch`` and its rate differs measurably from
    the rate there (:func:`vramcal.calibration.throughput.overlap`), else the limit itself (``limit_name``): a
    refused knee, or one whose interval overlaps the limit's, is no advice.
    """
    rates = measured_rates(length_trials(profile, seq_len))
    high = safe if safe is not None else profile.limits.safe_batch_size if profile.limits else limit_batch
    knee = find_knee(rates, batch_size_min, max(high, limit_batch))
    at_limit = rate_at(rates, limit_batch)
    there = f" at {rate_text(at_limit)} samples/s" if at_limit else ""
    keep = f"using the {limit_name} batch size {limit_batch}"
    if knee is None:
        return limit_batch, limit_name, (f"{THROUGHPUT}: no measured throughput up to batch_size "
                                         f"{limit_batch}: {keep}")
    if knee.refused:
        return limit_batch, limit_name, f"{THROUGHPUT}: no throughput knee: {knee.refused}; {keep}"
    reach = (f"the throughput knee, the smallest measured batch size reaching {knee.fraction * 100:g} % of the best "
             f"{format_rate(knee.best.samples_per_s)} samples/s (at batch_size {knee.best.batch_size})")
    if knee.batch_size >= limit_batch:
        return limit_batch, limit_name, (f"{THROUGHPUT}: {reach}, batch_size {knee.batch_size}, is not "
                                         f"below the {limit_name} batch size {limit_batch}: using {limit_batch}")
    if at_limit is None or overlap(knee.rate.interval, at_limit.interval):
        return limit_batch, limit_name, (f"{THROUGHPUT}: {NO_DIFFERENCE} in samples/s between batch_size "
                                         f"{knee.batch_size} at {rate_text(knee.rate)}, {reach}, and the "
                                         f"{limit_name} batch size {limit_batch}{there or ' (no rate there)'}: their "
                                         f"95 % intervals overlap; {keep}")
    gain = knee.best.samples_per_s / knee.rate.samples_per_s - 1
    beyond = (f"no measured size gains more than {gain:.1%} over it" if knee.best is not knee.rate
              else "no measured size is faster")
    if not knee.rate.steady:
        beyond += (f" (its rate rests on {knee.rate.n_steps} timed step{'s' * (knee.rate.n_steps != 1)} of short "
                   f"trials: the first epoch's time against the forecast will tell)")
    return knee.batch_size, "knee", (f"{THROUGHPUT}: batch_size {knee.batch_size} at "
                                     f"{rate_text(knee.rate)} samples/s is {reach}, below the {limit_name} batch "
                                     f"size {limit_batch}{there}; {beyond}")


def fitted_from(profile: Profile) -> int | None:
    """The smallest batch size among the one-length fit's points (None: no fit, or a profile over lengths)."""
    if profile.fit is None or profile.surface is not None or not profile.fit.batch_sizes:
        return None
    return min(profile.fit.batch_sizes)


def verdict(peak_bytes: int, upper_bytes: int, usable_bytes: int, batch_size: int, fitted_from: int | None) -> str:
    """How a training run's measured peak compares with the profile's figures for it (bytes; batch sizes in
    samples): ``above usable``; ``above the bound`` (above ``upper_bytes``, the warning line
    :attr:`Sizing.line_bytes`: the profile under-predicts the run); ``below the fitted range`` (above it at a
    batch size smaller than every fitted point, where the line, fitted near the limit, is an extrapolation: on
    the host, peaks at small batches sit above it); else ``within the bound``."""
    if peak_bytes > usable_bytes:
        return "above usable"
    if peak_bytes <= upper_bytes:
        return "within the bound"
    return "below the fitted range" if fitted_from is not None and batch_size < fitted_from else "above the bound"


def compare(sizing: Sizing, peak_bytes: int, process: bool = False) -> tuple[str, list[str]]:
    """The measured peak against the profile's prediction, as one line, and warnings.

    Args:
        process: the prediction carries a measured process term (a framework's process, :mod:`vramcal.sizing`):
            the advice for a peak above it is then about the process's steps, not the calibration.

    Returns:
        ``peak 2.70 GiB: predicted 2.60 GiB (+3.8 %), warned above 2.75 GiB, usable 3.10 GiB`` and a warning
        for a peak above the warning line (:attr:`Sizing.line_bytes`) or above usable memory.
    """
    predicted = sizing.predicted_peak_bytes  # not positive: a line fitted near the limit, far below its range
    error = f"{(peak_bytes - predicted) / predicted:+.1%}" if predicted > 0 else "no relative error"
    term = (f", process term {sizing.process_delta_bytes / 2**20:+.1f} MiB" if process else "") + (
        f", gradient term +{sizing.gradient_delta_bytes / 2**20:.1f} MiB" if sizing.gradient_delta_bytes else "")
    line = (f"peak {format_bytes(peak_bytes)} at batch_size {sizing.batch_size}: predicted "
            f"{format_bytes(predicted)} ({error}{term}), warned above {format_bytes(sizing.line_bytes)}, usable "
            f"{format_bytes(sizing.usable_bytes)}")
    found = verdict(peak_bytes, sizing.line_bytes, sizing.usable_bytes, sizing.batch_size, sizing.fitted_from)
    widened = f" (the prediction + {sizing.warn_basis})" if sizing.warn_basis else ""
    cause = ("beyond what this process held when training started: its steps hold more than the trials' (its "
             "allocator, tensors it keeps); train at a smaller batch size, and report it" if process else
             "the profile does not hold for this run; re-run `vramcal probe` (with this run's data) and report it")
    warnings = {
        "above usable": [f"the measured peak {format_bytes(peak_bytes)} is above usable memory "
                         f"{format_bytes(sizing.usable_bytes)}: {cause}"],
        "above the bound": [f"the measured peak is above the warning line {format_bytes(sizing.line_bytes)}"
                            f"{widened}: the profile under-predicts this run"],
        "below the fitted range": [f"the measured peak is above the warning line "
                                   f"{format_bytes(sizing.line_bytes)} at batch_size {sizing.batch_size}, below the "
                                   f"fitted range (from batch_size {sizing.fitted_from}), where the line is an "
                                   f"extrapolation; the profile's limits are not affected"],
    }.get(found, [])
    return line, warnings


def scaled_lr(lr: float, batch_size: int, reference_batch_size: int, scaling: str) -> float:
    """Peak learning rate for ``batch_size`` given ``lr`` at ``reference_batch_size``.

    ``none``: lr. ``linear``: lr x b / ref (Goyal et al. 2017, for SGD). ``sqrt``: lr x sqrt(b / ref),
    the square-root scaling rule for Adam (Malladi et al. 2022, "On the SDEs and Scaling Rules for
    Adaptive Gradient Algorithms").
    """
    ratio = batch_size / reference_batch_size
    if scaling == "none":
        return lr
    if scaling == "linear":
        return lr * ratio
    if scaling == "sqrt":
        return lr * math.sqrt(ratio)
    raise ValueError(f"lr scaling must be none, linear or sqrt, got {scaling!r}")
