"""FSDP on the host, measured: what sharding saves a rank, and how well a 2-rank profile predicts a 3-rank world.

``python -m bench.fsdp`` calibrates a model (``--spec``: one of :data:`bench.specs.SPECS` or :data:`HEAVY`; or
``--lm CONFIG``) as a world
of 2 gloo ranks twice, under DDP and under FSDP2 (``vramcal.api.plan_calibration(..., world=World(2, strategy=...))``,
each trial a real world of ranks under the ``--capacity`` budget each), then:

1. **The sharded bytes.** ``--repeats`` real trials of each world at the FSDP profile's conservative size,
   interleaved: the per-rank peaks' difference (DDP - FSDP, medians) against what a DDP rank holds more, counted from
   the model (:func:`expected_difference`): the parameters and optimizer state sharded away (the gradients are not
   at the peak: :mod:`vramcal.sizing.sharding`), plus DDP's gradient buckets, less FSDP's two unsharded units in flight.
   The model states counted whole (``model_state_bytes - rank_model_state_bytes``, gradients included: the first
   comparison this bench made) are printed beside it.
2. **Another world size.** From the 2-rank FSDP profile, :func:`vramcal.sizing.sharding.at_world_size` at ``--to``
   ranks; then a real ``--to``-rank FSDP trial at that world's conservative size (steady, as a verification runs), its
   peak read as a verification reads it (:func:`vramcal.calibration.creep.read_peak`) against the moved fit's
   prediction there.

It prints the figures and writes them as JSON (``--out``). Each world's ranks run on this host's cores, so the
3-rank trial is slower, not larger, than on three cards.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.specs import SPECS
from vramcal.models.regressor.spec import RegressorSpec

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
# the benchmark's specs hold under 1 MiB of model states, below the noise of a rank's peak (~2 MiB); this one holds
# ~200 MiB (12.8 M parameters: 8 layers of d_model 512), so what sharding saves is measurable on the host
HEAVY = RegressorSpec(d_model=512, n_layers=8, d_state=16, headdim=32, seq_len=32, chunk_size=16)
SPEC_CHOICES = {**{name: bench.spec for name, bench in SPECS.items()}, "states-heavy": HEAVY}


def model(args: argparse.Namespace):
    """The ModelRef the bench calibrates: a benchmark spec (transformers, fp32), or an lm config."""
    from vramcal.models import lm
    from vramcal.workload import ModelRef

    if args.lm:
        return ModelRef.make(lm.FACTORY, {"config": lm.read_config(Path(args.lm)), "dtype": "fp32",
                                          "implementation": "transformers", "seq_len": args.seq_len})
    return SPEC_CHOICES[args.spec].ref("transformers")


def calibrate(ref, budget: int, world, out: Path):
    from vramcal import api
    from vramcal.measure.device import host_device

    plan = api.plan_calibration(ref, device=host_device(capacity_bytes=budget), world=world, profiles_dir=out)
    return api.run_calibration(plan)


def trial(ref, budget: int, world, batch_size: int, steady: bool = False):
    from vramcal.api import worker_pool
    from vramcal.measure.device import host_device
    from vramcal.measure.trial import TrialRequest, TrialRunner
    from vramcal.records import TrialSettings

    runner = TrialRunner(worker_pool())
    request = TrialRequest(ref, batch_size, host_device(capacity_bytes=budget), world=world, steady=steady,
                           verifies=steady, settings=TrialSettings(timeout_s=600))
    trials = runner.run(request, "steady" if steady else "")
    return trials[-1], runner.context


def expected_difference(ref, fsdp) -> dict[str, int]:
    """What a 2-rank DDP rank holds more than an FSDP rank at the peak, counted from the model (bytes): the
    parameters and optimizer state sharded away (:func:`vramcal.sizing.sharding.sharded_bytes`), plus DDP's gradient
    buckets (the gradients' size again, ``gradient_as_bucket_view=False``: PyTorch's DDP notes), less FSDP's two
    unsharded units in flight at the backward's start (the unit all-gathered and the next one prefetched, the largest
    unit's parameters each: PyTorch's FSDP2 notes; :func:`vramcal.measure.distributed.shard_units` on the model
    built here)."""
    import torch

    from vramcal.measure.distributed import shard_units
    from vramcal.sizing.sharding import sharded_bytes
    from vramcal.workload import build

    whole, held = sharded_bytes(fsdp)
    step = build(ref, torch.device("cpu"))
    unit = max((sum(p.numel() * p.element_size() for p in u.parameters()) for u in shard_units(step)), default=0)
    buckets = fsdp.model_info["gradient_bytes"] * fsdp.world.nproc
    sharded = whole - held
    return {"sharded_bytes": sharded, "bucket_bytes": buckets, "in_flight_bytes": 2 * unit,
            "expected_bytes": sharded + buckets - 2 * unit}


def main(argv: list[str] | None = None) -> int:
    from vramcal.calibration.creep import read_peak
    from vramcal.records import World
    from vramcal.sizing.sharding import at_world_size
    from vramcal.units import parse_bytes

    parser = argparse.ArgumentParser(prog="python -m bench.fsdp", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="states-heavy", choices=sorted(SPEC_CHOICES))
    parser.add_argument("--lm", default=None, help="an lm config file (configs/mamba2-lm-tiny.json) instead of --spec")
    parser.add_argument("--seq-len", type=int, default=32, help="the lm config's seq_len")
    parser.add_argument("--capacity", default="2GiB", help="each rank's budget")
    parser.add_argument("--to", type=int, default=3, help="the world size predicted from the 2-rank profile")
    parser.add_argument("--repeats", type=int, default=3, help="trials of each world at the same batch")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fsdp")
    args = parser.parse_args(argv)
    ref, budget = model(args), parse_bytes(args.capacity)
    args.out.mkdir(parents=True, exist_ok=True)

    fsdp = calibrate(ref, budget, World(2, strategy="fsdp"), args.out / "profiles")
    ddp = calibrate(ref, budget, World(2), args.out / "profiles")
    for name, profile in (("FSDP", fsdp), ("DDP", ddp)):
        print(f"{name} 2 ranks: {profile.fit.formula()}, safe {profile.limits.safe_batch_size}, conservative "
              f"{profile.limits.conservative_batch_size}, verified {profile.verified}")

    size = fsdp.limits.conservative_batch_size
    peaks = {"fsdp": [], "ddp": []}
    for _ in range(args.repeats):  # interleaved: the host's drift reaches both worlds alike
        peaks["fsdp"].append(trial(ref, budget, World(2, strategy="fsdp"), size)[0].peak_bytes)
        peaks["ddp"].append(trial(ref, budget, World(2), size)[0].peak_bytes)
    sharded, replicated = (statistics.median(peaks[k]) for k in ("fsdp", "ddp"))
    whole, held = fsdp.model_info["model_state_bytes"], fsdp.model_info["rank_model_state_bytes"]
    saved, counted, terms = replicated - sharded, whole - held, expected_difference(ref, fsdp)
    expected = terms["expected_bytes"]
    print(f"at batch_size {size}, medians of {args.repeats}: per-rank peak DDP {replicated / MIB:.2f} MiB, FSDP "
          f"{sharded / MIB:.2f} MiB: difference {saved / MIB:.2f} MiB; expected {expected / MIB:.2f} MiB "
          f"(parameters and optimizer state sharded away {terms['sharded_bytes'] / MIB:.2f} + DDP's buckets "
          f"{terms['bucket_bytes'] / MIB:.2f} - two unsharded units {terms['in_flight_bytes'] / MIB:.2f}): "
          f"{(saved - expected) / expected * 100:+.1f} %; against the model states counted whole (gradients "
          f"included) {counted / MIB:.2f} MiB: {(saved - counted) / counted * 100:+.1f} %")

    moved = at_world_size(fsdp, args.to)
    at = moved.limits.conservative_batch_size
    predicted = moved.overhead_bytes + fsdp.fit.slope_bytes_per_sample * at
    steady, context = trial(ref, budget, World(args.to, strategy="fsdp"), at, steady=True)
    measured = read_peak(steady, fsdp.creep) if steady.ok else None
    error = None if measured is None else (measured - predicted) / predicted * 100
    print(f"{args.to} ranks from the 2-rank profile: safe {moved.limits.safe_batch_size}, conservative {at} "
          f"(parameters and optimizer state {moved.shift_bytes / MIB:+.2f} MiB per rank); predicted peak at {at}: "
          f"{predicted / MIB:.2f} MiB; "
          f"real {args.to}-rank trial: {steady.status}"
          + ("" if measured is None else f", peak {measured / MIB:.2f} MiB ({error:+.2f} %)"))

    result = {"model": ref.to_dict(), "capacity_bytes": budget,
              "fsdp": {"formula": fsdp.fit.formula(), "limits": fsdp.limits.to_dict(), "verified": fsdp.verified,
                       "model_info": fsdp.model_info},
              "ddp": {"formula": ddp.fit.formula(), "limits": ddp.limits.to_dict(), "verified": ddp.verified},
              "same_batch": {"batch_size": size, "peaks_bytes": peaks, "ddp_peak_bytes": replicated,
                             "fsdp_peak_bytes": sharded, "difference_bytes": saved, **terms,
                             "error_pct": (saved - expected) / expected * 100, "model_states_bytes": counted,
                             "model_states_error_pct": (saved - counted) / counted * 100},
              "other_world": {"nproc": args.to, "conservative": at, "predicted_peak_bytes": predicted,
                              "status": steady.status, "peak_bytes": measured, "error_pct": error,
                              "rank_model_state_bytes": context.get("rank_model_state_bytes")},
              "command": "python -m bench.fsdp " + " ".join(argv if argv is not None else sys.argv[1:])}
    name = Path(args.lm).stem if args.lm else args.spec
    path = args.out / f"{name}-{args.capacity.replace('.', '_')}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
