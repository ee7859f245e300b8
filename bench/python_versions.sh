#!/usr/bin/env bash
# Every Python the package declares (issue 9): for each version, a fresh venv with vramcal installed
# (`pip install -e '.[dev]'`), the test suite (`pytest -q`), and one host calibration of the benchmark's
# small spec on the host; then bench/python_versions.py compares the calibrations: each version's safe size,
# and whether its verification peak lies inside the other versions' 95 % prediction intervals.
#
# Usage: bench/python_versions.sh [VERSION ...]          (default: 3.11 3.12 3.13)
#   PYV_DIR     where the venvs live (default: ~/.cache/vramcal-pyvenvs; outside the repository)
#   PYV_TORCH   the torch requirement (default: torch==2.13.0)
#   PYV_TORCH_FROM  pypi (default): PyPI's build for every version, so all run the same torch build (its
#               CUDA 13 build: download.pytorch.org, the CPU builds' index, is unreachable here; it runs on a
#               CPU but pulls ~3 GB of nvidia-* wheels on a first install); local: pip's configuration
#               (3.11 then takes the CPU wheel in /opt/wheels, 3.12/3.13 still PyPI's CUDA build)
#   PYV_BUDGET  the host budget of the calibration (default 2GiB: with the CUDA build a trial of one sample
#               holds ~1 GiB of data segment, more than 1.5 GiB leaves usable)
#   PYV_TESTS   the versions whose test suite runs (default: all given; "none": calibrations only)
# Results: bench/results/python-versions.{md,json}; logs in $PYV_DIR/<version>/*.log.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DIR=${PYV_DIR:-$HOME/.cache/vramcal-pyvenvs}
TORCH=${PYV_TORCH:-torch==2.13.0}
TORCH_FROM=${PYV_TORCH_FROM:-pypi}
BUDGET=${PYV_BUDGET:-2GiB}
case "$TORCH_FROM" in
  pypi) TORCH_PIP=(--isolated --index-url https://pypi.org/simple) ;;
  local) TORCH_PIP=() ;;
  *) echo "python_versions: PYV_TORCH_FROM must be pypi or local, got $TORCH_FROM" >&2; exit 2 ;;
esac
DATA=${PYV_DATA:-data/es_1s.parquet}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(3.11 3.12 3.13)
SPEC=(--d-model 64 --n-layers 2 --d-state 16 --headdim 16 --seq-len 64 --chunk-size 32)
mkdir -p "$DIR"
fail() { echo "python_versions: $1" >&2; exit 1; }
[ -e "$DATA" ] || fail "no $DATA: build it with \`.venv/bin/python -m vramcal data es-sample\`"
summary=()
for version in "${VERSIONS[@]}"; do
  full=$(pyenv versions --bare 2>/dev/null | grep -E "^${version//./\\.}\.[0-9]+$" | sort -V | tail -1 || true)
  [ -n "$full" ] || fail "Python $version is not installed through pyenv (\`pyenv versions\` lists what is)"
  python=$(PYENV_VERSION=$full pyenv which "python$version")
  venv=$DIR/$version
  log=$venv/logs
  started=$(date +%s)
  stamp="$venv/.installed-$(echo "$full $TORCH $TORCH_FROM" | sha1sum | cut -c1-12)"
  if [ ! -e "$stamp" ]; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    mkdir -p "$log"
    "$venv/bin/python" -m pip install --quiet --upgrade pip >"$log/install.log" 2>&1
    "$venv/bin/python" -m pip install --quiet "${TORCH_PIP[@]}" "$TORCH" >>"$log/install.log" 2>&1 \
      || fail "Python $version: \`pip install $TORCH\` failed (see $log/install.log)"
    "$venv/bin/python" -m pip install --quiet --no-deps mlfinpy==0.1.2 >>"$log/install.log" 2>&1 || true  # as make setup
    touch "$stamp"
  fi
  mkdir -p "$log"
  # vramcal itself on every run (the tree may have changed since the venv was made)
  "$venv/bin/python" -m pip install --quiet -e '.[dev]' >>"$log/install.log" 2>&1 \
    || fail "Python $version: \`pip install -e '.[dev]'\` failed (see $log/install.log)"
  installed=$(date +%s)
  tests=skipped
  if [ -z "${PYV_TESTS:-}" ] || [[ " $PYV_TESTS " == *" $version "* ]]; then
    if "$venv/bin/python" -m pytest -q -p no:cacheprovider >"$log/pytest.log" 2>&1; then tests=passed; else tests=failed; fi
  fi
  tested=$(date +%s)
  profile=$venv/small-$BUDGET.json
  rm -f "$profile"
  set +e
  "$venv/bin/python" -m vramcal probe --gpu none --capacity "$BUDGET" "${SPEC[@]}" --data "$DATA" --stride 1 \
    --out "$profile" --no-report >"$log/probe.log" 2>&1
  probe_code=$?
  set -e
  finished=$(date +%s)
  torch_version=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
  echo "Python $full (torch $torch_version): install $((installed - started)) s, pytest $tests $((tested - installed)) s," \
       "probe exit $probe_code $((finished - tested)) s"
  summary+=("$version=$full,$torch_version,$tests,$((tested - installed)),$probe_code,$((finished - tested)),$((installed - started)),$profile,$log")
done
.venv/bin/python -m bench.python_versions --budget "$BUDGET" "${summary[@]}"
