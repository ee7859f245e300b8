"""Reports: a PNG and a Markdown file made only from profiles, so a GPU box's profile reports anywhere.

:func:`write_report` writes a profile's report (:mod:`~vramcal.report.figure`, :mod:`~vramcal.report.markdown`);
:func:`write_cost_report` the run forecast of several cards (``vramcal cost``). Pure functions of the profiles.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from vramcal.files import atomic_write_bytes, atomic_write_text
from vramcal.forecast import ForecastSettings
from vramcal.report.catalogue import GpuModel
from vramcal.report.cost import render_cost_markdown
from vramcal.report.cost_figure import render_cost_png
from vramcal.report.figure import render_png
from vramcal.report.markdown import render_markdown, report_name
from vramcal.report.variants import group_rows, render_frontier_png, variant_groups, variants_section

if TYPE_CHECKING:
    from vramcal.forecast import Forecast
    from vramcal.profile import Profile


def write_report(profiles: Sequence[Profile], out_dir: Path, name: str | None = None,
                 extra_gpus: Sequence[GpuModel] = (), forecast: ForecastSettings = ForecastSettings()
                 ) -> tuple[Path, Path]:
    """Write ``<out_dir>/<name>.png`` and ``.md`` atomically (``name`` default :func:`report_name`), and each group
    of variants' frontier figure (:func:`variants_png_names`) and section; returns (png, md). ``extra_gpus``: cards
    for the other-GPU table (``--gpus``); ``forecast``: what the run forecast forecasts.

    Raises:
        ValueError: no profiles, or a name that is not a plain file stem.
        OSError: the folder cannot be written.
    """
    if not profiles:
        raise ValueError("a report needs at least one profile")
    png_path, md_path = _paths(out_dir, name or report_name(profiles))
    atomic_write_bytes(png_path, render_png(profiles))
    sections: list[str] = []
    groups = variant_groups(profiles)
    for group, figure_name in zip(groups, variants_png_names(png_path.stem, len(groups))):
        rows = group_rows(group)
        atomic_write_bytes(png_path.with_name(figure_name), render_frontier_png(rows))
        sections += variants_section(rows, figure_name)
    markdown = render_markdown(profiles, png_path.name, extra_gpus, forecast)
    atomic_write_text(md_path, markdown + ("\n" + "\n".join(sections).rstrip() + "\n" if sections else ""))
    return png_path, md_path


def variants_png_names(name: str, groups: int) -> list[str]:
    """The file names of a report's variant figures: ``<name>-variants.png``, then ``-variants-2.png``, ...."""
    return [f"{name}-variants{'' if index == 0 else f'-{index + 1}'}.png" for index in range(groups)]


def write_cost_report(forecasts: Sequence[Forecast], out_dir: Path, name: str, title: str) -> tuple[Path, Path]:
    """Write the run forecast (:func:`vramcal.forecast.cost_table`'s rows) as ``<name>.png`` and ``<name>.md``
    atomically; returns (png, md).

    Raises:
        ValueError: a name that is not a plain file stem. OSError: the folder cannot be written.
    """
    png_path, md_path = _paths(out_dir, name)
    atomic_write_bytes(png_path, render_cost_png(forecasts, title))
    atomic_write_text(md_path, render_cost_markdown(forecasts, png_path.name, title))
    return png_path, md_path


def _paths(out_dir: Path, name: str) -> tuple[Path, Path]:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ValueError(f"report name {name!r} must be a plain file stem (letters, digits, '.', '_', '-')")
    return Path(out_dir) / f"{name}.png", Path(out_dir) / f"{name}.md"
