"""A world's profile at other world sizes, per card (:mod:`vramcal.sizing.sharding`): the tables of ``vramcal limits
--world-size`` and ``--global-batch``, over the other-GPU table's cards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vramcal.report.catalogue import GpuModel, other_gpu_limits
from vramcal.report.table import markdown_table
from vramcal.sizing.sharding import AtWorldSize, at_world_size, fewest_ranks, sharded_bytes
from vramcal.units import format_bytes

if TYPE_CHECKING:
    from vramcal.profile import Profile


@dataclass(frozen=True)
class WorldRow:
    """One card's answer: ``found`` is None when no world of up to ``most`` ranks fits the global batch."""

    gpu: GpuModel
    found: AtWorldSize | None

    def to_dict(self) -> dict[str, Any]:
        found = self.found
        facts = {"gpu": self.gpu.label, "total_bytes": self.gpu.total_bytes, "fits": found is not None}
        if found is not None:
            facts.update(nproc=found.nproc, measured=found.measured, overhead_bytes=found.overhead_bytes,
                         shift_bytes=found.shift_bytes, global_safe=found.global_safe,
                         global_conservative=found.global_conservative, limits=found.limits.to_dict())
        return facts


def world_rows(profile: Profile, extra_gpus: Sequence[GpuModel] = (), nproc: int | None = None,
               global_batch: int | None = None, most: int = 4096) -> list[WorldRow]:
    """Per card: the limits at ``nproc`` ranks, or the fewest ranks carrying ``global_batch`` (exactly one).

    Raises:
        ValueError: neither or both of ``nproc`` and ``global_batch``; see
            :func:`~vramcal.report.catalogue.other_gpu_limits`.
        vramcal.sizing.SizingError: see :func:`vramcal.sizing.sharding.at_world_size`.
    """
    if (nproc is None) == (global_batch is None):
        raise ValueError("give exactly one of a world size and a global batch")
    cards = [row.gpu for row in other_gpu_limits(profile, extra_gpus)]
    if nproc is not None:
        return [WorldRow(gpu, at_world_size(profile, nproc, gpu.total_bytes)) for gpu in cards]
    return [WorldRow(gpu, fewest_ranks(profile, global_batch, gpu.total_bytes, most=most)) for gpu in cards]


def world_heading(profile: Profile) -> str:
    """What was measured and what is computed, for the tables' readers."""
    world = profile.world
    line = (f"calibrated at {world.nproc} ranks ({world.describe()}); other world sizes and cards are computed "
            f"from that fit by the sharding model (vramcal.sizing.sharding)")
    if world.strategy == "ddp":
        return line + ": a DDP rank holds the whole model at any world size, so its per-rank limits do not move"
    whole, held = sharded_bytes(profile)  # refuses a profile that does not count its model states
    return line + (f": the parameters and optimizer state ({format_bytes(whole)}, counted; {format_bytes(held)} on "
                   f"each of the {world.nproc} ranks) divide by the world size (the gradients are freed before the "
                   f"forward, so not at the peak); the rest of the fit (activations, gathered blocks, the process) is "
                   f"measured and does not")


def world_table(rows: Sequence[WorldRow], global_batch: int | None = None) -> str:
    """The rows as a Markdown table (a per-rank batch column for ``global_batch``)."""
    header = ["GPU", "Total", "Ranks", "Per-rank safe", "Per-rank conservative", "Global safe",
              "Global conservative"] + (["Per-rank batch"] if global_batch else []) + ["Basis"]
    body = []
    for row in rows:
        found = row.found
        if found is None:
            body.append([row.gpu.label, format_bytes(row.gpu.total_bytes), "none fits", *["–"] * (len(header) - 4),
                         "computed"])
            continue
        limits = found.limits
        cells = [row.gpu.label, format_bytes(row.gpu.total_bytes), str(found.nproc), f"{limits.safe_batch_size:,}",
                 f"{limits.conservative_batch_size:,}", f"{found.global_safe:,}", f"{found.global_conservative:,}"]
        if global_batch:
            cells.append(f"{-(-global_batch // found.nproc):,}")
        moved = f"computed (parameters and optimizer state {found.shift_bytes / 2**20:+.2f} MiB per rank)"
        body.append(cells + ["measured" if found.measured else moved])
    return markdown_table(header, body, right=range(1, len(header) - 1))
