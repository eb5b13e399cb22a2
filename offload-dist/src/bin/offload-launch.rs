//! `offload-launch -n G [--master-addr A] [--master-port P] -- CMD ARGS...`
//!
//! Starts G copies of CMD with the variables torchrun sets (`RANK`,
//! `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`), the job's rendezvous secret `OFFLOAD_DIST_SECRET` (a
//! fresh random one, unless the launcher's environment has one already:
//! then that one) and `NCCL_NVLS_ENABLE=0` unless already set, and waits.
//! Output is not prefixed (stdout and stderr are inherited; stdin is
//! closed). When a rank exits non-zero or by a signal, the others are
//! stopped (SIGTERM to each rank's process group, SIGKILL after a grace)
//! and the launcher exits non-zero, naming the rank and its status; it
//! exits 0 only if every rank did. SIGINT and SIGTERM to the launcher are
//! passed on to every rank the same way.

use std::ffi::OsString;
use std::process::{ExitCode, ExitStatus};
use std::time::Duration;

use clap::Parser;
use offload_dist::{SECRET_VAR, Secret};
use tokio::process::Command;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

/// How long stopped ranks get between SIGTERM and SIGKILL.
const GRACE: Duration = Duration::from_secs(3);

/// Starts G ranks of a command with the variables torchrun sets.
#[derive(Parser, Debug)]
#[command(name = "offload-launch", version, about, long_about = None)]
struct Args {
    /// Number of ranks (processes) to start, 1 to 1024.
    #[arg(short = 'n', long = "nproc", value_parser = clap::value_parser!(u32).range(1..=1024))]
    nproc: u32,

    /// MASTER_ADDR: where rank 0 listens for the rendezvous.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,

    /// MASTER_PORT, 1 to 65535 (default: a free port on MASTER_ADDR).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,

    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, num_args = 1.., value_name = "CMD")]
    command: Vec<OsString>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("offload-launch: cannot start its runtime: {e}");
            return ExitCode::from(1);
        }
    };
    ExitCode::from(runtime.block_on(launch(args)))
}

/// A free port on `addr` (bound and released: another process could take
/// it first, as with torchrun).
fn free_port(addr: &str) -> std::io::Result<u16> {
    let listener = std::net::TcpListener::bind((addr, 0))?;
    Ok(listener.local_addr()?.port())
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => format!("ended ({status})"),
    }
}

/// The launcher's exit code for a failed rank: its own code, or 128 + the
/// signal, as a shell reports it.
fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).ok().filter(|c| *c != 0).unwrap_or(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(1),
        _ => 1,
    }
}

/// Sends `sig` to the process group `pgid` (a rank and its children).
fn signal_group(pgid: u32, sig: libc::c_int) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
    // SAFETY: a plain system call on a process group we created; no memory
    // is involved. ESRCH (the group is gone) is fine.
    unsafe {
        libc::killpg(pgid, sig);
    }
}

async fn launch(args: Args) -> u8 {
    let port = match args.master_port {
        Some(p) => p,
        None => match free_port(&args.master_addr) {
            Ok(p) => p,
            Err(e) => {
                eprintln!(
                    "offload-launch: cannot find a free port on {}: {e}; pass --master-port",
                    args.master_addr
                );
                return 2;
            }
        },
    };
    let n = args.nproc;
    let program = &args.command[0];
    eprintln!(
        "offload-launch: {n} rank(s) of {} with MASTER_ADDR={} MASTER_PORT={port}",
        program.to_string_lossy(),
        args.master_addr
    );
    let nvls_set = std::env::var_os("NCCL_NVLS_ENABLE").is_some();
    // The job's secret: its ranks' hellos prove it, so that nobody else
    // reaching MASTER_ADDR:MASTER_PORT can take a rank or read the id.
    // One given to the launcher is inherited by its ranks as it is.
    let generated = match Secret::from_env() {
        Ok(Some(_)) => None,
        Ok(None) => match Secret::generate() {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("offload-launch: cannot make the job's secret: {e}");
                return 1;
            }
        },
        Err(e) => {
            eprintln!("offload-launch: {e}");
            return 2;
        }
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<(u32, std::io::Result<ExitStatus>)>();
    // Process group ids of the ranks still running (index = rank).
    let mut groups: Vec<Option<u32>> = Vec::new();
    for rank in 0..n {
        let mut cmd = Command::new(program);
        cmd.args(&args.command[1..])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", port.to_string())
            .stdin(std::process::Stdio::null())
            // Its own process group: stopping a rank stops its children.
            .process_group(0);
        if !nvls_set {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        if let Some(s) = &generated {
            cmd.env(SECRET_VAR, s.to_env_value());
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                eprintln!(
                    "offload-launch: cannot start rank {rank} ({}): {e}",
                    program.to_string_lossy()
                );
                stop(&mut groups, &mut rx).await;
                return 127;
            }
        };
        groups.push(child.id());
        let tx = tx.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            let _ = tx.send((rank, status));
        });
    }
    drop(tx);

    let mut sigint = signal(SignalKind::interrupt()).ok();
    let mut sigterm = signal(SignalKind::terminate()).ok();
    let mut running = n;
    let code = loop {
        tokio::select! {
            ended = rx.recv() => {
                let Some((rank, status)) = ended else { break 0 };
                running -= 1;
                if let Some(g) = groups[rank as usize].take() {
                    // Its children, if any outlived it.
                    signal_group(g, libc::SIGKILL);
                }
                match status {
                    Ok(s) if s.success() => {
                        if running == 0 {
                            break 0;
                        }
                    }
                    Ok(s) => {
                        eprintln!(
                            "offload-launch: rank {rank} {}; stopping the other {running} rank(s)",
                            describe(s)
                        );
                        break exit_code(s);
                    }
                    Err(e) => {
                        eprintln!("offload-launch: waiting for rank {rank}: {e}; stopping the other ranks");
                        break 1;
                    }
                }
            }
            Some(()) = recv(&mut sigint) => {
                eprintln!("offload-launch: interrupted; stopping all ranks");
                break 130;
            }
            Some(()) = recv(&mut sigterm) => {
                eprintln!("offload-launch: terminated; stopping all ranks");
                break 143;
            }
        }
    };
    if code != 0 {
        stop(&mut groups, &mut rx).await;
    }
    code
}

async fn recv(s: &mut Option<tokio::signal::unix::Signal>) -> Option<()> {
    match s {
        Some(s) => s.recv().await,
        None => std::future::pending().await,
    }
}

/// Stops every running rank: SIGTERM to its group, then SIGKILL to those
/// still running after [`GRACE`]; waits for them.
async fn stop(
    groups: &mut [Option<u32>],
    rx: &mut mpsc::UnboundedReceiver<(u32, std::io::Result<ExitStatus>)>,
) {
    for g in groups.iter().flatten() {
        signal_group(*g, libc::SIGTERM);
    }
    let deadline = tokio::time::Instant::now() + GRACE;
    while groups.iter().any(Option::is_some) {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some((rank, _))) => {
                if let Some(g) = groups[rank as usize].take() {
                    signal_group(g, libc::SIGKILL);
                }
            }
            Ok(None) => break,
            Err(_) => {
                for (rank, g) in groups.iter().enumerate() {
                    if let Some(g) = g {
                        eprintln!("offload-launch: rank {rank} ignored SIGTERM; killing it");
                        signal_group(*g, libc::SIGKILL);
                    }
                }
                while groups.iter().any(Option::is_some) {
                    match rx.recv().await {
                        Some((rank, _)) => groups[rank as usize] = None,
                        None => break,
                    }
                }
            }
        }
    }
}
