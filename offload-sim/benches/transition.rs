//! CPU cost of one layerwise block transition (hooks, ring bookkeeping,
//! placement, lending the views) on the null device, for the Flux.1-dev
//! block stack; goal ≤ 5 µs. And simulator throughput: block forwards per
//! second of the simulated device running the tiny preset.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use offload_core::OffloadConfig;
use offload_core::device::Device;
use offload_core::runtime::{CorePlatform, Runtime};
use offload_sim::DeviceProfile;
use offload_sim::harness::{RunOptions, StrategyChoice, Workload, blocks_of, run};
use offload_sim::null::{Null, NullDevice};
use offload_sim::presets::{SyntheticWeights, flux1_dev, tiny};

fn block_transition(c: &mut Criterion) {
    let preset = flux1_dev();
    let device = Arc::new(NullDevice);
    let compute = Arc::new(device.create_stream().unwrap());
    let weights = Arc::new(SyntheticWeights { seed: 0 });
    let platform =
        CorePlatform::<Null>::new("null", Arc::clone(&device), Arc::clone(&compute), weights);
    let config = OffloadConfig {
        enable_layerwise_offload: true,
        ..OffloadConfig::default()
    };
    let mut rt = Runtime::new(device, compute, preset.pipeline.clone());
    let backend = Box::new(platform.layerwise(config).unwrap());
    rt.enable(backend).map_err(|(e, _)| e).unwrap();
    let p = &preset.pipeline;
    let blocks: Vec<String> = blocks_of(p, p.module_id("transformer").unwrap())
        .into_iter()
        .map(|b| p.module(b).path.clone())
        .collect();
    let mut i = 0;
    c.bench_function(
        "layerwise block transition (flux1-dev block, null device)",
        |b| {
            b.iter(|| {
                let path = &blocks[i % blocks.len()];
                i += 1;
                black_box(rt.forward(path, |scope| Ok(scope.views()?.len())).unwrap())
            })
        },
    );
}

fn simulator_throughput(c: &mut Criterion) {
    let preset = tiny();
    let w = Workload {
        tokens: preset.default_tokens,
        preset,
        steps: 4,
        requests: 1,
    };
    let opts = RunOptions::new(DeviceProfile::h200());
    let choice = StrategyChoice::strategy(offload_core::OffloadStrategy::Layerwise);
    let blocks = 7 * 4;
    let mut g = c.benchmark_group("simulator");
    g.throughput(Throughput::Elements(blocks));
    g.bench_function("tiny preset, layerwise, one request of 4 steps", |b| {
        b.iter(|| black_box(run(&w, &choice, &opts).unwrap()))
    });
    g.finish();
}

criterion_group!(benches, block_transition, simulator_throughput);
criterion_main!(benches);
