#!/usr/bin/env bash
# The crossover sweep on one GPU, in one call (issue 20, item 1):
#   1. offload-bench, DiT-only: the pinned link measured in the same
#      process (a fresh buffer and the host masters back to back), the
#      resident step at every token count of TOKENS (default every 1,024
#      from 1,024 to 16,896), then default layerwise at the look-ahead the
#      chooser picks from the resident step's traced per-block compute
#      (`budget::choose_lookahead`, up to depth 16), REPEATS times (default
#      3) in the one process; no fixed-depth rows, no simulator rows;
#   2. offload-bench --pipeline: whole Flux.1-dev requests under BUDGETS
#      (default 16GiB,8GiB) at BUDGET_TOKENS (default 4,608), against
#      resident;
#   3. a table last: tokens, step, limit, step / limit (and its spread over
#      the repeats), the same against the limit at the link measured right
#      after each row's steps (the link drifts over a sweep), the planned
#      look-ahead, the device memory its slots
#      take and the peak device weight bytes; then the budget rows (the
#      DiT phase per forward against max(resident DiT forward, streamed /
#      bandwidth)).
# Usage: bench/run-crossover.sh [path/to/offload-bench]   (default: the
# offload-bench beside this script, else target/release/offload-bench).
# JSON and logs under $OUT (default /tmp/crossover-out). Exit status 0 only
# if both runs completed with every output equal to resident.
#   TOKENS=1024,2048,...  REPEATS=3  STEPS=3  WARMUP=1
#   BUDGETS=16GiB,8GiB  BUDGET_TOKENS=4608  BUDGET_STEPS=12  REQUESTS=2
#   ATTENTION=flash (the proxy's attention, `--attention`: flash or
#   materialized; both runs)
#   BUDGET_S=400 (the deadline of both runs together, seconds), of which
#   SWEEP_S=270 at most for the sweep (estimated on an H200: ~40 s of set-up,
#   ~35 s resident, ~150 s for the 3 × 17 layerwise rows; the budgets ~100 s)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
BIN=$(bench_bin "$HERE" "${1:-}") || exit 2
OUT=${OUT:-/tmp/crossover-out}
mkdir -p "$OUT"
if [ -z "${TOKENS:-}" ]; then
  TOKENS=$(seq -s, 1024 1024 16384),16896
fi
REPEATS=${REPEATS:-3}
STEPS=${STEPS:-3}
WARMUP=${WARMUP:-1}
BUDGETS=${BUDGETS:-16GiB,8GiB}
BUDGET_TOKENS=${BUDGET_TOKENS:-4608}
BUDGET_STEPS=${BUDGET_STEPS:-12}
REQUESTS=${REQUESTS:-2}
ATTENTION=${ATTENTION:-flash}
BEGAN=$(date +%s)
DEADLINE=$((BEGAN + ${BUDGET_S:-400}))
left() { echo $((DEADLINE - $(date +%s))); }
status=0

echo "== sweep: default layerwise at the chooser's look-ahead, tokens $TOKENS, $REPEATS repeats, $ATTENTION attention"
sweep_s=${SWEEP_S:-270}
[ "$sweep_s" -lt "$(left)" ] || sweep_s=$(left)
timeout "$sweep_s" "$BIN" --tokens "$TOKENS" --depths "" --repeats "$REPEATS" --attention "$ATTENTION" \
  --steps "$STEPS" --warmup "$WARMUP" --no-simulate \
  --json "$OUT/crossover.json" >"$OUT/crossover.log" 2>"$OUT/crossover.err"
rc=$?
[ $rc -eq 0 ] || { echo "sweep: exit $rc (see $OUT/crossover.err)"; tail -3 "$OUT/crossover.err"; status=1; }

echo "== budgets $BUDGETS at $BUDGET_TOKENS tokens (pipeline mode)"
if [ "$(left)" -gt 30 ]; then
  timeout "$(left)" "$BIN" --pipeline --budgets "$BUDGETS" --tokens "$BUDGET_TOKENS" --attention "$ATTENTION" \
    --steps "$BUDGET_STEPS" --requests "$REQUESTS" --saved-from none \
    --json "$OUT/budgets.json" >"$OUT/budgets.log" 2>"$OUT/budgets.err"
  rc=$?
  [ $rc -eq 0 ] || { echo "budgets: exit $rc (see $OUT/budgets.err)"; tail -3 "$OUT/budgets.err"; status=1; }
else
  echo "budgets: skipped, $(left) s left of BUDGET_S"; status=1
fi
echo "== $(( $(date +%s) - BEGAN )) s; JSON and logs in $OUT"
echo

# The table, last: from the JSON (python3's standard library), else the
# bench's own summary lines.
if command -v python3 >/dev/null 2>&1; then
  python3 - "$OUT/crossover.json" "$OUT/budgets.json" <<'PY'
import json, statistics, sys
def load(p):
    try:
        with open(p) as f:
            return json.load(f)
    except Exception as e:
        print(f"({p}: {e})")
        return None
sweep, budgets = load(sys.argv[1]), load(sys.argv[2])
if sweep:
    print(f"device {sweep.get('device')}; pinned host→device {sweep.get('pinned_h2d_gbps', 0):.2f} GB/s (fresh buffer), {sweep.get('master_h2d_gbps', 0):.2f} GB/s (host masters)")
    rows = [r for r in sweep["rows"] if r.get("lookahead")]
    by = {}
    for r in rows:
        by.setdefault(r["tokens"], []).append(r)
    print("| tokens | step s | limit s | step / limit | spread | step / the row's own link limit | its spread | row link GB/s | runs | look-ahead (depth) | slots | slot memory GB | peak device weight GB | output = resident |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    worst, worst_row = 0.0, 0.0
    for t in sorted(by):
        rs = by[t]
        ratios = [r["ratio"] for r in rs]
        step = statistics.median(r["step_s"] for r in rs)
        l = rs[0]["lookahead"]
        ratio = step / rs[0]["limit_s"]
        worst = max(worst, max(ratios))
        own = [r["ratio_row_link"] for r in rs if r.get("ratio_row_link")]
        links = [r["row_link_gbps"] for r in rs if r.get("row_link_gbps")]
        if own:
            worst_row = max(worst_row, max(own))
            own_s = f"{statistics.median(own):.3f} | {max(own) - min(own):.3f} | {min(links):.2f}-{max(links):.2f}"
        else:
            own_s = "– | – | –"
        print(f"| {t} | {step:.4f} | {rs[0]['limit_s']:.4f} | {ratio:.3f} | {max(ratios) - min(ratios):.3f} | {own_s} | {len(rs)} | {l['depth']} | {l['slots']} | {l['slot_memory_bytes'] / 1e9:.2f} | {max(r['peak_device_weight_bytes'] for r in rs) / 1e9:.2f} | {all(r['output_equals_resident'] for r in rs)} |")
    own_worst = f"{worst_row:.3f}" if worst_row else "– (no row measured its link)"
    print(f"worst step / limit of any run: {worst:.3f}; against the row's own link: {own_worst} (target ≤ 1.02; spread target ≤ 0.01)")
if budgets:
    runs = budgets.get("runs", [])
    bw = budgets.get("pinned_h2d_gbps", 0) * 1e9
    def dit(run):
        ph = [p for p in run.get("phases", []) if p.get("component") == "transformer"]
        return ph[0] if ph else None
    res = next((r for r in runs if r.get("name") == "resident"), None)
    rp = dit(res) if res else None
    print()
    print("| budget | DiT forward s | limit s | step / limit | DiT mode | depth | slots × slot GB | largest phase in use GB | output = resident |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        if r.get("name") == "resident" or not r.get("device_budget"):
            continue
        p, plan = dit(r), r.get("plan") or {}
        comp = next((c for c in plan.get("components", []) if c.get("path") == "transformer"), None)
        if not p or not comp or not rp or not bw:
            print(f"| {r.get('device_budget')} | – | – | – | {r.get('error') or 'no DiT phase'} | | | | |")
            continue
        step = p["seconds"] / max(p["forwards"], 1)
        limit = max(rp["seconds"] / max(rp["forwards"], 1), comp["streamed_bytes"] / bw)
        peak = max(q["pool_used_peak_bytes"] for q in r["phases"]) / 1e9
        print(f"| {r['device_budget']} | {step:.4f} | {limit:.4f} | {step / limit:.3f} | {comp['mode']} {comp['streamed_blocks']}/{comp['blocks']} streamed | {comp['depth']} | {comp['slots']} × {comp['slot_bytes'] / 1e9:.3f} | {peak:.2f} | {r.get('output_equals_resident')} |")
    print("(the DiT phase per forward includes its first forward's cold fill; target ≤ 1.02)")
PY
else
  grep -A30 '^Default layerwise at the chooser' "$OUT/crossover.log"
  grep -A10 '^Whole requests' "$OUT/budgets.log"
fi
exit $status
