//! Linear layers as one cuBLASLt GEMM with the bias added in its epilogue
//! (as PyTorch's `F.linear` runs on CUDA): the product accumulates in f32,
//! the bias is added to the f32 sum and the result rounded to bf16 once,
//! where candle's `Linear` rounds the product to bf16 and adds the bias in
//! a second, broadcast kernel (per-element index arithmetic: ~137 ms of a
//! 4,608-token Flux step).
//!
//! The handle (with cuBLASLt's 32 MiB Hopper workspace) is made once per
//! candle stream and kept for the process. Operands whose device addresses
//! are not 256-byte aligned (cuBLASLt's default assumption, which cudarc's
//! safe matmul leaves in place) take candle's path instead; [`stats`]
//! counts both, so a run can show that none did. (Flux's block tensors are
//! all multiples of 256 bytes, so offload's slots, packed back to back from
//! an aligned base, keep every one aligned: the offloaded and resident
//! forwards take the same path and compute the same bits.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use candle_core::cuda_backend::cudarc::driver::{CudaView, DevicePtr};
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Module as _, Result, Shape, Tensor};

static LT_CALLS: AtomicU64 = AtomicU64::new(0);
static FALLBACKS: AtomicU64 = AtomicU64::new(0);

/// (GEMMs run through cuBLASLt, linears of two rows or more that fell
/// back to candle's: an unaligned operand, or a GEMM cuBLASLt refused)
/// since the process started.
pub fn stats() -> (u64, u64) {
    (
        LT_CALLS.load(Ordering::Relaxed),
        FALLBACKS.load(Ordering::Relaxed),
    )
}

/// cuBLASLt handles by the address of the stream they launch on.
type Handles = Mutex<Vec<(usize, Arc<CudaBlasLT>)>>;

/// The handle of `dev`'s stream, made at its first GEMM.
fn handle(dev: &candle_core::CudaDevice) -> Result<Arc<CudaBlasLT>> {
    static HANDLES: OnceLock<Handles> = OnceLock::new();
    let stream = dev.cuda_stream();
    let key = Arc::as_ptr(&stream) as usize;
    let mut handles = HANDLES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, h)) = handles.iter().find(|(k, _)| *k == key) {
        return Ok(Arc::clone(h));
    }
    let h = Arc::new(
        CudaBlasLT::new(stream)
            .map_err(|e| candle_core::Error::Msg(format!("cuBLASLt handle: {e:?}")))?,
    );
    handles.push((key, Arc::clone(&h)));
    Ok(h)
}

/// `x · wᵀ + b` for bf16 `x` `[…, K]`, `w` `[N, K]`, `b` `[N]`: one
/// cuBLASLt GEMM with a bias epilogue on CUDA where every operand is
/// contiguous and 256-byte aligned, else candle's `Linear` (counted as a
/// fallback, as is a GEMM cuBLASLt refuses, with a warning the first
/// time). A single row (the modulation GEMVs, a few µs) always takes
/// candle's path, uncounted: the choice depends on shapes, never on where
/// a tensor lives, so offloaded and resident forwards agree bit for bit.
pub fn linear_bias(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let plain = || candle_nn::Linear::new(w.clone(), Some(b.clone())).forward(x);
    let k = x.dims().last().copied().unwrap_or(0);
    if k == 0 || x.elem_count() / k < 2 {
        return plain();
    }
    let fits = [x, w, b]
        .iter()
        .all(|t| t.dtype() == DType::BF16 && t.is_contiguous() && aligned(t))
        && w.rank() == 2
        && b.rank() == 1;
    if fits {
        match x.apply_op3_no_bwd(w, b, &LinearBias) {
            Ok(out) => {
                LT_CALLS.fetch_add(1, Ordering::Relaxed);
                return Ok(out);
            }
            Err(e) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        "cuBLASLt linear refused {:?} · {:?}ᵀ: {e}; candle's Linear instead",
                        x.shape(),
                        w.shape()
                    );
                });
            }
        }
    }
    FALLBACKS.fetch_add(1, Ordering::Relaxed);
    plain()
}

/// Whether `t` is a CUDA tensor whose first element is 256-byte aligned.
fn aligned(t: &Tensor) -> bool {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(c) = &*storage else {
        return false;
    };
    let Ok(slice) = c.as_cuda_slice::<half::bf16>() else {
        return false;
    };
    let stream = c.device().cuda_stream();
    let view = slice.slice(layout.start_offset()..);
    let (ptr, _record) = view.device_ptr(&stream);
    ptr % ALIGN_BYTES == 0
}

/// The `len` elements of contiguous bf16 storage `s` from `l`'s start.
fn view<'a>(s: &'a CudaStorage, l: &Layout, len: usize) -> Result<CudaView<'a, half::bf16>> {
    let (start, _) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("cuBLASLt linear: a strided operand".into()))?;
    Ok(s.as_cuda_slice::<half::bf16>()?.slice(start..start + len))
}

/// The alignment cuBLASLt assumes of every operand unless told otherwise
/// (`CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES`' default).
const ALIGN_BYTES: u64 = 256;

struct LinearBias;

impl candle_core::CustomOp3 for LinearBias {
    fn name(&self) -> &'static str {
        "linear-bias-cublaslt"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Err(candle_core::Error::Msg("cuBLASLt linear: CUDA only".into()))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = x.device().clone();
        let dims = xl.dims();
        let k = *dims
            .last()
            .ok_or_else(|| candle_core::Error::Msg("cuBLASLt linear: x of rank 0".into()))?;
        let rows = xl.shape().elem_count() / k.max(1);
        let (n, wk) = wl.shape().dims2()?;
        if wk != k || bl.shape().dims1()? != n {
            return Err(candle_core::Error::Msg(format!(
                "cuBLASLt linear: x {:?}, w {:?}, b {:?}",
                xl.shape(),
                wl.shape(),
                bl.shape()
            )));
        }
        let (xs, ws, bs) = (view(x, xl, rows * k)?, view(w, wl, n * k)?, view(b, bl, n)?);
        // SAFETY: every element is written by the GEMM below before any read.
        let mut out = unsafe { dev.alloc::<half::bf16>(rows * n)? };
        let stream = dev.cuda_stream();
        let out_ptr = out.device_ptr(&stream).0;
        if out_ptr % ALIGN_BYTES != 0 {
            return Err(candle_core::Error::Msg(format!(
                "cuBLASLt linear: candle allocated an output at {out_ptr:#x}, not {ALIGN_BYTES}-byte aligned"
            )));
        }
        // Row-major `out[rows, n] = x[rows, k] · w[n, k]ᵀ` is column-major
        // `outᵀ[n, rows] = w · xᵀ`: A = w transposed (lda k), B = x (ldb k),
        // C `n × rows` (ldc n), the bias one value per row of C.
        let cfg = MatmulConfig {
            transa: true,
            transb: false,
            transc: false,
            m: n as u64,
            n: rows as u64,
            k: k as u64,
            alpha: 1.0,
            lda: k as i64,
            ldb: k as i64,
            beta: 0.0,
            ldc: n as i64,
            stride_a: None,
            stride_b: None,
            stride_c: None,
            stride_bias: None,
            batch_size: None,
        };
        let lt = handle(&dev)?;
        // SAFETY: the views and `out` hold exactly the elements the
        // configuration reads and writes (n·k, rows·k, n and rows·n), on
        // the stream the handle launches on.
        unsafe { lt.matmul(cfg, &ws, &xs, &mut out, Some(&bs), None) }
            .map_err(|e| candle_core::Error::Msg(format!("cuBLASLt linear: {e:?}")))?;
        let mut shape = dims.to_vec();
        *shape.last_mut().expect("rank ≥ 1") = n;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(shape)))
    }
}
