"""A world's per-rank memory at other world sizes, and the fewest ranks a global batch needs.

Under FSDP2 each rank holds ``1/N`` of the parameters and optimizer state (``S``: the counted model states less the
gradients, which the step frees before the peak: ``bench.fsdp_terms``, bench/README.md); nothing else a rank holds
depends on ``N``. From a profile measured at ``N0`` ranks, at ``N``::

    overhead(N) = overhead(N0) - S_rank(N0) + S / N        (FSDP; S_rank(N0): what a rank held, counted)
    overhead(N) = overhead(N0)                             (DDP: every rank holds S whole)
    peak(N, batch_size) = overhead(N) + slope × batch_size

and the limits follow from the moved fit (:func:`vramcal.calibration.limits.compute_limits`). Sources: PyTorch's
FSDP2 notes; ZeRO stage 3, ``(2 + 2 + K)Ψ / N_d`` (Rajbhandari et al. 2020, §5).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from vramcal.calibration.limits import Limits, compute_limits
from vramcal.profile import Profile
from vramcal.records import World
from vramcal.sizing import SizingError


@dataclass(frozen=True)
class AtWorldSize:
    """A world's per-rank limits at ``nproc`` ranks on a card of ``limits.total_bytes``: the moved fit's overhead
    (bytes), ``shift_bytes = overhead(nproc) - overhead(N0)``, and whether ``nproc`` is the profile's own world
    (``measured``: the calibration's limits)."""

    nproc: int
    limits: Limits
    overhead_bytes: float
    shift_bytes: float
    measured: bool

    @property
    def global_safe(self) -> int:
        """Samples per optimizer step of the whole world at the safe size (``global_conservative`` likewise)."""
        return self.nproc * self.limits.safe_batch_size

    @property
    def global_conservative(self) -> int:
        return self.nproc * self.limits.conservative_batch_size


def state_shift(profile: Profile, nproc: int) -> float:
    """Bytes a rank holds more (+) or fewer (-) at ``nproc`` ranks than in the profile's world (module docstring).

    Raises:
        SizingError: a profile of one process, or an FSDP profile that does not record its model states.
    """
    if world_of(profile).strategy == "ddp":
        return 0.0
    whole, held = sharded_bytes(profile)
    return whole / nproc - held


def world_of(profile: Profile) -> World:
    """The profile's world. Raises: SizingError: a single-process profile (no world to carry)."""
    if profile.world is None:
        raise SizingError("a single-process profile has no world to carry to other world sizes: calibrate one "
                          "with `vramcal probe --nproc N` (and --strategy fsdp for a sharded one)")
    return profile.world


def sharded_bytes(profile: Profile) -> tuple[int, int]:
    """(one whole copy, what a rank of the profile's world held) of an FSDP profile's parameters and optimizer
    state, bytes: its counted model states less the gradients.

    Raises:
        SizingError: a profile that does not record its model states.
    """
    whole, held, grads = (profile.model_info.get(k) for k in ("model_state_bytes", "rank_model_state_bytes",
                                                               "gradient_bytes"))
    if not all(isinstance(v, int) for v in (whole, held, grads)):
        raise SizingError("this FSDP profile does not record its model states (made before vramcal counted them): "
                          "calibrate it again with `vramcal probe --nproc N --strategy fsdp`")
    return whole - grads * profile.world.nproc, held - grads


def at_world_size(profile: Profile, nproc: int, total_bytes: int | None = None) -> AtWorldSize:
    """The profile's per-rank limits at ``nproc`` ranks, on a card of ``total_bytes`` (default: the profile's
    device).

    Raises:
        SizingError: fewer than 2 ranks; see :func:`state_shift`; a profile without fitted limits.
    """
    if nproc < 2:
        raise SizingError(f"a world has at least 2 ranks, not {nproc}: a single process is calibrated without "
                          f"--nproc")
    if profile.fit is None or profile.limits is None:
        raise SizingError("the profile has no fitted limits to carry: re-run `vramcal probe` with a larger budget")
    world, total = profile.world, total_bytes or profile.device.total_bytes
    shift = state_shift(profile, nproc)
    fit = dataclasses.replace(profile.fit, overhead_bytes=profile.fit.overhead_bytes + shift)
    measured = nproc == world.nproc and total == profile.device.total_bytes
    failed = profile.limits.failed_batch_size if nproc <= world.nproc and total <= profile.device.total_bytes \
        else None
    limits = profile.limits if measured else compute_limits(fit, total, profile.settings, failed)
    return AtWorldSize(nproc, limits, fit.overhead_bytes, shift, measured)


def fewest_ranks(profile: Profile, global_batch: int, total_bytes: int | None = None,
                 limit: str = "conservative", most: int = 4096) -> AtWorldSize | None:
    """The smallest world (2 ranks or more) whose ranks each fit ``ceil(global_batch / N)`` samples at the
    ``limit`` size, on a card of ``total_bytes``; None when even ``most`` ranks do not.

    Raises:
        SizingError: see :func:`at_world_size`; a global batch below 1.
    """
    if global_batch < 1:
        raise SizingError(f"a global batch is at least 1 sample, not {global_batch}")
    for nproc in range(2, most + 1):
        found = at_world_size(profile, nproc, total_bytes)
        per_rank = found.limits.conservative_batch_size if limit == "conservative" else found.limits.safe_batch_size
        if per_rank >= math.ceil(global_batch / nproc):
            return found
        if profile.world.strategy == "ddp" and per_rank == 0:
            return None  # a DDP rank's room does not grow with the world
    return None


def same_but_size(calibrated: World | None, run: World | None) -> bool:
    """Whether two worlds differ in their number of ranks alone: what :func:`carried` can bridge."""
    return (calibrated is not None and run is not None
            and dataclasses.replace(calibrated, nproc=run.nproc) == run)


def carried(profile: Profile, world: World) -> Profile:
    """``profile``, a world's, as a profile of ``world`` (another number of ranks): its fit moved and its limits
    computed (:func:`at_world_size`); its verification and recorded runs left out, and no file (``path`` None).

    Raises:
        SizingError: ``world`` differs from the profile's in more than its size (another strategy or settings: the
            model moves the model states only), a profile over several lengths, see :func:`at_world_size`.
    """
    if not same_but_size(profile.world, world):
        calibrated = profile.world.describe() if profile.world else "one process"
        raise SizingError(f"the sharding model carries a world's profile to other numbers of ranks of the same "
                          f"strategy and settings only, not {calibrated} to {world.describe()}: calibrate that world "
                          f"with `vramcal probe {' '.join(world.probe_args())}`")
    if profile.surface is not None:
        raise SizingError("the sharding model carries a profile of one seq_len: calibrate this world over several "
                          f"lengths with `vramcal probe {' '.join(world.probe_args())} --seq-len ...`")
    found = at_world_size(profile, world.nproc)
    fit = dataclasses.replace(profile.fit, overhead_bytes=found.overhead_bytes)
    info = dict(profile.model_info)
    if world.strategy == "fsdp":  # a rank's shares at the new size
        grads = round(info["gradient_bytes"] * profile.world.nproc / world.nproc)
        info.update(rank_model_state_bytes=round(info["model_state_bytes"] / world.nproc), gradient_bytes=grads)
    return dataclasses.replace(profile, world=world, fit=fit, limits=found.limits, verification={}, model_info=info,
                               observations=(), path=None)
