"""``vramcal size``: the batch size for a model on a device in one command (:func:`vramcal.service.size.size_for`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import click

from vramcal.cli.options import EXIT_UNVERIFIED, Unverified, device_options, limit_options, one_line
from vramcal.cli.probe import (
    ModelOptions,
    capacity_option,
    data_file_options,
    importable_from_cwd,
    model_options,
    model_params,
    stdout_to_stderr,
    trial_options,
)
from vramcal.records import TrialSettings
from vramcal.service.size import size_for
from vramcal.sizing import LIMITS, NoLimitsError
from vramcal.words import labelled


@click.command("size")
@device_options
@capacity_option
@model_options
@data_file_options
@limit_options
@trial_options
@click.option("--limit", type=click.Choice(LIMITS), default="conservative", show_default=True,
              help="which of the profile's limits to print")
@click.option("--profiles-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("profiles"),
              show_default=True, help="where the matching profile is looked for, and a calibration saved")
@click.option("--json", "as_json", is_flag=True, help="print the answer, its sizing and the profile's file as JSON")
@click.pass_context
def size_command(ctx: click.Context, gpu, capacity, implementation, model: ModelOptions, data: dict[str, Any],
                 settings, trials: TrialSettings, limit, profiles_dir, as_json) -> None:
    """Print the batch size for a model on this device, alone on stdout: from the matching profile when one holds
    (same model, device, budget and software), else calibrating first and saying why. A second call with nothing
    changed runs no trial. Exits 3 when the profile's limits are not verified, or it has none."""

    if len(model.seq_lens) > 1:
        raise click.BadParameter("a batch size is for one length: give one --seq-len", param_hint="--seq-len")
    with one_line("interrupted: no profile written, existing profiles are unchanged"), stdout_to_stderr(True):
        name, params, _ = model_params(model)
        importable_from_cwd(name)
        try:
            answered = size_for(name, params, gpu=gpu, capacity_bytes=capacity, implementation=implementation,
                                    options=data, profiles_dir=profiles_dir, settings=settings, trials=trials,
                                    limit=limit)
        except NoLimitsError as error:  # a profile without limits: exit 3 (README "Exit codes")
            raise Unverified(str(error)) from None
    s = answered.sizing
    # the files left out; the gate's (memory taken since the calibration), clamping, an unverified profile
    for notice in (*answered.left_out, *s.notices):
        click.echo(f"vramcal: {labelled(notice)}", err=True)
    click.echo(f"vramcal: batch_size {s.batch_size} ({s.label}; safe {s.safe_batch_size}, conservative "
               f"{s.conservative_batch_size}) {answered.reason}", err=True)
    if as_json:
        click.echo(json.dumps({"batch_size": s.batch_size, "calibrated": answered.calibrated, "reason": answered.reason,
                               "profile": str(answered.path), "verified": answered.profile.verified,
                               "sizing": dataclasses.asdict(s)}, indent=2, sort_keys=True))
    else:
        click.echo(s.batch_size)
    if not answered.profile.verified:
        ctx.exit(EXIT_UNVERIFIED)
