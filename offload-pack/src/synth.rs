//! Synthetic Flux-shaped DiTs whose weights look trained (normal or
//! Student-t at each tensor's init scale; uniform for comparison), and the
//! byte ratio the packer gets on them, tensor by tensor so that a
//! Flux.1-dev-sized model (11.9 B weights) never sits in memory whole.

use std::time::Instant;

use offload_core::model::DType;

use crate::container::{TensorIn, encode_tensor, plan_tensor};
use crate::format::{Code, EncodeConfig, Stats};

/// A Flux transformer's shape (diffusers' `FluxTransformer2DModel`
/// config; the shape list is the one `offload-candle`'s `weight_shapes`
/// writes, repeated here so this crate does not build candle).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FluxShape {
    /// Width of one head.
    pub head_dim: usize,
    /// Heads (`hidden = head_dim × heads`).
    pub heads: usize,
    /// Double-stream blocks.
    pub double: usize,
    /// Single-stream blocks.
    pub single: usize,
    /// Latent channels.
    pub in_channels: usize,
    /// Text states' width.
    pub joint: usize,
    /// Pooled text embedding's width.
    pub pooled: usize,
    /// Whether the guidance scale is embedded.
    pub guidance: bool,
}

impl FluxShape {
    /// Flux.1-dev: hidden 3072, 19 double and 38 single blocks, MLP ratio 4
    /// (11.9 B weights, 23.8 GB in bf16).
    pub fn dev() -> Self {
        Self {
            head_dim: 128,
            heads: 24,
            double: 19,
            single: 38,
            in_channels: 64,
            joint: 4096,
            pooled: 768,
            guidance: true,
        }
    }

    /// A reduced-width model for tests: hidden 384, 1 double and 2 single
    /// blocks (≈ 10 M weights).
    pub fn small() -> Self {
        Self {
            head_dim: 64,
            heads: 6,
            double: 1,
            single: 2,
            in_channels: 64,
            joint: 384,
            pooled: 256,
            guidance: true,
        }
    }

    /// The model width.
    pub fn hidden(&self) -> usize {
        self.head_dim * self.heads
    }

    /// Every tensor: name and shape, in diffusers' module order.
    pub fn tensors(&self) -> Vec<(String, Vec<u64>)> {
        let (h, d) = (self.hidden() as u64, self.head_dim as u64);
        let mut out = Vec::new();
        let mut lin = |name: String, o: u64, i: u64| {
            out.push((format!("{name}.weight"), vec![o, i]));
            out.push((format!("{name}.bias"), vec![o]));
        };
        lin("x_embedder".into(), h, self.in_channels as u64);
        lin("context_embedder".into(), h, self.joint as u64);
        let mut embedders = vec![("timestep_embedder", 256)];
        if self.guidance {
            embedders.push(("guidance_embedder", 256));
        }
        embedders.push(("text_embedder", self.pooled as u64));
        for (e, width) in embedders {
            lin(format!("time_text_embed.{e}.linear_1"), h, width);
            lin(format!("time_text_embed.{e}.linear_2"), h, h);
        }
        for i in 0..self.double {
            let p = format!("transformer_blocks.{i}");
            lin(format!("{p}.norm1.linear"), 6 * h, h);
            lin(format!("{p}.norm1_context.linear"), 6 * h, h);
            for n in [
                "to_q",
                "to_k",
                "to_v",
                "add_q_proj",
                "add_k_proj",
                "add_v_proj",
                "to_out.0",
                "to_add_out",
            ] {
                lin(format!("{p}.attn.{n}"), h, h);
            }
            for ff in ["ff", "ff_context"] {
                lin(format!("{p}.{ff}.net.0.proj"), 4 * h, h);
                lin(format!("{p}.{ff}.net.2"), h, 4 * h);
            }
        }
        for i in 0..self.single {
            let p = format!("single_transformer_blocks.{i}");
            lin(format!("{p}.norm.linear"), 3 * h, h);
            lin(format!("{p}.proj_mlp"), 4 * h, h);
            lin(format!("{p}.proj_out"), h, 5 * h);
            for n in ["to_q", "to_k", "to_v"] {
                lin(format!("{p}.attn.{n}"), h, h);
            }
        }
        lin("norm_out.linear".into(), 2 * h, h);
        lin("proj_out".into(), self.in_channels as u64, h);
        for i in 0..self.double {
            for n in ["norm_q", "norm_k", "norm_added_q", "norm_added_k"] {
                out.push((format!("transformer_blocks.{i}.attn.{n}.weight"), vec![d]));
            }
        }
        for i in 0..self.single {
            for n in ["norm_q", "norm_k"] {
                out.push((
                    format!("single_transformer_blocks.{i}.attn.{n}.weight"),
                    vec![d],
                ));
            }
        }
        out
    }

    /// Weights in all.
    pub fn weights(&self) -> u64 {
        self.tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<u64>())
            .sum()
    }
}

/// The law a synthetic tensor's weights are drawn from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Law {
    /// N(0, σ²) at the init scale: linear weights σ² = 1/fan-in, biases
    /// 1/(3·fan-in), RMS-norm weights 1 + N(0, 0.1²). Within half a point
    /// of real trained weights (`research/exponent_stats.md` §4).
    Normal,
    /// Student-t with ν = 4 at the same variances: the conservative,
    /// Flux-calibrated case.
    StudentT4,
    /// PyTorch's default init, uniform in ±1/√fan-in (norms 1 ± 0.1):
    /// flatters every exponent code; for comparison only.
    Uniform,
}

impl Law {
    /// Every law.
    pub const ALL: [Law; 3] = [Law::Normal, Law::StudentT4, Law::Uniform];

    /// Its name (`normal`, `student-t`, `uniform`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Normal => "normal",
            Self::StudentT4 => "student-t",
            Self::Uniform => "uniform",
        }
    }

    /// The law named `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|l| l.name() == name)
    }
}

/// splitmix64: seeds one stream per (seed, tensor, chunk).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// xorshift64*, as `offload-candle`'s `Uniform`.
struct Rng(u64);

impl Rng {
    fn next_u32(&mut self) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32
    }

    /// Uniform in (0, 1), never 0 or 1 (a 2⁻²⁴ grid shifted by half).
    fn open01(&mut self) -> f32 {
        ((self.next_u32() >> 8) as f32 + 0.5) * (1.0 / (1u32 << 24) as f32)
    }

    /// Uniform in [−1, 1).
    fn sym(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 * (2.0 / (1u32 << 24) as f32) - 1.0
    }

    /// Two standard normals (Box–Muller).
    fn normal_pair(&mut self) -> (f32, f32) {
        let r = (-2.0 * self.open01().ln()).sqrt();
        let (s, c) = (std::f32::consts::TAU * self.open01()).sin_cos();
        (r * c, r * s)
    }
}

/// f32 → bf16 bits, rounding to nearest even (as `half::bf16::from_f32`
/// for the finite values drawn here).
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x40;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// Draws `n` bf16 values into `out` (2n bytes): `centre + scale · X`, X of
/// `law` with unit variance (uniform: in ±1).
fn draw(law: Law, rng: &mut Rng, centre: f32, scale: f32, out: &mut [u8]) {
    let n = out.len() / 2;
    let mut put = |i: usize, v: f32| {
        out[2 * i..2 * i + 2].copy_from_slice(&bf16_bits(centre + scale * v).to_le_bytes());
    };
    let mut i = 0;
    while i < n {
        match law {
            Law::Uniform => {
                put(i, rng.sym());
                i += 1;
            }
            Law::Normal => {
                let (a, b) = rng.normal_pair();
                put(i, a);
                if i + 1 < n {
                    put(i + 1, b);
                }
                i += 2;
            }
            Law::StudentT4 => {
                // t₄ = z / √(χ²₄ / 4), χ²₄ = −2 ln(u₃u₄); Var t₄ = 2, so
                // t₄ / √2 = z / √(−ln(u₃u₄)) has unit variance.
                let (a, b) = rng.normal_pair();
                let k = 1.0 / (-(rng.open01() * rng.open01()).ln()).sqrt();
                put(i, a * k);
                if i + 1 < n {
                    let k2 = 1.0 / (-(rng.open01() * rng.open01()).ln()).sqrt();
                    put(i + 1, b * k2);
                }
                i += 2;
            }
        }
    }
}

/// The (centre, scale) of tensor `name` under `law`: norms 1 + 0.1·X;
/// a weight of fan-in f, 1/√f; its bias, 1/√(3f) (normal and Student-t;
/// uniform biases 1/√f, as PyTorch).
fn scale_of(law: Law, name: &str, shape: &[u64], all: &[(String, Vec<u64>)]) -> (f32, f32) {
    if name.contains(".norm_") {
        return (1.0, 0.1);
    }
    let fan_in = if name.ends_with(".bias") {
        let w = name.replace(".bias", ".weight");
        all.iter()
            .find(|(n, _)| *n == w)
            .and_then(|(_, s)| s.get(1).copied())
            .unwrap_or(1)
    } else {
        shape.get(1).copied().unwrap_or(1)
    };
    let bound = 1.0 / (fan_in as f32).sqrt();
    match law {
        Law::Uniform => (0.0, bound),
        _ if name.ends_with(".bias") => (0.0, bound / 3f32.sqrt()),
        _ => (0.0, bound),
    }
}

/// Weights per independently seeded chunk of a tensor.
const CHUNK: usize = 1 << 16;

/// Tensor `index` (`name`, `shape`) of a synthetic model of `law` from
/// `seed`, as bf16 bytes, drawn on `threads` threads (chunks of 65,536
/// weights each seeded from (seed, tensor, chunk): the same bytes whatever
/// the thread count).
pub fn tensor_bytes(
    law: Law,
    seed: u64,
    index: usize,
    name: &str,
    shape: &[u64],
    all: &[(String, Vec<u64>)],
    threads: usize,
) -> Vec<u8> {
    let n: u64 = shape.iter().product();
    let (centre, scale) = scale_of(law, name, shape, all);
    let mut out = vec![0u8; 2 * n as usize];
    let seed_of = |c: usize| mix(mix(seed ^ mix(index as u64)) ^ c as u64) | 1;
    let chunks: Vec<(usize, &mut [u8])> = out.chunks_mut(2 * CHUNK).enumerate().collect();
    let threads = threads.clamp(1, chunks.len().max(1));
    if threads == 1 {
        for (c, o) in chunks {
            draw(law, &mut Rng(seed_of(c)), centre, scale, o);
        }
        return out;
    }
    let mut groups: Vec<Vec<(usize, &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
    for (k, c) in chunks.into_iter().enumerate() {
        groups[k % threads].push(c);
    }
    std::thread::scope(|s| {
        for g in groups {
            s.spawn(move || {
                for (c, o) in g {
                    draw(law, &mut Rng(seed_of(c)), centre, scale, o);
                }
            });
        }
    });
    out
}

/// What packing a synthetic model gave.
#[derive(Clone, Debug, Default)]
pub struct SynthReport {
    /// Per tensor: name, shape, figures.
    pub tensors: Vec<(String, Vec<u64>, Stats)>,
    /// Seconds drawing the weights.
    pub draw_seconds: f64,
    /// Seconds planning, encoding and checking the round trips.
    pub encode_seconds: f64,
    /// bf16 bytes actually drawn and encoded (less than the model's where
    /// blocks were sampled).
    pub drawn_bytes: u64,
}

impl SynthReport {
    /// bf16 bytes.
    pub fn decoded_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.2.decoded_bytes).sum()
    }

    /// Packed bytes (blobs).
    pub fn packed_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.2.packed_bytes).sum()
    }

    /// Packed / bf16 bytes.
    pub fn ratio(&self) -> f64 {
        self.packed_bytes() as f64 / self.decoded_bytes().max(1) as f64
    }

    /// Escapes / weights of the window-coded tensors.
    pub fn escape_share(&self) -> f64 {
        let (e, w) = self
            .tensors
            .iter()
            .filter(|t| matches!(t.2.code, Code::Window3 { .. }))
            .fold((0u64, 0u64), |(e, w), t| {
                (e + t.2.escapes, w + t.2.decoded_bytes / 2)
            });
        e as f64 / w.max(1) as f64
    }

    /// Tensors of each code: (window-coded, raw).
    pub fn codes(&self) -> (usize, usize) {
        let w = self
            .tensors
            .iter()
            .filter(|t| matches!(t.2.code, Code::Window3 { .. }))
            .count();
        (w, self.tensors.len() - w)
    }
}

/// Draws every tensor of `shape` from `law`, packs it (round trip checked
/// unless `cfg.verify` is off) and drops it: the figures of packing that
/// model, one tensor in memory at a time.
pub fn pack_synthetic(
    shape: &FluxShape,
    law: Law,
    seed: u64,
    cfg: &EncodeConfig,
) -> Result<SynthReport, crate::container::PackError> {
    pack_synthetic_sampled(shape, law, seed, cfg, usize::MAX)
}

/// The block of a tensor name: its stack and index
/// (`transformer_blocks.7.…` → `("transformer_blocks", 7)`).
fn block_of(name: &str) -> Option<(&str, usize)> {
    let mut it = name.splitn(3, '.');
    let stack = it.next()?;
    let index = it.next()?.parse().ok()?;
    it.next()?;
    Some((stack, index))
}

/// As [`pack_synthetic`], but only the first `drawn` blocks of each stack
/// are drawn and packed: a later block's tensor counts with the figures of
/// the same tensor of block `index % drawn` (same shape, same law, so the
/// same figures up to sampling noise of tensors of millions of weights).
/// The totals cover the whole model; `drawn = usize::MAX` draws it all.
pub fn pack_synthetic_sampled(
    shape: &FluxShape,
    law: Law,
    seed: u64,
    cfg: &EncodeConfig,
    drawn: usize,
) -> Result<SynthReport, crate::container::PackError> {
    let all = shape.tensors();
    let drawn = drawn.max(1);
    let mut report = SynthReport::default();
    let mut seen: std::collections::HashMap<String, Stats> = std::collections::HashMap::new();
    for (i, (name, dims)) in all.iter().enumerate() {
        if let Some((stack, index)) = block_of(name)
            && index >= drawn
        {
            let rest = &name[stack.len() + 1 + index.to_string().len()..];
            let twin = format!("{stack}.{}{rest}", index % drawn);
            if let Some(st) = seen.get(&twin) {
                report.tensors.push((name.clone(), dims.clone(), *st));
                continue;
            }
        }
        let t0 = Instant::now();
        let bytes = tensor_bytes(law, seed, i, name, dims, &all, cfg.threads());
        let t1 = Instant::now();
        let t = TensorIn {
            name,
            dtype: DType::Bf16,
            shape: dims,
            bytes: &bytes,
        };
        let planned = plan_tensor(&t, cfg)?;
        let enc = encode_tensor(&t, planned.code, cfg)?;
        report.draw_seconds += (t1 - t0).as_secs_f64();
        report.encode_seconds += t1.elapsed().as_secs_f64();
        report.drawn_bytes += enc.stats.decoded_bytes;
        seen.insert(name.clone(), enc.stats);
        report.tensors.push((name.clone(), dims.clone(), enc.stats));
    }
    Ok(report)
}
