#!/usr/bin/env bash
# Call P1 (2026-12-07, twenty-fourth session; offload-bench built at the
# commit in .bundle/BUILD): can the GPU read a staged master in place, in
# pageable memory (bench/pageable_probe.py), and issue 21's three
# host-budget rows at today's code (bench/run-staged.sh: 8 GiB, every
# master staged, each again from a masters file larger than the budget
# with its page cache dropped), 4,608 tokens, depth 2.
set -u
R=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$R"
O=${OUT:-/tmp/outP1}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; lscpu | grep -E 'Model name|L3|NUMA node\(s\)'; grep -E 'MemTotal|MemAvailable' /proc/meminfo; uname -r; cat /proc/driver/nvidia/version 2>/dev/null | head -1; } | tee "$O/env.txt"
t0=$(date +%s)
timeout ${PROBE_S:-200} python3 bench/pageable_probe.py --dir ${PROBE_DIR:-/tmp} >"$O/probe.log" 2>&1
echo "probe rc $? in $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
OUT="$O/staged" STEPS=${STEPS:-5} REPEATS=${REPEATS:-2} MASTERS_FILE=${MASTERS_FILE:-/tmp/offload-masters.bin} \
  timeout ${STAGED_S:-330} bash bench/run-staged.sh .bundle >"$O/staged-call.txt" 2>&1
echo "staged rc $? in $(( $(date +%s) - t0 )) s"
rm -f /tmp/offload-masters.bin
gzip -f "$O"/staged/*.json 2>/dev/null
grep -E "GB/s|masters file" "$O/staged/staged.err" | head -6 | cut -c1-220
sed -n '/^Staged masters/,$p' "$O/staged/staged.log" | cut -c1-260 | head -30
echo "== probe"
sed -n '/^| measurement/,$p' "$O/probe.log" | cut -c1-230
tail -3 "$O/probe.log" | cut -c1-300
echo "total $(( $(date +%s) - T0 )) s"
