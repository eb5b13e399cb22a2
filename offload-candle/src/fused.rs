//! Flux's elementwise work as three hand-written kernels (`fused.cu`,
//! compiled once per process with nvrtc, as `offload-cuda`'s proxy kernels
//! are): q/k RMSNorm and RoPE in one pass over `[B, L, H, D]` in place,
//! AdaLN's gate and residual add in one pass, and a strided copy that puts
//! the attention's output beside the single block's MLP in the buffer its
//! output projection reads. Each replaces two to four of candle's kernels
//! and their f32 or concatenation round trips; `offload-flux-bench` checks
//! each against candle's plain operations on the GPU.
//!
//! Every kernel reads and writes bf16 and rounds where diffusers' separate
//! PyTorch kernels round, so the fused forward stays as close to diffusers
//! as the plain one. Each needs contiguous operands with 16-byte aligned
//! starts (the callers check with [`fits`] and take candle's path
//! otherwise); the choice depends on shapes and offsets, which are the same
//! for the offloaded and the resident forward.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice as CandleCuda, WrapErr};
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::bf16;

/// The kernels' CUDA C source.
pub const SRC: &str = include_str!("fused.cu");

const MODULE: &str = "offload_candle_fused";

static LAUNCHES: AtomicU64 = AtomicU64::new(0);
static FALLBACKS: AtomicU64 = AtomicU64::new(0);

/// (fused kernels launched, residual adds that fell back to candle's
/// operations with [`crate::flux::Kernels::fused_gate`] on: an unaligned or
/// strided operand) since the process started; a run shows none fell back.
pub fn stats() -> (u64, u64) {
    (
        LAUNCHES.load(Ordering::Relaxed),
        FALLBACKS.load(Ordering::Relaxed),
    )
}

pub(crate) fn count_launch() {
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn count_fallback() {
    FALLBACKS.fetch_add(1, Ordering::Relaxed);
}

fn msg(text: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(text.into())
}

/// The PTX of [`SRC`], compiled at the first call (nvrtc's error kept for
/// every later one).
fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        candle_core::cuda_backend::cudarc::nvrtc::compile_ptx(SRC)
            .map(|p| p.to_src())
            .map_err(|e| format!("nvrtc compiling offload-candle's fused kernels: {e:?}"))
    })
    .as_deref()
    .map_err(|e| msg(e.clone()))
}

/// Whether `t` is a contiguous bf16 CUDA tensor whose first element is
/// 16-byte aligned (what the kernels' vector loads need).
pub fn fits(t: &Tensor) -> bool {
    if t.dtype() != DType::BF16 || !t.is_contiguous() {
        return false;
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(c) = &*storage else {
        return false;
    };
    let Ok(slice) = c.as_cuda_slice::<bf16>() else {
        return false;
    };
    let stream = c.device().cuda_stream();
    let view = slice.slice(layout.start_offset()..);
    let (ptr, _record) = view.device_ptr(&stream);
    ptr % 16 == 0
}

/// A bf16 CUDA tensor of `shape` whose contents are undefined.
///
/// # Safety
///
/// The caller writes every element before anything reads it.
pub unsafe fn uninit(shape: impl Into<Shape>, device: &candle_core::Device) -> Result<Tensor> {
    let shape = shape.into();
    let candle_core::Device::Cuda(dev) = device else {
        return Err(msg(format!("uninit: a CUDA device, not {device:?}")));
    };
    // SAFETY: the caller's contract: every element is written before a read.
    let slice = unsafe { dev.alloc::<bf16>(shape.elem_count())? };
    Ok(Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone())),
        shape,
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// Checks `t` is a contiguous CUDA tensor of bf16 or f32.
fn check_cuda(t: &Tensor) -> Result<()> {
    if !t.device().is_cuda() || t.dtype() != DType::BF16 && t.dtype() != DType::F32 {
        return Err(msg(format!(
            "fused kernels: a CUDA bf16/f32 tensor, not {:?} on {:?}",
            t.dtype(),
            t.device()
        )));
    }
    if !t.is_contiguous() {
        return Err(msg("fused kernels: a strided operand"));
    }
    Ok(())
}

/// The `T` elements of a storage [`check_cuda`] checked, as a view.
fn slice_of<'a, T: candle_core::cuda_backend::CudaDType>(
    storage: &'a Storage,
    layout: &Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    let Storage::Cuda(c) = storage else {
        return Err(msg("fused kernels: a strided or non-CUDA operand"));
    };
    view_of(c, layout, "fused kernels: a strided or non-CUDA operand")
}

/// The `T` elements `l` lays out in `s` (contiguous, else the error `err`).
fn view_of<'a, T: candle_core::cuda_backend::CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    err: &str,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    let (a, z) = l.contiguous_offsets().ok_or_else(|| msg(err))?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..z))
}

/// An error unless `view`'s first element is `align`-byte aligned (what
/// the kernel's vector loads of it need: a misaligned load would fault and
/// take the context with it).
fn check_aligned<T>(
    what: &str,
    view: &impl DevicePtr<T>,
    stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    align: u64,
) -> Result<()> {
    let (ptr, _record) = view.device_ptr(stream);
    if ptr % align == 0 {
        Ok(())
    } else {
        Err(msg(format!(
            "fused kernels: {what} at {ptr:#x} is not {align}-byte aligned"
        )))
    }
}

/// Launch shape for `threads` threads in blocks of 256.
fn grid(threads: usize) -> Result<LaunchConfig> {
    let blocks = u32::try_from(threads.div_ceil(256))
        .map_err(|_| msg(format!("fused kernels: {threads} threads is too many")))?;
    Ok(LaunchConfig {
        grid_dim: (blocks.max(1), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// diffusers' q/k RMSNorm then RoPE (interleaved pairs, f32 inside), in
/// place over `x` `[B, L, heads, 128]` bf16: tokens below `split` normalised
/// by `w_first`, the rest by `w_rest` (`[128]` bf16 each), rotated by `cos`
/// and `sin` `[L, 64]` f32 (batch 1 shares them; B·L rows in all).
pub fn qk_norm_rope(
    x: &Tensor,
    w_first: &Tensor,
    w_rest: &Tensor,
    split: usize,
    cos: &Tensor,
    sin: &Tensor,
    eps: f32,
) -> Result<()> {
    let (b, l, heads, d) = x.dims4()?;
    if d != 128 || b != 1 {
        return Err(msg(format!(
            "qk_norm_rope: [1, L, H, 128], not {:?}",
            x.shape()
        )));
    }
    for (name, t, dims) in [
        ("w_first", w_first, vec![d]),
        ("w_rest", w_rest, vec![d]),
        ("cos", cos, vec![l, d / 2]),
        ("sin", sin, vec![l, d / 2]),
    ] {
        if t.dims() != dims.as_slice() {
            return Err(msg(format!(
                "qk_norm_rope: {name} {:?}, not {dims:?}",
                t.shape()
            )));
        }
    }
    if cos.dtype() != DType::F32 || sin.dtype() != DType::F32 {
        return Err(msg("qk_norm_rope: f32 tables"));
    }
    x.inplace_op1(&QkNormRope {
        w: [w_first.clone(), w_rest.clone()],
        cos: cos.clone(),
        sin: sin.clone(),
        rows: l,
        heads,
        split,
        eps,
    })
}

struct QkNormRope {
    w: [Tensor; 2],
    cos: Tensor,
    sin: Tensor,
    rows: usize,
    heads: usize,
    split: usize,
    eps: f32,
}

impl candle_core::InplaceOp1 for QkNormRope {
    fn name(&self) -> &'static str {
        "qk-norm-rope"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        Err(msg("qk_norm_rope: CUDA only"))
    }

    fn cuda_fwd(&self, x: &mut CudaStorage, xl: &Layout) -> Result<()> {
        let dev: CandleCuda = x.device().clone();
        let (a, z) = xl
            .contiguous_offsets()
            .ok_or_else(|| msg("qk_norm_rope: a strided x"))?;
        for t in [&self.w[0], &self.w[1], &self.cos, &self.sin] {
            check_cuda(t)?;
        }
        let (g0, l0) = self.w[0].storage_and_layout();
        let (g1, l1) = self.w[1].storage_and_layout();
        let (gc, lc) = self.cos.storage_and_layout();
        let (gs, ls) = self.sin.storage_and_layout();
        let (w0, w1) = (slice_of::<bf16>(&g0, l0)?, slice_of::<bf16>(&g1, l1)?);
        let (cos, sin) = (slice_of::<f32>(&gc, lc)?, slice_of::<f32>(&gs, ls)?);
        let stream = dev.cuda_stream();
        for (what, v) in [("w_first", &w0), ("w_rest", &w1)] {
            check_aligned(what, v, &stream, 8)?;
        }
        check_aligned("cos", &cos, &stream, 8)?;
        check_aligned("sin", &sin, &stream, 8)?;
        let mut xs = x.as_cuda_slice_mut::<bf16>()?.slice_mut(a..z);
        check_aligned("x", &xs, &stream, 8)?;
        let func = dev.get_or_load_custom_func("qk_norm_rope", MODULE, ptx()?)?;
        let (rows, heads, split) = (
            i32::try_from(self.rows).map_err(|_| msg("qk_norm_rope: rows"))?,
            i32::try_from(self.heads).map_err(|_| msg("qk_norm_rope: heads"))?,
            i32::try_from(self.split.min(self.rows)).map_err(|_| msg("qk_norm_rope: split"))?,
        );
        let cfg = grid(self.rows * self.heads * 32)?;
        let mut builder = func.builder();
        builder.arg(&mut xs);
        builder.arg(&w0);
        builder.arg(&w1);
        builder.arg(&cos);
        builder.arg(&sin);
        builder.arg(&rows);
        builder.arg(&heads);
        builder.arg(&split);
        builder.arg(&self.eps);
        // SAFETY: the kernel reads rows·heads·128 values of x (its view
        // holds exactly those), 128 of each weight and rows·64 of each
        // table, as checked by `qk_norm_rope`'s shapes.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(())
    }
}

/// `x + g ⊙ y` for `x`, `y` `[B, L, H]` bf16 and a gate `g` `[B, H]` (B
/// 1): one pass, rounded as diffusers' multiply then add.
pub fn gate_residual(x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor> {
    let (b, _, h) = x.dims3()?;
    if b != 1 || y.dims() != x.dims() || g.elem_count() != h || h % 8 != 0 {
        return Err(msg(format!(
            "gate_residual: x {:?}, y {:?}, g {:?}",
            x.shape(),
            y.shape(),
            g.shape()
        )));
    }
    let g = g.reshape(h)?;
    x.apply_op3_no_bwd(y, &g, &GateResidual)
}

struct GateResidual;

impl candle_core::CustomOp3 for GateResidual {
    fn name(&self) -> &'static str {
        "gate-residual"
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
        Err(msg("gate_residual: CUDA only"))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        y: &CudaStorage,
        yl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = x.device().clone();
        let strided = "gate_residual: a strided operand";
        let (xs, ys, gs) = (
            view_of::<bf16>(x, xl, strided)?,
            view_of::<bf16>(y, yl, strided)?,
            view_of::<bf16>(g, gl, strided)?,
        );
        let stream = dev.cuda_stream();
        for (what, v) in [("x", &xs), ("y", &ys), ("the gate", &gs)] {
            check_aligned(what, v, &stream, 16)?;
        }
        let n = xl.shape().elem_count();
        // SAFETY: the kernel writes all n values before anything reads them.
        let out = unsafe { dev.alloc::<bf16>(n)? };
        let func = dev.get_or_load_custom_func("gate_residual", MODULE, ptx()?)?;
        let n8 = (n / 8) as i64;
        let h8 = i32::try_from(gl.shape().elem_count() / 8).map_err(|_| msg("gate_residual: h"))?;
        let mut builder = func.builder();
        builder.arg(&xs);
        builder.arg(&ys);
        builder.arg(&gs);
        builder.arg(&out);
        builder.arg(&n8);
        builder.arg(&h8);
        // SAFETY: x, y and out hold n values (n a multiple of h, h of 8,
        // checked by `gate_residual`), g holds h; 16-byte alignment is the
        // caller's check (`fits`).
        unsafe { builder.launch(grid(n / 8)?) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), xl.shape().clone()))
    }
}

/// Copies `src` `[B, L, C]` into columns `offset..offset + C` of `dst`
/// `[B, L, W]` (both bf16, contiguous, C, W and the offset multiples of 8).
pub fn copy_into_columns(dst: &Tensor, src: &Tensor, offset: usize) -> Result<()> {
    let (b, l, c) = src.dims3()?;
    let (db, dl, w) = dst.dims3()?;
    if (b, l) != (db, dl) || offset + c > w || c % 8 != 0 || w % 8 != 0 || offset % 8 != 0 {
        return Err(msg(format!(
            "copy_into_columns: {:?} at column {offset} of {:?}",
            src.shape(),
            dst.shape()
        )));
    }
    dst.inplace_op2(src, &CopyCols { offset })
}

struct CopyCols {
    offset: usize,
}

impl candle_core::InplaceOp2 for CopyCols {
    fn name(&self) -> &'static str {
        "copy-columns"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        Err(msg("copy_into_columns: CUDA only"))
    }

    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dl: &Layout,
        src: &CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        let dev = dst.device().clone();
        let ss = view_of::<bf16>(src, sl, "copy_into_columns: a strided source")?;
        let (da, dz) = dl
            .contiguous_offsets()
            .ok_or_else(|| msg("copy_into_columns: a strided destination"))?;
        let mut ds = dst.as_cuda_slice_mut::<bf16>()?.slice_mut(da..dz);
        let stream = dev.cuda_stream();
        check_aligned("the copy's source", &ss, &stream, 16)?;
        check_aligned("the copy's destination", &ds, &stream, 16)?;
        let cols = *sl
            .dims()
            .last()
            .ok_or_else(|| msg("copy_into_columns: rank"))?;
        let width = *dl
            .dims()
            .last()
            .ok_or_else(|| msg("copy_into_columns: rank"))?;
        let rows = sl.shape().elem_count() / cols.max(1);
        let func = dev.get_or_load_custom_func("copy_cols", MODULE, ptx()?)?;
        let to_i32 = |v: usize| i32::try_from(v / 8).map_err(|_| msg("copy_into_columns: width"));
        let (rows64, cols8, ld8, off8) = (
            rows as i64,
            to_i32(cols)?,
            to_i32(width)?,
            to_i32(self.offset)?,
        );
        let mut builder = func.builder();
        builder.arg(&ss);
        builder.arg(&mut ds);
        builder.arg(&rows64);
        builder.arg(&cols8);
        builder.arg(&ld8);
        builder.arg(&off8);
        // SAFETY: src holds rows·cols values, dst rows·width, and every
        // write lands in columns offset..offset + cols < width of a row
        // (checked by `copy_into_columns`).
        unsafe { builder.launch(grid(rows * cols / 8)?) }.w()?;
        Ok(())
    }
}
