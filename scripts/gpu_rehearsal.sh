#!/usr/bin/env bash
# CPU rehearsal of the GPU check on the H200 image (issue 11): build a Python 3.12 environment like the
# image's (torch 2.11 from PyPI - its CUDA 13 build, the image's own, which runs on a CPU; transformers
# 5.17; no optuna, mamba-ssm, causal-conv1d, nvitop or psutil), fill wheels/ with `make gpu-wheels` (the
# exact versions of scripts/gpu_wheels.txt, checked against the image's package list), run
# scripts/gpu_check.sh exactly as the device does, and require that it takes its one deadline first, passes the
# preflight (the carried transformers shadows 5.17; nvitop, psutil, nvidia-ml-py and regex come from the carried
# wheels) and then stops at the one "no NVIDIA GPU visible" line with exit code 4.
# Then the deadline (issue 61): the same script on the host (`--gpu none --spec tiny`) under a 300 s deadline,
# sent SIGTERM in its calibration as a device limit would: the setup's seconds recorded, the check's budget
# derived from the deadline, the step in flight stopped and kept, the later ones skipped, "finished" written.
# REHEARSAL_ONLY=deadline runs that part alone, with $PYTHON (default python3), no environment built.
# Usage: scripts/gpu_rehearsal.sh   (REHEARSAL_DIR, REHEARSAL_PYTHON, REHEARSAL_TORCH, REHEARSAL_ONLY to override)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${REHEARSAL_DIR:-.rehearsal}
fail() { echo "rehearsal FAILED: $1" >&2; exit 1; }

# The host run of scripts/gpu_check.sh under python $1, SIGTERMed (by its pid) once its data step is written.
deadline() {
  local out="$DIR/deadline" pid code=0 i
  rm -rf "$out" "$out.work"
  GPU_CHECK_DEADLINE_S=300 PYTHON="$1" OUT="$out" scripts/gpu_check.sh --gpu none --spec tiny --capacity 2.5GiB \
    --reserve 0 --data "$DIR/no-bars.parquet" >"$DIR/deadline.out" 2>"$DIR/deadline.err" &
  pid=$!
  for i in $(seq 1 280); do
    grep -qs '"data"' "$out/gpu_check.json" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  sleep 3
  kill -TERM "$pid"
  wait "$pid" || code=$?
  cat "$DIR/deadline.out"
  [ "$code" -eq 1 ] || fail "the host run exited $code, not 1 (a step stopped): $(tail -3 "$DIR/deadline.err")"
  "$1" - "$out/gpu_check.json" <<'EOF' || fail "the deadline's results are not as they should be"
import json, sys
r = json.load(open(sys.argv[1]))
steps, setup = r["steps"], r["setup_s"]
assert r["finished"] is True and setup is not None and r["budget_s"] == 300 - setup - 30, (r["budget_s"], setup)
assert steps["default"]["status"] == "stopped" and "SIGTERM" in steps["default"]["reason"], steps["default"]
assert all(steps[s]["status"] == "skipped" for s in ("boundary", "train", "chunk_size")), steps
print(f"deadline: setup {setup:.0f} s, budget {r['budget_s']:.0f} s of 300; SIGTERM at {r['elapsed_s']:.0f} s stopped "
      f"the calibration in flight, kept, and the results finished")
EOF
  grep -q "^gpu_check.sh: one deadline, 300 s from now" "$DIR/deadline.out" || fail "no deadline line"
  [ -s "$out/gpu_check.log" ] || fail "no gpu_check.log"
}

if [ "${REHEARSAL_ONLY:-}" = deadline ]; then
  mkdir -p "$DIR"
  deadline "${PYTHON:-python3}"
  echo "rehearsal passed (the deadline part only)"
  exit 0
fi
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
[ "$code" -eq 4 ] || fail "scripts/gpu_check.sh exited $code, not 4 (no GPU)"
head -1 "$DIR/check.out" | grep -q "^gpu_check.sh: one deadline, 510 s from now" || fail "no deadline first"
grep -q "^preflight: packages ok (.*transformers 5\.2[3-9]\|^preflight: packages ok (.*transformers [6-9]\." "$DIR/check.out" \
  || fail "the preflight did not pass with the carried transformers (>=5.23)"
grep -q "transformers from $PWD/.gpu-site" "$DIR/check.out" || fail "transformers was not imported from .gpu-site"
[ "$(grep -cv '^preflight: warning' "$DIR/check.err")" -eq 1 ] || fail "expected one line on stderr"
grep -q "^no NVIDIA GPU visible (NVML: .*): the GPU check needs one$" "$DIR/check.err" || fail "no 'no GPU' line"
deadline "$V"
echo "rehearsal passed: environment $((built - started)) s, wheels + check $((finished - built)) s, deadline" \
     "$(($(date +%s) - finished)) s, total $(($(date +%s) - started)) s"
