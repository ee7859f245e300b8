"""The software and settings of a process that change the memory of the same step: read here (no torch import),
recorded in every profile, compared when one is used (:mod:`vramcal.sizing.staleness`). The workers' defaults
(:data:`WORKER_DEFAULTS`) are set by :class:`vramcal.measure.worker.Workers` before its fork server starts.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys
from collections.abc import Mapping
from pathlib import Path

# glibc malloc in host workers: a fixed 256 KiB mmap/trim threshold, one arena, huge pages for mapped blocks, so
# peaks repeat and long runs do not creep above their trials (bench/results/creep-256k/STUDY.md).
HOST_MALLOC = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=262144:glibc.malloc.trim_threshold=262144:"
               "glibc.malloc.arena_max=1")
# oneDNN's primitive cache (one entry per op and shape) grows without bound on changing batch shapes: off in host
# workers (bench/results/lm-train/README.md).
ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ARROW_POOL = "ARROW_DEFAULT_MEMORY_POOL"  # Arrow's system pool: its default keeps ~1 GiB of address space (DESIGN.md)
# What a worker's fork server starts with unless the caller set it (read once, when a process starts).
WORKER_DEFAULTS = {ARROW_POOL: "system", "GLIBC_TUNABLES": HOST_MALLOC,
                   "PYTORCH_NVML_BASED_CUDA_CHECK": "1", ONEDNN_CACHE: "0"}
# Of those, the host's own: a GPU worker builds its batches with glibc's and oneDNN's defaults, as a framework's
# process on the card does (the 256 KiB threshold makes host steps up to 71 % slower: creep-256k/STUDY.md).
HOST_ONLY = ("GLIBC_TUNABLES", ONEDNN_CACHE)
# Triton's kernel and autotuning caches (triton 3.6 knobs.autotuning.cache), kept across a GPU worker's trials.
TRITON_ENV = ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")
# The CUDA caching allocator's and the driver's settings (PyTorch's "CUDA semantics" notes), and the host's.
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_MODULE_LOADING")
HOST_MALLOC_ENV = ("GLIBC_TUNABLES", ARROW_POOL, "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_",
                   "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD", "OMP_NUM_THREADS", ONEDNN_CACHE)
# Packages recorded in a profile; those whose version can move the memory of the same step.
RECORDED_PACKAGES = ("torch", "transformers", "mamba-ssm", "causal-conv1d", "triton", "nvidia-ml-py", "nvitop")
MEMORY_PACKAGES = ("torch", "transformers", "mamba-ssm", "causal-conv1d", "triton")


# mallopt(3) parameters of the HOST_MALLOC tunables a running process can still take (hugetlb it cannot).
_MALLOPT = {"glibc.malloc.mmap_threshold": -3, "glibc.malloc.trim_threshold": -1, "glibc.malloc.arena_max": -8}


def set_host_malloc() -> str | None:
    """Give this running process the workers' glibc malloc settings (:data:`HOST_MALLOC`) through ``mallopt``
    (all but huge pages), so a framework's process sized by a host profile holds what the trials did.

    Returns:
        What was set, for a notice (None: not glibc, or this process already started with them).
    """
    import ctypes

    if _STARTED_WITH_TUNABLES == HOST_MALLOC or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    settings = dict(item.split("=") for item in HOST_MALLOC.split(":"))
    for name, parameter in _MALLOPT.items():
        if libc.mallopt(parameter, int(settings[name])) != 1:
            return None
    return ", ".join(f"{name.rsplit('.', 1)[1]} {settings[name]}" for name in _MALLOPT)


CACHED_STACKS = 2  # thread stacks a worker forked from the server finds cached (bench/README.md, "The process term")


def cache_thread_stacks(count: int = CACHED_STACKS) -> None:
    """Leave ``count`` thread stacks in glibc's stack cache, as a forked worker finds them, so a step's threads reuse
    them instead of mapping 8 MiB of data segment each (bench/README.md, "The process term and the late threads")."""
    import threading
    import time

    tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
    alive = threading.Barrier(count)  # all alive at once: each holds a stack of its own, not the last one's again
    threads = [threading.Thread(target=alive.wait, name="vramcal-stack") for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for _ in range(100):  # a joined thread's stack reaches the cache when its task has ended
        if tasks is None or len(os.listdir("/proc/self/task")) <= tasks:
            break
        time.sleep(0.01)


def set_arrow_pool() -> str | None:
    """Give this process Arrow's system memory pool, as the workers have it, unless ``ARROW_DEFAULT_MEMORY_POOL``
    chose one: an imported pyarrow's pool now, the variable for a later import and children. Arrow's default
    reserves 1 GiB of VmData per reading thread (bench/README.md, "FSDP on the host").

    Returns:
        What was set, for a notice (None: the process started with the variable set, or the pool is the system's).
    """
    if _STARTED_WITH_ARROW_POOL:
        return None  # the caller's choice (the workers' setting in os.environ may be vramcal's own, for children)
    pyarrow = sys.modules.get("pyarrow")  # imported already: its default pool may be in use
    if pyarrow is not None:
        if pyarrow.default_memory_pool().backend_name == "system":
            return None
        pyarrow.set_memory_pool(pyarrow.system_memory_pool())
    elif os.environ.get(ARROW_POOL) == "system":
        return None
    os.environ[ARROW_POOL] = "system"
    return f"{ARROW_POOL}=system"


# as at import: starting the workers' server sets GLIBC_TUNABLES in os.environ for a while
_STARTED_WITH_TUNABLES = os.environ.get("GLIBC_TUNABLES")
_STARTED_WITH_ARROW_POOL = os.environ.get(ARROW_POOL)


# The least RLIMIT_AS a process that runs steps can work in (torch, transformers and one tiny step map 1.07 GiB).
ADDRESS_SPACE_FLOOR = 2 * 2**30


def address_space_refusal() -> str | None:
    """The one line for an RLIMIT_AS set outside vramcal below :data:`ADDRESS_SPACE_FLOOR` (None: none, or enough)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft >= ADDRESS_SPACE_FLOOR:
        return None
    return (f"this process may map at most {soft / 2**30:.2f} GiB of address space (RLIMIT_AS, set outside vramcal: "
            f"ulimit -v, prlimit --as): torch and its libraries map more than that before a step; lift it to "
            f"{ADDRESS_SPACE_FLOOR // 2**30} GiB or more, and bound the run with --capacity instead")


def software_versions() -> dict[str, str | None]:
    """Versions of Python and the packages of :data:`RECORDED_PACKAGES` (None: not installed); torch's with its build
    (:func:`torch_version`)."""
    versions = {"python": platform.python_version(), **{name: package_version(name) for name in RECORDED_PACKAGES}}
    return {**versions, "torch": torch_version(versions["torch"])}


def package_version(distribution: str) -> str | None:
    """An installed distribution's version (None: not installed)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_version(published: str | None) -> str | None:
    """torch's version with its build (``2.13.0+cpu``), read from its ``version.py`` without importing it: the
    published version lacks the build, which moves memory (a CUDA build's host worker holds ~540 MiB more)."""
    if published is None or "+" in published:
        return published
    try:
        text = importlib.metadata.distribution("torch").locate_file("torch/version.py").read_text()
    except (importlib.metadata.PackageNotFoundError, OSError):
        return published
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found and found.group(1).split("+")[0] == published else published


def triton_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """A GPU worker's Triton caches (:data:`TRITON_ENV`): ``$XDG_CACHE_HOME/vramcal/triton``, else (unset or
    relative, as the XDG Base Directory specification says) ``~/.cache/vramcal/triton``."""
    base = environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "vramcal" / "triton"


def worker_setting(name: str) -> str | None:
    """The value of environment variable ``name`` a worker started now would see."""
    return os.environ.get(name, WORKER_DEFAULTS.get(name))


def shown_setting(value: str | None) -> str:
    """An environment variable's value for people: ``unset`` (None), else quoted (``'1'``)."""
    return "unset" if value is None else repr(value)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (``/proc/PID/stat``'s state ``Z``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True
