"""Limits on other GPUs, extrapolated from one profile's fit, for a built-in catalogue of common cards.

The rows assume the profile's overhead and slope hold on another card (not exact: the CUDA context, cuBLAS
workspaces and kernels differ by card; only the measured row is measured). Catalogue totals are NVML's ``total``
as ``nvidia-smi`` prints it on those cards in public logs (an "80 GB" H100 reports 81559 MiB).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vramcal.calibration.limits import Limits, compute_limits
from vramcal.models.registry import family_of
from vramcal.report.facts import batch_text, bytes_text, failure_words
from vramcal.report.table import MISSING, markdown_table
from vramcal.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from vramcal.profile import Profile

MIB = 2**20
MIN_GPU_BYTES = MIB  # as --capacity: a smaller --gpus size is a missing unit, not a card


@dataclass(frozen=True)
class GpuModel:
    """A card: a short ``label``, ``total_bytes`` (NVML's ``total`` where known) and its ``source``, the name NVML
    reports (None: unknown), what an estimate traces it as (:class:`vramcal.estimate.card.Card`; None: an H100)."""

    label: str
    total_bytes: int
    source: str
    nvml_name: str | None = None
    compute_capability: str | None = None
    sm_count: int | None = None


def _nvidia_smi(label: str, nvml_name: str, total_mib: int, capability: str, sm_count: int) -> GpuModel:
    return GpuModel(label, total_mib * MIB, f"nvidia-smi total {total_mib} MiB", nvml_name, capability, sm_count)


# Totals: nvidia-smi in public logs; compute capabilities: developer.nvidia.com/cuda-gpus; SM counts: NVIDIA's
# architecture whitepapers (GA10x, AD102, GA100, GH100)
CATALOGUE: tuple[GpuModel, ...] = (
    _nvidia_smi("RTX 3050 Ti Laptop 4 GB", "NVIDIA GeForce RTX 3050 Ti Laptop GPU", 4096, "8.6", 20),
    _nvidia_smi("RTX 3060 12 GB", "NVIDIA GeForce RTX 3060", 12288, "8.6", 28),
    _nvidia_smi("RTX A4000 16 GB", "NVIDIA RTX A4000", 16376, "8.6", 48),
    _nvidia_smi("RTX 4090 24 GB", "NVIDIA GeForce RTX 4090", 24564, "8.9", 128),
    _nvidia_smi("A100 40 GB (SXM4)", "NVIDIA A100-SXM4-40GB", 40960, "8.0", 108),
    _nvidia_smi("A100 80 GB (SXM4)", "NVIDIA A100-SXM4-80GB", 81920, "8.0", 108),
    _nvidia_smi("H100 80 GB (HBM3)", "NVIDIA H100 80GB HBM3", 81559, "9.0", 132),
    _nvidia_smi("H200 141 GB", "NVIDIA H200", 143771, "9.0", 132),
)


@dataclass(frozen=True)
class GpuLimitRow:
    """One row of the other-GPU table; ``measured``: the profile's own device."""

    gpu: GpuModel
    limits: Limits
    measured: bool


def parse_gpu_list(text: str) -> list[GpuModel]:
    """Parse ``--gpus "NAME=SIZE,NAME=SIZE"`` (sizes by :func:`vramcal.units.parse_bytes`, e.g. ``"L4=24GB"``); an
    entry without a size names a card of the :data:`CATALOGUE` (the start of its label, any case).

    Raises:
        ValueError: an entry that is neither NAME=SIZE nor one catalogued card, an empty name, a size that cannot
            be read or is below 1 MiB (as ``--capacity``), or a name given twice (any case); the message names the
            entry.
    """
    gpus: list[GpuModel] = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        name, sep, size = entry.rpartition("=")
        if not sep:
            card = catalogued(entry)
            if card in gpus:
                raise ValueError(f"--gpus entry {entry!r}: {card.label!r} is given twice; name each card once")
            gpus.append(card)
            continue
        if not name.strip():
            raise ValueError(f"--gpus entry {entry!r} is not NAME=SIZE: write e.g. \"RTX 4080=16GiB,L4=24GB\"")
        try:
            total_bytes = parse_bytes(size)
        except ValueError as error:
            raise ValueError(f"--gpus entry {entry!r}: {error}") from None
        if total_bytes < MIN_GPU_BYTES:
            raise ValueError(f"--gpus entry {entry!r}: {size.strip()} is below the minimum of "
                             f"{format_bytes(MIN_GPU_BYTES)}; write a unit, e.g. 24GiB")
        if any(g.label.casefold() == name.strip().casefold() for g in gpus):
            raise ValueError(f"--gpus entry {entry!r}: {name.strip()!r} is given twice; name each card once")
        gpus.append(GpuModel(name.strip(), total_bytes, f"--gpus {size.strip()}"))
    return gpus


def cards_for(gpus: Sequence[GpuModel] | None) -> list[GpuModel]:
    """The cards an estimate shows: ``gpus`` (each once, by label or NVML name), else the catalogue."""
    found: list[GpuModel] = []
    for gpu in CATALOGUE if not gpus else gpus:
        if not any(g.label.casefold() == gpu.label.casefold() or (g.nvml_name and g.nvml_name == gpu.nvml_name)
                   for g in found):
            found.append(gpu)
    return found


def catalogued(name: str) -> GpuModel:
    """The one card of :data:`CATALOGUE` whose label starts with ``name`` (any case).

    Raises:
        ValueError: none, or several (the message lists them).
    """
    found = [gpu for gpu in CATALOGUE if gpu.label.casefold().startswith(name.casefold())]
    if len(found) != 1:
        known = ", ".join(gpu.label for gpu in (found or CATALOGUE))
        what = "names several catalogued cards" if found else "is no catalogued card"
        raise ValueError(f"--gpus entry {name!r} {what} ({known}): name one, or give its memory as NAME=SIZE, e.g. "
                         f"\"{name}=24GiB\"")
    return found[0]


def other_gpu_limits(profile: Profile, extra_gpus: Iterable[GpuModel] = (),
                     catalogue: Sequence[GpuModel] = CATALOGUE) -> list[GpuLimitRow]:
    """The limits this profile's fit implies on each card (``compute_limits(fit, card.total_bytes, settings)``), the
    measured device's row (its own limits) replacing a catalogue card of its NVML name. A batch size that failed on
    the measured device caps cards with no more memory. A host profile is never carried to a GPU (its rows are its
    own; :mod:`vramcal.estimate.learned` estimates a card instead).

    Rows by total memory, the measured first among equals.

    Raises:
        ValueError: the profile has no fit (fewer than three successful trials) to extrapolate from, or a fit
            that does not rise (no limits).
    """
    if profile.fit is None:
        raise ValueError("the profile has no fitted memory model (it needs at least 3 successful trials over 2 "
                         "batch sizes): re-run `vramcal probe` to measure more batch sizes")
    if profile.limits is None:
        raise ValueError(f"the profile's fitted line does not rise ({profile.fit.formula()}), so no limit follows "
                         f"from it on any card: re-run `vramcal probe` with a larger budget")
    device = profile.device
    failed = profile.limits.failed_batch_size
    carried = device.kind.cuda_kernels  # a card's fit carries to other cards; the host's RAM in fp32 does not
    measured_label = f"{device.name} (this profile)" if carried else f"host: {device.name}"
    rows = [GpuLimitRow(GpuModel(measured_label, device.total_bytes, device.total_source,
                                 device.name if carried else None), profile.limits, True)]
    for gpu in [*catalogue, *extra_gpus] if carried else []:
        if gpu.nvml_name == device.name:
            continue
        cap = failed if failed is not None and gpu.total_bytes <= device.total_bytes else None
        rows.append(GpuLimitRow(gpu, compute_limits(profile.fit, gpu.total_bytes, profile.settings, cap), False))
    return sorted(rows, key=lambda row: (row.gpu.total_bytes, not row.measured))


def limits_table(rows: Sequence[GpuLimitRow], verified: bool, bold: bool = True) -> str:
    """The seed documents' "GPU-specific safe limits" table, the measured row marked (in bold unless ``bold`` is
    False: a terminal)."""
    mark = "**" if bold else ""
    body = []
    for row in rows:
        if row.measured:
            basis = f"{mark}measured{mark} ({'verified' if verified else 'NOT verified'})"
        else:
            basis = f"extrapolated; total = {row.gpu.source}"
        name = f"{mark}{row.gpu.label}{mark}" if row.measured else row.gpu.label
        body.append([name, format_bytes(row.gpu.total_bytes), bytes_text(row.limits.usable_bytes),
                     batch_text(row.limits.safe_batch_size), batch_text(row.limits.conservative_batch_size), basis])
    gpus = any(row.gpu.nvml_name or not row.measured for row in rows)  # a host profile's table holds the host alone
    return markdown_table(["GPU" if gpus else "device", "total memory", "usable", "safe max", "conservative", "basis"],
                          body, right=[1, 2, 3, 4])


def limits_notes(profile: Profile) -> list[str]:
    """What the other-GPU rows assume, as sentences."""
    settings = profile.settings
    fit = profile.fit
    overhead = bytes_text(fit.overhead_bytes) if fit else MISSING
    slope = bytes_text(fit.slope_bytes_per_sample) if fit else MISSING
    usable = (f"Usable = total − {format_bytes(settings.reserve_bytes)} reserve − {settings.margin * 100:g} % "
              f"margin; safe max is the largest batch whose upper 95 % prediction bound fits in usable; conservative = "
              f"floor({settings.conservative_fraction:g} × safe max).")
    if not profile.device.kind.cuda_kernels:
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
    return notes
