//! Staged masters through a ring of parts (CONTRACT §7c) on the simulator:
//! a staging ring smaller than two of the largest block (here smaller than
//! one) streams every staged block in parts of one buffer, each part's copy
//! after its own fill and each buffer refilled only after the copy that
//! read it; a prefetched block is queued and its last parts issued by a
//! later hook (at the latest its own pre-forward).
//! Bit-identical to resident with no checker violation and the device's
//! own pinned peak within the ring of parts, with the filler on the hook's
//! thread and on its own; the planted bugs of the part transport are seen.
//!
//! The ring's size is a process setting
//! ([`offload_core::budget::host::set_staging_ring_bytes`]): every test in
//! this binary (its own process) sets the same.

use offload_core::budget::host::{STAGING_PARTS, set_staging_ring_bytes, staging_layout};
use offload_core::invariants::Invariant;
use offload_core::runtime::PlantedBug;
use offload_sim::harness::{RunOptions, StrategyChoice, Workload, run};
use offload_tests::outputs;

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

use offload_tests::staged_layerwise as layerwise;

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

/// The largest streamed block of the workload.
const LARGEST: u64 = 230_288;

/// The streamed bytes, the two rings of parts (without a host budget: two
/// of the largest block's worth; under one: eight buffers, smaller than
/// the largest block) and the largest resident unit's upload buffer, from
/// a plain layerwise run's bounds.
fn sizes() -> (u64, (u64, u64), u64) {
    set_staging_ring_bytes(RING);
    let o = run(
        &workload(),
        &layerwise(None, None),
        &opts(&[], 1, None, false),
    )
    .unwrap();
    let b = o.bounds;
    let free = staging_layout(LARGEST, false);
    let budgeted = staging_layout(LARGEST, true);
    assert_eq!(free.part_bytes, RING / STAGING_PARTS);
    assert_eq!(free.buffers, (2 * LARGEST).div_ceil(RING / STAGING_PARTS));
    assert_eq!(budgeted.part_bytes, RING / STAGING_PARTS);
    assert_eq!(budgeted.buffers, STAGING_PARTS);
    assert_eq!(
        b.staging_ring_bytes,
        free.bytes(),
        "the bound counts the ring of parts"
    );
    assert!(
        budgeted.bytes() < LARGEST,
        "under a budget, a ring smaller than the largest block ({})",
        budgeted.bytes()
    );
    (
        b.offloaded_bytes,
        (free.bytes(), budgeted.bytes()),
        b.staging_bytes - b.host_staging_bytes,
    )
}

/// Every master staged (the ring of two blocks' worth of parts), every
/// master staged under a host budget at the least plan (eight parts,
/// smaller than a block), and half of them under a budget, at depths 1–3,
/// with and without jitter, the filler on the hook's thread and on its
/// own: bit-identical, no violation, and never more page-locked than the
/// ring and one upload buffer or the budget. Seen red (2026-12-07) with
/// on-demand fills left pending (the block's compute waited for a `ready`
/// its parts had yet to record: the second request's output differed).
#[test]
fn a_ring_of_parts_is_bit_identical_and_pins_only_the_ring() {
    let (streamed, (free, budgeted), transient) = sizes();
    let want = resident();
    let least = budgeted + transient;
    let half = least + streamed / 2;
    for threads in [false, true] {
        for depth in [1, 2, 3] {
            for (pin, budget) in [(Some(false), None), (None, Some(least)), (None, Some(half))] {
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
                    let bound = budget.unwrap_or(free + transient);
                    offload_tests::assert_staged_run(&o, &want, bound, &at);
                }
            }
        }
    }
}

/// Whether `bug`, planted, is reported by the device's checker (a
/// violation of `invariant`) in some run of every master staged through
/// the ring of parts: without a host budget (two blocks' worth of parts),
/// or (`budgeted`) under one at the least plan (eight parts, fewer than a
/// block's).
fn caught(bug: PlantedBug, invariant: Invariant, threads: bool, budgeted: bool) -> bool {
    let (_, (_, ring), transient) = sizes();
    let (pin, budget) = if budgeted {
        (None, Some(ring + transient))
    } else {
        (Some(false), None)
    };
    // With the filler on threads of its own, how far it has filled when a
    // prefetch asks depends on the host's scheduling (a loaded machine
    // saw none of one sweep's nine runs violate): up to four sweeps.
    let sweeps = if threads { 4 } else { 1 };
    for _ in 0..sweeps {
        for depth in [1, 2, 3] {
            for jitter in [None, Some(1), Some(2)] {
                let o = run(
                    &workload(),
                    &layerwise(pin, budget),
                    &opts(&[bug], depth, jitter, threads),
                )
                .unwrap();
                if o.violations.iter().any(|v| v.invariant == invariant) {
                    return true;
                }
            }
        }
    }
    false
}

/// [`caught`] as NoEarlyFree with the filler inline and on its own thread,
/// with and without a host budget; panics naming the case where not.
fn caught_everywhere(bug: PlantedBug) {
    for threads in [false, true] {
        for budgeted in [false, true] {
            assert!(
                caught(bug, Invariant::NoEarlyFree, threads, budgeted),
                "threads {threads}, budgeted {budgeted}: {bug:?} never seen"
            );
        }
    }
}

/// A slot's `ready` recorded after a staged block's first part instead of
/// its last: compute reads the slot while its later parts land.
#[test]
fn planted_ready_after_the_first_part_is_caught() {
    caught_everywhere(PlantedBug::StagedReadyAfterFirstPart);
}

/// A block's pre-forward that lets compute wait for its slot's `ready`
/// before its queued staged parts are issued (the `ready` not yet
/// recorded): compute reads the slot before the block lands.
#[test]
fn planted_wait_on_an_unrecorded_ready_is_caught() {
    caught_everywhere(PlantedBug::StagedReadyUnrecorded);
}

/// A buffer of the ring refilled before the copy that read its last part.
#[test]
fn planted_part_reuse_before_its_copy_is_caught() {
    caught_everywhere(PlantedBug::HostStagingReuseBeforeCopy);
}

/// The request planner under a device and a host budget (CONTRACT §7a with
/// §7c) through the ring of parts: its plan counts the ring of parts (the
/// engine allocates the same), the staged blocks of every phase stream in
/// parts, a phase change settles a pending block (`use_pool`), and the
/// run is bit-identical with no violation and the device's pinned peak
/// within the budget, from the least host budget to halfway to the
/// weights, the filler inline and on its own thread.
#[test]
fn a_planned_host_budget_streams_its_staged_blocks_in_parts() {
    use offload_tests::budget::{budgets, least_device, least_host};
    set_staging_ring_bytes(RING);
    let w = workload();
    let opts = offload_tests::trained_opts(&[], 1, None);
    let want = resident();
    let inputs = offload_sim::plan::estimated_inputs(&w.preset, &opts.profile, w.tokens, 3);
    let total = w.preset.weight_bytes();
    let least = least_device(&w, &inputs);
    let device = least + (total - least) / 4;
    let least_host = least_host(&w, &inputs, device);
    let mut staged_runs = 0;
    for threads in [false, true] {
        for k in 0..=2u64 {
            let host = least_host + (total - least_host) * k / 4;
            let given = RunOptions {
                planner: Some(inputs.clone()),
                host_threads: threads,
                ..opts.clone()
            };
            let at = format!("threads {threads}, device {device}, host {host}");
            let o = run(
                &w,
                &StrategyChoice::Config(budgets(device, Some(host))),
                &given,
            )
            .unwrap_or_else(|f| panic!("{at}: {}", f.error));
            let side = o
                .plan
                .as_ref()
                .and_then(|p| p.host.clone())
                .expect("a host budget is planned");
            offload_tests::assert_staged_run(&o, &want, host, &at);
            if side.staged_bytes > 0 {
                // The ring of the largest staged block: eight parts, or
                // two whole ones where the largest staged is small.
                assert!(
                    side.staging_bytes <= RING,
                    "{at}: the plan's ring {} over the ring of parts",
                    side.staging_bytes
                );
                staged_runs += 1;
            }
        }
    }
    assert!(staged_runs > 0, "no plan staged a block");
}

/// A part's fill that fails in the middle of a block (the weight source
/// panics from its 1st, 5th, 20th, 41st or 81st read of the request on),
/// inline and on the filler's thread, at depths 1 to 6 (several
/// prefetches queued behind the failing one): the request fails with a
/// typed error naming the fill, never hangs nor unwinds, and the slots of
/// the failing block and of every block queued behind it are forgotten
/// (CONTRACT §7c): the next request, the source disarmed, is
/// bit-identical to resident with no violation. Seen red (2026-12-07)
/// with the failed block's slot kept (the next request's output
/// differed), with the post-forward settling before it released its own
/// block (the next request failed: an illegal residency transition, the
/// block still placed), and by review with only the front of the queue
/// forgotten (depth 3, read 80: the next request's output differed).
#[test]
fn a_part_whose_fill_fails_fails_the_request_typed_and_the_next_runs() {
    set_staging_ring_bytes(RING);
    let want = resident();
    for threads in [false, true] {
        for depth in [1, 2, 3, 4, 6] {
            for fail_at in [0u64, 4, 19, 40, 80] {
                let at = format!("threads {threads}, depth {depth}, read {fail_at}");
                let make = move || {
                    let o = opts(&[], depth, None, threads);
                    (workload(), o, layerwise(Some(false), None))
                };
                let (first, after) = offload_tests::failing_fill_run(make, fail_at, true)
                    .unwrap_or_else(|e| panic!("{at}: {e}"));
                let e = first.unwrap_or_else(|| panic!("{at}: the armed request succeeded"));
                let (outs, violations) = after.expect("a disarmed request followed");
                assert!(e.contains("panicked"), "{at}: {e}");
                assert_eq!(violations, 0, "{at}: violations after the failed request");
                assert_eq!(outs.last(), want.last(), "{at}: the next request");
            }
        }
    }
}
