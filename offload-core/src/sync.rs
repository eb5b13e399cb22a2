//! Concurrency shim: the only file that names `std::sync`. Under `cfg(loom)`
//! the model-checked types replace the std ones, so loom sees every
//! synchronisation point of host-side shared state.

#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::{Arc, Mutex, atomic};
#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use std::sync::{Arc, Mutex, atomic};

/// A mutex usable in a `static` (const constructor). Used only for
/// process-wide bookkeeping that is not part of any protocol loom checks
/// (e.g. "warn once per pipeline type").
pub(crate) use std::sync::Mutex as StaticMutex;
