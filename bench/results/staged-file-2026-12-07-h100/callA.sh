#!/usr/bin/env bash
# Call A (2026-12-07, nineteenth session; built at the commit in
# .bundle/BUILD): the whole GPU suite at HEAD, then the 8 GiB staged row
# (4,608 tokens, depth 2) through rings of eight parts of several sizes,
# with plain fills and with streaming-store fills, one process each: does a
# ring small enough to stay in the host's cache (plain stores, the DMA
# reading the lines the fill just wrote) stream faster than 512 MiB of
# streaming-store parts?
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outA}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; lscpu | grep -E 'Model name|L3|NUMA node\(s\)'; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } | tee "$O/env.txt"
if [ -z "${NO_SUITE:-}" ]; then
t0=$(date +%s)
timeout ${SUITE_S:-150} .bundle/gpu-tests ${SUITE_FILTER:-} --test-threads 1 --nocapture >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^test result|FAILED|panicked" "$O/suite.log" | head -12
fi
for fill in ${FILLS:-plain streaming}; do
t0=$(date +%s)
timeout ${BENCH_S:-120} .bundle/offload-bench --tokens 4608 --depths 2 --steps ${STEPS:-5} --warmup 1 \
  --no-planner --no-simulate --host-budgets ${BUDGETS:-8GiB} --staging-rings ${RINGS:-32MiB,128MiB,512MiB} \
  --fill-copy $fill --repeats ${REPEATS:-2} --json "$O/$fill.json" >"$O/$fill.log" 2>"$O/$fill.err"
echo "$fill bench rc $? in $(( $(date +%s) - t0 )) s"
done
if [ -z "${NO_FILE:-}" ]; then
t0=$(date +%s)
MF=${MASTERS_FILE:-/tmp/offload-masters.bin}
timeout ${FILE_S:-180} .bundle/offload-bench --tokens 4608 --depths 2 --steps ${STEPS:-5} --warmup 1 \
  --no-planner --no-simulate --host-budgets 8GiB --masters-file "$MF" \
  --repeats ${FILE_REPEATS:-2} --json "$O/file.json" >"$O/file.log" 2>"$O/file.err"
echo "file bench rc $? in $(( $(date +%s) - t0 )) s"
df -h "$(dirname "$MF")" | tail -1; rm -f "$MF"
fi
gzip -f "$O/suite.log" "$O"/*.json 2>/dev/null
for fill in ${FILLS:-plain streaming}; do
echo "== $fill"; grep -E "GB/s" "$O/$fill.err" | head -5
grep -E "^\| layerwise" "$O/$fill.log" | awk -F'|' '$3 ~ /4608/ {print $2 "|" $4 "|" $6}' | head -12
done
echo "== file"; grep -E "masters file|GB/s" "$O/file.err" | head -6
sed -n '/^| file run/,$p' "$O/file.log" | cut -c1-300
