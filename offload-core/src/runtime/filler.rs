//! The staging ring's host side (CONTRACT §7c): its pinned staging buffers,
//! each behind a lock with the event that orders its reuse, and the filler
//! that copies staged masters into them from pageable memory.
//!
//! Where the device allows host work on a thread of its own
//! ([`crate::device::Device::host_worker_threads`]), the filler is a thread:
//! the engine hands it the next staged block while it copies the current
//! one, so the host's copy overlaps the link, compute and the pinned blocks'
//! copies instead of blocking the hook's thread. Otherwise (the simulator,
//! whose host is one deterministic clock) each fill runs on the caller's
//! thread when the engine needs it. Either way one rule orders a buffer's
//! reuse: the filler waits for the buffer's `copied` event (the copy that
//! last read it) before writing it.

use crate::sync::{Arc, Condvar, Mutex, MutexGuard, lock};
use std::collections::VecDeque;

use crate::device::{Api, Device, HostBuffer};
use crate::lifecycle::OffloadError;
use crate::runtime::backend::WeightSource;
use crate::runtime::layout::Unit;
use crate::runtime::read::{ParallelBytes, Reader, UnitBytes};
use crate::runtime::shared::dev_err;

/// What a staging buffer holds: part `.2` of block `.1` of ring `.0` (a
/// staged block larger than a buffer passes through in parts of it).
pub(crate) type Tag = (usize, usize, u64);

/// What one fill copies: bytes `range` (offset, length) of `unit`'s bytes,
/// or of its `coded` bytes, tagged `tag`; `last`: the unit's last part.
pub(crate) struct Part<'a> {
    pub(crate) tag: Tag,
    pub(crate) unit: &'a Unit,
    pub(crate) coded: Option<&'a std::sync::Arc<dyn crate::device::HostRegion>>,
    pub(crate) range: (u64, u64),
    pub(crate) last: bool,
}

/// One pinned staging buffer, locked by the filler for the whole of a fill
/// and lent to the engine for a copy out of it.
pub(crate) struct Stage<A: Api> {
    pub(crate) buffer: A::HostBuffer,
    /// Recorded on the copy stream after each copy out of the buffer.
    pub(crate) copied: A::Event,
}

/// What a staging buffer holds, behind a lock of its own that no fill
/// holds while it copies: the hook's thread reads it without waiting for
/// a fill in progress.
#[derive(Default)]
struct Meta {
    /// The part whose bytes the buffer holds, once no fill is pending.
    holds: Option<Tag>,
    /// A copy out of it has been issued (its `copied` recorded) since it
    /// was last filled: it may be refilled.
    spent: bool,
    /// A fill of it is queued or running.
    pending: bool,
    /// Its pending fill has waited for the copy that last read the buffer
    /// and is copying bytes in: it ends in host time, not the copy
    /// stream's ([`StagingRing::lands_without_copy_wait`]).
    filling: bool,
    /// Why its last fill failed.
    error: Option<String>,
}

struct Cell<A: Api> {
    stage: Mutex<Stage<A>>,
    meta: Mutex<Meta>,
    /// Signalled (with `meta`) when a fill ends.
    done: Condvar,
}

/// One fill: bytes `range` of `unit`'s bytes (or of its coded bytes,
/// `coded`) into stage `stage`, tagged `tag`.
struct Job {
    stage: usize,
    tag: Tag,
    /// Offset and length within the unit's (or its coded) bytes.
    range: (u64, u64),
    /// The unit's last part: its pages are released after it.
    last: bool,
    unit: Unit,
    coded: Option<std::sync::Arc<dyn crate::device::HostRegion>>,
    /// Only the planted `HostStagingReuseBeforeCopy` sets it.
    skip_wait: bool,
    release: bool,
    /// A unit to read ahead after this one (`WeightSource::prefetch`).
    next: Option<Unit>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    stop: bool,
}

/// What the filler reads with.
struct Context<A: Api> {
    device: Arc<A::Device>,
    weights: Arc<dyn WeightSource>,
    threads: usize,
    /// The ring's worker threads a fill splits over (`threads` of them,
    /// started once with the ring and stopped when it drops), or `None`
    /// where they could not start (each fill then starts its own).
    pool: Option<rayon::ThreadPool>,
    /// The fills so far, as the host timed them.
    tally: Mutex<FillLog>,
}

/// The staging fills a ring ran, timed on the host from the first byte
/// written to the pages released (never the wait for the buffer's copy):
/// the host's fill rate as the ring ran it, beside its copies and compute
/// (CONTRACT §7c), which the staged forecast predicts from.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct FillTally {
    /// Fills that completed.
    pub(crate) fills: u64,
    /// Bytes they wrote.
    pub(crate) bytes: u64,
    /// Seconds they took together.
    pub(crate) seconds: f64,
}

impl FillTally {
    /// Bytes per second, once something was filled.
    pub(crate) fn bytes_per_s(&self) -> Option<f64> {
        (self.fills > 0 && self.seconds > 0.0).then(|| self.bytes as f64 / self.seconds)
    }
}

/// The fills a ring ran, each as timed, kept back to `window` bytes: the
/// rate the ring's recent fills ran at, not its first ones'. Why: a mapped
/// checkpoint's first step reads its staged blocks from the disk (2 GB/s
/// on the lent H100, where the page cache then served 38–49 GB/s to
/// `pread`), and a rate averaged over every fill so far forecast that
/// file's step at 0.26–0.31 of what it ran (BENCHMARKS, "A masters file
/// larger than the budget…"). A window of one pass's staged bytes (the
/// engine sets it) keeps the last pass: the page cache's rate where the
/// file stays cached, the disk's where it does not. No window: the sums
/// of every fill, no list.
#[derive(Debug, Default)]
pub(crate) struct FillLog {
    /// Bytes of recent fills kept (0: every fill).
    window: u64,
    /// The fills kept, oldest first: bytes and seconds.
    recent: VecDeque<(u64, f64)>,
    /// What `recent` holds together.
    kept: FillTally,
}

impl FillLog {
    /// One fill of `bytes` that took `seconds`.
    pub(crate) fn record(&mut self, bytes: u64, seconds: f64) {
        // Without a window only the sums are kept (a ring that runs for
        // the whole enable keeps no list that grows with it).
        if self.window > 0 {
            self.recent.push_back((bytes, seconds));
        }
        self.kept.fills += 1;
        self.kept.bytes += bytes;
        self.kept.seconds += seconds;
        self.trim();
    }

    /// Keeps the fills of the last `bytes` (at least the newest fill),
    /// counting from the first fill after a window was set where there was
    /// none; 0 keeps the sums of every fill from now on.
    pub(crate) fn set_window(&mut self, bytes: u64) {
        if bytes == 0 {
            self.recent.clear();
        } else if self.window == 0 {
            // Fills summed without a list cannot leave a window: a window
            // starts from nothing.
            self.kept = FillTally::default();
        }
        self.window = bytes;
        self.trim();
    }

    /// The kept fills together.
    pub(crate) fn tally(&self) -> FillTally {
        self.kept
    }

    fn trim(&mut self) {
        if self.window == 0 {
            return;
        }
        while self.recent.len() > 1 {
            let (bytes, seconds) = self.recent[0];
            if self.kept.bytes - bytes < self.window {
                break;
            }
            self.recent.pop_front();
            self.kept.fills -= 1;
            self.kept.bytes -= bytes;
            self.kept.seconds -= seconds;
        }
    }
}

/// The staging buffers and their filler.
pub(crate) struct StagingRing<A: Api> {
    cells: Arc<Vec<Cell<A>>>,
    /// Bytes of each buffer (all alike).
    part_bytes: u64,
    /// Bytes of the buffers together.
    bytes: u64,
    context: Arc<Context<A>>,
    queue: Arc<(Mutex<Queue>, Condvar)>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl<A: Api> StagingRing<A> {
    /// A ring over `stages`, filled by `threads` host threads reading
    /// `weights`; a filler thread where `device` allows one.
    pub(crate) fn new(
        device: Arc<A::Device>,
        weights: Arc<dyn WeightSource>,
        stages: Vec<(A::HostBuffer, A::Event)>,
        threads: usize,
    ) -> Self {
        let background = device.host_worker_threads() && !cfg!(loom);
        let part_bytes = stages.first().map_or(0, |(b, _)| b.len_bytes());
        let bytes = stages.iter().map(|(b, _)| b.len_bytes()).sum();
        let cells: Arc<Vec<Cell<A>>> = Arc::new(
            stages
                .into_iter()
                .map(|(buffer, copied)| Cell {
                    stage: Mutex::new(Stage { buffer, copied }),
                    meta: Mutex::new(Meta::default()),
                    done: Condvar::new(),
                })
                .collect(),
        );
        let context = Arc::new(Context {
            device,
            weights,
            pool: fill_pool(threads),
            threads,
            tally: Mutex::new(FillLog::default()),
        });
        let queue: Arc<(Mutex<Queue>, Condvar)> = Arc::default();
        let worker = if background {
            let (cells, context, queue) =
                (Arc::clone(&cells), Arc::clone(&context), Arc::clone(&queue));
            let spawned = std::thread::Builder::new()
                .name("offload-stage-fill".to_owned())
                .spawn(move || {
                    ALIVE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    // Counted down however the thread ends.
                    struct Alive;
                    impl Drop for Alive {
                        fn drop(&mut self) {
                            ALIVE.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                    let _alive = Alive;
                    work(&cells, &context, &queue);
                });
            match spawned {
                Ok(handle) => Some(handle),
                Err(e) => {
                    tracing::warn!(
                        "no staging fill thread ({e}); staged blocks fill on the hook's thread"
                    );
                    None
                }
            }
        } else {
            None
        };
        Self {
            cells,
            part_bytes,
            bytes,
            context,
            queue,
            worker,
        }
    }

    /// Staging buffers.
    pub(crate) fn len(&self) -> usize {
        self.cells.len()
    }

    /// The ring's fill workers, for reads beside its fills (a staged
    /// upload at enable).
    pub(crate) fn pool(&self) -> Option<&rayon::ThreadPool> {
        self.context.pool.as_ref()
    }

    /// Bytes of one staging buffer (each is as large): a staged block
    /// larger than it passes through in parts of it.
    pub(crate) fn part_bytes(&self) -> u64 {
        self.part_bytes
    }

    /// Bytes of each staging buffer together.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The fills run so far (the last `window` bytes of them, where
    /// [`Self::set_fill_window`] set one), timed.
    pub(crate) fn tally(&self) -> FillTally {
        lock(&self.context.tally).tally()
    }

    /// Times only the fills of the last `bytes` ([`FillLog`]): the engine
    /// sets one pass's staged bytes.
    pub(crate) fn set_fill_window(&self, bytes: u64) {
        lock(&self.context.tally).set_window(bytes);
    }

    /// The stage holding `tag` (filled, or a fill pending), if any.
    pub(crate) fn holding(&self, tag: Tag) -> Option<usize> {
        self.cells
            .iter()
            .position(|c| lock(&c.meta).holds == Some(tag))
    }

    /// Whether stage `j`'s fill has ended (its bytes are in, or its error
    /// is): [`Self::with_filled`] would not wait.
    pub(crate) fn is_filled(&self, j: usize) -> bool {
        !lock(&self.cells[j].meta).pending
    }

    /// Whether stage `j` may be filled now without losing bytes a copy
    /// has yet to read: no fill pending, and empty or copied out of since
    /// its last fill.
    pub(crate) fn is_free(&self, j: usize) -> bool {
        let meta = lock(&self.cells[j].meta);
        !meta.pending && (meta.holds.is_none() || meta.spent)
    }

    /// Whether part `tag` can be had without the host waiting for the copy
    /// stream: a stage holds it filled, or its fill has waited for the
    /// buffer's last copy and is copying bytes in; or no stage holds it,
    /// no fill queued on the filler thread is still to wait for a copy
    /// (a fill queued now would run after it), and stage `next` (where it
    /// would be filled) is free and the copy that last read it has
    /// completed (a query, no wait). A stage whose fill is queued behind
    /// others reads `false`. The last post-forward's loop asks this before
    /// each part: a wait for the copy stream's backlog there would outlast
    /// the kernels it runs beside (CONTRACT §7c).
    pub(crate) fn lands_without_copy_wait(&self, tag: Tag, next: usize) -> bool {
        if let Some(j) = self.holding(tag) {
            let meta = lock(&self.cells[j].meta);
            return !meta.pending || meta.filling;
        }
        if self.cells.iter().any(|c| {
            let meta = lock(&c.meta);
            meta.pending && !meta.filling
        }) {
            return false;
        }
        let Some(cell) = self.cells.get(next) else {
            return false;
        };
        if !self.is_free(next) {
            return false;
        }
        let stage = match cell.stage.try_lock() {
            Ok(stage) => stage,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        self.context
            .device
            .event_done(&stage.copied)
            .unwrap_or(false)
    }

    /// Stage `j` holds nothing a fill put there any more (an upload
    /// wrote it).
    pub(crate) fn forget(&self, j: usize) {
        lock(&self.cells[j].meta).holds = None;
    }

    /// Whether fills run on a thread of their own (else a fill queued
    /// ahead is dropped).
    pub(crate) fn fills_ahead(&self) -> bool {
        self.worker.is_some()
    }

    /// Fills stage `j` with bytes `range` of `unit` (tagged `tag`; `last`:
    /// the unit's last part): queued for the filler thread, or run here
    /// when there is none and `now`. A fill queued ahead without a thread
    /// is dropped (the part is filled when needed).
    pub(crate) fn fill(
        &self,
        j: usize,
        Part {
            tag,
            unit,
            coded,
            range,
            last,
        }: Part<'_>,
        (skip_wait, release): (bool, bool),
        next: Option<&Unit>,
        now: bool,
    ) {
        if self.worker.is_none() && !now {
            return;
        }
        {
            // One fill of a stage at a time: a queued one finishes first
            // (else its end would mark the next one's bytes filled).
            let cell = &self.cells[j];
            let mut meta = lock(&cell.meta);
            while meta.pending {
                meta = wait(&cell.done, meta);
            }
            meta.holds = Some(tag);
            meta.spent = false;
            meta.pending = true;
            meta.error = None;
        }
        let job = Job {
            stage: j,
            tag,
            range,
            last,
            unit: unit.clone(),
            coded: coded.cloned(),
            skip_wait,
            release,
            next: next.cloned(),
        };
        if self.worker.is_some() {
            let (q, ready) = &*self.queue;
            lock(q).jobs.push_back(job);
            ready.notify_one();
        } else {
            run(&self.cells, &self.context, job);
        }
    }

    /// Waits for stage `j`'s fill, then lends the stage (locked) to `f`,
    /// which copies out of it and records its `copied`; once `f` succeeds
    /// the stage is spent (it may be refilled). Only the engine's thread
    /// queues fills, so none can start on `j` between the wait and the
    /// lend.
    pub(crate) fn with_filled<T>(
        &self,
        j: usize,
        f: impl FnOnce(&mut Stage<A>) -> Result<T, OffloadError>,
    ) -> Result<T, OffloadError> {
        let cell = &self.cells[j];
        {
            let mut meta = lock(&cell.meta);
            while meta.pending {
                meta = wait(&cell.done, meta);
            }
            if let Some(e) = meta.error.take() {
                meta.holds = None;
                return Err(OffloadError::DeviceOp {
                    operation: "the staging fill".to_owned(),
                    kind: crate::device::DeviceErrorKind::Other,
                    shortfall_bytes: None,
                    cause: e.into(),
                });
            }
        }
        let out = f(&mut lock(&cell.stage))?;
        lock(&cell.meta).spent = true;
        Ok(out)
    }

    /// Stops the filler thread (its queued fills run first) and gives the
    /// buffers and events back. `None` if a fill still holds a buffer (a
    /// panicked filler): then nothing is given back.
    pub(crate) fn into_stages(mut self) -> Option<Vec<(A::HostBuffer, A::Event)>> {
        self.stop();
        let cells =
            Arc::try_unwrap(std::mem::replace(&mut self.cells, Arc::new(Vec::new()))).ok()?;
        Some(
            cells
                .into_iter()
                .map(|c| {
                    let s = c.stage.into_inner().unwrap_or_else(|e| e.into_inner());
                    (s.buffer, s.copied)
                })
                .collect(),
        )
    }

    /// Stops the filler thread once its queued fills have run, and joins
    /// it (nothing if the ring has none). A ring being released stops it
    /// before its streams are drained, so a drain that fails (and leaks the
    /// ring's buffers, which the device may still read) leaves no thread
    /// parked behind it.
    pub(crate) fn stop(&mut self) {
        if let Some(worker) = self.worker.take() {
            let (q, ready) = &*self.queue;
            lock(q).stop = true;
            ready.notify_all();
            if worker.join().is_err() {
                tracing::error!("the staging fill thread panicked");
            }
        }
    }
}

impl<A: Api> Drop for StagingRing<A> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Staging fill threads running in this process.
static ALIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many staging fill threads are running in this process (every ring's
/// together): a released ring leaves none behind, its drain failed or not.
pub fn fill_threads_alive() -> usize {
    ALIVE.load(std::sync::atomic::Ordering::SeqCst)
}

fn wait<'a, T>(c: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    c.wait(g).unwrap_or_else(|e| e.into_inner())
}

/// The filler thread: runs queued fills in order until stopped.
fn work<A: Api>(cells: &[Cell<A>], context: &Context<A>, queue: &(Mutex<Queue>, Condvar)) {
    let (q, ready) = queue;
    loop {
        let job = {
            let mut g = lock(q);
            loop {
                if let Some(job) = g.jobs.pop_front() {
                    break job;
                }
                if g.stop {
                    return;
                }
                g = wait(ready, g);
            }
        };
        run(cells, context, job);
    }
}

/// One fill: wait for the copy that last read the buffer, copy the unit's
/// bytes in, mark it filled.
fn run<A: Api>(cells: &[Cell<A>], context: &Context<A>, job: Job) {
    let cell = &cells[job.stage];
    let mut stage = lock(&cell.stage);
    let waited = if job.skip_wait {
        Ok(())
    } else {
        context
            .device
            .synchronize_event(&stage.copied)
            .map_err(|e| dev_err("synchronize_event(host staging copied)", e).to_string())
    };
    if waited.is_ok() {
        lock(&cell.meta).filling = true;
    }
    // A panic inside the fill (a weight source's, a thread that could not
    // start) must not leave the stage pending for ever: it becomes the
    // fill's error, and waiters are woken below.
    let waited = waited.and_then(|()| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            fill_stage(&mut stage, context, &job)
        }))
        .map_err(|_| format!("the staging fill of `{}` panicked", job.unit.name))
    });
    if waited.is_ok() {
        context.device.host_filled(job.range.1);
    }
    // The buffer first: a waiter woken below may lend it at once.
    drop(stage);
    let mut meta = lock(&cell.meta);
    match waited {
        Ok(()) => {
            meta.holds = Some(job.tag);
        }
        Err(e) => {
            meta.holds = None;
            meta.error = Some(e);
        }
    }
    meta.pending = false;
    meta.filling = false;
    drop(meta);
    cell.done.notify_all();
}

/// The fill itself: the unit's bytes (or its coded bytes) into the stage's
/// buffer, then its pages released and the next unit read ahead where the
/// job asks.
fn fill_stage<A: Api>(stage: &mut Stage<A>, context: &Context<A>, job: &Job) {
    let (offset, len) = job.range;
    let (kind, reader) = match &job.coded {
        // Pages released after the read: read so that none is mapped in.
        Some(coded) if job.release => (
            "stage coded",
            Reader::CodedDirect {
                weights: &*context.weights,
                unit: &job.unit,
                coded: coded.bytes(),
            },
        ),
        Some(coded) => ("stage coded", Reader::Slice(coded.bytes())),
        None => (
            "stage",
            Reader::Unit(UnitBytes {
                weights: &*context.weights,
                unit: &job.unit,
                direct: job.release,
            }),
        ),
    };
    let _span = crate::runtime::shared::transfer_span(&job.unit.name, len, "host", kind).entered();
    let start = std::time::Instant::now();
    stage.buffer.write_from(
        0,
        len,
        &crate::runtime::read::Offset(
            &ParallelBytes {
                reader,
                threads: context.threads,
                pool: context.pool.as_ref(),
            },
            offset,
        ),
    );
    // The unit's pages dropped once its last part is read (a coded block's
    // window, or its bytes' pages), the next staged unit read ahead.
    if job.release && job.last {
        context.weights.release(&job.unit);
        if let Some(next) = &job.next {
            context.weights.prefetch(next);
        }
    }
    lock(&context.tally).record(len, start.elapsed().as_secs_f64());
}

/// The worker threads of a ring's fills: `threads` of them (none for one,
/// or under loom), named `offload-fill-N`; `None`, logged, where the OS
/// refuses them (each fill then starts its own threads, or reads on one).
fn fill_pool(threads: usize) -> Option<rayon::ThreadPool> {
    if threads <= 1 || cfg!(loom) {
        return None;
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("offload-fill-{i}"))
        .build()
        .inspect_err(|e| {
            tracing::debug!("the staging fill's {threads} worker threads were refused ({e}); each fill starts its own")
        })
        .ok()
}

#[cfg(test)]
#[cfg(not(loom))]
mod tests {
    use super::*;
    use crate::device::ByteSource;

    /// A fill split over the ring's worker pool reads exactly what one
    /// thread reads, at any offset and length (parts page-aligned, the
    /// last short), as does the fallback that starts threads per fill; a
    /// part that panics (here: one reading past its source) reaches the
    /// caller through either, as the filler's `catch_unwind` expects. Seen
    /// red (2026-12-02) with the pool's parts read from `i * per` of the
    /// source, without the fill's `position`.
    #[test]
    fn a_fill_over_the_pool_reads_what_one_thread_reads() {
        let pool = fill_pool(4).expect("4 worker threads start");
        let source: Vec<u8> = (0..40u64 << 20).map(|i| (i * 7 % 251) as u8).collect();
        for (position, len) in [
            (0usize, 20 << 20),
            (12_345, (9 << 20) + 17),
            (36 << 20, 4 << 20),
        ] {
            let want = &source[position..position + len];
            for pool in [Some(&pool), None] {
                let mut got = vec![0u8; len];
                ParallelBytes {
                    reader: Reader::Slice(&source),
                    threads: 4,
                    pool,
                }
                .read_at(position as u64, &mut got);
                assert!(
                    got == want,
                    "at {position}, {len} bytes, pool {}",
                    pool.is_some()
                );
            }
        }
        for pool in [Some(&pool), None] {
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut got = vec![0u8; 20 << 20];
                ParallelBytes {
                    reader: Reader::Slice(&source),
                    threads: 4,
                    pool,
                }
                .read_at(30 << 20, &mut got);
            }));
            assert!(caught.is_err(), "pool {}: the part's panic", pool.is_some());
        }
    }

    /// A part of a ring of parts as small as 4 MiB is split over the
    /// ring's workers, not read on one thread: each worker's piece is
    /// slow here (a sleep), so the pieces overlap and the threads that
    /// read them are seen, by name. Seen red (2026-12-07) with pooled
    /// reads split only from 4 MiB a thread, as reads over threads started
    /// per read are: one thread read the whole part, and a 32 MiB ring's
    /// 4 MiB parts filled at 9 GB/s on an H100's host; and, found by
    /// review, with the pool ignored (threads started for the read).
    #[test]
    fn a_small_part_is_filled_over_the_pool() {
        struct Threads(Mutex<std::collections::BTreeSet<String>>);
        impl ByteSource for Threads {
            fn read_at(&self, _: u64, dst: &mut [u8]) {
                std::thread::sleep(std::time::Duration::from_millis(20));
                dst.fill(1);
                let me = std::thread::current();
                lock(&self.0).insert(format!("{:?} {}", me.id(), me.name().unwrap_or("")));
            }
        }
        struct Via<'a>(&'a Threads);
        impl crate::runtime::backend::WeightSource for Via<'_> {
            fn read(&self, _: crate::model::StorageId, position: u64, dst: &mut [u8]) {
                self.0.read_at(position, dst);
            }
        }
        let pool = fill_pool(4).expect("4 worker threads start");
        let threads = Threads(Mutex::new(Default::default()));
        let via = Via(&threads);
        let unit = Unit {
            name: "part".to_owned(),
            module: crate::model::ModuleId(0),
            entries: vec![crate::runtime::layout::Entry {
                storage: crate::model::StorageId(0),
                offset: 0,
                bytes: 4 << 20,
            }],
            bytes: 4 << 20,
        };
        let mut got = vec![0u8; 4 << 20];
        ParallelBytes {
            reader: Reader::Unit(UnitBytes {
                weights: &via,
                unit: &unit,
                direct: false,
            }),
            threads: 4,
            pool: Some(&pool),
        }
        .read_at(0, &mut got);
        assert!(got.iter().all(|&b| b == 1));
        let seen = lock(&threads.0).clone();
        assert!(
            seen.len() >= 2 && seen.iter().all(|t| t.contains("offload-fill-")),
            "a 4 MiB part read on {seen:?}, not on two or more of the pool's four workers"
        );
    }

    /// A ring's fill rate is its last pass's: fills from a cold disk then
    /// a pass from the page cache rate at the page cache's, the window
    /// keeping at least the newest fill and, without one, every fill.
    /// Seen red (2026-12-07) with the window never trimmed (the rate
    /// averaged over every fill, as before): 1.95 GB/s where the last
    /// pass ran 40; and, found by review, with fills listed where no
    /// window is set (a list growing for the whole enable).
    #[test]
    fn the_fill_rate_is_the_last_pass_s() {
        const GB: u64 = 1_000_000_000;
        let mut log = FillLog::default();
        log.set_window(4 * GB);
        // A first pass of 4 GB at 1 GB/s (the disk), then one at 40.
        for _ in 0..4 {
            log.record(GB, 1.0);
        }
        for _ in 0..4 {
            log.record(GB, 0.025);
        }
        let rate = log.tally().bytes_per_s().expect("filled");
        assert!((rate - 40e9).abs() < 1e3, "{rate}");
        assert_eq!(log.tally().fills, 4);
        // A window smaller than one fill keeps the newest fill.
        log.set_window(1);
        assert_eq!(log.tally().fills, 1);
        assert!((log.tally().bytes_per_s().unwrap() - 40e9).abs() < 1e3);
        // No window: the sums of every fill from now on, no fill listed.
        log.set_window(0);
        for _ in 0..1000 {
            log.record(GB, 1.0);
        }
        assert_eq!(log.tally().fills, 1001);
        assert!((log.tally().bytes_per_s().unwrap() - 1001e9 / 1000.025).abs() < 1e3);
        assert!(log.recent.is_empty(), "{} fills listed", log.recent.len());
    }
}
