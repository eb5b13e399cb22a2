#!/usr/bin/env bash
# Call S11: the streaming-store fill A/B (issue 21's staged rows).
set -u
B=$(cd "$(dirname "$0")" && pwd)
cd "$B"
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  date -u +%Y-%m-%dT%H:%M:%SZ
  ldd --version | head -1
  lscpu | grep -E 'Model name|L3|L2|NUMA node|^CPU\(s\)|Flags' | cut -c1-200
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt" | head -12
. ./lib.sh; cuda_libs
# GPU tests of the staged fill (real pinned memory, the fence before the copy).
GT=$(ls ./gpu-* | head -1)
timeout 150 "$GT" --test-threads 1 staged planted_staging > "$OUT/gpu-staged.log" 2>&1
echo "gpu staged tests rc=$?"; grep -E "^test |test result" "$OUT/gpu-staged.log" | tail -8
# A: streaming stores (the new default), bf16 and lossless.
mkdir -p "$OUT/a" "$OUT/b" "$OUT/c"
OUT=$OUT/a COMPRESSION=none,lossless CODED_BLOCKS=/tmp/offload.opackb TOKENS=4608 DEPTHS=2 \
  HOST_BUDGETS=4GiB,8GiB,12GiB,unpinned REPEATS=2 timeout 300 ./run-staged.sh "$B" > "$OUT/a-call.log" 2>&1
echo "A rc=$?"
# B: plain copies (what the fill did before), bf16.
OUT=$OUT/b FILL_COPY=plain TOKENS=4608 DEPTHS=2 HOST_BUDGETS=8GiB,12GiB,unpinned REPEATS=2 \
  timeout 120 ./run-staged.sh "$B" > "$OUT/b-call.log" 2>&1
echo "B rc=$?"
# C: plain copies with glibc's non-temporal threshold at 1 MiB.
OUT=$OUT/c FILL_COPY=plain GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000 \
  TOKENS=4608 DEPTHS=2 HOST_BUDGETS=8GiB,12GiB REPEATS=1 timeout 90 ./run-staged.sh "$B" > "$OUT/c-call.log" 2>&1
echo "C rc=$?"
for x in a b c; do echo "== $x"; grep -E "^Staged masters|host_budget|unpinned" "$OUT/$x-call.log" | grep -E "^Staged|^\| layerwise" | cut -d'|' -f2,4,7,9,12,13 ; done
for x in a b c; do echo "== $x copy engine"; sed -n '/compute busy ms/,/^$/p' "$OUT/$x/staged.log" | grep "^| layerwise" | cut -d'|' -f2,7,8,9 ; done
