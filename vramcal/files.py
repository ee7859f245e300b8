"""Writing files so that a crash, a kill or a full disk never leaves a half-written one.

Every file vramcal writes (profiles, reports, checkpoints, run records, tune results) goes through
here: a temporary file in the same folder, written and fsynced, then ``os.replace`` over the target,
so a reader sees either the previous content or the new one, never a mix.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file in the same folder, fsync, rename.

    Raises:
        OSError: the folder cannot be created or written; ``path`` is then untouched.
    """
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (as :func:`atomic_write_text`); used for checkpoints too.

    Raises:
        OSError: the folder cannot be created or written; ``path`` is then untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o666 & ~_umask())  # mkstemp makes 0600; use the mode open() would
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON with sorted keys, written atomically (:func:`atomic_write_text`)."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
