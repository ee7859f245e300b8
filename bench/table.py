"""The results table (Markdown and CSV) from the results dict of :mod:`bench.compare`: pure, re-runnable."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

from vramcal.units import format_bytes

COLUMNS = ("tool", "trials", "wall_s", "batch_size", "error_pct", "survived", "survival_peak_rss")


def rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per tool answer; vramcal gives three (conservative, safe, and its predicted boundary)."""
    truth = results["ground_truth"]["batch_size"]
    steps = results["steps"]

    def survival(batch_size: int | None) -> tuple[str, str]:
        run = results["survival"].get(str(batch_size)) if batch_size else None
        if run is None:
            return "-", "-"
        verdict = "yes" if run.get("status") == "ok" else f"no ({run.get('status')} at step {run.get('steps_done')})"
        return verdict, format_bytes(run["rss_peak_bytes"]) if run.get("rss_peak_bytes") else "-"

    def error(batch_size: float | None) -> str:
        return f"{100 * (batch_size - truth) / truth:+.1f}" if batch_size else "-"

    out = [{"tool": "ground truth (bisection)", "trials": len(results["ground_truth"]["trials"]),
            "wall_s": f"{results['ground_truth']['wall_s']:.1f}", "batch_size": truth, "error_pct": "0.0",
            "survived": "-", "survival_peak_rss": "-"}]
    for name, tool in results["tools"].items():
        answer = tool.get("answer")
        base = {"trials": len(tool["trials"]), "wall_s": f"{tool['process_wall_s']:.1f}"}
        if name == "vramcal" and tool.get("limits"):
            limits = tool["limits"]
            for label, size in (("vramcal conservative", limits["conservative_batch_size"]),
                                ("vramcal safe", limits["safe_batch_size"])):
                survived, rss = survival(size)
                out.append({"tool": label, **base, "batch_size": size, "error_pct": error(size),
                            "survived": survived, "survival_peak_rss": rss})
            boundary = limits["boundary_batch_size"]
            out.append({"tool": "vramcal predicted boundary", **base, "batch_size": f"{boundary:.1f}",
                        "error_pct": error(boundary), "survived": "-", "survival_peak_rss": "-"})
            continue
        survived, rss = survival(answer)
        out.append({"tool": name if tool.get("returncode") == 0 else f"{name} (failed: rc {tool.get('returncode')})",
                    **base, "batch_size": answer if answer is not None else "-", "error_pct": error(answer),
                    "survived": survived, "survival_peak_rss": rss})
    for row in out:
        row["survived"] = row["survived"] if row["survived"] == "-" else row["survived"]
    return out


def ratios(results: dict[str, Any]) -> list[dict[str, str]]:
    """vramcal's process wall time and trial count divided by each anchor's (below 1: vramcal cheaper)."""
    tools = results["tools"]
    mine = tools.get("vramcal")
    if not mine:
        return []
    out = []
    for name, tool in tools.items():
        if name == "vramcal" or not tool.get("trials"):
            continue
        out.append({"anchor": name, "wall_ratio": f"{mine['process_wall_s'] / tool['process_wall_s']:.2f}",
                    "trials_ratio": f"{len(mine['trials']) / len(tool['trials']):.2f}"})
    return out


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    truth = results["ground_truth"]
    vram = results["tools"].get("vramcal", {})
    lines = [f"# vramcal vs batch-size finders: spec `{results['spec_name']}`, budget {env['budget']}", "",
             f"- model: `{json.dumps(results['spec'], sort_keys=True)}` (transformers Mamba-2, fp32, AdamW)",
             f"- machine: {env['machine']}, {env['cpus']} CPUs, {env['platform']}",
             f"- versions: {', '.join(f'{k} {v}' for k, v in env['versions'].items())}",
             f"- budget: {env['budget']} ({env['budget_bytes']} B), enforced as {env['limit']}",
             f"- limit check (alloc 1.05 x budget under the limit): binds={results['limit_check']['binds']}, "
             f"recognised by vramcal/Lightning/Accelerate={results['limit_check']['recognised_by_all']}",
             f"- ground truth: {truth['batch_size']} (first failing {truth['first_failing_batch_size']}; "
             f"{'cached from an earlier run' if truth.get('cached') else 'computed in this run'})",
             f"- survival run: {results['steps']} train steps in a fresh process under the same limit",
             f"- Accelerate starting_batch_size: {results['accelerate_start']}",
             f"- load average at start/end: {_load(env.get('load_average_start'))} / "
             f"{_load(env.get('load_average_end'))} (the machine is shared: wall times are noisy)",
             f"- created (UTC): {env['created_utc']}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for row in rows(results)]
    lines += ["", "Ratios of vramcal's wall time and trials to each anchor's (same run):", "",
              "| anchor | wall_ratio | trials_ratio |", "|---|---|---|"]
    lines += [f"| {r['anchor']} | {r['wall_ratio']} | {r['trials_ratio']} |" for r in ratios(results)]
    if vram.get("limits"):
        limits = vram["limits"]
        lines += ["", f"vramcal: usable {format_bytes(limits['usable_bytes'])} of {env['budget']} "
                  f"(reserve 0.5 GiB + margin 10 %); safe {limits['safe_batch_size']} and conservative "
                  f"{limits['conservative_batch_size']} sit {truth['batch_size'] - limits['safe_batch_size']} and "
                  f"{truth['batch_size'] - limits['conservative_batch_size']} below the ground truth by design."]
    lines += ["", "Trials per tool (batch size:status):", ""]
    for name, tool in [("ground truth", truth)] + list(results["tools"].items()):
        lines.append(f"- {name}: " + ", ".join(f"{t['batch_size']}:{t['status']}" for t in tool["trials"]))
    if results.get("note"):
        lines += ["", "## Note", "", results["note"]]
    return "\n".join(lines) + "\n"


def _load(value) -> str:
    return "-" if not value else "/".join(f"{v:.1f}" for v in value)


def write_tables(results: dict[str, Any], md_path: Path, csv_path: Path) -> None:
    md_path.write_text(markdown(results))
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows(results))


if __name__ == "__main__":  # re-render: python -m bench.table bench/results/small-1_5GiB.json
    path = Path(sys.argv[1])
    data = json.loads(path.read_text())
    write_tables(data, path.with_suffix(".md"), path.with_suffix(".csv"))
