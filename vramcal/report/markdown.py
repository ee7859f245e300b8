"""The report's Markdown: summary, training runs, throughput and forecast, trials and the limits on other GPUs.

A pure function of the profiles: the same profiles give the same bytes (the only timestamp is the profile's own
``created_utc``). The facts the figure shares are :mod:`vramcal.report.facts`; the summary table
:mod:`vramcal.report.summary`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vramcal.calibration.creep import STEADY, read_peak
from vramcal.calibration.throughput import Rate, rate_text
from vramcal.forecast import FAR, FAR_FRACTION, ForecastSettings, observation_verdict, profile_forecasts
from vramcal.report.catalogue import GpuModel, limits_notes, limits_table, other_gpu_limits
from vramcal.report.cost import forecast_notes, forecast_table
from vramcal.report.facts import (
    batch_text,
    bytes_text,
    device_label,
    missing_notes,
    profile_knee,
    profile_rates,
    report_name,
    seconds_text,
    series_labels,
    trial_reason,
    trial_state,
    usable_bytes,
)
from vramcal.report.lengths import varying_section
from vramcal.report.summary import creep_shape, knee_text, summary_table, world_text
from vramcal.report.table import MISSING, markdown_table
from vramcal.sizing import fitted_from, verdict
from vramcal.units import format_bytes, format_duration, format_rate

if TYPE_CHECKING:
    from vramcal.profile import Profile

# Moved to facts.py, summary.py and catalogue.py; importers keep this path.
__all__ = ["creep_shape", "device_label", "lengths_section", "limits_notes", "limits_table", "missing_notes",
           "profile_knee", "profile_rates", "render_markdown", "report_name", "series_labels", "trial_reason",
           "trial_state", "trials_table", "usable_bytes", "world_text"]


def trials_table(profile: Profile) -> str:
    """Every trial: batch size, purpose, status, peak and each source, step time, samples/s, why a trial that did
    not finish ended (:func:`trial_reason`), in-fit mark.

    Columns whose source does not exist on this device (e.g. NVML on the host), or that no trial fills, are left
    out.
    """
    usable = usable_bytes(profile)
    in_fit = Counter(zip(profile.fit.batch_sizes, profile.fit.peak_bytes)) if profile.fit else Counter()
    columns = [  # (header, right-aligned, value of a trial)
        ("#", True, None), ("batch", True, lambda t: str(t.batch_size)),
        ("purpose", False, lambda t: t.purpose or MISSING),
        ("status", False, lambda t: trial_state(t, usable)), ("peak", True, lambda t: bytes_text(t.peak_bytes)),
        ("NVML peak", True, lambda t: bytes_text(t.nvml_peak_bytes) + (f" ({t.nvml_source})" * bool(t.nvml_source))),
        ("NVML overhead", True, lambda t: bytes_text(t.nvml_overhead_bytes)),
        ("torch max reserved", True, lambda t: bytes_text(t.torch_max_reserved_bytes)),
        ("torch max allocated", True, lambda t: bytes_text(t.torch_max_allocated_bytes)),
        ("RSS peak", True, lambda t: bytes_text(t.rss_peak_bytes)),
        ("step time", True, lambda t: MISSING if t.step_s is None else seconds_text(t.step_s)),
        ("samples/s", True, lambda t: MISSING if t.samples_per_s is None else format_rate(t.samples_per_s)),
        ("reason", False, trial_reason), ("in fit", False, None)]
    rows, creep = [], profile.creep
    for index, trial in enumerate(profile.trials, 1):
        row = [str(index)] + [get(trial) for _, _, get in columns[1:-1]]
        key = (trial.batch_size, read_peak(trial, creep))  # the fit's points carry the step creep
        fitted = trial.ok and trial.purpose != STEADY and in_fit[key] > 0
        row.append("yes" if fitted else "")
        in_fit[key] -= fitted
        rows.append(row)
    keep = [i for i, (header, _, _) in enumerate(columns)
            if header in ("#", "batch", "status", "peak") or any(r[i] not in (MISSING, "") for r in rows)]
    return markdown_table([columns[i][0] for i in keep], [[r[i] for i in keep] for r in rows],
                          right=[j for j, i in enumerate(keep) if columns[i][1]])





def observations_table(profile: Profile) -> str:
    """The training runs that used the profile: measured peak against the prediction and the warning line it was
    held against (:attr:`vramcal.profile.Observation.line_bytes`)."""
    rows, start = [], fitted_from(profile)
    for o in profile.observations:
        found = verdict(o.peak_bytes, o.line_bytes, o.usable_bytes, o.batch_size, start)
        found = found if found in ("within the bound", "below the fitted range") else f"**{found}**"
        rows.append([o.recorded_utc, str(o.batch_size), format_bytes(o.data_bytes),
                     (">= " if o.peak_unseen else "") + format_bytes(o.peak_bytes),  # a lower bound: part not seen
                     format_bytes(o.predicted_peak_bytes), f"{o.error:+.1%}", format_bytes(o.line_bytes), found,
                     str(o.steps), o.vramcal_version])
    return markdown_table(["recorded (UTC)", "batch", "data", "measured peak", "predicted", "error", "warned above",
                           "verdict", "steps", "vramcal"], rows, right=[1, 2, 3, 4, 5, 6, 8])


def lengths_section(profile: Profile, level: str) -> list[str]:
    """For a calibration over several lengths: the model in batch_size × seq_len and each length's limits."""
    surface = profile.surface
    if surface is None:
        return []
    fit = surface.fit
    rows = []
    for entry in surface.lengths:
        n = sum(1 for t in profile.trials if t.seq_len == entry.seq_len)
        rows.append([str(entry.seq_len), batch_text(entry.safe_batch_size), batch_text(entry.conservative_batch_size),
                     "yes" if entry.verified else "**no**", bytes_text(entry.safe_peak_bytes), str(n),
                     "reference (full search)" if entry.seq_len == surface.reference_seq_len else "verifications"])
    lines = [f"{level} Sequence lengths", "",
             (f"One calibration over {len(surface.lengths)} lengths: `{fit.formula()}` (r² = {fit.r_squared:.4f}, "
              f"n = {fit.n_points}, s = {format_bytes(fit.residual_stderr_bytes)}), a full search at seq_len "
              f"{surface.reference_seq_len} and the verifications at the others; any length in between is an "
              f"interpolation (`vramcal limits --seq-len`)."
              + (f" Signs: {fit.negative_terms()}." if fit.negative_terms() else "")), "",
             markdown_table(["seq_len", "safe", "conservative", "verified", "safe's peak", "trials", "how"], rows,
                            right=[0, 1, 2, 4, 5]), ""]
    if fit.extra_terms:
        lines += [f"> **Needs more terms**: {fit.extra_terms}", ""]
    return lines


def rates_table(rates: Sequence[Rate]) -> str:
    """The measured throughput at each batch size: samples/s with its interval, step time and spread, steps."""
    rows = [[f"{r.batch_size:,}", rate_text(r), seconds_text(r.step_s),
             MISSING if r.spread is None else f"{r.spread:.0%}", str(r.n_steps), str(r.n_trials),
             "yes" if r.steady else "no"] for r in rates]
    return markdown_table(["batch", "samples/s (95 %)", "mean step", "spread (sd/mean)", "steps", "trials", "steady"],
                          rows, right=[0, 1, 2, 3, 4, 5])


def time_observations_table(profile: Profile) -> str | None:
    """The training runs that recorded their times: measured samples/s and epoch time against the forecast."""
    rows = []
    for o in profile.observations:
        if o.epoch_s is None:
            continue
        error = o.time_error
        verdict_text = MISSING if error is None else ("**far**" if observation_verdict(o) == FAR else "close")
        rows.append([o.recorded_utc, str(o.batch_size), format_rate(o.samples_per_s) if o.samples_per_s else MISSING,
                     format_rate(o.forecast_samples_per_s) if o.forecast_samples_per_s else MISSING,
                     format_duration(o.epoch_s), format_duration(o.forecast_epoch_s) if o.forecast_epoch_s else MISSING,
                     MISSING if error is None else f"{error:+.1%}", verdict_text])
    if not rows:
        return None
    return markdown_table(["recorded (UTC)", "batch", "samples/s", "forecast", "epoch", "forecast", "error", "verdict"],
                          rows, right=[1, 2, 3, 4, 5, 6])


def forecast_section(profile: Profile, settings: ForecastSettings, level: str = "##") -> list[str]:
    """The measured throughput, the knee and the run forecast (``vramcal cost``'s table) for one profile."""
    rates = profile_rates(profile)
    lines = [f"{level} Throughput and run forecast", ""]
    if not rates:
        return lines + ["No trial recorded a step time: no throughput, no forecast.", ""]
    knee = profile_knee(profile)
    lines += [("Samples/s at each measured batch size, from every timed step of the trials there (the mean step "
               "time; 95 % interval of the mean). *Steady*: a steady trial ran there, or enough steps were timed; "
               "otherwise a short trial's first steps."), "", rates_table(rates), ""]
    if knee is not None:
        lines += [f"Throughput: {knee_text(knee)}.", ""]
    forecasts = profile_forecasts(profile, settings)
    sizes = ("at the conservative batch size and at the throughput knee (`--size-for throughput`)"
             if any((f.batch_source or "").startswith("knee") for f in forecasts) else
             "at the conservative batch size (`--size-for throughput` trains at the same size: the notes say why)")
    lines += [f"A `vramcal train` run of {settings.epochs} epochs, {sizes}:", "", forecast_table(forecasts), ""]
    lines += [f"- {note}" for note in forecast_notes(forecasts)] + [""]
    observed = time_observations_table(profile)
    if observed is not None:
        lines += [("Training runs that recorded their times, against the forecast for their batch size, data and "
                   f"epochs (**far**: more than {FAR_FRACTION * 100:g} % off, or than the run's steps' own noise "
                   "allowed when that is wider):"), "", observed, ""]
    return lines


def profile_section(profile: Profile, extra_gpus: Sequence[GpuModel], level: str = "##",
                    forecast: ForecastSettings = ForecastSettings()) -> list[str]:
    """Summary, notes, trials and other-GPU limits of one profile, as Markdown lines."""
    lines = [f"{level} Summary", "", summary_table(profile), ""]
    for note in missing_notes(profile):
        lines += [f"> **{note.split(':')[0]}**:{note.split(':', 1)[1]}", ""]
    warnings = list(profile.warnings)
    if profile.fit is not None and profile.fit.nonlinearity:
        warnings.append(profile.fit.nonlinearity)
    if warnings:
        lines += [f"{level} Warnings", "", *(f"- {w}" for w in dict.fromkeys(warnings)), ""]
    lines += lengths_section(profile, level) + varying_section(profile, level)
    lines += [f"{level} Training runs", ""]
    lines += ([("Each `vramcal train` run that used this profile appends its measured peak (by the trials' "
                "definition) beside the prediction for its batch size and data."), "", observations_table(profile)]
              if profile.observations else ["None recorded yet: `vramcal train` appends one per run."])
    lines += ["", *forecast_section(profile, forecast, level)]
    lines += [f"{level} Trials", "", ("Peaks in binary units (1 GiB = 2³⁰ bytes); the raw bytes are in the "
              "profile. `over-budget`: finished, but its peak exceeded usable memory; `in fit`: a point of the "
              "fitted line."), "",
              trials_table(profile), "",
              f"{level} Limits on other GPUs ({'extrapolated' if profile.device.kind == 'cuda' else 'not carried'})",
              ""]
    if profile.fit is None or profile.limits is None:
        lines += ["Not available: there is no fit to extrapolate from.", ""]
        return lines
    lines += [limits_table(other_gpu_limits(profile, extra_gpus), profile.verified), ""]
    lines += [f"- {note}" for note in limits_notes(profile)] + [""]
    return lines


def render_markdown(profiles: Sequence[Profile], png_name: str, extra_gpus: Sequence[GpuModel] = (),
                    forecast: ForecastSettings = ForecastSettings()) -> str:
    """The whole Markdown report; ``png_name`` is the figure's file name, relative to the report; ``forecast``:
    what its run forecast forecasts."""
    labels, title = series_labels(profiles)
    lines = [f"# vramcal report: {title[0]}", "", f"**{title[1]}**", "",
             "Made by `vramcal report` from profile files only; regenerate it at any time.", "",
             f"![Peak memory and throughput against batch size]({png_name})", ""]
    if len(profiles) == 1:
        lines += profile_section(profiles[0], extra_gpus, forecast=forecast)
        return "\n".join(lines).rstrip() + "\n"
    body = []
    for label, p in zip(labels, profiles):
        limits = p.limits
        body.append([label, f"`{p.fit.formula()}`" if p.fit else MISSING,
                     f"{p.fit.r_squared:.4f}" if p.fit else MISSING, bytes_text(usable_bytes(p)),
                     batch_text(limits.safe_batch_size) if limits else MISSING,
                     batch_text(limits.conservative_batch_size) if limits else MISSING,
                     "yes" if p.verified else "**no**"])
    lines += ["## Comparison", "", markdown_table(["profile", "memory model", "r²", "usable", "safe",
                                                   "conservative", "verified"], body, right=[2, 3, 4, 5]), ""]
    for label, p in zip(labels, profiles):
        lines += [f"## {label}", ""] + profile_section(p, extra_gpus, level="###", forecast=forecast)
    return "\n".join(lines).rstrip() + "\n"
