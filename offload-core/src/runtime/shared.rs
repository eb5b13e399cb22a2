//! What every strategy shares: the device handles, the placement of each
//! storage, the residency table, and the few operations that touch the
//! device outside the hot path (filling host masters, uploading resident
//! units, freeing).

use crate::sync::{Arc, Mutex, MutexGuard, lock};
use std::collections::BTreeSet;

use crate::config::{OffloadConfig, OffloadStrategy};
use crate::device::{
    Api, ByteSource, Codec, CodecSpan, Device, DeviceBuffer, HostBuffer, HostSource,
};
use crate::lifecycle::OffloadError;
use crate::model::{Pipeline, StorageId};
use crate::plan::{ResolvedPlan, resolve};
use crate::residency::{Owner, Residency, ResidencyTable, Transition};
use crate::runtime::backend::{DeviceLocation, HostMasters, WeightSource};
use crate::runtime::bugs::{Bugs, PlantedBug};
use crate::runtime::hooks::Model;
use crate::runtime::layout::{Partition, Unit, partition};

/// One host master: pinned memory we filled, the loader's memory
/// registered in place, or (CONTRACT §7c) the loader's pageable memory left
/// where it is, streamed through pinned staging buffers (`Staged`) or read
/// by the device where it lies (`Pageable`: a read-only window of a mapped
/// checkpoint, on a device that reads pageable memory).
pub(crate) enum HostMaster<A: Api> {
    Pinned(A::HostBuffer),
    Registered(A::Registration),
    Staged(Staged),
    Pageable(std::sync::Arc<dyn crate::device::HostRegion>),
}

/// A master left in pageable memory (the weight source's: its mapped file
/// or its heap), read into a pinned staging buffer before each copy:
/// through [`WeightSource::read`], or, for a coded block (CONTRACT §7b,
/// §7c), from the coded bytes the weight source holds
/// ([`WeightSource::take_coded`]: a coded-block file's window, never
/// registered).
#[derive(Clone)]
pub(crate) struct Staged {
    /// The bytes each fill copies: the unit's, or its coded bytes'.
    pub(crate) bytes: u64,
    /// The coded bytes, for a coded block.
    pub(crate) coded: Option<std::sync::Arc<dyn crate::device::HostRegion>>,
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staged")
            .field("bytes", &self.bytes)
            .field("coded", &self.coded.is_some())
            .finish()
    }
}

impl<A: Api> HostMaster<A> {
    /// Its pinned or registered bytes: what it holds of page-locked host
    /// memory (0 for a staged or pageable master, whose bytes stay
    /// pageable).
    pub(crate) fn len_bytes(&self) -> u64 {
        use crate::device::Registration;
        match self {
            HostMaster::Pinned(b) => b.len_bytes(),
            HostMaster::Registered(r) => r.len_bytes(),
            HostMaster::Staged(_) | HostMaster::Pageable(_) => 0,
        }
    }

    /// As a copy source, or the typed error of a staged master (only the
    /// staging transport reads it, through a pinned staging buffer; `what`
    /// names the copy).
    pub(crate) fn copy_source(&self, what: &str) -> Result<HostSource<'_, A>, OffloadError> {
        match self {
            HostMaster::Pinned(b) => Ok(HostSource::Pinned(b)),
            HostMaster::Registered(r) => Ok(HostSource::Registered(r)),
            HostMaster::Pageable(p) => Ok(HostSource::Pageable(p)),
            HostMaster::Staged(_) => Err(OffloadError::DeviceOp {
                operation: what.to_owned(),
                kind: crate::device::DeviceErrorKind::Other,
                shortfall_bytes: None,
                cause: "its host master is staged (pageable memory): only the staging transport reads a staged master".into(),
            }),
        }
    }
}

/// Where a coded master's bytes came from ([`Handles::coded_master`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CodedFrom {
    /// The weight source's coded window, registered in place.
    InPlace,
    /// The weight source's coded window, copied into pinned memory (under
    /// a host budget, where registering it would lock its whole mapping).
    Copied,
    /// Encoded at enable.
    Encoded,
}

/// What [`Handles::coded_master`] made of a block.
pub(crate) enum CodedMaster<A: Api> {
    /// Its coded master, the decode's work items, where its bytes came from.
    Made(HostMaster<A>, u64, CodedFrom),
    /// The codec refused it: it streams raw.
    Raw,
    /// The device refused pinned memory for its coded bytes (`error`, not
    /// a lost device): the bytes, pageable, for the caller to stage (or to
    /// fail with `error` where it cannot).
    PinRefused {
        coded: crate::runtime::backend::CodedRegion,
        error: OffloadError,
    },
}

/// Device handles a backend works with.
pub(crate) struct Handles<A: Api> {
    pub(crate) device: Arc<A::Device>,
    pub(crate) compute: Arc<A::Stream>,
    pub(crate) copy: A::Stream,
    /// The communication stream gathers run on (gathering backends only).
    pub(crate) comm: Option<A::Stream>,
    /// The stream decodes run on (a ring that decodes, CONTRACT §7b).
    pub(crate) decode: Option<A::Stream>,
    pub(crate) weights: Arc<dyn WeightSource>,
    /// The host masters made through these handles and not yet freed.
    masters: Mutex<HostMasters>,
}

/// What a strategy's state answers for the runtime: the one place the
/// [`crate::runtime::Backend`] queries every strategy delegates are written.
pub(crate) trait StrategyState<A: Api> {
    /// Where each storage is.
    fn placement(&self) -> &Placement<A>;
    /// Device bytes held for weights now.
    fn device_weight_bytes(&self) -> u64;
    /// Host bytes held for weights (as the strategy reports them).
    fn host_weight_bytes(&self) -> u64;
}

/// A backend's handles, planted bugs and state (`None` while disabled),
/// shared with its hooks.
pub(crate) struct Shared<A: Api, S> {
    pub(crate) handles: Handles<A>,
    pub(crate) bugs: Bugs,
    pub(crate) state: Mutex<Option<S>>,
    /// Why the backend is poisoned (a multi-rank failure), if it is.
    pub(crate) poison: Mutex<Option<String>>,
}

impl<A: Api, S: StrategyState<A>> Shared<A, S> {
    pub(crate) fn new(handles: Handles<A>, bugs: Bugs) -> Self {
        Self {
            handles,
            bugs,
            state: Mutex::new(None),
            poison: Mutex::new(None),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Option<S>> {
        lock(&self.state)
    }

    pub(crate) fn bug(&self, bug: PlantedBug) -> bool {
        self.bugs.has(bug)
    }

    /// Why the backend is poisoned, if it is.
    pub(crate) fn poisoned(&self) -> Option<String> {
        lock(&self.poison).clone()
    }

    /// Poisons the backend (the first reason is kept).
    pub(crate) fn set_poison(&self, reason: String) {
        lock(&self.poison).get_or_insert(reason);
    }

    pub(crate) fn locate(&self, storage: StorageId) -> Option<DeviceLocation<A>> {
        self.lock().as_ref()?.placement().locate(storage)
    }

    pub(crate) fn residency(&self, storage: StorageId) -> Option<Residency> {
        self.lock().as_ref()?.placement().residency_of(storage)
    }

    pub(crate) fn device_weight_bytes(&self) -> u64 {
        self.lock().as_ref().map_or(0, S::device_weight_bytes)
    }

    pub(crate) fn host_weight_bytes(&self) -> u64 {
        self.lock().as_ref().map_or(0, S::host_weight_bytes)
    }
}

impl<A: Api> Handles<A> {
    pub(crate) fn new(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
    ) -> Result<Self, OffloadError> {
        let copy = device
            .create_stream()
            .map_err(|e| dev_err("create_stream", e))?;
        device.name_stream(&copy, "copy");
        device.name_stream(&compute, "compute");
        Ok(Self {
            device,
            compute,
            copy,
            comm: None,
            decode: None,
            weights,
            masters: Mutex::new(HostMasters::default()),
        })
    }

    /// Adds the communication stream a gathering backend runs its
    /// collectives on.
    pub(crate) fn with_comm(mut self) -> Result<Self, OffloadError> {
        let comm = self
            .device
            .create_stream()
            .map_err(|e| dev_err("create_stream", e))?;
        self.device.name_stream(&comm, "comm");
        self.comm = Some(comm);
        Ok(self)
    }

    /// Adds the stream a decoding ring runs its decodes on.
    pub(crate) fn with_decode(mut self) -> Result<Self, OffloadError> {
        let decode = self
            .device
            .create_priority_stream()
            .map_err(|e| dev_err("create_priority_stream", e))?;
        self.device.name_stream(&decode, "decode");
        self.decode = Some(decode);
        Ok(self)
    }

    /// Waits for everything enqueued on its streams (enable, disable,
    /// rollback: never on the hot path).
    pub(crate) fn drain(&self) -> Result<(), OffloadError> {
        self.device
            .synchronize_stream(&self.copy)
            .map_err(|e| dev_err("synchronize_stream(copy)", e))?;
        if let Some(decode) = &self.decode {
            self.device
                .synchronize_stream(decode)
                .map_err(|e| dev_err("synchronize_stream(decode)", e))?;
        }
        if let Some(comm) = &self.comm {
            self.device
                .synchronize_stream(comm)
                .map_err(|e| dev_err("synchronize_stream(comm)", e))?;
        }
        self.device
            .synchronize_stream(&self.compute)
            .map_err(|e| dev_err("synchronize_stream(compute)", e))
    }

    /// The one way a strategy gives its resources back: drain both streams
    /// (unless `drain` is false, which only planted bugs ask for), then run
    /// `free`, which frees everything and keeps the first error. If the
    /// drain fails, the device may still read or write any of it: nothing
    /// is freed, `resources` is leaked with a logged error, and the drain's
    /// error is returned.
    pub(crate) fn release<T>(
        &self,
        strategy: &str,
        resources: T,
        drain: bool,
        free: impl FnOnce(T, &mut Option<OffloadError>),
    ) -> Result<(), OffloadError> {
        if drain && let Err(e) = self.drain() {
            tracing::error!(
                "{strategy} offload: draining the streams failed ({e}); leaking its device and host memory rather than freeing memory the device may still use"
            );
            std::mem::forget(resources);
            return Err(e);
        }
        let mut first = None;
        free(resources, &mut first);
        first.map_or(Ok(()), Err)
    }

    /// A pinned host buffer of exactly `unit.bytes`, filled from the weight
    /// source straight into place (storages in `skip` are left unwritten:
    /// only a planted bug asks for that).
    pub(crate) fn fill_pinned(
        &self,
        unit: &Unit,
        skip: &BTreeSet<StorageId>,
    ) -> Result<A::HostBuffer, OffloadError> {
        let mut host = self.device.alloc_pinned(unit.bytes).map_err(|e| {
            dev_err(
                format!("alloc_pinned({} bytes) for `{}`", unit.bytes, unit.name),
                e,
            )
        })?;
        for e in unit.entries.iter().filter(|e| !skip.contains(&e.storage)) {
            host.write_from(
                e.offset,
                e.bytes,
                &StorageBytes {
                    weights: &*self.weights,
                    storage: e.storage,
                    base: 0,
                },
            );
        }
        Ok(host)
    }

    /// The coded host master of `unit` (CONTRACT §7b): `packed`, the
    /// coded bytes the weight source holds of it in the codec's format
    /// ([`crate::runtime::WeightSource::take_coded`], taken by the caller),
    /// registered in place, or copied into pinned memory of their size
    /// (under a host budget, or where registering them is refused: the
    /// host plan counted that size, and a copy is cheaper than an encode);
    /// else its bytes read from the weight source, encoded by `codec`,
    /// pinned at the coded size; with the decode's work items.
    /// [`CodedMaster::Raw`] (logged) where the codec refuses: the block
    /// then streams raw; [`CodedMaster::PinRefused`] where the device
    /// refuses the pinned memory (not a lost device), with the coded bytes
    /// for the caller to stage.
    pub(crate) fn coded_master(
        &self,
        unit: &Unit,
        spans: &[CodecSpan],
        codec: &dyn Codec<A>,
        packed: Option<crate::runtime::backend::CodedRegion>,
        whole_mappings: bool,
    ) -> Result<CodedMaster<A>, OffloadError> {
        // A packed checkpoint's window in the codec's format: registered in
        // place, nothing encoded.
        if let Some(coded) = packed {
            let len = coded.region.bytes().len() as u64;
            let bound = crate::device::coded_bound(unit.bytes, spans.len());
            if len > bound {
                tracing::warn!(unit = %unit.name, "the packed `{}` takes {len} bytes, above the bound of {bound}; encoding it instead", unit.name);
            } else {
                // Under a host budget a window is never registered where
                // the device would lock its whole mapping: its coded bytes
                // are copied into pinned memory of their exact size.
                let coded = if whole_mappings || coded.region.enclosing().is_none() {
                    let work = coded.work;
                    match self.device.register_host(coded.region) {
                        Ok(r) => {
                            return Ok(CodedMaster::Made(
                                self.counted(HostMaster::Registered(r)),
                                work,
                                CodedFrom::InPlace,
                            ));
                        }
                        Err(e) => {
                            tracing::warn!(unit = %unit.name, "registering the packed `{}` in place failed ({}); copying it into pinned memory", unit.name, e.error);
                            crate::runtime::backend::CodedRegion {
                                region: e.region,
                                work,
                            }
                        }
                    }
                } else {
                    coded
                };
                return self.pinned_coded(unit, coded, CodedFrom::Copied);
            }
        }
        let coded = match self.encode(unit, spans, codec) {
            Ok(coded) => coded,
            Err(reason) => {
                tracing::warn!(unit = %unit.name, "the {} codec refused `{}` ({reason}); it streams raw", codec.name(), unit.name);
                return Ok(CodedMaster::Raw);
            }
        };
        self.pinned_coded(
            unit,
            crate::runtime::backend::CodedRegion {
                work: coded.work,
                region: Box::new(coded.blob),
            },
            CodedFrom::Encoded,
        )
    }

    /// `unit`'s bytes, read from the weight source and encoded by `codec`
    /// (nothing pinned): the encoder's reason where it refuses.
    pub(crate) fn encode(
        &self,
        unit: &Unit,
        spans: &[CodecSpan],
        codec: &dyn Codec<A>,
    ) -> Result<crate::device::Coded, String> {
        codec.encode(
            &crate::runtime::read::unit_bytes_parallel(&*self.weights, unit),
            unit.bytes,
            spans,
        )
    }

    /// The exact length of the blob [`Self::encode`] would give for
    /// `unit`, with nothing encoded ([`Codec::coded_len`]).
    pub(crate) fn coded_len(
        &self,
        unit: &Unit,
        spans: &[CodecSpan],
        codec: &dyn Codec<A>,
    ) -> Result<Option<u64>, String> {
        // One reader shared by the sizing's own threads (`plan_block`
        // splits the unit over them), not a reader that splits each read.
        codec.coded_len(
            &crate::runtime::read::unit_bytes(&*self.weights, unit),
            unit.bytes,
            spans,
        )
    }

    /// `coded` copied into pinned memory of its exact size, or handed back
    /// where the device refuses the memory (not a lost device).
    pub(crate) fn pinned_coded(
        &self,
        unit: &Unit,
        coded: crate::runtime::backend::CodedRegion,
        from: CodedFrom,
    ) -> Result<CodedMaster<A>, OffloadError> {
        let len = coded.region.bytes().len() as u64;
        match self.device.alloc_pinned(len) {
            Ok(mut host) => {
                // Over the fills' threads, as the unit was read to encode
                // it (`unit_bytes_parallel`).
                host.write_from(
                    0,
                    len,
                    &crate::runtime::read::parallel_slice(coded.region.bytes()),
                );
                Ok(CodedMaster::Made(
                    self.counted(HostMaster::Pinned(host)),
                    coded.work,
                    from,
                ))
            }
            Err(e) => {
                let error = dev_err(
                    format!("alloc_pinned({len} bytes) for the coded `{}`", unit.name),
                    e,
                );
                match &error {
                    OffloadError::DeviceOp { kind, .. }
                        if *kind != crate::device::DeviceErrorKind::DeviceLost =>
                    {
                        Ok(CodedMaster::PinRefused { coded, error })
                    }
                    _ => Err(error),
                }
            }
        }
    }

    /// A pinned host buffer of exactly `shard.bytes`: bytes
    /// `shard.start..shard.end` of `unit`'s packing, read from the weight
    /// source (only those: a source that loaded this rank's part only
    /// suffices), then zeros up to `shard.bytes`.
    pub(crate) fn fill_shard(
        &self,
        unit: &Unit,
        shard: &crate::runtime::ring::Shard,
    ) -> Result<A::HostBuffer, OffloadError> {
        let mut host = self.device.alloc_pinned(shard.bytes).map_err(|e| {
            dev_err(
                format!(
                    "alloc_pinned({} bytes) for this rank's shard of `{}`",
                    shard.bytes, unit.name
                ),
                e,
            )
        })?;
        for e in &unit.entries {
            let (from, to) = (
                e.offset.max(shard.start),
                (e.offset + e.bytes).min(shard.end),
            );
            if from < to {
                host.write_from(
                    from - shard.start,
                    to - from,
                    &StorageBytes {
                        weights: &*self.weights,
                        storage: e.storage,
                        base: from - e.offset,
                    },
                );
            }
        }
        let data = shard.end - shard.start;
        if data < shard.bytes {
            host.write_from(data, shard.bytes - data, &Zeros);
        }
        Ok(host)
    }

    /// This rank's host master of `unit`'s `shard` (CONTRACT §8): memory
    /// the weight source already holds (a window of its mapped checkpoint,
    /// [`WeightSource::take_shard_region`]) registered in place, else a
    /// pinned copy ([`Self::fill_shard`]). A shard that is all padding (a
    /// unit smaller than its group) is always a pinned copy of zeros.
    /// `wrong_offset` (only the `ShardWindowWrongOffset` planted bug) asks
    /// for the window one bf16 element late.
    pub(crate) fn shard_master(
        &self,
        unit: &Unit,
        shard: &crate::runtime::ring::Shard,
        wrong_offset: bool,
    ) -> Result<HostMaster<A>, OffloadError> {
        let start = if wrong_offset {
            shard.start + 2
        } else {
            shard.start
        };
        if shard.end > shard.start
            && let Some(region) = self
                .weights
                .take_shard_region(unit, start..start + shard.bytes)
        {
            let len = region.bytes().len() as u64;
            if len == shard.bytes {
                match self.device.register_host(region) {
                    Ok(r) => return Ok(self.counted(HostMaster::Registered(r))),
                    Err(e) => tracing::warn!(
                        unit = %unit.name,
                        "registering this rank's shard of `{}` in place failed ({}); pinning a copy",
                        unit.name,
                        e.error
                    ),
                }
            } else {
                tracing::warn!(
                    unit = %unit.name,
                    "the weight source's window of this rank's shard of `{}` holds {len} bytes, not {}; pinning a copy",
                    unit.name,
                    shard.bytes
                );
            }
        }
        self.fill_shard(unit, shard)
            .map(|b| self.counted(HostMaster::Pinned(b)))
    }

    /// The host master of `unit`: memory the weight source already holds,
    /// registered in place, else a pinned buffer filled from the source;
    /// a window of a larger mapping (which a device registers whole, once:
    /// a mapped checkpoint) is registered only where `whole_mappings`,
    /// otherwise pinned as a copy, so that a host budget counts exactly the
    /// bytes of the blocks it pins (CONTRACT §7c).
    pub(crate) fn master_within(
        &self,
        unit: &Unit,
        skip: &BTreeSet<StorageId>,
        whole_mappings: bool,
    ) -> Result<HostMaster<A>, OffloadError> {
        if skip.is_empty()
            && let Some(region) = self.weights.take_region(unit)
            && region.bytes().len() as u64 == unit.bytes
            && (whole_mappings || region.enclosing().is_none())
        {
            match self.device.register_host(region) {
                Ok(r) => return Ok(self.counted(HostMaster::Registered(r))),
                Err(e) => {
                    tracing::warn!(unit = %unit.name, "in-place registration failed ({}); pinning a copy", e.error)
                }
            }
        }
        self.fill_pinned(unit, skip)
            .map(|b| self.counted(HostMaster::Pinned(b)))
    }

    /// [`Self::master_within`] for a unit that may stage (CONTRACT §7c):
    /// `Ok(None)` where the device refuses its pin or registration (any
    /// device error but a lost device), with a warning naming the unit,
    /// the device's error and `then` (what becomes of it).
    pub(crate) fn master_or_refused(
        &self,
        unit: &Unit,
        whole_mappings: bool,
        then: &str,
    ) -> Result<Option<HostMaster<A>>, OffloadError> {
        match self.master_within(unit, &BTreeSet::new(), whole_mappings) {
            Err(OffloadError::DeviceOp { kind, cause, .. })
                if kind != crate::device::DeviceErrorKind::DeviceLost =>
            {
                tracing::warn!(unit = %unit.name, "pinning `{}` was refused ({cause}); {then}", unit.name);
                Ok(None)
            }
            other => other.map(Some),
        }
    }

    /// Counts `master` among the masters these handles hold.
    pub(crate) fn counted(&self, master: HostMaster<A>) -> HostMaster<A> {
        self.count(&master, true);
        master
    }

    fn count(&self, master: &HostMaster<A>, made: bool) {
        let mut guard = lock(&self.masters);
        let m = &mut *guard;
        let (units, bytes) = match master {
            HostMaster::Pinned(_) => (&mut m.copied_units, &mut m.copied_bytes),
            HostMaster::Registered(_) => (&mut m.in_place_units, &mut m.in_place_bytes),
            HostMaster::Staged(_) | HostMaster::Pageable(_) => {
                (&mut m.staged_units, &mut m.staged_bytes)
            }
        };
        let len = match master {
            HostMaster::Staged(s) => s.bytes,
            HostMaster::Pageable(p) => p.bytes().len() as u64,
            _ => master.len_bytes(),
        };
        let tally = |units: &mut u64, bytes: &mut u64| {
            if made {
                *units += 1;
                *bytes += len;
            } else {
                *units = units.saturating_sub(1);
                *bytes = bytes.saturating_sub(len);
            }
        };
        tally(units, bytes);
        if matches!(master, HostMaster::Pageable(_)) {
            tally(&mut m.pageable_read_units, &mut m.pageable_read_bytes);
        }
    }

    /// The host masters made through these handles and not yet freed.
    pub(crate) fn host_masters(&self) -> HostMasters {
        *lock(&self.masters)
    }

    /// Puts the master `staged` makes in `slot`, in place of the master
    /// there, and frees that one (CONTRACT §7c: a pinned block staged to
    /// keep the host budget). A master shared with another owner is left
    /// in place, an error naming `name`.
    ///
    /// # Safety
    ///
    /// No copy reading the master in `slot` may be pending (no engine
    /// holds it, or every stream that copied from it has drained).
    pub(crate) unsafe fn restage(
        &self,
        slot: &mut std::sync::Arc<HostMaster<A>>,
        name: &str,
        staged: impl FnOnce() -> HostMaster<A>,
    ) -> Result<(), OffloadError> {
        if std::sync::Arc::strong_count(slot) != 1 {
            return Err(OffloadError::Forward {
                module: name.to_owned(),
                reason: "its host master is shared: it cannot stage to keep the host budget"
                    .to_owned(),
            });
        }
        let old = std::mem::replace(slot, std::sync::Arc::new(staged()));
        match std::sync::Arc::try_unwrap(old) {
            // SAFETY: forwarded from the caller; its only owner (checked
            // above) was this slot.
            Ok(old) => unsafe { self.free_master(old) },
            Err(_) => unreachable!("a master with one owner, checked above"),
        }
    }

    /// Frees a host master (its copies must have completed).
    ///
    /// # Safety
    ///
    /// No copy reading `master` may be pending.
    pub(crate) unsafe fn free_master(&self, master: HostMaster<A>) -> Result<(), OffloadError> {
        self.count(&master, false);
        match master {
            HostMaster::Pinned(b) => {
                // SAFETY: forwarded from the caller.
                let freed = unsafe { self.device.free_pinned(b) };
                freed.map_err(|e| dev_err("free_pinned", e))
            }
            HostMaster::Registered(r) => {
                // SAFETY: forwarded from the caller; the memory is dropped.
                let region = unsafe { self.device.unregister_host(r) };
                region.map(drop).map_err(|e| dev_err("unregister_host", e))
            }
            // Nothing pinned: its bytes stay with the weight source (a
            // pageable master drops its handle on the source's mapping).
            HostMaster::Staged(_) | HostMaster::Pageable(_) => Ok(()),
        }
    }

    /// Uploads `unit` to a new device buffer and waits for the copy (enable
    /// time only). Nothing is left allocated on failure.
    pub(crate) fn upload(
        &self,
        unit: &Unit,
        skip: &BTreeSet<StorageId>,
    ) -> Result<A::DeviceBuffer, OffloadError> {
        self.upload_within(unit, skip, true)
    }

    /// [`Self::upload`] through [`Self::master_within`]: under a host
    /// budget (`whole_mappings` false) a resident unit that is a window of
    /// a larger mapping is uploaded through a pinned copy, never by
    /// registering (and so locking) the whole mapping.
    pub(crate) fn upload_within(
        &self,
        unit: &Unit,
        skip: &BTreeSet<StorageId>,
        whole_mappings: bool,
    ) -> Result<A::DeviceBuffer, OffloadError> {
        let staging = self.master_within(unit, skip, whole_mappings)?;
        self.upload_through(unit, staging)
    }

    /// Uploads `unit` from `staging` (a master [`Self::master_within`]
    /// made for it), waits for the copy and frees `staging`: the second
    /// half of [`Self::upload_within`], for a caller that handles a refused
    /// pin (the first half's error) apart from a failed upload.
    pub(crate) fn upload_through(
        &self,
        unit: &Unit,
        staging: HostMaster<A>,
    ) -> Result<A::DeviceBuffer, OffloadError> {
        let result = self.upload_from(unit, &staging);
        if let Err(e) = self
            .device
            .synchronize_stream(&self.copy)
            .map_err(|e| dev_err("synchronize_stream(copy)", e))
        {
            // A copy may still read the staging buffer and write the device
            // buffer: leak both rather than free them.
            tracing::error!("upload of `{}`: {e}; leaking its buffers", unit.name);
            std::mem::forget(staging);
            std::mem::forget(result);
            return Err(e);
        }
        // SAFETY: the copy stream, the only one that read `staging`, was
        // synchronised just above.
        let freed = unsafe { self.free_master(staging) };
        let buffer = result?;
        freed?;
        Ok(buffer)
    }

    /// Uploads `unit` from `staging` (its host master, or a staging copy)
    /// to a new device buffer and waits for the copy. Nothing is left
    /// allocated on failure.
    pub(crate) fn upload_from(
        &self,
        unit: &Unit,
        staging: &HostMaster<A>,
    ) -> Result<A::DeviceBuffer, OffloadError> {
        let source = staging.copy_source(&format!("copy_h2d of `{}`", unit.name))?;
        let buffer = self.device.alloc_device(unit.bytes).map_err(|e| {
            dev_err(
                format!("alloc_device({} bytes) for `{}`", unit.bytes, unit.name),
                e,
            )
        })?;
        self.device.name_buffer(&buffer, &unit.name);
        let span = transfer_span(&unit.name, unit.bytes, "copy", "h2d").entered();
        // SAFETY: both ranges are the whole of buffers of exactly
        // `unit.bytes`; the copy stream is synchronised below before the
        // staging buffer is freed or the device buffer is lent.
        let copied = unsafe {
            self.device
                .copy_h2d(&self.copy, source, 0, &buffer, 0, unit.bytes)
        }
        .map_err(|e| dev_err(format!("copy_h2d of `{}`", unit.name), e));
        drop(span);
        let copied = copied.and_then(|()| {
            self.device
                .synchronize_stream(&self.copy)
                .map_err(|e| dev_err("synchronize_stream(copy)", e))
        });
        match copied {
            Ok(()) => Ok(buffer),
            Err(e) => {
                if self.device.synchronize_stream(&self.copy).is_ok() {
                    // SAFETY: the copy stream is drained: nothing uses `buffer`.
                    let _ = unsafe { self.device.free_device(buffer, &[]) };
                } else {
                    tracing::error!("upload of `{}`: {e}; leaking its device buffer", unit.name);
                    std::mem::forget(buffer);
                }
                Err(e)
            }
        }
    }

    /// Frees every buffer (after drained streams); every free runs, the
    /// first error is kept in `first`.
    pub(crate) fn free_all(
        &self,
        buffers: Vec<Arc<A::DeviceBuffer>>,
        what: &str,
        first: &mut Option<OffloadError>,
    ) {
        for b in buffers {
            if let Err(e) = self.free(b, &[], what) {
                first.get_or_insert(e);
            }
        }
    }

    /// Frees a device buffer after `after`; fails if a view still holds it.
    pub(crate) fn free(
        &self,
        buffer: Arc<A::DeviceBuffer>,
        after: &[&A::Event],
        what: &str,
    ) -> Result<(), OffloadError> {
        let buffer = Arc::try_unwrap(buffer).map_err(|_| OffloadError::Forward {
            module: what.to_owned(),
            reason: "cannot free: a view of it is still lent".to_owned(),
        })?;
        // SAFETY: every operation on `buffer` was enqueued on the copy or
        // compute stream before an event in `after` was recorded (callers
        // pass the buffer's ready and last-use events, or drained streams).
        unsafe { self.device.free_device(buffer, after) }
            .map_err(|e| dev_err(format!("free_device of `{what}`"), e))
    }
}

struct StorageBytes<'a> {
    weights: &'a dyn WeightSource,
    storage: StorageId,
    /// The storage's byte at position 0 of this source.
    base: u64,
}

impl ByteSource for StorageBytes<'_> {
    fn read_at(&self, position: u64, dst: &mut [u8]) {
        self.weights.read(self.storage, self.base + position, dst);
    }
}

struct Zeros;

impl ByteSource for Zeros {
    fn read_at(&self, _: u64, dst: &mut [u8]) {
        dst.fill(0);
    }
}

/// The span around one transfer the strategies issue (`tracing`, debug
/// level, so a runtime's own subscriber sees each one and a disabled level
/// costs a cached check): `offload.transfer` with the unit moved (`block`:
/// a block's path, or a component's), its `bytes`, the `stream` it is
/// issued on (`copy`, or `comm` for a gather) and its `kind` (`h2d`,
/// `h2d shard`, `all-gather`, `d2h`). A collective's own span
/// (`offload.collective`, from the `Collective`) nests inside the gather's.
pub(crate) fn transfer_span(block: &str, bytes: u64, stream: &str, kind: &str) -> tracing::Span {
    tracing::debug_span!("offload.transfer", block, bytes, stream, kind)
}

/// The span around a backend's `enable` (`offload.enable`, debug level):
/// its `strategy` and the pipeline's type; the transfers `enable` issues
/// nest inside it.
pub(crate) fn enable_span(strategy: OffloadStrategy, model: &Model) -> tracing::Span {
    tracing::debug_span!(
        "offload.enable",
        strategy = %strategy,
        pipeline = model.pipeline.type_name()
    )
}

pub(crate) fn dev_err(
    operation: impl Into<String>,
    e: impl crate::device::DeviceError,
) -> OffloadError {
    OffloadError::device(operation, e)
}

/// Where every storage is, and its residency.
pub(crate) struct Placement<A: Api> {
    pub(crate) location: Vec<Option<DeviceLocation<A>>>,
    pub(crate) residency: ResidencyTable<StorageId>,
    pub(crate) owner: Owner,
}

impl<A: Api> Placement<A> {
    pub(crate) fn new(pipeline: &Pipeline, strategy: OffloadStrategy) -> Self {
        Self {
            location: vec![None; pipeline.storages().count()],
            residency: ResidencyTable::new(),
            owner: Owner(strategy.hook_name().to_owned()),
        }
    }

    /// Claims every storage of `unit` (state `HostOnly`).
    pub(crate) fn claim(&mut self, unit: &Unit) -> Result<(), OffloadError> {
        for e in &unit.entries {
            self.residency.claim(e.storage, &self.owner)?;
        }
        Ok(())
    }

    /// Applies `t` to every storage of `unit`.
    pub(crate) fn transition(&mut self, unit: &Unit, t: Transition) -> Result<(), OffloadError> {
        for e in &unit.entries {
            self.residency.apply(&e.storage, &self.owner, t)?;
        }
        Ok(())
    }

    /// Points every storage of `unit` into `buffer`.
    pub(crate) fn place(&mut self, unit: &Unit, buffer: &Arc<A::DeviceBuffer>) {
        for e in &unit.entries {
            self.location[e.storage.index()] = Some(DeviceLocation {
                buffer: Arc::clone(buffer),
                offset: e.offset,
            });
        }
    }

    /// Moves the second storage of `unit` `bytes` further into its buffer
    /// (only the `ShiftedPlacement` planted bug asks for this).
    pub(crate) fn shift_second_entry(&mut self, unit: &Unit, bytes: u64) {
        if let Some(e) = unit.entries.get(1)
            && let Some(loc) = self.location[e.storage.index()].as_mut()
        {
            loc.offset += bytes;
        }
    }

    /// Marks every storage of `unit` host-only again.
    pub(crate) fn unplace(&mut self, unit: &Unit) {
        for e in &unit.entries {
            self.location[e.storage.index()] = None;
        }
    }

    /// A resident unit: claim, copy, done, placed.
    pub(crate) fn resident(
        &mut self,
        unit: &Unit,
        buffer: &Arc<A::DeviceBuffer>,
    ) -> Result<(), OffloadError> {
        self.claim(unit)?;
        self.transition(unit, Transition::IssueCopy)?;
        self.transition(unit, Transition::CopyDone)?;
        self.place(unit, buffer);
        Ok(())
    }

    pub(crate) fn locate(&self, storage: StorageId) -> Option<DeviceLocation<A>> {
        self.location.get(storage.index()).cloned().flatten()
    }

    pub(crate) fn residency_of(&self, storage: StorageId) -> Option<Residency> {
        self.residency.state(&storage)
    }
}

/// The packing every backend lays `pipeline`'s units out in when its
/// weight source proposes no order of its own (every component's blocks,
/// each component a group, whatever the strategy): what a loader packs its
/// buffers in so that every backend registers them in place.
pub fn packing(pipeline: &Pipeline) -> Result<Partition, OffloadError> {
    let every = OffloadConfig {
        device_budget: Some(crate::bytes::DeviceBudget::Auto),
        ..OffloadConfig::default()
    };
    plan_and_partition(pipeline, &every, None).map(|(_, partition)| partition)
}

/// The packing every backend lays `pipeline`'s units out in over
/// `weights`: [`packing`], each unit in the order the source holds it
/// ([`WeightSource::position`]).
pub fn packing_for(
    pipeline: &Pipeline,
    weights: &dyn WeightSource,
) -> Result<Partition, OffloadError> {
    Ok(packing(pipeline)?.in_source_order(pipeline, &|s| weights.position(s)))
}

/// The plan and the partition every strategy of this pipeline uses: the
/// blocks of every component's stacks (what the planned strategy may
/// stream), else of the plan's own stacks, else of the DiT stacks
/// layerwise offload would use, so packing is the same whatever the
/// strategy (a sampled simulated payload keeps the same bytes of each
/// tensor only if its offset in its unit is the same); each unit in the
/// order `weights` holds it, if given (sizes are the same either way).
pub(crate) fn plan_and_partition(
    pipeline: &Pipeline,
    config: &OffloadConfig,
    weights: Option<&dyn WeightSource>,
) -> Result<(ResolvedPlan, Partition), OffloadError> {
    let plan = resolve(pipeline, config)?;
    let every = OffloadConfig {
        device_budget: Some(crate::bytes::DeviceBudget::Auto),
        ..OffloadConfig::default()
    };
    let stacks = match resolve(pipeline, &every) {
        Ok(all)
            if plan
                .stacks
                .iter()
                .all(|s| all.stacks.iter().any(|a| a.blocks == s.blocks)) =>
        {
            all.stacks
        }
        _ if !plan.stacks.is_empty() => plan.stacks.clone(),
        _ => {
            let layerwise = OffloadConfig {
                enable_layerwise_offload: true,
                ..OffloadConfig::default()
            };
            resolve(pipeline, &layerwise)
                .map(|p| p.stacks)
                .unwrap_or_default()
        }
    };
    let groups: Vec<_> = plan.components.iter().map(|c| c.module).collect();
    let partition = partition(pipeline, &stacks, &groups);
    let partition = match weights {
        Some(w) => partition.in_source_order(pipeline, &|s| w.position(s)),
        None => partition,
    };
    Ok((plan, partition))
}

/// The components model-level offload swaps, each with the units it brings
/// in whole: every offloaded component of the plan (resolution refuses a
/// pipeline without a DiT or an encoder, CONTRACT §6).
pub(crate) fn swapped_components<'p>(
    pipeline: &Pipeline,
    plan: &'p ResolvedPlan,
    partition: &'p Partition,
) -> Vec<(&'p crate::plan::ResolvedComponent, Vec<&'p Unit>)> {
    plan.components
        .iter()
        .filter(|c| c.offloaded)
        .map(|c| {
            let units = partition
                .all()
                .filter(|u| pipeline.is_within(u.module, c.module))
                .collect();
            (c, units)
        })
        .collect()
}

/// Fails before anything is mutated if another strategy owns offload hooks
/// on the model (INV-1).
pub(crate) fn check_single_owner(
    model: &Model,
    strategy: OffloadStrategy,
) -> Result<(), OffloadError> {
    let names = [
        OffloadStrategy::ModelLevel.hook_name(),
        OffloadStrategy::Layerwise.hook_name(),
        OffloadStrategy::DistributedLayerwise.hook_name(),
        OffloadStrategy::Planned.hook_name(),
    ];
    let claims = model.hook_claims();
    let ours = crate::invariants::HookClaim {
        module: "",
        hook: strategy.hook_name(),
        owner: strategy.hook_name(),
    };
    crate::invariants::single_owner(
        claims
            .iter()
            .map(|(m, h, o)| crate::invariants::HookClaim {
                module: m,
                hook: h,
                owner: o,
            })
            .chain(std::iter::once(ours)),
        &names,
        std::iter::empty(),
    )?;
    Ok(())
}

/// The device bytes held by a list of buffers.
pub(crate) fn bytes_of<A: Api>(buffers: &[Arc<A::DeviceBuffer>]) -> u64 {
    buffers.iter().map(|b| b.len_bytes()).sum()
}

/// Installs `hooks` under the strategy's name and owner, in order; on the
/// first failure removes those it installed (unless `rollback` is false,
/// which only a planted bug asks for) and returns the error.
pub(crate) fn install_hooks(
    model: &mut Model,
    strategy: OffloadStrategy,
    hooks: Vec<(
        crate::model::ModuleId,
        Box<dyn offload_hooks::ModelHook<crate::runtime::hooks::ForwardCtx>>,
    )>,
    rollback: bool,
) -> Result<Vec<crate::model::ModuleId>, OffloadError> {
    let owner = offload_hooks::HookOwner::new(strategy.hook_name());
    let mut installed = Vec::new();
    for (module, hook) in hooks {
        if let Err(e) = model
            .hooks_of(module)
            .register(strategy.hook_name(), owner.clone(), hook)
        {
            if rollback {
                remove_hooks(model, strategy, &mut installed);
            }
            return Err(e.into());
        }
        installed.push(module);
    }
    Ok(installed)
}

/// Installs `hooks` under their own names, owned by the strategy, in
/// order (a backend with more than one hook per module); on the first
/// failure removes those it installed and returns the error.
pub(crate) fn install_named_hooks(
    model: &mut Model,
    strategy: OffloadStrategy,
    hooks: Vec<(
        crate::model::ModuleId,
        &'static str,
        Box<dyn offload_hooks::ModelHook<crate::runtime::hooks::ForwardCtx>>,
    )>,
) -> Result<Vec<crate::model::ModuleId>, OffloadError> {
    let owner = offload_hooks::HookOwner::new(strategy.hook_name());
    let mut installed = Vec::new();
    for (module, name, hook) in hooks {
        if let Err(e) = model.hooks_of(module).register(name, owner.clone(), hook) {
            installed.dedup();
            remove_hooks(model, strategy, &mut installed);
            return Err(e.into());
        }
        installed.push(module);
    }
    installed.sort_unstable();
    installed.dedup();
    Ok(installed)
}

/// Removes the strategy's hooks from `modules` (and only its own).
pub(crate) fn remove_hooks(
    model: &mut Model,
    strategy: OffloadStrategy,
    modules: &mut Vec<crate::model::ModuleId>,
) {
    let owner = offload_hooks::HookOwner::new(strategy.hook_name());
    for m in modules.drain(..) {
        model.hooks_of(m).remove_owned_by(&owner);
    }
}
