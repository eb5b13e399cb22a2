//! The staged rows' measurements (CONTRACT §7c, `--host-budgets`): the
//! staged path's own rate (pageable → pinned by host threads, pinned →
//! device by DMA, pipelined over two buffers, no compute), and a masters
//! file: the streamed blocks written to one file, mapped, and served as
//! the weight source of the `file` rows, read from the disk after its page
//! cache is dropped.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};
use offload_core::device::{ByteSource, Device, HostBuffer, HostSource};
use offload_core::model::StorageId;
use offload_core::runtime::{Unit, WeightSource};
use offload_cuda::{CudaDevice, CudaStream};

use crate::Loaded;

/// `src` copied into a destination by up to `threads` scoped threads,
/// contiguous page-aligned parts (as the staging filler splits a fill).
pub(crate) struct Parallel<'a>(pub(crate) &'a [u8], pub(crate) usize);

impl ByteSource for Parallel<'_> {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        let src = &self.0[position as usize..position as usize + dst.len()];
        split(dst, self.1, |at, d| {
            crate::fill_copy(d, &src[at..at + d.len()])
        });
    }
}

/// `dst` in contiguous page-aligned parts, one for each of up to `threads`
/// scoped threads, each part passed with its offset in `dst` to `read`
/// (as the staging filler splits a fill).
fn split(dst: &mut [u8], threads: usize, read: impl Fn(usize, &mut [u8]) + Sync) {
    let per = dst.len().div_ceil(threads).next_multiple_of(4096).max(4096);
    let read = &read;
    std::thread::scope(|s| {
        for (i, d) in dst.chunks_mut(per).enumerate() {
            s.spawn(move || read(i * per, d));
        }
    });
}

/// A loaded unit's bytes, as the staged rows' measurements read them.
pub(crate) fn loaded_bytes<'a>(loaded: &'a Loaded, u: &Unit) -> Result<&'a [u8]> {
    loaded
        .units
        .get(&u.name)
        .map(|b| &b[..u.bytes as usize])
        .with_context(|| format!("no loaded memory for `{}`", u.name))
}

/// How the staged rows' measurements read a block: a source of its bytes
/// for a pinned buffer's `write_from` (the fill's threads over loaded
/// memory, a mapping, or `pread`s of a file).
pub(crate) type Source<'a> = dyn Fn(&Unit) -> Result<Box<dyn ByteSource + 'a>> + 'a;

/// A source over `bytes`, copied as the staging fill copies (its threads,
/// its copy).
pub(crate) fn over<'a>(bytes: &'a [u8]) -> Box<dyn ByteSource + 'a> {
    Box::new(Parallel(
        bytes,
        offload_core::runtime::staging_fill_threads(),
    ))
}

/// The staging fill alone, GB/s: each block's bytes (`source`) read into
/// one pinned buffer, back to back; the median of `passes` passes (one
/// pass for a read that must stay cold).
pub(crate) fn fill_rate(
    device: &CudaDevice,
    blocks: &[&Unit],
    source: &Source<'_>,
    passes: usize,
) -> Result<f64> {
    let largest = blocks.iter().map(|u| u.bytes).max().context("no blocks")?;
    let mut pinned = device.alloc_pinned(largest)?;
    let total: u64 = blocks.iter().map(|u| u.bytes).sum();
    let mut times = Vec::new();
    for _ in 0..passes.max(1) {
        let t = Instant::now();
        for u in blocks {
            pinned.write_from(0, u.bytes, &*source(u)?);
        }
        times.push(t.elapsed().as_secs_f64());
    }
    // SAFETY: no copy used the buffer.
    unsafe { device.free_pinned(pinned) }?;
    times.sort_by(f64::total_cmp);
    Ok(total as f64 / times[times.len() / 2] / 1e9)
}

/// The staged path alone, GB/s: each block's bytes (`source`) read into
/// one of two pinned buffers (after the DMA that last read it), then DMA'd
/// to one device buffer, back to back, no compute: the rate the link and
/// the host memory together allow a staged stream (the host's read and the
/// DMA share the host's memory bandwidth). The median of three passes.
pub(crate) fn staged_stream_bandwidth(
    device: &CudaDevice,
    stream: &CudaStream,
    blocks: &[&Unit],
    source: &Source<'_>,
) -> Result<f64> {
    let largest = blocks.iter().map(|u| u.bytes).max().context("no blocks")?;
    let mut pinned = vec![device.alloc_pinned(largest)?, device.alloc_pinned(largest)?];
    let copied = [device.create_event()?, device.create_event()?];
    let dev = device.alloc_device(largest)?;
    let total: u64 = blocks.iter().map(|u| u.bytes).sum();
    let mut times = Vec::new();
    for _ in 0..3 {
        device.synchronize_stream(stream)?;
        let t = Instant::now();
        for (i, u) in blocks.iter().enumerate() {
            let b = i % 2;
            device.synchronize_event(&copied[b])?;
            pinned[b].write_from(0, u.bytes, &*source(u)?);
            // SAFETY: the pinned buffer holds `u.bytes` (the largest), as
            // does the device buffer; the host rewrites the pinned buffer
            // only after `copied[b]` (recorded next); nothing is freed
            // before the stream is synchronised below.
            unsafe {
                device.copy_h2d(stream, HostSource::Pinned(&pinned[b]), 0, &dev, 0, u.bytes)
            }?;
            device.record_event(&copied[b], stream)?;
        }
        device.synchronize_stream(stream)?;
        times.push(t.elapsed().as_secs_f64());
    }
    // SAFETY: the stream is drained.
    unsafe {
        for p in pinned.drain(..) {
            device.free_pinned(p)?;
        }
        device.free_device(dev, &[])?;
    }
    times.sort_by(f64::total_cmp);
    Ok(total as f64 / times[1] / 1e9)
}

/// Bytes of `file` from `at`, read with `pread` by up to `threads` scoped
/// threads in contiguous page-aligned parts: how the staging fill reads a
/// released block (`WeightSource::read_direct` over its threads); a part
/// whose read fails is copied from the file's mapping `map`, as
/// [`FileMasters::read_direct`] falls back.
struct Pread<'a> {
    file: &'a File,
    map: &'a [u8],
    at: u64,
    threads: usize,
}

impl ByteSource for Pread<'_> {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        use std::os::unix::fs::FileExt;
        let at = self.at + position;
        split(dst, self.threads, |offset, d| {
            let from = at + offset as u64;
            if self.file.read_exact_at(d, from).is_err() {
                let from = from as usize;
                crate::fill_copy(d, &self.map[from..from + d.len()]);
            }
        });
    }
}

/// `inner`'s bytes, then `after` (a block's pages released once read).
struct Then<'a> {
    inner: Box<dyn ByteSource + 'a>,
    after: Box<dyn Fn() + 'a>,
}

impl ByteSource for Then<'_> {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        self.inner.read_at(position, dst);
        (self.after)();
    }
}

/// A masters file's read rates, GB/s, each measured as the `file` rows
/// read it: through the mapping (pages kept) or with `pread` (a block
/// released after its read, the budget rows of a file larger than the
/// budget).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub(crate) struct FileRates {
    /// Through the mapping, the page cache dropped first: the disk.
    pub(crate) cold: f64,
    /// Through the mapping from the page cache, alone.
    pub(crate) mapped: f64,
    /// `pread` from the page cache, alone.
    pub(crate) pread: f64,
    /// Through the mapping from the page cache, each block's pages
    /// released after its read (faulted in again by the next), alone.
    pub(crate) mapped_released: f64,
    /// Through the mapping from the page cache into two pinned buffers
    /// pipelined with their DMA (the file's staged stream).
    pub(crate) mapped_stream: f64,
    /// The same, each block's pages released after its read.
    pub(crate) mapped_released_stream: f64,
    /// `pread` from the page cache, pipelined with the DMA.
    pub(crate) pread_stream: f64,
}

/// `--file-reads` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum FileReads {
    /// `pread` into the staging buffer.
    Pread,
    /// Through the mapping.
    Mapped,
    /// Read by the device where they lie, in the mapping
    /// (`staged_reads = "in_place"`, CONTRACT §7c): no fill; the staged
    /// blocks' pages stay mapped. Needs a GPU that reads pageable memory
    /// (HMM or ATS); elsewhere the row's enable fails typed.
    InPlace,
}

/// The streamed blocks in one file, mapped read-only: the weight source of
/// the `file` rows (blocks from the mapping, everything else from the
/// loaded weights). It lends no region to register, so that pinned blocks
/// are copies read from the file and staged ones are read through the
/// mapping; it lends each block's window of the mapping to be read in
/// place by the device (`in-place` rows).
pub(crate) struct FileMasters {
    file: File,
    map: Arc<memmap2::Mmap>,
    /// Each block unit's first byte in the file.
    offsets: BTreeMap<String, u64>,
    loaded: Arc<Loaded>,
    /// Bytes of blocks read with `pread` ([`WeightSource::read_direct`])
    /// and through the mapping, so far: which reader a row used.
    direct_bytes: AtomicU64,
    mapped_bytes: AtomicU64,
    /// Bytes of blocks whose pages were released after their read.
    released_bytes: AtomicU64,
    /// Released blocks are read through the mapping, not with `pread`
    /// ([`Self::set_reads`]).
    mapped_reads: AtomicBool,
}

impl FileMasters {
    /// `path` holding `blocks` back to back (written from `loaded` when it
    /// is missing or of another size; timed), mapped.
    pub(crate) fn open(path: &Path, blocks: &[&Unit], loaded: Arc<Loaded>) -> Result<Self> {
        let mut offsets = BTreeMap::new();
        let mut at = 0u64;
        for u in blocks {
            offsets.insert(u.name.clone(), at);
            at += u.bytes;
        }
        let fresh = std::fs::metadata(path).map_or(true, |m| m.len() != at);
        if fresh {
            let t = Instant::now();
            let mut f = File::create(path).with_context(|| format!("create {}", path.display()))?;
            for u in blocks {
                let bytes = loaded
                    .units
                    .get(&u.name)
                    .with_context(|| format!("no loaded memory for `{}`", u.name))?;
                std::io::Write::write_all(&mut f, &bytes[..u.bytes as usize])?;
            }
            f.sync_all()?;
            eprintln!(
                "masters file {}: {:.2} GB written in {:.1} s",
                path.display(),
                at as f64 / 1e9,
                t.elapsed().as_secs_f64()
            );
        }
        let file = File::open(path).with_context(|| format!("open {}", path.display()))?;
        // SAFETY: the bench wrote the file and nothing else writes it while
        // it is mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }?;
        Ok(Self {
            file,
            map: Arc::new(map),
            offsets,
            loaded,
            direct_bytes: AtomicU64::new(0),
            mapped_bytes: AtomicU64::new(0),
            released_bytes: AtomicU64::new(0),
            mapped_reads: AtomicBool::new(false),
        })
    }

    /// How the blocks released after their read are read from now on.
    pub(crate) fn set_reads(&self, way: FileReads) {
        self.mapped_reads
            .store(way == FileReads::Mapped, Ordering::Relaxed);
    }

    /// Bytes of the file.
    pub(crate) fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Drops the file's pages from this process and from the page cache
    /// (`madvise(MADV_DONTNEED)` on the mapping, then
    /// `posix_fadvise(POSIX_FADV_DONTNEED)`): the next read comes from the
    /// disk.
    pub(crate) fn drop_cache(&self) -> Result<()> {
        // SAFETY: a read-only file mapping: dropped pages are read again
        // from the file.
        unsafe {
            self.map
                .unchecked_advise(memmap2::UncheckedAdvice::DontNeed)?;
        }
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor of an open file; advice only.
        let rc =
            unsafe { libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        anyhow::ensure!(rc == 0, "posix_fadvise(DONTNEED): {rc}");
        Ok(())
    }

    /// Block bytes read so far with `pread`, through the mapping, and
    /// released after their read.
    pub(crate) fn reads(&self) -> (u64, u64, u64) {
        (
            self.direct_bytes.load(Ordering::Relaxed),
            self.mapped_bytes.load(Ordering::Relaxed),
            self.released_bytes.load(Ordering::Relaxed),
        )
    }

    /// The file's read rates ([`FileRates`]): through the mapping from the
    /// disk (page cache dropped first), then from the page cache through
    /// the mapping and with `pread`, alone and pipelined with the DMA.
    pub(crate) fn rates(
        &self,
        device: &CudaDevice,
        stream: &CudaStream,
        blocks: &[&Unit],
    ) -> Result<FileRates> {
        let mapped = |u: &Unit| -> Result<Box<dyn ByteSource + '_>> {
            let at = self.offsets[&u.name] as usize;
            Ok(over(&self.map[at..at + u.bytes as usize]))
        };
        let threads = offload_core::runtime::staging_fill_threads();
        let pread = |u: &Unit| -> Result<Box<dyn ByteSource + '_>> {
            Ok(Box::new(Pread {
                file: &self.file,
                map: &self.map,
                at: self.offsets[&u.name],
                threads,
            }))
        };
        let released = |u: &Unit| -> Result<Box<dyn ByteSource + '_>> {
            let unit = u.clone();
            Ok(Box::new(Then {
                inner: mapped(u)?,
                after: Box::new(move || self.drop_pages(&unit)),
            }))
        };
        self.drop_cache()?;
        let cold = fill_rate(device, blocks, &mapped, 1)?;
        let rates = FileRates {
            cold,
            mapped: fill_rate(device, blocks, &mapped, 3)?,
            mapped_released: fill_rate(device, blocks, &released, 3)?,
            pread: fill_rate(device, blocks, &pread, 3)?,
            mapped_stream: staged_stream_bandwidth(device, stream, blocks, &mapped)?,
            mapped_released_stream: staged_stream_bandwidth(device, stream, blocks, &released)?,
            pread_stream: staged_stream_bandwidth(device, stream, blocks, &pread)?,
        };
        self.released_bytes.store(0, Ordering::Relaxed);
        Ok(rates)
    }

    /// Drops `unit`'s pages from this process (`madvise(MADV_DONTNEED)`),
    /// counted in [`Self::reads`].
    fn drop_pages(&self, unit: &Unit) {
        if let Some((at, len)) = self.range(unit) {
            self.released_bytes.fetch_add(len as u64, Ordering::Relaxed);
            // SAFETY: a read-only file mapping: dropped pages are read
            // again from the page cache or the file.
            let _ = unsafe {
                self.map
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, at, len)
            };
        }
    }

    fn range(&self, unit: &Unit) -> Option<(usize, usize)> {
        self.offsets
            .get(&unit.name)
            .map(|&at| (at as usize, unit.bytes as usize))
    }
}

impl WeightSource for FileMasters {
    fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        let (unit, offset) = &self.loaded.at[&storage];
        match self.offsets.get(unit) {
            Some(&at) => {
                self.mapped_bytes
                    .fetch_add(dst.len() as u64, Ordering::Relaxed);
                let start = (at + offset + position) as usize;
                crate::fill_copy(dst, &self.map[start..start + dst.len()]);
            }
            None => self.loaded.read(storage, position, dst),
        }
    }

    fn read_direct(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        use std::os::unix::fs::FileExt;
        let (unit, offset) = &self.loaded.at[&storage];
        if self.mapped_reads.load(Ordering::Relaxed) {
            return self.read(storage, position, dst);
        }
        match self.offsets.get(unit) {
            Some(&at) if self.file.read_exact_at(dst, at + offset + position).is_ok() => {
                self.direct_bytes
                    .fetch_add(dst.len() as u64, Ordering::Relaxed);
            }
            _ => self.read(storage, position, dst),
        }
    }

    fn pageable_window(&self, unit: &Unit) -> Option<Arc<dyn offload_core::device::HostRegion>> {
        let (at, len) = self.range(unit)?;
        offload_safetensors::MappedWindow::new(Arc::clone(&self.map), at..at + len)
            .map(|w| Arc::new(w) as Arc<dyn offload_core::device::HostRegion>)
    }

    fn prefetch(&self, unit: &Unit) {
        if let Some((at, len)) = self.range(unit) {
            let _ = self.map.advise_range(memmap2::Advice::WillNeed, at, len);
        }
    }

    fn release(&self, unit: &Unit) {
        self.drop_pages(unit);
    }

    fn wants_restore(&self) -> bool {
        false
    }
}

/// The process's resident file-backed pages (`RssFile` of
/// `/proc/self/status`), bytes.
fn rss_file() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("RssFile:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// Samples [`rss_file`] every 5 ms on a thread until dropped; the peak.
pub(crate) struct RssSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssSampler {
    pub(crate) fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(rss_file()));
        let (s, p) = (Arc::clone(&stop), Arc::clone(&peak));
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(rss_file(), Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        });
        Self {
            stop,
            peak,
            thread: Some(thread),
        }
    }

    /// Stops; the peak seen.
    pub(crate) fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The measurements' split read copies what one slice copy does, at
    /// offsets and lengths off the page, the last part short, through the
    /// loaded-bytes source and through `pread` of a file (its fallback to
    /// the mapping included: a range past the file's end reads the map).
    #[test]
    fn split_reads_read_what_one_copy_reads() {
        let source: Vec<u8> = (0..(9u32 << 20) + 123)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let path = std::env::temp_dir().join(format!("offload-split-{}", std::process::id()));
        std::fs::write(&path, &source[..source.len() - 4096]).unwrap();
        let file = File::open(&path).unwrap();
        for (position, len) in [
            (0usize, source.len()),
            (4097, (5 << 20) + 3),
            (source.len() - 5000, 5000),
        ] {
            let want = &source[position..position + len];
            for threads in [1, 3, 16] {
                let mut got = vec![0u8; len];
                Parallel(&source, threads).read_at(position as u64, &mut got);
                assert!(got == want, "loaded, {threads} threads at {position}");
                let mut got = vec![0u8; len];
                Pread {
                    file: &file,
                    map: &source,
                    at: 0,
                    threads,
                }
                .read_at(position as u64, &mut got);
                assert!(got == want, "pread, {threads} threads at {position}");
            }
        }
        let _ = std::fs::remove_file(&path);
    }
}
