//! The GPU half of `offload-pack`'s window3 code: its decoder kernel
//! (`offload_pack::kernels::DECODE_CU`, CUDA C compiled once per process
//! with nvrtc, as the proxy's kernels are) loaded into a context, and a
//! launch over a table of tensors on a stream. This is the device end of a
//! compressed block's transport; the ring engine's decode stage (CONTRACT
//! §7) is what orders it (copy landed → decode → slot ready; staging buffer
//! reused after the decode that read it). `offload-decode-bench` measures
//! it alone. [`CudaCodec`] is the ring's codec: `offload_pack::block`'s coded
//! blocks, decoded by `opk_decode_block` in one launch a fill.

use std::ffi::{CString, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};
use offload_core::device::{ByteSource, Codec, CodecSpan, Coded, Device, DeviceBuffer};
use offload_pack::block::{Span, encode_block};

use crate::proxy::{Module, compile};
use crate::{Cuda, CudaBuffer, CudaDevice, CudaError, CudaStream};

/// Errors of the decoder.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] CudaError),
    /// nvrtc failed (or its library is missing).
    #[error("nvrtc compiling offload-pack's decoder: {0}")]
    Nvrtc(String),
    /// The launch is larger than one grid.
    #[error("{tiles} tiles in one launch (at most {} )", u32::MAX >> 1)]
    TooManyTiles {
        /// Tiles asked for.
        tiles: u64,
    },
}

fn driver<T>(r: Result<T, result::DriverError>, operation: &str) -> Result<T, DecodeError> {
    r.map_err(|e| DecodeError::Driver(CudaError::new(operation, e.0)))
}

/// One window3 tensor of a launch, as the kernel's `OpkTensor`: the
/// blob's device address (64-byte aligned), the decoded tensor's, and the
/// tiles of the tensors before it in the table (the table sorted by it).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpkTensor {
    /// The blob on the device.
    pub blob: u64,
    /// Where its bf16 values go.
    pub out: u64,
    /// Tiles of the tensors before it.
    pub first_tile: u64,
}

/// The decoder's module and kernel in one context, with a device error
/// flag the kernel raises on a tile whose escape index disagrees with its
/// codes.
pub struct PackDecoder {
    // Drop order: the module goes before the flag's buffer.
    module: Module,
    function: sys::CUfunction,
    /// `opk_decode_block`, from the same module.
    block: sys::CUfunction,
    /// Work items one thread block of `block` takes (its grid is the work
    /// divided by this, rounded up).
    block_items: u32,
    flag: CudaBuffer,
}

// SAFETY: the function handle belongs to the module the decoder owns; the
// driver lets any thread launch it with the context current (every launch
// binds it).
unsafe impl Send for PackDecoder {}
// SAFETY: as above; every method takes `&self` and only enqueues work or
// reads the flag synchronously.
unsafe impl Sync for PackDecoder {}

impl std::fmt::Debug for PackDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackDecoder").finish_non_exhaustive()
    }
}

impl PackDecoder {
    /// The decoder of `offload_pack::kernels::DECODE_CU` on `device`.
    pub fn new(device: &CudaDevice) -> Result<Self, DecodeError> {
        static PTX: OnceLock<Result<CString, String>> = OnceLock::new();
        let ptx = PTX
            .get_or_init(|| compile(offload_pack::kernels::DECODE_CU))
            .as_ref()
            .map_err(|e| DecodeError::Nvrtc(e.clone()))?;
        Self::load(device, ptx, offload_pack::kernels::DECODE_BLOCK_ITEMS)
    }

    /// A decoder compiled from `src` instead (a checking run's planted
    /// kernel: the same entry point and table, `OPK_BLOCK_ITEMS` left at
    /// its default).
    pub fn from_source(device: &CudaDevice, src: &str) -> Result<Self, DecodeError> {
        Self::from_source_with_items(device, src, offload_pack::kernels::DECODE_BLOCK_ITEMS)
    }

    /// A decoder compiled from `src` whose `opk_decode_block` takes
    /// `block_items` work items a thread block (a benchmark's variant that
    /// defines `OPK_BLOCK_ITEMS` so; a larger grid than needed is harmless,
    /// a smaller one leaves items undecoded).
    pub fn from_source_with_items(
        device: &CudaDevice,
        src: &str,
        block_items: u32,
    ) -> Result<Self, DecodeError> {
        let ptx = compile(src).map_err(DecodeError::Nvrtc)?;
        Self::load(device, &ptx, block_items.max(1))
    }

    /// Work items one thread block of `opk_decode_block` takes.
    pub fn block_items(&self) -> u32 {
        self.block_items
    }

    fn load(device: &CudaDevice, ptx: &CString, block_items: u32) -> Result<Self, DecodeError> {
        let module = Module::load(device, ptx, "offload-pack decoder")?;
        let function = module.function(offload_pack::kernels::DECODE_KERNEL)?;
        let block = module.function(offload_pack::kernels::BLOCK_KERNEL)?;
        let flag = device.alloc_device(4)?;
        driver(
            // SAFETY: the flag is ours, 4 bytes, not yet used by any stream.
            unsafe { result::memset_d8_sync(flag.ptr(), 0, 4) },
            "cuMemsetD8(decode flag)",
        )?;
        // A memset of device memory may return before it lands; the first
        // decode (on a non-blocking stream) must see the cleared flag.
        device.synchronize()?;
        Ok(Self {
            module,
            function,
            block,
            block_items,
            flag,
        })
    }

    /// Enqueues on `stream` the decode of the `n` tensors of `table` (a
    /// device array of [`OpkTensor`]), `tiles` tiles in all: one 128-thread
    /// block a tile.
    ///
    /// # Safety
    ///
    /// `table` holds `n` entries sorted by `first_tile`, whose tiles sum to
    /// `tiles`; each entry's blob is a window3 blob in device memory of the
    /// length its header gives and its `out` has room for the decoded
    /// bytes; until an event recorded on `stream` after this call has
    /// completed, the table and blobs are not written or freed, and the
    /// outputs are not read, written or freed, by other work.
    pub unsafe fn decode(
        &self,
        stream: &CudaStream,
        table: &CudaBuffer,
        n: u32,
        tiles: u64,
    ) -> Result<(), DecodeError> {
        if n == 0 || tiles == 0 {
            return Ok(());
        }
        let grid = u32::try_from(tiles)
            .ok()
            .filter(|&g| g <= u32::MAX >> 1)
            .ok_or(DecodeError::TooManyTiles { tiles })?;
        self.module.ctx.bind()?;
        let (mut t, mut count, mut flag) = (table.ptr(), n, self.flag.ptr());
        let mut params: [*mut c_void; 3] = [
            (&raw mut t).cast(),
            (&raw mut count).cast(),
            (&raw mut flag).cast(),
        ];
        // SAFETY: the kernel takes (const OpkTensor*, unsigned, int*), the
        // three locals above (the driver copies them at launch); the table
        // and what it points at are the caller's contract; the flag is ours.
        let launched = unsafe {
            result::launch_kernel(
                self.function,
                (grid, 1, 1),
                (offload_pack::kernels::DECODE_BLOCK_THREADS, 1, 1),
                0,
                stream.raw(),
                &mut params,
            )
        };
        driver(launched, "cuLaunchKernel(opk_decode_window3)")
    }

    /// Enqueues on `stream` the decode of the coded block (`OPB1`,
    /// `offload_pack::block`) of `blob_bytes` at device address `blob`
    /// into the unit at `out` (`out_bytes` of room): the block's `work`
    /// items, [`PackDecoder::block_items`] to a 128-thread block (0
    /// enqueues nothing). The kernel
    /// reads and writes nothing outside those two ranges whatever the
    /// blob holds (a damaged one raises the error flag instead).
    ///
    /// # Safety
    ///
    /// Once `stream` reaches this launch, `blob` holds a block blob that
    /// `offload_pack::block::BlockView::parse` accepts (what
    /// `encode_block` wrote), 256-byte aligned, whose work items are
    /// `work`, and `out` has room for its decoded bytes; until an event
    /// recorded on `stream` after this call has completed, the blob is not
    /// written or freed, and the output is not read, written or freed, by
    /// other work.
    pub unsafe fn decode_block(
        &self,
        stream: &CudaStream,
        (blob, blob_bytes): (sys::CUdeviceptr, u64),
        (out, out_bytes): (sys::CUdeviceptr, u64),
        work: u64,
    ) -> Result<(), DecodeError> {
        if work == 0 {
            return Ok(());
        }
        let grid = u32::try_from(work.div_ceil(u64::from(self.block_items)))
            .ok()
            .filter(|&g| g <= u32::MAX >> 1)
            .ok_or(DecodeError::TooManyTiles { tiles: work })?;
        self.module.ctx.bind()?;
        let (mut b, mut bb, mut o, mut ob, mut flag) =
            (blob, blob_bytes, out, out_bytes, self.flag.ptr());
        let mut params: [*mut c_void; 5] = [
            (&raw mut b).cast(),
            (&raw mut bb).cast(),
            (&raw mut o).cast(),
            (&raw mut ob).cast(),
            (&raw mut flag).cast(),
        ];
        // SAFETY: the kernel takes (const unsigned char*, unsigned long
        // long, unsigned char*, unsigned long long, int*), the five locals
        // above (the driver copies them at launch);
        // the blob and the output are the caller's contract; the flag is
        // ours.
        let launched = unsafe {
            result::launch_kernel(
                self.block,
                (grid, 1, 1),
                (offload_pack::kernels::DECODE_BLOCK_THREADS, 1, 1),
                0,
                stream.raw(),
                &mut params,
            )
        };
        driver(launched, "cuLaunchKernel(opk_decode_block)")
    }

    /// Waits for `stream`, then reads and clears the error flag: whether a
    /// tile decoded since the last call had an inconsistent escape index.
    /// The flag is the decoder's, shared by every stream it launches on:
    /// one stream's decodes at a time between two calls.
    pub fn take_error(
        &self,
        device: &CudaDevice,
        stream: &CudaStream,
    ) -> Result<bool, DecodeError> {
        device.synchronize_stream(stream)?;
        Ok(self.take_flag(device)? != 0)
    }

    /// Reads and clears the error flag (0: no error; 1: a tile's escape
    /// index disagreed with its codes; 2: a block table entry did not hold
    /// its work item), once every stream that launched this decoder's
    /// kernels has been drained by the caller.
    fn take_flag(&self, device: &CudaDevice) -> Result<i32, DecodeError> {
        self.module.ctx.bind()?;
        let mut v = [0i32; 1];
        driver(
            // SAFETY: the flag holds one i32; the stream that wrote it is drained.
            unsafe { result::memcpy_dtoh_sync(&mut v, self.flag.ptr()) },
            "cuMemcpyDtoH(decode flag)",
        )?;
        driver(
            // SAFETY: as above.
            unsafe { result::memset_d8_sync(self.flag.ptr(), 0, 4) },
            "cuMemsetD8(decode flag)",
        )?;
        // The clear lands before any later decode is enqueued.
        device.synchronize()?;
        Ok(v[0])
    }
}

/// What a [`CudaCodec`] has decoded since it was made: its launches and
/// the bytes they read (coded, what the link carried) and wrote (decoded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CodecStats {
    /// Decodes enqueued (one launch a block fill).
    pub decodes: u64,
    /// Coded bytes those decodes read.
    pub coded_bytes: u64,
    /// Bytes they wrote into slots.
    pub decoded_bytes: u64,
}

/// The lossless block code on CUDA ([`offload_core::device::Codec`],
/// CONTRACT §7b): `offload_pack::block`'s coded blocks, encoded on the host
/// at enable (window3 where it pays, raw otherwise, every block's round
/// trip checked by the encoder) and decoded by `opk_decode_block` (one
/// launch a fill, on the stream the ring engine gives, after a
/// perturbation point as a copy has).
///
/// One per device: it holds the device's loaded decoder module (share one
/// [`PackDecoder`] with [`CudaCodec::with_decoder`] where the module is
/// already loaded). Its error flag is the decoder's: read it with
/// [`CudaCodec::take_error`].
pub struct CudaCodec {
    device: Arc<CudaDevice>,
    decoder: Arc<PackDecoder>,
    config: offload_pack::format::EncodeConfig,
    decodes: AtomicU64,
    coded_bytes: AtomicU64,
    decoded_bytes: AtomicU64,
}

impl std::fmt::Debug for CudaCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCodec")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl CudaCodec {
    /// The codec of `device`, its decoder compiled (once per process) and
    /// loaded here.
    pub fn new(device: &Arc<CudaDevice>) -> Result<Self, DecodeError> {
        Ok(Self::with_decoder(
            device,
            Arc::new(PackDecoder::new(device)?),
        ))
    }

    /// The codec of `device` over a decoder already loaded in its context
    /// (a planted kernel's, or one shared with other users).
    pub fn with_decoder(device: &Arc<CudaDevice>, decoder: Arc<PackDecoder>) -> Self {
        Self {
            device: Arc::clone(device),
            decoder,
            config: offload_pack::format::EncodeConfig::default(),
            decodes: AtomicU64::new(0),
            coded_bytes: AtomicU64::new(0),
            decoded_bytes: AtomicU64::new(0),
        }
    }

    /// The decoder it launches.
    pub fn decoder(&self) -> &Arc<PackDecoder> {
        &self.decoder
    }

    /// Drains the device, then reads and clears the decoder's error flag:
    /// 0 when every decode since the last call was consistent, 1 when a
    /// tile's escape index disagreed with its codes, 2 when a block's
    /// table entry did not hold its work item.
    pub fn take_error(&self) -> Result<i32, DecodeError> {
        self.device.synchronize()?;
        self.decoder.take_flag(&self.device)
    }

    /// Decodes enqueued so far and their bytes.
    pub fn stats(&self) -> CodecStats {
        CodecStats {
            decodes: self.decodes.load(Ordering::Relaxed),
            coded_bytes: self.coded_bytes.load(Ordering::Relaxed),
            decoded_bytes: self.decoded_bytes.load(Ordering::Relaxed),
        }
    }
}

/// [`CudaCodec`]'s encoder, which needs no device: the unit's `len` bytes
/// read from `unit`, coded by `offload_pack::block::encode_block` (its
/// round trip checked unless `cfg.verify` is off) over `spans`; the reason
/// as text where it refuses.
pub fn encode_unit(
    unit: &dyn ByteSource,
    len: u64,
    spans: &[CodecSpan],
    cfg: &offload_pack::format::EncodeConfig,
) -> Result<Coded, String> {
    let n = usize::try_from(len).map_err(|_| format!("a unit of {len} bytes"))?;
    let mut bytes = vec![0u8; n];
    unit.read_at(0, &mut bytes);
    let block = encode_block(&bytes, &pack_spans(spans), cfg).map_err(|e| e.to_string())?;
    Ok(Coded {
        blob: block.blob,
        work: block.work,
    })
}

/// The exact length of the blob [`encode_unit`] gives, without encoding
/// (`offload_pack::block::plan_block`: each tensor's exponent histogram,
/// the unit read in pieces).
pub fn coded_len_of_unit(
    unit: &(dyn ByteSource + Sync),
    len: u64,
    spans: &[CodecSpan],
    cfg: &offload_pack::format::EncodeConfig,
) -> Result<u64, String> {
    offload_pack::block::plan_block(unit, len, &pack_spans(spans), cfg)
        .map(|p| p.blob_bytes)
        .map_err(|e| e.to_string())
}

fn pack_spans(spans: &[CodecSpan]) -> Vec<Span> {
    spans.iter().map(Span::from).collect()
}

/// A decoder error as the device trait's error: a driver error as it is,
/// anything else (nvrtc, an oversized grid) with `CUDA_ERROR_INVALID_VALUE`.
fn as_cuda(e: DecodeError) -> CudaError {
    match e {
        DecodeError::Driver(e) => e,
        other => CudaError::new(
            other.to_string(),
            sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
        ),
    }
}

impl Codec<Cuda> for CudaCodec {
    fn name(&self) -> &str {
        "offload-pack OPB1"
    }

    fn format(&self) -> Option<&str> {
        Some(offload_pack::blocks_file::BLOCKS_FORMAT)
    }

    /// The kernel's error flag, read and cleared: `Err` naming it where a
    /// tile's escape index disagreed with its codes (1) or a table entry
    /// did not fit the blob or the slot (2).
    fn check(&self) -> Result<(), CudaError> {
        match self.take_error() {
            Ok(0) => Ok(()),
            Ok(flag) => Err(CudaError::new(
                format!(
                    "opk_decode_block raised its error flag ({flag}: {}); the slot kept its previous bytes",
                    if flag == 1 {
                        "a tile's escape index disagrees with its codes"
                    } else {
                        "a table entry does not fit the blob or the slot"
                    }
                ),
                sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
            )),
            Err(e) => Err(as_cuda(e)),
        }
    }

    fn encode(
        &self,
        unit: &dyn ByteSource,
        len: u64,
        spans: &[CodecSpan],
    ) -> Result<Coded, String> {
        encode_unit(unit, len, spans, &self.config)
    }

    fn coded_len(
        &self,
        unit: &(dyn ByteSource + Sync),
        len: u64,
        spans: &[CodecSpan],
    ) -> Result<Option<u64>, String> {
        coded_len_of_unit(unit, len, spans, &self.config).map(Some)
    }

    unsafe fn decode(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer,
        coded_bytes: u64,
        work: u64,
        dst: &CudaBuffer,
        decoded_bytes: u64,
    ) -> Result<(), CudaError> {
        let refuse = |what: String| {
            Err(CudaError::new(
                what,
                sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
            ))
        };
        if coded_bytes > src.len_bytes() || decoded_bytes > dst.len_bytes() {
            return refuse(format!(
                "opk_decode_block: {coded_bytes} coded bytes in a {}-byte staging buffer, {decoded_bytes} decoded bytes in a {}-byte slot",
                src.len_bytes(),
                dst.len_bytes()
            ));
        }
        if work > 0 && coded_bytes < offload_pack::block::BLOCK_HEADER_BYTES as u64 {
            return refuse(format!(
                "opk_decode_block: {work} work items in {coded_bytes} coded bytes (less than a block header)"
            ));
        }
        if work == 0 {
            return Ok(());
        }
        self.device.perturb(stream)?;
        // SAFETY: the caller's contract (Codec::decode) is this launch's:
        // `src` holds the blob `encode` returned (BlockView::parse accepts
        // it: encode_block checked its round trip through that parser),
        // with these `work` items, once the stream reaches it; device
        // allocations are 256-byte aligned; `dst` has room for the
        // `decoded_bytes` (checked above) the blob decodes to; neither is
        // touched by other work until an event after it completes.
        unsafe {
            self.decoder.decode_block(
                stream,
                (src.ptr(), coded_bytes),
                (dst.ptr(), decoded_bytes),
                work,
            )
        }
        .map_err(as_cuda)?;
        self.decodes.fetch_add(1, Ordering::Relaxed);
        self.coded_bytes.fetch_add(coded_bytes, Ordering::Relaxed);
        self.decoded_bytes
            .fetch_add(decoded_bytes, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use offload_core::device::{CodecSpan, coded_bound};
    use offload_pack::block::{BlockView, decode_block};
    use offload_pack::format::EncodeConfig;
    use offload_pack::synth::{Law, tensor_bytes};

    /// The codec's encoder on a block-shaped unit (two normal bf16
    /// weights, a raw f32 norm between them, a gap): its blob parses with
    /// the work items it reports, decodes to the unit, stays within
    /// `coded_bound` and codes the weights (under 0.8 of the bytes); bad
    /// spans are refused with a reason.
    #[test]
    fn the_encoder_gives_a_block_the_kernel_can_decode() {
        let all = vec![
            ("b.q.weight".to_owned(), vec![512u64, 512]),
            ("b.norm_q.weight".to_owned(), vec![512u64]),
            ("b.up.weight".to_owned(), vec![1024u64, 512]),
        ];
        let q = tensor_bytes(Law::Normal, 3, 0, &all[0].0, &all[0].1, &all, 2);
        let up = tensor_bytes(Law::Normal, 3, 2, &all[2].0, &all[2].1, &all, 2);
        let norm: Vec<u8> = (0..2048u32).map(|i| (i * 37) as u8).collect();
        let mut unit = q.clone();
        unit.extend_from_slice(&norm);
        unit.extend_from_slice(&[0u8; 6]);
        let up_at = unit.len() as u64;
        unit.extend_from_slice(&up);
        let spans = [
            CodecSpan {
                offset: 0,
                bytes: q.len() as u64,
                bf16: true,
            },
            CodecSpan {
                offset: q.len() as u64,
                bytes: norm.len() as u64,
                bf16: false,
            },
            CodecSpan {
                offset: up_at,
                bytes: up.len() as u64,
                bf16: true,
            },
        ];
        let len = unit.len() as u64;
        let coded = super::encode_unit(&unit, len, &spans, &EncodeConfig::default()).unwrap();
        let view = BlockView::parse(&coded.blob).unwrap();
        assert_eq!(view.work(), coded.work);
        assert_eq!(view.decoded_bytes(), len);
        assert!(coded.blob.len() as u64 <= coded_bound(len, spans.len()));
        assert!(
            (coded.blob.len() as u64) * 10 < len * 8,
            "{} of {len} bytes",
            coded.blob.len()
        );
        let mut back = vec![0u8; unit.len()];
        decode_block(&coded.blob, &mut back, 2).unwrap();
        assert_eq!(back, unit);
        let overlapping = [
            spans[0],
            CodecSpan {
                offset: 8,
                ..spans[1]
            },
        ];
        let e = super::encode_unit(&unit, len, &overlapping, &EncodeConfig::default()).unwrap_err();
        assert!(e.contains("overlaps"), "{e}");
    }

    /// Where nvrtc is found (the toolkit's lib on `LD_LIBRARY_PATH`; no GPU
    /// needed), the decoder source compiles as the device will compile it,
    /// and defines both kernels.
    #[test]
    fn the_decoder_compiles_with_nvrtc_where_found() {
        // SAFETY: only probes for the shared library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            println!("skipped: libnvrtc not found (LD_LIBRARY_PATH)");
            return;
        }
        let ptx = crate::proxy::compile(offload_pack::kernels::DECODE_CU)
            .unwrap_or_else(|log| panic!("nvrtc: {log}"));
        let ptx = ptx.to_string_lossy();
        for kernel in [
            offload_pack::kernels::DECODE_KERNEL,
            offload_pack::kernels::BLOCK_KERNEL,
        ] {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{kernel} missing from the PTX"
            );
        }
    }
}
