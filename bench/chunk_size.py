"""The SSD chunk_size against memory per sample and speed, measured by real trials (issue 45).

The chunked SSD scan (Dao and Gu 2024, "Transformers are SSMs", section 6) computes the same outputs for any chunk
length that divides the sequence; what changes is what a step holds and how long it takes: within a chunk it
holds (chunk x chunk) decay and score matrices per head, across chunks one (headdim x d_state) state per chunk
(mamba #928 measured 8,153 MB at chunk 256 against 13,929 MB at chunk 16 on one model, on the fused kernels).

``python -m bench.chunk_size`` runs, for each chunk_size, vramcal trials (each its own process, as a calibration's:
:class:`vramcal.measure.trial.TrialRunner`) of the same spec at two batch sizes, ``--repeats`` rounds with the
chunk sizes in a rotated order each round (the machine's load spreads over all of them), and reports per chunk_size:

* memory per sample: ``(peak(b2) - peak(b1)) / (b2 - b1)`` of the median peaks (bytes; the fit's slope over the
  two sizes; the host's peak is ``max(VmHWM - RssFile, VmData)``, a GPU's NVML's or the allocator's, as the trials
  measure);
* the peak at the larger size, and samples/s there (``b2 / step_s``, the median over the rounds of each trial's
  median measured step);
* each against the spec's own chunk_size as a ratio.

The same study is the GPU check's ``chunk_size`` step (scripts/gpu_check.py: :func:`study` on the lent GPU with
its default spec, the fused kernels where they import), where chunk_size matters most.

Writes ``chunk_size-<device>.md`` and ``.json`` under ``--out`` (the command included). Options: ``--gpu``
(``none``: the host under ``--capacity``), ``--spec default|small``, ``--chunk-sizes``, ``--batch-sizes B1,B2``,
``--repeats``, ``--impl``, ``--data`` (``synthetic``: random-walk bars).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vramcal.models.regressor.spec import RegressorSpec

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
SPECS = {"default": RegressorSpec(),
         "small": RegressorSpec(d_model=64, n_layers=2, d_state=16, headdim=16, chunk_size=32, seq_len=64)}


def chunk_sizes_for(spec: RegressorSpec) -> tuple[int, ...]:
    """The chunk sizes the spec accepts (powers of two dividing its seq_len, :class:`RegressorSpec`), from 16."""
    return tuple(c for c in (16, 32, 64, 128, 256) if c <= spec.seq_len and spec.seq_len % c == 0)


def study(run: Callable[[RegressorSpec, int], Any], spec: RegressorSpec, chunk_sizes: Sequence[int],
          batch_sizes: tuple[int, int], repeats: int = 1, echo: Callable[[str], None] = print,
          stop: Callable[[], bool] = lambda: False) -> list[dict]:
    """Each chunk_size's figures (module docstring), one row each in ``chunk_sizes`` order.

    Args:
        run: one trial of a spec at a batch size: a :class:`~vramcal.records.Trial` (the caller binds the runner,
            the device and the data: :func:`trial_runner`).
        spec: the model; its ``chunk_size`` is the reference of the ratios (it need not be among ``chunk_sizes``).
        batch_sizes: (b1, b2), b1 < b2.
        repeats: rounds; round r runs the chunk sizes rotated by r.
        stop: asked before each trial: True starts no more (the GPU check's time); the rows keep what ran.

    Raises:
        ValueError: no chunk sizes, or batch sizes not increasing (one line).
    """
    low, high = batch_sizes
    if not chunk_sizes or not 0 < low < high:
        raise ValueError(f"the study takes chunk sizes and two increasing batch sizes, got {list(chunk_sizes)} and "
                         f"{list(batch_sizes)}")
    trials: dict[int, dict[int, list]] = {c: {low: [], high: []} for c in chunk_sizes}
    for round_ in range(repeats):
        order = list(chunk_sizes[round_ % len(chunk_sizes):]) + list(chunk_sizes[:round_ % len(chunk_sizes)])
        for chunk in order:
            for batch_size in batch_sizes:
                if stop():
                    return [row(chunk, trials[chunk], low, high) for chunk in chunk_sizes]
                trial = run(dataclasses.replace(spec, chunk_size=chunk), batch_size)
                trials[chunk][batch_size].append(trial)
                echo(f"  chunk_size {chunk}, batch {batch_size}: {trial.status}" + (
                    f", peak {trial.peak_bytes / MIB:.1f} MiB, {trial.samples_per_s:.1f} samples/s"
                    if trial.status == "ok" else ""))
    return [row(chunk, trials[chunk], low, high) for chunk in chunk_sizes]


def row(chunk: int, trials: dict[int, list], low: int, high: int) -> dict:
    """One chunk_size's figures from its trials at ``low`` and ``high`` (None where a size never finished)."""
    done = {b: [t for t in trials[b] if t.status == "ok"] for b in (low, high)}
    peak = {b: statistics.median(t.peak_bytes for t in done[b]) if done[b] else None for b in (low, high)}
    step_s = statistics.median(t.step_s for t in done[high]) if done[high] else None
    per_sample = (peak[high] - peak[low]) / (high - low) if None not in peak.values() else None
    return {"chunk_size": chunk, "batch_sizes": [low, high], "bytes_per_sample": per_sample,
            "peak_bytes": peak[high], "samples_per_s": high / step_s if step_s else None, "step_s": step_s,
            "trials": {str(b): [{"status": t.status, "peak_bytes": t.peak_bytes, "step_s": t.step_s}
                                for t in trials[b]] for b in (low, high)}}


def table(rows: list[dict], reference: int) -> list[str]:
    """The Markdown table: each chunk_size's figures and their ratios to chunk_size ``reference``'s."""
    base = next((r for r in rows if r["chunk_size"] == reference), None)

    def ratio(r: dict, key: str) -> str:
        return "-" if base is None or r[key] is None or not base[key] else f"{r[key] / base[key]:.2f}"

    def mib(value: float | None) -> str:
        return "-" if value is None else f"{value / MIB:.2f}"

    high = rows[0]["batch_sizes"][1]
    lines = [f"| chunk_size | MiB/sample | peak MiB at {high} | samples/s at {high} | MiB/sample / {reference} "
             f"| samples/s / {reference} |", "|---|---|---|---|---|---|"]
    for r in rows:
        rate = "-" if r["samples_per_s"] is None else f"{r['samples_per_s']:.1f}"
        lines.append(f"| {r['chunk_size']} | {mib(r['bytes_per_sample'])} | {mib(r['peak_bytes'])} | {rate} | "
                     f"{ratio(r, 'bytes_per_sample')} | {ratio(r, 'samples_per_s')} |")
    return lines


def trial_runner(device: Any, implementation: str, data: str | None,
                 timeout_s: float | Callable[[], float] = 900.0) -> Callable[[RegressorSpec, int], Any]:
    """:func:`study`'s ``run``: vramcal's trials of a spec on ``device`` (``data`` None: synthetic bars), each
    killed after ``timeout_s`` seconds (a callable: asked before each trial)."""
    from vramcal.api import worker_pool
    from vramcal.measure.trial import TrialRequest, TrialRunner
    from vramcal.records import TrialSettings

    runner = TrialRunner(worker_pool())
    options = json.dumps({"data": str(Path(data).resolve()) if data else None}, sort_keys=True)

    def run(spec: RegressorSpec, batch_size: int) -> Any:
        request = TrialRequest(spec.ref(implementation), batch_size, device, options,
                               TrialSettings(measured_steps=3, timeout_s=timeout_s() if callable(timeout_s) else
                                             timeout_s))
        return runner.run(request, purpose="chunk_size")[0]

    return run


def main(argv: list[str] | None = None) -> int:
    from vramcal.api import select_devices
    from vramcal.units import parse_bytes

    parser = argparse.ArgumentParser(prog="python -m bench.chunk_size", description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="none", help="none (the host under --capacity) or a GPU as vramcal's --gpu")
    parser.add_argument("--capacity", default="2.5GiB", help="the host budget of every trial")
    parser.add_argument("--spec", choices=tuple(SPECS), default="default")
    parser.add_argument("--chunk-sizes", default=None, help="comma-separated (default: every one the spec accepts)")
    parser.add_argument("--batch-sizes", default="8,32", help="B1,B2: the two sizes of each chunk_size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--impl", default="transformers", choices=("transformers", "mamba_ssm"))
    parser.add_argument("--data", default="synthetic", help="a bars parquet, or synthetic")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "chunk_size")
    args = parser.parse_args(argv)
    spec = SPECS[args.spec]
    chunks = tuple(int(c) for c in args.chunk_sizes.split(",")) if args.chunk_sizes else chunk_sizes_for(spec)
    low, high = (int(b) for b in args.batch_sizes.split(","))
    (device,), _ = select_devices(args.gpu, parse_bytes(args.capacity) if args.gpu == "none" else None)
    run = trial_runner(device, args.impl, None if args.data == "synthetic" else args.data)
    rows = study(run, spec, chunks, (low, high), args.repeats)
    command = "python -m bench.chunk_size " + " ".join(argv if argv is not None else sys.argv[1:])
    created = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    lines = [f"# chunk_size: memory per sample and samples/s on {device.name}", "", f"- command: `{command}`",
             f"- spec: `{spec.short()}` [{args.impl}], chunk_size varied; trials at batch {low} and {high}, "
             f"{args.repeats} rounds, medians", f"- created (UTC): {created}", "", *table(rows, spec.chunk_size), ""]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"chunk_size-{args.spec}-{'host' if device.kind == 'host' else 'gpu'}"
    (args.out / f"{stem}.md").write_text("\n".join(lines))
    (args.out / f"{stem}.json").write_text(json.dumps({"command": command, "device": device.name, "rows": rows,
                                                       "spec": spec.to_dict()}, indent=2, sort_keys=True) + "\n")
    print(f"written: {args.out / stem}.md, .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
