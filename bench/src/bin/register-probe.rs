//! A probe: can a staged block be registered in place for its copy and
//! unregistered after it, instead of copied into a staging buffer? Times
//! cuMemHostRegister / Unregister of block-sized windows (anonymous memory
//! and a read-only file mapping in page cache), whether an unregister
//! waits for unrelated copies in flight, and a pipelined stream (register
//! block i while block i-1 copies; unregister after its copy).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use offload_core::device::{Device, HostBuffer, HostRegion, HostSource};
use offload_cuda::CudaDevice;

struct Window {
    map: Arc<dyn AsRef<[u8]> + Send + Sync>,
    at: usize,
    len: usize,
    read_only: bool,
}

// SAFETY: the mapping lives (Arc) and is not written while windows exist.
unsafe impl HostRegion for Window {
    fn bytes(&self) -> &[u8] {
        &(*self.map).as_ref()[self.at..self.at + self.len]
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
}

struct Anon(memmap2::MmapMut);
impl AsRef<[u8]> for Anon {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}
struct Ro(memmap2::Mmap);
impl AsRef<[u8]> for Ro {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

fn run(
    device: &CudaDevice,
    label: &str,
    map: Arc<dyn AsRef<[u8]> + Send + Sync>,
    read_only: bool,
    block: usize,
) -> Result<()> {
    let total = (*map).as_ref().len() / block * block;
    let stream = device.create_stream()?;
    let dev = device.alloc_device(block as u64 * 2)?;
    let win = |i: usize| {
        Box::new(Window {
            map: Arc::clone(&map),
            at: i * block,
            len: block,
            read_only,
        }) as Box<dyn HostRegion>
    };
    let n = total / block;
    // Sequential register / unregister.
    let (mut reg_s, mut unreg_s) = (0f64, 0f64);
    for i in 0..n {
        let t = Instant::now();
        let r = device
            .register_host(win(i))
            .map_err(|e| anyhow::anyhow!("register: {}", e.error))?;
        reg_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        // SAFETY: no copy read it.
        let _ = unsafe { device.unregister_host(r) }?;
        unreg_s += t.elapsed().as_secs_f64();
    }
    println!(
        "{label}: register {:.2} GB/s, unregister {:.2} GB/s ({n} windows of {} MiB)",
        total as f64 / reg_s / 1e9,
        total as f64 / unreg_s / 1e9,
        block >> 20
    );
    // Does an unregister wait for an unrelated copy in flight?
    {
        let mut pinned = device.alloc_pinned(block as u64)?;
        pinned.write_from(0, block as u64, &&(*map).as_ref()[..block]);
        let r = device
            .register_host(win(1))
            .map_err(|e| anyhow::anyhow!("register: {}", e.error))?;
        let t = Instant::now();
        for _ in 0..20 {
            // SAFETY: in range; drained below.
            unsafe {
                device.copy_h2d(
                    &stream,
                    HostSource::Pinned(&pinned),
                    0,
                    &dev,
                    0,
                    block as u64,
                )
            }?;
        }
        let queued = t.elapsed().as_secs_f64();
        let t = Instant::now();
        // SAFETY: no copy reads this window.
        let _ = unsafe { device.unregister_host(r) }?;
        let u = t.elapsed().as_secs_f64();
        let t = Instant::now();
        device.synchronize_stream(&stream)?;
        let rest = t.elapsed().as_secs_f64();
        println!(
            "{label}: 20 copies queued in {:.1} ms; an unregister then took {:.1} ms; the copies' rest {:.1} ms (an unregister that waited leaves ~0)",
            queued * 1e3,
            u * 1e3,
            rest * 1e3
        );
        // SAFETY: drained.
        unsafe { device.free_pinned(pinned) }?;
    }
    // Pipelined: register i, copy it, then unregister i-1 after its copy.
    for rep in 0..2 {
        let ev = [device.create_event()?, device.create_event()?];
        device.synchronize_stream(&stream)?;
        let t = Instant::now();
        let mut prev: Option<(offload_cuda::CudaRegistration, usize)> = None;
        for i in 0..n {
            let r = device
                .register_host(win(i))
                .map_err(|e| anyhow::anyhow!("register: {}", e.error))?;
            // SAFETY: the window is registered and holds `block`; the device buffer 2 blocks.
            unsafe {
                device.copy_h2d(
                    &stream,
                    HostSource::Registered(&r),
                    0,
                    &dev,
                    (i % 2 * block) as u64,
                    block as u64,
                )
            }?;
            device.record_event(&ev[i % 2], &stream)?;
            if let Some((p, j)) = prev.take() {
                device.synchronize_event(&ev[j % 2])?;
                // SAFETY: its copy completed.
                let _ = unsafe { device.unregister_host(p) }?;
            }
            prev = Some((r, i));
        }
        device.synchronize_stream(&stream)?;
        if let Some((p, _)) = prev {
            // SAFETY: drained.
            let _ = unsafe { device.unregister_host(p) }?;
        }
        println!(
            "{label}: pipelined register → copy → unregister, pass {rep}: {:.2} GB/s",
            total as f64 / t.elapsed().as_secs_f64() / 1e9
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let device = CudaDevice::new(0)?;
    let total: usize = 8 << 30;
    let block = 680 << 20;
    for (label, huge) in [
        ("anonymous 4 KiB pages", false),
        ("anonymous, huge pages advised", true),
    ] {
        let mut m = memmap2::MmapMut::map_anon(total)?;
        let _ = m.advise(if huge {
            memmap2::Advice::HugePage
        } else {
            memmap2::Advice::NoHugePage
        });
        for (i, b) in m.iter_mut().enumerate().step_by(4096) {
            *b = i as u8 | 1;
        }
        run(&device, label, Arc::new(Anon(m)), false, block)?;
    }
    // A read-only file mapping in page cache.
    let path = std::env::var("PROBE_FILE").unwrap_or_else(|_| "register-probe.bin".to_owned());
    // Removed however the probe ends.
    struct Remove<'a>(&'a str);
    impl Drop for Remove<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(self.0);
        }
    }
    let _remove = Remove(&path);
    {
        let f = std::fs::File::create(&path).with_context(|| format!("create {path}"))?;
        f.set_len(total as u64)
            .with_context(|| format!("set_len {path}"))?;
        // SAFETY: the probe just created the file; nothing else maps it.
        let mut m =
            unsafe { memmap2::MmapMut::map_mut(&f) }.with_context(|| format!("map {path}"))?;
        for (i, b) in m.iter_mut().enumerate().step_by(4096) {
            *b = i as u8 | 1;
        }
        m.flush().with_context(|| format!("flush {path}"))?;
    }
    let f = std::fs::File::open(&path)?;
    // SAFETY: the probe wrote the file; nothing else writes it.
    let m = unsafe { memmap2::Mmap::map(&f) }?;
    let _ = m.advise(memmap2::Advice::WillNeed);
    let mut sum = 0u64;
    for i in (0..m.len()).step_by(4096) {
        sum += u64::from(m[i]);
    }
    println!("file touched ({sum})");
    run(
        &device,
        "read-only file mapping (page cache)",
        Arc::new(Ro(m)),
        true,
        block,
    )?;
    for block in [64 << 20, 256 << 20] {
        let f = std::fs::File::open(&path)?;
        // SAFETY: the probe wrote the file; nothing else writes it.
        let m = unsafe { memmap2::Mmap::map(&f) }?;
        run(
            &device,
            &format!("file, {} MiB windows", block >> 20),
            Arc::new(Ro(m)),
            true,
            block,
        )?;
    }
    Ok(())
}
