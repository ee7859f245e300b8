#!/usr/bin/env bash
# Wheels for the fused Mamba-2 path (`--impl mamba_ssm`, issue 11 part 3) on the H200 image, which has
# Python 3.12 and torch 2.11 (CUDA 13) with triton, but no mamba-ssm or causal-conv1d, no network, and no
# promise of a working compiler (a build there would also cost device time). Built here from PyPI's sdists into wheels/, where scripts/gpu_check.sh installs every wheel with
# `pip install --no-deps --no-index --target .gpu-site`:
#   causal-conv1d  its CUDA extension compiled for one architecture (sm_90, the H200's) against the torch
#                  of $PYTHON (2.11, CUDA 13) with this machine's nvcc; the version carries a local tag
#                  (+cu130.torch211.sm90) because the .so binds to that torch's C++ ABI
#   mamba-ssm      without its Mamba-1 CUDA extension (MAMBA_SKIP_CUDA_BUILD): Python + Triton kernels
#   einops         a pure-Python import of mamba_ssm; the image's package list names it, the rehearsal venv
#                  lacks it: carried (64 kB) so that the fused path does not depend on it
# Usage: scripts/build_fused_wheels.sh [--force]    (make gpu-fused-wheels; --force rebuilds existing wheels)
# Settings (environment): PYTHON (default .rehearsal/venv/bin/python3, made by `make gpu-rehearsal`: it is
# the image's Python 3.12 + torch 2.11.0 from PyPI), CAUSAL_CONV1D_VERSION, MAMBA_SSM_VERSION, EINOPS_VERSION,
# FUSED_ARCH (compute capability without the dot, default 90), MAX_JOBS (default 2), FUSED_BUILD_DIR
# (sdists, build tools, sources, logs and a copy of each wheel, kept so that `make gpu-wheels`, which
# empties wheels/, costs a copy and not a rebuild; default ${TMPDIR:-/tmp}/vramcal-fused-build).
# Builds run under `nice -n 19`. Each prints its wall time and the peak resident memory of its process
# tree (sampled each second). Measured figures: scripts/FUSED_WHEELS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
CAUSAL_CONV1D_VERSION=${CAUSAL_CONV1D_VERSION:-1.7.0}
MAMBA_SSM_VERSION=${MAMBA_SSM_VERSION:-2.3.2.post1}
EINOPS_VERSION=${EINOPS_VERSION:-0.8.2}
FUSED_ARCH=${FUSED_ARCH:-90}
export MAX_JOBS=${MAX_JOBS:-2}
PY=${PYTHON:-.rehearsal/venv/bin/python3}
BUILD=${FUSED_BUILD_DIR:-${TMPDIR:-/tmp}/vramcal-fused-build}
FORCE=0
case "${1:-}" in
  "") ;;
  --force) FORCE=1 ;;
  *) echo "usage: scripts/build_fused_wheels.sh [--force]" >&2; exit 2 ;;
esac
fail() { echo "build_fused_wheels: $1" >&2; exit 1; }

# --- what it builds with ---------------------------------------------------------------------------------
[ -x "$PY" ] || fail "no Python at $PY: run \`make gpu-rehearsal\` (the image-like Python 3.12 + torch 2.11 venv) or set PYTHON"
# The toolkit: $CUDA_HOME, else where nvcc lies (/usr/local/bin/nvcc may be a wrapper script, and torch would
# then take /usr/local for the toolkit and miss its headers), else /usr/local/cuda.
for dir in "${CUDA_HOME:-}" "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")")" /usr/local/cuda; do
  if [ -n "$dir" ] && [ -x "$dir/bin/nvcc" ] && [ -e "$dir/include/cuda_runtime.h" ]; then export CUDA_HOME=$dir; break; fi
done
[ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ] \
  || fail "no CUDA toolkit (bin/nvcc and include/cuda_runtime.h) at \$CUDA_HOME, beside nvcc or at /usr/local/cuda: install CUDA 13's nvcc or set CUDA_HOME"
read -r py_version torch_version torch_cuda torch_include < <("$PY" -c '
import sys, torch, torch.utils.cpp_extension as e
print("%d.%d.%d" % sys.version_info[:3], torch.__version__, torch.version.cuda, e.include_paths()[0])') \
  || fail "$PY cannot import torch: run \`make gpu-rehearsal\` or set PYTHON to a Python with torch 2.11"
nvcc_version=$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
case "$py_version" in 3.12.*) ;; *) fail "$PY is Python $py_version; the H200 image's is 3.12" ;; esac
case "$torch_version" in 2.11.*) ;; *) fail "$PY has torch $torch_version; the H200 image's is 2.11 (the .so binds to it)" ;; esac
[ "${torch_cuda%%.*}" = "${nvcc_version%%.*}" ] \
  || fail "torch was built with CUDA $torch_cuda but nvcc is $nvcc_version: the major versions must match"
[ -e "$torch_include/ATen/ATen.h" ] || fail "torch's C++ headers are missing under $torch_include"
# The system toolkit may hold only nvcc and the runtime; torch's CUDA headers (cublas_v2.h, cusparse.h,
# included by ATen/cuda) then come from the pip-installed nvidia packages beside torch.
nvidia_include=$("$PY" -c 'import pathlib, torch; print(pathlib.Path(torch.__file__).parent.parent / "nvidia" / "cu13" / "include")')
if [ -e "$nvidia_include/cublas_v2.h" ]; then export CPATH="$nvidia_include${CPATH:+:$CPATH}"; fi
local_tag="cu${torch_cuda//./}.torch$(echo "$torch_version" | cut -d. -f1,2 | tr -d .).sm$FUSED_ARCH"
echo "building with: Python $py_version ($PY), torch $torch_version (CUDA $torch_cuda), nvcc $nvcc_version ($CUDA_HOME)," \
     "$(gcc --version | head -1), arch sm_$FUSED_ARCH, MAX_JOBS=$MAX_JOBS, nice 19, build dir $BUILD"

# --- helpers -----------------------------------------------------------------------------------------------
mkdir -p wheels "$BUILD"/{sdist,src,dist,logs}
# measured LOG CMD...: run CMD under nice in its own session, log to LOG; print wall time and peak RSS.
measured() {
  local log=$1; shift
  local started peak_kib=0 rss code
  started=$(date +%s)
  setsid nice -n 19 "$@" >"$log" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    rss=$(ps -o rss= -s "$pid" 2>/dev/null | awk '{s += $1} END {print s + 0}')
    [ "$rss" -gt "$peak_kib" ] && peak_kib=$rss
    sleep 1
  done
  wait "$pid" && code=0 || code=$?
  echo "  wall $(( $(date +%s) - started )) s, peak RSS of the build's processes $(( peak_kib / 1024 )) MiB (log: $log)"
  [ "$code" -eq 0 ] || { tail -n 30 "$log" >&2; fail "build failed (exit $code); full log: $log"; }
}
# present NAME GLOB: is a wheel there already? (wheels/, else the build dir's copy, put back)
present() {
  local name=$1 glob=$2 found
  [ "$FORCE" -eq 1 ] && return 1
  if compgen -G "wheels/$glob" >/dev/null; then echo "$name: present, skipped ($(ls wheels/$glob))"; return 0; fi
  if found=$(compgen -G "$BUILD/dist/$glob" | head -1); then
    cp "$found" wheels/ && echo "$name: copied from the build dir ($found)"; return 0
  fi
  return 1
}
tools() {  # setuptools (< 82, as torch 2.11 requires), wheel, ninja: outside the venv, which stays image-like
  if [ ! -e "$BUILD/tools/.ok" ]; then
    "$PY" -m pip install --quiet --disable-pip-version-check --target "$BUILD/tools" "setuptools>=61,<82" wheel ninja
    touch "$BUILD/tools/.ok"
  fi
  export PYTHONPATH="$BUILD/tools${PYTHONPATH:+:$PYTHONPATH}" PATH="$BUILD/tools/bin:$PATH"
}
sdist() {  # sdist NAME VERSION DIRNAME -> unpacked fresh into $BUILD/src/DIRNAME
  local file="$BUILD/sdist/$3.tar.gz"
  if [ ! -e "$file" ]; then
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: --no-build-isolation \
      -d "$BUILD/sdist" "$1==$2"
  fi
  [ -e "$file" ] || fail "pip did not download $file"
  rm -rf "$BUILD/src/$3" && tar -xzf "$file" -C "$BUILD/src"
}

# --- causal-conv1d: the compiled extension --------------------------------------------------------------
cc_glob="causal_conv1d-$CAUSAL_CONV1D_VERSION+$local_tag-cp312-cp312-linux_x86_64.whl"
if ! present causal-conv1d "$cc_glob"; then
  tools
  sdist causal-conv1d "$CAUSAL_CONV1D_VERSION" "causal_conv1d-$CAUSAL_CONV1D_VERSION"
  src="$BUILD/src/causal_conv1d-$CAUSAL_CONV1D_VERSION"
  # Its setup.py passes -gencode for nine architectures (sm_75 ... sm_121), which overrides
  # TORCH_CUDA_ARCH_LIST; keep the one the H200 runs (nine would take about nine times as long).
  "$PY" - "$src/setup.py" "$FUSED_ARCH" <<'EOF'
import sys
path, arch = sys.argv[1], sys.argv[2]
text = open(path).read()
anchor = "    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI"
if text.count(anchor) != 1:
    sys.exit(f"build_fused_wheels: {path} changed (no single {anchor.strip()!r} line): update the patch")
patch = f'    cc_flag = ["-gencode", "arch=compute_{arch},code=sm_{arch}"]  # vramcal: one architecture\n'
open(path, "w").write(text.replace(anchor, patch + anchor))
EOF
  echo "causal-conv1d $CAUSAL_CONV1D_VERSION: compiling for sm_$FUSED_ARCH ..."
  # CFLAGS=-g0: no host debug information in the .so (about 3 MB less in the wheel; the carry limit is 64 MiB).
  measured "$BUILD/logs/causal_conv1d.log" env CAUSAL_CONV1D_FORCE_BUILD=TRUE CAUSAL_CONV1D_LOCAL_VERSION="$local_tag" \
    TORCH_CUDA_ARCH_LIST="${FUSED_ARCH:0:-1}.${FUSED_ARCH: -1}" CFLAGS="${CFLAGS:+$CFLAGS }-g0" \
    "$PY" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps -v -w "$BUILD/dist" "$src"
  compgen -G "$BUILD/dist/$cc_glob" >/dev/null || fail "no $cc_glob in $BUILD/dist after the build"
  cp "$BUILD"/dist/$cc_glob wheels/
fi

# --- mamba-ssm: Python + Triton, no Mamba-1 extension -------------------------------------------------------
ms_glob="mamba_ssm-$MAMBA_SSM_VERSION-*.whl"
if ! present mamba-ssm "$ms_glob"; then
  tools
  sdist mamba-ssm "$MAMBA_SSM_VERSION" "mamba_ssm-$MAMBA_SSM_VERSION"
  echo "mamba-ssm $MAMBA_SSM_VERSION: packaging without its CUDA extension ..."
  measured "$BUILD/logs/mamba_ssm.log" env MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE \
    "$PY" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps -v -w "$BUILD/dist" \
    "$BUILD/src/mamba_ssm-$MAMBA_SSM_VERSION"
  compgen -G "$BUILD/dist/$ms_glob" >/dev/null || fail "no $ms_glob in $BUILD/dist after the build"
  cp "$BUILD"/dist/$ms_glob wheels/
fi

# --- einops: imported by mamba_ssm, not on the image ---------------------------------------------------------
if ! present einops "einops-$EINOPS_VERSION-py3-none-any.whl"; then
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -d "$BUILD/dist" \
    "einops==$EINOPS_VERSION"
  cp "$BUILD/dist/einops-$EINOPS_VERSION-py3-none-any.whl" wheels/ && echo "einops $EINOPS_VERSION: downloaded"
fi

echo "fused wheels in wheels/ (all carried wheels: $(du -ch wheels/*.whl | tail -1 | cut -f1)):"
ls -l wheels/causal_conv1d-*.whl wheels/mamba_ssm-*.whl wheels/einops-*.whl | awk '{printf "  %9d  %s\n", $5, $9}'
