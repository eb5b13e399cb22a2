#!/usr/bin/env bash
# Call S16: the whole GPU suite on the session's final code (refused pins
# restaged within a host budget; staged fills priced at the measured rate).
set -u
B=$(cd "$(dirname "$0")" && pwd)
cd "$B"
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%Y-%m-%dT%H:%M:%SZ; } | tee "$OUT/machine.txt"
. ./lib.sh; cuda_libs
GT=$(ls ./gpu-* | head -1)
start=$(date +%s)
timeout 420 "$GT" --test-threads 1 --nocapture > "$OUT/gpu-suite.log" 2>&1
echo "gpu suite rc=$? in $(( $(date +%s) - start )) s"
grep -E "^test |test result|planted .*caught|page-locked peak|panicked" "$OUT/gpu-suite.log" | cut -c1-300 | tail -45
