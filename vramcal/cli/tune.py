"""``vramcal tune``: a thin click command over :mod:`vramcal.tune.study`.

Options shared
with ``vramcal train`` have the same names and defaults. Progress goes to stderr, the trials table and
the result files to stdout. User-fixable failures end as one line, exit 1; bad values exit 2.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import click
from click.core import ParameterSource

from vramcal.cli.options import spec_options
from vramcal.model import IMPLEMENTATIONS
from vramcal.train.config import LR_SCALINGS, SEED_BATCH_SIZE, TrainConfig, load_config

# Settings of the base config that a tune searches (the config's own values are replaced per trial).
_SEARCHED = ("lr", "batch_size", "weight_decay", "max_grad_norm")
_PER_CALL = ("trials",)  # options that a --resume or a joining worker may change


def _range(name: str, default: tuple[float, float], help_text: str):
    return click.option(name, type=(float, float), default=default, show_default=True, metavar="LOW HIGH",
                        help=help_text)


@click.command("tune")
@click.option("--data", "data", type=click.Path(dir_okay=False), default="data/es_1s.parquet", show_default=True,
              help="OHLCV parquet: timestamp, open, high, low, close, volume")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="JSON or TOML file of fixed training settings; options given here win")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="tune folder: study.db, trials/<nnnn>/ (trials/0000/, ...), trials.md, best-config.json, tune.png "
                   "[default: runs/tune-<UTC time>]")
@click.option("--resume", is_flag=True, help="continue the study in --run-dir (or --storage/--study-name)")
@click.option("--storage", default=None, help="optuna storage URL (sqlite:///..., postgresql://...) "
              "[default: sqlite in --run-dir]; workers given the same URL and --study-name share one study")
@click.option("--study-name", default="vramcal-tune", show_default=True)
@click.option("--trials", type=click.IntRange(1), default=20, show_default=True,
              help="complete or pruned trials the study should have (across all workers)")
@click.option("--n-initial", type=click.IntRange(0), default=5, show_default=True,
              help="random trials before TPE models the results")
@click.option("--gpu", default="auto", show_default=True, help="auto | none (the host) | an NVML index | a UUID")
@click.option("--impl", "implementation", type=click.Choice(IMPLEMENTATIONS), default="auto", show_default=True)
@spec_options
@click.option("--profile", default="auto", show_default=True, help="auto (look in --profiles-dir) or a file")
@click.option("--profiles-dir", type=click.Path(file_okay=False), default="profiles", show_default=True)
@click.option("--batch-size-min", type=click.IntRange(1), default=1, show_default=True)
@click.option("--batch-size-max", type=click.IntRange(1), default=None,
              help="[default: the profile's conservative batch size, also the most allowed]")
@_range("--lr-range", (1e-5, 1e-3), "peak learning rate at --reference-batch-size, log scale")
@_range("--weight-decay-range", (0.0, 0.1), "AdamW weight decay, linear scale")
@_range("--max-grad-norm-range", (0.25, 4.0), "gradient clipping norm, log scale")
@click.option("--lr-scaling", type=click.Choice(LR_SCALINGS), default="sqrt", show_default=True)
@click.option("--reference-batch-size", type=click.IntRange(1), default=SEED_BATCH_SIZE, show_default=True)
@click.option("--warmup-steps", type=click.IntRange(0), default=None, help="[default: 5 % of the steps]")
@click.option("--epochs", type=click.IntRange(1), default=3, show_default=True,
              help="epochs per trial; validation loss after each feeds the pruner")
@click.option("--max-steps", type=click.IntRange(1), default=None, help="optimizer steps per trial at most")
@click.option("--seed", type=int, default=0, show_default=True, help="training seed, and the sampler's")
@click.option("--stride", type=click.IntRange(1), default=None, help="bars between windows [default: seq_len // 2]")
@click.option("--val-fraction", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.2,
              show_default=True, help="the last fraction of rows, for validation")
@click.pass_context
def tune_command(ctx: click.Context, config_file: Path | None, run_dir: Path | None, resume: bool,
                 storage: str | None, study_name: str, trials: int, **options) -> None:
    """Search learning rate, batch size (within the profile's bounds), weight decay and clip norm with optuna."""
    from vramcal.train import loop
    from vramcal.tune import report as tune_report
    from vramcal.tune import study as tune

    explicit = {name for name in ctx.params
                if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)}
    echo = lambda line: click.echo(line, err=True)  # noqa: E731
    settings = _settings(config_file, options, explicit)
    if resume and run_dir is None and storage is None:
        raise click.BadParameter("--resume needs the --run-dir of the tune (or --storage and --study-name)",
                                 param_hint="--resume")
    run_dir = run_dir or Path("runs") / dt.datetime.now(dt.timezone.utc).strftime("tune-%Y%m%d-%H%M%S")
    try:
        if storage is None:
            _check_default_storage(run_dir, resume)
        bounds = None if resume else tune.batch_bounds(settings)  # every check before a study is touched
        if storage is None:
            run_dir.mkdir(parents=True, exist_ok=True)
        url = storage or tune.default_storage(run_dir)
        study, settings, existed = tune.open_study(tune.open_storage(url), study_name, None if resume else settings,
                                                   settings.base.seed, settings.n_initial)
        if existed:
            ignored = sorted(explicit - {"resume", "run_dir", "storage", "study_name", *_PER_CALL})
            verb = "resuming" if resume else "joining"
            echo(f"{verb} study {study_name!r} ({len(study.trials)} trials so far) with its saved settings"
                 + (f"; ignoring {', '.join(o.replace('_', '-') for o in ignored)}" if ignored else ""))
            bounds = tune.batch_bounds(settings)
        assert bounds is not None
        for notice in bounds.notices:
            echo(f"warning: {notice}")
        echo(f"study {study_name!r} in {url}: {trials} trials, TPE after {settings.n_initial} random, median "
             f"pruning; {bounds.describe()}")
        tune.run_study(study, settings, bounds, run_dir, trials, echo=echo)
        written = tune_report.write_results(study, settings, bounds, run_dir)
    except KeyboardInterrupt:
        raise click.ClickException(f"interrupted: the study is kept; continue it with `vramcal tune --run-dir "
                                   f"{run_dir} --resume`" + (f" --storage {storage} --study-name {study_name}"
                                                             if storage else "")) from None
    except click.ClickException:
        raise
    except (ValueError, loop.TrainError, OSError) as error:  # TuneError, SizingError, DataError, DeviceError...
        raise click.ClickException(str(error)) from None
    _print_results(study, settings, written)


def _settings(config_file: Path | None, options: dict, explicit: set[str]):
    """Defaults < config file < options given here; ranges checked (bad ones exit 2)."""
    from vramcal.tune import study as tune

    ranges = {k: options.pop(k) for k in ("lr_range", "weight_decay_range", "max_grad_norm_range")}
    batch_size_max, n_initial = options.pop("batch_size_max"), options.pop("n_initial")
    try:
        if config_file is None:
            base = TrainConfig.from_dict(options)
        else:
            base = load_config(config_file).replace(**{k: v for k, v in options.items() if k in explicit})
        base = base.replace(**{k: getattr(TrainConfig(), k) for k in _SEARCHED})
        base.spec.validate()
        return tune.TuneSettings(base=base, batch_size_max=batch_size_max, n_initial=n_initial, **ranges)
    except tune.TuneError as error:
        raise click.BadParameter(str(error)) from None
    except ValueError as error:  # ConfigError, an impossible spec
        raise click.ClickException(str(error)) from None


def _check_default_storage(run_dir: Path, resume: bool) -> None:
    from vramcal.tune import study as tune

    database = run_dir / tune.STUDY_DB
    if resume and not database.is_file():
        raise click.ClickException(f"nothing to resume in {run_dir}: it has no {tune.STUDY_DB} "
                                   f"(start a new tune without --resume)")
    if not resume and database.exists():
        raise click.ClickException(f"{run_dir} already holds a study: pass --resume to continue it, "
                                   f"or choose another --run-dir")


def _print_results(study, settings, written: dict[str, Path]) -> None:
    from vramcal.tune.report import best_trial, format_table

    click.echo(format_table(study))
    best = best_trial(study)
    if best is None:
        click.echo("no trial completed: no best configuration")
    else:
        click.echo(f"best: trial {best.number}, val_loss {best.value:.5f} -> {written['best']}")
        click.echo(f"train it: vramcal train --config {written['best']}")
    click.echo(f"table: {written['table']}  plot: {written['plot']}")

