//! The forward API: the [`Runtime`] (a pipeline on one device with at
//! most one backend), the forward [`Scope`] and the borrow-checked
//! [`View`]s it lends.

use crate::sync::Arc;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;

use offload_hooks::{BoxError, Forwarded, HookError, Phase};

use crate::budget::RequestPlan;
use crate::device::Api;
use crate::lifecycle::{LifecycleState, OffloadError};
use crate::measurements::PlannerInputs;
use crate::model::{ModuleId, Pipeline, Tensor, TensorId};
use crate::request::RequestShape;
use crate::runtime::backend::{Backend, Disabled};
use crate::runtime::hooks::{ForwardCtx, Model};
use crate::runtime::platform::CorePlatform;

/// The most requests `enable` runs to measure the device: the warm-up, the
/// check request where its plan streams coded blocks (CONTRACT §9), and
/// the check once more where the first ran out of memory and the plan was
/// made again with the shortfall.
const MEASURING_REQUESTS: usize = 3;

/// The runtime's own request, as a warm-up runs it: the forwards of every
/// component for a request of the given shape (CONTRACT §9).
pub type RequestFn<A> = dyn Fn(&Runtime<A>, &RequestShape) -> Result<(), BoxError> + Send + Sync;

/// A pipeline on one device, with at most one backend enabled.
pub struct Runtime<A: Api> {
    device: Arc<A::Device>,
    compute: Arc<A::Stream>,
    model: Model,
    backend: Option<Box<dyn Backend<A>>>,
    request: Option<Arc<RequestFn<A>>>,
}

impl<A: Api> Runtime<A> {
    /// A runtime for `pipeline` on `device`, launching on `compute`.
    pub fn new(device: Arc<A::Device>, compute: Arc<A::Stream>, pipeline: Pipeline) -> Self {
        Self {
            device,
            compute,
            model: Model::new(pipeline),
            backend: None,
            request: None,
        }
    }

    /// The runtime's request (its forwards of every component for a
    /// request of a given shape): what a planned backend's warm-up runs
    /// once at enable to measure this device (CONTRACT §9), and what
    /// [`Self::serve`] runs.
    pub fn set_request(
        &mut self,
        request: impl Fn(&Runtime<A>, &RequestShape) -> Result<(), BoxError> + Send + Sync + 'static,
    ) {
        self.request = Some(Arc::new(request));
    }

    /// The request plan in force (a `device_budget` configuration).
    pub fn request_plan(&self) -> Option<&RequestPlan> {
        self.backend.as_deref().and_then(|b| b.request_plan())
    }

    /// What the plan in force was made from: the warm-up's measurements
    /// (save them with [`PlannerInputs::to_json`] and give them back with
    /// `CorePlatform::with_planner` to skip the next warm-up), reloaded
    /// ones, or a caller's.
    pub fn planner_inputs(&self) -> Option<&PlannerInputs> {
        self.backend.as_deref().and_then(|b| b.planner_inputs())
    }

    /// Runs the runtime's request ([`Self::set_request`]) for `shape`. If it
    /// runs out of device memory under a planned backend, the backend plans
    /// again once with the shortfall and the request runs again; a second
    /// shortfall is an error naming what was needed.
    pub fn serve(&mut self, shape: &RequestShape) -> Result<(), OffloadError> {
        let request = self.request.clone().ok_or_else(|| OffloadError::Request {
            reason: "there is no request to serve: register the runtime's request with `Runtime::set_request`"
                .to_owned(),
        })?;
        loop {
            let error = match request(self, shape) {
                Ok(()) => return Ok(()),
                Err(e) => request_error(e),
            };
            if !self.replan_after(&error)? {
                return Err(error);
            }
        }
    }

    /// After a request failed with `error`: a planned backend whose first
    /// request ran out of memory plans again once with the shortfall and
    /// returns `true` (run the request again); `false` otherwise; an error
    /// naming what was needed after a second shortfall.
    pub fn replan_after(&mut self, error: &OffloadError) -> Result<bool, OffloadError> {
        match self.backend.as_mut() {
            Some(backend) => backend.replan_after(&mut self.model, error),
            None => Ok(false),
        }
    }

    /// The host masters the enabled backend holds: how many units (and
    /// bytes) are registered in place and how many were copied into pinned
    /// memory (zero with no backend). A checkpoint whose blocks each lie
    /// back to back in one file streams with no copy.
    pub fn host_masters(&self) -> crate::runtime::backend::HostMasters {
        self.backend
            .as_deref()
            .map(|b| b.host_masters())
            .unwrap_or_default()
    }

    /// The device.
    pub fn device(&self) -> &Arc<A::Device> {
        &self.device
    }

    /// The compute stream.
    pub fn compute_stream(&self) -> &Arc<A::Stream> {
        &self.compute
    }

    /// The pipeline's description (the same as `scope.pipeline()`).
    pub fn pipeline(&self) -> &Pipeline {
        &self.model.pipeline
    }

    /// Waits on the host until everything launched on the compute stream
    /// has run (a runtime reading its output back, a benchmark's timer);
    /// never needed for offload's own ordering.
    pub fn synchronize(&self) -> Result<(), OffloadError> {
        use crate::device::Device;
        self.device
            .synchronize_stream(&self.compute)
            .map_err(|e| OffloadError::device("synchronize_stream(compute)", e))
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
            let err = OffloadError::AlreadyEnabled {
                enabled: current.strategy(),
                requested: backend.strategy(),
            };
            return Err((err, backend));
        }
        let request = self.request.clone();
        if backend.needs_warmup() && request.is_none() {
            let err = OffloadError::Budget(Box::new(crate::budget::BudgetError::NoPlannerInputs {
                budget: crate::bytes::DeviceBudget::Auto,
            }));
            return Err((err, backend));
        }
        if let Err(e) = backend.enable(&mut self.model) {
            return Err((e, backend));
        }
        self.backend = Some(backend);
        // A planned backend with nothing given to plan from measures this
        // device: the runtime's request runs once, then the plan is made;
        // where that plan streams coded blocks, once more under it (the
        // check request, which measures what its decodes cost compute),
        // then the plan is made again.
        let mut round = 0;
        while let Some(shape) = self.backend.as_ref().and_then(|b| b.warmup_shape()) {
            round += 1;
            let finished = if round > MEASURING_REQUESTS {
                Err(OffloadError::Request {
                    reason: format!(
                        "the backend asked for a {round}th measuring request at enable ({shape}); at most {MEASURING_REQUESTS} run (the warm-up, the check, the check after a shortfall)"
                    ),
                })
            } else {
                self.measure_once(request.as_ref().expect("checked above"), &shape, round > 1)
            };
            if let Err(e) = finished {
                let mut backend = self.backend.take().expect("enabled above");
                let _ = backend.disable(&mut self.model);
                return Err((e, backend));
            }
        }
        self.log_masters();
        Ok(())
    }

    /// Runs one measuring request of `shape` at enable (the warm-up, or
    /// the check where `check`) and hands the backend its host time. A
    /// check request that runs out of device memory is the plan's first
    /// request: the backend plans again with the shortfall and the check
    /// runs again (the enable loop asks for it).
    fn measure_once(
        &mut self,
        request: &Arc<RequestFn<A>>,
        shape: &RequestShape,
        check: bool,
    ) -> Result<(), OffloadError> {
        let what = if check { "check" } else { "warm-up" };
        let began = std::time::Instant::now();
        match request(self, shape) {
            Ok(()) => {
                let seconds = began.elapsed().as_secs_f64();
                let backend = self.backend.as_mut().expect("enabled");
                backend.finish_warmup(&mut self.model, seconds)
            }
            Err(e) => {
                let error = request_error(e);
                if check && self.replan_after(&error)? {
                    return Ok(());
                }
                Err(OffloadError::Request {
                    reason: format!("the {what} request ({shape}) failed: {error}"),
                })
            }
        }
    }

    /// What `enable` made of the host masters, at `info`.
    fn log_masters(&self) {
        let m = self.host_masters();
        if m.in_place_units + m.copied_units > 0 {
            tracing::info!(
                in_place_units = m.in_place_units,
                in_place_bytes = m.in_place_bytes,
                copied_units = m.copied_units,
                copied_bytes = m.copied_bytes,
                "host masters: {} unit(s) registered in place ({}), {} copied into pinned memory ({})",
                m.in_place_units,
                crate::bytes::ByteSize::new(m.in_place_bytes),
                m.copied_units,
                crate::bytes::ByteSize::new(m.copied_bytes),
            );
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
    /// [`OffloadBackend::poison`](crate::lifecycle::OffloadBackend::poison)): call it before `disable` when a request
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
            .ok_or_else(|| no_module(&self.model.pipeline, path))?;
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
        let forwarded = registry
            .dispatch(&mut ctx, |_| {
                out = Some(f(&scope)?);
                Ok(())
            })
            .map_err(|e| match e {
                // The module's own forward (the closure): its error, named
                // once, as without hooks.
                HookError::Failed {
                    name,
                    phase: Phase::Forward,
                    source,
                } if name == offload_hooks::MODULE_FORWARD => scope.failed(source),
                hook => OffloadError::HookFailed {
                    module: scope.path().to_owned(),
                    error: Box::new(hook),
                },
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

    /// Waits on the host for the compute stream ([`Runtime::synchronize`]),
    /// with no trait to import.
    pub fn synchronize(&self) -> Result<(), OffloadError> {
        self.rt.synchronize()
    }

    /// The error a forward closure returned, naming this module once: an
    /// error of a forward scope (this one's, or a child's, whose path
    /// contains this one's) already names its module and passes as it is.
    fn failed(&self, e: BoxError) -> OffloadError {
        match e.downcast::<OffloadError>() {
            Ok(inner) => match *inner {
                named @ (OffloadError::Forward { .. } | OffloadError::HookFailed { .. }) => named,
                // A device operation keeps its kind and shortfall (a
                // caller tells "out of memory" from a bug, and a planned
                // backend re-plans by it), named within this forward.
                OffloadError::DeviceOp {
                    operation,
                    kind,
                    shortfall_bytes,
                    cause,
                } if !operation.starts_with("forward of `") => OffloadError::DeviceOp {
                    operation: format!("forward of `{}`: {operation}", self.path()),
                    kind,
                    shortfall_bytes,
                    cause,
                },
                op @ OffloadError::DeviceOp { .. } => op,
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

    /// A view of the tensor at `name`, relative to this module (dotted): a
    /// lookup of its module and then of its name, no scan of the pipeline.
    pub fn view(&self, name: &str) -> Result<View<'_, A>, OffloadError> {
        let p = &self.rt.model.pipeline;
        let id = p
            .tensor_in(self.module, name)
            .ok_or_else(|| self.no_tensor(name))?;
        self.view_of(id)
    }

    /// The relative paths of the blocks of the module list `container`
    /// (relative to this module), in order: `container.0`, `container.1`, …
    /// to run each with [`Self::child`] without writing their count.
    pub fn blocks(&self, container: &str) -> Result<Vec<&'rt str>, OffloadError> {
        let p: &'rt Pipeline = &self.rt.model.pipeline;
        let list = p
            .module_id(&crate::model::join(self.path(), container))
            .ok_or_else(|| self.no_child(container))?;
        let module = p.module(list);
        if module.kind != crate::model::ModuleKind::List {
            return Err(OffloadError::Forward {
                module: self.path().to_owned(),
                reason: format!(
                    "`{container}` is not a module list: blocks are the entries of a list"
                ),
            });
        }
        Ok(module
            .children
            .iter()
            .filter_map(|c| p.relative_path(*c, self.module))
            .collect())
    }

    /// The relative paths of every block of this module's block
    /// containers, in forward order, as resolution reads them (the offload
    /// plan's, else [`crate::model::ModuleBuilder::block_containers`]);
    /// an error naming that call if it declares none.
    pub fn block_stack(&self) -> Result<Vec<&'rt str>, OffloadError> {
        let containers = crate::plan::block_containers_of(self.pipeline(), self.module)
            .ok_or_else(|| OffloadError::Forward {
                module: self.path().to_owned(),
                reason: "it declares no block containers: name them with `block_containers(&[…])` on its module builder (or in the offload plan)".to_owned(),
            })?;
        let mut out = Vec::new();
        for container in &containers {
            out.extend(self.blocks(container)?);
        }
        Ok(out)
    }

    /// The error for a tensor name this module does not hold: the nearest
    /// names it does hold (its own and its subtree's, relative).
    fn no_tensor(&self, name: &str) -> OffloadError {
        let p = &self.rt.model.pipeline;
        let mut held: Vec<String> = p
            .subtree_tensors(self.module)
            .into_iter()
            .map(|t| {
                let t = p.tensor(t);
                let at = p.relative_path(t.module, self.module).unwrap_or_default();
                crate::model::join(at, &t.name)
            })
            .collect();
        held.sort();
        let hint = crate::suggest::did_you_mean(name, held.iter().map(String::as_str));
        let own = crate::suggest::listed(
            p.module(self.module)
                .tensors
                .iter()
                .map(|t| p.tensor(*t).name.as_str()),
            8,
        );
        let children = crate::suggest::listed(
            p.module(self.module)
                .children
                .iter()
                .map(|c| p.module(*c).name.as_str()),
            8,
        );
        OffloadError::Forward {
            module: self.path().to_owned(),
            reason: format!(
                "no tensor `{name}`{hint} (its own tensors: {own}; its children: {children})"
            ),
        }
    }

    fn no_child(&self, name: &str) -> OffloadError {
        no_module(
            &self.rt.model.pipeline,
            &crate::model::join(self.path(), name),
        )
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
            let state = match backend.residency(tensor.storage) {
                Some(r) => format!("its storage is {r:?}"),
                None => "its storage is not managed".to_owned(),
            };
            not_resident(match self.block_holding(tensor.module) {
                Some((block, Some(rel))) => format!(
                    "{state}: it belongs to the block `{block}`, whose weights are on the device only inside its own forward; read it inside `child(\"{rel}\", …)`"
                ),
                Some((block, None)) => format!(
                    "{state}: it belongs to the block `{block}`, whose weights are on the device only inside its own forward; read it inside `Runtime::forward(\"{block}\", …)`"
                ),
                None => format!(
                    "{state}: read it inside the forward of the module that holds it (`{}`)",
                    p.module(tensor.module).path
                ),
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

    /// The block holding `module` (an entry of a block container of one
    /// of its ancestors, as resolution reads them), with its path relative
    /// to this scope's module when it lies below it.
    fn block_holding(&self, module: ModuleId) -> Option<(&str, Option<&str>)> {
        let p = &self.rt.model.pipeline;
        let mut chain = vec![module];
        let mut cur = p.module(module).parent;
        while let Some(m) = cur {
            // `m` owns block containers: is the chain below one of them?
            if let Some(containers) = crate::plan::block_containers_of(p, m) {
                for container in &containers {
                    let Some(list) = p.module_id(&crate::model::join(&p.module(m).path, container))
                    else {
                        continue;
                    };
                    if let Some(block) = chain
                        .iter()
                        .rev()
                        .find(|c| p.module(**c).parent == Some(list))
                    {
                        let rel = p
                            .relative_path(*block, self.module)
                            .filter(|r| !r.is_empty());
                        return Some((p.module(*block).path.as_str(), rel));
                    }
                }
            }
            chain.push(m);
            cur = p.module(m).parent;
        }
        None
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

/// A request's error as an [`OffloadError`]: one a forward returned (kept,
/// so its device kind and shortfall survive), or the runtime's own.
fn request_error(e: BoxError) -> OffloadError {
    match e.downcast::<OffloadError>() {
        Ok(inner) => *inner,
        Err(e) => OffloadError::Request {
            reason: e.to_string(),
        },
    }
}

/// The error for a forward of a module path the pipeline does not have:
/// its deepest existing ancestor, that module's children and the nearest
/// of them.
fn no_module(p: &Pipeline, path: &str) -> OffloadError {
    if path.split('.').any(str::is_empty) {
        return OffloadError::Forward {
            module: path.to_owned(),
            reason: "a module path is dotted names, and this one has an empty segment (a leading, trailing or doubled `.`, or an empty name)".to_owned(),
        };
    }
    let mut parent = path;
    let ancestor = loop {
        match parent.rsplit_once('.') {
            Some((up, _)) => {
                parent = up;
                if let Some(m) = p.module_id(up) {
                    break m;
                }
            }
            None => break p.root(),
        }
    };
    let rel = p
        .relative_path(ancestor, p.root())
        .map_or(path, |base| match base {
            "" => path,
            base => path
                .strip_prefix(base)
                .map_or(path, |r| r.trim_start_matches('.')),
        });
    let wanted = rel.split('.').next().unwrap_or(rel);
    let names: Vec<&str> = p
        .module(ancestor)
        .children
        .iter()
        .map(|c| p.module(*c).name.as_str())
        .collect();
    let hint = crate::suggest::did_you_mean(wanted, names.iter().copied());
    let at = match p.module(ancestor).path.as_str() {
        "" => "the pipeline's root".to_owned(),
        a => format!("`{a}`"),
    };
    OffloadError::Forward {
        module: path.to_owned(),
        reason: format!(
            "no such module: {at} has no child `{wanted}`{hint} (its children: {})",
            crate::suggest::listed(names, 12)
        ),
    }
}
