//! The device-memory budget planner (CONTRACT §7a): property-tested on
//! arbitrary stacks of blocks, budgets and compute, against checks that do
//! not trust the planner's report of itself (INV-7's bounds of the
//! configuration it returns, the resolver's streamed bytes), then run on
//! the simulated device, whose own allocation counter must stay within the
//! budget.

use std::collections::BTreeMap;

use offload_core::budget::{BudgetError, BudgetPlan, ByteSize, PlannerInputs, plan};
use offload_core::model::{DType, Pipeline, PipelineBuilder};
use offload_core::runtime::memory_bounds;
use offload_core::{ComponentDeclaration, OffloadConfig, resolve};
use offload_sim::DeviceProfile;
use offload_sim::harness::{RunOptions, StrategyChoice, Workload, run};
use offload_sim::presets::tiny;
use proptest::prelude::*;

/// A DiT with `double` blocks of width `h1` then `single` of width `h2`,
/// `extra` bytes of embeddings outside them.
fn dit(double: usize, h1: u64, single: usize, h2: u64, extra: u64) -> Pipeline {
    with_encoder(double, h1, single, h2, extra, 0, 0)
}

/// [`dit`] plus a text encoder of `layers` blocks of width `he` (none for 0).
fn with_encoder(
    double: usize,
    h1: u64,
    single: usize,
    h2: u64,
    extra: u64,
    layers: usize,
    he: u64,
) -> Pipeline {
    let mut b = PipelineBuilder::new("Budget");
    if layers > 0 {
        let mut e = b.module("text_encoder");
        e.parameter("embed.weight", DType::Bf16, &[64, 4]);
        e.list("layers", layers, |_, l| {
            l.parameter("fc.weight", DType::Bf16, &[3 * he, he]);
        });
        e.block_containers(&["layers"]);
    }
    {
        let mut m = b.module("transformer");
        m.parameter("x_embedder.weight", DType::Bf16, &[extra.max(1), 1]);
        m.list("transformer_blocks", double, |_, blk| {
            blk.parameter("qkv.weight", DType::Bf16, &[3 * h1, h1])
                .parameter("ff.weight", DType::Bf16, &[4 * h1, h1]);
        });
        m.list("single_transformer_blocks", single, |_, blk| {
            blk.parameter("mlp.weight", DType::Bf16, &[5 * h2, h2]);
        });
        m.block_containers(&["transformer_blocks", "single_transformer_blocks"]);
    }
    b.declare_components(ComponentDeclaration {
        dit: vec!["transformer".into()],
        encoder: if layers > 0 {
            vec!["text_encoder".into()]
        } else {
            vec![]
        },
        vae: vec![],
        resident: vec![],
    });
    b.build().expect("the test DiT builds")
}

fn budget_config(bytes: u64) -> OffloadConfig {
    OffloadConfig {
        device_budget: Some(ByteSize(bytes).into()),
        ..OffloadConfig::default()
    }
}

/// A budget that streams the DiT and the text encoder (the compact form).
fn budget_config_both(bytes: u64) -> OffloadConfig {
    OffloadConfig::from_json_str(&format!(
        r#"{{"device_budget": {bytes}, "diffusion_offload_config": {{"mode": "layer", "components": ["dit", "text_encoder"]}}}}"#
    ))
    .unwrap()
}

/// Block sizes of each stack `config` streams, and the non-block bytes.
fn sizes(p: &Pipeline, config: &OffloadConfig) -> (Vec<Vec<(String, u64)>>, u64) {
    let mut layerwise = config.clone();
    layerwise.device_budget = None;
    if layerwise.diffusion_offload_config.is_none() {
        layerwise.enable_layerwise_offload = true;
    }
    let plan = resolve(p, &layerwise).unwrap();
    let stacks: Vec<Vec<(String, u64)>> = plan
        .stacks
        .iter()
        .map(|s| s.blocks.iter().map(|b| (b.path.clone(), b.bytes)).collect())
        .collect();
    let total: u64 = p.storages().map(|(_, s)| s.bytes).sum();
    let in_blocks: u64 = stacks.iter().flatten().map(|(_, b)| b).sum();
    (stacks, total - in_blocks)
}

/// The least budget, derived here from its definition: over every slot
/// size σ, the non-block part + blocks above σ (and, per stack, a lone
/// block at or below it, which cannot form a ring) + two slots of the
/// largest block left streaming + activations.
fn least_budget(stacks: &[Vec<(String, u64)>], non_block: u64, act: u64) -> u64 {
    stacks
        .iter()
        .flatten()
        .map(|(_, sigma)| {
            let (mut forced, mut slot) = (0, 0);
            for blocks in stacks {
                let small: Vec<u64> = blocks
                    .iter()
                    .map(|(_, b)| *b)
                    .filter(|b| b <= sigma)
                    .collect();
                forced += blocks
                    .iter()
                    .map(|(_, b)| *b)
                    .filter(|b| b > sigma)
                    .sum::<u64>();
                match small.len() {
                    1 => forced += small[0],
                    _ => slot = slot.max(small.iter().copied().max().unwrap_or(0)),
                }
            }
            non_block + forced + 2 * slot + act
        })
        .min()
        .unwrap()
}

/// Every promise a plan makes, checked from outside the planner.
fn check_plan(p: &Pipeline, planned: &BudgetPlan, budget: u64, act: u64) {
    // INV-7's bound of the configuration it returns, plus activations.
    let bounds = memory_bounds(p, &planned.config, planned.depth.max(1)).unwrap();
    assert!(
        bounds.device_weight_bytes + act <= budget,
        "over budget: weights {} + activations {act} > {budget}\n{planned}",
        bounds.device_weight_bytes
    );
    assert_eq!(bounds.device_weight_bytes + act, planned.peak_bytes);
    let resolved = resolve(p, &planned.config).unwrap();
    assert_eq!(resolved.streamed_bytes(), planned.streamed_bytes);
    let all: Vec<u64> = resolved
        .stacks
        .iter()
        .flat_map(|s| s.streamed().map(|b| b.bytes))
        .collect();
    if all.is_empty() {
        assert_eq!(planned.slots, 0);
        return;
    }
    // Never fewer than two slots; never one streaming block in a ring.
    assert!(planned.slots >= 2 && planned.depth >= 1, "{planned}");
    assert_eq!(planned.slots, planned.depth + 1);
    let slot = *all.iter().max().unwrap();
    let room = budget - planned.peak_bytes;
    for stack in &resolved.stacks {
        let streamed: Vec<u64> = stack.streamed().map(|b| b.bytes).collect();
        assert!(streamed.len() != 1, "a ring of one\n{planned}");
        // As much as fits: no streamed block below the slot size would fit
        // in what is left (or it would leave a single streamed block);
        // making the largest resident could shrink the slots, and the
        // planner tried that slot size too.
        for b in &streamed {
            let needed = if streamed.len() == 2 {
                streamed.iter().sum()
            } else {
                *b
            };
            if *b < slot {
                assert!(
                    needed > room,
                    "block of {b} B fits in {room} B left\n{planned}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("OFFLOAD_BUDGET_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_planner_never_exceeds_the_budget_and_reports_the_least_one_exactly(
        double in 0usize..6,
        h1 in prop::sample::select(vec![8u64, 16, 24]),
        single in 0usize..10,
        h2 in prop::sample::select(vec![4u64, 8, 16]),
        extra in 0u64..4096,
        act in 0u64..20_000,
        fraction in 0.0f64..1.3,
        compute in prop::collection::vec(0.0f64..2e-3, 16),
        link in 1e3f64..1e6,
        max_depth in 1usize..4,
        layers in prop::sample::select(vec![0usize, 0, 2, 3]),
        he in prop::sample::select(vec![4u64, 12, 40]),
    ) {
        prop_assume!(double + single >= 2);
        let p = with_encoder(double, h1, single, h2, extra, layers, he);
        let config_of = |b: u64| if layers > 0 { budget_config_both(b) } else { budget_config(b) };
        let (stacks, non_block) = sizes(&p, &config_of(1));
        let blocks: Vec<(String, u64)> = stacks.iter().flatten().cloned().collect();
        let total: u64 = non_block + blocks.iter().map(|(_, b)| b).sum::<u64>();
        let budget = ((total + act) as f64 * fraction) as u64 + 1;
        let inputs = PlannerInputs {
            link_bytes_per_s: link,
            block_compute_s: blocks
                .iter()
                .enumerate()
                .map(|(i, (path, _))| (path.clone(), compute[i % compute.len()]))
                .collect::<BTreeMap<_, _>>(),
            activation_bytes: act,
            max_depth,
            ..PlannerInputs::default()
        };
        let least = least_budget(&stacks, non_block, act).min(total + act);
        match plan(&p, &config_of(budget), &inputs) {
            Ok(planned) => {
                prop_assert!(budget >= least, "planned below the least budget {least}: {planned}");
                prop_assert_eq!(planned.minimum_bytes, least);
                check_plan(&p, &planned, budget, act);
            }
            Err(BudgetError::DoesNotFit { minimum, .. }) => {
                prop_assert!(budget < least, "refused {budget} ≥ least {least}");
                prop_assert_eq!(minimum, least);
            }
            Err(e) => prop_assert!(false, "unexpected error: {e}"),
        }
    }
}

/// The error names the budget, the least budget and its parts.
#[test]
fn a_budget_too_small_names_the_minimum() {
    let p = dit(2, 16, 4, 8, 100);
    let e = plan(&p, &budget_config(10), &PlannerInputs::default()).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, BudgetError::DoesNotFit { .. }), "{e:?}");
    for needle in [
        "`device_budget` = 10 B does not fit",
        "allowed: device_budget ≥",
        "2 slots of",
    ] {
        assert!(text.contains(needle), "{text}");
    }
}

/// Everything fits: every block stays resident, nothing streams.
#[test]
fn a_budget_that_holds_everything_streams_nothing() {
    let p = dit(2, 16, 4, 8, 100);
    let planned = plan(&p, &budget_config(1 << 30), &PlannerInputs::default()).unwrap();
    assert_eq!(planned.streamed_bytes, 0);
    assert_eq!(planned.resident_blocks, 6);
    check_plan(&p, &planned, 1 << 30, 0);
}

/// Bad keys and values are typed errors naming what is allowed.
#[test]
fn budget_keys_are_checked() {
    for (text, needle) in [
        (r#"{"device_budget": "24 gigs"}"#, "unknown unit `gigs`"),
        (r#"{"device_budget": 0}"#, "zero bytes"),
        (r#"{"device_budget": -5}"#, "negative"),
        (r#"{"device_budget": true}"#, "a positive byte count"),
    ] {
        let e = OffloadConfig::from_json_str(text).unwrap_err().to_string();
        assert!(
            e.contains(needle) && e.contains("device_budget"),
            "{text}: {e}"
        );
    }
    let ok = OffloadConfig::from_toml_str("device_budget = \"16GiB\"").unwrap();
    assert_eq!(ok.device_budget, Some(ByteSize(16 << 30).into()));
    assert_eq!(
        ok.select().unwrap().strategy,
        offload_core::OffloadStrategy::Layerwise
    );
    for (text, needle) in [
        (
            r#"{"device_budget": "1GiB", "enable_cpu_offload": true}"#,
            "conflicts with `enable_cpu_offload`",
        ),
        (
            r#"{"device_budget": "1GiB", "resident_blocks": ["a"]}"#,
            "set one of them",
        ),
        (
            r#"{"resident_blocks": ["a"], "enable_distributed_layerwise_offload": true}"#,
            "layerwise offload only",
        ),
    ] {
        let config = OffloadConfig::from_json_str(text).unwrap();
        let e = config.select().unwrap_err().to_string();
        assert!(e.contains(needle), "{text}: {e}");
    }
    let p = dit(2, 16, 4, 8, 100);
    let mut config = OffloadConfig {
        enable_layerwise_offload: true,
        resident_blocks: vec!["transformer.nope".into()],
        ..OffloadConfig::default()
    };
    let e = resolve(&p, &config).unwrap_err().to_string();
    assert!(
        e.contains("`transformer.nope`") && e.contains("allowed:"),
        "{e}"
    );
    config.resident_blocks = (0..2)
        .map(|i| format!("transformer.transformer_blocks.{i}"))
        .chain((0..3).map(|i| format!("transformer.single_transformer_blocks.{i}")))
        .collect();
    let e = resolve(&p, &config).unwrap_err().to_string();
    assert!(e.contains("leaving one to stream"), "{e}");
    // Bounds of an unplanned budget configuration are refused, not guessed.
    let e = memory_bounds(&p, &budget_config(1 << 20), 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("input of the budget planner"), "{e}");
}

/// The `tiny` preset's workload (`requests` requests of three steps) on
/// the simulated H200, its resident outputs, and the least budget the
/// planner accepts for it.
fn tiny_baseline(requests: usize) -> (Workload, RunOptions, Vec<u64>, u64) {
    let preset = tiny();
    let w = Workload {
        tokens: preset.default_tokens,
        preset,
        steps: 3,
        requests,
    };
    let opts = RunOptions::new(DeviceProfile::h200());
    let resident = run(&w, &StrategyChoice::Resident, &opts).unwrap();
    let want = resident.requests.iter().map(|r| r.output).collect();
    let least = match plan(
        &w.preset.pipeline,
        &budget_config(1),
        &PlannerInputs::default(),
    ) {
        Err(BudgetError::DoesNotFit { minimum, .. }) => minimum,
        other => panic!("a 1-byte budget: {other:?}"),
    };
    (w, opts, want, least)
}

/// A planned configuration runs on the simulated device at every budget
/// between the least and everything: output identical to the resident
/// run, no checker violation, INV-7 within the planned configuration's
/// bounds, and the device's own peak allocation within the budget.
#[test]
fn planned_runs_fit_the_budget_on_the_simulated_device() {
    let (w, opts, want, least) = tiny_baseline(2);
    let preset = &w.preset;
    let total = preset.weight_bytes();
    let mut seen_depths = std::collections::BTreeSet::new();
    for k in 0..=8 {
        let budget = least + (total - least) * k / 8;
        let planned = plan(
            &preset.pipeline,
            &budget_config(budget),
            &PlannerInputs::default(),
        )
        .unwrap_or_else(|e| panic!("budget {budget}: {e}"));
        seen_depths.insert(planned.resident_blocks);
        let opts = RunOptions {
            prefetch_depth: planned.depth.max(1),
            ..opts.clone()
        };
        let out = run(&w, &StrategyChoice::Config(planned.config.clone()), &opts)
            .unwrap_or_else(|f| panic!("budget {budget}: {}", f.error));
        assert!(out.violations.is_empty(), "{budget}: {:#?}", out.violations);
        assert_eq!(
            offload_sim::job::memory_violations(&out),
            None,
            "{budget}: INV-7"
        );
        let got: Vec<u64> = out.requests.iter().map(|r| r.output).collect();
        assert_eq!(
            got, want,
            "budget {budget}: outputs differ from the resident run"
        );
        assert!(
            out.at_end.device_peak_bytes <= budget,
            "budget {budget}: the device peaked at {} B\n{planned}",
            out.at_end.device_peak_bytes
        );
    }
    assert!(
        seen_depths.len() >= 3,
        "the budgets chose too few distinct plans: {seen_depths:?}"
    );
}

/// The planner's schedule is the best the recurrence allows, or close: on
/// small stacks, against every resident set that fits at every depth
/// (exhaustive), its predicted step is within 3 % of the best one.
#[test]
fn the_planner_finds_the_best_schedule_on_small_stacks() {
    use offload_core::budget::predict_config;
    let mut worst: f64 = 1.0;
    for (case, (double, single)) in [(2, 6), (3, 5), (1, 7), (4, 4)].into_iter().enumerate() {
        let p = dit(double, 16, single, 8, 100);
        let (stacks, non_block) = sizes(&p, &budget_config(1));
        let blocks = &stacks[0];
        let n = blocks.len();
        // Compute between 0.2 and 3 ms per block, seeded per case; a
        // double block copies in 3.6 ms, a single in 0.64 ms.
        let mut z = 0x9e37_79b9_u64 * (case as u64 + 1);
        let compute: BTreeMap<String, f64> = blocks
            .iter()
            .map(|(path, _)| {
                z = z
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (
                    path.clone(),
                    0.2e-3 + 2.8e-3 * ((z >> 33) as f64 / (1u64 << 31) as f64),
                )
            })
            .collect();
        let act = 500;
        let inputs = PlannerInputs {
            link_bytes_per_s: 1e6,
            block_compute_s: compute,
            activation_bytes: act,
            max_depth: 3,
            ..PlannerInputs::default()
        };
        let sum: u64 = blocks.iter().map(|(_, b)| b).sum();
        for frac in [0.3, 0.5, 0.7] {
            let budget = non_block + act + (sum as f64 * frac) as u64;
            let Ok(planned) = plan(&p, &budget_config(budget), &inputs) else {
                continue;
            };
            let mut best = f64::INFINITY;
            for mask in 0u32..(1 << n) {
                let streamed: Vec<u64> = (0..n)
                    .filter(|i| mask & (1 << i) == 0)
                    .map(|i| blocks[i].1)
                    .collect();
                if streamed.len() == 1 {
                    continue;
                }
                let resident: u64 = sum - streamed.iter().sum::<u64>();
                let slot = streamed.iter().copied().max().unwrap_or(0);
                for depth in 1..=3u64 {
                    let slots = if slot == 0 { 0 } else { (depth + 1) * slot };
                    if non_block + resident + slots + act > budget {
                        continue;
                    }
                    let config = OffloadConfig {
                        enable_layerwise_offload: true,
                        resident_blocks: (0..n)
                            .filter(|i| mask & (1 << i) != 0)
                            .map(|i| blocks[i].0.clone())
                            .collect(),
                        ..OffloadConfig::default()
                    };
                    let t = predict_config(&p, &config, depth as usize, &inputs).unwrap();
                    best = best.min(t);
                }
            }
            let ratio = planned.predicted_step_s / best;
            worst = worst.max(ratio);
            assert!(
                ratio <= 1.03,
                "{double}+{single} blocks at {frac} of their bytes: the planner's {:.4} ms against the best {:.4} ms\n{planned}",
                planned.predicted_step_s * 1e3,
                best * 1e3
            );
        }
    }
    println!("the planner's step over the exhaustive best, worst case: {worst:.4}");
}

/// A backend given the budget configuration itself plans at `enable`
/// (before anything is allocated) with the platform's planner inputs, and
/// runs within the budget, output identical to resident; without planner
/// inputs it refuses to enable, naming what is missing, and holds nothing.
#[test]
fn a_backend_plans_its_budget_at_enable() {
    use offload_core::runtime::Backend;
    use offload_sim::harness::Rig;
    let (w, opts, want, least) = tiny_baseline(1);
    let want = want[0];
    let preset = &w.preset;
    let budget = least + (preset.weight_bytes() - least) / 2;
    let config = budget_config(budget);
    // Without planner inputs: a typed error, nothing allocated.
    let mut rig = Rig::new(preset.pipeline.clone(), &opts).unwrap();
    let before = rig.device.stats().device_bytes;
    let backend: Box<dyn Backend<offload_sim::Sim>> =
        Box::new(rig.platform.layerwise(config.clone()).unwrap());
    let (e, _) = rig.runtime.enable(backend).unwrap_err();
    assert!(
        e.to_string().contains("needs what the planner knows"),
        "{e}"
    );
    assert_eq!(
        rig.device.stats().device_bytes,
        before,
        "a refused budget allocated"
    );
    drop(rig);
    // With them: planned at enable, within the budget, same output.
    let inputs = PlannerInputs::default();
    let expected = plan(&preset.pipeline, &config, &inputs).unwrap();
    let mut rig = Rig::new(preset.pipeline.clone(), &opts).unwrap();
    let before = rig.device.stats().device_bytes;
    rig.device.reset_peak();
    let platform = rig.platform;
    rig.platform = platform.with_planner(inputs);
    let backend = rig.platform.layerwise(config).unwrap();
    rig.runtime
        .enable(Box::new(backend))
        .map_err(|(e, _)| e)
        .unwrap();
    let got = rig.request(&w).unwrap().output;
    assert_eq!(got, want, "a budget planned at enable changed the output");
    let peak = rig.device.stats().device_peak_bytes - before;
    assert!(
        peak <= budget,
        "peak {peak} B over the budget {budget} B\n{expected}"
    );
    // What the plan keeps resident was allocated: the device peaked at the
    // planned weights exactly (not at an all-streamed ring's).
    assert_eq!(
        peak,
        expected.peak_bytes - expected.activation_bytes,
        "{expected}"
    );
    assert!(
        expected.resident_blocks > 0 && expected.streamed_bytes > 0,
        "{expected}"
    );
    assert!(
        rig.device.violations().is_empty(),
        "{:#?}",
        rig.device.violations()
    );
    rig.runtime.disable().unwrap();
}
