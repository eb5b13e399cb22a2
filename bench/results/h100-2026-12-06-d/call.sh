#!/usr/bin/env bash
# Call C (2026-12-06, tenth session): the GPU suite at today's main, then the
# candle Flux.1-dev DiT at the crossover in steady state (3 untimed steps,
# 7 timed), and the request planner's 16 / 8 GiB at 4,608.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
C="$R/.candle"
O=${OUT:-/tmp/outC}
mkdir -p "$O"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$O/env.txt"
date -u +%FT%TZ | tee -a "$O/env.txt"
export WORK=/tmp/flux-work
G="72x128 76x128 78x128 80x128 84x128 92x128"
OUT="$O/p1" GRIDS="64x64 $G" NO_PEER=1 GROWTH=0 BUDGETS=16GiB,8GiB DEPTH=16 WARMUP=3 STEPS=7 \
  CHECK_TOKENS=0 ABLATION=false BUDGET_S=300 bash "$C/run-candle.sh" >"$O/p1.txt" 2>"$O/p1.err"
echo "pass 1 rc $?"
if [ -n "${SUITE:-}" ]; then
echo "== GPU suite ($(date +%T))"
t0=$(date +%s)
timeout 120 "$R/.bundle/gpu-tests" --test-threads 1 >"$O/gpu-suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^test result|FAILED|panicked" "$O/gpu-suite.log" | head -8
gzip -f "$O/gpu-suite.log"
fi
tar czf "$O/candle.tgz" -C "$O" p1 p1.txt p1.err && rm -rf "$O/p1" "$O"/p1.*
tar xzf "$O/candle.tgz" -O p1.txt | grep -A9 "^| tokens | depth"
tar xzf "$O/candle.tgz" -O p1.txt | grep -A4 "^| budget"
tar xzf "$O/candle.tgz" -O p1.txt | grep "planted skip-exit:\|RESULT" | tail -2
