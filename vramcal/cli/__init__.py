"""The ``vramcal`` command line: every command is registered here, in one place.

Each command module is a thin click layer over :mod:`vramcal.api` and the library: it parses, calls,
prints. User-fixable failures are ``click.ClickException`` (exit 1, one line), bad values
``click.BadParameter`` (exit 2).
"""

from __future__ import annotations

import click

from vramcal import __version__
from vramcal.cli.cost import cost_command
from vramcal.cli.probe import probe, show
from vramcal.cli.report import limits_command, report_command
from vramcal.cli.train import data_group, train_command
from vramcal.cli.tune import tune_command
from vramcal.words import FLAGS, speaking


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vramcal")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Measure the memory of real Mamba-2 training steps and calibrate safe batch sizes."""
    ctx.with_resource(speaking(FLAGS))  # messages name the command line's flags (vramcal.words)


for command in (probe, show, report_command, limits_command, cost_command, train_command, data_group, tune_command):
    main.add_command(command)
