"""What a profile says when asked: its limits at a length or the longest length at a batch size (``vramcal limits
--seq-len/--batch-size``), and a run's measured peak held against its :class:`~vramcal.sizing.request.Sizing`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vramcal.calibration.surface import longest_at
from vramcal.profile import Profile
from vramcal.sizing.request import SizeRequest, Sizing, SizingError, check_counts, check_profile
from vramcal.sizing.rule import length_model, size
from vramcal.units import format_bytes
from vramcal.words import word


@dataclass(frozen=True)
class Answer:
    """A profile's answer at a sequence length or a batch size (``vramcal limits --seq-len/--batch-size``).

    Attributes:
        seq_len: the length answered at (for ``--batch-size``: the longest that fits).
        batch_size: the batch size answered at (for ``--seq-len``: the safe one).
        safe_batch_size, conservative_batch_size: the limits at ``seq_len``.
        basis: ``verified`` (a calibrated length), ``not verified``, or an interpolation note.
        predicted_peak_bytes, upper_bytes, usable_bytes: the model's figures at (batch_size, seq_len).
        sentence: the answer in words, for people, with what it rests on.
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
    """:attr:`Answer.sentence` (``surface``: the profile's :class:`~vramcal.calibration.surface.Surface` or None)."""
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


def verdict(peak_bytes: int, upper_bytes: int, usable_bytes: int, batch_size: int, fitted_from: int | None) -> str:
    """A run's measured peak against the profile's figures (bytes): ``above usable``; ``above the bound`` (above
    ``upper_bytes``, the warning line :attr:`Sizing.line_bytes`); ``below the fitted range`` (above it below every
    fitted batch size, where the line extrapolates: DESIGN.md); else ``within the bound``."""
    if peak_bytes > usable_bytes:
        return "above usable"
    if peak_bytes <= upper_bytes:
        return "within the bound"
    return "below the fitted range" if fitted_from is not None and batch_size < fitted_from else "above the bound"


def compare(sizing: Sizing, peak_bytes: int, process: bool = False) -> tuple[str, list[str]]:
    """The measured peak against the profile's prediction, as one line, and warnings.

    Args:
        process: the prediction carries a measured process term: the advice is then about the process's steps.

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
