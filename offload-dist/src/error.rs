//! [`DistError`]: everything bootstrap, rendezvous and the NCCL collective
//! can report, each naming what was wrong and what is allowed.

use std::fmt;
use std::io;
use std::time::Duration;

use offload_cuda::CudaError;

use crate::PeerFailure;

/// What went wrong while bootstrapping or running a distributed group.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// A variable that torchrun (and `offload-launch`) sets is not set.
    #[error("{var} is not set; expected {allowed} (torchrun and offload-launch set it)")]
    MissingVar {
        /// The variable.
        var: &'static str,
        /// What it should hold.
        allowed: String,
    },

    /// A variable holds something not allowed.
    #[error("{var}={value:?} is not allowed: {reason}; allowed: {allowed}")]
    InvalidVar {
        /// The variable.
        var: &'static str,
        /// Its value, as found.
        value: String,
        /// What is wrong with it.
        reason: String,
        /// What it may hold.
        allowed: String,
    },

    /// `RANK` is not below `WORLD_SIZE`.
    #[error(
        "RANK={rank} is not below WORLD_SIZE={world_size}; allowed ranks are 0..={}",
        world_size.saturating_sub(1)
    )]
    RankOutOfRange {
        /// `RANK`.
        rank: u32,
        /// `WORLD_SIZE`.
        world_size: u32,
    },

    /// A caller passed something the API does not allow (a payload on a
    /// rank other than 0, none on rank 0, an oversized payload...).
    #[error("{what}; allowed: {allowed}")]
    Usage {
        /// What was passed.
        what: String,
        /// What is allowed.
        allowed: String,
    },

    /// Rank 0 could not listen on `MASTER_ADDR:MASTER_PORT` (the port is
    /// taken, the address is not this host's...).
    #[error("rendezvous: rank 0 cannot listen on {addr}: {source}")]
    Bind {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// A peer could not connect to rank 0 before the deadline.
    #[error(
        "rendezvous: rank {rank} could not connect to rank 0 at {addr} within {timeout:?} ({attempts} attempts); last error: {last_error}"
    )]
    Connect {
        /// This rank.
        rank: u32,
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// The time allowed.
        timeout: Duration,
        /// How many connections were tried.
        attempts: u32,
        /// The last OS error (or "connect timed out").
        last_error: String,
    },

    /// A peer's `WORLD_SIZE` differs from rank 0's (reported on both).
    #[error(
        "rendezvous: WORLD_SIZE differs: rank 0 has WORLD_SIZE={rank0_world_size}, rank {rank} has WORLD_SIZE={peer_world_size}; every rank must have the same"
    )]
    WorldSizeMismatch {
        /// The peer's rank.
        rank: u32,
        /// Rank 0's `WORLD_SIZE`.
        rank0_world_size: u32,
        /// The peer's `WORLD_SIZE`.
        peer_world_size: u32,
    },

    /// Two processes claimed the same rank.
    #[error(
        "rendezvous: two processes claim RANK={rank} ({first} and {second}); each rank 1..WORLD_SIZE must come exactly once"
    )]
    DuplicateRank {
        /// The rank claimed twice.
        rank: u32,
        /// The first claimant's address.
        first: String,
        /// The second claimant's address.
        second: String,
    },

    /// Some ranks never reached rank 0 before the deadline.
    #[error(
        "rendezvous: rank(s) {} did not arrive within {timeout:?} ({arrived} of {expected} peers did){}",
        list(missing),
        dropped_note(*dropped, first_dropped.as_deref())
    )]
    MissingRanks {
        /// The ranks that never arrived.
        missing: Vec<u32>,
        /// How many peers arrived.
        arrived: usize,
        /// How many peers were expected (`WORLD_SIZE - 1`).
        expected: usize,
        /// The time allowed.
        timeout: Duration,
        /// How many connections rank 0 dropped (not ours: no or another
        /// secret, another version, junk, silence).
        dropped: usize,
        /// The first of them, "address: why".
        first_dropped: Option<String>,
    },

    /// A peer's `OFFLOAD_DIST_SECRET` and rank 0's disagree: one has a
    /// secret, the other none.
    #[error(
        "rendezvous: rank {rank}: {what} (rank 0 at {addr}); set the same OFFLOAD_DIST_SECRET on every rank, or on none"
    )]
    SecretMismatch {
        /// This rank.
        rank: u32,
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// Which side has one.
        what: String,
    },

    /// Another rank of the group failed or died: this rank learned it
    /// through its side channel (and aborted its communicator).
    #[error(
        "rank {this_rank} of {world_size} stopped because {failure}; the group is broken (start a new one)"
    )]
    PeerFailed {
        /// This rank.
        this_rank: u32,
        /// The group size.
        world_size: u32,
        /// Which rank failed, and its error.
        failure: PeerFailure,
    },

    /// Rank 0 ended the rendezvous with an error and told this peer why.
    #[error("rendezvous: rank 0 at {addr} failed: {reason}")]
    Rejected {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// Rank 0's reason.
        reason: String,
    },

    /// A peer connected but rank 0 sent no answer before the deadline.
    #[error(
        "rendezvous: rank {rank} got no answer from rank 0 at {addr} within {timeout:?} (and a 2 s grace): rank 0 is stuck, or started much later than this rank"
    )]
    NoAnswer {
        /// This rank.
        rank: u32,
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// The time allowed.
        timeout: Duration,
    },

    /// The other side does not speak this rendezvous protocol (another
    /// version of offload, or not offload at all).
    #[error("rendezvous protocol: {peer}: {what}")]
    Protocol {
        /// The other side's address.
        peer: String,
        /// What was wrong.
        what: String,
    },

    /// An I/O error during the rendezvous.
    #[error("rendezvous: {what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// NCCL or the CUDA driver cannot be used here: a skip, not a failure,
    /// where the machine has no GPU.
    #[error("NCCL unavailable: {reason}")]
    NcclUnavailable {
        /// Why (which libraries were tried, or that the driver is absent).
        reason: String,
    },

    /// An NCCL call failed.
    #[error("{operation} failed: {message}")]
    Nccl {
        /// The call, with its arguments.
        operation: String,
        /// NCCL's result code.
        result: u32,
        /// NCCL's error string and last-error detail.
        message: String,
    },

    /// `ncclCommInitRankConfig` did not complete in time (a rank never
    /// joined); the half-made communicator was aborted.
    #[error(
        "NCCL communicator init (rank {rank} of {world_size}) did not complete within {timeout:?}; aborted (did every rank call init with the same id?)"
    )]
    InitTimedOut {
        /// This rank.
        rank: u32,
        /// The group size.
        world_size: u32,
        /// The time allowed.
        timeout: Duration,
    },

    /// An NCCL unique id of the wrong length.
    #[error("an NCCL unique id is exactly {expected} bytes, got {got}")]
    BadNcclId {
        /// 128.
        expected: usize,
        /// What was given.
        got: usize,
    },

    /// The collective was aborted (by its watchdog, an NCCL error, or the
    /// caller).
    #[error(transparent)]
    Aborted(#[from] Aborted),

    /// The CUDA driver failed (creating the device, an event...).
    #[error("CUDA: {0}")]
    Cuda(#[from] CudaError),
}

impl DistError {
    /// Whether this says NCCL or the driver is absent (a skip on a machine
    /// without a GPU, not a failure).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::NcclUnavailable { .. })
    }
}

fn dropped_note(dropped: usize, first: Option<&str>) -> String {
    match (dropped, first) {
        (0, _) => String::new(),
        (n, Some(first)) => format!(
            "; {n} connection(s) dropped as not the job's (a rank with no or another OFFLOAD_DIST_SECRET, or another build?), the first {first}"
        ),
        (n, None) => format!("; {n} connection(s) dropped as not the job's"),
    }
}

fn list(ranks: &[u32]) -> String {
    let parts: Vec<String> = ranks.iter().map(u32::to_string).collect();
    parts.join(", ")
}

/// Why a communicator was aborted.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AbortCause {
    /// A collective did not complete within the timeout (its ready event
    /// stayed pending), or its enqueue did not settle in time.
    TimedOut,
    /// NCCL reported an error (`ncclCommGetAsyncError`, or a failed call).
    NcclError(String),
    /// Querying a collective's ready event failed.
    EventFailed(String),
    /// The caller called [`crate::NcclCollective::abort`].
    ByCaller,
    /// Another rank failed or died (the side channel's hook,
    /// [`crate::NcclCollective::abort_handle`]).
    PeerFailed(PeerFailure),
}

/// A collective that was pending when its communicator was aborted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingCollective {
    /// Its number, 1-based in issue order on this communicator.
    pub number: u64,
    /// Bytes each rank contributed.
    pub shard_bytes: u64,
}

/// An aborted communicator: which collective was at fault, why, and the
/// timeout in force. Every later collective on it fails with this.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct Aborted {
    /// This rank.
    pub rank: u32,
    /// The group size.
    pub ranks: u32,
    /// The oldest collective still pending at the abort, if any.
    pub collective: Option<PendingCollective>,
    /// The timeout that collective was given (without one, the timeout in
    /// force at the abort).
    pub timeout: Duration,
    /// Why.
    pub cause: AbortCause,
}

impl fmt::Display for Aborted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NCCL communicator (rank {} of {}) aborted: ",
            self.rank, self.ranks
        )?;
        let what = match self.collective {
            Some(c) => format!(
                "collective #{} (all-gather of {} bytes from each of {} ranks, {} in all)",
                c.number,
                c.shard_bytes,
                self.ranks,
                c.shard_bytes.saturating_mul(u64::from(self.ranks))
            ),
            None => "no collective pending".to_owned(),
        };
        match &self.cause {
            AbortCause::TimedOut => {
                write!(f, "{what} did not complete within {:?}", self.timeout)
            }
            AbortCause::NcclError(e) => write!(f, "{what}; NCCL reported: {e}"),
            AbortCause::EventFailed(e) => write!(f, "{what}; its ready event failed: {e}"),
            AbortCause::ByCaller => write!(f, "{what}; aborted by the caller"),
            AbortCause::PeerFailed(p) => write!(f, "{what}; aborted because {p}"),
        }?;
        f.write_str("; later collectives on it fail (build a new group)")
    }
}
