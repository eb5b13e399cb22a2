#!/usr/bin/env bash
# Call L (2026-12-06, twelfth session; built at the commit in .bundle/BUILD):
# the GPU suite with "auto" deciding hidden rings before encoding, then
# "none" against "auto" at 16,896 tokens (compute-bound: auto should now
# stream raw with nothing encoded) and at 10,240 (near the crossover,
# exposed: auto encodes and decides), each in one process with repeats.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outL}
mkdir -p "$O/a16896" "$O/a10240"
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; } | tee "$O/env.txt"
t0=$(date +%s)
timeout 150 .bundle/gpu-tests --test-threads 1 >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"; grep -E "^test result|FAILED|panicked" "$O/suite.log" | head -6
for t in 16896 10240; do
  t0=$(date +%s)
  r=3; [ $t = 10240 ] && r=1
  timeout 170 .bundle/offload-bench --tokens $t --depths "" --weight-compression none,auto --repeats $r --steps 3 --warmup 1 \
    --no-simulate --json "$O/a$t/auto.json" >"$O/a$t/auto.log" 2>"$O/a$t/auto.err"
  echo "auto $t rc $? in $(( $(date +%s) - t0 )) s"; grep -A4 "^Default layerwise at the chooser" "$O/a$t/auto.log" | tail -2
  grep -E "weight_compression|host→device" "$O/a$t/auto.err" | cut -c1-260 | head -5
done
gzip -f "$O"/*.log "$O"/*/*.log "$O"/*/*.err
tar czf "$O/all.tgz" -C "$O" a16896 a10240 && rm -rf "$O/a16896" "$O/a10240"
