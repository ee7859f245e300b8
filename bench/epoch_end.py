"""Which part of an epoch's end raises a host run's peak after its steps have levelled off.

One worker as a steady trial runs one (:mod:`bench.creep_curves`): the spec at its budget, a batch size, one warm-up
step, then ``--steps`` measured steps; then, one at a time, the parts of the trainer's epoch's end, reading the peak
after each, with full steps between them:

- ``partial``: a training step at the epoch's last, partial batch (``--partial`` samples);
- ``validate``: a validation pass over ``--val-chunks`` chunks at the batch size and one partial chunk;
- ``save``: ``torch.save`` of the model's and the optimizer's state to a file (the trainer's checkpoint).

    .venv/bin/python -m bench.epoch_end small 176 --partial 31 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from bench.specs import SPECS
from vramcal.api import worker_pool
from vramcal.measure.device import host_device
from vramcal.units import format_bytes, parse_bytes


def run(ref, budget_bytes: int, batch_size: int, steps: int, partial: int, val_chunks: int, order: str, data: str,
        channel=None) -> list[tuple[str, int]]:
    """In the worker: the model ``ref`` under ``budget_bytes``, ``steps`` steps, then each event of ``order``; the
    peak after each, bytes."""
    import torch

    from vramcal.measure.meters import open_meter
    from vramcal.workload import build, train_step, validation_step

    meter = open_meter(host_device(budget_bytes), budget_bytes)
    try:
        step = build(ref, torch.device("cpu"), {"data": data, "stride": 1})
        train_step(step, step.batch(batch_size))
        meter.reset()
        peaks = []

        def full(n: int, label: str) -> None:
            for _ in range(n):
                train_step(step, step.batch(batch_size))
            peaks.append((label, int(meter.read()["peak_bytes"])))

        full(steps, f"{steps} steps")
        for event in order.split(","):
            if event.startswith("steps:"):
                full(int(event.split(":")[1]), event)
                continue
            if event == "partial":
                train_step(step, step.batch(partial))
            elif event == "validate":
                for _ in range(val_chunks):
                    validation_step(step, batch_size)
                validation_step(step, partial)
            elif event == "save":
                with tempfile.TemporaryDirectory() as folder:
                    torch.save({"model": step.model.state_dict(), "optimizer": step.optimizer.state_dict()},
                               os.path.join(folder, "last.pt"))
            peaks.append((event, int(meter.read()["peak_bytes"])))
        return peaks
    finally:
        meter.close()


def bad_event(order: str) -> str | None:
    """The first event of ``order`` that :func:`run` does not know (None: all known)."""
    for event in order.split(","):
        steps = event.split(":")[1] if event.startswith("steps:") else None
        if event not in ("partial", "validate", "save") and not (steps and steps.isdigit() and int(steps) > 0):
            return event
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("batch_size", type=int)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--partial", type=int, default=31)
    parser.add_argument("--val-chunks", type=int, default=17)
    parser.add_argument("--order", default="partial,steps:5,validate,steps:5,save,steps:5")
    parser.add_argument("--data", default="data/es_1s.parquet")
    args = parser.parse_args()
    if (event := bad_event(args.order)) is not None:
        parser.error(f"--order: unknown event {event!r}: use partial, validate, save or steps:N (N > 0)")
    bench = SPECS[args.spec]
    outcome = worker_pool().run(run, bench.spec.ref("transformers"), parse_bytes(bench.budget), args.batch_size,
                                args.steps, args.partial, args.val_chunks, args.order, args.data)
    if outcome.status != "ok":
        raise SystemExit(f"{outcome.status}: {outcome.message}\n{outcome.error}")
    first = outcome.result[0][1]
    for label, peak in outcome.result:
        print(f"{label:>12}  {format_bytes(peak):>12}  {peak - first:+,} B ({(peak - first) / first * 100:+.2f} %)")
    print(json.dumps(outcome.result))


if __name__ == "__main__":
    main()
