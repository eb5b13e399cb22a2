#!/usr/bin/env bash
# Lossless weight compression on one GPU, in one call (issue 20's decode
# stage): the coded blocks decoded on the device by opk_decode_block
# (offload-cuda's CudaCodec), checked, then measured.
#   1. the GPU suite's compression tests (gpu-tests, the suite's test
#      binary): lossless layerwise bit-identical to resident, within INV-7
#      and under perturbation, 0 decode errors; the four planted
#      decode-transport bugs caught, each beside its clean control; and
#      device_basics;
#   2. decode_bench: the per-tensor and the coded-block kernels' throughput
#      (decoded bf16 bytes per second) on a Flux double and single block,
#      bit identity, the planted kernel checks;
#   3. offload-bench, DiT-only: --weight-compression none,lossless at
#      TOKENS (default 1,024, 4,608, 16,896 and three between), layerwise
#      at DEPTHS (default 2; one enable per depth and compression: a
#      lossless enable encodes every block), normal weights (--law);
#   4. a table last: per token count, none and lossless side by side
#      (link and host bytes against bf16, step, the bf16 link limit, step
#      against it, bit identity), then the decode rates.
# Usage: bench/run-compressed.sh [DIR]   DIR holds gpu-tests, offload-bench
# and decode_bench (default: beside this script, else target/release and
# target/release/examples). JSON and logs under $OUT (default
# /tmp/compressed-out). Exit status 0 only if every step passed.
#   TOKENS=1024,2048,4608,8192,12288,16896  DEPTHS=2  STEPS=3  WARMUP=1
#   LAW=normal  ITERS=50  COMPRESSIONS=none,lossless,auto  REPEATS=1
#   (auto: one enable per token count, from the resident step's traced
#   per-block compute there)
#   CODED_BLOCKS=/tmp/offload-flux.opackb: the lossless rows enable from this
#   coded-block file (written first from the loaded weights when absent, so
#   it is in the page cache), their coded masters registered in place
#   BUDGET_S=540 (every step together, seconds): TESTS_S=150, DECODE_S=70,
#   the sweep what is left (estimated on an H200: set-up and loading
#   ~60 s, resident ~25 s, none ~30 s, lossless ~60 s of encoding at
#   enable + ~30 s).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${1:-}
find_bin() {
  local name=$1
  for c in ${DIR:+"$DIR/$name"} "$HERE/$name" "$HERE/../target/release/$name" \
    "$HERE/../target/release/examples/$name"; do
    [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}
TESTS=$(find_bin gpu-tests) || TESTS=
BENCH=$(find_bin offload-bench) || BENCH=
DECODE=$(find_bin decode_bench) || DECODE=
OUT=${OUT:-/tmp/compressed-out}
mkdir -p "$OUT"
TOKENS=${TOKENS:-1024,2048,4608,8192,12288,16896}
DEPTHS=${DEPTHS:-2}
STEPS=${STEPS:-3}
WARMUP=${WARMUP:-1}
LAW=${LAW:-normal}
ITERS=${ITERS:-50}
BEGAN=$(date +%s)
DEADLINE=$((BEGAN + ${BUDGET_S:-540}))
left() { echo $((DEADLINE - $(date +%s))); }
status=0
# nvrtc (the decoder and the proxy's kernels) and cuBLAS (the proxy's
# GEMMs), from the toolkit or the Python wheels, found at run time.
. "$HERE/lib.sh"
cuda_libs
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "gpu-tests=${TESTS:-missing} offload-bench=${BENCH:-missing} decode_bench=${DECODE:-missing}"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
} | tee "$OUT/env.txt"

# A step: a name, a time limit (capped by what is left), a command; its
# stdout and stderr to $OUT/NAME.log; "name|exit|seconds" to steps.txt.
: >"$OUT/steps.txt"
run_step() {
  local name=$1 limit=$2
  shift 2
  local l
  l=$(left)
  [ "$limit" -le "$l" ] || limit=$l
  if [ "$limit" -lt 10 ]; then
    echo "== $name: skipped ($l s left of BUDGET_S)"
    echo "$name|skipped|0" >>"$OUT/steps.txt"
    status=1
    return
  fi
  echo "== $name (at most $limit s)"
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name|$rc|$(( $(date +%s) - t0 ))" >>"$OUT/steps.txt"
  if [ $rc -ne 0 ]; then
    echo "$name: exit $rc (see $OUT/$name.log)"
    tail -5 "$OUT/$name.log"
    status=1
  fi
}

if [ -n "$TESTS" ]; then
  run_step tests "${TESTS_S:-150}" "$TESTS" --test-threads 1 --nocapture \
    lossless_layerwise planted_decode_bugs device_basics
  grep -E '^(planted|perturbed|Lossless|test result|skipping)' "$OUT/tests.log" | head -20
else
  echo "== tests: gpu-tests not found"; status=1
fi
if [ -n "$DECODE" ]; then
  run_step decode "${DECODE_S:-70}" "$DECODE" --iters "$ITERS" --json "$OUT/decode.json"
else
  echo "== decode: decode_bench not found"; status=1
fi
if [ -n "$BENCH" ]; then
  run_step sweep "$(left)" "$BENCH" --tokens "$TOKENS" --depths "$DEPTHS" --no-planner \
    --weight-compression "${COMPRESSIONS:-none,lossless,auto}" --repeats "${REPEATS:-1}" \
    --law "$LAW" --steps "$STEPS" --warmup "$WARMUP" \
    --no-simulate --trace-dir "$OUT/traces" --coded-blocks "${CODED_BLOCKS:-/tmp/offload-flux.opackb}" \
    --json "$OUT/compressed.json"
else
  echo "== sweep: offload-bench not found"; status=1
fi
echo "== $(( $(date +%s) - BEGAN )) s; JSON and logs in $OUT"
cat "$OUT/steps.txt"
echo

# The table, last: from the JSON (python3's standard library), else the
# bench's own summary.
if command -v python3 >/dev/null 2>&1; then
  python3 - "$OUT/compressed.json" "$OUT/decode.json" <<'PY'
import json, sys
def load(p):
    try:
        with open(p) as f:
            return json.load(f)
    except Exception as e:
        print(f"({p}: {e})")
        return None
sweep, dec = load(sys.argv[1]), load(sys.argv[2])
if sweep:
    print(f"device {sweep.get('device')}; law {sweep.get('law')}; pinned host→device {sweep.get('pinned_h2d_gbps', 0):.2f} GB/s; streamed bf16 {sweep.get('streamed_bytes', 0) / 1e9:.2f} GB")
    res = {r["tokens"]: r for r in sweep["rows"] if r["depth"] == 0}
    print("| tokens | depth | compression | repeat | link / bf16 | host / bf16 | enable s | resident s | step s | bf16 link limit s | step / bf16 link | step / max(C, W/B) | decode errors | = resident |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = sorted((r for r in sweep["rows"] if r["depth"] > 0), key=lambda r: (r["tokens"], r["depth"], r["weight_compression"], r.get("repeat", 0)))
    for r in rows:
        link = r.get("link_over_bf16")
        err = r.get("decode_error")
        print(f"| {r['tokens']} | {r['depth']} | {r['weight_compression']} | {r.get('repeat', 0)} | {'1' if link is None else f'{link:.4f}'} | {r['host_over_bf16']:.4f} | {r['enable_s']:.2f} | {res.get(r['tokens'], {}).get('step_s', 0):.4f} | {r['step_s']:.4f} | {r['bf16_link_limit_s']:.4f} | {r['step_over_bf16_link']:.3f} | {r['ratio']:.3f} | {'–' if err is None else err} | {r['output_equals_resident']} |")
    # Spread over the repeats, and auto against the better of none and lossless.
    by = {}
    for r in rows:
        by.setdefault((r["tokens"], r["depth"], r["weight_compression"]), []).append(r["step_s"])
    print()
    print("| tokens | none s (spread) | lossless s (spread) | auto s (spread) | auto / min(none, lossless) |")
    print("| --- | --- | --- | --- | --- |")
    for t in sorted({k[0] for k in by}):
        cell = {}
        for c in ("none", "lossless", "auto"):
            v = [x for (tt, _, cc), xs in by.items() if tt == t and cc == c for x in xs]
            cell[c] = (min(v), max(v)) if v else None
        fmt = lambda c: "–" if cell[c] is None else f"{cell[c][0]:.4f}–{cell[c][1]:.4f} ({cell[c][1] / cell[c][0] - 1:.3f})"
        best = min((cell[c][0] for c in ("none", "lossless") if cell[c]), default=None)
        auto = "–" if cell["auto"] is None or best is None else f"{cell['auto'][0] / best:.3f}"
        print(f"| {t} | {fmt('none')} | {fmt('lossless')} | {fmt('auto')} | {auto} |")
if dec:
    print()
    print("| law | kernel | bytes / bf16 | decode TB/s (bf16 out) | bit-identical |")
    print("| --- | --- | --- | --- | --- |")
    for l in dec.get("laws", []):
        print(f"| {l['law']} | per-tensor (both blocks) | {l['ratio']:.4f} | {l['decode_bf16_tb_s']:.3f} | {l['bit_identical']} |")
        for b in l.get("blocks", []):
            print(f"| {l['law']} | opk_decode_block {b['block']} | {b['ratio']:.4f} | {b['decode_bf16_tb_s']:.3f} | {b['bit_identical']} |")
    print(f"decode_bench: {'all checks held' if not dec.get('failed') else 'FAILED: ' + '; '.join(dec['failed'])}")
PY
else
  grep -A30 '^Weight compression' "$OUT/sweep.log"
  grep -A10 '^| law' "$OUT/decode.log"
fi
exit $status
