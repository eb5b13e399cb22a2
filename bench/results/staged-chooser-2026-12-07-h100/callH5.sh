#!/usr/bin/env bash
# Call H5 (2026-12-07, twenty-first session; built at the commit in
# .bundle/BUILD), sized to the device time left: the whole GPU suite (the
# queue's waits as review left them at e2d0e9b), then the crossover
# (10,752 tokens, 8 GiB) at depth 2 and at the staged chooser's depth.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outH5}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; } | tee "$O/env.txt"
t0=$(date +%s)
timeout ${SUITE_S:-110} .bundle/gpu-tests --test-threads 1 --nocapture >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^test result|FAILED|panicked|^planted .* in parts" "$O/suite.log" | head -10
gzip -f "$O/suite.log"
t0=$(date +%s)
timeout ${CROSS_S:-120} .bundle/offload-bench --tokens 10752 --depths 2 --steps 3 --warmup 1 \
  --no-planner --no-simulate --host-budgets 8GiB --staged-chooser \
  --repeats 1 --json "$O/cross.json" >"$O/cross.log" 2>"$O/cross.err"
echo "crossover bench rc $? in $(( $(date +%s) - t0 )) s"
gzip -f "$O"/*.json 2>/dev/null
grep -E "staged stream|pinned host→device" "$O/cross.err" | head -2 | cut -c1-200
sed -n '/^Staged masters/,$p' "$O/cross.log" | cut -d'|' -f2,7,9,11,12,13,14,15 | head -8
