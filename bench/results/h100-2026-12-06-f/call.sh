#!/usr/bin/env bash
# Call E (2026-12-06, eleventh session): with the proxy's fused attention,
# (1) the resident step beside an unrelated pinned copy stream at 8,192,
# 10,240 and 16,896 tokens (what copies cost the fused kernel), then (2) the
# whole crossover sweep (every 1,024 from 1,024 to 16,896, 3 repeats) and
# the 16 / 8 GiB budgets at 4,608, with a deadline the fused kernel's
# longer compute-bound steps fit.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outE}
mkdir -p "$O/cross" "$O/beside"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; } | tee "$O/env.txt"
echo "== beside ($(date +%T))"
timeout 110 .bundle/offload-bench --tokens 8192,10240,16896 --depths "" --repeats 1 --steps 3 --warmup 1 \
  --no-simulate --copy-beside --json "$O/beside/beside.json" >"$O/beside/beside.log" 2>"$O/beside/beside.err"
echo "beside rc $?"
echo "== crossover ($(date +%T))"
OUT="$O/cross" REPEATS=3 BUDGET_S=430 SWEEP_S=340 \
  timeout 440 bench/run-crossover.sh .bundle/offload-bench >"$O/cross/table.txt" 2>&1
echo "cross rc $? ($(date +%T))"
gzip -f "$O/cross/"*.err "$O/cross/"*.log "$O/beside/"*.err 2>/dev/null
grep -A6 "beside copies s" "$O/beside/beside.log"
tail -34 "$O/cross/table.txt"
