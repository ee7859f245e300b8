"""A real PostgreSQL server for the tests, started from the Debian package's binaries in a temporary folder.

``running_server()`` runs ``initdb`` and ``pg_ctl`` from ``/usr/lib/postgresql/<version>/bin`` (the newest
installed; ``.ci/run`` installs the ``postgresql`` package when it is missing) with password authentication
(scram-sha-256) on 127.0.0.1 and a free port, and stops it on exit. PostgreSQL refuses to run as root, so
under root the server runs as ``nobody`` (its folder is made in ``/tmp``, which ``nobody`` can reach; pytest's
own temporary folders are private to root). Without the binaries, or without a user to run them as,
:func:`missing` gives the reason a test skips with.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

USER = "vramcal"
DATABASE = "postgres"  # the database initdb makes
START_TIMEOUT_S = 60


@dataclass(frozen=True)
class Server:
    """A running server: connect as ``USER`` with ``password`` to ``host:port``; ``stop()`` ends it at once
    (``pg_ctl stop -m immediate``: as a crash or a lost machine would, for tests of a server that goes away)."""

    host: str
    port: int
    password: str
    folder: Path
    stop: Callable[[], None] = field(repr=False, default=lambda: None)

    def url(self, scheme: str = "postgresql", password: str | None = None, encode: bool = True) -> str:
        """A storage URL for the server (the password percent-encoded unless ``encode`` is False)."""
        secret = self.password if password is None else password
        return f"{scheme}://{USER}:{quote(secret, safe='') if encode else secret}@{self.host}:{self.port}/{DATABASE}"


def binaries() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` that has initdb and pg_ctl, or None."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")
             if Path(p).with_name("pg_ctl").is_file()]
    return max(found, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0) if found else None


def _run_as() -> pwd.struct_passwd | None:
    """The user the server runs as: ``nobody`` under root, else the current user."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid())
    with contextlib.suppress(KeyError):
        return pwd.getpwnam("nobody")
    return None


def missing() -> str | None:
    """Why no server can be started here (None: one can)."""
    if binaries() is None:
        return "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): apt-get install postgresql"
    if _run_as() is None:
        return "running as root without a 'nobody' user to run PostgreSQL as (it refuses to run as root)"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_server(password: str) -> Iterator[Server]:
    """Start a fresh server whose superuser ``USER`` has ``password``; stop it and delete its folder on exit.

    Raises:
        RuntimeError: initdb or the server's start failed (the message holds the tail of its log).
    """
    bin_dir, user = binaries(), _run_as()
    assert bin_dir is not None and user is not None, missing()
    folder = Path(tempfile.mkdtemp(prefix="vramcal-pg-"))
    os.chown(folder, user.pw_uid, user.pw_gid)
    as_user = {} if os.geteuid() != 0 else {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8", "HOME": str(folder)}

    def run(*args: str, timeout: float = START_TIMEOUT_S) -> None:
        done = subprocess.run(args, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout, **as_user)
        if done.returncode != 0:
            log = (folder / "server.log").read_text()[-1500:] if (folder / "server.log").exists() else ""
            raise RuntimeError(f"{Path(args[0]).name} failed ({done.returncode}): {done.stderr[-1500:]} {log}")

    def stop() -> None:
        if (folder / "data" / "postmaster.pid").exists():
            run(str(bin_dir / "pg_ctl"), "-D", str(folder / "data"), "-m", "immediate", "-w", "stop", timeout=30)

    port = _free_port()
    (folder / "pwfile").write_text(password + "\n")
    os.chown(folder / "pwfile", user.pw_uid, user.pw_gid)
    try:
        run(str(bin_dir / "initdb"), "-D", str(folder / "data"), "-U", USER, f"--pwfile={folder / 'pwfile'}",
            "--auth=scram-sha-256", "--no-sync", "--encoding=UTF8")
        options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=40"
        run(str(bin_dir / "pg_ctl"), "-D", str(folder / "data"), "-l", str(folder / "server.log"), "-o", options,
            "-w", "-t", str(START_TIMEOUT_S), "start")
        yield Server("127.0.0.1", port, password, folder, stop)
    finally:
        with contextlib.suppress(Exception):
            stop()
        shutil.rmtree(folder, ignore_errors=True)
