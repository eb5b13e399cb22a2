#!/usr/bin/env bash
# One device call: the GPU suite, then whole Flux requests under 16 and 8 GiB
# with none/lossless/auto (2 steps, 1 request) for the outside-the-pool
# diagnostic; a short table last.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/call-out}
mkdir -p "$OUT"
OUT=$OUT SUITE=1 SUITE_S=220 BUDGETS=16GiB,8GiB STEPS=2 REQUESTS=1 LATE_MIN_S=100000 BUDGET_S=470 \
  bash "$HERE/run-planned-compressed.sh" "$HERE/offload-bench" > "$OUT/call.log" 2>&1
rc=$?
grep -E "^test .*(ok|FAILED)|test result|planted .*caught|page-locked peak|perturbed" "$OUT/gpu-suite.log" | cut -c1-300 | tail -40
python3 "$HERE/diag2.py" "$OUT" || true
tail -25 "$OUT/call.log" | cut -c1-400
echo "call rc=$rc"
