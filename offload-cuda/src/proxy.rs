//! A real compute proxy for tests and the benchmark: cuBLAS bf16 GEMMs over
//! a block's own weights with their real shapes, attention-sized batched
//! GEMMs, and an nvrtc kernel that folds bytes into a device checksum (an
//! integer sum, so its value does not depend on thread order).

use std::ffi::c_void;

use cudarc::cublas::{result as cublas, sys as cublas_sys};
use cudarc::driver::{result, sys};
use offload_core::device::Device;

use crate::{CudaBuffer, CudaDevice, CudaError, CudaStream};

const FOLD_SRC: &str = r#"
extern "C" __global__ void fold(const unsigned char* p, unsigned long long n, unsigned long long* out) {
    unsigned long long acc = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        acc += ((unsigned long long)p[i] + 1ull) * ((i % 65521ull) + 1ull);
    }
    atomicAdd(out, acc);
}
"#;

/// Errors of the proxy.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] CudaError),
    /// cuBLAS failed.
    #[error("cuBLAS {operation}: {message}")]
    Cublas {
        /// The call.
        operation: &'static str,
        /// What it said.
        message: String,
    },
    /// nvrtc failed.
    #[error("nvrtc: {0}")]
    Nvrtc(String),
}

fn blas<T>(r: Result<T, cublas::CublasError>, operation: &'static str) -> Result<T, ProxyError> {
    r.map_err(|e| ProxyError::Cublas {
        operation,
        message: format!("{e:?}"),
    })
}

/// Kernels and scratch buffers on one stream.
///
/// With `OFFLOAD_PROXY_NO_GEMM` set, the GEMMs are skipped (the checksum
/// still reads every byte): compute-sanitizer's racecheck cannot run
/// cuBLAS's Hopper kernels (it fails inside the sanitizer on their hardware
/// barriers), and our own kernel is what it should check.
pub struct Proxy {
    gemms: bool,
    handle: cublas_sys::cublasHandle_t,
    module: sys::CUmodule,
    fold: sys::CUfunction,
    /// The device checksum (one u64).
    pub sum: CudaBuffer,
    /// Activations: `tokens × max_in` bf16.
    pub input: CudaBuffer,
    /// Outputs: `tokens × max_out` bf16 (also scores for attention).
    pub output: CudaBuffer,
}

impl Proxy {
    /// Builds the proxy: `input_bytes` and `output_bytes` of scratch.
    pub fn new(
        device: &CudaDevice,
        stream: &CudaStream,
        input_bytes: u64,
        output_bytes: u64,
    ) -> Result<Self, ProxyError> {
        device.bind()?;
        let ptx = cudarc::nvrtc::compile_ptx(FOLD_SRC)
            .map_err(|e| ProxyError::Nvrtc(format!("{e:?}")))?;
        let image =
            std::ffi::CString::new(ptx.to_src()).map_err(|e| ProxyError::Nvrtc(e.to_string()))?;
        // SAFETY: `image` is a NUL-terminated PTX module.
        let module =
            unsafe { result::module::load_data(image.as_ptr().cast()) }.map_err(|e| CudaError {
                operation: "cuModuleLoadData(fold)".to_owned(),
                code: e.0,
            })?;
        // SAFETY: the module is loaded and defines `fold`.
        let fold = unsafe {
            result::module::get_function(module, std::ffi::CString::new("fold").expect("static"))
        }
        .map_err(|e| CudaError {
            operation: "cuModuleGetFunction(fold)".to_owned(),
            code: e.0,
        })?;
        let handle = blas(cublas::create_handle(), "cublasCreate")?;
        // SAFETY: both handles are live; cuBLAS then launches on `stream`.
        let set = unsafe { cublas::set_stream(handle, stream.raw().cast()) };
        blas(set, "cublasSetStream")?;
        let sum = device.alloc_device(8)?;
        let input = device.alloc_device(input_bytes.max(2))?;
        let output = device.alloc_device(output_bytes.max(2))?;
        let proxy = Self {
            gemms: std::env::var_os("OFFLOAD_PROXY_NO_GEMM").is_none(),
            handle,
            module,
            fold,
            sum,
            input,
            output,
        };
        proxy.reset(stream)?;
        Ok(proxy)
    }

    /// Sets the checksum to zero, and the activations to a fixed pattern of
    /// small finite bf16 values.
    pub fn reset(&self, stream: &CudaStream) -> Result<(), ProxyError> {
        // SAFETY: the buffers are ours; the memsets are ordered on `stream`.
        unsafe {
            result::memset_d8_async(self.sum.ptr(), 0, 8, stream.raw())
                .and_then(|()| {
                    result::memset_d8_async(
                        self.input.ptr(),
                        0x3c,
                        self.input.len as usize,
                        stream.raw(),
                    )
                })
                .map_err(|e| CudaError {
                    operation: "cuMemsetD8Async".to_owned(),
                    code: e.0,
                })?;
        }
        Ok(())
    }

    /// Folds `len` bytes at `ptr` into the checksum, on `stream`.
    pub fn fold(
        &self,
        stream: &CudaStream,
        ptr: sys::CUdeviceptr,
        len: u64,
    ) -> Result<(), ProxyError> {
        if len == 0 {
            return Ok(());
        }
        let (mut p, mut n, mut out) = (ptr, len, self.sum.ptr());
        let mut params: [*mut c_void; 3] = [
            (&raw mut p).cast(),
            (&raw mut n).cast(),
            (&raw mut out).cast(),
        ];
        let blocks = len.div_ceil(256 * 8).clamp(1, 4096) as u32;
        // SAFETY: `fold` takes (const u8*, u64, u64*), which `params` points
        // to; `ptr..ptr+len` is a live device range (the caller's view) and
        // the launch is ordered on `stream` after the waits that make it so.
        unsafe {
            result::launch_kernel(
                self.fold,
                (blocks, 1, 1),
                (256, 1, 1),
                0,
                stream.raw(),
                &mut params,
            )
        }
        .map_err(|e| CudaError {
            operation: "cuLaunchKernel(fold)".to_owned(),
            code: e.0,
        })?;
        Ok(())
    }

    /// `Y[tokens, out] = X[tokens, in] · W[out, in]ᵀ` in bf16 with f32
    /// accumulation; `w` is a row-major `[out, in]` bf16 weight.
    pub fn linear(
        &self,
        w: sys::CUdeviceptr,
        out_f: u64,
        in_f: u64,
        tokens: u64,
    ) -> Result<(), ProxyError> {
        if !self.gemms {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        assert!(
            tokens * in_f * 2 <= self.input.len && tokens * out_f * 2 <= self.output.len,
            "scratch too small"
        );
        // SAFETY: shapes checked against the scratch sizes above; `w` holds
        // out_f × in_f bf16 (the caller's view); launched on the set stream.
        blas(
            unsafe {
                cublas::gemm_ex(
                    self.handle,
                    cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                    cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                    out_f as i32,
                    tokens as i32,
                    in_f as i32,
                    (&raw const alpha).cast(),
                    w as *const c_void,
                    cublas_sys::cudaDataType::CUDA_R_16BF,
                    in_f as i32,
                    self.input.ptr() as *const c_void,
                    cublas_sys::cudaDataType::CUDA_R_16BF,
                    in_f as i32,
                    (&raw const beta).cast(),
                    self.output.ptr() as *mut c_void,
                    cublas_sys::cudaDataType::CUDA_R_16BF,
                    out_f as i32,
                    cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            },
            "cublasGemmEx",
        )
    }

    /// Attention-sized batched GEMMs over the scratch: scores
    /// `S[h, t, t] = Q[h, t, d] · K[h, t, d]ᵀ`, then `O[h, t, d] = S · V`.
    pub fn attention(&self, heads: u64, tokens: u64, head_dim: u64) -> Result<(), ProxyError> {
        if !self.gemms {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let qkv = tokens * head_dim;
        let scores = tokens * tokens;
        assert!(
            heads * qkv * 2 <= self.input.len && heads * (scores + qkv) * 2 <= self.output.len,
            "scratch too small"
        );
        let gemm = |transa,
                    transb,
                    m: u64,
                    n: u64,
                    k: u64,
                    a: u64,
                    lda: u64,
                    sa: u64,
                    b: u64,
                    ldb: u64,
                    sb: u64,
                    c: u64,
                    ldc: u64,
                    sc: u64| {
            // SAFETY: every operand lies within the scratch buffers (sizes
            // checked above); launched on the set stream.
            blas(
                unsafe {
                    cublas::gemm_strided_batched_ex(
                        self.handle,
                        transa,
                        transb,
                        m as i32,
                        n as i32,
                        k as i32,
                        (&raw const alpha).cast(),
                        a as *const c_void,
                        cublas_sys::cudaDataType::CUDA_R_16BF,
                        lda as i32,
                        sa as i64,
                        b as *const c_void,
                        cublas_sys::cudaDataType::CUDA_R_16BF,
                        ldb as i32,
                        sb as i64,
                        (&raw const beta).cast(),
                        c as *mut c_void,
                        cublas_sys::cudaDataType::CUDA_R_16BF,
                        ldc as i32,
                        sc as i64,
                        heads as i32,
                        cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                },
                "cublasGemmStridedBatchedEx",
            )
        };
        use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let (x, s) = (self.input.ptr(), self.output.ptr());
        let o = s + heads * scores * 2;
        // Column-major: S (t×t) = Kᵀ (t×d) · Q (d×t); Q, K and V share the input.
        gemm(
            CUBLAS_OP_T,
            CUBLAS_OP_N,
            tokens,
            tokens,
            head_dim,
            x,
            head_dim,
            qkv,
            x,
            head_dim,
            qkv,
            s,
            tokens,
            scores,
        )?;
        // O (d×t) = V (d×t) · S (t×t), after the scores in the output.
        gemm(
            CUBLAS_OP_N,
            CUBLAS_OP_N,
            head_dim,
            tokens,
            tokens,
            x,
            head_dim,
            qkv,
            s,
            tokens,
            scores,
            o,
            head_dim,
            qkv,
        )
    }

    /// Waits for `stream` and reads the checksum.
    pub fn read_sum(&self, device: &CudaDevice, stream: &CudaStream) -> Result<u64, ProxyError> {
        device.synchronize_stream(stream)?;
        let mut out = [0u64; 1];
        // SAFETY: `sum` holds one u64; the stream is synchronised.
        unsafe { result::memcpy_dtoh_sync(&mut out, self.sum.ptr()) }.map_err(|e| CudaError {
            operation: "cuMemcpyDtoH(sum)".to_owned(),
            code: e.0,
        })?;
        Ok(out[0])
    }

    /// Frees the scratch (after `stream` drained).
    pub fn free(self, device: &CudaDevice) -> Result<(), ProxyError> {
        device.bind()?;
        // SAFETY: callers drain the stream first; nothing uses the scratch.
        unsafe {
            let _ = cublas::destroy_handle(self.handle);
            let _ = result::module::unload(self.module);
            device.free_device(self.sum, &[])?;
            device.free_device(self.input, &[])?;
            device.free_device(self.output, &[])?;
        }
        Ok(())
    }
}
