#!/usr/bin/env bash
# Call R (2026-12-06, fourteenth session; built at the commit in
# .bundle/BUILD): call Q's sweep ran out of its 290 s before writing its
# JSON (the rows' own links lost); its transfer-bound rows ran
# 1.006-1.040 of the start's link, and 8 GiB 1.036. Again, with the JSON:
# the counts Q left short of 3 runs or spread past 0.01, and the budgets
# with 3 requests.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outR}
mkdir -p "$O/sweep"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; } | tee "$O/env.txt"
t0=$(date +%s)
OUT="$O/sweep" TOKENS=1024,2048,6144,7168,8192,9216,10240 REPEATS=3 REQUESTS=3 BUDGET_S=400 SWEEP_S=250 \
  timeout 410 bench/run-crossover.sh .bundle/offload-bench >"$O/sweep/table.txt" 2>&1
echo "sweep+budgets rc $? in $(( $(date +%s) - t0 )) s"
cp "$O/sweep/crossover.json" "$O/crossover.json" 2>/dev/null && gzip -f "$O/crossover.json"
gzip -f "$O"/sweep/*.log "$O"/sweep/*.err
cp "$O/sweep/table.txt" "$O/table.txt"
tar czf "$O/all.tgz" -C "$O" sweep && rm -rf "$O/sweep"
tail -22 "$O/table.txt"
