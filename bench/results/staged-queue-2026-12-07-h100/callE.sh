#!/usr/bin/env bash
# Call E (2026-12-07, twentieth session; built at the commit in
# .bundle/BUILD): the whole GPU suite (the queued staged prefetches, the
# planted StagedReadyUnrecorded), then the staged rows at the crossover
# (10,752 tokens; 8 GiB and every master staged) at depths 2, 4, 8 and 12:
# with a hook that waits only for its own block's fills, a deeper
# look-ahead should run the fills ahead (before: 1.09-1.12 at every depth).
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outE}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } | tee "$O/env.txt"
if [ -z "${NO_SUITE:-}" ]; then
t0=$(date +%s)
timeout ${SUITE_S:-170} .bundle/gpu-tests ${SUITE_FILTER:-} --test-threads 1 --nocapture >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^test result|FAILED|panicked|^planted .* in parts|^perturbed: staged" "$O/suite.log" | head -14
fi
t0=$(date +%s)
timeout ${CROSS_S:-330} .bundle/offload-bench --tokens ${TOKENS:-10752} --depths ${DEPTHS:-2,4,8,12} --steps 3 --warmup 1 \
  --no-planner --no-simulate --host-budgets ${BUDGETS:-8GiB,unpinned} \
  --repeats ${REPEATS:-1} --json "$O/cross.json" >"$O/cross.log" 2>"$O/cross.err"
echo "crossover bench rc $? in $(( $(date +%s) - t0 )) s"
gzip -f "$O/suite.log" "$O"/*.json 2>/dev/null
grep -E "staged stream|pinned host→device" "$O/cross.err" | head -3
sed -n '/^Timeline/,/^$/p' "$O/cross.log" | cut -d'|' -f2,4,5,6 | head -16
sed -n '/^Staged masters/,$p' "$O/cross.log" | cut -d'|' -f2,6,7,8,10,11,12,13 | head -16
