#!/usr/bin/env bash
# Call S12: the whole GPU suite on the final code of 2026-12-03.
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
grep -E "^test |test result|planted .*caught|skip" "$OUT/gpu-suite.log" | cut -c1-220 | tail -40
