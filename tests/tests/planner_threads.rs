//! The planner's search lays its greedy layouts out on rayon's threads
//! (`budget::search`, `Request::solve`): the plan is the one sequential
//! search's, on any number of threads. And what planning takes, per
//! thread count (`--ignored`: a table, no assertion on time).

use std::time::Instant;

use offload_core::budget::{DeviceMemory, RequestPlan, plan_within};
use offload_core::config::{OffloadConfig, WeightCompression};
use offload_core::measurements::PlannerInputs;

/// The H100's saved inputs for Flux.1-dev at 4,608 tokens (the fixture of
/// `planned_decode.rs`).
fn h100_inputs() -> PlannerInputs {
    serde_json::from_str(include_str!(
        "../fixtures/h100-flux1-dev-4608-auto-inputs.json"
    ))
    .expect("the fixture is saved planner inputs")
}

fn plan_on(threads: usize, gib: u64, compression: WeightCompression) -> RequestPlan {
    let preset = offload_sim::presets::flux1_dev();
    let config = OffloadConfig {
        weight_compression: Some(compression),
        ..offload_tests::budget::budget_config(gib << 30)
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a rayon pool");
    pool.install(|| {
        plan_within(
            &preset.pipeline,
            &config,
            &h100_inputs(),
            DeviceMemory::of(u64::MAX / 4),
            None,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    })
}

/// One thread and three give the same plan, to the bit of its predicted
/// time. Seen red with the search's greedy starts cut to what the pool's
/// threads could run at once.
#[test]
fn the_plan_is_the_same_on_any_number_of_threads() {
    for (gib, compression) in [
        (8, WeightCompression::Auto),
        (16, WeightCompression::None),
        (16, WeightCompression::Lossless),
    ] {
        let one = plan_on(1, gib, compression);
        let three = plan_on(3, gib, compression);
        assert_eq!(
            one.predicted_request_s.to_bits(),
            three.predicted_request_s.to_bits(),
            "{gib} GiB {compression:?}: {} s on one thread, {} s on three",
            one.predicted_request_s,
            three.predicted_request_s
        );
        assert_eq!(
            one.to_string(),
            three.to_string(),
            "{gib} GiB {compression:?}"
        );
    }
}

/// What planning Flux.1-dev on the H100's inputs takes, on one thread and
/// on every core (`cargo test --release --test planner_threads --
/// --ignored --nocapture`; BENCHMARKS, "The planner's search on every
/// core").
#[test]
#[ignore = "a benchmark: prints a table"]
fn planning_time() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("| budget | weight_compression | predicted s | 1 thread s | {cores} threads s |");
    println!("| --- | --- | --- | --- | --- |");
    for gib in [8, 16] {
        for compression in [
            WeightCompression::None,
            WeightCompression::Lossless,
            WeightCompression::Auto,
        ] {
            let timed = |threads| {
                let t = Instant::now();
                let p = plan_on(threads, gib, compression);
                (p, t.elapsed().as_secs_f64())
            };
            let (p, one) = timed(1);
            let (_, all) = timed(cores);
            println!(
                "| {gib} GiB | {compression:?} | {:.4} | {one:.2} | {all:.2} |",
                p.predicted_request_s
            );
        }
    }
}
