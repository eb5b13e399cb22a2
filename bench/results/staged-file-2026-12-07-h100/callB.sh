#!/usr/bin/env bash
# Call B (2026-12-07, nineteenth session; built at the commit in
# .bundle/BUILD): issue 21's file row (4,608 tokens, 8 GiB, a 23.67 GB
# masters file whose page cache is dropped before each enable) with the
# released blocks read by pread and through the mapping, in one process;
# then the staged rows at 10,752 tokens (the crossover), 8 GiB and every
# master staged, through the default ring of parts; first, the 8 GiB row
# through rings of 32, 128 and 512 MiB with fills split over the pool from
# 256 KiB a worker (call A's rings ran 4 MiB parts on one thread).
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outB}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } | tee "$O/env.txt"
t0=$(date +%s)
timeout ${RINGS_S:-130} .bundle/offload-bench --tokens 4608 --depths 2 --steps 5 --warmup 1 \
  --no-planner --no-simulate --host-budgets 8GiB --staging-rings ${RINGS:-32MiB,128MiB,512MiB} \
  --repeats 2 --json "$O/rings.json" >"$O/rings.log" 2>"$O/rings.err"
echo "rings bench rc $? in $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
MF=${MASTERS_FILE:-/tmp/offload-masters.bin}
timeout ${FILE_S:-240} .bundle/offload-bench --tokens 4608 --depths 2 --steps ${STEPS:-5} --warmup 1 \
  --no-planner --no-simulate --host-budgets 8GiB --masters-file "$MF" --file-reads pread,mapped \
  --repeats ${FILE_REPEATS:-2} --json "$O/file.json" >"$O/file.log" 2>"$O/file.err"
echo "file bench rc $? in $(( $(date +%s) - t0 )) s"
rm -f "$MF"
t0=$(date +%s)
timeout ${CROSS_S:-150} .bundle/offload-bench --tokens ${TOKENS:-10752} --depths 2 --steps 3 --warmup 1 \
  --no-planner --no-simulate --host-budgets 8GiB,unpinned \
  --repeats 2 --json "$O/cross.json" >"$O/cross.log" 2>"$O/cross.err"
echo "crossover bench rc $? in $(( $(date +%s) - t0 )) s"
gzip -f "$O"/*.json 2>/dev/null
echo "== file"; grep -E "masters file .*read|staged stream" "$O/file.err" | cut -c1-600
sed -n '/^| file run/,$p' "$O/file.log" | cut -c1-330
echo "== crossover"; grep -E "staged stream|fill\)" "$O/cross.err" | head -3
sed -n '/^Staged masters/,$p' "$O/cross.log" | cut -c1-300 | head -14
echo "== rings"; sed -n '/^Staged masters/,$p' "$O/rings.log" | cut -d'|' -f2,7,9,11,12,13 | head -12
