//! The request planner's test pipelines and inputs, shared by
//! `tests/budget.rs`, `tests/budget_edges.rs`, `tests/planned_decode.rs`
//! and `tests/planner_threads.rs`.

use offload_core::budget::{
    BudgetError, ComponentInputs, DeviceMemory, PlannerInputs, RequestPlan, plan_within,
};
use offload_core::bytes::ByteSize;
use offload_core::config::WeightCompression;
use offload_core::discovery::Role;
use offload_core::model::{DType, Pipeline, PipelineBuilder};
use offload_core::{ComponentDeclaration, OffloadConfig, resolve};

/// A pipeline: a DiT of `double` blocks (block `i` of width
/// `double_width(i)`) and `single` of width `h2` with `extra` bytes outside
/// its blocks; a text encoder of `layers` blocks of width `he` (none for
/// 0); a VAE of `vae` bytes (none for 0); `outside` bytes in a module of no
/// component.
pub fn pipeline(
    (double, double_width, single, h2, extra): (usize, &dyn Fn(usize) -> u64, usize, u64, u64),
    (layers, he): (usize, u64),
    vae: u64,
    outside: u64,
) -> Pipeline {
    let mut b = PipelineBuilder::new("Budget");
    if layers > 0 {
        let mut e = b.module("text_encoder");
        e.parameter("embed.weight", DType::Bf16, &[64, 4]);
        e.list("layers", layers, |_, l| {
            l.parameter("fc.weight", DType::Bf16, &[3 * he, he]);
        });
        e.block_containers(&["layers"]);
    }
    {
        let mut m = b.module("transformer");
        m.parameter("x_embedder.weight", DType::Bf16, &[extra.max(1), 1]);
        m.list("transformer_blocks", double, |i, blk| {
            let h = double_width(i);
            blk.parameter("qkv.weight", DType::Bf16, &[3 * h, h])
                .parameter("ff.weight", DType::Bf16, &[4 * h, h]);
        });
        m.list("single_transformer_blocks", single, |_, blk| {
            blk.parameter("mlp.weight", DType::Bf16, &[5 * h2, h2]);
        });
        m.block_containers(&["transformer_blocks", "single_transformer_blocks"]);
    }
    if vae > 0 {
        b.module("vae")
            .parameter("conv.weight", DType::Bf16, &[vae.div_ceil(2), 1]);
    }
    if outside > 0 {
        b.module("scheduler_table")
            .parameter("table", DType::Bf16, &[outside.div_ceil(2), 1]);
    }
    b.declare_components(ComponentDeclaration {
        dit: vec!["transformer".into()],
        encoder: if layers > 0 {
            vec!["text_encoder".into()]
        } else {
            vec![]
        },
        vae: if vae > 0 { vec!["vae".into()] } else { vec![] },
        resident: vec![],
    });
    b.build().expect("the test pipeline builds")
}

/// `{"device_budget": bytes}` alone.
pub fn budget_config(bytes: u64) -> OffloadConfig {
    OffloadConfig {
        device_budget: Some(ByteSize::new(bytes).into()),
        ..OffloadConfig::default()
    }
}

/// The H100's saved planner inputs for Flux.1-dev at 4,608 tokens × 28
/// steps (its 2026-12-05 19:13 UTC call under `"auto"`; no measured
/// decode figure).
pub fn h100_flux_inputs() -> PlannerInputs {
    serde_json::from_str(include_str!(
        "../fixtures/h100-flux1-dev-4608-auto-inputs.json"
    ))
    .expect("the fixture is saved planner inputs")
}

/// The simulator's Flux.1-dev planned from `inputs` within `budget` bytes
/// under `compression`, the device itself unbounded.
pub fn plan_flux(
    inputs: &PlannerInputs,
    budget: u64,
    compression: WeightCompression,
) -> Result<RequestPlan, BudgetError> {
    plan_within(
        &offload_sim::presets::flux1_dev().pipeline,
        &OffloadConfig {
            weight_compression: Some(compression),
            ..budget_config(budget)
        },
        inputs,
        DeviceMemory::of(u64::MAX / 4),
        None,
    )
}

/// Inputs for every component of `p`: compute per block from `compute`
/// (cycled), activations from `act` (cycled), the DiT once per step.
pub fn inputs(p: &Pipeline, link: f64, steps: u32, compute: &[f64], act: &[u64]) -> PlannerInputs {
    let resolved = resolve(p, &budget_config(1)).expect("the test pipeline resolves");
    let mut inputs = PlannerInputs::new(link, steps);
    let mut k = 0;
    for (i, c) in resolved.components.iter().enumerate() {
        let mut ci = ComponentInputs::new(1.0, c.role == Role::Dit, act[i % act.len()]);
        ci.own_compute_s = compute[(i * 7) % compute.len()] / 4.0;
        for s in resolved.stacks.iter().filter(|s| s.owner == c.path) {
            for b in &s.blocks {
                ci.block_compute_s
                    .insert(b.path.clone(), compute[k % compute.len()]);
                k += 1;
            }
        }
        inputs.components.insert(c.path.clone(), ci);
    }
    inputs
}

/// A planned simulator run at a budget that may be below the least: its
/// outcome, or `None` where `enable` refused it as not fitting (any other
/// failure panics, naming `at`).
pub fn fitting(
    run: Result<offload_sim::harness::RunOutcome, offload_sim::harness::RunFailure>,
    at: &str,
) -> Option<offload_sim::harness::RunOutcome> {
    match run {
        Ok(out) => Some(out),
        Err(f) if f.error.to_string().contains("does not fit") => None,
        Err(f) => panic!("{at}: {}", f.error),
    }
}

/// Whether some phase of `out` went over the budget on the device's own
/// count of memory in use (the allocator's chunks and the page tables
/// beside the allocations: CONTRACT §7a), as INV-7's per-phase check
/// reports it.
pub fn over_the_devices_count(out: &offload_sim::harness::RunOutcome) -> bool {
    offload_sim::job::phase_violations(out)
        .is_some_and(|v| v.to_string().contains("the device counts"))
}

/// The error a simulated allocation that ran `bytes` short returns, as a
/// request sees it: what `Runtime::replan_after` re-plans from.
pub fn out_of_memory(bytes: u64) -> offload_core::OffloadError {
    offload_core::OffloadError::device(
        "alloc_activations",
        offload_sim::device::SimError {
            operation: "alloc_activations".into(),
            kind: offload_core::device::DeviceErrorKind::OutOfMemory,
            detail: "planted".into(),
            shortfall_bytes: Some(bytes),
        },
    )
}

/// `{"device_budget": device}` with `host_budget` = `host` bytes where
/// given (CONTRACT §7c).
pub fn budgets(device: u64, host: Option<u64>) -> OffloadConfig {
    OffloadConfig {
        host_budget: host.map(|b| offload_core::bytes::HostBudget::Bytes(ByteSize::new(b))),
        ..budget_config(device)
    }
}

/// A host budget of `bytes`, as `host_budget = "<bytes>B"` gives.
pub fn limits(bytes: u64) -> offload_core::budget::HostLimits {
    offload_core::budget::HostLimits {
        budget: bytes,
        source: format!("host_budget = \"{bytes}B\""),
        readings: None,
    }
}

/// The least device budget the planner accepts for `w` (from its typed
/// error).
pub fn least_device(w: &offload_sim::harness::Workload, inputs: &PlannerInputs) -> u64 {
    let device = DeviceMemory::of(u64::MAX / 4);
    match plan_within(&w.preset.pipeline, &budgets(1, None), inputs, device, None) {
        Err(BudgetError::DoesNotFit { minimum, .. }) => minimum,
        other => panic!("a 1-byte device budget: {other:?}"),
    }
}

/// The least host budget a warm-up of `w` accepts (it keeps nothing; from
/// its typed error).
pub fn warmup_least_host(w: &offload_sim::harness::Workload) -> u64 {
    let limits = Some(limits(1));
    let config = budgets(1, Some(1));
    match offload_core::budget::smallest_footprint_within(&w.preset.pipeline, &config, limits) {
        Err(BudgetError::WarmupHostDoesNotFit { least, .. }) => least,
        other => panic!("a 1-byte host budget: {other:?}"),
    }
}

/// The least host budget the planner accepts for `w` within a device
/// budget of `device_budget` (from its typed error).
pub fn least_host(
    w: &offload_sim::harness::Workload,
    inputs: &PlannerInputs,
    device_budget: u64,
) -> u64 {
    let device = DeviceMemory::of(u64::MAX / 4);
    let config = budgets(device_budget, Some(1));
    match plan_within(&w.preset.pipeline, &config, inputs, device, Some(limits(1))) {
        Err(BudgetError::HostDoesNotFit { least, .. }) => least,
        other => panic!("a 1-byte host budget: {other:?}"),
    }
}
