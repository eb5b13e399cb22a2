//! Workload presets: synthetic diffusion pipelines with the tensor names,
//! shapes and dtypes of real models, plus the compute each module costs for
//! a given token count, and a deterministic weight source.

use offload_core::ComponentDeclaration;
use offload_core::model::StorageId;
use offload_core::model::{DType, ModuleBuilder, Pipeline, PipelineBuilder};
use offload_core::runtime::WeightSource;

/// How a block's compute scales with tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockCost {
    /// Width of attention.
    pub hidden: u64,
    /// Whether the block runs self-attention over all tokens.
    pub attention: bool,
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
}

impl Preset {
    /// Every preset name.
    pub const NAMES: [&'static str; 4] = ["flux1-dev", "wan2.2-t2v-a14b", "qwen-image", "tiny"];

    /// The preset called `name`.
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "flux1-dev" => Some(flux1_dev()),
            "wan2.2-t2v-a14b" => Some(wan22_t2v_a14b()),
            "qwen-image" => Some(qwen_image()),
            "tiny" => Some(tiny()),
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
            .filter(|(_, t)| t.kind == offload_core::model::TensorKind::Parameter)
            .map(|(_, t)| t.numel())
            .sum()
    }
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
    }
}

/// The Flux.1-dev transformer alone (the GPU benchmark's model).
pub fn flux1_dev_dit() -> Pipeline {
    let mut b = PipelineBuilder::new("FluxTransformer");
    flux_transformer(&mut b);
    declare(&mut b, &["transformer"], &[], &[]);
    b.build().expect("flux transformer builds")
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
    }
}

/// A tiny pipeline for tests: a Flux-shaped DiT of 3 double + 4 single
/// blocks of width 32 (an odd ring of 7), a second 3-block expert as in
/// Wan2.2 (the second half of the steps), a tied embedding, a
/// non-persistent buffer, mixed dtypes.
pub fn tiny() -> Preset {
    let d = 32u64;
    let mut b = PipelineBuilder::new("TinyPipeline");
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
        e.parameter("embed.weight", DType::Bf16, &[50, d]);
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
    Preset {
        name: "tiny",
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
