//! `offload-core`: the hardware-neutral core of offload.
//!
//! It owns everything that does not depend on a particular device: the
//! device trait family ([`device`]), the model description ([`model`]),
//! configuration and strategy selection ([`config`]), component discovery
//! ([`discovery`]), the offload plan and its pure resolver ([`plan`]), the
//! backend lifecycle and factory ([`lifecycle`]), residency as a type
//! ([`residency`]), the invariants of CONTRACT §10 ([`invariants`]), and the
//! strategies with the forward API, generic over the device ([`runtime`]).
//!
//! It never names a device library: backends (`offload-sim`,
//! `offload-cuda`, `offload-dist`) implement [`device::Api`] and stay thin.

pub mod budget;
pub mod bytes;
pub mod config;
pub mod copy;
pub mod declaration;
pub mod device;
pub mod diagnostics;
pub mod discovery;
pub mod invariants;
pub mod lifecycle;
pub mod measurements;
pub mod model;
pub mod plan;
pub mod request;
pub mod residency;
pub mod runtime;
pub mod schema;
mod suggest;
mod sync;

pub use config::{
    ComponentName, ConfigError, OffloadConfig, OffloadStrategy, ParallelConfig, Selection,
};
pub use discovery::ComponentDeclaration;
pub use lifecycle::{OffloadBackend, OffloadError, Platform, get_offload_backend};
pub use model::{DType, Pipeline, PipelineBuilder};
/// The error a forward closure, a hook or a request returns: any error,
/// boxed (`?` converts into it).
pub use offload_hooks::BoxError;
pub use plan::{OffloadPlan, PlanError, ResolvedPlan, resolve};
