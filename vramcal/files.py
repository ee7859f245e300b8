"""Writing files so that a crash, a kill or a full disk never leaves a half-written one: every file vramcal writes
goes to a temporary file in the same folder, fsynced, then ``os.replace`` over the target."""

from __future__ import annotations

import errno
import json
import os
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`atomic_write`).

    Raises:
        OSError: the folder cannot be created or written; ``path`` is then untouched.
    """
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_write`).

    Raises:
        OSError: the folder cannot be created or written; ``path`` is then untouched.
    """
    atomic_write(path, lambda handle: handle.write(data))


def atomic_write(path: Path, write: Callable[[BinaryIO], Any], keep_previous: Path | None = None) -> None:
    """Write ``path`` atomically by streaming ``write(handle)`` into a temporary file (no second copy of a large file
    in memory), then flush, fsync, rename. ``keep_previous``: ``path``'s current content becomes that file first,
    ``path`` never missing (:func:`_keep_previous`).

    Raises:
        OSError: the folder cannot be created or written; ``path`` (and ``keep_previous``) are then untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o666 & ~_umask())  # mkstemp makes 0600; use the mode open() would
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if keep_previous is not None and path.exists():
            _keep_previous(path, Path(keep_previous))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _keep_previous(path: Path, previous: Path) -> None:
    """Make ``previous`` hold ``path``'s content, ``path`` in place: a hard link under a temporary name (the pattern
    a killed save's leftovers are cleaned up by) renamed over ``previous``; without hard links, ``path`` is renamed.

    Raises:
        OSError: the folder cannot be written; ``path`` is then untouched.
    """
    link = previous.with_name(f".{previous.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        os.link(path, link)
    except OSError:  # no hard links here (FAT, some network filesystems)
        os.replace(path, previous)
        return
    try:
        os.replace(link, previous)
    except BaseException:
        link.unlink(missing_ok=True)
        raise


def _fsync_folder(folder: Path) -> None:
    """Make the renames durable (a crash right after could otherwise lose them on some filesystems)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON with sorted keys, written atomically (:func:`atomic_write_text`)."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


# errno -> what is wrong, and what to do where choosing another place is not all (os_advice)
_OS_ADVICE = {errno.ENOSPC: "the disk is full: free space there",
              errno.EDQUOT: "the quota is full: free space within the quota",
              errno.EFBIG: "the file passes the file-size limit set outside vramcal (ulimit -f): raise it",
              errno.EROFS: "the file system is read-only", errno.EACCES: "no permission: fix the permissions",
              errno.EPERM: "no permission: fix the permissions", errno.ENOENT: "no such file or folder: check the path",
              errno.ENOTDIR: "a file stands where a folder must be",
              errno.EISDIR: "a folder stands where a file must be",
              errno.EEXIST: "a file stands in the way", errno.EIO: "the disk failed to read or write: check it",
              errno.EMFILE: "too many open files: raise the limit (ulimit -n)"}


def os_advice(error: OSError, choose: str | None = None) -> str:
    """What to do about a failed read or write, by its errno; with ``choose`` (the option naming another place),
    ending in ``choose another <choose>``. The one place an OSError becomes advice."""
    fix = _OS_ADVICE.get(error.errno, "check the path and its permissions")
    acts = ": " in fix or error.errno not in _OS_ADVICE  # the fix says what to do, else choosing another place is it
    if choose is None:
        return fix if acts else f"{fix}: choose another place"
    return f"{fix}{', or' if acts else ':'} choose another {choose}"


WRITE_CHECK_BYTES = 1 << 20  # 100 times a profile: room for it, its journal and their temporary copies


def check_writable(folder: Path, size: int = WRITE_CHECK_BYTES) -> None:
    """Write and remove ``size`` bytes in ``folder`` (created if missing), synced: a full disk fails here, before
    an hour of calibration.

    Raises:
        OSError: the folder cannot be created, or ``size`` bytes cannot be written there (naming the folder).
    """
    probe = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".vramcal-write-check.", delete=False) as probe:
            probe.write(b"\0" * size)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        raise OSError(error.errno, error.strerror or str(error), str(folder)) from None
    finally:
        if probe is not None:
            Path(probe.name).unlink(missing_ok=True)
