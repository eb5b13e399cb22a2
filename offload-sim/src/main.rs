//! The main job: `cargo run --release -p offload-sim -- run`. Parses the
//! flags, runs [`offload_sim::job`], prints tables or JSON. Exit status: 0
//! when every strategy ran (or did not fit, which its row says) and no rule
//! was broken; non-zero with the typed error otherwise.
//!
//! `offload-sim plan` answers the capacity question without running
//! anything ([`offload_sim::plan`]): exit status 0 when the model fits the
//! budget, non-zero with the planner's error when it does not.

use std::collections::HashSet;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use offload_core::OffloadStrategy;
use offload_sim::job::{JobArgs, JobOutput, Report, Stage, StrategySet, run_job};
use offload_sim::plan::{Capacity, PlanArgs, capacity};

/// How long a job runs before its progress bar appears: shorter jobs draw
/// nothing.
const SHOW_PROGRESS_AFTER: Duration = Duration::from_secs(1);

/// The job's progress bar (indicatif, on stderr): drawn only when stderr
/// is a terminal and only once the job has run for
/// [`SHOW_PROGRESS_AFTER`]; otherwise nothing is drawn and no progress line
/// is printed (tests, CI and pipes see only the results and the log).
struct Progress {
    bar: ProgressBar,
    /// Set when the job is over; the timer thread draws nothing after it.
    finished: Arc<Mutex<bool>>,
}

impl Progress {
    fn new() -> Self {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:24} {pos}/{len} runs: {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Self {
            bar,
            finished: Arc::new(Mutex::new(false)),
        }
    }

    /// Draws the bar after [`SHOW_PROGRESS_AFTER`] if `terminal` (stderr
    /// is one) and the job is still running then.
    fn start(&self, terminal: bool) {
        if !terminal {
            return;
        }
        let (bar, finished) = (self.bar.clone(), Arc::clone(&self.finished));
        std::thread::spawn(move || {
            std::thread::sleep(SHOW_PROGRESS_AFTER);
            let finished = finished.lock().unwrap_or_else(PoisonError::into_inner);
            if !*finished {
                bar.set_draw_target(ProgressDrawTarget::stderr());
                bar.enable_steady_tick(Duration::from_millis(100));
            }
        });
    }

    fn stage(&self, stage: Stage<'_>) {
        self.bar.set_length(stage.total as u64);
        self.bar.set_position(stage.index as u64);
        self.bar.set_message(stage.what.to_owned());
    }

    fn finish(&self) {
        let mut finished = self.finished.lock().unwrap_or_else(PoisonError::into_inner);
        *finished = true;
        self.bar.finish_and_clear();
    }
}

/// Where log lines go: stderr, each distinct line once (the strategy
/// selection logs its notes each time a configuration is selected, which
/// the job does several times), and around the progress bar, not through
/// it.
#[derive(Clone)]
struct LogWriter {
    seen: Arc<Mutex<HashSet<Vec<u8>>>>,
    bar: ProgressBar,
}

/// One log line being formatted; written when complete.
struct LogLine {
    line: Vec<u8>,
    to: LogWriter,
}

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.line.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let line = std::mem::take(&mut self.line);
        let new = self
            .to
            .seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(line.clone());
        if new {
            self.to.bar.suspend(|| {
                let _ = std::io::stderr().write_all(&line);
            });
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogLine;

    fn make_writer(&'a self) -> LogLine {
        LogLine {
            line: Vec::new(),
            to: self.clone(),
        }
    }
}

#[derive(Parser)]
#[command(
    name = "offload-sim",
    about = "Plan and check offloading of diffusion pipelines on a simulated GPU"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a pipeline through the strategies and report time, memory and checks.
    Run(RunArgs),
    /// Plan a device budget without running: what stays resident, what
    /// streams, the predicted step (the core's planner on the profile's
    /// link and the kernel model). Fails when the model does not fit.
    Plan(PlanCmdArgs),
    /// Fit a profile's kernel model to a card's measured block compute: the
    /// resident rows of an `offload-bench` JSON (DiT-only mode), whose
    /// traced per-block compute gives each token count's mean block time.
    /// Prints the fitted parameters and each point's error.
    Fit(FitArgs),
}

#[derive(clap::Args)]
struct FitArgs {
    /// The `offload-bench --json` file (plain JSON, not gzipped).
    #[arg(long)]
    measured: PathBuf,
    /// The profile whose other figures (link, memory) the fit keeps and
    /// whose kernel parameters it starts from: h200, h100, rtx4090, l20.
    #[arg(long, default_value = "h200")]
    base: String,
    /// Device memory bandwidth in GB/s instead of the base's (the floor of
    /// one-row GEMMs and the bytes a block reads besides its GEMMs).
    #[arg(long)]
    hbm_gbps: Option<f64>,
    /// The elementwise rate in GB/s instead of the JSON's measured
    /// `elementwise_gbps` (else the base's).
    #[arg(long)]
    elementwise_gbps: Option<f64>,
    /// Hold `kernel_latency_us` at this value (µs) instead of fitting it.
    #[arg(long)]
    kernel_latency_us: Option<f64>,
}

#[derive(clap::Args)]
struct PlanCmdArgs {
    /// Device profile: h200, h100, rtx4090, l20.
    #[arg(long)]
    gpu: String,
    /// Preset: flux1-dev, wan2.2-t2v-a14b, qwen-image, tiny (not with
    /// --pipeline).
    #[arg(long, default_value = "flux1-dev", conflicts_with = "pipeline")]
    model: String,
    /// Your own pipeline description (JSON: modules, tensors, components;
    /// see offload_sim::plan::UserPipeline) instead of a preset.
    #[arg(long)]
    pipeline: Option<PathBuf>,
    /// Tokens per denoising forward, 1 to 1048576 (default: the pipeline's
    /// warm-up request, e.g. 4096+512 for Flux).
    #[arg(long)]
    tokens: Option<u64>,
    /// Denoising steps of a request, 1 to 10000 (default: the pipeline's
    /// warm-up request).
    #[arg(long)]
    steps: Option<u32>,
    /// Device budget: `auto` (default: the card's memory less --headroom)
    /// or a size, e.g. `24GiB`, `16 GB`.
    #[arg(long)]
    budget: Option<String>,
    /// What `auto` leaves free (default 1GiB).
    #[arg(long)]
    headroom: Option<String>,
    /// Host budget (CONTRACT §7c): the most page-locked host memory, `auto`
    /// (this machine's) or a size; held sets stay pinned, streamed blocks
    /// beyond it stream staged (default: every master pinned).
    #[arg(long)]
    host_budget: Option<String>,
    /// Device memory in GB (10^9 bytes) instead of the profile's.
    #[arg(long)]
    device_memory_gb: Option<f64>,
    /// Plan from these planner inputs (a warm-up's measurements saved with
    /// `run --save-measurements`) instead of the simulator's estimates.
    #[arg(long)]
    inputs: Option<PathBuf>,
    /// `weight_compression`: none (default), lossless or auto; coded
    /// blocks priced at their sizes estimated on weights that look trained
    /// and the profile's decoder (CONTRACT §7b).
    #[arg(long)]
    weight_compression: Option<String>,
    /// `pin_cpu_memory`: true (default) or false (every master pageable,
    /// staged through pinned buffers at the profile's host fill rate;
    /// CONTRACT §7c).
    #[arg(long)]
    pin_cpu_memory: Option<String>,
    /// Also write the plan as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StrategyArg {
    /// Every strategy (resident, model-level, layerwise; and distributed
    /// layerwise with --ranks above 1).
    All,
    /// No offload: everything resident.
    None,
    /// Model-level offload.
    ModelLevel,
    /// Layerwise offload.
    Layerwise,
    /// Distributed layerwise offload (with --ranks G: G simulated GPUs).
    DistributedLayerwise,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Preset: flux1-dev, wan2.2-t2v-a14b, qwen-image, tiny.
    #[arg(long, default_value = "flux1-dev")]
    model: String,
    /// Strategy to run (default: all); not with --config, which selects one.
    #[arg(long, value_enum, conflicts_with = "config")]
    strategy: Option<StrategyArg>,
    /// Device profile: h200, h100, rtx4090, l20.
    #[arg(long, default_value = "h200")]
    gpu: String,
    /// Tokens per DiT forward, 1 to 1048576 (default: the preset's, e.g.
    /// 4096+512 for Flux).
    #[arg(long)]
    tokens: Option<u64>,
    /// Denoising steps per request, 1 to 10000.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Requests, 1 to 1000 (the first warms up and is not timed).
    #[arg(long, default_value_t = 2)]
    requests: usize,
    /// Blocks the layerwise strategy keeps in flight, 1 to 16 (default 1,
    /// or the configuration's `prefetch_depth`).
    #[arg(long)]
    prefetch_depth: Option<usize>,
    /// A JSON or TOML configuration (flags, diffusion_offload_config, parallel);
    /// the strategy is then whatever it selects.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace (one track per stream) here.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Keep one payload byte in N (a power of two); default: enough to stay
    /// under 64 MiB of simulated payload.
    #[arg(long)]
    payload_divisor: Option<u64>,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Device memory in GB (10^9 bytes) instead of the profile's, to plan
    /// for another card.
    #[arg(long)]
    device_memory_gb: Option<f64>,
    /// Ranks of distributed layerwise offload, 1 to 64: each a simulated
    /// GPU on its own thread, gathering over the profile's link (default:
    /// the configuration's world size, else 1).
    #[arg(long)]
    ranks: Option<u32>,
    /// Write the planned row's measurements (what its warm-up measured on
    /// the simulated device) here, to plan from them again.
    #[arg(long)]
    save_measurements: Option<PathBuf>,
    /// Plan a device budget from these measurements (saved with
    /// --save-measurements) instead of a warm-up.
    #[arg(long)]
    measurements: Option<PathBuf>,
    /// Plant a bug in the strategies under test (test builds only).
    #[cfg(feature = "planted-bugs")]
    #[arg(long, hide = true)]
    plant: Vec<String>,
}

fn gb(bytes: Option<u64>) -> String {
    bytes.map_or_else(|| "–".to_owned(), |b| format!("{:.2} GB", b as f64 / 1e9))
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.1} ms"))
}

fn print_table(r: &Report) {
    println!(
        "── {} ── {} on {}, {} tokens, {} steps",
        r.strategy, r.model, r.gpu, r.tokens, r.steps
    );
    println!("  {}", r.fit);
    for note in &r.selection_notes {
        println!("  configuration: {note}");
    }
    if let Some(e) = &r.error {
        if r.fits {
            println!("  failed: {e}");
        } else {
            println!("  does not fit on this device: {e}");
        }
        for v in &r.violations {
            println!("  ! {v}");
        }
        return;
    }
    let per_image = format!("time per image ({} steps)", r.steps);
    let rows = [
        ("step time", ms(r.step_time_ms)),
        (per_image.as_str(), ms(r.image_time_ms)),
        ("resident step time", ms(Some(r.resident_step_time_ms))),
        ("compute (kernel model)", ms(Some(r.compute_ms))),
        ("limit max(compute, bytes/bandwidth)", ms(r.limit_ms)),
        (
            "ratio to limit",
            r.ratio_to_limit
                .map_or_else(|| "–".to_owned(), |v| format!("{v:.3}")),
        ),
        ("peak device weight memory", gb(r.peak_device_weight_bytes)),
        ("INV-7 device bound", gb(r.device_bound_bytes)),
        (
            "host masters (pinned + registered)",
            gb(r.pinned_host_bytes),
        ),
        (
            "peak host, enable's staging included",
            gb(r.peak_host_bytes),
        ),
        ("INV-7 host bound", gb(r.host_bound_bytes)),
        ("host→device per step", gb(r.h2d_bytes_per_step)),
        ("compute waited on transfers", ms(r.compute_wait_ms)),
        ("enable", ms(r.enable_ms)),
        (
            "output = resident output",
            r.output_matches_resident
                .map_or_else(|| "–".to_owned(), |m| m.to_string()),
        ),
        ("rules broken", r.checker_violations.to_string()),
    ];
    for (k, v) in rows {
        println!("  {k:<38} {v:>14}");
    }
    if !matches!(r.weight_compression.as_str(), "" | "none") {
        let coded = [
            ("weight_compression", r.weight_compression.clone()),
            (
                "link bytes / bf16 block bytes",
                r.link_ratio
                    .map_or_else(|| "–".to_owned(), |v| format!("{v:.4}")),
            ),
            (
                "decodes per step",
                r.decodes_per_step
                    .map_or_else(|| "–".to_owned(), |v| format!("{v:.1}")),
            ),
            ("decode engine per step", ms(r.decode_ms_per_step)),
        ];
        for (k, v) in coded {
            println!("  {k:<38} {v:>14}");
        }
    }
    if !r.per_rank.is_empty() {
        println!(
            "  limit for {} ranks: max(compute, streamed / (G × per-rank bandwidth) + exposed gather {}); gathers {} per step on rank 0",
            r.ranks,
            ms(r.exposed_gather_ms),
            ms(r.gather_ms_per_step)
        );
        println!(
            "  {:>4} {:>10} {:>12} {:>10} {:>12} {:>12} {:>12} {:>9} {:>10} {:>7} {:>7}",
            "rank",
            "step",
            "host",
            "/streamed",
            "host bound",
            "peak dev",
            "dev bound",
            "gathers",
            "gather",
            "INV-9",
            "= res"
        );
        for q in &r.per_rank {
            println!(
                "  {:>4} {:>10} {:>12} {:>10.4} {:>12} {:>12} {:>12} {:>9.1} {:>10} {:>7} {:>7}",
                q.rank,
                ms(Some(q.step_time_ms)),
                gb(Some(q.host_master_bytes)),
                q.host_fraction_of_streamed,
                gb(Some(q.host_bound_bytes)),
                gb(Some(q.peak_device_weight_bytes)),
                gb(Some(q.device_bound_bytes)),
                q.gathers_per_step,
                ms(Some(q.gather_ms_per_step)),
                q.collective_violations,
                q.output_matches_resident
            );
        }
    }
    if let Some(plan) = &r.plan {
        print_plan(r, plan);
    }
    for v in &r.violations {
        println!("  ! {v}");
    }
}

/// A planned row's plan, its phases measured against it, and what the
/// plan was made from.
fn print_plan(r: &Report, plan: &offload_core::budget::RequestPlan) {
    let gb = |b: u64| b as f64 / 1e9;
    if let Some(m) = &r.measurements {
        let how = match &m.source {
            offload_core::budget::InputSource::Warmup { shape, .. } => {
                format!("measured by a warm-up of {shape} on the simulated device")
            }
            offload_core::budget::InputSource::Estimated => "estimated".to_owned(),
            offload_core::budget::InputSource::Given => "given (--measurements)".to_owned(),
        };
        println!(
            "  plan from inputs {how}: link {:.2} GB/s{}",
            m.link_bytes_per_s / 1e9,
            if r.replanned {
                "; re-planned once after the first request ran out of memory"
            } else {
                ""
            }
        );
    }
    for line in plan.to_string().lines() {
        println!("  {line}");
    }
    println!(
        "  time per image (the whole request): measured {} against predicted {:.1} ms",
        ms(r.request_time_ms),
        plan.predicted_request_s * 1e3
    );
    println!(
        "  {:<18} {:>9} {:>12} {:>12} {:>11} {:>11} {:>11} {:>9}",
        "phase", "mode", "measured", "predicted", "peak", "weights", "bound", "budget"
    );
    for p in &r.phases {
        println!(
            "  {:<18} {:>9} {:>12} {:>12} {:>8.2} GB {:>8.2} GB {:>8.2} GB {:>6.2} GB",
            p.component,
            p.mode,
            ms(Some(p.measured_ms)),
            ms(Some(p.predicted_ms)),
            gb(p.peak_bytes),
            gb(p.peak_weight_bytes),
            gb(p.weight_bound_bytes),
            gb(p.budget_bytes),
        );
    }
}

fn job_args(args: &RunArgs) -> Result<JobArgs> {
    #[cfg(feature = "planted-bugs")]
    let bugs = args
        .plant
        .iter()
        .map(|name| {
            offload_core::runtime::PlantedBug::from_name(name).with_context(|| {
                let names: Vec<String> = offload_core::runtime::PlantedBug::ALL
                    .iter()
                    .map(|b| b.name())
                    .collect();
                format!("--plant {name}: allowed: {}", names.join(", "))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    #[cfg(not(feature = "planted-bugs"))]
    let bugs = Vec::new();
    Ok(JobArgs {
        model: args.model.clone(),
        strategy: match args.strategy.unwrap_or(StrategyArg::All) {
            StrategyArg::All => StrategySet::All,
            StrategyArg::None => StrategySet::One(OffloadStrategy::None),
            StrategyArg::ModelLevel => StrategySet::One(OffloadStrategy::ModelLevel),
            StrategyArg::Layerwise => StrategySet::One(OffloadStrategy::Layerwise),
            StrategyArg::DistributedLayerwise => {
                StrategySet::One(OffloadStrategy::DistributedLayerwise)
            }
        },
        gpu: args.gpu.clone(),
        tokens: args.tokens,
        steps: args.steps,
        requests: args.requests,
        prefetch_depth: args.prefetch_depth,
        config: args.config.clone(),
        payload_divisor: args.payload_divisor,
        seed: args.seed,
        jitter: None,
        bugs,
        device_memory_bytes: match args.device_memory_gb {
            None => None,
            Some(gb) if gb.is_finite() && gb > 0.0 && gb < 1e9 => Some((gb * 1e9) as u64),
            Some(gb) => anyhow::bail!(
                "--device-memory-gb `{gb}` is not allowed; allowed: more than 0 and less than 10^9"
            ),
        },
        faults: offload_sim::FaultPlan::none(),
        trace: args.trace.is_some(),
        ranks: args.ranks,
        measurements: match &args.measurements {
            None => None,
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading --measurements `{}`", path.display()))?;
                Some(
                    offload_core::budget::PlannerInputs::from_json_str(&text)
                        .map_err(|e| anyhow::anyhow!("--measurements `{}`: {e}", path.display()))?,
                )
            }
        },
    })
}

fn print(args: &RunArgs, out: &JobOutput) -> Result<()> {
    if let Some(path) = &args.save_measurements {
        let m = out
            .reports
            .iter()
            .find_map(|r| r.measurements.as_ref())
            .context("--save-measurements: no row was planned from a device budget")?;
        std::fs::write(path, m.to_json())
            .with_context(|| format!("writing measurements `{}`", path.display()))?;
    }
    if let (Some(path), Some(trace)) = (&args.trace, &out.trace) {
        std::fs::write(path, serde_json::to_vec(trace)?)
            .with_context(|| format!("writing trace `{}`", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out.reports)?);
        return Ok(());
    }
    println!(
        "{}: {:.1} B parameters, {:.2} GB of weights; {} with {:.0} GB (payload: 1 byte in {} kept, sizes and timing exact)\n",
        out.preset.name,
        out.preset.parameters() as f64 / 1e9,
        out.preset.weight_bytes() as f64 / 1e9,
        out.profile.name,
        out.profile.memory_bytes as f64 / 1e9,
        out.divisor
    );
    for r in &out.reports {
        print_table(r);
        println!();
    }
    Ok(())
}

fn fit_cmd(args: FitArgs) -> Result<()> {
    use offload_sim::DeviceProfile;
    use offload_sim::fit;
    let mut base = DeviceProfile::by_name(&args.base).ok_or_else(|| {
        anyhow::anyhow!(
            "--base `{}`: allowed: {}",
            args.base,
            DeviceProfile::names()
        )
    })?;
    let text = std::fs::read_to_string(&args.measured)
        .with_context(|| format!("--measured {}", args.measured.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("--measured {}: not JSON", args.measured.display()))?;
    let rate = |flag: &str, v: Option<f64>| -> Result<Option<f64>> {
        match v {
            Some(g) if !(g.is_finite() && g > 0.0 && g < 1e6) => {
                anyhow::bail!("{flag} {g}: allowed: more than 0 and less than 10^6 GB/s")
            }
            v => Ok(v),
        }
    };
    if let Some(g) = rate("--hbm-gbps", args.hbm_gbps)? {
        base.hbm_gbps = g;
    }
    let measured_rate = json
        .get("elementwise_gbps")
        .and_then(serde_json::Value::as_f64)
        .filter(|g| g.is_finite() && *g > 0.0);
    if let Some(g) = rate("--elementwise-gbps", args.elementwise_gbps)?.or(measured_rate) {
        base.elementwise_gbps = g;
    }
    let measured = fit::measured_from_bench(&json)
        .with_context(|| format!("--measured {}", args.measured.display()))?;
    let f = fit::fit(
        &offload_sim::presets::flux1_dev(),
        &base,
        &measured,
        args.kernel_latency_us,
    )?;
    let p = &f.profile;
    println!(
        "{} points from {} (device {}), fitted from {} (hbm {:.0} GB/s, elementwise {:.0} GB/s):",
        f.points.len(),
        args.measured.display(),
        json.get("device").and_then(|d| d.as_str()).unwrap_or("?"),
        args.base,
        p.hbm_gbps,
        p.elementwise_gbps
    );
    println!(
        "compute_tflops {:.1}, gemm_half_rows {:.1}, attention_tflops {:.1}, kernel_latency_us {:.2}",
        p.compute_tflops, p.gemm_half_rows, p.attention_tflops, p.kernel_latency_us
    );
    println!("| tokens | block list | measured ms | model ms | model / measured |");
    println!("| --- | --- | --- | --- | --- |");
    for (m, s) in &f.points {
        println!(
            "| {} | {} | {:.3} | {:.3} | {:.3} |",
            m.tokens,
            m.list,
            m.seconds * 1e3,
            s * 1e3,
            s / m.seconds
        );
    }
    println!(
        "rms log error {:.4}; worst point {:.1} %",
        f.rms_log,
        f.worst * 100.0
    );
    Ok(())
}

fn run_cmd(args: RunArgs, progress: &Progress) -> Result<()> {
    let job = job_args(&args)?;
    progress.start(std::io::stderr().is_terminal());
    let out = run_job(&job, &mut |stage| progress.stage(stage));
    progress.finish();
    let out = out?;
    print(&args, &out)?;
    out.verdict()?;
    Ok(())
}

fn print_capacity(c: &Capacity) {
    let gb = |b: u64| b as f64 / 1e9;
    let verdict = match &c.outcome {
        Ok(_) => "fits".to_owned(),
        Err(e) => match c.minimum_bytes() {
            Some(m) => format!("does not fit: needs at least {:.2} GB ({e})", gb(m)),
            None => format!("cannot be planned: {e}"),
        },
    };
    println!(
        "{} ({:.2} GB of weights) on {} ({:.2} GB), {} tokens × {} steps, device_budget {}: {verdict}",
        c.model,
        gb(c.weight_bytes),
        c.gpu,
        gb(c.memory_bytes),
        c.tokens,
        c.steps,
        c.config
            .device_budget
            .map_or_else(|| "–".to_owned(), |b| b.to_string()),
    );
    let source = match &c.inputs.source {
        offload_core::budget::InputSource::Estimated => {
            "estimated by the simulator's kernel and activation models".to_owned()
        }
        offload_core::budget::InputSource::Given => "given".to_owned(),
        offload_core::budget::InputSource::Warmup { seconds, shape, .. } => {
            format!("measured by a warm-up of {shape} ({seconds:.2} s)")
        }
    };
    println!(
        "  inputs: {source}; link {:.1} GB/s",
        c.inputs.link_bytes_per_s / 1e9
    );
    if let Ok(p) = &c.outcome {
        for line in p.to_string().lines() {
            println!("  {line}");
        }
        let phases: Vec<String> = p
            .minimum
            .phases
            .iter()
            .map(|(c, b)| format!("{c} {:.2} GB", gb(*b)))
            .collect();
        println!(
            "  least budget {:.2} GB: each phase's own minimum: {}",
            gb(p.minimum.bytes),
            phases.join(", ")
        );
    }
}

fn plan_cmd(args: PlanCmdArgs) -> Result<()> {
    let plan_args = PlanArgs {
        model: args.model,
        pipeline: args.pipeline,
        gpu: args.gpu,
        tokens: args.tokens,
        steps: args.steps,
        budget: args.budget,
        headroom: args.headroom,
        host_budget: args.host_budget,
        device_memory_gb: args.device_memory_gb,
        weight_compression: args.weight_compression,
        pin_cpu_memory: args.pin_cpu_memory,
    };
    let mut c = capacity(&plan_args)?;
    if let Some(path) = &args.inputs {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading planner inputs `{}`", path.display()))?;
        let inputs = offload_core::budget::PlannerInputs::from_json_str(&text)
            .map_err(|e| anyhow::anyhow!("--inputs `{}`: {e}", path.display()))?;
        c = offload_sim::plan::capacity_with(&plan_args, inputs)?;
    }
    print_capacity(&c);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&c.to_json())?)
            .with_context(|| format!("writing plan `{}`", path.display()))?;
    }
    c.verdict()
        .with_context(|| format!("{} on {}", c.model, c.gpu))?;
    Ok(())
}

fn main() -> ExitCode {
    let progress = Progress::new();
    tracing_subscriber::fmt()
        .with_writer(LogWriter {
            seen: Arc::default(),
            bar: progress.bar.clone(),
        })
        .with_target(false)
        .without_time()
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run_cmd(args, &progress),
        Command::Plan(args) => plan_cmd(args),
        Command::Fit(args) => fit_cmd(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
