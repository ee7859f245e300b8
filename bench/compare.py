"""vramcal against Lightning's BatchSizeFinder and Accelerate's find_executable_batch_size, one budget.

``python -m bench.compare --spec small`` runs, for each RegressorSpec named and its memory budget:

1. the ground truth (:mod:`bench.truth`): the largest batch size whose vramcal trial — the trainer's own
   program — finishes under the budget, by bisection; cached in the results JSON;
2. ``--rounds`` interleaved rounds of the tools (``vramcal``, ``vramcal-anchor-margin``,
   ``lightning-binsearch``, ``lightning-power``, ``accelerate``), each round in a shuffled but seeded
   order, each tool in a fresh Python process (:mod:`bench.child`) timed from launch to exit;
3. survival (:mod:`bench.survive`): every batch size a tool returned in any round (and each vramcal
   tool's safe size) trained by ``vramcal train``'s runner for ``--steps`` optimizer steps under the
   budget, its measured peak beside each vramcal profile's prediction.

The budget on the host is ``RLIMIT_DATA = budget`` on every tool's process, set between ``fork`` and
``exec`` (``preexec_fn``), so it covers the whole process from interpreter start; vramcal's trials and
the trainer's process set the same limit on themselves. Results go to
``bench/results/<spec>-<budget>.{json,md,csv}`` (``--quick``: ``bench/results/quick/``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.specs import QUICK_BUDGET, SPECS
from bench.table import SCHEMA, SURVIVE, TOOLS, survival_sizes, write_tables
from bench.truth import TruthError, cached, ground_truth, truth_key, vramcal_commit
from vramcal.units import format_bytes, parse_bytes

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
DATA = "data/es_1s.parquet"
QUICK = {"spec": "small", "budget": QUICK_BUDGET, "steps": 10, "rounds": 1, "accelerate_start": 256}


def _limit(budget_bytes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (budget_bytes, budget_bytes))
    return apply


def child_environment() -> dict[str, str]:
    """The environment of every tool's process: this one's, plus the allocator settings vramcal's workers
    run with (:class:`vramcal.measure.worker.Workers`: glibc malloc tunables, pyarrow's system pool),
    so the anchors search in the process make-up that the trainer, which trains their answers, runs in."""
    from vramcal.environment import HOST_MALLOC

    env = dict(os.environ)
    env.setdefault("GLIBC_TUNABLES", HOST_MALLOC)
    env.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    return env


def run_child(tool: str, request: dict, budget_bytes: int, timeout_s: float) -> dict[str, Any]:
    """Run ``bench.child TOOL`` in a fresh process under ``RLIMIT_DATA = budget_bytes``; its result dict
    plus ``process_wall_s`` (launch to exit), ``returncode`` and the stderr tail of a failed process."""
    with tempfile.TemporaryDirectory() as folder:
        request_path, result_path = Path(folder, "request.json"), Path(folder, "result.json")
        launched = time.time()
        request_path.write_text(json.dumps({**request, "launched_at": launched}))
        try:
            process = subprocess.run([sys.executable, "-m", "bench.child", tool, str(request_path), str(result_path)],
                                     cwd=REPO, preexec_fn=_limit(budget_bytes), capture_output=True, text=True,
                                     timeout=timeout_s, env=child_environment())
            returncode, stderr = process.returncode, process.stderr
        except subprocess.TimeoutExpired as expired:
            returncode, stderr = "timeout", str(expired.stderr or "")
        wall = time.time() - launched
        result = json.loads(result_path.read_text()) if result_path.exists() else {"answer": None, "trials": []}
    result.update(process_wall_s=wall, returncode=returncode, stderr_tail=stderr[-1500:] if returncode else None)
    return result


def train_windows(data: str, seq_len: int, stride: int) -> int:
    """How many training windows the trainer cuts from ``data`` (default validation fraction)."""
    from vramcal.models.regressor.bars import load_bars
    from vramcal.models.regressor.windows import make_windows

    return len(make_windows(load_bars(data), seq_len, stride, source=data).train_starts)


def round_orders(tools: list[str], rounds: int, seed: int) -> list[list[str]]:
    """The order of the tools in each round: a shuffle seeded by (seed, round), so a rerun repeats it."""
    orders = []
    for number in range(1, rounds + 1):
        order = list(tools)
        random.Random(seed * 1000 + number).shuffle(order)
        orders.append(order)
    return orders


def check_limit_binds(budget_bytes: int) -> dict[str, Any]:
    """Allocate 1.05 x budget in a fresh process under the limit: it must fail with the CPU allocator's
    error that all three tools recognise (else the budget is not enforced the way this benchmark says)."""
    code = ("import torch\nfrom accelerate.utils.memory import should_reduce_batch_size as a\n"
            "from lightning.pytorch.utilities.memory import is_oom_error as l\n"
            "from vramcal.oom import is_out_of_memory as v\n"
            f"try:\n    torch.ones({int(budget_bytes * 1.05)}, dtype=torch.uint8)\n    print('ALLOCATED')\n"
            "except Exception as e:\n"
            "    print(repr(str(e)[:160]), 'vramcal', v(e), 'lightning', l(e), 'accelerate', a(e))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, preexec_fn=_limit(budget_bytes),
                          capture_output=True, text=True, env=child_environment())
    out = done.stdout.strip() or done.stderr.strip()[-300:]
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
            "limit": "RLIMIT_DATA = budget on each tool's whole process (preexec_fn, before exec), on vramcal's "
                     "trial and training processes (set by their meter)",
            "load_average_start": os.getloadavg(), "vramcal_commit": vramcal_commit(),
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="small", help="comma-separated spec names: " + ", ".join(SPECS))
    parser.add_argument("--budget", default=None, help="memory budget, e.g. 1.5GiB (default: the spec's)")
    parser.add_argument("--steps", type=int, default=1000,
                        help="optimizer steps of each survival run (1,000 for results)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the tools")
    parser.add_argument("--seed", type=int, default=0, help="seeds the order of the tools in each round")
    parser.add_argument("--accelerate-start", type=int, default=1024,
                        help="starting_batch_size of find_executable_batch_size")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of " + ",".join(TOOLS))
    parser.add_argument("--data", default=DATA, help="the OHLCV bars every tool trains on")
    parser.add_argument("--stride", type=int, default=1, help="bars between windows (1: ~27k E-mini windows)")
    parser.add_argument("--refresh-truth", action="store_true", help="recompute the cached ground truth")
    parser.add_argument("--no-survival", action="store_true", help="skip the survival runs")
    parser.add_argument("--survive", choices=SURVIVE, default="all",
                        help="train every answer and safe size (all), or only vramcal's safe or conservative sizes")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before a tool's process is killed")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    parser.add_argument("--no-mkldnn", action="store_true",
                        help="turn oneDNN off in the anchors' processes (see bench/README.md)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: small spec at {QUICK_BUDGET}, 10 steps, 1 round, Accelerate from 256, "
                             f"to bench/results/quick")
    args = parser.parse_args(argv)
    if args.quick:
        given = set(argv or sys.argv[1:])
        for name, value in QUICK.items():
            if f"--{name.replace('_', '-')}" not in given:
                setattr(args, name, value)
        args.out = args.out or RESULTS / "quick"
    args.out = args.out or RESULTS
    unknown = [s for s in args.spec.split(",") if s not in SPECS]
    bad_tools = [t for t in args.tools.split(",") if t not in TOOLS]
    if unknown or bad_tools:
        parser.error(f"unknown spec(s) {unknown} (known: {', '.join(SPECS)})" if unknown
                     else f"unknown tool(s) {bad_tools} (known: {', '.join(TOOLS)})")
    if not Path(args.data).is_file():
        parser.error(f"no {args.data}: build it with `.venv/bin/python -m vramcal data es-sample`")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM ends the run like Ctrl-C: subprocess.run and vramcal's workers kill their process first
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for name in args.spec.split(","):
            run_spec(args, name)
    except KeyboardInterrupt:
        print("interrupted: the results JSON keeps what finished", file=sys.stderr)
        return 130
    except TruthError as error:
        print(f"no ground truth: {error}", file=sys.stderr)
        return 1
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_spec(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Truth, rounds of tools, survival runs and tables for one spec (module docstring)."""
    from vramcal import api
    from vramcal.measure.trial import TrialRunner

    bench_spec = SPECS[name]
    budget_text = args.budget or bench_spec.budget
    spec, budget = bench_spec.spec.to_dict(), parse_bytes(budget_text)
    data = str(Path(args.data).resolve())
    stem = f"{name}-{budget_text.replace('.', '_')}"
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{stem}.json"
    old = json.loads(json_path.read_text()) if json_path.exists() else {}
    env = environment(budget)
    print(f"== {name} at {format_bytes(budget)} ({env['vramcal_commit']})", flush=True)
    results: dict[str, Any] = {
        "bench_schema": SCHEMA, "spec_name": name, "spec": spec, "environment": env, "steps": args.steps,
        "survive": args.survive,
        "rounds": args.rounds, "seed": args.seed, "accelerate_start": args.accelerate_start, "quick": args.quick,
        "data": {"path": args.data, "stride": args.stride,
                 "train_windows": train_windows(data, bench_spec.spec.seq_len, args.stride)},
        "runs": {}, "survival": [],
        "notes": old.get("notes", []) if old.get("bench_schema") == SCHEMA else [],
        "adaptations": ["every tool's process runs with vramcal's worker allocator settings (GLIBC_TUNABLES="
                        "malloc tunables, ARROW_DEFAULT_MEMORY_POOL=system), the make-up of the trainer that trains "
                        "the answers"]}
    if args.no_mkldnn:
        results["adaptations"].append("torch.backends.mkldnn.enabled = False in the anchors' processes "
                                      "(see bench/README.md)")
    results["limit_check"] = check_limit_binds(budget)
    print("limit check:", results["limit_check"], flush=True)

    workers = api.worker_pool()
    key = truth_key(spec, budget, {"data": args.data, "stride": args.stride}, env["vramcal_commit"],
                    env["versions"]["torch"])
    truth = None if args.refresh_truth else cached(old, key)
    if truth is not None:
        results["ground_truth"] = {**truth, "cached": True}
    else:
        print("ground truth ...", flush=True)
        found = ground_truth(spec, budget, data, args.stride, runner=TrialRunner(workers), timeout_s=args.timeout)
        results["ground_truth"] = {**found, "key": key, "cached": False}
    print(f"ground truth: {results['ground_truth']['batch_size']}", flush=True)
    _write(json_path, {**old, "ground_truth": results["ground_truth"]})

    with tempfile.TemporaryDirectory(prefix="vramcal-bench-") as work:
        request = {"spec": spec, "budget_bytes": budget, "start": args.accelerate_start, "data": data,
                   "stride": args.stride, "mkldnn": not args.no_mkldnn}
        results["orders"] = round_orders(args.tools.split(","), args.rounds, args.seed)
        for number, order in enumerate(results["orders"], start=1):
            for position, tool in enumerate(order):
                print(f"round {number}: {tool} ...", flush=True)
                run = run_child(tool, {**request, "profile_out": str(Path(work) / f"{tool}-r{number}.json")}, budget,
                                args.timeout)
                run.update(round=number, position=position)
                if tool.startswith("vramcal"):
                    run["profile_label"] = f"{tool}/r{number}"
                results["runs"].setdefault(tool, []).append(run)
                print(f"  {tool}: answer {run.get('answer')} in {run['process_wall_s']:.1f} s, "
                      f"{len(run.get('trials') or [])} trials" + (f" (rc {run['returncode']}: "
                      f"{(run['stderr_tail'] or '').strip().splitlines()[-1:]})" if run["returncode"] else ""),
                      flush=True)
                _write(json_path, results)  # progress survives a crash
        if not args.no_survival:
            results["survival"] = survival_runs(results, spec, budget, data, args.stride, args.steps, workers,
                                                kinds=args.survive,
                                                save=lambda: _write(json_path, results))
    results["environment"]["load_average_end"] = os.getloadavg()
    _write(json_path, results)
    write_tables(results, args.out / f"{stem}.md", args.out / f"{stem}.csv")
    print((args.out / f"{stem}.md").read_text(), flush=True)
    return results


def survival_runs(results: dict[str, Any], spec: dict[str, Any], budget: int, data: str, stride: int, steps: int,
                  workers: Any, save: Any = None, kinds: str = "all") -> list[dict[str, Any]]:
    """Train every answer (largest first; ``kinds``: ``--survive``, :func:`bench.table.survival_sizes`) with
    vramcal's runner; each run's peak beside every vramcal profile's prediction at that size (``predictions``,
    keyed ``<tool>/r<round>``)."""
    from bench.survive import sizing_at, survive
    from vramcal.profile import load_profile

    profiles = {run["profile_label"]: run["profile_path"] for tool, runs in results["runs"].items()
                for run in runs
                if run.get("profile_path") and (run.get("limits") or {}).get("safe_batch_size", 0) >= 1}
    if not profiles:
        print("no vramcal profile with limits to plan the survival runs with: skipped", flush=True)
        return []
    loaded = {label: load_profile(path) for label, path in profiles.items()}
    out = []
    for batch_size, sources in sorted(survival_sizes(results, kinds).items(), reverse=True):
        label = next((s.split()[0] + "/" + s.split()[-1] for s in sources if s.startswith("vramcal")),
                     "vramcal/r1" if "vramcal/r1" in profiles else next(iter(profiles)))
        print(f"survival at {batch_size} ({', '.join(sources)}; planned with {label}) ...", flush=True)
        try:
            run = survive(spec, budget, batch_size, profiles[label], data=data, stride=stride, steps=steps,
                          workers=workers)
        except (ValueError, OSError) as error:  # vramcal's one-line errors (planning, data, run folder)
            print(f"  {batch_size}: could not plan the run: {error}", flush=True)
            out.append({"batch_size": batch_size, "status": "error", "steps": steps, "steps_done": 0,
                        "peak_bytes": None, "failure": str(error), "sources": sources, "profile_label": label})
            continue
        pool = loaded[label].pool_data_bytes + run["data_delta_bytes"]
        run.update(sources=sources, profile_label=label,
                   predictions={key: {"predicted_peak_bytes": s.predicted_peak_bytes, "upper_bytes": s.upper_bytes,
                                      "usable_bytes": s.usable_bytes}
                                for key, profile in loaded.items()
                                for s in [sizing_at(profile, batch_size, pool)]})
        print(f"  {batch_size}: {run['status']} after {run['steps_done']} steps, peak "
              f"{format_bytes(run['peak_bytes']) if run['peak_bytes'] else '-'} (predicted "
              f"{format_bytes(run['predicted_peak_bytes'])}, upper {format_bytes(run['upper_bytes'])}), "
              f"{run['wall_s']:.0f} s", flush=True)
        out.append(run)
        results["survival"] = out
        if save is not None:
            save()
    return out


def _write(path: Path, results: dict[str, Any]) -> None:
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(main())
