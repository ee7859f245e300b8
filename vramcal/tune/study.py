"""``vramcal tune``: an optuna study (TPE, Bergstra et al. 2011, with a median pruner) over the learning rate, batch
size, weight decay and clip norm, whose batch-size range is the profile's ``[--batch-size-min, conservative]``; each
trial a real ``vramcal train`` run in ``<run_dir>/trials/<nnnn>`` scored by its lowest validation loss. The study
lives in a storage (:mod:`vramcal.tune.storage`) that several workers share (:mod:`vramcal.tune.workers`); its
results are :mod:`vramcal.tune.report`'s. DESIGN.md "Hyperparameter search" gives the rules.
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
        base: the training settings every trial starts from (the searched knobs replaced by the trial's).
        lr_range, weight_decay_range, max_grad_norm_range: (low, high); LR and clip norm on a log scale.
        batch_size_max: the user's upper batch bound (None: the profile's conservative batch size).
        n_initial: random start-up trials before TPE.
        seq_lens: look-back windows to search too, each with its own batch range (): the base's seq_len.
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
    """Raises: TuneError: a bound not finite or negative (``positive``: not above 0), or ``low > high``."""
    if not (math.isfinite(low) and math.isfinite(high)):
        raise TuneError(f"{name}: bounds must be finite numbers, got {low:g} {high:g}")
    if low > high:
        raise TuneError(f"{name}: the low end {low:g} is above the high end {high:g}")
    if low < 0 or (positive and low <= 0):
        raise TuneError(f"{name}: bounds must be {'> 0' if positive else '>= 0'}, got {low:g}")


@dataclass(frozen=True)
class BatchBounds:
    """The inclusive batch-size bounds of the search (``high`` <= the profile's ``conservative``), the profile
    that gave them, its limits, and ``notices`` for the user."""

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
    """The batch-size search range from the setting's profile, sized as ``vramcal train`` sizes a run (the data term
    and the gate: :func:`vramcal.sizing.size`): up to the conservative size, the throughput knee when sizing for
    throughput (:func:`vramcal.sizing.throughput_choice`), ``batch_size_max``, and the training windows.

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
    """What trials may choose: ``(seq_len, setting, bounds)`` per look-back window (one: the base's, not searched)."""

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
    """Each searched length's setting (:func:`vramcal.train.plan.resolve`) and batch bounds.

    Raises:
        TuneError, SizingError, DataError, DeviceError: for the first length that cannot be searched.
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
    """Load study ``study_name`` from ``storage``, or create it with ``settings`` (None: it must exist, ``--resume``).
    A joining worker takes the saved settings (waiting up to :data:`SETTINGS_WAIT_S`); the sampler's seed adds the
    trials so far and, for a study that existed, a hash of :func:`~vramcal.tune.workers.worker_id`; TPE runs with
    ``constant_liar`` so concurrent workers do not propose the same point. ``where``: the storage as printed.

    Returns:
        (study, the settings it searches, whether it existed).

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
    """The settings a study's creator saved, waited for while a new study has no trials.

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
    """``{option name: (asked, saved)}`` for the settings a resumed or joining worker was given that differ from the
    study's (the training settings', the model spec's and the search's own names)."""
    def flat(settings: TuneSettings) -> dict[str, Any]:
        data = settings.to_dict()
        base = data.pop("base")
        return {**base.pop("spec"), **base, **data}

    ours, theirs = flat(asked), flat(saved)
    return {name: (value, theirs.get(name)) for name, value in ours.items() if value != theirs.get(name)}


def run_study(study, settings: TuneSettings, space: SearchSpace, run_dir: Path, n_trials: int,
              echo: Echo = print, secrets: tuple[str, ...] = (), poll_s: float = POLL_S) -> int:
    """Run trials until the study has exactly ``n_trials`` complete or pruned ones across its workers (DESIGN.md
    "Hyperparameter search": dead workers' trials failed first, waiting for other workers' last trials, surplus
    trials, a failed trial replaced until more than ``n_trials`` failed). ``secrets``: hidden from the reasons.

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
    """One trial: suggest, plan and train with the trainer's own functions, report each epoch. ``n_trials``: the
    requested count (a trial past it is :class:`Surplus`); ``secrets``: hidden from the recorded reasons."""

    def __init__(self, settings: TuneSettings, space: SearchSpace, run_dir: Path, echo: Echo, n_trials: int,
                 secrets: tuple[str, ...] = ()) -> None:
        self.settings, self.space, self.run_dir, self.echo = settings, space, run_dir, echo
        self.n_trials, self.secrets = n_trials, secrets
        self.calls = self.failures = 0  # trials this objective ran, and how many of them failed

    def config(self, trial) -> tuple[TrainConfig, Setting]:
        """The trial's training settings and what they are sized against; with look-back windows searched, the length
        first, then the batch as a log-scale share of its range (``batch_share``, recorded as ``batch_size``)."""
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
        """Train the trial; any error fails this trial only, its one-line reason in the ``error`` user attribute.

        Raises:
            Surplus: the trial started past the count; it ran nothing.
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
