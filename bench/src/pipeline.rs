//! The pipeline mode (`--pipeline`): whole Flux.1-dev requests under device budgets.
//!
//! Each budget's request is planned by the request planner and run
//! against a resident run of the same request, on one GPU.
//!
//! The pipeline is `offload_sim::presets::flux1_dev()`: the transformer
//! (23.80 GB, 57 blocks), CLIP-L `text_encoder` (0.25 GB, 12 layers),
//! T5-XXL `text_encoder_2` (9.52 GB, 24 blocks) and the `vae` (0.07 GB),
//! random bf16 weights in host memory as a loader leaves them (registered
//! in place by every backend). The runtime's request, given to
//! [`Runtime::set_request`] (the warm-up runs it with 2 denoising steps),
//! is what a runtime does for one image:
//!
//! * each encoder once: its weights outside its blocks, then each block in
//!   a child scope; every 2-D bf16 weight a GEMM on the encoder's sequence
//!   (CLIP: the 77 rows of its position embedding, as diffusers pads its
//!   prompt; T5: the preset's 512 text tokens), attention over that
//!   sequence per block (width / 64 heads of 64), every weight byte
//!   folded, one chain step per block;
//! * `steps` DiT forwards: the DiT-only mode's proxy ([`crate::dit_body`]);
//! * the VAE decode once: each conv weight `[c_out, c_in, k, k]` a GEMM
//!   `c_out × (c_in·k·k)` over the pixels of its resolution (`conv_in` at
//!   the latent's, `up_blocks.i` at the latent's × 4^i, `conv_out` at the
//!   image's): the real FLOPs of the preset's convolutions (6.0 TFLOP at
//!   1024², against the simulator's `vae_flops` of 2.0), every byte
//!   folded, a chain step after each conv.
//!
//! GEMMs run in row chunks (and attention a few heads at a time) so that
//! the proxy's scratch stays small: it is allocated once, before any
//! backend, and is memory the runtime holds in every phase (the planner
//! sees it through the pool's high-water mark, as part of each phase's
//! activations). While each component's forward runs it also holds that
//! component's activations on the device, allocated through the CUDA
//! device's allocator at the start of its forward closure and freed after
//! an event recorded at its end, sized by the simulator's activation model
//! (`Preset::component_activation_bytes`: the DiT 0.45 GB at 4,608
//! tokens, T5 0.07 GB, the VAE 1.61 GB), so the warm-up measures them.
//!
//! For each budget: a fresh runtime, `enable_selected` timed (enable and
//! warm-up), the plan printed, `--requests` timed requests (each whole:
//! encoders, steps, decode; synchronised before the clock is read) and one
//! instrumented request that records each phase (a component's contiguous
//! forwards): its time between CUDA events, the allocator's high-water
//! marks from the phase's first forward (reset inside its closure, after
//! the backend's pre-forward hooks brought its weights in) to its end,
//! `cuMemGetInfo` samples inside every forward and at its end (less what
//! other processes and the context held before), the backend's own device
//! weight bytes, against the budget, the plan's prediction and the phase's
//! INV-7 weight bound (`plan_bounds`). Every output must equal the
//! resident run's.
//!
//! `--weight-compression none,lossless,auto` runs each budget once per
//! value (rows `16 GiB`, `16 GiB lossless`, `16 GiB auto`; the resident
//! run once; default `none` alone). Where any value codes, the CUDA codec
//! (`CudaCodec`) is loaded and given to every platform
//! (`CorePlatform::with_codec`); with `--coded-blocks PATH` the coded runs
//! read the loaded weights with the coded-block file of every stack's
//! blocks beside them (`WithCodedBlocks`; the file written first where
//! absent, or written again where it lacks a block of the pipeline or
//! holds one coded from other weights), so the planned backend takes each
//! block's coded bytes in place instead of encoding it at enable; the
//! `none` runs read the plain loaded weights. The last table gives each
//! planned run's DiT phase per forward ([`DitRow`]): streamed bf16 bytes,
//! bytes on the link, coded blocks, decode staging, and the measured
//! forward against the bf16 link limit `max(resident DiT forward,
//! streamed bf16 / pinned bandwidth)` and the plan's prediction.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use offload_core::OffloadConfig;
use offload_core::budget::{
    BudgetSource, ByteSize, ComponentMode, DeviceBudget, InputSource, PlannerInputs, RequestPlan,
};
use offload_core::device::Device;
use offload_core::lifecycle::OffloadError;
use offload_core::model::{DType, Pipeline, TensorId};
use offload_core::request::RequestShape;
use offload_core::runtime::{
    CorePlatform, PlanBounds, PlantedBug, Runtime, Scope, WeightSource, plan_bounds,
};
use offload_cuda::proxy::{CHAIN_ELEMENTS, CUBLAS_WORKSPACE_BYTES, Proxy};
use offload_cuda::{Cuda, CudaDevice, CudaEvent, CudaStream, driver_present};
use offload_sim::harness::{blocks_of, own_tensors};
use offload_sim::presets::{Preset, flux1_dev};
use serde::Serialize;

use crate::{
    Args, BoxError, Loaded, MAX_STEPS, MAX_WARMUP, attention_chunked, bandwidth, dit_body,
    linear_chunked, list, load, token_list, traffic_gbps,
};

/// The proxy's activations (GEMM inputs, attention's Q, K, V): 64 MiB,
/// about 2,200 rows of the widest DiT input (15,360).
const PROXY_INPUT_BYTES: u64 = 64 << 20;
/// The proxy's outputs (GEMM outputs, one batch of attention scores):
/// 96 MiB, two heads of scores at 4,608 tokens.
const PROXY_OUTPUT_BYTES: u64 = 96 << 20;
/// Head width of the encoders' attention (CLIP-L and T5-XXL: 64).
const ENCODER_HEAD_DIM: u64 = 64;
/// The most timed requests per budget.
const MAX_REQUESTS: u64 = 100;
/// The most GiB `--hog-gib` may hold.
const MAX_HOG_GIB: u64 = 1024;
/// How long the hog may take to hold its memory (python3, torch's import,
/// CUDA's start, the allocation).
const HOG_START: Duration = Duration::from_secs(90);
/// How long the hog may take to exit once told to.
const HOG_STOP: Duration = Duration::from_secs(20);
/// Device memory the resident run needs beside the weights, activations
/// and scratch (the context's growth, the allocator's granules).
const RESIDENT_HEADROOM_BYTES: u64 = 2 << 30;

/// The flags of the pipeline mode, checked.
struct PipelineSettings {
    tokens: u64,
    steps: u32,
    requests: u64,
    resident_warmup: u64,
    budgets: Vec<DeviceBudget>,
    hog_gib: Option<u64>,
    saved_from: Option<DeviceBudget>,
    /// `weight_compression` values each budget runs with (CONTRACT §7b).
    compressions: Vec<crate::Compression>,
}

impl PipelineSettings {
    fn from_args(args: &Args) -> Result<Self> {
        ensure!(
            args.ranks == 1,
            "--pipeline runs on one GPU; allowed: --ranks 1 (distributed layerwise is the DiT-only mode's)"
        );
        ensure!(
            !args.copy_beside,
            "--copy-beside is the DiT-only mode's (it times the DiT's resident step beside copies); allowed: without --pipeline"
        );
        let tokens = token_list(args.tokens.as_deref().unwrap_or("4608"))?;
        ensure!(
            tokens.len() == 1,
            "--tokens: the pipeline mode runs one request shape; allowed: one token count (e.g. 4608), not {tokens:?}"
        );
        let steps = args.steps.unwrap_or(28);
        ensure!(
            (1..=MAX_STEPS).contains(&steps),
            "--steps: {steps} is outside 1..={MAX_STEPS} (denoising steps per request)"
        );
        ensure!(
            (1..=MAX_REQUESTS).contains(&args.requests),
            "--requests: {} is outside 1..={MAX_REQUESTS} (timed requests per budget)",
            args.requests
        );
        let resident_warmup = args.warmup.unwrap_or(1);
        ensure!(
            resident_warmup <= MAX_WARMUP,
            "--warmup: {resident_warmup} is outside 0..={MAX_WARMUP}"
        );
        let budgets = list(
            "--budgets",
            args.budgets
                .as_deref()
                .unwrap_or("24GiB,16GiB,12GiB,8GiB,auto"),
            DeviceBudget::parse,
        )?;
        ensure!(
            !budgets.is_empty(),
            "--budgets: no budget given; allowed: a comma-separated list of sizes (\"16GiB\") or \"auto\""
        );
        if let Some(g) = args.hog_gib {
            ensure!(
                (1..=MAX_HOG_GIB).contains(&g),
                "--hog-gib: {g} is outside 1..={MAX_HOG_GIB}"
            );
            ensure!(
                budgets.contains(&DeviceBudget::Auto),
                "--hog-gib runs the `auto` budget beside another process; allowed: with `auto` among --budgets"
            );
        }
        let sized: Vec<DeviceBudget> = budgets
            .iter()
            .copied()
            .filter(|b| b.bytes().is_some())
            .collect();
        let saved_from = match args.saved_from.as_deref().map(str::trim) {
            Some("none") => None,
            Some(text) => {
                let b =
                    DeviceBudget::parse(text).map_err(|e| anyhow::anyhow!("--saved-from: {e}"))?;
                ensure!(
                    b.bytes().is_some() && budgets.contains(&b),
                    "--saved-from: {b} is not a sized budget among --budgets; allowed: one of {}, or none",
                    sized
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                Some(b)
            }
            None => {
                let sixteen = DeviceBudget::Bytes(ByteSize::new(16 << 30));
                sized
                    .iter()
                    .copied()
                    .find(|b| *b == sixteen)
                    .or_else(|| sized.first().copied())
            }
        };
        let compressions = crate::compressions(args)?;
        ensure!(
            args.coded_blocks.is_none()
                || compressions.iter().any(|c| *c != crate::Compression::None),
            "--coded-blocks: with --weight-compression lossless or auto only"
        );
        Ok(Self {
            tokens: tokens[0],
            steps: u32::try_from(steps).context("--steps")?,
            requests: args.requests,
            resident_warmup,
            budgets,
            hog_gib: args.hog_gib,
            saved_from,
            compressions,
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An encoder's forward, as the request runs it.
#[derive(Clone, Debug, Serialize)]
struct EncoderWork {
    path: String,
    /// Rows of its GEMMs and tokens of its attention.
    rows: u64,
    /// Attention heads (of [`ENCODER_HEAD_DIM`]).
    heads: u64,
}

impl EncoderWork {
    /// Encoder `path` of `p`: its sequence is its position embedding's rows
    /// (CLIP: 77) if it has one, else `text_tokens` (T5: 512); its width
    /// the commonest input width of its 2-D weights.
    fn of(p: &Pipeline, path: &str, text_tokens: u64) -> Result<Self> {
        let m = p
            .module_id(path)
            .with_context(|| format!("the preset has no encoder `{path}`"))?;
        let tensors = p.subtree_tensors(m);
        let rows = tensors
            .iter()
            .map(|t| (p.tensor_path(*t), p.tensor(*t)))
            .find(|(name, t)| name.ends_with("position_embedding.weight") && t.shape.len() == 2)
            .map_or(text_tokens, |(_, t)| t.shape[0]);
        let mut widths: std::collections::BTreeMap<u64, usize> = Default::default();
        for t in &tensors {
            let t = p.tensor(*t);
            if t.dtype == DType::Bf16 && t.shape.len() == 2 {
                *widths.entry(t.shape[1]).or_default() += 1;
            }
        }
        let width = widths
            .into_iter()
            .max_by_key(|(w, n)| (*n, *w))
            .map_or(ENCODER_HEAD_DIM, |(w, _)| w);
        Ok(Self {
            path: path.to_owned(),
            rows,
            heads: (width / ENCODER_HEAD_DIM).max(1),
        })
    }
}

/// What the request closure runs with: the proxy, the preset's cost model,
/// the encoders' shapes, the last output, and the phase log of an
/// instrumented request.
struct Work {
    proxy: Proxy,
    preset: Preset,
    encoders: Vec<EncoderWork>,
    output: Mutex<Option<u64>>,
    log: Mutex<Option<PhaseLog>>,
}

/// One phase of an instrumented request, as measured.
#[derive(Clone, Debug, Serialize)]
struct MeasuredPhase {
    component: String,
    forwards: u64,
    /// Between CUDA events on the compute stream: before the first
    /// forward's hooks (its bring-in included) to after the last forward.
    seconds: f64,
    /// The allocator's high-water mark of bytes in use, from the first
    /// forward's start (inside its closure) to the phase's end.
    pool_used_peak_bytes: u64,
    /// The same for bytes the pool holds from the driver.
    pool_reserved_peak_bytes: u64,
    /// `total − free` (cuMemGetInfo) less what was used before the run
    /// (other processes, the context), the most sampled inside the
    /// phase's forwards and at its end.
    info_used_peak_bytes: u64,
    /// The backend's own device weight bytes, the most sampled.
    weight_peak_bytes: u64,
    /// `cuMemGetInfo`'s used bytes (less the same) when the phase began
    /// (before its bring-in) and at its end.
    info_used_at_start_bytes: u64,
    info_used_at_end_bytes: u64,
}

/// The open phase of a [`PhaseLog`].
struct OpenPhase {
    component: String,
    start: CudaEvent,
    fresh: bool,
    forwards: u64,
    info_peak: u64,
    weight_peak: u64,
    info_at_start: u64,
}

/// The phases of one instrumented request.
struct PhaseLog {
    /// Device bytes used before the run by others (other processes, the
    /// context): what `cuMemGetInfo` samples are less.
    others: u64,
    open: Option<OpenPhase>,
    done: Vec<MeasuredPhase>,
}

impl PhaseLog {
    fn new(others: u64) -> Self {
        Self {
            others,
            open: None,
            done: Vec::new(),
        }
    }

    fn info_used(&self, device: &CudaDevice) -> Result<u64, BoxError> {
        let info = device.memory_info()?;
        Ok(info
            .total_bytes
            .saturating_sub(info.free_bytes)
            .saturating_sub(self.others))
    }

    /// A forward of `component` is about to run (before its hooks): a new
    /// phase if the open one is another component's.
    fn begin(&mut self, rt: &Runtime<Cuda>, component: &str) -> Result<(), BoxError> {
        if let Some(open) = self.open.as_mut()
            && open.component == component
        {
            open.forwards += 1;
            return Ok(());
        }
        self.end(rt)?;
        let device = rt.device();
        let start = device.create_timing_event()?;
        device.record_event(&start, rt.compute_stream())?;
        let info_at_start = self.info_used(device)?;
        self.open = Some(OpenPhase {
            component: component.to_owned(),
            start,
            fresh: true,
            forwards: 1,
            info_peak: 0,
            weight_peak: 0,
            info_at_start,
        });
        Ok(())
    }

    /// Inside a forward's closure (its hooks done): the first forward of a
    /// phase resets the allocator's high-water marks.
    fn started(&mut self, device: &CudaDevice) -> Result<(), BoxError> {
        if let Some(open) = self.open.as_mut()
            && std::mem::replace(&mut open.fresh, false)
        {
            // Frees the phase change enqueued (the phase before's sets,
            // after its last use) done first, so the mark starts from
            // what this phase holds.
            device.trim_pool()?;
            device.reset_pool_high()?;
        }
        Ok(())
    }

    /// Samples `cuMemGetInfo` and the backend's weight bytes.
    fn sample(&mut self, rt: &Runtime<Cuda>) -> Result<(), BoxError> {
        let used = self.info_used(rt.device())?;
        let weights = rt.backend().map_or(0, |b| b.device_weight_bytes());
        if let Some(open) = self.open.as_mut() {
            open.info_peak = open.info_peak.max(used);
            open.weight_peak = open.weight_peak.max(weights);
        }
        Ok(())
    }

    /// Ends the open phase: an event, a synchronisation, the allocator's
    /// marks.
    fn end(&mut self, rt: &Runtime<Cuda>) -> Result<(), BoxError> {
        let Some(open) = self.open.take() else {
            return Ok(());
        };
        let device = rt.device();
        let end = device.create_timing_event()?;
        device.record_event(&end, rt.compute_stream())?;
        device.synchronize_stream(rt.compute_stream())?;
        let (_, used_high) = device.pool_used()?;
        let (_, reserved_high) = device.pool_reserved()?;
        let at_end = self.info_used(device)?;
        let weights = rt.backend().map_or(0, |b| b.device_weight_bytes());
        self.done.push(MeasuredPhase {
            component: open.component,
            forwards: open.forwards,
            seconds: device.elapsed_ns(&open.start, &end)? as f64 * 1e-9,
            pool_used_peak_bytes: used_high,
            pool_reserved_peak_bytes: reserved_high,
            info_used_peak_bytes: open.info_peak.max(at_end),
            weight_peak_bytes: open.weight_peak.max(weights),
            info_used_at_start_bytes: open.info_at_start,
            info_used_at_end_bytes: at_end,
        });
        Ok(())
    }
}

/// One forward of component `path` holding `activation_bytes` on the
/// device (allocated through the device's allocator at the start of the
/// closure, freed after an event at its end): `body` runs in its scope
/// with a sampler to call after each block.
fn held_forward(
    rt: &Runtime<Cuda>,
    path: &str,
    activation_bytes: u64,
    log: &mut Option<PhaseLog>,
    body: impl FnOnce(
        &Scope<'_, Cuda>,
        &mut dyn FnMut() -> Result<(), BoxError>,
    ) -> Result<(), BoxError>,
) -> Result<(), BoxError> {
    rt.forward(path, |scope| {
        let device: &CudaDevice = scope.device();
        if let Some(l) = log.as_mut() {
            l.started(device)?;
        }
        let held = device.alloc_device(activation_bytes).map_err(|e| {
            OffloadError::device(
                format!("the activations of `{path}` ({activation_bytes} bytes)"),
                e,
            )
        })?;
        let mut sample = || -> Result<(), BoxError> {
            match log.as_mut() {
                Some(l) => l.sample(rt),
                None => Ok(()),
            }
        };
        let mut ran = sample();
        if ran.is_ok() {
            ran = body(scope, &mut sample);
        }
        // Freed once the forward's kernels are done with it.
        let done = device.create_event()?;
        device.record_event(&done, scope.stream())?;
        // SAFETY: every kernel of this forward was enqueued on the compute
        // stream before `done`; nothing reads the buffer (the proxy never
        // touches it: it stands for the memory, not the values).
        unsafe { device.free_device(held, &[&done]) }?;
        ran
    })?;
    Ok(())
}

/// Every tensor folded, and a GEMM per 2-D bf16 weight on `rows` rows.
fn encoder_kernels(
    scope: &Scope<'_, Cuda>,
    proxy: &Proxy,
    tensors: &[TensorId],
    rows: u64,
) -> Result<(), BoxError> {
    for t in tensors {
        let v = scope.view_id(*t)?;
        let ptr = v.buffer().ptr() + v.byte_range().start;
        let tensor = v.tensor();
        if tensor.dtype == DType::Bf16 && tensor.shape.len() == 2 {
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

/// One encoder forward in its scope: its own tensors, a chain step, then
/// each block (child scope): its tensors, attention, a chain step.
fn encoder_body(
    scope: &Scope<'_, Cuda>,
    proxy: &Proxy,
    enc: &EncoderWork,
    after_block: &mut dyn FnMut() -> Result<(), BoxError>,
) -> Result<(), BoxError> {
    let p = scope.pipeline();
    let module = scope.module();
    let prefix = format!("{}.", scope.path());
    encoder_kernels(scope, proxy, &own_tensors(p, module), enc.rows)?;
    proxy.chain(scope.stream())?;
    for b in blocks_of(p, module) {
        let path = &p.module(b).path;
        let rel = path.strip_prefix(&prefix).unwrap_or(path).to_owned();
        let tensors = p.subtree_tensors(b);
        scope.child(&rel, |blk| {
            encoder_kernels(blk, proxy, &tensors, enc.rows)?;
            attention_chunked(proxy, enc.heads, enc.rows, ENCODER_HEAD_DIM)?;
            proxy.chain(blk.stream())?;
            Ok(())
        })?;
        after_block()?;
    }
    Ok(())
}

/// The output pixels a VAE conv at `rel` (its tensor path within the VAE)
/// runs over for an image of `height × width`: `conv_in` at the latent's
/// resolution (÷ 8 each way), `up_blocks.i` at the latent's × 4^i,
/// everything else (`conv_out`) at the image's.
fn conv_pixels(rel: &str, height: u64, width: u64) -> u64 {
    let latent = height.div_ceil(8) * width.div_ceil(8);
    let full = height * width;
    if rel.contains("conv_in") {
        return latent;
    }
    let up = rel
        .split_once("up_blocks.")
        .and_then(|(_, rest)| rest.split('.').next().and_then(|i| i.parse::<u32>().ok()));
    match up {
        Some(i) => latent
            .checked_shl(2 * i)
            .map_or(full, |p| p.min(full))
            .max(1),
        None => full.max(1),
    }
}

/// The GEMM a VAE tensor stands for: `(c_out, c_in·k·k, pixels)` for a
/// bf16 conv weight (3-D or more), else none.
fn conv_gemm(rel: &str, dtype: DType, shape: &[u64], height: u64, width: u64) -> Option<[u64; 3]> {
    (dtype == DType::Bf16 && shape.len() >= 3).then(|| {
        [
            shape[0],
            shape[1..].iter().product(),
            conv_pixels(rel, height, width),
        ]
    })
}

/// The VAE decode's FLOPs at `height × width` (each conv's GEMM).
fn vae_flops(p: &Pipeline, vae: &str, height: u64, width: u64) -> f64 {
    let Some(m) = p.module_id(vae) else {
        return 0.0;
    };
    let prefix = format!("{vae}.");
    p.subtree_tensors(m)
        .into_iter()
        .filter_map(|t| {
            let path = p.tensor_path(t);
            let tensor = p.tensor(t);
            conv_gemm(
                path.strip_prefix(&prefix).unwrap_or(&path),
                tensor.dtype,
                &tensor.shape,
                height,
                width,
            )
        })
        .map(|[o, i, r]| 2.0 * o as f64 * i as f64 * r as f64)
        .sum()
}

/// One VAE decode in its scope: each conv weight's GEMM over its pixels
/// (in row chunks), every tensor folded, a chain step after each conv.
fn vae_body(
    scope: &Scope<'_, Cuda>,
    proxy: &Proxy,
    height: u64,
    width: u64,
    after: &mut dyn FnMut() -> Result<(), BoxError>,
) -> Result<(), BoxError> {
    let p = scope.pipeline();
    let prefix = format!("{}.", scope.path());
    for t in p.subtree_tensors(scope.module()) {
        let v = scope.view_id(t)?;
        let ptr = v.buffer().ptr() + v.byte_range().start;
        let tensor = v.tensor();
        let path = p.tensor_path(t);
        let rel = path.strip_prefix(&prefix).unwrap_or(&path);
        if let Some([out_f, in_f, rows]) =
            conv_gemm(rel, tensor.dtype, &tensor.shape, height, width)
        {
            linear_chunked(proxy, ptr, out_f, in_f, rows)?;
        }
        proxy.fold(
            scope.stream(),
            ptr,
            v.byte_range().end - v.byte_range().start,
        )?;
        if tensor.shape.len() >= 3 {
            proxy.chain(scope.stream())?;
        }
    }
    proxy.chain(scope.stream())?;
    after()
}

/// The output size of `shape` (its height and width, else the preset's
/// square from the image tokens).
fn output_size(preset: &Preset, shape: &RequestShape) -> (u64, u64) {
    if shape.height > 0 && shape.width > 0 {
        (u64::from(shape.height), u64::from(shape.width))
    } else {
        let side = (preset.vae_pixels(preset.split(shape.tokens)) as f64)
            .sqrt()
            .round() as u64;
        (side.max(8), side.max(8))
    }
}

/// The runtime's request (see the module docs): the encoders once, the
/// denoising steps, the decode; then the output is read back (the
/// request's one synchronisation). An instrumented request logs phases.
fn request(rt: &Runtime<Cuda>, work: &Work, shape: &RequestShape) -> Result<(), BoxError> {
    let proxy = &work.proxy;
    let preset = &work.preset;
    let p = &rt.model().pipeline;
    let act = |path: &str| preset.component_activation_bytes(p, path, shape.tokens);
    proxy.reset(rt.compute_stream())?;
    let mut log = lock(&work.log).take();
    let ran = (|| -> Result<(), BoxError> {
        for enc in &work.encoders {
            if let Some(l) = log.as_mut() {
                l.begin(rt, &enc.path)?;
            }
            held_forward(rt, &enc.path, act(&enc.path), &mut log, |scope, after| {
                encoder_body(scope, proxy, enc, after)
            })?;
        }
        let steps = shape.steps as usize;
        for step in 0..steps {
            // Two experts split the steps (the first serves the first half).
            let dit = match preset.dits.as_slice() {
                [_, second, ..] if step >= steps / 2 => *second,
                [first, ..] => *first,
                [] => return Err("the preset has no DiT".into()),
            };
            if let Some(l) = log.as_mut() {
                l.begin(rt, dit)?;
            }
            held_forward(rt, dit, act(dit), &mut log, |scope, after| {
                dit_body(scope, proxy, shape.tokens, None, after)
            })?;
        }
        let (height, width) = output_size(preset, shape);
        for vae in &preset.vaes {
            if let Some(l) = log.as_mut() {
                l.begin(rt, vae)?;
            }
            held_forward(rt, vae, act(vae), &mut log, |scope, after| {
                vae_body(scope, proxy, height, width, after)
            })?;
        }
        if let Some(l) = log.as_mut() {
            l.end(rt)?;
        }
        *lock(&work.output) = Some(proxy.read_output()?);
        Ok(())
    })();
    *lock(&work.log) = log;
    ran
}

/// One phase of a run's instrumented request against its plan.
#[derive(Clone, Debug, Serialize)]
struct PhaseRow {
    #[serde(flatten)]
    measured: MeasuredPhase,
    mode: Option<String>,
    kept: Option<bool>,
    predicted_s: Option<f64>,
    /// The plan's peak of the phase (every part).
    predicted_peak_bytes: Option<u64>,
    /// The activations the plan assumed for it (what the warm-up measured).
    predicted_activation_bytes: Option<u64>,
    /// What the request allocated for its activations (the model).
    activation_bytes: u64,
    /// INV-7's device weight bound of the phase (`plan_bounds`).
    weight_bound_bytes: Option<u64>,
    budget_bytes: Option<u64>,
    /// Allocator bytes in use ≤ the budget.
    pool_within_budget: Option<bool>,
    /// Allocator bytes held from the driver ≤ the budget.
    reserved_within_budget: Option<bool>,
    /// `cuMemGetInfo`'s used bytes ≤ the budget.
    info_within_budget: Option<bool>,
    /// The backend's weight bytes ≤ the phase's bound.
    within_bound: Option<bool>,
}

/// The process beside the auto run.
#[derive(Clone, Debug, Serialize)]
struct HogReport {
    gib: u64,
    pid: u32,
    /// Seconds it took to hold its memory.
    start_s: f64,
    free_before_bytes: u64,
    free_with_hog_bytes: u64,
    /// `free_before − free_with_hog`.
    held_bytes: u64,
    free_after_stop_bytes: Option<u64>,
    stopped: String,
}

/// One run (resident, a budget, saved measurements).
#[derive(Clone, Debug, Serialize, Default)]
struct RunReport {
    name: String,
    /// The configuration's `device_budget`, if any.
    device_budget: Option<String>,
    /// Its `weight_compression` (`none`, `lossless`, `auto`).
    weight_compression: String,
    error: Option<String>,
    /// The whole run: enable, every request, disable.
    wall_s: f64,
    /// `enable_selected` (enable and, without saved measurements, the
    /// warm-up), synchronised.
    enable_s: f64,
    /// The warm-up's own seconds (`planner_inputs().source`).
    warmup_s: Option<f64>,
    /// Free device memory before enable (`cuMemGetInfo`).
    free_at_enable_bytes: u64,
    /// Device bytes used by others and the context before the run.
    others_bytes: u64,
    /// Right after `enable` (the device synchronised): `cuMemGetInfo`'s
    /// used bytes less `others_bytes` less what the allocator's pool holds,
    /// i.e. what the driver holds for this run outside the pool (host
    /// mappings' page tables and anything else); the plan counts its
    /// `mapping_bytes` for it.
    outside_pool_after_enable_bytes: u64,
    request_s: Vec<f64>,
    /// The median of `request_s` (the mean of the middle two for an even
    /// count): the time per image (batch 1).
    median_request_s: f64,
    predicted_request_s: Option<f64>,
    predicted_over_measured: Option<f64>,
    /// `predicted_over_measured` within 0.95–1.05.
    prediction_in_target: Option<bool>,
    output: Option<u64>,
    /// Every timed request gave the same output.
    outputs_agree: bool,
    output_equals_resident: Option<bool>,
    /// The plan changed after a request (a first-request shortfall made
    /// the backend plan again).
    replanned: bool,
    modes: String,
    /// The plan in force after enable (before any request).
    #[serde(skip)]
    enable_plan: Option<RequestPlan>,
    plan: Option<RequestPlan>,
    plan_text: Option<String>,
    inputs: Option<PlannerInputs>,
    phases: Vec<PhaseRow>,
    host_weight_bytes: u64,
    /// Units a backend could not register in place (copied instead).
    units_copied: u64,
    hog: Option<HogReport>,
    /// Its plan's DiT phase against its limits (planned runs with an
    /// instrumented request).
    dit: Option<DitRow>,
}

/// The DiT phase (component `transformer`) of a planned run: what its
/// plan streams, codes and puts on the link per forward, and its measured
/// forward against the bf16 link limit and the plan's prediction.
#[derive(Clone, Debug, Serialize, PartialEq)]
struct DitRow {
    blocks: usize,
    streamed_blocks: usize,
    /// The streamed blocks that stream coded (`ComponentPlan::coded_blocks`).
    coded_blocks: usize,
    /// bf16 bytes streamed per forward (`streamed_bytes`).
    streamed_bytes: u64,
    /// Bytes on the link per forward (`link_bytes`: coded blocks at their
    /// coded bytes).
    link_bytes: u64,
    /// `link_bytes / streamed_bytes` (1 with nothing coded).
    link_over_bf16: f64,
    /// Its phase's decode staging (`peak.staging_bytes`).
    staging_bytes: u64,
    /// The plan's decodes per forward (`decode_s / forwards`), s.
    decode_s_per_forward: f64,
    /// Forwards per request (the plan's).
    forwards: f64,
    /// The plan's phase time per forward (`predicted_s / forwards`).
    predicted_forward_s: f64,
    /// The instrumented request's DiT phase seconds / its forwards (the
    /// first forward's cold fill and the phase's bring-in included).
    forward_s: Option<f64>,
    /// The resident run's, the same way.
    resident_forward_s: Option<f64>,
    /// `streamed_bytes` over the pinned host→device bandwidth measured at
    /// the start of this process.
    bf16_link_s: f64,
    /// `max(resident_forward_s, bf16_link_s)` (`bf16_link_s` alone
    /// without a resident run): the bf16 link limit of
    /// `bench/run-crossover.sh`'s budget table.
    bf16_link_limit_s: f64,
    /// `forward_s / bf16_link_limit_s` (below 1: faster than bf16
    /// streaming could be).
    forward_over_limit: Option<f64>,
    /// `predicted_forward_s / forward_s`.
    predicted_over_measured: Option<f64>,
}

/// `r`'s DiT phase ([`DitRow`]), from its plan and its instrumented
/// request, against `resident` (the resident run's report) and the pinned
/// bandwidth `bw_gbps` (GB/s); `None` without a planned `transformer`.
fn dit_row(r: &RunReport, resident: Option<&RunReport>, bw_gbps: f64) -> Option<DitRow> {
    let c = r.plan.as_ref()?.component("transformer")?;
    let forward = |r: &RunReport| {
        r.phases
            .iter()
            .find(|p| p.measured.component == "transformer" && p.measured.forwards > 0)
            .map(|p| p.measured.seconds / p.measured.forwards as f64)
    };
    let forward_s = forward(r);
    let resident_forward_s = resident.filter(|r| r.error.is_none()).and_then(forward);
    let per = |s: f64| s / c.forwards.max(1e-12);
    let bf16_link_s = if bw_gbps > 0.0 {
        c.streamed_bytes as f64 / (bw_gbps * 1e9)
    } else {
        0.0
    };
    let bf16_link_limit_s = resident_forward_s.map_or(bf16_link_s, |f| f.max(bf16_link_s));
    let predicted_forward_s = per(c.predicted_s);
    Some(DitRow {
        blocks: c.blocks,
        streamed_blocks: c.streamed_blocks,
        coded_blocks: c.coded_blocks.len(),
        streamed_bytes: c.streamed_bytes,
        link_bytes: c.link_bytes,
        link_over_bf16: if c.streamed_bytes > 0 {
            c.link_bytes as f64 / c.streamed_bytes as f64
        } else {
            1.0
        },
        staging_bytes: c.peak.staging_bytes,
        decode_s_per_forward: per(c.decode_s),
        forwards: c.forwards,
        predicted_forward_s,
        forward_s,
        resident_forward_s,
        bf16_link_s,
        bf16_link_limit_s,
        forward_over_limit: forward_s
            .filter(|_| bf16_link_limit_s > 0.0)
            .map(|f| f / bf16_link_limit_s),
        predicted_over_measured: forward_s
            .filter(|f| *f > 0.0)
            .map(|f| predicted_forward_s / f),
    })
}

impl RunReport {
    fn peak(&self, f: impl Fn(&MeasuredPhase) -> u64) -> u64 {
        self.phases
            .iter()
            .map(|p| f(&p.measured))
            .max()
            .unwrap_or(0)
    }

    fn all(&self, f: impl Fn(&PhaseRow) -> Option<bool>) -> Option<bool> {
        let v: Vec<bool> = self.phases.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| v.iter().all(|b| *b))
    }
}

/// The median (the mean of the middle two for an even count).
fn middle(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// Each component's mode, short.
fn modes(plan: &RequestPlan) -> String {
    plan.components
        .iter()
        .map(|c| {
            let what = match c.mode {
                ComponentMode::Streamed => {
                    format!("streamed {}/{} d{}", c.streamed_blocks, c.blocks, c.depth)
                }
                m => m.to_string(),
            };
            let kept = if c.kept && c.mode != ComponentMode::Resident {
                " kept"
            } else {
                ""
            };
            format!("{}: {what}{kept}", c.path)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The other process holding device memory (`--hog-gib`): python3 with
/// torch holding `gib` GiB until its stdin closes (so it also exits if
/// this process dies).
struct Hog {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Hog {
    fn start(gib: u64, device: &CudaDevice) -> Result<(Self, HogReport)> {
        let free_before = device.memory_info()?.free_bytes;
        let script = format!(
            "import sys, torch\nx = torch.empty({gib} << 30, dtype=torch.uint8, device='cuda')\ntorch.cuda.synchronize()\nprint('held', x.numel(), flush=True)\nsys.stdin.read()\n"
        );
        let began = Instant::now();
        let mut child = Command::new("python3")
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting `python3` for --hog-gib (it needs python3 with torch and CUDA)")?;
        let pid = child.id();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("the hog's stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut hog = Self { child, stdin };
        let line = rx.recv_timeout(HOG_START).unwrap_or_default();
        if !line.starts_with("held") {
            let stopped = hog.stop(Duration::ZERO);
            let mut err = String::new();
            if let Some(mut e) = hog.child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            let tail: Vec<&str> = err.lines().rev().take(6).collect();
            bail!(
                "--hog-gib {gib}: the hog (pid {pid}) did not hold its memory within {} s ({stopped}); its stderr ends: {}",
                HOG_START.as_secs(),
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            );
        }
        let free_with = device.memory_info()?.free_bytes;
        let report = HogReport {
            gib,
            pid,
            start_s: began.elapsed().as_secs_f64(),
            free_before_bytes: free_before,
            free_with_hog_bytes: free_with,
            held_bytes: free_before.saturating_sub(free_with),
            free_after_stop_bytes: None,
            stopped: String::new(),
        };
        Ok((hog, report))
    }

    /// Closes its stdin (it exits), waits up to `grace`; kills it (by its
    /// own handle) if it has not exited by then. Says how it ended.
    fn stop(&mut self, grace: Duration) -> String {
        drop(self.stdin.take());
        let until = Instant::now() + grace;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return format!("exited: {status}"),
                Ok(None) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                _ => break,
            }
        }
        let killed = self.child.kill();
        let waited = self.child.wait();
        format!("killed ({killed:?}, {waited:?})")
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.stop(HOG_STOP);
        }
    }
}

/// Everything a run needs.
struct Bench<'a> {
    device: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    pipeline: Pipeline,
    loaded: Arc<Loaded>,
    /// The device's codec, where a run codes blocks, and the weights those
    /// runs read (the loaded ones, with a coded-block file beside them
    /// where `--coded-blocks` names one).
    codec: Option<(Arc<offload_cuda::decode::CudaCodec>, Arc<dyn WeightSource>)>,
    work: Arc<Work>,
    shape: RequestShape,
    bugs: &'a [PlantedBug],
}

/// How one run goes.
struct RunSpec {
    name: String,
    config: OffloadConfig,
    planner: Option<PlannerInputs>,
    untimed: u64,
    timed: u64,
    instrumented: bool,
    plant: bool,
}

impl Bench<'_> {
    /// Bytes used on the device by others (other processes, the context)
    /// now: `total − free` less what the pool holds.
    fn others(&self) -> Result<(u64, u64)> {
        self.device.synchronize()?;
        self.device.trim_pool()?;
        let info = self.device.memory_info()?;
        let (reserved, _) = self.device.pool_reserved()?;
        Ok((
            info.total_bytes
                .saturating_sub(info.free_bytes)
                .saturating_sub(reserved),
            info.free_bytes,
        ))
    }

    fn run(&self, spec: &RunSpec) -> RunReport {
        let mut report = RunReport {
            name: spec.name.clone(),
            device_budget: spec.config.device_budget.map(|b| b.to_string()),
            weight_compression: spec.config.compression().to_string(),
            ..RunReport::default()
        };
        eprintln!("== {}", spec.name);
        let t = Instant::now();
        if let Err(e) = self.run_into(spec, &mut report) {
            eprintln!("{}: {e:#}", spec.name);
            report.error = Some(format!("{e:#}"));
        }
        report.wall_s = t.elapsed().as_secs_f64();
        eprintln!("{}: {:.1} s in all", spec.name, report.wall_s);
        *lock(&self.work.log) = None;
        report.units_copied = self.loaded.mismatched();
        report
    }

    fn run_into(&self, spec: &RunSpec, report: &mut RunReport) -> Result<()> {
        let (others, free) = self.others()?;
        report.others_bytes = others;
        report.free_at_enable_bytes = free;
        let coded = spec.config.compression() != offload_core::config::WeightCompression::None;
        let weights = match (&self.codec, coded) {
            (Some((_, w)), true) => Arc::clone(w),
            _ => Arc::clone(&self.loaded) as Arc<dyn WeightSource>,
        };
        let mut platform = CorePlatform::<Cuda>::new(
            "cuda",
            Arc::clone(&self.device),
            Arc::clone(&self.stream),
            weights,
        )
        .with_request(self.shape.clone());
        if let Some((codec, _)) = &self.codec {
            platform = platform.with_codec(Arc::clone(codec) as _);
        }
        if let Some(inputs) = &spec.planner {
            platform = platform.with_planner(inputs.clone());
        }
        #[cfg(feature = "planted-bugs")]
        if spec.plant {
            platform = platform.with_planted_bugs(self.bugs);
        }
        #[cfg(not(feature = "planted-bugs"))]
        let _ = (spec.plant, self.bugs);
        let mut rt = Runtime::new(
            Arc::clone(&self.device),
            Arc::clone(&self.stream),
            self.pipeline.clone(),
        );
        let work = Arc::clone(&self.work);
        rt.set_request(move |rt, shape| request(rt, &work, shape));
        let t = Instant::now();
        rt.enable_selected(&spec.config, &platform)
            .with_context(|| format!("{}: enable_selected", spec.name))?;
        self.device.synchronize_stream(&self.stream)?;
        report.enable_s = t.elapsed().as_secs_f64();
        {
            self.device.synchronize()?;
            let info = self.device.memory_info()?;
            let (reserved, _) = self.device.pool_reserved()?;
            report.outside_pool_after_enable_bytes = info
                .total_bytes
                .saturating_sub(info.free_bytes)
                .saturating_sub(others)
                .saturating_sub(reserved);
        }
        report.host_weight_bytes = rt.backend().map_or(0, |b| b.host_weight_bytes());
        let mut plan = rt.request_plan().cloned();
        report.enable_plan.clone_from(&plan);
        report.inputs = rt.planner_inputs().cloned();
        report.warmup_s = report.inputs.as_ref().and_then(|i| match &i.source {
            InputSource::Warmup { seconds, .. } => Some(*seconds),
            _ => None,
        });
        if spec.config.device_budget.is_some() && plan.is_none() {
            bail!("{}: a device budget enabled no request plan", spec.name);
        }
        if let Some(p) = &plan {
            println!(
                "\n== {}: enable {:.2} s{}\n{p}",
                spec.name,
                report.enable_s,
                report
                    .warmup_s
                    .map_or(String::new(), |w| format!(" (warm-up {w:.2} s)"))
            );
        }
        for _ in 0..spec.untimed {
            rt.serve(&self.shape)
                .with_context(|| format!("{}: an untimed request", spec.name))?;
        }
        let mut outputs = Vec::new();
        for i in 0..spec.timed {
            self.device.synchronize_stream(&self.stream)?;
            let t = Instant::now();
            rt.serve(&self.shape)
                .with_context(|| format!("{}: timed request {}", spec.name, i + 1))?;
            self.device.synchronize_stream(&self.stream)?;
            report.request_s.push(t.elapsed().as_secs_f64());
            outputs.push(lock(&self.work.output).take());
        }
        if spec.instrumented {
            *lock(&self.work.log) = Some(PhaseLog::new(others));
            let served = rt.serve(&self.shape);
            let log = lock(&self.work.log).take();
            served.with_context(|| format!("{}: the instrumented request", spec.name))?;
            outputs.push(lock(&self.work.output).take());
            let measured = log.map(|l| l.done).unwrap_or_default();
            let now = rt.request_plan().cloned();
            report.replanned = now != plan;
            plan = now;
            let bounds: Option<PlanBounds> = match &plan {
                Some(p) => Some(plan_bounds(&self.pipeline, &spec.config, p)?),
                None => None,
            };
            report.phases = measured
                .into_iter()
                .map(|m| self.phase_row(m, plan.as_ref(), bounds.as_ref()))
                .collect();
        } else {
            let now = rt.request_plan().cloned();
            report.replanned = now != plan;
            plan = now;
        }
        report.outputs_agree = outputs.windows(2).all(|w| w[0] == w[1]);
        report.output = outputs.first().copied().flatten();
        report.median_request_s = middle(&report.request_s);
        if let Some(p) = &plan {
            report.predicted_request_s = Some(p.predicted_request_s);
            report.predicted_over_measured = (report.median_request_s > 0.0)
                .then(|| p.predicted_request_s / report.median_request_s);
            report.prediction_in_target = report
                .predicted_over_measured
                .map(|x| (0.95..=1.05).contains(&x));
            report.modes = modes(p);
            report.plan_text = Some(p.to_string());
        } else {
            report.modes = "every component resident".to_owned();
        }
        report.plan = plan;
        rt.disable()
            .with_context(|| format!("{}: disable", spec.name))?;
        eprintln!(
            "{}: enable {:.2} s, request {:.3} s (median of {:?}), output {:?}",
            spec.name, report.enable_s, report.median_request_s, report.request_s, report.output
        );
        Ok(())
    }

    fn phase_row(
        &self,
        m: MeasuredPhase,
        plan: Option<&RequestPlan>,
        bounds: Option<&PlanBounds>,
    ) -> PhaseRow {
        let c = plan.and_then(|p| p.component(&m.component));
        let budget = plan.map(|p| p.budget_bytes);
        let within = |v: u64| budget.map(|b| v <= b);
        let bound = bounds
            .and_then(|b| b.phase(&m.component))
            .map(|b| b.device_weight_bytes);
        PhaseRow {
            mode: c.map(|c| c.mode.to_string()),
            kept: c.map(|c| c.kept),
            predicted_s: c.map(|c| c.predicted_s),
            predicted_peak_bytes: c.map(|c| c.peak.total()),
            predicted_activation_bytes: c.map(|c| c.peak.activation_bytes),
            activation_bytes: self.work.preset.component_activation_bytes(
                &self.pipeline,
                &m.component,
                self.shape.tokens,
            ),
            weight_bound_bytes: bound,
            budget_bytes: budget,
            pool_within_budget: within(m.pool_used_peak_bytes),
            reserved_within_budget: within(m.pool_reserved_peak_bytes),
            info_within_budget: within(m.info_used_peak_bytes),
            within_bound: bound.map(|b| m.weight_peak_bytes <= b),
            measured: m,
        }
    }
}

/// The coded-block file the coded runs read (`--coded-blocks`).
#[derive(Clone, Debug, Default, Serialize)]
struct CodedFileReport {
    path: String,
    /// Why it was written in this run (absent, or not covering the
    /// pipeline's blocks), if it was.
    written: Option<String>,
    /// Seconds the write took (`pack_blocks`), if written.
    write_s: Option<f64>,
    /// Seconds opening it took, with its coverage checked.
    open_s: f64,
    /// Blocks of the pipeline (every stack's, as the backends pack them).
    blocks: usize,
    /// Of them, those the file holds coded from these weights.
    covered: usize,
    /// Bytes of the file's blobs.
    coded_bytes: u64,
    /// The bf16 bytes they decode to.
    decoded_bytes: u64,
}

/// Of `pipeline`'s blocks (every stack's, as the backends pack them over
/// `weights`), how many there are and those `blocks` does not hold coded
/// from `weights`, each with why.
fn uncovered(
    blocks: &offload_pack::blocks_file::CodedBlocks,
    pipeline: &Pipeline,
    weights: &dyn WeightSource,
) -> Result<(usize, Vec<String>)> {
    let part = offload_core::runtime::packing_for(pipeline, weights)
        .map_err(|e| anyhow::anyhow!("the pipeline's packing: {e}"))?;
    let mut missing = Vec::new();
    for u in part.blocks.values() {
        match blocks.checked_region(u, weights) {
            Ok(Some(_)) => {}
            Ok(None) => missing.push(format!(
                "{}: not in the file (or laid out otherwise)",
                u.name
            )),
            Err(e) => missing.push(format!("{}: {e}", u.name)),
        }
    }
    Ok((part.blocks.len(), missing))
}

/// The coded-block file at `path` of every block of `pipeline` over
/// `weights`, opened: written first where absent, and written again where
/// it is a coded-block file that lacks some block or holds one coded from
/// other weights (a DiT-only file, or one of another checkpoint); a file
/// that is not a coded-block file is an error, never overwritten.
fn coded_blocks_file(
    path: &std::path::Path,
    pipeline: &Pipeline,
    weights: &Arc<Loaded>,
) -> Result<(offload_pack::blocks_file::CodedBlocks, CodedFileReport)> {
    use offload_pack::blocks_file::{CodedBlocks, pack_blocks};
    let source = &**weights as &dyn WeightSource;
    let mut report = CodedFileReport {
        path: path.display().to_string(),
        ..CodedFileReport::default()
    };
    let why = if path.exists() {
        let t = Instant::now();
        let blocks = CodedBlocks::open(path).map_err(|e| {
            anyhow::anyhow!(
                "--coded-blocks {}: exists and is not a coded-block file this build reads ({e}); remove it or name another path",
                path.display()
            )
        })?;
        let (n, missing) = uncovered(&blocks, pipeline, source)?;
        if missing.is_empty() {
            report.open_s = t.elapsed().as_secs_f64();
            report.blocks = n;
            report.covered = n;
            report.coded_bytes = blocks.coded_bytes();
            report.decoded_bytes = blocks.blocks().map(|(_, e)| e.decoded_bytes).sum();
            eprintln!(
                "coded-block file {}: every one of the pipeline's {n} blocks held, coded from these weights ({:.2} GB); opened and checked in {:.2} s",
                path.display(),
                gb(report.coded_bytes),
                report.open_s
            );
            return Ok((blocks, report));
        }
        // Unmapped before the file is replaced (removed and written anew,
        // never written under the mapping).
        drop(blocks);
        std::fs::remove_file(path)
            .with_context(|| format!("removing the coded-block file {}", path.display()))?;
        format!(
            "it held {} of the pipeline's {n} blocks coded from these weights; first missing or stale: {}",
            n - missing.len(),
            missing[0]
        )
    } else {
        "absent".to_owned()
    };
    eprintln!("coded-block file {}: writing it ({why})", path.display());
    let t = Instant::now();
    let r = pack_blocks(
        path,
        pipeline,
        source,
        &offload_pack::format::EncodeConfig::default(),
    )
    .with_context(|| format!("writing the coded-block file {}", path.display()))?;
    report.write_s = Some(t.elapsed().as_secs_f64());
    report.written = Some(why);
    eprintln!(
        "coded-block file {}: {} blocks, {:.2} of {:.2} GB ({:.4}) written in {:.1} s",
        path.display(),
        r.blocks,
        gb(r.coded_bytes),
        gb(r.decoded_bytes),
        r.coded_bytes as f64 / r.decoded_bytes.max(1) as f64,
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let blocks = CodedBlocks::open(path)
        .with_context(|| format!("opening the coded-block file {}", path.display()))?;
    let (n, missing) = uncovered(&blocks, pipeline, source)?;
    ensure!(
        missing.is_empty(),
        "the coded-block file {} just written holds {} of the pipeline's {n} blocks: {}",
        path.display(),
        n - missing.len(),
        missing.join("; ")
    );
    report.open_s = t.elapsed().as_secs_f64();
    report.blocks = n;
    report.covered = n;
    report.coded_bytes = blocks.coded_bytes();
    report.decoded_bytes = r.decoded_bytes;
    eprintln!(
        "coded-block file opened and every block checked in {:.2} s ({:.2} GB)",
        report.open_s,
        gb(report.coded_bytes)
    );
    Ok((blocks, report))
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

fn yes(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "–",
    }
}

/// The pipeline mode: see the module docs.
pub(crate) fn main(args: &Args, bugs: &[PlantedBug]) -> Result<()> {
    let settings = PipelineSettings::from_args(args)?;
    if args.trace_dir.is_some() {
        eprintln!("--trace-dir: the pipeline mode writes no traces (the DiT-only mode does)");
    }
    let plant_name = bugs.first().map(|b| b.name());
    if !driver_present() {
        bail!("no CUDA driver found: the benchmark needs a GPU");
    }
    let device = Arc::new(CudaDevice::new(0)?);
    let stream = Arc::new(device.create_stream()?);
    device.label_stream(&stream, crate::timeline::COMPUTE);
    let preset = flux1_dev();
    let pipeline = preset.pipeline.clone();
    let mut shape = preset.request(settings.tokens, settings.steps);
    shape.warmup_steps = shape.warmup_steps.min(shape.steps).max(1);
    shape
        .validate()
        .map_err(|e| anyhow::anyhow!("the request shape: {e}"))?;
    let weight_bytes: u64 = pipeline.storages().map(|(_, s)| s.bytes).sum();
    let total = device.memory_info()?.total_bytes;
    let bw = bandwidth(&device, &stream)?;
    eprintln!("pinned host→device (fresh 1 GiB buffer): {bw:.2} GB/s");
    let t = Instant::now();
    let loaded = Arc::new(load(&pipeline, args.law.law())?);
    let load_s = t.elapsed().as_secs_f64();
    eprintln!(
        "weights in host memory: {:.1} GB in {load_s:.1} s",
        gb(loaded.bytes())
    );
    // The proxy's scratch: small, GEMMs chunked; at least one head of
    // attention at these tokens.
    let (att_in, att_out) = Proxy::attention_scratch(1, shape.tokens, crate::HEAD_DIM);
    let input_bytes = PROXY_INPUT_BYTES.max(att_in).max(CHAIN_ELEMENTS * 2);
    let output_bytes = PROXY_OUTPUT_BYTES.max(att_out);
    device.synchronize()?;
    let pool_before = device.pool_used()?.0;
    let proxy = crate::new_proxy(&device, &stream, input_bytes, output_bytes)?;
    let scratch_bytes = device.pool_used()?.0.saturating_sub(pool_before);
    let elementwise_gbps = traffic_gbps(&device, &stream, &proxy)?;
    eprintln!(
        "proxy scratch {:.3} GB (activations {:.3} GB, outputs {:.3} GB, cuBLAS workspace {:.3} GB); elementwise traffic kernel {elementwise_gbps:.0} GB/s",
        gb(scratch_bytes),
        gb(input_bytes),
        gb(output_bytes),
        gb(CUBLAS_WORKSPACE_BYTES)
    );
    let encoders = preset
        .encoders
        .iter()
        .map(|e| EncoderWork::of(&pipeline, e, preset.text_tokens))
        .collect::<Result<Vec<_>>>()?;
    let (height, width) = output_size(&preset, &shape);
    let vae_tflops: f64 = preset
        .vaes
        .iter()
        .map(|v| vae_flops(&pipeline, v, height, width))
        .sum::<f64>()
        / 1e12;
    let components: Vec<serde_json::Value> = preset
        .encoders
        .iter()
        .chain(&preset.dits)
        .chain(&preset.vaes)
        .map(|c| {
            let m = pipeline.module_id(c);
            serde_json::json!({
                "path": c,
                "bytes": m.map_or(0, |m| pipeline.subtree_bytes(m)),
                "blocks": m.map_or(0, |m| blocks_of(&pipeline, m).len()),
                "activation_bytes": preset.component_activation_bytes(&pipeline, c, shape.tokens),
            })
        })
        .collect();
    println!(
        "Flux.1-dev pipeline, {:.2} GB bf16 ({}); request {shape} (warm-up {} steps); {}; {:.1} GB of device memory; pinned host→device {bw:.2} GB/s",
        gb(weight_bytes),
        components
            .iter()
            .map(|c| format!(
                "{} {:.2} GB, activations {:.3} GB",
                c["path"].as_str().unwrap_or(""),
                gb(c["bytes"].as_u64().unwrap_or(0)),
                gb(c["activation_bytes"].as_u64().unwrap_or(0))
            ))
            .collect::<Vec<_>>()
            .join("; "),
        shape.warmup_steps,
        device.name(),
        gb(total)
    );
    println!(
        "proxy: encoders {}; VAE convs as GEMMs, {vae_tflops:.2} TFLOP per decode; scratch {:.3} GB held in every phase; elementwise kernel {elementwise_gbps:.0} GB/s",
        encoders
            .iter()
            .map(|e| format!("{} on {} rows, {} heads", e.path, e.rows, e.heads))
            .collect::<Vec<_>>()
            .join(", "),
        gb(scratch_bytes)
    );
    // The codec and, with --coded-blocks, the coded-block file of every
    // stack's blocks (written first when absent or not covering them, then
    // opened: every block checked), for the runs that code blocks.
    let mut coded_file: Option<CodedFileReport> = None;
    let codec = if settings
        .compressions
        .iter()
        .any(|c| *c != crate::Compression::None)
    {
        let codec = Arc::new(
            offload_cuda::decode::CudaCodec::new(&device)
                .context("loading the block decoder (nvrtc)")?,
        );
        let weights: Arc<dyn WeightSource> = match &args.coded_blocks {
            Some(path) => {
                let (blocks, report) = coded_blocks_file(path, &pipeline, &loaded)?;
                coded_file = Some(report);
                Arc::new(offload_pack::blocks_file::WithCodedBlocks {
                    inner: Arc::clone(&loaded) as Arc<dyn WeightSource>,
                    blocks,
                })
            }
            None => Arc::clone(&loaded) as Arc<dyn WeightSource>,
        };
        Some((codec, weights))
    } else {
        None
    };
    let work = Arc::new(Work {
        proxy,
        preset: preset.clone(),
        encoders: encoders.clone(),
        output: Mutex::new(None),
        log: Mutex::new(None),
    });
    let bench = Bench {
        device: Arc::clone(&device),
        stream: Arc::clone(&stream),
        pipeline: pipeline.clone(),
        loaded: Arc::clone(&loaded),
        codec,
        work: Arc::clone(&work),
        shape: shape.clone(),
        bugs,
    };
    let suffix = plant_name
        .as_ref()
        .map_or(String::new(), |n| format!(" (planted {n})"));
    let header = serde_json::json!({
        "mode": "pipeline",
        "device": device.name(),
        "attention": crate::attention_kind().name(),
        "device_total_bytes": total,
        "pinned_h2d_gbps": bw,
        "elementwise_gbps": elementwise_gbps,
        "shape": shape,
        "weight_bytes": weight_bytes,
        "components": components,
        "encoders": encoders,
        "vae_tflops": vae_tflops,
        "proxy_scratch_bytes": scratch_bytes,
        "proxy_input_bytes": input_bytes,
        "proxy_output_bytes": output_bytes,
        "load_s": load_s,
        "planted": plant_name,
        "weight_compression": settings
            .compressions
            .iter()
            .map(|c| c.config().to_string())
            .collect::<Vec<_>>(),
        "coded_blocks_file": coded_file,
    });
    // The JSON after every run: a run cut short by a time limit leaves
    // the ones before.
    let dump = |runs: &[RunReport], saved: &serde_json::Value, complete: bool| -> Result<()> {
        let mut doc = header.clone();
        doc["complete"] = complete.into();
        doc["runs"] = serde_json::to_value(runs)?;
        doc["saved"] = saved.clone();
        std::fs::write(&args.json, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("writing {}", args.json.display()))
    };
    let mut runs: Vec<RunReport> = Vec::new();
    // Each run's output against the resident run's (the first), then the
    // JSON so far.
    let push = |runs: &mut Vec<RunReport>, mut r: RunReport, saved: &serde_json::Value| {
        let resident = runs
            .first()
            .filter(|f| f.name == "resident" && f.error.is_none())
            .and_then(|f| f.output);
        if r.name != "resident" {
            r.output_equals_resident = resident.zip(r.output).map(|(a, b)| a == b);
        }
        r.dit = dit_row(&r, runs.first().filter(|f| f.name == "resident"), bw);
        runs.push(r);
        dump(runs, saved, false)
    };
    // Resident first: the reference output and the compute floor.
    let most_activations = preset
        .encoders
        .iter()
        .chain(&preset.dits)
        .chain(&preset.vaes)
        .map(|c| preset.component_activation_bytes(&pipeline, c, shape.tokens))
        .max()
        .unwrap_or(0);
    let free = device.memory_info()?.free_bytes;
    let resident_needs = weight_bytes + most_activations + RESIDENT_HEADROOM_BYTES;
    if resident_needs <= free {
        let r = bench.run(&RunSpec {
            name: "resident".to_owned(),
            config: OffloadConfig::default(),
            planner: None,
            untimed: settings.resident_warmup,
            timed: settings.requests,
            instrumented: true,
            plant: false,
        });
        push(&mut runs, r, &serde_json::Value::Null)?;
    } else {
        let r = RunReport {
            name: "resident".to_owned(),
            error: Some(format!(
                "not run: the whole pipeline needs {:.2} GB with its activations and headroom, and {} has {:.2} GB free",
                gb(resident_needs),
                device.name(),
                gb(free)
            )),
            ..RunReport::default()
        };
        push(&mut runs, r, &serde_json::Value::Null)?;
    }
    let mut saved: Option<(RunReport, PlannerInputs)> = None;
    for (&b, &compression) in settings
        .budgets
        .iter()
        .flat_map(|b| settings.compressions.iter().map(move |c| (b, c)))
    {
        let config = OffloadConfig {
            device_budget: Some(b),
            weight_compression: (compression != crate::Compression::None)
                .then(|| compression.config()),
            ..OffloadConfig::default()
        };
        // Rows named by budget, and by compression where it codes.
        let suffix = match compression {
            crate::Compression::None => suffix.clone(),
            c => format!(" {}{suffix}", c.config()),
        };
        let spec = |name: String| RunSpec {
            name,
            config: config.clone(),
            planner: None,
            untimed: 0,
            timed: settings.requests,
            instrumented: true,
            plant: true,
        };
        let report = match (b, settings.hog_gib) {
            (DeviceBudget::Auto, Some(gib)) => {
                bench.others()?;
                match Hog::start(gib, &device) {
                    Ok((mut hog, mut info)) => {
                        eprintln!(
                            "hog (pid {}): {:.1} GB held in {:.1} s; {:.1} GB free",
                            info.pid,
                            gb(info.held_bytes),
                            info.start_s,
                            gb(info.free_with_hog_bytes)
                        );
                        let mut r = bench.run(&spec(format!("auto beside {gib} GiB{suffix}")));
                        info.stopped = hog.stop(HOG_STOP);
                        info.free_after_stop_bytes =
                            device.memory_info().ok().map(|i| i.free_bytes);
                        r.hog = Some(info);
                        r
                    }
                    Err(e) => RunReport {
                        name: format!("auto beside {gib} GiB{suffix}"),
                        device_budget: Some("auto".to_owned()),
                        weight_compression: config.compression().to_string(),
                        error: Some(format!("{e:#}")),
                        ..RunReport::default()
                    },
                }
            }
            _ => bench.run(&spec(format!("{b}{suffix}"))),
        };
        if settings.saved_from == Some(b)
            && compression == settings.compressions[0]
            && let Some(inputs) = &report.inputs
            && report.error.is_none()
        {
            saved = Some((report.clone(), inputs.clone()));
        }
        push(&mut runs, report, &serde_json::Value::Null)?;
    }
    // Saved measurements: written as a file, read back, given to a run
    // without a warm-up.
    let mut saved_report = serde_json::Value::Null;
    if let Some(b) = settings.saved_from {
        match &saved {
            Some((from, inputs)) => {
                let path = args
                    .json
                    .with_extension(format!("inputs-{}.json", crate::slug(&b.to_string())));
                let text = inputs.to_json();
                std::fs::write(&path, &text)
                    .with_context(|| format!("writing {}", path.display()))?;
                let reread = PlannerInputs::from_json_str(&text)
                    .map_err(|e| anyhow::anyhow!("reading back {}: {e}", path.display()))?;
                let compression = settings.compressions[0];
                let config = OffloadConfig {
                    device_budget: Some(b),
                    weight_compression: (compression != crate::Compression::None)
                        .then(|| compression.config()),
                    ..OffloadConfig::default()
                };
                let r = bench.run(&RunSpec {
                    name: format!("{b}, saved measurements{suffix}"),
                    config,
                    planner: Some(reread),
                    untimed: 0,
                    timed: 1,
                    instrumented: false,
                    plant: true,
                });
                // The plan in force after its enable, against the one the
                // warm-up made.
                let first_plan = from.enable_plan.as_ref();
                let same_choices = match (&r.plan, first_plan) {
                    (Some(a), Some(b)) => Some(a.choices() == b.choices()),
                    _ => None,
                };
                let same_prediction = match (&r.plan, first_plan) {
                    (Some(a), Some(b)) => Some(
                        (a.predicted_request_s - b.predicted_request_s).abs()
                            <= 1e-9 * b.predicted_request_s.abs().max(1.0),
                    ),
                    _ => None,
                };
                saved_report = serde_json::json!({
                    "from": from.name,
                    "file": path.display().to_string(),
                    "enable_s": r.enable_s,
                    "enable_with_warmup_s": from.enable_s,
                    "warmup_s": from.warmup_s,
                    "faster": r.error.is_none() && r.enable_s < from.enable_s,
                    "same_choices": same_choices,
                    "same_prediction": same_prediction,
                    "replanned_before": from.replanned,
                });
                push(&mut runs, r, &saved_report)?;
            }
            None => {
                saved_report = serde_json::json!({"error": format!("the {b} run gave no measurements to save")});
            }
        }
    }
    let resident_output = runs
        .iter()
        .find(|r| r.name == "resident" && r.error.is_none())
        .and_then(|r| r.output);
    print_tables(&runs, &saved_report, resident_output, bw);
    dump(&runs, &saved_report, true)?;
    drop(bench);
    match Arc::try_unwrap(work) {
        Ok(w) => w.proxy.free()?,
        Err(_) => eprintln!("the proxy is still shared; it is freed at exit"),
    }
    verdict(&runs, &plant_name)
}

/// The tables: each run's phases, the summary of whole requests, then
/// each planned run's DiT phase (printed last).
fn print_tables(
    runs: &[RunReport],
    saved: &serde_json::Value,
    resident_output: Option<u64>,
    bw_gbps: f64,
) {
    println!(
        "\nPhases of each run's instrumented request (GB; peaks from the phase's first forward to its end)"
    );
    println!(
        "| run | phase | forwards | mode | predicted s | measured s | predicted / measured | planned peak | activations planned / held | allocator in use | allocator reserved | cuMemGetInfo | weights (backend) | INV-7 weight bound | budget | in use ≤ budget | reserved ≤ budget | cuMemGetInfo ≤ budget | weights ≤ bound |"
    );
    println!(
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    let opt = |v: Option<u64>| v.map_or("–".to_owned(), |b| format!("{:.2}", gb(b)));
    for r in runs {
        for p in &r.phases {
            let m = &p.measured;
            println!(
                "| {} | {} | {} | {} | {} | {:.3} | {} | {} | {} / {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {} |",
                r.name,
                m.component,
                m.forwards,
                p.mode.as_deref().unwrap_or("resident"),
                p.predicted_s.map_or("–".to_owned(), |s| format!("{s:.3}")),
                m.seconds,
                p.predicted_s.map_or("–".to_owned(), |s| format!(
                    "{:.3}",
                    s / m.seconds.max(1e-12)
                )),
                opt(p.predicted_peak_bytes),
                opt(p.predicted_activation_bytes),
                gb(p.activation_bytes),
                gb(m.pool_used_peak_bytes),
                gb(m.pool_reserved_peak_bytes),
                gb(m.info_used_peak_bytes),
                gb(m.weight_peak_bytes),
                opt(p.weight_bound_bytes),
                opt(p.budget_bytes),
                yes(p.pool_within_budget),
                yes(p.reserved_within_budget),
                yes(p.info_within_budget),
                yes(p.within_bound),
            );
        }
    }
    for r in runs.iter().filter(|r| r.hog.is_some()) {
        let h = r.hog.as_ref().expect("filtered");
        let free_at_enable = r.plan.as_ref().map(|p| p.device.free_bytes);
        let (budget, source) = match r.plan.as_ref().map(|p| (p.budget_bytes, p.budget)) {
            Some((b, BudgetSource::Auto { headroom_bytes, .. })) => (
                Some(b),
                format!("free − {:.2} GB headroom", gb(headroom_bytes)),
            ),
            Some((b, _)) => (Some(b), "given".to_owned()),
            None => (None, String::new()),
        };
        let oom = match &r.error {
            None if !r.replanned => "no out-of-memory (no re-plan)".to_owned(),
            None => "a first-request shortfall, re-planned once".to_owned(),
            Some(e) => format!("failed: {e}"),
        };
        println!(
            "\nauto beside another process (pid {}, {} GiB asked, {:.2} GB held in {:.1} s): free at enable {}, the plan's budget {} ({source}), largest phase in use {:.2} GB (cuMemGetInfo {:.2} GB); {oom}; the hog {}",
            h.pid,
            h.gib,
            gb(h.held_bytes),
            h.start_s,
            opt(free_at_enable),
            opt(budget),
            gb(r.peak(|m| m.pool_used_peak_bytes)),
            gb(r.peak(|m| m.info_used_peak_bytes)),
            h.stopped
        );
    }
    if let Some(from) = saved.get("from").and_then(|v| v.as_str()) {
        let f = |k: &str| {
            saved
                .get(k)
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(0.0)
        };
        let b = |k: &str| yes(saved.get(k).and_then(serde_json::Value::as_bool));
        println!(
            "\nsaved measurements of the {from} run ({}): enable {:.2} s without a warm-up against {:.2} s with one (its warm-up {:.2} s): faster {}; the same choices {}; the same predicted request {}",
            saved.get("file").and_then(|v| v.as_str()).unwrap_or(""),
            f("enable_s"),
            f("enable_with_warmup_s"),
            f("warmup_s"),
            b("faster"),
            b("same_choices"),
            b("same_prediction"),
        );
    } else if !saved.is_null() {
        println!("\nsaved measurements: {saved}");
    }
    println!(
        "\nWhole requests (time per image = the median request, batch 1; resident output {})",
        resident_output.map_or("unknown".to_owned(), |o| format!("{o:#018x}"))
    );
    println!(
        "| run | compression | modes | enable s (warm-up s) | predicted s | measured s | predicted / measured | largest phase GB: in use / cuMemGetInfo | budget GB | peaks ≤ budget | weights ≤ INV-7 bound | output = resident | error |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in runs {
        let within = match (
            r.all(|p| p.pool_within_budget),
            r.all(|p| p.info_within_budget),
        ) {
            (None, _) => "–".to_owned(),
            (a, b) => format!("{} (cuMemGetInfo {})", yes(a), yes(b)),
        };
        println!(
            "| {} | {} | {} | {:.2}{} | {} | {:.3} | {} | {:.2} / {:.2} | {} | {} | {} | {} | {} |",
            r.name,
            r.weight_compression,
            r.modes,
            r.enable_s,
            r.warmup_s.map_or(String::new(), |w| format!(" ({w:.2})")),
            r.predicted_request_s
                .map_or("–".to_owned(), |s| format!("{s:.3}")),
            r.median_request_s,
            r.predicted_over_measured
                .map_or("–".to_owned(), |x| format!(
                    "{x:.3} (in 0.95–1.05: {})",
                    yes(r.prediction_in_target)
                )),
            gb(r.peak(|m| m.pool_used_peak_bytes)),
            gb(r.peak(|m| m.info_used_peak_bytes)),
            opt(r.plan.as_ref().map(|p| p.budget_bytes)),
            within,
            yes(r.all(|p| p.within_bound)),
            match (r.name.as_str(), r.output_equals_resident) {
                ("resident", _) => "(reference)",
                (_, Some(true)) => "yes",
                (_, Some(false)) => "NO",
                (_, None) => "–",
            },
            r.error.as_deref().unwrap_or(""),
        );
    }
    print_dit_table(runs, bw_gbps);
}

/// The DiT phase of each planned run ([`DitRow`], printed last): what its
/// plan streams and codes per forward, and its measured forward against
/// the bf16 link limit and the plan's prediction.
fn print_dit_table(runs: &[RunReport], bw_gbps: f64) {
    let rows: Vec<(&RunReport, &DitRow)> = runs
        .iter()
        .filter_map(|r| r.dit.as_ref().map(|d| (r, d)))
        .collect();
    if rows.is_empty() {
        return;
    }
    let resident = rows
        .iter()
        .find_map(|(_, d)| d.resident_forward_s)
        .map_or("– (no resident run)".to_owned(), |f| format!("{f:.4} s"));
    println!(
        "\nThe DiT phase per forward (GB; the plan's streamed bf16 bytes, the bytes on the link and the decode staging; bf16 link limit = max(resident DiT forward {resident}, streamed bf16 / pinned {bw_gbps:.2} GB/s); measured = the instrumented request's phase / forwards)"
    );
    println!(
        "| run | compression | streamed / blocks | coded blocks | bf16 GB | link GB | link / bf16 | staging GB | decode s | measured s | bf16 link limit s | measured / limit | predicted s | predicted / measured | output = resident |"
    );
    println!(
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    let f4 = |v: Option<f64>| v.map_or("–".to_owned(), |x| format!("{x:.4}"));
    let f3 = |v: Option<f64>| v.map_or("–".to_owned(), |x| format!("{x:.3}"));
    for (r, d) in rows {
        println!(
            "| {} | {} | {}/{} | {} | {:.2} | {:.2} | {:.3} | {:.3} | {:.4} | {} | {:.4} | {} | {:.4} | {} | {} |",
            r.name,
            r.weight_compression,
            d.streamed_blocks,
            d.blocks,
            d.coded_blocks,
            gb(d.streamed_bytes),
            gb(d.link_bytes),
            d.link_over_bf16,
            gb(d.staging_bytes),
            d.decode_s_per_forward,
            f4(d.forward_s),
            d.bf16_link_limit_s,
            f3(d.forward_over_limit),
            d.predicted_forward_s,
            f3(d.predicted_over_measured),
            yes(r.output_equals_resident),
        );
    }
}

/// The exit status: every run ran, every output equals resident (or, with
/// a planted bug, some differ), no phase over its budget or its bound.
fn verdict(runs: &[RunReport], plant: &Option<String>) -> Result<()> {
    let failed: Vec<&str> = runs
        .iter()
        .filter(|r| r.error.is_some())
        .map(|r| r.name.as_str())
        .collect();
    let over: Vec<&str> = runs
        .iter()
        .filter(|r| {
            // The allocator's figure, the device's free-memory figure
            // (what this process holds beyond what others held before the
            // run) and the weights against their INV-7 bound.
            r.all(|p| p.pool_within_budget) == Some(false)
                || r.all(|p| p.info_within_budget) == Some(false)
                || r.all(|p| p.within_bound) == Some(false)
        })
        .map(|r| r.name.as_str())
        .collect();
    let differing: Vec<&str> = runs
        .iter()
        .filter(|r| {
            r.output_equals_resident == Some(false) || (!r.outputs_agree && r.error.is_none())
        })
        .map(|r| r.name.as_str())
        .collect();
    let mut problems = Vec::new();
    if !failed.is_empty() {
        problems.push(format!("runs failed: {}", failed.join(", ")));
    }
    if !over.is_empty() {
        problems.push(format!(
            "over the budget (allocator or cuMemGetInfo) or INV-7's bound in some phase: {}",
            over.join(", ")
        ));
    }
    match plant {
        None if !differing.is_empty() => problems.push(format!(
            "outputs differ from resident (a correctness bug): {}",
            differing.join(", ")
        )),
        Some(name) if differing.is_empty() => problems.push(format!(
            "planted {name}: every output equals resident (the bug went unseen)"
        )),
        Some(name) => println!(
            "planted {name}: {} differ from resident (caught)",
            differing.join(", ")
        ),
        None => println!("every output equals resident"),
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn settings(flags: &[&str]) -> Result<PipelineSettings> {
        let args = Args::try_parse_from(
            ["offload-bench", "--pipeline"]
                .into_iter()
                .chain(flags.iter().copied()),
        )?;
        PipelineSettings::from_args(&args)
    }

    #[test]
    fn pipeline_flags_are_checked() {
        let s = settings(&[]).unwrap();
        assert_eq!((s.tokens, s.steps, s.requests), (4608, 28, 2));
        assert_eq!(s.budgets.len(), 5);
        assert_eq!(
            s.saved_from,
            Some(DeviceBudget::Bytes(ByteSize::new(16 << 30)))
        );
        let s = settings(&["--budgets", "8GiB,auto", "--hog-gib", "110"]).unwrap();
        assert_eq!(
            s.saved_from,
            Some(DeviceBudget::Bytes(ByteSize::new(8 << 30)))
        );
        assert_eq!(s.hog_gib, Some(110));
        for (flags, want) in [
            (&["--tokens", "4608,16896"][..], "one token count"),
            (&["--budgets", "16GiB", "--hog-gib", "4"][..], "with `auto`"),
            (&["--hog-gib", "0"][..], "outside 1..=1024"),
            (&["--saved-from", "12GB"][..], "not a sized budget among"),
            (&["--budgets", "lots"][..], "--budgets"),
            (&["--requests", "0"][..], "--requests: 0"),
            (&["--steps", "0"][..], "--steps: 0"),
            (&["--ranks", "2"][..], "one GPU"),
            (
                &["--copy-beside"][..],
                "--copy-beside is the DiT-only mode's",
            ),
            (&["--coded-blocks", "x.opackb"][..], "lossless or auto only"),
        ] {
            let e = settings(flags)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains(want), "{flags:?}: {e}");
        }
        assert_eq!(
            settings(&["--saved-from", "none"]).unwrap().saved_from,
            None
        );
        assert_eq!(
            settings(&[]).unwrap().compressions,
            [crate::Compression::None]
        );
        for flags in [
            &["--weight-compression", "none", "--coded-blocks", "x.opackb"][..],
            &[
                "--weight-compression",
                "none,none",
                "--coded-blocks",
                "x.opackb",
            ][..],
        ] {
            let e = settings(flags).err().unwrap().to_string();
            assert!(e.contains("lossless or auto only"), "{flags:?}: {e}");
        }
        let e = settings(&["--weight-compression", "lossy"])
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("none") && e.contains("lossless") && e.contains("auto"),
            "{e}"
        );
        for flags in [
            &["--weight-compression", "auto", "--coded-blocks", "x.opackb"][..],
            &[
                "--weight-compression",
                "none,lossless",
                "--coded-blocks",
                "x.opackb",
            ][..],
        ] {
            settings(flags).unwrap_or_else(|e| panic!("{flags:?}: {e}"));
        }
        let s = settings(&["--weight-compression", "none,lossless,auto,lossless"]).unwrap();
        assert_eq!(
            s.compressions,
            [
                crate::Compression::None,
                crate::Compression::Lossless,
                crate::Compression::Auto
            ]
        );
    }

    #[test]
    fn budgets_without_pipeline_are_refused() {
        let args = Args::try_parse_from(["offload-bench", "--budgets", "16GiB"]).unwrap();
        let e = crate::Settings::from_args(&args).err().unwrap().to_string();
        assert!(e.contains("goes with --pipeline"), "{e}");
    }

    #[test]
    fn vae_convs_run_at_their_resolution() {
        let preset = flux1_dev();
        let p = &preset.pipeline;
        assert_eq!(conv_pixels("decoder.conv_in.weight", 1024, 1024), 128 * 128);
        assert_eq!(
            conv_pixels("decoder.up_blocks.2.resnets.0.conv1.weight", 1024, 1024),
            512 * 512
        );
        assert_eq!(conv_pixels("decoder.conv_out.weight", 1024, 1024), 1 << 20);
        let tflops = vae_flops(p, "vae", 1024, 1024) / 1e12;
        assert!((5.5..6.5).contains(&tflops), "{tflops}");
    }

    #[test]
    fn encoders_run_on_their_sequences() {
        let preset = flux1_dev();
        let p = &preset.pipeline;
        let clip = EncoderWork::of(p, "text_encoder", 512).unwrap();
        assert_eq!((clip.rows, clip.heads), (77, 12));
        let t5 = EncoderWork::of(p, "text_encoder_2", 512).unwrap();
        assert_eq!((t5.rows, t5.heads), (512, 64));
    }

    #[test]
    fn the_loader_packs_as_the_planned_backend() {
        // Every unit of every strategy's partition is one the loader
        // loaded with the same layout (else registration in place fails).
        let preset = flux1_dev();
        let p = &preset.pipeline;
        let part = crate::packing(p).unwrap();
        let config = OffloadConfig {
            device_budget: Some(DeviceBudget::Bytes(ByteSize::new(16 << 30))),
            ..OffloadConfig::default()
        };
        let resolved = offload_core::resolve(p, &config).unwrap();
        let groups: Vec<_> = resolved.components.iter().map(|c| c.module).collect();
        let planned = offload_core::runtime::partition(p, &resolved.stacks, &groups);
        assert_eq!(part, planned);
        assert_eq!(part.blocks.len(), 57 + 12 + 24);
    }

    /// The units every strategy's backend packs `p` in (the core's
    /// `plan_and_partition`: the planned resolution's stacks, the
    /// strategy's components as groups), each one the loader loaded with
    /// the same layout.
    #[test]
    fn every_strategy_packs_as_the_loader() {
        for pipeline in [flux1_dev().pipeline, offload_sim::presets::flux1_dev_dit()] {
            packs_as_the_loader(&pipeline);
        }
    }

    fn packs_as_the_loader(p: &Pipeline) {
        let loaded = crate::packing(p).unwrap();
        let every = offload_core::resolve(
            p,
            &OffloadConfig {
                device_budget: Some(DeviceBudget::Auto),
                ..OffloadConfig::default()
            },
        )
        .unwrap();
        let configs = [
            OffloadConfig::default(),
            OffloadConfig {
                enable_layerwise_offload: true,
                ..OffloadConfig::default()
            },
            OffloadConfig {
                enable_cpu_offload: true,
                ..OffloadConfig::default()
            },
        ];
        for config in configs {
            let plan = match offload_core::resolve(p, &config) {
                Ok(plan) => plan,
                // Model level refuses a pipeline with no encoder (it would
                // move nothing).
                Err(offload_core::PlanError::NothingToOffload { .. })
                    if config.enable_cpu_offload =>
                {
                    continue;
                }
                Err(e) => panic!("{config:?}: {e}"),
            };
            let groups: Vec<_> = plan.components.iter().map(|c| c.module).collect();
            let part = offload_core::runtime::partition(p, &every.stacks, &groups);
            for u in part.all() {
                let l = loaded.all().find(|l| l.name == u.name);
                assert_eq!(l, Some(u), "{config:?}: unit `{}`", u.name);
            }
        }
    }

    /// The simulated H200's run options, a workload of one request of 4
    /// steps of `preset`, the simulator's estimated planner inputs, and
    /// the least device budget the planner accepts on them.
    fn simulated(
        preset: &offload_sim::presets::Preset,
    ) -> (
        offload_sim::harness::RunOptions,
        offload_sim::harness::Workload,
        offload_core::budget::PlannerInputs,
        u64,
    ) {
        let opts = offload_sim::harness::RunOptions::new(offload_sim::DeviceProfile::h200());
        let w = offload_sim::harness::Workload {
            preset: preset.clone(),
            tokens: preset.default_tokens,
            steps: 4,
            requests: 1,
        };
        let inputs =
            offload_sim::plan::estimated_inputs(preset, &opts.profile, w.tokens, w.steps as u32);
        let least = offload_core::budget::plan(
            &preset.pipeline,
            &OffloadConfig {
                device_budget: Some(DeviceBudget::Auto),
                ..OffloadConfig::default()
            },
            &inputs,
            offload_core::budget::DeviceMemory::of(1 << 40),
        )
        .unwrap()
        .minimum
        .bytes;
        (opts, w, inputs, least)
    }

    /// On the simulated device, with the loader as the weight source:
    /// resident, layerwise, model level and a planned budget register
    /// every unit in place (none refused), and their outputs agree.
    #[test]
    fn backends_register_the_loaded_units_in_place() {
        use offload_sim::harness::{Rig, request};
        let preset = offload_sim::presets::tiny();
        let p = preset.pipeline.clone();
        let loaded = Arc::new(load(&p, offload_pack::synth::Law::Normal).unwrap());
        let (opts, w, inputs, budget) = simulated(&preset);
        let configs = [
            OffloadConfig::default(),
            OffloadConfig {
                enable_layerwise_offload: true,
                ..OffloadConfig::default()
            },
            OffloadConfig {
                enable_cpu_offload: true,
                ..OffloadConfig::default()
            },
            OffloadConfig {
                device_budget: Some(DeviceBudget::Bytes(ByteSize::new(budget))),
                ..OffloadConfig::default()
            },
        ];
        let mut outputs = Vec::new();
        for config in configs {
            let mut rig = Rig::with_weights(
                p.clone(),
                &opts,
                Arc::clone(&loaded) as Arc<dyn WeightSource>,
            )
            .unwrap();
            rig.platform.set_planner(inputs.clone());
            rig.runtime.enable_selected(&config, &rig.platform).unwrap();
            assert_eq!(loaded.mismatched(), 0, "{config:?}");
            let m = request(&rig.runtime, &rig.device, &rig.probe, &w).unwrap();
            outputs.push(m.output);
            rig.runtime.disable().unwrap();
        }
        assert!(outputs.windows(2).all(|o| o[0] == o[1]), "{outputs:?}");
    }

    /// `--coded-blocks`: the file of every stack's blocks written where
    /// absent, opened as it is where it covers them, written again where
    /// it holds blocks of other weights or of other layouts, and refused
    /// (left alone) where it is no coded-block file; on the simulator,
    /// planned `lossless` and `auto` over the loaded weights with the file
    /// beside them (as the coded rows run) stream coded blocks and give
    /// the resident output, and so does `none` over the plain weights.
    #[test]
    fn coded_runs_read_the_pipelines_coded_block_file() {
        use offload_pack::synth::Law;
        use offload_sim::harness::{Rig, request};
        let preset = offload_sim::presets::tiny_wide();
        let p = preset.pipeline.clone();
        let loaded = Arc::new(load(&p, Law::Normal).unwrap());
        let dir = std::env::temp_dir().join(format!("bench-coded-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pipeline.opackb");
        let blocks = crate::packing(&p).unwrap().blocks.len();
        let (_, r) = coded_blocks_file(&path, &p, &loaded).unwrap();
        assert_eq!(r.written.as_deref(), Some("absent"));
        assert_eq!((r.blocks, r.covered), (blocks, blocks));
        assert!(
            r.write_s.is_some() && r.coded_bytes < r.decoded_bytes,
            "{r:?}"
        );
        let (file, r) = coded_blocks_file(&path, &p, &loaded).unwrap();
        assert_eq!((r.written, r.covered), (None, blocks));

        // The coded rows' weights, as `main` makes them; the none rows'.
        let coded: Arc<dyn WeightSource> = Arc::new(offload_pack::blocks_file::WithCodedBlocks {
            inner: Arc::clone(&loaded) as Arc<dyn WeightSource>,
            blocks: file,
        });
        let (opts, w, inputs, least) = simulated(&preset);
        let total = preset.weight_bytes();
        let budget = least + (total - least) / 2;
        let mut outputs = Vec::new();
        for c in [
            None,
            Some(crate::Compression::Lossless),
            Some(crate::Compression::Auto),
            Some(crate::Compression::None),
        ] {
            let (config, weights) = match c {
                None => (
                    OffloadConfig::default(),
                    Arc::clone(&loaded) as Arc<dyn WeightSource>,
                ),
                Some(c) => (
                    OffloadConfig {
                        device_budget: Some(DeviceBudget::Bytes(ByteSize::new(budget))),
                        weight_compression: (c != crate::Compression::None).then(|| c.config()),
                        ..OffloadConfig::default()
                    },
                    if c == crate::Compression::None {
                        Arc::clone(&loaded) as Arc<dyn WeightSource>
                    } else {
                        Arc::clone(&coded)
                    },
                ),
            };
            let mut rig = Rig::with_weights(p.clone(), &opts, weights).unwrap();
            rig.platform.set_planner(inputs.clone());
            rig.runtime.enable_selected(&config, &rig.platform).unwrap();
            if c == Some(crate::Compression::Lossless) {
                let plan = rig.runtime.request_plan().expect("a plan");
                let dit = plan.component("transformer").expect("a DiT");
                assert!(
                    !dit.coded_blocks.is_empty() && dit.link_bytes < dit.streamed_bytes,
                    "{plan}"
                );
            }
            let m = request(&rig.runtime, &rig.device, &rig.probe, &w).unwrap();
            outputs.push(m.output);
            rig.runtime.disable().unwrap();
        }
        assert!(outputs.windows(2).all(|o| o[0] == o[1]), "{outputs:?}");
        assert_eq!(loaded.mismatched(), 0);

        // Coded from other weights (stale): written again.
        let other = load(&p, Law::Uniform).unwrap();
        let (_, r) = coded_blocks_file(&path, &p, &Arc::new(other)).unwrap();
        let why = r.written.unwrap();
        assert!(why.contains("held 0 of") && why.contains("stale"), "{why}");
        // Of other layouts (the narrower preset's blocks): written again.
        let narrow = offload_sim::presets::tiny().pipeline;
        let narrow_loaded = load(&narrow, Law::Normal).unwrap();
        offload_pack::blocks_file::pack_blocks(
            &path,
            &narrow,
            &narrow_loaded,
            &offload_pack::format::EncodeConfig::default(),
        )
        .unwrap();
        let (_, r) = coded_blocks_file(&path, &p, &loaded).unwrap();
        let why = r.written.unwrap();
        assert!(why.contains("not in the file"), "{why}");
        assert_eq!(r.covered, blocks);
        // Not a coded-block file: refused, left as it was.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"not a coded-block file").unwrap();
        let e = coded_blocks_file(&path, &p, &loaded)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("is not a coded-block file"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"not a coded-block file");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A planned run's DiT row: the plan's bytes per forward, the
    /// measured forward against `max(resident forward, bf16 / bandwidth)`
    /// and the plan's prediction.
    #[test]
    fn the_dit_row_sets_the_forward_against_the_bf16_link_limit() {
        let preset = offload_sim::presets::tiny_wide();
        let p = &preset.pipeline;
        let inputs = offload_sim::plan::estimated_inputs(
            &preset,
            &offload_sim::DeviceProfile::h200().clone(),
            preset.default_tokens,
            4,
        );
        let total = preset.weight_bytes();
        let plan = offload_core::budget::plan(
            p,
            &OffloadConfig {
                device_budget: Some(DeviceBudget::Bytes(ByteSize::new(total / 2))),
                ..OffloadConfig::default()
            },
            &inputs,
            offload_core::budget::DeviceMemory::of(1 << 40),
        )
        .unwrap();
        let c = plan.component("transformer").unwrap().clone();
        assert!(c.streamed_bytes > 0, "{plan}");
        let phase = |seconds: f64, forwards: u64| PhaseRow {
            measured: MeasuredPhase {
                component: "transformer".to_owned(),
                forwards,
                seconds,
                pool_used_peak_bytes: 0,
                pool_reserved_peak_bytes: 0,
                info_used_peak_bytes: 0,
                weight_peak_bytes: 0,
                info_used_at_start_bytes: 0,
                info_used_at_end_bytes: 0,
            },
            mode: None,
            kept: None,
            predicted_s: None,
            predicted_peak_bytes: None,
            predicted_activation_bytes: None,
            activation_bytes: 0,
            weight_bound_bytes: None,
            budget_bytes: None,
            pool_within_budget: None,
            reserved_within_budget: None,
            info_within_budget: None,
            within_bound: None,
        };
        let resident = RunReport {
            name: "resident".to_owned(),
            phases: vec![phase(0.4, 4)],
            ..RunReport::default()
        };
        let run = RunReport {
            name: "x".to_owned(),
            plan: Some(plan.clone()),
            phases: vec![phase(0.8, 4)],
            ..RunReport::default()
        };
        assert_eq!(dit_row(&resident, None, 50.0), None, "no plan, no row");
        // The link binds: 1 byte per second.
        let d = dit_row(&run, Some(&resident), 1e-9).unwrap();
        assert_eq!(d.streamed_bytes, c.streamed_bytes);
        assert_eq!((d.link_bytes, d.coded_blocks), (c.link_bytes, 0));
        assert_eq!(d.link_over_bf16, 1.0);
        assert_eq!((d.forward_s, d.resident_forward_s), (Some(0.2), Some(0.1)));
        assert_eq!(d.bf16_link_s, c.streamed_bytes as f64);
        assert_eq!(d.bf16_link_limit_s, c.streamed_bytes as f64);
        assert_eq!(d.forward_over_limit, Some(0.2 / c.streamed_bytes as f64));
        let predicted = c.predicted_s / c.forwards;
        assert_eq!(d.predicted_forward_s, predicted);
        assert_eq!(d.predicted_over_measured, Some(predicted / 0.2));
        // Compute binds: the resident forward.
        let d = dit_row(&run, Some(&resident), 1e12).unwrap();
        assert_eq!(d.bf16_link_limit_s, 0.1);
        assert_eq!(d.forward_over_limit, Some(2.0));
        // A failed resident run: the link alone.
        let failed = RunReport {
            error: Some("out of memory".to_owned()),
            ..resident.clone()
        };
        let d = dit_row(&run, Some(&failed), 1e12).unwrap();
        assert_eq!(d.resident_forward_s, None);
        assert_eq!(d.bf16_link_limit_s, d.bf16_link_s);
    }

    #[test]
    fn the_median_of_two_is_their_mean() {
        assert_eq!(middle(&[1.0, 3.0]), 2.0);
        assert_eq!(middle(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(middle(&[]), 0.0);
    }
}
