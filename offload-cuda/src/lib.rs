//! `offload-cuda`: the device traits of `offload-core` on NVIDIA GPUs,
//! through cudarc's driver API with dynamic loading (CUDA 13.0 bindings).
//!
//! The crate builds, and its tests pass, on a machine with no CUDA toolkit
//! or GPU: [`driver_present`] checks for the driver library before anything
//! calls it (cudarc panics on a missing library).
//!
//! Thin by design: every method translates one call and names it in its
//! error. Ordering lives in core's safe types (slots and staging buffers
//! own their ready and last-use events); cudarc's own buffer event tracking
//! is not used (it records only the last reader of a buffer).
//!
//! # Ownership
//!
//! One [`CudaContext`] per [`CudaDevice`]: the device's primary context,
//! retained once and released when the last holder goes, and the internal
//! stream that orders allocations and frees. Every stream, event, device
//! buffer, pinned buffer and registration holds it, so any of them may
//! outlive the device handle. Freed explicitly ([`Device::free_device`],
//! [`Device::free_pinned`], [`Device::unregister_host`]), memory is given
//! back in stream order as the caller promised; dropped instead (a `?` or a
//! panic past it), a buffer first drains the whole context
//! (`cuCtxSynchronize`, which orders it after every event of every stream)
//! and then frees, and if draining fails it is leaked with a logged error:
//! memory the device may still touch is never freed.

pub mod decode;
mod perturb;
pub mod proxy;
mod timeline;

pub use perturb::Perturbation;
pub use timeline::{SpanId, TimelineSpan};

use std::ffi::{CStr, c_void};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::result;
use cudarc::driver::sys;
use offload_core::device::{
    Api, ByteSource, Device, DeviceBuffer, DeviceError, DeviceErrorKind, HostBuffer, HostRegion,
    HostSource, MemoryInfo, RegisterError, Registration,
};

use perturb::{Perturber, PtxKernel};

/// Whether a CUDA driver with at least one device can be used here.
pub fn driver_present() -> bool {
    // SAFETY: only probes for the shared library; loads nothing else.
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    result::init().is_ok() && result::device::get_count().is_ok_and(|n| n > 0)
}

/// The CUDA [`Api`].
#[derive(Debug)]
pub struct Cuda;

impl Api for Cuda {
    type Device = CudaDevice;
    type Stream = CudaStream;
    type Event = CudaEvent;
    type DeviceBuffer = CudaBuffer;
    type HostBuffer = PinnedBuffer;
    type Registration = CudaRegistration;
    type Error = CudaError;
}

/// A driver error, naming the operation.
#[derive(Debug, thiserror::Error)]
#[error("{operation}{}", self.code_suffix())]
pub struct CudaError {
    /// The operation (with its sizes).
    pub operation: String,
    /// The driver's code.
    pub code: sys::CUresult,
    /// The kind, where it is not the driver code's: set by
    /// [`CudaError::transfer_failed`] only.
    kind: Option<DeviceErrorKind>,
    /// For an allocation out of memory: the bytes it lacked (the request
    /// less the free memory `cuMemGetInfo` reported after the failure).
    shortfall: Option<u64>,
}

impl CudaError {
    /// A driver error: `operation` failed with `code`.
    pub fn new(operation: impl Into<String>, code: sys::CUresult) -> Self {
        Self {
            operation: operation.into(),
            code,
            kind: None,
            shortfall: None,
        }
    }

    /// A failed transfer or collective that the driver reported no code
    /// for (a collective library's own error, such as NCCL's): kind
    /// [`DeviceErrorKind::TransferFailed`], `code` `CUDA_ERROR_UNKNOWN`,
    /// displayed as `operation` alone (which names the library's error).
    pub fn transfer_failed(operation: impl Into<String>) -> Self {
        Self {
            operation: operation.into(),
            code: sys::cudaError_enum::CUDA_ERROR_UNKNOWN,
            kind: Some(DeviceErrorKind::TransferFailed),
            shortfall: None,
        }
    }

    fn code_suffix(&self) -> String {
        match self.kind {
            Some(_) => String::new(),
            None => format!(": {:?}", self.code),
        }
    }
}

impl DeviceError for CudaError {
    fn shortfall_bytes(&self) -> Option<u64> {
        self.shortfall
    }

    fn kind(&self) -> DeviceErrorKind {
        use sys::cudaError_enum as E;
        if let Some(kind) = self.kind {
            return kind;
        }
        match self.code {
            E::CUDA_ERROR_OUT_OF_MEMORY => DeviceErrorKind::OutOfMemory,
            E::CUDA_ERROR_ILLEGAL_ADDRESS
            | E::CUDA_ERROR_LAUNCH_FAILED
            | E::CUDA_ERROR_ECC_UNCORRECTABLE
            | E::CUDA_ERROR_HARDWARE_STACK_ERROR
            | E::CUDA_ERROR_DEVICE_UNAVAILABLE
            | E::CUDA_ERROR_DEINITIALIZED
            | E::CUDA_ERROR_CONTEXT_IS_DESTROYED => DeviceErrorKind::DeviceLost,
            _ => DeviceErrorKind::Other,
        }
    }
}

fn check(code: sys::CUresult, operation: impl FnOnce() -> String) -> Result<(), CudaError> {
    if code == sys::cudaError_enum::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::new(operation(), code))
    }
}

fn wrap<T>(
    r: Result<T, result::DriverError>,
    operation: impl FnOnce() -> String,
) -> Result<T, CudaError> {
    r.map_err(|e| CudaError::new(operation(), e.0))
}

/// An error the caller could have foreseen (a range out of bounds, an
/// object of another device), reported with the driver's code for it.
fn invalid(code: sys::CUresult, operation: String) -> CudaError {
    CudaError::new(operation, code)
}

/// Whether `offset..offset + bytes` lies within `len` bytes.
fn in_bounds(offset: u64, bytes: u64, len: u64) -> bool {
    offset.checked_add(bytes).is_some_and(|end| end <= len)
}

/// One device's primary context (retained once, released when the last
/// holder drops it) and the internal stream that orders allocations and
/// frees. Shared through an `Arc` by the device and everything made from
/// it.
pub struct CudaContext {
    ordinal: i32,
    dev: sys::CUdevice,
    raw: sys::CUcontext,
    memory: sys::CUstream,
    spin: OnceLock<PtxKernel>,
    /// The in-place pageable read (`pageable.ptx`), loaded on first use.
    pageable: OnceLock<PtxKernel>,
}

// SAFETY: the context and stream are driver handles usable from any thread
// once the context is made current there (every method binds it first).
unsafe impl Send for CudaContext {}
// SAFETY: as above; the driver synchronises concurrent use of its handles.
unsafe impl Sync for CudaContext {}

impl fmt::Debug for CudaContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaContext(#{})", self.ordinal)
    }
}

impl CudaContext {
    /// Retains device `ordinal`'s primary context and makes its memory
    /// stream. The driver must be initialised.
    fn retain(ordinal: i32) -> Result<Self, CudaError> {
        let dev = wrap(result::device::get(ordinal), || {
            format!("cuDeviceGet({ordinal})")
        })?;
        // SAFETY: `dev` came from cuDeviceGet; the retain is released in
        // Drop, which runs from here on whatever fails below.
        let raw = wrap(unsafe { result::primary_ctx::retain(dev) }, || {
            format!("cuDevicePrimaryCtxRetain({ordinal})")
        })?;
        let mut ctx = Self {
            ordinal,
            dev,
            raw,
            memory: std::ptr::null_mut(),
            spin: OnceLock::new(),
            pageable: OnceLock::new(),
        };
        ctx.bind()?;
        ctx.memory = wrap(
            result::stream::create(result::stream::StreamKind::NonBlocking),
            || "cuStreamCreate(memory)".to_owned(),
        )?;
        Ok(ctx)
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Makes the context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context is retained for as long as `self` lives.
        wrap(unsafe { result::ctx::set_current(self.raw) }, || {
            format!("cuCtxSetCurrent(device {})", self.ordinal)
        })
    }

    /// Blocks the host until every stream of the context has drained (all
    /// work enqueued so far, in any stream, has completed).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        wrap(result::ctx::synchronize(), || {
            format!("cuCtxSynchronize(device {})", self.ordinal)
        })
    }

    /// `name` of `ptx`, loaded into this context on first use and kept in
    /// `cell`.
    fn kernel<'a>(
        &self,
        cell: &'a OnceLock<PtxKernel>,
        ptx: &CStr,
        name: &CStr,
    ) -> Result<&'a PtxKernel, CudaError> {
        if let Some(k) = cell.get() {
            return Ok(k);
        }
        self.bind()?;
        // SAFETY: the context is current (bound just above).
        let loaded = wrap(unsafe { PtxKernel::load(ptx, name) }, || {
            format!("cuModuleLoadData({})", name.to_string_lossy())
        })?;
        let (module, function) = (loaded.module, loaded.function);
        let kept = cell.get_or_init(|| PtxKernel { module, function });
        if kept.module != module {
            // Another thread loaded it first: ours is used by nothing.
            // SAFETY: loaded above into the current context, never launched.
            let _ = unsafe { result::module::unload(module) };
        }
        Ok(kept)
    }

    /// Enqueues the spin kernel for `ns` nanoseconds on `stream`.
    fn spin(&self, stream: sys::CUstream, ns: u64) -> Result<(), CudaError> {
        let kernel = self.kernel(&self.spin, perturb::SPIN_PTX, c"spin")?;
        self.bind()?;
        // SAFETY: the context is current, `stream` is one of its live
        // streams (callers pass their own), and the module stays loaded
        // until this context is dropped, after synchronising.
        wrap(unsafe { kernel.launch_spin(stream, ns) }, || {
            format!("cuLaunchKernel(spin, {ns} ns)")
        })
    }
}

impl Drop for CudaContext {
    /// Runs when the device and everything made from it are gone: drains
    /// the context, unloads the spin kernel, destroys the memory stream and
    /// releases the primary context.
    fn drop(&mut self) {
        if let Err(e) = self.synchronize() {
            tracing::error!("releasing CUDA device {}: {e}", self.ordinal);
        }
        // SAFETY: the context is current (or the calls fail harmlessly);
        // the module's launches and the stream's work have drained; the
        // primary context was retained once, in `retain`.
        unsafe {
            for k in [self.spin.get(), self.pageable.get()].into_iter().flatten() {
                let _ = result::module::unload(k.module);
            }
            if !self.memory.is_null() {
                let _ = result::stream::destroy(self.memory);
            }
            let _ = result::primary_ctx::release(self.dev);
        }
    }
}

/// A non-blocking stream, destroyed on drop (work already enqueued still
/// completes).
pub struct CudaStream {
    raw: sys::CUstream,
    _ctx: Arc<CudaContext>,
}

// SAFETY: a CUstream is a handle the driver lets any thread use.
unsafe impl Send for CudaStream {}
// SAFETY: as above; the driver synchronises concurrent use of a stream.
unsafe impl Sync for CudaStream {}

impl fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaStream({:p})", self.raw)
    }
}

impl CudaStream {
    /// The raw handle, for launching kernels and cuBLAS.
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// The context the stream belongs to.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self._ctx
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        // SAFETY: the handle is ours and its context is alive (we hold it);
        // destruction is deferred by the driver until enqueued work
        // completes.
        let _ = unsafe { result::stream::destroy(self.raw) };
    }
}

/// An event, destroyed on drop: without timing, except the timeline's own.
pub struct CudaEvent {
    raw: sys::CUevent,
    _ctx: Arc<CudaContext>,
}

// SAFETY: a CUevent is a handle the driver lets any thread use.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaEvent({:p})", self.raw)
    }
}

impl CudaEvent {
    /// A new event of `ctx`, made with `flags`.
    fn create(ctx: &Arc<CudaContext>, flags: sys::CUevent_flags) -> Result<Self, CudaError> {
        ctx.bind()?;
        let raw = wrap(result::event::create(flags), || "cuEventCreate".to_owned())?;
        Ok(Self {
            raw,
            _ctx: Arc::clone(ctx),
        })
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: the handle is ours and its context is alive (we hold it);
        // the driver defers destruction of a recorded event until it
        // completes.
        let _ = unsafe { result::event::destroy(self.raw) };
    }
}

/// Device memory of an exact size, from the stream-ordered pool.
///
/// Dropped without [`Device::free_device`], it drains its context and then
/// frees (or leaks, with a logged error, if draining fails).
pub struct CudaBuffer {
    ctx: Arc<CudaContext>,
    /// 0 once freed (and for an empty buffer): Drop then does nothing.
    ptr: sys::CUdeviceptr,
    len: u64,
}

impl fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl CudaBuffer {
    /// The device address.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The context the buffer was allocated in.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl DeviceBuffer for CudaBuffer {
    fn len_bytes(&self) -> u64 {
        self.len
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        let (ptr, len) = (self.ptr, self.len);
        if let Err(e) = self.ctx.synchronize() {
            tracing::error!(
                "dropping a {len}-byte device buffer: {e}; leaking it (the device may still use it)"
            );
            return;
        }
        // SAFETY: every stream of the context has drained, so no work uses
        // the buffer; it came from cuMemAllocAsync and was not freed (the
        // explicit free zeroes `ptr`).
        let freed = unsafe { result::free_async(ptr, self.ctx.memory) }
            // SAFETY: the memory stream is the context's own, alive.
            .and_then(|()| unsafe { result::stream::synchronize(self.ctx.memory) });
        if let Err(e) = freed {
            tracing::error!("dropping a {len}-byte device buffer: cuMemFreeAsync: {e:?}");
        }
    }
}

/// Pinned host memory of an exact size (plain: not write-combined, so the
/// CPU reads it at full speed).
///
/// Dropped without [`Device::free_pinned`], it drains its context and then
/// frees (or leaks, with a logged error, if draining fails).
pub struct PinnedBuffer {
    ctx: Arc<CudaContext>,
    /// Null once freed (and for an empty buffer): Drop then does nothing.
    ptr: *mut u8,
    len: u64,
}

// SAFETY: the allocation is owned by this value; access goes through
// `&self`/`&mut self`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only reads.
unsafe impl Sync for PinnedBuffer {}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .finish()
    }
}

impl PinnedBuffer {
    fn slice(&self) -> &[u8] {
        if self.ptr.is_null() {
            return &[];
        }
        // SAFETY: `ptr` points to `len` bytes we own for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len as usize) }
    }

    fn slice_mut(&mut self) -> &mut [u8] {
        if self.ptr.is_null() {
            return &mut [];
        }
        // SAFETY: as above, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len as usize) }
    }
}

impl HostBuffer for PinnedBuffer {
    fn len_bytes(&self) -> u64 {
        self.len
    }

    fn write_from(&mut self, offset: u64, len: u64, src: &dyn ByteSource) {
        let dst = &mut self.slice_mut()[offset as usize..(offset + len) as usize];
        src.read_at(0, dst);
    }

    fn read_into(&self, offset: u64, dst: &mut [u8]) {
        dst.copy_from_slice(&self.slice()[offset as usize..offset as usize + dst.len()]);
    }
}

/// Page-locked host bytes this process holds through offload-cuda, as the
/// driver calls succeed: `cuMemHostAlloc` buffers, and `cuMemHostRegister`
/// ranges (a shared mapping counted once, whole, as the driver locks it).
/// The device's own observation of host memory, for INV-7's host bound and
/// `host_budget` (CONTRACT §7c), never a strategy's report.
static LOCKED: LockedCounter = LockedCounter {
    pinned: std::sync::atomic::AtomicU64::new(0),
    registered: std::sync::atomic::AtomicU64::new(0),
    peak: std::sync::atomic::AtomicU64::new(0),
};

struct LockedCounter {
    pinned: std::sync::atomic::AtomicU64,
    registered: std::sync::atomic::AtomicU64,
    /// Peak of pinned + registered since the last [`reset_host_locked_peak`].
    peak: std::sync::atomic::AtomicU64,
}

impl LockedCounter {
    fn add(&self, which: &std::sync::atomic::AtomicU64, bytes: usize) {
        use std::sync::atomic::Ordering::SeqCst;
        // The sum from this add's own result and the other counter: a
        // concurrent free can only lower the true peak seen here.
        let mine = which.fetch_add(bytes as u64, SeqCst) + bytes as u64;
        let other = if std::ptr::eq(which, &self.pinned) {
            self.registered.load(SeqCst)
        } else {
            self.pinned.load(SeqCst)
        };
        self.peak.fetch_max(mine + other, SeqCst);
    }

    fn sub(&self, which: &std::sync::atomic::AtomicU64, bytes: usize) {
        use std::sync::atomic::Ordering::SeqCst;
        let _ = which.fetch_update(SeqCst, SeqCst, |v| Some(v.saturating_sub(bytes as u64)));
    }
}

/// Page-locked host memory held through offload-cuda now and at its peak.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostLocked {
    /// `cuMemHostAlloc` bytes held now.
    pub pinned_bytes: u64,
    /// `cuMemHostRegister` bytes held now.
    pub registered_bytes: u64,
    /// Peak of the two together since [`reset_host_locked_peak`].
    pub peak_bytes: u64,
}

/// The process's page-locked host memory held through offload-cuda.
pub fn host_locked() -> HostLocked {
    use std::sync::atomic::Ordering::SeqCst;
    HostLocked {
        pinned_bytes: LOCKED.pinned.load(SeqCst),
        registered_bytes: LOCKED.registered.load(SeqCst),
        peak_bytes: LOCKED.peak.load(SeqCst),
    }
}

/// Restarts [`HostLocked::peak_bytes`] from what is held now.
pub fn reset_host_locked_peak() {
    use std::sync::atomic::Ordering::SeqCst;
    LOCKED.peak.store(
        LOCKED.pinned.load(SeqCst) + LOCKED.registered.load(SeqCst),
        SeqCst,
    );
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        let len = self.len;
        if let Err(e) = self.ctx.synchronize() {
            tracing::error!(
                "dropping a {len}-byte pinned buffer: {e}; leaking it (a copy may still use it)"
            );
            return;
        }
        // SAFETY: every stream has drained, so no copy uses it; it came
        // from cuMemHostAlloc and was not freed (the explicit free nulls
        // `ptr`).
        match unsafe { result::free_host(self.ptr.cast()) } {
            Ok(()) => LOCKED.sub(&LOCKED.pinned, len as usize),
            Err(e) => {
                tracing::error!("dropping a {len}-byte pinned buffer: cuMemFreeHost: {e:?}")
            }
        }
    }
}

/// Caller memory registered in place with `cuMemHostRegister`; unregistered
/// by [`Device::unregister_host`], which gives the memory back.
///
/// The address and length are captured once, at registration: copies and
/// the unregistration use them, never the region again. Dropped without
/// `unregister_host`, it drains its context, unregisters and drops the
/// memory (or leaks the memory, with a logged error, if either fails).
pub struct CudaRegistration {
    ctx: Arc<CudaContext>,
    ptr: *const u8,
    len: usize,
    /// `None` once given back by `unregister_host`.
    region: Option<Box<dyn HostRegion>>,
    /// The enclosing mapping this window's registration belongs to (see
    /// [`HostRegion::enclosing`]), counted in the device's table; `None`
    /// for memory registered alone.
    shared: Option<(Arc<SharedRegistrations>, usize)>,
}

impl CudaRegistration {
    /// Ends this registration: unregisters the memory, or, for a window of
    /// a shared mapping, drops its count and unregisters the mapping with
    /// the last window.
    fn end(&self) -> Result<(), CudaError> {
        match &self.shared {
            Some((table, base)) => table.release(*base),
            None => {
                // SAFETY: registered in `register_host` at this captured
                // address; callers guarantee no copy reads it now.
                let code = unsafe { sys::cuMemHostUnregister(self.ptr as *mut c_void) };
                check(code, || format!("cuMemHostUnregister({} bytes)", self.len))?;
                LOCKED.sub(&LOCKED.registered, self.len);
                Ok(())
            }
        }
    }
}

/// Mappings registered once for all their windows (a mapped checkpoint
/// file): base address → (length, windows registered). The mapping is
/// unregistered when its last window is; the windows keep it mapped
/// (CONTRACT of [`HostRegion::enclosing`]), so its address cannot be reused
/// while it is in the table.
#[derive(Debug, Default)]
struct SharedRegistrations(Mutex<std::collections::HashMap<usize, (usize, usize)>>);

impl SharedRegistrations {
    fn table(&self) -> MutexGuard<'_, std::collections::HashMap<usize, (usize, usize)>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one more window of `mapping`, registering it with the first.
    fn acquire(&self, mapping: &[u8], read_only: bool) -> Result<usize, CudaError> {
        let (base, len) = (mapping.as_ptr() as usize, mapping.len());
        let mut table = self.table();
        if let Some((known, count)) = table.get_mut(&base) {
            if *known != len {
                return Err(invalid(
                    sys::cudaError_enum::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                    format!("a mapping at {base:#x} is registered with {known} bytes, not {len}"),
                ));
            }
            *count += 1;
            return Ok(base);
        }
        let flags = if read_only {
            sys::CU_MEMHOSTREGISTER_READ_ONLY
        } else {
            0
        };
        // SAFETY: `mapping` stays mapped and unmoved while any window of it
        // lives (HostRegion::enclosing's contract); the table unregisters it
        // when the last window's registration ends.
        let code = unsafe { sys::cuMemHostRegister_v2(base as *mut c_void, len, flags) };
        check(code, || {
            format!("cuMemHostRegister({len} bytes, flags {flags:#x}) of a shared mapping")
        })?;
        tracing::debug!(bytes = len, read_only, "registered a shared mapping");
        LOCKED.add(&LOCKED.registered, len);
        table.insert(base, (len, 1));
        Ok(base)
    }

    /// One window of the mapping at `base` is done; the last unregisters it.
    fn release(&self, base: usize) -> Result<(), CudaError> {
        let mut table = self.table();
        let Some((len, count)) = table.get_mut(&base) else {
            return Err(invalid(
                sys::cudaError_enum::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
                format!("no shared mapping at {base:#x}"),
            ));
        };
        *count -= 1;
        if *count > 0 {
            return Ok(());
        }
        let len = *len;
        table.remove(&base);
        // SAFETY: registered by `acquire` at this address; its last window
        // is ending and callers guarantee no copy reads it now.
        let code = unsafe { sys::cuMemHostUnregister(base as *mut c_void) };
        check(code, || {
            format!("cuMemHostUnregister({len} bytes) of a shared mapping")
        })?;
        LOCKED.sub(&LOCKED.registered, len);
        Ok(())
    }
}

// SAFETY: the region is `Send`; `ptr` is its address, read only by the
// driver while the region is owned here.
unsafe impl Send for CudaRegistration {}
// SAFETY: the region is `Sync`; shared access only reads `ptr` and `len`.
unsafe impl Sync for CudaRegistration {}

impl fmt::Debug for CudaRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaRegistration")
            .field("len", &self.len)
            .finish()
    }
}

impl Registration for CudaRegistration {
    fn len_bytes(&self) -> u64 {
        self.len as u64
    }
}

impl Drop for CudaRegistration {
    fn drop(&mut self) {
        let Some(region) = self.region.take() else {
            return;
        };
        if self.len == 0 {
            return;
        }
        let len = self.len;
        if let Err(e) = self.ctx.synchronize() {
            tracing::error!(
                "dropping a {len}-byte registration: {e}; leaking the memory (a copy may still read it)"
            );
            std::mem::forget(region);
            return;
        }
        // Every stream has drained, so no copy reads it.
        if let Err(e) = self.end() {
            tracing::error!("dropping a {len}-byte registration: {e}; leaking the memory");
            std::mem::forget(region);
        }
    }
}

/// One GPU: its shared [`CudaContext`], an optional timing perturbation
/// (see [`Perturbation`]) and a timeline recorder (see
/// [`CudaDevice::timeline_start`]).
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    name: String,
    perturbation: Mutex<Option<Perturber>>,
    timeline: timeline::Recorder,
    shared: Arc<SharedRegistrations>,
    /// The chunk the stream-ordered pool maps device memory in (measured
    /// at creation; [`ASSUMED_POOL_CHUNK`] where it could not be).
    pool_chunk: u64,
    /// The device loads pageable host memory itself
    /// (`CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS`: HMM or ATS), read at
    /// creation: [`Device::reads_pageable`].
    pageable_access: bool,
}

/// `pageable.ptx`, NUL-terminated for `cuModuleLoadData`.
const PAGEABLE_PTX: &CStr =
    match CStr::from_bytes_with_nul(concat!(include_str!("pageable.ptx"), "\0").as_bytes()) {
        Ok(ptx) => ptx,
        Err(_) => panic!("pageable.ptx contains a NUL byte"),
    };

/// Launches `read_pageable(src, dst, n)` on `stream`.
///
/// # Safety
///
/// The kernel's context is current and `stream` one of its live streams;
/// `src..src + n` is memory the device can load (pinned, or pageable on a
/// device that reads it) and `dst..dst + n` device memory, both kept, the
/// source unchanged and the destination untouched, until an event
/// recorded after the launch completes; the module stays loaded until
/// then (its context drops only after draining).
unsafe fn launch_read(
    kernel: &PtxKernel,
    stream: sys::CUstream,
    src: u64,
    dst: u64,
    n: u64,
) -> Result<(), CudaError> {
    let (mut src, mut dst, mut n) = (src, dst, n);
    let mut params: [*mut c_void; 3] = [
        (&raw mut src).cast(),
        (&raw mut dst).cast(),
        (&raw mut n).cast(),
    ];
    // SAFETY: `read_pageable(u64 src, u64 dst, u64 n)` takes three u64s,
    // which `params` points to (copied at launch); the kernel reads no
    // aligned word outside the source's and writes only `dst..dst + n`
    // (pageable.ptx, bench/pageable_kernel_model.py); the rest is the
    // caller's.
    let launched = unsafe {
        result::launch_kernel(
            kernel.function,
            (PAGEABLE_READ_BLOCKS, 1, 1),
            (1024, 1, 1),
            0,
            stream,
            &mut params,
        )
    };
    wrap(launched, || {
        format!("cuLaunchKernel(read_pageable, {n} bytes)")
    })
}

/// Thread blocks of 1,024 threads an in-place pageable read launches
/// ([`HostSource::Pageable`]): enough loads in flight to cover the link's
/// latency, on a few of the device's multiprocessors (two blocks each), so
/// that compute beside it keeps the rest.
pub const PAGEABLE_READ_BLOCKS: u32 = 32;

/// The pool chunk counted where it cannot be measured: what the default
/// pool of an H100 with driver 580 maps (`bench/pool_probe.py`).
const ASSUMED_POOL_CHUNK: u64 = 32 << 20;

/// The chunk a stream-ordered pool maps device memory in: what a pool of
/// our own, empty, reserves for a one-byte allocation (32 MiB on an H100
/// with driver 580, where every reservation of the default pool is a
/// multiple of it and allocations are packed into its chunks:
/// `bench/pool_probe.py`, BENCHMARKS.md).
fn measure_pool_chunk(ctx: &CudaContext) -> Result<u64, CudaError> {
    ctx.bind()?;
    // SAFETY: a zeroed `CUmemPoolProps` is every field's default (no
    // handle type, no size limit, reserved bytes zero); the allocation type
    // and location are set below.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = ctx.ordinal;
    // SAFETY: `props` is a valid, initialised `CUmemPoolProps`.
    let pool = wrap(
        unsafe { result::mem_pool::create(&raw const props) },
        || "cuMemPoolCreate".to_owned(),
    )?;
    let measured = (|| {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `pool` is live; the allocation is ordered on the
        // context's memory stream and freed on it below.
        let allocated = unsafe { sys::cuMemAllocFromPoolAsync(&raw mut ptr, 1, pool, ctx.memory) };
        wrap(allocated.result(), || {
            "cuMemAllocFromPoolAsync(1 byte)".to_owned()
        })?;
        let mut reserved: u64 = 0;
        // SAFETY: the stream is the context's own; `reserved` is a u64, the
        // attribute's type; the pointer came from this pool and is freed
        // once.
        let read = unsafe {
            let read = wrap(result::stream::synchronize(ctx.memory), || {
                "cuStreamSynchronize(memory)".to_owned()
            });
            let read = read.and_then(|()| {
                wrap(
                    result::mem_pool::get_attribute(
                        pool,
                        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                        (&raw mut reserved).cast(),
                    ),
                    || "cuMemPoolGetAttribute(RESERVED_MEM_CURRENT)".to_owned(),
                )
            });
            // Freed whatever the read did.
            let freed = wrap(result::free_async(ptr, ctx.memory), || {
                "cuMemFreeAsync".to_owned()
            })
            .and_then(|()| {
                wrap(result::stream::synchronize(ctx.memory), || {
                    "cuStreamSynchronize(memory)".to_owned()
                })
            });
            read.and(freed)
        };
        read.map(|()| reserved.max(1))
    })();
    // SAFETY: nothing of the pool is allocated any more (freed above, the
    // stream synchronised) or the allocation failed.
    let destroyed = wrap(unsafe { result::mem_pool::destroy(pool) }, || {
        "cuMemPoolDestroy".to_owned()
    });
    let chunk = measured?;
    destroyed?;
    Ok(chunk)
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaDevice({} #{})", self.name, self.ctx.ordinal)
    }
}

impl CudaDevice {
    /// Device `ordinal`'s primary context. Fails (never panics) where no
    /// driver or device is found.
    pub fn new(ordinal: i32) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError::new(
                "loading the CUDA driver",
                sys::cudaError_enum::CUDA_ERROR_NO_DEVICE,
            ));
        }
        let ctx = Arc::new(CudaContext::retain(ordinal)?);
        let name = wrap(result::device::get_name(ctx.dev), || {
            "cuDeviceGetName".to_owned()
        })?;
        let pool_chunk = match measure_pool_chunk(&ctx) {
            Ok(chunk) => chunk,
            Err(e) => {
                tracing::warn!(
                    "offload-cuda: the stream-ordered pool's chunk could not be measured ({e}); budgets count {ASSUMED_POOL_CHUNK} B of its rounding (what an H100 with driver 580 maps)"
                );
                ASSUMED_POOL_CHUNK
            }
        };
        // SAFETY: `ctx.dev` came from cuDeviceGet.
        let pageable_access = unsafe {
            result::device::get_attribute(
                ctx.dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS,
            )
        }
        .is_ok_and(|v| v == 1);
        Ok(Self {
            ctx,
            name,
            perturbation: Mutex::new(None),
            timeline: timeline::Recorder::default(),
            shared: Arc::default(),
            pool_chunk,
            pageable_access,
        })
    }

    /// The in-place read kernel that [`HostSource::Pageable`] launches
    /// (`pageable.ptx`), over pinned memory, which every CUDA GPU loads
    /// through unified addressing: `bytes` from `src_offset` of `src` to
    /// `dst_offset` of `dst` on `stream`. What checks the kernel on a GPU
    /// without pageable memory access (the GPU suite).
    ///
    /// # Safety
    ///
    /// As [`Device::copy_h2d`]: neither side freed, the source unchanged
    /// and the destination untouched, until an event recorded after this
    /// read completes.
    pub unsafe fn read_pinned_by_kernel(
        &self,
        stream: &CudaStream,
        src: &PinnedBuffer,
        src_offset: u64,
        dst: &CudaBuffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), CudaError> {
        if !in_bounds(src_offset, bytes, src.len) || !in_bounds(dst_offset, bytes, dst.len) {
            return Err(invalid(
                sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
                format!(
                    "read_pageable: {bytes} bytes from {src_offset} of a {}-byte pinned source to {dst_offset} of a {}-byte buffer",
                    src.len, dst.len
                ),
            ));
        }
        if bytes == 0 {
            return Ok(());
        }
        let kernel = self
            .ctx
            .kernel(&self.ctx.pageable, PAGEABLE_PTX, c"read_pageable")?;
        self.bind()?;
        // SAFETY: in bounds (checked above); pinned memory is loadable by
        // the device at its host address; the rest is the caller's.
        unsafe {
            launch_read(
                kernel,
                stream.raw,
                src.ptr as u64 + src_offset,
                dst.ptr + dst_offset,
                bytes,
            )
        }
    }

    /// The chunk the stream-ordered pool maps device memory in
    /// ([`Device::allocation_chunk`]).
    pub fn pool_chunk(&self) -> u64 {
        self.pool_chunk
    }

    /// Mappings registered now for their windows ([`HostRegion::enclosing`]),
    /// each with the number of windows registered: what a test reads to see
    /// a checkpoint's files registered once and unregistered with their
    /// last window.
    pub fn shared_registrations(&self) -> Vec<(usize, usize)> {
        self.shared.table().values().copied().collect()
    }

    /// The device's name (e.g. `NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind()
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ctx.ordinal
    }

    /// The shared context (held by everything made from this device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Blocks the host until every stream of the device has drained.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.ctx.synchronize()
    }

    fn pool(&self) -> Result<sys::CUmemoryPool, CudaError> {
        self.bind()?;
        // SAFETY: `dev` is valid; the default pool lives as long as the context.
        wrap(
            unsafe { result::device::get_default_mem_pool(self.ctx.dev) },
            || "cuDeviceGetDefaultMemPool".to_owned(),
        )
    }

    /// Returns the pool's unused memory to the driver (after frees have
    /// completed), so `cuMemGetInfo` deltas measure what is in use.
    pub fn trim_pool(&self) -> Result<(), CudaError> {
        let pool = self.pool()?;
        // SAFETY: the memory stream is the context's own; the pool handle
        // is live.
        unsafe {
            wrap(result::stream::synchronize(self.ctx.memory), || {
                "cuStreamSynchronize(memory)".to_owned()
            })?;
            wrap(result::mem_pool::trim_to(pool, 0), || {
                "cuMemPoolTrimTo".to_owned()
            })
        }
    }

    fn pool_attribute(&self, attribute: sys::CUmemPool_attribute) -> Result<u64, CudaError> {
        let pool = self.pool()?;
        let mut value = 0u64;
        // SAFETY: every attribute read here is a u64 (cuuint64_t), written
        // in place.
        let read =
            unsafe { result::mem_pool::get_attribute(pool, attribute, (&raw mut value).cast()) };
        wrap(read, || format!("cuMemPoolGetAttribute({attribute:?})"))?;
        Ok(value)
    }

    /// The allocator's own counters: bytes in use now, and the high-water
    /// mark since [`Self::reset_pool_high`].
    pub fn pool_used(&self) -> Result<(u64, u64), CudaError> {
        use sys::CUmemPool_attribute::{
            CU_MEMPOOL_ATTR_USED_MEM_CURRENT, CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        };
        Ok((
            self.pool_attribute(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            self.pool_attribute(CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        ))
    }

    /// Device memory the pool holds from the driver (in use or cached):
    /// now, and the high-water mark since [`Self::reset_pool_high`].
    pub fn pool_reserved(&self) -> Result<(u64, u64), CudaError> {
        use sys::CUmemPool_attribute::{
            CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        };
        Ok((
            self.pool_attribute(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            self.pool_attribute(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        ))
    }

    /// Resets the high-water marks of [`Self::pool_used`] and
    /// [`Self::pool_reserved`] to the current values.
    pub fn reset_pool_high(&self) -> Result<(), CudaError> {
        use sys::CUmemPool_attribute::{
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        };
        let pool = self.pool()?;
        for attribute in [
            CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        ] {
            let mut zero = 0u64;
            // SAFETY: the attribute is a u64; setting it to 0 resets the mark.
            let set =
                unsafe { result::mem_pool::set_attribute(pool, attribute, (&raw mut zero).cast()) };
            wrap(set, || format!("cuMemPoolSetAttribute({attribute:?})"))?;
        }
        Ok(())
    }

    /// Sets how much unused memory the pool keeps mapped instead of
    /// returning it to the driver at the next synchronisation (default 0:
    /// give everything back; `u64::MAX`: keep everything until
    /// [`Self::trim_pool`]).
    pub fn set_pool_release_threshold(&self, bytes: u64) -> Result<(), CudaError> {
        let pool = self.pool()?;
        let mut value = bytes;
        // SAFETY: the attribute is a u64 (cuuint64_t), read from `value`.
        let set = unsafe {
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut value).cast(),
            )
        };
        wrap(set, || {
            format!("cuMemPoolSetAttribute(RELEASE_THRESHOLD, {bytes})")
        })
    }

    fn perturber(&self) -> MutexGuard<'_, Option<Perturber>> {
        self.perturbation
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets (or, with `None`, clears) the timing perturbation; its random
    /// choices restart from its seed. Loads the spin kernel now, so that a
    /// missing or failing JIT shows here rather than in the first delayed
    /// operation.
    pub fn set_perturbation(&self, perturbation: Option<Perturbation>) -> Result<(), CudaError> {
        if perturbation.is_some() {
            self.ctx
                .kernel(&self.ctx.spin, perturb::SPIN_PTX, c"spin")?;
        }
        *self.perturber() = perturbation.map(Perturber::new);
        Ok(())
    }

    /// The timing perturbation in force, if any.
    pub fn perturbation(&self) -> Option<Perturbation> {
        self.perturber().as_ref().map(Perturber::config)
    }

    /// A perturbation point: with a perturbation set, maybe (its
    /// probability) enqueue a spin of random length on `stream` and sleep
    /// the host for a random time; without one, nothing. The device calls
    /// it before `copy_h2d`, `copy_d2h`, `stream_wait_event`,
    /// `record_event` and `free_device`'s waits; callers may add their own
    /// (a test delaying a block's kernels).
    pub fn perturb(&self, stream: &CudaStream) -> Result<(), CudaError> {
        self.perturb_raw(stream.raw)
    }

    fn perturb_raw(&self, stream: sys::CUstream) -> Result<(), CudaError> {
        let drawn = self.perturber().as_mut().and_then(Perturber::draw);
        let Some(delay) = drawn else {
            return Ok(());
        };
        if delay.spin_ns > 0 {
            self.ctx.spin(stream, delay.spin_ns)?;
        }
        if delay.host_us > 0 {
            std::thread::sleep(std::time::Duration::from_micros(delay.host_us));
        }
        Ok(())
    }

    /// Enqueues on `stream` a kernel that busy-waits `ns` nanoseconds on
    /// the device's global timer: work enqueued after it on `stream` starts
    /// that much later.
    pub fn spin(&self, stream: &CudaStream, ns: u64) -> Result<(), CudaError> {
        self.ctx.spin(stream.raw, ns)
    }

    /// Fails unless `ctx` is this device's context (objects of another
    /// `CudaDevice` are refused, not mixed).
    fn same_context(&self, ctx: &Arc<CudaContext>, what: &str) -> Result<(), CudaError> {
        if Arc::ptr_eq(ctx, &self.ctx) {
            Ok(())
        } else {
            Err(invalid(
                sys::cudaError_enum::CUDA_ERROR_INVALID_CONTEXT,
                format!("{what}: made by another CudaDevice"),
            ))
        }
    }
}

impl Device<Cuda> for CudaDevice {
    fn alloc_device(&self, bytes: u64) -> Result<CudaBuffer, CudaError> {
        self.bind()?;
        // A zero-sized buffer needs no memory.
        if bytes == 0 {
            return Ok(CudaBuffer {
                ctx: Arc::clone(&self.ctx),
                ptr: 0,
                len: 0,
            });
        }
        let op = || format!("cuMemAllocAsync({bytes} bytes)");
        // SAFETY: the pool allocation is ordered on our memory stream, which
        // is synchronised below before the buffer is handed out, so any
        // stream may use it at once.
        let alloc = || unsafe { result::malloc_async(self.ctx.memory, bytes as usize) };
        let mut allocated = alloc();
        // Out of memory: the pool may hold freed memory it has not given
        // back (chunks of earlier allocations, too small for this one, that
        // the driver's free memory no longer counts). Once the frees
        // already enqueued have run, trim the pool to what is in use and
        // try once more, as a caching allocator empties its cache before
        // reporting an out-of-memory (ARCHITECTURE, "Out of memory").
        // A trim that fails leaves the out-of-memory to report (its
        // shortfall is what a re-plan needs).
        if matches!(&allocated, Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY)
            && self.trim_pool().is_ok()
        {
            allocated = alloc();
        }
        let ptr = wrap(allocated, op).map_err(|mut e| {
            if e.code == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
                let free = result::mem_get_info().map_or(0, |(free, _)| free as u64);
                e.shortfall = Some(bytes.saturating_sub(free).max(1));
            }
            e
        })?;
        // From here on the buffer's Drop frees it if anything fails.
        let buffer = CudaBuffer {
            ctx: Arc::clone(&self.ctx),
            ptr,
            len: bytes,
        };
        // SAFETY: the memory stream is the context's own, alive.
        let synced = unsafe { result::stream::synchronize(self.ctx.memory) };
        wrap(synced, op)?;
        Ok(buffer)
    }

    unsafe fn free_device(
        &self,
        mut buffer: CudaBuffer,
        after: &[&CudaEvent],
    ) -> Result<(), CudaError> {
        if buffer.ptr == 0 {
            return Ok(());
        }
        // On any error below `buffer` is dropped still holding its pointer:
        // its Drop drains the context before freeing, or leaks.
        self.same_context(&buffer.ctx, "free_device")?;
        self.bind()?;
        let memory = self.ctx.memory;
        for e in after {
            self.perturb_raw(memory)?;
            // SAFETY: both handles are live; the wait orders the free after
            // the event on the device.
            let waited = unsafe {
                result::stream::wait_event(
                    memory,
                    e.raw,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            };
            wrap(waited, || {
                "cuStreamWaitEvent(memory, before free)".to_owned()
            })?;
        }
        let (ptr, len) = (std::mem::replace(&mut buffer.ptr, 0), buffer.len);
        // SAFETY: the caller guarantees every use of `buffer` is ordered
        // before one of `after`, which the memory stream now waits for; the
        // pointer came from cuMemAllocAsync and is freed once (zeroed above,
        // so Drop does nothing; if this call fails it is leaked).
        wrap(unsafe { result::free_async(ptr, memory) }, || {
            format!("cuMemFreeAsync({len} bytes)")
        })
    }

    fn alloc_pinned(&self, bytes: u64) -> Result<PinnedBuffer, CudaError> {
        self.bind()?;
        if bytes == 0 {
            return Ok(PinnedBuffer {
                ctx: Arc::clone(&self.ctx),
                ptr: std::ptr::null_mut(),
                len: 0,
            });
        }
        // SAFETY: flags 0: plain page-locked memory, freed by `free_pinned`
        // or the buffer's Drop.
        let ptr = wrap(unsafe { result::malloc_host(bytes as usize, 0) }, || {
            format!("cuMemHostAlloc({bytes} bytes)")
        })?;
        LOCKED.add(&LOCKED.pinned, bytes as usize);
        Ok(PinnedBuffer {
            ctx: Arc::clone(&self.ctx),
            ptr: ptr.cast(),
            len: bytes,
        })
    }

    unsafe fn free_pinned(&self, mut buffer: PinnedBuffer) -> Result<(), CudaError> {
        if buffer.ptr.is_null() {
            return Ok(());
        }
        // On an error here `buffer` drops still holding its pointer (its
        // Drop drains, then frees or leaks).
        buffer.ctx.bind()?;
        let (ptr, len) = (
            std::mem::replace(&mut buffer.ptr, std::ptr::null_mut()),
            buffer.len,
        );
        // SAFETY: the caller guarantees no copy uses it; it came from
        // cuMemHostAlloc and is freed once (nulled above).
        wrap(unsafe { result::free_host(ptr.cast()) }, || {
            format!("cuMemFreeHost({len} bytes)")
        })?;
        LOCKED.sub(&LOCKED.pinned, len as usize);
        Ok(())
    }

    fn register_host(
        &self,
        region: Box<dyn HostRegion>,
    ) -> Result<CudaRegistration, RegisterError<Cuda>> {
        if let Err(error) = self.bind() {
            return Err(RegisterError { error, region });
        }
        // Captured once: the HostRegion contract keeps them valid while
        // the registration owns the region.
        let (ptr, len) = {
            let bytes = region.bytes();
            (bytes.as_ptr(), bytes.len())
        };
        let registration = |region, shared| CudaRegistration {
            ctx: Arc::clone(&self.ctx),
            ptr,
            len,
            region: Some(region),
            shared,
        };
        if len == 0 {
            return Ok(registration(region, None));
        }
        if let Some(mapping) = region.enclosing() {
            let (base, end) = (
                mapping.as_ptr() as usize,
                mapping.as_ptr() as usize + mapping.len(),
            );
            let acquired = if base <= ptr as usize && ptr as usize + len <= end {
                self.shared.acquire(mapping, region.read_only())
            } else {
                Err(invalid(
                    sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
                    format!(
                        "register_host: a {len}-byte window lies outside its enclosing mapping"
                    ),
                ))
            };
            return match acquired {
                Ok(base) => Ok(registration(region, Some((Arc::clone(&self.shared), base)))),
                Err(error) => Err(RegisterError { error, region }),
            };
        }
        let flags = if region.read_only() {
            sys::CU_MEMHOSTREGISTER_READ_ONLY
        } else {
            0
        };
        // SAFETY: `ptr..ptr + len` is the region's memory, which the
        // registration owns and which stays put while it lives (HostRegion
        // is an unsafe trait with that contract); it is unregistered before
        // the region is given back or dropped.
        let code = unsafe { sys::cuMemHostRegister_v2(ptr as *mut c_void, len, flags) };
        match check(code, || format!("cuMemHostRegister({len} bytes)")) {
            Ok(()) => {
                LOCKED.add(&LOCKED.registered, len);
                Ok(registration(region, None))
            }
            Err(error) => Err(RegisterError { error, region }),
        }
    }

    unsafe fn unregister_host(
        &self,
        mut registration: CudaRegistration,
    ) -> Result<Box<dyn HostRegion>, CudaError> {
        // On an error below the registration drops still owning its region
        // (its Drop drains, then unregisters or leaks).
        if registration.len > 0 {
            registration.ctx.bind()?;
            // The caller guarantees no copy reads it now.
            registration.end()?;
        }
        registration.region.take().ok_or_else(|| {
            invalid(
                sys::cudaError_enum::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
                "unregister_host: the memory was already given back".to_owned(),
            )
        })
    }

    fn memory_info(&self) -> Result<MemoryInfo, CudaError> {
        self.bind()?;
        let (free, total) = wrap(result::mem_get_info(), || "cuMemGetInfo".to_owned())?;
        Ok(MemoryInfo {
            free_bytes: free as u64,
            total_bytes: total as u64,
        })
    }

    fn reads_pageable(&self) -> bool {
        self.pageable_access
    }

    fn create_stream(&self) -> Result<CudaStream, CudaError> {
        self.bind()?;
        let raw = wrap(
            result::stream::create(result::stream::StreamKind::NonBlocking),
            || "cuStreamCreate".to_owned(),
        )?;
        Ok(CudaStream {
            raw,
            _ctx: Arc::clone(&self.ctx),
        })
    }

    /// A non-blocking stream at the context's greatest priority
    /// (`cuStreamCreateWithPriority`): the driver starts its pending
    /// blocks ahead of lower-priority streams' as SMs free up.
    fn create_priority_stream(&self) -> Result<CudaStream, CudaError> {
        self.bind()?;
        let (mut least, mut greatest) = (0i32, 0i32);
        // SAFETY: two valid out-pointers; the context is current (bind).
        let range = unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) };
        wrap(range.result(), || "cuCtxGetStreamPriorityRange".to_owned())?;
        let mut raw = std::mem::MaybeUninit::uninit();
        // SAFETY: a valid out-pointer; flags and priority are the driver's
        // own (non-blocking, its greatest); the stream is destroyed by
        // CudaStream's Drop, as `create_stream`'s.
        let created = unsafe {
            sys::cuStreamCreateWithPriority(
                raw.as_mut_ptr(),
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                greatest,
            )
        };
        wrap(created.result(), || {
            format!("cuStreamCreateWithPriority(priority {greatest})")
        })?;
        Ok(CudaStream {
            // SAFETY: written by the successful call above.
            raw: unsafe { raw.assume_init() },
            _ctx: Arc::clone(&self.ctx),
        })
    }

    fn create_event(&self) -> Result<CudaEvent, CudaError> {
        CudaEvent::create(&self.ctx, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    fn create_timing_event(&self) -> Result<CudaEvent, CudaError> {
        CudaEvent::create(&self.ctx, sys::CUevent_flags::CU_EVENT_DEFAULT)
    }

    fn elapsed_ns(&self, from: &CudaEvent, to: &CudaEvent) -> Result<u64, CudaError> {
        self.bind()?;
        // SAFETY: both events are live handles of this context; the caller
        // made them with timing and waited for both (the driver reports
        // an error otherwise, which is returned).
        let ms = wrap(unsafe { result::event::elapsed(from.raw, to.raw) }, || {
            "cuEventElapsedTime".to_owned()
        })?;
        Ok(if ms > 0.0 {
            (f64::from(ms) * 1e6).round() as u64
        } else {
            0
        })
    }

    fn memory_peak(&self) -> Result<Option<u64>, CudaError> {
        self.bind()?;
        Ok(Some(self.pool_used()?.1))
    }

    fn reset_memory_peak(&self) -> Result<(), CudaError> {
        self.bind()?;
        self.reset_pool_high()
    }

    /// Trims the pool once the frees enqueued have run.
    fn release_unused(&self) -> Result<(), CudaError> {
        self.bind()?;
        self.trim_pool()
    }

    /// The pool's reserved high-water mark: it maps device memory in
    /// chunks (multiples of 32 MiB on the H100 and H200) and packs
    /// allocations into them, so what it holds exceeds what is in use by
    /// its chunks' slack, not by a granule per allocation (BENCHMARKS.md,
    /// the pool probe).
    fn memory_reserved_peak(&self) -> Result<Option<u64>, CudaError> {
        self.bind()?;
        Ok(Some(self.pool_reserved()?.1))
    }

    fn allocation_chunk(&self) -> u64 {
        self.pool_chunk
    }

    /// One 8-byte entry per 4 KiB host page (`bench/pool_probe.py`: 2 MiB
    /// of device memory per GiB pinned or registered, H100, driver 580; a
    /// host of larger pages maps fewer, so this counts at least theirs).
    fn host_page_table_bytes(&self, locked: u64) -> u64 {
        locked.div_ceil(4096).saturating_mul(8)
    }

    fn record_event(&self, event: &CudaEvent, stream: &CudaStream) -> Result<(), CudaError> {
        self.bind()?;
        self.perturb_raw(stream.raw)?;
        // SAFETY: both handles are live (their owners hold the context).
        wrap(
            unsafe { result::event::record(event.raw, stream.raw) },
            || "cuEventRecord".to_owned(),
        )
    }

    fn stream_wait_event(&self, stream: &CudaStream, event: &CudaEvent) -> Result<(), CudaError> {
        self.bind()?;
        self.perturb_raw(stream.raw)?;
        // SAFETY: both handles are live.
        wrap(
            unsafe {
                result::stream::wait_event(
                    stream.raw,
                    event.raw,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            },
            || "cuStreamWaitEvent".to_owned(),
        )
    }

    fn event_done(&self, event: &CudaEvent) -> Result<bool, CudaError> {
        self.bind()?;
        // SAFETY: the handle is live.
        match unsafe { result::event::query(event.raw) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(CudaError::new("cuEventQuery", e.0)),
        }
    }

    fn synchronize_event(&self, event: &CudaEvent) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the handle is live.
        wrap(unsafe { result::event::synchronize(event.raw) }, || {
            "cuEventSynchronize".to_owned()
        })
    }

    fn synchronize_stream(&self, stream: &CudaStream) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the handle is live.
        wrap(unsafe { result::stream::synchronize(stream.raw) }, || {
            "cuStreamSynchronize".to_owned()
        })
    }

    unsafe fn copy_h2d(
        &self,
        stream: &CudaStream,
        src: HostSource<'_, Cuda>,
        src_offset: u64,
        dst: &CudaBuffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        // The source address: a pinned buffer's, the one captured when
        // the memory was registered (never the region's again), or a
        // pageable region's own.
        let (base, len, kind) = match &src {
            HostSource::Pinned(b) => (b.ptr.cast_const(), b.len, "pinned"),
            HostSource::Registered(r) => (r.ptr, r.len as u64, "registered"),
            HostSource::Pageable(p) => {
                let bytes = p.bytes();
                (bytes.as_ptr(), bytes.len() as u64, "pageable")
            }
        };
        if !in_bounds(src_offset, bytes, len) || !in_bounds(dst_offset, bytes, dst.len) {
            return Err(invalid(
                sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
                format!(
                    "cuMemcpyHtoDAsync: {bytes} bytes from {src_offset} of a {len}-byte {kind} source to {dst_offset} of a {}-byte buffer",
                    dst.len
                ),
            ));
        }
        // A pageable source is read by the kernel, where the device loads
        // pageable memory at all.
        let pageable = match src {
            HostSource::Pageable(_) if !self.pageable_access => {
                return Err(invalid(
                    sys::cudaError_enum::CUDA_ERROR_NOT_SUPPORTED,
                    format!(
                        "reading {bytes} bytes of pageable memory in place: this device does not load pageable memory (CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS is 0: HMM needs the open kernel modules on Linux 6.1.24 or later, or ATS); stage it through pinned memory (staged_reads = \"fill\")"
                    ),
                ));
            }
            HostSource::Pageable(_) => Some(self.ctx.kernel(
                &self.ctx.pageable,
                PAGEABLE_PTX,
                c"read_pageable",
            )?),
            HostSource::Pinned(_) | HostSource::Registered(_) => None,
        };
        self.bind()?;
        self.perturb_raw(stream.raw)?;
        let span = self.timeline.begin(&self.ctx, stream.raw, || {
            timeline::h2d_name(bytes, kind, dst.ptr, dst_offset)
        })?;
        if let Some(kernel) = pageable {
            // SAFETY: both ranges are in bounds (checked above) and the
            // device loads pageable memory (checked above); the caller
            // keeps the region mapped and unchanged, and the destination
            // untouched, until an event recorded after this read completes.
            let launched = unsafe {
                launch_read(
                    kernel,
                    stream.raw,
                    base as u64 + src_offset,
                    dst.ptr + dst_offset,
                    bytes,
                )
            };
            let ended = self.timeline.end(&self.ctx, stream.raw, span);
            launched?;
            return ended;
        }
        // SAFETY: both ranges are in bounds (checked above; `base` is
        // non-null since `len >= bytes > 0`); the caller guarantees that
        // neither side is freed, and the destination not otherwise touched,
        // until an event recorded after this copy completes.
        let code = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.ptr + dst_offset,
                base.add(src_offset as usize).cast(),
                bytes as usize,
                stream.raw,
            )
        };
        // Ended whether or not the copy was enqueued: a timeline never
        // holds a copy begun and not ended.
        let ended = self.timeline.end(&self.ctx, stream.raw, span);
        check(code, || format!("cuMemcpyHtoDAsync({bytes} bytes)"))?;
        ended
    }

    unsafe fn copy_d2h(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer,
        src_offset: u64,
        dst: &mut PinnedBuffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        if !in_bounds(src_offset, bytes, src.len) || !in_bounds(dst_offset, bytes, dst.len) {
            return Err(invalid(
                sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
                format!(
                    "cuMemcpyDtoHAsync: {bytes} bytes from {src_offset} of a {}-byte buffer to {dst_offset} of a {}-byte pinned buffer",
                    src.len, dst.len
                ),
            ));
        }
        self.bind()?;
        self.perturb_raw(stream.raw)?;
        let span = self.timeline.begin(&self.ctx, stream.raw, || {
            timeline::d2h_name(bytes, src.ptr, src_offset)
        })?;
        // SAFETY: as for `copy_h2d`; `dst` is borrowed mutably, so the host
        // does not read it through this handle meanwhile.
        let code = unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.ptr.add(dst_offset as usize).cast(),
                src.ptr + src_offset,
                bytes as usize,
                stream.raw,
            )
        };
        let ended = self.timeline.end(&self.ctx, stream.raw, span);
        check(code, || format!("cuMemcpyDtoHAsync({bytes} bytes)"))?;
        ended
    }
}
