//! The layerwise benchmark on one GPU, in one run: a Flux.1-dev-sized DiT
//! (exact block shapes, 11.9 B parameters, random bf16 weights distinct per
//! block) at batch 1, its weights already in host memory as a loader leaves
//! them. Measures the pinned host→device bandwidth, the resident step, the
//! layerwise step at prefetch depth 1 and 2, the limit `max(resident,
//! streamed bytes / bandwidth)` and the ratio, peak device weight bytes
//! (the allocator's high-water mark and cuMemGetInfo), host bytes held for
//! weights, the time `enable` took, and the output of the chained compute
//! proxy (a function of every weight byte read, in order), which must equal
//! the resident run's. Prints a table and writes JSON. Never a timed test.
//!
//! Built with the `planted-bugs` feature, `--plant NAME` plants a core bug
//! in the layerwise runs: their output then differs from resident.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use offload_core::device::{Device, HostRegion, HostSource};
use offload_core::model::{DType, ModuleId, Pipeline, StorageId, TensorId};
#[cfg(feature = "planted-bugs")]
use offload_core::runtime::PlantedBug;
use offload_core::runtime::{Backend, CorePlatform, Runtime, Scope, Unit, WeightSource, partition};
use offload_core::{OffloadConfig, resolve};
use offload_cuda::proxy::Proxy;
use offload_cuda::{Cuda, CudaDevice, CudaStream, driver_present};
use offload_sim::harness::blocks_of;
use offload_sim::presets::flux1_dev_dit;
use serde::Serialize;

mod dist;

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

#[derive(Parser)]
#[command(
    name = "offload-bench",
    about = "Layerwise offload of a Flux.1-dev-sized DiT against the PCIe limit"
)]
struct Args {
    /// Token counts (image + text) per forward, comma-separated, each in
    /// 1..=1048576 and small enough that the scratch fits on the GPU.
    #[arg(long, default_value = "4608,16896")]
    tokens: String,
    /// Timed steps per setting, 1..=1000 (the median is reported).
    #[arg(long, default_value_t = 5)]
    steps: u64,
    /// Warm-up steps per setting, 0..=100.
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// Write the results as JSON here.
    #[arg(long, default_value = "bench.json")]
    json: std::path::PathBuf,
    /// Plant this core bug in the layerwise runs (e.g. `wrong-master`).
    #[cfg(feature = "planted-bugs")]
    #[arg(long)]
    plant: Option<String>,
    /// Distributed layerwise on G GPUs, one process per GPU (2..=8; run
    /// under `offload-launch -n G` or torchrun, or alone: it then runs
    /// itself under `offload-launch` found beside it). 1: the single-GPU
    /// layerwise benchmark.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    ranks: u32,
}

/// The flags, checked.
struct Settings {
    tokens: Vec<u64>,
    steps: u64,
    warmup: u64,
}

impl Settings {
    fn from_args(args: &Args) -> Result<Self> {
        let allowed = format!("give token counts such as 4608,16896, each in 1..={MAX_TOKENS}");
        let tokens = args
            .tokens
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
            "--tokens: `{}` names no token count ({allowed})",
            args.tokens
        );
        ensure!(
            (1..=MAX_STEPS).contains(&args.steps),
            "--steps: {} is outside 1..={MAX_STEPS} (the median of the timed steps is reported)",
            args.steps
        );
        ensure!(
            args.warmup <= MAX_WARMUP,
            "--warmup: {} is outside 0..={MAX_WARMUP}",
            args.warmup
        );
        Ok(Self {
            tokens,
            steps: args.steps,
            warmup: args.warmup,
        })
    }
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
struct Loaded {
    units: BTreeMap<String, Arc<Vec<u8>>>,
    at: BTreeMap<StorageId, (String, u64)>,
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
        dst.copy_from_slice(&self.units[unit][start..start + dst.len()]);
    }

    fn take_region(&self, unit: &Unit) -> Option<Box<dyn HostRegion>> {
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

/// Random weights written by 16 threads straight into the loader's buffers.
fn load(pipeline: &Pipeline) -> Result<Loaded> {
    let config = OffloadConfig {
        enable_layerwise_offload: true,
        ..OffloadConfig::default()
    };
    let plan = resolve(pipeline, &config)?;
    let groups: Vec<ModuleId> = plan.components.iter().map(|c| c.module).collect();
    let part = partition(pipeline, &plan.stacks, &groups);
    let units: Vec<&Unit> = part.all().collect();
    let mut at = BTreeMap::new();
    for u in &units {
        for e in &u.entries {
            at.insert(e.storage, (u.name.clone(), e.offset));
        }
    }
    let buffers: Vec<(String, Vec<u8>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..16)
            .map(|t| {
                let chunk: Vec<&Unit> = units.iter().skip(t).step_by(16).copied().collect();
                s.spawn(move || {
                    chunk
                        .into_iter()
                        .map(|u| (u.name.clone(), generate(u)))
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
        at,
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
    let qkv = tokens.saturating_mul(HEAD_DIM);
    let scores = tokens.saturating_mul(tokens);
    let input = tokens
        .saturating_mul(widest_in)
        .max(HEADS.saturating_mul(qkv))
        .saturating_mul(2);
    let output = tokens
        .saturating_mul(widest_out)
        .max(HEADS.saturating_mul(scores.saturating_add(qkv)))
        .saturating_mul(2);
    (input, output)
}

/// One DiT forward: per block, every weight view folded, a GEMM per 2-D
/// bf16 weight with its real shape at `tokens` rows, the attention-sized
/// batched GEMMs, then the chain step.
fn step(rt: &Runtime<Cuda>, proxy: &Proxy, tokens: u64) -> Result<()> {
    rt.forward("transformer", |dit| {
        let p = dit.pipeline();
        let module = dit.module();
        let blocks = blocks_of(p, module);
        let inner: BTreeSet<TensorId> = blocks.iter().flat_map(|b| p.subtree_tensors(*b)).collect();
        let own: Vec<TensorId> = p
            .subtree_tensors(module)
            .into_iter()
            .filter(|t| !inner.contains(t))
            .collect();
        kernels(dit, proxy, &own, tokens)?;
        proxy.chain(dit.stream())?;
        for b in blocks {
            let rel = p.module(b).path["transformer.".len()..].to_owned();
            let tensors = p.subtree_tensors(b);
            dit.child(&rel, |blk| {
                kernels(blk, proxy, &tensors, tokens)?;
                proxy.attention(HEADS, tokens, HEAD_DIM)?;
                proxy.chain(blk.stream())?;
                Ok(())
            })?;
        }
        Ok(())
    })?;
    Ok(())
}

fn kernels(
    scope: &Scope<'_, Cuda>,
    proxy: &Proxy,
    tensors: &[TensorId],
    tokens: u64,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    for t in tensors {
        let v = scope.view_id(*t)?;
        let ptr = v.buffer().ptr() + v.byte_range().start;
        let tensor = v.tensor();
        if tensor.dtype == DType::Bf16 && tensor.shape.len() == 2 {
            proxy.linear(ptr, tensor.shape[0], tensor.shape[1], tokens)?;
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

#[derive(Serialize, Clone)]
struct Row {
    run: String,
    tokens: u64,
    step_s: f64,
    limit_s: f64,
    ratio: f64,
    peak_device_weight_bytes: u64,
    peak_cumemgetinfo_bytes: u64,
    host_weight_bytes: u64,
    enable_s: f64,
    output: u64,
    output_equals_resident: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let settings = Settings::from_args(&args)?;
    #[cfg(feature = "planted-bugs")]
    let bugs = planted(&args)?;
    #[cfg(not(feature = "planted-bugs"))]
    let bugs: Vec<offload_core::runtime::PlantedBug> = Vec::new();
    let plant_name: Option<String> = bugs.first().map(|b| b.name());
    if args.ranks > 1 {
        return dist::main(&settings, args.ranks, &args.json, &bugs);
    }
    if !driver_present() {
        bail!("no CUDA driver found: the benchmark needs a GPU");
    }
    let device = Arc::new(CudaDevice::new(0)?);
    let stream = Arc::new(device.create_stream()?);
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
    eprintln!("pinned host→device: {bw:.1} GB/s");
    let t = Instant::now();
    let loaded = Arc::new(load(&pipeline)?);
    eprintln!(
        "weights in host memory: {:.1} GB in {:.1} s",
        weight_bytes as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    let (input_bytes, output_bytes) = scratch_bytes(&pipeline, max_t);
    let proxy = Proxy::new(&device, Arc::clone(&stream), input_bytes, output_bytes)?;
    let platform = |depth, plant: bool| {
        let p = CorePlatform::<Cuda>::new(
            "cuda",
            Arc::clone(&device),
            Arc::clone(&stream),
            Arc::clone(&loaded) as Arc<dyn WeightSource>,
        )
        .with_prefetch_depth(depth);
        #[cfg(feature = "planted-bugs")]
        let p = if plant { p.with_planted_bugs(&bugs) } else { p };
        #[cfg(not(feature = "planted-bugs"))]
        let _ = plant;
        p
    };
    let layerwise = OffloadConfig {
        enable_layerwise_offload: true,
        ..OffloadConfig::default()
    };
    let plan = resolve(&pipeline, &layerwise)?;
    let streamed = plan.streamed_bytes();
    let (resident_part, largest) = (weight_bytes - streamed, plan.largest_block_bytes());
    let suffix = plant_name
        .as_ref()
        .map_or(String::new(), |n| format!(" (planted {n})"));
    let runs: Vec<(String, Box<MakeBackend<'_>>)> = vec![
        (
            "resident".to_owned(),
            Box::new(|| Ok(platform(1, false).resident()?)),
        ),
        (
            format!("layerwise depth 1{suffix}"),
            Box::new(|| {
                Ok(Box::new(platform(1, true).layerwise(layerwise.clone())?)
                    as Box<dyn Backend<Cuda>>)
            }),
        ),
        (
            format!("layerwise depth 2{suffix}"),
            Box::new(|| {
                Ok(Box::new(platform(2, true).layerwise(layerwise.clone())?)
                    as Box<dyn Backend<Cuda>>)
            }),
        ),
    ];
    let mut rows: Vec<Row> = Vec::new();
    for (name, make) in &runs {
        device.synchronize_stream(&stream)?;
        device.trim_pool()?;
        device.reset_pool_high()?;
        let (used_before, _) = device.pool_used()?;
        let free_before = device.memory_info()?.free_bytes;
        let mut rt = Runtime::new(Arc::clone(&device), Arc::clone(&stream), pipeline.clone());
        let t = Instant::now();
        rt.enable(make()?).map_err(|(e, _)| e)?;
        device.synchronize_stream(&stream)?;
        let enable_s = t.elapsed().as_secs_f64();
        let host_weight_bytes = rt.backend().map_or(0, |b| b.host_weight_bytes());
        for &tokens in &settings.tokens {
            let mut peak_info = free_before.saturating_sub(device.memory_info()?.free_bytes);
            let mut times = Vec::new();
            proxy.reset(&stream)?;
            for i in 0..settings.warmup + settings.steps {
                device.synchronize_stream(&stream)?;
                let t = Instant::now();
                step(&rt, &proxy, tokens)?;
                device.synchronize_stream(&stream)?;
                if i >= settings.warmup {
                    times.push(t.elapsed().as_secs_f64());
                }
                peak_info =
                    peak_info.max(free_before.saturating_sub(device.memory_info()?.free_bytes));
            }
            // The allocator's high-water mark, less what was in use before
            // enable (the proxy's scratch): device bytes held for weights.
            let peak = device.pool_used()?.1.saturating_sub(used_before);
            let output = proxy.read_output()?;
            rows.push(Row {
                run: name.clone(),
                tokens,
                step_s: median(&mut times).context("no timed steps")?,
                limit_s: 0.0,
                ratio: 0.0,
                peak_device_weight_bytes: peak,
                peak_cumemgetinfo_bytes: peak_info,
                host_weight_bytes,
                enable_s,
                output,
                output_equals_resident: false,
            });
            eprintln!(
                "{name} at {tokens} tokens: {:.3} s/step, output {output:#018x}",
                rows.last().map_or(0.0, |r| r.step_s)
            );
        }
        rt.disable()?;
    }
    let resident: BTreeMap<u64, (f64, u64)> = rows
        .iter()
        .filter(|r| r.run == "resident")
        .map(|r| (r.tokens, (r.step_s, r.output)))
        .collect();
    for r in &mut rows {
        let (resident_step, resident_output) = resident
            .get(&r.tokens)
            .copied()
            .context("a resident row per token count")?;
        let transfer = if r.run == "resident" {
            0.0
        } else {
            streamed as f64 / (bw * 1e9)
        };
        r.limit_s = resident_step.max(transfer);
        r.ratio = r.step_s / r.limit_s;
        r.output_equals_resident = r.output == resident_output;
    }
    println!(
        "\nFlux.1-dev DiT, {:.2} B parameters, {:.1} GB bf16; {} ; pinned host→device {bw:.1} GB/s{suffix}",
        pipeline.tensors().map(|(_, t)| t.numel()).sum::<u64>() as f64 / 1e9,
        weight_bytes as f64 / 1e9,
        device.name()
    );
    println!(
        "| run | tokens | s / step | limit s | step / limit | peak device weight GB (allocator) | cuMemGetInfo GB | host weight GB | enable s | output | output = resident |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        println!(
            "| {} | {} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} | {:.2} | {:#018x} | {} |",
            r.run,
            r.tokens,
            r.step_s,
            r.limit_s,
            r.ratio,
            r.peak_device_weight_bytes as f64 / 1e9,
            r.peak_cumemgetinfo_bytes as f64 / 1e9,
            r.host_weight_bytes as f64 / 1e9,
            r.enable_s,
            r.output,
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
    let doc = serde_json::json!({
        "device": device.name(),
        "pinned_h2d_gbps": bw,
        "weight_bytes": weight_bytes,
        "streamed_bytes": streamed,
        "planted": plant_name,
        "rows": rows,
    });
    std::fs::write(&args.json, serde_json::to_vec_pretty(&doc)?)
        .with_context(|| format!("writing {}", args.json.display()))?;
    proxy.free()?;
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

#[cfg(test)]
mod tests {
    use super::{Args, Settings, median, name_seed};
    use clap::Parser;

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
        ];
        for (flags, expect) in rows {
            match (settings(flags), expect) {
                (Ok(got), Ok(want)) => assert_eq!(&got, want, "{flags:?}"),
                (Err(got), Err(want)) => assert!(got.contains(want), "{flags:?}: {got}"),
                (got, want) => panic!("{flags:?}: got {got:?}, want {want:?}"),
            }
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
