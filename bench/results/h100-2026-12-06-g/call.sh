#!/usr/bin/env bash
# Call F (2026-12-06, eleventh session): the whole GPU suite at today's main
# (the fused attention in every proxy), the fused kernel's tests under
# compute-sanitizer racecheck and memcheck, and the materialized attention
# on the same card at three crossover counts (2 repeats) and beside copies,
# for the comparison with call E.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outF}
mkdir -p "$O"
{ nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader; date -u +%FT%TZ; } | tee "$O/env.txt"
echo "== suite ($(date +%T))"
t0=$(date +%s)
timeout 170 .bundle/gpu-tests --test-threads 1 >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^test result|FAILED|panicked|^failures" "$O/suite.log" | head -8
for tool in racecheck memcheck; do
  t0=$(date +%s)
  OFFLOAD_PROXY_NO_GEMM=1 OFFLOAD_UNDER_SANITIZER=1 timeout 90 compute-sanitizer --tool $tool --error-exitcode 86 \
    .bundle/gpu-tests --test-threads 1 flash_attention the_proxy_attention_kinds >"$O/sanitize-$tool.log" 2>&1
  echo "$tool rc $? in $(( $(date +%s) - t0 )) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$O/sanitize-$tool.log" | tr '\n' ' ')"
done
echo "== materialized beside copies, crossover counts ($(date +%T))"
timeout 170 .bundle/offload-bench --attention materialized --tokens 9216,10240,11264 --depths "" --repeats 2 --steps 3 --warmup 1 \
  --no-simulate --copy-beside --json "$O/materialized.json" >"$O/materialized.log" 2>"$O/materialized.err"
echo "materialized rc $?"
gzip -f "$O"/*.log "$O"/*.err
zcat "$O/materialized.log.gz" | grep -A5 "beside copies s"
zcat "$O/materialized.log.gz" | grep -A6 "^Default layerwise at the chooser" | head -8
