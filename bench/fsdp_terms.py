"""What a DDP rank holds beyond an FSDP rank, term by term: where ``bench.fsdp``'s difference beyond the counted
sharded bytes comes from.

``python -m bench.fsdp_terms`` runs one 2-rank gloo world of each strategy (the ``states-heavy`` spec of
:mod:`bench.fsdp` at ``--batch-size``, built, wrapped and stepped as a world's trial does:
:func:`vramcal.measure.distributed.wrap`, :func:`vramcal.workload.train_step`, the workers' glibc malloc settings),
and on each rank, after ``--warmup`` steps:

- **between steps** (the gradients freed): the process's resident set (VmRSS) and data segment (VmData), and the
  parameters and optimizer state it holds (counted: a DTensor's local shard);
- **the step's peak**: the host meter's figures for one more step (``peak_bytes``: VmHWM since a reset before the
  step, or the data-segment peak, the larger; :func:`vramcal.measure.meters.host_peaks`);
- DDP's gradient buckets (the reducer's ``bucket_sizes``, its logging data) and the largest unit's unsharded
  parameter bytes (one all-gathered block under FSDP).

So ``peak - between`` is what the step holds transiently (activations, gradients, FSDP's gathered units and
collective buffers) and the worlds' difference splits into what stays between steps and what the step adds.
It prints rank 0's figures for both worlds and writes every rank's as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def rank(index: int, strategy: str, batch_size: int, warmup: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from bench.fsdp import HEAVY
    from vramcal.measure.distributed import local_bytes, shard_units, wrap
    from vramcal.measure.meters import host_peaks, read_status_bytes, reset_peak_rss
    from vramcal.records import World
    from vramcal.workload import build, optimizer_step, train_step

    torch.set_num_threads(1)
    world = World(2, strategy=strategy)
    dist.init_process_group("gloo", init_method=init, rank=index, world_size=2)
    step = build(HEAVY.ref("transformers"), torch.device("cpu"))
    units = [sum(p.numel() * p.element_size() for p in u.parameters()) for u in shard_units(step)]
    model = wrap(step, world, torch.device("cpu"))

    def one() -> None:
        train_step(step, step.batch(batch_size), model)
        optimizer_step(step)

    for _ in range(warmup):
        one()
    dist.barrier()
    states = local_bytes([*step.model.parameters(), *(v for s in step.optimizer.state.values()
                                                      for v in s.values() if hasattr(v, "numel"))])
    rss_between = read_status_bytes("VmRSS") - read_status_bytes("RssFile")  # as the host peak counts it
    data_between = read_status_bytes("VmData")
    reset_peak_rss()
    one()
    peaks = host_peaks()
    facts = {"strategy": strategy, "rank": index, "batch_size": batch_size, "rss_between_bytes": rss_between,
             "data_between_bytes": data_between, **peaks,
             "params_and_optimizer_bytes": states, "largest_unit_bytes": max(units, default=0),
             "grad_bytes_whole": sum(p.numel() * p.element_size() for p in step.model.parameters())}
    if strategy == "ddp":
        facts["bucket_sizes"] = [int(b) for b in str(model._get_ddp_logging_data().get("bucket_sizes")).split(",")]
    Path(out, f"{strategy}-{index}.json").write_text(json.dumps(facts))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from vramcal.environment import WORKER_DEFAULTS

    parser = argparse.ArgumentParser(prog="python -m bench.fsdp_terms", description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=28)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fsdp" / "terms.json")
    args = parser.parse_args(argv)
    os.environ.update({k: v for k, v in WORKER_DEFAULTS.items() if k not in os.environ})  # the workers' malloc
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for strategy in ("fsdp", "ddp"):
            init = f"file://{folder}/{strategy}-init"
            mp.start_processes(rank, args=(strategy, args.batch_size, args.warmup, init, folder), nprocs=2,
                               start_method="spawn")
            results[strategy] = [json.loads(Path(folder, f"{strategy}-{i}.json").read_text()) for i in range(2)]
    mib = 2**20
    for strategy, ranks in results.items():
        r = ranks[0]
        print(f"{strategy}: peak {r['peak_bytes'] / mib:.2f} MiB (rss {r['rss_peak_bytes'] / mib:.2f}, data "
              f"{r['data_peak_bytes'] / mib:.2f}); between steps rss {r['rss_between_bytes'] / mib:.2f}, data "
              f"{r['data_between_bytes'] / mib:.2f} MiB; params+optimizer "
              f"{r['params_and_optimizer_bytes'] / mib:.2f} MiB; largest unit {r['largest_unit_bytes'] / mib:.2f} MiB"
              + (f"; buckets {[round(b / mib, 2) for b in r['bucket_sizes']]}" if 'bucket_sizes' in r else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"results": results, "command": "python -m bench.fsdp_terms "
                                    + " ".join(argv if argv is not None else sys.argv[1:])}, indent=2) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
