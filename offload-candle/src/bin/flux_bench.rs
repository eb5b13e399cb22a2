//! The candle Flux DiT on a GPU, streamed by offload from a safetensors
//! checkpoint, against itself resident and against diffusers.
//!
//! ```sh
//! offload-flux-bench --ckpt DIR --inputs inputs.safetensors --reference diffusers_out.safetensors
//! ```
//!
//! In one process: the host→device bandwidth of pinned memory; `enable`
//! from the checkpoint (mapping, validation, registration in place, the
//! resident rest) with the host memory it added; the offloaded step (median
//! of `--steps`) and its output; the resident candle step (every weight
//! loaded by candle's own safetensors reader) and its output; the two
//! outputs compared bit for bit, and against diffusers' (cosine, max abs
//! error); step / limit with limit = max(resident step, streamed bytes /
//! bandwidth); then `--growth-steps` offloaded steps at a small size with
//! host and device memory read after the warm-up and at the end; then, for
//! each of `--budgets`, the DiT enabled with that `device_budget` through
//! `Runtime::enable_selected` (the runtime's request, `shape.steps` candle
//! forwards, measured by the planned backend's warm-up), one request timed
//! (median step), its outputs against resident bit for bit and the
//! allocator's peak against the budget: a table row each. One JSON object
//! last.
//!
//! The fast paths ([`flux::Kernels`]) are checked first, each against
//! candle's plain operations on the same random bf16 inputs (up to 4,608
//! tokens; cosine ≥ 0.9999, max abs ≤ 2 % of the largest output): with
//! flash attention (the `flash-attn` build), FlashAttention-2 against the
//! unfused attention at Flux's shape (24 heads of 128); the cuBLASLt bias
//! epilogue against candle's `Linear`; the fused AdaLN against norm,
//! multiply and add. After the resident steps, the resident step with each
//! fast path switched off (the attention ones up to 4,608 tokens), timed
//! and compared with the full one (cosine ≥ 0.999): what each bought. A
//! failed check fails the run (exit 1) after the JSON is written. The
//! report names the paths and the law the checkpoint's weights were drawn
//! from (`_offload_init` in config.json), and counts the cuBLASLt GEMMs and
//! fallbacks of the offloaded and the resident steps.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use offload_candle::cuda::ZeroCopy;
use offload_candle::flux::{self, Flux, FluxConfig, FluxInputs};
use offload_core::bytes::DeviceBudget;
use offload_core::device::{Device as _, HostBuffer as _, HostSource};
use offload_core::model::PipelineBuilder;
use offload_core::request::RequestShape;
use offload_core::runtime::{Backend, CorePlatform, Runtime, WeightSource};
use offload_core::{ComponentDeclaration, OffloadConfig, Pipeline};
use offload_cuda::{Cuda, CudaDevice};
use offload_safetensors::{Checkpoint, NameMap, SafetensorsSource};

#[derive(Parser, Debug)]
#[command(about = "candle Flux DiT streamed by offload from a safetensors checkpoint")]
struct Args {
    /// diffusers checkpoint directory (config.json + safetensors shards).
    #[arg(long)]
    ckpt: PathBuf,
    /// Inputs (.safetensors written by flux_reference.py or FluxInputs::save).
    #[arg(long)]
    inputs: PathBuf,
    /// diffusers' output on the same inputs (.safetensors with `output`).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Timed steps per figure (median reported).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    steps: u32,
    /// Untimed offloaded steps before the timed ones, 1 to 100: with a
    /// deep look-ahead the first timed steps after one untimed step ran
    /// short (seen on an H100, depth 16: 0.55 of the link's time at 4,608
    /// tokens, 0.88-0.91 at 9,728), so a steady-state figure needs a few.
    /// The likely reading, not checked: the cold first step's compute let
    /// the copy engine fill every look-ahead slot (Flux's first 16 blocks
    /// are double blocks, 46 % of the bytes) before the timed step began.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    warmup: u32,
    /// Offloaded steps of the memory-growth run.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    growth_steps: u32,
    /// Blocks left streaming in the growth run (the rest resident, so that
    /// 1,000 steps take seconds, not minutes).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=57))]
    growth_streamed: u32,
    /// Layerwise prefetch depth.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
    depth: u32,
    /// Plant a bug (`skip-exit`: closing a scope does not order the slot's
    /// reuse after candle's kernels); needs the `planted-bugs` build. The
    /// run then reports whether the offloaded output still equals resident.
    #[arg(long)]
    plant: Option<String>,
    /// f32 GEMMs (the attention scores, of bf16 values) on TF32 tensor
    /// cores: exact products of bf16-valued inputs, f32 accumulation.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    tf32: bool,
    /// `weight_compression` of the layerwise rows (CONTRACT §7b): `none`,
    /// or `lossless` (every streamed block coded at enable and decoded on
    /// the GPU by offload-cuda's `CudaCodec`, beside candle's compute).
    #[arg(long, default_value = "none", value_parser = ["none", "lossless"])]
    weight_compression: String,
    /// Attention path of the timed forwards: `auto` (flash where this build
    /// has it), `flash` or `unfused`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "flash", "unfused"])]
    attention: String,
    /// Tokens of the flash-vs-unfused attention check (at most this and the
    /// inputs' tokens; 0 skips the check and the unfused forward).
    #[arg(long, default_value_t = 4608)]
    check_tokens: usize,
    /// Device budgets of the request planner to run the DiT under, after
    /// the resident run: a comma-separated list of sizes ("16GiB") or
    /// `auto`, or `none`.
    #[arg(long, default_value = "16GiB,8GiB,auto")]
    budgets: String,
    /// diffusers' JSON on the same checkpoint and inputs (its
    /// `group_offload_step_s`, if present, is what each budget's step is
    /// set against).
    #[arg(long)]
    diffusers_json: Option<PathBuf>,
    /// Write the JSON here as well.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Time the resident step with each fast path switched off (what each
    /// bought); `false` skips them (a sweep of token counts that needs
    /// only the offloaded and resident steps).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    ablation: bool,
}

/// The budgets of `--budgets` (`none`: no budget).
fn parse_budgets(text: &str) -> Result<Vec<DeviceBudget>> {
    if text.trim() == "none" {
        return Ok(Vec::new());
    }
    text.split(',')
        .map(|b| DeviceBudget::parse(b.trim()).map_err(|e| anyhow!("--budgets: {e}")))
        .collect()
}

/// The bounds of the flash-vs-unfused checks: the attention alone (both
/// paths bf16 in and out, f32 accumulation: they differ by bf16 roundings
/// of the probabilities and the output) and the whole forward (57 blocks
/// of such differences, the bar the diffusers comparison has).
const ATTENTION_MIN_COSINE: f64 = 0.9999;
const ATTENTION_MAX_ABS_OVER_MAX: f32 = 0.02;
const FORWARD_MIN_COSINE: f64 = 0.999;

/// One fast path against candle's plain operations on the same inputs:
/// (cosine, max abs, max |plain|) into `cases` and, past the bounds, a line
/// into `failed`.
fn check_case(
    what: String,
    fast: &Tensor,
    plain: &Tensor,
    cases: &mut Vec<serde_json::Value>,
    failed: &mut Vec<String>,
) -> Result<()> {
    let (cos, max_abs) = compare(
        &fast.to_device(&Device::Cpu)?,
        &plain.to_device(&Device::Cpu)?,
    )?;
    let peak = plain
        .to_dtype(DType::F32)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    let ok = cos >= ATTENTION_MIN_COSINE && max_abs <= ATTENTION_MAX_ABS_OVER_MAX * peak;
    if !ok {
        failed.push(format!(
            "{what}: cosine {cos} (bound {ATTENTION_MIN_COSINE}), max abs {max_abs} against \
             max |plain| {peak} (bound {ATTENTION_MAX_ABS_OVER_MAX} of it)"
        ));
    }
    cases.push(serde_json::json!({
        "what": what, "cosine": cos, "max_abs": max_abs, "max_abs_plain": peak, "ok": ok,
    }));
    Ok(())
}

/// The cuBLASLt bias epilogue against candle's `Linear` (3072 → 3072 and
/// 12288 → 3072, weights of deviation 1/√fan-in) and the fused AdaLN
/// against norm, multiply and add, on random bf16 inputs of `tokens` rows,
/// into `report["kernel_checks"]`.
fn check_kernels(
    candle: &Device,
    cfg: &FluxConfig,
    tokens: usize,
    report: &mut serde_json::Map<String, serde_json::Value>,
    failed: &mut Vec<String>,
) -> Result<()> {
    use candle_core::Module as _;
    let h = cfg.hidden();
    let randn = |std: f32, shape: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, std, shape, candle)?.to_dtype(DType::BF16)?)
    };
    let mut cases = Vec::new();
    for fan_in in [h, 4 * h] {
        let x = randn(1.0, &[1, tokens, fan_in])?;
        let w = randn(1.0 / (fan_in as f32).sqrt(), &[h, fan_in])?;
        let b = randn(1.0 / (3.0 * fan_in as f32).sqrt(), &[h])?;
        let before = offload_candle::lt::stats();
        let fast = offload_candle::lt::linear_bias(&x, &w, &b)?;
        let took_lt = offload_candle::lt::stats().0 > before.0;
        let plain = candle_nn::Linear::new(w.clone(), Some(b.clone())).forward(&x)?;
        check_case(
            format!(
                "cuBLASLt bias epilogue vs candle Linear, {fan_in} → {h}, {tokens} rows (took cuBLASLt: {took_lt})"
            ),
            &fast,
            &plain,
            &mut cases,
            failed,
        )?;
    }
    let fused = Flux::new(cfg.clone(), candle)?.with_kernels(flux::Kernels {
        fused_modulate: true,
        ..flux::Kernels::PLAIN
    })?;
    let plain = Flux::new(cfg.clone(), candle)?.with_kernels(flux::Kernels::PLAIN)?;
    let x = randn(1.0, &[1, tokens, h])?;
    let (shift, scale) = (randn(1.0, &[1, h])?, randn(0.5, &[1, h])?);
    check_case(
        format!("fused AdaLN vs norm, multiply, add, {tokens} rows"),
        &fused.norm_modulate(&x, &shift, &scale)?,
        &plain.norm_modulate(&x, &shift, &scale)?,
        &mut cases,
        failed,
    )?;
    check_fused(candle, cfg, tokens, &mut cases, failed)?;
    report.insert("kernel_checks".into(), cases.into());
    Ok(())
}

/// The hand-written kernels (`offload_candle::fused`) and the epilogues
/// that feed them, each against candle's operations written out the way
/// diffusers computes: the q/k norm and RoPE (a text part of 512 rows with
/// one weight, the rest with another), the gate and residual, the GELU
/// epilogue, and a GEMM written into columns of a wider buffer beside a
/// strided copy.
fn check_fused(
    candle: &Device,
    cfg: &FluxConfig,
    tokens: usize,
    cases: &mut Vec<serde_json::Value>,
    failed: &mut Vec<String>,
) -> Result<()> {
    use candle_core::D;
    use candle_core::Module as _;
    use offload_candle::{fused, lt};
    let (h, heads, d) = (
        cfg.hidden(),
        cfg.num_attention_heads,
        cfg.attention_head_dim,
    );
    let randn = |std: f32, shape: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, std, shape, candle)?.to_dtype(DType::BF16)?)
    };
    let split = 512.min(tokens / 2);
    // q/k RMSNorm + RoPE.
    let x = (randn(1.0, &[1, tokens, heads, d])? * 3.0)?;
    let (w0, w1) = ((randn(0.1, &[d])? + 1.0)?, (randn(0.1, &[d])? + 1.0)?);
    let angles = (Tensor::rand(0f32, 1f32, (tokens, d / 2), candle)? * 100.0)?;
    let (cos, sin) = (angles.cos()?, angles.sin()?);
    let fast = x.copy()?;
    fused::qk_norm_rope(&fast, &w0, &w1, split, &cos, &sin, 1e-6)?;
    let xf = x.to_dtype(DType::F32)?;
    let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + 1e-6)?
        .sqrt()?
        .recip()?;
    let y = xf.broadcast_mul(&r)?.to_dtype(DType::BF16)?;
    let y = Tensor::cat(
        &[
            y.narrow(1, 0, split)?.broadcast_mul(&w0)?,
            y.narrow(1, split, tokens - split)?.broadcast_mul(&w1)?,
        ],
        1,
    )?;
    let plain = candle_nn::rotary_emb::rope_i(
        &y.transpose(1, 2)?.to_dtype(DType::F32)?.contiguous()?,
        &cos,
        &sin,
    )?
    .to_dtype(DType::BF16)?
    .transpose(1, 2)?;
    check_case(
        format!(
            "fused q/k RMSNorm + RoPE vs norm, multiply, f32 RoPE, {tokens} rows (split {split})"
        ),
        &fast,
        &plain,
        cases,
        failed,
    )?;
    // Gate and residual.
    let (x, y, g) = (
        randn(1.0, &[1, tokens, h])?,
        randn(1.0, &[1, tokens, h])?,
        randn(0.5, &[1, h])?,
    );
    let plain = (&x + y.broadcast_mul(&g.unsqueeze(1)?)?)?;
    check_case(
        format!("fused gate + residual vs multiply, add, {tokens} rows"),
        &fused::gate_residual(&x, &y, &g)?,
        &plain,
        cases,
        failed,
    )?;
    // GELU epilogue.
    let x = randn(1.0, &[1, tokens, h])?;
    let w = randn(1.0 / (h as f32).sqrt(), &[4 * h, h])?;
    let b = randn(1.0 / (3.0 * h as f32).sqrt(), &[4 * h])?;
    let plain_mlp = candle_nn::Linear::new(w.clone(), Some(b.clone()))
        .forward(&x)?
        .gelu()?;
    check_case(
        format!(
            "cuBLASLt bias + GELU epilogue vs Linear, gelu, {h} → {}, {tokens} rows",
            4 * h
        ),
        &lt::linear_bias_act(&x, &w, &b, true)?,
        &plain_mlp,
        cases,
        failed,
    )?;
    // The GEMM into columns h.. of a [1, L, 5h] buffer, an attention-like
    // tensor copied into columns ..h.
    let attn = randn(1.0, &[1, tokens, h])?;
    // SAFETY: the GEMM writes columns h..5h and the copy 0..h of every row.
    let joint = unsafe { fused::uninit((1, tokens, 5 * h), candle)? };
    lt::linear_into(&x, &w, &b, &joint, 0, h, true)?;
    fused::copy_into_columns(&joint, &attn, 0)?;
    check_case(
        format!(
            "GEMM + GELU into columns {h}.. and a copy into ..{h} vs concatenation, {tokens} rows"
        ),
        &joint,
        &Tensor::cat(&[&attn, &plain_mlp], D::Minus1)?,
        cases,
        failed,
    )?;
    Ok(())
}

/// Flash against unfused attention on random bf16 inputs `[1, heads, L,
/// 128]`, per spread of the queries and keys (1: scores of deviation 1, as
/// RMS-normalised ones; 2: sharper, deviation 4): (cosine, max abs error,
/// max |unfused|, flash ms, unfused ms) per case into `report`; the failed
/// bounds into `failed`.
fn check_attention(
    candle: &Device,
    heads: usize,
    tokens: usize,
    report: &mut serde_json::Map<String, serde_json::Value>,
    failed: &mut Vec<String>,
) -> Result<()> {
    use flux::Attention;
    let mut cases = Vec::new();
    for spread in [1.0f32, 2.0] {
        let draw = |s: f32| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, s, (1, heads, tokens, 128), candle)?.to_dtype(DType::BF16)?)
        };
        let (q, k, v) = (draw(spread)?, draw(spread)?, draw(1.0)?);
        let run = |path: Attention| -> Result<(Tensor, f64)> {
            let out = flux::attend(&q, &k, &v, path)?;
            candle.synchronize()?;
            let t = Instant::now();
            for _ in 0..5 {
                flux::attend(&q, &k, &v, path)?;
            }
            candle.synchronize()?;
            Ok((out, t.elapsed().as_secs_f64() * 1e3 / 5.0))
        };
        let (fast, fast_ms) = run(Attention::Flash)?;
        let (slow, slow_ms) = run(Attention::Unfused)?;
        let (cos, max_abs) = compare(
            &fast.to_device(&Device::Cpu)?,
            &slow.to_device(&Device::Cpu)?,
        )?;
        let peak = slow
            .to_dtype(DType::F32)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        let ok = cos >= ATTENTION_MIN_COSINE && max_abs <= ATTENTION_MAX_ABS_OVER_MAX * peak;
        if !ok {
            failed.push(format!(
                "flash vs unfused attention (spread {spread}, {tokens} tokens): cosine {cos} \
                 (bound {ATTENTION_MIN_COSINE}), max abs {max_abs} against max |out| {peak} \
                 (bound {ATTENTION_MAX_ABS_OVER_MAX} of it)"
            ));
        }
        cases.push(serde_json::json!({
            "spread": spread,
            "cosine": cos,
            "max_abs": max_abs,
            "max_abs_unfused": peak,
            "flash_ms": fast_ms,
            "unfused_ms": slow_ms,
            "ok": ok,
        }));
    }
    report.insert(
        "attention_check".into(),
        serde_json::json!({
            "tokens": tokens,
            "heads": heads,
            "head_dim": 128,
            "min_cosine": ATTENTION_MIN_COSINE,
            "max_abs_over_max": ATTENTION_MAX_ABS_OVER_MAX,
            "cases": cases,
        }),
    );
    Ok(())
}

fn pipeline(ckpt: &Checkpoint) -> Result<Pipeline> {
    let mut b = PipelineBuilder::new("FluxPipeline");
    {
        let mut t = b.module("transformer");
        ckpt.declare(&mut t, "")?;
        t.block_containers(&["transformer_blocks", "single_transformer_blocks"]);
    }
    b.declare_components(ComponentDeclaration {
        dit: vec!["transformer".into()],
        ..Default::default()
    });
    Ok(b.build()?)
}

/// (VmRSS, RssAnon) in bytes.
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| {
        status
            .lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("RssAnon:"))
}

/// Host→device GB/s of a fresh 1 GiB pinned buffer, best of 5 copies.
fn bandwidth(dev: &CudaDevice) -> Result<f64> {
    let bytes = 1u64 << 30;
    let mut host = dev.alloc_pinned(bytes)?;
    host.write_from(0, bytes, &vec![1u8; bytes as usize]);
    let buf = dev.alloc_device(bytes)?;
    let stream = dev.create_stream()?;
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        // SAFETY: whole buffers of `bytes`; the stream is synchronised
        // before either is freed.
        unsafe { dev.copy_h2d(&stream, HostSource::Pinned(&host), 0, &buf, 0, bytes)? };
        dev.synchronize_stream(&stream)?;
        best = best.max(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    // SAFETY: the stream that used both is synchronised above.
    unsafe {
        dev.free_device(buf, &[])?;
        dev.free_pinned(host)?;
    }
    Ok(best)
}

fn bits(t: &Tensor) -> Result<Vec<u16>> {
    Ok(t.flatten_all()?
        .to_dtype(DType::BF16)?
        .to_vec1::<half::bf16>()?
        .into_iter()
        .map(half::bf16::to_bits)
        .collect())
}

/// Cosine similarity and the largest absolute difference.
fn compare(a: &Tensor, b: &Tensor) -> Result<(f64, f32)> {
    let a: Vec<f32> = a.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
    let b: Vec<f32> = b.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
    if a.len() != b.len() {
        bail!("outputs of {} and {} elements", a.len(), b.len());
    }
    let dot: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let na = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let max = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    Ok((dot / (na * nb), max))
}

struct Offloaded {
    rt: Runtime<Cuda>,
    views: ZeroCopy,
}

impl Offloaded {
    fn step(&self, model: &Flux, inputs: &FluxInputs) -> Result<Tensor> {
        let out = offload_candle::forward_in(&self.rt, "transformer", &self.views, |w| {
            model.forward(inputs, w)
        })?
        .ok_or_else(|| anyhow!("the DiT's forward was skipped"))?;
        Ok(out)
    }
}

fn sync(candle: &Device, dev: &CudaDevice, compute: &offload_cuda::CudaStream) -> Result<()> {
    candle.synchronize()?;
    dev.synchronize_stream(compute)?;
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Errors print as one line of causes (`Error: what: why`), with no
/// backtrace whatever `RUST_BACKTRACE` says, and exit 1.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing::Level::INFO)
        .init();
    let args = Args::parse();
    let budgets = parse_budgets(&args.budgets)?;
    if !offload_cuda::driver_present() {
        println!("SKIP: no CUDA driver found; offload-flux-bench needs a GPU");
        return Ok(());
    }
    let config_json =
        std::fs::read_to_string(args.ckpt.join("config.json")).context("config.json")?;
    let cfg: FluxConfig = serde_json::from_str(&config_json)
        .context("config.json is not a FluxTransformer2DModel configuration")?;
    let mut report = serde_json::Map::new();
    let init = flux::recorded_init(&config_json).unwrap_or_else(|| "not recorded".into());
    eprintln!("checkpoint weights: {init}");
    report.insert("checkpoint_init".into(), init.into());
    let mut failed: Vec<String> = Vec::new();
    let dev = Arc::new(CudaDevice::new(0)?);
    report.insert("device".into(), dev.name().into());
    let gbps = bandwidth(&dev)?;
    report.insert("pinned_h2d_gb_s".into(), gbps.into());

    // enable from the checkpoint.
    let (rss0, anon0) = rss();
    let t = Instant::now();
    let ckpt = Arc::new(Checkpoint::open(&args.ckpt)?);
    let pipe = pipeline(&ckpt)?;
    let source = Arc::new(SafetensorsSource::new(
        &pipe,
        vec![(Arc::clone(&ckpt), NameMap::prefix("transformer.", ""))],
    )?);
    let compute = Arc::new(dev.create_stream()?);
    let platform = CorePlatform::<Cuda>::new(
        "cuda",
        Arc::clone(&dev),
        Arc::clone(&compute),
        Arc::clone(&source) as Arc<dyn WeightSource>,
    )
    .with_prefetch_depth(args.depth as usize);
    let lossless = args.weight_compression == "lossless";
    let codec = if lossless {
        Some(Arc::new(offload_cuda::decode::CudaCodec::new(&dev)?))
    } else {
        None
    };
    let platform = match &codec {
        Some(c) => platform.with_codec(Arc::clone(c) as _),
        None => platform,
    };
    let layerwise = OffloadConfig {
        enable_layerwise_offload: true,
        weight_compression: lossless.then_some(offload_core::config::WeightCompression::Lossless),
        ..Default::default()
    };
    // Today's limit counts the blocks' bf16 bytes, coded or not.
    let bf16_streamed = offload_core::resolve(
        &pipe,
        &OffloadConfig {
            enable_layerwise_offload: true,
            ..Default::default()
        },
    )?
    .streamed_bytes();
    report.insert(
        "weight_compression".into(),
        args.weight_compression.clone().into(),
    );
    let mut rt = Runtime::new(Arc::clone(&dev), Arc::clone(&compute), pipe.clone());
    rt.enable(Box::new(platform.layerwise(layerwise)?) as Box<dyn Backend<Cuda>>)
        .map_err(|(e, _)| e)?;
    let enable_s = t.elapsed().as_secs_f64();
    let (rss1, anon1) = rss();
    let (windows, copies) = source.windows_and_copies();
    let streamed = rt.backend().map_or(0, |b| b.host_weight_bytes());
    report.insert("bf16_streamed_bytes".into(), bf16_streamed.into());
    report.insert(
        "host_masters_over_bf16".into(),
        (streamed as f64 / bf16_streamed.max(1) as f64).into(),
    );
    report.insert("checkpoint_bytes".into(), ckpt.total_bytes().into());
    report.insert("checkpoint_files".into(), ckpt.files().count().into());
    report.insert("enable_s".into(), enable_s.into());
    report.insert(
        "enable_rss_added_bytes".into(),
        rss1.saturating_sub(rss0).into(),
    );
    report.insert(
        "enable_anon_added_bytes".into(),
        anon1.saturating_sub(anon0).into(),
    );
    report.insert("units_registered_in_place".into(), windows.into());
    report.insert("units_copied_to_pinned".into(), copies.into());
    report.insert(
        "bytes_copied_to_pinned".into(),
        source.copied_bytes().into(),
    );
    report.insert("streamed_bytes".into(), streamed.into());

    // The offloaded steps.
    let cuda = candle_core::CudaDevice::new_with_stream(0)?;
    // SAFETY: candle's tensors all live on this device's one stream; the
    // only other stream, offload's compute stream, is ordered against it by
    // ZeroCopy's events around every scope.
    unsafe { cuda.disable_event_tracking() };
    candle_core::cuda_backend::set_gemm_reduced_precision_f32(args.tf32);
    report.insert("tf32".into(), args.tf32.into());
    let candle = Device::Cuda(cuda);
    let inputs = Arc::new(FluxInputs::load(&args.inputs, &candle)?);
    let tokens = inputs.hidden_states.dim(1)? + inputs.encoder_hidden_states.dim(1)?;
    report.insert("tokens".into(), tokens.into());
    let model = Flux::new(cfg.clone(), &candle)?;
    let model = Arc::new(match args.attention.as_str() {
        "flash" => model.with_attention(flux::Attention::Flash)?,
        "unfused" => model.with_attention(flux::Attention::Unfused)?,
        _ => model,
    });
    let flash = model.attention_path() == flux::Attention::Flash;
    eprintln!("kernels: {}", model.kernels().name());
    report.insert("attention".into(), model.attention_path().name().into());
    report.insert("kernels".into(), model.kernels().name().into());
    let check_tokens = args.check_tokens.min(tokens);
    if flash && check_tokens > 0 {
        check_attention(
            &candle,
            cfg.num_attention_heads,
            check_tokens,
            &mut report,
            &mut failed,
        )?;
    }
    if check_tokens > 0 {
        check_kernels(&candle, &cfg, check_tokens, &mut report, &mut failed)?;
    }
    // SAFETY: Flux returns freshly computed tensors; the views are used only
    // inside their scopes; `off` (the backend) outlives every step below,
    // each synchronised.
    let views = unsafe { ZeroCopy::new(&candle)? };
    match args.plant.as_deref() {
        None => {}
        #[cfg(feature = "planted-bugs")]
        Some("skip-exit") => views.plant_skip_exit(),
        Some(other) => bail!(
            "--plant {other}: this build plants `skip-exit` only with the planted-bugs feature"
        ),
    }
    report.insert("planted".into(), args.plant.clone().into());
    let off = Offloaded { rt, views };
    // The warm-up steps beyond the first run before the kernel counts
    // start, so the offloaded and resident counts below stay one forward
    // plus the timed steps each.
    let mut warm: Option<Vec<u16>> = None;
    for _ in 1..args.warmup {
        let out = bits(&off.step(&model, &inputs)?)?;
        sync(&candle, &dev, &compute)?;
        if warm.as_ref().is_some_and(|w| *w != out) && args.plant.is_none() {
            bail!("two offloaded steps on the same inputs differ");
        }
        warm = Some(out);
    }
    report.insert("warmup_steps".into(), args.warmup.into());
    let lt_before = offload_candle::lt::stats();
    let fused_before = offload_candle::fused::stats();
    let first = off.step(&model, &inputs)?;
    sync(&candle, &dev, &compute)?;
    if let Some(w) = warm
        && args.plant.is_none()
        && w != bits(&first)?
    {
        bail!("two offloaded steps on the same inputs differ");
    }
    let mut times = Vec::new();
    for _ in 0..args.steps {
        let t = Instant::now();
        let out = off.step(&model, &inputs)?;
        sync(&candle, &dev, &compute)?;
        times.push(t.elapsed().as_secs_f64());
        if bits(&out)? != bits(&first)? && args.plant.is_none() {
            bail!("two offloaded steps on the same inputs differ");
        }
    }
    let offload_step = median(times.clone());
    report.insert("offload_step_s".into(), offload_step.into());
    report.insert("depth".into(), args.depth.into());
    let lt_offloaded = offload_candle::lt::stats();
    let fused_offloaded = offload_candle::fused::stats();
    let lt_offloaded = (lt_offloaded.0 - lt_before.0, lt_offloaded.1 - lt_before.1);
    report.insert("offload_steps_s".into(), times.into());
    report.insert("zero_copy_views_cached".into(), off.views.cached().into());
    let Offloaded { mut rt, views } = off;
    drop(views);
    rt.disable()?;
    drop(rt);

    // candle resident: every weight loaded by candle's own reader.
    let t = Instant::now();
    let files: Vec<PathBuf> = ckpt.files().map(Path::to_owned).collect();
    // SAFETY: candle maps the same read-only files; nothing rewrites them.
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files)? };
    let mut weights: HashMap<String, Tensor> = HashMap::new();
    for (name, _) in st.tensors() {
        weights.insert(name.clone(), st.load(&name, &candle)?);
    }
    candle.synchronize()?;
    report.insert(
        "candle_resident_load_s".into(),
        t.elapsed().as_secs_f64().into(),
    );
    let resident_out = model.forward(&inputs, &weights)?;
    candle.synchronize()?;
    let mut times = Vec::new();
    for _ in 0..args.steps {
        let t = Instant::now();
        model.forward(&inputs, &weights)?;
        candle.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    let resident_step = median(times.clone());
    report.insert("resident_steps_s".into(), times.into());
    // cuBLASLt GEMMs and fallbacks of the offloaded and of the resident
    // steps: the same paths compute the same bits.
    let lt_now = offload_candle::lt::stats();
    let lt_resident = (
        lt_now.0 - lt_before.0 - lt_offloaded.0,
        lt_now.1 - lt_before.1 - lt_offloaded.1,
    );
    report.insert(
        "lt_gemms_offloaded_resident".into(),
        serde_json::json!([lt_offloaded.0, lt_resident.0]),
    );
    report.insert(
        "lt_fallbacks_offloaded_resident".into(),
        serde_json::json!([lt_offloaded.1, lt_resident.1]),
    );
    let fused_now = offload_candle::fused::stats();
    report.insert(
        "fused_launches_offloaded_resident".into(),
        serde_json::json!([
            fused_offloaded.0 - fused_before.0,
            fused_now.0 - fused_offloaded.0
        ]),
    );
    report.insert(
        "fused_fallbacks_offloaded_resident".into(),
        serde_json::json!([
            fused_offloaded.1 - fused_before.1,
            fused_now.1 - fused_offloaded.1
        ]),
    );
    // What each fast path bought: the resident step with it switched off
    // (the attention ones only up to --check-tokens), compared with the
    // step that has them all.
    let all = model.kernels();
    let mut variants = Vec::new();
    if args.ablation && all.gemm_bias_epilogue {
        variants.push((
            "without the cuBLASLt epilogues (nor what needs them)",
            flux::Kernels {
                gemm_bias_epilogue: false,
                gelu_epilogue: false,
                fused_qk_rope: false,
                ..all
            },
        ));
    }
    if args.ablation && all.blhd {
        variants.push((
            "without the [B, L, H, D] layout (nor the fused q/k norm and RoPE)",
            flux::Kernels {
                blhd: false,
                fused_qk_rope: false,
                ..all
            },
        ));
    }
    if args.ablation && all.fused_qk_rope {
        variants.push((
            "without the fused q/k norm and RoPE",
            flux::Kernels {
                fused_qk_rope: false,
                ..all
            },
        ));
    }
    if args.ablation && all.gelu_epilogue {
        variants.push((
            "without the GELU epilogue and the concatenation-free MLP",
            flux::Kernels {
                gelu_epilogue: false,
                ..all
            },
        ));
    }
    if args.ablation && all.fused_gate {
        variants.push((
            "without the fused gate",
            flux::Kernels {
                fused_gate: false,
                ..all
            },
        ));
    }
    if args.ablation && all.fused_modulate {
        variants.push((
            "without the fused AdaLN",
            flux::Kernels {
                fused_modulate: false,
                ..all
            },
        ));
    }
    if args.ablation && flash && check_tokens == tokens {
        variants.push((
            "unfused attention",
            flux::Kernels {
                attention: flux::Attention::Unfused,
                ..all
            },
        ));
        variants.push(("candle's plain operations", flux::Kernels::PLAIN));
    }
    let mut ablation = Vec::new();
    for (what, kernels) in variants {
        let variant = Flux::new(cfg.clone(), &candle)?.with_kernels(kernels)?;
        let out = variant.forward(&inputs, &weights)?;
        candle.synchronize()?;
        let mut times = Vec::new();
        for _ in 0..args.steps.min(3) {
            let t = Instant::now();
            variant.forward(&inputs, &weights)?;
            candle.synchronize()?;
            times.push(t.elapsed().as_secs_f64());
        }
        let step = median(times);
        let (cos, max_abs) = compare(
            &resident_out.to_device(&Device::Cpu)?,
            &out.to_device(&Device::Cpu)?,
        )?;
        if kernels.attention == flux::Attention::Unfused && kernels != flux::Kernels::PLAIN {
            report.insert("resident_step_unfused_s".into(), step.into());
            report.insert("cosine_flash_vs_unfused_forward".into(), cos.into());
            report.insert(
                "max_abs_flash_vs_unfused_forward".into(),
                f64::from(max_abs).into(),
            );
        }
        if cos < FORWARD_MIN_COSINE {
            failed.push(format!(
                "the forward with {} against the one {what} ({}): cosine {cos} \
                 (bound {FORWARD_MIN_COSINE}), max abs {max_abs}",
                all.name(),
                kernels.name()
            ));
        }
        ablation.push(serde_json::json!({
            "what": what,
            "kernels": kernels.name(),
            "resident_step_s": step,
            "cosine_vs_all": cos,
            "max_abs_vs_all": max_abs,
        }));
    }
    report.insert("ablation".into(), ablation.into());
    if !flash {
        // The same with the other f32 GEMM precision (the unfused
        // attention's scores), for the record.
        candle_core::cuda_backend::set_gemm_reduced_precision_f32(!args.tf32);
        let mut times = Vec::new();
        for _ in 0..args.steps.min(3) {
            let t = Instant::now();
            model.forward(&inputs, &weights)?;
            candle.synchronize()?;
            times.push(t.elapsed().as_secs_f64());
        }
        candle_core::cuda_backend::set_gemm_reduced_precision_f32(args.tf32);
        report.insert(
            "resident_step_other_f32_gemm_s".into(),
            median(times).into(),
        );
    }
    drop(weights);
    let identical = bits(&resident_out)? == bits(&first)?;
    report.insert("resident_step_s".into(), resident_step.into());
    report.insert("offload_equals_resident".into(), identical.into());
    // The limit of today's bf16 link: coded rows are held to it too.
    let limit = resident_step.max(bf16_streamed as f64 / (gbps * 1e9));
    report.insert("limit_s".into(), limit.into());
    report.insert("step_over_limit".into(), (offload_step / limit).into());
    report.insert(
        "step_over_bf16_link".into(),
        (offload_step / (bf16_streamed as f64 / (gbps * 1e9))).into(),
    );
    if let Some(c) = &codec {
        let s = c.stats();
        report.insert("decodes".into(), s.decodes.into());
        report.insert(
            "link_over_bf16".into(),
            (s.coded_bytes as f64 / s.decoded_bytes.max(1) as f64).into(),
        );
        let flag = c.take_error()?;
        report.insert("decode_error".into(), flag.into());
        if flag != 0 {
            failed.push(format!("the block decoder raised its error flag ({flag})"));
        }
    }
    if let Some(r) = &args.reference {
        let reference = candle_core::safetensors::load(r, &Device::Cpu)?;
        let theirs = reference
            .get("output")
            .ok_or_else(|| anyhow!("{}: no `output`", r.display()))?;
        let (cos, max_abs) = compare(&first.to_device(&Device::Cpu)?, theirs)?;
        report.insert("cosine_vs_diffusers".into(), cos.into());
        report.insert("max_abs_vs_diffusers".into(), f64::from(max_abs).into());
        let (cos_r, _) = compare(&resident_out.to_device(&Device::Cpu)?, theirs)?;
        report.insert("cosine_resident_vs_diffusers".into(), cos_r.into());
    }

    // The request planner's budgets, each on a fresh runtime, beside
    // nothing else of this process (the resident weights are dropped).
    if !budgets.is_empty() {
        let group_step = match &args.diffusers_json {
            Some(p) => std::fs::read_to_string(p)
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .and_then(|v| v.get("group_offload_step_s").and_then(|x| x.as_f64())),
            None => None,
        };
        let want = bits(&resident_out)?;
        let bench = BudgetBench {
            dev: &dev,
            compute: &compute,
            candle: &candle,
            pipe: &pipe,
            source: &source,
            model: &model,
            inputs: &inputs,
            tokens,
            steps: args.steps,
            depth: args.depth,
            want: &want,
        };
        let mut rows = Vec::new();
        for &b in &budgets {
            let row = match bench.run(b) {
                Ok(row) => row,
                Err(e) => serde_json::json!({ "budget": b.to_string(), "error": format!("{e:#}") }),
            };
            rows.push(row);
        }
        println!(
            "| budget | planned resident blocks | step s | predicted s | step vs diffusers group offload | peak in use (GB) | peak ≤ budget |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        for row in &mut rows {
            let step = row.get("step_s").and_then(|v| v.as_f64());
            let vs = match (step, group_step) {
                (Some(s), Some(g)) if s > 0.0 => {
                    row["group_offload_step_s"] = g.into();
                    row["speedup_vs_group_offload"] = (g / s).into();
                    format!("{:.2}× faster ({g:.4} s)", g / s)
                }
                _ => "-".to_owned(),
            };
            let row = &*row;
            let f = |k: &str, prec: usize| {
                row.get(k)
                    .and_then(|v| v.as_f64())
                    .map_or("-".to_owned(), |v| format!("{v:.prec$}"))
            };
            let peak = row
                .get("pool_used_peak_bytes")
                .and_then(|v| v.as_u64())
                .map_or("-".to_owned(), |p| format!("{:.2}", p as f64 / 1e9));
            let budget_gb = row
                .get("budget_bytes")
                .and_then(|v| v.as_u64())
                .map_or(String::new(), |b| format!(" of {:.2}", b as f64 / 1e9));
            println!(
                "| {} | {} | {} | {} | {vs} | {peak}{budget_gb} | {} |",
                row["budget"].as_str().unwrap_or("-"),
                row.get("resident_blocks_text")
                    .and_then(|v| v.as_str())
                    .unwrap_or("-"),
                f("step_s", 4),
                f("predicted_step_s", 4),
                row.get("peak_within_budget")
                    .map_or("-".to_owned(), ToString::to_string),
            );
            let budget = row["budget"].as_str().unwrap_or("-").to_owned();
            if let Some(e) = row.get("error").and_then(|v| v.as_str()) {
                failed.push(format!("budget {budget}: {e}"));
                continue;
            }
            if row.get("equals_resident").and_then(|v| v.as_bool()) != Some(true) {
                failed.push(format!(
                    "budget {budget}: the output differs from candle resident"
                ));
            }
            if row.get("peak_within_budget").and_then(|v| v.as_bool()) != Some(true) {
                failed.push(format!(
                    "budget {budget}: device memory in use peaked at {peak} GB, over the budget{budget_gb} GB"
                ));
            }
        }
        report.insert("budgets".into(), rows.into());
    }

    // Memory growth over many steps: most blocks resident, the last
    // `growth_streamed` blocks streaming, a small request.
    if args.growth_steps > 0 {
        let blocks = Flux::new(cfg.clone(), &candle)?.block_paths();
        let keep = blocks.len().saturating_sub(args.growth_streamed as usize);
        let config = OffloadConfig {
            enable_layerwise_offload: true,
            resident_blocks: blocks[..keep]
                .iter()
                .map(|b| format!("transformer.{b}"))
                .collect(),
            ..Default::default()
        };
        let mut rt = Runtime::new(Arc::clone(&dev), Arc::clone(&compute), pipe.clone());
        rt.enable(Box::new(platform.layerwise(config)?) as Box<dyn Backend<Cuda>>)
            .map_err(|(e, _)| e)?;
        // SAFETY: as above.
        let views = unsafe { ZeroCopy::new(&candle)? };
        let off = Offloaded { rt, views };
        let small = flux::random_inputs(&cfg, 16, 64, 3, &candle)?;
        let warm = 10.min(args.growth_steps);
        let mut at_warm = None;
        let t = Instant::now();
        for i in 0..args.growth_steps {
            off.step(&model, &small)?;
            if i + 1 == warm {
                sync(&candle, &dev, &compute)?;
                at_warm = Some((rss(), dev.memory_info()?.free_bytes));
            }
        }
        sync(&candle, &dev, &compute)?;
        let elapsed = t.elapsed().as_secs_f64();
        let ((rss_w, anon_w), free_w) = at_warm.expect("at least one step");
        let ((rss_e, anon_e), free_e) = (rss(), dev.memory_info()?.free_bytes);
        report.insert("growth_steps".into(), args.growth_steps.into());
        report.insert(
            "growth_step_s".into(),
            (elapsed / f64::from(args.growth_steps)).into(),
        );
        report.insert(
            "growth_rss_bytes".into(),
            (rss_e as i64 - rss_w as i64).into(),
        );
        report.insert(
            "growth_anon_bytes".into(),
            (anon_e as i64 - anon_w as i64).into(),
        );
        report.insert(
            "growth_device_bytes".into(),
            (free_w as i64 - free_e as i64).into(),
        );
        report.insert("growth_views_cached".into(), off.views.cached().into());
        let Offloaded { mut rt, views } = off;
        drop(views);
        rt.disable()?;
    }
    report.insert("checks_failed".into(), failed.clone().into());
    let json = serde_json::Value::Object(report);
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(&json)?)?;
    }
    println!("{json}");
    if !failed.is_empty() {
        bail!("{}", failed.join("; "));
    }
    Ok(())
}

/// What every budget run shares.
struct BudgetBench<'a> {
    dev: &'a Arc<CudaDevice>,
    compute: &'a Arc<offload_cuda::CudaStream>,
    candle: &'a Device,
    pipe: &'a Pipeline,
    source: &'a Arc<SafetensorsSource>,
    model: &'a Arc<Flux>,
    inputs: &'a Arc<FluxInputs>,
    tokens: usize,
    steps: u32,
    depth: u32,
    /// candle resident's output bits.
    want: &'a [u16],
}

/// What the runtime's request records of its steps.
#[derive(Default)]
struct StepLog {
    /// Seconds of each step (forward and synchronisation).
    times: Vec<f64>,
    /// Whether every step's output equalled candle resident's.
    equal: bool,
    steps: usize,
}

/// The runtime's request (`Runtime::set_request`): `shape.steps` DiT
/// forwards of the candle model, each synchronised, timed and compared
/// with candle resident's output.
struct FluxRequest {
    model: Arc<Flux>,
    inputs: Arc<FluxInputs>,
    views: ZeroCopy,
    candle: Device,
    dev: Arc<CudaDevice>,
    want: Vec<u16>,
    log: std::sync::Mutex<StepLog>,
}

impl FluxRequest {
    fn run(&self, rt: &Runtime<Cuda>, shape: &RequestShape) -> Result<()> {
        for _ in 0..shape.steps {
            let t = Instant::now();
            let out = offload_candle::forward_in(rt, "transformer", &self.views, |w| {
                self.model.forward(&self.inputs, w)
            })?
            .ok_or_else(|| anyhow!("the DiT's forward was skipped"))?;
            sync(&self.candle, &self.dev, rt.compute_stream())?;
            let s = t.elapsed().as_secs_f64();
            let equal = bits(&out)? == self.want;
            let mut log = self.log.lock().map_err(|_| anyhow!("poisoned step log"))?;
            log.times.push(s);
            log.equal &= equal;
            log.steps += 1;
        }
        Ok(())
    }

    fn reset(&self) -> Result<()> {
        *self.log.lock().map_err(|_| anyhow!("poisoned step log"))? = StepLog {
            equal: true,
            ..StepLog::default()
        };
        Ok(())
    }
}

impl BudgetBench<'_> {
    /// One budget: enable the DiT with `device_budget` through
    /// `enable_selected` (the planned backend's warm-up runs the request
    /// below at enable), then one request of `steps` steps timed, its
    /// outputs against resident and the allocator's peak against the
    /// budget.
    fn run(&self, budget: DeviceBudget) -> Result<serde_json::Value> {
        eprintln!("== budget {budget}");
        self.candle.synchronize()?;
        self.dev.synchronize()?;
        self.dev.trim_pool()?;
        let free = self.dev.memory_info()?.free_bytes;
        let shape = RequestShape::new(self.tokens as u64, self.steps);
        let platform = CorePlatform::<Cuda>::new(
            "cuda",
            Arc::clone(self.dev),
            Arc::clone(self.compute),
            Arc::clone(self.source) as Arc<dyn WeightSource>,
        )
        .with_prefetch_depth(self.depth as usize)
        .with_request(shape.clone());
        let config = OffloadConfig {
            device_budget: Some(budget),
            ..Default::default()
        };
        // SAFETY: as for the layerwise run: Flux returns freshly computed
        // tensors, the views live only inside their scopes, and the request
        // (which owns them) is dropped with the runtime, after `disable`.
        let views = unsafe { ZeroCopy::new(self.candle)? };
        let request = Arc::new(FluxRequest {
            model: Arc::clone(self.model),
            inputs: Arc::clone(self.inputs),
            views,
            candle: self.candle.clone(),
            dev: Arc::clone(self.dev),
            want: self.want.to_vec(),
            log: std::sync::Mutex::new(StepLog::default()),
        });
        request.reset()?;
        let mut rt = Runtime::new(
            Arc::clone(self.dev),
            Arc::clone(self.compute),
            self.pipe.clone(),
        );
        let r = Arc::clone(&request);
        rt.set_request(move |rt, shape| r.run(rt, shape).map_err(Into::into));
        let t = Instant::now();
        rt.enable_selected(&config, &platform)
            .with_context(|| format!("budget {budget}: enable_selected"))?;
        let enable_s = t.elapsed().as_secs_f64();
        let warmup_equal = request.log.lock().map_or(false, |l| l.equal);
        let plan = rt
            .request_plan()
            .cloned()
            .ok_or_else(|| anyhow!("budget {budget}: a device budget enabled no request plan"))?;
        eprintln!("{plan}");
        request.reset()?;
        sync(self.candle, self.dev, self.compute)?;
        self.dev.reset_pool_high()?;
        rt.serve(&shape)
            .with_context(|| format!("budget {budget}: the timed request"))?;
        sync(self.candle, self.dev, self.compute)?;
        let (_, used_peak) = self.dev.pool_used()?;
        let (_, reserved_peak) = self.dev.pool_reserved()?;
        let info = self.dev.memory_info()?;
        let (times, equal, steps) = {
            let l = request
                .log
                .lock()
                .map_err(|_| anyhow!("poisoned step log"))?;
            (l.times.clone(), l.equal, l.steps)
        };
        if steps != self.steps as usize {
            bail!(
                "budget {budget}: the request ran {steps} steps, not {}",
                self.steps
            );
        }
        let replanned = rt.request_plan() != Some(&plan);
        let plan = rt.request_plan().cloned().unwrap_or(plan);
        rt.disable()
            .with_context(|| format!("budget {budget}: disable"))?;
        drop(rt);
        let dit = plan.component("transformer");
        let resident = dit.map_or(0, |c| c.resident_blocks.len());
        let blocks = dit.map_or(0, |c| c.blocks);
        let step = median(times.clone());
        eprintln!(
            "budget {budget}: enable {enable_s:.2} s, step {step:.4} s (median of {times:?}), predicted {:.4} s, \
             {resident} of {blocks} blocks resident, peak in use {used_peak} of {} bytes",
            plan.predicted_step_s(),
            plan.budget_bytes
        );
        Ok(serde_json::json!({
            "budget": budget.to_string(),
            "budget_bytes": plan.budget_bytes,
            "free_at_enable_bytes": free,
            "enable_s": enable_s,
            "mode": dit.map(|c| c.mode.to_string()),
            "resident_blocks": resident,
            "blocks": blocks,
            "resident_blocks_text": format!("{resident} of {blocks}"),
            "streamed_bytes_per_step": dit.map(|c| c.streamed_bytes),
            "depth": dit.map(|c| c.depth),
            "step_s": step,
            "steps_s": times,
            "predicted_step_s": plan.predicted_step_s(),
            "predicted_over_measured": plan.predicted_step_s() / step,
            "replanned": replanned,
            "planned_peak_bytes": plan.peak_bytes,
            "pool_used_peak_bytes": used_peak,
            "pool_reserved_peak_bytes": reserved_peak,
            "info_used_at_end_bytes": info.total_bytes.saturating_sub(info.free_bytes),
            "peak_within_budget": used_peak <= plan.budget_bytes,
            "warmup_equals_resident": warmup_equal,
            "equals_resident": equal && warmup_equal,
            "link_gb_s": plan.link_bytes_per_s / 1e9,
        }))
    }
}
