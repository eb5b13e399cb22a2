#!/usr/bin/env bash
# Call D (2026-12-06, eleventh session): the proxy's fused attention on the
# GPU (its host-reference test with three planted bugs, the kinds test, the
# suite's bit-identity and planted-ordering tests with it), then the whole
# crossover sweep (every 1,024 from 1,024 to 16,896, 3 repeats) and the
# 16 / 8 GiB budgets at 4,608 with it.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outD}
mkdir -p "$O/cross"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; } | tee "$O/env.txt"
echo "== new tests ($(date +%T))"
timeout 90 .bundle/gpu-tests --test-threads 1 --nocapture flash_attention the_proxy_attention_kinds >"$O/flash-tests.log" 2>&1
echo "new tests rc $?"
grep -E "flash attention|planted attention|proxy outputs|^test |panicked|test result" "$O/flash-tests.log" | head -20
echo "== suite subset ($(date +%T))"
timeout 110 .bundle/gpu-tests --test-threads 1 every_strategy_is_bit_identical planted_ordering device_basics >"$O/suite.log" 2>&1
echo "suite rc $?"
grep -E "^test |test result|panicked" "$O/suite.log" | head -10
echo "== crossover ($(date +%T))"
OUT="$O/cross" REPEATS=3 BUDGET_S=380 SWEEP_S=265 \
  timeout 390 bench/run-crossover.sh .bundle/offload-bench >"$O/cross/table.txt" 2>&1
echo "cross rc $? ($(date +%T))"
gzip -f "$O/cross/"*.err "$O/cross/"*.log 2>/dev/null
tail -32 "$O/cross/table.txt"
