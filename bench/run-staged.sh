#!/usr/bin/env bash
# Staged masters on one GPU, in one call (issue 21, CONTRACT §7c):
# offload-bench DiT-only, layerwise at DEPTHS with every master pinned
# (the reference rows) and with HOST_BUDGETS (a host_budget: the blocks
# beyond it stay in the loader's pageable memory and stream through two
# pinned staging buffers; `unpinned`: every master staged), normal
# weights, at TOKENS. The bench measures, in the same run, the pinned
# host→device bandwidth and the pageable → pinned host copy rate the
# staging fill runs at, and prints the staged table last.
# Usage: bench/run-staged.sh [DIR]  DIR holds offload-bench (default:
# beside this script, else target/release). Logs and JSON under $OUT.
#   TOKENS=4608  DEPTHS=2  HOST_BUDGETS=8GiB,unpinned  STEPS=3  WARMUP=1  REPEATS=1
#   MASTERS_FILE=/tmp/offload-masters.bin: each budget again with its
#   masters from this file (written first, 23.7 GB for Flux.1-dev), its
#   page cache dropped before each enable; unset: no file rows
#   COMPRESSION=none,lossless with CODED_BLOCKS=/tmp/offload.opackb: every
#   row again with weight_compression = "lossless", the coded masters from
#   this coded-block file (written first from the loaded weights, about a
#   minute on 16 cores): within the budget registered in place, beyond it
#   staged coded (CONTRACT §7b with §7c); default COMPRESSION=none
#   FILE_READS=pread,in-place: how the file rows read their staged
#   blocks (default pread; in-place: staged_reads = "in_place", the GPU
#   reads the mapping where it lies, on a GPU with pageable memory access)
#   FILL_COPY=plain: the loader's bytes copied with copy_from_slice, not
#   the streaming stores the library's weight sources use (the A/B)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${1:-}
BENCH=
for c in ${DIR:+"$DIR/offload-bench"} "$HERE/offload-bench" "$HERE/../target/release/offload-bench"; do
  [ -x "$c" ] && { BENCH=$c; break; }
done
OUT=${OUT:-/tmp/staged-out}
mkdir -p "$OUT"
. "$HERE/lib.sh"
cuda_libs
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  date -u +%Y-%m-%dT%H:%M:%SZ
  nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo
  cat /sys/fs/cgroup/memory.max 2>/dev/null
  echo "offload-bench=${BENCH:-missing}"
} | tee "$OUT/env.txt"
[ -n "$BENCH" ] || { echo "offload-bench not found"; exit 1; }
"$BENCH" --tokens "${TOKENS:-4608}" --depths "${DEPTHS:-2}" --steps "${STEPS:-3}" \
  --warmup "${WARMUP:-1}" --no-planner --no-simulate \
  --host-budgets "${HOST_BUDGETS:-8GiB,unpinned}" --json "$OUT/staged.json" \
  ${MASTERS_FILE:+--masters-file "$MASTERS_FILE"} \
  --weight-compression "${COMPRESSION:-none}" --repeats "${REPEATS:-1}" \
  ${CODED_BLOCKS:+--coded-blocks "$CODED_BLOCKS"} \
  ${FILL_COPY:+--fill-copy "$FILL_COPY"} \
  ${FILE_READS:+--file-reads "$FILE_READS"} \
  >"$OUT/staged.log" 2>"$OUT/staged.err"
rc=$?
tail -n 5 "$OUT/staged.err"
df -h "$(dirname "${MASTERS_FILE:-/tmp/x}")" | tail -1
sed -n '/^Staged masters/,$p' "$OUT/staged.log"
echo "offload-bench exit $rc"
exit $rc
