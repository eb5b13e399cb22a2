//! [`init_from_env`]: the whole bootstrap in one call.

use std::time::Duration;

use offload_cuda::CudaDevice;

use crate::{
    DistEnv, DistError, NcclCollective, NcclId, RendezvousConfig, Secret, SideChannel, nccl_info,
    rendezvous,
};

/// What [`init_from_env`] builds: this process's place, its GPU and its
/// communicator.
#[derive(Debug)]
pub struct DistGroup {
    /// The variables it was built from.
    pub env: DistEnv,
    /// The GPU for `LOCAL_RANK`.
    pub device: CudaDevice,
    /// The communicator (rank `env.rank` of `env.world_size`), aborted
    /// by the side channel when another rank fails.
    pub collective: NcclCollective,
    /// The group's side channel: [`SideChannel::check`] names a rank that
    /// failed; [`SideChannel::report`] tells the others this one did;
    /// [`SideChannel::finish`] when this rank is done (dropping it
    /// otherwise counts as this rank failing).
    pub channel: SideChannel,
}

/// Bootstraps this process into its group, torchrun style:
///
/// 1. fails with [`DistError::NcclUnavailable`] at once (before reading
///    anything else) where the CUDA driver or NCCL is absent, so a machine
///    without a GPU can skip cleanly;
/// 2. reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
///    `MASTER_PORT` ([`DistEnv::from_env`]) and the job's secret,
///    `OFFLOAD_DIST_SECRET` ([`Secret::from_env`]; unset: an open
///    rendezvous, with a warning);
/// 3. makes the device for `LOCAL_RANK` with `device_for_local_rank`
///    (typically `|i| CudaDevice::new(i as i32)`);
/// 4. on rank 0, makes the NCCL unique id; the [`rendezvous()`] hands it to
///    every rank that proves the secret, and leaves the side channel;
/// 5. joins the communicator ([`NcclCollective::init_watched`]: a peer's
///    failure ends the wait, and later aborts the communicator).
///
/// A failure after the rendezvous is reported to the other ranks before
/// it is returned.
///
/// `timeout` bounds the rendezvous and the communicator's init, each, and
/// is the collectives' deadline ([`NcclCollective::set_timeout`] changes
/// that later).
pub fn init_from_env<E>(
    device_for_local_rank: impl FnOnce(u32) -> Result<CudaDevice, E>,
    timeout: Duration,
) -> Result<DistGroup, DistError>
where
    DistError: From<E>,
{
    let nccl = nccl_info();
    if !offload_cuda::driver_present() {
        let mut reason = "no CUDA driver with a device on this machine".to_owned();
        if let Err(DistError::NcclUnavailable { reason: r }) = &nccl {
            reason = format!("{reason}; and {r}");
        }
        return Err(DistError::NcclUnavailable { reason });
    }
    nccl?;
    let env = DistEnv::from_env()?;
    let secret = Secret::from_env()?;
    let device = device_for_local_rank(env.local_rank)?;
    let id = if env.rank == 0 {
        Some(NcclCollective::unique_id()?)
    } else {
        None
    };
    let config = RendezvousConfig::new(timeout).with_secret(secret);
    let joined = rendezvous(&env, id.as_ref().map(NcclId::as_bytes), &config)?;
    let channel = joined.channel;
    let formed = NcclId::from_bytes(&joined.payload).and_then(|id| {
        NcclCollective::init_watched(&device, &id, env.rank, env.world_size, timeout, &channel)
    });
    match formed {
        Ok(collective) => Ok(DistGroup {
            env,
            device,
            collective,
            channel,
        }),
        Err(e) => {
            if !matches!(e, DistError::PeerFailed { .. }) {
                channel.report(&e);
            }
            channel.finish();
            Err(e)
        }
    }
}
