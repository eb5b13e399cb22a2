//! The planner's search lays its greedy layouts out on rayon's threads
//! (`budget::search`, `Request::solve`): the plan is the one sequential
//! search's, on any number of threads. And what planning takes, per
//! thread count (`--ignored`: a table, no assertion on time).

use std::time::Instant;

use offload_core::budget::RequestPlan;
use offload_core::config::WeightCompression;
use offload_tests::budget::{h100_flux_inputs, plan_flux};

/// The H100's Flux.1-dev inputs planned on a rayon pool of `threads`.
fn plan_on(threads: usize, gib: u64, compression: WeightCompression) -> RequestPlan {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a rayon pool");
    pool.install(|| {
        plan_flux(&h100_flux_inputs(), gib << 30, compression).unwrap_or_else(|e| panic!("{e}"))
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
