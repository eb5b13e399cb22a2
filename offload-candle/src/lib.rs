//! `offload-candle`: candle models streamed by offload.
//!
//! A model written with candle reads its weights through [`ModuleWeights`]
//! scopes ([`flux::Flux`] is Flux.1's DiT written that way). Two kinds of
//! scope run the same model code:
//!
//! - a map of resident tensors (`HashMap<String, Tensor>`, what candle's own
//!   safetensors loader returns): the baseline;
//! - [`OffloadScope`]: an offload forward scope, whose blocks are streamed
//!   by the enabled backend (layerwise, model-level, budgeted); each view is
//!   turned into a candle tensor by a [`ViewTensors`].
//!
//! [`HostCopy`] copies a view to the host through the device traits (any
//! backend, the simulator included: what the tests use without a GPU). With
//! the `cuda` feature, `cuda::Zerocopy` makes a candle CUDA tensor that reads
//! the slot in place, ordered on offload's compute stream.

use std::cell::RefCell;

use candle_core::{Device as CandleDevice, Result, Tensor};
use offload_core::device::{Api, Device as _, HostBuffer as _};
use offload_core::model::DType;
use offload_core::runtime::{Scope, View};

pub mod flux;

#[cfg(feature = "cuda")]
pub mod cuda;

#[cfg(feature = "cuda")]
pub mod lt;

#[cfg(feature = "cuda")]
pub mod fused;

pub use flux::{Flux, FluxConfig, FluxInputs, ModuleWeights, Weights};

/// candle's element type for offload's, where candle has one.
pub fn candle_dtype(d: DType) -> Result<candle_core::DType> {
    use candle_core::DType as C;
    Ok(match d {
        DType::Bf16 => C::BF16,
        DType::F16 => C::F16,
        DType::F32 => C::F32,
        DType::F64 => C::F64,
        DType::I64 => C::I64,
        DType::U8 | DType::Bool => C::U8,
        DType::F8E4M3 => C::F8E4M3,
        other => {
            return Err(candle_core::Error::Msg(format!(
                "offload dtype {other} has no candle counterpart"
            )));
        }
    })
}

/// Refuses a view that is not its shape laid out contiguously (a strided or
/// transposed alias): a tensor made from its bytes would read the wrong
/// elements.
pub(crate) fn require_contiguous(view: &View<'_, impl Api>) -> Result<()> {
    let t = view.tensor();
    let mut expected = vec![0u64; t.shape.len()];
    let mut acc = 1u64;
    for (i, d) in t.shape.iter().enumerate().rev() {
        expected[i] = acc;
        acc = acc.saturating_mul(*d);
    }
    let dims_of_one_ok = t
        .strides
        .iter()
        .zip(&expected)
        .zip(&t.shape)
        .all(|((s, e), d)| s == e || *d == 1);
    if dims_of_one_ok {
        Ok(())
    } else {
        Err(candle_core::Error::Msg(format!(
            "tensor `{}` has strides {:?} for shape {:?}: only contiguous views become candle tensors",
            t.name, t.strides, t.shape
        )))
    }
}

fn shape_of(view: &View<'_, impl Api>) -> Vec<usize> {
    view.tensor().shape.iter().map(|&d| d as usize).collect()
}

/// Turns a lent view into a candle tensor.
pub trait ViewTensors<A: Api> {
    /// The tensor `view` holds, readable by candle operations issued while
    /// the scope that lent it runs (a copy, or the slot itself).
    fn tensor(&self, scope: &Scope<'_, A>, view: &View<'_, A>) -> Result<Tensor>;

    /// Called when a module's scope opens, before its first candle
    /// operation: orders candle's work after what the scope's stream holds
    /// (the slot's fill). Default: nothing (copies are already ordered).
    fn enter(&self, scope: &Scope<'_, A>) -> Result<()> {
        let _ = scope;
        Ok(())
    }

    /// Called when a module's scope closes, after its last candle operation
    /// was issued: orders the scope's stream (and so the slot's reuse) after
    /// candle's work. Default: nothing.
    fn exit(&self, scope: &Scope<'_, A>) -> Result<()> {
        let _ = scope;
        Ok(())
    }
}

/// Copies each view to the host through the device traits (a pinned
/// buffer, a device→host copy on the compute stream, a wait), and makes a
/// candle tensor on `target` from the bytes. Works on every backend; costs a
/// host round trip per tensor (tests, the simulator).
#[derive(Debug)]
pub struct HostCopy {
    /// Where the tensors are made.
    pub target: CandleDevice,
}

impl<A: Api> ViewTensors<A> for HostCopy {
    fn tensor(&self, scope: &Scope<'_, A>, view: &View<'_, A>) -> Result<Tensor> {
        require_contiguous(view)?;
        let range = view.byte_range();
        let bytes = range.end - range.start;
        let dev = scope.device();
        let wrap = |what: &str, e: A::Error| candle_core::Error::Msg(format!("{what}: {e}"));
        let mut host = dev
            .alloc_pinned(bytes)
            .map_err(|e| wrap("alloc_pinned", e))?;
        // SAFETY: the source range is the view's, inside its buffer, which
        // the scope keeps resident while it runs; the destination is the
        // whole of a fresh buffer; the stream is synchronised below before
        // the buffer is read or freed.
        unsafe {
            dev.copy_d2h(
                scope.stream(),
                view.buffer(),
                range.start,
                &mut host,
                0,
                bytes,
            )
        }
        .map_err(|e| wrap("copy_d2h", e))?;
        dev.synchronize_stream(scope.stream())
            .map_err(|e| wrap("synchronize_stream", e))?;
        let mut out = vec![0u8; bytes as usize];
        host.read_into(0, &mut out);
        // SAFETY: the stream that copied into `host` was synchronised above.
        unsafe { dev.free_pinned(host) }.map_err(|e| wrap("free_pinned", e))?;
        let dtype = candle_dtype(view.tensor().dtype)?;
        Tensor::from_raw_buffer(&out, dtype, &shape_of(view), &self.target)
    }
}

/// Runs the forward of the module at `path` on `rt` with `f` reading its
/// weights through an [`OffloadScope`]: an offload error inside a block's
/// scope comes back as itself (typed), any other as the module's forward
/// error. `None` when a hook skipped the forward.
pub fn forward_in<A: Api, V: ViewTensors<A>, R>(
    rt: &offload_core::runtime::Runtime<A>,
    path: &str,
    views: &V,
    f: impl FnOnce(&OffloadScope<'_, '_, A, V>) -> Result<R>,
) -> std::result::Result<Option<R>, offload_core::OffloadError> {
    rt.forward(path, |scope| {
        let weights = OffloadScope::new(scope, views);
        f(&weights).map_err(|e| match weights.take_error() {
            Some(offload) => Box::new(offload) as Box<dyn std::error::Error + Send + Sync>,
            None => Box::new(e),
        })
    })
}

/// An offload forward scope of the DiT as a [`ModuleWeights`]: path `""`
/// reads the DiT's own (resident) tensors, a block path runs that block's
/// forward scope (its hooks stream it in, its views are the slot) and reads
/// its tensors there.
pub struct OffloadScope<'a, 's, A: Api, V: ViewTensors<A>> {
    scope: &'a Scope<'s, A>,
    views: &'a V,
    /// The first offload error of a block scope, kept whole for the caller.
    error: RefCell<Option<offload_core::OffloadError>>,
}

impl<'a, 's, A: Api, V: ViewTensors<A>> OffloadScope<'a, 's, A, V> {
    /// The DiT's scope `scope`, its views made into tensors by `views`.
    pub fn new(scope: &'a Scope<'s, A>, views: &'a V) -> Self {
        Self {
            scope,
            views,
            error: RefCell::new(None),
        }
    }

    /// The offload error that failed a block scope, if one did.
    pub fn take_error(&self) -> Option<offload_core::OffloadError> {
        self.error.borrow_mut().take()
    }
}

impl<A: Api, V: ViewTensors<A>> ModuleWeights for OffloadScope<'_, '_, A, V> {
    fn with_module<R>(
        &self,
        path: &str,
        f: &mut dyn FnMut(&dyn Weights) -> Result<R>,
    ) -> Result<R> {
        let run = |scope: &Scope<'_, A>, f: &mut dyn FnMut(&dyn Weights) -> Result<R>| {
            let get = |name: &str| -> Result<Tensor> {
                let view = scope.view(name).map_err(candle_core::Error::wrap)?;
                self.views.tensor(scope, &view)
            };
            self.views.enter(scope)?;
            let out = f(&get);
            // Ordered even when `f` failed: its issued work may still read
            // the slot.
            self.views.exit(scope)?;
            out
        };
        if path.is_empty() {
            return run(self.scope, f);
        }
        let ran = self.scope.child(path, |blk| {
            run(blk, &mut *f).map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
        });
        match ran {
            Ok(Some(r)) => Ok(r),
            Ok(None) => Err(candle_core::Error::Msg(format!(
                "the forward of `{path}` was skipped by a hook"
            ))),
            Err(e) => {
                let msg = e.to_string();
                self.error.borrow_mut().get_or_insert(e);
                Err(candle_core::Error::Msg(msg))
            }
        }
    }
}
