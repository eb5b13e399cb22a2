//! The compute proxy of the GPU suite and the benchmark: cuBLAS bf16 GEMMs
//! over a block's own weights with their real shapes, attention (by
//! default fused as FlashAttention computes it, `attention.cu`; or as
//! batched GEMMs that materialize the scores, [`Attention`]), and two
//! nvrtc kernels (`kernels.cu`) that make the output depend on every byte
//! read, in order.
//!
//! * [`Proxy::fold`] adds bytes into a per-block accumulator `sum` (an
//!   integer sum: thread order does not change it). The caller folds every
//!   weight view of a block; [`Proxy::linear`] folds the first row its GEMM
//!   produced and [`Proxy::attention`] the first row of its output O (which
//!   sums over every token).
//! * [`Proxy::chain`], after each block, mixes `sum` into a device `state`
//!   (non-commutative), clears `sum`, and rewrites the first activations
//!   from the state, so the next block's GEMMs depend on everything before.
//! * [`Proxy::read_output`] returns the state.
//!
//! The output is therefore a function of every weight byte each block read,
//! of the block order, and of the token count.
//!
//! With `OFFLOAD_PROXY_NO_GEMM` set, the cuBLAS GEMMs and their output
//! folds are skipped (the weight folds, the chain and the fused attention,
//! all ours, still run): compute-sanitizer's racecheck cannot run cuBLAS's
//! Hopper kernels (it fails inside the sanitizer on their hardware
//! barriers), and our own kernels are what it should check.

use std::ffi::{CStr, CString, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::cublas::{result as cublas, sys as cublas_sys};
use cudarc::driver::{result, sys};
use offload_core::device::{Device, DeviceBuffer};

use crate::{CudaBuffer, CudaContext, CudaDevice, CudaError, CudaStream};

/// The proxy's kernels (CUDA C, compiled once per process with nvrtc).
const KERNELS_SRC: &str = include_str!("kernels.cu");

/// The fused attention kernels (CUDA C for `compute_80`: `mma.sync` and
/// `ldmatrix`), compiled once per process with nvrtc. Public so that a
/// check can compile a planted copy ([`FlashKernels::from_source`]).
pub const ATTENTION_SRC: &str = include_str!("attention.cu");

/// The virtual architecture [`ATTENTION_SRC`] is compiled for: the least
/// with bf16 `mma.sync` (Ampere); the driver JITs it for the device.
const ATTENTION_ARCH: &str = "compute_80";

/// How [`Proxy::attention`] computes attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Attention {
    /// Fused, as the models' runtimes run it (FlashAttention-2's forward:
    /// the scores stay on the SM, an online softmax): compute-bound, as a
    /// DiT's attention is in candle (`candle-flash-attn`), diffusers (SDPA)
    /// and ComfyUI.
    #[default]
    Flash,
    /// Two cuBLAS batched GEMMs per batch of heads, the scores written to
    /// and read back from device memory (no softmax): the same FLOPs, but
    /// bound by memory traffic, and measured to lose 2–3.6 % beside
    /// host-to-device copies (BENCHMARKS). Head dimensions other than 64
    /// and 128 run this way under either kind.
    Materialized,
}

impl Attention {
    /// Every kind, with the name `offload-bench --attention` takes.
    pub const ALL: [(Self, &'static str); 2] =
        [(Self::Flash, "flash"), (Self::Materialized, "materialized")];

    /// Its name (`flash` or `materialized`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Flash => "flash",
            Self::Materialized => "materialized",
        }
    }
}

impl std::str::FromStr for Attention {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .iter()
            .find(|(_, n)| *n == s)
            .map(|(k, _)| *k)
            .ok_or_else(|| {
                format!("unknown attention {s:?}; expected \"flash\" or \"materialized\"")
            })
    }
}

/// Activations the chain kernel rewrites after each block (bf16 elements):
/// at least the widest `in_features` of Flux.1-dev (15,360), so a GEMM's
/// first output row depends on the state.
pub const CHAIN_ELEMENTS: u64 = 16384;

/// The most bytes of attention scores one batch of heads holds
/// ([`Proxy::attention`]): 256 MiB.
pub const ATTENTION_SCORES_BYTES: u64 = 256 << 20;

/// The most bytes one pass of [`Proxy::traffic`] reads (and writes): 256 MiB.
pub const TRAFFIC_REGION_BYTES: u64 = 256 << 20;

/// cuBLAS's workspace, ours rather than its own: NVIDIA's recommended size
/// for Hopper (4 MiB suffices before it). Without one, cuBLAS 12.2+ takes
/// its workspace from the device's stream-ordered pool on each call, which
/// would count in the allocator's high-water mark beside the weights.
pub const CUBLAS_WORKSPACE_BYTES: u64 = 32 << 20;

/// Errors of the proxy.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] CudaError),
    /// cuBLAS failed (or its library is missing).
    #[error("cuBLAS {operation}: {message}")]
    Cublas {
        /// The call.
        operation: &'static str,
        /// What it said.
        message: String,
    },
    /// nvrtc failed (or its library is missing).
    #[error("nvrtc: {0}")]
    Nvrtc(String),
    /// An operation needs more scratch than the proxy was built with.
    #[error(
        "{operation} needs {needed_bytes} bytes of {buffer} scratch; the proxy has {have_bytes} (build it larger)"
    )]
    Scratch {
        /// The operation, with its shape.
        operation: String,
        /// `input` or `output`.
        buffer: &'static str,
        /// What the operation needs (saturating at `u64::MAX`).
        needed_bytes: u64,
        /// What the proxy has.
        have_bytes: u64,
    },
    /// A dimension is zero or beyond cuBLAS's `i32` range.
    #[error("{operation}: {name} = {value} is outside 1..={}", i32::MAX)]
    Dimension {
        /// The operation.
        operation: &'static str,
        /// The dimension's name.
        name: &'static str,
        /// Its value.
        value: u64,
    },
    /// A launch on a stream other than the proxy's (its cuBLAS handle
    /// launches on the proxy's stream; mixing streams would race).
    #[error("{operation}: the proxy launches on its own stream, not the one given")]
    WrongStream {
        /// The operation.
        operation: &'static str,
    },
    /// A dimension the kernel has no variant for.
    #[error("{operation}: {name} = {value} is not supported; allowed: {allowed}")]
    Unsupported {
        /// The operation.
        operation: &'static str,
        /// The dimension's name.
        name: &'static str,
        /// Its value.
        value: u64,
        /// What is allowed.
        allowed: &'static str,
    },
    /// A buffer is not aligned as the kernel's accesses need.
    #[error("{operation}: {buffer} at {address:#x} is not {align}-byte aligned")]
    Misaligned {
        /// The operation.
        operation: &'static str,
        /// Which buffer.
        buffer: &'static str,
        /// Its device address.
        address: u64,
        /// The alignment it needs, in bytes.
        align: u64,
    },
    /// A buffer or the stream belongs to another device's context than the
    /// kernels.
    #[error("{operation}: a buffer or the stream is of another context than the kernels")]
    OtherContext {
        /// The operation, with its shape.
        operation: String,
    },
    /// The output buffer is one of the inputs.
    #[error("{operation}: the output buffer is one of the inputs")]
    Aliased {
        /// The operation, with its shape.
        operation: String,
    },
}

fn blas<T>(r: Result<T, cublas::CublasError>, operation: &'static str) -> Result<T, ProxyError> {
    r.map_err(|e| ProxyError::Cublas {
        operation,
        message: format!("{e:?}"),
    })
}

fn driver<T>(r: Result<T, result::DriverError>, operation: &str) -> Result<T, ProxyError> {
    r.map_err(|e| ProxyError::Driver(CudaError::new(operation, e.0)))
}

/// The kernels' PTX, compiled once per process (PTX does not depend on the
/// context).
fn ptx() -> Result<&'static CString, ProxyError> {
    static PTX: OnceLock<Result<CString, String>> = OnceLock::new();
    PTX.get_or_init(|| compile(KERNELS_SRC))
        .as_ref()
        .map_err(|e| ProxyError::Nvrtc(e.clone()))
}

/// The fused attention's PTX, compiled once per process.
fn attention_ptx() -> Result<&'static CString, ProxyError> {
    static PTX: OnceLock<Result<CString, String>> = OnceLock::new();
    PTX.get_or_init(|| compile_for(ATTENTION_SRC, Some(ATTENTION_ARCH)))
        .as_ref()
        .map_err(|e| ProxyError::Nvrtc(e.clone()))
}

/// `src` compiled by nvrtc to NUL-terminated PTX, or nvrtc's log.
pub(crate) fn compile(src: &str) -> Result<CString, String> {
    compile_for(src, None)
}

/// [`compile`] for the virtual architecture `arch` (nvrtc's default where
/// `None`).
fn compile_for(src: &str, arch: Option<&'static str>) -> Result<CString, String> {
    // SAFETY: only probes for the shared library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(
            "libnvrtc was not found (is the CUDA toolkit's lib on LD_LIBRARY_PATH?)".to_owned(),
        );
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch,
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        e => format!("{e:?}"),
    })?;
    CString::new(ptx.to_src()).map_err(|e| e.to_string())
}

/// A cuBLAS handle, destroyed on drop.
struct Blas {
    ctx: Arc<CudaContext>,
    raw: cublas_sys::cublasHandle_t,
}

impl Drop for Blas {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: the handle is ours; cublasDestroy waits for the work
            // it launched.
            let _ = unsafe { cublas::destroy_handle(self.raw) };
        }
    }
}

/// A loaded module, unloaded on drop once the context has drained.
pub(crate) struct Module {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) raw: sys::CUmodule,
}

impl Module {
    /// `ptx` (a NUL-terminated PTX module) loaded in `device`'s context;
    /// `what` names it in an error.
    pub(crate) fn load(device: &CudaDevice, ptx: &CStr, what: &str) -> Result<Self, CudaError> {
        device.bind()?;
        // SAFETY: `ptx` is NUL-terminated (a `CStr`); the context is current.
        let raw = unsafe { result::module::load_data(ptx.as_ptr().cast()) }
            .map_err(|e| CudaError::new(format!("cuModuleLoadData({what})"), e.0))?;
        Ok(Self {
            ctx: Arc::clone(device.context()),
            raw,
        })
    }

    /// The module's kernel `name`: an error, not a handle, where the
    /// module does not define it.
    pub(crate) fn function(&self, name: &str) -> Result<sys::CUfunction, CudaError> {
        let operation = || format!("cuModuleGetFunction({name})");
        let c_name = CString::new(name).map_err(|_| {
            CudaError::new(operation(), sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE)
        })?;
        // SAFETY: the module is loaded (it is unloaded only on drop).
        unsafe { result::module::get_function(self.raw, c_name) }
            .map_err(|e| CudaError::new(operation(), e.0))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        match self.ctx.synchronize() {
            Ok(()) => {
                // SAFETY: the context is current and drained: no launch of
                // the module's kernels is pending.
                let _ = unsafe { result::module::unload(self.raw) };
            }
            Err(e) => tracing::error!("unloading a module: {e}; leaving it loaded"),
        }
    }
}

/// The fused attention kernels (`attention.cu`) loaded in one context:
/// `O = softmax(Q·Kᵀ / sqrt(D))·V` per head, bf16 in and out, for head
/// dimensions 64 and 128.
pub struct FlashKernels {
    module: Module,
    d64: sys::CUfunction,
    d128: sys::CUfunction,
}

// SAFETY: the function handles belong to the module this owns; the driver
// lets any thread launch them with the context current (every launch binds
// it).
unsafe impl Send for FlashKernels {}
// SAFETY: as above; launching only enqueues work.
unsafe impl Sync for FlashKernels {}

impl std::fmt::Debug for FlashKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlashKernels").finish_non_exhaustive()
    }
}

impl FlashKernels {
    /// Query rows (and keys) per tile of the kernels: a CTA per 64 rows.
    pub const TILE: u64 = 64;

    /// The kernels of [`ATTENTION_SRC`] (compiled once per process),
    /// loaded in `device`'s context.
    pub fn new(device: &CudaDevice) -> Result<Self, ProxyError> {
        Self::load(device, attention_ptx()?)
    }

    /// The kernels of `src` instead: a check's planted copy of
    /// [`ATTENTION_SRC`], with the same entry points (`flash_d64`,
    /// `flash_d128`) and parameters.
    pub fn from_source(device: &CudaDevice, src: &str) -> Result<Self, ProxyError> {
        let ptx = compile_for(src, Some(ATTENTION_ARCH)).map_err(ProxyError::Nvrtc)?;
        Self::load(device, &ptx)
    }

    fn load(device: &CudaDevice, ptx: &CStr) -> Result<Self, ProxyError> {
        let module = Module::load(device, ptx, "attention kernels")?;
        let d64 = module.function("flash_d64")?;
        let d128 = module.function("flash_d128")?;
        Ok(Self { module, d64, d128 })
    }

    /// Whether a head dimension has a fused kernel (64 and 128).
    pub fn supports(head_dim: u64) -> bool {
        matches!(head_dim, 64 | 128)
    }

    /// Enqueues `o = attention(q, k, v)` on `stream` over `heads` heads of
    /// `tokens` rows of `head_dim` bf16 each (`[heads][tokens][head_dim]`,
    /// row-major). Every buffer must hold `heads·tokens·head_dim` bf16, be
    /// of the kernels' context (as the stream), and `o` must not be one of
    /// the inputs ([`Self::check`] says the rest); buffers stay alive until
    /// the kernel has run (dropping one synchronises its context).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        stream: &CudaStream,
        q: &CudaBuffer,
        k: &CudaBuffer,
        v: &CudaBuffer,
        o: &CudaBuffer,
        heads: u64,
        tokens: u64,
        head_dim: u64,
    ) -> Result<(), ProxyError> {
        let need = heads
            .saturating_mul(tokens)
            .saturating_mul(head_dim)
            .saturating_mul(2);
        let shape = format!("attention of {heads} heads x {tokens} tokens x {head_dim}");
        for (name, b) in [("q", q), ("k", k), ("v", v), ("o", o)] {
            if b.len_bytes() < need {
                return Err(ProxyError::Scratch {
                    operation: shape,
                    buffer: name,
                    needed_bytes: need,
                    have_bytes: b.len_bytes(),
                });
            }
        }
        if [q, k, v].iter().any(|b| b.ptr() == o.ptr()) {
            return Err(ProxyError::Aliased { operation: shape });
        }
        let ours = |c: &Arc<CudaContext>| Arc::ptr_eq(c, &self.module.ctx);
        if !ours(stream.context()) || ![q, k, v, o].iter().all(|b| ours(b.context())) {
            return Err(ProxyError::OtherContext { operation: shape });
        }
        // SAFETY: each range lies within its live buffer (checked above),
        // `o` is none of the inputs, and the borrows keep the buffers
        // alive past the launch (a buffer's drop synchronises first).
        unsafe {
            self.launch(
                stream,
                q.ptr(),
                k.ptr(),
                v.ptr(),
                o.ptr(),
                heads,
                tokens,
                head_dim,
            )
        }
    }

    /// What the kernels take: head dimension 64 or 128; 1 to
    /// `i32::MAX − 64` tokens (its key loop counts in `int`); 1 to 65,535
    /// heads (the grid's y dimension); Q, K and V 16-byte aligned (loaded
    /// 16 bytes at a time) and O 4-byte aligned (stored as bf16 pairs).
    /// `ptrs` are Q, K, V and O.
    pub fn check(ptrs: [u64; 4], heads: u64, tokens: u64, head_dim: u64) -> Result<(), ProxyError> {
        let unsupported = |name, value, allowed| ProxyError::Unsupported {
            operation: "attention (flash)",
            name,
            value,
            allowed,
        };
        if !Self::supports(head_dim) {
            return Err(unsupported("head_dim", head_dim, "64 or 128"));
        }
        if tokens == 0 || tokens > i32::MAX as u64 - Self::TILE {
            return Err(unsupported("tokens", tokens, "1..=2147483583"));
        }
        if heads == 0 || heads > 65_535 {
            return Err(unsupported(
                "heads",
                heads,
                "1..=65535 (the grid's y dimension)",
            ));
        }
        for (name, ptr, align) in [
            ("q", ptrs[0], 16),
            ("k", ptrs[1], 16),
            ("v", ptrs[2], 16),
            ("o", ptrs[3], 4),
        ] {
            if ptr % align != 0 {
                return Err(ProxyError::Misaligned {
                    operation: "attention (flash)",
                    buffer: name,
                    address: ptr,
                    align,
                });
            }
        }
        Ok(())
    }

    /// [`Self::run`] over raw ranges.
    ///
    /// # Safety
    ///
    /// `q`, `k`, `v` and `o` each address `heads·tokens·head_dim` bf16 of
    /// device memory of the kernels' context that stays allocated until
    /// the kernel has run on `stream`; `o` overlaps none of the inputs, and
    /// nothing else writes the inputs or touches `o` meanwhile. (Shapes,
    /// and the alignment the kernel's vector accesses need, are checked
    /// here: [`Self::check`].)
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch(
        &self,
        stream: &CudaStream,
        q: sys::CUdeviceptr,
        k: sys::CUdeviceptr,
        v: sys::CUdeviceptr,
        o: sys::CUdeviceptr,
        heads: u64,
        tokens: u64,
        head_dim: u64,
    ) -> Result<(), ProxyError> {
        Self::check([q, k, v, o], heads, tokens, head_dim)?;
        let function = if head_dim == 64 { self.d64 } else { self.d128 };
        let (t, h) = (tokens as i32, heads as u32);
        let tiles = tokens.div_ceil(Self::TILE) as u32;
        let (mut q, mut k, mut v, mut o, mut t) = (q, k, v, o, t);
        let mut scale = std::f32::consts::LOG2_E / (head_dim as f32).sqrt();
        let mut params: [*mut c_void; 6] = [
            (&raw mut q).cast(),
            (&raw mut k).cast(),
            (&raw mut v).cast(),
            (&raw mut o).cast(),
            (&raw mut t).cast(),
            (&raw mut scale).cast(),
        ];
        self.module.ctx.bind()?;
        // SAFETY: `function` is `flash_d64` or `flash_d128`, whose
        // parameters are exactly these six (three input pointers, the
        // output, T as int, the scale as float), pointing at live locals;
        // the ranges are the caller's to vouch for; 128 threads and static
        // shared memory, as the kernels are written for.
        let launched = unsafe {
            result::launch_kernel(
                function,
                (tiles, h, 1),
                (128, 1, 1),
                0,
                stream.raw(),
                &mut params,
            )
        };
        driver(launched, "cuLaunchKernel(flash)")
    }
}

/// Kernels and scratch buffers on one stream.
pub struct Proxy {
    // Drop order matters: cuBLAS and the module go before the buffers
    // (the workspace among them).
    blas: Blas,
    module: Module,
    flash: FlashKernels,
    fold: sys::CUfunction,
    chain: sys::CUfunction,
    touch: sys::CUfunction,
    /// Held, never read: cuBLAS writes it.
    _workspace: CudaBuffer,
    sum: CudaBuffer,
    state: CudaBuffer,
    input: CudaBuffer,
    output: CudaBuffer,
    stream: Arc<CudaStream>,
    gemms: bool,
    attention: Attention,
    chain_elements: u64,
}

// SAFETY: the function handles belong to the module the proxy owns; the
// driver lets any thread launch them with the context current (every
// launch binds it).
unsafe impl Send for Proxy {}
// SAFETY: as above; every method takes `&self` and only enqueues work.
unsafe impl Sync for Proxy {}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("input_bytes", &self.input.len_bytes())
            .field("output_bytes", &self.output.len_bytes())
            .field("gemms", &self.gemms)
            .field("attention", &self.attention)
            .finish()
    }
}

impl Proxy {
    /// Builds the proxy on `stream`: `input_bytes` of activations (at least
    /// [`CHAIN_ELEMENTS`] bf16 are useful) and `output_bytes` of outputs.
    ///
    /// It needs a device of compute capability 8.0 or later (Ampere on):
    /// its GEMMs are bf16 and the fused attention is compiled for
    /// `compute_80`, which an older device refuses when the module loads
    /// (a typed error), whichever [`Attention`] kind is set.
    pub fn new(
        device: &CudaDevice,
        stream: Arc<CudaStream>,
        input_bytes: u64,
        output_bytes: u64,
    ) -> Result<Self, ProxyError> {
        let ptx = ptx()?;
        // SAFETY: only probes for the shared library.
        if !unsafe { cublas_sys::is_culib_present() } {
            return Err(ProxyError::Cublas {
                operation: "loading libcublas",
                message: "not found (is the CUDA toolkit's lib on LD_LIBRARY_PATH?)".to_owned(),
            });
        }
        let ctx = Arc::clone(device.context());
        let module = Module::load(device, ptx, "proxy kernels")?;
        let fold = module.function("fold")?;
        let chain = module.function("chain")?;
        let touch = module.function("touch")?;
        let flash = FlashKernels::new(device)?;
        let blas_handle = Blas {
            ctx: Arc::clone(&ctx),
            raw: blas(cublas::create_handle(), "cublasCreate")?,
        };
        // SAFETY: both handles are live; cuBLAS then launches on `stream`,
        // which the proxy keeps alive as long as the handle.
        let set = unsafe { cublas::set_stream(blas_handle.raw, stream.raw().cast()) };
        blas(set, "cublasSetStream")?;
        // After cublasSetStream, which resets the workspace to cuBLAS's own.
        let workspace = device.alloc_device(CUBLAS_WORKSPACE_BYTES)?;
        // SAFETY: the handle is live; the buffer is ours, pool-allocated
        // (aligned beyond the 256 bytes cuBLAS needs), used only by this
        // handle on its one stream, and freed after the handle is destroyed
        // (field order).
        let status = unsafe {
            cublas_sys::cublasSetWorkspace_v2(
                blas_handle.raw,
                workspace.ptr() as *mut c_void,
                CUBLAS_WORKSPACE_BYTES as usize,
            )
        };
        if status != cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(ProxyError::Cublas {
                operation: "cublasSetWorkspace",
                message: format!("{status:?}"),
            });
        }
        let sum = device.alloc_device(8)?;
        let state = device.alloc_device(8)?;
        let input = device.alloc_device(input_bytes.max(2))?;
        let output = device.alloc_device(output_bytes.max(2))?;
        let proxy = Self {
            blas: blas_handle,
            module,
            flash,
            fold,
            chain,
            touch,
            _workspace: workspace,
            sum,
            state,
            chain_elements: CHAIN_ELEMENTS.min(input.len_bytes() / 2),
            input,
            output,
            stream,
            gemms: std::env::var_os("OFFLOAD_PROXY_NO_GEMM").is_none(),
            attention: Attention::default(),
        };
        let stream = Arc::clone(&proxy.stream);
        proxy.reset(&stream)?;
        Ok(proxy)
    }

    /// The stream every kernel of the proxy runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The activations (`tokens × in` bf16).
    pub fn input(&self) -> &CudaBuffer {
        &self.input
    }

    /// The outputs (`tokens × out` bf16, also scores for attention).
    pub fn output(&self) -> &CudaBuffer {
        &self.output
    }

    /// Whether the GEMMs run (`OFFLOAD_PROXY_NO_GEMM` unset).
    pub fn gemms(&self) -> bool {
        self.gemms
    }

    /// How [`Self::attention`] computes attention ([`Attention::Flash`]
    /// unless set).
    pub fn attention_kind(&self) -> Attention {
        self.attention
    }

    /// Sets how [`Self::attention`] computes attention. The scratch is the
    /// same for both kinds ([`Self::attention_scratch`]), so the device
    /// memory a run takes does not move with it.
    pub fn set_attention(&mut self, kind: Attention) {
        self.attention = kind;
    }

    fn ours(&self, stream: &CudaStream, operation: &'static str) -> Result<(), ProxyError> {
        if stream.raw() == self.stream.raw() {
            Ok(())
        } else {
            Err(ProxyError::WrongStream { operation })
        }
    }

    fn launch(
        &self,
        function: sys::CUfunction,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
        operation: &str,
    ) -> Result<(), ProxyError> {
        self.module.ctx.bind()?;
        // SAFETY: `function` is one of the loaded module's kernels, and
        // each caller passes exactly the parameters its signature in
        // kernels.cu takes, pointing at live locals (the driver copies them
        // at launch); the device pointers among them are the proxy's own
        // buffers or a range the caller vouches for; the stream is the
        // proxy's.
        let launched = unsafe {
            result::launch_kernel(
                function,
                (grid, 1, 1),
                (block, 1, 1),
                0,
                self.stream.raw(),
                params,
            )
        };
        driver(launched, operation)
    }

    /// Clears the accumulator and the state, and sets the activations to a
    /// fixed pattern of small finite bf16 values.
    pub fn reset(&self, stream: &CudaStream) -> Result<(), ProxyError> {
        self.ours(stream, "reset")?;
        self.module.ctx.bind()?;
        let s = self.stream.raw();
        // SAFETY: the buffers are ours and exactly these sizes; the memsets
        // are ordered on the proxy's stream.
        let set = unsafe {
            result::memset_d8_async(self.sum.ptr(), 0, 8, s)
                .and_then(|()| result::memset_d8_async(self.state.ptr(), 0, 8, s))
                .and_then(|()| {
                    result::memset_d8_async(
                        self.input.ptr(),
                        0x3c,
                        self.input.len_bytes() as usize,
                        s,
                    )
                })
        };
        driver(set, "cuMemsetD8Async(proxy reset)")
    }

    /// Folds `len` bytes at `ptr` into the block's accumulator.
    ///
    /// `ptr..ptr + len` must be device memory that stays allocated until
    /// the fold runs: a view lent by a forward scope, launched inside it.
    pub fn fold(
        &self,
        stream: &CudaStream,
        ptr: sys::CUdeviceptr,
        len: u64,
    ) -> Result<(), ProxyError> {
        self.ours(stream, "fold")?;
        self.fold_raw(ptr, len)
    }

    fn fold_raw(&self, ptr: sys::CUdeviceptr, len: u64) -> Result<(), ProxyError> {
        if len == 0 {
            return Ok(());
        }
        let (mut p, mut n, mut out) = (ptr, len, self.sum.ptr());
        let mut params: [*mut c_void; 3] = [
            (&raw mut p).cast(),
            (&raw mut n).cast(),
            (&raw mut out).cast(),
        ];
        // Each thread reads 16 bytes per step of its loop.
        let blocks = len.div_ceil(256 * 16).clamp(1, 4096) as u32;
        self.launch(self.fold, blocks, 256, &mut params, "cuLaunchKernel(fold)")
    }

    /// Ends a block: `state = mix(state, sum)`, `sum = 0`, and the first
    /// [`CHAIN_ELEMENTS`] activations rewritten from the new state.
    pub fn chain(&self, stream: &CudaStream) -> Result<(), ProxyError> {
        self.ours(stream, "chain")?;
        let (mut state, mut sum, mut x, mut k) = (
            self.state.ptr(),
            self.sum.ptr(),
            self.input.ptr(),
            self.chain_elements,
        );
        let mut params: [*mut c_void; 4] = [
            (&raw mut state).cast(),
            (&raw mut sum).cast(),
            (&raw mut x).cast(),
            (&raw mut k).cast(),
        ];
        self.launch(self.chain, 1, 256, &mut params, "cuLaunchKernel(chain)")
    }

    fn dim(operation: &'static str, name: &'static str, value: u64) -> Result<i32, ProxyError> {
        i32::try_from(value)
            .ok()
            .filter(|v| *v > 0)
            .ok_or(ProxyError::Dimension {
                operation,
                name,
                value,
            })
    }

    fn fits(
        &self,
        operation: impl FnOnce() -> String,
        buffer: &'static str,
        needed_bytes: u64,
    ) -> Result<(), ProxyError> {
        let have_bytes = match buffer {
            "input" => self.input.len_bytes(),
            _ => self.output.len_bytes(),
        };
        if needed_bytes <= have_bytes {
            Ok(())
        } else {
            Err(ProxyError::Scratch {
                operation: operation(),
                buffer,
                needed_bytes,
                have_bytes,
            })
        }
    }

    /// `Y[tokens, out] = X[tokens, in] · W[out, in]ᵀ` in bf16 with f32
    /// accumulation, then folds Y's first row; `w` is a row-major
    /// `[out, in]` bf16 weight (a view lent by a forward scope, launched
    /// inside it).
    pub fn linear(
        &self,
        w: sys::CUdeviceptr,
        out_f: u64,
        in_f: u64,
        tokens: u64,
    ) -> Result<(), ProxyError> {
        let m = Self::dim("linear", "out_features", out_f)?;
        let n = Self::dim("linear", "tokens", tokens)?;
        let k = Self::dim("linear", "in_features", in_f)?;
        let shape = || format!("linear [{tokens}, {in_f}] x [{out_f}, {in_f}]T");
        self.fits(
            shape,
            "input",
            tokens.saturating_mul(in_f).saturating_mul(2),
        )?;
        self.fits(
            shape,
            "output",
            tokens.saturating_mul(out_f).saturating_mul(2),
        )?;
        if !self.gemms {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        self.module.ctx.bind()?;
        // SAFETY: X and Y lie within the scratch buffers (checked above);
        // `w` holds out_f × in_f bf16 (the caller's view); cuBLAS launches
        // on the proxy's stream; alpha and beta are read at the call.
        let launched = unsafe {
            cublas::gemm_ex(
                self.blas.raw,
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                (&raw const alpha).cast(),
                w as *const c_void,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                k,
                self.input.ptr() as *const c_void,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                k,
                (&raw const beta).cast(),
                self.output.ptr() as *mut c_void,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                m,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        blas(launched, "cublasGemmEx")?;
        // Column-major Y (out_f × tokens): token 0's outputs come first.
        self.fold_raw(self.output.ptr(), out_f * 2)
    }

    /// Heads per batch of [`Self::attention`] at `tokens`: as many as keep
    /// one batch's scores within [`ATTENTION_SCORES_BYTES`] (at least one).
    pub fn attention_heads_per_batch(heads: u64, tokens: u64) -> u64 {
        let per_head = tokens.saturating_mul(tokens).saturating_mul(2).max(1);
        (ATTENTION_SCORES_BYTES / per_head).clamp(1, heads.max(1))
    }

    /// Scratch [`Self::attention`] needs: `(input, output)` bytes (Q, K
    /// and V share the input; one batch's scores, then every head's O).
    pub fn attention_scratch(heads: u64, tokens: u64, head_dim: u64) -> (u64, u64) {
        let qkv = tokens.saturating_mul(head_dim);
        let input = heads.saturating_mul(qkv).saturating_mul(2);
        let output = Self::attention_output_offset(heads, tokens)
            .saturating_add(heads.saturating_mul(qkv).saturating_mul(2));
        (input, output)
    }

    /// Where O starts in the output scratch, in bytes: after one batch's
    /// scores (`g·T²` bf16), rounded up to 16 bytes, so that O is aligned
    /// for the fused kernel's stores (4 bytes) whatever `g·T²` is (odd
    /// where both are odd: 2,365 or 4,097 tokens at 24 heads) and the
    /// scratch is the same for both kinds.
    pub fn attention_output_offset(heads: u64, tokens: u64) -> u64 {
        let g = Self::attention_heads_per_batch(heads, tokens);
        g.saturating_mul(tokens.saturating_mul(tokens))
            .saturating_mul(2)
            .saturating_add(15)
            & !15
    }

    /// Attention at Flux's cost (`4·T²·heads·head_dim` FLOPs; Q, K and V
    /// share the activations), then folds O's first row, which sums over
    /// every token. As [`Self::attention_kind`] says:
    ///
    /// * [`Attention::Flash`] (head dimensions 64 and 128): the fused
    ///   kernel ([`FlashKernels`]) over every head at once, the softmax's
    ///   scores never written. It runs under `OFFLOAD_PROXY_NO_GEMM` too
    ///   (it is ours, for the sanitizer to check).
    /// * [`Attention::Materialized`] (and other head dimensions): batched
    ///   GEMMs over the scratch, a batch of heads at a time (so the scores
    ///   of one batch, not of every head, are held): scores
    ///   `S[h, t, t] = Q[h, t, d] · K[h, t, d]ᵀ`, then `O[h, t, d] = S · V`,
    ///   no softmax.
    pub fn attention(&self, heads: u64, tokens: u64, head_dim: u64) -> Result<(), ProxyError> {
        let t = Self::dim("attention", "tokens", tokens)?;
        let d = Self::dim("attention", "head_dim", head_dim)?;
        Self::dim("attention", "heads", heads)?;
        let qkv = tokens.saturating_mul(head_dim);
        let scores = tokens.saturating_mul(tokens);
        let shape = || format!("attention of {heads} heads x {tokens} tokens x {head_dim}");
        let (need_in, need_out) = Self::attention_scratch(heads, tokens, head_dim);
        self.fits(shape, "input", need_in)?;
        self.fits(shape, "output", need_out)?;
        let g = Self::attention_heads_per_batch(heads, tokens);
        if self.attention == Attention::Flash && FlashKernels::supports(head_dim) {
            let x = self.input.ptr();
            // Where the materialized kind puts O too: the scratch is the
            // same for both kinds.
            let o = self.output.ptr() + Self::attention_output_offset(heads, tokens);
            // SAFETY: Q = K = V is the first `heads·qkv` bf16 of the input
            // and O the `heads·qkv` after one batch's scores in the output
            // (both sizes checked above), distinct buffers the proxy owns
            // and frees only after synchronising; the launch is on its
            // stream, which every other kernel of the proxy shares.
            unsafe {
                self.flash
                    .launch(&self.stream, x, x, x, o, heads, tokens, head_dim)?;
            }
            return self.fold_raw(o, head_dim * 2);
        }
        if !self.gemms {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        self.module.ctx.bind()?;
        #[allow(clippy::too_many_arguments)]
        let gemm = |transa,
                    transb,
                    m: i32,
                    n: i32,
                    k: i32,
                    a: u64,
                    lda: i32,
                    sa: u64,
                    b: u64,
                    ldb: i32,
                    sb: u64,
                    c: u64,
                    ldc: i32,
                    sc: u64,
                    batch: i32| {
            // SAFETY: every operand lies within the scratch buffers (sizes
            // checked above; strides fit i64 since the products fit the
            // buffers); cuBLAS launches on the proxy's stream.
            let launched = unsafe {
                cublas::gemm_strided_batched_ex(
                    self.blas.raw,
                    transa,
                    transb,
                    m,
                    n,
                    k,
                    (&raw const alpha).cast(),
                    a as *const c_void,
                    cublas_sys::cudaDataType::CUDA_R_16BF,
                    lda,
                    sa as i64,
                    b as *const c_void,
                    cublas_sys::cudaDataType::CUDA_R_16BF,
                    ldb,
                    sb as i64,
                    (&raw const beta).cast(),
                    c as *mut c_void,
                    cublas_sys::cudaDataType::CUDA_R_16BF,
                    ldc,
                    sc as i64,
                    batch,
                    cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            blas(launched, "cublasGemmStridedBatchedEx")
        };
        use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let (x, s) = (self.input.ptr(), self.output.ptr());
        // Every head's O after one batch's scores.
        let o = s + Self::attention_output_offset(heads, tokens);
        let mut h0 = 0;
        while h0 < heads {
            let batch = g.min(heads - h0);
            let b = Self::dim("attention", "heads per batch", batch)?;
            let (xq, oq) = (x + h0 * qkv * 2, o + h0 * qkv * 2);
            // Column-major: S (t×t) = Kᵀ (t×d) · Q (d×t).
            gemm(
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                t,
                t,
                d,
                xq,
                d,
                qkv,
                xq,
                d,
                qkv,
                s,
                t,
                scores,
                b,
            )?;
            // O (d×t) = V (d×t) · S (t×t).
            gemm(
                CUBLAS_OP_N,
                CUBLAS_OP_N,
                d,
                t,
                t,
                xq,
                d,
                qkv,
                s,
                t,
                scores,
                oq,
                d,
                qkv,
                b,
            )?;
            h0 += batch;
        }
        // Head 0, token 0: head_dim outputs, each a sum over every token.
        self.fold_raw(o, head_dim * 2)
    }

    /// Memory traffic of `bytes` (half read from the activations, half
    /// written to the outputs, in passes over at most
    /// [`TRAFFIC_REGION_BYTES`]): a model's elementwise work, which moves
    /// activations at memory bandwidth. It changes no result the output
    /// depends on (the outputs it writes are rewritten before they are
    /// read again).
    pub fn traffic(&self, bytes: u64) -> Result<(), ProxyError> {
        let region = TRAFFIC_REGION_BYTES
            .min(self.input.len_bytes())
            .min(self.output.len_bytes())
            / 16;
        if bytes < 32 || region == 0 {
            return Ok(());
        }
        let half_words = bytes / 32;
        let (mut words, mut passes) = (half_words.min(region), half_words.div_ceil(region));
        if passes > 1 {
            // Spread evenly over the passes.
            words = half_words.div_ceil(passes);
        }
        let (mut src, mut dst) = (self.input.ptr(), self.output.ptr());
        let mut params: [*mut c_void; 4] = [
            (&raw mut src).cast(),
            (&raw mut dst).cast(),
            (&raw mut words).cast(),
            (&raw mut passes).cast(),
        ];
        let blocks = words.div_ceil(256).clamp(1, 132 * 8) as u32;
        self.launch(
            self.touch,
            blocks,
            256,
            &mut params,
            "cuLaunchKernel(touch)",
        )
    }

    /// Waits for the proxy's stream and reads the state: the output.
    pub fn read_output(&self) -> Result<u64, ProxyError> {
        self.module.ctx.bind()?;
        // SAFETY: the stream is the proxy's own, alive.
        let synced = unsafe { result::stream::synchronize(self.stream.raw()) };
        driver(synced, "cuStreamSynchronize(proxy)")?;
        let mut out = [0u64; 1];
        // SAFETY: `state` holds one u64; every write to it was on the
        // stream just synchronised.
        let read = unsafe { result::memcpy_dtoh_sync(&mut out, self.state.ptr()) };
        driver(read, "cuMemcpyDtoH(state)")?;
        Ok(out[0])
    }

    /// Waits for the proxy's stream, then frees everything (dropping the
    /// proxy does the same, logging instead of returning errors).
    pub fn free(self) -> Result<(), ProxyError> {
        self.module.ctx.bind()?;
        // SAFETY: the stream is the proxy's own, alive.
        let synced = unsafe { result::stream::synchronize(self.stream.raw()) };
        driver(synced, "cuStreamSynchronize(proxy)")?;
        drop(self);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where nvrtc is found (the toolkit's lib on `LD_LIBRARY_PATH`; no GPU
    /// needed), both sources compile as the device will compile them and
    /// define every kernel the proxy loads.
    #[test]
    fn the_kernels_compile_with_nvrtc_where_found() {
        // SAFETY: only probes for the shared library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            println!("skipped: libnvrtc not found (LD_LIBRARY_PATH)");
            return;
        }
        for (ptx, kernels) in [
            (ptx(), &["fold", "chain", "touch"][..]),
            (attention_ptx(), &["flash_d64", "flash_d128"][..]),
        ] {
            let ptx = ptx.unwrap_or_else(|e| panic!("{e}")).to_string_lossy();
            for kernel in kernels {
                assert!(
                    ptx.contains(&format!(".entry {kernel}(")),
                    "{kernel} missing from the PTX"
                );
            }
        }
        // For real architectures nvrtc also assembles the PTX, which checks
        // the inline `mma`/`ldmatrix` instructions a virtual target passes
        // through unread.
        for arch in ["sm_80", "sm_90"] {
            if let Err(log) = compile_for(ATTENTION_SRC, Some(arch)) {
                panic!("attention.cu for {arch}: {log}");
            }
        }
    }

    /// O's offset in the output scratch is 16-byte aligned and O fits
    /// behind one batch's scores, for every head count up to Flux's 24 and
    /// token counts on and off every alignment (odd `g·T²` among them:
    /// 2,365 and 4,097 tokens at 24 heads, every odd count from 8,193 up).
    #[test]
    fn attention_output_is_aligned_and_within_the_scratch() {
        let counts = (1..=4200u64).chain((8185..=8200).chain([9537, 16897, 20001]));
        for tokens in counts {
            for heads in 1..=24u64 {
                for head_dim in [64u64, 128] {
                    let at = Proxy::attention_output_offset(heads, tokens);
                    let g = Proxy::attention_heads_per_batch(heads, tokens);
                    assert_eq!(at % 16, 0, "{heads} heads, {tokens} tokens: O at {at}");
                    assert!(at >= g * tokens * tokens * 2, "O overlaps the scores");
                    let (_, output) = Proxy::attention_scratch(heads, tokens, head_dim);
                    assert!(at + heads * tokens * head_dim * 2 <= output);
                }
            }
        }
    }

    /// The fused kernel's launch refuses what it cannot run: other head
    /// dimensions, no tokens or more than its `int` loop counts, more heads
    /// than the grid takes, inputs not 16-byte or an output not 4-byte
    /// aligned.
    #[test]
    fn the_fused_kernel_refuses_shapes_and_alignments_it_cannot_run() {
        let ok = [0x1000u64, 0x2000, 0x3000, 0x4004];
        FlashKernels::check(ok, 24, 4097, 128).unwrap();
        FlashKernels::check(ok, 65_535, 1, 64).unwrap();
        let refused = |ptrs, heads, tokens, head_dim, what: &str| {
            let e = FlashKernels::check(ptrs, heads, tokens, head_dim).unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
        };
        refused(
            ok,
            1,
            64,
            96,
            "head_dim = 96 is not supported; allowed: 64 or 128",
        );
        refused(ok, 1, 0, 64, "tokens = 0");
        refused(ok, 1, i32::MAX as u64, 64, "tokens = 2147483647");
        refused(ok, 0, 64, 64, "heads = 0");
        refused(ok, 65_536, 64, 64, "heads = 65536");
        refused(
            [0x1008, 0x2000, 0x3000, 0x4000],
            1,
            64,
            64,
            "q at 0x1008 is not 16-byte aligned",
        );
        refused(
            [0x1000, 0x2000, 0x3004, 0x4000],
            1,
            64,
            64,
            "v at 0x3004 is not 16-byte aligned",
        );
        refused(
            [0x1000, 0x2000, 0x3000, 0x4002],
            1,
            64,
            64,
            "o at 0x4002 is not 4-byte aligned",
        );
    }

    #[test]
    fn attention_kinds_parse_by_name_and_refuse_others() {
        for (kind, name) in Attention::ALL {
            assert_eq!(name.parse::<Attention>(), Ok(kind));
            assert_eq!(kind.name(), name);
        }
        assert_eq!(Attention::default(), Attention::Flash);
        let e = "fused".parse::<Attention>().unwrap_err();
        assert!(e.contains("\"fused\"") && e.contains("\"flash\""), "{e}");
    }
}
