"""Benchmark: the trainer at the calibrated conservative batch size against the seeds' batch size of 96.

Prints figures; asserts nothing. On one machine, in one invocation, it runs ``vramcal train`` twice on
the same bars, each in a fresh process (so one run's peak does not carry into the other's VmHWM or
allocator), for ``--steps`` optimizer steps:

1. at the profile's conservative batch size (``--batch-size auto``);
2. at batch size 96 (the seed documents' choice; clamped like any explicit batch size).

and prints, per run, samples/s as the trainer measured it (``samples_per_s`` of ``metrics.jsonl``:
all samples over the wall time of all steps, the first one included, which also allocates the AdamW
state) and at the median step (``batch / step_s_median``), the real run's peak memory (``peak_bytes``:
VmHWM on the host, NVML/allocator on a GPU), and the profile's prediction for that batch size (point
estimate and upper 95 % bound).

    .venv/bin/python bench/train_throughput.py --data data/es_1s.parquet --gpu none --steps 4 --stride 8

A trial runs the trainer's own program (the same factory, data pipeline, worker process and meter), so
the peak should sit within a few per cent of the prediction; ``vramcal train`` prints the same
comparison after its first epoch.

``--stride 8`` gives ~3,400 training windows on the 1-s E-mini bars, so a conservative batch of
several hundred still fills whole batches.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from vramcal import api
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.units import format_bytes

SEED_BATCH_SIZE = 96


def run_trainer(args: argparse.Namespace, batch: str, run_dir: Path) -> dict:
    """One ``vramcal train`` run in a fresh process; returns its last epoch row and run record."""
    command = [sys.executable, "-m", "vramcal", "train", "--data", args.data, "--gpu", args.gpu, "--impl", args.impl,
               "--profile", args.profile, "--profiles-dir", args.profiles_dir, "--batch-size", batch,
               "--max-steps", str(args.steps), "--epochs", "1", "--run-dir", str(run_dir),
               *(["--stride", str(args.stride)] if args.stride else []), *args.spec_args]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vramcal train --batch-size {batch} failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    record = json.loads((run_dir / "run.json").read_text())
    return {"row": [r for r in rows if r["kind"] == "epoch"][-1], "record": record,
            "oom": [r for r in rows if r["kind"] == "oom"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/es_1s.parquet")
    parser.add_argument("--gpu", default="auto")
    parser.add_argument("--profile", default="auto")
    parser.add_argument("--profiles-dir", default="profiles")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--impl", default="auto")
    parser.add_argument("spec_args", nargs="*", help="model options after --, as for vramcal train")
    args = parser.parse_args()
    spec = _spec(args.spec_args)

    device = api.select_devices(args.gpu)[0][0]
    located = api.locate_profile("regressor", spec.to_dict(), device=device, implementation=args.impl,
                                 profiles_dir=args.profiles_dir, path=None if args.profile == "auto" else args.profile)
    profile, path = located.profile, located.path
    print(f"device: {device.name}; model: {spec.short()} [{profile.implementation}]")
    print(f"profile: {path}\n  {profile.fit.formula()}; conservative {profile.limits.conservative_batch_size}, "
          f"safe {profile.limits.safe_batch_size}, usable {format_bytes(profile.limits.usable_bytes)}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="vramcal-bench-") as tmp:
        for name, batch in (("conservative", "auto"), ("seeds' 96", str(SEED_BATCH_SIZE))):
            results[name] = run_trainer(args, batch, Path(tmp) / name.replace("'", "").replace(" ", "-"))
    print(f"\n{'run':<14}{'batch':>7}{'steps':>7}{'samples/s':>11}{'median':>9}{'peak':>12}{'predicted':>12}"
          f"{'upper 95%':>12}{'peak/pred':>10}")
    for name, result in results.items():
        row = result["row"]
        batch = row["batch_size"]
        predicted, upper = profile.fit.predict(batch), profile.fit.upper(batch)
        median_rate = batch / row["step_s_median"]
        print(f"{name:<14}{batch:>7}{row['step']:>7}{row['samples_per_s']:>11.1f}{median_rate:>9.1f}"
              f"{format_bytes(row['peak_bytes']):>12}{format_bytes(predicted):>12}{format_bytes(upper):>12}"
              f"{row['peak_bytes'] / predicted:>10.3f}")
        if result["oom"]:
            print(f"  out-of-memory fallbacks: {result['oom']}")
    conservative, seed = results["conservative"]["row"], results["seeds' 96"]["row"]
    ratio = (conservative["batch_size"] / conservative["step_s_median"]) / (seed["batch_size"] / seed["step_s_median"])
    print(f"\nthroughput at the median step, conservative / 96: {ratio:.2f}x (all steps: "
          f"{conservative['samples_per_s'] / seed['samples_per_s']:.2f}x); peak source: {conservative['peak_source']}")


def _spec(spec_args: list[str]) -> RegressorSpec:
    values = {}
    for option, value in zip(spec_args[::2], spec_args[1::2]):
        name = option.lstrip("-").replace("-", "_")
        values[name] = value if name == "dtype" else int(value)
    return RegressorSpec(**values)


if __name__ == "__main__":
    main()
