//! The strategies as a state machine under random pipelines (1–80 blocks,
//! mixed dtypes, tied weights, non-persistent buffers), random
//! configurations, random operations (repeated requests, skipped blocks,
//! single blocks, enable/disable) and random faults. `PROPTEST_CASES` sets
//! the case count (CI runs 10,000 in release).
//!
//! The seeded run replays one scenario from `OFFLOAD_SIM_SEED`, VOPR style:
//! a failing seed is printed and can be run again on its own.

use offload_core::OffloadConfig;
use offload_core::model::DType;
use offload_sim::FaultPlan;
use offload_sim::faults::{SEED_ENV, seed_from_env};
use offload_tests::scenario::{BlockSpec, Driver, Op, PipeSpec, Scenario, op, scenario, seeded};
use proptest::prelude::*;
use proptest::test_runner::Config;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

/// The reference: the scenario drives generation; operations are legal in
/// any state (the driver ignores those that do not apply).
struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Scenario;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Scenario> {
        scenario().boxed()
    }

    fn transitions(_: &Scenario) -> BoxedStrategy<Op> {
        op().boxed()
    }

    fn apply(state: Scenario, _: &Op) -> Scenario {
        state
    }
}

struct Offload;

impl StateMachineTest for Offload {
    type SystemUnderTest = Driver;
    type Reference = Reference;

    fn init_test(scenario: &Scenario) -> Driver {
        Driver::new(scenario.clone())
    }

    fn apply(mut driver: Driver, _: &Scenario, op: Op) -> Driver {
        driver.apply(&op);
        driver
    }

    fn teardown(driver: Driver, _: Scenario) {
        driver.finish();
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(64)
}

prop_state_machine! {
    #![proptest_config(Config { cases: cases(), failure_persistence: None, ..Config::default() })]

    #[test]
    fn strategies_keep_every_invariant(sequential 1..16 => Offload);
}

fn run_seed(seed: u64) {
    let (scenario, ops) = seeded(seed);
    let result = std::panic::catch_unwind(|| {
        let mut driver = Driver::new(scenario);
        for op in &ops {
            driver.apply(op);
        }
        driver.finish();
    });
    if let Err(e) = result {
        eprintln!("scenario failed: replay with {SEED_ENV}={seed}");
        std::panic::resume_unwind(e);
    }
}

#[test]
fn seeded_scenarios() {
    match std::env::var(SEED_ENV) {
        Ok(_) => run_seed(seed_from_env(0)),
        Err(_) => (0..32).for_each(run_seed),
    }
}

/// The suite's own checks (INV-3 from the device's order checker, INV-7
/// with exact bounds against its peaks, INV-2 by census, INV-8 against the
/// resident twin) with each mutation of the evidence issue planted: some of
/// the 32 seeded scenarios fail, every time (the seeds are fixed). The
/// deterministic tests in `planted.rs` catch each of them on every run.
#[test]
fn the_seeded_scenarios_catch_each_planted_mutation() {
    use offload_core::runtime::PlantedBug;
    let bugs = [
        PlantedBug::SkipLastUseWait,
        PlantedBug::SkipReadyWait,
        PlantedBug::WrapAroundSkipLastUseWait,
        PlantedBug::OnDemandSkipLastUseWait,
        PlantedBug::EvictWithoutLastUse,
        PlantedBug::BringInBeforeEvict,
        PlantedBug::FailedBringInFreeWithoutWait,
        PlantedBug::SecondHostCopy,
        PlantedBug::ExtraSlot,
    ];
    for bug in bugs {
        let caught = (0..32u64)
            .filter(|seed| {
                let (scenario, ops) = seeded(*seed);
                std::panic::catch_unwind(|| {
                    let mut driver = Driver::planted(scenario, &[bug]);
                    for op in &ops {
                        driver.apply(op);
                    }
                    driver.finish();
                })
                .is_err()
            })
            .count();
        println!("{}: caught by {caught} of 32 seeded scenarios", bug.name());
        assert!(caught > 0, "{bug:?} escaped every seeded scenario");
    }
}

#[test]
fn the_same_seed_gives_the_same_trace() {
    use offload_core::OffloadStrategy;
    use offload_sim::harness::{RunOptions, StrategyChoice, Workload, run};
    use offload_sim::{DeviceProfile, FaultPlan};
    let (a, b) = (seeded(7), seeded(7));
    assert_eq!(
        format!("{a:?}"),
        format!("{b:?}"),
        "generation is a function of the seed"
    );
    let preset = offload_sim::presets::tiny();
    let w = Workload {
        tokens: preset.default_tokens,
        preset,
        steps: 2,
        requests: 2,
    };
    let mut rng = offload_sim::faults::rng(11);
    let opts = RunOptions {
        faults: FaultPlan::random(&mut rng, 0, 0, 0),
        seed: 11,
        ..RunOptions::new(DeviceProfile::rtx4090())
    };
    let choice = StrategyChoice::strategy(OffloadStrategy::Layerwise);
    let (x, y) = (
        run(&w, &choice, &opts).unwrap(),
        run(&w, &choice, &opts).unwrap(),
    );
    assert_eq!(x.trace, y.trace);
    assert!(!x.trace.ops.is_empty());
    let other = RunOptions { seed: 12, ..opts };
    let z = run(&w, &choice, &other).unwrap();
    assert_ne!(
        x.requests[0].output, z.requests[0].output,
        "another weight seed gives other outputs"
    );
}

#[test]
fn a_failed_device_allocation_at_enable_is_no_refused_pin() {
    // Found by CI: the 14th allocation, a resident upload's device buffer,
    // fails; it was taken for a refused pin, a staging ring was made for
    // the upload and the uploads after it pinned their transients beside
    // it, past INV-7's bound for a run with no refused pin (1,193 > 1,145
    // bytes). Now that is `enable`'s typed error; the 9th, the upload's
    // pin, is a refused pin: the upload stages and `enable` completes.
    let b = |t: Vec<(DType, Vec<u64>)>, tie, buffer| BlockSpec {
        tensors: t,
        tie,
        buffer,
    };
    let spec = PipeSpec {
        containers: vec![vec![
            b(vec![(DType::Bf16, vec![1])], false, false),
            b(vec![(DType::Bf16, vec![6])], true, true),
            b(
                vec![(DType::F8E4M3, vec![3]), (DType::I32, vec![5])],
                false,
                false,
            ),
            b(
                vec![(DType::F64, vec![10, 10]), (DType::F32, vec![2])],
                true,
                false,
            ),
        ]],
        encoder_layers: 3,
    };
    let config = OffloadConfig {
        enable_cpu_offload: true,
        enable_layerwise_offload: true,
        ..OffloadConfig::default()
    };
    for (at, pin) in [(14, false), (9, true)] {
        let s = Scenario {
            spec: spec.clone(),
            config: config.clone(),
            depth: 1,
            faults: FaultPlan {
                fail_alloc_at: Some(at),
                ..FaultPlan::none()
            },
            seed: 14787010569866819097,
        };
        // The driver checks every invariant after each operation.
        let (failed, log) = offload_tests::capture_logs(|| {
            let mut d = Driver::new(s);
            d.apply(&Op::Enable);
            let failed: Vec<String> = d
                .log
                .iter()
                .filter(|l| l.starts_with("enable failed"))
                .cloned()
                .collect();
            d.apply(&Op::Request {
                steps: 1,
                skip: Vec::new(),
            });
            d.finish();
            failed
        });
        let staged = log.contains("for its upload was refused");
        if pin {
            assert!(failed.is_empty(), "allocation {at}: {failed:?}");
            assert!(staged, "allocation {at}: the upload's pin refused: {log}");
        } else {
            assert!(
                failed.len() == 1 && failed[0].contains("alloc_device("),
                "allocation {at}: the device allocation's error: {failed:?}"
            );
            assert!(!staged, "allocation {at}: no refused pin: {log}");
        }
    }
}
