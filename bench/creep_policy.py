"""The steady trial's policy against recorded step curves: how far its prediction is from a long run's peak.

``bench/results/creep/curves.json.gz`` holds the creep study's curves (``STUDY.md`` beside it: what ran): the
peak after each measured training step of a worker made as vramcal's trials are, on the host, at five specs and
three batch sizes each, most of them 1,000 steps long. For every curve that reached 1,000 steps this replays
the shipped policy (:func:`vramcal.calibration.creep.steady_done` with ``TrialSettings().plateau_steps``, at
most ``TrialSettings().steady_steps``, then the host's allowance
:data:`vramcal.calibration.creep.HOST_LATE_CREEP`) on the curve's first steps, and prints the steady trial's
length, its prediction at that batch size and the error against the peak after 1,000 steps.

    .venv/bin/python -m bench.creep_policy [--plateau-steps N] [--steady-steps N] [--allowance F]
                                           [--curves FILE --run-steps N]

``--curves`` replays other curves (:mod:`bench.creep_curves` records them: ``bench/results/creep-256k/`` holds those
of the workers' 256 KiB mmap threshold), against the peak after ``--run-steps`` steps.

The curves have no validation passes (a trial's does one; the trainer's are full passes, and the study found
they never raised the peak) and no epoch's end (the steady trial's step at a partial batch after its second step:
the replay measures the stop rule on full steps; what an epoch's end adds is in ``bench/results/epoch-end/``), and
one process per curve: repeats of one size differ by 0.4-0.8 %.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

from vramcal.calibration.creep import HOST_LATE_CREEP, epoch_end_due, steady_done
from vramcal.records import TrialSettings

CURVES = Path(__file__).parent / "results" / "creep" / "curves.json.gz"
RUN_STEPS = 1000


def replay(curve: list[int], plateau_steps: int, steady_steps: int) -> int:
    """The steps a steady trial measures on ``curve``: until the plateau after its epoch's end
    (:func:`vramcal.calibration.creep.steady_done`), at most ``steady_steps``."""
    settings = TrialSettings(steady_steps=steady_steps, plateau_steps=plateau_steps)
    for n in range(1, steady_steps + 1):
        if steady_done(curve[:n], settings, settings.measured_steps if epoch_end_due(curve[:n], settings) else None):
            return n
    return steady_steps


def main() -> int:
    defaults = TrialSettings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plateau-steps", type=int, default=defaults.plateau_steps)
    parser.add_argument("--steady-steps", type=int, default=defaults.steady_steps)
    parser.add_argument("--allowance", type=float, default=HOST_LATE_CREEP)
    parser.add_argument("--curves", type=Path, default=CURVES)
    parser.add_argument("--run-steps", type=int, default=RUN_STEPS)
    args = parser.parse_args()
    run_steps = args.run_steps
    recorded = json.loads(gzip.open(args.curves, "rt").read())["runs"]
    runs = [r for r in recorded if len(r["step_peak_bytes"]) >= run_steps]
    if not runs:
        longest = max((len(r["step_peak_bytes"]) for r in recorded), default=0)
        print(f"creep_policy: no curve in {args.curves} has {run_steps} steps (the longest has {longest}): give a "
              f"smaller --run-steps", file=sys.stderr)
        return 2
    print(f"plateau_steps {args.plateau_steps}, steady_steps {args.steady_steps}, allowance {args.allowance:.1%}; "
          f"{len(runs)} curves of {run_steps} steps")
    print(f"{'spec':8} {'batch':>5} {'steps':>5} {'steady MiB':>10} {'predicted':>9} {f'{run_steps:,} steps':>11} "
          f"{'error':>7}")
    errors, lengths = [], []
    for run in sorted(runs, key=lambda r: (r["spec"], r["batch_size"], r["run_id"])):
        curve = run["step_peak_bytes"]
        n = replay(curve, args.plateau_steps, args.steady_steps)
        predicted = max(curve[:n]) * (1 + args.allowance)
        end = max(curve[:run_steps])
        errors.append((end - predicted) / predicted)
        lengths.append(n)
        print(f"{run['spec']:8} {run['batch_size']:5} {n:5} {max(curve[:n]) / 2**20:10.1f} {predicted / 2**20:9.1f} "
              f"{end / 2**20:11.1f} {errors[-1]:+7.2%}")
    print(f"error ({run_steps:,}-step peak against the prediction): {min(errors):+.2%} to {max(errors):+.2%}; "
          f"steady trial {min(lengths)}-{max(lengths)} steps (median {statistics.median(lengths):g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
