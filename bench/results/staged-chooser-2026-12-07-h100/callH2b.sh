#!/usr/bin/env bash
# Call H2b (2026-12-07, twenty-first session; built at the commit in
# .bundle/BUILD), what device time leaves after the sweep (call H1):
# issue 21's 8 GiB row at 4,608 tokens (depth 2, two runs) beside the
# fully pinned limit, then the crossover (10,752 tokens, 8 GiB) at depth 2
# and again at the staged chooser's depth (--staged-chooser).
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outH2b}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } | tee "$O/env.txt"
t0=$(date +%s)
timeout ${ROWS_S:-110} .bundle/offload-bench --tokens 4608 --depths 2 --steps 5 --warmup 1 \
  --no-planner --no-simulate --host-budgets 8GiB --staged-chooser \
  --repeats 2 --json "$O/rows.json" >"$O/rows.log" 2>"$O/rows.err"
echo "4608 rows rc $? in $(( $(date +%s) - t0 )) s"
left=$(( ${ALL_S:-230} - ($(date +%s) - T0) ))
t0=$(date +%s)
timeout $left .bundle/offload-bench --tokens 10752 --depths 2 --steps 3 --warmup 1 \
  --no-planner --no-simulate --host-budgets 8GiB --staged-chooser \
  --repeats 1 --json "$O/cross.json" >"$O/cross.log" 2>"$O/cross.err"
echo "crossover bench rc $? in $(( $(date +%s) - t0 )) s (limit $left)"
gzip -f "$O"/*.json 2>/dev/null
echo "== 4608"; grep -E "staged stream|pinned host→device" "$O/rows.err" | head -2 | cut -c1-200
sed -n '/^Staged masters/,$p' "$O/rows.log" | cut -d'|' -f2,7,9,11,12,13,14,15 | head -8
echo "== 10752"; sed -n '/^Staged masters/,$p' "$O/cross.log" | cut -d'|' -f2,7,9,11,12,13,14,15 | head -8
echo "total $(( $(date +%s) - T0 )) s"
