#!/usr/bin/env bash
# Whole Flux requests, 4,608 tokens x 28 steps, 2 requests, 16 and 8 GiB,
# none/lossless/auto, after the mapping fix; the outside-the-pool table last.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/call-out}
mkdir -p "$OUT"
OUT=$OUT SUITE=0 BUDGETS=16GiB,8GiB REQUESTS=2 LATE_MIN_S=100000 BUDGET_S=560 \
  bash "$HERE/run-planned-compressed.sh" "$HERE/offload-bench" > "$OUT/call.log" 2>&1
rc=$?
python3 "$HERE/diag2.py" "$OUT" | grep -v "INFO" || true
tail -16 "$OUT/call.log" | cut -c1-600
echo "call rc=$rc"
