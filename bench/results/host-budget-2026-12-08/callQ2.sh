#!/usr/bin/env bash
# Call Q2 (2026-12-08, on Q1's warm machine): Q1's staged part ran past its
# 240 s limit at 5 steps x 2 repeats on this host (a 1.4 GB/s disk) and
# its logs did not come back; the same rows once, 3 timed steps, as the
# twenty-fourth session's call P2 ran them. Run as one command line:
O=$OUT; . bench/lib.sh; cuda_libs; t0=$(date +%s)
OUT="$O/staged" STEPS=3 REPEATS=1 MASTERS_FILE=/tmp/offload-masters.bin timeout 420 bash bench/run-staged.sh .bundle > "$O/staged-call.txt" 2>&1
echo "staged rc $? in $(( $(date +%s) - t0 )) s"; rm -f /tmp/offload-masters.bin; gzip -f $O/staged/*.json
grep -E "GB/s|masters file" "$O/staged/staged.err" | head -8 | cut -c1-400
sed -n '/^Staged masters/,$p' "$O/staged/staged.log" | cut -c1-330
