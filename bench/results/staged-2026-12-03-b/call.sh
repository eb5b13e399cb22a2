#!/usr/bin/env bash
# Call S13: the whole GPU suite (with the planned host-budget test) and the
# staged rows at other token counts (streaming-store fills).
set -u
B=$(cd "$(dirname "$0")" && pwd)
cd "$B"
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%Y-%m-%dT%H:%M:%SZ; } | tee "$OUT/machine.txt"
. ./lib.sh; cuda_libs
GT=$(ls ./gpu-* | head -1)
start=$(date +%s)
timeout 300 "$GT" --test-threads 1 --nocapture > "$OUT/gpu-suite.log" 2>&1
echo "gpu suite rc=$? in $(( $(date +%s) - start )) s"
grep -E "^test |test result|planted .*caught|page-locked peak|skip" "$OUT/gpu-suite.log" | cut -c1-240 | tail -45
mkdir -p "$OUT/tok"
start=$(date +%s)
OUT=$OUT/tok TOKENS=1024,8192,16896 DEPTHS=2 HOST_BUDGETS=8GiB,unpinned REPEATS=2 \
  timeout 330 ./run-staged.sh "$B" > "$OUT/tok-call.log" 2>&1
echo "token sweep rc=$? in $(( $(date +%s) - start )) s"
grep -E "^Staged masters|^\| layerwise" "$OUT/tok-call.log" | cut -d'|' -f2,3,7,8,9,10,11,14
