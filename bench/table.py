"""The results tables (Markdown and CSV) from the results dict of :mod:`bench.compare`: pure, re-runnable.

``python -m bench.table bench/results/small-1_5GiB.json`` re-renders the ``.md`` and ``.csv`` beside it.

The dict (``bench_schema`` 2) holds ``runs[tool]``: one record per round (``round``, ``answer``,
``trials``, ``process_wall_s``, ``returncode``; vramcal's also ``limits`` and ``profile_label``),
``ground_truth``, and ``survival``: one record per batch size trained (``status``, ``steps_done``,
``peak_bytes``, the closed-loop figures of the profile it was planned with, and ``predictions`` keyed
``<vramcal tool>/r<round>``: each vramcal profile's point prediction and upper bound at that size).
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from vramcal.units import format_bytes

SCHEMA = 2
VRAMCAL = ("vramcal", "vramcal-anchor-margin", "vramcal-aimed")
ANCHORS = ("lightning-binsearch", "lightning-power", "accelerate")
TOOLS = VRAMCAL + ANCHORS
LABELS = {"vramcal": "vramcal", "vramcal-anchor-margin": "vramcal (anchors' margin)", "vramcal-aimed": "vramcal --aim"}
COLUMNS = ("tool", "rounds", "wall_s_median", "wall_s_range", "trials", "batch_size", "error_pct", "survived")
BOUNDARY_TOLERANCE = 0.01  # issue 19: predicted boundary within 1 % of the bisected truth
PREDICTION_TOLERANCE = 0.03  # issue 19: the trainer's peak within ±3 % of the point prediction
WALL_RATIO_TARGET = 0.33  # issue 19: at most a third of Lightning binsearch's wall time


class ResultsError(ValueError):
    """A results file this module cannot render (another schema); the message says how to get one."""


# ------------------------------------------------------------------------------------------ summaries

def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A tool's rounds in figures: median and range of the process wall time (s), trials and answers per
    round, whether the answers differ, and the rounds that failed (no answer)."""
    walls = [r["process_wall_s"] for r in runs]
    answers = [r.get("answer") for r in runs]
    return {"rounds": len(runs), "wall_s_median": statistics.median(walls) if walls else None,
            "wall_s_min": min(walls, default=None), "wall_s_max": max(walls, default=None),
            "trials": [len(r.get("trials") or []) for r in runs], "answers": answers,
            "answers_differ": len({a for a in answers}) > 1,
            "failed_rounds": [r["round"] for r in runs if r.get("answer") is None]}


def _limit(runs: list[dict[str, Any]], name: str) -> list[Any]:
    return [(r.get("limits") or {}).get(name) for r in runs]


def _values(values: list[Any], digits: int = 0) -> str:
    """``105`` when every round agrees, else ``105 / 107 / 105 (differ)``; ``-`` for a missing value."""
    text = ["-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in values]
    if not text:
        return "-"
    return text[0] if len(set(text)) == 1 else " / ".join(text) + " (differ)"


def _error(values: list[Any], truth: int) -> str:
    present = [v for v in values if v is not None]
    if not present or not truth:
        return "-"
    return f"{100 * (statistics.median(present) - truth) / truth:+.1f}"


def survival_at(results: dict[str, Any], batch_size: Any) -> dict[str, Any] | None:
    if batch_size is None:
        return None
    return next((s for s in results.get("survival", []) if s["batch_size"] == int(batch_size)), None)


def _survived(results: dict[str, Any], sizes: list[Any]) -> str:
    verdicts = []
    for size in sorted({int(s) for s in sizes if s is not None}):
        run = survival_at(results, size)
        if run is None:
            verdicts.append("not run")
        elif run["status"] == "ok":
            verdicts.append("yes")
        else:
            verdicts.append(f"no ({run['status']} at step {run.get('steps_done')})")
    if not verdicts:
        return "-"
    return verdicts[0] if len(set(verdicts)) == 1 else "; ".join(
        f"{s}: {v}" for s, v in zip(sorted({int(s) for s in sizes if s is not None}), verdicts))


def rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per tool answer; each vramcal tool gives three (conservative, safe, predicted boundary)."""
    truth = results["ground_truth"]["batch_size"]
    out = [{"tool": "ground truth (bisection)", "rounds": 1,
            "wall_s_median": _seconds(results["ground_truth"]["wall_s"]), "wall_s_range": "-",
            "trials": str(len(results["ground_truth"]["trials"])), "batch_size": str(truth),
            "error_pct": "0.0", "survived": "-"}]
    for name in ordered(results["runs"]):
        runs = results["runs"][name]
        figures = summary(runs)
        base = {"rounds": figures["rounds"], "wall_s_median": _seconds(figures["wall_s_median"]),
                "wall_s_range": f"{_seconds(figures['wall_s_min'])}-{_seconds(figures['wall_s_max'])}",
                "trials": _values(figures["trials"])}
        failed = (f" (failed in round {', '.join(map(str, figures['failed_rounds']))})"
                  if figures["failed_rounds"] else "")
        if name in VRAMCAL:
            for label in ("conservative", "safe"):
                sizes = _limit(runs, f"{label}_batch_size")
                out.append({"tool": f"{LABELS[name]} {label}{failed}", **base, "batch_size": _values(sizes),
                            "error_pct": _error(sizes, truth), "survived": _survived(results, sizes)})
            boundary = _limit(runs, "boundary_batch_size")
            out.append({"tool": f"{LABELS[name]} predicted boundary", **base, "batch_size": _values(boundary, 1),
                        "error_pct": _error(boundary, truth), "survived": "-"})
            continue
        answers = figures["answers"]
        out.append({"tool": name + failed, **base, "batch_size": _values(answers),
                    "error_pct": _error(answers, truth), "survived": _survived(results, answers)})
    return out


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def ordered(runs: dict[str, Any]) -> list[str]:
    """The tools in the table's order (vramcal first, then the anchors; the JSON's keys are sorted)."""
    return sorted(runs, key=lambda name: TOOLS.index(name) if name in TOOLS else len(TOOLS))


def wall_ratio(results: dict[str, Any], tool: str, anchor: str) -> float | None:
    """Median process wall time of ``tool`` over that of ``anchor`` (below 1: ``tool`` is faster)."""
    runs = results["runs"]
    if not runs.get(tool) or not runs.get(anchor):
        return None
    return summary(runs[tool])["wall_s_median"] / summary(runs[anchor])["wall_s_median"]


def ratios(results: dict[str, Any]) -> list[dict[str, str]]:
    """Each vramcal tool's median wall time and median trial count over each anchor's."""
    out = []
    for tool in (t for t in VRAMCAL if results["runs"].get(t)):
        mine = summary(results["runs"][tool])
        for anchor in (a for a in ANCHORS if results["runs"].get(a)):
            theirs = summary(results["runs"][anchor])
            trials = statistics.median(theirs["trials"])
            out.append({"tool": LABELS[tool], "anchor": anchor,
                        "wall_ratio": f"{wall_ratio(results, tool, anchor):.2f}",
                        "trials_ratio": f"{statistics.median(mine['trials']) / trials:.2f}" if trials else "-"})
    return out


# -------------------------------------------------------------------------------------------- targets

def closed_loop(run: dict[str, Any] | None, key: str) -> tuple[str, str]:
    """(measured, met) of the trainer's peak at one size against one profile's prediction ``key``:
    within :data:`PREDICTION_TOLERANCE` of the point prediction, at or below the upper 95 % bound and within
    that profile's usable memory (where the results do not record it, judged without it)."""
    if run is None or run.get("peak_bytes") is None:
        return ("not run" if run is None else f"no peak ({run['status']})"), "-"
    prediction = run.get("predictions", {}).get(key)
    if prediction is None:
        return "no prediction", "-"
    peak, predicted, upper = run["peak_bytes"], prediction["predicted_peak_bytes"], prediction["upper_bytes"]
    usable = prediction.get("usable_bytes", run.get("usable_bytes") if key == run.get("profile_label") else None)
    off = (peak - predicted) / predicted
    met = peak <= upper and abs(off) <= PREDICTION_TOLERANCE and (usable is None or peak <= usable)
    return (f"b={run['batch_size']}: {format_bytes(peak)} vs {format_bytes(predicted)} ({100 * off:+.1f} %), "
            f"upper {format_bytes(upper)}" + (f", usable {format_bytes(usable)}" if usable else "")), _yes(met)


def _pct(fraction: float) -> str:
    return f"{100 * fraction:g} %"


def _combine(parts: list[tuple[str, str]]) -> tuple[str, str]:
    measured = "; ".join(m for m, _ in parts) or "-"
    verdicts = [v for _, v in parts]
    met = "-" if not verdicts or "-" in verdicts else _yes(all(v == "yes" for v in verdicts))
    return measured, met


def targets(results: dict[str, Any]) -> list[dict[str, str]]:
    """Issue 19's targets for each vramcal tool, each with the measured figures of every round and whether
    it was met in all of them."""
    truth = results["ground_truth"]["batch_size"]
    steps = results["steps"]
    out = []
    for tool in (t for t in VRAMCAL if results["runs"].get(t)):
        runs, label = results["runs"][tool], LABELS[tool]
        if any(r.get("limits") is None for r in runs):
            out.append({"target": f"{label} ran", "measured": "no limits in round(s) " + ", ".join(
                str(r["round"]) for r in runs if r.get("limits") is None), "met": "**no**"})
            continue
        boundaries = _limit(runs, "boundary_batch_size")
        offs = [(b - truth) / truth for b in boundaries]
        # The bisection brackets the edge: ``truth`` fits and ``first_failing`` does not, so a predicted edge
        # between them is as close as the truth can tell (one sample is 1.7 % of a truth of 57).
        failing = results["ground_truth"].get("first_failing_batch_size") or truth + 1
        inside = [truth <= b < failing for b in boundaries]
        out.append({"target": f"{label}: predicted boundary within {_pct(BOUNDARY_TOLERANCE)} of the ground truth "
                              "(or between it and the first failing size)",
                    "measured": ", ".join(f"{b:.1f} ({100 * o:+.1f} %{', inside' * i})"
                                          for b, o, i in zip(boundaries, offs, inside))
                    + f" vs {truth} (first failing {failing})",
                    "met": _yes(all(abs(o) <= BOUNDARY_TOLERANCE or i for o, i in zip(offs, inside)))})
        for which in ("safe", "conservative"):
            sizes = _limit(runs, f"{which}_batch_size")
            out.append({"target": f"{label}: {which} batch size never above the ground truth",
                        "measured": f"{_values(sizes)} vs {truth}", "met": _yes(all(s <= truth for s in sizes))})
        for which in ("conservative", "safe"):
            parts = [closed_loop(survival_at(results, r["limits"][f"{which}_batch_size"]), f"{tool}/r{r['round']}")
                     for r in runs]
            measured, met = _combine(parts)
            target = (f"{label}: trainer's peak at the {which} size within ±{_pct(PREDICTION_TOLERANCE)} of the "
                      f"prediction, at or below the upper bound and within usable memory")
            out.append({"target": target, "measured": measured, "met": met})
        survivals = [survival_at(results, r["limits"]["safe_batch_size"]) for r in runs]
        measured = "; ".join("not run" if s is None else f"b={s['batch_size']}: {s['status']} after "
                             f"{s['steps_done']} steps" for s in survivals)
        met = "-" if any(s is None for s in survivals) else _yes(all(s["status"] == "ok" for s in survivals))
        out.append({"target": f"{label}: {steps} training steps at the safe size finish with no out-of-memory error",
                    "measured": measured, "met": met})
        ratio = wall_ratio(results, tool, "lightning-binsearch")
        if ratio is not None:
            mine, theirs = summary(runs), summary(results["runs"]["lightning-binsearch"])
            out.append({"target": f"{label}: median wall time at most {WALL_RATIO_TARGET:g}× Lightning binsearch's",
                        "measured": f"{mine['wall_s_median']:.1f} s vs {theirs['wall_s_median']:.1f} s (ratio "
                                    f"{ratio:.2f}; ranges {mine['wall_s_min']:.1f}-{mine['wall_s_max']:.1f} s and "
                                    f"{theirs['wall_s_min']:.1f}-{theirs['wall_s_max']:.1f} s)",
                        "met": _yes(ratio <= WALL_RATIO_TARGET)})
    return out


def needs_survival(results: dict[str, Any]) -> dict[int, list[str]]:
    """Every batch size a survival run must train, with where it came from: each tool's answer in each
    round, and each vramcal tool's safe size (its conservative size is its answer)."""
    sizes: dict[int, list[str]] = {}
    for name, runs in results["runs"].items():
        for run in runs:
            found = [("", run.get("answer"))]
            if name in VRAMCAL and run.get("limits"):
                found = [(" conservative", run["limits"]["conservative_batch_size"]),
                         (" safe", run["limits"]["safe_batch_size"])]
            for what, size in found:
                if size:
                    sizes.setdefault(int(size), []).append(f"{name}{what} r{run['round']}")
    return sizes


SURVIVE = ("all", "safe", "conservative")


def survival_sizes(results: dict[str, Any], survive: str = "all") -> dict[int, list[str]]:
    """:func:`needs_survival`, or with ``survive`` ``safe`` / ``conservative`` only the vramcal tools' sizes of
    that kind (``bench.compare --survive``: one long run at a time on a small machine). Pure.

    Raises:
        ValueError: ``survive`` is none of ``SURVIVE``.
    """
    if survive not in SURVIVE:
        raise ValueError(f"--survive {survive!r}: use one of {', '.join(SURVIVE)}")
    sizes = needs_survival(results)
    if survive == "all":
        return sizes
    return {size: sources for size, sources in sizes.items()
            if any(f" {survive} r" in source for source in sources)}


# ------------------------------------------------------------------------------------------- markdown

def _survival_sizes_phrase(results: dict[str, Any]) -> str:
    survive = results.get("survive", "all")
    return "each answer" if survive == "all" else f"vramcal's {survive} sizes only (--survive {survive})"


def survival_table(results: dict[str, Any]) -> list[str]:
    lines = ["| batch | from | status | steps | peak | predicted (profile) | peak vs predicted | upper | <= upper | "
             "wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in sorted(results.get("survival", []), key=lambda s: -s["batch_size"]):
        peak = run.get("peak_bytes")
        predicted, upper = run.get("predicted_peak_bytes"), run.get("upper_bytes")
        vs = f"{100 * (peak - predicted) / predicted:+.1f} %" if peak and predicted else "-"
        below = "-" if not (peak and upper) else _yes(peak <= upper)
        lines.append(f"| {run['batch_size']} | {', '.join(run.get('sources', []))} | {run['status']} | "
                     f"{run['steps_done']}/{run['steps']} | {format_bytes(peak) if peak else '-'} | "
                     f"{format_bytes(predicted) if predicted else '-'} ({run.get('profile_label', '-')}) | {vs} | "
                     f"{format_bytes(upper) if upper else '-'} | {below} | {run.get('wall_s', 0):.0f} |")
    return lines


def markdown(results: dict[str, Any]) -> str:
    """The results page (raises ResultsError for a results dict of another schema)."""
    if results.get("bench_schema") != SCHEMA:
        raise ResultsError(f"results of bench schema {results.get('bench_schema', 1)}, not {SCHEMA}: rerun "
                           f"`python -m bench.compare` to make new ones")
    env, truth = results["environment"], results["ground_truth"]
    lines = [f"# vramcal vs batch-size finders: spec `{results['spec_name']}`, budget {env['budget']}"
             + (" (quick smoke run: not results)" if results.get("quick") else ""), "",
             f"- model: `{json.dumps(results['spec'], sort_keys=True)}` (transformers Mamba-2, fp32, AdamW)",
             f"- data: {results['data']['path']}, stride {results['data']['stride']} "
             f"({results['data'].get('train_windows', '?')} training windows)",
             f"- machine: {env['machine']}, {env['cpus']} CPUs, {env['platform']}",
             f"- versions: {', '.join(f'{k} {v}' for k, v in env['versions'].items())}",
             f"- budget: {env['budget']} ({env['budget_bytes']} B), enforced as {env['limit']}",
             f"- limit check (alloc 1.05 x budget under the limit): binds={results['limit_check']['binds']}, "
             f"recognised by vramcal/Lightning/Accelerate={results['limit_check']['recognised_by_all']}",
             f"- ground truth: {truth['batch_size']} (first failing {truth['first_failing_batch_size']}; "
             f"{'cached from an earlier run' if truth.get('cached') else 'computed in this run'}, trials by vramcal "
             f"commit {truth.get('key', {}).get('vramcal_commit') or 'unknown'}; {_non_oom(truth)})",
             f"- vramcal commit of this run: {env.get('vramcal_commit') or 'unknown'}",
             f"- rounds: {results['rounds']} (seed {results['seed']}), orders: "
             + "; ".join(", ".join(order) for order in results.get("orders", [])),
             f"- survival: {results['steps']} optimizer steps of `vramcal train`'s runner at "
             f"{_survival_sizes_phrase(results)}, under the budget (RLIMIT_DATA)",
             f"- Accelerate starting_batch_size: {results['accelerate_start']}",
             f"- load average at start/end: {_load(env.get('load_average_start'))} / "
             f"{_load(env.get('load_average_end'))} (the machine is shared: wall times are noisy)",
             f"- created (UTC): {env['created_utc']}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for row in rows(results)]
    lines += ["", "Ratios of each vramcal tool's median wall time and trials to each anchor's (same rounds):", "",
              "| vramcal | anchor | wall_ratio | trials_ratio |", "|---|---|---|---|"]
    lines += [f"| {r['tool']} | {r['anchor']} | {r['wall_ratio']} | {r['trials_ratio']} |" for r in ratios(results)]
    lines += ["", f"## Survival: `vramcal train`, {results['steps']} steps under the budget", ""]
    lines += survival_table(results)
    lines += ["", "## Targets (issue 19)", "", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {t['met']} |" for t in targets(results)]
    if results.get("adaptations"):
        lines += ["", "Adaptations: " + "; ".join(results["adaptations"]) + "."]
    lines += ["", "Trials per tool and round (batch size:status):", ""]
    lines.append("- ground truth: " + ", ".join(f"{t['batch_size']}:{t['status']}" for t in truth["trials"]))
    for name in ordered(results["runs"]):
        for run in results["runs"][name]:
            lines.append(f"- {name} r{run['round']}: " + ", ".join(f"{t['batch_size']}:{t['status']}"
                                                                   for t in run.get("trials") or []))
    if results.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(lines) + "\n"


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


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m bench.table RESULTS.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    try:
        write_tables(json.loads(path.read_text()), path.with_suffix(".md"), path.with_suffix(".csv"))
    except (OSError, ValueError) as error:
        print(f"{path}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # re-render: python -m bench.table bench/results/small-1_5GiB.json
    sys.exit(main(sys.argv[1:]))
