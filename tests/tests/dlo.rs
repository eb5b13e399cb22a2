//! Distributed layerwise offload on the multi-rank simulator: G simulated
//! devices, one thread per rank, one simulated gather group (CONTRACT §8).
//!
//! * Clean runs on 2, 3 and 4 ranks: outputs equal the resident runs',
//!   host masters are 1/G of the streamed weights (plus under G bytes of
//!   padding per block), every gathered block is handed back intact at
//!   disable, no rule broken.
//! * The five planted collective bugs, each caught, each beside a clean
//!   control of the same scenario.
//! * A rank failing before, inside or after a collective: every rank
//!   returns (no hang) with a typed error, and the backends are poisoned.
//! * Seeded scenarios (ranks, depth, encoders on one rank, jitter, faults):
//!   `OFFLOAD_DLO_CASES` of them (default 64; `cargo xtask props` runs
//!   2,000 in release).

use std::collections::BTreeMap;

use offload_core::OffloadConfig;
use offload_core::invariants::Invariant;
use offload_core::runtime::{PlantedBug, memory_bounds};
use offload_sim::harness::{RunOptions, StrategyChoice, Workload};
use offload_sim::multi::{EncoderRanks, MultiOptions, RankOutcome, outputs, run_ranks};
use offload_sim::presets::Preset;
use offload_sim::{DeviceProfile, FaultPlan, Jitter};
use rand::{Rng, SeedableRng};

fn tiny(steps: usize, requests: usize) -> Workload {
    let preset = Preset::by_name("tiny").unwrap();
    Workload {
        tokens: preset.default_tokens,
        preset,
        steps,
        requests,
    }
}

/// DLO over the flags (the DiT gathered).
fn dlo() -> StrategyChoice {
    StrategyChoice::Config(OffloadConfig {
        enable_distributed_layerwise_offload: true,
        ..OffloadConfig::default()
    })
}

/// DLO over the compact form: the DiT gathered, the text encoder streamed
/// rank-local (with [`EncoderRanks::First`], by rank 0 only).
fn dlo_with_local_encoder() -> StrategyChoice {
    let config: OffloadConfig = serde_json::from_str(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"],
            "layer_options": {"dit": {"weight_transfer": "allgather"},
                              "text_encoder": {"weight_transfer": "rank-local"}}}}"#,
    )
    .unwrap();
    StrategyChoice::Config(config)
}

fn multi(ranks: u32, depth: usize) -> MultiOptions {
    MultiOptions {
        ranks,
        run: RunOptions {
            prefetch_depth: depth,
            ..RunOptions::new(DeviceProfile::h200())
        },
        faults: Vec::new(),
        encoders: EncoderRanks::All,
    }
}

fn violations(ranks: &[RankOutcome]) -> Vec<String> {
    ranks
        .iter()
        .flat_map(|r| {
            r.violations()
                .iter()
                .map(move |v| format!("rank {}: {v}", r.rank))
        })
        .collect()
}

fn errors(ranks: &[RankOutcome]) -> Vec<String> {
    ranks
        .iter()
        .filter_map(|r| {
            r.result
                .as_ref()
                .err()
                .map(|f| format!("rank {}: {}", r.rank, f.error))
        })
        .collect()
}

/// Gathered blocks of `tiny` under the flags (both DiTs: 7 + 3).
const TINY_DIT_BLOCKS: usize = 10;

#[test]
fn ranks_match_resident_with_a_gth_of_the_host_bytes_and_restore_every_block() {
    for g in [2u32, 3, 4] {
        let w = tiny(4, 2);
        let m = multi(g, 1);
        let resident = run_ranks(&w, &StrategyChoice::Resident, &m).unwrap();
        let ranks = run_ranks(&w, &dlo(), &m).unwrap();
        assert_eq!(errors(&ranks), Vec::<String>::new(), "G={g}");
        assert_eq!(violations(&ranks), Vec::<String>::new(), "G={g}");
        assert_eq!(outputs(&ranks), outputs(&resident), "G={g}");
        let mut config = OffloadConfig {
            enable_distributed_layerwise_offload: true,
            ..OffloadConfig::default()
        };
        config.parallel.data_parallel_size = g;
        let whole = memory_bounds(&w.preset.pipeline, &config, 1).unwrap();
        assert_eq!(whole.group_size, g);
        for r in &ranks {
            let out = r.result.as_ref().unwrap();
            let held = out.after_enable.pinned_bytes + out.after_enable.registered_bytes;
            // 1/G of the streamed weights, plus under G bytes per block.
            let share = whole.offloaded_bytes.div_ceil(u64::from(g));
            assert!(
                held >= share && held < share + TINY_DIT_BLOCKS as u64 * u64::from(g),
                "G={g} rank {}: {held} host bytes for a share of {share}",
                r.rank
            );
            assert_eq!(r.restored_blocks, TINY_DIT_BLOCKS, "G={g} rank {}", r.rank);
            assert!(!out.poisoned);
            // Every gather of every rank: the ranks agree (INV-9 is quiet).
            assert_eq!(r.gathers.len(), ranks[0].gathers.len());
        }
    }
}

/// What a planted bug did to a scenario: the invariants the devices saw
/// broken, whether an output differs from resident, and the errors.
#[derive(Debug, Default)]
struct Seen {
    invariants: std::collections::BTreeSet<&'static str>,
    output_differs: bool,
    errors: Vec<String>,
}

impl Seen {
    fn caught(&self) -> bool {
        !self.invariants.is_empty() || self.output_differs || !self.errors.is_empty()
    }
}

fn seen(choice: &StrategyChoice, m: &MultiOptions, bugs: &[PlantedBug]) -> Seen {
    let w = tiny(4, 2);
    let resident = run_ranks(&w, &StrategyChoice::Resident, m).unwrap();
    let m = MultiOptions {
        run: RunOptions {
            bugs: bugs.to_vec(),
            ..m.run.clone()
        },
        ..m.clone()
    };
    let ranks = run_ranks(&w, choice, &m).unwrap();
    Seen {
        invariants: ranks
            .iter()
            .flat_map(|r| r.violations().iter().map(|v| v.invariant.id()))
            .collect(),
        output_differs: outputs(&ranks)
            .iter()
            .zip(outputs(&resident))
            .any(|(a, b)| a.is_some() && *a != b),
        errors: errors(&ranks),
    }
}

/// The planted collective bugs and the scenario each is caught in.
fn collective_bugs() -> Vec<(PlantedBug, StrategyChoice, MultiOptions, Invariant)> {
    let first = MultiOptions {
        encoders: EncoderRanks::First,
        ..multi(2, 1)
    };
    vec![
        (
            PlantedBug::DivergentCollectiveOrder,
            dlo(),
            multi(2, 2),
            Invariant::CollectiveAgreement,
        ),
        (
            PlantedBug::WholeSlotGather,
            dlo(),
            multi(2, 1),
            Invariant::CollectiveAgreement,
        ),
        (
            PlantedBug::StaticSlot,
            dlo(),
            multi(2, 1),
            Invariant::NoEarlyFree,
        ),
        (
            PlantedBug::ShardReuseBeforeGather,
            dlo(),
            multi(2, 2),
            Invariant::NoEarlyFree,
        ),
        (
            PlantedBug::EagerFirstFill,
            dlo_with_local_encoder(),
            first,
            Invariant::CollectiveAgreement,
        ),
    ]
}

/// Each planted collective bug is caught by the invariant it breaks, and
/// the same scenario without it is clean. Prints the table BENCHMARKS.md
/// quotes.
#[test]
fn every_planted_collective_bug_is_caught_beside_a_clean_control() {
    println!("| planted bug | ranks, depth | checker | output differs | ranks failing |");
    println!("| --- | --- | --- | --- | --- |");
    for (bug, choice, m, invariant) in collective_bugs() {
        let control = seen(&choice, &m, &[]);
        assert!(
            !control.caught(),
            "{bug:?}'s scenario is not clean without it: {control:?}"
        );
        let s = seen(&choice, &m, &[bug]);
        println!(
            "| {} | {}, {} | {} | {} | {} |",
            bug.name(),
            m.ranks,
            m.run.prefetch_depth,
            s.invariants.iter().copied().collect::<Vec<_>>().join(", "),
            s.output_differs,
            s.errors.len()
        );
        assert!(
            s.invariants.contains(invariant.id()),
            "{bug:?} not caught by {}: {s:?}",
            invariant.id()
        );
    }
}

/// Where a fault hits one rank, relative to the collectives.
fn fault_runs() -> Vec<(&'static str, FaultPlan)> {
    vec![
        (
            "before any collective (enable runs out of memory)",
            FaultPlan {
                fail_alloc_at: Some(8),
                ..FaultPlan::none()
            },
        ),
        (
            "inside collective #4",
            FaultPlan {
                fail_collective_at: Some(4),
                ..FaultPlan::none()
            },
        ),
        (
            "after collective #6 (a shard copy fails)",
            FaultPlan {
                fail_copy_at: Some(9),
                ..FaultPlan::none()
            },
        ),
    ]
}

#[test]
fn a_failing_rank_gives_every_rank_a_typed_error_and_poisons_the_backends() {
    for (when, fault) in fault_runs() {
        let w = tiny(4, 2);
        let mut m = multi(3, 1);
        m.faults = vec![FaultPlan::none(), fault, FaultPlan::none()];
        let ranks = run_ranks(&w, &dlo(), &m).unwrap();
        for r in &ranks {
            let f = r
                .result
                .as_ref()
                .err()
                .unwrap_or_else(|| panic!("{when}: rank {} succeeded", r.rank));
            let text = f.error.to_string();
            assert!(!text.is_empty(), "{when}");
            if r.rank != 1 {
                assert!(
                    text.contains("rank 1") || text.contains("broken"),
                    "{when}: rank {} error does not name rank 1: {text}",
                    r.rank
                );
            }
            assert!(f.poisoned, "{when}: rank {} not poisoned ({text})", r.rank);
            // A failure inside a forward's collective or copy poisons the
            // backend from its own hook, before the runtime says anything.
            if !when.starts_with("before") {
                assert!(
                    f.poisoned_by_hooks,
                    "{when}: rank {}'s hooks did not poison it ({text})",
                    r.rank
                );
            }
            // No rule broken, INV-9 included: no rank issued a collective
            // the others did not (the disable of a failed rank gathers
            // nothing).
            let broken: Vec<String> = f.violations.iter().map(ToString::to_string).collect();
            assert_eq!(broken, Vec::<String>::new(), "{when}: rank {}", r.rank);
        }
    }
}

/// Every rank's outputs, request by request.
type Outputs = Vec<Option<Vec<u64>>>;

fn cases() -> u64 {
    std::env::var("OFFLOAD_DLO_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64)
}

/// Seeded multi-rank scenarios: ranks, depth, encoders on rank 0 only,
/// requests, steps, jitter and (in half of them) one fault on one rank.
/// Never a hang; without a fault every rank matches resident with no rule
/// broken; with one, every rank either matches resident or fails with a
/// typed error, and no rule is broken (INV-9 included: a failed rank's
/// disable issues no collective).
#[test]
fn seeded_multi_rank_scenarios() {
    let n = cases();
    let seed = offload_sim::faults::seed_from_env(0x00d1_0000);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut resident: BTreeMap<(u32, bool, usize, usize), Outputs> = BTreeMap::new();
    let (mut faulted, mut failed_ranks) = (0u64, 0u64);
    for case in 0..n {
        let g = rng.random_range(2..=4u32);
        let depth = rng.random_range(1..=3usize);
        let first = rng.random_bool(0.3);
        let steps = rng.random_range(1..=4usize);
        let requests = rng.random_range(1..=2usize);
        let w = tiny(steps, requests);
        let mut m = multi(g, 1);
        m.encoders = if first {
            EncoderRanks::First
        } else {
            EncoderRanks::All
        };
        let choice = if first {
            dlo_with_local_encoder()
        } else {
            dlo()
        };
        let key = (g, first, steps, requests);
        let base = resident
            .entry(key)
            .or_insert_with(|| outputs(&run_ranks(&w, &StrategyChoice::Resident, &m).unwrap()))
            .clone();
        m.run.prefetch_depth = depth;
        m.run.jitter = rng.random_bool(0.5).then(|| Jitter {
            seed: rng.random(),
            probability: 0.3,
            max_ns: 50_000,
        });
        let fault = rng.random_bool(0.5).then(|| {
            let rank = rng.random_range(0..g) as usize;
            let mut plan = FaultPlan::none();
            match rng.random_range(0..3) {
                0 => plan.fail_alloc_at = Some(rng.random_range(1..=40)),
                1 => plan.fail_copy_at = Some(rng.random_range(1..=60)),
                _ => plan.fail_collective_at = Some(rng.random_range(1..=60)),
            }
            (rank, plan)
        });
        if let Some((rank, plan)) = fault {
            m.faults = vec![FaultPlan::none(); g as usize];
            m.faults[rank] = plan;
            faulted += 1;
        }
        let ranks = run_ranks(&w, &choice, &m).unwrap();
        let what = format!(
            "case {case} (OFFLOAD_SIM_SEED={seed}): G={g} depth={depth} encoders-on-rank-0-only={first} steps={steps} requests={requests} fault={fault:?}"
        );
        let got = outputs(&ranks);
        if fault.is_none() {
            assert_eq!(errors(&ranks), Vec::<String>::new(), "{what}");
            assert_eq!(violations(&ranks), Vec::<String>::new(), "{what}");
            assert_eq!(got, base, "{what}");
            continue;
        }
        for (r, out) in ranks.iter().zip(&got) {
            match (&r.result, out) {
                (Ok(_), Some(o)) => assert_eq!(Some(o), base[r.rank as usize].as_ref(), "{what}"),
                (Err(_), _) => failed_ranks += 1,
                _ => unreachable!(),
            }
            let broken: Vec<String> = r.violations().iter().map(ToString::to_string).collect();
            assert_eq!(broken, Vec::<String>::new(), "{what}: rank {}", r.rank);
        }
    }
    println!(
        "{n} seeded multi-rank scenarios, {faulted} with a fault, {failed_ranks} ranks failed with a typed error, 0 hangs"
    );
}

/// DLO's enable issues no collective (every ring's first fill waits for
/// its first forward): each rank's first collective is the runtime's own
/// prompt-embedding gather, on every rank.
#[test]
fn enable_issues_no_collective() {
    let w = tiny(2, 1);
    let ranks = run_ranks(&w, &dlo(), &multi(2, 1)).unwrap();
    assert_eq!(errors(&ranks), Vec::<String>::new());
    for r in &ranks {
        let first = r.gathers.first().expect("gathers");
        assert_eq!(
            first.shard_bytes,
            offload_sim::multi::embed_shard_bytes(1),
            "rank {}: its first collective is not the runtime's ({first:?})",
            r.rank
        );
    }
}

/// A poisoned backend's `disable` runs no collective and restores nothing;
/// the same disable, not poisoned, gathers every block once more.
#[test]
fn a_poisoned_disable_gathers_nothing() {
    use offload_sim::harness::Rig;
    use std::sync::{Arc, Mutex};

    struct Counting(offload_sim::presets::SyntheticWeights, Mutex<usize>);
    impl offload_core::runtime::WeightSource for Counting {
        fn read(&self, s: offload_core::model::StorageId, p: u64, d: &mut [u8]) {
            self.0.read(s, p, d);
        }
        fn restore(&self, _: &offload_core::runtime::Unit, _: &[u8]) {
            *self.1.lock().unwrap() += 1;
        }
    }
    for poison in [false, true] {
        let w = tiny(2, 1);
        let opts = RunOptions::new(DeviceProfile::h200());
        let devices: Vec<offload_sim::SimDevice> = (0..2)
            .map(|_| offload_sim::SimDevice::new(opts.sim_config()).unwrap())
            .collect();
        let group = offload_sim::SimGroup::new(&devices).ranks().unwrap();
        let results: Vec<(usize, usize, usize)> = std::thread::scope(|s| {
            let handles: Vec<_> = devices
                .into_iter()
                .zip(group)
                .enumerate()
                .map(|(r, (device, collective))| {
                    let (w, opts) = (&w, &opts);
                    s.spawn(move || {
                        let weights = Arc::new(Counting(
                            offload_sim::presets::SyntheticWeights { seed: 0 },
                            Mutex::new(0),
                        ));
                        let mut rig = Rig::on_device(
                            device.clone(),
                            w.preset.pipeline.clone(),
                            opts,
                            Arc::clone(&weights) as Arc<dyn offload_core::runtime::WeightSource>,
                            Some(collective.clone()),
                        )
                        .unwrap();
                        let mut config = OffloadConfig {
                            enable_distributed_layerwise_offload: true,
                            ..OffloadConfig::default()
                        };
                        config.parallel.data_parallel_size = 2;
                        config.parallel.rank = r as u32;
                        let backend = rig.backend(&StrategyChoice::Config(config)).unwrap();
                        rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
                        rig.request(w).unwrap();
                        if poison {
                            rig.runtime.poison("the test says so");
                        }
                        let before = collective.log().len();
                        let disabled = rig.runtime.disable();
                        assert!(disabled.is_ok(), "{:?}", disabled.err());
                        device.synchronize_all();
                        let after = collective.log().len();
                        let restored = *weights.1.lock().unwrap();
                        (before, after, restored)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (before, after, restored) in results {
            if poison {
                assert_eq!((after, restored), (before, 0), "poisoned: no collective");
            } else {
                // A gather per block not already in flight (the wrap-around
                // prefetch is reused).
                assert!(
                    after - before >= TINY_DIT_BLOCKS - 1,
                    "{before} → {after} gathers"
                );
                assert_eq!(restored, TINY_DIT_BLOCKS);
            }
        }
    }
}

/// Rank-local DLO with resident leading layers (CONTRACT §8): the first N
/// blocks of the DiTs stay on the device, the rest stream; the output
/// equals resident, the device peak is INV-7's bound (which counts the
/// resident blocks), no rule is broken. One rank: rank-local mode needs no
/// group.
#[test]
fn rank_local_with_resident_leading_layers_matches_resident() {
    use offload_sim::harness::run;
    let w = tiny(4, 2);
    let opts = RunOptions::new(DeviceProfile::h200());
    let resident = run(&w, &StrategyChoice::Resident, &opts).unwrap();
    let outputs = |o: &offload_sim::harness::RunOutcome| -> Vec<u64> {
        o.requests.iter().map(|r| r.output).collect()
    };
    let mut streamed = Vec::new();
    for layers in [0u32, 1] {
        let config = OffloadConfig {
            enable_distributed_layerwise_offload: true,
            dlo_use_allgather: Some(false),
            dlo_resident_layers: Some(layers),
            ..OffloadConfig::default()
        };
        let out = run(&w, &StrategyChoice::Config(config), &opts)
            .unwrap_or_else(|f| panic!("{layers} resident layers: {}", f.error));
        assert_eq!(out.violations, vec![], "{layers} resident layers");
        assert_eq!(
            outputs(&out),
            outputs(&resident),
            "{layers} resident layers"
        );
        assert!(out.at_end.device_peak_bytes <= out.bounds.device_weight_bytes);
        streamed.push((out.bounds.offloaded_bytes, out.bounds.resident_bytes));
    }
    assert!(
        streamed[1].0 < streamed[0].0 && streamed[1].1 > streamed[0].1,
        "resident layers move bytes from streamed to resident: {streamed:?}"
    );
    // Two would leave `transformer_2` (3 blocks) one streaming block: a
    // typed error before anything moves.
    let config = OffloadConfig {
        enable_distributed_layerwise_offload: true,
        dlo_use_allgather: Some(false),
        dlo_resident_layers: Some(2),
        ..OffloadConfig::default()
    };
    let e = run(&w, &StrategyChoice::Config(config), &opts).expect_err("one streaming block");
    assert!(
        e.error.to_string().contains("one streaming block"),
        "{}",
        e.error
    );
}
