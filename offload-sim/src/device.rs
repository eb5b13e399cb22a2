//! The simulated device: a real backend of `offload_core::device`.
//!
//! * **Data.** Every buffer has real memory; copies move bytes and
//!   [`SimDevice::compute`] reads them into a checksum. Effects happen in
//!   the order the host enqueues them. With a payload divisor `d > 1` (for
//!   real-model sizes that do not fit in host memory) a buffer of `n` bytes
//!   keeps one byte in `d` (logical positions `≡ 0 mod d`); sizes, offsets,
//!   timing and accounting stay logical and exact.
//! * **Time.** A virtual clock: every operation runs on its stream after the
//!   stream's previous work, after the events it waits for, after the host
//!   enqueued it, and after earlier work on the same engine (one host→device
//!   copy engine, one device→host copy engine, one compute engine). Durations
//!   come from the [`DeviceProfile`]. The wall clock is never read.
//! * **Order.** A vector clock per stream and one for the host: waits join
//!   event clocks, enqueues join the host clock, host synchronisation joins
//!   the device's. Every access of every buffer goes to core's INV-3 checker
//!   with that happens-before relation, so a missing wait is reported even
//!   when the timing happened to hide it.
//! * **Faults.** A [`FaultPlan`] fails the N-th allocation, copy or
//!   collective.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use offload_core::device::{
    Api, ByteSource, Collective, Device, DeviceBuffer, DeviceError, DeviceErrorKind, HostBuffer,
    HostRegion, HostSource, MemoryInfo, RegisterError, Registration,
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
}

impl DeviceError for SimError {
    fn kind(&self) -> DeviceErrorKind {
        self.kind
    }
}

/// A simulated stream.
#[derive(Debug)]
pub struct SimStream {
    index: usize,
}

/// A simulated event.
#[derive(Debug)]
pub struct SimEvent {
    index: usize,
}

/// Simulated device memory.
#[derive(Debug)]
pub struct SimDeviceBuffer {
    id: u64,
    len: u64,
}

impl SimDeviceBuffer {
    /// The buffer's id (stable within one device).
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl DeviceBuffer for SimDeviceBuffer {
    fn len_bytes(&self) -> u64 {
        self.len
    }
}

/// Simulated pinned host memory. Host reads and writes go through the
/// device's order checker (a staging buffer rewritten while a copy still
/// reads it is reported).
pub struct SimHostBuffer {
    id: u64,
    len: u64,
    mem: Vec<u8>,
    divisor: u64,
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
            offset + len <= self.len,
            "write past the end of a pinned buffer"
        );
        lock(&self.shared).host_access(
            host_name(self.id),
            offset..offset + len,
            Access::Write,
            "host write",
        );
        let d = self.divisor;
        let mut byte = [0u8; 1];
        if d == 1 {
            src.read_at(0, &mut self.mem[offset as usize..(offset + len) as usize]);
            return;
        }
        let mut pos = offset.next_multiple_of(d) - offset;
        for out in &mut self.mem[kept(offset, offset + len, d)] {
            src.read_at(pos, &mut byte);
            *out = byte[0];
            pos += d;
        }
    }

    fn read_into(&self, offset: u64, dst: &mut [u8]) {
        let len = dst.len() as u64;
        assert!(
            offset + len <= self.len,
            "read past the end of a pinned buffer"
        );
        lock(&self.shared).host_access(
            host_name(self.id),
            offset..offset + len,
            Access::Read,
            "host read",
        );
        let d = self.divisor;
        for (i, out) in dst.iter_mut().enumerate() {
            let p = offset + i as u64;
            *out = if p.is_multiple_of(d) {
                self.mem[(p / d) as usize]
            } else {
                0
            };
        }
    }
}

impl Drop for SimHostBuffer {
    fn drop(&mut self) {
        let mut st = lock(&self.shared);
        if st.pinned.remove(&self.id).is_some() {
            st.pinned_bytes -= self.len;
            st.record_violation(Invariant::BoundedMemory, format!(
                "pinned buffer {} ({} bytes) dropped without free_pinned: its copies were never ordered before the free",
                self.id, self.len
            ));
        }
    }
}

/// Caller memory registered in place.
pub struct SimRegistration {
    id: u64,
    region: Box<dyn HostRegion>,
}

impl fmt::Debug for SimRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimRegistration")
            .field("id", &self.id)
            .field("len", &self.region.bytes().len())
            .finish()
    }
}

impl Registration for SimRegistration {
    fn len_bytes(&self) -> u64 {
        self.region.bytes().len() as u64
    }
}

/// One end of a transfer.
struct End {
    name: String,
    offset: u64,
    len: u64,
}

/// The engines whose work serialises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    H2d,
    D2h,
    Compute,
    Collective,
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
    name: String,
    len: u64,
    mem: Vec<u8>,
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
    /// Peak device bytes.
    pub device_peak_bytes: u64,
    /// Pinned host bytes allocated now.
    pub pinned_bytes: u64,
    /// Host bytes registered in place now.
    pub registered_bytes: u64,
    /// Device allocations so far.
    pub allocations: u64,
    /// Copies so far.
    pub copies: u64,
    /// Kernels so far.
    pub kernels: u64,
}

#[derive(Debug)]
struct State {
    profile: DeviceProfile,
    divisor: u64,
    host_now_ns: u64,
    host_clock: VectorClock,
    streams: Vec<StreamState>,
    events: Vec<EventState>,
    device: BTreeMap<u64, DevBuf>,
    pinned: BTreeMap<u64, u64>,
    registered: BTreeMap<u64, u64>,
    next_id: u64,
    engines: [u64; 4],
    op_clocks: Vec<VectorClock>,
    checker: BufferOrderChecker,
    violations: Vec<Violation>,
    faults: FaultPlan,
    collectives: u64,
    stats_h2d: u64,
    stats_d2h: u64,
    device_bytes: u64,
    device_peak: u64,
    pinned_bytes: u64,
    registered_bytes: u64,
    allocations: u64,
    copies: u64,
    kernels: u64,
    trace: Trace,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn host_name(id: u64) -> String {
    format!("pinned#{id}")
}

const HOST: usize = 0;

/// The kept (real) indices of logical bytes `start..end` with divisor `d`:
/// logical positions ≡ 0 mod d, stored at position / d.
fn kept(start: u64, end: u64, d: u64) -> Range<usize> {
    (start.div_ceil(d) as usize)..(end.div_ceil(d) as usize)
}

/// Copies logical `src_off..src_off + bytes` of `src` to `dst_off` of `dst`
/// (offsets congruent modulo `d`).
fn copy_kept(src: &[u8], src_off: u64, dst: &mut [u8], dst_off: u64, bytes: u64, d: u64) {
    let from = kept(src_off, src_off + bytes, d);
    let to = kept(dst_off, dst_off + bytes, d);
    dst[to].copy_from_slice(&src[from]);
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
        }
    }

    fn record_violation(&mut self, invariant: Invariant, detail: String) {
        self.violations.push(Violation { invariant, detail });
    }

    /// The host does something: its clock ticks.
    fn host_tick(&mut self) -> usize {
        self.host_now_ns += (self.profile.launch_overhead_us * 1e3) as u64;
        self.host_clock.tick(HOST);
        self.op_clocks.push(self.host_clock.clone());
        self.op_clocks.len() - 1
    }

    fn host_access(&mut self, buffer: String, range: Range<u64>, access: Access, what: &str) {
        let op = self.host_tick();
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

    /// Enqueues an operation of `duration_ns` on `stream` using `engine`;
    /// returns (op id, start, end).
    fn enqueue(
        &mut self,
        stream: usize,
        engine: Engine,
        duration_ns: u64,
        name: &str,
    ) -> (usize, u64, u64) {
        self.host_tick();
        let s = &mut self.streams[stream];
        s.clock.join(&self.host_clock);
        s.clock.tick(stream);
        let engine_free = &mut self.engines[engine as usize];
        let start = s.tail_ns.max(*engine_free).max(self.host_now_ns);
        let end = start + duration_ns;
        s.tail_ns = end;
        *engine_free = end;
        let clock = s.clock.clone();
        let track = s.name.clone();
        self.op_clocks.push(clock);
        self.trace.push(TraceOp {
            track,
            name: name.to_owned(),
            start_ns: start,
            duration_ns,
        });
        (self.op_clocks.len() - 1, start, end)
    }

    /// Checks, counts (for fault injection), schedules and records one
    /// transfer of `bytes` from `src` to `dst` on `stream`; the caller then
    /// moves the bytes.
    fn transfer(
        &mut self,
        stream: usize,
        engine: Engine,
        src: End,
        dst: End,
        bytes: u64,
    ) -> Result<(), SimError> {
        let kind = match engine {
            Engine::H2d => "h2d",
            Engine::D2h => "d2h",
            Engine::Collective => "all_gather",
            Engine::Compute => "compute",
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
        let (n, fail_at) = if engine == Engine::Collective {
            self.collectives += 1;
            (self.collectives, self.faults.fail_collective_at)
        } else {
            self.copies += 1;
            (self.copies, self.faults.fail_copy_at)
        };
        if fail_at == Some(n) {
            let what = if engine == Engine::Collective {
                "collective"
            } else {
                "copy"
            };
            return Err(self.err(
                op_name,
                DeviceErrorKind::TransferFailed,
                format!("injected failure of {what} #{n}"),
            ));
        }
        let duration = match engine {
            Engine::D2h => self.profile.d2h_ns(bytes),
            Engine::Collective => self.profile.h2d_ns(bytes) / 8,
            _ => self.profile.h2d_ns(bytes),
        };
        let (op, _, _) = self.enqueue(stream, engine, duration, &op_name);
        match engine {
            Engine::H2d => self.stats_h2d += bytes,
            Engine::D2h => self.stats_d2h += bytes,
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
        Ok(())
    }

    fn dev_name(&self, id: u64) -> String {
        self.device
            .get(&id)
            .map(|b| b.name.clone())
            .unwrap_or_else(|| format!("device#{id}"))
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
}

impl SimConfig {
    /// Exact payloads, no faults.
    pub fn exact(profile: DeviceProfile) -> Self {
        Self {
            profile,
            payload_divisor: 1,
            faults: FaultPlan::none(),
        }
    }
}

impl SimDevice {
    /// A new device.
    pub fn new(config: SimConfig) -> Self {
        assert!(
            config.payload_divisor.is_power_of_two(),
            "payload divisor must be a power of two"
        );
        let mut default_stream = StreamState {
            name: "host".to_owned(),
            tail_ns: 0,
            clock: VectorClock::new(1),
            waited_ns: 0,
        };
        default_stream.clock.tick(HOST);
        Self {
            shared: Arc::new(Mutex::new(State {
                profile: config.profile,
                divisor: config.payload_divisor,
                host_now_ns: 0,
                host_clock: VectorClock::new(1),
                streams: vec![default_stream],
                events: Vec::new(),
                device: BTreeMap::new(),
                pinned: BTreeMap::new(),
                registered: BTreeMap::new(),
                next_id: 1,
                engines: [0; 4],
                op_clocks: Vec::new(),
                checker: BufferOrderChecker::new(),
                violations: Vec::new(),
                faults: config.faults,
                collectives: 0,
                stats_h2d: 0,
                stats_d2h: 0,
                device_bytes: 0,
                device_peak: 0,
                pinned_bytes: 0,
                registered_bytes: 0,
                allocations: 0,
                copies: 0,
                kernels: 0,
                trace: Trace::default(),
            })),
        }
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

    /// Blocks the host until every stream is idle; returns the time, ns.
    pub fn synchronize_all(&self) -> u64 {
        let mut st = self.state();
        let end = st.streams.iter().map(|s| s.tail_ns).max().unwrap_or(0);
        st.host_now_ns = st.host_now_ns.max(end);
        let clocks: Vec<VectorClock> = st.streams.iter().map(|s| s.clock.clone()).collect();
        for c in &clocks {
            st.host_clock.join(c);
        }
        st.host_now_ns
    }

    /// Every violation the checker saw, in order.
    pub fn violations(&self) -> Vec<Violation> {
        self.state().violations.clone()
    }

    /// Counters.
    pub fn stats(&self) -> SimStats {
        let st = self.state();
        SimStats {
            h2d_bytes: st.stats_h2d,
            d2h_bytes: st.stats_d2h,
            device_bytes: st.device_bytes,
            device_peak_bytes: st.device_peak,
            pinned_bytes: st.pinned_bytes,
            registered_bytes: st.registered_bytes,
            allocations: st.allocations,
            copies: st.copies,
            kernels: st.kernels,
        }
    }

    /// Resets the device peak to the current use (to measure one phase).
    pub fn reset_peak(&self) {
        let mut st = self.state();
        st.device_peak = st.device_bytes;
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
            .map(|b| b.name.clone())
            .collect()
    }

    /// Reports a leak (INV-7) for every device buffer, pinned buffer or
    /// registration still alive; call after `disable`.
    pub fn check_released(&self) -> usize {
        let mut st = self.state();
        let mut leaks: Vec<String> = st
            .device
            .values()
            .map(|b| format!("device buffer `{}` ({} bytes)", b.name, b.len))
            .collect();
        leaks.extend(
            st.pinned
                .iter()
                .map(|(id, len)| format!("pinned buffer #{id} ({len} bytes)")),
        );
        leaks.extend(
            st.registered
                .iter()
                .map(|(id, len)| format!("registration #{id} ({len} bytes)")),
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

    /// A kernel on `stream` that reads `inputs` (buffer, byte range) and
    /// costs `flops`; returns a checksum of every byte it read (position
    /// within the range and value), so a run that read other bytes gives
    /// another checksum.
    pub fn compute(
        &self,
        stream: &SimStream,
        inputs: &[(&SimDeviceBuffer, Range<u64>)],
        flops: f64,
        name: &str,
    ) -> Result<u64, SimError> {
        let mut st = self.state();
        let duration = st.profile.compute_ns(flops);
        for (buf, range) in inputs {
            if !st.device.contains_key(&buf.id) {
                return Err(st.err(
                    format!("compute `{name}`"),
                    DeviceErrorKind::Other,
                    format!("reads freed buffer #{}", buf.id),
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
        let (op, _, _) = st.enqueue(stream.index, Engine::Compute, duration, name);
        st.kernels += 1;
        let stream_name = st.streams[stream.index].name.clone();
        let d = st.divisor;
        let mut sum: u64 = 0xcbf2_9ce4_8422_2325;
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
            let mem = &st.device[&buf.id].mem;
            // Position within the range of the first kept byte, then every d.
            let mut pos = range.start.next_multiple_of(d) - range.start;
            for &v in &mem[kept(range.start, range.end, d)] {
                sum = (sum ^ (u64::from(v) | (pos << 8))).wrapping_mul(0x100_0000_01b3);
                pos += d;
            }
        }
        Ok(sum)
    }
}

impl Device<Sim> for SimDevice {
    fn alloc_device(&self, bytes: u64) -> Result<SimDeviceBuffer, SimError> {
        let mut st = self.state();
        st.host_tick();
        st.allocations += 1;
        let n = st.allocations;
        if st.faults.fail_alloc_at == Some(n) {
            return Err(st.err(
                format!("alloc_device({bytes} bytes)"),
                DeviceErrorKind::OutOfMemory,
                format!("injected failure of allocation #{n}"),
            ));
        }
        if st.device_bytes + bytes > st.profile.memory_bytes {
            return Err(st.err(
                format!("alloc_device({bytes} bytes)"),
                DeviceErrorKind::OutOfMemory,
                format!(
                    "{} of {} bytes in use",
                    st.device_bytes, st.profile.memory_bytes
                ),
            ));
        }
        let id = st.next_id;
        st.next_id += 1;
        let real = bytes.div_ceil(st.divisor) as usize;
        st.device.insert(
            id,
            DevBuf {
                name: format!("device#{id}"),
                len: bytes,
                mem: vec![0u8; real],
            },
        );
        st.checker.forget(&format!("device#{id}"));
        st.device_bytes += bytes;
        st.device_peak = st.device_peak.max(st.device_bytes);
        Ok(SimDeviceBuffer { id, len: bytes })
    }

    unsafe fn free_device(
        &self,
        buffer: SimDeviceBuffer,
        after: &[&SimEvent],
    ) -> Result<(), SimError> {
        let mut st = self.state();
        // The free is an operation on a private stream that waits for `after`.
        let mut clock = st.host_clock.clone();
        for e in after {
            let c = st.events[e.index].clock.clone();
            clock.join(&c);
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
        match st.device.remove(&buffer.id) {
            Some(b) => {
                st.device_bytes -= b.len;
                Ok(())
            }
            None => Err(st.err(
                "free_device",
                DeviceErrorKind::Other,
                format!("{name} is not allocated"),
            )),
        }
    }

    fn alloc_pinned(&self, bytes: u64) -> Result<SimHostBuffer, SimError> {
        let mut st = self.state();
        st.host_tick();
        st.allocations += 1;
        let n = st.allocations;
        if st.faults.fail_alloc_at == Some(n) {
            return Err(st.err(
                format!("alloc_pinned({bytes} bytes)"),
                DeviceErrorKind::OutOfMemory,
                format!("injected failure of allocation #{n}"),
            ));
        }
        let id = st.next_id;
        st.next_id += 1;
        st.pinned.insert(id, bytes);
        st.pinned_bytes += bytes;
        st.checker.forget(&host_name(id));
        let divisor = st.divisor;
        Ok(SimHostBuffer {
            id,
            len: bytes,
            mem: vec![0u8; bytes.div_ceil(divisor) as usize],
            divisor,
            shared: Arc::clone(&self.shared),
        })
    }

    unsafe fn free_pinned(&self, buffer: SimHostBuffer) -> Result<(), SimError> {
        let mut st = self.state();
        st.host_access(
            host_name(buffer.id),
            0..buffer.len,
            Access::Free,
            "free_pinned",
        );
        if st.pinned.remove(&buffer.id).is_some() {
            st.pinned_bytes -= buffer.len;
        }
        Ok(())
    }

    fn register_host(
        &self,
        region: Box<dyn HostRegion>,
    ) -> Result<SimRegistration, RegisterError<Sim>> {
        let mut st = self.state();
        st.host_tick();
        st.allocations += 1;
        let n = st.allocations;
        if st.faults.fail_alloc_at == Some(n) {
            let error = st.err(
                "register_host",
                DeviceErrorKind::OutOfMemory,
                format!("injected failure of allocation #{n}"),
            );
            return Err(RegisterError { error, region });
        }
        let id = st.next_id;
        st.next_id += 1;
        let len = region.bytes().len() as u64;
        st.registered.insert(id, len);
        st.registered_bytes += len;
        st.checker.forget(&format!("registered#{id}"));
        Ok(SimRegistration { id, region })
    }

    unsafe fn unregister_host(
        &self,
        registration: SimRegistration,
    ) -> Result<Box<dyn HostRegion>, SimError> {
        let mut st = self.state();
        let len = registration.len_bytes();
        st.host_access(
            format!("registered#{}", registration.id),
            0..len,
            Access::Free,
            "unregister_host",
        );
        st.registered.remove(&registration.id);
        st.registered_bytes -= len;
        Ok(registration.region)
    }

    fn memory_info(&self) -> Result<MemoryInfo, SimError> {
        let st = self.state();
        Ok(MemoryInfo {
            free_bytes: st.profile.memory_bytes - st.device_bytes,
            total_bytes: st.profile.memory_bytes,
        })
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
        }
        Ok(done)
    }

    fn synchronize_event(&self, event: &SimEvent) -> Result<(), SimError> {
        let mut st = self.state();
        st.host_tick();
        let e = st.events[event.index].clone();
        st.host_now_ns = st.host_now_ns.max(e.time_ns);
        st.host_clock.join(&e.clock);
        Ok(())
    }

    fn synchronize_stream(&self, stream: &SimStream) -> Result<(), SimError> {
        let mut st = self.state();
        st.host_tick();
        let s = &st.streams[stream.index];
        let (tail, clock) = (s.tail_ns, s.clock.clone());
        st.host_now_ns = st.host_now_ns.max(tail);
        st.host_clock.join(&clock);
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
        let (name, len) = match &src {
            HostSource::Pinned(b) => (host_name(b.id), b.len),
            HostSource::Registered(r) => (format!("registered#{}", r.id), r.len_bytes()),
        };
        if !st.device.contains_key(&dst.id) {
            return Err(st.err(
                format!("h2d {name}"),
                DeviceErrorKind::Other,
                "destination is freed",
            ));
        }
        let dst_end = End {
            name: st.dev_name(dst.id),
            offset: dst_offset,
            len: dst.len,
        };
        st.transfer(
            stream.index,
            Engine::H2d,
            End {
                name,
                offset: src_offset,
                len,
            },
            dst_end,
            bytes,
        )?;
        let d = st.divisor;
        let mem = &mut st.device.get_mut(&dst.id).expect("checked above").mem;
        match &src {
            HostSource::Pinned(b) => copy_kept(&b.mem, src_offset, mem, dst_offset, bytes, d),
            HostSource::Registered(r) => {
                let to = kept(dst_offset, dst_offset + bytes, d);
                let first = src_offset.next_multiple_of(d) as usize;
                let region = r.region.bytes();
                for (i, out) in mem[to].iter_mut().enumerate() {
                    *out = region[first + i * d as usize];
                }
            }
        }
        Ok(())
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
        let src_end = End {
            name: st.dev_name(src.id),
            offset: src_offset,
            len: src.len,
        };
        let dst_end = End {
            name: host_name(dst.id),
            offset: dst_offset,
            len: dst.len,
        };
        st.transfer(stream.index, Engine::D2h, src_end, dst_end, bytes)?;
        let d = st.divisor;
        copy_kept(
            &st.device[&src.id].mem,
            src_offset,
            &mut dst.mem,
            dst_offset,
            bytes,
            d,
        );
        Ok(())
    }
}

/// A collective of one rank over the simulated device (the gather is a
/// device-to-device copy), with injectable failures. Multi-rank groups come
/// with the distributed backend.
#[derive(Clone, Debug)]
pub struct SimCollective {
    device: SimDevice,
}

impl SimCollective {
    /// A group of one on `device`.
    pub fn single(device: &SimDevice) -> Self {
        Self {
            device: device.clone(),
        }
    }
}

impl Collective<Sim> for SimCollective {
    fn rank(&self) -> u32 {
        0
    }

    fn size(&self) -> u32 {
        1
    }

    unsafe fn all_gather(
        &self,
        stream: &SimStream,
        shard: &SimDeviceBuffer,
        shard_offset: u64,
        shard_bytes: u64,
        dst: &SimDeviceBuffer,
        dst_offset: u64,
    ) -> Result<(), SimError> {
        let mut st = self.device.state();
        let src_end = End {
            name: st.dev_name(shard.id),
            offset: shard_offset,
            len: shard.len,
        };
        let dst_end = End {
            name: st.dev_name(dst.id),
            offset: dst_offset,
            len: dst.len,
        };
        st.transfer(
            stream.index,
            Engine::Collective,
            src_end,
            dst_end,
            shard_bytes,
        )?;
        let d = st.divisor;
        let src: Vec<u8> =
            st.device[&shard.id].mem[kept(shard_offset, shard_offset + shard_bytes, d)].to_vec();
        let out = &mut st.device.get_mut(&dst.id).expect("allocated").mem;
        out[kept(dst_offset, dst_offset + shard_bytes, d)].copy_from_slice(&src);
        Ok(())
    }
}
