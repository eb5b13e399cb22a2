#!/usr/bin/env bash
# Call J (2026-12-06, twelfth session; bundle built at 3cfe4f5): what the
# eleventh session could not run on a GPU: the whole suite at 3cfe4f5 (the
# odd-shape fused-attention test, Module::load, the context check, the
# tests' new draws), the fused kernel's tests under compute-sanitizer, the
# proxy at odd token counts (g·T² odd: 2,365, 4,097, 8,193, 10,001), and
# "none" against "auto" at 16,896 tokens with the fused attention.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outJ}
mkdir -p "$O/odd" "$O/auto"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; } | tee "$O/env.txt"
t0=$(date +%s)
timeout 150 .bundle/gpu-tests --test-threads 1 >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"; grep -E "^test result|FAILED|panicked|^test .*(odd_shapes|flash|kinds)" "$O/suite.log" | head -8
for tool in racecheck memcheck; do
  t0=$(date +%s)
  OFFLOAD_PROXY_NO_GEMM=1 OFFLOAD_UNDER_SANITIZER=1 timeout 60 compute-sanitizer --tool $tool --error-exitcode 86 \
    .bundle/gpu-tests --test-threads 1 flash_attention fused_attention_matches >"$O/sanitize-$tool.log" 2>&1
  echo "$tool rc $? in $(( $(date +%s) - t0 )) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$O/sanitize-$tool.log" | tr '\n' ' ')"
done
t0=$(date +%s)
timeout 80 .bundle/offload-bench --tokens 2365,4097,8193,10001 --depths "" --steps 2 --warmup 1 --no-simulate \
  --json "$O/odd/odd.json" >"$O/odd/odd.log" 2>"$O/odd/odd.err"
echo "odd rc $? in $(( $(date +%s) - t0 )) s"; grep -A7 "^Default layerwise at the chooser" "$O/odd/odd.log" | head -8
t0=$(date +%s)
timeout 160 .bundle/offload-bench --tokens 16896 --depths "" --weight-compression none,auto --repeats 3 --steps 3 --warmup 1 \
  --no-simulate --json "$O/auto/auto.json" >"$O/auto/auto.log" 2>"$O/auto/auto.err"
echo "auto rc $? in $(( $(date +%s) - t0 )) s"; grep -B2 -A8 "^Default layerwise at the chooser" "$O/auto/auto.log" | head -14
tail -3 "$O/auto/auto.err"
gzip -f "$O"/*.log "$O"/odd/*.log "$O"/auto/*.log
tar czf "$O/all.tgz" -C "$O" odd auto && rm -rf "$O/odd" "$O/auto"
