//! Workload presets: synthetic diffusion pipelines with the tensor names,
//! shapes and dtypes of real models, plus the work each DiT block does for a
//! given token count (which rows each weight's GEMM runs on, the
//! attention), and a deterministic weight source.

use offload_core::ComponentDeclaration;
use offload_core::model::{DType, ModuleBuilder, Pipeline, PipelineBuilder};
use offload_core::model::{ModuleId, StorageId, Tensor, TensorKind};
use offload_core::runtime::WeightSource;

use crate::profile::{BlockWork, LinearWork};

/// How a block's attention scales with tokens (its linears are read off
/// its weights: [`Preset::block_work`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockCost {
    /// Width of attention.
    pub hidden: u64,
    /// Whether the block runs attention over all tokens.
    pub attention: bool,
}

/// The tokens of one DiT forward, by stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenSplit {
    /// Image (or video) tokens.
    pub image: u64,
    /// Text tokens.
    pub text: u64,
}

impl TokenSplit {
    /// `total` tokens of which the text takes `text_tokens`, but never more
    /// than half (`total / 2`, rounded down) when the total is small; the
    /// image takes the rest. So `image + text == total`, and a tiny total
    /// keeps at least as many image tokens as text tokens.
    pub fn of(total: u64, text_tokens: u64) -> Self {
        let text = text_tokens.min(total / 2);
        Self {
            image: total - text,
            text,
        }
    }

    /// Image and text tokens together.
    pub fn total(&self) -> u64 {
        self.image + self.text
    }
}

/// Which rows a linear's GEMM runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// One row: the conditioning vector (modulation, time embedding).
    One,
    /// The text tokens.
    Text,
    /// The image tokens.
    Image,
    /// Every token.
    All,
}

impl Rows {
    /// How many rows that is for `split`.
    pub fn count(self, split: TokenSplit) -> u64 {
        match self {
            Self::One => 1,
            Self::Text => split.text,
            Self::Image => split.image,
            Self::All => split.total(),
        }
    }
}

/// Where a tensor sits in a DiT: in which kind of block, or outside blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// A dual-stream (MMDiT) block: Flux's double blocks, Qwen-Image's
    /// blocks (`transformer_blocks`).
    Dual,
    /// A single-stream block: Flux's single blocks
    /// (`single_transformer_blocks`).
    Single,
    /// A Wan block: self-attention, cross-attention to the text, MLP
    /// (`blocks`).
    Wan,
    /// A block of another container.
    OtherBlock,
    /// Outside the blocks.
    Outside,
}

/// The elementwise work of one block in diffusers' eager forward, as
/// passes over `tokens × hidden` activations (each element read or written
/// counts once; a pass over the MLP's 4·hidden counts 4): counted from
/// `FluxTransformerBlock` and `FluxSingleTransformerBlock` (Qwen-Image's
/// dual-stream blocks and Wan's blocks do the same kinds of work and are
/// charged as the nearest of the two). These ops are memory-bound: they
/// cost their bytes at memory bandwidth, whatever their FLOPs.
pub fn elementwise_passes(place: Place) -> &'static [(&'static str, u64)] {
    const DUAL: &[(&str, u64)] = &[
        ("norm1: LayerNorm", 2),
        ("modulation: x·(1 + scale) + shift", 4),
        ("RMSNorm of q and k", 8),
        ("rotary embedding of q and k", 8),
        ("concatenate text and image q, k, v", 6),
        ("attention reads q, k, v and writes o", 4),
        ("split the attention output", 2),
        ("gate · attention + residual", 5),
        ("norm2 + modulation", 6),
        ("GELU over 4·hidden", 8),
        ("gate · MLP + residual", 5),
    ];
    const SINGLE: &[(&str, u64)] = &[
        ("norm + modulation", 6),
        ("GELU over 4·hidden", 8),
        ("RMSNorm of q and k", 8),
        ("rotary embedding of q and k", 8),
        ("attention reads q, k, v and writes o", 4),
        ("concatenate attention and MLP (5·hidden)", 10),
        ("gate · projection + residual", 5),
    ];
    match place {
        Place::Dual | Place::Wan => DUAL,
        Place::Single => SINGLE,
        Place::OtherBlock | Place::Outside => &[],
    }
}

/// Block containers by name.
const CONTAINERS: [(&str, Place); 3] = [
    ("transformer_blocks", Place::Dual),
    ("single_transformer_blocks", Place::Single),
    ("blocks", Place::Wan),
];

/// The rows each linear runs on: (place, module path within the block or,
/// outside blocks, within the DiT, rows). A rule matches a tensor whose
/// path starts with the module path followed by `.`; the first match wins;
/// a linear no rule matches runs on every token. Wan's blocks have no
/// modulation linear (their `scale_shift_table` is added, not multiplied).
const ROW_RULES: &[(Place, &str, Rows)] = &[
    // Dual-stream blocks: modulations on the conditioning vector, the
    // text stream's weights on the text, the image stream's on the image.
    (Place::Dual, "norm1.linear", Rows::One),
    (Place::Dual, "norm1_context.linear", Rows::One),
    (Place::Dual, "img_mod", Rows::One),
    (Place::Dual, "txt_mod", Rows::One),
    (Place::Dual, "attn.add_q_proj", Rows::Text),
    (Place::Dual, "attn.add_k_proj", Rows::Text),
    (Place::Dual, "attn.add_v_proj", Rows::Text),
    (Place::Dual, "attn.to_add_out", Rows::Text),
    (Place::Dual, "ff_context", Rows::Text),
    (Place::Dual, "txt_mlp", Rows::Text),
    (Place::Dual, "attn.to_q", Rows::Image),
    (Place::Dual, "attn.to_k", Rows::Image),
    (Place::Dual, "attn.to_v", Rows::Image),
    (Place::Dual, "attn.to_out", Rows::Image),
    (Place::Dual, "ff", Rows::Image),
    (Place::Dual, "img_mlp", Rows::Image),
    // Single-stream blocks: the modulation on one row, the rest on all.
    (Place::Single, "norm.linear", Rows::One),
    // Wan blocks: cross-attention keys and values on the text.
    (Place::Wan, "attn2.to_k", Rows::Text),
    (Place::Wan, "attn2.to_v", Rows::Text),
    // Outside blocks: embeddings of the conditioning vector, of the text,
    // of the image; the final modulation and projection.
    (Place::Outside, "time_text_embed", Rows::One),
    (
        Place::Outside,
        "condition_embedder.time_embedder",
        Rows::One,
    ),
    (Place::Outside, "condition_embedder.time_proj", Rows::One),
    (Place::Outside, "norm_out.linear", Rows::One),
    (Place::Outside, "context_embedder", Rows::Text),
    (Place::Outside, "txt_in", Rows::Text),
    (
        Place::Outside,
        "condition_embedder.text_embedder",
        Rows::Text,
    ),
    (Place::Outside, "x_embedder", Rows::Image),
    (Place::Outside, "img_in", Rows::Image),
    (Place::Outside, "proj_out", Rows::Image),
];

/// Whether `path` is `module` or lies below it.
fn under(path: &str, module: &str) -> bool {
    path.strip_prefix(module)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

fn rows_in(place: Place, local: &str) -> Rows {
    ROW_RULES
        .iter()
        .find(|(p, module, _)| *p == place && under(local, module))
        .map_or(Rows::All, |(_, _, rows)| *rows)
}

fn place_of_container(name: &str) -> Place {
    CONTAINERS
        .iter()
        .find(|(c, _)| *c == name)
        .map_or(Place::OtherBlock, |(_, p)| *p)
}

/// Where a DiT-relative path lies: the first `name.N` pair (N a number)
/// names its block's container, and the rest is the path within the
/// block; with none it lies outside blocks.
fn locate(path: &str) -> (Place, &str) {
    let mut offset = 0;
    let mut segments = path.split('.').peekable();
    while let Some(segment) = segments.next() {
        offset += segment.len() + 1;
        if let Some(index) = segments.peek()
            && !index.is_empty()
            && index.bytes().all(|b| b.is_ascii_digit())
        {
            let local = path.get(offset + index.len() + 1..).unwrap_or("");
            return (place_of_container(segment), local);
        }
    }
    (Place::Outside, path)
}

/// Rows of the GEMM of the linear weight at `dit_relative_tensor_path`
/// (the tensor's path within its DiT, e.g.
/// `transformer_blocks.3.attn.add_q_proj.weight` or `proj_out.weight`, not
/// prefixed by the component's own path) for a forward over `split`
/// (the table `ROW_RULES`: modulations on one row, each stream's weights on
/// its own tokens, the rest on all tokens). Meaningful for 2-D weights
/// ([`is_linear_weight`]).
pub fn linear_rows(dit_relative_tensor_path: &str, split: TokenSplit) -> u64 {
    let (place, local) = locate(dit_relative_tensor_path);
    rows_in(place, local).count(split)
}

/// Live activation tensors of one DiT block, each `tokens × hidden` bf16,
/// in the activation model ([`Preset::component_activation_bytes`]): the input and
/// the residual (2), q, k and v (3), the MLP's 4·hidden hidden state (4)
/// and the single-stream block's 5·hidden concatenation of attention and
/// MLP (5), plus the attention output and the gated output (2).
pub const ACTIVATION_TENSORS: u64 = 16;

/// The commonest input width of the 2-D weights under `module` (an
/// encoder's model width).
fn linear_width(p: &Pipeline, module: ModuleId) -> u64 {
    let mut count: std::collections::BTreeMap<u64, usize> = std::collections::BTreeMap::new();
    for t in p.subtree_tensors(module) {
        let t = p.tensor(t);
        if is_linear_weight(t) {
            *count.entry(t.shape[1]).or_default() += 1;
        }
    }
    count
        .into_iter()
        .max_by_key(|(w, n)| (*n, *w))
        .map_or(0, |(w, _)| w)
}

/// Whether the work model treats `t` as a linear's weight: a 2-D
/// parameter (out × in). Every 2-D parameter of the DiT presets is a bf16
/// linear weight.
pub fn is_linear_weight(t: &Tensor) -> bool {
    t.kind == TensorKind::Parameter && t.shape.len() == 2
}

/// A preset: the pipeline and what its forward costs.
#[derive(Clone, Debug)]
pub struct Preset {
    /// Name on the command line.
    pub name: &'static str,
    /// The description.
    pub pipeline: Pipeline,
    /// DiT component paths, in the order denoising uses them (two experts:
    /// the first serves the first half of the steps).
    pub dits: Vec<&'static str>,
    /// Encoder component paths.
    pub encoders: Vec<&'static str>,
    /// VAE component paths.
    pub vaes: Vec<&'static str>,
    /// Attention cost of DiT blocks.
    pub block_cost: BlockCost,
    /// Default tokens per forward (image + text).
    pub default_tokens: u64,
    /// Text tokens encoders run over.
    pub text_tokens: u64,
    /// FLOPs of one VAE decode.
    pub vae_flops: f64,
    /// The VAE decoder's channel widths, widest first (its activation
    /// model's feature maps).
    pub vae_channels: [u64; 4],
    /// Output pixels per image token (Flux, Qwen-Image: a token is a 2×2
    /// patch of latents, each 8×8 pixels: 256; Wan: × 4 frames).
    pub pixels_per_token: u64,
    /// Chunks the VAE decodes its output in (1 for an image; a video VAE
    /// decodes a latent frame at a time).
    pub vae_chunks: u64,
}

impl Preset {
    /// Every preset name.
    pub const NAMES: [&'static str; 5] = [
        "flux1-dev",
        "wan2.2-t2v-a14b",
        "qwen-image",
        "tiny",
        "tiny-wide",
    ];

    /// The preset called `name`.
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "flux1-dev" => Some(flux1_dev()),
            "wan2.2-t2v-a14b" => Some(wan22_t2v_a14b()),
            "qwen-image" => Some(qwen_image()),
            "tiny" => Some(tiny()),
            "tiny-wide" => Some(tiny_wide()),
            _ => None,
        }
    }

    /// Total weight bytes.
    pub fn weight_bytes(&self) -> u64 {
        self.pipeline.storages().map(|(_, s)| s.bytes).sum()
    }

    /// Total parameter count.
    pub fn parameters(&self) -> u64 {
        self.pipeline
            .tensors()
            .filter(|(_, t)| t.kind == TensorKind::Parameter)
            .map(|(_, t)| t.numel())
            .sum()
    }

    /// `total_tokens` split between image and text: [`TokenSplit::of`]
    /// with this preset's [`Self::text_tokens`]. Wan's text is not part of
    /// its sequence (only cross-attended), so there the split undercounts
    /// the image by the text tokens; only its final `proj_out` runs on
    /// image rows (its blocks run on all tokens), a negligible error.
    pub fn split(&self, total_tokens: u64) -> TokenSplit {
        TokenSplit::of(total_tokens, self.text_tokens)
    }

    /// Device memory a forward of component `path` needs beside its weights
    /// at `tokens` tokens per denoising forward (the simulator's activation
    /// model; the harness allocates exactly this while the forward runs):
    ///
    /// * a DiT: [`ACTIVATION_TENSORS`] live tensors of `tokens × hidden`
    ///   bf16 (0.45 GB for Flux at 4,608 tokens; the GPU proxy measured
    ///   0.46);
    /// * an encoder: the same over its text tokens and its own width (the
    ///   commonest input width of its linears);
    /// * a VAE: its full-resolution decode of one chunk, the widest live
    ///   set there: the last up block's input (`vae_channels[2]` wide) and
    ///   its upsampled copy, and two feature maps of `vae_channels[3]`, bf16
    ///   (1.61 GB at 1024²).
    pub fn component_activation_bytes(&self, pipeline: &Pipeline, path: &str, tokens: u64) -> u64 {
        let split = self.split(tokens);
        if self.dits.contains(&path) {
            tokens * self.block_cost.hidden * 2 * ACTIVATION_TENSORS
        } else if self.encoders.contains(&path) {
            let width = pipeline
                .module_id(path)
                .map_or(0, |m| linear_width(pipeline, m));
            self.text_tokens * width * 2 * ACTIVATION_TENSORS
        } else if self.vaes.contains(&path) {
            let pixels = self.vae_pixels(split);
            let c = self.vae_channels;
            pixels * (2 * c[2] + 2 * c[3]) * 2
        } else {
            0
        }
    }

    /// Output pixels of one VAE decode chunk for `split`.
    pub fn vae_pixels(&self, split: TokenSplit) -> u64 {
        split.image * self.pixels_per_token / self.vae_chunks.max(1)
    }

    /// The request this preset's warm-up recipe declares for `tokens` and
    /// `steps` (its output size from the image tokens; square).
    pub fn request(&self, tokens: u64, steps: u32) -> offload_core::request::RequestShape {
        let split = self.split(tokens);
        let pixels = split.image * self.pixels_per_token / self.vae_chunks.max(1);
        let side = (pixels as f64).sqrt().round() as u32;
        offload_core::request::RequestShape {
            frames: u32::try_from(self.vae_chunks).unwrap_or(1).max(1),
            ..offload_core::request::RequestShape::new(tokens, steps).with_output(side, side)
        }
    }

    /// The work of the DiT block `block` of `pipeline` for a forward over
    /// `split`: each linear on its rows ([`linear_rows`]), the attention
    /// (`4·T²·hidden` over all tokens, plus `4·T·T_text·hidden` of
    /// cross-attention in Wan blocks), the other weight bytes.
    pub fn block_work(&self, pipeline: &Pipeline, block: ModuleId, split: TokenSplit) -> BlockWork {
        let m = pipeline.module(block);
        let list = m.parent.map(|l| pipeline.module(l));
        let place = list.map_or(Place::OtherBlock, |l| place_of_container(&l.name));
        // The DiT holding the block: one of this preset's, else the
        // container's parent.
        let dit = self
            .dits
            .iter()
            .copied()
            .find(|d| under(&m.path, d))
            .or_else(|| {
                list.and_then(|l| l.parent)
                    .map(|c| pipeline.module(c).path.as_str())
            })
            .unwrap_or("");
        let tensors = pipeline.subtree_tensors(block);
        let mut work = work_of(pipeline, &tensors, dit, split);
        work.attention_flops = self.attention_flops(place, split);
        work.activation_bytes = self.activation_bytes(place, split);
        work
    }

    /// Bytes of activations one block's elementwise work moves (norms,
    /// modulation, rotary embedding, concatenations, the attention's own
    /// inputs and output, activation functions, gates and residual adds):
    /// [`elementwise_passes`] over `tokens × hidden` bf16 elements. None
    /// without [`BlockCost::attention`] (the synthetic test presets).
    fn activation_bytes(&self, place: Place, split: TokenSplit) -> u64 {
        if !self.block_cost.attention {
            return 0;
        }
        let passes: u64 = elementwise_passes(place).iter().map(|(_, n)| n).sum();
        passes * split.total() * self.block_cost.hidden * 2
    }

    /// The work of the DiT `component`'s tensors outside its blocks
    /// (embeddings, final norm and projection) for a forward over `split`:
    /// linears only.
    pub fn non_block_work(
        &self,
        pipeline: &Pipeline,
        component: ModuleId,
        split: TokenSplit,
    ) -> BlockWork {
        let tensors = crate::harness::own_tensors(pipeline, component);
        work_of(pipeline, &tensors, &pipeline.module(component).path, split)
    }

    /// Attention FLOPs of one block at `place`: `4·T²·hidden` over all
    /// `T` tokens (joint attention in dual-stream blocks, self-attention
    /// elsewhere), and in Wan blocks the cross-attention's
    /// `4·T·T_text·hidden` (the queries are every token of the sequence,
    /// the keys the text's). None without [`BlockCost::attention`].
    fn attention_flops(&self, place: Place, split: TokenSplit) -> f64 {
        if !self.block_cost.attention {
            return 0.0;
        }
        let (t, text, hidden) = (
            split.total() as f64,
            split.text as f64,
            self.block_cost.hidden as f64,
        );
        let cross = if place == Place::Wan {
            4.0 * t * text * hidden
        } else {
            0.0
        };
        4.0 * t * t * hidden + cross
    }
}

/// The linears (on [`linear_rows`]) and other bytes of `tensors`, which
/// lie below the DiT at `dit`.
fn work_of(
    pipeline: &Pipeline,
    tensors: &[offload_core::model::TensorId],
    dit: &str,
    split: TokenSplit,
) -> BlockWork {
    let mut work = BlockWork::default();
    for &id in tensors {
        let t = pipeline.tensor(id);
        let bytes = t.numel() * t.dtype.size_bytes();
        // Every byte is read once more by the fold that checks it (the
        // simulator's kernels and the GPU proxy both fold what they read).
        work.other_bytes += bytes;
        if !is_linear_weight(t) {
            continue;
        }
        let path = pipeline.tensor_path(id);
        let relative = path
            .strip_prefix(dit)
            .and_then(|p| p.strip_prefix('.'))
            .unwrap_or(&path);
        work.linears.push(LinearWork {
            rows: linear_rows(relative, split),
            out_features: t.shape[0],
            in_features: t.shape[1],
            weight_bytes: bytes,
        });
    }
    work
}

fn linear(m: &mut ModuleBuilder<'_>, name: &str, out_f: u64, in_f: u64, bias: bool) {
    m.parameter(&format!("{name}.weight"), DType::Bf16, &[out_f, in_f]);
    if bias {
        m.parameter(&format!("{name}.bias"), DType::Bf16, &[out_f]);
    }
}

fn rms(m: &mut ModuleBuilder<'_>, name: &str, dim: u64) {
    m.parameter(&format!("{name}.weight"), DType::Bf16, &[dim]);
}

/// A dual-stream (MMDiT) block, as Flux's double blocks and Qwen-Image's
/// blocks: two modulations, joint attention with added projections and
/// QK norms, two MLPs. Only the names of the modulations and MLPs differ.
fn dual_stream_block(
    blk: &mut ModuleBuilder<'_>,
    d: u64,
    ff: u64,
    head: u64,
    modulations: [&str; 2],
    mlps: [&str; 2],
) {
    for m in modulations {
        linear(blk, m, 6 * d, d, true);
    }
    for p in [
        "to_q",
        "to_k",
        "to_v",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_out.0",
        "to_add_out",
    ] {
        linear(blk, &format!("attn.{p}"), d, d, true);
    }
    for n in ["norm_q", "norm_k", "norm_added_q", "norm_added_k"] {
        rms(blk, &format!("attn.{n}"), head);
    }
    for f in mlps {
        linear(blk, &format!("{f}.net.0.proj"), ff, d, true);
        linear(blk, &format!("{f}.net.2"), d, ff, true);
    }
}

const FULL_VAE: [u64; 4] = [512, 512, 256, 128];

/// A preset's declared warm-up request: `tokens` per denoising forward
/// (512 of them text), `steps` steps, the output its image tokens decode
/// to (square, `chunks` frames), 2 warm-up steps.
fn warmup(
    tokens: u64,
    steps: u32,
    pixels_per_token: u64,
    chunks: u64,
) -> offload_core::request::RequestShape {
    let text = 512.min(tokens / 4);
    let pixels = (tokens - text) * pixels_per_token / chunks.max(1);
    let side = (pixels as f64).sqrt().round() as u32;
    offload_core::request::RequestShape {
        frames: chunks as u32,
        ..offload_core::request::RequestShape::new(tokens, steps).with_output(side, side)
    }
}

fn declare(b: &mut PipelineBuilder, dit: &[&str], encoder: &[&str], vae: &[&str]) {
    let own = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect();
    b.declare_components(ComponentDeclaration {
        dit: own(dit),
        encoder: own(encoder),
        vae: own(vae),
        resident: vec![],
    });
}

/// A T5 encoder stack (`encoder.block.N`), as T5-XXL / umT5-XXL.
fn t5(b: &mut PipelineBuilder, path: &str, layers: usize, d: u64, ff: u64, vocab: u64) {
    let mut m = b.module(path);
    m.parameter("shared.weight", DType::Bf16, &[vocab, d]);
    m.list("encoder.block", layers, |i, blk| {
        for p in ["q", "k", "v", "o"] {
            linear(blk, &format!("layer.0.SelfAttention.{p}"), d, d, false);
        }
        if i == 0 {
            blk.parameter(
                "layer.0.SelfAttention.relative_attention_bias.weight",
                DType::Bf16,
                &[32, 64],
            );
        }
        rms(blk, "layer.0.layer_norm", d);
        linear(blk, "layer.1.DenseReluDense.wi_0", ff, d, false);
        linear(blk, "layer.1.DenseReluDense.wi_1", ff, d, false);
        linear(blk, "layer.1.DenseReluDense.wo", d, ff, false);
        rms(blk, "layer.1.layer_norm", d);
    });
    rms(&mut m, "encoder.final_layer_norm", d);
    m.block_containers(&["encoder.block"]);
}

/// A CLIP-L text encoder.
fn clip_l(b: &mut PipelineBuilder, path: &str) {
    let mut m = b.module(path);
    m.parameter(
        "text_model.embeddings.token_embedding.weight",
        DType::Bf16,
        &[49408, 768],
    );
    m.parameter(
        "text_model.embeddings.position_embedding.weight",
        DType::Bf16,
        &[77, 768],
    );
    m.buffer(
        "text_model.embeddings.position_ids",
        DType::I64,
        &[1, 77],
        false,
    );
    m.list("text_model.encoder.layers", 12, |_, l| {
        for p in ["q_proj", "k_proj", "v_proj", "out_proj"] {
            linear(l, &format!("self_attn.{p}"), 768, 768, true);
        }
        for n in ["layer_norm1", "layer_norm2"] {
            l.parameter(&format!("{n}.weight"), DType::Bf16, &[768]);
            l.parameter(&format!("{n}.bias"), DType::Bf16, &[768]);
        }
        linear(l, "mlp.fc1", 3072, 768, true);
        linear(l, "mlp.fc2", 768, 3072, true);
    });
    m.parameter("text_model.final_layer_norm.weight", DType::Bf16, &[768]);
    m.parameter("text_model.final_layer_norm.bias", DType::Bf16, &[768]);
    m.block_containers(&["text_model.encoder.layers"]);
}

/// A KL VAE decoder with channel widths `ch` (\[512, 512, 256, 128\] is
/// the released decoder, about 50 M parameters).
fn vae(b: &mut PipelineBuilder, path: &str, latent: u64, ch: [u64; 4]) {
    let mut m = b.module(path);
    m.parameter(
        "decoder.conv_in.weight",
        DType::Bf16,
        &[ch[0], latent, 3, 3],
    );
    m.list("decoder.up_blocks", 4, |i, up| {
        let c = ch[i];
        up.list("resnets", 3, |_, r| {
            r.parameter("conv1.weight", DType::Bf16, &[c, c, 3, 3]);
            r.parameter("conv2.weight", DType::Bf16, &[c, c, 3, 3]);
        });
    });
    m.parameter("decoder.conv_out.weight", DType::Bf16, &[3, ch[3], 3, 3]);
}

/// The Flux.1-dev transformer: 19 double + 38 single blocks, hidden 3072
/// (11.9 B parameters).
fn flux_transformer(b: &mut PipelineBuilder) {
    let (d, ff, head) = (3072u64, 12288u64, 128u64);
    {
        let mut t = b.module("transformer");
        linear(&mut t, "x_embedder", d, 64, true);
        linear(&mut t, "context_embedder", d, 4096, true);
        for e in ["timestep_embedder", "guidance_embedder"] {
            linear(
                &mut t,
                &format!("time_text_embed.{e}.linear_1"),
                d,
                256,
                true,
            );
            linear(&mut t, &format!("time_text_embed.{e}.linear_2"), d, d, true);
        }
        linear(
            &mut t,
            "time_text_embed.text_embedder.linear_1",
            d,
            768,
            true,
        );
        linear(&mut t, "time_text_embed.text_embedder.linear_2", d, d, true);
        t.buffer("pos_embed.freqs", DType::F32, &[4608, 64], false);
        t.list("transformer_blocks", 19, |_, blk| {
            dual_stream_block(
                blk,
                d,
                ff,
                head,
                ["norm1.linear", "norm1_context.linear"],
                ["ff", "ff_context"],
            );
        });
        t.list("single_transformer_blocks", 38, |_, blk| {
            linear(blk, "norm.linear", 3 * d, d, true);
            linear(blk, "proj_mlp", ff, d, true);
            linear(blk, "proj_out", d, d + ff, true);
            for p in ["to_q", "to_k", "to_v"] {
                linear(blk, &format!("attn.{p}"), d, d, true);
            }
            rms(blk, "attn.norm_q", head);
            rms(blk, "attn.norm_k", head);
        });
        linear(&mut t, "norm_out.linear", 2 * d, d, true);
        linear(&mut t, "proj_out", 64, d, true);
        t.block_containers(&["transformer_blocks", "single_transformer_blocks"]);
    }
}

/// Flux.1-dev: the transformer, CLIP-L and T5-XXL text encoders, the
/// 16-channel VAE.
pub fn flux1_dev() -> Preset {
    let mut b = PipelineBuilder::new("FluxPipeline");
    flux_transformer(&mut b);
    clip_l(&mut b, "text_encoder");
    t5(&mut b, "text_encoder_2", 24, 4096, 10240, 32128);
    vae(&mut b, "vae", 16, FULL_VAE);
    declare(
        &mut b,
        &["transformer"],
        &["text_encoder", "text_encoder_2"],
        &["vae"],
    );
    b.warmup_request(warmup(4096 + 512, 28, 256, 1));
    Preset {
        name: "flux1-dev",
        pipeline: b.build().expect("flux preset builds"),
        dits: vec!["transformer"],
        encoders: vec!["text_encoder", "text_encoder_2"],
        vaes: vec!["vae"],
        block_cost: BlockCost {
            hidden: 3072,
            attention: true,
        },
        default_tokens: 4096 + 512,
        text_tokens: 512,
        vae_flops: 2.0e12,
        vae_channels: FULL_VAE,
        pixels_per_token: 256,
        vae_chunks: 1,
    }
}

/// The Flux.1-dev transformer alone (the GPU benchmark's model).
pub fn flux1_dev_dit() -> Pipeline {
    let mut b = PipelineBuilder::new("FluxTransformer");
    flux_transformer(&mut b);
    declare(&mut b, &["transformer"], &[], &[]);
    b.build().expect("flux transformer builds")
}

/// Flux.1-dev's DiT alone as a preset: [`flux1_dev`]'s costs and kernel
/// model on [`flux1_dev_dit`], no encoders or VAE to run between the
/// steps (the crossover sweeps' model).
pub fn flux1_dev_dit_preset() -> Preset {
    Preset {
        pipeline: flux1_dev_dit(),
        encoders: Vec::new(),
        vaes: Vec::new(),
        ..flux1_dev()
    }
}

fn wan_transformer(b: &mut PipelineBuilder, path: &str) {
    let (d, ff) = (5120u64, 13824u64);
    let mut t = b.module(path);
    t.parameter("patch_embedding.weight", DType::Bf16, &[d, 16, 1, 2, 2]);
    t.parameter("patch_embedding.bias", DType::Bf16, &[d]);
    linear(
        &mut t,
        "condition_embedder.time_embedder.linear_1",
        d,
        256,
        true,
    );
    linear(
        &mut t,
        "condition_embedder.time_embedder.linear_2",
        d,
        d,
        true,
    );
    linear(&mut t, "condition_embedder.time_proj", 6 * d, d, true);
    linear(
        &mut t,
        "condition_embedder.text_embedder.linear_1",
        d,
        4096,
        true,
    );
    linear(
        &mut t,
        "condition_embedder.text_embedder.linear_2",
        d,
        d,
        true,
    );
    t.buffer("rope.freqs", DType::F32, &[1024, 64], false);
    t.list("blocks", 40, |_, blk| {
        for a in ["attn1", "attn2"] {
            for p in ["to_q", "to_k", "to_v", "to_out.0"] {
                linear(blk, &format!("{a}.{p}"), d, d, true);
            }
            rms(blk, &format!("{a}.norm_q"), d);
            rms(blk, &format!("{a}.norm_k"), d);
        }
        blk.parameter("norm2.weight", DType::F32, &[d]);
        blk.parameter("norm2.bias", DType::F32, &[d]);
        linear(blk, "ffn.net.0.proj", ff, d, true);
        linear(blk, "ffn.net.2", d, ff, true);
        blk.parameter("scale_shift_table", DType::F32, &[1, 6, d]);
    });
    t.parameter("scale_shift_table", DType::F32, &[1, 2, d]);
    linear(&mut t, "proj_out", 64, d, true);
    t.block_containers(&["blocks"]);
}

/// Wan2.2-T2V-A14B: two 40-block experts (high noise, low noise), hidden
/// 5120, umT5-XXL encoder, the Wan VAE.
pub fn wan22_t2v_a14b() -> Preset {
    let mut b = PipelineBuilder::new("WanPipeline");
    wan_transformer(&mut b, "transformer");
    wan_transformer(&mut b, "transformer_2");
    t5(&mut b, "text_encoder", 24, 4096, 10240, 256_384);
    vae(&mut b, "vae", 16, FULL_VAE);
    declare(
        &mut b,
        &["transformer", "transformer_2"],
        &["text_encoder"],
        &["vae"],
    );
    b.warmup_request(warmup(32_760, 40, 1024, 21));
    Preset {
        name: "wan2.2-t2v-a14b",
        pipeline: b.build().expect("wan preset builds"),
        dits: vec!["transformer", "transformer_2"],
        encoders: vec!["text_encoder"],
        vaes: vec!["vae"],
        block_cost: BlockCost {
            hidden: 5120,
            attention: true,
        },
        default_tokens: 32_760,
        text_tokens: 512,
        vae_flops: 20.0e12,
        vae_channels: FULL_VAE,
        pixels_per_token: 1024,
        vae_chunks: 21,
    }
}

/// Qwen-Image: 60 dual-stream blocks, hidden 3072, a Qwen2.5-VL-7B text
/// encoder.
pub fn qwen_image() -> Preset {
    let (d, ff, head) = (3072u64, 12288u64, 128u64);
    let mut b = PipelineBuilder::new("QwenImagePipeline");
    {
        let mut t = b.module("transformer");
        linear(&mut t, "img_in", d, 64, true);
        linear(&mut t, "txt_in", d, 3584, true);
        rms(&mut t, "txt_norm", 3584);
        linear(
            &mut t,
            "time_text_embed.timestep_embedder.linear_1",
            d,
            256,
            true,
        );
        linear(
            &mut t,
            "time_text_embed.timestep_embedder.linear_2",
            d,
            d,
            true,
        );
        t.list("transformer_blocks", 60, |_, blk| {
            dual_stream_block(
                blk,
                d,
                ff,
                head,
                ["img_mod.1", "txt_mod.1"],
                ["img_mlp", "txt_mlp"],
            );
        });
        linear(&mut t, "norm_out.linear", 2 * d, d, true);
        linear(&mut t, "proj_out", 64, d, true);
        t.block_containers(&["transformer_blocks"]);
    }
    {
        let (h, inter) = (3584u64, 18944u64);
        let mut e = b.module("text_encoder");
        e.parameter("model.embed_tokens.weight", DType::Bf16, &[152_064, h]);
        e.list("model.layers", 28, |_, l| {
            linear(l, "self_attn.q_proj", h, h, true);
            linear(l, "self_attn.k_proj", 512, h, true);
            linear(l, "self_attn.v_proj", 512, h, true);
            linear(l, "self_attn.o_proj", h, h, false);
            linear(l, "mlp.gate_proj", inter, h, false);
            linear(l, "mlp.up_proj", inter, h, false);
            linear(l, "mlp.down_proj", h, inter, false);
            rms(l, "input_layernorm", h);
            rms(l, "post_attention_layernorm", h);
        });
        rms(&mut e, "model.norm", h);
        e.block_containers(&["model.layers"]);
    }
    vae(&mut b, "vae", 16, FULL_VAE);
    declare(&mut b, &["transformer"], &["text_encoder"], &["vae"]);
    b.warmup_request(warmup(4096 + 512, 50, 256, 1));
    Preset {
        name: "qwen-image",
        pipeline: b.build().expect("qwen preset builds"),
        dits: vec!["transformer"],
        encoders: vec!["text_encoder"],
        vaes: vec!["vae"],
        block_cost: BlockCost {
            hidden: d,
            attention: true,
        },
        default_tokens: 4096 + 512,
        text_tokens: 512,
        vae_flops: 2.0e12,
        vae_channels: FULL_VAE,
        pixels_per_token: 256,
        vae_chunks: 1,
    }
}

/// A tiny pipeline for tests: a Flux-shaped DiT of 3 double + 4 single
/// blocks of width 32 (an odd ring of 7), a second 3-block expert as in
/// Wan2.2 (the second half of the steps), a tied embedding, a
/// non-persistent buffer, mixed dtypes.
pub fn tiny() -> Preset {
    tiny_with("tiny", 32, false)
}

/// [`tiny`] with a module outside every component (`scheduler`, as a
/// runtime's own embedding table: resident for the whole request, uploaded
/// at enable) and a text encoder whose embedding is the pipeline's largest
/// unit, so that where the encoder is kept under a host budget the upload
/// buffer the plan counts (CONTRACT §7c) is the one its upload uses.
pub fn tiny_outside() -> Preset {
    tiny_with("tiny-outside", 32, true)
}

/// [`tiny`] with hidden size 128: its linear weights (12,288 to 65,536
/// values) are large enough for a lossless exponent code to take them
/// (CONTRACT §7b), the streamed blocks about 2.3 MB in all.
pub fn tiny_wide() -> Preset {
    tiny_with("tiny-wide", 128, false)
}

fn tiny_with(name: &'static str, d: u64, outside: bool) -> Preset {
    let mut b = PipelineBuilder::new("TinyPipeline");
    if outside {
        b.module("scheduler")
            .parameter("table.weight", DType::Bf16, &[512, d]);
    }
    {
        let mut t = b.module("transformer");
        linear(&mut t, "x_embedder", d, 16, true);
        t.buffer("pos_embed.freqs", DType::F32, &[8, 4], false);
        t.list("transformer_blocks", 3, |_, blk| {
            linear(blk, "attn.to_qkv", 3 * d, d, true);
            linear(blk, "ff.net.0.proj", 4 * d, d, false);
            rms(blk, "attn.norm_q", 8);
            blk.parameter("scale", DType::F8E4M3, &[d]);
        });
        t.list("single_transformer_blocks", 4, |i, blk| {
            linear(blk, "proj_mlp", 2 * d + i as u64, d, true);
            blk.parameter("gate", DType::F32, &[d]);
        });
        linear(&mut t, "proj_out", 16, d, true);
        t.block_containers(&["transformer_blocks", "single_transformer_blocks"]);
    }
    {
        // A second expert, as Wan2.2's low-noise DiT: a second ring, whose
        // first block arrives unprefetched (copied on demand) and whose
        // blocks evict the first ring's wrap-around prefetch.
        let mut t = b.module("transformer_2");
        linear(&mut t, "x_embedder", d, 16, true);
        t.list("blocks", 3, |i, blk| {
            linear(blk, "attn.to_qkv", 3 * d, d, true);
            linear(blk, "ffn.0", 2 * d + 8 * i as u64, d, false);
        });
        t.block_containers(&["blocks"]);
    }
    {
        let mut e = b.module("text_encoder");
        let vocab = if outside { 1200 } else { 50 };
        e.parameter("embed.weight", DType::Bf16, &[vocab, d]);
        e.list("layers", 2, |_, l| {
            linear(l, "fc", d, d, false);
        });
        e.tie("lm_head.weight", "text_encoder.embed.weight");
        e.block_containers(&["layers"]);
    }
    vae(&mut b, "vae", 4, [16, 16, 8, 8]);
    declare(
        &mut b,
        &["transformer", "transformer_2"],
        &["text_encoder"],
        &["vae"],
    );
    b.warmup_request(warmup(64, 4, 16, 1));
    Preset {
        name,
        pipeline: b.build().expect("tiny preset builds"),
        dits: vec!["transformer", "transformer_2"],
        encoders: vec!["text_encoder"],
        vaes: vec!["vae"],
        block_cost: BlockCost {
            hidden: d,
            attention: true,
        },
        default_tokens: 64,
        text_tokens: 16,
        vae_flops: 1.0e6,
        vae_channels: [16, 16, 8, 8],
        pixels_per_token: 16,
        vae_chunks: 1,
    }
}

/// Random-looking, deterministic weights: byte `p` of storage `s` is a hash
/// of (seed, s, p / 8). Never all zeros.
#[derive(Clone, Copy, Debug)]
pub struct SyntheticWeights {
    /// The seed.
    pub seed: u64,
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl WeightSource for SyntheticWeights {
    fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        let base = splitmix(self.seed ^ (storage.index() as u64).wrapping_mul(0x1000_0000_01b3));
        for (i, out) in dst.iter_mut().enumerate() {
            let p = position + i as u64;
            let word = splitmix(base ^ (p / 8));
            *out = (word >> ((p % 8) * 8)) as u8;
        }
    }

    /// Every byte can be regenerated: nothing to hand back at disable.
    fn wants_restore(&self) -> bool {
        false
    }
}

/// A weight source whose every unit is also a window the device may read
/// in place ([`WeightSource::pageable_window`]): what a mapped checkpoint
/// gives `staged_reads = "in_place"` (CONTRACT §7c), on the simulator.
/// Each window is fresh anonymous memory of the unit's size, owned by the
/// master that takes it alone (so a copy that reads it after that master
/// dropped it is seen by the device, [`crate::SimConfig::pageable_reads`]),
/// holding the unit's bytes as the unit lays them out at every position
/// the device keeps (one in `divisor`, the run's payload divisor): its
/// other pages are never touched, so a Flux-sized window costs the host
/// what the device keeps of it.
pub struct MappedWindows {
    inner: std::sync::Arc<dyn WeightSource>,
    divisor: u64,
    asks: std::sync::atomic::AtomicU64,
}

impl MappedWindows {
    /// `inner`'s bytes, with windows holding every `divisor`-th byte.
    pub fn new(inner: std::sync::Arc<dyn WeightSource>, divisor: u64) -> Self {
        Self {
            inner,
            divisor: divisor.max(1),
            asks: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// How many windows were asked for so far (each ask fills a fresh
    /// one: what an `enable` costs the host).
    pub fn asks(&self) -> u64 {
        self.asks.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Anonymous memory lent as a read-only window.
struct SparseWindow(memmap2::MmapMut);

// SAFETY: the mapping is owned here, written only before it is lent (in
// `pageable_window`), never remapped or unmapped while this value lives:
// `bytes` returns the same slice on every call.
unsafe impl offload_core::device::HostRegion for SparseWindow {
    fn bytes(&self) -> &[u8] {
        &self.0
    }

    fn read_only(&self) -> bool {
        true
    }
}

impl WeightSource for MappedWindows {
    fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        self.inner.read(storage, position, dst);
    }

    fn pageable_window(
        &self,
        unit: &offload_core::runtime::Unit,
    ) -> Option<std::sync::Arc<dyn offload_core::device::HostRegion>> {
        self.asks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let len = usize::try_from(unit.bytes).ok()?.max(1);
        let mut map = memmap2::MmapMut::map_anon(len).ok()?;
        for e in &unit.entries {
            // The kept positions inside this entry.
            let mut p = e.offset.next_multiple_of(self.divisor);
            while p < e.offset + e.bytes {
                let at = usize::try_from(p).ok()?;
                self.inner
                    .read(e.storage, p - e.offset, map.get_mut(at..at + 1)?);
                p += self.divisor;
            }
        }
        Some(std::sync::Arc::new(SparseWindow(map)))
    }

    fn wants_restore(&self) -> bool {
        self.inner.wants_restore()
    }
}

/// Weights that look trained, deterministic: each bf16 storage's values
/// are N(0, 1/fan-in) (fan-in: the second dimension of its first 2-D
/// tensor, else the last), as initialised weights are and trained ones
/// stay within half a point of for an exponent code; every other storage's
/// bytes are [`SyntheticWeights`]'. What a lossless code's ratio is honest
/// on (`SyntheticWeights`' uniform bytes give a code nothing to take).
#[derive(Clone, Debug)]
pub struct TrainedWeights {
    seed: u64,
    /// Per bf16 storage, its standard deviation.
    scale: std::collections::BTreeMap<StorageId, f32>,
    other: SyntheticWeights,
}

impl TrainedWeights {
    /// Trained-looking weights for `pipeline` from `seed`.
    pub fn new(seed: u64, pipeline: &offload_core::Pipeline) -> Self {
        let mut scale = std::collections::BTreeMap::new();
        let mut not_bf16 = std::collections::BTreeSet::new();
        for (_, t) in pipeline.tensors() {
            if t.dtype != offload_core::DType::Bf16 {
                not_bf16.insert(t.storage);
                continue;
            }
            let fan_in = match t.shape.as_slice() {
                [_, f, ..] => *f,
                [f] => *f,
                [] => 1,
            }
            .max(1);
            scale
                .entry(t.storage)
                .or_insert((1.0 / (fan_in as f64).sqrt()) as f32);
        }
        scale.retain(|s, _| !not_bf16.contains(s));
        Self {
            seed,
            scale,
            other: SyntheticWeights { seed },
        }
    }

    /// bf16 value `e` of storage `storage` at `sigma`.
    fn value(&self, storage: StorageId, e: u64, sigma: f32) -> u16 {
        let base = splitmix(
            self.seed ^ 0x7261_696e ^ (storage.index() as u64).wrapping_mul(0x1000_0000_01b3),
        );
        let z = splitmix(base ^ e);
        let u1 = ((z >> 40) as f32 + 0.5) / (1u64 << 24) as f32;
        let u2 = ((z >> 16) & 0xff_ffff) as f32 / (1u64 << 24) as f32;
        let n = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
        let b = (n * sigma).to_bits();
        ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
    }
}

impl WeightSource for TrainedWeights {
    fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        let Some(&sigma) = self.scale.get(&storage) else {
            return self.other.read(storage, position, dst);
        };
        for (i, out) in dst.iter_mut().enumerate() {
            let p = position + i as u64;
            let v = self.value(storage, p / 2, sigma);
            *out = v.to_le_bytes()[(p % 2) as usize];
        }
    }

    /// Every byte can be regenerated: nothing to hand back at disable.
    fn wants_restore(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::blocks_of;

    const D: f64 = 3072.0;

    fn check_split(total: u64, text_tokens: u64, expect: (u64, u64)) {
        let s = TokenSplit::of(total, text_tokens);
        assert_eq!(
            (s.image, s.text),
            expect,
            "split of {total} tokens with {text_tokens} text tokens"
        );
        assert_eq!(s.total(), total);
    }

    #[test]
    fn split_gives_text_its_tokens_but_never_more_than_half() {
        check_split(4608, 512, (4096, 512));
        check_split(16_896, 512, (16_384, 512));
        check_split(1024, 512, (512, 512));
        check_split(1000, 512, (500, 500));
        check_split(3, 512, (2, 1));
        check_split(2, 512, (1, 1));
        check_split(1, 512, (1, 0));
        check_split(0, 512, (0, 0));
        check_split(64, 0, (64, 0));
        assert_eq!(flux1_dev().split(4608), TokenSplit::of(4608, 512));
        assert_eq!(
            tiny().split(64),
            TokenSplit {
                image: 48,
                text: 16
            }
        );
    }

    fn check_rows(path: &str, expect: Rows) {
        // Every class a different count, so a wrong rule shows.
        let split = TokenSplit {
            image: 4000,
            text: 500,
        };
        assert_eq!(
            linear_rows(path, split),
            expect.count(split),
            "rows of `{path}`: expected {expect:?}"
        );
    }

    #[test]
    fn rows_follow_the_stream_each_weight_belongs_to() {
        use Rows::{All, Image, One, Text};
        // Flux's double blocks.
        check_rows("transformer_blocks.0.norm1.linear.weight", One);
        check_rows("transformer_blocks.18.norm1_context.linear.weight", One);
        check_rows("transformer_blocks.3.attn.to_q.weight", Image);
        check_rows("transformer_blocks.3.attn.to_k.weight", Image);
        check_rows("transformer_blocks.3.attn.to_v.weight", Image);
        check_rows("transformer_blocks.3.attn.to_out.0.weight", Image);
        check_rows("transformer_blocks.3.attn.add_q_proj.weight", Text);
        check_rows("transformer_blocks.3.attn.add_k_proj.weight", Text);
        check_rows("transformer_blocks.3.attn.add_v_proj.weight", Text);
        check_rows("transformer_blocks.3.attn.to_add_out.weight", Text);
        check_rows("transformer_blocks.3.ff.net.0.proj.weight", Image);
        check_rows("transformer_blocks.3.ff.net.2.weight", Image);
        check_rows("transformer_blocks.3.ff_context.net.0.proj.weight", Text);
        check_rows("transformer_blocks.3.ff_context.net.2.weight", Text);
        // Flux's single blocks: same names, all tokens.
        check_rows("single_transformer_blocks.0.norm.linear.weight", One);
        check_rows("single_transformer_blocks.37.attn.to_q.weight", All);
        check_rows("single_transformer_blocks.37.proj_mlp.weight", All);
        check_rows("single_transformer_blocks.37.proj_out.weight", All);
        // Outside blocks.
        check_rows("time_text_embed.timestep_embedder.linear_1.weight", One);
        check_rows("time_text_embed.text_embedder.linear_2.weight", One);
        check_rows("norm_out.linear.weight", One);
        check_rows("context_embedder.weight", Text);
        check_rows("x_embedder.weight", Image);
        check_rows("proj_out.weight", Image);
        // Qwen-Image.
        check_rows("transformer_blocks.59.img_mod.1.weight", One);
        check_rows("transformer_blocks.59.txt_mod.1.weight", One);
        check_rows("transformer_blocks.59.img_mlp.net.2.weight", Image);
        check_rows("transformer_blocks.59.txt_mlp.net.0.proj.weight", Text);
        check_rows("img_in.weight", Image);
        check_rows("txt_in.weight", Text);
        // Wan.
        check_rows("blocks.5.attn2.to_k.weight", Text);
        check_rows("blocks.5.attn2.to_v.weight", Text);
        check_rows("blocks.5.attn2.to_q.weight", All);
        check_rows("blocks.5.attn1.to_k.weight", All);
        check_rows("blocks.5.ffn.net.0.proj.weight", All);
        check_rows("condition_embedder.time_proj.weight", One);
        check_rows("condition_embedder.text_embedder.linear_1.weight", Text);
        // Names matched by whole segments, unknown names on all tokens.
        check_rows("transformer_blocks.0.attn.to_qkv.weight", All);
        check_rows("transformer_blocks.0.ffx.weight", All);
        check_rows("layers.0.fc.weight", All);
        check_rows("something_else.weight", All);
    }

    /// No linear of a dual-stream block falls through to "all tokens": a
    /// misspelt rule would.
    #[test]
    fn every_dual_stream_linear_has_a_rule() {
        for preset in [flux1_dev(), qwen_image()] {
            let p = &preset.pipeline;
            let dit = p.module_id("transformer").expect("a DiT");
            let split = TokenSplit {
                image: 4000,
                text: 500,
            };
            for b in blocks_of(p, dit) {
                if !p
                    .module(b)
                    .path
                    .starts_with("transformer.transformer_blocks.")
                {
                    continue;
                }
                for t in p.subtree_tensors(b) {
                    let path = p.tensor_path(t);
                    if is_linear_weight(p.tensor(t)) {
                        let rows = linear_rows(&path["transformer.".len()..], split);
                        assert_ne!(rows, 4500, "{}: `{path}` has no rule", preset.name);
                    }
                }
            }
        }
    }

    fn block(preset: &Preset, path: &str) -> ModuleId {
        preset.pipeline.module_id(path).expect("the block exists")
    }

    /// The `h200` kernel model against what it was calibrated on: the
    /// H200's traced resident per-block compute of the Flux proxy
    /// (2026-11-30; the figures in `DeviceProfile::h200`'s docs), within
    /// 3 % for every block kind and token count.
    #[test]
    fn the_h200_model_matches_the_traced_blocks() {
        let flux = flux1_dev();
        let p = crate::DeviceProfile::h200();
        let measured_ms = [
            (1024, 1.145, 0.690),
            (4608, 2.931, 2.526),
            (8192, 5.650, 4.994),
            (16896, 14.364, 13.917),
        ];
        for (tokens, double, single) in measured_ms {
            let split = flux.split(tokens);
            for (path, want) in [
                ("transformer.transformer_blocks.3", double),
                ("transformer.single_transformer_blocks.3", single),
            ] {
                let w = flux.block_work(&flux.pipeline, block(&flux, path), split);
                let got = p.work_ns(&w) as f64 / 1e6;
                assert!(
                    (got / want - 1.0).abs() <= 0.03,
                    "{path} at {tokens} tokens: model {got:.3} ms, measured {want:.3} ms"
                );
            }
        }
    }

    #[test]
    fn flux_blocks_cost_their_closed_forms() {
        let flux = flux1_dev();
        let split = flux.split(4608);
        let double = flux.block_work(
            &flux.pipeline,
            block(&flux, "transformer.transformer_blocks.7"),
            split,
        );
        let d2 = D * D;
        let double_expect = 2.0 * (12.0 * d2 * 1.0 + 12.0 * d2 * 4096.0 + 12.0 * d2 * 512.0);
        assert_eq!(double.linear_flops(), double_expect, "double block");
        assert_eq!(double.linears.len(), 14);
        assert_eq!(double.attention_flops, 4.0 * 4608.0 * 4608.0 * D);
        let single = flux.block_work(
            &flux.pipeline,
            block(&flux, "transformer.single_transformer_blocks.30"),
            split,
        );
        let single_expect = 2.0 * (3.0 * d2 * 1.0 + 12.0 * d2 * 4608.0);
        assert_eq!(single.linear_flops(), single_expect, "single block");
        assert_eq!(single.attention_flops, 4.0 * 4608.0 * 4608.0 * D);
        // Every byte is folded once: the other bytes are the block's.
        let block_bytes = flux
            .pipeline
            .subtree_bytes(block(&flux, "transformer.transformer_blocks.3"));
        assert_eq!(double.other_bytes, block_bytes);
    }

    /// Linear FLOPs of the whole DiT (blocks and the rest), and what the old
    /// model charged: every 2-D weight on every token.
    fn dit_linear_flops(preset: &Preset, tokens: u64) -> (f64, f64) {
        let p = &preset.pipeline;
        let dit = p.module_id("transformer").expect("a DiT");
        let split = preset.split(tokens);
        let mut new = preset.non_block_work(p, dit, split).linear_flops();
        for b in blocks_of(p, dit) {
            new += preset.block_work(p, b, split).linear_flops();
        }
        let all_rows: f64 = p
            .subtree_tensors(dit)
            .into_iter()
            .map(|t| p.tensor(t))
            .filter(|t| is_linear_weight(t))
            .map(|t| 2.0 * t.numel() as f64 * tokens as f64)
            .sum();
        (new, all_rows)
    }

    #[test]
    fn flux_linears_cost_well_below_every_weight_on_every_token() {
        let flux = flux1_dev();
        for tokens in [4608, 16_896] {
            let (new, old) = dit_linear_flops(&flux, tokens);
            let ratio = new / old;
            assert!(
                (0.3..0.8).contains(&ratio),
                "{tokens} tokens: linear FLOPs {new:.4e} against {old:.4e} on all rows: ratio {ratio:.3} (1/{:.2})",
                1.0 / ratio
            );
        }
    }
}
