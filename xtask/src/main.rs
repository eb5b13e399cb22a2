//! `cargo xtask`: project automation. `cargo xtask ci` runs every check CI
//! runs: formatting, clippy with warnings denied, the workspace's docs with
//! warnings denied, the workspace tests, and the architecture check that
//! the neutral crates name no device library.

use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod arch;
mod gpu;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "offload project automation")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// fmt --check, clippy -D warnings, cargo doc -D warnings, the tests,
    /// the architecture check.
    Ci,
    /// Only the architecture check (INV-6: neutral crates name no device
    /// library; offload-sim reads no wall clock; offload-sim's library pulls
    /// in no command line dependency; offload-core's files import in
    /// layers).
    Arch,
    /// The loom models (release, `--cfg loom`, LOOM_MAX_PREEMPTIONS=2).
    Loom,
    /// The property tests in release: the state machine (PROPTEST_CASES,
    /// default 10,000) and the seeded multi-rank DLO scenarios
    /// (OFFLOAD_DLO_CASES, default 2,000).
    Props,
    /// The GPU suite: run it here (a CUDA machine with a toolchain), or build
    /// a self-contained bundle for a CUDA machine without one.
    GpuTest {
        /// Build the bundle into this folder instead of running.
        #[arg(long)]
        bundle: Option<std::path::PathBuf>,
    },
    /// Build `offload-flux-bench` (the candle Flux DiT with candle's CUDA
    /// backend and FlashAttention-2) into a folder with the reference script
    /// and `run-candle.sh`. Needs a CUDA 13.0 nvcc and CUTLASS 3.5.0's
    /// headers: `$CUDA_TK`, or `nvcc` on `PATH`; PyPI has both:
    /// `python3 -m pip install --no-deps --target T nvidia-cuda-nvcc==13.0.88
    /// nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88
    /// nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cutlass==3.5.0.0`,
    /// then `CUDA_TK=T/nvidia/cu13` (a newer nvcc writes PTX a 580 driver
    /// cannot load; CUTLASS is found at `T/cutlass_library/source`, or
    /// `$CUTLASS_DIR`).
    CandleBundle {
        /// The folder.
        dir: std::path::PathBuf,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Ci => ci(),
        Cmd::Arch => arch::check_workspace(),
        Cmd::Loom => loom(),
        Cmd::Props => props(),
        Cmd::GpuTest { bundle: None } => cargo(&[
            "test",
            "--locked",
            "-p",
            "offload-cuda",
            "-p",
            "offload-tests",
            "--test",
            "gpu",
            "--",
            "--nocapture",
        ]),
        Cmd::GpuTest { bundle: Some(dir) } => gpu::bundle(&dir),
        Cmd::CandleBundle { dir } => gpu::candle_bundle(&dir),
    }
}

/// Loom builds everything with `--cfg loom`: a target directory of its own
/// keeps the normal build cached.
fn loom() -> Result<()> {
    cargo_env(
        &[
            "test",
            "--release",
            "--locked",
            "-p",
            "offload-core",
            "--lib",
            "loom",
        ],
        &[
            ("RUSTFLAGS", "--cfg loom"),
            ("LOOM_MAX_PREEMPTIONS", "2"),
            ("CARGO_TARGET_DIR", "target/loom"),
            ("CARGO_PROFILE_RELEASE_DEBUG", "false"),
        ],
    )
}

fn props() -> Result<()> {
    let cases = std::env::var("PROPTEST_CASES").unwrap_or_else(|_| "10000".to_owned());
    let dlo_cases = std::env::var("OFFLOAD_DLO_CASES").unwrap_or_else(|_| "2000".to_owned());
    cargo_env(
        &[
            "test",
            "--release",
            "--locked",
            "-p",
            "offload-tests",
            // Neither names a backend: the release build skips candle, CUDA
            // and NCCL's crates (CI's time, on 2 cores).
            "--no-default-features",
            "--test",
            "state_machine",
            "--test",
            "dlo",
            "--",
            "--nocapture",
        ],
        &[
            ("PROPTEST_CASES", cases.as_str()),
            ("OFFLOAD_DLO_CASES", dlo_cases.as_str()),
            // No line tables: nothing here is profiled.
            ("CARGO_PROFILE_RELEASE_DEBUG", "false"),
        ],
    )
}

fn ci() -> Result<()> {
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--locked",
        "--",
        "-D",
        "warnings",
    ])?;
    // A broken intra-doc link is only a warning: denied, like clippy's.
    // Cheap: only the members are documented, over dependencies checked.
    cargo_env(
        &["doc", "--no-deps", "--workspace", "--locked"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )?;
    // The simulator as a library user builds it (`--workspace` unifies
    // features, so only this compiles it without the command line's).
    cargo(&[
        "clippy",
        "-p",
        "offload-sim",
        "--no-default-features",
        "--lib",
        "--locked",
        "--",
        "-D",
        "warnings",
    ])?;
    cargo(&["test", "--workspace", "--locked"])?;
    props()?;
    loom()?;
    arch::check_workspace()?;
    println!("xtask ci: all checks passed");
    Ok(())
}

/// Runs `cargo ARGS`, streaming its output; fails if it fails.
pub(crate) fn cargo(args: &[&str]) -> Result<()> {
    cargo_env(args, &[])
}

/// Runs `cargo ARGS` with extra environment variables.
pub(crate) fn cargo_env(args: &[&str], env: &[(&str, &str)]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let shown: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
    eprintln!("xtask: {} cargo {}", shown.join(" "), args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .envs(env.iter().copied())
        .status()
        .with_context(|| format!("cannot run `{cargo}`"))?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}
