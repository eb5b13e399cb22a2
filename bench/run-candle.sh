#!/usr/bin/env bash
# The candle Flux DiT on a GPU, in one call (from the repository root, the
# candle bundle carried in $B): a random-weight Flux.1-dev transformer
# written by diffusers' save_pretrained, seeded inputs, the diffusers peer
# (from_pretrained + group offload set-up and steps, resident output), then
# offload-flux-bench on the same checkpoint and inputs. Logs and JSON under
# $OUT; a short table last.
#   SIDE=64 TEXT=512 (4,608 tokens)  STEPS=5  GROWTH=1000  NO_PEER=1
#   EXTRA_SIDES="32" (more token counts: the benchmark alone, no peer)
# $OUT keeps the JSON and env.txt; logs go to $WORK/logs.
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/candle-out}
W=${WORK:-/tmp/flux-work}
L="$W/logs"
mkdir -p "$OUT" "$W" "$L"
if [ -d .whl ]; then
  python3 -m pip install --no-index --no-deps .whl/*.whl >"$L/pip.log" 2>&1 || tail -3 "$L/pip.log"
fi
# candle's CudaDevice loads cuBLAS, cuBLASLt and cuRAND (cudarc, at run
# time): make the toolkit's and the Python wheels' copies findable.
LIBS=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /opt \
  $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) \
  \( -name 'libcurand.so*' -o -name 'libcublasLt.so*' -o -name 'libcublas.so*' -o -name 'libnvrtc.so*' \) 2>/dev/null \
  | grep -v /stubs/ | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
} | tee "$OUT/env.txt"
step() { echo "== $1 ($(date +%T))"; }
step checkpoint
if [ ! -f "$W/flux/config.json" ]; then
  python3 "$B/flux_reference.py" make-checkpoint --out "$W/flux" >"$OUT/checkpoint.json" 2>"$L/checkpoint.err" \
    || { tail -20 "$L/checkpoint.err"; exit 1; }
fi
cat "$OUT/checkpoint.json" 2>/dev/null; ls -la "$W/flux"
python3 "$B/flux_reference.py" make-inputs --out "$W/inputs.safetensors" --side "${SIDE:-64}" --text "${TEXT:-512}" \
  | tee "$L/inputs.json"
cat "$W"/flux/*.safetensors >/dev/null # the page cache holds the checkpoint (diffusers just wrote it)
REF=()
if [ -f "$W/diffusers.json" ] && [ -f "$W/diffusers_out.safetensors" ]; then
  cp "$W/diffusers.json" "$OUT/diffusers.json" # this machine ran the peer on this checkpoint already
  REF=(--reference "$W/diffusers_out.safetensors")
elif [ -z "${NO_PEER:-}" ]; then
  step diffusers
  python3 "$B/flux_reference.py" bench --ckpt "$W/flux" --inputs "$W/inputs.safetensors" \
    --out "$W/diffusers_out.safetensors" --steps "${STEPS:-5}" >"$OUT/diffusers.json" 2>"$L/diffusers.err" \
    || tail -20 "$L/diffusers.err"
  cat "$OUT/diffusers.json"
  cp "$OUT/diffusers.json" "$W/diffusers.json"
  [ -f "$W/diffusers_out.safetensors" ] && REF=(--reference "$W/diffusers_out.safetensors")
fi
step offload-flux-bench
RUST_LOG=info "$B/offload-flux-bench" --ckpt "$W/flux" --inputs "$W/inputs.safetensors" "${REF[@]}" \
  --steps "${STEPS:-5}" --growth-steps "${GROWTH:-1000}" --json "$OUT/candle.json" >"$L/candle.out" 2>"$L/candle.err"
rc=$?
tail -5 "$L/candle.err"
if [ -x "$B/offload-flux-bench-planted" ]; then
  step planted
  "$B/offload-flux-bench-planted" --ckpt "$W/flux" --inputs "$W/inputs.safetensors" --plant skip-exit \
    --steps 2 --growth-steps 0 --json "$OUT/planted.json" >"$L/planted.out" 2>"$L/planted.err" || tail -5 "$L/planted.err"
fi
for side in ${EXTRA_SIDES:-}; do
  step "offload-flux-bench, side $side"
  python3 "$B/flux_reference.py" make-inputs --out "$W/inputs$side.safetensors" --side "$side" --text "${TEXT:-512}" >/dev/null
  "$B/offload-flux-bench" --ckpt "$W/flux" --inputs "$W/inputs$side.safetensors" --steps "${STEPS:-5}" --growth-steps 0 \
    --json "$OUT/candle_side$side.json" >"$L/candle$side.out" 2>"$L/candle$side.err" || tail -5 "$L/candle$side.err"
done
step table
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception as e:
        return {"error": str(e)}
c, d, p = load("candle.json"), load("diffusers.json"), load("planted.json")
rows = [
    ("tokens", c.get("tokens")),
    ("checkpoint GB / files", f'{c.get("checkpoint_bytes", 0)/1e9:.2f} / {c.get("checkpoint_files")}'),
    ("pinned H2D GB/s", c.get("pinned_h2d_gb_s")),
    ("enable s (ours)", c.get("enable_s")),
    ("  units in place / copied (GB copied)", f'{c.get("units_registered_in_place")} / {c.get("units_copied_to_pinned")} ({c.get("bytes_copied_to_pinned", 0)/1e9:.3f})'),
    ("  RSS / anon added GB", f'{c.get("enable_rss_added_bytes", 0)/1e9:.3f} / {c.get("enable_anon_added_bytes", 0)/1e9:.3f}'),
    ("diffusers from_pretrained + group offload s", f'{d.get("from_pretrained_s")} + {d.get("group_offload_setup_s")}'),
    ("candle offload step s", c.get("offload_step_s")),
    ("candle resident step s", c.get("resident_step_s")),
    ("limit s", c.get("limit_s")),
    ("step / limit", c.get("step_over_limit")),
    ("offloaded == resident (bits)", c.get("offload_equals_resident")),
    ("cosine vs diffusers (offloaded / resident)", f'{c.get("cosine_vs_diffusers")} / {c.get("cosine_resident_vs_diffusers")}'),
    ("max |diff| vs diffusers", c.get("max_abs_vs_diffusers")),
    ("diffusers resident / group-offload step s", f'{d.get("resident_step_s")} / {d.get("group_offload_step_s")}'),
    ("growth steps, s/step", f'{c.get("growth_steps")}, {c.get("growth_step_s")}'),
    ("growth RSS / anon / device bytes", f'{c.get("growth_rss_bytes")} / {c.get("growth_anon_bytes")} / {c.get("growth_device_bytes")}'),
    ("planted skip-exit: still equals resident?", p.get("offload_equals_resident")),
    ("views cached (main / growth)", f'{c.get("zero_copy_views_cached")} / {c.get("growth_views_cached")}'),
]
for name in sorted(os.listdir(out)):
    if name.startswith("candle_side"):
        e = load(name)
        rows.append((f'{e.get("tokens")} tokens: offload / resident / limit s, ratio',
                     f'{e.get("offload_step_s")} / {e.get("resident_step_s")} / {e.get("limit_s")}, {e.get("step_over_limit")}'
                     f' (bits equal: {e.get("offload_equals_resident")})'))
for k, v in rows:
    print(f"{k:<46} {v}")
PY
exit $rc
