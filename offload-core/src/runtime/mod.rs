//! Running a pipeline: the [`Model`] (description + hooks), the weight
//! source, the [`Backend`]s that place weights on a device, and the forward
//! API ([`Runtime::forward`], [`Scope`], [`View`]) through which a runtime
//! author's kernels read weights.
//!
//! A forward scope runs the module's hooks (pre-forward: bring weights in,
//! make the compute stream wait), lends device views of the module's
//! tensors with the stream to launch on, and runs the post-forward hooks
//! (record the last use) when the closure returns. Views borrow the scope,
//! so keeping one past its scope does not compile. Using it inside does:
//!
//! ```
//! # fn ok<A: offload_core::device::Api>(rt: &offload_core::runtime::Runtime<A>) {
//! let range = rt.forward("transformer.blocks.0", |scope| Ok(scope.view("w")?.byte_range())).unwrap();
//! # }
//! ```
//!
//! ```compile_fail
//! # fn leak<A: offload_core::device::Api>(rt: &offload_core::runtime::Runtime<A>) {
//! let kept = rt.forward("transformer.blocks.0", |scope| Ok(scope.view("w")?)).unwrap();
//! # }
//! ```

mod bounds;
mod layerwise;
mod layout;
mod model_level;
mod platform;
mod resident;
mod ring;
mod shared;
mod slots;

use crate::sync::Arc;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;

use offload_hooks::{BoxError, Forwarded, HookRegistry};

use crate::device::Api;
use crate::lifecycle::{LifecycleState, OffloadBackend, OffloadError};
use crate::model::{ModuleId, Pipeline, StorageId, Tensor, TensorId};
use crate::residency::Residency;

pub use bounds::{MemoryBounds, memory_bounds, offloaded_storages};
pub use layerwise::{DistributedLayerwiseBackend, LayerwiseBackend};
pub use layout::{Entry, Partition, Unit, partition};
pub use model_level::ModelLevelBackend;
pub use platform::CorePlatform;
pub use resident::ResidentBackend;

/// Bugs a test can plant in a backend (with the `planted-bugs` feature) to
/// see that the invariant checkers catch them. Never set otherwise: the
/// switches are read only where the feature is compiled in
/// ([`CorePlatform::with_planted_bugs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum PlantedBug {
    /// INV-3 (layerwise): no fill's copy waits for its slot's last use.
    SkipLastUseWait,
    /// INV-3 (layerwise): compute does not wait for a slot's ready event.
    SkipReadyWait,
    /// INV-3 (layerwise): disable frees slots and masters without draining.
    FreeWithoutDrain,
    /// INV-8 (layerwise): views point into the wrong slot.
    WrongSlot,
    /// INV-7 (layerwise): one slot more than depth + 1.
    ExtraSlot,
    /// INV-2 (layerwise): a second pinned host copy of every block.
    SecondHostCopy,
    /// INV-7 (layerwise): host masters leak at disable.
    LeakHostMasters,
    /// INV-5 (layerwise): a failed enable leaves its hooks installed.
    NoRollback,
    /// INV-1 (layerwise): enable does not check for another strategy's hooks.
    IgnoreOtherOwner,
    /// INV-4 (layerwise): non-persistent buffers are not loaded.
    SkipNonPersistent,
    /// INV-3 (layerwise): a block's last use is recorded in its pre-forward,
    /// before its kernels, so the next fill of its slot does not wait for them.
    LastUseBeforeCompute,
    /// INV-3 (layerwise): the slot is chosen statically (block index modulo
    /// the slot count) instead of the least recently filled free slot; an
    /// odd ring wraps onto the slot compute is reading.
    StaticSlot,
    /// INV-3 (layerwise): the on-demand refill (a skipped predecessor) does
    /// not wait for the victim slot's last use.
    OnDemandSkipLastUseWait,
    /// INV-3 (layerwise): the wrap-around prefetch (the last block fetching
    /// block 0) does not wait for the victim slot's last use.
    WrapAroundSkipLastUseWait,
    /// INV-8 (layerwise): a fill copies the next block's host master.
    WrongMaster,
    /// INV-8 (layerwise): a prefetch stamps its slot and records ready
    /// without copying, so the slot keeps the bytes of what it held before.
    StaleSlot,
    /// INV-8 (layerwise): slot stamps ignore the ring, so a block of a
    /// second ring reads the slot of the first ring's block with its index.
    IgnoreRingStamp,
    /// INV-4 (layerwise): the second storage of each streamed block is
    /// placed two bytes off, overlapping its neighbour.
    ShiftedPlacement,
    /// INV-3 (model level): eviction frees after the bring-in's ready event
    /// only, not after the component's last use.
    EvictWithoutLastUse,
    /// INV-3 (model level): compute does not wait for a bring-in.
    BringInWithoutReady,
    /// INV-7 (model level): a component is brought in before the others
    /// are evicted.
    BringInBeforeEvict,
    /// INV-3 (model level): a failed bring-in frees what it allocated
    /// without waiting for the copies already enqueued.
    FailedBringInFreeWithoutWait,
    /// INV-3 (every strategy): dropping an enabled backend frees without
    /// draining.
    DropWithoutDrain,
    /// INV-9 (distributed layerwise): ranks of odd index issue the
    /// prefetches of one pre-forward farthest first, so their collectives
    /// run in another order than the even ranks'.
    DivergentCollectiveOrder,
    /// INV-9/INV-8 (distributed layerwise): the all-gather writes the whole
    /// slot (G × the largest shard) instead of the slot narrowed to this
    /// block's G·s bytes.
    WholeSlotGather,
    /// INV-3 (distributed layerwise): a shard copy does not wait for the
    /// gather that last read its shard buffer.
    ShardReuseBeforeGather,
    /// INV-9 (distributed layerwise): `enable` fills block 0 of its first
    /// ring (as layerwise does) instead of deferring every ring's first fill
    /// to its first forward; a rank whose first ring gathers then issues a
    /// collective at enable that a rank whose first ring is rank-local (an
    /// encoder only it runs) does not.
    EagerFirstFill,
}

impl PlantedBug {
    /// Every planted bug.
    pub const ALL: [PlantedBug; 27] = [
        PlantedBug::SkipLastUseWait,
        PlantedBug::SkipReadyWait,
        PlantedBug::FreeWithoutDrain,
        PlantedBug::WrongSlot,
        PlantedBug::ExtraSlot,
        PlantedBug::SecondHostCopy,
        PlantedBug::LeakHostMasters,
        PlantedBug::NoRollback,
        PlantedBug::IgnoreOtherOwner,
        PlantedBug::SkipNonPersistent,
        PlantedBug::LastUseBeforeCompute,
        PlantedBug::StaticSlot,
        PlantedBug::OnDemandSkipLastUseWait,
        PlantedBug::WrapAroundSkipLastUseWait,
        PlantedBug::WrongMaster,
        PlantedBug::StaleSlot,
        PlantedBug::IgnoreRingStamp,
        PlantedBug::ShiftedPlacement,
        PlantedBug::EvictWithoutLastUse,
        PlantedBug::BringInWithoutReady,
        PlantedBug::BringInBeforeEvict,
        PlantedBug::FailedBringInFreeWithoutWait,
        PlantedBug::DropWithoutDrain,
        PlantedBug::DivergentCollectiveOrder,
        PlantedBug::WholeSlotGather,
        PlantedBug::ShardReuseBeforeGather,
        PlantedBug::EagerFirstFill,
    ];

    /// The bug's name on command lines (`skip-last-use-wait`).
    pub fn name(self) -> String {
        let mut out = String::new();
        for (i, c) in format!("{self:?}").chars().enumerate() {
            if c.is_ascii_uppercase() {
                if i > 0 {
                    out.push('-');
                }
                out.push(c.to_ascii_lowercase());
            } else {
                out.push(c);
            }
        }
        out
    }

    /// The bug called `name` (as [`Self::name`] spells it).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.name() == name)
    }
}

/// The planted bugs a backend carries: empty unless the `planted-bugs`
/// feature is compiled in and a test asked for some.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Bugs(Vec<PlantedBug>);

impl Bugs {
    pub(crate) fn new(bugs: &[PlantedBug]) -> Self {
        Self(if cfg!(feature = "planted-bugs") {
            bugs.to_vec()
        } else {
            Vec::new()
        })
    }

    /// Whether `bug` is planted.
    pub(crate) fn has(&self, bug: PlantedBug) -> bool {
        cfg!(feature = "planted-bugs") && self.0.contains(&bug)
    }
}

/// What every hook of a forward sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardCtx {
    /// The module whose forward runs.
    pub module: ModuleId,
}

/// The hooks of every module.
pub type HookMap = BTreeMap<ModuleId, RefCell<HookRegistry<ForwardCtx>>>;

/// A pipeline being run: its description and the hooks installed on its
/// modules. Backends install and remove their hooks here.
pub struct Model {
    /// The description.
    pub pipeline: Pipeline,
    /// Hooks per module.
    pub hooks: HookMap,
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Model")
            .field("pipeline", &self.pipeline.type_name())
            .field("hooks", &self.hook_claims())
            .finish()
    }
}

impl Model {
    /// A model with no hooks.
    pub fn new(pipeline: Pipeline) -> Self {
        Self {
            pipeline,
            hooks: BTreeMap::new(),
        }
    }

    /// Every installed hook as (module path, hook name, owner), sorted: the
    /// observable hook state (INV-1, INV-5).
    pub fn hook_claims(&self) -> Vec<(String, String, String)> {
        let mut out = Vec::new();
        for (module, registry) in &self.hooks {
            let path = self.pipeline.module(*module).path.clone();
            for (name, owner) in registry.borrow().owners() {
                out.push((path.clone(), name.to_owned(), owner.as_str().to_owned()));
            }
        }
        out
    }

    /// The registry of `module`, created empty if needed.
    pub fn hooks_of(&mut self, module: ModuleId) -> &mut HookRegistry<ForwardCtx> {
        self.hooks.entry(module).or_default().get_mut()
    }
}

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

/// A pipeline on one device, with at most one backend enabled.
pub struct Runtime<A: Api> {
    device: Arc<A::Device>,
    compute: Arc<A::Stream>,
    model: Model,
    backend: Option<Box<dyn Backend<A>>>,
}

impl<A: Api> Runtime<A> {
    /// A runtime for `pipeline` on `device`, launching on `compute`.
    pub fn new(device: Arc<A::Device>, compute: Arc<A::Stream>, pipeline: Pipeline) -> Self {
        Self {
            device,
            compute,
            model: Model::new(pipeline),
            backend: None,
        }
    }

    /// The device.
    pub fn device(&self) -> &Arc<A::Device> {
        &self.device
    }

    /// The compute stream.
    pub fn compute_stream(&self) -> &Arc<A::Stream> {
        &self.compute
    }

    /// The model (description and hooks).
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The model, to install hooks of one's own (a block cache, a timer).
    pub fn model_mut(&mut self) -> &mut Model {
        &mut self.model
    }

    /// The enabled backend.
    pub fn backend(&self) -> Option<&dyn Backend<A>> {
        self.backend.as_deref()
    }

    /// Enables `backend`. On failure the backend is returned with the error
    /// and the model is as it was.
    pub fn enable(
        &mut self,
        mut backend: Box<dyn Backend<A>>,
    ) -> Result<(), (OffloadError, Box<dyn Backend<A>>)> {
        if let Some(current) = &self.backend {
            let err = OffloadError::Forward {
                module: String::new(),
                reason: format!(
                    "a {} backend is already enabled; disable it first (one strategy per pipeline)",
                    current.strategy()
                ),
            };
            return Err((err, backend));
        }
        match backend.enable(&mut self.model) {
            Ok(()) => {
                self.backend = Some(backend);
                Ok(())
            }
            Err(e) => Err((e, backend)),
        }
    }

    /// Enables the backend `config` selects on `platform`, or the resident
    /// backend where it selects no offload ([`CorePlatform::backend_for`]):
    /// after it, forwards run whatever the configuration says. On failure
    /// the model is as it was and the backend is dropped (use
    /// [`Self::enable`] to keep it, e.g. to ask a poisoned one its state).
    pub fn enable_selected(
        &mut self,
        config: &crate::config::OffloadConfig,
        platform: &CorePlatform<A>,
    ) -> Result<(), OffloadError> {
        let backend = platform.backend_for(config)?;
        self.enable(backend).map_err(|(e, _)| e)
    }

    /// Disables and returns the backend (every step runs; the first error is
    /// returned, and the backend dropped).
    pub fn disable(&mut self) -> Result<Option<Box<dyn Backend<A>>>, OffloadError> {
        match self.disable_backend() {
            None => Ok(None),
            Some((b, result)) => result.map(|()| Some(b)),
        }
    }

    /// Disables the backend, if any, and returns it with the outcome, so a
    /// caller can still ask a backend whose `disable` failed for its state
    /// (poisoned?).
    pub fn disable_backend(&mut self) -> Option<Disabled<A>> {
        let mut b = self.backend.take()?;
        let result = b.disable(&mut self.model);
        Some((b, result))
    }

    /// Tells the backend this rank failed outside its hooks (see
    /// [`OffloadBackend::poison`]): call it before `disable` when a request
    /// failed on a rank of a gather group.
    pub fn poison(&mut self, reason: &str) {
        if let Some(b) = self.backend.as_mut() {
            b.poison(reason);
        }
    }

    /// The lifecycle state of the backend, if any.
    pub fn state(&self) -> Option<LifecycleState> {
        self.backend.as_ref().map(|b| b.state())
    }

    /// Runs one forward of the module at `path`: its hooks, then `f` with a
    /// scope lending device views of its tensors. Returns `None` when a hook
    /// skipped the forward.
    pub fn forward<R>(
        &self,
        path: &str,
        f: impl FnOnce(&Scope<'_, A>) -> Result<R, BoxError>,
    ) -> Result<Option<R>, OffloadError> {
        let module = self
            .model
            .pipeline
            .module_id(path)
            .ok_or_else(|| OffloadError::Forward {
                module: path.to_owned(),
                reason: "no such module".to_owned(),
            })?;
        self.dispatch(module, f)
    }

    fn dispatch<R>(
        &self,
        module: ModuleId,
        f: impl FnOnce(&Scope<'_, A>) -> Result<R, BoxError>,
    ) -> Result<Option<R>, OffloadError> {
        let scope = Scope {
            rt: self,
            module,
            _not_send: PhantomData,
        };
        let Some(cell) = self.model.hooks.get(&module) else {
            return f(&scope).map(Some).map_err(|e| scope.failed(e));
        };
        let mut registry = cell.try_borrow_mut().map_err(|_| OffloadError::Forward {
            module: scope.path().to_owned(),
            reason: "forward re-entered while its own forward runs".to_owned(),
        })?;
        let mut out = None;
        let mut ctx = ForwardCtx { module };
        let forwarded = registry.dispatch(&mut ctx, |_| {
            out = Some(f(&scope)?);
            Ok(())
        })?;
        match forwarded {
            Forwarded::Ran => Ok(out),
            Forwarded::Skipped { .. } | Forwarded::Failed => Ok(None),
        }
    }
}

impl<A: Api> Drop for Runtime<A> {
    /// Dropping a runtime with a backend enabled (a `?` past it, a panic
    /// unwinding through a forward) drops the backend first, whose own
    /// `Drop` drains its streams before any memory they may touch is freed
    /// (memory the device may still touch after a failed drain is leaked,
    /// never freed); the hooks go with the model.
    fn drop(&mut self) {
        drop(self.backend.take());
    }
}

/// One module's forward: the stream to launch on and device views of the
/// module's tensors, lent until the closure returns.
pub struct Scope<'rt, A: Api> {
    rt: &'rt Runtime<A>,
    module: ModuleId,
    _not_send: PhantomData<*const ()>,
}

impl<'rt, A: Api> Scope<'rt, A> {
    /// The module's path.
    pub fn path(&self) -> &str {
        &self.rt.model.pipeline.module(self.module).path
    }

    /// The module.
    pub fn module(&self) -> ModuleId {
        self.module
    }

    /// The pipeline.
    pub fn pipeline(&self) -> &Pipeline {
        &self.rt.model.pipeline
    }

    /// The device.
    pub fn device(&self) -> &A::Device {
        &self.rt.device
    }

    /// The stream to launch kernels on.
    pub fn stream(&self) -> &A::Stream {
        &self.rt.compute
    }

    /// The error a forward closure returned, naming this module once: an
    /// error of a forward scope (this one's, or a child's, whose path
    /// contains this one's) already names its module and passes as it is.
    fn failed(&self, e: BoxError) -> OffloadError {
        match e.downcast::<OffloadError>() {
            Ok(inner) => match *inner {
                named @ OffloadError::Forward { .. } => named,
                other => OffloadError::Forward {
                    module: self.path().to_owned(),
                    reason: other.to_string(),
                },
            },
            Err(e) => OffloadError::Forward {
                module: self.path().to_owned(),
                reason: e.to_string(),
            },
        }
    }

    /// A view of the tensor at `name`, relative to this module (dotted).
    pub fn view(&self, name: &str) -> Result<View<'_, A>, OffloadError> {
        let p = &self.rt.model.pipeline;
        let full = crate::model::join(self.path(), name);
        let id = p
            .tensors()
            .find(|(id, _)| p.tensor_path(*id) == full)
            .map(|(id, _)| id)
            .ok_or_else(|| OffloadError::Forward {
                module: self.path().to_owned(),
                reason: format!("no tensor `{name}`"),
            })?;
        self.view_of(id)
    }

    /// Views of every tensor of this module's subtree, in declaration order.
    pub fn views(&self) -> Result<Vec<View<'_, A>>, OffloadError> {
        self.rt
            .model
            .pipeline
            .subtree_tensors(self.module)
            .into_iter()
            .map(|t| self.view_of(t))
            .collect()
    }

    /// A view of the tensor `id` (anywhere in the pipeline, if resident).
    pub fn view_id(&self, id: TensorId) -> Result<View<'_, A>, OffloadError> {
        self.view_of(id)
    }

    fn view_of(&self, id: TensorId) -> Result<View<'_, A>, OffloadError> {
        let p = &self.rt.model.pipeline;
        let tensor = p.tensor(id);
        let not_resident = |why: String| OffloadError::Forward {
            module: self.path().to_owned(),
            reason: format!("tensor `{}` is not on the device: {why}", p.tensor_path(id)),
        };
        let backend = self.rt.backend.as_ref().ok_or_else(|| {
            not_resident(
                "no backend is enabled; enable one before the first forward: \
                     `Runtime::enable_selected(&config, &platform)` enables the backend the \
                     configuration selects, or the resident one when it selects no offload"
                    .to_owned(),
            )
        })?;
        let loc = backend.locate(tensor.storage).ok_or_else(|| {
            not_resident(match backend.residency(tensor.storage) {
                Some(r) => format!("its storage is {r:?}"),
                None => "its storage is not managed".to_owned(),
            })
        })?;
        let span = tensor.span_bytes();
        Ok(View {
            buffer: loc.buffer,
            range: loc.offset + span.start..loc.offset + span.end,
            tensor,
            _scope: PhantomData,
        })
    }

    /// Runs the forward of the child at `name` (dotted, relative) inside this
    /// one: its hooks, then `f` with its scope.
    pub fn child<R>(
        &self,
        name: &str,
        f: impl FnOnce(&Scope<'_, A>) -> Result<R, BoxError>,
    ) -> Result<Option<R>, OffloadError> {
        let full = crate::model::join(self.path(), name);
        self.rt.forward(&full, f)
    }
}

/// A device view of one tensor, lent by a [`Scope`].
pub struct View<'s, A: Api> {
    buffer: Arc<A::DeviceBuffer>,
    range: Range<u64>,
    tensor: &'s Tensor,
    _scope: PhantomData<&'s ()>,
}

impl<A: Api> View<'_, A> {
    /// The device buffer holding the tensor.
    pub fn buffer(&self) -> &A::DeviceBuffer {
        &self.buffer
    }

    /// The bytes of the buffer the tensor's view touches.
    pub fn byte_range(&self) -> Range<u64> {
        self.range.clone()
    }

    /// The tensor's description (dtype, shape, strides).
    pub fn tensor(&self) -> &Tensor {
        self.tensor
    }
}

impl<A: Api> fmt::Debug for View<'_, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("View")
            .field("tensor", &self.tensor.name)
            .field("range", &self.range)
            .finish()
    }
}
