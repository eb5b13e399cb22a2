//! The main job (`offload-sim run`) as a library: runs a real-model-shaped
//! pipeline through the strategies on a simulated GPU and reports, per
//! strategy, time against the physical limit, memory, traffic and every
//! residency rule broken. The binary only parses flags and prints.
//!
//! Three outcomes, kept apart: a strategy that runs (a row with figures), a
//! strategy that does not fit on the device (a row that says so; the job
//! still succeeds), and an error (bad input, a strategy with no backend, a
//! failure that is not out-of-memory: the job fails with a typed
//! [`JobError`]). Rules broken (checker violations, an output that differs
//! from the resident run's, memory beyond INV-7's bound) make
//! [`JobOutput::verdict`] fail.

use std::path::PathBuf;

use offload_core::device::DeviceErrorKind;
use offload_core::invariants::Violation;
use offload_core::runtime::{PlantedBug, memory_bounds};
use offload_core::{OffloadConfig, OffloadError, OffloadStrategy};
use serde::Serialize;
use serde_json::{Value, json};

use crate::FaultPlan;
use crate::device::Jitter;
use crate::harness::{RequestMeasure, RunOptions, RunOutcome, StrategyChoice, Workload, run};
use crate::multi::{EncoderRanks, MultiOptions, run_ranks};
use crate::presets::Preset;
use crate::profile::DeviceProfile;

/// The most tokens per forward the job simulates (1 Mi: beyond any video
/// model; the attention term grows with its square).
pub const MAX_TOKENS: u64 = 1 << 20;
/// The most denoising steps per request.
pub const MAX_STEPS: usize = 10_000;
/// The most requests.
pub const MAX_REQUESTS: usize = 1_000;
/// The deepest prefetch.
pub const MAX_PREFETCH_DEPTH: usize = 16;
/// The most ranks of a simulated gather group.
pub const MAX_RANKS: u32 = 64;

/// Which strategies to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StrategySet {
    /// Resident, model level and layerwise.
    All,
    /// One strategy.
    One(OffloadStrategy),
}

/// What the job runs.
#[derive(Clone, Debug)]
pub struct JobArgs {
    /// Preset name.
    pub model: String,
    /// Strategies (ignored with `config`).
    pub strategy: StrategySet,
    /// Device profile name.
    pub gpu: String,
    /// Tokens per DiT forward (`None`: the preset's).
    pub tokens: Option<u64>,
    /// Denoising steps per request.
    pub steps: usize,
    /// Requests (the first warms up and is not timed, if there are several).
    pub requests: usize,
    /// Layerwise prefetch depth (`None`: 1, or the configuration's
    /// `prefetch_depth`; both given must agree).
    pub prefetch_depth: Option<usize>,
    /// A configuration file; the strategy is then what it selects.
    pub config: Option<PathBuf>,
    /// Keep one payload byte in N (`None`: under 64 MiB in all).
    pub payload_divisor: Option<u64>,
    /// Seed of the synthetic weights.
    pub seed: u64,
    /// Seeded delays that widen race windows.
    pub jitter: Option<Jitter>,
    /// Bugs planted in the strategies under test (ignored without the
    /// `planted-bugs` feature; the resident baseline stays clean).
    pub bugs: Vec<PlantedBug>,
    /// Device memory in bytes instead of the profile's (capacity planning:
    /// "what if the card had this much?").
    pub device_memory_bytes: Option<u64>,
    /// Faults injected into the strategies under test (library only, for
    /// tests: a failed run is then a row with its error and the rules the
    /// device saw broken, not a job error).
    pub faults: FaultPlan,
    /// Collect a Perfetto trace.
    pub trace: bool,
    /// Ranks of distributed layerwise offload (`None`: the configuration's
    /// world size, else 1). Each rank is a simulated GPU on its own thread.
    pub ranks: Option<u32>,
    /// What a device budget is planned from (a warm-up's saved
    /// measurements), instead of a warm-up.
    pub measurements: Option<offload_core::budget::PlannerInputs>,
}

impl Default for JobArgs {
    fn default() -> Self {
        Self {
            model: "flux1-dev".to_owned(),
            strategy: StrategySet::All,
            gpu: "h200".to_owned(),
            tokens: None,
            steps: 10,
            requests: 2,
            prefetch_depth: None,
            config: None,
            payload_divisor: None,
            seed: 0,
            jitter: None,
            bugs: Vec::new(),
            device_memory_bytes: None,
            faults: FaultPlan::none(),
            trace: false,
            ranks: None,
            measurements: None,
        }
    }
}

/// A configuration file's error, with the file named once: errors that
/// already name it (a syntax or schema error read from it, a file that
/// cannot be read) as they are.
fn named_once(path: &std::path::Path, error: &OffloadError) -> String {
    let text = error.to_string();
    if text.contains(&format!("`{}`", path.display())) {
        text
    } else {
        format!("configuration `{}`: {text}", path.display())
    }
}

/// Why the job failed.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// A flag's value is not allowed.
    #[error("{flag} `{value}` is not allowed; {allowed}")]
    BadFlag {
        /// The flag.
        flag: &'static str,
        /// The value given.
        value: String,
        /// What is allowed.
        allowed: String,
    },
    /// The configuration file was rejected (its error names the file
    /// where it says where in it; the file is named once).
    #[error("{}", named_once(path, error))]
    Config {
        /// The file.
        path: PathBuf,
        /// Why.
        error: OffloadError,
    },
    /// A strategy failed for another reason than running out of memory
    /// (a strategy with no backend, a device failure, a bug).
    #[error("{strategy}: {error}")]
    Run {
        /// The strategy.
        strategy: String,
        /// Why.
        error: OffloadError,
    },
    /// The device ran out of memory although INV-7's bound for the
    /// strategy fits it: a memory bug, not a device too small.
    #[error(
        "{strategy}: out of device memory although INV-7's bound of {bound_bytes} bytes fits the device's {capacity_bytes} (a memory bug): {error}"
    )]
    MemoryBug {
        /// The strategy.
        strategy: String,
        /// INV-7's device bound.
        bound_bytes: u64,
        /// The device's memory.
        capacity_bytes: u64,
        /// What failed.
        error: OffloadError,
    },
    /// Residency rules were broken.
    #[error("{count} residency rule(s) broken (see the violations in the report)")]
    Violations {
        /// How many.
        count: usize,
    },
}

/// One strategy's row.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Strategy name.
    pub strategy: String,
    /// Preset.
    pub model: String,
    /// Profile.
    pub gpu: String,
    /// Steps per request.
    pub steps: usize,
    /// Tokens per forward.
    pub tokens: u64,
    /// Whether the strategy fits on the device (false: `error` says why,
    /// and the figures are null).
    pub fits: bool,
    /// Why it did not fit.
    pub error: Option<String>,
    /// The device's memory: the profile's, or `--device-memory-gb`.
    pub device_memory_bytes: u64,
    /// What the device lacks for this strategy: INV-7's device bound less
    /// the device's memory (null when it fits).
    pub needs_more_bytes: Option<u64>,
    /// `fits on h200 (141.00 GB)`, or `does not fit on rtx4090 (24.00 GB):
    /// needs 12.34 GB more` ([`fit_line`]).
    pub fit: String,
    /// The configuration's selection notes, as its log lines say them
    /// (each flag disabled by priority); empty without a configuration.
    pub selection_notes: Vec<String>,
    /// Median step time of the timed requests.
    pub step_time_ms: Option<f64>,
    /// Time per image: steps × step time (one request's denoising).
    pub image_time_ms: Option<f64>,
    /// The resident baseline's step time (unbounded memory).
    pub resident_step_time_ms: f64,
    /// DiT compute per step by the device's kernel model (the sum of the
    /// resident baseline's DiT kernel durations,
    /// [`RequestMeasure::dit_compute_ns`]): the limit's compute term.
    pub compute_ms: f64,
    /// `max(compute, streamed bytes per step / bandwidth)`.
    pub limit_ms: Option<f64>,
    /// Step over limit.
    pub ratio_to_limit: Option<f64>,
    /// Peak device bytes, from the device's own counter.
    pub peak_device_weight_bytes: Option<u64>,
    /// INV-7's device bound for this strategy and depth.
    pub device_bound_bytes: Option<u64>,
    /// Pinned + registered host bytes held after enable (the host masters),
    /// from the device's counters.
    pub pinned_host_bytes: Option<u64>,
    /// Peak pinned + registered host bytes, enable's staging included.
    pub peak_host_bytes: Option<u64>,
    /// INV-7's host bound (one copy of the offloaded weights, plus enable's
    /// declared staging: the largest resident unit).
    pub host_bound_bytes: Option<u64>,
    /// Host weight bytes the strategy reports holding.
    pub streamed_weight_bytes: Option<u64>,
    /// Host→device bytes per denoising step.
    pub h2d_bytes_per_step: Option<u64>,
    /// `weight_compression` of the row's configuration (CONTRACT §7b).
    pub weight_compression: String,
    /// Bytes a streamed block puts on the link over its bf16 bytes, for
    /// all streamed blocks together (their host masters, which is what
    /// each copy moves, over the bf16 bytes INV-7 counts for them): 1.0
    /// uncoded, the code's ratio with `"lossless"` (on weights drawn like
    /// trained ones, see `presets::TrainedWeights`).
    pub link_ratio: Option<f64>,
    /// Decodes per step and the decoder's time per step on the decode
    /// engine (the profile's `decode_gbps`).
    pub decodes_per_step: Option<f64>,
    /// The decode engine's time per step, ms.
    pub decode_ms_per_step: Option<f64>,
    /// Time compute waited on transfers per step.
    pub compute_wait_ms: Option<f64>,
    /// Time `enable` took.
    pub enable_ms: Option<f64>,
    /// Outputs equal the resident run's, request by request.
    pub output_matches_resident: Option<bool>,
    /// Rules broken.
    pub checker_violations: usize,
    /// What was broken.
    pub violations: Vec<String>,
    /// Ranks (G): 1 but for distributed layerwise on several.
    pub ranks: u32,
    /// Gather time per step on the link (rank 0; distributed layerwise).
    pub gather_ms_per_step: Option<f64>,
    /// The part of the gathers the shard copies cannot hide, per step
    /// (distributed layerwise's limit adds it to the copy time).
    pub exposed_gather_ms: Option<f64>,
    /// One row per rank (distributed layerwise on several ranks).
    pub per_rank: Vec<RankRow>,
    /// The whole request (encoders, denoising, decode), median of the
    /// timed requests, ms.
    pub request_time_ms: Option<f64>,
    /// A planned row: the plan in force (what each component does, why,
    /// each phase's predicted time and peak).
    pub plan: Option<offload_core::budget::RequestPlan>,
    /// A planned row: what the plan was made from (the warm-up's
    /// measurements on the simulated device).
    pub measurements: Option<offload_core::budget::PlannerInputs>,
    /// A planned row: each phase of the last timed request, measured
    /// against the plan.
    pub phases: Vec<PhaseRow>,
    /// A planned row: whether the first request ran out of memory and
    /// the backend planned again.
    pub replanned: bool,
}

/// One phase of a planned row: measured on the simulated device against
/// what the plan predicted and bounded.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseRow {
    /// The component.
    pub component: String,
    /// What the plan does with it (`resident`, `swapped`, `streamed`).
    pub mode: String,
    /// Measured time per request, ms.
    pub measured_ms: f64,
    /// Predicted, ms.
    pub predicted_ms: f64,
    /// Peak device bytes in the phase (weights and activations), from the
    /// device's own counter.
    pub peak_bytes: u64,
    /// Peak device weight bytes in it.
    pub peak_weight_bytes: u64,
    /// INV-7's weight bound of the phase.
    pub weight_bound_bytes: u64,
    /// The budget.
    pub budget_bytes: u64,
}

/// One rank of a distributed layerwise run.
#[derive(Clone, Debug, Serialize)]
pub struct RankRow {
    /// The rank.
    pub rank: u32,
    /// Median step time of the timed requests.
    pub step_time_ms: f64,
    /// Pinned + registered host bytes held after enable (this rank's
    /// shards), from the device's counters.
    pub host_master_bytes: u64,
    /// Host master bytes over the weights the strategy streams.
    pub host_fraction_of_streamed: f64,
    /// INV-7's host bound for this rank.
    pub host_bound_bytes: u64,
    /// Peak device weight bytes, from the device's counter.
    pub peak_device_weight_bytes: u64,
    /// INV-7's device bound.
    pub device_bound_bytes: u64,
    /// Collectives this rank issued in the last timed request's denoising.
    pub gathers_per_step: f64,
    /// Their link time per step.
    pub gather_ms_per_step: f64,
    /// Collective-agreement (INV-9) violations this rank's device saw.
    pub collective_violations: usize,
    /// Outputs equal the resident run's on this rank.
    pub output_matches_resident: bool,
    /// Rules broken on this rank.
    pub checker_violations: usize,
}

/// What the job produced.
#[derive(Debug)]
pub struct JobOutput {
    /// The preset.
    pub preset: Preset,
    /// The profile.
    pub profile: DeviceProfile,
    /// The payload divisor used.
    pub divisor: u64,
    /// One row per strategy.
    pub reports: Vec<Report>,
    /// The Perfetto trace of every strategy, if asked for.
    pub trace: Option<Value>,
}

impl JobOutput {
    /// Fails if any rule was broken.
    pub fn verdict(&self) -> Result<(), JobError> {
        let count: usize = self.reports.iter().map(|r| r.checker_violations).sum();
        if count > 0 {
            return Err(JobError::Violations { count });
        }
        Ok(())
    }
}

/// The row's verdict on the device: `fits on h200 (141.00 GB)`, or, when
/// the strategy needs `needs_more` bytes beyond the device's memory,
/// `does not fit on rtx4090 (24.00 GB): needs 12.34 GB more`.
pub fn fit_line(profile: &DeviceProfile, needs_more: Option<u64>) -> String {
    let device = format!("{} ({})", profile.name, bytes_text(profile.memory_bytes));
    match needs_more {
        None => format!("fits on {device}"),
        Some(more) => format!("does not fit on {device}: needs {} more", bytes_text(more)),
    }
}

/// Bytes for people: `141.00 GB`, `12.50 MB`, `4.42 kB`, `12 bytes` (powers
/// of ten).
pub fn bytes_text(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.2} kB", b / 1e3)
    } else {
        format!("{bytes} bytes")
    }
}

/// The selection's log lines for `choice` (what `select` logs at `info`),
/// so that the job shows them once beside its rows.
fn selection_notes(choice: &StrategyChoice) -> Vec<String> {
    match choice {
        StrategyChoice::Config(c) => c
            .select()
            .map(|s| s.disabled_flags.iter().map(ToString::to_string).collect())
            .unwrap_or_default(),
        StrategyChoice::Resident => Vec::new(),
    }
}

fn bad(flag: &'static str, value: impl ToString, allowed: impl Into<String>) -> JobError {
    JobError::BadFlag {
        flag,
        value: value.to_string(),
        allowed: allowed.into(),
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// The timed requests (all but the first when there are several).
fn timed(out: &RunOutcome) -> &[RequestMeasure] {
    if out.requests.len() > 1 {
        &out.requests[1..]
    } else {
        &out.requests
    }
}

/// The median over the timed requests of `ns(request)` per step, ms.
fn per_step_ms(out: &RunOutcome, steps: usize, ns: impl Fn(&RequestMeasure) -> u64) -> f64 {
    median(
        timed(out)
            .iter()
            .map(|r| ns(r) as f64 / steps as f64 / 1e6)
            .collect(),
    )
    .unwrap_or(0.0)
}

fn step_ms(out: &RunOutcome, steps: usize) -> f64 {
    per_step_ms(out, steps, |r| r.denoise_ns)
}

/// What the resident baseline gives every row: its step time, and the
/// compute the kernel model charged per step (the limit's compute term).
#[derive(Clone, Copy, Debug)]
struct Baseline {
    step_ms: f64,
    compute_ms: f64,
}

impl Baseline {
    fn of(resident: &RunOutcome, steps: usize) -> Self {
        Self {
            step_ms: step_ms(resident, steps),
            compute_ms: per_step_ms(resident, steps, |r| r.dit_compute_ns),
        }
    }
}

/// The largest activations any phase of `w` holds (the simulator's
/// activation model).
fn max_activation_bytes(w: &Workload) -> u64 {
    let p = &w.preset;
    p.dits
        .iter()
        .chain(&p.encoders)
        .chain(&p.vaes)
        .map(|c| p.component_activation_bytes(&p.pipeline, c, w.tokens))
        .max()
        .unwrap_or(0)
}

/// INV-7 against the device's own counters (peak device bytes; peak pinned
/// and registered host bytes), with the exact bound of the strategy
/// (CONTRACT §10): the one INV-7 checker of simulated runs.
pub fn memory_violations(out: &RunOutcome) -> Option<Violation> {
    // A refused pin (the device's own count) stages a layerwise or planned block
    // through the staging ring, which the bounds then declare.
    let bounds = if out.at_end.pins_refused > 0 {
        out.bounds.with_refused_pins()
    } else {
        out.bounds
    };
    let observed = bounds.observe(
        out.at_end.device_peak_bytes,
        out.at_end.pinned_peak_bytes + out.at_end.registered_peak_bytes,
        out.at_end.locked_peak_bytes,
    );
    offload_core::invariants::bounded_memory(&observed, bounds.padding_bytes).err()
}

fn report(
    w: &Workload,
    profile: &DeviceProfile,
    out: &RunOutcome,
    resident: &RunOutcome,
) -> Report {
    let steps = w.steps;
    let step = step_ms(out, steps);
    let base = Baseline::of(resident, steps);
    let last = timed(out).last().cloned().unwrap_or_default();
    let ideal_bytes = match out.strategy {
        OffloadStrategy::Layerwise | OffloadStrategy::DistributedLayerwise => last.block_bytes,
        OffloadStrategy::ModelLevel => last.dit_bytes,
        // What the plan moved while denoising (its streamed blocks and the
        // DiT's bring-in).
        OffloadStrategy::Planned => last.denoise_h2d_bytes,
        OffloadStrategy::None => 0,
    } as f64
        / steps as f64;
    let transfer_ms = ideal_bytes / (profile.h2d_pinned_gbps * 1e9) * 1e3;
    let limit = base.compute_ms.max(transfer_ms);
    let matches = out
        .requests
        .iter()
        .map(|r| r.output)
        .eq(resident.requests.iter().map(|r| r.output));
    let mut violations: Vec<String> = out
        .violations
        .iter()
        .chain(&memory_violations(out))
        .map(ToString::to_string)
        .collect();
    if !matches {
        violations
            .push("INV-8 Equivalence violated: outputs differ from the resident run".to_owned());
    }
    let phases = phase_rows(out, &last);
    if let Some(v) = phase_violations(out) {
        violations.push(v.to_string());
    }
    let request_ms = median(
        timed(out)
            .iter()
            .map(|r| r.request_ns as f64 / 1e6)
            .collect(),
    );
    let planned = out.plan.is_some();
    Report {
        strategy: out.strategy.to_string(),
        model: w.preset.name.to_owned(),
        gpu: profile.name.to_owned(),
        steps,
        tokens: w.tokens,
        fits: true,
        error: None,
        device_memory_bytes: profile.memory_bytes,
        needs_more_bytes: None,
        fit: fit_line(profile, None),
        selection_notes: Vec::new(),
        step_time_ms: Some(step),
        // A planned row plans the whole request: its image takes the
        // request (encoders and decode included).
        image_time_ms: Some(if planned {
            request_ms.unwrap_or(step * steps as f64)
        } else {
            step * steps as f64
        }),
        resident_step_time_ms: base.step_ms,
        compute_ms: base.compute_ms,
        limit_ms: Some(limit),
        ratio_to_limit: (limit > 0.0).then(|| step / limit),
        peak_device_weight_bytes: Some(out.at_end.device_peak_bytes),
        device_bound_bytes: Some(out.bounds.device_weight_bytes),
        pinned_host_bytes: Some(out.after_enable.pinned_bytes + out.after_enable.registered_bytes),
        peak_host_bytes: Some(out.at_end.pinned_peak_bytes + out.at_end.registered_peak_bytes),
        host_bound_bytes: Some(out.bounds.host_weight_bytes),
        streamed_weight_bytes: Some(out.host_weight_bytes),
        h2d_bytes_per_step: Some(last.denoise_h2d_bytes / steps as u64),
        weight_compression: compression_of(out),
        link_ratio: (out.bounds.offloaded_bytes > 0 && out.strategy == OffloadStrategy::Layerwise)
            .then(|| {
                // The device's own count of the host masters after enable.
                (out.after_enable.pinned_bytes + out.after_enable.registered_bytes) as f64
                    / out.bounds.offloaded_bytes as f64
            }),
        decodes_per_step: Some(last.denoise_decodes as f64 / steps as f64),
        decode_ms_per_step: Some(
            profile.decode_ns(last.denoise_decoded_bytes) as f64 / steps as f64 / 1e6,
        ),
        compute_wait_ms: Some(last.denoise_wait_ns as f64 / steps as f64 / 1e6),
        enable_ms: Some(out.enable_ns as f64 / 1e6),
        output_matches_resident: Some(matches),
        checker_violations: violations.len(),
        violations,
        ranks: 1,
        gather_ms_per_step: None,
        exposed_gather_ms: None,
        per_rank: Vec::new(),
        request_time_ms: request_ms,
        plan: out.plan.clone(),
        measurements: out.inputs.clone(),
        phases,
        replanned: out.replanned,
    }
}

/// The phases of a planned run's last timed request, against its plan.
fn phase_rows(out: &RunOutcome, last: &RequestMeasure) -> Vec<PhaseRow> {
    let (Some(plan), Some(bounds)) = (&out.plan, &out.plan_bounds) else {
        return Vec::new();
    };
    last.phases
        .iter()
        .map(|ph| {
            let c = plan.component(&ph.component);
            PhaseRow {
                component: ph.component.clone(),
                mode: c.map_or_else(|| "–".to_owned(), |c| c.mode.to_string()),
                measured_ms: ph.ns as f64 / 1e6,
                predicted_ms: c.map_or(0.0, |c| c.predicted_s * 1e3),
                peak_bytes: ph.total_peak_bytes,
                peak_weight_bytes: ph.weight_peak_bytes,
                weight_bound_bytes: bounds
                    .phase(&ph.component)
                    .map_or(0, |b| b.device_weight_bytes),
                budget_bytes: bounds.budget_bytes,
            }
        })
        .collect()
}

/// INV-7 per phase for a planned run (every timed request's phases, from
/// the device's own window peaks, against the plan's phase bounds and the
/// budget): the one checker of planned runs' memory, beside
/// [`memory_violations`].
pub fn phase_violations(out: &RunOutcome) -> Option<Violation> {
    let bounds = out.plan_bounds.as_ref()?;
    let observed: Vec<offload_core::invariants::PhaseObservation> = out
        .requests
        .iter()
        .flat_map(|r| &r.phases)
        .map(|p| offload_core::invariants::PhaseObservation {
            phase: p.component.clone(),
            peak_weight_bytes: p.weight_peak_bytes,
            peak_total_bytes: p.total_peak_bytes,
            peak_counted_bytes: p.counted_peak_bytes,
        })
        .collect();
    offload_core::invariants::bounded_phases(&observed, &bounds.by_phase(), bounds.budget_bytes)
        .err()
}

impl Report {
    /// A row without figures: the strategy did not fit (`fits` false), or
    /// failed under an injected fault, with what the device saw broken.
    fn without_figures(
        w: &Workload,
        profile: &DeviceProfile,
        strategy: String,
        base: Baseline,
        fits: bool,
        error: String,
        violations: Vec<String>,
    ) -> Self {
        Report {
            strategy,
            model: w.preset.name.to_owned(),
            gpu: profile.name.to_owned(),
            steps: w.steps,
            tokens: w.tokens,
            fits,
            error: Some(error),
            device_memory_bytes: profile.memory_bytes,
            needs_more_bytes: None,
            fit: fit_line(profile, None),
            selection_notes: Vec::new(),
            step_time_ms: None,
            image_time_ms: None,
            resident_step_time_ms: base.step_ms,
            compute_ms: base.compute_ms,
            limit_ms: None,
            ratio_to_limit: None,
            peak_device_weight_bytes: None,
            device_bound_bytes: None,
            pinned_host_bytes: None,
            peak_host_bytes: None,
            host_bound_bytes: None,
            streamed_weight_bytes: None,
            h2d_bytes_per_step: None,
            weight_compression: String::new(),
            link_ratio: None,
            decodes_per_step: None,
            decode_ms_per_step: None,
            compute_wait_ms: None,
            enable_ms: None,
            output_matches_resident: None,
            checker_violations: violations.len(),
            violations,
            ranks: 1,
            gather_ms_per_step: None,
            exposed_gather_ms: None,
            per_rank: Vec::new(),
            request_time_ms: None,
            plan: None,
            measurements: None,
            phases: Vec::new(),
            replanned: false,
        }
    }
}

/// Checks the flags and loads the configuration: every problem is a typed
/// error before anything runs.
fn workload(args: &JobArgs) -> Result<(Workload, DeviceProfile, u64), JobError> {
    let preset = Preset::by_name(&args.model).ok_or_else(|| {
        bad(
            "--model",
            &args.model,
            format!("allowed: {}", Preset::NAMES.join(", ")),
        )
    })?;
    let mut profile = DeviceProfile::by_name(&args.gpu).ok_or_else(|| {
        bad(
            "--gpu",
            &args.gpu,
            format!("allowed: {}", DeviceProfile::names()),
        )
    })?;
    if let Some(bytes) = args.device_memory_bytes {
        if bytes == 0 {
            return Err(bad("--device-memory-gb", 0, "allowed: more than 0"));
        }
        profile.memory_bytes = bytes;
    }
    let tokens = args.tokens.unwrap_or(preset.default_tokens);
    if !(1..=MAX_TOKENS).contains(&tokens) {
        return Err(bad(
            "--tokens",
            tokens,
            format!("allowed: 1 to {MAX_TOKENS}"),
        ));
    }
    if !(1..=MAX_STEPS).contains(&args.steps) {
        return Err(bad(
            "--steps",
            args.steps,
            format!("allowed: 1 to {MAX_STEPS}"),
        ));
    }
    if !(1..=MAX_REQUESTS).contains(&args.requests) {
        return Err(bad(
            "--requests",
            args.requests,
            format!("allowed: 1 to {MAX_REQUESTS}"),
        ));
    }
    if let Some(depth) = args.prefetch_depth
        && !(1..=MAX_PREFETCH_DEPTH).contains(&depth)
    {
        return Err(bad(
            "--prefetch-depth",
            depth,
            format!("allowed: 1 to {MAX_PREFETCH_DEPTH}"),
        ));
    }
    let divisor = match args.payload_divisor {
        Some(d) if d.is_power_of_two() => d,
        Some(d) => {
            return Err(bad(
                "--payload-divisor",
                d,
                "allowed: a power of two (1, 2, 4, …)",
            ));
        }
        None => crate::harness::default_payload_divisor(preset.weight_bytes()),
    };
    Ok((
        Workload {
            preset,
            tokens,
            steps: args.steps,
            requests: args.requests,
        },
        profile,
        divisor,
    ))
}

fn choices(args: &JobArgs) -> Result<Vec<StrategyChoice>, JobError> {
    if let Some(path) = &args.config {
        let config = OffloadConfig::from_path(path)
            .and_then(|c| c.select().map(|_| c))
            .map_err(|e| JobError::Config {
                path: path.clone(),
                error: e.into(),
            })?;
        // The key and the flag say the same thing: one of them, or both
        // alike.
        if let (Some(depth), Some(flag)) = (config.prefetch_depth, args.prefetch_depth)
            && flag != depth as usize
        {
            return Err(bad(
                "--prefetch-depth",
                flag,
                format!(
                    "the configuration `{}` sets prefetch_depth = {depth}: give the depth in one of them",
                    path.display()
                ),
            ));
        }
        return Ok(vec![StrategyChoice::Config(config)]);
    }
    Ok(match args.strategy {
        StrategySet::All => {
            let mut all = vec![
                OffloadStrategy::None,
                OffloadStrategy::ModelLevel,
                OffloadStrategy::Layerwise,
            ];
            if args.ranks.unwrap_or(1) > 1 {
                all.push(OffloadStrategy::DistributedLayerwise);
            }
            all.into_iter().map(StrategyChoice::strategy).collect()
        }
        StrategySet::One(s) => vec![StrategyChoice::strategy(s)],
    })
}

fn is_dlo(choice: &StrategyChoice) -> bool {
    matches!(choice, StrategyChoice::Config(c)
        if c.select().is_ok_and(|s| s.strategy == OffloadStrategy::DistributedLayerwise))
}

/// The ranks distributed layerwise runs on: `--ranks`, else the
/// configuration's world size; they must agree, and only distributed
/// layerwise runs on several.
fn ranks_of(args: &JobArgs, choices: &[StrategyChoice]) -> Result<u32, JobError> {
    let world = choices
        .iter()
        .filter(|c| is_dlo(c))
        .map(|c| c.config().parallel.world_size())
        .max()
        .unwrap_or(1);
    let ranks = match (args.ranks, world) {
        (None, w) => u32::try_from(w).unwrap_or(u32::MAX),
        (Some(r), 1) => r,
        (Some(r), w) if u64::from(r) == w => r,
        (Some(r), w) => {
            return Err(bad(
                "--ranks",
                r,
                format!(
                    "the configuration's parallel section makes a world of {w} ranks: give --ranks {w} or leave it out"
                ),
            ));
        }
    };
    if !(1..=MAX_RANKS).contains(&ranks) {
        return Err(bad("--ranks", ranks, format!("allowed: 1 to {MAX_RANKS}")));
    }
    if ranks > 1 && !choices.iter().any(is_dlo) {
        return Err(bad(
            "--ranks",
            ranks,
            "several ranks run distributed layerwise offload only: add --strategy distributed-layerwise (or a configuration that selects it), or give --ranks 1",
        ));
    }
    Ok(ranks)
}

/// A sampled payload keeps the bytes at positions ≡ 0 mod d of every
/// buffer, so a gather of shards of s bytes keeps its bytes in place only
/// if d divides s: on several ranks the divisor is at most the largest
/// power of two dividing every block's shard.
fn gather_divisor(args: &JobArgs, w: &Workload, ranks: u32, divisor: u64) -> Result<u64, JobError> {
    if ranks <= 1 {
        return Ok(divisor);
    }
    let p = &w.preset.pipeline;
    let shard_align = w
        .preset
        .dits
        .iter()
        .filter_map(|d| p.module_id(d))
        .flat_map(|m| crate::harness::blocks_of(p, m))
        .map(|b| p.subtree_bytes(b).div_ceil(u64::from(ranks)))
        .map(|s| 1u64 << s.trailing_zeros().min(63))
        .min()
        .unwrap_or(1);
    match args.payload_divisor {
        Some(d) if d > shard_align => Err(bad(
            "--payload-divisor",
            d,
            format!(
                "with {ranks} ranks every block's shard must keep whole bytes: allowed up to {shard_align}"
            ),
        )),
        Some(d) => Ok(d),
        None => Ok(divisor.min(shard_align)),
    }
}

/// Distributed layerwise's limit per step, ms: `max(compute, streamed
/// bytes / (G · per-rank bandwidth) + exposed gather)` (compute: the kernel
/// model's, [`Report::compute_ms`]), where a block's gather is exposed by
/// what it takes beyond its shard copy (the copy of the next shard
/// overlaps it). Also returns the exposed part.
fn dlo_limit_ms(
    w: &Workload,
    profile: &DeviceProfile,
    ranks: u32,
    streamed_per_step: f64,
    compute_ms: f64,
) -> (f64, f64) {
    let shared = profile.for_ranks(ranks);
    let p = &w.preset.pipeline;
    let mut exposed_ns = 0.0;
    let dits = w.preset.dits.len().max(1) as f64;
    for dit in &w.preset.dits {
        let Some(module) = p.module_id(dit) else {
            continue;
        };
        for b in crate::harness::blocks_of(p, module) {
            let s = p.subtree_bytes(b).div_ceil(u64::from(ranks));
            let gather = shared.all_gather_ns(ranks, s) as f64;
            let copy = shared.h2d_ns(s) as f64;
            exposed_ns += (gather - copy).max(0.0) / dits;
        }
    }
    let copy_ms = streamed_per_step / (f64::from(ranks) * shared.h2d_pinned_gbps * 1e9) * 1e3;
    let exposed_ms = exposed_ns / 1e6;
    (compute_ms.max(copy_ms + exposed_ms), exposed_ms)
}

/// Runs distributed layerwise on `ranks` simulated GPUs against a resident
/// run on as many, and makes its row (figures of rank 0, one row per rank).
fn run_dlo(
    args: &JobArgs,
    w: &Workload,
    profile: &DeviceProfile,
    choice: &StrategyChoice,
    ranks: u32,
    (opts, unbounded): (&RunOptions, &RunOptions),
    base: Baseline,
) -> Result<Report, JobError> {
    let name = OffloadStrategy::DistributedLayerwise.to_string();
    let multi = |run: &RunOptions, faults: Vec<FaultPlan>| MultiOptions {
        ranks,
        run: run.clone(),
        faults,
        encoders: EncoderRanks::All,
    };
    let run_err = |strategy: &str, error: OffloadError| JobError::Run {
        strategy: strategy.to_owned(),
        error,
    };
    let baseline = run_ranks(w, &StrategyChoice::Resident, &multi(unbounded, Vec::new()))
        .map_err(|e| run_err("resident baseline", e))?;
    let faults = if args.faults.any() {
        vec![args.faults]
    } else {
        Vec::new()
    };
    let out = run_ranks(w, choice, &multi(opts, faults)).map_err(|e| run_err(&name, e))?;
    if let Some(failed) = out.iter().find(|r| r.result.is_err()) {
        let f = failed.result.as_ref().expect_err("found failed");
        let violations: Vec<String> = out
            .iter()
            .flat_map(|r| {
                r.violations()
                    .iter()
                    .map(move |v| format!("rank {}: {v}", r.rank))
            })
            .collect();
        if args.faults.any() {
            let mut row = Report::without_figures(
                w,
                profile,
                name,
                base,
                true,
                format!("rank {}: {}", failed.rank, f.error),
                violations,
            );
            row.ranks = ranks;
            return Ok(row);
        }
        return Err(JobError::Run {
            strategy: format!("{name} (rank {} of {ranks})", failed.rank),
            error: OffloadError::Request {
                reason: f.error.to_string(),
            },
        });
    }
    let resident_outputs = crate::multi::outputs(&baseline);
    let mut per_rank = Vec::new();
    let mut all_violations = Vec::new();
    for (r, base) in out.iter().zip(&resident_outputs) {
        let o = r.result.as_ref().expect("every rank succeeded");
        let mut vs: Vec<String> = o
            .violations
            .iter()
            .chain(&memory_violations(o))
            .map(ToString::to_string)
            .collect();
        let matches = base
            .as_ref()
            .is_some_and(|b| o.requests.iter().map(|q| q.output).eq(b.iter().copied()));
        if !matches {
            vs.push("INV-8 Equivalence violated: outputs differ from the resident run".to_owned());
        }
        let last = timed(o).last().cloned().unwrap_or_default();
        let (from, to) = last.denoise_window_ns;
        let window: Vec<&crate::collective::GatherRecord> = r
            .gathers
            .iter()
            .filter(|g| g.start_ns >= from && g.start_ns < to)
            .collect();
        let steps = w.steps as f64;
        let streamed = o.bounds.offloaded_bytes.max(1);
        let held = o.after_enable.pinned_bytes + o.after_enable.registered_bytes;
        per_rank.push(RankRow {
            rank: r.rank,
            step_time_ms: step_ms(o, w.steps),
            host_master_bytes: held,
            host_fraction_of_streamed: held as f64 / streamed as f64,
            host_bound_bytes: o.bounds.host_weight_bytes,
            peak_device_weight_bytes: o.at_end.device_peak_bytes,
            device_bound_bytes: o.bounds.device_weight_bytes,
            gathers_per_step: window.len() as f64 / steps,
            gather_ms_per_step: window.iter().map(|g| g.link_ns).sum::<u64>() as f64 / steps / 1e6,
            collective_violations: o
                .violations
                .iter()
                .filter(|v| v.invariant == offload_core::invariants::Invariant::CollectiveAgreement)
                .count(),
            output_matches_resident: matches,
            checker_violations: vs.len(),
        });
        all_violations.extend(vs.into_iter().map(|v| format!("rank {}: {v}", r.rank)));
    }
    let first = out[0].result.as_ref().expect("every rank succeeded");
    let last = timed(first).last().cloned().unwrap_or_default();
    let streamed_per_step = last.block_bytes as f64 / w.steps as f64;
    let (limit, exposed) = dlo_limit_ms(w, profile, ranks, streamed_per_step, base.compute_ms);
    let step = per_rank.iter().map(|r| r.step_time_ms).fold(0.0, f64::max);
    let matches = per_rank.iter().all(|r| r.output_matches_resident);
    Ok(Report {
        strategy: name,
        model: w.preset.name.to_owned(),
        gpu: profile.name.to_owned(),
        steps: w.steps,
        tokens: w.tokens,
        fits: true,
        error: None,
        device_memory_bytes: profile.memory_bytes,
        needs_more_bytes: None,
        fit: fit_line(profile, None),
        selection_notes: Vec::new(),
        step_time_ms: Some(step),
        image_time_ms: Some(step * w.steps as f64),
        resident_step_time_ms: base.step_ms,
        compute_ms: base.compute_ms,
        limit_ms: Some(limit),
        ratio_to_limit: (limit > 0.0).then(|| step / limit),
        peak_device_weight_bytes: Some(first.at_end.device_peak_bytes),
        device_bound_bytes: Some(first.bounds.device_weight_bytes),
        pinned_host_bytes: Some(per_rank[0].host_master_bytes),
        peak_host_bytes: Some(first.at_end.pinned_peak_bytes + first.at_end.registered_peak_bytes),
        host_bound_bytes: Some(first.bounds.host_weight_bytes),
        streamed_weight_bytes: Some(first.host_weight_bytes),
        h2d_bytes_per_step: Some(last.denoise_h2d_bytes / w.steps as u64),
        weight_compression: "none".to_owned(),
        link_ratio: None,
        decodes_per_step: None,
        decode_ms_per_step: None,
        compute_wait_ms: Some(last.denoise_wait_ns as f64 / w.steps as f64 / 1e6),
        enable_ms: Some(first.enable_ns as f64 / 1e6),
        output_matches_resident: Some(matches),
        checker_violations: all_violations.len(),
        violations: all_violations,
        ranks,
        gather_ms_per_step: Some(per_rank[0].gather_ms_per_step),
        exposed_gather_ms: Some(exposed),
        per_rank,
        request_time_ms: None,
        plan: None,
        measurements: None,
        phases: Vec::new(),
        replanned: false,
    })
}

/// The `weight_compression` a run's configuration gave.
fn compression_of(out: &RunOutcome) -> String {
    out.config.compression().to_string()
}

fn strategy_name(choice: &StrategyChoice) -> String {
    match choice {
        StrategyChoice::Resident => OffloadStrategy::None.to_string(),
        StrategyChoice::Config(c) => c
            .select()
            .map(|s| s.strategy.to_string())
            .unwrap_or_else(|_| "unknown".to_owned()),
    }
}

/// Where the job is: run `index` of `total` (the resident baseline, then
/// each strategy) starts, doing `what`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stage<'a> {
    /// Runs finished before this one.
    pub index: usize,
    /// Runs in all.
    pub total: usize,
    /// What this run is (`resident baseline`, `layerwise`, …).
    pub what: &'a str,
}

/// Runs the job. `progress` is told when each run starts (the binary
/// draws a progress bar from it on a terminal).
pub fn run_job(args: &JobArgs, progress: &mut dyn FnMut(Stage<'_>)) -> Result<JobOutput, JobError> {
    let (w, profile, divisor) = workload(args)?;
    let choices = choices(args)?;
    let total = 1 + choices.len();
    let ranks = ranks_of(args, &choices)?;
    let divisor = gather_divisor(args, &w, ranks, divisor)?;
    // A coded row's ratio is honest only on weights that look trained.
    let trained_weights = choices
        .iter()
        .any(|c| c.config().compression() != offload_core::config::WeightCompression::None);
    // `staged_reads = "in_place"` plans for a GPU that reads pageable
    // memory, its weights a mapped checkpoint's windows (CONTRACT §7c).
    let pageable_reads = choices
        .iter()
        .any(|c| c.config().staged_reads == Some(offload_core::config::StagedReads::InPlace));
    let opts = RunOptions {
        trained_weights,
        pageable_reads,
        prefetch_depth: args.prefetch_depth.unwrap_or(1),
        payload_divisor: divisor,
        faults: FaultPlan::none(),
        seed: args.seed,
        jitter: args.jitter,
        bugs: args.bugs.clone(),
        planner: args.measurements.clone(),
        ..RunOptions::new(profile.clone())
    };
    // The baseline: same physics, memory without limit, no planted bug, so
    // the limit and the outputs are known even where the pipeline does not
    // fit.
    let unbounded = RunOptions {
        profile: DeviceProfile {
            memory_bytes: u64::MAX / 4,
            ..profile.clone()
        },
        bugs: Vec::new(),
        faults: FaultPlan::none(),
        ..opts.clone()
    };
    progress(Stage {
        index: 0,
        total,
        what: "resident baseline",
    });
    let resident = run(&w, &StrategyChoice::Resident, &unbounded).map_err(|f| JobError::Run {
        strategy: "resident baseline".to_owned(),
        error: f.error,
    })?;
    let base = Baseline::of(&resident, w.steps);
    let opts = RunOptions {
        faults: args.faults,
        ..opts
    };
    let mut reports = Vec::new();
    let mut traces: Vec<Value> = Vec::new();
    for (i, choice) in choices.iter().enumerate() {
        let name = strategy_name(choice);
        if is_dlo(choice) && ranks > 1 {
            progress(Stage {
                index: i + 1,
                total,
                what: &format!("{name} on {ranks} ranks"),
            });
            let mut r = run_dlo(args, &w, &profile, choice, ranks, (&opts, &unbounded), base)?;
            r.selection_notes = selection_notes(choice);
            reports.push(r);
            continue;
        }
        progress(Stage {
            index: i + 1,
            total,
            what: &name,
        });
        let out = match run(&w, choice, &opts) {
            Ok(out) => out,
            Err(f) => {
                let row = |fits: bool, f: &crate::harness::RunFailure| {
                    let violations = f.violations.iter().map(ToString::to_string).collect();
                    Report::without_figures(
                        &w,
                        &profile,
                        name.clone(),
                        base,
                        fits,
                        f.error.to_string(),
                        violations,
                    )
                };
                if args.faults.any() {
                    let mut r = row(true, &f);
                    r.selection_notes = selection_notes(choice);
                    reports.push(r);
                    continue;
                }
                if f.error.device_error_kind() == Some(DeviceErrorKind::OutOfMemory) {
                    // The weights' bound, and the largest phase's
                    // activations beside them.
                    let bound = memory_bounds(
                        &w.preset.pipeline,
                        &choice.config(),
                        args.prefetch_depth.unwrap_or(1),
                    )
                    .map_or(u64::MAX, |b| b.device_weight_bytes)
                    .saturating_add(max_activation_bytes(&w));
                    if bound > profile.memory_bytes {
                        let mut r = row(false, &f);
                        r.needs_more_bytes = Some(bound - profile.memory_bytes);
                        r.fit = fit_line(&profile, r.needs_more_bytes);
                        r.selection_notes = selection_notes(choice);
                        r.error = Some(format!(
                            "needs {:.2} GB on the device at once (INV-7's bound for the weights and the largest phase's activations), the device has {:.2} GB ({})",
                            bound as f64 / 1e9,
                            profile.memory_bytes as f64 / 1e9,
                            f.error
                        ));
                        reports.push(r);
                        continue;
                    }
                    return Err(JobError::MemoryBug {
                        strategy: name,
                        bound_bytes: bound,
                        capacity_bytes: profile.memory_bytes,
                        error: f.error,
                    });
                }
                return Err(JobError::Run {
                    strategy: name,
                    error: f.error,
                });
            }
        };
        let mut r = report(&w, &profile, &out, &resident);
        r.selection_notes = selection_notes(choice);
        // Beside a planned row, the plan a budget made before (layerwise:
        // encoders and VAE resident, the DiT's blocks planned), run for
        // comparison when it fits.
        let comparison = out.plan.as_ref().and_then(|plan| {
            let alt = plan
                .alternatives
                .iter()
                .find(|a| a.strategy == "layerwise")?;
            alt.predicted_request_s?;
            let mut config = OffloadConfig {
                enable_layerwise_offload: true,
                ..OffloadConfig::default()
            };
            let mut depth = 1;
            for c in &alt.choices {
                if w.preset.dits.contains(&c.path.as_str()) {
                    config
                        .resident_blocks
                        .extend(c.resident_blocks.iter().cloned());
                    depth = depth.max(c.depth);
                }
            }
            Some((config, depth))
        });
        if args.trace {
            let chrome = out.trace.to_chrome_json();
            for mut e in chrome["traceEvents"]
                .as_array()
                .cloned()
                .unwrap_or_default()
            {
                e["pid"] = json!(i);
                traces.push(e);
            }
            traces.push(
                json!({"name": "process_name", "ph": "M", "pid": i, "args": {"name": r.strategy}}),
            );
        }
        reports.push(r);
        if let Some((config, depth)) = comparison {
            let choice = StrategyChoice::Config(config);
            let alt_opts = RunOptions {
                prefetch_depth: depth,
                ..opts.clone()
            };
            match run(&w, &choice, &alt_opts) {
                Ok(out) => {
                    let mut r = report(&w, &profile, &out, &resident);
                    r.strategy = "layerwise (the budget's plan before: encoders and VAE resident)"
                        .to_owned();
                    reports.push(r);
                }
                Err(f) if f.error.device_error_kind() == Some(DeviceErrorKind::OutOfMemory) => {
                    let mut r = Report::without_figures(
                        &w,
                        &profile,
                        "layerwise (the budget's plan before: encoders and VAE resident)"
                            .to_owned(),
                        base,
                        false,
                        f.error.to_string(),
                        Vec::new(),
                    );
                    r.fit = "does not fit under the budget with its slots held in every phase"
                        .to_owned();
                    reports.push(r);
                }
                Err(f) => {
                    return Err(JobError::Run {
                        strategy: "layerwise comparison".to_owned(),
                        error: f.error,
                    });
                }
            }
        }
    }
    Ok(JobOutput {
        preset: w.preset,
        profile,
        divisor,
        reports,
        trace: args
            .trace
            .then(|| json!({"traceEvents": traces, "displayTimeUnit": "ms"})),
    })
}
