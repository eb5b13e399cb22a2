//! The layerwise benchmark on one GPU, in one run: a Flux.1-dev-sized DiT
//! (exact block shapes, 11.9 B parameters, random bf16 weights) at batch 1,
//! its weights already in host memory as a loader leaves them. Measures the
//! pinned host→device bandwidth, the resident step, the layerwise step at
//! prefetch depth 1 and 2, the limit `max(resident, streamed bytes /
//! bandwidth)` and the ratio, peak device weight bytes (cuMemGetInfo), host
//! bytes held for weights, and the time `enable` took. Prints a table and
//! writes JSON. Never a timed test.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use offload_core::device::{Device, HostRegion, HostSource};
use offload_core::model::{DType, ModuleId, Pipeline, StorageId, TensorId};
use offload_core::runtime::{Backend, CorePlatform, Runtime, Scope, Unit, WeightSource, partition};
use offload_core::{OffloadConfig, resolve};
use offload_cuda::proxy::Proxy;
use offload_cuda::{Cuda, CudaDevice, CudaStream, driver_present};
use offload_sim::harness::blocks_of;
use offload_sim::presets::flux1_dev_dit;
use serde::Serialize;

#[derive(Parser)]
#[command(
    name = "offload-bench",
    about = "Layerwise offload of a Flux.1-dev-sized DiT against the PCIe limit"
)]
struct Args {
    /// Token counts (image + text) per forward.
    #[arg(long, value_delimiter = ',', default_values_t = [4608u64, 16896])]
    tokens: Vec<u64>,
    /// Timed steps per setting (the median is reported).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Warm-up steps per setting.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Write the results as JSON here.
    #[arg(long, default_value = "bench.json")]
    json: std::path::PathBuf,
}

/// A loader's buffers: each unit packed as the partition lays it out, in
/// host memory the weights already occupy. Regions are handed out shared,
/// so every backend of the run registers the same memory in place.
struct Loaded {
    units: BTreeMap<String, Arc<Vec<u8>>>,
    at: BTreeMap<StorageId, (String, u64)>,
}

struct Shared(Arc<Vec<u8>>);

impl HostRegion for Shared {
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
}

/// Random bf16 values, small and finite (never zeros), written by 16
/// threads straight into the loader's buffers.
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
        let chunks: Vec<Vec<&Unit>> = (0..16)
            .map(|t| units.iter().skip(t).step_by(16).copied().collect())
            .collect();
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                s.spawn(move || {
                    chunk
                        .into_iter()
                        .map(|u| {
                            let mut buf = vec![0u8; u.bytes as usize];
                            let mut z = u.bytes ^ 0x9e37_79b9_7f4a_7c15;
                            for pair in buf.chunks_exact_mut(8) {
                                z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
                                let mut x = z;
                                x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                                x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                                x ^= x >> 31;
                                // High byte of each bf16: a bounded exponent.
                                x = (x & 0x81ff_81ff_81ff_81ff) | 0x3c00_3c00_3c00_3c00;
                                pair.copy_from_slice(&x.to_le_bytes());
                            }
                            (u.name.clone(), buf)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("generator"))
            .collect()
    });
    Ok(Loaded {
        units: buffers.into_iter().map(|(n, b)| (n, Arc::new(b))).collect(),
        at,
    })
}

/// Pinned host→device bandwidth, GB/s: 1 GiB copies, median of five.
fn bandwidth(device: &CudaDevice, stream: &CudaStream) -> Result<f64> {
    let bytes = 1u64 << 30;
    let host = device.alloc_pinned(bytes)?;
    let dev = device.alloc_device(bytes)?;
    let mut times = Vec::new();
    for _ in 0..6 {
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
    times.remove(0);
    Ok(bytes as f64 / median(times) / 1e9)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One DiT forward: per block, a GEMM per 2-D bf16 weight with its real
/// shape at `tokens` rows, and the attention-sized batched GEMMs.
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
        gemms(dit, proxy, &own, tokens)?;
        for b in blocks {
            let rel = p.module(b).path["transformer.".len()..].to_owned();
            let tensors = p.subtree_tensors(b);
            dit.child(&rel, |blk| {
                gemms(blk, proxy, &tensors, tokens)?;
                proxy.attention(24, tokens, 128)?;
                Ok(())
            })?;
        }
        proxy.fold(dit.stream(), proxy.output.ptr(), 1 << 20)?;
        Ok(())
    })?;
    Ok(())
}

fn gemms(
    scope: &Scope<'_, Cuda>,
    proxy: &Proxy,
    tensors: &[TensorId],
    tokens: u64,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    for t in tensors {
        let v = scope.view_id(*t)?;
        let tensor = v.tensor();
        if tensor.dtype == DType::Bf16 && tensor.shape.len() == 2 {
            proxy.linear(
                v.buffer().ptr() + v.byte_range().start,
                tensor.shape[0],
                tensor.shape[1],
                tokens,
            )?;
        }
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
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !driver_present() {
        bail!("no CUDA driver found: the benchmark needs a GPU");
    }
    let device = Arc::new(CudaDevice::new(0)?);
    let stream = Arc::new(device.create_stream()?);
    let bw = bandwidth(&device, &stream)?;
    eprintln!("pinned host→device: {bw:.1} GB/s");
    let pipeline = flux1_dev_dit();
    let weight_bytes: u64 = pipeline.storages().map(|(_, s)| s.bytes).sum();
    let t = Instant::now();
    let loaded = Arc::new(load(&pipeline)?);
    eprintln!(
        "weights in host memory: {:.1} GB in {:.1} s",
        weight_bytes as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    let max_t = *args.tokens.iter().max().context("--tokens")?;
    let proxy = Proxy::new(
        &device,
        &stream,
        max_t * 15360 * 2,
        24 * (max_t * max_t + max_t * 128) * 2,
    )?;
    let platform = |depth| {
        CorePlatform::<Cuda>::new(
            "cuda",
            Arc::clone(&device),
            Arc::clone(&stream),
            Arc::clone(&loaded) as Arc<dyn WeightSource>,
        )
        .with_prefetch_depth(depth)
    };
    let layerwise = OffloadConfig {
        enable_layerwise_offload: true,
        ..OffloadConfig::default()
    };
    let plan = resolve(&pipeline, &layerwise)?;
    let streamed = plan.streamed_bytes();
    let (resident_part, largest) = (weight_bytes - streamed, plan.largest_block_bytes());
    let runs: Vec<(&str, Box<MakeBackend<'_>>)> = vec![
        ("resident", Box::new(|| Ok(platform(1).resident()?))),
        (
            "layerwise depth 1",
            Box::new(|| {
                Ok(Box::new(platform(1).layerwise(layerwise.clone())?) as Box<dyn Backend<Cuda>>)
            }),
        ),
        (
            "layerwise depth 2",
            Box::new(|| {
                Ok(Box::new(platform(2).layerwise(layerwise.clone())?) as Box<dyn Backend<Cuda>>)
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
        for &tokens in &args.tokens {
            let mut peak_info = free_before.saturating_sub(device.memory_info()?.free_bytes);
            let mut times = Vec::new();
            proxy.reset(&stream)?;
            for i in 0..args.warmup + args.steps {
                device.synchronize_stream(&stream)?;
                let t = Instant::now();
                step(&rt, &proxy, tokens)?;
                device.synchronize_stream(&stream)?;
                if i >= args.warmup {
                    times.push(t.elapsed().as_secs_f64());
                }
                peak_info =
                    peak_info.max(free_before.saturating_sub(device.memory_info()?.free_bytes));
            }
            // The allocator's high-water mark, less what was in use before
            // enable (the proxy's scratch): device bytes held for weights.
            let peak = device.pool_used()?.1.saturating_sub(used_before);
            let output = proxy.read_sum(&device, &stream)?;
            rows.push(Row {
                run: (*name).to_owned(),
                tokens,
                step_s: median(times),
                limit_s: 0.0,
                ratio: 0.0,
                peak_device_weight_bytes: peak,
                peak_cumemgetinfo_bytes: peak_info,
                host_weight_bytes,
                enable_s,
                output,
            });
            eprintln!(
                "{name} at {tokens} tokens: {:.3} s/step",
                rows.last().map_or(0.0, |r| r.step_s)
            );
        }
        rt.disable()?;
    }
    let resident_step: BTreeMap<u64, f64> = rows
        .iter()
        .filter(|r| r.run == "resident")
        .map(|r| (r.tokens, r.step_s))
        .collect();
    let resident_out: BTreeMap<u64, u64> = rows
        .iter()
        .filter(|r| r.run == "resident")
        .map(|r| (r.tokens, r.output))
        .collect();
    for r in &mut rows {
        let transfer = if r.run == "resident" {
            0.0
        } else {
            streamed as f64 / (bw * 1e9)
        };
        r.limit_s = resident_step[&r.tokens].max(transfer);
        r.ratio = r.step_s / r.limit_s;
    }
    println!(
        "\nFlux.1-dev DiT, {:.2} B parameters, {:.1} GB bf16; {} ; pinned host→device {bw:.1} GB/s",
        pipeline.tensors().map(|(_, t)| t.numel()).sum::<u64>() as f64 / 1e9,
        weight_bytes as f64 / 1e9,
        device.name()
    );
    println!(
        "| run | tokens | s / step | limit s | step / limit | peak device weight GB (allocator) | cuMemGetInfo GB | host weight GB | enable s | output = resident |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        println!(
            "| {} | {} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
            r.run,
            r.tokens,
            r.step_s,
            r.limit_s,
            r.ratio,
            r.peak_device_weight_bytes as f64 / 1e9,
            r.peak_cumemgetinfo_bytes as f64 / 1e9,
            r.host_weight_bytes as f64 / 1e9,
            r.enable_s,
            resident_out[&r.tokens] == r.output
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
        "rows": rows,
    });
    std::fs::write(&args.json, serde_json::to_vec_pretty(&doc)?)?;
    proxy.free(&device)?;
    Ok(())
}
