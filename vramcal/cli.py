"""The ``vramcal`` command line: a thin click layer over the library.

Each command parses, calls a vramcal function, prints. User-fixable failures are
``click.ClickException`` (exit 1, one line), bad values ``click.BadParameter`` (exit 2).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from vramcal import __version__
from vramcal.model import DTYPE_POLICIES, IMPLEMENTATIONS, ModelSpec
from vramcal.units import format_bytes, parse_bytes

_DEFAULTS = ModelSpec()


class ByteSize(click.ParamType):
    """A size such as ``12GiB``, parsed by :func:`vramcal.units.parse_bytes`."""

    name = "size"

    def __init__(self, min_bytes: int = 0) -> None:
        self.min_bytes = min_bytes

    def convert(self, value, param, ctx):
        try:
            n_bytes = value if isinstance(value, int) else parse_bytes(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)
        if n_bytes < self.min_bytes:
            self.fail(f"{value} is below the minimum of {format_bytes(self.min_bytes)}", param, ctx)
        return n_bytes


def spec_options(command):
    """The ModelSpec options shared by probe, train and tune (field names as the options)."""
    options = [
        click.option("--d-model", type=click.IntRange(1), default=_DEFAULTS.d_model, show_default=True),
        click.option("--n-layers", type=click.IntRange(1), default=_DEFAULTS.n_layers, show_default=True),
        click.option("--d-state", type=click.IntRange(1), default=_DEFAULTS.d_state, show_default=True),
        click.option("--headdim", type=click.IntRange(1), default=_DEFAULTS.headdim, show_default=True),
        click.option("--expand", type=click.IntRange(1), default=_DEFAULTS.expand, show_default=True),
        click.option("--chunk-size", type=click.IntRange(1), default=_DEFAULTS.chunk_size, show_default=True),
        click.option("--seq-len", type=click.IntRange(1), default=_DEFAULTS.seq_len, show_default=True),
        click.option("--dtype", type=click.Choice(DTYPE_POLICIES), default=_DEFAULTS.dtype, show_default=True,
                     help="fp32, or fp32 weights with bf16 autocast (CUDA only)"),
    ]
    return functools.reduce(lambda cmd, option: option(cmd), reversed(options), command)


def spec_from_options(options: dict) -> ModelSpec:
    """Pop the spec options from a click kwargs dict and build a validated ModelSpec.

    Raises:
        click.BadParameter: the spec is impossible; the message says which values would work.
    """
    names = ("d_model", "n_layers", "d_state", "headdim", "expand", "chunk_size", "seq_len", "dtype")
    spec = ModelSpec(**{name: options.pop(name) for name in names})
    try:
        spec.validate()
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="model spec") from None
    return spec


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vramcal")
def main() -> None:
    """Measure the memory of real Mamba-2 training steps and calibrate safe batch sizes."""


@main.command()
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
    from vramcal.device import DeviceError, NvmlError, select
    from vramcal.limits import LimitSettings
    from vramcal.probe import CalibrationError, calibrate, check_request
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
                                on_trial=_TrialPrinter(max_trials, settings.usable_bytes(device.total_bytes)))
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


class _TrialPrinter:
    """One line per finished trial above a tqdm progress bar (trials run / at most max_trials)."""

    def __init__(self, max_trials: int, usable_bytes: int) -> None:
        from tqdm import tqdm

        self._usable_bytes = usable_bytes
        self._bar = tqdm(total=max_trials, desc="trials", unit="trial", leave=False, file=sys.stderr,
                         disable=None)

    def __call__(self, trial) -> None:
        peak = format_bytes(trial.peak_bytes) if trial.peak_bytes is not None else "-"
        step = f"{trial.step_s:.3f} s/step, {trial.samples_per_s:.1f} samples/s" if trial.step_s else ""
        status = "over" if trial.ok and not trial.fits(self._usable_bytes) else trial.status
        self._bar.write(f"  batch_size {trial.batch_size:>6}  {status:<7}  peak {peak:>10}  {step}  "
                        f"[{trial.purpose}, {trial.wall_s:.1f} s]")
        self._bar.update(1)


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


def summary(profile) -> str:
    """The probe's closing lines for people: formula, usable, safe and conservative, verification."""
    lines = [f"{profile.device.name}: {format_bytes(profile.device.total_bytes)} total"]
    fit, limits = profile.fit, profile.limits
    if fit is None or limits is None:
        lines.append("no fit: " + "; ".join(profile.warnings))
        return "\n".join(lines)
    lines.append(f"{fit.formula()}   (r² = {fit.r_squared:.4f}, {fit.n_points} points)")
    lines.append(f"usable        {format_bytes(limits.usable_bytes)}")
    for name, value in (("safe", limits.safe_batch_size), ("conservative", limits.conservative_batch_size)):
        check = profile.verification.get(name)
        state = (f"verified: peak {format_bytes(check.peak_bytes)}" if check and check.passed
                 else "NOT verified")
        lines.append(f"{name:<13} batch_size {value:<6} ({state})")
    lines.append(f"(point estimate without the prediction interval, the seeds' formula "
                 f"floor((usable - overhead) / slope): {limits.point_safe_batch_size})")
    lines.extend(f"warning: {w}" for w in profile.warnings)
    return "\n".join(lines)


@main.command()
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


# Commands that live beside their feature modules (imported last: they use main and spec_options).
import vramcal.train.cli  # noqa: E402, F401 - adds `train` and `data` to main
import vramcal.tune_cli  # noqa: E402, F401 - adds `tune` to main
from vramcal.report_cli import limits_command, report_command  # noqa: E402

main.add_command(report_command)
main.add_command(limits_command)

if __name__ == "__main__":  # pragma: no cover
    main()
