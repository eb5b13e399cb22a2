#!/usr/bin/env bash
# Call H (2026-12-06, eleventh session): lossless layerwise with the fused
# attention in the proxy, at 1,024 and 4,608 tokens (depth 2, normal
# weights), against none: step / the bf16 link's limit (target <= 0.75).
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outH}
mkdir -p "$O"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; } | tee "$O/env.txt"
timeout 185 .bundle/offload-bench --tokens 1024,4608 --depths 2 --no-planner --weight-compression none,lossless \
  --law normal --steps 3 --warmup 1 --no-simulate --coded-blocks /tmp/offload-flux.opackb \
  --json "$O/lossless.json" >"$O/lossless.log" 2>"$O/lossless.err"
echo "bench rc $? ($(date +%T))"
grep -E "^\| (layerwise|resident)" "$O/lossless.log" | head -12
grep -iE "link / bf16|ratio|coded" "$O/lossless.log" | tail -8
gzip -f "$O/lossless.log" "$O/lossless.err" "$O/lossless.json"
