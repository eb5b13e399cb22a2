//! For every invariant the simulator can see, a bug is planted through a
//! test-only switch and the checker must report it; the same scenario
//! without the bug must be clean. (INV-6 is planted in `xtask`'s tests.)

use std::collections::BTreeMap;

use offload_core::invariants::{
    HookClaim, Invariant, MemoryObservation, TensorFacts, Violation, bounded_memory,
    buffers_stay_correct, fail_before_mutate, one_host_master, single_owner,
};
use offload_core::runtime::{PlantedBug, Runtime};
use offload_core::{OffloadStrategy, Pipeline};
use offload_hooks::{HookOwner, ModelHook};
use offload_sim::harness::{Rig, RunOptions, RunOutcome, StrategyChoice, Workload, blocks_of, run};
use offload_sim::presets::tiny;
use offload_sim::{DeviceProfile, Sim};

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
        steps: 3,
        requests: 2,
    }
}

fn layerwise() -> StrategyChoice {
    StrategyChoice::strategy(OffloadStrategy::Layerwise)
}

fn layerwise_run(bugs: &[PlantedBug]) -> RunOutcome {
    run(&workload(), &layerwise(), &opts(bugs)).expect("the run completes")
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

#[test]
fn clean_run_has_no_violation() {
    assert!(layerwise_run(&[]).violations.is_empty());
}

#[test]
fn inv3_copy_without_waiting_for_last_use() {
    let out = layerwise_run(&[PlantedBug::SkipLastUseWait]);
    caught(
        &out.violations,
        Invariant::NoEarlyFree,
        "overwrite or free while a read may be in flight",
    );
    caught(&out.violations, Invariant::NoEarlyFree, "slot");
}

#[test]
fn inv3_compute_without_waiting_for_ready() {
    let out = layerwise_run(&[PlantedBug::SkipReadyWait]);
    caught(
        &out.violations,
        Invariant::NoEarlyFree,
        "read before the fill completed",
    );
}

/// Enable, run one block (which enqueues a prefetch), disable at once: a
/// disable that does not drain frees a host master a copy still reads.
fn disable_in_flight(bugs: &[PlantedBug]) -> Vec<Violation> {
    let o = opts(bugs);
    let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
    let backend = rig.backend(&layerwise(), &o).unwrap();
    rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
    let path = "transformer.transformer_blocks.0";
    rig.runtime.forward(path, |s| Ok(s.views()?.len())).unwrap();
    rig.runtime.disable().unwrap();
    rig.device.violations()
}

#[test]
fn inv3_free_without_draining() {
    assert!(
        disable_in_flight(&[]).is_empty(),
        "{:#?}",
        disable_in_flight(&[])
    );
    caught(
        &disable_in_flight(&[PlantedBug::FreeWithoutDrain]),
        Invariant::NoEarlyFree,
        "free_pinned",
    );
}

#[test]
fn inv8_views_into_the_wrong_slot() {
    let clean = layerwise_run(&[]);
    let buggy = layerwise_run(&[PlantedBug::WrongSlot]);
    let outputs = |o: &RunOutcome| o.requests.iter().map(|r| r.output).collect::<Vec<_>>();
    let resident = run(&workload(), &StrategyChoice::Resident, &opts(&[])).unwrap();
    let check = |o: &RunOutcome| {
        let (a, b) = (outputs(&resident), outputs(o));
        offload_core::invariants::equivalence(
            &a.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>(),
            &b.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>(),
        )
    };
    assert!(check(&clean).is_ok());
    let v = check(&buggy).expect_err("wrong slot changes the output");
    assert_eq!(v.invariant, Invariant::Equivalence);
}

fn memory(out: &RunOutcome, depth: u64) -> MemoryObservation {
    MemoryObservation {
        peak_device_weight_bytes: out.at_end.device_peak_bytes,
        resident_bytes: out.non_block_bytes,
        slot_bytes: (depth + 1) * out.largest_block_bytes,
        host_weight_bytes: out.after_enable.pinned_bytes,
        offloaded_weight_bytes: out.host_weight_bytes.min(out.after_enable.pinned_bytes),
        group_size: 1,
        staging_bytes: 0,
    }
}

#[test]
fn inv7_an_extra_slot_breaks_the_device_bound() {
    let clean = layerwise_run(&[]);
    assert!(
        bounded_memory(&memory(&clean, 1), 0).is_ok(),
        "{:?}",
        memory(&clean, 1)
    );
    let buggy = layerwise_run(&[PlantedBug::ExtraSlot]);
    let v = bounded_memory(&memory(&buggy, 1), 0).expect_err("three slots at depth 1");
    assert_eq!(v.invariant, Invariant::BoundedMemory);
    assert!(v.to_string().contains("peak device weight bytes"), "{v}");
}

#[test]
fn inv7_leaked_host_masters_are_reported_after_disable() {
    caught(
        &layerwise_run(&[PlantedBug::LeakHostMasters]).violations,
        Invariant::BoundedMemory,
        "still allocated after disable",
    );
}

#[test]
fn inv2_a_second_host_copy() {
    let o = |bugs: &[PlantedBug]| {
        let o = opts(bugs);
        let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
        let backend = rig.backend(&layerwise(), &o).unwrap();
        rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
        let b = rig.runtime.backend().unwrap();
        let masters = b.host_masters();
        let offloaded: std::collections::BTreeSet<_> = masters.iter().copied().collect();
        let result = one_host_master(offloaded, masters);
        rig.runtime.disable().unwrap();
        result
    };
    assert!(o(&[]).is_ok());
    let v = o(&[PlantedBug::SecondHostCopy]).expect_err("two masters per storage");
    assert_eq!(v.invariant, Invariant::OneHostMaster);
    assert!(v.to_string().contains("has 2 host masters"), "{v}");
}

fn claims(rt: &Runtime<Sim>) -> Vec<(String, String, String)> {
    rt.model().hook_claims()
}

#[test]
fn inv1_two_strategies_on_one_pipeline() {
    let attempt = |bugs: &[PlantedBug]| {
        let o = opts(bugs);
        let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
        let mut model_level = rig
            .backend(&StrategyChoice::strategy(OffloadStrategy::ModelLevel), &o)
            .unwrap();
        model_level.enable(rig.runtime.model_mut()).unwrap();
        let mut lw = rig.backend(&layerwise(), &o).unwrap();
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
impl ModelHook<offload_core::runtime::ForwardCtx> for Impostor {}

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
        let backend = rig.backend(&layerwise(), &o).unwrap();
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

/// Every tensor's facts, its values read through forward scopes.
fn tensor_facts(bugs: &[PlantedBug], choice: &StrategyChoice) -> Vec<TensorFacts> {
    let o = opts(bugs);
    let mut rig = Rig::new(tiny().pipeline, &o).unwrap();
    let backend = rig.backend(choice, &o).unwrap();
    rig.runtime.enable(backend).map_err(|(e, _)| e).unwrap();
    let mut sums: BTreeMap<String, u64> = BTreeMap::new();
    let rt = &rig.runtime;
    let p = &rt.model().pipeline;
    let read = |scope: &offload_core::runtime::Scope<'_, Sim>,
                t,
                sums: &mut BTreeMap<String, u64>|
     -> Result<(), offload_core::OffloadError> {
        let v = scope.view_id(t)?;
        let sum = rig
            .device
            .compute(scope.stream(), &[(v.buffer(), v.byte_range())], 1.0, "read")
            .unwrap();
        sums.insert(p.tensor_path(t), sum);
        Ok(())
    };
    for comp in ["text_encoder", "transformer", "vae"] {
        rt.forward(comp, |scope| {
            let module = scope.module();
            let blocks = blocks_of(p, module);
            let in_blocks: Vec<_> = blocks.iter().flat_map(|b| p.subtree_tensors(*b)).collect();
            for t in p
                .subtree_tensors(module)
                .into_iter()
                .filter(|t| !in_blocks.contains(t))
            {
                read(scope, t, &mut sums)?;
            }
            for b in blocks {
                let rel = p.module(b).path[p.module(module).path.len() + 1..].to_owned();
                scope.child(&rel, |blk| {
                    for t in p.subtree_tensors(b) {
                        read(blk, t, &mut sums)?;
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
        .unwrap();
    }
    rig.runtime.disable().unwrap();
    p_facts(&tiny().pipeline, &sums)
}

fn p_facts(p: &Pipeline, sums: &BTreeMap<String, u64>) -> Vec<TensorFacts> {
    p.tensors()
        .map(|(id, t)| TensorFacts {
            path: p.tensor_path(id),
            dtype: t.dtype.to_string(),
            shape: t.shape.clone(),
            strides: t.strides.clone(),
            storage_offset: t.storage_offset,
            alias_class: t.storage.index() as u32,
            checksum: sums[&p.tensor_path(id)],
        })
        .collect()
}

#[test]
fn inv4_non_persistent_buffers_keep_their_values() {
    let resident = tensor_facts(&[], &StrategyChoice::Resident);
    assert!(buffers_stay_correct(&resident, &tensor_facts(&[], &layerwise())).is_ok());
    let v = buffers_stay_correct(
        &resident,
        &tensor_facts(&[PlantedBug::SkipNonPersistent], &layerwise()),
    )
    .expect_err("non-persistent buffers lost");
    assert_eq!(v.invariant, Invariant::BuffersStayCorrect);
    assert!(v.to_string().contains("pos_embed.freqs"), "{v}");
}
