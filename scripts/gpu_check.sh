#!/usr/bin/env bash
# GPU check, run from the source tree on a machine with an NVIDIA GPU, no network and only its
# preinstalled Python packages (the H200 image: torch 2.11, triton 3.6, transformers 5.17, scipy, pandas,
# pyarrow, matplotlib, click, tqdm, huggingface-hub, tokenizers, safetensors, regex, psutil ...).
# What vramcal needs beyond them is carried in ./wheels (filled by `make gpu-wheels` on a machine with PyPI:
# the exact versions of scripts/gpu_wheels.txt) and installed here without dependencies ahead of the image's
# packages; scripts/preflight.py checks that everything is there and new enough, and prints one line per
# package found. The fused path's wheels (`make gpu-fused-wheels`: causal-conv1d compiled for sm_90,
# mamba-ssm, einops) are optional; when they are in ./wheels the same command installs them, and the
# preflight prints whether they import. Then scripts/gpu_check.py runs its steps (its docstring), writing
# gpu_check.json, GPU_CHECK.md and gpu_check_files.tar.gz to $OUT after every step; its output is also kept in
# $OUT/gpu_check.log.
# Time: one deadline, taken at the first line: everything ends within GPU_CHECK_DEADLINE_S seconds (default 510;
# give the device call a timeout_s 30 s longer, README). The setup (wheels, preflight, nvidia-smi) is timed and
# recorded (setup_s in gpu_check.json); the check runs under `timeout` with what is left less 10 s (SIGTERM to the
# check's whole process group, its fork server and trials included, then SIGKILL 10 s later: both before the
# deadline), and with its own --budget-s 20 s shorter still, so it stops itself first with everything written.
# A SIGTERM or Ctrl-C to this script (a device limit) is passed on to the check, which stops the step in flight,
# keeps what it measured and writes the "finished" mark before it exits.
# Usage: OUT=/some/dir scripts/gpu_check.sh [gpu_check.py options]   (default OUT: gpu-check; the work
#        folder, with profiles, reports, the run and Triton's cache, is $OUT.work). With `--gpu none` (a host
#        rehearsal) the preflight does not ask for a GPU.
# Exit codes: 0 done; 1 a step ended in an error or was stopped (GPU_CHECK.md says which); 3 preflight: a
# package missing or too old (one line each); 4 no NVIDIA GPU visible (one line); 5 the setup left the check too
# little time (one line); any other: pip's, or 124/137 (the timeout: the check's own budget should end it first).
set -euo pipefail
started=$(date +%s)
DEADLINE_S=${GPU_CHECK_DEADLINE_S:-510}
KILL_S=10 STOP_S=20
echo "gpu_check.sh: one deadline, ${DEADLINE_S} s from now: the setup, then the check, end within it"
trap 'echo "gpu_check.sh: stopped in the setup, before the check started" >&2; exit 143' TERM INT
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
PY=${PYTHON:-python3}
rm -rf .gpu-site
if compgen -G "wheels/*.whl" >/dev/null; then
  $PY -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target .gpu-site wheels/*.whl
fi
export PYTHONPATH="$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
case " $* " in *" --gpu none "*) $PY scripts/preflight.py ;; *) $PY scripts/preflight.py --gpu ;; esac
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
setup_s=$(( $(date +%s) - started ))
left_s=$(( DEADLINE_S - setup_s - KILL_S ))
budget_s=$(( left_s - STOP_S ))
if [ "$budget_s" -lt 30 ]; then
  echo "the setup took ${setup_s} s of the ${DEADLINE_S} s deadline: ${budget_s} s is too little for the check;" \
       "raise GPU_CHECK_DEADLINE_S (and the device call's timeout with it)" >&2
  exit 5
fi
echo "gpu_check.sh: setup ${setup_s} s; the check: --budget-s ${budget_s}, timeout ${left_s} s" \
     "(SIGKILL ${KILL_S} s later)"
mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# SIGTERM to timeout, which passes it to the check's group (a background command ignores SIGINT: TERM for Ctrl-C too)
pass_on() { kill -s TERM "$(cat "$tmp/pid" 2>/dev/null)" 2>/dev/null || true; }
trap pass_on TERM INT
( timeout -k "$KILL_S" "$left_s" "$PY" -u scripts/gpu_check.py --out "$OUT" --budget-s "$budget_s" \
    --setup-s "$setup_s" "$@" &
  echo $! >"$tmp/pid"
  trap '' TERM INT  # a signal to this script's group is passed on above; this shell and tee stay to the end
  code=0; wait $! || code=$?
  echo "$code" >"$tmp/code" ) 2>&1 | (trap '' TERM INT; exec tee "$OUT/gpu_check.log") &
while kill -0 $! 2>/dev/null; do wait $! || true; done  # a trapped signal ends a wait early: wait again
exit "$(cat "$tmp/code" 2>/dev/null || echo 1)"
