//! The request planner at its edges (large stacks on the greedy path, granules above block sizes, mappings and slack near 2^50, activations near 2^60, depth 1 to 7) and a budget that cannot be held failing before the warm-up.
use offload_core::OffloadConfig;
use offload_core::budget::{BudgetError, DeviceMemory, Evaluator, PlannerInputs, plan};
use offload_core::model::Pipeline;
use offload_tests::budget::{budget_config, inputs};
use proptest::prelude::*;

/// A pipeline whose double blocks come in three widths from `h1`.
fn pipeline(
    (double, h1, single, h2, extra): (usize, u64, usize, u64, u64),
    encoder: (usize, u64),
    vae: u64,
    outside: u64,
) -> Pipeline {
    offload_tests::budget::pipeline(
        (double, &|i| h1 + (i as u64 % 3) * 4, single, h2, extra),
        encoder,
        vae,
        outside,
    )
}

fn check(
    p: &Pipeline,
    inp: &PlannerInputs,
    budget: u64,
    dev: DeviceMemory,
) -> Result<u64, BudgetError> {
    match plan(p, &budget_config(budget), inp, dev) {
        Ok(pl) => {
            let e = Evaluator::new(p, &budget_config(budget), inp).unwrap();
            let ev = e.evaluate(&pl.choices()).unwrap();
            assert!(
                ev.peak_bytes <= budget,
                "peak {} > budget {budget}\n{pl}",
                ev.peak_bytes
            );
            for c in &pl.components {
                assert!(c.peak.total() <= budget);
            }
            // the least budget plans too, one below does not
            let m = pl.minimum.bytes;
            assert!(
                plan(p, &budget_config(m), inp, dev).is_ok(),
                "least budget {m} does not plan"
            );
            if m > 1 {
                assert!(matches!(
                    plan(p, &budget_config(m - 1), inp, dev),
                    Err(BudgetError::DoesNotFit { .. })
                ));
            }
            Ok(m)
        }
        Err(e) => Err(e),
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("OFFLOAD_BUDGET_EDGE_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(6),
        ..ProptestConfig::default()
    })]
    #[test]
    fn large_stacks_and_extremes(
        double in 0usize..30, single in 0usize..30, layers in prop::sample::select(vec![0usize, 1, 2, 12]),
        vae in prop::sample::select(vec![0u64, 600]), outside in prop::sample::select(vec![0u64, 500]),
        act in prop::collection::vec(prop::sample::select(vec![0u64, 1, 20_000, 1 << 40, 1 << 60]), 4),
        compute in prop::collection::vec(0.0f64..2e-3, 16),
        steps in prop::sample::select(vec![1u32, 28, 100_000]),
        granule in prop::sample::select(vec![1u64, 1 << 21, 1 << 30]),
        mapping in prop::sample::select(vec![0u64, 700, 1 << 50]),
        slack in prop::sample::select(vec![0u64, 1 << 50]),
        fraction in 0.0f64..1.5, interference in 0.0f64..1.0, depth in 1usize..8,
    ) {
        let p = pipeline((double, 16, single, 8, 100), (layers, 24), vae, outside);
        let mut inp = inputs(&p, 1e6, steps, &compute, &act);
        inp.allocation_granule_bytes = granule; inp.mapping_bytes = mapping; inp.allocator_slack_bytes = slack;
        inp.copy_interference = interference; inp.max_depth = depth;
        let dev = DeviceMemory::of(u64::MAX / 2);
        // find least by a huge budget
        let least = match check(&p, &inp, u64::MAX / 2, dev) { Ok(m) => m, Err(e) => panic!("{e}") };
        let budget = ((least as f64) * fraction) as u64 + 1;
        let _ = check(&p, &inp, budget.min(u64::MAX / 2), dev);
        let _ = check(&p, &inp, least + (least / 7).min(1 << 40), dev);
    }
}

/// A budget the device cannot hold (above its memory, or below the least)
/// should fail before the warm-up runs (CONTRACT §7a: "fails before anything
/// is mutated"; INV-5).
#[test]
fn an_impossible_budget_fails_before_the_warmup() {
    use offload_sim::harness::{Rig, RunOptions, Workload};
    use offload_sim::presets::tiny;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    for budget in [
        offload_core::bytes::DeviceBudget::parse("1TiB").unwrap(),
        offload_core::bytes::DeviceBudget::parse("1B").unwrap(),
    ] {
        let preset = tiny();
        let w = Workload {
            tokens: preset.default_tokens,
            preset,
            steps: 2,
            requests: 1,
        };
        let mut rig = Rig::new(
            w.preset.pipeline.clone(),
            &RunOptions::new(offload_sim::DeviceProfile::h200()),
        )
        .unwrap();
        rig.serve_workload(&w);
        let runs = Arc::new(AtomicUsize::new(0));
        let r2 = Arc::clone(&runs);
        let preset = w.preset.clone();
        rig.runtime.set_request(move |rt, shape| {
            r2.fetch_add(1, Ordering::SeqCst);
            let w = Workload {
                preset: preset.clone(),
                tokens: shape.tokens,
                steps: shape.steps as usize,
                requests: 1,
            };
            let device: &offload_sim::SimDevice = rt.device();
            let probe = offload_sim::harness::Probe::new(device)?;
            offload_sim::harness::request(rt, device, &probe, &w)?;
            Ok(())
        });
        let config = OffloadConfig {
            device_budget: Some(budget),
            ..OffloadConfig::default()
        };
        let e = rig
            .runtime
            .enable_selected(&config, &rig.platform)
            .unwrap_err();
        eprintln!(
            "budget {budget}: {e}; warm-up requests run: {}",
            runs.load(Ordering::SeqCst)
        );
        assert_eq!(
            runs.load(Ordering::SeqCst),
            0,
            "budget {budget}: the warm-up ran before the typed error: {e}"
        );
    }
}

mod restage {
    use offload_core::budget::host::{BuiltBlock, built_peak, restage_within};
    use proptest::prelude::*;

    /// A block of `staged` bytes staged, else `pinned` (a coded master's
    /// pinned bytes may differ from what a staging buffer holds of it).
    fn built(staged: u64, pinned: u64, is_staged: bool, may_stage: bool) -> BuiltBlock {
        BuiltBlock {
            pinned: if is_staged { 0 } else { pinned },
            staged,
            is_staged,
            may_stage,
        }
    }

    /// Every store reachable by staging some of `blocks`' stageable
    /// pinned blocks, with how many it staged.
    fn subsets(blocks: &[BuiltBlock]) -> impl Iterator<Item = (Vec<BuiltBlock>, usize)> + '_ {
        let movable: Vec<usize> = (0..blocks.len())
            .filter(|&i| !blocks[i].is_staged && blocks[i].may_stage)
            .collect();
        (0u32..(1 << movable.len())).map(move |mask| {
            let mut after = blocks.to_vec();
            for (k, &i) in movable.iter().enumerate() {
                if mask & (1 << k) != 0 {
                    after[i] = built(blocks[i].staged, 0, true, true);
                }
            }
            (after, mask.count_ones() as usize)
        })
    }

    proptest! {
        /// Whatever the store the device allowed, the blocks chosen are
        /// pinned ones that may stage and bring it within the budget; or
        /// the error says the peak it reached is over, and staging every
        /// stageable block no larger than the ring (which never grows the
        /// ring) would not have fit either.
        #[test]
        fn restaging_lands_within_the_budget_or_says_why(
            sizes in prop::collection::vec((0u64..50, 0u64..50, prop::bool::weighted(0.15), prop::bool::weighted(0.8)), 0..12),
            fixed in 0u64..40,
            budget in 0u64..400,
        ) {
            let blocks: Vec<BuiltBlock> = sizes.iter().map(|&(b, p, s, m)| built(b, p, s, m)).collect();
            match restage_within(budget, fixed, &blocks) {
                Ok(more) => {
                    let mut after = blocks.clone();
                    for &i in &more {
                        prop_assert!(!blocks[i].is_staged && blocks[i].may_stage);
                        after[i] = built(blocks[i].staged, 0, true, true);
                    }
                    prop_assert!(built_peak(fixed, &after) <= budget);
                    if built_peak(fixed, &blocks) <= budget {
                        prop_assert!(more.is_empty(), "a store within its budget is left alone");
                    }
                    // The least ring any fitting choice has, and the fewest
                    // blocks staged at that ring.
                    let ring_of = |v: &[BuiltBlock]| v.iter().filter(|b| b.is_staged).map(|b| b.staged).max().unwrap_or(0);
                    let ours = (ring_of(&after), more.len());
                    for (ring, count) in subsets(&blocks).filter(|(a, _)| built_peak(fixed, a) <= budget).map(|(a, n)| (ring_of(&a), n)) {
                        prop_assert!(ring > ours.0 || (ring == ours.0 && count >= ours.1), "{ring}, {count} beats {ours:?}");
                    }
                }
                Err(e) => {
                    // Exact: no set of stageable pinned blocks fits, and
                    // the least peak any reaches is the one named.
                    prop_assert!(e.peak.bytes() > budget);
                    let least = subsets(&blocks).map(|(a, _)| built_peak(fixed, &a)).min();
                    prop_assert_eq!(least, Some(e.peak.bytes()));
                }
            }
        }
    }
}
