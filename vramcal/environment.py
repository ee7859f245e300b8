"""The software and the settings a process runs with that change the memory of the same step: read here, recorded
in every profile, and compared when a profile is used (:mod:`vramcal.sizing.staleness`).

Nothing here imports torch: versions come from the installed packages' metadata, settings from the
environment as a worker will see it (:class:`vramcal.measure.worker.Workers` sets vramcal's defaults for the
host allocator before its fork server starts: :data:`WORKER_DEFAULTS`).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys
from collections.abc import Mapping
from pathlib import Path

# glibc malloc in workers: blocks of 256 KiB and more are mapped and unmapped on their own (a fixed threshold: glibc's
# default threshold drifts up to 32 MiB as blocks are freed, and the heap then fragments by chance), one arena, and
# transparent huge pages for those mappings. With glibc's defaults three trials of the tiny spec at one batch size
# varied by 4-8 %. With a fixed 4 MiB threshold they agreed within 1 %, but the activations between 256 KiB and 4 MiB
# stayed on the heap, which fragmented step after step: 1,000-step runs at the four benchmark specs' safe sizes crept
# 1.3-6.9 % above a trial (bench/results/creep/STUDY.md). At 256 KiB (2-core host, steady trials at small 135, long
# 13, wide 21, default 72): the creep over 30-100 steps 0.04 / 0.2 / 0.4 / 0.05 % instead of 4.7 / 0.6 / 5.6 / 0.4 %,
# the first step's peak 4.3 / 14 / 3.8 / 0.3 % lower (the last's 8.6 / 14 / 8.5 / 0.7 %), a step 44 / 49 / 71 / 0 %
# slower (page faults of the fresh mappings; none on the default spec, whose activations were mapped already).
# bench/results/creep-256k/STUDY.md.
HOST_MALLOC = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=262144:glibc.malloc.trim_threshold=262144:"
               "glibc.malloc.arena_max=1")
# oneDNN's primitive cache off in workers: it keeps a compiled primitive per op and shape (1,024 by default), so a run
# whose batch shapes change (lengths that vary: the lm on text in the token budget's batches) grew its data segment
# ~0.85 MiB a step past every trial's peak and ran out of memory at step 172 of 300; with the cache off the same
# batches held flat (bench/results/lm-train/README.md). One shape needs a handful of entries, so the trials hold the
# same with it on or off (the tiny lm on one shape: 636 MiB either way, its 120 steps 4.8 % longer; on changing shapes
# 659 against 839 MiB by step 120).
ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ARROW_POOL = "ARROW_DEFAULT_MEMORY_POOL"  # Arrow's system pool: its default keeps ~1 GiB of address space (DESIGN.md)
# What a host worker's fork server starts with unless the caller set it (read once, when a process starts).
WORKER_DEFAULTS = {ARROW_POOL: "system", "GLIBC_TUNABLES": HOST_MALLOC,
                   "PYTORCH_NVML_BASED_CUDA_CHECK": "1", ONEDNN_CACHE: "0"}
# Of those, the host's figures' own: a GPU worker builds its batches on the host with glibc's and oneDNN's defaults,
# as a framework's process on the same card does (the 256 KiB mmap threshold faults in every fresh mapping: host
# steps up to 71 % slower, bench/results/creep-256k/STUDY.md), so its rates are the ones a run gets.
HOST_ONLY = ("GLIBC_TUNABLES", ONEDNN_CACHE)
# Triton keeps its compiled kernels, and with TRITON_CACHE_AUTOTUNING=1 its autotuning results (triton 3.6:
# knobs.autotuning.cache; Autotuner.check_disk_cache writes <kernel>.autotune.json), in TRITON_CACHE_DIR, so the
# fused path's trials after the first neither compile nor autotune again: a GPU worker's defaults.
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
    """Give this running process the workers' glibc malloc settings (:data:`HOST_MALLOC`) through ``mallopt``:
    the fixed mmap and trim thresholds and one arena, for the allocations from now on (huge pages for mapped
    blocks only a process started with ``GLIBC_TUNABLES`` gets). A framework's process sized by a host
    profile needs them for its steps to hold what the trials' did: measured on the host, a plain loop of the
    tiny language model at batch 136 peaked 863 MiB with glibc's defaults, 745 MiB after this call and 747 MiB
    started with the tunables (the trial: 801 MiB; measured with the earlier 4 MiB thresholds).

    Whether the process started with them is read as it was when vramcal was imported, not from ``os.environ``
    now: starting the trials' workers sets the variable there while their server starts (it stayed there before,
    and a process that calibrated and then trained skipped the settings: +5.5 % over its prediction).

    Returns:
        What was set, for a notice (None: not glibc, or this process already started with them).
    """
    import ctypes
    import platform

    if _STARTED_WITH_TUNABLES == HOST_MALLOC or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    settings = dict(item.split("=") for item in HOST_MALLOC.split(":"))
    for name, parameter in _MALLOPT.items():
        if libc.mallopt(parameter, int(settings[name])) != 1:
            return None
    return ", ".join(f"{name.rsplit('.', 1)[1]} {settings[name]}" for name in _MALLOPT)


CACHED_STACKS = 2  # thread stacks a worker forked from the server finds in glibc's cache (measured: host, 2 cores)


def cache_thread_stacks(count: int = CACHED_STACKS) -> None:
    """Leave ``count`` thread stacks in this process's glibc stack cache, as a worker forked from the trials' server
    finds them (its server's threads' stacks, freed by the fork): threads started by a training step later reuse
    them rather than mapping 8 MiB of data segment each after the process term was measured. Measured on the
    host, the tiny language model at batch 396: a fresh process grew 14.6 MiB more than the trial from the start
    of training to its peak, 8 MiB of it the stack of the thread torch starts at the first step; with its stacks
    cached as the trial's, 7 MiB (bench/README.md, "The process term and the late threads")."""
    import threading

    for _ in range(count):
        thread = threading.Thread(target=lambda: None, name="vramcal-stack")
        thread.start()
        thread.join()


def set_arrow_pool() -> str | None:
    """Give this process Arrow's system memory pool, as the workers have it (:data:`WORKER_DEFAULTS`), unless
    ``ARROW_DEFAULT_MEMORY_POOL`` chose one: an imported pyarrow's default pool is set now
    (``pyarrow.set_memory_pool``), and the variable is set for a pyarrow imported later and for child processes.
    Arrow's default pool (mimalloc) reserves a 1 GiB mapping when a thread other than the main one first reads data,
    which the host's meter counts (VmData): building the regressor's step in a thread grew VmData by 1,237 MiB
    with it and 213 MiB with the system pool, and a Lightning FSDP rank, which builds its model so, measured a
    process term of +1.14 GiB and fit no batch (bench/README.md, "FSDP on the host"). Data read before this call
    stays where it is.

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


# GLIBC_TUNABLES as this process had it when vramcal was imported: starting the trials' workers sets it in
# os.environ while their server starts (glibc parses the variable in place, so /proc/self/environ no longer holds it)
_STARTED_WITH_TUNABLES = os.environ.get("GLIBC_TUNABLES")
_STARTED_WITH_ARROW_POOL = os.environ.get(ARROW_POOL)


# The least address space (RLIMIT_AS) a process that runs steps can work in: importing torch maps 0.66 GiB on the
# host (VmSize), and torch, transformers and one step of the tiny model 1.07 GiB (VmPeak); under
# `prlimit --as=1GiB` the imports themselves fail, in whatever allocates first. A larger model maps more.
ADDRESS_SPACE_FLOOR = 2 * 2**30


def address_space_refusal() -> str | None:
    """The one line for an RLIMIT_AS set outside vramcal below :data:`ADDRESS_SPACE_FLOOR` (None: none, or enough).
    vramcal bounds a run's memory itself (``--capacity``, through RLIMIT_DATA), which counts what a run holds."""
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
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in RECORDED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {**versions, "torch": torch_version(versions["torch"])}


def torch_version(published: str | None) -> str | None:
    """torch's version with its build, as ``torch.__version__`` (``2.13.0+cpu``, ``2.13.0+cu130``), read from its
    ``version.py`` without importing it: PyPI publishes ``published`` without the build, which moves memory (a host
    worker of the CUDA build holds about 540 MiB more than one of the CPU build)."""
    if published is None or "+" in published:
        return published
    try:
        text = importlib.metadata.distribution("torch").locate_file("torch/version.py").read_text()
    except (importlib.metadata.PackageNotFoundError, OSError):
        return published
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found and found.group(1).split("+")[0] == published else published


def triton_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where a GPU worker's Triton keeps its caches unless the caller chose (:data:`TRITON_ENV`):
    ``$XDG_CACHE_HOME/vramcal/triton``, ``~/.cache/vramcal/triton`` when that is unset or relative (the XDG Base
    Directory specification ignores a relative one)."""
    base = environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "vramcal" / "triton"


def worker_setting(name: str) -> str | None:
    """The value of environment variable ``name`` a worker started now would see."""
    return os.environ.get(name, WORKER_DEFAULTS.get(name))


def shown_setting(value: str | None) -> str:
    """An environment variable's value for people: ``unset`` (None), else quoted (``'1'``)."""
    return "unset" if value is None else repr(value)
