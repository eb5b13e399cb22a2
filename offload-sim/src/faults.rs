//! Seeded fault injection and the seed that drives every random choice of a
//! run. The seed is printed on failure and read back from `OFFLOAD_SIM_SEED`.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// The environment variable a failing run's seed is replayed from.
pub const SEED_ENV: &str = "OFFLOAD_SIM_SEED";

/// Which operations fail (1-based counts; `None` never).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FaultPlan {
    /// The N-th allocation (device, pinned or registration) fails with
    /// out-of-memory.
    pub fail_alloc_at: Option<u64>,
    /// The N-th copy fails.
    pub fail_copy_at: Option<u64>,
    /// The N-th collective fails.
    pub fail_collective_at: Option<u64>,
    /// The N-th host synchronisation (of a stream or an event) fails, as
    /// on a lost device: a strategy must then leak what the device may
    /// still touch rather than free it.
    pub fail_sync_at: Option<u64>,
    /// Every N-th request to pin host memory (a pinned allocation or a
    /// registration in place) is refused, as a platform that limits pinned
    /// memory refuses it (WSL2, a loaded Windows process): the strategy must
    /// then stream that block staged (CONTRACT §7c).
    pub refuse_pin_every: Option<u64>,
    /// Pin requests `first..=last` (1-based) are refused, as a platform
    /// refuses a run of requests while its pinned memory is spent (a
    /// staging buffer asked for three times, refused each time).
    pub refuse_pins: Option<(u64, u64)>,
}

impl FaultPlan {
    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    /// At most one fault of each kind, chosen by `rng` within the given
    /// horizons (about half of the plans inject nothing of a kind).
    pub fn random(rng: &mut ChaCha8Rng, allocs: u64, copies: u64, collectives: u64) -> Self {
        let mut pick = |horizon: u64| {
            (horizon > 0 && rng.random_bool(0.5)).then(|| rng.random_range(1..=horizon))
        };
        Self {
            fail_alloc_at: pick(allocs),
            fail_copy_at: pick(copies),
            fail_collective_at: pick(collectives),
            fail_sync_at: None,
            refuse_pin_every: None,
            refuse_pins: None,
        }
    }

    /// Whether anything is injected.
    pub fn any(&self) -> bool {
        self.fail_alloc_at.is_some()
            || self.fail_copy_at.is_some()
            || self.fail_collective_at.is_some()
            || self.fail_sync_at.is_some()
            || self.refuse_pin_every.is_some()
            || self.refuse_pins.is_some()
    }
}

/// The seed of this run: `OFFLOAD_SIM_SEED` if set, else `default`.
pub fn seed_from_env(default: u64) -> u64 {
    std::env::var(SEED_ENV)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(default)
}

/// The run's random number generator.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}
