//! A probe of the staged path's shape (no offload engine): 8 GiB of
//! pageable bytes streamed to the device through pinned staging buffers,
//! pipelined (the host fills buffer j once the DMA that last read it is
//! done, then queues its DMA), with whole-block buffers (today's ring) or
//! small chunks, plain or streaming-store fills. Prints GB/s per shape.

use std::time::Instant;

use anyhow::Result;
use offload_core::device::{ByteSource, Device, HostBuffer, HostSource};
use offload_cuda::CudaDevice;
use rayon::prelude::*;

struct Pooled<'a> {
    src: &'a [u8],
    pool: &'a rayon::ThreadPool,
    threads: usize,
    streaming: bool,
}

impl ByteSource for Pooled<'_> {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        let src = &self.src[position as usize..position as usize + dst.len()];
        let per = dst
            .len()
            .div_ceil(self.threads)
            .next_multiple_of(4096)
            .max(4096);
        let streaming = self.streaming;
        self.pool.install(|| {
            dst.par_chunks_mut(per)
                .zip(src.par_chunks(per))
                .for_each(|(d, s)| {
                    if streaming {
                        offload_core::copy::copy_streaming(d, s)
                    } else {
                        d.copy_from_slice(s)
                    }
                })
        });
    }
}

/// Whether the device buffer's last MiB equals the source's (the last
/// pass of a shape wrote every byte).
fn last_mib_arrived(
    device: &CudaDevice,
    stream: &offload_cuda::CudaStream,
    dev: &offload_cuda::CudaBuffer,
    src: &[u8],
) -> Result<bool> {
    let total = src.len();
    let mut back = device.alloc_pinned(1 << 20)?;
    let at = (total - (1 << 20)) as u64;
    // SAFETY: both ranges lie within their buffers; synchronised before the read.
    unsafe { device.copy_d2h(stream, dev, at, &mut back, 0, 1 << 20) }?;
    device.synchronize_stream(stream)?;
    let mut host = vec![0u8; 1 << 20];
    back.read_into(0, &mut host);
    // SAFETY: the stream was drained: no copy writes the buffer.
    unsafe { device.free_pinned(back) }?;
    Ok(host == src[total - (1 << 20)..])
}

fn main() -> Result<()> {
    let total: usize = 8 << 30;
    let mut src = vec![0u8; total];
    for (i, b) in src.iter_mut().enumerate().step_by(64) {
        *b = (i >> 6) as u8 | 1;
    }
    let device = CudaDevice::new(0)?;
    let stream = device.create_stream()?;
    let dev = device.alloc_device(total as u64)?;
    let threads = offload_core::runtime::staging_fill_threads();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    println!("fill threads {threads}");
    // The link alone.
    {
        let mut pinned = device.alloc_pinned(1 << 30)?;
        pinned.write_from(0, 1 << 30, &&src[..1 << 30]);
        let mut best = 0f64;
        for _ in 0..3 {
            device.synchronize_stream(&stream)?;
            let t = Instant::now();
            for i in 0..8u64 {
                // SAFETY: both buffers hold the range; drained below before free.
                unsafe {
                    device.copy_h2d(
                        &stream,
                        HostSource::Pinned(&pinned),
                        0,
                        &dev,
                        i << 30,
                        1 << 30,
                    )
                }?;
            }
            device.synchronize_stream(&stream)?;
            best = best.max(total as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        println!("{:48} {best:7.2} GB/s", "link: pinned → device (best of 3)");
        // SAFETY: drained.
        unsafe { device.free_pinned(pinned) }?;
    }
    let shapes: &[(usize, usize, bool, &str)] = &[
        (
            680 << 20,
            2,
            true,
            "whole blocks 680 MiB x2, streaming (today)",
        ),
        (680 << 20, 2, false, "whole blocks 680 MiB x2, plain"),
        (4 << 20, 8, false, "chunks 4 MiB x8, plain"),
        (8 << 20, 4, false, "chunks 8 MiB x4, plain"),
        (8 << 20, 8, false, "chunks 8 MiB x8, plain"),
        (16 << 20, 4, false, "chunks 16 MiB x4, plain"),
        (16 << 20, 8, false, "chunks 16 MiB x8, plain"),
        (32 << 20, 4, false, "chunks 32 MiB x4, plain"),
        (64 << 20, 4, false, "chunks 64 MiB x4, plain"),
        (16 << 20, 8, true, "chunks 16 MiB x8, streaming"),
        (64 << 20, 4, true, "chunks 64 MiB x4, streaming"),
    ];
    for &(chunk, ring, streaming, label) in shapes {
        let mut bufs = Vec::new();
        let mut evs = Vec::new();
        for _ in 0..ring {
            bufs.push(device.alloc_pinned(chunk as u64)?);
            evs.push(device.create_event()?);
        }
        // Chunk `off..off + n` of the source into `buf` by the pool.
        let fill = |buf: &mut offload_cuda::PinnedBuffer, off: usize, n: usize| {
            buf.write_from(
                0,
                n as u64,
                &Pooled {
                    src: &src[off..off + n],
                    pool: &pool,
                    threads,
                    streaming,
                },
            )
        };
        let mut staged = Vec::new();
        let mut alone = Vec::new();
        for _ in 0..3 {
            device.synchronize_stream(&stream)?;
            let t = Instant::now();
            for (i, off) in (0..total).step_by(chunk).enumerate() {
                let j = i % ring;
                let n = chunk.min(total - off);
                device.synchronize_event(&evs[j])?;
                fill(&mut bufs[j], off, n);
                // SAFETY: the buffer holds `n`, the device buffer the range; the buffer is
                // rewritten only after its event (next); drained before free.
                unsafe {
                    device.copy_h2d(
                        &stream,
                        HostSource::Pinned(&bufs[j]),
                        0,
                        &dev,
                        off as u64,
                        n as u64,
                    )
                }?;
                device.record_event(&evs[j], &stream)?;
            }
            device.synchronize_stream(&stream)?;
            staged.push(total as f64 / t.elapsed().as_secs_f64() / 1e9);
            let t = Instant::now();
            for (i, off) in (0..total).step_by(chunk).enumerate() {
                fill(&mut bufs[i % ring], off, chunk.min(total - off));
            }
            alone.push(total as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        staged.sort_by(f64::total_cmp);
        alone.sort_by(f64::total_cmp);
        println!(
            "{label:48} staged {:6.2} ({:.2}–{:.2}) GB/s, fill alone {:6.2} GB/s",
            staged[1], staged[0], staged[2], alone[1]
        );
        for b in bufs {
            // SAFETY: the stream was drained: no copy reads the buffer.
            unsafe { device.free_pinned(b) }?;
        }
        anyhow::ensure!(
            last_mib_arrived(&device, &stream, &dev, &src)?,
            "{label}: the last MiB on the device differs from the source"
        );
    }
    Ok(())
}
