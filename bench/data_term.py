"""The data term (issue 9): a dataset 10x larger than the calibration's, on the host and on the GPU path.

``python -m bench.data_term`` (``--quick``: a tighter budget, a few steps):

1. calibrates the spec on the host at its budget with the E-mini bars (the 1x data: 34,171 one-second
   bars) at ``--stride`` (default: the trainer's, seq_len // 2);
2. writes a ``--factor``-times larger bars file: the E-mini bars tiled, each copy's timestamps shifted
   by a week (the trainer's gap rule keeps windows inside one copy);
3. **host path**: plans a run on the large file with the 1x profile exactly as ``vramcal train`` does
   (:func:`vramcal.train.plan.resolve` counts the run's data bytes, :func:`~vramcal.train.plan.plan_run`
   sizes the conservative batch through :func:`vramcal.sizing.size` with ``pool_data_bytes``, which adds
   the difference to the calibration's data) and trains ``--steps`` steps under the budget: the
   measured peak against the adjusted prediction (target: within 5 %) and against the unadjusted one;
4. **GPU path, by computation** (no GPU needed): the factory's own rule for what a run holds in the
   measured memory (:meth:`vramcal.workload.TrainingStep.pool_data_bytes` on a ``cuda`` device, data
   in host memory, as :func:`~vramcal.train.plan.resolve` decides too) is 0 bytes for both files, so
   sizing the same profile as a ``cuda`` device's gives the same batch size and prediction for 1x and
   10x; with ``data_on_device`` the run's bytes enter the prediction.

Results: ``bench/results/data-term.{md,json}`` (``--quick``: ``bench/results/quick/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.specs import QUICK_BUDGET, SPECS
from vramcal.units import format_bytes, parse_bytes

RESULTS = Path(__file__).resolve().parent / "results"
SHIFT = "7D"  # each copy of the bars one week after the previous one
PREDICTION_TOLERANCE = 0.05


def tile_bars(bars, factor: int):
    """``factor`` copies of ``bars`` one after another, copy k's timestamps shifted by k x (span + a week).

    Args:
        bars: an OHLCV frame (``timestamp``, ``open``, ``high``, ``low``, ``close``, ``volume``).

    Returns:
        A frame of ``factor * len(bars)`` rows with increasing timestamps.
    """
    import pandas as pd

    span = bars["timestamp"].iloc[-1] - bars["timestamp"].iloc[0] + pd.Timedelta(SHIFT)
    copies = [bars.assign(timestamp=bars["timestamp"] + k * span) for k in range(factor)]
    return pd.concat(copies, ignore_index=True)


def gpu_path(profile, pool_small: dict[str, int], pool_large: dict[str, int]) -> dict[str, Any]:
    """Size the host profile as if it were a ``cuda`` device's (data held on the device: none), for the 1x
    and the large data, with the data in host memory and on the device. Pure.

    Args:
        pool_small, pool_large: the data bytes each run holds in the measured memory, keyed ``host`` and
            ``device`` (the factory's ``pool_data_bytes`` for a cuda device without/with ``data_on_device``).
    """
    from vramcal.sizing import size

    device = dataclasses.replace(profile.device, kind="cuda", name=f"{profile.device.name} (as a GPU, computed)")
    cuda = dataclasses.replace(profile, device=device, data={**profile.data, "pool_bytes": 0})
    out = {}
    for where in ("host", "device"):
        small = size(cuda, pool_data_bytes=pool_small[where])
        large = size(cuda, pool_data_bytes=pool_large[where])
        out[where] = {"pool_bytes_1x": pool_small[where], "pool_bytes_large": pool_large[where],
                      "batch_size_1x": small.batch_size, "batch_size_large": large.batch_size,
                      "predicted_1x": small.predicted_peak_bytes, "predicted_large": large.predicted_peak_bytes,
                      "unchanged": (small.batch_size, small.predicted_peak_bytes)
                      == (large.batch_size, large.predicted_peak_bytes)}
    return out


def pools(data: str, spec: dict[str, Any], stride: int | None) -> dict[str, int]:
    """What a run on ``data`` holds in a GPU's measured memory, by the factory's own rule: data in host
    memory (``host``) and with ``data_on_device`` (``device``); the step is built on the CPU."""
    import torch

    from vramcal.models.regressor.spec import RegressorSpec
    from vramcal.workload import build

    ref = RegressorSpec.from_dict(spec).ref("transformers")
    step = build(ref, torch.device("cpu"), {"data": data, "stride": stride})
    on_device = dataclasses.replace(step, data_on_device=True)
    return {"host": step.pool_data_bytes("cuda"), "device": on_device.pool_data_bytes("cuda")}


def markdown(results: dict[str, Any]) -> str:
    host, gpu = results["host"], results["gpu"]
    off = _off(host["peak_bytes"], host["predicted_peak_bytes"])
    raw_off = _off(host["peak_bytes"], host["unadjusted_predicted_peak_bytes"])
    lines = [f"# The data term: {results['factor']}x the calibration's data (spec `{results['spec_name']}`, "
             f"budget {results['budget']})" + (" (quick smoke run: not results)" if results.get("quick") else ""), "",
             f"- calibration: {results['data_1x']['bars']} bars (E-mini 1 s), stride "
             f"{results['stride'] or 'seq_len // 2'}, data held "
             f"{format_bytes(results['profile']['pool_bytes'])}; safe {results['profile']['safe_batch_size']}, "
             f"conservative {results['profile']['conservative_batch_size']}, verified {results['profile']['verified']}",
             f"- large data: {results['data_large']['bars']} bars (the E-mini bars tiled {results['factor']}x, each "
             f"copy a week after the previous), run's data {format_bytes(host['pool_bytes'])} "
             f"(+{format_bytes(host['data_delta_bytes'])})",
             f"- versions: {', '.join(f'{k} {v}' for k, v in results['versions'].items())}; created "
             f"{results['created_utc']}", "", "## Host path (data in the measured memory)", "",
             "| batch (conservative after the data term) | steps | status | peak | adjusted prediction | "
             "peak vs adjusted | unadjusted prediction | peak vs unadjusted | upper (adjusted) |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| {host['batch_size']} | {host['steps_done']}/{host['steps']} | {host['status']} | "
             f"{format_bytes(host['peak_bytes']) if host['peak_bytes'] else '-'} | "
             f"{format_bytes(host['predicted_peak_bytes'])} | {_pct(off)} | "
             f"{format_bytes(host['unadjusted_predicted_peak_bytes'])} | {_pct(raw_off)} | "
             f"{format_bytes(host['upper_bytes'])} |", "",
             "## GPU path (computed: the same profile sized as a cuda device's)", "",
             "| data | held in device memory 1x / large | batch 1x / large | prediction 1x / large | unchanged |",
             "|---|---|---|---|---|"]
    for where, label in (("host", "in host memory (default)"), ("device", "--data-on-device")):
        g = gpu[where]
        lines.append(f"| {label} | {format_bytes(g['pool_bytes_1x'])} / {format_bytes(g['pool_bytes_large'])} | "
                     f"{g['batch_size_1x']} / {g['batch_size_large']} | {format_bytes(g['predicted_1x'])} / "
                     f"{format_bytes(g['predicted_large'])} | {'yes' if g['unchanged'] else 'no'} |")
    met_host = off is not None and abs(off) <= PREDICTION_TOLERANCE and host["status"] == "ok"
    lines += ["", "## Targets (issue 9)", "", "| target | met |", "|---|---|",
              f"| host: measured peak within 5 % of the adjusted prediction | {'yes' if met_host else '**no**'} |",
              f"| GPU path: the larger data changes the prediction by nothing (data on the host) | "
              f"{'yes' if gpu['host']['unchanged'] else '**no**'} |"]
    return "\n".join(lines) + "\n"


def _off(peak: int | None, predicted: int) -> float | None:
    return None if not peak else (peak - predicted) / predicted


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f} %"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.data_term", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="small", choices=sorted(SPECS))
    parser.add_argument("--budget", default=None, help="host budget (default: the spec's)")
    parser.add_argument("--factor", type=int, default=10, help="how many times the calibration's data")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps of the training run")
    parser.add_argument("--stride", type=int, default=None,
                        help="bars between windows (default: the trainer's, seq_len // 2; 1 makes every epoch's "
                             "validation pass over the large data take many minutes)")
    parser.add_argument("--data", default="data/es_1s.parquet")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_BUDGET} budget, 5 steps, to bench/results/quick")
    args = parser.parse_args(argv)
    if args.quick:
        args.budget, args.steps, args.out = args.budget or QUICK_BUDGET, 5, args.out or RESULTS / "quick"
    args.out = args.out or RESULTS
    if not Path(args.data).is_file():
        parser.error(f"no {args.data}: build it with `.venv/bin/python -m vramcal data es-sample`")
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "data-term.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    (args.out / "data-term.md").write_text(markdown(results))
    print(markdown(results))
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.compare import environment
    from vramcal import api
    from vramcal.measure.device import host_device
    from vramcal.models.regressor.bars import load_bars, write_parquet
    from vramcal.sizing import length_model
    from vramcal.train.config import TrainConfig
    from vramcal.train.errors import TrainError
    from vramcal.train.plan import plan_run, resolve
    from vramcal.train.runner import train

    bench_spec = SPECS[args.spec]
    budget_text = args.budget or bench_spec.budget
    budget, spec = parse_bytes(budget_text), bench_spec.spec
    small = str(Path(args.data).resolve())
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="vramcal-data-term-") as work:
        print(f"calibrating {args.spec} at {budget_text} on {args.data} (stride {args.stride}) ...", flush=True)
        plan = api.plan_calibration("regressor", spec.to_dict(), device=host_device(capacity_bytes=budget),
                                    implementation="transformers", options={"data": small, "stride": args.stride},
                                    out=Path(work) / "profile.json")
        profile = api.run_calibration(plan, on_trial=lambda t: print(f"  trial {t.batch_size}: {t.status}", flush=True))
        bars = load_bars(small)
        large = str(write_parquet(tile_bars(bars, args.factor), Path(work) / f"bars-{args.factor}x.parquet"))
        config = TrainConfig(data=large, spec=spec, implementation="transformers", gpu="none",
                             profile=str(plan.path), epochs=10**6, max_steps=args.steps, stride=args.stride)
        setting = resolve(config, capacity_bytes=budget)
        run_plan = plan_run(config, Path(work) / "run", setting)
        sizing = run_plan.sizing
        print(f"training {args.steps} steps at {sizing.batch_size} on {args.factor}x the data ...", flush=True)
        status, failure, result = "ok", None, None
        try:
            result = train(dataclasses.replace(run_plan, profile_path=None), echo=print, workers=api.worker_pool())
        except TrainError as error:
            status, failure = ("oom" if "out of memory" in str(error) else "error"), str(error)
        gpu = gpu_path(profile, pools(small, spec.to_dict(), args.stride), pools(large, spec.to_dict(), args.stride))
    model = length_model(profile)
    host = {"batch_size": sizing.batch_size, "source": sizing.source, "steps": args.steps,
            "steps_done": result.steps if result else 0, "status": status, "failure": failure,
            "peak_bytes": result.peak_bytes if result else None, "pool_bytes": setting.pool_data_bytes,
            "data_delta_bytes": sizing.data_delta_bytes, "predicted_peak_bytes": sizing.predicted_peak_bytes,
            "upper_bytes": sizing.upper_bytes, "unadjusted_predicted_peak_bytes": int(model.predict(sizing.batch_size)),
            "notices": list(sizing.notices), "host_memory_limit_bytes": run_plan.host_memory_limit_bytes}
    return {"spec_name": args.spec, "spec": spec.to_dict(), "budget": budget_text, "budget_bytes": budget,
            "factor": args.factor, "stride": args.stride, "quick": args.quick,
            "data_1x": {"path": args.data, "bars": len(bars)}, "data_large": {"bars": len(bars) * args.factor},
            "profile": {"pool_bytes": profile.pool_data_bytes, "safe_batch_size": profile.limits.safe_batch_size,
                        "conservative_batch_size": profile.limits.conservative_batch_size,
                        "verified": profile.verified, "trials": len(profile.trials)},
            "host": host, "gpu": gpu, "versions": environment(budget)["versions"],
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wall_s": time.time() - started}


if __name__ == "__main__":
    sys.exit(main())
