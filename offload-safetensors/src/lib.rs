//! `offload-safetensors`: host masters straight from safetensors checkpoints.
//!
//! A [`Checkpoint`] maps one `.safetensors` file, or a diffusers shard set
//! (`diffusion_pytorch_model-0000N-of-0000M.safetensors` with its
//! `….safetensors.index.json`), read-only and shared, with memmap2: nothing
//! is read until a page is touched, and the bytes live in the page cache,
//! not in this process's heap.
//!
//! A [`SafetensorsSource`] binds a [`Pipeline`]'s tensors to checkpoint
//! tensors through a [`NameMap`] (prefix rules, data not code: JSON such as
//! `[{"pipeline": "transformer.", "checkpoint": ""}]`), validating name,
//! dtype and shape up front (a typed [`CheckpointError`] naming the tensor
//! and the file). It is a [`WeightSource`] that proposes the packing order:
//! [`WeightSource::position`] gives each tensor's file and offset, and every
//! strategy packs a block in the order its file holds it, whatever order the
//! pipeline declared its tensors in (a hand-written forward order, or
//! [`Checkpoint::declare`]'s). A block whose tensors lie back to back in one
//! file is then a window of the mapping ([`WeightSource::take_region`]),
//! which the device registers in place (read-only; on CUDA with
//! `CU_MEMHOSTREGISTER_READ_ONLY`, the whole file once for all its windows)
//! and copies from: no second host copy. A block that is not one window
//! (split across shards; another tensor between its own, as where a file
//! groups tensors by dtype and the block mixes dtypes; a non-persistent
//! buffer no file holds) is filled into an exact-size pinned master
//! instead, with a `warn` naming the block, its bytes and the reason, and
//! counted ([`SafetensorsSource::windows_and_copies`],
//! [`SafetensorsSource::copied_bytes`]; the runtime's own count is
//! `Runtime::host_masters`). Units outside the blocks (a component's
//! embedders and norms, which a file in name order seldom holds back to
//! back) are said at `info`: under layerwise offload they are only staged
//! through pinned memory on their way to the device.
//!
//! Under distributed layerwise offload a rank holds only its shard of each
//! gathered block (bytes `r·s..(r+1)·s` of its packing, CONTRACT §8), and
//! a shard whose bytes lie in one file as packed is a window of the mapping
//! too ([`WeightSource::take_shard_region`]), registered in place the same
//! way, whether or not the whole block is one window: in a shard set only
//! the shards a file boundary splits are copied into pinned memory (a
//! `warn` naming the block, the shard's bytes and why), the others of the
//! same block stay windows. The last rank's padding (under G bytes past the
//! block, never read by compute) is the bytes that follow the block in its
//! file; a shard whose padding would run past the file's end is copied.
//! Counted apart: [`SafetensorsSource::shard_windows_and_copies`],
//! [`SafetensorsSource::shard_copied_bytes`].
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;
use offload_core::Pipeline;
use offload_core::device::HostRegion;
use offload_core::model::{DType, ModuleBuilder, ModuleId, StorageId, TensorKind};
use offload_core::runtime::{SourcePosition, Unit, WeightSource};
use serde::Deserialize;

/// What went wrong reading or binding a checkpoint. Every variant names the
/// file or tensor at fault and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be opened, read or mapped.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A `.safetensors` header is malformed.
    #[error("{}: not a valid safetensors file: {reason}", path.display())]
    Header {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// A shard index is malformed or names a tensor its shard lacks.
    #[error("{}: {reason}", path.display())]
    Index {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A directory holds no checkpoint, or several without an index.
    #[error("{}: {reason}", path.display())]
    NotACheckpoint {
        /// The path given.
        path: PathBuf,
        /// What was found there, and what is accepted.
        reason: String,
    },
    /// One tensor name appears in two files of a shard set.
    #[error("tensor `{name}` appears in both {} and {}", first.display(), second.display())]
    Duplicate {
        /// The checkpoint name.
        name: String,
        /// One file.
        first: PathBuf,
        /// The other.
        second: PathBuf,
    },
    /// A dtype offload does not model.
    #[error("tensor `{name}` in {} has dtype {dtype}, which offload does not support (bf16, f16, f32, f64, f8e4m3, f8e5m2, i64, i32, u8, bool)", file.display())]
    UnsupportedDType {
        /// The checkpoint name.
        name: String,
        /// Its file.
        file: PathBuf,
        /// The safetensors dtype.
        dtype: String,
    },
    /// No rule of the name map covers a pipeline tensor.
    #[error(
        "tensor `{tensor}` of the pipeline is not covered by any name-map rule (rules map pipeline prefixes {prefixes:?})"
    )]
    Unmapped {
        /// The pipeline path.
        tensor: String,
        /// The rules' pipeline prefixes.
        prefixes: Vec<String>,
    },
    /// A pipeline tensor's checkpoint name is in no file.
    #[error("tensor `{tensor}` of the pipeline: no tensor `{name}` in {}", files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "))]
    Missing {
        /// The pipeline path.
        tensor: String,
        /// The checkpoint name it maps to.
        name: String,
        /// The files searched.
        files: Vec<PathBuf>,
    },
    /// Dtypes differ.
    #[error("tensor `{tensor}` of the pipeline is {expected}, but `{name}` in {} is {found}", file.display())]
    DType {
        /// The pipeline path.
        tensor: String,
        /// The checkpoint name.
        name: String,
        /// Its file.
        file: PathBuf,
        /// The pipeline's dtype.
        expected: DType,
        /// The checkpoint's dtype.
        found: DType,
    },
    /// Shapes differ.
    #[error("tensor `{tensor}` of the pipeline has shape {expected:?}, but `{name}` in {} has {found:?}", file.display())]
    Shape {
        /// The pipeline path.
        tensor: String,
        /// The checkpoint name.
        name: String,
        /// Its file.
        file: PathBuf,
        /// The pipeline's shape.
        expected: Vec<u64>,
        /// The checkpoint's shape.
        found: Vec<u64>,
    },
    /// A pipeline tensor is not the whole of its storage (a strided or
    /// offset view): a checkpoint tensor fills a whole storage.
    #[error(
        "tensor `{tensor}` of the pipeline views bytes {span:?} of a {storage_bytes}-byte storage; a checkpoint tensor must fill its storage exactly"
    )]
    PartialStorage {
        /// The pipeline path.
        tensor: String,
        /// The bytes it views.
        span: Range<u64>,
        /// The storage's size.
        storage_bytes: u64,
    },
    /// A name map that does not parse, or a rule that would match inside a
    /// path segment.
    #[error("name map: {0}")]
    NameMap(String),
    /// A checkpoint whose names do not describe a module tree.
    #[error("checkpoint tensor `{name}`: {reason}")]
    Layout {
        /// The checkpoint name.
        name: String,
        /// What is wrong, and what is allowed.
        reason: String,
    },
}

/// A prefix that can only match whole dotted segments: empty, or ending in
/// `.`.
fn segment_prefix(prefix: &str) -> bool {
    prefix.is_empty() || prefix.ends_with('.')
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    }
}

/// One tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// Index of its file in [`Checkpoint::files`].
    pub file: usize,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Its bytes within the file (header included in the offsets).
    pub range: Range<usize>,
}

/// One mapped file.
struct Mapped {
    path: PathBuf,
    map: Arc<Mmap>,
    /// The open file, for positional reads that map nothing in
    /// ([`WeightSource::read_direct`]).
    file: Arc<File>,
}

/// A safetensors checkpoint: one file or a shard set, memory-mapped.
pub struct Checkpoint {
    files: Vec<Mapped>,
    tensors: BTreeMap<String, TensorEntry>,
}

impl fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checkpoint")
            .field("files", &self.files().collect::<Vec<_>>())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// The shard index diffusers and transformers write beside a shard set.
#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens `path`: a `.safetensors` file, a `.safetensors.index.json`
    /// shard index, or a directory holding one shard index, or else one
    /// `diffusion_pytorch_model.safetensors` or `model.safetensors`, or else
    /// exactly one `.safetensors` file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let path = path.as_ref();
        if path.is_dir() {
            return Self::open_dir(path);
        }
        if path.to_string_lossy().ends_with(".json") {
            return Self::open_index(path);
        }
        Self::open_files(&[path.to_owned()])
    }

    fn open_dir(dir: &Path) -> Result<Self, CheckpointError> {
        let mut indexes = Vec::new();
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io(dir))? {
            let p = entry.map_err(io(dir))?.path();
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if name.ends_with(".safetensors.index.json") {
                indexes.push(p);
            } else if name.ends_with(".safetensors") {
                files.push(p);
            }
        }
        indexes.sort();
        files.sort();
        // diffusers' and transformers' own names win over other files (a
        // saved input beside the weights).
        let named: Vec<PathBuf> = files
            .iter()
            .filter(|p| {
                p.file_name().is_some_and(|n| {
                    n == "diffusion_pytorch_model.safetensors" || n == "model.safetensors"
                })
            })
            .cloned()
            .collect();
        if indexes.is_empty() && named.len() == 1 {
            return Self::open_files(&named);
        }
        match (indexes.as_slice(), files.as_slice()) {
            ([index], _) => Self::open_index(index),
            ([], [file]) => Self::open_files(std::slice::from_ref(file)),
            ([], []) => Err(CheckpointError::NotACheckpoint {
                path: dir.to_owned(),
                reason: "no `.safetensors` file and no `.safetensors.index.json` in this directory"
                    .into(),
            }),
            ([], many) => Err(CheckpointError::NotACheckpoint {
                path: dir.to_owned(),
                reason: format!(
                    "{} `.safetensors` files and no index: name one file, or the `.safetensors.index.json`",
                    many.len()
                ),
            }),
            (many, _) => Err(CheckpointError::NotACheckpoint {
                path: dir.to_owned(),
                reason: format!("{} shard indexes: name the one to open", many.len()),
            }),
        }
    }

    fn open_index(index: &Path) -> Result<Self, CheckpointError> {
        let text = std::fs::read_to_string(index).map_err(io(index))?;
        let parsed: Index = serde_json::from_str(&text).map_err(|e| CheckpointError::Index {
            path: index.to_owned(),
            reason: format!("not a shard index (`{{\"weight_map\": {{name: file}}}}`): {e}"),
        })?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let shards: BTreeSet<&String> = parsed.weight_map.values().collect();
        let mut paths = Vec::new();
        for s in shards {
            if s.contains('/') || s.contains('\\') || s == ".." {
                return Err(CheckpointError::Index {
                    path: index.to_owned(),
                    reason: format!("shard `{s}` is not a file name beside the index"),
                });
            }
            let p = dir.join(s);
            if !p.is_file() {
                return Err(CheckpointError::Index {
                    path: index.to_owned(),
                    reason: format!("shard `{s}` is not a file beside the index"),
                });
            }
            paths.push(p);
        }
        let ckpt = Self::open_files(&paths)?;
        for (name, shard) in &parsed.weight_map {
            let in_file = ckpt.tensors.get(name).map(|t| &ckpt.files[t.file].path);
            if in_file.and_then(|p| p.file_name()) != Some(std::ffi::OsStr::new(shard)) {
                return Err(CheckpointError::Index {
                    path: index.to_owned(),
                    reason: format!(
                        "the index puts `{name}` in `{shard}`, but {}",
                        match in_file {
                            Some(p) => format!("it is in {}", p.display()),
                            None => "no shard holds it".to_owned(),
                        }
                    ),
                });
            }
        }
        Ok(ckpt)
    }

    fn open_files(paths: &[PathBuf]) -> Result<Self, CheckpointError> {
        let mut files = Vec::new();
        let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
        for path in paths {
            let file = File::open(path).map_err(io(path))?;
            // SAFETY: a read-only shared mapping. As every mmap-based
            // checkpoint loader, this relies on the file not being truncated
            // or rewritten while it is mapped (documented on `Checkpoint`).
            let map = unsafe { Mmap::map(&file) }.map_err(io(path))?;
            let header = |reason: String| CheckpointError::Header {
                path: path.clone(),
                reason,
            };
            offsets_within(&map).map_err(header)?;
            let (n, meta) =
                safetensors::SafeTensors::read_metadata(&map).map_err(|e| header(e.to_string()))?;
            let data_start = 8 + n;
            let index = files.len();
            for (name, info) in meta.tensors() {
                let dtype = dtype(info.dtype).ok_or_else(|| CheckpointError::UnsupportedDType {
                    name: name.clone(),
                    file: path.clone(),
                    dtype: format!("{:?}", info.dtype),
                })?;
                // Checked again here, whatever the parser let through: a
                // tensor's bytes lie within the file.
                let (start, end) = info.data_offsets;
                let range = data_start
                    .checked_add(start)
                    .zip(data_start.checked_add(end));
                let Some((start, end)) = range.filter(|(s, e)| s <= e && *e <= map.len()) else {
                    return Err(header(format!(
                        "tensor `{name}`: data_offsets [{start}, {end}] are not within the {} data bytes after the header",
                        map.len() - data_start
                    )));
                };
                let entry = TensorEntry {
                    file: index,
                    dtype,
                    shape: info.shape.iter().map(|&d| d as u64).collect(),
                    range: start..end,
                };
                if let Some(prev) = tensors.insert(name.clone(), entry) {
                    return Err(CheckpointError::Duplicate {
                        name,
                        first: paths[prev.file].clone(),
                        second: path.clone(),
                    });
                }
            }
            files.push(Mapped {
                path: path.clone(),
                map: Arc::new(map),
                file: Arc::new(file),
            });
        }
        Ok(Self { files, tensors })
    }

    /// The files, in the order [`TensorEntry::file`] indexes them.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|f| f.path.as_path())
    }

    /// Every tensor by name.
    pub fn tensors(&self) -> &BTreeMap<String, TensorEntry> {
        &self.tensors
    }

    /// A tensor's bytes (from the mapping: touching them reads the file).
    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        let t = self.tensors.get(name)?;
        Some(&self.files[t.file].map[t.range.clone()])
    }

    /// Total tensor bytes.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.range.len() as u64).sum()
    }

    /// Declares in `module` every tensor whose name starts with `prefix`
    /// (empty, or ending in `.`; stripped), as a parameter of the
    /// checkpoint's dtype and shape, in file order (the order a
    /// [`SafetensorsSource`] packs each block in whatever the declaration's,
    /// so its master is a window of the mapping). Numbered children (`transformer_blocks.7`) become module
    /// lists, created in numeric order; an index must be below the number
    /// of tensors declared (a crafted `blocks.1000000000.w` is an error, not
    /// a billion modules). Returns how many tensors were declared.
    pub fn declare(
        &self,
        module: &mut ModuleBuilder<'_>,
        prefix: &str,
    ) -> Result<usize, CheckpointError> {
        if !segment_prefix(prefix) {
            return Err(CheckpointError::Layout {
                name: prefix.to_owned(),
                reason: "a prefix to declare is empty or ends in `.` (it names whole segments)"
                    .into(),
            });
        }
        let mut ordered: Vec<(&String, &TensorEntry)> = self
            .tensors
            .iter()
            .filter(|(n, _)| n.starts_with(prefix) && n.len() > prefix.len())
            .collect();
        ordered.sort_by_key(|(_, t)| (t.file, t.range.start));
        // Every list and its length, so children exist in numeric order
        // before the file's order (10 before 2) adds their tensors.
        let mut lists: BTreeMap<String, usize> = BTreeMap::new();
        for (name, _) in &ordered {
            let segs: Vec<&str> = name[prefix.len()..].split('.').collect();
            if segs.iter().any(|s| s.is_empty()) {
                return Err(CheckpointError::Layout {
                    name: (*name).clone(),
                    reason: "an empty path segment".into(),
                });
            }
            for (i, s) in segs.iter().enumerate().take(segs.len() - 1).skip(1) {
                if let Ok(k) = s.parse::<usize>() {
                    if k >= ordered.len() {
                        return Err(CheckpointError::Layout {
                            name: (*name).clone(),
                            reason: format!(
                                "list index {k} is not below the {} tensors declared",
                                ordered.len()
                            ),
                        });
                    }
                    let list = segs[..i].join(".");
                    let len = lists.entry(list).or_default();
                    *len = (*len).max(k + 1);
                }
            }
        }
        let mut created = BTreeSet::new();
        for (name, t) in &ordered {
            let rel = &name[prefix.len()..];
            let segs: Vec<&str> = rel.split('.').collect();
            for i in 1..segs.len() {
                let list = segs[..i].join(".");
                if let Some(&len) = lists.get(&list)
                    && created.insert(list.clone())
                {
                    module.list(&list, len, |_, _| {});
                }
            }
            module.parameter(rel, t.dtype, &t.shape);
        }
        Ok(ordered.len())
    }
}

/// The header's largest parser accepts (safetensors' own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Refuses a header whose `data_offsets` reach past the file's data bytes,
/// before `safetensors` reads it: its `read_metadata` (0.8) adds the last
/// tensor's end to the header's length unchecked, so offsets summing near
/// 2^64 (eight tensors of 2^61 bytes) overflow there: a panic where
/// overflow is checked (debug builds, `cargo test`); in release the
/// wrapped sum is below the file's length and the header is refused.
/// Anything else malformed is left to `safetensors` to report. Every
/// parser of a safetensors container calls it first (offload-pack's packed
/// and coded-block files too).
pub fn offsets_within(buffer: &[u8]) -> Result<(), String> {
    let Some(prefix) = buffer.first_chunk::<8>() else {
        return Ok(());
    };
    let n = u64::from_le_bytes(*prefix);
    let header = usize::try_from(n)
        .ok()
        .filter(|_| n <= MAX_HEADER_BYTES)
        .and_then(|n| buffer.get(8..8 + n));
    let Some(header) = header else {
        return Ok(());
    };
    let data_bytes = (buffer.len() - 8 - header.len()) as u64;
    // The most lenient reading of the header (any JSON object): whatever
    // `safetensors` accepts, this reads too, with the same entries.
    let Ok(entries) = serde_json::from_slice::<BTreeMap<String, serde_json::Value>>(header) else {
        return Ok(());
    };
    for (name, entry) in &entries {
        let Some(offsets) = entry.get("data_offsets").and_then(|o| o.as_array()) else {
            continue;
        };
        if offsets
            .iter()
            .any(|o| o.as_u64().is_some_and(|o| o > data_bytes))
        {
            return Err(format!(
                "tensor `{name}`: data_offsets {} reach past the {data_bytes} data bytes after the header",
                serde_json::Value::Array(offsets.clone())
            ));
        }
    }
    Ok(())
}

fn dtype(d: safetensors::Dtype) -> Option<DType> {
    use safetensors::Dtype as S;
    Some(match d {
        S::BF16 => DType::Bf16,
        S::F16 => DType::F16,
        S::F32 => DType::F32,
        S::F64 => DType::F64,
        S::F8_E4M3 => DType::F8E4M3,
        S::F8_E5M2 => DType::F8E5M2,
        S::I64 => DType::I64,
        S::I32 => DType::I32,
        S::U8 => DType::U8,
        S::BOOL => DType::Bool,
        _ => return None,
    })
}

/// One rule of a [`NameMap`]: a pipeline path starting with `pipeline` is
/// the checkpoint name `checkpoint` + the rest.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// A prefix of pipeline tensor paths (`transformer.`).
    pub pipeline: String,
    /// What replaces it in the checkpoint's names (often empty).
    pub checkpoint: String,
}

/// How a checkpoint names the pipeline's tensors: prefix rules, the first
/// that matches wins. Data, not code: read it from JSON.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct NameMap {
    /// The rules, in order.
    pub rules: Vec<Rule>,
}

impl NameMap {
    /// One rule: pipeline paths under `pipeline` are checkpoint names under
    /// `checkpoint`.
    pub fn prefix(pipeline: &str, checkpoint: &str) -> Self {
        Self {
            rules: vec![Rule {
                pipeline: pipeline.to_owned(),
                checkpoint: checkpoint.to_owned(),
            }],
        }
    }

    /// Parses `[{"pipeline": "transformer.", "checkpoint": ""}, …]`.
    pub fn from_json(text: &str) -> Result<Self, CheckpointError> {
        let map: Self = serde_json::from_str(text).map_err(|e| {
            CheckpointError::NameMap(format!(
                "{e}; expected a list of {{\"pipeline\": prefix, \"checkpoint\": prefix}}"
            ))
        })?;
        map.validate()?;
        Ok(map)
    }

    /// Every prefix names whole segments: empty, or ending in `.` (a rule
    /// `transformer` would also match `transformer_2.…`).
    pub fn validate(&self) -> Result<(), CheckpointError> {
        for r in &self.rules {
            for (side, p) in [("pipeline", &r.pipeline), ("checkpoint", &r.checkpoint)] {
                if !segment_prefix(p) {
                    return Err(CheckpointError::NameMap(format!(
                        "{side} prefix `{p}` must be empty or end in `.` (it names whole segments)"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The checkpoint name of the pipeline tensor at `path`, if a rule
    /// covers it.
    pub fn checkpoint_name(&self, path: &str) -> Option<String> {
        self.rules.iter().find_map(|r| {
            path.strip_prefix(r.pipeline.as_str())
                .map(|rest| format!("{}{rest}", r.checkpoint))
        })
    }
}

/// Where one storage's bytes are.
#[derive(Clone, Debug)]
struct Bound {
    checkpoint: usize,
    file: usize,
    range: Range<usize>,
    /// The checkpoint tensor's name, for reports.
    name: String,
}

/// A [`WeightSource`] over safetensors checkpoints (see the crate docs).
pub struct SafetensorsSource {
    checkpoints: Vec<Arc<Checkpoint>>,
    /// Per storage: its bytes in a checkpoint, or `None` for a
    /// non-persistent buffer no checkpoint holds (read as zeros).
    storages: Vec<Option<Bound>>,
    /// Per checkpoint: the number of its first file among all the parts'
    /// files (the numbering [`SourcePosition::file`] uses).
    first_file: Vec<u32>,
    /// The block modules of the pipeline's packing (`None` where it does not
    /// resolve: then every unit is treated as a block when reporting).
    blocks: Option<BTreeSet<ModuleId>>,
    in_place: bool,
    windows: AtomicU64,
    copied: AtomicU64,
    copied_bytes: AtomicU64,
    shard_windows: AtomicU64,
    shard_copies: AtomicU64,
    shard_copied_bytes: AtomicU64,
}

impl fmt::Debug for SafetensorsSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SafetensorsSource")
            .field("checkpoints", &self.checkpoints)
            .field("in_place", &self.in_place)
            .finish()
    }
}

impl SafetensorsSource {
    /// Binds every tensor of `pipeline` to a tensor of one of `parts` (a
    /// checkpoint and the name map of the pipeline tensors it holds; the
    /// first part whose map covers a tensor is the one read), checking
    /// names, dtypes and shapes. A non-persistent buffer may be absent (it
    /// reads as zeros); tied tensors share one checkpoint tensor.
    pub fn new(
        pipeline: &Pipeline,
        parts: Vec<(Arc<Checkpoint>, NameMap)>,
    ) -> Result<Self, CheckpointError> {
        for (_, map) in &parts {
            map.validate()?;
        }
        let mut storages: Vec<Option<Bound>> = vec![None; pipeline.storages().count()];
        for (id, t) in pipeline.tensors() {
            let path = pipeline.tensor_path(id);
            let storage = t.storage.index();
            if storages[storage].is_some() {
                continue; // tied: the storage is bound already
            }
            let part = parts
                .iter()
                .enumerate()
                .find_map(|(i, (c, m))| m.checkpoint_name(&path).map(|n| (i, c, n)));
            let Some((ci, ckpt, name)) = part else {
                return Err(CheckpointError::Unmapped {
                    tensor: path,
                    prefixes: parts
                        .iter()
                        .flat_map(|(_, m)| m.rules.iter().map(|r| r.pipeline.clone()))
                        .collect(),
                });
            };
            let Some(entry) = ckpt.tensors.get(&name) else {
                if matches!(t.kind, TensorKind::Buffer { persistent: false }) {
                    continue;
                }
                let tied_elsewhere = pipeline
                    .tensors()
                    .any(|(o, ot)| o != id && ot.storage == t.storage);
                if tied_elsewhere {
                    continue; // another tensor of the storage may name it
                }
                return Err(CheckpointError::Missing {
                    tensor: path,
                    name,
                    files: ckpt.files().map(Path::to_owned).collect(),
                });
            };
            let file = || ckpt.files[entry.file].path.clone();
            if entry.dtype != t.dtype {
                return Err(CheckpointError::DType {
                    tensor: path,
                    name,
                    file: file(),
                    expected: t.dtype,
                    found: entry.dtype,
                });
            }
            if entry.shape != t.shape {
                return Err(CheckpointError::Shape {
                    tensor: path,
                    name,
                    file: file(),
                    expected: t.shape.clone(),
                    found: entry.shape.clone(),
                });
            }
            let storage_bytes = pipeline.storage(t.storage).bytes;
            let span = t.span_bytes();
            if span != (0..storage_bytes) || entry.range.len() as u64 != storage_bytes {
                return Err(CheckpointError::PartialStorage {
                    tensor: path,
                    span,
                    storage_bytes,
                });
            }
            storages[storage] = Some(Bound {
                checkpoint: ci,
                file: entry.file,
                range: entry.range.clone(),
                name,
            });
        }
        // A storage left unbound must be a non-persistent buffer's.
        for (id, t) in pipeline.tensors() {
            if storages[t.storage.index()].is_none()
                && !matches!(t.kind, TensorKind::Buffer { persistent: false })
            {
                let path = pipeline.tensor_path(id);
                let (ckpt, name) = parts
                    .iter()
                    .find_map(|(c, m)| m.checkpoint_name(&path).map(|n| (c, n)))
                    .expect("every tensor was mapped above");
                return Err(CheckpointError::Missing {
                    tensor: path,
                    name,
                    files: ckpt.files().map(Path::to_owned).collect(),
                });
            }
        }
        let first_file = parts
            .iter()
            .scan(0u32, |next, (c, _)| {
                let first = *next;
                *next += c.files.len() as u32;
                Some(first)
            })
            .collect();
        // Which units are blocks, for how loudly a copy is reported; a
        // pipeline that does not resolve fails at `enable` anyway.
        let blocks = offload_core::runtime::packing(pipeline)
            .ok()
            .map(|p| p.blocks.keys().copied().collect());
        Ok(Self {
            checkpoints: parts.into_iter().map(|(c, _)| c).collect(),
            storages,
            first_file,
            blocks,
            in_place: true,
            windows: AtomicU64::new(0),
            copied: AtomicU64::new(0),
            copied_bytes: AtomicU64::new(0),
            shard_windows: AtomicU64::new(0),
            shard_copies: AtomicU64::new(0),
            shard_copied_bytes: AtomicU64::new(0),
        })
    }

    /// Whether blocks that are one window of a file are handed out for
    /// registration in place (default `true`); `false` fills pinned copies
    /// of everything (for comparison, or where registration is unwanted).
    pub fn with_in_place(mut self, in_place: bool) -> Self {
        self.in_place = in_place;
        self
    }

    /// How many units were handed out as windows of a mapping, and how many
    /// were declined (their masters are filled by copying).
    pub fn windows_and_copies(&self) -> (u64, u64) {
        (
            self.windows.load(Ordering::Relaxed),
            self.copied.load(Ordering::Relaxed),
        )
    }

    /// Bytes of the units declined (filled into pinned memory instead).
    pub fn copied_bytes(&self) -> u64 {
        self.copied_bytes.load(Ordering::Relaxed)
    }

    /// How many shards of gathered blocks (distributed layerwise, CONTRACT
    /// §8) were handed out as windows of a mapping, and how many were
    /// declined (copied into pinned memory instead).
    pub fn shard_windows_and_copies(&self) -> (u64, u64) {
        (
            self.shard_windows.load(Ordering::Relaxed),
            self.shard_copies.load(Ordering::Relaxed),
        )
    }

    /// Bytes of the shards declined (their padding included).
    pub fn shard_copied_bytes(&self) -> u64 {
        self.shard_copied_bytes.load(Ordering::Relaxed)
    }

    fn mapped(&self, b: &Bound) -> &Mapped {
        &self.checkpoints[b.checkpoint].files[b.file]
    }

    /// The window of a mapping that holds `unit` exactly as it is packed,
    /// or why not.
    fn window(&self, unit: &Unit) -> Result<MappedWindow, String> {
        let mut bound = Vec::with_capacity(unit.entries.len());
        for e in &unit.entries {
            let b = self.storages[e.storage.index()]
                .as_ref()
                .ok_or_else(|| "it holds a non-persistent buffer no checkpoint holds".to_owned())?;
            bound.push((e, b));
        }
        let &(first_entry, first) = bound.first().ok_or_else(|| "no tensors".to_owned())?;
        if let Some((_, b)) = bound
            .iter()
            .find(|(_, b)| (b.checkpoint, b.file) != (first.checkpoint, first.file))
        {
            return Err(format!(
                "its tensors lie in two files ({} and {})",
                self.mapped(first).path.display(),
                self.mapped(b).path.display()
            ));
        }
        let path = self.mapped(first).path.display();
        let mut in_file: Vec<&Bound> = bound.iter().map(|(_, b)| *b).collect();
        in_file.sort_by_key(|b| b.range.start);
        for pair in in_file.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if b.range.start < a.range.end {
                return Err(format!(
                    "`{}` and `{}` overlap in {path} (one checkpoint tensor bound to two storages)",
                    a.name, b.name
                ));
            }
            if b.range.start > a.range.end {
                return Err(format!(
                    "its tensors are not back to back in {path}: {} bytes of other tensors lie between `{}` and `{}`",
                    b.range.start - a.range.end,
                    a.name,
                    b.name
                ));
            }
        }
        // Back to back in the file; packed in the file's order too? (The
        // strategy packs in another only where the file's would misalign a
        // tensor.) `base` is the file offset of packing offset 0.
        let base = (first.range.start as u64)
            .checked_sub(first_entry.offset)
            .ok_or_else(|| "it is packed in another order than the file's".to_owned())?;
        if bound
            .iter()
            .any(|(e, b)| b.range.start as u64 != base + e.offset)
        {
            return Err(
                "its tensors lie back to back in the file, but it is packed in another order (as where the file's would misalign a tensor)"
                    .to_owned(),
            );
        }
        let start = base as usize;
        let range = start..start + unit.bytes as usize;
        let map = Arc::clone(&self.mapped(first).map);
        MappedWindow::new(map, range)
            .ok_or_else(|| "its window runs past the end of the file".to_owned())
    }
}

impl SafetensorsSource {
    /// The window of a mapping that holds bytes `range` of `unit`'s
    /// packing (one rank's shard), or why not: the unit's bytes in `range`
    /// must lie in one file exactly as packed (back to back, in the
    /// packing's order); the part of `range` past the unit (the last
    /// rank's padding) is whatever follows it in that file, which must
    /// still hold it.
    fn shard_window(&self, unit: &Unit, range: Range<u64>) -> Result<MappedWindow, String> {
        let data_end = range.end.min(unit.bytes);
        if range.start >= data_end {
            return Err("it holds none of the block's bytes (all padding)".to_owned());
        }
        let mut over = Vec::new();
        for e in unit
            .entries
            .iter()
            .filter(|e| e.offset < data_end && e.offset + e.bytes > range.start)
        {
            let b = self
                .storages
                .get(e.storage.index())
                .and_then(Option::as_ref)
                .ok_or_else(|| "it holds a non-persistent buffer no checkpoint holds".to_owned())?;
            over.push((e, b));
        }
        over.sort_by_key(|(e, _)| e.offset);
        let &(first_entry, first) = over
            .first()
            .ok_or_else(|| "no tensors lie in it".to_owned())?;
        if let Some((_, b)) = over
            .iter()
            .find(|(_, b)| (b.checkpoint, b.file) != (first.checkpoint, first.file))
        {
            return Err(format!(
                "a file boundary splits it: its tensors lie in {} and {}",
                self.mapped(first).path.display(),
                self.mapped(b).path.display()
            ));
        }
        let path = self.mapped(first).path.display();
        if first_entry.offset > range.start {
            return Err("it begins between two tensors of the packing".to_owned());
        }
        let last = over.last().map_or(0, |(e, _)| e.offset + e.bytes);
        if last < data_end
            || over
                .windows(2)
                .any(|p| p[0].0.offset + p[0].0.bytes != p[1].0.offset)
        {
            return Err("the packing leaves a gap between its tensors".to_owned());
        }
        // File offset of packing offset 0 (of this file's part of the unit).
        let base = first.range.start as i128 - i128::from(first_entry.offset);
        if let Some((_, b)) = over
            .iter()
            .find(|(e, b)| b.range.start as i128 != base + i128::from(e.offset))
        {
            return Err(format!(
                "its tensors are not back to back in {path} in the packing's order (`{}` lies elsewhere)",
                b.name
            ));
        }
        let start = usize::try_from(base + i128::from(range.start))
            .map_err(|_| "its window starts outside the file".to_owned())?;
        let len = usize::try_from(range.end - range.start)
            .map_err(|_| "its window is larger than the address space".to_owned())?;
        let end = start
            .checked_add(len)
            .ok_or_else(|| "its window runs past the end of the address space".to_owned())?;
        let map = Arc::clone(&self.mapped(first).map);
        MappedWindow::new(map, start..end).ok_or_else(|| {
            if range.end > unit.bytes {
                format!(
                    "its {} bytes of padding would run past the end of {path}",
                    range.end - unit.bytes
                )
            } else {
                format!("its window runs past the end of {path}")
            }
        })
    }
}

impl WeightSource for SafetensorsSource {
    fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        match &self.storages[storage.index()] {
            Some(b) => {
                let src = &self.mapped(b).map[b.range.clone()];
                let p = position as usize;
                // Into a staging buffer or a pinned master, which only the
                // copy engine reads: streaming stores.
                offload_core::copy::copy_streaming(dst, &src[p..p + dst.len()]);
            }
            None => dst.fill(0),
        }
    }

    /// The storage's file (numbered across every part's files, in order)
    /// and the offset of its bytes there: every strategy packs a unit in
    /// this order, so a block back to back in its file is one window of it.
    fn position(&self, storage: StorageId) -> Option<SourcePosition> {
        let b = self.storages[storage.index()].as_ref()?;
        Some(SourcePosition {
            file: self.first_file[b.checkpoint] + b.file as u32,
            offset: b.range.start as u64,
        })
    }

    fn take_region(&self, unit: &Unit) -> Option<Box<dyn HostRegion>> {
        if !self.in_place {
            self.copied.fetch_add(1, Ordering::Relaxed);
            self.copied_bytes.fetch_add(unit.bytes, Ordering::Relaxed);
            return None;
        }
        match self.window(unit) {
            Ok(w) => {
                self.windows.fetch_add(1, Ordering::Relaxed);
                Some(Box::new(w))
            }
            Err(why) => {
                self.copied.fetch_add(1, Ordering::Relaxed);
                self.copied_bytes.fetch_add(unit.bytes, Ordering::Relaxed);
                let size = offload_core::bytes::ByteSize::new(unit.bytes);
                if self
                    .blocks
                    .as_ref()
                    .is_none_or(|b| b.contains(&unit.module))
                {
                    tracing::warn!(
                        unit = %unit.name,
                        bytes = unit.bytes,
                        "block `{}` ({size}) is not one window of the checkpoint: {why}; its host master is a copy in pinned memory",
                        unit.name
                    );
                } else {
                    tracing::info!(
                        unit = %unit.name,
                        bytes = unit.bytes,
                        "`{}` ({size}, outside the blocks) is not one window of the checkpoint: {why}; it is copied through pinned memory",
                        unit.name
                    );
                }
                None
            }
        }
    }

    /// The unit's window of its file's mapping, for the device to read in
    /// place (`staged_reads = "in_place"`, CONTRACT §7c): the same window
    /// [`WeightSource::take_region`] registers, never registered here.
    fn pageable_window(&self, unit: &Unit) -> Option<Arc<dyn HostRegion>> {
        match self.window(unit) {
            Ok(w) => Some(Arc::new(w)),
            Err(why) => {
                tracing::debug!(unit = %unit.name, "`{}` is not one window of the checkpoint ({why}): it cannot be read in place", unit.name);
                None
            }
        }
    }

    /// One rank's shard of a gathered block (CONTRACT §8) as a window of
    /// its file's mapping, registered in place (the backend registers each
    /// file's mapping once, read-only, for all its windows, as for whole
    /// blocks): wherever the shard's bytes lie in one file as packed,
    /// whether or not the whole block does. Declined (a pinned copy, with a
    /// warning naming the block, the shard's bytes and why) where a file
    /// boundary splits the shard or its padding would run past a file's
    /// end.
    fn take_shard_region(&self, unit: &Unit, range: Range<u64>) -> Option<Box<dyn HostRegion>> {
        let bytes = range.end.saturating_sub(range.start);
        let decline = || {
            self.shard_copies.fetch_add(1, Ordering::Relaxed);
            self.shard_copied_bytes.fetch_add(bytes, Ordering::Relaxed);
        };
        if !self.in_place {
            decline();
            return None;
        }
        match self.shard_window(unit, range.clone()) {
            Ok(w) => {
                self.shard_windows.fetch_add(1, Ordering::Relaxed);
                Some(Box::new(w))
            }
            Err(why) => {
                decline();
                tracing::warn!(
                    unit = %unit.name,
                    bytes,
                    "this rank's shard of block `{}` (bytes {}..{} of {}) is not one window of the checkpoint: {why}; its host master is a copy in pinned memory",
                    unit.name,
                    range.start,
                    range.end,
                    unit.bytes
                );
                None
            }
        }
    }

    /// A positional read of the file (`pread`): nothing is mapped in, so a
    /// staged block whose pages are released after each read never faults
    /// its pages in. A short or failed read falls back to the mapping.
    fn read_direct(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        use std::os::unix::fs::FileExt;
        if let Some(b) = &self.storages[storage.index()] {
            let m = self.mapped(b);
            let at = b.range.start as u64 + position;
            if m.file.read_exact_at(dst, at).is_ok() {
                return;
            }
        }
        self.read(storage, position, dst);
    }

    /// Reads a staged unit's pages ahead (`madvise(MADV_WILLNEED)`).
    fn prefetch(&self, unit: &Unit) {
        for (map, range) in self.ranges_of(unit) {
            // Advice only: a refusal changes nothing but speed.
            let _ = map.advise_range(memmap2::Advice::WillNeed, range.start, range.len());
        }
    }

    /// Drops a staged unit's pages from this process once they were read
    /// into a staging buffer (`madvise(MADV_DONTNEED)`), so that a mapped
    /// checkpoint larger than the host budget never stays resident.
    fn release(&self, unit: &Unit) {
        for (map, range) in self.ranges_of(unit) {
            // SAFETY: the mapping is read-only and file-backed (`Mmap`), so
            // dropping its pages loses nothing: a later read faults the
            // same bytes in again from the page cache or the file. Pages a
            // registration pinned stay pinned (the driver holds them).
            let _ = unsafe {
                map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    range.start,
                    range.len(),
                )
            };
        }
    }

    fn wants_restore(&self) -> bool {
        false // the file still holds every byte
    }
}

impl SafetensorsSource {
    /// The mapped byte ranges `unit`'s storages lie in.
    fn ranges_of(&self, unit: &Unit) -> Vec<(&Mmap, Range<usize>)> {
        unit.entries
            .iter()
            .filter_map(|e| self.storages.get(e.storage.index())?.as_ref())
            .map(|b| (&*self.mapped(b).map, b.range.clone()))
            .filter(|(_, r)| !r.is_empty())
            .collect()
    }
}

/// A window of a read-only file mapping, holding the mapping alive: a host
/// region registered in place (the whole mapping its enclosing memory).
/// `offload-pack` serves its packed windows with it too.
pub struct MappedWindow {
    map: Arc<Mmap>,
    range: Range<usize>,
}

impl MappedWindow {
    /// `range` of `map`, or `None` where it runs past the mapping's end.
    pub fn new(map: Arc<Mmap>, range: Range<usize>) -> Option<Self> {
        (range.start <= range.end && range.end <= map.len()).then_some(Self { map, range })
    }
}

// SAFETY: the mapping is read-only, never remapped or unmapped while an
// `Arc` to it lives, so `bytes` and `enclosing` return the same slices on
// every call and nothing writes them through this process (the mapped file
// must not be rewritten while mapped, as `Checkpoint` and offload-pack's
// `PackedCheckpoint` document).
unsafe impl HostRegion for MappedWindow {
    fn bytes(&self) -> &[u8] {
        &self.map[self.range.clone()]
    }

    fn enclosing(&self) -> Option<&[u8]> {
        Some(&self.map[..])
    }

    fn read_only(&self) -> bool {
        true
    }
}

/// Writes `tensors` (name, dtype, shape, bytes) as one `.safetensors` file
/// at `path`: for tests and tools that make checkpoints.
pub fn write_file(
    path: &Path,
    tensors: &[(String, DType, Vec<u64>, Vec<u8>)],
) -> Result<(), CheckpointError> {
    let views = tensors
        .iter()
        .map(|(n, d, s, b)| {
            let dt = match d {
                DType::Bf16 => safetensors::Dtype::BF16,
                DType::F16 => safetensors::Dtype::F16,
                DType::F32 => safetensors::Dtype::F32,
                DType::F64 => safetensors::Dtype::F64,
                DType::F8E4M3 => safetensors::Dtype::F8_E4M3,
                DType::F8E5M2 => safetensors::Dtype::F8_E5M2,
                DType::I64 => safetensors::Dtype::I64,
                DType::I32 => safetensors::Dtype::I32,
                DType::U8 => safetensors::Dtype::U8,
                DType::Bool => safetensors::Dtype::BOOL,
            };
            let shape: Vec<usize> = s.iter().map(|&d| d as usize).collect();
            safetensors::tensor::TensorView::new(dt, shape, b)
                .map(|v| (n.clone(), v))
                .map_err(|e| CheckpointError::Header {
                    path: path.to_owned(),
                    reason: format!("tensor `{n}`: {e}"),
                })
        })
        .collect::<Result<HashMap<_, _>, _>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| CheckpointError::Header {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}
