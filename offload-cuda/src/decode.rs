//! The GPU half of `offload-pack`'s window3 code: its decoder kernel
//! (`offload_pack::kernels::DECODE_CU`, CUDA C compiled once per process
//! with nvrtc, as the proxy's kernels are) loaded into a context, and a
//! launch over a table of tensors on a stream. This is the device end of a
//! compressed block's transport; the ring engine's decode stage (CONTRACT
//! §7) is what orders it (copy landed → decode → slot ready; staging buffer
//! reused after the decode that read it). `offload-decode-bench` measures
//! it alone.

use std::ffi::{CString, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};
use offload_core::device::Device;

use crate::proxy::{Module, compile};
use crate::{CudaBuffer, CudaDevice, CudaError, CudaStream};

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
        Self::load(device, ptx)
    }

    /// A decoder compiled from `src` instead (a checking run's planted
    /// kernel: the same entry point and table).
    pub fn from_source(device: &CudaDevice, src: &str) -> Result<Self, DecodeError> {
        let ptx = compile(src).map_err(DecodeError::Nvrtc)?;
        Self::load(device, &ptx)
    }

    fn load(device: &CudaDevice, ptx: &CString) -> Result<Self, DecodeError> {
        device.bind()?;
        // SAFETY: `ptx` is a NUL-terminated PTX module; the context is current.
        let raw = driver(
            unsafe { result::module::load_data(ptx.as_ptr().cast()) },
            "cuModuleLoadData(offload-pack decoder)",
        )?;
        let module = Module {
            ctx: Arc::clone(device.context()),
            raw,
        };
        let name = CString::new(offload_pack::kernels::DECODE_KERNEL)
            .map_err(|e| DecodeError::Nvrtc(e.to_string()))?;
        // SAFETY: the module is loaded and defines the kernel.
        let function = driver(
            unsafe { result::module::get_function(module.raw, name) },
            "cuModuleGetFunction(opk_decode_window3)",
        )?;
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
        Ok(v[0] != 0)
    }
}
