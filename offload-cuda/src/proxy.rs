//! The compute proxy of the GPU suite and the benchmark: cuBLAS bf16 GEMMs
//! over a block's own weights with their real shapes, attention-sized
//! batched GEMMs, and two nvrtc kernels (`kernels.cu`) that make the output
//! depend on every byte read, in order.
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
//! With `OFFLOAD_PROXY_NO_GEMM` set, the GEMMs and their output folds are
//! skipped (the weight folds and the chain still run): compute-sanitizer's
//! racecheck cannot run cuBLAS's Hopper kernels (it fails inside the
//! sanitizer on their hardware barriers), and our own kernels are what it
//! should check.

use std::ffi::{CString, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::cublas::{result as cublas, sys as cublas_sys};
use cudarc::driver::{result, sys};
use offload_core::device::{Device, DeviceBuffer};

use crate::{CudaBuffer, CudaContext, CudaDevice, CudaError, CudaStream};

/// The proxy's kernels (CUDA C, compiled once per process with nvrtc).
const KERNELS_SRC: &str = include_str!("kernels.cu");

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

/// `src` compiled by nvrtc to NUL-terminated PTX, or nvrtc's log.
pub(crate) fn compile(src: &str) -> Result<CString, String> {
    // SAFETY: only probes for the shared library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(
            "libnvrtc was not found (is the CUDA toolkit's lib on LD_LIBRARY_PATH?)".to_owned(),
        );
    }
    let ptx = cudarc::nvrtc::compile_ptx(src).map_err(|e| match e {
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

/// Kernels and scratch buffers on one stream.
pub struct Proxy {
    // Drop order matters: cuBLAS and the module go before the buffers
    // (the workspace among them).
    blas: Blas,
    module: Module,
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
            .finish()
    }
}

impl Proxy {
    /// Builds the proxy on `stream`: `input_bytes` of activations (at least
    /// [`CHAIN_ELEMENTS`] bf16 are useful) and `output_bytes` of outputs.
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
        device.bind()?;
        // SAFETY: `ptx` is a NUL-terminated PTX module; the context is current.
        let raw = driver(
            unsafe { result::module::load_data(ptx.as_ptr().cast()) },
            "cuModuleLoadData(proxy kernels)",
        )?;
        let module = Module {
            ctx: Arc::clone(&ctx),
            raw,
        };
        // SAFETY: the module is loaded and defines both kernels.
        let fold = driver(
            unsafe { result::module::get_function(module.raw, c"fold".to_owned()) },
            "cuModuleGetFunction(fold)",
        )?;
        // SAFETY: as above.
        let chain = driver(
            unsafe { result::module::get_function(module.raw, c"chain".to_owned()) },
            "cuModuleGetFunction(chain)",
        )?;
        // SAFETY: as above.
        let touch = driver(
            unsafe { result::module::get_function(module.raw, c"touch".to_owned()) },
            "cuModuleGetFunction(touch)",
        )?;
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
        let g = Self::attention_heads_per_batch(heads, tokens);
        let input = heads.saturating_mul(qkv).saturating_mul(2);
        let output = g
            .saturating_mul(tokens.saturating_mul(tokens))
            .saturating_add(heads.saturating_mul(qkv))
            .saturating_mul(2);
        (input, output)
    }

    /// Attention at Flux's cost (`4·T²·heads·head_dim` FLOPs) as batched
    /// GEMMs over the scratch, a batch of heads at a time (so the scores
    /// of one batch, not of every head, are held): scores
    /// `S[h, t, t] = Q[h, t, d] · K[h, t, d]ᵀ`, then `O[h, t, d] = S · V`
    /// (Q, K and V share the activations), then folds O's first row, which
    /// sums over every token.
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
        if !self.gemms {
            return Ok(());
        }
        let g = Self::attention_heads_per_batch(heads, tokens);
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
        let o = s + g * scores * 2;
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
