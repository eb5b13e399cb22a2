#!/usr/bin/env bash
# Call Q1 (2026-12-08, twenty-fifth session; built at the commit in
# .bundle/BUILD): the whole GPU suite, then issue 21's three host-budget
# rows in one process (bench/run-staged.sh: fully pinned, an 8 GiB host
# budget and every master staged, over the loaded weights and from a
# 23.7 GB masters file, page cache dropped before each enable), 4,608
# tokens, depth 2, 5 timed steps, 2 repeats; then the same budgets with
# weight_compression = "lossless" (coded masters, one repeat).
set -u
R=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$R"
O=${OUT:-/tmp/outQ1}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; nvidia-smi -q | grep -i addressing; date -u +%FT%TZ; cat .bundle/BUILD; nproc; lscpu | grep -E 'Model name|L3|NUMA node\(s\)'; grep -E 'MemTotal|MemAvailable' /proc/meminfo; uname -r; head -1 /proc/driver/nvidia/version 2>/dev/null; } | tee "$O/env.txt"
t0=$(date +%s)
timeout ${SUITE_S:-150} .bundle/gpu-tests --test-threads 1 >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"; grep -E "test result|FAILED|panicked" "$O/suite.log" | head -6 | cut -c1-300
t0=$(date +%s)
OUT="$O/staged" STEPS=${STEPS:-5} REPEATS=${REPEATS:-2} MASTERS_FILE=/tmp/offload-masters.bin \
  timeout ${STAGED_S:-240} bash bench/run-staged.sh .bundle >"$O/staged-call.txt" 2>&1
echo "staged rc $? in $(( $(date +%s) - t0 )) s"
rm -f /tmp/offload-masters.bin
t0=$(date +%s)
OUT="$O/lossless" STEPS=3 REPEATS=1 COMPRESSION=lossless CODED_BLOCKS=/tmp/offload.opackb \
  timeout ${LOSSLESS_S:-170} bash bench/run-staged.sh .bundle >"$O/lossless-call.txt" 2>&1
echo "lossless rc $? in $(( $(date +%s) - t0 )) s"
rm -f /tmp/offload.opackb
gzip -f "$O"/suite.log "$O"/*/*.json 2>/dev/null
for d in staged lossless; do
  [ -f "$O/$d/staged.log" ] || continue
  echo "== $d"; grep -E "GB/s|masters file|coded" "$O/$d/staged.err" | head -6 | cut -c1-220
  tail -2 "$O/$d/staged.err" | cut -c1-300
  sed -n '/^Staged masters/,$p' "$O/$d/staged.log" | cut -c1-240 | head -18
done
echo "total $(( $(date +%s) - T0 )) s"
