"""Option types and option groups shared by several commands, each declared once; and the one place
where errors become one line and an exit status.

Exit statuses (README "Exit codes"): 0 done; 1 a failure the message explains (bad data, no profile,
no device, a trial that could not start, a failed run); 2 a bad option value; 3 a calibration that wrote
a profile whose limits are not verified by real trials (or has none); 130 interrupted (Ctrl-C); 143 stopped by
SIGTERM (``kill``, ``timeout``, a scheduler's cancel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from vramcal.calibration.limits import LimitSettings
from vramcal.cli.types import ByteSize, ByteSizes, Checkpointing, FiniteFloat, GpuChoice, Reporters, SeqLenList
from vramcal.cli.types import KeyValue as KeyValue  # re-exported: vramcal.cli.options.KeyValue is named in docs
from vramcal.estimate import EstimateError
from vramcal.files import os_advice
from vramcal.measure.nvml import NvmlError
from vramcal.models.mamba2 import CHECKPOINTING_FORMS, DTYPE_POLICIES, IMPLEMENTATIONS
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.profile import left_out, load_profile, profiles_under
from vramcal.records import Kind, World
from vramcal.service.calibrator import CalibrationError
from vramcal.sizing.staleness import STRICT_ENV
from vramcal.train.config import REPORT_TO, VARIANT_CHOICES
from vramcal.train.errors import TrainError

EXIT_UNVERIFIED = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process that SIGTERM ended
_DEFAULTS = RegressorSpec()
SPEC_NAMES = ("d_model", "n_layers", "d_state", "headdim", "expand", "chunk_size", "seq_len", "dtype", "checkpointing")


def group(*decorators: Callable) -> Callable:
    """Several click decorators as one, applied in the order written (so ``--help`` lists them so)."""
    return lambda command: functools.reduce(lambda cmd, option: option(cmd), reversed(decorators), command)


def collected(name: str, build: Callable[..., Any], *decorators: Callable) -> Callable:
    """Click options gathered into one typed value: the command receives ``name=build(**their values)`` in their
    stead, so an option can be followed from where it is declared to the record that carries it.

    ``build`` must not raise anything but :class:`click.BadParameter` (it runs before the command's own error
    handling).
    """
    names = [param.name for param in group(*decorators)(lambda: None).__click_params__]

    def apply(command: Callable) -> Callable:
        @functools.wraps(command)
        def gathered(*args: Any, **kwargs: Any) -> Any:
            kwargs[name] = build(**{key: kwargs.pop(key) for key in names})
            return command(*args, **kwargs)

        return group(*decorators)(gathered)

    return apply


def explicit(ctx: click.Context) -> set[str]:
    """The parameters given on the command line (not defaults)."""
    return {name for name in ctx.params
            if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)}


GPU_HELP = "auto | none (the host) | all | a CUDA index among the visible GPUs | a GPU/MIG UUID"

device_options = group(
    click.option("--gpu", type=GpuChoice(), default="auto", show_default=True, help=GPU_HELP),
    click.option("--impl", "implementation", type=click.Choice(IMPLEMENTATIONS), default="auto", show_default=True,
                 help="the Mamba-2 implementation: mamba_ssm's fused kernels on GPUs where they import"),
)

def _spec_group(seq_len_option: Callable) -> Callable:
    return group(
        click.option("--d-model", type=click.IntRange(1), default=_DEFAULTS.d_model, show_default=True),
        click.option("--n-layers", type=click.IntRange(1), default=_DEFAULTS.n_layers, show_default=True),
        click.option("--d-state", type=click.IntRange(1), default=_DEFAULTS.d_state, show_default=True),
        click.option("--headdim", type=click.IntRange(1), default=_DEFAULTS.headdim, show_default=True),
        click.option("--expand", type=click.IntRange(1), default=_DEFAULTS.expand, show_default=True),
        click.option("--chunk-size", type=click.IntRange(1), default=_DEFAULTS.chunk_size, show_default=True),
        seq_len_option,
        click.option("--dtype", type=click.Choice(DTYPE_POLICIES), default=_DEFAULTS.dtype, show_default=True,
                     help="fp32, or fp32 weights with bf16 autocast (CUDA, compute capability 8.0+)"),
        click.option("--checkpointing", type=Checkpointing(), default=_DEFAULTS.checkpointing, show_default=True,
                     help=f"activation checkpointing, {CHECKPOINTING_FORMS}: every Mamba-2 block, or every K-th, "
                          f"recomputed in the backward pass (less memory per sample, more compute); each its own "
                          f"profile"),
    )


spec_options = _spec_group(click.option("--seq-len", type=click.IntRange(1), default=_DEFAULTS.seq_len,
                                        show_default=True))
# probe: one length, or several calibrated at once (issue 13)
probe_spec_options = _spec_group(click.option(
    "--seq-len", type=SeqLenList(), default=str(_DEFAULTS.seq_len), show_default=True,
    help="one length, or several calibrated at once: a list 128,512,2048 or a range 128:2048 (its ends and their "
         "geometric middle); multiples of chunk_size"))

data_options = group(
    click.option("--stride", type=click.IntRange(1), default=None, help="bars between windows [default: seq_len // 2]"),
    click.option("--val-fraction", type=FiniteFloat(0, 1, min_open=True, max_open=True), default=0.2,
                 show_default=True, help="the last fraction of rows, for validation"),
    click.option("--data-on-device", is_flag=True, help="hold the windows in GPU memory (counted there) instead of "
                 "host memory with batches copied per step"),
)

def strict_profiles(strict: bool) -> None:
    """``--strict-profile``: refuse stale profiles for the rest of this command (:mod:`vramcal.sizing.staleness`), its
    workers included (they inherit the environment)."""

    if strict:
        os.environ[STRICT_ENV] = "1"


strict_option = click.option("--strict-profile", "strict_profile", is_flag=True,
                             help="refuse a profile made under other software or settings that can move memory (a "
                                  "new torch, CUDA, driver or allocator setting; on the host also the torch build and "
                                  "Python) instead of warning; also VRAMCAL_STRICT_PROFILE=1")


training_options = group(
    click.option("--data", "data", type=click.Path(dir_okay=False), default="data/es_1s.parquet", show_default=True,
                 help="OHLCV parquet: timestamp, open, high, low, close, volume"),
    click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
                 help="JSON or TOML file of settings (option names with underscores); options given here win"),
    device_options,
    click.option("--capacity", type=ByteSizes(min_bytes=2**20), default=None,
                 help="memory budget, e.g. 12GiB: on the host the training process's limit (default: the "
                      "profile's budget); on a GPU it narrows the card; under DDP on the host one per local rank "
                      "(2GiB,3GiB: each rank sized by its own budget's profile)"),
    spec_options,
    click.option("--profile", default="auto", show_default=True, help="auto (look in --profiles-dir) or a file"),
    strict_option,
    click.option("--profiles-dir", type=click.Path(file_okay=False), default="profiles", show_default=True),
    click.option("--batch-size-min", type=click.IntRange(1), default=1, show_default=True),
    click.option("--size-for", type=click.Choice(("memory", "throughput")), default="memory", show_default=True,
                 help="without --batch-size: memory = the profile's conservative batch size; throughput = the "
                      "throughput knee (the smallest measured size reaching 95 % of the best samples/s) when it is "
                      "below that, else the conservative size"),
    click.option("--lr-scaling", type=click.Choice(("none", "linear", "sqrt")), default="sqrt", show_default=True,
                 help="how the peak LR follows the batch size from --reference-batch-size"),
    click.option("--reference-batch-size", type=click.IntRange(1), default=96, show_default=True),
    click.option("--warmup-steps", type=click.IntRange(0), default=None, help="[default: 5 % of the steps]"),
    click.option("--max-steps", type=click.IntRange(1), default=None, help="stop after this many optimizer steps"),
    click.option("--seed", type=int, default=0, show_default=True),
    data_options,
    click.option("--checkpoint-steps", type=click.IntRange(1), default=None,
                 help="also save a checkpoint every N steps within an epoch"),
    click.option("--checkpoint-minutes", type=FiniteFloat(0, min_open=True), default=None,
                 help="also save a checkpoint every M minutes within an epoch"),
    click.option("--variant", type=click.Choice(VARIANT_CHOICES), default="spec", show_default=True,
                 help="spec: train the model as its options give it; auto: the calibrated variant of it (its "
                      "--checkpointing and --chunk-size) with the most measured samples/s for this run's batch"),
    click.option("--report-to", type=Reporters(), default="tensorboard", show_default=True,
                 help=f"where the epochs' figures go beside metrics.jsonl: {', '.join(REPORT_TO)} (MLflow when "
                      f"installed: its own tracking URI and experiment), comma-separated, or none"),
)

@dataclasses.dataclass(frozen=True)
class WorldOptions:
    """A command's options for a data-parallel world (``parallel``): the strategy and the settings that change a
    rank's memory; None for the backend means nccl on GPUs, gloo on the host."""

    backend: str | None = None
    strategy: str = World.strategy  # World's defaults, written once there
    bucket_cap_mb: float = World.bucket_cap_mb
    gradient_as_bucket_view: bool = World.gradient_as_bucket_view
    find_unused_parameters: bool = World.find_unused_parameters
    static_graph: bool = World.static_graph
    reshard_after_forward: bool = World.reshard_after_forward
    oversubscribe: bool = False  # more host ranks than cores (check_local_ranks); no setting of the world's

    @classmethod
    def build(cls, ddp_backend: str | None, **settings: Any) -> WorldOptions:
        return cls(ddp_backend, **settings)

    def world(self, nproc: int, kind: Kind, nproc_flag: str = "--nproc") -> World | None:
        """The :class:`~vramcal.records.World` of ``nproc`` ranks on devices of ``kind`` these options ask for, or
        None for one process.

        Raises:
            click.BadParameter: a world that cannot be (the message names the option); world options given for
                one process.
        """
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if f.name not in ("backend", "oversubscribe")}
        if nproc == 1:
            changed = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
            if changed:
                raise click.BadParameter(f"is for a world of 2 or more ranks, and this is one process: add "
                                         f"{nproc_flag} N, or leave it out", param_hint=_flag(changed[0]))
            return None
        try:
            return World(nproc, self.backend or kind.backend, **settings)
        except ValueError as error:
            name = next((n for n in settings if str(error).startswith(n)), None)
            raise click.BadParameter(str(error), param_hint=_flag(name) if name else None) from None


def _flag(name: str) -> str:
    return {"backend": "--ddp-backend", "reshard_after_forward": "--reshard-after-forward/--no-reshard-after-forward"
            }.get(name, "--" + name.replace("_", "-"))


world_options = collected(
    "parallel", WorldOptions.build,
    click.option("--strategy", type=click.Choice(("ddp", "fsdp")), default=World.strategy, show_default=True,
                 help="ddp: every rank holds the whole model (DistributedDataParallel); fsdp: FSDP2's fully_shard on "
                      "each Mamba-2 block and the root, every rank holding 1/N of the parameters, gradients and "
                      "optimizer state"),
    click.option("--ddp-backend", type=click.Choice(("gloo", "nccl")), default=None,
                 help="[default: gloo on the host, nccl on GPUs]"),
    click.option("--bucket-cap-mb", type=FiniteFloat(0, min_open=True), default=World.bucket_cap_mb,
                 show_default=True, help="DDP's gradient bucket size, MiB"),
    click.option("--gradient-as-bucket-view", is_flag=True, help="DDP's gradients as views of its buckets"),
    click.option("--find-unused-parameters", is_flag=True, help="DDP's search for parameters without gradients"),
    click.option("--static-graph", is_flag=True, help="DDP's static-graph mode"),
    click.option("--reshard-after-forward/--no-reshard-after-forward", default=World.reshard_after_forward,
                 show_default=True, help="FSDP: free each block's gathered parameters after its forward (gathered "
                                         "again for the backward); --no-: keep them, more memory, less traffic"),
    click.option("--oversubscribe", is_flag=True,
                 help="allow more host (gloo) ranks than the cores this process may run on: ranks then share cores, "
                      "so step times and throughput are slower than with a core each (memory per rank is the same)"),
)


def check_local_ranks(nproc: int, flag: str, kind: Kind, oversubscribe: bool = False) -> None:
    """A world of ``nproc`` ranks on this machine must fit what it has, checked before any rank is forked: on the
    host (gloo) at most one rank per core this process may run on (a rank's step, timed and measured, needs its
    core), unless ``oversubscribe`` (``--oversubscribe``: the user takes ranks sharing cores, slower); GPUs are
    checked against the visible ones where the devices are chosen.

    Raises:
        click.BadParameter: more ranks than cores without ``oversubscribe``, naming ``flag``.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if kind.shared and nproc > cores and not oversubscribe:
        raise click.BadParameter(f"{nproc} ranks is more than the {cores} cores this process may run on: a host "
                                 f"rank needs a core of its own; give {flag} {cores} or fewer, or --oversubscribe "
                                 f"to share cores (slower steps)", param_hint=flag)


def limit_settings(reserve: int, margin: float, conservative_fraction: float):
    """The :class:`~vramcal.calibration.limits.LimitSettings` the limit options give."""

    return LimitSettings(reserve_bytes=reserve, margin=margin, conservative_fraction=conservative_fraction)


limit_options = collected(
    "settings", limit_settings,
    click.option("--reserve", type=ByteSize(), default="512MiB", show_default=True, help="memory kept free"),
    click.option("--margin", type=FiniteFloat(0, 1, max_open=True), default=0.10, show_default=True,
                 help="fraction of total memory kept free"),
    click.option("--conservative", "conservative_fraction", type=FiniteFloat(0, 1, min_open=True), default=0.9,
                 show_default=True, help="conservative = floor(this x safe)"),
)


@contextlib.contextmanager
def one_line(interrupted: str | Callable[[], str] = "interrupted") -> Iterator[None]:
    """Turn vramcal's user-facing errors into one line and exit 1 (Ctrl-C: ``interrupted`` and exit 130; SIGTERM:
    the same with ``stopped by SIGTERM`` in place of its first word, exit 143). ``interrupted`` may be a function,
    called when the interrupt comes, for a line that says what is on disk then (a run's checkpoints, or none).

    Every error class vramcal raises for people is a ValueError (bad data, a bad profile, config or LM config,
    no profile, no device, a bad factory) or a RuntimeError subclass whose message is written for people (a
    failed calibration or run, NVML); OSError covers files that cannot be read or written. A message of several
    lines (a library's) is joined into one.
    """

    try:
        yield
    except click.ClickException:
        raise
    except Terminated:
        line = interrupted() if callable(interrupted) else interrupted
        raise Stopped(f"stopped by SIGTERM{line.removeprefix('interrupted')}") from None
    except KeyboardInterrupt:
        raise Interrupted(interrupted() if callable(interrupted) else interrupted) from None
    except (ValueError, CalibrationError, EstimateError, NvmlError, TrainError) as error:
        raise click.ClickException(single_line(str(error)) or type(error).__name__) from None
    except OSError as error:
        raise click.ClickException(f"cannot read or write {error.filename or 'a file'} "
                                   f"({single_line(error.strerror or str(error))}): {os_advice(error)}") from None


def single_line(text: str) -> str:
    """``text`` as one line: its lines joined by spaces (a message from a library may span several)."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


class Unverified(click.ClickException):
    """A failure that is a profile without verified limits (``vramcal size`` of a profile with none): one line, exit
    :data:`EXIT_UNVERIFIED`, as the calibration that wrote it."""

    exit_code = EXIT_UNVERIFIED


class Interrupted(click.ClickException):
    exit_code = EXIT_INTERRUPTED


class Stopped(click.ClickException):
    exit_code = EXIT_TERMINATED


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by :func:`stop_on_sigterm`'s handler: a KeyboardInterrupt, so that it
    takes Ctrl-C's way out (workers killed first, checkpoints and journals kept, one line), with its own status."""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While the command runs, SIGTERM raises :class:`Terminated` (its default ends the process at once: no line,
    and its workers, whose parent is the fork server, left to notice alone); the previous handler after. Only in
    the main thread, where Python runs signal handlers."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def load_profiles(paths: tuple[Path, ...], why_not: Callable[[Any], str | None] = lambda profile: None
                  ) -> tuple[list, list[str]]:
    """The profiles PATHS name, and one line per profile a folder held that the command leaves out.

    A file is taken as it is: one that is no profile, or that ``why_not`` refuses, ends the command (it was asked
    for by name). A folder gives every profile below it (:func:`vramcal.profile.profiles_under`) that ``why_not``
    (the command's use of a profile: None, or why it cannot use it) has nothing against; each of its files left
    out, unreadable or refused, is one line ``left out PATH: why``, and the command goes on with the rest.

    Raises:
        click.ClickException: a named file that is no profile or is refused; a folder holding no profile file;
            nothing left to use (the first line says why).
    """
    profiles, lines = [], []
    with one_line():
        for path in paths:
            if not path.is_dir():
                profile = load_profile(path)
                if (why := why_not(profile)) is not None:
                    raise click.ClickException(f"{path}: {why}")
                profiles.append(profile)
                continue
            found, unreadable = profiles_under(path)
            if not found and not unreadable:
                raise click.ClickException(f"{path} holds no profile (*.json): run `vramcal probe` first")
            refused = [(p.path, why) for p in found if (why := why_not(p)) is not None]
            lines += [left_out(where, why) for where, why in sorted(unreadable + refused)]
            profiles += [p for p in found if p.path not in dict(refused)]
    if not profiles:
        raise click.ClickException(f"no profile here can be used ({len(lines)} left out; the first: "
                                   f"{lines[0].removeprefix('left out ')})")
    return profiles, lines
