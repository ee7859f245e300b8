"""``vramcal train --model lm``: the language model's options, their checks, and what the run says before it
starts (:mod:`vramcal.train.lm_plan` plans it; the trainer's runner runs it as it runs the regressor's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from vramcal.cli.options import group
from vramcal.cli.types import Buckets, KeyValue
from vramcal.train.checkpoint import CONFIG
from vramcal.train.config import BATCHINGS, MODELS, trains_documents
from vramcal.units import format_bytes
from vramcal.words import labelled

lm_options = group(
    click.option("--model", type=click.Choice(MODELS), default="regressor", show_default=True,
                 help="regressor: the spec on OHLCV bars (--data); lm: a Mamba-2 language model (--model-arg "
                      "config=FILE) on real text (--text), sized by a profile over several lengths"),
    click.option("--model-arg", "model_args", type=KeyValue(), multiple=True,
                 help="config=<Mamba2Config JSON> for --model lm"),
    click.option("--text", default="stdlib", show_default=True,
                 help="--model lm's documents: a folder of *.py and *.txt files, or stdlib (the standard library's "
                      "own modules); one document per definition, longer ones cut at the profile's longest seq_len"),
    click.option("--batching", type=click.Choice(BATCHINGS), default="budget", show_default=True,
                 help="--model lm's batches: budget (the profile's token budget) or buckets (its bucket table)"),
    click.option("--buckets", type=Buckets(), default="auto", show_default=True,
                 help="with --batching buckets: each bucket's longest length (128,256,512,1024), or auto (the "
                      "calibration's)"),
)

# options of the regressor's run that a language model's does not take (its batches follow the profile's lengths)
REGRESSOR_ONLY = ("batch_size", "effective_batch_size", "val_batch_size", "size_for", "variant", "stride", "data",
                  "data_on_device", "probe", "d_model", "n_layers", "d_state", "headdim", "expand", "chunk_size",
                  "seq_len", "checkpointing", "lr_scaling", "reference_batch_size")


def lm_settings(options: dict[str, Any], given: set[str]) -> None:
    """``--model-arg config=FILE`` as the config's ``lm_config`` (in ``options``, and ``given`` when given).

    Raises:
        click.BadParameter: a model argument other than config=, or one for the regressor.
    """
    arguments = dict(options.pop("model_args"))
    unknown = sorted(set(arguments) - {"config"})
    if unknown or (arguments and not trains_documents(options["model"])):
        what = f"--model-arg {unknown[0]}" if unknown else "--model-arg"
        raise click.BadParameter(f"{what} is not a setting of vramcal train: --model lm takes config=<Mamba2Config "
                                 f"JSON>, the regressor its spec options (--d-model, ...)", param_hint="--model-arg")
    if "config" in arguments:
        options["lm_config"] = str(arguments["config"])
        given.add("lm_config")
    given.discard("model_args")


def check_lm(config: Any, given: set[str], nproc_per_node: int, torchrun: dict[str, Any]) -> None:
    """Refuse what a language model's run does not take, and lm options for the regressor.

    Raises:
        click.BadParameter: one line naming the option.
    """
    if not config.documents:
        stray = [name for name in ("text", "batching", "buckets") if name in given]
        if stray:
            raise click.BadParameter("applies to --model lm", param_hint=f"--{stray[0]}")
        return
    stray = [name for name in REGRESSOR_ONLY if name in given]
    if stray:
        raise click.BadParameter("does not apply to --model lm: its batches and lengths follow the profile's token "
                                 "budget or bucket table (--batching) and its learning rate is --lr as given",
                                 param_hint=f"--{stray[0].replace('_', '-')}")
    if nproc_per_node > 1 or any(v is not None for v in torchrun.values()):
        raise click.BadParameter("--model lm trains in one process (DDP is the regressor's)",
                                 param_hint="--nproc-per-node")
    if config.buckets and config.batching != "buckets":
        raise click.BadParameter("is for --batching buckets", param_hint="--buckets")


def saved_model(run_dir: Path) -> str:
    """The model a run folder's saved config trains (``regressor`` where it cannot be read: its resume says why)."""
    try:
        return str(json.loads((Path(run_dir) / CONFIG).read_text()).get("model", "regressor"))
    except (OSError, ValueError, AttributeError):
        return "regressor"


def announce_lm(plan: Any) -> None:
    """What a language model's run is about to do, on stderr: its model, batching, worst batch and its prediction,
    and its text."""
    for notice in plan.notices:
        click.echo(labelled(notice), err=True)
    stats, sizing = plan.data_stats, plan.sizing
    verb = "resuming" if plan.resume else "training"
    click.echo(f"{verb}: lm {Path(str(plan.config.lm_config)).name} [{plan.implementation}] on {plan.device.name}, "
               f"lr {plan.lr:.3g}", err=True)
    by = ("the token budget ({:,} tokens)".format(stats["batching"]["budget"]["conservative_tokens"])
          if stats["batching"]["mode"] == "budget" else f"the bucket table ({len(stats['batching']['buckets'])} "
                                                        f"buckets)")
    click.echo(f"batches by {by}: {stats['train_batches']} per epoch; the worst, {stats['worst']['batch_size']} "
               f"documents padded to {stats['worst']['seq_len']} tokens: predicted peak "
               f"{format_bytes(sizing.predicted_peak_bytes)}, warned above {format_bytes(sizing.line_bytes)} (profile "
               f"{plan.profile_path})", err=True)
    click.echo(f"text: {stats['files']} files of {stats['text']} ({stats['root']}), {stats['documents']} documents, "
               f"{stats['train_windows']} training and {stats['val_windows']} validation ({stats['val_files']} files "
               f"by path hash), {stats['train_tokens']:,} and {stats['val_tokens']:,} tokens; run folder "
               f"{plan.run_dir}", err=True)
