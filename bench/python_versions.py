"""Compare host calibrations made under several Pythons (the report of ``bench/python_versions.sh``).

``python -m bench.python_versions [--budget 2GiB] VERSION=FIELDS ...`` where FIELDS is
``FULL,TORCH,TESTS,TEST_S,PROBE_EXIT,PROBE_S,INSTALL_S,PROFILE,LOGS`` (as ``bench/python_versions.sh`` writes).

For each version: its safe and conservative batch sizes and the measured peak of its safe size's
verification trial; for each pair (v, w): does v's verification peak lie inside w's 95 % prediction
interval at v's safe size (``w.fit.lower(s_v) <= peak_v <= w.fit.upper(s_v)``)? That is issue 9's
"a host calibration of one spec agrees within the prediction interval on every Python". Writes
``bench/results/python-versions.{md,json}``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramcal.units import format_bytes

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = ("full", "torch", "tests", "test_s", "probe_exit", "probe_s", "install_s", "profile", "logs")


@dataclass(frozen=True)
class Calibration:
    """One version's calibration: safe size (samples), its verification peak (bytes) and the fit."""

    version: str
    safe_batch_size: int
    conservative_batch_size: int
    safe_peak_bytes: int | None
    verified: bool
    fit: Any  # vramcal.calibration.fit.Fit (predict, lower, upper)


def agreement(calibrations: list[Calibration]) -> list[dict[str, Any]]:
    """For each ordered pair (v, w), v != w: v's safe-size verification peak against w's interval there.

    Pure (tested with synthetic fits). ``inside`` is None when v has no verification peak.
    """
    rows = []
    for mine in calibrations:
        for other in calibrations:
            if other is mine:
                continue
            size, peak = mine.safe_batch_size, mine.safe_peak_bytes
            lower, upper = other.fit.lower(size), other.fit.upper(size)
            rows.append({"version": mine.version, "against": other.version, "batch_size": size,
                         "peak_bytes": peak, "lower_bytes": int(lower), "upper_bytes": int(upper),
                         "inside": None if peak is None else bool(lower <= peak <= upper)})
    return rows


def parse(argument: str) -> dict[str, Any]:
    """``3.12=3.12.1,2.13.0,passed,95,0,80,300,/path/profile.json,/path/logs`` -> a dict of :data:`FIELDS`."""
    version, _, rest = argument.partition("=")
    values = rest.split(",")
    if len(values) != len(FIELDS):
        raise ValueError(f"expected VERSION={','.join(FIELDS)}, got {argument!r}")
    row: dict[str, Any] = {"version": version, **dict(zip(FIELDS, values))}
    for name in ("test_s", "probe_exit", "probe_s", "install_s"):
        row[name] = int(row[name])
    return row


def load(row: dict[str, Any]) -> Calibration | None:
    from vramcal.profile import ProfileError, load_profile

    try:
        profile = load_profile(row["profile"])
    except ProfileError:
        return None
    if profile.limits is None or profile.fit is None:
        return None
    safe = profile.verification.get("safe")
    return Calibration(row["version"], profile.limits.safe_batch_size, profile.limits.conservative_batch_size,
                       safe.peak_bytes if safe is not None else None, profile.verified, profile.fit)


def markdown(rows: list[dict[str, Any]], calibrations: list[Calibration], pairs: list[dict[str, Any]],
             budget: str) -> str:
    by_version = {c.version: c for c in calibrations}
    lines = ["# vramcal on every declared Python (issue 9)", "",
             f"Small spec (d_model 64, n_layers 2, d_state 16, headdim 16, seq_len 64, chunk 32), host budget "
             f"{budget}, E-mini bars with stride 1; created {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}.", "",
             "| Python | torch | pytest | pytest s | probe exit | probe s | install s | safe | conservative | "
             "safe peak | verified |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        c = by_version.get(row["version"])
        figures = ([str(c.safe_batch_size), str(c.conservative_batch_size),
                    format_bytes(c.safe_peak_bytes) if c.safe_peak_bytes else "-", "yes" if c.verified else "**no**"]
                   if c else ["-", "-", "-", "no profile"])
        lines.append(f"| {row['full']} | {row['torch']} | {row['tests']} | {row['test_s']} | {row['probe_exit']} | "
                     f"{row['probe_s']} | {row['install_s']} | " + " | ".join(figures) + " |")
    lines += ["", "Each version's safe-size verification peak against the other versions' 95 % prediction "
              "interval at that batch size:", "", "| version | against | batch | peak | interval | inside |",
              "|---|---|---|---|---|---|"]
    for p in pairs:
        peak = format_bytes(p["peak_bytes"]) if p["peak_bytes"] else "-"
        inside = "-" if p["inside"] is None else ("yes" if p["inside"] else "**no**")
        lines.append(f"| {p['version']} | {p['against']} | {p['batch_size']} | {peak} | "
                     f"{format_bytes(p['lower_bytes'])} - {format_bytes(p['upper_bytes'])} | {inside} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    budget = "2GiB"
    if argv[:1] == ["--budget"]:
        budget, argv = argv[1], argv[2:]
    rows = [parse(a) for a in argv]
    calibrations = [c for c in (load(r) for r in rows) if c is not None]
    pairs = agreement(calibrations)
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, calibrations, pairs, budget)
    (RESULTS / "python-versions.md").write_text(text)
    (RESULTS / "python-versions.json").write_text(json.dumps(
        {"budget": budget, "runs": rows, "calibrations": [{"version": c.version, "safe_batch_size": c.safe_batch_size,
                                         "conservative_batch_size": c.conservative_batch_size,
                                         "safe_peak_bytes": c.safe_peak_bytes, "verified": c.verified,
                                         "overhead_bytes": c.fit.overhead_bytes,
                                         "slope_bytes_per_sample": c.fit.slope_bytes_per_sample}
                                        for c in calibrations],
         "agreement": pairs}, indent=1, sort_keys=True) + "\n")
    print(text)
    return 0 if all(p["inside"] for p in pairs) and all(r["tests"] != "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
