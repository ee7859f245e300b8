"""The report's variants of one model (:mod:`vramcal.sizing.variants`): a Markdown section and a frontier figure.

Two or more variants of one model (its checkpointing and chunk_size) on one hardware, budget and world
(:func:`variant_groups`) get a table (:func:`variants_section`) and a PNG (:func:`render_frontier_png`): samples/s
against batch size, one line per variant up to its safe size (hollow above), the knee starred, the conservative
size ringed. matplotlib loads only to draw; the PNG is deterministic (fixed size and dpi, no metadata).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramcal.calibration.throughput import rate_text
from vramcal.report.facts import profile_rates
from vramcal.report.figure import COLORS, log2_axis, png_bytes
from vramcal.report.table import MISSING, markdown_table
from vramcal.sizing.variants import VariantRow, same_model, variant_rows
from vramcal.units import format_bytes

if TYPE_CHECKING:
    from vramcal.profile import Profile

FIGSIZE_IN = (10.0, 6.0)
DPI = 100


def variant_groups(profiles: Sequence[Profile]) -> list[list[Profile]]:
    """The profiles that are variants of one model, in groups of two or more different variants, in the order of
    their first profile; each group on one hardware, budget and world (``Device.hardware_difference`` None,
    the same ``total_bytes`` and ``world``). A profile repeated in a variant (the same key) keeps its first."""
    groups: list[list[Profile]] = []
    for profile in profiles:
        group = next((g for g in groups if _together(g[0], profile)), None)
        if group is None:
            groups.append([profile])
        elif all(p.model.key() != profile.model.key() for p in group):
            group.append(profile)
    return [g for g in groups if len(g) > 1]


def _together(a: Profile, b: Profile) -> bool:
    return (same_model(a.model, b.model) and a.device.hardware_difference(b.device) is None
            and a.device.total_bytes == b.device.total_bytes and a.world == b.world)


def group_rows(group: Sequence[Profile], paths: Sequence[Path] | None = None) -> list[VariantRow]:
    """The group's :class:`~vramcal.sizing.variants.VariantRow` rows; ``paths``: the profiles' files where known (the
    report's Markdown and figure do not show them; ``report --json`` does)."""
    return variant_rows(list(zip(paths or [Path("")] * len(group), group)))


def variants_section(rows: Sequence[VariantRow], png_name: str, level: str = "##") -> list[str]:
    """The Markdown lines of one group's section: the figure, then the table of its variants."""
    body = []
    for row in rows:
        limits, fit = row.profile.limits, row.profile.fit
        knee = f"{row.knee_batch_size}: {rate_text(row.knee_rate)}" if row.knee_batch_size else MISSING
        body.append([row.label, "yes" if row.profile.verified else "**no**",
                     str(limits.safe_batch_size) if limits else MISSING,
                     str(limits.conservative_batch_size) if limits else MISSING,
                     format_bytes(fit.slope_bytes_per_sample) if fit else MISSING,
                     rate_text(row.rate_conservative) if row.rate_conservative else MISSING, knee,
                     f"{row.samples_per_s_per_gib:.3g}" if row.samples_per_s_per_gib else MISSING])
    return [f"{level} Variants of this model", "",
            f"{len(rows)} variants, each its own verified profile (sizing never mixes them); `vramcal train "
            f"--variant auto` trains the one with the most measured samples/s for its batch. Samples/s per GiB: at "
            f"the conservative size, per GiB of its predicted peak.", "",
            f"![Samples/s against batch size, one line per variant]({png_name})", "",
            markdown_table(["variant", "verified", "safe", "conservative", "per sample", "samples/s at conservative",
                            "knee: samples/s", "samples/s per GiB"], body, right=[2, 3, 4, 5, 6, 7]), ""]


def render_frontier_png(rows: Sequence[VariantRow]) -> bytes:
    """The frontier figure of one group (module docstring) as PNG bytes (``FIGSIZE_IN`` × ``DPI`` pixels)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # deferred: matplotlib loads only to draw
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    for index, row in enumerate(rows):
        _draw_variant(ax, row, COLORS[index % len(COLORS)])
    sizes = [r.batch_size for row in rows for r in profile_rates(row.profile)]
    if sizes and max(sizes) >= 8 * max(1, min(sizes)):
        log2_axis(ax.xaxis)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("batch size (samples per step)")
    ax.set_ylabel("throughput (samples/s)")
    ax.grid(True, color="#dddddd", lw=0.6)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1, fontsize=8.5, frameon=False)
    first = rows[0].profile
    figure.suptitle(f"Variants of one model on {first.device.name}, {format_bytes(first.device.total_bytes)}: "
                    f"samples/s against batch size\nsolid: sizes a run may take (up to safe); hollow: above safe; "
                    f"ringed: conservative; star: knee", fontsize=11)
    return png_bytes(figure, DPI)


def _draw_variant(ax: Any, row: VariantRow, color: str) -> None:
    """One variant's line: its measured rates, solid up to its safe size, hollow above it."""
    rates, limits = profile_rates(row.profile), row.profile.limits
    safe = limits.safe_batch_size if limits is not None else None
    runs = [(r.batch_size, r.samples_per_s) for r in rates if safe is None or r.batch_size <= safe]
    past = [(r.batch_size, r.samples_per_s) for r in rates if safe is not None and r.batch_size > safe]
    label = f"{row.label}: safe {safe if safe is not None else MISSING}"
    if runs:
        ax.plot(*zip(*runs), color=color, lw=1.6, marker="o", ms=4, label=label, zorder=3)
    else:
        ax.plot([], [], color=color, lw=1.6, label=label)
    if past:
        ax.scatter(*zip(*past), facecolors="none", edgecolors=color, s=30, linewidths=1.1, zorder=3)
    if row.rate_conservative is not None and limits is not None:
        ax.scatter([limits.conservative_batch_size], [row.rate_conservative.samples_per_s], facecolors="none",
                   edgecolors=color, s=140, linewidths=1.6, zorder=4)
    if row.knee_batch_size is not None and row.knee_rate is not None:
        ax.scatter([row.knee_batch_size], [row.knee_rate.samples_per_s], marker="*", s=170, color=color,
                   edgecolors="black", linewidths=0.6, zorder=5)
