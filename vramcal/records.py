"""Records: the plain, frozen data vramcal measures and keeps (devices, worlds, trials, how trials run).

No process, hardware or framework code is imported here, so the pure parts can use these records anywhere.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Literal

from vramcal.schema import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Range, Record


class Kind(enum.StrEnum):
    """A device kind, and what differs between kinds: code elsewhere asks the kind, not which kind it is.

    ``cuda``: an NVIDIA GPU or a MIG slice of one; its memory is the card's own, its total what NVML reports.
    ``host``: the machine's RAM; its total is a budget vramcal holds each process to (``RLIMIT_DATA``, the user's
    ``--capacity``), and a step's data pipeline lives in it. A kind compares equal to its name (``"host"``).
    """

    CUDA = "cuda"
    HOST = "host"

    @classmethod
    def of(cls, torch_type: str) -> Kind:
        """The kind of a ``torch.device``'s type (``cuda``; ``cpu`` and the rest are the host)."""
        return cls.CUDA if torch_type == "cuda" else cls.HOST

    @property
    def torch_type(self) -> str:
        """The ``torch.device`` type a step of this kind runs on."""
        return "cuda" if self is Kind.CUDA else "cpu"

    @property
    def budgeted(self) -> bool:
        """Its total is the user's budget, held with ``RLIMIT_DATA`` (the host), not the device's own (a card)."""
        return self is Kind.HOST

    @property
    def holds_data(self) -> bool:
        """A step's data pipeline (a loader's batches, the documents) lives in this kind's memory (the host's)."""
        return self is Kind.HOST

    @property
    def cuda_kernels(self) -> bool:
        """CUDA's own kernels run here: mamba_ssm's fused Mamba-2 path, bf16 tensor cores, a card's caching
        allocator (the host runs torch's CPU kernels)."""
        return self is Kind.CUDA

    @property
    def shared(self) -> bool:
        """One memory for all of a machine's processes (the host's RAM: ranks share it), not one per device."""
        return self is Kind.HOST

    @property
    def gpu_choice(self) -> str:
        """The ``--gpu`` value that selects a device of this kind (a GPU's UUID where one is known)."""
        return "auto" if self is Kind.CUDA else "none"

    @property
    def backend(self) -> Backend:
        """torch.distributed's backend for ranks of this kind."""
        return "nccl" if self is Kind.CUDA else "gloo"

    def label(self, name: str, host: str = "host {}") -> str:
        """A device's name as reports show it: a card's as it is, the host's with ``host`` around it."""
        return name if self is Kind.CUDA else host.format(name)


@dataclass(frozen=True)
class Device(Record):
    """One calibratable memory pool: an NVIDIA GPU, a MIG slice of one, or the host's RAM.

    Attributes:
        kind: ``cuda`` for an NVIDIA GPU or MIG slice, ``host`` for the machine's RAM.
        name: marketing name (``NVIDIA H200``, ``NVIDIA H100 80GB HBM3 MIG 1g.10gb``), or the host's CPU and cores.
        total_bytes: memory the limits are computed against: a GPU's NVML v2 ``total - reserved`` (v1 ``total``;
            a MIG slice's own), the host's cgroup limit or MemAvailable; ``--capacity`` when given (never more).
        total_source: where ``total_bytes`` came from.
        uuid: ``GPU-...`` (a MIG slice: ``MIG-...``), what trials pin ``CUDA_VISIBLE_DEVICES`` to.
        pci_bus_id, nvml_index: the physical GPU's NVML identity (a slice's parent's). None on the host.
        cuda_index: the device's CUDA index among those visible to the process that selected it.
        driver_version, cuda_driver_version: NVIDIA driver and the CUDA version it supports.
        compute_capability: ``major.minor`` (``9.0`` on an H100/H200); None when NVML did not say.
        nvml_total_bytes, nvml_reserved_bytes: NVML's raw ``total`` and ``reserved`` (v2), bytes.
        parent_uuid: a MIG slice's physical GPU.
    """

    kind: Kind
    name: str
    total_bytes: int
    total_source: str
    uuid: str | None = None
    pci_bus_id: str | None = None
    nvml_index: int | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    cuda_index: int | None = None
    compute_capability: str | None = None
    nvml_total_bytes: int | None = None
    nvml_reserved_bytes: int | None = None
    parent_uuid: str | None = None
    RANGES = {"total_bytes": POSITIVE, "nvml_index": NON_NEGATIVE, "cuda_index": NON_NEGATIVE,
              "nvml_total_bytes": NON_NEGATIVE, "nvml_reserved_bytes": NON_NEGATIVE}

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))  # a name read from JSON, or given as text

    @property
    def is_mig(self) -> bool:
        return (self.uuid or "").startswith("MIG-")

    def slug(self, unique: bool = False) -> str:
        """Folder name under ``profiles/`` (``nvidia-h200-140gib``, ``host-amd-epyc-7763-2-cores``), sized by NVML's
        raw total; ``unique=True`` appends 8 hex digits of the UUID to tell identical cards apart."""
        base = self.kind.label(self.name)  # a budget's size is in the profile's name, a card's in its folder's
        size = "" if self.kind.budgeted else f"-{(self.nvml_total_bytes or self.total_bytes) // 2**30}gib"
        slug = re.sub(r"[^a-z0-9]+", "-", base.lower()).strip("-") + size
        if unique and self.uuid:
            slug += "-" + re.sub(r"[^a-z0-9]", "", self.uuid.lower().split("-", 1)[-1])[:8]
        return slug

    @property
    def gpu(self) -> str:
        """The ``gpu=`` choice that selects this device again (:func:`vramcal.api.select_devices`): a GPU's UUID
        (``auto`` without one), ``none`` for the host."""
        return self.uuid or self.kind.gpu_choice

    def hardware_difference(self, other: Device) -> str | None:
        """None when ``other`` is the same kind of device (same kind and name); else a phrase naming the difference."""
        if self.kind != other.kind:
            return f"device kind {other.kind} is not {self.kind}"
        if self.name != other.name:
            return f"device {other.name!r} is not {self.name!r}"
        return None


TrialStatus = Literal["ok", "oom", "timeout", "error"]
Backend = Literal["gloo", "nccl"]
Strategy = Literal["ddp", "fsdp"]
DDP_SETTINGS = ("bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters", "static_graph")
FSDP_SETTINGS = ("reshard_after_forward",)


@dataclass(frozen=True)
class World(Record):
    """A data-parallel world of ``nproc`` ranks (torch.distributed), each measured by its own meter; limits are per
    rank (DESIGN.md "Several processes: DDP and FSDP").

    Attributes:
        nproc: ranks (>= 2).
        backend: ``gloo`` (the host) or ``nccl`` (NVIDIA GPUs).
        strategy: ``ddp`` (DistributedDataParallel: the whole model on every rank) or ``fsdp`` (``fully_shard`` on
            each Mamba-2 block and the root: ``1/nproc`` of it per rank, plus the blocks being gathered).
        bucket_cap_mb, gradient_as_bucket_view, find_unused_parameters, static_graph: DDP's settings that change a
            rank's memory (PyTorch's DDP notes). DDP only.
        reshard_after_forward: ``fully_shard(reshard_after_forward=...)``. FSDP only.
        threads_per_rank: ``torch.set_num_threads`` of each rank (torchrun's default ``OMP_NUM_THREADS=1``).

    Raises (on construction):
        ValueError: fewer than 2 ranks, an unknown backend or strategy, a bucket size not positive, a setting of
            the other strategy.
    """

    nproc: int
    backend: Backend = "gloo"
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False
    threads_per_rank: int = 1
    strategy: Strategy = "ddp"
    reshard_after_forward: bool = True
    RANGES = {"nproc": Range(2), "bucket_cap_mb": POSITIVE, "threads_per_rank": AT_LEAST_ONE}

    def __post_init__(self) -> None:
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 2:
            raise ValueError(f"a DDP world needs at least 2 ranks, got {self.nproc!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo (the host) or nccl (NVIDIA GPUs), got {self.backend!r}")
        if not 0 < self.bucket_cap_mb < float("inf"):
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {self.bucket_cap_mb!r}")
        if self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank!r}")
        if self.strategy not in ("ddp", "fsdp"):
            raise ValueError(f"strategy must be ddp or fsdp, got {self.strategy!r}")
        other = [name for name in (FSDP_SETTINGS if self.strategy == "ddp" else DDP_SETTINGS)
                 if getattr(self, name) != getattr(World, name)]
        if other:
            raise ValueError(f"{other[0]} is a setting of {'FSDP' if self.strategy == 'ddp' else 'DDP'}, not of "
                             f"{self.strategy.upper()}: leave it out, or choose the other strategy")

    def describe(self) -> str:
        """``DDP 2 ranks (gloo, buckets 25 MiB)`` or ``FSDP 2 ranks (gloo, fully_shard per block, ...)``."""
        if self.strategy == "fsdp":
            reshard = "reshard after forward" if self.reshard_after_forward else "no reshard after forward"
            return f"FSDP {self.nproc} ranks ({self.backend}, fully_shard per block, {reshard})"
        extras = [name for name in DDP_SETTINGS if getattr(self, name) is True]
        return (f"DDP {self.nproc} ranks ({self.backend}, buckets {self.bucket_cap_mb:g} MiB"
                + "".join(f", {name}" for name in extras) + ")")

    def probe_args(self) -> list[str]:
        """The options of ``vramcal probe`` that calibrate this world (``--nproc N``, settings off their default)."""
        args = [f"--nproc {self.nproc}"] + (["--strategy fsdp"] if self.strategy == "fsdp" else [])
        for name in DDP_SETTINGS if self.strategy == "ddp" else FSDP_SETTINGS:
            value, default = getattr(self, name), getattr(World, name)
            flag = "--" + name.replace("_", "-")
            if value == default:
                continue
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
            else:
                args.append(f"{flag} {value:g}")
        return args

    def settings(self) -> dict[str, Any]:
        """The settings of this world's strategy that change a rank's memory, by name."""
        names = (*(DDP_SETTINGS if self.strategy == "ddp" else FSDP_SETTINGS), "threads_per_rank")
        return {name: getattr(self, name) for name in names}


@dataclass(frozen=True)
class TrialSettings(Record):
    """How the trials of a calibration run, and how many.

    Attributes:
        warmup_steps: unmeasured optimizer steps first (AdamW allocates its state, Triton autotunes).
        measured_steps: measured steps of each trial (>= 2: the peak is the largest of them).
        val_steps: validation passes at the trial's batch size, as the trainer validates.
        steady_steps: the most measured steps of the steady trial (:mod:`vramcal.calibration.creep`); 0: none.
        plateau_steps: the steady trial ends once its peak has not risen for this many steps after its epoch's end
            (0: it runs all ``steady_steps``; :func:`vramcal.calibration.creep.steady_done`).
        max_trials: the most trials (>= 1; several lengths add 4 per extra length; 20: ``bench/search_curves.py``).
        timeout_s: seconds before a trial's process is killed (the trial then counts as ``timeout``).
        boundary: measure near the out-of-memory boundary (:mod:`vramcal.calibration.search`, rule 3).

    Raises (on construction):
        ValueError: a setting outside its range, named. TypeError: a setting of the wrong type, named.
    """

    warmup_steps: int = 1
    measured_steps: int = 2
    val_steps: int = 1
    steady_steps: int = 40
    plateau_steps: int = 5
    max_trials: int = 20
    timeout_s: float = 900.0
    boundary: bool = True

    def __post_init__(self) -> None:
        for name, low in (("warmup_steps", 0), ("measured_steps", 2), ("val_steps", 0), ("steady_steps", 0),
                          ("plateau_steps", 0), ("max_trials", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}= takes a whole number >= {low}, not {type(value).__name__} {value!r:.40}")
            if value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)):
            raise TypeError(f"timeout_s= takes seconds, not {type(self.timeout_s).__name__} {self.timeout_s!r:.40}")
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if not isinstance(self.boundary, bool):
            raise TypeError(f"boundary= takes True or False, not {type(self.boundary).__name__} {self.boundary!r:.40}")


@dataclass(frozen=True)
class Trial(Record):
    """The raw record of one trial. Bytes are integers, times seconds; None: not measured here (or an older profile).

    Attributes:
        batch_size: samples per step.
        status: ``ok``, ``oom`` (an allocator out-of-memory error, or a kill the kernel counted as one), ``timeout``
            or ``error`` (a process killed from outside: its ``error`` starts ``Killed:``).
        peak_bytes: the figure the fit uses (DESIGN.md): GPU ``max(nvml_peak_bytes, nvml_overhead_bytes +
            torch_max_reserved_bytes)``; host ``max(rss_peak_bytes, data_peak_bytes)`` (``RLIMIT_DATA`` limits the
            data segment).
        nvml_peak_bytes, nvml_source: NVML's per-process peak (``process``), or the device-wide change
            (``device-delta``).
        nvml_overhead_bytes: NVML usage minus ``torch.cuda.memory_reserved()`` after warm-up (context, workspaces).
        torch_max_reserved_bytes, torch_max_allocated_bytes: caching allocator peaks in the measured steps.
        rss_peak_bytes, data_peak_bytes: the host's VmHWM less its file-backed pages (``RssFile``), and its peak
            VmData, over the measured steps.
        data_bytes: training data held in the measured memory (all on the host; on a GPU device-resident data).
        step_s, samples_per_s: median wall time of the measured steps, and ``batch_size / step_s``.
        step_times_s, warmup_times_s, val_times_s: each measured step (from drawing its batch to a synchronize after
            the optimizer step), warm-up step and validation pass, in order.
        startup_s, build_s, wall_s: process start, building the step, the whole trial as the caller saw it.
        purpose, error: why the search chose this size (``grow``, ...); the traceback's last lines, when it failed.
        seq_len: the trial's sequence length in a calibration over several lengths (None: the model's one).
        rank_peak_bytes: each rank's ``peak_bytes`` in a DDP world, rank 0 first; ``peak_bytes`` is the largest.
        held_bytes: what the process held once its step was built, before the first step (the process term's
            baseline; :func:`vramcal.measure.meters.host_held_bytes`, or NVML).
        step_peaks, epoch_end_step, late_creep_bytes: a steady trial's peak after each measured step, the step after
            which it ran its epoch's end, its allowance for creep after the last (:mod:`vramcal.calibration.creep`).
    """

    batch_size: int
    status: TrialStatus
    peak_bytes: int | None = None
    nvml_peak_bytes: int | None = None
    nvml_source: str | None = None
    nvml_overhead_bytes: int | None = None
    torch_max_reserved_bytes: int | None = None
    torch_max_allocated_bytes: int | None = None
    rss_peak_bytes: int | None = None
    data_peak_bytes: int | None = None
    data_bytes: int | None = None
    step_s: float | None = None
    samples_per_s: float | None = None
    startup_s: float | None = None
    build_s: float | None = None
    wall_s: float | None = None
    purpose: str = ""
    error: str | None = None
    seq_len: int | None = None
    rank_peak_bytes: tuple[int, ...] | None = None
    held_bytes: int | None = None
    step_peaks: tuple[int, ...] | None = None
    epoch_end_step: int | None = None
    late_creep_bytes: int | None = None
    step_times_s: tuple[float, ...] | None = None
    warmup_times_s: tuple[float, ...] | None = None
    val_times_s: tuple[float, ...] | None = None
    # sizes positive, byte counts and durations never negative; nvml_overhead_bytes, a difference, of any sign
    RANGES = {"batch_size": AT_LEAST_ONE, "peak_bytes": POSITIVE, "seq_len": AT_LEAST_ONE, "step_peaks": POSITIVE,
              "epoch_end_step": AT_LEAST_ONE, "late_creep_bytes": NON_NEGATIVE,
              **dict.fromkeys(("nvml_peak_bytes", "torch_max_reserved_bytes", "torch_max_allocated_bytes",
                               "rss_peak_bytes", "data_peak_bytes", "data_bytes", "step_s", "samples_per_s",
                               "startup_s", "build_s", "wall_s", "step_times_s", "warmup_times_s",
                               "val_times_s"), NON_NEGATIVE)}

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.peak_bytes is not None

    def fits(self, usable_bytes: int) -> bool:
        """Finished and its peak stayed within ``usable_bytes``."""
        return self.ok and self.peak_bytes <= usable_bytes  # type: ignore[operator]
