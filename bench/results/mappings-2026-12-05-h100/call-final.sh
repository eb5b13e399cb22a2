#!/usr/bin/env bash
# The GPU suite on the final code, then 8 GiB none/lossless/auto, 2 steps.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/call-out}
mkdir -p "$OUT"
OUT=$OUT SUITE=1 SUITE_S=220 BUDGETS=8GiB STEPS=2 REQUESTS=1 LATE_MIN_S=100000 BUDGET_S=420 \
  bash "$HERE/run-planned-compressed.sh" "$HERE/offload-bench" > "$OUT/call.log" 2>&1
rc=$?
grep -E "^test .*(ok|FAILED)|test result|unpinned|planted staged-bring-in" "$OUT/gpu-suite.log" | cut -c1-250 | tail -30
python3 "$HERE/diag2.py" "$OUT" | grep -v "INFO\|^    ==" || true
grep -h "of mappings it counted" "$OUT"/planned-*.err | cut -c1-200
tail -8 "$OUT/call.log" | cut -c1-400
echo "call rc=$rc"
