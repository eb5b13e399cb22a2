//! The simulated device's lossless block codec (CONTRACT §7b):
//! `offload-pack`'s coded blocks, decoded by [`SimDevice::decode`] on the
//! decode engine at simulated time.
//!
//! * Without a payload divisor every byte is real: [`Codec::encode`] runs
//!   `offload-pack`'s block encoder (its round trip checked) and the decode
//!   runs its CPU decoder on the bytes the staging buffer holds when the
//!   decode starts, so a decode that starts before its copy has landed, or
//!   reads a staging buffer already overwritten, writes other bytes (or
//!   zeros, where they do not decode) and the output differs.
//! * With a payload divisor `d` only one byte in `d` exists, which no code
//!   can decode. The coded size is then estimated from a sample of each
//!   tensor (its first 256 KiB, the same law throughout a synthetic tensor),
//!   and the blob carries, in its first eight kept bytes, the number of the
//!   encode that made it; the decode reads that number from the staging
//!   buffer at its start and writes that block's kept bytes. A decode that
//!   reads the wrong staging contents still writes the wrong block.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use offload_core::device::{ByteSource, Codec, CodecSpan, Coded};
use offload_pack::block::{self, BlockView, Span};
use offload_pack::format::{Code, EncodeConfig, Layout, TILE_ELEMS, plan_bf16};

use crate::device::{Sim, SimDevice, SimDeviceBuffer, SimError, SimStream};

/// Bytes of each tensor a sampled estimate encodes.
const SAMPLE_BYTES: u64 = 256 << 10;

/// `offload-pack`'s coded blocks on one simulated device.
pub struct SimCodec {
    device: SimDevice,
    /// Sampled mode: each encode's kept unit bytes, by its number.
    sampled: Arc<Mutex<BTreeMap<u64, Vec<u8>>>>,
    next: AtomicU64,
    /// The device's `decode_errors` at the last [`Codec::check`].
    checked_errors: AtomicU64,
}

impl std::fmt::Debug for SimCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimCodec").finish_non_exhaustive()
    }
}

impl SimCodec {
    /// The codec of `device`.
    pub fn new(device: &SimDevice) -> Self {
        Self {
            device: device.clone(),
            sampled: Arc::new(Mutex::new(BTreeMap::new())),
            next: AtomicU64::new(1),
            checked_errors: AtomicU64::new(device.stats().decode_errors),
        }
    }

    fn config() -> EncodeConfig {
        EncodeConfig {
            threads: 1,
            ..EncodeConfig::default()
        }
    }

    fn spans(spans: &[CodecSpan]) -> Vec<Span> {
        spans.iter().map(Span::from).collect()
    }

    /// The coded size and work items of `unit` estimated from a sample of
    /// each span (gaps raw), laid out as `offload-pack`'s block encoder
    /// lays it out.
    /// The coded size of a unit of `len` bytes over `spans` (`unit` its
    /// bytes), estimated from a sample of each bf16 tensor (256 KiB) as
    /// the sampled mode sizes its blobs: what `offload-sim plan` prices a
    /// coded block at (CONTRACT §7b).
    pub fn estimated_bytes(unit: &dyn ByteSource, len: u64, spans: &[CodecSpan]) -> u64 {
        Self::estimate(unit, len, spans).0
    }

    fn estimate(unit: &dyn ByteSource, len: u64, spans: &[CodecSpan]) -> (u64, u64) {
        let align = |x: u64| x.div_ceil(64) * 64;
        let mut pieces: Vec<(u64, bool, u64)> = Vec::new(); // (bytes, bf16, offset)
        let mut at = 0;
        for s in spans {
            if s.offset > at {
                pieces.push((s.offset - at, false, at));
            }
            if s.bytes > 0 {
                pieces.push((s.bytes, s.bf16, s.offset));
            }
            at = s.offset + s.bytes;
        }
        if at < len {
            pieces.push((len - at, false, at));
        }
        let mut total =
            align((block::BLOCK_HEADER_BYTES + block::ENTRY_BYTES * pieces.len()) as u64);
        let mut work = 0;
        for (bytes, bf16, offset) in pieces {
            let raw = Layout::raw_bytes(bytes);
            let mut coded = None;
            if bf16 && bytes.is_multiple_of(2) && bytes / 2 >= TILE_ELEMS as u64 {
                let n = (bytes.min(SAMPLE_BYTES) / 2 * 2) as usize;
                let mut sample = vec![0u8; n];
                unit.read_at(offset, &mut sample);
                if let Ok(stats) = plan_bf16(&sample, &Self::config())
                    && matches!(stats.code, Code::Window3 { .. })
                {
                    let per_byte = stats.packed_bytes as f64 / n as f64;
                    let est = align((per_byte * bytes as f64).ceil() as u64);
                    if est < raw {
                        coded = Some(est);
                    }
                }
            }
            match coded {
                Some(est) => {
                    total += est;
                    work += (bytes / 2).div_ceil(TILE_ELEMS as u64);
                }
                None => {
                    total += raw;
                    work += bytes.div_ceil(block::RAW_CHUNK);
                }
            }
        }
        (total, work)
    }
}

impl Codec<Sim> for SimCodec {
    fn name(&self) -> &str {
        "offload-pack OPB1 window3 (simulated decode)"
    }

    /// `offload-pack OPB1` where every payload byte is kept (a coded-block
    /// file's blobs decode for real); none with a payload divisor, whose
    /// blobs are this codec's own.
    fn format(&self) -> Option<&str> {
        (self.device.payload_divisor() == 1).then_some(offload_pack::blocks_file::BLOCKS_FORMAT)
    }

    fn encode(
        &self,
        unit: &dyn ByteSource,
        len: u64,
        spans: &[CodecSpan],
    ) -> Result<Coded, String> {
        self.device.note_encode(len);
        let d = self.device.payload_divisor();
        if d == 1 {
            let mut bytes = vec![0u8; len as usize];
            unit.read_at(0, &mut bytes);
            let b = block::encode_block(&bytes, &Self::spans(spans), &Self::config())
                .map_err(|e| e.to_string())?;
            return Ok(Coded {
                blob: b.blob,
                work: b.work,
            });
        }
        let (size, work) = Self::estimate(unit, len, spans);
        let size = size.max(8 * d);
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut kept = Vec::with_capacity(len.div_ceil(d) as usize);
        let mut byte = [0u8; 1];
        for p in (0..len).step_by(d as usize) {
            unit.read_at(p, &mut byte);
            kept.push(byte[0]);
        }
        self.sampled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, kept);
        let mut blob = vec![0u8; size as usize];
        for (k, b) in id.to_le_bytes().into_iter().enumerate() {
            blob[k * d as usize] = b;
        }
        Ok(Coded { blob, work })
    }

    /// Exact without a payload divisor (`offload-pack`'s `plan_block`, no
    /// encode); with one, the sampled estimate the blob is sized by.
    fn coded_len(
        &self,
        unit: &(dyn ByteSource + Sync),
        len: u64,
        spans: &[CodecSpan],
    ) -> Result<Option<u64>, String> {
        let d = self.device.payload_divisor();
        if d == 1 {
            return block::plan_block(unit, len, &Self::spans(spans), &Self::config())
                .map(|p| Some(p.blob_bytes))
                .map_err(|e| e.to_string());
        }
        Ok(Some(Self::estimate(unit, len, spans).0.max(8 * d)))
    }

    /// `Err` when decodes since the last check found no whole coded block
    /// (the device's `decode_errors` grew), as a GPU decoder's error flag.
    fn check(&self) -> Result<(), SimError> {
        let now = self.device.stats().decode_errors;
        let before = self.checked_errors.swap(now, Ordering::Relaxed);
        if now > before {
            return Err(SimError {
                operation: "decode".to_owned(),
                kind: offload_core::device::DeviceErrorKind::Other,
                detail: format!(
                    "{} decode(s) found no whole coded block in their staging buffer (their slot got zeros)",
                    now - before
                ),
                shortfall_bytes: None,
            });
        }
        Ok(())
    }

    unsafe fn decode(
        &self,
        stream: &SimStream,
        src: &SimDeviceBuffer,
        coded_bytes: u64,
        _work: u64,
        dst: &SimDeviceBuffer,
        decoded_bytes: u64,
    ) -> Result<(), SimError> {
        let d = self.device.payload_divisor();
        let sampled = Arc::clone(&self.sampled);
        let decode = move |input: &[u8]| -> Option<Vec<u8>> {
            if d == 1 {
                let view = BlockView::parse(input).ok()?;
                if view.decoded_bytes() != decoded_bytes {
                    return None;
                }
                let mut out = vec![0u8; decoded_bytes as usize];
                view.decode_into(&mut out, 1).ok()?;
                Some(out)
            } else {
                let id = u64::from_le_bytes(input.get(..8)?.try_into().ok()?);
                sampled
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&id)
                    .cloned()
            }
        };
        self.device.decode(
            stream,
            (src, coded_bytes),
            (dst, decoded_bytes),
            Arc::new(decode),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sampled_estimate_is_near_the_real_size_on_normal_weights() {
        // 2 × 300 K normal weights and a raw gap.
        let mut unit = Vec::new();
        let mut z = 7u64;
        for _ in 0..600_000 {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u1 = ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u2 = (z >> 11) as f64 / (1u64 << 53) as f64;
            let v = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * 0.02;
            unit.extend_from_slice(&(((v as f32).to_bits() >> 16) as u16).to_le_bytes());
        }
        unit.extend_from_slice(&[1u8; 100]);
        let spans = [
            CodecSpan {
                offset: 0,
                bytes: 600_000,
                bf16: true,
            },
            CodecSpan {
                offset: 600_000,
                bytes: 600_000,
                bf16: true,
            },
        ];
        let real =
            block::encode_block(&unit, &SimCodec::spans(&spans), &SimCodec::config()).unwrap();
        let (est, work) = SimCodec::estimate(&unit.as_slice(), unit.len() as u64, &spans);
        assert_eq!(work, real.work);
        let err = (est as f64 - real.blob.len() as f64).abs() / real.blob.len() as f64;
        assert!(
            err < 0.01,
            "estimate {est} vs {} ({err:.4})",
            real.blob.len()
        );
        assert!((real.blob.len() as f64) < 0.75 * unit.len() as f64);
    }
}
