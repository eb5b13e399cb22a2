//! `cargo xtask gpu-test --bundle DIR`: everything the GPU suite and the
//! benchmark need on a CUDA machine with no Rust toolchain.
//!
//! DIR holds `cargo-nextest`, `gpu-suite.tar.zst` (a nextest archive of the
//! GPU suite and the CUDA backend's tests), `gpu-tests` (the suite's test
//! binary, for `compute-sanitizer`), `offload-bench`, `peers/` and `run.sh`:
//!
//! * `run.sh tests` runs the suite and prints `N passed, M failed`;
//! * `run.sh sanitize` runs it under memcheck, racecheck and synccheck;
//! * `run.sh bench` runs the benchmark, then the diffusers peer.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

const RUN_SH: &str = r#"#!/bin/sh
# The offload GPU bundle. Usage: run.sh tests | sanitize | bench
# Run from the repository root (nextest maps the archive onto it).
here="$(cd "$(dirname "$0")" && pwd)"
root="${OFFLOAD_ROOT:-$(pwd)}"
case "${1:-tests}" in
tests)
    out="$("$here/cargo-nextest" nextest run --archive-file "$here/gpu-suite.tar.zst" \
        --workspace-remap "$root" --no-fail-fast --test-threads 1 2>&1)"
    status=$?
    echo "$out"
    passed=$(echo "$out" | grep -oE '[0-9]+ passed' | tail -1 | grep -oE '[0-9]+')
    failed=$(echo "$out" | grep -oE '[0-9]+ failed' | tail -1 | grep -oE '[0-9]+')
    echo "${passed:-0} passed, ${failed:-0} failed"
    exit $status
    ;;
sanitize)
    status=0
    export OFFLOAD_UNDER_SANITIZER=1
    for tool in memcheck racecheck synccheck; do
        # racecheck cannot run cuBLAS's Hopper kernels (it fails inside the
        # sanitizer on their hardware barriers): it runs the suite with the
        # GEMMs off, checking our own kernel; memcheck and synccheck run all.
        unset OFFLOAD_PROXY_NO_GEMM
        [ "$tool" = racecheck ] && export OFFLOAD_PROXY_NO_GEMM=1
        echo "== compute-sanitizer --tool $tool ${OFFLOAD_PROXY_NO_GEMM:+(GEMMs off)}"
        timeout "${SANITIZE_TIMEOUT:-170}" compute-sanitizer --tool "$tool" --error-exitcode 86 \
            "$here/gpu-tests" --test-threads 1 > "${OUT:-/tmp}/sanitize-$tool.log" 2>&1
        code=$?
        tail -8 "${OUT:-/tmp}/sanitize-$tool.log"
        [ "$code" -ne 0 ] && status=$code
        echo "== $tool exit $code"
    done
    exit $status
    ;;
bench)
    "$here/offload-bench" --json "${OUT:-.}/bench.json"
    python3 "$here/peers/diffusers_group_offload.py" --json "${OUT:-.}/peer.json"
    ;;
*)
    echo "usage: run.sh tests | sanitize | bench" >&2
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
            "--archive-file",
            archive.to_str().context("bundle path")?,
        ],
        &env,
    )?;
    let suite = test_binary(&env)?;
    std::fs::copy(&suite, dir.join("gpu-tests")).context("copying the suite's test binary")?;
    crate::cargo_env(
        &["build", "--locked", "--release", "-p", "offload-bench"],
        &env,
    )?;
    std::fs::copy(
        root.join("target/release/offload-bench"),
        dir.join("offload-bench"),
    )
    .context("copying offload-bench")?;
    std::fs::copy(
        root.join("bench/peers/diffusers_group_offload.py"),
        dir.join("peers/diffusers_group_offload.py"),
    )?;
    let nextest = which("cargo-nextest")
        .context("cargo-nextest is not on PATH (it ships with the toolchain image)")?;
    std::fs::copy(&nextest, dir.join("cargo-nextest")).context("copying cargo-nextest")?;
    std::fs::write(dir.join("run.sh"), RUN_SH)?;
    make_executable(&dir.join("run.sh"))?;
    println!(
        "xtask gpu-test: bundle in {} (run.sh tests | sanitize | bench)",
        dir.display()
    );
    Ok(())
}

/// Builds the GPU suite's test binary and returns its path.
fn test_binary(env: &[(&str, &str)]) -> Result<std::path::PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .args([
            "test",
            "--locked",
            "--release",
            "-p",
            "offload-tests",
            "--test",
            "gpu",
            "--no-run",
            "--message-format",
            "json",
        ])
        .envs(env.iter().copied())
        .output()
        .context("building the GPU suite")?;
    if !out.status.success() {
        bail!(
            "building the GPU suite failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "gpu")
        .find_map(|m| m["executable"].as_str().map(std::path::PathBuf::from))
        .context("no executable for the gpu test")
}

fn which(name: &str) -> Option<std::path::PathBuf> {
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
