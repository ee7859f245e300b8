"""GPU check: calibrate two model sizes on GPU 0 and find the true out-of-memory boundary of one.

Run from the source tree on a machine with an NVIDIA GPU (see scripts/gpu_check.sh). Writes profiles
and reports under OUT (default: the repo's profiles/ and reports/), and prints the predicted safe
batch size against the true boundary found by bisection with real trials on the whole card.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from vramcal.calibrate.limits import LimitSettings
from vramcal.calibrate.probe import calibrate
from vramcal.cli.console import summary
from vramcal.measure.device import select
from vramcal.measure.trial import TrialRequest, TrialRunner
from vramcal.models.mamba2 import resolve_implementation
from vramcal.models.regressor import ModelSpec
from vramcal.profile import profile_path, save_profile

SPECS = {
    "default": ModelSpec(dtype="bf16-autocast"),
    "large": ModelSpec(d_model=768, n_layers=24, d_state=128, headdim=64, chunk_size=256, seq_len=1024,
                       dtype="bf16-autocast"),
}


def true_boundary(runner: TrialRunner, template: TrialRequest, low: int, total_bytes: int,
                  deadline: float) -> tuple[int, int | None, list]:
    """Largest batch size whose real trial finishes on the whole card (bisection to 1 %).

    ``low`` must be known to run. Returns (largest ok, smallest failed or None if time ran out, trials).
    """
    trials, high = [], None
    probe = max(low + 1, int(low * 1.5))
    while high is None and time.time() < deadline:
        trial = runner.run(TrialRequest(**{**template.__dict__, "batch_size": probe}), purpose="boundary")
        trials.append(trial)
        print(f"  boundary trial batch_size {probe}: {trial.status} "
              f"peak {trial.peak_bytes and trial.peak_bytes / 2**30:.2f} GiB", flush=True)
        if trial.ok and trial.peak_bytes <= total_bytes:
            low, probe = probe, probe * 2
        else:
            high = probe
    while high is not None and high - low > max(1, math.ceil(0.01 * low)) and time.time() < deadline:
        middle = (low + high) // 2
        trial = runner.run(TrialRequest(**{**template.__dict__, "batch_size": middle}), purpose="boundary")
        trials.append(trial)
        print(f"  boundary trial batch_size {middle}: {trial.status}", flush=True)
        if trial.ok and trial.peak_bytes <= total_bytes:
            low = middle
        else:
            high = middle
    return low, high, trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--budget-s", type=float, default=450, help="stop starting trials after this")
    parser.add_argument("--impl", default="auto")
    args = parser.parse_args()
    started = time.time()
    (device,), _ = select("0")
    results = {}
    runner = TrialRunner(timeout_s=120)
    for name, spec in SPECS.items():
        implementation = resolve_implementation(args.impl, "cuda")
        profile = calibrate(device, spec, implementation, LimitSettings(), runner=runner, max_trials=12,
                            on_trial=lambda t: print(f"  batch_size {t.batch_size} {t.status} "
                                                     f"peak {t.peak_bytes} [{t.purpose}]", flush=True))
        path = save_profile(profile, profile_path(args.out / "profiles", device, spec, implementation))
        print(summary(profile), f"\nprofile: {path}", flush=True)
        results[name] = {"profile": str(path), "safe": profile.limits.safe_batch_size,
                         "conservative": profile.limits.conservative_batch_size,
                         "predicted_boundary": profile.limits.boundary_batch_size}
        try:
            from vramcal.report import write_report

            write_report([profile], args.out / "reports")
        except ImportError:
            pass
    name = "default"
    template = TrialRequest(SPECS[name], resolve_implementation(args.impl, "cuda"), 1, device)
    low, high, _ = true_boundary(runner, template, results[name]["safe"], device.total_bytes,
                                 deadline=started + args.budget_s)
    results[name].update({"true_boundary_ok": low, "true_boundary_failed": high})
    print(f"{name}: predicted safe {results[name]['safe']}, conservative {results[name]['conservative']}, "
          f"predicted boundary {results[name]['predicted_boundary']:.0f}; true boundary: largest ok {low}, "
          f"smallest failed {high}", flush=True)
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
