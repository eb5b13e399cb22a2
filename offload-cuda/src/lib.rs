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

pub mod proxy;

use std::ffi::c_void;
use std::fmt;

use cudarc::driver::result;
use cudarc::driver::sys;
use offload_core::device::{
    Api, ByteSource, Device, DeviceBuffer, DeviceError, DeviceErrorKind, HostBuffer, HostRegion,
    HostSource, MemoryInfo, RegisterError, Registration,
};

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
#[error("{operation}: {code:?}")]
pub struct CudaError {
    /// The operation (with its sizes).
    pub operation: String,
    /// The driver's code.
    pub code: sys::CUresult,
}

impl DeviceError for CudaError {
    fn kind(&self) -> DeviceErrorKind {
        use sys::cudaError_enum as E;
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
        Err(CudaError {
            operation: operation(),
            code,
        })
    }
}

fn wrap<T>(
    r: Result<T, result::DriverError>,
    operation: impl FnOnce() -> String,
) -> Result<T, CudaError> {
    r.map_err(|e| CudaError {
        operation: operation(),
        code: e.0,
    })
}

/// A non-blocking stream, destroyed on drop (work already enqueued still
/// completes).
#[derive(Debug)]
pub struct CudaStream {
    raw: sys::CUstream,
}

// SAFETY: a CUstream is a handle the driver lets any thread use.
unsafe impl Send for CudaStream {}
// SAFETY: as above; the driver synchronises concurrent use of a stream.
unsafe impl Sync for CudaStream {}

impl CudaStream {
    /// The raw handle, for launching kernels and cuBLAS.
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        // SAFETY: the handle is ours; destruction is deferred by the driver
        // until enqueued work completes.
        let _ = unsafe { result::stream::destroy(self.raw) };
    }
}

/// An event without timing, destroyed on drop.
#[derive(Debug)]
pub struct CudaEvent {
    raw: sys::CUevent,
}

// SAFETY: a CUevent is a handle the driver lets any thread use.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: the handle is ours; the driver defers destruction of a
        // recorded event until it completes.
        let _ = unsafe { result::event::destroy(self.raw) };
    }
}

/// Device memory of an exact size, from the stream-ordered pool.
#[derive(Debug)]
pub struct CudaBuffer {
    ptr: sys::CUdeviceptr,
    len: u64,
}

impl CudaBuffer {
    /// The device address.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }
}

impl DeviceBuffer for CudaBuffer {
    fn len_bytes(&self) -> u64 {
        self.len
    }
}

/// Pinned host memory of an exact size (plain: not write-combined, so the
/// CPU reads it at full speed).
pub struct PinnedBuffer {
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
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` points to `len` bytes we own for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len as usize) }
    }

    fn slice_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
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

/// Caller memory registered in place with `cuMemHostRegister`; unregistered
/// by [`Device::unregister_host`], which gives the memory back.
pub struct CudaRegistration {
    region: Box<dyn HostRegion>,
}

impl fmt::Debug for CudaRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaRegistration")
            .field("len", &self.region.bytes().len())
            .finish()
    }
}

impl Registration for CudaRegistration {
    fn len_bytes(&self) -> u64 {
        self.region.bytes().len() as u64
    }
}

/// One GPU: its primary context and an internal stream that orders
/// allocations and frees.
pub struct CudaDevice {
    ordinal: i32,
    ctx: sys::CUcontext,
    memory: sys::CUstream,
    name: String,
}

// SAFETY: the context and stream are driver handles usable from any thread
// once the context is made current there (every method does).
unsafe impl Send for CudaDevice {}
// SAFETY: as above.
unsafe impl Sync for CudaDevice {}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaDevice({} #{})", self.name, self.ordinal)
    }
}

impl CudaDevice {
    /// Device `ordinal`'s primary context. Fails (never panics) where no
    /// driver or device is found.
    pub fn new(ordinal: i32) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError {
                operation: "loading the CUDA driver".to_owned(),
                code: sys::cudaError_enum::CUDA_ERROR_NO_DEVICE,
            });
        }
        let dev = wrap(result::device::get(ordinal), || {
            format!("cuDeviceGet({ordinal})")
        })?;
        // SAFETY: `dev` is a valid device; the primary context is released in Drop.
        let ctx = wrap(unsafe { result::primary_ctx::retain(dev) }, || {
            "cuDevicePrimaryCtxRetain".to_owned()
        })?;
        // SAFETY: `ctx` was just retained.
        wrap(unsafe { result::ctx::set_current(ctx) }, || {
            "cuCtxSetCurrent".to_owned()
        })?;
        let name = wrap(result::device::get_name(dev), || {
            "cuDeviceGetName".to_owned()
        })?;
        let memory = wrap(
            result::stream::create(result::stream::StreamKind::NonBlocking),
            || "cuStreamCreate(memory)".to_owned(),
        )?;
        Ok(Self {
            ordinal,
            ctx,
            memory,
            name,
        })
    }

    /// The device's name (e.g. `NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context lives as long as `self`.
        wrap(unsafe { result::ctx::set_current(self.ctx) }, || {
            "cuCtxSetCurrent".to_owned()
        })
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    fn pool(&self) -> Result<sys::CUmemoryPool, CudaError> {
        self.bind()?;
        let dev = wrap(result::device::get(self.ordinal), || {
            "cuDeviceGet".to_owned()
        })?;
        // SAFETY: `dev` is valid; the default pool lives as long as the context.
        wrap(unsafe { result::device::get_default_mem_pool(dev) }, || {
            "cuDeviceGetDefaultMemPool".to_owned()
        })
    }

    /// Returns the pool's unused memory to the driver (after frees have
    /// completed), so `cuMemGetInfo` deltas measure what is in use.
    pub fn trim_pool(&self) -> Result<(), CudaError> {
        let pool = self.pool()?;
        // SAFETY: the stream is ours; the pool handle is live.
        unsafe {
            wrap(result::stream::synchronize(self.memory), || {
                "cuStreamSynchronize(memory)".to_owned()
            })?;
            wrap(result::mem_pool::trim_to(pool, 0), || {
                "cuMemPoolTrimTo".to_owned()
            })
        }
    }

    /// The allocator's own counters: bytes in use now, and the high-water
    /// mark since [`Self::reset_pool_high`].
    pub fn pool_used(&self) -> Result<(u64, u64), CudaError> {
        let pool = self.pool()?;
        let (mut current, mut high) = (0u64, 0u64);
        // SAFETY: both attributes are u64 (cuuint64_t) and written in place.
        unsafe {
            wrap(
                result::mem_pool::get_attribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                    (&raw mut current).cast(),
                ),
                || "cuMemPoolGetAttribute(USED_MEM_CURRENT)".to_owned(),
            )?;
            wrap(
                result::mem_pool::get_attribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&raw mut high).cast(),
                ),
                || "cuMemPoolGetAttribute(USED_MEM_HIGH)".to_owned(),
            )?;
        }
        Ok((current, high))
    }

    /// Resets the high-water mark of [`Self::pool_used`] to the current use.
    pub fn reset_pool_high(&self) -> Result<(), CudaError> {
        let pool = self.pool()?;
        let mut zero = 0u64;
        // SAFETY: the attribute is a u64; setting it to 0 resets the mark.
        wrap(
            unsafe {
                result::mem_pool::set_attribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&raw mut zero).cast(),
                )
            },
            || "cuMemPoolSetAttribute(USED_MEM_HIGH)".to_owned(),
        )
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _ = self.bind();
        // SAFETY: the stream is ours; the primary context was retained in `new`.
        unsafe {
            let _ = result::stream::synchronize(self.memory);
            let _ = result::stream::destroy(self.memory);
            if let Ok(dev) = result::device::get(self.ordinal) {
                let _ = result::primary_ctx::release(dev);
            }
        }
    }
}

impl Device<Cuda> for CudaDevice {
    fn alloc_device(&self, bytes: u64) -> Result<CudaBuffer, CudaError> {
        self.bind()?;
        let op = || format!("cuMemAllocAsync({bytes} bytes)");
        // A zero-sized buffer needs no memory.
        if bytes == 0 {
            return Ok(CudaBuffer { ptr: 0, len: 0 });
        }
        // SAFETY: the pool allocation is ordered on our memory stream, which
        // is synchronised before the buffer is handed out, so any stream may
        // use it at once.
        let ptr = wrap(
            unsafe { result::malloc_async(self.memory, bytes as usize) },
            op,
        )?;
        // SAFETY: the stream is ours.
        wrap(unsafe { result::stream::synchronize(self.memory) }, op)?;
        Ok(CudaBuffer { ptr, len: bytes })
    }

    unsafe fn free_device(
        &self,
        buffer: CudaBuffer,
        after: &[&CudaEvent],
    ) -> Result<(), CudaError> {
        self.bind()?;
        if buffer.len == 0 {
            return Ok(());
        }
        for e in after {
            // SAFETY: both handles are live; the wait orders the free after
            // the event on the device.
            let waited = unsafe {
                result::stream::wait_event(
                    self.memory,
                    e.raw,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            };
            wrap(waited, || "cuStreamWaitEvent(before free)".to_owned())?;
        }
        // SAFETY: the caller guarantees every use of `buffer` is ordered
        // before one of `after`, which the memory stream now waits for.
        wrap(
            unsafe { result::free_async(buffer.ptr, self.memory) },
            || format!("cuMemFreeAsync({} bytes)", buffer.len),
        )
    }

    fn alloc_pinned(&self, bytes: u64) -> Result<PinnedBuffer, CudaError> {
        self.bind()?;
        if bytes == 0 {
            return Ok(PinnedBuffer {
                ptr: std::ptr::null_mut(),
                len: 0,
            });
        }
        // SAFETY: flags 0: plain page-locked memory, freed in `free_pinned`.
        let ptr = wrap(unsafe { result::malloc_host(bytes as usize, 0) }, || {
            format!("cuMemHostAlloc({bytes} bytes)")
        })?;
        Ok(PinnedBuffer {
            ptr: ptr.cast(),
            len: bytes,
        })
    }

    unsafe fn free_pinned(&self, buffer: PinnedBuffer) -> Result<(), CudaError> {
        self.bind()?;
        if buffer.len == 0 {
            return Ok(());
        }
        // SAFETY: the caller guarantees no copy uses it; it came from
        // cuMemHostAlloc.
        wrap(unsafe { result::free_host(buffer.ptr.cast()) }, || {
            format!("cuMemFreeHost({} bytes)", buffer.len)
        })
    }

    fn register_host(
        &self,
        region: Box<dyn HostRegion>,
    ) -> Result<CudaRegistration, RegisterError<Cuda>> {
        if let Err(error) = self.bind() {
            return Err(RegisterError { error, region });
        }
        let bytes = region.bytes();
        if bytes.is_empty() {
            return Ok(CudaRegistration { region });
        }
        let (ptr, len) = (bytes.as_ptr() as *mut c_void, bytes.len());
        // SAFETY: the region is owned by the registration and outlives it;
        // it is unregistered before it is given back.
        let code = unsafe { sys::cuMemHostRegister_v2(ptr, len, 0) };
        match check(code, || format!("cuMemHostRegister({len} bytes)")) {
            Ok(()) => Ok(CudaRegistration { region }),
            Err(error) => Err(RegisterError { error, region }),
        }
    }

    unsafe fn unregister_host(
        &self,
        registration: CudaRegistration,
    ) -> Result<Box<dyn HostRegion>, CudaError> {
        self.bind()?;
        let bytes = registration.region.bytes();
        if !bytes.is_empty() {
            // SAFETY: registered in `register_host`; no copy reads it now.
            let code = unsafe { sys::cuMemHostUnregister(bytes.as_ptr() as *mut c_void) };
            check(code, || {
                format!("cuMemHostUnregister({} bytes)", bytes.len())
            })?;
        }
        Ok(registration.region)
    }

    fn memory_info(&self) -> Result<MemoryInfo, CudaError> {
        self.bind()?;
        let (free, total) = wrap(result::mem_get_info(), || "cuMemGetInfo".to_owned())?;
        Ok(MemoryInfo {
            free_bytes: free as u64,
            total_bytes: total as u64,
        })
    }

    fn create_stream(&self) -> Result<CudaStream, CudaError> {
        self.bind()?;
        let raw = wrap(
            result::stream::create(result::stream::StreamKind::NonBlocking),
            || "cuStreamCreate".to_owned(),
        )?;
        Ok(CudaStream { raw })
    }

    fn create_event(&self) -> Result<CudaEvent, CudaError> {
        self.bind()?;
        let raw = wrap(
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING),
            || "cuEventCreate".to_owned(),
        )?;
        Ok(CudaEvent { raw })
    }

    fn record_event(&self, event: &CudaEvent, stream: &CudaStream) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: both handles are live.
        wrap(
            unsafe { result::event::record(event.raw, stream.raw) },
            || "cuEventRecord".to_owned(),
        )
    }

    fn stream_wait_event(&self, stream: &CudaStream, event: &CudaEvent) -> Result<(), CudaError> {
        self.bind()?;
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
            Err(e) => Err(CudaError {
                operation: "cuEventQuery".to_owned(),
                code: e.0,
            }),
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
        self.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        let base: &[u8] = match &src {
            HostSource::Pinned(b) => b.slice(),
            HostSource::Registered(r) => r.region.bytes(),
        };
        let src = &base[src_offset as usize..(src_offset + bytes) as usize];
        // SAFETY: the caller guarantees the ranges are in bounds and that
        // neither side is touched until an event after this copy completes.
        wrap(
            unsafe { result::memcpy_htod_async(dst.ptr + dst_offset, src, stream.raw) },
            || format!("cuMemcpyHtoDAsync({bytes} bytes)"),
        )
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
        self.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        let dst = &mut dst.slice_mut()[dst_offset as usize..(dst_offset + bytes) as usize];
        // SAFETY: as for `copy_h2d`.
        wrap(
            unsafe { result::memcpy_dtoh_async(dst, src.ptr + src_offset, stream.raw) },
            || format!("cuMemcpyDtoHAsync({bytes} bytes)"),
        )
    }
}
