"""Where a tune's study lives: a database URL for optuna's ``RDBStorage`` (``sqlite:///`` by default,
``postgresql://``, ``mysql+pymysql://``) or an optuna journal file (``journal:///abs/path.log``, or a path ending in
``.log``/``.jsonl``), opened with optuna's heartbeat so dead workers' trials go stale (:data:`HEARTBEAT_S`,
:data:`GRACE_S`), and passwords hidden from every message (:func:`redact`). A password may hold ``@``, ``:``, ``/``:
it runs to the URL's last ``@`` and is percent-encoded for SQLAlchemy. DESIGN.md "Hyperparameter search".
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import quote, unquote

from vramcal.workload import first_line

STUDY_DB = "study.db"
JOURNAL_SCHEME = "journal://"
JOURNAL_SUFFIXES = (".log", ".jsonl")
HEARTBEAT_S = 60  # optuna's heartbeat_interval: each running trial beats this often
GRACE_S = 2 * HEARTBEAT_S  # optuna's grace_period: a RUNNING trial without a beat for this long is stale
HEARTBEAT_ATTR = "vramcal:heartbeat_unix_s"  # a journal trial's last heartbeat (system attribute, seconds)
POSTGRES_EXTRA = "pip install 'vramcal[postgres]'"
# PostgreSQL drivers SQLAlchemy knows, by module: the URL scheme that picks each, and how to install it
_POSTGRES_DRIVERS = {"psycopg": ("postgresql+psycopg", POSTGRES_EXTRA),
                     "psycopg2": ("postgresql+psycopg2", "pip install psycopg2-binary")}
_PIP_NAMES = {"MySQLdb": "mysqlclient", "pymysql": "PyMySQL", "psycopg2": "psycopg2-binary"}  # module: package
_CREDENTIALS = re.compile(r"^(?P<scheme>[A-Za-z][\w+.-]*)://(?P<user>[^:/@\s]*):(?P<password>.*)@(?P<rest>[^@]*)$")


class StorageError(ValueError):
    """A storage that cannot be opened or used; the one-line message (password hidden) says what to do."""


@dataclass(frozen=True)
class StorageURL:
    """A storage as the user gave it (``text``: may hold a password, print :attr:`shown`), its ``kind`` (``rdb`` or
    ``journal``), the ``target`` opened (the URL with the password percent-encoded, or the journal's path) and the
    password's forms to hide (``secrets``)."""

    text: str
    kind: Literal["rdb", "journal"]
    target: str
    secrets: tuple[str, ...] = ()

    @property
    def shown(self) -> str:
        return redact(self.text, self.secrets)

    def hide(self, message: str) -> str:
        """``message`` with this URL's password (and any URL's) hidden."""
        return redact(message, self.secrets)


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` with passwords replaced by ``***``: a URL's (up to its *last* ``@``), ``password=``/``passwd=``
    parameters, and every string in ``secrets``."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "***")
    text = re.sub(r"(://[^:/@\s]*:)\S*@", r"\1***@", text)
    return re.sub(r"((?:password|passwd)\s*=\s*)[^&\s'\"]*", r"\1***", text, flags=re.IGNORECASE)


def default_storage(run_dir: Path) -> str:
    """The SQLite database of a tune folder, ``sqlite:///<run_dir>/study.db`` (absolute)."""
    return f"sqlite:///{(Path(run_dir) / STUDY_DB).resolve()}"


def parse_storage(text: str) -> StorageURL:
    """Read a ``--storage`` value (the forms in the module docstring).

    Raises:
        StorageError: a ``journal://`` URL without an absolute path, or neither a URL nor a journal file path.
    """
    text = text.strip()
    if text.startswith(JOURNAL_SCHEME):
        path = text[len(JOURNAL_SCHEME):]
        if not path.startswith("/"):
            raise StorageError(f"{text}: a journal URL holds an absolute path after three slashes, "
                               f"journal:///path/to/study.log (or give the path itself, ending in .log)")
        return StorageURL(text, "journal", path)
    if "://" not in text:
        if text.endswith(JOURNAL_SUFFIXES):
            return StorageURL(text, "journal", text)
        raise StorageError(f"the study storage {redact(text)!r} is neither a URL (sqlite:///..., postgresql://..., "
                           f"journal:///...) nor a journal file path ending in .log or .jsonl")
    match = _CREDENTIALS.match(text)
    if match is None or not match["password"]:
        return StorageURL(text, "rdb", text)
    password = match["password"]
    encoded = quote(password, safe="%")  # keeps %XX escapes a user wrote; SQLAlchemy unquotes the rest
    target = f"{match['scheme']}://{match['user']}:{encoded}@{match['rest']}"
    return StorageURL(text, "rdb", target, tuple(dict.fromkeys((password, unquote(password), encoded))))


def open_storage(url: str | StorageURL, create: bool = True):
    """Open a storage with heartbeats. ``create``: a journal file that is absent is made (False for ``--resume``).

    Raises:
        StorageError: the URL cannot be opened (a bad form, a missing driver named with what to install, an
            unreachable server, a missing folder, no journal), the password hidden.
    """
    url = parse_storage(url) if isinstance(url, str) else url
    opener = _open_journal if url.kind == "journal" else _open_rdb
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optuna's ExperimentalWarning for heartbeats and journals
        try:
            return opener(url, create)
        except StorageError:
            raise
        except Exception as error:  # sqlalchemy, drivers and optuna raise many kinds; all mean "cannot open"
            raise StorageError(f"cannot open the study storage {url.shown}: {url.hide(first_line(error))}") from None


@contextlib.contextmanager
def storage_errors(url: StorageURL) -> Iterator[None]:
    """A storage that fails once open (a lost connection) as one line: any error whose chain holds a SQLAlchemy
    error or optuna's ``StorageInternalError`` (optuna 5.0 raises its own ``UnboundLocalError`` over a failed write).

    Raises:
        StorageError: for those, with the driver's first line, the password hidden. Other errors pass unchanged.
    """
    try:
        yield
    except StorageError:
        raise
    except Exception as error:
        cause = _storage_cause(error)
        if cause is None:
            raise
        raise StorageError(f"the study storage {url.shown} failed: {url.hide(first_line(cause))} (what was "
                           f"recorded is kept: continue with --resume)") from None


def _storage_cause(error: BaseException) -> BaseException | None:
    """The first SQLAlchemy error in ``error``'s chain, else optuna's ``StorageInternalError``, else None."""
    import optuna
    import sqlalchemy

    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return next((e for e in chain if isinstance(e, sqlalchemy.exc.SQLAlchemyError)),
                next((e for e in chain if isinstance(e, optuna.exceptions.StorageInternalError)), None))


def _open_rdb(url: StorageURL, create: bool):
    import optuna

    check_driver(url)
    storage = optuna.storages.RDBStorage(url.target, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
    storage.get_all_studies()  # connects: a refused password or an unreachable server fails here, as "cannot open"
    return storage


def check_driver(url: StorageURL) -> None:
    """The URL's scheme is one SQLAlchemy knows and its driver imports.

    Raises:
        StorageError: an unknown scheme; a driver not installed, naming what to install (and for PostgreSQL the
            URL form that works with the installed driver).
    """
    import sqlalchemy
    from sqlalchemy.engine import make_url

    try:
        dialect = make_url(url.target).get_dialect()
    except Exception as error:  # ArgumentError (not a URL), NoSuchModuleError (an unknown scheme)
        raise StorageError(f"cannot open the study storage {url.shown}: {url.hide(first_line(error))} (the forms: "
                           f"sqlite:///path.db, postgresql://user@host/db, journal:///path.log)") from None
    try:
        dialect.import_dbapi()
    except ImportError as error:
        module = getattr(error, "name", None) or dialect.driver
        scheme = url.target.split("://", 1)[0]
        why = "" if isinstance(error, ModuleNotFoundError) else f" ({first_line(error)})"
        lead = (f"cannot open the study storage {url.shown}: SQLAlchemy {sqlalchemy.__version__} opens {scheme}:// "
                f"with the {module} driver, which is not installed{why}")
        raise StorageError(f"{lead}: {_driver_fix(url, dialect.name, module)}") from None


def _driver_fix(url: StorageURL, dialect: str, module: str) -> str:
    """What to do about a missing driver: the install command, and the URL form that works."""
    if dialect != "postgresql" or module not in _POSTGRES_DRIVERS:
        return f"pip install {_PIP_NAMES.get(module, module)}"
    rest = url.shown.split("://", 1)[1]
    install = _POSTGRES_DRIVERS[module][1]
    others = [name for name in _POSTGRES_DRIVERS if name != module and _importable(name)]
    if others:
        return f"{install}, or write {_POSTGRES_DRIVERS[others[0]][0]}://{rest} to use the installed {others[0]}"
    if module == "psycopg":
        return f"{install} (psycopg 3), or write postgresql+psycopg2://{rest} to use psycopg2"
    return f"{POSTGRES_EXTRA} and write postgresql+psycopg://{rest} (psycopg 3), or {install}"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (imports of it fail)
        return False


def _open_journal(url: StorageURL, create: bool):
    from optuna.storages.journal import JournalFileBackend

    path = Path(url.target)
    if not path.parent.is_dir():
        raise StorageError(f"cannot open the study storage {url.shown}: the folder {path.parent} does not exist "
                           f"(create it, or give another path)")
    if not create and not path.is_file():
        raise StorageError(f"there is no study to resume in {url.shown}: the journal file does not exist "
                           f"(start one without --resume)")
    # absolute: optuna's lock is a symlink to this path, and a dangling one is never broken (optuna 5.0)
    storage = heartbeat_journal_storage()(JournalFileBackend(str(path.resolve())))
    storage.get_all_studies()  # reads the log: a file that is not a journal fails here, not mid-study
    return storage


@functools.cache
def heartbeat_journal_storage() -> type:
    """The class of a journal storage with heartbeats (defined on first use: this module imports no optuna)."""
    from optuna.storages import JournalStorage
    from optuna.storages._heartbeat import BaseHeartbeat
    from optuna.trial import TrialState

    class _HeartbeatJournalStorage(JournalStorage, BaseHeartbeat):
        """A journal storage with optuna's ``BaseHeartbeat`` (only ``RDBStorage`` has one), so ``fail_stale_trials``
        works as on a database; a beat is the writer's wall-clock time in :data:`HEARTBEAT_ATTR`."""

        heartbeat_interval, grace_period = HEARTBEAT_S, GRACE_S

        def record_heartbeat(self, trial_id: int) -> None:
            try:
                self.set_trial_system_attr(trial_id, HEARTBEAT_ATTR, time.time())
            except Exception:  # the trial was failed meanwhile as stale, or the file is briefly unreachable:
                pass  # the next beat tries again; a heartbeat thread must not die with a traceback

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            now = time.time()
            return [t._trial_id for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
                    if now - t.system_attrs.get(HEARTBEAT_ATTR, now) > self.grace_period]

        def get_heartbeat_interval(self) -> int:
            return self.heartbeat_interval

        def get_heartbeat_stale_trial_callback(self):
            return None

    return _HeartbeatJournalStorage
