//! The backend lifecycle (CONTRACT §3): the [`OffloadBackend`] trait, the
//! [`Lifecycle`] state machine every backend embeds, the [`Platform`] a
//! runtime provides, and the factory [`get_offload_backend`].

use std::fmt;

use crate::config::{ConfigError, OffloadConfig, OffloadStrategy, ParallelConfig, Selection};
use crate::plan::PlanError;
use crate::runtime::hooks::Model;

/// Where a backend is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LifecycleState {
    /// Built, or disabled: no hooks, no resources.
    Disabled,
    /// Hooks installed, resources held.
    Enabled,
    /// A multi-rank failure left it unusable; build a new backend.
    Poisoned {
        /// What failed.
        reason: String,
    },
}

/// Errors of the lifecycle and of backends.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    /// The configuration was rejected.
    #[error(transparent)]
    Config(Box<ConfigError>),
    /// Plan resolution failed; nothing was mutated.
    #[error(transparent)]
    Plan(Box<PlanError>),
    /// The backend is poisoned.
    #[error("the {strategy} backend is poisoned ({reason}); build a new backend")]
    Poisoned {
        /// The backend's strategy.
        strategy: OffloadStrategy,
        /// Why.
        reason: String,
    },
    /// The platform could not resolve a device.
    #[error("platform `{platform}` cannot resolve a device: {reason}")]
    Device {
        /// The platform.
        platform: String,
        /// Why.
        reason: String,
    },
    /// A device operation failed. The backend's error is part of the
    /// message (not chained again as a source).
    #[error("{operation} failed: {cause}")]
    DeviceOp {
        /// The operation (e.g. `alloc_device(1048576 bytes)`).
        operation: String,
        /// What kind of failure the backend reported.
        kind: crate::device::DeviceErrorKind,
        /// For out of memory: the bytes the allocation lacked, if known.
        shortfall_bytes: Option<u64>,
        /// The backend's error.
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The platform built a backend of another strategy than selected.
    #[error(
        "platform `{platform}` built a {built} backend, but the configuration selects {expected}"
    )]
    WrongBackend {
        /// The platform.
        platform: String,
        /// The selected strategy.
        expected: OffloadStrategy,
        /// What it built.
        built: OffloadStrategy,
    },
    /// A hook could not be installed or removed.
    #[error(transparent)]
    Hook(#[from] offload_hooks::HookError),
    /// Another strategy already owns offload hooks on this pipeline (INV-1).
    #[error(transparent)]
    Invariant(#[from] crate::invariants::Violation),
    /// A residency transition was refused.
    #[error(transparent)]
    Residency(#[from] crate::residency::ResidencyError),
    /// A hook of a module failed during its forward.
    #[error("forward of {}: {error}", module_named(module))]
    HookFailed {
        /// The module path.
        module: String,
        /// The hook's error (its name and phase; part of the message, not
        /// chained again as a source).
        error: Box<offload_hooks::HookError>,
    },
    /// A hook of a backend ran while the backend is disabled.
    #[error("the {strategy} backend is disabled: enable it before running forwards")]
    Disabled {
        /// Its strategy.
        strategy: OffloadStrategy,
    },
    /// A backend is already enabled on the runtime.
    #[error(
        "a {enabled} backend is already enabled on this runtime, so the {requested} backend was not enabled: disable it first (`Runtime::disable`), one strategy per pipeline"
    )]
    AlreadyEnabled {
        /// The strategy enabled now.
        enabled: OffloadStrategy,
        /// The strategy asked for.
        requested: OffloadStrategy,
    },
    /// The runtime's request (its registered forwards) failed or is missing.
    #[error("request: {reason}")]
    Request {
        /// What failed.
        reason: String,
    },
    /// A forward scope was asked for something it cannot lend.
    #[error("forward of {}: {reason}", module_named(module))]
    Forward {
        /// The module path.
        module: String,
        /// What was wrong.
        reason: String,
    },
    /// The strategy is not implemented by this platform yet.
    #[error("platform `{platform}` has no {strategy} backend")]
    Unsupported {
        /// The platform.
        platform: String,
        /// The strategy.
        strategy: OffloadStrategy,
    },
    /// The device budget cannot be planned (it does not fit, or the
    /// planner's inputs are unusable).
    #[error(transparent)]
    Budget(Box<crate::budget::BudgetError>),
    /// The distributed strategy's gather group does not match the
    /// collective it was given (or it was given none).
    #[error("distributed layerwise offload: {reason}")]
    GatherGroup {
        /// What was wrong and what is expected.
        reason: String,
    },
}

/// A module path as errors name it: `` `dit.blocks.0` ``, or the root by
/// name (never an empty pair of quotes).
pub(crate) fn module_named(path: &str) -> String {
    if path.is_empty() {
        "the pipeline's root module".to_owned()
    } else {
        format!("`{path}`")
    }
}

impl OffloadError {
    /// A device operation's error from a backend's error.
    pub fn device(operation: impl Into<String>, e: impl crate::device::DeviceError) -> Self {
        OffloadError::DeviceOp {
            operation: operation.into(),
            kind: e.kind(),
            shortfall_bytes: e.shortfall_bytes(),
            cause: Box::new(e),
        }
    }

    /// The kind of device failure behind this error, if a device operation
    /// failed (also through a hook: a forward whose pre-forward could not
    /// allocate reports `OutOfMemory`). Lets a caller tell "does not fit"
    /// from a bug.
    pub fn device_error_kind(&self) -> Option<crate::device::DeviceErrorKind> {
        self.device_op().map(|(kind, _)| kind)
    }

    /// For an out-of-memory failure: the bytes the failed allocation
    /// lacked, when the device said (a re-plan grows the phase by them).
    pub fn shortfall_bytes(&self) -> Option<u64> {
        self.device_op().and_then(|(_, s)| s)
    }

    /// The device operation behind this error (through a hook, too).
    fn device_op(&self) -> Option<(crate::device::DeviceErrorKind, Option<u64>)> {
        match self {
            OffloadError::DeviceOp {
                kind,
                shortfall_bytes,
                ..
            } => Some((*kind, *shortfall_bytes)),
            OffloadError::Hook(h) => hook_device_op(h),
            OffloadError::HookFailed { error, .. } => hook_device_op(error),
            _ => None,
        }
    }
}

/// The device operation behind a hook's error, through its sources.
fn hook_device_op(
    h: &offload_hooks::HookError,
) -> Option<(crate::device::DeviceErrorKind, Option<u64>)> {
    let mut source = std::error::Error::source(h);
    while let Some(e) = source {
        if let Some(inner) = e.downcast_ref::<OffloadError>() {
            return inner.device_op();
        }
        source = e.source();
    }
    None
}

impl From<ConfigError> for OffloadError {
    fn from(e: ConfigError) -> Self {
        OffloadError::Config(Box::new(e))
    }
}

impl From<PlanError> for OffloadError {
    fn from(e: PlanError) -> Self {
        OffloadError::Plan(Box::new(e))
    }
}

/// What [`Lifecycle::begin_enable`] tells the backend to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnableStep {
    /// Go ahead and enable.
    Proceed,
    /// Already enabled: a warning was logged; do nothing.
    AlreadyEnabled,
}

/// What [`Lifecycle::begin_disable`] tells the backend to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DisableStep {
    /// Go ahead and release hooks and resources.
    Proceed,
    /// Nothing is enabled: do nothing (disable is idempotent).
    NothingToDo,
}

/// The lifecycle state machine every backend embeds, so the rules of §3
/// live in one place: a second `enable` warns and does nothing, `disable`
/// is idempotent, a poisoned backend refuses `enable`.
#[derive(Clone, Debug)]
pub struct Lifecycle {
    strategy: OffloadStrategy,
    state: LifecycleState,
}

impl Lifecycle {
    /// A disabled lifecycle for a backend of `strategy`.
    pub fn new(strategy: OffloadStrategy) -> Self {
        Self {
            strategy,
            state: LifecycleState::Disabled,
        }
    }

    /// The state.
    pub fn state(&self) -> &LifecycleState {
        &self.state
    }

    /// Whether enabled.
    pub fn is_enabled(&self) -> bool {
        self.state == LifecycleState::Enabled
    }

    /// Call first in `enable`.
    pub fn begin_enable(&self) -> Result<EnableStep, OffloadError> {
        match &self.state {
            LifecycleState::Disabled => Ok(EnableStep::Proceed),
            LifecycleState::Enabled => {
                tracing::warn!(strategy = %self.strategy, "offload already enabled: enable ignored");
                Ok(EnableStep::AlreadyEnabled)
            }
            LifecycleState::Poisoned { reason } => Err(OffloadError::Poisoned {
                strategy: self.strategy,
                reason: reason.clone(),
            }),
        }
    }

    /// Call when `enable` has finished successfully.
    pub fn finish_enable(&mut self) {
        if self.state == LifecycleState::Disabled {
            self.state = LifecycleState::Enabled;
        }
    }

    /// Call first in `disable`.
    pub fn begin_disable(&self) -> DisableStep {
        match self.state {
            LifecycleState::Enabled => DisableStep::Proceed,
            _ => DisableStep::NothingToDo,
        }
    }

    /// Call when `disable` has released everything (even if a step failed:
    /// every step runs, and the first error is returned).
    pub fn finish_disable(&mut self) {
        if self.state == LifecycleState::Enabled {
            self.state = LifecycleState::Disabled;
        }
    }

    /// Marks the backend poisoned (a multi-rank failure cleaned up locally).
    pub fn poison(&mut self, reason: impl Into<String>) {
        self.state = LifecycleState::Poisoned {
            reason: reason.into(),
        };
    }
}

/// One offload backend (CONTRACT §3). Exactly one is installed per pipeline.
pub trait OffloadBackend: Send {
    /// The strategy it implements.
    fn strategy(&self) -> OffloadStrategy;

    /// Resolves the plan (pure), establishes initial residency and installs
    /// hooks. A second call warns and does nothing. On failure every hook it
    /// installed is removed and the pipeline's tensors are back on their
    /// prior host storage (or the backend is poisoned, for gathering
    /// backends).
    fn enable(&mut self, model: &mut Model) -> Result<(), OffloadError>;

    /// Removes the hooks and resources this backend owns, and only those.
    /// Idempotent. Does not restore the original placement: afterwards every
    /// tensor is back on its host source.
    fn disable(&mut self, model: &mut Model) -> Result<(), OffloadError>;

    /// Whether enabled.
    fn is_enabled(&self) -> bool;

    /// The lifecycle state.
    fn state(&self) -> LifecycleState;

    /// Tells a multi-rank gathering backend that this rank failed outside
    /// its hooks (the runtime's own code, a collective of its own), so its
    /// collectives may be out of step with the other ranks': the backend is
    /// poisoned, and its `disable` runs no collective (CONTRACT §3, §8).
    /// Backends of one rank ignore it (the default).
    fn poison(&mut self, reason: &str) {
        let _ = reason;
    }
}

/// The device a backend runs on, as the platform names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSpec {
    /// Platform-specific ordinal (e.g. the CUDA device index).
    pub ordinal: u32,
    /// Human-readable name.
    pub name: String,
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (#{})", self.name, self.ordinal)
    }
}

/// Everything a platform needs to build one backend.
#[derive(Clone, Debug)]
pub struct BackendRequest {
    /// The selection.
    pub selection: Selection,
    /// The configuration it came from.
    pub config: OffloadConfig,
    /// The resolved device.
    pub device: DeviceSpec,
}

/// What the runtime provides to the factory: the platform-support check,
/// device resolution, and construction of the concrete backends.
pub trait Platform {
    /// The backends it builds (`dyn OffloadBackend`, or a richer trait such
    /// as [`crate::runtime::Backend`]).
    type Backend: OffloadBackend + ?Sized;

    /// The platform's name, for messages.
    fn name(&self) -> &str;

    /// Whether this platform can offload at all.
    fn supports_offload(&self) -> bool;

    /// The device this process offloads to.
    fn resolve_device(&self, parallel: &ParallelConfig) -> Result<DeviceSpec, OffloadError>;

    /// Builds the backend for `request.selection.strategy` (never `None`).
    fn create_backend(&self, request: BackendRequest) -> Result<Box<Self::Backend>, OffloadError>;
}

/// Builds exactly one backend for the configuration, or `None` when
/// offloading is off or the platform does not support it (with a warning).
/// A rejected configuration is an `Err`. Nothing is installed here: the
/// pipeline is untouched until the backend's `enable`.
pub fn get_offload_backend<P: Platform + ?Sized>(
    config: &OffloadConfig,
    platform: &P,
) -> Result<Option<Box<P::Backend>>, OffloadError> {
    let selection = config.select()?;
    // Once per backend built: selection itself is pure, and every backend
    // selects again as it resolves.
    for disabled in &selection.disabled_flags {
        tracing::info!(flag = disabled.flag, selected = %disabled.by, "{disabled}");
    }
    if selection.strategy == OffloadStrategy::None {
        return Ok(None);
    }
    if !platform.supports_offload() {
        tracing::warn!(
            platform = platform.name(),
            strategy = %selection.strategy,
            "platform `{}` does not support offload: {} offload stays off",
            platform.name(),
            selection.strategy
        );
        return Ok(None);
    }
    let device = platform.resolve_device(&config.parallel)?;
    let strategy = selection.strategy;
    let backend = platform.create_backend(BackendRequest {
        selection,
        config: config.clone(),
        device,
    })?;
    if backend.strategy() != strategy {
        return Err(OffloadError::WrongBackend {
            platform: platform.name().to_owned(),
            expected: strategy,
            built: backend.strategy(),
        });
    }
    Ok(Some(backend))
}
