//! An unrelated stream of pinned host→device copies, kept busy by a host
//! thread until finished (`--copy-beside`): the resident step timed beside
//! it measures what copies cost this workload's kernels with no offload
//! engine in the way (no hooks, no waits, no slots), the figure the
//! crossover's remaining loss is put on (ARCHITECTURE.md, "What is left at
//! the crossover is the kernels, not the ring").

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use offload_core::device::{Device, HostSource};
use offload_cuda::CudaDevice;

/// Bytes of each copy (one pinned buffer to one device buffer, again and
/// again): large enough that the copy engine never idles between them.
const PIECE_BYTES: u64 = 512 << 20;

/// The copier; [`Beside::finish`] stops it and reports what it moved.
/// Dropped unfinished (an error between start and finish), it stops and
/// frees its buffers all the same.
pub(crate) struct Beside {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<(u64, f64)>>>,
}

impl Beside {
    /// Allocates the buffers and a stream of its own, then starts copying.
    pub(crate) fn start(device: &Arc<CudaDevice>) -> Result<Self> {
        let stream = device.create_stream()?;
        let host = device.alloc_pinned(PIECE_BYTES)?;
        let dev = match device.alloc_device(PIECE_BYTES) {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: nothing was queued that reads the buffer.
                unsafe { device.free_pinned(host) }?;
                return Err(e.into());
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let (d, halt) = (Arc::clone(device), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("copy-beside".to_owned())
            .spawn(move || -> Result<(u64, f64)> {
                d.bind()?;
                let t = Instant::now();
                let mut copied = 0u64;
                let mut failed = None;
                while !halt.load(Ordering::Relaxed) {
                    // SAFETY: whole buffers of equal size, used by this
                    // thread alone; the stream is drained before the next
                    // copy and before either buffer is freed.
                    let done = unsafe {
                        d.copy_h2d(&stream, HostSource::Pinned(&host), 0, &dev, 0, PIECE_BYTES)
                    }
                    .and_then(|()| d.synchronize_stream(&stream));
                    if let Err(e) = done {
                        failed = Some(e);
                        break;
                    }
                    copied += PIECE_BYTES;
                }
                let secs = t.elapsed().as_secs_f64();
                let drained = d.synchronize_stream(&stream);
                // SAFETY: the stream that read them is drained (or the
                // context is gone, and freeing reports it).
                let freed = unsafe { d.free_device(dev, &[]) }
                    .and_then(|()| unsafe { d.free_pinned(host) });
                if let Some(e) = failed {
                    return Err(e).context("copy-beside: a copy failed");
                }
                drained?;
                freed?;
                Ok((copied, secs))
            })
            .context("copy-beside: starting its thread")?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the copier and returns the rate it copied at while it ran,
    /// GB/s.
    pub(crate) fn finish(mut self) -> Result<f64> {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self
            .thread
            .take()
            .context("copy-beside: already finished")?;
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
