//! Concurrency shim: the only file that names `std::sync`. Under `cfg(loom)`
//! the model-checked `Mutex` replaces the std one, so loom explores every
//! interleaving of the host-side state that threads share (the slot table,
//! the warn-once registry). `Arc` stays std: it owns device handles and
//! buffers, it is not a protocol of ours.

#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};

pub(crate) use std::sync::{Arc, OnceLock};

/// Locks `m`, taking the data of a poisoned lock (a panicking hook must not
/// wedge the backend's cleanup).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
