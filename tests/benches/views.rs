//! Host cost of lending views: `Scope::view(name)` for every tensor of
//! Flux.1-dev's DiT (1,161 tensors; a runtime fetches each weight by name,
//! as models are written) beside one `Scope::views()` of them all, on the
//! null device with the resident backend. Goal: a view by name ≤ 1 µs
//! (it scanned every tensor and built path strings: 23.5 µs).

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use offload_core::OffloadConfig;
use offload_core::device::Device;
use offload_core::runtime::{CorePlatform, Runtime};
use offload_sim::null::{Null, NullDevice};
use offload_sim::presets::{SyntheticWeights, flux1_dev_dit};

fn views(c: &mut Criterion) {
    let pipeline = flux1_dev_dit();
    let device = Arc::new(NullDevice);
    let compute = Arc::new(device.create_stream().unwrap());
    let weights = Arc::new(SyntheticWeights { seed: 0 });
    let platform =
        CorePlatform::<Null>::new("null", Arc::clone(&device), Arc::clone(&compute), weights);
    let mut rt = Runtime::new(device, compute, pipeline.clone());
    rt.enable_selected(&OffloadConfig::default(), &platform)
        .unwrap();
    let dit = pipeline.module_id("transformer").unwrap();
    // Every tensor's name relative to the DiT, as a model reads it.
    let names: Vec<String> = pipeline
        .subtree_tensors(dit)
        .into_iter()
        .map(|t| pipeline.tensor_path(t)["transformer.".len()..].to_owned())
        .collect();
    let mut group = c.benchmark_group("views of flux1-dev's DiT");
    group.throughput(Throughput::Elements(names.len() as u64));
    group.bench_function(
        format!("Scope::view(name), each of {} tensors", names.len()),
        |b| {
            b.iter(|| {
                rt.forward("transformer", |s| {
                    for n in &names {
                        black_box(s.view(n)?);
                    }
                    Ok(())
                })
                .unwrap()
            })
        },
    );
    group.bench_function("Scope::views(), all at once", |b| {
        b.iter(|| {
            rt.forward("transformer", |s| {
                black_box(s.views()?);
                Ok(())
            })
            .unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, views);
criterion_main!(benches);
