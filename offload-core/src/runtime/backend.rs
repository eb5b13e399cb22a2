//! What a strategy is to the runtime: the [`Backend`] trait (the
//! lifecycle plus where each storage is), the [`WeightSource`] host masters
//! are filled from, and a storage's [`DeviceLocation`].

use crate::sync::Arc;

use crate::budget::RequestPlan;
use crate::device::Api;
use crate::lifecycle::{OffloadBackend, OffloadError};
use crate::measurements::PlannerInputs;
use crate::model::StorageId;
use crate::request::RequestShape;
use crate::residency::Residency;
use crate::runtime::hooks::Model;
use crate::runtime::layout::{SourcePosition, Unit};

/// A unit's coded bytes held by a weight source ([`WeightSource::take_coded`]).
pub struct CodedRegion {
    /// The coded bytes, exactly.
    pub region: Box<dyn crate::device::HostRegion>,
    /// The decode's work items.
    pub work: u64,
}

impl std::fmt::Debug for CodedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CodedRegion")
            .field("bytes", &self.region.bytes().len())
            .field("work", &self.work)
            .finish()
    }
}

/// Where the weights' bytes come from (a checkpoint reader, a generator).
pub trait WeightSource: Send + Sync {
    /// Fills `dst` with the bytes of `storage` at
    /// `position..position + dst.len()`. `dst` is most often a staging
    /// buffer or a pinned master, which only the copy engine reads: a
    /// source that copies bytes it holds should copy them with
    /// [`crate::copy::copy_streaming`] (non-temporal stores), as the
    /// safetensors source does.
    fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]);

    /// Where `storage`'s bytes lie in this source, if it holds them in an
    /// order of its own (a mapped checkpoint: the file and the offset).
    /// Every strategy packs a unit's storages in this order wherever each
    /// keeps its natural alignment ([`crate::runtime::Partition::in_source_order`]),
    /// so a block whose tensors lie back to back in one file is one window
    /// of it ([`Self::take_region`]) whatever order the pipeline declared
    /// them in. `None` (the default): the declaration's order.
    fn position(&self, storage: StorageId) -> Option<SourcePosition> {
        let _ = storage;
        None
    }

    /// Memory that already holds `unit` packed exactly as [`Unit::entries`]
    /// lays it out (a loader's buffer): the strategy registers it in place as
    /// the host master instead of copying into fresh pinned memory, and owns
    /// it from then on. `None` (the default): masters are filled by `read`.
    fn take_region(&self, unit: &Unit) -> Option<Box<dyn crate::device::HostRegion>> {
        let _ = unit;
        None
    }

    /// Memory that already holds bytes `range` of `unit` packed as
    /// [`Unit::entries`] lays it out: one rank's shard of a gathered block
    /// (CONTRACT §8, `range` is `start..start + s`), registered in place as
    /// the shard's host master instead of copying it into fresh pinned
    /// memory (a mapped checkpoint's window). The region must be exactly
    /// `range`'s length. `range` may run past `unit.bytes` (the last rank's
    /// zero padding): those bytes land in the slot past the unit and
    /// compute never reads them, so the region may hold whatever follows
    /// the unit in the source's memory there, provided it is that memory
    /// (readable, the same mapping). `None` (the default), or where no
    /// such memory exists (the shard is split between two files, the
    /// padding would run past a file's end): the shard is copied into
    /// pinned memory through `read`, zeros as padding.
    fn take_shard_region(
        &self,
        unit: &Unit,
        range: std::ops::Range<u64>,
    ) -> Option<Box<dyn crate::device::HostRegion>> {
        let _ = (unit, range);
        None
    }

    /// Memory that already holds `unit` coded in `format` (a packed
    /// checkpoint's window, CONTRACT §7b): its coded bytes and the decode's
    /// work items, registered in place as the coded host master instead of
    /// encoding at enable. `format` is the device codec's
    /// ([`crate::device::Codec::format`]); a source holding another format,
    /// or a unit laid out otherwise than [`Unit::entries`], returns `None`
    /// (the default), and the block is encoded.
    fn take_coded(&self, unit: &Unit, format: &str) -> Option<CodedRegion> {
        let _ = (unit, format);
        None
    }

    /// [`Self::read`], without mapping the bytes into this process where
    /// the source can (a positional read of its file, `pread`): the staging
    /// filler reads with it the blocks whose pages it releases after reading
    /// (CONTRACT §7c), so that no page of the file is faulted in or stays
    /// resident. Default: [`Self::read`].
    fn read_direct(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        self.read(storage, position, dst);
    }

    /// Reads bytes `position..position + dst.len()` of `coded`, the coded
    /// bytes [`Self::take_coded`] handed out for `unit`, with positional
    /// reads that map nothing in (`pread`): the filler reads so the coded
    /// staged blocks whose pages it releases after reading (CONTRACT §7c).
    /// A source answers only for bytes that are exactly its own window of
    /// `unit` (the same address and length: never a copy, a blob encoded
    /// at enable or a stale block), and returns `false` otherwise or where
    /// the read fails; the caller then reads `coded` itself. Default:
    /// `false`.
    fn read_coded_direct(&self, unit: &Unit, coded: &[u8], position: u64, dst: &mut [u8]) -> bool {
        let _ = (unit, coded, position, dst);
        false
    }

    /// `unit`'s bytes, packed exactly as [`Unit::entries`] lays them out,
    /// as memory the device may read where it lies (`staged_reads =
    /// "in_place"`, CONTRACT §7c): a read-only window of a mapped file, never
    /// registered, never written, mapped for as long as the returned handle
    /// lives, whose pages this source does not release while it does.
    /// `None` (the default), or where no such window exists: the unit
    /// streams through the staging ring.
    fn pageable_window(
        &self,
        unit: &Unit,
    ) -> Option<std::sync::Arc<dyn crate::device::HostRegion>> {
        let _ = unit;
        None
    }

    /// A staged unit's bytes (CONTRACT §7c) will be read soon (the next
    /// staged block in ring order): a source backed by a mapped file may
    /// start reading them ahead (`madvise(MADV_WILLNEED)`). Default:
    /// nothing.
    fn prefetch(&self, unit: &Unit) {
        let _ = unit;
    }

    /// A staged unit's bytes were read into a staging buffer and are not
    /// needed before the next step: a source backed by a mapped file may
    /// drop their pages from this process (`madvise(MADV_DONTNEED)`; read
    /// again from the page cache or the file next time), so that resident
    /// memory stays within the host budget whatever the checkpoint's size.
    /// Called only when the engine's host budget asks for it
    /// ([`crate::budget::HostPlan::release_after_read`]). Default: nothing.
    fn release(&self, unit: &Unit) {
        let _ = unit;
    }

    /// Distributed layerwise `disable` hands back every block this rank held
    /// only a shard of, gathered once more across the group and packed as
    /// [`Unit::entries`] lays it out (exactly `unit.bytes`), so a source
    /// that loaded only this rank's shards has the full weights again
    /// (CONTRACT §8). The default drops them (a source that kept every byte
    /// needs nothing back).
    fn restore(&self, unit: &Unit, bytes: &[u8]) {
        let _ = (unit, bytes);
    }

    /// Whether [`Self::restore`] wants the blocks: `false` for a source
    /// that still holds (or can regenerate) every byte, which spares
    /// distributed layerwise `disable` its gathers and copies. Every rank
    /// of a group must answer alike (the gathers are collectives). Default
    /// `true`, as CONTRACT §8 asks.
    fn wants_restore(&self) -> bool {
        true
    }
}

/// The host masters a backend holds, by how they were made: memory the
/// weight source already held, registered in place (no copy), or copies
/// into pinned memory the backend allocated (a block that is not one window
/// of its file, a source that only reads). Counted as the backend makes and
/// frees them, so after `enable` it is what `enable` made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostMasters {
    /// Units registered in place (page-locked where they lie; a staged
    /// unit the device reads where it lies is never locked:
    /// `pageable_read_units`).
    pub in_place_units: u64,
    /// Their bytes.
    pub in_place_bytes: u64,
    /// Units copied into pinned memory.
    pub copied_units: u64,
    /// Their bytes.
    pub copied_bytes: u64,
    /// Units left in the source's pageable memory, streamed through pinned
    /// staging buffers (CONTRACT §7c: beyond the host budget, pinning
    /// refused, or `pin_cpu_memory = false`).
    pub staged_units: u64,
    /// Their bytes (not pinned: what the staging saves).
    pub staged_bytes: u64,
    /// Of the staged units, those the device reads where they lie (a
    /// read-only window of a mapped checkpoint, on a device that reads
    /// pageable memory: `staged_reads`, CONTRACT §7c), with no host copy.
    pub pageable_read_units: u64,
    /// Their bytes.
    pub pageable_read_bytes: u64,
}

/// Where one storage's bytes are readable by device kernels now.
#[derive(Debug)]
pub struct DeviceLocation<A: Api> {
    /// The buffer.
    pub buffer: Arc<A::DeviceBuffer>,
    /// The storage's first byte in it.
    pub offset: u64,
}

impl<A: Api> Clone for DeviceLocation<A> {
    fn clone(&self) -> Self {
        Self {
            buffer: Arc::clone(&self.buffer),
            offset: self.offset,
        }
    }
}

/// A backend the [`Runtime`](crate::runtime::Runtime) can run: the lifecycle, plus where each
/// storage is on the device.
pub trait Backend<A: Api>: OffloadBackend {
    /// The device location of `storage`, if it is resident now.
    fn locate(&self, storage: StorageId) -> Option<DeviceLocation<A>>;

    /// The residency of `storage`, if this backend manages it.
    fn residency(&self, storage: StorageId) -> Option<Residency>;

    /// The host masters this backend holds now, in place or copied.
    fn host_masters(&self) -> HostMasters {
        HostMasters::default()
    }

    /// What this backend forecasts of a step of each ring with staged
    /// masters (CONTRACT §7c), by the ring's first block: layerwise's
    /// [`crate::runtime::LayerwiseBackend::staged_forecast`], from
    /// `inputs` or the platform's planner inputs; empty for every other
    /// backend.
    fn staged_forecast(
        &self,
        inputs: Option<&PlannerInputs>,
    ) -> Result<Vec<(String, crate::budget::StagedForecast)>, OffloadError> {
        let _ = inputs;
        Ok(Vec::new())
    }

    /// The look-ahead the recurrence chooses for each ring with staged
    /// masters, by the ring's first block: layerwise's
    /// [`crate::runtime::LayerwiseBackend::staged_lookahead`]; empty for
    /// every other backend.
    fn staged_lookahead(
        &self,
        inputs: Option<&PlannerInputs>,
        max_depth: usize,
    ) -> Result<Vec<(String, crate::budget::Lookahead)>, OffloadError> {
        let _ = (inputs, max_depth);
        Ok(Vec::new())
    }

    /// Device bytes this backend holds for weights now.
    fn device_weight_bytes(&self) -> u64;

    /// Host bytes this backend holds for weights (pinned or registered), as
    /// it reports them. (Checks observe the device's own allocations.)
    fn host_weight_bytes(&self) -> u64;

    /// The request plan in force (a planned backend, enabled; `None` for
    /// every other backend and during a warm-up).
    fn request_plan(&self) -> Option<&RequestPlan> {
        None
    }

    /// What the plan was made from: the warm-up's measurements, the
    /// reloaded ones, or a caller's (a planned backend; `None` otherwise).
    fn planner_inputs(&self) -> Option<&PlannerInputs> {
        None
    }

    /// Whether `enable` will leave a warm-up to run (a planned backend
    /// with nothing given to plan from): the runtime must then run its
    /// request once and call [`Self::finish_warmup`].
    fn needs_warmup(&self) -> bool {
        false
    }

    /// The request the pending measuring request runs, if one is pending:
    /// the warm-up, or after it the check request (a plan that streams
    /// coded blocks, run once timed to measure what its decodes cost the
    /// kernels beside them, CONTRACT §9). The runtime runs it and calls
    /// [`Self::finish_warmup`] while one is pending.
    fn warmup_shape(&self) -> Option<RequestShape> {
        None
    }

    /// Ends the pending measuring request: reads what it measured, plans
    /// from it and puts the plan in force (a planned backend; others have
    /// nothing to do). After the warm-up the plan in force may want the
    /// check request ([`Self::warmup_shape`] again). `seconds` is the host
    /// time the request took.
    fn finish_warmup(&mut self, model: &mut Model, seconds: f64) -> Result<(), OffloadError> {
        let _ = (model, seconds);
        Ok(())
    }

    /// A request failed with `error`: if it ran out of device memory and
    /// the backend can plan again with the shortfall (once), it does and
    /// returns `true` (run the request again); otherwise `false`, or an
    /// error naming what was needed when it already re-planned once.
    fn replan_after(
        &mut self,
        model: &mut Model,
        error: &OffloadError,
    ) -> Result<bool, OffloadError> {
        let _ = (model, error);
        Ok(false)
    }
}

/// A backend [`Runtime::disable_backend`](crate::runtime::Runtime::disable_backend) took out, and how its `disable`
/// went.
pub type Disabled<A> = (Box<dyn Backend<A>>, Result<(), OffloadError>);
