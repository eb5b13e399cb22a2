#!/usr/bin/env bash
# Fifth session, last call: the GPU suite on the final code.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/call-out}
mkdir -p "$OUT"
. "$HERE/lib.sh"
cuda_libs
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%Y-%m-%dT%H:%M:%SZ; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
start=$(date +%s)
timeout 300 "$HERE/gpu-tests" --test-threads 1 --nocapture > "$OUT/gpu-suite.log" 2>&1
echo "suite rc=$? in $(( $(date +%s) - start )) s"
grep -E "^test .*(ok|FAILED)|test result|pool chunk|unpinned at the pinned least|panicked|page-locked peak" "$OUT/gpu-suite.log" | cut -c1-240 | tail -40
