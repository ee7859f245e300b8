"""FSDP on the host, measured: what sharding saves a rank, and how well a 2-rank profile predicts a 3-rank world.

``python -m bench.fsdp`` calibrates a model (``--spec``: one of :data:`bench.specs.SPECS` or :data:`HEAVY`; or
``--lm CONFIG``) as a world
of 2 gloo ranks twice, under DDP and under FSDP2 (``vramcal.api.plan_calibration(..., world=World(2, strategy=...))``,
each trial a real world of ranks under the ``--capacity`` budget each), then:

1. **The sharded bytes.** One real trial of each world at the FSDP profile's conservative size: the per-rank peaks'
   difference (DDP - FSDP) against the model-state bytes a DDP rank holds more, counted in the trials
   (``model_state_bytes - rank_model_state_bytes`` of the FSDP profile, :func:`vramcal.measure.trial.model_state`).
2. **Another world size.** From the 2-rank FSDP profile, :func:`vramcal.sharding.at_world_size` at ``--to`` ranks;
   then a real ``--to``-rank FSDP trial at that world's conservative size (steady, as a verification runs), its
   peak read as a verification reads it (:func:`vramcal.calibration.creep.read_peak`) against the moved fit's
   prediction there.

It prints the figures and writes them as JSON (``--out``). Each world's ranks run on this host's cores, so the
3-rank trial is slower, not larger, than on three cards.
"""

from __future__ import annotations

import argparse
import json
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


def main(argv: list[str] | None = None) -> int:
    from vramcal.calibration.creep import read_peak
    from vramcal.records import World
    from vramcal.sharding import at_world_size
    from vramcal.units import parse_bytes

    parser = argparse.ArgumentParser(prog="python -m bench.fsdp", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="states-heavy", choices=sorted(SPEC_CHOICES))
    parser.add_argument("--lm", default=None, help="an lm config file (configs/mamba2-lm-tiny.json) instead of --spec")
    parser.add_argument("--seq-len", type=int, default=32, help="the lm config's seq_len")
    parser.add_argument("--capacity", default="2GiB", help="each rank's budget")
    parser.add_argument("--to", type=int, default=3, help="the world size predicted from the 2-rank profile")
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
    sharded, _ = trial(ref, budget, World(2, strategy="fsdp"), size)
    replicated, _ = trial(ref, budget, World(2), size)
    whole, held = fsdp.model_info["model_state_bytes"], fsdp.model_info["rank_model_state_bytes"]
    saved, expected = replicated.peak_bytes - sharded.peak_bytes, whole - held
    print(f"at batch_size {size}: per-rank peak DDP {replicated.peak_bytes / MIB:.2f} MiB, FSDP "
          f"{sharded.peak_bytes / MIB:.2f} MiB: difference {saved / MIB:.2f} MiB; model states a DDP rank holds "
          f"more: {expected / MIB:.2f} MiB (whole {whole / MIB:.2f}, FSDP rank {held / MIB:.2f}): "
          f"{(saved - expected) / expected * 100:+.1f} %")

    moved = at_world_size(fsdp, args.to)
    at = moved.limits.conservative_batch_size
    predicted = moved.overhead_bytes + fsdp.fit.slope_bytes_per_sample * at
    steady, context = trial(ref, budget, World(args.to, strategy="fsdp"), at, steady=True)
    measured = read_peak(steady, fsdp.creep) if steady.ok else None
    error = None if measured is None else (measured - predicted) / predicted * 100
    print(f"{args.to} ranks from the 2-rank profile: safe {moved.limits.safe_batch_size}, conservative {at} (model "
          f"states {moved.shift_bytes / MIB:+.2f} MiB per rank); predicted peak at {at}: {predicted / MIB:.2f} MiB; "
          f"real {args.to}-rank trial: {steady.status}"
          + ("" if measured is None else f", peak {measured / MIB:.2f} MiB ({error:+.2f} %)"))

    result = {"model": ref.to_dict(), "capacity_bytes": budget,
              "fsdp": {"formula": fsdp.fit.formula(), "limits": fsdp.limits.to_dict(), "verified": fsdp.verified,
                       "model_info": fsdp.model_info},
              "ddp": {"formula": ddp.fit.formula(), "limits": ddp.limits.to_dict(), "verified": ddp.verified},
              "same_batch": {"batch_size": size, "ddp_peak_bytes": replicated.peak_bytes,
                             "fsdp_peak_bytes": sharded.peak_bytes, "difference_bytes": saved,
                             "sharded_bytes": expected, "error_pct": (saved - expected) / expected * 100},
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
