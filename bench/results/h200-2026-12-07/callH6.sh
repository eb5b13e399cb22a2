#!/usr/bin/env bash
# Call H6 (2026-12-07, twenty-second session; built at the commit in
# .bundle/BUILD): 4aee133 on a GPU (the ring's last post-forward issues the
# staged queue as fills land): 10,752 tokens, 8 GiB, depths 2, 4, 8 and the
# staged chooser's, beside the fully pinned rows; then the whole GPU suite.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outH6}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } | tee "$O/env.txt"
t0=$(date +%s)
timeout ${CROSS_S:-300} .bundle/offload-bench --tokens ${TOKENS:-10752} --depths ${DEPTHS:-2,4,8} --steps 3 --warmup ${WARMUP:-2} \
  --no-planner --no-simulate --host-budgets 8GiB --staged-chooser \
  --repeats ${REPEATS:-1} --json "$O/cross.json" >"$O/cross.log" 2>"$O/cross.err"
echo "crossover bench rc $? in $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout ${SUITE_S:-110} .bundle/gpu-tests --test-threads 1 --nocapture >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^test result|FAILED|panicked|^planted .* in parts" "$O/suite.log" | head -10
gzip -f "$O/suite.log" "$O"/*.json 2>/dev/null
grep -E "staged stream|pinned host→device" "$O/cross.err" "$O/cross.log" | head -3 | cut -c1-220
sed -n '/^| run .*compute busy/,/^$/p' "$O/cross.log" | cut -d'|' -f2,4,5,7,8 | head -12
sed -n '/^Staged masters/,$p' "$O/cross.log" | cut -d'|' -f2,7,9,11,12,13,14,15 | head -12
echo "total $(( $(date +%s) - T0 )) s"
