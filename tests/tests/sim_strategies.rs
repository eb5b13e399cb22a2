//! Every strategy on the simulated device: outputs bit-identical to the
//! resident run (INV-8), no checker violation, memory within bounds (INV-7).

use offload_core::OffloadStrategy;
use offload_sim::DeviceProfile;
use offload_sim::harness::{RunOptions, StrategyChoice, Workload, run};
use offload_sim::presets::tiny;

fn workload(steps: usize, requests: usize) -> Workload {
    let preset = tiny();
    Workload {
        tokens: preset.default_tokens,
        preset,
        steps,
        requests,
    }
}

#[test]
fn every_strategy_matches_the_resident_run() {
    let w = workload(3, 2);
    let opts = RunOptions::new(DeviceProfile::h200());
    let resident = run(&w, &StrategyChoice::Resident, &opts).unwrap();
    assert!(resident.violations.is_empty(), "{:?}", resident.violations);
    let outputs: Vec<u64> = resident.requests.iter().map(|r| r.output).collect();
    for strategy in [OffloadStrategy::ModelLevel, OffloadStrategy::Layerwise] {
        for depth in [1, 2, 3] {
            let opts = RunOptions {
                prefetch_depth: depth,
                ..opts.clone()
            };
            let out = run(&w, &StrategyChoice::strategy(strategy), &opts).unwrap();
            assert_eq!(out.strategy, strategy);
            assert!(
                out.violations.is_empty(),
                "{strategy} depth {depth}: {:#?}",
                out.violations
            );
            let got: Vec<u64> = out.requests.iter().map(|r| r.output).collect();
            assert_eq!(
                got, outputs,
                "{strategy} depth {depth}: outputs differ from the resident run"
            );
        }
    }
}
