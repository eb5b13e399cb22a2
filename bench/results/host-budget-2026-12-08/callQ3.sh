#!/usr/bin/env bash
# Call Q3 (2026-12-08, twenty-fifth session; offload-bench at the commit
# in .bundle/BUILD): issue 21's host-budget rows once more (8 GiB and every
# master staged, over the loaded weights and from a 23.7 GB masters file,
# page cache dropped), 4,608 tokens, depth 2, 3 timed steps, the engine's
# staged forecast now pricing staged copies at the staged stream the row
# ran beside (PlannerInputs::staged_stream_bytes_per_s): its step /
# forecast and named bound against Q1/Q2's (which priced them at the link).
set -u
R=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$R"
O=${OUT:-/tmp/outQ3}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; lscpu | grep -E 'Model name|L3'; uname -r; } | tee "$O/env.txt"
OUT="$O/staged" STEPS=${STEPS:-3} REPEATS=1 MASTERS_FILE=/tmp/offload-masters.bin \
  timeout ${STAGED_S:-400} bash bench/run-staged.sh .bundle >"$O/staged-call.txt" 2>&1
echo "staged rc $? in $(( $(date +%s) - T0 )) s"
rm -f /tmp/offload-masters.bin
gzip -f "$O"/staged/*.json 2>/dev/null
grep -E "GB/s|masters file" "$O/staged/staged.err" | head -6 | cut -c1-300
sed -n '/^Staged masters/,$p' "$O/staged/staged.log" | cut -c1-330
echo "total $(( $(date +%s) - T0 )) s"
