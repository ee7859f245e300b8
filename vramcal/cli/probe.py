"""``vramcal probe`` and ``vramcal show``: thin adapters over :mod:`vramcal.api`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from vramcal import files
from vramcal.cli import defaults
from vramcal.cli.console import VERBOSITY, echo_lines, observations_lines, summary, variant_lines
from vramcal.cli.options import (
    EXIT_UNVERIFIED,
    SPEC_NAMES,
    WorldOptions,
    check_local_ranks,
    collected,
    data_options,
    device_options,
    explicit,
    group,
    limit_options,
    one_line,
    probe_spec_options,
    strict_option,
    world_options,
)
from vramcal.cli.types import ByteSize, FiniteFloat, KeyValue
from vramcal.models import registry
from vramcal.models.registry import describe
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.profile import load_profile
from vramcal.records import TrialSettings
from vramcal.report import write_report
from vramcal.report.progress import TrialPrinter, trial_line
from vramcal.service.calibrate import plan_calibration, run_calibration
from vramcal.service.pool import select_devices, worker_pool
from vramcal.sizing.lookup import probe_command, suggested_capacity
from vramcal.sizing.staleness import check
from vramcal.sizing.variants import variant_rows, variants_of
from vramcal.units import format_bytes, size_argument

DEFAULT_DATA = Path("data/es_1s.parquet")

@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """What ``--model``, ``--model-arg`` and the spec options (``--d-model`` ... ``--dtype``) say, before they are
    checked against each other (:func:`model_params`).

    Attributes:
        spec: the spec options' values by name (``seq_len`` a :class:`~vramcal.calibration.fit2d.SeqLens`).
        given: those of ``spec`` the command line gave (not defaults).
    """

    model: str
    args: dict[str, Any]
    spec: dict[str, Any]
    given: frozenset[str]

    @classmethod
    def build(cls, model: str, model_args: tuple[tuple[str, Any], ...], **spec: Any) -> ModelOptions:
        return cls(model, dict(model_args), spec, frozenset(explicit(click.get_current_context())) & spec.keys())

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self.spec["seq_len"].lengths


model_options = collected(
    "model", ModelOptions.build,
    click.option("--model", default="regressor", show_default=True,
                 help="regressor (vramcal's trainer) | lm (a Mamba-2 language model from a transformers config) | "
                      "module:function (your factory returning a vramcal.TrainingStep)"),
    click.option("--model-arg", "model_args", type=KeyValue(), multiple=True,
                 help="KEY=VALUE for --model lm or your factory (repeat); lm needs config=<Mamba2Config JSON>"),
    probe_spec_options,
)

capacity_option = click.option(
    "--capacity", type=ByteSize(min_bytes=2**20), default=None,
    help="memory budget, e.g. 12GiB (default: the whole device; host: cgroup limit or MemAvailable)")


def factory_options(data: str | None, **windows: Any) -> dict[str, Any]:
    """The data options the trials take (the regressor's: the file they hold, data/es_1s.parquet by default when
    it exists, and how it is cut into windows; :meth:`vramcal.models.registry.Family.data_options` keeps those
    that apply to the model)."""
    if data is None and DEFAULT_DATA.is_file():
        data = str(DEFAULT_DATA)
    return {"data": data, **windows}


data_file_options = collected(
    "data", factory_options,
    click.option("--data", type=click.Path(dir_okay=False), default=None,
                 help="regressor: the OHLCV parquet the trials hold [default: data/es_1s.parquet if it exists, "
                      "else synthetic bars of its size]"),
    data_options,
)

_TRIALS = TrialSettings()  # the defaults of the trial options, from the one record that holds them
trial_options = collected(
    "trials", TrialSettings,
    click.option("--warmup-steps", type=click.IntRange(1), default=_TRIALS.warmup_steps, show_default=True),
    click.option("--measured-steps", type=click.IntRange(2), default=_TRIALS.measured_steps, show_default=True),
    click.option("--val-steps", type=click.IntRange(0), default=_TRIALS.val_steps, show_default=True,
                 help="validation passes per trial, at the trial's batch size, as the trainer validates"),
    click.option("--steady-steps", type=click.IntRange(0), default=_TRIALS.steady_steps, show_default=True,
                 help="the most measured steps of the steady trial at the conservative size: how much more a long "
                      "run peaks than a short trial (the step creep), added to the predictions; 0 skips it"),
    click.option("--plateau-steps", type=click.IntRange(0), default=_TRIALS.plateau_steps, show_default=True,
                 help="the steady trial ends once its peak has not risen for this many steps after its epoch's "
                      "end (a partial batch and validation after its first steps; 0: no epoch's end, it runs all "
                      "--steady-steps); a peak still rising at the end is reported"),
    click.option("--max-trials", type=click.IntRange(3), default=_TRIALS.max_trials, show_default=True),
    click.option("--timeout", "timeout_s", type=FiniteFloat(1, 86400), default=_TRIALS.timeout_s, show_default=True,
                 help="seconds before a trial is killed"),
    click.option("--boundary/--no-boundary", default=_TRIALS.boundary, show_default=True,
                 help="measure near the out-of-memory boundary (its largest trials); without: faster, and the "
                      "predicted boundary is an extrapolation"),
)
rank_options = group(
    click.option("--nproc", type=click.IntRange(1), default=1, show_default=True,
                 help="ranks of a DDP world per trial (torch.distributed; the host: gloo, every rank under the "
                      "budget; GPUs: nccl, one visible GPU each): per-rank limits"),
    world_options,
)


@click.command()
@device_options
@capacity_option
@model_options
@data_file_options
@limit_options
@trial_options
@rank_options
@click.option("--profiles-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("profiles"),
              show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="profile file (default: <profiles-dir>/<device>/<model>-<impl>-<hash>.json)")
@click.option("--reports-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"),
              show_default=True)
@click.option("--no-report", is_flag=True, help="do not write the PNG/Markdown report")
@click.option("--aim/--no-aim", default=False, show_default=True,
              help="trace the step on fake tensors first (seconds) and aim the first trials with its slope instead "
                   "of climbing from batch_size 1; the limits are verified the same way")
@click.option("--eval", "evaluation", is_flag=True,
              help="also calibrate the evaluation pass alone (no gradients; after real training steps): a verified "
                   "evaluation batch size, which vramcal train validates at")
@click.option("--json", "as_json", is_flag=True, help="print the profile(s) as JSON on stdout (the rest on stderr)")
@click.pass_context
def probe(ctx: click.Context, gpu, capacity, implementation, model: ModelOptions, data: dict[str, Any],
          settings, trials: TrialSettings, nproc: int, parallel: WorldOptions, profiles_dir, out, reports_dir,
          no_report, aim, evaluation, as_json) -> None:
    """Calibrate: real training steps at growing batch sizes, a fit, verified safe/conservative limits.

    Exits 0 when every profile written is verified, 3 when one is not (its limits are estimates).
    """

    with one_line("interrupted: no profile written, existing profiles are unchanged; the trials so far are kept "
                  "beside the profile (*.journal): run the same command again to continue from them"), \
            stdout_to_stderr(as_json):
        worker_pool().warm_up()  # the trials' server imports torch while the options and data are checked
        common = dict(implementation=implementation, settings=settings, options=data, profiles_dir=profiles_dir,
                      out=out, trials=trials, aim=aim, evaluation=evaluation)
        plans = plan_probes(model, gpu, capacity, nproc, parallel, common, err=as_json)
        if not no_report:
            check_writable(reports_dir, "reports", "--reports-dir, or --no-report")
        profiles = [calibrate_one(plan, as_json, None if no_report else reports_dir) for plan in plans]
    if as_json:
        click.echo(json.dumps([p.to_dict() for p in profiles] if len(profiles) > 1 else profiles[0].to_dict(),
                              indent=2, sort_keys=True))
    if not all(p.verified for p in profiles):
        ctx.exit(EXIT_UNVERIFIED)


def plan_probes(model: ModelOptions, gpu: str, capacity: int | None, nproc: int, parallel: WorldOptions,
                common: dict[str, Any], err: bool) -> list:
    """One :class:`~vramcal.service.calibrator.CalibrationPlan` per device ``--gpu`` names (one for a DDP world),
    every check
    done before any trial; prints the device notices. ``common``: :func:`vramcal.service.calibrate.plan_calibration`'s
    keywords that every plan shares.

    Raises:
        click.BadParameter: options that do not fit together.
    """

    name, params, spec = model_params(model)
    importable_from_cwd(name)
    devices, notice = select_devices("all" if nproc > 1 and gpu == "auto" else gpu, capacity)
    kind = devices[0].kind
    check_local_ranks(nproc, "--nproc", kind, parallel.oversubscribe)
    world = parallel.world(nproc, kind)
    if kind.shared and world is not None:  # the host's ranks share its memory: one device
        devices = devices[:1]
    if common["out"] is not None and len(devices) > 1 and world is None:
        raise click.BadParameter("--out names one file; with --gpu all, use --profiles-dir", param_hint="--out")
    echo_lines(([notice] if notice else []) + host_hint(devices[0], capacity), err=err)
    # several lengths when the command line gave --seq-len, else the spec's default or --model-arg's
    common = dict(common, world=world, seq_lens=model.spec["seq_len"] if "seq_len" in model.given else ())

    def key(device):  # the regressor's spec, made once: its key on each device (dtype, implementation)
        return registry.REGRESSOR.ref(spec, device, common["implementation"]) if spec is not None else name

    if world is not None:
        ranks = () if kind.shared else tuple(devices[:world.nproc])
        return [plan_calibration(key(devices[0]), params, device=devices[0], rank_devices=ranks, **common)]
    return [plan_calibration(key(device), params, device=device, unique_device=len(devices) > 1, **common)
            for device in devices]


def model_params(model: ModelOptions) -> tuple[str, dict[str, Any], RegressorSpec | None]:
    """The model choice and its arguments (the spec options for a family that takes them; ``--model-arg``, and
    ``--seq-len``/``--dtype`` where the family uses them, for the others), and the regressor's
    :class:`RegressorSpec` made from them (checked when made; None for the other families).

    Raises:
        click.BadParameter: options that do not apply to the chosen model, or that contradict each other.
        WorkloadError: a malformed model name.
    """
    args = dict(model.args)
    spec = {**model.spec, "seq_len": model.seq_lens[0]}  # the first of several (the API takes them all)
    family = registry.family(model.model)  # a malformed name: WorkloadError, one line, exit 1
    if family.spec_options:
        if args:
            raise click.BadParameter(f"--model {model.model} takes the spec options (--d-model, ...), not "
                                     f"--model-arg", param_hint="--model-arg")
        try:
            return model.model, spec, RegressorSpec(**spec)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="model spec") from None
    stray = sorted(n for n in SPEC_NAMES if n in model.given and n not in ("seq_len", "dtype"))
    if stray:
        raise click.BadParameter(f"{', '.join('--' + s.replace('_', '-') for s in stray)} apply to --model regressor; "
                                 f"pass arguments of --model {model.model} with --model-arg", param_hint="--model")
    for name in ("seq_len", "dtype"):
        flag = f"--{name.replace('_', '-')}"
        if name in model.given and name in args and args[name] != spec[name]:
            raise click.BadParameter(f"--model-arg {name}={args[name]} and {flag} {spec[name]} disagree: give one "
                                     f"of them", param_hint=flag)
        if name in model.given or (name in family.option_args and name not in args):
            args.setdefault(name, spec[name])
    return model.model, args, None


def importable_from_cwd(model: str) -> None:
    """Let ``--model module:function`` name a module in the current directory, as ``python -m`` would (and
    uvicorn or gunicorn do for ``module:app``); PYTHONPATH and installed packages work as usual. Trial
    processes start with this ``sys.path``."""
    if ":" in model and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


@contextlib.contextmanager
def stdout_to_stderr(active: bool) -> Iterator[None]:
    """Point file descriptor 1 at stderr while ``active`` (``--json``), so that what trial processes and
    libraries print (to the descriptor they inherit, not to click's stream) cannot mix into the JSON."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def host_hint(device, capacity: int | None) -> list[str]:
    if device.kind.budgeted and capacity is None:
        example = size_argument(suggested_capacity(device.total_bytes))
        return [f"calibrating all of the host's {device.total_source} ({format_bytes(device.total_bytes)}); "
                f"pass --capacity, e.g. {example}, to budget less"]
    return []


def calibrate_one(plan, err: bool = False, reports_dir: Path | None = None):
    """Run one device's calibration, print its trials and summary (to stderr when ``err``), write its report;
    returns the profile."""

    what = (f"{describe(plan.model.without('seq_len'))} at seq_len {', '.join(map(str, plan.seq_lens))}"
            if plan.seq_lens else describe(plan.model))
    world = plan.world
    per_rank = (f"; {world.describe()}: memory, batch sizes and limits per rank (the global batch is {world.nproc} × "
                f"per rank)" if world is not None else "")
    echo_lines(f"calibrating {what} on {plan.device.name}, {format_bytes(plan.device.total_bytes)} "
               f"({plan.device.total_source}){' per rank' if world is not None else ''}, usable "
               f"{format_bytes(plan.usable_bytes)}{per_rank}", err=err)
    if plan.aim is not None:
        echo_lines(f"aimed with {format_bytes(plan.aim.slope_bytes_per_sample)} per sample ({plan.aim.source})",
                   err=err)
    echo_lines(list(plan.notices), err=err)
    printer = TrialPrinter(plan.search().max_trials, plan.usable_bytes, file=sys.stderr if err else sys.stdout,
                           level=VERBOSITY.get())
    try:
        profile = run_calibration(plan, on_trial=printer, on_notice=lambda line: echo_lines(line, err=err),
                                      on_step=printer.step)
    except OSError as error:
        if not str(error.filename or "").startswith(str(plan.path.parent)):
            raise
        # the profile's folder (or its journal) cannot take files: said before any trial
        raise click.ClickException(f"cannot write profiles to {plan.path.parent} ({error.strerror}): "
                                   f"{files.os_advice(error, '--out or --profiles-dir')}") from None
    finally:
        printer.close()
    echo_lines([summary(profile), f"profile: {plan.path}"], err=err)
    if reports_dir is not None:
        png, markdown = write_report([profile], reports_dir)
        echo_lines(f"report: {markdown} and {png}", err=err)
    if not profile.verified:
        echo_lines(f"not verified: {'; '.join(profile.warnings) or 'no verification trial passed'} (exit "
                   f"{EXIT_UNVERIFIED})", err=True)
    return profile


def warn_if_stale(profile, path: Path, strict: bool) -> None:
    """A warning on stderr for a profile made under other software or settings (:mod:`vramcal.sizing.staleness`);
    ``strict``: refuse it (StaleProfileError, one line)."""

    notice = check(profile, str(path), strict=strict or None,
                   command=probe_command(profile.device, profile.model, profile.world))
    if notice:
        click.echo(f"warning: {notice}", err=True)


def check_writable(folder: Path, what: str, options: str) -> None:
    """Fail before any trial when ``folder`` cannot take files, a full disk included
    (:func:`vramcal.files.check_writable`: a calibration can take an hour).

    Raises:
        click.ClickException: the folder cannot take files, naming ``options`` to choose another.
    """
    try:
        files.check_writable(folder)
    except OSError as error:
        raise click.ClickException(f"cannot write {what} to {folder} ({error.strerror}): "
                                   f"{files.os_advice(error, options)}") from None


@click.command()
@click.argument("profile_path", type=click.Path(path_type=Path), required=False)
@click.option("--json", "as_json", is_flag=True, help="print the profile as JSON for programs")
@click.option("--config", "show_config", is_flag=True,
              help="print, instead of a profile, the defaults the files (vramcal.toml, the user's config.toml, "
                   "VRAMCAL_CONFIG) set, per command, and where each came from")
@strict_option
@click.pass_context
def show(ctx: click.Context, profile_path: Path | None, as_json: bool, show_config: bool, strict_profile: bool) -> None:
    """Print a profile for people (or --json for programs), with the training runs that used it; or, with
    --config, the options' defaults the files set."""

    if show_config != (profile_path is None):
        raise click.UsageError("give a PROFILE_PATH to show, or --config for the defaults in force: one of them")
    if show_config:
        _show_defaults(ctx.find_root(), as_json)
        return
    with one_line():
        profile = load_profile(profile_path)
        warn_if_stale(profile, profile_path, strict_profile)
    if as_json:
        click.echo(json.dumps(profile.to_dict(), indent=2, sort_keys=True))
        return
    click.echo(f"{profile_path}  (vramcal {profile.vramcal_version}, {profile.created_utc})")
    click.echo(f"model: {describe(profile.model)}  [{profile.implementation}: {profile.kernel_path}]")
    usable = profile.settings.usable_bytes(profile.device.total_bytes)
    for trial in profile.trials:
        click.echo(trial_line(trial, usable, trial.purpose))
    echo_lines([summary(profile), *observations_lines(profile)])
    found = variants_of(profile.model, profile.device, profile_path.parent, world=profile.world,
                        total_bytes=profile.device.total_bytes)
    if len(found) > 1:  # the same model in other variants beside it (vramcal.sizing.variants)
        echo_lines(variant_lines(variant_rows(found)))


def _show_defaults(root: click.Context, as_json: bool) -> None:
    """``show --config``: each option a file sets, for every command that has it: the value and its source."""

    found = root.meta[defaults.META]
    rows = defaults.in_force(root.command, found)
    if as_json:
        click.echo(json.dumps({"files": [str(path) for path in found.files],
                               "options": [{"command": " ".join(row.command), "key": row.name, "value": row.value,
                                            "source": row.source} for row in rows]},
                              indent=2, sort_keys=True, default=str))
        return
    if not found.files:
        click.echo(f"no defaults file: none at {defaults.user_file(os.environ)}, no {defaults.PROJECT_FILE} here or "
                   f"above (up to a folder holding .git), {defaults.ENV} unset")
        return
    click.echo(f"defaults from {', '.join(map(str, found.files))} (a later file wins; a flag wins over all)"
               + ("" if rows else ": they set nothing"))
    width = max((len(" ".join(row.command)) + len(row.name) for row in rows), default=0) + 1
    for row in rows:
        click.echo(f"{' '.join(row.command) + ' ' + row.name:<{width}} = {defaults.shown(row.value):<24} {row.source}")
