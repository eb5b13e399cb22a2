//! The main job: `cargo run --release -p offload-sim -- run`. Runs a
//! real-model-shaped pipeline through the strategies on a simulated GPU and
//! prints, per strategy, time against the physical limit, memory, traffic
//! and whether any residency rule was broken.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use offload_core::{OffloadConfig, OffloadStrategy};
use offload_sim::harness::{RunOptions, RunOutcome, StrategyChoice, Workload, run};
use offload_sim::presets::Preset;
use offload_sim::{DeviceProfile, FaultPlan};
use serde::Serialize;
use serde_json::{Value, json};

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
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StrategyArg {
    /// Every strategy this simulator runs (resident, model-level, layerwise).
    All,
    /// No offload: everything resident.
    None,
    /// Model-level offload.
    ModelLevel,
    /// Layerwise offload.
    Layerwise,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Preset: flux1-dev, wan2.2-t2v-a14b, qwen-image, tiny.
    #[arg(long, default_value = "flux1-dev")]
    model: String,
    /// Strategy to run (ignored with --config).
    #[arg(long, value_enum, default_value = "all")]
    strategy: StrategyArg,
    /// Device profile: h200, rtx4090, l20.
    #[arg(long, default_value = "h200")]
    gpu: String,
    /// Tokens per DiT forward (default: the preset's, e.g. 4096+512 for Flux).
    #[arg(long)]
    tokens: Option<u64>,
    /// Denoising steps per request.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Requests (the first warms up and is not timed).
    #[arg(long, default_value_t = 2)]
    requests: usize,
    /// Blocks the layerwise strategy keeps in flight.
    #[arg(long, default_value_t = 1)]
    prefetch_depth: usize,
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
}

/// One strategy's row, with the fields the issue names.
#[derive(Serialize)]
struct Report {
    strategy: String,
    model: String,
    gpu: String,
    steps: usize,
    tokens: u64,
    step_time_ms: f64,
    resident_step_time_ms: f64,
    limit_ms: f64,
    ratio_to_limit: f64,
    peak_device_weight_bytes: u64,
    device_bound_bytes: u64,
    pinned_host_bytes: u64,
    streamed_weight_bytes: u64,
    h2d_bytes_per_step: u64,
    compute_wait_ms: f64,
    enable_ms: f64,
    output_matches_resident: bool,
    checker_violations: usize,
    violations: Vec<String>,
    /// Whether the strategy ran on this device (false: `error` says why,
    /// typically out of memory).
    fits: bool,
    /// Why it did not run.
    error: Option<String>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

/// Per-step figures of the timed requests (all but the first when there are
/// several).
fn timed(out: &RunOutcome) -> &[offload_sim::harness::RequestMeasure] {
    if out.requests.len() > 1 {
        &out.requests[1..]
    } else {
        &out.requests
    }
}

fn step_ms(out: &RunOutcome, steps: usize) -> f64 {
    median(
        timed(out)
            .iter()
            .map(|r| r.denoise_ns as f64 / steps as f64 / 1e6)
            .collect(),
    )
}

fn report(
    args: &RunArgs,
    preset: &Preset,
    profile: &DeviceProfile,
    out: &RunOutcome,
    resident: &RunOutcome,
    tokens: u64,
) -> Report {
    let steps = args.steps.max(1);
    let step = step_ms(out, steps);
    let resident_step = step_ms(resident, steps);
    let last = timed(out).last().cloned().unwrap_or_default();
    let ideal_bytes = match out.strategy {
        OffloadStrategy::Layerwise | OffloadStrategy::DistributedLayerwise => last.block_bytes,
        OffloadStrategy::ModelLevel => last.dit_bytes,
        OffloadStrategy::None => 0,
    } as f64
        / steps as f64;
    let transfer_ms = ideal_bytes / (profile.h2d_pinned_gbps * 1e9) * 1e3;
    let limit = resident_step.max(transfer_ms);
    let matches = out
        .requests
        .iter()
        .map(|r| r.output)
        .eq(resident.requests.iter().map(|r| r.output));
    let mut violations: Vec<String> = out.violations.iter().map(ToString::to_string).collect();
    if !matches {
        violations
            .push("INV-8 Equivalence violated: outputs differ from the resident run".to_owned());
    }
    let depth = args.prefetch_depth.max(1) as u64;
    Report {
        strategy: out.strategy.to_string(),
        model: preset.name.to_owned(),
        gpu: profile.name.to_owned(),
        steps,
        tokens,
        step_time_ms: step,
        resident_step_time_ms: resident_step,
        limit_ms: limit,
        ratio_to_limit: if limit > 0.0 { step / limit } else { 0.0 },
        peak_device_weight_bytes: out.at_end.device_peak_bytes,
        device_bound_bytes: match out.strategy {
            OffloadStrategy::Layerwise => {
                out.non_block_bytes + (depth + 1) * out.largest_block_bytes
            }
            _ => out.at_end.device_peak_bytes.max(out.device_weight_bytes),
        },
        pinned_host_bytes: out.after_enable.pinned_bytes + out.after_enable.registered_bytes,
        streamed_weight_bytes: out.host_weight_bytes,
        h2d_bytes_per_step: last.denoise_h2d_bytes / steps as u64,
        compute_wait_ms: last.denoise_wait_ns as f64 / steps as f64 / 1e6,
        enable_ms: out.enable_ns as f64 / 1e6,
        output_matches_resident: matches,
        checker_violations: violations.len(),
        violations,
        fits: true,
        error: None,
    }
}

/// The row of a strategy that could not run on this device.
fn unfit(
    args: &RunArgs,
    preset: &Preset,
    profile: &DeviceProfile,
    strategy: String,
    resident_step: f64,
    tokens: u64,
    error: String,
) -> Report {
    Report {
        strategy,
        model: preset.name.to_owned(),
        gpu: profile.name.to_owned(),
        steps: args.steps.max(1),
        tokens,
        step_time_ms: 0.0,
        resident_step_time_ms: resident_step,
        limit_ms: 0.0,
        ratio_to_limit: 0.0,
        peak_device_weight_bytes: 0,
        device_bound_bytes: 0,
        pinned_host_bytes: 0,
        streamed_weight_bytes: 0,
        h2d_bytes_per_step: 0,
        compute_wait_ms: 0.0,
        enable_ms: 0.0,
        output_matches_resident: false,
        checker_violations: 0,
        violations: Vec::new(),
        fits: false,
        error: Some(error),
    }
}

fn gb(bytes: u64) -> String {
    format!("{:.2} GB", bytes as f64 / 1e9)
}

fn print_table(r: &Report) {
    println!(
        "── {} ── {} on {}, {} tokens, {} steps",
        r.strategy, r.model, r.gpu, r.tokens, r.steps
    );
    if let Some(e) = &r.error {
        println!("  does not run on this device: {e}");
        return;
    }
    let rows = [
        ("step time", format!("{:.1} ms", r.step_time_ms)),
        (
            "resident step time",
            format!("{:.1} ms", r.resident_step_time_ms),
        ),
        (
            "limit max(compute, bytes/bandwidth)",
            format!("{:.1} ms", r.limit_ms),
        ),
        ("ratio to limit", format!("{:.3}", r.ratio_to_limit)),
        ("peak device weight memory", gb(r.peak_device_weight_bytes)),
        ("pinned host memory", gb(r.pinned_host_bytes)),
        (
            "streamed weights (host masters)",
            gb(r.streamed_weight_bytes),
        ),
        ("host→device per step", gb(r.h2d_bytes_per_step)),
        (
            "compute waited on transfers",
            format!("{:.1} ms/step", r.compute_wait_ms),
        ),
        ("enable", format!("{:.0} ms", r.enable_ms)),
        (
            "output = resident output",
            r.output_matches_resident.to_string(),
        ),
        ("checker violations", r.checker_violations.to_string()),
    ];
    for (k, v) in rows {
        println!("  {k:<38} {v:>14}");
    }
    for v in &r.violations {
        println!("  ! {v}");
    }
}

fn run_cmd(args: RunArgs) -> Result<()> {
    let preset = Preset::by_name(&args.model).with_context(|| {
        format!(
            "unknown --model `{}`; allowed: {}",
            args.model,
            Preset::NAMES.join(", ")
        )
    })?;
    let profile = DeviceProfile::by_name(&args.gpu).with_context(|| {
        let names: Vec<&str> = DeviceProfile::all().iter().map(|p| p.name).collect();
        format!(
            "unknown --gpu `{}`; allowed: {}",
            args.gpu,
            names.join(", ")
        )
    })?;
    if args.prefetch_depth == 0 {
        bail!("--prefetch-depth must be ≥ 1");
    }
    let tokens = args.tokens.unwrap_or(preset.default_tokens);
    let divisor = match args.payload_divisor {
        Some(d) if d.is_power_of_two() => d,
        Some(d) => bail!("--payload-divisor {d} is not a power of two"),
        None => (preset.weight_bytes() / (64 << 20))
            .max(1)
            .next_power_of_two(),
    };
    let choices: Vec<StrategyChoice> = match (&args.config, args.strategy) {
        (Some(path), _) => {
            let config = OffloadConfig::from_path(path)
                .with_context(|| format!("configuration `{}`", path.display()))?;
            config
                .select()
                .with_context(|| format!("configuration `{}`", path.display()))?;
            vec![StrategyChoice::Config(config)]
        }
        (None, StrategyArg::All) => [
            OffloadStrategy::None,
            OffloadStrategy::ModelLevel,
            OffloadStrategy::Layerwise,
        ]
        .into_iter()
        .map(StrategyChoice::strategy)
        .collect(),
        (None, StrategyArg::None) => vec![StrategyChoice::Resident],
        (None, StrategyArg::ModelLevel) => {
            vec![StrategyChoice::strategy(OffloadStrategy::ModelLevel)]
        }
        (None, StrategyArg::Layerwise) => {
            vec![StrategyChoice::strategy(OffloadStrategy::Layerwise)]
        }
    };
    let workload = Workload {
        preset: preset.clone(),
        tokens,
        steps: args.steps.max(1),
        requests: args.requests.max(1),
    };
    let opts = RunOptions {
        prefetch_depth: args.prefetch_depth,
        payload_divisor: divisor,
        faults: FaultPlan::none(),
        seed: args.seed,
        ..RunOptions::new(profile.clone())
    };
    // The baseline: same physics, memory without limit, so the limit and the
    // outputs are known even where the pipeline does not fit.
    let unbounded = RunOptions {
        profile: DeviceProfile {
            memory_bytes: u64::MAX / 4,
            ..profile.clone()
        },
        ..opts.clone()
    };
    let resident =
        run(&workload, &StrategyChoice::Resident, &unbounded).context("resident baseline")?;
    let mut reports = Vec::new();
    let mut traces: Vec<Value> = Vec::new();
    for (i, choice) in choices.iter().enumerate() {
        let out = match run(&workload, choice, &opts) {
            Ok(out) => out,
            Err(e) => {
                let name = match choice {
                    StrategyChoice::Resident => OffloadStrategy::None.to_string(),
                    StrategyChoice::Config(c) => c
                        .select()
                        .map(|s| s.strategy.to_string())
                        .unwrap_or_default(),
                };
                let resident_step = step_ms(&resident, args.steps.max(1));
                reports.push(unfit(
                    &args,
                    &preset,
                    &profile,
                    name,
                    resident_step,
                    tokens,
                    e.to_string(),
                ));
                continue;
            }
        };
        let r = report(&args, &preset, &profile, &out, &resident, tokens);
        if args.trace.is_some() {
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
    }
    if let Some(path) = &args.trace {
        let doc = json!({"traceEvents": traces, "displayTimeUnit": "ms"});
        std::fs::write(path, serde_json::to_vec(&doc)?)
            .with_context(|| format!("writing trace `{}`", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        println!(
            "{}: {:.1} B parameters, {} of weights; {} (payload: 1 byte in {divisor} kept, sizes and timing exact)\n",
            preset.name,
            preset.parameters() as f64 / 1e9,
            gb(preset.weight_bytes()),
            profile.name
        );
        for r in &reports {
            print_table(r);
            println!();
        }
    }
    if reports.iter().any(|r| r.checker_violations > 0) {
        bail!("residency rules were broken (see the violations above)");
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run_cmd(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
