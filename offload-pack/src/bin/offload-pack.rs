//! `offload-pack`: writes a packed checkpoint beside a safetensors one, or
//! reports the ratios on a synthetic Flux-shaped DiT.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use offload_pack::container::{PackedCheckpoint, default_output, pack_checkpoint};
use offload_pack::format::{Code, EncodeConfig};
use offload_pack::synth::{FluxShape, Law, pack_synthetic_sampled};

/// Packs bf16 weights losslessly (3-bit exponent window code in 4,096-weight
/// tiles; docs/PACKED_FORMAT.md).
#[derive(Parser, Debug)]
#[command(name = "offload-pack", version)]
struct Args {
    /// A checkpoint directory, `.safetensors` file or shard index.
    input: Option<PathBuf>,
    /// The packed file to write (default: `<stem>.opack` beside the input).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Threads (default: every core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print only the totals, not every tensor.
    #[arg(long)]
    quiet: bool,
    /// Instead of a checkpoint: draw a synthetic Flux-shaped DiT of this law
    /// (`normal`, `student-t`, `uniform`, or `all`), pack it tensor by
    /// tensor (round trips checked) and report its ratio.
    #[arg(long)]
    synthetic: Option<String>,
    /// Synthetic model width: heads of 128 (24 = Flux.1-dev's 3072).
    #[arg(long, default_value_t = 24)]
    heads: usize,
    /// Synthetic double blocks.
    #[arg(long, default_value_t = 19)]
    double: usize,
    /// Synthetic single blocks.
    #[arg(long, default_value_t = 38)]
    single: usize,
    /// Synthetic: draw only the first N blocks of each stack; later blocks
    /// count with the figures of block `index % N` (same shapes, same law).
    #[arg(long)]
    sample_blocks: Option<usize>,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the report as JSON too.
    #[arg(long)]
    json: bool,
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The chain of causes on one line, without a backtrace.
            eprintln!("offload-pack: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing::Level::INFO)
        .init();
    let args = Args::parse();
    let cfg = EncodeConfig {
        threads: args.threads,
        ..EncodeConfig::default()
    };
    if let Some(laws) = &args.synthetic {
        return synthetic(&args, laws, &cfg);
    }
    let Some(input) = &args.input else {
        bail!("name a checkpoint (directory, .safetensors or shard index), or pass --synthetic");
    };
    let output = args.output.clone().unwrap_or_else(|| default_output(input));
    let report = pack_checkpoint(input, &output, &cfg)
        .with_context(|| format!("packing {}", input.display()))?;
    if !args.quiet {
        println!(
            "{:<70} {:>14} {:>10} {:>8} {:>8}",
            "tensor", "bf16 bytes", "code", "escapes", "ratio"
        );
        for t in &report.tensors {
            let esc = match t.stats.code {
                Code::Window3 { .. } => format!(
                    "{:.2}%",
                    100.0 * t.stats.escapes as f64 / (t.stats.decoded_bytes / 2).max(1) as f64
                ),
                Code::Raw => "-".into(),
            };
            println!(
                "{:<70} {:>14} {:>10} {:>8} {:>8.4}",
                t.name,
                t.stats.decoded_bytes,
                t.stats.code.label(),
                esc,
                t.stats.ratio()
            );
        }
    }
    let coded = report
        .tensors
        .iter()
        .filter(|t| matches!(t.stats.code, Code::Window3 { .. }))
        .count();
    // Re-open what was written: the loader checks every blob against the
    // manifest.
    let packed = PackedCheckpoint::open(&report.output)
        .with_context(|| format!("re-opening {}", report.output.display()))?;
    println!(
        "{}: {} tensors ({} window-coded, {} raw), {} → {} bytes packed, ratio {:.4}; file {} bytes ({:.4} of bf16); {:.2} s on {} threads ({:.2} GB/s of bf16), every round trip checked",
        report.output.display(),
        report.tensors.len(),
        coded,
        report.tensors.len() - coded,
        report.decoded_bytes,
        report.packed_bytes,
        report.packed_bytes as f64 / report.decoded_bytes.max(1) as f64,
        packed.file_bytes(),
        packed.file_bytes() as f64 / report.decoded_bytes.max(1) as f64,
        report.seconds,
        report.threads,
        report.decoded_bytes as f64 / report.seconds.max(1e-9) / 1e9,
    );
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}

fn synthetic(args: &Args, laws: &str, cfg: &EncodeConfig) -> anyhow::Result<()> {
    let laws: Vec<Law> = if laws == "all" {
        Law::ALL.to_vec()
    } else {
        laws.split(',')
            .map(|l| {
                Law::from_name(l).with_context(|| {
                    format!("law `{l}`: expected normal, student-t, uniform or all")
                })
            })
            .collect::<anyhow::Result<_>>()?
    };
    let shape = FluxShape {
        heads: args.heads,
        double: args.double,
        single: args.single,
        ..FluxShape::dev()
    };
    println!(
        "synthetic Flux-shaped DiT: hidden {}, {} double + {} single blocks, {} weights ({} bf16 bytes), seed {}, {} threads",
        shape.hidden(),
        shape.double,
        shape.single,
        shape.weights(),
        2 * shape.weights(),
        args.seed,
        cfg.threads()
    );
    if let Some(n) = args.sample_blocks {
        println!(
            "blocks drawn: the first {n} of each stack; the others count with their twin's figures"
        );
    }
    println!(
        "{:<10} {:>8} {:>10} {:>12} {:>10} {:>10} {:>12}",
        "law", "ratio", "escapes", "coded/raw", "draw s", "encode s", "encode GB/s"
    );
    let mut rows = Vec::new();
    for law in laws {
        let t = Instant::now();
        let r = pack_synthetic_sampled(
            &shape,
            law,
            args.seed,
            cfg,
            args.sample_blocks.unwrap_or(usize::MAX),
        )?;
        let (w, raw) = r.codes();
        println!(
            "{:<10} {:>8.4} {:>9.2}% {:>12} {:>10.1} {:>10.1} {:>12.2}",
            law.name(),
            r.ratio(),
            100.0 * r.escape_share(),
            format!("{w}/{raw}"),
            r.draw_seconds,
            r.encode_seconds,
            r.drawn_bytes as f64 / r.encode_seconds.max(1e-9) / 1e9
        );
        if !args.quiet {
            for (name, dims, st) in &r.tensors {
                tracing::debug!("{name} {dims:?} {} {:.4}", st.code.label(), st.ratio());
            }
        }
        rows.push(serde_json::json!({
            "law": law.name(), "ratio": r.ratio(), "escape_share": r.escape_share(),
            "decoded_bytes": r.decoded_bytes(), "packed_bytes": r.packed_bytes(),
            "window_coded": w, "raw": raw, "draw_seconds": r.draw_seconds,
            "encode_seconds": r.encode_seconds, "seconds": t.elapsed().as_secs_f64(),
            "drawn_bytes": r.drawn_bytes, "sample_blocks": args.sample_blocks,
        }));
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({"hidden": shape.hidden(), "double": shape.double, "single": shape.single, "weights": shape.weights(), "laws": rows})
        );
    }
    Ok(())
}
