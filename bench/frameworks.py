"""The profile's promise in a framework's process: Lightning, Hugging Face Trainer and Accelerate at the profile's size.

One calibration of a Mamba-2 language model (the ``lm`` family: transformers' ``Mamba2ForCausalLM``, random
tokens) on the host under a budget, then, for each framework, a fresh Python process (as a user's script runs)
that trains the same model with the framework and vramcal's integration at the profile's conservative size for
``--steps`` optimizer steps:

* ``lightning``: a ``LightningModule`` whose ``batch_size`` the ``VramcalBatchSize`` callback sets;
* ``hf``: ``transformers.Trainer`` with ``VramcalCallback.sized(TrainingArguments(...))``;
* ``accelerate``: ``accelerator.prepare`` on the model and AdamW, ``sized(accelerator, ...)``, and
  ``measured(...)`` around the loop;
* ``plain``: a plain PyTorch loop with ``FrameworkRun`` (the README's pattern).

Each runs in the environment this command started with (not with the allocator settings vramcal's worker pool
puts in ``os.environ`` for its fork server: a user's script starts without them). Each prints what the
integration predicted (its process term included) and the peak it measured in its own process (the trials'
definition: on the host the larger of VmHWM less file-backed pages and the data-segment peak). The parent reads the
same process from outside, polling ``/proc/<pid>/status`` (VmHWM, VmData) every 50 ms, as a cross-check.

    .venv/bin/python -m bench.frameworks [--steps 100] [--capacity 1.5GiB] [--out bench/results/frameworks]

Writes ``frameworks.json`` and ``frameworks.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "mamba2-lm-tiny.json"
FRAMEWORKS = ("lightning", "hf", "accelerate", "plain")


class Tokens(torch.utils.data.Dataset):
    """Random token windows, a fresh one per index (deterministic), for as many steps as asked."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def model_and_data(seq_len: int, steps: int, batch_hint: int) -> tuple[torch.nn.Module, Tokens]:
    from vramcal.models.lm import mamba2_config, read_config
    from vramcal.models.mamba2 import import_transformers_mamba2

    settings = read_config(str(CONFIG))
    torch.manual_seed(0)
    model = import_transformers_mamba2().Mamba2ForCausalLM(mamba2_config(settings))
    return model, Tokens(steps * batch_hint * 2, seq_len, settings["vocab_size"])


def child(framework: str, profile: str, steps: int, seq_len: int) -> dict[str, Any]:
    """One framework's run (in its own process); the integration's figures."""
    from vramcal.profile import load_profile

    conservative = load_profile(profile).limits.conservative_batch_size
    if framework == "lightning":
        run = _lightning(profile, steps, seq_len, conservative)
    elif framework == "hf":
        run = _hf(profile, steps, seq_len, conservative)
    elif framework == "accelerate":
        run = _accelerate(profile, steps, seq_len, conservative)
    else:
        run = _plain(profile, steps, seq_len, conservative)
    s = run.sizing
    return {"framework": framework, "batch_size": s.batch_size, "conservative": conservative,
            "predicted_peak_bytes": s.predicted_peak_bytes, "upper_bytes": s.upper_bytes,
            "usable_bytes": s.usable_bytes, "process_delta_bytes": s.process_delta_bytes,
            "held_bytes": run.held_bytes, "peak_bytes": run.peak_bytes}


def _lightning(profile: str, steps: int, seq_len: int, hint: int):
    import lightning

    from vramcal.integrations.lightning import VramcalBatchSize

    model, data = model_and_data(seq_len, steps, hint)

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.batch_size = model, 1

        def training_step(self, batch, index):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=False)

    callback = VramcalBatchSize(profile)
    trainer = lightning.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, callbacks=[callback])
    trainer.fit(Module())
    return callback.run


def _hf(profile: str, steps: int, seq_len: int, hint: int):
    from transformers import Trainer, TrainingArguments

    from vramcal.integrations.hf import VramcalCallback

    model, data = model_and_data(seq_len, steps, hint)
    callback = VramcalCallback(profile)
    args = callback.sized(TrainingArguments(output_dir="/tmp/vramcal-bench-hf", max_steps=steps, use_cpu=True,
                                            report_to=[], save_strategy="no", logging_strategy="no",
                                            disable_tqdm=True, learning_rate=1e-4, weight_decay=0.01,
                                            dataloader_num_workers=0))
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    return callback.run


def _accelerate(profile: str, steps: int, seq_len: int, hint: int):
    from accelerate import Accelerator

    from vramcal.integrations.accelerate import measured, sized

    accelerator = Accelerator(cpu=True)
    model, data = model_and_data(seq_len, steps, hint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    run = sized(accelerator, profile)
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=run.sizing.batch_size))
    with measured(run, accelerator) as done:
        for batch in loader:
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
            done.done += 1
            if done.done >= steps:
                break
    return run


def _plain(profile: str, steps: int, seq_len: int, hint: int):
    from vramcal.integrations.run import FrameworkRun

    run = FrameworkRun(profile, device="cpu")
    model, data = model_and_data(seq_len, steps, hint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(data, batch_size=run.start().batch_size)
    for done, batch in enumerate(loader, start=1):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if done >= steps:
            break
    run.conclude(steps)
    return run


# The environment this command started with: vramcal's worker pool sets its allocator defaults in os.environ
# for the fork server (vramcal.environment.WORKER_DEFAULTS), and a user's script would not start with them.
USER_ENV = dict(os.environ)


def watch(command: list[str]) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    """Run ``command`` in the environment this command started with, polling its /proc status: the largest
    VmHWM and VmData seen (bytes)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=USER_ENV)
    seen = {"VmHWM": 0, "VmData": 0}
    while process.poll() is None:
        try:
            for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in seen:
                    seen[key] = max(seen[key], int(value.split()[0]) * 1024)
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    out, err = process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, out, err), seen


def main() -> None:
    from vramcal.units import format_bytes, parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--capacity", default="1.5GiB")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "frameworks")
    parser.add_argument("--child", choices=FRAMEWORKS, default=None)
    parser.add_argument("--profile", default=None)
    args = parser.parse_args()
    if args.child:
        warnings.simplefilter("ignore")  # the frameworks' own; vramcal's warnings are what it printed
        warnings.filterwarnings("always", message="vramcal")
        print(json.dumps(child(args.child, args.profile, args.steps, args.seq_len)))
        return
    import vramcal

    args.out.mkdir(parents=True, exist_ok=True)
    profile = vramcal.calibrate("lm", {"config": str(CONFIG), "seq_len": args.seq_len}, gpu="none",
                                capacity_bytes=parse_bytes(args.capacity), profiles_dir=args.out / "profiles")
    (path,) = sorted((args.out / "profiles").glob("**/*.json"))[-1:]
    rows = []
    for framework in FRAMEWORKS:
        started = time.perf_counter()
        done, outside = watch([sys.executable, "-m", "bench.frameworks", "--child", framework, "--profile",
                               str(path), "--steps", str(args.steps), "--seq-len", str(args.seq_len)])
        if done.returncode != 0:
            rows.append({"framework": framework, "error": done.stderr.strip().splitlines()[-1:]})
            print(f"{framework}: failed: {rows[-1]['error']}")
            continue
        printed = [line[line.index("vramcal"):] for line in (done.stdout + done.stderr).splitlines()
                   if "vramcal: " in line and "warnings.warn" not in line]
        row = {**json.loads(done.stdout.strip().splitlines()[-1]), "printed": printed,
               "outside_vmhwm_bytes": outside["VmHWM"],
               "outside_vmdata_bytes": outside["VmData"], "wall_s": time.perf_counter() - started,
               "steps": args.steps}
        row["error_fraction"] = (row["peak_bytes"] - row["predicted_peak_bytes"]) / row["predicted_peak_bytes"]
        rows.append(row)
        term = (row["process_delta_bytes"] or 0) / 2**20
        print(f"{framework}: batch_size {row['batch_size']} (conservative {row['conservative']}), predicted "
              f"{format_bytes(row['predicted_peak_bytes'])} (process term {term:+.1f} MiB), measured "
              f"{format_bytes(row['peak_bytes'])} ({row['error_fraction']:+.1%}), usable "
              f"{format_bytes(row['usable_bytes'])}; outside: VmHWM {format_bytes(outside['VmHWM'])}, VmData "
              f"{format_bytes(outside['VmData'])}; {row['wall_s']:.0f} s")
    result = {"profile": str(path), "capacity": args.capacity, "seq_len": args.seq_len, "config": CONFIG.name,
              "safe": profile.limits.safe_batch_size, "conservative": profile.limits.conservative_batch_size,
              "rows": rows}
    (args.out / "frameworks.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Frameworks at the profile's size: lm ({CONFIG.name}, seq_len {args.seq_len}), host, "
             f"{args.capacity}, {args.steps} steps", "",
             "| framework | batch size | predicted (process term) | measured | error | usable | outside VmHWM |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['framework']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['framework']} | {r['batch_size']} | {format_bytes(r['predicted_peak_bytes'])} "
                     f"({(r['process_delta_bytes'] or 0) / 2**20:+.1f} MiB) | {format_bytes(r['peak_bytes'])} | "
                     f"{r['error_fraction']:+.1%} | {format_bytes(r['usable_bytes'])} | "
                     f"{format_bytes(r['outside_vmhwm_bytes'])} |")
    for r in rows:
        lines += ["", f"{r['framework']} printed:", "", "```", *r.get("printed", []), "```"]
    lines += ["", "Command: `.venv/bin/python -m bench.frameworks --steps "
              f"{args.steps} --capacity {args.capacity} --seq-len {args.seq_len}`"]
    (args.out / "frameworks.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
