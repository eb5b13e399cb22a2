//! A coded-block checkpoint (CONTRACT §7b, `docs/PACKED_FORMAT.md` §Coded
//! block files): each streamed block's `OPB1` blob ([`crate::block`]) as it
//! crosses the link, written once beside a checkpoint and mapped at enable,
//! so the ring engine registers every coded master in place instead of
//! encoding at enable.
//!
//! The container is safetensors (extension `.opackb`): one `U8` tensor per
//! block, named by the block's path, the data page-aligned; the metadata
//! key [`BLOCKS_KEY`] holds the manifest: the format ([`BLOCKS_FORMAT`]),
//! and per block its decoded bytes, its work items and its unit's layout
//! (each storage's offset and bytes, in unit order), so a loader hands out
//! a blob only for a unit laid out exactly so. [`CodedBlocks::open`] checks
//! every blob whole ([`BlockView::parse`]) against the manifest: typed
//! errors, never a panic.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use offload_core::device::HostRegion;
use offload_core::model::StorageId;
use offload_core::runtime::{CodedRegion, SourcePosition, Unit, WeightSource};
use offload_safetensors::MappedWindow;
use serde::{Deserialize, Serialize};

use crate::block::{BlockView, EncodedBlock};
use crate::container::{FILE_ALIGN, PackError};

/// The metadata key of the manifest.
pub const BLOCKS_KEY: &str = "offload_pack_blocks";
/// The blob format a coded-block file holds (what a codec's
/// `Codec::format` must say to take its blobs).
pub const BLOCKS_FORMAT: &str = "offload-pack OPB1";
/// The file extension.
pub const BLOCKS_EXTENSION: &str = "opackb";

/// One block of the manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockEntry {
    /// Bytes of the decoded unit.
    pub decoded_bytes: u64,
    /// Work items of its decode.
    pub work: u64,
    /// The unit's layout: each storage's (offset, bytes), in unit order.
    pub layout: Vec<(u64, u64)>,
    /// [`fingerprint`] of the weights the block was coded from (absent in
    /// files written before it was recorded: such a block is handed out
    /// unchecked, with a warning).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
}

/// The manifest under [`BLOCKS_KEY`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlocksManifest {
    /// [`BLOCKS_FORMAT`].
    pub format: String,
    /// [`crate::block::BLOCK_VERSION`].
    pub version: u16,
    /// Every block by path.
    pub blocks: BTreeMap<String, BlockEntry>,
}

/// One block to write: its path, its unit's layout and its coded bytes.
pub struct BlockToWrite {
    /// The block's path (the unit's name).
    pub name: String,
    /// The unit's layout, (offset, bytes) per storage.
    pub layout: Vec<(u64, u64)>,
    /// Its coded bytes.
    pub coded: EncodedBlock,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PackError + '_ {
    move |source| PackError::Io {
        path: path.to_owned(),
        source,
    }
}

fn container(path: &Path, reason: impl Into<String>) -> PackError {
    PackError::Container {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// The unit layout a manifest records for `unit`.
pub fn layout_of(unit: &Unit) -> Vec<(u64, u64)> {
    unit.entries.iter().map(|e| (e.offset, e.bytes)).collect()
}

/// Bytes of a [`fingerprint`]'s digest kept (hex: twice as many
/// characters).
const FINGERPRINT_BYTES: usize = 16;
/// Bytes read at each place a [`fingerprint`] samples.
const SAMPLE_BYTES: u64 = 64;

/// A fingerprint of the weights `unit` is laid out over, as `weights`
/// holds them: SHA-256 (its first 16 bytes, hex) over each storage's
/// place in the unit (offset and bytes) and 64 bytes at its start, its
/// middle and its end. A few reads a block, so a loader checks every
/// block at enable for next to nothing; it tells a file coded from other
/// weights (another checkpoint, a fine-tune of the same shapes, every
/// tensor different) from its own, not a few values edited in place.
pub fn fingerprint(unit: &Unit, weights: &dyn WeightSource) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let mut sample = [0u8; SAMPLE_BYTES as usize];
    for e in &unit.entries {
        h.update(e.offset.to_le_bytes());
        h.update(e.bytes.to_le_bytes());
        let n = e.bytes.min(SAMPLE_BYTES);
        let mut at = vec![0, (e.bytes - n) / 2, e.bytes - n];
        at.dedup();
        for p in at {
            let dst = &mut sample[..n as usize];
            weights.read(e.storage, p, dst);
            h.update(&*dst);
        }
    }
    h.finalize()[..FINGERPRINT_BYTES]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One block of a coded-block file to write: its path, its unit's layout
/// ((offset, bytes) per storage, in unit order) and the [`fingerprint`]
/// of the weights it is coded from, if known.
pub type BlockName = (String, Vec<(u64, u64)>, Option<String>);

/// Writes a coded-block file at `path` from `names` (each block's path,
/// layout and fingerprint, in the order to write) and `coded(i)`, called
/// once per block in that order (one block in memory at a time). The
/// header is reserved first at its longest and rewritten once every
/// length is known.
pub fn write_blocks(
    path: &Path,
    names: &[BlockName],
    mut coded: impl FnMut(usize) -> Result<EncodedBlock, PackError>,
) -> Result<u64, PackError> {
    let mut seen = std::collections::BTreeSet::new();
    if let Some((n, _, _)) = names.iter().find(|(n, _, _)| !seen.insert(n.clone())) {
        return Err(container(path, format!("two blocks named `{n}`")));
    }
    let header = |sizes: &[(u64, u64, u64)]| -> String {
        let manifest = BlocksManifest {
            format: BLOCKS_FORMAT.into(),
            version: crate::block::BLOCK_VERSION,
            blocks: names
                .iter()
                .zip(sizes)
                .map(|((n, l, f), &(_, decoded, work))| {
                    (
                        n.clone(),
                        BlockEntry {
                            decoded_bytes: decoded,
                            work,
                            layout: l.clone(),
                            fingerprint: f.clone(),
                        },
                    )
                })
                .collect(),
        };
        let mut h = serde_json::Map::new();
        h.insert(
            "__metadata__".into(),
            serde_json::json!({
                BLOCKS_KEY: serde_json::to_string(&manifest).expect("a manifest serialises")
            }),
        );
        let mut at = 0u64;
        for ((n, _, _), &(len, _, _)) in names.iter().zip(sizes) {
            h.insert(
                n.clone(),
                serde_json::json!({"dtype": "U8", "shape": [len], "data_offsets": [at, at.saturating_add(len)]}),
            );
            at = at.saturating_add(len);
        }
        serde_json::to_string(&h).expect("a header serialises")
    };
    // The longest the header can be: every number at 20 digits (10^19;
    // the offsets saturate at u64::MAX, 20 digits too).
    const WIDEST: u64 = 10_000_000_000_000_000_000;
    let longest = header(&vec![(WIDEST, WIDEST, WIDEST); names.len()]).len();
    let data_start = (8 + longest as u64).div_ceil(FILE_ALIGN) * FILE_ALIGN;
    let file = File::create(path).map_err(io(path))?;
    let mut w = BufWriter::with_capacity(8 << 20, file);
    w.seek(SeekFrom::Start(data_start)).map_err(io(path))?;
    let mut sizes = Vec::with_capacity(names.len());
    for (i, (name, layout, _)) in names.iter().enumerate() {
        let b = coded(i)?;
        let decoded = layout
            .iter()
            .try_fold(0u64, |a, (_, n)| a.checked_add(*n))
            .unwrap_or(u64::MAX);
        if b.decoded_bytes != decoded {
            return Err(PackError::Mismatch {
                path: path.to_owned(),
                tensor: name.clone(),
                reason: format!(
                    "its layout holds {decoded} bytes, its coded block decodes to {}",
                    b.decoded_bytes
                ),
            });
        }
        w.write_all(&b.blob).map_err(io(path))?;
        sizes.push((b.blob.len() as u64, b.decoded_bytes, b.work));
    }
    let mut text = header(&sizes);
    text.extend(std::iter::repeat_n(
        ' ',
        (data_start - 8) as usize - text.len(),
    ));
    w.seek(SeekFrom::Start(0)).map_err(io(path))?;
    w.write_all(&(text.len() as u64).to_le_bytes())
        .map_err(io(path))?;
    w.write_all(text.as_bytes()).map_err(io(path))?;
    w.flush().map_err(io(path))?;
    Ok(data_start + sizes.iter().map(|s| s.0).sum::<u64>())
}

/// A coded-block file, mapped read-only, every block checked at open.
pub struct CodedBlocks {
    path: PathBuf,
    /// The file, for positional reads of released windows.
    file: File,
    /// Positional reads of windows so far ([`Self::direct_reads`]).
    direct_reads: std::sync::atomic::AtomicU64,
    map: Arc<Mmap>,
    blocks: BTreeMap<String, (std::ops::Range<usize>, BlockEntry)>,
    /// A planted bug: hand blocks out without comparing fingerprints.
    #[cfg(feature = "planted-bugs")]
    skip_fingerprints: bool,
}

impl std::fmt::Debug for CodedBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CodedBlocks")
            .field("path", &self.path)
            .field("blocks", &self.blocks.len())
            .finish()
    }
}

impl CodedBlocks {
    /// Maps the file at `path` and checks it: a safetensors container
    /// whose tensors are exactly the manifest's blocks, each a `U8`
    /// vector whose blob parses whole and agrees with the manifest
    /// (decoded bytes = its layout's, work items).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, PackError> {
        let path = path.as_ref().to_owned();
        let file = File::open(&path).map_err(io(&path))?;
        // SAFETY: mapped read-only; the file must not be rewritten while
        // mapped (documented on the type, as safetensors checkpoints are).
        let map = unsafe { Mmap::map(&file) }.map_err(io(&path))?;
        // Offsets past the data refused first: `read_metadata` would add
        // them unchecked (an overflow panic in debug builds).
        offload_safetensors::offsets_within(&map).map_err(|e| container(&path, e))?;
        let (n, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| container(&path, e.to_string()))?;
        let text = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(BLOCKS_KEY))
            .ok_or_else(|| container(&path, format!("no `{BLOCKS_KEY}` in its metadata")))?;
        let manifest: BlocksManifest = serde_json::from_str(text)
            .map_err(|e| container(&path, format!("its manifest: {e}")))?;
        if manifest.format != BLOCKS_FORMAT || manifest.version != crate::block::BLOCK_VERSION {
            return Err(container(
                &path,
                format!(
                    "format `{}` version {}, this crate reads `{BLOCKS_FORMAT}` version {}",
                    manifest.format,
                    manifest.version,
                    crate::block::BLOCK_VERSION
                ),
            ));
        }
        let data = 8 + n;
        let tensors = meta.tensors();
        if tensors.len() != manifest.blocks.len() {
            return Err(container(
                &path,
                format!(
                    "{} tensors for {} blocks in its manifest",
                    tensors.len(),
                    manifest.blocks.len()
                ),
            ));
        }
        let mut blocks = BTreeMap::new();
        for (name, entry) in manifest.blocks {
            let info = tensors
                .get(&name)
                .ok_or_else(|| container(&path, format!("block `{name}` has no tensor")))?;
            let (a, b) = info.data_offsets;
            let range = data
                .checked_add(a)
                .zip(data.checked_add(b))
                .filter(|(a, b)| a <= b && *b <= map.len());
            let Some((a, b)) = range else {
                return Err(container(
                    &path,
                    format!("block `{name}` runs past the file"),
                ));
            };
            let view = BlockView::parse(&map[a..b]).map_err(|source| PackError::Blob {
                path: path.clone(),
                tensor: name.clone(),
                source,
            })?;
            // A crafted layout may not sum in 64 bits: that is a mismatch.
            let decoded = entry
                .layout
                .iter()
                .try_fold(0u64, |a, (_, n)| a.checked_add(*n))
                .unwrap_or(u64::MAX);
            if view.decoded_bytes() != entry.decoded_bytes
                || decoded != entry.decoded_bytes
                || view.work() != entry.work
            {
                return Err(PackError::Mismatch {
                    path: path.clone(),
                    tensor: name,
                    reason: format!(
                        "the manifest says {} decoded bytes ({decoded} in its layout) and {} work items, the blob {} and {}",
                        entry.decoded_bytes,
                        entry.work,
                        view.decoded_bytes(),
                        view.work()
                    ),
                });
            }
            blocks.insert(name, (a..b, entry));
        }
        Ok(Self {
            path,
            file,
            direct_reads: std::sync::atomic::AtomicU64::new(0),
            map: Arc::new(map),
            blocks,
            #[cfg(feature = "planted-bugs")]
            skip_fingerprints: false,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Positional reads of coded windows so far
    /// ([`WeightSource::read_coded_direct`]: a coded staged block whose pages
    /// are released after each read).
    pub fn direct_reads(&self) -> u64 {
        self.direct_reads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes `position..position + dst.len()` of `unit`'s window read with
    /// `pread` (nothing mapped in), where `coded` is exactly that window of
    /// this mapping and the range lies within it; `false` otherwise, or
    /// where the read fails (logged at `debug`).
    fn read_window_direct(&self, unit: &Unit, coded: &[u8], position: u64, dst: &mut [u8]) -> bool {
        use std::os::unix::fs::FileExt;
        let Some(range) = self.window_of(unit) else {
            return false;
        };
        let window = &self.map[range.clone()];
        let within = position
            .checked_add(dst.len() as u64)
            .is_some_and(|end| end <= window.len() as u64);
        if !(std::ptr::eq(window.as_ptr(), coded.as_ptr()) && window.len() == coded.len() && within)
        {
            return false;
        }
        match self.file.read_exact_at(dst, range.start as u64 + position) {
            Ok(()) => {
                self.direct_reads
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                true
            }
            Err(e) => {
                tracing::debug!(file = %self.path.display(), block = %unit.name, "a positional read of the coded window failed ({e}); reading it through the mapping");
                false
            }
        }
    }

    /// Plants a bug (tests of the check): blocks are handed out without
    /// comparing their fingerprints.
    #[cfg(feature = "planted-bugs")]
    pub fn plant_skip_fingerprints(&mut self) {
        self.skip_fingerprints = true;
    }

    /// `unit`'s coded region, checked against the weights it stands for:
    /// `Ok(None)` where the file holds no block of that path laid out as
    /// `unit` is; a typed [`PackError::Mismatch`] naming the file and the
    /// block where the block was coded from other weights than `weights`
    /// holds (its [`fingerprint`] differs); the region otherwise (a block
    /// with no fingerprint recorded is handed out unchecked, logged at
    /// `warn`).
    pub fn checked_region(
        &self,
        unit: &Unit,
        weights: &dyn WeightSource,
    ) -> Result<Option<CodedRegion>, PackError> {
        let Some((_, entry)) = self.entry_for(unit) else {
            return Ok(None);
        };
        #[cfg(feature = "planted-bugs")]
        let skip = self.skip_fingerprints;
        #[cfg(not(feature = "planted-bugs"))]
        let skip = false;
        match &entry.fingerprint {
            _ if skip => {}
            None => tracing::warn!(
                file = %self.path.display(),
                block = %unit.name,
                "coded-block file written without fingerprints: block handed out unchecked against its weights"
            ),
            Some(want) => {
                let have = fingerprint(unit, weights);
                if have != *want {
                    return Err(PackError::Mismatch {
                        path: self.path.clone(),
                        tensor: unit.name.clone(),
                        reason: format!(
                            "coded from other weights than the checkpoint's (fingerprint {want} in the file, {have} of the weights): the file is stale; write it again from this checkpoint"
                        ),
                    });
                }
            }
        }
        Ok(self.region(unit))
    }

    /// The blocks by path.
    pub fn blocks(&self) -> impl Iterator<Item = (&str, &BlockEntry)> {
        self.blocks.iter().map(|(n, (_, e))| (n.as_str(), e))
    }

    /// Bytes of the blobs.
    pub fn coded_bytes(&self) -> u64 {
        self.blocks.values().map(|(r, _)| r.len() as u64).sum()
    }

    /// The byte range of the mapping holding `unit`'s block, if this file
    /// holds it laid out as `unit` is.
    fn window_of(&self, unit: &Unit) -> Option<std::ops::Range<usize>> {
        self.entry_for(unit).map(|(range, _)| range.clone())
    }

    /// The block of `unit`'s path, if this file holds it laid out as `unit`
    /// is: its byte range in the mapping and its manifest entry.
    fn entry_for(&self, unit: &Unit) -> Option<&(std::ops::Range<usize>, BlockEntry)> {
        self.blocks
            .get(&unit.name)
            .filter(|(_, e)| e.layout == layout_of(unit) && e.decoded_bytes == unit.bytes)
    }

    /// `unit`'s coded region, if this file holds its block laid out as
    /// `unit` is (unchecked against the weights: [`Self::checked_region`]
    /// checks).
    pub fn region(&self, unit: &Unit) -> Option<CodedRegion> {
        let (range, entry) = self.entry_for(unit)?;
        let window = MappedWindow::new(Arc::clone(&self.map), range.clone())?;
        Some(CodedRegion {
            region: Box::new(window) as Box<dyn HostRegion>,
            work: entry.work,
        })
    }
}

/// A weight source with a coded-block file beside it: everything as
/// `inner` answers, and each block the file holds, laid out as the engine
/// lays it out, handed out coded ([`WeightSource::take_coded`]) for a
/// codec of [`BLOCKS_FORMAT`].
pub struct WithCodedBlocks {
    /// The source of every byte.
    pub inner: Arc<dyn WeightSource>,
    /// The coded blocks.
    pub blocks: CodedBlocks,
}

impl WeightSource for WithCodedBlocks {
    fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        self.inner.read(storage, position, dst);
    }

    fn position(&self, storage: StorageId) -> Option<SourcePosition> {
        self.inner.position(storage)
    }

    fn take_region(&self, unit: &Unit) -> Option<Box<dyn HostRegion>> {
        self.inner.take_region(unit)
    }

    /// A block whose fingerprint differs from the weights' (a stale file)
    /// is not handed out: it is logged at `warn`, naming the file and the
    /// block, and the engine encodes it at enable from the weights, so
    /// the output stays the checkpoint's.
    fn take_coded(&self, unit: &Unit, format: &str) -> Option<CodedRegion> {
        if format == BLOCKS_FORMAT {
            match self.blocks.checked_region(unit, &*self.inner) {
                Ok(region) => region,
                Err(e) => {
                    tracing::warn!(
                        "{e}; the block is not taken from the file (it is encoded at enable, or staged raw)"
                    );
                    None
                }
            }
        } else {
            self.inner.take_coded(unit, format)
        }
    }

    fn take_shard_region(
        &self,
        unit: &Unit,
        range: std::ops::Range<u64>,
    ) -> Option<Box<dyn HostRegion>> {
        self.inner.take_shard_region(unit, range)
    }

    fn read_direct(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
        self.inner.read_direct(storage, position, dst);
    }

    /// `pread` of this file's own window of `unit` (a coded staged block
    /// whose pages are released after each read), never of bytes that are
    /// not exactly that window; else what `inner` answers.
    fn read_coded_direct(&self, unit: &Unit, coded: &[u8], position: u64, dst: &mut [u8]) -> bool {
        self.blocks.read_window_direct(unit, coded, position, dst)
            || self.inner.read_coded_direct(unit, coded, position, dst)
    }

    /// The unit's pages ahead: its coded window where this file holds the
    /// block (what a coded staged fill reads), else what `inner` holds of
    /// it (a raw staged fill's), never both (a disk read twice over).
    fn prefetch(&self, unit: &Unit) {
        match self.blocks.window_of(unit) {
            Some(range) => {
                // Advice only: a refusal changes nothing but speed.
                let _ = self.blocks.map.advise_range(
                    memmap2::Advice::WillNeed,
                    range.start,
                    range.len(),
                );
            }
            None => self.inner.prefetch(unit),
        }
    }

    /// Drops the unit's pages from this process once read: its coded
    /// window's (a block staged coded) and `inner`'s (a block staged raw).
    fn release(&self, unit: &Unit) {
        if let Some(range) = self.blocks.window_of(unit) {
            // SAFETY: the mapping is read-only and file-backed (`Mmap`), so
            // dropping its pages loses nothing: a later read faults the
            // same bytes in again from the page cache or the file. Pages a
            // registration pinned stay pinned (the driver holds them).
            let _ = unsafe {
                self.blocks.map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    range.start,
                    range.len(),
                )
            };
        }
        self.inner.release(unit);
    }

    fn restore(&self, unit: &Unit, bytes: &[u8]) {
        self.inner.restore(unit, bytes);
    }

    fn wants_restore(&self) -> bool {
        self.inner.wants_restore()
    }
}

/// What [`pack_blocks`] wrote.
#[derive(Clone, Debug, Serialize)]
pub struct BlocksReport {
    /// Blocks written.
    pub blocks: usize,
    /// Their bf16 (decoded) bytes.
    pub decoded_bytes: u64,
    /// Their coded bytes.
    pub coded_bytes: u64,
    /// The file's bytes.
    pub file_bytes: u64,
    /// Seconds taken.
    pub seconds: f64,
}

/// Writes at `path` the coded-block file of every block of `pipeline`'s
/// stacks, laid out as every backend lays them out over `weights`
/// ([`offload_core::runtime::packing_for`]), each read from `weights`,
/// encoded as a ring engine's codec would ([`crate::block::encode_block`]
/// on the unit's [`offload_core::runtime::codec_spans`], its round trip
/// checked), one block in memory at a time.
pub fn pack_blocks(
    path: &Path,
    pipeline: &offload_core::Pipeline,
    weights: &dyn WeightSource,
    cfg: &crate::format::EncodeConfig,
) -> Result<BlocksReport, PackError> {
    let start = std::time::Instant::now();
    let part = offload_core::runtime::packing_for(pipeline, weights)
        .map_err(|e| container(path, format!("the pipeline's packing: {e}")))?;
    let bf16 = offload_core::runtime::bf16_storages(pipeline);
    let units: Vec<&Unit> = part.blocks.values().collect();
    let names: Vec<BlockName> = units
        .iter()
        .map(|u| (u.name.clone(), layout_of(u), Some(fingerprint(u, weights))))
        .collect();
    let mut coded_bytes = 0;
    // One buffer for every block's bytes, read over the fills' threads
    // (a fresh one a block was touched page by page on one thread); a byte
    // no storage covers reads as zero (`unit_bytes_parallel`), never the
    // last block's.
    let mut bytes = Vec::new();
    let file_bytes = write_blocks(path, &names, |i| {
        use offload_core::device::ByteSource;
        let u = units[i];
        bytes.resize(u.bytes as usize, 0);
        offload_core::runtime::unit_bytes_parallel(weights, u).read_at(0, &mut bytes);
        let spans: Vec<crate::block::Span> = offload_core::runtime::codec_spans(u, &bf16)
            .into_iter()
            .map(|s| crate::block::Span {
                offset: s.offset,
                bytes: s.bytes,
                bf16: s.bf16,
            })
            .collect();
        let b =
            crate::block::encode_block(&bytes, &spans, cfg).map_err(|e| PackError::Mismatch {
                path: path.to_owned(),
                tensor: u.name.clone(),
                reason: e.to_string(),
            })?;
        coded_bytes += b.blob.len() as u64;
        Ok(b)
    })?;
    Ok(BlocksReport {
        blocks: units.len(),
        decoded_bytes: units.iter().map(|u| u.bytes).sum(),
        coded_bytes,
        file_bytes,
        seconds: start.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{Span, encode_block};
    use crate::format::EncodeConfig;

    fn normal(n: usize, seed: u64) -> Vec<u8> {
        let all = vec![("b.w".to_owned(), vec![n as u64])];
        crate::synth::tensor_bytes(
            crate::synth::Law::Normal,
            seed,
            0,
            "b.w",
            &[n as u64, 1],
            &all,
            1,
        )
    }

    fn file(blocks: &[(&str, Vec<u8>)]) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("opackb-{}-{}", std::process::id(), blocks.len()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.opackb");
        let names: Vec<BlockName> = blocks
            .iter()
            .map(|(n, b)| ((*n).to_owned(), vec![(0, b.len() as u64)], None))
            .collect();
        write_blocks(&path, &names, |i| {
            let b = &blocks[i].1;
            Ok(encode_block(
                b,
                &[Span {
                    offset: 0,
                    bytes: b.len() as u64,
                    bf16: true,
                }],
                &EncodeConfig::default(),
            )
            .unwrap())
        })
        .unwrap();
        path
    }

    #[test]
    fn a_written_file_opens_with_every_block_checked() {
        let a = normal(3 * 4096, 1);
        let b = normal(5000, 2);
        let path = file(&[("x.blocks.0", a.clone()), ("x.blocks.1", b.clone())]);
        let f = CodedBlocks::open(&path).unwrap();
        let blocks: Vec<(&str, &BlockEntry)> = f.blocks().collect();
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[0].1.decoded_bytes, a.len() as u64);
        assert!(f.coded_bytes() < (a.len() + b.len()) as u64);
        // Every blob decodes to its block.
        for (name, want) in [("x.blocks.0", &a), ("x.blocks.1", &b)] {
            let (r, _) = &f.blocks[name];
            let mut out = vec![0u8; want.len()];
            crate::block::decode_block(&f.map[r.clone()], &mut out, 1).unwrap();
            assert_eq!(&out, want);
        }
    }

    #[test]
    fn damaged_files_are_typed_errors() {
        let a = normal(2 * 4096, 3);
        let path = file(&[("y.0", a)]);
        let good = std::fs::read(&path).unwrap();
        let damaged = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut bytes = good.clone();
            f(&mut bytes);
            let p = path.with_extension("bad");
            std::fs::write(&p, &bytes).unwrap();
            CodedBlocks::open(&p).map(|_| ()).unwrap_err().to_string()
        };
        // Truncated blob, a table byte flipped, no manifest, not a container.
        let n = good.len();
        assert!(damaged(&|b| b.truncate(n - 100)).contains("t.bad"));
        let data = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
        assert!(damaged(&|b| b[data + 16] ^= 0x55).contains("y.0"));
        let e = damaged(&|b| {
            let h = String::from_utf8_lossy(&b[8..data]).replace(BLOCKS_KEY, "offload_pack_blockz");
            b[8..data].copy_from_slice(h.as_bytes());
        });
        assert!(e.contains(BLOCKS_KEY), "{e}");
        assert!(!damaged(&|b| b.truncate(5)).is_empty());
    }
}
