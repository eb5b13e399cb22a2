//! Property tests: arbitrary JSON and TOML to the configuration parser, and
//! arbitrary module trees, declarations, plans and configs to the resolver.
//! Never a panic; every accepted plan keeps the resolver's promises.

use std::collections::BTreeSet;

use offload_core::model::{DType, PipelineBuilder};
use offload_core::{ComponentDeclaration, OffloadConfig, OffloadPlan, resolve};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

/// Keys the configuration knows, plus near misses.
const KEYS: &[&str] = &[
    "enable_cpu_offload",
    "enable_layerwise_offload",
    "enable_distributed_layerwise_offload",
    "pin_cpu_memory",
    "dlo_use_allgather",
    "dlo_resident_layers",
    "diffusion_offload_config",
    "parallel",
    "mode",
    "components",
    "layer_options",
    "pin_memory",
    "weight_transfer",
    "resident_layers",
    "data_parallel_size",
    "sequence_parallel_size",
    "tensor_parallel_size",
    "use_hsdp",
    "hsdp_shard_size",
    "hsdp_replicate_size",
    "rank",
    "dit",
    "text_encoder",
    "vae",
    "enable_cpu_ofload",
];
const WORDS: &[&str] = &[
    "module",
    "layer",
    "dit",
    "text_encoder",
    "vae",
    "allgather",
    "rank-local",
    "",
    "unet",
];

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<bool>().prop_map(Value::from),
        (-3i64..10).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        prop::sample::select(WORDS).prop_map(Value::from),
        ".*".prop_map(Value::from),
    ]
}

/// JSON shaped like configuration: known keys, plausible values, nesting.
fn config_like() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(
                prop::sample::select(KEYS).prop_map(str::to_owned),
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// Well-formed configurations, to reach the semantic checks often.
fn valid_shaped_config() -> impl Strategy<Value = Value> {
    let flags = (any::<bool>(), any::<bool>(), any::<bool>());
    let compact = prop::option::of((
        prop::sample::select(&["module", "layer"][..]),
        prop::collection::vec(
            prop::sample::select(&["dit", "text_encoder", "vae"][..]),
            0..4,
        ),
        prop::collection::btree_map(
            prop::sample::select(&["dit", "text_encoder", "vae"][..]),
            (
                prop::option::of(prop::sample::select(&["allgather", "rank-local"][..])),
                0u32..4,
            ),
            0..3,
        ),
    ));
    let parallel = (1u32..3, 1u32..3, 1u32..3, any::<bool>(), 0u32..4);
    (flags, prop::option::of(0u32..4), compact, parallel).prop_map(|((c, l, d), resident, compact, (dp, sp, tp, hsdp, rank))| {
        let mut doc = json!({
            "enable_cpu_offload": c,
            "enable_layerwise_offload": l,
            "enable_distributed_layerwise_offload": d,
            "parallel": {"data_parallel_size": dp, "sequence_parallel_size": sp, "tensor_parallel_size": tp,
                "use_hsdp": hsdp, "hsdp_shard_size": dp, "rank": rank},
        });
        if let Some(r) = resident {
            doc["dlo_resident_layers"] = json!(r);
            doc["dlo_use_allgather"] = json!(r == 0);
        }
        if let Some((mode, components, options)) = compact {
            let options: Map<String, Value> = options
                .into_iter()
                .map(|(k, (wt, rl))| {
                    let mut o = json!({"resident_layers": rl});
                    if let Some(wt) = wt {
                        o["weight_transfer"] = json!(wt);
                    }
                    (k.to_owned(), o)
                })
                .collect();
            doc["diffusion_offload_config"] = json!({"mode": mode, "components": components, "layer_options": options});
        }
        doc
    })
}

fn parse_and_select(json_text: &str) {
    if let Ok(config) = OffloadConfig::from_json_str(json_text) {
        let _ = config.select();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn any_json_text_never_panics(text in ".*") {
        parse_and_select(&text);
    }

    #[test]
    fn any_toml_text_never_panics(text in "[a-z_\\[\\]=\" 0-9.{},\n-]*") {
        if let Ok(config) = OffloadConfig::from_toml_str(&text) {
            let _ = config.select();
        }
    }

    #[test]
    fn config_shaped_json_and_toml_never_panic(doc in config_like()) {
        parse_and_select(&doc.to_string());
        if let Ok(config) = toml::to_string(&doc)
            .map_err(|e| e.to_string())
            .and_then(|text| OffloadConfig::from_toml_str(&text).map_err(|e| e.to_string()))
        {
            let _ = config.select();
        }
    }

    #[test]
    fn well_formed_configs_select_or_name_a_key(doc in valid_shaped_config()) {
        let config = OffloadConfig::from_json_str(&doc.to_string()).expect("well-formed");
        match config.select() {
            Ok(sel) => {
                prop_assert!(sel.disabled_flags.iter().all(|d| d.by == sel.strategy));
                prop_assert!(sel.gather_group.size >= 1);
            }
            Err(e) => prop_assert!(e.to_string().contains('`'), "error names no key: {e}"),
        }
    }
}

/// One top-level module of a generated pipeline.
#[derive(Debug, Clone)]
struct ModSpec {
    /// container name → (blocks, is a list, block width)
    containers: std::collections::BTreeMap<&'static str, (usize, bool, u64)>,
    declared: Option<Vec<&'static str>>,
    deprecated: Option<&'static str>,
    dtype: DType,
}

const MODULE_NAMES: &[&str] = &[
    "transformer",
    "transformer_2",
    "text_encoder",
    "vae",
    "dit",
    "model",
    "extra",
];
const CONTAINER_NAMES: &[&str] = &[
    "blocks",
    "transformer_blocks",
    "single_transformer_blocks",
    "layers",
    "missing",
];

fn mod_spec() -> impl Strategy<Value = ModSpec> {
    (
        prop::collection::btree_map(
            prop::sample::select(CONTAINER_NAMES),
            (0usize..80, prop::bool::weighted(0.9), 1u64..9),
            0..3,
        ),
        prop_oneof![
            3 => Just(None::<Vec<&'static str>>).prop_map(|_| Some(Vec::new())), // "declare exactly the containers"
            1 => prop::option::of(prop::collection::vec(prop::sample::select(CONTAINER_NAMES), 0..3)),
        ],
        prop::option::of(prop::sample::select(CONTAINER_NAMES)),
        prop::sample::select(&DType::ALL[..]),
    )
        .prop_map(|(containers, declared, deprecated, dtype)| {
            let declared = match declared {
                Some(d) if d.is_empty() => Some(containers.keys().copied().collect()),
                other => other,
            };
            ModSpec { containers, declared, deprecated, dtype }
        })
}

/// Configurations for the resolver: mostly ones that select, so resolution
/// gets past configuration checks; sometimes anything well-formed.
fn resolver_config() -> impl Strategy<Value = Value> {
    let good = [
        json!({}),
        json!({"enable_cpu_offload": true}),
        json!({"enable_layerwise_offload": true}),
        json!({"enable_layerwise_offload": true, "enable_cpu_offload": true}),
        json!({"enable_distributed_layerwise_offload": true, "dlo_use_allgather": false, "dlo_resident_layers": 2}),
        json!({"enable_distributed_layerwise_offload": true, "parallel": {"data_parallel_size": 2}}),
        json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}),
        json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"]}}),
        json!({"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder"]}}),
        json!({"parallel": {"sequence_parallel_size": 2}, "diffusion_offload_config": {"mode": "layer",
            "components": ["dit", "text_encoder"], "layer_options": {"text_encoder": {"weight_transfer": "allgather"}}}}),
    ];
    prop_oneof![3 => prop::sample::select(good.to_vec()), 1 => valid_shaped_config()]
}

fn paths() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(
        prop_oneof![
            8 => prop::sample::select(MODULE_NAMES).prop_map(str::to_owned),
            1 => (prop::sample::select(MODULE_NAMES), prop::sample::select(CONTAINER_NAMES), 0usize..3)
                .prop_map(|(m, c, i)| format!("{m}.{c}.{i}")),
            1 => Just(String::new()),
        ],
        0..3,
    )
}

/// Mostly empty lists: a plan names few paths, and a wrong one is an error.
fn plan_paths() -> impl Strategy<Value = Vec<String>> {
    prop_oneof![4 => Just(Vec::new()), 1 => paths()]
}

fn plan() -> impl Strategy<Value = Option<OffloadPlan>> {
    prop::option::weighted(0.3, (
        prop_oneof![4 => Just(1u32), 1 => 0u32..3],
        prop_oneof![
            2 => Just(Default::default()),
            1 => prop::collection::btree_map(prop::sample::select(MODULE_NAMES).prop_map(str::to_owned), prop::collection::vec(prop::sample::select(CONTAINER_NAMES).prop_map(str::to_owned), 0..3), 0..2),
        ],
        plan_paths(),
        plan_paths(),
        plan_paths(),
    ))
    .prop_map(|o| {
        o.map(|(version, block_containers, self_managed, resident_leading_blocks, replicated_encoders)| OffloadPlan {
            version,
            block_containers,
            self_managed,
            resident_leading_blocks,
            replicated_encoders,
            ..OffloadPlan::default()
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_pipelines_resolve_or_err(
        modules in prop::collection::btree_map(prop::sample::select(MODULE_NAMES), mod_spec(), 0..5),
        declaration in prop::option::of((paths(), paths(), paths(), paths())),
        ties in prop::collection::vec((0usize..200, 0usize..200), 0..2),
        plan in plan(),
        doc in resolver_config(),
    ) {
        let mut b = PipelineBuilder::new("Generated");
        let mut tensor_paths = Vec::new();
        for (name, m) in &modules {
            let mut mb = b.module(name);
            mb.parameter("embed", m.dtype, &[3, 5]);
            tensor_paths.push(format!("{name}.embed"));
            for (c, (n, is_list, width)) in &m.containers {
                if *is_list {
                    mb.list(c, *n, |i, blk| {
                        blk.parameter("w", m.dtype, &[*width, i as u64 + 1]);
                    });
                    tensor_paths.extend((0..*n).map(|i| format!("{name}.{c}.{i}.w")));
                } else {
                    mb.child(c).parameter("w", m.dtype, &[*width]);
                }
            }
            if let Some(d) = &m.declared {
                mb.block_containers(d);
            }
            if let Some(d) = m.deprecated {
                mb.deprecated_block_container(d);
            }
        }
        for (i, (from, to)) in ties.iter().enumerate() {
            if let (Some(from), Some(to)) = (tensor_paths.get(*from), tensor_paths.get(*to)) {
                let module = from.rsplit_once('.').map_or("", |(m, _)| m).to_owned();
                b.module(&module).tie(&format!("tie{i}"), to);
            }
        }
        if let Some((dit, encoder, vae, resident)) = declaration {
            b.declare_components(ComponentDeclaration { dit, encoder, vae, resident });
        }
        if let Some(plan) = plan {
            b.offload_plan(plan);
        }
        let Ok(pipeline) = b.build() else { return Ok(()) };
        let config = OffloadConfig::from_json_str(&doc.to_string()).expect("well-formed");
        let before = pipeline.clone();
        if let Ok(plan) = resolve(&pipeline, &config) {
            let mut seen = BTreeSet::new();
            for stack in &plan.stacks {
                prop_assert!(stack.blocks.len() >= 2, "a stack of {} blocks", stack.blocks.len());
                prop_assert!(stack.resident.iter().all(|i| *i < stack.blocks.len()));
                prop_assert!(stack.blocks.len() - stack.resident.len() != 1);
                for block in &stack.blocks {
                    prop_assert!(seen.insert(block.module), "block {} in two stacks", block.path);
                }
            }
            let total: u64 = pipeline.storages().map(|(_, s)| s.bytes).sum();
            prop_assert!(plan.streamed_bytes() <= total);
        }
        prop_assert_eq!(before, pipeline, "resolution mutated the pipeline");
    }
}
