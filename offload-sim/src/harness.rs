//! Runs a workload (requests of encode → denoise steps → decode) through a
//! strategy on a [`SimDevice`], and measures what the main job reports.
//! Every kernel reads every byte of the weights it uses and folds a
//! checksum into the request's output on the device, in the order the
//! kernels run, so an offloaded run's outputs can be compared bit for bit
//! with the resident run's (INV-8), and a kernel that read a slot before its
//! fill landed changes the output.
//!
//! The harness synchronises only where a runtime would, through the same
//! device API: once per request, to read its output back, and, where
//! [`RunOptions::step_sync`] asks (a caller that times each step, as
//! `offload-bench` does), after each denoising step. Phases are timed with
//! events, never by draining the device.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use offload_core::device::Device;
use offload_core::invariants::Violation;
use offload_core::lifecycle::{LifecycleState, OffloadError};
use offload_core::model::{ModuleId, StorageId, TensorId, TensorKind};
use offload_core::runtime::{
    Backend, CorePlatform, MemoryBounds, PlantedBug, Runtime, Scope, WeightSource, memory_bounds,
};
use offload_core::{OffloadConfig, OffloadStrategy};

use crate::device::{Jitter, Sim, SimAccumulator, SimConfig, SimDevice, SimEvent, SimStats};
use crate::faults::FaultPlan;
use crate::presets::{Preset, SyntheticWeights};
use crate::profile::{BlockWork, DeviceProfile};
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
#[allow(clippy::large_enum_variant)] // built a few times a run; a box buys nothing
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
            OffloadStrategy::Planned => {
                c.device_budget = Some(offload_core::budget::DeviceBudget::Auto);
            }
        }
        Self::Config(c)
    }

    /// The configuration this choice amounts to (the default, no offload,
    /// for the resident baseline).
    pub fn config(&self) -> OffloadConfig {
        match self {
            Self::Config(c) => c.clone(),
            Self::Resident => OffloadConfig::default(),
        }
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
    /// Seeded delays that widen race windows (none by default).
    pub jitter: Option<Jitter>,
    /// Bugs to plant (tests only; ignored without the `planted-bugs` feature).
    pub bugs: Vec<PlantedBug>,
    /// What a device budget is planned from (saved measurements), instead
    /// of a warm-up.
    pub planner: Option<offload_core::budget::PlannerInputs>,
    /// Weights that look trained ([`crate::presets::TrainedWeights`])
    /// instead of uniform bytes: what a lossless code's ratio is honest on.
    pub trained_weights: bool,
    /// [`SimConfig::host_threads`]: host work (the staging filler) on
    /// threads of its own.
    pub host_threads: bool,
    /// The caller waits for each denoising step's output (synchronises the
    /// compute stream after each DiT forward) before it starts the next,
    /// as a benchmark timing each step does (`offload-bench`): no hook runs
    /// between a step's last block and that wait. Off by default (a
    /// runtime that reads only the request's output, which is synchronised
    /// once).
    pub step_sync: bool,
    /// [`SimConfig::pageable_reads`]: the device reads pageable memory in
    /// place (`staged_reads = "in_place"`, CONTRACT §7c), and the weights
    /// come as windows it can read ([`crate::presets::MappedWindows`]).
    pub pageable_reads: bool,
}

impl RunOptions {
    /// The simulated device these options describe.
    pub fn sim_config(&self) -> SimConfig {
        SimConfig {
            profile: self.profile.clone(),
            payload_divisor: self.payload_divisor,
            faults: self.faults,
            jitter: self.jitter,
            host_threads: self.host_threads,
            pageable_reads: self.pageable_reads,
        }
    }

    /// Defaults on `profile`: depth 1, all payload bytes, no faults.
    pub fn new(profile: DeviceProfile) -> Self {
        Self {
            profile,
            prefetch_depth: 1,
            payload_divisor: 1,
            faults: FaultPlan::none(),
            seed: 0,
            jitter: None,
            bugs: Vec::new(),
            planner: None,
            trained_weights: false,
            host_threads: false,
            step_sync: false,
            pageable_reads: false,
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
    /// When the denoising phase began and ended on the device's clock, ns.
    pub denoise_window_ns: (u64, u64),
    /// Host→device bytes during denoising.
    pub denoise_h2d_bytes: u64,
    /// Time compute waited on events during denoising, ns.
    pub denoise_wait_ns: u64,
    /// Decodes during denoising (CONTRACT §7b).
    pub denoise_decodes: u64,
    /// Bytes those decodes wrote.
    pub denoise_decoded_bytes: u64,
    /// Bytes of the DiT blocks forwarded during denoising.
    pub block_bytes: u64,
    /// Bytes of the distinct DiTs used.
    pub dit_bytes: u64,
    /// DiT FLOPs of the request: each linear on its rows, and attention
    /// ([`Preset::block_work`]).
    pub dit_flops: f64,
    /// Compute time of the request's DiT kernels, ns: the sum of the
    /// durations the device was charged ([`DeviceProfile::work_ns`]), what
    /// the denoising would take with every weight resident and nothing
    /// waited for.
    pub dit_compute_ns: u64,
    /// Virtual time of the whole request (encoders, denoising, decode), ns.
    pub request_ns: u64,
    /// Each phase, in order.
    pub phases: Vec<PhaseMeasure>,
}

/// Everything one run measured.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    /// The strategy that ran.
    pub strategy: OffloadStrategy,
    /// The configuration it ran.
    pub config: OffloadConfig,
    /// Per request.
    pub requests: Vec<RequestMeasure>,
    /// Virtual time `enable` took, ns.
    pub enable_ns: u64,
    /// Counters after enable.
    pub after_enable: SimStats,
    /// Counters at the end (before disable).
    pub at_end: SimStats,
    /// Host weight bytes the backend reported after enable (for the
    /// report; checks read the device's own counters).
    pub host_weight_bytes: u64,
    /// INV-7's bounds for this run's configuration and depth (a planned
    /// run's: its largest phase's, see `plan_bounds`).
    pub bounds: MemoryBounds,
    /// A planned run's bounds, per phase.
    pub plan_bounds: Option<offload_core::runtime::PlanBounds>,
    /// A planned run's request plan (the last in force).
    pub plan: Option<offload_core::budget::RequestPlan>,
    /// What it was planned from (the warm-up's measurements).
    pub inputs: Option<offload_core::budget::PlannerInputs>,
    /// Whether the first request ran out of memory and the backend planned
    /// again.
    pub replanned: bool,
    /// Whether the backend ended poisoned (a multi-rank failure).
    pub poisoned: bool,
    /// Every checker violation, including leaks after disable.
    pub violations: Vec<Violation>,
    /// The timeline.
    pub trace: Trace,
}

/// Parameter elements under `m`.
pub fn parameters(p: &offload_core::Pipeline, m: ModuleId) -> u64 {
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

/// The tensors of `component` outside its blocks ([`blocks_of`]).
pub fn own_tensors(p: &offload_core::Pipeline, component: ModuleId) -> Vec<TensorId> {
    let in_blocks: BTreeSet<TensorId> = blocks_of(p, component)
        .iter()
        .flat_map(|b| p.subtree_tensors(*b))
        .collect();
    p.subtree_tensors(component)
        .into_iter()
        .filter(|t| !in_blocks.contains(t))
        .collect()
}

/// Where a runtime's kernels put their output, and the events that time a
/// request's denoising phase.
#[derive(Debug)]
pub struct Probe {
    /// The output every kernel folds into.
    pub output: SimAccumulator,
    start: SimEvent,
    end: SimEvent,
}

impl Probe {
    /// A probe on `device`.
    pub fn new(device: &SimDevice) -> Result<Self, OffloadError> {
        let event = || {
            device
                .create_event()
                .map_err(|e| OffloadError::device("create_event", e))
        };
        Ok(Self {
            output: device.create_accumulator(),
            start: event()?,
            end: event()?,
        })
    }
}

/// A kernel reading `tensors` through `scope`, costing `flops` at the
/// device's peak rate ([`DeviceProfile::compute_ns`]), folding into `output`.
pub fn kernel(
    scope: &Scope<'_, Sim>,
    tensors: &[TensorId],
    flops: f64,
    name: &str,
    output: &SimAccumulator,
) -> Result<(), OffloadError> {
    let duration_ns = scope.device().profile().compute_ns(flops);
    kernel_for(scope, tensors, duration_ns, name, output)
}

/// A kernel reading `tensors` through `scope` for `duration_ns`, folding
/// into `output`.
pub fn kernel_for(
    scope: &Scope<'_, Sim>,
    tensors: &[TensorId],
    duration_ns: u64,
    name: &str,
    output: &SimAccumulator,
) -> Result<(), OffloadError> {
    let views = tensors
        .iter()
        .map(|t| scope.view_id(*t))
        .collect::<Result<Vec<_>, _>>()?;
    let inputs: Vec<(&crate::device::SimDeviceBuffer, std::ops::Range<u64>)> =
        views.iter().map(|v| (v.buffer(), v.byte_range())).collect();
    let device: &SimDevice = scope.device();
    device
        .compute_for(scope.stream(), &inputs, duration_ns, name, output)
        .map_err(|e| OffloadError::device(format!("compute `{name}`"), e))
}

/// What one kernel of a forward costs on the device, and the FLOPs it
/// stands for.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Charge {
    /// Its duration on the compute engine, ns.
    pub duration_ns: u64,
    /// Its FLOPs.
    pub flops: f64,
}

impl Charge {
    /// `flops` at `profile`'s peak rate, as one kernel (encoders, VAEs).
    pub fn flops(profile: &DeviceProfile, flops: f64) -> Self {
        Self {
            duration_ns: profile.compute_ns(flops),
            flops,
        }
    }

    /// `work` on `profile`'s kernel model (DiT blocks).
    pub fn work(profile: &DeviceProfile, work: &BlockWork) -> Self {
        Self {
            duration_ns: profile.work_ns(work),
            flops: work.flops(),
        }
    }
}

/// What a component's forward ran (nothing for what a hook skipped).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Forwarded {
    /// Bytes of the blocks forwarded.
    pub block_bytes: u64,
    /// FLOPs of the kernels run.
    pub flops: f64,
    /// Their durations, ns.
    pub compute_ns: u64,
}

/// The forward of one component: its own tensors as one kernel, then each
/// block as one kernel in a child scope. `charge` says what the kernel of
/// a module costs: it is asked for the component itself (its tensors
/// outside blocks) and for each block. While the forward runs it holds
/// `activation_bytes` of activations on the device
/// ([`SimDevice::alloc_activations`], freed after its kernels), and
/// `on_start` runs first inside it (after the component's pre-forward
/// hooks).
pub fn component_forward(
    rt: &Runtime<Sim>,
    output: &SimAccumulator,
    path: &str,
    charge: impl Fn(ModuleId) -> Charge,
    activation_bytes: u64,
    on_start: impl FnOnce(),
) -> Result<Forwarded, OffloadError> {
    let out = rt.forward(path, |scope| {
        on_start();
        let device: &SimDevice = scope.device();
        let scratch = if activation_bytes > 0 {
            Some(
                device
                    .alloc_activations(activation_bytes)
                    .map_err(|e| dev_err(&format!("alloc_activations for `{path}`"), e))?,
            )
        } else {
            None
        };
        let run = || -> Result<Forwarded, OffloadError> {
            let p = scope.pipeline();
            let module = scope.module();
            let own = own_tensors(p, module);
            let c = charge(module);
            kernel_for(
                scope,
                &own,
                c.duration_ns,
                &format!("{path} (non-block)"),
                output,
            )?;
            let mut done = Forwarded {
                block_bytes: 0,
                flops: c.flops,
                compute_ns: c.duration_ns,
            };
            for b in blocks_of(p, module) {
                let bpath = p.module(b).path.clone();
                let rel = bpath[path.len() + 1..].to_owned();
                let c = charge(b);
                let tensors = p.subtree_tensors(b);
                let r = scope.child(&rel, |blk| {
                    Ok(kernel_for(blk, &tensors, c.duration_ns, &bpath, output)?)
                })?;
                if r.is_some() {
                    done.block_bytes += p.subtree_bytes(b);
                    done.flops += c.flops;
                    done.compute_ns += c.duration_ns;
                }
            }
            Ok(done)
        };
        let done = run();
        if let Some(buffer) = scratch {
            // Freed once the forward's kernels are done with it.
            let done_event = device
                .create_event()
                .map_err(|e| dev_err("create_event", e))?;
            device
                .record_event(&done_event, scope.stream())
                .map_err(|e| dev_err("record_event(activations)", e))?;
            // SAFETY: every kernel of this forward was enqueued on the
            // compute stream before `done_event`; nothing uses the buffer
            // after.
            unsafe { device.free_device(buffer, &[&done_event]) }
                .map_err(|e| dev_err("free activations", e))?;
        }
        Ok(done?)
    })?;
    Ok(out.unwrap_or_default())
}

/// What each DiT kernel of `preset` costs for a forward over `tokens` on
/// `profile` ([`Preset::block_work`] on [`DeviceProfile::work_ns`]), by
/// module: each DiT (its non-block part) and each of its blocks.
pub fn dit_charges(
    preset: &Preset,
    p: &offload_core::Pipeline,
    profile: &DeviceProfile,
    tokens: u64,
) -> BTreeMap<ModuleId, Charge> {
    let split = preset.split(tokens);
    let mut charges = BTreeMap::new();
    for dit in preset.dits.iter().filter_map(|d| p.module_id(d)) {
        let own = preset.non_block_work(p, dit, split);
        charges.insert(dit, Charge::work(profile, &own));
        for b in blocks_of(p, dit) {
            let work = preset.block_work(p, b, split);
            charges.insert(b, Charge::work(profile, &work));
        }
    }
    charges
}

fn dev_err(operation: &str, e: crate::device::SimError) -> OffloadError {
    OffloadError::device(operation, e)
}

/// One request: encoders, `w.steps` DiT forwards (two experts split the
/// steps), VAEs; then the output is read back, the request's one host
/// synchronisation (on the compute stream, as a runtime reading its output
/// does). The denoising phase is timed with events on the compute stream.
/// It never waits at a step's end: a rig's [`RunOptions::step_sync`] is
/// read by [`Rig::request`] and [`request_with`].
pub fn request(
    rt: &Runtime<Sim>,
    device: &SimDevice,
    probe: &Probe,
    w: &Workload,
) -> Result<RequestMeasure, OffloadError> {
    request_inner(rt, device, probe, w, (true, false), || Ok(()))
}

/// One request on `rig` as one rank of a group runs it: the encoders only
/// if `encodes`, then `exchange` (the runtime's own collective), then the
/// rest as [`request`].
pub fn request_with(
    rig: &Rig,
    w: &Workload,
    encodes: bool,
    exchange: impl FnOnce() -> Result<(), OffloadError>,
) -> Result<RequestMeasure, OffloadError> {
    request_inner(
        &rig.runtime,
        &rig.device,
        &rig.probe,
        w,
        (encodes, rig.step_sync),
        exchange,
    )
}

fn request_inner(
    rt: &Runtime<Sim>,
    device: &SimDevice,
    probe: &Probe,
    w: &Workload,
    (encodes, step_sync): (bool, bool),
    exchange: impl FnOnce() -> Result<(), OffloadError>,
) -> Result<RequestMeasure, OffloadError> {
    let preset = &w.preset;
    let mut m = RequestMeasure::default();
    let out = &probe.output;
    let compute = rt.compute_stream();
    device
        .reset_accumulator(compute, out)
        .map_err(|e| dev_err("reset output", e))?;
    let p = &rt.model().pipeline;
    let profile = device.profile();
    let act = |path: &str| preset.component_activation_bytes(p, path, w.tokens);
    let mut phases = PhaseClock::new(device)?;
    let request_start = phases.event()?;
    device
        .record_event(&request_start, compute)
        .map_err(|e| dev_err("record_event(request start)", e))?;
    if encodes {
        // Every weight on every text token, at the peak rate.
        let t = preset.text_tokens as f64;
        for enc in &preset.encoders {
            let component = p.module_id(enc);
            phases.begin(enc, compute)?;
            component_forward(
                rt,
                out,
                enc,
                |m| {
                    let elements = if Some(m) == component {
                        own_tensors(p, m).iter().map(|t| p.tensor(*t).numel()).sum()
                    } else {
                        parameters(p, m)
                    };
                    Charge::flops(&profile, 2.0 * elements as f64 * t)
                },
                act(enc),
                || phases.started(),
            )?;
        }
    }
    exchange()?;
    device
        .record_event(&probe.start, compute)
        .map_err(|e| dev_err("record_event(denoise start)", e))?;
    let (s0, wait0) = (device.stats(), device.waited_ns(compute));
    let charges = dit_charges(preset, p, &profile, w.tokens);
    let mut used = BTreeSet::new();
    for step in 0..w.steps {
        let dit = if preset.dits.len() > 1 && step >= w.steps / 2 {
            preset.dits[1]
        } else {
            preset.dits[0]
        };
        used.insert(dit);
        phases.begin(dit, compute)?;
        let done = component_forward(
            rt,
            out,
            dit,
            |module| charges[&module],
            act(dit),
            || phases.started(),
        )?;
        m.block_bytes += done.block_bytes;
        m.dit_flops += done.flops;
        m.dit_compute_ns += done.compute_ns;
        if step_sync {
            device
                .synchronize_stream(compute)
                .map_err(|e| dev_err("synchronize_stream(compute) after a step", e))?;
        }
    }
    device
        .record_event(&probe.end, compute)
        .map_err(|e| dev_err("record_event(denoise end)", e))?;
    let s1 = device.stats();
    m.denoise_h2d_bytes = s1.h2d_bytes - s0.h2d_bytes;
    m.denoise_wait_ns = device.waited_ns(compute) - wait0;
    m.denoise_decodes = s1.decodes - s0.decodes;
    m.denoise_decoded_bytes = s1.decoded_bytes - s0.decoded_bytes;
    m.dit_bytes = used
        .iter()
        .filter_map(|d| p.module_id(d))
        .map(|d| p.subtree_bytes(d))
        .sum();
    for vae in &preset.vaes {
        let flops = preset.vae_flops;
        let bytes = act(vae);
        phases.begin(vae, compute)?;
        rt.forward(vae, |scope| {
            phases.started();
            let scratch = device
                .alloc_activations(bytes)
                .map_err(|e| dev_err(&format!("alloc_activations for `{vae}`"), e))?;
            let tensors = scope.pipeline().subtree_tensors(scope.module());
            let ran = kernel(scope, &tensors, flops, vae, out);
            let done = device
                .create_event()
                .map_err(|e| dev_err("create_event", e))?;
            device
                .record_event(&done, scope.stream())
                .map_err(|e| dev_err("record_event(activations)", e))?;
            // SAFETY: the decode's kernel was enqueued before `done`.
            unsafe { device.free_device(scratch, &[&done]) }
                .map_err(|e| dev_err("free activations", e))?;
            Ok(ran?)
        })?;
    }
    phases.end(compute)?;
    let request_end = phases.event()?;
    device
        .record_event(&request_end, compute)
        .map_err(|e| dev_err("record_event(request end)", e))?;
    device
        .synchronize_stream(compute)
        .map_err(|e| dev_err("synchronize_stream(compute) to read the output", e))?;
    m.output = device.read_accumulator(out);
    let window = (
        device.event_time_ns(&probe.start),
        device.event_time_ns(&probe.end),
    );
    m.denoise_ns = window.1 - window.0;
    m.denoise_window_ns = window;
    m.request_ns = device.event_time_ns(&request_end) - device.event_time_ns(&request_start);
    m.phases = phases.finish();
    Ok(m)
}

/// One phase of a request as the device saw it: a component's contiguous
/// forwards (an encoder's, the denoising steps of one DiT, a decode).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PhaseMeasure {
    /// The component.
    pub component: String,
    /// Its time on the compute stream (bring-in included), ns.
    pub ns: u64,
    /// The device's peak weight bytes in it ([`SimDevice::take_window`]),
    /// from its first forward's start (its bring-in done) to its end.
    pub weight_peak_bytes: u64,
    /// The device's peak of everything (weights and activations) in it.
    pub total_peak_bytes: u64,
    /// The peak of the device's own count of memory in use in it (what
    /// its free memory misses: the allocator's chunks, the page tables of
    /// page-locked host memory), as a GPU's `cuMemGetInfo` counts.
    pub counted_peak_bytes: u64,
}

/// A phase ended: its component, start and end events, and its peaks
/// (weights, everything, the device's own count).
type EndedPhase = (String, SimEvent, SimEvent, (u64, u64, u64));

/// Phases of one request, timed with events and measured with the
/// device's window peaks.
struct PhaseClock<'d> {
    device: &'d SimDevice,
    current: Option<(String, SimEvent)>,
    fresh: std::cell::Cell<bool>,
    /// Each phase ended: its component, start and end, and its peaks
    /// (weights, everything, the device's own count).
    done: Vec<EndedPhase>,
}

impl<'d> PhaseClock<'d> {
    fn new(device: &'d SimDevice) -> Result<Self, OffloadError> {
        Ok(Self {
            device,
            current: None,
            fresh: std::cell::Cell::new(false),
            done: Vec::new(),
        })
    }

    fn event(&self) -> Result<SimEvent, OffloadError> {
        self.device
            .create_event()
            .map_err(|e| dev_err("create_event", e))
    }

    /// A forward of `component` is about to run: a new phase if it is not
    /// the current one's.
    fn begin(
        &mut self,
        component: &str,
        stream: &crate::device::SimStream,
    ) -> Result<(), OffloadError> {
        if self.current.as_ref().is_some_and(|(c, _)| c == component) {
            return Ok(());
        }
        self.end(stream)?;
        let start = self.event()?;
        self.device
            .record_event(&start, stream)
            .map_err(|e| dev_err("record_event(phase start)", e))?;
        self.current = Some((component.to_owned(), start));
        self.fresh.set(true);
        Ok(())
    }

    /// Inside the first forward of a phase (its hooks done): the phase's
    /// memory window starts.
    fn started(&self) {
        if self.fresh.replace(false) {
            self.device.take_window();
        }
    }

    fn end(&mut self, stream: &crate::device::SimStream) -> Result<(), OffloadError> {
        if let Some((c, start)) = self.current.take() {
            let end = self.event()?;
            self.device
                .record_event(&end, stream)
                .map_err(|e| dev_err("record_event(phase end)", e))?;
            let peaks = self.device.take_window_counted();
            self.done.push((c, start, end, peaks));
        }
        Ok(())
    }

    /// Every phase (after the host synchronised with the device).
    fn finish(self) -> Vec<PhaseMeasure> {
        self.done
            .into_iter()
            .map(|(component, start, end, (w, t, c))| PhaseMeasure {
                component,
                ns: self.device.event_time_ns(&end) - self.device.event_time_ns(&start),
                weight_peak_bytes: w,
                total_peak_bytes: t,
                counted_peak_bytes: c,
            })
            .collect()
    }
}

/// A simulated device, a runtime on it and a platform building backends
/// for it: what a scenario test drives step by step.
pub struct Rig {
    /// The device (shared with the runtime).
    pub device: SimDevice,
    /// The runtime.
    pub runtime: Runtime<Sim>,
    /// Builds backends on the device (with `opts.bugs` planted).
    pub platform: CorePlatform<Sim>,
    /// The runtime's output and timing events.
    pub probe: Probe,
    /// [`RunOptions::step_sync`]: [`Rig::request`] waits for each step.
    pub step_sync: bool,
}

/// The payload bytes a simulated device keeps by default: at most this much
/// of a pipeline's weights, one byte in [`default_payload_divisor`] (the
/// main job's default and [`Rig::quick`]'s).
pub const DEFAULT_KEPT_PAYLOAD_BYTES: u64 = 64 << 20;

/// The smallest power of two `d` that keeps the payload of `weight_bytes`
/// of weights under [`DEFAULT_KEPT_PAYLOAD_BYTES`] (1 for a small
/// pipeline: every byte kept).
pub fn default_payload_divisor(weight_bytes: u64) -> u64 {
    (weight_bytes / DEFAULT_KEPT_PAYLOAD_BYTES)
        .max(1)
        .next_power_of_two()
}

impl Rig {
    /// The quick path, in one call: a simulated H200
    /// ([`DeviceProfile::h200`]) with `pipeline`, its compute stream,
    /// synthetic weights (seed 0), a platform building backends on it
    /// (prefetch depth 1) and a runtime with no backend yet. Then
    /// `rig.runtime.enable_selected(&config, &rig.platform)?` and forwards,
    /// whose kernels fold into `rig.probe.output` (see the README's Usage).
    ///
    /// Memory against fidelity: every simulated buffer is real host memory.
    /// This constructor keeps every byte of a pipeline of up to 64 MiB of
    /// weights, and one byte in `d` of a larger one
    /// ([`default_payload_divisor`]: under 64 MiB kept in all), as the main
    /// job does; sizes, offsets, timing and memory accounting stay exact and
    /// outputs still depend on the bytes kept, but a check that needs every
    /// byte (INV-2's census of host masters) does not hold. To keep every
    /// byte whatever the size, use [`Rig::new`] with
    /// `RunOptions::new(profile)` ([`SimConfig::exact`]): it costs the
    /// pipeline's size at least twice over in host memory and in time
    /// (issue 10: a small pipeline took 3.7 GB and 55 s in a debug build).
    pub fn quick(pipeline: offload_core::Pipeline) -> Result<Self, OffloadError> {
        let weight_bytes = pipeline.storages().map(|(_, s)| s.bytes).sum();
        let opts = RunOptions {
            payload_divisor: default_payload_divisor(weight_bytes),
            ..RunOptions::new(DeviceProfile::h200())
        };
        Self::new(pipeline, &opts)
    }

    /// A fresh device with `pipeline` and synthetic weights of `opts.seed`.
    pub fn new(pipeline: offload_core::Pipeline, opts: &RunOptions) -> Result<Self, OffloadError> {
        let weights: Arc<dyn WeightSource> = if opts.trained_weights {
            Arc::new(crate::presets::TrainedWeights::new(opts.seed, &pipeline))
        } else {
            Arc::new(SyntheticWeights { seed: opts.seed })
        };
        let weights: Arc<dyn WeightSource> = if opts.pageable_reads {
            Arc::new(crate::presets::MappedWindows::new(
                weights,
                opts.payload_divisor,
            ))
        } else {
            weights
        };
        Self::with_weights(pipeline, opts, weights)
    }

    /// A fresh device with `pipeline` reading `weights`.
    pub fn with_weights(
        pipeline: offload_core::Pipeline,
        opts: &RunOptions,
        weights: Arc<dyn WeightSource>,
    ) -> Result<Self, OffloadError> {
        let device = SimDevice::new(opts.sim_config()).map_err(|e| dev_err("SimDevice::new", e))?;
        Self::on_device(device, pipeline, opts, weights, None)
    }

    /// A rig on `device` (one rank of a group when `collective` is given:
    /// its platform builds distributed layerwise backends gathering
    /// through it).
    pub fn on_device(
        device: SimDevice,
        pipeline: offload_core::Pipeline,
        opts: &RunOptions,
        weights: Arc<dyn WeightSource>,
        collective: Option<crate::collective::SimCollective>,
    ) -> Result<Self, OffloadError> {
        let dev = Arc::new(device.clone());
        let compute = Arc::new(
            dev.create_stream()
                .map_err(|e| dev_err("create_stream", e))?,
        );
        let platform = plant(
            CorePlatform::<Sim>::new(
                format!("sim:{}", opts.profile.name),
                Arc::clone(&dev),
                Arc::clone(&compute),
                weights,
            )
            .with_prefetch_depth(opts.prefetch_depth)
            .with_codec(Arc::new(crate::codec::SimCodec::new(&device))),
            &opts.bugs,
        );
        let platform = match collective {
            Some(c) => platform.with_collective(Arc::new(c)),
            None => platform,
        };
        let platform = match &opts.planner {
            Some(inputs) => platform.with_planner(inputs.clone()),
            None => platform,
        };
        let probe = Probe::new(&device)?;
        let runtime = Runtime::new(dev, compute, pipeline);
        Ok(Self {
            device,
            runtime,
            platform,
            probe,
            step_sync: opts.step_sync,
        })
    }

    /// The backend `choice` selects.
    pub fn backend(&self, choice: &StrategyChoice) -> Result<Box<dyn Backend<Sim>>, OffloadError> {
        match choice {
            StrategyChoice::Resident => self.platform.resident(),
            StrategyChoice::Config(config) => self.platform.backend_for(config),
        }
    }

    /// One request on this rig's runtime.
    pub fn request(&self, w: &Workload) -> Result<RequestMeasure, OffloadError> {
        request_with(self, w, true, || Ok(()))
    }

    /// Registers `w`'s request as the runtime's ([`Runtime::set_request`]:
    /// what a planned backend's warm-up runs, with the shape's steps) and
    /// tells the platform to plan for `w`'s tokens and steps.
    pub fn serve_workload(&mut self, w: &Workload) {
        let preset = w.preset.clone();
        self.runtime.set_request(move |rt, shape| {
            let w = Workload {
                preset: preset.clone(),
                tokens: shape.tokens,
                steps: shape.steps as usize,
                requests: 1,
            };
            let device: &SimDevice = rt.device();
            let probe = Probe::new(device)?;
            request(rt, device, &probe, &w)?;
            Ok(())
        });
        let steps = u32::try_from(w.steps).unwrap_or(u32::MAX);
        self.platform.set_request(w.preset.request(w.tokens, steps));
    }
}

#[cfg(feature = "planted-bugs")]
fn plant(platform: CorePlatform<Sim>, bugs: &[PlantedBug]) -> CorePlatform<Sim> {
    platform.with_planted_bugs(bugs)
}

#[cfg(not(feature = "planted-bugs"))]
fn plant(platform: CorePlatform<Sim>, _: &[PlantedBug]) -> CorePlatform<Sim> {
    platform
}

/// INV-2 observed from the device: for each storage in `offloaded` (of at
/// least 16 bytes, so that its bytes identify it), one entry per host
/// allocation (pinned or registered) holding its exact bytes, read from
/// the device's own memory. A storage with one host master appears once.
/// Needs every payload byte (a payload divisor of 1).
pub fn host_master_census(
    device: &SimDevice,
    pipeline: &offload_core::Pipeline,
    weights: &dyn WeightSource,
    offloaded: &BTreeSet<StorageId>,
) -> Vec<StorageId> {
    use std::collections::HashMap;
    const KEY: usize = 16;
    let mut expected: HashMap<[u8; KEY], Vec<(StorageId, Vec<u8>)>> = HashMap::new();
    for (id, storage) in pipeline.storages() {
        if !offloaded.contains(&id) || storage.bytes < KEY as u64 {
            continue;
        }
        let mut bytes = vec![0u8; storage.bytes as usize];
        weights.read(id, 0, &mut bytes);
        let key: [u8; KEY] = bytes[..KEY].try_into().expect("16 bytes");
        expected.entry(key).or_default().push((id, bytes));
    }
    let mut found = Vec::new();
    for alloc in device.host_allocations() {
        let mem = &alloc.bytes;
        for start in 0..mem.len().saturating_sub(KEY - 1) {
            let key: [u8; KEY] = mem[start..start + KEY].try_into().expect("16 bytes");
            if let Some(candidates) = expected.get(&key) {
                for (id, bytes) in candidates {
                    if mem[start..].starts_with(bytes) {
                        found.push(*id);
                    }
                }
            }
        }
    }
    found
}

/// A run that failed, with every rule the device saw broken until then
/// (including after the drop: leaks).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct RunFailure {
    /// What failed.
    pub error: OffloadError,
    /// What the device's checkers saw.
    pub violations: Vec<Violation>,
    /// Whether the backend ended poisoned (a multi-rank failure).
    pub poisoned: bool,
    /// Whether its own hooks had poisoned it when the request failed
    /// (before the runtime told it).
    pub poisoned_by_hooks: bool,
}

impl From<OffloadError> for RunFailure {
    fn from(error: OffloadError) -> Self {
        Self {
            error,
            violations: Vec::new(),
            poisoned: false,
            poisoned_by_hooks: false,
        }
    }
}

/// Runs `w` with `choice` on a fresh simulated device.
pub fn run(
    w: &Workload,
    choice: &StrategyChoice,
    opts: &RunOptions,
) -> Result<RunOutcome, RunFailure> {
    let mut rig = Rig::new(w.preset.pipeline.clone(), opts)?;
    rig.serve_workload(w);
    drive(
        rig,
        choice,
        &choice.config(),
        opts,
        w.requests,
        |rig| rig.request(w),
        |_| {},
    )
}

/// The life of one run on `rig`: build `choice`'s backend, enable, run
/// `requests` requests through `request`, disable, drop, and check what the
/// device holds afterwards. `config` is what INV-7's bounds are computed
/// for (the rank's own, under DLO). `teardown` frees what the caller
/// allocated on the device beside the backend, before leaks are counted.
pub fn drive(
    mut rig: Rig,
    choice: &StrategyChoice,
    config: &OffloadConfig,
    opts: &RunOptions,
    requests: usize,
    mut request: impl FnMut(&Rig) -> Result<RequestMeasure, OffloadError>,
    teardown: impl FnOnce(&SimDevice),
) -> Result<RunOutcome, RunFailure> {
    let pipeline = rig.runtime.model().pipeline.clone();
    let device = rig.device.clone();
    let fail = |error: OffloadError, device: &SimDevice| RunFailure {
        error,
        violations: device.violations(),
        poisoned: false,
        poisoned_by_hooks: false,
    };
    let planned = config.device_budget.is_some();
    let mut bounds = if planned {
        None
    } else {
        Some(memory_bounds(&pipeline, config, opts.prefetch_depth).map_err(|e| fail(e, &device))?)
    };
    let backend = rig.backend(choice).map_err(|e| fail(e, &device))?;
    let strategy = backend.strategy();
    let t0 = device.host_now_ns();
    if let Err((error, backend)) = rig.runtime.enable(backend) {
        let poisoned = matches!(backend.state(), LifecycleState::Poisoned { .. });
        drop((backend, rig));
        teardown(&device);
        device.check_released();
        return Err(RunFailure {
            poisoned,
            poisoned_by_hooks: poisoned,
            ..fail(error, &device)
        });
    }
    let enable_ns = device.host_now_ns() - t0;
    let after_enable = device.stats();
    let host_weight_bytes = rig.runtime.backend().map_or(0, |b| b.host_weight_bytes());
    // A planned backend's bounds are its plan's, per phase.
    let mut plan_bounds = None;
    if planned {
        let computed = rig
            .runtime
            .request_plan()
            .ok_or_else(|| OffloadError::Request {
                reason: "a device budget enabled no request plan".to_owned(),
            })
            .and_then(|plan| offload_core::runtime::plan_bounds(&pipeline, config, plan));
        match computed {
            Ok(b) => {
                bounds = Some(b.as_memory_bounds());
                plan_bounds = Some(b);
            }
            Err(e) => return Err(fail(e, &device)),
        }
    }
    let mut measured = Vec::new();
    let mut failure = None;
    let mut replanned = false;
    let mut left = requests;
    while left > 0 {
        match request(&rig) {
            Ok(m) => {
                measured.push(m);
                left -= 1;
            }
            Err(e) => match rig.runtime.replan_after(&e) {
                // Out of memory in the first request: planned again with
                // the shortfall; the request runs again.
                Ok(true) => {
                    replanned = true;
                    if let Some(plan) = rig.runtime.request_plan()
                        && let Ok(b) = offload_core::runtime::plan_bounds(&pipeline, config, plan)
                    {
                        bounds = Some(b.as_memory_bounds());
                        plan_bounds = Some(b);
                    }
                }
                Ok(false) => {
                    failure = Some(e);
                    break;
                }
                Err(again) => {
                    failure = Some(again);
                    break;
                }
            },
        }
    }
    let plan = rig.runtime.request_plan().cloned();
    let inputs = rig.runtime.planner_inputs().cloned();
    let at_end = device.stats();
    let is_poisoned =
        |s: Option<LifecycleState>| matches!(s, Some(LifecycleState::Poisoned { .. }));
    // What the backend's own hooks made of the failure, before the runtime
    // tells it (as a multi-rank runtime must, so that `disable` issues no
    // collective the other ranks will not).
    let poisoned_by_hooks = is_poisoned(rig.runtime.state());
    if let Some(e) = &failure {
        rig.runtime.poison(&format!("a request failed ({e})"));
    }
    let poisoned_before = is_poisoned(rig.runtime.state());
    let (poisoned_after, disabled) = match rig.runtime.disable_backend() {
        Some((b, result)) => (is_poisoned(Some(b.state())), result),
        None => (false, Ok(())),
    };
    let poisoned = poisoned_before || poisoned_after;
    drop(rig);
    teardown(&device);
    device.check_released();
    if let Some(error) = failure.or(disabled.err()) {
        return Err(RunFailure {
            error,
            violations: device.violations(),
            poisoned,
            poisoned_by_hooks,
        });
    }
    Ok(RunOutcome {
        strategy,
        config: config.clone(),
        requests: measured,
        enable_ns,
        after_enable,
        at_end,
        host_weight_bytes,
        bounds: bounds.expect("computed for every strategy"),
        plan_bounds,
        plan,
        inputs,
        replanned,
        poisoned,
        violations: device.violations(),
        trace: device.trace(),
    })
}
