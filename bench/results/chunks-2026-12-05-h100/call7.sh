#!/usr/bin/env bash
# Fifth session on an H200: the pool probe and whole requests at 28 steps
# (16 and 8 GiB, none/lossless/auto), final code.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
FINAL=${OUT:-/tmp/call-out}
W=/tmp/w; mkdir -p "$W" "$FINAL"
. "$HERE/lib.sh"
cuda_libs
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%Y-%m-%dT%H:%M:%SZ; } > "$W/machine.txt" 2>&1
cat "$W/machine.txt"
start=$(date +%s)
PYTHONUNBUFFERED=1 timeout 60 python3 bench/pool_probe.py > "$W/pool_probe.log" 2>&1; echo "probe rc=$?"
grep -E '^\+a1|^\+double|^\+act5|^cuMemHost' "$W/pool_probe.log" | head -12
OUT=$W/req SUITE=0 BUDGETS=16GiB,8GiB REQUESTS=1 LATE_MIN_S=100000 BUDGET_S=420 \
  bash "$HERE/run-planned-compressed.sh" "$HERE/offload-bench" > "$W/call.log" 2>&1
echo "requests rc=$? at $(( $(date +%s) - start )) s"
python3 "$HERE/diag3.py" "$W" | grep -v INFO || true
tail -14 "$W/call.log" | cut -c1-400
gzip -9 -f "$W"/req/*.json 2>/dev/null
tar czf "$FINAL/results.tgz" -C "$W" .
