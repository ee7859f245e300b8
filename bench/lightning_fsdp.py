"""A Lightning FSDP fit sized by the callback, on 2 gloo ranks of the host: each rank's peak against its prediction.

``python -m bench.lightning_fsdp --profile FILE`` (a 2-rank FSDP profile of a :mod:`bench.fsdp` spec: ``python -m
bench.fsdp`` writes one; without ``--profile`` this command calibrates ``--spec`` itself, ``vramcal.api`` with
``World(2, strategy="fsdp")``) runs a fresh process, as a user's script runs, that fits a ``LightningModule`` with
``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` on 2 CPU ranks (Lightning starts the second
rank itself), started with the trials' glibc malloc settings (``GLIBC_TUNABLES`` as vramcal's information line advises
a host run; the callback gives the process Arrow's system memory pool when it is made). Its ``configure_model``
builds the spec's training step (vramcal's regressor factory) and shards it as the probe does
(:func:`vramcal.measure.distributed.shard`: ``fully_shard`` on each Mamba-2 block and the root);
its ``training_step`` is the factory's loss on a batch of the size the dataloader hands it. The
:class:`~vramcal.integrations.lightning.VramcalBatchSize` callback reads the FSDP world from the sharded module at
fit start, sizes ``batch_size`` from the profile (the process term and Lightning's gradient term included) and
measures each rank's peak (the trials' definition). Rank 0 writes every rank's peak and prediction as JSON
(``--out``).

``--child`` is the fit itself (what the launched process runs; the test suite runs it with a small spec).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


def fit(profile: str, spec: str, steps: int, out: Path, profiles_dir: str | None = None) -> None:
    """The Lightning fit on 2 ranks (module docstring); rank 0 writes the ranks' figures to ``out``."""
    import warnings

    import lightning
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    from bench.fsdp import SPEC_CHOICES
    from vramcal.integrations.lightning import VramcalBatchSize
    from vramcal.measure.distributed import shard
    from vramcal.records import World
    from vramcal.workload import build

    warnings.simplefilter("ignore")  # the frameworks' own; vramcal's reach the log as information and warnings
    ref = SPEC_CHOICES[spec].ref("transformers")

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size, self.step = 1, None

        def configure_model(self) -> None:
            if self.step is None:
                self.step = build(ref, torch.device("cpu"))
                self.model = shard(self.step, World(self.trainer.world_size, strategy="fsdp"))

        def training_step(self, indices, index):
            return self.step.loss(self.model, self.step.batch(indices.shape[0]))

        def configure_optimizers(self):
            return self.step.optimizer

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.arange(10**6), batch_size=self.batch_size)

    callback = (VramcalBatchSize(profile) if profiles_dir is None else
                VramcalBatchSize(model=ref, profiles_dir=profiles_dir))
    trainer = lightning.Trainer(max_steps=steps, accelerator="cpu", devices=2, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                               process_group_backend="gloo"),
                                callbacks=[callback])
    trainer.fit(Module())
    s = callback.sizing
    figures = torch.tensor([float(s.predicted_peak_bytes), float(s.upper_bytes), float(callback.peak_bytes)])
    ranks = trainer.strategy.all_gather(figures).reshape(-1, 3).tolist()
    if trainer.global_rank == 0:
        out.write_text(json.dumps({
            "world": callback.run.world.describe(), "source": callback.profile_source, "batch_size": s.batch_size,
            "safe": s.safe_batch_size, "conservative": s.conservative_batch_size, "usable_bytes": s.usable_bytes,
            "steps": trainer.global_step,
            "ranks": [{"predicted_peak_bytes": p, "upper_bytes": u, "peak_bytes": m} for p, u, m in ranks],
            "report": callback.report}, indent=2) + "\n")
    # gloo's threads joined before the interpreter exits: left to exit, a rank once aborted there under load
    # ("terminate called without an active exception", exit -6) after its figures were written
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from vramcal.environment import WORKER_DEFAULTS
    from vramcal.units import parse_bytes

    parser = argparse.ArgumentParser(prog="python -m bench.lightning_fsdp", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="a 2-rank FSDP profile of --spec [default: calibrate one]")
    parser.add_argument("--profiles-dir", default=None, help="--child: find the profile here by the model")
    parser.add_argument("--spec", default="states-heavy")
    parser.add_argument("--capacity", default="2GiB", help="each rank's budget, when calibrating")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fsdp" / "lightning.json")
    parser.add_argument("--child", action="store_true", help="run the fit itself")
    args = parser.parse_args(argv)
    if args.child:
        fit(args.profile, args.spec, args.steps, args.out, args.profiles_dir)
        # its figures are written and its process group destroyed: leave without the interpreter's teardown, where a
        # rank still aborted now and then ("terminate called without an active exception", exit -6: a C++ thread of
        # the run's libraries not joined), after destroy_process_group() alone
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    profile = args.profile
    if profile is None:
        from bench.fsdp import SPEC_CHOICES, calibrate
        from vramcal.records import World

        ref = SPEC_CHOICES[args.spec].ref("transformers")
        made = calibrate(ref, parse_bytes(args.capacity), World(2, strategy="fsdp"), args.out.parent / "profiles")
        profile = str(made.path)
    started = time.perf_counter()
    # glibc's malloc as the trials' from the first allocation, as FrameworkRun.start advises a host run; Arrow's pool
    # is the callback's to set (vramcal.integrations.run.use_system_arrow_pool: with Arrow's default pool, mimalloc,
    # the regressor's data read in a rank's thread reserves a 1 GiB mapping that VmData counts: a process term of
    # +1.13 GiB a rank, measured before the callback set it, and refused)
    env = {**os.environ, "GLIBC_TUNABLES": WORKER_DEFAULTS["GLIBC_TUNABLES"]}
    done = subprocess.run([sys.executable, "-m", "bench.lightning_fsdp", "--child", "--profile", profile, "--spec",
                           args.spec, "--steps", str(args.steps), "--out", str(args.out)], cwd=REPO,
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return 1
    result = json.loads(args.out.read_text())
    print(f"{result['world']}, batch_size {result['batch_size']} (safe {result['safe']}, conservative "
          f"{result['conservative']}) from {result['source']}, {result['steps']} steps, "
          f"{time.perf_counter() - started:.0f} s")
    for rank, r in enumerate(result["ranks"]):
        error = (r["peak_bytes"] - r["predicted_peak_bytes"]) / r["predicted_peak_bytes"] * 100
        r["error_pct"] = error
        print(f"rank {rank}: predicted {r['predicted_peak_bytes'] / MIB:.2f} MiB (upper {r['upper_bytes'] / MIB:.2f}),"
              f" measured {r['peak_bytes'] / MIB:.2f} MiB ({error:+.2f} %)")
    result["command"] = "python -m bench.lightning_fsdp " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
