#!/usr/bin/env bash
# Call G (2026-12-06, eleventh session): the crossover sweep with the fused
# attention again (every 1,024 from 1,024 to 16,896, 3 repeats, the 16 /
# 8 GiB budgets at 4,608), on whichever card comes, for a second call's
# spread; outputs in one archive.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outG}
mkdir -p "$O/cross"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; } | tee "$O/env.txt"
OUT="$O/cross" REPEATS=3 BUDGET_S=440 SWEEP_S=350 \
  timeout 450 bench/run-crossover.sh .bundle/offload-bench >"$O/cross/table.txt" 2>&1
echo "cross rc $? ($(date +%T))"
tail -30 "$O/cross/table.txt"
tar czf "$O/cross.tgz" -C "$O" cross && rm -rf "$O/cross"
