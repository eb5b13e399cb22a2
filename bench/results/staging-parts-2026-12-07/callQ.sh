#!/usr/bin/env bash
# Call Q (2026-12-07, seventeenth session; built at the commit in
# .bundle/BUILD): issue 20's crossover sweep (every 1,024 tokens from 1,024
# to 16,896, three repeats, the chooser's look-ahead) with the 16 / 8 GiB
# requests at 4,608 tokens, as call N (2026-12-06) ran it; its
# crossover.json refits the h200 profile. Run only on an H200.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outQ}
mkdir -p "$O/sweep"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } | tee "$O/env.txt"
t0=$(date +%s)
OUT="$O/sweep" REPEATS=3 REQUESTS=3 BUDGET_S=${BUDGET_S:-520} SWEEP_S=${SWEEP_S:-330} \
  timeout ${ALL_S:-560} bench/run-crossover.sh .bundle/offload-bench >"$O/sweep/table.txt" 2>&1
echo "sweep+budgets rc $? in $(( $(date +%s) - t0 )) s"
cp "$O/sweep/crossover.json" "$O/crossover.json" 2>/dev/null
gzip -f "$O"/sweep/*.log "$O"/sweep/*.err "$O/crossover.json" 2>/dev/null
cp "$O/sweep/table.txt" "$O/table.txt"
tar czf "$O/all.tgz" -C "$O" sweep && rm -rf "$O/sweep"
tail -32 "$O/table.txt"
