#!/usr/bin/env bash
# GPU check, run from the source tree on a machine with an NVIDIA GPU, no network and only its
# preinstalled Python packages (the H200 image: torch, transformers 5.17, nvidia-ml-py, scipy, pandas,
# pyarrow, matplotlib, click, tqdm, huggingface-hub, tokenizers, safetensors).
# What vramcal needs beyond them is carried in ./wheels (filled by `make gpu-wheels` on a machine with
# PyPI: transformers>=5.23, nvitop and its psutil) and installed here without dependencies: the image's
# packages satisfy the rest, and scripts/preflight.py checks that they do. The fused path's wheels
# (`make gpu-fused-wheels`: causal-conv1d compiled for sm_90, mamba-ssm, einops) are optional; when they
# are in ./wheels the same command installs them, and the preflight prints whether they import.
# Usage: OUT=/some/dir scripts/gpu_check.sh     (default OUT: the repo, i.e. profiles/ and reports/)
# Exit codes: 0 done; 3 preflight: a package missing or too old (one line each); 4 no NVIDIA GPU
# visible (one line); any other: pip's, or scripts/gpu_check.py's (124: its time limit).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
PY=${PYTHON:-python3}
rm -rf .gpu-site
if compgen -G "wheels/*.whl" >/dev/null; then
  $PY -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target .gpu-site wheels/*.whl
fi
export PYTHONPATH="$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY scripts/preflight.py --gpu
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
timeout 480 $PY scripts/gpu_check.py --out "$OUT"
