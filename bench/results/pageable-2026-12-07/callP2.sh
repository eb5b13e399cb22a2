#!/usr/bin/env bash
# Call P2 (2026-12-07, twenty-fourth session; built at the commit in
# .bundle/BUILD): does the lent GPU read pageable memory
# (bench/pageable_probe.py); the GPU suite's in-place read test; issue
# 21's three host-budget rows (bench/run-staged.sh: 8 GiB and every
# master staged, over the loaded weights and from a masters file larger
# than the budget, page cache dropped), 4,608 tokens, depth 2; then, where
# the probe saw pageable memory access, the same file rows with
# staged_reads = "in_place" (the GPU reads the mapping where it lies).
set -u
R=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$R"
O=${OUT:-/tmp/outP2}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; nvidia-smi -q | grep -i addressing; date -u +%FT%TZ; cat .bundle/BUILD; nproc; lscpu | grep -E 'Model name|L3|NUMA node\(s\)'; grep -E 'MemTotal|MemAvailable' /proc/meminfo; uname -r; head -1 /proc/driver/nvidia/version 2>/dev/null; } | tee "$O/env.txt"
t0=$(date +%s)
timeout ${PROBE_S:-150} python3 bench/pageable_probe.py --dir ${PROBE_DIR:-/tmp} --file-blocks ${PROBE_BLOCKS:-8} >"$O/probe.log" 2>&1
echo "probe rc $? in $(( $(date +%s) - t0 )) s"
grep -m1 '"attributes"' "$O/probe.log" | cut -c1-400
timeout ${SUITE_S:-60} .bundle/gpu-tests in_place_reads --test-threads 1 --nocapture >"$O/suite.log" 2>&1
echo "suite rc $?"; grep -E "^test |test result|skipping|in-place reads|panicked" "$O/suite.log" | head -6 | cut -c1-300
t0=$(date +%s)
OUT="$O/staged" STEPS=${STEPS:-5} REPEATS=${REPEATS:-1} MASTERS_FILE=/tmp/offload-masters.bin \
  timeout ${STAGED_S:-240} bash bench/run-staged.sh .bundle >"$O/staged-call.txt" 2>&1
echo "staged rc $? in $(( $(date +%s) - t0 )) s"
if grep -q '"pageable_memory_access": 1' "$O/probe.log"; then
  t0=$(date +%s)
  OUT="$O/inplace" STEPS=${STEPS:-5} REPEATS=${REPEATS:-1} MASTERS_FILE=/tmp/offload-masters.bin FILE_READS=in-place \
    HOST_BUDGETS=${INPLACE_BUDGETS:-8GiB,unpinned} timeout ${INPLACE_S:-200} bash bench/run-staged.sh .bundle >"$O/inplace-call.txt" 2>&1
  echo "in-place rc $? in $(( $(date +%s) - t0 )) s"
fi
rm -f /tmp/offload-masters.bin
gzip -f "$O"/staged/*.json "$O"/inplace/*.json 2>/dev/null
for d in staged inplace; do
  [ -f "$O/$d/staged.log" ] || continue
  echo "== $d"; grep -E "GB/s|masters file" "$O/$d/staged.err" | head -4 | cut -c1-200
  tail -3 "$O/$d/staged.err" | cut -c1-300
  sed -n '/^Staged masters/,$p' "$O/$d/staged.log" | cut -c1-240 | head -16
done
echo "== probe"
sed -n '/^| measurement/,$p' "$O/probe.log" | cut -c1-200
tail -2 "$O/probe.log" | cut -c1-300
echo "total $(( $(date +%s) - T0 )) s"
