//! `cargo xtask gpu-test --bundle DIR`: everything the GPU suite and the
//! benchmark need on a CUDA machine with no Rust toolchain.
//!
//! DIR holds `cargo-nextest`, `gpu-suite.tar.zst` (a nextest archive of the
//! GPU suite and the CUDA backend's tests), `gpu-tests` (the suite's test
//! binary, for `compute-sanitizer`), `offload-bench`,
//! `offload-bench-planted` (the benchmark with `--features planted-bugs`),
//! `offload-launch` and `offload-dist-check` (the NCCL checks), `peers/`
//! and `run.sh`:
//!
//! * `run.sh tests` runs the suite and prints `N passed, M failed`;
//! * `run.sh sanitize` runs the drop tests, then the suite, under memcheck,
//!   and the suite under racecheck and synccheck;
//! * `run.sh bench` runs the benchmark, the planted benchmark, the peer;
//! * `run.sh all` runs tests, memcheck of the drop tests, bench, and prints
//!   a summary table; every step has an explicit timeout, 530 s in all;
//! * `run.sh dlo-all` (two GPUs or more) runs tests, the NCCL checks under
//!   `offload-launch`, the distributed layerwise benchmark, its planted
//!   collective bug and the FSDP2 peer, and prints a summary table;
//! * `run.sh pipeline` runs the whole-request benchmark (`offload-bench
//!   --pipeline`: Flux.1-dev's encoders, 28 steps and decode under the
//!   24/16/12/8 GiB budgets and `auto` beside a process holding 110 GiB,
//!   against resident) and then the diffusers whole-request peer, and
//!   prints a summary; under 9 minutes on one H200 (expected about 6.5).
//!
//! Executables are found through cargo's `--message-format json`, so the
//! bundle builds with any `CARGO_TARGET_DIR`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::Value;

const RUN_SH: &str = r#"#!/bin/sh
# The offload GPU bundle. Usage: run.sh tests | sanitize | bench | all | dlo | dlo-all | pipeline
# (pipeline: whole Flux.1-dev requests under device budgets + the diffusers
# pipeline peer, whose wheels the caller installs first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#       --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# PIPELINE_TIMEOUT=290, PIPELINE_PEER_TIMEOUT=240 (530 s in all: under 9
# min; expected ~3.5 + ~3 min), PIPELINE_BUDGETS, PIPELINE_STEPS=28,
# PIPELINE_REQUESTS=2, HOG_GIB=110 (0: `auto` alone), NO_PEER=1)
# (dlo, dlo-all: two GPUs or more; RANKS=2; dlo-all = tests + NCCL checks +
# distributed layerwise bench + its planted bug + the FSDP2 peer, about
# 6 min on two H200s; NO_TESTS=1, NO_PEER=1 leave steps out)
# Run from the repository root (nextest maps the archive onto it), or set
# OFFLOAD_ROOT. Logs and JSON go to $OUT (default /tmp/offload-gpu).
# Timeouts (seconds, each overridable): TESTS_TIMEOUT=140, DROP_TIMEOUT=75,
# SANITIZE_TIMEOUT=300 (per full-suite sanitizer run), BENCH_TIMEOUT=200
# (per bench process; BENCH_RUNS=1 processes, BENCH_TOKENS), perf = the
# bench BENCH_RUNS times + the planted bench + the peer (PEER_TOKENS),
# PLANTED_TIMEOUT=55, PEER_TIMEOUT=100; NO_PEER=1 leaves the peer out of
# `all`. `all` = tests + memcheck of the
# drop tests + bench + planted bench + peer: at most 530 s (expected about
# 6.5 min on an H200: suite ~1.5 min, drop tests under memcheck ~40 s,
# bench ~2.2 min, planted bench ~30 s, peer ~1.5 min).
here="$(cd "$(dirname "$0")" && pwd)"
root="${OFFLOAD_ROOT:-$(pwd)}"
out="${OUT:-/tmp/offload-gpu}"
mkdir -p "$out"

# The suite: each test in its own process, one at a time; the output of
# passing tests (the planted-bug lines among it) is shown at the end.
run_tests() {
    timeout "${TESTS_TIMEOUT:-140}" "$here/cargo-nextest" nextest run \
        --archive-file "$here/gpu-suite.tar.zst" --workspace-remap "$root" \
        --no-fail-fast --test-threads 1 --success-output final > "$out/tests.log" 2>&1
    status=$?
    cat "$out/tests.log"
    # nextest's own summary line ("Summary [...] 11 tests run: 9 passed,
    # 2 failed, ..."), not the tests' output printed after it.
    line=$(grep -E '^[[:space:]]*Summary \[' "$out/tests.log" | tail -1)
    passed=$(echo "$line" | sed -n 's/.* \([0-9][0-9]*\) passed.*/\1/p')
    failed=$(echo "$line" | sed -n 's/.* \([0-9][0-9]*\) failed.*/\1/p')
    [ "$status" -eq 124 ] && echo "tests: timed out after ${TESTS_TIMEOUT:-140} s"
    tests_line="${passed:-0} passed, ${failed:-0} failed"
    echo "$tests_line"
    return $status
}

# One sanitizer run: tool, timeout, log name, then the test binary's
# arguments (a name filter, --skip).
sanitizer() {
    tool=$1 limit=$2 log=$3
    shift 3
    echo "== compute-sanitizer --tool $tool $* ${OFFLOAD_PROXY_NO_GEMM:+(GEMMs off)}"
    OFFLOAD_UNDER_SANITIZER=1 timeout "$limit" compute-sanitizer --tool "$tool" \
        --error-exitcode 86 "$here/gpu-tests" --test-threads 1 "$@" > "$out/$log" 2>&1
    code=$?
    tail -8 "$out/$log"
    [ "$code" -eq 124 ] && echo "== $tool: timed out after $limit s"
    echo "== $tool exit $code"
    return $code
}

# memcheck over the drop and panic tests (buffers dropped with work in
# flight, a runtime dropped enabled, a panic inside a forward): no access to
# freed memory, no failed CUDA call.
run_drop_memcheck() {
    sanitizer memcheck "${DROP_TIMEOUT:-75}" sanitize-drop-memcheck.log drop_
}

# The drop tests, then the rest of the suite, under memcheck with the GEMMs
# on; racecheck and synccheck over the suite. racecheck sees only
# shared-memory hazards inside a kernel, and synccheck only misuse of
# in-kernel barriers: neither observes the ordering of work across streams
# (a copy racing a kernel), which the perturbation and planted-bug tests
# check instead. racecheck cannot run cuBLAS's Hopper kernels (it fails
# inside the sanitizer on their hardware barriers): it runs with the GEMMs
# off, checking our own kernels.
run_sanitize() {
    status=0
    unset OFFLOAD_PROXY_NO_GEMM
    run_drop_memcheck || status=$?
    limit="${SANITIZE_TIMEOUT:-300}"
    sanitizer memcheck "$limit" sanitize-memcheck.log --skip drop_ || status=$?
    export OFFLOAD_PROXY_NO_GEMM=1
    sanitizer racecheck "$limit" sanitize-racecheck.log || status=$?
    unset OFFLOAD_PROXY_NO_GEMM
    sanitizer synccheck "$limit" sanitize-synccheck.log || status=$?
    return $status
}

# The single-GPU bench, BENCH_RUNS times (default 1) as separate
# processes: resident, layerwise at depths 1 and 2 and at the depth the
# ring recurrence chooses, at four token counts, each row with a traced
# step (the first run's Perfetto traces in $out/traces). Device budgets
# are whole-request plans: `run.sh pipeline`.
run_bench() {
    status=0
    i=1
    while [ "$i" -le "${BENCH_RUNS:-1}" ]; do
        timeout "${BENCH_TIMEOUT:-200}" "$here/offload-bench" \
            --tokens "${BENCH_TOKENS:-1024,4608,8192,16896}" \
            --json "$out/bench-$i.json" $([ "$i" -eq 1 ] && echo --trace-dir "$out/traces") \
            > "$out/bench-$i.log" 2> "$out/bench-$i.err" || status=$?
        cat "$out/bench-$i.log"
        tail -3 "$out/bench-$i.err"
        i=$((i + 1))
    done
    return $status
}

# A planted bug (every fill copies the next block's bytes): the layerwise
# outputs must differ from resident, and the program says so.
run_planted_bench() {
    timeout "${PLANTED_TIMEOUT:-55}" "$here/offload-bench-planted" --plant wrong-master \
        --tokens 4608 --steps 1 --warmup 1 --json "$out/bench-planted.json"
}

run_peer() {
    timeout "${PEER_TIMEOUT:-100}" python3 "$here/peers/diffusers_group_offload.py" \
        --tokens "${PEER_TOKENS:-4608,16896}" --json "$out/peer.json"
}

# Two GPUs and more (`run.sh dlo`, `run.sh dlo-all`). The NCCL checks:
# gathers into a narrowed range, the all-gather bandwidth, a collective one
# rank skips aborted by the watchdog. RANKS (default 2) GPUs.
run_dist_check() {
    NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" timeout "${DIST_TIMEOUT:-120}" \
        "$here/offload-launch" -n "${RANKS:-2}" -- "$here/offload-dist-check" \
        > "$out/dist-check.log" 2>&1
    code=$?
    cat "$out/dist-check.log"
    return $code
}

# Distributed layerwise on RANKS GPUs against resident and single-GPU
# layerwise, in one run (the bench launches its ranks itself).
run_dlo_bench() {
    NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" timeout "${DLO_TIMEOUT:-300}" \
        "$here/offload-bench" --ranks "${RANKS:-2}" --tokens "${DLO_TOKENS:-4608,16896}" \
        --json "$out/dlo.json"
}

# A planted collective bug on the GPU: the gather writes the whole slot.
run_dlo_planted() {
    NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" timeout "${DLO_PLANTED_TIMEOUT:-150}" \
        "$here/offload-bench-planted" --ranks "${RANKS:-2}" --plant whole-slot-gather \
        --tokens 4608 --steps 1 --warmup 1 --json "$out/dlo-planted.json"
}

# PyTorch FSDP2 with CPU offload on the same DiT and tokens.
run_fsdp2() {
    NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" timeout "${FSDP2_TIMEOUT:-240}" \
        torchrun --standalone --nproc_per_node="${RANKS:-2}" "$here/peers/fsdp2_cpu_offload.py" \
        --tokens "${DLO_TOKENS:-4608,16896}" --steps 5 --warmup 2 --json "$out/fsdp2.json"
}

# Whole Flux.1-dev requests (CLIP-L, T5-XXL, PIPELINE_STEPS denoising
# steps, the VAE decode) under each of PIPELINE_BUDGETS through the request
# planner, against a resident run: each plan, predicted against measured,
# each phase's peaks against its budget and INV-7 bound, outputs against
# resident, enable without a warm-up from the 16 GiB run's saved
# measurements, and `auto` beside another process (python3 + torch)
# holding HOG_GIB GiB. About 3.5 min on an H200.
run_pipeline_bench() {
    budgets="${PIPELINE_BUDGETS:-24GiB,16GiB,12GiB,8GiB,auto}"
    hog="${HOG_GIB:-110}"
    case ",$budgets," in
    *,auto,*) [ "$hog" -gt 0 ] 2>/dev/null || hog="" ;;
    *) hog="" ;;
    esac
    timeout "${PIPELINE_TIMEOUT:-290}" "$here/offload-bench" --pipeline \
        --budgets "$budgets" --steps "${PIPELINE_STEPS:-28}" \
        --requests "${PIPELINE_REQUESTS:-2}" ${hog:+--hog-gib "$hog"} \
        --json "$out/pipeline.json" > "$out/pipeline.log" 2> "$out/pipeline.err"
    code=$?
    cat "$out/pipeline.log"
    tail -5 "$out/pipeline.err"
    [ "$code" -eq 124 ] && echo "pipeline bench: timed out after ${PIPELINE_TIMEOUT:-290} s"
    return $code
}

# diffusers' recipe for the same request (group offloading of every
# component, and resident), ~3 min on an H200. Needs the wheels of .whl/
# on PYTHONPATH (see the top of this file).
run_pipeline_peer() {
    timeout "${PIPELINE_PEER_TIMEOUT:-240}" python3 "$here/peers/diffusers_pipeline.py" \
        --steps "${PIPELINE_STEPS:-28}" --tokens 4608 --requests 2 --warmup 1 \
        --json "$out/diffusers_pipeline.json" > "$out/diffusers_pipeline.log" 2>&1
    code=$?
    tail -30 "$out/diffusers_pipeline.log"
    [ "$code" -eq 124 ] && echo "pipeline peer: timed out after ${PIPELINE_PEER_TIMEOUT:-240} s"
    return $code
}

# Time per image of both, side by side (from their JSON; missing files
# say so).
pipeline_summary() {
    python3 - "$out/pipeline.json" "$out/diffusers_pipeline.json" <<'PY' || true
import json, sys
def load(p):
    try:
        with open(p) as f:
            return json.load(f)
    except Exception as e:
        print(f"({p}: {e})")
        return None
ours, peer = load(sys.argv[1]), load(sys.argv[2])
print("| who | run | time per image s | largest phase in use GB | predicted / measured | output = resident |")
print("| --- | --- | --- | --- | --- | --- |")
for r in (ours or {}).get("runs", []):
    peak = max([p.get("pool_used_peak_bytes", 0) for p in r.get("phases", [])] or [0]) / 1e9
    pm = r.get("predicted_over_measured")
    eq = r.get("output_equals_resident")
    err = f" (error: {r['error'][:80]})" if r.get("error") else ""
    print(f"| offload | {r['name']}{err} | {r.get('median_request_s', 0):.3f} | {peak:.2f} | "
          f"{'-' if pm is None else f'{pm:.3f}'} | {'-' if eq is None else eq} |")
for r in (peer or {}).get("rows", []):
    pk = r.get("peak_allocated_gb")
    print(f"| diffusers | {r.get('run')} | {r.get('time_per_image_s', 0):.3f} | "
          f"{'-' if pk is None else f'{pk:.2f}'} | - | max diff {r.get('max_abs_diff_vs_first_run')} |")
PY
}

# Runs a step, timing it; appends a row to the summary.
summary=""
step() {
    name=$1
    shift
    start=$(date +%s)
    "$@"
    code=$?
    took=$(( $(date +%s) - start ))
    case $code in
    0) verdict=ok ;;
    124) verdict="timed out" ;;
    *) verdict="failed ($code)" ;;
    esac
    summary="$summary| $name | $verdict | $took |
"
    [ "$code" -eq 0 ] || overall=1
    return 0
}

overall=0
case "${1:-tests}" in
tests) run_tests ;;
sanitize) run_sanitize ;;
bench)
    status=0
    run_bench || status=$?
    run_planted_bench || status=$?
    run_peer || status=$?
    exit $status
    ;;
all)
    began=$(date +%s)
    tests_line=""
    step "tests" run_tests
    step "memcheck: drop_ tests" run_drop_memcheck
    step "bench (${BENCH_RUNS:-1} runs)" run_bench
    step "bench --plant wrong-master" run_planted_bench
    [ -n "${NO_PEER:-}" ] || step "peer (diffusers)" run_peer
    echo
    echo "== summary ($(( $(date +%s) - began )) s; logs and JSON in $out)"
    echo "suite: ${tests_line:-no count}"
    grep -E '^[[:space:]]*planted ' "$out/tests.log" 2>/dev/null | sed 's/^[[:space:]]*//'
    echo "| step | result | seconds |"
    echo "| --- | --- | --- |"
    printf '%s' "$summary"
    exit $overall
    ;;
perf)
    began=$(date +%s)
    step "bench (${BENCH_RUNS:-1} runs)" run_bench
    step "bench --plant wrong-master" run_planted_bench
    [ -n "${NO_PEER:-}" ] || step "peer (diffusers)" run_peer
    echo
    echo "== summary ($(( $(date +%s) - began )) s; logs and JSON in $out)"
    echo "| step | result | seconds |"
    echo "| --- | --- | --- |"
    printf '%s' "$summary"
    exit $overall
    ;;
pipeline)
    began=$(date +%s)
    step "pipeline bench (offload-bench --pipeline)" run_pipeline_bench
    [ -n "${NO_PEER:-}" ] || step "peer (diffusers pipeline)" run_pipeline_peer
    echo
    echo "== summary ($(( $(date +%s) - began )) s; logs and JSON in $out)"
    pipeline_summary
    echo
    echo "| step | result | seconds |"
    echo "| --- | --- | --- |"
    printf '%s' "$summary"
    exit $overall
    ;;
dlo) run_dist_check && run_dlo_bench ;;
dlo-bench) run_dlo_bench ;;
fsdp2) run_fsdp2 ;;
dlo-all)
    began=$(date +%s)
    tests_line=""
    [ -n "${NO_TESTS:-}" ] || step "tests" run_tests
    step "NCCL checks (offload-dist-check, ${RANKS:-2} ranks)" run_dist_check
    step "distributed layerwise bench (${RANKS:-2} ranks)" run_dlo_bench
    step "bench --ranks --plant whole-slot-gather" run_dlo_planted
    [ -n "${NO_PEER:-}" ] || step "peer (FSDP2 CPU offload)" run_fsdp2
    echo
    echo "== summary ($(( $(date +%s) - began )) s; logs and JSON in $out)"
    echo "suite: ${tests_line:-not run}"
    grep -E '^(PASS|FAIL|SKIP)' "$out/dist-check.log" 2>/dev/null | sort | uniq -c
    echo "| step | result | seconds |"
    echo "| --- | --- | --- |"
    printf '%s' "$summary"
    exit $overall
    ;;
*)
    echo "usage: run.sh tests | sanitize | bench | perf | all | pipeline | dlo | dlo-all | dlo-bench | fsdp2" >&2
    exit 2
    ;;
esac
"#;

pub(crate) fn bundle(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir.join("peers"))
        .with_context(|| format!("creating {}", dir.display()))?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // Smaller binaries travel better: no debug info in the bundle.
    let env = [
        ("CARGO_PROFILE_RELEASE_DEBUG", "false"),
        ("CARGO_PROFILE_RELEASE_STRIP", "true"),
    ];
    let archive = dir.join("gpu-suite.tar.zst");
    crate::cargo_env(
        &[
            "nextest",
            "archive",
            "--locked",
            "--release",
            "-p",
            "offload-tests",
            "--test",
            "gpu",
            "-p",
            "offload-cuda",
            "--lib",
            "-p",
            "offload-dist",
            "--test",
            "nccl",
            "--archive-file",
            archive.to_str().context("bundle path")?,
        ],
        &env,
    )?;
    let suite = executable(
        &[
            "test",
            "--locked",
            "--release",
            "-p",
            "offload-tests",
            "--test",
            "gpu",
            "--no-run",
        ],
        &env,
        "gpu",
    )?;
    copy(&suite, &dir.join("gpu-tests"))?;
    // Each build is copied before the next: both write the same path.
    let bench = executable(
        &["build", "--locked", "--release", "-p", "offload-bench"],
        &env,
        "offload-bench",
    )?;
    copy(&bench, &dir.join("offload-bench"))?;
    let planted = executable(
        &[
            "build",
            "--locked",
            "--release",
            "-p",
            "offload-bench",
            "--features",
            "planted-bugs",
        ],
        &env,
        "offload-bench",
    )?;
    copy(&planted, &dir.join("offload-bench-planted"))?;
    for (target, name) in [
        ("offload-launch", "offload-launch"),
        ("offload-dist-check", "offload-dist-check"),
    ] {
        let bin = executable(
            &[
                "build",
                "--locked",
                "--release",
                "-p",
                "offload-dist",
                "--bin",
                target,
            ],
            &env,
            target,
        )?;
        copy(&bin, &dir.join(name))?;
    }
    for peer in [
        "diffusers_group_offload.py",
        "diffusers_pipeline.py",
        "fsdp2_cpu_offload.py",
    ] {
        copy(
            &root.join("bench/peers").join(peer),
            &dir.join("peers").join(peer),
        )?;
    }
    let nextest = which("cargo-nextest")
        .context("cargo-nextest is not on PATH (it ships with the toolchain image)")?;
    copy(&nextest, &dir.join("cargo-nextest"))?;
    std::fs::write(dir.join("run.sh"), RUN_SH)?;
    make_executable(&dir.join("run.sh"))?;
    println!(
        "xtask gpu-test: bundle in {} (run.sh tests | sanitize | bench | all | pipeline)",
        dir.display()
    );
    Ok(())
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

/// Runs `cargo ARGS --message-format json-render-diagnostics` (progress and
/// diagnostics on the terminal) and returns the executable cargo reports
/// for the target named `target`: its real path, wherever
/// `CARGO_TARGET_DIR` puts it.
fn executable(args: &[&str], env: &[(&str, &str)], target: &str) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let shown: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
    eprintln!(
        "xtask: {} cargo {} --message-format json-render-diagnostics",
        shown.join(" "),
        args.join(" ")
    );
    let mut child = Command::new(&cargo)
        .args(args)
        .args(["--message-format", "json-render-diagnostics"])
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot run `{cargo}`"))?;
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let mut found = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading cargo's messages")?;
        let Ok(m) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if m["reason"] == "compiler-artifact"
            && m["target"]["name"] == target
            && let Some(path) = m["executable"].as_str()
        {
            found = Some(PathBuf::from(path));
        }
    }
    let status = child.wait().context("waiting for cargo")?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    found.with_context(|| format!("cargo reported no executable for `{target}`"))
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

fn make_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut perms = std::fs::metadata(path)?.permissions();
    perms.set_mode(0o755);
    std::fs::set_permissions(path, perms)?;
    Ok(())
}

/// The candle build's one change to candle-core: cudarc's linking and
/// version features. candle-core 0.11.1 asks for `dynamic-linking` and
/// `cuda-version-from-build-system`; `offload-cuda` for `dynamic-loading`
/// and `cuda-13000`; cudarc's build script refuses the two linkings
/// together. The copy asks for what `offload-cuda` asks for.
const CANDLE_CUDARC_FROM: &str =
    "    \"cuda-version-from-build-system\",\n    \"dynamic-linking\",\n";
const CANDLE_CUDARC_TO: &str = "    \"cuda-13000\",\n    \"dynamic-loading\",\n";

/// A CUDA 13.0 nvcc from PyPI, into a folder `T`. 13.0 exactly: a newer
/// nvcc writes PTX the 580 driver (CUDA 13.0) cannot load.
const WHEELS: &str = "python3 -m pip install --no-deps --target T nvidia-cuda-nvcc==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85";

/// The toolkit of [`WHEELS`], as the bundle's `BUILD` file names it.
const WHEELS_SHORT: &str = "nvcc 13.0.88 (PyPI wheels)";

/// Binaries larger than this travel gzipped: the bundle, carried to the
/// GPU machine, stays well under its 64 MiB.
const GZIP_ABOVE_BYTES: u64 = 16 << 20;

/// The CUTLASS headers candle-flash-attn 0.11.1 pins (commit 7d49e6c7, the
/// v3.5.0 tag): PyPI's wheel carries them byte for byte under
/// `cutlass_library/source/`, so the build needs no GitHub.
const CUTLASS_WHEEL: &str = "nvidia-cutlass==3.5.0.0";

/// The start of candle-flash-attn 0.11.1's `run_mha_fwd` in
/// `kernels/flash_api.cu`, and the line after its end: the dispatch the copy
/// replaces with [`FLASH_DISPATCH`].
const FLASH_DISPATCH_FROM: &str =
    "void run_mha_fwd(Flash_fwd_params &params, cudaStream_t stream) {";
const FLASH_DISPATCH_UNTIL: &str = "extern \"C\" void run_mha(";

/// Flux's one attention kernel: bf16, head dim 128, non-causal, no paged
/// KV. The stock dispatch names all 52 other specialisations, whose
/// objects the trimmed build does not compile (the link would fail);
/// anything else aborts with the reason.
const FLASH_DISPATCH: &str = r#"#include <cstdio>
#include <cstdlib>

// offload's trimmed build (cargo xtask candle-bundle): only Flux's kernel.
void run_mha_fwd(Flash_fwd_params &params, cudaStream_t stream) {
  if (params.is_bf16 && !params.is_causal && params.block_table == nullptr && params.d == 128) {
    run_mha_fwd_<cutlass::bfloat16_t, 128, false>(params, stream);
  } else {
    fprintf(stderr, "candle-flash-attn (offload's trimmed build) has only bf16, head dim 128, "
            "non-causal, unpaged attention: got bf16 %d, head dim %d, causal %d, paged %d\n",
            params.is_bf16, params.d, params.is_causal, params.block_table != nullptr);
    abort();
  }
}

"#;

/// The copy's build script: nvcc on the two files Flux needs (instead of
/// cudaforge on 53, which fetches CUTLASS from GitHub), for
/// `sm_$CUDA_COMPUTE_CAP`, with the switches Flux never turns on compiled
/// out, against the CUTLASS of `$OFFLOAD_CUTLASS_DIR`; both files at once.
const FLASH_BUILD_RS: &str = r#"//! offload's build of candle-flash-attn (written by `cargo xtask
//! candle-bundle`): the two kernel files Flux needs, compiled by nvcc against
//! `$OFFLOAD_CUTLASS_DIR` (PyPI's nvidia-cutlass 3.5.0.0 headers).
use std::path::{Path, PathBuf};
use std::process::Command;

const FILES: [&str; 2] = ["kernels/flash_api.cu", "kernels/flash_fwd_hdim128_bf16_sm80.cu"];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels");
    for v in ["OFFLOAD_CUTLASS_DIR", "CUDA_COMPUTE_CAP", "CUDA_HOME"] {
        println!("cargo::rerun-if-env-changed={v}");
    }
    let cutlass = PathBuf::from(std::env::var("OFFLOAD_CUTLASS_DIR").expect(
        "OFFLOAD_CUTLASS_DIR: the folder with CUTLASS's include/ and tools/util/include/",
    ));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let nvcc = std::env::var("CUDA_HOME")
        .map(|h| Path::new(&h).join("bin/nvcc"))
        .unwrap_or_else(|_| PathBuf::from("nvcc"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let mut jobs = Vec::new();
    let mut objects = Vec::new();
    for file in FILES {
        let object = out.join(Path::new(file).with_extension("o").file_name().unwrap());
        let child = Command::new(&nvcc)
            .args(["-std=c++17", "-O3", "--use_fast_math"])
            .args(["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__"])
            .args(["-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"])
            .args(["--expt-relaxed-constexpr", "--expt-extended-lambda"])
            .args(["-Xcompiler", "-fPIC", "-Xcompiler", "-Wno-deprecated-declarations"])
            .args(["-DFLASHATTENTION_DISABLE_DROPOUT", "-DFLASHATTENTION_DISABLE_ALIBI"])
            .args(["-DFLASHATTENTION_DISABLE_SOFTCAP", "-DFLASHATTENTION_DISABLE_LOCAL"])
            .arg("-DFLASHATTENTION_DISABLE_UNEVEN_K")
            .arg(format!("-gencode=arch=compute_{cap},code=sm_{cap}"))
            .arg(format!("-I{}", cutlass.join("include").display()))
            .arg(format!("-I{}", cutlass.join("tools/util/include").display()))
            .arg("-Ikernels")
            .args(["-c", file, "-o"])
            .arg(&object)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
        jobs.push((file, child));
        objects.push(object);
    }
    for (file, mut child) in jobs {
        let status = child.wait().expect("waiting for nvcc");
        assert!(status.success(), "nvcc {file}: {status}");
    }
    let lib = out.join("libflashattention.a");
    let status = Command::new(&nvcc)
        .arg("--lib")
        .arg("-o")
        .arg(&lib)
        .args(&objects)
        .status()
        .expect("nvcc --lib");
    assert!(status.success(), "nvcc --lib: {status}");
    println!("cargo::rustc-link-search={}", out.display());
    println!("cargo::rustc-link-lib=static=flashattention");
    println!("cargo::rustc-link-lib=dylib=cudart");
    println!("cargo::rustc-link-lib=dylib=stdc++");
}
"#;

/// Builds `offload-flux-bench` (offload-candle with candle's CUDA backend
/// and FlashAttention-2) into `dir` with the Flux reference script and
/// `run-candle.sh`.
///
/// Needs nvcc (for candle's kernels): `$CUDA_TK` or the `nvcc` on `PATH`;
/// the NVIDIA wheels carry one ([`WHEELS`], then `CUDA_TK=T/nvidia/cu13`),
/// and CUTLASS 3.5.0's headers ([`CUTLASS_WHEEL`] into the same `T`, or
/// `$CUTLASS_DIR`). The build patches candle-core (see
/// [`CANDLE_CUDARC_FROM`]) and candle-flash-attn (its build script
/// [`FLASH_BUILD_RS`], its dispatch [`FLASH_DISPATCH`]) through `--config`,
/// from copies made under `target/candle-cuda`, links candle's `-lcudart`
/// against the static runtime (no libcudart needed where it runs), and
/// restores `Cargo.lock` afterwards.
pub(crate) fn candle_bundle(dir: &Path) -> Result<()> {
    let began = std::time::Instant::now();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .context("the workspace root")?;
    let wheels = format!("{WHEELS} {CUTLASS_WHEEL}");
    let tk = match std::env::var_os("CUDA_TK") {
        Some(t) => PathBuf::from(t),
        None => {
            let out = Command::new("sh")
                .args(["-c", "command -v nvcc"])
                .output()
                .context("looking for nvcc")?;
            let nvcc = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            if nvcc.is_empty() {
                bail!(
                    "candle's CUDA kernels need nvcc: set CUDA_TK to a CUDA 13.0 toolkit (the NVIDIA wheels carry one: \
                     {wheels}; then CUDA_TK=T/nvidia/cu13)"
                );
            }
            Path::new(&nvcc)
                .parent()
                .and_then(Path::parent)
                .context("nvcc's toolkit")?
                .to_owned()
        }
    };
    let cudart = tk.join("lib/libcudart_static.a");
    if !cudart.is_file() {
        bail!(
            "{} not found: the toolkit at {} has no static CUDA runtime",
            cudart.display(),
            tk.display()
        );
    }
    // CUTLASS: `$CUTLASS_DIR`, else the wheel installed beside the
    // toolkit's (T/nvidia/cu13 → T/cutlass_library/source).
    let cutlass = match std::env::var_os("CUTLASS_DIR") {
        Some(c) => PathBuf::from(c),
        None => tk.join("../../cutlass_library/source"),
    };
    for sub in [
        "include/cute",
        "include/cutlass",
        "tools/util/include/cutlass",
    ] {
        if !cutlass.join(sub).is_dir() {
            bail!(
                "{} not found: FlashAttention needs CUTLASS 3.5.0's headers (`{wheels}` puts them in \
                 T/cutlass_library/source; or set CUTLASS_DIR to a folder with include/ and tools/util/include/)",
                cutlass.join(sub).display()
            );
        }
    }
    let cutlass = cutlass.canonicalize().context("CUTLASS's folder")?;
    // The patched crates, from the registry's copies cargo resolved (all
    // features: candle-flash-attn is optional).
    let meta = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--all-features",
        ])
        .current_dir(&root)
        .output()
        .context("cargo metadata")?;
    let meta: Value = serde_json::from_slice(&meta.stdout).context("cargo metadata's output")?;
    let source_of = |name: &str| -> Result<PathBuf> {
        let manifest = meta["packages"]
            .as_array()
            .and_then(|p| p.iter().find(|p| p["name"] == name))
            .and_then(|p| p["manifest_path"].as_str())
            .with_context(|| format!("{name} in the workspace's dependencies"))?;
        Ok(Path::new(manifest)
            .parent()
            .with_context(|| format!("{name}'s source"))?
            .to_owned())
    };
    let work = root.join("target/candle-cuda");

    let src = source_of("candle-core")?;
    let original = std::fs::read_to_string(src.join("Cargo.toml"))?;
    if original.matches(CANDLE_CUDARC_FROM).count() != 1 {
        bail!(
            "{}: cudarc's features are not what this patch expects; update CANDLE_CUDARC_FROM",
            src.join("Cargo.toml").display()
        );
    }
    let core = work.join("candle-core");
    vendor(
        &src,
        &core,
        &[(
            "Cargo.toml",
            original.replace(CANDLE_CUDARC_FROM, CANDLE_CUDARC_TO),
        )],
    )?;

    let src = source_of("candle-flash-attn")?;
    let api = std::fs::read_to_string(src.join("kernels/flash_api.cu"))?;
    let (Some(from), Some(until)) = (
        api.find(FLASH_DISPATCH_FROM),
        api.find(FLASH_DISPATCH_UNTIL),
    ) else {
        bail!(
            "{}: run_mha_fwd is not where this patch expects; update FLASH_DISPATCH_FROM/UNTIL",
            src.join("kernels/flash_api.cu").display()
        );
    };
    if api.matches(FLASH_DISPATCH_FROM).count() != 1 || until < from {
        bail!(
            "{}: run_mha_fwd is not what this patch expects",
            src.join("kernels/flash_api.cu").display()
        );
    }
    let api = format!("{}{FLASH_DISPATCH}{}", &api[..from], &api[until..]);
    let flash = work.join("candle-flash-attn");
    vendor(
        &src,
        &flash,
        &[
            ("kernels/flash_api.cu", api),
            ("build.rs", FLASH_BUILD_RS.to_owned()),
        ],
    )?;

    let lib = work.join("lib");
    std::fs::create_dir_all(&lib)?;
    std::fs::write(
        lib.join("libcudart.so"),
        format!("INPUT({})\n", cudart.display()),
    )?;

    let lock = std::fs::read(root.join("Cargo.lock"))?;
    let path = format!(
        "{}:{}",
        tk.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let patch_core = format!(
        "patch.crates-io.candle-core.path={:?}",
        core.display().to_string()
    );
    let patch_flash = format!(
        "patch.crates-io.candle-flash-attn.path={:?}",
        flash.display().to_string()
    );
    let env = [
        ("CARGO_PROFILE_RELEASE_DEBUG", "false"),
        ("CARGO_PROFILE_RELEASE_STRIP", "true"),
        ("CUDA_COMPUTE_CAP", "90"),
        ("CUDA_HOME", tk.to_str().context("toolkit path")?),
        (
            "OFFLOAD_CUTLASS_DIR",
            cutlass.to_str().context("CUTLASS path")?,
        ),
        ("PATH", &path),
        ("LIBRARY_PATH", lib.to_str().context("lib path")?),
    ];
    std::fs::create_dir_all(dir)?;
    // Each build is copied before the next: both write the same path.
    let mut built = Ok(());
    for (features, name) in [
        ("cuda,flash-attn", "offload-flux-bench"),
        ("cuda,flash-attn,planted-bugs", "offload-flux-bench-planted"),
    ] {
        let args = [
            "build",
            "--release",
            "-p",
            "offload-candle",
            "--features",
            features,
            "--bin",
            "offload-flux-bench",
            "--config",
            &patch_core,
            "--config",
            &patch_flash,
        ];
        built =
            executable(&args, &env, "offload-flux-bench").and_then(|b| copy(&b, &dir.join(name)));
        if built.is_err() {
            break;
        }
    }
    std::fs::write(root.join("Cargo.lock"), lock)?;
    built?;
    copy(
        &root.join("bench/peers/flux_reference.py"),
        &dir.join("flux_reference.py"),
    )?;
    copy(
        &root.join("bench/run-candle.sh"),
        &dir.join("run-candle.sh"),
    )?;
    make_executable(&dir.join("run-candle.sh"))?;
    // Its shared shell helpers, sourced from beside it.
    copy(&root.join("bench/lib.sh"), &dir.join("lib.sh"))?;
    // The peer's wheels (diffusers and what it needs beyond the device's
    // torch), where the checkout has them in `.whl/`.
    let wheels_dir = root.join(".whl");
    if wheels_dir.is_dir() {
        std::fs::create_dir_all(dir.join("whl"))?;
        for entry in std::fs::read_dir(&wheels_dir)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "whl") {
                copy(
                    &path,
                    &dir.join("whl")
                        .join(path.file_name().context("wheel name")?),
                )?;
            }
        }
    }
    // Big binaries travel gzipped (run-candle.sh unpacks them).
    for name in ["offload-flux-bench", "offload-flux-bench-planted"] {
        let bin = dir.join(name);
        let _ = std::fs::remove_file(dir.join(format!("{name}.gz")));
        if std::fs::metadata(&bin)?.len() > GZIP_ABOVE_BYTES {
            let status = Command::new("gzip")
                .args(["-9", "-f"])
                .arg(&bin)
                .status()
                .context("running gzip")?;
            if !status.success() {
                bail!("gzip {}: {status}", bin.display());
            }
        }
    }
    let head = Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .current_dir(&root)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    std::fs::write(
        dir.join("BUILD"),
        format!(
            "commit {head}; features cuda,flash-attn; sm_90; {WHEELS_SHORT} + {CUTLASS_WHEEL}; built in {:.0} s\n",
            began.elapsed().as_secs_f64()
        ),
    )?;
    let mut bytes = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        bytes += if entry.file_type()?.is_dir() {
            std::fs::read_dir(entry.path())?
                .map(|e| e.and_then(|e| e.metadata()).map_or(0, |m| m.len()))
                .sum()
        } else {
            entry.metadata()?.len()
        };
    }
    eprintln!(
        "xtask: candle bundle in {} ({:.1} MiB) after {:.0} s",
        dir.display(),
        bytes as f64 / (1u64 << 20) as f64,
        began.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Keeps `to` a copy of the crate at `from` with `patched` files (path
/// relative to the crate, new contents) replaced. An up-to-date copy is
/// left alone: a fresh one would rebuild the crate.
fn vendor(from: &Path, to: &Path, patched: &[(&str, String)]) -> Result<()> {
    let current = patched
        .iter()
        .all(|(p, text)| std::fs::read_to_string(to.join(p)).ok().as_deref() == Some(text));
    if current {
        return Ok(());
    }
    let _ = std::fs::remove_dir_all(to);
    copy_tree(from, to)?;
    for (p, text) in patched {
        std::fs::write(to.join(p), text)
            .with_context(|| format!("writing {}", to.join(p).display()))?;
    }
    Ok(())
}

fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            copy(&entry.path(), &target)?;
        }
    }
    Ok(())
}
