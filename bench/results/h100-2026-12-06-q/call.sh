#!/usr/bin/env bash
# Call Q (2026-12-06, fourteenth session; built at the commit in
# .bundle/BUILD): the issue-20 acceptance call's first half: the GPU
# suite, then the crossover sweep (every 1,024 tokens from 1,024 to
# 16,896, three repeats, the chooser's look-ahead) with the 16 / 8 GiB
# requests at 4,608 tokens; its crossover.json refits the h200 profile.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outQ}
mkdir -p "$O/sweep"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } | tee "$O/env.txt"
t0=$(date +%s)
timeout 140 .bundle/gpu-tests --test-threads 1 >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"; grep -E "^test result|FAILED|panicked" "$O/suite.log" | head -6
t0=$(date +%s)
OUT="$O/sweep" REPEATS=3 REQUESTS=3 BUDGET_S=420 SWEEP_S=290 \
  timeout 430 bench/run-crossover.sh .bundle/offload-bench >"$O/sweep/table.txt" 2>&1
echo "sweep+budgets rc $? in $(( $(date +%s) - t0 )) s"
cp "$O/sweep/crossover.json" "$O/crossover.json" 2>/dev/null
gzip -f "$O"/*.log "$O"/sweep/*.log "$O"/sweep/*.err "$O/crossover.json"
cp "$O/sweep/table.txt" "$O/table.txt"
tar czf "$O/all.tgz" -C "$O" sweep && rm -rf "$O/sweep"
tail -32 "$O/table.txt"
