//! The simulated multi-rank collective, driven through raw `Device` and
//! `Collective` calls from one host thread per rank: gathers assemble the
//! right bytes at the right simulated time; disagreement, departure,
//! injected faults and hangs end in typed errors, never a hang; ordering
//! bugs around a gather are INV-3 violations on the rank that has them,
//! and a gather wider than its block is an INV-9 violation. Every bug test
//! runs a clean control beside it.

use std::ops::Range;
use std::sync::mpsc;
use std::time::Duration;

use offload_core::device::{
    Collective, Device, DeviceError, DeviceErrorKind, HostBuffer, HostSource,
};
use offload_core::invariants::{Invariant, Violation};
use offload_sim::device::{SimDeviceBuffer, SimHostBuffer, SimStream};
use offload_sim::{
    DeviceProfile, FaultPlan, SimCollective, SimConfig, SimDevice, SimError, SimGroup,
};

/// Long enough never to fire in a correct run, short enough that a broken
/// implementation fails the test instead of hanging it.
const WAIT: Duration = Duration::from_secs(10);

fn devices(g: usize, divisor: u64, faults: &[(usize, FaultPlan)]) -> Vec<SimDevice> {
    (0..g)
        .map(|r| {
            let faults = faults
                .iter()
                .find(|(q, _)| *q == r)
                .map_or_else(FaultPlan::none, |(_, f)| *f);
            SimDevice::new(SimConfig {
                faults,
                ..SimConfig::sampled(DeviceProfile::h200().for_ranks(g as u32), divisor)
            })
            .unwrap()
        })
        .collect()
}

fn group(g: usize) -> Vec<SimCollective> {
    SimGroup::new(&devices(g, 1, &[]))
        .wait_limit(WAIT)
        .ranks()
        .unwrap()
}

/// Runs `f` for every rank on its own host thread; results in rank order.
fn on_ranks<T: Send>(ranks: Vec<SimCollective>, f: impl Fn(SimCollective) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let threads: Vec<_> = ranks.into_iter().map(|c| s.spawn(move || f(c))).collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a rank's thread panicked"))
            .collect()
    })
}

fn pattern(rank: usize, block: usize, i: u64) -> u8 {
    (rank * 61 + block * 17 + i as usize * 7 + 1) as u8
}

fn pinned(d: &SimDevice, bytes: &[u8]) -> SimHostBuffer {
    let mut h = d.alloc_pinned(bytes.len() as u64).unwrap();
    h.write_from(0, bytes.len() as u64, &bytes.to_vec());
    h
}

/// Fills `buf` with `byte` and waits for it.
fn fill(d: &SimDevice, buf: &SimDeviceBuffer, byte: u8) {
    let s = d.create_stream().unwrap();
    let len = offload_core::device::DeviceBuffer::len_bytes(buf);
    let h = pinned(d, &vec![byte; len as usize]);
    // SAFETY: in bounds; synchronised at once.
    unsafe { d.copy_h2d(&s, HostSource::Pinned(&h), 0, buf, 0, len) }.unwrap();
    d.synchronize_stream(&s).unwrap();
}

/// The bytes of `range` of `buf`, read back after the host has waited for
/// `after` (the stream that wrote them).
fn read_back(
    d: &SimDevice,
    after: &SimStream,
    buf: &SimDeviceBuffer,
    range: Range<u64>,
) -> Vec<u8> {
    d.synchronize_stream(after).unwrap();
    let s = d.create_stream().unwrap();
    let len = range.end - range.start;
    let mut h = d.alloc_pinned(len).unwrap();
    // SAFETY: in bounds; synchronised before the host reads.
    unsafe { d.copy_d2h(&s, buf, range.start, &mut h, 0, len) }.unwrap();
    d.synchronize_stream(&s).unwrap();
    let mut out = vec![0u8; len as usize];
    h.read_into(0, &mut out);
    out
}

fn of(violations: &[Violation], invariant: Invariant) -> Vec<&Violation> {
    violations
        .iter()
        .filter(|v| v.invariant == invariant)
        .collect()
}

fn transfer_failed(e: &SimError) -> bool {
    e.kind() == DeviceErrorKind::TransferFailed
}

/// One shard copied and gathered into a slot narrowed to G·s, for G = 1, 2
/// and 4: the slot holds every rank's shard in rank order, the bytes
/// around the narrowed range stay as they were, and each rank's log has it.
#[test]
fn gathers_assemble_every_rank_s_shard_into_the_narrowed_range() {
    for g in [1usize, 2, 4] {
        let (s, lead, slot_len) = (40u64, 16u64, 16 + 4 * 64 + 8);
        let results = on_ranks(group(g), |c| {
            let d = c.device().clone();
            let r = c.rank() as usize;
            assert_eq!(c.size() as usize, g);
            let (copy, comm) = (d.create_stream().unwrap(), d.create_stream().unwrap());
            let host = pinned(&d, &(0..s).map(|i| pattern(r, 0, i)).collect::<Vec<_>>());
            let shard = d.alloc_device(64).unwrap();
            let slot = d.alloc_device(slot_len).unwrap();
            fill(&d, &slot, 0xee);
            let copied = d.create_event().unwrap();
            // SAFETY: in bounds; the gather waits for the copy, the host
            // synchronises before reading.
            unsafe {
                d.copy_h2d(&copy, HostSource::Pinned(&host), 0, &shard, 0, s)
                    .unwrap();
                d.record_event(&copied, &copy).unwrap();
                d.stream_wait_event(&comm, &copied).unwrap();
                c.all_gather(&comm, &shard, 0, s, &slot, lead).unwrap();
            }
            let bytes = read_back(&d, &comm, &slot, 0..slot_len);
            (bytes, c.log(), d.violations())
        });
        for (r, (bytes, log, violations)) in results.iter().enumerate() {
            assert!(violations.is_empty(), "G = {g}, rank {r}: {violations:#?}");
            let end = lead + g as u64 * s;
            for (p, b) in bytes.iter().enumerate() {
                let p = p as u64;
                let want = if (lead..end).contains(&p) {
                    let i = p - lead;
                    pattern((i / s) as usize, 0, i % s)
                } else {
                    0xee
                };
                assert_eq!(*b, want, "G = {g}, rank {r}, byte {p}");
            }
            assert_eq!(log.len(), 1);
            assert_eq!((log[0].n, log[0].shard_bytes), (1, s));
        }
    }
}

/// The gather ends at max(start) + link time on every rank: a rank whose
/// stream is busy delays every other rank's stream. Control: without the
/// late rank the gather ends long before.
#[test]
fn a_late_rank_delays_every_rank_s_stream() {
    let s = 1u64 << 16;
    let run = |late: bool| {
        on_ranks(group(2), |c| {
            let d = c.device().clone();
            let comm = d.create_stream().unwrap();
            let shard = d.alloc_device(s).unwrap();
            let slot = d.alloc_device(2 * s).unwrap();
            let host = pinned(&d, &vec![c.rank() as u8; s as usize]);
            let out = d.create_accumulator();
            if late && c.rank() == 1 {
                // About 1.1 ms of compute ahead of the gather on its stream.
                let flops = DeviceProfile::h200().compute_tflops * 1.1e9;
                d.compute(&comm, &[], flops, "busy", &out).unwrap();
            }
            let (done, after) = (d.create_event().unwrap(), d.create_event().unwrap());
            // SAFETY: in bounds; all on one stream.
            unsafe {
                d.copy_h2d(&comm, HostSource::Pinned(&host), 0, &shard, 0, s)
                    .unwrap();
                c.all_gather(&comm, &shard, 0, s, &slot, 0).unwrap();
            }
            d.record_event(&done, &comm).unwrap();
            // Later work on the stream waits for the gather.
            d.compute(&comm, &[(&slot, 0..2 * s)], 1.0, "use", &out)
                .unwrap();
            d.record_event(&after, &comm).unwrap();
            d.synchronize_stream(&comm).unwrap();
            assert!(d.violations().is_empty(), "{:#?}", d.violations());
            (c.log()[0], d.event_time_ns(&done), d.event_time_ns(&after))
        })
    };
    let link = DeviceProfile::h200().all_gather_ns(2, s);
    let kernel = DeviceProfile::h200().compute_ns(1.0);
    let late = run(true);
    let start = late.iter().map(|(l, _, _)| l.start_ns).max().unwrap();
    assert!(
        late[1].0.start_ns > 1_000_000 && late[0].0.start_ns < 100_000,
        "{late:?}"
    );
    for (log, done, after) in &late {
        assert_eq!(log.end_ns, start + link, "{late:?}");
        assert_eq!(log.link_ns, link);
        assert_eq!(*done, log.end_ns, "the stream's tail is the gather's end");
        assert_eq!(*after, log.end_ns + kernel, "later work waits for the end");
    }
    let on_time = run(false);
    assert!(on_time[0].1 < 200_000, "{on_time:?}");
    assert!(late[0].1 > 1_000_000, "rank 0 waited for rank 1: {late:?}");
}

/// Ranks that gather different sizes at collective #2: an INV-9 violation
/// on every rank's device naming #2 and the signatures, a typed error on
/// every rank (no hang), and every later collective fails at once.
/// Control: the same run with agreeing sizes reports nothing.
#[test]
fn a_size_mismatch_is_a_violation_on_every_rank_and_never_a_hang() {
    let run = |mismatch: bool| {
        on_ranks(group(3), |c| {
            let d = c.device().clone();
            let comm = d.create_stream().unwrap();
            let shard = d.alloc_device(32).unwrap();
            let slot = d.alloc_device(96).unwrap();
            let host = pinned(&d, &[1u8; 32]);
            let gather = |bytes: u64| {
                // SAFETY: in bounds; all on one stream.
                unsafe {
                    d.copy_h2d(&comm, HostSource::Pinned(&host), 0, &shard, 0, 32)
                        .unwrap();
                    c.all_gather(&comm, &shard, 0, bytes, &slot, 0)
                }
            };
            let outcomes = [
                gather(32),
                gather(if mismatch && c.rank() == 2 { 16 } else { 32 }),
                gather(32),
            ];
            (outcomes, d.violations())
        })
    };
    for (r, (outcomes, violations)) in run(false).iter().enumerate() {
        assert!(outcomes.iter().all(Result::is_ok), "rank {r}: {outcomes:?}");
        assert!(violations.is_empty(), "rank {r}: {violations:#?}");
    }
    for (r, ([first, second, third], violations)) in run(true).iter().enumerate() {
        assert!(first.is_ok(), "rank {r}: {first:?}");
        let e = second.as_ref().unwrap_err();
        assert!(transfer_failed(e), "rank {r}: {e}");
        assert!(e.to_string().contains("disagree"), "rank {r}: {e}");
        let inv9 = of(violations, Invariant::CollectiveAgreement);
        assert_eq!(inv9.len(), 1, "rank {r}: {violations:#?}");
        let detail = &inv9[0].detail;
        assert!(
            detail.contains("collective #2")
                && detail.contains("all_gather of 16 bytes")
                && detail.contains("all_gather of 32 bytes"),
            "rank {r}: {detail}"
        );
        let e = third.as_ref().unwrap_err();
        assert!(
            transfer_failed(e) && e.to_string().contains("broken since collective #2"),
            "rank {r}: {e}"
        );
    }
}

/// A rank that drops its handle after two collectives: the others' third
/// collective fails with a typed error naming it. Control: the first two
/// succeed, and leaving is not a violation.
#[test]
fn a_rank_that_leaves_is_named_in_the_others_errors() {
    let results = on_ranks(group(3), |c| {
        let d = c.device().clone();
        let r = c.rank();
        let comm = d.create_stream().unwrap();
        let shard = d.alloc_device(8).unwrap();
        let slot = d.alloc_device(24).unwrap();
        let host = pinned(&d, &[r as u8; 8]);
        let mut outcomes = Vec::new();
        for n in 1..=3 {
            if r == 1 && n == 3 {
                drop(c);
                return (outcomes, d.violations());
            }
            // SAFETY: in bounds; all on one stream.
            outcomes.push(unsafe {
                d.copy_h2d(&comm, HostSource::Pinned(&host), 0, &shard, 0, 8)
                    .unwrap();
                c.all_gather(&comm, &shard, 0, 8, &slot, 0)
            });
        }
        (outcomes, d.violations())
    });
    for (r, (outcomes, violations)) in results.iter().enumerate() {
        assert!(
            outcomes[..2].iter().all(Result::is_ok),
            "rank {r}: {outcomes:?}"
        );
        assert!(violations.is_empty(), "rank {r}: {violations:#?}");
        if r != 1 {
            let e = outcomes[2].as_ref().unwrap_err();
            assert!(
                transfer_failed(e)
                    && e.to_string()
                        .contains("rank 1 left the group before collective #3"),
                "rank {r}: {e}"
            );
        }
    }
}

/// `fail_collective_at = 2` on rank 1: rank 1 gets the injected error, the
/// others an error naming rank 1 and #2; then the group is broken.
/// Control: collective #1 succeeded everywhere.
#[test]
fn an_injected_collective_failure_reaches_every_rank() {
    let faults = [(
        1,
        FaultPlan {
            fail_collective_at: Some(2),
            ..FaultPlan::none()
        },
    )];
    let ranks = SimGroup::new(&devices(3, 1, &faults))
        .wait_limit(WAIT)
        .ranks()
        .unwrap();
    let results = on_ranks(ranks, |c| {
        let d = c.device().clone();
        let comm = d.create_stream().unwrap();
        let shard = d.alloc_device(8).unwrap();
        let slot = d.alloc_device(24).unwrap();
        let host = pinned(&d, &[7u8; 8]);
        (1..=3)
            .map(|_| {
                // SAFETY: in bounds; all on one stream.
                unsafe {
                    d.copy_h2d(&comm, HostSource::Pinned(&host), 0, &shard, 0, 8)
                        .unwrap();
                    c.all_gather(&comm, &shard, 0, 8, &slot, 0)
                }
            })
            .collect::<Vec<_>>()
    });
    for (r, outcomes) in results.iter().enumerate() {
        assert!(outcomes[0].is_ok(), "rank {r}: {outcomes:?}");
        let e = outcomes[1].as_ref().unwrap_err();
        assert!(transfer_failed(e), "rank {r}: {e}");
        let want = if r == 1 {
            "injected failure of collective #2"
        } else {
            "rank 1 failed collective #2"
        };
        assert!(e.to_string().contains(want), "rank {r}: {e}");
        let e = outcomes[2].as_ref().unwrap_err();
        assert!(
            e.to_string().contains("broken since collective #2"),
            "rank {r}: {e}"
        );
    }
}

/// A call one rank's device refuses (a destination range past its buffer)
/// is a typed error there, nothing enqueued, and fails the collective for
/// the others instead of leaving them waiting.
#[test]
fn a_refused_call_fails_the_collective_for_every_rank() {
    let results = on_ranks(group(2), |c| {
        let d = c.device().clone();
        let comm = d.create_stream().unwrap();
        let shard = d.alloc_device(8).unwrap();
        let slot = d.alloc_device(16).unwrap();
        let offset = if c.rank() == 0 { 4 } else { 0 };
        // SAFETY: rank 0's range is out of bounds: the device refuses it.
        let e = unsafe { c.all_gather(&comm, &shard, 0, 8, &slot, offset) };
        (e, d.trace().ops.len())
    });
    let e0 = results[0].0.as_ref().unwrap_err();
    assert!(e0.to_string().contains("exceeds its 16 bytes"), "{e0}");
    assert_eq!(results[0].1, 0, "nothing enqueued on the refusing rank");
    let e1 = results[1].0.as_ref().unwrap_err();
    assert!(
        transfer_failed(e1) && e1.to_string().contains("rank 0 failed collective #1"),
        "{e1}"
    );
}

/// The last resort: a rank that never enters a collective nor leaves. The
/// waiting rank gets a typed error after the wait limit and every device an
/// INV-9 "hang" violation.
#[test]
fn a_rank_that_never_comes_is_a_hang_error_not_a_hang() {
    let limit = Duration::from_millis(100);
    let ranks = SimGroup::new(&devices(2, 1, &[]))
        .wait_limit(limit)
        .ranks()
        .unwrap();
    let (tx, rx) = mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let results = on_ranks(ranks, |c| {
        let d = c.device().clone();
        if c.rank() == 1 {
            // Holds its handle, issues nothing, until rank 0 is done.
            let _ = rx.lock().unwrap().recv();
            return (None, d.violations());
        }
        let comm = d.create_stream().unwrap();
        let shard = d.alloc_device(8).unwrap();
        let slot = d.alloc_device(16).unwrap();
        // SAFETY: in bounds.
        let e = unsafe { c.all_gather(&comm, &shard, 0, 8, &slot, 0) };
        let _ = tx.send(());
        (Some(e), d.violations())
    });
    let e = results[0].0.as_ref().unwrap().as_ref().unwrap_err();
    assert!(
        transfer_failed(e) && e.to_string().contains("a hang"),
        "{e}"
    );
    for (r, (_, violations)) in results.iter().enumerate() {
        let hang: Vec<_> = of(violations, Invariant::CollectiveAgreement)
            .into_iter()
            .filter(|v| v.detail.contains("a hang") && v.detail.contains("[1]"))
            .collect();
        assert_eq!(hang.len(), 1, "rank {r}: {violations:#?}");
    }
}

/// The bugs the streaming loop below can carry, on one rank or all.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Bug {
    None,
    /// The communication stream does not wait for the shard copy.
    MissingWait,
    /// The next shard copy does not wait for the gather that reads the
    /// shard buffer.
    OverwriteShard,
    /// The gather takes the whole shard buffer instead of the block's shard.
    WideGather,
    /// The gather into the slot does not wait for compute's last use of it.
    SkipSlotWait,
}

/// Two blocks of different sizes streamed through one shard buffer and one
/// slot, as DLO does (CONTRACT §8): copy the shard, the communication
/// stream waits for it and gathers into the slot narrowed to the block,
/// compute waits for the gather and reads the slot. `buggy` ranks carry
/// `bug`. Returns every rank's violations and the slot as last gathered.
fn stream_two_blocks(g: usize, bug: Bug, buggy: &[usize]) -> Vec<(Vec<Violation>, Vec<u8>)> {
    let sizes = [40u64, 24];
    let max = 40u64;
    on_ranks(group(g), |c| {
        let d = c.device().clone();
        let r = c.rank() as usize;
        let bug = if buggy.contains(&r) { bug } else { Bug::None };
        let (copy, comm, compute) = (
            d.create_stream().unwrap(),
            d.create_stream().unwrap(),
            d.create_stream().unwrap(),
        );
        let hosts: Vec<SimHostBuffer> = sizes
            .iter()
            .enumerate()
            .map(|(b, s)| pinned(&d, &(0..*s).map(|i| pattern(r, b, i)).collect::<Vec<_>>()))
            .collect();
        let shard = d.alloc_device(max).unwrap();
        let slot = d.alloc_device(g as u64 * max).unwrap();
        let (copied, gathered, used) = (
            d.create_event().unwrap(),
            d.create_event().unwrap(),
            d.create_event().unwrap(),
        );
        let out = d.create_accumulator();
        for (b, s) in sizes.iter().copied().enumerate() {
            let gather_bytes = if bug == Bug::WideGather { max } else { s };
            if bug != Bug::OverwriteShard {
                // The shard buffer is free once the last gather read it.
                d.stream_wait_event(&copy, &gathered).unwrap();
            }
            // SAFETY: in bounds; ordering is what the test checks (the
            // simulator records every breach).
            unsafe {
                d.copy_h2d(&copy, HostSource::Pinned(&hosts[b]), 0, &shard, 0, s)
                    .unwrap();
                d.record_event(&copied, &copy).unwrap();
                if bug != Bug::MissingWait {
                    d.stream_wait_event(&comm, &copied).unwrap();
                }
                if bug != Bug::SkipSlotWait {
                    // The slot is free once compute's last use completed.
                    d.stream_wait_event(&comm, &used).unwrap();
                }
                c.all_gather(&comm, &shard, 0, gather_bytes, &slot, 0)
                    .unwrap();
            }
            d.record_event(&gathered, &comm).unwrap();
            d.stream_wait_event(&compute, &gathered).unwrap();
            d.compute(
                &compute,
                &[(&slot, 0..g as u64 * gather_bytes)],
                1e6,
                "block",
                &out,
            )
            .unwrap();
            d.record_event(&used, &compute).unwrap();
        }
        d.synchronize_stream(&copy).unwrap();
        d.synchronize_stream(&compute).unwrap();
        let slot_bytes = read_back(&d, &comm, &slot, 0..g as u64 * sizes[1]);
        (d.violations(), slot_bytes)
    })
}

fn assert_clean(results: &[(Vec<Violation>, Vec<u8>)]) {
    for (r, (violations, slot)) in results.iter().enumerate() {
        assert!(violations.is_empty(), "rank {r}: {violations:#?}");
        for (p, b) in slot.iter().enumerate() {
            let (q, i) = (p as u64 / 24, p as u64 % 24);
            assert_eq!(*b, pattern(q as usize, 1, i), "rank {r}, byte {p}");
        }
    }
}

#[test]
fn the_clean_streaming_loop_reports_nothing() {
    assert_clean(&stream_two_blocks(2, Bug::None, &[]));
}

/// The communication stream does not wait for the shard copy (rank 1
/// only): INV-3 on rank 1's device, nothing on rank 0's.
#[test]
fn a_gather_not_waiting_for_its_shard_copy_is_inv3_on_that_rank() {
    let results = stream_two_blocks(2, Bug::MissingWait, &[1]);
    assert!(results[0].0.is_empty(), "{:#?}", results[0].0);
    let inv3 = of(&results[1].0, Invariant::NoEarlyFree);
    assert!(
        inv3.iter()
            .any(|v| v.detail.contains("read before the fill completed")
                && v.detail.contains("all_gather")),
        "{:#?}",
        results[1].0
    );
    assert_clean(&stream_two_blocks(2, Bug::None, &[1]));
}

/// The next block's shard copy does not wait for the gather reading the
/// shard buffer (rank 0 only): INV-3 on rank 0's device.
#[test]
fn a_copy_overwriting_a_shard_under_its_gather_is_inv3_on_that_rank() {
    let results = stream_two_blocks(2, Bug::OverwriteShard, &[0]);
    assert!(results[1].0.is_empty(), "{:#?}", results[1].0);
    let inv3 = of(&results[0].0, Invariant::NoEarlyFree);
    assert!(
        inv3.iter().any(|v| v
            .detail
            .contains("overwrite or free while a read may be in flight")
            && v.detail.contains("all_gather")),
        "{:#?}",
        results[0].0
    );
    assert_clean(&stream_two_blocks(2, Bug::None, &[0]));
}

/// The second block's gather into the slot does not wait for compute's
/// read of the first block (rank 1 only): INV-3 on rank 1's device.
#[test]
fn a_gather_into_a_slot_compute_still_reads_is_inv3_on_that_rank() {
    let results = stream_two_blocks(2, Bug::SkipSlotWait, &[1]);
    assert!(results[0].0.is_empty(), "{:#?}", results[0].0);
    let inv3 = of(&results[1].0, Invariant::NoEarlyFree);
    assert!(
        inv3.iter().any(|v| v
            .detail
            .contains("overwrite or free while a read may be in flight")
            && v.detail.contains("all_gather #2")
            && v.detail.contains("`block`")),
        "{:#?}",
        results[1].0
    );
    assert_clean(&stream_two_blocks(2, Bug::None, &[1]));
}

/// Every rank gathers the whole shard buffer (40 bytes) for the 24-byte
/// block: INV-9 on every device, naming the bytes no copy wrote.
#[test]
fn a_gather_wider_than_its_block_is_inv9() {
    let results = stream_two_blocks(2, Bug::WideGather, &[0, 1]);
    for (r, (violations, _)) in results.iter().enumerate() {
        let inv9 = of(violations, Invariant::CollectiveAgreement);
        assert_eq!(inv9.len(), 1, "rank {r}: {violations:#?}");
        assert!(
            inv9[0].detail.contains(
                "a gather of 40 bytes reads shard bytes 24..40 that no copy wrote since the last gather"
            ),
            "rank {r}: {}",
            inv9[0].detail
        );
    }
    assert_clean(&stream_two_blocks(2, Bug::None, &[]));
}

/// A second gather of a shard no copy refilled reads bytes already
/// gathered: INV-9 too ("since the last gather").
#[test]
fn gathering_a_shard_twice_without_a_copy_is_inv9() {
    let results = on_ranks(group(2), |c| {
        let d = c.device().clone();
        let comm = d.create_stream().unwrap();
        let shard = d.alloc_device(8).unwrap();
        let slot = d.alloc_device(16).unwrap();
        let host = pinned(&d, &[3u8; 8]);
        let gather = |copy_first: bool| {
            // SAFETY: in bounds; all on one stream.
            unsafe {
                if copy_first {
                    d.copy_h2d(&comm, HostSource::Pinned(&host), 0, &shard, 0, 8)
                        .unwrap();
                }
                c.all_gather(&comm, &shard, 0, 8, &slot, 0).unwrap();
            }
            of(&d.violations(), Invariant::CollectiveAgreement).len()
        };
        (gather(true), gather(true), gather(false))
    });
    for (r, counts) in results.iter().enumerate() {
        assert_eq!(*counts, (0, 0, 1), "rank {r}");
    }
}

/// With a payload divisor of 4 the kept bytes (logical positions ≡ 0 mod
/// 4) of the gathered range hold every rank's kept shard bytes, the kept
/// bytes around it stay as they were; shards that cannot keep that
/// alignment are refused on every rank, with no hang.
#[test]
fn sampled_payloads_land_at_the_kept_positions() {
    let (s, lead, len) = (32u64, 8u64, 8 + 2 * 32 + 8);
    let ranks = SimGroup::new(&devices(2, 4, &[]))
        .wait_limit(WAIT)
        .ranks()
        .unwrap();
    let results = on_ranks(ranks, |c| {
        let d = c.device().clone();
        let r = c.rank() as usize;
        let comm = d.create_stream().unwrap();
        let host = pinned(&d, &(0..s).map(|i| pattern(r, 0, i)).collect::<Vec<_>>());
        let shard = d.alloc_device(s).unwrap();
        let slot = d.alloc_device(len).unwrap();
        fill(&d, &slot, 0xee);
        // SAFETY: in bounds; all on one stream.
        unsafe {
            d.copy_h2d(&comm, HostSource::Pinned(&host), 0, &shard, 0, s)
                .unwrap();
            c.all_gather(&comm, &shard, 0, s, &slot, lead).unwrap();
        }
        let bytes = read_back(&d, &comm, &slot, 0..len);
        // 30-byte shards would put rank 1's kept bytes off the kept grid.
        // SAFETY: in bounds; refused before anything is enqueued.
        let refused = unsafe { c.all_gather(&comm, &shard, 0, 30, &slot, lead) };
        (bytes, refused, d.violations())
    });
    for (r, (bytes, refused, violations)) in results.iter().enumerate() {
        assert!(violations.is_empty(), "rank {r}: {violations:#?}");
        for (p, b) in bytes.iter().enumerate() {
            let p = p as u64;
            let want = if !p.is_multiple_of(4) {
                0
            } else if (lead..lead + 2 * s).contains(&p) {
                let i = p - lead;
                pattern((i / s) as usize, 0, i % s)
            } else {
                0xee
            };
            assert_eq!(*b, want, "rank {r}, byte {p}");
        }
        let e = refused.as_ref().unwrap_err();
        assert!(
            e.to_string().contains("sampled payloads need")
                || e.to_string().contains("failed collective #2"),
            "rank {r}: {e}"
        );
    }
}

/// The link model reproduces the measured two-H200 gather, and the group
/// refuses what it cannot simulate.
#[test]
fn link_model_and_group_construction() {
    let h200 = DeviceProfile::h200();
    let t = h200.all_gather_ns(2, 340_000_000) as f64;
    assert!(
        (t / 1.38e6 - 1.0).abs() < 0.01,
        "{t} ns vs 1.38 ms measured"
    );
    assert_eq!(h200.all_gather_ns(1, 1 << 20), h200.local_copy_ns(1 << 20));
    assert_eq!(h200.for_ranks(1).h2d_pinned_gbps, h200.h2d_pinned_gbps);
    assert_eq!(h200.for_ranks(2).h2d_pinned_gbps, 52.3);
    assert!(DeviceProfile::rtx4090().for_ranks(4).h2d_pinned_gbps < 25.0);
    assert_eq!(DeviceProfile::l20().link.kind, "pcie");

    let d = devices(2, 1, &[]);
    assert!(SimGroup::new(&[]).ranks().is_err());
    let e = SimGroup::new(&[d[0].clone(), d[0].clone()])
        .ranks()
        .unwrap_err();
    assert!(e.to_string().contains("same device"), "{e}");
    let sampled = SimDevice::new(SimConfig::sampled(DeviceProfile::h200(), 4)).unwrap();
    let e = SimGroup::new(&[d[0].clone(), sampled]).ranks().unwrap_err();
    assert!(e.to_string().contains("payload divisors differ"), "{e}");
    let ranks = SimGroup::new(&d).ranks().unwrap();
    assert_eq!(
        ranks
            .iter()
            .map(|c| (c.rank(), c.size()))
            .collect::<Vec<_>>(),
        [(0, 2), (1, 2)]
    );
    // A rank that departed cannot gather any more.
    ranks[0].depart();
    let comm = d[0].create_stream().unwrap();
    let (shard, slot) = (
        d[0].alloc_device(8).unwrap(),
        d[0].alloc_device(16).unwrap(),
    );
    // SAFETY: in bounds.
    let e = unsafe { ranks[0].all_gather(&comm, &shard, 0, 8, &slot, 0) }.unwrap_err();
    assert!(e.to_string().contains("rank 0 has left the group"), "{e}");
}
