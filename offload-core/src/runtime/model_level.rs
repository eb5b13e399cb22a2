//! The model-level strategy (CONTRACT §6): offloaded components are
//! mutually exclusive on the device. Pre-forward of a component evicts the
//! others (weights are immutable: eviction frees the device copy after its
//! last use, no device→host copy), brings this one in on the copy stream and
//! makes compute wait for it. VAEs and resident modules stay on the device.

use crate::sync::Arc;
use std::collections::BTreeSet;

use offload_hooks::{BoxError, Forwarded, ModelHook, PreForward};

use crate::config::{OffloadConfig, OffloadStrategy};
use crate::device::{Api, Device};
use crate::discovery::log_warnings;
use crate::lifecycle::{
    DisableStep, EnableStep, Lifecycle, LifecycleState, OffloadBackend, OffloadError,
};
use crate::model::{ModuleId, StorageId};
use crate::residency::{Residency, Transition};
use crate::runtime::backend::{Backend, DeviceLocation, WeightSource};
use crate::runtime::bugs::{Bugs, PlantedBug};
use crate::runtime::filler::StagingRing;
use crate::runtime::hooks::{ForwardCtx, Model};
use crate::runtime::layout::Unit;
use crate::runtime::shared::{
    Handles, HostMaster, Placement, Shared, StrategyState, bytes_of, check_single_owner, dev_err,
    install_hooks, plan_and_partition, remove_hooks, swapped_components,
};

pub(crate) struct Component<A: Api> {
    path: String,
    module: ModuleId,
    /// Each unit and its host master (shared with a planned backend's
    /// store, which then frees it; otherwise this component's own).
    units: Vec<(Unit, Arc<HostMaster<A>>)>,
    on_device: Vec<Arc<A::DeviceBuffer>>,
    ready: A::Event,
    last_use: A::Event,
    /// Between its pre- and post-forward: its kernels may still be
    /// enqueued, and its last use is not recorded yet, so it must not be
    /// evicted (a nested forward of another component would).
    in_use: bool,
}

pub(crate) struct State<A: Api> {
    placement: Placement<A>,
    resident: Vec<Arc<A::DeviceBuffer>>,
    components: Vec<Component<A>>,
    /// The pinned upload buffer a swapped held unit whose master is staged
    /// (`pin_cpu_memory = false`, or its pin refused; CONTRACT §6, §7c) is
    /// brought in through at each of its phases; none where no held unit
    /// is staged.
    upload: Option<StagingRing<A>>,
}

impl<A: Api> StrategyState<A> for State<A> {
    fn placement(&self) -> &Placement<A> {
        &self.placement
    }

    fn device_weight_bytes(&self) -> u64 {
        bytes_of::<A>(&self.resident)
            + self
                .components
                .iter()
                .map(|c| bytes_of::<A>(&c.on_device))
                .sum::<u64>()
    }

    fn host_weight_bytes(&self) -> u64 {
        self.components
            .iter()
            .flat_map(|c| &c.units)
            .map(|(_, h)| h.len_bytes())
            .sum::<u64>()
            + self.upload.as_ref().map_or(0, StagingRing::bytes)
    }
}

impl<A: Api> Shared<A, State<A>> {
    /// The pinned bytes of the upload buffer staged held units are brought
    /// in through (0 where none is held).
    pub(crate) fn upload_bytes(&self) -> u64 {
        self.lock()
            .as_ref()
            .and_then(|st| st.upload.as_ref())
            .map_or(0, StagingRing::bytes)
    }

    fn evict(&self, st: &mut State<A>, c: usize) -> Result<(), OffloadError> {
        let comp = &mut st.components[c];
        let buffers = std::mem::take(&mut comp.on_device);
        for (unit, _) in &comp.units {
            st.placement.unplace(unit);
            st.placement.transition(unit, Transition::Release)?;
        }
        let after: &[&A::Event] = if self.bug(PlantedBug::EvictWithoutLastUse) {
            &[&comp.ready]
        } else {
            &[&comp.ready, &comp.last_use]
        };
        for b in buffers {
            self.handles.free(b, after, &comp.path)?;
        }
        Ok(())
    }

    /// Brings component `c` in: all units or none. On failure the buffers
    /// already allocated are freed after the copies already enqueued.
    fn bring_in(&self, st: &mut State<A>, c: usize) -> Result<(), OffloadError> {
        let h = &self.handles;
        let comp = &mut st.components[c];
        let upload = st.upload.as_ref();
        let mut buffers: Vec<Arc<A::DeviceBuffer>> = Vec::new();
        let mut copy_all = || -> Result<(), OffloadError> {
            for (unit, host) in &comp.units {
                if matches!(**host, HostMaster::Staged(_)) {
                    // Unpinned, or its pin was refused (CONTRACT §7c): from
                    // pageable memory through the upload buffer, chunk by
                    // chunk (the host waits for each chunk's copy, and for
                    // the last).
                    let ring = upload.ok_or_else(|| OffloadError::Forward {
                        module: unit.name.clone(),
                        reason: "its host master is staged and no upload buffer is held to bring it in through".to_owned(),
                    })?;
                    let buffer = crate::runtime::layerwise::upload_staged(h, unit, ring)?;
                    if self.bug(PlantedBug::StagedBringInSkipsCopy) {
                        // Planted: the staged unit's fresh buffer, never
                        // written, stands in for the uploaded one.
                        let fresh = h.device.alloc_device(unit.bytes);
                        // SAFETY: `upload_staged` synchronised the copy
                        // stream: nothing uses `buffer` any more.
                        let _ = unsafe { h.device.free_device(buffer, &[]) };
                        let fresh = fresh.map_err(|e| {
                            dev_err(format!("alloc_device({} bytes)", unit.bytes), e)
                        })?;
                        buffers.push(Arc::new(fresh));
                    } else {
                        buffers.push(Arc::new(buffer));
                    }
                    continue;
                }
                let buffer = h.device.alloc_device(unit.bytes).map_err(|e| {
                    dev_err(
                        format!("alloc_device({} bytes) for `{}`", unit.bytes, unit.name),
                        e,
                    )
                })?;
                h.device.name_buffer(&buffer, &unit.name);
                let buffer = Arc::new(buffer);
                buffers.push(Arc::clone(&buffer));
                let _span =
                    crate::runtime::shared::transfer_span(&unit.name, unit.bytes, "copy", "h2d")
                        .entered();
                let source = host.copy_source(&format!("copy_h2d of `{}`", unit.name))?;
                // SAFETY: the buffer is new and exactly `unit.bytes`, as is
                // the master; compute waits for `ready` (recorded below,
                // after every copy) before reading it; it is freed only
                // after `ready` and `last_use`.
                unsafe {
                    h.device
                        .copy_h2d(&h.copy, source, 0, &buffer, 0, unit.bytes)
                }
                .map_err(|e| dev_err(format!("copy_h2d of `{}`", unit.name), e))?;
            }
            Ok(())
        };
        let copied = copy_all();
        // `ready` covers every copy enqueued, whether or not all succeeded.
        let recorded = h
            .device
            .record_event(&comp.ready, &h.copy)
            .map_err(|e| dev_err("record_event(ready)", e));
        let recorded_ok = recorded.is_ok();
        if let Some(e) = copied.err().or(recorded.err()) {
            if !recorded_ok {
                // `ready` does not cover the copies just enqueued: wait for
                // them on the host, or leak what they may still write.
                if h.device.synchronize_stream(&h.copy).is_ok() {
                    h.free_all(buffers, &comp.path, &mut None);
                } else {
                    tracing::error!(
                        "bring-in of `{}`: {e}; leaking its device buffers",
                        comp.path
                    );
                    std::mem::forget(buffers);
                }
                return Err(e);
            }
            let after: &[&A::Event] = if self.bug(PlantedBug::FailedBringInFreeWithoutWait) {
                &[]
            } else {
                &[&comp.ready]
            };
            for b in buffers {
                let _ = h.free(b, after, &comp.path);
            }
            return Err(e);
        }
        for ((unit, _), buffer) in comp.units.iter().zip(&buffers) {
            st.placement.transition(unit, Transition::IssueCopy)?;
            st.placement.place(unit, buffer);
        }
        comp.on_device = buffers;
        Ok(())
    }
}

struct ComponentHook<A: Api> {
    shared: Arc<Shared<A, State<A>>>,
    component: usize,
}

impl<A: Api> ComponentHook<A> {
    fn pre(&self) -> Result<(), OffloadError> {
        enter(&self.shared, self.component)
    }

    fn post(&self) -> Result<(), OffloadError> {
        leave(&self.shared, self.component)
    }
}

/// Component `c`'s pre-forward: unless it is on the device, evict every
/// other component (each freed after its last use) and bring it in (all or
/// nothing); then make compute wait for its bring-in. Refused while another
/// component runs its forward. The model-level strategy's hook, and the
/// planned backend's for each component's held set.
pub(crate) fn enter<A: Api>(shared: &Shared<A, State<A>>, c: usize) -> Result<(), OffloadError> {
    let h = &shared.handles;
    let mut guard = shared.lock();
    let st = guard.as_mut().ok_or_else(disabled)?;
    if st.components[c].on_device.is_empty() {
        let others: Vec<usize> = (0..st.components.len())
            .filter(|d| *d != c && !st.components[*d].on_device.is_empty())
            .collect();
        if let Some(d) = others.iter().find(|d| st.components[**d].in_use) {
            return Err(OffloadError::Forward {
                module: st.components[c].path.clone(),
                reason: format!(
                    "model-level offload cannot bring it in while `{}` runs its forward (it would evict weights its kernels still read); run one offloaded component at a time",
                    st.components[*d].path
                ),
            });
        }
        let early = shared.bug(PlantedBug::BringInBeforeEvict);
        if early {
            shared.bring_in(st, c)?;
        }
        for d in others {
            shared.evict(st, d)?;
        }
        if !early {
            shared.bring_in(st, c)?;
        }
    }
    if !shared.bug(PlantedBug::BringInWithoutReady) {
        h.device
            .stream_wait_event(&h.compute, &st.components[c].ready)
            .map_err(|e| dev_err("stream_wait_event(compute, ready)", e))?;
    }
    for (unit, _) in &st.components[c].units {
        if st.placement.residency_of(unit.entries[0].storage) == Some(Residency::InFlight) {
            st.placement.transition(unit, Transition::CopyDone)?;
        }
    }
    st.components[c].in_use = true;
    Ok(())
}

/// Component `c`'s post-forward: its last use is recorded on the compute
/// stream (its eviction frees after it).
pub(crate) fn leave<A: Api>(shared: &Shared<A, State<A>>, c: usize) -> Result<(), OffloadError> {
    let h = &shared.handles;
    let mut guard = shared.lock();
    let st = guard.as_mut().ok_or_else(disabled)?;
    let comp = &mut st.components[c];
    comp.in_use = false;
    h.device
        .record_event(&comp.last_use, &h.compute)
        .map_err(|e| dev_err("record_event(last use)", e))
}

/// Evicts every component on the device but `keep` (each freed after its
/// last use); refused while one of them runs its forward.
pub(crate) fn evict_others<A: Api>(
    shared: &Shared<A, State<A>>,
    keep: Option<usize>,
) -> Result<(), OffloadError> {
    let mut guard = shared.lock();
    let Some(st) = guard.as_mut() else {
        return Ok(());
    };
    for c in 0..st.components.len() {
        if Some(c) == keep || st.components[c].on_device.is_empty() {
            continue;
        }
        if st.components[c].in_use {
            return Err(OffloadError::Forward {
                module: st.components[c].path.clone(),
                reason: "another component's forward began while this one's runs (nested forwards?); run one component at a time".to_owned(),
            });
        }
        shared.evict(st, c)?;
    }
    Ok(())
}

fn disabled() -> OffloadError {
    OffloadError::Disabled {
        strategy: OffloadStrategy::ModelLevel,
    }
}

impl<A: Api> ModelHook<ForwardCtx> for ComponentHook<A> {
    fn pre_forward(&mut self, _: &mut ForwardCtx) -> Result<PreForward, BoxError> {
        self.pre()?;
        Ok(PreForward::Continue)
    }

    fn post_forward(&mut self, _: &mut ForwardCtx, _: &Forwarded) -> Result<(), BoxError> {
        Ok(self.post()?)
    }
}

/// Swaps whole components between host masters and the device.
///
/// Dropping it while enabled drains its streams before freeing anything (a
/// failed drain leaks, with a logged error).
pub struct ModelLevelBackend<A: Api> {
    config: OffloadConfig,
    lifecycle: Lifecycle,
    shared: Arc<Shared<A, State<A>>>,
    hooked: Vec<ModuleId>,
}

impl<A: Api> ModelLevelBackend<A> {
    /// A model-level backend on `device`.
    pub fn new(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
        config: OffloadConfig,
    ) -> Result<Self, OffloadError> {
        Self::with_bugs(device, compute, weights, config, Bugs::default())
    }

    pub(crate) fn with_bugs(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
        config: OffloadConfig,
        bugs: Bugs,
    ) -> Result<Self, OffloadError> {
        // `pin_cpu_memory = false` stages every master (`build`).
        config.select()?;
        Ok(Self {
            config,
            lifecycle: Lifecycle::new(OffloadStrategy::ModelLevel),
            shared: Arc::new(Shared::new(Handles::new(device, compute, weights)?, bugs)),
            hooked: Vec::new(),
        })
    }

    /// Builds host masters and resident units into `st`; on error, `st`
    /// holds what was built, for [`Self::release`].
    fn build(&self, model: &Model, st: &mut State<A>) -> Result<(), OffloadError> {
        let (plan, partition) = plan_and_partition(
            &model.pipeline,
            &self.config,
            Some(&*self.shared.handles.weights),
        )?;
        log_warnings(&plan.warnings);
        let h = &self.shared.handles;
        // `pin_cpu_memory = false` (CONTRACT §7c): every master stays in
        // pageable memory; a swapped unit is brought in at each of its
        // phases, and a resident unit uploaded once, through one pinned
        // upload buffer (`st.upload`). A pin the device refuses (not a lost
        // device) stages its unit too.
        let unpinned = !plan.selection.pin_memory;
        let mut swapped: BTreeSet<StorageId> = BTreeSet::new();
        let mut largest_staged: Option<u64> = None;
        for (comp, units) in swapped_components(&model.pipeline, &plan, &partition) {
            let ready = h
                .device
                .create_event()
                .map_err(|e| dev_err("create_event", e))?;
            let last_use = h
                .device
                .create_event()
                .map_err(|e| dev_err("create_event", e))?;
            st.components.push(Component {
                path: comp.path.clone(),
                module: comp.module,
                units: Vec::new(),
                on_device: Vec::new(),
                ready,
                last_use,
                in_use: false,
            });
            for unit in units {
                let (master, why) = if unpinned {
                    (None, "pin_cpu_memory = false")
                } else {
                    let then = "its phase brings it in from pageable memory each time";
                    (
                        h.master_or_refused(unit, true, then)?,
                        "its pin was refused",
                    )
                };
                let host = match master {
                    Some(m) => m,
                    None => {
                        tracing::info!(unit = %unit.name, bytes = unit.bytes, "`{}` is brought in from pageable memory at each of its phases, through a pinned upload buffer ({why})", unit.name);
                        largest_staged = largest_staged.max(Some(unit.bytes));
                        h.counted(HostMaster::Staged(crate::runtime::shared::Staged {
                            bytes: unit.bytes,
                            coded: None,
                        }))
                    }
                };
                swapped.extend(unit.entries.iter().map(|e| e.storage));
                st.placement.claim(unit)?;
                st.components
                    .last_mut()
                    .expect("pushed above")
                    .units
                    .push((unit.clone(), Arc::new(host)));
            }
        }
        let resident: Vec<&Unit> = partition
            .all()
            .filter(|u| !u.entries.iter().any(|e| swapped.contains(&e.storage)))
            .collect();
        let largest_resident = resident.iter().map(|u| u.bytes).max();
        // One pinned upload buffer, of the largest unit that goes through
        // it (at most `UPLOAD_STAGING_BYTES`: larger ones go in chunks):
        // where a swapped unit is staged, every resident upload goes
        // through it too, so that no second pinned buffer sits beside it.
        let ring = |bytes: u64| crate::runtime::layerwise::upload_ring(h, bytes);
        // (Sized for the resident units too, which go through it: a small
        // staged unit must not make them upload in small chunks.)
        if let Some(staged) = largest_staged {
            st.upload = Some(ring(staged.max(largest_resident.unwrap_or(0)))?);
        } else if unpinned && let Some(bytes) = largest_resident {
            st.upload = Some(ring(bytes)?);
        }
        for unit in resident {
            let master = match st.upload {
                Some(_) => None,
                None => {
                    h.master_or_refused(unit, true, "it is uploaded once from pageable memory")?
                }
            };
            let buffer = Arc::new(match master {
                Some(m) => h.upload_through(unit, m)?,
                None => {
                    if st.upload.is_none() {
                        st.upload = Some(ring(largest_resident.unwrap_or(unit.bytes))?);
                    }
                    let ring = st.upload.as_ref().expect("made above");
                    crate::runtime::layerwise::upload_staged(h, unit, ring)?
                }
            });
            st.resident.push(Arc::clone(&buffer));
            st.placement.resident(unit, &buffer)?;
        }
        // Only a staged swapped unit needs the upload buffer after enable.
        if largest_staged.is_none()
            && let Some(ring) = st.upload.take()
        {
            let mut first = None;
            crate::runtime::layerwise::free_staging_ring(h, ring, true, &mut first);
            if let Some(e) = first {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Frees everything after draining (see `Handles::release`).
    fn release(&self, st: State<A>, drain: bool) -> Result<(), OffloadError> {
        release_state(&self.shared, "model-level", st, drain)
    }
}

/// Frees everything `st` holds after draining (see `Handles::release`).
pub(crate) fn release_state<A: Api>(
    shared: &Shared<A, State<A>>,
    what: &str,
    mut st: State<A>,
    drain: bool,
) -> Result<(), OffloadError> {
    let h = &shared.handles;
    // The upload buffer's fill thread first, as layerwise stops its ring's:
    // a drain that fails leaks the state, and would leave it parked there.
    if let Some(ring) = st.upload.as_mut() {
        ring.stop();
    }
    h.release(what, st, drain, |st, first| {
        // Placement holds references to the buffers: drop it first.
        drop(st.placement);
        for comp in st.components {
            for b in comp.on_device {
                if let Err(e) = h.free(b, &[&comp.ready, &comp.last_use], &comp.path) {
                    first.get_or_insert(e);
                }
            }
            for (_, host) in comp.units {
                // A master shared with a planned backend's store is
                // freed by the store.
                let Ok(host) = Arc::try_unwrap(host) else {
                    continue;
                };
                // SAFETY: both streams are drained: no copy reads the master.
                if let Err(e) = unsafe { h.free_master(host) } {
                    first.get_or_insert(e);
                }
            }
        }
        h.free_all(st.resident, "resident unit", first);
        if let Some(ring) = st.upload {
            crate::runtime::layerwise::free_staging_ring(h, ring, true, first);
        }
    })
}

/// Hands the phase state built into `shared` the upload buffer its staged
/// swapped held units are brought in through (CONTRACT §7c), kept until
/// the state is released; `Err(ring)` back where no state is built.
pub(crate) fn keep_upload<A: Api>(
    shared: &Shared<A, State<A>>,
    ring: StagingRing<A>,
) -> Result<(), StagingRing<A>> {
    match shared.lock().as_mut() {
        Some(st) => {
            st.upload = Some(ring);
            Ok(())
        }
        None => Err(ring),
    }
}

/// One component's held set, swapped in for its phase by a planned
/// backend: its units and their (shared) host masters.
pub(crate) struct Group<A: Api> {
    pub(crate) path: String,
    pub(crate) module: ModuleId,
    pub(crate) units: Vec<(Unit, Arc<HostMaster<A>>)>,
}

/// The caller's upload through its staging buffer, where it has one
/// (`None`: it has none).
pub(crate) type StagedUpload<'a, A> =
    dyn Fn(&Unit) -> Option<Result<<A as Api>::DeviceBuffer, OffloadError>> + 'a;

/// Builds a planned backend's phase state into `shared`: `groups` swapped
/// in their phase (component `i` of the state is `groups[i]`), and
/// `resident` units uploaded for the whole request (from their master,
/// through `upload_staged` where that master is staged, or through a
/// pinned copy from the weight source when they have none). On error the state
/// holds what was built, for [`release_state`].
pub(crate) fn build_planned<A: Api>(
    shared: &Shared<A, State<A>>,
    pipeline: &crate::model::Pipeline,
    groups: Vec<Group<A>>,
    resident: Vec<(Unit, Option<Arc<HostMaster<A>>>)>,
    whole_mappings: bool,
    upload_staged: &StagedUpload<'_, A>,
) -> Result<(), OffloadError> {
    let h = &shared.handles;
    let mut st = State {
        placement: Placement::new(pipeline, OffloadStrategy::Planned),
        resident: Vec::new(),
        components: Vec::new(),
        upload: None,
    };
    let build = |st: &mut State<A>| -> Result<(), OffloadError> {
        for g in groups {
            let ready = h
                .device
                .create_event()
                .map_err(|e| dev_err("create_event", e))?;
            let last_use = h
                .device
                .create_event()
                .map_err(|e| dev_err("create_event", e))?;
            for (unit, _) in &g.units {
                st.placement.claim(unit)?;
            }
            st.components.push(Component {
                path: g.path,
                module: g.module,
                units: g.units,
                on_device: Vec::new(),
                ready,
                last_use,
                in_use: false,
            });
        }
        for (unit, master) in resident {
            let buffer = Arc::new(match master {
                // A staged master (a kept set under a host budget, CONTRACT
                // §7c): through the caller's staging buffer.
                Some(m) if matches!(*m, HostMaster::Staged(_)) => upload_staged(&unit)
                    .unwrap_or_else(|| {
                        Err(OffloadError::Forward {
                            module: unit.name.clone(),
                            reason: "a staged master with no upload buffer".to_owned(),
                        })
                    })?,
                Some(m) => h.upload_from(&unit, &m)?,
                // Through the caller's staging buffer where it has one (so
                // no second pinned buffer sits beside it), else a pinned
                // copy of the unit; under a host budget never by
                // registering (and so locking) a whole mapping (CONTRACT
                // §7c).
                None => match upload_staged(&unit) {
                    Some(uploaded) => uploaded?,
                    None => {
                        // Once a pin was refused, no pin is asked again:
                        // the rest go through the buffer made for it, as
                        // in model level and layerwise (CONTRACT §7c).
                        let copy = match st.upload {
                            Some(_) => None,
                            None => h.master_or_refused(
                                &unit,
                                whole_mappings,
                                "uploading it through a pinned upload buffer",
                            )?,
                        };
                        match copy {
                            Some(copy) => h.upload_through(&unit, copy)?,
                            None => {
                                if st.upload.is_none() {
                                    // Of this unit (later, larger ones go
                                    // through it in chunks).
                                    st.upload = Some(crate::runtime::layerwise::upload_ring(
                                        h, unit.bytes,
                                    )?);
                                }
                                let ring = st.upload.as_ref().expect("made above");
                                crate::runtime::layerwise::upload_staged(h, &unit, ring)?
                            }
                        }
                    }
                },
            });
            st.resident.push(Arc::clone(&buffer));
            st.placement.resident(&unit, &buffer)?;
        }
        // A buffer made for refused pins is freed once the uploads are
        // done (on an error, with the state that holds it).
        if let Some(ring) = st.upload.take() {
            let mut first = None;
            crate::runtime::layerwise::free_staging_ring(h, ring, true, &mut first);
            if let Some(e) = first {
                return Err(e);
            }
        }
        Ok(())
    };
    let result = build(&mut st);
    *shared.lock() = Some(st);
    result
}

impl<A: Api> Drop for ModelLevelBackend<A> {
    fn drop(&mut self) {
        let st = self.shared.lock().take();
        if let Some(st) = st {
            let drain = !self.shared.bug(PlantedBug::DropWithoutDrain);
            if let Err(e) = self.release(st, drain) {
                tracing::error!("dropping an enabled model-level backend: {e}");
            }
        }
    }
}

impl<A: Api> OffloadBackend for ModelLevelBackend<A> {
    fn strategy(&self) -> OffloadStrategy {
        OffloadStrategy::ModelLevel
    }

    fn enable(&mut self, model: &mut Model) -> Result<(), OffloadError> {
        let _span =
            crate::runtime::shared::enable_span(OffloadStrategy::ModelLevel, model).entered();
        if self.lifecycle.begin_enable()? == EnableStep::AlreadyEnabled {
            return Ok(());
        }
        check_single_owner(model, OffloadStrategy::ModelLevel)?;
        let mut st = State {
            placement: Placement::new(&model.pipeline, OffloadStrategy::ModelLevel),
            resident: Vec::new(),
            components: Vec::new(),
            upload: None,
        };
        if let Err(e) = self.build(model, &mut st) {
            let _ = self.release(st, true);
            return Err(e);
        }
        let hooks: Vec<(usize, ModuleId)> = st
            .components
            .iter()
            .enumerate()
            .map(|(i, c)| (i, c.module))
            .collect();
        *self.shared.lock() = Some(st);
        // Hooks last: nothing above touched the model.
        let hooks = hooks
            .into_iter()
            .map(|(component, module)| {
                let hook: Box<dyn ModelHook<ForwardCtx>> = Box::new(ComponentHook {
                    shared: Arc::clone(&self.shared),
                    component,
                });
                (module, hook)
            })
            .collect();
        match install_hooks(model, OffloadStrategy::ModelLevel, hooks, true) {
            Ok(installed) => self.hooked = installed,
            Err(e) => {
                let st = self.shared.lock().take();
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
        remove_hooks(model, OffloadStrategy::ModelLevel, &mut self.hooked);
        let st = self.shared.lock().take();
        let result = st.map_or(Ok(()), |st| self.release(st, true));
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

impl<A: Api> Backend<A> for ModelLevelBackend<A> {
    fn locate(&self, storage: StorageId) -> Option<DeviceLocation<A>> {
        self.shared.locate(storage)
    }

    fn residency(&self, storage: StorageId) -> Option<Residency> {
        self.shared.residency(storage)
    }

    fn device_weight_bytes(&self) -> u64 {
        self.shared.device_weight_bytes()
    }

    fn host_weight_bytes(&self) -> u64 {
        self.shared.host_weight_bytes()
    }

    fn host_masters(&self) -> crate::runtime::backend::HostMasters {
        self.shared.handles.host_masters()
    }
}
