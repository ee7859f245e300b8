#!/bin/bash
# The run forecast against the trainer on three specs (issue 22): calibrate, train 3 epochs at the conservative
# size, then 3 epochs sized for throughput (the knee). Logs beside this file; profiles and runs in $WORK.
cd "$(dirname "$0")/../../.."
V=".venv/bin/python -m vramcal"
OUT=bench/results/forecast-256k
WORK=${WORK:-/tmp/vramcal-forecast}
declare -A SPECS=(
  [small]="--d-model 64 --n-layers 2 --d-state 16 --headdim 16 --seq-len 64 --chunk-size 32"
  [default]=""
  [wide]="--d-model 256 --n-layers 4 --d-state 64 --headdim 64 --seq-len 128 --chunk-size 64"
)
declare -A CAP=([small]=1.5GiB [default]=2.5GiB [wide]=2GiB)
declare -A STRIDE=([small]=8 [default]=16 [wide]=16)
for s in ${ONLY:-small default wide}; do
  d=$WORK/$s; rm -rf $d; mkdir -p $d
  common="--gpu none ${SPECS[$s]} --data data/es_1s.parquet --stride ${STRIDE[$s]} --profiles-dir $d/profiles"
  /usr/bin/time -f "$s probe wall %e s" $V probe --capacity ${CAP[$s]} $common --no-report > $OUT/$s-probe.log 2>&1
  /usr/bin/time -f "$s train wall %e s" $V train $common --epochs 3 --run-dir $d/cons > $OUT/$s-train.log 2>&1
  /usr/bin/time -f "$s knee wall %e s" $V train $common --epochs 3 --size-for throughput --run-dir $d/knee \
    > $OUT/$s-knee.log 2>&1
done
echo done
