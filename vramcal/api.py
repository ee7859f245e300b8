"""vramcal's public API: calibrate a training step on a device, find its profile, size a run.

Every command is an adapter over these functions; a user's own script is too::

    import vramcal

    profile = vramcal.calibrate("mytrain:make_step", gpu="auto")   # real trials, verified limits, saved
    batch_size = vramcal.batch_size(profile)                        # the conservative batch size
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True)

where ``mytrain.make_step(device, **params)`` returns a :class:`vramcal.TrainingStep` (see
:mod:`vramcal.workload`). Models are named by family (``regressor``, the bundled default; ``lm``, a
Mamba-2 language model from a transformers config: :mod:`vramcal.models.registry`) or by ``module:function``.

What is decided where: :func:`model_ref` turns a model choice and a device into the profile's key
(checking the arguments and resolving ``implementation="auto"``); :func:`plan_calibration` adds the
lengths, the budget, the trial settings and the file; :func:`run_calibration` runs the trials
(:mod:`vramcal.calibrator`); :func:`vramcal.sizing.size` turns a profile into a batch size and its
predicted peak. Each returns a record that the next one takes.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vramcal.arguments import callback, flag, mapping, of_type, path_like
from vramcal.calibration.creep import read_peak
from vramcal.calibration.fit2d import SeqLens, parse_seq_lens
from vramcal.calibration.limits import LimitSettings
from vramcal.calibrator import CalibrationError, CalibrationPlan, run_trials
from vramcal.estimated import aim_for
from vramcal.files import check_writable
from vramcal.journal import Journal, journal_path, plan_key
from vramcal.measure.device import check_host_world, free_bytes, select
from vramcal.measure.trial import TrialRequest, TrialRunner
from vramcal.measure.worker import Workers
from vramcal.models.registry import DATA_OPTIONS, arguments, family_of, model_ref
from vramcal.profile import (
    DEFAULT_PROFILES_DIR,
    Profile,
    ProfileError,
    load_profile,
    newest_profile,
    profile_path,
    replaced_name,
    save_profile,
)
from vramcal.progress import TrialPrinter
from vramcal.records import Device, Trial, TrialSettings, World
from vramcal.sizing import (
    Answer,
    Limit,
    NoLimitsError,
    SizeRequest,
    Sizing,
    SizingError,
    answer,
    check_counts,
    size,
    staleness,
)
from vramcal.sizing.lookup import Located, ddp_term, locate_profile, probe_command, suggested_capacity
from vramcal.sizing.staleness import StaleProfileError
from vramcal.units import parse_bytes, size_argument
from vramcal.words import is_info, word
from vramcal.workload import ModelRef, WorkloadError

__all__ = ["Answer", "Answered", "CalibrationError", "CalibrationPlan", "LimitSettings", "Located", "Profile",
           "ProfileError", "Sizing", "SizingError", "TrialSettings", "WorkloadError", "answer", "batch_size",
           "calibrate", "find_profile", "load_profile", "locate_profile", "model_ref", "plan_calibration",
           "probe_command", "run_calibration", "select_devices", "size", "size_for", "verify", "worker_pool"]

# What the worker fork server imports (the families, the trainer): trials and training runs share it.
WORKER_PRELOAD = ("vramcal.preload",)

# How the API's functions check the arguments they share, by name, at their door (vramcal.arguments; DESIGN.md,
# "Failure"): a wrong type is one TypeError naming the argument, before any work.
_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "settings": lambda n, v: of_type(n, v, LimitSettings, "a vramcal.LimitSettings (LimitSettings(reserve_bytes=0))"),
    "trials": lambda n, v: of_type(n, v, TrialSettings, "a vramcal.TrialSettings (TrialSettings(max_trials=8))"),
    "options": lambda n, v: mapping(n, v, "the data options as a dict ({'stride': 4})"),
    "profiles_dir": path_like, "out": lambda n, v: path_like(n, v, "a profile file's path", none=True),
    "path": lambda n, v: path_like(n, v, "a profile file's path", none=True),
    "save": flag, "progress": flag, "unique_device": flag, "aim": flag, "evaluation": flag,
    "on_trial": callback, "on_notice": callback, "on_step": callback,
    "device": lambda n, v: of_type(n, v, Device, "a vramcal.records.Device (select_devices(gpu)[0][0])"),
    "world": lambda n, v: of_type(n, v, World, "a vramcal.records.World, or None", none=True),
    "implementation": lambda n, v: of_type(n, v, str, "'auto', 'transformers' or 'mamba_ssm'"),
    "seq_lens": lambda n, v: of_type(n, v, (str, Sequence, SeqLens), "lengths: [128, 512], '128,512' or '128:2048'"),
    "plan": lambda n, v: of_type(n, v, CalibrationPlan, "a vramcal.CalibrationPlan (from plan_calibration)"),
    "profile": lambda n, v: of_type(n, v, Profile, "a vramcal.Profile (vramcal.load_profile(path))"),
    "rank_devices": lambda n, v: of_type(n, v, (list, tuple), "the ranks' Devices as a list"),
}


def _door(**given: Any) -> None:
    """The front door's checks of the ``given`` arguments, each by its name (:data:`_CHECKS`).

    Raises:
        TypeError: one of the wrong type, named (``trials= takes a vramcal.TrialSettings ..., not dict {}``).
    """
    for name, value in given.items():
        _CHECKS[name](name, value)


def select_devices(gpu: str = "auto", capacity_bytes: int | str | None = None) -> tuple[list[Device], str | None]:
    """Resolve a ``gpu`` choice (``auto``, ``none``, ``all``, a CUDA index or a UUID) to devices.

    Args:
        capacity_bytes: a budget below the device's memory: bytes, or a size as the command line takes it
            (``"1.5GiB"``, ``"512MiB"``: :func:`vramcal.units.parse_bytes`).

    Returns:
        The devices, and a one-line notice (e.g. why the host was chosen) or None.

    Raises:
        DeviceError: no such device here. NvmlError: a GPU asked for explicitly, NVML unusable.
        TypeError, ValueError: ``capacity_bytes`` is not a whole number of bytes or a size.
    """

    return select(gpu, capacity_argument(capacity_bytes))


def capacity_argument(capacity: int | str | None) -> int | None:
    """``capacity_bytes=`` as bytes: an int as it is, a size string parsed (``"1.5GiB"``), None as None.

    Raises:
        TypeError: neither (a float, a bool). ValueError: a string that is no size, or a size below one byte.
    """

    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, int | str):
        raise TypeError(f"capacity_bytes= takes a whole number of bytes or a size such as '1.5GiB', not "
                        f"{type(capacity).__name__} {capacity!r}")
    try:
        value = parse_bytes(capacity) if isinstance(capacity, str) else capacity
    except ValueError as error:
        raise ValueError(f"capacity_bytes={capacity!r}: {error}") from None
    if value < 1:
        raise ValueError(f"capacity_bytes={capacity!r} is no budget: give a positive size such as '1.5GiB'")
    return value


def worker_pool(extra_preload: tuple[str, ...] = ()):
    """The workers trials and training runs run in (:class:`vramcal.measure.worker.Workers`), forked from one
    server that has imported :mod:`vramcal.preload` (and ``extra_preload``): the same process make-up for both."""

    return Workers((*WORKER_PRELOAD, *extra_preload))


def plan_calibration(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *, device: Device,
                     implementation: str = "auto", settings: LimitSettings = LimitSettings(),
                     options: dict[str, Any] | None = None, profiles_dir: Path | str = DEFAULT_PROFILES_DIR,
                     out: Path | str | None = None, unique_device: bool = False,
                     seq_lens: str | Sequence[int] | SeqLens = (), trials: TrialSettings = TrialSettings(),
                     world: World | None = None, rank_devices: Sequence[Device] = (),
                     aim: bool = False, evaluation: bool = False) -> CalibrationPlan:
    """Check everything knowable before the first trial (:func:`model_ref`, the lengths, the budget) and
    place the file.

    Args:
        options: the family's data options (the regressor's ``data``, ``stride``, ``val_fraction``,
            ``data_on_device``); a family that takes none drops them
            (:meth:`vramcal.models.registry.Family.data_options`); a key no family takes is refused.
        seq_lens: calibrate several sequence lengths at once (one profile holding the model in
            batch_size × seq_len, :mod:`vramcal.calibration.surface`): a list, a text as ``--seq-len``
            takes it (``"128,512,2048"``, or a range ``"128:2048"``: its ends and their geometric middle) or its
            :class:`~vramcal.calibration.fit2d.SeqLens`; each a multiple of the model's chunk_size; the factory
            must take ``seq_len``. A single length is a one-length calibration at it.
        trials: how each trial runs and how many. world: calibrate a DDP world of ranks; the limits are per rank.
        rank_devices: the ranks' GPUs (``world.nproc`` of one model; ``device`` is rank 0's); () on the host.
        aim: trace the step on fake tensors (the trials' server started first, importing meanwhile) and aim the
            search's growth with its slope (:func:`vramcal.estimated.aim_for`, its bound learned from
            ``profiles_dir``); one process at one length only (else, or untraceable, ``plan.notices`` says why).
        evaluation: also calibrate the evaluation pass alone (no gradients, after real training steps at the
            conservative size): a verified evaluation batch size (:mod:`vramcal.calibration.evaluation`).

    Raises:
        ValueError, WorkloadError: see :func:`model_ref`; lengths that are not multiples of chunk_size or a
            factory without ``seq_len``; a budget with no usable memory; a world whose devices do not fit it;
            an ``options`` key no family takes (the known ones listed). TypeError: an argument of the wrong type.
    """
    _door(device=device, implementation=implementation, settings=settings, options=options, profiles_dir=profiles_dir,
          out=out, unique_device=unique_device, seq_lens=seq_lens, trials=trials, world=world, aim=aim,
          rank_devices=rank_devices, evaluation=evaluation)
    lengths = _read_lengths(seq_lens)
    ref = model_ref(model, {**arguments(params), **({"seq_len": lengths.lengths[0]} if lengths else {})},
                    device=device, implementation=implementation)
    designed = _check_lengths(ref, lengths, device, implementation) if lengths else ()
    ref = ref.replace(seq_len=designed[0]) if len(designed) == 1 else ref
    several = designed if len(designed) > 1 else ()
    settings.check(device.total_bytes)
    _check_world(world, device, tuple(rank_devices))
    family, key = family_of(ref), ref.without("seq_len") if several else ref
    path = Path(out) if out is not None else profile_path(profiles_dir, device, key, family.implementation(ref),
                                                          unique_device, world)
    data = family.data_options(_known_options(options))
    found, notices = _aim(ref, data, device, profiles_dir, one=not several and world is None) if aim else (None, ())
    return CalibrationPlan(device, ref, settings, data, path, several, trials, world, tuple(rank_devices), found,
                           notices, evaluation=evaluation)


def _known_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Raises: ValueError: a key no family takes, with the known ones."""
    unknown = sorted(set(options or {}) - set(DATA_OPTIONS))
    if unknown:
        raise ValueError(f"options= has no {', '.join(map(repr, unknown))}: it takes {', '.join(DATA_OPTIONS)} (the "
                         f"regressor's data; other families ignore them)")
    return dict(options or {})


def _aim(ref: ModelRef, data: dict[str, Any], device: Device, profiles_dir: Path | str, one: bool):
    """(the :class:`~vramcal.calibration.search.Aim` of a calibration, or None; notices): only for one process at
    one length (:func:`vramcal.estimated.aim_for`)."""
    if not one:
        return None, ("not aimed: the estimate is of one process at one length",)

    worker_pool().warm_up(device.kind)  # the trials' server imports torch and the model while the step is traced
    found, why = aim_for(ref, data, device.kind, profiles_dir)
    return found, (why,) if why else ()


def _check_world(world: World | None, device: Device, rank_devices: tuple[Device, ...]) -> None:
    """Raises: ValueError for a world whose backend does not run on the device, whose GPUs are not ``world.nproc``
    cards of one model, or whose host ranks' budgets add up to more than the host's memory (DeviceError)."""
    if world is None:
        if rank_devices:
            raise ValueError("rank_devices are for a DDP world: give world=World(nproc)")
        return
    if (world.backend == "nccl") != (device.kind == "cuda"):
        raise ValueError(f"the {world.backend} backend does not run on {device.name}: use gloo on the host and "
                         f"nccl on NVIDIA GPUs")
    if device.kind == "host":
        check_host_world([device.total_bytes] * world.nproc)  # every rank under the budget, at once
    if device.kind == "cuda":
        if len(rank_devices) != world.nproc:
            raise ValueError(f"a DDP world of {world.nproc} ranks needs {world.nproc} GPUs, {len(rank_devices)} are "
                             f"visible here: use fewer ranks, or CUDA_VISIBLE_DEVICES to show more")
        names = {d.name for d in rank_devices}
        if len(names) > 1:
            raise ValueError(f"the ranks' GPUs differ ({', '.join(sorted(names))}): calibrate each model of card on "
                             f"its own (a profile is per device)")


def _read_lengths(seq_lens: str | Sequence[int] | SeqLens) -> SeqLens | None:
    """``seq_lens`` read once (:func:`vramcal.calibration.fit2d.parse_seq_lens`); None when empty."""
    if isinstance(seq_lens, SeqLens):
        return seq_lens
    text = seq_lens if isinstance(seq_lens, str) else ",".join(map(str, seq_lens))
    return parse_seq_lens(text) if text.strip() else None


def _check_lengths(ref: ModelRef, lengths: SeqLens, device: Device, implementation: str) -> tuple[int, ...]:
    """The lengths asked for (:meth:`vramcal.calibration.fit2d.SeqLens.design`), each a multiple of the model's
    chunk_size and a model the family accepts at it."""
    family = family_of(ref)
    if not family.takes_seq_len(ref):
        raise ValueError(f"--seq-len: {ref.factory} takes no seq_len argument")
    designed = lengths.design(family.chunk_size(ref))
    params = {k: v for k, v in ref.params.items() if k != "implementation"}
    for length in designed:  # e.g. the regressor's spec checks at every length (``ref``'s own was, when it was made)
        if length != params.get("seq_len"):
            family.check({**params, "seq_len": length}, device, implementation)
    return designed


def run_calibration(plan: CalibrationPlan, *, save: bool = True, on_trial: Callable[[Trial], None] | None = None,
                    on_notice: Callable[[str], None] | None = None,
                    on_step: Callable[[dict[str, Any]], None] | None = None) -> Profile:
    """Run the calibration's trials (each in a fresh worker process, :func:`worker_pool`) and write the profile.

    A user's factory module is imported in each trial process after the meter has pinned the device
    (never preloaded into the fork server): a module that touches CUDA when imported, as
    ``DEVICE = "cuda" if torch.cuda.is_available() else "cpu"`` does, would otherwise start CUDA before
    the pin. Runs recorded out of memory in the profile at ``plan.path`` stay in the new one: evidence that caps
    the sizes later runs take (:func:`vramcal.sizing.run_failure_cap`).

    With ``save``, the profile's folder must take :data:`vramcal.files.WRITE_CHECK_BYTES` before the first trial,
    and each trial is kept in the trial journal beside the profile as it finishes (:mod:`vramcal.journal`): a
    crash, a kill or a full disk loses no trial, and the same calibration run again reuses them. The profile's save
    removes the journal.

    Args:
        save: write the profile to ``plan.path`` (atomically).
        on_trial: called with each finished trial, in order (a reused one too).
        on_notice: called with a line for people about the journal (trials reused, one replaced).
        on_step: called with each step of the steady trial as it ends (``step``, ``of``: the most steps,
            ``peak_bytes``, ``step_s``), the calibration's longest trial (:class:`vramcal.measure.trial.TrialRunner`).

    Returns:
        The profile; ``profile.verified`` says whether real trials verified both limits, ``profile.path`` is the
        file written (None without ``save``).

    Raises:
        CalibrationError: the first trial failed: one sample does not fit, or the training step itself
            failed (the factory raised or returned something else, or the step raised; the message
            gives the error's first line and says to fix the step, not the budget); the journal or the
            profile could not be written (the previous profile is untouched, the trials are in the journal).
        OSError: the profile's folder cannot take files (before any trial).
    """
    _door(plan=plan, save=save, on_trial=on_trial, on_notice=on_notice, on_step=on_step)
    journal = _open_journal(plan, on_notice) if save else None
    profile = _with_failed_runs(run_trials(plan, TrialRunner(worker_pool(), on_step), on_trial, journal), plan.path)
    if plan.world is not None:
        profile = dataclasses.replace(profile, single_process=ddp_term(profile, plan.path.parent.parent))
    if journal is not None:
        try:
            save_profile(profile, plan.path, plan.keep_previous)
        except OSError as error:
            raise CalibrationError(f"cannot write the profile {plan.path} ({error.strerror or error}): the previous "
                                   f"profile is untouched and the {len(profile.trials)} trials are kept in "
                                   f"{journal.path}; free space and run the same command again (it reuses them)") \
                from None
        journal.remove()
        profile = dataclasses.replace(profile, path=plan.path)
    return profile


def _with_failed_runs(profile: Profile, path: Path) -> Profile:
    """``profile`` with the observations of runs that ran out of memory under the profile file at ``path`` (at the
    same usable memory), when there is one and it reads."""
    try:
        before = load_profile(path) if path.exists() and profile.limits is not None else None
    except ProfileError:
        before = None
    kept = tuple(o for o in (before.observations if before else ()) if o.out_of_memory
                 and o.usable_bytes == profile.limits.usable_bytes)
    return dataclasses.replace(profile, observations=kept) if kept else profile


def _open_journal(plan: CalibrationPlan, on_notice: Callable[[str], None] | None) -> Journal:
    """The calibration's journal (:mod:`vramcal.journal`), once its folder took
    :data:`vramcal.files.WRITE_CHECK_BYTES`.

    Raises:
        OSError: the folder cannot take files.
    """
    folder = plan.path.parent
    made = tuple(p for p in (folder, *folder.parents) if not p.exists())
    check_writable(folder)
    journal = Journal.open(journal_path(plan.path), plan_key(plan), made)
    if journal.notice and on_notice:
        on_notice(journal.notice)
    return journal


def calibrate(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *, gpu: str = "auto",
              capacity_bytes: int | str | None = None, implementation: str = "auto",
              settings: LimitSettings = LimitSettings(), options: dict[str, Any] | None = None,
              profiles_dir: Path | str = DEFAULT_PROFILES_DIR, save: bool = True,
              on_trial: Callable[[Trial], None] | None = None, seq_lens: str | Sequence[int] = (),
              trials: TrialSettings = TrialSettings(), progress: bool = True, evaluation: bool = False) -> Profile:
    """Calibrate a training step on one device and (by default) save its profile under ``profiles_dir``.

    Args:
        model, params: see :func:`model_ref`.
        gpu: ``auto`` (the first visible GPU, else the host), ``none`` (the host), a CUDA index or a UUID.
        capacity_bytes: a budget below the device's memory: bytes, or a size string (``"1.5GiB"``); on the
            host, trials run under ``RLIMIT_DATA`` = the budget. ``gpu="auto"`` on a machine without a GPU
            calibrates the host (a line on stderr says so, with ``progress``).
        settings: reserve (bytes), margin and conservative fraction.
        seq_lens, trials, evaluation: see :func:`plan_calibration` (``evaluation=True``: the profile's
            ``evaluation`` holds the evaluation pass's verified limits, which the trainer and integrations validate at).
        on_trial: called with each finished trial; without it, and with ``progress``, each trial is printed to
            stderr as one line, and the steady trial's steps every 5 (:class:`vramcal.progress.TrialPrinter`).

    Returns:
        The profile: ``limits.safe_batch_size`` and ``limits.conservative_batch_size`` (samples), the fit
        ``peak_bytes = overhead_bytes + slope_bytes_per_sample × batch_size``, ``verified``, and ``path``: the
        file it wrote (None with ``save=False``), which the last line of its progress names too.

    Raises:
        DeviceError, NvmlError: no such device. ValueError, WorkloadError: bad model arguments.
        CalibrationError: not even one sample fits. OSError: the profile cannot be written.
    """
    _door(save=save, on_trial=on_trial, progress=progress)
    device, notice = _one_device(gpu, capacity_bytes)
    plan = plan_calibration(model, params, device=device, implementation=implementation, settings=settings,
                            options=options, profiles_dir=profiles_dir, seq_lens=seq_lens, trials=trials,
                            evaluation=evaluation)
    return _run_said(plan, notice, capacity_bytes is None, save=save, on_trial=on_trial, progress=progress)


def _one_device(gpu: str, capacity_bytes: int | str | None) -> tuple[Device, str | None]:
    """The one device ``gpu`` names (:func:`select_devices`) and its notice.

    Raises:
        ValueError: ``gpu`` names several (``all``): calibrate them one at a time.
    """
    devices, notice = select_devices(gpu, capacity_bytes)
    if len(devices) != 1:
        raise ValueError(f"gpu={gpu!r} names {len(devices)} devices: calibrate them one at a time")
    return devices[0], notice


def _run_said(plan: CalibrationPlan, notice: str | None, whole_host: bool, *, save: bool = True,
              on_trial: Callable[[Trial], None] | None = None, progress: bool = True,
              why: str | None = None) -> Profile:
    """:func:`run_calibration` with :func:`calibrate`'s progress on stderr: why it calibrates (``why``, before any
    trial), the device notice (``whole_host``: no budget was given, so the host's whole memory is calibrated), each
    trial, where the profile went."""
    printer = (TrialPrinter(plan.search().max_trials, plan.usable_bytes, bar=False, prefix="vramcal:")
               if progress and on_trial is None else None)
    if printer is not None and why:
        printer.note(why)
    if printer is not None and notice:  # the host chosen for gpu="auto": said, as the command says it
        printer.note(f"{notice}; give capacity_bytes= (such as "
                     f"{size_argument(suggested_capacity(plan.device.total_bytes))!r}) for a budget below all of it"
                     if plan.device.kind == "host" and whole_host else notice)
    try:
        profile = run_calibration(plan, save=save, on_trial=on_trial or printer,
                                  on_step=printer.step if printer is not None else None)
    finally:
        if printer is not None:
            printer.close()
    if printer is not None and save:
        printer.note(f"profile saved to {plan.path}")
    return profile


def find_profile(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *, gpu: str = "auto",
                 capacity_bytes: int | str | None = None, implementation: str = "auto",
                 profiles_dir: Path | str = DEFAULT_PROFILES_DIR, path: Path | str | None = None) -> Profile:
    """The profile for a model on the device ``gpu`` names (as :func:`calibrate` takes it): the newest matching
    one under ``profiles_dir`` calibrated at ``capacity_bytes`` (bytes or ``"1.5GiB"``; None: whatever budget the
    matching files share), or ``path``. Matching files that failed their checks are passed over with a
    :class:`UserWarning` each, and so is a stale profile (:mod:`vramcal.sizing.staleness`); the device's notice (the
    host chosen for ``gpu="auto"``) is a line on stderr.

    Raises:
        SizingError, WorkloadError, ValueError: see :func:`locate_profile` (SeveralBudgetsError: no
            ``capacity_bytes`` and the matching files were calibrated at several budgets, each listed).
            DeviceError, NvmlError: no such device.
    """
    _door(implementation=implementation, profiles_dir=profiles_dir, path=path)
    (device, *_), notice = select_devices(gpu, capacity_bytes)
    located = locate_profile(model, params, device=device, profile=path, implementation=implementation,
                             profiles_dir=profiles_dir,
                             total_bytes=device.total_bytes if capacity_bytes is not None else None)
    for line in ([notice] if notice else []) + list(located.notices):
        tell(line)
    return located.profile


def tell(notice: str) -> None:
    """A notice of the API to people: information (:class:`~vramcal.words.Info`) as a line on stderr, a warning
    through :func:`warnings.warn` (attributed to the caller of the public function)."""
    if is_info(notice):
        print(f"vramcal: {notice}", file=sys.stderr, flush=True)
    else:
        warnings.warn(f"vramcal: {notice}", stacklevel=3)


@dataclasses.dataclass(frozen=True)
class Answered:
    """What :func:`size_for` answered: the batch size (samples) and its :class:`~vramcal.sizing.Sizing`, the
    profile and its file, whether this call calibrated (``calibrated``), and why, for people (``reason``, and one
    line per matching profile file it could not read, ``left_out``)."""

    batch_size: int
    sizing: Sizing
    profile: Profile
    path: Path
    calibrated: bool
    reason: str
    left_out: tuple[str, ...] = ()


def size_for(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *, gpu: str = "auto",
             capacity_bytes: int | str | None = None, implementation: str = "auto",
             options: dict[str, Any] | None = None, profiles_dir: Path | str = DEFAULT_PROFILES_DIR,
             settings: LimitSettings = LimitSettings(), trials: TrialSettings = TrialSettings(),
             limit: Limit = "conservative", seq_len: int | None = None, progress: bool = True) -> Answered:
    """The batch size for a model on a device in one call: the matching profile under ``profiles_dir`` when one
    holds (the same model, implementation, device and budget, made under the software and settings running
    now: :mod:`vramcal.sizing.staleness`, strictly), else a calibration (:func:`calibrate`, saved there), saying why
    (none, or made under other software) before its first trial; a stale or unreadable file where the new profile
    goes is kept beside it (:func:`vramcal.profile.replaced_name`), and the reason says so. A second call with
    nothing changed runs no trial, a profile without limits included. The size is gated by what the device has
    free now (:func:`vramcal.measure.device.free_bytes`: memory other processes took since the calibration lowers
    the limits, said in a notice).

    Args:
        model, params, gpu, capacity_bytes, implementation, options, settings, trials, progress: as
            :func:`calibrate`. limit, seq_len: as :class:`~vramcal.sizing.SizeRequest`.

    Raises:
        NoLimitsError: the matching or new profile has no usable limits (a calibration at its budget gives the
            same; ``vramcal size`` exits 3). Otherwise as :func:`calibrate` and :func:`vramcal.sizing.size`.
    """
    _door(implementation=implementation, options=options, profiles_dir=profiles_dir, settings=settings, trials=trials,
          progress=progress)
    ask = SizeRequest(limit=limit, seq_len=seq_len)
    device, notice = _one_device(gpu, capacity_bytes)
    budget = device.total_bytes if device.kind == "host" else None
    ref = model_ref(model, params, device=device, implementation=implementation)
    found, skipped = newest_profile(profiles_dir, device, ref, None, budget)
    why = (f"calibrating: no profile of this model on this device{' at this budget' * (budget is not None)} under "
           f"{profiles_dir}/" + (f" ({len(skipped)} matching file(s) left out)" if skipped else ""))
    if found is not None:
        answered = _from_profile(found, ref, device, ask)
        if isinstance(answered, Answered):
            return dataclasses.replace(answered, left_out=tuple(skipped))
        why = f"calibrating again: {answered}"
    plan = plan_calibration(ref, device=device, settings=settings, options=options, profiles_dir=profiles_dir,
                            trials=trials)
    if plan.path.is_file():  # a stale or unreadable profile where the new one goes: kept, not overwritten
        plan = dataclasses.replace(plan, keep_previous=replaced_name(plan.path))
        why += f"; the file it replaces, {plan.path}, is kept as {plan.keep_previous.name}"
    profile = _run_said(plan, notice, capacity_bytes is None, progress=progress, why=why)
    try:
        sizing = size(profile, ask, **_gate(device))
    except NoLimitsError:
        raise _no_limits(plan.path, profile) from None
    return Answered(sizing.batch_size, sizing, profile, plan.path, True, why, tuple(skipped))


def _from_profile(found: Path, ref: ModelRef, device: Device, ask: SizeRequest) -> Answered | str:
    """:func:`size_for`'s answer from the matching profile ``found``, or why it is calibrated again (made under other
    software or settings, or sizing no more).

    Raises:
        NoLimitsError: it holds (not stale) but has no usable limits: a calibration at its budget gives the same.
    """
    try:
        located = locate_profile(ref, device=device, profile=found, strict=True)
        sizing = size(located.profile, ask, **_gate(device))
    except NoLimitsError:
        stale = staleness.check(load_profile(found), str(found), device, strict=False)
        if stale is None:
            raise _no_limits(found, load_profile(found)) from None
        return stale
    except (StaleProfileError, SizingError) as error:
        return str(error)
    return Answered(sizing.batch_size, sizing, located.profile, found, False, f"from the matching profile {found}")


def _no_limits(path: Path, profile: Profile) -> NoLimitsError:
    """Why ``profile`` (at ``path``) has no limits, and what changes that: calibrating again at its budget does not."""
    ok = sum(t.ok for t in profile.trials)
    why = (f"no line fitted to its {ok} successful trial(s)" if profile.fit is None else
           "its fitted peak does not rise with batch_size" if profile.limits is None else
           "not one sample fits its usable memory by the fit")
    return NoLimitsError(f"{path}: the profile has no usable limits ({why}), and calibrating again at its budget gives "
                         f"the same: give a larger {word('capacity')} or a smaller {word('reserve')} or "
                         f"{word('margin')}, and check that the step's memory grows with its batch")


def _gate(device: Device) -> dict[str, Any]:
    """:func:`vramcal.sizing.size`'s ``free_bytes`` and ``free_source``: what ``device`` has free now."""
    free, source = free_bytes(device)
    return {"free_bytes": free, "free_source": source}


def batch_size(profile: Profile | Path | str, limit: Limit = "conservative", *, request: int | None = None,
               batch_size_min: int = 1, pool_data_bytes: int | None = None, seq_len: int | None = None) -> int:
    """The batch size to train with (samples): the profile's conservative (or safe) size, or ``request``
    clamped to ``[batch_size_min, safe]`` (:func:`vramcal.sizing.size`, which also gives the predicted peak).

    Args:
        profile: a :class:`Profile`, or the path of a profile file (read with :func:`load_profile`).
        pool_data_bytes: the run's data bytes in the measured memory (None: as much as the calibration held).
        seq_len: the run's sequence length; required for a profile calibrated over several lengths.

    Raises:
        SizingError: the profile has no limits, the bounds are empty, or ``seq_len`` is missing for, or
            outside, what the profile calibrated; an argument out of range. TypeError: an argument of the
            wrong type (:class:`vramcal.sizing.SizeRequest`). ProfileError: a path that holds no profile.
    """
    if isinstance(profile, str | Path):
        profile = load_profile(profile)
    ask = SizeRequest(limit=limit, batch_size_min=batch_size_min, request=request, seq_len=seq_len)
    return size(profile, ask, pool_data_bytes=pool_data_bytes).batch_size


def verify(profile: Profile, batch_size: int, seq_len: int | None = None, *,
           trials: TrialSettings = TrialSettings()) -> Trial:
    """One real trial of the profile's model at (``batch_size``, ``seq_len``) on the profile's device here
    (the host at the profile's budget), as a calibration's verification runs it and reads it: its
    ``peak_bytes`` includes the profile's step creep at that size (:mod:`vramcal.calibration.creep`), and the
    measured figures stay in its sources (``rss_peak_bytes``, ``data_peak_bytes``, ``nvml_peak_bytes``, ...).

    Args:
        trials: the trial's steps and time limit.

    Raises:
        SizingError: the profile's device is not here; ``batch_size`` or ``seq_len`` below 1. TypeError: an
            argument of the wrong type.
    """
    _door(profile=profile, trials=trials)
    check_counts(answer_batch_size=batch_size, seq_len=seq_len)
    budget = profile.device.total_bytes if profile.device.kind == "host" else None
    device = select_devices(profile.device.gpu, budget)[0][0]
    if device.hardware_difference(profile.device):
        raise SizingError(f"the profile was made on {profile.device.name}, this is {device.name}: verify it there")
    device = dataclasses.replace(device, total_bytes=profile.device.total_bytes)
    model = profile.model.replace(seq_len=seq_len) if seq_len is not None else profile.model
    request = TrialRequest(model, batch_size, device, json.dumps(profile.data.get("options", {}), sort_keys=True),
                           trials)
    (trial,) = TrialRunner(worker_pool()).run(request, purpose="verify-answer")
    trial = dataclasses.replace(trial, seq_len=seq_len)
    return dataclasses.replace(trial, peak_bytes=read_peak(trial, profile.creep))
