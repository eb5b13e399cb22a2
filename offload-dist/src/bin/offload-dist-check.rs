//! `offload-dist-check`: the NCCL collective on real GPUs, one process a
//! rank: `offload-launch -n 2 -- offload-dist-check`.
//!
//! On each rank: bootstrap from the environment ([`init_from_env`]), then
//!
//! * `gather-N`: an all-gather of N bytes a rank (N = 1, 7, 4097,
//!   64 MiB + 3) of distinct per-rank patterns, from an offset shard into
//!   a narrowed range of a larger buffer pre-filled with a sentinel: every
//!   gathered byte must be its rank's pattern and every byte outside the
//!   range still the sentinel;
//! * `bandwidth`: the median of 10 all-gathers of 340 MB shards (after a
//!   warm-up; each timed on the host, stream synchronised, after a 1-byte
//!   all-gather that lines the ranks up), as ms, algorithm and bus GB/s;
//! * `abort`: rank 0 issues a collective that the other ranks skip; its
//!   watchdog must abort the communicator within the 5 s timeout plus 3 s,
//!   and the next all-gather must fail naming the collective and the
//!   timeout. The other ranks wait out that window and abort locally.
//!
//! Prints one `PASS name ...` or `FAIL name ...` line per check and exits
//! non-zero on any FAIL. Where NCCL or the driver is absent it prints
//! `SKIP: ...` and exits 0 only when `OFFLOAD_DIST_ALLOW_SKIP=1`, else it
//! fails with the typed error, so a GPU run never passes by skipping.
//! The process exits without running destructors (after an abort, nothing
//! waits on a stream that may still hold the aborted kernel).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use offload_core::device::{
    Collective, Device, DeviceError, DeviceErrorKind, HostBuffer, HostSource,
};
use offload_cuda::{CudaBuffer, CudaDevice, CudaStream};
use offload_dist::{AbortCause, DistError, DistGroup, init_from_env, nccl_info};

/// Bounds the rendezvous and the communicator's init.
const INIT_TIMEOUT: Duration = Duration::from_secs(60);
/// Each collective's deadline in the correctness and bandwidth checks.
const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(30);
/// The deadline in the abort check.
const ABORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How late past `ABORT_TIMEOUT` the abort may come.
const ABORT_SLACK: Duration = Duration::from_secs(3);

const SIZES: [u64; 4] = [1, 7, 4097, (64 << 20) + 3];
const SHARD_LEAD: u64 = 5;
const FRONT: u64 = 13;
const BACK: u64 = 29;
const SENTINEL: u8 = 0xa5;
const LEAD_BYTE: u8 = 0x5a;
const BANDWIDTH_SHARD: u64 = 340_000_000;
const BANDWIDTH_ITERS: usize = 10;

fn main() -> ExitCode {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // SAFETY: the first statement of main: no other thread exists yet
        // to read the environment concurrently.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
    let allow_skip = std::env::var("OFFLOAD_DIST_ALLOW_SKIP").as_deref() == Ok("1");
    let group = match init_from_env(|i| CudaDevice::new(i as i32), INIT_TIMEOUT) {
        Ok(g) => g,
        Err(e) if e.is_unavailable() && allow_skip => {
            println!("SKIP: offload-dist-check: {e} (accepted: OFFLOAD_DIST_ALLOW_SKIP=1)");
            return ExitCode::SUCCESS;
        }
        Err(e) if e.is_unavailable() => {
            println!(
                "FAIL init: {e} (a GPU run needs NCCL and the driver; OFFLOAD_DIST_ALLOW_SKIP=1 accepts a skip)"
            );
            return ExitCode::FAILURE;
        }
        Err(e) => {
            println!("FAIL init: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = run(&group);
    if code != 0 {
        group
            .channel
            .report(&"offload-dist-check: a check failed on this rank");
    }
    // Done: the other ranks are not to take this rank's exit for a death.
    group.channel.finish();
    // Skip destructors: see the module docs.
    std::process::exit(code);
}

fn run(g: &DistGroup) -> i32 {
    let (rank, world) = (g.collective.rank(), g.collective.size());
    let nccl = nccl_info()
        .map(|i| {
            format!(
                "NCCL {}.{}.{} from {}",
                i.version.0, i.version.1, i.version.2, i.library
            )
        })
        .unwrap_or_default();
    println!(
        "offload-dist-check: rank {rank} of {world} (LOCAL_RANK {}) on {} #{}, {nccl}, master {}",
        g.env.local_rank,
        g.device.name(),
        g.device.ordinal(),
        g.env.master_endpoint()
    );
    let stream = match g.device.create_stream() {
        Ok(s) => s,
        Err(e) => {
            println!("FAIL setup rank {rank}/{world}: {e}");
            return 1;
        }
    };
    let mut failed = 0;
    let mut report = |name: &str, result: Result<String, String>| match result {
        Ok(s) => println!("PASS {name} rank {rank}/{world}: {s}"),
        Err(s) => {
            failed += 1;
            println!("FAIL {name} rank {rank}/{world}: {s}");
        }
    };
    g.collective.set_timeout(COLLECTIVE_TIMEOUT);
    for size in SIZES {
        report(&format!("gather-{size}"), check_gather(g, &stream, size));
    }
    report("bandwidth", check_bandwidth(g, &stream));
    report("abort", check_abort(g, &stream));
    println!(
        "offload-dist-check: rank {rank}: {} check(s) failed",
        failed
    );
    i32::from(failed > 0)
}

fn pattern(rank: u32, i: u64) -> u8 {
    ((i * 131 + u64::from(rank) * 71 + 17) % 251) as u8
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Fills a new pinned buffer of `len` bytes with `f(i)`.
fn pinned(
    dev: &CudaDevice,
    len: u64,
    f: impl Fn(u64) -> u8,
) -> Result<offload_cuda::PinnedBuffer, String> {
    let mut buf = dev.alloc_pinned(len).map_err(err)?;
    let bytes: Vec<u8> = (0..len).map(f).collect();
    buf.write_from(0, len, &bytes);
    Ok(buf)
}

fn check_gather(g: &DistGroup, stream: &CudaStream, size: u64) -> Result<String, String> {
    if let Some(a) = g.collective.aborted() {
        return Err(format!("not run: {a}"));
    }
    let dev = &g.device;
    let rank = g.collective.rank();
    let world = u64::from(g.collective.size());
    let total = FRONT + world * size + BACK;
    let shard_host = pinned(dev, SHARD_LEAD + size, |i| {
        if i < SHARD_LEAD {
            LEAD_BYTE
        } else {
            pattern(rank, i - SHARD_LEAD)
        }
    })?;
    let dst_host = pinned(dev, total, |_| SENTINEL)?;
    let mut out = dev.alloc_pinned(total).map_err(err)?;
    let shard = dev.alloc_device(SHARD_LEAD + size).map_err(err)?;
    let dst = dev.alloc_device(total).map_err(err)?;
    // SAFETY: every range lies within its buffer; all buffers outlive the
    // stream synchronisation below, and nothing else touches them.
    unsafe {
        dev.copy_h2d(
            stream,
            HostSource::Pinned(&shard_host),
            0,
            &shard,
            0,
            SHARD_LEAD + size,
        )
        .map_err(err)?;
        dev.copy_h2d(stream, HostSource::Pinned(&dst_host), 0, &dst, 0, total)
            .map_err(err)?;
        g.collective
            .all_gather(stream, &shard, SHARD_LEAD, size, &dst, FRONT)
            .map_err(err)?;
        dev.copy_d2h(stream, &dst, 0, &mut out, 0, total)
            .map_err(err)?;
    }
    dev.synchronize_stream(stream).map_err(err)?;
    g.collective.wait_idle().map_err(err)?;
    let mut got = vec![0u8; total as usize];
    out.read_into(0, &mut got);
    if let Some(mismatch) = first_mismatch(&got, world, size) {
        return Err(mismatch);
    }
    Ok(format!(
        "{world} × {size} bytes from shard offset {SHARD_LEAD} into [{FRONT}, {}) of a {total}-byte buffer; the {} bytes around it untouched",
        FRONT + world * size,
        FRONT + BACK
    ))
}

/// The byte expected at `i` of the gathered buffer: rank r's pattern in
/// its slice of `[FRONT, FRONT + world × size)`, the sentinel around it.
fn expected_byte(i: u64, world: u64, size: u64) -> u8 {
    if (FRONT..FRONT + world * size).contains(&i) {
        let (r, k) = ((i - FRONT) / size, (i - FRONT) % size);
        pattern(r as u32, k)
    } else {
        SENTINEL
    }
}

/// The first byte of `got` that is not what the all-gather should leave,
/// described.
fn first_mismatch(got: &[u8], world: u64, size: u64) -> Option<String> {
    let end = FRONT + world * size;
    let (i, &b) = got
        .iter()
        .enumerate()
        .find(|&(i, &b)| b != expected_byte(i as u64, world, size))?;
    let i = i as u64;
    let what = if i < FRONT {
        format!("byte {i} before the range")
    } else if i >= end {
        format!("byte {} after the range", i - end)
    } else {
        let (r, k) = ((i - FRONT) / size, (i - FRONT) % size);
        format!("byte {k} of rank {r}'s shard")
    };
    Some(format!(
        "{what} (offset {i} of {}): expected {:#04x}, got {b:#04x}",
        got.len(),
        expected_byte(i, world, size)
    ))
}

/// A 1-byte all-gather, synchronised: the ranks leave it together.
fn line_up(
    g: &DistGroup,
    stream: &CudaStream,
    one: &CudaBuffer,
    row: &CudaBuffer,
) -> Result<(), String> {
    // SAFETY: `one` has 1 byte, `row` one per rank; synchronised below.
    unsafe { g.collective.all_gather(stream, one, 0, 1, row, 0) }.map_err(err)?;
    g.device.synchronize_stream(stream).map_err(err)
}

fn check_bandwidth(g: &DistGroup, stream: &CudaStream) -> Result<String, String> {
    if let Some(a) = g.collective.aborted() {
        return Err(format!("not run: {a}"));
    }
    let dev = &g.device;
    let world = u64::from(g.collective.size());
    let shard = dev.alloc_device(BANDWIDTH_SHARD).map_err(err)?;
    let dst = dev.alloc_device(world * BANDWIDTH_SHARD).map_err(err)?;
    let one = dev.alloc_device(1).map_err(err)?;
    let row = dev.alloc_device(world).map_err(err)?;
    let gather = || -> Result<Duration, String> {
        line_up(g, stream, &one, &row)?;
        let t0 = Instant::now();
        // SAFETY: whole buffers of the right sizes; synchronised below.
        unsafe {
            g.collective
                .all_gather(stream, &shard, 0, BANDWIDTH_SHARD, &dst, 0)
        }
        .map_err(err)?;
        dev.synchronize_stream(stream).map_err(err)?;
        Ok(t0.elapsed())
    };
    for _ in 0..2 {
        gather()?;
    }
    let mut times = Vec::with_capacity(BANDWIDTH_ITERS);
    for _ in 0..BANDWIDTH_ITERS {
        times.push(gather()?);
    }
    g.collective.wait_idle().map_err(err)?;
    times.sort();
    let median = times[times.len() / 2].as_secs_f64();
    let bytes = (world * BANDWIDTH_SHARD) as f64;
    let algbw = bytes / median / 1e9;
    let busbw = algbw * (world - 1) as f64 / world as f64;
    Ok(format!(
        "all-gather of {world} × {BANDWIDTH_SHARD} bytes: median {:.3} ms of {BANDWIDTH_ITERS} (min {:.3}, max {:.3}), algbw {algbw:.1} GB/s, busbw {busbw:.1} GB/s (host-timed, stream synchronised)",
        median * 1e3,
        times[0].as_secs_f64() * 1e3,
        times[times.len() - 1].as_secs_f64() * 1e3,
    ))
}

fn check_abort(g: &DistGroup, stream: &CudaStream) -> Result<String, String> {
    if let Some(a) = g.collective.aborted() {
        return Err(format!("not run: {a}"));
    }
    let dev = &g.device;
    let rank = g.collective.rank();
    let world = u64::from(g.collective.size());
    let size = 4097;
    let shard = dev.alloc_device(size).map_err(err)?;
    let dst = dev.alloc_device(world * size).map_err(err)?;
    let one = dev.alloc_device(1).map_err(err)?;
    let row = dev.alloc_device(world).map_err(err)?;
    line_up(g, stream, &one, &row)?;
    g.collective.wait_idle().map_err(err)?;
    g.collective.set_timeout(ABORT_TIMEOUT);
    let number = g.collective.issued() + 1;
    if rank != 0 {
        // Skip collective #number; stay alive (and idle) while rank 0's
        // watchdog runs out its deadline, then abort locally.
        std::thread::sleep(ABORT_TIMEOUT + ABORT_SLACK);
        let before = g.collective.aborted();
        g.collective.abort();
        let how = match before {
            Some(a) => format!("its watchdog had aborted it already ({:?})", a.cause),
            None => "aborted it locally".to_owned(),
        };
        return Ok(format!(
            "skipped collective #{number} that rank 0 issued, waited {:?}, {how}",
            ABORT_TIMEOUT + ABORT_SLACK
        ));
    }
    let t0 = Instant::now();
    // SAFETY: whole buffers of the right sizes. After the abort they are
    // never freed (the process exits without destructors).
    unsafe { g.collective.all_gather(stream, &shard, 0, size, &dst, 0) }
        .map_err(|e| format!("collective #{number} failed to enqueue: {e}"))?;
    let waited = g.collective.wait_idle();
    let elapsed = t0.elapsed();
    let aborted = match waited {
        Ok(()) => {
            return Err(format!(
                "collective #{number} completed although the other ranks skipped it"
            ));
        }
        Err(DistError::Aborted(a)) => a,
        Err(e) => return Err(format!("wait_idle: {e}")),
    };
    if aborted.cause != AbortCause::TimedOut {
        return Err(format!("aborted for another reason: {aborted}"));
    }
    if aborted.collective.map(|c| c.number) != Some(number) {
        return Err(format!("the abort names another collective: {aborted}"));
    }
    if elapsed < ABORT_TIMEOUT || elapsed > ABORT_TIMEOUT + ABORT_SLACK {
        return Err(format!(
            "aborted after {elapsed:?}; expected within [{ABORT_TIMEOUT:?}, {:?}]",
            ABORT_TIMEOUT + ABORT_SLACK
        ));
    }
    // SAFETY: as above; the call must be refused before touching them.
    let later = unsafe { g.collective.all_gather(stream, &shard, 0, size, &dst, 0) };
    let e = match later {
        Ok(()) => return Err("an all-gather after the abort was accepted".to_owned()),
        Err(e) => e,
    };
    let text = e.to_string();
    if e.kind() != DeviceErrorKind::TransferFailed
        || !text.contains(&format!("collective #{number}"))
        || !text.contains(&format!("{ABORT_TIMEOUT:?}"))
    {
        return Err(format!(
            "the later all-gather's error ({:?}) does not name collective #{number} and the {ABORT_TIMEOUT:?} timeout: {text}",
            e.kind()
        ));
    }
    Ok(format!(
        "collective #{number} (skipped by the other ranks) aborted by the watchdog after {:.2} s (timeout {ABORT_TIMEOUT:?}); the next all-gather failed: {text}",
        elapsed.as_secs_f64()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gathered(world: u64, size: u64) -> Vec<u8> {
        let total = FRONT + world * size + BACK;
        (0..total).map(|i| expected_byte(i, world, size)).collect()
    }

    #[test]
    fn a_correct_gather_passes() {
        for size in [1, 7, 4097] {
            assert_eq!(first_mismatch(&gathered(2, size), 2, size), None);
        }
    }

    #[test]
    fn patterns_differ_between_ranks() {
        assert!((0..7).all(|k| pattern(0, k) != pattern(1, k)));
    }

    #[test]
    fn each_region_names_its_mismatch() {
        let (world, size) = (2, 7);
        let mut got = gathered(world, size);
        got[3] ^= 1;
        assert!(
            first_mismatch(&got, world, size)
                .unwrap()
                .starts_with("byte 3 before the range")
        );
        let mut got = gathered(world, size);
        got[(FRONT + size + 2) as usize] ^= 1;
        assert!(
            first_mismatch(&got, world, size)
                .unwrap()
                .starts_with("byte 2 of rank 1's shard")
        );
        let mut got = gathered(world, size);
        let last = got.len() - 1;
        got[last] ^= 1;
        assert!(
            first_mismatch(&got, world, size)
                .unwrap()
                .starts_with(&format!("byte {} after the range", BACK - 1))
        );
    }
}
