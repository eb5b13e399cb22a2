//! The benchmark on one GPU, in one run, in two modes.
//!
//! **DiT-only layerwise** (the default): a Flux.1-dev-sized DiT (exact
//! block shapes, 11.9 B parameters, random bf16 weights distinct per
//! block) at batch 1, its weights already in host memory as a loader
//! leaves them. The compute proxy runs each linear on the rows it runs on
//! in Flux (modulation on one row, text-stream weights on the text tokens,
//! image-stream weights on the image tokens, single blocks on all tokens)
//! and attention at Flux's cost.
//!
//! Measures: the pinned host→device bandwidth of a fresh buffer and of the
//! host masters themselves (every block copied back to back, no compute);
//! the resident step; layerwise at each `--depths` and at the depth the
//! ring recurrence chooses (`budget::predict_step` on the resident step's
//! per-block compute); the limit `max(resident, streamed / bandwidth)`
//! against both bandwidths and the ratio; the recurrence's predicted step
//! and the simulator's; peak device weight bytes (the allocator's
//! high-water mark and cuMemGetInfo); host bytes for weights; the time
//! `enable` took; one traced step per row (CUDA events around every copy
//! and every block's compute, written as a Perfetto trace) read as compute
//! waits and copy-engine idle; and the output of the chained proxy (a
//! function of every weight byte read, in order), which must equal the
//! resident run's. Device budgets are whole-request plans now: they are
//! the pipeline mode's.
//!
//! `--weight-compression none,lossless` runs the layerwise rows once per
//! value: `lossless` codes every streamed block at enable (`CudaCodec`,
//! `offload_pack::block`) and decodes it on the GPU in each fill; its rows
//! add the bytes on the link per step and in host memory against bf16,
//! the step against the bf16 link limit (streamed bf16 bytes / pinned
//! bandwidth) and the decoder's error flag. `--law` draws every loaded
//! bf16 tensor from `offload_pack::synth`'s laws at its init scale
//! (default normal, what trained weights look like to the code).
//!
//! **Pipeline** (`--pipeline`, [`pipeline`]): whole Flux.1-dev requests
//! (both text encoders, the denoising steps, the VAE decode) under each
//! `--budgets` through the request planner, against a resident run; with
//! `--weight-compression` each budget once per value, the coded rows over
//! `--coded-blocks` where given.
//!
//! Prints tables and writes JSON. Never a timed test.
//!
//! Built with the `planted-bugs` feature, `--plant NAME` plants a core bug
//! in the offloaded runs: their output then differs from resident.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use offload_core::budget;
use offload_core::config::WeightCompression;
use offload_core::device::{Device, DeviceBuffer, HostRegion, HostSource};
use offload_core::model::{DType, Pipeline, StorageId, TensorId};
#[cfg(feature = "planted-bugs")]
use offload_core::runtime::PlantedBug;
use offload_core::runtime::{Backend, CorePlatform, Entry, Runtime, Scope, Unit, WeightSource};
use offload_core::{OffloadConfig, resolve};
use offload_cuda::decode::CudaCodec;
use offload_cuda::proxy::{Attention, Proxy};
use offload_cuda::{Cuda, CudaDevice, CudaStream, driver_present};
use offload_pack::synth::{Law, tensor_bytes};
use offload_sim::harness::blocks_of;
use offload_sim::presets::{TokenSplit, flux1_dev_dit, linear_rows};
use serde::Serialize;
use timeline::Analysis;

mod beside;
mod dist;
mod pipeline;
mod staged;
mod timeline;

/// What a forward closure returns on failure.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Attention heads and head width of Flux.1-dev.
const HEADS: u64 = 24;
const HEAD_DIM: u64 = 128;
/// Token counts the flags accept (the memory check below narrows it).
const MAX_TOKENS: u64 = 1 << 20;
const MAX_STEPS: u64 = 1000;
const MAX_WARMUP: u64 = 100;
/// Device memory kept free beside weights and scratch (cuBLAS workspace,
/// the allocator's granules, the bandwidth probe).
const HEADROOM_BYTES: u64 = 4 << 30;
/// The deepest look-ahead the DiT-only mode's chooser considers
/// (`budget::choose_lookahead`): the `prefetch_depth` key's range, 1 to 16.
const MAX_PLANNED_DEPTH: usize = 16;

#[derive(Parser)]
#[command(
    name = "offload-bench",
    about = "Layerwise offload of a Flux.1-dev-sized DiT against the PCIe limit, or (--pipeline) whole Flux.1-dev requests under device budgets"
)]
pub(crate) struct Args {
    /// Token counts (image + text) per forward, comma-separated, each in
    /// 1..=1048576 and small enough that the scratch fits on the GPU
    /// (default 4608,16896). With --pipeline: the one token count of a
    /// denoising forward (default 4608, the preset's warm-up request).
    #[arg(long)]
    tokens: Option<String>,
    /// Timed steps per setting, 1..=1000 (the median is reported; default
    /// 5). With --pipeline: denoising steps per request (default 28).
    #[arg(long)]
    steps: Option<u64>,
    /// Warm-up steps per setting, 0..=100 (default 2). With --pipeline:
    /// untimed requests of the resident run before its timed ones
    /// (default 1; a planned run's warm-up is the planner's own).
    #[arg(long)]
    warmup: Option<u64>,
    /// Write the results as JSON here.
    #[arg(long, default_value = "bench.json")]
    json: std::path::PathBuf,
    /// Plant this core bug in the offloaded runs (e.g. `wrong-master`).
    #[cfg(feature = "planted-bugs")]
    #[arg(long)]
    plant: Option<String>,
    /// Distributed layerwise on G GPUs, one process per GPU (2..=8; run
    /// under `offload-launch -n G` or torchrun, or alone: it then runs
    /// itself under `offload-launch` found beside it). 1: the single-GPU
    /// layerwise benchmark.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    ranks: u32,
    /// Prefetch depths to run layerwise at, comma-separated, each in the
    /// `prefetch_depth` key's 1..=16 (the depth the ring recurrence chooses
    /// is run besides).
    #[arg(long, default_value = "1,2")]
    depths: String,
    /// Write each row's traced step here as a Perfetto trace.
    #[arg(long)]
    trace_dir: Option<std::path::PathBuf>,
    /// Run the layerwise rows (each `--depths` and the chooser's) this many
    /// times in the one process, 1..=10, to report their spread (the
    /// resident rows and the bandwidth are measured once).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10))]
    repeats: u32,
    /// Skip the simulator's prediction of every row (it runs on the host's
    /// CPU, seconds a row): for sweeps over many token counts.
    #[arg(long)]
    no_simulate: bool,
    /// Whole requests of the Flux.1-dev pipeline (CLIP-L, T5-XXL, the DiT,
    /// the VAE) through the request planner instead of the DiT alone.
    #[arg(long)]
    pipeline: bool,
    /// With --pipeline: device budgets to plan and run, comma-separated
    /// (`24GiB,16GiB,auto`; default 24GiB,16GiB,12GiB,8GiB,auto).
    #[arg(long)]
    budgets: Option<String>,
    /// With --pipeline: timed requests per budget, 1..=100 (their median
    /// is reported), each followed by one instrumented request.
    #[arg(long, default_value_t = 2)]
    requests: u64,
    /// With --pipeline: run the `auto` budget beside another process
    /// holding this many GiB of the device's memory (`python3` with
    /// torch, started before and killed after), 1..=1024.
    #[arg(long)]
    hog_gib: Option<u64>,
    /// With --pipeline: the budget whose warm-up measurements are saved
    /// and given back (`CorePlatform::with_planner`) to a run without a
    /// warm-up (default: 16GiB if among --budgets, else the first sized
    /// one; `none`: no such run).
    #[arg(long)]
    saved_from: Option<String>,
    /// DiT-only mode: leave out the rows at the depth the ring recurrence
    /// chooses (one enable per distinct chosen depth; a lossless enable
    /// encodes every block): only `--depths` run.
    #[arg(long)]
    no_planner: bool,
    /// DiT-only mode: also time the resident step beside an unrelated
    /// stream of pinned host→device copies (no offload engine: no hooks,
    /// waits or slots), one `resident beside copies` row per token count:
    /// what copies cost this workload's kernels, its step and compute
    /// busy against the resident row's. Not with --pipeline or --ranks.
    #[arg(long)]
    copy_beside: bool,
    /// With `--weight-compression lossless` (or `auto`): a coded-block
    /// file (offload-pack's `.opackb`) to enable the coded rows from, its
    /// coded masters registered in place; written first from the loaded
    /// weights if it does not exist (timed), so it is in the page cache.
    /// With --pipeline it holds every stack's blocks (DiT, CLIP, T5), and
    /// a file that lacks some of them, or holds one coded from other
    /// weights, is written again.
    #[arg(long)]
    coded_blocks: Option<std::path::PathBuf>,
    /// `weight_compression` values, comma-separated (`none`; `lossless`:
    /// every streamed block coded on the host at enable, or taken from
    /// --coded-blocks, and decoded on the GPU by `CudaCodec`; `auto`:
    /// coded where the recurrence says it is faster). DiT-only mode: the
    /// layerwise rows once per value. --pipeline: each budget once per
    /// value (the resident run once); default `none` alone.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "none")]
    weight_compression: Vec<Compression>,
    /// The law each loaded bf16 tensor is drawn from at its init scale
    /// (`offload_pack::synth`: N(0, 1/fan-in), Student-t ν = 4 at the same
    /// variance, or uniform ±1/√fan-in); other dtypes stay random bytes.
    #[arg(long, value_enum, default_value = "normal")]
    law: LawArg,
    /// DiT-only mode: extra layerwise rows (at each `--depths`) whose
    /// masters are staged (CONTRACT §7c), comma-separated: a `host_budget`
    /// (`8GiB`: the blocks beyond it stay in the loader's pageable memory
    /// and stream through pinned staging buffers) or `unpinned`
    /// (`pin_cpu_memory = false`: every block staged). Each row reports its
    /// staged bytes, the pinned-memory peak, and its step against the
    /// staged path's own limit (the host copy rate, measured in this run).
    #[arg(long, value_delimiter = ',')]
    host_budgets: Vec<String>,
    /// With `--host-budgets`: each staged row once per staging ring size,
    /// comma-separated (`512MiB,1400MiB`; the process setting
    /// `offload_core::budget::host::set_staging_ring_bytes`, set before
    /// each such row's enable): two whole blocks where both fit, else eight
    /// parts of an eighth (CONTRACT §7c). Empty: the library's default.
    #[arg(long, value_delimiter = ',')]
    staging_rings: Vec<String>,
    /// With `--host-budgets`: each staged row whose ring the staged
    /// chooser (`LayerwiseBackend::staged_lookahead`: the recurrence with
    /// the host stage, at the fill rate the row's own fills ran at, from
    /// this token count's traced compute) would run at another depth runs
    /// once more at that depth (`staged chooser` rows).
    #[arg(long)]
    staged_chooser: bool,
    /// How the loader's bytes are copied into staging buffers and pinned
    /// masters: `streaming` (`offload_core::copy::copy_streaming`, the
    /// library's weight sources' copy: non-temporal stores) or `plain`
    /// (`copy_from_slice`, the comparison: what the fill wrote before).
    #[arg(long, value_enum, default_value = "streaming")]
    fill_copy: FillCopy,
    /// With `--host-budgets`: the streamed blocks written to this file
    /// (when missing or of another size), mapped, and each budget run again
    /// with its masters from the file (`file` rows): the file's page cache
    /// dropped before each such enable, pinned blocks read from it, staged
    /// ones read through the mapping (pages released after each read when
    /// the budget binds: read with `pread` then, unless `--file-reads
    /// mapped`), the process's resident file pages sampled.
    #[arg(long)]
    masters_file: Option<std::path::PathBuf>,
    /// How the `file` rows read the blocks whose pages are released after
    /// each read: `pread` (what `offload-safetensors` does: nothing
    /// mapped in) or `mapped` (through the mapping with the fill's
    /// streaming copy, the pages faulted in and released after), or
    /// `in-place` (`staged_reads = "in_place"`: no fill, the GPU reads the
    /// staged blocks where they lie in the mapping; a GPU with pageable
    /// memory access only). Several (`pread,mapped`) run each file row
    /// once per way, in one process.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "pread")]
    file_reads: Vec<staged::FileReads>,
    /// How the proxy computes attention, in every mode: `flash` (a fused
    /// FlashAttention-2-style kernel, the scores kept on the SM, as the
    /// models' runtimes run it) or `materialized` (cuBLAS batched GEMMs
    /// that write and read the scores: the same FLOPs, bound by memory
    /// traffic, and slowed 2–3.6 % by host-to-device copies beside it).
    #[arg(long, default_value = "flash", value_parser = clap::builder::ValueParser::new(str::parse::<Attention>))]
    attention: Attention,
}

/// `--attention`, set once at start.
static ATTENTION: std::sync::OnceLock<Attention> = std::sync::OnceLock::new();

/// The proxy's attention kind as `--attention` set it.
pub(crate) fn attention_kind() -> Attention {
    ATTENTION.get().copied().unwrap_or_default()
}

/// A proxy on `stream` with the scratch given, computing attention as
/// `--attention` says: every mode builds its proxy here.
pub(crate) fn new_proxy(
    device: &CudaDevice,
    stream: &Arc<CudaStream>,
    input_bytes: u64,
    output_bytes: u64,
) -> Result<Proxy> {
    let mut proxy = Proxy::new(device, Arc::clone(stream), input_bytes, output_bytes)?;
    proxy.set_attention(attention_kind());
    Ok(proxy)
}

/// A `--host-budgets` value: a `host_budget`, or every master staged.
#[derive(Clone, Copy, Debug)]
enum HostRow {
    Budget(offload_core::bytes::HostBudget),
    Unpinned,
}

impl HostRow {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        if text == "unpinned" {
            return Ok(Self::Unpinned);
        }
        offload_core::bytes::HostBudget::parse(text)
            .map(Self::Budget)
            .map_err(|e| format!("{e}; or `unpinned` (pin_cpu_memory = false)"))
    }

    fn name(self) -> String {
        match self {
            Self::Budget(b) => format!("host_budget {b}"),
            Self::Unpinned => "unpinned".to_owned(),
        }
    }

    fn config(self, base: &OffloadConfig) -> OffloadConfig {
        match self {
            Self::Budget(b) => OffloadConfig {
                host_budget: Some(b),
                ..base.clone()
            },
            Self::Unpinned => OffloadConfig {
                pin_cpu_memory: Some(false),
                ..base.clone()
            },
        }
    }
}

/// `--weight-compression` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Compression {
    /// bf16 as stored.
    None,
    /// Coded blocks decoded on the device.
    Lossless,
    /// Each ring coded where the ring recurrence says it is faster, from
    /// the resident step's traced per-block compute at the row's token
    /// count and a decode measured at enable (one enable per token count).
    Auto,
}

impl Compression {
    pub(crate) fn config(self) -> WeightCompression {
        match self {
            Compression::None => WeightCompression::None,
            Compression::Lossless => WeightCompression::Lossless,
            Compression::Auto => WeightCompression::Auto,
        }
    }
}

/// `--fill-copy` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum FillCopy {
    /// Non-temporal stores (`copy_streaming`).
    Streaming,
    /// `copy_from_slice`.
    Plain,
}

/// `--fill-copy plain` was given: the loader's copies are plain.
static PLAIN_FILL: AtomicBool = AtomicBool::new(false);

/// A copy of the loader's bytes into a staging buffer or a pinned master,
/// as `--fill-copy` says.
pub(crate) fn fill_copy(dst: &mut [u8], src: &[u8]) {
    if PLAIN_FILL.load(Ordering::Relaxed) {
        dst.copy_from_slice(src);
    } else {
        offload_core::copy::copy_streaming(dst, src);
    }
}

/// `--law` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LawArg {
    /// N(0, 1/fan-in).
    Normal,
    /// Student-t, ν = 4, at the same variance.
    StudentT,
    /// Uniform ±1/√fan-in.
    Uniform,
}

impl LawArg {
    pub(crate) fn law(self) -> Law {
        match self {
            LawArg::Normal => Law::Normal,
            LawArg::StudentT => Law::StudentT4,
            LawArg::Uniform => Law::Uniform,
        }
    }
}

/// The flags of the DiT-only mode, checked.
pub(crate) struct Settings {
    pub(crate) tokens: Vec<u64>,
    pub(crate) steps: u64,
    pub(crate) warmup: u64,
    depths: Vec<usize>,
    /// The law of the loaded bf16 weights.
    pub(crate) law: Law,
    compressions: Vec<Compression>,
    /// `--staging-rings`, bytes (empty: the library's default ring).
    staging_rings: Vec<u64>,
}

/// A comma-separated list of `flag`, each parsed by `parse`; empty items
/// are skipped.
pub(crate) fn list<T>(
    flag: &str,
    text: &str,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Vec<T>> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| parse(s).map_err(|e| anyhow::anyhow!("{flag}: {e}")))
        .collect()
}

/// Token counts of `--tokens` (`text`), each in 1..=[`MAX_TOKENS`], at
/// least one.
pub(crate) fn token_list(text: &str) -> Result<Vec<u64>> {
    let allowed = format!("give token counts such as 4608,16896, each in 1..={MAX_TOKENS}");
    let tokens = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let n: u64 = s
                .parse()
                .map_err(|_| anyhow::anyhow!("--tokens: `{s}` is not a number ({allowed})"))?;
            ensure!(
                (1..=MAX_TOKENS).contains(&n),
                "--tokens: {n} is outside 1..={MAX_TOKENS}"
            );
            Ok(n)
        })
        .collect::<Result<Vec<u64>>>()?;
    ensure!(
        !tokens.is_empty(),
        "--tokens: `{text}` names no token count ({allowed})"
    );
    Ok(tokens)
}

impl Settings {
    fn from_args(args: &Args) -> Result<Self> {
        let pipeline_only = [
            ("--budgets", args.budgets.is_some()),
            ("--hog-gib", args.hog_gib.is_some()),
            ("--saved-from", args.saved_from.is_some()),
        ];
        for (flag, given) in pipeline_only {
            ensure!(
                !given,
                "{flag} goes with --pipeline (device budgets plan whole requests; the DiT-only mode has no budget rows)"
            );
        }
        ensure!(
            !(args.copy_beside && args.ranks > 1),
            "--copy-beside times one GPU's resident step beside copies; allowed: --ranks 1"
        );
        let tokens = token_list(args.tokens.as_deref().unwrap_or("4608,16896"))?;
        let steps = args.steps.unwrap_or(5);
        ensure!(
            (1..=MAX_STEPS).contains(&steps),
            "--steps: {steps} is outside 1..={MAX_STEPS} (the median of the timed steps is reported)"
        );
        let warmup = args.warmup.unwrap_or(2);
        ensure!(
            warmup <= MAX_WARMUP,
            "--warmup: {warmup} is outside 0..={MAX_WARMUP}"
        );
        let depths = list("--depths", &args.depths, |s| {
            s.parse::<usize>()
                .ok()
                .filter(|d| {
                    u32::try_from(*d)
                        .is_ok_and(|d| offload_core::config::PREFETCH_DEPTHS.contains(&d))
                })
                .ok_or_else(|| {
                    let r = offload_core::config::PREFETCH_DEPTHS;
                    format!(
                        "`{s}` is not a depth; allowed: {}..={} (the `prefetch_depth` key's range)",
                        r.start(),
                        r.end()
                    )
                })
        })?;
        let compressions = compressions(args)?;
        ensure!(
            args.staging_rings.is_empty() || !args.host_budgets.is_empty(),
            "--staging-rings sizes the staging ring of the staged rows: with --host-budgets only"
        );
        ensure!(
            !args.staged_chooser || !args.host_budgets.is_empty(),
            "--staged-chooser runs staged rows again at the staged chooser's depth: with --host-budgets only"
        );
        let staging_rings = args
            .staging_rings
            .iter()
            .map(|t| {
                let bytes = offload_core::bytes::ByteSize::parse(t)
                    .map(offload_core::bytes::ByteSize::bytes)
                    .map_err(|e| anyhow::anyhow!("--staging-rings: {e}"))?;
                ensure!(
                    bytes >= 1 << 20,
                    "--staging-rings: `{t}` is below 1 MiB (eight parts of at least 128 KiB); give a size such as 512MiB"
                );
                Ok(bytes)
            })
            .collect::<Result<Vec<u64>>>()?;
        // With `--copy-beside` the resident rows alone are a run (the
        // interference probe: resident beside copies, no layerwise row).
        ensure!(
            !(depths.is_empty() && args.no_planner && !args.copy_beside),
            "--depths names no depth and --no-planner leaves out the chooser's rows: no layerwise row would run; name a depth in 1..=16, drop --no-planner, or add --copy-beside for the resident rows alone"
        );
        Ok(Self {
            tokens,
            steps,
            warmup,
            depths,
            law: args.law.law(),
            compressions,
            staging_rings,
        })
    }
}

/// The `"auto"` rows of the DiT-only mode, `(at the chooser's look-ahead,
/// depth, tokens)`: one enable per token count (`"auto"` decides from that
/// count's compute) at each `--depths`, then at the depth the chooser
/// picked for it unless `--no-planner`, as the uncoded rows run.
pub(crate) fn auto_rows(
    depths: &[usize],
    chosen: &BTreeMap<u64, budget::Lookahead>,
    no_planner: bool,
) -> Vec<(bool, usize, u64)> {
    let fixed = depths
        .iter()
        .flat_map(|&d| chosen.keys().map(move |&t| (false, d, t)));
    let planned = chosen
        .iter()
        .filter(|_| !no_planner)
        .map(|(&t, l)| (true, l.depth, t));
    fixed.chain(planned).collect()
}

/// `--weight-compression`'s values, each once, in the order given.
pub(crate) fn compressions(args: &Args) -> Result<Vec<Compression>> {
    let mut out = Vec::new();
    for c in &args.weight_compression {
        if !out.contains(c) {
            out.push(*c);
        }
    }
    ensure!(
        !out.is_empty(),
        "--weight-compression: name at least one of none, lossless, auto"
    );
    Ok(out)
}

/// The planted bugs `--plant` asks for (none without the feature).
#[cfg(feature = "planted-bugs")]
fn planted(args: &Args) -> Result<Vec<PlantedBug>> {
    let Some(name) = &args.plant else {
        return Ok(Vec::new());
    };
    let bug = PlantedBug::from_name(name).with_context(|| {
        let names: Vec<String> = PlantedBug::ALL.iter().map(|b| b.name()).collect();
        format!(
            "--plant: unknown bug `{name}`; allowed: {}",
            names.join(", ")
        )
    })?;
    Ok(vec![bug])
}

/// A loader's buffers: each unit packed as the partition lays it out, in
/// host memory the weights already occupy. Regions are handed out shared,
/// so every backend of the run registers the same memory in place.
pub(crate) struct Loaded {
    pub(crate) units: BTreeMap<String, Arc<Vec<u8>>>,
    /// Each unit's layout as loaded: a backend's unit of the same name
    /// and a different layout is refused (copied instead, never misread).
    entries: BTreeMap<String, Vec<Entry>>,
    pub(crate) at: BTreeMap<StorageId, (String, u64)>,
    /// Units a backend asked for that were not loaded as it lays them out
    /// (each then copied into a pinned master: correct, slower).
    mismatched: AtomicU64,
}

impl Loaded {
    /// Units asked for in place and refused so far.
    pub(crate) fn mismatched(&self) -> u64 {
        self.mismatched.load(Ordering::Relaxed)
    }

    /// Bytes loaded.
    pub(crate) fn bytes(&self) -> u64 {
        self.units.values().map(|b| b.len() as u64).sum()
    }
}

struct Shared(Arc<Vec<u8>>);

// SAFETY: the bytes live in a Vec behind an Arc: nobody can move or write
// them while this handle holds a reference (Arc hands out `&mut` only to a
// sole owner), and `bytes` returns the same slice every time.
unsafe impl HostRegion for Shared {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl WeightSource for Loaded {
    fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        let (unit, offset) = &self.at[&storage];
        let start = (offset + position) as usize;
        fill_copy(dst, &self.units[unit][start..start + dst.len()]);
    }

    fn take_region(&self, unit: &Unit) -> Option<Box<dyn HostRegion>> {
        if self.entries.get(&unit.name) != Some(&unit.entries) {
            self.mismatched.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        self.units
            .get(&unit.name)
            .map(|b| Box::new(Shared(Arc::clone(b))) as Box<dyn HostRegion>)
    }

    /// The loader keeps every byte: distributed layerwise `disable` need
    /// not gather the blocks back.
    fn wants_restore(&self) -> bool {
        false
    }
}

/// FNV-1a of a unit's name: its generator's seed, so that units of one
/// shape (all 19 double blocks, all 38 single blocks) get distinct weights.
fn name_seed(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Each bf16 storage's tensor (for drawing it): its index among the
/// storages, its path and shape; and every tensor's path and shape (a
/// bias's scale reads its weight's fan-in).
struct Drawn {
    bf16: BTreeMap<StorageId, (usize, String, Vec<u64>)>,
    all: Vec<(String, Vec<u64>)>,
    law: Law,
}

impl Drawn {
    fn new(pipeline: &Pipeline, law: Law) -> Self {
        let mut by_storage: BTreeMap<StorageId, Vec<TensorId>> = BTreeMap::new();
        for (id, t) in pipeline.tensors() {
            by_storage.entry(t.storage).or_default().push(id);
        }
        let index: BTreeMap<StorageId, usize> = pipeline
            .storages()
            .enumerate()
            .map(|(i, (s, _))| (s, i))
            .collect();
        let bf16 = by_storage
            .into_iter()
            .filter(|(_, ts)| ts.len() == 1 && pipeline.tensor(ts[0]).dtype == DType::Bf16)
            .map(|(s, ts)| {
                let t = pipeline.tensor(ts[0]);
                (s, (index[&s], pipeline.tensor_path(ts[0]), t.shape.clone()))
            })
            .collect();
        let all = pipeline
            .tensors()
            .map(|(id, t)| (pipeline.tensor_path(id), t.shape.clone()))
            .collect();
        Self { bf16, all, law }
    }

    /// One unit's bytes: each bf16 tensor drawn from the law at its init
    /// scale (seeded by the unit's name and the storage), everything else
    /// [`generate`]'s random bytes.
    fn unit(&self, unit: &Unit) -> Vec<u8> {
        let mut buf = generate(unit);
        for e in &unit.entries {
            let Some((index, name, shape)) = self.bf16.get(&e.storage) else {
                continue;
            };
            let bytes = tensor_bytes(
                self.law,
                name_seed(&unit.name),
                *index,
                name,
                shape,
                &self.all,
                1,
            );
            if bytes.len() as u64 == e.bytes {
                buf[e.offset as usize..(e.offset + e.bytes) as usize].copy_from_slice(&bytes);
            }
        }
        buf
    }
}

/// One unit's random bf16 values, small and finite (never zeros).
fn generate(unit: &Unit) -> Vec<u8> {
    let mut buf = vec![0u8; unit.bytes as usize];
    let mut z = name_seed(&unit.name);
    for chunk in buf.chunks_mut(8) {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
        // High byte of each bf16: a bounded exponent.
        x = (x & 0x81ff_81ff_81ff_81ff) | 0x3c00_3c00_3c00_3c00;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    buf
}

/// The partition every backend packs `pipeline` in
/// ([`offload_core::runtime::packing`]).
pub(crate) fn packing(pipeline: &Pipeline) -> Result<offload_core::runtime::Partition> {
    offload_core::runtime::packing(pipeline).context("resolving the packing")
}

/// Weights written by 16 threads straight into the loader's buffers: every
/// bf16 tensor drawn from `law` at its init scale, the rest random bytes.
pub(crate) fn load(pipeline: &Pipeline, law: Law) -> Result<Loaded> {
    let drawn = Drawn::new(pipeline, law);
    let drawn = &drawn;
    let part = packing(pipeline)?;
    let units: Vec<&Unit> = part.all().collect();
    let mut at = BTreeMap::new();
    for u in &units {
        for e in &u.entries {
            at.insert(e.storage, (u.name.clone(), e.offset));
        }
    }
    let entries = units
        .iter()
        .map(|u| (u.name.clone(), u.entries.clone()))
        .collect();
    let buffers: Vec<(String, Vec<u8>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..16)
            .map(|t| {
                let chunk: Vec<&Unit> = units.iter().skip(t).step_by(16).copied().collect();
                s.spawn(move || {
                    chunk
                        .into_iter()
                        .map(|u| (u.name.clone(), drawn.unit(u)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a weight generator thread panicked"))
            })
            .collect::<Result<Vec<_>>>()
            .map(|v| v.into_iter().flatten().collect())
    })?;
    Ok(Loaded {
        units: buffers.into_iter().map(|(n, b)| (n, Arc::new(b))).collect(),
        entries,
        at,
        mismatched: AtomicU64::new(0),
    })
}

/// Pinned host→device bandwidth, GB/s: 1 GiB copies, median of five.
fn bandwidth(device: &CudaDevice, stream: &CudaStream) -> Result<f64> {
    sampled_bandwidth(device, stream, 6, 1, || Ok(()))
}

/// Pinned host→device bandwidth, GB/s: `samples` copies of 1 GiB, each
/// after `before_each` (untimed), the median of all but the first `skip`.
fn sampled_bandwidth(
    device: &CudaDevice,
    stream: &CudaStream,
    samples: usize,
    skip: usize,
    mut before_each: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let bytes = 1u64 << 30;
    let host = device.alloc_pinned(bytes)?;
    let dev = device.alloc_device(bytes)?;
    let mut times = Vec::new();
    for _ in 0..samples {
        before_each()?;
        let t = Instant::now();
        // SAFETY: whole buffers of equal size; synchronised before reuse.
        unsafe { device.copy_h2d(stream, HostSource::Pinned(&host), 0, &dev, 0, bytes) }?;
        device.synchronize_stream(stream)?;
        times.push(t.elapsed().as_secs_f64());
    }
    // SAFETY: the stream is drained.
    unsafe {
        device.free_device(dev, &[])?;
        device.free_pinned(host)?;
    }
    let kept = times.get_mut(skip..).unwrap_or_default();
    Ok(bytes as f64 / median(kept).context("no bandwidth samples")? / 1e9)
}

/// The median, or `None` for no samples.
fn median(v: &mut [f64]) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// The proxy's scratch at `tokens`: activations and outputs for the widest
/// GEMM of the pipeline and for attention (saturating: an absurd count
/// asks for more than any GPU has).
fn scratch_bytes(pipeline: &Pipeline, tokens: u64) -> (u64, u64) {
    let (mut widest_in, mut widest_out) = (0u64, 0u64);
    for (_, t) in pipeline.tensors() {
        if t.dtype == DType::Bf16 && t.shape.len() == 2 {
            widest_out = widest_out.max(t.shape[0]);
            widest_in = widest_in.max(t.shape[1]);
        }
    }
    let (att_in, att_out) = Proxy::attention_scratch(HEADS, tokens, HEAD_DIM);
    let input = tokens
        .saturating_mul(widest_in)
        .saturating_mul(2)
        .max(att_in);
    let output = tokens
        .saturating_mul(widest_out)
        .saturating_mul(2)
        .max(att_out);
    (input, output)
}

/// One DiT forward: per block, every weight view folded, a GEMM per 2-D
/// bf16 weight with its real shape on the rows it runs on in Flux
/// ([`linear_rows`]), attention at Flux's cost over all tokens, then the
/// chain step.
fn step(rt: &Runtime<Cuda>, proxy: &Proxy, tokens: u64) -> Result<()> {
    step_marked(rt, proxy, tokens, None)
}

/// [`step`], each block's compute marked on the GPU timeline of `mark`.
fn step_marked(
    rt: &Runtime<Cuda>,
    proxy: &Proxy,
    tokens: u64,
    mark: Option<&CudaDevice>,
) -> Result<()> {
    rt.forward("transformer", |dit| {
        dit_body(dit, proxy, tokens, mark, &mut || Ok(()))
    })?;
    Ok(())
}

/// The body of one DiT forward in the DiT's scope `dit` (see [`step`]):
/// its own tensors, then each block in a child scope (its hooks bring it
/// in), `after_block` called after each block's kernels are enqueued.
pub(crate) fn dit_body(
    dit: &Scope<'_, Cuda>,
    proxy: &Proxy,
    tokens: u64,
    mark: Option<&CudaDevice>,
    after_block: &mut dyn FnMut() -> Result<(), BoxError>,
) -> Result<(), BoxError> {
    let split = flux_split(tokens);
    let p = dit.pipeline();
    let module = dit.module();
    let prefix = format!("{}.", dit.path());
    let blocks = blocks_of(p, module);
    let traffic: Vec<u64> = blocks
        .iter()
        .map(|b| flux().block_work(p, *b, split).activation_bytes)
        .collect();
    let inner: BTreeSet<TensorId> = blocks.iter().flat_map(|b| p.subtree_tensors(*b)).collect();
    let own: Vec<TensorId> = p
        .subtree_tensors(module)
        .into_iter()
        .filter(|t| !inner.contains(t))
        .collect();
    kernels(dit, proxy, &own, &prefix, split)?;
    proxy.chain(dit.stream())?;
    for (b, traffic) in blocks.into_iter().zip(traffic) {
        let path = &p.module(b).path;
        let rel = path.strip_prefix(&prefix).unwrap_or(path).to_owned();
        let tensors = p.subtree_tensors(b);
        dit.child(&rel, |blk| {
            let span = match mark {
                Some(d) => Some(d.timeline_begin(blk.stream(), path.as_str())?),
                None => None,
            };
            kernels(blk, proxy, &tensors, &prefix, split)?;
            attention_chunked(proxy, HEADS, tokens, HEAD_DIM)?;
            proxy.traffic(traffic)?;
            proxy.chain(blk.stream())?;
            if let (Some(d), Some(span)) = (mark, span) {
                d.timeline_end(blk.stream(), span)?;
            }
            Ok(())
        })?;
        after_block()?;
    }
    Ok(())
}

/// `proxy.linear` over `rows` rows in as few equal chunks as the proxy's
/// scratch holds (one call when it holds them all): the same FLOPs and
/// the same weight bytes read per chunk, with a bounded scratch.
pub(crate) fn linear_chunked(
    proxy: &Proxy,
    w: u64,
    out_f: u64,
    in_f: u64,
    rows: u64,
) -> Result<(), BoxError> {
    let fit = |len: u64, width: u64| len / width.saturating_mul(2).max(1);
    let cap = fit(proxy.input().len_bytes(), in_f)
        .min(fit(proxy.output().len_bytes(), out_f))
        .max(1);
    let chunks = rows.div_ceil(cap).max(1);
    let per = rows.div_ceil(chunks);
    let mut left = rows;
    while left > 0 {
        let r = per.min(left);
        proxy.linear(w, out_f, in_f, r)?;
        left -= r;
    }
    Ok(())
}

/// `proxy.attention` over `heads` heads, as many heads per call as the
/// proxy's scratch holds (all of them when it can): the same FLOPs.
pub(crate) fn attention_chunked(
    proxy: &Proxy,
    heads: u64,
    tokens: u64,
    head_dim: u64,
) -> Result<(), BoxError> {
    let (have_in, have_out) = (proxy.input().len_bytes(), proxy.output().len_bytes());
    let fits = |h: u64| {
        let (i, o) = Proxy::attention_scratch(h, tokens, head_dim);
        i <= have_in && o <= have_out
    };
    let per = (1..=heads.max(1)).rev().find(|h| fits(*h)).unwrap_or(1);
    let mut left = heads;
    while left > 0 {
        let h = per.min(left);
        proxy.attention(h, tokens, head_dim)?;
        left -= h;
    }
    Ok(())
}

/// Flux's split of a token count: 512 text tokens (fewer when the count
/// is small), the rest image.
fn flux_split(tokens: u64) -> TokenSplit {
    flux().split(tokens)
}

/// The Flux.1-dev preset (its cost model), built once.
fn flux() -> &'static offload_sim::presets::Preset {
    static FLUX: std::sync::OnceLock<offload_sim::presets::Preset> = std::sync::OnceLock::new();
    FLUX.get_or_init(offload_sim::presets::flux1_dev)
}

/// A proxy sized for `tokens`, and the activation memory of that workload:
/// its scratch and cuBLAS's workspace, as the allocator counts them.
fn measured_proxy(
    device: &CudaDevice,
    stream: &Arc<CudaStream>,
    pipeline: &Pipeline,
    tokens: u64,
) -> Result<(Proxy, u64)> {
    let (input_bytes, output_bytes) = scratch_bytes(pipeline, tokens);
    device.synchronize_stream(stream)?;
    let before = device.pool_used()?.0;
    let proxy = new_proxy(device, stream, input_bytes, output_bytes)?;
    Ok((proxy, device.pool_used()?.0.saturating_sub(before)))
}

/// The proxy's elementwise traffic kernel alone, GB/s moved (8 GB, the
/// median of three).
fn traffic_gbps(device: &CudaDevice, stream: &CudaStream, proxy: &Proxy) -> Result<f64> {
    let bytes = 8_000_000_000u64;
    let mut times = Vec::new();
    for _ in 0..3 {
        device.synchronize_stream(stream)?;
        let t = Instant::now();
        proxy.traffic(bytes)?;
        device.synchronize_stream(stream)?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(bytes as f64 / median(&mut times).context("no samples")? / 1e9)
}

/// Every tensor of `tensors` folded, and a GEMM per 2-D bf16 weight on
/// the rows it runs on in Flux (its path below `prefix`, the DiT's, read
/// by [`linear_rows`]).
fn kernels(
    scope: &Scope<'_, Cuda>,
    proxy: &Proxy,
    tensors: &[TensorId],
    prefix: &str,
    split: TokenSplit,
) -> Result<(), BoxError> {
    let p = scope.pipeline();
    for t in tensors {
        let v = scope.view_id(*t)?;
        let ptr = v.buffer().ptr() + v.byte_range().start;
        let tensor = v.tensor();
        if tensor.dtype == DType::Bf16 && tensor.shape.len() == 2 {
            let path = p.tensor_path(*t);
            let rows = linear_rows(path.strip_prefix(prefix).unwrap_or(&path), split);
            linear_chunked(proxy, ptr, tensor.shape[0], tensor.shape[1], rows)?;
        }
        proxy.fold(
            scope.stream(),
            ptr,
            v.byte_range().end - v.byte_range().start,
        )?;
    }
    Ok(())
}

/// Builds one run's backend.
type MakeBackend<'a> = dyn Fn() -> Result<Box<dyn Backend<Cuda>>> + 'a;

/// The limit no schedule beats: `max(resident step, streamed bytes / the
/// link at `gbps` GB/s)`, seconds.
fn link_limit_s(resident_step: f64, streamed_bytes: f64, gbps: f64) -> f64 {
    resident_step.max(streamed_bytes / (gbps * 1e9))
}

/// A row's limit at the link measured beside it, and its step against
/// that limit; `(None, None)` where no positive rate was measured.
fn row_link_ratio(
    step: f64,
    resident_step: f64,
    streamed_bytes: f64,
    row_gbps: Option<f64>,
) -> (Option<f64>, Option<f64>) {
    match row_gbps.filter(|g| *g > 0.0) {
        Some(g) => {
            let limit = link_limit_s(resident_step, streamed_bytes, g);
            (Some(limit), Some(step / limit))
        }
        None => (None, None),
    }
}

/// One row of the tables.
#[derive(Serialize, Clone)]
struct Row {
    run: String,
    tokens: u64,
    /// Prefetch depth (0 for resident).
    depth: usize,
    /// Which of `--repeats` this row is (0-based).
    repeat: u32,
    /// The chooser's look-ahead at this token count (for the chooser's
    /// rows): depth, slots, slot bytes, their device memory and its
    /// prediction.
    lookahead: Option<budget::Lookahead>,
    streamed_bytes: u64,
    /// The median of the timed steps.
    step_s: f64,
    /// Each timed step, s, in the order run: whether a slow median is one
    /// hiccup or every step slower (a link that moved) shows here.
    step_times_s: Vec<f64>,
    /// `max(resident step, streamed / fresh pinned bandwidth)`.
    limit_s: f64,
    ratio: f64,
    /// `max(resident step, streamed / host-master bandwidth)`.
    limit_masters_s: f64,
    ratio_masters: f64,
    /// Streamed rows: the fresh-buffer pinned bandwidth measured right
    /// after this row's timed steps (the link drifts by a few per cent over
    /// a sweep's minutes; `None` where the probe's 1 GiB did not fit),
    /// GB/s.
    row_link_gbps: Option<f64>,
    /// `max(resident step, streamed / row_link_gbps)`.
    row_limit_s: Option<f64>,
    /// `step_s / row_limit_s`.
    ratio_row_link: Option<f64>,
    /// `--copy-beside` rows: the rate the unrelated copy stream ran at,
    /// one figure for every row of the spec (from after its enable to its
    /// last token count's traced step), GB/s. Its copies are in the row's
    /// traced copy figures too (the compute figures are what it is for).
    beside_gbps: Option<f64>,
    /// The predicted step: the ring recurrence
    /// (`budget::predict_step`) on the resident step's per-block compute
    /// and the host-master bandwidth.
    predicted_s: f64,
    /// The simulator's predicted step (`offload-sim`, the `h200` profile
    /// with this run's host-master bandwidth).
    simulated_s: Option<f64>,
    /// The simulator's step over its own limit (its resident step, the
    /// streamed bytes over the host-master bandwidth).
    simulated_ratio: Option<f64>,
    peak_device_weight_bytes: u64,
    peak_cumemgetinfo_bytes: u64,
    host_weight_bytes: u64,
    enable_s: f64,
    output: u64,
    output_equals_resident: bool,
    /// The traced step.
    timeline: Analysis,
    /// `none` or `lossless`.
    weight_compression: String,
    /// Lossless rows: the bytes the link carried per timed step (coded
    /// blocks as decoded, any block the codec refused as bf16).
    link_bytes_per_step: Option<u64>,
    /// Lossless rows: `link_bytes_per_step` / the streamed bf16 bytes.
    link_over_bf16: Option<f64>,
    /// Host master bytes / the streamed bf16 bytes.
    host_over_bf16: f64,
    /// The bf16 link limit: streamed bf16 bytes / the fresh pinned
    /// bandwidth (what no bf16 schedule beats on the link).
    bf16_link_limit_s: f64,
    /// `step_s / bf16_link_limit_s`.
    step_over_bf16_link: f64,
    /// Lossless rows: the decoder's error flag after the row (0: none).
    decode_error: Option<i32>,
    /// Page-locked host bytes offload-cuda itself counted at their peak
    /// over the row (`offload_cuda::host_locked`, beyond what was held
    /// before its enable): pinned copies, registrations, staging buffers.
    host_locked_peak_bytes: u64,
    /// Streamed bytes whose masters are staged (CONTRACT §7c: pageable,
    /// through pinned staging buffers), from the backend's host masters.
    staged_bytes: u64,
    /// Staged rows: the staged path's own limit, max(resident step,
    /// streamed / fresh pinned bandwidth, staged / host copy rate).
    staged_limit_s: Option<f64>,
    /// `step_s / staged_limit_s`.
    step_over_staged_limit: Option<f64>,
    /// `file` rows: the peak of the process's resident file-backed pages
    /// (`RssFile`) from before the enable to the last step.
    rss_file_peak_bytes: Option<u64>,
    /// `file` rows: the share of the block bytes read from the file after
    /// the enable (the staged blocks' fills) that were read with `pread`
    /// (released blocks), the rest through the mapping: which reader's
    /// rates its limits use.
    file_pread_share: Option<f64>,
    /// `file` rows: the share of those bytes whose pages were released
    /// after their read.
    file_released_share: Option<f64>,
    /// `file` rows: the file's read rate from the page cache, alone, by
    /// the row's reader, GB/s.
    file_read_gbps: Option<f64>,
    /// `file` rows: the file's own limit, max(resident step, pinned bytes
    /// / bandwidth + staged bytes / `file_read_gbps`).
    file_limit_s: Option<f64>,
    /// `step_s / file_limit_s`.
    step_over_file_limit: Option<f64>,
    /// `file` rows: the same limit at the file's staged stream (the row's
    /// reader pipelined with the DMA through two pinned buffers, no
    /// compute: the read and the DMA share the host's memory).
    file_stream_limit_s: Option<f64>,
    /// `step_s / file_stream_limit_s`.
    step_over_file_stream_limit: Option<f64>,
    /// Staged rows: the ring engine's own forecast of the step
    /// (`Backend::staged_forecast`: the recurrence with the host stage, at
    /// the fill rate its fills ran at over their last pass, from
    /// this token count's traced compute), s.
    forecast_s: Option<f64>,
    /// The host fill rate the forecast used (measured by the engine), GB/s.
    forecast_fill_gbps: Option<f64>,
    /// The bound the forecast sits on (compute, the link, the host's fills).
    forecast_bound: Option<String>,
    /// Staged rows: the look-ahead the staged chooser picks for the ring
    /// (`Backend::staged_lookahead`, depths 1 to 16, from the same inputs
    /// as the forecast) and its forecast there.
    staged_chooser: Option<budget::Lookahead>,
}

/// One run: a backend and the token counts it runs.
struct Spec<'a> {
    name: String,
    /// Which of `--repeats`.
    repeat: u32,
    /// The chooser's look-ahead per token count (its rows only).
    lookahead: BTreeMap<u64, budget::Lookahead>,
    /// The proxy it computes with.
    proxy: &'a Proxy,
    depth: usize,
    streamed: u64,
    tokens: Vec<u64>,
    /// Its `weight_compression`.
    compression: Compression,
    make: Box<MakeBackend<'a>>,
    /// A `file` row: its masters from `--masters-file`, whose page cache
    /// is dropped before the enable; resident file pages sampled.
    file: bool,
    /// A `--copy-beside` row: an unrelated copy stream runs from after the
    /// enable to the last step ([`beside::Beside`]).
    beside: bool,
}

/// Host→device bandwidth of the host masters themselves, GB/s: every block
/// of the loaded weights registered in place (as layerwise does) and copied
/// back to back into one device buffer, no compute; the median of three
/// passes.
fn master_bandwidth(
    device: &CudaDevice,
    stream: &CudaStream,
    loaded: &Loaded,
    blocks: &[&Unit],
) -> Result<f64> {
    let largest = blocks.iter().map(|u| u.bytes).max().context("no blocks")?;
    let dev = device.alloc_device(largest)?;
    let mut regs = Vec::new();
    for u in blocks {
        let region = loaded
            .take_region(u)
            .with_context(|| format!("no loaded memory for `{}`", u.name))?;
        regs.push(device.register_host(region).map_err(|e| e.error)?);
    }
    let total: u64 = blocks.iter().map(|u| u.bytes).sum();
    let mut times = Vec::new();
    for _ in 0..3 {
        device.synchronize_stream(stream)?;
        let t = Instant::now();
        for (u, r) in blocks.iter().zip(&regs) {
            // SAFETY: each copy reads a whole registered unit into the
            // start of a buffer at least as large; nothing is freed or
            // unregistered before the synchronisation below.
            unsafe { device.copy_h2d(stream, HostSource::Registered(r), 0, &dev, 0, u.bytes) }?;
        }
        device.synchronize_stream(stream)?;
        times.push(t.elapsed().as_secs_f64());
    }
    for r in regs {
        // SAFETY: the stream is drained: no copy reads it.
        unsafe { device.unregister_host(r) }?;
    }
    // SAFETY: as above.
    unsafe { device.free_device(dev, &[])? };
    Ok(total as f64 / median(&mut times).context("no samples")? / 1e9)
}

/// Anonymous host memory with or without transparent huge pages, for the
/// page probe.
struct Anon(memmap2::MmapMut);

// SAFETY: the mapping is owned here and never remapped or written while
// registered (only `&self.0` is lent); `bytes` returns the same slice
// every time.
unsafe impl HostRegion for Anon {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Host→device bandwidth from 2 GiB registered in place, GB/s: anonymous
/// memory advised to use huge pages (`huge`) or 4 KiB pages, touched, then
/// copied whole three times (the median), in 64 MiB pieces (a block's
/// order of size).
fn page_probe(device: &CudaDevice, stream: &CudaStream, huge: bool) -> Result<f64> {
    const BYTES: usize = 2 << 30;
    const PIECE: u64 = 64 << 20;
    let mut map = memmap2::MmapOptions::new().len(BYTES).map_anon()?;
    let advice = if huge {
        memmap2::Advice::HugePage
    } else {
        memmap2::Advice::NoHugePage
    };
    map.advise(advice)?;
    map.fill(0x3c);
    let reg = device
        .register_host(Box::new(Anon(map)))
        .map_err(|e| e.error)?;
    let dev = device.alloc_device(PIECE)?;
    let mut times = Vec::new();
    for _ in 0..3 {
        device.synchronize_stream(stream)?;
        let t = Instant::now();
        for k in 0..(BYTES as u64 / PIECE) {
            // SAFETY: each piece lies inside the registration and the
            // buffer; nothing is freed before the synchronisation below.
            unsafe {
                device.copy_h2d(
                    stream,
                    HostSource::Registered(&reg),
                    k * PIECE,
                    &dev,
                    0,
                    PIECE,
                )
            }?;
        }
        device.synchronize_stream(stream)?;
        times.push(t.elapsed().as_secs_f64());
    }
    // SAFETY: the stream is drained.
    unsafe {
        device.unregister_host(reg)?;
        device.free_device(dev, &[])?;
    }
    Ok(BYTES as f64 / median(&mut times).context("no samples")? / 1e9)
}

/// The kernel's transparent-huge-page setting, as it reads.
fn thp_setting() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map_or_else(|e| format!("unknown ({e})"), |s| s.trim().to_owned())
}

/// The ring recurrence's inputs at one token count: each block's compute
/// from the traced resident step (in stack order), its copy from the
/// host masters' bandwidth, the step's compute outside the blocks.
#[derive(Clone, Debug)]
struct Ring {
    compute_s: Vec<f64>,
    copy_s: Vec<f64>,
    other_s: f64,
    interference: f64,
}

/// The fixed cost of one copy the recurrence assumes (the planner's
/// default `copy_latency_s`).
const COPY_LATENCY_S: f64 = 10e-6;

impl Ring {
    fn new(resident: &Analysis, resident_step: f64, master_gbps: f64, blocks: &[Unit]) -> Self {
        let compute_s: Vec<f64> = blocks
            .iter()
            .map(|u| resident.per_block_s.get(&u.name).copied().unwrap_or(0.0))
            .collect();
        let sum: f64 = compute_s.iter().sum();
        Self {
            copy_s: blocks
                .iter()
                .map(|u| u.bytes as f64 / (master_gbps * 1e9) + COPY_LATENCY_S)
                .collect(),
            compute_s,
            other_s: (resident_step - sum).max(0.0),
            interference: offload_sim::DeviceProfile::h200().copy_interference,
        }
    }

    /// What `weight_compression = "auto"` decides from at this token
    /// count: the link (the masters' bandwidth), the copy latency and
    /// interference the recurrence assumes, the resident step's traced
    /// compute of each block (by path) and outside them.
    fn inputs(&self, blocks: &[Unit], master_gbps: f64, steps: u64) -> budget::PlannerInputs {
        let mut dit = offload_core::budget::ComponentInputs::new(1.0, true, 0);
        dit.own_compute_s = self.other_s;
        dit.block_compute_s = blocks
            .iter()
            .zip(&self.compute_s)
            .map(|(u, c)| (u.name.clone(), *c))
            .collect();
        let mut inputs = budget::PlannerInputs::new(master_gbps * 1e9, steps as u32)
            .component("transformer", dit);
        inputs.copy_latency_s = COPY_LATENCY_S;
        inputs.copy_interference = self.interference;
        inputs
    }

    /// The chooser's look-ahead with every block streamed, through slots
    /// of `slot_bytes` (no memory cap: default layerwise).
    fn choose(&self, slot_bytes: u64) -> Result<budget::Lookahead> {
        let resident = vec![false; self.compute_s.len()];
        let shape = budget::RingShape {
            compute_s: &self.compute_s,
            copy_s: &self.copy_s,
            resident: &resident,
            other_s: self.other_s,
            interference: self.interference,
        };
        Ok(budget::choose_lookahead(
            &shape,
            slot_bytes,
            MAX_PLANNED_DEPTH,
            None,
        )?)
    }

    /// The steady-state step with every block streamed at `depth`.
    fn predict(&self, depth: usize) -> f64 {
        budget::predict_step(
            &self.compute_s,
            &self.copy_s,
            &vec![false; self.compute_s.len()],
            depth,
            self.other_s,
            self.interference,
        )
    }
}

/// The simulator's predicted step, s: Flux.1-dev on the simulated `h200`
/// (its calibrated kernel model) with this run's host-master bandwidth,
/// `config` at `depth` (`None`: resident), two requests of ten steps,
/// the second timed (its first block was prefetched before it began: one
/// block's copy in ten steps).
fn simulate(
    config: Option<&OffloadConfig>,
    depth: usize,
    tokens: u64,
    master_gbps: f64,
) -> Result<f64> {
    use offload_sim::harness::{RunOptions, StrategyChoice, Workload, run};
    let preset = flux().clone();
    let divisor = (preset.weight_bytes() / (64 << 20))
        .max(1)
        .next_power_of_two();
    let w = Workload {
        preset,
        tokens,
        steps: 10,
        requests: 2,
    };
    let mut profile = offload_sim::DeviceProfile::h200();
    profile.h2d_pinned_gbps = master_gbps;
    let opts = RunOptions {
        prefetch_depth: depth.max(1),
        payload_divisor: divisor,
        ..RunOptions::new(profile)
    };
    let choice = config.map_or(StrategyChoice::Resident, |c| {
        StrategyChoice::Config(c.clone())
    });
    let out = run(&w, &choice, &opts).map_err(|f| anyhow::anyhow!("simulating: {}", f.error))?;
    let last = out.requests.last().context("a simulated request")?;
    Ok(last.denoise_ns as f64 / w.steps as f64 / 1e9)
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
    let args = Args::parse();
    // The library's `info` lines (plans, coded forms, staged blocks,
    // warnings) on stderr, beside the bench's own.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing::Level::INFO)
        .with_target(false)
        .without_time()
        .try_init();
    PLAIN_FILL.store(args.fill_copy == FillCopy::Plain, Ordering::Relaxed);
    let _ = ATTENTION.set(args.attention);
    eprintln!("proxy attention: {}", attention_kind().name());
    #[cfg(feature = "planted-bugs")]
    let bugs = planted(&args)?;
    #[cfg(not(feature = "planted-bugs"))]
    let bugs: Vec<offload_core::runtime::PlantedBug> = Vec::new();
    if args.pipeline {
        return pipeline::main(&args, &bugs);
    }
    let settings = Settings::from_args(&args)?;
    let plant_name: Option<String> = bugs.first().map(|b| b.name());
    if args.ranks > 1 {
        return dist::main(&settings, args.ranks, &args.json, &bugs);
    }
    if !driver_present() {
        bail!("no CUDA driver found: the benchmark needs a GPU");
    }
    let device = Arc::new(CudaDevice::new(0)?);
    let stream = Arc::new(device.create_stream()?);
    device.label_stream(&stream, timeline::COMPUTE);
    let pipeline = flux1_dev_dit();
    let weight_bytes: u64 = pipeline.storages().map(|(_, s)| s.bytes).sum();
    // The resident run holds every weight and the largest scratch at once.
    let free = device.memory_info()?.free_bytes;
    let fits = |t: u64| {
        let (i, o) = scratch_bytes(&pipeline, t);
        weight_bytes
            .saturating_add(i)
            .saturating_add(o)
            .saturating_add(HEADROOM_BYTES)
            <= free
    };
    let max_t = settings.tokens.iter().copied().max().unwrap_or(1);
    if !fits(max_t) {
        // The largest count that fits: the scratch grows with the count.
        let (mut lo, mut hi) = (0u64, max_t);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid) { lo = mid } else { hi = mid - 1 }
        }
        let (i, o) = scratch_bytes(&pipeline, max_t);
        let allowed = if lo == 0 {
            "none fits".to_owned()
        } else {
            format!("allowed here: 1..={lo}")
        };
        bail!(
            "--tokens: {max_t} needs {:.1} GB of proxy scratch beside {:.1} GB of weights, and {} has {:.1} GB free; {allowed}",
            (i.saturating_add(o)) as f64 / 1e9,
            weight_bytes as f64 / 1e9,
            device.name(),
            free as f64 / 1e9
        );
    }
    let bw = bandwidth(&device, &stream)?;
    eprintln!("pinned host→device (fresh 1 GiB buffer): {bw:.2} GB/s");
    let t = Instant::now();
    let loaded = Arc::new(load(&pipeline, settings.law)?);
    eprintln!(
        "weights in host memory: {:.1} GB in {:.1} s",
        weight_bytes as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    let layerwise = OffloadConfig {
        enable_layerwise_offload: true,
        ..OffloadConfig::default()
    };
    let plan = resolve(&pipeline, &layerwise)?;
    let streamed_all = plan.streamed_bytes();
    let (resident_part, largest) = (weight_bytes - streamed_all, plan.largest_block_bytes());
    let block_units: Vec<Unit> = {
        let part = packing(&pipeline)?;
        plan.stacks
            .iter()
            .flat_map(|s| &s.blocks)
            .map(|b| part.blocks[&b.module].clone())
            .collect()
    };
    let master_gbps = master_bandwidth(
        &device,
        &stream,
        &loaded,
        &block_units.iter().collect::<Vec<_>>(),
    )?;
    eprintln!("host masters → device, back to back: {master_gbps:.2} GB/s");
    let host_rows: Vec<HostRow> = args
        .host_budgets
        .iter()
        .map(|t| HostRow::parse(t).map_err(|e| anyhow::anyhow!("--host-budgets: {e}")))
        .collect::<Result<_>>()?;
    let block_refs: Vec<&Unit> = block_units.iter().collect();
    let host_gbps = if host_rows.is_empty() {
        None
    } else {
        let g = staged::fill_rate(
            &device,
            &block_refs,
            &|u: &Unit| Ok(staged::over(staged::loaded_bytes(&loaded, u)?)),
            3,
        )?;
        eprintln!("pageable → pinned host copy (the staging fill): {g:.2} GB/s");
        Some(g)
    };
    let stream_gbps = if host_rows.is_empty() {
        None
    } else {
        let g = staged::staged_stream_bandwidth(&device, &stream, &block_refs, &|u: &Unit| {
            Ok(staged::over(staged::loaded_bytes(&loaded, u)?))
        })?;
        eprintln!("staged stream (host copy + DMA, two buffers, no compute): {g:.2} GB/s");
        Some(g)
    };
    let file_masters = match (&args.masters_file, host_rows.is_empty()) {
        (Some(path), false) => {
            let f = Arc::new(staged::FileMasters::open(
                path,
                &block_refs,
                Arc::clone(&loaded),
            )?);
            let r = f.rates(&device, &stream, &block_refs)?;
            eprintln!(
                "masters file {:.2} GB read by the fill threads: {:.2} GB/s from the disk (page cache dropped, through the mapping); from the page cache {:.2} GB/s through the mapping ({:.2} with each block's pages released after its read), {:.2} GB/s with pread; beside the DMA (two pinned buffers, no compute) {:.2} GB/s through the mapping ({:.2} released), {:.2} GB/s with pread",
                f.len() as f64 / 1e9,
                r.cold,
                r.mapped,
                r.mapped_released,
                r.pread,
                r.mapped_stream,
                r.mapped_released_stream,
                r.pread_stream
            );
            Some((f, r))
        }
        _ => None,
    };
    let pages_4k = page_probe(&device, &stream, false)?;
    let pages_huge = page_probe(&device, &stream, true)?;
    let thp = thp_setting();
    eprintln!(
        "registered 2 GiB in 64 MiB copies: {pages_4k:.2} GB/s (4 KiB pages), {pages_huge:.2} GB/s (huge pages); THP: {thp}"
    );
    let (proxy, activation_bytes) = measured_proxy(&device, &stream, &pipeline, max_t)?;
    let elementwise_gbps = traffic_gbps(&device, &stream, &proxy)?;
    eprintln!("elementwise traffic kernel: {elementwise_gbps:.0} GB/s");
    let codec: Option<Arc<CudaCodec>> = if settings
        .compressions
        .iter()
        .any(|c| *c != Compression::None)
    {
        Some(Arc::new(
            CudaCodec::new(&device).context("loading the block decoder (nvrtc)")?,
        ))
    } else {
        None
    };
    // The lossless rows' weights: the loaded ones, with a coded-block
    // file beside them when one is asked for.
    let coded_source: Arc<dyn WeightSource> = match (&args.coded_blocks, &codec) {
        (Some(path), Some(_)) => {
            if !path.exists() {
                let t = Instant::now();
                let r = offload_pack::blocks_file::pack_blocks(
                    path,
                    &pipeline,
                    &*loaded,
                    &offload_pack::format::EncodeConfig::default(),
                )
                .with_context(|| format!("writing the coded-block file {}", path.display()))?;
                eprintln!(
                    "coded-block file {}: {} blocks, {:.2} of {:.2} GB ({:.4}) written in {:.1} s",
                    path.display(),
                    r.blocks,
                    r.coded_bytes as f64 / 1e9,
                    r.decoded_bytes as f64 / 1e9,
                    r.coded_bytes as f64 / r.decoded_bytes.max(1) as f64,
                    t.elapsed().as_secs_f64()
                );
            }
            let t = Instant::now();
            let blocks = offload_pack::blocks_file::CodedBlocks::open(path)
                .with_context(|| format!("opening the coded-block file {}", path.display()))?;
            eprintln!(
                "coded-block file opened and every block checked in {:.2} s ({:.2} GB)",
                t.elapsed().as_secs_f64(),
                blocks.coded_bytes() as f64 / 1e9
            );
            Arc::new(offload_pack::blocks_file::WithCodedBlocks {
                inner: Arc::clone(&loaded) as Arc<dyn WeightSource>,
                blocks,
            })
        }
        (Some(_), None) => {
            bail!("--coded-blocks: with --weight-compression lossless or auto only")
        }
        _ => Arc::clone(&loaded) as Arc<dyn WeightSource>,
    };
    let platform = |depth,
                    plant: bool,
                    weights: Arc<dyn WeightSource>,
                    planner: Option<budget::PlannerInputs>| {
        let p =
            CorePlatform::<Cuda>::new("cuda", Arc::clone(&device), Arc::clone(&stream), weights)
                .with_prefetch_depth(depth);
        let p = match planner {
            Some(inputs) => p.with_planner(inputs),
            None => p,
        };
        let p = match &codec {
            Some(c) => p.with_codec(Arc::clone(c) as _),
            None => p,
        };
        #[cfg(feature = "planted-bugs")]
        let p = if plant { p.with_planted_bugs(&bugs) } else { p };
        #[cfg(not(feature = "planted-bugs"))]
        let _ = plant;
        p
    };
    let suffix = plant_name
        .as_ref()
        .map_or(String::new(), |n| format!(" (planted {n})"));
    // A layerwise backend of `config` at `depth`, over `weights` where
    // given (a `file` row's), else the loaded weights (coded ones where the
    // row compresses).
    let layerwise_over = |config: OffloadConfig,
                          depth: usize,
                          planner: Option<budget::PlannerInputs>,
                          weights: Option<Arc<dyn WeightSource>>|
     -> Box<MakeBackend<'_>> {
        let weights = match weights {
            Some(w) => w,
            None if config.compression() == WeightCompression::None => {
                Arc::clone(&loaded) as Arc<dyn WeightSource>
            }
            None => Arc::clone(&coded_source),
        };
        Box::new(move || {
            Ok(Box::new(
                platform(depth, true, Arc::clone(&weights), planner.clone())
                    .layerwise(config.clone())?,
            ) as Box<dyn Backend<Cuda>>)
        })
    };
    let layerwise_at = |config, depth, planner| layerwise_over(config, depth, planner, None);
    let mut rows: Vec<Row> = Vec::new();
    let mut traces: BTreeMap<String, offload_sim::trace::Trace> = BTreeMap::new();
    // Each token count's planner inputs (traced compute, the link), filled
    // once the resident rows are in: what staged rows forecast from.
    let forecast_inputs: std::cell::RefCell<BTreeMap<u64, budget::PlannerInputs>> =
        std::cell::RefCell::new(BTreeMap::new());
    let mut run = |spec: &Spec<'_>, rows: &mut Vec<Row>| -> Result<()> {
        // A `--copy-beside` row's copier is allocated before what is in
        // use is read below, so no peak of the row counts its buffers.
        let mut copier = if spec.beside {
            Some(beside::Beside::new(&device)?)
        } else {
            None
        };
        device.synchronize_stream(&stream)?;
        device.trim_pool()?;
        device.reset_pool_high()?;
        let (used_before, _) = device.pool_used()?;
        let free_before = device.memory_info()?.free_bytes;
        let mut rt = Runtime::new(Arc::clone(&device), Arc::clone(&stream), pipeline.clone());
        let locked_before = offload_cuda::host_locked();
        offload_cuda::reset_host_locked_peak();
        let mut sampler = None;
        if spec.file
            && let Some((f, _)) = &file_masters
        {
            f.drop_cache()?;
            sampler = Some(staged::RssSampler::start());
        }
        let t = Instant::now();
        rt.enable((spec.make)()?).map_err(|(e, _)| e)?;
        device.synchronize_stream(&stream)?;
        let enable_s = t.elapsed().as_secs_f64();
        // Counted from after the enable: the staged blocks' reads, not the
        // pinned ones' copies at the enable.
        let reads_before = file_masters.as_ref().map(|(f, _)| f.reads());
        let host_weight_bytes = rt.backend().map_or(0, |b| b.host_weight_bytes());
        let staged_bytes = rt.backend().map_or(0, |b| b.host_masters().staged_bytes);
        let coded = codec
            .as_ref()
            .filter(|_| spec.compression != Compression::None);
        let first_row = rows.len();
        if let Some(c) = &mut copier {
            c.start()?;
        }
        // The peaks over the spec's rows so far: the link probe's buffers
        // (below) are let go of, and the high-water marks reset, after
        // each probe, so a later row's peak is this and what it saw since.
        let (mut spec_pool_peak, mut spec_locked_peak) = (0u64, 0u64);
        for &tokens in &spec.tokens {
            let mut peak_info = free_before.saturating_sub(device.memory_info()?.free_bytes);
            let mut times = Vec::new();
            let proxy = spec.proxy;
            proxy.reset(&stream)?;
            let mut stats_before = None;
            for i in 0..settings.warmup + settings.steps {
                if i == settings.warmup {
                    stats_before = coded.map(|c| c.stats());
                }
                device.synchronize_stream(&stream)?;
                let t = Instant::now();
                step(&rt, proxy, tokens)?;
                device.synchronize_stream(&stream)?;
                if i >= settings.warmup {
                    times.push(t.elapsed().as_secs_f64());
                }
                peak_info =
                    peak_info.max(free_before.saturating_sub(device.memory_info()?.free_bytes));
            }
            // A file row's block bytes read since its enable: the shares
            // read with `pread` and released after their read.
            let file_shares = || {
                spec.file
                    .then(|| {
                        let ((d0, m0, r0), (d1, m1, r1)) =
                            (reads_before?, file_masters.as_ref()?.0.reads());
                        let (direct, read) = (d1 - d0, (d1 - d0) + (m1 - m0));
                        (read > 0)
                            .then(|| (direct as f64 / read as f64, (r1 - r0) as f64 / read as f64))
                    })
                    .flatten()
            };
            // The engine's forecast of a staged step, from its own fill
            // rate, its staged copies at the staged stream the row's fills
            // ran beside (the heap's, or a file row's by its reader).
            let row_stream = match (&file_masters, file_shares()) {
                (Some((_, rates)), Some(shares)) => Some(file_reader_rates(rates, shares).1),
                _ if spec.file => None,
                _ => stream_gbps,
            };
            let inputs =
                forecast_inputs
                    .borrow()
                    .get(&tokens)
                    .cloned()
                    .map(|i| budget::PlannerInputs {
                        staged_stream_bytes_per_s: row_stream.map(|g| g * 1e9),
                        ..i
                    });
            let (forecast, chooser) = match (rt.backend(), inputs, staged_bytes > 0) {
                (Some(b), Some(inputs), true) => (
                    b.staged_forecast(Some(&inputs))?,
                    b.staged_lookahead(Some(&inputs), MAX_PLANNED_DEPTH)?,
                ),
                _ => (Vec::new(), Vec::new()),
            };
            // The allocator's high-water mark, less what was in use before
            // enable (the proxy's scratch): device bytes held for weights.
            let peak = spec_pool_peak.max(device.pool_used()?.1.saturating_sub(used_before));
            spec_pool_peak = peak;
            let output = proxy.read_output()?;
            // Coded bytes as decoded, plus any block the codec refused
            // (streamed as bf16): every block crosses the link once a step.
            let link_bytes_per_step = match (coded, stats_before) {
                (Some(c), Some(b)) => {
                    let a = c.stats();
                    let streamed = spec.streamed * settings.steps;
                    let raw = streamed.saturating_sub(a.decoded_bytes - b.decoded_bytes);
                    Some((a.coded_bytes - b.coded_bytes + raw) / settings.steps)
                }
                _ => None,
            };
            let decode_error = match coded {
                Some(c) => Some(c.take_error()?),
                None => None,
            };
            // The row's own page-locked peak, read before the link probe
            // below pins its buffer.
            let locked_peak = spec_locked_peak.max(offload_cuda::host_locked().peak_bytes);
            spec_locked_peak = locked_peak;
            // The link as it is now, beside this row's steps: the limit of
            // a transfer-bound row moves with it. Not for `file` rows (their
            // resident file pages are sampled until the row is in). A probe
            // that fails leaves the row without this figure, said, not
            // without the row; its buffers go back before the next row.
            let row_link_gbps = if spec.depth > 0 && !spec.file {
                let measured = sampled_bandwidth(&device, &stream, 4, 1, || Ok(()));
                device.trim_pool()?;
                device.reset_pool_high()?;
                offload_cuda::reset_host_locked_peak();
                match measured {
                    Ok(g) => Some(g),
                    Err(e) => {
                        eprintln!(
                            "{} at {tokens} tokens: the link probe failed ({e:#}); no own-link figure for the row",
                            spec.name
                        );
                        None
                    }
                }
            } else {
                None
            };
            // One more step, traced (not timed: the events cost launches).
            {
                let _q = copier.as_ref().map(beside::Beside::quiet);
                device.timeline_start()?;
            }
            let traced = step_marked(&rt, proxy, tokens, Some(&device));
            let spans = {
                let _q = copier.as_ref().map(beside::Beside::quiet);
                device.timeline_stop()
            };
            traced?;
            let spans = spans?;
            let analysis = timeline::analyse(&spans);
            traces.insert(
                format!("{}-{tokens}", slug(&spec.name)),
                timeline::to_trace(&spans),
            );
            let file_shares = file_shares();
            rows.push(Row {
                run: spec.name.clone(),
                tokens,
                depth: spec.depth,
                repeat: spec.repeat,
                lookahead: spec.lookahead.get(&tokens).copied(),
                streamed_bytes: spec.streamed,
                step_times_s: times.clone(),
                step_s: median(&mut times).context("no timed steps")?,
                limit_s: 0.0,
                ratio: 0.0,
                limit_masters_s: 0.0,
                ratio_masters: 0.0,
                row_link_gbps,
                row_limit_s: None,
                ratio_row_link: None,
                beside_gbps: None,
                predicted_s: 0.0,
                simulated_s: None,
                simulated_ratio: None,
                peak_device_weight_bytes: peak,
                peak_cumemgetinfo_bytes: peak_info,
                host_weight_bytes,
                enable_s,
                output,
                output_equals_resident: false,
                timeline: analysis,
                weight_compression: format!("{:?}", spec.compression).to_lowercase(),
                link_bytes_per_step,
                link_over_bf16: None,
                host_over_bf16: 0.0,
                bf16_link_limit_s: 0.0,
                step_over_bf16_link: 0.0,
                decode_error,
                host_locked_peak_bytes: locked_peak
                    .saturating_sub(locked_before.pinned_bytes + locked_before.registered_bytes),
                staged_bytes,
                staged_limit_s: None,
                step_over_staged_limit: None,
                rss_file_peak_bytes: sampler.take().map(staged::RssSampler::finish),
                file_pread_share: file_shares.map(|(pread, _)| pread),
                file_released_share: file_shares.map(|(_, released)| released),
                file_read_gbps: None,
                file_limit_s: None,
                step_over_file_limit: None,
                file_stream_limit_s: None,
                step_over_file_stream_limit: None,
                forecast_s: (!forecast.is_empty())
                    .then(|| forecast.iter().map(|(_, f)| f.forward_s).sum()),
                forecast_fill_gbps: forecast.first().map(|(_, f)| f.fill_bytes_per_s / 1e9),
                forecast_bound: forecast.first().map(|(_, f)| f.bound().to_owned()),
                staged_chooser: chooser.first().map(|(_, l)| *l),
            });
            if let Some(c) = &mut copier {
                c.check()?;
            }
            let r = rows.last().context("pushed")?;
            eprintln!(
                "{} at {tokens} tokens: {:.4} s/step (traced: compute idle {:.1} ms, copy idle {:.1} ms), output {output:#018x}",
                spec.name,
                r.step_s,
                r.timeline.compute_idle_s * 1e3,
                r.timeline.copy_idle_s * 1e3
            );
        }
        if let Some(c) = copier {
            let gbps = c.finish()?;
            for r in &mut rows[first_row..] {
                r.beside_gbps = Some(gbps);
            }
        }
        rt.disable()?;
        Ok(())
    };
    // The resident rows, alone or (`--copy-beside`) beside an unrelated
    // copy stream.
    let resident_spec = |beside: bool| Spec {
        name: if beside {
            "resident beside copies"
        } else {
            "resident"
        }
        .to_owned(),
        repeat: 0,
        lookahead: BTreeMap::new(),
        proxy: &proxy,
        depth: 0,
        streamed: 0,
        tokens: settings.tokens.clone(),
        compression: Compression::None,
        make: Box::new(|| {
            Ok(
                platform(1, false, Arc::clone(&loaded) as Arc<dyn WeightSource>, None)
                    .resident()?,
            )
        }),
        file: false,
        beside,
    };
    // Resident first: its traced steps give the planner each block's compute.
    run(&resident_spec(false), &mut rows)?;
    let resident: BTreeMap<u64, (f64, u64, Analysis)> = rows
        .iter()
        .map(|r| (r.tokens, (r.step_s, r.output, r.timeline.clone())))
        .collect();
    let rings: BTreeMap<u64, Ring> = resident
        .iter()
        .map(|(t, (step_s, _, a))| (*t, Ring::new(a, *step_s, master_gbps, &block_units)))
        .collect();
    forecast_inputs.borrow_mut().extend(
        rings
            .iter()
            .map(|(&t, ring)| (t, ring.inputs(&block_units, master_gbps, settings.steps))),
    );
    let mut specs: Vec<Spec<'_>> = Vec::new();
    if args.copy_beside {
        specs.push(resident_spec(true));
    }
    // The look-ahead the chooser picks with every block streamed (one
    // slot beyond the shallowest depth the recurrence finds as short as
    // any up to MAX_PLANNED_DEPTH), per token count.
    let mut chosen: BTreeMap<u64, budget::Lookahead> = BTreeMap::new();
    for (&t, ring) in &rings {
        chosen.insert(t, ring.choose(largest)?);
    }
    for repeat in 0..args.repeats {
        for &compression in &settings.compressions {
            let (config, coded) = match compression {
                Compression::None => (layerwise.clone(), String::new()),
                Compression::Lossless | Compression::Auto => (
                    OffloadConfig {
                        weight_compression: Some(compression.config()),
                        ..layerwise.clone()
                    },
                    format!(" {}", format!("{compression:?}").to_lowercase()),
                ),
            };
            if compression == Compression::Auto {
                // "auto" decides at enable for one token count's compute:
                // an enable per count, at each `--depths` and at the
                // chooser's look-ahead.
                for (planner, d, t) in auto_rows(&settings.depths, &chosen, args.no_planner) {
                    let kind = if planner { "planner depth" } else { "depth" };
                    specs.push(Spec {
                        name: format!("layerwise {kind} {d}{coded}{suffix}"),
                        repeat,
                        lookahead: if planner {
                            BTreeMap::from([(t, chosen[&t])])
                        } else {
                            BTreeMap::new()
                        },
                        proxy: &proxy,
                        depth: d,
                        streamed: streamed_all,
                        tokens: vec![t],
                        compression,
                        make: layerwise_at(
                            config.clone(),
                            d,
                            Some(rings[&t].inputs(&block_units, master_gbps, settings.steps)),
                        ),
                        file: false,
                        beside: false,
                    });
                }
                continue;
            }
            for &d in &settings.depths {
                specs.push(Spec {
                    name: format!("layerwise depth {d}{coded}{suffix}"),
                    repeat,
                    lookahead: BTreeMap::new(),
                    proxy: &proxy,
                    depth: d,
                    streamed: streamed_all,
                    tokens: settings.tokens.clone(),
                    compression,
                    make: layerwise_at(config.clone(), d, None),
                    file: false,
                    beside: false,
                });
            }
            let mut by_depth: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
            for (&t, l) in chosen.iter().filter(|_| !args.no_planner) {
                by_depth.entry(l.depth).or_default().push(t);
            }
            for (d, tokens) in by_depth {
                specs.push(Spec {
                    name: format!("layerwise planner depth {d}{coded}{suffix}"),
                    repeat,
                    lookahead: chosen.clone(),
                    proxy: &proxy,
                    depth: d,
                    streamed: streamed_all,
                    tokens,
                    compression,
                    make: layerwise_at(config.clone(), d, None),
                    file: false,
                    beside: false,
                });
            }
        }
    }
    // The staged rows: over the loaded weights, and from the masters file.
    // A file row per `--file-reads` way (`None`: the loaded weights).
    type Source = (Option<staged::FileReads>, Option<Arc<dyn WeightSource>>);
    let mut sources: Vec<Source> = vec![(None, None)];
    if let Some((f, _)) = &file_masters {
        for &way in &args.file_reads {
            sources.push((Some(way), Some(Arc::clone(f) as Arc<dyn WeightSource>)));
        }
    }
    // With `--weight-compression lossless` the staged rows run coded too
    // (CONTRACT §7b with §7c: the blocks beyond the budget stage their
    // coded bytes, from the coded-block file when one is given), over the
    // loaded weights only.
    let staged_compressions: Vec<Compression> = std::iter::once(Compression::None)
        .chain(
            settings
                .compressions
                .iter()
                .copied()
                .filter(|c| *c == Compression::Lossless),
        )
        .collect();
    // The staging ring sizes the staged rows run at (`None`: the default).
    let staging_rings: Vec<Option<u64>> = if settings.staging_rings.is_empty() {
        vec![None]
    } else {
        settings.staging_rings.iter().copied().map(Some).collect()
    };
    // Each staged spec's backend and name at any depth, by its name: what a
    // `--staged-chooser` row runs again at the chooser's depth.
    type Remake<'a> = Box<dyn Fn(usize) -> Box<MakeBackend<'a>> + 'a>;
    type Named<'a> = Box<dyn Fn(usize) -> String + 'a>;
    let mut templates: BTreeMap<String, (Named<'_>, Remake<'_>, bool, Compression)> =
        BTreeMap::new();
    let over = &layerwise_over;
    for repeat in 0..args.repeats {
        for &ring in &staging_rings {
            for &h in &host_rows {
                for &d in &settings.depths {
                    for &compression in &staged_compressions {
                        let coded = compression != Compression::None;
                        let config = if coded {
                            OffloadConfig {
                                weight_compression: Some(compression.config()),
                                ..h.config(&layerwise)
                            }
                        } else {
                            h.config(&layerwise)
                        };
                        for (reads, weights) in
                            sources.iter().filter(|(f, _)| !coded || f.is_none())
                        {
                            let file = reads.is_some();
                            let masters = file_masters.as_ref().map(|(f, _)| Arc::clone(f));
                            let reads = *reads;
                            let config = if reads == Some(staged::FileReads::InPlace) {
                                OffloadConfig {
                                    staged_reads: Some(offload_core::config::StagedReads::InPlace),
                                    ..config.clone()
                                }
                            } else {
                                config.clone()
                            };
                            let (config, weights) = (config, weights.clone());
                            let remake: Remake<'_> = Box::new(move |depth: usize| {
                                let layerwise = over(config.clone(), depth, None, weights.clone());
                                let masters = masters.clone();
                                let inner: Box<MakeBackend<'_>> = Box::new(move || {
                                    if let (Some(f), Some(way)) = (&masters, reads) {
                                        f.set_reads(way);
                                    }
                                    layerwise()
                                });
                                match ring {
                                    None => inner,
                                    Some(bytes) => Box::new(move || {
                                        offload_core::budget::host::set_staging_ring_bytes(bytes);
                                        inner()
                                    }),
                                }
                            });
                            let suffix = suffix.clone();
                            let name = move |depth: usize| {
                                format!(
                                    "layerwise depth {depth}{}{} {}{}{suffix}",
                                    match reads {
                                        None => "",
                                        Some(staged::FileReads::Pread) => " file",
                                        Some(staged::FileReads::Mapped) => " file mapped",
                                        Some(staged::FileReads::InPlace) => " file in-place",
                                    },
                                    if coded { " lossless" } else { "" },
                                    h.name(),
                                    ring.map_or_else(String::new, |b| format!(
                                        " ring {}",
                                        offload_core::bytes::ByteSize::new(b)
                                    ))
                                )
                            };
                            specs.push(Spec {
                                name: name(d),
                                repeat,
                                lookahead: BTreeMap::new(),
                                proxy: &proxy,
                                depth: d,
                                streamed: streamed_all,
                                tokens: settings.tokens.clone(),
                                compression,
                                make: remake(d),
                                file,
                                beside: false,
                            });
                            templates.insert(name(d), (Box::new(name), remake, file, compression));
                        }
                    }
                }
            }
        }
    }
    for spec in &specs {
        run(spec, &mut rows)?;
    }
    if args.staged_chooser {
        // Each staged row whose chooser would run another depth, once more
        // at that depth, in the order the rows ran: once per (row, depth,
        // tokens, repeat), and not where `--depths` already ran it.
        let mut ran: std::collections::BTreeSet<(String, u32, u64)> = rows
            .iter()
            .map(|r| (r.run.clone(), r.repeat, r.tokens))
            .collect();
        let again: Vec<Spec<'_>> = rows
            .iter()
            .filter_map(|r| {
                let (name, remake, file, compression) = templates.get(&r.run)?;
                let l = r.staged_chooser?;
                let key = (name(l.depth), r.repeat, r.tokens);
                (l.depth != r.depth && ran.insert(key)).then(|| Spec {
                    name: format!("{} staged chooser", name(l.depth)),
                    repeat: r.repeat,
                    lookahead: BTreeMap::new(),
                    proxy: &proxy,
                    depth: l.depth,
                    streamed: streamed_all,
                    tokens: vec![r.tokens],
                    compression: *compression,
                    make: remake(l.depth),
                    file: *file,
                    beside: false,
                })
            })
            .collect();
        for spec in &again {
            run(spec, &mut rows)?;
        }
    }
    for r in &mut rows {
        let (resident_step, resident_output, _) = resident
            .get(&r.tokens)
            .context("a resident row per token count")?;
        let streamed = r.streamed_bytes as f64;
        r.limit_s = link_limit_s(*resident_step, streamed, bw);
        r.ratio = r.step_s / r.limit_s;
        r.limit_masters_s = link_limit_s(*resident_step, streamed, master_gbps);
        r.ratio_masters = r.step_s / r.limit_masters_s;
        (r.row_limit_s, r.ratio_row_link) =
            row_link_ratio(r.step_s, *resident_step, streamed, r.row_link_gbps);
        if r.depth > 0 {
            r.bf16_link_limit_s = streamed / (bw * 1e9);
            r.step_over_bf16_link = r.step_s / r.bf16_link_limit_s;
            r.host_over_bf16 = r.host_weight_bytes as f64 / streamed.max(1.0);
            r.link_over_bf16 = r.link_bytes_per_step.map(|b| b as f64 / streamed.max(1.0));
        }
        r.output_equals_resident = r.output == *resident_output;
        // The staged path's own limit: pinned blocks at the link's rate,
        // staged ones at the staged stream's (host copy and DMA sharing the
        // host's memory), one copy engine.
        // (A coded row's staged bytes are coded: its figure is the step
        // against the pinned bf16 limit.)
        if let (Some(g), true, "none") = (
            stream_gbps,
            r.staged_bytes > 0,
            r.weight_compression.as_str(),
        ) {
            let pinned = streamed - r.staged_bytes as f64;
            let limit = resident_step.max(pinned / (bw * 1e9) + r.staged_bytes as f64 / (g * 1e9));
            r.staged_limit_s = Some(limit);
            r.step_over_staged_limit = Some(r.step_s / limit);
        }
        // A file row's limits, at the rates of the reader it used (`pread`
        // where most of its block bytes were read so: blocks released
        // after their read): the file read alone, and the file's staged
        // stream (its read beside the DMA, sharing the host's memory).
        if let (Some((_, rates)), Some(share)) = (&file_masters, r.file_pread_share) {
            let (read, stream) =
                file_reader_rates(rates, (share, r.file_released_share.unwrap_or(0.0)));
            let pinned = streamed - r.staged_bytes as f64;
            let limit_at =
                |g: f64| resident_step.max(pinned / (bw * 1e9) + r.staged_bytes as f64 / (g * 1e9));
            r.file_read_gbps = Some(read);
            r.file_limit_s = Some(limit_at(read));
            r.step_over_file_limit = Some(r.step_s / limit_at(read));
            r.file_stream_limit_s = Some(limit_at(stream));
            r.step_over_file_stream_limit = Some(r.step_s / limit_at(stream));
        }
        r.predicted_s = if r.depth == 0 {
            *resident_step
        } else {
            rings[&r.tokens].predict(r.depth)
        };
        let config = (r.depth > 0).then_some(&layerwise);
        if !args.no_simulate {
            r.simulated_s = Some(simulate(config, r.depth, r.tokens, master_gbps)?);
        }
    }
    let sim_resident: BTreeMap<u64, f64> = rows
        .iter()
        .filter(|r| r.depth == 0)
        .filter_map(|r| Some((r.tokens, r.simulated_s?)))
        .collect();
    for r in &mut rows {
        let limit = sim_resident
            .get(&r.tokens)
            .map(|c| c.max(r.streamed_bytes as f64 / (master_gbps * 1e9)));
        r.simulated_ratio = r.simulated_s.zip(limit).map(|(s, l)| s / l);
    }
    println!(
        "\nFlux.1-dev DiT, {:.2} B parameters, {:.1} GB bf16; {}; pinned host→device {bw:.2} GB/s (fresh 1 GiB buffer), {master_gbps:.2} GB/s (host masters, back to back){suffix}",
        pipeline.tensors().map(|(_, t)| t.numel()).sum::<u64>() as f64 / 1e9,
        weight_bytes as f64 / 1e9,
        device.name()
    );
    println!(
        "registered in place, 2 GiB in 64 MiB copies: {pages_4k:.2} GB/s on 4 KiB pages, {pages_huge:.2} GB/s on huge pages (THP {thp}); elementwise traffic kernel {elementwise_gbps:.0} GB/s"
    );
    println!(
        "| run | tokens | s / step | limit s | step / limit | step / limit (masters' bandwidth) | recurrence predicted s | predicted / measured | simulator s | simulated / measured | simulated ratio | compute idle ms | copy idle ms | peak device weight GB (allocator) | cuMemGetInfo GB | host weight GB | enable s | output = resident |"
    );
    println!(
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for r in &rows {
        println!(
            "| {} | {} | {:.4} | {:.4} | {:.3} | {:.3} | {:.4} | {:.3} | {:.4} | {:.3} | {:.3} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
            r.run,
            r.tokens,
            r.step_s,
            r.limit_s,
            r.ratio,
            r.ratio_masters,
            r.predicted_s,
            r.predicted_s / r.step_s,
            r.simulated_s.unwrap_or(0.0),
            r.simulated_s.unwrap_or(0.0) / r.step_s,
            r.simulated_ratio.unwrap_or(0.0),
            r.timeline.compute_idle_s * 1e3,
            r.timeline.copy_idle_s * 1e3,
            r.peak_device_weight_bytes as f64 / 1e9,
            r.peak_cumemgetinfo_bytes as f64 / 1e9,
            r.host_weight_bytes as f64 / 1e9,
            r.enable_s,
            r.output_equals_resident
        );
    }
    println!(
        "INV-7 bound for layerwise: resident part {:.3} GB + (depth + 1) × largest block {:.3} GB = {:.2} GB (depth 1), {:.2} GB (depth 2)",
        resident_part as f64 / 1e9,
        largest as f64 / 1e9,
        (resident_part + 2 * largest) as f64 / 1e9,
        (resident_part + 3 * largest) as f64 / 1e9
    );
    println!(
        "\nTimeline (one traced step per row; mean block compute by container, mean copy by size)"
    );
    println!(
        "| run | tokens | compute busy ms | compute idle ms | of which waiting for a copy ms | copy busy ms | copy idle ms | copy GB/s | block compute ms | copy ms |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        let a = &r.timeline;
        let kinds: Vec<String> = a
            .block_compute_s
            .iter()
            .map(|(k, s)| format!("{k} {:.3}", s * 1e3))
            .collect();
        let copies: Vec<String> = a
            .copy_s_by_bytes
            .iter()
            .map(|(b, s)| format!("{:.0} MB {:.3}", *b as f64 / 1e6, s * 1e3))
            .collect();
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {} | {} |",
            r.run,
            r.tokens,
            a.compute_busy_s * 1e3,
            a.compute_idle_s * 1e3,
            a.compute_wait_copy_s * 1e3,
            a.copy_busy_s * 1e3,
            a.copy_idle_s * 1e3,
            a.copy_gbps,
            kinds.join(", "),
            copies.join(", ")
        );
    }
    let beside: Vec<&Row> = rows.iter().filter(|r| r.beside_gbps.is_some()).collect();
    if !beside.is_empty() {
        println!(
            "\nThe resident step beside an unrelated copy stream (no offload engine): what copies cost these kernels"
        );
        println!(
            "| tokens | resident step s | beside copies s | step ratio | compute busy ratio | compute idle ms | copies GB/s | output = resident |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
        for r in beside {
            let Some((alone, _, a)) = resident.get(&r.tokens) else {
                continue;
            };
            println!(
                "| {} | {:.4} | {:.4} | {:.4} | {:.4} | {:.1} | {:.2} | {} |",
                r.tokens,
                alone,
                r.step_s,
                r.step_s / alone,
                r.timeline.compute_busy_s / a.compute_busy_s.max(f64::MIN_POSITIVE),
                r.timeline.compute_idle_s * 1e3,
                r.beside_gbps.unwrap_or(0.0),
                r.output_equals_resident
            );
        }
    }
    if let Some(dir) = &args.trace_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (name, trace) in &traces {
            let path = dir.join(format!("timeline-{name}.json"));
            std::fs::write(&path, serde_json::to_vec(&trace.to_chrome_json())?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    let doc = serde_json::json!({
        "device": device.name(),
        "pinned_h2d_gbps": bw,
        "master_h2d_gbps": master_gbps,
        "registered_4k_pages_gbps": pages_4k,
        "elementwise_gbps": elementwise_gbps,
        "registered_huge_pages_gbps": pages_huge,
        "transparent_hugepage": thp,
        "weight_bytes": weight_bytes,
        "streamed_bytes": streamed_all,
        "staging_fill_gbps": host_gbps,
        "staged_stream_gbps": stream_gbps,
        "masters_file_gbps": file_masters.as_ref().map(|(_, r)| *r),
        "activation_bytes": activation_bytes,
        "planted": plant_name,
        "law": settings.law.name(),
        "attention": attention_kind().name(),
        "rows": rows,
        "resident_block_compute_s": resident.iter().map(|(t, (_, _, a))| (t.to_string(), a.per_block_s.clone())).collect::<BTreeMap<_, _>>(),
    });
    std::fs::write(&args.json, serde_json::to_vec_pretty(&doc)?)
        .with_context(|| format!("writing {}", args.json.display()))?;
    drop(specs);
    proxy.free()?;
    print_lookahead_summary(&rows);
    print_compression_summary(&rows);
    print_staged_summary(
        &rows,
        host_gbps,
        stream_gbps,
        file_masters.as_ref().map(|(_, r)| *r),
    );
    let differing = rows.iter().filter(|r| !r.output_equals_resident).count();
    match &plant_name {
        None if differing > 0 => {
            bail!("{differing} layerwise rows differ from resident: a correctness bug")
        }
        Some(name) if differing == 0 => {
            bail!("planted {name}: every output equals resident (the bug went unseen)")
        }
        Some(name) => {
            println!("planted {name}: {differing} layerwise rows differ from resident (caught)")
        }
        None => println!("every output equals resident"),
    }
    Ok(())
}

/// The chooser's rows, one line per token count (printed last): its
/// look-ahead and the device memory its slots take, the median step of
/// its `--repeats` and their spread in step / limit.
fn print_lookahead_summary(rows: &[Row]) {
    let mut by_tokens: BTreeMap<(&str, u64), Vec<&Row>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.lookahead.is_some()) {
        by_tokens
            .entry((r.weight_compression.as_str(), r.tokens))
            .or_default()
            .push(r);
    }
    if by_tokens.is_empty() {
        return;
    }
    println!(
        "\nDefault layerwise at the chooser's look-ahead (step: median over repeats; spread: max − min of step / limit)"
    );
    println!(
        "| tokens | compression | step s | limit s | step / limit | spread | repeats | look-ahead (depth) | slots | slot memory GB | peak device weight GB | output = resident |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for ((compression, t), rs) in by_tokens {
        let mut steps: Vec<f64> = rs.iter().map(|r| r.step_s).collect();
        let ratios: Vec<f64> = rs.iter().map(|r| r.ratio).collect();
        let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let l = rs[0].lookahead.expect("filtered");
        let limit = rs[0].limit_s;
        let step = median(&mut steps).unwrap_or(0.0);
        println!(
            "| {t} | {compression} | {step:.4} | {limit:.4} | {:.3} | {:.3} | {} | {} | {} | {:.2} | {:.2} | {} |",
            step / limit,
            hi - lo,
            rs.len(),
            l.depth,
            l.slots,
            l.slot_memory_bytes as f64 / 1e9,
            rs.iter()
                .map(|r| r.peak_device_weight_bytes)
                .max()
                .unwrap_or(0) as f64
                / 1e9,
            rs.iter().all(|r| r.output_equals_resident)
        );
    }
}

/// The staged rows (`--host-budgets`), printed last: staged bytes, the
/// pinned + registered bytes held, the step against the fully pinned
/// row's limit and against the staged path's own limit.
fn print_staged_summary(
    rows: &[Row],
    host_gbps: Option<f64>,
    stream_gbps: Option<f64>,
    file: Option<staged::FileRates>,
) {
    let Some(g) = host_gbps else { return };
    println!(
        "\nStaged masters (CONTRACT §7c), fills with {} copies; pageable → pinned host copy {g:.2} GB/s; staged stream (host copy + DMA, no compute) {:.2} GB/s{}",
        if PLAIN_FILL.load(Ordering::Relaxed) {
            "plain"
        } else {
            "streaming"
        },
        stream_gbps.unwrap_or(0.0),
        file.map_or(String::new(), |r| format!(
            "; masters file read {:.2} GB/s from the disk; from the page cache {:.2} GB/s through the mapping ({:.2} released after each block), {:.2} with pread; beside the DMA {:.2} through the mapping ({:.2} released), {:.2} with pread",
            r.cold, r.mapped, r.mapped_released, r.pread, r.mapped_stream, r.mapped_released_stream, r.pread_stream
        ))
    );
    println!(
        "| run | tokens | staged GB | pinned + registered GB (backend) | page-locked peak GB (device) | step s | pinned limit s | step / pinned limit | staged limit s | step / staged limit | forecast s (fill GB/s, bound) | step / forecast | staged chooser: depth (forecast s) | output == resident |"
    );
    println!(
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    // Coded rows too: their staged GB are coded bytes, their own limit
    // not computed (0).
    for r in rows
        .iter()
        .filter(|r| r.depth > 0 && (r.weight_compression == "none" || r.staged_bytes > 0))
    {
        let forecast = match (r.forecast_s, r.forecast_fill_gbps, &r.forecast_bound) {
            (Some(f), Some(g), Some(b)) => format!("{f:.4} ({g:.2}, {b})"),
            _ => "–".to_owned(),
        };
        let chooser = r.staged_chooser.map_or("–".to_owned(), |l| {
            format!("{} ({:.4})", l.depth, l.predicted_step_s)
        });
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.4} | {:.4} | {:.3} | {:.4} | {:.3} | {forecast} | {} | {chooser} | {} |",
            r.run,
            r.tokens,
            r.staged_bytes as f64 / 1e9,
            r.host_weight_bytes as f64 / 1e9,
            r.host_locked_peak_bytes as f64 / 1e9,
            r.step_s,
            r.limit_s,
            r.ratio,
            r.staged_limit_s.unwrap_or(0.0),
            r.step_over_staged_limit.unwrap_or(0.0),
            r.forecast_s
                .map_or("–".to_owned(), |f| format!("{:.3}", r.step_s / f)),
            r.output_equals_resident
        );
    }
    let files: Vec<&Row> = rows
        .iter()
        .filter(|r| r.rss_file_peak_bytes.is_some())
        .collect();
    if files.is_empty() {
        return;
    }
    println!(
        "\n| file run | tokens | read with pread | released | resident file pages peak GB | page-locked peak GB | step s | file read GB/s | file limit s | step / file limit | file stream limit s | step / file stream limit | output == resident |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in files {
        println!(
            "| {} | {} | {:.0} % | {:.0} % | {:.2} | {:.2} | {:.4} | {:.2} | {:.4} | {:.3} | {:.4} | {:.3} | {} |",
            r.run,
            r.tokens,
            r.file_pread_share.unwrap_or(0.0) * 100.0,
            r.file_released_share.unwrap_or(0.0) * 100.0,
            r.rss_file_peak_bytes.unwrap_or(0) as f64 / 1e9,
            r.host_locked_peak_bytes as f64 / 1e9,
            r.step_s,
            r.file_read_gbps.unwrap_or(0.0),
            r.file_limit_s.unwrap_or(0.0),
            r.step_over_file_limit.unwrap_or(0.0),
            r.file_stream_limit_s.unwrap_or(0.0),
            r.step_over_file_stream_limit.unwrap_or(0.0),
            r.output_equals_resident
        );
    }
}

/// The layerwise rows by `weight_compression` (printed last): bytes on
/// the link and in host memory against bf16, the step against the bf16
/// link limit and against `max(resident, bf16 link)`, bit identity.
fn print_compression_summary(rows: &[Row]) {
    if !rows.iter().any(|r| r.weight_compression == "lossless") {
        return;
    }
    println!("\nWeight compression (bf16 link limit = streamed bf16 bytes / pinned bandwidth)");
    println!(
        "| run | tokens | compression | link bytes / bf16 | host masters / bf16 | enable s | s / step | bf16 link limit s | step / bf16 link limit | step / limit | decode errors | output = resident |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in rows.iter().filter(|r| r.depth > 0) {
        println!(
            "| {} | {} | {} | {} | {:.4} | {:.2} | {:.4} | {:.4} | {:.3} | {:.3} | {} | {} |",
            r.run,
            r.tokens,
            r.weight_compression,
            r.link_over_bf16
                .map_or("1 (bf16)".to_owned(), |x| format!("{x:.4}")),
            r.host_over_bf16,
            r.enable_s,
            r.step_s,
            r.bf16_link_limit_s,
            r.step_over_bf16_link,
            r.ratio,
            r.decode_error.map_or("–".to_owned(), |e| e.to_string()),
            r.output_equals_resident
        );
    }
}

/// A file row's read rate alone and its staged stream beside the DMA,
/// GB/s, by the reader most of its block bytes went through (`shares`:
/// read with `pread`, released after their read).
fn file_reader_rates(rates: &staged::FileRates, (pread, released): (f64, f64)) -> (f64, f64) {
    if pread >= 0.5 {
        (rates.pread, rates.pread_stream)
    } else if released >= 0.5 {
        (rates.mapped_released, rates.mapped_released_stream)
    } else {
        (rates.mapped, rates.mapped_stream)
    }
}

/// A file-name-safe form of a run's name.
fn slug(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect::<String>()
        .split('-')
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

#[cfg(test)]
mod tests {
    use super::{Args, Settings, link_limit_s, median, name_seed, row_link_ratio};
    use clap::Parser;

    /// A transfer-bound row is judged against the link measured beside it
    /// (the link drifted 52.8-54.7 GB/s over one H100 sweep), a
    /// compute-bound one against the resident step whatever the link; an
    /// unmeasured or non-positive rate gives no figure, not a division by
    /// zero.
    #[test]
    fn a_row_is_judged_at_its_own_link() {
        let streamed = 23.67e9;
        // Transfer-bound: 0.4419 s at the process's 53.57 GB/s; the row's
        // own link ran at 54.65 GB/s, so its limit is 0.4331 s.
        let (limit, ratio) = row_link_ratio(0.4330, 0.0490, streamed, Some(54.65));
        let limit = limit.expect("a measured rate gives a limit");
        assert!((limit - streamed / 54.65e9).abs() < 1e-12, "{limit}");
        assert!((ratio.expect("and a ratio") - 0.4330 / limit).abs() < 1e-12);
        assert!(
            (link_limit_s(0.0490, streamed, 53.57) - streamed / 53.57e9).abs() < 1e-12,
            "the process's limit is its own"
        );
        // Compute-bound: the resident step binds at either rate.
        let (limit, ratio) = row_link_ratio(0.5617, 0.5514, streamed, Some(50.0));
        assert_eq!(limit, Some(0.5514));
        assert!((ratio.expect("a ratio") - 0.5617 / 0.5514).abs() < 1e-12);
        for none in [None, Some(0.0), Some(-1.0)] {
            assert_eq!(row_link_ratio(0.43, 0.05, streamed, none), (None, None));
        }
    }

    fn settings(flags: &[&str]) -> Result<Vec<u64>, String> {
        let args =
            Args::try_parse_from(std::iter::once("offload-bench").chain(flags.iter().copied()))
                .map_err(|e| e.to_string())?;
        Settings::from_args(&args)
            .map(|s| s.tokens)
            .map_err(|e| e.to_string())
    }

    /// Flags, and the token counts or the start of the error they give.
    type Row<'a> = (&'a [&'a str], Result<Vec<u64>, &'a str>);

    #[test]
    fn flags_are_checked_not_panicked_on() {
        let rows: &[Row<'_>] = &[
            (&[], Ok(vec![4608, 16896])),
            (
                &["--tokens", "1024, 4608,16896"],
                Ok(vec![1024, 4608, 16896]),
            ),
            (&["--tokens="], Err("--tokens: `` names no token count")),
            (
                &["--tokens", ","],
                Err("--tokens: `,` names no token count"),
            ),
            (
                &["--tokens", "0"],
                Err("--tokens: 0 is outside 1..=1048576"),
            ),
            (
                &["--tokens", "9999999"],
                Err("--tokens: 9999999 is outside"),
            ),
            (&["--tokens", "4k"], Err("--tokens: `4k` is not a number")),
            (&["--steps", "0"], Err("--steps: 0 is outside 1..=1000")),
            (
                &["--warmup", "101"],
                Err("--warmup: 101 is outside 0..=100"),
            ),
            (&["--warmup", "0"], Ok(vec![4608, 16896])),
            (&["--copy-beside"], Ok(vec![4608, 16896])),
            (
                &["--copy-beside", "--ranks", "2"],
                Err("--copy-beside times one GPU's resident step"),
            ),
            (
                &["--depths", "", "--no-planner"],
                Err("--depths names no depth and --no-planner"),
            ),
            (
                &["--depths", "", "--no-planner", "--copy-beside"],
                Ok(vec![4608, 16896]),
            ),
            (
                &["--staging-rings", "512MiB"],
                Err(
                    "--staging-rings sizes the staging ring of the staged rows: with --host-budgets only",
                ),
            ),
            (
                &["--host-budgets", "8GiB", "--staging-rings", "512MiB,0"],
                Err("--staging-rings: "),
            ),
            (
                &["--staged-chooser"],
                Err(
                    "--staged-chooser runs staged rows again at the staged chooser's depth: with --host-budgets only",
                ),
            ),
            (
                &["--staged-chooser", "--host-budgets", "8GiB"],
                Ok(vec![4608, 16896]),
            ),
            (
                &["--host-budgets", "8GiB", "--staging-rings", "512"],
                Err("--staging-rings: `512` is below 1 MiB"),
            ),
            (
                &[
                    "--host-budgets",
                    "8GiB",
                    "--staging-rings",
                    "512MiB,1400MiB",
                ],
                Ok(vec![4608, 16896]),
            ),
        ];
        for (flags, expect) in rows {
            match (settings(flags), expect) {
                (Ok(got), Ok(want)) => assert_eq!(&got, want, "{flags:?}"),
                (Err(got), Err(want)) => assert!(got.contains(want), "{flags:?}: {got}"),
                (got, want) => panic!("{flags:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    /// `--attention`: each name maps to its proxy kind (flash unless
    /// given), any other is clap's error naming the allowed values.
    #[test]
    fn the_attention_flag_maps_to_the_proxy_kind() {
        use offload_cuda::proxy::Attention;
        let parse = |flags: &[&str]| {
            Args::try_parse_from(std::iter::once("offload-bench").chain(flags.iter().copied()))
                .map(|a| a.attention)
                .map_err(|e| e.to_string())
        };
        assert_eq!(parse(&[]), Ok(Attention::Flash));
        for (kind, name) in Attention::ALL {
            assert_eq!(parse(&["--attention", name]), Ok(kind), "{name}");
        }
        let e = parse(&["--attention", "fused"]).unwrap_err();
        assert!(
            e.contains("fused") && e.contains("flash") && e.contains("materialized"),
            "{e}"
        );
    }

    /// `"auto"` runs at the chooser's look-ahead as the uncoded rows do:
    /// with `--depths ""` (the crossover sweep's flags) it ran no row at
    /// all, silently. One row per token count and depth; `--depths ""`
    /// with `--no-planner` is refused, since no layerwise row would run,
    /// unless `--copy-beside` asks for the resident rows alone
    /// (`flags_are_checked_not_panicked_on`).
    #[test]
    fn auto_rows_run_at_the_choosers_look_ahead_and_each_depth() {
        use super::auto_rows;
        use offload_core::budget::Lookahead;
        use std::collections::BTreeMap;
        let at = |depth| Lookahead {
            depth,
            slots: depth + 1,
            slot_bytes: 1,
            slot_memory_bytes: depth as u64 + 1,
            predicted_step_s: 1.0,
            limit_s: 1.0,
        };
        let chosen = BTreeMap::from([(4608, at(2)), (8192, at(13))]);
        assert_eq!(
            auto_rows(&[], &chosen, false),
            vec![(true, 2, 4608), (true, 13, 8192)]
        );
        assert_eq!(
            auto_rows(&[1], &chosen, false),
            vec![
                (false, 1, 4608),
                (false, 1, 8192),
                (true, 2, 4608),
                (true, 13, 8192)
            ]
        );
        assert_eq!(
            auto_rows(&[1, 2], &chosen, true),
            vec![
                (false, 1, 4608),
                (false, 1, 8192),
                (false, 2, 4608),
                (false, 2, 8192)
            ]
        );
        let e = Settings::from_args(
            &Args::try_parse_from(["offload-bench", "--depths", "", "--no-planner"]).unwrap(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("--no-planner") && e.contains("no layerwise row"),
            "{e}"
        );
        assert!(
            Settings::from_args(&Args::try_parse_from(["offload-bench", "--depths", ""]).unwrap())
                .is_ok()
        );
    }

    /// `--weight-compression` and `--law`: lists and names checked by
    /// clap (typed errors naming the allowed values), duplicates dropped.
    #[test]
    fn compression_and_law_flags_are_checked() {
        use super::{Compression, LawArg};
        let parse = |flags: &[&str]| {
            Args::try_parse_from(std::iter::once("offload-bench").chain(flags.iter().copied()))
                .map_err(|e| e.to_string())
                .and_then(|a| {
                    Settings::from_args(&a)
                        .map(|s| (s.compressions, a.law))
                        .map_err(|e| e.to_string())
                })
        };
        assert_eq!(
            parse(&[]).unwrap(),
            (vec![Compression::None], LawArg::Normal)
        );
        assert_eq!(
            parse(&[
                "--weight-compression",
                "none,lossless,none,auto",
                "--law",
                "student-t"
            ])
            .unwrap(),
            (
                vec![Compression::None, Compression::Lossless, Compression::Auto],
                LawArg::StudentT
            )
        );
        for (flags, want) in [
            (
                &["--weight-compression", "lossy"][..],
                "invalid value 'lossy' for '--weight-compression",
            ),
            (
                &["--weight-compression", "none,zstd"][..],
                "possible values: none, lossless, auto",
            ),
            (
                &["--law", "cauchy"][..],
                "possible values: normal, student-t, uniform",
            ),
        ] {
            let e = parse(flags).unwrap_err();
            assert!(e.contains(want), "{flags:?}: {e}");
        }
    }

    #[test]
    fn median_of_nothing_is_none() {
        assert_eq!(median(&mut []), None);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
    }

    #[test]
    fn blocks_of_one_shape_get_distinct_seeds() {
        let seeds: std::collections::BTreeSet<u64> = (0..38)
            .map(|i| name_seed(&format!("transformer.single_transformer_blocks.{i}")))
            .chain((0..19).map(|i| name_seed(&format!("transformer.transformer_blocks.{i}"))))
            .collect();
        assert_eq!(seeds.len(), 57);
    }
}
