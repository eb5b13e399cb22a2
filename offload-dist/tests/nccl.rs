//! The NCCL collective: what runs without a GPU (detection, ids, errors),
//! and a one-rank group where NCCL and a GPU are present.

use std::time::Duration;

use offload_core::device::{
    Collective, Device, DeviceError, DeviceErrorKind, HostBuffer, HostSource,
};
use offload_cuda::{CudaDevice, driver_present};
use offload_dist::{
    Abort, AbortCause, Aborted, DistError, NcclCollective, NcclId, PeerFailure, PendingCollective,
    init_from_env, nccl_info, nccl_present,
};

/// NCCL and a GPU, or a clear skip line.
fn gpu() -> Option<CudaDevice> {
    if let Err(e) = nccl_info() {
        println!("skipped: no NCCL: {e}");
        return None;
    }
    if !driver_present() {
        println!("skipped: no CUDA driver with a device");
        return None;
    }
    Some(CudaDevice::new(0).expect("device 0"))
}

#[test]
fn detection_never_panics_and_agrees() {
    let present = nccl_present();
    match nccl_info() {
        Ok(info) => {
            assert!(present);
            assert!(info.version >= (2, 14, 0), "{info:?}");
        }
        Err(e) => {
            assert!(!present);
            assert!(e.is_unavailable(), "{e:?}");
            let text = e.to_string();
            assert!(
                text.contains("libnccl.so.2") || text.contains("OFFLOAD_NCCL_LIBRARY"),
                "{text}"
            );
            println!("skipped: no NCCL here: {text}");
        }
    }
}

#[test]
fn unique_ids_need_nccl() {
    match NcclCollective::unique_id() {
        Ok(id) => assert!(nccl_present(), "{id:?}"),
        Err(e) => assert!(!nccl_present() && e.is_unavailable(), "{e:?}"),
    }
}

#[test]
fn init_from_env_is_a_skip_without_a_gpu() {
    if nccl_present() && driver_present() {
        println!("skipped: NCCL and a GPU are present");
        return;
    }
    // Whatever the environment says: absence is reported first.
    let err = init_from_env(|i| CudaDevice::new(i as i32), Duration::from_millis(10)).unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
}

#[test]
fn ids_are_exactly_128_bytes() {
    let bytes: Vec<u8> = (0..128u8).collect();
    let id = NcclId::from_bytes(&bytes).unwrap();
    assert_eq!(id.as_bytes(), &bytes[..]);
    for len in [0, 127, 129] {
        let err = NcclId::from_bytes(&vec![0; len]).unwrap_err();
        assert!(
            matches!(err, DistError::BadNcclId { expected: 128, got } if got == len),
            "{err:?}"
        );
    }
}

#[test]
fn an_abort_names_the_collective_its_size_and_the_timeout() {
    let a = Aborted {
        rank: 0,
        ranks: 2,
        collective: Some(PendingCollective {
            number: 7,
            shard_bytes: 4097,
        }),
        timeout: Duration::from_secs(5),
        cause: AbortCause::TimedOut,
    };
    let text = a.to_string();
    for part in [
        "collective #7",
        "4097 bytes",
        "8194 in all",
        "within 5s",
        "rank 0 of 2",
    ] {
        assert!(text.contains(part), "{part}: {text}");
    }
}

#[test]
fn transfer_failures_carry_their_kind() {
    let e = offload_cuda::CudaError::transfer_failed("ncclAllGather: remote process error");
    assert_eq!(e.kind(), DeviceErrorKind::TransferFailed);
    assert_eq!(e.to_string(), "ncclAllGather: remote process error");
}

#[test]
fn a_one_rank_group_gathers_and_aborts() {
    let Some(dev) = gpu() else { return };
    let id = NcclCollective::unique_id().unwrap();
    let col = NcclCollective::init(&dev, &id, 0, 1, Duration::from_secs(20)).unwrap();
    assert_eq!((col.rank(), col.size()), (0, 1));
    let stream = dev.create_stream().unwrap();
    let (size, front, total) = (4097u64, 3u64, 4097 + 3 + 5);
    let mut shard_host = dev.alloc_pinned(size).unwrap();
    let pattern: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    shard_host.write_from(0, size, &pattern);
    let mut fill = dev.alloc_pinned(total).unwrap();
    fill.write_from(0, total, &vec![0xa5u8; total as usize]);
    let mut out = dev.alloc_pinned(total).unwrap();
    let shard = dev.alloc_device(size).unwrap();
    let dst = dev.alloc_device(total).unwrap();
    // SAFETY: all ranges lie within their buffers; synchronised below.
    unsafe {
        dev.copy_h2d(&stream, HostSource::Pinned(&shard_host), 0, &shard, 0, size)
            .unwrap();
        dev.copy_h2d(&stream, HostSource::Pinned(&fill), 0, &dst, 0, total)
            .unwrap();
        col.all_gather(&stream, &shard, 0, size, &dst, front)
            .unwrap();
        dev.copy_d2h(&stream, &dst, 0, &mut out, 0, total).unwrap();
    }
    dev.synchronize_stream(&stream).unwrap();
    col.wait_idle().unwrap();
    let mut got = vec![0u8; total as usize];
    out.read_into(0, &mut got);
    assert!(got[..front as usize].iter().all(|&b| b == 0xa5));
    assert_eq!(&got[front as usize..(front + size) as usize], &pattern[..]);
    assert!(got[(front + size) as usize..].iter().all(|&b| b == 0xa5));
    assert_eq!(col.issued(), 1);

    // Out of bounds: refused before NCCL sees it.
    // SAFETY: the call is refused (the range does not fit).
    let e = unsafe { col.all_gather(&stream, &shard, 0, size, &dst, total) }.unwrap_err();
    assert_eq!(e.kind(), DeviceErrorKind::Other, "{e}");

    col.abort();
    assert_eq!(col.aborted().unwrap().cause, AbortCause::ByCaller);
    // SAFETY: refused: the communicator is aborted.
    let e = unsafe { col.all_gather(&stream, &shard, 0, size, &dst, front) }.unwrap_err();
    assert_eq!(e.kind(), DeviceErrorKind::TransferFailed);
    assert!(e.to_string().contains("aborted by the caller"), "{e}");
}

#[test]
fn a_peer_failure_is_named_in_the_abort() {
    let failure = PeerFailure::Failed {
        rank: 3,
        error: "CUDA out of memory".to_owned(),
    };
    let a = Aborted {
        rank: 0,
        ranks: 4,
        collective: None,
        timeout: Duration::from_secs(300),
        cause: AbortCause::PeerFailed(failure.clone()),
    };
    let text = a.to_string();
    assert!(
        text.contains("aborted because rank 3 failed: CUDA out of memory"),
        "{text}"
    );
    let e = DistError::PeerFailed {
        this_rank: 0,
        world_size: 4,
        failure,
    };
    assert!(e.to_string().contains("rank 3 failed"), "{e}");
}

#[test]
fn the_abort_handle_aborts_from_another_thread() {
    let Some(dev) = gpu() else { return };
    let id = NcclCollective::unique_id().unwrap();
    let col = NcclCollective::init(&dev, &id, 0, 1, Duration::from_secs(20)).unwrap();
    let handle = col.abort_handle();
    let failure = PeerFailure::Vanished {
        rank: 1,
        detail: "its connection closed".to_owned(),
    };
    std::thread::spawn(move || handle.abort(&failure))
        .join()
        .unwrap();
    let a = col.aborted().expect("aborted");
    assert!(
        matches!(&a.cause, AbortCause::PeerFailed(f) if f.rank() == 1),
        "{a}"
    );
    let e = col.wait_idle().unwrap_err();
    assert!(e.to_string().contains("rank 1 died without a word"), "{e}");
}
