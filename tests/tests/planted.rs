//! Every planted bug, caught by a checker that observes the simulated
//! device (its vector-clock order checker, its own memory counters and
//! host allocations, the outputs its kernels computed at simulated time),
//! never by a strategy's report of itself; and the same scenario without
//! the bug is clean. (INV-6 is planted in `xtask`'s tests; the GPU's side
//! of the ordering bugs is in `gpu.rs`.)
//!
//! The workload is the `tiny` preset: an odd ring of 7 DiT blocks, a
//! second 3-block expert (a second ring whose first block is copied on
//! demand), an encoder, a VAE. `sim_catch_table` prints the table that
//! `BENCHMARKS.md` quotes.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use offload_core::device::{Device, DeviceErrorKind};
use offload_core::invariants::{
    HookClaim, Invariant, TensorFacts, Violation, buffers_stay_correct, fail_before_mutate,
    one_host_master, single_owner,
};
use offload_core::model::{ModuleId, TensorId};
use offload_core::runtime::{ForwardCtx, PlantedBug, Runtime, Scope};
use offload_core::{OffloadConfig, OffloadStrategy, Pipeline};
use offload_hooks::{BoxError, HookOwner, ModelHook};
use offload_sim::harness::{
    Rig, RunOptions, RunOutcome, StrategyChoice, Workload, blocks_of, host_master_census, kernel,
    run,
};
use offload_sim::job::{JobArgs, StrategySet, memory_violations, run_job};
use offload_sim::presets::{SyntheticWeights, tiny};
use offload_sim::{DeviceProfile, FaultPlan, Jitter, Sim};
use offload_tests::BlockCache;

fn opts(bugs: &[PlantedBug]) -> RunOptions {
    RunOptions {
        bugs: bugs.to_vec(),
        ..RunOptions::new(DeviceProfile::h200())
    }
}

fn workload() -> Workload {
    let preset = tiny();
    Workload {
        tokens: preset.default_tokens,
        preset,
        steps: 4,
        requests: 2,
    }
}

fn layerwise() -> StrategyChoice {
    StrategyChoice::strategy(OffloadStrategy::Layerwise)
}

fn model_level() -> StrategyChoice {
    StrategyChoice::strategy(OffloadStrategy::ModelLevel)
}

fn outputs(o: &RunOutcome) -> Vec<u64> {
    o.requests.iter().map(|r| r.output).collect()
}

fn resident_outputs() -> Vec<u64> {
    outputs(&run(&workload(), &StrategyChoice::Resident, &opts(&[])).unwrap())
}

/// What the simulator saw of one run: the checker's violations (INV-3,
/// leaks), INV-7 from the device's counters, and INV-8 from the outputs.
struct Seen {
    violations: Vec<Violation>,
    output_differs: bool,
}

/// Seeded delays before device operations (as the GPU suite's spin
/// kernels): they move where data lands, never what a correct run
/// computes.
fn jittered(bugs: &[PlantedBug], seed: u64) -> RunOptions {
    RunOptions {
        jitter: Some(Jitter {
            seed,
            probability: 0.3,
            max_ns: 50_000,
        }),
        ..opts(bugs)
    }
}

const JITTER_SEEDS: u64 = 6;

fn seen(choice: &StrategyChoice, bugs: &[PlantedBug]) -> Seen {
    let out = run(&workload(), choice, &opts(bugs)).expect("the run completes");
    let mut violations = out.violations.clone();
    violations.extend(memory_violations(&out));
    let resident = resident_outputs();
    let output_differs = outputs(&out) != resident
        || (0..JITTER_SEEDS).any(|seed| {
            let o = run(&workload(), choice, &jittered(bugs, seed)).expect("the run completes");
            outputs(&o) != resident
        });
    Seen {
        output_differs,
        violations,
    }
}

/// Asserts a violation of `invariant` whose text holds `needle`.
fn caught(violations: &[Violation], invariant: Invariant, needle: &str) {
    assert!(
        violations
            .iter()
            .any(|v| v.invariant == invariant && v.to_string().contains(needle)),
        "expected {invariant} containing `{needle}`, got {violations:#?}"
    );
}

const OVERWRITE: &str = "overwrite or free while a read may be in flight";
const EARLY_READ: &str = "read before the fill completed";

#[test]
fn clean_runs_are_clean() {
    for choice in [StrategyChoice::Resident, layerwise(), model_level()] {
        let s = seen(&choice, &[]);
        assert!(s.violations.is_empty(), "{:#?}", s.violations);
        assert!(!s.output_differs);
    }
}

#[test]
fn inv3_copy_without_waiting_for_last_use() {
    let s = seen(&layerwise(), &[PlantedBug::SkipLastUseWait]);
    caught(&s.violations, Invariant::NoEarlyFree, OVERWRITE);
    caught(&s.violations, Invariant::NoEarlyFree, "slot");
}

#[test]
fn inv3_compute_without_waiting_for_ready() {
    let s = seen(&layerwise(), &[PlantedBug::SkipReadyWait]);
    caught(&s.violations, Invariant::NoEarlyFree, EARLY_READ);
    // Data lands at its simulated time: the racing kernels read stale
    // bytes, so the output shows it too.
    assert!(s.output_differs);
}

#[test]
fn inv3_last_use_recorded_before_the_compute() {
    let s = seen(&layerwise(), &[PlantedBug::LastUseBeforeCompute]);
    caught(&s.violations, Invariant::NoEarlyFree, OVERWRITE);
}

#[test]
fn inv3_static_slot_choice_on_an_odd_ring() {
    // 7 blocks, 2 slots: block 6 and block 0 both map to slot 0.
    let s = seen(&layerwise(), &[PlantedBug::StaticSlot]);
    caught(&s.violations, Invariant::NoEarlyFree, "slot0");
}

#[test]
fn inv3_wrap_around_prefetch_without_last_use_wait() {
    let s = seen(&layerwise(), &[PlantedBug::WrapAroundSkipLastUseWait]);
    caught(&s.violations, Invariant::NoEarlyFree, OVERWRITE);
}

#[test]
fn inv3_on_demand_refill_without_last_use_wait() {
    // The second expert's first block is copied on demand every request.
    let s = seen(&layerwise(), &[PlantedBug::OnDemandSkipLastUseWait]);
    caught(&s.violations, Invariant::NoEarlyFree, OVERWRITE);
}

#[test]
fn inv8_wrong_slot_wrong_master_stale_slot_second_ring() {
    for bug in [
        PlantedBug::WrongSlot,
        PlantedBug::WrongMaster,
        PlantedBug::StaleSlot,
        PlantedBug::IgnoreRingStamp,
    ] {
        assert!(
            seen(&layerwise(), &[bug]).output_differs,
            "{bug:?} must change the output"
        );
    }
}

#[test]
fn inv3_model_level_eviction_without_last_use() {
    let s = seen(&model_level(), &[PlantedBug::EvictWithoutLastUse]);
    caught(&s.violations, Invariant::NoEarlyFree, OVERWRITE);
}

#[test]
fn inv3_model_level_bring_in_without_ready() {
    let s = seen(&model_level(), &[PlantedBug::BringInWithoutReady]);
    caught(&s.violations, Invariant::NoEarlyFree, EARLY_READ);
    assert!(s.output_differs);
}

#[test]
fn inv7_model_level_bring_in_before_evicting() {
    let s = seen(&model_level(), &[PlantedBug::BringInBeforeEvict]);
    caught(
        &s.violations,
        Invariant::BoundedMemory,
        "peak device weight bytes",
    );
}

#[test]
fn inv7_an_extra_slot_breaks_the_device_bound() {
    let s = seen(&layerwise(), &[PlantedBug::ExtraSlot]);
    caught(
        &s.violations,
        Invariant::BoundedMemory,
        "peak device weight bytes",
    );
}

#[test]
fn inv7_leaked_host_masters_are_reported_after_disable() {
    let s = seen(&layerwise(), &[PlantedBug::LeakHostMasters]);
    caught(
        &s.violations,
        Invariant::BoundedMemory,
        "still allocated after disable",
    );
}

/// INV-3 on the fault path, deterministically: every copy of a model-level
/// run is failed in turn; a failed bring-in must free what it allocated
/// only after the copies it already enqueued.
#[test]
fn inv3_failed_bring_in_frees_after_its_copies() {
    let sweep = |bugs: &[PlantedBug]| -> Vec<Violation> {
        let mut all = Vec::new();
        for n in 1..=40 {
            let o = RunOptions {
                faults: FaultPlan {
                    fail_copy_at: Some(n),
                    ..FaultPlan::none()
                },
                ..opts(bugs)
            };
            // Failed runs are expected: the fault is the point.
            let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
            let backend = rig.backend(&model_level()).unwrap();
            if rig.runtime.enable(backend).is_ok() {
                for _ in 0..2 {
                    let _ = rig.request(&workload());
                }
            }
            let device = rig.device.clone();
            drop(rig);
            all.extend(device.violations());
        }
        all
    };
    let clean = sweep(&[]);
    assert!(clean.is_empty(), "{clean:#?}");
    caught(
        &sweep(&[PlantedBug::FailedBringInFreeWithoutWait]),
        Invariant::NoEarlyFree,
        "overwrite or free while a write may be in flight",
    );
}

/// Enable, run one block (which enqueues a prefetch), then `end` the rig:
/// what the checker saw, and what was left allocated.
fn in_flight(
    choice: &StrategyChoice,
    bugs: &[PlantedBug],
    faults: FaultPlan,
    end: impl FnOnce(Rig),
) -> (Vec<Violation>, usize) {
    let o = RunOptions {
        faults,
        ..opts(bugs)
    };
    in_flight_with(choice, &o, end)
}

/// [`in_flight`] with `o`; the device drained after `end`, so that a copy
/// still queued then runs (and is checked).
fn in_flight_with(
    choice: &StrategyChoice,
    o: &RunOptions,
    end: impl FnOnce(Rig),
) -> (Vec<Violation>, usize) {
    let mut rig = Rig::new(tiny().pipeline, o).unwrap();
    let backend = rig.backend(choice).unwrap();
    rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
    let out = &rig.probe.output;
    rig.runtime
        .forward("transformer", |dit| {
            let tensors = dit.pipeline().subtree_tensors(
                dit.pipeline()
                    .module_id("transformer.transformer_blocks.0")
                    .unwrap(),
            );
            dit.child("transformer_blocks.0", |b| {
                Ok(kernel(b, &tensors, 1e9, "block 0", out)?)
            })?;
            Ok(())
        })
        .unwrap();
    let device = rig.device.clone();
    end(rig);
    device.synchronize_all();
    let leaks = device.check_released();
    (device.violations(), leaks)
}

#[test]
fn inv3_disable_without_draining() {
    let disable = |mut rig: Rig| {
        rig.runtime.disable().unwrap();
    };
    let (v, leaks) = in_flight(&layerwise(), &[], FaultPlan::none(), disable);
    assert!(v.is_empty() && leaks == 0, "{v:#?}");
    let (v, _) = in_flight(
        &layerwise(),
        &[PlantedBug::FreeWithoutDrain],
        FaultPlan::none(),
        disable,
    );
    caught(&v, Invariant::NoEarlyFree, "free_pinned");
}

/// Masters read in place (`staged_reads = "in_place"`, CONTRACT §7c): a
/// disable that frees without draining drops a pageable master while the
/// prefetch that reads it is queued, and the device sees the copy read
/// memory its owner dropped (INV-3, the simulator's own check of
/// `HostSource::Pageable`), as does a drop of the enabled runtime that
/// does not drain; a disable or drop that drains leaves none.
#[test]
fn inv3_disable_without_draining_drops_a_window_read_in_place() {
    let choice = StrategyChoice::Config(OffloadConfig {
        enable_layerwise_offload: true,
        pin_cpu_memory: Some(false),
        staged_reads: Some(offload_core::config::StagedReads::InPlace),
        ..OffloadConfig::default()
    });
    let disable = |mut rig: Rig| {
        rig.runtime.disable().unwrap();
    };
    let with = |bugs: &[PlantedBug]| RunOptions {
        pageable_reads: true,
        ..opts(bugs)
    };
    let (v, leaks) = in_flight_with(&choice, &with(&[]), disable);
    assert!(v.is_empty() && leaks == 0, "{v:#?}");
    let (v, _) = in_flight_with(&choice, &with(&[PlantedBug::FreeWithoutDrain]), disable);
    caught(&v, Invariant::NoEarlyFree, "pageable memory");
    // Dropping the enabled runtime: drained, none; without the drain, seen.
    let (v, leaks) = in_flight_with(&choice, &with(&[]), drop);
    assert!(v.is_empty() && leaks == 0, "{v:#?}");
    let (v, _) = in_flight_with(&choice, &with(&[PlantedBug::DropWithoutDrain]), drop);
    caught(&v, Invariant::NoEarlyFree, "pageable memory");
}

/// Dropping an enabled runtime (a `?` past it) drains before freeing: no
/// violation, nothing left allocated. Planted: a drop that does not drain.
#[test]
fn inv3_drop_while_enabled() {
    for choice in [layerwise(), model_level(), StrategyChoice::Resident] {
        let (v, leaks) = in_flight(&choice, &[], FaultPlan::none(), drop);
        assert!(v.is_empty(), "{v:#?}");
        assert_eq!(leaks, 0);
    }
    let (v, _) = in_flight(
        &layerwise(),
        &[PlantedBug::DropWithoutDrain],
        FaultPlan::none(),
        drop,
    );
    caught(&v, Invariant::NoEarlyFree, "free_pinned");
}

/// A panic inside a forward unwinds through the runtime, which drops its
/// backend: drained, freed, nothing reported, nothing leaked.
#[test]
fn inv3_panic_inside_a_forward() {
    for choice in [layerwise(), model_level()] {
        let o = opts(&[]);
        let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
        let backend = rig.backend(&choice).unwrap();
        rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
        let device = rig.device.clone();
        let result = catch_unwind(AssertUnwindSafe(move || {
            let rig = rig;
            let _ = rig.runtime.forward("transformer", |dit| {
                dit.child("transformer_blocks.0", |_| -> Result<(), BoxError> {
                    panic!("a kernel launch panicked")
                })?;
                Ok(())
            });
        }));
        assert!(result.is_err(), "the panic propagates");
        assert_eq!(device.check_released(), 0);
        assert!(device.violations().is_empty(), "{:#?}", device.violations());
    }
}

/// When draining fails (a lost device), nothing the device may still touch
/// is freed: the disable reports the device error, the checker sees no
/// early free, and the memory is leaked (reported as such).
#[test]
fn a_failed_drain_leaks_rather_than_frees() {
    // Count the host synchronisations a clean run makes before disable.
    let before_disable = {
        let o = opts(&[]);
        let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
        let backend = rig.backend(&layerwise()).unwrap();
        rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
        rig.request(&workload()).unwrap();
        rig.device.stats().syncs
    };
    let o = RunOptions {
        faults: FaultPlan {
            fail_sync_at: Some(before_disable + 1),
            ..FaultPlan::none()
        },
        ..opts(&[])
    };
    let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
    let backend = rig.backend(&layerwise()).unwrap();
    rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
    rig.request(&workload()).unwrap();
    let Err(e) = rig.runtime.disable() else {
        panic!("the drain was planned to fail");
    };
    assert_eq!(
        e.device_error_kind(),
        Some(DeviceErrorKind::DeviceLost),
        "{e}"
    );
    let device = rig.device.clone();
    assert!(device.violations().is_empty(), "{:#?}", device.violations());
    assert!(
        device.check_released() > 0,
        "the memory is leaked, not freed"
    );
    assert!(
        device
            .violations()
            .iter()
            .all(|v| v.invariant == Invariant::BoundedMemory),
        "only the leak is reported"
    );
}

/// A failed drain with every master staged and the fill on a thread of its
/// own (as on a GPU): the disable reports the device error and leaks the
/// staging buffers (the device may still read them), but the filler thread
/// does not stay parked inside the leaked state: none is left running.
/// Seen red (2026-12-02) without `release_state`'s stop before the drain:
/// one thread left.
#[test]
fn a_failed_drain_leaves_no_staging_fill_thread_behind() {
    let staged = StrategyChoice::Config(OffloadConfig {
        enable_layerwise_offload: true,
        pin_cpu_memory: Some(false),
        ..OffloadConfig::default()
    });
    let o = RunOptions {
        host_threads: true,
        ..opts(&[])
    };
    let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
    let backend = rig.backend(&staged).unwrap();
    rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
    rig.request(&workload()).unwrap();
    assert!(
        offload_core::runtime::staging_fill_threads_alive() >= 1,
        "the staged ring fills on its own thread"
    );
    // Lost now: the filler's next wait and the disable's drain both fail.
    rig.device.lose();
    assert!(
        rig.runtime.disable().is_err(),
        "the drain was planned to fail"
    );
    assert!(rig.device.check_released() > 0, "the memory is leaked");
    assert_eq!(offload_core::runtime::staging_fill_threads_alive(), 0);

    // The planned backend's upload buffer, which a swapped held unit whose
    // pin was refused is brought in through (CONTRACT §7c), the same way:
    // no host budget, pins refused until a held unit stages, then the
    // device lost. Seen red (the review of 2026-12-05) with the buffer's
    // fill thread left running into the failed drain: one thread alive
    // after every such disable.
    let w = Workload {
        tokens: offload_sim::presets::tiny_outside().default_tokens,
        preset: offload_sim::presets::tiny_outside(),
        steps: 3,
        requests: 1,
    };
    let inputs = offload_sim::plan::estimated_inputs(&w.preset, &o.profile, w.tokens, 3);
    let least = match offload_core::budget::plan_within(
        &w.preset.pipeline,
        &offload_tests::budget::budget_config(1),
        &inputs,
        offload_core::budget::DeviceMemory::of(u64::MAX / 4),
        None,
    ) {
        Err(offload_core::budget::BudgetError::DoesNotFit { minimum, .. }) => minimum,
        other => panic!("{other:?}"),
    };
    let total = w.preset.weight_bytes();
    let mut staged_held = 0;
    for k in 1..=3u64 {
        let config = StrategyChoice::Config(offload_tests::budget::budget_config(
            least + (total - least) * k / 4,
        ));
        for n in 1..=12u64 {
            let refusing = RunOptions {
                planner: Some(inputs.clone()),
                faults: FaultPlan {
                    refuse_pins: Some((n, n)),
                    ..FaultPlan::none()
                },
                ..o.clone()
            };
            let mut rig = Rig::new(w.preset.pipeline.clone(), &refusing).unwrap();
            let backend = rig.backend(&config).unwrap();
            let (enabled, log) = offload_tests::capture_logs(|| {
                rig.runtime.enable(backend).map_err(|(e, _)| e.to_string())
            });
            enabled.unwrap_or_else(|e| panic!("device budget {k}/4, pin {n} refused: {e}"));
            if !log.contains("is brought in from pageable memory at each of its phases") {
                rig.runtime.disable().unwrap();
                continue;
            }
            staged_held += 1;
            rig.request(&w).unwrap();
            rig.device.lose();
            assert!(
                rig.runtime.disable().is_err(),
                "the drain was planned to fail"
            );
            assert_eq!(
                offload_core::runtime::staging_fill_threads_alive(),
                0,
                "device budget {k}/4, pin {n} refused: the upload buffer's fill thread outlived a failed drain"
            );
        }
    }
    assert!(
        staged_held > 0,
        "some refused pin staged a swapped held unit"
    );
}

/// INV-2 read from the device's host allocations: each offloaded storage's
/// bytes are held by exactly one pinned or registered allocation.
#[test]
fn inv2_a_second_host_copy() {
    let census = |bugs: &[PlantedBug]| {
        let o = opts(bugs);
        let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
        let backend = rig.backend(&layerwise()).unwrap();
        rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
        let pipeline = tiny().pipeline;
        let config = OffloadConfig {
            enable_layerwise_offload: true,
            ..OffloadConfig::default()
        };
        let offloaded = offload_core::runtime::offloaded_storages(&pipeline, &config).unwrap();
        let found = host_master_census(
            &rig.device,
            &pipeline,
            &SyntheticWeights { seed: 0 },
            &offloaded,
        );
        let identifiable: Vec<_> = offloaded
            .into_iter()
            .filter(|s| pipeline.storage(*s).bytes >= 16)
            .collect();
        assert!(identifiable.len() > 10, "the census sees the blocks");
        one_host_master(identifiable, found)
    };
    assert!(census(&[]).is_ok());
    let v = census(&[PlantedBug::SecondHostCopy]).expect_err("two masters per storage");
    assert_eq!(v.invariant, Invariant::OneHostMaster);
    assert!(v.to_string().contains("has 2 host masters"), "{v}");
    // The device's own counters see it too (INV-7's host bound).
    caught(
        &seen(&layerwise(), &[PlantedBug::SecondHostCopy]).violations,
        Invariant::BoundedMemory,
        "host weight bytes",
    );
}

fn claims(rt: &Runtime<Sim>) -> Vec<(String, String, String)> {
    rt.model().hook_claims()
}

#[test]
fn inv1_two_strategies_on_one_pipeline() {
    let attempt = |bugs: &[PlantedBug]| {
        let o = opts(bugs);
        let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
        let mut model_level = rig.backend(&model_level()).unwrap();
        model_level.enable(rig.runtime.model_mut()).unwrap();
        let mut lw = rig.backend(&layerwise()).unwrap();
        let enabled = lw.enable(rig.runtime.model_mut());
        let hooks = claims(&rig.runtime);
        let names = [
            OffloadStrategy::ModelLevel.hook_name(),
            OffloadStrategy::Layerwise.hook_name(),
            OffloadStrategy::DistributedLayerwise.hook_name(),
        ];
        let verdict = single_owner(
            hooks.iter().map(|(m, h, o)| HookClaim {
                module: m,
                hook: h,
                owner: o,
            }),
            &names,
            std::iter::empty(),
        );
        let _ = lw.disable(rig.runtime.model_mut());
        let _ = model_level.disable(rig.runtime.model_mut());
        (enabled.is_ok(), verdict)
    };
    let (enabled, verdict) = attempt(&[]);
    assert!(!enabled, "the second strategy must refuse to enable");
    assert!(verdict.is_ok());
    let (enabled, verdict) = attempt(&[PlantedBug::IgnoreOtherOwner]);
    assert!(enabled);
    let v = verdict.expect_err("two owners of offload hooks");
    assert_eq!(v.invariant, Invariant::SingleOwner);
}

/// A hook another owner registered under the layerwise name, on block 3.
struct Impostor;
impl ModelHook<ForwardCtx> for Impostor {}

#[test]
fn inv5_failed_enable_rolls_back_its_hooks() {
    let attempt = |bugs: &[PlantedBug]| {
        let o = opts(bugs);
        let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
        let p: &Pipeline = &rig.runtime.model().pipeline;
        let block = blocks_of(p, p.module_id("transformer").unwrap())[3];
        rig.runtime
            .model_mut()
            .hooks_of(block)
            .register(
                OffloadStrategy::Layerwise.hook_name(),
                HookOwner::new("impostor"),
                Box::new(Impostor),
            )
            .unwrap();
        let before = claims(&rig.runtime);
        let backend = rig.backend(&layerwise()).unwrap();
        let err = rig
            .runtime
            .enable(backend)
            .map(|_| ())
            .map_err(|(e, _)| e.to_string());
        let after = claims(&rig.runtime);
        (err, fail_before_mutate(&before, &after))
    };
    // The owner check refuses before anything is touched.
    let (err, verdict) = attempt(&[]);
    assert!(err.unwrap_err().contains("INV-1"));
    assert!(verdict.is_ok());
    // Past the owner check, registration fails on block 3: rollback removes
    // the hooks of blocks 0–2.
    let (err, verdict) = attempt(&[PlantedBug::IgnoreOtherOwner]);
    assert!(err.unwrap_err().contains("impostor"));
    assert!(verdict.is_ok());
    let (_, verdict) = attempt(&[PlantedBug::IgnoreOtherOwner, PlantedBug::NoRollback]);
    let v = verdict.expect_err("hooks left behind");
    assert_eq!(v.invariant, Invariant::FailBeforeMutate);
}

/// One view as the device lends it.
struct Lent {
    tensor: TensorId,
    buffer: u64,
    range: std::ops::Range<u64>,
    checksum: u64,
}

/// Reads every tensor of `scope` (`tensors`) through its view: the device
/// range it spans and a kernel's checksum of its bytes.
fn lend(
    rig: &Rig,
    scope: &Scope<'_, Sim>,
    tensors: &[TensorId],
    out: &mut Vec<Vec<Lent>>,
) -> Result<(), offload_core::OffloadError> {
    let mut group = Vec::new();
    for t in tensors {
        let v = scope.view_id(*t)?;
        let acc = &rig.probe.output;
        rig.device
            .reset_accumulator(scope.stream(), acc)
            .map_err(|e| offload_core::OffloadError::device("reset output", e))?;
        kernel(scope, &[*t], 1.0, "read", acc)?;
        rig.device
            .synchronize_stream(scope.stream())
            .map_err(|e| offload_core::OffloadError::device("synchronize_stream", e))?;
        group.push(Lent {
            tensor: *t,
            buffer: v.buffer().id(),
            range: v.byte_range(),
            checksum: rig.device.read_accumulator(acc),
        });
    }
    out.push(group);
    Ok(())
}

/// INV-4's facts of every tensor, observed from the views the device lends:
/// values (a kernel's checksum), the bytes each view spans, and aliasing
/// (views lent together that share device memory), numbered canonically.
fn tensor_facts(bugs: &[PlantedBug], choice: &StrategyChoice) -> Vec<TensorFacts> {
    let o = opts(bugs);
    let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
    let backend = rig.backend(choice).unwrap();
    rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
    let p = rig.runtime.model().pipeline.clone();
    let mut groups: Vec<Vec<Lent>> = Vec::new();
    for comp in ["text_encoder", "transformer", "transformer_2", "vae"] {
        rig.runtime
            .forward(comp, |scope| {
                let module = scope.module();
                let blocks: Vec<ModuleId> = blocks_of(&p, module);
                let in_blocks: Vec<_> = blocks.iter().flat_map(|b| p.subtree_tensors(*b)).collect();
                let own: Vec<TensorId> = p
                    .subtree_tensors(module)
                    .into_iter()
                    .filter(|t| !in_blocks.contains(t))
                    .collect();
                lend(&rig, scope, &own, &mut groups)?;
                for b in blocks {
                    let rel = p.module(b).path[p.module(module).path.len() + 1..].to_owned();
                    scope.child(&rel, |blk| {
                        Ok(lend(&rig, blk, &p.subtree_tensors(b), &mut groups)?)
                    })?;
                }
                Ok(())
            })
            .unwrap();
    }
    rig.runtime.disable().unwrap();
    // Alias classes: within a group of views lent together, views whose
    // device ranges overlap share memory; classes are numbered in order of
    // first appearance, so runs on different devices compare.
    let mut class: BTreeMap<TensorId, u32> = BTreeMap::new();
    let mut next = 0u32;
    let mut facts: BTreeMap<TensorId, (u64, u64)> = BTreeMap::new();
    for group in &groups {
        for (i, a) in group.iter().enumerate() {
            let shared = group[..i].iter().find(|b| {
                b.buffer == a.buffer && a.range.start < b.range.end && b.range.start < a.range.end
            });
            let c = match shared {
                Some(b) => class[&b.tensor],
                None => {
                    next += 1;
                    next
                }
            };
            class.insert(a.tensor, c);
            facts.insert(a.tensor, (a.range.end - a.range.start, a.checksum));
        }
    }
    p.tensors()
        .map(|(id, t)| TensorFacts {
            path: p.tensor_path(id),
            dtype: t.dtype.to_string(),
            shape: t.shape.clone(),
            strides: t.strides.clone(),
            storage_offset: t.storage_offset,
            view_bytes: facts[&id].0,
            alias_class: class[&id],
            checksum: facts[&id].1,
        })
        .collect()
}

#[test]
fn inv4_buffers_keep_their_values_and_aliasing_on_the_device() {
    let resident = tensor_facts(&[], &StrategyChoice::Resident);
    // The tied embedding shares its class; distinct storages do not.
    let tied: Vec<_> = resident
        .iter()
        .filter(|f| {
            f.path.starts_with("text_encoder.")
                && (f.path.ends_with("embed.weight") || f.path.ends_with("lm_head.weight"))
        })
        .collect();
    assert_eq!(tied.len(), 2);
    assert_eq!(tied[0].alias_class, tied[1].alias_class);
    for choice in [layerwise(), model_level()] {
        assert!(buffers_stay_correct(&resident, &tensor_facts(&[], &choice)).is_ok());
    }
    let v = buffers_stay_correct(
        &resident,
        &tensor_facts(&[PlantedBug::SkipNonPersistent], &layerwise()),
    )
    .expect_err("non-persistent buffers lost");
    assert_eq!(v.invariant, Invariant::BuffersStayCorrect);
    assert!(v.to_string().contains("pos_embed.freqs"), "{v}");
    // A storage placed two bytes off overlaps its neighbour on the device.
    let shifted = tensor_facts(&[PlantedBug::ShiftedPlacement], &layerwise());
    let v = buffers_stay_correct(&resident, &shifted).expect_err("placement shifted");
    assert_eq!(v.invariant, Invariant::BuffersStayCorrect);
    let merged = resident
        .iter()
        .zip(&shifted)
        .any(|(r, s)| r.alias_class != s.alias_class);
    assert!(merged, "the overlap shows as aliasing, not only as values");
}

/// The skipped-block path, deterministically: a cache skips block 2, so
/// block 3 arrives unprefetched and is copied on demand into a slot whose
/// last reader may still run.
#[test]
fn skipped_block_path() {
    let attempt = |bugs: &[PlantedBug]| {
        let o = opts(bugs);
        let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
        let p = rig.runtime.model().pipeline.clone();
        let blocks = blocks_of(&p, p.module_id("transformer").unwrap());
        let skip = Arc::new(Mutex::new(BTreeSet::from([blocks[2]])));
        BlockCache::install(rig.runtime.model_mut(), &blocks, &skip);
        let backend = rig.backend(&layerwise()).unwrap();
        rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
        // Step 0 runs the first expert, whose block 2 is skipped.
        let w = Workload {
            steps: 2,
            ..workload()
        };
        let output = rig.request(&w).unwrap().output;
        rig.runtime.disable().unwrap();
        (output, rig.device.violations())
    };
    let (clean, v) = attempt(&[]);
    assert!(v.is_empty(), "{v:#?}");
    let (_, v) = attempt(&[PlantedBug::OnDemandSkipLastUseWait]);
    caught(&v, Invariant::NoEarlyFree, OVERWRITE);
    let (_, v) = attempt(&[PlantedBug::SkipLastUseWait]);
    caught(&v, Invariant::NoEarlyFree, OVERWRITE);
    // The skip changes the output (block 2 did not run) but not between
    // clean runs.
    assert_eq!(attempt(&[]).0, clean);
}

/// The main job's own checks catch every ordering and memory mutation its
/// workload reaches (the second expert's on-demand first block and the
/// wrap-around included): the verdict fails, with the rule named.
#[test]
fn the_main_job_catches_every_mutation() {
    let job = |bugs: &[PlantedBug]| {
        let args = JobArgs {
            model: "tiny".to_owned(),
            steps: 4,
            bugs: bugs.to_vec(),
            ..JobArgs::default()
        };
        run_job(&args, &mut |_| {}).expect("the job runs")
    };
    job(&[]).verdict().expect("clean");
    for bug in [
        PlantedBug::SkipLastUseWait,
        PlantedBug::SkipReadyWait,
        PlantedBug::LastUseBeforeCompute,
        PlantedBug::StaticSlot,
        PlantedBug::WrapAroundSkipLastUseWait,
        PlantedBug::OnDemandSkipLastUseWait,
        PlantedBug::WrongMaster,
        PlantedBug::StaleSlot,
        PlantedBug::IgnoreRingStamp,
        PlantedBug::ExtraSlot,
        PlantedBug::SecondHostCopy,
        PlantedBug::EvictWithoutLastUse,
        PlantedBug::BringInWithoutReady,
        PlantedBug::BringInBeforeEvict,
    ] {
        let out = job(&[bug]);
        assert!(out.verdict().is_err(), "the main job missed {bug:?}");
    }
    // On several ranks, the collective bugs the job's scenario reaches (the
    // fifth, an eager first fill, needs an encoder only rank 0 runs: see
    // tests/dlo.rs): a broken rule, or ranks failing with typed errors.
    for (bug, depth) in [
        (PlantedBug::DivergentCollectiveOrder, 2),
        (PlantedBug::WholeSlotGather, 1),
        (PlantedBug::StaticSlot, 1),
        (PlantedBug::ShardReuseBeforeGather, 2),
    ] {
        let args = JobArgs {
            model: "tiny".to_owned(),
            steps: 4,
            strategy: StrategySet::One(offload_core::OffloadStrategy::DistributedLayerwise),
            ranks: Some(2),
            prefetch_depth: Some(depth),
            bugs: vec![bug],
            ..JobArgs::default()
        };
        if let Ok(out) = run_job(&args, &mut |_| {}) {
            assert!(out.verdict().is_err(), "the main job missed {bug:?}");
        }
    }
    // Distributed layerwise runs on as many simulated GPUs as the
    // configuration's world; a --ranks that disagrees is an error, not a row.
    let dlo = std::env::temp_dir().join(format!("offload-dlo-{}.json", std::process::id()));
    std::fs::write(
        &dlo,
        r#"{"enable_distributed_layerwise_offload": true, "parallel": {"data_parallel_size": 2}}"#,
    )
    .unwrap();
    let args = JobArgs {
        model: "tiny".to_owned(),
        config: Some(dlo.clone()),
        steps: 3,
        ..JobArgs::default()
    };
    let out = run_job(&args, &mut |_| {}).expect("DLO on two ranks");
    assert!(out.verdict().is_ok());
    assert_eq!(out.reports[0].per_rank.len(), 2);
    let e = run_job(
        &JobArgs {
            ranks: Some(4),
            ..args
        },
        &mut |_| {},
    )
    .expect_err("four ranks for a world of two");
    assert!(e.to_string().contains("world of 2"), "{e}");
}

/// The table `BENCHMARKS.md` quotes: for each planted bug, what the
/// simulator caught it with (checker invariant, output). Every row must be
/// caught by something.
#[test]
fn sim_catch_table() {
    let rows: Vec<(PlantedBug, StrategyChoice)> = vec![
        (PlantedBug::SkipLastUseWait, layerwise()),
        (PlantedBug::SkipReadyWait, layerwise()),
        (PlantedBug::LastUseBeforeCompute, layerwise()),
        (PlantedBug::StaticSlot, layerwise()),
        (PlantedBug::WrapAroundSkipLastUseWait, layerwise()),
        (PlantedBug::OnDemandSkipLastUseWait, layerwise()),
        (PlantedBug::WrongSlot, layerwise()),
        (PlantedBug::WrongMaster, layerwise()),
        (PlantedBug::StaleSlot, layerwise()),
        (PlantedBug::IgnoreRingStamp, layerwise()),
        (PlantedBug::ExtraSlot, layerwise()),
        (PlantedBug::SecondHostCopy, layerwise()),
        (PlantedBug::LeakHostMasters, layerwise()),
        (PlantedBug::EvictWithoutLastUse, model_level()),
        (PlantedBug::BringInWithoutReady, model_level()),
        (PlantedBug::BringInBeforeEvict, model_level()),
    ];
    println!("| planted bug | strategy | simulator checker | simulator output differs |");
    println!("| --- | --- | --- | --- |");
    for (bug, choice) in rows {
        let s = seen(&choice, &[bug]);
        let invariants: std::collections::BTreeSet<String> = s
            .violations
            .iter()
            .map(|v| v.invariant.id().to_owned())
            .collect();
        let strategy = match &choice {
            StrategyChoice::Config(c) => c.select().unwrap().strategy.to_string(),
            StrategyChoice::Resident => "none".to_owned(),
        };
        println!(
            "| {} | {strategy} | {} | {} |",
            bug.name(),
            if invariants.is_empty() {
                "–".to_owned()
            } else {
                invariants.into_iter().collect::<Vec<_>>().join(", ")
            },
            if s.output_differs { "yes" } else { "no" }
        );
        assert!(
            !s.violations.is_empty() || s.output_differs,
            "{bug:?} caught by nothing"
        );
    }
}

/// Model level refuses to bring a component in while another one runs its
/// forward (a nested forward would evict weights the running kernels still
/// read): a typed error, no early free, and the runtime goes on.
#[test]
fn model_level_refuses_a_nested_forward_of_another_component() {
    let o = opts(&[]);
    let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
    let backend = rig.backend(&model_level()).unwrap();
    rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
    let rt = &rig.runtime;
    let out = &rig.probe.output;
    let nested = rt.forward("transformer", |dit| {
        let p = dit.pipeline();
        let own = p.subtree_tensors(p.module_id("transformer.x_embedder").unwrap());
        kernel(dit, &own, 1e9, "dit", out)?;
        Ok(rt.forward("text_encoder", |_| Ok(()))?)
    });
    let e = nested.expect_err("the nested forward is refused");
    assert!(
        e.to_string()
            .contains("run one offloaded component at a time"),
        "{e}"
    );
    assert!(
        rig.device.violations().is_empty(),
        "{:#?}",
        rig.device.violations()
    );
    let w = workload();
    let expected = resident_outputs();
    assert_eq!(rig.request(&w).unwrap().output, expected[0]);
    rig.runtime.disable().unwrap();
    assert!(
        rig.device.violations().is_empty(),
        "{:#?}",
        rig.device.violations()
    );
}

/// The main job on the fault path: with copy faults injected (every copy of
/// the first forty in turn), a failed model-level bring-in that frees
/// without waiting for its copies fails the job's verdict; clean, it holds.
#[test]
fn the_main_job_catches_a_failed_bring_in_freeing_early() {
    let verdicts = |bugs: &[PlantedBug]| {
        (1..=40)
            .map(|n| {
                let args = JobArgs {
                    model: "tiny".to_owned(),
                    strategy: StrategySet::One(OffloadStrategy::ModelLevel),
                    steps: 4,
                    bugs: bugs.to_vec(),
                    faults: FaultPlan {
                        fail_copy_at: Some(n),
                        ..FaultPlan::none()
                    },
                    ..JobArgs::default()
                };
                run_job(&args, &mut |_| {})
                    .expect("faults are rows, not job errors")
                    .verdict()
            })
            .collect::<Vec<_>>()
    };
    assert!(verdicts(&[]).iter().all(Result::is_ok));
    assert!(
        verdicts(&[PlantedBug::FailedBringInFreeWithoutWait])
            .iter()
            .any(Result::is_err)
    );
}

/// "Does not fit" only when INV-7's own bound exceeds the device; running
/// out of memory within the bound is a memory bug and fails the job.
#[test]
fn out_of_memory_within_the_bound_is_a_bug_not_a_misfit() {
    let config = OffloadConfig {
        enable_cpu_offload: true,
        ..OffloadConfig::default()
    };
    // The weights' bound, and the largest activations of any phase (the
    // harness holds them beside the weights while a forward runs).
    let preset = tiny();
    let act = preset
        .dits
        .iter()
        .chain(&preset.encoders)
        .chain(&preset.vaes)
        .map(|c| preset.component_activation_bytes(&preset.pipeline, c, preset.default_tokens))
        .max()
        .unwrap();
    let bound = offload_core::runtime::memory_bounds(&preset.pipeline, &config, 1)
        .unwrap()
        .device_weight_bytes
        + act;
    let job = |memory: u64, bugs: &[PlantedBug]| {
        let args = JobArgs {
            model: "tiny".to_owned(),
            strategy: StrategySet::One(OffloadStrategy::ModelLevel),
            steps: 4,
            device_memory_bytes: Some(memory),
            bugs: bugs.to_vec(),
            ..JobArgs::default()
        };
        run_job(&args, &mut |_| {})
    };
    let fits = job(bound, &[]).expect("fits exactly");
    assert!(fits.reports[0].fits);
    fits.verdict().expect("clean");
    let short = job(bound - 1, &[]).expect("a row, not an error");
    assert!(!short.reports[0].fits, "one byte short does not fit");
    assert!(
        short.reports[0]
            .error
            .as_deref()
            .unwrap()
            .contains("INV-7's bound")
    );
    short.verdict().expect("not fitting breaks no rule");
    // Layerwise with one slot more than its bound: out of memory on a device
    // that holds the bound and the activations exactly is a bug.
    let layerwise = OffloadConfig {
        enable_layerwise_offload: true,
        ..OffloadConfig::default()
    };
    let lw_bound = offload_core::runtime::memory_bounds(&preset.pipeline, &layerwise, 1)
        .unwrap()
        .device_weight_bytes
        + act;
    let lw = |bugs: &[PlantedBug]| {
        let args = JobArgs {
            model: "tiny".to_owned(),
            strategy: StrategySet::One(OffloadStrategy::Layerwise),
            steps: 4,
            device_memory_bytes: Some(lw_bound),
            bugs: bugs.to_vec(),
            ..JobArgs::default()
        };
        run_job(&args, &mut |_| {})
    };
    lw(&[]).expect("fits exactly").verdict().expect("clean");
    let e = lw(&[PlantedBug::ExtraSlot]).expect_err("a memory bug");
    assert!(e.to_string().contains("a memory bug"), "{e}");
}

/// The planned backend's bugs, each caught by a checker that observes the
/// simulated device: a slot pool kept through a phase that streams nothing,
/// a phase that keeps the held sets of components not kept (INV-7 per
/// phase: the device's window peaks against the plan's phase bounds); the
/// composed engines' ordering bugs (INV-3: the order checker), a clean
/// control beside them.
#[test]
fn the_planned_backends_bugs_are_caught() {
    use offload_sim::harness::{RunOptions, StrategyChoice, Workload, run};
    let preset = tiny();
    let w = Workload {
        tokens: preset.default_tokens,
        preset: preset.clone(),
        steps: 4,
        requests: 2,
    };
    let opts = RunOptions::new(offload_sim::DeviceProfile::h200());
    let resident = run(&w, &StrategyChoice::Resident, &opts).unwrap();
    let want: Vec<u64> = resident.requests.iter().map(|r| r.output).collect();
    // A budget where the DiTs stream, the encoder swaps and the VAE runs
    // without slots.
    let inputs = offload_sim::plan::estimated_inputs(&w.preset, &opts.profile, w.tokens, 4);
    let least = match offload_core::budget::plan(
        &preset.pipeline,
        &OffloadConfig {
            device_budget: Some(offload_core::bytes::ByteSize::new(1).into()),
            ..OffloadConfig::default()
        },
        &inputs,
        offload_core::budget::DeviceMemory::of(1 << 40),
    ) {
        Err(offload_core::budget::BudgetError::DoesNotFit { minimum, .. }) => minimum,
        other => panic!("{other:?}"),
    };
    let config = OffloadConfig {
        device_budget: Some(offload_core::bytes::ByteSize::new(least + 4000).into()),
        ..OffloadConfig::default()
    };
    let caught = |bugs: &[PlantedBug]| {
        let opts = RunOptions {
            bugs: bugs.to_vec(),
            ..opts.clone()
        };
        match run(&w, &StrategyChoice::Config(config.clone()), &opts) {
            Ok(out) => {
                let outputs: Vec<u64> = out.requests.iter().map(|r| r.output).collect();
                let mut what = Vec::new();
                if !out.violations.is_empty() {
                    what.push(format!("INV-3/other: {}", out.violations[0]));
                }
                if let Some(v) = offload_sim::job::phase_violations(&out) {
                    what.push(format!("INV-7 per phase: {v}"));
                }
                if let Some(v) = offload_sim::job::memory_violations(&out) {
                    what.push(format!("INV-7: {v}"));
                }
                if outputs != want {
                    what.push("INV-8: outputs differ".to_owned());
                }
                what
            }
            Err(f) => vec![format!("failed: {}", f.error)]
                .into_iter()
                .chain(f.violations.iter().map(|v| v.to_string()))
                .collect(),
        }
    };
    assert_eq!(caught(&[]), Vec::<String>::new(), "the clean control");
    for (bug, needle) in [
        (PlantedBug::KeepPoolAcrossPhases, "INV-7 per phase"),
        (PlantedBug::SkipPhaseEviction, "INV-7 per phase"),
        (PlantedBug::EvictWithoutLastUse, "INV-3"),
        (PlantedBug::BringInWithoutReady, "INV-3"),
        (PlantedBug::SkipReadyWait, "INV-3"),
        (PlantedBug::SkipLastUseWait, "INV-3"),
        (PlantedBug::FreeWithoutDrain, "INV-3"),
    ] {
        let what = caught(&[bug]);
        println!("planted {} under a budget: {what:?}", bug.name());
        assert!(
            what.iter().any(|w| w.contains(needle)),
            "{} not caught by {needle}: {what:?}",
            bug.name()
        );
    }
}
