"""How far the process term of one framework script spreads over repeats (issue 42 item 9).

The process term is what a framework's process holds as training starts beyond what the profile's trials held
at the same point (:func:`vramcal.sizing.extra_bytes`), measured once in each run. ``python -m bench.process_term``
calibrates the ``lm`` family's tiny config on the host (as :mod:`bench.frameworks` does; or takes ``--profile``),
then runs each framework's script (:func:`bench.frameworks.child`: Lightning, HF Trainer, Accelerate, plain
PyTorch) ``--repeats`` times, each in a fresh process, for ``--steps`` optimizer steps, and prints per framework
what each repeat held, its process term, the range of the terms (max − min) and each run's peak against its
prediction.

    .venv/bin/python -m bench.process_term [--repeats 3] [--steps 5] [--capacity 1.5GiB] [--profile FILE]
                                           [--out bench/results/process-term]

Writes ``process-term.json`` and ``process-term.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.frameworks import CONFIG, FRAMEWORKS, watch


def repeat(framework: str, profile: Path, steps: int, seq_len: int) -> dict[str, Any]:
    """One run of ``framework``'s script in a fresh process: :func:`bench.frameworks.child`'s figures."""
    started = time.perf_counter()
    done, _ = watch([sys.executable, "-m", "bench.frameworks", "--child", framework, "--profile", str(profile),
                     "--steps", str(steps), "--seq-len", str(seq_len)])
    if done.returncode != 0:
        return {"framework": framework, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - started}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per framework: the process terms (bytes) of its repeats, their range, and the peak errors."""
    out: dict[str, Any] = {}
    for framework in FRAMEWORKS:
        ok = [r for r in runs if r["framework"] == framework and "error" not in r]
        terms = [r["process_delta_bytes"] or 0 for r in ok]
        held = [r["held_bytes"] for r in ok if r["held_bytes"] is not None]
        out[framework] = {"process_terms_bytes": terms, "held_bytes": held,
                          "held_range_bytes": max(held) - min(held) if len(held) > 1 else None,
                          "errors": [r["peak_bytes"] / r["predicted_peak_bytes"] - 1 for r in ok]}
    return out


def markdown(result: dict[str, Any]) -> str:
    from vramcal.units import format_bytes

    lines = [f"# The process term over repeats of one script: lm ({CONFIG.name}), host, {result['capacity']}, "
             f"{result['repeats']} repeats of {result['steps']} steps", "",
             f"The profile's trials held {format_bytes(result['trials_held_bytes'])} as their step was built.", "",
             "| framework | held as training starts (each repeat) | range | process terms | peak vs prediction |",
             "|---|---|---|---|---|"]
    for framework, row in result["frameworks"].items():
        held = ", ".join(format_bytes(b) for b in row["held_bytes"])
        span = format_bytes(row["held_range_bytes"]) if row["held_range_bytes"] is not None else "—"
        terms = ", ".join(f"{t / 2**20:+.1f} MiB" for t in row["process_terms_bytes"])
        errors = ", ".join(f"{e:+.1%}" for e in row["errors"])
        lines.append(f"| {framework} | {held} | {span} | {terms} | {errors} |")
    lines += ["", f"Command: `.venv/bin/python -m bench.process_term --repeats {result['repeats']} --steps "
              f"{result['steps']} --capacity {result['capacity']}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from vramcal.profile import load_profile
    from vramcal.units import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--capacity", default="1.5GiB")
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "process-term")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.profile
    if path is None:
        import vramcal

        vramcal.calibrate("lm", {"config": str(CONFIG), "seq_len": args.seq_len}, gpu="none",
                          capacity_bytes=parse_bytes(args.capacity), profiles_dir=args.out / "profiles")
        (path,) = sorted((args.out / "profiles").glob("**/*.json"))[-1:]
    runs = []
    for index in range(args.repeats):  # interleaved: a busy moment of the host falls on every framework alike
        for framework in FRAMEWORKS:
            runs.append({**repeat(framework, path, args.steps, args.seq_len), "repeat": index})
            print(json.dumps({k: runs[-1].get(k) for k in ("framework", "repeat", "held_bytes",
                                                             "process_delta_bytes", "error")}))
    result = {"profile": str(path), "capacity": args.capacity, "repeats": args.repeats, "steps": args.steps,
              "trials_held_bytes": load_profile(path).held_bytes, "runs": runs, "frameworks": summary(runs)}
    (args.out / "process-term.json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    (args.out / "process-term.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
