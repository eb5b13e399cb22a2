//! The planned strategy (CONTRACT §7a): one backend that carries out a
//! request plan ([`crate::budget::RequestPlan`]) by composing the two
//! engines, owning every hook (INV-1):
//!
//! * the **phase engine** (the model-level engine of `model_level.rs`):
//!   each component's held set (its weights outside its blocks and its
//!   resident blocks) is a swap group brought in when the component's
//!   forward begins and evicted when another's does (freed after its last
//!   use); a kept component's held set, and every weight outside the
//!   components, is uploaded once and stays;
//! * the **ring engine** (`layerwise.rs`): the streamed blocks of every
//!   component are rings over the same host masters, through a slot pool
//!   sized per phase (`depth + 1` of the phase's largest streamed block),
//!   allocated when a streaming phase begins and freed when a phase that
//!   streams nothing begins.
//!
//! Host masters exist once for every weight of every component (pinned,
//! or registered in place where the weight source hands over its memory),
//! in a store both engines borrow from, so a re-plan (after the warm-up, or
//! after a first request that ran out of memory) changes what is resident
//! and what streams without touching the host.
//!
//! With no planner inputs given, `enable` puts the smallest footprint in
//! force (every block that can stream streams, nothing kept) with
//! device-timed marks around every fill, block and component forward, and
//! memory samples at each; the runtime runs the warm-up request through it
//! and calls [`Backend::finish_warmup`], which reads the marks into
//! [`PlannerInputs`], plans, and puts the plan in force.

use crate::sync::{Arc, Mutex, lock};
use std::collections::{BTreeMap, BTreeSet};

use offload_hooks::{BoxError, Forwarded, ModelHook, PreForward};

use crate::budget::{
    self, BudgetError, ComponentChoice, DeviceMemory, HostLimits, HostSide, RequestPlan,
};
use crate::config::{OffloadConfig, OffloadStrategy, WeightCompression};
use crate::declaration::Role;
use crate::device::{Api, Codec, Device, DeviceErrorKind};
use crate::discovery::log_warnings;
use crate::lifecycle::{
    DisableStep, EnableStep, Lifecycle, LifecycleState, OffloadBackend, OffloadError,
};
use crate::measurements::{ComponentInputs, InputSource, PlannerInputs};
use crate::model::{ModuleId, StorageId};
use crate::plan::{ResolvedPlan, resolve};
use crate::request::RequestShape;
use crate::residency::Residency;
use crate::runtime::backend::{Backend, DeviceLocation, WeightSource};
use crate::runtime::bugs::{Bugs, PlantedBug};
use crate::runtime::hooks::{ForwardCtx, Model};
use crate::runtime::layerwise::{Pool, RingEngine, StoredMaster};
use crate::runtime::layout::{Partition, Unit, partition};
use crate::runtime::model_level::{self, Group};
use crate::runtime::ring::RingLayout;
use crate::runtime::shared::{
    CodedFrom, CodedMaster, Handles, HostMaster, Shared, check_single_owner, dev_err, enable_span,
    install_named_hooks, remove_hooks,
};
use crate::runtime::timer::{Mark, Timer};

/// The hook a timing mark before a block's own hooks registers under
/// (sorts before the strategy's `planned_offload`).
const MARK_BEFORE: &str = "planned_mark";
/// The hook a timing mark after them registers under (sorts after).
const MARK_AFTER: &str = "planned_time";

/// The pipeline as the planned backend runs it: the resolution over every
/// component, the partition every unit comes from, the managed components.
struct Layout {
    resolved: ResolvedPlan,
    partition: Partition,
    /// Every component the plan manages: path, module, role.
    components: Vec<(String, ModuleId, Role)>,
    /// The pipeline's bf16 storages (the codec's spans).
    bf16: BTreeSet<crate::model::StorageId>,
}

impl Layout {
    /// Every block of every managed component's stacks: (block path, unit).
    fn blocks(&self) -> impl Iterator<Item = (&str, &Unit)> {
        self.resolved
            .stacks
            .iter()
            .filter(|s| self.components.iter().any(|c| c.0 == s.owner))
            .flat_map(|s| &s.blocks)
            .map(|b| (b.path.as_str(), &self.partition.blocks[&b.module]))
    }

    /// The units of the blocks `choices` stream coded.
    fn coded_units(&self, choices: &[ComponentChoice]) -> BTreeSet<String> {
        let coded: BTreeSet<&str> = choices
            .iter()
            .flat_map(|c| c.coded_blocks.iter().map(String::as_str))
            .collect();
        self.blocks()
            .filter(|(path, _)| coded.contains(path))
            .map(|(_, u)| u.name.clone())
            .collect()
    }
}

/// A coded host master and its (coded bytes, the decode's work items).
type CodedOf<A> = (HostMaster<A>, (u64, u64));

/// Why [`Planned::coded_master_of`] failed: the device refused the coded
/// master's pin or registration (a platform short of page-locked memory,
/// which a smaller pin may pass), or anything else.
enum CodedFail {
    PinRefused(OffloadError),
    Other(OffloadError),
}

impl CodedFail {
    fn error(self) -> OffloadError {
        match self {
            Self::PinRefused(e) | Self::Other(e) => e,
        }
    }
}

impl From<OffloadError> for CodedFail {
    fn from(e: OffloadError) -> Self {
        Self::Other(e)
    }
}

/// A streamed block's coded form as enable learned it (CONTRACT §7b,
/// `weight_compression` under a device budget): its coded bytes, which the
/// planner prices (a coded-block file's window, else the codec's exact
/// [`Codec::coded_len`], nothing encoded), and the blob where enable
/// encoded it (the block the decoder was measured on, or every block of
/// a codec that sizes only by encoding), kept until the first plan's
/// store is built.
struct CodedForm {
    bytes: u64,
    blob: Option<crate::runtime::backend::CodedRegion>,
    /// Its bytes are a coded-block file's window (taken again when its
    /// master is made).
    in_file: bool,
}

/// The coded bytes a coded-block file holds of `unit` in `codec`'s format
/// (CONTRACT §7b), where they fit its bound.
fn file_region<A: Api>(
    h: &Handles<A>,
    codec: &dyn Codec<A>,
    unit: &Unit,
    spans: &[crate::device::CodecSpan],
) -> Option<crate::runtime::backend::CodedRegion> {
    let bound = crate::device::coded_bound(unit.bytes, spans.len());
    codec.format().and_then(|format| {
        h.weights
            .take_coded(unit, format)
            .filter(|c| c.region.bytes().len() as u64 <= bound.min(unit.bytes))
    })
}

/// `unit` encoded now by `codec`, or the reason it has no coded form: the
/// codec refused it, or its blob exceeds `coded_bound`.
fn encoded_region<A: Api>(
    h: &Handles<A>,
    codec: &dyn Codec<A>,
    unit: &Unit,
    spans: &[crate::device::CodecSpan],
) -> Result<crate::runtime::backend::CodedRegion, String> {
    let bound = crate::device::coded_bound(unit.bytes, spans.len());
    let coded = h.encode(unit, spans, codec)?;
    if coded.blob.len() as u64 > bound {
        return Err(format!(
            "it gave {} bytes, above the bound of {bound} for {} bytes",
            coded.blob.len(),
            unit.bytes
        ));
    }
    Ok(crate::runtime::backend::CodedRegion {
        work: coded.work,
        region: Box::new(coded.blob),
    })
}

/// `unit`'s coded form (CONTRACT §7b): a coded-block file's window (its
/// length), else the codec's exact [`Codec::coded_len`] (nothing
/// encoded), else, for a codec that sizes only by encoding, its blob
/// encoded now and kept; `None` (logged: it streams raw) where the codec
/// refuses it or its blob would exceed `coded_bound`.
fn coded_form<A: Api>(
    h: &Handles<A>,
    codec: &dyn Codec<A>,
    unit: &Unit,
    spans: &[crate::device::CodecSpan],
) -> Option<CodedForm> {
    let bound = crate::device::coded_bound(unit.bytes, spans.len());
    if let Some(c) = file_region(h, codec, unit, spans) {
        return Some(CodedForm {
            bytes: c.region.bytes().len() as u64,
            blob: None,
            in_file: true,
        });
    }
    let found = match h.coded_len(unit, spans, codec) {
        Ok(Some(len)) if len <= bound => Ok(CodedForm {
            bytes: len,
            blob: None,
            in_file: false,
        }),
        Ok(Some(len)) => Err(format!(
            "it would give {len} bytes, above the bound of {bound} for {} bytes",
            unit.bytes
        )),
        Ok(None) => encoded_region(h, codec, unit, spans).map(|region| CodedForm {
            bytes: region.region.bytes().len() as u64,
            blob: Some(region),
            in_file: false,
        }),
        Err(reason) => Err(reason),
    };
    found
        .map_err(|reason| {
            tracing::warn!(unit = %unit.name, "the {} codec refused `{}` ({reason}); it streams raw", codec.name(), unit.name);
        })
        .ok()
}

/// The typed error of an encode that broke its coded form: the blob took
/// `got` bytes (or the codec refused, `Err`) where its form said `want`,
/// the length the planner priced the block at.
fn broke_its_size<A: Api>(
    codec: &dyn Codec<A>,
    unit: &Unit,
    want: u64,
    got: Result<u64, String>,
) -> OffloadError {
    OffloadError::DeviceOp {
        operation: format!("encoding `{}` with the {} codec", unit.name, codec.name()),
        kind: DeviceErrorKind::Other,
        shortfall_bytes: None,
        cause: match got {
            Ok(got) => format!(
                "its blob took {got} bytes, where the codec's coded_len said {want} (the planner prices a block at its coded_len)"
            ),
            Err(reason) => format!(
                "the codec refused it ({reason}) after its coded_len sized it at {want} bytes (the planner prices a block at its coded_len)"
            ),
        }
        .into(),
    }
}

type Phases<A> = Shared<A, model_level::State<A>>;

/// Carries out a request plan under a device budget (CONTRACT §7a).
///
/// Dropping it while enabled drains every stream before freeing anything
/// (a failed drain leaks, with a logged error), as the engines it composes.
pub struct PlannedBackend<A: Api> {
    config: OffloadConfig,
    lifecycle: Lifecycle,
    device: Arc<A::Device>,
    compute: Arc<A::Stream>,
    bugs: Bugs,
    ring: Arc<RingEngine<A>>,
    phases: Arc<Phases<A>>,
    /// Inputs given (a caller's or saved measurements): no warm-up.
    given: Option<PlannerInputs>,
    /// The request to plan for, if the platform names one (else the
    /// pipeline's warm-up recipe).
    request: Option<RequestShape>,
    /// Host masters of every unit of every managed component, by unit name.
    store: BTreeMap<String, Arc<HostMaster<A>>>,
    /// The store's coded masters (CONTRACT §7b): their coded bytes and the
    /// decode's work items, by unit name.
    store_coded: BTreeMap<String, (u64, u64)>,
    /// The codec, where `weight_compression` codes blocks.
    codec: Option<Arc<dyn Codec<A>>>,
    /// Each streamed block's coded form, by unit name (blocks the codec
    /// refused have none and stream raw).
    coded_forms: BTreeMap<String, CodedForm>,
    /// The decoder's rate measured at enable, bf16 bytes written per
    /// second.
    decode_rate: Option<f64>,
    layout: Option<Layout>,
    plan: Option<RequestPlan>,
    inputs: Option<PlannerInputs>,
    /// The warm-up's (or the check request's) marks, while one is
    /// pending.
    timer: Option<Arc<Timer<A>>>,
    warmup: Option<RequestShape>,
    /// The check request, while one is pending (CONTRACT §9): the plan
    /// made from the warm-up streams coded blocks and its inputs carry no
    /// measured decode interference, so the request runs once more under
    /// that plan, timed, to measure it.
    check: Option<RequestShape>,
    memory: Option<DeviceMemory>,
    /// Device memory the host masters' mappings took (measured at enable).
    mapping_bytes: u64,
    /// The component whose phase runs now (the last to begin).
    current: Arc<Mutex<Option<String>>>,
    replanned: bool,
    hooked: Vec<ModuleId>,
    /// `host_budget` as read at enable (every re-plan plans within it).
    host_limits: Option<HostLimits>,
    /// The host side in force: which streamed blocks' masters are staged.
    host_side: Option<HostSide>,
    /// The store as built releases staged pages after each read though
    /// the host side does not: the device refused pins the plan counted
    /// on, and what they left staged exceeds the budget's room
    /// (`fit_store`).
    release_refused: bool,
    /// `pin_cpu_memory = false` (CONTRACT §7c): every master stays in
    /// pageable memory; the plan's host side stages every unit.
    unpinned: bool,
}

/// Plans a store may follow in one re-plan while its masters' mappings
/// grow ([`PlannedBackend::settle_store`]).
const SETTLE_ROUNDS: usize = 3;

impl<A: Api> PlannedBackend<A> {
    /// A planned backend for `config` (which must set `device_budget`),
    /// planning from `inputs` when given, else from a warm-up of `request`
    /// (or of the pipeline's declared warm-up request).
    pub fn new(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
        config: OffloadConfig,
        inputs: Option<PlannerInputs>,
        request: Option<RequestShape>,
    ) -> Result<Self, OffloadError> {
        Self::with_bugs(
            device,
            compute,
            weights,
            config,
            (inputs, request),
            Bugs::default(),
            None,
        )
    }

    /// [`Self::new`] with planted bugs and the device's codec
    /// (`weight_compression` `"lossless"` or `"auto"` need one).
    pub(crate) fn with_bugs(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
        config: OffloadConfig,
        (inputs, request): (Option<PlannerInputs>, Option<RequestShape>),
        bugs: Bugs,
        codec: Option<Arc<dyn Codec<A>>>,
    ) -> Result<Self, OffloadError> {
        let selection = config.select()?;
        // `pin_cpu_memory = false` stages every master (below): the planner
        // prices it, with or without a host budget.
        let unpinned = !selection.pin_memory;
        if selection.strategy != OffloadStrategy::Planned {
            return Err(OffloadError::Unsupported {
                platform: "planned backend".to_owned(),
                strategy: selection.strategy,
            });
        }
        if let Some(shape) = &request {
            shape.validate().map_err(|e| {
                OffloadError::Budget(Box::new(BudgetError::Input {
                    input: "request".to_owned(),
                    value: e.value.clone(),
                    allowed: e.to_string(),
                }))
            })?;
        }
        let codec = match (config.compression(), codec) {
            (WeightCompression::None, _) => None,
            (_, Some(codec)) => Some(codec),
            (c, None) => {
                return Err(OffloadError::Config(Box::new(crate::config::no_codec(c))));
            }
        };
        let ring = Arc::new(RingEngine::new(
            Arc::clone(&device),
            Arc::clone(&compute),
            Arc::clone(&weights),
            bugs.clone(),
            codec.clone(),
        )?);
        let phases = Arc::new(Shared::new(
            Handles::new(Arc::clone(&device), Arc::clone(&compute), weights)?,
            bugs.clone(),
        ));
        Ok(Self {
            config,
            lifecycle: Lifecycle::new(OffloadStrategy::Planned),
            device,
            compute,
            bugs,
            ring,
            phases,
            given: inputs,
            request,
            store: BTreeMap::new(),
            store_coded: BTreeMap::new(),
            codec,
            coded_forms: BTreeMap::new(),
            decode_rate: None,
            layout: None,
            plan: None,
            inputs: None,
            timer: None,
            warmup: None,
            check: None,
            memory: None,
            mapping_bytes: 0,
            current: Arc::new(Mutex::new(None)),
            replanned: false,
            hooked: Vec::new(),
            host_limits: None,
            host_side: None,
            release_refused: false,
            unpinned,
        })
    }

    /// The request this backend plans for: the platform's, else the
    /// pipeline's warm-up recipe.
    fn request_of(&self, model: &Model) -> Option<RequestShape> {
        self.request
            .clone()
            .or_else(|| model.pipeline.warmup_request().cloned())
    }

    /// The units (by name) the host side in force stages for `choices`:
    /// the streamed blocks it stages, and every held unit of a kept
    /// component (uploaded once from pageable memory); under
    /// `pin_cpu_memory = false`, every unit of the store (a swapped held
    /// unit is brought in from pageable memory at each of its phases).
    fn staged_units(&self, layout: &Layout, choices: &[ComponentChoice]) -> BTreeSet<String> {
        let mut out: BTreeSet<String> = BTreeSet::new();
        if self.bugs.has(PlantedBug::PlannedPinsStagedBlocks) {
            return out;
        }
        if self.unpinned {
            return Self::store_units(layout)
                .into_iter()
                .map(|u| u.name)
                .collect();
        }
        let Some(side) = &self.host_side else {
            return out;
        };
        {
            out.extend(
                layout
                    .resolved
                    .stacks
                    .iter()
                    .flat_map(|s| &s.blocks)
                    .filter(|b| side.staged_blocks.contains(&b.path))
                    .map(|b| layout.partition.blocks[&b.module].name.clone()),
            );
        }
        for (path, module, _) in &layout.components {
            let Some(choice) = choices.iter().find(|c| &c.path == path && c.kept) else {
                continue;
            };
            if !side.kept_staged.contains(path) {
                continue;
            }
            out.extend(layout.partition.rest_of(*module).map(|u| u.name.clone()));
            out.extend(
                layout
                    .resolved
                    .stacks
                    .iter()
                    .filter(|s| &s.owner == path)
                    .flat_map(|s| &s.blocks)
                    .filter(|b| choice.resident_blocks.contains(&b.path))
                    .map(|b| layout.partition.blocks[&b.module].name.clone()),
            );
        }
        out
    }

    /// Why the host side in force stages a unit: `pin_cpu_memory = false`,
    /// else the host budget.
    fn stage_reason(&self) -> budget::StageReason {
        if self.unpinned {
            budget::StageReason::Unpinned
        } else {
            budget::StageReason::Budget
        }
    }

    /// Every unit the store holds a master of: each managed component's
    /// rest and every block of its stacks.
    fn store_units(layout: &Layout) -> Vec<Unit> {
        let managed: Vec<ModuleId> = layout.components.iter().map(|c| c.1).collect();
        layout
            .partition
            .rest
            .iter()
            .filter(|u| managed.contains(&u.module))
            .chain(layout.partition.blocks.values())
            .cloned()
            .collect()
    }

    /// Host masters for every unit of every managed component (its rest
    /// and every block of its stacks): pinned or registered in place, but
    /// the blocks the host side stages (CONTRACT §7c), which stay in
    /// pageable memory. Under a host budget a window of a mapping is
    /// pinned as a copy (a registration would lock the whole mapping), and
    /// a streamed block whose pin the device refuses stages too.
    fn build_store(
        &mut self,
        layout: &Layout,
        choices: &[ComponentChoice],
    ) -> Result<(), OffloadError> {
        let staged = self.staged_units(layout, choices);
        let coded = layout.coded_units(choices);
        let use_of = unit_uses(layout, choices);
        let mut tally = crate::runtime::layerwise::CodingTally::default();
        for unit in &Self::store_units(layout) {
            let want = (staged.contains(&unit.name), coded.contains(&unit.name));
            let master = self.make_master(layout, unit, want, use_of(unit), &mut tally)?;
            self.store.insert(unit.name.clone(), Arc::new(master));
        }
        if !tally.is_empty() {
            tally.log(self.codec.as_deref());
        }
        self.fit_store(layout, choices)?;
        self.log_staged();
        Ok(())
    }

    /// Keeps the store within the host budget where the device refused
    /// pins the plan counted on (CONTRACT §7c): a refused block stages and
    /// may need a staging ring the plan did not hold (a plan that pinned
    /// every streamed block has none), so further pinned streamed blocks
    /// stage until the page-locked peak (masters, the ring, the upload
    /// buffer) fits again ([`budget::host::restage_within`]); where none
    /// can, a typed error. Both engines are released (or not yet built).
    fn fit_store(
        &mut self,
        layout: &Layout,
        choices: &[ComponentChoice],
    ) -> Result<(), OffloadError> {
        self.release_refused = false;
        let (Some(limits), Some(side)) = (&self.host_limits, &self.host_side) else {
            return Ok(());
        };
        // Either planted bug leaves the store's pins as they are (the
        // first pins what the plan stages: its test wants INV-7 to see it).
        if self.bugs.has(PlantedBug::KeepPinsBesideRefused)
            || self.bugs.has(PlantedBug::PlannedPinsStagedBlocks)
        {
            return Ok(());
        }
        let (budget, transient) = (limits.budget, side.transient_bytes);
        let held = held_modules(layout, choices);
        let planned_staged = self.staged_units(layout, choices);
        let streamed: Vec<&Unit> = layout
            .partition
            .blocks
            .values()
            .filter(|u| !held.contains(&u.module) && self.store.contains_key(&u.name))
            .collect();
        let staged = |u: &Unit| matches!(*self.store[&u.name], HostMaster::Staged(_));
        // Only where the device refused a pin: otherwise the store is the
        // plan's, within the budget by the plan's own count.
        if !streamed
            .iter()
            .any(|u| staged(u) && !planned_staged.contains(&u.name))
        {
            return Ok(());
        }
        let blocks: Vec<budget::host::BuiltBlock> = streamed
            .iter()
            .map(|u| {
                let m = &self.store[&u.name];
                budget::host::BuiltBlock {
                    pinned: m.len_bytes(),
                    // What a staging buffer holds of it: a coded master's
                    // coded bytes (the ring is made from them).
                    staged: self.store_coded.get(&u.name).map_or(u.bytes, |c| c.0),
                    is_staged: staged(u),
                    // Only a pinned copy we made (a registered master is the
                    // loader's memory) that no engine shares.
                    may_stage: matches!(**m, HostMaster::Pinned(_))
                        && Arc::strong_count(m) == 1
                        && !self.store_coded.contains_key(&u.name),
                }
            })
            .collect();
        let others: u64 = self
            .store
            .iter()
            .filter(|(name, _)| !streamed.iter().any(|u| &&u.name == name))
            .fold(0u64, |a, (_, m)| a.saturating_add(m.len_bytes()));
        let more = budget::host::restage_within(budget, others.saturating_add(transient), &blocks)
            .map_err(|e| OffloadError::Config(Box::new(e.into_config_error())))?;
        // The refused blocks' pages stay mapped beside the pins that held:
        // where they exceed the budget's room, they are released after
        // each read though the plan released nothing.
        self.release_refused = !side.release_after_read
            && budget::host::built_release(
                budget,
                others.saturating_add(transient),
                &blocks,
                &more,
            );
        if self.release_refused {
            tracing::info!(
                "staged blocks' pages are released after each read: the pins the device refused left more staged than the host budget has room for"
            );
        }
        let units: Vec<Unit> = more.iter().map(|&i| streamed[i].clone()).collect();
        for unit in &units {
            let why = budget::StageReason::Restaged;
            tracing::info!(unit = %unit.name, bytes = unit.bytes, reason = %why, "`{}` streams staged ({why})", unit.name);
            let h = &self.phases.handles;
            let slot = self
                .store
                .get_mut(&unit.name)
                .expect("a streamed block of the store");
            // SAFETY: no engine holds the store's masters here (none built
            // yet, or both released and drained): no copy reads it.
            unsafe {
                h.restage(slot, &unit.name, || {
                    h.counted(HostMaster::Staged(crate::runtime::shared::Staged {
                        bytes: unit.bytes,
                        coded: None,
                    }))
                })
            }?;
        }
        Ok(())
    }

    /// A host master of `unit` (its use under the plan, `role`): staged
    /// where `staged`, else pinned (or registered in place without a host
    /// budget); a unit whose pin or registration the device refuses (not
    /// a lost device) stages, with a warning naming it and the device's
    /// error: a streamed block streams staged, a kept unit is uploaded
    /// once from pageable memory, a swapped held unit is brought in from
    /// pageable memory at each of its phases (CONTRACT §7c).
    /// Where `coded` (a streamed block the plan streams coded, CONTRACT
    /// §7b), its coded master ([`Self::coded_master_of`]: staged where
    /// `staged`; raw where the codec refuses it), recorded in
    /// `store_coded`.
    fn make_master(
        &mut self,
        layout: &Layout,
        unit: &Unit,
        (staged, coded): (bool, bool),
        role: UnitUse,
        tally: &mut crate::runtime::layerwise::CodingTally,
    ) -> Result<HostMaster<A>, OffloadError> {
        let streams = role == UnitUse::Streams;
        self.store_coded.remove(&unit.name);
        if coded
            && let Some((master, meta)) = self
                .coded_master_of(layout, unit, (staged, streams), tally)
                .map_err(CodedFail::error)?
        {
            self.store_coded.insert(unit.name.clone(), meta);
            return Ok(master);
        }
        let h = &self.phases.handles;
        let budget = self.host_limits.is_some();
        let stage = |why: budget::StageReason| {
            match role {
                UnitUse::Streams => {
                    tracing::info!(unit = %unit.name, bytes = unit.bytes, reason = %why, "`{}` streams staged ({why})", unit.name)
                }
                UnitUse::Kept => {
                    tracing::info!(unit = %unit.name, bytes = unit.bytes, "`{}` is kept on the device, uploaded once from pageable memory", unit.name)
                }
                // Named where its phase state is built (`apply`): a re-plan
                // may pin it again.
                UnitUse::Swapped => {}
            }
            h.counted(HostMaster::Staged(crate::runtime::shared::Staged {
                bytes: unit.bytes,
                coded: None,
            }))
        };
        if staged {
            return Ok(stage(self.stage_reason()));
        }
        let then = match role {
            UnitUse::Streams => "it streams staged",
            UnitUse::Kept => "it is uploaded once from pageable memory",
            UnitUse::Swapped => "its phase brings it in from pageable memory each time",
        };
        Ok(match h.master_or_refused(unit, !budget, then)? {
            Some(master) => master,
            None => stage(budget::StageReason::Refused),
        })
    }

    /// `unit`'s coded host master and its (coded bytes, work items), from
    /// its coded bytes: the blob enable encoded, else the coded bytes the
    /// weight source holds (a coded-block file's window), else encoded
    /// now. Staged (pageable, streamed through the host staging ring)
    /// where `staged`; else a file's window registered in place (copied
    /// into pinned memory of its size under a host budget, where
    /// registering would lock its whole mapping) and a blob pinned at its
    /// size; a streamed block whose pin the device refuses under a host
    /// budget stages coded (CONTRACT §7c). `None` where the codec refuses
    /// it (it streams raw).
    fn coded_master_of(
        &mut self,
        layout: &Layout,
        unit: &Unit,
        (staged, streams): (bool, bool),
        tally: &mut crate::runtime::layerwise::CodingTally,
    ) -> Result<Option<CodedOf<A>>, CodedFail> {
        use crate::runtime::backend::CodedRegion;
        let Some(codec) = self.codec.clone() else {
            return Ok(None);
        };
        let h = &self.phases.handles;
        let spans = crate::runtime::layout::codec_spans(unit, &layout.bf16);
        let (blob, sized) = match self.coded_forms.get_mut(&unit.name) {
            Some(f) => (f.blob.take(), Some(f.bytes)),
            None => (None, None),
        };
        let found = match blob {
            Some(region) => Ok((region, false)),
            None => match file_region(h, &*codec, unit, &spans) {
                Some(region) => Ok((region, true)),
                None => {
                    let start = std::time::Instant::now();
                    let encoded = encoded_region(h, &*codec, unit, &spans);
                    tally.add_seconds(start.elapsed().as_secs_f64());
                    encoded.map(|region| (region, false))
                }
            },
        };
        // The planner priced the block at its coded form's bytes (nothing
        // encoded then): an encode of another length, or a refusal of a
        // block the codec sized, broke `Codec::coded_len`'s promise, and a
        // master of another size would overrun what the plan counted.
        let (region, in_file) = match (found, sized) {
            (Ok(found), Some(want)) if found.0.region.bytes().len() as u64 != want => {
                return Err(CodedFail::Other(broke_its_size(
                    &*codec,
                    unit,
                    want,
                    Ok(found.0.region.bytes().len() as u64),
                )));
            }
            (Err(reason), Some(want)) => {
                return Err(CodedFail::Other(broke_its_size(
                    &*codec,
                    unit,
                    want,
                    Err(reason),
                )));
            }
            (Err(reason), None) => {
                tracing::warn!(unit = %unit.name, "the {} codec refused `{}` ({reason}); it streams raw", codec.name(), unit.name);
                return Ok(None);
            }
            (Ok(found), _) => found,
        };
        let (len, work) = (region.region.bytes().len() as u64, region.work);
        let staged_coded = |region: CodedRegion, why: budget::StageReason| {
            tracing::info!(unit = %unit.name, bytes = len, reason = %why, "`{}` streams staged ({why}), coded: {len} of its {} bytes", unit.name, unit.bytes);
            let region: std::sync::Arc<dyn crate::device::HostRegion> = region.region.into();
            h.counted(HostMaster::Staged(crate::runtime::shared::Staged {
                bytes: len,
                coded: Some(region),
            }))
        };
        if staged {
            return Ok(Some((
                staged_coded(region, self.stage_reason()),
                (len, work),
            )));
        }
        let budget = self.host_limits.is_some();
        let made = if in_file {
            crate::runtime::layerwise::coded_master(
                h,
                unit,
                &spans,
                &*codec,
                Some(region),
                tally,
                !budget,
            )?
        } else {
            tally.encoded_before(unit.bytes, len);
            h.pinned_coded(unit, region, CodedFrom::Encoded)?
        };
        match made {
            CodedMaster::Made(master, work, _) => {
                let len = master.len_bytes();
                Ok(Some((master, (len, work))))
            }
            CodedMaster::Raw => Ok(None),
            CodedMaster::PinRefused {
                coded,
                error: OffloadError::DeviceOp { kind, cause, .. },
            } if streams && kind != DeviceErrorKind::DeviceLost => {
                tracing::warn!(unit = %unit.name, "pinning the coded `{}` was refused ({cause}); it streams staged", unit.name);
                Ok(Some((
                    staged_coded(coded, budget::StageReason::Refused),
                    (len, work),
                )))
            }
            CodedMaster::PinRefused { error, .. } => Err(CodedFail::PinRefused(error)),
        }
    }

    /// Each streamed block's coded form (CONTRACT §7b): the coded bytes a
    /// coded-block file holds of it (nothing encoded), else its blob
    /// encoded now on the host (kept until the first plan's store is
    /// built); none where the codec refuses it or its blob would exceed
    /// [`crate::device::coded_bound`] (it streams raw). Then the decoder's
    /// rate, measured on the largest coded block whose coded bytes and
    /// output fit `budget` (the large blocks' decodes are the ones that
    /// count; a small one's would be mostly launch latency). Nothing is
    /// pinned but that block's coded master, freed after the measurement.
    fn learn_coded(&mut self, layout: &Layout, budget: u64) -> Result<(), OffloadError> {
        let Some(codec) = self.codec.clone() else {
            return Ok(());
        };
        let h = &self.phases.handles;
        let start = std::time::Instant::now();
        let (mut in_file, mut sized, mut refused) = (0usize, 0usize, 0usize);
        let mut encoded = 0usize;
        let (mut bytes, mut coded_bytes) = (0u64, 0u64);
        let mut forms = BTreeMap::new();
        for (_, unit) in layout.blocks() {
            let spans = crate::runtime::layout::codec_spans(unit, &layout.bf16);
            // Sized, not encoded, where the codec can: a block is encoded
            // only once a plan streams it coded (a file's window is taken
            // again when its master is made).
            let form = coded_form(h, &*codec, unit, &spans).inspect(|f| {
                if f.in_file {
                    in_file += 1;
                } else if f.blob.is_some() {
                    encoded += 1;
                } else {
                    sized += 1;
                }
            });
            match form {
                Some(f) => {
                    bytes += unit.bytes;
                    coded_bytes += f.bytes;
                    forms.insert(unit.name.clone(), f);
                }
                None => refused += 1,
            }
        }
        tracing::info!(
            in_file,
            sized,
            encoded,
            refused,
            bytes,
            coded_bytes,
            "planned offload, weight_compression = \"{}\": {} blocks have coded forms ({} in a coded-block file, {} sized on the host{}, {} encoded on the host{}): {coded_bytes} of {bytes} bytes ({:.4}) in {:.2} s; {refused} stream raw",
            self.config.compression(),
            in_file + sized + encoded,
            in_file,
            sized,
            if sized > 0 {
                " (encoded once a plan streams them coded)"
            } else {
                ""
            },
            encoded,
            if encoded > 0 {
                " (the codec sizes a block only by encoding it; kept pageable until the plan pins those it streams coded)"
            } else {
                ""
            },
            coded_bytes as f64 / bytes.max(1) as f64,
            start.elapsed().as_secs_f64()
        );
        self.coded_forms = forms;
        // Given inputs that carry the decoder's rate (saved measurements)
        // are planned from it: nothing to measure.
        if self
            .given
            .as_ref()
            .is_some_and(|g| g.decode_bytes_per_s.is_some())
        {
            return Ok(());
        }
        // The decoder's rate, on the largest coded block that fits both
        // budgets (its bytes and coded bytes the device's, its coded
        // master, pinned for the measurement, the host's); where the
        // platform refuses its pin, the next that fits with fewer coded
        // bytes (a platform short of page-locked memory may grant a
        // smaller pin; the rate, more of it launch latency, is the lower
        // one). None fits: the smallest, alone.
        let coded: Vec<(&Unit, u64)> = layout
            .blocks()
            .filter_map(|(_, u)| Some((u, self.coded_forms.get(&u.name)?.bytes)))
            .collect();
        let host = self.host_limits.as_ref().map_or(u64::MAX, |l| l.budget);
        let mut fitting: Vec<&(&Unit, u64)> = coded
            .iter()
            .filter(|(u, c)| u.bytes.saturating_add(*c) <= budget && *c <= host)
            .collect();
        fitting.sort_by_key(|(u, c)| (std::cmp::Reverse(u.bytes), std::cmp::Reverse(*c)));
        let mut candidates: Vec<Unit> = Vec::new();
        if let Some(&&(first, first_coded)) = fitting.first() {
            candidates.push(first.clone());
            if let Some(&&(next, _)) = fitting.iter().find(|(_, c)| *c < first_coded) {
                candidates.push(next.clone());
            }
        } else if let Some((u, _)) = coded.iter().min_by_key(|(u, _)| u.bytes) {
            candidates.push((*u).clone());
        }
        let mut made = None;
        for (i, unit) in candidates.iter().enumerate() {
            // Encoded now (its form was only sized), and its blob lent for
            // the measurement and kept: a plan that streams it coded pins
            // that blob rather than encoding it again.
            if let Some(f) = self.coded_forms.get_mut(&unit.name)
                && f.blob.is_none()
                && !f.in_file
            {
                let spans = crate::runtime::layout::codec_spans(unit, &layout.bf16);
                match encoded_region(&self.phases.handles, &*codec, unit, &spans) {
                    Ok(region) if region.region.bytes().len() as u64 == f.bytes => {
                        f.blob = Some(region);
                    }
                    got => {
                        return Err(broke_its_size(
                            &*codec,
                            unit,
                            f.bytes,
                            got.map(|r| r.region.bytes().len() as u64),
                        ));
                    }
                }
            }
            let kept = self.coded_forms.get(&unit.name).and_then(|f| {
                f.blob
                    .as_ref()
                    .map(|b| crate::runtime::backend::CodedRegion {
                        work: b.work,
                        region: Box::new(b.region.bytes().to_vec()),
                    })
            });
            let mut tally = crate::runtime::layerwise::CodingTally::default();
            let tried = self.coded_master_of(layout, unit, (false, false), &mut tally);
            if let (Some(region), Some(f)) = (kept, self.coded_forms.get_mut(&unit.name)) {
                f.blob = Some(region);
            }
            match tried {
                Err(CodedFail::PinRefused(OffloadError::DeviceOp { kind, cause, .. }))
                    if kind != DeviceErrorKind::DeviceLost && i + 1 < candidates.len() =>
                {
                    tracing::warn!(
                        unit = %unit.name,
                        "planned offload: pinning `{}` to measure the decoder was refused ({cause}); measuring on `{}` instead",
                        unit.name,
                        candidates[i + 1].name
                    );
                }
                tried => {
                    made = tried.map_err(CodedFail::error)?.map(|m| (unit.clone(), m));
                    break;
                }
            }
        }
        if let Some((unit, (master, meta))) = made {
            let rate = self.ring.measure_decoder(&unit, &master, meta);
            // A failed measurement may leave its copy of the master in
            // flight: drained first, else the master is leaked (logged).
            if rate.is_err() && self.ring.drain().is_err() {
                tracing::error!(unit = %unit.name, "the decode measurement failed and its streams did not drain: leaking the coded master it read");
                std::mem::forget(master);
                return rate.map(|_| ());
            }
            // SAFETY: the measurement synchronised with its decodes, or
            // failed and its streams drained: no copy reads the master.
            let freed = unsafe { self.phases.handles.free_master(master) };
            let rate = rate?;
            freed?;
            // Its buffers go back to the device (not kept by the
            // allocator), so the masters' mappings measured next see
            // the device as enable found it.
            self.device
                .release_unused()
                .map_err(|e| dev_err("release_unused (after the decode measurement)", e))?;
            tracing::info!(
                unit = %unit.name,
                decode_bytes_per_s = rate,
                "planned offload: the {} decoder writes {:.0} GB/s (measured on `{}`)",
                codec.name(),
                rate / 1e9,
                unit.name
            );
            self.decode_rate = Some(rate);
        }
        Ok(())
    }

    /// [`Self::learn_coded`], its encoded blobs dropped where it fails.
    fn learn_coded_or_drop(&mut self, layout: &Layout, budget: u64) -> Result<(), OffloadError> {
        let learned = self.learn_coded(layout, budget);
        if learned.is_err() {
            self.coded_forms.clear();
        }
        learned
    }

    /// `inputs` with each block's coded bytes ([`Self::learn_coded`]) and,
    /// where they carry none, the decoder's measured rate.
    fn with_coded(&self, layout: &Layout, mut inputs: PlannerInputs) -> PlannerInputs {
        if self.codec.is_none() {
            return inputs;
        }
        for (path, _, _) in &layout.components {
            let Some(c) = inputs.components.get_mut(path) else {
                continue;
            };
            c.coded_block_bytes = layout
                .resolved
                .stacks
                .iter()
                .filter(|s| &s.owner == path)
                .flat_map(|s| &s.blocks)
                .filter_map(|b| {
                    let unit = &layout.partition.blocks[&b.module];
                    Some((b.path.clone(), self.coded_forms.get(&unit.name)?.bytes))
                })
                .collect();
        }
        if inputs.decode_bytes_per_s.is_none() {
            inputs.decode_bytes_per_s = self.decode_rate;
        }
        inputs
    }

    /// The log line of what the store stages.
    fn log_staged(&self) {
        let staged: Vec<u64> = self
            .store
            .values()
            .filter_map(|m| match &**m {
                HostMaster::Staged(s) => Some(s.bytes),
                _ => None,
            })
            .collect();
        if let Some(side) = &self.host_side {
            tracing::info!(
                staged_units = staged.len(),
                staged_bytes = staged.iter().sum::<u64>(),
                "planned offload: {} units ({} bytes) stay in pageable memory (streamed blocks through pinned staging buffers, kept sets uploaded once); {side}",
                staged.len(),
                staged.iter().sum::<u64>()
            );
        }
    }

    /// [`Self::reconcile_store`], measuring what device memory in use grew
    /// by meanwhile (both engines released and the allocator's unused
    /// memory given back first, so that only the masters' mappings move
    /// it; 0 where it shrank).
    fn reconcile_measured(&mut self, choices: &[ComponentChoice]) -> Result<u64, OffloadError> {
        let used = |d: &A::Device| -> Result<u64, OffloadError> {
            d.release_unused()
                .map_err(|e| dev_err("release_unused (before the store follows a plan)", e))?;
            let info = d.memory_info().map_err(|e| dev_err("memory_info", e))?;
            Ok(info.total_bytes.saturating_sub(info.free_bytes))
        };
        let before = used(&self.device)?;
        self.reconcile_store(choices)?;
        Ok(used(&self.device)?.saturating_sub(before))
    }

    /// Makes the store's masters match the host side in force for
    /// `choices` (after a re-plan, both engines released): masters of
    /// blocks the plan now stages are freed first (so the page-locked peak
    /// never holds both plans' pins), then the blocks it now pins or holds
    /// are pinned (a block staged because its pin was refused is asked
    /// again).
    fn reconcile_store(&mut self, choices: &[ComponentChoice]) -> Result<(), OffloadError> {
        let layout = self.layout.take().expect("enabled");
        let result = self.reconcile_with(&layout, choices);
        self.layout = Some(layout);
        result
    }

    fn reconcile_with(
        &mut self,
        layout: &Layout,
        choices: &[ComponentChoice],
    ) -> Result<(), OffloadError> {
        let staged = self.staged_units(layout, choices);
        let coded = layout.coded_units(choices);
        let use_of = unit_uses(layout, choices);
        let mut changed = false;
        let mut tally = crate::runtime::layerwise::CodingTally::default();
        let units = Self::store_units(layout);
        // A master's form: (staged, coded). A coded master the codec
        // refused stays raw (it has no coded form to take).
        for to_staged in [true, false] {
            for unit in &units {
                let Some(now) = self.store.get(&unit.name) else {
                    continue;
                };
                let now = (
                    matches!(**now, HostMaster::Staged(_)),
                    self.store_coded.contains_key(&unit.name),
                );
                let want_coded = coded.contains(&unit.name) && self.codec.is_some();
                let want = (staged.contains(&unit.name), want_coded);
                if now == want && now.0 && to_staged && use_of(unit) == UnitUse::Streams {
                    // Its master stays as it was (staged while the plan
                    // before held it, or streamed it): named again under
                    // this plan, which streams it.
                    // (`now == want` and `now.0`: the plan stages it.)
                    let why = self.stage_reason();
                    let coded = if now.1 { ", coded" } else { "" };
                    tracing::info!(unit = %unit.name, bytes = unit.bytes, reason = %why, "`{}` streams staged ({why}){coded}", unit.name);
                }
                if now == want || want.0 != to_staged {
                    continue;
                }
                changed = true;
                let old = self.store.remove(&unit.name).expect("present");
                self.store_coded.remove(&unit.name);
                match Arc::try_unwrap(old) {
                    // SAFETY: both engines are released (their streams
                    // drained, their clones of the master dropped): no copy
                    // reads it.
                    Ok(m) => unsafe { self.phases.handles.free_master(m) }?,
                    Err(m) => {
                        tracing::error!(
                            "host master of `{}` is still shared; leaking it",
                            unit.name
                        );
                        std::mem::forget(m);
                    }
                }
                let master = self.make_master(layout, unit, want, use_of(unit), &mut tally)?;
                self.store.insert(unit.name.clone(), Arc::new(master));
            }
        }
        if !tally.is_empty() {
            tally.log(self.codec.as_deref());
        }
        self.fit_store(layout, choices)?;
        if changed {
            self.log_staged();
        }
        Ok(())
    }

    /// Frees the store's masters (every engine released and drained first).
    fn free_store(&mut self) -> Result<(), OffloadError> {
        self.store_coded.clear();
        let h = &self.phases.handles;
        let mut first = None;
        for (name, m) in std::mem::take(&mut self.store) {
            match Arc::try_unwrap(m) {
                Ok(m) => {
                    // SAFETY: both engines are released (their streams
                    // drained, their clones of the master dropped): no copy
                    // reads it.
                    if let Err(e) = unsafe { h.free_master(m) } {
                        first.get_or_insert(e);
                    }
                }
                Err(m) => {
                    tracing::error!("host master of `{name}` is still shared; leaking it");
                    std::mem::forget(m);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Puts `choices` in force: rings of the streamed blocks, the phase
    /// state (swap groups, resident units), and every hook.
    fn apply(
        &mut self,
        model: &mut Model,
        choices: &[ComponentChoice],
        timer: Option<Arc<Timer<A>>>,
    ) -> Result<(), OffloadError> {
        let layout = self.layout.as_ref().expect("enable resolved the layout");
        let choice_of = |path: &str| choices.iter().find(|c| c.path == path);
        // The rings: each stack with the plan's resident blocks.
        let mut resolved = layout.resolved.clone();
        for stack in &mut resolved.stacks {
            let resident: Vec<String> = choice_of(&stack.owner)
                .map(|c| c.resident_blocks.clone())
                .unwrap_or_default();
            stack.resident = stack
                .blocks
                .iter()
                .enumerate()
                .filter(|(_, b)| resident.contains(&b.path))
                .map(|(i, _)| i)
                .collect();
        }
        let rings = RingLayout::new(&resolved, &layout.partition, 1, 0);
        let (store, store_coded) = (&self.store, &self.store_coded);
        let master_of = |u: &Unit| -> Option<StoredMaster<A>> {
            Some((
                store.get(&u.name).cloned()?,
                store_coded.get(&u.name).copied(),
            ))
        };
        let release = self.release_refused
            || self
                .host_side
                .as_ref()
                .is_some_and(|h| h.release_after_read);
        let block_hooks = self.ring.build(
            &model.pipeline,
            &rings,
            &master_of,
            timer.clone(),
            (release, self.config.host_budget.is_some()),
        )?;
        // The phase state: held sets of components not kept swap; kept
        // sets and everything outside the components stay.
        let mut groups = Vec::new();
        let mut resident = Vec::new();
        let mut group_of: BTreeMap<String, usize> = BTreeMap::new();
        let mut pools: BTreeMap<String, Pool> = BTreeMap::new();
        for (path, module, _) in &layout.components {
            let choice = choice_of(path);
            let mut held: Vec<(Unit, Arc<HostMaster<A>>)> = Vec::new();
            if let Some(u) = layout.partition.rest_of(*module) {
                held.push((u.clone(), Arc::clone(&store[&u.name])));
            }
            let (mut streamed_max, mut coded_max) = (0, 0);
            for stack in resolved.stacks.iter().filter(|s| &s.owner == path) {
                for (i, b) in stack.blocks.iter().enumerate() {
                    let u = &layout.partition.blocks[&b.module];
                    if stack.resident.contains(&i) {
                        held.push((u.clone(), Arc::clone(&store[&u.name])));
                    } else {
                        streamed_max = streamed_max.max(u.bytes);
                        // Its coded master decodes through the phase's
                        // staging buffers (CONTRACT §7b).
                        if let Some((coded, _)) = store_coded.get(&u.name) {
                            coded_max = coded_max.max(*coded);
                        }
                    }
                }
            }
            let depth = choice.map_or(0, |c| c.depth);
            let slots = if streamed_max > 0 { depth + 1 } else { 0 };
            pools.insert(
                path.clone(),
                Pool {
                    slots,
                    slot_bytes: streamed_max,
                    depth,
                    staging_bytes: coded_max,
                },
            );
            if choice.is_some_and(|c| c.kept) {
                resident.extend(held.into_iter().map(|(u, m)| (u, Some(m))));
            } else if !held.is_empty() {
                group_of.insert(path.clone(), groups.len());
                groups.push(Group {
                    path: path.clone(),
                    module: *module,
                    units: held,
                });
            }
        }
        let managed: Vec<ModuleId> = layout.components.iter().map(|c| c.1).collect();
        for unit in &layout.partition.rest {
            if !managed.contains(&unit.module) && !self.store.contains_key(&unit.name) {
                resident.push((unit.clone(), None));
            }
        }
        // Kept sets whose masters are staged (a host budget) upload through
        // one pinned buffer made for them, in chunks, freed once they are
        // done.
        // Swapped held units whose pin was refused are brought in through
        // it at each phase: then it is held for the request (within the
        // plan's upload buffer, never beside a second one).
        let h = &self.phases.handles;
        let mut held_staged = None;
        for (u, _) in groups
            .iter()
            .flat_map(|g| &g.units)
            .filter(|(_, m)| matches!(**m, HostMaster::Staged(_)))
        {
            let why = if self.unpinned {
                "pin_cpu_memory = false"
            } else {
                "its pin was refused"
            };
            tracing::info!(unit = %u.name, bytes = u.bytes, "`{}` is brought in from pageable memory at each of its phases, through a pinned upload buffer ({why})", u.name);
            held_staged = held_staged.max(Some(u.bytes));
        }
        let largest_staged = resident
            .iter()
            .filter(|(_, m)| {
                m.as_ref()
                    .is_some_and(|m| matches!(**m, HostMaster::Staged(_)))
            })
            .map(|(u, _)| u.bytes)
            .chain(held_staged)
            .max();
        let upload_ring = match largest_staged {
            Some(bytes) => Some(crate::runtime::layerwise::upload_ring(h, bytes)?),
            None => None,
        };
        // Every upload of this apply goes through it where it exists (the
        // units outside every component too): one pinned upload buffer at a
        // time, as the planner counts.
        let outside_pinned = self.bugs.has(PlantedBug::OutsideUploadBesideBuffer);
        let store = &self.store;
        let upload = |unit: &Unit| {
            if outside_pinned && !store.contains_key(&unit.name) {
                return None;
            }
            upload_ring
                .as_ref()
                .map(|ring| crate::runtime::layerwise::upload_staged(h, unit, ring))
        };
        let built = model_level::build_planned(
            &self.phases,
            &model.pipeline,
            groups,
            resident,
            // (A mapping is registered whole only without a host budget
            // and with pinned masters, CONTRACT §7c.)
            self.host_limits.is_none() && !self.unpinned,
            &upload,
        );
        let upload_ring = match upload_ring {
            Some(ring) if built.is_ok() && held_staged.is_some() => {
                model_level::keep_upload(&self.phases, ring).err()
            }
            other => other,
        };
        if let Some(ring) = upload_ring {
            let mut first = None;
            crate::runtime::layerwise::free_staging_ring(h, ring, true, &mut first);
            match (&built, first) {
                (Ok(()), Some(e)) => return Err(e),
                (Err(_), Some(e)) => {
                    tracing::error!(
                        "planned offload: freeing the upload buffer after a failed apply: {e}"
                    )
                }
                _ => {}
            }
        }
        built?;
        // Hooks: a phase hook on every component, the ring's on every
        // streamed block, and (while measuring) timing marks on every block.
        let mut hooks: Vec<(ModuleId, &'static str, Box<dyn ModelHook<ForwardCtx>>)> = Vec::new();
        let name = OffloadStrategy::Planned.hook_name();
        for (path, module, _) in &layout.components {
            let pool = pools[path];
            hooks.push((
                *module,
                name,
                Box::new(PhaseHook {
                    device: Arc::clone(&self.device),
                    compute: Arc::clone(&self.compute),
                    phases: Arc::clone(&self.phases),
                    ring: Arc::clone(&self.ring),
                    group: group_of.get(path).copied(),
                    pool,
                    path: path.clone(),
                    timer: timer.clone(),
                    current: Arc::clone(&self.current),
                    bugs: self.bugs.clone(),
                }),
            ));
        }
        for (module, hook) in block_hooks {
            hooks.push((module, name, hook));
        }
        if let Some(t) = &timer {
            for stack in &resolved.stacks {
                for b in &stack.blocks {
                    for (hook_name, before) in [(MARK_BEFORE, true), (MARK_AFTER, false)] {
                        hooks.push((
                            b.module,
                            hook_name,
                            Box::new(BlockMark {
                                timer: Arc::clone(t),
                                compute: Arc::clone(&self.compute),
                                path: b.path.clone(),
                                before,
                                phases: Arc::clone(&self.phases),
                                ring: Arc::clone(&self.ring),
                                current: Arc::clone(&self.current),
                            }),
                        ));
                    }
                }
            }
        }
        self.hooked = install_named_hooks(model, OffloadStrategy::Planned, hooks)?;
        self.timer = timer;
        Ok(())
    }

    /// Takes the plan in force out: hooks removed, both engines released
    /// (drained first); the store's masters stay. Every step runs; the
    /// first error is returned.
    fn unapply(&mut self, model: &mut Model, drain: bool) -> Result<(), OffloadError> {
        remove_hooks(model, OffloadStrategy::Planned, &mut self.hooked);
        let ring = self.ring.release(drain);
        let st = self.phases.lock().take();
        let phases = st.map_or(Ok(()), |st| {
            model_level::release_state(&self.phases, "planned", st, drain)
        });
        self.timer = None;
        ring.and(phases)
    }

    /// Releases everything (the plan in force, then the store).
    fn release_all(&mut self, model: Option<&mut Model>, drain: bool) -> Result<(), OffloadError> {
        let undone = match model {
            Some(m) => self.unapply(m, drain),
            None => {
                let ring = self.ring.release(drain);
                let st = self.phases.lock().take();
                let phases = st.map_or(Ok(()), |st| {
                    model_level::release_state(&self.phases, "planned", st, drain)
                });
                ring.and(phases)
            }
        };
        // Masters are freed only once both engines drained and let go.
        let stored = if undone.is_ok() {
            self.free_store()
        } else {
            tracing::error!("planned offload: leaking its host masters after a failed release");
            for (_, m) in std::mem::take(&mut self.store) {
                std::mem::forget(m);
            }
            Ok(())
        };
        self.layout = None;
        // The blobs enable encoded go with everything else.
        self.coded_forms.clear();
        undone.and(stored)
    }

    /// Plans from `inputs` and puts the plan in force in place of the one
    /// now in force. With `check` (the request the warm-up ran), a plan
    /// that streams coded blocks while `inputs` carry no measured decode
    /// interference is put in force timed, and the check request is
    /// pending ([`Self::wants_check`]).
    fn replan(
        &mut self,
        model: &mut Model,
        inputs: PlannerInputs,
        check: Option<RequestShape>,
    ) -> Result<(), OffloadError> {
        let memory = self.memory.expect("enabled");
        // Planning is pure: a plan that fails here leaves the one in force.
        // (One made again once the store has followed it, with the
        // mappings its masters took, may fail after the plan in force is
        // taken out: `settle_store`'s typed error, which poisons.)
        let plan = budget::plan_within(
            &model.pipeline,
            &self.config,
            &inputs,
            memory,
            self.host_limits.clone(),
        )
        .map_err(|e| OffloadError::Budget(Box::new(e)))?;
        *lock(&self.current) = None;
        let mut settled = None;
        let applied = self.unapply(model, true).and_then(|()| {
            let (plan, inputs) = self.settle_store(&model.pipeline, plan, inputs)?;
            tracing::info!("planned offload: {plan}");
            let timer = (check.is_some() && self.wants_check(&plan, &inputs))
                .then(|| Arc::new(Timer::new(Arc::clone(&self.device))));
            self.check = timer.as_ref().and(check);
            let applied = self.apply(model, &plan.choices(), timer);
            settled = Some((plan, inputs));
            applied
        });
        if let Err(e) = applied {
            // Half of one plan and half of another is no plan: everything
            // is released (hooks removed, memory freed, masters unpinned)
            // and the backend refuses further use.
            self.check = None;
            let _ = self.release_all(Some(model), true);
            self.plan = None;
            self.lifecycle
                .poison(format!("planned offload: a re-plan failed: {e}"));
            return Err(e);
        }
        let (plan, inputs) = settled.expect("applied");
        self.plan = Some(plan);
        self.inputs = Some(inputs);
        self.drop_blobs();
        Ok(())
    }

    /// Makes the store follow `plan` (both engines released), measuring
    /// what its change grew device memory in use by: its new masters may
    /// map more than the plan counted (a coded-block file registered beside
    /// the checkpoint whose windows the raw units still hold). Where they
    /// do, plans again from `inputs` with the larger mappings and follows
    /// that plan, up to [`SETTLE_ROUNDS`] plans in all; the plan returned
    /// is always the one the store (and the host side in force) follows.
    /// A plan that no longer fits the budget with the mappings counted is
    /// a typed error (the budget cannot hold the masters' mappings).
    fn settle_store(
        &mut self,
        pipeline: &crate::model::Pipeline,
        mut plan: RequestPlan,
        mut inputs: PlannerInputs,
    ) -> Result<(RequestPlan, PlannerInputs), OffloadError> {
        let memory = self.memory.expect("enabled");
        for round in 1..=SETTLE_ROUNDS {
            self.host_side = plan.host.clone();
            let grew = if self.bugs.has(PlantedBug::StoreMappingsUnmeasured) {
                self.reconcile_store(&plan.choices())?;
                0
            } else {
                self.reconcile_measured(&plan.choices())?
            };
            let host: u64 = self.store.values().map(|m| m.len_bytes()).sum();
            // The masters' mappings (never counted smaller), and the page
            // tables of the pinned buffers this plan holds beside them.
            let masters = self.mapping_bytes;
            self.mapping_bytes = masters
                .saturating_add(grew)
                .min(self.mapping_cap(host).max(masters));
            let tables = self.buffer_tables(plan.host.as_ref());
            let counted = inputs.mapping_bytes;
            let mapping = self.mapping_bytes.saturating_add(tables);
            if mapping <= counted {
                break;
            }
            if round == SETTLE_ROUNDS {
                tracing::warn!(
                    grew,
                    tables,
                    "planned offload: after {SETTLE_ROUNDS} plans the masters' mappings and the page tables of the pinned staging and upload buffers ({tables} B) still exceed the {counted} B the plan counts (the masters grew device memory in use by {grew} B: another process allocating?); keeping the last"
                );
                break;
            }
            tracing::info!(
                grew,
                tables,
                mapping,
                "planned offload: the masters of this plan grew device memory in use by {grew} B, and its pinned staging and upload buffers take {tables} B of page tables, beyond the {counted} B of mappings it counted; planning again with {mapping} B"
            );
            inputs.mapping_bytes = mapping;
            plan = budget::plan_within(
                pipeline,
                &self.config,
                &inputs,
                memory,
                self.host_limits.clone(),
            )
            .map_err(|e| OffloadError::Budget(Box::new(e)))?;
        }
        Ok((plan, inputs))
    }

    /// Device memory the page tables of the pinned buffers held beside
    /// the masters take (the staging ring and the upload buffer, pinned at
    /// apply: not in the masters' measured mappings): those `side` plans,
    /// or, where the store stages masters the plan did not (pins the
    /// device refused, with or without a host side), those its staged
    /// masters make (a ring of two of the largest and its upload buffer),
    /// whichever is more.
    fn buffer_tables(&self, side: Option<&HostSide>) -> u64 {
        if self.bugs.has(PlantedBug::StagingTablesUncounted) {
            return 0;
        }
        let tables = |bytes: u64| self.device.host_page_table_bytes(bytes);
        let planned = side.map_or(0, |s| tables(s.staging_bytes) + tables(s.transient_bytes));
        let largest = self
            .store
            .values()
            .filter_map(|m| match &**m {
                HostMaster::Staged(s) => Some(s.bytes),
                _ => None,
            })
            .max();
        let built = largest.map_or(0, |b| {
            tables(crate::budget::host::staging_ring_bytes(
                b,
                self.config.host_budget.is_some(),
            )) + tables(b.min(crate::budget::host::UPLOAD_STAGING_BYTES))
        });
        planned.max(built)
    }

    /// The most of a growth in device memory while `host` bytes of
    /// masters were made that is taken for their mappings: twice the page
    /// tables the device declares for them, at least 1/256 of them (twice
    /// a page table of 8 B per 4 KiB page); beyond it, another process's.
    fn mapping_cap(&self, host: u64) -> u64 {
        (host / 256).max(self.device.host_page_table_bytes(host).saturating_mul(2))
    }

    /// The allocator's slack every phase carries at least: up to a chunk
    /// less one byte of rounding (CONTRACT §7a).
    fn least_slack(&self) -> u64 {
        if self.bugs.has(PlantedBug::SlackSampledNotChunked) {
            return 0;
        }
        self.device.allocation_chunk().max(1) - 1
    }

    /// What the warm-up measured, from its marks and memory samples.
    fn measurements(
        &self,
        model: &Model,
        timer: &Timer<A>,
        shape: &RequestShape,
        seconds: f64,
    ) -> Result<PlannerInputs, OffloadError> {
        let layout = self.layout.as_ref().expect("enabled");
        let memory = self.memory.expect("enabled");
        let marks = timer.read()?;
        let mut compute: BTreeMap<String, f64> = BTreeMap::new();
        let mut start = BTreeMap::new();
        let mut own: BTreeMap<String, f64> = BTreeMap::new();
        let mut forwards: BTreeMap<String, u64> = BTreeMap::new();
        let mut open_copy: Option<(u64, u64)> = None;
        let mut copies: Vec<(u64, u64)> = Vec::new();
        // The phase running: its path, start, the time of its first block's
        // marks (its leading kernels end there) and of its last block's end
        // (its trailing kernels start there).
        let mut phase: Option<(String, u64, Option<u64>, Option<u64>)> = None;
        for (mark, t) in marks {
            match mark {
                Mark::CopyStart { bytes } => open_copy = Some((bytes, t)),
                // The warm-up streams every block raw: no decodes.
                Mark::DecodeStart | Mark::DecodeEnd => {}
                Mark::CopyEnd => {
                    if let Some((bytes, t0)) = open_copy.take() {
                        copies.push((bytes, t.saturating_sub(t0)));
                    }
                }
                Mark::BlockBefore(_) => {
                    if let Some((_, _, first @ None, _)) = phase.as_mut() {
                        *first = Some(t);
                    }
                }
                Mark::BlockStart(p) => {
                    start.insert(p, t);
                }
                Mark::BlockEnd(p) => {
                    if let Some(s) = start.get(&p) {
                        // The last forward's: free of first-use costs.
                        compute.insert(p.clone(), t.saturating_sub(*s) as f64 * 1e-9);
                    }
                    if let Some((_, _, _, last)) = phase.as_mut() {
                        *last = Some(t);
                    }
                }
                Mark::PhaseStart(p) => {
                    *forwards.entry(p.clone()).or_default() += 1;
                    phase = Some((p, t, None, None));
                }
                Mark::PhaseEnd(p) => {
                    if let Some((q, t0, first, last)) = phase.take()
                        && q == p
                    {
                        // Its own kernels: before its first block and after
                        // its last (between blocks the device waits for
                        // fills and the host, which are not its compute).
                        let ns = match (first, last) {
                            (Some(f), Some(l)) => f.saturating_sub(t0) + t.saturating_sub(l),
                            _ => t.saturating_sub(t0),
                        };
                        own.insert(p, ns as f64 * 1e-9);
                    }
                }
            }
        }
        let (link, latency) = fit_link(&copies).unwrap_or_else(|| {
            tracing::warn!(
                "planned offload: the warm-up copied no block to time the link; assuming 25 GB/s"
            );
            (25e9, 10e-6)
        });
        // Activations: per phase, the most memory in use beside the
        // weights held then (and beside what was in use before enable).
        // The host masters' mappings are counted apart (every phase
        // carries them), not as activations.
        // (The pool's rounding at a mark and the page tables of the
        // warm-up's own staging buffers are in the device's count, so in
        // `by_free`, and the slack and tables counted apart count them
        // again: on the safe side.)
        let used_before = memory.total_bytes.saturating_sub(memory.free_bytes) + self.mapping_bytes;
        let mut activation: BTreeMap<String, u64> = BTreeMap::new();
        // The allocator's slack: what it held beyond what was in use
        // rounded up to its chunk (what frees left in chunks still part
        // used), and the rounding itself, up to a chunk less one byte in
        // any phase (a sample of it here says nothing of another phase's).
        let chunk = match self.least_slack() {
            0 => 1,
            least => least + 1,
        };
        let mut slack = 0u64;
        for (p, s) in timer.samples() {
            if let (Some(reserved), Some(peak)) = (s.reserved_peak_bytes, s.peak_bytes) {
                let rounded = peak.div_ceil(chunk).saturating_mul(chunk);
                slack = slack.max(reserved.saturating_sub(rounded));
            }
            let by_free = s
                .used_bytes
                .saturating_sub(s.weight_bytes)
                .saturating_sub(used_before);
            let by_peak = s
                .peak_bytes
                .map_or(0, |peak| peak.saturating_sub(s.weight_bytes));
            let a = activation.entry(p).or_default();
            *a = (*a).max(by_free).max(by_peak);
        }
        if self.bugs.has(PlantedBug::UnderstateActivations) {
            for (path, _, role) in &layout.components {
                if *role == Role::Dit
                    && let Some(a) = activation.get_mut(path)
                {
                    *a /= 2;
                }
            }
        }
        let steps = f64::from(shape.steps.max(1));
        let mut components = BTreeMap::new();
        for (path, _, role) in &layout.components {
            let n = forwards.get(path).copied().unwrap_or(0) as f64;
            let per_step = *role == Role::Dit;
            let block_compute_s = layout
                .resolved
                .stacks
                .iter()
                .filter(|s| &s.owner == path)
                .flat_map(|s| &s.blocks)
                .filter_map(|b| compute.get(&b.path).map(|t| (b.path.clone(), *t)))
                .collect();
            components.insert(
                path.clone(),
                ComponentInputs {
                    forwards: if per_step { n / steps } else { n },
                    per_step,
                    own_compute_s: own.get(path).copied().unwrap_or(0.0),
                    block_compute_s,
                    coded_block_bytes: BTreeMap::new(),
                    activation_bytes: activation.get(path).copied().unwrap_or(0),
                },
            );
        }
        let request = self.request_of(model).unwrap_or_else(|| shape.clone());
        let inputs = PlannerInputs {
            pipeline_type: model.pipeline.type_name().to_owned(),
            link_bytes_per_s: link,
            steps: request.steps,
            components,
            source: InputSource::Warmup {
                shape: shape.clone(),
                seconds,
                device_total_bytes: memory.total_bytes,
                device_free_bytes: memory.free_bytes,
            },
            copy_latency_s: latency,
            allocation_granule_bytes: self.device.allocation_granule(),
            mapping_bytes: self.mapping_bytes,
            allocator_slack_bytes: slack.saturating_add(chunk - 1),
            // Where the warm-up staged blocks, their fills' rate; only a
            // host that fills on threads of its own times them as they
            // run (a simulated host's fills take no simulated time).
            host_fill_bytes_per_s: self
                .ring
                .host_fill_rate()
                .filter(|_| self.device.host_worker_threads()),
            ..PlannerInputs::new(link, request.steps)
        };
        // Coded sizes and the decoder's rate (`weight_compression`).
        Ok(self.with_coded(layout, inputs))
    }

    /// Whether `plan` needs the check request (CONTRACT §9): it streams
    /// coded blocks and `inputs` carry no measured decode interference,
    /// so what its decodes cost the kernels beside them is the H200's
    /// fit, not this device's; and some phase that streams coded blocks
    /// is bound by compute, its decodes at least [`CHECK_DECODE_SHARE`] of
    /// the request ([`check_request_wanted`]). Where the link binds every
    /// such phase, its decodes run while compute waits for them: the check
    /// would measure nothing ([`decode_interference_of`]'s quarter rule)
    /// and pay a request at every start; where those compute binds decode
    /// for a sliver, it would time too few. Either way it is skipped, and
    /// an `info` line says why.
    fn wants_check(&self, plan: &RequestPlan, inputs: &PlannerInputs) -> bool {
        if self.bugs.has(PlantedBug::DecodeInterferenceAssumed)
            || inputs.decode_interference.is_some()
        {
            return false;
        }
        match check_request_wanted(plan) {
            Ok(wanted) => wanted,
            Err(why) => {
                tracing::info!(
                    "planned offload: no check request: {why}; the assumed decode interference {} stays",
                    budget::DECODE_INTERFERENCE
                );
                false
            }
        }
    }

    /// After the check request: the decode interference its marks show
    /// (how much longer each block's kernels ran than the warm-up measured
    /// them, over how long decodes ran beside them), planned again with.
    fn finish_check(
        &mut self,
        model: &mut Model,
        shape: &RequestShape,
        seconds: f64,
    ) -> Result<(), OffloadError> {
        let timer = self.timer.clone().expect("a check request runs timed");
        let marks = timer.read()?;
        drop(timer.samples());
        let mut inputs = self.inputs.clone().expect("a plan has its inputs");
        let measured = decode_interference_of(&marks, &inputs);
        if let InputSource::Warmup { seconds: s, .. } = &mut inputs.source {
            *s += seconds;
        }
        match measured {
            Some(m) => {
                let k = m.interference();
                tracing::info!(
                    decode_interference = k,
                    decodes = m.decodes,
                    beside_compute_s = m.overlap_s,
                    longer_s = m.longer_s,
                    "planned offload: the check request ({}) measured each decode slowing the kernels beside it by {k:.2} of their overlap ({} decodes, {:.1} ms of them beside compute, the kernels {:.1} ms longer than in the warm-up; {} assumed); planning again with it",
                    shape.for_warmup(),
                    m.decodes,
                    m.overlap_s * 1e3,
                    m.longer_s * 1e3,
                    budget::DECODE_INTERFERENCE
                );
                inputs.decode_interference = Some(k);
            }
            None => tracing::info!(
                "planned offload: the check request ({}) ran too few decodes beside compute to measure what they cost it (the link binds: they run while compute waits), or its figure was noise; keeping the assumed decode interference {}",
                shape.for_warmup(),
                budget::DECODE_INTERFERENCE
            ),
        }
        // Planned again either way: the plan in force carries the check's
        // timing marks. A shortfall the check ran into was enable's: the
        // first served request keeps its own re-plan (CONTRACT §7a).
        self.replanned = false;
        self.replan(model, inputs, None)
    }

    /// Drops the blobs enable encoded (CONTRACT §7b): once a plan's store
    /// is built, those it streams coded are pinned; a later re-plan that
    /// streams another block coded encodes it again.
    fn drop_blobs(&mut self) {
        for f in self.coded_forms.values_mut() {
            f.blob = None;
        }
    }
}

/// What a unit of the store is under a plan: a streamed block, or a held
/// unit (its component's rest or a resident block) of a kept component
/// (uploaded once) or of a swapped one (brought in at each of its
/// phases).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum UnitUse {
    Streams,
    Kept,
    Swapped,
}

/// Each store unit's [`UnitUse`] under `choices`.
fn unit_uses(layout: &Layout, choices: &[ComponentChoice]) -> impl Fn(&Unit) -> UnitUse {
    let held = held_modules(layout, choices);
    let kept_paths: BTreeSet<&str> = choices
        .iter()
        .filter(|c| c.kept)
        .map(|c| c.path.as_str())
        .collect();
    let mut kept: BTreeSet<ModuleId> = layout
        .components
        .iter()
        .filter(|(path, _, _)| kept_paths.contains(path.as_str()))
        .map(|(_, module, _)| *module)
        .collect();
    kept.extend(
        layout
            .resolved
            .stacks
            .iter()
            .filter(|s| kept_paths.contains(s.owner.as_str()))
            .flat_map(|s| &s.blocks)
            .map(|b| b.module),
    );
    let blocks: BTreeSet<ModuleId> = layout.partition.blocks.keys().copied().collect();
    move |unit: &Unit| {
        if blocks.contains(&unit.module) && !held.contains(&unit.module) {
            UnitUse::Streams
        } else if kept.contains(&unit.module) {
            UnitUse::Kept
        } else {
            UnitUse::Swapped
        }
    }
}

/// The block modules `choices` keep resident (held).
fn held_modules(layout: &Layout, choices: &[ComponentChoice]) -> BTreeSet<ModuleId> {
    layout
        .resolved
        .stacks
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| choices.iter().any(|c| c.resident_blocks.contains(&b.path)))
        .map(|b| b.module)
        .collect()
}

/// The least share of a request's predicted time that the decodes beside
/// compute (those of the phases compute binds) must take for a check
/// request to run. Below it the decodes are too few to time against the
/// kernels' own spread, and what their figure moves the prediction by is
/// small: (figure − 0.9) × the decodes, under 0.2 % of the request over
/// the figures measured (the H100's 0.75–1.06, the H200's 0.79–1.08) and
/// at most 3.1 % at the planner's extreme, 4.
pub const CHECK_DECODE_SHARE: f64 = 0.01;

/// Whether a check request (CONTRACT §9) is worth running for `plan`:
/// `Ok(false)` where it streams nothing coded, `Ok(true)` where the coded
/// phases that compute binds decode for at least [`CHECK_DECODE_SHARE`]
/// of the request, and otherwise why not (the `info` line's words): the
/// link binds every phase that streams coded blocks (their decodes run
/// while compute waits), or those compute binds decode too little.
pub fn check_request_wanted(plan: &RequestPlan) -> Result<bool, String> {
    let coded: Vec<&budget::ComponentPlan> = plan
        .components
        .iter()
        .filter(|c| !c.coded_blocks.is_empty())
        .collect();
    if coded.is_empty() {
        return Ok(false);
    }
    let names = |cs: &[&budget::ComponentPlan]| {
        cs.iter()
            .map(|c| c.path.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let beside: Vec<&budget::ComponentPlan> = coded
        .iter()
        .copied()
        .filter(|c| c.limit == budget::Limit::Compute)
        .collect();
    if beside.is_empty() {
        return Err(format!(
            "the link binds every phase that streams coded blocks ({}), so their decodes run while compute waits and what they cost the kernels would not show",
            names(&coded)
        ));
    }
    let decode_s: f64 = beside.iter().map(|c| c.decode_s).sum();
    // (A prediction of 0 or NaN, which no plan the planner makes has,
    // runs the check: the comparison below is false.)
    let request_s = plan.predicted_request_s;
    if decode_s < CHECK_DECODE_SHARE * request_s {
        return Err(format!(
            "the phases compute binds that stream coded blocks ({}) decode for {:.2} ms of a {:.3} s request, under {:.0} % of it: too few decodes to time, and what they cost the kernels moves the prediction little",
            names(&beside),
            decode_s * 1e3,
            request_s,
            CHECK_DECODE_SHARE * 100.0
        ));
    }
    Ok(true)
}

/// What the check request's marks show of its decodes and the kernels
/// beside them.
#[derive(Clone, Copy, Debug, PartialEq)]
struct DecodeCost {
    /// Decodes timed.
    decodes: usize,
    /// Seconds of decode beside the kernels of blocks whose warm-up compute
    /// is known.
    overlap_s: f64,
    /// How much longer those blocks' kernels ran than in the warm-up,
    /// seconds (negative where they ran shorter).
    longer_s: f64,
}

impl DecodeCost {
    /// The interference: `longer_s / overlap_s` (within the planner's
    /// range: [`decode_interference_of`] measures nothing outside it).
    fn interference(&self) -> f64 {
        self.longer_s / self.overlap_s
    }
}

/// The decode interference the check request's `marks` show against the
/// block compute `inputs` carry (the warm-up's, every block streamed raw):
/// over every block forward that ran beside a decode, how much longer its
/// kernels ran, over how long decodes ran beside them within the kernels'
/// own time. `None` where that overlap is less than a quarter of the
/// decodes' time (where the link binds and decodes run
/// while compute waits: what they cost compute then says little, and
/// matters little), or the figure is at or below 0 or at or beyond
/// `MAX_DECODE_INTERFERENCE` (noise, not a measurement).
fn decode_interference_of(marks: &[(Mark, u64)], inputs: &PlannerInputs) -> Option<DecodeCost> {
    let compute: BTreeMap<&str, f64> = inputs
        .components
        .values()
        .flat_map(|c| c.block_compute_s.iter().map(|(p, t)| (p.as_str(), *t)))
        .collect();
    let mut decodes: Vec<(u64, u64)> = Vec::new();
    let mut open: Option<u64> = None;
    let mut start: BTreeMap<&str, u64> = BTreeMap::new();
    let mut windows: Vec<(&str, u64, u64)> = Vec::new();
    for (mark, t) in marks {
        match mark {
            Mark::DecodeStart => open = Some(*t),
            Mark::DecodeEnd => {
                if let Some(t0) = open.take() {
                    decodes.push((t0, *t));
                }
            }
            Mark::BlockStart(p) => {
                start.insert(p, *t);
            }
            Mark::BlockEnd(p) => {
                if let Some(s) = start.remove(p.as_str()) {
                    windows.push((p, s, *t));
                }
            }
            _ => {}
        }
    }
    let decoding: u64 = decodes.iter().map(|(s, e)| e.saturating_sub(*s)).sum();
    let (mut overlap, mut longer) = (0u64, 0.0f64);
    for (p, s, e) in windows {
        let Some(raw) = compute.get(p) else {
            continue;
        };
        // Every decode within the kernels' own time (what the warm-up
        // measured them at): a decode in the tail it stretched them by is
        // its cost, not more overlap. The planner's recurrence charges the
        // figure over every decode its ring has issued within a kernel
        // (`budget::staged_ends`): all of these but those it starts
        // before their hook issues them.
        let end = e.min(s.saturating_add((raw * 1e9) as u64));
        let o: u64 = decodes
            .iter()
            .map(|&(ds, de)| de.min(end).saturating_sub(ds.max(s)))
            .sum();
        if o > 0 {
            overlap += o;
            longer += e.saturating_sub(s) as f64 * 1e-9 - raw;
        }
    }
    let cost = DecodeCost {
        decodes: decodes.len(),
        overlap_s: overlap as f64 * 1e-9,
        longer_s: longer,
    };
    // A figure at or below 0, or beyond the planner's range, is noise (a
    // clock that moved between the warm-up and the check), not a
    // measurement.
    let k = cost.interference();
    (overlap > 0
        && overlap.saturating_mul(4) >= decoding
        && k > 0.0
        && k < budget::MAX_DECODE_INTERFERENCE)
        .then_some(cost)
}

/// The link from the warm-up's copies `(bytes, ns)`: a least-squares fit
/// of `time = latency + bytes / bandwidth` where the copies differ in size
/// enough to tell the two apart (else the bandwidth of all the bytes, and
/// no latency): bytes per second and seconds, or `None` without copies.
fn fit_link(copies: &[(u64, u64)]) -> Option<(f64, f64)> {
    let n = copies.len() as f64;
    let total_ns: u64 = copies.iter().map(|c| c.1).sum();
    if copies.is_empty() || total_ns == 0 {
        return None;
    }
    let (sx, sy) = copies.iter().fold((0.0, 0.0), |(x, y), (b, t)| {
        (x + *b as f64, y + *t as f64 * 1e-9)
    });
    let (mx, my) = (sx / n, sy / n);
    let (mut sxx, mut sxy) = (0.0, 0.0);
    for (b, t) in copies {
        let (dx, dy) = (*b as f64 - mx, *t as f64 * 1e-9 - my);
        sxx += dx * dx;
        sxy += dx * dy;
    }
    let spread = sxx.sqrt() / n.sqrt();
    if spread > 0.05 * mx && sxy > 0.0 {
        let per_byte = sxy / sxx;
        let latency = (my - per_byte * mx).max(0.0);
        return Some((1.0 / per_byte, latency));
    }
    Some((sx / sy, 0.0))
}

/// The hook on each component: its phase begins (its held set brought in,
/// every other component's evicted, its slot pool made) and ends.
struct PhaseHook<A: Api> {
    device: Arc<A::Device>,
    compute: Arc<A::Stream>,
    phases: Arc<Phases<A>>,
    ring: Arc<RingEngine<A>>,
    /// Its swap group in the phase state (none: kept, or nothing held).
    group: Option<usize>,
    /// Its phase's slot pool (and decode staging).
    pool: Pool,
    path: String,
    timer: Option<Arc<Timer<A>>>,
    current: Arc<Mutex<Option<String>>>,
    bugs: Bugs,
}

impl<A: Api> PhaseHook<A> {
    fn weights(&self) -> u64 {
        self.phases.device_weight_bytes() + self.ring.device_weight_bytes()
    }

    fn pre(&self) -> Result<(), OffloadError> {
        let begins = lock(&self.current).replace(self.path.clone()).as_deref() != Some(&self.path);
        // The phase before gives its memory back first (the held sets not
        // kept, then a slot pool unlike this phase's), so the device never
        // holds two phases' sets at once; then this phase's pool and held
        // set come in.
        if !self.bugs.has(PlantedBug::SkipPhaseEviction) {
            model_level::evict_others(&self.phases, self.group)?;
        }
        let keep_pool = self.bugs.has(PlantedBug::KeepPoolAcrossPhases) && self.pool.slots == 0;
        if begins {
            // What the phase before freed goes back to the device before
            // this one allocates (the host waits for those frees, so for
            // the phase before's last kernels): the allocator keeps no
            // slack of it that the device's free memory would miss.
            if !keep_pool && !self.ring.has_pool(self.pool) {
                self.ring.use_pool(Pool {
                    depth: 1,
                    ..Pool::default()
                })?;
            }
            self.device
                .release_unused()
                .map_err(|e| dev_err("release_unused (a phase begins)", e))?;
        }
        if !keep_pool {
            self.ring.use_pool(self.pool)?;
        }
        if let Some(g) = self.group {
            model_level::enter(&self.phases, g)?;
        }
        if let Some(t) = &self.timer {
            t.reset_peak()?;
            t.mark(&self.compute, Mark::PhaseStart(self.path.clone()))?;
        }
        Ok(())
    }

    fn post(&self) -> Result<(), OffloadError> {
        if let Some(t) = &self.timer {
            t.mark(&self.compute, Mark::PhaseEnd(self.path.clone()))?;
            // The warm-up only: the phase's high-water mark is read once
            // its work is done.
            self.device
                .synchronize_stream(&self.compute)
                .map_err(|e| dev_err("synchronize_stream(compute) to measure a phase", e))?;
            t.sample(&self.path, self.weights())?;
        }
        if let Some(g) = self.group {
            model_level::leave(&self.phases, g)?;
        }
        Ok(())
    }
}

impl<A: Api> ModelHook<ForwardCtx> for PhaseHook<A> {
    fn pre_forward(&mut self, _: &mut ForwardCtx) -> Result<PreForward, BoxError> {
        self.pre()?;
        Ok(PreForward::Continue)
    }

    fn post_forward(&mut self, _: &mut ForwardCtx, _: &Forwarded) -> Result<(), BoxError> {
        Ok(self.post()?)
    }
}

/// A timing mark on a block, while the warm-up measures: before the ring's
/// hook (its wait for the fill included) or after it (the block's kernels
/// alone), with a memory sample.
struct BlockMark<A: Api> {
    timer: Arc<Timer<A>>,
    compute: Arc<A::Stream>,
    path: String,
    before: bool,
    phases: Arc<Phases<A>>,
    ring: Arc<RingEngine<A>>,
    current: Arc<Mutex<Option<String>>>,
}

impl<A: Api> BlockMark<A> {
    fn sample(&self) -> Result<(), OffloadError> {
        let phase = lock(&self.current).clone().unwrap_or_default();
        let weights = self.phases.device_weight_bytes() + self.ring.device_weight_bytes();
        self.timer.sample(&phase, weights)
    }
}

impl<A: Api> ModelHook<ForwardCtx> for BlockMark<A> {
    fn pre_forward(&mut self, _: &mut ForwardCtx) -> Result<PreForward, BoxError> {
        let mark = if self.before {
            Mark::BlockBefore(self.path.clone())
        } else {
            Mark::BlockStart(self.path.clone())
        };
        self.timer.mark(&self.compute, mark)?;
        self.sample()?;
        Ok(PreForward::Continue)
    }

    fn post_forward(&mut self, _: &mut ForwardCtx, _: &Forwarded) -> Result<(), BoxError> {
        if !self.before {
            self.timer
                .mark(&self.compute, Mark::BlockEnd(self.path.clone()))?;
            self.sample()?;
        }
        Ok(())
    }
}

impl<A: Api> Drop for PlannedBackend<A> {
    fn drop(&mut self) {
        if self.layout.is_some() {
            let drain = !self.bugs.has(PlantedBug::DropWithoutDrain);
            if let Err(e) = self.release_all(None, drain) {
                tracing::error!("dropping an enabled planned backend: {e}");
            }
        }
    }
}

impl<A: Api> OffloadBackend for PlannedBackend<A> {
    fn strategy(&self) -> OffloadStrategy {
        OffloadStrategy::Planned
    }

    fn enable(&mut self, model: &mut Model) -> Result<(), OffloadError> {
        let _span = enable_span(OffloadStrategy::Planned, model).entered();
        if self.lifecycle.begin_enable()? == EnableStep::AlreadyEnabled {
            return Ok(());
        }
        check_single_owner(model, OffloadStrategy::Planned)?;
        // Everything that can fail without touching anything first.
        let info = self
            .device
            .memory_info()
            .map_err(|e| dev_err("memory_info", e))?;
        let memory = DeviceMemory {
            total_bytes: info.total_bytes,
            free_bytes: info.free_bytes,
        };
        // The budget itself (a size above the device, or `auto` with no
        // room) fails before the store is built or a warm-up runs (INV-5).
        let (budget_bytes, _) = budget::resolve_budget(&self.config, memory)
            .map_err(|e| OffloadError::Budget(Box::new(e)))?;
        // The host budget, read once (`"auto"`): every plan of this enable
        // plans within what it read.
        let host_limits = budget::config_host_limits(&self.config)
            .map_err(|e| OffloadError::Budget(Box::new(e)))?;
        let resolved = resolve(&model.pipeline, &self.config)?;
        let groups: Vec<ModuleId> = resolved.components.iter().map(|c| c.module).collect();
        let weights = &self.phases.handles.weights;
        let part = partition(&model.pipeline, &resolved.stacks, &groups)
            .in_source_order(&model.pipeline, &|s| weights.position(s));
        let components: Vec<(String, ModuleId, Role)> = resolved
            .components
            .iter()
            .filter(|c| c.role != Role::Resident && !c.self_managed)
            .map(|c| (c.path.clone(), c.module, c.role))
            .collect();
        let request = self.request_of(model);
        let layout = Layout {
            bf16: crate::runtime::layout::bf16_storages(&model.pipeline),
            resolved,
            partition: part,
            components,
        };
        // `weight_compression` (CONTRACT §7b): each streamed block's coded
        // size and the decoder's rate, before anything is planned (but
        // after what can fail without them: encoding takes minutes).
        let given = self.given.clone();
        // Coded masters are made (the decoder's measurement) within the
        // host budget: a coded-block file's window copied, never
        // registered (which would lock its whole mapping).
        self.host_limits = host_limits.clone();
        let (choices, plan, inputs, warmup, host_side) = match &given {
            Some(given) => {
                self.learn_coded_or_drop(&layout, budget_bytes)?;
                let mut inputs = self.with_coded(&layout, given.clone());
                if let Some(r) = &request {
                    inputs.steps = r.steps;
                }
                // The device's own facts, whoever gave the rest: its
                // allocator's granule now, the mappings as last measured
                // (measured again below, once the masters exist).
                inputs.allocation_granule_bytes = self.device.allocation_granule();
                let plan = match budget::plan_within(
                    &model.pipeline,
                    &self.config,
                    &inputs,
                    memory,
                    host_limits.clone(),
                ) {
                    Ok(plan) => plan,
                    Err(e) => {
                        // The blobs enable encoded go with the failed enable.
                        self.coded_forms.clear();
                        return Err(OffloadError::Budget(Box::new(e)));
                    }
                };
                let side = plan.host.clone();
                (plan.choices(), Some(plan), Some(inputs), None, side)
            }
            None => {
                let Some(shape) = request else {
                    return Err(OffloadError::Budget(Box::new(
                        BudgetError::NoPlannerInputs {
                            budget: self
                                .config
                                .device_budget
                                .unwrap_or(budget::DeviceBudget::Auto),
                        },
                    )));
                };
                let (choices, minimum, side) = budget::smallest_footprint_within(
                    &model.pipeline,
                    &self.config,
                    host_limits.clone(),
                )
                .map_err(|e| OffloadError::Budget(Box::new(e)))?;
                // The warm-up itself runs in the smallest footprint: a
                // budget below it (activations not yet counted) fails now,
                // not after a warm-up that would have exceeded it.
                let room = budget_bytes.min(memory.free_bytes);
                if minimum.bytes > room {
                    let device =
                        crate::bytes::DeviceBudget::size_of(self.config.device_budget, room);
                    // The host budget moved the warm-up off the device's
                    // smallest footprint: where that one fits the device,
                    // it is the pair that does not fit, not the device.
                    if let Some(limits) = &host_limits {
                        let (_, smallest) =
                            budget::smallest_footprint(&model.pipeline, &self.config)
                                .map_err(|e| OffloadError::Budget(Box::new(e)))?;
                        if smallest.bytes <= room {
                            return Err(OffloadError::Budget(Box::new(
                                BudgetError::NoPlanFitsBoth {
                                    device,
                                    host: match self.config.host_budget {
                                        Some(crate::bytes::HostBudget::Bytes(b)) => b,
                                        _ => crate::bytes::ByteSize::new(limits.budget),
                                    },
                                    held_room: limits.budget,
                                },
                            )));
                        }
                    }
                    // (The smallest footprint counts no activations.)
                    return Err(OffloadError::Budget(Box::new(minimum.does_not_fit(device))));
                }
                self.learn_coded_or_drop(&layout, budget_bytes)?;
                (choices, None, None, Some(shape), side)
            }
        };
        log_warnings(&layout.resolved.warnings);
        self.memory = Some(memory);
        self.host_limits = host_limits;
        if let Some(side) = &host_side {
            tracing::info!("planned offload: {side}");
        }
        self.host_side = host_side;
        if let Err(e) = self.build_store(&layout, &choices) {
            self.layout = Some(layout);
            let _ = self.release_all(None, true);
            return Err(e);
        }
        self.layout = Some(layout);
        // The masters' mappings: what device memory in use grew by while
        // only host memory was pinned or registered. A delta above
        // `mapping_cap` (twice the page tables the device declares for
        // them) is another process's, not ours.
        let host: u64 = self.store.values().map(|m| m.len_bytes()).sum();
        let cap = self.mapping_cap(host);
        self.mapping_bytes = match self.device.memory_info() {
            Ok(after) => {
                let used =
                    |i: &crate::device::MemoryInfo| i.total_bytes.saturating_sub(i.free_bytes);
                let grew = used(&after).saturating_sub(used(&info));
                tracing::info!(
                    grew,
                    host,
                    "planned offload: device memory in use grew by {grew} B from the start of enable to the host masters made ({host} B page-locked); the plan counts {} B of it (at most {cap} B: twice their page tables) as their mappings",
                    grew.min(cap)
                );
                grew.min(cap)
            }
            Err(e) => {
                let _ = self.release_all(None, true);
                return Err(dev_err("memory_info", e));
            }
        };
        // Given inputs planned before the masters existed: plan again if
        // the mappings measured now (and the page tables of the plan's
        // pinned buffers) differ from what they assumed, or if they count
        // less of the allocator's slack than its chunk leaves.
        let mut replanned = false;
        let mapped = self
            .mapping_bytes
            .saturating_add(self.buffer_tables(plan.as_ref().and_then(|p| p.host.as_ref())));
        let least_slack = self.least_slack();
        let (mut choices, mut plan, mut inputs) = match (plan, inputs) {
            (Some(_), Some(mut inp))
                if inp.mapping_bytes != mapped || inp.allocator_slack_bytes < least_slack =>
            {
                replanned = true;
                inp.mapping_bytes = mapped;
                inp.allocator_slack_bytes = inp.allocator_slack_bytes.max(least_slack);
                match budget::plan_within(
                    &model.pipeline,
                    &self.config,
                    &inp,
                    memory,
                    self.host_limits.clone(),
                ) {
                    Ok(p) => {
                        // Its host side may differ from the one the store
                        // was built for: the store follows it (below).
                        self.host_side = p.host.clone();
                        (p.choices(), Some(p), Some(inp))
                    }
                    Err(e) => {
                        let _ = self.release_all(None, true);
                        return Err(OffloadError::Budget(Box::new(e)));
                    }
                }
            }
            (plan, inputs) => (choices, plan, inputs),
        };
        // The store was just built for these choices: only a re-plan
        // moves it (asking again at once for the pins just refused would
        // only be refused again, or take a pin a staged unit gave up).
        if replanned && let (Some(p), Some(i)) = (plan.take(), inputs.take()) {
            match self.settle_store(&model.pipeline, p, i) {
                Ok((p, i)) => {
                    choices = p.choices();
                    plan = Some(p);
                    inputs = Some(i);
                }
                Err(e) => {
                    let _ = self.release_all(None, true);
                    return Err(e);
                }
            }
        }
        let timer = warmup
            .is_some()
            .then(|| Arc::new(Timer::new(Arc::clone(&self.device))));
        if let Err(e) = self.apply(model, &choices, timer) {
            let _ = self.release_all(Some(model), true);
            return Err(e);
        }
        if let Some(plan) = &plan {
            tracing::info!("planned offload: {plan}");
            self.drop_blobs();
        }
        self.plan = plan;
        self.inputs = inputs;
        self.warmup = warmup;
        self.replanned = false;
        self.lifecycle.finish_enable();
        Ok(())
    }

    fn disable(&mut self, model: &mut Model) -> Result<(), OffloadError> {
        if self.lifecycle.begin_disable() == DisableStep::NothingToDo {
            return Ok(());
        }
        let drain = !self.bugs.has(PlantedBug::FreeWithoutDrain);
        let result = self.release_all(Some(model), drain);
        *lock(&self.current) = None;
        self.plan = None;
        self.warmup = None;
        self.check = None;
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

impl<A: Api> Backend<A> for PlannedBackend<A> {
    fn locate(&self, storage: StorageId) -> Option<DeviceLocation<A>> {
        self.ring
            .locate(storage)
            .or_else(|| self.phases.locate(storage))
    }

    fn residency(&self, storage: StorageId) -> Option<Residency> {
        self.ring
            .residency(storage)
            .or_else(|| self.phases.residency(storage))
    }

    fn device_weight_bytes(&self) -> u64 {
        self.phases.device_weight_bytes() + self.ring.device_weight_bytes()
    }

    fn host_weight_bytes(&self) -> u64 {
        self.store.values().map(|m| m.len_bytes()).sum::<u64>()
            + self.ring.host_staging_bytes()
            + self.phases.upload_bytes()
    }

    fn host_masters(&self) -> crate::runtime::backend::HostMasters {
        self.phases.handles.host_masters()
    }

    fn request_plan(&self) -> Option<&RequestPlan> {
        self.plan.as_ref()
    }

    fn planner_inputs(&self) -> Option<&PlannerInputs> {
        self.inputs.as_ref()
    }

    fn needs_warmup(&self) -> bool {
        self.given.is_none()
    }

    fn warmup_shape(&self) -> Option<RequestShape> {
        self.warmup
            .as_ref()
            .or(self.check.as_ref())
            .map(RequestShape::for_warmup)
    }

    fn finish_warmup(&mut self, model: &mut Model, seconds: f64) -> Result<(), OffloadError> {
        if self.warmup.is_none()
            && let Some(shape) = self.check.take()
        {
            return self.finish_check(model, &shape, seconds);
        }
        let (Some(shape), Some(timer)) = (self.warmup.take(), self.timer.clone()) else {
            return Ok(());
        };
        let inputs = self.measurements(model, &timer, &shape.for_warmup(), seconds)?;
        self.replan(model, inputs, Some(shape))
    }

    fn replan_after(
        &mut self,
        model: &mut Model,
        error: &OffloadError,
    ) -> Result<bool, OffloadError> {
        if error.device_error_kind() != Some(DeviceErrorKind::OutOfMemory) || self.plan.is_none() {
            return Ok(false);
        }
        let Some(phase) = lock(&self.current).clone() else {
            return Ok(false);
        };
        let plan = self.plan.as_ref().expect("checked");
        let shortfall = error
            .shortfall_bytes()
            .unwrap_or(plan.budget_bytes / 16)
            .max(1);
        if self.replanned {
            return Err(OffloadError::Budget(Box::new(
                BudgetError::ShortfallAgain {
                    phase,
                    needed_bytes: shortfall,
                    budget: crate::bytes::DeviceBudget::size_of(
                        self.config.device_budget,
                        plan.budget_bytes,
                    ),
                },
            )));
        }
        // What the phase held beside our weights when it ran out: the
        // device was full (its total, less what others held before enable)
        // and still `shortfall` short, so its activations are at least
        // that, whatever the plan assumed.
        let memory = self.memory.expect("enabled");
        let others = memory.total_bytes.saturating_sub(memory.free_bytes);
        let mut inputs = self.inputs.clone().expect("a plan has its inputs");
        // The mappings and the allocator's slack are every phase's already:
        // not the phase's activations (else the re-plan counts them twice).
        let observed = memory
            .total_bytes
            .saturating_add(shortfall)
            .saturating_sub(self.device_weight_bytes())
            .saturating_sub(others)
            .saturating_sub(inputs.mapping_bytes)
            .saturating_sub(inputs.allocator_slack_bytes);
        if let Some(c) = inputs.components.get_mut(&phase) {
            c.activation_bytes = c.activation_bytes.saturating_add(shortfall).max(observed);
        }
        tracing::warn!(
            "planned offload: a request ran out of device memory in the `{phase}` phase ({shortfall} bytes short); planning again with {shortfall} more bytes of activations there"
        );
        self.replanned = true;
        // A check request that ran out of memory runs again under the
        // plan made with the shortfall (if that one still streams coded).
        let check = self.check.take();
        self.replan(model, inputs, check)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs whose one component's blocks `a` and `b` computed 1 ms each
    /// in the warm-up.
    fn inputs() -> PlannerInputs {
        let mut c = crate::measurements::ComponentInputs {
            forwards: 1.0,
            ..Default::default()
        };
        c.block_compute_s.insert("a".into(), 1e-3);
        c.block_compute_s.insert("b".into(), 1e-3);
        let mut i = PlannerInputs::new(1e9, 1);
        i.components.insert("dit".into(), c);
        i
    }

    fn block(p: &str, s: u64, e: u64) -> [(Mark, u64); 2] {
        [
            (Mark::BlockStart(p.into()), s),
            (Mark::BlockEnd(p.into()), e),
        ]
    }

    fn decode(s: u64, e: u64) -> [(Mark, u64); 2] {
        [(Mark::DecodeStart, s), (Mark::DecodeEnd, e)]
    }

    /// A 0.2 ms decode beside each of two 1 ms blocks that ran 0.36 ms
    /// longer: 1.8. Blocks without a warm-up figure, or beside no decode,
    /// count nothing.
    #[test]
    fn the_interference_is_the_kernels_extra_time_over_the_decodes_beside_them() {
        let mut marks = Vec::new();
        marks.extend(decode(100_000, 300_000));
        marks.extend(block("a", 0, 1_360_000));
        marks.extend(decode(1_500_000, 1_700_000));
        marks.extend(block("b", 1_400_000, 2_760_000));
        // Beside no decode: not counted, however long.
        marks.extend(block("a", 3_000_000, 9_000_000));
        // No warm-up figure: not counted.
        marks.extend(decode(10_100_000, 10_300_000));
        marks.extend(block("c", 10_000_000, 12_000_000));
        let m = decode_interference_of(&marks, &inputs()).expect("measured");
        assert_eq!(m.decodes, 3);
        assert!((m.overlap_s - 0.4e-3).abs() < 1e-12, "{m:?}");
        assert!((m.interference() - 1.8).abs() < 1e-9, "{m:?}");
    }

    /// Decodes that ran while compute waited (the link binds) say nothing
    /// of what they cost it: no figure where less than a quarter of their
    /// time ran beside the kernels. The tail a decode stretched a kernel by
    /// is not counted as more overlap. A figure at or below 0 or beyond
    /// the planner's range is noise: no figure.
    #[test]
    fn decodes_beside_little_compute_measure_nothing() {
        let mut marks = Vec::new();
        marks.extend(decode(0, 1_000_000));
        marks.extend(block("a", 900_000, 1_900_000));
        assert_eq!(decode_interference_of(&marks, &inputs()), None);
        // Within the kernels' own millisecond only: 0.2 ms beside them.
        let mut marks = Vec::new();
        marks.extend(block("a", 0, 1_400_000));
        marks.extend(decode(800_000, 1_400_000));
        let m = decode_interference_of(&marks, &inputs()).expect("measured");
        assert!((m.overlap_s - 0.2e-3).abs() < 1e-12, "{m:?}");
        assert!((m.interference() - 2.0).abs() < 1e-9, "{m:?}");
        for end in [20_000_000, 1_000_000, 900_000] {
            let mut marks = Vec::new();
            marks.extend(block("a", 0, end));
            marks.extend(decode(0, 100_000));
            assert_eq!(decode_interference_of(&marks, &inputs()), None, "{end}");
        }
    }
}
