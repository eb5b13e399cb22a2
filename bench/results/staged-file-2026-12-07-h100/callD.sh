#!/usr/bin/env bash
# Call D (2026-12-07, nineteenth session; offload-bench at the commit in
# .bundle/BUILD, fills split from 256 KiB a worker): the 8 GiB row at
# 4,608 tokens through rings of eight parts of 32, 64, 128 and 512 MiB,
# plain fills then streaming fills, one process each: does a ring small
# enough to stay in the host's cache, filled with plain stores, stream
# faster than 512 MiB of streaming-store parts?
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outD}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; } | tee "$O/env.txt"
for fill in plain streaming; do
t0=$(date +%s)
timeout ${BENCH_S:-140} .bundle/offload-bench --tokens 4608 --depths 2 --steps 5 --warmup 1 \
  --no-planner --no-simulate --host-budgets 8GiB --staging-rings ${RINGS:-32MiB,64MiB,128MiB,512MiB} \
  --fill-copy $fill --repeats 2 --json "$O/$fill.json" >"$O/$fill.log" 2>"$O/$fill.err"
echo "$fill bench rc $? in $(( $(date +%s) - t0 )) s"
done
gzip -f "$O"/*.json
for fill in plain streaming; do
echo "== $fill"; sed -n '/^Staged masters/,$p' "$O/$fill.log" | cut -d'|' -f2,7,9,11,12,13 | head -14
done
