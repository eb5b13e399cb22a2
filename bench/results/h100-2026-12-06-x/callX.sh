#!/usr/bin/env bash
# Call X (2026-12-06, sixteenth session): the planned backend's enable with
# no coded-block file, whole Flux.1-dev requests (CLIP-L, T5-XXL, the DiT,
# the VAE) under a 16 GiB device budget at 4,608 tokens, "lossless" and
# "auto": HEAD's offload-bench (coded forms sized by Codec::coded_len, a
# block encoded only where the plan streams it coded) against e4de16c's
# (every block encoded at enable), one process each, same machine.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
. bench/lib.sh
cuda_libs
O=${OUT:-/tmp/outX}
mkdir -p "$O"
{ nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader; date -u +%FT%TZ; echo "new $(cat .bundle/BUILD_BENCH) old e4de16c"; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo; } | tee "$O/env.txt"
for b in new old; do
  bin=.bundle/offload-bench; [ $b = old ] && bin=.bundle/offload-bench-e4de16c
  t0=$(date +%s)
  timeout ${X_S:-270} $bin --pipeline --budgets 16GiB --tokens 4608 --steps 4 --requests 1 \
    --saved-from none --weight-compression lossless,auto --json "$O/$b.json" >"$O/$b.log" 2>"$O/$b.err"
  echo "$b rc $? in $(( $(date +%s) - t0 )) s"
  grep -aE "blocks have coded forms|weight_compression: [0-9]+ blocks coded|: enable [0-9.]+ s, request" "$O/$b.err" | sed 's/^.*\(planned offload\|weight_compression:\)/\1/' | cut -c1-260 | head -12
done
python3 - "$O" <<'PY'
import json, sys, os
o = sys.argv[1]
print("| build | run | compression | enable s | DiT streamed / coded | link / bf16 | request s | output = resident |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for b in ("new", "old"):
    p = os.path.join(o, b + ".json")
    try:
        doc = json.load(open(p))
    except Exception as e:
        print(f"| {b} | ({e}) |"); continue
    for r in doc.get("runs", []):
        d = r.get("dit") or {}
        print(f"| {b} | {r.get('name')} | {r.get('weight_compression')} | {r.get('enable_s', 0):.2f} | {d.get('streamed_blocks','–')}/{d.get('blocks','–')} / {d.get('coded_blocks','–')} | {d.get('link_over_bf16', float('nan')):.3f} | {r.get('median_request_s', 0):.3f} | {r.get('output_equals_resident')} |")
PY
gzip -f "$O"/*.err
