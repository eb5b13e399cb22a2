//! [`init_from_env`]: the whole bootstrap in one call.

use std::time::Duration;

use offload_cuda::CudaDevice;

use crate::{DistEnv, DistError, NcclCollective, NcclId, nccl_info, rendezvous};

/// What [`init_from_env`] builds: this process's place, its GPU and its
/// communicator.
#[derive(Debug)]
pub struct DistGroup {
    /// The variables it was built from.
    pub env: DistEnv,
    /// The GPU for `LOCAL_RANK`.
    pub device: CudaDevice,
    /// The communicator (rank `env.rank` of `env.world_size`).
    pub collective: NcclCollective,
}

/// Bootstraps this process into its group, torchrun style:
///
/// 1. fails with [`DistError::NcclUnavailable`] at once (before reading
///    anything else) where the CUDA driver or NCCL is absent, so a machine
///    without a GPU can skip cleanly;
/// 2. reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
///    `MASTER_PORT` ([`DistEnv::from_env`]);
/// 3. makes the device for `LOCAL_RANK` with `device_for_local_rank`
///    (typically `|i| CudaDevice::new(i as i32)`);
/// 4. on rank 0, makes the NCCL unique id; the [`rendezvous()`] hands it to
///    every rank;
/// 5. joins the communicator ([`NcclCollective::init`]).
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
    let device = device_for_local_rank(env.local_rank)?;
    let id = if env.rank == 0 {
        Some(NcclCollective::unique_id()?)
    } else {
        None
    };
    let bytes = rendezvous(&env, id.as_ref().map(NcclId::as_bytes), timeout)?;
    let id = NcclId::from_bytes(&bytes)?;
    let collective = NcclCollective::init(&device, &id, env.rank, env.world_size, timeout)?;
    Ok(DistGroup {
        env,
        device,
        collective,
    })
}
