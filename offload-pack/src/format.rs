//! The packed tensor ("blob") format: header, sections, the encoder and the
//! tile-parallel reference decoder (`docs/PACKED_FORMAT.md` is the spec).
//!
//! A blob is one tensor. Its 64-byte header names the code; a window-coded
//! (`Window3`) blob then holds four sections, each starting on a 64-byte
//! boundary of the blob:
//!
//! 1. sign+mantissa bytes, one per weight, `n_tiles × 4096` (zero-padded);
//! 2. the 3-bit codes as bit planes, `n_tiles × 1536` bytes (per tile three
//!    planes of 128 little-endian `u32` words; weight `32w + b` of a tile is
//!    bit `b` of word `w` of each plane);
//! 3. the escape index, `n_tiles + 1` little-endian `u32` (an exclusive
//!    prefix sum of each tile's escapes);
//! 4. the escaped exponents, one byte each, in weight order.
//!
//! Code `c ∈ 1..=7` means exponent `lo + c − 1`; code 0 is an escape whose
//! exponent is the next byte of section 4. Every tile decodes alone: its
//! escapes start at `index[tile]`, and a weight's escape slot is that plus
//! the escapes before it in its tile (a popcount and a block-wide scan).

use std::ops::Range;

/// The first four bytes of every blob.
pub const MAGIC: [u8; 4] = *b"OPK1";
/// The format version this crate writes and reads.
pub const VERSION: u16 = 1;
/// Weights per tile.
pub const TILE_ELEMS: usize = 4096;
/// 32-weight code words per tile (one per thread of a 128-thread block).
pub const WORDS_PER_TILE: usize = TILE_ELEMS / 32;
/// Bytes of one bit plane of one tile.
pub const PLANE_BYTES: usize = TILE_ELEMS / 8;
/// Bytes of a tile's three bit planes.
pub const TILE_CODE_BYTES: usize = 3 * PLANE_BYTES;
/// Bytes of the header.
pub const HEADER_BYTES: usize = 64;
/// Alignment of every section within a blob, and of a blob's length.
pub const ALIGN: usize = 64;
/// Exponent values a window covers (codes 1 to 7).
pub const WINDOW: usize = 7;
/// The largest window start (`lo + 6 ≤ 255`).
pub const MAX_LO: u8 = 255 - (WINDOW as u8 - 1);

/// The code of one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(tag = "code", rename_all = "snake_case")]
pub enum Code {
    /// The tensor's bytes as they are (any dtype).
    Raw,
    /// bf16 only: sign+mantissa raw, exponents in the 3-bit window
    /// `lo ..= lo + 6`, escapes for the rest.
    Window3 {
        /// The lowest exponent of the window (0 to [`MAX_LO`]).
        lo: u8,
    },
}

impl Code {
    /// The header's code id: 0 raw, 1 window3.
    pub fn id(self) -> u8 {
        match self {
            Self::Raw => 0,
            Self::Window3 { .. } => 1,
        }
    }

    /// A short name for reports (`raw`, `w3@120`).
    pub fn label(self) -> String {
        match self {
            Self::Raw => "raw".into(),
            Self::Window3 { lo } => format!("w3@{lo}"),
        }
    }
}

/// What is wrong with a blob (untrusted packed data). Decoders return one of
/// these and never panic or read outside the blob.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The blob is shorter than its header or its sections say.
    #[error("packed tensor truncated: {what} needs {needed} bytes, the blob has {have}")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Bytes it needs.
        needed: u64,
        /// Bytes there are.
        have: u64,
    },
    /// Not a blob of this format.
    #[error("not a packed tensor: magic {found:02x?}, expected {MAGIC:02x?} (`OPK1`)")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// A version this crate does not read.
    #[error("packed tensor version {found}, this decoder reads version {VERSION}")]
    BadVersion {
        /// The header's version.
        found: u16,
    },
    /// A code id this crate does not know.
    #[error("packed tensor code id {found}, expected 0 (raw) or 1 (window3)")]
    BadCode {
        /// The header's code id.
        found: u8,
    },
    /// A header field that disagrees with the layout its other fields imply.
    #[error("packed tensor header field `{field}` is {found}, expected {expected}")]
    BadHeader {
        /// The field.
        field: &'static str,
        /// The value the layout implies.
        expected: u64,
        /// The value found.
        found: u64,
    },
    /// An escape index entry out of order, out of range, or disagreeing with
    /// the tile's codes.
    #[error(
        "packed tensor tile {tile}: escape index says escapes {start}..{end} (of {total}), its codes hold {counted}"
    )]
    BadEscapeIndex {
        /// The tile.
        tile: u32,
        /// `index[tile]`.
        start: u32,
        /// `index[tile + 1]`.
        end: u32,
        /// `index[n_tiles]`, the escapes in the blob.
        total: u32,
        /// Escape codes found in the tile.
        counted: u32,
    },
    /// A tile number past the last tile.
    #[error("tile {tile} of a packed tensor with {n_tiles} tiles")]
    TileOutOfRange {
        /// The tile asked for.
        tile: u32,
        /// Tiles in the blob.
        n_tiles: u32,
    },
    /// An output buffer of the wrong size.
    #[error("output buffer of {found} bytes for {expected} decoded bytes")]
    OutputSize {
        /// Bytes the decode writes.
        expected: u64,
        /// Bytes given.
        found: u64,
    },
}

/// What went wrong encoding.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// bf16 data of an odd number of bytes.
    #[error("bf16 data of {bytes} bytes (odd)")]
    OddLength {
        /// Its length.
        bytes: usize,
    },
    /// A forced window that does not fit the exponent range.
    #[error("window start {lo} out of range 0..={MAX_LO}")]
    WindowOutOfRange {
        /// The start given.
        lo: u8,
    },
    /// The host round trip after encoding gave other bytes (a bug in the
    /// encoder or decoder; never expected).
    #[error(
        "round trip of a {code} packed tensor differs from its input at weight {weight}: {input:#06x} in, {output:#06x} out"
    )]
    RoundTrip {
        /// The code used.
        code: String,
        /// The first weight (element) that differs.
        weight: u64,
        /// Its input bits.
        input: u16,
        /// Its decoded bits.
        output: u16,
    },
    /// A tensor too large for the window code's 32-bit escape index.
    #[error(
        "{elems} weights in one tensor: the window code holds at most {} (code it raw)",
        u32::MAX
    )]
    TooLarge {
        /// Its weights.
        elems: u64,
    },
    /// [`encode_into`] given a buffer of another length than the plan's
    /// blob.
    #[error("an output of {found} bytes for a packed tensor of {expected}")]
    OutputLength {
        /// The planned blob's length.
        expected: u64,
        /// The buffer's.
        found: u64,
    },
    /// [`encode_into`] found another number of escapes than its plan
    /// counted (a plan of other data, or a bug in this crate).
    #[error("the encoding found {found} escapes where its plan counted {planned}")]
    EscapesNotPlanned {
        /// The plan's escapes.
        planned: u64,
        /// The encoding's.
        found: u64,
    },
    /// The host round trip failed to decode at all.
    #[error("round trip of a {code} packed tensor failed to decode: {source}")]
    RoundTripDecode {
        /// The code used.
        code: String,
        /// Why.
        source: DecodeError,
    },
}

/// Bugs planted on purpose, to see a check go red (feature `planted-bugs`).
#[cfg(feature = "planted-bugs")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlantedBug {
    /// The encoder's choice is always raw (the ratio check must fail).
    AlwaysRaw,
    /// The decoder's escape slot counts the weight's own escape bit too
    /// (an off-by-one in the escape index: the round trip must fail).
    EscapeSlotInclusive,
    /// The encoder's window start is one too low (more escapes: the ratio
    /// stays exact, only the bytes grow).
    WindowOffByOne,
}

/// The planted bug in force for one call (always `None` without the
/// feature).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plant(#[cfg(feature = "planted-bugs")] pub(crate) Option<PlantedBug>);

impl Plant {
    #[allow(unused_variables, clippy::unused_self)]
    fn is(self, what: &str) -> bool {
        #[cfg(feature = "planted-bugs")]
        {
            matches!(
                (self.0, what),
                (Some(PlantedBug::AlwaysRaw), "always_raw")
                    | (Some(PlantedBug::EscapeSlotInclusive), "slot_inclusive")
                    | (Some(PlantedBug::WindowOffByOne), "window_off_by_one")
            )
        }
        #[cfg(not(feature = "planted-bugs"))]
        false
    }
}

fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN as u64) * ALIGN as u64
}

/// Where each section of a window-coded blob lies, from its weight and
/// escape counts (the only layout a decoder accepts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Weights.
    pub elems: u64,
    /// Tiles, `ceil(elems / 4096)`.
    pub n_tiles: u32,
    /// Sign+mantissa section.
    pub signman: Range<u64>,
    /// Bit-plane section.
    pub codes: Range<u64>,
    /// Escape index (`n_tiles + 1` × `u32`).
    pub esc_index: Range<u64>,
    /// Escaped exponents.
    pub escapes: Range<u64>,
    /// The blob's length (a multiple of 64).
    pub total_bytes: u64,
}

impl Layout {
    /// The layout of `elems` weights with `escapes` escapes; `None` where a
    /// size overflows (only from a crafted header).
    pub fn window3(elems: u64, escapes: u64) -> Option<Self> {
        let n_tiles = elems.div_ceil(TILE_ELEMS as u64);
        let n_tiles_u32 = u32::try_from(n_tiles).ok()?;
        let h = HEADER_BYTES as u64;
        let sm_end = h.checked_add(n_tiles.checked_mul(TILE_ELEMS as u64)?)?;
        let codes_end = sm_end.checked_add(n_tiles.checked_mul(TILE_CODE_BYTES as u64)?)?;
        let idx_end = codes_end.checked_add((n_tiles + 1).checked_mul(4)?)?;
        let esc_start = align_up(idx_end);
        let esc_end = esc_start.checked_add(escapes)?;
        let total = align_up(esc_end);
        if total > isize::MAX as u64 {
            return None;
        }
        Some(Self {
            elems,
            n_tiles: n_tiles_u32,
            signman: h..sm_end,
            codes: sm_end..codes_end,
            esc_index: codes_end..idx_end,
            escapes: esc_start..esc_end,
            total_bytes: total,
        })
    }

    /// The length of a raw blob of `decoded_bytes`.
    pub fn raw_bytes(decoded_bytes: u64) -> u64 {
        align_up(HEADER_BYTES as u64 + decoded_bytes)
    }
}

/// The header's fields, in order (all little-endian):
///
/// | offset | type | field |
/// | --- | --- | --- |
/// | 0 | `[u8; 4]` | magic `OPK1` |
/// | 4 | `u16` | version (1) |
/// | 6 | `u8` | code id (0 raw, 1 window3) |
/// | 7 | `u8` | window start `lo` (0 for raw) |
/// | 8 | `u64` | decoded bytes (`2 × elems` for window3) |
/// | 16 | `u32` | tile weights (4096; 0 for raw) |
/// | 20 | `u32` | tiles |
/// | 24 | `u64` | sign+mantissa offset (raw: the data's offset, 64) |
/// | 32 | `u64` | bit-plane offset (0 for raw) |
/// | 40 | `u64` | escape index offset (0 for raw) |
/// | 48 | `u64` | escaped exponents offset (0 for raw) |
/// | 56 | `u64` | blob length |
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The code.
    pub code: Code,
    /// Bytes of the decoded tensor.
    pub decoded_bytes: u64,
    /// Tiles (0 for raw).
    pub n_tiles: u32,
    /// Section offsets: sign+mantissa (raw: data), bit planes, escape
    /// index, escapes.
    pub offsets: [u64; 4],
    /// The blob's length.
    pub total_bytes: u64,
}

impl Header {
    fn write(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6] = self.code.id();
        out[7] = match self.code {
            Code::Raw => 0,
            Code::Window3 { lo } => lo,
        };
        out[8..16].copy_from_slice(&self.decoded_bytes.to_le_bytes());
        let tile = if self.code == Code::Raw {
            0
        } else {
            TILE_ELEMS as u32
        };
        out[16..20].copy_from_slice(&tile.to_le_bytes());
        out[20..24].copy_from_slice(&self.n_tiles.to_le_bytes());
        for (i, o) in self.offsets.iter().enumerate() {
            out[24 + 8 * i..32 + 8 * i].copy_from_slice(&o.to_le_bytes());
        }
        out[56..64].copy_from_slice(&self.total_bytes.to_le_bytes());
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn check(field: &'static str, expected: u64, found: u64) -> Result<(), DecodeError> {
    if expected == found {
        Ok(())
    } else {
        Err(DecodeError::BadHeader {
            field,
            expected,
            found,
        })
    }
}

/// A validated view of one blob: its header checked against the only
/// layout it may have, every section inside the blob.
#[derive(Clone, Debug)]
pub struct Packed<'a> {
    blob: &'a [u8],
    header: Header,
    /// Escapes in the blob (`index[n_tiles]`).
    escapes: u32,
}

impl<'a> Packed<'a> {
    /// Checks `blob` (untrusted) and returns a view to decode it from.
    pub fn parse(blob: &'a [u8]) -> Result<Self, DecodeError> {
        let have = blob.len() as u64;
        if blob.len() < HEADER_BYTES {
            return Err(DecodeError::Truncated {
                what: "header",
                needed: HEADER_BYTES as u64,
                have,
            });
        }
        let magic = [blob[0], blob[1], blob[2], blob[3]];
        if magic != MAGIC {
            return Err(DecodeError::BadMagic { found: magic });
        }
        let version = u16::from_le_bytes([blob[4], blob[5]]);
        if version != VERSION {
            return Err(DecodeError::BadVersion { found: version });
        }
        let lo = blob[7];
        let code = match blob[6] {
            0 => Code::Raw,
            1 => Code::Window3 { lo },
            found => return Err(DecodeError::BadCode { found }),
        };
        let decoded_bytes = u64_at(blob, 8);
        let tile = u64::from(u32_at(blob, 16));
        let n_tiles = u32_at(blob, 20);
        let offsets = [
            u64_at(blob, 24),
            u64_at(blob, 32),
            u64_at(blob, 40),
            u64_at(blob, 48),
        ];
        let total_bytes = u64_at(blob, 56);
        let header = Header {
            code,
            decoded_bytes,
            n_tiles,
            offsets,
            total_bytes,
        };
        let truncated = |what, needed| DecodeError::Truncated { what, needed, have };
        match code {
            Code::Raw => {
                check("window start", 0, u64::from(lo))?;
                check("tile weights", 0, tile)?;
                check("tiles", 0, u64::from(n_tiles))?;
                check("data offset", HEADER_BYTES as u64, offsets[0])?;
                for (f, o) in ["bit-plane offset", "escape index offset", "escapes offset"]
                    .into_iter()
                    .zip(&offsets[1..])
                {
                    check(f, 0, *o)?;
                }
                // The bound first: the sum below must not overflow (a header
                // claiming 2^64 − 1 decoded bytes panicked here in debug).
                if decoded_bytes > isize::MAX as u64 / 2 {
                    return Err(DecodeError::BadHeader {
                        field: "decoded bytes",
                        expected: isize::MAX as u64 / 2,
                        found: decoded_bytes,
                    });
                }
                let expected = HEADER_BYTES as u64 + decoded_bytes;
                check("blob length", Layout::raw_bytes(decoded_bytes), total_bytes)?;
                if have < expected {
                    return Err(truncated("raw data", expected));
                }
                Ok(Self {
                    blob,
                    header,
                    escapes: 0,
                })
            }
            Code::Window3 { lo } => {
                if lo > MAX_LO {
                    return Err(DecodeError::BadHeader {
                        field: "window start",
                        expected: u64::from(MAX_LO),
                        found: u64::from(lo),
                    });
                }
                check("decoded bytes parity", 0, decoded_bytes % 2)?;
                check("tile weights", TILE_ELEMS as u64, tile)?;
                let elems = decoded_bytes / 2;
                // The layout without escapes fixes everything up to the
                // escape index; the index's last entry then fixes the rest.
                let bare = Layout::window3(elems, 0).ok_or(DecodeError::BadHeader {
                    field: "decoded bytes",
                    expected: isize::MAX as u64 / 4,
                    found: decoded_bytes,
                })?;
                check("tiles", u64::from(bare.n_tiles), u64::from(n_tiles))?;
                check("sign+mantissa offset", bare.signman.start, offsets[0])?;
                check("bit-plane offset", bare.codes.start, offsets[1])?;
                check("escape index offset", bare.esc_index.start, offsets[2])?;
                check("escapes offset", bare.escapes.start, offsets[3])?;
                if have < bare.esc_index.end {
                    return Err(truncated("escape index", bare.esc_index.end));
                }
                let idx = bare.esc_index.start as usize;
                let first = u32_at(blob, idx);
                check("escape index[0]", 0, u64::from(first))?;
                let escapes = u32_at(blob, idx + 4 * n_tiles as usize);
                if u64::from(escapes) > elems {
                    return Err(DecodeError::BadHeader {
                        field: "escape index[tiles] (escapes)",
                        expected: elems,
                        found: u64::from(escapes),
                    });
                }
                let full =
                    Layout::window3(elems, u64::from(escapes)).ok_or(DecodeError::BadHeader {
                        field: "decoded bytes",
                        expected: isize::MAX as u64 / 4,
                        found: decoded_bytes,
                    })?;
                check("blob length", full.total_bytes, total_bytes)?;
                if have < full.escapes.end {
                    return Err(truncated("escapes", full.escapes.end));
                }
                Ok(Self {
                    blob,
                    header,
                    escapes,
                })
            }
        }
    }

    /// The first tile whose escape index entries are out of order
    /// (`index[t] > index[t + 1]`), if any: a loader's O(tiles) check
    /// before the blob goes to a GPU decoder.
    pub fn escape_index_disorder(&self) -> Option<u32> {
        let idx = self.header.offsets[2] as usize;
        (0..self.header.n_tiles).find(|&t| {
            let t = t as usize;
            u32_at(self.blob, idx + 4 * t) > u32_at(self.blob, idx + 4 * (t + 1))
        })
    }

    /// The header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Escapes in the blob.
    pub fn escapes(&self) -> u32 {
        self.escapes
    }

    /// The blob's length.
    pub fn total_bytes(&self) -> u64 {
        self.header.total_bytes
    }

    /// Tiles (0 for raw).
    pub fn n_tiles(&self) -> u32 {
        self.header.n_tiles
    }

    /// The decoded bytes of `tile` in the output (`2 × 4096 × tile ..`).
    pub fn tile_output(&self, tile: u32) -> Range<usize> {
        let start = tile as usize * TILE_ELEMS * 2;
        let end = (start + TILE_ELEMS * 2).min(self.header.decoded_bytes as usize);
        start..end.max(start)
    }

    /// Decodes the whole tensor.
    pub fn decode(&self) -> Result<Vec<u8>, DecodeError> {
        let mut out = vec![0u8; self.header.decoded_bytes as usize];
        self.decode_into(&mut out, 1)?;
        Ok(out)
    }

    /// Decodes the whole tensor into `out` (exactly its decoded size),
    /// tiles spread over `threads` threads.
    pub fn decode_into(&self, out: &mut [u8], threads: usize) -> Result<(), DecodeError> {
        self.decode_into_planted(out, threads, Plant::default())
    }

    pub(crate) fn decode_into_planted(
        &self,
        out: &mut [u8],
        threads: usize,
        plant: Plant,
    ) -> Result<(), DecodeError> {
        check_output(self.header.decoded_bytes, out.len())?;
        match self.header.code {
            Code::Raw => {
                let d = HEADER_BYTES;
                out.copy_from_slice(&self.blob[d..d + out.len()]);
                Ok(())
            }
            Code::Window3 { .. } => {
                let tiles = self.header.n_tiles as usize;
                // Eight tiles a thread at least: a spawn costs more than a tile.
                let threads = threads.clamp(1, (tiles / 8).max(1));
                let per = tiles.div_ceil(threads).max(1);
                let chunk = per * TILE_ELEMS * 2;
                if threads == 1 {
                    for (t, o) in out.chunks_mut(TILE_ELEMS * 2).enumerate() {
                        self.decode_tile_planted(t as u32, o, plant)?;
                    }
                    return Ok(());
                }
                std::thread::scope(|s| {
                    let handles: Vec<_> = out
                        .chunks_mut(chunk)
                        .enumerate()
                        .map(|(i, part)| {
                            s.spawn(move || {
                                for (k, o) in part.chunks_mut(TILE_ELEMS * 2).enumerate() {
                                    self.decode_tile_planted((i * per + k) as u32, o, plant)?;
                                }
                                Ok(())
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .try_for_each(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                })
            }
        }
    }

    /// Decodes one tile of a window-coded blob into `out` (its
    /// [`Self::tile_output`] length), in the shape the GPU kernel runs:
    /// 128 lanes, lane `w` owning code word `w` (weights `32w .. 32w + 32`).
    ///
    /// 1. Each lane loads its word of the three planes and forms its escape
    ///    mask `!(p0 | p1 | p2)` (bits past the tensor's end cleared).
    /// 2. A block-wide exclusive scan of the lanes' popcounts gives each
    ///    lane its first escape slot, from `index[tile]`; the scan's total
    ///    must equal `index[tile + 1] − index[tile]`.
    /// 3. Each lane rebuilds its 32 weights: exponent `lo + code − 1`, or
    ///    for code 0 the escape byte at its slot plus the popcount of the
    ///    mask's lower bits; sign and mantissa from the weight's byte.
    pub fn decode_tile(&self, tile: u32, out: &mut [u8]) -> Result<(), DecodeError> {
        self.decode_tile_planted(tile, out, Plant::default())
    }

    fn decode_tile_planted(
        &self,
        tile: u32,
        out: &mut [u8],
        plant: Plant,
    ) -> Result<(), DecodeError> {
        let Code::Window3 { lo } = self.header.code else {
            // A raw blob has no tiles.
            return Err(DecodeError::TileOutOfRange { tile, n_tiles: 0 });
        };
        let n_tiles = self.header.n_tiles;
        if tile >= n_tiles {
            return Err(DecodeError::TileOutOfRange { tile, n_tiles });
        }
        let range = self.tile_output(tile);
        check_output(range.len() as u64, out.len())?;
        let valid = range.len() / 2;
        let [sm_off, codes_off, idx_off, esc_off] = self.header.offsets.map(|o| o as usize);
        let t = tile as usize;
        let sm = &self.blob[sm_off + t * TILE_ELEMS..sm_off + (t + 1) * TILE_ELEMS];
        let codes =
            &self.blob[codes_off + t * TILE_CODE_BYTES..codes_off + (t + 1) * TILE_CODE_BYTES];
        let start = u32_at(self.blob, idx_off + 4 * t);
        let end = u32_at(self.blob, idx_off + 4 * (t + 1));

        // Phase 1: per lane, the escape mask and its popcount.
        let mut planes = [[0u32; WORDS_PER_TILE]; 3];
        let mut mask = [0u32; WORDS_PER_TILE];
        let mut slot = [0u32; WORDS_PER_TILE];
        for w in 0..WORDS_PER_TILE {
            for (p, plane) in planes.iter_mut().enumerate() {
                plane[w] = u32_at(codes, p * PLANE_BYTES + 4 * w);
            }
            let live = valid.saturating_sub(32 * w).min(32);
            let live_mask = if live == 32 {
                u32::MAX
            } else {
                (1u32 << live) - 1
            };
            mask[w] = !(planes[0][w] | planes[1][w] | planes[2][w]) & live_mask;
        }
        // Phase 2: the block-wide exclusive scan.
        let mut counted = 0u32;
        for w in 0..WORDS_PER_TILE {
            slot[w] = counted;
            counted += mask[w].count_ones();
        }
        if start > end || end > self.escapes || end - start != counted {
            return Err(DecodeError::BadEscapeIndex {
                tile,
                start,
                end,
                total: self.escapes,
                counted,
            });
        }
        let esc = &self.blob[esc_off + start as usize..esc_off + end as usize];
        let inclusive = plant.is("slot_inclusive");
        // Phase 3: per lane, its 32 weights (all 32 rebuilt, the live ones
        // stored; a padding weight's byte and code are in the tile).
        let base = u16::from(lo).wrapping_sub(1);
        for w in 0..WORDS_PER_TILE {
            let live = valid.saturating_sub(32 * w).min(32);
            if live == 0 {
                break;
            }
            let (p0, p1, p2, m) = (planes[0][w], planes[1][w], planes[2][w], mask[w]);
            let sm_w: &[u8; 32] = sm[32 * w..32 * w + 32].try_into().expect("32 bytes");
            let mut vals = [0u8; 64];
            for g in 0..4 {
                let byte = |p: u32| SPREAD[((p >> (8 * g)) & 0xff) as usize];
                // Byte i of `c8`: the code of weight 8g + i.
                let c8 = byte(p0) | (byte(p1) << 1) | (byte(p2) << 2);
                for i in 0..8 {
                    let b = 8 * g + i;
                    let code = ((c8 >> (8 * i)) & 7) as u16;
                    let exp = if code != 0 {
                        // lo ≤ 249 and code ≤ 7: lo + code − 1 ≤ 255.
                        base.wrapping_add(code)
                    } else {
                        let below = if inclusive {
                            (m & (((2u64 << b) - 1) as u32)).count_ones()
                        } else {
                            (m & ((1u32 << b) - 1)).count_ones()
                        };
                        // In range for a live weight: slot[w] + below <
                        // counted = esc.len(), except under the planted bug,
                        // which may read one past; a padding weight's code
                        // is never 0 in a blob this crate wrote, and reads
                        // 0 if it is.
                        let k = (slot[w] + below) as usize;
                        u16::from(*esc.get(k).unwrap_or(&0))
                    };
                    let s = u16::from(sm_w[b]);
                    let bits = ((s & 0x80) << 8) | (exp << 7) | (s & 0x7f);
                    vals[2 * b..2 * b + 2].copy_from_slice(&bits.to_le_bytes());
                }
            }
            out[64 * w..64 * w + 2 * live].copy_from_slice(&vals[..2 * live]);
        }
        Ok(())
    }
}

/// `SPREAD[b]`: bit i of `b` moved to bit 0 of byte i (eight codes'
/// plane bits side by side, one byte each).
const SPREAD: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut i = 0;
        while i < 8 {
            if (b >> i) & 1 == 1 {
                t[b] |= 1 << (8 * i);
            }
            i += 1;
        }
        b += 1;
    }
    t
};

fn check_output(expected: u64, found: usize) -> Result<(), DecodeError> {
    if expected == found as u64 {
        Ok(())
    } else {
        Err(DecodeError::OutputSize {
            expected,
            found: found as u64,
        })
    }
}

/// How to encode.
#[derive(Clone, Debug)]
pub struct EncodeConfig {
    /// Threads for one tensor (tiles are split among them); 0: all cores.
    pub threads: usize,
    /// Tensors with fewer weights stay raw (norms, biases, small tensors);
    /// default one tile.
    pub min_elems: usize,
    /// A code to use whatever the choice would be (tests; a `Window3` on
    /// non-bf16 data is an error).
    pub force: Option<Code>,
    /// Whether to decode on the host and compare after encoding (default
    /// `true`; the encoder is exact only if this passes).
    pub verify: bool,
    #[cfg(feature = "planted-bugs")]
    /// A bug to plant (tests of the checks).
    pub planted: Option<PlantedBug>,
}

impl Default for EncodeConfig {
    fn default() -> Self {
        Self {
            threads: 0,
            min_elems: TILE_ELEMS,
            force: None,
            verify: true,
            #[cfg(feature = "planted-bugs")]
            planted: None,
        }
    }
}

impl EncodeConfig {
    pub(crate) fn plant(&self) -> Plant {
        Plant(
            #[cfg(feature = "planted-bugs")]
            self.planted,
        )
    }

    /// The threads this configuration uses.
    pub fn threads(&self) -> usize {
        if self.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            self.threads
        }
    }
}

/// One encoded tensor and what its encoding did.
#[derive(Clone, Debug)]
pub struct Encoded {
    /// The blob.
    pub blob: Vec<u8>,
    /// Its figures.
    pub stats: Stats,
}

/// Figures of one encoded tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stats {
    /// The code chosen.
    #[serde(flatten)]
    pub code: Code,
    /// Bytes of the tensor as given.
    pub decoded_bytes: u64,
    /// Bytes of its blob.
    pub packed_bytes: u64,
    /// Escaped weights (window3).
    pub escapes: u64,
}

impl Stats {
    /// The figures of `decoded_bytes` of any tensor encoded raw.
    pub fn raw(decoded_bytes: u64) -> Self {
        Self {
            code: Code::Raw,
            decoded_bytes,
            packed_bytes: Layout::raw_bytes(decoded_bytes),
            escapes: 0,
        }
    }

    /// Packed bytes / decoded bytes (1 for an empty tensor).
    pub fn ratio(&self) -> f64 {
        if self.decoded_bytes == 0 {
            1.0
        } else {
            self.packed_bytes as f64 / self.decoded_bytes as f64
        }
    }
}

/// The exponent histogram of bf16 data (little-endian pairs).
pub fn exponent_histogram(bf16: &[u8], threads: usize) -> [u64; 256] {
    fn one(data: &[u8]) -> [u64; 256] {
        let mut h = [[0u64; 256]; 2];
        let mut pairs = data.chunks_exact(4);
        for p in &mut pairs {
            let a = u16::from_le_bytes([p[0], p[1]]);
            let b = u16::from_le_bytes([p[2], p[3]]);
            h[0][usize::from((a >> 7) as u8)] += 1;
            h[1][usize::from((b >> 7) as u8)] += 1;
        }
        for p in pairs.remainder().chunks_exact(2) {
            h[0][usize::from((u16::from_le_bytes([p[0], p[1]]) >> 7) as u8)] += 1;
        }
        let mut out = [0u64; 256];
        for (i, o) in out.iter_mut().enumerate() {
            *o = h[0][i] + h[1][i];
        }
        out
    }
    let threads = threads.max(1);
    if threads == 1 || bf16.len() < 1 << 20 {
        return one(bf16);
    }
    let chunk = (bf16.len() / 2).div_ceil(threads) * 2;
    std::thread::scope(|s| {
        let parts: Vec<_> = bf16
            .chunks(chunk)
            .map(|c| s.spawn(move || one(c)))
            .collect();
        let mut out = [0u64; 256];
        for p in parts {
            let h = p.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            for (o, x) in out.iter_mut().zip(h) {
                *o += x;
            }
        }
        out
    })
}

/// The window start covering the most weights of `hist` (the lowest on a
/// tie), and the weights it leaves out (the escapes).
pub fn best_window(hist: &[u64; 256]) -> (u8, u64) {
    let total: u64 = hist.iter().sum();
    let mut best = (0u8, 0u64);
    let mut sum: u64 = hist[..WINDOW].iter().sum();
    for lo in 0..=MAX_LO {
        if lo > 0 {
            sum = sum + hist[usize::from(lo) + WINDOW - 1] - hist[usize::from(lo) - 1];
        }
        if sum > best.1 {
            best = (lo, sum);
        }
    }
    (best.0, total - best.1)
}

/// What the encoder would choose for bf16 data with exponent histogram
/// `hist`, and the blob's length: window3 where it is smaller than raw and
/// the tensor has at least `min_elems` weights, else raw; with the blob's
/// length and escapes. Exact, so a file's layout is known before anything
/// is encoded.
pub fn choose(hist: &[u64; 256], min_elems: usize) -> Stats {
    let elems: u64 = hist.iter().sum();
    let raw = Stats::raw(2 * elems);
    if elems < min_elems as u64 || elems > u64::from(u32::MAX) {
        return raw;
    }
    let (lo, escapes) = best_window(hist);
    match Layout::window3(elems, escapes) {
        Some(l) if l.total_bytes < raw.packed_bytes => Stats {
            code: Code::Window3 { lo },
            packed_bytes: l.total_bytes,
            escapes,
            ..raw
        },
        _ => raw,
    }
}

/// Encodes any tensor's bytes raw.
pub fn encode_raw(data: &[u8]) -> Encoded {
    let stats = Stats::raw(data.len() as u64);
    let mut blob = vec![0u8; stats.packed_bytes as usize];
    encode_into(data, &stats, 1, &mut blob).expect("a raw blob of its planned length");
    Encoded { blob, stats }
}

/// The code the encoder uses for bf16 data under `cfg` (its `force`, else
/// [`choose`] on the data's exponent histogram) and the exact figures of
/// the blob it gives (length, escapes), before encoding anything.
pub fn plan_bf16(data: &[u8], cfg: &EncodeConfig) -> Result<Stats, EncodeError> {
    plan_bf16_from(data.len() as u64, cfg, || {
        Ok(exponent_histogram(data, cfg.threads()))
    })
}

/// [`plan_bf16`] for `bytes` bytes of bf16 data whose exponent histogram
/// `hist` gives (called only where the code depends on it): the plan is a
/// function of the histogram alone, so a caller may count it from the data
/// in pieces (`block::plan_block`) without holding the data whole.
pub fn plan_bf16_from<E>(
    bytes: u64,
    cfg: &EncodeConfig,
    hist: impl FnOnce() -> Result<[u64; 256], E>,
) -> Result<Stats, E>
where
    E: From<EncodeError>,
{
    if !bytes.is_multiple_of(2) {
        return Err(EncodeError::OddLength {
            bytes: bytes as usize,
        }
        .into());
    }
    let plant = cfg.plant();
    let elems = bytes / 2;
    let raw = Stats::raw(bytes);
    let hist = match cfg.force {
        Some(Code::Raw) => return Ok(raw),
        None if plant.is("always_raw") => return Ok(raw),
        _ => hist()?,
    };
    debug_assert_eq!(
        hist.iter().sum::<u64>(),
        elems,
        "an exponent histogram counts every weight once"
    );
    let lo = match cfg.force {
        Some(Code::Window3 { lo }) => lo,
        _ => match choose(&hist, cfg.min_elems) {
            Stats {
                code: Code::Window3 { lo },
                ..
            } if plant.is("window_off_by_one") => lo.saturating_sub(1),
            chosen => return Ok(chosen),
        },
    };
    if lo > MAX_LO {
        return Err(EncodeError::WindowOutOfRange { lo }.into());
    }
    if elems > u64::from(u32::MAX) {
        return Err(EncodeError::TooLarge { elems }.into());
    }
    let hits: u64 = hist[usize::from(lo)..usize::from(lo) + WINDOW].iter().sum();
    let layout = Layout::window3(elems, elems - hits).ok_or(EncodeError::TooLarge { elems })?;
    Ok(Stats {
        code: Code::Window3 { lo },
        packed_bytes: layout.total_bytes,
        escapes: elems - hits,
        ..raw
    })
}

/// Encodes bf16 data (little-endian pairs) with the code [`plan_bf16`]
/// picks, then decodes it on the host and compares (unless `cfg.verify` is
/// off).
pub fn encode_bf16(data: &[u8], cfg: &EncodeConfig) -> Result<Encoded, EncodeError> {
    let planned = plan_bf16(data, cfg)?;
    encode_bf16_as(data, planned.code, cfg)
}

/// Encodes bf16 data with `code`, then checks the round trip (unless
/// `cfg.verify` is off).
pub fn encode_bf16_as(data: &[u8], code: Code, cfg: &EncodeConfig) -> Result<Encoded, EncodeError> {
    if !data.len().is_multiple_of(2) {
        return Err(EncodeError::OddLength { bytes: data.len() });
    }
    let threads = cfg.threads();
    let encoded = match code {
        Code::Raw => encode_raw(data),
        Code::Window3 { lo } => encode_window3(data, lo, threads)?,
    };
    if cfg.verify {
        verify(data, &encoded, threads, cfg.plant())?;
    }
    Ok(encoded)
}

/// Decodes `encoded` and compares it with `data`, naming the first weight
/// that differs.
fn verify(data: &[u8], encoded: &Encoded, threads: usize, plant: Plant) -> Result<(), EncodeError> {
    verify_blob(data, &encoded.blob, encoded.stats.code, threads, plant)
}

/// Decodes the tensor blob `blob`, written with `code`, and compares it
/// with `data`, naming the first weight that differs: tile by tile into a
/// small buffer per thread (no second copy of the tensor), the tiles
/// spread over `threads`.
pub(crate) fn verify_blob(
    data: &[u8],
    blob: &[u8],
    code: Code,
    threads: usize,
    plant: Plant,
) -> Result<(), EncodeError> {
    let code = code.label();
    let decode_err = |source| EncodeError::RoundTripDecode {
        code: code.clone(),
        source,
    };
    let packed = Packed::parse(blob).map_err(decode_err)?;
    let first_difference = |out: &[u8], input: &[u8], base: usize| {
        let i = out
            .chunks_exact(2)
            .zip(input.chunks_exact(2))
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        EncodeError::RoundTrip {
            code: code.clone(),
            weight: (base + i) as u64,
            input: u16::from_le_bytes([input[2 * i], input[2 * i + 1]]),
            output: u16::from_le_bytes([out[2 * i], out[2 * i + 1]]),
        }
    };
    check_output(packed.header().decoded_bytes, data.len()).map_err(decode_err)?;
    if packed.header().code == Code::Raw {
        let out = &blob[HEADER_BYTES..HEADER_BYTES + data.len()];
        return if out == data {
            Ok(())
        } else {
            Err(first_difference(out, data, 0))
        };
    }
    // Tile by tile into a small buffer, compared with the input at once:
    // no second copy of the tensor.
    let tiles = packed.n_tiles() as usize;
    let threads = threads.clamp(1, (tiles / 8).max(1));
    let per = tiles.div_ceil(threads).max(1);
    let check = |first: usize, input: &[u8]| -> Result<(), EncodeError> {
        let mut buf = vec![0u8; TILE_ELEMS * 2];
        for (k, want) in input.chunks(TILE_ELEMS * 2).enumerate() {
            let out = &mut buf[..want.len()];
            packed
                .decode_tile_planted((first + k) as u32, out, plant)
                .map_err(decode_err)?;
            if out != want {
                return Err(first_difference(out, want, (first + k) * TILE_ELEMS));
            }
        }
        Ok(())
    };
    if threads == 1 {
        return check(0, data);
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = data
            .chunks(per * TILE_ELEMS * 2)
            .enumerate()
            .map(|(i, part)| s.spawn(move || check(i * per, part)))
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })
}

/// Encodes one tile: its sign+mantissa bytes and bit planes (padding
/// weights get code 1, never an escape), appending its escapes to `esc`.
fn encode_tile(src: &[u8], lo: u8, sm: &mut [u8], codes: &mut [u8], esc: &mut Vec<u8>) -> u32 {
    /// Gathers bit 0 of each of a u64's 8 bytes into one byte (byte i's
    /// bit to bit i): the products of distinct bit pairs never overlap.
    fn gather(x: u64) -> u32 {
        (((x & 0x0101_0101_0101_0101).wrapping_mul(0x0102_0408_1020_4080)) >> 56) as u32
    }
    let n = src.len() / 2;
    let mut count = 0u32;
    let mut planes = [[0u32; WORDS_PER_TILE]; 3];
    for w in 0..WORDS_PER_TILE {
        let live = n.saturating_sub(32 * w).min(32);
        let at = (64 * w).min(src.len());
        let src_w = &src[at..at + 2 * live];
        let sm_w = &mut sm[32 * w..32 * w + 32];
        let mut exps = [0u8; 32];
        // Padding weights: sign+mantissa 0, code 1 (never an escape).
        let mut cd = [1u8; 32];
        for (b, pair) in src_w.chunks_exact(2).enumerate() {
            let bits = u16::from_le_bytes([pair[0], pair[1]]);
            sm_w[b] = ((bits >> 8) as u8 & 0x80) | (bits as u8 & 0x7f);
            let e = (bits >> 7) as u8;
            exps[b] = e;
            let d = e.wrapping_sub(lo);
            cd[b] = if usize::from(d) < WINDOW { d + 1 } else { 0 };
        }
        sm_w[live..].fill(0);
        let mut p = [0u32; 3];
        for (k, chunk) in cd.chunks_exact(8).enumerate() {
            let x = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            for (bit, plane) in p.iter_mut().enumerate() {
                *plane |= gather(x >> bit) << (8 * k);
            }
        }
        let esc_mask = !(p[0] | p[1] | p[2]);
        if esc_mask != 0 {
            for (b, &e) in exps.iter().enumerate() {
                if esc_mask >> b & 1 == 1 {
                    esc.push(e);
                }
            }
            count += esc_mask.count_ones();
        }
        for (plane, word) in planes.iter_mut().zip(p) {
            plane[w] = word;
        }
    }
    for (p, plane) in planes.iter().enumerate() {
        let out = &mut codes[p * PLANE_BYTES..(p + 1) * PLANE_BYTES];
        for (o, word) in out.chunks_exact_mut(4).zip(plane) {
            o.copy_from_slice(&word.to_le_bytes());
        }
    }
    count
}

/// Per part of a tensor's tiles (in order): its escapes and each tile's
/// escape count.
type TileParts = Vec<(Vec<u8>, Vec<u32>)>;

/// Window-codes `data` at `lo` into a blob's sign+mantissa (`sm`) and bit
/// plane (`codes`) sections, tiles spread over `threads` threads; each
/// part's escapes and per-tile counts for [`write_window3_tail`].
fn encode_tiles(data: &[u8], lo: u8, threads: usize, sm: &mut [u8], codes: &mut [u8]) -> TileParts {
    let tiles = data.len().div_ceil(2 * TILE_ELEMS);
    // Eight tiles a thread at least: a spawn costs more than a tile.
    let threads = threads.clamp(1, (tiles / 8).max(1));
    let per = tiles.div_ceil(threads).max(1);
    let run = |src: &[u8], sm: &mut [u8], codes: &mut [u8]| {
        let mut esc = Vec::new();
        let mut counts = Vec::new();
        for ((s, m), c) in src
            .chunks(TILE_ELEMS * 2)
            .zip(sm.chunks_mut(TILE_ELEMS))
            .zip(codes.chunks_mut(TILE_CODE_BYTES))
        {
            counts.push(encode_tile(s, lo, m, c, &mut esc));
        }
        (esc, counts)
    };
    if threads == 1 {
        return vec![run(data, sm, codes)];
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = data
            .chunks(per * TILE_ELEMS * 2)
            .zip(sm.chunks_mut(per * TILE_ELEMS))
            .zip(codes.chunks_mut(per * TILE_CODE_BYTES))
            .map(|((d, m), c)| s.spawn(move || run(d, m, c)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// Writes a window3 blob's header, escape index and escapes (`blob` is
/// the whole blob, `layout.total_bytes` long, its first two sections
/// already written by [`encode_tiles`], which gave `parts`).
fn write_window3_tail(blob: &mut [u8], layout: &Layout, lo: u8, parts: &TileParts) {
    Header {
        code: Code::Window3 { lo },
        decoded_bytes: 2 * layout.elems,
        n_tiles: layout.n_tiles,
        offsets: [
            layout.signman.start,
            layout.codes.start,
            layout.esc_index.start,
            layout.escapes.start,
        ],
        total_bytes: layout.total_bytes,
    }
    .write(blob);
    let mut idx = layout.esc_index.start as usize;
    let mut esc_at = layout.escapes.start as usize;
    let mut cum = 0u32;
    blob[idx..idx + 4].copy_from_slice(&0u32.to_le_bytes());
    for (esc, counts) in parts {
        for c in counts {
            cum += c;
            idx += 4;
            blob[idx..idx + 4].copy_from_slice(&cum.to_le_bytes());
        }
        blob[esc_at..esc_at + esc.len()].copy_from_slice(esc);
        esc_at += esc.len();
    }
}

/// Checks window3 arguments: even length, `lo` in range, at most
/// `u32::MAX` weights; the weights.
fn window3_weights(data: &[u8], lo: u8) -> Result<u64, EncodeError> {
    if !data.len().is_multiple_of(2) {
        return Err(EncodeError::OddLength { bytes: data.len() });
    }
    if lo > MAX_LO {
        return Err(EncodeError::WindowOutOfRange { lo });
    }
    let elems = (data.len() / 2) as u64;
    if elems > u64::from(u32::MAX) {
        return Err(EncodeError::TooLarge { elems });
    }
    Ok(elems)
}

/// Encodes bf16 data with the window starting at `lo`, tiles spread over
/// `threads` threads (no verification: [`encode_bf16`] does that).
pub fn encode_window3(data: &[u8], lo: u8, threads: usize) -> Result<Encoded, EncodeError> {
    let elems = window3_weights(data, lo)?;
    let bare = Layout::window3(elems, 0).expect("an in-memory tensor's layout fits");
    // The sections before the escapes do not depend on them: encode into
    // the blob itself (one allocation, no copy), grown for the escapes.
    let mut blob = vec![0u8; bare.escapes.start as usize];
    let (sm, codes) = blob[HEADER_BYTES..bare.esc_index.start as usize]
        .split_at_mut(bare.n_tiles as usize * TILE_ELEMS);
    let parts = encode_tiles(data, lo, threads, sm, codes);
    let escapes: u64 = parts.iter().map(|(e, _)| e.len() as u64).sum();
    let layout = Layout::window3(elems, escapes).expect("an in-memory tensor's layout fits");
    blob.resize(layout.total_bytes as usize, 0);
    write_window3_tail(&mut blob, &layout, lo, &parts);
    Ok(Encoded {
        blob,
        stats: Stats {
            code: Code::Window3 { lo },
            decoded_bytes: data.len() as u64,
            packed_bytes: layout.total_bytes,
            escapes,
        },
    })
}

/// Encodes a tensor with the code and figures [`plan_bf16`] gave
/// (`planned`) into `out`: zeroed, exactly `planned.packed_bytes` long
/// (a block's blob writes each tensor in place, no blob of its own and no
/// copy). `Err` where `out` has another length, and where the escapes the
/// encoding found are not the plan's (then `out` holds no valid blob).
pub fn encode_into(
    data: &[u8],
    planned: &Stats,
    threads: usize,
    out: &mut [u8],
) -> Result<(), EncodeError> {
    let length = |expected: u64| {
        if out.len() as u64 == expected {
            Ok(())
        } else {
            Err(EncodeError::OutputLength {
                expected,
                found: out.len() as u64,
            })
        }
    };
    match planned.code {
        Code::Raw => {
            length(Layout::raw_bytes(data.len() as u64))?;
            Header {
                code: Code::Raw,
                decoded_bytes: data.len() as u64,
                n_tiles: 0,
                offsets: [HEADER_BYTES as u64, 0, 0, 0],
                total_bytes: out.len() as u64,
            }
            .write(out);
            out[HEADER_BYTES..HEADER_BYTES + data.len()].copy_from_slice(data);
            Ok(())
        }
        Code::Window3 { lo } => {
            let elems = window3_weights(data, lo)?;
            let layout =
                Layout::window3(elems, planned.escapes).ok_or(EncodeError::TooLarge { elems })?;
            length(layout.total_bytes)?;
            let (sm, codes) = out[HEADER_BYTES..layout.esc_index.start as usize]
                .split_at_mut(layout.n_tiles as usize * TILE_ELEMS);
            let parts = encode_tiles(data, lo, threads, sm, codes);
            let found: u64 = parts.iter().map(|(e, _)| e.len() as u64).sum();
            if found != planned.escapes {
                return Err(EncodeError::EscapesNotPlanned {
                    planned: planned.escapes,
                    found,
                });
            }
            write_window3_tail(out, &layout, lo, &parts);
            Ok(())
        }
    }
}
