#!/usr/bin/env bash
# Fuzzes one target for SECONDS on one core at low priority:
#   offload-fuzz/fuzz/run.sh TARGET SECONDS
# New inputs go to work/TARGET (not checked in), crashes to
# artifacts/TARGET/, the log to logs/TARGET.log; MAX_LEN (default 8192)
# bounds an input (70000 for the packed targets, whose seeds are 57-61 KB).
set -euo pipefail
cd "$(dirname "$0")"
t=$1
secs=${2:-600}
bin=target/x86_64-unknown-linux-gnu/release/$t
mkdir -p "work/$t" "artifacts/$t" logs
# -fork=1 -ignore_crashes=1: a crash is saved and the run goes on, so one
# bug does not end the minutes; -rss_limit_mb bounds the whole process.
exec nice -n 10 "$bin" -fork=1 -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1 \
  -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -max_len="${MAX_LEN:-8192}" \
  -print_final_stats=1 -artifact_prefix="artifacts/$t/" \
  "work/$t" "../corpus/$t" >"logs/$t.log" 2>&1
