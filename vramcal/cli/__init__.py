"""The ``vramcal`` command line: every command is registered here, in one place.

Each command module is a thin click layer over :mod:`vramcal.api` and the library: it parses, calls,
prints. User-fixable failures are ``click.ClickException`` (exit 1, one line), bad values
``click.BadParameter`` (exit 2). The options' defaults may come from TOML files (:mod:`vramcal.cli.defaults`), read
here, by the root group, before the subcommand parses.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

# The command's own process reads parquet files too (the bars, to plan a run): pyarrow's default pool (jemalloc)
# would reserve about 1 GiB of address space there that nothing uses (issue 23: a run's process tree looked much
# larger than its budget). Set before anything imports pyarrow; a value the user exported wins.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")

import click  # noqa: E402 - after the pool is chosen

from vramcal import __version__
from vramcal.cli.console import VERBOSITY
from vramcal.cli.cost import cost_command
from vramcal.cli.defaults import apply_defaults
from vramcal.cli.estimate import estimate_command
from vramcal.cli.options import stop_on_sigterm
from vramcal.cli.probe import probe, show
from vramcal.cli.report import limits_command, report_command
from vramcal.cli.size import size_command
from vramcal.cli.train import data_group, train_command
from vramcal.cli.tune import tune_command
from vramcal.environment import address_space_refusal
from vramcal.words import FLAGS, speaking

STEPPING = {"probe", "size", "estimate", "train", "tune"}  # the commands that import torch and run steps


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vramcal")
@click.option("-q", "--quiet", is_flag=True, help="no line per trial and no progress bars (results and errors stay)")
@click.option("-v", "--verbose", is_flag=True, help="also a line per step of the steady trial")
@click.pass_context
def main(ctx: click.Context, quiet: bool, verbose: bool) -> None:
    """Measure the memory of real Mamba-2 training steps and calibrate safe batch sizes."""
    if quiet and verbose:
        raise click.UsageError("-q and -v contradict each other: give one")
    apply_defaults(ctx)  # vramcal.toml and the user's config.toml, as click's default_map: flags still win
    refusal = address_space_refusal() if ctx.invoked_subcommand in STEPPING else None
    if refusal:
        raise click.ClickException(refusal)
    ctx.with_resource(speaking(FLAGS))  # messages name the command line's flags (vramcal.words)
    ctx.with_resource(stop_on_sigterm())  # kill, timeout, a scheduler's cancel: Ctrl-C's way out, exit 143
    ctx.with_resource(_set(VERBOSITY, -1 if quiet else 1 if verbose else 0))


@contextlib.contextmanager
def _set(variable: contextvars.ContextVar, value: object) -> Iterator[None]:
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


for command in (probe, size_command, show, report_command, limits_command, estimate_command, cost_command,
                train_command, data_group, tune_command):
    main.add_command(command)
