#!/usr/bin/env bash
# Call H1 (issue 20 on an H200; built at the commit in .bundle/BUILD): the
# crossover sweep (every 1,024 tokens from 1,024 to 16,896, 3 repeats,
# the chooser's look-ahead) and the 16/8 GiB budgets at 4,608 tokens,
# through bench/run-crossover.sh with the bundle's offload-bench.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
export OUT=${OUT:-/tmp/outH1}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; } | tee "$OUT/env.txt"
BUDGET_S=${BUDGET_S:-540} SWEEP_S=${SWEEP_S:-330} bash bench/run-crossover.sh "$R/.bundle/offload-bench" 2>&1 | tail -45
gzip -f "$OUT"/*.json 2>/dev/null
