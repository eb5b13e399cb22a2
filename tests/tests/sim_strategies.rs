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
            assert_eq!(
                offload_sim::job::memory_violations(&out),
                None,
                "{strategy} depth {depth}: INV-7"
            );
            let got: Vec<u64> = out.requests.iter().map(|r| r.output).collect();
            assert_eq!(
                got, outputs,
                "{strategy} depth {depth}: outputs differ from the resident run"
            );
        }
    }
}

/// Weights a loader already holds, block by block, in the packed layout:
/// layerwise registers them in place (no pinned copy) and computes the same.
#[test]
fn loader_memory_is_registered_in_place() {
    use offload_core::device::HostRegion;
    use offload_core::model::StorageId;
    use offload_core::runtime::{Runtime, Unit, WeightSource};
    use offload_sim::presets::SyntheticWeights;
    use std::sync::Arc;

    struct Loaded(SyntheticWeights);
    impl WeightSource for Loaded {
        fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
            self.0.read(storage, position, dst);
        }
        fn take_region(&self, unit: &Unit) -> Option<Box<dyn HostRegion>> {
            let mut bytes = vec![0u8; unit.bytes as usize];
            for e in &unit.entries {
                self.0.read(
                    e.storage,
                    0,
                    &mut bytes[e.offset as usize..(e.offset + e.bytes) as usize],
                );
            }
            Some(Box::new(bytes))
        }
    }

    let w = workload(3, 2);
    let opts = RunOptions::new(DeviceProfile::h200());
    let expected: Vec<u64> = run(&w, &StrategyChoice::Resident, &opts)
        .unwrap()
        .requests
        .iter()
        .map(|r| r.output)
        .collect();

    let rig = offload_sim::harness::Rig::new(w.preset.pipeline.clone(), &opts).unwrap();
    let device = Arc::new(rig.device.clone());
    let compute = Arc::clone(rig.runtime.compute_stream());
    let platform = offload_core::runtime::CorePlatform::<offload_sim::Sim>::new(
        "sim",
        Arc::clone(&device),
        Arc::clone(&compute),
        Arc::new(Loaded(SyntheticWeights { seed: 0 })),
    );
    let config = offload_core::OffloadConfig {
        enable_layerwise_offload: true,
        ..Default::default()
    };
    let mut rt = Runtime::new(device, compute, w.preset.pipeline.clone());
    rt.enable(Box::new(platform.layerwise(config).unwrap()))
        .map_err(|(e, _)| e)
        .unwrap();
    let stats = rig.device.stats();
    let streamed = rt.backend().unwrap().host_weight_bytes();
    assert_eq!(stats.pinned_bytes, 0, "no pinned copy");
    assert_eq!(
        stats.registered_bytes, streamed,
        "every block registered in place"
    );
    let probe = offload_sim::harness::Probe::new(&rig.device).unwrap();
    let got: Vec<u64> = (0..2)
        .map(|_| {
            offload_sim::harness::request(&rt, &rig.device, &probe, &w)
                .unwrap()
                .output
        })
        .collect();
    assert_eq!(got, expected);
    rt.disable().unwrap();
    assert_eq!(
        rig.device.stats().registered_bytes,
        0,
        "unregistered at disable"
    );
    assert!(
        rig.device.violations().is_empty(),
        "{:?}",
        rig.device.violations()
    );
}

/// A forward's error names its module once, however deep it arose (a child
/// scope's error passes through its parents unchanged), and an error of
/// the caller's own names the module that ran it.
#[test]
fn forward_errors_name_their_module_once() {
    use offload_sim::harness::Rig;
    let preset = tiny();
    let mut rig = Rig::new(
        preset.pipeline.clone(),
        &RunOptions::new(DeviceProfile::h200()),
    )
    .unwrap();
    let backend = rig.platform.resident().unwrap();
    rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
    let e = rig
        .runtime
        .forward("transformer", |dit| {
            dit.child("transformer_blocks.0", |blk| {
                blk.view("nope")?;
                Ok(())
            })?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert_eq!(e.matches("forward of").count(), 1, "{e}");
    assert!(
        e.contains("`transformer.transformer_blocks.0`") && e.contains("no tensor `nope`"),
        "{e}"
    );
    let e = rig
        .runtime
        .forward("transformer", |_| -> Result<(), _> {
            Err("the caller's own failure".into())
        })
        .unwrap_err()
        .to_string();
    assert_eq!(e, "forward of `transformer`: the caller's own failure");
    rig.runtime.disable().unwrap();
}

/// `pin_cpu_memory = false` (or the compact `pin_memory = false`) means
/// "stage every master" for layerwise, model-level and planned offload
/// (CONTRACT §7c) and is refused, with where it works, by distributed
/// layerwise, which has no staging transport; without offload it changes
/// nothing.
#[test]
fn unpinned_host_masters_stage_where_a_staging_transport_is_and_are_refused_elsewhere() {
    use offload_core::{OffloadConfig, get_offload_backend};
    use offload_sim::harness::Rig;
    let rig = Rig::new(tiny().pipeline, &RunOptions::new(DeviceProfile::h200())).unwrap();
    for text in [
        r#"{"enable_layerwise_offload": true, "pin_cpu_memory": false}"#,
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "pin_memory": false}}"#,
        r#"{"enable_cpu_offload": true, "pin_cpu_memory": false}"#,
        r#"{"device_budget": "1GiB", "pin_cpu_memory": false}"#,
    ] {
        let config = OffloadConfig::from_json_str(text).unwrap();
        assert!(
            get_offload_backend(&config, &rig.platform).is_ok(),
            "{text}: its masters are staged"
        );
    }
    let text = r#"{"enable_distributed_layerwise_offload": true, "pin_cpu_memory": false}"#;
    let config = OffloadConfig::from_json_str(text).unwrap();
    let e = get_offload_backend(&config, &rig.platform)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`pin_cpu_memory` = false")
            && e.contains("with layerwise offload, model-level offload (enable_cpu_offload) or a device_budget only"),
        "{text}: {e}"
    );
    let config = OffloadConfig::from_json_str(r#"{"pin_cpu_memory": false}"#).unwrap();
    assert!(get_offload_backend(&config, &rig.platform).is_ok());
}

/// `None` from `get_offload_backend` (a configuration that selects no
/// offload) means the pipeline runs as it is, resident:
/// `Runtime::enable_selected` enables the resident backend in its place,
/// and the outputs equal a resident run's. A forward with no backend at all
/// fails with an error that says how to enable one.
#[test]
fn a_configuration_selecting_no_offload_runs_resident() {
    use offload_core::{OffloadConfig, OffloadStrategy, get_offload_backend};
    use offload_sim::harness::Rig;
    let w = workload(3, 2);
    let opts = RunOptions::new(DeviceProfile::h200());
    let resident = run(&w, &StrategyChoice::Resident, &opts).unwrap();
    for text in [
        "{}",
        r#"{"pin_cpu_memory": false}"#,
        r#"{"enable_layerwise_offload": false, "enable_cpu_offload": false}"#,
    ] {
        let config = OffloadConfig::from_json_str(text).unwrap();
        let mut rig = Rig::new(w.preset.pipeline.clone(), &opts).unwrap();
        assert!(
            get_offload_backend(&config, &rig.platform)
                .unwrap()
                .is_none()
        );
        let e = rig
            .runtime
            .forward("transformer", |dit| Ok(dit.views()?.len()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no backend is enabled") && e.contains("enable_selected"),
            "{e}"
        );
        rig.runtime
            .enable_selected(&config, &rig.platform)
            .unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(
            rig.runtime.backend().map(|b| b.strategy()),
            Some(OffloadStrategy::None)
        );
        let outputs: Vec<u64> = (0..w.requests)
            .map(|_| rig.request(&w).unwrap().output)
            .collect();
        let expected: Vec<u64> = resident.requests.iter().map(|r| r.output).collect();
        assert_eq!(outputs, expected, "{text}");
        rig.runtime.disable().unwrap();
        assert!(rig.device.violations().is_empty(), "{text}");
    }
    // A configuration that selects a strategy gets that strategy.
    let config = OffloadConfig::from_json_str(r#"{"enable_layerwise_offload": true}"#).unwrap();
    let mut rig = Rig::new(w.preset.pipeline.clone(), &opts).unwrap();
    rig.runtime.enable_selected(&config, &rig.platform).unwrap();
    assert_eq!(
        rig.runtime.backend().map(|b| b.strategy()),
        Some(OffloadStrategy::Layerwise)
    );
    rig.runtime.disable().unwrap();
}

/// `Rig::quick` on a real model's description: it keeps one payload byte
/// in `d` (under 64 MiB in all), so Flux.1-dev (23.8 GB of weights) runs
/// layerwise in a debug test, and the tiny preset keeps every byte.
#[test]
fn the_quick_rig_samples_big_pipelines_only() {
    use offload_core::OffloadConfig;
    use offload_sim::harness::{Rig, component_forward, default_payload_divisor};
    use offload_sim::presets::flux1_dev;
    let flux = flux1_dev();
    assert_eq!(default_payload_divisor(tiny().weight_bytes()), 1);
    assert!(flux.weight_bytes() / default_payload_divisor(flux.weight_bytes()) <= 64 << 20);
    let mut rig = Rig::quick(flux.pipeline.clone()).unwrap();
    let config = OffloadConfig::from_json_str(r#"{"enable_layerwise_offload": true}"#).unwrap();
    rig.runtime.enable_selected(&config, &rig.platform).unwrap();
    let done = component_forward(
        &rig.runtime,
        &rig.probe.output,
        "transformer",
        |_| offload_sim::harness::Charge::default(),
        0,
        || {},
    )
    .unwrap();
    assert!(done.block_bytes > 20_000_000_000, "{done:?}");
    rig.runtime.disable().unwrap();
    assert!(rig.device.violations().is_empty());
}
