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
    for name, tool in _ordered(results["tools"]):
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
    for name, tool in _ordered(tools):
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
             f"{'cached from an earlier run' if truth.get('cached') else 'computed in this run'}, "
             f"trials by vramcal commit {truth.get('vramcal_commit') or 'unknown'}; "
             f"{_non_oom(truth)})",
             f"- vramcal commit of this run: {env.get('vramcal_commit') or 'unknown'}",
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
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {t['met']} |" for t in targets(results)]
    if results.get("adaptations"):
        lines += ["", f"Adaptations: {results['adaptations']}."]
    lines += ["", "Trials per tool (batch size:status):", ""]
    for name, tool in [("ground truth", truth)] + _ordered(results["tools"]):
        lines.append(f"- {name}: " + ", ".join(f"{t['batch_size']}:{t['status']}" for t in tool["trials"]))
    notes = results.get("notes") or ([results["note"]] if results.get("note") else [])
    if notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def targets(results: dict[str, Any]) -> list[dict[str, str]]:
    """The issue's targets for vramcal, each with the measured figure and whether it was met."""
    truth = results["ground_truth"]["batch_size"]
    tools = results["tools"]
    vram = tools.get("vramcal", {})
    limits = vram.get("limits")
    if not limits:
        return [{"target": "vramcal ran", "measured": f"no limits (rc {vram.get('returncode')})", "met": "no"}]
    out = []
    boundary = limits["boundary_batch_size"]
    off = 100 * (boundary - truth) / truth
    out.append({"target": "predicted boundary within 3 % of the ground truth",
                "measured": f"{boundary:.1f} vs {truth} ({off:+.1f} %)", "met": _yes(abs(off) <= 3.0)})
    for label in ("safe", "conservative"):
        size = limits[f"{label}_batch_size"]
        out.append({"target": f"{label} batch size never above the ground truth",
                    "measured": f"{size} vs {truth} (gap {truth - size}, {100 * (truth - size) / truth:.1f} % below)",
                    "met": _yes(size <= truth)})
    conservative = limits["conservative_batch_size"]
    run = results.get("survival", {}).get(str(conservative))
    out.append({"target": f"conservative batch size survives {results['steps']} steps",
                "measured": "not run" if run is None else f"{run.get('status')} after {run.get('steps_done')} steps",
                "met": "-" if run is None else _yes(run.get("status") == "ok"
                                                    and run.get("steps_done") == results["steps"])})
    binsearch = tools.get("lightning-binsearch")
    if binsearch:
        ratio = vram["process_wall_s"] / binsearch["process_wall_s"]
        out.append({"target": "vramcal wall time at most half of Lightning binsearch's",
                    "measured": f"{vram['process_wall_s']:.1f} s vs {binsearch['process_wall_s']:.1f} s "
                                f"(ratio {ratio:.2f})", "met": _yes(ratio <= 0.5)})
    return out


def _ordered(tools: dict[str, Any]) -> list[tuple[str, Any]]:
    """vramcal first, then the anchors in the order bench.compare runs them (the JSON's keys are sorted)."""
    order = ("vramcal", "lightning-binsearch", "lightning-power", "accelerate")
    return sorted(tools.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order))


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def _non_oom(truth: dict[str, Any]) -> str:
    failures = [t for t in truth.get("trials", []) if t["status"] not in ("ok", "oom")]
    if not failures:
        return "every failing trial was an out-of-memory error"
    return ("failures that were not out-of-memory, counted as failures at that size: "
            + ", ".join(f"{t['batch_size']}:{t['status']}" for t in failures))


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
