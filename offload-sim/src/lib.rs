//! `offload-sim`: a deterministic simulated device for offload.
//!
//! [`SimDevice`] is a real backend of `offload_core::device` (real host
//! memory, a virtual clock, a happens-before checker, seeded faults), used by
//! the property tests and by the main job (`cargo run --release -p
//! offload-sim -- run`) to plan capacity and check the strategies without a
//! GPU.

pub mod device;
pub mod faults;
pub mod harness;
pub mod job;
pub mod null;
pub mod presets;
pub mod profile;
pub mod trace;

pub use device::{
    Jitter, Sim, SimAccumulator, SimCollective, SimConfig, SimDevice, SimError, SimStats,
};
pub use faults::FaultPlan;
pub use profile::DeviceProfile;
