//! The device trait family, in the wgpu-hal manner: [`Api`] holds only
//! associated types; behaviour lives on [`Device`] (memory, streams,
//! events, copies), [`Collective`] (weight gathering across ranks) and
//! [`Codec`] (a lossless block code the device decodes, CONTRACT §7b).
//!
//! Backends translate and report only what the caller could not foresee
//! ([`DeviceErrorKind::OutOfMemory`], [`DeviceErrorKind::DeviceLost`], a
//! failed transfer). Everything a caller can check (sizes, ranges, the order
//! of operations) is core's job: the `unsafe` methods below state what the
//! caller must have checked, and core's safe types (slots and staging
//! buffers that own the events ordering them) uphold it.
//!
//! # Life cycles
//!
//! * **Stream**: created by [`Device::create_stream`]; operations enqueued
//!   on it run in order; dropping it is legal at any time (work already
//!   enqueued still completes).
//! * **Event**: created unrecorded by [`Device::create_event`]; each
//!   [`Device::record_event`] captures the work enqueued on a stream so far,
//!   replacing the previous capture. Waiting on or querying an event that was
//!   never recorded is legal and completes at once. Dropping is legal at any
//!   time.
//! * **Device buffer**: exactly `bytes` long from [`Device::alloc_device`];
//!   valid until [`Device::free_device`], which is ordered after the given
//!   events on the device (the host does not wait). Contents are undefined
//!   until written.
//! * **Pinned host buffer**: exactly `bytes` long from
//!   [`Device::alloc_pinned`]; the host may read and write it while no copy
//!   that uses it is pending; freed by [`Device::free_pinned`].
//! * **Registration**: [`Device::register_host`] takes ownership of memory
//!   the caller already filled (a `Vec`, a memory-mapped checkpoint) and
//!   makes it a copy source in place, without a second copy;
//!   [`Device::unregister_host`] gives the memory back. A failed
//!   registration gives it back too, so nothing loaded is lost.

use std::error::Error as StdError;
use std::fmt;

/// The associated types of one backend. No behaviour lives here.
pub trait Api: Sized + Send + Sync + 'static {
    /// The device: memory, streams, events and copies.
    type Device: Device<Self>;
    /// An in-order queue of device work.
    type Stream: fmt::Debug + Send + Sync;
    /// A marker in a stream that other streams and the host can wait for.
    type Event: fmt::Debug + Send + Sync;
    /// Device memory of an exact size.
    type DeviceBuffer: DeviceBuffer;
    /// Pinned host memory of an exact size.
    type HostBuffer: HostBuffer;
    /// Caller memory registered in place as a copy source.
    type Registration: Registration;
    /// What the backend reports.
    type Error: DeviceError;
}

/// Kinds of error a backend may report: only what the caller could not
/// foresee.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceErrorKind {
    /// Device or pinned memory is exhausted.
    OutOfMemory,
    /// The device is gone (Xid, reset, lost context).
    DeviceLost,
    /// A transfer or collective failed.
    TransferFailed,
    /// Anything else the driver reported.
    Other,
}

/// How long [`Device::host_pause`] pauses the host, µs: a poll's period,
/// short beside a block's kernels (milliseconds) and a staging part's
/// fill (about 1.5 ms for 64 MiB).
pub const HOST_PAUSE_US: u64 = 20;

/// A backend error: it names the operation and says which kind it is.
pub trait DeviceError: StdError + Send + Sync + 'static {
    /// The kind.
    fn kind(&self) -> DeviceErrorKind;

    /// For `OutOfMemory`: how many more bytes the failed allocation needed
    /// than were free, when the backend knows (a re-plan grows the failing
    /// phase by it). Default `None`.
    fn shortfall_bytes(&self) -> Option<u64> {
        None
    }
}

/// Device memory of an exact size.
pub trait DeviceBuffer: fmt::Debug + Send + Sync {
    /// Its size in bytes, exactly as requested.
    fn len_bytes(&self) -> u64;
}

/// Bytes to load into host memory, addressed by position: a slice, a
/// checkpoint reader, a generator. Loading calls it for the positions the
/// destination needs, straight into the destination (no staging copy).
pub trait ByteSource {
    /// Fills `dst` with the bytes at `position..position + dst.len()`.
    fn read_at(&self, position: u64, dst: &mut [u8]);
}

fn read_slice(bytes: &[u8], position: u64, dst: &mut [u8]) {
    let start = position as usize;
    dst.copy_from_slice(&bytes[start..start + dst.len()]);
}

impl ByteSource for &[u8] {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        read_slice(self, position, dst);
    }
}

impl ByteSource for Vec<u8> {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        read_slice(self, position, dst);
    }
}

impl<const N: usize> ByteSource for [u8; N] {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        read_slice(self, position, dst);
    }
}

/// Pinned host memory of an exact size.
///
/// The host reads and writes it only through these methods, so a backend
/// can check (the simulator does) that no copy using it is still pending.
pub trait HostBuffer: fmt::Debug + Send + Sync {
    /// Its size in bytes, exactly as requested.
    fn len_bytes(&self) -> u64;
    /// Writes `len` bytes from `src` (positions `0..len`) at `offset`.
    /// Legal while no copy using this buffer is pending.
    fn write_from(&mut self, offset: u64, len: u64, src: &dyn ByteSource);
    /// Reads bytes at `offset` into `dst`. Legal while no copy writing this
    /// buffer is pending.
    fn read_into(&self, offset: u64, dst: &mut [u8]);
}

/// Memory the caller owns and hands to [`Device::register_host`].
///
/// A registration captures the region's address and length once, when it
/// is registered, and copies read that address until it is unregistered:
/// the device reads the memory behind the region's back.
///
/// # Safety
///
/// Implementors guarantee that, for as long as the value lives and is not
/// mutably borrowed, [`HostRegion::bytes`] returns the same slice (same
/// pointer, same length) on every call, and that the memory behind it is
/// neither moved, freed nor written through any other handle (no interior
/// mutability, no other owner writing). `Vec<u8>` and `Box<[u8]>` qualify:
/// a registration owns the region, so nothing else can reach them.
pub unsafe trait HostRegion: Send + Sync + 'static {
    /// The bytes.
    fn bytes(&self) -> &[u8];

    /// The larger memory this region is a window of, when a backend should
    /// register that memory once for all its windows (a mapped file, whose
    /// windows may share pages, which a device cannot register twice). The
    /// same slice on every call, containing [`HostRegion::bytes`], and
    /// neither moved nor unmapped while this region lives. `None` (the
    /// default): the region is registered alone.
    fn enclosing(&self) -> Option<&[u8]> {
        None
    }

    /// Whether the memory may only be read (a read-only file mapping): a
    /// backend registers it read-only (CUDA refuses a read-only mapping
    /// registered otherwise). Default `false`.
    fn read_only(&self) -> bool {
        false
    }
}

// SAFETY: an owned Vec's buffer moves or changes only through `&mut`, which
// nobody has while the registration owns it.
unsafe impl HostRegion for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

// SAFETY: as for `Vec<u8>`.
unsafe impl HostRegion for Box<[u8]> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// Caller memory registered in place.
pub trait Registration: fmt::Debug + Send + Sync {
    /// Its size in bytes.
    fn len_bytes(&self) -> u64;
}

/// Free and total device memory, from the device's own accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Free bytes.
    pub free_bytes: u64,
    /// Total bytes.
    pub total_bytes: u64,
}

/// A host-side copy source.
pub enum HostSource<'a, A: Api> {
    /// A pinned allocation.
    Pinned(&'a A::HostBuffer),
    /// Memory registered in place.
    Registered(&'a A::Registration),
    /// Pageable memory the device reads where it lies, neither pinned nor
    /// registered (CONTRACT §7c, in-place reads): a read-only window of a
    /// mapped checkpoint, only on a device whose
    /// [`Device::reads_pageable`] is true (elsewhere the copy is a typed
    /// error). The caller keeps the region alive, unchanged, until an event
    /// recorded after the copy completes; a backend may keep a weak handle
    /// to check that it did.
    Pageable(&'a std::sync::Arc<dyn HostRegion>),
}

impl<A: Api> fmt::Debug for HostSource<'_, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostSource::Pinned(b) => f.debug_tuple("Pinned").field(b).finish(),
            HostSource::Registered(r) => f.debug_tuple("Registered").field(r).finish(),
            HostSource::Pageable(p) => f
                .debug_struct("Pageable")
                .field("bytes", &p.bytes().len())
                .finish(),
        }
    }
}

/// A failed registration: the error and the memory, given back.
pub struct RegisterError<A: Api> {
    /// What the backend reported.
    pub error: A::Error,
    /// The memory, unchanged.
    pub region: Box<dyn HostRegion>,
}

impl<A: Api> fmt::Debug for RegisterError<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisterError")
            .field("error", &self.error)
            .field("region_bytes", &self.region.bytes().len())
            .finish()
    }
}

/// Memory, streams, events and copies of one device.
///
/// Every method may be called from any thread. Methods that are `unsafe`
/// enqueue work that outlives the call; their `# Safety` lists say what the
/// caller must guarantee until that work completes.
pub trait Device<A: Api>: Send + Sync {
    /// Allocates exactly `bytes` of device memory (stream-ordered where the
    /// backend supports it). Fails with `OutOfMemory` beyond capacity.
    fn alloc_device(&self, bytes: u64) -> Result<A::DeviceBuffer, A::Error>;

    /// Frees `buffer` once every event in `after` has completed, without
    /// blocking the host.
    ///
    /// # Safety
    ///
    /// Every device operation that reads or writes `buffer` must have been
    /// enqueued before one of the events in `after` was recorded on its
    /// stream; no operation on `buffer` may be enqueued afterwards.
    unsafe fn free_device(
        &self,
        buffer: A::DeviceBuffer,
        after: &[&A::Event],
    ) -> Result<(), A::Error>;

    /// Allocates exactly `bytes` of pinned host memory (plain, readable by
    /// the CPU).
    fn alloc_pinned(&self, bytes: u64) -> Result<A::HostBuffer, A::Error>;

    /// Frees a pinned buffer.
    ///
    /// # Safety
    ///
    /// Every copy that reads or writes `buffer` must have completed (its
    /// event has been synchronised or queried done).
    unsafe fn free_pinned(&self, buffer: A::HostBuffer) -> Result<(), A::Error>;

    /// Registers caller memory in place as a copy source. On failure the
    /// memory comes back in the error.
    fn register_host(
        &self,
        region: Box<dyn HostRegion>,
    ) -> Result<A::Registration, RegisterError<A>>;

    /// Unregisters memory and gives it back.
    ///
    /// # Safety
    ///
    /// Every copy that reads `registration` must have completed.
    unsafe fn unregister_host(
        &self,
        registration: A::Registration,
    ) -> Result<Box<dyn HostRegion>, A::Error>;

    /// Free and total device memory.
    fn memory_info(&self) -> Result<MemoryInfo, A::Error>;

    /// The most device memory in use at once since the last
    /// [`Device::reset_memory_peak`] (or since creation), by the device's
    /// own accounting (its allocator's high-water mark), where it keeps
    /// one; `None` (the default) where it does not.
    fn memory_peak(&self) -> Result<Option<u64>, A::Error> {
        Ok(None)
    }

    /// Starts [`Device::memory_peak`] again from the memory in use now.
    fn reset_memory_peak(&self) -> Result<(), A::Error> {
        Ok(())
    }

    /// Gives the allocator's unused memory back to the device, once the
    /// frees already enqueued have run (the host waits for them): what a
    /// phase frees is then free device memory before the next phase
    /// allocates, not slack the allocator keeps. A no-op by default.
    fn release_unused(&self) -> Result<(), A::Error> {
        Ok(())
    }

    /// The most device memory the allocator held at once (in use, and
    /// mapped but not in use: its chunks' slack) since the last
    /// [`Device::reset_memory_peak`], where it keeps one; `None` (the
    /// default) where it does not. The warm-up plans the difference from
    /// [`Device::memory_peak`] as every phase's allocator slack.
    fn memory_reserved_peak(&self) -> Result<Option<u64>, A::Error> {
        Ok(None)
    }

    /// The allocator's granule where each allocation takes a whole number
    /// of these bytes (1, the default: exactly what it asks, or an
    /// allocator that packs allocations into chunks, whose slack
    /// [`Device::memory_reserved_peak`] measures). The request planner
    /// rounds each allocation it plans up to it.
    fn allocation_granule(&self) -> u64 {
        1
    }

    /// The chunk the allocator maps device memory in where it packs
    /// allocations into shared chunks (1, the default: no such chunks).
    /// What it holds at a peak is then what is in use rounded up to a
    /// chunk, plus what frees left in chunks still part used: the planner
    /// counts up to a chunk less one byte of that rounding in every phase,
    /// beside the fragmentation the warm-up measured (CONTRACT §7a).
    fn allocation_chunk(&self) -> u64 {
        1
    }

    /// Device memory the device's page tables take to map `locked` bytes
    /// of page-locked host memory (a pinned allocation or a registration
    /// of that size), where it takes any (0, the default): what the
    /// planner counts for the pinned staging and upload buffers a plan
    /// holds beside the masters, whose own mappings are measured.
    fn host_page_table_bytes(&self, locked: u64) -> u64 {
        let _ = locked;
        0
    }

    /// Names a stream for traces and reports (no behaviour).
    fn name_stream(&self, stream: &A::Stream, name: &str) {
        let _ = (stream, name);
    }

    /// Names a device buffer for traces and reports (no behaviour).
    fn name_buffer(&self, buffer: &A::DeviceBuffer, name: &str) {
        let _ = (buffer, name);
    }

    /// Creates a non-blocking stream.
    fn create_stream(&self) -> Result<A::Stream, A::Error>;

    /// Whether copies may read pageable host memory where it lies
    /// ([`HostSource::Pageable`]): the device itself loads the bytes
    /// across the link (CUDA's pageable memory access: HMM with the open
    /// kernel modules, or ATS), so a staged master needs no host copy into
    /// a pinned staging buffer (CONTRACT §7c). `false` (the default).
    fn reads_pageable(&self) -> bool {
        false
    }

    /// Whether a strategy may run host work (the staging fill, CONTRACT
    /// §7c) on a thread of its own beside the caller's. `true` (the
    /// default) on a real device; a simulated device whose host is one
    /// deterministic clock says `false`, and that work runs on the caller's
    /// thread when it is needed.
    fn host_worker_threads(&self) -> bool {
        true
    }

    /// The host wrote `bytes` into a pinned staging buffer (a staging
    /// fill, CONTRACT §7c). Nothing on a real device, whose host keeps its
    /// own time; a simulated host whose work runs on the caller's thread
    /// charges its clock at its fill rate, so the time the engine's thread
    /// spends filling delays what that thread issues next.
    fn host_filled(&self, bytes: u64) {
        let _ = bytes;
    }

    /// The host pauses between polls of events (the last post-forward's
    /// loop, CONTRACT §7c, while it waits for a staging buffer or for the
    /// kernels it runs beside, whichever comes first): a sleep of
    /// [`HOST_PAUSE_US`] on a real device (the default; the OS may sleep
    /// longer). A device whose clock moves only with the host's calls
    /// must move it on here (the simulator moves its host clock by
    /// [`HOST_PAUSE_US`]): the loop polls with nothing else between its
    /// pauses, and stops after about a second of them.
    fn host_pause(&self) {
        std::thread::sleep(std::time::Duration::from_micros(HOST_PAUSE_US));
    }

    /// A new stream whose work the device schedules ahead of other
    /// streams' pending work where it can (the decode stream of CONTRACT
    /// §7b: a short decode that compute waits for should not queue behind
    /// the compute it feeds). Default: [`Device::create_stream`].
    fn create_priority_stream(&self) -> Result<A::Stream, A::Error> {
        self.create_stream()
    }

    /// Creates an unrecorded event.
    fn create_event(&self) -> Result<A::Event, A::Error>;

    /// Creates an unrecorded event that can time work
    /// ([`Device::elapsed_ns`]); the default is [`Device::create_event`],
    /// for backends whose events all carry a time.
    fn create_timing_event(&self) -> Result<A::Event, A::Error> {
        self.create_event()
    }

    /// Device time from `from` to `to`, nanoseconds (0 when `to` came
    /// first). Both must be timing events, recorded and completed.
    fn elapsed_ns(&self, from: &A::Event, to: &A::Event) -> Result<u64, A::Error>;

    /// Captures in `event` the work enqueued on `stream` so far.
    fn record_event(&self, event: &A::Event, stream: &A::Stream) -> Result<(), A::Error>;

    /// Makes later work on `stream` wait for `event`'s capture, on the
    /// device (the host does not wait).
    fn stream_wait_event(&self, stream: &A::Stream, event: &A::Event) -> Result<(), A::Error>;

    /// Whether `event`'s capture has completed.
    fn event_done(&self, event: &A::Event) -> Result<bool, A::Error>;

    /// Blocks the host until `event`'s capture has completed.
    fn synchronize_event(&self, event: &A::Event) -> Result<(), A::Error>;

    /// Blocks the host until all work on `stream` has completed.
    fn synchronize_stream(&self, stream: &A::Stream) -> Result<(), A::Error>;

    /// Enqueues on `stream` a copy of `bytes` bytes from `src` at
    /// `src_offset` to `dst` at `dst_offset`.
    ///
    /// # Safety
    ///
    /// * both ranges lie within their buffers;
    /// * `src` is not written, freed or unregistered, and `dst`'s range is
    ///   not read, written or freed by other work, until an event recorded
    ///   on `stream` after this call has completed (or other work waits for
    ///   it on the device).
    unsafe fn copy_h2d(
        &self,
        stream: &A::Stream,
        src: HostSource<'_, A>,
        src_offset: u64,
        dst: &A::DeviceBuffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), A::Error>;

    /// Enqueues on `stream` a copy of `bytes` bytes from `src` at
    /// `src_offset` to `dst` at `dst_offset`.
    ///
    /// # Safety
    ///
    /// * both ranges lie within their buffers;
    /// * `src`'s range is not written or freed, and `dst` is not read,
    ///   written or freed by the host, until an event recorded on `stream`
    ///   after this call has completed.
    unsafe fn copy_d2h(
        &self,
        stream: &A::Stream,
        src: &A::DeviceBuffer,
        src_offset: u64,
        dst: &mut A::HostBuffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), A::Error>;
}

/// A group of ranks that gather weights (CONTRACT §8).
///
/// Life cycle: created by the distributed backend's bootstrap with every
/// rank of the group; every rank must issue the same collectives in the same
/// order; never used from a path only some ranks take (failure cleanup
/// included).
pub trait Collective<A: Api>: Send + Sync {
    /// This rank within the group, `0..size`.
    fn rank(&self) -> u32;

    /// The group size G.
    fn size(&self) -> u32;

    /// Enqueues on `stream` an all-gather: every rank contributes
    /// `shard_bytes` bytes of `shard` at `shard_offset`; rank r's
    /// contribution lands in `dst` at `dst_offset + r × shard_bytes`, so
    /// `size × shard_bytes` bytes of `dst` are written.
    ///
    /// # Safety
    ///
    /// * both ranges lie within their buffers;
    /// * the same rules as [`Device::copy_h2d`] hold for `shard` (read) and
    ///   `dst`'s range (written) until an event recorded on `stream` after
    ///   this call has completed.
    unsafe fn all_gather(
        &self,
        stream: &A::Stream,
        shard: &A::DeviceBuffer,
        shard_offset: u64,
        shard_bytes: u64,
        dst: &A::DeviceBuffer,
        dst_offset: u64,
    ) -> Result<(), A::Error>;
}

/// One tensor of a block's unit, as a [`Codec`] sees it: where it lies and
/// whether it holds bf16 values (the only ones a lossless exponent code
/// compresses; everything else travels raw).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodecSpan {
    /// Offset in the unit.
    pub offset: u64,
    /// Bytes.
    pub bytes: u64,
    /// Whether the tensor is bf16.
    pub bf16: bool,
}

/// The most bytes a coded unit of `len` bytes with `spans` spans may take:
/// its raw bytes plus 512 bytes of headers and alignment per span and for
/// the block (what INV-7's bounds count for a staging buffer and a coded
/// host master before anything is encoded).
pub fn coded_bound(len: u64, spans: usize) -> u64 {
    len.saturating_add(512 * (spans as u64 + 1))
}

/// One block's coded bytes, as a [`Codec`] encoded them.
#[derive(Clone, Debug)]
pub struct Coded {
    /// The bytes the host keeps and the link carries.
    pub blob: Vec<u8>,
    /// The decode's work items (the codec's own measure; handed back to
    /// [`Codec::decode`]).
    pub work: u64,
}

/// A lossless block code the device decodes (CONTRACT §7b): the ring
/// engine's *decode* transport copies a block's coded bytes to a device
/// staging buffer and has the device decode them into the block's slot.
///
/// Life cycle: one per device (it may hold the device's compiled decoder);
/// [`Codec::encode`] runs on the host at `enable`, from any thread;
/// [`Codec::decode`] enqueues device work.
pub trait Codec<A: Api>: Send + Sync {
    /// The code's name, for logs and reports.
    fn name(&self) -> &str;

    /// The blob format this codec decodes, as a packed checkpoint names it
    /// (`offload-pack OPB1`): a weight source's coded region
    /// (`WeightSource::take_coded`) is used only when its format is this.
    /// `None`: the codec decodes nothing it did not encode itself.
    fn format(&self) -> Option<&str> {
        None
    }

    /// Encodes one block's unit of `len` bytes, read from `unit` (its
    /// tensors at `spans`, sorted and disjoint; bytes no span covers
    /// travel raw). Decoding the result must give back exactly those
    /// bytes; an encoder that cannot promise it (a round trip that failed)
    /// returns `Err` with the reason, and the block streams raw. A blob
    /// longer than [`coded_bound`] is refused the same way (INV-7's bounds
    /// count that much before anything is encoded).
    fn encode(&self, unit: &dyn ByteSource, len: u64, spans: &[CodecSpan])
    -> Result<Coded, String>;

    /// The exact length of the blob [`Codec::encode`] gives for this unit,
    /// found without encoding it (`offload-pack`'s: from each tensor's
    /// exponent histogram, `block::plan_block`). The request planner
    /// prices every block's coded bytes with it at `enable` and encodes
    /// only the blocks a plan streams coded (CONTRACT §7b), so `encode`
    /// must then give a blob of exactly this length (one of another
    /// length, or a refusal, is a typed error: the planner priced this
    /// one). `Err` with the reason where `encode` would refuse the unit.
    /// `Ok(None)`, the default: this codec sizes a block only by encoding
    /// it (the planner then encodes every block at `enable` and keeps the
    /// blobs until its plan is in force).
    fn coded_len(
        &self,
        unit: &(dyn ByteSource + Sync),
        len: u64,
        spans: &[CodecSpan],
    ) -> Result<Option<u64>, String> {
        let _ = (unit, len, spans);
        Ok(None)
    }

    /// Whether every decode so far found a whole coded block: `Err` (the
    /// backend's error, naming what it saw) where one did not (a damaged or
    /// stale blob), which it also clears. The host calls it only after
    /// synchronising with the decodes it covers (the ring engine: after
    /// its enable-time measurement and after `disable` drained).
    fn check(&self) -> Result<(), A::Error> {
        Ok(())
    }

    /// Enqueues on `stream` the decode of the `coded_bytes` bytes at the
    /// start of `src` (a [`Coded`] blob, with its `work`) into the first
    /// `decoded_bytes` bytes of `dst`.
    ///
    /// # Safety
    ///
    /// * `src` holds, once `stream` reaches this call, the blob that
    ///   [`Codec::encode`] returned (both ranges lie within their buffers);
    /// * the same rules as [`Device::copy_h2d`] hold for `src` (read) and
    ///   `dst`'s range (written) until an event recorded on `stream` after
    ///   this call has completed.
    unsafe fn decode(
        &self,
        stream: &A::Stream,
        src: &A::DeviceBuffer,
        coded_bytes: u64,
        work: u64,
        dst: &A::DeviceBuffer,
        decoded_bytes: u64,
    ) -> Result<(), A::Error>;
}
