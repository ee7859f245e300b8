"""Everything decided before the first step: data, run folder, device, implementation, profile, batch, LR.

Checks run cheapest first (spec, data, run folder) so a bad input fails in a second with one line,
before a device is touched or a calibration started. The run folder is only checked then; it is
created after every check has passed, so a run that cannot start leaves nothing behind.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vramcal.measure.device import select
from vramcal.model import ModelSpec, kernel_path, resolve_implementation
from vramcal.records import Device
from vramcal.train import checkpoint
from vramcal.train.config import ConfigError, TrainConfig, load_config
from vramcal.train.data import DataError, Windows, load_bars, make_windows
from vramcal.train.sizing import BatchChoice, SizingError, choose_batch_size, resolve_profile, scaled_lr

ProbeFn = Callable[[Device, ModelSpec, str], Path]


@dataclass(frozen=True)
class Plan:
    """A run, fully decided.

    Attributes:
        torch_device: ``cpu`` or ``cuda`` (the chosen GPU pinned by ``CUDA_VISIBLE_DEVICES=<UUID>``).
        batch: the batch size per optimizer step and where it came from.
        profile_path: the profile that sized the run (None when resumed from a checkpoint's choice).
        profile_limits: the profile's limits and formula, for the run record and the benchmark.
        lr: the peak learning rate after ``lr_scaling``.
    """

    config: TrainConfig
    run_dir: Path
    device: Device
    torch_device: str
    implementation: str
    kernel_path: str
    batch: BatchChoice
    profile_path: str | None
    profile_limits: dict[str, Any]
    lr: float
    windows: Windows
    notices: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        """The content of ``run.json``."""
        import torch

        return {"config": self.config.to_dict(), "device": self.device.to_dict(),
                "torch_device": self.torch_device, "implementation": self.implementation,
                "kernel_path": self.kernel_path, "batch": asdict(self.batch), "profile": self.profile_path,
                "profile_limits": self.profile_limits, "lr": self.lr, "data": self.windows.stats(),
                "notices": list(self.notices), "torch": torch.__version__,
                "written_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def load_windows(config: TrainConfig) -> Windows:
    """Bars from ``config.data`` cut into windows. Raises: DataError."""
    bars = load_bars(config.data)
    return make_windows(bars, config.spec.seq_len, config.stride, config.val_fraction, source=config.data)


def pick_device(gpu: str, capacity_bytes: int | None = None) -> tuple[Device, str, list[str]]:
    """The device to train on, its torch device string, and notices for the user.

    Raises:
        DeviceError / NvmlError: from :func:`vramcal.measure.device.select`.
        SizingError: a GPU that this torch build cannot use.
    """
    devices, notice = select(gpu, capacity_bytes)
    device, notices = devices[0], [notice] if notice else []
    if len(devices) > 1:
        notices.append(f"--gpu {gpu}: training uses one GPU, {device.name} ({device.uuid})")
    if device.kind == "host":
        return device, "cpu", notices
    os.environ["CUDA_VISIBLE_DEVICES"] = device.uuid or ""  # pin by UUID before CUDA initialises
    import torch

    if not torch.cuda.is_available():
        raise SizingError(f"{device.name} is here but this torch ({torch.__version__}) cannot use CUDA: "
                          f"install a CUDA build of torch, or train on the host with --gpu none")
    return device, "cuda", notices


def plan_run(config: TrainConfig, run_dir: Path, *, probe: ProbeFn | None = None,
             capacity_bytes: int | None = None) -> Plan:
    """Decide a new run.

    Args:
        probe: when given, calibrate first (it returns the new profile's path) instead of looking one up.

    Raises:
        ValueError: an impossible spec; DataError, RunDirError, SizingError, DeviceError, NvmlError,
            ConfigError: one-line messages for the user.
    """
    spec = config.spec
    spec.validate()
    windows = load_windows(config)
    checkpoint.check_run_dir(run_dir, resume=False)  # created only once every check has passed (at the end)
    device, torch_device, notices = pick_device(config.gpu, capacity_bytes)
    if spec.dtype == "bf16-autocast" and device.kind != "cuda":
        raise ConfigError("dtype bf16-autocast is for CUDA GPUs; use --dtype fp32 on the host")
    implementation = resolve_implementation(config.implementation, device.kind)
    if probe is not None:
        if config.profile != "auto":
            raise ConfigError("--probe writes a new profile: leave --profile at auto")
        profile, path = resolve_profile(str(probe(device, spec, implementation)), config.profiles_dir,
                                        device, spec, implementation)
    else:
        profile, path = resolve_profile(config.profile, config.profiles_dir, device, spec, implementation)
    batch = choose_batch_size(profile, config.batch_size, config.batch_size_min)
    if batch.warning:
        notices.append(batch.warning)
    n_train = len(windows.train_starts)
    if batch.batch_size > n_train:
        notices.append(f"batch size {batch.batch_size} is more than the {n_train} training windows: one step per "
                       f"epoch of {n_train} samples (a smaller --stride gives more windows)")
        batch = BatchChoice(n_train, batch.source + "+data", batch.warning,
                            int(profile.fit.predict(n_train)))  # type: ignore[union-attr]
    limits = profile.limits
    profile_limits = {"conservative_batch_size": limits.conservative_batch_size,  # type: ignore[union-attr]
                      "safe_batch_size": limits.safe_batch_size,  # type: ignore[union-attr]
                      "usable_bytes": limits.usable_bytes, "total_bytes": limits.total_bytes,  # type: ignore[union-attr]
                      "formula": profile.fit.formula(),  # type: ignore[union-attr]
                      "overhead_bytes": profile.fit.overhead_bytes,  # type: ignore[union-attr]
                      "slope_bytes_per_sample": profile.fit.slope_bytes_per_sample,  # type: ignore[union-attr]
                      "verified": profile.verified}
    lr = scaled_lr(config.lr, batch.batch_size, config.reference_batch_size, config.lr_scaling)
    checkpoint.prepare_run_dir(run_dir, resume=False)
    return Plan(config=config, run_dir=Path(run_dir), device=device, torch_device=torch_device,
                implementation=implementation, kernel_path=kernel_path(implementation), batch=batch,
                profile_path=str(path), profile_limits=profile_limits, lr=lr, windows=windows,
                notices=tuple(notices))


def plan_resume(run_dir: Path, overrides: dict[str, Any]) -> tuple[Plan, dict[str, Any]]:
    """Decide the continuation of the run in ``run_dir`` from its config and last checkpoint.

    Args:
        overrides: settings given on the command line (``epochs``, ``max_steps``) that replace the saved ones.

    Returns:
        The plan (batch size, LR and implementation as the run started) and the checkpoint payload.

    Raises:
        RunDirError: nothing to resume, or an unreadable checkpoint. DataError: the data file changed.
    """
    run_dir = checkpoint.prepare_run_dir(run_dir, resume=True)
    config = load_config(run_dir / checkpoint.CONFIG).replace(**overrides)
    state = checkpoint.load_checkpoint(run_dir / checkpoint.LAST)
    windows = load_windows(config)
    saved = state["data_stats"]
    if (saved["rows"], saved["split_row"], saved["stride"]) != (len(windows.targets), windows.split_row,
                                                                windows.stride):
        raise DataError(f"{config.data} is not the data this run started on ({saved['rows']} rows then, "
                        f"{len(windows.targets)} now): resume with the same file, or start a new run")
    device, torch_device, notices = pick_device(config.gpu)
    recorded = Device.from_dict(state["device"])
    difference = device.same_hardware(recorded)
    if difference:
        notices.append(f"resuming on other hardware than the run started on ({difference}); the batch size "
                       f"stays {state['batch']['batch_size']}")
    done = state["progress"]
    if config.max_steps is not None and done["step"] >= config.max_steps:
        notices.append(f"--max-steps {config.max_steps}: the run has already done {done['step']} steps, nothing "
                       f"to train (pass a larger --max-steps to go on)")
    elif done["epoch"] >= config.epochs:
        notices.append(f"--epochs {config.epochs}: the run has already done {done['epoch']} epochs, nothing "
                       f"to train (pass a larger --epochs to go on)")
    implementation = state["implementation"]
    resolve_implementation(implementation, device.kind)
    plan = Plan(config=config, run_dir=run_dir, device=device, torch_device=torch_device,
                implementation=implementation, kernel_path=kernel_path(implementation),
                batch=BatchChoice(**state["batch"]), profile_path=state.get("profile_path"),
                profile_limits=state.get("profile_limits", {}), lr=state["lr"], windows=windows,
                notices=tuple(notices))
    return plan, state
