"""What a profile's fields must say of each other, each relation the rule the writer follows: the fit is the
least-squares line (or plane) through its own points, which are trials; limits follow from the fit, device and
settings under :func:`vramcal.calibration.limits.safe_ceiling`; each verification is a trial at its limit;
observations share the usable memory; the derived keys are what the fields give. Each refusal is one
:class:`~vramcal.profile.ProfileError` line naming the field.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vramcal.calibration.creep import steady_equivalent
from vramcal.calibration.fit import fit_linear
from vramcal.calibration.fit2d import fit_2d
from vramcal.calibration.limits import point_safe_batch_size, safe_ceiling
from vramcal.calibration.search import largest_fitting
from vramcal.profile.record import DERIVED, Profile, ProfileError
from vramcal.schema import shown
from vramcal.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from vramcal.calibration.fit import Fit
    from vramcal.calibration.fit2d import Fit2D
    from vramcal.records import Trial

REL_TOLERANCE = 1e-6  # a fit's figures against the same fit recomputed: float rounding, not a measurement


def read_profile(data: object) -> Profile:
    """The profile a file's JSON object holds, typed (:meth:`Profile.from_dict`) and related (:func:`check_profile`,
    :func:`check_derived`).

    Raises:
        ProfileError: not a vramcal profile, another schema version, or the first bad field (one line).
    """
    profile = Profile.from_dict(data)
    check_profile(profile)
    check_derived(profile, {k: data[k] for k in DERIVED if k in data})
    return profile


def check_profile(profile: Profile) -> None:
    """Raises: ProfileError: the first field that contradicts the others (module docstring), in one line."""
    usable = profile.settings.usable_bytes(profile.device.total_bytes)
    if usable <= 0:
        raise ProfileError(f"settings leave no usable memory of device.total_bytes {profile.device.total_bytes} "
                           f"(reserve {profile.settings.reserve_bytes}, margin {profile.settings.margin})")
    if profile.surface is not None:
        check_surface_shape(profile)
    trials = steady_equivalent(profile.reference_trials, profile.creep_rule)  # what the fit, limits, verifications read
    if profile.fit is not None:
        check_fit(profile.fit, trials)
    if profile.limits is not None:
        check_limits(profile, trials)
    elif profile.fit is not None and profile.fit.slope_bytes_per_sample > 0:
        raise ProfileError("limits = null, yet the fit rises (fit.slope_bytes_per_sample > 0): a calibration always "
                           "gives limits from such a fit")
    for name, record in (("verification", profile.verification), ("observations", profile.observations),
                         ("surface", profile.surface)):
        if record and profile.limits is None:
            raise ProfileError(f"{name} is given without limits (limits is null)")
    check_verification(profile, trials)
    if profile.surface is not None:
        check_surface(profile)
    for index, observation in enumerate(profile.observations):
        where = f"observations[{index}]"
        if observation.usable_bytes != profile.limits.usable_bytes:  # type: ignore[union-attr]
            raise ProfileError(f"{where}.usable_bytes = {observation.usable_bytes} is not the profile's usable "
                               f"memory {profile.limits.usable_bytes}")  # type: ignore[union-attr]
        if observation.upper_bytes < observation.predicted_peak_bytes:
            raise ProfileError(f"{where}.upper_bytes = {observation.upper_bytes} is below its predicted_peak_bytes "
                               f"{observation.predicted_peak_bytes}")


def check_fit(fit: Fit, trials: Sequence[Trial]) -> None:
    """Raises: ProfileError: a figure of the fit not its points' least-squares line, or a point no trial's."""
    if not fit.n_points == len(fit.batch_sizes) == len(fit.peak_bytes):
        raise ProfileError(f"fit.n_points = {fit.n_points} does not match its {len(fit.batch_sizes)} batch sizes "
                           f"and {len(fit.peak_bytes)} peaks")
    try:
        again = fit_linear(fit.batch_sizes, fit.peak_bytes)
    except ValueError as error:
        raise ProfileError(f"fit.batch_sizes: {error}") from None
    peak, batch = max(fit.peak_bytes), max(fit.batch_sizes)
    scales = {"overhead_bytes": peak, "slope_bytes_per_sample": peak / batch, "overhead_stderr_bytes": peak,
              "slope_stderr_bytes_per_sample": peak / batch, "residual_stderr_bytes": peak, "r_squared": 1.0,
              "batch_mean": batch, "batch_sxx": batch**2 * fit.n_points, "t_critical": 1.0}
    for name, scale in scales.items():
        if differs(getattr(fit, name), getattr(again, name), scale):
            raise ProfileError(f"fit.{name} = {getattr(fit, name):.6g} does not follow from the fit's own points "
                               f"(the least-squares line through fit.batch_sizes and fit.peak_bytes gives "
                               f"{getattr(again, name):.6g})")
    unmatched = Counter(zip(fit.batch_sizes, fit.peak_bytes)) - Counter((t.batch_size, t.peak_bytes) for t in trials
                                                                        if t.ok)
    if unmatched:
        batch_size, peak_bytes = min(unmatched)
        raise ProfileError(f"fit point (batch_size {batch_size}, peak_bytes {peak_bytes}) is no recorded trial's: "
                           f"fit.batch_sizes and fit.peak_bytes must be trials the line was fitted through")


def differs(stored: float, again: float, scale: float) -> bool:
    """Whether a recorded figure and the same figure recomputed differ by more than float rounding."""
    return abs(stored - again) > REL_TOLERANCE * max(abs(stored), abs(again)) + 1e-9 * abs(scale)


def check_limits(profile: Profile, trials: Sequence[Trial]) -> None:
    """Raises: ProfileError: the first limit that contradicts the fit, device, settings or trials."""
    limits, fit, settings, total = profile.limits, profile.fit, profile.settings, profile.device.total_bytes
    assert limits is not None
    if fit is None:
        raise ProfileError("limits are given without a fit (fit is null)")
    _check_line(fit, total)
    if limits.total_bytes != total:
        raise ProfileError(f"limits.total_bytes = {limits.total_bytes} is not device.total_bytes {total}")
    usable = settings.usable_bytes(total)
    if limits.usable_bytes != usable:
        raise ProfileError(f"limits.usable_bytes = {limits.usable_bytes} does not follow from device.total_bytes and "
                           f"the settings ({usable})")
    try:
        point = point_safe_batch_size(fit, usable)
    except OverflowError:
        raise ProfileError(f"fit.slope_bytes_per_sample = {fit.slope_bytes_per_sample:.6g} is too small to size "
                           f"anything with") from None
    if limits.point_safe_batch_size != point:
        raise ProfileError(f"limits.point_safe_batch_size = {limits.point_safe_batch_size} does not follow from the "
                           f"fit ({point} = floor((usable - overhead) / slope))")
    failed, safe = limits.failed_batch_size, limits.safe_batch_size
    if failed is not None and not any(t.batch_size == failed and not t.fits(usable) for t in trials):
        raise ProfileError(f"limits.failed_batch_size = {failed}, but no trial at batch_size {failed} failed")
    if failed is not None and safe >= failed:
        raise ProfileError(f"limits.safe_batch_size = {safe} is not below the failed batch size {failed}")
    evidence = largest_fitting(trials, usable)
    ceiling = safe_ceiling(fit, usable, evidence, failed)
    if safe > ceiling:
        raise ProfileError(f"limits.safe_batch_size = {safe} is above what the file's own evidence allows "
                           f"({ceiling}: the fit's point estimate in {format_bytes(usable)} is {point}, the largest "
                           f"batch size whose trials fitted {evidence or 'none'})")
    most = math.floor(settings.conservative_fraction * safe)
    if not 0 <= limits.conservative_batch_size <= most:
        raise ProfileError(f"limits.conservative_batch_size = {limits.conservative_batch_size} is not within [0, "
                           f"{most}] (floor of settings.conservative_fraction {settings.conservative_fraction:g} x "
                           f"safe_batch_size {safe})")


def _check_line(fit: Fit, total_bytes: int) -> None:
    """A line limits can come from: rising, and below the whole device at batch 0 (its overhead may be negative)."""
    if fit.slope_bytes_per_sample <= 0:
        raise ProfileError(f"fit.slope_bytes_per_sample = {fit.slope_bytes_per_sample:.6g} is not positive, yet the "
                           f"file gives limits: no limit follows from a line that does not rise")
    if fit.overhead_bytes > total_bytes:
        raise ProfileError(f"fit.overhead_bytes = {fit.overhead_bytes:.6g} is more than the whole device "
                           f"(device.total_bytes {total_bytes}): no batch would fit")


def check_verification(profile: Profile, trials: Sequence[Trial]) -> None:
    """Raises: ProfileError: a verification that is no recorded trial at its limit, or ``passed`` wrongly."""
    limits = profile.limits
    if limits is None:
        return
    sizes = {"safe": limits.safe_batch_size, "conservative": limits.conservative_batch_size}
    for name, check in profile.verification.items():
        if check.batch_size != sizes[name]:
            raise ProfileError(f"verification.{name}.batch_size = {check.batch_size} is not the {name} batch size "
                               f"{sizes[name]}")
        if not any(t.batch_size == check.batch_size and t.peak_bytes == check.peak_bytes for t in trials):
            raise ProfileError(f"verification.{name}: no recorded trial at batch_size {check.batch_size} with "
                               f"peak_bytes {check.peak_bytes}")
        if check.passed != (check.peak_bytes is not None and check.peak_bytes <= limits.usable_bytes):
            raise ProfileError(f"verification.{name}.passed = {str(check.passed).lower()} contradicts its peak "
                               f"{check.peak_bytes} against usable {limits.usable_bytes}")


def check_surface(profile: Profile) -> None:
    """Several lengths: the 2-D fit, the reference length's limits as the profile's, each length's limits against
    its own trials.

    Raises:
        ProfileError: the first field that breaks them.
    """
    surface = profile.surface
    assert surface is not None and profile.limits is not None
    trials = steady_equivalent(profile.trials, profile.creep_rule)
    check_fit_2d(surface.fit, trials)
    reference = surface.at(surface.reference_seq_len)
    limits = profile.limits
    if (reference.safe_batch_size, reference.conservative_batch_size) != (limits.safe_batch_size,  # type: ignore
                                                                          limits.conservative_batch_size):
        raise ProfileError(f"surface seq_len {surface.reference_seq_len} (the reference): its limits are not the "
                           f"profile's limits ({limits.safe_batch_size}, {limits.conservative_batch_size})")
    for index, entry in enumerate(surface.lengths):
        _check_length(profile, entry, f"surface.lengths[{index}]", [t for t in trials if t.seq_len == entry.seq_len])


def check_surface_shape(profile: Profile) -> None:
    """Raises: ProfileError: a model with a seq_len, lengths not distinct multiples of chunk_size shortest first,
    or a reference not among them."""
    surface = profile.surface
    assert surface is not None
    if "seq_len" in profile.model.params:
        raise ProfileError("model.params.seq_len is set, yet the profile covers several lengths (surface): a "
                           "profile over lengths keys its model without one")
    lengths = surface.seq_lens
    if len(lengths) < 2 or list(lengths) != sorted(set(lengths)):
        raise ProfileError(f"surface.lengths {list(lengths)} are not two or more distinct lengths, shortest first")
    if surface.reference_seq_len not in lengths:
        raise ProfileError(f"surface.reference_seq_len = {surface.reference_seq_len} is none of surface.lengths "
                           f"{list(lengths)}")
    odd = [length for length in lengths if length % surface.chunk_size]
    if odd:
        raise ProfileError(f"surface.lengths: seq_len {odd[0]} is not a multiple of surface.chunk_size "
                           f"{surface.chunk_size}")


def _check_length(profile: Profile, entry: Any, where: str, trials: Sequence[Trial]) -> None:
    """One length's limits against the trials at that length."""
    usable, fraction = profile.limits.usable_bytes, profile.settings.conservative_fraction  # type: ignore[union-attr]
    most = math.floor(fraction * entry.safe_batch_size)
    if not 0 <= entry.conservative_batch_size <= most:
        raise ProfileError(f"{where}.conservative_batch_size = {entry.conservative_batch_size} is not within [0, "
                           f"{most}] (floor of {fraction:g} x safe_batch_size {entry.safe_batch_size})")
    failed = entry.failed_batch_size
    if failed is not None and not any(t.batch_size == failed and not t.fits(usable) for t in trials):
        raise ProfileError(f"{where}.failed_batch_size = {failed}, but no trial at seq_len {entry.seq_len} and "
                           f"batch_size {failed} failed")
    if failed is not None and entry.safe_batch_size >= failed:
        raise ProfileError(f"{where}.safe_batch_size = {entry.safe_batch_size} is not below its failed batch size "
                           f"{failed}")
    for name, size, peak in (("safe", entry.safe_batch_size, entry.safe_peak_bytes),
                             ("conservative", entry.conservative_batch_size, entry.conservative_peak_bytes)):
        at = [t for t in trials if t.batch_size == size]
        fitted = bool(at) and all(t.fits(usable) for t in at) and peak in [t.peak_bytes for t in at]
        if peak is not None and not fitted:
            raise ProfileError(f"{where}.{name}_peak_bytes = {peak}: no fitting trial at seq_len {entry.seq_len} and "
                               f"batch_size {size} peaked so")


def check_fit_2d(fit: Fit2D, trials: Sequence[Trial]) -> None:
    """Raises: ProfileError: a figure of the 2-D fit not its points' least-squares plane, or a point no trial's."""
    if not fit.n_points == len(fit.batch_sizes) == len(fit.seq_lens) == len(fit.peak_bytes):
        raise ProfileError(f"surface.fit.n_points = {fit.n_points} does not match its points")
    try:
        again = fit_2d(fit.batch_sizes, fit.seq_lens, fit.peak_bytes)
    except ValueError as error:
        raise ProfileError(f"surface.fit.batch_sizes: {error}") from None
    peak = max(fit.peak_bytes)
    figures = {name: (getattr(fit, name), getattr(again, name), peak) for name in (
        "overhead_bytes", "bytes_per_token", "bytes_per_sample", "overhead_stderr_bytes", "stderr_bytes_per_token",
        "stderr_bytes_per_sample", "residual_stderr_bytes")}
    figures.update({"r_squared": (fit.r_squared, again.r_squared, 1.0),
                    "t_critical": (fit.t_critical, again.t_critical, 1.0)})
    for i, (row, row_again) in enumerate(zip(fit.xtx_inverse, again.xtx_inverse)):
        scale = max(map(abs, row_again))
        figures.update({f"xtx_inverse[{i}][{j}]": (v, w, scale) for j, (v, w) in enumerate(zip(row, row_again))})
    for name, (stored, recomputed, scale) in figures.items():
        if differs(stored, recomputed, scale):
            raise ProfileError(f"surface.fit.{name} = {stored:.6g} does not follow from the fit's own points (the "
                               f"least-squares plane through them gives {recomputed:.6g})")
    points = Counter(zip(fit.batch_sizes, fit.seq_lens, fit.peak_bytes))
    unmatched = points - Counter((t.batch_size, t.seq_len, t.peak_bytes) for t in trials if t.ok)
    if unmatched:
        batch_size, seq_len, peak_bytes = min(unmatched)
        raise ProfileError(f"surface.fit point (batch_size {batch_size}, seq_len {seq_len}, peak_bytes {peak_bytes}) "
                           f"is no recorded trial's")


def check_derived(profile: Profile, written: dict[str, Any]) -> None:
    """Raises: ProfileError: a derived key (``model_key``, ``verified``, ``creep``) not what the fields give."""
    creep = profile.creep
    expected = {"model_key": profile.model.key(), "verified": profile.verified,
                "creep": creep.to_dict() if creep else None}
    if isinstance(written.get("creep"), dict) and isinstance(expected["creep"], dict):
        # a file written before the creep's curve was recorded holds fewer of its keys: compare those
        expected["creep"] = {k: v for k, v in expected["creep"].items() if k in written["creep"]}
    for key, value in expected.items():
        if key not in written:
            continue
        if written[key] != value or isinstance(written[key], bool) != isinstance(value, bool):
            raise ProfileError(f"{key} = {shown(written[key])} is not what the profile's fields give ({shown(value)})")
