"""Both kernel paths of a card's estimate, side by side (issue 57): bytes per sample and their ratio.

``python -m bench.kernel_paths`` traces, as an H100 runs them (:func:`vramcal.estimate.cache.cached_trace`, kept on
disk like any estimate's), the GPU check's default and large specs (``scripts/gpu_check.py``'s ``SPECS``: bf16
autocast) and the ``lm`` family's 130m config (``configs/mamba2-130m.json``, bf16 autocast, seq_len 2048) on
transformers' PyTorch chunked scan and on mamba_ssm's fused kernels (their twins: :mod:`vramcal.estimate.fused`;
``make setup-dev`` installs them in ``.venv/fused-kernels``, put on ``PYTHONPATH`` for this), and prints the caching
allocator's reserved bytes per sample and the step's own overhead of each, the ratio of the two slopes and each
trace's wall time (seconds, this machine; cold unless the trace was kept).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from vramcal.models import lm
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.workload import ModelRef

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


def refs() -> dict[str, tuple[ModelRef, dict]]:
    """The three models by name, each as ``(ref without an implementation, factory options)``."""
    large = RegressorSpec(d_model=768, n_layers=24, d_state=128, headdim=64, chunk_size=256, seq_len=1024,
                          dtype="bf16-autocast")
    config = lm.read_config(REPO / "configs" / "mamba2-130m.json")
    return {"default": (RegressorSpec(dtype="bf16-autocast").ref("transformers"), {"data": None}),
            "large": (large.ref("transformers"), {"data": None}),
            "lm 130m": (ModelRef.make(lm.FACTORY, {"config": config, "dtype": "bf16-autocast", "seq_len": 2048,
                                                   "implementation": "transformers"}), {})}


def main(argv: list[str] | None = None) -> int:
    from vramcal.estimate.cache import cached_trace
    from vramcal.estimate.card import Card

    names = argv if argv else list(refs())
    print("| model | path | MiB/sample | overhead MiB | trace s | transformers / mamba_ssm |")
    print("|---|---|---:|---:|---:|---:|")
    for name in names:
        ref, options = refs()[name]
        slopes = {}
        for path in ("transformers", "mamba_ssm"):
            started = time.perf_counter()
            trace = cached_trace(ref.replace(implementation=path), options, "cuda", Card())
            slopes[path] = trace.slope_bytes_per_sample
            ratio = f"{slopes['transformers'] / slopes[path]:.2f}x" if path == "mamba_ssm" else ""
            print(f"| {name} | {path} | {trace.slope_bytes_per_sample / MIB:,.2f} | "
                  f"{trace.overhead_bytes / MIB:,.0f} | {time.perf_counter() - started:.0f} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
