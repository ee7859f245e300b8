"""Several ``vramcal tune`` processes on one study: who runs a trial (``worker``: ``<host>:<pid>``), which trials are
dead (their worker gone on this host, or stale by optuna's heartbeat: :data:`vramcal.tune.storage.GRACE_S`), what
counts towards ``--trials`` (complete and pruned) and which are surplus, and the line each trial ends with
(DESIGN.md "Hyperparameter search").
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterable

from vramcal.environment import alive
from vramcal.tune.storage import GRACE_S, redact
from vramcal.units import format_duration

SURPLUS = "surplus"  # the user attribute of a trial that started past the requested count and did not run


def worker_id() -> str:
    """``<host>:<pid>`` of this process, kept in each trial's ``worker`` user attribute."""
    return f"{socket.gethostname()}:{os.getpid()}"


def dead_trials(study) -> dict[int, tuple[int, str]]:
    """The RUNNING trials whose worker is dead (module docstring): ``{trial id: (number, reason)}``."""
    from optuna.trial import TrialState

    storage = study._storage
    beats = getattr(storage, "heartbeat_interval", None) is not None  # RDBStorage's, or the journal's (storage)
    stale = set(storage._get_stale_trial_ids(study._study_id)) if beats else set()
    host, dead = socket.gethostname(), {}
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker_host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
        if worker_host == host and pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid)):
            dead[trial._trial_id] = (trial.number, "its worker process is gone")
        elif trial._trial_id in stale:
            dead[trial._trial_id] = (trial.number, f"its worker sent no heartbeat for {GRACE_S} s")
    return dead


def fail_dead_trials(study) -> list[tuple[int, str]]:
    """Mark RUNNING trials whose worker is dead as FAIL, the reason in ``error`` (written first: optuna's own
    ``fail_stale_trials`` records none). Returns ``(number, reason)`` of each."""
    import optuna
    from optuna.trial import TrialState

    failed = []
    for trial_id, (number, reason) in dead_trials(study).items():
        try:
            study._storage.set_trial_user_attr(trial_id, "error", reason)
            if study._storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                failed.append((number, reason))
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # it finished meanwhile, or another worker failed it first
    return failed


def finished(trials: Iterable) -> int:
    """Trials that count towards ``--trials``: complete or pruned."""
    from optuna.trial import TrialState

    return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)


def is_surplus(trials: Iterable, number: int, n_trials: int) -> bool:
    """Whether trial ``number`` starts past the count: the finished and running trials numbered before it (optuna
    numbers them as the storage made them, so every worker agrees) already make ``n_trials``."""
    from optuna.trial import TrialState

    counted = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return sum(t.number < number and t.state in counted for t in trials) >= n_trials


def time_left(trials: Iterable, n_trials: int) -> str:
    """``4 of 20 finished, about 9.6 min left``: the trials still to run at the finished ones' mean wall time,
    shared between this worker and the others running one."""
    from optuna.trial import TrialState

    trials = list(trials)
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    durations = [t.duration.total_seconds() for t in done if t.duration is not None]
    left, shown = n_trials - len(done), f"{len(done)} of {n_trials} finished"
    if left <= 0 or not durations:
        return shown
    others = {t.user_attrs.get("worker") for t in trials if t.state == TrialState.RUNNING} - {worker_id()}
    seconds = sum(durations) / len(durations) * math.ceil(left / (1 + len(others)))
    workers = f" between {1 + len(others)} workers" if others else ""
    return f"{shown}, about {format_duration(seconds)} left{workers}"


def shown_trials(trials: Iterable) -> list:
    """The trials a table lists: all but the surplus ones (they never ran)."""
    return [t for t in trials if not t.user_attrs.get(SURPLUS)]


def failure_reason(error: BaseException, secrets: tuple[str, ...] = ()) -> str:
    """One line for a failed trial: vramcal's own errors' message, else ``Type: first line``; passwords and
    ``secrets`` hidden."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    own = type(error).__module__.startswith("vramcal.")
    return redact(first if own and first else f"{type(error).__name__}: {first}".rstrip(": "), secrets)[:500]


def announce(echo, n_trials: int):
    """The optuna callback that prints an ended trial's line: state, lowest validation loss, why it failed, and
    :func:`time_left`."""
    def callback(study, trial) -> None:
        if trial.user_attrs.get(SURPLUS):
            echo(f"trial {trial.number}: {trial.user_attrs['error']}")
            return
        value = trial.user_attrs.get("val_loss")
        shown = f"val_loss {value:.4f}" if value is not None else "no validation"
        reason = trial.user_attrs.get("error")
        echo(f"trial {trial.number}: {trial.state.name.lower()}, {shown}" + (f" ({reason})" if reason else "")
             + f"; {time_left(study.get_trials(deepcopy=False), n_trials)}")

    return callback
