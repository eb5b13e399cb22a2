//! A null device: every operation succeeds at once and does nothing. It
//! measures the CPU cost of our own bookkeeping (hooks, ring, placement)
//! with no simulator or driver underneath, as the transition benchmark does.

use offload_core::device::{
    Api, ByteSource, Device, DeviceBuffer, DeviceError, DeviceErrorKind, HostBuffer, HostRegion,
    HostSource, MemoryInfo, RegisterError, Registration,
};

/// The null [`Api`].
#[derive(Debug)]
pub struct Null;

/// Never returned; the null device cannot fail.
#[derive(Debug, thiserror::Error)]
#[error("null device")]
pub struct NullError;

impl DeviceError for NullError {
    fn kind(&self) -> DeviceErrorKind {
        DeviceErrorKind::Other
    }
}

/// A length and nothing else.
#[derive(Debug)]
pub struct NullBuffer(u64);

impl DeviceBuffer for NullBuffer {
    fn len_bytes(&self) -> u64 {
        self.0
    }
}

impl HostBuffer for NullBuffer {
    fn len_bytes(&self) -> u64 {
        self.0
    }
    fn write_from(&mut self, _: u64, _: u64, _: &dyn ByteSource) {}
    fn read_into(&self, _: u64, dst: &mut [u8]) {
        dst.fill(0);
    }
}

/// A registration that keeps the region.
pub struct NullRegistration(Box<dyn HostRegion>);

impl std::fmt::Debug for NullRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NullRegistration")
    }
}

impl Registration for NullRegistration {
    fn len_bytes(&self) -> u64 {
        self.0.bytes().len() as u64
    }
}

/// A stream or an event: nothing to hold.
#[derive(Debug, Default)]
pub struct NullHandle;

impl Api for Null {
    type Device = NullDevice;
    type Stream = NullHandle;
    type Event = NullHandle;
    type DeviceBuffer = NullBuffer;
    type HostBuffer = NullBuffer;
    type Registration = NullRegistration;
    type Error = NullError;
}

/// The null device.
#[derive(Debug, Default)]
pub struct NullDevice;

impl Device<Null> for NullDevice {
    fn alloc_device(&self, bytes: u64) -> Result<NullBuffer, NullError> {
        Ok(NullBuffer(bytes))
    }
    unsafe fn free_device(&self, _: NullBuffer, _: &[&NullHandle]) -> Result<(), NullError> {
        Ok(())
    }
    fn alloc_pinned(&self, bytes: u64) -> Result<NullBuffer, NullError> {
        Ok(NullBuffer(bytes))
    }
    unsafe fn free_pinned(&self, _: NullBuffer) -> Result<(), NullError> {
        Ok(())
    }
    fn register_host(
        &self,
        region: Box<dyn HostRegion>,
    ) -> Result<NullRegistration, RegisterError<Null>> {
        Ok(NullRegistration(region))
    }
    unsafe fn unregister_host(
        &self,
        r: NullRegistration,
    ) -> Result<Box<dyn HostRegion>, NullError> {
        Ok(r.0)
    }
    fn memory_info(&self) -> Result<MemoryInfo, NullError> {
        Ok(MemoryInfo {
            free_bytes: u64::MAX,
            total_bytes: u64::MAX,
        })
    }
    fn create_stream(&self) -> Result<NullHandle, NullError> {
        Ok(NullHandle)
    }
    fn create_event(&self) -> Result<NullHandle, NullError> {
        Ok(NullHandle)
    }
    fn elapsed_ns(&self, _: &NullHandle, _: &NullHandle) -> Result<u64, NullError> {
        Ok(0)
    }
    fn record_event(&self, _: &NullHandle, _: &NullHandle) -> Result<(), NullError> {
        Ok(())
    }
    fn stream_wait_event(&self, _: &NullHandle, _: &NullHandle) -> Result<(), NullError> {
        Ok(())
    }
    fn event_done(&self, _: &NullHandle) -> Result<bool, NullError> {
        Ok(true)
    }
    fn synchronize_event(&self, _: &NullHandle) -> Result<(), NullError> {
        Ok(())
    }
    fn synchronize_stream(&self, _: &NullHandle) -> Result<(), NullError> {
        Ok(())
    }
    unsafe fn copy_h2d(
        &self,
        _: &NullHandle,
        _: HostSource<'_, Null>,
        _: u64,
        _: &NullBuffer,
        _: u64,
        _: u64,
    ) -> Result<(), NullError> {
        Ok(())
    }
    unsafe fn copy_d2h(
        &self,
        _: &NullHandle,
        _: &NullBuffer,
        _: u64,
        _: &mut NullBuffer,
        _: u64,
        _: u64,
    ) -> Result<(), NullError> {
        Ok(())
    }
}
