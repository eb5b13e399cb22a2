//! [`NcclCollective`]: the [`Collective`] of `offload-core` over NCCL, with
//! a watchdog that aborts a communicator whose collective does not
//! complete in time.

pub(crate) mod ffi;

use std::ffi::c_int;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{result as cu, sys as cusys};
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclUniqueId};
use offload_core::device::{Collective, DeviceBuffer};
use offload_cuda::{Cuda, CudaBuffer, CudaContext, CudaDevice, CudaError, CudaStream};

use crate::{Abort, AbortCause, Aborted, DistError, PeerFailure, PendingCollective, SideChannel};
use ffi::{IN_PROGRESS, INVALID_ARGUMENT, INVALID_USAGE, Nccl, SUCCESS};

/// How often the watchdog polls while collectives are queued.
const BUSY_POLL: Duration = Duration::from_millis(2);
/// How often it polls for NCCL async errors otherwise.
const IDLE_POLL: Duration = Duration::from_millis(100);

/// Whether an NCCL library (2.14 or newer) can be loaded here. Never
/// panics; loads the library on the first call.
pub fn nccl_present() -> bool {
    ffi::nccl().is_ok()
}

/// The loaded NCCL library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclInfo {
    /// `(major, minor, patch)`.
    pub version: (u32, u32, u32),
    /// The name or path it was loaded from.
    pub library: String,
}

/// The NCCL library, loading it on the first call;
/// [`DistError::NcclUnavailable`] says what was tried where it is absent.
pub fn nccl_info() -> Result<NcclInfo, DistError> {
    let nccl = loaded()?;
    Ok(NcclInfo {
        version: nccl.version(),
        library: nccl.source.clone(),
    })
}

fn loaded() -> Result<&'static Nccl, DistError> {
    ffi::nccl().map_err(|reason| DistError::NcclUnavailable { reason })
}

/// An NCCL unique id: 128 opaque bytes that rank 0 makes and every rank
/// passes to [`NcclCollective::init`].
#[derive(Clone, PartialEq, Eq)]
pub struct NcclId(pub [u8; NcclId::LEN]);

impl NcclId {
    /// Its length in bytes.
    pub const LEN: usize = 128;

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// An id from exactly [`Self::LEN`] bytes (what the rendezvous hands
    /// out).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DistError> {
        let array = <[u8; Self::LEN]>::try_from(bytes).map_err(|_| DistError::BadNcclId {
            expected: Self::LEN,
            got: bytes.len(),
        })?;
        Ok(Self(array))
    }

    fn to_raw(&self) -> ncclUniqueId {
        ncclUniqueId {
            internal: self.0.map(|b| b as _),
        }
    }
}

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NcclId(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

/// A communicator handle; valid while it sits in `Shared::comm`.
#[derive(Clone, Copy)]
struct Comm(ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one call at a
// time (every use holds `Shared::comm`), and `ncclCommGetAsyncError` /
// `ncclCommAbort` from another thread by design.
unsafe impl Send for Comm {}

/// A CUDA event of this collective's pool.
struct Event(cusys::CUevent);

// SAFETY: a CUevent is a driver handle usable from any thread.
unsafe impl Send for Event {}

/// A collective that was pending, and the timeout it was given.
type Culprit = (PendingCollective, Duration);

struct Pending {
    number: u64,
    shard_bytes: u64,
    timeout: Duration,
    event: Event,
    deadline: Instant,
}

impl Pending {
    fn describe(&self) -> Culprit {
        let collective = PendingCollective {
            number: self.number,
            shard_bytes: self.shard_bytes,
        };
        (collective, self.timeout)
    }
}

struct State {
    timeout: Duration,
    issued: u64,
    pending: Vec<Pending>,
    spare: Vec<Event>,
    aborted: Option<Aborted>,
    stop: bool,
}

impl State {
    fn oldest(&self) -> Option<Culprit> {
        self.pending
            .iter()
            .min_by_key(|p| p.number)
            .map(Pending::describe)
    }
}

struct Shared {
    nccl: &'static Nccl,
    ctx: Arc<CudaContext>,
    rank: u32,
    size: u32,
    /// `None` once aborted or destroyed.
    comm: Mutex<Option<Comm>>,
    state: Mutex<State>,
    /// Signalled when the queue shrinks, the communicator is aborted, or
    /// the watchdog should stop.
    changed: Condvar,
    /// Set (with `interrupt_cause`) by an abort from another thread, so
    /// that an enqueue polling in `settle` lets go of the handle at once.
    interrupted: AtomicBool,
    interrupt_cause: Mutex<Option<AbortCause>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How an NCCL call that may answer `ncclInProgress` ended.
enum Settle {
    Failed(u32),
    TimedOut,
    /// `stop` said so (an abort from another thread, a peer's failure).
    Interrupted,
}

/// Polls `comm` until the call that returned `rc` settles, `deadline`
/// passes, or `stop` returns true (asked between polls).
fn settle(
    nccl: &Nccl,
    comm: ncclComm_t,
    mut rc: u32,
    deadline: Instant,
    stop: &dyn Fn() -> bool,
) -> Result<(), Settle> {
    let mut polls = 0u32;
    loop {
        match rc {
            SUCCESS => return Ok(()),
            IN_PROGRESS => {}
            e => return Err(Settle::Failed(e)),
        }
        if Instant::now() >= deadline {
            return Err(Settle::TimedOut);
        }
        if stop() {
            return Err(Settle::Interrupted);
        }
        if polls < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
        polls += 1;
        let mut state = IN_PROGRESS;
        // SAFETY: `comm` is live (the caller holds it out of reach of
        // any abort); writes one ncclResult_t.
        let q = unsafe { (nccl.comm_get_async_error)(comm, &mut state) };
        rc = if q == SUCCESS { state } else { q };
    }
}

impl Shared {
    /// Aborts from any thread, even while another is inside `all_gather`:
    /// raises the interrupt first, so an enqueue polling in `settle`
    /// releases the handle's mutex within one poll, then aborts.
    fn abort_from_anywhere(&self, cause: AbortCause) {
        lock(&self.interrupt_cause).get_or_insert_with(|| cause.clone());
        self.interrupted.store(true, Ordering::Release);
        let oldest = lock(&self.state).oldest();
        self.abort(oldest, cause);
    }

    fn interrupted(&self) -> bool {
        self.interrupted.load(Ordering::Acquire)
    }

    /// Aborts the communicator (once), recording why.
    fn abort(&self, culprit: Option<Culprit>, cause: AbortCause) {
        let taken = self.mark_aborted(&mut lock(&self.comm), culprit, cause);
        if let Some(comm) = taken {
            self.run_abort(comm);
        }
    }

    /// Takes the handle out of `slot` (so no later call can use it) and
    /// records why, waking every waiter; the caller then releases the
    /// mutex and calls [`Self::run_abort`] with what it got. Recording
    /// first means callers learn of the abort at once, even where
    /// `ncclCommAbort` itself takes a while (some NCCL versions wait for
    /// the other ranks of the host).
    fn mark_aborted(
        &self,
        slot: &mut Option<Comm>,
        culprit: Option<Culprit>,
        cause: AbortCause,
    ) -> Option<Comm> {
        let comm = slot.take()?;
        let mut st = lock(&self.state);
        if st.aborted.is_none() {
            st.aborted = Some(Aborted {
                rank: self.rank,
                ranks: self.size,
                collective: culprit.map(|c| c.0),
                timeout: culprit.map_or(st.timeout, |c| c.1),
                cause,
            });
        }
        // Nobody waits for these any more; their events are destroyed on
        // drop (destroying a pending event is legal).
        let events: Vec<Event> = st.pending.drain(..).map(|p| p.event).collect();
        st.spare.extend(events);
        if let Some(a) = &st.aborted {
            tracing::error!("{a}");
        }
        drop(st);
        self.changed.notify_all();
        Some(comm)
    }

    /// `ncclCommAbort` on a handle taken by [`Self::mark_aborted`].
    fn run_abort(&self, comm: Comm) {
        let _ = self.ctx.bind();
        // SAFETY: the handle was live and is out of the mutex, so no other
        // call can use it; abort frees it.
        let rc = unsafe { (self.nccl.comm_abort)(comm.0) };
        if rc != SUCCESS {
            tracing::error!("ncclCommAbort: {}", self.nccl.describe(rc));
        }
    }

    /// NCCL's asynchronous error, if any (skipped while the communicator
    /// is busy issuing, or gone).
    fn async_error(&self) -> Option<u32> {
        let slot = match self.comm.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        let comm = (*slot)?;
        let mut state = SUCCESS;
        // SAFETY: the handle is live while we hold the mutex; writes one
        // ncclResult_t.
        let rc = unsafe { (self.nccl.comm_get_async_error)(comm.0, &mut state) };
        let code = if rc == SUCCESS { state } else { rc };
        (code != SUCCESS && code != IN_PROGRESS).then_some(code)
    }

    fn refused(&self, what: &str) -> CudaError {
        let st = lock(&self.state);
        match &st.aborted {
            Some(a) => CudaError::transfer_failed(format!("{what} refused: {a}")),
            None => CudaError::transfer_failed(format!(
                "{what} refused: the NCCL communicator is closed"
            )),
        }
    }
}

/// The watchdog thread's loop (see the module docs).
fn watchdog(shared: Arc<Shared>) {
    if let Err(e) = shared.ctx.bind() {
        tracing::error!("NCCL watchdog: {e}");
    }
    let mut last_async_poll = Instant::now();
    let mut st = lock(&shared.state);
    loop {
        if st.stop {
            return;
        }
        if st.aborted.is_some() {
            st = shared
                .changed
                .wait_timeout(st, IDLE_POLL)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            continue;
        }
        let mut failure: Option<(Option<Culprit>, AbortCause)> = None;
        let mut finished = false;
        let mut i = 0;
        while i < st.pending.len() {
            // SAFETY: the event is live (owned by the queue), its context
            // is retained by `shared.ctx`.
            match unsafe { cu::event::query(st.pending[i].event.0) } {
                Ok(()) => {
                    let done = st.pending.remove(i);
                    st.spare.push(done.event);
                    finished = true;
                }
                Err(e) if e.0 == cusys::cudaError_enum::CUDA_ERROR_NOT_READY => i += 1,
                Err(e) => {
                    let p = st.pending[i].describe();
                    failure = Some((
                        Some(p),
                        AbortCause::EventFailed(format!("cuEventQuery: {:?}", e.0)),
                    ));
                    break;
                }
            }
        }
        if finished {
            shared.changed.notify_all();
        }
        let now = Instant::now();
        if failure.is_none() {
            let late = st
                .pending
                .iter()
                .filter(|p| now >= p.deadline)
                .min_by_key(|p| p.number);
            if let Some(p) = late {
                failure = Some((Some(p.describe()), AbortCause::TimedOut));
            }
        }
        let poll_async =
            failure.is_none() && (!st.pending.is_empty() || last_async_poll.elapsed() >= IDLE_POLL);
        let oldest = st.oldest();
        drop(st);
        if poll_async {
            last_async_poll = Instant::now();
            if let Some(code) = shared.async_error() {
                failure = Some((oldest, AbortCause::NcclError(shared.nccl.describe(code))));
            }
        }
        if let Some((collective, cause)) = failure {
            shared.abort(collective, cause);
        }
        st = lock(&shared.state);
        if st.stop {
            return;
        }
        let wait = if st.pending.is_empty() {
            IDLE_POLL
        } else {
            BUSY_POLL
        };
        st = shared
            .changed
            .wait_timeout(st, wait)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

/// One rank's NCCL communicator, enqueuing all-gathers on the caller's
/// stream (`ncclUint8`, count = the shard's bytes), watched by a thread
/// that aborts it when a collective does not complete within the timeout.
///
/// # Threading
///
/// * The communicator is **non-blocking** (`ncclConfig_t::blocking = 0`):
///   no NCCL call blocks the host; a call that answers `ncclInProgress` is
///   polled (`ncclCommGetAsyncError`) by the calling thread until it
///   settles or its deadline passes, and then the communicator is aborted.
///   So init, a first collective that connects to its peers, and the final
///   `ncclCommFinalize` all have deadlines. (`NCCL_COMM_BLOCKING=1`
///   overrides this in NCCL itself, and the host waits lose their bounds.)
/// * Every use of the communicator handle holds one mutex: `all_gather`
///   for the whole enqueue (NCCL forbids concurrent calls on one
///   communicator), the watchdog for each async-error poll (it skips the
///   poll when the mutex is busy) and to take the handle out for an
///   abort. An abort is recorded (and every waiter woken) before
///   `ncclCommAbort` runs, outside the mutex: callers learn of it at once
///   even where `ncclCommAbort` takes a while (some NCCL versions wait for
///   the host's other ranks), and since `ncclCommAbort` frees the
///   communicator and the handle is out of the mutex by then, no call ever
///   sees a freed handle.
/// * After each all-gather, a CUDA event is recorded on the caller's
///   stream and queued with a deadline (`now + timeout`). The watchdog
///   thread polls the queue (every 2 ms while it is not empty, every
///   100 ms otherwise): finished events go back to a pool; the oldest
///   entry past its deadline, a failed event query, or an NCCL async error
///   aborts the communicator. From then on every `all_gather` fails with
///   [`Aborted`], which names the collective, its size and the timeout.
/// * A collective's deadline counts from its enqueue, so it includes
///   whatever its stream waits for before it: choose the timeout for the
///   longest wait plus the transfer.
/// * Drop waits for the queued collectives (bounded by their deadlines),
///   stops and joins the watchdog (leaving it, with a logged error, if it
///   is still inside `ncclCommAbort` after the timeout, at least 10 s),
///   then finalizes and destroys the communicator (aborting it if
///   finalize fails or times out), or does nothing more if it was
///   aborted; then it destroys the events.
pub struct NcclCollective {
    shared: Arc<Shared>,
    watchdog: Option<JoinHandle<()>>,
}

impl fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.shared.rank)
            .field("size", &self.shared.size)
            .field("aborted", &self.aborted().is_some())
            .finish()
    }
}

impl NcclCollective {
    /// A fresh unique id, made on rank 0 and handed to the others (it also
    /// starts NCCL's bootstrap listener in this process).
    pub fn unique_id() -> Result<NcclId, DistError> {
        let nccl = loaded()?;
        let mut raw = ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes one ncclUniqueId.
        let rc = unsafe { (nccl.get_unique_id)(&mut raw) };
        if rc != SUCCESS {
            return Err(DistError::Nccl {
                operation: "ncclGetUniqueId".to_owned(),
                result: rc,
                message: nccl.describe(rc),
            });
        }
        Ok(NcclId(raw.internal.map(|b| b as u8)))
    }

    /// Joins the communicator `id` as `rank` of `world_size` on `device`
    /// (`ncclCommInitRankConfig`, non-blocking, with the device's context
    /// current). Every rank must call it with the same id and world size;
    /// it waits for all of them, at most `timeout`, and then aborts the
    /// half-made communicator ([`DistError::InitTimedOut`]). `timeout` is
    /// also each collective's deadline (see [`Self::set_timeout`]).
    pub fn init(
        device: &CudaDevice,
        id: &NcclId,
        rank: u32,
        world_size: u32,
        timeout: Duration,
    ) -> Result<Self, DistError> {
        Self::init_inner(device, id, rank, world_size, timeout, &|| None)
    }

    /// [`Self::init`], watched by the group's side channel: a peer that
    /// fails while the communicator forms ends the wait at once (the
    /// half-made communicator aborted, [`DistError::PeerFailed`]); and
    /// once formed, the communicator is aborted when a peer fails
    /// ([`Self::abort_handle`] registered with
    /// [`SideChannel::on_failure`]).
    pub fn init_watched(
        device: &CudaDevice,
        id: &NcclId,
        rank: u32,
        world_size: u32,
        timeout: Duration,
        channel: &SideChannel,
    ) -> Result<Self, DistError> {
        let comm = Self::init_inner(device, id, rank, world_size, timeout, &|| {
            channel.check().err()
        })?;
        channel.on_failure(Arc::new(comm.abort_handle()));
        Ok(comm)
    }

    fn init_inner(
        device: &CudaDevice,
        id: &NcclId,
        rank: u32,
        world_size: u32,
        timeout: Duration,
        stop: &dyn Fn() -> Option<DistError>,
    ) -> Result<Self, DistError> {
        if world_size == 0 || world_size > c_int::MAX as u32 {
            return Err(DistError::Usage {
                what: format!("an NCCL group of {world_size} ranks"),
                allowed: format!("1 to {} ranks", c_int::MAX),
            });
        }
        if rank >= world_size {
            return Err(DistError::RankOutOfRange { rank, world_size });
        }
        let nccl = loaded()?;
        device.bind()?;
        let deadline = Instant::now() + timeout;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let mut config = ffi::ConfigV214::nonblocking();
        let operation = format!("ncclCommInitRankConfig(rank {rank} of {world_size})");
        // SAFETY: `comm` and `config` are valid for the call (the config
        // is copied by NCCL before it returns); the id is passed by value;
        // the device's context is current on this thread.
        let rc = unsafe {
            (nccl.comm_init_rank_config)(
                &mut comm,
                world_size as c_int,
                id.to_raw(),
                rank as c_int,
                &mut config,
            )
        };
        let failed = |result: u32| DistError::Nccl {
            operation: operation.clone(),
            result,
            message: nccl.describe(result),
        };
        if comm.is_null() {
            return Err(failed(if rc == SUCCESS {
                ffi::INVALID_USAGE
            } else {
                rc
            }));
        }
        let abort = |comm: ncclComm_t| {
            // SAFETY: the half-made communicator is ours alone; abort
            // frees it.
            let _ = unsafe { (nccl.comm_abort)(comm) };
        };
        let stopped = std::cell::RefCell::new(None);
        let ask = || {
            let e = stop();
            let some = e.is_some();
            if some {
                *stopped.borrow_mut() = e;
            }
            some
        };
        match settle(nccl, comm, rc, deadline, &ask) {
            Ok(()) => {}
            Err(Settle::Interrupted) => {
                abort(comm);
                return Err(stopped.take().unwrap_or(DistError::InitTimedOut {
                    rank,
                    world_size,
                    timeout,
                }));
            }
            Err(Settle::TimedOut) => {
                abort(comm);
                return Err(DistError::InitTimedOut {
                    rank,
                    world_size,
                    timeout,
                });
            }
            Err(Settle::Failed(code)) => {
                let e = failed(code);
                abort(comm);
                return Err(e);
            }
        }
        let (mut count, mut user_rank): (c_int, c_int) = (-1, -1);
        // SAFETY: the communicator is initialised; each call writes one int.
        let (rc1, rc2) = unsafe {
            (
                (nccl.comm_count)(comm, &mut count),
                (nccl.comm_user_rank)(comm, &mut user_rank),
            )
        };
        if rc1 != SUCCESS || rc2 != SUCCESS {
            let e = failed(if rc1 != SUCCESS { rc1 } else { rc2 });
            abort(comm);
            return Err(e);
        }
        if count != world_size as c_int || user_rank != rank as c_int {
            abort(comm);
            return Err(DistError::Nccl {
                operation,
                result: SUCCESS,
                message: format!(
                    "the communicator reports rank {user_rank} of {count}, not rank {rank} of {world_size}"
                ),
            });
        }
        let shared = Arc::new(Shared {
            nccl,
            ctx: Arc::clone(device.context()),
            rank: user_rank as u32,
            size: count as u32,
            comm: Mutex::new(Some(Comm(comm))),
            state: Mutex::new(State {
                timeout,
                issued: 0,
                pending: Vec::new(),
                spare: Vec::new(),
                aborted: None,
                stop: false,
            }),
            changed: Condvar::new(),
            interrupted: AtomicBool::new(false),
            interrupt_cause: Mutex::new(None),
        });
        let for_thread = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name(format!("nccl-watchdog-{rank}"))
            .spawn(move || watchdog(for_thread));
        match spawned {
            Ok(handle) => Ok(Self {
                shared,
                watchdog: Some(handle),
            }),
            Err(source) => {
                shared.abort(None, AbortCause::ByCaller);
                Err(DistError::Io {
                    what: "starting the NCCL watchdog thread".to_owned(),
                    source,
                })
            }
        }
    }

    /// The deadline given to each later collective.
    pub fn timeout(&self) -> Duration {
        lock(&self.shared.state).timeout
    }

    /// Sets the deadline for later collectives (those already queued keep
    /// theirs).
    pub fn set_timeout(&self, timeout: Duration) {
        lock(&self.shared.state).timeout = timeout;
    }

    /// How many collectives this communicator has issued (the last one's
    /// number).
    pub fn issued(&self) -> u64 {
        lock(&self.shared.state).issued
    }

    /// Why the communicator was aborted, if it was.
    pub fn aborted(&self) -> Option<Aborted> {
        lock(&self.shared.state).aborted.clone()
    }

    /// Blocks until every queued collective has completed (`Ok`), or the
    /// communicator is aborted (the watchdog enforces the deadlines, so
    /// this returns within the longest of them plus a poll).
    pub fn wait_idle(&self) -> Result<(), DistError> {
        let mut st = lock(&self.shared.state);
        loop {
            if let Some(a) = &st.aborted {
                return Err(DistError::Aborted(a.clone()));
            }
            if st.pending.is_empty() {
                return Ok(());
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, IDLE_POLL)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Aborts the communicator now (`ncclCommAbort`: queued collectives
    /// are not waited for; some NCCL versions wait for the host's other
    /// ranks to abort too). Later collectives fail; idempotent.
    pub fn abort(&self) {
        self.shared.abort_from_anywhere(AbortCause::ByCaller);
    }

    /// A handle that aborts this communicator from any thread, even while
    /// another thread is inside [`Collective::all_gather`] (its enqueue
    /// lets go within one poll) or waits for a collective on the device
    /// (`ncclCommAbort` releases the kernels waiting for peers): the
    /// [`Abort`] hook of the group's [`SideChannel`]. Every later call
    /// fails with [`Aborted`], its cause [`AbortCause::PeerFailed`]
    /// naming the rank that failed and its error.
    pub fn abort_handle(&self) -> NcclAbortHandle {
        NcclAbortHandle {
            shared: Arc::clone(&self.shared),
        }
    }
}

/// Aborts an [`NcclCollective`] from any thread
/// ([`NcclCollective::abort_handle`]); idempotent, and a no-op once the
/// communicator is gone.
#[derive(Clone)]
pub struct NcclAbortHandle {
    shared: Arc<Shared>,
}

impl fmt::Debug for NcclAbortHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclAbortHandle")
            .field("rank", &self.shared.rank)
            .finish()
    }
}

impl Abort for NcclAbortHandle {
    fn abort(&self, failure: &PeerFailure) {
        self.shared
            .abort_from_anywhere(AbortCause::PeerFailed(failure.clone()));
    }
}

impl Collective<Cuda> for NcclCollective {
    fn rank(&self) -> u32 {
        self.shared.rank
    }

    fn size(&self) -> u32 {
        self.shared.size
    }

    unsafe fn all_gather(
        &self,
        stream: &CudaStream,
        shard: &CudaBuffer,
        shard_offset: u64,
        shard_bytes: u64,
        dst: &CudaBuffer,
        dst_offset: u64,
    ) -> Result<(), CudaError> {
        let shared = &*self.shared;
        // One debug span per collective (a runtime's subscriber sees it
        // inside the strategy's `offload.transfer` span naming the block).
        let _span = tracing::debug_span!(
            "offload.collective",
            op = "all-gather",
            bytes = shard_bytes.saturating_mul(u64::from(shared.size)),
            shard_bytes,
            rank = shared.rank,
            ranks = shared.size,
            stream = ?stream.raw(),
        )
        .entered();
        let what = || {
            format!(
                "ncclAllGather({shard_bytes} bytes from each of {} ranks)",
                shared.size
            )
        };
        let total = shard_bytes.checked_mul(u64::from(shared.size));
        let in_bounds = |offset: u64, bytes: Option<u64>, len: u64| {
            bytes
                .and_then(|b| offset.checked_add(b))
                .is_some_and(|end| end <= len)
        };
        if !in_bounds(shard_offset, Some(shard_bytes), shard.len_bytes())
            || !in_bounds(dst_offset, total, dst.len_bytes())
        {
            return Err(CudaError::new(
                format!(
                    "{}: shard {shard_offset}+{shard_bytes} of a {}-byte buffer, destination {dst_offset}+{} of a {}-byte buffer; both ranges must lie within their buffers",
                    what(),
                    shard.len_bytes(),
                    total.map_or_else(|| "overflow".to_owned(), |t| t.to_string()),
                    dst.len_bytes()
                ),
                cusys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
            ));
        }
        let mut slot = lock(&shared.comm);
        let Some(comm) = *slot else {
            return Err(shared.refused(&what()));
        };
        if shard_bytes == 0 {
            return Ok(());
        }
        shared.ctx.bind()?;
        let (number, timeout) = {
            let mut st = lock(&shared.state);
            st.issued += 1;
            (st.issued, st.timeout)
        };
        let this = (
            PendingCollective {
                number,
                shard_bytes,
            },
            timeout,
        );
        let deadline = Instant::now() + timeout;
        // SAFETY: both ranges lie within their buffers (checked above); the
        // caller guarantees the buffers stay valid and untouched until an
        // event recorded after this call completes; the communicator is
        // live (we hold its mutex); the stream is the caller's, of the
        // device this communicator was made on.
        let rc = unsafe {
            (shared.nccl.all_gather)(
                (shard.ptr() + shard_offset) as *const std::ffi::c_void,
                (dst.ptr() + dst_offset) as *mut std::ffi::c_void,
                shard_bytes as usize,
                ncclDataType_t::ncclUint8,
                comm.0,
                stream.raw().cast(),
            )
        };
        match settle(shared.nccl, comm.0, rc, deadline, &|| shared.interrupted()) {
            Ok(()) => {}
            Err(Settle::Failed(code)) if code == INVALID_ARGUMENT || code == INVALID_USAGE => {
                // Checked by NCCL before anything was enqueued: the
                // communicator is still good.
                return Err(CudaError::transfer_failed(format!(
                    "{} (collective #{number}): {}",
                    what(),
                    shared.nccl.describe(code)
                )));
            }
            Err(failure) => {
                let cause = match failure {
                    Settle::Failed(code) => AbortCause::NcclError(shared.nccl.describe(code)),
                    Settle::TimedOut => AbortCause::TimedOut,
                    Settle::Interrupted => lock(&shared.interrupt_cause)
                        .clone()
                        .unwrap_or(AbortCause::ByCaller),
                };
                let taken = shared.mark_aborted(&mut slot, Some(this), cause);
                drop(slot);
                if let Some(comm) = taken {
                    shared.run_abort(comm);
                }
                return Err(shared.refused(&what()));
            }
        }
        let spare = lock(&shared.state).spare.pop();
        let event = match spare {
            Some(e) => e,
            None => Event(
                cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| CudaError::new("cuEventCreate (NCCL watchdog)", e.0))?,
            ),
        };
        // SAFETY: both handles are live; the context is current.
        if let Err(e) = unsafe { cu::event::record(event.0, stream.raw()) } {
            lock(&shared.state).spare.push(event);
            return Err(CudaError::new(
                format!("cuEventRecord after {} (collective #{number})", what()),
                e.0,
            ));
        }
        lock(&shared.state).pending.push(Pending {
            number,
            shard_bytes,
            timeout,
            event,
            deadline,
        });
        drop(slot);
        shared.changed.notify_all();
        Ok(())
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        // Bounded: the watchdog aborts whatever passes its deadline.
        let _ = self.wait_idle();
        lock(&self.shared.state).stop = true;
        self.shared.changed.notify_all();
        if let Some(handle) = self.watchdog.take() {
            // The watchdog may be inside ncclCommAbort, which some NCCL
            // versions make wait for the host's other ranks: wait for it a
            // while, then leave it (and what it holds) rather than hang.
            let give_up = Instant::now() + self.timeout().max(Duration::from_secs(10));
            while !handle.is_finished() && Instant::now() < give_up {
                std::thread::sleep(Duration::from_millis(5));
            }
            if !handle.is_finished() {
                tracing::error!(
                    "NCCL rank {}: the watchdog is still inside ncclCommAbort; leaving it and the communicator's events",
                    self.shared.rank
                );
                return;
            }
            let _ = handle.join();
        }
        let shared = &*self.shared;
        let _ = shared.ctx.bind();
        let taken = lock(&shared.comm).take();
        if let Some(comm) = taken {
            let deadline = Instant::now() + lock(&shared.state).timeout;
            // SAFETY: the communicator is live and ours alone (the
            // watchdog is joined, `self` is going away).
            let rc = unsafe { (shared.nccl.comm_finalize)(comm.0) };
            match settle(shared.nccl, comm.0, rc, deadline, &|| shared.interrupted()) {
                Ok(()) => {
                    // SAFETY: finalized; destroy frees it.
                    let rc = unsafe { (shared.nccl.comm_destroy)(comm.0) };
                    if rc != SUCCESS {
                        tracing::error!("ncclCommDestroy: {}", shared.nccl.describe(rc));
                    }
                }
                Err(e) => {
                    let why = match e {
                        Settle::Failed(code) => shared.nccl.describe(code),
                        Settle::TimedOut => "timed out".to_owned(),
                        Settle::Interrupted => "interrupted by an abort".to_owned(),
                    };
                    tracing::error!("ncclCommFinalize: {why}; aborting the communicator");
                    // SAFETY: still live and ours; abort frees it.
                    let _ = unsafe { (shared.nccl.comm_abort)(comm.0) };
                }
            }
        }
        let mut st = lock(&shared.state);
        let pending: Vec<Event> = st.pending.drain(..).map(|p| p.event).collect();
        for event in st.spare.drain(..).chain(pending) {
            // SAFETY: the event is ours; the driver defers destroying one
            // still pending.
            let _ = unsafe { cu::event::destroy(event.0) };
        }
    }
}
