#!/usr/bin/env bash
# Call T (2026-12-06, fifteenth session; built at the commit in
# .bundle/BUILD): the GPU suite on the in-place block encoder, then the
# time `enable` takes to encode Flux's 57 blocks on the host (lossless,
# no coded-block file, 4,608 tokens, depth 2, normal weights): the new
# binary and the previous one (.bundle/offload-bench-c9616e0) on this
# machine, then the coded-block file written by the new one.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outT}
mkdir -p "$O/enc"
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; nproc; lscpu | grep -E "Model name|NUMA node\(s\)"; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } | tee "$O/env.txt"
. bench/lib.sh; cuda_libs
t0=$(date +%s)
timeout 130 .bundle/gpu-tests --test-threads 1 >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"; grep -E "^test result|FAILED|panicked" "$O/suite.log" | head -6
enc() { # name binary extra-args...
  local name=$1 bin=$2; shift 2
  local t0=$(date +%s) left=$(( 580 - ($(date +%s) - T0) ))
  [ $left -gt 20 ] || { echo "$name: no time left"; return; }
  timeout $left "$bin" --tokens 4608 --depths 2 --no-planner --weight-compression lossless --law normal \
    --steps 3 --warmup 1 --no-simulate --json "$O/enc/$name.json" "$@" >"$O/enc/$name.log" 2>"$O/enc/$name.err"
  echo "$name rc $? in $(( $(date +%s) - t0 )) s"
  grep -aE "encoded at enable|coded-block file|weight_compression:" "$O/enc/$name.err" "$O/enc/$name.log" | sed 's/^[^:]*://' | cut -c1-330 | head -4
  python3 - "$O/enc/$name.json" <<'PY'
import json,sys
try:
    d=json.load(open(sys.argv[1]))
except Exception as e:
    print("  no json:", e); sys.exit()
rows=d.get("rows", d if isinstance(d,list) else [])
for r in rows:
    if r.get("depth",0)>0:
        print("  %s tokens %s: enable %.2f s, step %.4f s, link/bf16 %s, step/bf16 link %.3f, = resident %s" % (r.get("weight_compression"), r.get("tokens"), r.get("enable_s",0), r.get("step_s",0), r.get("link_over_bf16"), r.get("step_over_bf16_link",0), r.get("output_equals_resident")))
PY
}
enc new .bundle/offload-bench
enc old .bundle/offload-bench-c9616e0
rm -f /tmp/offload-flux.opackb
enc file .bundle/offload-bench --coded-blocks /tmp/offload-flux.opackb
gzip -f "$O"/*.log "$O"/enc/*.log "$O"/enc/*.err 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
