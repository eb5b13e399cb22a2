//! Staged masters through a ring of parts (CONTRACT §7c) on the simulator:
//! a staging ring smaller than two of the largest block (here smaller than
//! one) streams every staged block in parts of one buffer, each part's copy
//! after its own fill and each buffer refilled only after the copy that
//! read it; a prefetched block's last parts are issued at the next hook.
//! Bit-identical to resident with no checker violation and the device's
//! own pinned peak within the ring of parts, with the filler on the hook's
//! thread and on its own; the planted bugs of the part transport are seen.
//!
//! The ring's size is a process setting
//! ([`offload_core::budget::host::set_staging_ring_bytes`]): every test in
//! this binary (its own process) sets the same.

use offload_core::budget::host::{
    STAGING_PARTS, set_staging_ring_bytes, staging_layout, staging_ring_bytes,
};
use offload_core::config::OffloadConfig;
use offload_core::invariants::Invariant;
use offload_core::runtime::PlantedBug;
use offload_sim::harness::{RunOptions, RunOutcome, StrategyChoice, Workload, run};
use offload_tests::{all_violations, outputs};

/// The ring: 8 buffers of 20 KiB, against blocks of 66–230 KB (the largest
/// takes 12 parts, more than the ring holds).
const RING: u64 = 160 << 10;

fn workload() -> Workload {
    offload_tests::tiny_wide_workload()
}

fn opts(bugs: &[PlantedBug], depth: usize, jitter: Option<u64>, threads: bool) -> RunOptions {
    RunOptions {
        host_threads: threads,
        ..offload_tests::trained_opts(bugs, depth, jitter)
    }
}

fn layerwise(pin: Option<bool>, budget: Option<u64>) -> StrategyChoice {
    use offload_core::bytes::{ByteSize, HostBudget};
    StrategyChoice::Config(OffloadConfig {
        enable_layerwise_offload: true,
        pin_cpu_memory: pin,
        host_budget: budget.map(|b| HostBudget::Bytes(ByteSize::new(b))),
        ..OffloadConfig::default()
    })
}

fn resident() -> Vec<u64> {
    outputs(
        &run(
            &workload(),
            &StrategyChoice::Resident,
            &opts(&[], 1, None, false),
        )
        .unwrap(),
    )
}

/// The device's own pinned + registered peak.
fn host_peak(o: &RunOutcome) -> u64 {
    o.at_end.pinned_peak_bytes + o.at_end.registered_peak_bytes
}

/// The streamed bytes, the ring of parts and the largest resident unit's
/// upload buffer, from a plain layerwise run's bounds; checks the ring is
/// one of parts, smaller than the largest block.
fn sizes() -> (u64, u64, u64) {
    set_staging_ring_bytes(RING);
    let o = run(
        &workload(),
        &layerwise(None, None),
        &opts(&[], 1, None, false),
    )
    .unwrap();
    let b = o.bounds;
    let ring = b.staging_ring_bytes;
    let parts = staging_layout(RING);
    assert_eq!(parts.buffers, STAGING_PARTS);
    assert_eq!(ring, parts.bytes(), "the bound counts the ring of parts");
    assert_eq!(
        ring,
        staging_ring_bytes(230_288),
        "the largest block's ring"
    );
    assert!(
        ring < 230_288,
        "a ring smaller than the largest block ({ring})"
    );
    (
        b.offloaded_bytes,
        ring,
        b.staging_bytes - b.host_staging_bytes,
    )
}

/// Every master staged, and half of them under a host budget, at depths
/// 1–3, with and without jitter, the filler on the hook's thread and on
/// its own: bit-identical, no violation, and never more page-locked than
/// the ring of parts and one upload buffer (every master staged) or the
/// budget. Seen red (2026-12-07) with on-demand fills left pending (the
/// block's compute waited for a `ready` its parts had yet to record: the
/// second request's output differed).
#[test]
fn a_ring_of_parts_is_bit_identical_and_pins_only_the_ring() {
    let (streamed, ring, transient) = sizes();
    let want = resident();
    let half = ring + transient + streamed / 2;
    for threads in [false, true] {
        for depth in [1, 2, 3] {
            for (pin, budget) in [(Some(false), None), (None, Some(half))] {
                for jitter in [None, Some(3)] {
                    let o = run(
                        &workload(),
                        &layerwise(pin, budget),
                        &opts(&[], depth, jitter, threads),
                    )
                    .unwrap();
                    let at = format!(
                        "threads {threads}, depth {depth}, {pin:?}/{budget:?}, jitter {jitter:?}"
                    );
                    assert_eq!(outputs(&o), want, "{at}");
                    assert!(
                        all_violations(&o).is_empty(),
                        "{at}: {:#?}",
                        all_violations(&o)
                    );
                    let bound = budget.unwrap_or(ring + transient);
                    assert!(
                        host_peak(&o) <= bound,
                        "{at}: pinned peak {} > {bound}",
                        host_peak(&o)
                    );
                }
            }
        }
    }
}

/// Whether `bug`, planted, is seen (a violation of `invariant` or an
/// output unlike resident) in some run of every master staged through the
/// ring of parts.
fn caught(bug: PlantedBug, invariant: Invariant, threads: bool) -> bool {
    set_staging_ring_bytes(RING);
    let want = resident();
    let mut seen = false;
    for depth in [1, 2, 3] {
        for jitter in [None, Some(1), Some(2)] {
            let o = run(
                &workload(),
                &layerwise(Some(false), None),
                &opts(&[bug], depth, jitter, threads),
            )
            .unwrap();
            seen |= o.violations.iter().any(|v| v.invariant == invariant) || outputs(&o) != want;
        }
    }
    seen
}

/// A slot's `ready` recorded after a staged block's first part instead of
/// its last: compute reads the slot while its later parts land.
#[test]
fn planted_ready_after_the_first_part_is_caught() {
    for threads in [false, true] {
        assert!(
            caught(
                PlantedBug::StagedReadyAfterFirstPart,
                Invariant::NoEarlyFree,
                threads
            ),
            "threads {threads}: StagedReadyAfterFirstPart never seen"
        );
    }
}

/// A buffer of the ring refilled before the copy that read its last part.
#[test]
fn planted_part_reuse_before_its_copy_is_caught() {
    for threads in [false, true] {
        assert!(
            caught(
                PlantedBug::HostStagingReuseBeforeCopy,
                Invariant::NoEarlyFree,
                threads
            ),
            "threads {threads}: HostStagingReuseBeforeCopy never seen"
        );
    }
}
