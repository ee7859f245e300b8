"""``vramcal train`` and ``vramcal data es-sample``: thin adapters over :mod:`vramcal.train` and the API.

Progress goes to stderr; the closing line to stdout. Failures end as one line (exit 1), bad values
exit 2, Ctrl-C exits 130 with the checkpoints on disk kept.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import click

from vramcal.cli.lm import announce_lm, check_lm, lm_options, lm_settings, saved_model
from vramcal.cli.options import (
    WorldOptions,
    check_local_ranks,
    explicit,
    group,
    one_line,
    strict_profiles,
    training_options,
    world_options,
)
from vramcal.cli.probe import calibrate_one, stdout_to_stderr
from vramcal.cli.types import BatchSize, FiniteFloat
from vramcal.measure.device import check_host_world
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.profile import ProfileError, load_profile
from vramcal.records import Kind
from vramcal.report import report_name, write_report
from vramcal.service.pool import select_devices, worker_pool
from vramcal.train import checkpoint, distributed
from vramcal.train.config import RESUME_OVERRIDES, ConfigError, TrainConfig, load_config, trains_documents
from vramcal.units import format_bytes
from vramcal.words import labelled

TORCHRUN_OPTIONS = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "master_addr",
                    "master_port", "max_restarts", "monitor_interval")
# world_options' settings: a resume given none of them keeps the run's own (distributed.launched_world)
WORLD_OPTIONS = {"strategy", "ddp_backend", "bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters",
                 "static_graph", "reshard_after_forward"}
torchrun_options = group(
    click.option("--nnodes", default=None, help="torchrun's: nodes of the DDP run (N or MIN:MAX)"),
    click.option("--node-rank", type=click.IntRange(0), default=None, help="torchrun's: this node's rank"),
    click.option("--rdzv-backend", default=None, help="torchrun's: rendezvous backend (c10d, static, ...)"),
    click.option("--rdzv-endpoint", default=None, help="torchrun's: rendezvous host:port"),
    click.option("--rdzv-id", default=None, help="torchrun's: the job's rendezvous id"),
    click.option("--rdzv-conf", default=None, help="torchrun's: more rendezvous settings (key=value,...)"),
    click.option("--master-addr", default=None, help="torchrun's: the static rendezvous' address"),
    click.option("--master-port", type=click.IntRange(1, 65535), default=None, help="torchrun's: its port"),
    click.option("--max-restarts", type=click.IntRange(0), default=None, help="torchrun's: restarts of the world"),
    click.option("--monitor-interval", type=FiniteFloat(0, min_open=True), default=None,
                 help="torchrun's: seconds between the agent's checks of the ranks"),
)


@click.group("data")
def data_group() -> None:
    """Build OHLCV bar files for the trainer."""


def _bar_length(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """``--bar`` checked as it is parsed (a bad option value, exit 2), by the check the bars' builder makes."""
    from vramcal.models.regressor.bars import DataError, bar_offset  # loads numpy: only when called

    try:
        bar_offset(value)
    except DataError as error:
        raise click.BadParameter(str(error).removeprefix("--bar "), ctx, param) from None
    return value


@data_group.command("es-sample")
@click.option("--bar", default="1s", show_default=True, callback=_bar_length,
              help="bar length, a pandas offset: 1s, 5s, 1min, ...")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("data/es_1s.parquet"),
              show_default=True)
@click.option("--ticks", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="a tick CSV (DateTime, Price, Volume); default: the E-mini S&P 500 sample inside mlfinpy")
def es_sample_command(bar: str, out: Path, ticks: Path | None) -> None:
    """OHLCV bars from real E-mini S&P 500 futures ticks (September 2013, ~500,000 trades)."""
    from vramcal.models.regressor.bars import es_sample, few_bars_notice  # loads numpy: only when called

    with one_line():
        bars = es_sample(bar, out, ticks)
    notice = few_bars_notice(len(bars), bar, RegressorSpec().seq_len)
    if notice:
        click.echo(f"warning: {notice}", err=True)
    click.echo(f"{len(bars)} bars of {bar} from {bars['timestamp'].iloc[0]} to {bars['timestamp'].iloc[-1]} -> {out}")


@click.command("train")
@training_options
@lm_options
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="run folder [default: runs/<UTC time>]")
@click.option("--resume", is_flag=True, help="continue the run in --run-dir from its last checkpoint with its saved "
              "settings; a new --epochs or --max-steps stretches (or shortens) the cosine LR decay to the new "
              "total from the current step, keeping the warm-up; a new --lr or --max-grad-norm applies from "
              "there (after a divergence or a NaN)")
@click.option("--probe", is_flag=True, help="calibrate this device and model first (on this data), then train")
@click.option("--effective-batch-size", type=click.IntRange(1), default=None,
              help="samples per optimizer step to keep: the largest micro-batch the profile allows (--batch-size, "
                   "or its limit) and the gradient accumulation steps that reach it; the LR scales with it")
@click.option("--batch-size", type=BatchSize(), default="auto", show_default=True,
              help="auto = the profile's conservative batch size; N is clamped to [--batch-size-min, safe] (with no "
                   "profile: N as it is, unchecked against memory)")
@click.option("--val-batch-size", type=click.IntRange(1), default=None,
              help="samples per validation chunk [default: the profile's evaluation limit (vramcal probe --eval), "
                   "else the training batch]; above the evaluation limit the run is warned")
@click.option("--lr", type=FiniteFloat(0, min_open=True), default=5e-5, show_default=True,
              help="peak learning rate at --reference-batch-size")
@click.option("--weight-decay", type=FiniteFloat(0), default=0.01, show_default=True)
@click.option("--max-grad-norm", type=FiniteFloat(0, min_open=True), default=1.0, show_default=True)
@click.option("--epochs", type=click.IntRange(1), default=10, show_default=True)
@click.option("--nproc-per-node", type=click.IntRange(1), default=1, show_default=True,
              help="ranks on this machine (DDP, or FSDP with --strategy fsdp), started by torch.distributed's "
                   "launcher (torchrun's agent); each rank sized by its own device's profile for the world (vramcal "
                   "probe --nproc)")
@torchrun_options
@world_options
@click.option("--json", "as_json", is_flag=True, help="at the end, print the run folder, batch size and its sizing, "
              "steps, last val_loss, measured and predicted peak and the files as JSON on stdout (the rest on stderr)")
@click.pass_context
def train_command(ctx: click.Context, config_file: str | None, run_dir: Path | None, resume: bool, probe: bool,
                  capacity: tuple[int, ...] | None, nproc_per_node: int, parallel: WorldOptions, as_json: bool,
                  **options: Any) -> None:
    """Train the calibrated Mamba-2 model on OHLCV bars with the profile's batch size.

    After the first epoch and at the end it prints its measured peak beside the profile's prediction,
    and records the run in the profile (`vramcal show` lists them). Its epochs go to metrics.jsonl and to
    TensorBoard (`tensorboard --logdir <run folder>`).
    """
    from vramcal.train.runner import train  # loads numpy: only when called

    given = explicit(ctx)
    strict_profiles(options.pop("strict_profile"))
    torchrun = {name: options.pop(name) for name in TORCHRUN_OPTIONS}
    lm_settings(options, given)
    config = None
    if not resume:
        with one_line():  # a config file's error is one line here too
            config = make_config(config_file, options, given)
            check_lm(config, given, nproc_per_node, torchrun)
    if resume and "nproc_per_node" not in given and not any(torchrun.values()):
        with one_line():  # the world the run folder was launched with (one process when it holds none)
            nproc_per_node, launched = distributed.launched_ranks(resume_dir(run_dir))
            torchrun.update(launched)
    if nproc_per_node > 1 or any(torchrun.values()):
        with stdout_to_stderr(as_json):
            run_dir = train_world(ctx, config_file, options, given, run_dir, resume, probe, capacity or (),
                                  nproc_per_node, {k: v for k, v in torchrun.items() if v is not None}, parallel)
        echo_done(run_dir, as_json)
        return
    capacity = single_capacity(capacity, parallel)
    with one_line(), stdout_to_stderr(as_json):  # --json: what the worker server's processes print goes to stderr
        worker_pool().warm_up()  # the training worker's server imports torch while the run is planned
        plan = resume_plan(run_dir, options, given) if resume else new_plan(config, probe, capacity, run_dir)
        (announce_lm if plan.config.documents else announce)(plan)
    with one_line(lambda: interrupted_line(plan.run_dir)), stdout_to_stderr(as_json):
        train(plan, echo=lambda line: click.echo(line, err=True))
    refresh_report(plan.profile_path)
    echo_done(plan.run_dir, as_json)


def refresh_report(profile_path: str | None, reports_dir: Path = Path("reports")) -> None:
    """Rewrite the report `vramcal probe` wrote of the run's profile in ``reports_dir`` (its default), now holding
    the run the profile recorded: its peak and its time against their forecasts, and its windows as the epoch the
    report forecasts (a report made at probe time never shows the run, and forecasts the calibration's windows).
    Nothing where there is no such report (``--no-report``, another ``--reports-dir``: `vramcal report` makes one);
    a report that cannot be written is a warning."""
    if profile_path is None:
        return
    try:
        profile = load_profile(profile_path)
        if (reports_dir / f"{report_name([profile])}.md").exists():
            png, markdown = write_report([profile], reports_dir)
            click.echo(f"report: {markdown} and {png}, with this run", err=True)
    except (OSError, ProfileError) as error:
        click.echo(f"warning: the report of {profile_path} was not brought up to date ({error})", err=True)


def new_plan(config: TrainConfig, probe: bool, capacity: int | None, run_dir: Path | None):
    """A new run's plan (``--probe``: calibrated first): the regressor's (:mod:`vramcal.train.plan`, unchecked
    without a profile when --batch-size is given) or a language model's (:mod:`vramcal.train.lm_plan`)."""
    from vramcal.train import lm_plan  # loads numpy: only when called
    from vramcal.train import plan as planning  # loads numpy: only when called

    if probe:
        config = probe_first(config, capacity)
    run_dir = run_dir or new_run_dir()
    if config.documents:
        return lm_plan.plan_run(config, run_dir, lm_plan.resolve(config, capacity))
    return planning.plan_run(config, run_dir, planning.resolve(config, capacity, unchecked=True))


def single_capacity(capacity: tuple[int, ...] | None, parallel: WorldOptions) -> int | None:
    """The one ``--capacity`` of a single-process run.

    Raises:
        click.BadParameter: several budgets, or DDP options, without ``--nproc-per-node``.
    """
    parallel.world(1, Kind.HOST, "--nproc-per-node")  # refuses world options: one process has no world settings
    if capacity and len(capacity) > 1:
        raise click.BadParameter("several budgets are for the ranks of a DDP run: add --nproc-per-node N",
                                 param_hint="--capacity")
    return capacity[0] if capacity else None


def train_world(ctx, config_file, options, given, run_dir, resume, probe, capacities, nproc_per_node, torchrun,
                parallel):
    """``--nproc-per-node``: the run's ranks through torchrun's agent (:mod:`vramcal.train.distributed`); returns
    the run folder."""
    from vramcal.train.plan import load_windows  # loads numpy: only when called

    nodes = node_count(torchrun.get("nnodes", 1))
    if nproc_per_node * nodes < 2:
        flag = "--" + next(iter(torchrun)).replace("_", "-")
        raise click.BadParameter("is torchrun's, for a DDP run of 2 or more ranks: add --nproc-per-node N (and "
                                 "--nnodes for several machines), or leave it out for one process", param_hint=flag)
    check_local_ranks(nproc_per_node, "--nproc-per-node", kind_here(options.get("gpu")), parallel.oversubscribe)
    with one_line():
        if probe:
            raise click.BadParameter("--probe calibrates one process: calibrate the world first with "
                                     "`vramcal probe --nproc N`", param_hint="--probe")
        if options.get("effective_batch_size") is not None:
            raise click.BadParameter("is for one process: under DDP each rank trains at its own batch size and the "
                                     "global batch is their sum", param_hint="--effective-batch-size")
        if len(capacities) not in (0, 1, nproc_per_node):
            raise click.BadParameter(f"give one budget, or one per local rank ({nproc_per_node})",
                                     param_hint="--capacity")
        if resume:
            run_dir = checkpoint.prepare_run_dir(resume_dir(run_dir), resume=True)
            config = load_config(run_dir / checkpoint.CONFIG)
            capacities = capacities or distributed.launched_capacities(run_dir)  # the budgets it was started with
        else:
            config = make_config(config_file, options, given)
        kind = kind_here(config.gpu)
        if capacities and kind.budgeted:  # no budget given: each rank's profile's, checked when its world was probed
            check_host_world(list(capacities) if len(capacities) > 1 else [capacities[0]] * nproc_per_node)
        if not resume:
            load_windows(config)  # the data checked before any rank starts
            run_dir = checkpoint.prepare_run_dir(run_dir or new_run_dir(), resume=False)
        world = parallel.world(nproc_per_node * nodes, kind)
        if resume:
            world = resumed_world(run_dir, world, given)
        click.echo(f"training {world.describe()} in {run_dir}", err=True)
    overrides = {k: options[k] for k in RESUME_OVERRIDES if resume and k in given}
    with one_line(lambda: interrupted_line(run_dir, f" --nproc-per-node {nproc_per_node}")):
        try:
            distributed.launch(config, run_dir, world, nproc_per_node, torchrun, capacities, resume, overrides)
        finally:
            checkpoint.release_run_dir(run_dir)
    return run_dir


def resumed_world(run_dir: Path, world, given: set[str]):
    """The world a resume trains: the one the run was started with (its strategy and settings,
    :func:`vramcal.train.distributed.launched_world`) unless world options are given.

    Raises:
        click.BadParameter: ``--strategy`` other than the run's (its checkpoints hold the state that way).
    """
    launched = distributed.launched_world(run_dir, world)
    if not given & WORLD_OPTIONS:
        return launched
    if launched.strategy != world.strategy and "fsdp" in (launched.strategy, world.strategy):
        raise click.BadParameter(f"this run was started with --strategy {launched.strategy} and its checkpoints "
                                 f"hold its state that way: resume it without --strategy (or with --strategy "
                                 f"{launched.strategy})", param_hint="--strategy")
    return world


def interrupted_line(run_dir: Path, flags: str = "") -> str:
    """What an interrupted run left, read from its folder when the interrupt comes: its checkpoints and the command
    that continues from them (``flags``: a DDP run's), or that nothing was saved (stopped before its first
    checkpoint, ``--resume`` would find nothing)."""
    if checkpoint.has_checkpoint(run_dir):
        return (f"interrupted: the checkpoints in {run_dir} are kept; continue with `vramcal train --resume --run-dir "
                f"{run_dir}{flags}`")
    return (f"interrupted before the first checkpoint: nothing was saved; run the command again (the same --run-dir "
            f"{run_dir} can be used)")


def node_count(nnodes: object) -> int:
    """The most nodes ``--nnodes`` allows (``N`` or torchrun's ``MIN:MAX``).

    Raises:
        click.BadParameter: anything else, naming the option.
    """
    text = str(nnodes).strip()
    parts = text.split(":")
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise click.BadParameter(f"{text!r} is not a number of nodes: give N or MIN:MAX (whole numbers >= 1)",
                                 param_hint="--nnodes")
    return int(parts[-1])


def kind_here(gpu: str | None) -> Kind:
    """The kind of device a run given ``gpu`` (``--gpu``) trains on here: the host for ``none``, else a visible
    NVIDIA GPU's where there is one (the default backend follows it)."""
    return Kind.HOST if gpu == "none" else select_devices("auto")[0][0].kind


def new_run_dir() -> Path:
    return Path("runs") / dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")


def echo_done(run_dir: Path, as_json: bool = False) -> None:
    """The closing line, from what the run (a DDP run's rank 0) wrote in its folder; with ``--json`` it goes to
    stderr and :func:`vramcal.train.runner.run_summary` to stdout."""
    from vramcal.train.runner import run_summary  # loads numpy: only when called

    with one_line():
        done = run_summary(run_dir)
    if done["val_loss"] is not None:
        steps = done["steps"]
        baseline = "uniform" if trains_documents(done.get("model", "")) else "zero-return"
        click.echo(f"done: {steps} step{'' if steps == 1 else 's'}, val_loss {done['val_loss']:.4f} ({baseline} "
                   f"{done['val_zero_loss']:.4f}), metrics {done['metrics']}, checkpoint {done['checkpoint']}, "
                   f"TensorBoard {done['tensorboard']}", err=as_json)
    if as_json:
        click.echo(json.dumps(done, indent=2, sort_keys=True))


def make_config(config_file: str | None, options: dict[str, Any], given: set[str]):
    """Defaults < config file < options given on the command line.

    Raises:
        ConfigError: the config file is unusable (exit 1). click.BadParameter: an option value the
            config refuses (exit 2).
    """

    base = None if config_file is None else load_config(config_file)
    try:
        config = (TrainConfig.from_dict(options) if base is None
                  else base.replace(**{k: v for k, v in options.items() if k in given}))
    except ConfigError as error:
        raise click.BadParameter(str(error)) from None
    except ValueError as error:  # the spec, made again by replace (RegressorSpec checks itself when made)
        raise click.BadParameter(str(error), param_hint="model spec") from None
    return config


def resume_dir(run_dir: Path | None) -> Path:
    """Raises: click.BadParameter when ``--resume`` has no ``--run-dir``."""
    if run_dir is None:
        raise click.BadParameter("--resume needs the --run-dir of the run to continue", param_hint="--resume")
    return run_dir


def resume_plan(run_dir: Path | None, options: dict[str, Any], given: set[str]):
    from vramcal.train.plan import plan_resume  # loads numpy: only when called

    run_dir = resume_dir(run_dir)
    ignored = sorted(given - {*RESUME_OVERRIDES, "run_dir", "resume"})
    if ignored:
        click.echo(f"--resume continues with the run's saved settings; ignoring "
                   f"{', '.join('--' + o.replace('_', '-') for o in ignored)}", err=True)
    overrides = {k: options[k] for k in RESUME_OVERRIDES if k in given}
    if trains_documents(saved_model(run_dir)):
        from vramcal.train import lm_plan  # loads numpy: only when called

        return lm_plan.plan_resume(run_dir, overrides)
    return plan_resume(run_dir, overrides)


def probe_first(config, capacity: int | None):
    """``--probe``: calibrate this run's model on its device over its data, as ``vramcal probe`` does
    (printing to stderr), and size the run from the profile it wrote."""
    from vramcal.train.plan import calibration_plan  # loads numpy: only when called

    plan = calibration_plan(config, capacity)
    calibrate_one(plan, err=True)
    return config.replace(profile=str(plan.path))


def announce(plan) -> None:
    """What the run is about to do, on stderr: notices, model, batch size and its prediction, data (its gaps, its
    features without spread)."""
    from vramcal.models.regressor.windows import data_notices  # loads numpy: only when called

    config, stats = plan.config, plan.data_stats
    for notice in plan.notices:
        click.echo(labelled(notice), err=True)  # information as it is, warnings marked (vramcal.words)
    verb = "resuming" if plan.resume else "training"
    click.echo(f"{verb}: {config.spec.short()} [{plan.implementation}] on {plan.device.name}", err=True)
    click.echo(f"batch_size {plan.batch_size}{batch_origin(plan)}, lr {plan.lr:.3g} ({config.lr_scaling} scaling "
               f"from {config.lr:.3g} at batch {config.reference_batch_size})", err=True)
    if plan.validation is not None:
        predicted = plan.validation.predicted_at(plan.validation.batch_size)
        click.echo(f"validation batch_size {plan.validation.batch_size} ({plan.validation.source}"
                   + (f", predicted peak {format_bytes(predicted)})" if predicted else ")"), err=True)
    click.echo(f"data: {stats['rows']} rows, {stats['train_windows']} training and {stats['val_windows']} validation "
               f"windows of {stats['seq_len']} bars (stride {stats['stride']}), validation from "
               f"{stats['first_val_timestamp']}; run folder {plan.run_dir}", err=True)
    for line in data_notices(stats):
        click.echo(line, err=True)


def batch_origin(plan) -> str:
    """What follows the batch size in :func:`announce`: its accumulation, where it came from and its prediction
    (`` (conservative; profile P, predicted peak 1.20 GiB, upper bound 1.25 GiB)``), or that it is unchecked."""
    sizing = plan.sizing
    if sizing is None:
        steps = f" accumulated to {plan.step_batch_size} per optimizer step" * (plan.step_batch_size > plan.batch_size)
        return f"{steps} (unchecked: no profile)"
    accumulated = ""
    if sizing.accumulation_steps > 1:  # the fewest micro-batches within the limit, evened out (sizing.accumulation)
        last = sizing.effective_batch_size - sizing.batch_size * (sizing.accumulation_steps - 1)
        accumulated = (f" x {sizing.accumulation_steps} accumulated = {sizing.effective_batch_size} per optimizer step"
                       + (f" (the last micro-batch {last})" if last != sizing.batch_size else ""))
    return (f"{accumulated} ({sizing.label}; profile {plan.profile_path}, predicted peak "
            f"{format_bytes(sizing.predicted_peak_bytes)}, warned above {format_bytes(sizing.line_bytes)})")
