"""The terms a run adds to its profile's prediction (data, process, gradients, the gate's missing memory) and the
spreads that widen its warning line; the rules are :mod:`vramcal.sizing`'s."""

from __future__ import annotations

from collections.abc import Iterable

from vramcal.calibration.limits import Limits, LimitSettings
from vramcal.profile import Profile
from vramcal.records import Trial
from vramcal.sizing.request import GradientsHeld
from vramcal.units import format_bytes
from vramcal.words import Info

# How far correct runs spread around their prediction, rounded up: bench.survival (-0.7 to +0.5 %) and
# bench.frameworks (up to +2.5 %); the floor of the warning line.
BENCH_SPREAD = 0.03
# How far one framework script's process term differs between repeats, rounded up: within 4-100 KiB
# (bench.process_term, bench/results/process-term).
PROCESS_REPEAT_BYTES = 2**20


def length_trials(profile: Profile, seq_len: int | None = None) -> list[Trial]:
    """The trials at the run's length: all of a one-length profile's; else those at ``seq_len`` (None: the
    reference length)."""
    if profile.surface is None:
        return list(profile.trials)
    wanted = seq_len or profile.surface.reference_seq_len
    return [t for t in profile.trials
            if t.seq_len == wanted or (t.seq_len is None and wanted == profile.surface.reference_seq_len)]


def extra_bytes(profile: Profile, pool_data_bytes: int | None, process_bytes: int | None) -> tuple[int, int, str]:
    """(data delta, process delta, what holds them), bytes. A measured process term covers the process's data, so
    the data term is then 0; a process holding less than the trials' is credited all of it (bench/README.md,
    "The process term and the late threads")."""
    if process_bytes is not None:
        held = profile.held_bytes
        if held is None:
            return 0, 0, "this process holds"
        return 0, process_bytes - held, "this process holds"
    return (0 if pool_data_bytes is None else pool_data_bytes - profile.pool_data_bytes), 0, "the data hold"


def process_spread(profile: Profile) -> int:
    """What a measured process term may be off by (bytes): the range of what the trials' processes held when their
    step was built, plus :data:`PROCESS_REPEAT_BYTES`."""
    held = [t.held_bytes for t in profile.trials if t.ok and t.held_bytes is not None and t.purpose != "steady"]
    return (max(held) - min(held) if len(held) > 1 else 0) + PROCESS_REPEAT_BYTES


def trials_spread(trials: Iterable[Trial]) -> float | None:
    """The widest ``(max − min) / min`` of the short trials' peaks repeated at one batch size and length (None: no
    size was repeated)."""
    peaks: dict[tuple[int, int | None], list[int]] = {}
    for trial in trials:
        if trial.ok and trial.peak_bytes and trial.purpose != "steady":
            peaks.setdefault((trial.batch_size, trial.seq_len), []).append(trial.peak_bytes)
    return max(((max(p) - min(p)) / min(p) for p in peaks.values() if len(p) > 1), default=None)


def repeat_spread(profile: Profile, seq_len: int | None = None) -> tuple[float, str]:
    """(fraction, basis) the warning line widens the prediction by: the widest of repeated trials of one batch size
    (``(max − min) / min``), the range of the recorded runs' relative errors (two or more), and
    :data:`BENCH_SPREAD`."""
    found = [(BENCH_SPREAD, f"{BENCH_SPREAD:.0%}: how far correct runs spread in vramcal's benchmark")]
    repeated = trials_spread(length_trials(profile, seq_len))
    if repeated is not None:
        found.append((repeated, f"{repeated:.1%}: repeated trials of one batch size in the calibration"))
    errors = [o.peak_bytes / o.predicted_peak_bytes - 1 for o in profile.observations
              if o.predicted_peak_bytes > 0 and o.peak_unseen is None and not o.out_of_memory]  # bounds spread nothing
    if len(errors) > 1:
        found.append((max(errors) - min(errors), f"{max(errors) - min(errors):.1%}: the spread of the "
                                                 f"{len(errors)} runs recorded in the profile"))
    return max(found)


def gradient_term(profile: Profile, held: GradientsHeld | None, accumulation_steps: int = 1) -> tuple[int, str | None]:
    """(bytes, notice) of the gradient term for a run whose forward passes run beside the gradients for the reason
    ``held`` ((0, None) when None)."""
    if held is None:
        return 0, None
    why = held.says(accumulation_steps)
    counted = profile.model_info.get("gradient_bytes")
    if not isinstance(counted, int) or counted <= 0:
        return 0, (f"the gradients are held through the forward pass ({why}), but the profile does not record "
                   f"their bytes: re-run `vramcal probe` to count them; the prediction leaves them out")
    return counted, Info(f"the gradients are held through the forward pass ({why}): a gradient term of "
                         f"+{format_bytes(counted)} in the prediction and the limits")


def process_notice(profile: Profile, process_bytes: int, delta: int) -> str:
    """The process term, for people."""
    if profile.held_bytes is None:
        return (f"this process holds {format_bytes(process_bytes)} as training starts, but the profile does not record "
                f"what its trials held (it predates the process term): recalibrate to size this process")
    return Info(f"this process holds {format_bytes(process_bytes)} as training starts, the profile's trials held "
                f"{format_bytes(profile.held_bytes)}: a process term of {delta / 2**20:+.1f} MiB in the prediction and "
                f"the limits")


def missing(limits: Limits, settings: LimitSettings, free_bytes: int | None, source: str) -> tuple[int, str | None]:
    """(bytes missing against the profile's budget now, notice): ``total − reserve − free`` when positive, else
    (0, None)."""
    if free_bytes is None:
        return 0, None
    gone = limits.total_bytes - settings.reserve_bytes - free_bytes
    if gone <= 0:
        return 0, None
    return gone, (f"the device has {format_bytes(free_bytes)} free now ({source}): {format_bytes(gone)} less than "
                  f"the profile's {format_bytes(limits.total_bytes)} budget leaves beyond its reserve (other processes "
                  f"took it since the calibration)")
