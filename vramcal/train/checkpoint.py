"""The run folder: its config, run record, metrics and checkpoints, every file written atomically.

::

    <run_dir>/config.json          the TrainConfig (what --resume continues with)
    <run_dir>/run.json             device, implementation, kernel path, batch size and why, LR, data
    <run_dir>/metrics.jsonl        one JSON object per line: kind "epoch" rows and "oom"/"non-finite" events
    <run_dir>/checkpoint-last.pt   model, optimizer, scheduler and progress after the last epoch (or stop)
    <run_dir>/checkpoint-best.pt   the same at the lowest validation loss so far

A killed run leaves every file either at its previous or its new content (temporary file in the same
folder, fsync, ``os.replace``), so ``--resume`` always finds a whole checkpoint.
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path
from typing import Any

from vramcal.profile import atomic_write_bytes, atomic_write_text

CONFIG = "config.json"
RUN = "run.json"
METRICS = "metrics.jsonl"
LAST = "checkpoint-last.pt"
BEST = "checkpoint-best.pt"
CHECKPOINT_FORMAT = 1


class RunDirError(ValueError):
    """A run folder that cannot be used as asked; the one-line message says what to do."""


def prepare_run_dir(run_dir: Path, resume: bool) -> Path:
    """Check (and for a new run, create) the run folder before any training.

    Raises:
        RunDirError: a new run in a folder that already holds one (nothing there is touched), a resume
            with no checkpoint to resume, or a folder that cannot be created or written.
    """
    run_dir = Path(run_dir)
    if resume:
        if not (run_dir / LAST).is_file() or not (run_dir / CONFIG).is_file():
            raise RunDirError(f"nothing to resume in {run_dir}: it has no {LAST} and {CONFIG} "
                              f"(start a new run without --resume)")
    elif (run_dir / CONFIG).exists() or (run_dir / LAST).exists():
        raise RunDirError(f"{run_dir} already holds a run: pass --resume to continue it, or choose another --run-dir")
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
    """Rewrite ``metrics.jsonl`` with all rows so far (the checkpoint keeps the same list)."""
    path = Path(run_dir) / METRICS
    atomic_write_text(path, "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    return path


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """``torch.save`` of ``payload`` (tensors, dicts, lists, numbers, strings), written atomically."""
    import torch

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
    return payload
