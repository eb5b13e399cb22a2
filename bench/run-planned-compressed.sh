#!/usr/bin/env bash
# `weight_compression` under a device budget on one GPU, in one call
# (issue 20, item 4: the request planner chooses coded blocks):
#   1. the GPU suite (the `gpu-*` test binary beside this script, when
#      there: bit-identity and INV-7 per phase of planned lossless, its
#      planted staging bug, and every earlier test);
#   2. offload-bench --pipeline: whole Flux.1-dev requests (CLIP-L, T5-XXL,
#      the DiT, the VAE; weights drawn N(0, 1/fan-in)) under BUDGETS at
#      TOKENS, each budget with WEIGHT_COMPRESSION (none, lossless, auto),
#      from a coded-block file of every stack's blocks (written first when
#      absent, at CODED, outside $OUT);
#   3. if time is left, the same at LATE_TOKENS for LATE_COMPRESSION
#      (compute-bound: auto against none);
#   4. a table last: each run's DiT phase per forward (streamed, coded,
#      link / bf16, staging, predicted, measured) against the bf16 link
#      limit max(resident DiT forward, streamed bf16 bytes / the pinned
#      bandwidth measured in the same process), and its whole request.
# Usage: bench/run-planned-compressed.sh [path/to/offload-bench]
# JSON and logs under $OUT (default /tmp/planned-compressed-out). Exit
# status 0 only if every run completed with its output equal to resident
# and every phase within its budget and bound.
#   BUDGETS=16GiB,8GiB  TOKENS=4608  STEPS=12  REQUESTS=2
#   WEIGHT_COMPRESSION=none,lossless,auto  CODED=/tmp/offload-flux.opackb
#   LATE_TOKENS=16896  LATE_BUDGETS=16GiB  LATE_COMPRESSION=none,auto  LATE_STEPS=6
#   BUDGET_S=540 (the deadline of everything, seconds)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${1:-}
if [ -z "$BIN" ]; then
  for c in "$HERE/offload-bench" "$HERE/../target/release/offload-bench"; do
    [ -x "$c" ] && BIN=$c && break
  done
fi
[ -n "$BIN" ] && [ -x "$BIN" ] || { echo "usage: $0 path/to/offload-bench (none found)" >&2; exit 2; }
OUT=${OUT:-/tmp/planned-compressed-out}
mkdir -p "$OUT"
BUDGETS=${BUDGETS:-16GiB,8GiB}
TOKENS=${TOKENS:-4608}
STEPS=${STEPS:-12}
REQUESTS=${REQUESTS:-2}
WEIGHT_COMPRESSION=${WEIGHT_COMPRESSION:-none,lossless,auto}
CODED=${CODED:-/tmp/offload-flux.opackb}
LATE_TOKENS=${LATE_TOKENS:-16896}
LATE_BUDGETS=${LATE_BUDGETS:-16GiB}
LATE_COMPRESSION=${LATE_COMPRESSION:-none,auto}
LATE_STEPS=${LATE_STEPS:-6}
BEGAN=$(date +%s)
DEADLINE=$((BEGAN + ${BUDGET_S:-540}))
left() { echo $((DEADLINE - $(date +%s))); }
stage() { echo "== [$(( $(date +%s) - BEGAN )) s] $*"; }
status=0
[ -f "$HERE/lib.sh" ] && . "$HERE/lib.sh" && cuda_libs
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%Y-%m-%dT%H:%M:%SZ; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if ls "$HERE"/gpu-* >/dev/null 2>&1; then
  stage "the GPU suite"
  gt=$(ls "$HERE"/gpu-* | head -1)
  timeout 200 "$gt" --test-threads 1 --nocapture > "$OUT/gpu-suite.log" 2>&1
  rc=$?
  echo "gpu suite rc=$rc"
  [ $rc -eq 0 ] || status=1
  grep -E "^test .*(ok|FAILED)|test result|planted .*caught|panicked|decoder .*GB/s|budget [0-9]+ B: DiT" "$OUT/gpu-suite.log" | cut -c1-260 | tail -40
fi

stage "whole requests: budgets $BUDGETS at $TOKENS tokens, weight_compression $WEIGHT_COMPRESSION"
timeout "$(left)" "$BIN" --pipeline --budgets "$BUDGETS" --tokens "$TOKENS" --steps "$STEPS" \
  --requests "$REQUESTS" --saved-from none --weight-compression "$WEIGHT_COMPRESSION" \
  --coded-blocks "$CODED" --json "$OUT/planned-$TOKENS.json" \
  >"$OUT/planned-$TOKENS.log" 2>"$OUT/planned-$TOKENS.err"
rc=$?
[ $rc -eq 0 ] || { echo "planned $TOKENS: exit $rc (see $OUT/planned-$TOKENS.err)"; tail -5 "$OUT/planned-$TOKENS.err"; status=1; }
grep -E "coded-block file|decoder writes|weight_compression" "$OUT/planned-$TOKENS.err" | cut -c1-260 | head -12

if [ "$(left)" -gt 150 ]; then
  stage "late: budgets $LATE_BUDGETS at $LATE_TOKENS tokens, weight_compression $LATE_COMPRESSION"
  timeout "$(left)" "$BIN" --pipeline --budgets "$LATE_BUDGETS" --tokens "$LATE_TOKENS" --steps "$LATE_STEPS" \
    --requests "$REQUESTS" --saved-from none --weight-compression "$LATE_COMPRESSION" \
    --coded-blocks "$CODED" --json "$OUT/planned-$LATE_TOKENS.json" \
    >"$OUT/planned-$LATE_TOKENS.log" 2>"$OUT/planned-$LATE_TOKENS.err"
  rc=$?
  [ $rc -eq 0 ] || { echo "planned $LATE_TOKENS: exit $rc (see $OUT/planned-$LATE_TOKENS.err)"; tail -5 "$OUT/planned-$LATE_TOKENS.err"; status=1; }
else
  stage "late: skipped, $(left) s left"
fi
stage "done; JSON and logs in $OUT"
echo

python3 - "$OUT"/planned-*.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        doc = json.load(open(path))
    except Exception as e:
        print(f"({path}: {e})")
        continue
    bw = doc.get("pinned_h2d_gbps", 0) * 1e9
    runs = doc.get("runs", [])
    def dit(run):
        ph = [p for p in run.get("phases", []) if p.get("component") == "transformer"]
        return ph[0] if ph else None
    res = next((r for r in runs if r.get("name") == "resident"), None)
    rp = dit(res) if res else None
    res_fwd = rp["seconds"] / max(rp["forwards"], 1) if rp else None
    print(f"{doc.get('device')}, {doc['shape']['tokens']} tokens, {doc['shape']['steps']} steps; pinned host→device {doc.get('pinned_h2d_gbps', 0):.2f} GB/s; resident DiT forward {res_fwd and f'{res_fwd:.4f}'} s, request {res and res.get('median_request_s') or 0:.3f} s")
    print("| run | DiT streamed / coded | link / bf16 | staging GB | DiT forward s | bf16 link limit s | forward / limit | predicted / measured forward | request s | output = resident | within budget and bound |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        if r.get("name") == "resident":
            continue
        p, plan = dit(r), r.get("plan") or {}
        comp = next((c for c in plan.get("components", []) if c.get("path") == "transformer"), None)
        if not p or not comp or res_fwd is None or not bw:
            print(f"| {r.get('name')} | – | – | – | – | – | – | – | – | – | {r.get('error') or 'no DiT phase'} |")
            continue
        fwd = p["seconds"] / max(p["forwards"], 1)
        limit = max(res_fwd, comp["streamed_bytes"] / bw)
        pred = comp["predicted_s"] / max(comp["forwards"], 1e-12)
        within = all(q.get("pool_within_budget") is not False and q.get("within_bound") is not False for q in r.get("phases", []))
        ratio = comp["link_bytes"] / max(comp["streamed_bytes"], 1)
        print(f"| {r['name']} | {comp['streamed_blocks']}/{comp['blocks']} / {len(comp.get('coded_blocks', []))} | {ratio:.3f} | {comp['peak'].get('staging_bytes', 0) / 1e9:.3f} | {fwd:.4f} | {limit:.4f} | {fwd / limit:.3f} | {pred / fwd:.3f} | {r.get('median_request_s', 0):.3f} | {r.get('output_equals_resident')} | {within} |")
    print()
PY
exit $status
