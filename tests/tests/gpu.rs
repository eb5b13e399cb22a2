//! The GPU suite: the strategies on a real GPU through `offload-cuda`.
//! Where no CUDA driver is found every test prints one skip line and passes.
//!
//! Kernels are real: cuBLAS bf16 GEMMs over each block's own 2-D weights
//! with their shapes, attention-sized batched GEMMs, and a checksum kernel
//! reading every byte the forward was lent. Weights are random, never zero.
//! For every strategy the output equals the resident run's bit for bit, and
//! device memory measured with `cuMemGetInfo` stays within INV-7's bound.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use offload_core::device::Device;
use offload_core::model::{DType, ModuleId, Pipeline, PipelineBuilder, StorageId, TensorId};
use offload_core::runtime::{Backend, CorePlatform, ForwardCtx, Runtime, Scope, WeightSource};
use offload_core::{ComponentDeclaration, OffloadConfig, OffloadError};
use offload_cuda::proxy::Proxy;
use offload_cuda::{Cuda, CudaDevice, CudaStream, driver_present};
use offload_hooks::{BoxError, HookOwner, ModelHook, PreForward};
use offload_sim::harness::blocks_of;
use offload_sim::presets::SyntheticWeights;

const TOKENS: u64 = 256;

fn gpu() -> Option<Arc<CudaDevice>> {
    if !driver_present() {
        println!("skipping GPU test: no CUDA driver found");
        return None;
    }
    Some(Arc::new(CudaDevice::new(0).expect("device 0")))
}

/// Random weights whose bf16/f32 values are small and finite (every odd
/// byte, the high byte of a little-endian bf16, gets a bounded exponent).
struct FiniteWeights(SyntheticWeights);

impl WeightSource for FiniteWeights {
    fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        self.0.read(storage, position, dst);
        for (i, b) in dst.iter_mut().enumerate() {
            if (position + i as u64) % 2 == 1 {
                *b = (*b & 0x81) | 0x3c;
            }
        }
    }
}

/// A DiT of heterogeneous blocks (double then single, as Flux), an encoder
/// stack and a VAE; blocks of a few MiB each.
fn pipeline() -> Pipeline {
    let d = 512u64;
    let mut b = PipelineBuilder::new("GpuPipeline");
    {
        let mut t = b.module("transformer");
        t.parameter("x_embedder.weight", DType::Bf16, &[d, 64]);
        t.buffer("rope.freqs", DType::F32, &[TOKENS, 32], false);
        t.list("transformer_blocks", 5, |_, blk| {
            blk.parameter("attn.to_qkv.weight", DType::Bf16, &[3 * d, d])
                .parameter("attn.to_out.weight", DType::Bf16, &[d, d])
                .parameter("ff.up.weight", DType::Bf16, &[4 * d, d])
                .parameter("ff.down.weight", DType::Bf16, &[d, 4 * d])
                .parameter("norm.weight", DType::F32, &[d]);
        });
        t.list("single_transformer_blocks", 6, |i, blk| {
            blk.parameter("proj_mlp.weight", DType::Bf16, &[2 * d + 64 * i as u64, d])
                .parameter("norm.weight", DType::F32, &[d]);
        });
        t.parameter("proj_out.weight", DType::Bf16, &[64, d]);
        t.block_containers(&["transformer_blocks", "single_transformer_blocks"]);
    }
    {
        let mut e = b.module("text_encoder");
        e.parameter("embed.weight", DType::Bf16, &[1000, d]);
        e.list("layers", 3, |_, l| {
            l.parameter("fc.weight", DType::Bf16, &[d, d]);
        });
        e.block_containers(&["layers"]);
    }
    b.module("vae")
        .parameter("decoder.weight", DType::Bf16, &[d, d]);
    b.declare_components(ComponentDeclaration {
        dit: vec!["transformer".into()],
        encoder: vec!["text_encoder".into()],
        vae: vec!["vae".into()],
        resident: vec![],
    });
    b.build().expect("builds")
}

/// One kernel over the tensors: GEMMs for 2-D bf16 weights, the checksum
/// for every byte.
fn kernel(scope: &Scope<'_, Cuda>, proxy: &Proxy, tensors: &[TensorId]) -> Result<(), BoxError> {
    let stream: &CudaStream = scope.stream();
    for t in tensors {
        let v = scope.view_id(*t)?;
        let ptr = v.buffer().ptr() + v.byte_range().start;
        let tensor = v.tensor();
        if tensor.dtype == DType::Bf16 && tensor.shape.len() == 2 {
            proxy.linear(ptr, tensor.shape[0], tensor.shape[1], TOKENS)?;
            proxy.fold(stream, proxy.output.ptr(), TOKENS * tensor.shape[0] * 2)?;
        }
        proxy.fold(stream, ptr, v.byte_range().end - v.byte_range().start)?;
    }
    Ok(())
}

fn component(rt: &Runtime<Cuda>, proxy: &Proxy, path: &str) -> Result<(), OffloadError> {
    rt.forward(path, |scope| {
        let p = scope.pipeline();
        let module = scope.module();
        let blocks = blocks_of(p, module);
        let inner: BTreeSet<TensorId> = blocks.iter().flat_map(|b| p.subtree_tensors(*b)).collect();
        let own: Vec<TensorId> = p
            .subtree_tensors(module)
            .into_iter()
            .filter(|t| !inner.contains(t))
            .collect();
        kernel(scope, proxy, &own)?;
        for b in blocks {
            let rel = p.module(b).path[p.module(module).path.len() + 1..].to_owned();
            let tensors = p.subtree_tensors(b);
            scope.child(&rel, |blk| {
                kernel(blk, proxy, &tensors)?;
                proxy.attention(4, TOKENS, 64)?;
                Ok(())
            })?;
        }
        Ok(())
    })?;
    Ok(())
}

/// Skips the DiT blocks in the set (a block cache).
struct Cache(Arc<Mutex<BTreeSet<ModuleId>>>);

impl ModelHook<ForwardCtx> for Cache {
    fn pre_forward(&mut self, ctx: &mut ForwardCtx) -> Result<PreForward, BoxError> {
        let skip = self.0.lock().expect("not poisoned").contains(&ctx.module);
        Ok(if skip {
            PreForward::Skip
        } else {
            PreForward::Continue
        })
    }
}

/// Builds the backend under test from the platform.
type MakeBackend<'a> = dyn Fn(&CorePlatform<Cuda>) -> Box<dyn Backend<Cuda>> + 'a;

struct Run {
    outputs: Vec<u64>,
    /// cuMemGetInfo: device memory in use beyond what was before enable.
    peak_used_bytes: u64,
    /// The allocator's high-water mark beyond what was before enable.
    peak_allocated_bytes: u64,
    bound_bytes: u64,
}

/// Requests (encoder, `steps` DiT forwards with some blocks skipped in
/// the second request, VAE) with the backend `make` builds.
fn run(
    device: &Arc<CudaDevice>,
    depth: usize,
    make: &MakeBackend<'_>,
    bound: impl Fn(&Pipeline) -> u64,
) -> Run {
    let p = pipeline();
    let stream = Arc::new(device.create_stream().unwrap());
    let proxy = Proxy::new(
        device,
        &stream,
        TOKENS * 4096 * 2,
        TOKENS * (4096 + TOKENS * 4) * 2 * 4,
    )
    .unwrap();
    let weights = Arc::new(FiniteWeights(SyntheticWeights { seed: 42 }));
    let platform =
        CorePlatform::<Cuda>::new("cuda", Arc::clone(device), Arc::clone(&stream), weights)
            .with_prefetch_depth(depth);
    let mut rt = Runtime::new(Arc::clone(device), Arc::clone(&stream), p.clone());
    let skip = Arc::new(Mutex::new(BTreeSet::new()));
    let blocks = blocks_of(&p, p.module_id("transformer").unwrap());
    for b in &blocks {
        rt.model_mut()
            .hooks_of(*b)
            .register(
                "block_cache",
                HookOwner::new("cache"),
                Box::new(Cache(Arc::clone(&skip))),
            )
            .unwrap();
    }
    device.synchronize_stream(&stream).unwrap();
    // Memory an earlier run freed stays reserved in the pool: give it back
    // so cuMemGetInfo deltas measure this run.
    device.trim_pool().unwrap();
    device.reset_pool_high().unwrap();
    let (allocated_before, _) = device.pool_used().unwrap();
    let free_before = device.memory_info().unwrap().free_bytes;
    rt.enable(make(&platform)).map_err(|(e, _)| e).unwrap();
    let mut peak = 0u64;
    let mut sample = |rt: &Runtime<Cuda>| {
        device.synchronize_stream(rt.compute_stream()).unwrap();
        device.trim_pool().unwrap();
        peak = peak.max(free_before.saturating_sub(device.memory_info().unwrap().free_bytes));
    };
    let mut outputs = Vec::new();
    for request in 0..3 {
        proxy.reset(&stream).unwrap();
        *skip.lock().unwrap() = if request == 1 {
            [blocks[2], blocks[7]].into()
        } else {
            BTreeSet::new()
        };
        component(&rt, &proxy, "text_encoder").unwrap();
        sample(&rt);
        for _ in 0..2 {
            component(&rt, &proxy, "transformer").unwrap();
            sample(&rt);
        }
        component(&rt, &proxy, "vae").unwrap();
        outputs.push(proxy.read_sum(device, &stream).unwrap());
    }
    let allocated_peak = device.pool_used().unwrap().1;
    rt.disable().unwrap();
    device.synchronize_stream(&stream).unwrap();
    proxy.free(device).unwrap();
    Run {
        outputs,
        peak_used_bytes: peak,
        peak_allocated_bytes: allocated_peak - allocated_before,
        bound_bytes: bound(&p),
    }
}

/// Allocator granularity the bound allows per allocation (the pool maps
/// memory in 2 MiB pages).
const PAGE: u64 = 2 << 20;

fn total(p: &Pipeline) -> u64 {
    p.storages().map(|(_, s)| s.bytes).sum()
}

#[test]
fn device_basics() {
    let Some(d) = gpu() else { return };
    use offload_core::device::{DeviceError, DeviceErrorKind, HostBuffer, HostSource};
    let s = d.create_stream().unwrap();
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i * 13 + 1) as u8).collect();
    let mut host = d.alloc_pinned(1 << 20).unwrap();
    host.write_from(0, 1 << 20, &data);
    let dev = d.alloc_device(1 << 20).unwrap();
    let done = d.create_event().unwrap();
    // SAFETY: ranges in bounds; the stream is synchronised before reuse.
    unsafe { d.copy_h2d(&s, HostSource::Pinned(&host), 0, &dev, 0, 1 << 20) }.unwrap();
    let mut back = d.alloc_pinned(1 << 20).unwrap();
    // SAFETY: same stream, ordered after the upload.
    unsafe { d.copy_d2h(&s, &dev, 0, &mut back, 0, 1 << 20) }.unwrap();
    d.record_event(&done, &s).unwrap();
    d.synchronize_event(&done).unwrap();
    assert!(d.event_done(&done).unwrap());
    let mut out = vec![0u8; 1 << 20];
    back.read_into(0, &mut out);
    assert_eq!(out, data);
    // In-place registration, then a copy from it.
    let reg = d
        .register_host(Box::new(data.clone()))
        .map_err(|e| e.error)
        .unwrap();
    // SAFETY: as above.
    unsafe { d.copy_h2d(&s, HostSource::Registered(&reg), 0, &dev, 0, 1 << 20) }.unwrap();
    d.synchronize_stream(&s).unwrap();
    // SAFETY: the stream is drained.
    let region = unsafe { d.unregister_host(reg) }.unwrap();
    assert_eq!(region.bytes(), &data[..]);
    // Out of memory is a typed error. (Under compute-sanitizer the failed
    // allocation would be reported as an API error: the probe is skipped.)
    if std::env::var_os("OFFLOAD_UNDER_SANITIZER").is_none() {
        let info = d.memory_info().unwrap();
        let e = d.alloc_device(info.total_bytes * 2).unwrap_err();
        assert_eq!(e.kind(), DeviceErrorKind::OutOfMemory, "{e}");
    } else {
        println!("under compute-sanitizer: the out-of-memory probe is skipped");
    }
    // SAFETY: the stream is drained; nothing uses them.
    unsafe {
        d.free_device(dev, &[&done]).unwrap();
        d.free_pinned(host).unwrap();
        d.free_pinned(back).unwrap();
    }
}

#[test]
fn every_strategy_is_bit_identical_and_bounded() {
    let Some(d) = gpu() else { return };
    let resident = run(&d, 1, &|pl| pl.resident().unwrap(), |p| {
        total(p) + 32 * PAGE
    });
    assert!(
        resident.peak_allocated_bytes >= total(&pipeline()),
        "the allocator sees every resident weight"
    );
    assert!(
        resident.peak_used_bytes <= resident.bound_bytes,
        "{} > {}",
        resident.peak_used_bytes,
        resident.bound_bytes
    );
    assert!(resident.outputs.iter().all(|o| *o != 0));
    assert_ne!(
        resident.outputs[0], resident.outputs[1],
        "skipping blocks changes the output"
    );
    assert_eq!(
        resident.outputs[0], resident.outputs[2],
        "repeated requests agree"
    );
    let layerwise = OffloadConfig {
        enable_layerwise_offload: true,
        ..OffloadConfig::default()
    };
    let model_level = OffloadConfig {
        enable_cpu_offload: true,
        ..OffloadConfig::default()
    };
    for depth in [1usize, 2] {
        let config = layerwise.clone();
        let out = run(
            &d,
            depth,
            &|pl: &CorePlatform<Cuda>| Box::new(pl.layerwise(config.clone()).unwrap()),
            |p| {
                let plan = offload_core::resolve(p, &layerwise).unwrap();
                let allocations =
                    plan.stacks.iter().map(|s| s.blocks.len()).sum::<usize>() as u64 + 8;
                total(p) - plan.streamed_bytes()
                    + (depth as u64 + 1) * plan.largest_block_bytes()
                    + allocations * PAGE
            },
        );
        assert_eq!(out.outputs, resident.outputs, "layerwise depth {depth}");
        assert!(
            out.peak_allocated_bytes > 0,
            "the measurement sees the slots"
        );
        assert!(
            out.peak_allocated_bytes <= out.bound_bytes,
            "allocator: {} > {}",
            out.peak_allocated_bytes,
            out.bound_bytes
        );
        assert!(
            out.peak_used_bytes <= out.bound_bytes,
            "layerwise depth {depth}: {} > {}",
            out.peak_used_bytes,
            out.bound_bytes
        );
    }
    let out = run(
        &d,
        1,
        &|pl| {
            offload_core::get_offload_backend(&model_level, pl)
                .unwrap()
                .unwrap()
        },
        // The DiT and the encoder are never on the device together.
        |p| total(p) - p.subtree_bytes(p.module_id("text_encoder").unwrap()) + 32 * PAGE,
    );
    assert_eq!(out.outputs, resident.outputs, "model level");
    assert!(out.peak_used_bytes <= out.bound_bytes);
}

/// One request on the GPU: encoder, `steps` DiT forwards, VAE; the
/// checksum of every kernel.
fn gpu_request(rt: &Runtime<Cuda>, proxy: &Proxy, steps: usize) -> Result<u64, OffloadError> {
    let stream: &CudaStream = rt.compute_stream();
    proxy.reset(stream).unwrap();
    component(rt, proxy, "text_encoder")?;
    for _ in 0..steps {
        component(rt, proxy, "transformer")?;
    }
    component(rt, proxy, "vae")?;
    Ok(proxy.read_sum(rt.device(), stream).unwrap())
}

/// One DiT block's forward on its own.
fn gpu_block(rt: &Runtime<Cuda>, proxy: &Proxy, block: ModuleId) -> Result<u64, OffloadError> {
    let stream: &CudaStream = rt.compute_stream();
    proxy.reset(stream).unwrap();
    let p = &rt.model().pipeline;
    let rel = p.module(block).path["transformer.".len()..].to_owned();
    let tensors = p.subtree_tensors(block);
    rt.forward("transformer", |dit| {
        dit.child(&rel, |blk| kernel(blk, proxy, &tensors))?;
        Ok(())
    })?;
    Ok(proxy.read_sum(rt.device(), stream).unwrap())
}

/// The simulator's seeded scenarios on the GPU: generated pipelines of 1–80
/// blocks with mixed dtypes, tied weights and non-persistent buffers, the
/// generated configuration and operations (enable, requests with skipped
/// blocks, repeated requests, single blocks, disable), against a resident
/// twin on the same GPU. (Fault injection is the simulator's; none here.)
#[test]
fn seeded_scenarios_on_cuda() {
    let Some(d) = gpu() else { return };
    for seed in 0..12u64 {
        let (scenario, ops) = offload_tests::scenario::seeded(seed);
        let pipeline = offload_tests::scenario::build(&scenario.spec);
        let stream = Arc::new(d.create_stream().unwrap());
        let proxy = Proxy::new(
            &d,
            &stream,
            TOKENS * 4096 * 2,
            TOKENS * (4096 + TOKENS * 4) * 2 * 4,
        )
        .unwrap();
        let weights = Arc::new(FiniteWeights(SyntheticWeights {
            seed: scenario.seed,
        }));
        let platform =
            CorePlatform::<Cuda>::new("cuda", Arc::clone(&d), Arc::clone(&stream), weights)
                .with_prefetch_depth(scenario.depth);
        let skip = Arc::new(Mutex::new(BTreeSet::new()));
        let blocks = blocks_of(&pipeline, pipeline.module_id("transformer").unwrap());
        let runtime = || {
            let mut rt = Runtime::new(Arc::clone(&d), Arc::clone(&stream), pipeline.clone());
            for b in &blocks {
                rt.model_mut()
                    .hooks_of(*b)
                    .register(
                        "block_cache",
                        HookOwner::new("cache"),
                        Box::new(Cache(Arc::clone(&skip))),
                    )
                    .unwrap();
            }
            rt
        };
        let mut resident = runtime();
        resident
            .enable(platform.resident().unwrap())
            .map_err(|(e, _)| e)
            .unwrap();
        let mut offloaded = runtime();
        let mut enabled = false;
        for op in &ops {
            let context = format!("seed {seed}, {op:?}, scenario {scenario:?}");
            match op {
                offload_tests::scenario::Op::Enable if !enabled => {
                    let before = offloaded.model().hook_claims();
                    let backend = offload_core::get_offload_backend(&scenario.config, &platform)
                        .unwrap()
                        .unwrap();
                    match offloaded.enable(backend) {
                        Ok(()) => enabled = true,
                        // A configuration the pipeline cannot take (e.g. an
                        // encoder of one layer selected explicitly) fails
                        // before anything changes.
                        Err(_) => assert_eq!(offloaded.model().hook_claims(), before, "{context}"),
                    }
                }
                offload_tests::scenario::Op::Disable if enabled => {
                    offloaded.disable().unwrap();
                    enabled = false;
                }
                offload_tests::scenario::Op::Request { steps, skip: s } if enabled => {
                    *skip.lock().unwrap() = s.iter().map(|i| blocks[i % blocks.len()]).collect();
                    let expected = gpu_request(&resident, &proxy, *steps).unwrap();
                    let got = gpu_request(&offloaded, &proxy, *steps).unwrap();
                    skip.lock().unwrap().clear();
                    assert_eq!(got, expected, "{context}");
                }
                offload_tests::scenario::Op::Block { index } if enabled => {
                    let block = blocks[index % blocks.len()];
                    let expected = gpu_block(&resident, &proxy, block).unwrap();
                    assert_eq!(
                        gpu_block(&offloaded, &proxy, block).unwrap(),
                        expected,
                        "{context}"
                    );
                }
                _ => {}
            }
        }
        if enabled {
            offloaded.disable().unwrap();
        }
        resident.disable().unwrap();
        d.synchronize_stream(&stream).unwrap();
        proxy.free(&d).unwrap();
    }
}
