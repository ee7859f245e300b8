"""Training a sharded world: ``vramcal train`` on 2 gloo ranks under FSDP at a 2-rank FSDP profile's conservative size,
each rank's peak against its prediction, measured inside (the trials' definition) and from outside.

``python -m bench.fsdp_train [--spec default] [--capacity C] [--steps 200] [--data FILE] [--profile FILE] [--out DIR]``:

1. Calibrates the spec (one of :data:`bench.specs.SPECS`, at its budget unless ``--capacity`` is given) as a world of
   2 FSDP ranks (``vramcal probe --gpu none --nproc 2 --strategy fsdp --capacity C SPEC --data FILE``), unless
   ``--profile`` names one.
2. Trains ``vramcal train --gpu none --nproc-per-node 2 --strategy fsdp --capacity C SPEC --stride 1 --max-steps N``
   sized by it (each rank at the profile's conservative size), while this process polls each rank's training process
   (its pid in ``<run_dir>/ranks/<rank>.pid``) every 50 ms: the largest ``VmHWM`` and ``VmData`` of
   ``/proc/<pid>/status`` seen, as ``bench.frameworks`` reads a framework's process from outside.
3. Prints each rank's peak by the trials' definition (the run's observation in the profile: ``max(VmHWM since the
   first step, the data segment's peak)``) and from outside (the same definition read by this process: the larger of
   the largest ``VmHWM`` and ``VmData`` seen over the process's life, its start and first step included, sampled
   every 50 ms), each against the prediction its observation holds, and writes them with the commands to
   ``<out>/fsdp-train.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


def vramcal(*args: str, watch: Path | None = None) -> tuple[subprocess.CompletedProcess, dict[int, dict[str, int]]]:
    """``python -m vramcal ARGS``; with ``watch`` (a run folder) each rank's training process polled from outside:
    ``{rank: {"VmHWM": bytes, "VmData": bytes}}`` (the largest seen)."""
    seen: dict[int, dict[str, int]] = {}
    process = subprocess.Popen([sys.executable, "-m", "vramcal", *args], stdout=subprocess.PIPE, stderr=sys.stderr,
                               text=True)
    poller = threading.Thread(target=poll, args=(process, watch, seen), daemon=True) if watch else None
    if poller:
        poller.start()
    out, _ = process.communicate()
    if poller:
        poller.join()
    return subprocess.CompletedProcess(process.args, process.returncode, out, ""), seen


def poll(process: subprocess.Popen, run_dir: Path, seen: dict[int, dict[str, int]]) -> None:
    while process.poll() is None:
        for pid_file in (run_dir / "ranks").glob("*.pid"):
            try:
                fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid_file.read_text().strip()}/status")
                              .read_text().splitlines() if ":" in line)
            except (OSError, ValueError):
                continue
            rank = seen.setdefault(int(pid_file.stem), {"VmHWM": 0, "VmData": 0})
            for key in rank:
                if key in fields:
                    rank[key] = max(rank[key], int(fields[key].split()[0]) * 1024)
        time.sleep(0.05)


def spec_args(name: str) -> list[str]:
    """The command-line options of a benchmark spec (:data:`bench.specs.SPECS`)."""
    from bench.specs import SPECS

    spec = SPECS[name].spec
    return [arg for field in ("d_model", "n_layers", "d_state", "headdim", "expand", "chunk_size", "seq_len")
            for arg in (f"--{field.replace('_', '-')}", str(getattr(spec, field)))]


def calibrate(capacity: str, spec: list[str], data: Path, out: Path) -> Path:
    args = ["probe", "--gpu", "none", "--nproc", "2", "--strategy", "fsdp", "--capacity", capacity, *spec,
            "--data", str(data), "--profiles-dir", str(out / "profiles"), "--reports-dir", str(out / "reports")]
    started = time.perf_counter()
    done, _ = vramcal(*args)
    if done.returncode != 0:
        sys.exit(f"the probe failed (exit {done.returncode})")
    print(f"$ vramcal {' '.join(args)}   # {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return max((out / "profiles").glob("**/*-fsdp2-*.json"), key=lambda p: p.stat().st_mtime)


def main(argv: list[str] | None = None) -> int:
    from bench.specs import SPECS
    from vramcal.profile import load_profile

    parser = argparse.ArgumentParser(prog="python -m bench.fsdp_train", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="default", choices=sorted(SPECS))
    parser.add_argument("--capacity", default=None, help="each rank's budget (default: the spec's)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--data", type=Path, default=REPO / "data" / "es_1s.parquet")
    parser.add_argument("--profile", type=Path, default=None, help="a 2-rank FSDP profile (default: calibrate one)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fsdp-train")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    capacity, spec = args.capacity or SPECS[args.spec].budget, spec_args(args.spec)
    path = args.profile or calibrate(capacity, spec, args.data, args.out)
    profile = load_profile(path)
    run_dir = args.out / "runs" / time.strftime("%Y%m%d-%H%M%S")  # (runs/ is not committed: checkpoints)
    train = ["train", "--gpu", "none", "--nproc-per-node", "2", "--strategy", "fsdp", "--capacity", capacity, *spec,
             "--data", str(args.data), "--stride", "1", "--max-steps", str(args.steps), "--profile", str(path),
             "--run-dir", str(run_dir), "--json"]
    started = time.perf_counter()
    done, outside = vramcal(*train, watch=run_dir)
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"the training run failed (exit {done.returncode})")
    observed = {o.rank: o for o in load_profile(path).observations if o.run_dir == str(run_dir.resolve())}
    ranks = []
    for rank, o in sorted(observed.items()):
        hwm, data = (outside.get(rank, {}).get(field, 0) for field in ("VmHWM", "VmData"))
        predicted = o.predicted_peak_bytes
        row = {"rank": rank, "batch_size": o.batch_size, "steps": o.steps, "predicted_peak_bytes": predicted,
               "peak_bytes": o.peak_bytes, "error_pct": (o.peak_bytes - predicted) / predicted * 100,
               "outside_vmhwm_bytes": hwm, "outside_vmdata_bytes": data, "outside_peak_bytes": max(hwm, data),
               "outside_error_pct": (max(hwm, data) - predicted) / predicted * 100}
        ranks.append(row)
        print(f"rank {rank}: batch {row['batch_size']}, {row['steps']} steps: predicted {predicted / MIB:.2f} MiB; "
              f"peak {o.peak_bytes / MIB:.2f} MiB ({row['error_pct']:+.2f} %); from outside {max(hwm, data) / MIB:.2f} "
              f"MiB ({row['outside_error_pct']:+.2f} %: VmHWM {hwm / MIB:.2f}, VmData {data / MIB:.2f} MiB)")
    result: dict[str, Any] = {
        "profile": str(path), "formula": profile.fit.formula(), "limits": profile.limits.to_dict(),
        "verified": profile.verified, "world": profile.world.to_dict(), "model_info": profile.model_info,
        "ranks": ranks, "train_wall_s": wall_s, "summary": json.loads(done.stdout),
        "command": "python -m bench.fsdp_train " + " ".join(argv if argv is not None else sys.argv[1:]),
        "train_command": "vramcal " + " ".join(train)}
    target = args.out / "fsdp-train.json"
    target.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"written: {target} ({wall_s:.0f} s of training)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
