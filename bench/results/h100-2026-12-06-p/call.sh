#!/usr/bin/env bash
# Call P (2026-12-06, fourteenth session; built at the commit in
# .bundle/BUILD): issue 20's compression acceptance in one call: the
# whole GPU suite (the decode transport's planted bugs under
# perturbation among it), the decode throughput, "none" against
# "lossless" at 1,024 and 4,608 tokens with every block streamed (depth 2,
# normal weights, the coded masters from a coded-block file), then "none"
# against "auto" at 16,896 tokens at the chooser's look-ahead.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outP}
mkdir -p "$O/comp" "$O/a16896" /tmp/nb
ln -sf "$R/.bundle/offload-bench" "$R/.bundle/decode_bench" /tmp/nb/
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } | tee "$O/env.txt"
t0=$(date +%s)
timeout 130 .bundle/gpu-tests --test-threads 1 >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"; grep -E "^test result|FAILED|panicked" "$O/suite.log" | head -6
t0=$(date +%s)
OUT="$O/comp" TOKENS=1024,4608 COMPRESSIONS=none,lossless BUDGET_S=250 DECODE_S=60 CODED_BLOCKS=/tmp/offload-flux.opackb \
  timeout 255 bench/run-compressed.sh /tmp/nb >"$O/comp/table.txt" 2>&1
echo "compressed rc $? in $(( $(date +%s) - t0 )) s"
grep -E "coded|enable|weight_compression" "$O/comp/sweep.log" | cut -c1-300 | head -12 >"$O/enable-lines.txt"
left=$(( 575 - ($(date +%s) - T0) ))
t0=$(date +%s)
timeout $left .bundle/offload-bench --tokens 16896 --depths "" --weight-compression none,auto --repeats 3 --steps 3 --warmup 1 \
  --law normal --no-simulate --json "$O/a16896/auto.json" >"$O/a16896/auto.log" 2>"$O/a16896/auto.err"
echo "auto 16896 rc $? in $(( $(date +%s) - t0 )) s (limit $left)"
grep -E "weight_compression|host→device" "$O/a16896/auto.err" | cut -c1-260 | head -4 >"$O/auto-lines.txt"
cp "$O/comp/table.txt" "$O/comp-table.txt"
gzip -f "$O"/*.log "$O"/comp/*.log "$O"/a16896/*.log "$O"/a16896/*.err 2>/dev/null
tar czf "$O/all.tgz" -C "$O" comp a16896 && rm -rf "$O/comp" "$O/a16896"
cut -c1-200 "$O/enable-lines.txt" | head -6; cut -c1-200 "$O/auto-lines.txt"
tail -22 "$O/comp-table.txt"
echo "total $(( $(date +%s) - T0 )) s"
