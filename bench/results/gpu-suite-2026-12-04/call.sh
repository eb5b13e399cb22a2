#!/usr/bin/env bash
# Call S17: the whole GPU suite on the session's final code (refused pins
# release pages the budget has no room for; the sim profile's fill rate),
# then the two probes again (P1's spread across calls, P2's file part).
# As run, with the suite's preamble since moved into bench/lib.sh
# (`gpu_suite`, `gpu_suite_summary`).
set -u
B=$(cd "$(dirname "$0")" && pwd)
cd "$B"
. ./lib.sh
gpu_suite
timeout 100 ./stage-probe > "$OUT/stage-probe.txt" 2>&1; echo "stage-probe rc=$?"
PROBE_FILE="$B/register-probe.bin" timeout 100 ./register-probe > "$OUT/register-probe.txt" 2>&1; echo "register-probe rc=$?"
rm -f "$B/register-probe.bin"
gpu_suite_summary
cat "$OUT/stage-probe.txt" "$OUT/register-probe.txt"
