#!/usr/bin/env bash
# CPU rehearsal of the GPU check on the H200 image (issue 11): build a Python 3.12 environment like the
# image's (torch 2.11 from PyPI - its CUDA 13 build, the image's own, which runs on a CPU; transformers
# 5.17; no optuna, mamba-ssm, causal-conv1d, nvitop or psutil), fill wheels/ with `make gpu-wheels` (the
# exact versions of scripts/gpu_wheels.txt, checked against the image's package list), run
# scripts/gpu_check.sh exactly as the device does, and require that it passes the preflight (the carried
# transformers shadows 5.17; nvitop, psutil, nvidia-ml-py and regex come from the carried wheels) and then
# stops at the one "no NVIDIA GPU visible" line with exit code 4.
# Usage: scripts/gpu_rehearsal.sh   (REHEARSAL_DIR, REHEARSAL_PYTHON, REHEARSAL_TORCH to override)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${REHEARSAL_DIR:-.rehearsal}
PY312=${REHEARSAL_PYTHON:-$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12)}
TORCH=${REHEARSAL_TORCH:-torch==2.11.0}
IMAGE="$TORCH transformers==5.17.* huggingface-hub==1.33.* tokenizers==0.23.* safetensors==0.8.* nvidia-ml-py
       numpy scipy pandas pyarrow matplotlib click tqdm"
started=$(date +%s)
stamp="$DIR/venv/.image-$(echo "$PY312 $IMAGE" | sha1sum | cut -c1-12)"
if [ ! -e "$stamp" ]; then
  rm -rf "$DIR/venv"
  "$PY312" -m venv "$DIR/venv"
  "$DIR/venv/bin/python" -m pip install --quiet --disable-pip-version-check $IMAGE
  touch "$stamp"
fi
built=$(date +%s)
V="$DIR/venv/bin/python3"
for absent in optuna mamba_ssm causal_conv1d nvitop psutil; do
  if "$V" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$absent') is None)"; then
    echo "rehearsal: $absent is installed in $DIR/venv, but the H200 image has none" >&2; exit 1
  fi
done
make --no-print-directory gpu-wheels PYTHON="$V" >/dev/null
set +e
PYTHON="$V" OUT="$DIR/out" scripts/gpu_check.sh >"$DIR/check.out" 2>"$DIR/check.err"
code=$?
set -e
finished=$(date +%s)
cat "$DIR/check.out" "$DIR/check.err"
fail() { echo "rehearsal FAILED: $1" >&2; exit 1; }
[ "$code" -eq 4 ] || fail "scripts/gpu_check.sh exited $code, not 4 (no GPU)"
grep -q "^preflight: packages ok (.*transformers 5\.2[3-9]\|^preflight: packages ok (.*transformers [6-9]\." "$DIR/check.out" \
  || fail "the preflight did not pass with the carried transformers (>=5.23)"
grep -q "transformers from $PWD/.gpu-site" "$DIR/check.out" || fail "transformers was not imported from .gpu-site"
[ "$(grep -cv '^preflight: warning' "$DIR/check.err")" -eq 1 ] || fail "expected one line on stderr"
grep -q "^no NVIDIA GPU visible (NVML: .*): the GPU check needs one$" "$DIR/check.err" || fail "no 'no GPU' line"
echo "rehearsal passed: environment $((built - started)) s, wheels + check $((finished - built)) s, total $((finished - started)) s"
