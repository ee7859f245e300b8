"""Benchmark: the language-model trainer (``vramcal train --model lm``, issue 41 item 3) on the standard library's
own source, in the batches of the profile's token budget, against a fixed batch padded to the longest length.

Prints figures and writes them; asserts nothing. In one invocation, on one machine:

1. the profile: ``vramcal probe --model lm --model-arg config=configs/mamba2-lm-tiny.json --seq-len 64:1024`` at
   ``--capacity`` (``--reserve 0``), or ``--profile FILE``;
2. ``--steps`` steps of ``vramcal train --model lm`` (the token budget's sampler, the default), polled from outside:
   every process under the command, ``/proc/<pid>/status`` every 50 ms (VmData and VmHWM; the training worker is the
   descendant with the largest VmData). Its peak by the trials' definition (``peak_bytes`` of its epoch rows) and
   the outside VmData peak are held against the plan's prediction for the worst batch;
3. the fixed batch: the profile's conservative batch at its longest seq_len, each batch that many training
   documents in the run's shuffled order padded to the longest length, for ``--fixed-steps`` steps of the same
   training step (the family's factory, the trainer's loss) in a fresh process with the workers' malloc and oneDNN
   settings (:data:`vramcal.environment.WORKER_DEFAULTS`: the 256 KiB mmap threshold makes a step of the tiny lm
   2-3 times slower than glibc's defaults, so a child without them was not comparable); its tokens/s (tokens that
   are not padding) beside the sampler run's, and the ratio.

Every process runs torch on ``--threads`` threads (``OMP_NUM_THREADS``, default 1): on the shared 2-core host two
threads under other work took 3-12 s for a step that one thread takes in 1 s (8 documents of 256 tokens), and
the probe and both runs must run alike. ``--val-fraction`` (default 0.02) keeps the end-of-run validation pass
short.

    .venv/bin/python -m bench.lm_train --capacity 640MiB --steps 300 --out bench/results/lm-train
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "mamba2-lm-tiny.json"
VRAMCAL = [sys.executable, "-m", "vramcal"]
ENV = dict(os.environ)  # with OMP_NUM_THREADS set in main()


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc's parent links)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def watched(command: list[str], log: Path) -> tuple[int, dict[int, dict[str, int]]]:
    """Run ``command`` (stdout and stderr to ``log``), polling every process under it: its exit code and each pid's
    largest VmData and VmHWM (bytes)."""
    seen: dict[int, dict[str, int]] = {}
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=ENV)
        polls = 0
        while process.poll() is None:
            if polls % 20 == 0:
                pids = descendants(process.pid)
            polls += 1
            for pid in pids:
                try:
                    status = Path(f"/proc/{pid}/status").read_text().splitlines()
                except OSError:
                    continue
                for line in status:
                    key, _, value = line.partition(":")
                    if key in ("VmData", "VmHWM"):
                        mine = seen.setdefault(pid, {"VmData": 0, "VmHWM": 0})
                        mine[key] = max(mine[key], int(value.split()[0]) * 1024)
            time.sleep(0.05)
    return process.returncode, seen


def fixed_child(plan_path: Path, steps: int) -> dict:
    """In a fresh process: ``steps`` steps at the profile's conservative batch at its longest length, each batch the
    next training documents of the run's first epoch order padded to that length; tokens/s (not padding)."""
    import torch

    from vramcal.measure.trial import torch_device
    from vramcal.models.corpus import IGNORE_INDEX
    from vramcal.train.lm_loop import UNIFORM_LOSS, tensors
    from vramcal.train.lm_plan import read_corpus
    from vramcal.train.plan import Plan
    from vramcal.workload import build, optimizer_step

    record = json.loads(plan_path.read_text())
    plan = Plan.from_record(record, plan_path.parent)
    stats, longest, batch = plan.data_stats, int(record["bench"]["seq_len"]), int(record["bench"]["batch_size"])
    corpus = read_corpus(plan)
    device = torch_device(plan.device)
    step = build(plan.model.replace(seq_len=longest), device, {"lr": plan.lr, "seed": plan.config.seed})
    order = torch.randperm(len(corpus.train), generator=torch.Generator().manual_seed(plan.config.seed)).tolist()
    times, tokens = [], []
    for i in range(steps + 1):  # the first allocates AdamW's state: not timed, as the trainer's first epoch
        docs = [corpus.train[order[(i * batch + j) % len(order)]] for j in range(batch)]
        start = time.perf_counter()
        ids, labels = tensors(docs, device)  # padded to the batch's longest, then to the profile's longest:
        ids = torch.nn.functional.pad(ids, (0, longest - ids.shape[1]))
        labels = torch.nn.functional.pad(labels, (0, longest - labels.shape[1]), value=IGNORE_INDEX)
        loss = step.model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        optimizer_step(step)
        float(loss)
        if i:
            times.append(time.perf_counter() - start)
            tokens.append(sum(map(len, docs)))
    return {"batch_size": batch, "seq_len": longest, "steps": steps, "tokens_per_s": sum(tokens) / sum(times),
            "step_s_median": statistics.median(times), "last_loss_over_uniform": float(loss) / UNIFORM_LOSS,
            "text_tokens": stats["train_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", default="640MiB")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--onednn-cache", default=None, help="ONEDNN_PRIMITIVE_CACHE_CAPACITY for every process "
                        "(0: off; oneDNN keeps primitives per shape, 1,024 by default: batches of changing shapes "
                        "grow the process ~1 MiB a step on the host)")
    parser.add_argument("--val-fraction", default="0.02")
    parser.add_argument("--seq-len", default="64:1024")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fixed-steps", type=int, default=40)
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "lm-train")
    parser.add_argument("--child", type=Path, default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(fixed_child(args.child, args.fixed_steps)))
        return
    from vramcal.environment import WORKER_DEFAULTS
    from vramcal.profile import load_profile
    from vramcal.units import format_bytes, format_rate

    ENV.update(OMP_NUM_THREADS=args.threads, PYTHONPATH=str(REPO))
    if args.onednn_cache is not None:
        ENV["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = args.onednn_cache
    args.out.mkdir(parents=True, exist_ok=True)
    profile_path = args.profile
    if profile_path is None:
        subprocess.run([*VRAMCAL, "probe", "--gpu", "none", "--capacity", args.capacity, "--reserve", "0", "--model",
                        "lm", "--model-arg", f"config={CONFIG}", "--seq-len", args.seq_len, "--profiles-dir",
                        str(args.out / "profiles"), "--no-report"], check=True, cwd=REPO, env=ENV)
        profile_path = sorted((args.out / "profiles").glob("**/*.json"))[-1]
    run_dir = args.out / "run"
    code, seen = watched([*VRAMCAL, "train", "--model", "lm", "--model-arg", f"config={CONFIG}", "--gpu", "none",
                          "--capacity", args.capacity, "--profile", str(profile_path), "--max-steps", str(args.steps),
                          "--val-fraction", args.val_fraction, "--report-to", "none", "--run-dir", str(run_dir)],
                         args.out / "train.log")
    if code != 0:
        sys.exit(f"vramcal train exited {code}: see {args.out / 'train.log'}")
    record = json.loads((run_dir / "run.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    predicted = record["sizing"]["predicted_peak_bytes"]
    peak = max(r["peak_bytes"] for r in epochs)
    worker = max(seen.values(), key=lambda v: v["VmData"])
    profile = load_profile(profile_path)
    longest = max(profile.surface.seq_lens)
    fixed_batch = profile.surface.at(longest).conservative_batch_size
    plan_copy = args.out / "plan.json"
    plan_copy.write_text(json.dumps({**record, "bench": {"seq_len": longest, "batch_size": fixed_batch}}))
    child = subprocess.run([sys.executable, "-m", "bench.lm_train", "--child", str(plan_copy), "--fixed-steps",
                            str(args.fixed_steps)], capture_output=True, text=True, cwd=REPO,
                           env={**WORKER_DEFAULTS, **ENV})  # the malloc settings the trainer's worker runs with
    if child.returncode != 0:
        sys.exit(f"the fixed batch failed: {child.stderr.strip().splitlines()[-1:]}")
    fixed = json.loads(child.stdout.strip().splitlines()[-1])
    tokens_s = sum(r["tokens"] for r in epochs) / sum(r["train_s"] for r in epochs)
    result = {"profile": str(profile_path), "steps": max(r["step"] for r in epochs), "worst": record["data"]["worst"],
              "batching": record["data"]["batching"], "predicted_peak_bytes": predicted, "peak_bytes": peak,
              "error": (peak - predicted) / predicted, "outside_vmdata_bytes": worker["VmData"],
              "outside_vmhwm_bytes": worker["VmHWM"], "outside_error": (worker["VmData"] - predicted) / predicted,
              "oom_events": sum(r["kind"] == "oom" for r in rows), "tokens_per_s": tokens_s, "fixed": fixed,
              "ratio": tokens_s / fixed["tokens_per_s"], "threads": args.threads,
              "onednn_cache": args.onednn_cache, "epochs": epochs}
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['steps']} steps, worst batch {result['worst']['batch_size']} x {result['worst']['seq_len']}: "
          f"peak {format_bytes(peak)} against predicted {format_bytes(predicted)} ({result['error']:+.2%}); "
          f"outside VmData {format_bytes(worker['VmData'])} ({result['outside_error']:+.2%}), VmHWM "
          f"{format_bytes(worker['VmHWM'])}; out-of-memory events {result['oom_events']}")
    print(f"tokens/s: sampler {format_rate(tokens_s)}, fixed batch {fixed_batch} x {longest} padded "
          f"{format_rate(fixed['tokens_per_s'])}: ratio {result['ratio']:.2f}x")


if __name__ == "__main__":
    main()
