#!/bin/bash
cd "$(dirname "$0")/../../.."
V=".venv/bin/python -m vramcal"
declare -A SPECS=(
  [small]="--d-model 64 --n-layers 2 --d-state 16 --headdim 16 --seq-len 64 --chunk-size 32"
  [default]=""
  [wide]="--d-model 256 --n-layers 4 --d-state 64 --headdim 64 --seq-len 128 --chunk-size 64"
)
declare -A CAP=([small]=1.5GiB [default]=2.5GiB [wide]=2GiB)
declare -A STRIDE=([small]=8 [default]=16 [wide]=16)
for s in small default wide; do
  d=/tmp/vramcal-forecast/$s; rm -rf $d; mkdir -p $d
  /usr/bin/time -f "$s probe wall %e s" $V probe --gpu none --capacity ${CAP[$s]} ${SPECS[$s]} --data data/es_1s.parquet --stride ${STRIDE[$s]} --profiles-dir $d/profiles --no-report > $d/probe.log 2>&1
  /usr/bin/time -f "$s train wall %e s" $V train --gpu none ${SPECS[$s]} --data data/es_1s.parquet --stride ${STRIDE[$s]} --profiles-dir $d/profiles --epochs 3 --run-dir $d/cons > $d/cons.log 2>&1
done
echo done
