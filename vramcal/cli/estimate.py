"""``vramcal estimate``: a model's batch sizes on cards you do not have, estimated without a GPU
(:mod:`vramcal.estimate.learned`), with the error bound learned from the profiles you have."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from vramcal.cli.console import estimate_lines
from vramcal.cli.options import limit_options, one_line
from vramcal.cli.probe import ModelOptions, data_file_options, model_options, model_params
from vramcal.cli.types import ByteSize, GpuList
from vramcal.estimate.learned import ANY_GPU, estimate_cards
from vramcal.models import registry
from vramcal.models.registry import model_ref
from vramcal.report.catalogue import cards_for
from vramcal.service.pool import select_devices


@click.command("estimate")
@model_options
@data_file_options
@click.option("--gpus", type=GpuList(), default=None,
              help='cards: catalogued names ("H200,RTX 4090") or NAME=SIZE [default: the whole catalogue]')
@click.option("--capacity", type=ByteSize(min_bytes=2**20), default=None,
              help="also this host at this memory budget, e.g. 2.5GiB")
@click.option("--impl", "paths", type=click.Choice(["both", "transformers", "mamba_ssm"]), default="both",
              show_default=True, help="the cards' kernel path: transformers' PyTorch chunked scan, mamba_ssm's fused "
                                      "kernels, or a row of each (labelled, the one this install runs named)")
@click.option("--batch-size", type=click.IntRange(1), default=None,
              help="also each row's predicted peak at this batch size (allocated and reserved, the CUDA context and "
                   "the data apart) and whether it fits")
@limit_options
@click.option("--profiles-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("profiles"),
              show_default=True, help="the calibrations the baseline and the error bound are learned from")
@click.option("--json", "as_json", is_flag=True, help="print the estimate as JSON for programs")
def estimate_command(model: ModelOptions, data: dict[str, Any], gpus, capacity, paths, batch_size, settings,
                     profiles_dir, as_json) -> None:
    """Estimate safe and conservative batch sizes on cards you do not have: the training step traced on fake
    tensors as each card runs it (no GPU, seconds), for both kernel paths, plus a baseline and an error bound learned
    from your profiles. With --batch-size, each card's predicted peak there. Never verified: `vramcal probe` on the
    card measures."""

    if len(model.seq_lens) > 1:
        raise click.BadParameter("an estimate is of one length: give one --seq-len", param_hint="--seq-len")
    on_gpus = model.spec["dtype"] != "fp32"  # bf16 autocast: a GPU's step, traced with the CPU's autocast
    if on_gpus and capacity is not None:
        raise click.BadParameter(f"the host trains in fp32, not {model.spec['dtype']}: estimate the host apart with "
                                 f"--dtype fp32", param_hint="--capacity")
    with one_line():
        name, params, _ = model_params(model)
        host, _ = select_devices("none", capacity)
        ref = model_ref(name, params, device=ANY_GPU if on_gpus else host[0], implementation="transformers")
        data = registry.family_of(ref).data_options(data)  # those that apply to the model
        refs = None if paths == "both" or ref.params.get("implementation") is None else [
            ref.replace(implementation=paths)]
        found = estimate_cards(ref, data, cards=cards_for(gpus), host=host[0] if capacity is not None else None,
                               settings=settings, profiles_dir=profiles_dir, batch_size=batch_size, refs=refs)
    if as_json:
        click.echo(json.dumps(found.to_dict(), indent=2, sort_keys=True))
        return
    for line in estimate_lines(found):
        click.echo(line)
