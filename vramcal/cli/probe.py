"""The ``vramcal`` command line: a thin click layer over the library.

Each command parses, calls a vramcal function, prints. User-fixable failures are
``click.ClickException`` (exit 1, one line), bad values ``click.BadParameter`` (exit 2).
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from vramcal.cli.console import TrialPrinter, summary
from vramcal.cli.options import ByteSize, spec_from_options, spec_options
from vramcal.model import IMPLEMENTATIONS
from vramcal.units import format_bytes


@click.command()
@click.option("--gpu", default="auto", show_default=True,
              help="auto | none (the host) | all | an NVML index | a GPU UUID")
@click.option("--capacity", type=ByteSize(min_bytes=2**20), default=None,
              help="memory budget, e.g. 12GiB (default: the whole device; host: cgroup limit or MemAvailable)")
@click.option("--impl", "implementation", type=click.Choice(IMPLEMENTATIONS), default="auto", show_default=True)
@spec_options
@click.option("--reserve", type=ByteSize(), default="512MiB", show_default=True, help="memory kept free")
@click.option("--margin", type=click.FloatRange(0, 1, max_open=True), default=0.10, show_default=True,
              help="fraction of total memory kept free")
@click.option("--conservative", "conservative_fraction", type=click.FloatRange(0, 1, min_open=True),
              default=0.9, show_default=True, help="conservative = floor(this x safe)")
@click.option("--warmup-steps", type=click.IntRange(1), default=1, show_default=True)
@click.option("--measured-steps", type=click.IntRange(2), default=2, show_default=True)
@click.option("--max-trials", type=click.IntRange(3), default=16, show_default=True)
@click.option("--timeout", "timeout_s", type=click.FloatRange(1), default=900, show_default=True,
              help="seconds before a trial is killed")
@click.option("--profiles-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("profiles"),
              show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="profile file (default: <profiles-dir>/<device>/<impl>-<spec hash>.json)")
@click.option("--reports-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"),
              show_default=True)
@click.option("--no-report", is_flag=True, help="do not write the PNG/Markdown report")
def probe(gpu, capacity, implementation, reserve, margin, conservative_fraction, warmup_steps, measured_steps,
          max_trials, timeout_s, profiles_dir, out, reports_dir, no_report, **spec_kwargs) -> None:
    """Calibrate: real training steps at growing batch sizes, a fit, verified safe/conservative limits."""
    from vramcal.calibrate.limits import LimitSettings
    from vramcal.calibrate.probe import CalibrationError, calibrate, check_request
    from vramcal.measure.device import DeviceError, NvmlError, select
    from vramcal.profile import profile_path, save_profile

    spec = spec_from_options(spec_kwargs)
    settings = LimitSettings(reserve_bytes=reserve, margin=margin, conservative_fraction=conservative_fraction)
    try:
        devices, notice = select(gpu, capacity)
    except (DeviceError, NvmlError) as error:
        raise click.ClickException(str(error)) from None
    if notice:
        click.echo(notice)
    if devices[0].kind == "host" and capacity is None:
        click.echo(f"calibrating all of the host's {devices[0].total_source} "
                   f"({format_bytes(devices[0].total_bytes)}); pass --capacity, e.g. 4GiB, to budget less")
    if out is not None and len(devices) > 1:
        raise click.BadParameter("--out names one file; with --gpu all, use --profiles-dir", param_hint="--out")
    for device in devices:
        try:
            concrete = check_request(device, spec, implementation, settings)
        except ValueError as error:
            raise click.ClickException(str(error)) from None
        path = out or profile_path(profiles_dir, device, spec, concrete)
        _check_writable(path.parent, "profiles", "--out or --profiles-dir")
        if not no_report:
            _check_writable(reports_dir, "reports", "--reports-dir, or --no-report")
        click.echo(f"calibrating {spec.short()} [{concrete}] on {device.name}, "
                   f"{format_bytes(device.total_bytes)} ({device.total_source}), "
                   f"usable {format_bytes(settings.usable_bytes(device.total_bytes))}")
        try:
            profile = calibrate(device, spec, concrete, settings, warmup_steps=warmup_steps,
                                measured_steps=measured_steps, max_trials=max_trials, timeout_s=timeout_s,
                                on_trial=TrialPrinter(max_trials, settings.usable_bytes(device.total_bytes)))
        except (ValueError, CalibrationError) as error:
            raise click.ClickException(str(error)) from None
        except KeyboardInterrupt:
            kept = f"; the existing {path} is unchanged" if path.exists() else ""
            raise click.ClickException(f"interrupted: no profile written{kept}") from None
        try:
            save_profile(profile, path)
        except OSError as error:
            raise click.ClickException(f"cannot write the profile to {path} ({error.strerror}): "
                                       f"choose another --out or --profiles-dir") from None
        click.echo(summary(profile))
        click.echo(f"profile: {path}")
        if not no_report:
            _write_report(profile, reports_dir)

def _check_writable(folder: Path, what: str, options: str) -> None:
    """Fail before any trial when ``folder`` cannot take files (a calibration can take an hour)."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".vramcal-write-check."):
            pass
    except OSError as error:
        raise click.ClickException(f"cannot write {what} to {folder} ({error.strerror}): "
                                   f"choose another {options}") from None


def _write_report(profile, reports_dir: Path) -> None:
    from vramcal.report import write_report

    try:
        png, markdown = write_report([profile], reports_dir)
    except OSError as error:
        raise click.ClickException(f"cannot write the report to {reports_dir} ({error.strerror}): "
                                   f"choose another --reports-dir") from None
    click.echo(f"report: {markdown} and {png}")

@click.command()
@click.argument("profile_path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print the profile as JSON for programs")
def show(profile_path: Path, as_json: bool) -> None:
    """Print a profile for people (or --json for programs)."""
    from vramcal.profile import ProfileError, load_profile

    try:
        profile = load_profile(profile_path)
    except ProfileError as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        click.echo(json.dumps(profile.to_dict(), indent=2, sort_keys=True))
        return
    click.echo(f"{profile_path}  (vramcal {profile.vramcal_version}, {profile.created_utc})")
    click.echo(f"model: {profile.spec.short()}  [{profile.implementation}: {profile.kernel_path}]")
    for trial in profile.trials:
        peak = format_bytes(trial.peak_bytes) if trial.peak_bytes is not None else "-"
        click.echo(f"  batch_size {trial.batch_size:>6}  {trial.status:<7}  peak {peak:>10}  {trial.purpose}")
    click.echo(summary(profile))
