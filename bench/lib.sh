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
