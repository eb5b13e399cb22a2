#!/usr/bin/env bash
# Call P3 (2026-12-07, twenty-fourth session; built as .bundle/BUILD says):
# the in-place read kernel (pageable.ptx) on the GPU at every alignment,
# over pinned memory (and pageable where the GPU reads it), clean, then
# with its shift planted wrong (gpu-tests-planted: must fail).
set -u
R=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$R"
O=${OUT:-/tmp/outP3}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvidia-smi -q | grep -i addressing; date -u +%FT%TZ; cat .bundle/BUILD; } | tee "$O/env.txt"
for b in gpu-tests gpu-tests-planted; do
  timeout 120 .bundle/$b in_place_reads --test-threads 1 --nocapture >"$O/$b.log" 2>&1
  echo "$b rc $?"; grep -E "^test |test result|skipping|in-place read kernel|panicked|pinned: len" "$O/$b.log" | head -5 | cut -c1-260
done
