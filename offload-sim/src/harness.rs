//! Runs a workload (requests of encode → denoise steps → decode) through a
//! strategy on a [`SimDevice`], and measures what the main job reports.
//! Every kernel reads every byte of the weights it uses into a checksum, so
//! an offloaded run's outputs can be compared bit for bit with the resident
//! run's (INV-8).

use std::collections::BTreeSet;
use std::sync::Arc;

use offload_core::device::Device;
use offload_core::invariants::Violation;
use offload_core::lifecycle::{OffloadError, get_offload_backend};
use offload_core::model::{ModuleId, TensorId, TensorKind};
use offload_core::runtime::{Backend, CorePlatform, PlantedBug, Runtime, Scope};
use offload_core::{OffloadConfig, OffloadStrategy};

use crate::device::{Sim, SimConfig, SimDevice, SimStats};
use crate::faults::FaultPlan;
use crate::presets::{Preset, SyntheticWeights};
use crate::profile::DeviceProfile;
use crate::trace::Trace;

/// What to run.
#[derive(Clone, Debug)]
pub struct Workload {
    /// The pipeline and its costs.
    pub preset: Preset,
    /// Tokens per DiT forward.
    pub tokens: u64,
    /// Denoising steps per request.
    pub steps: usize,
    /// Requests (the first is a warm-up and is not timed).
    pub requests: usize,
}

/// Which strategy.
#[derive(Clone, Debug)]
pub enum StrategyChoice {
    /// Every weight resident (the baseline).
    Resident,
    /// What a configuration selects.
    Config(OffloadConfig),
}

impl StrategyChoice {
    /// The choice for `strategy` by its flag.
    pub fn strategy(strategy: OffloadStrategy) -> Self {
        let mut c = OffloadConfig::default();
        match strategy {
            OffloadStrategy::None => return Self::Resident,
            OffloadStrategy::ModelLevel => c.enable_cpu_offload = true,
            OffloadStrategy::Layerwise => c.enable_layerwise_offload = true,
            OffloadStrategy::DistributedLayerwise => c.enable_distributed_layerwise_offload = true,
        }
        Self::Config(c)
    }
}

/// How to run it.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The device's physics.
    pub profile: DeviceProfile,
    /// Layerwise prefetch depth.
    pub prefetch_depth: usize,
    /// Keep one payload byte in this many (1 = all).
    pub payload_divisor: u64,
    /// Faults to inject.
    pub faults: FaultPlan,
    /// Weight seed.
    pub seed: u64,
    /// Bugs to plant (tests only; ignored without the `planted-bugs` feature).
    pub bugs: Vec<PlantedBug>,
}

impl RunOptions {
    /// Defaults on `profile`: depth 1, all payload bytes, no faults.
    pub fn new(profile: DeviceProfile) -> Self {
        Self {
            profile,
            prefetch_depth: 1,
            payload_divisor: 1,
            faults: FaultPlan::none(),
            seed: 0,
            bugs: Vec::new(),
        }
    }
}

/// One request's measurements.
#[derive(Clone, Debug, Default)]
pub struct RequestMeasure {
    /// Checksum of every kernel of the request, in order.
    pub output: u64,
    /// Virtual time of the denoising phase, ns.
    pub denoise_ns: u64,
    /// Host→device bytes during denoising.
    pub denoise_h2d_bytes: u64,
    /// Time compute waited on events during denoising, ns.
    pub denoise_wait_ns: u64,
    /// Bytes of the DiT blocks forwarded during denoising.
    pub block_bytes: u64,
    /// Bytes of the distinct DiTs used.
    pub dit_bytes: u64,
    /// DiT FLOPs of the request.
    pub dit_flops: f64,
}

/// Everything one run measured.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    /// The strategy that ran.
    pub strategy: OffloadStrategy,
    /// Per request.
    pub requests: Vec<RequestMeasure>,
    /// Virtual time `enable` took, ns.
    pub enable_ns: u64,
    /// Counters after enable.
    pub after_enable: SimStats,
    /// Counters at the end (before disable).
    pub at_end: SimStats,
    /// Device weight bytes the backend reported after enable.
    pub device_weight_bytes: u64,
    /// Host weight bytes the backend reported after enable.
    pub host_weight_bytes: u64,
    /// Largest block bytes of the plan (0 without stacks).
    pub largest_block_bytes: u64,
    /// Non-block resident bytes (for the INV-7 bound).
    pub non_block_bytes: u64,
    /// Every checker violation, including leaks after disable.
    pub violations: Vec<Violation>,
    /// The timeline.
    pub trace: Trace,
}

fn parameters(p: &offload_core::Pipeline, m: ModuleId) -> u64 {
    p.subtree_tensors(m)
        .into_iter()
        .map(|t| p.tensor(t))
        .filter(|t| t.kind == TensorKind::Parameter)
        .map(|t| t.numel())
        .sum()
}

/// The block modules of `module` in forward order (its declared containers).
pub fn blocks_of(p: &offload_core::Pipeline, module: ModuleId) -> Vec<ModuleId> {
    let m = p.module(module);
    let containers = m
        .block_containers
        .clone()
        .or_else(|| m.deprecated_block_container.clone().map(|c| vec![c]))
        .unwrap_or_default();
    containers
        .iter()
        .filter_map(|c| p.module_id(&format!("{}.{c}", m.path)))
        .flat_map(|list| p.module(list).children.clone())
        .collect()
}

/// A kernel reading `tensors` through `scope`.
fn kernel(
    scope: &Scope<'_, Sim>,
    tensors: &[TensorId],
    flops: f64,
    name: &str,
) -> Result<u64, OffloadError> {
    let views = tensors
        .iter()
        .map(|t| scope.view_id(*t))
        .collect::<Result<Vec<_>, _>>()?;
    let inputs: Vec<(&crate::device::SimDeviceBuffer, std::ops::Range<u64>)> =
        views.iter().map(|v| (v.buffer(), v.byte_range())).collect();
    let device: &SimDevice = scope.device();
    device
        .compute(scope.stream(), &inputs, flops, name)
        .map_err(|e| OffloadError::DeviceOp {
            operation: format!("compute `{name}`"),
            cause: Box::new(e),
        })
}

/// The forward of one component: its own tensors, then each block in a
/// child scope. Returns the checksums folded, the block bytes and the flops
/// (zeros when a hook skipped it).
pub fn component_forward(
    rt: &Runtime<Sim>,
    path: &str,
    tokens: u64,
    block_flops: impl Fn(u64) -> f64,
) -> Result<(u64, u64, f64), OffloadError> {
    let out = rt.forward(path, |scope| {
        let p = scope.pipeline();
        let module = scope.module();
        let blocks = blocks_of(p, module);
        let in_blocks: BTreeSet<TensorId> =
            blocks.iter().flat_map(|b| p.subtree_tensors(*b)).collect();
        let own: Vec<TensorId> = p
            .subtree_tensors(module)
            .into_iter()
            .filter(|t| !in_blocks.contains(t))
            .collect();
        let own_flops =
            2.0 * own.iter().map(|t| p.tensor(*t).numel()).sum::<u64>() as f64 * tokens as f64;
        let mut sum = kernel(scope, &own, own_flops, &format!("{path} (non-block)"))?;
        let (mut bytes, mut flops) = (0u64, own_flops);
        for b in blocks {
            let bpath = p.module(b).path.clone();
            let rel = bpath[path.len() + 1..].to_owned();
            let params = parameters(p, b);
            let f = block_flops(params);
            let tensors = p.subtree_tensors(b);
            let r = scope.child(&rel, |blk| Ok(kernel(blk, &tensors, f, &bpath)?))?;
            if let Some(r) = r {
                sum = fold(sum, r);
                bytes += p.subtree_bytes(b);
                flops += f;
            }
        }
        Ok((sum, bytes, flops))
    })?;
    Ok(out.unwrap_or((0, 0, 0.0)))
}

fn fold(a: u64, b: u64) -> u64 {
    (a ^ b).wrapping_mul(0x100_0000_01b3).rotate_left(17)
}

/// One request: encoders, `w.steps` DiT forwards (two experts split the
/// steps), VAEs; times the denoising phase.
pub fn request(
    rt: &Runtime<Sim>,
    device: &SimDevice,
    w: &Workload,
) -> Result<RequestMeasure, OffloadError> {
    let preset = &w.preset;
    let mut m = RequestMeasure::default();
    let mut out = 0u64;
    for enc in &preset.encoders {
        let t = preset.text_tokens;
        let (s, _, _) = component_forward(rt, enc, t, |params| 2.0 * params as f64 * t as f64)?;
        out = fold(out, s);
    }
    device.synchronize_all();
    let (t0, s0, wait0) = (
        device.host_now_ns(),
        device.stats(),
        device.waited_ns(rt.compute_stream()),
    );
    let hidden = preset.block_cost.hidden as f64;
    let tokens = w.tokens as f64;
    let attention = if preset.block_cost.attention {
        4.0 * tokens * tokens * hidden
    } else {
        0.0
    };
    let mut used = BTreeSet::new();
    for step in 0..w.steps {
        let dit = if preset.dits.len() > 1 && step >= w.steps / 2 {
            preset.dits[1]
        } else {
            preset.dits[0]
        };
        used.insert(dit);
        let (s, bytes, flops) = component_forward(rt, dit, w.tokens, |params| {
            2.0 * params as f64 * tokens + attention
        })?;
        out = fold(out, s);
        m.block_bytes += bytes;
        m.dit_flops += flops;
    }
    device.synchronize_all();
    let s1 = device.stats();
    m.denoise_ns = device.host_now_ns() - t0;
    m.denoise_h2d_bytes = s1.h2d_bytes - s0.h2d_bytes;
    m.denoise_wait_ns = device.waited_ns(rt.compute_stream()) - wait0;
    let p = &rt.model().pipeline;
    m.dit_bytes = used
        .iter()
        .filter_map(|d| p.module_id(d))
        .map(|d| p.subtree_bytes(d))
        .sum();
    for vae in &preset.vaes {
        let flops = preset.vae_flops;
        let r = rt.forward(vae, |scope| {
            let tensors = scope.pipeline().subtree_tensors(scope.module());
            Ok(kernel(scope, &tensors, flops, vae)?)
        })?;
        out = fold(out, r.unwrap_or(0));
    }
    device.synchronize_all();
    m.output = out;
    Ok(m)
}

/// A simulated device, a runtime on it and a platform building backends
/// for it: what a scenario test drives step by step.
pub struct Rig {
    /// The device (shared with the runtime).
    pub device: SimDevice,
    /// The runtime.
    pub runtime: Runtime<Sim>,
    /// Builds backends on the device.
    pub platform: CorePlatform<Sim>,
}

impl Rig {
    /// A fresh device with `pipeline` and synthetic weights of `opts.seed`.
    pub fn new(pipeline: offload_core::Pipeline, opts: &RunOptions) -> Result<Self, OffloadError> {
        let device = SimDevice::new(SimConfig {
            profile: opts.profile.clone(),
            payload_divisor: opts.payload_divisor,
            faults: opts.faults,
        });
        let dev = Arc::new(device.clone());
        let compute = Arc::new(dev.create_stream().map_err(|e| OffloadError::DeviceOp {
            operation: "create_stream".to_owned(),
            cause: Box::new(e),
        })?);
        let weights = Arc::new(SyntheticWeights { seed: opts.seed });
        let platform = CorePlatform::<Sim>::new(
            format!("sim:{}", opts.profile.name),
            Arc::clone(&dev),
            Arc::clone(&compute),
            weights,
        )
        .with_prefetch_depth(opts.prefetch_depth);
        #[cfg(feature = "planted-bugs")]
        let platform = platform.with_planted_bugs(&opts.bugs);
        let runtime = Runtime::new(dev, compute, pipeline);
        Ok(Self {
            device,
            runtime,
            platform,
        })
    }

    /// The backend `choice` selects (with `opts.bugs` planted).
    pub fn backend(
        &self,
        choice: &StrategyChoice,
        opts: &RunOptions,
    ) -> Result<Box<dyn Backend<Sim>>, OffloadError> {
        let backend: Box<dyn Backend<Sim>> = match choice {
            StrategyChoice::Resident => self.platform.resident()?,
            StrategyChoice::Config(config) => match get_offload_backend(config, &self.platform)? {
                Some(b) => b,
                None => self.platform.resident()?,
            },
        };
        plant(backend, &opts.bugs, &self.platform, choice)
    }
}

/// Runs `w` with `choice` on a fresh simulated device.
pub fn run(
    w: &Workload,
    choice: &StrategyChoice,
    opts: &RunOptions,
) -> Result<RunOutcome, OffloadError> {
    let mut rig = Rig::new(w.preset.pipeline.clone(), opts)?;
    let backend = rig.backend(choice, opts)?;
    let device = rig.device.clone();
    let rt = &mut rig.runtime;
    let strategy = backend.strategy();
    let t0 = device.host_now_ns();
    rt.enable(backend).map_err(|(e, _)| e)?;
    device.synchronize_all();
    let enable_ns = device.host_now_ns() - t0;
    let after_enable = device.stats();
    let b = rt.backend().expect("enabled");
    let (device_weight_bytes, host_weight_bytes) = (b.device_weight_bytes(), b.host_weight_bytes());

    let (largest_block_bytes, non_block_bytes) = plan_facts(&w.preset, choice);
    let mut requests = Vec::new();
    let mut failure = None;
    for _ in 0..w.requests {
        match request(rt, &device, w) {
            Ok(m) => requests.push(m),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let at_end = device.stats();
    let disabled = rt.disable();
    drop(rig);
    device.check_released();
    if let Some(e) = failure {
        return Err(e);
    }
    disabled?;
    Ok(RunOutcome {
        strategy,
        requests,
        enable_ns,
        after_enable,
        at_end,
        device_weight_bytes,
        host_weight_bytes,
        largest_block_bytes,
        non_block_bytes,
        violations: device.violations(),
        trace: device.trace(),
    })
}

/// Largest block and non-block bytes of the layerwise plan of the preset.
fn plan_facts(preset: &Preset, choice: &StrategyChoice) -> (u64, u64) {
    let config = match choice {
        StrategyChoice::Config(c) => c.clone(),
        StrategyChoice::Resident => OffloadConfig::default(),
    };
    match offload_core::resolve(&preset.pipeline, &config) {
        Ok(plan) if !plan.stacks.is_empty() => {
            let total: u64 = preset.pipeline.storages().map(|(_, s)| s.bytes).sum();
            let blocks: u64 = plan
                .stacks
                .iter()
                .flat_map(|s| &s.blocks)
                .map(|b| b.bytes)
                .sum();
            (plan.largest_block_bytes(), total - blocks)
        }
        _ => (0, 0),
    }
}

/// TEMP: bugs are planted platform-wide in [`Rig::new`].
fn plant(
    backend: Box<dyn Backend<Sim>>,
    _: &[PlantedBug],
    _: &CorePlatform<Sim>,
    _: &StrategyChoice,
) -> Result<Box<dyn Backend<Sim>>, OffloadError> {
    Ok(backend)
}
