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
the same epoch. A non-finite loss (the learning rate was too high) ends a trial as pruned, so TPE
still learns from it.

Each trial is a ``vramcal train`` run in a worker process of its own (:func:`vramcal.train.runner.train`),
made like the probe's trials that sized it; after each epoch the worker asks this process, which calls
``trial.report`` and answers "stop" when the pruner says so. Whatever goes wrong inside a trial — an
out-of-memory error the trainer could not recover from, a crash, a ``kill -9`` of the worker — fails
that trial only: the study goes on and writes its results. What the trials are sized against (data,
device, profile) is decided once for the study (:func:`vramcal.train.plan.resolve`). A killed study
loses only its running trial: the study lives in a database and ``--resume`` continues it; a trial left
running is marked failed (:func:`fail_dead_trials`) when the study is resumed or joined.

Storage URLs may hold credentials (``postgresql://user:password@host/db``): they are read from
``--storage`` or the ``VRAMCAL_TUNE_STORAGE`` environment variable (which no process list shows) and
printed or written only through :func:`redact`.

Storage: SQLite at ``<run_dir>/study.db`` by default, or any URL optuna's ``RDBStorage`` opens
(``postgresql://``, ``mysql://``, ``sqlite:///``). Several processes or machines given the same
``--storage`` and ``--study-name`` work on one study at once (optuna's distributed mode). The first one
saves the search settings in the study; the others use those, with batch bounds from their own profile.

The trials table, the best configuration and the PNG are made by :mod:`vramcal.tune.report`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vramcal.sizing import size, throughput_choice
from vramcal.train.config import TrainConfig
from vramcal.train.plan import Setting

Echo = Callable[[str], None]
STUDY_DB = "study.db"
BEST_CONFIG = "best-config.json"
TRIALS_TABLE = "trials.md"
PLOT = "tune.png"
DEFAULT_STUDY_NAME = "vramcal-tune"
HEARTBEAT_S = 60  # a killed trial is marked failed after 2 x this without a heartbeat


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
                dataclasses.replace(self.base.spec, seq_len=length).validate()
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
        notices: warnings for the user (a user range narrowed to the profile or to the data).
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

    Upper end: the conservative batch size (:func:`vramcal.sizing.size`, with the data term), sizing for
    throughput the throughput knee when below it (:func:`vramcal.sizing.throughput_choice`), or
    ``batch_size_max`` when lower (a higher one is narrowed with a notice); never more than the training
    windows (a larger batch is one whole epoch).

    Raises:
        TuneError: the whole user range lies above the conservative batch size or the training windows.
        SizingError: the profile has no usable limits.
    """
    seq_len = setting.config.spec.seq_len
    sizing = size(setting.profile, limit="conservative", pool_data_bytes=setting.pool_data_bytes, seq_len=seq_len)
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
        notices.append(why)
    if settings.batch_size_max is not None and settings.batch_size_max <= high:
        high = settings.batch_size_max
    elif settings.batch_size_max is not None:
        notices.append(f"--batch-size-max {settings.batch_size_max} is above the profile's {what}: searching up "
                       f"to {high}")
    if high > n_train:
        if low > n_train:
            raise TuneError(f"--batch-size-min {low} is more than the {n_train} training windows: lower it, "
                            f"or use more data or a smaller --stride")
        notices.append(f"the data has {n_train} training windows: searching batch sizes up to {n_train}")
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
    from vramcal.train.plan import resolve

    lengths = settings.seq_lens or (settings.base.spec.seq_len,)
    entries = []
    for length in sorted(lengths):
        setting = resolve(settings.base.replace(seq_len=length), capacity_bytes)
        entries.append((length, setting, batch_bounds(settings, setting)))
    return SearchSpace(tuple(entries))


def redact(text: str) -> str:
    """``text`` (a storage URL, or an error message that may quote one) with passwords replaced by ``***``,
    for everything vramcal prints or writes.

    The password of ``scheme://user:password@host/...`` runs to the *last* ``@`` (so a password holding an
    unescaped ``@`` or ``/`` is hidden whole, at the cost of hiding more of a URL that has an ``@`` after its
    host); ``password=...`` and ``passwd=...`` parameters (query strings, driver DSNs) are hidden too.
    """
    text = re.sub(r"(://[^:/@\s]*:)\S*@", r"\1***@", text)
    return re.sub(r"((?:password|passwd)\s*=\s*)[^&\s'\"]*", r"\1***", text, flags=re.IGNORECASE)


# ------------------------------------------------------------------------------------------- study

def default_storage(run_dir: Path) -> str:
    return f"sqlite:///{(Path(run_dir) / STUDY_DB).resolve()}"


def open_storage(url: str):
    """optuna's RDB storage with a heartbeat, so trials of a killed process end as failed.

    Raises:
        TuneError: the URL cannot be opened (bad scheme, missing driver, unreachable server, no folder).
    """
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            return optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S)
        except Exception as error:  # sqlalchemy, drivers and optuna raise many kinds; all mean "cannot open"
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise TuneError(f"cannot open the study storage {redact(url)}: {redact(first)[:200]}") from None


def open_study(storage, study_name: str, settings: TuneSettings | None, seed: int, n_initial: int):
    """Load study ``study_name`` from ``storage``, or create it with ``settings`` when absent.

    Args:
        settings: None = the study must exist (``--resume``).

    Returns:
        (study, the settings it searches: the saved ones for an existing study, and whether it existed).

    Raises:
        TuneError: ``--resume`` of a study that is not there.
    """
    import optuna

    # vramcal prints one line per trial itself; optuna's own warning for a failed trial carries its traceback
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    names = {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    existed = study_name in names
    if not existed and settings is None:
        raise TuneError(f"there is no study {study_name!r} to resume in {redact(storage.url)}: start one without "
                        f"--resume (known: {', '.join(sorted(names)) or 'none'})")
    study = optuna.create_study(storage=storage, study_name=study_name, direction="minimize", load_if_exists=True)
    if existed:
        saved = study.user_attrs.get("settings")
        if saved is None:
            raise TuneError(f"study {study_name!r} was not made by vramcal tune (no saved settings): "
                            f"choose another --study-name")
        settings = TuneSettings.from_dict(saved)
    else:
        assert settings is not None
        study.set_user_attr("settings", settings.to_dict())
    # A fresh sampler seed per start, so a resumed study does not repeat its first random trials.
    study.sampler = optuna.samplers.TPESampler(n_startup_trials=settings.n_initial, seed=seed + len(study.trials),
                                               multivariate=True)
    study.pruner = optuna.pruners.MedianPruner(n_startup_trials=max(1, settings.n_initial), n_warmup_steps=0)
    return study, settings, existed


def worker_id() -> str:
    """``<host>:<pid>`` of this process, kept in each trial's ``worker`` user attribute."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _process_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: it exists, under another user
        return False
    return False


def fail_dead_trials(study) -> list[int]:
    """Mark RUNNING trials whose process is dead as FAIL, before a resumed or joining worker goes on.

    A trial is dead when its ``worker`` ran on this host and that process no longer exists (a ``kill -9``
    or a crash), or when optuna's heartbeat is older than the grace period
    (:func:`optuna.storages.fail_stale_trials`, any host). Trials of live workers are left alone.

    Returns:
        The numbers of the trials marked failed.
    """
    import optuna
    from optuna.trial import TrialState

    before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker_host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
        if worker_host == host and pid.isdigit() and int(pid) != os.getpid() and _process_is_gone(int(pid)):
            try:
                study._storage.set_trial_user_attr(trial._trial_id, "error", "its worker process is gone")
                study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # it finished meanwhile
    still = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    return sorted(before - still)


def finished(study) -> int:
    """Trials that count towards ``--trials``: complete or pruned."""
    from optuna.trial import TrialState

    return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)


def run_study(study, settings: TuneSettings, space: SearchSpace, run_dir: Path, n_trials: int,
              echo: Echo = print) -> int:
    """Run trials until the study has ``n_trials`` complete or pruned ones (across all its workers).

    Trials left RUNNING by a killed worker are marked failed first (:func:`fail_dead_trials`). A trial
    that fails (any error) is recorded as failed with its one-line reason, and the study goes on with
    another trial in its place, until this call has seen more than ``n_trials`` failures (a study of N
    trials tolerates N failed ones; more means something fails every trial, and the reasons say what).

    Returns:
        The number of trials this call ran.
    """
    import optuna
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState

    for number in fail_dead_trials(study):
        echo(f"trial {number}: fail (its worker process is gone)")
    objective = Objective(settings, space, Path(run_dir), echo)
    while (remaining := n_trials - finished(study)) > 0:
        if objective.failures > n_trials:
            echo(f"stopping: {objective.failures} trials failed (see the reasons above), {finished(study)} of "
                 f"{n_trials} finished")
            break
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.optimize(objective, n_trials=min(remaining, n_trials + 1 - objective.failures), gc_after_trial=True,
                           catch=(Exception,),
                           callbacks=[MaxTrialsCallback(n_trials, states=(TrialState.COMPLETE, TrialState.PRUNED)),
                                      _announce(echo)])
    return objective.calls


class Objective:
    """One trial: suggest, plan and train with the trainer's own functions, report each epoch."""

    def __init__(self, settings: TuneSettings, space: SearchSpace, run_dir: Path, echo: Echo) -> None:
        self.settings, self.space, self.run_dir, self.echo = settings, space, run_dir, echo
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
        trial only, with its one-line reason in the ``error`` user attribute (optuna records it as FAIL)."""
        import optuna

        trial.set_user_attr("worker", worker_id())
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
            trial.set_user_attr("error", failure_reason(error))
            raise

    def _train(self, trial) -> float:
        import optuna

        from vramcal.train.errors import TrainError
        from vramcal.train.plan import plan_run
        from vramcal.train.runner import train

        config, setting = self.config(trial)
        plan = plan_run(config, self.run_dir / "trials" / f"{trial.number:04d}", setting)
        sizing = plan.sizing
        trial.set_user_attr("batch_size_used", sizing.batch_size)
        trial.set_user_attr("clamped", sizing.source != "requested")
        trial.set_user_attr("batch_source", sizing.source)
        trial.set_user_attr("run_dir", str(plan.run_dir))
        echo = lambda line: self.echo(f"trial {trial.number}: {line}")  # noqa: E731
        if sizing.source == "clamped":
            echo(f"warning: {sizing.notices[0]}")
        length = f"seq_len {config.spec.seq_len}, " if self.space.searched else ""
        echo(f"{length}lr {config.lr:.3g}, batch_size {sizing.batch_size} ({sizing.source}), weight_decay "
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
            if "non-finite" in str(error):  # the LR was too high: a result TPE should learn from
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


def failure_reason(error: BaseException) -> str:
    """One line for a failed trial: the message of vramcal's own errors (written for people, naming the
    trial's last good checkpoint), else ``Type: first line``; passwords redacted (:func:`redact`)."""
    from vramcal.train.errors import TrainError

    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    own = isinstance(error, TrainError | TuneError) or type(error).__name__ in ("DataError", "RunDirError",
                                                                                 "SizingError", "ConfigError")
    return redact(first if own and first else f"{type(error).__name__}: {first}".rstrip(": "))[:500]


def _announce(echo: Echo):
    def callback(study, trial) -> None:
        value = trial.user_attrs.get("val_loss")
        shown = f"val_loss {value:.4f}" if value is not None else "no validation"
        reason = trial.user_attrs.get("error")
        echo(f"trial {trial.number}: {trial.state.name.lower()}, {shown}" + (f" ({reason})" if reason else ""))

    return callback
