//! The layerwise strategy (CONTRACT §7).
//!
//! * Host: each block's storages are packed into one pinned host master of
//!   exactly the block's bytes, filled straight from the weight source, once.
//! * Device: one slot pool of `depth + 1` buffers of the largest block,
//!   allocated once and shared by every ring (stack). Each slot owns a
//!   *ready* event (recorded on the copy stream after its fill) and a
//!   *last use* event (recorded on the compute stream after the forward that
//!   read it), and a stamp naming the (ring, block) it holds.
//! * Pre-forward of block i: find the slot stamped (ring, i) or fill one on
//!   demand (its predecessor was skipped); make the compute stream wait for
//!   the slot's ready event; point the block's tensors into the slot; then
//!   make sure blocks i+1..=i+depth (wrapping to block 0) are filling. A fill
//!   takes the least recently filled free slot: the copy stream waits for its
//!   last use, copies, records ready. The host never waits.
//! * Post-forward: record the slot's last use; the block's tensors go back
//!   to their host masters. Nothing is copied back.
//!
//! The distributed strategy adds its gather step in [`Fill`]: the copy into
//! the slot becomes copy-shard-then-gather.

use crate::sync::{Arc, Mutex, MutexGuard, lock};

use offload_hooks::{BoxError, Forwarded, ModelHook, PreForward};

use crate::config::{OffloadConfig, OffloadStrategy};
use crate::device::{Api, Device, DeviceBuffer};
use crate::discovery::log_warnings;
use crate::lifecycle::{
    DisableStep, EnableStep, Lifecycle, LifecycleState, OffloadBackend, OffloadError,
};
use crate::model::{ModuleId, StorageId};
use crate::residency::{Residency, Transition};
use crate::runtime::layout::Unit;
use crate::runtime::shared::{
    Handles, HostMaster, Placement, bytes_of, check_single_owner, dev_err, install_hooks,
    plan_and_partition, remove_hooks,
};
use crate::runtime::slots::SlotTable;
use crate::runtime::{Backend, Bugs, DeviceLocation, ForwardCtx, Model, PlantedBug, WeightSource};

/// One block's host master.
struct Master<A: Api> {
    unit: Unit,
    host: HostMaster<A>,
}

/// One ring: the blocks of one stack, in forward order.
struct Ring<A: Api> {
    blocks: Vec<Master<A>>,
}

/// One device slot and the events that order its reuse.
struct Slot<A: Api> {
    buffer: Arc<A::DeviceBuffer>,
    ready: A::Event,
    last_use: A::Event,
}

struct State<A: Api> {
    placement: Placement<A>,
    resident: Vec<Arc<A::DeviceBuffer>>,
    rings: Vec<Ring<A>>,
    slots: Vec<Slot<A>>,
    table: SlotTable,
    depth: usize,
    /// Extra host masters kept only when a planted bug asks for them.
    shadow_masters: Vec<HostMaster<A>>,
    /// The slot each block was last filled into (read only by the
    /// `IgnoreRingStamp` planted bug, which trusts it over the stamps).
    filled_into: Vec<Vec<Option<usize>>>,
}

struct Shared<A: Api> {
    handles: Handles<A>,
    bugs: Bugs,
    state: Mutex<Option<State<A>>>,
}

impl<A: Api> Shared<A> {
    fn lock(&self) -> MutexGuard<'_, Option<State<A>>> {
        lock(&self.state)
    }

    fn bug(&self, bug: PlantedBug) -> bool {
        self.bugs.has(bug)
    }
}

/// Why a block is being filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FillKind {
    /// Block 0 of the first ring, at enable.
    Initial,
    /// A prefetch from the pre-forward of an earlier block (`wrap`: the
    /// ring's end fetching its start).
    Prefetch { wrap: bool },
    /// The block arrived unmaterialised: copied on demand.
    OnDemand,
}

/// The fill step of the ring: host master → slot. (DLO replaces the copy by
/// copy-shard-then-gather.)
trait Fill<A: Api> {
    fn fill(
        &self,
        shared: &Shared<A>,
        st: &mut State<A>,
        ring: usize,
        block: usize,
        kind: FillKind,
    ) -> Result<usize, OffloadError>;
}

struct CopyFill;

impl CopyFill {
    /// The slot to fill: the least recently filled free one (or, with the
    /// `StaticSlot` planted bug, the block's index modulo the slot count,
    /// in use or not).
    fn choose<A: Api>(
        shared: &Shared<A>,
        st: &mut State<A>,
        ring: usize,
        block: usize,
    ) -> Result<(usize, Option<(usize, usize)>), OffloadError> {
        if shared.bug(PlantedBug::StaticSlot) {
            let global = st.rings[..ring]
                .iter()
                .map(|r| r.blocks.len())
                .sum::<usize>()
                + block;
            let k = global % st.slots.len();
            return Ok((k, st.table.evict_unchecked(k, ring, block)));
        }
        let k = st.table.victim().ok_or_else(|| OffloadError::Forward {
            module: st.rings[ring].blocks[block].unit.name.clone(),
            reason: format!(
                "all {} slots are in use (nested block forwards?)",
                st.slots.len()
            ),
        })?;
        Ok((k, st.table.evict(k, ring, block)))
    }
}

impl<A: Api> Fill<A> for CopyFill {
    fn fill(
        &self,
        shared: &Shared<A>,
        st: &mut State<A>,
        ring: usize,
        block: usize,
        kind: FillKind,
    ) -> Result<usize, OffloadError> {
        let h = &shared.handles;
        let (k, previous) = Self::choose(shared, st, ring, block)?;
        // The slot's previous content is gone: a prefetch nobody consumed
        // is discarded.
        if let Some((r, b)) = previous {
            let old = &st.rings[r].blocks[b].unit;
            if st.placement.residency_of(old.entries[0].storage) == Some(Residency::InFlight)
                && !shared.bug(PlantedBug::IgnoreRingStamp)
            {
                st.placement.transition(old, Transition::Discard)?;
            }
        }
        let skip_wait = shared.bug(PlantedBug::SkipLastUseWait)
            || (kind == FillKind::OnDemand && shared.bug(PlantedBug::OnDemandSkipLastUseWait))
            || (kind == (FillKind::Prefetch { wrap: true })
                && shared.bug(PlantedBug::WrapAroundSkipLastUseWait));
        let source = if shared.bug(PlantedBug::WrongMaster) {
            (block + 1) % st.rings[ring].blocks.len()
        } else {
            block
        };
        let master = &st.rings[ring].blocks[source];
        let slot = &st.slots[k];
        if !skip_wait {
            h.device
                .stream_wait_event(&h.copy, &slot.last_use)
                .map_err(|e| dev_err("stream_wait_event(copy, last use)", e))?;
        }
        let stale = shared.bug(PlantedBug::StaleSlot) && matches!(kind, FillKind::Prefetch { .. });
        if !stale {
            // SAFETY: the master is exactly `unit.bytes` and the slot holds
            // the largest block, so both ranges are in bounds; the copy
            // stream waits for the slot's last use above (nothing reads the
            // slot while it is overwritten), compute waits for `ready`
            // (recorded next) before reading it, and the master is freed
            // only after draining.
            unsafe {
                h.device.copy_h2d(
                    &h.copy,
                    master.host.source(),
                    0,
                    &slot.buffer,
                    0,
                    master
                        .unit
                        .bytes
                        .min(st.rings[ring].blocks[block].unit.bytes),
                )
            }
            .map_err(|e| dev_err(format!("copy_h2d of `{}`", master.unit.name), e))?;
        }
        h.device
            .record_event(&slot.ready, &h.copy)
            .map_err(|e| dev_err("record_event(ready)", e))?;
        let unit = st.rings[ring].blocks[block].unit.clone();
        let already =
            st.placement.residency_of(unit.entries[0].storage) == Some(Residency::InFlight);
        if !(already && shared.bug(PlantedBug::IgnoreRingStamp)) {
            st.placement.transition(&unit, Transition::IssueCopy)?;
        }
        st.table.filled(k, ring, block);
        st.filled_into[ring][block] = Some(k);
        Ok(k)
    }
}

/// The hook on one block.
struct BlockHook<A: Api> {
    shared: Arc<Shared<A>>,
    ring: usize,
    block: usize,
}

impl<A: Api> BlockHook<A> {
    fn pre(&self) -> Result<(), OffloadError> {
        let shared = &*self.shared;
        let h = &shared.handles;
        let mut guard = shared.lock();
        let st = guard.as_mut().ok_or_else(disabled)?;
        let (r, i) = (self.ring, self.block);
        let unit = st.rings[r].blocks[i].unit.clone();
        let stamped = st.table.holding(r, i);
        let inflight =
            st.placement.residency_of(unit.entries[0].storage) == Some(Residency::InFlight);
        let k = match (stamped, inflight) {
            (Some(k), true) => k,
            // Planted: trust the slot the block was filled into, though
            // another ring may have refilled it since.
            (None, true) if shared.bug(PlantedBug::IgnoreRingStamp) => {
                let k = st.filled_into[r][i].expect("an in-flight block was filled");
                st.table.evict_unchecked(k, r, i);
                st.table.filled(k, r, i);
                k
            }
            // Not materialised (a hook skipped the predecessor, another ring
            // took the slot, or the block runs twice): copy on demand.
            _ => CopyFill.fill(shared, st, r, i, FillKind::OnDemand)?,
        };
        let read_slot = if shared.bug(PlantedBug::WrongSlot) {
            (k + 1) % st.table.len()
        } else {
            k
        };
        st.table.acquire(k);
        if !shared.bug(PlantedBug::SkipReadyWait) {
            h.device
                .stream_wait_event(&h.compute, &st.slots[k].ready)
                .map_err(|e| dev_err("stream_wait_event(compute, ready)", e))?;
        }
        if shared.bug(PlantedBug::LastUseBeforeCompute) {
            h.device
                .record_event(&st.slots[k].last_use, &h.compute)
                .map_err(|e| dev_err("record_event(last use)", e))?;
        }
        st.placement.transition(&unit, Transition::CopyDone)?;
        let buffer = Arc::clone(&st.slots[read_slot].buffer);
        st.placement.place(&unit, &buffer);
        if shared.bug(PlantedBug::ShiftedPlacement) {
            st.placement.shift_second_entry(&unit, 2);
        }
        let n = st.rings[r].blocks.len();
        for j in 1..=st.depth.min(n - 1) {
            let b = (i + j) % n;
            let ready = st.table.holding(r, b).is_some()
                && st
                    .placement
                    .residency_of(st.rings[r].blocks[b].unit.entries[0].storage)
                    == Some(Residency::InFlight);
            // Prefetch only into a free slot; with none free (another
            // ring's block is being read) the block is copied on demand.
            if !ready && (st.table.victim().is_some() || shared.bug(PlantedBug::StaticSlot)) {
                CopyFill.fill(shared, st, r, b, FillKind::Prefetch { wrap: b < i })?;
            }
        }
        Ok(())
    }

    fn post(&self) -> Result<(), OffloadError> {
        let shared = &*self.shared;
        let h = &shared.handles;
        let mut guard = shared.lock();
        let st = guard.as_mut().ok_or_else(disabled)?;
        let unit = st.rings[self.ring].blocks[self.block].unit.clone();
        match st.table.release(self.ring, self.block) {
            Some(k) => {
                if !shared.bug(PlantedBug::LastUseBeforeCompute) {
                    h.device
                        .record_event(&st.slots[k].last_use, &h.compute)
                        .map_err(|e| dev_err("record_event(last use)", e))?;
                }
            }
            // Planted: a static slot choice refilled the slot under this
            // block; it no longer holds it, and its last use goes unrecorded.
            None if shared.bug(PlantedBug::StaticSlot) => {}
            None => return Ok(()),
        }
        st.placement.unplace(&unit);
        st.placement.transition(&unit, Transition::Release)?;
        Ok(())
    }
}

/// Storages only non-persistent buffers view.
fn non_persistent(p: &crate::model::Pipeline) -> std::collections::BTreeSet<StorageId> {
    use crate::model::TensorKind;
    let persistent: std::collections::BTreeSet<StorageId> = p
        .tensors()
        .filter(|(_, t)| t.kind != TensorKind::Buffer { persistent: false })
        .map(|(_, t)| t.storage)
        .collect();
    p.tensors()
        .map(|(_, t)| t.storage)
        .filter(|s| !persistent.contains(s))
        .collect()
}

fn disabled() -> OffloadError {
    OffloadError::Forward {
        module: String::new(),
        reason: "layerwise offload is disabled".to_owned(),
    }
}

impl<A: Api> ModelHook<ForwardCtx> for BlockHook<A> {
    fn pre_forward(&mut self, _: &mut ForwardCtx) -> Result<PreForward, BoxError> {
        self.pre()?;
        Ok(PreForward::Continue)
    }

    fn post_forward(&mut self, _: &mut ForwardCtx, _: &Forwarded) -> Result<(), BoxError> {
        Ok(self.post()?)
    }
}

/// Streams DiT (and encoder) blocks through a ring of device slots.
///
/// Dropping it while enabled (without [`OffloadBackend::disable`]) drains
/// its streams before freeing anything; if draining fails, the memory the
/// device may still touch is leaked with a logged error, never freed.
pub struct LayerwiseBackend<A: Api> {
    config: OffloadConfig,
    depth: usize,
    lifecycle: Lifecycle,
    shared: Arc<Shared<A>>,
    hooked: Vec<ModuleId>,
}

impl<A: Api> LayerwiseBackend<A> {
    /// A layerwise backend with `depth` blocks prefetched (1 by default).
    pub fn new(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
        config: OffloadConfig,
        depth: usize,
    ) -> Result<Self, OffloadError> {
        Self::with_bugs(device, compute, weights, config, depth, Bugs::default())
    }

    pub(crate) fn with_bugs(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
        config: OffloadConfig,
        depth: usize,
        bugs: Bugs,
    ) -> Result<Self, OffloadError> {
        Ok(Self {
            config,
            depth: depth.max(1),
            lifecycle: Lifecycle::new(OffloadStrategy::Layerwise),
            shared: Arc::new(Shared {
                handles: Handles::new(device, compute, weights)?,
                bugs,
                state: Mutex::new(None),
            }),
            hooked: Vec::new(),
        })
    }

    fn new_state(&self, model: &Model) -> State<A> {
        State {
            placement: Placement::new(&model.pipeline, OffloadStrategy::Layerwise),
            resident: Vec::new(),
            rings: Vec::new(),
            slots: Vec::new(),
            table: SlotTable::new(0),
            depth: self.depth,
            shadow_masters: Vec::new(),
            filled_into: Vec::new(),
        }
    }

    /// Builds host masters, resident units and the slot pool into `st`; on
    /// error, `st` holds what was built, for [`Self::release`].
    fn build(&self, model: &Model, st: &mut State<A>) -> Result<(), OffloadError> {
        let (plan, partition) = plan_and_partition(&model.pipeline, &self.config)?;
        if plan.strategy() != OffloadStrategy::Layerwise {
            return Err(OffloadError::Unsupported {
                platform: "layerwise backend".to_owned(),
                strategy: plan.strategy(),
            });
        }
        log_warnings(&plan.warnings);
        let h = &self.shared.handles;
        let skip = if self.shared.bug(PlantedBug::SkipNonPersistent) {
            non_persistent(&model.pipeline)
        } else {
            Default::default()
        };
        let streamed: std::collections::BTreeSet<ModuleId> = plan
            .stacks
            .iter()
            .flat_map(|s| s.blocks.iter().map(|b| b.module))
            .collect();
        // Host masters, pinned once, exact size.
        for stack in &plan.stacks {
            st.rings.push(Ring { blocks: Vec::new() });
            st.filled_into.push(vec![None; stack.blocks.len()]);
            for block in &stack.blocks {
                let unit = partition.blocks[&block.module].clone();
                let host = h.master(&unit, &skip)?;
                st.placement.claim(&unit)?;
                st.rings
                    .last_mut()
                    .expect("pushed above")
                    .blocks
                    .push(Master { unit, host });
                if self.shared.bug(PlantedBug::SecondHostCopy) {
                    let unit = &partition.blocks[&block.module];
                    st.shadow_masters
                        .push(HostMaster::Pinned(h.fill_pinned(unit, &skip)?));
                }
            }
        }
        // Everything else stays resident.
        let resident_units = partition.rest.iter().chain(
            partition
                .blocks
                .iter()
                .filter(|(m, _)| !streamed.contains(m))
                .map(|(_, u)| u),
        );
        for unit in resident_units {
            let buffer = Arc::new(h.upload(unit, &skip)?);
            st.resident.push(Arc::clone(&buffer));
            st.placement.resident(unit, &buffer)?;
        }
        // The slot pool: depth + 1 slots of the largest block, allocated once.
        let slot_bytes = plan.largest_block_bytes();
        let slots = self.depth + 1 + usize::from(self.shared.bug(PlantedBug::ExtraSlot));
        st.table = SlotTable::new(slots);
        for k in 0..slots {
            let ready = h
                .device
                .create_event()
                .map_err(|e| dev_err("create_event", e))?;
            let last_use = h
                .device
                .create_event()
                .map_err(|e| dev_err("create_event", e))?;
            let buffer = h.device.alloc_device(slot_bytes).map_err(|e| {
                dev_err(format!("alloc_device({slot_bytes} bytes) for slot {k}"), e)
            })?;
            h.device.name_buffer(&buffer, &format!("slot{k}"));
            st.slots.push(Slot {
                buffer: Arc::new(buffer),
                ready,
                last_use,
            });
        }
        // Block 0 of the first ring is materialised before the first forward.
        if !st.rings.is_empty() {
            CopyFill.fill(&self.shared, st, 0, 0, FillKind::Initial)?;
        }
        Ok(())
    }

    /// Frees everything `st` holds, after draining both streams (unless
    /// `drain` is false, which only planted bugs ask for). If draining
    /// fails, everything is leaked (the device may still touch it) and the
    /// error returned; otherwise every free runs and the first error is
    /// returned.
    fn release(&self, st: State<A>, drain: bool) -> Result<(), OffloadError> {
        let h = &self.shared.handles;
        let leak = self.shared.bug(PlantedBug::LeakHostMasters);
        h.release("layerwise", st, drain, |st, first| {
            // Placement holds references to the buffers: drop it first.
            drop(st.placement);
            for slot in st.slots {
                if let Err(e) = h.free(slot.buffer, &[&slot.ready, &slot.last_use], "slot") {
                    first.get_or_insert(e);
                }
            }
            h.free_all(st.resident, "resident unit", first);
            for master in st
                .rings
                .into_iter()
                .flat_map(|r| r.blocks)
                .map(|m| m.host)
                .chain(st.shadow_masters)
            {
                if leak {
                    std::mem::forget(master);
                    continue;
                }
                // SAFETY: both streams were drained (`release` runs this
                // only after a successful drain, or for a planted bug), so
                // no copy reads the master any more.
                if let Err(e) = unsafe { h.free_master(master) } {
                    first.get_or_insert(e);
                }
            }
        })
    }

    /// Bytes of one slot, and the slot count.
    pub fn slots(&self) -> (u64, usize) {
        let guard = self.shared.lock();
        guard.as_ref().map_or((0, 0), |st| {
            (
                st.slots.first().map_or(0, |s| s.buffer.len_bytes()),
                st.slots.len(),
            )
        })
    }
}

impl<A: Api> Drop for LayerwiseBackend<A> {
    fn drop(&mut self) {
        let st = self.shared.lock().take();
        if let Some(st) = st {
            let drain = !self.shared.bug(PlantedBug::DropWithoutDrain);
            if let Err(e) = self.release(st, drain) {
                tracing::error!("dropping an enabled layerwise backend: {e}");
            }
        }
    }
}

impl<A: Api> OffloadBackend for LayerwiseBackend<A> {
    fn strategy(&self) -> OffloadStrategy {
        OffloadStrategy::Layerwise
    }

    fn enable(&mut self, model: &mut Model) -> Result<(), OffloadError> {
        if self.lifecycle.begin_enable()? == EnableStep::AlreadyEnabled {
            return Ok(());
        }
        if !self.shared.bug(PlantedBug::IgnoreOtherOwner) {
            check_single_owner(model, OffloadStrategy::Layerwise)?;
        }
        let mut st = self.new_state(model);
        if let Err(e) = self.build(model, &mut st) {
            let _ = self.release(st, true);
            return Err(e);
        }
        let blocks: Vec<(usize, usize, ModuleId)> = st
            .rings
            .iter()
            .enumerate()
            .flat_map(|(r, ring)| {
                ring.blocks
                    .iter()
                    .enumerate()
                    .map(move |(i, m)| (r, i, m.unit.module))
            })
            .collect();
        *self.shared.lock() = Some(st);
        // Hooks last: nothing above touched the model.
        let hooks = blocks
            .into_iter()
            .map(|(r, i, module)| {
                let hook: Box<dyn ModelHook<ForwardCtx>> = Box::new(BlockHook {
                    shared: Arc::clone(&self.shared),
                    ring: r,
                    block: i,
                });
                (module, hook)
            })
            .collect();
        let rollback = !self.shared.bug(PlantedBug::NoRollback);
        match install_hooks(model, OffloadStrategy::Layerwise, hooks, rollback) {
            Ok(installed) => self.hooked = installed,
            Err(e) => {
                let st = if rollback {
                    self.shared.lock().take()
                } else {
                    None
                };
                if let Some(st) = st {
                    let _ = self.release(st, true);
                }
                return Err(e);
            }
        }
        self.lifecycle.finish_enable();
        Ok(())
    }

    fn disable(&mut self, model: &mut Model) -> Result<(), OffloadError> {
        if self.lifecycle.begin_disable() == DisableStep::NothingToDo {
            return Ok(());
        }
        remove_hooks(model, OffloadStrategy::Layerwise, &mut self.hooked);
        let st = self.shared.lock().take();
        let drain = !self.shared.bug(PlantedBug::FreeWithoutDrain);
        let result = st.map_or(Ok(()), |st| self.release(st, drain));
        self.lifecycle.finish_disable();
        result
    }

    fn is_enabled(&self) -> bool {
        self.lifecycle.is_enabled()
    }

    fn state(&self) -> LifecycleState {
        self.lifecycle.state().clone()
    }
}

impl<A: Api> Backend<A> for LayerwiseBackend<A> {
    fn locate(&self, storage: StorageId) -> Option<DeviceLocation<A>> {
        self.shared.lock().as_ref()?.placement.locate(storage)
    }

    fn residency(&self, storage: StorageId) -> Option<Residency> {
        self.shared.lock().as_ref()?.placement.residency_of(storage)
    }

    fn device_weight_bytes(&self) -> u64 {
        let guard = self.shared.lock();
        guard.as_ref().map_or(0, |st| {
            let slots: Vec<Arc<A::DeviceBuffer>> =
                st.slots.iter().map(|s| Arc::clone(&s.buffer)).collect();
            bytes_of::<A>(&st.resident) + bytes_of::<A>(&slots)
        })
    }

    fn host_weight_bytes(&self) -> u64 {
        let guard = self.shared.lock();
        guard.as_ref().map_or(0, |st| {
            let masters: u64 = st
                .rings
                .iter()
                .flat_map(|r| &r.blocks)
                .map(|m| m.unit.bytes)
                .sum();
            let shadows: u64 = st.shadow_masters.iter().map(HostMaster::len_bytes).sum();
            masters + shadows
        })
    }
}
