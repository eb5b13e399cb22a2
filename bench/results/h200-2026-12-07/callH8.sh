#!/usr/bin/env bash
# Call H8: on an H200, issue 20's sweep and budgets (callH1.sh); on any
# other card, the A/B of the last post-forward's loop (callH7.sh).
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "H200: callH1"; BUDGET_S=${H1_S:-480} SWEEP_S=${SW_S:-300} OUT=${OUT:-/tmp/out} bash "$R/.bundle/callH1.sh"
else
  echo "not an H200: callH7"; OUT=${OUT:-/tmp/out} bash "$R/.bundle/callH7.sh"
fi
