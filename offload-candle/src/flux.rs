//! Flux.1's DiT (`FluxTransformer2DModel` as diffusers names it) written with
//! candle operations, block by block, reading each block's weights through
//! a [`ModuleWeights`] scope: a map of resident tensors, or an offload
//! forward scope whose views are the streamed slots.
//!
//! The numerics follow diffusers 0.3x–0.4x: timestep and guidance scaled by
//! 1000 in bf16, sinusoidal projections in f32 (`flip_sin_to_cos`), RoPE
//! over axes (16, 56, 56) with θ = 10000 computed in f64 and applied in f32,
//! RMS-normalised queries and keys, attention scores and softmax in f32 with
//! probabilities in bf16 (as a flash kernel keeps them), layer norms without
//! affine parameters (ε = 1e-6), GELU with the tanh approximation, and
//! AdaLayerNormContinuous's (scale, shift) order at the output.
//!
//! Attention is one of two [`Attention`] paths: candle's own operations
//! (scores materialised; any device), or, with the `flash-attn` feature on a
//! CUDA device, FlashAttention-2 (`candle-flash-attn`: bf16 inputs, f32
//! accumulation and softmax statistics, probabilities in bf16 for the
//! second product, as diffusers' cuDNN and flash kernels do).

use candle_core::{D, DType, Device, Module as _, Result, Tensor};

/// The transformer's shape: diffusers' `config.json` of
/// `FluxTransformer2DModel`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
pub struct FluxConfig {
    /// Latent channels in and out (64: 16 channels × 2 × 2 patches).
    #[serde(default = "d_in_channels")]
    pub in_channels: usize,
    /// Double-stream blocks (19).
    #[serde(default = "d_num_layers")]
    pub num_layers: usize,
    /// Single-stream blocks (38).
    #[serde(default = "d_num_single_layers")]
    pub num_single_layers: usize,
    /// Width of one head (128).
    #[serde(default = "d_head_dim")]
    pub attention_head_dim: usize,
    /// Heads (24).
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// Width of the text encoder's states (4096).
    #[serde(default = "d_joint")]
    pub joint_attention_dim: usize,
    /// Width of the pooled text embedding (768).
    #[serde(default = "d_pooled")]
    pub pooled_projection_dim: usize,
    /// Whether the guidance scale is embedded (Flux.1-dev).
    #[serde(default = "d_guidance")]
    pub guidance_embeds: bool,
    /// RoPE widths per position axis; they sum to the head width.
    #[serde(default = "d_axes")]
    pub axes_dims_rope: Vec<usize>,
}

fn d_in_channels() -> usize {
    64
}
fn d_num_layers() -> usize {
    19
}
fn d_num_single_layers() -> usize {
    38
}
fn d_head_dim() -> usize {
    128
}
fn d_heads() -> usize {
    24
}
fn d_joint() -> usize {
    4096
}
fn d_pooled() -> usize {
    768
}
fn d_guidance() -> bool {
    true
}
fn d_axes() -> Vec<usize> {
    vec![16, 56, 56]
}

impl FluxConfig {
    /// Flux.1-dev.
    pub fn dev() -> Self {
        Self {
            in_channels: 64,
            num_layers: 19,
            num_single_layers: 38,
            attention_head_dim: 128,
            num_attention_heads: 24,
            joint_attention_dim: 4096,
            pooled_projection_dim: 768,
            guidance_embeds: true,
            axes_dims_rope: vec![16, 56, 56],
        }
    }

    /// The model width (heads × head width).
    pub fn hidden(&self) -> usize {
        self.attention_head_dim * self.num_attention_heads
    }
}

/// One forward's inputs, as diffusers' `FluxTransformer2DModel.forward`
/// takes them (batch `B`, image tokens `S`, text tokens `T`).
#[derive(Clone, Debug)]
pub struct FluxInputs {
    /// Packed latents `[B, S, in_channels]`, bf16.
    pub hidden_states: Tensor,
    /// Text encoder states `[B, T, joint_attention_dim]`, bf16.
    pub encoder_hidden_states: Tensor,
    /// Pooled text embedding `[B, pooled_projection_dim]`, bf16.
    pub pooled_projections: Tensor,
    /// Timestep in `[0, 1]`, `[B]`, f32.
    pub timestep: Tensor,
    /// Guidance scale, `[B]`, f32 (ignored without guidance embeds).
    pub guidance: Tensor,
    /// Image token positions `[S, 3]`, f32.
    pub img_ids: Tensor,
    /// Text token positions `[T, 3]`, f32.
    pub txt_ids: Tensor,
}

/// The weights of one module, by name relative to it.
pub trait Weights {
    /// The tensor `name` (dotted, relative to the module).
    fn get(&self, name: &str) -> Result<Tensor>;
}

impl<F: Fn(&str) -> Result<Tensor>> Weights for F {
    fn get(&self, name: &str) -> Result<Tensor> {
        self(name)
    }
}

/// Runs parts of a forward with the weights of a module: the DiT's own
/// (path `""`), or a block's (`transformer_blocks.3`). Resident maps and
/// offload forward scopes implement it.
pub trait ModuleWeights {
    /// Runs `f` with the weights of the module at `path` (relative to the
    /// DiT) readable through its argument.
    fn with_module<R>(&self, path: &str, f: &mut dyn FnMut(&dyn Weights) -> Result<R>)
    -> Result<R>;
}

/// Weights held by name (relative to the DiT): the resident baseline.
impl ModuleWeights for std::collections::HashMap<String, Tensor> {
    fn with_module<R>(
        &self,
        path: &str,
        f: &mut dyn FnMut(&dyn Weights) -> Result<R>,
    ) -> Result<R> {
        let get = |name: &str| {
            let full = if path.is_empty() {
                name.to_owned()
            } else {
                format!("{path}.{name}")
            };
            self.get(&full)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg(format!("no weight `{full}`")))
        };
        f(&get)
    }
}

fn linear(w: &dyn Weights, name: &str, x: &Tensor) -> Result<Tensor> {
    let weight = w.get(&format!("{name}.weight"))?;
    let bias = w.get(&format!("{name}.bias")).ok();
    candle_nn::Linear::new(weight, bias).forward(x)
}

/// How a forward computes attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// candle's operations: bf16 queries and keys cast to f32, scores and
    /// softmax in f32, probabilities cast to bf16 for the product with the
    /// values. Any device, any head width.
    Unfused,
    /// FlashAttention-2 from `candle-flash-attn` (the `flash-attn` feature):
    /// CUDA, bf16, head width 128, the inputs read in `[B, L, H, D]` order.
    Flash,
}

impl Attention {
    /// The fastest path this build has for `cfg` on `device`: flash where
    /// it is compiled in and applies, else unfused.
    pub fn best(cfg: &FluxConfig, device: &Device) -> Self {
        if Self::Flash.check(cfg, device).is_ok() {
            Self::Flash
        } else {
            Self::Unfused
        }
    }

    /// Whether this path can run `cfg` on `device`, and why not.
    pub fn check(self, cfg: &FluxConfig, device: &Device) -> Result<()> {
        match self {
            Self::Unfused => Ok(()),
            Self::Flash if !cfg!(feature = "flash-attn") => Err(candle_core::Error::Msg(
                "flash attention: this build has no `flash-attn` feature".into(),
            )),
            Self::Flash if !device.is_cuda() => Err(candle_core::Error::Msg(format!(
                "flash attention runs on CUDA devices only, not {device:?}"
            ))),
            Self::Flash if cfg.attention_head_dim != 128 => Err(candle_core::Error::Msg(format!(
                "flash attention: head width {} (the bundle's kernel is built for 128)",
                cfg.attention_head_dim
            ))),
            Self::Flash => Ok(()),
        }
    }

    /// The name the benchmark prints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Unfused => "unfused",
            Self::Flash => "flash-attn-2",
        }
    }
}

/// The paths a forward takes: [`Kernels::best`] for a device (on CUDA,
/// every fast path this build has; on the CPU, candle's plain operations),
/// each checked on the GPU against the plain one by `offload-flux-bench`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernels {
    /// The attention.
    pub attention: Attention,
    /// Queries, keys and values kept in `[B, L, H, D]` from the projections
    /// to the attention (RoPE over `L·H` rows with tables repeated per
    /// head): what flash attention reads, with no transposes; the unfused
    /// attention reads them through transposed views. The same values
    /// either way.
    pub blhd: bool,
    /// The blocks' linear layers as one cuBLASLt GEMM each with the bias
    /// added in its epilogue (f32, one rounding to bf16, as PyTorch's
    /// `F.linear`), instead of candle's GEMM then a broadcast add (CUDA and
    /// the `cuda` feature).
    pub gemm_bias_epilogue: bool,
    /// AdaLN's `norm(x)·(1 + scale) + shift` as one layer norm with weight
    /// `1 + scale` and bias `shift` (f32 inside, one rounding), instead of a
    /// norm then a broadcast multiply and add (batch 1; any device).
    pub fused_modulate: bool,
    /// Queries, keys and values projected straight into the joint
    /// sequence's `[B, L, H, D]` buffers (a double block's text rows then
    /// image rows, no concatenation), and the q/k RMSNorm and RoPE as one
    /// in-place kernel (bf16 in and out, f32 inside, rounded where
    /// diffusers rounds) instead of a norm, an f32 cast, candle's RoPE and
    /// a cast back (needs `blhd`, `gemm_bias_epilogue` and the `cuda`
    /// feature).
    pub fused_qk_rope: bool,
    /// The MLPs' GELU in the cuBLASLt epilogue of the GEMM before it, and
    /// the single block's GELU'd MLP written straight into the buffer its
    /// output projection reads, the attention copied in beside it (one
    /// strided copy where a concatenation copied both; needs
    /// `gemm_bias_epilogue`).
    pub gelu_epilogue: bool,
    /// A residual stream's `x + gate ⊙ y` as one kernel instead of a
    /// broadcast multiply and an add (CUDA and the `cuda` feature).
    pub fused_gate: bool,
}

impl Kernels {
    /// candle's plain operations: the CPU's paths, the reference the fast
    /// ones are checked against.
    pub const PLAIN: Self = Self {
        attention: Attention::Unfused,
        blhd: false,
        gemm_bias_epilogue: false,
        fused_modulate: false,
        fused_qk_rope: false,
        gelu_epilogue: false,
        fused_gate: false,
    };

    /// Every fast path this build has for `cfg` on `device`; none on the
    /// CPU (whose outputs stay those of candle's plain operations).
    pub fn best(cfg: &FluxConfig, device: &Device) -> Self {
        if !device.is_cuda() {
            return Self::PLAIN;
        }
        let attention = Attention::best(cfg, device);
        let blhd = attention == Attention::Flash;
        let cuda = cfg!(feature = "cuda");
        Self {
            attention,
            blhd,
            gemm_bias_epilogue: cuda,
            fused_modulate: true,
            fused_qk_rope: cuda && blhd && cfg.attention_head_dim == 128,
            gelu_epilogue: cuda,
            fused_gate: cuda,
        }
    }

    /// Whether these paths can run `cfg` on `device`, and why not.
    pub fn check(&self, cfg: &FluxConfig, device: &Device) -> Result<()> {
        self.attention.check(cfg, device)?;
        if self.gemm_bias_epilogue && !(cfg!(feature = "cuda") && device.is_cuda()) {
            return Err(candle_core::Error::Msg(format!(
                "the cuBLASLt bias epilogue needs the `cuda` feature and a CUDA device, not {device:?}"
            )));
        }
        let cuda = cfg!(feature = "cuda") && device.is_cuda();
        if self.fused_qk_rope
            && !(cuda && self.blhd && self.gemm_bias_epilogue && cfg.attention_head_dim == 128)
        {
            return Err(candle_core::Error::Msg(format!(
                "the fused q/k norm and RoPE needs the `cuda` feature, a CUDA device (not {device:?}), \
                 the [B, L, H, D] layout, the cuBLASLt epilogue and head width 128 (not {})",
                cfg.attention_head_dim
            )));
        }
        if self.gelu_epilogue && !(cuda && self.gemm_bias_epilogue) {
            return Err(candle_core::Error::Msg(format!(
                "the GELU epilogue needs the cuBLASLt epilogue, the `cuda` feature and a CUDA device, not {device:?}"
            )));
        }
        if self.fused_gate && !cuda {
            return Err(candle_core::Error::Msg(format!(
                "the fused gate needs the `cuda` feature and a CUDA device, not {device:?}"
            )));
        }
        Ok(())
    }

    /// A short name: the attention and each fast path on.
    pub fn name(&self) -> String {
        let mut s = self.attention.name().to_owned();
        if self.blhd {
            s.push_str("+blhd");
        }
        if self.gemm_bias_epilogue {
            s.push_str("+lt-bias");
        }
        if self.fused_modulate {
            s.push_str("+fused-adaln");
        }
        if self.fused_qk_rope {
            s.push_str("+fused-qk-rope");
        }
        if self.gelu_epilogue {
            s.push_str("+gelu-epilogue");
        }
        if self.fused_gate {
            s.push_str("+fused-gate");
        }
        s
    }
}

/// Scaled dot-product attention of `q`, `k`, `v` (`[B, heads, L, D]`, bf16,
/// RoPE applied), no mask, softmax scale `1/√D`, by `path`: `[B, L,
/// heads·D]`, bf16.
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, path: Attention) -> Result<Tensor> {
    let (b, h, l, d) = q.dims4()?;
    let scale = 1.0 / (d as f64).sqrt();
    match path {
        Attention::Unfused => {
            let scores = q
                .to_dtype(DType::F32)?
                .matmul(&k.to_dtype(DType::F32)?.t()?)?
                .affine(scale, 0.0)?;
            let p = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(DType::BF16)?;
            // (A transposed view of `[B, L, H, D]` values is copied: the
            // product is then the one of contiguous values, bit for bit.)
            let out = p.matmul(&v.contiguous()?)?; // [B, heads, L, D]
            out.transpose(1, 2)?.reshape((b, l, h * d))
        }
        Attention::Flash => {
            // `[B, L, H, D]` views: the kernel takes any row and head
            // strides with the last dimension contiguous.
            let t = |x: &Tensor| x.transpose(1, 2);
            attend_blhd(&t(q)?, &t(k)?, &t(v)?)
        }
    }
}

/// Flash attention of `[B, L, H, D]` queries, keys and values: `[B, L,
/// H·D]` (the kernel writes a contiguous `[B, L, H, D]`).
fn attend_blhd(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, l, h, d) = q.dims4()?;
    let scale = 1.0 / (d as f64).sqrt();
    flash(q, k, v, scale as f32)?.reshape((b, l, h * d))
}

#[cfg(feature = "flash-attn")]
fn flash(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    candle_flash_attn::flash_attn(q, k, v, scale, false)
}

#[cfg(not(feature = "flash-attn"))]
fn flash(_: &Tensor, _: &Tensor, _: &Tensor, _: f32) -> Result<Tensor> {
    Err(candle_core::Error::Msg(
        "flash attention: this build has no `flash-attn` feature".into(),
    ))
}

/// The model, its shape, the constants its norms use, its paths, and the
/// positional tables of the last token positions it saw (a step's ids
/// recur every step: tens of ms of host trigonometry at 16,896 tokens).
#[derive(Debug)]
pub struct Flux {
    cfg: FluxConfig,
    ones: Tensor,
    zeros: Tensor,
    kernels: Kernels,
    rope_cache: std::sync::Mutex<Option<(Vec<f32>, Rope)>>,
}

/// Positional tables for one forward: cos and sin `[T + S, head/2]`, f32;
/// for the `[B, L, H, D]` layout each row repeated per head, `[(T + S)·H,
/// head/2]`; `per_token`, the unrepeated `[T + S, head/2]` pair the fused
/// kernel reads.
#[derive(Clone, Debug)]
struct Rope {
    cos: Tensor,
    sin: Tensor,
    // Read by the fused kernel only (the `cuda` feature).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    per_token: (Tensor, Tensor),
}

impl Flux {
    /// The model of `cfg` computing on `device`, with the best paths this
    /// build has there ([`Kernels::best`]).
    pub fn new(cfg: FluxConfig, device: &Device) -> Result<Self> {
        let h = cfg.hidden();
        Ok(Self {
            ones: Tensor::ones(h, DType::BF16, device)?,
            zeros: Tensor::zeros(h, DType::BF16, device)?,
            kernels: Kernels::best(&cfg, device),
            rope_cache: Default::default(),
            cfg,
        })
    }

    /// The same model computing attention by `path`; an error where `path`
    /// cannot run here ([`Attention::check`]).
    pub fn with_attention(self, path: Attention) -> Result<Self> {
        let kernels = Kernels {
            attention: path,
            ..self.kernels
        };
        self.with_kernels(kernels)
    }

    /// The same model taking `kernels`; an error where they cannot run
    /// here ([`Kernels::check`]).
    pub fn with_kernels(mut self, kernels: Kernels) -> Result<Self> {
        kernels.check(&self.cfg, self.ones.device())?;
        self.kernels = kernels;
        self.rope_cache = Default::default();
        Ok(self)
    }

    /// The attention path forwards take.
    pub fn attention_path(&self) -> Attention {
        self.kernels.attention
    }

    /// The paths forwards take.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// The configuration.
    pub fn config(&self) -> &FluxConfig {
        &self.cfg
    }

    /// The paths of the blocks, in the order a forward runs them.
    pub fn block_paths(&self) -> Vec<String> {
        (0..self.cfg.num_layers)
            .map(|i| format!("transformer_blocks.{i}"))
            .chain(
                (0..self.cfg.num_single_layers).map(|i| format!("single_transformer_blocks.{i}")),
            )
            .collect()
    }

    /// One forward: the noise prediction `[B, S, in_channels]`, bf16.
    pub fn forward(&self, x: &FluxInputs, weights: &impl ModuleWeights) -> Result<Tensor> {
        let dev = x.hidden_states.device();
        let (img, txt, temb) = weights.with_module("", &mut |w| {
            let img = linear(w, "x_embedder", &x.hidden_states)?;
            let t = timestep_embedding(&x.timestep, dev)?;
            let mut temb = mlp(w, "time_text_embed.timestep_embedder", &t)?;
            if self.cfg.guidance_embeds {
                let g = timestep_embedding(&x.guidance, dev)?;
                temb = (temb + mlp(w, "time_text_embed.guidance_embedder", &g)?)?;
            }
            let pooled = mlp(w, "time_text_embed.text_embedder", &x.pooled_projections)?;
            let temb = (temb + pooled)?;
            let txt = linear(w, "context_embedder", &x.encoder_hidden_states)?;
            Ok((img, txt, temb))
        })?;
        let rope = self.rope(&x.txt_ids, &x.img_ids)?;
        let (mut img, mut txt) = (img, txt);
        for i in 0..self.cfg.num_layers {
            (txt, img) = weights.with_module(&format!("transformer_blocks.{i}"), &mut |w| {
                self.double_block(w, &img, &txt, &temb, &rope)
            })?;
        }
        let t_len = txt.dim(1)?;
        let mut hs = Tensor::cat(&[&txt, &img], 1)?;
        for i in 0..self.cfg.num_single_layers {
            hs = weights.with_module(&format!("single_transformer_blocks.{i}"), &mut |w| {
                self.single_block(w, &hs, &temb, &rope)
            })?;
        }
        let img = hs.narrow(1, t_len, hs.dim(1)? - t_len)?;
        weights.with_module("", &mut |w| {
            let emb = linear(w, "norm_out.linear", &temb.silu()?)?;
            let chunks = emb.chunk(2, 1)?;
            let (scale, shift) = (&chunks[0], &chunks[1]);
            let y = self.norm_modulate(&img, shift, scale)?;
            linear(w, "proj_out", &y)
        })
    }

    fn norm(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::layer_norm(x, &self.ones, &self.zeros, 1e-6)
    }

    /// `x · (1 + scale) + shift`, scale and shift `[B, H]`.
    fn modulate(&self, x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
        let scale = (scale.unsqueeze(1)? + 1.0)?;
        x.broadcast_mul(&scale)?.broadcast_add(&shift.unsqueeze(1)?)
    }

    /// AdaLN's `norm(x) · (1 + scale) + shift` for `x` `[B, L, H]`, shift
    /// and scale `[B, H]`: fused into the layer norm's weight and bias
    /// where [`Kernels::fused_modulate`] is on and the batch is 1 (`1 +
    /// scale` rounded to bf16 as diffusers has it).
    pub fn norm_modulate(&self, x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
        if self.kernels.fused_modulate && x.dim(0)? == 1 && x.is_contiguous() {
            let weight = (scale.squeeze(0)? + 1.0)?;
            let bias = shift.squeeze(0)?.contiguous()?;
            return candle_nn::ops::layer_norm(x, &weight, &bias, 1e-6);
        }
        self.modulate(&self.norm(x)?, shift, scale)
    }

    /// A block's linear layer: with [`Kernels::gemm_bias_epilogue`], one
    /// cuBLASLt GEMM with the bias in its epilogue.
    fn linear(&self, w: &dyn Weights, name: &str, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.kernels.gemm_bias_epilogue {
            let weight = w.get(&format!("{name}.weight"))?;
            if let Ok(bias) = w.get(&format!("{name}.bias")) {
                return crate::lt::linear_bias(x, &weight, &bias);
            }
        }
        linear(w, name, x)
    }

    /// Whether q, k, v stay `[B, L, H, D]` rather than `[B, H, L, D]`
    /// ([`Kernels::blhd`]).
    fn blhd(&self) -> bool {
        self.kernels.blhd
    }

    /// The positional tables of these ids: the cached ones where the ids
    /// are the last call's.
    fn rope(&self, txt_ids: &Tensor, img_ids: &Tensor) -> Result<Rope> {
        let ids = Tensor::cat(&[txt_ids, img_ids], 0)?.to_dtype(DType::F32)?;
        let flat: Vec<f32> = ids.flatten_all()?.to_vec1()?;
        let mut cache = self
            .rope_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((cached, rope)) = cache.as_ref()
            && *cached == flat
        {
            return Ok(rope.clone());
        }
        let rope = self.rope_tables(&ids.to_vec2()?, img_ids.device())?;
        *cache = Some((flat, rope.clone()));
        Ok(rope)
    }

    fn rope_tables(&self, ids: &[Vec<f32>], dev: &Device) -> Result<Rope> {
        let half: usize = self.cfg.axes_dims_rope.iter().sum::<usize>() / 2;
        let freqs: Vec<Vec<f64>> = self
            .cfg
            .axes_dims_rope
            .iter()
            .map(|&dim| {
                (0..dim / 2)
                    .map(|k| 1.0 / 10000f64.powf((2 * k) as f64 / dim as f64))
                    .collect()
            })
            .collect();
        let (mut cos, mut sin) = (
            Vec::with_capacity(ids.len() * half),
            Vec::with_capacity(ids.len() * half),
        );
        for pos in ids {
            for (axis, freqs) in freqs.iter().enumerate() {
                let p = f64::from(pos[axis]);
                for &freq in freqs {
                    let angle = p * freq;
                    cos.push(angle.cos() as f32);
                    sin.push(angle.sin() as f32);
                }
            }
        }
        let n = ids.len();
        let (cos, sin) = (
            Tensor::from_vec(cos, (n, half), dev)?,
            Tensor::from_vec(sin, (n, half), dev)?,
        );
        let per_token = (cos.clone(), sin.clone());
        if !self.blhd() {
            return Ok(Rope {
                cos,
                sin,
                per_token,
            });
        }
        let h = self.cfg.num_attention_heads;
        let per_head = |t: Tensor| -> Result<Tensor> {
            t.unsqueeze(1)?
                .broadcast_as((n, h, half))?
                .contiguous()?
                .reshape((n * h, half))
        };
        Ok(Rope {
            cos: per_head(cos)?,
            sin: per_head(sin)?,
            per_token,
        })
    }

    /// `[B, L, H·D]` → `[B, heads, L, D]` (or `[B, L, heads, D]`, see
    /// [`Self::blhd`]), RMS-normalised by `norm` (none for `v`).
    fn heads(&self, w: &dyn Weights, x: &Tensor, norm: Option<&str>) -> Result<Tensor> {
        let (b, l, _) = x.dims3()?;
        let x = x.reshape((
            b,
            l,
            self.cfg.num_attention_heads,
            self.cfg.attention_head_dim,
        ))?;
        let x = match norm {
            Some(norm) => candle_nn::ops::rms_norm(
                &x.contiguous()?,
                &w.get(&format!("{norm}.weight"))?,
                1e-6,
            )?,
            None => x,
        };
        if self.blhd() {
            x.contiguous()
        } else {
            x.transpose(1, 2)?.contiguous()
        }
    }

    /// The axis of the tokens in [`Self::heads`]' layout.
    fn token_axis(&self) -> usize {
        if self.blhd() { 1 } else { 2 }
    }

    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Tensor> {
        // RoPE in f32 as diffusers applies it; in `[B, L, H, D]` the
        // `L·H` rows are rotated by the tables repeated per head.
        let rot = |x: &Tensor| -> Result<Tensor> {
            let shape = x.shape().clone();
            let (b, d0, d1, d) = x.dims4()?;
            let x = if self.blhd() {
                x.reshape((b, 1, d0 * d1, d))?
            } else {
                x.clone()
            };
            candle_nn::rotary_emb::rope_i(&x.to_dtype(DType::F32)?, &rope.cos, &rope.sin)?
                .to_dtype(DType::BF16)?
                .reshape(shape)
        };
        let (q, k) = (rot(q)?, rot(k)?);
        match (self.blhd(), self.kernels.attention) {
            (true, Attention::Flash) => attend_blhd(&q, &k, v),
            (true, path) => {
                let t = |x: &Tensor| x.transpose(1, 2);
                attend(&t(&q)?, &t(&k)?, &t(v)?, path)
            }
            (false, path) => attend(&q, &k, v, path),
        }
    }

    fn qkv(
        &self,
        w: &dyn Weights,
        x: &Tensor,
        names: [&str; 3],
        norms: [&str; 2],
    ) -> Result<[Tensor; 3]> {
        let q = self.heads(w, &self.linear(w, names[0], x)?, Some(norms[0]))?;
        let k = self.heads(w, &self.linear(w, names[1], x)?, Some(norms[1]))?;
        let v = self.heads(w, &self.linear(w, names[2], x)?, None)?;
        Ok([q, k, v])
    }

    /// The attention over the joint sequence of `parts` (each an input `[1,
    /// Lᵢ, H]`, its q/k/v projections and its q/k norms, in sequence
    /// order): `[B, L, H]`.
    fn joint_attention(
        &self,
        w: &dyn Weights,
        parts: &[(&Tensor, [&str; 3], [&str; 2])],
        rope: &Rope,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.kernels.fused_qk_rope
            && parts.len() <= 2
            && parts.iter().all(|(x, ..)| x.dim(0).is_ok_and(|b| b == 1))
        {
            // Each part's rows start 256-byte aligned in the joint buffer
            // (cuBLASLt's output alignment), decided by shape alone.
            let width = self.cfg.hidden();
            let first_rows = parts.first().map_or(Ok(0), |(x, ..)| x.dim(1))?;
            if parts.len() == 1 || crate::lt::aligned_at(first_rows, width, 0) {
                return self.joint_attention_fused(w, parts, rope);
            }
        }
        let mut qkv: [Vec<Tensor>; 3] = Default::default();
        for (x, names, norms) in parts {
            for (all, t) in qkv.iter_mut().zip(self.qkv(w, x, *names, *norms)?) {
                all.push(t);
            }
        }
        let axis = self.token_axis();
        let [q, k, v] = qkv.map(|ts| {
            if ts.len() == 1 {
                Ok(ts[0].clone())
            } else {
                Tensor::cat(&ts, axis)
            }
        });
        self.attention(&q?, &k?, &v?, rope)
    }

    /// [`Self::joint_attention`] with each projection written into its
    /// place in the joint `[1, L, H, D]` buffer and the q/k norms and RoPE
    /// applied in place by one kernel each.
    #[cfg(feature = "cuda")]
    fn joint_attention_fused(
        &self,
        w: &dyn Weights,
        parts: &[(&Tensor, [&str; 3], [&str; 2])],
        rope: &Rope,
    ) -> Result<Tensor> {
        let (heads, d) = (self.cfg.num_attention_heads, self.cfg.attention_head_dim);
        let lens = parts
            .iter()
            .map(|(x, ..)| x.dim(1))
            .collect::<Result<Vec<_>>>()?;
        if lens.len() > 2 {
            return Err(candle_core::Error::Msg(format!(
                "the fused q/k norm takes one or two parts, not {}",
                lens.len()
            )));
        }
        let l: usize = lens.iter().sum();
        let (first, _, _) = parts
            .first()
            .ok_or_else(|| candle_core::Error::Msg("attention over no tokens".into()))?;
        let dev = first.device();
        let mut qkv = Vec::with_capacity(3);
        for which in 0..3 {
            let t = if let [(x, names, _)] = parts {
                self.linear(w, names[which], x)?
            } else {
                // SAFETY: the parts' rows tile 0..l, and each GEMM below
                // writes all of its rows' heads·d columns.
                let t = unsafe { crate::fused::uninit((1, l, heads * d), dev)? };
                let mut row = 0;
                for ((x, names, _), len) in parts.iter().zip(&lens) {
                    let name = names[which];
                    crate::lt::linear_into(
                        x,
                        &w.get(&format!("{name}.weight"))?,
                        &w.get(&format!("{name}.bias"))?,
                        &t,
                        row,
                        0,
                        false,
                    )?;
                    row += len;
                }
                t
            };
            qkv.push(t.reshape((1, l, heads, d))?);
        }
        let (cos, sin) = &rope.per_token;
        for (which, t) in qkv.iter().take(2).enumerate() {
            let norm = |i: usize| w.get(&format!("{}.weight", parts[i].2[which]));
            let (w_first, w_rest) = (norm(0)?, norm(parts.len() - 1)?);
            crate::fused::qk_norm_rope(t, &w_first, &w_rest, lens[0], cos, sin, 1e-6)?;
            crate::fused::count_launch();
        }
        let [q, k, v] = [&qkv[0], &qkv[1], &qkv[2]];
        match self.kernels.attention {
            Attention::Flash => attend_blhd(q, k, v),
            path => {
                let t = |x: &Tensor| x.transpose(1, 2);
                attend(&t(q)?, &t(k)?, &t(v)?, path)
            }
        }
    }

    /// `x + g ⊙ y` for the residual stream `x` `[B, L, H]`, a block's
    /// output `y` and its gate `g` `[B, H]`: one kernel with
    /// [`Kernels::fused_gate`] (batch 1, 16-byte aligned operands), else a
    /// broadcast multiply and an add.
    fn residual(&self, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.kernels.fused_gate {
            if x.dim(0)? == 1 && [x, y, g].iter().all(|t| crate::fused::fits(t)) {
                crate::fused::count_launch();
                return crate::fused::gate_residual(x, y, g);
            }
            crate::fused::count_fallback();
        }
        x + gate(y, g)?
    }

    /// A feed-forward's `linear(gelu(linear(x)))`, the GELU in the first
    /// GEMM's epilogue with [`Kernels::gelu_epilogue`].
    fn feed_forward(&self, w: &dyn Weights, name: &str, x: &Tensor) -> Result<Tensor> {
        let first = format!("{name}.net.0.proj");
        let hidden = self.linear_gelu(w, &first, x)?;
        self.linear(w, &format!("{name}.net.2"), &hidden)
    }

    /// `gelu(linear(x))`, in one GEMM with [`Kernels::gelu_epilogue`].
    fn linear_gelu(&self, w: &dyn Weights, name: &str, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.kernels.gelu_epilogue {
            let weight = w.get(&format!("{name}.weight"))?;
            let bias = w.get(&format!("{name}.bias"))?;
            return crate::lt::linear_bias_act(x, &weight, &bias, true);
        }
        self.linear(w, name, x)?.gelu()
    }

    fn double_block(
        &self,
        w: &dyn Weights,
        img: &Tensor,
        txt: &Tensor,
        temb: &Tensor,
        rope: &Rope,
    ) -> Result<(Tensor, Tensor)> {
        let silu = temb.silu()?;
        let m = self.linear(w, "norm1.linear", &silu)?.chunk(6, 1)?;
        let c = self.linear(w, "norm1_context.linear", &silu)?.chunk(6, 1)?;
        let img_n = self.norm_modulate(img, &m[0], &m[1])?;
        let txt_n = self.norm_modulate(txt, &c[0], &c[1])?;
        let attn = self.joint_attention(
            w,
            &[
                (
                    &txt_n,
                    ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
                    ["attn.norm_added_q", "attn.norm_added_k"],
                ),
                (
                    &img_n,
                    ["attn.to_q", "attn.to_k", "attn.to_v"],
                    ["attn.norm_q", "attn.norm_k"],
                ),
            ],
            rope,
        )?;
        let t_len = txt.dim(1)?;
        let txt_attn = attn.narrow(1, 0, t_len)?;
        let img_attn = attn.narrow(1, t_len, attn.dim(1)? - t_len)?;
        let img_attn = self.linear(w, "attn.to_out.0", &img_attn)?;
        let txt_attn = self.linear(w, "attn.to_add_out", &txt_attn)?;

        let img = self.residual(img, &img_attn, &m[2])?;
        let img_n = self.norm_modulate(&img, &m[3], &m[4])?;
        let ff = self.feed_forward(w, "ff", &img_n)?;
        let img = self.residual(&img, &ff, &m[5])?;

        let txt = self.residual(txt, &txt_attn, &c[2])?;
        let txt_n = self.norm_modulate(&txt, &c[3], &c[4])?;
        let ff = self.feed_forward(w, "ff_context", &txt_n)?;
        let txt = self.residual(&txt, &ff, &c[5])?;
        Ok((txt, img))
    }

    fn single_block(
        &self,
        w: &dyn Weights,
        hs: &Tensor,
        temb: &Tensor,
        rope: &Rope,
    ) -> Result<Tensor> {
        let m = self.linear(w, "norm.linear", &temb.silu()?)?.chunk(3, 1)?;
        let x = self.norm_modulate(hs, &m[0], &m[1])?;
        let qkv = (
            &x,
            ["attn.to_q", "attn.to_k", "attn.to_v"],
            ["attn.norm_q", "attn.norm_k"],
        );
        #[cfg(feature = "cuda")]
        if self.kernels.gelu_epilogue
            && x.dim(0)? == 1
            && crate::lt::aligned_at(0, 0, self.cfg.hidden())
            && self.cfg.hidden() % 8 == 0
            && w.get("proj_mlp.weight")?.dim(0)? % 8 == 0
        {
            // The MLP's GELU'd projection into columns H.. of the output
            // projection's input, then the attention into columns ..H.
            let (b, l, h) = x.dims3()?;
            let mlp_w = w.get("proj_mlp.weight")?;
            let mlp_width = mlp_w.dim(0)?;
            // SAFETY: the GEMM writes columns h..h + mlp_width of every row
            // and the copy columns 0..h: every element before the read.
            let joint = unsafe { crate::fused::uninit((b, l, h + mlp_width), x.device())? };
            crate::lt::linear_into(&x, &mlp_w, &w.get("proj_mlp.bias")?, &joint, 0, h, true)?;
            let attn = self.joint_attention(w, &[qkv], rope)?;
            crate::fused::copy_into_columns(&joint, &attn.contiguous()?, 0)?;
            crate::fused::count_launch();
            let out = self.linear(w, "proj_out", &joint)?;
            return self.residual(hs, &out, &m[2]);
        }
        let mlp = self.linear_gelu(w, "proj_mlp", &x)?;
        let attn = self.joint_attention(w, &[qkv], rope)?;
        let out = self.linear(w, "proj_out", &Tensor::cat(&[&attn, &mlp], D::Minus1)?)?;
        self.residual(hs, &out, &m[2])
    }
}

/// `x · g` for `x` `[B, L, H]` and a gate `g` `[B, H]`. With one batch as
/// `[L, H] · [1, H]`: the same products, with two dimensions of
/// broadcast index arithmetic per element on CUDA instead of three.
fn gate(x: &Tensor, g: &Tensor) -> Result<Tensor> {
    let (b, l, h) = x.dims3()?;
    if b == 1 && x.is_contiguous() {
        return x
            .reshape((l, h))?
            .broadcast_mul(&g.reshape((1, h))?)?
            .reshape((b, l, h));
    }
    x.broadcast_mul(&g.unsqueeze(1)?)
}

/// diffusers' `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)`
/// of `t · 1000` (scaled in bf16, as diffusers does), as bf16 `[B, 256]`.
fn timestep_embedding(t: &Tensor, dev: &Device) -> Result<Tensor> {
    let t: Vec<f32> = (t.to_dtype(DType::BF16)? * 1000.0)?
        .to_dtype(DType::F32)?
        .to_vec1()?;
    let half = 128usize;
    let mut out = Vec::with_capacity(t.len() * 2 * half);
    for &ti in &t {
        let freqs = (0..half).map(|k| (-(10000f32.ln()) * k as f32 / half as f32).exp());
        let angles: Vec<f32> = freqs.map(|f| ti * f).collect();
        out.extend(angles.iter().map(|a| a.cos()));
        out.extend(angles.iter().map(|a| a.sin()));
    }
    Tensor::from_vec(out, (t.len(), 2 * half), dev)?.to_dtype(DType::BF16)
}

/// `linear_2(silu(linear_1(x)))` (diffusers' `TimestepEmbedding` and
/// `PixArtAlphaTextProjection` with SiLU).
fn mlp(w: &dyn Weights, name: &str, x: &Tensor) -> Result<Tensor> {
    let h = linear(w, &format!("{name}.linear_1"), x)?.silu()?;
    linear(w, &format!("{name}.linear_2"), &h)
}

/// Every tensor of diffusers' `FluxTransformer2DModel` of `cfg`: name and
/// shape (all bf16 in a bf16 checkpoint), in diffusers' module order.
pub fn weight_shapes(cfg: &FluxConfig) -> Vec<(String, Vec<usize>)> {
    let (h, d) = (cfg.hidden(), cfg.attention_head_dim);
    let mut out = Vec::new();
    let mut lin = |name: String, o: usize, i: usize| {
        out.push((format!("{name}.weight"), vec![o, i]));
        out.push((format!("{name}.bias"), vec![o]));
    };
    lin("x_embedder".into(), h, cfg.in_channels);
    lin("context_embedder".into(), h, cfg.joint_attention_dim);
    let mut embedders = vec![("timestep_embedder", 256)];
    if cfg.guidance_embeds {
        embedders.push(("guidance_embedder", 256));
    }
    embedders.push(("text_embedder", cfg.pooled_projection_dim));
    for (e, width) in embedders {
        lin(format!("time_text_embed.{e}.linear_1"), h, width);
        lin(format!("time_text_embed.{e}.linear_2"), h, h);
    }
    for i in 0..cfg.num_layers {
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
    for i in 0..cfg.num_single_layers {
        let p = format!("single_transformer_blocks.{i}");
        lin(format!("{p}.norm.linear"), 3 * h, h);
        lin(format!("{p}.proj_mlp"), 4 * h, h);
        lin(format!("{p}.proj_out"), h, 5 * h);
        for n in ["to_q", "to_k", "to_v"] {
            lin(format!("{p}.attn.{n}"), h, h);
        }
    }
    lin("norm_out.linear".into(), 2 * h, h);
    lin("proj_out".into(), cfg.in_channels, h);
    for i in 0..cfg.num_layers {
        for n in ["norm_q", "norm_k", "norm_added_q", "norm_added_k"] {
            out.push((format!("transformer_blocks.{i}.attn.{n}.weight"), vec![d]));
        }
    }
    for i in 0..cfg.num_single_layers {
        for n in ["norm_q", "norm_k"] {
            out.push((
                format!("single_transformer_blocks.{i}.attn.{n}.weight"),
                vec![d],
            ));
        }
    }
    out
}

/// A seeded stream of uniform numbers in `[-1, 1)` (xorshift64*), so that
/// tests and tools make the same random checkpoint everywhere.
#[derive(Debug)]
pub struct Uniform(u64);

impl Uniform {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next number.
    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        (x as f32 / (1u64 << 23) as f32) - 1.0
    }

    /// The next two standard normal numbers (Box–Muller over two draws of
    /// this stream; |z| ≤ 5.8, the draws' 2⁻²⁴ resolution).
    pub fn next_normal_pair(&mut self) -> (f32, f32) {
        // (0, 1]: the logarithm stays finite.
        let u1 = 1.0 - (f64::from(self.next_f32()) + 1.0) / 2.0;
        let u2 = (f64::from(self.next_f32()) + 1.0) / 2.0;
        let r = (-2.0 * u1.ln()).sqrt();
        let a = std::f64::consts::TAU * u2;
        ((r * a.cos()) as f32, (r * a.sin()) as f32)
    }
}

/// The law a random checkpoint's weights are drawn from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// PyTorch's default `Linear` initialisation: weights and biases
    /// uniform in ±1/√fan-in; RMS-norm weights uniform in 1 ± 0.1.
    Uniform,
    /// Normal, as trained weights are spread (their exponents as wide):
    /// linear weights N(0, 1/fan-in), biases N(0, 1/(3·fan-in)) (the
    /// variance of PyTorch's uniform bias), RMS-norm weights 1 + N(0, 0.1²)
    /// (diffusers initialises them to ones).
    Normal,
}

impl Init {
    /// The name the checkpoint's `config.json` records (`_offload_init`)
    /// and the benchmark prints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Uniform => "uniform",
            Self::Normal => "normal",
        }
    }

    /// The law named `name` ([`Self::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Uniform, Self::Normal]
            .into_iter()
            .find(|i| i.name() == name)
    }

    /// `n` values of a tensor of this law: centred on `centre`, spread
    /// `scale` (the uniform law's half-width, the normal law's deviation).
    fn draw(self, rng: &mut Uniform, n: usize, centre: f32, scale: f32) -> Vec<f32> {
        match self {
            Self::Uniform => (0..n).map(|_| centre + scale * rng.next_f32()).collect(),
            Self::Normal => {
                let mut out = Vec::with_capacity(n + 1);
                while out.len() < n {
                    let (a, b) = rng.next_normal_pair();
                    out.extend([centre + scale * a, centre + scale * b]);
                }
                out.truncate(n);
                out
            }
        }
    }
}

/// The key of diffusers' `config.json` where a random checkpoint records
/// its [`Init`] (diffusers ignores keys starting with `_`).
pub const INIT_KEY: &str = "_offload_init";

fn bf16_bytes(values: impl Iterator<Item = f32>) -> Vec<u8> {
    values
        .flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
        .collect()
}

impl FluxConfig {
    /// diffusers' `config.json` for this shape.
    pub fn to_diffusers_json(&self) -> String {
        serde_json::json!({
            "_class_name": "FluxTransformer2DModel",
            "patch_size": 1,
            "in_channels": self.in_channels,
            "num_layers": self.num_layers,
            "num_single_layers": self.num_single_layers,
            "attention_head_dim": self.attention_head_dim,
            "num_attention_heads": self.num_attention_heads,
            "joint_attention_dim": self.joint_attention_dim,
            "pooled_projection_dim": self.pooled_projection_dim,
            "guidance_embeds": self.guidance_embeds,
            "axes_dims_rope": self.axes_dims_rope,
        })
        .to_string()
    }
}

/// Writes a random bf16 checkpoint of `cfg` into `dir` as diffusers lays
/// one out (`config.json`, `diffusion_pytorch_model.safetensors`), its
/// weights drawn by `init` from the stream of `seed`; `config.json` records
/// the law under [`INIT_KEY`].
pub fn write_random_checkpoint(
    dir: &std::path::Path,
    cfg: &FluxConfig,
    seed: u64,
    init: Init,
) -> std::result::Result<(), offload_safetensors::CheckpointError> {
    let io = |e| offload_safetensors::CheckpointError::Io {
        path: dir.to_owned(),
        source: e,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut config: serde_json::Value =
        serde_json::from_str(&cfg.to_diffusers_json()).expect("to_diffusers_json writes JSON");
    config[INIT_KEY] = init.name().into();
    std::fs::write(dir.join("config.json"), config.to_string()).map_err(io)?;
    let mut rng = Uniform::new(seed);
    let mut tensors = Vec::new();
    let shapes = weight_shapes(cfg);
    for (name, shape) in &shapes {
        let n: usize = shape.iter().product();
        let values = if name.contains(".norm_") {
            init.draw(&mut rng, n, 1.0, 0.1)
        } else {
            // A bias has the fan-in of its weight.
            let fan_in = shapes
                .iter()
                .find(|(w, _)| *w == name.replace(".bias", ".weight"))
                .map_or(1, |(_, s)| s.get(1).copied().unwrap_or(1));
            let bound = 1.0 / (fan_in as f32).sqrt();
            let scale = match init {
                Init::Normal if name.ends_with(".bias") => bound / 3f32.sqrt(),
                _ => bound,
            };
            init.draw(&mut rng, n, 0.0, scale)
        };
        let shape = shape.iter().map(|&d| d as u64).collect();
        tensors.push((
            name.clone(),
            offload_core::model::DType::Bf16,
            shape,
            bf16_bytes(values.into_iter()),
        ));
    }
    offload_safetensors::write_file(&dir.join("diffusion_pytorch_model.safetensors"), &tensors)
}

/// The [`Init`] a checkpoint's `config.json` records, or `None` (a
/// checkpoint not written by [`write_random_checkpoint`] or
/// `flux_reference.py make-checkpoint`).
pub fn recorded_init(config_json: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(config_json).ok()?;
    v.get(INIT_KEY)?.as_str().map(str::to_owned)
}

/// Random inputs for a `side × side` latent grid (`side²` image tokens)
/// and `text` tokens, on `device`: latents and text states uniform in ±1,
/// timestep 0.5, guidance 3.5, image ids `(0, row, col)`, text ids 0.
pub fn random_inputs(
    cfg: &FluxConfig,
    side: usize,
    text: usize,
    seed: u64,
    device: &Device,
) -> Result<FluxInputs> {
    let mut rng = Uniform::new(seed);
    let mut uniform = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.next_f32()).collect() };
    let s = side * side;
    let bf16 =
        |v: Vec<f32>, shape: &[usize]| Tensor::from_vec(v, shape, device)?.to_dtype(DType::BF16);
    let img_ids: Vec<f32> = (0..s)
        .flat_map(|i| [0.0, (i / side) as f32, (i % side) as f32])
        .collect();
    Ok(FluxInputs {
        hidden_states: bf16(uniform(s * cfg.in_channels), &[1, s, cfg.in_channels])?,
        encoder_hidden_states: bf16(
            uniform(text * cfg.joint_attention_dim),
            &[1, text, cfg.joint_attention_dim],
        )?,
        pooled_projections: bf16(
            uniform(cfg.pooled_projection_dim),
            &[1, cfg.pooled_projection_dim],
        )?,
        timestep: Tensor::new(&[0.5f32], device)?,
        guidance: Tensor::new(&[3.5f32], device)?,
        img_ids: Tensor::from_vec(img_ids, (s, 3), device)?,
        txt_ids: Tensor::zeros((text, 3), DType::F32, device)?,
    })
}

impl FluxInputs {
    /// The inputs by name, as the reference script reads and writes them.
    pub fn to_map(&self) -> std::collections::HashMap<String, Tensor> {
        [
            ("hidden_states", &self.hidden_states),
            ("encoder_hidden_states", &self.encoder_hidden_states),
            ("pooled_projections", &self.pooled_projections),
            ("timestep", &self.timestep),
            ("guidance", &self.guidance),
            ("img_ids", &self.img_ids),
            ("txt_ids", &self.txt_ids),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.clone()))
        .collect()
    }

    /// The inputs from a `.safetensors` file written by [`Self::save`] or
    /// the reference script, on `device`.
    pub fn load(path: &std::path::Path, device: &Device) -> Result<Self> {
        let mut m = candle_core::safetensors::load(path, device)?;
        let mut take = |k: &str| {
            m.remove(k).ok_or_else(|| {
                candle_core::Error::Msg(format!("{}: no tensor `{k}`", path.display()))
            })
        };
        Ok(Self {
            hidden_states: take("hidden_states")?,
            encoder_hidden_states: take("encoder_hidden_states")?,
            pooled_projections: take("pooled_projections")?,
            timestep: take("timestep")?,
            guidance: take("guidance")?,
            img_ids: take("img_ids")?,
            txt_ids: take("txt_ids")?,
        })
    }

    /// Writes the inputs to a `.safetensors` file.
    pub fn save(&self, path: &std::path::Path) -> Result<()> {
        candle_core::safetensors::save(&self.to_map(), path)
    }
}
