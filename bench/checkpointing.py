"""Memory for speed, measured: the default spec with and without activation checkpointing, and at a smaller chunk.

``python -m bench.checkpointing`` calibrates three variants of the default spec (``RegressorSpec()``: d_model 128,
4 layers, d_state 32, headdim 32, seq_len 128, chunk_size 64) on the host under one ``--capacity`` budget, each as
``vramcal probe --gpu none --capacity ...`` does and each verified by its real trials
(``vramcal.api.plan_calibration`` then ``api.run_calibration``, transformers' PyTorch path):

* ``off``: no checkpointing, the default;
* ``block``: every Mamba-2 block recomputed in the backward pass (``--checkpointing block``);
* ``chunk 32``: chunk_size 32, no checkpointing (the SSD scan's other memory knob, for comparison).

It prints, per variant: the safe and conservative batch sizes, the fitted slope (memory per sample), samples/s at
the conservative size (the profile's own throughput facts: :func:`vramcal.calibration.throughput.rate_for_run`
over its trials, the steady trial's rate there) with its 95 % interval, and each against ``off`` as a ratio. The
table and the figures go to ``--out`` (``checkpointing-<capacity>.md`` and ``.json``, the command included), the
profiles to ``--out``/profiles. A run takes about ten minutes on two cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

from vramcal.models.regressor.spec import RegressorSpec

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
VARIANTS = {"off": RegressorSpec(), "block": RegressorSpec(checkpointing="block"),
            "chunk 32": RegressorSpec(chunk_size=32)}


def calibrate(spec: RegressorSpec, budget: int, options: dict, out: Path):
    """One verified calibration of ``spec`` on the host under ``budget`` bytes (the probe's defaults)."""
    from vramcal import api
    from vramcal.measure.device import host_device

    plan = api.plan_calibration(spec.ref("transformers"), device=host_device(capacity_bytes=budget),
                                options=options, profiles_dir=out)
    return api.run_calibration(plan)


def figures(profile) -> dict:
    """What the table shows of one profile: limits, slope, and the measured rate at the conservative size."""
    from vramcal.calibration.throughput import measured_rates, rate_for_run

    conservative = profile.limits.conservative_batch_size
    rate = rate_for_run(measured_rates(profile.trials), conservative)
    return {"safe": profile.limits.safe_batch_size, "conservative": conservative,
            "slope_bytes_per_sample": profile.fit.slope_bytes_per_sample,
            "overhead_bytes": profile.fit.overhead_bytes, "verified": profile.verified,
            "samples_per_s": rate.samples_per_s if rate else None,
            "samples_per_s_interval": list(rate.interval) if rate else None,
            "rate_steady": rate.steady if rate else None, "trials": len(profile.trials),
            "model": profile.model.to_dict()}


def versions(software: dict) -> str:
    """The software a profile records that moves its figures: ``python 3.11.7, torch 2.13.0+cpu, ...``."""
    names = ("python", "torch", "transformers")
    return ", ".join(f"{name} {software[name]}" for name in names if software.get(name))


def table(rows: dict[str, dict]) -> list[str]:
    """The Markdown table: each variant's figures and their ratios to ``off``."""
    base = rows["off"]

    def ratio(name: str, key: str) -> str:
        value, reference = rows[name][key], base[key]
        return "-" if value is None or not reference else f"{value / reference:.2f}"

    def rate(row: dict) -> str:
        if row["samples_per_s"] is None:
            return "-"
        low, high = row["samples_per_s_interval"]
        span = f" ({low:.1f}-{high:.1f})" if low is not None and high is not None else ""
        return f"{row['samples_per_s']:.1f}{span}"

    lines = ["| variant | verified | safe | conservative | slope MiB/sample | samples/s at conservative (95 %) "
             "| conservative / off | slope / off | samples/s / off |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {'yes' if row['verified'] else 'no'} | {row['safe']} | {row['conservative']} | "
                     f"{row['slope_bytes_per_sample'] / MIB:.2f} | {rate(row)} | {ratio(name, 'conservative')} | "
                     f"{ratio(name, 'slope_bytes_per_sample')} | {ratio(name, 'samples_per_s')} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from vramcal.units import format_bytes, parse_bytes

    parser = argparse.ArgumentParser(prog="python -m bench.checkpointing", description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", default="2.5GiB", help="the host budget of every calibration")
    parser.add_argument("--data", default=str(REPO / "data" / "es_1s.parquet"),
                        help="the bars the trials hold (the probe's default); 'synthetic' for synthetic bars")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {', '.join(VARIANTS)}")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "checkpointing")
    args = parser.parse_args(argv)
    budget, names = parse_bytes(args.capacity), [n.strip() for n in args.variants.split(",")]
    if "off" not in names or not set(names) <= VARIANTS.keys():
        parser.error(f"--variants takes off and any of {', '.join(VARIANTS)}")
    options = {"data": None if args.data == "synthetic" else args.data}
    args.out.mkdir(parents=True, exist_ok=True)

    rows = {}
    for name in names:
        load = os.getloadavg()[0]
        profile = calibrate(VARIANTS[name], budget, options, args.out / "profiles")
        rows[name] = {**figures(profile), "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)]}
        device, environment = profile.device.name, versions(profile.software)
        print(f"{name}: {profile.fit.formula()}, safe {profile.limits.safe_batch_size}, conservative "
              f"{profile.limits.conservative_batch_size}, verified {profile.verified}", flush=True)
    created = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    command = "python -m bench.checkpointing " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# Activation checkpointing on the host: the default spec at {format_bytes(budget)}", "",
             f"- command: `{command}`",
             *(f"- {name}: `{VARIANTS[name].short()}` [transformers]" for name in names),
             f"- data: {options['data'] or 'synthetic bars'}; machine: {device} ({environment})",
             f"- created (UTC): {created}; 1-minute load average at each calibration's start and end (the machine is "
             f"shared: rates are noisy): " + ", ".join(f"{n} {r['load_1min'][0]}/{r['load_1min'][1]}"
                                                      for n, r in rows.items()), "", *table(rows), ""]
    print("\n".join(lines))
    stem = f"checkpointing-{args.capacity.replace('.', '_')}"
    (args.out / f"{stem}.md").write_text("\n".join(lines))
    (args.out / f"{stem}.json").write_text(json.dumps({"command": command, "capacity_bytes": budget,
                                                       "variants": rows}, indent=2, sort_keys=True) + "\n")
    print(f"written: {args.out / stem}.md, .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
