//! `offload-dist`: the distributed layerwise strategy's process group
//! (CONTRACT §8): bootstrap from torchrun's variables, a TCP rendezvous
//! that hands out the NCCL unique id, the NCCL [`Collective`] with a
//! watchdog, and the `offload-launch` launcher.
//!
//! Everything builds and its tests pass on a machine with no GPU and no
//! NCCL: [`nccl_present`] and [`offload_cuda::driver_present`] say whether
//! they can be used, and [`init_from_env`] fails with
//! [`DistError::NcclUnavailable`] (a skip, not a failure) where they cannot.
//!
//! # Bootstrap
//!
//! Each process reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`
//! and `MASTER_PORT` ([`DistEnv`]; `offload-launch` and torchrun set them)
//! and the job's secret, `OFFLOAD_DIST_SECRET` ([`Secret`]; `offload-launch`
//! makes one per job, under torchrun set it yourself).
//! Rank 0 makes an NCCL unique id ([`NcclCollective::unique_id`]) and
//! serves it on `MASTER_ADDR:MASTER_PORT`; every other rank connects,
//! retrying until the deadline, and says hello (its rank and world size,
//! behind a magic and a protocol version, proved with an HMAC under the
//! secret over the hello and a nonce rank 0 sent it: a connection that
//! cannot prove it is dropped and logged, takes no rank and never reads
//! the id). Rank 0 answers only once every
//! rank has arrived, so the rendezvous is also a barrier; it fails, and
//! tells every connected peer why, on a world-size mismatch, a rank
//! claimed twice, or ranks missing at the deadline (named). The payload is
//! opaque bytes ([`rendezvous()`]), so all of this is tested over loopback
//! without NCCL. Then every rank joins the communicator
//! ([`NcclCollective::init`], with its own deadline).
//!
//! # Side channel
//!
//! The rendezvous's connections stay open ([`SideChannel`]): a rank that
//! fails tells the others ([`SideChannel::report`], or its dropped group),
//! a rank that dies without a word is seen by its closed connection, and
//! every other rank runs its [`Abort`] hooks (for NCCL,
//! [`NcclCollective::abort_handle`]: `ncclCommAbort`) and fails with
//! [`DistError::PeerFailed`], naming the rank and its error, within
//! seconds instead of at the collective's timeout.
//!
//! # Watchdog
//!
//! A collective that never completes (a peer that died, or skipped it)
//! must not hang any rank. The communicator is non-blocking, so no NCCL
//! call blocks the host without a deadline; after each all-gather a CUDA
//! event is recorded on the caller's stream, and a watchdog thread polls
//! those events and NCCL's async error. An entry past its deadline, or an
//! error, aborts the communicator (`ncclCommAbort`, which also releases
//! the kernels waiting for peers); every later collective then fails with
//! [`Aborted`], naming the collective's number, its size and the timeout.
//! [`NcclCollective`] documents the threading.
//!
//! [`Collective`]: offload_core::device::Collective

mod channel;
mod env;
mod error;
mod init;
mod nccl;
mod rendezvous;
mod secret;

pub use channel::{Abort, MAX_REASON_BYTES, PeerFailure, SILENCE, SideChannel};
pub use env::{DistEnv, MAX_WORLD_SIZE};
pub use error::{AbortCause, Aborted, DistError, PendingCollective};
pub use init::{DistGroup, init_from_env};
pub use nccl::{NcclCollective, NcclId, NcclInfo, nccl_info, nccl_present};
pub use rendezvous::{
    HELLO_TIMEOUT, Joined, MAGIC, MAX_PAYLOAD, MAX_PENDING, RendezvousConfig, VERSION, rendezvous,
};
pub use secret::{MAX_SECRET_BYTES, MIN_SECRET_BYTES, SECRET_VAR, Secret};
