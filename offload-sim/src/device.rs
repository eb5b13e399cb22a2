//! The simulated device: a real backend of `offload_core::device`.
//!
//! * **Data, at its simulated time.** Every buffer has real memory. Work
//!   the host enqueues does not touch memory when it is enqueued: each
//!   copy's bytes land at its completion, each kernel reads its inputs at
//!   its start, each free releases memory when the device reaches it. The
//!   host sees memory as of its own clock. So a kernel that starts before
//!   the copy filling its input completes reads the stale bytes, exactly as
//!   a GPU would, and the output shows the race, not only the checker.
//!   With a payload divisor `d > 1` (real-model sizes that do not fit in
//!   host memory) a buffer of `n` bytes keeps one byte in `d` (logical
//!   positions `≡ 0 mod d`); sizes, offsets, timing and accounting stay
//!   logical and exact.
//! * **Time.** A virtual clock: every operation runs on its stream after the
//!   stream's previous work, after the events it waits for, after the host
//!   enqueued it, and after earlier work on the same engine (one host→device
//!   copy engine, one device→host copy engine, one compute engine). Durations
//!   come from the [`DeviceProfile`], optionally stretched by a seeded
//!   [`Jitter`] that widens race windows as the CUDA backend's perturbation
//!   mode does. The wall clock is never read (but by a collective group's
//!   last-resort hang limit, `crate::collective`). Arithmetic that would overflow
//!   the clock is an error, never a wrap.
//! * **Order.** A vector clock per stream and one for the host: waits join
//!   event clocks, enqueues join the host clock, host synchronisation joins
//!   the device's. Every access of every buffer goes to core's INV-3 checker
//!   with that happens-before relation, so a missing wait is reported even
//!   when the timing happened to hide it.
//! * **Faults.** A [`FaultPlan`] fails the N-th allocation, copy,
//!   collective or host synchronisation.
//! * **Drops.** A buffer or registration dropped without its free is
//!   released as the CUDA backend releases it: after the whole device is
//!   synchronised.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use offload_core::device::{
    Api, ByteSource, Device, DeviceBuffer, DeviceError, DeviceErrorKind, HostBuffer, HostRegion,
    HostSource, MemoryInfo, RegisterError, Registration,
};
use offload_core::invariants::{
    Access, BufferOp, BufferOrderChecker, Invariant, VectorClock, Violation,
};

use crate::faults::FaultPlan;
use crate::profile::DeviceProfile;
use crate::trace::{Trace, TraceOp};

/// The simulator's [`Api`].
#[derive(Debug)]
pub struct Sim;

impl Api for Sim {
    type Device = SimDevice;
    type Stream = SimStream;
    type Event = SimEvent;
    type DeviceBuffer = SimDeviceBuffer;
    type HostBuffer = SimHostBuffer;
    type Registration = SimRegistration;
    type Error = SimError;
}

/// An error the simulated device reports.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{operation}: {detail}")]
pub struct SimError {
    /// The operation.
    pub operation: String,
    /// Which kind.
    pub kind: DeviceErrorKind,
    /// What happened.
    pub detail: String,
    /// For `OutOfMemory`: the bytes the allocation lacked.
    pub shortfall_bytes: Option<u64>,
}

impl DeviceError for SimError {
    fn kind(&self) -> DeviceErrorKind {
        self.kind
    }

    fn shortfall_bytes(&self) -> Option<u64> {
        self.shortfall_bytes
    }
}

/// A simulated stream.
#[derive(Debug)]
pub struct SimStream {
    index: usize,
}

impl SimStream {
    /// The stream's id on its device (0 is the host's; never reused).
    pub fn id(&self) -> usize {
        self.index
    }
}

/// A simulated event.
#[derive(Debug)]
pub struct SimEvent {
    index: usize,
}

/// A kernel's output: one 64-bit value on the device that kernels fold
/// their checksums into, in the order they run (see [`SimDevice::compute`]).
#[derive(Debug)]
pub struct SimAccumulator {
    index: usize,
}

/// Simulated device memory. Dropped without [`Device::free_device`], it is
/// freed after the whole device is synchronised.
pub struct SimDeviceBuffer {
    id: u64,
    len: u64,
    freed: bool,
    shared: Arc<Mutex<State>>,
}

impl fmt::Debug for SimDeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimDeviceBuffer")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}

impl SimDeviceBuffer {
    /// The buffer's id (stable within one device; never reused).
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl DeviceBuffer for SimDeviceBuffer {
    fn len_bytes(&self) -> u64 {
        self.len
    }
}

impl Drop for SimDeviceBuffer {
    fn drop(&mut self) {
        if self.freed {
            return;
        }
        let mut st = lock(&self.shared);
        st.synchronize_device();
        let name = st.dev_name(self.id);
        st.host_access(name, 0..self.len, Access::Free, "drop of a device buffer");
        st.copied.remove(&self.id);
        if let Some(b) = st.device.get_mut(&self.id)
            && b.live
        {
            b.live = false;
            b.mem = None;
            st.stats.device_bytes -= self.len;
        }
    }
}

/// Simulated pinned host memory. Host reads and writes go through the
/// device's order checker (a staging buffer rewritten while a copy still
/// reads it is reported). Dropped without [`Device::free_pinned`], it is
/// freed after the whole device is synchronised.
pub struct SimHostBuffer {
    id: u64,
    len: u64,
    freed: bool,
    shared: Arc<Mutex<State>>,
}

impl fmt::Debug for SimHostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimHostBuffer")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}

impl HostBuffer for SimHostBuffer {
    fn len_bytes(&self) -> u64 {
        self.len
    }

    fn write_from(&mut self, offset: u64, len: u64, src: &dyn ByteSource) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "write past the end of a pinned buffer"
        );
        let mut st = lock(&self.shared);
        st.host_access(
            host_name(self.id),
            offset..offset + len,
            Access::Write,
            "host write",
        );
        let d = st.divisor;
        let Some(mem) = st.pinned.get_mut(&self.id).map(|m| &mut m.mem) else {
            return;
        };
        if d == 1 {
            src.read_at(0, &mut mem[offset as usize..(offset + len) as usize]);
            return;
        }
        let mut byte = [0u8; 1];
        let mut pos = offset.next_multiple_of(d) - offset;
        for out in &mut mem[kept(offset, offset + len, d)] {
            src.read_at(pos, &mut byte);
            *out = byte[0];
            pos += d;
        }
    }

    fn read_into(&self, offset: u64, dst: &mut [u8]) {
        let len = dst.len() as u64;
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "read past the end of a pinned buffer"
        );
        let mut st = lock(&self.shared);
        st.host_access(
            host_name(self.id),
            offset..offset + len,
            Access::Read,
            "host read",
        );
        let d = st.divisor;
        let mem = st.pinned.get(&self.id).map(|m| &m.mem[..]).unwrap_or(&[]);
        for (i, out) in dst.iter_mut().enumerate() {
            let p = offset + i as u64;
            *out = if p.is_multiple_of(d) {
                mem.get((p / d) as usize).copied().unwrap_or(0)
            } else {
                0
            };
        }
    }
}

impl Drop for SimHostBuffer {
    fn drop(&mut self) {
        if self.freed {
            return;
        }
        let mut st = lock(&self.shared);
        st.synchronize_device();
        st.host_access(
            host_name(self.id),
            0..self.len,
            Access::Free,
            "drop of a pinned buffer",
        );
        if st.pinned.remove(&self.id).is_some() {
            st.stats.pinned_bytes -= self.len;
            st.stats.locked_bytes -= self.len;
        }
    }
}

/// Caller memory registered in place. The device reads a snapshot taken at
/// registration (the address and length are captured once; the region is
/// immutable while registered, by [`HostRegion`]'s contract). Dropped
/// without [`Device::unregister_host`], it is unregistered after the whole
/// device is synchronised.
pub struct SimRegistration {
    id: u64,
    len: u64,
    region: Option<Box<dyn HostRegion>>,
    shared: Arc<Mutex<State>>,
}

impl fmt::Debug for SimRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimRegistration")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}

impl Registration for SimRegistration {
    fn len_bytes(&self) -> u64 {
        self.len
    }
}

impl Drop for SimRegistration {
    fn drop(&mut self) {
        if self.region.is_none() {
            return;
        }
        let mut st = lock(&self.shared);
        st.synchronize_device();
        st.unregister(self.id, self.len, "drop of a registration");
    }
}

/// One end of a transfer, for checks and the trace.
struct End {
    name: String,
    offset: u64,
    len: u64,
}

/// Where a transfer's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loc {
    Device(u64),
    Pinned(u64),
    Registered(u64),
    /// A pageable region read in place, by its id.
    Pageable(u64),
}

/// Decode windows kept for the interference a kernel sees: more than a
/// ring runs ahead (64 slots at most).
const DECODE_WINDOWS: usize = 128;

/// The engines whose work serialises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    H2d,
    D2h,
    Compute,
    Collective,
    /// Lossless decodes (CONTRACT §7b): concurrent with compute, which they
    /// slow by the profile's `decode_interference`.
    Decode,
}

/// A data effect waiting for its simulated time.
#[derive(Debug)]
enum Effect {
    /// A copy or gather lands (at its completion).
    Copy {
        src: Loc,
        src_offset: u64,
        dst: Loc,
        dst_offset: u64,
        bytes: u64,
    },
    /// A kernel reads its inputs (at its start) and folds their checksum
    /// into an accumulator.
    Kernel {
        inputs: Vec<(u64, Range<u64>)>,
        accumulator: usize,
    },
    /// An all-gather or a decode lands (at its completion): the bytes every
    /// rank contributed, assembled (or the decoded bytes), with a payload
    /// divisor only the kept ones of `dst_offset..dst_offset + len`.
    Gather {
        dst: u64,
        dst_offset: u64,
        len: u64,
        data: Vec<u8>,
    },
    /// A decode starts (CONTRACT §7b): it reads the kept bytes of
    /// `src[..coded]` as they are now, decodes them, and schedules their
    /// landing in `dst[..decoded]` at `end` (zeros where they do not
    /// decode).
    Decode {
        src: u64,
        coded: u64,
        dst: u64,
        decoded: u64,
        /// When it lands, and the sequence number reserved for the landing
        /// when the decode was issued (so it lands before work issued
        /// after it that starts at the same time).
        end: (u64, u64),
        decoder: Decoder,
    },
    /// The device reaches a free: the memory goes.
    Free { id: u64 },
    /// A memset of an accumulator.
    Reset { accumulator: usize },
}

/// What a decode runs on the bytes it reads ([`SimDevice::decode`]).
pub type DecodeFn = Arc<dyn Fn(&[u8]) -> Option<Vec<u8>> + Send + Sync>;

/// A [`DecodeFn`] held by a pending effect.
#[derive(Clone)]
pub struct Decoder(DecodeFn);

impl fmt::Debug for Decoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Decoder")
    }
}

/// Seeded stretching of the timeline: before each device operation, with
/// probability `probability`, its stream first idles for a random time up
/// to `max_ns` (as the CUDA backend's spin kernels do). Deterministic for a
/// seed.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Jitter {
    /// The seed.
    pub seed: u64,
    /// Chance that an operation is delayed.
    pub probability: f64,
    /// Longest delay, ns.
    pub max_ns: u64,
}

#[derive(Debug)]
struct StreamState {
    name: String,
    tail_ns: u64,
    clock: VectorClock,
    waited_ns: u64,
}

#[derive(Debug, Default, Clone)]
struct EventState {
    time_ns: u64,
    clock: VectorClock,
}

#[derive(Debug)]
struct DevBuf {
    /// Its name for the checker and the trace (kept after the free, so a
    /// late use is reported against the right buffer).
    name: String,
    len: u64,
    /// Allocated, not yet handed to a free.
    live: bool,
    /// `None` once the device has reached its free.
    mem: Option<Vec<u8>>,
    /// A runtime's activations ([`SimDevice::alloc_activations`]), counted
    /// apart from the weights.
    activation: bool,
}

#[derive(Debug)]
struct HostMem {
    len: u64,
    mem: Vec<u8>,
}

/// A pageable region a copy reads where it lies: the caller's, held
/// weakly, so that a copy that runs after the caller dropped it is seen.
struct PageableMem {
    region: std::sync::Weak<dyn HostRegion>,
    mem: Vec<u8>,
}

impl std::fmt::Debug for PageableMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageableMem")
            .field("live", &(self.region.strong_count() > 0))
            .field("kept", &self.mem.len())
            .finish()
    }
}

/// Counters the harness reports.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SimStats {
    /// Host→device bytes copied.
    pub h2d_bytes: u64,
    /// Device→host bytes copied.
    pub d2h_bytes: u64,
    /// Device bytes allocated now.
    pub device_bytes: u64,
    /// Peak device bytes (weights: every allocation but activations).
    pub device_peak_bytes: u64,
    /// Activation bytes allocated now ([`SimDevice::alloc_activations`]).
    pub activation_bytes: u64,
    /// Peak activation bytes.
    pub activation_peak_bytes: u64,
    /// Peak of everything allocated (weights and activations) since the
    /// last [`Device::reset_memory_peak`] or [`SimDevice::reset_peak`].
    pub total_peak_bytes: u64,
    /// Peak weight bytes since the last [`SimDevice::take_window`].
    pub window_weight_peak_bytes: u64,
    /// Peak of everything since the last [`SimDevice::take_window`].
    pub window_total_peak_bytes: u64,
    /// Peak of the device's own count of memory in use (what its free
    /// memory misses: what the allocator holds, everything in use rounded
    /// up to its chunk, and the page tables of page-locked host memory)
    /// since the last [`SimDevice::take_window`].
    pub window_counted_peak_bytes: u64,
    /// Pinned host bytes allocated now.
    pub pinned_bytes: u64,
    /// Peak pinned host bytes.
    pub pinned_peak_bytes: u64,
    /// Host bytes registered in place now.
    pub registered_bytes: u64,
    /// Peak registered host bytes.
    pub registered_peak_bytes: u64,
    /// Page-locked host bytes now as a GPU locks them: pinned bytes, and
    /// registered regions, where a window of a larger mapping
    /// ([`HostRegion::enclosing`]) locks that whole mapping, once however
    /// many of its windows are registered (as offload-cuda registers it).
    pub locked_bytes: u64,
    /// Peak of [`Self::locked_bytes`].
    pub locked_peak_bytes: u64,
    /// Device allocations so far.
    pub allocations: u64,
    /// Copies so far.
    pub copies: u64,
    /// Kernels so far.
    pub kernels: u64,
    /// Lossless decodes so far (CONTRACT §7b).
    pub decodes: u64,
    /// Bytes those decodes wrote.
    pub decoded_bytes: u64,
    /// Decodes whose input did not decode (the bytes a staging buffer held
    /// when the decode started were not a whole coded block): each wrote
    /// zeros, as a GPU decoder raises its error flag.
    pub decode_errors: u64,
    /// Units this device's codec encoded on the host so far
    /// (`SimCodec::encode`; sizing one, `Codec::coded_len`, encodes
    /// nothing).
    pub encodes: u64,
    /// Bytes of the units those encodes read.
    pub encoded_bytes: u64,
    /// Host synchronisations (of a stream or an event) so far.
    pub syncs: u64,
    /// Requests to pin host memory (pinned allocations, registrations).
    pub pin_requests: u64,
    /// Of them, refused: by the `refuse_pin_every` fault or an injected
    /// allocation failure (a layerwise block whose pin is refused streams
    /// staged, CONTRACT §7c).
    pub pins_refused: u64,
    /// Bytes the engine filled into host staging buffers
    /// (`Device::host_filled`), on any thread.
    pub host_filled_bytes: u64,
}

/// One host allocation (pinned or registered) and its bytes, as the device
/// holds them: what INV-2's checker reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostAllocation {
    /// `pinned#N` or `registered#N`.
    pub name: String,
    /// Its bytes (with a payload divisor, the kept ones).
    pub bytes: Vec<u8>,
}

#[derive(Debug)]
struct State {
    profile: DeviceProfile,
    divisor: u64,
    /// [`SimConfig::host_threads`].
    host_threads: bool,
    /// [`SimConfig::pageable_reads`].
    pageable_reads: bool,
    /// Pageable regions copies read in place, by id: a weak handle (the
    /// caller owns the region) and its kept bytes, taken at the first copy
    /// (the region is read-only). A copy names the region by id, so one
    /// queued before its region was dropped still sees it dropped when a
    /// new region takes the same address.
    pageable: BTreeMap<u64, PageableMem>,
    host_now_ns: u64,
    host_clock: VectorClock,
    streams: Vec<StreamState>,
    events: Vec<EventState>,
    device: BTreeMap<u64, DevBuf>,
    pinned: BTreeMap<u64, HostMem>,
    registered: BTreeMap<u64, HostMem>,
    accumulators: Vec<u64>,
    pending: BTreeMap<(u64, u64), Effect>,
    next_id: u64,
    next_seq: u64,
    engines: [u64; 5],
    /// The last decodes' windows on the decode engine (start, end): a
    /// kernel is slowed for the part of it a decode actually runs (a
    /// decode queued behind its slot's last use has not started yet).
    decode_windows: std::collections::VecDeque<(u64, u64)>,
    op_clocks: Vec<VectorClock>,
    checker: BufferOrderChecker,
    violations: Vec<Violation>,
    faults: FaultPlan,
    /// [`SimDevice::lose`]: every later host synchronisation fails.
    lost: bool,
    /// Enclosing mappings of registered windows: (address) → (bytes,
    /// windows registered).
    mappings: BTreeMap<usize, (u64, usize)>,
    /// Each registration's enclosing mapping, where it has one.
    registration_mapping: BTreeMap<u64, usize>,
    jitter: Option<(Jitter, u64)>,
    collectives: u64,
    /// Per device buffer, the byte ranges host→device copies wrote since a
    /// gather last read them (INV-9: a gather reads only those).
    copied: BTreeMap<u64, RangeSet>,
    stats: SimStats,
    trace: Trace,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn host_name(id: u64) -> String {
    format!("pinned#{id}")
}

fn registered_name(id: u64) -> String {
    format!("registered#{id}")
}

fn accumulator_name(index: usize) -> String {
    format!("accumulator#{index}")
}

const HOST: usize = 0;

/// The kept (real) indices of logical bytes `start..end` with divisor `d`:
/// logical positions ≡ 0 mod d, stored at position / d.
fn kept(start: u64, end: u64, d: u64) -> Range<usize> {
    (start.div_ceil(d) as usize)..(end.div_ceil(d) as usize)
}

/// Disjoint, sorted, non-adjacent byte ranges.
#[derive(Debug, Default)]
struct RangeSet(Vec<Range<u64>>);

impl RangeSet {
    fn insert(&mut self, r: Range<u64>) {
        if r.is_empty() {
            return;
        }
        let (mut lo, mut hi) = (r.start, r.end);
        self.0.retain(|x| {
            let touches = x.start <= hi && lo <= x.end;
            if touches {
                lo = lo.min(x.start);
                hi = hi.max(x.end);
            }
            !touches
        });
        let at = self.0.partition_point(|x| x.start < lo);
        self.0.insert(at, lo..hi);
    }

    fn remove(&mut self, r: Range<u64>) {
        if r.is_empty() {
            return;
        }
        let mut out = Vec::with_capacity(self.0.len() + 1);
        for x in self.0.drain(..) {
            if x.end <= r.start || r.end <= x.start {
                out.push(x);
                continue;
            }
            if x.start < r.start {
                out.push(x.start..r.start);
            }
            if r.end < x.end {
                out.push(r.end..x.end);
            }
        }
        self.0 = out;
    }

    /// The first maximal part of `r` not covered, if any.
    fn first_gap(&self, r: Range<u64>) -> Option<Range<u64>> {
        let mut at = r.start;
        for x in &self.0 {
            if at >= r.end {
                return None;
            }
            if x.end <= at {
                continue;
            }
            if x.start > at {
                return Some(at..x.start.min(r.end));
            }
            at = x.end;
        }
        (at < r.end).then_some(at..r.end)
    }
}

/// The fold kernels apply to an accumulator: order-dependent.
pub fn fold(a: u64, b: u64) -> u64 {
    (a ^ b).wrapping_mul(0x100_0000_01b3).rotate_left(17)
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl State {
    fn err(
        &self,
        operation: impl Into<String>,
        kind: DeviceErrorKind,
        detail: impl Into<String>,
    ) -> SimError {
        SimError {
            operation: operation.into(),
            kind,
            detail: detail.into(),
            shortfall_bytes: None,
        }
    }

    /// A pageable region as a copy source (`HostSource::Pageable`): its
    /// name, length and location, its kept bytes taken at its first copy;
    /// a typed error where this device does not read pageable memory.
    fn pageable_source(
        &mut self,
        region: &std::sync::Arc<dyn HostRegion>,
    ) -> Result<(String, u64, Loc), SimError> {
        let bytes = region.bytes();
        let (at, len) = (bytes.as_ptr() as usize, bytes.len() as u64);
        let name = format!("pageable@{at:#x}");
        if !self.pageable_reads {
            return Err(self.err(
                format!("h2d {name}"),
                DeviceErrorKind::Other,
                "this device does not read pageable memory (SimConfig::pageable_reads is off): copy from pinned or registered memory".to_owned(),
            ));
        }
        let d = self.divisor as usize;
        // The region's own allocation (a dropped one's stays allocated
        // while its weak handle lives, so no new region shares it).
        let weak = std::sync::Arc::downgrade(region);
        let live = self
            .pageable
            .iter()
            .find(|(_, p)| std::sync::Weak::ptr_eq(&p.region, &weak))
            .map(|(&id, _)| id);
        let id = match live {
            Some(id) => id,
            None => {
                // A new region (or a new one at a dropped one's address):
                // copies queued for the old one keep its entry; dropped
                // regions no queued copy reads are forgotten.
                let queued: std::collections::BTreeSet<u64> = self
                    .pending
                    .values()
                    .filter_map(|e| match e {
                        Effect::Copy {
                            src: Loc::Pageable(id),
                            ..
                        } => Some(*id),
                        _ => None,
                    })
                    .collect();
                self.pageable
                    .retain(|id, p| p.region.strong_count() > 0 || queued.contains(id));
                let id = self.new_id();
                self.pageable.insert(
                    id,
                    PageableMem {
                        region: weak,
                        mem: bytes.iter().step_by(d).copied().collect(),
                    },
                );
                id
            }
        };
        Ok((name, len, Loc::Pageable(id)))
    }

    fn record_violation(&mut self, invariant: Invariant, detail: String) {
        self.violations.push(Violation { invariant, detail });
    }

    /// The host does something: its clock ticks.
    fn host_tick(&mut self) -> usize {
        self.host_now_ns = self
            .host_now_ns
            .saturating_add((self.profile.launch_overhead_us * 1e3) as u64);
        self.host_clock.tick(HOST);
        self.op_clocks.push(self.host_clock.clone());
        self.op_clocks.len() - 1
    }

    /// The host spends `ns` on work of its own (a staging fill, a pause):
    /// its clock moves on by it and what has landed by then lands.
    fn host_spend(&mut self, ns: u64) {
        self.host_now_ns = self.host_now_ns.saturating_add(ns);
        let now = self.host_now_ns;
        self.settle(now);
    }

    /// Applies every pending data effect whose time has come by `until`,
    /// in time order (ties in enqueue order).
    fn settle(&mut self, until: u64) {
        while let Some(entry) = self.pending.first_entry() {
            if entry.key().0 > until {
                break;
            }
            let effect = entry.remove();
            self.apply(effect);
        }
    }

    fn schedule(&mut self, time_ns: u64, effect: Effect) {
        self.next_seq += 1;
        self.pending.insert((time_ns, self.next_seq), effect);
    }

    fn apply(&mut self, effect: Effect) {
        let d = self.divisor;
        match effect {
            Effect::Copy {
                src,
                src_offset,
                dst,
                dst_offset,
                bytes,
            } => {
                // A pageable source its owner dropped before the copy ran:
                // the device would have read unmapped memory.
                if let Loc::Pageable(id) = src
                    && let Some(p) = self.pageable.get(&id)
                    && p.region.strong_count() == 0
                {
                    self.record_violation(
                        Invariant::NoEarlyFree,
                        format!(
                            "a copy read pageable memory (region #{id}, {bytes} bytes from {src_offset}) after its owner dropped it"
                        ),
                    );
                }
                // Freed memory reads as zeros (the checker has reported the
                // use after free); a freed destination swallows the bytes.
                let from = kept(src_offset, src_offset + bytes, d);
                let data: Vec<u8> = match self.memory(src) {
                    Some(mem) => mem
                        .get(from.clone())
                        .map_or_else(|| vec![0; from.len()], <[u8]>::to_vec),
                    None => vec![0; from.len()],
                };
                let to = kept(dst_offset, dst_offset + bytes, d);
                if let Some(mem) = self.memory_mut(dst)
                    && let Some(out) = mem.get_mut(to)
                {
                    let n = out.len().min(data.len());
                    out[..n].copy_from_slice(&data[..n]);
                }
            }
            Effect::Kernel {
                inputs,
                accumulator,
            } => {
                let mut sum: u64 = 0xcbf2_9ce4_8422_2325;
                for (id, range) in &inputs {
                    let mem = self.device.get(id).and_then(|b| b.mem.as_deref());
                    // Position within the range of the first kept byte, then every d.
                    let mut pos = range.start.next_multiple_of(d) - range.start;
                    for i in kept(range.start, range.end, d) {
                        let v = mem.and_then(|m| m.get(i)).copied().unwrap_or(0);
                        sum = (sum ^ (u64::from(v) | (pos << 8))).wrapping_mul(0x100_0000_01b3);
                        pos += d;
                    }
                }
                let acc = &mut self.accumulators[accumulator];
                *acc = fold(*acc, sum);
            }
            Effect::Gather {
                dst,
                dst_offset,
                len,
                data,
            } => {
                let to = kept(dst_offset, dst_offset + len, d);
                if let Some(mem) = self.memory_mut(Loc::Device(dst))
                    && let Some(out) = mem.get_mut(to)
                {
                    let n = out.len().min(data.len());
                    out[..n].copy_from_slice(&data[..n]);
                }
            }
            Effect::Decode {
                src,
                coded,
                dst,
                decoded,
                end,
                decoder,
            } => {
                let from = kept(0, coded, d);
                let input: Vec<u8> = self
                    .memory(Loc::Device(src))
                    .and_then(|m| m.get(from.clone()))
                    .map_or_else(|| vec![0; from.len()], <[u8]>::to_vec);
                let kept_len = kept(0, decoded, d).len();
                let data = match (decoder.0)(&input) {
                    Some(out) if out.len() == kept_len => out,
                    _ => {
                        self.stats.decode_errors += 1;
                        vec![0; kept_len]
                    }
                };
                self.pending.insert(
                    end,
                    Effect::Gather {
                        dst,
                        dst_offset: 0,
                        len: decoded,
                        data,
                    },
                );
            }
            Effect::Reset { accumulator } => self.accumulators[accumulator] = 0,
            Effect::Free { id } => {
                if let Some(b) = self.device.get_mut(&id)
                    && !b.live
                {
                    b.mem = None;
                }
            }
        }
    }

    fn memory(&self, loc: Loc) -> Option<&[u8]> {
        match loc {
            Loc::Device(id) => self.device.get(&id)?.mem.as_deref(),
            Loc::Pinned(id) => Some(&self.pinned.get(&id)?.mem),
            Loc::Registered(id) => Some(&self.registered.get(&id)?.mem),
            Loc::Pageable(id) => Some(&self.pageable.get(&id)?.mem),
        }
    }

    fn memory_mut(&mut self, loc: Loc) -> Option<&mut [u8]> {
        match loc {
            Loc::Device(id) => self.device.get_mut(&id)?.mem.as_deref_mut(),
            Loc::Pinned(id) => Some(&mut self.pinned.get_mut(&id)?.mem),
            Loc::Registered(id) => Some(&mut self.registered.get_mut(&id)?.mem),
            // Read-only: copies only read it.
            Loc::Pageable(_) => None,
        }
    }

    /// The kept bytes of logical `range` of `loc` as they will be at
    /// simulated time `at`: the memory now with the pending effects due by
    /// `at` applied to a scratch copy (nothing is mutated out of time
    /// order). Only effects that can reach `loc` are replayed: those writing
    /// it, and, transitively, those writing what they copy from.
    fn bytes_at(&self, loc: Loc, range: Range<u64>, at: u64) -> Vec<u8> {
        let d = self.divisor;
        let due: Vec<&Effect> = self
            .pending
            .range(..=(at, u64::MAX))
            .map(|(_, e)| e)
            .collect();
        let mut relevant = vec![loc];
        for effect in due.iter().rev() {
            if let Effect::Copy { src, dst, .. } = effect
                && relevant.contains(dst)
                && !relevant.contains(src)
            {
                relevant.push(*src);
            }
        }
        // Writes replayed in time order: (where, kept indices, bytes); a
        // free reads as zeros from then on, as `apply` makes it.
        let mut overlay: Vec<(Loc, Range<usize>, Vec<u8>)> = Vec::new();
        let mut freed: Vec<Loc> = Vec::new();
        let read = |overlay: &[(Loc, Range<usize>, Vec<u8>)],
                    freed: &[Loc],
                    loc: Loc,
                    at: Range<usize>|
         -> Vec<u8> {
            if freed.contains(&loc) {
                return vec![0; at.len()];
            }
            let mut out = match self.memory(loc).and_then(|m| m.get(at.clone())) {
                Some(m) => m.to_vec(),
                None => vec![0; at.len()],
            };
            for (l, r, data) in overlay {
                if *l != loc {
                    continue;
                }
                let lo = r.start.max(at.start);
                let hi = r.end.min(at.end).min(r.start + data.len());
                if lo < hi {
                    out[lo - at.start..hi - at.start]
                        .copy_from_slice(&data[lo - r.start..hi - r.start]);
                }
            }
            out
        };
        for effect in due {
            match effect {
                Effect::Copy {
                    src,
                    src_offset,
                    dst,
                    dst_offset,
                    bytes,
                } if relevant.contains(dst) && !freed.contains(dst) => {
                    let data = read(
                        &overlay,
                        &freed,
                        *src,
                        kept(*src_offset, src_offset + bytes, d),
                    );
                    overlay.push((*dst, kept(*dst_offset, dst_offset + bytes, d), data));
                }
                Effect::Gather {
                    dst,
                    dst_offset,
                    len,
                    data,
                } if relevant.contains(&Loc::Device(*dst))
                    && !freed.contains(&Loc::Device(*dst)) =>
                {
                    overlay.push((
                        Loc::Device(*dst),
                        kept(*dst_offset, dst_offset + len, d),
                        data.clone(),
                    ));
                }
                Effect::Free { id } if relevant.contains(&Loc::Device(*id)) => {
                    freed.push(Loc::Device(*id));
                }
                _ => {}
            }
        }
        read(&overlay, &freed, loc, kept(range.start, range.end, d))
    }

    /// A host access of `buffer`: checked against the device's work, after
    /// the memory has caught up with the host's clock.
    fn host_access(&mut self, buffer: String, range: Range<u64>, access: Access, what: &str) {
        let op = self.host_tick();
        self.settle(self.host_now_ns);
        self.observe(
            op,
            buffer,
            range,
            "host".to_owned(),
            access,
            what.to_owned(),
        );
    }

    fn observe(
        &mut self,
        op: usize,
        buffer: String,
        range: Range<u64>,
        stream: String,
        access: Access,
        what: String,
    ) {
        let clocks = &self.op_clocks;
        let result = self.checker.observe(
            BufferOp {
                op,
                buffer,
                range,
                stream,
                access,
                what,
            },
            |a, b| clocks[a].le(&clocks[b]),
        );
        if let Err(v) = result {
            self.violations.push(v);
        }
    }

    /// Counts a host synchronisation; the planned one fails.
    fn sync_fault(&mut self, operation: &str) -> Result<(), SimError> {
        self.stats.syncs += 1;
        let n = self.stats.syncs;
        if self.lost {
            return Err(self.err(
                operation,
                DeviceErrorKind::DeviceLost,
                format!("the device was lost (host synchronisation #{n})"),
            ));
        }
        if self.faults.fail_sync_at == Some(n) {
            return Err(self.err(
                operation,
                DeviceErrorKind::DeviceLost,
                format!("injected failure of host synchronisation #{n}"),
            ));
        }
        Ok(())
    }

    /// The host waits for every stream (a context synchronisation).
    fn synchronize_device(&mut self) {
        self.host_tick();
        let end = self.streams.iter().map(|s| s.tail_ns).max().unwrap_or(0);
        let end = self
            .pending
            .keys()
            .map(|(t, _)| *t)
            .max()
            .unwrap_or(0)
            .max(end);
        self.host_now_ns = self.host_now_ns.max(end);
        let clocks: Vec<VectorClock> = self.streams.iter().map(|s| s.clock.clone()).collect();
        for c in &clocks {
            self.host_clock.join(c);
        }
        self.settle(self.host_now_ns);
    }

    /// The extra delay the jitter puts before the next operation.
    fn jitter_ns(&mut self) -> u64 {
        let Some((j, state)) = self.jitter.as_mut() else {
            return 0;
        };
        *state = splitmix(*state);
        let roll = (*state >> 11) as f64 / (1u64 << 53) as f64;
        if roll >= j.probability || j.max_ns == 0 {
            return 0;
        }
        *state = splitmix(*state);
        *state % j.max_ns
    }

    /// Enqueues an operation of `duration_ns` on `stream` using `engine`;
    /// returns (op id, start, end).
    fn enqueue(
        &mut self,
        stream: usize,
        engine: Engine,
        duration_ns: u64,
        name: &str,
    ) -> Result<(usize, u64, u64), SimError> {
        let start = self.enqueue_start(stream, engine, duration_ns, name)?;
        let end = start
            .checked_add(duration_ns)
            .ok_or_else(|| self.overflow(name, duration_ns))?;
        let op = self.enqueue_commit(stream, engine, start, end, name);
        Ok((op, start, end))
    }

    fn overflow(&self, name: &str, duration_ns: u64) -> SimError {
        self.err(
            name,
            DeviceErrorKind::Other,
            format!(
                "a {duration_ns} ns operation overflows the simulated clock (the workload is too large to simulate)"
            ),
        )
    }

    /// The first half of [`Self::enqueue`]: the host issues the operation
    /// (its clock ticks, the jitter draws) and the earliest start on
    /// `stream` and `engine` comes back; nothing is enqueued yet.
    fn enqueue_start(
        &mut self,
        stream: usize,
        engine: Engine,
        duration_ns: u64,
        name: &str,
    ) -> Result<u64, SimError> {
        self.host_tick();
        let delay = self.jitter_ns();
        let ready = self.streams[stream]
            .tail_ns
            .checked_add(delay)
            .ok_or_else(|| self.overflow(name, duration_ns))?;
        Ok(ready
            .max(self.engines[engine as usize])
            .max(self.host_now_ns))
    }

    /// The second half of [`Self::enqueue`]: the operation occupies
    /// `stream` and `engine` from `start` to `end`; returns its op id.
    fn enqueue_commit(
        &mut self,
        stream: usize,
        engine: Engine,
        start: u64,
        end: u64,
        name: &str,
    ) -> usize {
        let s = &mut self.streams[stream];
        s.clock.join(&self.host_clock);
        s.clock.tick(stream);
        s.tail_ns = s.tail_ns.max(end);
        let engine_free = &mut self.engines[engine as usize];
        *engine_free = (*engine_free).max(end);
        let clock = s.clock.clone();
        let track = s.name.clone();
        self.op_clocks.push(clock);
        self.trace.push(TraceOp {
            track,
            name: name.to_owned(),
            start_ns: start,
            duration_ns: end.saturating_sub(start),
        });
        self.op_clocks.len() - 1
    }

    /// Checks, counts (for fault injection), schedules and records one copy
    /// of `bytes` from `src` to `dst` on `stream`; its bytes land at its
    /// completion.
    fn transfer(
        &mut self,
        stream: usize,
        engine: Engine,
        (src, src_loc): (End, Loc),
        (dst, dst_loc): (End, Loc),
        bytes: u64,
    ) -> Result<(), SimError> {
        let kind = match engine {
            Engine::H2d => "h2d",
            Engine::D2h => "d2h",
            Engine::Collective => "all_gather",
            Engine::Compute => "compute",
            Engine::Decode => "decode",
        };
        let op_name = format!("{kind} {} → {}", src.name, dst.name);
        self.check_range(&op_name, "source", src.offset, bytes, src.len)?;
        self.check_range(&op_name, "destination", dst.offset, bytes, dst.len)?;
        let d = self.divisor;
        if d > 1 && (dst.offset % d != src.offset % d) {
            return Err(self.err(
                op_name,
                DeviceErrorKind::Other,
                format!("sampled payloads need source and destination offsets equal modulo {d}"),
            ));
        }
        self.stats.copies += 1;
        let n = self.stats.copies;
        if self.faults.fail_copy_at == Some(n) {
            return Err(self.err(
                op_name,
                DeviceErrorKind::TransferFailed,
                format!("injected failure of copy #{n}"),
            ));
        }
        let duration = match engine {
            Engine::D2h => self.profile.d2h_ns(bytes),
            _ => self.profile.h2d_ns(bytes),
        };
        let (op, _, end) = self.enqueue(stream, engine, duration, &op_name)?;
        match engine {
            Engine::H2d => {
                self.stats.h2d_bytes += bytes;
                if let Loc::Device(id) = dst_loc {
                    self.copied
                        .entry(id)
                        .or_default()
                        .insert(dst.offset..dst.offset + bytes);
                }
            }
            Engine::D2h => self.stats.d2h_bytes += bytes,
            _ => {}
        }
        let stream_name = self.streams[stream].name.clone();
        self.observe(
            op,
            src.name,
            src.offset..src.offset + bytes,
            stream_name.clone(),
            Access::Read,
            op_name.clone(),
        );
        self.observe(
            op,
            dst.name,
            dst.offset..dst.offset + bytes,
            stream_name,
            Access::Write,
            op_name,
        );
        self.schedule(
            end,
            Effect::Copy {
                src: src_loc,
                src_offset: src.offset,
                dst: dst_loc,
                dst_offset: dst.offset,
                bytes,
            },
        );
        Ok(())
    }

    fn dev_name(&self, id: u64) -> String {
        self.device
            .get(&id)
            .map(|b| b.name.clone())
            .unwrap_or_else(|| format!("device#{id}"))
    }

    fn dev_end(&self, buffer: &SimDeviceBuffer, offset: u64) -> (End, Loc) {
        (
            End {
                name: self.dev_name(buffer.id),
                offset,
                len: buffer.len,
            },
            Loc::Device(buffer.id),
        )
    }

    fn check_range(
        &self,
        op: &str,
        what: &str,
        offset: u64,
        bytes: u64,
        len: u64,
    ) -> Result<(), SimError> {
        if offset.checked_add(bytes).is_none_or(|end| end > len) {
            return Err(self.err(
                op,
                DeviceErrorKind::Other,
                format!(
                    "{what} range {offset}..{} exceeds its {len} bytes",
                    offset.saturating_add(bytes)
                ),
            ));
        }
        Ok(())
    }

    fn count_allocation(&mut self, what: &str) -> Result<(), SimError> {
        self.host_tick();
        self.stats.allocations += 1;
        let n = self.stats.allocations;
        if self.faults.fail_alloc_at == Some(n) {
            return Err(self.err(
                what,
                DeviceErrorKind::OutOfMemory,
                format!("injected failure of allocation #{n}"),
            ));
        }
        Ok(())
    }

    /// A request to pin host memory: an allocation (counted), refused by
    /// the `refuse_pin_every` fault on every N-th such request.
    fn count_pin_request(&mut self, what: &str) -> Result<(), SimError> {
        self.stats.pin_requests += 1;
        if let Err(e) = self.count_allocation(what) {
            self.stats.pins_refused += 1;
            return Err(e);
        }
        let n = self.stats.pin_requests;
        let injected = match (self.faults.refuse_pins, self.faults.refuse_pin_every) {
            (Some((first, last)), _) if (first..=last).contains(&n) => {
                format!("pin requests {first} to {last}")
            }
            (_, Some(every)) if every > 0 && n.is_multiple_of(every) => {
                format!("every {every}th pin request")
            }
            _ => return Ok(()),
        };
        self.stats.pins_refused += 1;
        Err(self.err(
            what,
            DeviceErrorKind::Other,
            format!("pinning refused (injected: {injected}; this is #{n})"),
        ))
    }

    fn new_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn unregister(&mut self, id: u64, len: u64, what: &str) {
        self.host_access(registered_name(id), 0..len, Access::Free, what);
        if self.registered.remove(&id).is_some() {
            self.stats.registered_bytes -= len;
            match self.registration_mapping.remove(&id) {
                Some(at) => {
                    if let Some((bytes, windows)) = self.mappings.get_mut(&at) {
                        *windows -= 1;
                        if *windows == 0 {
                            self.stats.locked_bytes -= *bytes;
                            self.mappings.remove(&at);
                        }
                    }
                }
                None => self.stats.locked_bytes -= len,
            }
        }
    }

    /// `bytes` more page-locked now (a pin or a registration).
    fn lock_more(&mut self, bytes: u64) {
        self.stats.locked_bytes += bytes;
        self.stats.locked_peak_bytes = self.stats.locked_peak_bytes.max(self.stats.locked_bytes);
        self.note_counted();
    }

    /// What the allocator holds for `bytes` in use: rounded up to its
    /// chunk where it maps chunks.
    fn reserved_for(&self, bytes: u64) -> u64 {
        match self.profile.allocation_chunk_bytes {
            0 => bytes,
            c => bytes.div_ceil(c).saturating_mul(c),
        }
    }

    /// The page tables of what is page-locked now.
    fn mapping_bytes(&self) -> u64 {
        match self.profile.host_mapping_divisor {
            0 => 0,
            // Page tables map what is locked: a registered window of a
            // larger mapping maps that whole mapping, once.
            d => self.stats.locked_bytes / d,
        }
    }

    /// The device's own count of memory in use (its free memory's
    /// complement, less nothing of others'): the allocator's holding and
    /// the page tables.
    fn counted_bytes(&self) -> u64 {
        self.reserved_for(self.stats.device_bytes + self.stats.activation_bytes)
            .saturating_add(self.mapping_bytes())
    }

    /// Raises the window's peak of [`Self::counted_bytes`].
    fn note_counted(&mut self) {
        let c = self.counted_bytes();
        self.stats.window_counted_peak_bytes = self.stats.window_counted_peak_bytes.max(c);
    }
}

/// A simulated GPU. Cloning shares the device.
#[derive(Clone, Debug)]
pub struct SimDevice {
    shared: Arc<Mutex<State>>,
}

/// How to build a [`SimDevice`].
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The physics.
    pub profile: DeviceProfile,
    /// Keep one byte in `payload_divisor` (a power of two; 1 keeps all).
    pub payload_divisor: u64,
    /// Faults to inject.
    pub faults: FaultPlan,
    /// Seeded delays that widen race windows (none by default).
    pub jitter: Option<Jitter>,
    /// Whether strategies may run host work on threads of their own
    /// ([`Device::host_worker_threads`]: the staging filler, CONTRACT §7c).
    /// Off by default, so that a seed replays one interleaving; on, the
    /// filler thread's accesses are checked like the caller's (one host
    /// clock), and timings depend on the scheduler.
    pub host_threads: bool,
    /// Whether copies may read pageable host memory where it lies
    /// ([`Device::reads_pageable`], `HostSource::Pageable`): a GPU with
    /// pageable memory access (HMM, ATS). Such a copy runs on the copy
    /// engine at the profile's host→device rate, takes no host time, and
    /// is checked: a region dropped before its copy ran is an INV-3
    /// violation. Off by default (such a copy is then a typed error).
    pub pageable_reads: bool,
}

impl SimConfig {
    /// Exact payloads, no faults, no jitter. Every byte of every buffer is
    /// kept in host memory: right for small pipelines (tests, `tiny`); a
    /// real model needs [`Self::sampled`].
    pub fn exact(profile: DeviceProfile) -> Self {
        Self {
            profile,
            payload_divisor: 1,
            faults: FaultPlan::none(),
            jitter: None,
            host_threads: false,
            pageable_reads: false,
        }
    }

    /// One payload byte kept in `divisor` (a power of two): sizes, offsets,
    /// timing and accounting stay exact, host memory shrinks `divisor`-fold.
    pub fn sampled(profile: DeviceProfile, divisor: u64) -> Self {
        Self {
            payload_divisor: divisor,
            ..Self::exact(profile)
        }
    }
}

impl SimDevice {
    /// A new device. A payload divisor that is not a power of two is an
    /// error.
    pub fn new(config: SimConfig) -> Result<Self, SimError> {
        if !config.payload_divisor.is_power_of_two() {
            return Err(SimError {
                operation: "SimDevice::new".to_owned(),
                kind: DeviceErrorKind::Other,
                detail: format!(
                    "payload divisor {} is not a power of two",
                    config.payload_divisor
                ),
                shortfall_bytes: None,
            });
        }
        let mut default_stream = StreamState {
            name: "host".to_owned(),
            tail_ns: 0,
            clock: VectorClock::new(1),
            waited_ns: 0,
        };
        default_stream.clock.tick(HOST);
        Ok(Self {
            shared: Arc::new(Mutex::new(State {
                profile: config.profile,
                divisor: config.payload_divisor,
                host_threads: config.host_threads,
                pageable_reads: config.pageable_reads,
                pageable: BTreeMap::new(),
                host_now_ns: 0,
                host_clock: VectorClock::new(1),
                streams: vec![default_stream],
                events: Vec::new(),
                device: BTreeMap::new(),
                pinned: BTreeMap::new(),
                registered: BTreeMap::new(),
                accumulators: Vec::new(),
                pending: BTreeMap::new(),
                next_id: 1,
                next_seq: 0,
                engines: [0; 5],
                decode_windows: std::collections::VecDeque::new(),
                op_clocks: Vec::new(),
                checker: BufferOrderChecker::new(),
                violations: Vec::new(),
                faults: config.faults,
                lost: false,
                mappings: BTreeMap::new(),
                registration_mapping: BTreeMap::new(),
                jitter: config.jitter.map(|j| (j, j.seed)),
                collectives: 0,
                copied: BTreeMap::new(),
                stats: SimStats::default(),
                trace: Trace::default(),
            })),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.shared)
    }

    /// The profile.
    pub fn profile(&self) -> DeviceProfile {
        self.state().profile.clone()
    }

    /// Host time now, ns.
    pub fn host_now_ns(&self) -> u64 {
        self.state().host_now_ns
    }

    /// The simulated time at which `event`'s capture completes (as
    /// `cudaEventElapsedTime` reads a timed event; the host need not wait).
    pub fn event_time_ns(&self, event: &SimEvent) -> u64 {
        self.state().events[event.index].time_ns
    }

    /// Blocks the host until every stream is idle and every pending effect
    /// has landed (a context synchronisation); returns the time, ns. Tests
    /// of the device itself use it; the harness synchronises only where a
    /// runtime would.
    pub fn synchronize_all(&self) -> u64 {
        let mut st = self.state();
        st.synchronize_device();
        st.host_now_ns
    }

    /// Every violation the checker saw, in order.
    pub fn violations(&self) -> Vec<Violation> {
        self.state().violations.clone()
    }

    /// Allocates `bytes` of a runtime's activations (scratch beside the
    /// weights: what a forward needs while it runs). The device counts them
    /// apart from the weights ([`SimStats::activation_bytes`]; INV-7's
    /// bounds count weights only), in its free memory and its total peak;
    /// free them with [`Device::free_device`].
    pub fn alloc_activations(&self, bytes: u64) -> Result<SimDeviceBuffer, SimError> {
        self.alloc(bytes, true)
    }

    fn alloc(&self, bytes: u64, activation: bool) -> Result<SimDeviceBuffer, SimError> {
        let mut st = self.state();
        let what = if activation {
            format!("alloc_activations({bytes} bytes)")
        } else {
            format!("alloc_device({bytes} bytes)")
        };
        st.count_allocation(&what)?;
        let capacity = st.profile.memory_bytes;
        let used = st.stats.device_bytes + st.stats.activation_bytes;
        if used.saturating_add(bytes) > capacity {
            let detail = format!("{used} of {capacity} bytes in use");
            let mut e = st.err(what, DeviceErrorKind::OutOfMemory, detail);
            e.shortfall_bytes = Some(used.saturating_add(bytes) - capacity);
            return Err(e);
        }
        let id = st.new_id();
        let real = bytes.div_ceil(st.divisor) as usize;
        st.device.insert(
            id,
            DevBuf {
                name: format!("device#{id}"),
                len: bytes,
                live: true,
                mem: Some(vec![0u8; real]),
                activation,
            },
        );
        st.checker.forget(&format!("device#{id}"));
        if activation {
            st.stats.activation_bytes += bytes;
            st.stats.activation_peak_bytes = st
                .stats
                .activation_peak_bytes
                .max(st.stats.activation_bytes);
        } else {
            st.stats.device_bytes += bytes;
            st.stats.device_peak_bytes = st.stats.device_peak_bytes.max(st.stats.device_bytes);
        }
        let total = st.stats.device_bytes + st.stats.activation_bytes;
        st.stats.total_peak_bytes = st.stats.total_peak_bytes.max(total);
        st.stats.window_total_peak_bytes = st.stats.window_total_peak_bytes.max(total);
        st.stats.window_weight_peak_bytes =
            st.stats.window_weight_peak_bytes.max(st.stats.device_bytes);
        st.note_counted();
        Ok(SimDeviceBuffer {
            id,
            len: bytes,
            freed: false,
            shared: Arc::clone(&self.shared),
        })
    }

    /// The peaks (weights; everything) since the last call, and a new
    /// window from the memory in use now: what a harness reads phase by
    /// phase without disturbing the run's own peaks.
    pub fn take_window(&self) -> (u64, u64) {
        let (weights, total, _) = self.take_window_counted();
        (weights, total)
    }

    /// [`Self::take_window`], and the peak of the device's own count of
    /// memory in use in the window (what its free memory misses: the
    /// allocator's chunks and the page tables beside the allocations).
    pub fn take_window_counted(&self) -> (u64, u64, u64) {
        let mut st = self.state();
        let out = (
            st.stats.window_weight_peak_bytes,
            st.stats.window_total_peak_bytes,
            st.stats.window_counted_peak_bytes,
        );
        st.stats.window_weight_peak_bytes = st.stats.device_bytes;
        st.stats.window_total_peak_bytes = st.stats.device_bytes + st.stats.activation_bytes;
        st.stats.window_counted_peak_bytes = st.counted_bytes();
        out
    }

    /// Counters.
    pub fn stats(&self) -> SimStats {
        let st = self.state();
        st.stats.clone()
    }

    /// Counts one host encode of a unit of `bytes` by this device's codec
    /// ([`SimStats::encodes`]).
    pub(crate) fn note_encode(&self, bytes: u64) {
        let mut st = self.state();
        st.stats.encodes += 1;
        st.stats.encoded_bytes += bytes;
    }

    /// Loses the device now: every later host synchronisation fails
    /// (`DeviceLost`), whoever makes it, as on a GPU that fell off the bus;
    /// unlike [`FaultPlan::fail_sync_at`], independent of how many
    /// synchronisations a host thread of the backend made before.
    pub fn lose(&self) {
        self.state().lost = true;
    }

    /// Resets the peaks to the current use (to measure one phase).
    pub fn reset_peak(&self) {
        let mut st = self.state();
        st.stats.device_peak_bytes = st.stats.device_bytes;
        st.stats.activation_peak_bytes = st.stats.activation_bytes;
        st.stats.total_peak_bytes = st.stats.device_bytes + st.stats.activation_bytes;
        st.stats.pinned_peak_bytes = st.stats.pinned_bytes;
        st.stats.registered_peak_bytes = st.stats.registered_bytes;
        st.stats.locked_peak_bytes = st.stats.locked_bytes;
    }

    /// Nanoseconds `stream` waited on events beyond its own work so far.
    pub fn waited_ns(&self, stream: &SimStream) -> u64 {
        self.state().streams[stream.index].waited_ns
    }

    /// Device buffers still allocated, by name.
    pub fn live_device_buffers(&self) -> Vec<String> {
        self.state()
            .device
            .values()
            .filter(|b| b.live)
            .map(|b| b.name.clone())
            .collect()
    }

    /// Every pinned and registered host allocation with its bytes, as the
    /// device holds them now (INV-2 reads host masters from here, not from
    /// a strategy's report).
    pub fn host_allocations(&self) -> Vec<HostAllocation> {
        let mut st = self.state();
        let now = st.host_now_ns;
        st.settle(now);
        st.pinned
            .iter()
            .map(|(id, m)| (host_name(*id), m))
            .chain(
                st.registered
                    .iter()
                    .map(|(id, m)| (registered_name(*id), m)),
            )
            .map(|(name, m)| HostAllocation {
                name,
                bytes: m.mem.clone(),
            })
            .collect()
    }

    /// Reports a leak (INV-7) for every device buffer, pinned buffer or
    /// registration still alive; call after `disable`.
    pub fn check_released(&self) -> usize {
        let mut st = self.state();
        let mut leaks: Vec<String> = st
            .device
            .values()
            .filter(|b| b.live)
            .map(|b| format!("device buffer `{}` ({} bytes)", b.name, b.len))
            .collect();
        leaks.extend(
            st.pinned
                .iter()
                .map(|(id, m)| format!("pinned buffer #{id} ({} bytes)", m.len)),
        );
        leaks.extend(
            st.registered
                .iter()
                .map(|(id, m)| format!("registration #{id} ({} bytes)", m.len)),
        );
        for leak in &leaks {
            st.record_violation(
                Invariant::BoundedMemory,
                format!("{leak} still allocated after disable"),
            );
        }
        leaks.len()
    }

    /// The trace so far.
    pub fn trace(&self) -> Trace {
        self.state().trace.clone()
    }

    /// A new accumulator, set to zero.
    pub fn create_accumulator(&self) -> SimAccumulator {
        let mut st = self.state();
        st.accumulators.push(0);
        SimAccumulator {
            index: st.accumulators.len() - 1,
        }
    }

    /// The host reads `accumulator`: a host access, so it must be ordered
    /// after the kernels that wrote it (synchronise the stream first, as a
    /// runtime reading its output does), else the checker reports it and
    /// the value read is whatever has landed by the host's clock.
    pub fn read_accumulator(&self, accumulator: &SimAccumulator) -> u64 {
        let mut st = self.state();
        st.host_access(
            accumulator_name(accumulator.index),
            0..8,
            Access::Read,
            "host read of an accumulator",
        );
        st.accumulators[accumulator.index]
    }

    /// Sets `accumulator` to zero on `stream` (a device memset: ordered
    /// after the stream's earlier work, no host synchronisation).
    pub fn reset_accumulator(
        &self,
        stream: &SimStream,
        accumulator: &SimAccumulator,
    ) -> Result<(), SimError> {
        let mut st = self.state();
        let (op, start, _) = st.enqueue(stream.index, Engine::Compute, 0, "reset output")?;
        let stream_name = st.streams[stream.index].name.clone();
        st.observe(
            op,
            accumulator_name(accumulator.index),
            0..8,
            stream_name,
            Access::Write,
            "reset output".to_owned(),
        );
        st.schedule(
            start,
            Effect::Reset {
                accumulator: accumulator.index,
            },
        );
        Ok(())
    }

    /// A kernel on `stream` that reads `inputs` (buffer, byte range) when it
    /// starts and costs `flops` at the profile's peak rate
    /// ([`DeviceProfile::compute_ns`]); otherwise as [`Self::compute_for`].
    pub fn compute(
        &self,
        stream: &SimStream,
        inputs: &[(&SimDeviceBuffer, Range<u64>)],
        flops: f64,
        name: &str,
        accumulator: &SimAccumulator,
    ) -> Result<(), SimError> {
        let duration_ns = self.state().profile.compute_ns(flops);
        self.compute_for(stream, inputs, duration_ns, name, accumulator)
    }

    /// A kernel on `stream` that reads `inputs` (buffer, byte range) when it
    /// starts and runs for `duration_ns` (a duration the caller's model
    /// computed, e.g. [`DeviceProfile::work_ns`]); it folds a checksum of
    /// every byte it read (value and position within its range) into
    /// `accumulator`, so a run that read other bytes, or ran kernels in
    /// another order, ends with another value.
    pub fn compute_for(
        &self,
        stream: &SimStream,
        inputs: &[(&SimDeviceBuffer, Range<u64>)],
        duration_ns: u64,
        name: &str,
        accumulator: &SimAccumulator,
    ) -> Result<(), SimError> {
        let mut st = self.state();
        for (buf, range) in inputs {
            if range.start > range.end {
                return Err(st.err(
                    format!("compute `{name}`"),
                    DeviceErrorKind::Other,
                    format!("input range {range:?} is reversed"),
                ));
            }
            st.check_range(
                &format!("compute `{name}`"),
                "input",
                range.start,
                range.end - range.start,
                buf.len,
            )?;
        }
        // A kernel that starts while a host→device copy runs is slowed by
        // the copy's memory traffic (the profile's `copy_interference`).
        let start = st.enqueue_start(stream.index, Engine::Compute, duration_ns, name)?;
        // For the part of it the copy engine is still busy.
        let copying = st.engines[Engine::H2d as usize].saturating_sub(start);
        let duration_ns = if copying > 0 {
            let k = st.profile.copy_interference;
            let overlap = copying.min(duration_ns) as f64;
            (duration_ns as f64 + overlap * k).round() as u64
        } else {
            duration_ns
        };
        // And by a decode beside it, for the part of it a decode runs.
        let end_nominal = start.saturating_add(duration_ns);
        let decoding: u64 = st
            .decode_windows
            .iter()
            .map(|&(s, e)| e.min(end_nominal).saturating_sub(s.max(start)))
            .sum();
        let duration_ns = if decoding > 0 {
            let k = st.profile.decode_interference;
            (duration_ns as f64 + decoding.min(duration_ns) as f64 * k).round() as u64
        } else {
            duration_ns
        };
        let end = start
            .checked_add(duration_ns)
            .ok_or_else(|| st.overflow(name, duration_ns))?;
        let op = st.enqueue_commit(stream.index, Engine::Compute, start, end, name);
        st.stats.kernels += 1;
        let stream_name = st.streams[stream.index].name.clone();
        for (buf, range) in inputs {
            let bname = st.dev_name(buf.id);
            st.observe(
                op,
                bname,
                range.clone(),
                stream_name.clone(),
                Access::Read,
                name.to_owned(),
            );
        }
        st.observe(
            op,
            accumulator_name(accumulator.index),
            0..8,
            stream_name,
            Access::Write,
            name.to_owned(),
        );
        let inputs = inputs
            .iter()
            .map(|(b, r)| (b.id, r.clone()))
            .collect::<Vec<_>>();
        st.schedule(
            start,
            Effect::Kernel {
                inputs,
                accumulator: accumulator.index,
            },
        );
        Ok(())
    }
}

impl Device<Sim> for SimDevice {
    fn alloc_device(&self, bytes: u64) -> Result<SimDeviceBuffer, SimError> {
        self.alloc(bytes, false)
    }

    unsafe fn free_device(
        &self,
        mut buffer: SimDeviceBuffer,
        after: &[&SimEvent],
    ) -> Result<(), SimError> {
        buffer.freed = true;
        let mut st = self.state();
        // The free is an operation on a private stream that waits for `after`.
        let mut clock = st.host_clock.clone();
        let mut at = 0;
        for e in after {
            let event = st.events[e.index].clone();
            clock.join(&event.clock);
            at = at.max(event.time_ns);
        }
        st.host_tick();
        clock.join(&st.host_clock);
        st.op_clocks.push(clock);
        let op = st.op_clocks.len() - 1;
        let name = st.dev_name(buffer.id);
        st.observe(
            op,
            name.clone(),
            0..buffer.len,
            "free".to_owned(),
            Access::Free,
            format!("free {name}"),
        );
        let at = at.max(st.host_now_ns);
        st.copied.remove(&buffer.id);
        match st.device.get_mut(&buffer.id) {
            Some(b) if b.live => {
                // The memory goes when the device reaches the free; until
                // then work already enqueued may still use it.
                b.live = false;
                if b.activation {
                    st.stats.activation_bytes -= buffer.len;
                } else {
                    st.stats.device_bytes -= buffer.len;
                }
                st.schedule(at, Effect::Free { id: buffer.id });
                Ok(())
            }
            _ => Err(st.err(
                "free_device",
                DeviceErrorKind::Other,
                format!("{name} is not allocated"),
            )),
        }
    }

    fn alloc_pinned(&self, bytes: u64) -> Result<SimHostBuffer, SimError> {
        let mut st = self.state();
        st.count_pin_request(&format!("alloc_pinned({bytes} bytes)"))?;
        let id = st.new_id();
        let divisor = st.divisor;
        st.pinned.insert(
            id,
            HostMem {
                len: bytes,
                mem: vec![0u8; bytes.div_ceil(divisor) as usize],
            },
        );
        st.stats.pinned_bytes += bytes;
        st.stats.pinned_peak_bytes = st.stats.pinned_peak_bytes.max(st.stats.pinned_bytes);
        st.lock_more(bytes);
        st.checker.forget(&host_name(id));
        Ok(SimHostBuffer {
            id,
            len: bytes,
            freed: false,
            shared: Arc::clone(&self.shared),
        })
    }

    unsafe fn free_pinned(&self, mut buffer: SimHostBuffer) -> Result<(), SimError> {
        buffer.freed = true;
        let mut st = self.state();
        st.host_access(
            host_name(buffer.id),
            0..buffer.len,
            Access::Free,
            "free_pinned",
        );
        if st.pinned.remove(&buffer.id).is_some() {
            st.stats.pinned_bytes -= buffer.len;
            st.stats.locked_bytes -= buffer.len;
        }
        Ok(())
    }

    fn register_host(
        &self,
        region: Box<dyn HostRegion>,
    ) -> Result<SimRegistration, RegisterError<Sim>> {
        let mut st = self.state();
        if let Err(error) = st.count_pin_request("register_host") {
            return Err(RegisterError { error, region });
        }
        let id = st.new_id();
        // The address and length are captured once, here.
        let bytes = region.bytes();
        let len = bytes.len() as u64;
        let d = st.divisor as usize;
        let mem: Vec<u8> = bytes.iter().step_by(d).copied().collect();
        st.registered.insert(id, HostMem { len, mem });
        st.stats.registered_bytes += len;
        match region.enclosing() {
            Some(mapping) => {
                let at = mapping.as_ptr() as usize;
                st.registration_mapping.insert(id, at);
                let entry = st.mappings.entry(at).or_insert((mapping.len() as u64, 0));
                entry.1 += 1;
                if entry.1 == 1 {
                    let whole = entry.0;
                    st.lock_more(whole);
                }
            }
            None => st.lock_more(len),
        }
        st.stats.registered_peak_bytes = st
            .stats
            .registered_peak_bytes
            .max(st.stats.registered_bytes);
        st.checker.forget(&registered_name(id));
        Ok(SimRegistration {
            id,
            len,
            region: Some(region),
            shared: Arc::clone(&self.shared),
        })
    }

    unsafe fn unregister_host(
        &self,
        mut registration: SimRegistration,
    ) -> Result<Box<dyn HostRegion>, SimError> {
        let region = registration.region.take().expect("registered");
        let mut st = self.state();
        st.unregister(registration.id, registration.len, "unregister_host");
        Ok(region)
    }

    fn memory_info(&self) -> Result<MemoryInfo, SimError> {
        let st = self.state();
        Ok(MemoryInfo {
            free_bytes: st.profile.memory_bytes.saturating_sub(st.counted_bytes()),
            total_bytes: st.profile.memory_bytes,
        })
    }

    fn memory_peak(&self) -> Result<Option<u64>, SimError> {
        Ok(Some(self.state().stats.total_peak_bytes))
    }

    fn memory_reserved_peak(&self) -> Result<Option<u64>, SimError> {
        let st = self.state();
        Ok((st.profile.allocation_chunk_bytes > 0)
            .then(|| st.reserved_for(st.stats.total_peak_bytes)))
    }

    fn allocation_chunk(&self) -> u64 {
        self.state().profile.allocation_chunk_bytes.max(1)
    }

    fn host_page_table_bytes(&self, locked: u64) -> u64 {
        match self.state().profile.host_mapping_divisor {
            0 => 0,
            d => locked.div_ceil(d),
        }
    }

    fn reset_memory_peak(&self) -> Result<(), SimError> {
        let mut st = self.state();
        st.stats.total_peak_bytes = st.stats.device_bytes + st.stats.activation_bytes;
        Ok(())
    }

    fn elapsed_ns(&self, from: &SimEvent, to: &SimEvent) -> Result<u64, SimError> {
        let st = self.state();
        let (a, b) = (&st.events[from.index], &st.events[to.index]);
        Ok(b.time_ns.saturating_sub(a.time_ns))
    }

    fn name_stream(&self, stream: &SimStream, name: &str) {
        self.state().streams[stream.index].name = name.to_owned();
    }

    fn name_buffer(&self, buffer: &SimDeviceBuffer, name: &str) {
        let mut st = self.state();
        let old = st.dev_name(buffer.id);
        let new = format!("{name}#{}", buffer.id);
        st.checker.forget(&old);
        if let Some(b) = st.device.get_mut(&buffer.id) {
            b.name = new;
        }
    }

    /// [`SimConfig::host_threads`]: off by default (the simulated host is
    /// one clock; host work stays on the caller's thread, so that a seed
    /// replays the same interleaving).
    fn host_worker_threads(&self) -> bool {
        self.state().host_threads
    }

    fn reads_pageable(&self) -> bool {
        self.state().pageable_reads
    }

    /// A staging fill on the caller's thread takes the host `bytes` at the
    /// profile's `host_fill_gbps` (bytes per ns): the one host clock moves
    /// on by it. With [`SimConfig::host_threads`] the filler is a thread of
    /// its own, whose time this clock does not keep: nothing.
    fn host_filled(&self, bytes: u64) {
        let mut st = self.state();
        st.stats.host_filled_bytes = st.stats.host_filled_bytes.saturating_add(bytes);
        let gbps = st.profile.host_fill_gbps;
        if st.host_threads || !gbps.is_finite() || gbps <= 0.0 {
            return;
        }
        let ns = (bytes as f64 / gbps).min(u64::MAX as f64) as u64;
        st.host_spend(ns);
    }

    /// The simulated host's one clock moves on by
    /// [`offload_core::device::HOST_PAUSE_US`].
    fn host_pause(&self) {
        self.state()
            .host_spend(offload_core::device::HOST_PAUSE_US * 1_000);
    }

    fn create_stream(&self) -> Result<SimStream, SimError> {
        let mut st = self.state();
        st.host_tick();
        let index = st.streams.len();
        let mut clock = st.host_clock.clone();
        clock.tick(index);
        st.streams.push(StreamState {
            name: format!("stream {index}"),
            tail_ns: 0,
            clock,
            waited_ns: 0,
        });
        Ok(SimStream { index })
    }

    fn create_event(&self) -> Result<SimEvent, SimError> {
        let mut st = self.state();
        st.events.push(EventState::default());
        Ok(SimEvent {
            index: st.events.len() - 1,
        })
    }

    fn record_event(&self, event: &SimEvent, stream: &SimStream) -> Result<(), SimError> {
        let mut st = self.state();
        st.host_tick();
        let s = &st.streams[stream.index];
        let recorded = EventState {
            time_ns: s.tail_ns.max(st.host_now_ns),
            clock: s.clock.clone(),
        };
        st.events[event.index] = recorded;
        Ok(())
    }

    fn stream_wait_event(&self, stream: &SimStream, event: &SimEvent) -> Result<(), SimError> {
        let mut st = self.state();
        st.host_tick();
        let e = st.events[event.index].clone();
        let host_now = st.host_now_ns;
        let s = &mut st.streams[stream.index];
        let ready = s.tail_ns.max(host_now);
        if e.time_ns > ready {
            s.waited_ns += e.time_ns - ready;
        }
        s.tail_ns = s.tail_ns.max(e.time_ns);
        s.clock.join(&e.clock);
        Ok(())
    }

    fn event_done(&self, event: &SimEvent) -> Result<bool, SimError> {
        let mut st = self.state();
        st.host_tick();
        let e = st.events[event.index].clone();
        let done = e.time_ns <= st.host_now_ns;
        if done {
            st.host_clock.join(&e.clock);
            let now = st.host_now_ns;
            st.settle(now);
        }
        Ok(done)
    }

    fn synchronize_event(&self, event: &SimEvent) -> Result<(), SimError> {
        let mut st = self.state();
        st.host_tick();
        st.sync_fault("synchronize_event")?;
        let e = st.events[event.index].clone();
        st.host_now_ns = st.host_now_ns.max(e.time_ns);
        st.host_clock.join(&e.clock);
        let now = st.host_now_ns;
        st.settle(now);
        Ok(())
    }

    fn synchronize_stream(&self, stream: &SimStream) -> Result<(), SimError> {
        let mut st = self.state();
        st.host_tick();
        st.sync_fault("synchronize_stream")?;
        let s = &st.streams[stream.index];
        let (tail, clock) = (s.tail_ns, s.clock.clone());
        st.host_now_ns = st.host_now_ns.max(tail);
        st.host_clock.join(&clock);
        let now = st.host_now_ns;
        st.settle(now);
        Ok(())
    }

    unsafe fn copy_h2d(
        &self,
        stream: &SimStream,
        src: HostSource<'_, Sim>,
        src_offset: u64,
        dst: &SimDeviceBuffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), SimError> {
        let mut st = self.state();
        let (name, len, loc) = match &src {
            HostSource::Pinned(b) => (host_name(b.id), b.len, Loc::Pinned(b.id)),
            HostSource::Registered(r) => (registered_name(r.id), r.len, Loc::Registered(r.id)),
            HostSource::Pageable(region) => st.pageable_source(region)?,
        };
        let source = End {
            name,
            offset: src_offset,
            len,
        };
        let dest = st.dev_end(dst, dst_offset);
        st.transfer(stream.index, Engine::H2d, (source, loc), dest, bytes)
    }

    unsafe fn copy_d2h(
        &self,
        stream: &SimStream,
        src: &SimDeviceBuffer,
        src_offset: u64,
        dst: &mut SimHostBuffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), SimError> {
        let mut st = self.state();
        let source = st.dev_end(src, src_offset);
        let dest = End {
            name: host_name(dst.id),
            offset: dst_offset,
            len: dst.len,
        };
        st.transfer(
            stream.index,
            Engine::D2h,
            source,
            (dest, Loc::Pinned(dst.id)),
            bytes,
        )
    }
}

/// One rank's all-gather as the collective group hands it to that rank's
/// device (`crate::collective`).
pub(crate) struct GatherCall<'a> {
    pub(crate) stream: &'a SimStream,
    pub(crate) shard: &'a SimDeviceBuffer,
    pub(crate) shard_offset: u64,
    pub(crate) shard_bytes: u64,
    pub(crate) dst: &'a SimDeviceBuffer,
    pub(crate) dst_offset: u64,
    /// The group size G.
    pub(crate) ranks: u32,
    /// The collective's number on this rank (1-based).
    pub(crate) n: u64,
}

/// What a rank brings to a collective: its earliest start, the link time
/// its profile gives, and its shard bytes as they are at that start.
#[derive(Debug)]
pub(crate) struct GatherEntry {
    pub(crate) start_ns: u64,
    pub(crate) link_ns: u64,
    /// The kept bytes of the shard range at `start_ns`.
    pub(crate) contribution: Vec<u8>,
}

impl GatherCall<'_> {
    fn name(&self, st: &State) -> String {
        format!(
            "all_gather #{} {} → {}",
            self.n,
            st.dev_name(self.shard.id),
            st.dev_name(self.dst.id)
        )
    }

    /// `G × shard_bytes`, the destination bytes written.
    fn total(&self) -> Option<u64> {
        self.shard_bytes.checked_mul(u64::from(self.ranks))
    }
}

impl SimDevice {
    /// The first half of one rank's all-gather: checks the call (typed
    /// errors, nothing enqueued), counts it for fault injection, lets the
    /// host issue it (its clock ticks, the jitter draws), and returns the
    /// rank's entry. Its contribution is the shard range as it will be at
    /// the start: the pending effects due by then applied to a scratch copy.
    pub(crate) fn gather_enter(&self, call: &GatherCall<'_>) -> Result<GatherEntry, SimError> {
        let mut st = self.state();
        let name = call.name(&st);
        for (what, buffer) in [("shard", call.shard), ("destination", call.dst)] {
            if !Arc::ptr_eq(&buffer.shared, &self.shared) {
                return Err(st.err(
                    name,
                    DeviceErrorKind::Other,
                    format!("the {what} buffer belongs to another device"),
                ));
            }
        }
        let Some(total) = call.total() else {
            return Err(st.err(
                name,
                DeviceErrorKind::Other,
                format!(
                    "{} ranks × {} bytes overflows 64 bits",
                    call.ranks, call.shard_bytes
                ),
            ));
        };
        st.check_range(
            &name,
            "shard",
            call.shard_offset,
            call.shard_bytes,
            call.shard.len,
        )?;
        st.check_range(&name, "destination", call.dst_offset, total, call.dst.len)?;
        let d = st.divisor;
        if d > 1
            && (call.shard_offset % d != call.dst_offset % d
                || (call.ranks > 1 && !call.shard_bytes.is_multiple_of(d)))
        {
            return Err(st.err(
                name,
                DeviceErrorKind::Other,
                format!(
                    "sampled payloads need shard and destination offsets equal modulo {d} and, with more than one rank, shard bytes a multiple of {d}"
                ),
            ));
        }
        st.collectives += 1;
        let k = st.collectives;
        if st.faults.fail_collective_at == Some(k) {
            return Err(st.err(
                name,
                DeviceErrorKind::TransferFailed,
                format!("injected failure of collective #{k}"),
            ));
        }
        let link_ns = st.profile.all_gather_ns(call.ranks, call.shard_bytes);
        let start_ns = st.enqueue_start(call.stream.index, Engine::Collective, link_ns, &name)?;
        if start_ns.checked_add(link_ns).is_none() {
            return Err(st.overflow(&name, link_ns));
        }
        let range = call.shard_offset..call.shard_offset + call.shard_bytes;
        let contribution = st.bytes_at(Loc::Device(call.shard.id), range, start_ns);
        Ok(GatherEntry {
            start_ns,
            link_ns,
            contribution,
        })
    }

    /// The second half, once every rank entered: the gather occupies the
    /// stream and the collective engine from this rank's `start_ns` to the
    /// group's `end_ns`; it reads the shard range and writes the destination
    /// range (INV-3, with the stream's clock); the shard range must have been
    /// filled by host→device copies since it was last gathered (INV-9); the
    /// assembled `data` (kept bytes of the destination range) lands at
    /// `end_ns`.
    pub(crate) fn gather_land(
        &self,
        call: &GatherCall<'_>,
        start_ns: u64,
        end_ns: u64,
        data: Vec<u8>,
    ) {
        let mut st = self.state();
        let name = call.name(&st);
        let total = call.total().unwrap_or(u64::MAX);
        let end_ns = end_ns.max(start_ns);
        let op = st.enqueue_commit(
            call.stream.index,
            Engine::Collective,
            start_ns,
            end_ns,
            &name,
        );
        let stream_name = st.streams[call.stream.index].name.clone();
        let shard_name = st.dev_name(call.shard.id);
        let dst_name = st.dev_name(call.dst.id);
        let read = call.shard_offset..call.shard_offset + call.shard_bytes;
        st.observe(
            op,
            shard_name.clone(),
            read.clone(),
            stream_name.clone(),
            Access::Read,
            name.clone(),
        );
        st.observe(
            op,
            dst_name,
            call.dst_offset..call.dst_offset.saturating_add(total),
            stream_name,
            Access::Write,
            name.clone(),
        );
        let copied = st.copied.entry(call.shard.id).or_default();
        let gap = copied.first_gap(read.clone());
        copied.remove(read.clone());
        if let Some(gap) = gap {
            st.record_violation(
                Invariant::CollectiveAgreement,
                format!(
                    "`{name}`: a gather of {} bytes reads shard bytes {}..{} that no copy wrote since the last gather: a gather wider than its block?",
                    call.shard_bytes, gap.start, gap.end
                ),
            );
        }
        st.schedule(
            end_ns,
            Effect::Gather {
                dst: call.dst.id,
                dst_offset: call.dst_offset,
                len: total,
                data,
            },
        );
    }

    /// A lossless decode on `stream` (CONTRACT §7b): reads
    /// `src[..coded_bytes]` when it starts and writes `dst[..decoded_bytes]`
    /// when it ends (INV-3 checks both, with the stream's clock); runs on
    /// the decode engine for the profile's `decode_ns`. At its start
    /// (simulated time: copies that land before it are seen, whenever
    /// they were issued), `decode` turns the kept bytes `src` holds (every
    /// one with no payload divisor) into the kept bytes of the output, or
    /// `None` where they do not decode (counted in `decode_errors`; zeros
    /// land instead).
    pub fn decode(
        &self,
        stream: &SimStream,
        (src, coded_bytes): (&SimDeviceBuffer, u64),
        (dst, decoded_bytes): (&SimDeviceBuffer, u64),
        decode: DecodeFn,
    ) -> Result<(), SimError> {
        let mut st = self.state();
        let name = format!("decode {} → {}", st.dev_name(src.id), st.dev_name(dst.id));
        for (what, buffer) in [("source", src), ("destination", dst)] {
            if !Arc::ptr_eq(&buffer.shared, &self.shared) {
                return Err(st.err(
                    name,
                    DeviceErrorKind::Other,
                    format!("the {what} buffer belongs to another device"),
                ));
            }
        }
        st.check_range(&name, "source", 0, coded_bytes, src.len)?;
        st.check_range(&name, "destination", 0, decoded_bytes, dst.len)?;
        let duration = st.profile.decode_ns(decoded_bytes);
        let (op, start, end) = st.enqueue(stream.index, Engine::Decode, duration, &name)?;
        if st.decode_windows.len() == DECODE_WINDOWS {
            st.decode_windows.pop_front();
        }
        st.decode_windows.push_back((start, end));
        st.stats.decodes += 1;
        st.stats.decoded_bytes += decoded_bytes;
        let stream_name = st.streams[stream.index].name.clone();
        let (src_name, dst_name) = (st.dev_name(src.id), st.dev_name(dst.id));
        st.observe(
            op,
            src_name,
            0..coded_bytes,
            stream_name.clone(),
            Access::Read,
            name.clone(),
        );
        st.observe(
            op,
            dst_name,
            0..decoded_bytes,
            stream_name,
            Access::Write,
            name,
        );
        st.next_seq += 1;
        let landing = (end, st.next_seq);
        st.schedule(
            start,
            Effect::Decode {
                src: src.id,
                coded: coded_bytes,
                dst: dst.id,
                decoded: decoded_bytes,
                end: landing,
                decoder: Decoder(decode),
            },
        );
        Ok(())
    }

    /// Records a violation seen outside this device (by its collective
    /// group).
    pub(crate) fn report(&self, invariant: Invariant, detail: String) {
        self.state().record_violation(invariant, detail);
    }

    /// The payload divisor.
    pub fn payload_divisor(&self) -> u64 {
        self.state().divisor
    }

    /// Whether `other` is this device (a clone of it).
    pub(crate) fn is(&self, other: &SimDevice) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }
}
