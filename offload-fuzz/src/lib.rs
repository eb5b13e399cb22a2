//! `offload-fuzz`: one harness per parser of untrusted input.
//!
//! Each `pub fn TARGET(data: &[u8])` feeds arbitrary bytes to one parser
//! and asserts what must hold whatever the bytes: the parser returns a
//! value or a typed error with a message (it never panics, and the
//! harness panics, which the fuzzer reports, where a property fails), and
//! where a value comes back a consistency property holds (a configuration
//! re-serialised parses to the same value; a header's tensors lie within
//! the file and hold exactly their shape's bytes).
//!
//! | target | parser |
//! | --- | --- |
//! | [`safetensors_file`] | `Checkpoint::open` on a `.safetensors` file, then `declare` and `SafetensorsSource::new` over it |
//! | [`safetensors_index`] | `Checkpoint::open` on a `.safetensors.index.json` and on its directory |
//! | [`name_map`] | `NameMap::from_json` |
//! | [`config`] | `OffloadConfig::from_json_str` / `from_toml_str` and `select`, `ByteSize::parse`, `DeviceBudget::parse` |
//! | [`plan`] | `OffloadPlan::from_json_str` / `from_toml_str` |
//! | [`measurements`] | `PlannerInputs::from_json_str` |
//! | [`planner`] | `budget::plan` over a fixed small pipeline from measurements parsed from the input |
//! | [`packed_blob`] | `offload-pack`'s `Packed::parse` and its decodes |
//! | [`packed_checkpoint`] | `PackedCheckpoint::open` on a `.opack` file |
//! | [`coded_blocks`] | `CodedBlocks::open` on a `.opackb` coded-block file, each block checked against fixed weights and decoded |
//!
//! The same functions run under libFuzzer (`fuzz/`, see the README) and
//! in a bounded, seeded run in `cargo test` ([`mutate`], `tests/ci.rs`).

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use offload_core::budget::DeviceMemory;
use offload_core::bytes::{ByteSize, DeviceBudget};
use offload_core::config::OffloadConfig;
use offload_core::measurements::PlannerInputs;
use offload_core::model::{DType, Pipeline, PipelineBuilder};
use offload_core::runtime::WeightSource;
use offload_core::schema::OffloadPlan;
use offload_core::{ComponentDeclaration, budget};
use offload_safetensors::{Checkpoint, NameMap, write_file};

pub mod alloc_cap;
pub mod mutate;

/// A harness: arbitrary bytes in, a panic only where a property fails.
pub type Harness = fn(&[u8]);

/// The targets by name, as the corpus and regression folders name them.
pub const TARGETS: [(&str, Harness); 10] = [
    ("safetensors_file", safetensors_file),
    ("safetensors_index", safetensors_index),
    ("name_map", name_map),
    ("config", config),
    ("plan", plan),
    ("measurements", measurements),
    ("planner", planner),
    ("packed_blob", packed_blob),
    ("packed_checkpoint", packed_checkpoint),
    ("coded_blocks", coded_blocks),
];

thread_local! {
    /// This thread's scratch directory, once made.
    static DIR: RefCell<Option<PathBuf>> = const { RefCell::new(None) };
}

/// Removes this thread's scratch directory, if any (the bounded run calls
/// it after each target; a fuzzing process leaves its own behind).
pub fn remove_scratch() {
    if let Some(dir) = DIR.with(|d| d.borrow_mut().take()) {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A scratch directory of this process and thread (file-based parsers
/// read their input from a file in it).
fn scratch(name: &str) -> PathBuf {
    DIR.with(|d| {
        let mut d = d.borrow_mut();
        let dir = d.get_or_insert_with(|| {
            // /dev/shm where there is one: no disk in the loop.
            let base = Path::new("/dev/shm");
            let base = if base.is_dir() {
                base.to_owned()
            } else {
                std::env::temp_dir()
            };
            let dir = base
                .join(format!(
                    "offload-fuzz-{}-{:?}",
                    std::process::id(),
                    std::thread::current().id()
                ))
                .to_string_lossy()
                .replace(['(', ')'], "");
            let dir = PathBuf::from(dir);
            std::fs::create_dir_all(&dir).expect("a scratch directory");
            dir
        });
        dir.join(name)
    })
}

/// The text a text parser sees: the bytes, invalid UTF-8 replaced (so
/// the fuzzer's mutations are never wasted on a UTF-8 check).
fn text(data: &[u8]) -> String {
    String::from_utf8_lossy(data).into_owned()
}

/// A typed error must say what was wrong.
fn said(e: &impl std::fmt::Display) {
    assert!(!e.to_string().trim().is_empty(), "an error with no message");
}

/// `Checkpoint::open` on `data` written as a `.safetensors` file, and,
/// where `data` holds a `}`, on the file framed from it: `data` up to its
/// last `}` as the header (its length prefix written to match), the rest
/// as the tensor bytes, so mutations of a header's JSON are not all lost
/// to a length prefix that no longer matches. On success every tensor
/// lies within the file after the header, its bytes are exactly its
/// shape's, `bytes` returns them, and declaring the tensors and binding
/// them back (`SafetensorsSource::new`, then reading every storage) reads
/// the same bytes.
pub fn safetensors_file(data: &[u8]) {
    safetensors_bytes(data);
    if let Some(end) = data.iter().rposition(|&b| b == b'}') {
        let mut framed = Vec::with_capacity(data.len() + 8);
        framed.extend_from_slice(&(end as u64 + 1).to_le_bytes());
        framed.extend_from_slice(data);
        safetensors_bytes(&framed);
    }
}

fn safetensors_bytes(data: &[u8]) {
    let path = scratch("fuzz.safetensors");
    std::fs::write(&path, data).expect("write the scratch file");
    let ckpt = match Checkpoint::open(&path) {
        Ok(c) => c,
        Err(e) => return said(&e),
    };
    check_checkpoint(&ckpt, &[data.len()]);
    let mut b = PipelineBuilder::new("Fuzz");
    match ckpt.declare(&mut b.module("m"), "") {
        // A tensor named exactly the prefix (here ``) is not declared.
        Ok(n) => assert_eq!(n, ckpt.tensors().keys().filter(|n| !n.is_empty()).count()),
        Err(e) => return said(&e),
    }
    let pipeline = match b.build() {
        Ok(p) => p,
        Err(e) => return said(&e),
    };
    let ckpt = Arc::new(ckpt);
    let source = match offload_safetensors::SafetensorsSource::new(
        &pipeline,
        vec![(Arc::clone(&ckpt), NameMap::prefix("m.", ""))],
    ) {
        Ok(s) => s,
        Err(e) => return said(&e),
    };
    for (id, t) in pipeline.tensors() {
        let bytes = pipeline.storage(t.storage).bytes;
        let mut dst = vec![0u8; usize::try_from(bytes).expect("a storage within the file")];
        source.read(t.storage, 0, &mut dst);
        let name = pipeline.tensor_path(id);
        let name = name.strip_prefix("m.").expect("declared under `m.`");
        assert_eq!(Some(dst.as_slice()), ckpt.bytes(name), "tensor `{name}`");
    }
}

/// Every tensor within its file (`lens`: each file's length), after the
/// 8-byte length prefix, holding exactly its shape's bytes.
fn check_checkpoint(ckpt: &Checkpoint, lens: &[usize]) {
    let mut total = 0u64;
    for (name, t) in ckpt.tensors() {
        let len = lens[t.file];
        assert!(
            8 <= t.range.start && t.range.start <= t.range.end && t.range.end <= len,
            "tensor `{name}` at {:?} outside a file of {len} bytes",
            t.range
        );
        let want = t
            .shape
            .iter()
            .try_fold(t.dtype.size_bytes(), |a, &d| a.checked_mul(d))
            .expect("a shape whose bytes fit the file cannot overflow");
        assert_eq!(
            want,
            t.range.len() as u64,
            "tensor `{name}`: shape vs bytes"
        );
        assert_eq!(ckpt.bytes(name).map(<[u8]>::len), Some(t.range.len()));
        total += t.range.len() as u64;
    }
    assert_eq!(total, ckpt.total_bytes());
}

/// The two shards beside the fuzzed index: `a.safetensors` holds `x` and
/// `y`, `b.safetensors` holds `z`. Returns the directory and the shards'
/// lengths by name.
fn shard_dir() -> (PathBuf, [(String, usize); 2]) {
    let dir = scratch("index");
    let a = dir.join("a.safetensors");
    let b = dir.join("b.safetensors");
    if !b.is_file() {
        std::fs::create_dir_all(&dir).expect("the shard directory");
        write_file(
            &a,
            &[
                (
                    "x".into(),
                    DType::F32,
                    vec![2],
                    vec![0, 0, 128, 63, 0, 0, 0, 64],
                ),
                ("y".into(), DType::U8, vec![3], vec![1, 2, 3]),
            ],
        )
        .expect("shard a");
        write_file(&b, &[("z".into(), DType::Bf16, vec![1], vec![128, 63])]).expect("shard b");
    }
    let len = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len() as usize);
    let lens = [
        ("a.safetensors".into(), len(&a)),
        ("b.safetensors".into(), len(&b)),
    ];
    (dir, lens)
}

/// `Checkpoint::open` on `data` written as a shard set's
/// `model.safetensors.index.json` beside two valid shards, and on their
/// directory: both give the same answer; on success every tensor lies in
/// its shard and every name the index maps is there.
pub fn safetensors_index(data: &[u8]) {
    let (dir, lens) = shard_dir();
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(&index, data).expect("write the index");
    let by_file = Checkpoint::open(&index);
    let by_dir = Checkpoint::open(&dir);
    match (&by_file, &by_dir) {
        (Ok(f), Ok(d)) => {
            assert_eq!(f.tensors(), d.tensors());
            let file_lens: Vec<usize> = f
                .files()
                .map(|p| {
                    let n = p.file_name().map(|n| n.to_string_lossy().into_owned());
                    lens.iter()
                        .find(|(s, _)| Some(s) == n.as_ref())
                        .map_or(data.len(), |(_, l)| *l)
                })
                .collect();
            check_checkpoint(f, &file_lens);
        }
        (Err(f), Err(d)) => {
            said(f);
            said(d);
        }
        (f, d) => panic!(
            "the index and its directory disagree: {:?} vs {:?}",
            f.as_ref().map(|_| ()),
            d.as_ref().map(|_| ())
        ),
    }
}

/// `NameMap::from_json`: on success every prefix names whole segments,
/// the map re-written as JSON parses to itself, and each rule maps its
/// own prefix's paths unless an earlier rule covers them.
pub fn name_map(data: &[u8]) {
    let text = text(data);
    let map = match NameMap::from_json(&text) {
        Ok(m) => m,
        Err(e) => return said(&e),
    };
    assert!(map.validate().is_ok());
    let again: Vec<serde_json::Value> = map
        .rules
        .iter()
        .map(|r| serde_json::json!({"pipeline": r.pipeline, "checkpoint": r.checkpoint}))
        .collect();
    let again = serde_json::Value::Array(again).to_string();
    assert_eq!(
        NameMap::from_json(&again).ok().as_ref(),
        Some(&map),
        "{again}"
    );
    for (i, r) in map.rules.iter().enumerate() {
        let path = format!("{}w", r.pipeline);
        let first = map
            .rules
            .iter()
            .position(|e| path.starts_with(e.pipeline.as_str()))
            .expect("the rule covers its own prefix");
        if first == i {
            assert_eq!(
                map.checkpoint_name(&path),
                Some(format!("{}w", r.checkpoint))
            );
        }
    }
}

/// The configuration parsers, on the input as JSON and as TOML: on
/// success `select` answers without panicking and the configuration
/// re-serialised (JSON; TOML where TOML can write it) parses to the same
/// value. Then the size parsers on the input as a size string (see
/// [`sizes`]).
pub fn config(data: &[u8]) {
    let text = text(data);
    for parsed in [
        OffloadConfig::from_json_str(&text),
        OffloadConfig::from_toml_str(&text),
    ] {
        let c = match parsed {
            Ok(c) => c,
            Err(e) => {
                said(&e);
                continue;
            }
        };
        if let Err(e) = c.select() {
            said(&e);
        }
        let json = serde_json::to_string(&c).expect("a configuration writes as JSON");
        assert_eq!(
            OffloadConfig::from_json_str(&json).as_ref().ok(),
            Some(&c),
            "JSON round trip of {json}"
        );
        // TOML has no integer above i64::MAX: such a size cannot be written.
        if let Ok(toml) = toml::to_string(&c) {
            assert_eq!(
                OffloadConfig::from_toml_str(&toml).as_ref().ok(),
                Some(&c),
                "TOML round trip of {toml}"
            );
        }
    }
    sizes(&text);
}

/// `ByteSize::parse` and `DeviceBudget::parse`: a size is at least one
/// byte, its byte count parses back to it, and the form written back as a
/// key's value (`written_at_least`) parses to at least as many bytes.
pub fn sizes(text: &str) {
    match ByteSize::parse(text) {
        Ok(b) => {
            assert!(b.bytes() >= 1);
            assert_eq!(ByteSize::parse(&b.bytes().to_string()), Ok(b));
            assert!(!b.to_string().is_empty());
            let written = b.written_at_least(b.bytes());
            let back = ByteSize::parse(written.trim_matches('"'))
                .unwrap_or_else(|e| panic!("`{text}` written back as {written}: {e}"));
            // Above 2^53 bytes (8 PiB) an f64 of the figure is not exact.
            if b.bytes() < 1 << 53 {
                assert!(back >= b, "`{text}` written back as {written} is less");
            }
            assert_eq!(DeviceBudget::parse(text), Ok(DeviceBudget::Bytes(b)));
        }
        Err(e) => {
            said(&e);
            match DeviceBudget::parse(text) {
                Ok(d) => assert_eq!(d, DeviceBudget::Auto),
                Err(e) => said(&e),
            }
        }
    }
}

/// `OffloadPlan::from_json_str` / `from_toml_str` on the input: on
/// success the version is the supported one and the plan re-serialised
/// parses to itself.
pub fn plan(data: &[u8]) {
    let text = text(data);
    for parsed in [
        OffloadPlan::from_json_str(&text),
        OffloadPlan::from_toml_str(&text),
    ] {
        let p = match parsed {
            Ok(p) => p,
            Err(e) => {
                said(&e);
                continue;
            }
        };
        assert_eq!(p.version, offload_core::schema::PLAN_SCHEMA_VERSION);
        let json = serde_json::to_string(&p).expect("a plan writes as JSON");
        assert_eq!(
            OffloadPlan::from_json_str(&json).as_ref().ok(),
            Some(&p),
            "{json}"
        );
        let toml = toml::to_string(&p).expect("a plan writes as TOML");
        assert_eq!(
            OffloadPlan::from_toml_str(&toml).as_ref().ok(),
            Some(&p),
            "{toml}"
        );
    }
}

/// `PlannerInputs::from_json_str`: on success the saved form
/// (`to_json`) parses again, to the same integers and components (floats
/// may move by an ulp through a decimal round trip).
pub fn measurements(data: &[u8]) {
    let text = text(data);
    let m = match PlannerInputs::from_json_str(&text) {
        Ok(m) => m,
        Err(e) => return said(&e),
    };
    let json = m.to_json();
    let back = PlannerInputs::from_json_str(&json)
        .unwrap_or_else(|e| panic!("the saved form does not parse: {e}\n{json}"));
    assert_eq!(
        (
            back.version,
            back.steps,
            back.max_depth,
            back.allocation_granule_bytes
        ),
        (m.version, m.steps, m.max_depth, m.allocation_granule_bytes)
    );
    assert_eq!(
        back.host_fill_bytes_per_s.is_some(),
        m.host_fill_bytes_per_s.is_some(),
        "the host fill rate survives the saved form: {json}"
    );
    assert_eq!(
        back.staged_stream_bytes_per_s.is_some(),
        m.staged_stream_bytes_per_s.is_some(),
        "the staged stream's rate survives the saved form: {json}"
    );
    assert_eq!(
        back.components.keys().collect::<Vec<_>>(),
        m.components.keys().collect::<Vec<_>>()
    );
    assert_eq!(back.pipeline_type, m.pipeline_type);
}

/// A small pipeline for [`planner`] and [`coded_blocks`]: a DiT of two
/// block containers (4 and 2 blocks of two sizes) and a text encoder of 2
/// layers, declared.
pub fn small_pipeline() -> &'static Pipeline {
    static PIPELINE: std::sync::OnceLock<Pipeline> = std::sync::OnceLock::new();
    PIPELINE.get_or_init(|| {
        let mut b = PipelineBuilder::new("FuzzPipeline");
        {
            let mut te = b.module("text_encoder");
            te.parameter("embed.weight", DType::Bf16, &[64, 32]);
            te.list("layers", 2, |_, l| {
                l.parameter("mlp.weight", DType::Bf16, &[32, 32]);
            });
            te.block_containers(&["layers"]);
        }
        {
            let mut dit = b.module("transformer");
            dit.parameter("x_embedder.weight", DType::Bf16, &[64, 16]);
            dit.list("big_blocks", 4, |_, blk| {
                blk.parameter("attn.weight", DType::Bf16, &[64, 64]);
            });
            dit.list("small_blocks", 2, |_, blk| {
                blk.parameter("attn.weight", DType::F32, &[32, 32]);
            });
            dit.parameter("proj_out.weight", DType::Bf16, &[16, 64]);
            dit.block_containers(&["big_blocks", "small_blocks"]);
        }
        b.declare_components(ComponentDeclaration {
            dit: vec!["transformer".into()],
            encoder: vec!["text_encoder".into()],
            ..Default::default()
        });
        b.build().expect("the fuzz pipeline builds")
    })
}

/// `budget::plan` over a small pipeline (a DiT of 4 + 2 blocks, a text
/// encoder) from `PlannerInputs` parsed from the input (measurements a
/// second start reloads, or a caller writes: untrusted), for a budget of a
/// size and of `"auto"`, with `weight_compression` `"none"`, `"lossless"`
/// or `"auto"` by the input's first byte, and the host side by its length
/// (every master pinned, a host budget of a size, or every master staged:
/// the inputs' fill and staged stream rates priced, CONTRACT §7c): a plan
/// or a typed error, never a panic, a hang or an unbounded allocation.
pub fn planner(data: &[u8]) {
    let Ok(inputs) = PlannerInputs::from_json_str(&text(data)) else {
        return;
    };
    let pipeline = small_pipeline();
    // Each budget uncoded and, where the input's first byte says so, with
    // `weight_compression` (the planner prices the inputs' coded sizes and
    // decoder rate: CONTRACT §7b).
    let compression = match data.first().map(|b| b % 3) {
        Some(1) => "\nweight_compression = \"lossless\"",
        Some(2) => "\nweight_compression = \"auto\"",
        _ => "",
    };
    let host = match data.len() % 3 {
        1 => "\nhost_budget = \"24KiB\"",
        2 => "\npin_cpu_memory = false",
        _ => "",
    };
    for (budget, memory) in [
        (r#"device_budget = "40KiB""#, DeviceMemory::of(1 << 30)),
        (
            "device_budget = \"auto\"\ndevice_headroom = \"16KiB\"",
            DeviceMemory {
                total_bytes: 1 << 20,
                free_bytes: 1 << 17,
            },
        ),
    ] {
        let config = OffloadConfig::from_toml_str(&format!("{budget}{compression}{host}"))
            .expect("a fixed budget parses");
        match budget::plan(pipeline, &config, &inputs, memory) {
            Ok(plan) => {
                let _ = plan.predicted_step_s();
            }
            Err(e) => said(&e),
        }
    }
}

/// `offload-pack`'s blob parser on `data` (one packed tensor): on success
/// the whole decode and every tile decoded alone either both fail with a
/// typed error or agree byte for byte, and a decode is exactly the
/// header's decoded size (bounded by the blob's length, so no input
/// allocates past it).
pub fn packed_blob(data: &[u8]) {
    use offload_pack::format::Packed;
    let p = match Packed::parse(data) {
        Ok(p) => p,
        Err(e) => return said(&e),
    };
    let decoded = p.header().decoded_bytes;
    assert!(
        decoded <= 2 * data.len() as u64,
        "a blob of {} bytes claims {decoded} decoded bytes and parsed",
        data.len()
    );
    let whole = p.decode();
    if let Err(e) = &whole {
        said(e);
    }
    let tiles = p.n_tiles();
    if tiles == 0 {
        return;
    }
    let mut ok = true;
    let mut by_tiles = vec![0u8; decoded as usize];
    for t in 0..tiles {
        let range = p.tile_output(t);
        if range.end > by_tiles.len() {
            ok = false;
            continue;
        }
        if let Err(e) = p.decode_tile(t, &mut by_tiles[range]) {
            said(&e);
            ok = false;
        }
    }
    if let (Ok(whole), true) = (&whole, ok) {
        assert!(
            *whole == by_tiles,
            "the whole decode and the tile decodes differ"
        );
    }
}

/// `PackedCheckpoint::open` on `data` written as a `.opack` file: on
/// success every tensor decodes to its manifest's decoded bytes, or fails
/// with a typed error.
pub fn packed_checkpoint(data: &[u8]) {
    let path = scratch("fuzz.opack");
    std::fs::write(&path, data).expect("the scratch file");
    let ck = match offload_pack::container::PackedCheckpoint::open(&path) {
        Ok(ck) => ck,
        Err(e) => return said(&e),
    };
    for (name, entry) in ck.tensors() {
        match ck.decode(name, 1) {
            Ok(bytes) => assert!(
                entry.range.len() as u64 * 2 + 64 >= bytes.len() as u64,
                "`{name}`: {} decoded bytes from a {}-byte blob",
                bytes.len(),
                entry.range.len()
            ),
            Err(e) => said(&e),
        }
    }
}

/// Weights of [`small_pipeline`] for [`coded_blocks`]: every bf16 value a
/// fixed function of its storage and place, drawn like a trained weight's
/// (a few exponents around 2^-7, so the window code codes them); other
/// bytes the same function's low byte.
pub struct FixedWeights;

impl FixedWeights {
    fn byte(storage: u64, at: u64) -> u8 {
        // splitmix64 of (storage, the bf16 value's index).
        let mut z = ((storage << 40) ^ (at / 2)).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let value = ((z >> 20) & 1) << 15 | (120 + z % 6) << 7 | (z >> 8) & 0x7f;
        (value >> (8 * (at % 2))) as u8
    }
}

impl WeightSource for FixedWeights {
    fn read(&self, storage: offload_core::model::StorageId, position: u64, dst: &mut [u8]) {
        let s = u64::from(storage.index() as u32);
        for (i, b) in dst.iter_mut().enumerate() {
            *b = Self::byte(s, position + i as u64);
        }
    }
}

/// The coded-block file of [`small_pipeline`]'s blocks over
/// [`FixedWeights`] (the corpus seed of [`coded_blocks`]), written at
/// `path`.
pub fn write_coded_blocks_seed(path: &Path) -> Result<(), String> {
    offload_pack::blocks_file::pack_blocks(
        path,
        small_pipeline(),
        &FixedWeights,
        &offload_pack::format::EncodeConfig::default(),
    )
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// `CodedBlocks::open` on `data` written as a `.opackb` coded-block file,
/// then for every block of [`small_pipeline`] the file's block of that
/// path and layout checked against [`FixedWeights`] (its fingerprint) and
/// decoded into exactly the unit's bytes: a value or a typed error at each
/// step, never a panic. (Windows are slices of the file's mapping, so they
/// lie within it by construction; blob bodies carry no checksum, so a
/// mutant that parses may decode to other bytes, which this cannot tell
/// from a real file.)
pub fn coded_blocks(data: &[u8]) {
    use offload_pack::blocks_file::CodedBlocks;
    let path = scratch("fuzz.opackb");
    std::fs::write(&path, data).expect("the scratch file");
    let blocks = match CodedBlocks::open(&path) {
        Ok(b) => b,
        Err(e) => return said(&e),
    };
    let part = offload_core::runtime::packing_for(small_pipeline(), &FixedWeights)
        .expect("the fuzz pipeline packs");
    for unit in part.blocks.values() {
        let region = match blocks.checked_region(unit, &FixedWeights) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(e) => {
                said(&e);
                continue;
            }
        };
        let bytes = region.region.bytes();
        let mut out = vec![0u8; usize::try_from(unit.bytes).expect("a small unit")];
        if let Err(e) = offload_pack::block::decode_block(bytes, &mut out, 1) {
            said(&e);
        }
    }
}
