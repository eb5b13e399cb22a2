//! Capacity planning without a GPU (`offload-sim plan`): the core's
//! device-budget planner ([`offload_core::budget::plan`]) fed with a device
//! profile's link and the simulator's kernel model, so "does this model fit
//! this card, and how fast would it step?" is answered in well under a
//! second, before anything is allocated.
//!
//! Only the DiT(s) stream: the configuration is a budget alone, which
//! selects layerwise offload of the DiT ([`OffloadConfig::device_budget`]).
//! Encoders and VAEs are not offloaded by it and stay resident, so their
//! bytes are part of what the planner counts outside the blocks
//! ([`Capacity::resident_outside_blocks`] lists them).

use offload_core::budget::{
    self, BYTE_SIZE_FORMS, BudgetError, BudgetPlan, ByteSize, PlannerInputs,
};
use offload_core::{OffloadConfig, resolve};
use serde::Serialize;
use serde_json::{Value, json};

use crate::harness::{blocks_of, dit_charges};
use crate::job::{JobError, MAX_TOKENS};
use crate::presets::Preset;
use crate::profile::DeviceProfile;

/// What the default budget leaves of the card's memory for the CUDA context
/// and the caching allocator's slack: 1 GiB. A CUDA context alone takes
/// 300–600 MB on recent drivers (more with lazy module loading off), and the
/// allocator rounds blocks up; a budget of the whole card would plan memory
/// the process cannot have. `--budget` replaces the default outright.
pub const CONTEXT_RESERVE_BYTES: u64 = 1 << 30;

/// Live activation tensors of one DiT block, each `tokens × hidden` bf16, in
/// the activation estimate ([`activation_estimate_bytes`]): the input and
/// the residual (2), q, k and v (3), the MLP's 4·hidden hidden state (4) and
/// the single-stream block's 5·hidden concatenation of attention and MLP
/// (5), plus the attention output and the gated output (2). An estimate, not
/// a measurement: the GPU benchmark measured 0.46 GB for Flux at 4608
/// tokens, where this gives 0.45 GB.
pub const ACTIVATION_TENSORS: u64 = 16;

/// The most `--activation-gb` accepts, GB (a petabyte: beyond any card).
pub const MAX_ACTIVATION_GB: f64 = 1e6;

/// The activation estimate: `tokens × hidden × 2 bytes ×`
/// [`ACTIVATION_TENSORS`].
pub fn activation_estimate_bytes(tokens: u64, hidden: u64) -> u64 {
    tokens * hidden * 2 * ACTIVATION_TENSORS
}

/// What `offload-sim plan` plans.
#[derive(Clone, Debug, Default)]
pub struct PlanArgs {
    /// Preset name.
    pub model: String,
    /// Device profile name.
    pub gpu: String,
    /// Tokens per DiT forward (`None`: the preset's).
    pub tokens: Option<u64>,
    /// The device budget as a [`ByteSize`] string (`None`: the card's memory
    /// less [`CONTEXT_RESERVE_BYTES`]).
    pub budget: Option<String>,
    /// Activation memory, GB (10⁹ bytes), measured elsewhere (`None`:
    /// [`activation_estimate_bytes`]).
    pub activation_gb: Option<f64>,
}

/// A component's bytes that stay on the device outside the streamed blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ResidentPart {
    /// The component's path.
    pub path: String,
    /// What it is (`dit`, `encoder`, `vae`).
    pub role: String,
    /// Its bytes outside the blocks that stream (all of them for a
    /// component that does not stream).
    pub bytes: u64,
}

/// The answer: the planner's inputs and its plan, or why nothing fits.
#[derive(Clone, Debug)]
pub struct Capacity {
    /// Preset.
    pub model: String,
    /// Profile.
    pub gpu: String,
    /// Tokens per DiT forward.
    pub tokens: u64,
    /// Every weight of the pipeline.
    pub weight_bytes: u64,
    /// The weights of the DiT(s).
    pub dit_bytes: u64,
    /// How many DiTs (experts) the pipeline has.
    pub dits: usize,
    /// The card's memory.
    pub memory_bytes: u64,
    /// The budget planned for.
    pub budget_bytes: u64,
    /// What the default budget left out of the card ([`CONTEXT_RESERVE_BYTES`];
    /// `None` with `--budget`).
    pub reserve_bytes: Option<u64>,
    /// Whether `activation_bytes` is the estimate, not a given figure.
    pub activation_estimated: bool,
    /// The hidden size the estimate used.
    pub hidden: u64,
    /// What the planner was given.
    pub inputs: PlannerInputs,
    /// What stays resident outside the streamed blocks, by component: the
    /// planner's non-streamed part.
    pub resident_outside_blocks: Vec<ResidentPart>,
    /// Every DiT's forward with every block resident, seconds: the compute
    /// no plan goes below.
    pub compute_floor_s: f64,
    /// The plan, or why the budget does not hold one.
    pub outcome: Result<BudgetPlan, BudgetError>,
}

impl Capacity {
    /// Whether something streams (false when everything stays resident or
    /// nothing fits).
    pub fn streams(&self) -> bool {
        self.outcome.as_ref().is_ok_and(|p| p.streamed_bytes > 0)
    }

    /// The plan's streamed bytes over the link, each streamed block's copy
    /// latency included, seconds: the transfer no schedule of this plan
    /// goes below (0 when nothing streams).
    pub fn transfer_floor_s(&self) -> Option<f64> {
        let p = self.outcome.as_ref().ok()?;
        let copies = (p.blocks - p.resident_blocks) as f64;
        let latency = if p.streamed_bytes == 0 {
            0.0
        } else {
            copies * self.inputs.copy_latency_s
        };
        Some(p.streamed_bytes as f64 / self.inputs.link_bytes_per_s + latency)
    }

    /// Fails with the planner's error when the budget holds no plan.
    pub fn verdict(&self) -> Result<(), BudgetError> {
        self.outcome.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    /// Everything as JSON: the inputs, the floors, and the plan
    /// ([`BudgetPlan`]'s fields, `null` when nothing fits, `error` then
    /// says why).
    pub fn to_json(&self) -> Value {
        json!({
            "model": self.model,
            "gpu": self.gpu,
            "tokens": self.tokens,
            "weight_bytes": self.weight_bytes,
            "dit_bytes": self.dit_bytes,
            "memory_bytes": self.memory_bytes,
            "budget_bytes": self.budget_bytes,
            "reserve_bytes": self.reserve_bytes,
            "activation_bytes": self.inputs.activation_bytes,
            "activation_estimated": self.activation_estimated,
            "inputs": self.inputs,
            "resident_outside_blocks": self.resident_outside_blocks,
            "compute_floor_s": self.compute_floor_s,
            "transfer_floor_s": self.transfer_floor_s(),
            "fits": self.outcome.is_ok(),
            "minimum_bytes": self.minimum_bytes(),
            "plan": self.outcome.as_ref().ok(),
            "error": self.outcome.as_ref().err().map(ToString::to_string),
        })
    }

    /// The least budget that holds a plan, when the planner said.
    pub fn minimum_bytes(&self) -> Option<u64> {
        match &self.outcome {
            Ok(p) => Some(p.minimum_bytes),
            Err(BudgetError::DoesNotFit { minimum, .. }) => Some(*minimum),
            Err(_) => None,
        }
    }
}

fn bad(flag: &'static str, value: impl ToString, allowed: impl Into<String>) -> JobError {
    JobError::BadFlag {
        flag,
        value: value.to_string(),
        allowed: allowed.into(),
    }
}

/// Checks the flags (every problem a typed [`JobError::BadFlag`], as
/// `offload-sim run` reports them) and plans: the budget, the link and the
/// kernel model of `args.gpu`, the blocks of `args.model`.
pub fn capacity(args: &PlanArgs) -> Result<Capacity, JobError> {
    let preset = Preset::by_name(&args.model).ok_or_else(|| {
        bad(
            "--model",
            &args.model,
            format!("allowed: {}", Preset::NAMES.join(", ")),
        )
    })?;
    let profile = DeviceProfile::by_name(&args.gpu).ok_or_else(|| {
        let names: Vec<&str> = DeviceProfile::all().iter().map(|p| p.name).collect();
        bad("--gpu", &args.gpu, format!("allowed: {}", names.join(", ")))
    })?;
    let tokens = args.tokens.unwrap_or(preset.default_tokens);
    if !(1..=MAX_TOKENS).contains(&tokens) {
        return Err(bad(
            "--tokens",
            tokens,
            format!("allowed: 1 to {MAX_TOKENS}"),
        ));
    }
    let (budget_bytes, reserve_bytes) = match &args.budget {
        None => {
            let reserve = CONTEXT_RESERVE_BYTES.min(profile.memory_bytes / 2);
            (profile.memory_bytes - reserve, Some(reserve))
        }
        Some(text) => {
            let b = ByteSize::parse(text)
                .map_err(|_| bad("--budget", text, format!("allowed: {BYTE_SIZE_FORMS}")))?;
            if b.0 > profile.memory_bytes {
                return Err(bad(
                    "--budget",
                    text,
                    format!(
                        "allowed: at most the {}'s memory, {} bytes ({:.2} GB)",
                        profile.name,
                        profile.memory_bytes,
                        profile.memory_bytes as f64 / 1e9
                    ),
                ));
            }
            (b.0, None)
        }
    };
    let hidden = preset.block_cost.hidden;
    let (activation_bytes, activation_estimated) = match args.activation_gb {
        None => (activation_estimate_bytes(tokens, hidden), true),
        Some(gb) if gb.is_finite() && (0.0..=MAX_ACTIVATION_GB).contains(&gb) => {
            ((gb * 1e9).round() as u64, false)
        }
        Some(gb) => {
            return Err(bad(
                "--activation-gb",
                gb,
                format!("allowed: 0 to {MAX_ACTIVATION_GB} (GB, 10^9 bytes)"),
            ));
        }
    };

    let p = &preset.pipeline;
    let charges = dit_charges(&preset, p, &profile, tokens);
    let dit_ids: Vec<_> = preset.dits.iter().filter_map(|d| p.module_id(d)).collect();
    let mut block_compute_s = std::collections::BTreeMap::new();
    let mut non_block_s = 0.0;
    for &dit in &dit_ids {
        non_block_s += charges[&dit].duration_ns as f64 * 1e-9;
        for b in blocks_of(p, dit) {
            block_compute_s.insert(
                p.module(b).path.clone(),
                charges[&b].duration_ns as f64 * 1e-9,
            );
        }
    }
    // The planner charges `other_compute_s` once per stack, and each DiT is
    // one stack (its containers concatenated): the mean keeps the sum exact.
    let other_compute_s = non_block_s / dit_ids.len().max(1) as f64;
    let compute_floor_s = non_block_s + block_compute_s.values().sum::<f64>();
    let inputs = PlannerInputs {
        link_bytes_per_s: profile.h2d_pinned_gbps * 1e9,
        copy_latency_s: profile.copy_latency_us * 1e-6,
        block_compute_s,
        compute_s_per_byte: 0.0,
        other_compute_s,
        activation_bytes,
        max_depth: PlannerInputs::default().max_depth,
        copy_interference: profile.copy_interference,
    };
    let config = OffloadConfig {
        device_budget: Some(ByteSize(budget_bytes).into()),
        ..OffloadConfig::default()
    };
    let outcome = budget::plan(p, &config, &inputs);
    Ok(Capacity {
        model: preset.name.to_owned(),
        gpu: profile.name.to_owned(),
        tokens,
        weight_bytes: preset.weight_bytes(),
        dit_bytes: dit_ids.iter().map(|&d| p.subtree_bytes(d)).sum(),
        dits: dit_ids.len(),
        memory_bytes: profile.memory_bytes,
        budget_bytes,
        reserve_bytes,
        activation_estimated,
        hidden,
        inputs,
        resident_outside_blocks: resident_outside_blocks(&preset, &config),
        compute_floor_s,
        outcome,
    })
}

/// What a budget-only configuration keeps on the device outside the
/// streamed blocks, by component: the streamed components' bytes outside
/// their blocks, and every other component whole (encoders, VAEs).
fn resident_outside_blocks(preset: &Preset, config: &OffloadConfig) -> Vec<ResidentPart> {
    let p = &preset.pipeline;
    let Ok(resolved) = resolve(p, config) else {
        // The planner resolves the same configuration and reports why.
        return Vec::new();
    };
    resolved
        .components
        .iter()
        .map(|c| {
            let streamed: u64 = resolved
                .stacks
                .iter()
                .filter(|s| s.owner == c.path)
                .flat_map(|s| &s.blocks)
                .map(|b| b.bytes)
                .sum();
            ResidentPart {
                path: c.path.clone(),
                role: c.role.to_string(),
                bytes: c.bytes.saturating_sub(streamed),
            }
        })
        .filter(|r| r.bytes > 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(model: &str, gpu: &str) -> PlanArgs {
        PlanArgs {
            model: model.to_owned(),
            gpu: gpu.to_owned(),
            ..PlanArgs::default()
        }
    }

    /// The activation estimate gives the 0.46 GB the GPU benchmark measured
    /// for Flux at 4608 tokens, to 2 %.
    #[test]
    fn activation_estimate_matches_the_flux_measurement() {
        let b = activation_estimate_bytes(4608, 3072) as f64;
        assert!((b / 0.46e9 - 1.0).abs() < 0.02, "{b}");
    }

    /// Every block the planner sees has a compute time from the kernel
    /// model (none falls back to the per-byte rate), and the encoders and
    /// the VAE are in the non-streamed part.
    #[test]
    fn every_planned_block_is_timed_and_the_rest_is_resident() {
        for model in Preset::NAMES {
            let c = capacity(&args(model, "h200")).unwrap();
            let preset = Preset::by_name(model).unwrap();
            let config = OffloadConfig {
                device_budget: Some(ByteSize(c.budget_bytes).into()),
                ..OffloadConfig::default()
            };
            let resolved = resolve(&preset.pipeline, &config).unwrap();
            assert_eq!(resolved.stacks.len(), c.dits, "{model}: one stack per DiT");
            for b in resolved.stacks.iter().flat_map(|s| &s.blocks) {
                let t = c.inputs.block_compute_s.get(&b.path);
                assert!(t.is_some_and(|t| *t > 0.0), "{model}: {} untimed", b.path);
            }
            let plan = c.outcome.as_ref().unwrap();
            let listed: u64 = c.resident_outside_blocks.iter().map(|r| r.bytes).sum();
            assert_eq!(listed, plan.non_streamed_bytes, "{model}");
            for e in preset.encoders.iter().chain(&preset.vaes) {
                assert!(
                    c.resident_outside_blocks.iter().any(|r| r.path == *e),
                    "{model}: {e} not listed"
                );
            }
        }
    }
}
