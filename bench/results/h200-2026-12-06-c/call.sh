#!/usr/bin/env bash
# Call A (2026-12-06, tenth session): is the crossover's last 2 % the
# copies' or the engine's, and what does ~10,500 tokens give?
set -u
B=$(cd "$(dirname "$0")" && pwd)
cd "$B/.."
O=${OUT:-/tmp/outA}
mkdir -p "$O/cross" "$O/beside"
{
  nvidia-smi --query-gpu=name,driver_version,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
  date -u +%FT%TZ
  python3 -V
  python3 -c "import torch; print('torch', torch.__version__)"
  python3 -c "import diffusers; print('diffusers', diffusers.__version__)" 2>&1 | tail -1
  python3 -c "import safetensors; print('safetensors', safetensors.__version__)" 2>&1 | tail -1
} >"$O/env.txt" 2>&1
cat "$O/env.txt"
echo "== beside ($(date +%T))"
timeout 160 "$B/offload-bench" --tokens 4608,10752,11264,16896 --depths "" --repeats 2 --steps 3 --warmup 1 \
  --no-simulate --copy-beside --json "$O/beside/beside.json" >"$O/beside/beside.log" 2>"$O/beside/beside.err"
echo "beside rc $?"
echo "== crossover ($(date +%T))"
OUT="$O/cross" TOKENS=10240,10496,10752,11008,11264 REPEATS=3 BUDGET_S=215 SWEEP_S=210 \
  timeout 225 bench/run-crossover.sh "$B/offload-bench" >"$O/cross/table.txt" 2>&1
echo "cross rc $?"
echo "== probe ($(date +%T))"
timeout 130 python3 bench/interference_probe.py --seconds 1.0 --reps 2 --json "$O/probe.json" >"$O/probe.txt" 2>&1
echo "probe rc $?"
echo "== done ($(date +%T))"
grep -A8 "beside copies s" "$O/beside/beside.log"; grep -A8 "^Default layerwise at the chooser" "$O/beside/beside.log"
tail -12 "$O/cross/table.txt"
tail -25 "$O/probe.txt"
