"""Checkpointing or accumulation, for an effective batch that does not fit as one micro-batch (issue 45).

``python -m bench.checkpoint_or_accumulate`` on the host, under one ``--capacity``:

1. calibrates a benchmark spec (``--spec``, :data:`bench.specs.SPECS`: ``small`` by default, whose steps are
   about eight times cheaper than the default spec's, so 200 steps fit a session on a shared 2-core host) without
   checkpointing (``off``) and with every block checkpointed (``block``), each verified
   (:func:`bench.checkpointing.calibrate`), on one bars file (``--data``, or synthetic bars written to ``--out``) at
   ``--stride`` as the training runs read it;
2. takes an effective batch that does not fit as one micro-batch without checkpointing (``--effective-batch-size``;
   default twice ``off``'s conservative size, above its safe size) and asks vramcal's choice
   (:func:`vramcal.sizing.variants.choose`, as ``vramcal train --variant auto`` does): ``off`` accumulates
   micro-batches of its conservative size, ``block`` trains larger micro-batches (one where its conservative size
   admits it);
3. measures both: ``vramcal train`` of each setting for ``--steps`` optimizer steps, ``--rounds`` rounds in
   alternating order (the machine is shared), samples/s as the trainer measures it (``samples_per_s`` of the
   last epoch row in ``metrics.jsonl``: its samples over its steps' time); the faster one by the medians is set
   beside the choice;
4. trains ``--long-steps`` (200) steps with ``vramcal train --variant auto --effective-batch-size N``: its measured
   peak against the profile's prediction for its micro-batch (the issue's bound: within ±3 %).

Writes ``checkpoint_or_accumulate-<capacity>.md`` and ``.json`` under ``--out`` (the commands included).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.checkpointing import REPO, calibrate
from bench.specs import SPECS

MIB = 2**20


def train(args: argparse.Namespace, extra: list[str], steps: int, run_dir: Path) -> dict:
    """One ``vramcal train`` run in a fresh process: its ``--json`` summary and its last epoch row."""
    spec = args.variants["off"]
    shape = [f"--{name.replace('_', '-')}={getattr(spec, name)}"
             for name in ("d_model", "n_layers", "d_state", "headdim", "expand", "chunk_size", "seq_len")]
    command = [sys.executable, "-m", "vramcal", "train", "--gpu", "none", "--capacity", args.capacity, *shape,
               "--data", args.bars, "--stride", str(args.stride), "--effective-batch-size", str(args.effective),
               "--max-steps", str(steps), "--epochs", "1000", "--report-to", "none", "--run-dir", str(run_dir),
               "--json", *extra]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode:
        raise SystemExit(f"vramcal train failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    summary = json.loads(done.stdout)
    rows = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines() if line.strip()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    samples = sum(r["samples"] for r in epochs)
    train_s = sum(r["train_s"] for r in epochs)
    return {"command": " ".join(["vramcal", *command[3:]]), "batch_size": summary["batch_size"],
            "step_batch_size": summary["step_batch_size"], "steps": summary["steps"],
            "samples_per_s": samples / train_s, "peak_bytes": summary["peak_bytes"],
            "predicted_peak_bytes": summary["predicted_peak_bytes"], "upper_bytes": summary["upper_bytes"],
            "profile": summary["profile"]}


def measure(args: argparse.Namespace, profiles: dict, work: Path) -> dict[str, list[dict]]:
    """``--rounds`` runs of each setting, alternating which goes first."""
    runs: dict[str, list[dict]] = {name: [] for name in profiles}
    for round_ in range(args.rounds):
        for name in (list(profiles) if round_ % 2 == 0 else list(profiles)[::-1]):
            spec = ["--checkpointing", args.variants[name].checkpointing]  # the profile's model, as given
            run = train(args, ["--profile", str(profiles[name][0]), *spec], args.steps, work / f"{name}-{round_}")
            runs[name].append(run)
            print(f"  {name}, round {round_}: batch {run['batch_size']} x {run['step_batch_size'] // run['batch_size']}"
                  f", {run['samples_per_s']:.2f} samples/s", flush=True)
    return runs


def lines(args: argparse.Namespace, profiles: dict, choice, runs: dict, long: dict, command: str) -> list[str]:
    """The Markdown results."""
    from vramcal.sizing.variants import variant_label

    medians = {name: statistics.median(r["samples_per_s"] for r in each) for name, each in runs.items()}
    faster = max(medians, key=medians.get)
    chosen = next(n for n, (_, p) in profiles.items() if p.model == choice.chosen.profile.model)
    error = long["peak_bytes"] / long["predicted_peak_bytes"] - 1
    out = [f"# Checkpointing or accumulation on the host at {args.capacity}: effective batch {args.effective}", "",
           f"- command: `{command}`; created (UTC) {dt.datetime.now(dt.UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}",
           f"- data: {args.bars} (stride {args.stride}); spec {args.spec}: `{args.variants['off'].short()}` "
           f"[transformers]", "",
           "| setting | verified | safe | conservative | micro-batch x accumulation | samples/s by vramcal train "
           f"({args.steps} steps, {args.rounds} runs, median) | runs |", "|---|---|---|---|---|---|---|"]
    for name, (_, profile) in profiles.items():
        run = runs[name][0]
        out.append(f"| {variant_label(profile.model)} | {'yes' if profile.verified else 'no'} | "
                   f"{profile.limits.safe_batch_size} | {profile.limits.conservative_batch_size} | "
                   f"{run['batch_size']} x {run['step_batch_size'] // run['batch_size']} | {medians[name]:.2f} | "
                   + ", ".join(f"{r['samples_per_s']:.2f}" for r in runs[name]) + " |")
    out += ["", f"- vramcal's choice (`choose`, the profiles' trial rates): **{chosen}**: {choice.reason}",
            f"- faster by measurement: **{faster}** ({medians[faster] / min(medians.values()) - 1:+.1%} samples/s); "
            f"the choice is {'the faster one' if faster == chosen else 'NOT the faster one'}",
            f"- {args.long_steps} steps with `--variant auto`: `{long['command']}`: micro-batch {long['batch_size']} "
            f"(x {long['step_batch_size'] // long['batch_size']}), peak {long['peak_bytes'] / MIB:.1f} MiB against "
            f"the predicted {long['predicted_peak_bytes'] / MIB:.1f} MiB: {error:+.2%} "
            f"({'within' if abs(error) <= 0.03 else 'OUTSIDE'} ±3 %), {long['samples_per_s']:.2f} samples/s", ""]
    return out


def main(argv: list[str] | None = None) -> int:
    from vramcal.models.regressor.bars import synthetic_bars, write_parquet
    from vramcal.sizing import SizeRequest
    from vramcal.sizing.variants import choose, variants_of
    from vramcal.units import parse_bytes

    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint_or_accumulate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--spec", choices=tuple(SPECS), default="small")
    parser.add_argument("--capacity", default="1.2GiB")
    parser.add_argument("--data", default="synthetic", help="a bars parquet, or synthetic")
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--effective-batch-size", dest="effective", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--long-steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "checkpointing")
    args = parser.parse_args(argv)
    off = SPECS[args.spec].spec
    args.variants = {"off": off, "block": dataclasses.replace(off, checkpointing="block")}
    command = "python -m bench.checkpoint_or_accumulate " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    args.bars = args.data if args.data != "synthetic" else str(  # kept outside --out: it is 1 MB of random bars
        write_parquet(synthetic_bars(), Path(tempfile.mkdtemp(prefix="bench-bars-")) / "bars-synthetic.parquet"))
    profiles_dir = args.out / "profiles-accumulate"
    made = {}
    for name in ("off", "block"):
        profile = calibrate(args.variants[name], parse_bytes(args.capacity), {"data": args.bars, "stride": args.stride},
                            profiles_dir)
        made[name] = profile
        print(f"{name}: {profile.fit.formula()}, safe {profile.limits.safe_batch_size}, conservative "
              f"{profile.limits.conservative_batch_size}, verified {profile.verified}", flush=True)
    found = variants_of(made["off"].model, made["off"].device, profiles_dir, total_bytes=made["off"].device.total_bytes)
    profiles = {name: next((path, p) for path, p in found if p.model == profile.model)
                for name, profile in made.items()}
    args.effective = args.effective or 2 * profiles["off"][1].limits.conservative_batch_size
    choice = choose(found, SizeRequest(effective_batch_size=args.effective), profiles["off"][1].model)
    print(f"choice for effective batch {args.effective}: {choice.reason}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-accumulate-") as work:
        runs = measure(args, profiles, Path(work))
        long = train(args, ["--variant", "auto", "--profiles-dir", str(profiles_dir)], args.long_steps,
                     Path(work) / "long")
    text = lines(args, profiles, choice, runs, long, command)
    print("\n".join(text))
    stem = f"checkpoint_or_accumulate-{args.spec}-{args.capacity.replace('.', '_')}"
    (args.out / f"{stem}.md").write_text("\n".join(text))
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"command": command, "effective_batch_size": args.effective, "choice": choice.reason, "runs": runs,
         "long": long}, indent=2, sort_keys=True, default=str) + "\n")
    print(f"written: {args.out / stem}.md, .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
