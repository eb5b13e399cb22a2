//! What a strategy is to the runtime: the [`Backend`] trait (the
//! lifecycle plus where each storage is), the [`WeightSource`] host masters
//! are filled from, and a storage's [`DeviceLocation`].

use crate::sync::Arc;

use crate::device::Api;
use crate::lifecycle::{OffloadBackend, OffloadError};
use crate::model::StorageId;
use crate::residency::Residency;
use crate::runtime::layout::Unit;

/// Where the weights' bytes come from (a checkpoint reader, a generator).
pub trait WeightSource: Send + Sync {
    /// Fills `dst` with the bytes of `storage` at
    /// `position..position + dst.len()`.
    fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]);

    /// Memory that already holds `unit` packed exactly as [`Unit::entries`]
    /// lays it out (a loader's buffer): the strategy registers it in place as
    /// the host master instead of copying into fresh pinned memory, and owns
    /// it from then on. `None` (the default): masters are filled by `read`.
    fn take_region(&self, unit: &Unit) -> Option<Box<dyn crate::device::HostRegion>> {
        let _ = unit;
        None
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

/// A backend the [`Runtime`] can run: the lifecycle, plus where each
/// storage is on the device.
pub trait Backend<A: Api>: OffloadBackend {
    /// The device location of `storage`, if it is resident now.
    fn locate(&self, storage: StorageId) -> Option<DeviceLocation<A>>;

    /// The residency of `storage`, if this backend manages it.
    fn residency(&self, storage: StorageId) -> Option<Residency>;

    /// Device bytes this backend holds for weights now.
    fn device_weight_bytes(&self) -> u64;

    /// Host bytes this backend holds for weights (pinned or registered), as
    /// it reports them. (Checks observe the device's own allocations.)
    fn host_weight_bytes(&self) -> u64;
}

/// A backend [`Runtime::disable_backend`] took out, and how its `disable`
/// went.
pub type Disabled<A> = (Box<dyn Backend<A>>, Result<(), OffloadError>);
