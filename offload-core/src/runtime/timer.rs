//! Device-timed marks the warm-up (and the check request after it)
//! records (CONTRACT §9): timing events on the copy stream around each
//! fill, on the decode stream around each decode and on the compute
//! stream around each block's and each component's forward, and the
//! device's memory figures sampled at the same points. Read once the warm-up request is done (the
//! host waits for every mark then, never on the hot path: a backend
//! records marks only while it measures).

use crate::sync::{Arc, Mutex, lock};

use crate::device::{Api, Device};
use crate::lifecycle::OffloadError;
use crate::runtime::shared::dev_err;

/// What a mark stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Mark {
    /// A fill of `bytes` begins on the copy stream (after its waits).
    CopyStart {
        /// Bytes copied.
        bytes: u64,
    },
    /// The fill just begun ends.
    CopyEnd,
    /// A decode of a coded block begins on the decode stream (after its
    /// waits: its copy and its slot's last use).
    DecodeStart,
    /// The decode just begun ends.
    DecodeEnd,
    /// Block `path`'s hooks begin, before compute waits for its fill.
    BlockBefore(String),
    /// Block `path`'s kernels may begin (its fill is waited for).
    BlockStart(String),
    /// Block `path`'s kernels are enqueued.
    BlockEnd(String),
    /// Component `path`'s forward begins (after its bring-in).
    PhaseStart(String),
    /// Component `path`'s forward ends.
    PhaseEnd(String),
}

/// The device's memory at a mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MemorySample {
    /// Bytes in use (total − free).
    pub(crate) used_bytes: u64,
    /// The device's own high-water mark since the last reset, if it keeps
    /// one.
    pub(crate) peak_bytes: Option<u64>,
    /// The allocator's high-water mark of what it held (in use and slack),
    /// if it keeps one.
    pub(crate) reserved_peak_bytes: Option<u64>,
    /// Weight bytes the backend held on the device then.
    pub(crate) weight_bytes: u64,
}

/// The marks of one warm-up.
pub(crate) struct Timer<A: Api> {
    device: Arc<A::Device>,
    marks: Mutex<Vec<(Mark, A::Event)>>,
    memory: Mutex<Vec<(String, MemorySample)>>,
}

impl<A: Api> Timer<A> {
    pub(crate) fn new(device: Arc<A::Device>) -> Self {
        Self {
            device,
            marks: Mutex::new(Vec::new()),
            memory: Mutex::new(Vec::new()),
        }
    }

    /// Records `mark` on `stream` now.
    pub(crate) fn mark(&self, stream: &A::Stream, mark: Mark) -> Result<(), OffloadError> {
        let event = self
            .device
            .create_timing_event()
            .map_err(|e| dev_err("create_timing_event", e))?;
        self.device
            .record_event(&event, stream)
            .map_err(|e| dev_err("record_event(warm-up mark)", e))?;
        lock(&self.marks).push((mark, event));
        Ok(())
    }

    /// Samples the device's memory during `phase`, the backend holding
    /// `weight_bytes`.
    pub(crate) fn sample(&self, phase: &str, weight_bytes: u64) -> Result<(), OffloadError> {
        let info = self
            .device
            .memory_info()
            .map_err(|e| dev_err("memory_info", e))?;
        let peak = self
            .device
            .memory_peak()
            .map_err(|e| dev_err("memory_peak", e))?;
        let reserved = self
            .device
            .memory_reserved_peak()
            .map_err(|e| dev_err("memory_reserved_peak", e))?;
        lock(&self.memory).push((
            phase.to_owned(),
            MemorySample {
                used_bytes: info.total_bytes.saturating_sub(info.free_bytes),
                peak_bytes: peak,
                reserved_peak_bytes: reserved,
                weight_bytes,
            },
        ));
        Ok(())
    }

    /// Resets the device's high-water mark (a phase begins).
    pub(crate) fn reset_peak(&self) -> Result<(), OffloadError> {
        self.device
            .reset_memory_peak()
            .map_err(|e| dev_err("reset_memory_peak", e))
    }

    /// Every mark with its device time relative to the first, ns, in
    /// record order; waits for the last mark first. Frees the events.
    pub(crate) fn read(&self) -> Result<Vec<(Mark, u64)>, OffloadError> {
        let marks = std::mem::take(&mut *lock(&self.marks));
        let Some((_, first)) = marks.first() else {
            return Ok(Vec::new());
        };
        for (_, e) in &marks {
            self.device
                .synchronize_event(e)
                .map_err(|e| dev_err("synchronize_event(warm-up mark)", e))?;
        }
        marks
            .iter()
            .map(|(m, e)| {
                let ns = self
                    .device
                    .elapsed_ns(first, e)
                    .map_err(|e| dev_err("elapsed_ns(warm-up mark)", e))?;
                Ok((m.clone(), ns))
            })
            .collect()
    }

    /// Every memory sample, in order.
    pub(crate) fn samples(&self) -> Vec<(String, MemorySample)> {
        std::mem::take(&mut *lock(&self.memory))
    }
}
