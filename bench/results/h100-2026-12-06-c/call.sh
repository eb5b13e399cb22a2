#!/usr/bin/env bash
# Call B (2026-12-06, tenth session): the candle Flux.1-dev DiT (FlashAttention-2,
# cuBLASLt) at the crossover: layerwise at depth 16 against candle resident at
# 9,728-12,288 tokens, and the request planner's 16 / 8 GiB at 4,608.
set -u
C=$(cd "$(dirname "$0")/../.candle" && pwd)
O=${OUT:-/tmp/outB}
mkdir -p "$O"
export OUT="$O/candle" WORK=/tmp/flux-work
mkdir -p "$OUT"
# 4,608 first (its budgets), then the crossover grids (512 text tokens + rows x cols).
GRIDS="64x64 72x128 76x128 78x128 80x128 84x128 92x128" NO_PEER=1 GROWTH=0 BUDGETS=16GiB,8GiB \
  DEPTH=16 CHECK_TOKENS=0 ABLATION=false STEPS=5 BUDGET_S=390 \
  bash "$C/run-candle.sh" >"$O/candle.txt" 2>"$O/candle.err"
echo "run-candle rc $?"
tar czf "$O/candle.tgz" -C "$O" candle && rm -rf "$O/candle"
# The proxy DiT at the same counts on the same card (its materialized attention).
cd "$(dirname "$0")/.."
mkdir -p "$O/cross"
OUT="$O/cross" TOKENS=9728,10240,10752,11264 REPEATS=2 BUDGET_S=140 SWEEP_S=135 \
  timeout 150 bench/run-crossover.sh .bundle/offload-bench >"$O/cross/table.txt" 2>&1
echo "cross rc $?"
tar czf "$O/cross.tgz" -C "$O" cross && rm -rf "$O/cross"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
grep -A12 "^| tokens | depth" "$O/candle.txt"
grep -B1 -A6 "^| budget" "$O/candle.txt"
grep "planted\|RESULT" "$O/candle.txt"
tar xzf "$O/cross.tgz" -O cross/table.txt | tail -9
