"""A stale profile: made under software, a driver or allocator settings that can move the memory of the same step
(torch, CUDA and the driver: the CUDA context and workspaces; ``PYTORCH_CUDA_ALLOC_CONF``: the caching allocator;
mamba_ssm, causal_conv1d, Triton, transformers: the kernels; on the host also Python and the malloc settings).
:func:`check` gives one notice naming each change and the command that recalibrates, or, strict
(``--strict-profile``, ``VRAMCAL_STRICT_PROFILE=1``), raises :class:`StaleProfileError`.
"""

from __future__ import annotations

import os
import sys

from vramcal.environment import (
    ALLOCATOR_ENV,
    HOST_MALLOC_ENV,
    MEMORY_PACKAGES,
    shown_setting,
    software_versions,
    worker_setting,
)
from vramcal.profile import Profile, ProfileError
from vramcal.records import Device

STRICT_ENV = "VRAMCAL_STRICT_PROFILE"


class StaleProfileError(ProfileError):
    """A profile made under other software or settings, refused because the caller asked to be strict."""


def changes(profile: Profile, device: Device | None = None) -> list[str]:
    """Each change since the profile was made that can move memory, as ``torch 2.5.1 -> 2.13.0+cpu``; ``device``
    is the running device (its driver is compared on a GPU)."""
    running, recorded = software_versions(), recorded_software(profile)
    host = not profile.device.kind.cuda_kernels  # the host's allocator is Python's and glibc's, a card's its driver's
    names = (*MEMORY_PACKAGES, "python") if host else MEMORY_PACKAGES
    found = [f"{name} {recorded.get(name) or 'absent'} -> {running.get(name) or 'absent'}" for name in names
             if name in recorded and recorded.get(name) != running.get(name)]
    if device is not None and device.kind.cuda_kernels:
        found += [f"{label} {getattr(profile.device, field)} -> {getattr(device, field)}"
                  for field, label in (("driver_version", "NVIDIA driver"), ("cuda_driver_version", "CUDA driver"))
                  if getattr(profile.device, field) and getattr(profile.device, field) != getattr(device, field)]
        torch = sys.modules.get("torch")
        cuda = profile.environment.get("torch_cuda_version")
        if torch is not None and cuda and torch.version.cuda != cuda:
            found.append(f"torch's CUDA {cuda} -> {torch.version.cuda}")
    for name in HOST_MALLOC_ENV if host else ALLOCATOR_ENV:
        if name == "OMP_NUM_THREADS" and profile.world is not None:
            continue  # a rank's threads are its world's threads_per_rank (compared with the world); torchrun sets 1
        if name in profile.environment and profile.environment[name] != worker_setting(name):
            found.append(f"{name} {shown_setting(profile.environment[name])} -> "
                         f"{shown_setting(worker_setting(name))}")
    return found


def recorded_software(profile: Profile) -> dict[str, str | None]:
    """The software ``profile`` was made with, torch's version with its build (``2.13.0+cu130``, also from the
    trials' environment in older profiles)."""
    torch, built = profile.software.get("torch"), profile.environment.get("torch_version")
    if torch and built and built.split("+")[0] == torch:
        return {**profile.software, "torch": built}
    return profile.software


def check(profile: Profile, source: str, device: Device | None = None, *, strict: bool | None = None,
          command: str = "vramcal probe") -> str | None:
    """The notice for a stale profile (None: nothing changed that can move memory).

    Args:
        source: how to name the profile (its file).
        strict: refuse a stale profile (None: ``VRAMCAL_STRICT_PROFILE=1`` says).
        command: what recalibrates it here.

    Raises:
        StaleProfileError: strict, and the profile is stale.
    """
    found = changes(profile, device)
    if not found:
        return None
    made = f"{source} was made with other software or settings that can move memory ({'; '.join(found)})"
    if strict if strict is not None else os.environ.get(STRICT_ENV) == "1":
        raise StaleProfileError(f"{made}: refused as strict (--strict-profile, strict=True or {STRICT_ENV}=1); "
                                f"recalibrate with `{command}`, or leave strict off to use it with a warning")
    return f"{made}: its figures may not hold here; recalibrate with `{command}`"


