"""vramcal against Lightning's BatchSizeFinder and Accelerate's find_executable_batch_size, one budget.

``python -m bench.compare --spec small --budget 1.5GiB`` runs, for one ModelSpec and memory budget:

1. the ground truth: the largest batch size whose real trial (1 warm-up + 2 measured steps, vramcal's
   :class:`~vramcal.measure.trial.TrialRunner`) finishes under the budget, by doubling then bisection; cached
   in the results JSON and reused unless ``--refresh-truth``;
2. each tool (``vramcal``, ``lightning-binsearch``, ``lightning-power``, ``accelerate``) in a fresh
   Python process (:mod:`bench.child`), timed from process launch to exit;
3. for each batch size a tool returned, ``--steps`` (50) real training steps in a fresh process.

The budget on the host is ``RLIMIT_DATA = budget`` on every process, set in the child between ``fork``
and ``exec`` (``preexec_fn``), so it covers the whole process from interpreter start: an allocation that
would take the process's data segment past the budget fails with torch's CPU allocator error
(``DefaultCPUAllocator: can't allocate memory``), which vramcal, Lightning's ``is_oom_error`` and
Accelerate's ``should_reduce_batch_size`` all recognise. vramcal calibrates against the same figure
(``--capacity`` = budget). Results go to ``bench/results/<spec>-<budget>.{json,md,csv}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vramcal.models.regressor import ModelSpec
from vramcal.units import format_bytes, parse_bytes

SPECS = {
    "small": ModelSpec(d_model=64, n_layers=2, d_state=16, headdim=16, seq_len=64, chunk_size=32),
    "default": ModelSpec(),
}
ANCHORS = ("lightning-binsearch", "lightning-power", "accelerate")
TOOLS = ("vramcal",) + ANCHORS
RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def _limit(budget_bytes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (budget_bytes, budget_bytes))
    return apply


def run_child(tool: str, request: dict, budget_bytes: int, timeout_s: float = 1800.0) -> dict[str, Any]:
    """Run ``bench.child TOOL`` in a fresh process under ``RLIMIT_DATA = budget_bytes``; its result dict
    plus ``process_wall_s`` (launch to exit), ``returncode`` and the stderr tail."""
    with tempfile.TemporaryDirectory() as folder:
        request_path, result_path = Path(folder, "request.json"), Path(folder, "result.json")
        launched = time.time()
        request_path.write_text(json.dumps({**request, "launched_at": launched}))
        process = subprocess.run([sys.executable, "-m", "bench.child", tool, str(request_path), str(result_path)],
                                 cwd=REPO, preexec_fn=_limit(budget_bytes), capture_output=True, text=True,
                                 timeout=timeout_s)
        wall = time.time() - launched
        result = json.loads(result_path.read_text()) if result_path.exists() else {"answer": None, "trials": []}
    result.update(process_wall_s=wall, returncode=process.returncode,
                  stderr_tail=process.stderr[-1500:] if process.returncode else None)
    return result


def ground_truth(spec: ModelSpec, budget_bytes: int) -> dict[str, Any]:
    """Largest batch size whose real trial finishes under ``RLIMIT_DATA = budget_bytes``: double from 1
    until a trial fails, then bisect until the fitting and failing sizes are adjacent."""
    from vramcal.measure.device import host_device
    from vramcal.measure.trial import TrialRequest, TrialRunner

    runner, device = TrialRunner(timeout_s=1800), host_device(capacity_bytes=budget_bytes)
    trials: list[dict] = []
    started = time.time()

    def fits(batch_size: int) -> bool:
        request = TrialRequest(spec=spec, implementation="transformers", batch_size=batch_size, device=device,
                               host_memory_limit_bytes=budget_bytes)
        trial = runner.run(request, purpose="truth")
        trials.append({"batch_size": batch_size, "status": trial.status, "peak_bytes": trial.peak_bytes,
                       "wall_s": trial.wall_s, "error": (trial.error or "")[-300:] or None})
        print(f"  truth trial {batch_size}: {trial.status}", flush=True)
        if trial.status not in ("ok", "oom"):
            # A crash or a hang at this size is a failure at this size (the search goes on below it), but it
            # is not an out-of-memory error: the results file lists it apart, never counted as an oom.
            print(f"  truth trial {batch_size} ended with {trial.status} (not oom): {trial.error}", flush=True)
        return trial.status == "ok"

    low, high = 0, 1
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return {"batch_size": low, "first_failing_batch_size": high, "trials": trials,
            "non_oom_failures": [t for t in trials if t["status"] not in ("ok", "oom")],
            "vramcal_commit": vramcal_commit(), "wall_s": time.time() - started}


def vramcal_commit() -> str | None:
    """The checked-out commit of this repository (``+dirty`` when vramcal/ has uncommitted changes)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "vramcal"], cwd=REPO, capture_output=True,
                               text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def check_limit_binds(budget_bytes: int) -> dict[str, Any]:
    """Allocate 1.05 x budget in a fresh process under the limit: it must fail with the CPU allocator's
    error that all three tools recognise (else the budget is not enforced the way this benchmark says)."""
    code = ("import torch\nfrom accelerate.utils.memory import should_reduce_batch_size as a\n"
            "from lightning.pytorch.utilities.memory import is_oom_error as l\n"
            "from vramcal.meters import is_out_of_memory as v\n"
            f"try:\n    torch.ones({int(budget_bytes * 1.05)}, dtype=torch.uint8)\n    print('ALLOCATED')\n"
            "except Exception as e:\n"
            "    print(repr(str(e)[:160]), 'vramcal', v(e), 'lightning', l(e), 'accelerate', a(e))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, preexec_fn=_limit(budget_bytes),
                         capture_output=True, text=True).stdout.strip()
    return {"binds": "ALLOCATED" not in out and "can't allocate memory" in out,
            "recognised_by_all": out.endswith("vramcal True lightning True accelerate True"), "output": out}


def environment(budget_bytes: int) -> dict[str, Any]:
    import importlib.metadata

    from vramcal.measure.device import host_device

    versions = {"python": platform.python_version()}
    for package in ("vramcal", "torch", "transformers", "lightning", "accelerate"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"machine": host_device().name, "cpus": os.cpu_count(), "platform": platform.platform(),
            "versions": versions, "budget_bytes": budget_bytes, "budget": format_bytes(budget_bytes),
            "limit": "RLIMIT_DATA = budget on each tool's whole process (preexec_fn, before exec)",
            "load_average_start": os.getloadavg(), "vramcal_commit": vramcal_commit(),
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", choices=sorted(SPECS), default="small")
    parser.add_argument("--budget", default="1.5GiB", help="memory budget, e.g. 1.5GiB")
    parser.add_argument("--steps", type=int, default=50, help="steps of the survival run (50 for results)")
    parser.add_argument("--accelerate-start", type=int, default=1024,
                        help="starting_batch_size of find_executable_batch_size")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of " + ",".join(TOOLS))
    parser.add_argument("--refresh-truth", action="store_true", help="recompute the cached ground truth")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-mkldnn", action="store_true",
                        help="turn oneDNN off in the anchors' and survival processes (see README)")
    args = parser.parse_args(argv)

    from bench.table import write_tables  # noqa: PLC0415 - after argument errors

    spec, budget = SPECS[args.spec], parse_bytes(args.budget)
    stem = f"{args.spec}-{args.budget.replace('.', '_')}"
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{stem}.json"
    old = json.loads(json_path.read_text()) if json_path.exists() else {}
    truth_key = {"spec": spec.to_dict(), "budget_bytes": budget}
    results: dict[str, Any] = {"spec_name": args.spec, "spec": spec.to_dict(), "environment": environment(budget),
                               "steps": args.steps, "accelerate_start": args.accelerate_start}
    results["limit_check"] = check_limit_binds(budget)
    print("limit check:", results["limit_check"], flush=True)
    cached = old.get("ground_truth")
    if cached and not args.refresh_truth and cached.get("key") == truth_key:
        results["ground_truth"] = {**cached, "cached": True}
    else:
        print("ground truth ...", flush=True)
        results["ground_truth"] = {**ground_truth(spec, budget), "key": truth_key, "cached": False}
    print("ground truth:", results["ground_truth"]["batch_size"], flush=True)
    json_path.write_text(json.dumps({**old, "ground_truth": results["ground_truth"]}, indent=1, sort_keys=True))

    request = {"spec": spec.to_dict(), "budget_bytes": budget, "start": args.accelerate_start,
               "mkldnn": not args.no_mkldnn}
    results["adaptations"] = ("torch.backends.mkldnn.enabled = False in the anchors' and survival processes "
                              "(see bench/README.md)") if args.no_mkldnn else None
    results["tools"] = {}
    for tool in args.tools.split(","):
        print(f"{tool} ...", flush=True)
        results["tools"][tool] = run_child(tool, request, budget)
        print(f"  {tool}: answer {results['tools'][tool]['answer']} in "
              f"{results['tools'][tool]['process_wall_s']:.1f} s", flush=True)
        json_path.write_text(json.dumps(results, indent=1, sort_keys=True))  # progress survives a crash

    results["survival"] = {}
    for batch_size in sorted(_answers(results), reverse=True):
        print(f"survival run at {batch_size} ...", flush=True)
        survive = run_child("survive", {"spec": spec.to_dict(), "batch_size": batch_size, "steps": args.steps,
                                        "mkldnn": not args.no_mkldnn}, budget)
        results["survival"][str(batch_size)] = survive
        print(f"  {batch_size}: {survive.get('status')} after {survive.get('steps_done')} steps", flush=True)
    results["environment"]["load_average_end"] = os.getloadavg()
    json_path.write_text(json.dumps(results, indent=1, sort_keys=True))
    write_tables(results, args.out / f"{stem}.md", args.out / f"{stem}.csv")
    print((args.out / f"{stem}.md").read_text())
    return 0


def _answers(results: dict) -> set[int]:
    """Every batch size a tool returned (vramcal: conservative and safe) that needs a survival run."""
    sizes = set()
    for name, tool in results["tools"].items():
        if tool.get("answer"):
            sizes.add(int(tool["answer"]))
        if name == "vramcal" and tool.get("limits"):
            sizes.add(int(tool["limits"]["safe_batch_size"]))
    return sizes


if __name__ == "__main__":
    sys.exit(main())
