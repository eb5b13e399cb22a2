//! The device budget (CONTRACT §7a): a planner that, before anything is
//! allocated, plans a whole request (its encoders once, `steps` denoising
//! forwards, its VAE once) under a device budget, and says why.
//!
//! For each component it chooses one of three modes ([`ComponentMode`]):
//! resident for the whole request; swapped in for its forward (model level);
//! or streamed through a ring of slots with some blocks resident
//! (layerwise: an encoder's block stack too, so a 9.5 GB T5 need not fit
//! at once). A component's *held* set (its weights outside its blocks and
//! its resident blocks) is on the device during its own phase; if the
//! component is *kept*, across every phase. While another component runs,
//! a component that is not kept is evicted, and brought back when its
//! phase begins (its copy counted once per request). A phase that streams
//! has its own slots (`depth + 1` of its largest streamed block), allocated
//! when it begins and freed when a phase that does not need them begins.
//!
//! Each phase's peak is `outside + kept sets of the others + held + slots
//! + activations` (`outside`: weights in no component, always resident;
//! activations: what the phase's forward needs beside its weights, from the
//! warm-up). The planner minimises the predicted request time (each
//! streaming phase by the ring recurrence of [`ring`]) with every phase's
//! peak within the budget. The least budget any plan needs is the largest
//! phase's own minimum, and a smaller budget fails naming it and its parts
//! ([`BudgetError::DoesNotFit`]).
//!
//! [`plan`] is pure: a function of the pipeline, the configuration, the
//! [`PlannerInputs`] (measured, reloaded or given) and the device's memory.
//! Nothing here names a device.

pub mod host;
mod ring;
mod search;
mod types;

pub use crate::bytes::{BYTE_SIZE_FORMS, ByteSize, DEFAULT_HEADROOM, DeviceBudget, HostBudget};
use crate::config::OffloadConfig;
pub use crate::measurements::{ComponentInputs, InputSource, PlannerInputs};
use crate::model::Pipeline;
use crate::plan::PlanError;
pub use host::{HostBlock, HostLimits, HostPlan, StageReason, host_limits, plan_host};
pub(crate) use ring::check_max_depth;
pub use ring::{
    CompressionChoice, DECODE_INTERFERENCE, DecodeStage, HostStage, Lookahead,
    MAX_DECODE_INTERFERENCE, RingShape, StagedForecast, StagedRing, choose_compression,
    choose_lookahead, choose_staged_lookahead, copies_exposed, forecast_staged, forward_ends,
    forwards_s, hidden_choice, hosted_ends, predict_step, staged_ends, steady_s,
};
pub use search::{
    Evaluation, Evaluator, PAST_LIMIT_PART_SAID, PhaseEvaluation, Stack,
    checked_decode_interference, decode_interference, evaluate, smallest_footprint,
    smallest_footprint_within,
};
pub use types::{
    Alternative, BudgetError, BudgetSource, ComponentChoice, ComponentMode, ComponentPlan,
    DeviceMemory, HostSide, Limit, MinimumBudget, PastLimit, PeakParts, RequestPlan,
};

/// The budget `config` states for `device`: a size (at most the device's
/// memory), or `"auto"`: the device's free memory less `device_headroom`.
/// (See [`DeviceBudget::size_of`] for the budget as errors write it.)
pub fn resolve_budget(
    config: &OffloadConfig,
    device: DeviceMemory,
) -> Result<(u64, BudgetSource), BudgetError> {
    match config.device_budget {
        None => Err(BudgetError::NoBudget {
            forms: crate::bytes::DEVICE_BUDGET_FORMS,
        }),
        Some(DeviceBudget::Bytes(b)) => {
            if b.bytes() > device.total_bytes {
                return Err(BudgetError::AboveDevice {
                    budget: b,
                    device_bytes: device.total_bytes,
                    device_gib: device.total_bytes as f64 / f64::from(1u32 << 30),
                });
            }
            Ok((b.bytes(), BudgetSource::Given))
        }
        Some(DeviceBudget::Auto) => {
            let written = config.device_headroom.unwrap_or(DEFAULT_HEADROOM);
            let headroom = written.bytes();
            let free = device.free_bytes.min(device.total_bytes);
            if free <= headroom {
                return Err(BudgetError::NoRoom {
                    free_bytes: free,
                    headroom: written,
                });
            }
            Ok((
                free - headroom,
                BudgetSource::Auto {
                    free_bytes: free,
                    headroom_bytes: headroom,
                },
            ))
        }
    }
}

/// Plans `config`'s `device_budget` for a request of `pipeline` on a device
/// of `device` memory, from `inputs`: see the module docs.
///
/// Fails before anything is allocated: when the configuration does not
/// select the planned strategy or does not resolve, when the inputs are
/// unusable (typed, naming the input), when the budget exceeds the device,
/// or when it is below the least any plan needs
/// ([`BudgetError::DoesNotFit`] names it and its parts).
///
/// With a `host_budget`, the plan fits it too ([`plan_within`]): a size is
/// taken as written; `"auto"` reads this machine ([`host_limits`]), the one
/// thing this function reads beyond its arguments.
pub fn plan(
    pipeline: &Pipeline,
    config: &OffloadConfig,
    inputs: &PlannerInputs,
    device: DeviceMemory,
) -> Result<RequestPlan, BudgetError> {
    let host = config_host_limits(config)?;
    plan_within(pipeline, config, inputs, device, host)
}

/// The host budget `config` states, read on this machine for `"auto"`.
pub fn config_host_limits(config: &OffloadConfig) -> Result<Option<HostLimits>, BudgetError> {
    config
        .host_budget
        .map(|b| {
            host_limits(b, &host::ProcProbe::default()).map_err(|e| BudgetError::Input {
                input: "host_budget".to_owned(),
                value: format!("\"{b}\""),
                allowed: format!("a size on this machine ({e})"),
            })
        })
        .transpose()
}

/// [`plan`] within `host`, a host budget already resolved (a backend reads
/// `"auto"` once at enable and plans every re-plan within what it read):
/// every held unit keeps a pinned master, streamed blocks are pinned as the
/// budget allows and the rest staged ([`HostSide`]); the plan's held sets
/// are chosen so that the whole fits. Fails with
/// [`BudgetError::HostDoesNotFit`] below the least host budget any plan
/// needs, and [`BudgetError::NoPlanFitsBoth`] where each budget alone has
/// a plan but none fits both.
pub fn plan_within(
    pipeline: &Pipeline,
    config: &OffloadConfig,
    inputs: &PlannerInputs,
    device: DeviceMemory,
    host: Option<HostLimits>,
) -> Result<RequestPlan, BudgetError> {
    let selection = config
        .select()
        .map_err(|e| BudgetError::Plan(PlanError::Config(e)))?;
    if selection.strategy != crate::config::OffloadStrategy::Planned {
        return Err(BudgetError::NoBudget {
            forms: crate::bytes::DEVICE_BUDGET_FORMS,
        });
    }
    let (budget, source) = resolve_budget(config, device)?;
    search::plan_request(pipeline, config, inputs, budget, source, device, host)
}
