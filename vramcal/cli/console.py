"""What the commands print for people: one line per trial, and a calibration's summary."""

from __future__ import annotations

import sys

from vramcal.units import format_bytes


class TrialPrinter:
    """One line per finished trial above a tqdm progress bar (trials run / at most max_trials)."""

    def __init__(self, max_trials: int, usable_bytes: int) -> None:
        from tqdm import tqdm

        self._usable_bytes = usable_bytes
        self._bar = tqdm(total=max_trials, desc="trials", unit="trial", leave=False, file=sys.stderr,
                         disable=None)

    def __call__(self, trial) -> None:
        peak = format_bytes(trial.peak_bytes) if trial.peak_bytes is not None else "-"
        step = f"{trial.step_s:.3f} s/step, {trial.samples_per_s:.1f} samples/s" if trial.step_s else ""
        status = "over" if trial.ok and not trial.fits(self._usable_bytes) else trial.status
        self._bar.write(f"  batch_size {trial.batch_size:>6}  {status:<7}  peak {peak:>10}  {step}  "
                        f"[{trial.purpose}, {trial.wall_s:.1f} s]")
        self._bar.update(1)


def summary(profile) -> str:
    """The probe's closing lines for people: formula, usable, safe and conservative, verification."""
    lines = [f"{profile.device.name}: {format_bytes(profile.device.total_bytes)} total"]
    fit, limits = profile.fit, profile.limits
    if fit is None or limits is None:
        lines.append("no fit: " + "; ".join(profile.warnings))
        return "\n".join(lines)
    lines.append(f"{fit.formula()}   (r² = {fit.r_squared:.4f}, {fit.n_points} points)")
    lines.append(f"usable        {format_bytes(limits.usable_bytes)}")
    for name, value in (("safe", limits.safe_batch_size), ("conservative", limits.conservative_batch_size)):
        check = profile.verification.get(name)
        state = (f"verified: peak {format_bytes(check.peak_bytes)}" if check and check.passed
                 else "NOT verified")
        lines.append(f"{name:<13} batch_size {value:<6} ({state})")
    lines.append(f"(point estimate without the prediction interval, the seeds' formula "
                 f"floor((usable - overhead) / slope): {limits.point_safe_batch_size})")
    lines.extend(f"warning: {w}" for w in profile.warnings)
    return "\n".join(lines)
