"""``vramcal tune``'s storages for real: a PostgreSQL server the suite starts, optuna journal files, and several
``vramcal tune`` processes sharing one study.

The profile is built in memory (conservative batch size 10) and the data are synthetic bars, as in
tests/test_tune.py; every trial is a real training run of the tiny Mamba-2 (one epoch of at most 2 steps).
The storage URLs the README's "Hyperparameter search" section shows are the ones run here
(:func:`readme_storages`): its example host ``db.example:5432`` becomes the test server's, its ``/shared/``
the test folder's ``shared/``, and relative paths are run from the test folder. The server's password is the
README's, which holds ``@``, ``:`` and ``/`` unescaped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from click.testing import CliRunner
from optuna.trial import TrialState
from postgres_server import missing, running_server
from test_train import SPEC_ARGS, one_line_failure, training_folder

from vramcal.cli import main
from vramcal.tune.storage import HEARTBEAT_ATTR, open_storage, parse_storage
from vramcal.tune.study import TRIALS_TABLE
from vramcal.tune.workers import SURPLUS

README = Path(__file__).resolve().parents[1] / "README.md"
REPO = README.parent
TRIALS = 4
WORKER_TIMEOUT_S = 300
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def readme_storages() -> list[str]:
    """The ``--storage`` and ``VRAMCAL_TUNE_STORAGE`` values of the README's "Hyperparameter search" section."""
    section = README.read_text().split("\n## Hyperparameter search\n", 1)[1].split("\n## ", 1)[0]
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", section, flags=re.S))
    return [quoted or bare for quoted, bare in
            re.findall(r"(?:--storage |VRAMCAL_TUNE_STORAGE=)(?:'([^']+)'|(\S+))", blocks)]


def readme_password() -> str:
    """The password of the README's PostgreSQL URLs (user ``vramcal``, host ``db.example:5432``, database
    ``optuna``), which the test server is given."""
    urls = [s for s in readme_storages() if s.startswith("postgresql")]
    match = re.match(r"postgresql://vramcal:(.*)@db\.example:5432/optuna$", urls[0] if urls else "")
    assert match, f"the README shows no postgresql://vramcal:...@db.example:5432/optuna storage: {urls}"
    return match.group(1)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("storage")
    training_folder(tmp)
    (tmp / "shared" / "tune").mkdir(parents=True)
    return tmp


@pytest.fixture(scope="module")
def postgres():
    """Skips (with the reason) where no PostgreSQL server can be started or psycopg is not installed."""
    reason = missing()
    if reason:
        pytest.skip(reason)
    return pytest.importorskip("psycopg", reason="psycopg is not installed: pip install 'vramcal[postgres]'")


@pytest.fixture(scope="module")
def server(postgres):
    psycopg = postgres
    with running_server(readme_password()) as running:
        with psycopg.connect(host=running.host, port=running.port, user="vramcal", password=running.password,
                             dbname="postgres", autocommit=True) as connection:
            connection.execute("CREATE DATABASE optuna")
        yield running


def args(home: Path, run: str, *extra: str) -> list[str]:
    return ["tune", "--data", str(home / "bars.parquet"), "--profiles-dir", str(home / "profiles"), "--gpu", "none",
            "--run-dir", str(home / run), *SPEC_ARGS, "--epochs", "1", "--max-steps", "2", "--study-name", "es-mamba",
            "--trials", str(TRIALS), "--n-initial", "2", *extra]


def start(home: Path, run: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m vramcal tune`` in a process group of its own (so a kill takes its trial's worker too)."""
    environment = {k: v for k, v in os.environ.items() if k != "VRAMCAL_TUNE_STORAGE"} | (env or {})
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environment.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-m", "vramcal", *args(home, run, *extra)], cwd=home, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(condition, what: str, timeout_s: float = WORKER_TIMEOUT_S, worker: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if worker is not None and worker.poll() is not None:
            pytest.fail(f"the worker ended before {what}: {worker.stdout.read()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout_s} s")
        time.sleep(0.3)
    return value


def study_of(storage) -> optuna.Study | None:
    """The shared study once its creator has saved its settings (None before)."""
    if "es-mamba" not in {s.study_name for s in optuna.get_all_study_summaries(storage)}:
        return None
    study = optuna.load_study(study_name="es-mamba", storage=storage)
    return study if study.user_attrs.get("settings") else None


def finish(worker: subprocess.Popen) -> str:
    try:
        output, _ = worker.communicate(timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        pytest.fail(f"the worker did not end within {WORKER_TIMEOUT_S} s: {worker.communicate()[0]}")
    assert worker.returncode == 0, output
    assert "Traceback" not in output, output
    return output


def table_states(output: str) -> list[str]:
    """The state column of the trials table a worker printed."""
    rows = [line for line in output.splitlines() if re.match(r"\| \d", line)]
    return [row.split("|")[2].strip() for row in rows]


# ------------------------------------------------------------------------------------------ PostgreSQL

def test_two_workers_share_one_postgres_study_and_stop_at_the_count(home, server):
    """The README's two PostgreSQL forms, one per worker (the environment variable, then --storage), against a
    real server with a password holding @ : /: the second joins with the first one's settings, naming only
    the option that differs; together they finish exactly --trials trials, and each one's table is the
    whole study, with no trial left running."""
    forms = [s.replace("db.example:5432", f"{server.host}:{server.port}") for s in readme_storages()
             if s.startswith("postgresql")]
    assert len(forms) == 2 and forms[0] == forms[1] and {"@", ":", "/"} <= set(server.password)
    first = start(home, "pg-a", env={"VRAMCAL_TUNE_STORAGE": forms[0]})
    storage = open_storage(forms[0])
    wait_for(lambda: study_of(storage), "study with its settings", worker=first)
    second = start(home, "pg-b", "--storage", forms[1], "--n-initial", "3")
    outputs = [finish(first), finish(second)]
    study = optuna.load_study(study_name="es-mamba", storage=storage)
    assert sum(t.state in FINISHED for t in study.trials) == TRIALS, outputs
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    workers = {t.user_attrs["worker"] for t in study.trials}
    assert len(workers) == 2, workers  # both ran trials
    assert "joining study 'es-mamba' (" in outputs[1]
    assert "with its saved settings; ignoring --n-initial 3 (the study's: 2)\n" in outputs[1], outputs[1]
    for output in outputs:
        # a trial two workers started at once past the count never ran and is left out of the tables
        assert table_states(output) == [t.state.name.lower() for t in study.trials
                                        if not t.user_attrs.get(SURPLUS)], output
        assert "postgresql://vramcal:***@" in output
        assert server.password not in output
        assert not [piece for piece in re.split(r"[@:/]", server.password) if f"{piece}@" in output]


def test_a_wrong_password_with_at_signs_is_one_line_that_hides_all_of_it(home, server):
    """The driver's own error (authentication failed) comes back as one line; the password given, which
    holds @ : /, shows nowhere in the output, not even a piece of it as a host name."""
    wrong = "Xq7@Zk9:Vb2/Mn4@Lp0"
    url = f"postgresql://vramcal:{wrong}@{server.host}:{server.port}/optuna"
    result = CliRunner().invoke(main, args(home, "pg-wrong", "--storage", url))
    line = one_line_failure(result)
    assert line.startswith(f"Error: cannot open the study storage postgresql://vramcal:***@{server.host}:"), line
    assert "password authentication failed" in line, line
    for piece in re.split(r"[@:/]", wrong):
        assert piece not in result.output, (piece, result.output)


def test_a_missing_postgres_driver_names_the_extra_and_the_url_that_works(home):
    """Without psycopg (made unimportable in a fresh interpreter, as where it was never installed), the
    default postgresql:// driver of SQLAlchemy 2.1: one line naming the extra and the psycopg2 form, exit 1."""
    url = "postgresql://alice:p@ss@db.example/optuna"
    code = ("import sys; sys.modules['psycopg'] = None; from vramcal.cli import main; "
            f"main({args(home, 'pg-driver', '--storage', url)!r}, prog_name='vramcal')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        "Error: cannot open the study storage postgresql://alice:***@db.example/optuna: SQLAlchemy "
        f"{__import__('sqlalchemy').__version__} opens postgresql:// with the psycopg driver, which is not installed: "
        "pip install 'vramcal[postgres]' (psycopg 3), or write postgresql+psycopg2://alice:***@db.example/optuna to "
        "use psycopg2"], done.stderr


def test_a_server_that_goes_away_mid_study_is_one_line(home, postgres, monkeypatch):
    """A second server, stopped (as a crash would) while the first trial trains: the tune ends with one
    line naming the storage, the password hidden, exit 1 (no traceback)."""
    from vramcal.train import runner

    real_train = runner.train
    with running_server("an0ther@pass:w/rd") as doomed:
        def train(plan, **kwargs):
            doomed.stop()
            return real_train(plan, **kwargs)

        monkeypatch.setattr(runner, "train", train)
        result = CliRunner().invoke(main, args(home, "pg-gone", "--storage", doomed.url(encode=False)))
    line = one_line_failure(result)
    assert line.startswith(f"Error: the study storage postgresql://vramcal:***@{doomed.host}:{doomed.port}/postgres "
                           f"failed: "), line
    assert "Connection refused" in line and line.endswith("(what was recorded is kept: continue with --resume)"), line
    assert "an0ther" not in result.output and "pass:w" not in result.output


# --------------------------------------------------------------------------------------------- journal

def test_two_workers_share_one_journal_and_a_killed_ones_trial_is_failed(home):
    """The README's journal forms (journal:///..., and the same file as a relative path), one per worker. The
    second is killed (kill -9 of its process group) in the middle of a trial: the first marks that trial
    failed, runs the study on to exactly --trials, and its table shows the trial as failed, nothing running.
    Then --resume with one trial more continues the same journal."""
    forms = [s.replace("/shared/", f"{home}/shared/") for s in readme_storages() if not s.startswith("postgresql")]
    assert [parse_storage(s).kind for s in forms] == ["journal", "journal"], forms
    assert (home / parse_storage(forms[1]).target).resolve() == Path(parse_storage(forms[0]).target).resolve()
    first = start(home, "journal-a", "--storage", forms[0])
    storage = open_storage(forms[0])
    wait_for(lambda: study_of(storage), "study with its settings", worker=first)
    second = start(home, "journal-b", "--storage", forms[1])
    mark = f":{second.pid}"
    victim = wait_for(lambda: next((t for t in optuna.load_study(study_name="es-mamba", storage=storage).trials
                                    if t.state == TrialState.RUNNING and t.user_attrs.get("worker", "").endswith(mark)),
                                   None), "running trial in the second worker", worker=second)
    os.killpg(second.pid, signal.SIGKILL)
    second.wait(timeout=30)
    output = finish(first)
    trials = optuna.load_study(study_name="es-mamba", storage=storage).trials
    killed = trials[victim.number]
    assert (killed.state, killed.user_attrs["error"]) == (TrialState.FAIL, "its worker process is gone")
    assert sum(t.state in FINISHED for t in trials) == TRIALS
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert f"trial {victim.number}: fail (its worker process is gone)" in output
    states = table_states(output)
    assert states[victim.number] == "fail" and "running" not in states
    assert states == table_states((home / "journal-a" / TRIALS_TABLE).read_text())
    assert all(HEARTBEAT_ATTR in t.system_attrs for t in trials)  # optuna's heartbeat ran on the journal

    resumed = CliRunner().invoke(main, args(home, "journal-a", "--storage", forms[0], "--resume", "--trials",
                                            str(TRIALS + 1)))
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming study 'es-mamba' ({len(trials)} trials so far) with its saved settings\n" in resumed.output
    again = optuna.load_study(study_name="es-mamba", storage=storage)
    assert sum(t.state in FINISHED for t in again.trials) == TRIALS + 1


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_journal_trial_without_a_heartbeat_is_stale_on_any_host(tmp_path):
    """A RUNNING trial of a worker on another host (its pid means nothing here) whose last heartbeat is older
    than twice the interval is failed, as RDBStorage's heartbeat does on a database; a fresh one is not."""
    from vramcal.tune.storage import HEARTBEAT_S
    from vramcal.tune.workers import fail_dead_trials

    storage = open_storage(str(tmp_path / "study.log"))
    study = optuna.create_study(storage=storage, study_name="stale")
    for age_s in (3 * HEARTBEAT_S, HEARTBEAT_S):
        trial = study.ask()
        trial.set_user_attr("worker", "elsewhere:1")
        storage.set_trial_system_attr(trial._trial_id, HEARTBEAT_ATTR, time.time() - age_s)
    assert fail_dead_trials(study) == [(0, f"its worker sent no heartbeat for {2 * HEARTBEAT_S} s")]
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.RUNNING]
    assert study.trials[0].user_attrs["error"] == f"its worker sent no heartbeat for {2 * HEARTBEAT_S} s"


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_worker_that_ended_unreaped_is_dead_at_once(tmp_path):
    """A worker killed under a parent that has not reaped it yet (a zombie: signal 0 still reaches it) is
    gone, without waiting 2 minutes for its heartbeat to go stale."""
    from vramcal.tune.workers import fail_dead_trials, worker_id

    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z",
             "zombie", timeout_s=30)
    study = optuna.create_study(storage=open_storage(str(tmp_path / "study.log")), study_name="zombie")
    study.ask().set_user_attr("worker", f"{worker_id().rpartition(':')[0]}:{zombie.pid}")
    assert fail_dead_trials(study) == [(0, "its worker process is gone")]
    zombie.wait()


def test_a_relative_journal_locks_through_an_absolute_link(tmp_path, monkeypatch):
    """optuna's journal lock is a symlink to the journal's path: given as written (relative), it dangled, and a
    lock left by a worker killed while holding it was never broken (another worker then spun forever: seen
    in the two-worker test). The link is absolute, so the lock's 30 s grace period can break it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shared").mkdir()
    storage = open_storage("shared/study.log")
    lock = storage._backend._lock
    assert lock.acquire()  # as a worker killed inside a write leaves it
    try:
        assert os.readlink(lock._lock_file) == str(tmp_path / "shared" / "study.log")
        assert os.stat(lock._lock_file).st_mtime  # the link resolves: optuna's grace check can read it
    finally:
        lock.release()


@pytest.mark.parametrize(("storage", "message"), [
    ("journal://relative/study.log", "a journal URL holds an absolute path after three slashes"),
    ("study.txt", "is neither a URL (sqlite:///..., postgresql://..., journal:///...) nor a journal file path"),
])
def test_a_storage_of_no_known_form_exits_2(home, storage, message):
    result = CliRunner().invoke(main, args(home, "bad-form", "--storage", storage))
    assert result.exit_code == 2 and "Traceback" not in result.output and message in result.output, result.output


def test_a_journal_in_a_missing_folder_or_resumed_before_it_exists_is_one_line(home):
    line = one_line_failure(CliRunner().invoke(main, args(home, "j1", "--storage", "journal:///no/such/study.log")))
    assert line == ("Error: cannot open the study storage journal:///no/such/study.log: the folder /no/such does "
                    "not exist (create it, or give another path)")
    absent = home / "absent.log"
    line = one_line_failure(CliRunner().invoke(main, args(home, "j2", "--storage", str(absent), "--resume")))
    assert line == (f"Error: there is no study to resume in {absent}: the journal file does not exist (start one "
                    f"without --resume)")
    assert not absent.exists()


# -------------------------------------------------------------------------------------- the bookkeeping

@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_trial_started_past_the_count_runs_nothing_and_is_left_out_of_the_table(tmp_path):
    """Two workers that asked for a trial at once: the one numbered after the count's last is surplus. It
    suggests nothing, ends failed and marked, and neither the table nor the failures list it."""
    from vramcal.tune.report import failure_lines, format_table
    from vramcal.tune.study import Objective, Surplus, TuneSettings, open_study
    from vramcal.tune.workers import worker_id

    study, settings, _ = open_study(open_storage(str(tmp_path / "study.log")), "race", TuneSettings())
    study.ask().set_user_attr("worker", f"{worker_id().rpartition(':')[0]}:{os.getppid()}")  # a live worker's
    objective, late = Objective(settings, None, tmp_path, print, n_trials=1), study.ask()
    with pytest.raises(Surplus, match="not run: the study had 1 trials finished or running"):
        objective(late)
    study.tell(late, state=TrialState.FAIL)
    assert study.trials[1].params == {} and study.trials[1].user_attrs["surplus"] is True
    assert objective.calls == objective.failures == 0
    assert len(format_table(study).splitlines()) == 3 and failure_lines(study) == []  # header, rule, trial 0


def test_a_joining_worker_names_only_the_options_that_differ(home):
    """Resumed with the very options it was started with, a study names none as ignored; with two that
    differ (one of them given in a config file), it names exactly those, with both values."""
    first = CliRunner().invoke(main, args(home, "join", "--trials", "1", "--n-initial", "1", "--seed", "3"))
    assert first.exit_code == 0, first.output
    same = CliRunner().invoke(main, args(home, "join", "--trials", "1", "--n-initial", "1", "--seed", "3",
                                         "--resume"))
    assert same.exit_code == 0, same.output
    assert "resuming study 'es-mamba' (1 trials so far) with its saved settings\n" in same.output, same.output
    (home / "other.json").write_text('{"val_fraction": 0.3}')
    other = CliRunner().invoke(main, args(home, "join", "--trials", "1", "--n-initial", "1", "--seed", "4",
                                          "--config", str(home / "other.json"), "--resume"))
    assert other.exit_code == 0, other.output
    assert ("with its saved settings; ignoring --seed 4 (the study's: 3), --config's val_fraction 0.3 (the "
            "study's: 0.2)\n" in other.output), other.output
