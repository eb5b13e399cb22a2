#!/usr/bin/env bash
# Call K (2026-12-06, twelfth session; offload-bench built at the commit in
# .bundle/BUILD_BENCH): "none" against "auto" at 16,896 tokens (the
# fused attention; "auto" now runs at the chooser's look-ahead), the
# crossover region every 256 tokens from 7,680 to 9,216 with three repeats
# (8,193 ran 1.019 once in call J), and the 16 / 8 GiB requests at 4,608
# tokens with three timed requests.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outK}
mkdir -p "$O/auto" "$O/near"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD_BENCH; } | tee "$O/env.txt"
t0=$(date +%s)
timeout 190 .bundle/offload-bench --tokens 16896 --depths "" --weight-compression none,auto --repeats 3 --steps 3 --warmup 1 \
  --no-simulate --json "$O/auto/auto.json" >"$O/auto/auto.log" 2>"$O/auto/auto.err"
echo "auto rc $? in $(( $(date +%s) - t0 )) s"; grep -A8 "^Default layerwise at the chooser" "$O/auto/auto.log" | head -8; tail -2 "$O/auto/auto.err"
t0=$(date +%s)
OUT="$O/near" TOKENS=7680,7936,8193,8448,8704,8960,9216 REPEATS=3 REQUESTS=3 BUDGET_S=360 SWEEP_S=190 \
  timeout 370 bench/run-crossover.sh .bundle/offload-bench >"$O/near/table.txt" 2>&1
echo "near+budgets rc $? in $(( $(date +%s) - t0 )) s"; tail -16 "$O/near/table.txt"
gzip -f "$O"/*/*.log "$O"/*/*.err
tar czf "$O/all.tgz" -C "$O" auto near && rm -rf "$O/auto" "$O/near"
