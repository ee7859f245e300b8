"""``vramcal tune``: an optuna study over the trainer's knobs whose batch sizes come from the profile.

The seed documents run a hyperparameter optimiser over learning rate and batch size and clamp each
proposed batch size to the hardware's bounds before allocating; they list as future work that the
search space itself should use the trainer's bounds. Here it does: the batch-size range is
``[--batch-size-min, the profile's conservative batch size]`` (narrowed further by ``--batch-size-max``
and by the number of training windows), so no trial is spent on a batch that cannot fit. The trainer
still clamps whatever it is given (:func:`vramcal.sizing.size`), a second guard;
each trial records whether it did.

Search: TPE (``optuna.samplers.TPESampler``, Bergstra et al. 2011) after ``n_initial`` random start-up
trials, over the learning rate (log), the batch size (log, integer), the weight decay and the gradient
clip norm (log). Each trial is a real ``vramcal train`` run (:func:`vramcal.train.plan.plan_run` and
:func:`vramcal.train.runner.train`, the same code as the command) of ``epochs`` epochs or ``max_steps``
steps in ``<run_dir>/trials/<number>`` (zero-padded: ``trials/0000``); its value is its lowest validation loss (what
``checkpoint-best.pt`` holds). After every epoch the validation loss goes to ``trial.report`` and a
median pruner (``optuna.pruners.MedianPruner``) stops trials worse than the median of earlier ones at
the same epoch. A non-finite loss or a diverged run (the learning rate was too high) ends a trial as
pruned, so TPE still learns from it.

Each trial is a ``vramcal train`` run in a worker process of its own (:func:`vramcal.train.runner.train`),
made like the probe's trials that sized it; after each epoch the worker asks this process, which calls
``trial.report`` and answers "stop" when the pruner says so. Whatever goes wrong inside a trial — an
out-of-memory error the trainer could not recover from, a crash, a ``kill -9`` of the worker — fails
that trial only: the study goes on and writes its results. What the trials are sized against (data,
device, profile) is decided once for the study (:func:`vramcal.train.plan.resolve`). A killed study
loses only its running trial: the study lives in a storage and ``--resume`` continues it.

Storage (:mod:`vramcal.tune.storage`): SQLite at ``<run_dir>/study.db`` by default, any database URL optuna's
``RDBStorage`` opens (``postgresql://``, ``mysql://``, ``sqlite:///``), or an optuna journal file
(``journal:///path/study.log``, or a path ending in ``.log``). Several processes or machines given the same
``--storage`` and ``--study-name`` work on one study at once (optuna's distributed mode). The first one
saves the search settings in the study; the others use those, with batch bounds from their own profile.
They stop at exactly ``--trials`` finished trials between them, and fail the trials of workers that died
(:mod:`vramcal.tune.workers`, :func:`run_study`).

The trials table, the best configuration and the PNG are made by :mod:`vramcal.tune.report`. Each trial's run
writes its epochs to TensorBoard in its folder, and its hyperparameters and objective beside them once it ends
(:mod:`vramcal.train.tracking`): ``tensorboard --logdir <run_dir>`` compares the trials. Each trial's line ends
with the study's progress and the time left.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vramcal.measure.device import free_bytes
from vramcal.sizing import SizeRequest, size, throughput_choice
from vramcal.train.config import TrainConfig
from vramcal.train.errors import DivergedError, NonFiniteError, TrainError
from vramcal.train.plan import Setting
from vramcal.train.tracking import log_trial
from vramcal.tune.workers import SURPLUS, announce, fail_dead_trials, failure_reason, finished, is_surplus, worker_id
from vramcal.words import Info

Echo = Callable[[str], None]
BEST_CONFIG = "best-config.json"
TRIALS_TABLE = "trials.md"
PLOT = "tune.png"
DEFAULT_STUDY_NAME = "vramcal-tune"
POLL_S = 3.0  # how often a worker waiting for other workers' last trials looks at the study
SETTINGS_WAIT_S = 10.0  # how long a joining worker waits for a new study's creator to save its settings


class TuneError(ValueError):
    """A search that cannot start or go on; the one-line message says what to change."""


@dataclass(frozen=True)
class TuneSettings:
    """What a study searches, saved in the study so a resumed or second worker searches the same.

    Attributes:
        base: the training settings every trial starts from (``lr``, ``batch_size``, ``weight_decay``
            and ``max_grad_norm`` are replaced by the trial's).
        lr_range, weight_decay_range, max_grad_norm_range: (low, high) of each knob; LR and clip norm
            are searched on a log scale, weight decay on a linear one (it may be 0).
        batch_size_max: the user's upper batch bound (None: the profile's conservative batch size);
            the lower bound is ``base.batch_size_min``.
        n_initial: random start-up trials before TPE models the results.
        seq_lens: look-back windows to search too (categorical); each trial's batch range is that length's
            (issue 13: no trial is spent on a (batch, length) pair that cannot fit). () = the base's seq_len.
    """

    base: TrainConfig = field(default_factory=TrainConfig)
    lr_range: tuple[float, float] = (1e-5, 1e-3)
    weight_decay_range: tuple[float, float] = (0.0, 0.1)
    max_grad_norm_range: tuple[float, float] = (0.25, 4.0)
    batch_size_max: int | None = None
    n_initial: int = 5
    seq_lens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_range("--lr-range", *self.lr_range, positive=True)
        check_range("--weight-decay-range", *self.weight_decay_range)
        check_range("--max-grad-norm-range", *self.max_grad_norm_range, positive=True)
        if self.batch_size_max is not None:
            check_range("--batch-size-min/--batch-size-max", self.base.batch_size_min, self.batch_size_max,
                        positive=True)
        if self.n_initial < 0:
            raise TuneError(f"--n-initial must be >= 0, got {self.n_initial}")
        for length in self.seq_lens:
            try:
                dataclasses.replace(self.base.spec, seq_len=length)
            except ValueError as error:
                raise TuneError(f"--seq-lens: {error}") from None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "base": self.base.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TuneSettings:
        ranges = {k: tuple(data[k]) for k in ("lr_range", "weight_decay_range", "max_grad_norm_range")}
        return cls(base=TrainConfig.from_dict(data["base"]), batch_size_max=data["batch_size_max"],
                   n_initial=data["n_initial"], seq_lens=tuple(data.get("seq_lens", ())), **ranges)


def check_range(name: str, low: float, high: float, positive: bool = False) -> None:
    """Raises: TuneError when a bound is not finite, ``low > high``, a bound is negative, or (``positive``)
    not above 0."""
    if not (math.isfinite(low) and math.isfinite(high)):
        raise TuneError(f"{name}: bounds must be finite numbers, got {low:g} {high:g}")
    if low > high:
        raise TuneError(f"{name}: the low end {low:g} is above the high end {high:g}")
    if low < 0 or (positive and low <= 0):
        raise TuneError(f"{name}: bounds must be {'> 0' if positive else '>= 0'}, got {low:g}")


@dataclass(frozen=True)
class BatchBounds:
    """The batch sizes trials may use, and where the ends come from.

    Attributes:
        low, high: inclusive bounds of the ``batch_size`` search (``high`` <= the profile's conservative).
        profile_path: the profile that gave the upper end.
        conservative, safe: the profile's limits (the trainer clamps to ``safe``).
        notices: for the user (a user range narrowed to the profile or to the data; information marked
            :class:`~vramcal.words.Info`).
    """

    low: int
    high: int
    profile_path: str
    conservative: int
    safe: int
    notices: tuple[str, ...] = ()

    def describe(self) -> str:
        return (f"batch_size in [{self.low}, {self.high}] (profile {self.profile_path}: conservative "
                f"{self.conservative}, safe {self.safe})")


def batch_bounds(settings: TuneSettings, setting: Setting) -> BatchBounds:
    """The batch-size search range from the setting's profile, sized as ``vramcal train`` sizes a run.

    Upper end: the conservative batch size (:func:`vramcal.sizing.size`, with the data term and the gate: what
    the device has free now, :func:`vramcal.measure.device.free_bytes`, each trial gated again), sizing for
    throughput the throughput knee when below it (:func:`vramcal.sizing.throughput_choice`), or
    ``batch_size_max`` when lower (a higher one is narrowed with a notice); never more than the training
    windows (a larger batch is one whole epoch).

    Raises:
        TuneError: the whole user range lies above the conservative batch size or the training windows.
        SizingError: the profile has no usable limits.
    """
    seq_len = setting.config.spec.seq_len
    free, source = free_bytes(setting.device)
    sizing = size(setting.profile, SizeRequest(seq_len=seq_len), pool_data_bytes=setting.pool_data_bytes,
                  free_bytes=free, free_source=source)
    conservative, low, n_train = sizing.conservative_batch_size, settings.base.batch_size_min, setting.train_windows
    notices = list(setting.notices) + list(sizing.notices)
    if low > conservative:
        raise TuneError(f"--batch-size-min {low} is above the profile's conservative batch size {conservative} "
                        f"({setting.profile_path}): every batch in the range would be clamped; lower --batch-size-min")
    high, what = conservative, "conservative batch size"
    if settings.base.size_for == "throughput":  # no batch above the knee trains faster per sample
        high, source, why = throughput_choice(setting.profile, seq_len, conservative, "conservative", low,
                                              sizing.safe_batch_size)
        what = "throughput knee" if source == "knee" else what
        notices.append(Info(why))
    if settings.batch_size_max is not None and settings.batch_size_max <= high:
        high = settings.batch_size_max
    elif settings.batch_size_max is not None:
        notices.append(f"--batch-size-max {settings.batch_size_max} is above the profile's {what}: searching up "
                       f"to {high}")
    if high > n_train:
        if low > n_train:
            raise TuneError(f"--batch-size-min {low} is more than the {n_train} training windows: lower it, "
                            f"or use more data or a smaller --stride")
        notices.append(Info(f"the data has {n_train} training windows: searching batch sizes up to {n_train}"))
        high = n_train
    return BatchBounds(low, high, setting.profile_path, conservative, sizing.safe_batch_size, tuple(notices))


@dataclass(frozen=True)
class SearchSpace:
    """What trials may choose: for each look-back window, what it is sized against and its batch bounds.

    Attributes:
        lengths: ``(seq_len, setting, bounds)`` per length (one entry: the base's length, not searched).
    """

    lengths: tuple[tuple[int, Setting, BatchBounds], ...]

    @property
    def searched(self) -> bool:
        return len(self.lengths) > 1

    def at(self, seq_len: int) -> tuple[Setting, BatchBounds]:
        return next((setting, bounds) for length, setting, bounds in self.lengths if length == seq_len)

    def describe(self) -> str:
        if not self.searched:
            return self.lengths[0][2].describe()
        return "; ".join(f"seq_len {length}: batch_size in [{b.low}, {b.high}]" for length, _, b in self.lengths) + \
            f" (profiles: {', '.join(sorted({b.profile_path for _, _, b in self.lengths}))})"

    @property
    def notices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for _, _, bounds in self.lengths for n in bounds.notices))


def search_space(settings: TuneSettings, capacity_bytes: int | None = None) -> SearchSpace:
    """Resolve each searched length (data, device, its profile: one over several lengths, or one per length)
    and its batch bounds, as ``vramcal train`` sizes a run at that length.

    Raises:
        TuneError, SizingError, DataError, DeviceError: as :func:`batch_bounds` and
            :func:`vramcal.train.plan.resolve`, for the first length that cannot be searched.
    """
    from vramcal.train.plan import resolve  # loads numpy: only when called

    lengths = settings.seq_lens or (settings.base.spec.seq_len,)
    entries = []
    for length in sorted(lengths):
        setting = resolve(settings.base.replace(seq_len=length), capacity_bytes)
        entries.append((length, setting, batch_bounds(settings, setting)))
    return SearchSpace(tuple(entries))


# ------------------------------------------------------------------------------------------- study

def open_study(storage, study_name: str, settings: TuneSettings | None, where: str = "the storage"):
    """Load study ``study_name`` from ``storage``, or create it with ``settings`` when absent.

    Of workers that start at once, the one whose ``create_study`` succeeds saves its settings; the others
    load the study and wait up to :data:`SETTINGS_WAIT_S` for them. The sampler's seed is the saved settings'
    ``seed`` plus the number of trials so far (a resumed study does not repeat its first random trials), plus
    a number from :func:`~vramcal.tune.workers.worker_id` for a study that existed (two workers joining at once
    do not draw the same trials). TPE runs with ``constant_liar`` (optuna 5's default, set for optuna 4 too):
    running trials are penalised, so concurrent workers do not propose the same point.

    Args:
        settings: None = the study must exist (``--resume``).
        where: the storage as printed (:attr:`vramcal.tune.storage.StorageURL.shown`).

    Returns:
        (study, the settings it searches: the saved ones for an existing study, and whether it existed).

    Raises:
        TuneError: ``--resume`` of a study that is not there; a study not made by ``vramcal tune``.
    """
    import optuna

    # vramcal prints one line per trial itself; optuna's own warning for a failed trial carries its traceback
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    names = {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    existed = study_name in names
    if not existed and settings is None:
        raise TuneError(f"there is no study {study_name!r} to resume in {where}: start one without "
                        f"--resume (known: {', '.join(sorted(names)) or 'none'})")
    if not existed:
        try:
            study = optuna.create_study(storage=storage, study_name=study_name, direction="minimize")
            study.set_user_attr("settings", settings.to_dict())
        except optuna.exceptions.DuplicatedStudyError:
            existed = True  # another worker made it between the two calls
    if existed:
        study = optuna.load_study(study_name=study_name, storage=storage)
        settings = TuneSettings.from_dict(_saved_settings(study))
    seed = settings.base.seed + len(study.trials) + (zlib.crc32(worker_id().encode()) if existed else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.sampler = optuna.samplers.TPESampler(n_startup_trials=settings.n_initial, seed=seed % 2**32,
                                                   multivariate=True, constant_liar=True)
    study.pruner = optuna.pruners.MedianPruner(n_startup_trials=max(1, settings.n_initial), n_warmup_steps=0)
    return study, settings, existed


def _saved_settings(study) -> dict[str, Any]:
    """The settings a study's creator saved, waiting for them while a new study has no trials yet.

    Raises:
        TuneError: the study has trials (or had none for :data:`SETTINGS_WAIT_S`) and no saved settings.
    """
    deadline = time.monotonic() + SETTINGS_WAIT_S
    while (saved := study.user_attrs.get("settings")) is None:
        if study.trials or time.monotonic() > deadline:
            raise TuneError(f"study {study.study_name!r} was not made by vramcal tune (no saved settings): "
                            f"choose another --study-name")
        time.sleep(0.2)
    return saved


def setting_differences(asked: TuneSettings, saved: TuneSettings) -> dict[str, tuple[Any, Any]]:
    """The settings a resumed or joining worker was given that differ from the study's saved ones.

    Returns:
        ``{name: (asked value, saved value)}``, by option name: the training settings' and the model spec's
        field names (``epochs``, ``d_model``) and the search's own (``lr_range``, ``n_initial``).
    """
    def flat(settings: TuneSettings) -> dict[str, Any]:
        data = settings.to_dict()
        base = data.pop("base")
        return {**base.pop("spec"), **base, **data}

    ours, theirs = flat(asked), flat(saved)
    return {name: (value, theirs.get(name)) for name, value in ours.items() if value != theirs.get(name)}


def run_study(study, settings: TuneSettings, space: SearchSpace, run_dir: Path, n_trials: int,
              echo: Echo = print, secrets: tuple[str, ...] = (), poll_s: float = POLL_S) -> int:
    """Run trials until the study has exactly ``n_trials`` complete or pruned ones (across all its workers).

    Before each trial, trials of dead workers are failed (:func:`~vramcal.tune.workers.fail_dead_trials`).
    When the finished trials and those running in other workers already make ``n_trials``, this worker
    starts none: it waits, polling every ``poll_s`` seconds, until they end, and runs one in the place of any
    that fails (or whose worker dies); so every worker ends when the study has ``n_trials`` finished and none
    running, and its table is the whole study's. Two workers that start a trial at once past the count
    leave one of them *surplus*: it ends failed before it suggests anything (:meth:`Objective.__call__`) and
    is left out of the tables. A trial that fails (any error) is recorded as failed with its one-line
    reason, and another takes its place, until this call has seen more than ``n_trials`` failures (a study
    of N trials tolerates N failed ones; more means something fails every trial, and the reasons say what).

    Args:
        secrets: strings (a storage password) hidden from the trials' recorded reasons.

    Returns:
        The number of trials this call ran.
    """
    import optuna
    from optuna.trial import TrialState

    objective = Objective(settings, space, Path(run_dir), echo, n_trials, secrets)
    waited_for: list[int] = []
    while True:
        for number, reason in fail_dead_trials(study):
            echo(f"trial {number}: fail ({reason})")
        trials = study.get_trials(deepcopy=False)
        done, running = finished(trials), [t.number for t in trials if t.state == TrialState.RUNNING]
        if done >= n_trials:
            return objective.calls
        if objective.failures > n_trials:
            echo(f"stopping: {objective.failures} trials failed (see the reasons above), {done} of "
                 f"{n_trials} finished")
            return objective.calls
        if done + len(running) >= n_trials:
            if running != waited_for:
                echo(f"waiting: {done} of {n_trials} trials finished and trial {', '.join(map(str, running))} "
                     f"running in another worker; this one runs another if one of them fails")
                waited_for = running
            time.sleep(poll_s)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.optimize(objective, n_trials=1, gc_after_trial=True, catch=(Exception,),
                           callbacks=[announce(echo, n_trials), lambda _, trial: log_trial(trial, echo)])


class Surplus(Exception):
    """A trial that started past the requested count (:func:`~vramcal.tune.workers.is_surplus`)."""


class Objective:
    """One trial: suggest, plan and train with the trainer's own functions, report each epoch.

    Args:
        n_trials: the study's requested count (a trial started past it ends at once, :class:`Surplus`).
        secrets: strings hidden from the recorded reasons (a storage password).
    """

    def __init__(self, settings: TuneSettings, space: SearchSpace, run_dir: Path, echo: Echo, n_trials: int,
                 secrets: tuple[str, ...] = ()) -> None:
        self.settings, self.space, self.run_dir, self.echo = settings, space, run_dir, echo
        self.n_trials, self.secrets = n_trials, secrets
        self.calls = self.failures = 0  # trials this objective ran, and how many of them failed

    def config(self, trial) -> tuple[TrainConfig, Setting]:
        """The trial's training settings (the base ones with the suggested knobs) and what they are sized
        against. When look-back windows are searched, the length is chosen first and the batch size as a
        share of that length's range on a log scale (``batch_share``: one distribution for all lengths, so
        TPE can model it), recorded as the ``batch_size`` user attribute."""
        s = self.settings
        if self.space.searched:
            length = trial.suggest_categorical("seq_len", [entry[0] for entry in self.space.lengths])
            setting, bounds = self.space.at(length)
            share = trial.suggest_float("batch_share", 0.0, 1.0)
            batch = round(math.exp(math.log(bounds.low) + share * (math.log(bounds.high) - math.log(bounds.low))))
            trial.set_user_attr("batch_size", batch)
        else:
            length, setting, bounds = self.space.lengths[0]
            batch = trial.suggest_int("batch_size", bounds.low, bounds.high, log=True)
        config = s.base.replace(
            seq_len=length, lr=trial.suggest_float("lr", *s.lr_range, log=True), batch_size=batch,
            weight_decay=trial.suggest_float("weight_decay", *s.weight_decay_range),
            max_grad_norm=trial.suggest_float("max_grad_norm", *s.max_grad_norm_range, log=True))
        return config, setting

    def __call__(self, trial) -> float:
        """Train the trial; any error (a failed run, a crash, a folder that cannot be written) fails this
        trial only, with its one-line reason in the ``error`` user attribute (optuna records it as FAIL).

        Raises:
            Surplus: the trial started past the count; it ends failed, marked ``surplus``, having suggested
                and run nothing (optuna records it as FAIL).
        """
        import optuna

        trial.set_user_attr("worker", worker_id())
        if is_surplus(trial.study.get_trials(deepcopy=False), trial.number, self.n_trials):
            reason = f"not run: the study had {self.n_trials} trials finished or running when it started"
            trial.set_user_attr(SURPLUS, True)
            trial.set_user_attr("error", reason)
            raise Surplus(reason)
        self.calls += 1
        try:
            return self._train(trial)
        except optuna.TrialPruned:
            raise
        except KeyboardInterrupt:
            trial.set_user_attr("error", "interrupted (Ctrl-C or a kill of the tune)")
            raise
        except Exception as error:
            self.failures += 1
            trial.set_user_attr("error", failure_reason(error, self.secrets))
            raise

    def _train(self, trial) -> float:
        import optuna

        from vramcal.train.plan import plan_run  # loads numpy: only when called
        from vramcal.train.runner import train  # loads numpy: only when called

        config, setting = self.config(trial)
        plan = plan_run(config, self.run_dir / "trials" / f"{trial.number:04d}", setting)
        sizing = plan.sizing
        trial.set_user_attr("batch_size_used", sizing.batch_size)
        trial.set_user_attr("clamped", sizing.source != "requested")
        trial.set_user_attr("batch_source", sizing.label)
        trial.set_user_attr("run_dir", str(plan.run_dir))
        echo = lambda line: self.echo(f"trial {trial.number}: {line}")  # noqa: E731
        if sizing.source == "clamped":
            echo(f"warning: {sizing.notices[0]}")
        length = f"seq_len {config.spec.seq_len}, " if self.space.searched else ""
        echo(f"{length}lr {config.lr:.3g}, batch_size {sizing.batch_size} ({sizing.label}), weight_decay "
             f"{config.weight_decay:.3g}, max_grad_norm {config.max_grad_norm:.3g}")
        rows: list[dict[str, Any]] = []

        def on_epoch(row: dict[str, Any]) -> str | None:
            rows.append(row)
            _record(trial, rows)
            trial.report(row["val_loss"], row["epoch"])
            return "stop" if trial.should_prune() else None

        try:
            result = train(plan, echo=echo, on_epoch=on_epoch)
        except TrainError as error:
            trial.set_user_attr("stopped", str(error))
            if isinstance(error, (NonFiniteError, DivergedError)):  # the LR was too high: TPE learns from it
                raise optuna.TrialPruned(str(error)) from None
            raise
        if result.stopped:
            raise optuna.TrialPruned(f"val_loss {rows[-1]['val_loss']:.4f} at epoch {rows[-1]['epoch']} is worse "
                                     f"than the median of earlier trials")
        return min(r["val_loss"] for r in rows)


def _record(trial, rows: list[dict[str, Any]]) -> None:
    """The trial's figures so far in its user attributes (pruned trials keep them too)."""
    train_s = sum(r["train_s"] for r in rows)
    trial.set_user_attr("val_loss", min(r["val_loss"] for r in rows))
    trial.set_user_attr("val_zero_loss", rows[-1]["val_zero_loss"])
    trial.set_user_attr("samples_per_s", sum(r["samples"] for r in rows) / train_s if train_s > 0 else 0.0)
    trial.set_user_attr("epochs", len(rows))
    trial.set_user_attr("steps", rows[-1]["step"])
    trial.set_user_attr("peak_bytes", max(r["peak_bytes"] for r in rows))
