//! Staged masters (CONTRACT §7c) on the simulator: layerwise with
//! `pin_cpu_memory = false`, with a `host_budget` smaller than the streamed
//! weights, and with pinning refused by the device on every fifth request
//! runs to the end bit-identical to resident, with no checker violation,
//! the device's own pinned + registered peak within the budget, and every
//! staged block named in the log; the staging ring's one ordering (the host
//! refills a staging buffer only after the copy that read it) is seen by
//! the device's happens-before checker when a planted bug drops it.

use offload_core::bytes::{ByteSize, HostBudget};
use offload_core::config::OffloadConfig;
use offload_core::invariants::Invariant;
use offload_core::runtime::PlantedBug;
use offload_sim::FaultPlan;
use offload_sim::harness::{RunOptions, RunOutcome, StrategyChoice, Workload, run};
use offload_tests::capture_logs;

fn workload() -> Workload {
    offload_tests::tiny_wide_workload()
}

fn opts(bugs: &[PlantedBug], depth: usize, jitter: Option<u64>) -> RunOptions {
    offload_tests::trained_opts(bugs, depth, jitter)
}

use offload_tests::{host_peak, staged_layerwise as layerwise};

use offload_tests::{all_violations, outputs};

fn resident() -> Vec<u64> {
    outputs(&run(&workload(), &StrategyChoice::Resident, &opts(&[], 1, None)).unwrap())
}

/// One copy of the streamed blocks and the largest resident unit, from a
/// plain layerwise run's bounds.
fn sizes() -> (u64, u64, u64) {
    let o = run(&workload(), &layerwise(None, None), &opts(&[], 1, None)).unwrap();
    let b = o.bounds;
    (
        b.offloaded_bytes,
        b.staging_ring_bytes,
        b.staging_bytes - b.host_staging_bytes,
    )
}

#[test]
fn every_master_staged_is_bit_identical_and_pins_only_the_ring() {
    let want = resident();
    let (streamed, ring, transient) = sizes();
    for depth in [1, 2, 3] {
        for jitter in [None, Some(1), Some(2)] {
            let (o, log) = capture_logs(|| {
                run(
                    &workload(),
                    &layerwise(Some(false), None),
                    &opts(&[], depth, jitter),
                )
                .unwrap()
            });
            assert_eq!(outputs(&o), want, "depth {depth}, jitter {jitter:?}");
            assert!(all_violations(&o).is_empty(), "{:#?}", all_violations(&o));
            // Pinned: the ring and one resident unit's upload at a time,
            // nothing of the streamed weights.
            assert!(
                host_peak(&o) <= ring + transient,
                "pinned peak {} > ring {ring} + upload {transient}",
                host_peak(&o)
            );
            assert!(host_peak(&o) < streamed / 2, "the masters stay pageable");
            assert!(
                log.contains("streams staged (pin_cpu_memory = false)"),
                "the log names the staged blocks: {log}"
            );
        }
    }
}

#[test]
fn a_host_budget_pins_what_fits_and_stages_the_rest() {
    let want = resident();
    let (streamed, ring, transient) = sizes();
    for share in [0.0, 0.3, 0.6, 0.95] {
        let budget = ring + transient + (share * streamed as f64) as u64;
        for depth in [1, 2] {
            let o = run(
                &workload(),
                &layerwise(None, Some(budget)),
                &opts(&[], depth, Some(7)),
            )
            .unwrap();
            assert_eq!(outputs(&o), want, "share {share}, depth {depth}");
            assert!(all_violations(&o).is_empty(), "{:#?}", all_violations(&o));
            assert!(
                host_peak(&o) <= budget,
                "share {share}: pinned + registered peak {} > budget {budget}",
                host_peak(&o)
            );
            assert!(
                host_peak(&o) >= (share * streamed as f64) as u64 / 2,
                "share {share}: the budget is used ({} pinned)",
                host_peak(&o)
            );
        }
    }
    // A budget the whole model fits in stages nothing.
    let o = run(
        &workload(),
        &layerwise(None, Some(4 * streamed)),
        &opts(&[], 1, None),
    )
    .unwrap();
    assert!(host_peak(&o) >= streamed, "everything pinned");
}

#[test]
fn a_host_budget_below_the_least_plan_is_a_typed_error() {
    let (_, ring, transient) = sizes();
    let least = ring + transient;
    let Err(e) = run(
        &workload(),
        &layerwise(None, Some(least - 1)),
        &opts(&[], 1, None),
    ) else {
        panic!("a host budget below {least} B was accepted");
    };
    let text = e.to_string();
    assert!(
        text.contains("host_budget") && text.contains("at least"),
        "{text}"
    );
}

#[test]
fn host_budget_outside_layerwise_is_refused_with_where_it_works() {
    for json in [
        r#"{"enable_cpu_offload": true, "host_budget": "8GiB"}"#,
        r#"{"enable_distributed_layerwise_offload": true, "host_budget": "auto"}"#,
    ] {
        let c = OffloadConfig::from_json_str(json).unwrap();
        let e = c.select().unwrap_err().to_string();
        assert!(
            e.contains("host_budget")
                && e.contains("layerwise offload (enable_layerwise_offload = true) or a device_budget (the request planner) only"),
            "{json}: {e}"
        );
    }
    // The request planner takes it beside its device budget.
    let c = OffloadConfig::from_json_str(r#"{"device_budget": "16GiB", "host_budget": "8GiB"}"#)
        .unwrap();
    assert!(c.select().is_ok(), "{:?}", c.select());
    for bad in [r#""0""#, r#""8 gigs""#, "-1", r#""Auto""#] {
        let json = format!(r#"{{"enable_layerwise_offload": true, "host_budget": {bad}}}"#);
        let e = OffloadConfig::from_json_str(&json).unwrap_err().to_string();
        assert!(
            e.contains("host_budget") && e.contains("allowed"),
            "{bad}: {e}"
        );
    }
    let toml =
        OffloadConfig::from_toml_str("enable_layerwise_offload = true\nhost_budget = \"8GiB\"\n")
            .unwrap();
    assert_eq!(
        toml.host_budget,
        Some(HostBudget::Bytes(ByteSize::new(8 << 30)))
    );
    // Unpinned masters elsewhere: refused, naming where false works.
    let c =
        OffloadConfig::from_json_str(r#"{"enable_cpu_offload": true, "pin_cpu_memory": false}"#)
            .unwrap();
    assert!(c.select().is_ok(), "selection itself accepts it");
}

#[test]
fn refused_pins_stream_staged_and_the_log_names_each_block() {
    let want = resident();
    for every in [5, 7, 4] {
        let o_opts = RunOptions {
            faults: FaultPlan {
                refuse_pin_every: Some(every),
                ..FaultPlan::none()
            },
            ..opts(&[], 2, Some(3))
        };
        let (o, log) = capture_logs(|| run(&workload(), &layerwise(None, None), &o_opts).unwrap());
        assert!(o.at_end.pins_refused > 0, "every {every}: the fault fired");
        assert_eq!(outputs(&o), want, "every {every}");
        assert!(all_violations(&o).is_empty(), "{:#?}", all_violations(&o));
        let named = log
            .matches("streams staged (pinning or registration refused)")
            .count();
        assert!(named > 0, "every {every}: {log}");
        assert!(
            log.contains("was refused"),
            "the refusal's cause is logged: {log}"
        );
    }
}

/// Fault plans refusing each of `requests` pin requests alone (a re-plan
/// asks again, and may be granted), then every n-th for n from 2 to
/// `every` (a platform that keeps refusing).
fn pin_refusals(requests: u64, every: u64) -> Vec<FaultPlan> {
    (1..=requests)
        .map(|k| FaultPlan {
            refuse_pins: Some((k, k)),
            ..FaultPlan::none()
        })
        .chain((2..=every).map(|n| FaultPlan {
            refuse_pin_every: Some(n),
            ..FaultPlan::none()
        }))
        .collect()
}

/// Every pin request of a clean run at `config` refused in turn: each run
/// ends bit-identical to `want` within `host` on the device's own
/// page-locked count, with no checker violation, a refused block named in
/// the log; or `enable` fails typed (no choice of staged blocks fits what
/// the device allowed). With `KeepPinsBesideRefused` planted, every run
/// over the budget is flagged by INV-7. A run whose refused pin was a
/// swapped held unit's (brought in from pageable memory at each phase,
/// CONTRACT §7c) runs again with `StagedBringInSkipsCopy` planted, which
/// must not pass: its output differs from `want` or a checker reports it.
/// Returns (runs within with a block staged, typed errors, planted runs
/// over the budget, runs with a swapped held unit staged whose plant was
/// caught).
fn refuse_each_pin(
    w: &Workload,
    config: &StrategyChoice,
    given: &RunOptions,
    want: &[u64],
    host: u64,
) -> (usize, usize, usize, usize) {
    let clean = run(w, config, given).unwrap_or_else(|f| panic!("clean: {}", f.error));
    assert!(host_peak(&clean) <= host, "clean: {}", host_peak(&clean));
    // Each request alone (a re-plan asks again, and may be granted), then
    // every n-th (a platform that keeps refusing).
    let requests = clean.at_end.pin_requests;
    let faults = pin_refusals(requests, 7);
    let refusing = |k: usize, bugs: Vec<PlantedBug>| RunOptions {
        faults: faults[k],
        bugs,
        ..given.clone()
    };
    let (mut within, mut typed, mut over, mut restaged, mut held) = (0, 0, 0, 0, 0);
    for k in 0..faults.len() {
        let (o, log) = capture_logs(|| run(w, config, &refusing(k, Vec::new())));
        match o {
            Ok(o) => {
                offload_tests::assert_staged_run(
                    &o,
                    want,
                    host,
                    &format!("fault plan {k} refused"),
                );
                if o.at_end.pins_refused > 0 && log.contains("streams staged") {
                    assert!(log.contains("was refused"), "{log}");
                    within += 1;
                }
                if log.contains("streams staged (beyond the host budget: the staging ring a refused pin needs takes its room)") {
                    restaged += 1;
                }
                // A swapped held unit staged when its phase state was built
                // (a re-plan may pin it again): its refusal named too.
                if log.contains("is brought in from pageable memory at each of its phases") {
                    assert!(
                        log.contains("its phase brings it in from pageable memory each time"),
                        "fault plan {k}: the refused held unit is named: {log}"
                    );
                    let planted = run(
                        w,
                        config,
                        &refusing(k, vec![PlantedBug::StagedBringInSkipsCopy]),
                    );
                    let caught = match &planted {
                        Ok(p) => outputs(p) != want || !all_violations(p).is_empty(),
                        Err(f) => !f.violations.is_empty(),
                    };
                    assert!(
                        caught,
                        "planted StagedBringInSkipsCopy, fault plan {k}: the unwritten bring-in passed"
                    );
                    held += 1;
                }
            }
            Err(f) => {
                // No choice of staged blocks fits what the device allowed:
                // every refused pin, a held unit's too, stages.
                let e = f.error.to_string();
                assert!(
                    e.contains("room for what the device allowed"),
                    "fault plan {k} refused: not a typed error of the host budget: {e}"
                );
                typed += 1;
            }
        }
        if let Ok(o) = run(
            w,
            config,
            &refusing(k, vec![PlantedBug::KeepPinsBesideRefused]),
        ) && host_peak(&o) > host
        {
            assert!(
                all_violations(&o)
                    .iter()
                    .any(|v| v.invariant == Invariant::BoundedMemory),
                "planted, fault plan {k}: {} pinned over {host} and INV-7 saw nothing",
                host_peak(&o)
            );
            over += 1;
        }
    }
    eprintln!(
        "{requests} pin requests, {} fault plans: {within} refused and staged within the budget ({restaged} staging more to make room, {held} a swapped held unit brought in staged), {typed} typed errors, planted: {over} over the budget",
        faults.len()
    );
    assert!(
        restaged >= 1,
        "some refusal made the store stage more blocks"
    );
    (within, typed, over, held)
}

/// Layerwise at a host budget that its plan fits with every block pinned
/// (no staging ring held): a refused pin needs a ring of two of its block,
/// so a further block stages to make the room (CONTRACT §7c).
#[test]
fn refused_pins_under_a_layerwise_host_budget_stay_within_it() {
    let want = resident();
    let (offloaded, _, transient) = sizes();
    let host = offloaded + transient;
    let (within, _, over, _) = refuse_each_pin(
        &workload(),
        &layerwise(None, Some(host)),
        &opts(&[], 2, Some(3)),
        &want,
        host,
    );
    assert!(
        within >= 2,
        "refused blocks staged within the budget: {within}"
    );
    assert!(
        over >= 1,
        "the planted bug went over the budget somewhere: {over}"
    );
}

/// A run of `config` under `o` over trained weights that count their
/// `release` calls: the outcome, the count and the units released.
fn run_counting_releases(
    w: &Workload,
    config: &StrategyChoice,
    o: &RunOptions,
) -> (
    Result<RunOutcome, offload_sim::harness::RunFailure>,
    usize,
    std::collections::BTreeSet<String>,
) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let releases = Arc::new(AtomicUsize::new(0));
    let released = Arc::default();
    let source = Arc::new(offload_tests::CountsReleases {
        inner: offload_sim::presets::TrainedWeights::new(o.seed, &w.preset.pipeline),
        releases: Arc::clone(&releases),
        released: Arc::clone(&released),
    });
    let out = offload_sim::harness::Rig::with_weights(w.preset.pipeline.clone(), o, source)
        .map_err(|error| panic!("rig: {error}"))
        .and_then(|rig| {
            offload_sim::harness::drive(
                rig,
                config,
                &config.config(),
                o,
                w.requests,
                |rig| rig.request(w),
                |_| {},
            )
        });
    let names = released.lock().unwrap().clone();
    (out, releases.load(Ordering::SeqCst), names)
}

/// The streamed blocks of `config` with every master staged
/// (`pin_cpu_memory = false`), as its log names them.
fn streamed_units(
    w: &Workload,
    config: OffloadConfig,
    o: &RunOptions,
) -> std::collections::BTreeSet<String> {
    let unpinned = StrategyChoice::Config(OffloadConfig {
        pin_cpu_memory: Some(false),
        host_budget: None,
        ..config
    });
    let (out, log) = capture_logs(|| run(w, &unpinned, o));
    out.unwrap_or_else(|f| panic!("unpinned: {}", f.error));
    log.lines()
        .filter(|l| l.contains("streams staged"))
        .filter_map(|l| l.split('`').nth(1).map(str::to_owned))
        .collect()
}

/// A plan that pins every streamed block releases no page; where the
/// device refuses pins it counted on, the refused blocks' pages stay
/// mapped beside the pins that held, more than the budget has room for, so
/// the engine releases staged pages after each read (CONTRACT §7c), and
/// the pinned copies' source pages with them, though the plan did not:
/// every fault plan that refuses a pin releases every streamed block's
/// pages, the run bit-identical to resident within the budget. At a budget
/// with room for the refused blocks' pages nothing is released, refused or
/// not, nor without a host budget. Seen red (2026-12-04) with the release
/// taken from the plan alone (no release in any refusing run), and with
/// the pinned copies' pages kept (their units never released).
#[test]
fn refused_pins_release_staged_pages_when_the_budget_has_no_room_for_them() {
    let want = resident();
    let (offloaded, _, transient) = sizes();
    let host = offloaded + transient;
    let o = opts(&[], 2, Some(3));
    let (clean, released, _) = run_counting_releases(&workload(), &layerwise(None, Some(host)), &o);
    let clean = clean.unwrap_or_else(|f| panic!("clean: {}", f.error));
    assert_eq!(outputs(&clean), want);
    assert_eq!(released, 0, "a plan that pins every block releases nothing");
    let blocks = streamed_units(&workload(), layerwise(None, None).config(), &o);
    assert!(blocks.len() >= 4, "{blocks:?}");
    let refusing = refusals_release(
        &workload(),
        [
            (&layerwise(None, Some(host)), host, Some(&blocks)),
            (&layerwise(None, Some(2 * host)), 2 * host, None),
            (&layerwise(None, None), u64::MAX, None),
        ],
        &o,
        &want,
    );
    assert!(refusing >= 3, "refusing runs that staged: {refusing}");
}

/// Every 2nd, 3rd and 5th pin refused under each of `configs` (a config,
/// its host budget, and the units it must release, `None`: none): each run
/// completes bit-identical to `want` within the budget, or fails with the
/// typed error of a host budget no choice of staged blocks fits (a refused
/// pin itself never fails a run); a completed run with
/// a pin refused released exactly what it must. Returns the runs of the
/// first config with a pin refused.
fn refusals_release(
    w: &Workload,
    configs: [(
        &StrategyChoice,
        u64,
        Option<&std::collections::BTreeSet<String>>,
    ); 3],
    o: &RunOptions,
    want: &[u64],
) -> usize {
    let mut refusing = 0;
    for every in [2, 3, 5] {
        let faulty = RunOptions {
            faults: FaultPlan {
                refuse_pin_every: Some(every),
                ..FaultPlan::none()
            },
            ..o.clone()
        };
        for (i, (config, host, must)) in configs.into_iter().enumerate() {
            let (out, released, names) = run_counting_releases(w, config, &faulty);
            let out = match out {
                Ok(out) => out,
                Err(f) => {
                    // Every refused pin stages (with or without a host
                    // budget): only a budget no choice of staged blocks
                    // fits fails, typed.
                    let e = f.error.to_string();
                    assert!(
                        e.contains("room for what the device allowed"),
                        "config {i}, every {every}: not a typed error of the host budget: {e}"
                    );
                    continue;
                }
            };
            assert_eq!(outputs(&out), want, "config {i}, every {every}");
            assert!(
                all_violations(&out).is_empty(),
                "{:#?}",
                all_violations(&out)
            );
            assert!(host_peak(&out) <= host, "config {i}, every {every}");
            if out.at_end.pins_refused == 0 {
                continue;
            }
            match must {
                Some(units) => {
                    assert!(
                        released > 0 && units.iter().all(|u| names.contains(u)),
                        "config {i}, every {every}: {} pins refused; released {names:?} of {units:?}",
                        out.at_end.pins_refused
                    );
                    refusing += 1;
                }
                None => assert_eq!(
                    released, 0,
                    "config {i}, every {every}: room for the refused blocks, yet pages released"
                ),
            }
        }
    }
    refusing
}

#[test]
fn planted_staging_reuse_before_copy_is_caught_and_its_control_is_clean() {
    let bug = PlantedBug::HostStagingReuseBeforeCopy;
    let want = resident();
    let mut caught = false;
    for depth in [1, 2, 3] {
        for jitter in [None, Some(1), Some(2), Some(3)] {
            let clean = run(
                &workload(),
                &layerwise(Some(false), None),
                &opts(&[], depth, jitter),
            )
            .unwrap();
            assert!(all_violations(&clean).is_empty(), "control, depth {depth}");
            assert_eq!(outputs(&clean), want, "control, depth {depth}");
            let o = run(
                &workload(),
                &layerwise(Some(false), None),
                &opts(&[bug], depth, jitter),
            )
            .unwrap();
            caught |= o
                .violations
                .iter()
                .any(|v| v.invariant == Invariant::NoEarlyFree)
                || outputs(&o) != want;
        }
    }
    assert!(caught, "{bug:?}: neither the checker nor the output saw it");
}

/// The filler on a thread of its own (as on a GPU: the simulator's
/// `host_threads`), filling the next staged block while the engine copies
/// the current one: bit-identical to resident with no violation, for every
/// master staged and under a budget, at depths 1–3, with a caller that
/// goes on issuing and with one that waits at each step's end (the ring's
/// last post-forward then issues the queue, polling the filler's stages,
/// CONTRACT §7c); and the planted
/// `HostStagingReuseBeforeCopy` (the filler does not wait for the copy that
/// last read its buffer) is seen by the checker or the output.
#[test]
fn the_threaded_filler_is_bit_identical_and_its_planted_reuse_is_caught() {
    let want = resident();
    let (streamed, ring, transient) = sizes();
    let threaded = |bugs: &[PlantedBug], depth, jitter| RunOptions {
        host_threads: true,
        ..opts(bugs, depth, jitter)
    };
    for depth in [1, 2, 3] {
        for (pin, budget) in [
            (Some(false), None),
            (None, Some(ring + transient + streamed / 2)),
        ] {
            for (jitter, step_sync) in [(None, false), (Some(5), false), (None, true)] {
                let o = run(
                    &workload(),
                    &layerwise(pin, budget),
                    &RunOptions {
                        step_sync,
                        ..threaded(&[], depth, jitter)
                    },
                )
                .unwrap();
                assert_eq!(
                    outputs(&o),
                    want,
                    "depth {depth}, {pin:?}/{budget:?}, step sync {step_sync}"
                );
                assert!(all_violations(&o).is_empty(), "{:#?}", all_violations(&o));
            }
        }
    }
    let bug = PlantedBug::HostStagingReuseBeforeCopy;
    let mut caught = 0;
    for depth in [1, 2, 3] {
        for jitter in [None, Some(1), Some(2)] {
            let o = run(
                &workload(),
                &layerwise(Some(false), None),
                &threaded(&[bug], depth, jitter),
            )
            .unwrap();
            if o.violations
                .iter()
                .any(|v| v.invariant == Invariant::NoEarlyFree)
                || outputs(&o) != want
            {
                caught += 1;
            }
        }
    }
    assert!(caught > 0, "{bug:?} with the threaded filler: never seen");
}

/// A staging fill that panics (inside the weight source, on the filler's
/// thread or the hook's) never hangs the ring nor unwinds through it: the
/// request fails with a typed error naming the block whose fill panicked,
/// inline and with the threaded filler, at depths 1 and 2 (each run on a
/// thread of its own with a deadline, so a hang is a failure, not a stuck
/// CI). Seen red (2026-12-02): with the fill's `catch_unwind` removed from
/// `runtime/filler.rs::run`, the test process aborts (SIGABRT: the panic
/// unwinds through the stage's lock and the ring's drop).
#[test]
fn a_staging_fill_that_panics_fails_the_request_typed_and_never_hangs() {
    for threads in [false, true] {
        for depth in [1, 2] {
            let at = format!("threads {threads}, depth {depth}");
            let make = move || {
                let o = RunOptions {
                    host_threads: threads,
                    ..opts(&[], depth, None)
                };
                (workload(), o, layerwise(Some(false), None))
            };
            let (first, _) = offload_tests::failing_fill_run(make, 0, false)
                .unwrap_or_else(|e| panic!("{at}: {e}"));
            let e = first.unwrap_or_else(|| panic!("{at}: the request succeeded"));
            assert!(e.contains("panicked") && e.contains("blocks."), "{at}: {e}");
        }
    }
}

/// The ring engine's forecast of a staged step (CONTRACT §7c,
/// `Backend::staged_forecast`): with every master staged, after a request,
/// one forecast per ring that stages, its staged blocks and bytes those of
/// the streamed weights, at a finite fill rate the engine measured from
/// its own fills, never shorter than any of its bounds (compute, the link,
/// the host's fills) nor longer than all three in series, and naming the
/// bound it sits on. Without planner inputs it is a typed error naming
/// them, and the same forecast given inputs; a fully pinned ring forecasts
/// nothing. It forecasts with the ring's own staging buffers (two here;
/// one where the second is refused, which `forecast_staged` times as fills
/// serialised with the copies: the ring unit test). Seen red (2026-12-02)
/// with the host stage left out of `forecast_staged`: the forecast fell
/// below the host's fills.
#[test]
fn the_staged_forecast_reads_the_fills_the_engine_ran() {
    use offload_core::budget::StagedForecast;
    use offload_sim::DeviceProfile;
    let w = workload();
    let (streamed, _, _) = sizes();
    let inputs =
        offload_sim::plan::estimated_inputs(&w.preset, &DeviceProfile::h200(), w.tokens, 3);
    type Seen = Vec<Result<Vec<(String, StagedForecast)>, String>>;
    type Chosen = Vec<Result<Vec<(String, offload_core::budget::Lookahead)>, String>>;
    let chosen: std::cell::RefCell<[Chosen; 3]> = Default::default();
    let forecasts = |pin: Option<bool>,
                     planner: Option<offload_core::budget::PlannerInputs>,
                     faults: FaultPlan| {
        let o = RunOptions {
            planner,
            faults,
            ..opts(&[], 2, None)
        };
        let choice = layerwise(pin, None);
        let StrategyChoice::Config(config) = &choice else {
            unreachable!()
        };
        let rig = offload_sim::harness::Rig::new(w.preset.pipeline.clone(), &o).unwrap();
        let mut seen: Seen = Vec::new();
        let mut given = Vec::new();
        let out = offload_sim::harness::drive(
            rig,
            &choice,
            config,
            &o,
            w.requests,
            |rig| {
                let m = rig.request(&w)?;
                let b = rig.runtime.backend().expect("enabled");
                seen.push(b.staged_forecast(None).map_err(|e| e.to_string()));
                given.push(b.staged_forecast(Some(&inputs)).map_err(|e| e.to_string()));
                let mut c = chosen.borrow_mut();
                for (k, depth) in [2, 16, 0].into_iter().enumerate() {
                    c[k].push(b.staged_lookahead(None, depth).map_err(|e| e.to_string()));
                }
                Ok(m)
            },
            |_| {},
        )
        .unwrap_or_else(|f| panic!("{}", f.error));
        assert!(all_violations(&out).is_empty());
        (seen, given)
    };
    let (seen, given) = forecasts(Some(false), Some(inputs.clone()), FaultPlan::none());
    assert_eq!(seen.len(), w.requests);
    // The staged look-ahead (`Backend::staged_lookahead`) reads the same
    // rings and inputs: up to depth 2 its rule picks depth 2, whose
    // forward is the forecast's at the engine's depth 2, and its limit is
    // the staged path's. Up to 16 a depth in range; a max_depth of 0 is a
    // typed error naming it.
    let [upto2, upto16, zero] = chosen.take();
    for ((f, l2), l16) in seen.iter().zip(&upto2).zip(&upto16) {
        let (f, l2, l16) = (
            f.as_ref().unwrap(),
            l2.as_ref().unwrap(),
            l16.as_ref().unwrap(),
        );
        assert_eq!(
            f.iter().map(|(r, _)| r).collect::<Vec<_>>(),
            l2.iter().map(|(r, _)| r).collect::<Vec<_>>()
        );
        for (((ring, f), (_, l)), (_, deep)) in f.iter().zip(l2).zip(l16) {
            assert_eq!((l.depth, l.slots), (2, 3), "{ring}: {l:?}");
            assert!(l.slot_bytes > 0, "{ring}: {l:?}");
            assert!(
                (l.predicted_step_s - f.forward_s).abs() <= 1e-12 * f.forward_s,
                "{ring}: {l:?} against {f:?}"
            );
            let limit = f.compute_s.max(f.link_s).max(f.fills_s);
            assert!((l.limit_s - limit).abs() <= 1e-12 * limit, "{ring}: {l:?}");
            assert!((1..=16).contains(&deep.depth), "{ring}: {deep:?}");
            assert_eq!(deep.limit_s, l.limit_s, "{ring}");
        }
    }
    for e in &zero {
        let e = e.as_ref().unwrap_err();
        assert!(e.contains("max_depth"), "{e}");
    }
    for (f, g) in seen.iter().zip(&given) {
        let f = f.as_ref().unwrap();
        assert_eq!(f, g.as_ref().unwrap(), "the platform's inputs are these");
        assert!(!f.is_empty(), "every ring stages");
        assert_eq!(f.iter().map(|(_, f)| f.staged_bytes).sum::<u64>(), streamed);
        for (ring, f) in f {
            let bound = f.compute_s.max(f.link_s).max(f.fills_s);
            assert!(
                f.fill_bytes_per_s.is_finite() && f.fill_bytes_per_s > 0.0,
                "{ring}: {f:?}"
            );
            assert!(f.forward_s >= bound * (1.0 - 1e-9), "{ring}: {f:?}");
            assert!(
                f.forward_s
                    <= f.compute_s * (1.0 + inputs.copy_interference) + f.link_s + f.fills_s,
                "{ring}: {f:?}"
            );
            assert_eq!(f.depth, 2);
            assert_eq!(f.buffers, 2, "{ring}: the ring's two staging buffers");
            assert!(["compute", "the link", "the host's fills"].contains(&f.bound()));
        }
    }
    let (seen, given) = forecasts(Some(false), None, FaultPlan::none());
    for (f, g) in seen.iter().zip(&given) {
        let e = f.as_ref().unwrap_err();
        assert!(e.contains("planner inputs"), "{e}");
        assert!(!g.as_ref().unwrap().is_empty());
    }
    let (seen, _) = forecasts(None, Some(inputs.clone()), FaultPlan::none());
    assert!(seen.iter().all(|f| f.as_ref().unwrap().is_empty()));
    // Every master staged, the second staging buffer refused each of the
    // three times it is asked for (pin requests 2–4, the first being the
    // first buffer's): the ring runs on one, and the forecast says so.
    let ((seen, _), log) = capture_logs(|| {
        forecasts(
            Some(false),
            Some(inputs.clone()),
            FaultPlan {
                refuse_pins: Some((2, 4)),
                ..FaultPlan::none()
            },
        )
    });
    assert!(log.contains("host staging buffer 2 of"), "{log}");
    for f in &seen {
        for (ring, f) in f.as_ref().unwrap() {
            assert_eq!(f.buffers, 1, "{ring}: the ring's one staging buffer");
        }
    }
}

/// Only a refused pin (or registration) of an upload's transient master
/// sends the upload through a staging buffer: an allocation failing at any
/// point of `enable`, whether a pinned buffer's (then staged, logged as
/// refused, and the uploads after it through the same ring, asking for no
/// pin) or a device buffer's (then `enable`'s typed error, never called a
/// refused pin), and every run's outputs equal resident or its error
/// typed. Seen red with the uploads after a refused one pinning again (17
/// pins asked at every refusal, 16 without a fault). Found by review
/// (2026-12-03): a failed `alloc_device` of a resident unit was logged as
/// "pinning … for its upload was refused" and retried through a pinned
/// ring, hiding the device's out-of-memory.
#[test]
fn only_a_refused_pin_sends_an_upload_through_a_staging_buffer() {
    let want = resident();
    // Pins asked for by a run without a fault: one per master and upload.
    let asked = run(&workload(), &layerwise(None, None), &opts(&[], 2, None))
        .unwrap()
        .at_end
        .pin_requests;
    let mut staged_uploads = 0;
    let mut fewer = 0;
    for at in 1..=24u64 {
        let o = RunOptions {
            faults: FaultPlan {
                fail_alloc_at: Some(at),
                ..FaultPlan::none()
            },
            ..opts(&[], 2, None)
        };
        let (out, log) = capture_logs(|| run(&workload(), &layerwise(None, None), &o));
        for line in log
            .lines()
            .filter(|l| l.contains("for its upload was refused"))
        {
            staged_uploads += 1;
            assert!(
                !line.contains("alloc_device"),
                "allocation {at}: a device allocation called a refused pin: {line}"
            );
        }
        let refused = log.contains("for its upload was refused");
        match out {
            Ok(out) => {
                assert_eq!(outputs(&out), want, "allocation {at}");
                // After a refused upload pin the uploads that follow go
                // through the ring made for it and ask for no pin: at most
                // the ring's one more than without a fault, fewer where
                // uploads follow.
                if refused {
                    let n = out.at_end.pin_requests;
                    assert!(
                        n <= asked + 1,
                        "allocation {at}: {n} pins asked, {asked} without a fault"
                    );
                    fewer += usize::from(n <= asked);
                }
            }
            Err(f) => assert!(!f.error.to_string().is_empty(), "allocation {at}"),
        }
    }
    assert!(
        staged_uploads > 0,
        "some upload's pin was refused and staged"
    );
    assert!(fewer > 0, "uploads after a refused one asked for no pin");
}

// ---------------------------------------------------------------------
// A host budget beside a device budget: the request planner plans both
// (CONTRACT §7a, §7c).

use offload_core::budget::{BudgetError, DeviceMemory, PlannerInputs, plan_within};
use offload_sim::DeviceProfile;

/// The `tiny` preset's workload (2 requests of 3 steps) on the simulated
/// H200, its resident outputs and its estimated planner inputs.
fn planned_baseline() -> (Workload, RunOptions, Vec<u64>, PlannerInputs) {
    baseline_of(offload_sim::presets::tiny())
}

/// [`planned_baseline`] of `preset`.
fn baseline_of(
    preset: offload_sim::presets::Preset,
) -> (Workload, RunOptions, Vec<u64>, PlannerInputs) {
    let w = Workload {
        tokens: preset.default_tokens,
        preset,
        steps: 3,
        requests: 2,
    };
    let opts = RunOptions::new(DeviceProfile::h200());
    let resident = run(&w, &StrategyChoice::Resident, &opts).unwrap();
    let inputs = offload_sim::plan::estimated_inputs(&w.preset, &opts.profile, w.tokens, 3);
    (w, opts, outputs(&resident), inputs)
}

use offload_tests::budget::{budgets, least_device, least_host, limits, warmup_least_host};

/// Device and host budgets from the least of each to everything, run on the
/// simulated device through its own warm-up: outputs identical to resident,
/// no checker violation (INV-7 per phase and on the host, its host bound
/// the plan's budget), the device's own pinned + registered peak within the
/// host budget, the plan's host side within it and naming what it stages,
/// and the log naming each staged block and each kept set uploaded from
/// pageable memory.
#[test]
fn a_device_and_a_host_budget_are_planned_together_and_hold_on_the_device() {
    let (w, opts, want, inputs) = planned_baseline();
    let least_device = least_device(&w, &inputs);
    let total = w.preset.weight_bytes();
    let (mut staged_seen, mut kept_seen) = (0, 0);
    let warmup = warmup_least_host(&w);
    for device in [least_device + (total - least_device) / 4, total + 100_000] {
        // From the least this device budget's plans need (through saved
        // measurements where the warm-up needs more) to every weight.
        let least_host = least_host(&w, &inputs, device);
        for k in 0..=4u64 {
            let host = least_host + (total - least_host) * k / 4;
            let given = RunOptions {
                planner: (host < warmup).then(|| inputs.clone()),
                ..opts.clone()
            };
            let (o, log) = capture_logs(|| {
                run(
                    &w,
                    &StrategyChoice::Config(budgets(device, Some(host))),
                    &given,
                )
            });
            let o = o.unwrap_or_else(|f| panic!("device {device}, host {host}: {}", f.error));
            let plan = o.plan.as_ref().expect("a planned run has its plan");
            let side = plan.host.as_ref().expect("a host budget is planned");
            assert_eq!(outputs(&o), want, "device {device}, host {host}\n{plan}");
            assert!(
                all_violations(&o).is_empty(),
                "device {device}, host {host}: {:#?}",
                all_violations(&o)
            );
            assert_eq!(offload_sim::job::phase_violations(&o), None);
            assert_eq!(
                o.bounds.host_budget_bytes,
                Some(host),
                "INV-7 checks the budget"
            );
            assert!(
                host_peak(&o) <= host,
                "device {device}, host {host}: the device's pinned + registered peak {} is over\n{plan}",
                host_peak(&o)
            );
            if host < warmup {
                // No warm-up: what the device pinned is what the plan
                // said it would, at most.
                assert!(
                    host_peak(&o) <= side.peak_bytes,
                    "device {device}, host {host}: pinned {} beyond the plan's {side}",
                    host_peak(&o)
                );
            }
            if !side.kept_staged.is_empty() {
                kept_seen += 1;
                assert!(
                    log.contains("is kept on the device, uploaded once from pageable memory"),
                    "the log names the kept sets staged: {log}"
                );
            }
            if !side.staged_blocks.is_empty() {
                staged_seen += 1;
                for b in &side.staged_blocks {
                    assert!(
                        log.contains(&format!("{b}` streams staged")),
                        "the log names staged `{b}`: {log}"
                    );
                }
            }
        }
    }
    assert!(
        staged_seen >= 2 && kept_seen >= 2,
        "the smaller host budgets stage blocks ({staged_seen}) and kept sets ({kept_seen})"
    );

    // Planted: the store pins what the plan stages. INV-7 on the device's
    // own page-locked count sees it; the clean runs above did not.
    // (From saved measurements: the least host budget of the tighter
    // device budget is below the weights, which the warm-up's is not.)
    let planted = RunOptions {
        bugs: vec![PlantedBug::PlannedPinsStagedBlocks],
        planner: Some(inputs.clone()),
        ..opts.clone()
    };
    let device = least_device + (total - least_device) / 4;
    let least_host = least_host(&w, &inputs, device);
    assert!(least_host < total, "{least_host} B");
    let o = run(
        &w,
        &StrategyChoice::Config(budgets(device, Some(least_host))),
        &planted,
    )
    .unwrap_or_else(|f| panic!("planted: {}", f.error));
    assert_eq!(outputs(&o), want, "the planted bug is a memory bug");
    assert!(
        host_peak(&o) > least_host,
        "planted: {} pinned",
        host_peak(&o)
    );
    assert!(
        all_violations(&o)
            .iter()
            .any(|v| v.invariant == Invariant::BoundedMemory),
        "planted PlannedPinsStagedBlocks: INV-7 saw nothing: {:#?}",
        all_violations(&o)
    );
}

/// Where the device has room for every weight, a host budget far below
/// the weights costs the plan nothing: every component is kept on the
/// device (a kept set is uploaded once from pageable memory and pins
/// nothing), as without a host budget, and the run pins at most the
/// upload buffer beside it. Below the device's room, the host budget binds:
/// swapped held sets keep pinned masters, so the planner holds no more
/// than the host budget leaves.
#[test]
fn a_host_budget_keeps_on_the_device_what_it_cannot_pin() {
    let (w, opts, want, inputs) = planned_baseline();
    let total = w.preset.weight_bytes();
    let device = DeviceMemory::of(u64::MAX / 4);
    let p = &w.preset.pipeline;
    let room = total + 100_000;
    let host = least_host(&w, &inputs, room);
    assert!(
        host < total / 2,
        "the least host budget {host} B with room for all"
    );
    let free = plan_within(p, &budgets(room, None), &inputs, device, None).unwrap();
    let within = plan_within(
        p,
        &budgets(room, Some(host)),
        &inputs,
        device,
        Some(limits(host)),
    )
    .unwrap();
    let side = within.host.as_ref().unwrap();
    assert_eq!(within.choices(), free.choices(), "{within}");
    assert!(within.components.iter().all(|c| c.kept), "{within}");
    assert_eq!(side.held_bytes, 0, "{side}");
    assert!(side.kept_staged_bytes > total / 2, "{side}");
    assert!(within.to_string().contains("host budget"), "{within}");
    // Below what a warm-up (nothing kept) needs: from saved measurements.
    assert!(host < warmup_least_host(&w));
    let given = RunOptions {
        planner: Some(inputs.clone()),
        ..opts.clone()
    };
    let Err(f) = run(
        &w,
        &StrategyChoice::Config(budgets(room, Some(host))),
        &opts,
    ) else {
        panic!("a warm-up ran within {host} B");
    };
    assert!(
        f.error.to_string().contains("below what the warm-up needs"),
        "{}",
        f.error
    );
    let o = run(
        &w,
        &StrategyChoice::Config(budgets(room, Some(host))),
        &given,
    )
    .unwrap_or_else(|f| panic!("{}", f.error));
    assert_eq!(outputs(&o), want);
    assert!(all_violations(&o).is_empty(), "{:#?}", all_violations(&o));
    assert!(host_peak(&o) <= host, "{} > {host}", host_peak(&o));
    // A device budget that keeps less: a swapped held set pins, and the
    // plan's pinned held bytes are exactly the swapped ones.
    let least = least_device(&w, &inputs);
    let device_budget = least + (total - least) / 4;
    let tight = least_host(&w, &inputs, device_budget);
    let plan = plan_within(
        p,
        &budgets(device_budget, Some(tight)),
        &inputs,
        device,
        Some(limits(tight)),
    )
    .unwrap();
    let side = plan.host.as_ref().unwrap();
    let swapped_held: u64 = plan
        .components
        .iter()
        .filter(|c| !c.kept)
        .map(|c| c.held_bytes)
        .sum();
    assert!(
        swapped_held > 0,
        "something is swapped at this budget:\n{plan}"
    );
    assert_eq!(side.held_bytes, swapped_held, "{plan}");
}

/// Below the least host budget, `enable` fails typed, naming the least and
/// its parts, with nothing broken on the device; `"auto"` plans within what
/// this machine has (its reading is the plan's host budget, and the run
/// stays within it).
#[test]
fn a_host_budget_below_the_least_plan_fails_typed_and_auto_plans() {
    let (w, opts, _, inputs) = planned_baseline();
    let total = w.preset.weight_bytes() + 100_000;
    let least_host = least_host(&w, &inputs, total);
    let given = RunOptions {
        planner: Some(inputs.clone()),
        ..opts.clone()
    };
    let Err(f) = run(
        &w,
        &StrategyChoice::Config(budgets(total, Some(least_host - 1))),
        &given,
    ) else {
        panic!("a host budget below {least_host} B was accepted");
    };
    assert!(f.violations.is_empty(), "{:#?}", f.violations);
    let text = f.error.to_string();
    assert!(
        text.contains("`host_budget`")
            && text.contains("held sets pinned")
            && text.contains(&format!(
                "least any plan of this pipeline needs is {least_host} B"
            ))
            && text.contains("allowed: host_budget ≥"),
        "{text}"
    );
    let auto = OffloadConfig {
        host_budget: Some(HostBudget::Auto),
        ..offload_tests::budget::budget_config(total)
    };
    let o = run(&w, &StrategyChoice::Config(auto), &opts).unwrap_or_else(|f| panic!("{}", f.error));
    let side = o
        .plan
        .as_ref()
        .and_then(|p| p.host.as_ref())
        .expect("planned");
    assert!(side.source.contains("auto"), "{side}");
    assert_eq!(o.bounds.host_budget_bytes, Some(side.budget_bytes));
    assert!(host_peak(&o) <= side.budget_bytes && side.peak_bytes <= side.budget_bytes);
    assert!(all_violations(&o).is_empty(), "{:#?}", all_violations(&o));
}

/// Where the device refuses pins a planned host budget counted on, the run
/// still stays within the budget (CONTRACT §7c). At a host budget of its
/// own peak the plan pins every streamed block and holds no staging ring,
/// so a refused block needs a ring of two of itself: the store stages more
/// blocks to make its room. Every pin request of a clean run is refused in
/// turn, then every n-th ([`refuse_each_pin`]): each run ends
/// bit-identical to resident, within the budget on the device's own
/// page-locked count, with no checker violation and the refused block
/// named in the log. Where the refused pin is a swapped held unit's, its
/// phase brings it in from pageable memory through the upload buffer the
/// plan counts (once `enable` failed typed here), and planted
/// `StagedBringInSkipsCopy` (that bring-in never written) is caught. The
/// preset's text encoder holds its largest unit, so where it is kept the
/// upload buffer the plan counts is the one its upload uses (on `tiny` the
/// plan counts one no upload fills, room a refused block's ring fits in).
/// Planted `KeepPinsBesideRefused` (the store keeping the pins it was
/// granted): over the budget, and INV-7 sees it.
/// And the units outside the components upload through the kept sets'
/// upload buffer (one pinned upload buffer at a time, as the plan counts):
/// planted `OutsideUploadBesideBuffer` (each through a pinned copy of its
/// own while that buffer is alive), INV-7 sees the second buffer.
#[test]
fn refused_pins_and_outside_units_stay_within_a_planned_host_budget() {
    let (w, opts, want, inputs) = baseline_of(offload_sim::presets::tiny_outside());
    let (within, over, kept) =
        refused_pins_planned((w.clone(), opts.clone(), want.clone(), inputs.clone()));
    assert!(
        within >= 2,
        "refused streamed blocks staged within the budget: {within}"
    );
    assert!(
        over >= 1,
        "the planted bug went over the budget somewhere: {over}"
    );
    let mut caught = 0;
    for (device, host) in kept {
        let planted = RunOptions {
            bugs: vec![PlantedBug::OutsideUploadBesideBuffer],
            planner: Some(inputs.clone()),
            ..opts.clone()
        };
        let o = run(
            &w,
            &StrategyChoice::Config(budgets(device, Some(host))),
            &planted,
        )
        .unwrap_or_else(|f| panic!("planted: {}", f.error));
        assert_eq!(outputs(&o), want, "a memory bug");
        if host_peak(&o) > host {
            assert!(
                all_violations(&o)
                    .iter()
                    .any(|v| v.invariant == Invariant::BoundedMemory),
                "planted OutsideUploadBesideBuffer: {} pinned over {host}, INV-7 saw nothing",
                host_peak(&o)
            );
            caught += 1;
        }
    }
    assert!(
        caught >= 1,
        "the planted second upload buffer went over the budget: {caught}"
    );
}

/// The host side of `w`'s plan at `device` under a host budget with room
/// for every weight pinned twice over: every streamed block pinned,
/// nothing staged, no page released.
fn all_pinned(w: &Workload, inputs: &PlannerInputs, device: u64) -> offload_core::budget::HostSide {
    let total = w.preset.weight_bytes();
    let plan = plan_within(
        &w.preset.pipeline,
        &budgets(device, Some(4 * total)),
        inputs,
        DeviceMemory::of(u64::MAX / 4),
        Some(limits(4 * total)),
    )
    .unwrap();
    let side = plan.host.expect("a host budget is planned");
    assert!(
        side.staged_blocks.is_empty() && side.pinned_streamed_bytes > 0 && !side.release_after_read,
        "device {device}: every streamed block pinned: {side}"
    );
    side
}

/// Every pin refused in turn ([`refuse_each_pin`]) at three device budgets
/// of `baseline`, each at a host budget of its plan's own peak where the
/// plan pins every streamed block (so it holds no staging ring). Returns
/// the runs within the budget with a block staged, the planted runs over
/// it, and the (device, host) budgets whose plan keeps a set staged.
fn refused_pins_planned(
    (w, opts, want, inputs): (Workload, RunOptions, Vec<u64>, PlannerInputs),
) -> (usize, usize, Vec<(u64, u64)>) {
    let least_device = least_device(&w, &inputs);
    let total = w.preset.weight_bytes();
    let (mut within, mut held, mut over, mut kept) = (0, 0, 0, Vec::new());
    for k in 1..=3u64 {
        let device = least_device + (total - least_device) * k / 4;
        let side = all_pinned(&w, &inputs, device);
        // Its own peak: no room to spare.
        let host = side.peak_bytes;
        let config = StrategyChoice::Config(budgets(device, Some(host)));
        let given = RunOptions {
            planner: Some(inputs.clone()),
            ..opts.clone()
        };
        let clean = run(&w, &config, &given).unwrap_or_else(|f| panic!("clean: {}", f.error));
        let clean_side = clean.plan.as_ref().and_then(|p| p.host.clone()).unwrap();
        assert!(clean_side.staged_blocks.is_empty(), "{clean_side}");
        if !clean_side.kept_staged.is_empty() {
            kept.push((device, host));
        }
        let (w_, _, o_, h_) = refuse_each_pin(&w, &config, &given, &want, host);
        within += w_;
        held += h_;
        over += o_;
    }
    assert!(
        held >= 1,
        "a swapped held unit's refused pin completes, brought in from pageable memory (and its planted unwritten bring-in is caught)"
    );
    (within, over, kept)
}

/// As `refused_pins_release_staged_pages_when_the_budget_has_no_room_for_them`,
/// planned: at a host budget of the plan's own peak with every streamed
/// block pinned, pins the device refuses leave staged blocks the budget
/// has no room for beside the pins that held, and the store releases
/// their pages after each read though its plan did not; at twice that
/// budget, or without one, nothing is released. Seen red (2026-12-04) with
/// the release taken from the plan alone.
#[test]
fn refused_pins_release_staged_pages_under_a_planned_host_budget() {
    let (w, opts, _, inputs) = baseline_of(offload_sim::presets::tiny_outside());
    let opts = RunOptions {
        trained_weights: true,
        planner: Some(inputs.clone()),
        ..opts
    };
    let want = outputs(&run(&w, &StrategyChoice::Resident, &opts).unwrap());
    let least = least_device(&w, &inputs);
    let device = least + (w.preset.weight_bytes() - least) / 2;
    let host = all_pinned(&w, &inputs, device).peak_bytes;
    let config = StrategyChoice::Config(budgets(device, Some(host)));
    let (clean, released, _) = run_counting_releases(&w, &config, &opts);
    assert_eq!(
        outputs(&clean.unwrap_or_else(|f| panic!("clean: {}", f.error))),
        want
    );
    assert_eq!(
        released, 0,
        "a plan that pins every streamed block releases nothing"
    );
    let roomy = StrategyChoice::Config(budgets(device, Some(2 * host)));
    let unbudgeted = StrategyChoice::Config(budgets(device, None));
    let none = std::collections::BTreeSet::new();
    let refusing = refusals_release(
        &w,
        [
            (&config, host, Some(&none)),
            (&roomy, 2 * host, None),
            (&unbudgeted, u64::MAX, None),
        ],
        &opts,
        &want,
    );
    assert!(refusing >= 2, "refusing runs that staged: {refusing}");
}

/// `budgets(device, host)` with `pin_cpu_memory = false`.
fn unpinned(device: u64, host: Option<u64>) -> OffloadConfig {
    OffloadConfig {
        pin_cpu_memory: Some(false),
        ..budgets(device, host)
    }
}

/// `pin_cpu_memory = false` under a device budget (CONTRACT §7c) stages
/// every master, with or without a host budget: from the least device
/// budget to every weight, through the warm-up and from saved
/// measurements, each run is bit-identical to resident with no checker
/// violation; the plan's host side pins no master (no held set, no
/// streamed block) and stages every streamed block; the device registers
/// nothing and pins at most the staging ring and the upload buffer (the
/// plan's own peak where no warm-up ran, INV-7's host bound); the log
/// names each staged block and each swapped held unit brought in from
/// pageable memory. A host budget below the ring and the buffer fails
/// typed. Planted: the staged bring-in skipped (outputs differ) and the
/// store pinning what the plan stages (INV-7) are each caught.
#[test]
fn unpinned_masters_under_a_device_budget_stage_every_unit() {
    let (w, opts, want, inputs) = baseline_of(offload_sim::presets::tiny_outside());
    let least_device = least_device(&w, &inputs);
    let total = w.preset.weight_bytes();
    let (mut swapped_seen, mut streamed_seen, mut runs) = (0, 0, 0);
    let mut swapped_budgets = Vec::new();
    for k in 0..=4u64 {
        let device = least_device + (total + 100_000 - least_device) * k / 4;
        for host in [None, Some(total / 2)] {
            for given in [None, Some(inputs.clone())] {
                let from = if given.is_some() { "saved" } else { "warm-up" };
                let run_opts = RunOptions {
                    planner: given.clone(),
                    ..opts.clone()
                };
                let (o, log) = capture_logs(|| {
                    run(
                        &w,
                        &StrategyChoice::Config(unpinned(device, host)),
                        &run_opts,
                    )
                });
                let o = o.unwrap_or_else(|f| {
                    panic!("device {device}, host {host:?}, {from}: {}", f.error)
                });
                runs += 1;
                let plan = o.plan.as_ref().expect("a planned run has its plan");
                let side = plan
                    .host
                    .as_ref()
                    .expect("unpinned: a host side is planned");
                let at = format!("device {device}, host {host:?}, {from}\n{plan}");
                assert_eq!(outputs(&o), want, "{at}");
                assert!(
                    all_violations(&o).is_empty(),
                    "{at}: {:#?}",
                    all_violations(&o)
                );
                assert_eq!(offload_sim::job::phase_violations(&o), None, "{at}");
                assert_eq!(side.held_bytes + side.pinned_streamed_bytes, 0, "{at}");
                let streamed: usize = plan.components.iter().map(|c| c.streamed_blocks).sum();
                assert_eq!(side.staged_blocks.len(), streamed, "{at}");
                assert_eq!(
                    o.at_end.registered_peak_bytes, 0,
                    "{at}: nothing registered"
                );
                assert_eq!(
                    o.bounds.host_budget_bytes,
                    Some(side.budget_bytes),
                    "{at}: INV-7 checks the host side's bound"
                );
                if given.is_some() {
                    assert!(
                        host_peak(&o) <= side.peak_bytes,
                        "{at}: pinned {} beyond the ring and the buffer",
                        host_peak(&o)
                    );
                }
                if let Some(host) = host {
                    assert!(host_peak(&o) <= host, "{at}");
                    assert_eq!(side.budget_bytes, host, "{at}");
                } else {
                    assert!(side.peak_bytes <= side.budget_bytes, "{at}");
                    assert!(host_peak(&o) <= side.budget_bytes, "{at}");
                }
                for b in &side.staged_blocks {
                    streamed_seen += 1;
                    assert!(
                        log.contains(&format!("{b}` streams staged (pin_cpu_memory = false)")),
                        "{at}: the log names staged `{b}`: {log}"
                    );
                }
                if plan.components.iter().any(|c| !c.kept && c.held_bytes > 0) {
                    swapped_seen += 1;
                    assert!(
                        log.contains("through a pinned upload buffer (pin_cpu_memory = false)"),
                        "{at}: a swapped held unit named: {log}"
                    );
                    if given.is_some() {
                        swapped_budgets.push((device, host));
                    }
                }
            }
        }
    }
    eprintln!(
        "COUNTS runs {runs} streamed {streamed_seen} swapped {swapped_seen} budgets {swapped_budgets:?}"
    );
    assert!(
        runs == 20 && streamed_seen >= 10 && swapped_seen >= 2,
        "runs {runs}, staged blocks named {streamed_seen}, swapped held sets {swapped_seen}"
    );

    // A host budget below what the ring and the buffer page-lock: typed.
    let device = least_device + (total - least_device) / 2;
    let e = plan_within(
        &w.preset.pipeline,
        &unpinned(device, Some(1)),
        &inputs,
        DeviceMemory::of(u64::MAX / 4),
        Some(limits(1)),
    )
    .unwrap_err();
    assert!(
        matches!(e, BudgetError::HostDoesNotFit { held: 0, .. }),
        "{e:?}"
    );

    // Planted: each caught where a swapped held set is staged, and the
    // store pinning the staged masters over the host side's bound.
    let (mut skipped, mut pinned) = (0, 0);
    for &(device, host) in &swapped_budgets {
        let planted = |bug| RunOptions {
            bugs: vec![bug],
            planner: Some(inputs.clone()),
            ..opts.clone()
        };
        let config = StrategyChoice::Config(unpinned(device, host));
        let o = run(&w, &config, &planted(PlantedBug::StagedBringInSkipsCopy))
            .unwrap_or_else(|f| panic!("planted skip: {}", f.error));
        if outputs(&o) != want {
            skipped += 1;
        }
        let o = run(&w, &config, &planted(PlantedBug::PlannedPinsStagedBlocks))
            .unwrap_or_else(|f| panic!("planted pins: {}", f.error));
        assert_eq!(outputs(&o), want, "a memory bug");
        if all_violations(&o)
            .iter()
            .any(|v| v.invariant == Invariant::BoundedMemory)
        {
            pinned += 1;
        }
    }
    assert!(
        !swapped_budgets.is_empty()
            && skipped == swapped_budgets.len()
            && pinned == swapped_budgets.len(),
        "planted bring-in skipped caught {skipped}, pins caught {pinned}, of {}",
        swapped_budgets.len()
    );
}

/// Model-level offload with `pin_cpu_memory = false`, and with each of its
/// pin requests refused in turn (CONTRACT §7c): every swapped unit is
/// brought in from pageable memory at each of its phases and every
/// resident unit uploaded once, through one pinned upload buffer; each run
/// is bit-identical to resident with no checker violation, registers
/// nothing where unpinned and page-locks at most that buffer, and the log
/// names each unit staged. Planted: the staged bring-in skipped is caught
/// (outputs differ) in every run that stages a swapped unit.
#[test]
fn model_level_stages_unpinned_and_refused_masters() {
    let (w, opts, want, _) = planned_baseline();
    let model_level = |pin: Option<bool>| {
        StrategyChoice::Config(OffloadConfig {
            enable_cpu_offload: true,
            pin_cpu_memory: pin,
            ..OffloadConfig::default()
        })
    };
    let (o, log) = capture_logs(|| run(&w, &model_level(Some(false)), &opts));
    let o = o.unwrap_or_else(|f| panic!("unpinned: {}", f.error));
    assert_eq!(outputs(&o), want);
    assert!(all_violations(&o).is_empty(), "{:#?}", all_violations(&o));
    assert_eq!(o.at_end.registered_peak_bytes, 0, "nothing registered");
    // At most the one upload buffer INV-7 declares (the largest unit, at
    // most 64 MiB): no master, no transient pin beside it.
    assert!(
        o.bounds.staging_ring_bytes > 0
            && o.bounds.staging_ring_bytes <= offload_core::budget::host::UPLOAD_STAGING_BYTES
    );
    assert!(
        o.at_end.pinned_peak_bytes <= o.bounds.staging_ring_bytes,
        "pinned {} beyond the upload buffer {}",
        o.at_end.pinned_peak_bytes,
        o.bounds.staging_ring_bytes
    );
    let named = log
        .matches("through a pinned upload buffer (pin_cpu_memory = false)")
        .count();
    assert!(named >= 2, "the swapped units are named: {log}");
    let planted = RunOptions {
        bugs: vec![PlantedBug::StagedBringInSkipsCopy],
        ..opts.clone()
    };
    let p = run(&w, &model_level(Some(false)), &planted)
        .unwrap_or_else(|f| panic!("planted: {}", f.error));
    assert_ne!(outputs(&p), want, "planted StagedBringInSkipsCopy passed");

    // Each pin request refused in turn, then every n-th.
    let clean = run(&w, &model_level(None), &opts).unwrap();
    assert!(clean.at_end.pins_refused == 0 && clean.at_end.pin_requests > 0);
    let faults = pin_refusals(clean.at_end.pin_requests, 5);
    let (mut swapped, mut caught) = (0, 0);
    for (k, faults) in faults.iter().enumerate() {
        let refusing = |bugs: Vec<PlantedBug>| RunOptions {
            faults: *faults,
            bugs,
            ..opts.clone()
        };
        let (o, log) = capture_logs(|| run(&w, &model_level(None), &refusing(Vec::new())));
        let o = o.unwrap_or_else(|f| panic!("fault plan {k}: {}", f.error));
        assert!(o.at_end.pins_refused > 0, "fault plan {k} fired");
        assert_eq!(outputs(&o), want, "fault plan {k}");
        assert!(
            all_violations(&o).is_empty(),
            "fault plan {k}: {:#?}",
            all_violations(&o)
        );
        assert!(log.contains("was refused"), "fault plan {k}: {log}");
        if log.contains("through a pinned upload buffer (its pin was refused)") {
            swapped += 1;
            let p = run(
                &w,
                &model_level(None),
                &refusing(vec![PlantedBug::StagedBringInSkipsCopy]),
            )
            .unwrap_or_else(|f| panic!("planted, fault plan {k}: {}", f.error));
            if outputs(&p) != want {
                caught += 1;
            }
        }
    }
    eprintln!(
        "{} fault plans: {swapped} staged a swapped unit, planted caught {caught}",
        faults.len()
    );
    assert!(
        swapped >= 2 && caught == swapped,
        "swapped units staged {swapped}, planted caught {caught}"
    );
}

/// `base` with page tables of one byte per 16 bytes locked (large, so
/// that the staging buffers' tables move a plan), `bugs` planted, `faults`
/// and `given` measurements: the runs of the two page-table tests below.
fn large_tables(
    base: &RunOptions,
    bugs: Vec<PlantedBug>,
    faults: FaultPlan,
    given: Option<PlannerInputs>,
) -> RunOptions {
    RunOptions {
        profile: DeviceProfile {
            host_mapping_divisor: 16,
            ..base.profile.clone()
        },
        bugs,
        faults,
        planner: given,
        ..base.clone()
    }
}

/// A planned run within the device's own count: outputs equal to `want`,
/// no checker violation, every phase within its bound and the budget.
fn within_the_count(o: &RunOutcome, want: &[u64], at: &str) {
    assert_eq!(outputs(o), want, "{at}");
    assert!(
        all_violations(o).is_empty(),
        "{at}: {:#?}",
        all_violations(o)
    );
    assert_eq!(offload_sim::job::phase_violations(o), None, "{at}");
}

/// The pinned staging ring and upload buffer a plan holds take device
/// memory for their page tables, as the masters' mappings do (a GPU maps
/// 8 B per 4 KiB page: `bench/pool_probe.py`), and the masters' measured
/// mappings do not hold them: the plan counts them beside the masters'
/// (`Device::host_page_table_bytes`, `PlannedBackend::settle_store`,
/// CONTRACT §7a). With every master unpinned (only those buffers locked)
/// and page tables of one byte per 16 locked (large, so that they move a
/// plan), swept over device budgets, through the warm-up and from saved
/// measurements: every phase's peak of the device's own count within the
/// budget, outputs equal to resident. Planted `StagingTablesUncounted`:
/// some phase goes over.
#[test]
fn the_page_tables_of_staging_buffers_are_counted_in_every_phase() {
    use offload_tests::budget::{fitting, over_the_devices_count};
    let (w, base, want, inputs) = baseline_of(offload_sim::presets::tiny_outside());
    let least = least_device(&w, &inputs);
    let total = w.preset.weight_bytes();
    let opts = |bugs, given| large_tables(&base, bugs, FaultPlan::none(), given);
    let (mut runs, mut over, mut tables) = (0, 0, 0);
    for k in 0..=16u64 {
        let device = least + (total + 100_000 - least) * k / 16 + total / 64;
        for given in [None, Some(inputs.clone())] {
            let config = StrategyChoice::Config(unpinned(device, None));
            let at = format!("device {device}, given {}", given.is_some());
            let Some(o) = fitting(run(&w, &config, &opts(vec![], given.clone())), &at) else {
                continue;
            };
            runs += 1;
            let plan = o.plan.as_ref().expect("planned");
            let side = plan.host.as_ref().expect("unpinned: a host side");
            let at = format!("{at}\n{plan}");
            within_the_count(&o, &want, &at);
            let buffers = (side.staging_bytes.div_ceil(16)) + side.transient_bytes.div_ceil(16);
            assert!(
                plan.mapping_bytes >= buffers,
                "{at}: {} < {buffers}",
                plan.mapping_bytes
            );
            if side.staging_bytes > 0 {
                tables += 1;
            }
            let planted = vec![PlantedBug::StagingTablesUncounted];
            if run(&w, &config, &opts(planted, given)).is_ok_and(|p| over_the_devices_count(&p)) {
                over += 1;
            }
        }
    }
    eprintln!(
        "{runs} runs within the device's count ({tables} with a staging ring); the plant went over in {over}"
    );
    assert!(
        runs >= 32 && tables >= 8 && over >= 1,
        "{runs} runs, {tables} with a ring, the plant over in {over}"
    );
}

/// The same for masters the plan pins but the device refuses (CONTRACT
/// §7c: a refused pin stages its block, through a ring the plan did not
/// hold, with no host budget and so no host side): the tables counted are
/// those the store's staged masters make. Every second to fifth pin
/// refused (every third refuses the pinned copy that uploads the unit
/// outside every component, which then uploads from pageable memory
/// through an upload buffer of its own: before, a typed error failed
/// `enable`), page tables of one byte per 16 locked, swept over 17
/// device budgets: every phase within the budget on the device's own count,
/// outputs equal to resident. Planted `StagingTablesUncounted`: some phase
/// goes over.
#[test]
fn the_page_tables_of_a_refused_pins_staging_are_counted() {
    use offload_tests::budget::{fitting, over_the_devices_count};
    let (w, base, want, inputs) = baseline_of(offload_sim::presets::tiny_outside());
    let least = least_device(&w, &inputs);
    let total = w.preset.weight_bytes();
    let opts = |bugs, every| {
        let faults = FaultPlan {
            refuse_pin_every: Some(every),
            ..FaultPlan::none()
        };
        large_tables(&base, bugs, faults, None)
    };
    let (mut runs, mut staged, mut over) = (0, 0, 0);
    for every in [2, 3, 4, 5] {
        for k in 0..=16u64 {
            let device = least + (total + 100_000 - least) * k / 16 + total / 32;
            let config = StrategyChoice::Config(budgets(device, None));
            let at = format!("device {device}, every {every}");
            let Some(o) = fitting(run(&w, &config, &opts(vec![], every)), &at) else {
                continue;
            };
            runs += 1;
            let plan = o.plan.as_ref().expect("planned");
            assert!(plan.host.is_none(), "{at}: no host budget, no host side");
            within_the_count(&o, &want, &at);
            if o.at_end.pins_refused > 0 {
                staged += 1;
            }
            let planted = vec![PlantedBug::StagingTablesUncounted];
            if run(&w, &config, &opts(planted, every)).is_ok_and(|p| over_the_devices_count(&p)) {
                over += 1;
            }
        }
    }
    eprintln!(
        "{runs} runs within the device's count ({staged} with a pin refused); the plant went over in {over}"
    );
    assert!(
        runs >= 56 && staged == runs && over >= 1,
        "{runs} runs, {staged} with a pin refused, the plant over in {over}"
    );
}

/// The staged forecast's fill rate is the ring's last pass's, as the
/// engine sets its window (CONTRACT §7c): every master staged, the weight
/// source slow on the first request (each read sleeps, a checkpoint read
/// from a cold disk) and fast after, the second request's forecast fills
/// at more than six times the first's, where a rate averaged over every
/// fill would rise at most twofold. Seen red (2026-12-07, found by review)
/// with the engine setting no window (`host_staging_of`).
#[test]
fn the_staged_forecast_fills_at_the_last_pass_s_rate() {
    use offload_core::model::StorageId;
    use offload_core::runtime::WeightSource;
    use offload_sim::DeviceProfile;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    struct SlowFirst {
        inner: Arc<dyn WeightSource>,
        slow: AtomicBool,
    }
    impl WeightSource for SlowFirst {
        fn read(&self, storage: StorageId, position: u64, dst: &mut [u8]) {
            if self.slow.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(25));
            }
            self.inner.read(storage, position, dst);
        }
    }
    let w = workload();
    let inputs =
        offload_sim::plan::estimated_inputs(&w.preset, &DeviceProfile::h200(), w.tokens, 3);
    let o = RunOptions {
        planner: Some(inputs),
        ..opts(&[], 2, None)
    };
    let source = Arc::new(SlowFirst {
        inner: Arc::new(offload_sim::presets::TrainedWeights::new(
            o.seed,
            &w.preset.pipeline,
        )),
        slow: AtomicBool::new(true),
    });
    let choice = layerwise(Some(false), None);
    let StrategyChoice::Config(config) = &choice else {
        unreachable!()
    };
    let rig = offload_sim::harness::Rig::with_weights(
        w.preset.pipeline.clone(),
        &o,
        Arc::clone(&source) as Arc<dyn WeightSource>,
    )
    .unwrap();
    let mut rates: Vec<f64> = Vec::new();
    let out = offload_sim::harness::drive(
        rig,
        &choice,
        config,
        &o,
        2,
        |rig| {
            let m = rig.request(&w)?;
            let f = rig
                .runtime
                .backend()
                .expect("enabled")
                .staged_forecast(None)?;
            rates.push(
                f.iter()
                    .map(|(_, f)| f.fill_bytes_per_s)
                    .fold(f64::MAX, f64::min),
            );
            // The disk is cold for the first request only.
            source.slow.store(false, Ordering::Relaxed);
            Ok(m)
        },
        |_| {},
    )
    .unwrap_or_else(|f| panic!("{}", f.error));
    assert!(all_violations(&out).is_empty());
    assert_eq!(rates.len(), 2);
    assert!(
        rates[1] > 6.0 * rates[0],
        "the second request's fills at {:.3e} B/s against the first's {:.3e}: not the last pass's rate",
        rates[1],
        rates[0]
    );
}

/// `staged_reads = "in_place"` (CONTRACT §7c).
fn in_place(pin: Option<bool>, budget: Option<u64>) -> StrategyChoice {
    let StrategyChoice::Config(mut c) = layerwise(pin, budget) else {
        unreachable!("staged_layerwise is a configuration")
    };
    c.staged_reads = Some(offload_core::config::StagedReads::InPlace);
    StrategyChoice::Config(c)
}

fn reading_pageable(bugs: &[PlantedBug], depth: usize, jitter: Option<u64>) -> RunOptions {
    RunOptions {
        pageable_reads: true,
        ..opts(bugs, depth, jitter)
    }
}

/// Staged masters read in place by a device that reads pageable memory
/// (`staged_reads = "in_place"`, the weights as mapped windows): every
/// master staged and under a budget, at depths 1–3 with and without
/// jitter, the outputs equal resident with no violation, no staging ring
/// is pinned (the page-locked peak stays below one ring: only the upload
/// buffer and the budget's pinned blocks), every staged block is named in
/// the log as read in place, and the device copied what a fully pinned
/// run copies (its own count of host→device bytes).
#[test]
fn in_place_reads_are_bit_identical_and_pin_no_staging_ring() {
    let want = resident();
    let (streamed, ring, transient) = sizes();
    for (pin, budget) in [
        (Some(false), None),
        (None, Some(streamed / 2 + ring + transient)),
    ] {
        for depth in [1, 2, 3] {
            for jitter in [None, Some(1), Some(2)] {
                let at =
                    format!("pin {pin:?}, budget {budget:?}, depth {depth}, jitter {jitter:?}");
                let (o, log) = capture_logs(|| {
                    run(
                        &workload(),
                        &in_place(pin, budget),
                        &reading_pageable(&[], depth, jitter),
                    )
                    .unwrap()
                });
                let fill = run(
                    &workload(),
                    &layerwise(pin, budget),
                    &opts(&[], depth, jitter),
                )
                .unwrap();
                assert_eq!(outputs(&o), want, "{at}");
                assert!(
                    all_violations(&o).is_empty(),
                    "{at}: {:#?}",
                    all_violations(&o)
                );
                // No staging ring: nothing pinned but the upload buffer
                // (every master staged), or the budget spent on masters.
                assert!(
                    host_peak(&o) <= budget.unwrap_or(transient),
                    "{at}: page-locked peak {} over {}",
                    host_peak(&o),
                    budget.unwrap_or(transient)
                );
                if budget.is_none() {
                    assert!(
                        host_peak(&o) < host_peak(&fill),
                        "{at}: in place {} ≥ filled {}",
                        host_peak(&o),
                        host_peak(&fill)
                    );
                } else {
                    // The ring's share pins more blocks instead.
                    let (_, fill_log) = capture_logs(|| {
                        run(
                            &workload(),
                            &layerwise(pin, budget),
                            &opts(&[], depth, jitter),
                        )
                        .unwrap()
                    });
                    let staged_in_place = log.matches("streams staged, read in place").count();
                    let staged_filled = fill_log.matches("streams staged (").count();
                    assert!(
                        staged_in_place < staged_filled,
                        "{at}: {staged_in_place} blocks staged in place, {staged_filled} filled: the plan reserved a ring it never makes"
                    );
                }
                assert!(
                    log.contains("streams staged, read in place by the device"),
                    "{at}: {log}"
                );
                assert!(!log.contains("through the staging ring"), "{at}: {log}");
                // No staging ring, no queue: the copies a fully pinned run
                // issues, byte for byte.
                let pinned = run(
                    &workload(),
                    &layerwise(None, None),
                    &opts(&[], depth, jitter),
                )
                .unwrap();
                assert_eq!(
                    (o.at_end.h2d_bytes, o.at_end.copies),
                    (pinned.at_end.h2d_bytes, pinned.at_end.copies),
                    "{at}: bytes and copies over the link"
                );
            }
        }
    }
    // A budget below the ring a fill needs: refused filled, planned and
    // run in place (the plan reserves no ring for blocks read in place).
    let below = ring + transient - 1;
    let e = run(
        &workload(),
        &layerwise(None, Some(below)),
        &opts(&[], 2, None),
    )
    .unwrap_err();
    assert!(e.to_string().contains("host_budget"), "{e}");
    let o = run(
        &workload(),
        &in_place(None, Some(below)),
        &reading_pageable(&[], 2, None),
    )
    .unwrap();
    assert_eq!(outputs(&o), want, "in place under {below}");
    assert!(all_violations(&o).is_empty(), "{:#?}", all_violations(&o));
    assert!(host_peak(&o) <= below, "{} over {below}", host_peak(&o));
}

/// `w`'s requests served under `choice` from `weights` on a rig of `o`.
fn serve_in_place(
    w: &Workload,
    o: &RunOptions,
    weights: std::sync::Arc<dyn offload_core::runtime::WeightSource>,
    choice: &StrategyChoice,
) -> RunOutcome {
    let mut rig =
        offload_sim::harness::Rig::with_weights(w.preset.pipeline.clone(), o, weights).unwrap();
    rig.serve_workload(w);
    offload_sim::harness::drive(
        rig,
        choice,
        &choice.config(),
        o,
        w.requests,
        |rig| rig.request(w),
        |_| {},
    )
    .unwrap()
}

/// Under `"in_place"` the weight source is asked for each block's window
/// once at `enable` (the host plan's answer is the one the staged master
/// reads): every master staged and under a budget, the windows the
/// source filled are exactly the blocks the plan looked at, and every
/// staged block still reads in place. Red where the master asks again
/// (the simulator's windows are filled on each ask: twice the work).
#[test]
fn in_place_windows_are_asked_for_once_at_enable() {
    let want = resident();
    let (streamed, ring, transient) = sizes();
    let w = workload();
    let o = reading_pageable(&[], 2, None);
    for (pin, budget) in [
        (Some(false), None),
        (None, Some(streamed / 2 + ring + transient)),
    ] {
        let at = format!("pin {pin:?}, budget {budget:?}");
        let windows = std::sync::Arc::new(offload_sim::presets::MappedWindows::new(
            std::sync::Arc::new(offload_sim::presets::TrainedWeights::new(
                o.seed,
                &w.preset.pipeline,
            )),
            o.payload_divisor,
        ));
        let (done, log) =
            capture_logs(|| serve_in_place(&w, &o, windows.clone(), &in_place(pin, budget)));
        assert_eq!(outputs(&done), want, "{at}");
        assert!(all_violations(&done).is_empty(), "{at}");
        let in_place = log.matches("streams staged, read in place").count() as u64;
        let StrategyChoice::Config(filled) = layerwise(pin, budget) else {
            unreachable!("staged_layerwise is a configuration")
        };
        let blocks = streamed_units(&w, filled, &opts(&[], 2, None)).len() as u64;
        assert!(in_place > 0, "{at}: {log}");
        // The plan asks once for each streamed block (a pinned one too: it
        // sizes the plan before the budget picks).
        assert_eq!(
            windows.asks(),
            blocks,
            "{at}: {} windows filled for {blocks} streamed blocks, {in_place} read in place",
            windows.asks()
        );
    }
}

/// `"in_place"` on a device that does not read pageable memory fails
/// `enable` with a typed error naming the key and what is allowed, and a
/// source without windows streams through the staging ring, logged.
#[test]
fn in_place_reads_without_a_device_that_reads_pageable_memory_are_typed() {
    let e = run(
        &workload(),
        &in_place(Some(false), None),
        &opts(&[], 1, None),
    )
    .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("staged_reads") && text.contains("\"fill\" on this device"),
        "{text}"
    );
    // The device reads pageable memory but the weights come as no window
    // (the heap's): every block through the staging ring, each logged.
    let want = resident();
    let w = workload();
    let o = reading_pageable(&[], 2, None);
    let (done, log) = capture_logs(|| {
        let weights = std::sync::Arc::new(offload_sim::presets::TrainedWeights::new(
            o.seed,
            &w.preset.pipeline,
        ));
        serve_in_place(&w, &o, weights, &in_place(Some(false), None))
    });
    assert_eq!(outputs(&done), want);
    assert!(
        all_violations(&done).is_empty(),
        "{:#?}",
        all_violations(&done)
    );
    assert!(
        log.contains("streams staged through the staging ring"),
        "{log}"
    );
    assert!(!log.contains("streams staged, read in place"), "{log}");
}

/// `staged_reads` is read from JSON and TOML; `"in_place"` outside
/// layerwise offload is refused naming where it works, `"fill"` is
/// accepted everywhere, and a value that is neither names both.
#[test]
fn staged_reads_is_checked_where_it_is_read() {
    use offload_core::config::StagedReads;
    for json in [
        r#"{"enable_cpu_offload": true, "staged_reads": "in_place"}"#,
        r#"{"enable_distributed_layerwise_offload": true, "staged_reads": "in_place"}"#,
        r#"{"device_budget": "16GiB", "staged_reads": "in_place"}"#,
    ] {
        let c = OffloadConfig::from_json_str(json).unwrap();
        let e = c.select().unwrap_err().to_string();
        assert!(
            e.contains("staged_reads")
                && e.contains("with layerwise offload (enable_layerwise_offload = true) only"),
            "{json}: {e}"
        );
    }
    for json in [
        r#"{"enable_layerwise_offload": true, "staged_reads": "in_place"}"#,
        r#"{"device_budget": "16GiB", "staged_reads": "fill"}"#,
    ] {
        let c = OffloadConfig::from_json_str(json).unwrap();
        assert!(c.select().is_ok(), "{json}: {:?}", c.select());
    }
    for bad in [r#""inplace""#, r#""dma""#, r#""IN_PLACE""#] {
        let json = format!(r#"{{"enable_layerwise_offload": true, "staged_reads": {bad}}}"#);
        let e = OffloadConfig::from_json_str(&json).unwrap_err().to_string();
        assert!(
            e.contains("staged_reads") && e.contains("fill") && e.contains("in_place"),
            "{bad}: {e}"
        );
    }
    let toml = OffloadConfig::from_toml_str(
        "enable_layerwise_offload = true\nstaged_reads = \"in_place\"\n",
    )
    .unwrap();
    assert_eq!(toml.staged_reads, Some(StagedReads::InPlace));
}
