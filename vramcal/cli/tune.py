"""``vramcal tune``: a thin adapter over :mod:`vramcal.tune`.

The training options are ``vramcal train``'s own (declared once in :mod:`vramcal.cli.options`). Progress
goes to stderr, the trials table and the result files to stdout. User-fixable failures end as one line,
exit 1; bad values exit 2; Ctrl-C exits 130 with the study kept.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import click

from vramcal.calibration.fit2d import parse_seq_lens
from vramcal.cli.options import explicit, one_line, strict_profiles, training_options
from vramcal.cli.probe import stdout_to_stderr
from vramcal.cli.train import make_config
from vramcal.train.config import TrainConfig
from vramcal.tune import storage as storages
from vramcal.tune.storage import STUDY_DB
from vramcal.words import labelled

# Settings of the base config that a tune searches (the config's own values are replaced per trial).
_SEARCHED = ("lr", "batch_size", "weight_decay", "max_grad_norm")
_PER_CALL = ("trials", "resume", "run_dir", "storage", "study_name", "capacity")  # a resume or a joiner may change


def _range(name: str, default: tuple[float, float], help_text: str):
    return click.option(name, type=(float, float), default=default, show_default=True, metavar="LOW HIGH",
                        help=help_text)


@click.command("tune")
@training_options
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="tune folder: study.db, trials/<nnnn>/ (trials/0000/, ...; each a training run with its "
                   "TensorBoard files: `tensorboard --logdir` this folder), trials.md, best-config.json, tune.png "
                   "[default: runs/tune-<UTC time>]")
@click.option("--resume", is_flag=True, help="continue the study in --run-dir (or --storage/--study-name)")
@click.option("--storage", default=None, envvar="VRAMCAL_TUNE_STORAGE",
              help="optuna storage: a database URL (sqlite:///..., postgresql://...: pip install 'vramcal[postgres]') "
                   "or a journal file (journal:///abs/path.log, or a path ending in .log), or the "
                   "VRAMCAL_TUNE_STORAGE environment variable (keeps a password out of process lists; printed with "
                   "the password hidden) [default: sqlite in --run-dir]; workers given the same storage and "
                   "--study-name share one study")
@click.option("--study-name", default="vramcal-tune", show_default=True)
@click.option("--trials", type=click.IntRange(1), default=20, show_default=True,
              help="complete or pruned trials the study should have (across all workers: exactly this many)")
@click.option("--n-initial", type=click.IntRange(0), default=5, show_default=True,
              help="random trials before TPE models the results")
@click.option("--batch-size-max", type=click.IntRange(1), default=None,
              help="[default: the profile's conservative batch size, also the most allowed]")
@click.option("--seq-lens", default=None,
              help="look-back windows to search too, e.g. 64,128,256 or a range 64:256 (its ends and middle); "
                   "each needs a profile that covers it (one calibrated over several lengths, or one per length); "
                   "batch bounds follow the length")
@_range("--lr-range", (1e-5, 1e-3), "peak learning rate at --reference-batch-size, log scale")
@_range("--weight-decay-range", (0.0, 0.1), "AdamW weight decay, linear scale")
@_range("--max-grad-norm-range", (0.25, 4.0), "gradient clipping norm, log scale")
@click.option("--epochs", type=click.IntRange(1), default=3, show_default=True,
              help="epochs per trial; validation loss after each feeds the pruner")
@click.option("--json", "as_json", is_flag=True, help="at the end, print the study, its storage, the best trial's "
              "value and params and the trials by state as JSON on stdout (the table and the rest on stderr)")
@click.pass_context
def tune_command(ctx: click.Context, config_file: str | None, run_dir: Path | None, resume: bool,
                 storage: str | None, study_name: str, trials: int, capacity: tuple[int, ...] | None, as_json: bool,
                 **options: Any) -> None:
    """Search learning rate, batch size (within the profile's bounds), weight decay and clip norm with optuna.

    Every trial is a training run in the tune folder (trials/<nnnn>/) with its epochs, hyperparameters and
    objective in TensorBoard there: `tensorboard --logdir <tune folder>` compares them (HParams).
    """
    from vramcal.tune import report  # loads numpy: only when called
    from vramcal.tune import study as tune  # loads numpy: only when called

    given = explicit(ctx)
    strict_profiles(options.pop("strict_profile"))
    if capacity and len(capacity) > 1:
        raise click.BadParameter("a tune's trials are one process each: give one budget", param_hint="--capacity")
    capacity = capacity[0] if capacity else None
    with one_line():
        settings = tune_settings(config_file, options, given)
    if resume and run_dir is None and storage is None:
        raise click.BadParameter("--resume needs the --run-dir of the tune (or --storage and --study-name)",
                                 param_hint="--resume")
    run_dir = run_dir or Path("runs") / dt.datetime.now(dt.UTC).strftime("tune-%Y%m%d-%H%M%S")
    url = storage_url(storage, run_dir)
    echo = lambda line: click.echo(line, err=True)  # noqa: E731
    resume_hint = f"`vramcal tune --run-dir {run_dir} --resume`" + (" with the same --storage and --study-name"
                                                                     if storage else "")
    options_given = {p.name: p.opts[0] for p in ctx.command.params if p.name in given - set(_PER_CALL)}
    with one_line(f"interrupted: the study is kept; continue it with {resume_hint}"), storages.storage_errors(url), \
            stdout_to_stderr(as_json):
        study, settings, space = open_tune(settings, run_dir, resume, url, storage is None, study_name, capacity,
                                           options_given, echo)
        echo(f"study {study_name!r} in {url.shown}: {trials} trials, TPE after {settings.n_initial} random, "
             f"median pruning; {space.describe()}")
        tune.run_study(study, settings, space, run_dir, trials, echo=echo, secrets=url.secrets)
        written = report.write_results(study, settings, space, run_dir)
    print_results(study, written, as_json, url.shown, run_dir)


def storage_url(storage: str | None, run_dir: Path):
    """``--storage`` read (:func:`vramcal.tune.storage.parse_storage`), or the tune folder's SQLite; a value of
    no known form exits 2."""

    try:
        return storages.parse_storage(storages.default_storage(run_dir) if storage is None else storage)
    except storages.StorageError as error:
        raise click.BadParameter(str(error), param_hint="'--storage'") from None


def open_tune(settings, run_dir: Path, resume: bool, url, in_run_dir: bool, study_name: str,
              capacity: int | None, given: dict[str, str], echo):
    """Check everything, then open (or create) the study and decide the batch bounds, printing the notices.

    Args:
        url: the :class:`~vramcal.tune.storage.StorageURL` to open (print it only as its ``shown``).
        in_run_dir: ``url`` is the tune folder's own SQLite (no --storage).
        given: the options given on the command line but the ones a resume or a joiner may change, as
            ``{parameter name: option}`` (``{"implementation": "--impl"}``).

    Returns:
        (study, the settings it searches, the :class:`~vramcal.tune.study.SearchSpace`).
    """
    from vramcal.models.regressor.windows import data_notices  # loads numpy: only when called
    from vramcal.tune import study as tune  # loads numpy: only when called

    if in_run_dir:
        check_default_storage(run_dir, resume)
    if not resume:  # every check before a study is touched
        space = tune.search_space(settings, capacity)
    if in_run_dir:
        run_dir.mkdir(parents=True, exist_ok=True)
    asked = settings
    study, settings, existed = tune.open_study(storages.open_storage(url, create=not resume), study_name,
                                               None if resume else settings, url.shown)
    if existed:
        ignored = ignored_options(asked, settings, given)
        echo(f"{'resuming' if resume else 'joining'} study {study_name!r} ({len(study.trials)} trials so far) with "
             f"its saved settings" + (f"; ignoring {', '.join(ignored)}" if ignored else ""))
        space = tune.search_space(settings, capacity)
    for notice in space.notices:
        echo(labelled(notice))
    for line in data_notices(space.lengths[0][1].data_stats):
        echo(line)
    return study, settings, space


def ignored_options(asked, saved, given: dict[str, str]) -> list[str]:
    """The options given here that the study's saved settings override, each with both values
    (``--epochs 5 (the study's: 2)``), and with ``--config`` the settings from the file that differ
    (``--config's val_fraction 0.3 (the study's: 0.2)``). Options equal to the saved settings are not named.

    Args:
        given: ``{parameter name: option}`` of the options given on the command line.
    """
    from vramcal.tune.study import setting_differences  # loads numpy: only when called

    differences = setting_differences(asked, saved)
    named = [f"{given[name]} {_shown(ours)} (the study's: {_shown(theirs)})"
             for name, (ours, theirs) in sorted(differences.items()) if name in given]
    if "config_file" in given:  # the others came from the file (or, not in it, from the defaults)
        named += [f"--config's {name} {_shown(ours)} (the study's: {_shown(theirs)})"
                  for name, (ours, theirs) in sorted(differences.items()) if name not in given]
    return named


def _shown(value) -> str:
    if isinstance(value, list | tuple):
        return " ".join(_shown(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value)


def tune_settings(config_file: str | None, options: dict[str, Any], given: set[str]):
    """Defaults < config file < options given here, as ``vramcal train`` reads them (an unusable config file
    exits 1; an impossible spec or a bad range exits 2)."""
    from vramcal.tune import study as tune  # loads numpy: only when called

    ranges = {k: options.pop(k) for k in ("lr_range", "weight_decay_range", "max_grad_norm_range")}
    batch_size_max, n_initial = options.pop("batch_size_max"), options.pop("n_initial")
    seq_lens = options.pop("seq_lens")
    base = make_config(config_file, options, given)
    base = base.replace(**{k: getattr(TrainConfig(), k) for k in _SEARCHED})
    lengths = seq_len_choices(seq_lens, base.spec.chunk_size) if seq_lens is not None else ()
    try:
        return tune.TuneSettings(base=base, batch_size_max=batch_size_max, n_initial=n_initial, seq_lens=lengths,
                                 **ranges)
    except tune.TuneError as error:
        raise click.BadParameter(str(error)) from None


def seq_len_choices(text: str, chunk_size: int) -> tuple[int, ...]:
    """``--seq-lens`` read as ``vramcal probe --seq-len`` reads it (a list, or a range's ends and middle);
    bad ones exit 2."""

    try:
        return parse_seq_lens(text).design(chunk_size)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="'--seq-lens'") from None


def check_default_storage(run_dir: Path, resume: bool) -> None:
    database = run_dir / STUDY_DB
    if resume and not database.is_file():
        raise click.ClickException(f"nothing to resume in {run_dir}: it has no {STUDY_DB} "
                                   f"(start a new tune without --resume)")
    if not resume and database.exists():
        raise click.ClickException(f"{run_dir} already holds a study: pass --resume to continue it, "
                                   f"or choose another --run-dir")


def print_results(study, written: dict[str, Path], as_json: bool = False, storage: str = "", run_dir: Path = Path()):
    """The trials table, the failures, the best trial and the files; with ``as_json`` all that on stderr and
    :func:`vramcal.tune.report.study_summary` on stdout, with the ``storage`` (as shown: no password) and the tune
    folder.

    Raises:
        click.ClickException: no trial completed (after the JSON, whose ``best`` is then null).
    """
    from vramcal.tune.report import best_trial, failure_lines, format_table, study_summary  # loads numpy: when called

    err = as_json
    click.echo(format_table(study), err=err)
    for line in failure_lines(study):
        click.echo(line, err=err)
    best = best_trial(study)
    if best is not None:
        click.echo(f"best: trial {best.number}, val_loss {best.value:.5f} -> {written['best']}", err=err)
        click.echo(f"train it: vramcal train --config {written['best']}", err=err)
    click.echo(f"table: {written['table']}  plot: {written['plot']}", err=err)
    if err:
        click.echo(json.dumps({**study_summary(study, written), "storage": storage, "run_dir": str(run_dir)},
                              indent=2, sort_keys=True))
    if best is None:
        failed = len(failure_lines(study))
        raise click.ClickException("no trial completed, no best configuration"
                                   + (f": {failed} failed (the reasons are above and in {written['table']})"
                                      if failed else ""))
