"""The run folder: its config, run record, metrics and checkpoints, every file written atomically.

::

    <run_dir>/config.json          the TrainConfig (what --resume continues with)
    <run_dir>/run.json             the plan: device, model, batch size and prediction, LR, data, budget
    <run_dir>/metrics.jsonl        one JSON object per line: "epoch" rows and events (a NaN or infinity is null)
    <run_dir>/checkpoint-last.pt   model, optimizer, scheduler and progress at the last save
    <run_dir>/checkpoint-prev.pt   the save before it
    <run_dir>/checkpoint-best.pt   the save at the lowest validation loss so far
    <run_dir>/.vramcal.lock        held (flock) by the run going on there, with its pid

The promises (DESIGN.md "Failure"): a killed run leaves every file at its previous or new content; metrics never list
an epoch no checkpoint holds; checkpoints hold finite weights only; a folder is resumable or reusable."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vramcal.files import atomic_write, atomic_write_json, atomic_write_text

CONFIG = "config.json"
RUN = "run.json"
METRICS = "metrics.jsonl"
LAST = "checkpoint-last.pt"
PREV = "checkpoint-prev.pt"
BEST = "checkpoint-best.pt"
CHECKPOINTS = (LAST, PREV, BEST)  # in the order a resume tries them
CHECKPOINT_FORMAT = 2


class RunDirError(ValueError):
    """A run folder that cannot be used as asked; the one-line message says what to do."""


def has_checkpoint(run_dir: Path) -> bool:
    return any((Path(run_dir) / name).is_file() for name in CHECKPOINTS)


def has_readable_checkpoint(run_dir: Path) -> bool:
    """Whether a checkpoint of ``run_dir`` loads (reads the files and imports torch)."""
    try:
        load_resumable(run_dir)
    except RunDirError:
        return False
    return True


def check_run_dir(run_dir: Path, resume: bool) -> Path:
    """Check the run folder without creating or writing anything. A folder holds a run when it has a readable
    checkpoint; one with none, or only unreadable ones, takes a new run.

    Raises:
        RunDirError: a folder another run is using, a new run where one is held, a resume with no checkpoint or no
            config, or a folder that cannot be created.
    """
    run_dir = Path(run_dir)
    holder = run_holder(run_dir)
    if holder is not None:
        raise RunDirError(in_use(run_dir, holder))
    if resume:
        if not has_checkpoint(run_dir) or not (run_dir / CONFIG).is_file() or not (run_dir / RUN).is_file():
            raise RunDirError(f"nothing to resume in {run_dir}: it has no checkpoint (the run saved none), or no "
                              f"{CONFIG}/{RUN}; start a new run there without --resume")
    elif has_checkpoint(run_dir) and has_readable_checkpoint(run_dir):
        raise RunDirError(f"{run_dir} already holds a run: pass --resume to continue it, or choose another --run-dir")
    existing = next(p for p in (run_dir.absolute(), *run_dir.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        reason = "is a file" if not existing.is_dir() else "is not writable"
        raise RunDirError(f"cannot write to the run folder {run_dir} ({existing} {reason}): choose another --run-dir")
    return run_dir


def prepare_run_dir(run_dir: Path, resume: bool) -> Path:
    """:func:`check_run_dir`, then create and claim the folder, check it again and check that it can be written;
    called once every other check has passed, so a run that cannot start leaves no empty folder.

    Raises:
        RunDirError: as :func:`check_run_dir`; a folder another run holds; one that cannot be created or written.
    """
    run_dir = check_run_dir(run_dir, resume)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        claim_run_dir(run_dir)
        check_run_dir(run_dir, resume)
        remove_stale_temporaries(run_dir)
        if not resume:  # what is left are unreadable checkpoints (check_run_dir): kept aside, never reused
            for name in CHECKPOINTS:
                if (run_dir / name).is_file():
                    set_aside(run_dir / name)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".vramcal-write-check."):
            pass
    except OSError as error:
        raise RunDirError(f"cannot write to the run folder {run_dir} ({error.strerror or error}): "
                          f"choose another --run-dir") from None
    return run_dir


LOCK = ".vramcal.lock"
_CLAIMS: dict[Path, int] = {}  # run folder -> the open file this process holds its lock on


def claim_run_dir(run_dir: Path) -> None:
    """Hold ``run_dir`` for this process: an exclusive ``flock`` on its lock file, which holds the pid; the kernel
    drops it when the process ends, however it ends. Claiming a folder held already is a no-op.

    Raises:
        RunDirError: another process holds it, naming its pid. OSError: the lock file cannot be created.
    """
    import fcntl

    key = Path(run_dir).absolute()
    if key in _CLAIMS:
        return
    fd = os.open(key / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirError(in_use(run_dir, holder)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _CLAIMS[key] = fd


def run_holder(run_dir: Path) -> str | None:
    """The pid of another process that holds ``run_dir``, or None (nobody does, or this process)."""
    import fcntl

    key = Path(run_dir).absolute()
    if key in _CLAIMS or not (key / LOCK).is_file():
        return None
    try:
        fd = os.open(key / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)  # closing drops a shared lock this check took


def in_use(run_dir: Path, holder: str) -> str:
    return (f"{run_dir} is in use by another run (pid {holder}): a run folder takes one run at a time; wait for "
            f"it to end, or choose another --run-dir")


def release_run_dir(run_dir: Path) -> None:
    """Drop this process's claim on ``run_dir`` (none held: nothing to do)."""
    fd = _CLAIMS.pop(Path(run_dir).absolute(), None)
    if fd is not None:
        os.close(fd)


def _naming(path: Path, write: Any) -> None:
    """Run ``write()``, a failure raised as an OSError naming ``path`` (``torch.save``'s zip writer wraps the file's
    OSError in a RuntimeError, kept as its context: that OSError is the failure)."""
    try:
        write()
    except OSError as error:
        if error.filename is not None and Path(error.filename).name == Path(path).name:
            raise
        raise OSError(error.errno, error.strerror or str(error), str(path)) from error
    except RuntimeError as error:
        cause = error.__cause__ or error.__context__
        if not isinstance(cause, OSError):
            raise
        raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from error


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Raises: OSError naming ``path`` (:func:`_naming`)."""
    _naming(path, lambda: atomic_write_json(path, data))


def write_metrics(run_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """Rewrite ``metrics.jsonl`` with all rows so far, as strict JSON (a NaN or infinity is ``null``)."""
    path = Path(run_dir) / METRICS
    text = "".join(json.dumps(_finite_or_null(row), sort_keys=True, allow_nan=False) + "\n" for row in rows)
    _naming(path, lambda: atomic_write_text(path, text))
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


def save_checkpoint(run_dir: Path, payload: dict[str, Any], best: bool = False) -> Path:
    """Save ``payload`` as the last checkpoint, keeping the one it replaces as previous, and as the best one when
    ``best``; streamed into the file (no second copy of the state in memory).

    Raises:
        ValueError: non-finite model weights: nothing is written.
        OSError: the disk is full or the file too large (naming the file); that file is then unchanged.
    """
    import torch

    bad = non_finite_tensors(payload.get("model", {}))
    if bad:
        raise ValueError(f"refusing to save a checkpoint: non-finite weights in {', '.join(bad[:3])}")
    run_dir = Path(run_dir)
    content = {"format": CHECKPOINT_FORMAT, **payload}
    _naming(run_dir / LAST, lambda: atomic_write(run_dir / LAST, lambda handle: torch.save(content, handle),
                                                 keep_previous=run_dir / PREV))
    if best:
        _naming(run_dir / BEST, lambda: atomic_write(run_dir / BEST, lambda handle: torch.save(content, handle)))
    return run_dir / LAST


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint onto the CPU (``weights_only``: no code runs from the file).

    Raises:
        RunDirError: unreadable (truncated?), not a checkpoint, another format, or non-finite weights.
    """
    import torch

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch raises many types for a bad file
        raise RunDirError(f"{path} is not a readable checkpoint ({type(error).__name__}; truncated?)") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise RunDirError(f"{path} is not a vramcal checkpoint of format {CHECKPOINT_FORMAT}")
    if non_finite_tensors(payload.get("model", {})):
        raise RunDirError(f"{path} holds non-finite weights (NaN or infinity): it cannot be resumed")
    return payload


def load_resumable(run_dir: Path) -> tuple[dict[str, Any], Path, str | None]:
    """The newest readable checkpoint of ``run_dir``: last, else previous, else best.

    Returns:
        The payload, its path, and a notice when it is not ``checkpoint-last.pt`` (None otherwise).

    Raises:
        RunDirError: no checkpoint can be read (each one's reason in the message).
    """
    reasons = []
    for name in CHECKPOINTS:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        try:
            payload = load_checkpoint(path)
        except RunDirError as error:
            reasons.append(str(error))
            continue
        progress = payload["progress"]
        notice = None if name == LAST else (
            f"{'; '.join(reasons) or f'{LAST} is missing'}: resuming from {path} (epoch {progress['epoch']}, "
            f"step {progress['step']})")
        return payload, path, notice
    raise RunDirError(f"no readable checkpoint in {run_dir} ({'; '.join(reasons) or 'none saved'}): start a new run "
                      f"there without --resume (the unreadable files are then kept as *.unreadable)")


def resume_from(run_dir: Path, rank: int, echo: Callable[[str], None],
                check: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The checkpoint a resume continues from (:func:`load_resumable`), checked by ``check`` and said in ``echo``; an
    unreadable last one set aside (by rank 0: every rank of a world reads rank 0's files).

    Raises:
        RunDirError: as :func:`load_resumable`; and what ``check`` raises.
    """
    state, path, notice = load_resumable(run_dir)
    if notice:
        echo(f"warning: {notice}")
        if path.name != LAST and (run_dir / LAST).exists() and rank == 0:
            echo(f"the unreadable {LAST} is kept as {set_aside(run_dir / LAST).name}")
    if check is not None:
        check(state)
    done = state["progress"]
    within = f", batch {done['batch_in_epoch']} of epoch {done['epoch'] + 1}" if done["batch_in_epoch"] else ""
    echo(f"continuing from {path}: {done['epoch']} epoch(s) and {done['step']} step(s) done{within}")
    return state


def set_aside(path: Path) -> Path:
    """Rename an unreadable checkpoint to ``<name>.unreadable`` (so a save does not keep it as the previous).

    Raises:
        OSError: the folder cannot be written.
    """
    aside = Path(path).with_name(Path(path).name + ".unreadable")
    os.replace(path, aside)
    return aside


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete the temporary files killed saves left (each as large as a checkpoint); only where no other process
    saves into ``run_dir``."""
    removed = []
    for name in (*CHECKPOINTS, METRICS, CONFIG, RUN):
        for stale in Path(run_dir).glob(f".{name}.*.tmp"):
            stale.unlink(missing_ok=True)
            removed.append(stale)
    return removed


def last_good(run_dir: Path) -> str:
    """A phrase naming the checkpoint a failed run can resume from, for one-line errors."""
    for name in CHECKPOINTS:
        path = Path(run_dir) / name
        if path.is_file():
            return f"the last good checkpoint is {path}; continue with `vramcal train --resume --run-dir {run_dir}`"
    return f"no checkpoint was saved; start the run again (the same --run-dir {run_dir} can be used)"
