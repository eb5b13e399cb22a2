//! An unrelated stream of pinned host→device copies, kept busy by a host
//! thread (`--copy-beside`): the resident step timed beside it measures
//! what copies cost this workload's kernels with no offload engine in the
//! way (no hooks, no waits, no slots), the figure the crossover's remaining
//! loss is put on (ARCHITECTURE.md, "What is left at the crossover is the
//! kernels, not the ring").
//!
//! Its buffers are allocated by [`Beside::new`], before the row measures
//! what was in use, so no peak counts them; copying starts with
//! [`Beside::start`]. While a timeline records, the copier's copies are
//! traced like any other (on its own stream): [`Beside::quiet`] keeps a
//! copy from being enqueued, and so half traced, across the timeline's
//! start and stop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use offload_core::device::{Device, HostSource};
use offload_cuda::{CudaBuffer, CudaDevice, CudaStream, PinnedBuffer};

/// Bytes of each copy (one pinned buffer to one device buffer, again and
/// again): large enough that the copy engine never idles between them.
pub(crate) const PIECE_BYTES: u64 = 512 << 20;

/// What the copier owns; moved into its thread by [`Beside::start`].
/// Dropped, each buffer drains the context before it is freed (or is
/// leaked, logged, where that fails).
struct Parts {
    device: Arc<CudaDevice>,
    stream: CudaStream,
    host: PinnedBuffer,
    dev: CudaBuffer,
}

/// The copier. Dropped unfinished (an error between start and finish), it
/// stops, and its buffers are dropped as above.
pub(crate) struct Beside {
    parts: Option<Parts>,
    stop: Arc<AtomicBool>,
    failed: Arc<AtomicBool>,
    quiet: Arc<Mutex<()>>,
    thread: Option<JoinHandle<Result<(u64, f64)>>>,
}

impl Beside {
    /// Allocates the buffers and a stream of its own; nothing is copied yet.
    pub(crate) fn new(device: &Arc<CudaDevice>) -> Result<Self> {
        let stream = device.create_stream()?;
        let host = device.alloc_pinned(PIECE_BYTES)?;
        let dev = device.alloc_device(PIECE_BYTES)?;
        Ok(Self {
            parts: Some(Parts {
                device: Arc::clone(device),
                stream,
                host,
                dev,
            }),
            stop: Arc::new(AtomicBool::new(false)),
            failed: Arc::new(AtomicBool::new(false)),
            quiet: Arc::new(Mutex::new(())),
            thread: None,
        })
    }

    /// Starts copying, one piece after another until [`Self::finish`].
    pub(crate) fn start(&mut self) -> Result<()> {
        let p = self.parts.take().context("copy-beside: already started")?;
        let (stop, failed, quiet) = (
            Arc::clone(&self.stop),
            Arc::clone(&self.failed),
            Arc::clone(&self.quiet),
        );
        let thread = std::thread::Builder::new()
            .name("copy-beside".to_owned())
            .spawn(move || -> Result<(u64, f64)> {
                let run = || -> Result<(u64, f64)> {
                    p.device.bind()?;
                    let t = Instant::now();
                    let mut copied = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        {
                            let _q = quiet.lock().unwrap_or_else(|e| e.into_inner());
                            // SAFETY: whole buffers of equal size, used by
                            // this thread alone; the stream is drained
                            // before the next copy, and the buffers are
                            // dropped (draining the context) only after.
                            unsafe {
                                p.device.copy_h2d(
                                    &p.stream,
                                    HostSource::Pinned(&p.host),
                                    0,
                                    &p.dev,
                                    0,
                                    PIECE_BYTES,
                                )
                            }?;
                        }
                        p.device.synchronize_stream(&p.stream)?;
                        copied += PIECE_BYTES;
                    }
                    Ok((copied, t.elapsed().as_secs_f64()))
                };
                let out = run();
                if out.is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
                out
            })
            .context("copy-beside: starting its thread")?;
        self.thread = Some(thread);
        Ok(())
    }

    /// Held across a timeline's start and stop: no copy is being enqueued
    /// (and so half traced) meanwhile.
    pub(crate) fn quiet(&self) -> MutexGuard<'_, ()> {
        self.quiet.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Fails, with the copier's error, once the copier has stopped on one:
    /// a row after that would be timed with no copies beside it.
    pub(crate) fn check(&mut self) -> Result<()> {
        if !self.failed.load(Ordering::Relaxed) {
            return Ok(());
        }
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(Err(e))) => Err(e.context("copy-beside: the copier stopped")),
            Some(Err(_)) => bail!("copy-beside: its thread panicked"),
            _ => bail!("copy-beside: the copier stopped"),
        }
    }

    /// Stops the copier and returns the rate it copied at from its start,
    /// GB/s.
    pub(crate) fn finish(mut self) -> Result<f64> {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self.thread.take().context("copy-beside: never started")?;
        let (bytes, secs) = thread
            .join()
            .map_err(|_| anyhow!("copy-beside: its thread panicked"))??;
        Ok(if secs > 0.0 {
            bytes as f64 / secs / 1e9
        } else {
            0.0
        })
    }
}

impl Drop for Beside {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
