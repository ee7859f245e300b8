"""The report's summary table of one profile, and the sentences ``vramcal limits`` prints from it too."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from vramcal.calibration.creep import PLATEAU_TOLERANCE
from vramcal.calibration.throughput import Knee, rate_text
from vramcal.models.registry import describe
from vramcal.report.facts import batch_text, device_label, profile_knee, usable_bytes
from vramcal.report.table import MISSING, markdown_table
from vramcal.units import format_bytes

if TYPE_CHECKING:
    from vramcal.profile import Profile


def summary_table(profile: Profile) -> str:
    """Device, software, model, fit, usable/safe/conservative, verification, throughput, provenance."""
    device, fit, limits, settings = profile.device, profile.fit, profile.limits, profile.settings
    usable = usable_bytes(profile)
    software = ", ".join(f"{k} {v}" for k, v in sorted(profile.software.items()) if v) or MISSING
    drivers = ", ".join(x for x in (device.driver_version and f"driver {device.driver_version}",
                                    device.cuda_driver_version and f"CUDA {device.cuda_driver_version}") if x)
    device_text = f"{device_label(profile)}; total from {device.total_source}" + f"; {drivers}" * bool(drivers)
    rows = [("Device", device_text), ("Software", software), ("Model", _model_text(profile)),
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
    rows.append(("Usable memory", (f"{format_bytes(usable)} = total − {format_bytes(settings.reserve_bytes)} − "
                                   f"{settings.margin * 100:g} % of total")))
    if limits is not None:
        tag = "" if profile.verified else " (**not verified**: extrapolation only)"
        rows += [("Safe batch size", (f"**{batch_text(limits.safe_batch_size)}**{tag}; upper 95 % bound ≤ usable "
                                     f"(point estimate: {batch_text(limits.point_safe_batch_size)})")),
                 ("Conservative batch size", (f"**{batch_text(limits.conservative_batch_size)}**{tag}; "
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
    """A DDP or FSDP profile's world and its world term against a single-process profile, for people."""
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
    """``best 49.8 samples/s at batch 8; throughput knee (...) at batch 8: ...``, with the intervals."""
    where = f", somewhere in ({knee.below}, {knee.batch_size}]" if knee.below is not None else ""
    if knee.refused:
        return (f"best {rate_text(knee.best)} samples/s at batch {knee.best.batch_size}; no throughput knee: "
                f"{knee.refused}")
    return (f"best {rate_text(knee.best)} samples/s at batch {knee.best.batch_size}; throughput knee (the smallest "
            f"measured batch reaching {knee.fraction * 100:g} % of it) at batch {knee.batch_size}: "
            f"{rate_text(knee.rate)} samples/s{where}")


def creep_shape(creep) -> str:
    """How the steady trial's peak moved (``, level from step 7 on``, ``, flat``, ``, still rising (...)``), what
    its epoch-end validation pass added, and how much creep was measured against allowed for later steps; "" for a
    profile made before the steady trial's curve was recorded."""
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


def _model_text(profile: Profile) -> str:
    n_params = profile.model_info.get("n_params")
    count = f"{n_params:,} parameters, " if isinstance(n_params, int) else ""
    return f"{describe(profile.model)} ({count}factory `{profile.model.factory}`, key {profile.model.key()})"


def _data_text(profile: Profile) -> str:
    data = profile.data
    where = "on the device" if data.get("on_device") else "in host memory"
    return (f"{data.get('source', MISSING)}: {format_bytes(data.get('data_bytes', 0))} {where}; "
            f"{format_bytes(profile.pool_data_bytes)} of it in the measured memory (the data term of sizing)")


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
