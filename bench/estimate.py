"""The step estimate (:mod:`vramcal.estimate`) against vramcal's own measurements, on the host.

``python -m bench.estimate`` traces, for the benchmark's specs (:data:`bench.specs.SPECS`) and the ``lm`` family's
tiny and small configs, the training step on fake tensors (``estimate_step``, host, fp32, the transformers torch
path) and prints each estimate beside every committed measurement of the same model:

* profiles under ``examples/measured/profiles/`` whose model is the same reference (``vramcal.profile.load_profile``:
  the fit's overhead and slope, the safe size and its verification peak);
* the ``vramcal`` rounds of ``bench/results/<spec>-<budget>.json`` (each round a calibration of its own, on the E-mini
  bars at stride 1: the data differ from the synthetic bars the estimate builds, which moves the overhead, not the
  slope), and the same file's ground-truth bisection trials (a line through those at 32 samples and more; its
  largest trial that fitted the budget stands for the safe size);
* with ``--trials``, for a model with neither: two real host trials of it at ``--trial-sizes`` (this run's).

What is compared: the **slope** (bytes per sample), estimate against the measured fit; and the **peak at the measured
safe size**, where the estimate's peak is the measured overhead plus the estimated slope times the safe size
(``measured overhead + estimated slope x safe``), against the verification trial's measured peak there. The trace
sees no process baseline (about 0.5 GiB of libraries and allocator arenas on this host) and no host dataset, so its
own overhead (model states) is printed but not compared: the overhead of a real device comes from a measured profile
or a batch-size-1 trial.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.specs import SPECS
from vramcal.estimate import EstimateError, StepEstimate, estimate_step
from vramcal.estimate.learned import Calibrated, held_against, learned_baseline, learned_bound, leave_one_out
from vramcal.models import lm
from vramcal.models.mamba2 import keyed_params
from vramcal.workload import ModelRef

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "examples" / "measured" / "profiles"
RESULTS = REPO / "bench" / "results"
LM_CONFIGS = {"lm-tiny": ("mamba2-lm-tiny.json", 32), "lm-small": ("mamba2-lm-small.json", 128)}  # (file, seq_len)
TRACED = (8, 32)  # batch sizes every estimate traces; each measured safe size is traced too
GROUND_TRUTH_FROM = 32  # below it the host's measured peaks bend (allocator arenas), so the line starts here
MIB = 2**20


@dataclass(frozen=True)
class Measured:
    """One measurement of a model (bytes): the fitted line, the safe size and the peak a real trial had there."""

    source: str
    overhead_bytes: float
    slope_bytes_per_sample: float
    safe_batch_size: int
    safe_peak_bytes: int


def models() -> dict[str, ModelRef]:
    """The benchmark's regressor specs and the lm configs, by name (the transformers implementation, fp32)."""
    refs = {name: bench.spec.ref("transformers") for name, bench in SPECS.items()}
    for name, (config, seq_len) in LM_CONFIGS.items():
        refs[name] = ModelRef.make(lm.FACTORY, {"config": lm.read_config(REPO / "configs" / config),
                                                "dtype": "fp32", "implementation": "transformers", "seq_len": seq_len})
    return refs


def committed(name: str, ref: ModelRef) -> list[Measured]:
    """The committed measurements of ``ref`` (module docstring): profiles first, then the benchmark's rounds."""
    from vramcal.profile import load_profile

    found = []
    for path in sorted(PROFILES.glob("*/*.json")):
        profile = load_profile(path)
        if profile.model == ref and profile.fit is not None and "safe" in profile.verification:
            found.append(Measured(str(path.relative_to(REPO)), profile.fit.overhead_bytes,
                                  profile.fit.slope_bytes_per_sample, profile.verification["safe"].batch_size,
                                  profile.verification["safe"].peak_bytes))
    for path in sorted(RESULTS.glob(f"{name}-*.json")):
        results = json.loads(path.read_text())
        if name not in SPECS or results.get("spec") != SPECS[name].spec.to_dict():
            continue
        for run in results["runs"].get("vramcal", []):
            if run.get("fit") and run.get("verification", {}).get("safe", {}).get("peak_bytes"):
                safe = run["verification"]["safe"]
                found.append(Measured(f"{path.relative_to(REPO)} vramcal r{run['round']}", run["fit"]["overhead_bytes"],
                                      run["fit"]["slope_bytes_per_sample"], safe["batch_size"], safe["peak_bytes"]))
        found += truth(path, results)
    return found


def truth(path: Path, results: dict) -> list[Measured]:
    """The ground truth's bisection trials (:mod:`bench.truth`) at ``GROUND_TRUTH_FROM`` samples and more: their
    least-squares line, and the largest that fitted the budget as the "safe" point (the boundary)."""
    from vramcal.estimate.result import line

    ok = sorted((t["batch_size"], t["peak_bytes"]) for t in results.get("ground_truth", {}).get("trials", [])
                if t["status"] == "ok" and t["batch_size"] >= GROUND_TRUTH_FROM)
    if len({b for b, _ in ok}) < 2:
        return []
    overhead, slope = line([b for b, _ in ok], [p for _, p in ok])
    return [Measured(f"{path.relative_to(REPO)} ground truth ({len(ok)} trials >= {GROUND_TRUTH_FROM})", overhead,
                     slope, ok[-1][0], ok[-1][1])]


def trials(ref: ModelRef, sizes: tuple[int, int]) -> list[Measured]:
    """Two real host trials of ``ref`` (vramcal's trial runner): their line, and the larger as the "safe" point."""
    from vramcal.api import worker_pool
    from vramcal.measure.device import host_device
    from vramcal.measure.trial import TrialRequest, TrialRunner

    runner, device = TrialRunner(worker_pool()), host_device()
    small, large = (runner.run(TrialRequest(ref, size, device))[0] for size in sizes)
    if not (small.ok and large.ok):
        print(f"  trials failed: {small.error or large.error}", file=sys.stderr)
        return []
    slope = (large.peak_bytes - small.peak_bytes) / (sizes[1] - sizes[0])
    return [Measured(f"2 trials at {sizes[0]} and {sizes[1]} (this run)", small.peak_bytes - slope * sizes[0], slope,
                     sizes[1], large.peak_bytes)]


def predicted_peak(estimate: StepEstimate, measured: Measured) -> float:
    """The estimate's peak at the measured safe size: the measured overhead plus the estimated slope times the size."""
    return measured.overhead_bytes + estimate.slope_bytes_per_sample * measured.safe_batch_size


def row(name: str, estimate: StepEstimate, measured: Measured | None) -> str:
    """One table row: the estimate, and against ``measured`` when there is one."""
    own = (f"| {name} | {estimate.slope_bytes_per_sample / MIB:.3f} | {estimate.overhead_bytes / MIB:.1f} | "
           f"{estimate.wall_s:.1f} |")
    if measured is None:
        return own + " (no measurement) | | | | | | |"
    predicted, slope = predicted_peak(estimate, measured), measured.slope_bytes_per_sample
    return (own + f" {measured.source} | {slope / MIB:.3f} | {_pct(estimate.slope_bytes_per_sample, slope)} | "
            f"{measured.safe_batch_size} | {predicted / MIB:.1f} | {measured.safe_peak_bytes / MIB:.1f} | "
            f"{_pct(predicted, measured.safe_peak_bytes)} |")


HEADER = ("| model | est. slope MiB/sample | traced overhead MiB | estimate s | measured by | measured slope "
          "MiB/sample | slope error | safe size | est. peak at safe MiB (measured overhead + est. slope x safe) | "
          "measured peak at safe MiB | peak error |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _pct(value: float, reference: float) -> str:
    return f"{100 * (value - reference) / reference:+.1f} %"


def calibrations(names: list[str]) -> list[Calibrated]:
    """Every committed calibration that can teach the estimate (:func:`~vramcal.estimate.learned.held_against`): the
    profiles under ``examples/measured/profiles/``, and the vramcal rounds of ``bench/results/`` (each a calibration on
    the E-mini bars of ``data/es_1s.parquet`` at the file's stride; the data bytes its trials held are the trace's,
    of the same file: ``make data`` or ``vramcal data es-sample`` builds it)."""
    from vramcal.profile import load_profile

    cache: dict[str, StepEstimate] = {}
    found, notices = held_against(((p.relative_to(REPO), load_profile(p)) for p in sorted(PROFILES.glob("*/*.json"))),
                                  cache=cache)
    for notice in notices:
        print(f"  {notice}", file=sys.stderr)
    bars = REPO / "data" / "es_1s.parquet"
    for name in names:
        if name not in SPECS:
            continue
        for path in sorted(RESULTS.glob(f"{name}-*.json")):
            results = json.loads(path.read_text())
            # as a profile key compares them: results written before checkpointing existed have no such key
            spec = keyed_params(results.get("spec") or {})
            if spec != keyed_params(SPECS[name].spec.to_dict()) or not bars.is_file():
                continue
            options = {"data": str(bars), "stride": results.get("data", {}).get("stride")}
            estimate = estimate_step(SPECS[name].spec.ref("transformers"), TRACED, options=options)
            for run in results["runs"].get("vramcal", []):
                safe = run.get("verification", {}).get("safe", {})
                if run.get("fit") and safe.get("peak_bytes") and safe.get("passed", True):
                    found.append(Calibrated(f"{path.relative_to(REPO)} vramcal r{run['round']}", "host",
                                            run["fit"]["overhead_bytes"], estimate.data_bytes, safe["batch_size"],
                                            safe["peak_bytes"], estimate.overhead_bytes,
                                            estimate.slope_bytes_per_sample))
    return found


def print_bound(names: list[str]) -> None:
    """Each calibration's baseline and its leave-one-out error (the estimate with the others' median baseline),
    and the bound and baseline they give: :data:`vramcal.estimate.learned.BENCH_BOUND` and ``HOST_BASELINE``."""
    found = calibrations(names)
    print("| calibration | baseline MiB | safe size | measured peak MiB | leave-one-out error |\n|---|---|---|---|---|")
    for c, error in leave_one_out(found, "host"):
        print(f"| {c.path} | {c.baseline_bytes / MIB:.1f} | {c.safe_batch_size} | {c.safe_peak_bytes / MIB:.1f} | "
              f"{error:+.1%} |")
    bound, baseline = learned_bound(found, "host"), learned_baseline(found, "host")
    print(f"\nbaseline (median): {baseline.bytes / MIB:.0f} MiB over {len(found)}; bound: {bound.low:+.1%} to "
          f"{bound.high:+.1%} over {bound.n}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.estimate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=[*SPECS, *LM_CONFIGS], help="default: all")
    parser.add_argument("--trials", action="store_true", help="measure models with no committed measurement")
    parser.add_argument("--trial-sizes", type=int, nargs=2, default=(16, 128), metavar=("SMALL", "LARGE"))
    parser.add_argument("--bound", action="store_true", help="the leave-one-out bound and the host baseline over "
                        "every committed calibration (vramcal.estimate.learned's BENCH_BOUND, HOST_BASELINE)")
    args = parser.parse_args(argv)
    refs = models()
    if args.bound:
        print_bound(args.model or list(refs))
        return 0
    print(HEADER)
    errors: list[float] = []
    for name in args.model or list(refs):
        measured = committed(name, refs[name]) or (trials(refs[name], tuple(args.trial_sizes)) if args.trials else [])
        sizes = sorted({*TRACED, *(m.safe_batch_size for m in measured)})
        try:
            estimate = estimate_step(refs[name], sizes)
        except EstimateError as error:
            print(f"| {name} | {error} |")
            continue
        for each in measured or [None]:
            print(row(name, estimate, each))
            if each is not None:
                errors.append(100 * (predicted_peak(estimate, each) - each.safe_peak_bytes) / each.safe_peak_bytes)
    if errors:
        print(f"\npeak at the safe size, estimate against measured: {min(errors):+.1f} % to {max(errors):+.1f} % "
              f"(median {statistics.median(errors):+.1f} %) over {len(errors)} measurements")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
