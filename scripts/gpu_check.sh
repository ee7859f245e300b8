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
# gpu_check.json, GPU_CHECK.md and gpu_check_files.tar.gz to $OUT after every step, and stops itself
# before the 480 s below with everything written; its output is also kept in $OUT/gpu_check.log.
# Usage: OUT=/some/dir scripts/gpu_check.sh [gpu_check.py options]   (default OUT: gpu-check; the work
#        folder, with profiles, reports, the run and Triton's cache, is $OUT.work)
# Exit codes: 0 done; 1 a step ended in an error or was stopped (GPU_CHECK.md says which); 3 preflight: a
# package missing or too old (one line each); 4 no NVIDIA GPU visible (one line); any other: pip's, or
# 124 (the 480 s limit: the check's own budget should end it first).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
PY=${PYTHON:-python3}
rm -rf .gpu-site
if compgen -G "wheels/*.whl" >/dev/null; then
  $PY -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target .gpu-site wheels/*.whl
fi
export PYTHONPATH="$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY scripts/preflight.py --gpu
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
mkdir -p "$OUT"
timeout 480 $PY -u scripts/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
