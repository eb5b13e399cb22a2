//! CONTRACT §5 as tables: discovery (declared, legacy scan, warnings),
//! block-topology precedence, and every resolver error.

use offload_core::config::WeightTransfer;
use offload_core::discovery::{DiscoverySource, Role, discover, log_warnings};
use offload_core::model::{DType, ModelError, PipelineBuilder, StorageSpec, TensorSpec};
use offload_core::plan::{PlanWarning, TopologySource};
use offload_core::{
    ComponentDeclaration, OffloadConfig, OffloadPlan, OffloadStrategy, Pipeline, PlanError,
    ResolvedPlan, resolve,
};
use offload_tests::{blocks, capture_logs, dit, encoder, flux_like, vae};

fn config(json: &str) -> OffloadConfig {
    OffloadConfig::from_json_str(json).expect("test config parses")
}

const LAYERWISE: &str = r#"{"enable_layerwise_offload": true}"#;
const LAYER_DIT: &str = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#;

fn declare(b: &mut PipelineBuilder, dits: &[&str], encoders: &[&str], vaes: &[&str]) {
    let own = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect();
    b.declare_components(ComponentDeclaration {
        dit: own(dits),
        encoder: own(encoders),
        vae: own(vaes),
        resident: vec![],
    });
}

fn ok(pipeline: &Pipeline, cfg: &str) -> ResolvedPlan {
    resolve(pipeline, &config(cfg)).unwrap_or_else(|e| panic!("{cfg}: {e}"))
}

/// Resolves and expects an error matching `expect`, whose message holds
/// every needle.
fn check_err(
    pipeline: &Pipeline,
    cfg: &str,
    expect: impl Fn(&PlanError) -> bool,
    needles: &[&str],
) {
    let before = pipeline.clone();
    match resolve(pipeline, &config(cfg)) {
        Ok(plan) => panic!("{cfg}: expected an error, got {} stacks", plan.stacks.len()),
        Err(e) => {
            assert!(expect(&e), "{cfg}: unexpected error {e:?}");
            let msg = e.to_string();
            for n in needles {
                assert!(msg.contains(n), "message `{msg}` lacks `{n}`");
            }
        }
    }
    assert_eq!(&before, pipeline, "resolution never mutates the pipeline");
}

#[test]
fn declared_discovery_removes_duplicates() {
    let mut b = PipelineBuilder::new("Declared");
    dit(&mut b, "transformer", &[("blocks", 3)]);
    vae(&mut b, "vae");
    b.declare_components(ComponentDeclaration {
        dit: vec!["transformer".into(), "transformer".into()],
        encoder: vec![],
        vae: vec!["vae".into()],
        resident: vec![],
    });
    let p = b.build().unwrap();
    let d = discover(&p).unwrap();
    assert_eq!(d.source, DiscoverySource::Declared);
    let got: Vec<(Role, &str)> = d
        .components
        .iter()
        .map(|c| (c.role, c.path.as_str()))
        .collect();
    assert_eq!(got, [(Role::Dit, "transformer"), (Role::Vae, "vae")]);
    assert!(d.warnings.is_empty());
}

/// A declared path that is no module is an error at resolve, whatever the
/// strategy, naming the path, the nearest module and the list to fix (it
/// was a warning and a skip: layerwise then streamed nothing).
#[test]
fn declared_missing_path_is_an_error_naming_the_nearest() {
    for (declared, needles) in [
        (
            "transformer",
            &[
                "`transformer`",
                "top-level modules: `dit`, `text_encoder`",
                "dit: vec!",
            ][..],
        ),
        ("ditt", &["`ditt`", "did you mean `dit`?"][..]),
        (
            "dit.blocks.9",
            &["`dit.blocks.9`", "top-level modules: `dit`, `text_encoder`"][..],
        ),
        ("", &["an empty path", "top-level modules"][..]),
    ] {
        let mut b = PipelineBuilder::new("Misspelled");
        dit(&mut b, "dit", &[("blocks", 3)]);
        encoder(&mut b, "text_encoder", 2);
        declare(&mut b, &[declared], &["text_encoder"], &[]);
        let p = b.build().unwrap();
        for cfg in [
            LAYERWISE,
            r#"{"enable_cpu_offload": true}"#,
            r#"{}"#,
            r#"{"device_budget": "1GiB"}"#,
        ] {
            check_err(
                &p,
                cfg,
                |e| {
                    matches!(
                        e,
                        PlanError::DeclaredComponentMissing {
                            role: Role::Dit,
                            ..
                        }
                    )
                },
                needles,
            );
        }
    }
}

#[test]
fn dotted_declared_paths() {
    let mut b = PipelineBuilder::new("Nested");
    dit(&mut b, "model.diffusion.transformer", &[("blocks", 4)]);
    declare(&mut b, &["model.diffusion.transformer"], &[], &[]);
    let p = b.build().unwrap();
    let plan = ok(&p, LAYERWISE);
    assert_eq!(plan.stacks.len(), 1);
    assert_eq!(
        plan.stacks[0].blocks[3].path,
        "model.diffusion.transformer.blocks.3"
    );
}

#[test]
fn role_conflict_is_an_error() {
    let mut b = PipelineBuilder::new("Conflict");
    dit(&mut b, "transformer", &[("blocks", 3)]);
    declare(&mut b, &["transformer"], &[], &["transformer"]);
    let p = b.build().unwrap();
    check_err(
        &p,
        LAYERWISE,
        |e| matches!(e, PlanError::ComponentRoleConflict { .. }),
        &["transformer", "dit", "vae"],
    );
}

#[test]
fn legacy_scan_finds_well_known_names_and_warns_once_per_type() {
    let build = |ty: &str| {
        let mut b = PipelineBuilder::new(ty);
        dit(&mut b, "transformer", &[("blocks", 2)]);
        dit(&mut b, "transformer_2", &[("blocks", 2)]);
        encoder(&mut b, "text_encoder_2", 2);
        vae(&mut b, "audio_vae");
        b.module("scheduler_state")
            .buffer("sigmas", DType::F32, &[10], false);
        b.build().unwrap()
    };
    let p = build("LegacyPipelineA");
    let d = discover(&p).unwrap();
    assert_eq!(d.source, DiscoverySource::LegacyScan);
    let got: Vec<(Role, &str)> = d
        .components
        .iter()
        .map(|c| (c.role, c.path.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            (Role::Dit, "transformer"),
            (Role::Dit, "transformer_2"),
            (Role::Encoder, "text_encoder_2"),
            (Role::Vae, "audio_vae")
        ]
    );
    let plan = ok(&p, LAYERWISE);
    assert!(plan.warnings.contains(&PlanWarning::LegacyScan {
        pipeline_type: "LegacyPipelineA".into()
    }));

    // Logged once per pipeline type, however often it is resolved.
    let (first, logs) = capture_logs(|| log_warnings(&plan.warnings).len());
    assert_eq!(first, 1);
    assert!(
        logs.contains("WARN") && logs.contains("legacy scan"),
        "{logs}"
    );
    let (again, logs) = capture_logs(|| log_warnings(&ok(&p, LAYERWISE).warnings).len());
    assert_eq!(
        again, 0,
        "second resolution of the same type logs nothing: {logs}"
    );
    let other = build("LegacyPipelineB");
    assert_eq!(log_warnings(&ok(&other, LAYERWISE).warnings).len(), 1);
}

#[test]
fn topology_precedence() {
    // (plan entry, declared list, deprecated single) → (source, block paths' containers, warns)
    struct Row {
        plan: Option<&'static [&'static str]>,
        list: Option<&'static [&'static str]>,
        single: Option<&'static str>,
        source: TopologySource,
        blocks: usize,
        deprecated_warning: bool,
    }
    let rows = [
        Row {
            plan: Some(&["single"]),
            list: Some(&["double", "single"]),
            single: Some("double"),
            source: TopologySource::Plan,
            blocks: 5,
            deprecated_warning: false,
        },
        Row {
            plan: None,
            list: Some(&["double", "single"]),
            single: Some("double"),
            source: TopologySource::Declared,
            blocks: 8,
            deprecated_warning: false,
        },
        Row {
            plan: None,
            list: Some(&["single", "double"]),
            single: None,
            source: TopologySource::Declared,
            blocks: 8,
            deprecated_warning: false,
        },
        Row {
            plan: None,
            list: None,
            single: Some("double"),
            source: TopologySource::DeprecatedSingle,
            blocks: 3,
            deprecated_warning: true,
        },
        Row {
            plan: Some(&["double"]),
            list: None,
            single: None,
            source: TopologySource::Plan,
            blocks: 3,
            deprecated_warning: false,
        },
    ];
    for (i, row) in rows.iter().enumerate() {
        let mut b = PipelineBuilder::new("Precedence");
        {
            let mut m = b.module("transformer");
            blocks(&mut m, "double", 3, 8);
            blocks(&mut m, "single", 5, 8);
            if let Some(list) = row.list {
                m.block_containers(list);
            }
            if let Some(single) = row.single {
                m.deprecated_block_container(single);
            }
        }
        declare(&mut b, &["transformer"], &[], &[]);
        if let Some(containers) = row.plan {
            let mut plan = OffloadPlan::default();
            plan.block_containers.insert(
                "transformer".into(),
                containers.iter().map(|s| (*s).to_owned()).collect(),
            );
            b.offload_plan(plan);
        }
        let p = b.build().unwrap();
        let plan = ok(&p, LAYERWISE);
        assert_eq!(plan.stacks.len(), 1, "row {i}");
        let stack = &plan.stacks[0];
        assert_eq!(stack.source, row.source, "row {i}");
        assert_eq!(stack.blocks.len(), row.blocks, "row {i}");
        let warned = plan
            .warnings
            .iter()
            .any(|w| matches!(w, PlanWarning::DeprecatedBlockContainer { .. }));
        assert_eq!(warned, row.deprecated_warning, "row {i}");
    }
}

#[test]
fn containers_concatenate_in_declaration_order() {
    let p = flux_like(2, 3);
    let plan = ok(&p, LAYERWISE);
    let paths: Vec<&str> = plan.stacks[0]
        .blocks
        .iter()
        .map(|b| b.path.as_str())
        .collect();
    assert_eq!(
        paths,
        [
            "transformer.transformer_blocks.0",
            "transformer.transformer_blocks.1",
            "transformer.single_transformer_blocks.0",
            "transformer.single_transformer_blocks.1",
            "transformer.single_transformer_blocks.2",
        ]
    );
    assert!(plan.stacks[0].blocks.iter().all(|b| b.bytes > 0));
    // Flag form offloads the DiT only; the encoder stays resident.
    let enc = plan
        .components
        .iter()
        .find(|c| c.role == Role::Encoder)
        .unwrap();
    assert!(!enc.offloaded);
    assert_eq!(
        plan.streamed_bytes(),
        plan.stacks[0].blocks.iter().map(|b| b.bytes).sum::<u64>()
    );
}

/// A layer strategy that cannot stream the DiT (fewer than two blocks, or
/// no containers declared) is an error naming the call that declares them,
/// whether the component was selected by a flag or explicitly (it was a
/// warning, and layerwise then streamed nothing); the planner swaps such a
/// component whole instead.
#[test]
fn too_few_blocks_is_an_error_naming_the_fix() {
    for n in [0usize, 1] {
        let mut b = PipelineBuilder::new("Tiny");
        dit(&mut b, "transformer", &[("blocks", n)]);
        declare(&mut b, &["transformer"], &[], &[]);
        let p = b.build().unwrap();
        for cfg in [LAYERWISE, LAYER_DIT] {
            check_err(
                &p,
                cfg,
                |e| matches!(e, PlanError::TooFewBlocks { blocks, .. } if *blocks == n),
                &["transformer", "at least 2", "`blocks`"],
            );
        }
        assert!(ok(&p, r#"{"device_budget": "1GiB"}"#).stacks.is_empty());
    }
    // A DiT with module lists but no containers declared: the error names
    // `block_containers` with its lists.
    let mut b = PipelineBuilder::new("NoContainers");
    {
        let mut t = b.module("transformer");
        t.parameter("w", DType::Bf16, &[4, 4]);
        t.list("big_blocks", 3, |_, blk| {
            blk.parameter("w", DType::Bf16, &[4, 4]);
        });
        t.list("small_blocks", 2, |_, blk| {
            blk.parameter("w", DType::Bf16, &[2, 4]);
        });
    }
    declare(&mut b, &["transformer"], &[], &[]);
    let p = b.build().unwrap();
    for cfg in [LAYERWISE, LAYER_DIT] {
        check_err(
            &p,
            cfg,
            |e| matches!(e, PlanError::TooFewBlocks { blocks: 0, .. }),
            &[
                "`transformer` has 0 block(s)",
                "block_containers(&[\"big_blocks\", \"small_blocks\"])",
                "`big_blocks` (3 blocks)",
            ],
        );
    }
    // No module list at all: the error says to build one.
    let mut b = PipelineBuilder::new("NoTopology");
    b.module("transformer").parameter("w", DType::Bf16, &[4, 4]);
    declare(&mut b, &["transformer"], &[], &[]);
    let p = b.build().unwrap();
    check_err(
        &p,
        LAYERWISE,
        |e| matches!(e, PlanError::TooFewBlocks { blocks: 0, .. }),
        &["transformer", "module list", "block_containers"],
    );
}

/// Layerwise with no DiT at all, or model level without a DiT or an
/// encoder, would move nothing: an error (it was a warning and a no-op).
#[test]
fn strategies_that_would_move_nothing_are_errors() {
    let mut b = PipelineBuilder::new("EncoderOnly");
    encoder(&mut b, "text_encoder", 2);
    declare(&mut b, &[], &["text_encoder"], &[]);
    let p = b.build().unwrap();
    check_err(
        &p,
        r#"{"enable_cpu_offload": true}"#,
        |e| {
            matches!(
                e,
                PlanError::NothingToOffload {
                    strategy: OffloadStrategy::ModelLevel,
                    ..
                }
            )
        },
        &[
            "no DiT",
            "`text_encoder`",
            "enable_layerwise_offload",
            "device_budget",
        ],
    );
    check_err(
        &p,
        LAYERWISE,
        |e| {
            matches!(
                e,
                PlanError::NothingToOffload {
                    strategy: OffloadStrategy::Layerwise,
                    ..
                }
            )
        },
        &["dit", "ComponentDeclaration"],
    );

    let mut b = PipelineBuilder::new("DitOnly");
    dit(&mut b, "transformer", &[("blocks", 2)]);
    declare(&mut b, &["transformer"], &[], &[]);
    let p = b.build().unwrap();
    check_err(
        &p,
        r#"{"enable_cpu_offload": true}"#,
        |e| matches!(e, PlanError::NothingToOffload { .. }),
        &["no encoder", "`transformer`"],
    );
    assert_eq!(ok(&p, LAYERWISE).stacks.len(), 1);
}

#[test]
fn several_dits_and_encoder_stacks() {
    let mut b = PipelineBuilder::new("TwoExperts");
    dit(&mut b, "transformer", &[("blocks", 3)]);
    dit(&mut b, "transformer_2", &[("blocks", 5)]);
    encoder(&mut b, "text_encoder", 4);
    declare(
        &mut b,
        &["transformer", "transformer_2"],
        &["text_encoder"],
        &[],
    );
    let p = b.build().unwrap();
    let plan = ok(
        &p,
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"]}}"#,
    );
    let stacks: Vec<(&str, usize)> = plan
        .stacks
        .iter()
        .map(|s| (s.owner.as_str(), s.blocks.len()))
        .collect();
    assert_eq!(
        stacks,
        [
            ("transformer", 3),
            ("transformer_2", 5),
            ("text_encoder", 4)
        ]
    );
}

/// One pipeline and config per resolver error, each caught before anything
/// is mutated.
#[test]
fn every_resolver_error() {
    // Declared container missing.
    let mut b = PipelineBuilder::new("E");
    dit(&mut b, "transformer", &[("blocks", 3)]);
    b.module("transformer")
        .block_containers(&["blocks", "nope"]);
    declare(&mut b, &["transformer"], &[], &[]);
    check_err(
        &b.build().unwrap(),
        LAYERWISE,
        |e| matches!(e, PlanError::MissingContainer { .. }),
        &["transformer", "nope", "declared container list"],
    );

    // Container is not a module list.
    let mut b = PipelineBuilder::new("E");
    b.module("transformer.blocks")
        .parameter("w", DType::Bf16, &[2, 2]);
    b.module("transformer").block_containers(&["blocks"]);
    declare(&mut b, &["transformer"], &[], &[]);
    check_err(
        &b.build().unwrap(),
        LAYERWISE,
        |e| matches!(e, PlanError::NotAModuleList { .. }),
        &["transformer.blocks", "module list"],
    );

    // Explicit component not in the pipeline.
    let mut b = PipelineBuilder::new("E");
    dit(&mut b, "transformer", &[("blocks", 3)]);
    declare(&mut b, &["transformer"], &[], &[]);
    check_err(
        &b.build().unwrap(),
        r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit", "vae"]}}"#,
        |e| matches!(e, PlanError::ComponentNotFound { .. }),
        &["vae", "transformer"],
    );

    // Two DiTs claim the same blocks.
    let mut b = PipelineBuilder::new("E");
    {
        let mut m = b.module("transformer");
        blocks(&mut m.child("sub"), "blocks", 3, 8);
        m.block_containers(&["sub.blocks"]);
    }
    b.module("transformer.sub").block_containers(&["blocks"]);
    declare(&mut b, &["transformer", "transformer.sub"], &[], &[]);
    check_err(
        &b.build().unwrap(),
        LAYERWISE,
        |e| matches!(e, PlanError::BlockClaimedTwice { .. }),
        &["transformer.sub.blocks.0", "claimed"],
    );

    // A block nested inside another block.
    let mut b = PipelineBuilder::new("E");
    {
        let mut m = b.module("transformer");
        blocks(&mut m, "blocks", 2, 8);
        m.block_containers(&["blocks"]);
    }
    {
        let mut inner = b.module("transformer.blocks.0");
        blocks(&mut inner, "inner", 2, 8);
        inner.block_containers(&["inner"]);
    }
    declare(&mut b, &["transformer", "transformer.blocks.0"], &[], &[]);
    check_err(
        &b.build().unwrap(),
        LAYERWISE,
        |e| matches!(e, PlanError::BlockClaimedTwice { .. }),
        &["transformer.blocks.0.inner.0"],
    );

    // Tied weights across two blocks, and between a block and the rest.
    for tie_from in ["transformer.blocks.1.attn", "transformer"] {
        let mut b = PipelineBuilder::new("E");
        dit(&mut b, "transformer", &[("blocks", 3)]);
        b.module(tie_from)
            .tie("tied", "transformer.blocks.0.attn.to_out.weight");
        declare(&mut b, &["transformer"], &[], &[]);
        check_err(
            &b.build().unwrap(),
            LAYERWISE,
            |e| matches!(e, PlanError::StorageSharedAcrossBlocks { .. }),
            &["transformer.blocks.0.attn.to_out.weight", "tied"],
        );
    }

    // Resident layers: not allowed by the plan; counts that leave one block or exceed the stack.
    let dlo_resident = |n: u32| {
        format!(
            r#"{{"diffusion_offload_config": {{"mode": "layer", "components": ["dit"], "layer_options": {{"dit": {{"resident_layers": {n}}}}}}}}}"#
        )
    };
    let mut b = PipelineBuilder::new("E");
    dit(&mut b, "transformer", &[("blocks", 4)]);
    declare(&mut b, &["transformer"], &[], &[]);
    b.offload_plan(OffloadPlan::default());
    check_err(
        &b.build().unwrap(),
        &dlo_resident(2),
        |e| matches!(e, PlanError::ResidentLayersNotAllowed { .. }),
        &["transformer", "resident_leading_blocks"],
    );
    let mut b = PipelineBuilder::new("E");
    dit(&mut b, "transformer", &[("blocks", 4)]);
    declare(&mut b, &["transformer"], &[], &[]);
    let p = b.build().unwrap();
    for (n, accepted) in [(1, true), (2, true), (3, false), (4, true), (5, false)] {
        match resolve(&p, &config(&dlo_resident(n))) {
            Ok(plan) => {
                assert!(accepted, "resident_layers {n} must be rejected");
                assert_eq!(plan.strategy(), OffloadStrategy::DistributedLayerwise);
                assert_eq!(plan.stacks[0].resident, (0..n as usize).collect());
            }
            Err(e) => {
                assert!(!accepted, "resident_layers {n}: {e}");
                assert!(matches!(e, PlanError::ResidentLayersCount { .. }), "{e:?}");
                assert!(e.to_string().contains("n ≠ 3"), "{e}");
            }
        }
    }

    // An encoder gathered across ranks must be declared replicated.
    let gather_encoder = r#"{"parallel": {"data_parallel_size": 2},
        "diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"],
        "layer_options": {"dit": {"weight_transfer": "allgather"}, "text_encoder": {"weight_transfer": "allgather"}}}}"#;
    check_err(
        &p_with_encoder(None),
        gather_encoder,
        |e| matches!(e, PlanError::EncoderNotReplicated { group_size: 2, .. }),
        &["text_encoder", "replicated_encoders"],
    );
    let plan = ok(
        &p_with_encoder(Some(vec!["text_encoder".into()])),
        gather_encoder,
    );
    assert!(
        plan.stacks
            .iter()
            .all(|s| s.weight_transfer == WeightTransfer::Allgather)
    );
    assert_eq!(plan.selection.gather_group.size, 2);

    // Plan paths must exist; the version must be known.
    let mut b = PipelineBuilder::new("E");
    dit(&mut b, "transformer", &[("blocks", 3)]);
    declare(&mut b, &["transformer"], &[], &[]);
    b.offload_plan(OffloadPlan {
        self_managed: vec!["audio_vae".into()],
        ..OffloadPlan::default()
    });
    check_err(
        &b.build().unwrap(),
        LAYERWISE,
        |e| {
            matches!(
                e,
                PlanError::PlanPathNotFound {
                    key: "self_managed",
                    ..
                }
            )
        },
        &["audio_vae"],
    );
    let mut b = PipelineBuilder::new("E");
    dit(&mut b, "transformer", &[("blocks", 3)]);
    b.offload_plan(OffloadPlan {
        version: 2,
        ..OffloadPlan::default()
    });
    check_err(
        &b.build().unwrap(),
        LAYERWISE,
        |e| {
            matches!(
                e,
                PlanError::UnsupportedVersion {
                    version: 2,
                    supported: 1
                }
            )
        },
        &["version 2"],
    );

    // Extra stack naming a missing submodule.
    let mut b = PipelineBuilder::new("E");
    dit(&mut b, "transformer", &[("blocks", 3)]);
    declare(&mut b, &["transformer"], &[], &[]);
    let mut plan = OffloadPlan::default();
    plan.extra_stacks.insert(
        "transformer".into(),
        vec!["x_embedder".into(), "proj_out".into()],
    );
    b.offload_plan(plan);
    check_err(
        &b.build().unwrap(),
        LAYERWISE,
        |e| matches!(e, PlanError::MissingContainer { .. }),
        &["proj_out", "extra_stacks"],
    );

    // Configuration errors surface through the resolver too.
    check_err(
        &p,
        r#"{"enable_distributed_layerwise_offload": true, "dlo_resident_layers": 1}"#,
        |e| matches!(e, PlanError::Config(_)),
        &["dlo_resident_layers"],
    );
}

fn p_with_encoder(replicated: Option<Vec<String>>) -> Pipeline {
    let mut b = PipelineBuilder::new("E");
    dit(&mut b, "transformer", &[("blocks", 3)]);
    encoder(&mut b, "text_encoder", 3);
    declare(&mut b, &["transformer"], &["text_encoder"], &[]);
    if let Some(r) = replicated {
        b.offload_plan(OffloadPlan {
            replicated_encoders: r,
            ..OffloadPlan::default()
        });
    }
    b.build().unwrap()
}

#[test]
fn self_managed_components_are_left_alone() {
    let mut b = PipelineBuilder::new("SelfManaged");
    dit(&mut b, "transformer", &[("blocks", 3)]);
    dit(&mut b, "transformer_2", &[("blocks", 3)]);
    declare(&mut b, &["transformer", "transformer_2"], &[], &[]);
    b.offload_plan(OffloadPlan {
        self_managed: vec!["transformer_2".into()],
        ..OffloadPlan::default()
    });
    let plan = ok(&b.build().unwrap(), LAYERWISE);
    assert_eq!(plan.stacks.len(), 1);
    assert_eq!(plan.stacks[0].owner, "transformer");
    assert!(plan.warnings.contains(&PlanWarning::SelfManaged {
        path: "transformer_2".into()
    }));
}

#[test]
fn extra_stacks_form_their_own_ring() {
    let mut b = PipelineBuilder::new("Extra");
    dit(&mut b, "transformer", &[("blocks", 3)]);
    b.module("transformer.proj_out")
        .parameter("weight", DType::Bf16, &[64, 64]);
    declare(&mut b, &["transformer"], &[], &[]);
    let mut plan = OffloadPlan::default();
    plan.extra_stacks.insert(
        "transformer".into(),
        vec!["x_embedder".into(), "proj_out".into()],
    );
    b.offload_plan(plan);
    let plan = ok(&b.build().unwrap(), LAYERWISE);
    let sources: Vec<TopologySource> = plan.stacks.iter().map(|s| s.source).collect();
    assert_eq!(
        sources,
        [TopologySource::Declared, TopologySource::ExtraStack]
    );
    assert_eq!(plan.largest_block_bytes(), 64 * 64 * 2);
}

#[test]
fn plan_schema_round_trips_and_rejects() {
    let text = r#"
        version = 1
        self_managed = ["audio_vae"]
        resident_leading_blocks = ["transformer"]
        replicated_encoders = ["text_encoder"]
        [block_containers]
        transformer = ["transformer_blocks", "single_transformer_blocks"]
        [extra_stacks]
        transformer = ["proj_out", "norm_out"]
    "#;
    let plan = OffloadPlan::from_toml_str(text).unwrap();
    assert_eq!(plan.block_containers["transformer"].len(), 2);
    let json = serde_json::to_string(&plan).unwrap();
    assert_eq!(OffloadPlan::from_json_str(&json).unwrap(), plan);

    let rows: &[(&str, &[&str])] = &[
        (r#"{"version": 3}"#, &["version 3", "supported: 1"]),
        (r#"{"block_containers": {}}"#, &["missing field `version`"]),
        (
            r#"{"version": 1, "blocks": {}}"#,
            &["unknown field `blocks`", "block_containers"],
        ),
        (
            r#"{"version": 1, "self_managed": "vae"}"#,
            &["self_managed", "invalid type"],
        ),
    ];
    for (text, needles) in rows {
        let msg = OffloadPlan::from_json_str(text).unwrap_err().to_string();
        for n in *needles {
            assert!(msg.contains(n), "{text}: `{msg}` lacks `{n}`");
        }
    }
}

#[test]
fn builder_rejects_bad_descriptions() {
    type Build = fn(&mut PipelineBuilder);
    type Expect = fn(&ModelError) -> bool;
    let rows: &[(Build, Expect)] = &[
        (
            |b| {
                b.module("t")
                    .parameter("w", DType::Bf16, &[2])
                    .parameter("w", DType::Bf16, &[2]);
            },
            |e| matches!(e, ModelError::Duplicate { .. }),
        ),
        (
            |b| {
                b.module("t").parameter("bad-name", DType::Bf16, &[2]);
            },
            |e| matches!(e, ModelError::InvalidName { .. }),
        ),
        (
            |b| {
                b.module("t..x");
            },
            |e| matches!(e, ModelError::InvalidName { .. }),
        ),
        (
            |b| {
                b.module("t").tensor(
                    "w",
                    TensorSpec {
                        strides: Some(vec![1]),
                        ..TensorSpec::parameter(DType::F32, &[2, 2])
                    },
                );
            },
            |e| matches!(e, ModelError::StrideRank { .. }),
        ),
        (
            |b| {
                b.module("t").tensor(
                    "w",
                    TensorSpec {
                        storage: StorageSpec::Bytes(4),
                        ..TensorSpec::parameter(DType::F32, &[2, 2])
                    },
                );
            },
            |e| {
                matches!(
                    e,
                    ModelError::OutOfStorage {
                        needs_end_bytes: 16,
                        storage_bytes: 4,
                        ..
                    }
                )
            },
        ),
        (
            |b| {
                b.module("t").tie("w", "t.missing");
            },
            |e| matches!(e, ModelError::AliasTarget { .. }),
        ),
        (
            |b| {
                b.module("t").list("blocks", 2, |_, _| {});
                b.module("t.blocks.x");
            },
            |e| matches!(e, ModelError::ListChild { .. }),
        ),
    ];
    for (i, (build, expect)) in rows.iter().enumerate() {
        let mut b = PipelineBuilder::new("Bad");
        build(&mut b);
        let err = b.build().expect_err("row must fail");
        assert!(expect(&err), "row {i}: {err:?}");
    }
}

#[test]
fn model_description_keeps_views_and_aliases() {
    let mut b = PipelineBuilder::new("Views");
    b.module("t")
        .tensor(
            "packed",
            TensorSpec {
                storage: StorageSpec::Bytes(64),
                ..TensorSpec::parameter(DType::F32, &[4])
            },
        )
        .tensor(
            "view",
            TensorSpec {
                strides: Some(vec![1, 4]),
                storage_offset: 1,
                storage: StorageSpec::SharedWith("t.packed".into()),
                ..TensorSpec::parameter(DType::F32, &[3, 3])
            },
        )
        .tie("tied", "t.packed")
        .buffer("rope", DType::F32, &[8], false)
        .parameter("scale", DType::F8E4M3, &[16])
        .parameter("ids", DType::I64, &[0]);
    let p = b.build().unwrap();
    let t = p.module_id("t").unwrap();
    let storages = p.subtree_storages(t);
    assert_eq!(storages.len(), 4, "packed/view/tied share one storage");
    // packed (64) + rope (32) + scale (16) + ids (empty).
    assert_eq!(p.subtree_bytes(t), 64 + 32 + 16);
    let view = p.tensors().find(|(_, t)| t.name == "view").unwrap().1;
    assert_eq!(view.span_bytes(), 4..(4 + (2 + 2 * 4 + 1) * 4));
    assert_eq!(p.tensor_path(p.module(t).tensors[0]), "t.packed");
}

/// Shapes take the integer type a runtime keeps its sizes in (`usize`
/// constants, `i64` from a file); a negative dimension is a build error
/// naming the tensor.
#[test]
fn shapes_of_any_integer_type() {
    const HEADS: usize = 4;
    const HEAD_DIM: usize = 8;
    let mut b = PipelineBuilder::new("Shapes");
    b.module("m")
        .parameter("a", DType::Bf16, &[HEADS * HEAD_DIM, HEAD_DIM])
        .parameter("b", DType::F32, &vec![3i64, 2])
        .parameter("c", DType::Bf16, &[2u32][..]);
    let p = b.build().unwrap();
    let shape = |n: &str| p.tensor(p.tensor_id(n).unwrap()).shape.clone();
    assert_eq!(shape("m.a"), [32, 8]);
    assert_eq!(shape("m.b"), [3, 2]);
    assert_eq!(shape("m.c"), [2]);
    let mut b = PipelineBuilder::new("Negative");
    b.module("m").parameter("w", DType::Bf16, &[4, -1]);
    assert_eq!(
        b.build(),
        Err(ModelError::NegativeDim {
            path: "m.w".into(),
            dim: -1
        })
    );
}
