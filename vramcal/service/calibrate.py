"""A calibration planned (:func:`plan_calibration`: everything checkable before the first trial) and run
(:func:`run_calibration`: the trials of :mod:`vramcal.service.calibrator`, their journal, the profile written)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vramcal.calibration.fit2d import SeqLens, parse_seq_lens
from vramcal.calibration.limits import LimitSettings
from vramcal.estimate.learned import aim_for
from vramcal.files import check_writable
from vramcal.measure.device import check_host_world
from vramcal.measure.trial import TrialRunner
from vramcal.models.registry import DATA_OPTIONS, arguments, family_of, model_ref
from vramcal.profile import DEFAULT_PROFILES_DIR, Profile, ProfileError, load_profile, profile_path, save_profile
from vramcal.records import Device, Trial, TrialSettings, World
from vramcal.report.catalogue import CATALOGUE
from vramcal.report.progress import TrialPrinter
from vramcal.service.calibrator import CalibrationError, CalibrationPlan, run_trials
from vramcal.service.door import door
from vramcal.service.journal import Journal, journal_path, plan_key
from vramcal.service.pool import worker_pool
from vramcal.sizing.lookup import ddp_term, suggested_capacity
from vramcal.units import size_argument
from vramcal.workload import ModelRef


def plan_calibration(model: str | ModelRef = "regressor", params: dict[str, Any] | None = None, *, device: Device,
                     implementation: str = "auto", settings: LimitSettings = LimitSettings(),
                     options: dict[str, Any] | None = None, profiles_dir: Path | str = DEFAULT_PROFILES_DIR,
                     out: Path | str | None = None, unique_device: bool = False,
                     seq_lens: str | Sequence[int] | SeqLens = (), trials: TrialSettings = TrialSettings(),
                     world: World | None = None, rank_devices: Sequence[Device] = (),
                     aim: bool = False, evaluation: bool = False) -> CalibrationPlan:
    """Check everything knowable before the first trial (:func:`vramcal.models.registry.model_ref`, the lengths,
    the budget) and place the file.

    Args:
        options: the family's data options (the regressor's ``data``, ``stride``, ``val_fraction``,
            ``data_on_device``); a family that takes none drops them
            (:meth:`vramcal.models.registry.Family.data_options`).
        seq_lens: several lengths calibrated at once (one profile in batch_size × seq_len,
            :mod:`vramcal.calibration.surface`): a list, a text as ``--seq-len`` takes it (``"128,512,2048"`` or
            ``"128:2048"``) or a :class:`~vramcal.calibration.fit2d.SeqLens`; multiples of chunk_size; the factory
            must take ``seq_len``. A single length is a one-length calibration at it.
        trials: how each trial runs and how many. world: a DDP world of ranks; the limits are per rank.
        rank_devices: the ranks' GPUs (``world.nproc`` of one model; ``device`` is rank 0's); () on the host.
        aim: aim the search's growth with the traced step's slope (:func:`~vramcal.estimate.learned.aim_for`); one
            process at one length only (else ``plan.notices`` says why).
        evaluation: also calibrate the evaluation pass alone (:mod:`vramcal.calibration.evaluation`).

    Raises:
        ValueError, WorkloadError: bad model arguments; lengths that are not multiples of chunk_size or a
            factory without ``seq_len``; a budget with no usable memory; a world whose devices do not fit it;
            an ``options`` key no family takes. TypeError: an argument of the wrong type.
    """
    door(device=device, implementation=implementation, settings=settings, options=options, profiles_dir=profiles_dir,
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
    unknown = sorted(set(options or {}) - set(DATA_OPTIONS))
    if unknown:
        raise ValueError(f"options= has no {', '.join(map(repr, unknown))}: it takes {', '.join(DATA_OPTIONS)} (the "
                         f"regressor's data; other families ignore them)")
    return dict(options or {})


def _aim(ref: ModelRef, data: dict[str, Any], device: Device, profiles_dir: Path | str, one: bool):
    """(the search's Aim or None, notices): only for one process at one length."""
    if not one:
        return None, ("not aimed: the estimate is of one process at one length",)
    worker_pool().warm_up(device.kind)  # the trials' server imports torch and the model while the step is traced
    listed = next((card for card in CATALOGUE if card.nvml_name == device.name), None)  # its SM count
    found, why = aim_for(ref, data, device, profiles_dir, listed=listed)
    return found, (why,) if why else ()


def _check_world(world: World | None, device: Device, rank_devices: tuple[Device, ...]) -> None:
    if world is None:
        if rank_devices:
            raise ValueError("rank_devices are for a DDP world: give world=World(nproc)")
        return
    if world.backend != device.kind.backend:
        raise ValueError(f"the {world.backend} backend does not run on {device.name}: use gloo on the host and "
                         f"nccl on NVIDIA GPUs")
    if device.kind.shared:
        check_host_world([device.total_bytes] * world.nproc)  # every rank under the budget, at once
    else:
        if len(rank_devices) != world.nproc:
            raise ValueError(f"a DDP world of {world.nproc} ranks needs {world.nproc} GPUs, {len(rank_devices)} are "
                             f"visible here: use fewer ranks, or CUDA_VISIBLE_DEVICES to show more")
        names = {d.name for d in rank_devices}
        if len(names) > 1:
            raise ValueError(f"the ranks' GPUs differ ({', '.join(sorted(names))}): calibrate each model of card on "
                             f"its own (a profile is per device)")


def _read_lengths(seq_lens: str | Sequence[int] | SeqLens) -> SeqLens | None:
    if isinstance(seq_lens, SeqLens):
        return seq_lens
    text = seq_lens if isinstance(seq_lens, str) else ",".join(map(str, seq_lens))
    return parse_seq_lens(text) if text.strip() else None


def _check_lengths(ref: ModelRef, lengths: SeqLens, device: Device, implementation: str) -> tuple[int, ...]:
    """The lengths asked for, each a multiple of the model's chunk_size and a model the family accepts at it."""
    family = family_of(ref)
    if not family.takes_seq_len(ref):
        raise ValueError(f"--seq-len: {ref.factory} takes no seq_len argument")
    designed = lengths.design(family.chunk_size(ref))
    params = {k: v for k, v in ref.params.items() if k != "implementation"}
    for length in designed:  # ``ref``'s own length was checked when it was made
        if length != params.get("seq_len"):
            family.check({**params, "seq_len": length}, device, implementation)
    return designed


def run_calibration(plan: CalibrationPlan, *, save: bool = True, on_trial: Callable[[Trial], None] | None = None,
                    on_notice: Callable[[str], None] | None = None,
                    on_step: Callable[[dict[str, Any]], None] | None = None) -> Profile:
    """Run the calibration's trials, each in a fresh worker process (:func:`vramcal.service.pool.worker_pool`;
    a user's factory module is imported there after the meter pinned the device), and write the profile.

    Runs recorded out of memory in the profile at ``plan.path`` stay in the new one
    (:func:`vramcal.sizing.run_failure_cap`). With ``save``, the folder must take
    :data:`vramcal.files.WRITE_CHECK_BYTES` before the first trial, and each trial is kept in the journal beside
    the profile (:mod:`vramcal.service.journal`) until the profile is saved: a crash, kill or full disk loses none.

    Args:
        save: write the profile to ``plan.path`` (atomically).
        on_trial: called with each finished trial, in order (a reused one too).
        on_notice: called with a line for people about the journal (trials reused, one replaced).
        on_step: called with each step of the steady trial (``step``, ``of``, ``peak_bytes``, ``step_s``).

    Returns:
        The profile; ``profile.path`` is the file written (None without ``save``).

    Raises:
        CalibrationError: the first trial failed (one sample does not fit, or the step itself failed); the
            journal or the profile could not be written (the previous profile untouched, the trials journalled).
        OSError: the profile's folder cannot take files (before any trial).
    """
    door(plan=plan, save=save, on_trial=on_trial, on_notice=on_notice, on_step=on_step)
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
    """``profile`` with the out-of-memory runs recorded in the file at ``path`` at the same usable memory."""
    try:
        before = load_profile(path) if path.exists() and profile.limits is not None else None
    except ProfileError:
        before = None
    kept = tuple(o for o in (before.observations if before else ()) if o.out_of_memory
                 and o.usable_bytes == profile.limits.usable_bytes)
    return dataclasses.replace(profile, observations=kept) if kept else profile


def _open_journal(plan: CalibrationPlan, on_notice: Callable[[str], None] | None) -> Journal:
    """Raises: OSError: the folder cannot take files."""
    folder = plan.path.parent
    made = tuple(p for p in (folder, *folder.parents) if not p.exists())
    check_writable(folder)
    journal = Journal.open(journal_path(plan.path), plan_key(plan), made)
    if journal.notice and on_notice:
        on_notice(journal.notice)
    return journal


def run_said(plan: CalibrationPlan, notice: str | None, whole_host: bool, *, save: bool = True,
             on_trial: Callable[[Trial], None] | None = None, progress: bool = True,
             why: str | None = None) -> Profile:
    """:func:`run_calibration` with :func:`vramcal.api.calibrate`'s progress on stderr: ``why`` it calibrates, the
    device notice (``whole_host``: no budget given), each trial, where the profile went."""
    printer = (TrialPrinter(plan.search().max_trials, plan.usable_bytes, bar=False, prefix="vramcal:")
               if progress and on_trial is None else None)
    if printer is not None and why:
        printer.note(why)
    if printer is not None and notice:  # the host chosen for gpu="auto": said, as the command says it
        printer.note(f"{notice}; give capacity_bytes= (such as "
                     f"{size_argument(suggested_capacity(plan.device.total_bytes))!r}) for a budget below all of it"
                     if plan.device.kind.budgeted and whole_host else notice)
    try:
        profile = run_calibration(plan, save=save, on_trial=on_trial or printer,
                                  on_step=printer.step if printer is not None else None)
    finally:
        if printer is not None:
            printer.close()
    if printer is not None and save:
        printer.note(f"profile saved to {plan.path}")
    return profile
