"""``vramcal train`` and ``vramcal data es-sample``: thin click commands over :mod:`vramcal.train`.

Every user-fixable failure (bad data, no profile, unusable run folder, non-finite loss) ends as one
line and exit status 1 (``click.ClickException``); bad option values exit 2.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import click
from click.core import ParameterSource

from vramcal.cli.options import ByteSize, spec_options
from vramcal.model import IMPLEMENTATIONS, ModelSpec
from vramcal.train.config import LR_SCALINGS, SEED_BATCH_SIZE, ConfigError, TrainConfig, load_config
from vramcal.units import format_bytes

_SPEC_NAMES = ("d_model", "n_layers", "d_state", "headdim", "expand", "chunk_size", "seq_len", "dtype")


class _BatchSize(click.ParamType):
    """``auto`` (None) or a positive integer."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int) or str(value).lower() == "auto":
            return None if value is None or str(value).lower() == "auto" else value
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither auto nor an integer", param, ctx)
        if number < 1:
            self.fail(f"{number} is not >= 1", param, ctx)
        return number


@click.group("data")
def data_group() -> None:
    """Build OHLCV bar files for the trainer."""


@data_group.command("es-sample")
@click.option("--bar", default="1s", show_default=True, help="bar length, a pandas offset: 1s, 5s, 1min, ...")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("data/es_1s.parquet"),
              show_default=True)
@click.option("--ticks", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="a tick CSV (DateTime, Price, Volume); default: the E-mini S&P 500 sample inside mlfinpy")
def es_sample_command(bar: str, out: Path, ticks: Path | None) -> None:
    """OHLCV bars from real E-mini S&P 500 futures ticks (September 2013, ~500,000 trades)."""
    from vramcal.train.data import DataError, es_sample, few_bars_notice

    try:
        bars = es_sample(bar, out, ticks)
    except DataError as error:
        raise click.ClickException(str(error)) from None
    first, last = bars["timestamp"].iloc[0], bars["timestamp"].iloc[-1]
    notice = few_bars_notice(len(bars), bar)
    if notice:
        click.echo(f"warning: {notice}", err=True)
    click.echo(f"{len(bars)} bars of {bar} from {first} to {last} -> {out}")


@click.command("train")
@click.option("--data", "data", type=click.Path(dir_okay=False), default="data/es_1s.parquet", show_default=True,
              help="OHLCV parquet: timestamp, open, high, low, close, volume")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="JSON or TOML file of settings (option names with underscores); options given here win")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="run folder [default: runs/<UTC time>]")
@click.option("--resume", is_flag=True, help="continue the run in --run-dir from its last checkpoint with its saved "
              "settings; a new --epochs or --max-steps stretches (or shortens) the cosine LR decay to the new "
              "total from the current step, keeping the warm-up")
@click.option("--gpu", default="auto", show_default=True, help="auto | none (the host) | an NVML index | a UUID")
@click.option("--impl", "implementation", type=click.Choice(IMPLEMENTATIONS), default="auto", show_default=True)
@spec_options
@click.option("--profile", default="auto", show_default=True, help="auto (look in --profiles-dir) or a file")
@click.option("--profiles-dir", type=click.Path(file_okay=False), default="profiles", show_default=True)
@click.option("--probe", is_flag=True, help="calibrate this device and model first, then train with the result")
@click.option("--capacity", type=ByteSize(), default=None, help="memory budget for --probe, e.g. 12GiB")
@click.option("--batch-size", type=_BatchSize(), default="auto", show_default=True,
              help="auto = the profile's conservative batch size; N is clamped to [--batch-size-min, safe]")
@click.option("--batch-size-min", type=click.IntRange(1), default=1, show_default=True)
@click.option("--lr", type=click.FloatRange(0, min_open=True), default=5e-5, show_default=True,
              help="peak learning rate at --reference-batch-size")
@click.option("--lr-scaling", type=click.Choice(LR_SCALINGS), default="sqrt", show_default=True)
@click.option("--reference-batch-size", type=click.IntRange(1), default=SEED_BATCH_SIZE, show_default=True)
@click.option("--weight-decay", type=click.FloatRange(0), default=0.01, show_default=True)
@click.option("--max-grad-norm", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True)
@click.option("--warmup-steps", type=click.IntRange(0), default=None, help="[default: 5 % of the steps]")
@click.option("--epochs", type=click.IntRange(1), default=10, show_default=True)
@click.option("--max-steps", type=click.IntRange(1), default=None, help="stop after this many optimizer steps")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--stride", type=click.IntRange(1), default=None, help="bars between windows [default: seq_len // 2]")
@click.option("--val-fraction", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.2,
              show_default=True, help="the last fraction of rows, for validation")
@click.pass_context
def train_command(ctx: click.Context, config_file: Path | None, run_dir: Path | None, resume: bool, probe: bool,
                  capacity: int | None, **options) -> None:
    """Train the calibrated Mamba-2 model on OHLCV bars with the profile's batch size."""
    from vramcal.train import loop
    from vramcal.train import plan as planning

    explicit = {name: value for name, value in options.items()
                if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)}
    try:
        if resume:
            if run_dir is None:
                raise click.BadParameter("--resume needs the --run-dir of the run to continue", param_hint="--resume")
            ignored = sorted(set(explicit) - {"epochs", "max_steps"})
            if ignored:
                click.echo(f"--resume continues with the run's saved settings; ignoring {', '.join(ignored)}",
                           err=True)
            the_plan, state = planning.plan_resume(run_dir, {k: explicit[k] for k in ("epochs", "max_steps")
                                                             if k in explicit})
        else:
            config = _config(config_file, options, explicit)
            try:
                config.spec.validate()
            except ValueError as error:
                raise click.BadParameter(str(error), param_hint="model spec") from None
            run_dir = run_dir or Path("runs") / dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
            the_plan = planning.plan_run(config, run_dir, probe=_probe(config.profiles_dir) if probe else None,
                                         capacity_bytes=capacity)
            state = None
        for notice in the_plan.notices:
            click.echo(f"warning: {notice}" if notice.startswith("--batch-size") else notice, err=True)
        _announce(the_plan, state)
        last = loop.start(the_plan, echo=lambda line: click.echo(line, err=True), state=state)
    except click.ClickException:
        raise
    except (ValueError, loop.TrainError) as error:  # DataError, SizingError, RunDirError, ConfigError, ...
        raise click.ClickException(str(error)) from None
    except Exception as error:
        from vramcal.measure.device import NvmlError

        if isinstance(error, NvmlError):
            raise click.ClickException(str(error)) from None
        raise
    if last:
        steps = f"{last['step']} step{'' if last['step'] == 1 else 's'}"
        click.echo(f"done: {steps}, val_loss {last['val_loss']:.4f} (zero-return "
                   f"{last['val_zero_loss']:.4f}), metrics {the_plan.run_dir / 'metrics.jsonl'}, "
                   f"checkpoint {the_plan.run_dir / 'checkpoint-last.pt'}")


def _config(config_file: Path | None, options: dict, explicit: dict) -> TrainConfig:
    """Defaults < config file < options given on the command line.

    Raises:
        ConfigError: the config file is unusable (exit 1). click.BadParameter: an option value the
            config refuses, such as a non-finite --lr (exit 2).
    """
    base = None if config_file is None else load_config(config_file)
    try:
        return TrainConfig.from_dict(options) if base is None else base.replace(**explicit)
    except ConfigError as error:
        raise click.BadParameter(str(error)) from None


def _probe(profiles_dir: str):
    """A probe function for :func:`vramcal.train.plan.plan_run`: calibrate, save, print the summary."""

    def run(device, spec: ModelSpec, implementation: str) -> Path:
        from vramcal.calibrate.limits import LimitSettings
        from vramcal.calibrate.probe import CalibrationError, calibrate
        from vramcal.cli.console import TrialPrinter, summary
        from vramcal.profile import profile_path, save_profile

        settings = LimitSettings()
        click.echo(f"calibrating {spec.short()} [{implementation}] on {device.name}, "
                   f"{format_bytes(device.total_bytes)}", err=True)
        try:
            profile = calibrate(device, spec, implementation, settings, on_trial=TrialPrinter(16))
        except CalibrationError as error:
            raise ConfigError(str(error)) from None
        path = save_profile(profile, profile_path(Path(profiles_dir), device, spec, implementation))
        click.echo(summary(profile), err=True)
        click.echo(f"profile: {path}", err=True)
        return path

    return run


def _announce(the_plan, state) -> None:
    batch = the_plan.batch
    windows = the_plan.windows
    verb = f"resuming at step {state['progress']['step']}" if state else "training"
    click.echo(f"{verb}: {the_plan.config.spec.short()} [{the_plan.implementation}] on {the_plan.device.name}",
               err=True)
    predicted = format_bytes(batch.predicted_peak_bytes)
    click.echo(f"batch_size {batch.batch_size} ({batch.source}; profile {the_plan.profile_path}, predicted peak "
               f"{predicted}), lr {the_plan.lr:.3g} ({the_plan.config.lr_scaling} scaling from "
               f"{the_plan.config.lr:g} at batch {the_plan.config.reference_batch_size})", err=True)
    click.echo(f"data: {len(windows.targets)} rows, {len(windows.train_starts)} training and "
               f"{len(windows.val_starts)} validation windows of {windows.seq_len} bars (stride {windows.stride}), "
               f"validation from {windows.first_val_timestamp}; run folder {the_plan.run_dir}", err=True)

