#!/usr/bin/env bash
# Call P (2026-12-07, seventeenth session; built at the commit in
# .bundle/BUILD): the staging ring of parts. The GPU suite (with the new
# staged_layerwise_in_parts_is_bit_identical_on_the_gpu), then the staged
# rows at 4,608 and 16,896 tokens under an 8 GiB host budget and with every
# master staged, each with the ring of parts (512 MiB, the default) and a
# ring of two whole blocks (1400 MiB) in one process, two repeats; then the
# build before this change (63ee99f) on the 8 GiB row at 4,608 tokens.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outP}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } | tee "$O/env.txt"
t0=$(date +%s)
timeout ${SUITE_S:-170} .bundle/gpu-tests ${SUITE_FILTER:-} --test-threads 1 --nocapture >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^test result|FAILED|panicked|in parts" "$O/suite.log" | head -12
t0=$(date +%s)
timeout ${NEW_S:-280} .bundle/offload-bench --tokens ${TOKENS:-4608,16896} --depths 2 --steps 3 --warmup 1 \
  --no-planner --no-simulate --host-budgets 8GiB,unpinned --staging-rings 512MiB,1400MiB \
  --repeats 2 --json "$O/staged.json" >"$O/staged.log" 2>"$O/staged.err"
echo "new bench rc $? in $(( $(date +%s) - t0 )) s"
if [ -n "${OLD_S:-}" ]; then
t0=$(date +%s)
timeout ${OLD_S} .bundle/offload-bench-63ee99f --tokens 4608 --depths 2 --steps 3 --warmup 1 \
  --no-planner --no-simulate --host-budgets 8GiB --repeats 2 --json "$O/old.json" >"$O/old.log" 2>"$O/old.err"
echo "old bench rc $? in $(( $(date +%s) - t0 )) s"
fi
gzip -f "$O/suite.log" "$O/staged.json" "$O/old.json" 2>/dev/null
grep -E "GB/s" "$O/staged.err" | head -8
echo "== new"; sed -n '/^Staged masters/,$p' "$O/staged.log" | cut -c1-400
echo "== old"; sed -n '/^Staged masters/,$p' "$O/old.log" | cut -c1-400
