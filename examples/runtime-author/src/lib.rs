//! A runtime author's model code, written against offload's public APIs
//! only, as a crate outside the library would: a text encoder and a DiT
//! declared by hand in the order their forwards read them (not the
//! checkpoint's name order), a diffusers-style checkpoint written with the
//! `safetensors` crate, its tensors bound as the host masters, and the
//! forwards, each weight read by name through [`Scope::view`] inside the
//! child scope of its block. The kernels are the simulator's: each folds a
//! checksum of the bytes it read into an accumulator, so two runs that read
//! the same bytes in the same order end with the same output.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use offload_core::model::{DType, ModelError, ModuleBuilder, PipelineBuilder};
use offload_core::runtime::{Runtime, Scope};
use offload_core::{ComponentDeclaration, OffloadError, Pipeline};
use offload_safetensors::{Checkpoint, CheckpointError, NameMap, SafetensorsSource};
use offload_sim::{Sim, SimAccumulator, SimDevice};

/// The text encoder's module.
pub const TEXT_ENCODER: &str = "text_encoder";
/// The DiT's module.
pub const TRANSFORMER: &str = "transformer";
/// The text encoder's layers.
pub const ENCODER_LAYERS: usize = 4;
/// The DiT's wide blocks.
pub const BIG_BLOCKS: usize = 6;
/// The DiT's narrow blocks, after the wide ones.
pub const SMALL_BLOCKS: usize = 6;
/// The text encoder's width.
pub const TEXT_WIDTH: u64 = 32;
/// A wide block's width.
pub const BIG_WIDTH: u64 = 64;
/// A narrow block's width.
pub const SMALL_WIDTH: u64 = 32;
/// The vocabulary of the token embedding.
pub const VOCAB: u64 = 64;

/// Layerwise offload of the DiT, in the configuration's compact form.
pub const LAYERWISE_TOML: &str = r#"
[diffusion_offload_config]
mode = "layer"
components = ["dit"]
"#;

/// How long each simulated kernel runs, ns.
const KERNEL_NS: u64 = 2_000;

/// What went wrong building, loading or running the model.
#[derive(Debug, thiserror::Error)]
pub enum AuthorError {
    /// The pipeline declaration was refused.
    #[error("declaring the pipeline: {0}")]
    Pipeline(#[from] ModelError),
    /// The checkpoint could not be opened or bound to the pipeline.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A directory of the checkpoint could not be made.
    #[error("{}: {source}", path.display())]
    Io {
        /// The directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The `safetensors` crate refused to write a file.
    #[error("writing {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// What the writer said.
        source: safetensors::SafeTensorError,
    },
    /// Offload refused an operation or a forward failed.
    #[error(transparent)]
    Offload(#[from] OffloadError),
    /// A hook skipped a forward this model needs.
    #[error("a hook skipped the forward of `{0}`")]
    Skipped(String),
}

/// A text encoder layer's weights (relative name, shape), in the order its
/// forward reads them. Name order (the file's) differs: `layer_norm2` and
/// `mlp` sort before `self_attn`, `k_proj` before `q_proj`.
pub fn encoder_layer() -> Vec<(&'static str, Vec<u64>)> {
    let w = TEXT_WIDTH;
    vec![
        ("layer_norm1.weight", vec![w]),
        ("self_attn.q_proj.weight", vec![w, w]),
        ("self_attn.k_proj.weight", vec![w, w]),
        ("self_attn.v_proj.weight", vec![w, w]),
        ("self_attn.out_proj.weight", vec![w, w]),
        ("layer_norm2.weight", vec![w]),
        ("mlp.fc1.weight", vec![4 * w, w]),
        ("mlp.fc2.weight", vec![w, 4 * w]),
    ]
}

/// A DiT block's weights at `width`, in the order its forward reads them
/// (modulation, attention, MLP). Name order differs: `attn.to_k` sorts
/// before `attn.to_q`, `norm1` after `ff`.
pub fn dit_block(width: u64) -> Vec<(&'static str, Vec<u64>)> {
    let w = width;
    vec![
        ("norm1.linear.weight", vec![6 * w, w]),
        ("attn.to_q.weight", vec![w, w]),
        ("attn.to_k.weight", vec![w, w]),
        ("attn.to_v.weight", vec![w, w]),
        ("attn.to_out.0.weight", vec![w, w]),
        ("ff.net.0.proj.weight", vec![4 * w, w]),
        ("ff.net.2.weight", vec![w, 4 * w]),
    ]
}

/// The text encoder's weights outside its layers: read before them, after
/// them.
const ENCODER_IN: &[&str] = &["embed_tokens.weight"];
const ENCODER_OUT: &[&str] = &["final_layer_norm.weight"];
/// The DiT's weights outside its blocks: read before them, after them.
const DIT_IN: &[&str] = &["x_embedder.weight", "context_embedder.weight"];
const DIT_OUT: &[&str] = &["norm_out.linear.weight", "proj_out.weight"];

fn declare(module: &mut ModuleBuilder<'_>, tensors: &[(&str, Vec<u64>)]) {
    for (name, shape) in tensors {
        module.parameter(name, DType::Bf16, shape);
    }
}

/// The pipeline, declared by hand in forward order: a 4-layer text
/// encoder and a DiT of 6 wide then 6 narrow blocks (two block
/// containers), every weight bf16.
pub fn pipeline() -> Result<Pipeline, AuthorError> {
    pipeline_declared(&Declaration::default())
}

/// What the author may get wrong declaring the pipeline.
#[derive(Clone, Debug, Default)]
pub struct Declaration {
    /// The DiT's path as written in the component declaration (`None`:
    /// its module's, [`TRANSFORMER`]).
    pub dit_declared_as: Option<String>,
    /// Whether the DiT names its block containers.
    pub skip_block_containers: bool,
}

/// The pipeline as [`pipeline`] declares it, with the mistakes of `d`.
pub fn pipeline_declared(d: &Declaration) -> Result<Pipeline, AuthorError> {
    let mut b = PipelineBuilder::new("AuthorPipeline");
    {
        let mut te = b.module(TEXT_ENCODER);
        te.parameter(ENCODER_IN[0], DType::Bf16, &[VOCAB, TEXT_WIDTH]);
        te.list("layers", ENCODER_LAYERS, |_, layer| {
            declare(layer, &encoder_layer())
        });
        te.parameter(ENCODER_OUT[0], DType::Bf16, &[TEXT_WIDTH]);
        te.block_containers(&["layers"]);
    }
    {
        let mut dit = b.module(TRANSFORMER);
        dit.parameter(DIT_IN[0], DType::Bf16, &[BIG_WIDTH, 16])
            .parameter(DIT_IN[1], DType::Bf16, &[BIG_WIDTH, TEXT_WIDTH]);
        dit.list("big_blocks", BIG_BLOCKS, |_, block| {
            declare(block, &dit_block(BIG_WIDTH))
        });
        dit.list("small_blocks", SMALL_BLOCKS, |_, block| {
            declare(block, &dit_block(SMALL_WIDTH))
        });
        dit.parameter(DIT_OUT[0], DType::Bf16, &[2 * BIG_WIDTH, BIG_WIDTH])
            .parameter(DIT_OUT[1], DType::Bf16, &[16, BIG_WIDTH]);
        if !d.skip_block_containers {
            dit.block_containers(&["big_blocks", "small_blocks"]);
        }
    }
    b.declare_components(ComponentDeclaration {
        dit: vec![
            d.dit_declared_as
                .clone()
                .unwrap_or_else(|| TRANSFORMER.into()),
        ],
        encoder: vec![TEXT_ENCODER.into()],
        ..Default::default()
    });
    Ok(b.build()?)
}

/// Where each component's file lies in a checkpoint directory, as
/// diffusers saves a pipeline.
pub fn checkpoint_file(dir: &Path, component: &str) -> PathBuf {
    let file = if component == TRANSFORMER {
        "diffusion_pytorch_model.safetensors"
    } else {
        "model.safetensors"
    };
    dir.join(component).join(file)
}

/// Writes a checkpoint of `pipeline` under `dir` with the `safetensors`
/// crate, one file per component, each tensor under its name in its
/// component and seeded bf16 values (the crate lays them out sorted by
/// name).
pub fn write_checkpoint(pipeline: &Pipeline, dir: &Path, seed: u64) -> Result<(), AuthorError> {
    for component in [TEXT_ENCODER, TRANSFORMER] {
        let prefix = format!("{component}.");
        let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (id, t) in pipeline.tensors() {
            let path = pipeline.tensor_path(id);
            let Some(name) = path.strip_prefix(&prefix) else {
                continue;
            };
            let numel = t.shape.iter().product::<u64>();
            let mut x = (seed ^ id.index() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let bytes = (0..numel)
                .flat_map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let v = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    half::bf16::from_f32(v).to_le_bytes()
                })
                .collect();
            let shape = t.shape.iter().map(|&d| d as usize).collect();
            tensors.push((name.to_owned(), safetensors::Dtype::BF16, shape, bytes));
        }
        let file = checkpoint_file(dir, component);
        let parent = file
            .parent()
            .expect("a component's file is in its directory");
        std::fs::create_dir_all(parent).map_err(|source| AuthorError::Io {
            path: parent.to_owned(),
            source,
        })?;
        let write = |source| AuthorError::Write {
            path: file.clone(),
            source,
        };
        let views = tensors
            .iter()
            .map(|(n, d, s, b)| {
                safetensors::tensor::TensorView::new(*d, s.clone(), b).map(|v| (n.clone(), v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(write)?;
        safetensors::serialize_to_file(views, None, &file).map_err(write)?;
    }
    Ok(())
}

/// The checkpoint under `dir` as `pipeline`'s weights: each component's
/// file bound under its prefix (names, dtypes and shapes checked here).
pub fn weights(pipeline: &Pipeline, dir: &Path) -> Result<SafetensorsSource, AuthorError> {
    let mut parts = Vec::new();
    for component in [TEXT_ENCODER, TRANSFORMER] {
        let ckpt = Checkpoint::open(checkpoint_file(dir, component))?;
        parts.push((
            Arc::new(ckpt),
            NameMap::prefix(&format!("{component}."), ""),
        ));
    }
    Ok(SafetensorsSource::new(pipeline, parts)?)
}

/// One kernel of `scope`'s module reading the weights `names` (relative to
/// it), folding what it read into `output`.
fn kernel(
    scope: &Scope<'_, Sim>,
    names: &[&str],
    output: &SimAccumulator,
) -> Result<(), OffloadError> {
    let views = names
        .iter()
        .map(|n| scope.view(n))
        .collect::<Result<Vec<_>, _>>()?;
    let inputs: Vec<_> = views.iter().map(|v| (v.buffer(), v.byte_range())).collect();
    let device: &SimDevice = scope.device();
    device
        .compute_for(scope.stream(), &inputs, KERNEL_NS, scope.path(), output)
        .map_err(|e| OffloadError::device(format!("compute `{}`", scope.path()), e))
}

/// Runs the child `name` of `scope` as one kernel reading `tensors`.
fn child(
    scope: &Scope<'_, Sim>,
    name: &str,
    tensors: &[(&str, Vec<u64>)],
    output: &SimAccumulator,
) -> Result<(), AuthorError> {
    let names: Vec<&str> = tensors.iter().map(|(n, _)| *n).collect();
    scope
        .child(name, |block| Ok(kernel(block, &names, output)?))?
        .ok_or_else(|| AuthorError::Skipped(format!("{}.{name}", scope.path())))
}

/// The text encoder's forward: the embedding, each layer in its own
/// scope, the final norm.
pub fn encode(rt: &Runtime<Sim>, output: &SimAccumulator) -> Result<(), AuthorError> {
    let layer = encoder_layer();
    rt.forward(TEXT_ENCODER, |te| {
        kernel(te, ENCODER_IN, output)?;
        for i in 0..ENCODER_LAYERS {
            child(te, &format!("layers.{i}"), &layer, output)?;
        }
        kernel(te, ENCODER_OUT, output)?;
        Ok(())
    })?
    .ok_or_else(|| AuthorError::Skipped(TEXT_ENCODER.to_owned()))
}

/// One denoising step: the DiT's embedders, each block in its own scope
/// (the wide ones, then the narrow ones), the output projection.
pub fn denoise(rt: &Runtime<Sim>, output: &SimAccumulator) -> Result<(), AuthorError> {
    let (big, small) = (dit_block(BIG_WIDTH), dit_block(SMALL_WIDTH));
    rt.forward(TRANSFORMER, |dit| {
        kernel(dit, DIT_IN, output)?;
        // The blocks by the scope's own iterator: no count written here.
        for block in dit.blocks("big_blocks")? {
            child(dit, block, &big, output)?;
        }
        for block in dit.blocks("small_blocks")? {
            child(dit, block, &small, output)?;
        }
        kernel(dit, DIT_OUT, output)?;
        Ok(())
    })?
    .ok_or_else(|| AuthorError::Skipped(TRANSFORMER.to_owned()))
}

/// One request: the prompt encoded once, `steps` denoising steps, then the
/// host reads the output (after the compute stream, as a runtime must).
pub fn request(
    rt: &Runtime<Sim>,
    output: &SimAccumulator,
    steps: usize,
) -> Result<u64, AuthorError> {
    let device: &SimDevice = rt.device();
    let stream = rt.compute_stream();
    device
        .reset_accumulator(stream, output)
        .map_err(|e| OffloadError::device("reset the output", e))?;
    encode(rt, output)?;
    for _ in 0..steps {
        denoise(rt, output)?;
    }
    rt.synchronize()?;
    Ok(device.read_accumulator(output))
}
