#!/usr/bin/env bash
# `weight_compression` under a device budget on one GPU, in one call
# (issue 20, item 4: the request planner prices coded blocks):
#   1. offload-bench --pipeline: whole Flux.1-dev requests (CLIP-L, T5-XXL,
#      the DiT, the VAE; weights drawn N(0, 1/fan-in)) under BUDGETS at
#      TOKENS, each budget once per WEIGHT_COMPRESSION value (none,
#      lossless, auto; the resident run once), the coded runs from a
#      coded-block file of every stack's blocks (CODED, written first when
#      absent or not covering them; outside $OUT, so its ~24 GB do not
#      come back);
#   2. if at least LATE_MIN_S are left: the same at LATE_TOKENS for
#      LATE_COMPRESSION (compute-bound: does auto stay with none?), fewer
#      steps and requests, the coded-block file reused;
#   3. a table last (python3's standard library, from the JSON): each
#      run's DiT phase per forward (streamed and coded blocks, link / bf16,
#      staging, measured, the bf16 link limit max(resident DiT forward,
#      streamed bf16 / the pinned bandwidth measured in the same process),
#      measured / limit, predicted / measured) and its whole request.
# Usage: bench/run-planned-compressed.sh [path/to/offload-bench]   (default:
# the offload-bench beside this script, else target/release/offload-bench).
# JSON and logs under $OUT (default /tmp/planned-compressed-out); each
# stage's elapsed seconds on stdout. Exit status 0 only if stage 1
# completed and every run (of both stages) completed with its output equal
# to resident, every phase within its budget and INV-7 bound; a late stage
# cut short by the deadline is reported, and its completed runs judged.
#   BUDGETS=16GiB,8GiB  TOKENS=4608  STEPS= (the bench's 28)  REQUESTS=2
#   WEIGHT_COMPRESSION=none,lossless,auto
#   CODED=/tmp/offload-flux-pipeline.opackb (not the DiT-only mode's
#   /tmp/offload-flux.opackb: that one holds the DiT's blocks only)
#   LATE_TOKENS=16896  LATE_BUDGETS=16GiB  LATE_COMPRESSION=none,auto
#   LATE_STEPS=4  LATE_REQUESTS=1  LATE_MIN_S=75
#   BUDGET_S=400 (the deadline of everything, seconds)
#   SUITE=1: the GPU suite (the `gpu-*` test binary beside this script)
#   first, within SUITE_S=200 (off by default: it does not fit in 400 s
#   beside the rest)
# Estimated on an H200 (from earlier calls: weights load ~33 s, a
# coded-block file ~2.9 s/GB written, DiT forward 0.16 s resident, 0.17 s
# at 16 GiB and 0.32 s at 8 GiB uncoded at 4,608 tokens, 0.80 s at
# 16,896): stage 1 ~310 s (set-up and load ~40 s, the coded-block file
# ~95 s when absent, resident ~22 s, each 16 GiB run ~20-25 s, each 8 GiB
# run ~25-35 s); stage 2 ~80 s (load ~35 s, resident ~15 s, each run
# ~15 s). With the coded-block file already written, stage 1 is ~215 s.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
BIN=$(bench_bin "$HERE" "${1:-}") || exit 2
OUT=${OUT:-/tmp/planned-compressed-out}
mkdir -p "$OUT"
BUDGETS=${BUDGETS:-16GiB,8GiB}
TOKENS=${TOKENS:-4608}
STEPS=${STEPS:-}
REQUESTS=${REQUESTS:-2}
WEIGHT_COMPRESSION=${WEIGHT_COMPRESSION:-none,lossless,auto}
CODED=${CODED:-/tmp/offload-flux-pipeline.opackb}
LATE_TOKENS=${LATE_TOKENS:-16896}
LATE_BUDGETS=${LATE_BUDGETS:-16GiB}
LATE_COMPRESSION=${LATE_COMPRESSION:-none,auto}
LATE_STEPS=${LATE_STEPS:-4}
LATE_REQUESTS=${LATE_REQUESTS:-1}
LATE_MIN_S=${LATE_MIN_S:-75}
BEGAN=$(date +%s)
DEADLINE=$((BEGAN + ${BUDGET_S:-400}))
left() { echo $((DEADLINE - $(date +%s))); }
LAST=$BEGAN
# A stage's start, with the seconds since the start and since the last.
stage() {
  local now
  now=$(date +%s)
  echo "== [$((now - BEGAN)) s, +$((now - LAST)) s] $*"
  LAST=$now
}
status=0
cuda_libs
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%Y-%m-%dT%H:%M:%SZ; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
{ echo "bin=$BIN"; echo "budgets=$BUDGETS tokens=$TOKENS steps=${STEPS:-default} requests=$REQUESTS compression=$WEIGHT_COMPRESSION coded=$CODED"; echo "late: budgets=$LATE_BUDGETS tokens=$LATE_TOKENS steps=$LATE_STEPS requests=$LATE_REQUESTS compression=$LATE_COMPRESSION"; } > "$OUT/settings.txt"
if [ -f "$CODED" ]; then
  echo "coded-block file $CODED present ($(du -h "$CODED" | cut -f1)); the bench checks it covers the pipeline's blocks"
fi

if [ "${SUITE:-0}" = 1 ] && ls "$HERE"/gpu-* >/dev/null 2>&1; then
  stage "the GPU suite (SUITE=1)"
  gt=$(ls "$HERE"/gpu-* | head -1)
  timeout "${SUITE_S:-200}" "$gt" --test-threads 1 --nocapture > "$OUT/gpu-suite.log" 2>&1
  rc=$?
  echo "gpu suite rc=$rc"
  [ $rc -eq 0 ] || status=1
  grep -E "^test .*(ok|FAILED)|test result|planted .*caught|panicked|decoder .*GB/s" "$OUT/gpu-suite.log" | cut -c1-260 | tail -30
fi

# One pipeline run: its flags; JSON, stdout and stderr under $OUT by
# token count. Echoes the bench's exit status.
pipeline() {
  local tokens=$1 budgets=$2 compression=$3 steps=$4 requests=$5
  local name="planned-$tokens"
  local t
  t=$(left)
  if [ "$t" -le 0 ]; then
    echo "$name: no time left" >&2
    return 124
  fi
  timeout "$t" "$BIN" --pipeline --budgets "$budgets" --tokens "$tokens" \
    ${steps:+--steps "$steps"} --requests "$requests" --saved-from none \
    --weight-compression "$compression" --coded-blocks "$CODED" \
    --json "$OUT/$name.json" >"$OUT/$name.log" 2>"$OUT/$name.err"
}

# The bench's own timing lines of a run's stderr.
timings() {
  grep -E "^pinned host|^weights in host memory|^coded-block file|: [0-9.]+ s in all$|: enable [0-9.]+ s, request" "$1" | cut -c1-240
}

stage "1. whole requests: budgets $BUDGETS at $TOKENS tokens, ${STEPS:-28} steps, weight_compression $WEIGHT_COMPRESSION"
pipeline "$TOKENS" "$BUDGETS" "$WEIGHT_COMPRESSION" "$STEPS" "$REQUESTS"
rc=$?
timings "$OUT/planned-$TOKENS.err"
if [ $rc -ne 0 ]; then
  echo "stage 1 ($TOKENS tokens): exit $rc$([ $rc -eq 124 ] && echo ', cut short by BUDGET_S') (see $OUT/planned-$TOKENS.err)"
  tail -5 "$OUT/planned-$TOKENS.err" | cut -c1-400
  status=1
fi

if [ "$(left)" -ge "$LATE_MIN_S" ]; then
  stage "2. late: budgets $LATE_BUDGETS at $LATE_TOKENS tokens, $LATE_STEPS steps, weight_compression $LATE_COMPRESSION ($(left) s left)"
  pipeline "$LATE_TOKENS" "$LATE_BUDGETS" "$LATE_COMPRESSION" "$LATE_STEPS" "$LATE_REQUESTS"
  rc=$?
  timings "$OUT/planned-$LATE_TOKENS.err"
  if [ $rc -eq 124 ]; then
    echo "stage 2 ($LATE_TOKENS tokens): cut short by BUDGET_S; its completed runs are judged below"
  elif [ $rc -ne 0 ]; then
    echo "stage 2 ($LATE_TOKENS tokens): exit $rc (see $OUT/planned-$LATE_TOKENS.err)"
    tail -5 "$OUT/planned-$LATE_TOKENS.err" | cut -c1-400
    status=1
  fi
else
  stage "2. late: skipped, $(left) s left (LATE_MIN_S=$LATE_MIN_S)"
fi
stage "done in $(( $(date +%s) - BEGAN )) s; JSON and logs in $OUT"
echo

# The table, last: from the JSON; exit 1 if a run failed, differs from
# resident or broke its budget or bound.
jsons=()
for t in "$TOKENS" "$LATE_TOKENS"; do
  [ -f "$OUT/planned-$t.json" ] && jsons+=("$OUT/planned-$t.json")
done
if [ ${#jsons[@]} -eq 0 ]; then
  echo "no JSON written"
  exit 1
fi
python3 - "${jsons[@]}" <<'PY'
import json, sys
bad = []
def f(v, d=4):
    return "–" if v is None else f"{v:.{d}f}"
for path in sys.argv[1:]:
    try:
        doc = json.load(open(path))
    except Exception as e:
        print(f"({path}: {e})")
        bad.append(path)
        continue
    runs = doc.get("runs", [])
    shape = doc.get("shape", {})
    res = next((r for r in runs if r.get("name") == "resident"), None)
    res_dit = next((r["dit"]["resident_forward_s"] for r in runs if r.get("dit")), None)
    cf = doc.get("coded_blocks_file") or {}
    coded = ""
    if cf:
        coded = f"; coded-block file {cf.get('covered')}/{cf.get('blocks')} blocks, {cf.get('coded_bytes', 0) / 1e9:.2f} of {cf.get('decoded_bytes', 0) / 1e9:.2f} GB"
        coded += f", written in {cf['write_s']:.1f} s ({cf.get('written')})" if cf.get("write_s") is not None else ", reused"
    print(f"**{shape.get('tokens')} tokens × {shape.get('steps')} steps** on {doc.get('device')}: pinned host→device {doc.get('pinned_h2d_gbps', 0):.2f} GB/s; resident DiT forward {f(res_dit)} s, request {f(res and res.get('median_request_s'), 3)} s{coded}{'' if doc.get('complete') else '; INCOMPLETE (cut short)'}")
    print()
    print("| run | compression | DiT streamed / coded | link / bf16 | staging GB | decode s / forward (plan) | DiT forward s | bf16 link limit s | forward / limit | predicted / measured | enable s | request s | output = resident | within budget, bound | run s | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        ph = r.get("phases", [])
        within = all(q.get("pool_within_budget") is not False and q.get("info_within_budget") is not False and q.get("within_bound") is not False for q in ph)
        same = r.get("output_equals_resident")
        ok = r.get("error") is None and same is not False and within and r.get("outputs_agree", True)
        if not ok:
            bad.append(f"{shape.get('tokens')}: {r.get('name')}")
        d = r.get("dit")
        err = (r.get("error") or "").replace("|", "/")[:120]
        eq = "(reference)" if r.get("name") == "resident" else {True: "yes", False: "NO", None: "–"}[same]
        if d:
            dit = f"{d['streamed_blocks']}/{d['blocks']} / {d['coded_blocks']} | {d['link_over_bf16']:.3f} | {d['staging_bytes'] / 1e9:.3f} | {d['decode_s_per_forward']:.4f} | {f(d['forward_s'])} | {d['bf16_link_limit_s']:.4f} | {f(d['forward_over_limit'], 3)} | {f(d['predicted_over_measured'], 3)}"
        else:
            dit = " | ".join(["–"] * 8)
        print(f"| {r.get('name')} | {r.get('weight_compression')} | {dit} | {r.get('enable_s', 0):.2f} | {r.get('median_request_s', 0):.3f} | {eq} | {'yes' if within else 'NO'} | {r.get('wall_s', 0):.1f} | {err} |")
    print()
print("DiT forward = the instrumented request's DiT phase / its forwards (cold first fill included); forward / limit below 1: faster than bf16 streaming can be")
if bad:
    print("FAILED: " + "; ".join(bad))
    sys.exit(1)
print("every run completed, equal to resident, within its budget and bound")
PY
[ $? -eq 0 ] || status=1
exit $status
