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
use candle_core::cuda_backend::cudarc::cublaslt::{Activation, CudaBlasLT, Matmul, MatmulConfig};
use candle_core::cuda_backend::cudarc::driver::{CudaView, DevicePtr, DevicePtrMut};
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
    linear_bias_act(x, w, b, false)
}

/// [`linear_bias`], then with `gelu` the tanh-approximated GELU (Flux's
/// `gelu-approximate`) in the same epilogue, on the f32 sum (candle's
/// path: the linear, then candle's `gelu`).
pub fn linear_bias_act(x: &Tensor, w: &Tensor, b: &Tensor, gelu: bool) -> Result<Tensor> {
    let plain = || {
        let y = candle_nn::Linear::new(w.clone(), Some(b.clone())).forward(x)?;
        if gelu { y.gelu() } else { Ok(y) }
    };
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
        match x.apply_op3_no_bwd(w, b, &LinearBias { gelu }) {
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

struct LinearBias {
    gelu: bool,
}

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
        gemm(
            &dev,
            &xs,
            &ws,
            &bs,
            &mut out,
            Gemm {
                rows,
                n,
                k,
                ldc: n,
                gelu: self.gelu,
            },
        )?;
        let mut shape = dims.to_vec();
        *shape.last_mut().expect("rank ≥ 1") = n;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(shape)))
    }
}

/// Whether element (`row`, `col`) of a bf16 buffer `width` wide starts
/// [`ALIGN_BYTES`]-aligned given an aligned base (what [`linear_into`]
/// needs of the block it writes): a decision by shape, so the offloaded and
/// the resident forward make the same one.
pub fn aligned_at(row: usize, width: usize, col: usize) -> bool {
    ((row * width + col) * 2) as u64 % ALIGN_BYTES == 0
}

/// One GEMM's shape: `out[rows, n]` (row stride `ldc`) `= act(x[rows, k] ·
/// w[n, k]ᵀ + b)`.
#[derive(Clone, Copy)]
struct Gemm {
    rows: usize,
    n: usize,
    k: usize,
    ldc: usize,
    gelu: bool,
}

/// Launches `g` on `dev`'s stream, writing `out` (whose first element must
/// be [`ALIGN_BYTES`]-aligned; the caller's views hold at least what `g`
/// reads and writes).
fn gemm<O: DevicePtrMut<half::bf16>>(
    dev: &candle_core::CudaDevice,
    xs: &CudaView<'_, half::bf16>,
    ws: &CudaView<'_, half::bf16>,
    bs: &CudaView<'_, half::bf16>,
    out: &mut O,
    g: Gemm,
) -> Result<()> {
    let stream = dev.cuda_stream();
    let out_ptr = out.device_ptr_mut(&stream).0;
    if out_ptr % ALIGN_BYTES != 0 {
        return Err(candle_core::Error::Msg(format!(
            "cuBLASLt linear: an output at {out_ptr:#x}, not {ALIGN_BYTES}-byte aligned"
        )));
    }
    let need = (g.rows.saturating_sub(1)) * g.ldc + g.n;
    if out.len() < need || xs.len() < g.rows * g.k || ws.len() < g.n * g.k || bs.len() < g.n {
        return Err(candle_core::Error::Msg(format!(
            "cuBLASLt linear: operands too short for {} × {} · {}",
            g.rows, g.k, g.n
        )));
    }
    // Row-major `out[rows, n] = x[rows, k] · w[n, k]ᵀ` is column-major
    // `outᵀ[n, rows] = w · xᵀ`: A = w transposed (lda k), B = x (ldb k),
    // C `n × rows` (ldc: the output's row stride), the bias one value per
    // row of C.
    let cfg = MatmulConfig {
        transa: true,
        transb: false,
        transc: false,
        m: g.n as u64,
        n: g.rows as u64,
        k: g.k as u64,
        alpha: 1.0,
        lda: g.k as i64,
        ldb: g.k as i64,
        beta: 0.0,
        ldc: g.ldc as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    };
    let lt = handle(dev)?;
    let act = g.gelu.then_some(Activation::Gelu);
    // SAFETY: the views and `out` hold at least the elements the
    // configuration reads and writes (n·k, rows·k, n, and (rows − 1)·ldc +
    // n, checked above), on the stream the handle launches on.
    unsafe { lt.matmul(cfg, ws, xs, out, Some(bs), act.as_ref()) }
        .map_err(|e| candle_core::Error::Msg(format!("cuBLASLt linear: {e:?}")))
}

/// `x · wᵀ + b` (then GELU with `gelu`) written straight into rows `row..`
/// and columns `col..col + N` of `dst` `[B, L, W]` bf16: a concatenation
/// buffer filled by its producers' GEMMs, with no copy. Every operand
/// contiguous and 256-byte aligned (the written block's first element
/// included), else an error: the caller takes the unfused path by shape,
/// never by address.
pub fn linear_into(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    dst: &Tensor,
    row: usize,
    col: usize,
    gelu: bool,
) -> Result<()> {
    let k = x.dims().last().copied().unwrap_or(0);
    let rows = if k == 0 { 0 } else { x.elem_count() / k };
    let (n, wk) = w.dims2()?;
    let (db, dl, width) = dst.dims3()?;
    if rows == 0 {
        return Ok(());
    }
    let fits = [x, w, b]
        .iter()
        .all(|t| t.dtype() == DType::BF16 && t.is_contiguous() && aligned(t))
        && dst.dtype() == DType::BF16
        && dst.is_contiguous()
        && wk == k
        && b.dims() == [n]
        && db == 1
        && row + rows <= dl
        && col + n <= width;
    if !fits {
        return Err(candle_core::Error::Msg(format!(
            "cuBLASLt linear into {:?} at ({row}, {col}): x {:?}, w {:?}, b {:?} (bf16, contiguous, aligned)",
            dst.shape(),
            x.shape(),
            w.shape(),
            b.shape()
        )));
    }
    dst.inplace_op3(
        x,
        w,
        &LinearInto {
            bias: b.clone(),
            offset: row * width + col,
            g: Gemm {
                rows,
                n,
                k,
                ldc: width,
                gelu,
            },
        },
    )?;
    LT_CALLS.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

struct LinearInto {
    bias: Tensor,
    /// The written block's first element in `dst`.
    offset: usize,
    g: Gemm,
}

impl candle_core::InplaceOp3 for LinearInto {
    fn name(&self) -> &'static str {
        "linear-into-cublaslt"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        Err(candle_core::Error::Msg("cuBLASLt linear: CUDA only".into()))
    }

    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dl: &Layout,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<()> {
        let dev = x.device().clone();
        let g = self.g;
        let (bias, bl) = self.bias.storage_and_layout();
        let candle_core::Storage::Cuda(bias) = &*bias else {
            return Err(candle_core::Error::Msg(
                "cuBLASLt linear: a CPU bias".into(),
            ));
        };
        let (xs, ws, bs) = (
            view(x, xl, g.rows * g.k)?,
            view(w, wl, g.n * g.k)?,
            view(bias, bl, g.n)?,
        );
        let (start, end) = dl
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("cuBLASLt linear: a strided output".into()))?;
        let mut out = dst
            .as_cuda_slice_mut::<half::bf16>()?
            .slice_mut(start + self.offset..end);
        gemm(&dev, &xs, &ws, &bs, &mut out, g)
    }
}
