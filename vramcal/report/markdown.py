"""The report's Markdown: summary, trials table and the limits on other GPUs, from profiles only.

Also the facts the figure shares (labels, trial states, throughput knee). A pure function of the
profiles: the same profiles give the same bytes (the only timestamp is the profile's own ``created_utc``).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from vramcal.calibration.creep import PLATEAU_TOLERANCE, STEADY, read_peak, steady_equivalent
from vramcal.calibration.throughput import Knee, Rate, find_knee, measured_rates
from vramcal.forecast import FAR, FAR_FRACTION, ForecastSettings, observation_verdict, profile_forecasts
from vramcal.models.registry import describe, differences, family_of
from vramcal.profile import profile_path
from vramcal.report.catalogue import GpuLimitRow, GpuModel, other_gpu_limits
from vramcal.report.cost import forecast_notes, forecast_table
from vramcal.report.lengths import varying_section
from vramcal.report.table import MISSING, markdown_table
from vramcal.sizing import fitted_from, verdict
from vramcal.units import format_bytes, format_duration, format_rate

if TYPE_CHECKING:
    from vramcal.profile import Profile
    from vramcal.records import Trial



# ---------------------------------------------------------------------------------------------- naming

def report_name(profiles: Sequence[Profile]) -> str:
    """File stem: ``<device slug>-<profile file's stem>`` (:func:`~vramcal.profile.profile_path`: the model
    name, implementation and key, plus a DDP world and a host budget given as ``--capacity``, so the reports
    of two budgets or of one process and DDP do not overwrite each other); for several profiles
    ``compare-<hash>``."""
    names = [f"{p.device.slug()}-{profile_path('', p.device, p.model, p.implementation, world=p.world).stem}"
             for p in profiles]
    if len(profiles) == 1:
        return names[0]
    return f"compare-{hashlib.sha256(chr(10).join(sorted(names)).encode()).hexdigest()[:8]}"


def device_label(profile: Profile) -> str:
    """``NVIDIA H200 (140.40 GiB)`` or ``host RAM: AMD EPYC 7763 (2 cores) (7.50 GiB)``."""
    device = profile.device
    name = device.name if device.kind == "cuda" else f"host RAM: {device.name}"
    return f"{name} ({format_bytes(device.total_bytes)})"


def series_labels(profiles: Sequence[Profile]) -> tuple[list[str], list[str]]:
    """A label per profile naming only what differs between them, and title lines for what they share.

    The title's first line names the shared device, implementation and vramcal version, the second the
    shared model spec (or says that the specs differ).
    """
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


# ---------------------------------------------------------------------------------------------- facts

def reference_trials(profile: Profile) -> list[Trial]:
    """The trials of the profile's one-length fit: all of them, or for a calibration over several lengths
    those at the reference length (the others are in the sequence-length section)."""
    return profile.reference_trials


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
    """Why a trial that did not finish ended: the first line of its error (an ``error``'s exception, a
    ``timeout``'s limit, an ``oom``'s allocator message), cut to ``width`` characters; "" for a finished one."""
    if trial.status == "ok" or not trial.error:
        return ""
    line = trial.error.strip().splitlines()[0] if trial.error.strip() else ""
    return line if len(line) <= width else line[:width - 3] + "..."


def failure_words(profile: Profile, batch_size: int) -> str:
    """How the trials at ``batch_size`` failed, in words: ran out of memory or over usable memory, timed out, or
    failed with an error (the trials table gives its reason)."""
    usable = usable_bytes(profile)
    states = {trial_state(t, usable) for t in steady_equivalent(profile.reference_trials, profile.creep_rule)
              if t.batch_size == batch_size}
    if states & {"oom", "over-budget"} or not states:
        return "ran out of memory or over usable memory"
    return "timed out" if "timeout" in states else "failed with an error (its reason is in the trials table)"


def profile_rates(profile: Profile) -> list[Rate]:
    """The measured throughput at each batch size of the profile's one-length fit
    (:func:`vramcal.calibration.throughput.measured_rates`)."""
    return measured_rates(reference_trials(profile))


def profile_knee(profile: Profile) -> Knee | None:
    """The throughput knee among the sizes a run may use (up to the safe batch size; every measured size when the
    profile has no limits)."""
    limits = profile.limits
    high = limits.safe_batch_size if limits is not None and limits.safe_batch_size > 0 else None
    return find_knee(profile_rates(profile), 1, high)


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


# ---------------------------------------------------------------------------------------------- tables

def _bytes(n_bytes: float | None) -> str:
    return MISSING if n_bytes is None else format_bytes(n_bytes)


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
        ("status", False, lambda t: trial_state(t, usable)), ("peak", True, lambda t: _bytes(t.peak_bytes)),
        ("NVML peak", True, lambda t: _bytes(t.nvml_peak_bytes) + (f" ({t.nvml_source})" * bool(t.nvml_source))),
        ("NVML overhead", True, lambda t: _bytes(t.nvml_overhead_bytes)),
        ("torch max reserved", True, lambda t: _bytes(t.torch_max_reserved_bytes)),
        ("torch max allocated", True, lambda t: _bytes(t.torch_max_allocated_bytes)),
        ("RSS peak", True, lambda t: _bytes(t.rss_peak_bytes)),
        ("step time", True, lambda t: MISSING if t.step_s is None else _seconds(t.step_s)),
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


def _seconds(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _batch(n: int) -> str:
    return f"{n:,}" if n > 0 else "0 (nothing fits)"


def limits_table(rows: Sequence[GpuLimitRow], verified: bool, bold: bool = True) -> str:
    """The seed documents' "GPU-specific safe limits" table: GPU, total, usable, safe max, conservative.

    The measured device's row is marked (in bold unless ``bold`` is False, e.g. for a terminal).
    """
    mark = "**" if bold else ""
    body = []
    for row in rows:
        if row.measured:
            basis = f"{mark}measured{mark} ({'verified' if verified else 'NOT verified'})"
        else:
            basis = f"extrapolated; total = {row.gpu.source}"
        name = f"{mark}{row.gpu.label}{mark}" if row.measured else row.gpu.label
        body.append([name, format_bytes(row.gpu.total_bytes), _bytes(row.limits.usable_bytes),
                     _batch(row.limits.safe_batch_size), _batch(row.limits.conservative_batch_size), basis])
    gpus = any(row.gpu.nvml_name or not row.measured for row in rows)  # a host profile's table holds the host alone
    return markdown_table(["GPU" if gpus else "device", "total memory", "usable", "safe max", "conservative", "basis"],
                          body, right=[1, 2, 3, 4])


def limits_notes(profile: Profile) -> list[str]:
    """What the other-GPU rows assume, as sentences."""
    settings = profile.settings
    fit = profile.fit
    overhead = _bytes(fit.overhead_bytes) if fit else MISSING
    slope = _bytes(fit.slope_bytes_per_sample) if fit else MISSING
    usable = (f"Usable = total − {format_bytes(settings.reserve_bytes)} reserve − {settings.margin * 100:g} % "
              f"margin; safe max is the largest batch whose upper 95 % prediction bound fits in usable; conservative = "
              f"floor({settings.conservative_fraction:g} × safe max).")
    if profile.device.kind == "host":
        command = " ".join(["vramcal estimate", *family_of(profile.model).probe_args(profile.model),
                            '--gpus "H200,RTX 4090"'])
        return [usable, (f"A host profile is not carried to GPUs: host RAM in fp32 and a card's caching allocator, "
                         f"CUDA context and kernels hold different amounts. `{command}` estimates cards without a GPU, "
                         f"with the error bound learned from your profiles (`vramcal limits` on this profile prints "
                         f"it for the catalogue); `vramcal probe` on the card measures it.")]
    notes = [
        usable,
        (f"Rows other than the measured one are extrapolations: they assume this fit's overhead ({overhead}) "
         f"and slope ({slope} per sample) hold on that card. That is not exact: the CUDA context, cuBLAS "
         f"workspaces and the kernels chosen differ by card, driver and architecture. Probe the card itself "
         f"before relying on its row. The measured row is the limit the probe verified; a card of the same "
         f"size may differ from it by a few samples, since its row comes from the fit alone."),
    ]
    if profile.limits is not None and profile.limits.failed_batch_size is not None:
        failed = profile.limits.failed_batch_size
        notes.append(f"Batch {failed} {failure_words(profile, failed)} on the measured device, so cards with no "
                     f"more memory are capped below it.")
    if profile.device.kind == "host":
        notes.append("This profile was measured in host RAM, not on a GPU: its overhead is the Python process "
                     "with torch's CPU libraries and no CUDA context, so the GPU rows are orders of magnitude, "
                     "not limits.")
    return notes


# ---------------------------------------------------------------------------------------------- markdown

def summary_table(profile: Profile) -> str:
    """Device, software, model, fit, usable/safe/conservative, verification, throughput, provenance."""
    device, fit, limits, settings = profile.device, profile.fit, profile.limits, profile.settings
    usable = usable_bytes(profile)
    software = ", ".join(f"{k} {v}" for k, v in sorted(profile.software.items()) if v) or MISSING
    drivers = ", ".join(x for x in (device.driver_version and f"driver {device.driver_version}",
                                    device.cuda_driver_version and f"CUDA {device.cuda_driver_version}") if x)
    device_text = f"{device_label(profile)}; total from {device.total_source}" + f"; {drivers}" * bool(drivers)
    rows = [("Device", device_text),
            ("Software", software),
            ("Model", _model_text(profile)),
            ("Data held", _data_text(profile)),
            ("Implementation", f"{profile.implementation}: {profile.kernel_path}")]
    if fit is not None:
        rows.append(("Memory model", (f"`{fit.formula()}`; r² = {fit.r_squared:.4f}, n = {fit.n_points}, "
                                     f"s = {format_bytes(fit.residual_stderr_bytes)}; overhead ± "
                                     f"{format_bytes(fit.overhead_stderr_bytes)}, slope ± "
                                     f"{format_bytes(fit.slope_stderr_bytes_per_sample)} per sample")))
    else:
        rows.append(("Memory model", "**none** (fewer than 3 successful trials)"))
    rows.append(("Step creep", _creep_text(profile)))
    if profile.world is not None:
        rows.append((f"{profile.world.strategy.upper()} world", world_text(profile)))
    rows.append(("Usable memory", (f"{format_bytes(usable)} = total − {format_bytes(settings.reserve_bytes)} "
                                   f"− "
                                  f"{settings.margin * 100:g} % of total")))
    if limits is not None:
        tag = "" if profile.verified else " (**not verified**: extrapolation only)"
        rows += [("Safe batch size", (f"**{_batch(limits.safe_batch_size)}**{tag}; upper 95 % bound ≤ usable "
                                     f"(point estimate: {_batch(limits.point_safe_batch_size)})")),
                 ("Conservative batch size", (f"**{_batch(limits.conservative_batch_size)}**{tag}; "
                                             f"{settings.conservative_fraction:g} × safe"))]
    else:
        why = "**none** (no fit)" if fit is None else "**none** (the fitted line does not rise: no limit follows)"
        rows += [("Safe batch size", why), ("Conservative batch size", why)]
    rows.append(("Verification", _verification_text(profile, usable)))
    knee = profile_knee(profile)
    if knee is not None:
        rows.append(("Throughput", knee_text(knee)))
    rows.append(("Profile", (f"made {profile.created_utc or MISSING} (UTC) by vramcal "
                            f"{profile.vramcal_version or MISSING}, schema {profile.schema_version}")))
    return markdown_table(["", ""], [[f"**{k}**", v] for k, v in rows])


def world_text(profile: Profile) -> str:
    """A DDP profile's world and its DDP term, for people: ``DDP 2 ranks (gloo, buckets 25 MiB): limits per rank
    (global batch = 2 × per rank); DDP term +12.0 MiB per rank at batch 81 against a single-process profile
    (predicted 2.31 GiB there)``."""
    world = profile.world
    line = (f"{world.describe()}: limits per rank (global batch = {world.nproc} × per rank); every rank's peak in "
            f"the trials, the largest fitted")
    states = profile.model_info.get("model_state_bytes"), profile.model_info.get("rank_model_state_bytes")
    if world.strategy == "fsdp" and all(isinstance(n, int) for n in states):
        line += (f"; model states (parameters, gradients, optimizer state) {format_bytes(states[0])} whole, "
                 f"{format_bytes(states[1])} on each rank (counted): `vramcal limits --world-size N` carries the "
                 f"limits to other world sizes")
    term = profile.single_process
    if term is None:
        return line + "; world term: no single-process profile of this model and device to compare with"
    return (line + f"; world term {term['term_bytes'] / 2**20:+.1f} MiB per rank at batch {term['batch_size']} "
                   f"against the single-process profile `{Path(term['profile']).name}` (predicted "
                   f"{format_bytes(term['predicted_peak_bytes'])} there; its safe size "
                   f"{term['single_safe_batch_size']})")


def knee_text(knee: Knee) -> str:
    """``best 49.8 samples/s at batch 8; throughput knee (95 % of it) at batch 8 (above 1)``, with the intervals."""
    where = f", somewhere in ({knee.below}, {knee.batch_size}]" if knee.below is not None else ""
    if knee.refused:
        return (f"best {rate_text(knee.best)} samples/s at batch {knee.best.batch_size}; no throughput knee: "
                f"{knee.refused}")
    return (f"best {rate_text(knee.best)} samples/s at batch {knee.best.batch_size}; throughput knee (the smallest "
            f"measured batch reaching {knee.fraction * 100:g} % of it) at batch {knee.batch_size}: "
            f"{rate_text(knee.rate)} samples/s{where}")


def rate_text(rate: Rate) -> str:
    """``30.1 (27.2–33.5)``: samples/s with its 95 % interval when there is one."""
    if rate.low_samples_per_s is None:
        return format_rate(rate.samples_per_s)
    high = format_rate(rate.high_samples_per_s) if rate.high_samples_per_s is not None else "∞"
    return f"{format_rate(rate.samples_per_s)} ({format_rate(rate.low_samples_per_s)}–{high})"


def _model_text(profile: Profile) -> str:
    n_params = profile.model_info.get("n_params")
    count = f"{n_params:,} parameters, " if isinstance(n_params, int) else ""
    return f"{describe(profile.model)} ({count}factory `{profile.model.factory}`, key {profile.model.key()})"


def _data_text(profile: Profile) -> str:
    data = profile.data
    where = "on the device" if data.get("on_device") else "in host memory"
    return (f"{data.get('source', MISSING)}: {format_bytes(data.get('data_bytes', 0))} {where}; "
            f"{format_bytes(profile.pool_data_bytes)} of it in the measured memory (the data term of sizing)")


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


def creep_shape(creep) -> str:
    """How the steady trial's peak moved, in words a reader of the README follows: ``, level from step 7 on``,
    ``, flat`` or ``, still rising (+4.0 MiB over its last steps)``; what the validation pass it ran as an epoch's
    end did (``; a validation pass after step 2, as at an epoch's end, added 1.50 MiB``, with ``, under the 0.1 %
    counted as a rise`` when the curve was level before it); and how much of the creep was measured and how much is
    the allowance for later steps. Nothing for a profile made before the steady trial's curve was recorded."""
    if creep.steps is None:
        return ""
    epoch = ""
    if creep.epoch_end_step is not None:
        rise = f"added {format_bytes(creep.epoch_end_rise_bytes)}" if creep.epoch_end_rise_bytes else "added nothing"
        if creep.epoch_end_rise_bytes and creep.levelled_at is not None and creep.levelled_at < creep.epoch_end_step:
            rise += f", under the {PLATEAU_TOLERANCE:.1%} counted as a rise"  # level before the epoch's end: say why
        epoch = f"; a validation pass after step {creep.epoch_end_step}, as at an epoch's end, {rise}"
    later = (f"; of the creep, {format_bytes(creep.bytes_at_steady - creep.late_bytes)} measured and "
             f"{format_bytes(creep.late_bytes)} allowed for later steps" if creep.late_bytes else "")
    if creep.late_bytes and creep.bytes_at_steady <= creep.late_bytes and creep.levelled_at is not None:
        return f", flat{epoch}; all of the creep is the allowance for later steps"
    if creep.levelled_at is not None:
        return f", level from step {creep.levelled_at} on{epoch}{later}"
    return f", still rising (+{format_bytes(creep.late_rise_bytes)} over its last steps){epoch}{later}"


def _creep_text(profile: Profile) -> str:
    creep, steps = profile.creep, profile.run.get("steady_steps")
    if creep is None:
        return ("not measured (`--steady-steps 0`, or no steady trial finished): predictions are a trial's "
                "few steps, and a long run may peak a few percent higher" if steps is not None else MISSING)
    return (f"+{format_bytes(creep.per_sample_bytes)} per sample, in the model and the limits: a steady trial of "
            f"{creep.steps or steps} steps at batch {creep.batch_size} peaked {format_bytes(creep.steady_peak_bytes)} "
            f"against {format_bytes(creep.short_peak_bytes)} for the short trials there "
            f"(+{creep.bytes_at_steady / creep.short_peak_bytes:.1%}){creep_shape(creep)}; the trials table shows "
            f"raw peaks")


def _verification_text(profile: Profile, usable: int) -> str:
    if not profile.verification:
        return "**none**: no verification trial ran"
    parts = []
    for kind in ("safe", "conservative"):
        v = profile.verification.get(kind)
        if v is None:
            parts.append(f"{kind}: not run")
            continue
        peak = (f", peak {format_bytes(v.peak_bytes)} ({v.peak_bytes / usable * 100:.0f} % of usable)"
                if v.peak_bytes is not None and usable > 0 else "")
        parts.append(f"{kind} batch {v.batch_size}: {'passed' if v.passed else '**FAILED**'}{peak}")
    return "; ".join(parts)


def lengths_section(profile: Profile, level: str) -> list[str]:
    """For a calibration over several lengths: the model in batch_size × seq_len and each length's limits."""
    surface = profile.surface
    if surface is None:
        return []
    fit = surface.fit
    rows = []
    for entry in surface.lengths:
        n = sum(1 for t in profile.trials if t.seq_len == entry.seq_len)
        rows.append([str(entry.seq_len), _batch(entry.safe_batch_size), _batch(entry.conservative_batch_size),
                     "yes" if entry.verified else "**no**", _bytes(entry.safe_peak_bytes), str(n),
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
    rows = [[f"{r.batch_size:,}", rate_text(r), _seconds(r.step_s),
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
                     f"{p.fit.r_squared:.4f}" if p.fit else MISSING, _bytes(usable_bytes(p)),
                     _batch(limits.safe_batch_size) if limits else MISSING,
                     _batch(limits.conservative_batch_size) if limits else MISSING,
                     "yes" if p.verified else "**no**"])
    lines += ["## Comparison", "", markdown_table(["profile", "memory model", "r²", "usable", "safe",
                                                   "conservative", "verified"], body, right=[2, 3, 4, 5]), ""]
    for label, p in zip(labels, profiles):
        lines += [f"## {label}", ""] + profile_section(p, extra_gpus, level="###", forecast=forecast)
    return "\n".join(lines).rstrip() + "\n"
