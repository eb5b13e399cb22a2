#!/usr/bin/env bash
# The GPU suite alone, on the final code.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/call-out}
mkdir -p "$OUT"
. "$HERE/lib.sh"
cuda_libs
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%Y-%m-%dT%H:%M:%SZ; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout 240 "$HERE/gpu-tests" --test-threads 1 --nocapture > "$OUT/gpu-suite.log" 2>&1
rc=$?
grep -E "^test .*(ok|FAILED)|test result|unpinned|StagedModelLevel|planted staged-bring-in|panicked" "$OUT/gpu-suite.log" | cut -c1-260 | tail -40
echo "suite rc=$rc"
