"""What verified limits cost at the least, read from a benchmark's recorded trials, against 0.33x binsearch.

Issue 19 asks vramcal's calibration for at most a third of Lightning binsearch's wall time. This reads a
results JSON of :mod:`bench.compare` and prices, from each vramcal round's own trials, what any calibration
that keeps the product's promise (limits verified by real trials, the step creep measured) has to run:

- ``start``: the process, its imports and the first trial (batch 1), up to that trial's end, plus the
  process's time outside the calibration (``process_wall_s - answer_s``);
- ``boundary``: one boundary trial, the round's fastest (the predicted out-of-memory boundary within 1 % rests on
  a trial near it);
- ``safe``: **one** trial at the safe size (the round's fastest verification of its final safe size);
- ``conservative``: one trial at the conservative size (the steady trial's first steps, ``verify-conservative``);
- ``steady``: the rest of the steady trial (its steps after the verification: the creep and the epoch's end).

``floor`` is ``start + boundary + safe + conservative``: no growth trial, no repeat, no steady steps, a
calibration that knew the slope before it began: a lower bound on any calibration that verifies both limits
with a trial each. ``with creep`` adds ``steady``. Each is the median over the rounds, beside ``0.33 x`` the
median of binsearch's process wall time (the target) and the tool's median.

    .venv/bin/python -m bench.wall_floor bench/results/mmap256k/default-2_5GiB.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

TARGET = 0.33
ANCHOR = "lightning-binsearch"
PARTS = ("start", "boundary", "safe", "conservative", "steady")


def parts(run: dict[str, Any]) -> dict[str, float]:
    """Seconds of each part (module docstring) of one vramcal round (its ``trials``, ``limits``, ``answer_s``,
    ``process_wall_s``). Pure.

    Raises:
        ValueError: the round has no trial, or no trial at its safe or conservative size.
    """
    trials = run["trials"]
    if not trials:
        raise ValueError("a vramcal round with no trial")
    limits = run["limits"]
    safe = [t["wall_s"] for t in trials if t["purpose"].startswith("verify-safe")
            and t["batch_size"] == limits["safe_batch_size"]]
    conservative = [t["wall_s"] for t in trials if t["purpose"] == "verify-conservative"
                    and t["batch_size"] == limits["conservative_batch_size"]]
    if not safe or not conservative:
        raise ValueError(f"no verification at the safe size {limits['safe_batch_size']} or the conservative size "
                         f"{limits['conservative_batch_size']} in this round's trials")
    steady = sum(t["wall_s"] for t in trials if t["purpose"] == "steady")
    return {"start": trials[0]["end_s"] + run["process_wall_s"] - run["answer_s"],
            "boundary": min((t["wall_s"] for t in trials if t["purpose"] == "boundary"), default=0.0),
            "safe": min(safe), "conservative": conservative[-1],
            "steady": max(0.0, steady - conservative[-1]) if steady else 0.0}


def floors(results: dict[str, Any]) -> list[dict[str, Any]]:
    """A row per vramcal tool of a :mod:`bench.compare` results dict: the median of each part, ``floor``,
    ``with_creep``, the tool's median wall time and the target (``TARGET`` x binsearch's median), in seconds.

    Raises:
        ValueError: no binsearch rounds, or a round :func:`parts` refuses.
    """
    runs = results["runs"]
    if not runs.get(ANCHOR):
        raise ValueError(f"no {ANCHOR} rounds in these results: run bench.compare with --tools ...,{ANCHOR}")
    target = TARGET * statistics.median(r["process_wall_s"] for r in runs[ANCHOR])
    rows = []
    for tool in sorted(t for t in runs if t.startswith("vramcal")):
        each = [parts(run) for run in runs[tool]]
        row: dict[str, Any] = {"spec": results["spec_name"], "tool": tool, "rounds": len(each)}
        row.update({name: statistics.median(p[name] for p in each) for name in PARTS})
        row["floor"] = statistics.median(sum(p[n] for n in PARTS[:-1]) for p in each)
        row["with_creep"] = statistics.median(sum(p.values()) for p in each)
        row["measured"] = statistics.median(r["process_wall_s"] for r in runs[tool])
        row["target"] = target
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (seconds, one decimal). Pure."""
    columns = ("spec", "tool", "rounds", *PARTS, "floor", "with_creep", "measured", "target")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results JSON files of bench.compare")
    args = parser.parse_args(argv)
    rows = []
    for path in args.results:
        try:
            rows += floors(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError) as error:
            print(f"bench.wall_floor: {path}: {error}", file=sys.stderr)
            return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
