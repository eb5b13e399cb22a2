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

mod backend;
mod bounds;
mod bugs;
mod filler;
pub use filler::fill_threads_alive as staging_fill_threads_alive;
pub use read::fill_threads as staging_fill_threads;
mod forward;
pub(crate) mod hooks;
mod layerwise;
pub(crate) mod layout;
mod model_level;
mod planned;
pub use planned::{CHECK_DECODE_SHARE, check_request_wanted};
mod platform;
mod read;
mod resident;
mod ring;
mod shared;
mod slots;
mod timer;

pub use backend::{Backend, CodedRegion, DeviceLocation, Disabled, HostMasters, WeightSource};
pub use bounds::{
    MemoryBounds, PhaseBounds, PlanBounds, memory_bounds, offloaded_storages, plan_bounds,
};
pub use bugs::PlantedBug;
pub use forward::{RequestFn, Runtime, Scope, View};
pub use hooks::{ForwardCtx, HookMap, Model};
pub use layerwise::{DistributedLayerwiseBackend, LayerwiseBackend};
pub use layout::{Entry, Partition, SourcePosition, Unit, bf16_storages, codec_spans, partition};
pub use model_level::ModelLevelBackend;
pub use planned::PlannedBackend;
pub use platform::CorePlatform;
pub use read::{unit_bytes, unit_bytes_parallel};
pub use resident::ResidentBackend;
pub use shared::{packing, packing_for};
