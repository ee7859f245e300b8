"""Accelerate: a profile's batch size for a plain ``accelerate`` loop, held to its process (:func:`sized`), and its
peak checked (:func:`measured`); DESIGN.md "Framework processes" and "Several processes: DDP and FSDP".

    model, optimizer = accelerator.prepare(model, optimizer)
    run = sized(accelerator, model="mytrain:make_step", module=model, effective_batch_size=256)   # after prepare
    loader = accelerator.prepare(DataLoader(dataset, batch_size=run.sizing.batch_size, shuffle=True))
    with measured(run, accelerator) as steps:
        for batch in loader:
            ...
            steps.done += 1

Needs ``accelerate`` (``pip install 'vramcal[dev]'`` has it); ``import vramcal`` never imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramcal.arguments import of_type, shown
from vramcal.integrations.run import FrameworkRun, asked_request, check_find
from vramcal.integrations.worlds import backend_of, plugin_world
from vramcal.profile import DEFAULT_PROFILES_DIR, Profile
from vramcal.records import World


def sized(accelerator: Any, profile: Profile | str | Path | None = None, *, model: str | None = None,
          params: dict[str, Any] | None = None, profiles_dir: str | Path = DEFAULT_PROFILES_DIR,
          capacity_bytes: int | str | None = None, module: Any = None, **asked: Any) -> FrameworkRun:
    """The run of this ``accelerate.Accelerator``'s process, sized with its process term; call it after
    ``accelerator.prepare(model, optimizer)`` and before building the DataLoader. With an effective batch it sets
    ``accelerator.gradient_accumulation_steps``.

    Args:
        profile, model, params, profiles_dir, capacity_bytes: as :class:`~vramcal.integrations.run.FrameworkRun`.
        module: the prepared model, checkpointed as the profile's trials were
            (:meth:`~vramcal.integrations.run.FrameworkRun.checkpoint`); None: the run warns that it cannot.
        asked: the fields of :class:`~vramcal.sizing.SizeRequest` (``limit``, ``batch_size_min``, ``request``,
            ``effective_batch_size`` of this process, ...).

    Raises:
        TypeError: ``accelerator`` no Accelerator, ``module`` no torch module. SizingError, TypeError, ValueError:
            as :class:`~vramcal.integrations.run.FrameworkRun` and :class:`~vramcal.sizing.SizeRequest`; a
            checkpointing variant and a ``module`` with no blocks.
    """
    _accelerator(accelerator)
    find = check_find("sized", profile, model, params, profiles_dir, capacity_bytes)
    ask = asked_request("sized", asked)
    run = FrameworkRun(**find, device=accelerator.device, ask=ask, world=_world(accelerator), framework="accelerate")
    if module is not None:
        run.checkpoint(module)
    sizing = run.start()
    if sizing.accumulation_steps > 1:
        accelerator.gradient_accumulation_steps = sizing.accumulation_steps
    return run


def _world(accelerator: Any) -> World | None:
    """The world of an Accelerator of several processes: FSDP2 under its FSDP plugin, else DDP.

    Raises:
        SizingError: an FSDP1 plugin or CPU offload, which no profile measures.
    """
    if accelerator.num_processes < 2:
        return None
    device_type = accelerator.device.type
    if getattr(accelerator, "distributed_type", None) != "FSDP":  # a str enum: DistributedType.FSDP
        return World(accelerator.num_processes, backend_of(device_type))
    plugin = accelerator.state.fsdp_plugin  # FSDP2's cpu_offload: OffloadPolicy (none) or CPUOffloadPolicy
    return plugin_world(accelerator.num_processes, device_type, plugin.fsdp_version, plugin.reshard_after_forward,
                        type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy", "the Accelerator's FSDP plugin")


def _accelerator(accelerator: Any) -> None:
    """Raises: TypeError: ``accelerator`` is no ``accelerate.Accelerator`` (what this module reads of one)."""
    if not all(hasattr(accelerator, name) for name in ("num_processes", "device", "is_main_process")):
        reset = (" (one whose state was reset, as building TrainingArguments after it does: create the Accelerator "
                 "again)" if type(accelerator).__name__ == "Accelerator" else "")
        raise TypeError(f"accelerator= takes the accelerate.Accelerator this process prepared, not "
                        f"{shown(accelerator)}{reset}")


@dataclass
class Steps:
    """What :func:`measured` records: the optimizer steps done (``done``); the report once it ended."""

    done: int = 0
    report: str | None = None


def measured(run: FrameworkRun, accelerator: Any, run_dir: str = "") -> contextlib.AbstractContextManager[Steps]:
    """Measure the training loop inside: at the end, the peak against the prediction (said by the main process)
    and the observation appended to the profile.

    Raises:
        TypeError: ``run`` no FrameworkRun, ``accelerator`` no Accelerator, ``run_dir`` no str.
    """
    of_type("run", run, FrameworkRun, "the FrameworkRun that sized() returned")
    _accelerator(accelerator)
    of_type("run_dir", run_dir, str, "the run's folder as a str")
    return _measured(run, accelerator, run_dir)


@contextlib.contextmanager
def _measured(run: FrameworkRun, accelerator: Any, run_dir: str) -> Iterator[Steps]:
    steps = Steps()
    try:
        yield steps
    except BaseException:
        run.close()
        raise
    steps.report = run.conclude(steps=steps.done, run_dir=run_dir, main_process=accelerator.is_main_process)
