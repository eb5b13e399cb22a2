#!/usr/bin/env bash
# Call S (2026-12-06, fourteenth session): calls Q and R ran transfer-bound
# rows 1.005-1.044 on a machine where call N had run them at 1.004-1.005,
# the traced step's copy engine busy throughout in the slow runs too. Does
# a deeper look-ahead absorb it? 1,024 tokens, depths 2, 4 and 8, six
# repeats of five timed steps each.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
O=${OUT:-/tmp/outS}
mkdir -p "$O"
. bench/lib.sh; cuda_libs
{ nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; uptime; } | tee "$O/env.txt"
t0=$(date +%s)
timeout 300 .bundle/offload-bench --tokens 1024 --depths 2,4,8 --no-planner --repeats 6 --steps 5 --warmup 1 \
  --no-simulate --json "$O/depths.json" >"$O/depths.log" 2>"$O/depths.err"
echo "bench rc $? in $(( $(date +%s) - t0 )) s"
python3 - "$O/depths.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("link fresh %.2f masters %.2f" % (d["pinned_h2d_gbps"], d["master_h2d_gbps"]))
by = {}
for r in d["rows"]:
    if r.get("depth", 0) == 0: continue
    t = r["timeline"]
    by.setdefault(r["depth"], []).append((r["ratio"], r["ratio_row_link"], t["window_s"], t["copy_idle_s"]))
for k in sorted(by):
    v = by[k]
    print(k, "ratio", " ".join("%.3f" % x[0] for x in v), "| row link", " ".join("%.3f" % x[1] for x in v), "| traced window", " ".join("%.4f" % x[2] for x in v))
PY
gzip -f "$O"/*.log "$O"/*.err "$O"/*.json
