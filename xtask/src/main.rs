//! `cargo xtask`: project automation. `cargo xtask ci` runs every check CI
//! runs: formatting, clippy with warnings denied, the workspace tests, and
//! the architecture check that the neutral crates name no device library.

use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod arch;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "offload project automation")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// fmt --check, clippy -D warnings, the tests, the architecture check.
    Ci,
    /// Only the architecture check (INV-6: neutral crates name no device library).
    Arch,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Ci => ci(),
        Cmd::Arch => arch::check_workspace(),
    }
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
    cargo(&["test", "--workspace", "--locked"])?;
    arch::check_workspace()?;
    println!("xtask ci: all checks passed");
    Ok(())
}

/// Runs `cargo ARGS`, streaming its output; fails if it fails.
fn cargo(args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    eprintln!("xtask: cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .status()
        .with_context(|| format!("cannot run `{cargo}`"))?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}
