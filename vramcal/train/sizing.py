"""How the trainer sizes itself from a profile: which profile, which batch size, which learning rate.

Pure functions over a :class:`~vramcal.profile.Profile`, so the policy is tested without training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from vramcal.model import ModelSpec
from vramcal.profile import Profile, ProfileError, check_profile_matches, find_profile, load_profile
from vramcal.records import Device


class SizingError(ValueError):
    """No usable profile or batch size; the one-line message says which command or option fixes it."""


@dataclass(frozen=True)
class BatchChoice:
    """The batch size a run uses and why.

    Attributes:
        batch_size: samples per optimizer step.
        source: ``conservative`` (the profile's), ``requested`` (the user's, within bounds) or ``clamped``.
        warning: the clamping warning, naming the requested number, the used one and the bounds.
        predicted_peak_bytes: the profile's point estimate of the peak at ``batch_size``.
    """

    batch_size: int
    source: str
    warning: str | None
    predicted_peak_bytes: int


def probe_command(device: Device, spec: ModelSpec, implementation: str) -> str:
    """The ``vramcal probe`` command line that makes the missing profile (non-default spec options only)."""
    defaults = ModelSpec()
    options = [f"--{f.name.replace('_', '-')} {getattr(spec, f.name)}" for f in fields(ModelSpec)
               if f.name not in ("n_features", "d_conv", "n_groups")
               and getattr(spec, f.name) != getattr(defaults, f.name)]
    gpu = "none" if device.kind == "host" else "auto"
    return " ".join(["vramcal probe", f"--gpu {gpu}", f"--impl {implementation}", *options])


def resolve_profile(profile: str, profiles_dir: Path | str, device: Device, spec: ModelSpec,
                    implementation: str) -> tuple[Profile, Path]:
    """The profile to size the run with.

    Args:
        profile: ``auto`` (the newest matching one in ``profiles_dir``) or a file path.
        implementation: the concrete implementation the run trains.

    Raises:
        SizingError: no matching profile (says which probe command to run, or ``--probe``), a profile
            for another device, spec or implementation (names the difference), or one without limits.
    """
    if profile == "auto":
        path = find_profile(Path(profiles_dir), device, spec, implementation)
        if path is None:
            raise SizingError(f"no profile for {device.name} and this model ({spec.short()}, {implementation}) "
                              f"in {profiles_dir}/: run `{probe_command(device, spec, implementation)}` "
                              f"first, or add --probe to calibrate now")
    else:
        path = Path(profile)
    try:
        loaded = load_profile(path)
        check_profile_matches(loaded, device, spec)
    except ProfileError as error:
        raise SizingError(f"{path}: {error}") from None
    if loaded.implementation != implementation:
        raise SizingError(f"{path}: the profile measured the {loaded.implementation} implementation, this run "
                          f"trains {implementation}: pass --impl {loaded.implementation} or probe {implementation}")
    if loaded.limits is None or loaded.fit is None or loaded.limits.safe_batch_size < 1:
        raise SizingError(f"{path}: the profile has no usable limits (nothing fitted or nothing fits): "
                          f"re-run `{probe_command(device, spec, implementation)}`")
    return loaded, path


def choose_batch_size(profile: Profile, requested: int | None, batch_size_min: int) -> BatchChoice:
    """The run's batch size: the conservative one, or ``requested`` clamped to [min, safe].

    The seed documents clamp the user's batch size to [min, max] before any allocation; here max is
    the profile's safe batch size (the largest whose upper prediction bound fits in usable memory).

    Raises:
        SizingError: the bounds are empty (min above the safe batch size), or nothing fits.
    """
    limits, fit = profile.limits, profile.fit
    assert limits is not None and fit is not None  # resolve_profile refuses profiles without them
    safe = limits.safe_batch_size
    if batch_size_min > safe:
        raise SizingError(f"--batch-size-min {batch_size_min} is above the profile's safe batch size {safe}: "
                          f"lower --batch-size-min, or use a smaller model or a larger device")
    if requested is None:
        batch = limits.conservative_batch_size
        if batch < batch_size_min:
            raise SizingError(f"the profile's conservative batch size {batch} is below --batch-size-min "
                              f"{batch_size_min}: pass --batch-size between {batch_size_min} and {safe}")
        return BatchChoice(batch, "conservative", None, int(fit.predict(batch)))
    batch = min(max(requested, batch_size_min), safe)
    if batch == requested:
        return BatchChoice(batch, "requested", None, int(fit.predict(batch)))
    warning = (f"--batch-size {requested} is outside [{batch_size_min}, {safe}] (--batch-size-min, the "
               f"profile's safe batch size): using {batch}")
    return BatchChoice(batch, "clamped", warning, int(fit.predict(batch)))


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
