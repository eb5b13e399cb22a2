//! Seeded timing perturbation: random delays on the device (a spin kernel
//! enqueued on a stream) and on the host (a short sleep) before the
//! operations that order work across streams, so that a missing wait shows
//! up as a wrong output instead of hiding behind lucky timing.
//!
//! # What it widens
//!
//! A spin enqueued on a stream delays everything enqueued on that stream
//! after it, and nothing else. Before a `copy_h2d` it delays a fill, so a
//! compute that does not wait for the fill's ready event reads the slot's
//! old bytes. Before `stream_wait_event(compute, ready)` (each block's
//! pre-forward) or `record_event(last use, compute)` it delays compute, so
//! a copy or a free that does not wait for the last use overwrites or frees
//! memory compute has yet to read. Before the memory stream's waits in
//! `free_device` it delays frees (never unsafe: only later). Host sleeps
//! change how far the host runs ahead of the device.
//!
//! The choice of which operations are delayed, and by how much, is a pure
//! function of the seed and the sequence of perturbation points; the
//! device's own timing is not, so a run is a sample, not a replay.

use std::ffi::CStr;

use cudarc::driver::{result, sys};

/// Timing perturbation settings (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Perturbation {
    /// Seed of the random choices.
    pub seed: u64,
    /// Chance, per perturbation point, of a delay (0 never, 1 always; NaN
    /// never).
    pub probability: f64,
    /// A delayed point spins its stream for a uniform `0..max_spin_ns`.
    pub max_spin_ns: u64,
    /// A delayed point sleeps the host for a uniform `0..max_host_delay_us`.
    pub max_host_delay_us: u64,
}

/// One perturbation point's delays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Delay {
    pub(crate) spin_ns: u64,
    pub(crate) host_us: u64,
}

/// The random state of a perturbation: splitmix64 from the seed.
#[derive(Debug)]
pub(crate) struct Perturber {
    config: Perturbation,
    state: u64,
}

impl Perturber {
    pub(crate) fn new(config: Perturbation) -> Self {
        Self {
            config,
            state: config.seed,
        }
    }

    pub(crate) fn config(&self) -> Perturbation {
        self.config
    }

    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// The next point's delays, if it is delayed.
    pub(crate) fn draw(&mut self) -> Option<Delay> {
        let unit = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        // A NaN probability compares false: never delayed.
        if unit >= self.config.probability || self.config.probability.is_nan() {
            return None;
        }
        let Perturbation {
            max_spin_ns,
            max_host_delay_us,
            ..
        } = self.config;
        let mut below = |max: u64| if max == 0 { 0 } else { self.next() % max };
        let spin_ns = below(max_spin_ns);
        let host_us = below(max_host_delay_us);
        Some(Delay { spin_ns, host_us })
    }
}

/// The spin kernel's PTX, NUL-terminated for `cuModuleLoadData`.
pub(crate) const SPIN_PTX: &CStr =
    match CStr::from_bytes_with_nul(concat!(include_str!("spin.ptx"), "\0").as_bytes()) {
        Ok(ptx) => ptx,
        Err(_) => panic!("spin.ptx contains a NUL byte"),
    };

/// A kernel of a PTX module loaded into one context (the spin kernel, the
/// in-place pageable read), unloaded by its context's drop.
#[derive(Debug)]
pub(crate) struct PtxKernel {
    pub(crate) module: sys::CUmodule,
    pub(crate) function: sys::CUfunction,
}

// SAFETY: module and function handles may be used from any thread with
// their context current (every user binds it first).
unsafe impl Send for PtxKernel {}
// SAFETY: as above; launching concurrently is synchronised by the driver.
unsafe impl Sync for PtxKernel {}

impl PtxKernel {
    /// Loads `ptx` into the current context and finds `name` in it.
    ///
    /// # Safety
    ///
    /// The context the kernel is meant for must be current on this thread.
    pub(crate) unsafe fn load(ptx: &CStr, name: &CStr) -> Result<Self, result::DriverError> {
        // SAFETY: `ptx` is a NUL-terminated PTX module.
        let module = unsafe { result::module::load_data(ptx.as_ptr().cast()) }?;
        // SAFETY: the module was just loaded and is not unloaded yet.
        match unsafe { result::module::get_function(module, name.to_owned()) } {
            Ok(function) => Ok(Self { module, function }),
            Err(e) => {
                // SAFETY: loaded above, used by nothing.
                let _ = unsafe { result::module::unload(module) };
                Err(e)
            }
        }
    }

    /// Enqueues `spin(ns)` on `stream`: one thread, one block.
    ///
    /// # Safety
    ///
    /// The kernel must be the spin kernel, its context current, `stream` a
    /// live stream of it, and the module loaded until the launch completes.
    pub(crate) unsafe fn launch_spin(
        &self,
        stream: sys::CUstream,
        ns: u64,
    ) -> Result<(), result::DriverError> {
        let mut ns = ns;
        let mut params: [*mut std::ffi::c_void; 1] = [(&raw mut ns).cast()];
        // SAFETY: `spin` takes one u64, which `params` points to (the
        // driver copies parameters at launch); the rest is the caller's.
        unsafe {
            result::launch_kernel(self.function, (1, 1, 1), (1, 1, 1), 0, stream, &mut params)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Delay, Perturbation, Perturber, SPIN_PTX};

    fn draws(p: Perturbation, n: usize) -> Vec<Option<Delay>> {
        let mut r = Perturber::new(p);
        (0..n).map(|_| r.draw()).collect()
    }

    const P: Perturbation = Perturbation {
        seed: 7,
        probability: 0.5,
        max_spin_ns: 1000,
        max_host_delay_us: 10,
    };

    #[test]
    fn the_same_seed_draws_the_same_delays() {
        assert_eq!(draws(P, 200), draws(P, 200));
        assert_ne!(draws(P, 200), draws(Perturbation { seed: 8, ..P }, 200));
    }

    #[test]
    fn probability_and_bounds_hold() {
        let d = draws(P, 2000);
        let hit = d.iter().flatten().count();
        assert!((800..1200).contains(&hit), "{hit} of 2000 at p = 0.5");
        assert!(
            d.iter()
                .flatten()
                .all(|d| d.spin_ns < 1000 && d.host_us < 10)
        );
        let never = Perturbation {
            probability: 0.0,
            ..P
        };
        assert!(draws(never, 500).iter().all(Option::is_none));
        let nan = Perturbation {
            probability: f64::NAN,
            ..P
        };
        assert!(draws(nan, 500).iter().all(Option::is_none));
        let always = Perturbation {
            probability: 1.0,
            max_spin_ns: 0,
            max_host_delay_us: 0,
            ..P
        };
        assert!(draws(always, 500).iter().all(|d| *d
            == Some(Delay {
                spin_ns: 0,
                host_us: 0
            })));
    }

    #[test]
    fn the_spin_module_is_a_ptx_module_with_its_entry() {
        let text = SPIN_PTX.to_str().expect("ASCII");
        assert!(text.contains(".version 7.0") && text.contains(".entry spin("));
        assert!(text.contains("%globaltimer"));
    }
}
