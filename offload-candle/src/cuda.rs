//! Candle CUDA tensors that read offload's slots in place.
//!
//! [`ZeroCopy`] wraps each lent view's device memory as a candle tensor
//! without a copy. The slots are fixed (allocated once at `enable`), so the
//! same view recurs every step: the tensors are cached by address, dtype
//! and shape, their number bounded by the slots' layouts, and never freed
//! by candle (the memory is offload's; the cache is forgotten at drop, a
//! few hundred bytes of host bookkeeping per distinct view, once).
//!
//! Candle launches on its own stream. Each module scope is bridged with two
//! events: candle's stream waits for what offload's compute stream holds
//! when the scope opens (the slot's fill), and offload's compute stream
//! waits for candle's work when it closes, so the slot's last-use event,
//! recorded after, covers every candle kernel that read it.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::{result, sys};
use candle_core::cuda_backend::{CudaDevice as CandleCuda, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{Device, Result, Storage, Tensor};
use offload_core::runtime::{Scope, View};
use offload_cuda::Cuda;

use crate::{ViewTensors, candle_dtype};

type Key = (u64, u64, candle_core::DType, Vec<usize>);

fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("{what}: {e:?}"))
}

/// One reusable event (no timing), destroyed at drop.
struct Event(sys::CUevent);

// SAFETY: a CUDA event handle may be used from any thread of the process.
unsafe impl Send for Event {}
// SAFETY: as above; recording and waiting are thread-safe driver calls.
unsafe impl Sync for Event {}

impl Event {
    fn new() -> Result<Self> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(Self)
            .map_err(|e| err("cuEventCreate", e))
    }

    /// Records on `from` and makes `to` wait for it.
    fn order(&self, from: sys::CUstream, to: sys::CUstream) -> Result<()> {
        // SAFETY: the event is live (owned here) and both streams are live
        // for the call (their owners hold them).
        unsafe {
            result::event::record(self.0, from).map_err(|e| err("cuEventRecord", e))?;
            result::stream::wait_event(to, self.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                .map_err(|e| err("cuStreamWaitEvent", e))
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; the driver defers the
        // destruction until pending work on it completes.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// Lent views as candle CUDA tensors, read in place (see the module docs).
pub struct ZeroCopy {
    device: CandleCuda,
    cache: Mutex<HashMap<Key, Tensor>>,
    enter: Event,
    exit: Event,
    /// Held across each record + wait: the two events are shared, and a
    /// record by another thread between them would retarget the wait.
    bridge: Mutex<()>,
    /// Planted bug: `exit` orders nothing (the slot's last use is recorded
    /// before candle's kernels that read it ran).
    #[cfg(feature = "planted-bugs")]
    skip_exit: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for ZeroCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroCopy")
            .field("cached", &self.cached())
            .finish()
    }
}

impl ZeroCopy {
    /// Views as tensors on candle's `device`, which must be the GPU (the same
    /// primary context) the offload runtime runs on.
    ///
    /// # Safety
    ///
    /// The tensors it hands out read offload's slots: they (and views of
    /// them) must not be used by candle operations issued after the scope
    /// that lent them closed (a model that returns freshly computed
    /// tensors, as [`crate::flux::Flux`] does, keeps this), and the
    /// offload backend must outlive every operation issued on them.
    pub unsafe fn new(device: &Device) -> Result<Self> {
        let Device::Cuda(device) = device else {
            return Err(candle_core::Error::Msg(format!(
                "ZeroCopy needs a CUDA device, not {device:?}"
            )));
        };
        Ok(Self {
            device: device.clone(),
            cache: Mutex::new(HashMap::new()),
            enter: Event::new()?,
            exit: Event::new()?,
            bridge: Mutex::new(()),
            #[cfg(feature = "planted-bugs")]
            skip_exit: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Plants the bug the scope bridge guards against: closing a scope no
    /// longer makes offload's compute stream wait for candle's kernels, so a
    /// slot may be refilled while they still read it (tests only).
    #[cfg(feature = "planted-bugs")]
    pub fn plant_skip_exit(&self) {
        self.skip_exit
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Distinct views wrapped so far (bounded by the slots' layouts).
    pub fn cached(&self) -> usize {
        self.cache.lock().map_or(0, |c| c.len())
    }

    fn wrap(
        &self,
        ptr: u64,
        bytes: u64,
        dtype: candle_core::DType,
        shape: &[usize],
    ) -> Result<Tensor> {
        use candle_core::DType as D;
        let stream = self.device.cuda_stream();
        let n = shape.iter().product::<usize>();
        if n as u64 * dtype.size_in_bytes() as u64 != bytes {
            return Err(candle_core::Error::Msg(format!(
                "a {bytes}-byte view is not {shape:?} of {dtype:?}"
            )));
        }
        macro_rules! slice {
            ($t:ty) => {{
                // SAFETY: `ptr..ptr + bytes` is a lent view inside a live
                // device allocation of offload's; the slice is never dropped
                // (the cache holds it, and is forgotten), so candle never
                // frees it.
                let s = unsafe { stream.upgrade_device_ptr::<$t>(ptr, n) };
                CudaStorage::wrap_cuda_slice(s, self.device.clone())
            }};
        }
        let storage = match dtype {
            D::BF16 => slice!(half::bf16),
            D::F16 => slice!(half::f16),
            D::F32 => slice!(f32),
            D::F64 => slice!(f64),
            D::I64 => slice!(i64),
            D::U8 => slice!(u8),
            other => {
                return Err(candle_core::Error::Msg(format!(
                    "ZeroCopy does not wrap {other:?}"
                )));
            }
        };
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            shape,
            BackpropOp::none(),
            false,
        ))
    }
}

impl ViewTensors<Cuda> for ZeroCopy {
    fn tensor(&self, _scope: &Scope<'_, Cuda>, view: &View<'_, Cuda>) -> Result<Tensor> {
        crate::require_contiguous(view)?;
        let range = view.byte_range();
        let dtype = candle_dtype(view.tensor().dtype)?;
        let shape: Vec<usize> = view.tensor().shape.iter().map(|&d| d as usize).collect();
        let ptr = view.buffer().ptr() + range.start;
        let key = (ptr, range.end - range.start, dtype, shape);
        let mut cache = self
            .cache
            .lock()
            .map_err(|_| candle_core::Error::Msg("ZeroCopy cache poisoned".into()))?;
        if let Some(t) = cache.get(&key) {
            return Ok(t.clone());
        }
        let t = self.wrap(key.0, key.1, dtype, &key.3)?;
        cache.insert(key, t.clone());
        Ok(t)
    }

    fn enter(&self, scope: &Scope<'_, Cuda>) -> Result<()> {
        let _bridge = self
            .bridge
            .lock()
            .map_err(|_| candle_core::Error::Msg("ZeroCopy bridge poisoned".into()))?;
        self.enter
            .order(scope.stream().raw(), self.device.cuda_stream().cu_stream())
    }

    fn exit(&self, scope: &Scope<'_, Cuda>) -> Result<()> {
        #[cfg(feature = "planted-bugs")]
        if self.skip_exit.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        let ordered = match self.bridge.lock() {
            Ok(_bridge) => self
                .exit
                .order(self.device.cuda_stream().cu_stream(), scope.stream().raw()),
            Err(_) => Err(candle_core::Error::Msg("ZeroCopy bridge poisoned".into())),
        };
        if let Err(e) = ordered {
            // Nothing orders the slot's reuse after candle's kernels: wait
            // for them here instead (the host blocks; the slot is safe).
            return Err(match self.device.cuda_stream().synchronize() {
                Ok(()) => e,
                Err(d) => err(
                    "exit: ordering failed, then draining candle's stream failed",
                    (e, d),
                ),
            });
        }
        Ok(())
    }
}

impl Drop for ZeroCopy {
    fn drop(&mut self) {
        // The wrapped slices must never be freed by candle: forget them.
        let cache = std::mem::take(self.cache.get_mut().unwrap_or_else(|p| p.into_inner()));
        std::mem::forget(cache);
    }
}
