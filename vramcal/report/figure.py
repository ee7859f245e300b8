"""The report's figure: peak memory and throughput against batch size, one colour per profile.

Memory: each trial's peak with the step creep added (filled: ok, open triangle: over budget, cross at usable:
out of memory), the steady trial's own peak (diamond), the fitted line with its 95 % band, the warning line
(:func:`vramcal.sizing.repeat_spread`), total and usable memory, the safe, conservative and out-of-memory batch
sizes. Throughput: samples/s per batch size with 95 % whiskers, the knee starred, sizes above safe hollow; over
several lengths, safe size against seq_len. Legends sit below the panels. matplotlib loads only to draw (Agg, no
pyplot); the PNG is deterministic (fixed size and dpi, no metadata).
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vramcal.calibration.creep import STEADY, steady_equivalent
from vramcal.calibration.surface import answer_at
from vramcal.report.facts import profile_knee, profile_rates, safe_size, series_labels, trial_state, usable_bytes
from vramcal.sizing import repeat_spread
from vramcal.units import format_bytes, format_rate

if TYPE_CHECKING:
    from vramcal.profile import Profile

GIB = 2**30
FIGSIZE_IN = (14.0, 7.6)
DPI = 100
COLORS = ("#1f5fa8", "#d1562b", "#2a8c4a", "#8a46b0", "#b08a16", "#3a9fb0")
KEY = "#333333"
OOM_COLOR = "#c0392b"
BOUNDARY_STYLE = (0, (6, 2, 1, 2, 1, 2))  # dash-dot-dot: not the safe (--), conservative (-.) or usable (:) line
LOG_SPREAD = 8  # several profiles' largest batch sizes this many times apart: a log batch axis
LEGEND_WIDTH = 120  # characters of a profile's legend line before it wraps
KEY_WIDTH = 62  # characters of a style key's entry (or a single profile's) before it wraps


def render_png(profiles: Sequence[Profile]) -> bytes:
    """The figure as PNG bytes (``FIGSIZE_IN`` × ``DPI`` pixels)."""
    return png_bytes(build_figure(profiles))


def png_bytes(figure: Any, dpi: int = DPI) -> bytes:
    """``figure`` as deterministic PNG bytes (no ``Software`` or date metadata)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, metadata={"Software": None})
    return buffer.getvalue()


def log2_axis(axis: Any) -> None:
    """A base-2 log scale on ``axis`` (an x or y axis), its ticks as plain numbers."""
    getattr(axis.axes, f"set_{axis.axis_name}scale")("log", base=2)
    axis.set_major_formatter("{x:g}")


def build_figure(profiles: Sequence[Profile]) -> Any:
    """The matplotlib ``Figure`` (Agg canvas): memory, throughput and, over several lengths, safe size by seq_len."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels, title = series_labels(profiles)
    lengths = any(p.surface for p in profiles)
    figure = Figure(figsize=(FIGSIZE_IN[0] * (1.3 if lengths else 1), FIGSIZE_IN[1]), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 3 if lengths else 2, width_ratios=[1.5, 1, 1] if lengths else [1.5, 1])
    memory_ax, speed_ax = axes[0], axes[1]
    colors = [COLORS[i % len(COLORS)] for i in range(len(profiles))]
    log_batches = _spread_out(profiles)
    for profile, color in zip(profiles, colors):
        _draw_memory(memory_ax, profile, color, log_batches, len(profiles) == 1)
        _draw_speed(speed_ax, profile, color)
        if lengths:
            _draw_lengths(axes[2], profile, color)
    _draw_memory_lines(memory_ax, profiles, colors)
    _format_axes(memory_ax, speed_ax, profiles, log_batches)
    handles = [_series_handle(p, c) for p, c in zip(profiles, colors)]
    if len(profiles) == 1:  # each panel carries its own short entry
        memory_key = [handles[0](textwrap.fill(_fit_text(profiles[0]), KEY_WIDTH + 6)), *_memory_key(profiles)]
        speed_key = [handles[0](textwrap.fill(_speed_text(profiles[0]), KEY_WIDTH)), *_speed_key(profiles)]
    else:  # one full-width entry per profile under both panels; the style keys under each panel
        memory_key, speed_key = _memory_key(profiles), _speed_key(profiles)
        figure.legend(handles=[make(textwrap.fill(f"{label}: {_fit_text(p, short=True)}; {_speed_text(p, short=True)}",
                                                  LEGEND_WIDTH, subsequent_indent="    "))
                               for make, label, p in zip(handles, labels, profiles)],
                      loc="outside lower center", ncol=1, fontsize=8.5, frameon=False)
    memory_ax.legend(handles=memory_key, loc="upper center", bbox_to_anchor=(0.5, -0.11),
                     ncol=2, fontsize=8.5, frameon=False)
    speed_ax.legend(handles=speed_key, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=1,
                    fontsize=8.5, frameon=False)
    if len(profiles) == 1 and profiles[0].fit is None:
        memory_ax.text(0.5, 0.55, "no fit: fewer than 3 successful trials\nno line and no limits are drawn",
                       transform=memory_ax.transAxes, ha="center", va="center", fontsize=12, color="#888888")
    figure.suptitle("\n".join([*title, *_world_line(profiles)]), fontsize=12)
    return figure


def _spread_out(profiles: Sequence[Profile]) -> bool:
    """Whether the profiles' largest batch sizes lie more than :data:`LOG_SPREAD` times apart."""
    tops = [max((t.batch_size for t in p.reference_trials), default=1) for p in profiles]
    return len(profiles) > 1 and max(tops) > LOG_SPREAD * min(tops)


def _world_line(profiles: Sequence[Profile]) -> list[str]:
    """The title's line for DDP or FSDP profiles."""
    worlds = {p.world.describe() for p in profiles if p.world is not None}
    if not worlds:
        return []
    if len(worlds) == 1 and all(p.world is not None for p in profiles):
        nproc = profiles[0].world.nproc  # type: ignore[union-attr]
        return [f"{worlds.pop()}: memory, batch sizes and samples/s per rank (the global batch is {nproc} × per rank)"]
    return ["DDP/FSDP worlds among them: their memory, batch sizes and samples/s are per rank"]


def _draw_memory(ax: Any, profile: Profile, color: str, log_batches: bool = False, single: bool = True) -> None:
    usable = usable_bytes(profile)
    trials = profile.reference_trials
    states = [(trial, trial_state(trial, usable)) for trial in steady_equivalent(trials, profile.creep_rule)]
    steady = [(t.batch_size, t.peak_bytes / GIB) for t in trials if t.purpose == STEADY and t.ok]
    if steady:
        ax.scatter(*zip(*steady), marker="D", facecolors="none", edgecolors=color, s=60, linewidths=1.4, zorder=5)
    ok = [(t.batch_size, t.peak_bytes / GIB) for t, s in states if s == "ok"]
    over = [(t.batch_size, t.peak_bytes / GIB) for t, s in states if s == "over-budget"]
    oom = [(t.batch_size, usable / GIB) for t, s in states if s == "oom"]
    if ok:
        ax.scatter(*zip(*ok), marker="o", color=color, s=30, zorder=4)
    if over:
        ax.scatter(*zip(*over), marker="^", facecolors="none", edgecolors=color, s=70, linewidths=1.4, zorder=4)
    if oom:
        ax.scatter(*zip(*oom), marker="X", color=OOM_COLOR, edgecolors=color, s=70, zorder=5)
    fit, limits = profile.fit, profile.limits
    if fit is None:
        return
    import numpy as np

    boundary = _boundary(profile)
    right = max([t.batch_size for t in trials] + [limits.safe_batch_size if limits else 0, boundary or 0]) * 1.08
    grid = np.geomspace(1, max(right, 2.0), 240) if log_batches else np.linspace(0, max(right, 1.0), 240)
    ax.plot(grid, [fit.predict(b) / GIB for b in grid], color=color, lw=1.6, zorder=3)
    ax.fill_between(grid, [fit.lower(b) / GIB for b in grid], [fit.upper(b) / GIB for b in grid],
                    color=color, alpha=0.18, lw=0, zorder=2)
    spread, _ = repeat_spread(profile)  # the warning line: what a run's peak is held against (vramcal.sizing)
    ax.plot(grid, [max(fit.upper(b), fit.predict(b) * (1 + spread)) / GIB for b in grid], color=color, lw=0.9,
            ls=(0, (1, 2)), alpha=0.8, zorder=3, gid="warning-line")
    if safe_size(profile):
        ax.axvline(limits.safe_batch_size, color=color, ls="--", lw=1.2)
        ax.axvline(limits.conservative_batch_size, color=color, ls="-.", lw=1.2)
    if boundary is not None:
        ax.axvline(boundary, color=OOM_COLOR if single else color, ls=BOUNDARY_STYLE, lw=1.4, zorder=2,
                   gid="oom-boundary")
        ax.scatter([boundary], [profile.device.total_bytes / GIB], marker="v", color=OOM_COLOR, s=45, zorder=5)


def _boundary(profile: Profile) -> float | None:
    """Where the line reaches total memory (samples), None when unknown."""
    limits = profile.limits
    if limits is None or not math.isfinite(limits.boundary_batch_size) or limits.boundary_batch_size <= 0:
        return None
    return limits.boundary_batch_size


def band_text(profile: Profile) -> str:
    """The 95 % band's half-width at the safe size (the largest fit point without limits), for the key."""
    fit = profile.fit
    if fit is None:
        return ""
    at = safe_size(profile) or max(fit.batch_sizes)
    half, peak = fit.half_width(at), max(fit.predict(at), 1.0)
    thin = ": thinner than the line" if half < 0.005 * profile.device.total_bytes else ""
    return f" ±{format_bytes(half)} at {at:,}, {half / peak:.2%}{thin}"


def _draw_memory_lines(ax: Any, profiles: Sequence[Profile], colors: Sequence[str]) -> None:
    """Total (solid) and usable (dotted) memory, once per distinct pair; grey when all profiles share it."""
    pairs = [(p.device.total_bytes, usable_bytes(p)) for p in profiles]
    for (total, usable), color in dict(zip(pairs, colors)).items():
        color = "#555555" if len(set(pairs)) == 1 else color
        ax.axhline(total / GIB, color=color, lw=1.4, zorder=1)
        ax.axhline(usable / GIB, color=color, lw=1.4, ls=":", zorder=1)


def _draw_speed(ax: Any, profile: Profile, color: str) -> None:
    rates = profile_rates(profile)
    if not rates:
        return
    sizes, values = [r.batch_size for r in rates], [r.samples_per_s for r in rates]
    # a faint line: neighbouring batch sizes often differ by noise (a busy host), not by a trend
    ax.plot(sizes, values, color=color, lw=1.0, alpha=0.35, zorder=3)
    below = [r.samples_per_s - r.low_samples_per_s if r.low_samples_per_s is not None else 0.0 for r in rates]
    above = [r.high_samples_per_s - r.samples_per_s if r.high_samples_per_s is not None else 0.0 for r in rates]
    ax.errorbar(sizes, values, yerr=[below, above], fmt="none", ecolor=color, elinewidth=0.9, capsize=2, alpha=0.6,
                zorder=3)
    safe = safe_size(profile)
    runs = [(r.batch_size, r.samples_per_s) for r in rates if safe is None or r.batch_size <= safe]
    past = [(r.batch_size, r.samples_per_s) for r in rates if safe is not None and r.batch_size > safe]
    if runs:
        ax.scatter(*zip(*runs), color=color, s=22, zorder=4)
    if past:  # no run takes these sizes: "best" and the knee leave them out
        ax.scatter(*zip(*past), facecolors="none", edgecolors=color, s=30, linewidths=1.1, zorder=4, gid="above-safe")
    steady = [r for r in rates if r.steady]
    if steady:
        ax.scatter([r.batch_size for r in steady], [r.samples_per_s for r in steady], marker="D", facecolors="none",
                   edgecolors=color, s=60, linewidths=1.2, zorder=4)
    knee = profile_knee(profile)
    if knee is not None and not knee.refused and len(rates) > 1:
        ax.scatter([knee.batch_size], [knee.rate.samples_per_s], marker="*", s=170, color=color, edgecolors="black",
                   linewidths=0.6, zorder=5)
    limits = profile.limits
    if limits is not None and 0 < limits.safe_batch_size <= 4 * max(sizes):
        ax.axvline(limits.safe_batch_size, color=color, ls="--", lw=1.0, alpha=0.7)
        ax.axvline(limits.conservative_batch_size, color=color, ls="-.", lw=1.0, alpha=0.7)


def _faster_abovesafe_size(profile: Profile) -> Any:
    """The fastest measured rate above the safe size when it beats "best" (which stops at safe), else None."""
    safe, knee = safe_size(profile), profile_knee(profile)
    past = [r for r in profile_rates(profile) if safe is not None and r.batch_size > safe]
    fastest = max(past, key=lambda r: r.samples_per_s, default=None)
    return fastest if fastest is not None and knee is not None and fastest.samples_per_s > knee.best.samples_per_s \
        else None


def _draw_lengths(ax: Any, profile: Profile, color: str) -> None:
    """Safe batch size against seq_len: the model's (a line) and each calibrated length's (filled: safe, open:
    conservative)."""
    surface = profile.surface
    if surface is None:
        return
    usable, fraction = usable_bytes(profile), profile.settings.conservative_fraction
    low, high, step = min(surface.seq_lens), max(surface.seq_lens), surface.chunk_size
    grid = range(low, high + 1, max(step, (high - low) // 200 // step * step or step))
    ax.plot(list(grid), [answer_at(surface, n, usable, fraction)[0] for n in grid], color=color, lw=1.4, zorder=3)
    for entry in surface.lengths:
        style = {"color": color} if entry.verified else {"color": OOM_COLOR, "marker": "x"}
        ax.scatter([entry.seq_len], [entry.safe_batch_size], s=40, zorder=4, **{"marker": "o", **style})
        ax.scatter([entry.seq_len], [entry.conservative_batch_size], s=40, zorder=4, facecolors="none",
                   edgecolors=style["color"], marker="o")
    log2_axis(ax.xaxis)
    log2_axis(ax.yaxis)
    ax.set(xlabel="seq_len", ylabel="batch size", title="Safe batch size against seq_len")
    ax.grid(True, color="#dddddd", lw=0.6)
    from matplotlib.lines import Line2D

    ax.legend(handles=[Line2D([], [], color=KEY, lw=1.4, label="the model's safe size (interpolated)"),
                       Line2D([], [], color=KEY, marker="o", ls="none", label="verified safe"),
                       Line2D([], [], color=KEY, marker="o", mfc="none", ls="none", label="verified conservative"),
                       Line2D([], [], color=OOM_COLOR, marker="x", ls="none", label="not verified")],
              loc="upper center", bbox_to_anchor=(0.5, -0.11), fontsize=8.5, frameon=False)


def _format_axes(memory_ax: Any, speed_ax: Any, profiles: Sequence[Profile], log_batches: bool = False) -> None:
    from matplotlib.ticker import MaxNLocator

    batches = [t.batch_size for p in profiles for t in p.reference_trials]
    top = max([p.device.total_bytes for p in profiles] + [t.peak_bytes or 0 for p in profiles
                                                          for t in p.reference_trials])
    if log_batches:  # batch scales far apart: each profile's own range stays readable
        log2_axis(memory_ax.xaxis)
    else:
        memory_ax.set_xlim(left=0)
    memory_ax.set_ylim(bottom=0, top=top / GIB * 1.06)
    lengths = {p.surface.reference_seq_len if p.surface else p.model.params.get("seq_len") for p in profiles}
    at_length = f" (seq_len {lengths.pop()})" if len(lengths) == 1 and None not in lengths else ""
    rank = " per rank" if any(p.world for p in profiles) else ""
    memory_ax.set_title(f"Peak memory per training step{rank}{at_length}", fontsize=11)
    memory_ax.set_ylabel(f"peak memory{rank} (GiB)")
    speed_ax.set_title("Throughput of the same trials", fontsize=11)
    speed_ax.set_ylabel(f"throughput{rank} (samples/s)")
    fastest = max((r.samples_per_s for p in profiles for r in profile_rates(p)), default=0.0)
    # whiskers of two-step rates can reach far: the axis follows the rates, and a whisker leaves it
    speed_ax.set_ylim(bottom=0, top=fastest * 1.4 if fastest > 0 else None)
    if batches and max(batches) >= 8 * max(1, min(batches)):
        log2_axis(speed_ax.xaxis)
    for ax in (memory_ax, speed_ax):
        ax.set_xlabel(f"batch size{rank} (samples per step)")
        if ax.get_xscale() == "linear":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, color="#dddddd", lw=0.6)


def _series_handle(profile: Profile, color: str) -> Any:
    """A function making a legend handle in ``color`` with a given label."""
    from matplotlib.lines import Line2D

    return lambda text: Line2D([], [], color=color, lw=1.6, marker="o", ms=5, label=text)


def _fit_text(profile: Profile, short: bool = False) -> str:
    """The fit's formula and r² (and, when ``short``, the limits), or what is missing."""
    fit, limits = profile.fit, profile.limits
    if fit is None:
        return f"no fit ({sum(t.ok for t in profile.trials)} successful trial(s), 3 needed): no line, no limits"
    text = f"{fit.formula()}  (r² = {fit.r_squared:.4f}, n = {fit.n_points})"
    if short:
        for long, brief in (("peak = ", ""), ("batch_size", "batch"), (", n = ", ", n "), ("r² = ", "r² ")):
            text = text.replace(long, brief)
        if limits is not None:
            text += f"; safe {limits.safe_batch_size:,}, conservative {limits.conservative_batch_size:,}"
    return text + ("" if profile.verified else "  [limits NOT verified]")


def _speed_text(profile: Profile, short: bool = False) -> str:
    knee = profile_knee(profile)
    if knee is None:
        return "no successful trial: no throughput"
    best, reach = knee.best, knee.rate
    scope = " (up to safe)" if safe_size(profile) is not None else ""
    faster = _faster_abovesafe_size(profile)
    past = (f"; {format_rate(faster.samples_per_s)} at {faster.batch_size}, above safe (hollow)"
            if faster is not None else "")
    if knee.refused:  # open intervals (vramcal.calibration.throughput): no knee is called
        return (f"best{scope} {format_rate(best.samples_per_s)} samples/s at {best.batch_size}; no knee "
                f"(open intervals){past}")
    if short:
        return (f"best{scope} {format_rate(best.samples_per_s)} samples/s at {best.batch_size}, knee "
                f"({knee.fraction * 100:g} %) at {knee.batch_size}{past}")
    return (f"best{scope} {format_rate(best.samples_per_s)} samples/s at batch {best.batch_size}; knee "
            f"({knee.fraction * 100:g} % of it) at batch {knee.batch_size}, {format_rate(reach.samples_per_s)} "
            f"samples/s{past}")


def _memory_key(profiles: Sequence[Profile]) -> list:
    """Legend handles of the memory panel's styles (with the values for a single profile)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    single = len(profiles) == 1
    states = {trial_state(t, usable_bytes(p)) for p in profiles for t in p.trials}
    limits = profiles[0].limits if single else None
    verified = "" if not single or profiles[0].verified else " (unverified)"
    creep = any(p.creep for p in profiles)
    key = [Line2D([], [], color=KEY, marker="o", ls="none",
                  label="trial peak" + (" + step creep" if creep else ""))]
    if creep:
        key.append(Line2D([], [], color=KEY, marker="D", mfc="none", ls="none", label="steady trial (long run)"))
    if "over-budget" in states:
        key.append(Line2D([], [], color=KEY, marker="^", mfc="none", ls="none", ms=8,
                          label="over budget (peak > usable)"))
    if "oom" in states:
        key.append(Line2D([], [], color=OOM_COLOR, marker="X", ls="none", ms=8,
                          label="out of memory (drawn at usable)"))
    if states & {"timeout", "error"}:
        key.append(Line2D([], [], ls="none", label="timed-out / failed trials: see the table"))
    if any(p.fit for p in profiles):
        key.append(Patch(color=KEY, alpha=0.18, label="95 % prediction band" + (band_text(profiles[0]) if single
                                                                                 else " (may be thinner than a line)")))
        spread, basis = repeat_spread(profiles[0])
        source = next((short for word, short in (("benchmark", "the benchmarks' spread"), ("trials", "repeated "
                       "trials' spread")) if word in basis), "the recorded runs' spread")
        key.append(Line2D([], [], color=KEY, lw=0.9, ls=(0, (1, 2)),
                          label=f"warning line: prediction +{spread:.1%} ({source}); a run above it is warned"
                          if single else "warning line: a run above it is warned"))
    if any(p.limits and p.limits.safe_batch_size > 0 for p in profiles):
        key += [Line2D([], [], color=KEY, ls="--",
                       label=f"safe batch size{_value(limits, 'safe_batch_size')}{verified}"),
                Line2D([], [], color=KEY, ls="-.",
                       label=f"conservative batch size{_value(limits, 'conservative_batch_size')}{verified}")]
    if any(_boundary(p) is not None for p in profiles):
        at = f" ≈ {_boundary(profiles[0]):,.0f}" if single else ""
        key.append(Line2D([], [], color=OOM_COLOR if single else KEY, ls=BOUNDARY_STYLE, lw=1.4, marker="v", ms=6,
                          mfc=OOM_COLOR, mec=OOM_COLOR, label=f"out-of-memory boundary{at} (the line at total memory)"))
    key = [_wrapped(handle, KEY_WIDTH) for handle in key]
    total = f" {format_bytes(profiles[0].device.total_bytes)}" if single else ""
    usable = f" {format_bytes(usable_bytes(profiles[0]))}" if single else ""
    key += [Line2D([], [], color="#555555", lw=1.4, label=f"total memory{total}"),
            Line2D([], [], color="#555555", lw=1.4, ls=":", label=f"usable memory{usable}")]
    return key


def _wrapped(handle: Any, width: int) -> Any:
    """``handle`` with its label wrapped at ``width`` characters."""
    handle.set_label(textwrap.fill(handle.get_label(), width, subsequent_indent="  "))
    return handle


def _value(limits: Any, name: str) -> str:
    return f" = {getattr(limits, name):,}" if limits is not None else ""


def _speed_key(profiles: Sequence[Profile]) -> list:
    from matplotlib.lines import Line2D

    key = [Line2D([], [], color=KEY, marker="*", ms=11, ls="none",
                  label="throughput knee: the smallest batch reaching 95 % of the best"),
           Line2D([], [], color=KEY, marker="|", ms=9, ls="none", label="95 % interval of the mean step time")]
    if any(s is not None and r.batch_size > s for p in profiles for s in (safe_size(p),) for r in profile_rates(p)):
        key.append(Line2D([], [], color=KEY, marker="o", mfc="none", ls="none",
                          label="above the safe size: no run takes it, not in best or knee"))
    if any(r.steady for p in profiles for r in profile_rates(p)):
        key.append(Line2D([], [], color=KEY, marker="D", mfc="none", ls="none", label="steady (a steady trial, or "
                          "enough timed steps)"))
    if any(p.limits and p.limits.safe_batch_size > 0 for p in profiles):
        key.append(Line2D([], [], color=KEY, ls="--", label="safe / conservative (-.) batch size"))
    return [_wrapped(handle, KEY_WIDTH) for handle in key]
