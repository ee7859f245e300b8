"""The run folder: its config, run record, metrics and checkpoints, every file written atomically.

::

    <run_dir>/config.json          the TrainConfig (what --resume continues with)
    <run_dir>/run.json             device, implementation, kernel path, batch size and why, LR, data
    <run_dir>/metrics.jsonl        one JSON object per line: kind "epoch" rows and "oom"/"non-finite" events
                               (strict JSON: a NaN or infinite figure is null)
    <run_dir>/checkpoint-last.pt   model, optimizer, scheduler and progress after the last epoch (or stop)
    <run_dir>/checkpoint-best.pt   the same at the lowest validation loss so far

A killed run leaves every file either at its previous or its new content (temporary file in the same
folder, fsync, ``os.replace``), so ``--resume`` always finds a whole checkpoint; a checkpoint is only
written with finite weights.
"""

from __future__ import annotations

import io
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from vramcal.files import atomic_write_bytes, atomic_write_text

CONFIG = "config.json"
RUN = "run.json"
METRICS = "metrics.jsonl"
LAST = "checkpoint-last.pt"
BEST = "checkpoint-best.pt"
CHECKPOINT_FORMAT = 1


class RunDirError(ValueError):
    """A run folder that cannot be used as asked; the one-line message says what to do."""


def check_run_dir(run_dir: Path, resume: bool) -> Path:
    """Check the run folder without creating or writing anything (so a failed start leaves nothing behind).

    Raises:
        RunDirError: a new run in a folder that already holds one, a resume with no checkpoint to resume,
            or a folder that cannot be created (its nearest existing parent is a file or not writable).
    """
    run_dir = Path(run_dir)
    if resume:
        if not (run_dir / LAST).is_file() or not (run_dir / CONFIG).is_file():
            raise RunDirError(f"nothing to resume in {run_dir}: it has no {LAST} and {CONFIG} "
                              f"(start a new run without --resume)")
    elif (run_dir / CONFIG).exists() or (run_dir / LAST).exists():
        raise RunDirError(f"{run_dir} already holds a run: pass --resume to continue it, or choose another --run-dir")
    existing = next(p for p in (run_dir.absolute(), *run_dir.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        reason = "is a file" if not existing.is_dir() else "is not writable"
        raise RunDirError(f"cannot write to the run folder {run_dir} ({existing} {reason}): choose another --run-dir")
    return run_dir


def prepare_run_dir(run_dir: Path, resume: bool) -> Path:
    """:func:`check_run_dir`, then (for a new run) create the folder and check that it can be written.

    Call it once every other check has passed, so a run that cannot start leaves no empty folder.

    Raises:
        RunDirError: as :func:`check_run_dir`, or a folder that cannot be created or written.
    """
    run_dir = check_run_dir(run_dir, resume)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".vramcal-write-check."):
            pass
    except OSError as error:
        raise RunDirError(f"cannot write to the run folder {run_dir} ({error.strerror or error}): "
                          f"choose another --run-dir") from None
    return run_dir


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def write_metrics(run_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """Rewrite ``metrics.jsonl`` with all rows so far (the checkpoint keeps the same list).

    The file is strict JSON: a NaN or infinite number is written as ``null``.
    """
    path = Path(run_dir) / METRICS
    atomic_write_text(path, "".join(json.dumps(_finite_or_null(row), sort_keys=True, allow_nan=False) + "\n"
                                    for row in rows))
    return path


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(v) for v in value]
    return value


def non_finite_tensors(state_dict: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors of ``state_dict`` that hold a NaN or an infinity."""
    import torch

    return [name for name, tensor in state_dict.items()
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(tensor.isfinite().all())]


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """``torch.save`` of ``payload`` (tensors, dicts, lists, numbers, strings), written atomically.

    Raises:
        ValueError: the model weights (``payload["model"]``) are not all finite; nothing is written, so
            a checkpoint on disk always holds finite weights.
    """
    import torch

    bad = non_finite_tensors(payload.get("model", {}))
    if bad:
        raise ValueError(f"refusing to save {path}: non-finite weights in {', '.join(bad[:3])}")

    buffer = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, **payload}, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint onto the CPU (``weights_only``: no code runs from the file).

    Raises:
        RunDirError: the file is unreadable, not a checkpoint, or another format.
    """
    import torch

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch raises many types for a bad file
        raise RunDirError(f"{path} is not a readable checkpoint ({type(error).__name__}): "
                          f"start a new run with another --run-dir") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise RunDirError(f"{path} is not a vramcal checkpoint of format {CHECKPOINT_FORMAT}")
    if non_finite_tensors(payload.get("model", {})):
        raise RunDirError(f"{path} holds non-finite weights (NaN or infinity): it cannot be resumed; "
                          f"start a new run with a lower --lr")
    return payload
