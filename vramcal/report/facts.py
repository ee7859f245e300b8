"""What the report's Markdown and figure share: names, labels, trial states, the throughput knee, missing parts.

Pure functions of the profiles: the same profiles give the same text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vramcal.calibration.creep import steady_equivalent
from vramcal.calibration.throughput import Knee, Rate, find_knee, measured_rates
from vramcal.models.registry import describe, differences
from vramcal.profile import profile_path
from vramcal.report.table import MISSING
from vramcal.units import format_bytes

if TYPE_CHECKING:
    from vramcal.profile import Profile
    from vramcal.records import Trial


def report_name(profiles: Sequence[Profile]) -> str:
    """File stem: ``<device slug>-<profile file's stem>`` (:func:`~vramcal.profile.profile_path`, so two budgets or
    one process and DDP do not overwrite each other); for several profiles ``compare-<hash>``."""
    names = [f"{p.device.slug()}-{profile_path('', p.device, p.model, p.implementation, world=p.world).stem}"
             for p in profiles]
    if len(profiles) == 1:
        return names[0]
    return f"compare-{hashlib.sha256(chr(10).join(sorted(names)).encode()).hexdigest()[:8]}"


def device_label(profile: Profile) -> str:
    """``NVIDIA H200 (140.40 GiB)`` or ``host RAM: AMD EPYC 7763 (2 cores) (7.50 GiB)``."""
    device = profile.device
    return f"{device.kind.label(device.name, 'host RAM: {}')} ({format_bytes(device.total_bytes)})"


def series_labels(profiles: Sequence[Profile]) -> tuple[list[str], list[str]]:
    """A label per profile naming only what differs between them, and two title lines for what they share
    (device, implementation and vramcal version; the model spec, or that the specs differ)."""
    parts = [{"device": device_label(p), "impl": p.implementation,
              "version": f"vramcal {p.vramcal_version or '?'}"} for p in profiles]
    shared = [part for part in ("device", "impl", "version") if len({str(x[part]) for x in parts}) == 1]
    models = differences([p.model for p in profiles])  # the family where they differ, the settings that do
    labels = [" · ".join(bit for bit in (*(x[part] for part in ("device", "impl", "version") if part not in shared),
                                         *model) if bit) or "profile"
              for x, model in zip(parts, models)]
    first = [parts[0][part] for part in ("device", "impl", "version") if part in shared]
    if len(profiles) > 1:
        first.insert(0, f"{len(profiles)} profiles")
    spec = describe(profiles[0].model) if not any(any(model) for model in models) else "models differ (see legend)"
    return labels, [" · ".join(first), spec]


def usable_bytes(profile: Profile) -> int:
    """The profile's usable memory: from its limits, else from its settings and device."""
    if profile.limits is not None:
        return profile.limits.usable_bytes
    return profile.settings.usable_bytes(profile.device.total_bytes)


def trial_state(trial: Trial, usable: int) -> str:
    """``ok``, ``over-budget`` (finished but peak > usable), ``oom``, ``timeout`` or ``error``."""
    if trial.ok and trial.peak_bytes > usable:  # type: ignore[operator]
        return "over-budget"
    return trial.status if trial.status != "ok" or trial.ok else "error"


def trial_reason(trial: Trial, width: int = 100) -> str:
    """The first line of an unfinished trial's error, cut to ``width`` characters; "" for a finished one."""
    if trial.status == "ok" or not trial.error:
        return ""
    line = trial.error.strip().splitlines()[0] if trial.error.strip() else ""
    return line if len(line) <= width else line[:width - 3] + "..."


def failure_words(profile: Profile, batch_size: int) -> str:
    """How the trials at ``batch_size`` failed, in words (out of memory or over usable, timed out, an error)."""
    usable = usable_bytes(profile)
    states = {trial_state(t, usable) for t in steady_equivalent(profile.reference_trials, profile.creep_rule)
              if t.batch_size == batch_size}
    if states & {"oom", "over-budget"} or not states:
        return "ran out of memory or over usable memory"
    return "timed out" if "timeout" in states else "failed with an error (its reason is in the trials table)"


def profile_rates(profile: Profile) -> list[Rate]:
    """The measured throughput per batch size of the one-length fit's trials
    (:func:`vramcal.calibration.throughput.measured_rates`)."""
    return measured_rates(profile.reference_trials)


def safe_size(profile: Profile) -> int | None:
    """The largest batch size a run may take: the safe size, None without one (no limits, or nothing fits)."""
    limits = profile.limits
    return limits.safe_batch_size if limits is not None and limits.safe_batch_size > 0 else None


def profile_knee(profile: Profile) -> Knee | None:
    """The throughput knee among the sizes a run may use (:func:`safe_size`; all of them without one)."""
    return find_knee(profile_rates(profile), 1, safe_size(profile))


def missing_notes(profile: Profile) -> list[str]:
    """Plain sentences saying what the profile lacks (no fit, no limits, no verification)."""
    ok = [t for t in profile.trials if t.ok]
    notes = []
    if profile.fit is None:
        notes.append(f"No fit: {len(ok)} successful trial(s) over {len({t.batch_size for t in ok})} batch "
                     f"size(s); a fit needs at least 3 over 2 batch sizes. No line is drawn and no limits are "
                     f"given: re-run `vramcal probe` to measure more batch sizes.")
    elif profile.limits is None:
        notes.append("No limits: the fitted line does not rise with batch_size (its slope is not positive), so no "
                     "limit follows from it. Re-run `vramcal probe` with a larger budget.")
    elif not profile.verified:
        ran = {k: v for k, v in profile.verification.items() if v is not None}
        what = ("no verification trial ran" if not ran else "; ".join(
            f"{k} batch {v.batch_size} {'passed' if v.passed else 'FAILED'}" for k, v in sorted(ran.items())))
        notes.append(f"Not verified ({what}): the batch sizes below are extrapolations from the fit, not "
                     f"limits. Re-run `vramcal probe` to verify them with real trials.")
    return notes


def bytes_text(n_bytes: float | None) -> str:
    return MISSING if n_bytes is None else format_bytes(n_bytes)


def seconds_text(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def batch_text(n: int) -> str:
    return f"{n:,}" if n > 0 else "0 (nothing fits)"
