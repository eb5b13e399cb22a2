#!/usr/bin/env bash
# The candle Flux DiT on a GPU, in one call, checking itself (run from the
# repository root or anywhere; the candle bundle is the folder of this
# script, $B). Steps, each under a timeout inside a BUDGET_S deadline:
#   1. a random-weight Flux.1-dev transformer written by diffusers'
#      save_pretrained, weights drawn from INIT (normal: the spread of
#      trained weights; uniform: diffusers' own initialisation);
#   2. for each latent grid of GRIDS (rows x cols, plus TEXT text tokens;
#      default 64x64 16x32 128x128 = 4,608, 1,024 and 16,896 tokens), the
#      same seeded inputs for both frameworks, then
#      - the diffusers peer (the first grid: from_pretrained + block-level
#        group offload set-up and steps, then resident; the others:
#        resident only), writing its output;
#      - offload-flux-bench: each fast path checked against candle's plain
#        operations on random inputs (flash attention against the unfused
#        one, the cuBLASLt bias epilogue against candle's Linear, the fused
#        AdaLN against norm, multiply and add, the fused q/k norm + RoPE,
#        gate + residual, GELU epilogue and GEMM-into-columns against
#        candle's operations written as diffusers computes: cosine >=
#        0.9999, max abs bounded; up to 4,608 tokens); offloaded (layerwise) and resident
#        steps, their outputs bit for bit, against diffusers' (cosine, max
#        abs); the resident step with each fast path switched off (what each
#        bought; the attention ones up to 4,608 tokens), compared with the
#        full one (cosine >= 0.999); the first grid also GROWTH offloaded
#        steps for memory growth and the request planner's BUDGETS (the
#        DiT enabled with each `device_budget`, the planner's inputs
#        measured by its warm-up: planned resident blocks, step against
#        the plan's and diffusers' group offload, output against
#        resident, the allocator's peak against the budget);
#   3. the planted build (skip-exit) on the grid of most tokens
#      (PLANTED_GRID; compute-bound, where the copy engine runs ahead): its
#      output must differ from resident;
#   4. a table of all of it, last, and the exit status: 0 only if every
#      check held.
# Logs and JSON under $OUT (logs in $OUT/logs); the checkpoint and inputs
# under $WORK.
#   INIT=normal GRIDS="64x64 16x32 128x128" TEXT=512 STEPS=5 GROWTH=200
#   NO_PEER=1 BUDGET_S=560 ATTENTION=auto (flash | unfused)
#   DEPTH=2 (the layerwise rows' prefetch_depth, 1 to 16) WARMUP=1 (untimed
#   offloaded steps first; at depth 16 the first timed step after one ran
#   short) CHECK_TOKENS=4608
#   (0: no kernel checks) ABLATION=true (false: no fast-path-off steps)
#   BUDGETS=16GiB,8GiB,auto  WEIGHT_COMPRESSION=none (lossless: the layerwise
#   rows' blocks coded at enable and decoded on the GPU beside candle)
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/candle-out}
W=${WORK:-/tmp/flux-work}
L="$OUT/logs"
mkdir -p "$OUT" "$W" "$L"
BEGAN=$(date +%s)
DEADLINE=$((BEGAN + ${BUDGET_S:-560}))
GRIDS=${GRIDS:-64x64 16x32 128x128}
TEXT=${TEXT:-512}
STEPS=${STEPS:-5}
INIT=${INIT:-normal}
ATTENTION=${ATTENTION:-auto}
BUDGETS=${BUDGETS:-16GiB,8GiB,auto}
# The peer's wheels (diffusers) travel in the bundle ($B/whl) or in .whl/.
for d in "$B/whl" .whl; do
  if ls "$d"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "$d"/*.whl >"$L/pip.log" 2>&1 \
      || tail -3 "$L/pip.log"
    export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
    break
  fi
done
# The binaries, gzipped in the bundle when that keeps it small.
for bin in offload-flux-bench offload-flux-bench-planted; do
  if [ -f "$B/$bin.gz" ]; then
    gzip -dc "$B/$bin.gz" >"$W/$bin" && chmod +x "$W/$bin"
  elif [ -f "$B/$bin" ]; then
    cp "$B/$bin" "$W/$bin"
  fi
done
# candle's CudaDevice loads cuBLAS, cuBLASLt and cuRAND (cudarc, at run
# time): make the toolkit's and the Python wheels' copies findable. The
# CUDA runtime is linked in statically.
. "$B/lib.sh"
cuda_libs
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "bundle: $B ($(cat "$B/BUILD" 2>/dev/null || echo 'no BUILD file'))"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
} | tee "$OUT/env.txt"

# Steps: a name, a timeout (capped by what is left of BUDGET_S), a command.
# Appends "name|exit|seconds" to $OUT/steps.txt; says so on stderr (stdout
# may be the step's JSON).
: >"$OUT/steps.txt"
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - $(date +%s) - 15))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then
    echo "== $name: skipped (out of time)" >&2
    echo "$name|skipped|0" >>"$OUT/steps.txt"
    return 1
  fi
  echo "== $name ($(date +%T), at most ${limit} s)" >&2
  local t0 code
  t0=$(date +%s)
  timeout "$limit" "$@"
  code=$?
  [ "$code" -eq 124 ] && echo "   timed out after $limit s" >&2
  echo "$name|$code|$(($(date +%s) - t0))" >>"$OUT/steps.txt"
  return $code
}

if [ ! -f "$W/flux/config.json" ] || ! grep -q "\"_offload_init\": \"$INIT\"" "$W/flux/config.json"; then
  rm -rf "$W/flux" "$W"/diffusers_*
  run_step "checkpoint ($INIT)" 200 sh -c "python3 '$B/flux_reference.py' make-checkpoint --init '$INIT' --out '$W/flux' \
    >'$OUT/checkpoint.json' 2>'$L/checkpoint.err'" || { tail -20 "$L/checkpoint.err"; }
fi
cat "$OUT/checkpoint.json" 2>/dev/null
ls -la "$W/flux"
cat "$W"/flux/*.safetensors >/dev/null # the page cache holds the checkpoint

first=""
for grid in $GRIDS; do
  rows=${grid%x*} cols=${grid#*x}
  tag="${rows}x${cols}"
  [ -z "$first" ] && first=$tag
  python3 "$B/flux_reference.py" make-inputs --out "$W/inputs_$tag.safetensors" --side "$cols" --rows "$rows" \
    --text "$TEXT" >"$L/inputs_$tag.json" || { echo "make-inputs $tag failed"; continue; }
  REF=()
  if [ -f "$W/diffusers_$tag.json" ] && [ -f "$W/diffusers_out_$tag.safetensors" ]; then
    cp "$W/diffusers_$tag.json" "$OUT/diffusers_$tag.json" # this machine ran the peer on this checkpoint already
  elif [ -z "${NO_PEER:-}" ]; then
    extra=()
    [ "$tag" != "$first" ] && extra=(--resident-only)
    run_step "diffusers $tag" 150 python3 "$B/flux_reference.py" bench --ckpt "$W/flux" \
      --inputs "$W/inputs_$tag.safetensors" --out "$W/diffusers_out_$tag.safetensors" --steps "$STEPS" "${extra[@]}" \
      >"$OUT/diffusers_$tag.json" 2>"$L/diffusers_$tag.err" || tail -5 "$L/diffusers_$tag.err"
    cat "$OUT/diffusers_$tag.json"
    cp "$OUT/diffusers_$tag.json" "$W/diffusers_$tag.json"
  fi
  [ -f "$W/diffusers_out_$tag.safetensors" ] && REF=(--reference "$W/diffusers_out_$tag.safetensors")
  growth=0 budgets=none
  [ "$tag" = "$first" ] && growth=${GROWTH:-200} budgets=$BUDGETS
  [ -f "$OUT/diffusers_$tag.json" ] && REF+=(--diffusers-json "$OUT/diffusers_$tag.json")
  run_step "candle $tag" 260 "$W/offload-flux-bench" --ckpt "$W/flux" --inputs "$W/inputs_$tag.safetensors" "${REF[@]}" \
    --steps "$STEPS" --growth-steps "$growth" --budgets "$budgets" --attention "$ATTENTION" \
    --depth "${DEPTH:-2}" --warmup "${WARMUP:-1}" --check-tokens "${CHECK_TOKENS:-4608}" --ablation "${ABLATION:-true}" \
    --weight-compression "${WEIGHT_COMPRESSION:-none}" --json "$OUT/candle_$tag.json" \
    >"$L/candle_$tag.out" 2>"$L/candle_$tag.err"
  tail -4 "$L/candle_$tag.err"
done
# The planted build on the grid of most tokens (PLANTED_GRID): the skipped
# exit wait lets the copy engine refill a slot candle still reads only where
# the copy engine runs ahead of compute (compute-bound); where the step is
# transfer-bound the refill comes blocks after the reads ended, and the bug
# cannot show (seen: 4,608 tokens at 0.145 s of compute to 0.43 s of copy).
planted=${PLANTED_GRID:-}
if [ -z "$planted" ]; then
  most=0
  for grid in $GRIDS; do
    n=$((${grid%x*} * ${grid#*x}))
    [ "$n" -gt "$most" ] && most=$n planted=$grid
  done
fi
if [ -x "$W/offload-flux-bench-planted" ] && [ -n "$planted" ] && [ -f "$W/inputs_$planted.safetensors" ]; then
  run_step "planted skip-exit $planted" 120 "$W/offload-flux-bench-planted" --ckpt "$W/flux" \
    --inputs "$W/inputs_$planted.safetensors" --plant skip-exit --steps 2 --growth-steps 0 --check-tokens 0 \
    --attention "$ATTENTION" --json "$OUT/planted.json" >"$L/planted.out" 2>"$L/planted.err" || tail -5 "$L/planted.err"
fi

echo "== table ($(($(date +%s) - BEGAN)) s in all; JSON and logs in $OUT)"
python3 - "$OUT" "$first" $GRIDS <<'PY'
import json, os, sys
out, first, grids = sys.argv[1], sys.argv[2], sys.argv[3:]
def load(n):
    try:
        with open(os.path.join(out, n)) as f:
            return json.load(f)
    except Exception as e:
        return {"error": f"{n}: {e}"}
def f(v, spec=".4f"):
    return "-" if v is None else (format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))
failures = []
steps = [l.rstrip("\n").split("|") for l in open(os.path.join(out, "steps.txt")) if l.strip()]
for name, code, secs in steps:
    if code != "0":
        failures.append(f"step `{name}` exit {code}")
c0 = load(f"candle_{first}.json")
print(f"checkpoint init: {c0.get('checkpoint_init')}; kernels: {c0.get('kernels')}; device: {c0.get('device')}")
print()
print("| tokens | candle resident s | diffusers resident s | candle / diffusers | candle offloaded s | limit s | step / limit "
      "| offloaded == resident | cosine vs diffusers (max abs) | unfused-attention step s | flash vs unfused forward cosine (max abs) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
checks = []
for g in grids:
    c, d = load(f"candle_{g}.json"), load(f"diffusers_{g}.json")
    cr, dr = c.get("resident_step_s"), d.get("resident_step_s")
    ratio = cr / dr if cr and dr else None
    cos = c.get("cosine_vs_diffusers")
    print(f"| {c.get('tokens', g)} | {f(cr)} | {f(dr)} | {f(ratio, '.3f')} | {f(c.get('offload_step_s'))} | {f(c.get('limit_s'))} "
          f"| {f(c.get('step_over_limit'), '.3f')} | {c.get('offload_equals_resident')} | {f(cos, '.6f')} ({f(c.get('max_abs_vs_diffusers'))}) "
          f"| {f(c.get('resident_step_unfused_s'))} | {f(c.get('cosine_flash_vs_unfused_forward'), '.6f')} ({f(c.get('max_abs_flash_vs_unfused_forward'))}) |")
    if "error" in c:
        failures.append(c["error"])
        continue
    failures += [f"{g}: {m}" for m in c.get("checks_failed", [])]
    if c.get("offload_equals_resident") is not True:
        failures.append(f"{g}: offloaded output differs from resident")
    if cos is not None and cos < 0.999:
        failures.append(f"{g}: cosine vs diffusers {cos} < 0.999")
    if cos is None and "error" not in d:
        failures.append(f"{g}: no comparison with diffusers")
    if "attention_check" in c:
        checks.append((g, c["attention_check"]))
print()
print("| tokens | depth | link GB/s | offloaded steps / limit (min-max) | resident steps s (min-max) |")
print("| --- | --- | --- | --- | --- |")
for g in grids:
    c = load(f"candle_{g}.json")
    off, res, lim = c.get("offload_steps_s") or [], c.get("resident_steps_s") or [], c.get("limit_s")
    if off and lim:
        print(f"| {c.get('tokens', g)} | {c.get('depth')} | {f(c.get('pinned_h2d_gb_s'), '.2f')} "
              f"| {min(off) / lim:.3f}-{max(off) / lim:.3f} | {f(min(res) if res else None)}-{f(max(res) if res else None)} |")
print()
for g in grids:
    c = load(f"candle_{g}.json")
    if c.get("weight_compression") == "lossless":
        print(f"lossless {c.get('tokens', g)} tokens: step / bf16 link {f(c.get('step_over_bf16_link'), '.3f')}, "
              f"link / bf16 {f(c.get('link_over_bf16'), '.4f')}, host masters / bf16 {f(c.get('host_masters_over_bf16'), '.4f')}, "
              f"enable {f(c.get('enable_s'))} s, decoder flag {c.get('decode_error')}, offloaded == resident {c.get('offload_equals_resident')}")
print()
for g, a in checks:
    for case in a["cases"]:
        print(f"flash vs unfused attention ({g} run, {a['tokens']} tokens, q/k spread {case['spread']}): cosine {case['cosine']:.7f}, "
              f"max abs {case['max_abs']:.2e} (max |out| {case['max_abs_unfused']:.3f}), flash {case['flash_ms']:.2f} ms, "
              f"unfused {case['unfused_ms']:.2f} ms per call: {'ok' if case['ok'] else 'FAILED'}")
for g in grids:
    c = load(f"candle_{g}.json")
    for case in c.get("kernel_checks", []):
        print(f"{case['what']}: cosine {case['cosine']:.7f}, max abs {case['max_abs']:.2e} "
              f"(max |plain| {case['max_abs_plain']:.3f}): {'ok' if case['ok'] else 'FAILED'}")
    if c.get("lt_gemms_offloaded_resident") is not None:
        print(f"{g}: cuBLASLt GEMMs offloaded / resident {c.get('lt_gemms_offloaded_resident')}, "
              f"fallbacks to candle {c.get('lt_fallbacks_offloaded_resident')}")
    if c.get("fused_launches_offloaded_resident") is not None:
        fb = c.get("fused_fallbacks_offloaded_resident") or []
        print(f"{g}: fused kernels offloaded / resident {c.get('fused_launches_offloaded_resident')}, "
              f"fallbacks to candle {fb}")
        if any(fb):
            failures.append(f"{g}: fused kernels fell back to candle's operations {fb}")
print()
print(f"what each fast path bought (resident step with it off; all on: {c0.get('kernels')}):")
print("| tokens | switched off | kernels | resident step s | all on s | cosine vs all on (max abs) |")
print("| --- | --- | --- | --- | --- | --- |")
for g in grids:
    c = load(f"candle_{g}.json")
    for a in c.get("ablation", []):
        print(f"| {c.get('tokens')} | {a['what']} | {a['kernels']} | {f(a['resident_step_s'])} | {f(c.get('resident_step_s'))} "
              f"| {f(a['cosine_vs_all'], '.6f')} ({f(a['max_abs_vs_all'])}) |")
print()
p, d0 = load("planted.json"), load(f"diffusers_{first}.json")
print(f"enable s {f(c0.get('enable_s'))} (in place / copied units {c0.get('units_registered_in_place')} / {c0.get('units_copied_to_pinned')}); "
      f"diffusers from_pretrained + group offload set-up s {f(d0.get('from_pretrained_s'))} + {f(d0.get('group_offload_setup_s'))}; "
      f"diffusers group-offload step s {f(d0.get('group_offload_step_s'))}")
print()
print(f"request planner budgets ({c0.get('tokens')} tokens, DiT only; step: median of the request's steps):")
print("| budget | planned resident blocks | depth | step s | predicted s | step / limit | step vs diffusers group offload | peak in use GB (budget) | peak <= budget | == resident |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in c0.get("budgets", []):
    if "error" in r:
        print(f"| {r['budget']} | FAILED: {r['error']} | - | - | - | - | - | - | - | - |")
        continue
    g, s = r.get("group_offload_step_s"), r.get("step_s")
    vs = f"{g / s:.2f}x faster ({g:.4f} s)" if g and s else "-"
    # The plan's limit: max(candle resident, its streamed bytes / the link).
    res, gb, sb = c0.get("resident_step_s"), c0.get("pinned_h2d_gb_s"), r.get("streamed_bytes_per_step")
    lim = max(res, (sb or 0) / (gb * 1e9)) if res and gb else None
    print(f"| {r['budget']} | {r.get('resident_blocks_text')} | {r.get('depth')} | {f(s)} | {f(r.get('predicted_step_s'))} "
          f"| {f(s / lim if s and lim else None, '.3f')} | {vs} "
          f"| {f((r.get('pool_used_peak_bytes') or 0) / 1e9, '.2f')} ({f((r.get('budget_bytes') or 0) / 1e9, '.2f')}) "
          f"| {r.get('peak_within_budget')} | {r.get('equals_resident')} |")
print()
print(f"growth over {c0.get('growth_steps')} steps: RSS / anon / device bytes {c0.get('growth_rss_bytes')} / "
      f"{c0.get('growth_anon_bytes')} / {c0.get('growth_device_bytes')}")
caught = p.get("offload_equals_resident")
print(f"planted skip-exit: offloaded equals resident = {caught} ({'caught' if caught is False else 'NOT caught'})")
if caught is not False:
    failures.append("planted skip-exit not caught")
if c0.get("growth_steps") and ((c0.get("growth_device_bytes") or 0) > 0 or (c0.get("growth_anon_bytes") or 0) > 1 << 20):
    failures.append("memory grew over the growth steps (device > 0 B or anonymous > 1 MiB)")
print("| step | exit | s |")
print("| --- | --- | --- |")
for name, code, secs in steps:
    print(f"| {name} | {code} | {secs} |")
print("RESULT: " + ("all checks held" if not failures else "FAILED: " + "; ".join(failures)))
sys.exit(1 if failures else 0)
PY
