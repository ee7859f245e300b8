"""What the commands print for people: one line per trial, a calibration's summary, past training runs (their
peaks against the prediction, their epoch times against the forecast)."""

from __future__ import annotations

import contextvars

import click

from vramcal.calibration.evaluation import is_evaluation
from vramcal.calibration.throughput import rate_text
from vramcal.forecast import FAR, observation_verdict
from vramcal.report.markdown import creep_shape, world_text
from vramcal.sizing import fitted_from, verdict
from vramcal.units import format_bytes, format_duration, format_rate

# How much the commands say as they go (vramcal -q / -v): -1 quiet, 0 normal, 1 verbose.
VERBOSITY: contextvars.ContextVar[int] = contextvars.ContextVar("vramcal_verbosity", default=0)


def summary(profile) -> str:
    """The probe's closing lines for people: formula, usable, safe and conservative, verification."""
    lines = [f"{profile.device.name}: {format_bytes(profile.device.total_bytes)} total"]
    fit, limits = profile.fit, profile.limits
    if fit is None or limits is None:
        lines.append("no fit: " + "; ".join(profile.warnings))
        return "\n".join(lines)
    lines.append(f"{fit.formula()}   (r² = {fit.r_squared:.4f}; {points_text(profile)})")
    creep = profile.creep
    if creep is not None:
        lines.append(f"step creep    +{format_bytes(creep.bytes_at_steady)} at batch_size {creep.batch_size}: how much "
                     f"more a long run peaks than a trial's few steps, from a steady trial of "
                     f"{creep.steps or profile.run.get('steady_steps', '?')} steps{creep_shape(creep)}; included in "
                     f"the line, the limits and the verified peaks")
    if profile.world is not None:
        lines.append(f"world         {world_text(profile).replace('`', '')}")
    lines.append(f"usable        {format_bytes(limits.usable_bytes)}")
    for name, value in (("safe", limits.safe_batch_size), ("conservative", limits.conservative_batch_size)):
        check = profile.verification.get(name)
        state = (f"verified: peak {format_bytes(check.peak_bytes)}" if check and check.passed
                 else "NOT verified")
        lines.append(f"{name:<13} batch_size {value:<6} ({state})")
    lines.append(f"(point estimate without the prediction interval, the plain formula "
                 f"floor((usable - overhead) / slope): {limits.point_safe_batch_size})")
    if profile.surface is not None:
        surface = profile.surface
        lines.append(f"over seq_len: {surface.fit.formula()}   (r² = {surface.fit.r_squared:.4f}, "
                     f"{surface.fit.n_points} points; the lines above are seq_len {surface.reference_seq_len})")
        if surface.fit.negative_terms():
            lines.append(f"  ({surface.fit.negative_terms()})")
        lines += [f"  seq_len {e.seq_len:>6}  safe {e.safe_batch_size:<7} conservative {e.conservative_batch_size:<7} "
                  f"({'verified' if e.verified else 'NOT verified'})" for e in surface.lengths]
        lines += lengths_summary(profile)
    lines += evaluation_lines(profile)
    lines.extend(f"warning: {w}" for w in profile.warnings)
    return "\n".join(lines)


def points_text(profile) -> str:
    """Which trials the line goes through, for people: ``5 of the 8 trials are its points (batch_size 46, 76, 85 ×2,
    138): the line is fitted near the limit``. The others are the flat start, sizes far below the largest measured,
    trials that measured nothing, and the steady trial (the step creep's): the report's trials table marks each."""
    fit, counted = profile.fit, {}
    for size in sorted(fit.batch_sizes):
        counted[size] = counted.get(size, 0) + 1
    sizes = ", ".join(f"{size}{f' ×{n}' if n > 1 else ''}" for size, n in counted.items())
    length = profile.surface.reference_seq_len if profile.surface is not None else None  # the line's length
    trials = len([t for t in profile.trials if t.seq_len == length and not is_evaluation(t)])
    return (f"{fit.n_points} of the {trials} trials are its points (batch_size {sizes}): the line is fitted near "
            f"the limit")


def evaluation_lines(profile) -> list[str]:
    """The evaluation limit beside the training limit (``vramcal probe --eval``), or nothing without one."""
    found, limits = profile.evaluation, profile.limits
    if found is None:
        return []
    if found.limits is None or found.fit is None or limits is None:
        return ["evaluation    no limit: too few evaluation trials fitted (validate at the training batch size)"]
    lines = [f"evaluation    {found.fit.formula().replace('peak', 'eval_peak')}   (r² = {found.fit.r_squared:.4f}, "
             f"{found.fit.n_points} points, after training steps at batch_size {found.train_batch_size})"]
    for name, value, peak in (("safe", found.limits.safe_batch_size, found.safe_peak_bytes),
                              ("conservative", found.limits.conservative_batch_size, found.conservative_peak_bytes)):
        state = f"verified: peak {format_bytes(peak)}" if peak is not None else "NOT verified"
        lines.append(f"  eval {name:<12} batch_size {value:<6} ({state})")
    train = limits.safe_batch_size
    if train > 0:
        lines.append(f"  the evaluation pass fits {found.limits.safe_batch_size / train:.2f} x the training batch "
                     f"(safe {found.limits.safe_batch_size} against {train}: "
                     f"{format_bytes(found.fit.slope_bytes_per_sample)} a sample against "
                     f"{format_bytes(profile.fit.slope_bytes_per_sample)})")
    return lines


def lengths_summary(profile) -> list[str]:
    """Over several lengths: the token budget and whether its worst batches were verified (issue 41)."""
    sized = profile.lengths
    if sized is None or sized.budget is None:
        return [] if sized is None else [f"token budget: none ({sized.note})"]
    checks = [sized.verification.get(name) for name in ("budget", "conservative_budget")]
    state = "; ".join(f"{name} verified at batch_size {c.batch_size} x seq_len {c.seq_len}: peak "
                      f"{format_bytes(c.peak_bytes)}" if c and c.passed else f"{name} NOT verified"
                      for name, c in zip(("safe", "conservative"), checks))
    budget = sized.budget
    return [f"token budget  {budget.tokens:,} tokens per batch, conservative {budget.conservative_tokens:,} ({state}); "
            f"vramcal limits --buckets/--token-budget for the tables"]


def observations_lines(profile) -> list[str]:
    """How the training runs that used the profile compared with its prediction, one line each."""
    if not profile.observations:
        return ["training runs: none recorded yet"]
    lines = [f"training runs ({len(profile.observations)}): measured peak against the prediction"]
    start = fitted_from(profile)
    for o in profile.observations:
        mark = verdict(o.peak_bytes, o.line_bytes, o.usable_bytes, o.batch_size, start)
        mark = "OUT OF MEMORY" if o.out_of_memory else mark.upper() if mark == "above usable" else mark
        peak = (">= " if o.peak_unseen else "") + format_bytes(o.peak_bytes)  # a lower bound: part was not seen
        lines.append(f"  {o.recorded_utc}  batch_size {o.batch_size:>6}  peak {peak:>10}  "
                     f"predicted {format_bytes(o.predicted_peak_bytes):>10} ({o.error:+.1%})  {mark}  "
                     f"[{o.steps} step{'s' * (o.steps != 1)}, vramcal {o.vramcal_version}]")
        if o.epoch_s is not None:
            lines.append(f"  {'':20}  {time_line(o)}")
    return lines


def time_line(o) -> str:
    """An observation's measured epoch time and samples/s beside the forecast's, and how far apart they are."""
    rate = f", {format_rate(o.samples_per_s)} samples/s" if o.samples_per_s else ""
    if o.time_error is None:
        return f"epoch {format_duration(o.epoch_s)}{rate} (no forecast)"
    forecast_rate = f", {format_rate(o.forecast_samples_per_s)} samples/s" if o.forecast_samples_per_s else ""
    found = observation_verdict(o)
    return (f"epoch {format_duration(o.epoch_s)}{rate}: forecast {format_duration(o.forecast_epoch_s)}{forecast_rate} "
            f"({o.time_error:+.1%}, {found.upper() if found == FAR else found})")


def echo_lines(text: str | list[str], err: bool = False) -> None:
    for line in [text] if isinstance(text, str) else text:
        click.echo(line, err=err)


def estimate_lines(found) -> list[str]:
    """The estimate for people: what was traced, the formula, the card's choices and the bound per trace, the table
    (a card's row per kernel path), each row's peak at the batch size asked, the notices."""
    wall_s = sum(e.wall_s for e in found.estimates)
    out = [f"estimated, not measured: {found.describe()} (traced on fake tensors in {wall_s:.1f} s)"]
    out += found.formulas
    out.append(f"{'card':<24} {'path':<12} {'total':>10} {'usable':>10} {'safe':>8} {'conservative':>13} "
               f"{'est. peak':>10} {'up to':>10}")
    for row in found.rows:
        out.append(f"{row.card:<24} {row.path or '-':<12} {format_bytes(row.total_bytes):>10} "
                   f"{format_bytes(row.usable_bytes):>10} {row.safe_batch_size:>8} {row.conservative_batch_size:>13} "
                   f"{format_bytes(row.peak_bytes):>10} {format_bytes(row.worst_bytes):>10}")
    for row in (r for r in found.rows if r.asked):
        at = row.asked
        out.append(f"at batch_size {at['batch_size']} on {row.card}{f' ({row.path})' if row.path else ''}: peak "
                   f"{format_bytes(at['peak_bytes'])} (allocated {format_bytes(at['allocated_bytes'])}, reserved "
                   f"{format_bytes(at['reserved_bytes'])}, + {format_bytes(at['baseline_bytes'])} baseline, "
                   f"{format_bytes(at['data_bytes'])} data), up to {format_bytes(at['worst_bytes'])}: "
                   f"{'fits' if at['fits'] else 'does NOT fit'} in {format_bytes(at['usable_bytes'])} usable")
    out += found.notices
    return out


def variant_lines(rows) -> list[str]:
    """The variants of one model (:func:`vramcal.sizing.variants.variant_rows`) for people: limits, bytes per sample,
    samples/s at the conservative size and at the knee, samples/s per GiB of predicted peak there."""
    out = [f"variants of this model ({len(rows)}, each its own profile; `vramcal train --variant auto` takes the "
           f"fastest for its batch):",
           f"  {'variant':<36} {'verified':>8} {'safe':>7} {'conserv.':>8} {'per sample':>10} "
           f"{'samples/s at conserv.':>22} {'knee':>14} {'samples/s/GiB':>13}"]
    for row in rows:
        limits, fit = row.profile.limits, row.profile.fit
        safe, conservative = (limits.safe_batch_size, limits.conservative_batch_size) if limits else ("—", "—")
        knee = f"{row.knee_batch_size} ({rate_text(row.knee_rate)})" if row.knee_batch_size else "—"
        rate = rate_text(row.rate_conservative) if row.rate_conservative else "—"
        per_gib = f"{row.samples_per_s_per_gib:.3g}" if row.samples_per_s_per_gib else "—"
        out.append(f"  {row.label:<36} {'yes' if row.profile.verified else 'no':>8} {safe:>7} {conservative:>8} "
                   f"{format_bytes(fit.slope_bytes_per_sample) if fit else '—':>10} {rate:>22} {knee:>14} "
                   f"{per_gib:>13}")
    return out
