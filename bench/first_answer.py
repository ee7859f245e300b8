"""A Lightning user's first answer, with nothing written but the module: vramcal's callback beside BatchSizeFinder.

The module is ``examples/lightning_train.py``'s (the tiny Mamba-2 language model, random tokens). Each run is a
fresh Python process, as a user's script, on the host under the same budget (``--capacity``: vramcal's trials run
under it, and the BatchSizeFinder's process runs under it as ``RLIMIT_DATA``, so its out-of-memory errors happen
where a budgeted host's would):

* ``first``: ``VramcalBatchSize()`` with an empty profiles folder: the module calibrated in vramcal's trials, the
  profile verified and saved, the batch size set, then ``--steps`` steps;
* ``second``: the same again: the profile found, no trial;
* ``finder``: Lightning's ``BatchSizeFinder(mode="binsearch")`` (its defaults: 3 steps per size, from 2, doubling
  until an out-of-memory error, then bisecting), then ``--steps`` steps at the size it found.

Each prints the seconds from ``trainer.fit`` to the first training batch (the answer's wall time), the batch size
and this process's peak (VmHWM, and the data-segment peak the budget binds).

    .venv/bin/python -m bench.first_answer [--capacity 1.6GiB] [--steps 3] [--out bench/results/first-answer]

Writes ``first-answer.json`` and ``first-answer.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
KINDS = ("first", "second", "finder")


def child(kind: str, profiles_dir: str, capacity: str, steps: int) -> dict:
    """One run in this process: the figures."""
    import resource
    import warnings

    sys.path.insert(0, str(EXAMPLES))
    import lightning
    from lightning_train import LanguageModel

    from vramcal.measure.meters import host_peaks
    from vramcal.units import parse_bytes

    warnings.simplefilter("ignore")
    marks: dict = {}

    class Clock(lightning.Callback):
        def on_train_batch_start(self, trainer, module, batch, index) -> None:
            marks.setdefault("answered", time.perf_counter())
            marks.setdefault("batch_size", len(batch["input_ids"]))

    if kind == "finder":
        budget = parse_bytes(capacity)
        resource.setrlimit(resource.RLIMIT_DATA, (budget, budget))
        from lightning.pytorch.callbacks import BatchSizeFinder

        sizing = BatchSizeFinder(mode="binsearch")
    else:
        from vramcal.integrations.lightning import VramcalBatchSize

        sizing = VramcalBatchSize(profiles_dir=profiles_dir, capacity_bytes=capacity)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=steps, callbacks=[sizing, Clock()], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = LanguageModel()
    started = time.perf_counter()
    error = None
    try:
        trainer.fit(module)
    except Exception as failure:  # noqa: BLE001 - a finder whose size runs out of memory in the fit: a figure
        error = f"{type(failure).__name__}: {str(failure).splitlines()[0][:200]}"
    return {"kind": kind, "answer_s": marks.get("answered", time.perf_counter()) - started,
            "batch_size": module.batch_size, "steps": trainer.global_step, "error": error, **host_peaks()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", default="1.6GiB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "first-answer")
    parser.add_argument("--child", choices=KINDS, default=None)
    parser.add_argument("--profiles-dir", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.profiles_dir, args.capacity, args.steps)))
        return
    from vramcal.units import format_bytes

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "ARROW_DEFAULT_MEMORY_POOL")}
    with tempfile.TemporaryDirectory() as profiles:
        for kind in KINDS:
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "bench.first_answer", "--child", kind, "--profiles-dir",
                                   profiles, "--capacity", args.capacity, "--steps", str(args.steps)],
                                  capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
            if done.returncode != 0:
                rows.append({"kind": kind, "error": done.stderr.strip().splitlines()[-1:]})
                continue
            r = {**json.loads(done.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - started}
            rows.append(r)
            print(f"{kind}: answer {r['answer_s']:.1f} s (process {r['process_s']:.1f} s), "
                  f"batch_size {r['batch_size']}, {r['steps']} steps, peak {format_bytes(r['peak_bytes'])}"
                  f"{'; ' + r['error'] if r['error'] else ''}")
    load = os.getloadavg()
    result = {"capacity": args.capacity, "steps": args.steps, "cpus": os.cpu_count(), "load": load, "rows": rows}
    (args.out / "first-answer.json").write_text(json.dumps(result, indent=2))
    lines = [f"# A Lightning user's first answer: the tiny LM of examples/lightning_train.py, host, {args.capacity}",
             "", "| run | answer (s) | process (s) | batch size | steps | peak | data-segment peak | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "answer_s" not in r:
            lines.append(f"| {r['kind']} | failed: {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['kind']} | {r['answer_s']:.1f} | {r['process_s']:.1f} | {r['batch_size']} | "
                     f"{r['steps']} | {format_bytes(r['rss_peak_bytes'])} | {format_bytes(r['data_peak_bytes'])} | "
                     f"{r['error'] or ''} |")
    lines += ["", f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at the end.", "",
              f"Command: `.venv/bin/python -m bench.first_answer --capacity {args.capacity} --steps {args.steps}`"]
    (args.out / "first-answer.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
