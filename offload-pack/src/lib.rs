//! `offload-pack`: a lossless compressed host format for bf16 weights.
//!
//! A trained bf16 weight's exponent carries about 2.6 bits of its 8. Per
//! tensor, the encoder keeps each weight's sign and mantissa as one raw byte
//! and codes its exponent in 3 bits: the 7-wide window of exponents that
//! covers the most weights is coded 1 to 7, code 0 is an escape whose
//! exponent byte is stored apart. Tensors where that does not pay (norms,
//! biases, anything under one tile, or larger coded than raw) stay raw. On
//! weights drawn like trained ones a Flux-sized DiT packs to about 0.70 of
//! its bf16 bytes (`docs/PACKED_FORMAT.md`, and `offload-pack --synthetic`).
//!
//! The layout is for a GPU decoder ([`kernels::DECODE_CU`]): 4,096-weight
//! tiles that one 128-thread block decodes alone, sections on 64-byte
//! boundaries, a per-tile escape index found by popcount and a block scan,
//! no bit stream running across a tensor. [`format::Packed::decode_tile`]
//! is the CPU reference in the kernel's shape.
//!
//! - [`format`](mod@format): one tensor's blob: header, sections, encoder
//!   ([`format::encode_bf16`], its round trip always checked), validating
//!   parser and decoders (typed [`format::DecodeError`]s on any input).
//! - [`container`]: packed checkpoints (a safetensors container of blobs,
//!   the manifest in its metadata): [`container::pack_checkpoint`], the
//!   loader [`container::PackedCheckpoint`] (memory-mapped; per tensor its
//!   packed window and a host region to register in place) and the
//!   fallback [`container::encode_in_memory`].
//! - [`synth`]: Flux-shaped synthetic models (normal, Student-t ν = 4,
//!   uniform) and their ratios.
//! - [`block`]: one streamed block's coded bytes (its tensors' blobs behind
//!   a table), what a ring engine stages and decodes in one launch.
//! - [`blocks_file`]: a coded-block checkpoint (every streamed block's
//!   coded bytes, mapped and registered in place at enable) and
//!   [`blocks_file::WithCodedBlocks`], the weight source that hands them out.
//! - [`kernels`]: the CUDA C decoder for nvrtc.

pub mod block;
pub mod blocks_file;
pub mod container;
pub mod format;
pub mod kernels;
pub mod synth;

pub use container::{
    PackError, PackReport, PackedCheckpoint, PackedModel, PackedWindow, TensorIn, encode_in_memory,
    pack_checkpoint,
};
pub use format::{Code, DecodeError, EncodeConfig, EncodeError, Packed, Stats};

/// Checks a byte ratio against its target: `Err` naming both where the
/// ratio is above it (or not a number).
pub fn check_ratio(what: &str, ratio: f64, target: f64) -> Result<(), String> {
    if ratio <= target {
        Ok(())
    } else {
        Err(format!(
            "{what}: packed / bf16 bytes = {ratio:.4}, above the target {target:.4}"
        ))
    }
}
