"""The world a framework's run trains in, as the :class:`~vramcal.records.World` its profile must have been
calibrated for, and that world's profile (:func:`locate_world`): what the integrations share once each read its
framework's settings. DDP and FSDP2 are measured; FSDP1, DeepSpeed, tensor parallelism, CPU offload and
mixed-precision policies are refused in one line (DESIGN.md "Several processes: DDP and FSDP").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramcal.models.registry import model_ref
from vramcal.profile import Profile, ProfileError, load_profile, matching_profiles
from vramcal.records import DDP_SETTINGS, Backend, Device, Kind, World
from vramcal.sizing import SizingError
from vramcal.sizing.lookup import Located, NoProfileError, locate_profile
from vramcal.sizing.sharding import carried, same_but_size, sharded_bytes
from vramcal.units import format_bytes
from vramcal.words import Info


@dataclass(frozen=True)
class Carried(Located):
    """A profile carried to the run's world: ``path`` None (the run is not recorded in it), ``origin`` its source."""

    origin: str = ""

    @property
    def source(self) -> str:
        return f"{self.origin}, carried to {self.profile.world.nproc} ranks"


MEASURED = "vramcal's world profiles measure DDP (DistributedDataParallel) and FSDP2 (fully_shard) ranks only"


def backend_of(device_type: str) -> Backend:
    """The process group's backend on a device of ``device_type`` (``cuda``: nccl; the host: gloo)."""
    return Kind.of(device_type).backend


def ddp_world(nproc: int, backend: Backend, ddp_kwargs: Mapping[str, Any] | None = None) -> World:
    """The DDP world of ``nproc`` ranks built as ``DistributedDataParallel(**ddp_kwargs)``: the settings of
    :data:`~vramcal.records.DDP_SETTINGS` given, the others at DDP's defaults."""
    given = {name: value for name, value in (ddp_kwargs or {}).items() if name in DDP_SETTINGS and value is not None}
    return World(nproc, backend, **{name: float(value) if name == "bucket_cap_mb" else bool(value)
                                    for name, value in given.items()})


def fsdp_world(nproc: int, backend: Backend, reshard_after_forward: Any = True) -> World:
    """The FSDP2 world of ``nproc`` ranks, ``fully_shard(reshard_after_forward=...)``.

    Raises:
        SizingError: ``reshard_after_forward`` a number of ranks, which no probe measures.
    """
    if reshard_after_forward not in (True, False):
        raise unmeasured(f"FSDP2 resharding to {reshard_after_forward!r} ranks after the forward",
                         "reshard after the forward (True) or not (False)")
    return World(nproc, backend, strategy="fsdp", reshard_after_forward=bool(reshard_after_forward))


def sharded_world(module: Any, nproc: int, backend: Backend, who: str) -> World:
    """The FSDP2 world of a ``module`` that ``fully_shard`` sharded (``who``: how, in the framework's words),
    ``reshard_after_forward`` read from its units below the root (``post_forward_mesh_info`` is None exactly when a
    unit keeps its parameters gathered; FSDP2 sets the root's itself).

    Raises:
        SizingError: no submodule sharded with ``fully_shard``, units that differ in ``reshard_after_forward``, a
            mixed-precision policy or CPU offload.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy  # loads torch: only here

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise unmeasured(f"{who} sharded no module with fully_shard (FSDP2)",
                         "shard each Mamba-2 block and the root with fully_shard, as `vramcal probe --strategy fsdp` "
                         "does")
    groups = [g for unit in units for g in unit._get_fsdp_state()._fsdp_param_groups]
    if any(g.mp_policy != MixedPrecisionPolicy() for g in groups):
        raise unmeasured(f"{who} shards with a mixed-precision policy", "shard without one (fp32, as the probe)")
    if any(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups):
        raise unmeasured(f"{who} offloads the shards to the CPU", "shard without offload_policy")
    below = [g for unit in units[1:] for g in unit._get_fsdp_state()._fsdp_param_groups]
    reshard = {g.post_forward_mesh_info is not None for g in below or groups}
    if len(reshard) > 1:
        raise unmeasured(f"{who} reshards some units after the forward and not others",
                         "give every fully_shard the same reshard_after_forward")
    return fsdp_world(nproc, backend, reshard.pop() if reshard else True)


def plugin_world(nproc: int, device_type: str, version: Any, reshard_after_forward: Any, offload: Any,
                 who: str) -> World:
    """The world of a run whose Accelerate FSDP plugin (``who``) is of ``version``: FSDP2's on GPUs; on the host DDP,
    which Accelerate trains there (``MULTI_CPU``).

    Raises:
        SizingError: FSDP1 (``version`` 1), CPU offload, ``reshard_after_forward`` no bool.
    """
    if not Kind.of(device_type).cuda_kernels:  # Accelerate's FSDP runs on GPUs only
        return World(nproc, backend_of(device_type))
    if int(version) != 2:
        raise fsdp1_refused(f"{who} (fsdp_version {version})", nproc, "set the FSDP version to 2")
    if offload:
        raise unmeasured(f"{who} offloads the shards to the CPU", "train without CPU offload")
    return fsdp_world(nproc, backend_of(device_type), reshard_after_forward)


def fsdp1_refused(what: str, nproc: int, instead: str) -> SizingError:
    """The one-line refusal of FSDP1 (``what``), naming ``instead`` and the probe of the FSDP2 world."""
    probe = " ".join(World(max(nproc, 2), strategy="fsdp").probe_args())
    return SizingError(f"{what} is FSDP1 (FullyShardedDataParallel), whose memory no vramcal profile measured (its "
                       f"FSDP profiles are FSDP2's fully_shard per block): {instead}, and calibrate that world with "
                       f"`vramcal probe {probe}`")


def unmeasured(what: str, instead: str = "train under one of them to be sized, or choose the batch size "
                                         "yourself") -> SizingError:
    """The one-line refusal of a world no profile measures (``what``, in the framework's words)."""
    return SizingError(f"{what}: {MEASURED}; {instead}")


def locate_world(model: Any, params: dict[str, Any] | None, *, device: Device, profile: Profile | Path | str | None,
                 profiles_dir: Path | str, world: World | None, total_bytes: int | None) -> Located:
    """The profile for a run in ``world`` (:func:`vramcal.sizing.lookup.locate_profile`'s arguments): the world's own,
    else one of the same strategy and settings at another number of ranks (the given file, else the nearest size
    under ``profiles_dir``), carried by :func:`vramcal.sizing.sharding.carried` with a notice (``path`` None).

    Raises:
        as :func:`vramcal.sizing.lookup.locate_profile`; SizingError: a profile of another strategy or settings,
            or one the sharding model cannot carry.
    """
    find = {"device": device, "profiles_dir": profiles_dir, "total_bytes": total_bytes}
    try:
        return locate_profile(model, params, profile=profile, world=world, **find)
    except NoProfileError:
        if world is None:
            raise
        source = _other_size(model, params, world, **find)
        if source is None:
            raise
    except SizingError:
        source = _given_other_size(profile, world)
        if source is None:
            raise
    given = source.path or source  # its file, for the run's messages to name
    located = locate_profile(model, params, profile=given, world=source.world, **find)
    at = carried(located.profile, world)
    return Carried(at, None, (*located.notices, _carried_notice(located, at)), origin=located.source)


def _given_other_size(profile: Any, world: World | None) -> Profile | None:
    """The given profile (an object or a file) when it is of ``world``'s strategy and settings at another size."""
    if profile is None or world is None:
        return None
    try:
        found = profile if isinstance(profile, Profile) else load_profile(profile)
    except ProfileError:
        return None
    return found if same_but_size(found.world, world) and found.world != world else None


def _other_size(model: Any, params: dict[str, Any] | None, world: World, device: Device, profiles_dir: Path | str,
                total_bytes: int | None) -> Profile | None:
    """The newest profile under ``profiles_dir`` of ``world``'s strategy at the nearest other size, or None."""
    ref = model_ref(model, params, device=device)
    matches, _ = matching_profiles(profiles_dir, device, ref, world, total_bytes, any_size=True)
    matches = [p for p in matches if p.world != world]
    if not matches:
        return None
    return min(reversed(matches), key=lambda p: abs(p.world.nproc - world.nproc))


def _carried_notice(located: Located, at: Profile) -> Info:
    """The notice that a profile was carried: from which world, the model states' move, the limits computed."""
    source, world = located.profile, at.world
    states = " (a DDP rank holds the whole model at any size)"
    if world.strategy == "fsdp":
        (_, held), (_, now) = sharded_bytes(source), sharded_bytes(at)
        states = f" (a rank's parameters and optimizer state {format_bytes(held)} -> {format_bytes(now)})"
    return Info(f"{located.source} was calibrated for {source.world.describe()}; carried to {world.nproc} ranks by the "
            f"sharding model{states}: safe {at.limits.safe_batch_size}, conservative "
            f"{at.limits.conservative_batch_size} per rank, computed, not measured (`vramcal probe "
            f"{' '.join(world.probe_args())}` measures them); this run is not recorded in it")
