//! Reads of a unit's bytes from the weight source, one thread or split
//! over several (each a contiguous, page-aligned part): what a staging
//! fill writes into a pinned buffer, what a codec encodes at `enable`, and
//! a coded master's copy into pinned memory. Below the staging ring
//! (`filler`) and the backends' shared handles (`shared`), which both use
//! it.

use crate::sync::{Mutex, lock};

use crate::device::ByteSource;
use crate::runtime::backend::WeightSource;
use crate::runtime::layout::Unit;

/// `unit`'s bytes, packed as its entries lay them out, read from
/// `weights` (what a codec encodes: [`crate::device::Codec::encode`]).
pub fn unit_bytes<'a>(
    weights: &'a dyn WeightSource,
    unit: &'a Unit,
) -> impl crate::device::ByteSource + 'a {
    UnitBytes {
        weights,
        unit,
        direct: false,
    }
}

/// `unit`'s bytes as [`unit_bytes`] gives them, a large read split over
/// the fills' threads ([`fill_threads`]), each a
/// contiguous part: what a codec encoding a unit reads (at `enable`, and
/// `offload-pack`'s coded-block files). Why: the encoder copies the unit
/// into memory of its own before coding it, and one thread copying a Flux
/// double block's 680 MB into fresh pages was a third of encoding it
/// (0.48–0.51 s of 1.4 s on two cores; `bench/results/encode-2026-12-06-dev/`).
pub fn unit_bytes_parallel<'a>(
    weights: &'a dyn WeightSource,
    unit: &'a Unit,
) -> impl crate::device::ByteSource + 'a {
    ParallelUnitBytes {
        weights,
        unit,
        threads: fill_threads(),
        pool: None,
        direct: false,
    }
}

/// A unit's bytes, packed as its entries lay them out, read from the
/// weight source.
pub(crate) struct UnitBytes<'a> {
    pub(crate) weights: &'a dyn WeightSource,
    pub(crate) unit: &'a Unit,
    /// Read with [`WeightSource::read_direct`] (nothing mapped in).
    pub(crate) direct: bool,
}

impl ByteSource for UnitBytes<'_> {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        let end = position + dst.len() as u64;
        // A byte no storage covers reads as zero, whatever `dst` held (a
        // buffer reused across units, as `offload-pack` reuses one): units
        // are laid back to back (`Unit::pack`), but `Unit` is public.
        let covered: u64 = self
            .unit
            .entries
            .iter()
            .map(|e| {
                (e.offset + e.bytes)
                    .min(end)
                    .saturating_sub(e.offset.max(position))
            })
            .sum();
        if covered < dst.len() as u64 {
            dst.fill(0);
        }
        for e in &self.unit.entries {
            let (from, to) = (e.offset.max(position), (e.offset + e.bytes).min(end));
            if from < to {
                let out = &mut dst[(from - position) as usize..(to - position) as usize];
                if self.direct {
                    self.weights.read_direct(e.storage, from - e.offset, out);
                } else {
                    self.weights.read(e.storage, from - e.offset, out);
                }
            }
        }
    }
}

/// One part of a parallel read: its position and bytes, until a thread
/// (or, where none could start, the caller) takes it.
type PartSlot<'a> = Mutex<Option<(u64, &'a mut [u8])>>;

/// A unit's bytes read from the weight source by up to `threads` host
/// threads, each a contiguous part (page-aligned), into one staging buffer.
pub(crate) struct ParallelUnitBytes<'a> {
    pub(crate) weights: &'a dyn WeightSource,
    pub(crate) unit: &'a Unit,
    pub(crate) threads: usize,
    /// Worker threads to split over (the staging ring's pool), else threads
    /// started for the read.
    pub(crate) pool: Option<&'a rayon::ThreadPool>,
    /// Read with [`WeightSource::read_direct`]: the pages are released
    /// after the read, so they are never mapped in.
    pub(crate) direct: bool,
}

impl crate::device::ByteSource for ParallelUnitBytes<'_> {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        ParallelBytes {
            reader: Reader::Unit(UnitBytes {
                weights: self.weights,
                unit: self.unit,
                direct: self.direct,
            }),
            threads: self.threads,
            pool: self.pool,
        }
        .read_at(position, dst);
    }
}

/// What a parallel read reads: a unit from the weight source, or bytes
/// in memory (a coded block's), or a coded block's bytes read with
/// positional reads where the weight source holds them as its own window
/// (`WeightSource::read_coded_direct`), else from memory.
pub(crate) enum Reader<'a> {
    Unit(UnitBytes<'a>),
    Slice(&'a [u8]),
    CodedDirect {
        weights: &'a dyn WeightSource,
        unit: &'a Unit,
        coded: &'a [u8],
    },
}

impl crate::device::ByteSource for Reader<'_> {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        let slice = |s: &[u8], dst: &mut [u8]| {
            let at = position as usize;
            crate::copy::copy_streaming(dst, &s[at..at + dst.len()]);
        };
        match self {
            Reader::Unit(u) => u.read_at(position, dst),
            Reader::Slice(s) => slice(s, dst),
            Reader::CodedDirect {
                weights,
                unit,
                coded,
            } => {
                if !weights.read_coded_direct(unit, coded, position, dst) {
                    slice(coded, dst);
                }
            }
        }
    }
}

/// `bytes` as a source read over the fills' threads ([`fill_threads`]),
/// each a contiguous part written with streaming stores: a coded master
/// copied into pinned memory at `enable`, which only the copy engine
/// reads.
pub(crate) fn parallel_slice(bytes: &[u8]) -> impl crate::device::ByteSource + '_ {
    ParallelBytes {
        reader: Reader::Slice(bytes),
        threads: fill_threads(),
        pool: None,
    }
}

/// The least bytes a read split over threads it starts gives each (below
/// twice this a read stays on one thread): starting a thread costs tens of
/// microseconds.
pub(crate) const SPAWNED_PER_THREAD: usize = 4 << 20;

/// The same over a staging ring's worker pool, whose workers are woken,
/// not started: a ring of parts fills a part at a time, and a 4 MiB part
/// on one thread filled at 9 GB/s on an H100's host, where 16 workers copy
/// 50–60 GB/s (BENCHMARKS, "Small staging rings").
pub(crate) const POOLED_PER_THREAD: usize = 256 << 10;

/// A read split over up to `threads` host threads, each a contiguous part
/// (page-aligned).
pub(crate) struct ParallelBytes<'a> {
    pub(crate) reader: Reader<'a>,
    pub(crate) threads: usize,
    pub(crate) pool: Option<&'a rayon::ThreadPool>,
}

impl crate::device::ByteSource for ParallelBytes<'_> {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        let reader = &self.reader;
        let per_thread = if self.pool.is_some() {
            POOLED_PER_THREAD
        } else {
            SPAWNED_PER_THREAD
        };
        let threads = self.threads.min(dst.len() / per_thread).max(1);
        if threads == 1 || cfg!(loom) {
            reader.read_at(position, dst);
            return;
        }
        let per = dst.len().div_ceil(threads).next_multiple_of(4096);
        // The ring's workers, woken for the parts (no thread started per
        // fill); a part's panic reaches the caller, as a scoped thread's.
        if let Some(pool) = self.pool {
            pool.scope(|s| {
                for (i, part) in dst.chunks_mut(per).enumerate() {
                    s.spawn(move |_| reader.read_at(position + (i * per) as u64, part));
                }
            });
            return;
        }
        // Each part in a slot its thread takes; a part whose thread the OS
        // refused (a pids limit) is still in its slot after the scope, and
        // is read here.
        let slots: Vec<PartSlot<'_>> = dst
            .chunks_mut(per)
            .enumerate()
            .map(|(i, part)| Mutex::new(Some((position + (i * per) as u64, part))))
            .collect();
        std::thread::scope(|s| {
            for slot in &slots {
                let reader = &reader;
                let spawned = std::thread::Builder::new().spawn_scoped(s, move || {
                    if let Some((at, part)) = lock(slot).take() {
                        reader.read_at(at, part);
                    }
                });
                if let Err(e) = spawned {
                    tracing::debug!(
                        "a staging fill thread was refused ({e}); its part is read inline"
                    );
                }
            }
        });
        for slot in &slots {
            if let Some((at, part)) = lock(slot).take() {
                reader.read_at(at, part);
            }
        }
    }
}

/// Host threads one staging fill splits over (CONTRACT §7c): the machine's
/// cores, at most 16.
pub fn fill_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(16))
}

/// A byte source read from `.1` on.
pub(crate) struct Offset<'a>(pub(crate) &'a dyn crate::device::ByteSource, pub(crate) u64);

impl crate::device::ByteSource for Offset<'_> {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        self.0.read_at(self.1 + position, dst);
    }
}

#[cfg(test)]
#[cfg(not(loom))]
mod tests {
    use super::*;
    use crate::model::{ModuleId, StorageId};
    use crate::runtime::layout::Entry;

    /// Storages of uneven sizes, each byte a function of its storage and
    /// position.
    struct Storages(Vec<Vec<u8>>);

    impl WeightSource for Storages {
        fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
            let s = &self.0[storage.index()];
            let at = position as usize;
            dst.copy_from_slice(&s[at..at + dst.len()]);
        }
    }

    /// A unit read split over threads reads what one thread reads: a unit
    /// of 13 MiB and a few bytes whose storages straddle every part's
    /// boundary (parts of 4 MiB and more, page-aligned), at 2, 3 and 5
    /// threads and through `unit_bytes_parallel`, whole and from an odd
    /// position. Seen red with every part after the first read 2 bytes
    /// off (the helper's plant D2, which the simulator's small units never
    /// split far enough to see).
    #[test]
    fn a_unit_read_over_threads_reads_what_one_thread_reads() {
        let sizes = [(3 << 20) + 5, 1, (5 << 20) + 4093, 4096, (4 << 20) + 7];
        let storages = Storages(
            sizes
                .iter()
                .enumerate()
                .map(|(k, &n)| (0..n).map(|i| ((i * 31 + k * 7) % 253) as u8).collect())
                .collect(),
        );
        let mut offset = 0u64;
        let entries = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                let e = Entry {
                    storage: StorageId(k as u32),
                    offset,
                    bytes: n as u64,
                };
                offset += n as u64;
                e
            })
            .collect();
        let unit = Unit {
            name: "block".to_owned(),
            module: ModuleId(0),
            entries,
            bytes: offset,
        };
        let mut want = vec![0u8; offset as usize];
        unit_bytes(&storages, &unit).read_at(0, &mut want);
        assert_eq!(&want[..5], &storages.0[0][..5]);
        for threads in [2, 3, 5] {
            for (position, len) in [(0usize, want.len()), (4097, want.len() - 4097 - 3)] {
                let mut got = vec![0u8; len];
                ParallelUnitBytes {
                    weights: &storages,
                    unit: &unit,
                    threads,
                    pool: None,
                    direct: false,
                }
                .read_at(position as u64, &mut got);
                assert!(
                    got == want[position..position + len],
                    "{threads} threads at {position}"
                );
            }
        }
        let mut got = vec![0u8; want.len()];
        unit_bytes_parallel(&storages, &unit).read_at(0, &mut got);
        assert!(got == want);
        // A unit with a gap no storage covers, read into a buffer that held
        // other bytes: the gap reads as zeros, on one thread and split.
        // Seen red without the fill (the 0xee bytes stayed).
        let mut gapped = unit.clone();
        for e in &mut gapped.entries[2..] {
            e.offset += 5000;
        }
        gapped.bytes += 5000;
        let gap = unit.entries[2].offset as usize..unit.entries[2].offset as usize + 5000;
        for threads in [1, 3] {
            let mut got = vec![0xeeu8; gapped.bytes as usize];
            ParallelUnitBytes {
                weights: &storages,
                unit: &gapped,
                threads,
                pool: None,
                direct: false,
            }
            .read_at(0, &mut got);
            assert!(
                got[gap.clone()].iter().all(|&b| b == 0),
                "{threads} threads"
            );
            assert!(got[..gap.start] == want[..gap.start]);
            assert!(got[gap.end..] == want[gap.start..]);
        }
    }
}
