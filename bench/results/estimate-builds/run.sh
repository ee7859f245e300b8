#!/usr/bin/env bash
# The host estimate against a real calibration under one torch build (issue 62's "Done when"):
#   bench/results/estimate-builds/run.sh VENV CAPACITY OUTDIR
# e.g. run.sh .venv 1.5GiB bench/results/estimate-builds/cpu ; run.sh .venv-python3.12 2GiB .../cu130
# Two small host calibrations to learn from (OUTDIR/learn), then the held-out model (the benchmark's `small`
# spec, neither of the two): its estimate first (JSON), then its own verified calibration (OUTDIR/heldout), then the
# estimate at the measured safe size, then one real trial at the estimate's own safe size.
set -euo pipefail
venv=$1 capacity=$2 out=$3
py="$venv/bin/python"
mkdir -p "$out"
common=(--gpu none --capacity "$capacity" --no-report --no-boundary --steady-steps 0)
tiny=(--d-state 16 --headdim 16 --chunk-size 16 --seq-len 32)
learn() { echo "== learn $*" >&2; "$py" -m vramcal probe "${common[@]}" "$@" --profiles-dir "$out/learn"; }
learn "${tiny[@]}" --d-model 64 --n-layers 1
learn "${tiny[@]}" --d-model 32 --n-layers 2
held=(--d-model 64 --n-layers 2 --d-state 16 --headdim 16 --seq-len 64 --chunk-size 32)
"$py" -m vramcal estimate "${held[@]}" --gpus H200 --capacity "$capacity" --profiles-dir "$out/learn" \
    | tee "$out/estimate.txt"
"$py" -m vramcal estimate "${held[@]}" --gpus H200 --capacity "$capacity" --profiles-dir "$out/learn" --json \
    > "$out/estimate.json"
echo "== held-out calibration" >&2
"$py" -m vramcal probe "${common[@]}" "${held[@]}" --profiles-dir "$out/heldout"
safe=$("$py" -c 'import glob,sys; from vramcal.profile import load_profile
(p,) = glob.glob(sys.argv[1] + "/heldout/*/*.json"); print(load_profile(p).verification["safe"].batch_size)' "$out")
"$py" -m vramcal estimate "${held[@]}" --gpus H200 --capacity "$capacity" --profiles-dir "$out/learn" \
    --batch-size "$safe" --json > "$out/estimate-at-measured-safe.json"
echo "== one real trial at the estimate's safe size" >&2
"$py" bench/results/estimate-builds/trial.py "$out" "$capacity" | tee "$out/trial-at-estimated-safe.json"
