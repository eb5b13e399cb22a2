//! One test per invariant checker of CONTRACT §10: a clean observation
//! passes, and each planted bug is caught and attributed to its invariant.
//! (INV-6's checker is also run on the real workspace by `cargo xtask ci`.)

use offload_core::OffloadStrategy;
use offload_core::invariants::*;

fn caught(result: Result<(), Violation>, invariant: Invariant, needle: &str) {
    let v = result.expect_err("the planted bug must be caught");
    assert_eq!(v.invariant, invariant, "{v}");
    assert!(v.to_string().contains(needle), "`{v}` lacks `{needle}`");
    assert!(v.to_string().contains(invariant.id()));
}

const OFFLOAD_HOOKS: [&str; 3] = [
    OffloadStrategy::ModelLevel.hook_name(),
    OffloadStrategy::Layerwise.hook_name(),
    OffloadStrategy::DistributedLayerwise.hook_name(),
];

fn hook<'a>(module: &'a str, hook: &'a str, owner: &'a str) -> HookClaim<'a> {
    HookClaim {
        module,
        hook,
        owner,
    }
}

#[test]
fn inv1_single_owner() {
    let clean = [
        hook("transformer.blocks.0", "layerwise_offload", "layerwise#1"),
        hook("transformer.blocks.1", "layerwise_offload", "layerwise#1"),
        hook("transformer.blocks.1", "block_cache", "cache"),
    ];
    assert!(
        single_owner(
            clean.clone(),
            &OFFLOAD_HOOKS,
            [("blocks.0".to_owned(), "layerwise#1")]
        )
        .is_ok()
    );
    // Planted: a second strategy installs hooks on the same pipeline.
    let mut two = clean.to_vec();
    two.push(hook("text_encoder", "model_level_offload", "model_level#1"));
    caught(
        single_owner(two, &OFFLOAD_HOOKS, []),
        Invariant::SingleOwner,
        "2 owners",
    );
    // Planted: one tensor managed by two owners.
    caught(
        single_owner(
            clean,
            &OFFLOAD_HOOKS,
            [("blocks.0".to_owned(), "a"), ("blocks.0".to_owned(), "b")],
        ),
        Invariant::SingleOwner,
        "blocks.0",
    );
}

#[test]
fn inv2_one_host_master() {
    assert!(one_host_master([1, 2, 3], [1, 2, 3]).is_ok());
    // Planted: a second full host copy of storage 2.
    caught(
        one_host_master([1, 2, 3], [1, 2, 2, 3]),
        Invariant::OneHostMaster,
        "2 has 2 host masters",
    );
    // Planted: an offloaded storage with no master at all.
    caught(
        one_host_master([1, 2, 3], [1, 3]),
        Invariant::OneHostMaster,
        "2 has 0 host masters",
    );
}

fn op(op: usize, buffer: &str, stream: &str, access: Access, what: &str) -> BufferOp {
    BufferOp {
        op,
        buffer: buffer.into(),
        range: 0..64,
        stream: stream.into(),
        access,
        what: what.into(),
    }
}

/// Streams 0 = copy, 1 = compute. Builds vector clocks for a script of
/// (stream, waits-for-op) steps and returns the happens-before oracle.
fn clocks(script: &[(usize, Option<usize>)]) -> impl Fn(usize, usize) -> bool {
    let mut stream_clock = [VectorClock::new(2), VectorClock::new(2)];
    let mut op_clock: Vec<VectorClock> = Vec::new();
    for (stream, wait) in script {
        if let Some(w) = wait {
            let c = op_clock[*w].clone();
            stream_clock[*stream].join(&c);
        }
        stream_clock[*stream].tick(*stream);
        op_clock.push(stream_clock[*stream].clone());
    }
    move |a, b| op_clock[a].le(&op_clock[b])
}

#[test]
fn inv3_no_early_free() {
    // copy fills slot (0), compute waits and reads (1), copy waits for the
    // read and refills (2), compute waits and reads (3), copy waits and frees (4).
    let ordered = clocks(&[
        (0, None),
        (1, Some(0)),
        (0, Some(1)),
        (1, Some(2)),
        (0, Some(3)),
    ]);
    let ops = [
        op(0, "slot0", "copy", Access::Write, "h2d block 0"),
        op(1, "slot0", "compute", Access::Read, "block 0 forward"),
        op(2, "slot0", "copy", Access::Write, "h2d block 2"),
        op(3, "slot0", "compute", Access::Read, "block 2 forward"),
        op(4, "slot0", "copy", Access::Free, "free slot"),
    ];
    assert!(no_early_free(&ops, &ordered).is_ok());

    // Planted: the copy stream does not wait for the slot's last use.
    let no_last_use_wait = clocks(&[
        (0, None),
        (1, Some(0)),
        (0, None),
        (1, Some(2)),
        (0, Some(3)),
    ]);
    caught(
        no_early_free(&ops, no_last_use_wait),
        Invariant::NoEarlyFree,
        "overwrite or free while a read may be in flight",
    );
    // Planted: compute does not wait for the copy-done event.
    let no_ready_wait = clocks(&[
        (0, None),
        (1, None),
        (0, Some(1)),
        (1, Some(2)),
        (0, Some(3)),
    ]);
    caught(
        no_early_free(&ops, no_ready_wait),
        Invariant::NoEarlyFree,
        "read before the fill completed",
    );
    // Planted: free without waiting for the last read.
    let early_free = clocks(&[
        (0, None),
        (1, Some(0)),
        (0, Some(1)),
        (1, Some(2)),
        (0, None),
    ]);
    caught(
        no_early_free(&ops, early_free),
        Invariant::NoEarlyFree,
        "free slot",
    );
    // Planted: use after free, and double free.
    let mut after_free = ops.to_vec();
    after_free.push(op(5, "slot0", "compute", Access::Read, "stale read"));
    let all = |_: usize, _: usize| true;
    caught(
        no_early_free(&after_free, all),
        Invariant::NoEarlyFree,
        "use after free",
    );
    let mut double = ops.to_vec();
    double.push(op(5, "slot0", "copy", Access::Free, "second free"));
    caught(
        no_early_free(&double, all),
        Invariant::NoEarlyFree,
        "double free",
    );

    // Disjoint ranges of one buffer do not conflict; overlapping ones do.
    let unordered = |a: usize, b: usize| a == b;
    let part = |o: usize, range: std::ops::Range<u64>, access| BufferOp {
        range,
        ..op(o, "resident", "copy", access, "part")
    };
    assert!(
        no_early_free(
            &[
                part(0, 0..32, Access::Write),
                part(1, 32..64, Access::Write)
            ],
            unordered
        )
        .is_ok()
    );
    caught(
        no_early_free(
            &[part(0, 0..32, Access::Write), part(1, 16..48, Access::Read)],
            unordered,
        ),
        Invariant::NoEarlyFree,
        "read before the fill completed",
    );
}

fn facts(path: &str, checksum: u64, alias_class: u32) -> TensorFacts {
    TensorFacts {
        path: path.into(),
        dtype: "bf16".into(),
        shape: vec![4, 4],
        strides: vec![4, 1],
        storage_offset: 0,
        view_bytes: 32,
        alias_class,
        checksum,
    }
}

#[test]
fn inv4_buffers_stay_correct() {
    let before = [
        facts("rope.freqs", 7, 0),
        facts("embed", 9, 1),
        facts("lm_head", 9, 1),
    ];
    assert!(buffers_stay_correct(&before, &before).is_ok());
    // Planted: a non-persistent buffer lost its values after movement.
    let mut lost = before.clone();
    lost[0].checksum = 0;
    caught(
        buffers_stay_correct(&before, &lost),
        Invariant::BuffersStayCorrect,
        "rope.freqs",
    );
    // Planted: tied weights untied (aliasing lost).
    let mut untied = before.clone();
    untied[2].alias_class = 2;
    caught(
        buffers_stay_correct(&before, &untied),
        Invariant::BuffersStayCorrect,
        "lm_head",
    );
    // Planted: strides made contiguous.
    let mut restrided = before.clone();
    restrided[1].strides = vec![1, 4];
    caught(
        buffers_stay_correct(&before, &restrided),
        Invariant::BuffersStayCorrect,
        "embed",
    );
    caught(
        buffers_stay_correct(&before, &before[..2]),
        Invariant::BuffersStayCorrect,
        "3 tensors before, 2 after",
    );
}

#[test]
fn inv5_fail_before_mutate() {
    let before = offload_tests::flux_like(2, 2);
    assert!(fail_before_mutate(&before, &before.clone()).is_ok());
    // Planted: a failed enable left a different pipeline behind.
    let after = offload_tests::flux_like(2, 3);
    caught(
        fail_before_mutate(&before, &after),
        Invariant::FailBeforeMutate,
        "a failed enable changed the pipeline",
    );
}

#[test]
fn inv6_platform_abstraction() {
    assert!(platform_abstraction("offload-core", ["serde", "thiserror", "tracing"]).is_ok());
    // Planted: core depends on cudarc, or transitively on an NCCL binding.
    caught(
        platform_abstraction("offload-core", ["serde", "cudarc"]),
        Invariant::PlatformAbstraction,
        "cudarc",
    );
    caught(
        platform_abstraction("offload-core", ["nccl-rs"]),
        Invariant::PlatformAbstraction,
        "nccl-rs",
    );
}

#[test]
fn inv7_bounded_memory() {
    let good = MemoryObservation {
        peak_device_weight_bytes: 1_000 + 2 * 300,
        resident_bytes: 1_000,
        slot_bytes: 2 * 300,
        host_weight_bytes: 9_000,
        offloaded_weight_bytes: 9_000,
        group_size: 1,
        local_weight_bytes: 0,
        staging_bytes: 0,
        host_budget_bytes: None,
        host_locked_bytes: 9_000,
    };
    assert!(bounded_memory(&good, 0).is_ok());
    // A host budget (CONTRACT §7c): the host's page-locked bytes, as the
    // device locks them, stay within it, whatever one copy would allow.
    let budgeted = MemoryObservation {
        host_weight_bytes: 4_000,
        host_locked_bytes: 4_000,
        host_budget_bytes: Some(4_000),
        ..good
    };
    assert!(bounded_memory(&budgeted, 0).is_ok());
    caught(
        bounded_memory(
            &MemoryObservation {
                host_locked_bytes: 4_001,
                ..budgeted
            },
            0,
        ),
        Invariant::BoundedMemory,
        "> host_budget 4000",
    );
    // A window registered whose mapping the device locks whole: the
    // windows' bytes fit, the mapping does not.
    caught(
        bounded_memory(
            &MemoryObservation {
                host_weight_bytes: 3_000,
                host_locked_bytes: 12_000,
                ..budgeted
            },
            0,
        ),
        Invariant::BoundedMemory,
        "> host_budget 4000",
    );
    // Planted: a third slot allocated on the side.
    let over = MemoryObservation {
        peak_device_weight_bytes: good.peak_device_weight_bytes + 300,
        ..good
    };
    caught(
        bounded_memory(&over, 0),
        Invariant::BoundedMemory,
        "peak device weight bytes 1900 > resident 1000 + slots 600",
    );
    // Planted: a second host copy of the weights.
    let twice = MemoryObservation {
        host_weight_bytes: 18_000,
        ..good
    };
    caught(
        bounded_memory(&twice, 0),
        Invariant::BoundedMemory,
        "host weight bytes 18000",
    );
    // DLO: each rank holds 1/G (rounded up by padding).
    let dlo = MemoryObservation {
        host_weight_bytes: 2_251,
        group_size: 4,
        ..good
    };
    assert!(bounded_memory(&dlo, 1).is_ok());
    caught(bounded_memory(&dlo, 0), Invariant::BoundedMemory, "/ G 4");
}

#[test]
fn inv8_equivalence() {
    assert!(equivalence(&[1, 2, 3], &[1, 2, 3]).is_ok());
    // Planted: one flipped bit in the offloaded output.
    caught(
        equivalence(&[1, 2, 3], &[1, 2, 7]),
        Invariant::Equivalence,
        "first at byte 2",
    );
    caught(
        equivalence(&[1, 2, 3], &[1, 2]),
        Invariant::Equivalence,
        "2 bytes vs 3",
    );
}

#[test]
fn every_invariant_has_an_id() {
    let ids: Vec<&str> = Invariant::ALL.iter().map(|i| i.id()).collect();
    assert_eq!(
        ids,
        [
            "INV-1", "INV-2", "INV-3", "INV-4", "INV-5", "INV-6", "INV-7", "INV-8", "INV-9"
        ]
    );
}
