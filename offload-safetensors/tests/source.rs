//! A checkpoint on disk as the host masters of a simulated run: the bytes
//! the device computes with are the file's, streamed blocks are windows of
//! the mapping registered in place (no pinned copy), and every bad input is
//! a typed error naming the tensor and the file.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use offload_core::model::{DType, ModuleBuilder, PipelineBuilder, StorageId};
use offload_core::runtime::{
    CorePlatform, HostMasters, PlantedBug, Runtime, WeightSource, packing_for,
};
use offload_core::{ComponentDeclaration, OffloadConfig, Pipeline};
use offload_safetensors::{Checkpoint, CheckpointError, NameMap, SafetensorsSource, write_file};
use offload_sim::harness::{Probe, RunOptions, Workload, request};
use offload_sim::presets::{Preset, tiny};
use offload_sim::{DeviceProfile, SimDevice, SimGroup};

type Tensors = Vec<(String, DType, Vec<u64>, Vec<u8>)>;

fn bytes(seed: u64, n: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A small DiT: two block lists (3 double, 4 single), an embedder and an
/// output projection, every tensor bf16 but one f32 gate per single block.
fn dit_tensors() -> Tensors {
    let mut t: Tensors = Vec::new();
    let mut add = |name: String, dtype: DType, shape: Vec<u64>| {
        let n = shape.iter().product::<u64>() * dtype.size_bytes();
        let seed = t.len() as u64 + 1;
        t.push((name, dtype, shape, bytes(seed, n)));
    };
    add("x_embedder.weight".into(), DType::Bf16, vec![32, 16]);
    add("x_embedder.bias".into(), DType::Bf16, vec![32]);
    for i in 0..3 {
        add(
            format!("transformer_blocks.{i}.attn.to_q.weight"),
            DType::Bf16,
            vec![32, 32],
        );
        add(
            format!("transformer_blocks.{i}.attn.to_out.0.weight"),
            DType::Bf16,
            vec![32, 32],
        );
        add(
            format!("transformer_blocks.{i}.ff.net.0.proj.weight"),
            DType::Bf16,
            vec![64, 32],
        );
        add(
            format!("transformer_blocks.{i}.ff.net.2.weight"),
            DType::Bf16,
            vec![32, 64],
        );
    }
    for i in 0..4 {
        add(
            format!("single_transformer_blocks.{i}.proj_mlp.weight"),
            DType::Bf16,
            vec![64, 32],
        );
        add(
            format!("single_transformer_blocks.{i}.norm.linear.bias"),
            DType::Bf16,
            vec![96],
        );
    }
    add("proj_out.weight".into(), DType::Bf16, vec![16, 32]);
    t
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("offload-st-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn pipeline_from(ckpt: &Checkpoint) -> Pipeline {
    let mut b = PipelineBuilder::new("CheckpointPipeline");
    {
        let mut t = b.module("transformer");
        assert_eq!(ckpt.declare(&mut t, "").unwrap(), ckpt.tensors().len());
        t.block_containers(&["transformer_blocks", "single_transformer_blocks"]);
    }
    b.declare_components(ComponentDeclaration {
        dit: vec!["transformer".into()],
        ..Default::default()
    });
    b.build().unwrap()
}

fn workload(pipeline: Pipeline) -> Workload {
    let base = tiny();
    Workload {
        tokens: base.default_tokens,
        preset: Preset {
            name: "checkpoint",
            pipeline,
            dits: vec!["transformer"],
            encoders: vec![],
            vaes: vec![],
            ..base
        },
        steps: 2,
        requests: 2,
    }
}

/// The checkpoint as the weights of a `transformer.` pipeline (names,
/// dtypes and shapes checked).
fn dit_source(pipeline: &Pipeline, ckpt: Arc<Checkpoint>) -> SafetensorsSource {
    SafetensorsSource::new(pipeline, vec![(ckpt, NameMap::prefix("transformer.", ""))]).unwrap()
}

/// The same bytes held in memory, keyed by the pipeline's storages: the
/// reference a run from the file must match.
struct InMemory(Vec<Vec<u8>>);

impl WeightSource for InMemory {
    fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        let p = position as usize;
        dst.copy_from_slice(&self.0[storage.index()][p..p + dst.len()]);
    }
}

struct Run {
    outputs: Vec<u64>,
    pinned_peak: u64,
    registered: u64,
    streamed: u64,
    /// What `enable` made of the host masters.
    masters: HostMasters,
}

fn run(pipeline: &Pipeline, weights: Arc<dyn WeightSource>, layerwise: bool) -> Run {
    let w = workload(pipeline.clone());
    let opts = RunOptions::new(DeviceProfile::h200());
    let rig =
        offload_sim::harness::Rig::with_weights(pipeline.clone(), &opts, Arc::clone(&weights))
            .unwrap();
    let device = Arc::new(rig.device.clone());
    let compute = Arc::clone(rig.runtime.compute_stream());
    let platform = CorePlatform::<offload_sim::Sim>::new(
        "sim",
        Arc::clone(&device),
        Arc::clone(&compute),
        weights,
    );
    let mut rt = Runtime::new(device, compute, pipeline.clone());
    let backend = if layerwise {
        Box::new(
            platform
                .layerwise(OffloadConfig {
                    enable_layerwise_offload: true,
                    ..Default::default()
                })
                .unwrap(),
        )
    } else {
        platform.resident().unwrap()
    };
    rt.enable(backend).map_err(|(e, _)| e).unwrap();
    let stats = rig.device.stats();
    let streamed = rt.backend().unwrap().host_weight_bytes();
    let masters = rt.host_masters();
    let probe = Probe::new(&rig.device).unwrap();
    let outputs = (0..w.requests)
        .map(|_| request(&rt, &rig.device, &probe, &w).unwrap().output)
        .collect();
    rt.disable().unwrap();
    assert!(
        rig.device.violations().is_empty(),
        "{:?}",
        rig.device.violations()
    );
    assert_eq!(
        rig.device.stats().registered_bytes,
        0,
        "unregistered at disable"
    );
    Run {
        outputs,
        pinned_peak: stats.pinned_peak_bytes,
        registered: stats.registered_bytes,
        streamed,
        masters,
    }
}

fn in_memory(pipeline: &Pipeline, tensors: &Tensors) -> InMemory {
    let mut by_storage = vec![Vec::new(); pipeline.storages().count()];
    for (id, t) in pipeline.tensors() {
        let path = pipeline.tensor_path(id);
        let name = path.strip_prefix("transformer.").unwrap();
        let (_, _, _, b) = tensors.iter().find(|(n, ..)| n == name).unwrap();
        by_storage[t.storage.index()] = b.clone();
    }
    InMemory(by_storage)
}

#[test]
fn streamed_blocks_are_windows_of_the_file_and_compute_its_bytes() {
    let dir = scratch("single");
    let tensors = dit_tensors();
    let file = dir.join("diffusion_pytorch_model.safetensors");
    write_file(&file, &tensors).unwrap();
    let ckpt = Arc::new(Checkpoint::open(&dir).unwrap());
    let pipeline = pipeline_from(&ckpt);
    let reference = run(&pipeline, Arc::new(in_memory(&pipeline, &tensors)), false);

    let source = Arc::new(dit_source(&pipeline, Arc::clone(&ckpt)));
    let resident = run(
        &pipeline,
        Arc::clone(&source) as Arc<dyn WeightSource>,
        false,
    );
    assert_eq!(
        resident.outputs, reference.outputs,
        "the file's bytes, resident"
    );

    let before = source.windows_and_copies();
    let streamed = run(
        &pipeline,
        Arc::clone(&source) as Arc<dyn WeightSource>,
        true,
    );
    assert_eq!(
        streamed.outputs, reference.outputs,
        "the file's bytes, streamed"
    );
    let (windows, copies) = source.windows_and_copies();
    assert_eq!(windows - before.0, 7, "every block a window of the mapping");
    assert_eq!(
        copies - before.1,
        1,
        "only the rest (embedder + projection, apart in the file) copied"
    );
    // Observed on the device: the streamed masters are registrations of the
    // file's windows; pinned memory held only the staging of the rest.
    assert_eq!(streamed.registered, streamed.streamed);
    let rest: u64 = ["x_embedder.weight", "x_embedder.bias", "proj_out.weight"]
        .iter()
        .map(|n| ckpt.bytes(n).unwrap().len() as u64)
        .sum();
    assert_eq!(
        streamed.pinned_peak, rest,
        "no pinned copy of a streamed block"
    );

    // Registration in place turned off: the same outputs from pinned copies.
    let copied = Arc::new(dit_source(&pipeline, ckpt).with_in_place(false));
    let pinned = run(&pipeline, copied as Arc<dyn WeightSource>, true);
    assert_eq!(pinned.outputs, reference.outputs);
    assert_eq!(pinned.registered, 0);
}

/// Splits `tensors` over two shard files with an index, as diffusers'
/// `save_pretrained` does: in `tensors`' order, the second shard starting
/// at `cut` (in the middle of double block 1).
fn write_shards(dir: &Path, tensors: &Tensors, cut: &str) -> PathBuf {
    let cut = tensors.iter().position(|(n, ..)| n == cut).unwrap();
    let names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    write_file(&dir.join(names[0]), &tensors[..cut]).unwrap();
    write_file(&dir.join(names[1]), &tensors[cut..]).unwrap();
    let weight_map: serde_json::Map<String, serde_json::Value> = tensors
        .iter()
        .enumerate()
        .map(|(i, (n, ..))| (n.clone(), names[usize::from(i >= cut)].into()))
        .collect();
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(
        &index,
        serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    index
}

#[test]
fn a_shard_set_opens_from_its_index_and_a_split_block_is_copied() {
    let dir = scratch("shards");
    let tensors = dit_tensors();
    let index = write_shards(&dir, &tensors, "transformer_blocks.1.ff.net.0.proj.weight");
    let ckpt = Arc::new(Checkpoint::open(&index).unwrap());
    assert_eq!(ckpt.files().count(), 2);
    assert_eq!(
        Checkpoint::open(&dir).unwrap().tensors(),
        ckpt.tensors(),
        "the directory finds the index"
    );
    let pipeline = pipeline_from(&ckpt);
    let reference = run(&pipeline, Arc::new(in_memory(&pipeline, &tensors)), false);
    let source = Arc::new(dit_source(&pipeline, ckpt));
    let streamed = run(
        &pipeline,
        Arc::clone(&source) as Arc<dyn WeightSource>,
        true,
    );
    assert_eq!(streamed.outputs, reference.outputs);
    let (windows, copies) = source.windows_and_copies();
    assert_eq!(
        (windows, copies),
        (6, 2),
        "block 1 spans both shards: copied, as the rest"
    );
}

fn expect_err(
    r: Result<impl std::fmt::Debug, CheckpointError>,
    needles: &[&str],
) -> CheckpointError {
    let e = r.expect_err("bad input must fail");
    let text = e.to_string();
    for n in needles {
        assert!(text.contains(n), "`{text}` should name `{n}`");
    }
    e
}

#[test]
fn bad_checkpoints_and_mismatches_are_typed_errors_naming_tensor_and_file() {
    let dir = scratch("errors");
    let tensors = dit_tensors();
    let file = dir.join("a.safetensors");
    write_file(&file, &tensors).unwrap();
    let ckpt = Arc::new(Checkpoint::open(&file).unwrap());
    let pipeline = pipeline_from(&ckpt);
    let map = || NameMap::prefix("transformer.", "");

    // The pipeline expects what the file does not hold.
    let mut wrong = tensors.clone();
    wrong[0].1 = DType::F16;
    let f16 = dir.join("f16.safetensors");
    write_file(&f16, &wrong).unwrap();
    let e = expect_err(
        SafetensorsSource::new(
            &pipeline,
            vec![(Arc::new(Checkpoint::open(&f16).unwrap()), map())],
        ),
        &[
            "transformer.x_embedder.weight",
            "f16.safetensors",
            "bf16",
            "f16",
        ],
    );
    assert!(matches!(e, CheckpointError::DType { .. }));
    let mut wrong = tensors.clone();
    wrong[1].2 = vec![16, 2];
    let shape = dir.join("shape.safetensors");
    write_file(&shape, &wrong).unwrap();
    expect_err(
        SafetensorsSource::new(
            &pipeline,
            vec![(Arc::new(Checkpoint::open(&shape).unwrap()), map())],
        ),
        &[
            "transformer.x_embedder.bias",
            "shape.safetensors",
            "[32]",
            "[16, 2]",
        ],
    );
    let missing = dir.join("missing.safetensors");
    write_file(&missing, &tensors[1..]).unwrap();
    expect_err(
        SafetensorsSource::new(
            &pipeline,
            vec![(Arc::new(Checkpoint::open(&missing).unwrap()), map())],
        ),
        &["transformer.x_embedder.weight", "missing.safetensors"],
    );
    expect_err(
        SafetensorsSource::new(
            &pipeline,
            vec![(Arc::clone(&ckpt), NameMap::prefix("text_encoder.", ""))],
        ),
        &["transformer.proj_out.weight", "text_encoder."],
    );
    // Files and indexes that are not what they claim.
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"\xff\xff\xff\xff\xff\xff\xff\x7fnot a header").unwrap();
    assert!(matches!(
        expect_err(Checkpoint::open(&garbage), &["garbage.safetensors"]),
        CheckpointError::Header { .. }
    ));
    expect_err(
        Checkpoint::open(dir.join("absent.safetensors")),
        &["absent.safetensors"],
    );
    let index = dir.join("x.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"weight_map": {"x_embedder.weight": "nope.safetensors"}}"#,
    )
    .unwrap();
    expect_err(
        Checkpoint::open(&index),
        &["x.safetensors.index.json", "nope.safetensors"],
    );
    std::fs::write(
        &index,
        r#"{"weight_map": {"proj_out.weight": "a.safetensors", "lost": "a.safetensors"}}"#,
    )
    .unwrap();
    expect_err(
        Checkpoint::open(&index),
        &["x.safetensors.index.json", "lost"],
    );
    std::fs::write(&index, r#"{"weight_map": {"x_embedder.weight": "a.safetensors", "proj_out.weight": "f16.safetensors"}}"#).unwrap();
    assert!(matches!(
        expect_err(
            Checkpoint::open(&index),
            &["a.safetensors", "f16.safetensors"]
        ),
        CheckpointError::Duplicate { .. }
    ));
    std::fs::write(&index, r#"{"weights": {}}"#).unwrap();
    expect_err(Checkpoint::open(&index), &["weight_map"]);
    // Names that do not describe a module tree, and prefixes that would
    // match inside a segment.
    let crafted = dir.join("crafted.safetensors");
    write_file(
        &crafted,
        &[(
            "blocks.1000000000.w".into(),
            DType::Bf16,
            vec![2],
            vec![0; 4],
        )],
    )
    .unwrap();
    let mut b = PipelineBuilder::new("Crafted");
    let e = expect_err(
        Checkpoint::open(&crafted)
            .unwrap()
            .declare(&mut b.module("m"), ""),
        &["blocks.1000000000.w", "1000000000"],
    );
    assert!(matches!(e, CheckpointError::Layout { .. }));
    let mut b = PipelineBuilder::new("Prefix");
    expect_err(ckpt.declare(&mut b.module("m"), "transformer"), &["`.`"]);
    expect_err(
        NameMap::from_json(r#"[{"pipeline": "transformer", "checkpoint": ""}]"#),
        &["transformer", "`.`"],
    );
    expect_err(
        SafetensorsSource::new(
            &pipeline,
            vec![(Arc::clone(&ckpt), NameMap::prefix("transformer", ""))],
        ),
        &["pipeline prefix `transformer`"],
    );
    let empty = scratch("empty");
    expect_err(Checkpoint::open(&empty), &["no `.safetensors` file"]);
    expect_err(
        NameMap::from_json(r#"[{"pipeline": "a."}]"#),
        &["checkpoint"],
    );
    assert_eq!(
        NameMap::from_json(r#"[{"pipeline": "transformer.", "checkpoint": "model."}]"#)
            .unwrap()
            .checkpoint_name("transformer.proj_out.weight")
            .as_deref(),
        Some("model.proj_out.weight")
    );
}

/// Writes what the logs say at `info` and above, for [`capture_logs`].
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Runs `f` with a subscriber recording every event at `info` and above on
/// this thread; returns `f`'s result and the log text.
fn capture_logs<T>(f: impl FnOnce() -> T) -> (T, String) {
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::INFO)
        .without_time()
        .with_ansi(false)
        .finish();
    // Callsite interest is cached process-wide; a callsite first hit on a
    // thread without a subscriber would stay disabled here without a rebuild.
    let out = tracing::subscriber::with_default(subscriber, || {
        tracing::callsite::rebuild_interest_cache();
        f()
    });
    let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    (out, text)
}

/// The double blocks (list, count, width) of the forward-order DiT.
const DOUBLE: (&str, usize, u64) = ("transformer_blocks", 3, 32);
/// Its single blocks: fewer and narrower (a second block size).
const SINGLE: (&str, usize, u64) = ("single_transformer_blocks", 2, 16);

/// One block as a model's forward reads it: the attention projections q,
/// k, v, the MLP, the norm's modulation. Name order (the file's) puts
/// `to_k` before `to_q`.
fn forward_block(block: &mut ModuleBuilder<'_>, width: u64) {
    block
        .parameter("attn.to_q.weight", DType::Bf16, &[width, width])
        .parameter("attn.to_k.weight", DType::Bf16, &[width, width])
        .parameter("attn.to_v.weight", DType::Bf16, &[width, width])
        .parameter("ff.net.0.proj.weight", DType::Bf16, &[2 * width, width])
        .parameter("norm1.linear.weight", DType::Bf16, &[3 * width, width]);
}

/// A DiT declared by hand in forward order, as a runtime author writes
/// one (not [`Checkpoint::declare`]'s file order): bf16 blocks of two
/// sizes, and f32 tables beside bf16 projections outside the blocks.
fn forward_pipeline() -> Pipeline {
    let mut b = PipelineBuilder::new("ForwardOrderPipeline");
    {
        let mut t = b.module("transformer");
        t.parameter("x_embedder.weight", DType::Bf16, &[32, 16])
            .parameter("scale_shift_table", DType::F32, &[2, 32]);
        for (list, n, width) in [DOUBLE, SINGLE] {
            t.list(list, n, |_, block| forward_block(block, width));
        }
        t.parameter("norm_out.linear.weight", DType::F32, &[64, 32])
            .parameter("proj_out.weight", DType::Bf16, &[16, 32])
            .block_containers(&[DOUBLE.0, SINGLE.0]);
    }
    b.declare_components(ComponentDeclaration {
        dit: vec!["transformer".into()],
        ..Default::default()
    });
    b.build().unwrap()
}

/// The checkpoint of a `transformer.` pipeline: each tensor under its name
/// in the component, with seeded bytes, in declaration order (the file
/// sorts them: by dtype, largest first, then by name).
fn tensors_of(pipeline: &Pipeline) -> Tensors {
    pipeline
        .tensors()
        .map(|(id, t)| {
            let path = pipeline.tensor_path(id);
            let name = path.strip_prefix("transformer.").unwrap().to_owned();
            let n = t.shape.iter().product::<u64>() * t.dtype.size_bytes();
            (
                name,
                t.dtype,
                t.shape.clone(),
                bytes(id.index() as u64 + 100, n),
            )
        })
        .collect()
}

/// Bytes of the tensors whose names start with `prefix`.
fn bytes_under(tensors: &Tensors, prefix: &str) -> u64 {
    tensors
        .iter()
        .filter(|(n, ..)| n.starts_with(prefix))
        .map(|(.., b)| b.len() as u64)
        .sum()
}

#[test]
fn blocks_declared_in_forward_order_are_windows_of_a_file_in_name_order() {
    let dir = scratch("forward");
    let pipeline = forward_pipeline();
    let tensors = tensors_of(&pipeline);
    write_file(&dir.join("diffusion_pytorch_model.safetensors"), &tensors).unwrap();
    let ckpt = Arc::new(Checkpoint::open(&dir).unwrap());
    let at = |n: &str| ckpt.tensors()[n].range.start;
    assert!(
        at("transformer_blocks.0.attn.to_k.weight") < at("transformer_blocks.0.attn.to_q.weight"),
        "the premise: the file holds a block in another order than the declaration's"
    );
    let reference = run(&pipeline, Arc::new(in_memory(&pipeline, &tensors)), false);
    let source = Arc::new(dit_source(&pipeline, Arc::clone(&ckpt)));
    let (streamed, logs) = capture_logs(|| {
        run(
            &pipeline,
            Arc::clone(&source) as Arc<dyn WeightSource>,
            true,
        )
    });
    assert_eq!(streamed.outputs, reference.outputs, "the file's bytes");
    let blocks = (DOUBLE.1 + SINGLE.1) as u64;
    let block_bytes = bytes_under(&tensors, DOUBLE.0) + bytes_under(&tensors, SINGLE.0);
    let rest_bytes = bytes_under(&tensors, "") - block_bytes;
    assert_eq!(
        streamed.masters,
        HostMasters {
            in_place_units: blocks,
            in_place_bytes: block_bytes,
            copied_units: 0,
            copied_bytes: 0,
            staged_units: 0,
            staged_bytes: 0,
            pageable_read_units: 0,
            pageable_read_bytes: 0,
        },
        "every streamed block a window of the mapping, none copied"
    );
    assert_eq!(streamed.registered, block_bytes);
    // The rest (embedder, f32 tables, projection) lies apart in the file
    // (the f32 tables first, then the bf16 tensors by name, the blocks
    // between `proj_out` and `x_embedder`): declined, staged through pinned
    // memory on its way to the device and freed there, so it is no host
    // master, and only said at `info`.
    assert_eq!(source.windows_and_copies(), (blocks, 1));
    assert_eq!(source.copied_bytes(), rest_bytes);
    assert_eq!(
        streamed.pinned_peak, rest_bytes,
        "no pinned copy of a block"
    );
    assert!(!logs.contains("WARN"), "{logs}");
    assert!(
        logs.contains("`transformer` (") && logs.contains("outside the blocks"),
        "{logs}"
    );
}

#[test]
fn a_block_split_across_shards_is_copied_with_a_warning_naming_it() {
    let dir = scratch("forward-shards");
    let pipeline = forward_pipeline();
    let tensors = tensors_of(&pipeline);
    let mut by_name = tensors.clone();
    by_name.sort_by(|a, b| a.0.cmp(&b.0));
    let index = write_shards(&dir, &by_name, "transformer_blocks.1.ff.net.0.proj.weight");
    let ckpt = Arc::new(Checkpoint::open(&index).unwrap());
    let reference = run(&pipeline, Arc::new(in_memory(&pipeline, &tensors)), false);
    let source = Arc::new(dit_source(&pipeline, ckpt));
    let (streamed, logs) = capture_logs(|| {
        run(
            &pipeline,
            Arc::clone(&source) as Arc<dyn WeightSource>,
            true,
        )
    });
    assert_eq!(
        streamed.outputs, reference.outputs,
        "a copy computes the same"
    );
    let blocks = (DOUBLE.1 + SINGLE.1) as u64;
    let block_bytes = bytes_under(&tensors, DOUBLE.0) + bytes_under(&tensors, SINGLE.0);
    let split = bytes_under(&tensors, "transformer_blocks.1.");
    assert_eq!(
        streamed.masters,
        HostMasters {
            in_place_units: blocks - 1,
            in_place_bytes: block_bytes - split,
            copied_units: 1,
            copied_bytes: split,
            staged_units: 0,
            staged_bytes: 0,
            pageable_read_units: 0,
            pageable_read_bytes: 0,
        },
        "block 1 spans both shards: its master is the one copy"
    );
    let warns: Vec<&str> = logs.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warns.len(), 1, "one warning, for the split block: {logs}");
    for needle in [
        "block `transformer.transformer_blocks.1`",
        &format!("bytes={split}"),
        "two files",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        assert!(
            warns[0].contains(needle),
            "`{}` should name {needle}",
            warns[0]
        );
    }
    let rest_bytes = bytes_under(&tensors, "") - block_bytes;
    assert_eq!(source.windows_and_copies(), (blocks - 1, 2), "and the rest");
    assert_eq!(source.copied_bytes(), split + rest_bytes);
}

#[test]
fn a_block_mixing_dtypes_is_apart_in_a_file_grouped_by_dtype() {
    // safetensors writes tensors by dtype, largest first, then by name: a
    // bf16 block's f32 norm lies among the file's f32 tensors, away from
    // the block's bf16 ones, whatever order it is packed in.
    let mut b = PipelineBuilder::new("MixedPipeline");
    {
        let mut t = b.module("transformer");
        t.list("blocks", 2, |_, block| {
            block
                .parameter("attn.to_q.weight", DType::Bf16, &[8, 8])
                .parameter("norm.weight", DType::F32, &[8]);
        });
        t.block_containers(&["blocks"]);
    }
    b.declare_components(ComponentDeclaration {
        dit: vec!["transformer".into()],
        ..Default::default()
    });
    let pipeline = b.build().unwrap();
    let dir = scratch("mixed");
    let file = dir.join("model.safetensors");
    write_file(&file, &tensors_of(&pipeline)).unwrap();
    let source = SafetensorsSource::new(
        &pipeline,
        vec![(
            Arc::new(Checkpoint::open(&file).unwrap()),
            NameMap::prefix("transformer.", ""),
        )],
    )
    .unwrap();
    let packing = packing_for(&pipeline, &source).unwrap();
    let (regions, logs) = capture_logs(|| {
        packing
            .blocks
            .values()
            .map(|u| source.take_region(u).is_some())
            .collect::<Vec<_>>()
    });
    assert_eq!(regions, [false, false], "neither block is one window");
    for needle in [
        "block `transformer.blocks.0`",
        "bytes=160",
        "32 bytes of other tensors lie between `blocks.0.norm.weight` and `blocks.0.attn.to_q.weight`",
        "block `transformer.blocks.1`",
        "128 bytes of other tensors lie between `blocks.1.norm.weight` and `blocks.1.attn.to_q.weight`",
    ] {
        assert!(
            logs.contains(needle),
            "the log should name {needle}: {logs}"
        );
    }
    assert_eq!(source.windows_and_copies(), (0, 2));
    assert_eq!(source.copied_bytes(), 2 * 160);
}

/// A `.safetensors` file of an 8-byte length prefix and `header`, padded
/// to `n` bytes when given, then `data` bytes.
fn crafted_file(header: &str, pad_to: Option<usize>, data: usize) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    if let Some(n) = pad_to {
        h.resize(n, b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(std::iter::repeat_n(0u8, data));
    out
}

/// Headers that claim more than the file holds (found writing the fuzz
/// harnesses, `offload-fuzz`): each a typed `Header` error naming what is
/// wrong, never a panic, an allocation of the claimed size, or a tensor
/// outside the file.
#[test]
fn headers_claiming_more_than_the_file_are_typed_errors() {
    let dir = scratch("claims");
    // Eight U8 tensors of about 2^61 bytes: offsets summing to 2^64 - 1008,
    // past u64 with the header's 1000 bytes and the prefix (safetensors
    // 0.8's `read_metadata` added them unchecked).
    let mut entries = Vec::new();
    let (mut off, total) = (0u64, u64::MAX - 1007);
    for i in 0..8 {
        let size = if i < 7 { (1 << 61) - 1 } else { total - off };
        entries.push(format!(
            r#""t{i}":{{"dtype":"U8","shape":[{size}],"data_offsets":[{off},{}]}}"#,
            off + size
        ));
        off += size;
    }
    let wrapping = format!("{{{}}}", entries.join(","));
    let cases: Vec<(&str, Vec<u8>, &[&str])> = vec![
        (
            "offsets past 2^64",
            crafted_file(&wrapping, Some(1000), 0),
            &["data_offsets", "t0", "0 data bytes"],
        ),
        (
            "offsets past the file",
            crafted_file(
                r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
                None,
                8,
            ),
            &["`a`", "data_offsets [0,16]", "8 data bytes"],
        ),
        (
            "a header length of 2^63",
            {
                let mut f = (1u64 << 63).to_le_bytes().to_vec();
                f.extend(b"{}");
                f
            },
            &["not a valid safetensors file"],
        ),
        (
            "a header longer than the file",
            {
                let mut f = 100u64.to_le_bytes().to_vec();
                f.extend(b"{}");
                f
            },
            &["not a valid safetensors file"],
        ),
        (
            "a shape whose product overflows",
            crafted_file(
                r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}"#,
                None,
                0,
            ),
            &["not a valid safetensors file"],
        ),
        (
            "no length prefix",
            vec![1, 2, 3],
            &["not a valid safetensors file"],
        ),
        ("empty", Vec::new(), &["not a valid safetensors file"]),
    ];
    for (what, bytes, needles) in cases {
        let path = dir.join("crafted.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        let e = expect_err(Checkpoint::open(&path), needles);
        assert!(matches!(e, CheckpointError::Header { .. }), "{what}: {e:?}");
    }
}

// ---------------------------------------------------------------------
// Distributed layerwise offload from a checkpoint (CONTRACT §8): each
// rank's shard of a gathered block is a window of the file's mapping,
// registered in place; only a shard a file boundary splits is copied.
// ---------------------------------------------------------------------

/// What one rank of a distributed run from the checkpoint saw.
#[derive(Debug)]
struct RankRun {
    rank: u32,
    /// Its outputs, or its error.
    outputs: Result<Vec<u64>, String>,
    /// Host bytes registered and pinned after `enable`, on its device.
    registered: u64,
    pinned: u64,
    /// What its device's checkers saw broken.
    violations: Vec<String>,
    /// Its source's shard windows and pinned shard copies.
    shards: (u64, u64),
    /// What it logged at `info` and above.
    logs: String,
}

fn dlo_config() -> OffloadConfig {
    OffloadConfig {
        enable_distributed_layerwise_offload: true,
        ..Default::default()
    }
}

/// `g` simulated ranks (one thread each, one gather group), each reading
/// its own [`SafetensorsSource`] over `ckpt` (as one process per GPU
/// maps the same file), running the workload under distributed layerwise
/// offload with `bugs` planted; the simulator's own life cycle of a run
/// (`drive`: INV-7's bounds, leaks at the end).
fn dlo_from(
    pipeline: &Pipeline,
    ckpt: &Arc<Checkpoint>,
    g: u32,
    bugs: &[PlantedBug],
) -> Vec<RankRun> {
    use offload_sim::harness::{Rig, StrategyChoice, drive};
    use offload_sim::multi::{EncoderRanks, rank_config};
    let w = workload(pipeline.clone());
    let base = RunOptions::new(DeviceProfile::h200());
    let opts = RunOptions {
        profile: base.profile.for_ranks(g),
        bugs: bugs.to_vec(),
        ..base
    };
    let devices: Vec<SimDevice> = (0..g)
        .map(|_| SimDevice::new(opts.sim_config()).unwrap())
        .collect();
    let collectives = SimGroup::new(&devices).ranks().unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .into_iter()
            .zip(collectives)
            .enumerate()
            .map(|(r, (device, collective))| {
                let (w, opts) = (&w, &opts);
                s.spawn(move || {
                    let rank = r as u32;
                    let ((outcome, shards), logs) = capture_logs(|| {
                        let source = Arc::new(dit_source(pipeline, Arc::clone(ckpt)));
                        let rig = Rig::on_device(
                            device,
                            pipeline.clone(),
                            opts,
                            Arc::clone(&source) as Arc<dyn WeightSource>,
                            Some(collective.clone()),
                        )
                        .unwrap();
                        let config = rank_config(&dlo_config(), rank, g, EncoderRanks::All);
                        let choice = StrategyChoice::Config(config.clone());
                        let outcome = drive(
                            rig,
                            &choice,
                            &config,
                            opts,
                            w.requests,
                            |rig| rig.request(w),
                            |_| {},
                        );
                        collective.depart();
                        (outcome, source.shard_windows_and_copies())
                    });
                    let (outputs, registered, pinned, violations) = match outcome {
                        Ok(o) => (
                            Ok(o.requests.iter().map(|q| q.output).collect()),
                            o.after_enable.registered_bytes,
                            o.after_enable.pinned_bytes,
                            o.violations,
                        ),
                        Err(f) => (Err(f.error.to_string()), 0, 0, f.violations),
                    };
                    RankRun {
                        rank,
                        outputs,
                        registered,
                        pinned,
                        violations: violations.iter().map(|v| v.to_string()).collect(),
                        shards,
                        logs,
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Each gathered block's unit in the rank's packing (every block of the
/// DiT streams: no resident leading layers).
fn block_units(pipeline: &Pipeline, ckpt: &Arc<Checkpoint>) -> Vec<offload_core::runtime::Unit> {
    let source = dit_source(pipeline, Arc::clone(ckpt));
    packing_for(pipeline, &source)
        .unwrap()
        .blocks
        .into_values()
        .collect()
}

/// s = ceil(bytes / G): one rank's shard of a block, padding included.
fn shard_bytes(unit: &offload_core::runtime::Unit, g: u32) -> u64 {
    unit.bytes.div_ceil(u64::from(g))
}

/// The host bytes each rank of `g` may hold: its share of the streamed
/// weights (INV-7's bound for the rank's configuration), which every rank
/// reaches within under G bytes of padding per block.
fn share_of_streamed(pipeline: &Pipeline, g: u32) -> u64 {
    let mut config = dlo_config();
    config.parallel.data_parallel_size = g;
    let bounds = offload_core::runtime::memory_bounds(pipeline, &config, 1).unwrap();
    assert_eq!(bounds.group_size, g);
    bounds.offloaded_bytes.div_ceil(u64::from(g))
}

#[test]
fn dlo_shards_of_one_window_blocks_are_registered_in_place_a_gth_per_rank() {
    let dir = scratch("dlo-single");
    let tensors = dit_tensors();
    write_file(&dir.join("diffusion_pytorch_model.safetensors"), &tensors).unwrap();
    let ckpt = Arc::new(Checkpoint::open(&dir).unwrap());
    let pipeline = pipeline_from(&ckpt);
    let reference = run(&pipeline, Arc::new(in_memory(&pipeline, &tensors)), false);
    let units = block_units(&pipeline, &ckpt);
    assert_eq!(units.len(), 7);
    for g in [2u32, 3, 4] {
        let ranks = dlo_from(&pipeline, &ckpt, g, &[]);
        let shards: u64 = units.iter().map(|u| shard_bytes(u, g)).sum();
        let share = share_of_streamed(&pipeline, g);
        assert!(
            shards >= share && shards < share + units.len() as u64 * u64::from(g),
            "G={g}: {shards} bytes of shards for a share of {share}"
        );
        for r in &ranks {
            let at = format!("G={g} rank {}", r.rank);
            assert_eq!(
                r.outputs.as_ref(),
                Ok(&reference.outputs),
                "{at}: the file's bytes"
            );
            assert_eq!(r.violations, Vec::<String>::new(), "{at}");
            assert_eq!(r.shards, (7, 0), "{at}: every shard a window, none copied");
            // Observed on the device: this rank's shards registered in
            // place, 1/G of the streamed bytes (plus padding), nothing
            // pinned once enable has uploaded the rest.
            assert_eq!(r.registered, shards, "{at}");
            assert_eq!(r.pinned, 0, "{at}: no pinned copy of a shard");
            assert!(!r.logs.contains("WARN"), "{at}: {}", r.logs);
            assert!(
                r.logs.contains(&format!(
                    "in_place=7 in_place_bytes={shards} copied=0 copied_bytes=0"
                )),
                "{at}: the rank's own count at enable: {}",
                r.logs
            );
        }
    }
}

#[test]
fn dlo_from_a_shard_set_copies_only_the_shards_a_file_boundary_splits() {
    let dir = scratch("dlo-shards");
    let tensors = dit_tensors();
    let cut = "transformer_blocks.1.ff.net.0.proj.weight";
    let index = write_shards(&dir, &tensors, cut);
    let ckpt = Arc::new(Checkpoint::open(&index).unwrap());
    let pipeline = pipeline_from(&ckpt);
    let reference = run(&pipeline, Arc::new(in_memory(&pipeline, &tensors)), false);
    let units = block_units(&pipeline, &ckpt);
    let split = units
        .iter()
        .find(|u| u.name == "transformer.transformer_blocks.1")
        .unwrap();
    // Block 1's bytes in the first file (its attention), packed first: the
    // file boundary lies there in its packing.
    let boundary = bytes_under(&tensors, "transformer_blocks.1.attn.");
    assert!(0 < boundary && boundary < split.bytes);
    for (g, split_ranks) in [(2u32, vec![0u32]), (3, vec![]), (4, vec![1])] {
        let s = shard_bytes(split, g);
        let splits = |r: u32| {
            let (start, end) = (u64::from(r) * s, (u64::from(r + 1) * s).min(split.bytes));
            start < boundary && boundary < end
        };
        assert_eq!(
            (0..g).filter(|&r| splits(r)).collect::<Vec<_>>(),
            split_ranks,
            "G={g}: the premise"
        );
        let shards: u64 = units.iter().map(|u| shard_bytes(u, g)).sum();
        let ranks = dlo_from(&pipeline, &ckpt, g, &[]);
        for r in &ranks {
            let at = format!("G={g} rank {}", r.rank);
            assert_eq!(r.outputs.as_ref(), Ok(&reference.outputs), "{at}");
            assert_eq!(r.violations, Vec::<String>::new(), "{at}");
            let copied = u64::from(splits(r.rank));
            assert_eq!(r.shards, (7 - copied, copied), "{at}");
            assert_eq!(r.registered, shards - copied * s, "{at}");
            assert_eq!(
                r.pinned,
                copied * s,
                "{at}: a pinned copy only of the split shard"
            );
            assert!(
                r.logs.contains(&format!(
                    "in_place={} in_place_bytes={} copied={copied} copied_bytes={}",
                    7 - copied,
                    shards - copied * s,
                    copied * s
                )),
                "{at}: the rank's own count at enable: {}",
                r.logs
            );
            let warns: Vec<&str> = r.logs.lines().filter(|l| l.contains("WARN")).collect();
            assert_eq!(warns.len() as u64, copied, "{at}: {}", r.logs);
            for w in warns {
                for needle in [
                    "shard of block `transformer.transformer_blocks.1`",
                    &format!("bytes={s}"),
                    "a file boundary splits it",
                    "model-00001-of-00002.safetensors",
                    "model-00002-of-00002.safetensors",
                ] {
                    assert!(w.contains(needle), "{at}: `{w}` should name {needle}");
                }
            }
        }
    }
}

#[test]
fn planted_shard_window_wrong_offset_is_caught_and_its_control_is_clean() {
    let dir = scratch("dlo-planted");
    let tensors = dit_tensors();
    write_file(&dir.join("diffusion_pytorch_model.safetensors"), &tensors).unwrap();
    let ckpt = Arc::new(Checkpoint::open(&dir).unwrap());
    let pipeline = pipeline_from(&ckpt);
    let reference = run(&pipeline, Arc::new(in_memory(&pipeline, &tensors)), false);
    for g in [2u32, 3] {
        let clean = dlo_from(&pipeline, &ckpt, g, &[]);
        for r in &clean {
            assert_eq!(r.outputs.as_ref(), Ok(&reference.outputs), "control G={g}");
            assert_eq!(r.violations, Vec::<String>::new(), "control G={g}");
        }
        let planted = dlo_from(&pipeline, &ckpt, g, &[PlantedBug::ShardWindowWrongOffset]);
        // The bug takes the in-place path (its windows are registered)...
        assert!(
            planted.iter().all(|r| r.shards.0 > 0),
            "G={g}: {:?}",
            planted.iter().map(|r| r.shards).collect::<Vec<_>>()
        );
        // ... and is seen (INV-8): every rank gathers the shifted window
        // into its slots, so every rank's outputs are not the file's bytes.
        for r in &planted {
            assert!(
                r.outputs.is_ok() && r.outputs.as_ref() != Ok(&reference.outputs),
                "G={g} rank {}: the wrong offset went unseen ({:?}, {:?})",
                r.rank,
                r.outputs,
                r.violations
            );
        }
    }
}

#[test]
fn a_shard_window_holds_the_files_bytes_and_padding_stays_in_the_file() {
    // Two blocks of one 10-byte tensor each, the second last in the file:
    // with G = 4, s = 3, the last rank's shard (bytes 9..12) pads past
    // its block, into the next block's bytes for block 0 and past the
    // file's end for block 1.
    let mut b = PipelineBuilder::new("PaddedPipeline");
    {
        let mut t = b.module("transformer");
        t.list("blocks", 2, |_, block| {
            block.parameter("w", DType::U8, &[10]);
        });
        t.block_containers(&["blocks"]);
    }
    b.declare_components(ComponentDeclaration {
        dit: vec!["transformer".into()],
        ..Default::default()
    });
    let pipeline = b.build().unwrap();
    let dir = scratch("padded");
    let file = dir.join("model.safetensors");
    write_file(&file, &tensors_of(&pipeline)).unwrap();
    let ckpt = Arc::new(Checkpoint::open(&file).unwrap());
    let source = dit_source(&pipeline, Arc::clone(&ckpt));
    let packing = packing_for(&pipeline, &source).unwrap();
    let units: Vec<_> = packing.blocks.values().collect();
    let file_bytes = |name: &str| ckpt.bytes(name).unwrap().to_vec();
    let (b0, b1) = (file_bytes("blocks.0.w"), file_bytes("blocks.1.w"));
    let (regions, logs) = capture_logs(|| {
        units
            .iter()
            .map(|u| {
                (0..4u64)
                    .map(|r| {
                        source
                            .take_shard_region(u, r * 3..r * 3 + 3)
                            .map(|w| w.bytes().to_vec())
                    })
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
    });
    for (r, (got0, got1)) in regions[0].iter().zip(&regions[1]).enumerate().take(3) {
        let at = r * 3;
        assert_eq!(got0.as_deref(), Some(&b0[at..at + 3]), "block 0 rank {r}");
        assert_eq!(got1.as_deref(), Some(&b1[at..at + 3]), "block 1 rank {r}");
    }
    let padded: Vec<u8> = [&b0[9..], &b1[..2]].concat();
    assert_eq!(
        regions[0][3].as_deref(),
        Some(&padded[..]),
        "block 0's last byte, then the next bytes of the file as padding"
    );
    assert_eq!(regions[1][3], None, "padding past the file's end");
    assert!(
        logs.contains("2 bytes of padding would run past the end of")
            && logs.contains("model.safetensors")
            && logs.contains("shard of block `transformer.blocks.1` (bytes 9..12 of 10)"),
        "{logs}"
    );
    assert_eq!(source.shard_windows_and_copies(), (7, 1));
    assert_eq!(source.shard_copied_bytes(), 3);
    // A shard that is all padding holds none of the file.
    assert!(source.take_shard_region(units[0], 10..13).is_none());
}

/// A positional read (`read_direct`, what the staging filler uses for
/// blocks whose pages it releases, CONTRACT §7c) gives the same bytes as a
/// read through the mapping, at every storage and offset; and releasing a
/// unit's pages or reading them ahead changes no byte read after.
#[test]
fn direct_reads_equal_mapped_reads_and_release_loses_nothing() {
    let dir = scratch("direct");
    let tensors = dit_tensors();
    let file = dir.join("diffusion_pytorch_model.safetensors");
    write_file(&file, &tensors).unwrap();
    let ckpt = Arc::new(Checkpoint::open(&dir).unwrap());
    let pipeline = pipeline_from(&ckpt);
    let source = dit_source(&pipeline, Arc::clone(&ckpt));
    let partition = offload_core::runtime::partition(&pipeline, &[], &[]);
    let mut checked = 0;
    for unit in partition.all() {
        source.release(unit);
        source.prefetch(unit);
        for e in &unit.entries {
            for (from, len) in [
                (0, e.bytes),
                (e.bytes / 3, e.bytes / 2),
                (e.bytes.saturating_sub(1), 1),
            ] {
                let mut mapped = vec![0u8; len as usize];
                let mut direct = vec![0xa5u8; len as usize];
                source.read(e.storage, from, &mut mapped);
                source.read_direct(e.storage, from, &mut direct);
                assert_eq!(mapped, direct, "`{}` at {from}+{len}", unit.name);
                checked += 1;
            }
        }
    }
    assert!(checked > 30, "{checked} reads compared");
}
