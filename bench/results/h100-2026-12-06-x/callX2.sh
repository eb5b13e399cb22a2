#!/usr/bin/env bash
# Call X2: as X, with "auto" at 16,896 tokens (compute-bound: the plan codes
# little or nothing) beside "lossless" at 4,608, and each process's peak
# resident memory (/usr/bin/time -v, else VmHWM is not read).
set -u
R=$(cd "$(dirname "$0")/.." && pwd); cd "$R"; . bench/lib.sh; cuda_libs
O=${OUT:-/tmp/outX2}; mkdir -p "$O"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; echo "new $(cat .bundle/BUILD_BENCH) old e4de16c"; } | tee "$O/env.txt"
TIME=""; [ -x /usr/bin/time ] && TIME="/usr/bin/time -v"
for args in "16896 auto" "4608 lossless"; do
  set -- $args
  for b in new old; do
    bin=.bundle/offload-bench; [ $b = old ] && bin=.bundle/offload-bench-e4de16c
    t0=$(date +%s)
    timeout 130 $TIME $bin --pipeline --budgets 16GiB --tokens $1 --steps 2 --requests 1 \
      --saved-from none --weight-compression $2 --json "$O/$b-$1.json" >"$O/$b-$1.log" 2>"$O/$b-$1.err"
    echo "$b $1 $2 rc $? in $(( $(date +%s) - t0 )) s; $(grep -a 'Maximum resident' "$O/$b-$1.err" | tr -s ' ')"
    grep -aE "blocks have coded forms|blocks coded \(|: enable [0-9.]+ s, request" "$O/$b-$1.err" | sed 's/^.*\(planned offload\|weight_compression:\)/\1/' | cut -c1-200 | head -4
  done
done
gzip -f "$O"/*.err
