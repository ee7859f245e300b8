#!/usr/bin/env bash
# GPU check, run from the source tree on a machine with an NVIDIA GPU and only its preinstalled
# Python packages (torch, transformers, nvidia-ml-py, scipy, pandas, matplotlib, click, pyarrow).
# Missing wheels (transformers>=5.23, tqdm, ...) are installed from ./wheels if that folder exists:
#   make gpu-wheels   (on a machine with PyPI) fills it.
# Usage: OUT=/some/dir scripts/gpu_check.sh     (default OUT: the repo, i.e. profiles/ and reports/)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
PY=${PYTHON:-python3}
if [ -d wheels ] && ls wheels/*.whl >/dev/null 2>&1; then
  $PY -m pip install --quiet --no-index --find-links wheels --target .gpu-site wheels/*.whl
  export PYTHONPATH="$PWD/.gpu-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 480 $PY scripts/gpu_check.py --out "$OUT"
