//! `offload-sim`: a deterministic simulated device for offload.
//!
//! [`SimDevice`] is a real backend of `offload_core::device` (real host
//! memory, a virtual clock, a happens-before checker, seeded faults), used by
//! the property tests and by the main job (`cargo run --release -p
//! offload-sim -- run`) to plan capacity and check the strategies without a
//! GPU. [`SimGroup`] joins several of them into a gather group whose ranks
//! run on their own host threads and share one simulated all-gather;
//! [`SimCodec`] gives it `offload-pack`'s lossless block code, decoded on a
//! decode engine beside compute.
//! [`plan`] answers the capacity question without running anything
//! (`offload-sim plan`): the core's budget planner on a device profile and
//! the kernel model.

pub mod codec;
pub mod collective;
pub mod crossover;
pub mod device;
pub mod faults;
pub mod fit;
pub mod harness;
pub mod job;
pub mod multi;
pub mod null;
pub mod plan;
pub mod presets;
pub mod profile;
pub mod trace;

pub use codec::SimCodec;
pub use collective::{GatherRecord, SimCollective, SimGroup};
pub use device::{Jitter, Sim, SimAccumulator, SimConfig, SimDevice, SimError, SimStats};
pub use faults::FaultPlan;
pub use profile::{DeviceProfile, LinkProfile};
