//! Residency as a type (CONTRACT §1): the four states of a managed storage,
//! the legal transitions between them, and a table that enforces one owner
//! per managed storage.
//!
//! ```text
//!             issue_copy            copy_done
//!  HostOnly ─────────────▶ InFlight ─────────▶ Resident
//!     ▲                       ▲                   │
//!     │ restore               │ issue_copy        │ release
//!     │                       │                   ▼
//!     └──────────────────── Released ◀────────────┘
//!                    (InFlight ──discard──▶ Released: a prefetch never used)
//! ```
//!
//! `HostOnly`: only the host master holds the bytes. `InFlight`: a copy to
//! the device is enqueued, its ready event pending. `Resident`: the device
//! copy may be read (compute waited for the ready event). `Released`: the
//! device copy is no longer lent to compute; its slot may be reused once the
//! last-use event completes; the host master stays authoritative.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

/// Where a managed storage's bytes are now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Residency {
    /// Only the host master.
    HostOnly,
    /// Copy enqueued, ready event pending.
    InFlight,
    /// On the device and readable.
    Resident,
    /// Device copy released; host master authoritative.
    Released,
}

/// A request to change residency.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Transition {
    /// Enqueue the host→device copy (or gather).
    IssueCopy,
    /// The ready event was waited for: compute may read.
    CopyDone,
    /// Compute is done with it; the slot may be reused after last use.
    Release,
    /// Back to host only (disable, or a failed enable rolled back).
    Restore,
    /// A prefetched copy that compute never consumed: its slot is refilled
    /// (the copy stream orders the refill after the copy).
    Discard,
}

/// A transition not allowed from the current state.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "illegal residency transition {transition:?} from {from:?} for `{key}`; allowed from {from:?}: {allowed:?}"
)]
pub struct IllegalTransition {
    /// What was being moved.
    pub key: String,
    /// Its state.
    pub from: Residency,
    /// The requested transition.
    pub transition: Transition,
    /// What is allowed from that state.
    pub allowed: Vec<Transition>,
}

impl Residency {
    /// The transitions legal from this state.
    pub fn allowed(self) -> &'static [Transition] {
        match self {
            Residency::HostOnly => &[Transition::IssueCopy, Transition::Restore],
            Residency::InFlight => &[Transition::CopyDone, Transition::Discard],
            Residency::Resident => &[Transition::Release],
            Residency::Released => &[Transition::IssueCopy, Transition::Restore],
        }
    }

    /// The state after `transition`, or `None` if it is illegal.
    pub fn next(self, transition: Transition) -> Option<Residency> {
        use Residency::*;
        use Transition::*;
        match (self, transition) {
            (HostOnly | Released, IssueCopy) => Some(InFlight),
            (InFlight, CopyDone) => Some(Resident),
            (Resident, Release) => Some(Released),
            (HostOnly | Released, Restore) => Some(HostOnly),
            (InFlight, Discard) => Some(Released),
            _ => None,
        }
    }
}

/// An owner of managed storages (a backend instance).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Owner(pub String);

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Errors of the residency table.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResidencyError {
    /// The transition is illegal.
    #[error(transparent)]
    Illegal(#[from] IllegalTransition),
    /// Another owner manages the key.
    #[error("`{key}` is managed by `{owner}`; `{requested_by}` may not claim or move it")]
    NotOwner {
        /// The key.
        key: String,
        /// Its owner.
        owner: Owner,
        /// Who asked.
        requested_by: Owner,
    },
    /// The key is not managed.
    #[error("`{key}` is not managed by any owner")]
    Unmanaged {
        /// The key.
        key: String,
    },
}

/// Residency of every managed key, with exactly one owner each (INV-1).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ResidencyTable<K: Ord + Clone + fmt::Display> {
    entries: BTreeMap<K, (Owner, Residency)>,
}

impl<K: Ord + Clone + fmt::Display> ResidencyTable<K> {
    /// An empty table.
    pub fn new() -> Self {
        Self {
            entries: BTreeMap::new(),
        }
    }

    /// `owner` starts managing `key`, in state `HostOnly`. Claiming a key
    /// another owner manages is an error.
    pub fn claim(&mut self, key: K, owner: &Owner) -> Result<(), ResidencyError> {
        match self.entries.get(&key) {
            Some((o, _)) if o != owner => Err(ResidencyError::NotOwner {
                key: key.to_string(),
                owner: o.clone(),
                requested_by: owner.clone(),
            }),
            Some(_) => Ok(()),
            None => {
                self.entries
                    .insert(key, (owner.clone(), Residency::HostOnly));
                Ok(())
            }
        }
    }

    /// Applies `transition` to `key` on behalf of `owner`.
    pub fn apply(
        &mut self,
        key: &K,
        owner: &Owner,
        transition: Transition,
    ) -> Result<Residency, ResidencyError> {
        let Some((o, state)) = self.entries.get_mut(key) else {
            return Err(ResidencyError::Unmanaged {
                key: key.to_string(),
            });
        };
        if o != owner {
            return Err(ResidencyError::NotOwner {
                key: key.to_string(),
                owner: o.clone(),
                requested_by: owner.clone(),
            });
        }
        match state.next(transition) {
            Some(next) => {
                *state = next;
                Ok(next)
            }
            None => Err(IllegalTransition {
                key: key.to_string(),
                from: *state,
                transition,
                allowed: state.allowed().to_vec(),
            }
            .into()),
        }
    }

    /// The state of `key`.
    pub fn state(&self, key: &K) -> Option<Residency> {
        self.entries.get(key).map(|(_, s)| *s)
    }

    /// The owner of `key`.
    pub fn owner(&self, key: &K) -> Option<&Owner> {
        self.entries.get(key).map(|(o, _)| o)
    }

    /// Stops managing every key of `owner`; returns how many.
    pub fn release_owner(&mut self, owner: &Owner) -> usize {
        let before = self.entries.len();
        self.entries.retain(|_, (o, _)| o != owner);
        before - self.entries.len()
    }

    /// Every `(key, owner, state)`.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &Owner, Residency)> {
        self.entries.iter().map(|(k, (o, s))| (k, o, *s))
    }
}
