//! Packed checkpoints: a safetensors container of blobs (one `U8` tensor
//! per checkpoint tensor, the codes' figures in its metadata), the writer
//! that packs a safetensors checkpoint into one, the in-memory fallback, and
//! the loader that maps one and hands out each tensor's packed window.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use memmap2::Mmap;
use offload_core::device::HostRegion;
use offload_core::model::DType;
use offload_safetensors::MappedWindow;
use offload_safetensors::{Checkpoint, CheckpointError};
use serde::{Deserialize, Serialize};

use crate::format::{
    Code, DecodeError, EncodeConfig, EncodeError, Encoded, Packed, Stats, encode_bf16_as,
    encode_raw, plan_bf16,
};

/// The key of the safetensors `__metadata__` entry that holds a packed
/// checkpoint's description (a JSON string, [`Manifest`]).
pub const MANIFEST_KEY: &str = "offload_pack";
/// The `format` field of the manifest.
pub const FORMAT_NAME: &str = "offload-pack";
/// The data section of a packed file starts on this boundary (a page), and
/// every blob on a 64-byte one.
pub const FILE_ALIGN: u64 = 4096;
/// The page size the windows' page figures use.
pub const PAGE_BYTES: u64 = 4096;
/// The extension of a packed checkpoint written beside a safetensors one.
pub const EXTENSION: &str = "opack";

/// What went wrong packing, opening or reading a packed checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// A file could not be opened, read, written or mapped.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The safetensors checkpoint to pack could not be opened.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A tensor could not be encoded (or its round trip failed).
    #[error("tensor `{tensor}`: {source}")]
    Encode {
        /// The tensor.
        tensor: String,
        /// Why.
        source: EncodeError,
    },
    /// A packed file that is not a valid safetensors container.
    #[error("{}: not a valid packed checkpoint container: {reason}", path.display())]
    Container {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A blob that does not decode, or disagrees with the manifest.
    #[error("{}: tensor `{tensor}`: {source}", path.display())]
    Blob {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Why.
        source: DecodeError,
    },
    /// The manifest and the blobs disagree.
    #[error("{}: tensor `{tensor}`: {reason}", path.display())]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What disagrees.
        reason: String,
    },
    /// A tensor name the checkpoint does not hold.
    #[error("no tensor `{name}` in the packed checkpoint{}", nearest.as_ref().map(|n| format!(" (nearest: `{n}`)")).unwrap_or_default())]
    UnknownTensor {
        /// The name asked for.
        name: String,
        /// The nearest name held.
        nearest: Option<String>,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PackError + '_ {
    move |source| PackError::Io {
        path: path.to_owned(),
        source,
    }
}

/// One tensor of a packed checkpoint, as the manifest describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestTensor {
    /// The original dtype.
    pub dtype: DType,
    /// The original shape.
    pub shape: Vec<u64>,
    /// The code and its figures.
    #[serde(flatten)]
    pub stats: Stats,
}

/// The description a packed checkpoint carries in its safetensors metadata
/// under [`MANIFEST_KEY`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`FORMAT_NAME`].
    pub format: String,
    /// The blob format's version ([`crate::format::VERSION`]).
    pub version: u16,
    /// Weights per tile ([`crate::format::TILE_ELEMS`]).
    pub tile_elems: u64,
    /// Every tensor by name.
    pub tensors: BTreeMap<String, ManifestTensor>,
}

/// One tensor to pack: its name, dtype, shape and bytes.
#[derive(Clone, Copy, Debug)]
pub struct TensorIn<'a> {
    /// Its name.
    pub name: &'a str,
    /// Its dtype (only bf16 is coded; other dtypes travel raw).
    pub dtype: DType,
    /// Its shape.
    pub shape: &'a [u64],
    /// Its bytes (little-endian).
    pub bytes: &'a [u8],
}

/// The code for one tensor and its blob's exact figures, before encoding.
pub fn plan_tensor(t: &TensorIn<'_>, cfg: &EncodeConfig) -> Result<Stats, PackError> {
    if t.dtype == DType::Bf16 {
        plan_bf16(t.bytes, cfg).map_err(|source| PackError::Encode {
            tensor: t.name.to_owned(),
            source,
        })
    } else {
        Ok(Stats {
            code: Code::Raw,
            decoded_bytes: t.bytes.len() as u64,
            packed_bytes: crate::format::Layout::raw_bytes(t.bytes.len() as u64),
            escapes: 0,
        })
    }
}

/// Encodes one tensor with `code` (round trip checked unless `cfg.verify`
/// is off); only bf16 tensors may be window-coded.
pub fn encode_tensor(
    t: &TensorIn<'_>,
    code: Code,
    cfg: &EncodeConfig,
) -> Result<Encoded, PackError> {
    if t.dtype == DType::Bf16 {
        encode_bf16_as(t.bytes, code, cfg).map_err(|source| PackError::Encode {
            tensor: t.name.to_owned(),
            source,
        })
    } else if code == Code::Raw {
        Ok(encode_raw(t.bytes))
    } else {
        Err(PackError::Mismatch {
            path: PathBuf::new(),
            tensor: t.name.to_owned(),
            reason: format!("a {:?} tensor cannot be window-coded (bf16 only)", t.dtype),
        })
    }
}

/// One packed tensor held in memory.
#[derive(Clone, Debug)]
pub struct PackedTensorMem {
    /// Its name.
    pub name: String,
    /// The original dtype.
    pub dtype: DType,
    /// The original shape.
    pub shape: Vec<u64>,
    /// Its blob and figures.
    pub encoded: Encoded,
}

/// Tensors packed in memory ([`encode_in_memory`]).
#[derive(Clone, Debug, Default)]
pub struct PackedModel {
    /// The tensors, in the order given.
    pub tensors: Vec<PackedTensorMem>,
}

impl PackedModel {
    /// Bytes of the tensors as given.
    pub fn decoded_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.encoded.stats.decoded_bytes)
            .sum()
    }

    /// Bytes of the blobs.
    pub fn packed_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.encoded.stats.packed_bytes)
            .sum()
    }
}

/// The fallback when no packed checkpoint exists: encodes `tensors` in
/// memory with all of `cfg`'s threads (tiles of each tensor spread over
/// them), every round trip checked, and says so at `info` (with the bytes,
/// the ratio, the time, and how to avoid it next time).
pub fn encode_in_memory(
    tensors: &[TensorIn<'_>],
    cfg: &EncodeConfig,
) -> Result<PackedModel, PackError> {
    let start = Instant::now();
    let threads = cfg.threads();
    let decoded: u64 = tensors.iter().map(|t| t.bytes.len() as u64).sum();
    tracing::info!(
        tensors = tensors.len(),
        bytes = decoded,
        threads,
        "no packed checkpoint: encoding {} tensors ({decoded} bytes) in memory at enable with {threads} threads (`offload-pack` writes a packed checkpoint once instead)",
        tensors.len()
    );
    let mut out = PackedModel::default();
    for t in tensors {
        let planned = plan_tensor(t, cfg)?;
        let encoded = encode_tensor(t, planned.code, cfg)?;
        out.tensors.push(PackedTensorMem {
            name: t.name.to_owned(),
            dtype: t.dtype,
            shape: t.shape.to_vec(),
            encoded,
        });
    }
    let secs = start.elapsed().as_secs_f64();
    let packed = out.packed_bytes();
    tracing::info!(
        bytes = decoded,
        packed_bytes = packed,
        seconds = secs,
        "encoded in memory: {packed} of {decoded} bytes ({:.4}), round trips checked, in {secs:.2} s ({:.2} GB/s)",
        packed as f64 / decoded.max(1) as f64,
        decoded as f64 / secs.max(1e-9) / 1e9
    );
    Ok(out)
}

/// One tensor of a [`PackReport`].
#[derive(Clone, Debug, Serialize)]
pub struct TensorReport {
    /// Its name.
    pub name: String,
    /// Its dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<u64>,
    /// The code and its figures.
    pub stats: Stats,
}

/// What packing a checkpoint did.
#[derive(Clone, Debug, Serialize)]
pub struct PackReport {
    /// The file written.
    pub output: PathBuf,
    /// Every tensor, in file order.
    pub tensors: Vec<TensorReport>,
    /// Bytes of the checkpoint's tensors.
    pub decoded_bytes: u64,
    /// Bytes of the blobs.
    pub packed_bytes: u64,
    /// Bytes of the packed file (header and alignment included).
    pub file_bytes: u64,
    /// Seconds, planning, encoding, checking and writing.
    pub seconds: f64,
    /// Threads used.
    pub threads: usize,
}

/// Writes a packed checkpoint at `path` from `entries` (name, dtype, shape,
/// the code's figures, blob length exact), calling `blob(i)` for each blob
/// in order, so only one blob is in memory at a time. Returns the file's
/// length.
pub fn write_packed(
    path: &Path,
    entries: &[(String, DType, Vec<u64>, Stats)],
    mut blob: impl FnMut(usize) -> Result<Vec<u8>, PackError>,
) -> Result<u64, PackError> {
    let manifest = Manifest {
        format: FORMAT_NAME.into(),
        version: crate::format::VERSION,
        tile_elems: crate::format::TILE_ELEMS as u64,
        tensors: entries
            .iter()
            .map(|(n, d, s, st)| {
                (
                    n.clone(),
                    ManifestTensor {
                        dtype: *d,
                        shape: s.clone(),
                        stats: *st,
                    },
                )
            })
            .collect(),
    };
    if manifest.tensors.len() != entries.len() {
        return Err(PackError::Container {
            path: path.to_owned(),
            reason: "two tensors of one name".into(),
        });
    }
    let mut header = serde_json::Map::new();
    let manifest_json = serde_json::to_string(&manifest).expect("a manifest serialises");
    header.insert(
        "__metadata__".into(),
        serde_json::json!({ MANIFEST_KEY: manifest_json }),
    );
    let mut at = 0u64;
    for (name, _, _, st) in entries {
        header.insert(
            name.clone(),
            serde_json::json!({
                "dtype": "U8",
                "shape": [st.packed_bytes],
                "data_offsets": [at, at + st.packed_bytes],
            }),
        );
        at += st.packed_bytes;
    }
    let mut text = serde_json::to_string(&header).expect("a header serialises");
    // Pad with spaces (allowed by safetensors) so the data starts on a page.
    let data_start = (8 + text.len() as u64).div_ceil(FILE_ALIGN) * FILE_ALIGN;
    text.extend(std::iter::repeat_n(
        ' ',
        (data_start - 8) as usize - text.len(),
    ));
    let file = File::create(path).map_err(io(path))?;
    let mut w = BufWriter::with_capacity(8 << 20, file);
    w.write_all(&(text.len() as u64).to_le_bytes())
        .map_err(io(path))?;
    w.write_all(text.as_bytes()).map_err(io(path))?;
    for (i, (name, _, _, st)) in entries.iter().enumerate() {
        let b = blob(i)?;
        if b.len() as u64 != st.packed_bytes {
            return Err(PackError::Mismatch {
                path: path.to_owned(),
                tensor: name.clone(),
                reason: format!(
                    "planned {} packed bytes, encoded {}",
                    st.packed_bytes,
                    b.len()
                ),
            });
        }
        w.write_all(&b).map_err(io(path))?;
    }
    w.flush().map_err(io(path))?;
    Ok(data_start + at)
}

/// Writes the tensors of a [`PackedModel`] as a packed checkpoint.
pub fn write_model(path: &Path, model: &PackedModel) -> Result<u64, PackError> {
    let entries: Vec<_> = model
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.encoded.stats))
        .collect();
    write_packed(path, &entries, |i| {
        Ok(model.tensors[i].encoded.blob.clone())
    })
}

/// The packed file written beside `input` (a `.safetensors` file, a shard
/// index, or a checkpoint directory): `<stem>.opack` next to it.
pub fn default_output(input: &Path) -> PathBuf {
    if input.is_dir() {
        return input.join(format!("diffusion_pytorch_model.{EXTENSION}"));
    }
    let name = input
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name
        .strip_suffix(".safetensors.index.json")
        .or_else(|| name.strip_suffix(".safetensors"))
        .unwrap_or(&name);
    input.with_file_name(format!("{stem}.{EXTENSION}"))
}

/// Packs the safetensors checkpoint at `input` (as [`Checkpoint::open`]
/// takes it) into one packed file at `output`: a first pass plans each
/// tensor's code and exact length from its exponent histogram, the second
/// encodes, checks each round trip and writes, one tensor in memory at a
/// time, tiles spread over `cfg`'s threads. Tensors keep the checkpoint's
/// file order, so a block back to back in the checkpoint is back to back in
/// the packed file.
pub fn pack_checkpoint(
    input: &Path,
    output: &Path,
    cfg: &EncodeConfig,
) -> Result<PackReport, PackError> {
    let start = Instant::now();
    let ckpt = Checkpoint::open(input)?;
    let mut names: Vec<(&String, &offload_safetensors::TensorEntry)> =
        ckpt.tensors().iter().collect();
    names.sort_by_key(|(_, t)| (t.file, t.range.start));
    let mut entries = Vec::with_capacity(names.len());
    for (name, e) in &names {
        let bytes = ckpt
            .bytes(name)
            .expect("a tensor of the checkpoint has bytes");
        let t = TensorIn {
            name,
            dtype: e.dtype,
            shape: &e.shape,
            bytes,
        };
        entries.push((
            (*name).clone(),
            e.dtype,
            e.shape.clone(),
            plan_tensor(&t, cfg)?,
        ));
    }
    let tmp = output.with_extension(format!("{EXTENSION}.partial"));
    let written = write_packed(&tmp, &entries, |i| {
        let (name, dtype, shape, st) = &entries[i];
        let t = TensorIn {
            name,
            dtype: *dtype,
            shape,
            bytes: ckpt
                .bytes(name)
                .expect("a tensor of the checkpoint has bytes"),
        };
        let enc = encode_tensor(&t, st.code, cfg)?;
        if enc.stats != *st {
            return Err(PackError::Mismatch {
                path: output.to_owned(),
                tensor: name.clone(),
                reason: format!("planned {st:?}, encoded {:?}", enc.stats),
            });
        }
        Ok(enc.blob)
    })
    .and_then(|b| {
        std::fs::rename(&tmp, output).map_err(io(output))?;
        Ok(b)
    });
    let file_bytes = match written {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    let decoded_bytes = entries.iter().map(|e| e.3.decoded_bytes).sum();
    let packed_bytes = entries.iter().map(|e| e.3.packed_bytes).sum();
    Ok(PackReport {
        output: output.to_owned(),
        tensors: entries
            .into_iter()
            .map(|(name, dtype, shape, stats)| TensorReport {
                name,
                dtype,
                shape,
                stats,
            })
            .collect(),
        decoded_bytes,
        packed_bytes,
        file_bytes,
        seconds: start.elapsed().as_secs_f64(),
        threads: cfg.threads(),
    })
}

/// One tensor of a [`PackedCheckpoint`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedEntry {
    /// Its manifest entry (dtype, shape, code, figures).
    pub manifest: ManifestTensor,
    /// Its blob's bytes within the file.
    pub range: Range<usize>,
}

/// Where a tensor's (or a run of tensors') packed bytes lie in the mapped
/// file, for registering the packed master in place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedWindow {
    /// Offset in the file (a multiple of 64).
    pub offset: u64,
    /// Length (a multiple of 64).
    pub len: u64,
    /// `offset % PAGE_BYTES`: 0 where the window starts on a page.
    pub page_offset: u64,
    /// The window rounded out to whole pages (`PAGE_BYTES`), within the
    /// file's length.
    pub pages: Range<u64>,
}

/// A packed checkpoint, memory-mapped read-only (nothing is read until a
/// page is touched), its manifest and every blob's header checked at open.
pub struct PackedCheckpoint {
    path: PathBuf,
    map: Arc<Mmap>,
    tensors: BTreeMap<String, PackedEntry>,
}

impl std::fmt::Debug for PackedCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedCheckpoint")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl PackedCheckpoint {
    /// Maps the packed file at `path` and checks it: a safetensors
    /// container whose tensors are exactly the manifest's, each a `U8`
    /// vector whose blob parses, agrees with the manifest (code, decoded
    /// bytes, escapes, length) and has an escape index in order. Typed
    /// errors, never a panic, for any file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, PackError> {
        let this = Self::open_unchecked(path.as_ref())?;
        for (name, e) in &this.tensors {
            let blob = &this.map[e.range.clone()];
            let p = Packed::parse(blob).map_err(|source| PackError::Blob {
                path: this.path.clone(),
                tensor: name.clone(),
                source,
            })?;
            let m = &e.manifest;
            let expect_bytes = m
                .shape
                .iter()
                .try_fold(m.dtype.size_bytes(), |a, &d| a.checked_mul(d));
            let mismatch = |reason: String| PackError::Mismatch {
                path: this.path.clone(),
                tensor: name.clone(),
                reason,
            };
            if expect_bytes != Some(m.stats.decoded_bytes) {
                return Err(mismatch(format!(
                    "the manifest's {:?} {:?} is {expect_bytes:?} bytes, its decoded bytes {}",
                    m.dtype, m.shape, m.stats.decoded_bytes
                )));
            }
            let h = p.header();
            if h.code != m.stats.code
                || h.decoded_bytes != m.stats.decoded_bytes
                || p.total_bytes() != m.stats.packed_bytes
                || u64::from(p.escapes()) != m.stats.escapes
            {
                return Err(mismatch(format!(
                    "the blob says {} with {} decoded bytes, {} packed, {} escapes; the manifest {} with {}, {}, {}",
                    h.code.label(),
                    h.decoded_bytes,
                    p.total_bytes(),
                    p.escapes(),
                    m.stats.code.label(),
                    m.stats.decoded_bytes,
                    m.stats.packed_bytes,
                    m.stats.escapes
                )));
            }
            if matches!(m.stats.code, Code::Window3 { .. }) && m.dtype != DType::Bf16 {
                return Err(mismatch(format!(
                    "a {:?} tensor window-coded (bf16 only)",
                    m.dtype
                )));
            }
            if let Some(tile) = p.escape_index_disorder() {
                return Err(PackError::Blob {
                    path: this.path.clone(),
                    tensor: name.clone(),
                    source: DecodeError::BadHeader {
                        field: "escape index (in order)",
                        expected: u64::from(tile),
                        found: u64::from(tile) + 1,
                    },
                });
            }
        }
        Ok(this)
    }

    /// Maps and reads the container and the manifest only.
    fn open_unchecked(path: &Path) -> Result<Self, PackError> {
        let file = File::open(path).map_err(io(path))?;
        // SAFETY: a read-only shared mapping; as every mmap-based checkpoint
        // loader, this relies on the file not being truncated or rewritten
        // while it is mapped (documented on `PackedCheckpoint`).
        let map = unsafe { Mmap::map(&file) }.map_err(io(path))?;
        let bad = |reason: String| PackError::Container {
            path: path.to_owned(),
            reason,
        };
        // Offsets past the data refused first: `read_metadata` would add
        // them unchecked (an overflow panic in debug builds).
        offload_safetensors::offsets_within(&map).map_err(bad)?;
        let (n, meta) =
            safetensors::SafeTensors::read_metadata(&map).map_err(|e| bad(e.to_string()))?;
        let data_start = 8 + n;
        let text = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(MANIFEST_KEY))
            .ok_or_else(|| {
                bad(format!(
                    "no `{MANIFEST_KEY}` entry in its metadata (a plain safetensors file? pack it with `offload-pack`)"
                ))
            })?;
        let manifest: Manifest =
            serde_json::from_str(text).map_err(|e| bad(format!("manifest: {e}")))?;
        if manifest.format != FORMAT_NAME
            || manifest.version != crate::format::VERSION
            || manifest.tile_elems != crate::format::TILE_ELEMS as u64
        {
            return Err(bad(format!(
                "manifest of format `{}` version {} with {}-weight tiles; this reader takes `{FORMAT_NAME}` version {} with {}",
                manifest.format,
                manifest.version,
                manifest.tile_elems,
                crate::format::VERSION,
                crate::format::TILE_ELEMS
            )));
        }
        let mut tensors = BTreeMap::new();
        for (name, info) in meta.tensors() {
            let m = manifest
                .tensors
                .get(&name)
                .ok_or_else(|| bad(format!("tensor `{name}` is not in the manifest")))?;
            if info.dtype != safetensors::Dtype::U8 || info.shape.len() != 1 {
                return Err(bad(format!(
                    "tensor `{name}` is {:?} {:?}, a blob is a U8 vector",
                    info.dtype, info.shape
                )));
            }
            let range = data_start + info.data_offsets.0..data_start + info.data_offsets.1;
            if range.start % crate::format::ALIGN != 0 {
                return Err(bad(format!(
                    "tensor `{name}` starts at byte {}, not on a {}-byte boundary",
                    range.start,
                    crate::format::ALIGN
                )));
            }
            tensors.insert(
                name,
                PackedEntry {
                    manifest: m.clone(),
                    range,
                },
            );
        }
        if let Some(missing) = manifest.tensors.keys().find(|k| !tensors.contains_key(*k)) {
            return Err(bad(format!(
                "the manifest names `{missing}`, the container does not hold it"
            )));
        }
        Ok(Self {
            path: path.to_owned(),
            map: Arc::new(map),
            tensors,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every tensor by name.
    pub fn tensors(&self) -> &BTreeMap<String, PackedEntry> {
        &self.tensors
    }

    /// The whole mapping (what a backend registers once for all windows).
    pub fn mapping(&self) -> &[u8] {
        &self.map[..]
    }

    fn entry(&self, name: &str) -> Result<&PackedEntry, PackError> {
        self.tensors
            .get(name)
            .ok_or_else(|| PackError::UnknownTensor {
                name: name.to_owned(),
                nearest: self
                    .tensors
                    .keys()
                    .max_by_key(|k| common_prefix(k, name))
                    .cloned(),
            })
    }

    /// A tensor's blob (from the mapping).
    pub fn blob(&self, name: &str) -> Result<&[u8], PackError> {
        Ok(&self.map[self.entry(name)?.range.clone()])
    }

    /// A tensor's packed window in the file.
    pub fn window(&self, name: &str) -> Result<PackedWindow, PackError> {
        let r = self.entry(name)?.range.clone();
        Ok(self.window_of(r))
    }

    fn window_of(&self, r: Range<usize>) -> PackedWindow {
        let (start, end) = (r.start as u64, r.end as u64);
        let file = self.map.len() as u64;
        PackedWindow {
            offset: start,
            len: end - start,
            page_offset: start % PAGE_BYTES,
            pages: start / PAGE_BYTES * PAGE_BYTES
                ..(end.div_ceil(PAGE_BYTES) * PAGE_BYTES).min(file),
        }
    }

    /// The window holding `names` back to back (a block's tensors), in
    /// whatever order they are named, or why not (a tensor missing, or
    /// others between them).
    pub fn span(&self, names: &[&str]) -> Result<PackedWindow, PackError> {
        let mut ranges = names
            .iter()
            .map(|n| Ok((*n, self.entry(n)?.range.clone())))
            .collect::<Result<Vec<_>, PackError>>()?;
        ranges.sort_by_key(|(_, r)| r.start);
        for pair in ranges.windows(2) {
            if pair[0].1.end != pair[1].1.start {
                return Err(PackError::Mismatch {
                    path: self.path.clone(),
                    tensor: pair[1].0.to_owned(),
                    reason: format!(
                        "not back to back with `{}`: {} bytes lie between them",
                        pair[0].0,
                        pair[1].1.start.abs_diff(pair[0].1.end)
                    ),
                });
            }
        }
        let r = match (ranges.first(), ranges.last()) {
            (Some(a), Some(z)) => a.1.start..z.1.end,
            _ => 0..0,
        };
        Ok(self.window_of(r))
    }

    /// A host region over `window` of the mapping, registered in place the
    /// way `offload-safetensors` registers safetensors windows (read-only;
    /// the whole file is its enclosing memory, registered once).
    pub fn region(&self, window: &PackedWindow) -> Result<Box<dyn HostRegion>, PackError> {
        let range = window.offset as usize..(window.offset + window.len) as usize;
        match MappedWindow::new(Arc::clone(&self.map), range.clone()) {
            Some(w) => Ok(Box::new(w)),
            None => Err(PackError::Mismatch {
                path: self.path.clone(),
                tensor: String::new(),
                reason: format!(
                    "window {range:?} runs past the file's {} bytes",
                    self.map.len()
                ),
            }),
        }
    }

    /// Decodes a tensor (tiles over `threads` threads).
    pub fn decode(&self, name: &str, threads: usize) -> Result<Vec<u8>, PackError> {
        let e = self.entry(name)?;
        let blob = &self.map[e.range.clone()];
        let err = |source| PackError::Blob {
            path: self.path.clone(),
            tensor: name.to_owned(),
            source,
        };
        let p = Packed::parse(blob).map_err(err)?;
        let mut out = vec![0u8; p.header().decoded_bytes as usize];
        p.decode_into(&mut out, threads).map_err(err)?;
        Ok(out)
    }

    /// Bytes of the tensors decoded.
    pub fn decoded_bytes(&self) -> u64 {
        self.tensors
            .values()
            .map(|e| e.manifest.stats.decoded_bytes)
            .sum()
    }

    /// Bytes of the blobs.
    pub fn packed_bytes(&self) -> u64 {
        self.tensors.values().map(|e| e.range.len() as u64).sum()
    }

    /// Bytes of the file.
    pub fn file_bytes(&self) -> u64 {
        self.map.len() as u64
    }
}

fn common_prefix(a: &str, b: &str) -> usize {
    a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The manifest entry's JSON, as `docs/PACKED_FORMAT.md` §4 shows it.
    #[test]
    fn manifest_entry_json() {
        let m = ManifestTensor {
            dtype: DType::Bf16,
            shape: vec![3072, 3072],
            stats: Stats {
                code: Code::Window3 { lo: 118 },
                decoded_bytes: 18_874_368,
                packed_bytes: 13_216_704,
                escapes: 212_000,
            },
        };
        let text = serde_json::to_string(&m).unwrap();
        assert_eq!(
            text,
            r#"{"dtype":"bf16","shape":[3072,3072],"code":"window3","lo":118,"decoded_bytes":18874368,"packed_bytes":13216704,"escapes":212000}"#
        );
        assert_eq!(serde_json::from_str::<ManifestTensor>(&text).unwrap(), m);
        let raw = ManifestTensor {
            stats: Stats {
                code: Code::Raw,
                ..m.stats
            },
            ..m
        };
        let text = serde_json::to_string(&raw).unwrap();
        assert!(text.contains(r#""code":"raw","decoded_bytes""#), "{text}");
    }
}
