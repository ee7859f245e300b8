"""The 2-D fit's error between calibrated lengths, measured by real trials (issue 59 item 3).

``python -m bench.interpolation [PROFILE ...] [--out bench/results/interpolation]``

For each profile calibrated over several lengths (default: every one under ``examples/``, ``bench/results/`` and
``profiles/``) whose device is this host, real trials (:func:`vramcal.api.verify`: a verification's trial, its step
creep read in) at answers the surface interpolates, for each gap between neighbouring calibrated lengths:

* ``middle``: the gap's geometric middle (a multiple of chunk_size) at its interpolated safe batch;
* ``longest``: the longest seq_len (:func:`vramcal.calibration.surface.longest_at`) at the batch geometrically halfway
  between the gap's ends' safe batches, where it falls inside the gap;

and one ``control`` at the reference length's safe batch, a calibrated point: how far this host has drifted from
the calibration (software, load). Each point records the fit's point prediction and upper bound there and the
measured peak; the error is ``measured / predicted - 1``, and beyond the drift ``error - control's error``. Each
profile runs in a process of its own under the thread setting it recorded (``OMP_NUM_THREADS``), so a thread
setting that differs (the staleness ``vramcal limits`` warns of) is not read as an interpolation error.

Writes ``<out>/<profile stem>-<hash of its path>.json`` and prints each point and the worst under-prediction, which
:data:`vramcal.calibration.surface.INTERPOLATION_ERROR` must cover.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from vramcal.calibration.surface import answer_at, longest_at
from vramcal.profile import Profile, load_profile, profiles_under

REPO = Path(__file__).resolve().parent.parent
WHERE = ("examples", "bench/results", "profiles")  # the folders the committed (and the user's) profiles are in
MIB = 2**20


def multi_length(paths: list[Path]) -> list[Profile]:
    """The profiles over several lengths that ``paths`` (files or folders) hold."""
    found = []
    for path in paths:
        found += profiles_under(path)[0] if path.is_dir() else [load_profile(path)]
    return [p for p in found if p.surface is not None]


def points(profile: Profile) -> list[tuple[str, int, int]]:
    """(kind, batch_size, seq_len) of the trials that measure ``profile``'s interpolation (module docstring)."""
    surface, usable = profile.surface, profile.limits.usable_bytes
    chunk, reference = surface.chunk_size, surface.at(surface.reference_seq_len)
    chosen = [("control", reference.safe_batch_size, reference.seq_len)]
    for short, long in zip(surface.lengths, surface.lengths[1:]):
        middle = round(math.sqrt(short.seq_len * long.seq_len) / chunk) * chunk
        if short.seq_len < middle < long.seq_len:
            chosen.append(("middle", answer_at(surface, middle, usable, 0.9)[0], middle))
        batch = round(math.sqrt(short.safe_batch_size * long.safe_batch_size))
        length = longest_at(surface, batch, usable)
        if short.seq_len < length < long.seq_len:
            chosen.append(("longest", batch, length))
    return [(kind, b, length) for kind, b, length in chosen if b >= 1]


def measure(path: Path) -> dict:
    """Every point of one profile, measured here (:func:`vramcal.api.verify`)."""
    from vramcal.api import verify

    profile = load_profile(path)
    fit, rows = profile.surface.fit, []
    for kind, batch, length in points(profile):
        trial = verify(profile, batch, length)
        predicted, upper = fit.predict(batch, length), fit.upper(batch, length)
        rows.append({"kind": kind, "batch_size": batch, "seq_len": length, "status": trial.status,
                     "predicted_bytes": round(predicted), "upper_bytes": round(upper), "peak_bytes": trial.peak_bytes,
                     "error": trial.peak_bytes / predicted - 1 if trial.peak_bytes else None})
    control = rows[0]["error"] or 0.0
    for row in rows:
        row["beyond_drift"] = None if row["error"] is None else row["error"] - control
    return {"profile": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
            "seq_lens": list(profile.surface.seq_lens), "usable_bytes": profile.limits.usable_bytes,
            "omp_num_threads": profile.environment.get("OMP_NUM_THREADS"), "points": rows}


def in_its_own_process(path: Path) -> dict:
    """:func:`measure` in a fresh process under the thread setting the profile recorded (module docstring)."""
    threads = load_profile(path).environment.get("OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({"OMP_NUM_THREADS": str(threads)} if threads is not None else {})
    done = subprocess.run([sys.executable, "-m", "bench.interpolation", "--one", str(path)], env=env, cwd=REPO,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def result_name(path: Path) -> str:
    """``<profile stem>-<6 hex digits of its path>.json``: profiles of one name in two folders keep two results."""
    where = str(path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) else path)
    return f"{path.stem}-{hashlib.sha256(where.encode()).hexdigest()[:6]}.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="*", type=Path, help="profile files or folders [default: module docstring]")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "interpolation")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # a child: measure one, print its JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one)))
        return 0
    from vramcal.measure.device import host_device

    here = host_device()
    found = [p for p in multi_length(args.profiles or [REPO / w for w in WHERE if (REPO / w).exists()])
             if here.hardware_difference(p.device) is None]
    args.out.mkdir(parents=True, exist_ok=True)
    errors = []
    for profile in found:
        result = in_its_own_process(profile.path)
        (args.out / result_name(profile.path)).write_text(json.dumps(result, indent=2) + "\n")
        print(f"{result['profile']} (seq_len {result['seq_lens']}, OMP_NUM_THREADS {result['omp_num_threads']}):")
        for row in result["points"]:
            measured = f"{row['peak_bytes'] / MIB:8.2f} MiB" if row["peak_bytes"] else f"{row['status']:>12}"
            error = f"{row['error']:+.2%} ({row['beyond_drift']:+.2%} beyond drift)" if row["error"] is not None else ""
            print(f"  {row['kind']:<8} batch_size {row['batch_size']:>4} x seq_len {row['seq_len']:>5}: predicted "
                  f"{row['predicted_bytes'] / MIB:8.2f} MiB, upper {row['upper_bytes'] / MIB:8.2f}, measured "
                  f"{measured}  {error}")
            if row["kind"] != "control" and row["error"] is not None:
                errors.append(row["error"])
    if errors:
        print(f"{len(errors)} interpolated points of {len(found)} profiles: error {min(errors):+.2%} to "
              f"{max(errors):+.2%} (the worst under-prediction {max(errors):+.2%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
