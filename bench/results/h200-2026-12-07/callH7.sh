#!/usr/bin/env bash
# Call H7 (2026-12-07, twenty-second session; built at the commit in
# .bundle/BUILD; offload-bench-planted: the same with planted-bugs): the
# last post-forward's loop, A/B on one machine, alternating: 10,752 tokens,
# 8 GiB, depths 8 and 12, clean then planted StepEndLeavesQueue, twice;
# then the GPU suite (SUITE_S, 1 skips it).
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outH7}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } | tee "$O/env.txt"
for round in $(seq 1 ${ROUNDS:-2}); do
  for v in clean planted; do
    if [ $v = clean ]; then B=.bundle/offload-bench; P=""; else B=.bundle/offload-bench-planted; P="--plant step-end-leaves-queue"; fi
    t0=$(date +%s)
    timeout ${RUN_S:-140} $B --tokens 10752 --depths ${DEPTHS:-8,12} --steps 3 --warmup 2 \
      --no-planner --no-simulate --host-budgets 8GiB $P \
      --repeats 1 --json "$O/$v$round.json" >"$O/$v$round.log" 2>"$O/$v$round.err"
    echo "$v $round rc $? in $(( $(date +%s) - t0 )) s"
  done
done
gzip -f "$O"/*.json 2>/dev/null
for f in "$O"/clean*.log "$O"/planted*.log; do
  echo "== $(basename $f)"; grep -E "pageable" "$f" | cut -c1-200
  sed -n '/^Staged masters/,$p' "$f" | grep host_budget | cut -d'|' -f2,7,9,11
  sed -n '/^| run .*compute busy/,/^$/p' "$f" | grep host_budget | cut -d'|' -f2,5
done
echo "total $(( $(date +%s) - T0 )) s"
if [ "${SUITE_S:-100}" -gt 1 ]; then
  t0=$(date +%s)
  timeout ${SUITE_S:-100} .bundle/gpu-tests --test-threads 1 --nocapture >"$O/suite.log" 2>&1
  echo "suite rc $? in $(( $(date +%s) - t0 )) s"
  grep -E "^test result|FAILED|panicked|^planted .* in parts" "$O/suite.log" | head -8
  gzip -f "$O/suite.log"
fi
