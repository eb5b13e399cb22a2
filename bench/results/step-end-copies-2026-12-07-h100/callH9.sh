#!/usr/bin/env bash
# Call H9 (2026-12-07, twenty-third session; built at the commit in
# .bundle/BUILD): the last post-forward's loop that waits for a staging
# buffer only while the last block runs, A/B on one machine against the
# planted StepEndWaitsOnCopies (the loop of 5cdbaba) and StepEndLeavesQueue:
# TOKENS (11264), host budget BUDGET (16GiB), depths DEPTHS (12), one run
# each; then the GPU suite if SUITE_S > 1.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outH9}
mkdir -p "$O"
. bench/lib.sh
cuda_libs
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; } > "$O/env.txt"
head -2 "$O/env.txt"
for v in ${VARIANTS:-clean waits clean leaves}; do
  case $v in
    clean) B=.bundle/offload-bench; P="";;
    waits) B=.bundle/offload-bench-planted; P="--plant step-end-waits-on-copies";;
    leaves) B=.bundle/offload-bench-planted; P="--plant step-end-leaves-queue";;
  esac
  t0=$(date +%s)
  timeout ${RUN_S:-120} $B --tokens ${TOKENS:-11264} --depths ${DEPTHS:-12} --steps 3 --warmup 2 \
    --no-planner --no-simulate --host-budgets ${BUDGET:-16GiB} $P \
    --repeats 1 --json "$O/$v.json" >"$O/$v.log" 2>"$O/$v.err"
  echo "$v rc $? in $(( $(date +%s) - t0 )) s"
done
gzip -f "$O"/*.json 2>/dev/null
for v in ${VARIANTS:-clean waits clean leaves}; do
  echo "== $v"; grep -E "pageable" "$O/$v.log" | cut -c1-160
  sed -n '/^| run | tokens | staged GB/,$p' "$O/$v.log" | grep -E '^\| layerwise' | cut -d'|' -f2,7,9,11,12
  sed -n '/^| run .*compute busy/,/^$/p' "$O/$v.log" | grep -E '^\| layerwise' | cut -d'|' -f2,5
done
echo "total $(( $(date +%s) - T0 )) s"
if [ "${SUITE_S:-1}" -gt 1 ]; then
  timeout ${SUITE_S} .bundle/gpu-tests --test-threads 1 >"$O/suite.log" 2>&1
  echo "suite rc $?"; grep -E "^test result|FAILED" "$O/suite.log" | head -4; gzip -f "$O/suite.log"
fi
