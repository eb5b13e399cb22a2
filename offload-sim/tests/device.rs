//! The simulated device on its own: bytes move, the clock follows the
//! profile, the checker sees host staging reuse, capacity and injected
//! faults fail as a GPU would.

use offload_core::device::{Collective, Device, DeviceErrorKind, HostBuffer, HostSource};
use offload_core::invariants::Invariant;
use offload_sim::{DeviceProfile, FaultPlan, SimCollective, SimConfig, SimDevice};

fn device(faults: FaultPlan) -> SimDevice {
    SimDevice::new(SimConfig {
        faults,
        ..SimConfig::exact(DeviceProfile::h200())
    })
    .unwrap()
}

#[test]
fn copies_move_bytes_and_take_profile_time() {
    let d = device(FaultPlan::none());
    let s = d.create_stream().unwrap();
    let mut host = d.alloc_pinned(1 << 20).unwrap();
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7) as u8).collect();
    host.write_from(0, 1 << 20, &data);
    let dev = d.alloc_device(1 << 20).unwrap();
    let t0 = d.host_now_ns();
    // SAFETY: ranges in bounds; the stream is synchronised before reuse.
    unsafe { d.copy_h2d(&s, HostSource::Pinned(&host), 0, &dev, 0, 1 << 20) }.unwrap();
    let mut back = d.alloc_pinned(1 << 20).unwrap();
    // SAFETY: as above; same stream, so ordered after the upload.
    unsafe { d.copy_d2h(&s, &dev, 0, &mut back, 0, 1 << 20) }.unwrap();
    d.synchronize_stream(&s).unwrap();
    let mut out = vec![0u8; 1 << 20];
    back.read_into(0, &mut out);
    assert_eq!(out, data);
    let elapsed = d.host_now_ns() - t0;
    let expected = DeviceProfile::h200().h2d_ns(1 << 20) + DeviceProfile::h200().d2h_ns(1 << 20);
    assert!(
        elapsed >= expected && elapsed < expected + 100_000,
        "{elapsed} vs {expected}"
    );
    assert!(d.violations().is_empty(), "{:?}", d.violations());
    // SAFETY: the stream is drained.
    unsafe {
        d.free_pinned(host).unwrap();
        d.free_pinned(back).unwrap();
        d.free_device(dev, &[]).unwrap();
    }
    assert_eq!(d.check_released(), 0);
}

#[test]
fn rewriting_a_staging_buffer_under_a_copy_is_reported() {
    let d = device(FaultPlan::none());
    let s = d.create_stream().unwrap();
    let mut host = d.alloc_pinned(64).unwrap();
    host.write_from(0, 64, &[1u8; 64]);
    let dev = d.alloc_device(64).unwrap();
    // SAFETY: deliberately broken below: the host rewrites `host` before
    // the copy is known complete; the simulator only records it.
    unsafe { d.copy_h2d(&s, HostSource::Pinned(&host), 0, &dev, 0, 64) }.unwrap();
    host.write_from(0, 64, &[2u8; 64]);
    let v = d.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].invariant, Invariant::NoEarlyFree);
    assert!(
        v[0].detail
            .contains("overwrite or free while a read may be in flight")
            && v[0].detail.contains("pinned#"),
        "{v:?}"
    );
    // After waiting, rewriting is fine.
    d.synchronize_stream(&s).unwrap();
    host.write_from(0, 64, &[3u8; 64]);
    assert_eq!(d.violations().len(), 1);
    // A buffer dropped without free_pinned is freed after the device is
    // synchronised (no violation); one still held at the end is a leak.
    drop(host);
    assert_eq!(d.violations().len(), 1, "{:?}", d.violations());
    assert_eq!(d.check_released(), 1, "the device buffer");
    assert!(
        d.violations()
            .iter()
            .any(|v| v.invariant == Invariant::BoundedMemory)
    );
}

#[test]
fn capacity_and_injected_faults_fail_like_a_gpu() {
    // Capacity is logical: sampled payloads keep host memory small.
    let d = SimDevice::new(SimConfig::sampled(DeviceProfile::h200(), 1 << 30)).unwrap();
    let big = d.alloc_device(140_000_000_000).unwrap();
    let e = d.alloc_device(2_000_000_000).unwrap_err();
    assert_eq!(
        offload_core::device::DeviceError::kind(&e),
        DeviceErrorKind::OutOfMemory
    );
    assert!(
        e.to_string().contains("of 141000000000 bytes in use"),
        "{e}"
    );
    // SAFETY: nothing used it.
    unsafe { d.free_device(big, &[]) }.unwrap();

    let d = device(FaultPlan {
        fail_alloc_at: Some(2),
        fail_copy_at: Some(1),
        fail_collective_at: Some(1),
        fail_sync_at: Some(1),
        refuse_pin_every: None,
        refuse_pins: None,
    });
    let s = d.create_stream().unwrap();
    let a = d.alloc_device(8).unwrap();
    assert!(
        d.alloc_device(8)
            .unwrap_err()
            .to_string()
            .contains("injected failure of allocation #2")
    );
    let b = d.alloc_device(8).unwrap();
    let host = d.alloc_pinned(8).unwrap();
    // SAFETY: in bounds; nothing runs.
    let e = unsafe { d.copy_h2d(&s, HostSource::Pinned(&host), 0, &a, 0, 8) }.unwrap_err();
    assert_eq!(
        offload_core::device::DeviceError::kind(&e),
        DeviceErrorKind::TransferFailed
    );
    let group = SimCollective::single(&d);
    assert_eq!((group.rank(), group.size()), (0, 1));
    // SAFETY: in bounds.
    let e = unsafe { group.all_gather(&s, &a, 0, 8, &b, 0) }.unwrap_err();
    assert!(
        e.to_string().contains("injected failure of collective #1"),
        "{e}"
    );
    // SAFETY: in bounds; the second gather succeeds and is ordered on `s`.
    unsafe { group.all_gather(&s, &a, 0, 8, &b, 0) }.unwrap();
    // Out-of-range copies are errors, never panics.
    // SAFETY: the device checks the range and refuses.
    let e = unsafe { d.copy_h2d(&s, HostSource::Pinned(&host), 4, &a, 0, 8) }.unwrap_err();
    assert!(e.to_string().contains("exceeds its 8 bytes"), "{e}");
    // The first host synchronisation fails as on a lost device.
    let e = d.synchronize_stream(&s).unwrap_err();
    assert_eq!(
        offload_core::device::DeviceError::kind(&e),
        DeviceErrorKind::DeviceLost
    );
    assert!(
        e.to_string()
            .contains("injected failure of host synchronisation #1"),
        "{e}"
    );
    d.synchronize_stream(&s).unwrap();
}

/// Data lands at its simulated time: a kernel that does not wait for the
/// copy filling its input reads the bytes that were there before; one that
/// waits reads the new ones. The checker reports the first either way.
#[test]
fn a_read_before_its_fill_reads_stale_bytes() {
    let d = device(FaultPlan::none());
    let (copy, compute) = (d.create_stream().unwrap(), d.create_stream().unwrap());
    let bytes = 64 << 20;
    let mut host = d.alloc_pinned(bytes).unwrap();
    host.write_from(0, bytes, &vec![7u8; bytes as usize]);
    let slot = d.alloc_device(bytes).unwrap();
    let ready = d.create_event().unwrap();
    let out = d.create_accumulator();
    let read = |wait: bool| {
        d.reset_accumulator(&compute, &out).unwrap();
        // SAFETY: in bounds; the stream is synchronised below.
        unsafe { d.copy_h2d(&copy, HostSource::Pinned(&host), 0, &slot, 0, bytes) }.unwrap();
        d.record_event(&ready, &copy).unwrap();
        if wait {
            d.stream_wait_event(&compute, &ready).unwrap();
        }
        d.compute(&compute, &[(&slot, 0..bytes)], 1.0, "read", &out)
            .unwrap();
        d.synchronize_stream(&compute).unwrap();
        d.synchronize_stream(&copy).unwrap();
        d.read_accumulator(&out)
    };
    let stale = read(false);
    assert_eq!(d.violations().len(), 1, "{:?}", d.violations());
    assert!(
        d.violations()[0]
            .detail
            .contains("read before the fill completed")
    );
    let fresh = read(true);
    assert_ne!(stale, fresh, "the racing kernel read the old (zero) bytes");
    assert_eq!(read(true), fresh, "ordered reads agree");
    assert_eq!(d.violations().len(), 1);
    // Dropping buffers instead of freeing them synchronises the device
    // first: nothing leaks, nothing is reported.
    drop((host, slot));
    assert_eq!(d.check_released(), 0);
    assert_eq!(d.violations().len(), 1);
}

#[test]
fn clock_overflow_is_an_error_not_a_wrap() {
    let d = device(FaultPlan::none());
    let s = d.create_stream().unwrap();
    let out = d.create_accumulator();
    let e = d.compute(&s, &[], 1e300, "huge", &out).unwrap_err();
    assert!(
        e.to_string().contains("overflows the simulated clock"),
        "{e}"
    );
}

/// Buffers, pinned buffers and registrations dropped while copies still use
/// them are released after the whole device is synchronised: nothing is
/// reported, nothing leaks.
#[test]
fn drops_with_work_in_flight_wait_for_it() {
    let d = device(FaultPlan::none());
    let s = d.create_stream().unwrap();
    let bytes = 64 << 20;
    let mut host = d.alloc_pinned(bytes).unwrap();
    host.write_from(0, bytes, &vec![3u8; bytes as usize]);
    let dev = d.alloc_device(bytes).unwrap();
    let reg = d
        .register_host(Box::new(vec![5u8; 1 << 20]))
        .map_err(|e| e.error)
        .unwrap();
    // SAFETY: in bounds; nobody waits for the copies: the drops must.
    unsafe {
        d.copy_h2d(&s, HostSource::Pinned(&host), 0, &dev, 0, bytes)
            .unwrap();
        d.copy_h2d(&s, HostSource::Registered(&reg), 0, &dev, 0, 1 << 20)
            .unwrap();
    }
    drop(host);
    drop(reg);
    drop(dev);
    assert!(d.violations().is_empty(), "{:#?}", d.violations());
    assert_eq!(d.check_released(), 0);
}

/// A kernel reads its inputs when it starts: a copy that lands while it
/// runs (unordered, so the checker reports it) does not change what it read.
#[test]
fn a_kernel_reads_its_inputs_when_it_starts() {
    let d = device(FaultPlan::none());
    let (copy, compute) = (d.create_stream().unwrap(), d.create_stream().unwrap());
    let bytes = 1 << 16;
    let mut first = d.alloc_pinned(bytes).unwrap();
    first.write_from(0, bytes, &vec![1u8; bytes as usize]);
    let mut second = d.alloc_pinned(bytes).unwrap();
    second.write_from(0, bytes, &vec![2u8; bytes as usize]);
    let buf = d.alloc_device(bytes).unwrap();
    let out = d.create_accumulator();
    let read = |flops: f64| {
        d.reset_accumulator(&compute, &out).unwrap();
        d.compute(&compute, &[(&buf, 0..bytes)], flops, "read", &out)
            .unwrap();
    };
    // SAFETY: in bounds; synchronised before the kernels.
    unsafe { d.copy_h2d(&copy, HostSource::Pinned(&first), 0, &buf, 0, bytes) }.unwrap();
    d.synchronize_stream(&copy).unwrap();
    read(1.0);
    d.synchronize_stream(&compute).unwrap();
    let of_first = d.read_accumulator(&out);
    // A kernel of about 1 ms, and a copy of the second pattern enqueued
    // just after it, landing in microseconds: while the kernel runs.
    read(780e9);
    // SAFETY: deliberately unordered with the kernel; the simulator records it.
    unsafe { d.copy_h2d(&copy, HostSource::Pinned(&second), 0, &buf, 0, bytes) }.unwrap();
    d.synchronize_stream(&compute).unwrap();
    d.synchronize_stream(&copy).unwrap();
    assert_eq!(
        d.read_accumulator(&out),
        of_first,
        "the kernel read the bytes there when it started"
    );
    assert!(
        d.violations().iter().any(|v| v
            .detail
            .contains("overwrite or free while a read may be in flight")),
        "{:#?}",
        d.violations()
    );
    read(1.0);
    d.synchronize_stream(&compute).unwrap();
    assert_ne!(
        d.read_accumulator(&out),
        of_first,
        "the second pattern landed"
    );
}

/// A kernel that starts while a host→device copy runs takes longer by the
/// profile's `copy_interference` times the part the copy overlaps; one that
/// starts on an idle copy engine takes its own time.
#[test]
fn a_copy_slows_the_kernel_it_overlaps() {
    let d = device(FaultPlan::none());
    let p = DeviceProfile::h200();
    let (copy, compute) = (d.create_stream().unwrap(), d.create_stream().unwrap());
    let bytes = 64u64 << 20;
    let host = d.alloc_pinned(bytes).unwrap();
    let buf = d.alloc_device(bytes).unwrap();
    let out = d.create_accumulator();
    let (a, b) = (d.create_event().unwrap(), d.create_event().unwrap());
    // A kernel of about 10 ms, alone.
    let flops = p.compute_tflops * 1e10;
    d.record_event(&a, &compute).unwrap();
    d.compute(&compute, &[], flops, "alone", &out).unwrap();
    d.record_event(&b, &compute).unwrap();
    d.synchronize_stream(&compute).unwrap();
    let alone = d.event_time_ns(&b) - d.event_time_ns(&a);
    assert!(alone >= p.compute_ns(flops) && alone < p.compute_ns(flops) + 20_000);
    // The same kernel beside a 64 MiB copy (about 1.2 ms) issued first.
    // SAFETY: in bounds; synchronised before the buffers are freed.
    unsafe { d.copy_h2d(&copy, HostSource::Pinned(&host), 0, &buf, 0, bytes) }.unwrap();
    d.record_event(&a, &compute).unwrap();
    d.compute(&compute, &[], flops, "beside a copy", &out)
        .unwrap();
    d.record_event(&b, &compute).unwrap();
    d.synchronize_stream(&compute).unwrap();
    d.synchronize_stream(&copy).unwrap();
    let slowed = (d.event_time_ns(&b) - d.event_time_ns(&a)) as f64 - alone as f64;
    let most = p.copy_interference * p.h2d_ns(bytes) as f64;
    assert!(p.copy_interference > 0.0);
    assert!(
        slowed >= 0.9 * most && slowed <= most + 20_000.0,
        "slowed by {slowed} ns beside a {} ns copy (interference {})",
        p.h2d_ns(bytes),
        p.copy_interference
    );
    // SAFETY: both streams are drained.
    unsafe {
        d.free_pinned(host).unwrap();
        d.free_device(buf, &[]).unwrap();
    }
}

/// A kernel beside a decode (CONTRACT §7b) takes longer by the profile's
/// `decode_interference` times the part a decode runs beside it; a decode
/// enqueued before the kernel but waiting for an event (its slot's last
/// use) until after the kernel ends slows it not at all. Seen red with a
/// kernel charged from its start to the last decode's end (the rule
/// before 2026-12-05: 0.9 × the kernel's whole duration here).
#[test]
fn a_decode_slows_only_the_kernel_it_runs_beside() {
    let d = device(FaultPlan::none());
    let p = DeviceProfile::h200();
    let (decode, compute, other) = (
        d.create_stream().unwrap(),
        d.create_stream().unwrap(),
        d.create_stream().unwrap(),
    );
    let bytes = 256u64 << 20;
    let (src, dst) = (
        d.alloc_device(bytes).unwrap(),
        d.alloc_device(bytes).unwrap(),
    );
    let out = d.create_accumulator();
    let (a, b, gate) = (
        d.create_event().unwrap(),
        d.create_event().unwrap(),
        d.create_event().unwrap(),
    );
    let ident: offload_sim::device::DecodeFn = std::sync::Arc::new(|b: &[u8]| Some(b.to_vec()));
    // A kernel of about 5 ms, alone.
    let flops = p.compute_tflops * 5e9;
    let timed = |what: &str| {
        d.record_event(&a, &compute).unwrap();
        d.compute(&compute, &[], flops, what, &out).unwrap();
        d.record_event(&b, &compute).unwrap();
        d.synchronize_stream(&compute).unwrap();
        d.event_time_ns(&b) - d.event_time_ns(&a)
    };
    let alone = timed("alone");
    // A decode gated behind 1.1 GB of device→host copy on another stream
    // (about 20 ms on the D2H engine, which no kernel shares), enqueued
    // first: the kernel ends before it starts.
    let gate_bytes = 1u64 << 30;
    let gate_src = d.alloc_device(gate_bytes).unwrap();
    let mut gate_dst = d.alloc_pinned(gate_bytes).unwrap();
    assert!(p.d2h_ns(gate_bytes) > 2 * p.compute_ns(flops));
    // SAFETY: in bounds; synchronised before the buffers are freed.
    unsafe { d.copy_d2h(&other, &gate_src, 0, &mut gate_dst, 0, gate_bytes) }.unwrap();
    d.record_event(&gate, &other).unwrap();
    d.stream_wait_event(&decode, &gate).unwrap();
    d.decode(&decode, (&src, bytes), (&dst, bytes), ident.clone())
        .unwrap();
    let gated = timed("beside a gated decode");
    d.synchronize_stream(&decode).unwrap();
    assert!(
        gated <= alone + 20_000,
        "a decode that had not started slowed the kernel: {gated} ns against {alone} ns alone"
    );
    // A decode that runs: the kernel loses the interference of its overlap.
    d.decode(&decode, (&src, bytes), (&dst, bytes), ident)
        .unwrap();
    let beside = timed("beside a running decode") as f64 - alone as f64;
    d.synchronize_stream(&decode).unwrap();
    let most = p.decode_interference * p.decode_ns(bytes) as f64;
    assert!(
        beside >= 0.9 * most && beside <= most + 20_000.0,
        "slowed by {beside} ns beside a {} ns decode (interference {})",
        p.decode_ns(bytes),
        p.decode_interference
    );
    d.synchronize_stream(&other).unwrap();
    // SAFETY: every stream is drained.
    unsafe {
        d.free_device(src, &[]).unwrap();
        d.free_device(dst, &[]).unwrap();
        d.free_device(gate_src, &[]).unwrap();
        d.free_pinned(gate_dst).unwrap();
    }
}

/// Pageable memory read in place (`HostSource::Pageable`): the bytes land;
/// a copy still queued when its region's owner drops it is an INV-3
/// violation, even where a new region then takes the same address and is
/// copied from; a device without pageable reads refuses the copy, typed.
#[test]
fn pageable_reads_land_and_a_region_dropped_under_a_queued_copy_is_seen() {
    use std::sync::Arc;
    type Region = Arc<dyn offload_core::device::HostRegion>;
    let d = SimDevice::new(SimConfig {
        pageable_reads: true,
        ..SimConfig::exact(DeviceProfile::h200())
    })
    .unwrap();
    let s = d.create_stream().unwrap();
    let len = 1usize << 20;
    let dev = d.alloc_device(len as u64).unwrap();
    let mut back = d.alloc_pinned(len as u64).unwrap();
    let a: Region = Arc::new((0..len).map(|i| (i * 7) as u8).collect::<Vec<u8>>());
    // SAFETY: in bounds; `a` outlives the copy (synchronised below).
    unsafe { d.copy_h2d(&s, HostSource::Pageable(&a), 0, &dev, 0, len as u64) }.unwrap();
    // SAFETY: same stream, after the copy.
    unsafe { d.copy_d2h(&s, &dev, 0, &mut back, 0, len as u64) }.unwrap();
    d.synchronize_stream(&s).unwrap();
    let mut out = vec![0u8; len];
    back.read_into(0, &mut out);
    assert_eq!(&out[..], a.bytes());
    assert!(d.violations().is_empty(), "{:?}", d.violations());
    // Queued, then dropped; a second region over the same memory (the same
    // address: two windows of one mapping) copied from next.
    struct Window(Arc<Vec<u8>>);
    // SAFETY: the Vec behind the Arc is never written or moved.
    unsafe impl offload_core::device::HostRegion for Window {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
    }
    let memory = Arc::new(vec![3u8; len]);
    let first: Region = Arc::new(Window(Arc::clone(&memory)));
    // SAFETY: deliberately broken: `first` is dropped before the copy runs.
    unsafe { d.copy_h2d(&s, HostSource::Pageable(&first), 0, &dev, 0, len as u64) }.unwrap();
    drop(a);
    drop(first);
    let b: Region = Arc::new(Window(Arc::clone(&memory)));
    assert_eq!(b.bytes().as_ptr(), memory.as_ptr(), "the same address");
    // SAFETY: in bounds; `b` outlives the copy.
    unsafe { d.copy_h2d(&s, HostSource::Pageable(&b), 0, &dev, 0, len as u64) }.unwrap();
    d.synchronize_all();
    let v = d.violations();
    assert!(
        v.iter().any(|v| v.invariant == Invariant::NoEarlyFree
            && v.detail.contains("after its owner dropped it")),
        "{v:?}"
    );
    assert_eq!(v.len(), 1, "only the dropped region's copy: {v:?}");
    // Without pageable reads: a typed error, nothing enqueued.
    let plain = device(FaultPlan::none());
    let s2 = plain.create_stream().unwrap();
    let dev2 = plain.alloc_device(16).unwrap();
    // SAFETY: refused before anything is enqueued.
    let e = unsafe { plain.copy_h2d(&s2, HostSource::Pageable(&b), 0, &dev2, 0, 16) }.unwrap_err();
    assert!(
        e.to_string().contains("does not read pageable memory"),
        "{e}"
    );
}
