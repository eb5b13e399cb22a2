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
/// (0.49 s of 1.4 s on two cores).
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
    /// Worker threads to split over ([`StagingRing::pool`]), else threads
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

/// `bytes` as a source read by up to `threads` host threads, each a
/// contiguous part written with streaming stores: a coded master copied
/// into pinned memory at `enable`, which only the copy engine reads.
pub(crate) fn parallel_slice(bytes: &[u8], threads: usize) -> impl crate::device::ByteSource + '_ {
    ParallelBytes {
        reader: Reader::Slice(bytes),
        threads,
        pool: None,
    }
}

/// A read split over up to `threads` host threads, each a contiguous part
/// (page-aligned).
pub(crate) struct ParallelBytes<'a> {
    pub(crate) reader: Reader<'a>,
    pub(crate) threads: usize,
    pub(crate) pool: Option<&'a rayon::ThreadPool>,
}

impl crate::device::ByteSource for ParallelBytes<'_> {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        /// Below this a read stays on one thread.
        const PER_THREAD: usize = 4 << 20;
        let reader = &self.reader;
        let threads = self.threads.min(dst.len() / PER_THREAD).max(1);
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
