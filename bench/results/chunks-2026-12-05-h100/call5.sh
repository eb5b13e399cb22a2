#!/usr/bin/env bash
# Fifth session: the pool probe, the GPU suite, whole requests at 28 steps
# (16 and 8 GiB, none/lossless/auto), and the planted old slack at 8 GiB.
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
timeout 150 "$HERE/gpu-tests" --test-threads 1 --nocapture > "$W/gpu-suite.log" 2>&1
echo "suite rc=$? at $(( $(date +%s) - start )) s"
grep -E "^test .*(ok|FAILED)|test result|pool chunk|panicked" "$W/gpu-suite.log" | cut -c1-200 | tail -30
OUT=$W/req SUITE=0 BUDGETS=16GiB,8GiB REQUESTS=1 LATE_MIN_S=100000 BUDGET_S=330 \
  bash "$HERE/run-planned-compressed.sh" "$HERE/offload-bench" > "$W/call.log" 2>&1
echo "requests rc=$? at $(( $(date +%s) - start )) s"
left=$(( 555 - ($(date +%s) - start) ))
if [ -f /tmp/offload-flux-pipeline.opackb ] && [ $left -gt 40 ]; then
  timeout $left "$HERE/offload-bench-planted" --pipeline --budgets 8GiB --tokens 4608 --requests 1 \
    --saved-from none --weight-compression lossless --coded-blocks /tmp/offload-flux-pipeline.opackb \
    --plant slack-sampled-not-chunked --json "$W/planted-slack.json" > "$W/planted-slack.log" 2> "$W/planted-slack.err"
  echo "planted rc=$? at $(( $(date +%s) - start )) s"
fi
python3 "$HERE/diag3.py" "$W" | grep -v INFO || true
tail -14 "$W/call.log" | cut -c1-400
gzip -9 -f "$W"/req/*.json "$W"/*.json 2>/dev/null
tar czf "$FINAL/results.tgz" -C "$W" .
cp "$W/machine.txt" "$W/pool_probe.log" "$FINAL/"
