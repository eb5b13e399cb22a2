#!/usr/bin/env bash
# The GPU suite at the build in .bundle/BUILD.
cd "$(dirname "$0")/.."; O=${OUT:-/tmp/outS2}; mkdir -p "$O"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; cat .bundle/BUILD; } | tee "$O/env.txt"
t0=$(date +%s); timeout 200 .bundle/gpu-tests --test-threads 1 >"$O/suite.log" 2>&1
echo "suite rc $? in $(( $(date +%s) - t0 )) s"; grep -E "^test .* (ok|FAILED)$|^test result|panicked" "$O/suite.log" | tail -30
