"""The device run (issues 11, 18): everything a lent H200 should establish, in one script that cannot lose its results.

Its steps, in order, each in its own guard (scripts/gpu_check_run.py: a step's result, error, stop or skip is
written to ``gpu_check.json`` and ``GPU_CHECK.md`` as soon as it ends, and a failure never stops the next):

1. ``device``: the GPU (``--gpu``), or the host with ``--capacity`` for a rehearsal;
2. ``data``: the bars the trials and the trainer read: ``--data`` (default the tree's ``data/es_1s.parquet``),
   or, where that file is missing (it is git-ignored, so a copied working tree lacks it), synthetic bars
   (``vramcal.models.regressor.bars.synthetic_bars``: 34,171 random-walk 1-s bars, the E-mini sample's size) written to
   the work folder, and the results say so;
3. ``default``: calibrate the default spec (bf16 autocast on a GPU) on the whole device: profile and report; the
   calibration runs with ``--steady-steps 0`` and its steady trial (the step creep) runs after it, sized from the
   calibration's own step times, so a slow steady trial cannot cost the profile (:func:`calibration_step`);
4. ``boundary``: bisect the default spec's true out-of-memory boundary with real trials on the whole device, to
   compare with the profile's predicted one. Only memory decides (``bench.truth.memory_verdict``): a size does
   not fit when its trial ran out of memory or finished with a peak above the device's memory; an ``error`` or
   ``timeout`` is run once more, reported as what it is, and never becomes the boundary (the bisection stops
   at its last real bounds instead);
5. ``train``: one epoch of ``vramcal train``'s own runner at the default profile's conservative size (fewer steps
   when the trials' step times say an epoch would not fit the time given; the results say so), its measured
   peak against the profile's prediction and upper bound;
6. ``chunk_size``: the SSD chunk_size's effect (``bench.chunk_size.study``: real trials of the default step's spec
   at each chunk_size it accepts, at two batch sizes from the default profile's conservative size, a half and an
   eighth of it): memory per sample and samples/s per chunk_size, on the fused kernels where mamba_ssm imports
   (where chunk_size matters most), else transformers' path; trials stop when the step's time is spent;
7. ``large``: calibrate a spec that uses a real share of the card (d_model 768, 24 layers, seq_len 1024; GPU only);
   after the steps that need the default profile, so that a slow large spec cannot starve them;
8. ``fused``: where mamba_ssm imports (its wheels carried: make gpu-fused-wheels), calibrate the default spec with
   ``--impl mamba_ssm`` under its own caps (``gpu_check_policy.FUSED``: 8 trials, a steady trial of at most 10
   steps, 150 s).

``estimate`` (after ``data``, before any trial): the specs the calibrations run (``default``, whose estimate the
``fused`` step uses too, and on a card ``large``) estimated as ``vramcal estimate`` does (issue 57:
``estimate_cards``, on a card both kernel paths, labelled), in a process of its own so that nothing it loads stays
beside the trials; each path's bytes per sample and their ratio. Each calibration then writes its spec's estimate
beside its measurement (``estimate`` in its result): the estimated peak at the verified safe size against the peak
measured there, the error and whether the estimate's bound covers it.

Time: ``--budget-s`` bounds the whole run (gpu_check.sh derives it, and the ``timeout`` it runs the check under, from
its one deadline, after timing its setup, ``--setup-s``, recorded; the check stops itself before the timeout with
everything written). Each step has an estimate and a weight
(:data:`TIMES`); a calibration's most trials, steady steps and per-trial timeout derive from the time it is given
(``gpu_check_policy.trial_settings``, from the caps ``CUDA``, ``HOST``, ``FUSED`` there).

Triton (the fused path's kernels): vramcal's GPU workers keep Triton's compiled kernels and autotuning results
across trial processes (``vramcal.measure.meters.CudaMeter.worker_environment``: ``TRITON_CACHE_AUTOTUNING=1``, and
``TRITON_CACHE_DIR`` in the user's cache unless set); the check sets ``TRITON_CACHE_DIR`` to ``<work>/triton-cache``
before the first trial process starts, to count its files, so the kernels one trial compiles are found by the next,
and the autotuning results too (triton 3.6.0, read in its wheel and in triton-lang/triton:
``python/triton/knobs.py`` ``autotuning_knobs.cache = env_bool("TRITON_CACHE_AUTOTUNING")``;
``python/triton/runtime/autotuner.py`` ``Autotuner.__init__`` turns on ``cache_results`` with it, and
``check_disk_cache`` then writes ``<kernel>.autotune.json`` through the cache manager of ``TRITON_CACHE_DIR``
and reads it back instead of benchmarking: for kernels whose configs carry no pre_hook).

What persisting saves is read off each calibration's ``trial_wall_s``: the first trial's wall time (a cold cache
on a fresh machine: it compiles and autotunes in its warm-up step) against the later trials' (they find the
kernels and the autotune results on disk), each also split as ``rest_s`` = wall − process start − model build −
measured steps × median step time, which is the warm-up step (where Triton compiles and autotunes), the
validation pass and the meter. Later trials run at larger batch sizes, so their walls understate what the cache
saves; the cache's file counts before and after each step are recorded beside them. No trial runs without the
cache, so the run does not measure what each trial would cost without it.

Writes ``<out>/gpu_check.json``, ``<out>/GPU_CHECK.md`` and ``<out>/gpu_check_files.tar.gz`` (the profiles and
reports), and nothing else under ``<out>`` (the device tool brings back at most 8 files); profiles, reports,
the training run, the bars and Triton's cache go to ``--work`` (default ``<out>.work``, beside ``<out>``).

Options: ``--out`` (required), ``--work``, ``--budget-s`` (seconds, default 450), ``--setup-s`` (recorded), ``--gpu``
(``auto``; ``none`` rehearses on the host), ``--capacity`` (the host budget, e.g. 2.5GiB), ``--reserve`` (what the
calibrations keep free, default 0.5GiB as ``vramcal probe``; 0 lets a small host budget rehearse quickly), ``--spec``
(``default`` or ``tiny``), ``--data``, and ``--inject-error STEP`` (that step fails at its start: a rehearsal of a
failing step; only this script reads it).
Exit status: 0 when every step that ran ended ok, 1 when one did not (the results say which), 2 a bad option.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from gpu_check_policy import (  # noqa: E402
    CUDA,
    FUSED,
    HOST,
    Caps,
    bisect_boundary,
    boundary_line,
    cache_files,
    epoch_cut,
    first_and_later,
    steady_steps_that_fit,
    trial_row,
    trial_settings,
)
from gpu_check_run import Check, Step, run_steps  # noqa: E402

from vramcal.models.regressor.spec import RegressorSpec  # noqa: E402
from vramcal.units import format_bytes, parse_bytes  # noqa: E402

SPECS = {
    "default": RegressorSpec(dtype="bf16-autocast"),
    "large": RegressorSpec(d_model=768, n_layers=24, d_state=128, headdim=64, chunk_size=256, seq_len=1024,
                       dtype="bf16-autocast"),
    "tiny": RegressorSpec(d_model=32, n_layers=1, d_state=16, headdim=16, chunk_size=16, seq_len=32),
}
DATA = ROOT / "data" / "es_1s.parquet"
# In this order: the steps that need the default profile run right after it, so a slow large spec cannot starve them.
STEPS = ("device", "data", "estimate", "default", "boundary", "train", "chunk_size", "large", "fused")
# (estimate seconds: the least time a step is started with, weight: its share of the time left) per device kind;
# a step without an entry for a kind does not run on it. Estimates, not measurements: the GPU path has not run on
# a GPU yet; the device run's wall times (in its results) are what to set them from.
TIMES: dict[str, dict[str, tuple[float, float]]] = {
    "device": {"cuda": (20, 0), "host": (10, 0)},  # no weight: it is given its estimate
    "data": {"cuda": (10, 0), "host": (10, 0)},
    # cuda: both paths of default and large, 4 traces of ~5-20 s; a rehearsal's trials need the host's time, so there
    # it reads a kept trace or runs out (a cold trace of the tiny spec: ~10 s of CPU, a minute on the loaded host)
    "estimate": {"cuda": (30, 1), "host": (8, 0)},
    "default": {"cuda": (80, 4), "host": (35, 4)},  # a calibration: its caps' start_s + MIN_TRIALS x trial_s
    "boundary": {"cuda": (30, 1.5), "host": (10, 1.5)},
    "train": {"cuda": (30, 1), "host": (10, 1)},
    "chunk_size": {"cuda": (40, 1), "host": (10, 0.5)},  # a trial per chunk_size and batch size, ~5-15 s each
    "large": {"cuda": (80, 2)},
    "fused": {"cuda": (90, 2)},
}


# ------------------------------------------------------------------ vramcal's API, called from here only

def select_device(gpu: str, capacity_bytes: int | None) -> tuple[Any, str | None]:
    from vramcal import api

    devices, notice = api.select_devices(gpu, capacity_bytes)
    return devices[0], notice


def plan_calibration(device: Any, spec: RegressorSpec, implementation: str, data: str, profiles_dir: Path,
                     reserve_bytes: int) -> Any:
    from vramcal import api

    return api.plan_calibration("regressor", spec.to_dict(), device=device, implementation=implementation,
                                options={"data": data}, profiles_dir=profiles_dir,
                                settings=api.LimitSettings(reserve_bytes=reserve_bytes))


def estimate_main() -> None:
    """In a process of its own (:func:`estimate_specs`): for each spec of ``sys.argv[1]`` (JSON: ``specs`` by name,
    ``data``, ``profiles_dir``, ``reserve_bytes`` and the device's ``kind``, ``name``, ``total_bytes``,
    ``compute_capability``), print one JSON line as soon as it is estimated: ``{name: estimate}``, a card's rows for
    both kernel paths or the host's row, or ``{name: {"error": ...}}``."""
    import json

    from vramcal import api
    from vramcal.estimate.learned import estimate_cards
    from vramcal.records import Device
    from vramcal.report.catalogue import GpuModel

    asked = json.loads(sys.argv[1])
    device = Device(kind=asked["kind"], name=asked["name"], total_bytes=asked["total_bytes"], total_source="the check",
                    compute_capability=asked["compute_capability"])
    cuda = device.kind == "cuda"
    cards = [GpuModel(device.name, device.total_bytes, "the device", device.name, device.compute_capability)]
    for name, spec in asked["specs"].items():
        started = time.monotonic()
        try:
            ref = api.model_ref("regressor", spec, device=device, implementation="transformers")
            found = estimate_cards(ref, {"data": asked["data"]}, cards=cards if cuda else [],
                                   host=None if cuda else device, profiles_dir=asked["profiles_dir"],
                                   settings=api.LimitSettings(reserve_bytes=asked["reserve_bytes"]))
            figures = {"rows": [row.to_dict() for row in found.rows], "formulas": list(found.formulas),
                       "notices": list(found.notices)}
        except Exception as error:  # noqa: BLE001 - recorded, and the next spec is estimated
            figures = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps({name: {**figures, "wall_s": round(time.monotonic() - started, 1)}}), flush=True)


def estimate_specs(ctx: Any, specs: dict[str, RegressorSpec], timeout_s: float) -> dict[str, Any]:
    """The estimates of ``specs`` on the check's device (issue 57: both kernel paths on a card), made before any
    calibration's trials in a process of its own, so that nothing it imports or starts stays in the check's process
    while trials run; those finished within ``timeout_s``, by name (a spec not reached: absent)."""
    import json
    import subprocess

    d = ctx.device
    asked = {"specs": {name: spec.to_dict() for name, spec in specs.items()}, "data": ctx.data,
             "profiles_dir": str(ctx.work / "profiles"), "reserve_bytes": parse_bytes(ctx.args.reserve),
             "kind": d.kind, "name": d.name, "total_bytes": d.total_bytes,
             "compute_capability": getattr(d, "compute_capability", None)}
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import gpu_check; gpu_check.estimate_main()"
    try:
        out = subprocess.run([sys.executable, "-c", code, json.dumps(asked)], capture_output=True, text=True,
                             timeout=max(1.0, timeout_s), cwd=ROOT).stdout
    except subprocess.TimeoutExpired as stopped:
        out = stopped.stdout or ""
        out = out.decode() if isinstance(out, bytes) else out
    found: dict[str, Any] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            found.update(json.loads(line))
    return found


def estimate_step(ctx: Context) -> Step:
    """Every spec the calibrations will run, estimated before their trials (:func:`estimate_specs`): ``default``
    (also the ``fused`` step's) and, on a card, ``large``."""

    def body(given_s: float, partial: dict[str, Any]) -> dict[str, Any]:
        specs = {"default": ctx.spec(), **({"large": SPECS["large"]} if ctx.kind == "cuda" else {})}
        ctx.estimates = estimate_specs(ctx, specs, given_s - 1.0)
        missing = [name for name in specs if name not in ctx.estimates]
        lines = [f"{name}: {estimate_line(held_against_trials(e, '', None))}" for name, e in ctx.estimates.items()]
        return {"estimates": ctx.estimates, "not_reached": missing,
                "summary": "; ".join(lines + [f"{name}: not estimated in the time given" for name in missing])}

    return Step("estimate", TIMES["estimate"], body, needs=("device", "data"))


def held_against_trials(estimate: dict[str, Any], implementation: str, profile: Any) -> dict[str, Any]:
    """``estimate`` (:func:`estimate_specs`) beside a calibration's measurement (``profile``, or None before one):
    each row's estimated peak at the verified safe size (``fixed + slope × safe``) against the verification's
    measured peak there; the error of the row of the path the trials ran (``implementation``; the host's row on the
    host) and whether its bound covers it; each row's bytes per sample and the two paths' ratio."""
    check = profile.verification.get("safe") if profile is not None else None
    rows = [dict(row) for row in estimate.get("rows", [])]
    for row in rows:
        if check is not None and check.peak_bytes:
            row["estimated_peak_at_safe"] = int(row["fixed_bytes"] + row["slope_bytes_per_sample"] * check.batch_size)
            row["error_at_safe"] = row["estimated_peak_at_safe"] / check.peak_bytes - 1
    ran = next((r for r in rows if r["path"] in ("", implementation) and "error_at_safe" in r), None)
    slopes = {r["path"] or "host": r["slope_bytes_per_sample"] for r in rows}
    return {**estimate, "rows": rows, "path": implementation, "measured_safe": check and check.batch_size,
            "measured_peak": check and check.peak_bytes, "error": ran and ran["error_at_safe"],
            "inside_bound": ran is not None and ran["bound"]["low"] <= ran["error_at_safe"] <= ran["bound"]["high"],
            "bytes_per_sample": slopes,
            "ratio": slopes["transformers"] / slopes["mamba_ssm"] if slopes.get("mamba_ssm") and "transformers" in
            slopes else None}


def estimate_line(figures: dict[str, Any]) -> str:
    if not figures.get("rows"):
        return f"estimate: {figures.get('error') or 'none before the trials (the estimate step did not reach it)'}"
    each = ", ".join(f"{path}: {bps / 2**20:.2f} MiB/sample" for path, bps in figures["bytes_per_sample"].items())
    ratio = f" (ratio {figures['ratio']:.1f}x)" if figures.get("ratio") else ""
    error = (f"; {figures['error']:+.1%} of the measured peak at safe {figures['measured_safe']}, "
             f"{'inside' if figures['inside_bound'] else 'OUTSIDE'} its bound" if figures["error"] is not None else "")
    return f"estimate ({figures.get('wall_s')} s) {each}{ratio}{error}"


def run_calibration(plan: Any, settings: dict[str, Any], on_trial: Any) -> Any:
    """The calibration with the trial settings ``settings`` (:class:`vramcal.records.TrialSettings` fields)."""
    from vramcal import api
    from vramcal.records import TrialSettings

    return api.run_calibration(dataclasses.replace(plan, trials=TrialSettings(**settings)), on_trial=on_trial)


def plan_training(device: Any, spec: RegressorSpec, implementation: str, data: str, profiles_dir: Path,
                  run_dir: Path) -> Any:
    from vramcal.train.config import TrainConfig
    from vramcal.train.plan import plan_run, resolve

    # stride 1 on a GPU: 27,000 windows of the E-mini sample, so the conservative batch size is not capped by the data
    # (an epoch that would not fit the step's time is cut: gpu_check_policy.epoch_cut); the host keeps the default
    config = TrainConfig(data=data, spec=spec, gpu="auto" if device.kind == "cuda" else "none",
                         implementation=implementation, profiles_dir=str(profiles_dir), epochs=1,
                         stride=1 if device.kind == "cuda" else None, report_to=())  # the image has no tensorboard
    return plan_run(config, run_dir, resolve(config))


def trial_runner(plan: Any) -> Callable[..., Any]:
    """``run(batch_size, timeout_s, purpose, measured_steps=2) -> Trial``: one real trial of the calibration's
    step on its whole device (seconds)."""
    import json

    from vramcal.api import worker_pool
    from vramcal.measure.trial import TrialRequest, TrialRunner
    from vramcal.records import TrialSettings

    runner = TrialRunner(worker_pool())
    template = TrialRequest(plan.model, 1, plan.device, json.dumps(plan.options, sort_keys=True))

    def run(batch_size: int, timeout_s: float, purpose: str, measured_steps: int = 2) -> Any:
        settings = TrialSettings(measured_steps=measured_steps, timeout_s=timeout_s)
        (trial,) = runner.run(dataclasses.replace(template, batch_size=batch_size, settings=settings), purpose=purpose)
        return trial

    return run


# ---------------------------------------------------------------------------------------------- the steps

@dataclass
class Context:
    """What the steps hand on: the device, the bars, the calibrations."""

    args: argparse.Namespace
    work: Path
    device: Any = None
    data: str | None = None
    calibrations: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    estimates: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.device.kind if self.device is not None else "cuda"

    @property
    def triton_dir(self) -> Path:
        return self.work / "triton-cache"

    def spec(self) -> RegressorSpec:
        """The default step's spec: ``--spec`` on a GPU or when tiny; fp32 on the host (bf16 autocast is CUDA's)."""
        return SPECS[self.args.spec] if self.kind == "cuda" or self.args.spec == "tiny" else RegressorSpec()


def printer(trial: Any) -> None:
    peak = format_bytes(trial.peak_bytes) if trial.peak_bytes else "-"
    print(f"  batch_size {trial.batch_size:>6} {trial.status:<7} peak {peak:>10} [{trial.purpose}, "
          f"{trial.wall_s:.1f} s]", flush=True)


def device_step(ctx: Context) -> Step:
    def body(given_s: float, partial: dict[str, Any]) -> dict[str, Any]:
        args = ctx.args
        ctx.device, notice = select_device(args.gpu, parse_bytes(args.capacity) if args.capacity else None)
        d = ctx.device
        return {"device": d.to_dict(), "notice": notice,
                "summary": f"{d.name} ({d.kind}), {format_bytes(d.total_bytes)}" + (f"; {notice}" if notice else "")}

    return Step("device", TIMES["device"], body)


def data_step(ctx: Context) -> Step:
    def body(given_s: float, partial: dict[str, Any]) -> dict[str, Any]:
        path = Path(ctx.args.data)
        if path.is_file():
            ctx.data = str(path.resolve())
            return {"path": ctx.data, "synthetic": False, "summary": f"bars from {ctx.data}"}
        from vramcal.models.regressor.bars import synthetic_bars, write_parquet

        bars = synthetic_bars()
        ctx.data = str(write_parquet(bars, ctx.work / "bars-synthetic.parquet").resolve())
        why = (f"no {path} (data/ is git-ignored, so a copied working tree lacks it): {len(bars):,} synthetic "
               f"1-s bars (vramcal.models.regressor.bars.synthetic_bars, the E-mini sample's size) written to "
               f"{ctx.data}")
        return {"path": ctx.data, "synthetic": True, "bars": len(bars), "summary": why}

    return Step("data", TIMES["data"], body)


def calibration_step(ctx: Context, name: str, spec: Callable[[], RegressorSpec], implementation: str,
                     caps: Callable[[], Caps], unavailable: Callable[[], str | None] = lambda: None) -> Step:
    """A calibration as the product runs it, with ``--steady-steps 0``, then its steady trial on its own.

    The calibration (profile and report into the work folder) is complete before the steady trial starts, so a
    slow steady trial cannot cost the profile (a calibration stopped at its time limit leaves none). The steady
    trial then runs at the verified safe size, as many measured steps as fit a third of the step's time left by the
    calibration's own step times (``gpu_check_policy.steady_steps_that_fit``), with a timeout inside the step's time;
    its step creep (``vramcal.calibration.creep``'s measure_creep) is recorded beside the profile (not in it); the
    spec's estimate (:func:`estimate_step`) is held against it. ``spec``, ``caps``: read when the step starts.
    """

    def body(given_s: float, partial: dict[str, Any]) -> dict[str, Any]:
        from vramcal.report import write_report

        deadline = time.monotonic() + given_s
        the_caps = caps()
        settings = trial_settings(the_caps, min(given_s, the_caps.given_s or given_s))
        rows = partial.setdefault("trials", [])
        partial.update(settings=settings, triton_cache_before=cache_files(ctx.triton_dir))

        def on_trial(trial: Any) -> None:
            printer(trial)
            rows.append(trial_row(trial, 2))

        started = time.monotonic()
        plan = plan_calibration(ctx.device, spec(), implementation, ctx.data, ctx.work / "profiles",
                                parse_bytes(ctx.args.reserve))
        profile = run_calibration(plan, {**settings, "steady_steps": 0}, on_trial)
        wall_s = time.monotonic() - started
        write_report([profile], ctx.work / "reports")
        ctx.calibrations[name] = (plan, profile)
        limits, times = profile.limits, first_and_later(rows)
        figures = {
            "profile": str(plan.path), "wall_s": round(wall_s, 1), "trials": len(profile.trials), "settings": settings,
            "kernel_path": profile.kernel_path, "verified": profile.verified,
            "formula": profile.fit and profile.fit.formula(),
            "safe": limits and limits.safe_batch_size, "conservative": limits and limits.conservative_batch_size,
            "predicted_boundary": limits and limits.boundary_batch_size, "environment": profile.environment,
            "trial_wall_s": times, "sequence": rows}
        partial["calibration"] = figures  # kept if the steady trial is stopped
        figures["estimate"] = held_against_trials(ctx.estimates.get("large" if name == "large" else "default", {}),
                                                  implementation, profile)
        figures["steady"] = steady_trial(plan, profile, settings["steady_steps"], deadline)
        figures["triton_cache"] = {"before": partial["triton_cache_before"], "after": cache_files(ctx.triton_dir)}
        figures["summary"] = f"{calibration_line(figures)}; {estimate_line(figures['estimate'])}"
        return figures

    return Step(name, TIMES[name], body, needs=("device", "data"), unavailable=unavailable)


def steady_trial(plan: Any, profile: Any, most_steps: int, deadline: float) -> dict[str, Any]:
    """The steady trial after a calibration (:func:`calibration_step`): its figures, or why it did not run."""
    from vramcal.calibration.creep import STEADY, measure_creep

    safe = profile.limits.safe_batch_size if profile.limits and profile.verified else None
    if safe is None:
        return {"ran": False, "reason": "no verified safe size"}
    left_s = deadline - time.monotonic()
    steps, reason = steady_steps_that_fit(profile.trials, safe, left_s, most_steps)
    if not steps:
        return {"ran": False, "reason": reason}
    trial = trial_runner(plan)(safe, max(5.0, left_s - 3.0), purpose=STEADY, measured_steps=steps)
    printer(trial)
    creep = measure_creep([*profile.trials, trial])
    return {"ran": True, "batch_size": safe, "steps": steps, "trial": trial_row(trial, steps),
            "creep": creep and creep.to_dict(), "creep_bytes": creep and creep.bytes_at_steady}


def calibration_line(figures: dict[str, Any]) -> str:
    settings, times, steady = figures["settings"], figures["trial_wall_s"], figures["steady"]
    boundary = f"{figures['predicted_boundary']:.1f}" if figures["predicted_boundary"] else "-"
    if steady["ran"]:
        creep = steady["creep_bytes"]
        steady_text = (f"steady trial {steady['steps']} steps at {steady['batch_size']}: "
                       f"{steady['trial']['status']}" + (f", creep {format_bytes(creep)}" if creep is not None else ""))
    else:
        steady_text = f"no steady trial ({steady['reason']})"
    return (f"{figures['wall_s']:.0f} s, {figures['trials']} trials (at most {settings['max_trials']}, "
            f"{settings['timeout_s']:.0f} s per trial), safe {figures['safe']}, conservative "
            f"{figures['conservative']}, verified {figures['verified']}, predicted boundary {boundary}, kernel path "
            f"{figures['kernel_path']}; `{figures['formula']}`; first trial {times['first_s']:.1f} s, later median "
            f"{times['later_median_s']} s; {steady_text}")


def boundary_step(ctx: Context) -> Step:
    def body(given_s: float, partial: dict[str, Any]) -> dict[str, Any]:
        plan, profile = ctx.calibrations["default"]
        deadline = time.monotonic() + given_s
        run = trial_runner(plan)
        timeout_s = (HOST if ctx.kind == "host" else CUDA).trial_timeout_s
        found = bisect_boundary(profile.trials, plan.device.total_bytes,
                                profile.limits and profile.limits.boundary_batch_size,
                                lambda size: run(size, min(timeout_s, max(1.0, deadline - time.monotonic())),
                                                 "boundary-bisection"),
                                lambda: deadline - time.monotonic(), partial, on_trial=printer)
        found["trial_wall_s"] = first_and_later(found["trials"])
        found["summary"] = boundary_line(found)
        return found

    return Step("boundary", TIMES["boundary"], body, needs=("default",))


def train_step(ctx: Context) -> Step:
    def body(given_s: float, partial: dict[str, Any]) -> dict[str, Any]:
        from vramcal.train.runner import train

        _, profile = ctx.calibrations["default"]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        plan = plan_training(ctx.device, ctx.spec(), "transformers", ctx.data, ctx.work / "profiles",
                             ctx.work / "runs" / f"train-{stamp}")
        cut = epoch_cut(profile.trials, plan.batch_size, int(plan.data_stats["train_windows"]), given_s)
        if cut is not None:
            plan = dataclasses.replace(plan, config=plan.config.replace(max_steps=cut))
        partial.update(batch_size=plan.batch_size, max_steps=cut, run_dir=str(plan.run_dir))
        started = time.monotonic()
        result = train(plan, echo=lambda line: print(f"  {line}", flush=True))
        sizing, peak = plan.sizing, result.peak_bytes
        error = 100 * (peak - sizing.predicted_peak_bytes) / sizing.predicted_peak_bytes if peak else None
        figures = {"batch_size": sizing.batch_size, "predicted_peak_bytes": sizing.predicted_peak_bytes,
                   "upper_bytes": sizing.upper_bytes, "usable_bytes": sizing.usable_bytes, "measured_peak_bytes": peak,
                   "steps": result.steps, "max_steps": cut, "wall_s": round(time.monotonic() - started, 1),
                   "error_pct": error, "within_upper_bound": peak is not None and peak <= sizing.upper_bytes,
                   "last": result.last}
        what = f"{result.steps} steps (an epoch cut to fit the time)" if cut else f"one epoch ({result.steps} steps)"
        figures["summary"] = (f"{what} at batch {sizing.batch_size}: measured peak "
                              f"{format_bytes(peak) if peak else '-'} against predicted "
                              f"{format_bytes(sizing.predicted_peak_bytes)}"
                              f"{f' ({error:+.1f} %)' if error is not None else ''}, upper bound "
                              f"{format_bytes(sizing.upper_bytes)}")
        return figures

    return Step("train", TIMES["train"], body, needs=("default",))


def chunk_size_step(ctx: Context) -> Step:
    """The chunk_size study (module docstring, step 6; ``bench/chunk_size.py``)."""

    def body(given_s: float, partial: dict[str, Any]) -> dict[str, Any]:
        from bench.chunk_size import chunk_sizes_for, study, table
        from bench.chunk_size import trial_runner as chunk_trials

        _, profile = ctx.calibrations["default"]
        deadline, spec = time.monotonic() + given_s, ctx.spec()
        high = max(2, profile.limits.conservative_batch_size // 2)
        sizes, fused = (max(1, high // 4), high), fused_unavailable(ctx) is None
        implementation = "mamba_ssm" if fused else "transformers"
        cap = (HOST if ctx.kind == "host" else CUDA).trial_timeout_s
        run = chunk_trials(ctx.device, implementation, ctx.data,
                           lambda: min(cap, max(1.0, deadline - time.monotonic() - 2.0)))
        partial.update(implementation=implementation, batch_sizes=list(sizes))
        rows = study(run, spec, chunk_sizes_for(spec), sizes, echo=lambda line: print(line, flush=True),
                     stop=lambda: deadline - time.monotonic() < 5.0)
        each = "; ".join(f"{r['chunk_size']}: " + ("-" if r["bytes_per_sample"] is None else
                                                  f"{r['bytes_per_sample'] / 2**20:.2f} MiB/sample") +
                         ("" if r["samples_per_s"] is None else f", {r['samples_per_s']:.1f} samples/s")
                         for r in rows)
        return {"implementation": implementation, "batch_sizes": list(sizes), "rows": rows,
                "table": table(rows, spec.chunk_size),
                "summary": f"{implementation}, batch {sizes[0]} and {sizes[1]}, per chunk_size: {each}"}

    return Step("chunk_size", TIMES["chunk_size"], body, needs=("default",))


def fused_unavailable(ctx: Context) -> str | None:
    from vramcal.models.mamba2 import mamba_ssm_available

    if ctx.kind != "cuda":
        return "the fused kernels run on a GPU only"
    if not mamba_ssm_available():
        return "mamba_ssm or causal_conv1d does not import (their wheels are not carried: make gpu-fused-wheels)"
    return None


def steps(ctx: Context) -> list[Step]:
    return [device_step(ctx), data_step(ctx), estimate_step(ctx),
            calibration_step(ctx, "default", ctx.spec, "transformers", lambda: HOST if ctx.kind == "host" else CUDA),
            boundary_step(ctx), train_step(ctx), chunk_size_step(ctx),
            calibration_step(ctx, "large", lambda: SPECS["large"], "transformers", lambda: CUDA),
            calibration_step(ctx, "fused", ctx.spec, "mamba_ssm", lambda: FUSED,
                             unavailable=lambda: fused_unavailable(ctx))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results: gpu_check.json, GPU_CHECK.md, the bundle")
    parser.add_argument("--work", type=Path, default=None, help="profiles, reports, runs, caches (default <out>.work)")
    parser.add_argument("--budget-s", type=float, default=450, help="the whole check ends within this (seconds)")
    parser.add_argument("--setup-s", type=float, default=None, help="seconds gpu_check.sh spent before it (recorded)")
    parser.add_argument("--gpu", default="auto", help="auto, or none to rehearse on the host")
    parser.add_argument("--capacity", default=None, help="the host budget for a rehearsal, e.g. 2.5GiB")
    parser.add_argument("--reserve", default="0.5GiB", help="memory the calibrations keep free (vramcal probe's)")
    parser.add_argument("--spec", default="default", choices=("default", "tiny"))
    parser.add_argument("--data", default=str(DATA), help="OHLCV bars (missing: synthetic bars are written)")
    parser.add_argument("--inject-error", choices=STEPS, default=None, help="make this step fail (a rehearsal)")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    for option in ("capacity", "reserve"):
        try:
            if getattr(args, option) is not None:
                parse_bytes(getattr(args, option))
        except ValueError as error:
            parser.error(f"--{option}: {error}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    work = (args.work or out.with_name(out.name + ".work")).resolve()
    try:
        work.mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"cannot create {error.filename} ({error.strerror}): give another --out or --work", file=sys.stderr)
        return 1
    check = Check(out, work, args.budget_s, " ".join(["scripts/gpu_check.py", *(argv or sys.argv[1:])]))
    ctx = Context(args, work)
    # before the first trial process: the fork server, and every worker forked from it, inherit it; vramcal's GPU
    # workers keep Triton's autotuning results there too (TRITON_CACHE_AUTOTUNING=1, recorded in each profile)
    os.environ["TRITON_CACHE_DIR"] = str(ctx.triton_dir)
    check.results["notes"]["triton"] = (f"TRITON_CACHE_DIR={ctx.triton_dir}; vramcal's GPU workers set "
                                        f"TRITON_CACHE_AUTOTUNING=1 (compiled kernels and autotuning results kept "
                                        f"across trial processes)")
    check.results["setup_s"] = args.setup_s  # gpu_check.sh's wheels, preflight and nvidia-smi, before this started
    try:
        run_steps(check, steps(ctx), lambda: ctx.kind, inject=args.inject_error)
    except KeyboardInterrupt:
        print(f"interrupted: {out / 'gpu_check.json'} keeps what finished", file=sys.stderr)
        return 130
    print((out / "GPU_CHECK.md").read_text(), flush=True)
    failed = [name for name, entry in check.results["steps"].items() if entry["status"] in ("error", "stopped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
