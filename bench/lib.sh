# Shared by the bench/run-*.sh scripts (sourced; bundles carry it beside
# them): the CUDA libraries found at run time (nvrtc for the decoder and the
# proxy's kernels, cuBLAS/cuBLASLt for the GEMMs, cuRAND for candle), from
# the toolkit or the Python wheels, put on LD_LIBRARY_PATH.
cuda_libs() {
  local libs
  libs=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /opt \
    $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) \
    \( -name 'libnvrtc.so*' -o -name 'libcublasLt.so*' -o -name 'libcublas.so*' -o -name 'libcurand.so*' \) 2>/dev/null \
    | grep -v /stubs/ | xargs -r -n1 dirname | sort -u | tr '\n' ':')
  export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:-}"
}

# The whole GPU suite from a bundle (the `gpu-*` test binary beside this
# file), as the session calls record it: the machine's name, driver and
# date in $OUT/machine.txt, the suite's log in $OUT/gpu-suite.log, its
# exit status and seconds on stdout.
gpu_suite() {
  export OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%Y-%m-%dT%H:%M:%SZ; } | tee "$OUT/machine.txt"
  cuda_libs
  local gt start
  gt=$(ls ./gpu-* | head -1)
  start=$(date +%s)
  timeout 420 "$gt" --test-threads 1 --nocapture > "$OUT/gpu-suite.log" 2>&1
  echo "gpu suite rc=$? in $(( $(date +%s) - start )) s"
}

# The suite log's summary lines.
gpu_suite_summary() {
  grep -E "^test |test result|planted .*caught|page-locked peak|panicked" "$OUT/gpu-suite.log" | cut -c1-300 | tail -30
}

# The offload-bench a script runs, echoed: the path given ($2), else the
# one beside the script ($1: a bundle), else target/release's. None found:
# a usage line on stderr and status 2.
bench_bin() {
  local here=$1 given=${2:-} c
  if [ -n "$given" ]; then
    [ -f "$given" ] && [ -x "$given" ] && { echo "$given"; return 0; }
    echo "usage: $(basename "$0") path/to/offload-bench ($given is not an executable)" >&2
    return 2
  fi
  for c in "$here/offload-bench" "$here/../target/release/offload-bench"; do
    [ -f "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  echo "usage: $(basename "$0") path/to/offload-bench (none found beside it or in target/release)" >&2
  return 2
}
