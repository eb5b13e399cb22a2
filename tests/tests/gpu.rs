//! The GPU suite: the strategies on a real GPU through `offload-cuda`.
//! Where no CUDA driver is found every test prints one skip line and passes.
//!
//! Kernels are real: cuBLAS bf16 GEMMs over each block's own 2-D weights
//! with their shapes, fused attention (the proxy's default), and the chained proxy
//! (every weight byte folded, a state mixed after each block that rewrites
//! the next block's activations), so an output is a function of every byte
//! each block read, in order. Weights are random, finite, never zero and
//! distinct per storage.
//!
//! * Every strategy is bit-identical to resident, and the allocator's
//!   high-water mark and `cuMemGetInfo` stay within INV-7's bound from
//!   `memory_bounds` plus one 2 MiB granule per allocation.
//! * Under seeded timing perturbation (spins on the streams, host sleeps)
//!   every strategy and the simulator's seeded scenarios stay bit-identical
//!   to an unperturbed resident run.
//! * Planted ordering bugs are caught on the GPU: under perturbation the
//!   output differs from resident (or a forward fails) within a bounded
//!   number of seeds; each prints `planted <name>: caught on seed S after N
//!   runs`, beside a clean control.
//! * Layerwise with `weight_compression = "lossless"` (`CudaCodec`, the
//!   blocks decoded on the device) over trained-looking weights is
//!   bit-identical to resident, within INV-7 and under perturbation, with
//!   no decode error; each planted decode-transport ordering bug makes it
//!   differ, beside a clean control on the same seed.
//! * The proxy's fused attention (`FlashKernels`, head dimensions 64 and
//!   128, token counts on and off its 64-row tiles) matches a host
//!   reference, and each of its planted bugs (no rescale when a row's max
//!   moves, keys past T unmasked, a quad's row sums not combined) does
//!   not; the proxy's own fused path matches it at shapes where O's
//!   offset is odd; the proxy's two attention kinds differ in output (the
//!   fused one applies a softmax) and each is deterministic.
//! * The timeline recorder puts copies and marked spans on their streams'
//!   tracks, in order, and refuses a span never ended.
//! * Dropping an enabled runtime, or panicking inside a forward, leaks no
//!   device memory and leaves no CUDA error (tests named `drop_`, which the
//!   bundle also runs under compute-sanitizer memcheck).

use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use offload_core::budget::ComponentMode;
use offload_core::bytes::ByteSize;
use offload_core::config::WeightCompression;
use offload_core::device::{
    Device, DeviceBuffer, DeviceError, DeviceErrorKind, HostBuffer, HostSource,
};
use offload_core::model::{DType, ModuleId, Pipeline, PipelineBuilder, StorageId, TensorId};
use offload_core::request::RequestShape;
use offload_core::runtime::{
    Backend, CorePlatform, PlantedBug, Runtime, Scope, WeightSource, memory_bounds, plan_bounds,
};
use offload_core::{ComponentDeclaration, OffloadConfig, OffloadError};
use offload_cuda::decode::CudaCodec;
use offload_cuda::proxy::{ATTENTION_SRC, Attention, FlashKernels, Proxy};
use offload_cuda::{Cuda, CudaBuffer, CudaDevice, CudaStream, Perturbation, driver_present};
use offload_hooks::BoxError;
use offload_pack::synth::{Law, tensor_bytes};
use offload_sim::harness::blocks_of;
use offload_sim::presets::SyntheticWeights;
use offload_tests::BlockCache;

const TOKENS: u64 = 256;
const HEADS: u64 = 4;
const HEAD_DIM: u64 = 64;
/// Proxy scratch: activations and outputs for the widest GEMM and for
/// attention at `TOKENS`.
const INPUT_BYTES: u64 = TOKENS * 4096 * 2;
const OUTPUT_BYTES: u64 = TOKENS * (4096 + TOKENS * 4) * 2 * 4;
/// The allocator maps memory in 2 MiB granules: INV-7 allows one per
/// allocation beyond the exact bytes.
const GRANULE: u64 = 2 << 20;

/// GPU tests run one at a time in a process (they measure the device-wide
/// allocator and time races); nextest runs each in its own process anyway.
static GPU: Mutex<()> = Mutex::new(());

struct Gpu {
    device: Arc<CudaDevice>,
    _one_at_a_time: MutexGuard<'static, ()>,
}

fn gpu() -> Option<Gpu> {
    if !driver_present() {
        println!("skipping GPU test: no CUDA driver found");
        return None;
    }
    let guard = GPU.lock().unwrap_or_else(PoisonError::into_inner);
    Some(Gpu {
        device: Arc::new(CudaDevice::new(0).expect("device 0")),
        _one_at_a_time: guard,
    })
}

/// Whether compute-sanitizer runs us (the bundle sets this): slow tests
/// shrink, and the timing tests, which check ordering and not memory, are
/// skipped.
fn under_sanitizer() -> bool {
    std::env::var_os("OFFLOAD_UNDER_SANITIZER").is_some()
}

/// Random weights whose bf16/f32 values are small and finite (every odd
/// byte, the high byte of a little-endian bf16, gets a bounded exponent),
/// distinct per storage and per seed.
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

/// Trained-looking weights: every bf16 storage drawn from `law` at its
/// tensor's init scale (`offload_pack::synth`: N(0, 1/fan-in) for the
/// normal law), per storage and seed; every other storage as
/// [`FiniteWeights`]. What the lossless code compresses (uniform random
/// bits would stream raw).
struct TrainedWeights {
    bf16: std::collections::BTreeMap<StorageId, Vec<u8>>,
    other: FiniteWeights,
}

impl TrainedWeights {
    fn new(p: &Pipeline, law: Law, seed: u64) -> Self {
        let mut dtypes: std::collections::BTreeMap<StorageId, Vec<(TensorId, DType)>> =
            Default::default();
        for (id, t) in p.tensors() {
            dtypes.entry(t.storage).or_default().push((id, t.dtype));
        }
        let all: Vec<(String, Vec<u64>)> = p
            .tensors()
            .map(|(id, t)| (p.tensor_path(id), t.shape.clone()))
            .collect();
        let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
        let mut bf16 = std::collections::BTreeMap::new();
        for (index, (storage, s)) in p.storages().enumerate() {
            let Some(ts) = dtypes.get(&storage) else {
                continue;
            };
            if ts.iter().any(|(_, d)| *d != DType::Bf16) {
                continue;
            }
            let t = p.tensor(ts[0].0);
            let name = p.tensor_path(ts[0].0);
            let fan_in = t.shape.get(1).copied().unwrap_or(1).max(1);
            let shape = [s.bytes / 2 / fan_in, fan_in];
            let mut bytes = tensor_bytes(law, seed, index, &name, &shape, &all, threads);
            bytes.resize(s.bytes as usize, 0x3c);
            bf16.insert(storage, bytes);
        }
        Self {
            bf16,
            other: FiniteWeights(SyntheticWeights { seed }),
        }
    }
}

impl WeightSource for TrainedWeights {
    fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        match self.bf16.get(&storage) {
            Some(b) => {
                let at = position as usize;
                dst.copy_from_slice(&b[at..at + dst.len()]);
            }
            None => self.other.read(storage, position, dst),
        }
    }
}

/// A DiT of heterogeneous blocks (5 double then 6 single, as Flux: one
/// ring of 11, odd), an encoder stack and a VAE; blocks of 1–6 MiB.
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

/// The kernels over some tensors: a GEMM per 2-D bf16 weight (its first
/// output row folded) and every byte folded.
fn kernels(scope: &Scope<'_, Cuda>, proxy: &Proxy, tensors: &[TensorId]) -> Result<(), BoxError> {
    let stream: &CudaStream = scope.stream();
    for t in tensors {
        let v = scope.view_id(*t)?;
        let ptr = v.buffer().ptr() + v.byte_range().start;
        let tensor = v.tensor();
        if tensor.dtype == DType::Bf16 && tensor.shape.len() == 2 {
            proxy.linear(ptr, tensor.shape[0], tensor.shape[1], TOKENS)?;
        }
        proxy.fold(stream, ptr, v.byte_range().end - v.byte_range().start)?;
    }
    Ok(())
}

/// One block's forward body: a perturbation point (with a perturbation
/// set, compute may be delayed here: after the block's pre-forward, with
/// its waits and any planted early last-use record, and before its first
/// read), the kernels, attention, the chain step.
fn block_body(blk: &Scope<'_, Cuda>, proxy: &Proxy, tensors: &[TensorId]) -> Result<(), BoxError> {
    blk.device().perturb(blk.stream())?;
    kernels(blk, proxy, tensors)?;
    proxy.attention(HEADS, TOKENS, HEAD_DIM)?;
    proxy.chain(blk.stream())?;
    Ok(())
}

/// One component's forward: its own tensors, a chain step, then each
/// block (hooks, body).
fn component(rt: &Runtime<Cuda>, proxy: &Proxy, path: &str) -> Result<(), OffloadError> {
    component_with(rt, proxy, path, &mut || ())
}

/// [`component`], calling `begun` first inside its forward (after the
/// backend's pre-forward hooks).
fn component_with(
    rt: &Runtime<Cuda>,
    proxy: &Proxy,
    path: &str,
    begun: &mut dyn FnMut(),
) -> Result<(), OffloadError> {
    rt.forward(path, |scope| {
        begun();
        let p = scope.pipeline();
        let module = scope.module();
        let blocks = blocks_of(p, module);
        let inner: BTreeSet<TensorId> = blocks.iter().flat_map(|b| p.subtree_tensors(*b)).collect();
        let own: Vec<TensorId> = p
            .subtree_tensors(module)
            .into_iter()
            .filter(|t| !inner.contains(t))
            .collect();
        kernels(scope, proxy, &own)?;
        proxy.chain(scope.stream())?;
        for b in blocks {
            let rel = p.module(b).path[p.module(module).path.len() + 1..].to_owned();
            let tensors = p.subtree_tensors(b);
            scope.child(&rel, |blk| block_body(blk, proxy, &tensors))?;
        }
        Ok(())
    })?;
    Ok(())
}

/// Which backend a run enables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    Resident,
    Layerwise {
        depth: usize,
    },
    /// Layerwise with `weight_compression = "lossless"`: coded blocks
    /// decoded on the device (the rig's [`CudaCodec`]).
    Lossless {
        depth: usize,
    },
    /// Layerwise with `pin_cpu_memory = false`: every master pageable,
    /// streamed through pinned staging buffers (CONTRACT §7c).
    Staged {
        depth: usize,
    },
    /// [`Strategy::Staged`] with `"lossless"` over a coded-block file of
    /// the rig's trained weights (CONTRACT §7b with §7c): every block's
    /// coded bytes stay pageable, staged through the pinned ring, then
    /// decoded.
    StagedLossless {
        depth: usize,
    },
    ModelLevel,
    /// Model level with `pin_cpu_memory = false`: every master pageable,
    /// swapped units brought in through one pinned upload buffer (CONTRACT
    /// §6, §7c).
    StagedModelLevel,
}

impl Strategy {
    fn config(self) -> OffloadConfig {
        match self {
            Strategy::Resident => OffloadConfig::default(),
            Strategy::Layerwise { .. } => OffloadConfig {
                enable_layerwise_offload: true,
                ..OffloadConfig::default()
            },
            Strategy::Lossless { .. } => OffloadConfig {
                enable_layerwise_offload: true,
                weight_compression: Some(WeightCompression::Lossless),
                ..OffloadConfig::default()
            },
            Strategy::Staged { .. } => OffloadConfig {
                enable_layerwise_offload: true,
                pin_cpu_memory: Some(false),
                ..OffloadConfig::default()
            },
            Strategy::StagedLossless { .. } => OffloadConfig {
                enable_layerwise_offload: true,
                pin_cpu_memory: Some(false),
                weight_compression: Some(WeightCompression::Lossless),
                ..OffloadConfig::default()
            },
            Strategy::ModelLevel => OffloadConfig {
                enable_cpu_offload: true,
                ..OffloadConfig::default()
            },
            Strategy::StagedModelLevel => OffloadConfig {
                enable_cpu_offload: true,
                pin_cpu_memory: Some(false),
                ..OffloadConfig::default()
            },
        }
    }

    fn depth(self) -> usize {
        match self {
            Strategy::Layerwise { depth }
            | Strategy::Lossless { depth }
            | Strategy::Staged { depth }
            | Strategy::StagedLossless { depth } => depth,
            _ => 1,
        }
    }

    fn backend(self, platform: &CorePlatform<Cuda>) -> Result<Box<dyn Backend<Cuda>>, String> {
        let e = |e: OffloadError| e.to_string();
        Ok(match self {
            Strategy::Resident => platform.resident().map_err(e)?,
            Strategy::Layerwise { .. }
            | Strategy::Lossless { .. }
            | Strategy::Staged { .. }
            | Strategy::StagedLossless { .. } => {
                Box::new(platform.layerwise(self.config()).map_err(e)?)
            }
            Strategy::ModelLevel | Strategy::StagedModelLevel => {
                offload_core::get_offload_backend(&self.config(), platform)
                    .map_err(e)?
                    .ok_or("model level selects no backend")?
            }
        })
    }

    /// INV-7: the exact bound plus one granule per allocation.
    fn bound_bytes(self, p: &Pipeline) -> u64 {
        let b = memory_bounds(p, &self.config(), self.depth()).expect("bounds");
        b.device_weight_bytes + b.device_allocations * GRANULE
    }
}

/// A device, a compute stream, the proxy on it, the pipeline, the set of
/// DiT blocks the cache hook skips.
struct Rig {
    device: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    proxy: Arc<Proxy>,
    pipeline: Pipeline,
    skip: Arc<Mutex<BTreeSet<ModuleId>>>,
    /// Where set ([`Rig::trained`]): the law of the bf16 weights
    /// ([`TrainedWeights`]) and the codec every platform carries.
    trained: Option<(Law, Arc<CudaCodec>)>,
    /// The last trained weights made (seed, weights): a resident run and
    /// an offloaded one of the same seed share them.
    last_weights: Mutex<Option<(u64, Arc<TrainedWeights>)>>,
}

impl Rig {
    /// A rig whose weights are trained-looking (`law`) and whose
    /// platforms carry a [`CudaCodec`] (for [`Strategy::Lossless`]).
    fn trained(device: &Arc<CudaDevice>, pipeline: Pipeline, law: Law) -> Self {
        let codec = Arc::new(CudaCodec::new(device).expect("the decoder compiles (nvrtc)"));
        Self {
            trained: Some((law, codec)),
            ..Self::new(device, pipeline)
        }
    }

    /// The codec of a trained rig.
    fn codec(&self) -> &CudaCodec {
        &self.trained.as_ref().expect("a trained rig").1
    }

    fn new(device: &Arc<CudaDevice>, pipeline: Pipeline) -> Self {
        // Freed memory stays mapped in the pool until `settle` trims it
        // after synchronising: a planted use-after-free then reads stale
        // bytes (a wrong output) instead of faulting the context, and
        // memory freed on a stream is there for its next allocation.
        device.set_pool_release_threshold(u64::MAX).unwrap();
        let stream = Arc::new(device.create_stream().unwrap());
        let proxy =
            Arc::new(Proxy::new(device, Arc::clone(&stream), INPUT_BYTES, OUTPUT_BYTES).unwrap());
        Self {
            device: Arc::clone(device),
            stream,
            proxy,
            pipeline,
            skip: Arc::default(),
            trained: None,
            last_weights: Mutex::new(None),
        }
    }

    /// Runs every kernel the runs will run (each GEMM shape, attention,
    /// fold, chain, the spin kernel) once, so that lazily loaded code and
    /// cuBLAS's workspace are in place before memory is measured.
    fn warm_up(&self) {
        let p = &self.proxy;
        let w = p.input().ptr();
        for (_, t) in self.pipeline.tensors() {
            let (out_f, in_f) = match t.shape[..] {
                [o, i] if t.dtype == DType::Bf16 => (o, i),
                _ => continue,
            };
            // The activations stand in for the weight: only its shape matters.
            if out_f * in_f * 2 <= p.input().len_bytes() {
                p.linear(w, out_f, in_f, TOKENS).unwrap();
            }
        }
        p.attention(HEADS, TOKENS, HEAD_DIM).unwrap();
        p.chain(&self.stream).unwrap();
        self.device.spin(&self.stream, 0).unwrap();
        p.reset(&self.stream).unwrap();
        p.read_output().unwrap();
    }

    /// A platform over weights of `seed`, with `bugs` planted.
    /// A platform over weights of `seed` (trained where the rig is) with a
    /// coded-block file of them beside (written once per seed, to a
    /// temporary directory): for [`Strategy::StagedLossless`].
    fn coded_platform(&self, seed: u64, depth: usize, bugs: &[PlantedBug]) -> CorePlatform<Cuda> {
        use offload_pack::blocks_file::{CodedBlocks, WithCodedBlocks, pack_blocks};
        let inner = self.weights(seed);
        let dir = std::env::temp_dir().join(format!("gpu-coded-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{seed}.opackb"));
        if !path.exists() {
            pack_blocks(
                &path,
                &self.pipeline,
                &*inner,
                &offload_pack::format::EncodeConfig::default(),
            )
            .expect("writing the coded-block file");
        }
        let weights = Arc::new(WithCodedBlocks {
            inner,
            blocks: CodedBlocks::open(&path).expect("opening the coded-block file"),
        });
        self.platform_over(weights, depth, bugs)
    }

    /// The platform of `strategy` over weights of `seed`.
    fn platform_for(
        &self,
        strategy: Strategy,
        seed: u64,
        bugs: &[PlantedBug],
    ) -> CorePlatform<Cuda> {
        match strategy {
            Strategy::StagedLossless { depth } => self.coded_platform(seed, depth, bugs),
            s => self.platform(seed, s.depth(), bugs),
        }
    }

    fn platform(&self, seed: u64, depth: usize, bugs: &[PlantedBug]) -> CorePlatform<Cuda> {
        self.platform_over(self.weights(seed), depth, bugs)
    }

    fn weights(&self, seed: u64) -> Arc<dyn WeightSource> {
        match &self.trained {
            None => Arc::new(FiniteWeights(SyntheticWeights { seed })),
            Some((law, _)) => {
                let mut last = self
                    .last_weights
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                match &*last {
                    Some((s, w)) if *s == seed => Arc::clone(w) as Arc<dyn WeightSource>,
                    _ => {
                        let w = Arc::new(TrainedWeights::new(&self.pipeline, *law, seed));
                        *last = Some((seed, Arc::clone(&w)));
                        w
                    }
                }
            }
        }
    }

    fn platform_over(
        &self,
        weights: Arc<dyn WeightSource>,
        depth: usize,
        bugs: &[PlantedBug],
    ) -> CorePlatform<Cuda> {
        let platform = CorePlatform::<Cuda>::new(
            "cuda",
            Arc::clone(&self.device),
            Arc::clone(&self.stream),
            weights,
        )
        .with_prefetch_depth(depth)
        .with_planted_bugs(bugs);
        match &self.trained {
            Some((_, codec)) => platform.with_codec(Arc::clone(codec) as _),
            None => platform,
        }
    }

    /// A runtime of the pipeline with the cache hook on every DiT block.
    fn runtime(&self) -> Runtime<Cuda> {
        let p = &self.pipeline;
        let mut rt = Runtime::new(
            Arc::clone(&self.device),
            Arc::clone(&self.stream),
            p.clone(),
        );
        let blocks = blocks_of(p, p.module_id("transformer").unwrap());
        BlockCache::install(rt.model_mut(), &blocks, &self.skip);
        rt
    }

    fn dit_blocks(&self) -> Vec<ModuleId> {
        let p = &self.pipeline;
        blocks_of(p, p.module_id("transformer").unwrap())
    }

    /// Skips DiT blocks 2 and 7 in request 1 (on-demand fills), none else.
    fn set_skips(&self, request: usize) {
        let blocks = self.dit_blocks();
        *self.skip.lock().unwrap() = if request == 1 {
            [blocks[2], blocks[7]].into()
        } else {
            BTreeSet::new()
        };
    }

    /// Waits for everything, gives unused pool memory back, and returns
    /// the allocator's bytes in use.
    fn settle(&self) -> u64 {
        self.device.synchronize().expect("no CUDA error");
        self.device.trim_pool().unwrap();
        self.device.pool_used().unwrap().0
    }
}

struct Measured {
    outputs: Vec<u64>,
    /// cuMemGetInfo: device memory in use beyond what was before enable.
    peak_used_bytes: u64,
    /// The allocator's high-water mark beyond what was before enable.
    peak_allocated_bytes: u64,
}

/// Three requests (encoder, two DiT forwards, VAE; blocks skipped in the
/// second) with `strategy`, synchronising and measuring after each
/// component; no perturbation.
fn measured_run(rig: &Rig, strategy: Strategy) -> Measured {
    let device = &rig.device;
    let mut rt = rig.runtime();
    let platform = rig.platform_for(strategy, 42, &[]);
    let allocated_before = rig.settle();
    device.reset_pool_high().unwrap();
    let free_before = device.memory_info().unwrap().free_bytes;
    rt.enable(strategy.backend(&platform).unwrap())
        .map_err(|(e, _)| e)
        .unwrap();
    let mut peak = 0u64;
    let mut sample = |rt: &Runtime<Cuda>| {
        device.synchronize_stream(rt.compute_stream()).unwrap();
        device.trim_pool().unwrap();
        peak = peak.max(free_before.saturating_sub(device.memory_info().unwrap().free_bytes));
    };
    let mut outputs = Vec::new();
    for request in 0..3 {
        rig.proxy.reset(&rig.stream).unwrap();
        rig.set_skips(request);
        component(&rt, &rig.proxy, "text_encoder").unwrap();
        sample(&rt);
        for _ in 0..2 {
            component(&rt, &rig.proxy, "transformer").unwrap();
            sample(&rt);
        }
        component(&rt, &rig.proxy, "vae").unwrap();
        outputs.push(rig.proxy.read_output().unwrap());
    }
    rig.set_skips(0);
    let allocated_peak = device.pool_used().unwrap().1;
    rt.disable().unwrap();
    assert_eq!(rig.settle(), allocated_before, "{strategy:?}: no leak");
    Measured {
        outputs,
        peak_used_bytes: peak,
        peak_allocated_bytes: allocated_peak - allocated_before,
    }
}

/// The order of components in one request of the timing runs: both
/// model-level swaps (encoder → DiT and DiT → encoder) happen inside a
/// request, with no host synchronisation until its output is read.
const SEQUENCE: [&str; 6] = [
    "text_encoder",
    "transformer",
    "transformer",
    "text_encoder",
    "transformer",
    "vae",
];

/// Two requests of [`SEQUENCE`] (blocks skipped in the second) with
/// `strategy` over weights of `seed`, `bugs` planted, under
/// `perturbation`; the outputs, or what failed.
fn timing_run(
    rig: &Rig,
    strategy: Strategy,
    seed: u64,
    bugs: &[PlantedBug],
    perturbation: Option<Perturbation>,
) -> Result<Vec<u64>, String> {
    let platform = rig.platform_for(strategy, seed, bugs);
    let mut rt = rig.runtime();
    rig.settle();
    rig.device.set_perturbation(perturbation).unwrap();
    let out = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<u64>, String> {
        rt.enable(strategy.backend(&platform)?)
            .map_err(|(e, _)| e.to_string())?;
        let mut outputs = Vec::new();
        for request in 0..2 {
            rig.proxy.reset(&rig.stream).map_err(|e| e.to_string())?;
            rig.set_skips(request);
            for path in SEQUENCE {
                component(&rt, &rig.proxy, path).map_err(|e| e.to_string())?;
            }
            outputs.push(rig.proxy.read_output().map_err(|e| e.to_string())?);
        }
        Ok(outputs)
    }));
    rig.device.set_perturbation(None).unwrap();
    rig.set_skips(0);
    let out = out.unwrap_or_else(|panic| Err(format!("panicked: {}", panic_text(&*panic))));
    // A planted bug may break disable too; dropping drains regardless.
    let disabled = catch_unwind(AssertUnwindSafe(|| rt.disable().map(drop)));
    drop(rt);
    rig.settle();
    match disabled {
        Ok(Ok(())) => out,
        Ok(Err(e)) => out.and(Err(format!("disable: {e}"))),
        Err(panic) => out.and(Err(format!("disable panicked: {}", panic_text(&*panic)))),
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "(no message)".to_owned())
}

/// Wide race windows: half of the perturbation points spin their stream
/// for up to 3 ms and sleep the host up to 100 µs.
fn wide(seed: u64) -> Perturbation {
    Perturbation {
        seed,
        probability: 0.5,
        max_spin_ns: 3_000_000,
        max_host_delay_us: 100,
    }
}

#[test]
fn device_basics() {
    let Some(g) = gpu() else { return };
    let d = &g.device;
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
    // Ranges out of bounds are errors, not reads past the end.
    // SAFETY: refused before anything is enqueued.
    let e = unsafe { d.copy_h2d(&s, HostSource::Pinned(&host), 1, &dev, 0, 1 << 20) }.unwrap_err();
    assert!(
        e.to_string().contains("of a 1048576-byte pinned source"),
        "{e}"
    );
    // SAFETY: as above.
    let e = unsafe { d.copy_d2h(&s, &dev, 0, &mut back, u64::MAX, 2) }.unwrap_err();
    assert!(e.to_string().contains("cuMemcpyDtoHAsync"), "{e}");
    // In-place registration, then a copy from it (from the address
    // captured at registration).
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
    // The perturbation API: a spin, a point with and without a setting.
    d.spin(&s, 10_000).unwrap();
    d.perturb(&s).unwrap();
    let p = wide(3);
    d.set_perturbation(Some(p)).unwrap();
    assert_eq!(d.perturbation(), Some(p));
    for _ in 0..8 {
        d.perturb(&s).unwrap();
    }
    d.set_perturbation(None).unwrap();
    assert_eq!(d.perturbation(), None);
    // The pool's chunk (measured at creation, CONTRACT §7a): with
    // allocations of several sizes live (33 MiB, 100 MiB and 3 MiB beside
    // the 1 MiB above) and its unused chunks given back, the default pool
    // holds what is in use rounded up to a chunk: it packs them.
    let chunk = d.pool_chunk();
    let more: Vec<_> = [33u64 << 20, 100 << 20, 3 << 20]
        .into_iter()
        .map(|b| d.alloc_device(b).unwrap())
        .collect();
    d.trim_pool().unwrap();
    let (reserved, _) = d.pool_reserved().unwrap();
    let (used, _) = d.pool_used().unwrap();
    println!("pool chunk {chunk} B; the default pool holds {reserved} B for {used} B in use");
    assert!(chunk >= 2 << 20, "a pool chunk of {chunk} B");
    assert_eq!(
        reserved,
        used.div_ceil(chunk) * chunk,
        "the pool holds {reserved} B for {used} B in use, chunk {chunk} B"
    );
    for b in more {
        // SAFETY: nothing was enqueued on them.
        unsafe { d.free_device(b, &[]) }.unwrap();
    }
    // Out of memory is a typed error. (Under compute-sanitizer the failed
    // allocation would be reported as an API error: the probe is skipped.)
    if !under_sanitizer() {
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
    d.synchronize().unwrap();
}

/// `n` bf16 drawn from a standard normal: offload-pack's synthetic
/// normal law at fan-in 1 (σ = 1), from `seed`.
fn normal_bf16(seed: u64, n: usize) -> Vec<u8> {
    tensor_bytes(Law::Normal, seed, 0, "x.weight", &[n as u64, 1], &[], 1)
}

fn bf16_at(bytes: &[u8], i: usize) -> f32 {
    f32::from_bits((u32::from(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]))) << 16)
}

/// `softmax(Q·Kᵀ / sqrt(D))·V` on the host in f64, `[heads][t][d]`.
fn attention_reference(q: &[u8], k: &[u8], v: &[u8], heads: usize, t: usize, d: usize) -> Vec<f64> {
    let mut o = vec![0f64; heads * t * d];
    let scale = 1.0 / (d as f64).sqrt();
    for h in 0..heads {
        let at = |b: &[u8], row: usize, col: usize| f64::from(bf16_at(b, (h * t + row) * d + col));
        for i in 0..t {
            let s: Vec<f64> = (0..t)
                .map(|j| (0..d).map(|c| at(q, i, c) * at(k, j, c)).sum::<f64>() * scale)
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let l: f64 = p.iter().sum();
            for c in 0..d {
                o[(h * t + i) * d + c] = (0..t).map(|j| p[j] * at(v, j, c)).sum::<f64>() / l;
            }
        }
    }
    o
}

/// `data` copied into `dst` at byte `at` on `s`, waited for.
fn upload(d: &CudaDevice, s: &CudaStream, data: &[u8], dst: &CudaBuffer, at: u64) {
    let bytes = data.len() as u64;
    let mut host = d.alloc_pinned(bytes).unwrap();
    host.write_from(0, bytes, &data.to_vec());
    // SAFETY: the caller's range lies in `dst` (a bad one is an error, not
    // a write past it); the stream is synchronised before the pinned
    // buffer is freed.
    unsafe { d.copy_h2d(s, HostSource::Pinned(&host), 0, dst, at, bytes) }.unwrap();
    d.synchronize_stream(s).unwrap();
    // SAFETY: the copy has finished.
    unsafe { d.free_pinned(host) }.unwrap();
}

/// `n` bf16 of `src` from byte `at`, read on `s` after the work enqueued
/// on it, as f32.
fn download_bf16(d: &CudaDevice, s: &CudaStream, src: &CudaBuffer, at: u64, n: u64) -> Vec<f32> {
    let mut back = d.alloc_pinned(n * 2).unwrap();
    // SAFETY: as `upload`; ordered after the stream's earlier work.
    unsafe { d.copy_d2h(s, src, at, &mut back, 0, n * 2) }.unwrap();
    d.synchronize_stream(s).unwrap();
    let mut out = vec![0u8; (n * 2) as usize];
    back.read_into(0, &mut out);
    // SAFETY: the stream is drained.
    unsafe { d.free_pinned(back) }.unwrap();
    (0..n as usize).map(|i| bf16_at(&out, i)).collect()
}

/// The fused attention's output on the device, as f32.
#[allow(clippy::too_many_arguments)]
fn flash_on_device(
    d: &CudaDevice,
    s: &CudaStream,
    kernels: &FlashKernels,
    inputs: [&[u8]; 3],
    heads: u64,
    tokens: u64,
    head_dim: u64,
) -> Vec<f32> {
    let n = heads * tokens * head_dim;
    let on_device = |data: &[u8]| {
        let dev = d.alloc_device(n * 2).unwrap();
        upload(d, s, data, &dev, 0);
        dev
    };
    let (q, k, v) = (
        on_device(inputs[0]),
        on_device(inputs[1]),
        on_device(inputs[2]),
    );
    let o = d.alloc_device(n * 2).unwrap();
    kernels
        .run(s, &q, &k, &v, &o, heads, tokens, head_dim)
        .unwrap();
    let out = download_bf16(d, s, &o, 0, n);
    for b in [q, k, v, o] {
        // SAFETY: the stream is drained (download_bf16 waited for it).
        unsafe { d.free_device(b, &[]) }.unwrap();
    }
    out
}

/// The worst error of `got` against `want`, relative to `want`'s largest
/// magnitude.
fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - w).abs())
        .fold(0f64, f64::max)
        / scale
}

/// The proxy's fused attention (`attention.cu`) against a host reference
/// in f64, over head dimensions 64 and 128 and token counts on and off
/// its 64-row tiles (1, 64, 200, 1,000), Q, K and V distinct normal
/// draws; then each planted bug, compiled from a copy of the source, is
/// off by more than the bound on at least one shape. The bound (2 % of
/// the largest output) covers P and O rounded to bf16.
#[test]
fn flash_attention_matches_a_host_reference_and_its_planted_bugs_do_not() {
    const BOUND: f64 = 0.02;
    let Some(g) = gpu() else { return };
    let d = &g.device;
    let s = d.create_stream().unwrap();
    let shapes: [(u64, u64, u64); 5] = [
        (2, 200, 64),
        (2, 200, 128),
        (1, 64, 128),
        (3, 1, 64),
        (1, 1000, 128),
    ];
    let cases: Vec<_> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(h, t, dim))| {
            let n = (h * t * dim) as usize;
            let seed = 40_000 + 3 * i as u64;
            let (q, k, v) = (
                normal_bf16(seed, n),
                normal_bf16(seed + 1, n),
                normal_bf16(seed + 2, n),
            );
            let want = attention_reference(&q, &k, &v, h as usize, t as usize, dim as usize);
            ((h, t, dim), [q, k, v], want)
        })
        .collect();
    let worst = |kernels: &FlashKernels| -> Vec<f64> {
        cases
            .iter()
            .map(|((h, t, dim), [q, k, v], want)| {
                relative_error(
                    &flash_on_device(d, &s, kernels, [q, k, v], *h, *t, *dim),
                    want,
                )
            })
            .collect()
    };
    let clean = worst(&FlashKernels::new(d).unwrap());
    println!("flash attention, worst error / largest output per shape {shapes:?}: {clean:.5?}");
    assert!(clean.iter().all(|e| *e <= BOUND), "{clean:?} past {BOUND}");
    let planted = [
        (
            "no rescale when a row's max moves",
            "const float alpha[2] = {ex2(mrow[0] - mx[0]), ex2(mrow[1] - mx[1])};",
            "const float alpha[2] = {1.f, 1.f};",
        ),
        (
            "keys past T unmasked",
            "s[j][e] = key < T ? s[j][e] * scale_log2 : neg_inf;",
            "s[j][e] = s[j][e] * scale_log2;",
        ),
        (
            "a quad's row sums not combined",
            "l += __shfl_xor_sync(0xffffffffu, l, 1);",
            "",
        ),
    ];
    let mut missed = vec![];
    for (name, from, to) in planted {
        assert_eq!(
            ATTENTION_SRC.matches(from).count(),
            1,
            "{name}: the source changed"
        );
        let bugged = FlashKernels::from_source(d, &ATTENTION_SRC.replacen(from, to, 1)).unwrap();
        let errors = worst(&bugged);
        let caught = errors.iter().any(|e| *e > BOUND);
        println!(
            "planted attention bug \"{name}\": {} (worst error per shape {errors:.4?})",
            if caught { "caught" } else { "NOT caught" }
        );
        if !caught {
            missed.push(name);
        }
    }
    assert!(
        missed.is_empty(),
        "planted attention bugs not caught: {missed:?}"
    );
    // Refused shapes: a head dimension without a kernel, an output that
    // is an input.
    let b = d.alloc_device(1 << 16).unwrap();
    let kernels = FlashKernels::new(d).unwrap();
    let e = kernels.run(&s, &b, &b, &b, &b, 1, 64, 64).unwrap_err();
    assert!(
        e.to_string().contains("output buffer is one of the inputs"),
        "{e}"
    );
    let o = d.alloc_device(1 << 16).unwrap();
    let e = kernels.run(&s, &b, &b, &b, &o, 1, 64, 96).unwrap_err();
    assert!(
        e.to_string().contains("head_dim = 96 is not supported"),
        "{e}"
    );
    let e = kernels.run(&s, &b, &b, &b, &o, 1, 1024, 64).unwrap_err();
    assert!(e.to_string().contains("needs 131072 bytes of q"), "{e}");
}

/// The proxy's own fused path (`Proxy::attention`, Q = K = V = its
/// activations, O read back from where it writes it) against the host
/// reference, at shapes whose `g·T²` is odd (3 heads × 63 tokens, 5 × 129)
/// — where O once started 2 bytes off a 4-byte boundary and the kernel's
/// stores faulted — and at one token.
#[test]
fn the_proxy_fused_attention_matches_the_reference_at_odd_shapes() {
    const BOUND: f64 = 0.02;
    let Some(g) = gpu() else { return };
    let d = &g.device;
    let stream = Arc::new(d.create_stream().unwrap());
    let proxy = Proxy::new(d, Arc::clone(&stream), INPUT_BYTES, OUTPUT_BYTES).unwrap();
    let shapes: [(u64, u64, u64); 3] = [(3, 63, 64), (5, 129, 128), (1, 1, 128)];
    for (i, (heads, tokens, head_dim)) in shapes.into_iter().enumerate() {
        let n = (heads * tokens * head_dim) as usize;
        let x = normal_bf16(41_000 + i as u64, n);
        // On the proxy's stream, so ordered before its kernels.
        upload(d, &stream, &x, proxy.input(), 0);
        proxy.attention(heads, tokens, head_dim).unwrap();
        let at = Proxy::attention_output_offset(heads, tokens);
        let got = download_bf16(d, &stream, proxy.output(), at, n as u64);
        let want = attention_reference(
            &x,
            &x,
            &x,
            heads as usize,
            tokens as usize,
            head_dim as usize,
        );
        let e = relative_error(&got, &want);
        println!(
            "proxy fused attention, {heads} heads x {tokens} tokens x {head_dim}: O at byte {at}, worst error / largest output {e:.5}"
        );
        assert!(
            e <= BOUND,
            "{heads} x {tokens} x {head_dim}: {e} past {BOUND}"
        );
    }
}

/// The proxy's two attention kinds over the same activations: each is
/// deterministic (equal outputs from two runs) and they differ (the fused
/// kind applies a softmax, the materialized one does not), so a run
/// measures the kind it names.
#[test]
fn the_proxy_attention_kinds_are_deterministic_and_distinct() {
    let Some(g) = gpu() else { return };
    let d = &g.device;
    let stream = Arc::new(d.create_stream().unwrap());
    let mut proxy = Proxy::new(d, Arc::clone(&stream), INPUT_BYTES, OUTPUT_BYTES).unwrap();
    assert_eq!(proxy.attention_kind(), Attention::Flash);
    let mut run = |kind| {
        proxy.set_attention(kind);
        proxy.reset(&stream).unwrap();
        for _ in 0..3 {
            proxy.attention(HEADS, TOKENS, HEAD_DIM).unwrap();
            proxy.chain(&stream).unwrap();
        }
        proxy.read_output().unwrap()
    };
    let flash = [run(Attention::Flash), run(Attention::Flash)];
    if under_sanitizer() {
        // The materialized kind's cuBLAS GEMMs are off there.
        assert_eq!(flash[0], flash[1]);
        return;
    }
    let materialized = [run(Attention::Materialized), run(Attention::Materialized)];
    println!("proxy outputs: flash {flash:x?}, materialized {materialized:x?}");
    assert_eq!(
        flash[0], flash[1],
        "the fused attention is not deterministic"
    );
    assert_eq!(materialized[0], materialized[1]);
    assert_ne!(
        flash[0], materialized[0],
        "the attention kind changed nothing"
    );
}

/// The timeline recorder: two copies on one labelled stream, in issue
/// order and not overlapping, and a marked span on another; a second
/// timeline (events from the pool); a span never ended refused by name.
#[test]
fn timeline_records_copies_and_marked_spans() {
    const BYTES: u64 = 64 << 20;
    let Some(g) = gpu() else { return };
    let d = &g.device;
    let (copy, compute) = (d.create_stream().unwrap(), d.create_stream().unwrap());
    d.label_stream(&copy, "copy");
    d.label_stream(&compute, "compute");
    let host = d.alloc_pinned(BYTES).unwrap();
    let dev = d.alloc_device(2 * BYTES).unwrap();
    // Off, marking is a no-op and stopping an error.
    let ignored = d.timeline_begin(&compute, "ignored").unwrap();
    d.timeline_end(&compute, ignored).unwrap();
    assert!(d.timeline_stop().is_err());
    for run in 0..2 {
        d.timeline_start().unwrap();
        let block = d.timeline_begin(&compute, "block 0").unwrap();
        d.spin(&compute, 200_000).unwrap();
        d.timeline_end(&compute, block).unwrap();
        for i in 0..2 {
            // SAFETY: in bounds; `timeline_stop` waits for the copies
            // before the buffers drop.
            unsafe { d.copy_h2d(&copy, HostSource::Pinned(&host), 0, &dev, i * BYTES, BYTES) }
                .unwrap();
        }
        let spans = d.timeline_stop().unwrap();
        let on = |track: &str| {
            spans
                .iter()
                .filter(|s| s.track == track)
                .collect::<Vec<_>>()
        };
        let (copies, marked) = (on("copy"), on("compute"));
        assert_eq!(
            (copies.len(), marked.len(), spans.len()),
            (2, 1, 3),
            "run {run}: {spans:#?}"
        );
        assert_eq!(marked[0].name, "block 0");
        assert!(marked[0].duration_ns >= 100_000, "run {run}: {spans:#?}");
        for (i, c) in copies.iter().enumerate() {
            assert!(
                c.name.starts_with("h2d 67.1 MB pinned → dev 0x"),
                "{}",
                c.name
            );
            assert!(
                c.name.ends_with(&format!("+{}", i as u64 * BYTES)),
                "{}",
                c.name
            );
            assert!(c.duration_ns > 0, "run {run}: {spans:#?}");
        }
        assert!(
            copies[0].start_ns + copies[0].duration_ns <= copies[1].start_ns,
            "run {run}: {spans:#?}"
        );
    }
    d.timeline_start().unwrap();
    let _open = d.timeline_begin(&compute, "left open").unwrap();
    let e = d.timeline_stop().unwrap_err();
    assert!(
        e.to_string()
            .contains("span `left open` on compute was begun but never ended"),
        "{e}"
    );
    // Everything was released: a new timeline starts clean.
    d.timeline_start().unwrap();
    assert_eq!(d.timeline_stop().unwrap(), vec![]);
}

#[test]
fn every_strategy_is_bit_identical_and_within_inv7() {
    let Some(g) = gpu() else { return };
    let rig = Rig::new(&g.device, pipeline());
    rig.warm_up();
    let p = &rig.pipeline;
    let resident = measured_run(&rig, Strategy::Resident);
    assert!(resident.outputs.iter().all(|o| *o != 0));
    assert_ne!(
        resident.outputs[0], resident.outputs[1],
        "skipping blocks changes the output"
    );
    assert_eq!(
        resident.outputs[0], resident.outputs[2],
        "repeated requests agree"
    );
    let offloaded = [
        Strategy::Layerwise { depth: 1 },
        Strategy::Layerwise { depth: 2 },
        Strategy::ModelLevel,
    ]
    .map(|strategy| (strategy, measured_run(&rig, strategy)));
    // Every row is checked and printed before anything fails, so one run
    // on a GPU reports all of them.
    if under_sanitizer() {
        println!(
            "under compute-sanitizer: cuMemGetInfo counts the sanitizer's memory; INV-7 is checked on the allocator's counter only"
        );
    }
    let mut failures = Vec::new();
    for (strategy, out) in std::iter::once((Strategy::Resident, &resident))
        .chain(offloaded.iter().map(|(s, m)| (*s, m)))
    {
        let b = memory_bounds(p, &strategy.config(), strategy.depth()).unwrap();
        let bound = strategy.bound_bytes(p);
        println!(
            "{strategy:?}: allocator peak {} B, cuMemGetInfo peak {} B; INV-7 {} B + {} allocations x 2 MiB = {bound} B",
            out.peak_allocated_bytes,
            out.peak_used_bytes,
            b.device_weight_bytes,
            b.device_allocations
        );
        let checks = [
            (
                out.outputs == resident.outputs,
                format!(
                    "outputs {:x?} != resident {:x?}",
                    out.outputs, resident.outputs
                ),
            ),
            (
                out.peak_allocated_bytes >= b.device_weight_bytes,
                format!(
                    "the allocator saw {} B, less than the {} B of weights held",
                    out.peak_allocated_bytes, b.device_weight_bytes
                ),
            ),
            (
                out.peak_allocated_bytes <= bound,
                format!("allocator peak {} B > {bound} B", out.peak_allocated_bytes),
            ),
            (
                // Under compute-sanitizer, cuMemGetInfo also counts the
                // sanitizer's own device memory: only the allocator's
                // counter (above) measures ours there.
                under_sanitizer() || out.peak_used_bytes <= bound,
                format!("cuMemGetInfo peak {} B > {bound} B", out.peak_used_bytes),
            ),
        ];
        failures.extend(
            checks
                .into_iter()
                .filter(|(ok, _)| !ok)
                .map(|(_, why)| format!("{strategy:?}: {why}")),
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn every_strategy_is_bit_identical_under_perturbation() {
    let Some(g) = gpu() else { return };
    let rig = Rig::new(&g.device, pipeline());
    let seeds = if under_sanitizer() { 1 } else { 4 };
    for seed in 0..seeds {
        let weights = 7000 + seed;
        let expected = timing_run(&rig, Strategy::Resident, weights, &[], None).unwrap();
        for strategy in [
            Strategy::Layerwise { depth: 1 },
            Strategy::Layerwise { depth: 2 },
            Strategy::ModelLevel,
        ] {
            let got = timing_run(&rig, strategy, weights, &[], Some(wide(seed)));
            assert_eq!(
                got,
                Ok(expected.clone()),
                "{strategy:?} under perturbation seed {seed}"
            );
        }
    }
    println!("perturbed: layerwise depth 1 and 2 and model level equal resident on {seeds} seeds");
}

/// A planted ordering bug, the strategy it lives in, whether it needs the
/// perturbation, and which delay exposes it.
struct PlantedRow {
    bug: PlantedBug,
    strategy: Strategy,
    perturbed: bool,
    why: &'static str,
}

const LAYERWISE: Strategy = Strategy::Layerwise { depth: 1 };

/// Every row runs under [`wide`] perturbation (spins before copies, before
/// the compute stream's wait for a slot's ready event in each block's
/// pre-forward, before event records, and at the start of each block's
/// kernels) unless it is deterministic.
const PLANTED: [PlantedRow; 8] = [
    PlantedRow {
        bug: PlantedBug::SkipLastUseWait,
        strategy: LAYERWISE,
        perturbed: true,
        why: "compute delays (at block i-1's ready wait or kernel start) leave its reads pending while the unwaited fill of block i+1 overwrites the slot",
    },
    PlantedRow {
        bug: PlantedBug::SkipReadyWait,
        strategy: LAYERWISE,
        perturbed: true,
        why: "a spin before a prefetch's copy_h2d delays the fill; block i's kernels, not waiting for ready, read the slot's previous block",
    },
    PlantedRow {
        bug: PlantedBug::LastUseBeforeCompute,
        strategy: LAYERWISE,
        perturbed: true,
        why: "the last use is recorded before block i's kernels; a spin at the kernels' start delays them while the fill of block i+2 (waiting only for that early record) overwrites the slot",
    },
    PlantedRow {
        bug: PlantedBug::StaticSlot,
        strategy: LAYERWISE,
        perturbed: true,
        why: "11 blocks on 2 slots: block 10 and block 0 map to slot 0, so block 10's wrap-around prefetch refills the slot it reads; a compute spin at block 10's start lets the copy land first",
    },
    PlantedRow {
        bug: PlantedBug::EvictWithoutLastUse,
        strategy: Strategy::ModelLevel,
        perturbed: true,
        why: "compute spins keep the evicted component's kernels pending; its memory, freed after ready only, is reallocated in stream order to the next component, whose copy overwrites it",
    },
    PlantedRow {
        bug: PlantedBug::BringInWithoutReady,
        strategy: Strategy::ModelLevel,
        perturbed: true,
        why: "spins before the bring-in's copies delay them; compute, not waiting for ready, reads the new buffers first",
    },
    PlantedRow {
        bug: PlantedBug::WrongMaster,
        strategy: LAYERWISE,
        perturbed: false,
        why: "deterministic: every fill copies the next block's bytes",
    },
    PlantedRow {
        bug: PlantedBug::StaleSlot,
        strategy: LAYERWISE,
        perturbed: false,
        why: "deterministic: prefetches record ready without copying, so slots keep older blocks",
    },
];

/// Seeds tried per planted bug before it counts as missed.
const PLANTED_SEEDS: u64 = 12;

#[test]
fn planted_ordering_bugs_are_caught_on_the_gpu() {
    let Some(g) = gpu() else { return };
    if under_sanitizer() {
        println!(
            "under compute-sanitizer: the planted timing races are skipped (they test ordering, not memory)"
        );
        return;
    }
    let rig = Rig::new(&g.device, pipeline());
    // Weights differ per (bug, seed), and the planted run goes first, so a
    // buffer read too early never holds an earlier run's copy of the same
    // bytes.
    let weights = |row: usize, seed: u64| 10_000 * (row as u64 + 1) + seed;
    let control_seeds = 3;
    for strategy in [LAYERWISE, Strategy::ModelLevel] {
        for seed in 0..control_seeds {
            let got = timing_run(&rig, strategy, weights(99, seed), &[], Some(wide(seed)));
            let expected = timing_run(&rig, Strategy::Resident, weights(99, seed), &[], None);
            assert_eq!(got, expected, "clean {strategy:?}, seed {seed}");
        }
    }
    println!(
        "planted control (no bug): layerwise depth 1 and model level equal resident under the same perturbation on seeds 0..{control_seeds}"
    );
    let mut missed = Vec::new();
    for (row, p) in PLANTED.iter().enumerate() {
        let mut caught = None;
        for seed in 0..PLANTED_SEEDS {
            let perturbation = p.perturbed.then(|| wide(seed));
            let got = timing_run(&rig, p.strategy, weights(row, seed), &[p.bug], perturbation);
            let expected =
                timing_run(&rig, Strategy::Resident, weights(row, seed), &[], None).unwrap();
            match got {
                Ok(out) if out == expected => continue,
                Ok(_) => caught = Some((seed, "output differs from resident".to_owned())),
                Err(e) => caught = Some((seed, format!("the run failed: {e}"))),
            }
            break;
        }
        match caught {
            Some((seed, how)) => println!(
                "planted {}: caught on seed {seed} after {} runs ({how}; {})",
                p.bug.name(),
                seed + 1,
                p.why
            ),
            None => {
                println!(
                    "planted {}: NOT caught in {PLANTED_SEEDS} runs ({})",
                    p.bug.name(),
                    p.why
                );
                missed.push(p.bug.name());
            }
        }
    }
    assert!(missed.is_empty(), "planted bugs not caught: {missed:?}");
}

/// Lossless layerwise (coded blocks decoded on the device by
/// `opk_decode_block`) over normal bf16 weights: bit-identical to resident
/// and within INV-7 unperturbed, bit-identical under perturbation at depth
/// 1 and 2, every block decoded (its coded bytes fewer than its bf16
/// bytes), the decoder's error flag never raised.
#[test]
fn lossless_layerwise_is_bit_identical_and_decodes_on_the_gpu() {
    let Some(g) = gpu() else { return };
    let rig = Rig::trained(&g.device, pipeline(), Law::Normal);
    rig.warm_up();
    let p = &rig.pipeline;
    let resident = measured_run(&rig, Strategy::Resident);
    let before = rig.codec().stats();
    let lossless = Strategy::Lossless { depth: 1 };
    let out = measured_run(&rig, lossless);
    let stats = rig.codec().stats();
    let b = memory_bounds(p, &lossless.config(), 1).unwrap();
    let bound = lossless.bound_bytes(p);
    println!(
        "{lossless:?}: allocator peak {} B, cuMemGetInfo peak {} B; INV-7 {} B + {} allocations x 2 MiB = {bound} B; {} decodes, {} coded of {} decoded bytes ({:.4})",
        out.peak_allocated_bytes,
        out.peak_used_bytes,
        b.device_weight_bytes,
        b.device_allocations,
        stats.decodes - before.decodes,
        stats.coded_bytes - before.coded_bytes,
        stats.decoded_bytes - before.decoded_bytes,
        (stats.coded_bytes - before.coded_bytes) as f64
            / (stats.decoded_bytes - before.decoded_bytes).max(1) as f64
    );
    assert_eq!(
        rig.codec().take_error().unwrap(),
        0,
        "the decoder's error flag"
    );
    assert_eq!(out.outputs, resident.outputs, "lossless vs resident");
    assert!(stats.decodes > before.decodes, "no block was decoded");
    assert!(
        (stats.coded_bytes - before.coded_bytes) * 100
            < (stats.decoded_bytes - before.decoded_bytes) * 80,
        "normal weights code to under 0.8 of their bytes: {stats:?}"
    );
    assert!(
        out.peak_allocated_bytes <= bound,
        "allocator peak {} B > {bound} B",
        out.peak_allocated_bytes
    );
    assert!(
        under_sanitizer() || out.peak_used_bytes <= bound,
        "cuMemGetInfo peak {} B > {bound} B",
        out.peak_used_bytes
    );
    let seeds = if under_sanitizer() { 1 } else { 4 };
    for seed in 0..seeds {
        let weights = 7000 + seed;
        let expected = timing_run(&rig, Strategy::Resident, weights, &[], None).unwrap();
        for depth in [1, 2] {
            let strategy = Strategy::Lossless { depth };
            let got = timing_run(&rig, strategy, weights, &[], Some(wide(seed)));
            assert_eq!(
                got,
                Ok(expected.clone()),
                "{strategy:?} under perturbation seed {seed}"
            );
            assert_eq!(
                rig.codec().take_error().unwrap(),
                0,
                "{strategy:?} seed {seed}: the decoder's error flag"
            );
        }
    }
    println!(
        "perturbed: lossless layerwise depth 1 and 2 equal resident on {seeds} seeds, 0 decode errors ({:?})",
        rig.codec().stats()
    );
}

/// The decode transport's planted ordering bugs (CONTRACT §7b), each
/// under [`wide`] perturbation (spins before the staging copy, before the
/// decode launch and the decode stream's waits, before event records,
/// and at the start of each block's kernels).
const PLANTED_DECODE: [(PlantedBug, &str); 4] = [
    (
        PlantedBug::DecodeBeforeCopy,
        "a spin before the staging copy delays it; the decode, not waiting for `copied`, decodes the staging buffer's previous blob (or refuses stale bytes) into the slot",
    ),
    (
        PlantedBug::ComputeBeforeDecode,
        "ready is recorded after the staging copy; a spin before the decode delays it while compute reads the slot's previous block",
    ),
    (
        PlantedBug::StagingReuseBeforeDecode,
        "a spin on the decode stream delays the decode of fill k while the copy of fill k+2 (not waiting for `consumed`) overwrites its staging buffer; fill k decodes the wrong block",
    ),
    (
        PlantedBug::DecodeIntoSlotInUse,
        "compute spins keep block i-1's reads pending while the decode of block i+1, not waiting for the slot's last use, overwrites it",
    ),
];

#[test]
fn planted_decode_bugs_are_caught_on_the_gpu() {
    let Some(g) = gpu() else { return };
    if under_sanitizer() {
        println!(
            "under compute-sanitizer: the planted timing races are skipped (they test ordering, not memory)"
        );
        return;
    }
    let rig = Rig::trained(&g.device, pipeline(), Law::Normal);
    let lossless = Strategy::Lossless { depth: 1 };
    // Weights differ per (bug, seed), and the planted run goes first, as
    // in `planted_ordering_bugs_are_caught_on_the_gpu`.
    let weights = |row: usize, seed: u64| 20_000 * (row as u64 + 1) + seed;
    let mut missed = Vec::new();
    for (row, (bug, why)) in PLANTED_DECODE.iter().enumerate() {
        let mut caught = None;
        for seed in 0..PLANTED_SEEDS {
            let got = timing_run(
                &rig,
                lossless,
                weights(row, seed),
                &[*bug],
                Some(wide(seed)),
            );
            let flag = rig.codec().take_error().unwrap();
            let expected =
                timing_run(&rig, Strategy::Resident, weights(row, seed), &[], None).unwrap();
            match got {
                Ok(out) if out == expected => continue,
                Ok(_) => {
                    caught = Some((
                        seed,
                        format!("output differs from resident; decoder flag {flag}"),
                    ))
                }
                Err(e) => caught = Some((seed, format!("the run failed: {e}"))),
            }
            break;
        }
        match caught {
            Some((seed, how)) => {
                // The clean control: the same weights and perturbation,
                // no bug, equal resident.
                let control = timing_run(&rig, lossless, weights(row, seed), &[], Some(wide(seed)));
                let expected =
                    timing_run(&rig, Strategy::Resident, weights(row, seed), &[], None).unwrap();
                assert_eq!(
                    control,
                    Ok(expected),
                    "clean control of {} on seed {seed}",
                    bug.name()
                );
                assert_eq!(
                    rig.codec().take_error().unwrap(),
                    0,
                    "clean control's decoder flag"
                );
                println!(
                    "planted {}: caught on seed {seed} after {} runs ({how}; {why}); clean control on seed {seed} equals resident",
                    bug.name(),
                    seed + 1
                );
            }
            None => {
                println!(
                    "planted {}: NOT caught in {PLANTED_SEEDS} runs ({why})",
                    bug.name()
                );
                missed.push(bug.name());
            }
        }
    }
    assert!(
        missed.is_empty(),
        "planted decode bugs not caught: {missed:?}"
    );
}

/// Layerwise with every master staged (`pin_cpu_memory = false`, CONTRACT
/// §7c): bit-identical to resident unperturbed and under perturbation at
/// depth 1 and 2; the page-locked host memory offload-cuda itself counts
/// (`offload_cuda::host_locked`) never above the staging ring and one
/// resident unit's upload buffer; and the planted
/// `HostStagingReuseBeforeCopy` (the host refills a staging buffer without
/// waiting for the copy that read it) changes the output under
/// perturbation, beside a clean control.
#[test]
fn staged_layerwise_is_bit_identical_and_pins_only_its_ring_on_the_gpu() {
    let Some(g) = gpu() else { return };
    let rig = Rig::new(&g.device, pipeline());
    rig.warm_up();
    let p = &rig.pipeline;
    let resident = measured_run(&rig, Strategy::Resident);
    let staged = Strategy::Staged { depth: 1 };
    rig.settle();
    let locked_before = offload_cuda::host_locked();
    offload_cuda::reset_host_locked_peak();
    let out = measured_run(&rig, staged);
    let locked = offload_cuda::host_locked();
    let b = memory_bounds(p, &staged.config(), 1).unwrap();
    let held = locked.peak_bytes - (locked_before.pinned_bytes + locked_before.registered_bytes);
    println!(
        "{staged:?}: page-locked peak {held} B beyond the rig's (ring {} B + upload {} B; one copy of the streamed blocks {} B)",
        b.host_staging_bytes,
        b.staging_bytes - b.host_staging_bytes,
        b.offloaded_bytes
    );
    assert_eq!(out.outputs, resident.outputs, "staged vs resident");
    assert!(
        held <= b.staging_bytes,
        "page-locked peak {held} B > ring + upload {} B",
        b.staging_bytes
    );
    assert!(held < b.offloaded_bytes / 2, "the masters stayed pageable");
    let seeds = if under_sanitizer() { 1 } else { 4 };
    for seed in 0..seeds {
        let weights = 9000 + seed;
        let expected = timing_run(&rig, Strategy::Resident, weights, &[], None).unwrap();
        for depth in [1, 2] {
            let strategy = Strategy::Staged { depth };
            let got = timing_run(&rig, strategy, weights, &[], Some(wide(seed)));
            assert_eq!(
                got,
                Ok(expected.clone()),
                "{strategy:?} perturbation seed {seed}"
            );
        }
    }
    println!("perturbed: staged layerwise depth 1 and 2 equal resident on {seeds} seeds");
    if under_sanitizer() {
        return;
    }
    let (bug, seed, how) =
        planted_staging_bug_is_caught(&rig, staged, PlantedBug::HostStagingReuseBeforeCopy, 30_000);
    println!(
        "planted {}: caught on seed {seed} after {} runs ({how}: slow copies keep the copy from staging buffer j pending while the host refills it); clean control equals resident",
        bug.name(),
        seed + 1
    );
}

/// Sets the process's staging ring size for one test, and the default
/// back when dropped (the suite runs one test at a time: `cargo xtask
/// gpu-test` and the device calls pass `--test-threads 1`).
struct RingSize;

impl RingSize {
    fn set(bytes: u64) -> Self {
        offload_core::budget::host::set_staging_ring_bytes(bytes);
        Self
    }
}

impl Drop for RingSize {
    fn drop(&mut self) {
        offload_core::budget::host::set_staging_ring_bytes(
            offload_core::budget::host::STAGING_RING_BYTES,
        );
    }
}

/// Every master staged through a ring of parts (CONTRACT §7c) on the GPU:
/// the process's ring set to 4 MiB, so blocks of up to 6 MiB pass through
/// 512 KiB buffers (thirteen parts raw, about nine coded; with every
/// master staged and no host budget the ring holds two blocks' worth, 25
/// buffers), raw and coded: bit-identical to
/// resident unperturbed and under perturbation at depth 1 and 2, the
/// page-locked peak offload-cuda counts within the ring and one upload
/// buffer; and the planted
/// `HostStagingReuseBeforeCopy` (a buffer refilled before the copy of its
/// last part), `StagedReadyAfterFirstPart` (compute reads the slot while
/// later parts land) and `StagedReadyUnrecorded` (compute waits for a slot
/// whose queued parts are not issued yet) change the output under slow
/// copies, beside clean controls. Depth 4 queues several prefetches
/// behind one another.
#[test]
fn staged_layerwise_in_parts_is_bit_identical_on_the_gpu() {
    let Some(g) = gpu() else { return };
    let _ring = RingSize::set(4 << 20);
    let rig = Rig::trained(&g.device, pipeline(), Law::Normal);
    rig.warm_up();
    let p = &rig.pipeline;
    let resident = measured_run(&rig, Strategy::Resident);
    let staged = Strategy::Staged { depth: 1 };
    let coded = Strategy::StagedLossless { depth: 1 };
    // The coded-block file first (its encode pins nothing).
    drop(rig.platform_for(coded, 42, &[]));
    let b = memory_bounds(p, &staged.config(), 1).unwrap();
    let largest = blocks_of(p, p.module_id("transformer").unwrap())
        .into_iter()
        .map(|m| p.subtree_bytes(m))
        .max()
        .unwrap_or(0);
    let layout = offload_core::budget::host::staging_layout(largest, false);
    assert!(
        layout.part_bytes < largest && b.host_staging_bytes == layout.bytes(),
        "a ring of parts ({} buffers of {} B, counted {} B) for blocks of up to {largest} B",
        layout.buffers,
        layout.part_bytes,
        b.host_staging_bytes
    );
    for strategy in [staged, coded] {
        rig.settle();
        let locked_before = offload_cuda::host_locked();
        offload_cuda::reset_host_locked_peak();
        let out = measured_run(&rig, strategy);
        let locked = offload_cuda::host_locked();
        let held =
            locked.peak_bytes - (locked_before.pinned_bytes + locked_before.registered_bytes);
        println!(
            "{strategy:?} in parts: page-locked peak {held} B beyond the rig's (ring {} B + upload {} B; largest block {largest} B)",
            b.host_staging_bytes,
            b.staging_bytes - b.host_staging_bytes,
        );
        assert_eq!(
            out.outputs, resident.outputs,
            "{strategy:?} in parts vs resident"
        );
        if strategy == coded {
            assert_eq!(rig.codec().take_error().unwrap(), 0, "decoder flag");
        }
        assert!(
            held <= b.staging_bytes,
            "{strategy:?}: page-locked peak {held} B > ring + upload {} B",
            b.staging_bytes
        );
    }
    let seeds = if under_sanitizer() { 1 } else { 3 };
    for seed in 0..seeds {
        let weights = 9700 + seed;
        let expected = timing_run(&rig, Strategy::Resident, weights, &[], None).unwrap();
        for depth in [1, 2, 4] {
            for strategy in [
                Strategy::Staged { depth },
                Strategy::StagedLossless { depth },
            ] {
                let got = timing_run(&rig, strategy, weights, &[], Some(wide(seed)));
                assert_eq!(
                    got,
                    Ok(expected.clone()),
                    "{strategy:?} in parts, perturbation seed {seed}"
                );
            }
            assert_eq!(rig.codec().take_error().unwrap(), 0, "decoder flag");
        }
    }
    println!(
        "perturbed: staged layerwise in parts, raw and coded, depths 1, 2 and 4 equal resident on {seeds} seeds"
    );
    if under_sanitizer() {
        return;
    }
    for (bug, base) in [
        (PlantedBug::HostStagingReuseBeforeCopy, 32_000),
        (PlantedBug::StagedReadyAfterFirstPart, 33_000),
        (PlantedBug::StagedReadyUnrecorded, 34_000),
    ] {
        let (bug, seed, how) = planted_staging_bug_is_caught(&rig, staged, bug, base);
        println!(
            "planted {} in parts: caught on seed {seed} after {} runs ({how}); clean control equals resident",
            bug.name(),
            seed + 1
        );
    }
}

/// A planted staging bug (`HostStagingReuseBeforeCopy`,
/// `StagedReadyAfterFirstPart`, `StagedReadyUnrecorded`) under `strategy` (a staged one) with slow
/// copies, weights `base + seed`: the first seed on which the output
/// differs from resident or the run fails, and how; then its clean control
/// (the same weights and perturbation, no bug) must equal resident.
/// Panics where no seed catches it.
fn planted_staging_bug_is_caught(
    rig: &Rig,
    strategy: Strategy,
    bug: PlantedBug,
    base: u64,
) -> (PlantedBug, u64, String) {
    let weights = |seed: u64| base + seed;
    let mut caught = None;
    for seed in 0..PLANTED_SEEDS {
        let got = timing_run(rig, strategy, weights(seed), &[bug], Some(slow()));
        if rig.trained.is_some() {
            // A decoder's flag raised by the planted run is its own.
            let _ = rig.codec().take_error();
        }
        let expected = timing_run(rig, Strategy::Resident, weights(seed), &[], None).unwrap();
        match got {
            Ok(o) if o == expected => continue,
            Ok(_) => caught = Some((seed, "output differs from resident".to_owned())),
            Err(e) => caught = Some((seed, format!("the run failed: {e}"))),
        }
        break;
    }
    let (seed, how) = caught.unwrap_or_else(|| {
        panic!(
            "planted {} under {strategy:?}: NOT caught in {PLANTED_SEEDS} runs",
            bug.name()
        )
    });
    let control = timing_run(rig, strategy, weights(seed), &[], Some(slow()));
    let expected = timing_run(rig, Strategy::Resident, weights(seed), &[], None).unwrap();
    assert_eq!(
        control,
        Ok(expected),
        "clean control of {} under {strategy:?}",
        bug.name()
    );
    (bug, seed, how)
}

/// Coded blocks left pageable (CONTRACT §7b with §7c), on the GPU: every
/// master staged (`pin_cpu_memory = false`) with `"lossless"` over a
/// coded-block file of the trained weights, so each block's coded bytes
/// are copied into the pinned host staging ring, then to the device
/// staging buffer and decoded: bit-identical to resident unperturbed and
/// under perturbation (depth 1 and 2), the decoder's flag clear, the
/// page-locked peak no more than the ring and the upload buffer; and the
/// planted `HostStagingReuseBeforeCopy` is caught on the coded path,
/// beside a clean control.
#[test]
fn coded_staged_layerwise_is_bit_identical_and_pins_only_its_ring_on_the_gpu() {
    let Some(g) = gpu() else { return };
    let rig = Rig::trained(&g.device, pipeline(), Law::Normal);
    rig.warm_up();
    let p = &rig.pipeline;
    let resident = measured_run(&rig, Strategy::Resident);
    let staged = Strategy::StagedLossless { depth: 1 };
    // The coded-block file first (its encode pins nothing).
    drop(rig.platform_for(staged, 42, &[]));
    rig.settle();
    let locked_before = offload_cuda::host_locked();
    offload_cuda::reset_host_locked_peak();
    let before = rig.codec().stats();
    let out = measured_run(&rig, staged);
    let stats = rig.codec().stats();
    let locked = offload_cuda::host_locked();
    // The blocks really streamed coded (a silent fall back to raw staging,
    // a stale file say, would still be bit-identical).
    let (coded, decoded) = (
        stats.coded_bytes - before.coded_bytes,
        stats.decoded_bytes - before.decoded_bytes,
    );
    println!(
        "{staged:?}: {} decodes, {coded} coded of {decoded} decoded bytes",
        stats.decodes - before.decodes
    );
    assert!(stats.decodes > before.decodes, "no block decoded");
    assert!(
        (coded as f64) < 0.75 * decoded as f64,
        "{coded} coded of {decoded} bytes"
    );
    let b = memory_bounds(p, &Strategy::Staged { depth: 1 }.config(), 1).unwrap();
    let held = locked.peak_bytes - (locked_before.pinned_bytes + locked_before.registered_bytes);
    println!(
        "{staged:?}: page-locked peak {held} B beyond the rig's (ring bound {} B + upload {} B; one copy of the streamed blocks {} B)",
        b.host_staging_bytes,
        b.staging_bytes - b.host_staging_bytes,
        b.offloaded_bytes
    );
    assert_eq!(out.outputs, resident.outputs, "coded staged vs resident");
    assert_eq!(rig.codec().take_error().unwrap(), 0, "decoder flag");
    assert!(
        held <= b.staging_bytes,
        "page-locked peak {held} B > ring + upload {} B",
        b.staging_bytes
    );
    let seeds = if under_sanitizer() { 1 } else { 3 };
    for seed in 0..seeds {
        let weights = 9500 + seed;
        let expected = timing_run(&rig, Strategy::Resident, weights, &[], None).unwrap();
        for depth in [1, 2] {
            let strategy = Strategy::StagedLossless { depth };
            let got = timing_run(&rig, strategy, weights, &[], Some(wide(seed)));
            assert_eq!(
                got,
                Ok(expected.clone()),
                "{strategy:?} perturbation seed {seed}"
            );
            assert_eq!(rig.codec().take_error().unwrap(), 0, "decoder flag");
        }
    }
    println!("perturbed: coded staged layerwise depth 1 and 2 equal resident on {seeds} seeds");
    if under_sanitizer() {
        return;
    }
    let (bug, seed, how) =
        planted_staging_bug_is_caught(&rig, staged, PlantedBug::HostStagingReuseBeforeCopy, 31_000);
    println!(
        "planted {} on the coded staged path: caught on seed {seed} after {} runs ({how}); clean control equals resident",
        bug.name(),
        seed + 1
    );
}

/// One DiT block's forward on its own; no host synchronisation.
fn gpu_block(rt: &Runtime<Cuda>, proxy: &Proxy, block: ModuleId) -> Result<(), OffloadError> {
    let p = &rt.model().pipeline;
    let rel = p.module(block).path["transformer.".len()..].to_owned();
    let tensors = p.subtree_tensors(block);
    rt.forward("transformer", |dit| {
        dit.child(&rel, |blk| block_body(blk, proxy, &tensors))?;
        Ok(())
    })?;
    Ok(())
}

/// Every perturbation point spins its stream for up to 5 ms: copies are
/// slow.
fn slow() -> Perturbation {
    Perturbation {
        seed: 11,
        probability: 1.0,
        max_spin_ns: 5_000_000,
        max_host_delay_us: 0,
    }
}

#[test]
fn drop_while_enabled_leaks_nothing() {
    let Some(g) = gpu() else { return };
    let rig = Rig::new(&g.device, pipeline());
    for strategy in [LAYERWISE, Strategy::ModelLevel] {
        let before = rig.settle();
        {
            let platform = rig.platform(5, 1, &[]);
            let mut rt = rig.runtime();
            rt.enable(strategy.backend(&platform).unwrap())
                .map_err(|(e, _)| e)
                .unwrap();
            rig.device.set_perturbation(Some(slow())).unwrap();
            if strategy == LAYERWISE {
                // Block 0's pre-forward starts block 1's (slow) fill.
                gpu_block(&rt, &rig.proxy, rig.dit_blocks()[0]).unwrap();
            } else {
                // The DiT's bring-in copies are slow.
                component(&rt, &rig.proxy, "transformer").unwrap();
            }
            // Dropped enabled, work in flight: the backend drains first.
            drop(rt);
        }
        rig.device.set_perturbation(None).unwrap();
        assert_eq!(rig.settle(), before, "{strategy:?}: device memory leaked");
        println!("{strategy:?}: dropped while enabled with copies in flight; nothing leaked");
    }
}

#[test]
fn drop_panic_inside_a_forward_leaks_nothing() {
    let Some(g) = gpu() else { return };
    let rig = Rig::new(&g.device, pipeline());
    for strategy in [LAYERWISE, Strategy::ModelLevel] {
        let before = rig.settle();
        println!("{strategy:?}: a deliberate panic follows");
        let unwound = catch_unwind(AssertUnwindSafe(|| {
            let platform = rig.platform(6, 1, &[]);
            let mut rt = rig.runtime();
            rt.enable(strategy.backend(&platform).unwrap())
                .map_err(|(e, _)| e)
                .unwrap();
            rig.device.set_perturbation(Some(slow())).unwrap();
            let blocks = rig.dit_blocks();
            let rel = rig.pipeline.module(blocks[1]).path["transformer.".len()..].to_owned();
            let tensors = rig.pipeline.subtree_tensors(blocks[1]);
            let _ = rt.forward("transformer", |dit| {
                dit.child(&rel, |blk| -> Result<(), BoxError> {
                    block_body(blk, &rig.proxy, &tensors)?;
                    panic!("a kernel launcher panicked inside a block's forward");
                })?;
                Ok(())
            });
        }));
        assert!(unwound.is_err(), "the panic reached catch_unwind");
        rig.device.set_perturbation(None).unwrap();
        assert_eq!(rig.settle(), before, "{strategy:?}: device memory leaked");
    }
}

#[test]
fn drop_buffers_outliving_their_device() {
    let Some(Gpu {
        device,
        _one_at_a_time,
    }) = gpu()
    else {
        return;
    };
    // A second handle keeps the primary context alive throughout, so the
    // memory comes back through the buffers' own drops, not a teardown.
    let witness = CudaDevice::new(0).unwrap();
    witness.synchronize().unwrap();
    witness.trim_pool().unwrap();
    let before = witness.pool_used().unwrap().0;
    let s = device.create_stream().unwrap();
    let dev = device.alloc_device(3 << 20).unwrap();
    let mut pinned = device.alloc_pinned(1 << 20).unwrap();
    pinned.write_from(0, 1 << 20, &vec![7u8; 1 << 20]);
    let reg = device
        .register_host(Box::new(vec![9u8; 1 << 20]))
        .map_err(|e| e.error)
        .unwrap();
    // Copies still queued behind a spin when everything is dropped.
    device.spin(&s, 2_000_000).unwrap();
    // SAFETY: in bounds; the drops below drain the device before freeing.
    unsafe {
        device
            .copy_h2d(&s, HostSource::Registered(&reg), 0, &dev, 0, 1 << 20)
            .unwrap();
        device
            .copy_h2d(&s, HostSource::Pinned(&pinned), 0, &dev, 1 << 20, 1 << 20)
            .unwrap();
    }
    drop(device);
    // Only the buffers, the registration and the stream hold its context.
    drop(dev);
    drop(pinned);
    drop(reg);
    drop(s);
    witness.synchronize().expect("no CUDA error");
    witness.trim_pool().unwrap();
    assert_eq!(
        witness.pool_used().unwrap().0,
        before,
        "dropped buffers are freed"
    );
}

/// One request on the GPU: encoder, `steps` DiT forwards, VAE; the output.
fn gpu_request(rt: &Runtime<Cuda>, proxy: &Proxy, steps: usize) -> Result<u64, OffloadError> {
    proxy.reset(rt.compute_stream()).unwrap();
    component(rt, proxy, "text_encoder")?;
    for _ in 0..steps {
        component(rt, proxy, "transformer")?;
    }
    component(rt, proxy, "vae")?;
    Ok(proxy.read_output().unwrap())
}

/// One DiT block's forward on its own; its output.
fn gpu_block_output(
    rt: &Runtime<Cuda>,
    proxy: &Proxy,
    block: ModuleId,
) -> Result<u64, OffloadError> {
    proxy.reset(rt.compute_stream()).unwrap();
    gpu_block(rt, proxy, block)?;
    Ok(proxy.read_output().unwrap())
}

/// The simulator's seeded scenarios on the GPU: generated pipelines of 1–80
/// blocks with mixed dtypes, tied weights and non-persistent buffers, the
/// generated configuration and operations (enable, requests with skipped
/// blocks, repeated requests, single blocks, disable), against a resident
/// twin on the same GPU, the offloaded runtime under timing perturbation
/// (seeded by the scenario) and the twin unperturbed. (Fault injection is
/// the simulator's; none here.)
#[test]
fn seeded_scenarios_on_cuda_under_perturbation() {
    let Some(g) = gpu() else { return };
    let d = &g.device;
    let scenarios = if under_sanitizer() { 4 } else { 12 };
    for seed in 0..scenarios {
        let (scenario, ops) = offload_tests::scenario::seeded(seed);
        let pipeline = offload_tests::scenario::build(&scenario.spec);
        let stream = Arc::new(d.create_stream().unwrap());
        let proxy = Proxy::new(d, Arc::clone(&stream), INPUT_BYTES, OUTPUT_BYTES).unwrap();
        let weights = Arc::new(FiniteWeights(SyntheticWeights {
            seed: scenario.seed,
        }));
        let platform =
            CorePlatform::<Cuda>::new("cuda", Arc::clone(d), Arc::clone(&stream), weights)
                .with_prefetch_depth(scenario.depth);
        let skip = Arc::new(Mutex::new(BTreeSet::new()));
        let blocks = blocks_of(&pipeline, pipeline.module_id("transformer").unwrap());
        let runtime = || {
            let mut rt = Runtime::new(Arc::clone(d), Arc::clone(&stream), pipeline.clone());
            BlockCache::install(rt.model_mut(), &blocks, &skip);
            rt
        };
        let perturbation = Perturbation {
            seed,
            probability: 0.25,
            max_spin_ns: 1_000_000,
            max_host_delay_us: 50,
        };
        let perturbed = |on: bool| {
            d.set_perturbation(on.then_some(perturbation)).unwrap();
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
                    perturbed(true);
                    let result = offloaded.enable(backend);
                    perturbed(false);
                    match result {
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
                    perturbed(true);
                    let got = gpu_request(&offloaded, &proxy, *steps);
                    perturbed(false);
                    skip.lock().unwrap().clear();
                    assert_eq!(got.unwrap(), expected, "{context}");
                }
                offload_tests::scenario::Op::Block { index } if enabled => {
                    let block = blocks[index % blocks.len()];
                    let expected = gpu_block_output(&resident, &proxy, block).unwrap();
                    perturbed(true);
                    let got = gpu_block_output(&offloaded, &proxy, block);
                    perturbed(false);
                    assert_eq!(got.unwrap(), expected, "{context}");
                }
                _ => {}
            }
        }
        if enabled {
            offloaded.disable().unwrap();
        }
        resident.disable().unwrap();
        proxy.free().unwrap();
        d.synchronize().expect("no CUDA error");
    }
}

/// A safetensors checkpoint streamed by layerwise offload on the GPU: every
/// block is a window of the file's mapping, and the file is registered
/// once (read-only) for all of them, whatever pages the windows share;
/// every view the device lends holds the file's bytes; `disable`
/// unregisters the file with its last window, so a second `enable`
/// registers it again in place.
#[test]
fn checkpoint_windows_register_once_and_lend_the_files_bytes() {
    use offload_safetensors::{Checkpoint, NameMap, SafetensorsSource};
    let Some(g) = gpu() else { return };
    let d = Arc::clone(&g.device);
    // Blocks of odd sizes, so that neighbours share pages.
    let dir = std::env::temp_dir().join(format!("offload-gpu-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.safetensors");
    let mut tensors = Vec::new();
    for i in 0..6u64 {
        for (name, n) in [("a", 1_000_003u64), ("b", 77_777)] {
            let bytes: Vec<u8> = (0..n * 2).map(|k| (k * 31 + i * 7 + n) as u8).collect();
            tensors.push((format!("blocks.{i}.{name}"), DType::Bf16, vec![n], bytes));
        }
    }
    tensors.push((
        "head.w".to_owned(),
        DType::Bf16,
        vec![4099],
        vec![5u8; 8198],
    ));
    offload_safetensors::write_file(&file, &tensors).unwrap();
    let ckpt = Arc::new(Checkpoint::open(&file).unwrap());
    let mut b = PipelineBuilder::new("Checkpoint");
    {
        let mut m = b.module("dit");
        ckpt.declare(&mut m, "").unwrap();
        m.block_containers(&["blocks"]);
    }
    b.declare_components(offload_core::ComponentDeclaration {
        dit: vec!["dit".into()],
        ..Default::default()
    });
    let pipeline = b.build().unwrap();
    let source = Arc::new(
        SafetensorsSource::new(
            &pipeline,
            vec![(Arc::clone(&ckpt), NameMap::prefix("dit.", ""))],
        )
        .unwrap(),
    );
    let compute = Arc::new(d.create_stream().unwrap());
    let platform = CorePlatform::<Cuda>::new(
        "cuda",
        Arc::clone(&d),
        Arc::clone(&compute),
        Arc::clone(&source) as Arc<dyn offload_core::runtime::WeightSource>,
    );
    let config = OffloadConfig {
        enable_layerwise_offload: true,
        ..Default::default()
    };
    let mut rt = Runtime::new(Arc::clone(&d), Arc::clone(&compute), pipeline);
    for round in 0..2 {
        rt.enable(Box::new(platform.layerwise(config.clone()).unwrap()))
            .map_err(|(e, _)| e)
            .unwrap();
        let file_len = std::fs::metadata(&file).unwrap().len() as usize;
        assert_eq!(
            d.shared_registrations(),
            vec![(file_len, 6)],
            "round {round}: the file registered once, for its 6 block windows"
        );
        // Every lent view holds the file's bytes (copied back through the device).
        rt.forward("dit", |dit| {
            for i in 0..6 {
                dit.child(&format!("blocks.{i}"), |blk| {
                    for view in blk.views()? {
                        let range = view.byte_range();
                        let n = range.end - range.start;
                        let mut host = d.alloc_pinned(n)?;
                        // SAFETY: the view's range in its buffer, lent for this scope; the
                        // stream is synchronised before `host` is read or freed.
                        unsafe {
                            d.copy_d2h(blk.stream(), view.buffer(), range.start, &mut host, 0, n)?
                        };
                        d.synchronize_stream(blk.stream())?;
                        let mut got = vec![0u8; n as usize];
                        host.read_into(0, &mut got);
                        // SAFETY: synchronised above.
                        unsafe { d.free_pinned(host)? };
                        let name = format!("blocks.{i}.{}", view.tensor().name);
                        assert_eq!(Some(&got[..]), ckpt.bytes(&name), "round {round}: `{name}`");
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
        .unwrap();
        rt.disable().unwrap();
        assert_eq!(
            d.shared_registrations(),
            vec![],
            "round {round}: disable unregisters the file with its last window"
        );
    }
    let (windows, copies) = source.windows_and_copies();
    assert_eq!(
        (windows, copies),
        (14, 0),
        "per enable, 6 block windows and the head's, registered to stage its upload"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pipeline whose every unit is a whole number of allocator granules
/// (bf16 weights of 1,024 columns and 1,024·k rows, 2 MiB each k): the
/// pool's counters are then exact and a phase's device bytes are its bound
/// to the byte. A DiT of 5 blocks of 24 MiB and 6 of 4–8 MiB (heterogeneous,
/// an odd ring), an encoder of 8 MiB outside its 3 blocks of 2 MiB, a VAE
/// of 4 MiB without blocks.
fn granular_pipeline() -> Pipeline {
    let d = 1024u64;
    let mut b = PipelineBuilder::new("GranularPipeline");
    {
        let mut t = b.module("transformer");
        t.parameter("x_embedder.weight", DType::Bf16, &[d, d]);
        t.list("transformer_blocks", 5, |_, blk| {
            blk.parameter("attn.to_qkv.weight", DType::Bf16, &[3 * d, d])
                .parameter("attn.to_out.weight", DType::Bf16, &[d, d])
                .parameter("ff.up.weight", DType::Bf16, &[4 * d, d])
                .parameter("ff.down.weight", DType::Bf16, &[d, 4 * d]);
        });
        t.list("single_transformer_blocks", 6, |i, blk| {
            blk.parameter("proj_mlp.weight", DType::Bf16, &[d * (2 + i as u64 % 3), d]);
        });
        t.parameter("proj_out.weight", DType::Bf16, &[d, d]);
        t.block_containers(&["transformer_blocks", "single_transformer_blocks"]);
    }
    {
        let mut e = b.module("text_encoder");
        e.parameter("embed.weight", DType::Bf16, &[4 * d, d]);
        e.list("layers", 3, |_, l| {
            l.parameter("fc.weight", DType::Bf16, &[d, d]);
        });
        e.block_containers(&["layers"]);
    }
    b.module("vae")
        .parameter("decoder.weight", DType::Bf16, &[2 * d, d]);
    b.declare_components(ComponentDeclaration {
        dit: vec!["transformer".into()],
        encoder: vec!["text_encoder".into()],
        vae: vec!["vae".into()],
        resident: vec![],
    });
    b.build().expect("builds")
}

/// One request: the encoder, the DiT once per step, the VAE, with `phase`
/// called as each component's forward begins (`true`: inside it, after the
/// backend's pre-forward hooks brought its phase in) and after it ends.
fn planned_request(
    rt: &Runtime<Cuda>,
    proxy: &Proxy,
    steps: u32,
    phase: &mut dyn FnMut(&str, bool),
) -> Result<(), OffloadError> {
    let mut run = |path: &str| {
        component_with(rt, proxy, path, &mut || phase(path, true))?;
        phase(path, false);
        Ok::<_, OffloadError>(())
    };
    run("text_encoder")?;
    for _ in 0..steps {
        run("transformer")?;
    }
    run("vae")
}

fn budget_config(bytes: u64) -> OffloadConfig {
    OffloadConfig {
        device_budget: Some(ByteSize::new(bytes).into()),
        ..OffloadConfig::default()
    }
}

/// What a planned run on the GPU measured: outputs, each phase's peak of
/// allocated bytes beyond what was allocated before enable (the pool's
/// high-water mark, reset once the phase has begun and every free enqueued
/// before has run: what the phase holds while it computes, with the held
/// sets it should have evicted and the slots it should have freed, not
/// the instant of the swap, which the simulator's exact counters check),
/// what the plan was.
struct PlannedRun {
    outputs: Vec<u64>,
    peaks: std::collections::BTreeMap<String, u64>,
    plan: offload_core::budget::RequestPlan,
    inputs: offload_core::budget::PlannerInputs,
}

/// Two requests of `steps` steps under `budget` bytes, the planner given
/// `inputs` or warming up (a request of 2 steps through the runtime's
/// registered request), `bugs` planted.
fn planned_run(
    rig: &Rig,
    budget: u64,
    steps: u32,
    inputs: Option<offload_core::budget::PlannerInputs>,
    bugs: &[PlantedBug],
) -> Result<PlannedRun, String> {
    planned_run_within(rig, budget_config(budget), steps, inputs, bugs)
}

/// [`planned_run`] under `config` (a device budget, and a host budget
/// beside it where one is set).
fn planned_run_within(
    rig: &Rig,
    config: OffloadConfig,
    steps: u32,
    inputs: Option<offload_core::budget::PlannerInputs>,
    bugs: &[PlantedBug],
) -> Result<PlannedRun, String> {
    let device = &rig.device;
    let mut rt = rig.runtime();
    let proxy = Arc::clone(&rig.proxy);
    rt.set_request(move |rt, shape| {
        planned_request(rt, &proxy, shape.steps, &mut |_, _| ())?;
        Ok(())
    });
    let mut platform = rig
        .platform(42, 1, bugs)
        .with_request(RequestShape::new(TOKENS, steps));
    if let Some(inputs) = inputs {
        platform.set_planner(inputs);
    }
    let allocated_before = rig.settle();
    let backend = platform.planned(config).map_err(|e| e.to_string())?;
    rt.enable(Box::new(backend))
        .map_err(|(e, _)| e.to_string())?;
    let plan = rt.request_plan().cloned().ok_or("no request plan")?;
    let inputs = rt.planner_inputs().cloned().ok_or("no planner inputs")?;
    let mut peaks = std::collections::BTreeMap::<String, u64>::new();
    let mut outputs = Vec::new();
    let mut failed = None;
    for _ in 0..2 {
        rig.proxy.reset(&rig.stream).unwrap();
        let mut phase = |path: &str, begins: bool| {
            device.synchronize().unwrap();
            if begins {
                device.reset_pool_high().unwrap();
            } else {
                let high = device
                    .pool_used()
                    .unwrap()
                    .1
                    .saturating_sub(allocated_before);
                let peak = peaks.entry(path.to_owned()).or_default();
                *peak = (*peak).max(high);
            }
        };
        if let Err(e) = planned_request(&rt, &rig.proxy, steps, &mut phase) {
            failed = Some(e.to_string());
            break;
        }
        outputs.push(rig.proxy.read_output().unwrap());
    }
    rt.disable().map_err(|e| e.to_string())?;
    let after = rig.settle();
    if let Some(e) = failed {
        return Err(e);
    }
    if after != allocated_before {
        return Err(format!(
            "leaked {} bytes",
            after as i64 - allocated_before as i64
        ));
    }
    Ok(PlannedRun {
        outputs,
        peaks,
        plan,
        inputs,
    })
}

/// Each phase's peak within its INV-7 bound (from the plan's choices by
/// `plan_bounds`, not from the planner's report) and within the budget;
/// the first phase over, as a message.
fn phases_within_bounds(p: &Pipeline, budget: u64, run: &PlannedRun) -> Result<(), String> {
    let bounds = plan_bounds(p, &budget_config(budget), &run.plan).map_err(|e| e.to_string())?;
    let by_phase = bounds.by_phase();
    for (phase, peak) in &run.peaks {
        let bound = by_phase
            .get(phase)
            .ok_or(format!("phase {phase} not in the plan"))?;
        if peak > bound || *peak > budget {
            return Err(format!(
                "phase {phase}: {peak} device bytes > its bound {bound} (budget {budget})"
            ));
        }
    }
    Ok(())
}

/// Two requests of `steps` steps with every weight resident: the outputs
/// a planned run must give.
fn planned_resident(rig: &Rig, steps: u32) -> Vec<u64> {
    let mut rt = rig.runtime();
    let platform = rig.platform(42, 1, &[]);
    let allocated_before = rig.settle();
    rt.enable(platform.resident().unwrap())
        .map_err(|(e, _)| e)
        .unwrap();
    let mut outputs = Vec::new();
    for _ in 0..2 {
        rig.proxy.reset(&rig.stream).unwrap();
        planned_request(&rt, &rig.proxy, steps, &mut |_, _| ()).unwrap();
        outputs.push(rig.proxy.read_output().unwrap());
    }
    rt.disable().unwrap();
    assert_eq!(rig.settle(), allocated_before);
    outputs
}

/// The granular pipeline's rig on `gpu`, its pipeline, its weights' device
/// bytes, the resident outputs of two requests of `steps` steps, and a
/// first planned run through its own warm-up under a budget with room for
/// everything.
fn planned_setup(gpu: &Gpu, steps: u32) -> (Rig, Pipeline, u64, Vec<u64>, PlannedRun) {
    let rig = Rig::new(&gpu.device, granular_pipeline());
    rig.warm_up();
    let p = rig.pipeline.clone();
    let total = memory_bounds(&p, &OffloadConfig::default(), 1)
        .unwrap()
        .device_weight_bytes;
    let resident = planned_resident(&rig, steps);
    let first = planned_run(&rig, 2 * total, steps, None, &[]).unwrap();
    (rig, p, total, resident, first)
}

/// A host budget beside the device budget on the GPU (CONTRACT §7c): under
/// a device budget with room for everything and one halfway from the
/// least, at the least host budget the planner names there and halfway to
/// every weight (from the first run's measurements), and once through a
/// warm-up at what it needs (the store following the plan's host side
/// after it): two requests give the resident outputs, every phase within
/// its bound, and the page-locked peak offload-cuda counts beyond the
/// rig's own stays within the host budget (kept sets uploaded from
/// pageable memory, streamed blocks staged beyond it). Planted: the store
/// pins what the plan stages, and the device's count goes over.
#[test]
fn planned_host_budget_stages_within_it_on_the_gpu() {
    let Some(gpu) = gpu() else { return };
    const STEPS: u32 = 3;
    let (rig, p, total, resident, first) = planned_setup(&gpu, STEPS);
    let within = |device: u64, host: u64| OffloadConfig {
        host_budget: Some(offload_core::bytes::HostBudget::Bytes(ByteSize::new(host))),
        ..budget_config(device)
    };
    let one_byte = || offload_core::budget::HostLimits {
        budget: 1,
        source: "1 B".to_owned(),
        readings: None,
    };
    // The least host budget within a device budget (from the planner's
    // typed error), and the warm-up's (it keeps nothing).
    let least_host = |device: u64| match offload_core::budget::plan_within(
        &p,
        &within(device, 1),
        &first.inputs,
        offload_core::budget::DeviceMemory::of(u64::MAX / 4),
        Some(one_byte()),
    ) {
        Err(offload_core::budget::BudgetError::HostDoesNotFit { least, .. }) => least,
        other => panic!("a 1-byte host budget: {other:?}"),
    };
    let warmup_least = match offload_core::budget::smallest_footprint_within(
        &p,
        &within(2 * total, 1),
        Some(one_byte()),
    ) {
        Err(offload_core::budget::BudgetError::WarmupHostDoesNotFit { least, .. }) => least,
        other => panic!("a 1-byte host budget at the warm-up: {other:?}"),
    };
    let least_device = first.plan.minimum.bytes;
    let mut rows = Vec::new();
    let measure = |device: u64, host: u64, warm: bool, bugs: &[PlantedBug]| {
        rig.settle();
        let before = offload_cuda::host_locked();
        offload_cuda::reset_host_locked_peak();
        let inputs = (!warm).then(|| first.inputs.clone());
        let run = planned_run_within(&rig, within(device, host), STEPS, inputs, bugs)
            .unwrap_or_else(|e| panic!("device {device}, host {host}, {bugs:?}: {e}"));
        let locked = offload_cuda::host_locked();
        let held = locked.peak_bytes - (before.pinned_bytes + before.registered_bytes);
        assert_eq!(
            run.outputs, resident,
            "device {device}, host {host}: outputs"
        );
        (run, held)
    };
    for device in [2 * total, (least_device + total) / 2] {
        let least = least_host(device);
        for (host, warm) in [
            (least, false),
            ((least + total) / 2, false),
            (warmup_least.max(least), true),
        ] {
            let (run, held) = measure(device, host, warm, &[]);
            let side = run.plan.host.clone().expect("a host side");
            phases_within_bounds(&p, device, &run).unwrap();
            assert!(
                held <= host,
                "device {device}, host {host}: page-locked peak {held} B over the host budget\n{}",
                run.plan
            );
            rows.push(format!(
                "device {device} B, host {host} B{}: page-locked peak {held} B (plan {} B: swapped held {} B pinned, kept {} B staged, {} streamed blocks staged, ring {} B; fills priced at {})",
                if warm { " (warm-up)" } else { "" },
                side.peak_bytes,
                side.held_bytes,
                side.kept_staged_bytes,
                side.staged_blocks.len(),
                side.staging_bytes,
                side.fill_bytes_per_s
                    .map_or("the link (unmeasured)".to_owned(), |r| format!("{:.1} GB/s", r / 1e9))
            ));
        }
    }
    // Planted: the store pins what the plan stages; the device's own count
    // goes over the host budget (the run itself stays bit-identical).
    let bug = PlantedBug::PlannedPinsStagedBlocks;
    let device = (least_device + total) / 2;
    let least = least_host(device);
    assert!(least < total, "{least} B");
    let (_, held) = measure(device, least, false, &[bug]);
    assert!(
        held > least,
        "planted {bug:?}: page-locked peak {held} B within the host budget {least} B: not caught"
    );
    rows.push(format!(
        "planted {}: page-locked peak {held} B > host budget {least} B: caught",
        bug.name()
    ));
    for r in rows {
        println!("{r}");
    }
}

/// The planned backend on the GPU (CONTRACT §7a, §9): the warm-up measures
/// this device (a positive link, every block's compute), the planner's
/// least budget is below the pipeline's weights, and at the least budget
/// and halfway to everything resident two requests give the resident
/// outputs with every phase's allocated bytes within the phase's bound
/// (exact here: every unit is whole granules) and the budget. Planted: the
/// held set of the phase before not evicted, a phase's slot pool kept into
/// the next: both caught by the same per-phase check.
#[test]
fn planned_budgets_fit_every_phase_on_the_gpu() {
    let Some(gpu) = gpu() else { return };
    const STEPS: u32 = 3;
    // The warm-up, at a budget with room for everything.
    let (rig, p, total, resident, first) = planned_setup(&gpu, STEPS);
    let inputs = first.inputs.clone();
    assert!(
        matches!(
            inputs.source,
            offload_core::measurements::InputSource::Warmup { .. }
        ),
        "the warm-up measured: {:?}",
        inputs.source
    );
    assert!(
        inputs.link_bytes_per_s > 1e9,
        "link {}",
        inputs.link_bytes_per_s
    );
    let dit = &inputs.components["transformer"];
    assert_eq!(dit.block_compute_s.len(), 11, "every DiT block timed");
    assert!(dit.block_compute_s.values().all(|t| *t > 0.0));
    assert_eq!(first.outputs, resident, "planned (room for all) = resident");
    phases_within_bounds(&p, 2 * total, &first).unwrap();

    let least = first.plan.minimum.bytes;
    assert!(least < total, "least budget {least} < all weights {total}");
    let mut table = Vec::new();
    for budget in [least, (least + total) / 2] {
        let run = planned_run(&rig, budget, STEPS, Some(inputs.clone()), &[]).unwrap();
        assert_eq!(run.outputs, resident, "budget {budget}: outputs");
        assert!(
            matches!(
                run.plan.source,
                offload_core::measurements::InputSource::Warmup { .. }
            ),
            "the saved measurements plan it"
        );
        assert!(
            run.plan
                .components
                .iter()
                .any(|c| c.mode != ComponentMode::Resident),
            "budget {budget} < {total}: something offloads"
        );
        phases_within_bounds(&p, budget, &run).unwrap();
        table.push((budget, run.peaks));
    }
    for bug in [
        PlantedBug::SkipPhaseEviction,
        PlantedBug::KeepPoolAcrossPhases,
    ] {
        // The device has room for the bug's extra bytes: the run succeeds,
        // and only the per-phase check can see it.
        let run = planned_run(&rig, least, STEPS, Some(inputs.clone()), &[bug])
            .unwrap_or_else(|e| panic!("{bug:?} planted: the run failed instead: {e}"));
        let Err(caught) = phases_within_bounds(&p, least, &run) else {
            panic!("{bug:?} planted at {least} bytes: not caught");
        };
        println!("planted {bug:?}: caught: {caught}");
    }
    for (budget, peaks) in table {
        println!("budget {budget}: phase peaks {peaks:?}");
    }
}

/// `weight_compression = "lossless"` under a device budget on the GPU
/// (CONTRACT §7a, §7b), over trained-looking (normal) weights: the warm-up
/// measures the link, every block and the decoder, and learns each
/// block's coded size; at the least budget a lossless plan needs (which
/// counts two decode staging buffers) and halfway to everything, two
/// requests give the resident outputs, the DiT's streamed blocks stream
/// coded at under 0.8 of their bytes, the decoder's flag stays clean, and
/// every phase's allocated bytes stay within its INV-7 bound
/// (`plan_bounds`, which counts the staging) and the budget. Planted: a
/// phase that decodes nothing keeps the staging buffers of the phase
/// before; the per-phase check sees it.
#[test]
fn planned_lossless_is_bit_identical_within_each_phase_on_the_gpu() {
    let Some(gpu) = gpu() else { return };
    const STEPS: u32 = 3;
    let rig = Rig::trained(&gpu.device, granular_pipeline(), Law::Normal);
    rig.warm_up();
    let p = rig.pipeline.clone();
    let total = memory_bounds(&p, &OffloadConfig::default(), 1)
        .unwrap()
        .device_weight_bytes;
    let resident = planned_resident(&rig, STEPS);
    let lossless = |budget: u64| OffloadConfig {
        weight_compression: Some(WeightCompression::Lossless),
        ..budget_config(budget)
    };
    let first = planned_run_within(&rig, lossless(2 * total), STEPS, None, &[]).unwrap();
    assert_eq!(
        first.outputs, resident,
        "lossless (room for all) = resident"
    );
    let inputs = first.inputs.clone();
    let dit = &inputs.components["transformer"];
    assert_eq!(
        dit.coded_block_bytes.len(),
        11,
        "every DiT block has a coded size: {:?}",
        dit.coded_block_bytes
    );
    let rate = inputs.decode_bytes_per_s.expect("the decoder was measured");
    assert!(rate > 1e10, "decoder {rate} B/s");
    let least = first.plan.minimum.bytes;
    assert!(
        first.plan.minimum.parts.staging_bytes > 0,
        "the least lossless budget counts decode staging: {:?}",
        first.plan.minimum
    );
    let mut rows = vec![format!(
        "decoder {:.0} GB/s; least lossless budget {least} B ({} B of it decode staging); {} of {} DiT block bytes coded",
        rate / 1e9,
        first.plan.minimum.parts.staging_bytes,
        dit.coded_block_bytes.values().sum::<u64>(),
        p.storages().map(|(_, s)| s.bytes).sum::<u64>()
    )];
    for budget in [least, (least + total) / 2] {
        let run = planned_run_within(&rig, lossless(budget), STEPS, Some(inputs.clone()), &[])
            .unwrap_or_else(|e| panic!("budget {budget}: {e}"));
        assert_eq!(run.outputs, resident, "budget {budget}: outputs");
        assert_eq!(
            rig.codec().take_error().unwrap(),
            0,
            "budget {budget}: the decoder's flag"
        );
        phases_within_bounds(&p, budget, &run).unwrap();
        let c = run.plan.component("transformer").unwrap();
        assert!(
            !c.coded_blocks.is_empty() && (c.link_bytes as f64) < 0.8 * c.streamed_bytes as f64,
            "budget {budget}: {}",
            c.reason
        );
        rows.push(format!(
            "budget {budget} B: DiT {} of {} blocks streamed, {} coded, {} of {} bytes on the link per forward; phase peaks {:?}",
            c.streamed_blocks, c.blocks, c.coded_blocks.len(), c.link_bytes, c.streamed_bytes, run.peaks
        ));
    }
    let bug = PlantedBug::KeepDecodeStagingAcrossPhases;
    let run = planned_run_within(&rig, lossless(least), STEPS, Some(inputs.clone()), &[bug])
        .unwrap_or_else(|e| panic!("{bug:?} planted: the run failed instead: {e}"));
    let Err(caught) = phases_within_bounds(&p, least, &run) else {
        panic!("{bug:?} planted at {least} bytes: not caught");
    };
    rows.push(format!("planted {}: caught: {caught}", bug.name()));
    for r in rows {
        println!("{r}");
    }
}

/// Model level with `pin_cpu_memory = false` on the GPU (CONTRACT §6,
/// §7c): every swapped unit brought in from pageable memory at each of its
/// phases and every resident unit uploaded once, through one pinned upload
/// buffer: bit-identical to resident, within INV-7 on the allocator, the
/// page-locked peak beyond the rig's at most that buffer (nothing
/// registered), and bit-identical under perturbation. Planted: the staged
/// bring-in skipped (an unwritten buffer in its place) makes the output
/// differ.
#[test]
fn unpinned_model_level_is_bit_identical_and_pins_only_its_upload_buffer_on_the_gpu() {
    let Some(g) = gpu() else { return };
    let rig = Rig::new(&g.device, pipeline());
    rig.warm_up();
    let p = &rig.pipeline;
    let resident = measured_run(&rig, Strategy::Resident);
    let staged = Strategy::StagedModelLevel;
    rig.settle();
    let before = offload_cuda::host_locked();
    offload_cuda::reset_host_locked_peak();
    let out = measured_run(&rig, staged);
    let locked = offload_cuda::host_locked();
    let held = locked.peak_bytes - (before.pinned_bytes + before.registered_bytes);
    // The buffer of the largest unit (a block, or a component's weights
    // outside its blocks), at most 64 MiB: INV-7's declared staging.
    let b = memory_bounds(p, &staged.config(), 1).unwrap();
    let buffer = b.host_staging_bytes;
    assert!(buffer > 0 && buffer <= offload_core::budget::host::UPLOAD_STAGING_BYTES);
    println!(
        "{staged:?}: page-locked peak {held} B beyond the rig's (upload buffer at most {buffer} B; one copy of the swapped units {} B); allocator peak {} B (bound {} B)",
        b.offloaded_bytes,
        out.peak_allocated_bytes,
        staged.bound_bytes(p)
    );
    assert_eq!(
        out.outputs, resident.outputs,
        "unpinned model level vs resident"
    );
    assert!(
        held <= buffer,
        "page-locked peak {held} B > one upload buffer {buffer} B"
    );
    assert_eq!(
        locked.registered_bytes, before.registered_bytes,
        "nothing registered"
    );
    assert!(
        out.peak_allocated_bytes <= staged.bound_bytes(p),
        "allocator peak {} B > INV-7's bound {} B",
        out.peak_allocated_bytes,
        staged.bound_bytes(p)
    );
    let seeds = if under_sanitizer() { 1 } else { 4 };
    for seed in 0..seeds {
        let weights = 9100 + seed;
        let expected = timing_run(&rig, Strategy::Resident, weights, &[], None).unwrap();
        let got = timing_run(&rig, staged, weights, &[], Some(wide(seed)));
        assert_eq!(got, Ok(expected), "{staged:?} perturbation seed {seed}");
    }
    println!("perturbed: unpinned model level equals resident on {seeds} seeds");
    let bug = PlantedBug::StagedBringInSkipsCopy;
    let expected = timing_run(&rig, Strategy::Resident, 9200, &[], None).unwrap();
    let planted = timing_run(&rig, staged, 9200, &[bug], None);
    assert_ne!(
        planted,
        Ok(expected.clone()),
        "planted {}: not caught",
        bug.name()
    );
    assert_eq!(
        timing_run(&rig, staged, 9200, &[], None),
        Ok(expected),
        "clean control"
    );
    println!(
        "planted {}: caught (output differs); clean control equals resident",
        bug.name()
    );
}

/// The least device budget a "does not fit" error names
/// (`allowed: device_budget ≥ "N"`).
fn named_least(error: &str) -> Option<u64> {
    let tail = error.rsplit("device_budget ≥ \"").next()?;
    tail.split('"').next()?.parse().ok()
}

/// The request planner with `pin_cpu_memory = false` on the GPU (CONTRACT
/// §7c): at a device budget with room for everything, halfway from the
/// least and at the least (from saved measurements), and once through a
/// warm-up, two requests give the resident outputs with every phase within
/// its bound, the plan's host side pins no master, and the page-locked peak
/// beyond the rig's stays within its bound (a ring of two of the largest
/// block and the upload buffer). Planted: a swapped held set's staged
/// bring-in skipped makes the output differ.
#[test]
fn unpinned_planned_is_bit_identical_and_pins_only_its_buffers_on_the_gpu() {
    let Some(gpu) = gpu() else { return };
    const STEPS: u32 = 3;
    let (rig, p, total, resident, first) = planned_setup(&gpu, STEPS);
    let unpinned = |device: u64| OffloadConfig {
        pin_cpu_memory: Some(false),
        ..budget_config(device)
    };
    let least = first.plan.minimum.bytes;
    let mut swapped_at = None;
    for (device, warm) in [
        (2 * total, false),
        ((least + total) / 2, false),
        (least, false),
        ((least + total) / 2, true),
    ] {
        rig.settle();
        let before = offload_cuda::host_locked();
        offload_cuda::reset_host_locked_peak();
        let inputs = (!warm).then(|| first.inputs.clone());
        // The least of the pinned plan (`first`) is short of an unpinned
        // one's by the page tables of its staging ring and upload buffer
        // (CONTRACT §7a): there the enable's typed error names the least
        // this plan needs, and the run is made at it.
        let (device, run) = match planned_run_within(
            &rig,
            unpinned(device),
            STEPS,
            inputs.clone(),
            &[],
        ) {
            Ok(run) => (device, run),
            Err(e) if device == least => {
                let named =
                    named_least(&e.to_string()).unwrap_or_else(|| panic!("device {device}: {e}"));
                // A ring of two of granular_pipeline's largest block (24
                // MiB) and an upload buffer of it, 8 B per 4 KiB page.
                let tables = (3 * 25_165_824u64).div_ceil(4096) * 8;
                assert!(
                    named > device && named - device <= tables,
                    "device {device}: the least named {named} B exceeds it by more than the buffers' page tables ({tables} B): {e}"
                );
                println!(
                    "unpinned at the pinned least {device} B: does not fit; the least named, {named} B, is {} B more (the staging buffers' page tables)",
                    named - device
                );
                let run = planned_run_within(&rig, unpinned(named), STEPS, inputs, &[])
                    .unwrap_or_else(|e| panic!("device {named}: {e}"));
                (named, run)
            }
            Err(e) => panic!("device {device}: {e}"),
        };
        let locked = offload_cuda::host_locked();
        let held = locked.peak_bytes - (before.pinned_bytes + before.registered_bytes);
        let side = run.plan.host.clone().expect("unpinned: a host side");
        assert_eq!(run.outputs, resident, "device {device}: outputs");
        phases_within_bounds(&p, device, &run).unwrap();
        assert_eq!(side.held_bytes + side.pinned_streamed_bytes, 0, "{side}");
        assert!(
            held <= side.budget_bytes,
            "device {device}: page-locked peak {held} B over its bound {} B\n{}",
            side.budget_bytes,
            run.plan
        );
        let swapped = run
            .plan
            .components
            .iter()
            .filter(|c| !c.kept && c.held_bytes > 0)
            .count();
        if swapped > 0 && !warm {
            swapped_at.get_or_insert(device);
        }
        println!(
            "device {device} B{}: page-locked peak {held} B (bound {} B); {} streamed blocks staged, {swapped} swapped held set(s) brought in from pageable memory, kept {} B uploaded once",
            if warm { " (warm-up)" } else { "" },
            side.budget_bytes,
            side.staged_blocks.len(),
            side.kept_staged_bytes
        );
    }
    let device = swapped_at.expect("some device budget swaps a held set");
    let bug = PlantedBug::StagedBringInSkipsCopy;
    let planted = planned_run_within(
        &rig,
        unpinned(device),
        STEPS,
        Some(first.inputs.clone()),
        &[bug],
    );
    assert!(
        matches!(&planted, Ok(r) if r.outputs != resident),
        "planted {}: not caught at device {device} (the run must complete with another output): {:?}",
        bug.name(),
        planted.as_ref().map(|r| &r.outputs)
    );
    println!("planted {} at device {device} B: caught", bug.name());
}

/// In-place reads (`HostSource::Pageable`, CONTRACT §7c
/// `staged_reads = "in_place"`): the read kernel (`pageable.ptx`) over
/// pinned memory on every GPU (`CudaDevice::read_pinned_by_kernel`), and
/// over pageable memory on a GPU that reads it: every source and
/// destination alignment mod 16 (and past it), lengths around the
/// kernel's 16-byte body and 4-byte tail, and one long read, each equal to
/// the bytes read back, nothing outside the destination range written. On
/// a GPU that does not read pageable memory the pageable copy is a typed
/// error naming the attribute, and the test says it skipped those reads.
#[test]
fn in_place_reads_of_pageable_memory_land_byte_for_byte() {
    let Some(g) = gpu() else { return };
    let d = &g.device;
    let s = d.create_stream().unwrap();
    let total: usize = (1 << 20) + 4099;
    let data: Vec<u8> = (0..total).map(|i| (i * 131 + 7 + i / 251) as u8).collect();
    let region: Arc<dyn offload_core::device::HostRegion> = Arc::new(data.clone());
    let mut pinned = d.alloc_pinned(total as u64).unwrap();
    pinned.write_from(0, total as u64, &data);
    let dev = d.alloc_device(total as u64 + 64).unwrap();
    let mut back = d.alloc_pinned(total as u64 + 64).unwrap();
    let mut guard_host = d.alloc_pinned(total as u64 + 64).unwrap();
    guard_host.write_from(0, total as u64 + 64, &vec![0xA5u8; total + 64]);
    let pageable = d.reads_pageable();
    if !pageable {
        // SAFETY: refused before anything is enqueued.
        let e =
            unsafe { d.copy_h2d(&s, HostSource::Pageable(&region), 0, &dev, 0, 64) }.unwrap_err();
        assert!(e.to_string().contains("PAGEABLE_MEMORY_ACCESS"), "{e}");
        println!(
            "skipping in-place reads of pageable memory: this GPU does not read it (CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS is 0); the typed error was checked, the kernel runs over pinned memory"
        );
    }
    let mut checked = 0;
    for from_pinned in [true, false] {
        if !from_pinned && !pageable {
            continue;
        }
        // `len` bytes from `src_off` to `dst_off` by the read kernel.
        let read = |src_off: usize, dst_off: usize, len: usize| {
            // SAFETY: ranges in bounds; the caller drains the stream before
            // the buffers are reused; `region` and `pinned` outlive it.
            unsafe {
                if from_pinned {
                    d.read_pinned_by_kernel(
                        &s,
                        &pinned,
                        src_off as u64,
                        &dev,
                        dst_off as u64,
                        len as u64,
                    )
                } else {
                    d.copy_h2d(
                        &s,
                        HostSource::Pageable(&region),
                        src_off as u64,
                        &dev,
                        dst_off as u64,
                        len as u64,
                    )
                }
            }
            .unwrap();
        };
        let what = if from_pinned { "pinned" } else { "pageable" };
        for len in [0usize, 1, 3, 15, 16, 17, 19, 20, 21, 35, 36, 37, 100, 4097] {
            for src_off in 0..18usize {
                for dst_off in 0..18usize {
                    // SAFETY: in bounds; drained below before reuse.
                    unsafe {
                        d.copy_h2d(
                            &s,
                            HostSource::Pinned(&guard_host),
                            0,
                            &dev,
                            0,
                            total as u64 + 64,
                        )
                        .unwrap();
                    }
                    read(src_off, dst_off, len);
                    // SAFETY: same stream, after the read.
                    unsafe { d.copy_d2h(&s, &dev, 0, &mut back, 0, 64 + len as u64) }.unwrap();
                    d.synchronize_stream(&s).unwrap();
                    let mut out = vec![0u8; 64 + len];
                    back.read_into(0, &mut out);
                    assert_eq!(
                        &out[dst_off..dst_off + len],
                        &data[src_off..src_off + len],
                        "{what}: len {len}, source +{src_off}, destination +{dst_off}"
                    );
                    assert!(
                        out[..dst_off]
                            .iter()
                            .chain(&out[dst_off + len..])
                            .all(|&b| b == 0xA5),
                        "{what}: len {len}, source +{src_off}, destination +{dst_off}: bytes outside the range written"
                    );
                    checked += 1;
                }
            }
        }
        // One long read to the source's last byte, odd on both sides.
        let len = total - 13;
        read(13, 5, len);
        // SAFETY: same stream, after the read.
        unsafe { d.copy_d2h(&s, &dev, 5, &mut back, 0, len as u64) }.unwrap();
        d.synchronize_stream(&s).unwrap();
        let mut out = vec![0u8; len];
        back.read_into(0, &mut out);
        assert!(out == data[13..], "{what}: the long read differs");
        checked += 1;
    }
    println!("in-place read kernel: {checked} reads byte for byte (pageable memory: {pageable})");
}
