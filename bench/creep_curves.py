"""Record step-creep curves: the peak after every measured step of one long steady trial per spec and batch size.

Each curve is a steady trial as ``vramcal probe`` runs one (:class:`vramcal.measure.trial.TrialRunner`, a worker
forked from vramcal's server with the workers' allocator settings, the host budget of the spec as
``RLIMIT_DATA``, one warm-up step, then measured steps each on a fresh batch of the E-mini bars at stride 1),
with the plateau stop switched off, so it runs every step asked for. The curves go into a file in the format of
``bench/results/creep/curves.json.gz``, which ``python -m bench.creep_policy --curves FILE`` replays.

    .venv/bin/python -m bench.creep_curves --out bench/results/creep-256k/curves.json.gz small:160:500 long:16:500

Each ``SPEC:BATCH:STEPS`` names a spec of :mod:`bench.specs` (at its budget), a batch size and the measured steps.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from pathlib import Path

from bench.specs import SPECS
from vramcal.api import worker_pool
from vramcal.environment import worker_setting
from vramcal.measure.device import host_device
from vramcal.measure.trial import TrialRequest, TrialRunner
from vramcal.records import TrialSettings
from vramcal.units import parse_bytes


def curve(spec_name: str, batch_size: int, steps: int, data: str) -> dict:
    """One steady trial of ``steps`` measured steps at ``batch_size``: its peaks after each step, bytes."""
    bench = SPECS[spec_name]
    request = TrialRequest(bench.spec.ref("transformers"), batch_size, host_device(parse_bytes(bench.budget)),
                           json.dumps({"data": data, "stride": 1}),
                           TrialSettings(steady_steps=steps, plateau_steps=0, timeout_s=4 * 3600), steady=True)
    started = time.time()
    (trial,) = TrialRunner(worker_pool()).run(request, purpose="steady")
    if not trial.ok:
        raise SystemExit(f"{spec_name} at {batch_size}: {trial.status}: {trial.error}")
    return {"run_id": f"{spec_name}-b{batch_size}-n{steps}-{int(started)}", "spec": spec_name,
            "batch_size": batch_size, "step_peak_bytes": list(trial.step_peaks),
            "step_times_s": list(trial.step_times_s), "wall_s": round(time.time() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="SPEC:BATCH:STEPS")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", default="data/es_1s.parquet")
    args = parser.parse_args()
    source = (f"bench.creep_curves on {time.strftime('%Y-%m-%d')}: peak_bytes after each measured step of a steady "
              f"trial (1 warm-up step, no validation passes), host, {os.cpu_count()} cores, GLIBC_TUNABLES="
              f"{worker_setting('GLIBC_TUNABLES')}")
    runs = []
    for run in args.runs:
        name, batch_size, steps = run.split(":")
        runs.append(curve(name, int(batch_size), int(steps), args.data))
        print(f"{name} at {batch_size}: {len(runs[-1]['step_peak_bytes'])} steps, {runs[-1]['wall_s']} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out, "wt") as out:
        json.dump({"source": source, "runs": runs}, out)


if __name__ == "__main__":
    main()
