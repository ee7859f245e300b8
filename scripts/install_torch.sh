#!/usr/bin/env bash
# Install torch into a venv (the Makefile's setup): usage  scripts/install_torch.sh PYTHON VERSION
#
# With an NVIDIA GPU (nvidia-smi on PATH): PyPI's torch, the CUDA build, unless one is already installed.
# Without one, the CPU build of torch==VERSION, from the first of:
#   1. a wheel on this machine only (pip's find-links; no index asked): nothing downloaded;
#   2. PyTorch's own CPU wheel index (https://download.pytorch.org/whl/cpu; PyPI for torch's dependencies):
#      about 180 MB for torch, for every Python torch has wheels for;
#   3. PyPI, after one line saying so, when that index cannot be reached: on Linux x86-64 PyPI's torch is the
#      CUDA build (about 900 MB of torch plus several GB of NVIDIA libraries), which runs on the CPU as well.
set -euo pipefail
python=$1 version=$2
cpu_index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
pip=("$python" -m pip install --quiet --disable-pip-version-check)

if command -v nvidia-smi >/dev/null 2>&1; then
  exec "${pip[@]}" torch
fi
# torch alone from the first source that has it; then its dependencies (and, after the line, torch itself) from
# the usual index, torch already satisfied.
if ! "${pip[@]}" --no-deps --no-index "torch==$version" 2>/dev/null \
    && ! "${pip[@]}" --no-deps --retries 0 --timeout 20 --index-url "$cpu_index" "torch==$version" 2>/dev/null; then
  echo "install: PyTorch's CPU wheel index ($cpu_index) could not be reached or has no torch $version for" \
    "$("$python" -c 'import platform; print("Python", platform.python_version())'): installing torch==$version" \
    "from PyPI, on Linux the CUDA build (several GB; it runs on the CPU too)" >&2
fi
exec "${pip[@]}" "torch==$version"
