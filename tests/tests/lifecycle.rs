//! CONTRACT §3 and §1 as tables: the factory's selection and refusal paths,
//! the lifecycle state machine, and the residency transitions.

use std::cell::Cell;

use offload_core::config::ParallelConfig;
use offload_core::lifecycle::{
    BackendRequest, DeviceSpec, DisableStep, EnableStep, Lifecycle, LifecycleState,
};
use offload_core::residency::{Owner, Residency, ResidencyError, ResidencyTable, Transition};
use offload_core::runtime::Model;
use offload_core::{
    OffloadBackend, OffloadConfig, OffloadError, OffloadStrategy, Platform, get_offload_backend,
};
use offload_tests::capture_logs;

/// A backend that only tracks its lifecycle.
struct Recorder {
    strategy: OffloadStrategy,
    lifecycle: Lifecycle,
}

impl OffloadBackend for Recorder {
    fn strategy(&self) -> OffloadStrategy {
        self.strategy
    }
    fn enable(&mut self, _: &mut Model) -> Result<(), OffloadError> {
        if self.lifecycle.begin_enable()? == EnableStep::Proceed {
            self.lifecycle.finish_enable();
        }
        Ok(())
    }
    fn disable(&mut self, _: &mut Model) -> Result<(), OffloadError> {
        if self.lifecycle.begin_disable() == DisableStep::Proceed {
            self.lifecycle.finish_disable();
        }
        Ok(())
    }
    fn is_enabled(&self) -> bool {
        self.lifecycle.is_enabled()
    }
    fn state(&self) -> LifecycleState {
        self.lifecycle.state().clone()
    }
}

/// A platform that counts the backends it builds.
struct TestPlatform {
    supported: bool,
    device_ok: bool,
    build_as: Option<OffloadStrategy>,
    built: Cell<usize>,
}

impl TestPlatform {
    fn new() -> Self {
        Self {
            supported: true,
            device_ok: true,
            build_as: None,
            built: Cell::new(0),
        }
    }
}

impl Platform for TestPlatform {
    type Backend = dyn OffloadBackend;

    fn name(&self) -> &str {
        "test"
    }
    fn supports_offload(&self) -> bool {
        self.supported
    }
    fn resolve_device(&self, parallel: &ParallelConfig) -> Result<DeviceSpec, OffloadError> {
        if self.device_ok {
            Ok(DeviceSpec {
                ordinal: parallel.rank,
                name: "test-gpu".into(),
            })
        } else {
            Err(OffloadError::Device {
                platform: "test".into(),
                reason: "no device visible".into(),
            })
        }
    }
    fn create_backend(
        &self,
        request: BackendRequest,
    ) -> Result<Box<dyn OffloadBackend>, OffloadError> {
        self.built.set(self.built.get() + 1);
        let strategy = self.build_as.unwrap_or(request.selection.strategy);
        Ok(Box::new(Recorder {
            strategy,
            lifecycle: Lifecycle::new(strategy),
        }))
    }
}

enum Expect {
    Backend(OffloadStrategy),
    Nothing,
    Error(&'static str),
}

fn check(platform: TestPlatform, json: &str, expect: Expect) {
    let config = OffloadConfig::from_json_str(json).unwrap();
    let (result, logs) = capture_logs(|| get_offload_backend(&config, &platform));
    match (result, expect) {
        (Ok(Some(b)), Expect::Backend(s)) => {
            assert_eq!(b.strategy(), s, "{json}");
            assert!(!b.is_enabled(), "the factory installs nothing");
            assert_eq!(platform.built.get(), 1, "{json}: exactly one backend");
        }
        (Ok(None), Expect::Nothing) => {
            assert_eq!(platform.built.get(), 0, "{json}");
            if !platform.supported {
                assert!(
                    logs.contains("WARN") && logs.contains("does not support offload"),
                    "{logs}"
                );
            }
        }
        (Err(e), Expect::Error(needle)) => {
            assert!(
                e.to_string().contains(needle),
                "{json}: `{e}` lacks `{needle}`"
            );
        }
        (got, _) => panic!(
            "{json}: unexpected {:?}",
            got.map(|b| b.map(|b| b.strategy()))
        ),
    }
}

#[test]
fn factory_selection_and_refusals() {
    use OffloadStrategy::*;
    check(TestPlatform::new(), "{}", Expect::Nothing);
    check(
        TestPlatform::new(),
        r#"{"enable_cpu_offload": true}"#,
        Expect::Backend(ModelLevel),
    );
    check(
        TestPlatform::new(),
        r#"{"enable_layerwise_offload": true}"#,
        Expect::Backend(Layerwise),
    );
    check(
        TestPlatform::new(),
        r#"{"enable_cpu_offload": true, "enable_layerwise_offload": true, "enable_distributed_layerwise_offload": true}"#,
        Expect::Backend(DistributedLayerwise),
    );
    check(
        TestPlatform::new(),
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#,
        Expect::Backend(Layerwise),
    );
    check(
        TestPlatform {
            supported: false,
            ..TestPlatform::new()
        },
        r#"{"enable_layerwise_offload": true}"#,
        Expect::Nothing,
    );
    check(
        TestPlatform::new(),
        r#"{"diffusion_offload_config": {"mode": "layer", "components": []}}"#,
        Expect::Error("diffusion_offload_config.components"),
    );
    check(
        TestPlatform::new(),
        r#"{"enable_distributed_layerwise_offload": true, "dlo_resident_layers": 2}"#,
        Expect::Error("dlo_use_allgather"),
    );
    check(
        TestPlatform {
            device_ok: false,
            ..TestPlatform::new()
        },
        r#"{"enable_layerwise_offload": true}"#,
        Expect::Error("no device visible"),
    );
    check(
        TestPlatform {
            build_as: Some(ModelLevel),
            ..TestPlatform::new()
        },
        r#"{"enable_layerwise_offload": true}"#,
        Expect::Error("built a model-level backend"),
    );
}

#[test]
fn lifecycle_state_machine() {
    #[derive(Debug, Clone, Copy)]
    enum Op {
        Enable,
        Disable,
        Poison,
    }
    use Op::*;
    // (operations, expected final state name, whether the last enable fails)
    let rows: &[(&[Op], &str, bool)] = &[
        (&[], "disabled", false),
        (&[Enable], "enabled", false),
        (&[Enable, Enable], "enabled", false),
        (&[Enable, Disable], "disabled", false),
        (&[Disable], "disabled", false),
        (&[Enable, Disable, Disable], "disabled", false),
        (&[Enable, Disable, Enable], "enabled", false),
        (&[Enable, Poison], "poisoned", false),
        (&[Enable, Poison, Enable], "poisoned", true),
        (&[Poison, Disable, Enable], "poisoned", true),
    ];
    for (ops, want, last_enable_fails) in rows {
        let mut backend = Recorder {
            strategy: OffloadStrategy::Layerwise,
            lifecycle: Lifecycle::new(OffloadStrategy::Layerwise),
        };
        let mut pipeline = Model::new(offload_tests::flux_like(2, 2));
        let mut enable_failed = false;
        for op in *ops {
            match op {
                Enable => enable_failed = backend.enable(&mut pipeline).is_err(),
                Disable => backend.disable(&mut pipeline).unwrap(),
                Poison => backend.lifecycle.poison("peer rank 1 failed during enable"),
            }
        }
        let got = match backend.state() {
            LifecycleState::Disabled => "disabled",
            LifecycleState::Enabled => "enabled",
            LifecycleState::Poisoned { .. } => "poisoned",
        };
        assert_eq!(got, *want, "{ops:?}");
        assert_eq!(enable_failed, *last_enable_fails, "{ops:?}");
        assert_eq!(backend.is_enabled(), got == "enabled");
    }

    let mut lc = Lifecycle::new(OffloadStrategy::DistributedLayerwise);
    lc.finish_enable();
    let (step, logs) = capture_logs(|| lc.begin_enable().unwrap());
    assert_eq!(step, EnableStep::AlreadyEnabled);
    assert!(
        logs.contains("WARN") && logs.contains("already enabled"),
        "{logs}"
    );
    lc.poison("rank 3 lost");
    let err = lc.begin_enable().unwrap_err();
    assert!(
        err.to_string()
            .contains("poisoned (rank 3 lost); build a new backend"),
        "{err}"
    );
}

#[test]
fn residency_transition_table() {
    use Residency::*;
    use Transition::*;
    let rows = [
        (HostOnly, IssueCopy, Some(InFlight)),
        (HostOnly, CopyDone, None),
        (HostOnly, Release, None),
        (HostOnly, Restore, Some(HostOnly)),
        (InFlight, IssueCopy, None),
        (InFlight, CopyDone, Some(Resident)),
        (InFlight, Release, None),
        (InFlight, Restore, None),
        (Resident, IssueCopy, None),
        (Resident, CopyDone, None),
        (Resident, Release, Some(Released)),
        (Resident, Restore, None),
        (Released, IssueCopy, Some(InFlight)),
        (Released, CopyDone, None),
        (Released, Release, None),
        (Released, Restore, Some(HostOnly)),
    ];
    for (from, t, to) in rows {
        assert_eq!(from.next(t), to, "{from:?} --{t:?}-->");
        assert_eq!(
            from.allowed().contains(&t),
            to.is_some(),
            "{from:?} allowed() vs next()"
        );
    }
}

#[test]
fn residency_table_enforces_one_owner_and_legal_moves() {
    let a = Owner("layerwise_offload".into());
    let b = Owner("model_level_offload".into());
    let mut table = ResidencyTable::<String>::new();
    let key = "transformer.blocks.0".to_owned();
    table.claim(key.clone(), &a).unwrap();
    table.claim(key.clone(), &a).unwrap();
    assert!(matches!(
        table.claim(key.clone(), &b),
        Err(ResidencyError::NotOwner { .. })
    ));
    assert!(matches!(
        table.apply(&key, &b, Transition::IssueCopy),
        Err(ResidencyError::NotOwner { .. })
    ));
    assert!(matches!(
        table.apply(&"other".to_owned(), &a, Transition::IssueCopy),
        Err(ResidencyError::Unmanaged { .. })
    ));
    // A read before the fill: CopyDone skipped.
    let err = table.apply(&key, &a, Transition::Release).unwrap_err();
    assert!(
        err.to_string()
            .contains("illegal residency transition Release from HostOnly"),
        "{err}"
    );
    for (t, want) in [
        (Transition::IssueCopy, Residency::InFlight),
        (Transition::CopyDone, Residency::Resident),
        (Transition::Release, Residency::Released),
        (Transition::IssueCopy, Residency::InFlight),
    ] {
        assert_eq!(table.apply(&key, &a, t).unwrap(), want);
    }
    assert_eq!(table.state(&key), Some(Residency::InFlight));
    assert_eq!(table.release_owner(&a), 1);
    assert_eq!(table.owner(&key), None);
}

/// Enabling a second backend names both strategies and the call that
/// frees the runtime, never an empty module name.
#[test]
fn enabling_twice_names_both_strategies() {
    let mut rig = offload_sim::harness::Rig::quick(offload_tests::flux_like(2, 2)).unwrap();
    let layerwise =
        offload_core::OffloadConfig::from_toml_str("enable_layerwise_offload = true").unwrap();
    rig.runtime
        .enable_selected(&layerwise, &rig.platform)
        .unwrap();
    let err = rig
        .runtime
        .enable_selected(&offload_core::OffloadConfig::default(), &rig.platform)
        .unwrap_err();
    assert!(
        matches!(err, offload_core::OffloadError::AlreadyEnabled { .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("a layerwise backend is already enabled")
            && msg.contains("Runtime::disable")
            && !msg.contains("``"),
        "{msg}"
    );
    let _ = rig.runtime.disable().unwrap();
}

/// A DiT whose blocks hold module lists of their own (diffusers' `ff.net.0`),
/// its containers named by the offload plan rather than the module.
fn nested_pipeline() -> offload_core::Pipeline {
    use offload_core::model::DType;
    let mut b = offload_core::PipelineBuilder::new("Nested");
    {
        let mut t = b.module("transformer");
        t.parameter("x_embedder.weight", DType::Bf16, &[8usize, 8]);
        t.list("blocks", 3, |_, blk| {
            blk.list("net", 2, |_, n| {
                n.parameter("weight", DType::Bf16, &[8usize, 8]);
            });
        });
    }
    b.module("text_encoder")
        .parameter("w", DType::Bf16, &[8usize, 8]);
    b.declare_components(offload_core::ComponentDeclaration {
        dit: vec!["transformer".into()],
        encoder: vec!["text_encoder".into()],
        ..Default::default()
    });
    let mut plan = offload_core::OffloadPlan::default();
    plan.block_containers
        .insert("transformer".into(), vec!["blocks".into()]);
    b.offload_plan(plan);
    b.build().unwrap()
}

/// The scope's block iterator reads the containers as resolution does
/// (here the offload plan's: it returned nothing, silently, when it read
/// only the module's); a weight of a block read from the DiT's scope names
/// the block (not a list nested in it) as the `child` to read it in; the
/// root is named, never ``; a path with an empty segment says so.
#[test]
fn scopes_name_blocks_as_resolution_does() {
    let mut rig = offload_sim::harness::Rig::quick(nested_pipeline()).unwrap();
    let layerwise =
        offload_core::OffloadConfig::from_toml_str("enable_layerwise_offload = true").unwrap();
    rig.runtime
        .enable_selected(&layerwise, &rig.platform)
        .unwrap();
    let blocks = rig
        .runtime
        .forward("transformer", |s| {
            Ok(s.block_stack()?
                .iter()
                .map(|b| b.to_string())
                .collect::<Vec<_>>())
        })
        .unwrap()
        .unwrap();
    assert_eq!(blocks, ["blocks.0", "blocks.1", "blocks.2"]);
    let err = rig
        .runtime
        .forward("transformer", |s| {
            s.view("blocks.1.net.0.weight")?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("child(\"blocks.1\", …)"), "{err}");
    let err = rig
        .runtime
        .forward("text_encoder", |s| Ok(s.block_stack()?.len()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("declares no block containers") && err.contains("block_containers(&[…])"),
        "{err}"
    );
    let err = rig
        .runtime
        .forward("", |s| {
            s.view("nothing")?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("forward of the pipeline's root module: no tensor `nothing`"),
        "{err}"
    );
    for bad in ["transformer.", "transformer..blocks", ".transformer"] {
        let err = rig
            .runtime
            .forward(bad, |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("empty segment") && !err.contains("``"),
            "{bad}: {err}"
        );
    }
    let err = rig
        .runtime
        .forward("transformer", |s| {
            s.child("", |_| Ok(()))?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("empty segment") && !err.contains("``"),
        "{err}"
    );
    let _ = rig.runtime.disable().unwrap();
}
