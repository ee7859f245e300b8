"""The device run (issue 11): everything a lent H200 should establish, in one script and one output folder.

In order, each step skipped (and said so) when the time budget is spent:

1. calibrate the default spec (bf16 autocast) on the whole card, timed: profile and report;
2. calibrate a large spec that uses a real share of the card (d_model 768, 24 layers, seq_len 1024);
3. bisect the true out-of-memory boundary of the default spec with real trials on the whole card, to
   compare with the profile's predicted boundary;
4. train the default spec for one epoch at its conservative batch size with ``vramcal train``'s own
   runner, and compare the trainer's measured peak with the profile's prediction and upper bound;
5. the fused path (``--impl mamba_ssm``) when its carried wheels import: calibrate the default spec.

Writes ``<out>/profiles/``, ``<out>/reports/``, ``<out>/gpu_check.json`` (every figure) and
``<out>/GPU_CHECK.md`` (the summary), the JSON after every step so a killed run keeps what it did.
``--gpu none --capacity 1.5GiB --spec tiny`` rehearses the whole script on a CPU host.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vramcal import api  # noqa: E402
from vramcal.files import atomic_write_json, atomic_write_text  # noqa: E402
from vramcal.models.regressor import ModelSpec  # noqa: E402
from vramcal.units import format_bytes, parse_bytes  # noqa: E402

SPECS = {
    "default": ModelSpec(dtype="bf16-autocast"),
    "large": ModelSpec(d_model=768, n_layers=24, d_state=128, headdim=64, chunk_size=256, seq_len=1024,
                       dtype="bf16-autocast"),
    "tiny": ModelSpec(d_model=32, n_layers=1, d_state=16, headdim=16, chunk_size=16, seq_len=32),
}
DATA = Path("data/es_1s.parquet")


class Run:
    """The results so far, written after every step."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.deadline, self.started = out, time.time() + budget_s, time.time()
        self.results: dict[str, Any] = {"command": " ".join(sys.argv), "steps": {}}

    def left_s(self) -> float:
        return self.deadline - time.time()

    def record(self, name: str, figures: dict[str, Any]) -> None:
        self.results["steps"][name] = figures
        self.results["elapsed_s"] = time.time() - self.started
        atomic_write_json(self.out / "gpu_check.json", self.results)
        print(f"== {name}: {json.dumps(figures, default=str)[:600]}", flush=True)


def printer(trial) -> None:
    peak = format_bytes(trial.peak_bytes) if trial.peak_bytes else "-"
    print(f"  batch_size {trial.batch_size:>6} {trial.status:<7} peak {peak:>10} [{trial.purpose}, "
          f"{trial.wall_s:.1f} s]", flush=True)


def calibrate(run: Run, device, spec: ModelSpec, implementation: str, options: dict[str, Any]) -> tuple[Any, Any, dict]:
    """A calibration timed as the product runs it; profile and report into the output folder."""
    from vramcal.report import write_report

    started = time.time()
    plan = api.plan_calibration("regressor", spec.to_dict(), device=device, implementation=implementation,
                                options=options, profiles_dir=run.out / "profiles")
    profile = api.run_calibration(plan, on_trial=printer, max_trials=16, timeout_s=min(300, max(60, run.left_s())))
    write_report([profile], run.out / "reports")
    limits = profile.limits
    return plan, profile, {
        "profile": str(plan.path), "wall_s": time.time() - started, "trials": len(profile.trials),
        "kernel_path": profile.kernel_path, "verified": profile.verified,
        "formula": profile.fit and profile.fit.formula(),
        "safe": limits and limits.safe_batch_size, "conservative": limits and limits.conservative_batch_size,
        "predicted_boundary": limits and limits.boundary_batch_size, "environment": profile.environment,
        "creep": profile.creep and profile.creep.to_dict(),
        "sequence": [(t.batch_size, t.status, t.purpose, t.peak_bytes) for t in profile.trials]}


def bisect_boundary(run: Run, plan, profile, runner) -> dict[str, Any]:
    """The largest batch size whose real trial finishes on the whole budget (bisection to 1 %)."""
    from vramcal.measure.trial import TrialRequest

    template = TrialRequest(plan.model, 1, plan.device, json.dumps(plan.options, sort_keys=True),
                            host_memory_limit_bytes=plan.device.total_bytes if plan.device.kind == "host" else None)
    ok = [t.batch_size for t in profile.trials if t.ok and t.peak_bytes <= plan.device.total_bytes]
    failed = [t.batch_size for t in profile.trials if not t.ok]
    low, high = max(ok), min(failed) if failed else None
    trials = []
    probe = max(low + 1, math.ceil(profile.limits.boundary_batch_size * 1.03)) if high is None else None
    while run.left_s() > 30:
        size = probe if high is None else (low + high) // 2
        if high is not None and high - low <= max(1, math.ceil(0.01 * low)):
            break
        trial = runner.run(template.with_batch_size(size), purpose="boundary-bisection")
        printer(trial)
        trials.append((size, trial.status, trial.peak_bytes))
        if trial.ok and trial.peak_bytes <= plan.device.total_bytes:
            low, probe = size, size * 2
        else:
            high = size
    predicted = profile.limits.boundary_batch_size
    return {"largest_ok": low, "smallest_failed": high, "predicted": predicted,
            "error_pct": 100 * (predicted - low) / low if low else None, "trials": trials,
            "complete": high is not None and high - low <= max(1, math.ceil(0.01 * low))}


def train_one_epoch(run: Run, device, spec: ModelSpec, implementation: str, profiles: Path, data: str | None):
    """One epoch of ``vramcal train`` at the profile's conservative size; the trainer's peak against the profile."""
    from vramcal.train.config import TrainConfig
    from vramcal.train.plan import plan_run, resolve
    from vramcal.train.runner import train

    # stride 1: 27,000 windows of the E-mini sample, so the conservative batch size is not capped by the data
    config = TrainConfig(data=data, spec=spec, gpu="auto" if device.kind == "cuda" else "none",
                         implementation=implementation, profiles_dir=str(profiles), epochs=1, stride=1)
    plan = plan_run(config, run.out / "runs" / f"{spec.dtype}-{implementation}", resolve(config))
    started = time.time()
    result = train(plan, echo=lambda line: print(f"  {line}", flush=True))
    sizing = plan.sizing
    return {"batch_size": sizing.batch_size, "predicted_peak_bytes": sizing.predicted_peak_bytes,
            "upper_bytes": sizing.upper_bytes, "usable_bytes": sizing.usable_bytes,
            "measured_peak_bytes": result.peak_bytes, "steps": result.steps, "wall_s": time.time() - started,
            "error_pct": 100 * (result.peak_bytes - sizing.predicted_peak_bytes) / sizing.predicted_peak_bytes,
            "within_upper_bound": result.peak_bytes <= sizing.upper_bytes, "last": result.last}


def summary(results: dict[str, Any]) -> str:
    """GPU_CHECK.md: the figures issue 11 asks for."""
    steps = results["steps"]
    lines = ["# GPU check", "", f"Command: `{results['command']}`", "", f"Device: {steps.get('device', {})}", ""]
    for name in ("default", "large", "fused"):
        if name in steps:
            s = steps[name]
            lines.append(f"- calibration `{name}`: {s['wall_s']:.1f} s, {s['trials']} trials, safe {s['safe']}, "
                         f"conservative {s['conservative']}, verified {s['verified']}, kernel path "
                         f"{s['kernel_path']}; `{s['formula']}`")
    if "boundary" in steps:
        b = steps["boundary"]
        lines.append(f"- boundary (default spec): predicted {b['predicted']:.1f}, bisected largest ok "
                     f"{b['largest_ok']}, smallest failed {b['smallest_failed']} ({'' if b['complete'] else 'not '}"
                     f"complete), error {b['error_pct'] and round(b['error_pct'], 2)} %")
    if "train" in steps:
        t = steps["train"]
        lines.append(f"- training one epoch at batch {t['batch_size']}: measured peak "
                     f"{format_bytes(t['measured_peak_bytes'])} against predicted "
                     f"{format_bytes(t['predicted_peak_bytes'])} ({t['error_pct']:+.1f} %) and upper bound "
                     f"{format_bytes(t['upper_bytes'])}")
    lines += [f"- skipped: {', '.join(results.get('skipped', [])) or 'nothing'}",
              f"- elapsed: {results['elapsed_s']:.0f} s"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=450, help="stop starting steps after this")
    parser.add_argument("--gpu", default="auto", help="auto, or none to rehearse on the host")
    parser.add_argument("--capacity", default=None, help="a budget (host rehearsal)")
    parser.add_argument("--spec", default="default", choices=("default", "tiny"))
    args = parser.parse_args()
    run = Run(args.out, args.budget_s)
    (device,), notice = api.select_devices(args.gpu, parse_bytes(args.capacity) if args.capacity else None)
    run.record("device", {"device": device.to_dict(), "notice": notice})
    data = str(DATA.resolve()) if DATA.is_file() else None
    options = {"data": data}
    spec = SPECS[args.spec] if device.kind == "cuda" or args.spec == "tiny" else ModelSpec()
    names = [("default", spec, "transformers")]
    if device.kind == "cuda":
        names.append(("large", SPECS["large"], "transformers"))
    from vramcal.measure.trial import TrialRunner
    from vramcal.models.mamba2 import mamba_ssm_available

    plans: dict[str, Any] = {}
    run.results["skipped"] = []
    for name, the_spec, implementation in names:
        if run.left_s() < 60:
            run.results["skipped"].append(name)
            continue
        plan, profile, figures = calibrate(run, device, the_spec, implementation, options)
        plans[name] = (plan, profile)
        run.record(name, figures)
    if "default" in plans and run.left_s() > 60:
        run.record("boundary", bisect_boundary(run, *plans["default"], TrialRunner(timeout_s=300)))
    else:
        run.results["skipped"].append("boundary")
    if "default" in plans and run.left_s() > 45:
        run.record("train", train_one_epoch(run, device, spec, "transformers", run.out / "profiles", data))
    else:
        run.results["skipped"].append("train")
    if device.kind == "cuda" and mamba_ssm_available() and run.left_s() > 60:
        run.record("fused", calibrate(run, device, spec, "mamba_ssm", options)[2])
    else:
        run.results["skipped"].append("fused (wheels absent or no time)" if device.kind == "cuda" else "fused (host)")
    atomic_write_json(run.out / "gpu_check.json", run.results)
    atomic_write_text(run.out / "GPU_CHECK.md", summary(run.results))
    print(summary(run.results))


if __name__ == "__main__":
    main()
