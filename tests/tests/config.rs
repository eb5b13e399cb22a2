//! CONTRACT §2 as tables: every selection row, every rejection row, the
//! gather-group table, and the info line for each disabled flag. Each row
//! runs as JSON and again as the same document in TOML.

use offload_core::config::{GatherAxis, GatherGroup, WeightTransfer, gather_group};
use offload_core::{
    ComponentName, ConfigError, OffloadConfig, OffloadStrategy, ParallelConfig, Selection,
};
use offload_tests::capture_logs;
use serde_json::json;

/// Parses `doc` as JSON and, converted, as TOML; both must agree.
fn parse_both(doc: &serde_json::Value) -> [Result<Selection, ConfigError>; 2] {
    let from_json = OffloadConfig::from_json_str(&doc.to_string()).and_then(|c| c.select());
    let toml_text = toml::to_string(doc).expect("row converts to TOML");
    let from_toml = OffloadConfig::from_toml_str(&toml_text).and_then(|c| c.select());
    [from_json, from_toml]
}

/// Expects the strategy, the disabled flags in order, the components.
fn check_selects(
    doc: serde_json::Value,
    strategy: OffloadStrategy,
    disabled: &[&str],
    components: &[ComponentName],
) -> Selection {
    let mut last = None;
    for result in parse_both(&doc) {
        let sel = result.unwrap_or_else(|e| panic!("{doc}: unexpected error {e}"));
        assert_eq!(sel.strategy, strategy, "{doc}");
        let got: Vec<&str> = sel.disabled_flags.iter().map(|d| d.flag).collect();
        assert_eq!(got, disabled, "{doc}: disabled flags");
        assert!(sel.disabled_flags.iter().all(|d| d.by == strategy));
        let comps: Vec<ComponentName> = sel.components.iter().copied().collect();
        assert_eq!(comps, components, "{doc}: components");
        last = Some(sel);
    }
    last.unwrap()
}

/// Expects an error whose message holds every one of `needles`.
fn check_rejects(doc: serde_json::Value, needles: &[&str]) {
    for result in parse_both(&doc) {
        match result {
            Ok(sel) => panic!("{doc}: expected an error, selected {:?}", sel.strategy),
            Err(e) => {
                let msg = e.to_string();
                for n in needles {
                    assert!(msg.contains(n), "{doc}: message `{msg}` lacks `{n}`");
                }
            }
        }
    }
}

use ComponentName::{Dit, TextEncoder, Vae};
use OffloadStrategy::{DistributedLayerwise as Dlo, Layerwise, ModelLevel, None as Off};

#[test]
fn flag_selection_by_priority() {
    let rows: &[(
        serde_json::Value,
        OffloadStrategy,
        &[&str],
        &[ComponentName],
    )] = &[
        (json!({}), Off, &[], &[]),
        (json!({"enable_cpu_offload": false}), Off, &[], &[]),
        (
            json!({"enable_cpu_offload": true}),
            ModelLevel,
            &[],
            &[Dit, TextEncoder],
        ),
        (
            json!({"enable_layerwise_offload": true}),
            Layerwise,
            &[],
            &[Dit],
        ),
        (
            json!({"enable_distributed_layerwise_offload": true}),
            Dlo,
            &[],
            &[Dit],
        ),
        (
            json!({"enable_cpu_offload": true, "enable_layerwise_offload": true}),
            Layerwise,
            &["enable_cpu_offload"],
            &[Dit],
        ),
        (
            json!({"enable_cpu_offload": true, "enable_distributed_layerwise_offload": true}),
            Dlo,
            &["enable_cpu_offload"],
            &[Dit],
        ),
        (
            json!({"enable_layerwise_offload": true, "enable_distributed_layerwise_offload": true}),
            Dlo,
            &["enable_layerwise_offload"],
            &[Dit],
        ),
        (
            json!({"enable_cpu_offload": true, "enable_layerwise_offload": true, "enable_distributed_layerwise_offload": true}),
            Dlo,
            &["enable_layerwise_offload", "enable_cpu_offload"],
            &[Dit],
        ),
    ];
    for (doc, strategy, disabled, components) in rows {
        check_selects(doc.clone(), *strategy, disabled, components);
    }
}

#[test]
fn flag_tuning_and_defaults() {
    let sel = check_selects(
        json!({"enable_layerwise_offload": true}),
        Layerwise,
        &[],
        &[Dit],
    );
    assert!(sel.pin_memory, "pin_cpu_memory defaults to true");

    let sel = check_selects(
        json!({"enable_layerwise_offload": true, "pin_cpu_memory": false}),
        Layerwise,
        &[],
        &[Dit],
    );
    assert!(!sel.pin_memory);

    let sel = check_selects(
        json!({"enable_distributed_layerwise_offload": true}),
        Dlo,
        &[],
        &[Dit],
    );
    assert!(sel.uses_allgather(), "dlo_use_allgather defaults to true");
    assert_eq!(sel.dit_resident_layers(), 0);

    let sel = check_selects(
        json!({"enable_distributed_layerwise_offload": true, "dlo_use_allgather": false, "dlo_resident_layers": 3}),
        Dlo,
        &[],
        &[Dit],
    );
    assert!(!sel.uses_allgather());
    assert_eq!(sel.dit_resident_layers(), 3);
}

#[test]
fn compact_selection() {
    let rows: &[(serde_json::Value, OffloadStrategy, &[ComponentName])] = &[
        (
            json!({"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder"]}}),
            ModelLevel,
            &[Dit, TextEncoder],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}),
            Layerwise,
            &[Dit],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                "layer_options": {"dit": {"weight_transfer": "rank-local"}}}}),
            Layerwise,
            &[Dit],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                "layer_options": {"dit": {"weight_transfer": "allgather"}}}}),
            Dlo,
            &[Dit],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                "layer_options": {"dit": {"resident_layers": 2}}}}),
            Dlo,
            &[Dit],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"],
                "layer_options": {"text_encoder": {"weight_transfer": "allgather"}}}}),
            Dlo,
            &[Dit, TextEncoder],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["vae", "dit"]}}),
            Layerwise,
            &[Dit, Vae],
        ),
        // A flag that selects the same strategy is allowed beside the compact form.
        (
            json!({"enable_layerwise_offload": true,
                "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}),
            Layerwise,
            &[Dit],
        ),
        (
            json!({"enable_distributed_layerwise_offload": true,
                "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                    "layer_options": {"dit": {"weight_transfer": "allgather"}}}}),
            Dlo,
            &[Dit],
        ),
        (
            json!({"enable_cpu_offload": true,
                "diffusion_offload_config": {"mode": "module", "components": ["dit"]}}),
            ModelLevel,
            &[Dit],
        ),
        // HSDP with rank-local DLO is allowed.
        (
            json!({"parallel": {"data_parallel_size": 2, "use_hsdp": true, "hsdp_shard_size": 2},
                "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                    "layer_options": {"dit": {"weight_transfer": "rank-local", "resident_layers": 1}}}}),
            Dlo,
            &[Dit],
        ),
    ];
    for (doc, strategy, components) in rows {
        let sel = check_selects(doc.clone(), *strategy, &[], components);
        assert!(sel.components_explicit);
    }

    let sel = check_selects(
        json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "pin_memory": false}}),
        Layerwise,
        &[],
        &[Dit],
    );
    assert!(!sel.pin_memory);
    let sel = check_selects(
        json!({"pin_cpu_memory": false, "diffusion_offload_config": {"mode": "layer", "components": ["dit"], "pin_memory": false}}),
        Layerwise,
        &[],
        &[Dit],
    );
    assert!(!sel.pin_memory);
}

#[test]
fn rejections_name_key_value_and_allowed() {
    let rows: Vec<(serde_json::Value, &[&str])> = vec![
        // Unknown keys, at every level.
        (
            json!({"enable_cpu_ofload": true}),
            &[
                "unknown field `enable_cpu_ofload`",
                "expected one of",
                "enable_cpu_offload",
            ],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"], "extra": 1}}),
            &[
                "diffusion_offload_config",
                "unknown field `extra`",
                "layer_options",
            ],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                "layer_options": {"dit": {"resident": 1}}}}),
            &[
                "diffusion_offload_config.layer_options.dit",
                "unknown field `resident`",
                "resident_layers",
            ],
        ),
        (
            json!({"parallel": {"dp": 2}}),
            &["parallel", "unknown field `dp`", "data_parallel_size"],
        ),
        // Wrong types.
        (
            json!({"enable_cpu_offload": "yes"}),
            &["`enable_cpu_offload`", "invalid type", "a boolean"],
        ),
        (
            json!({"dlo_resident_layers": -1}),
            &["`dlo_resident_layers`", "-1"],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": "dit"}}),
            &[
                "diffusion_offload_config.components",
                "invalid type",
                "sequence",
            ],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                "layer_options": {"dit": {"resident_layers": -2}}}}),
            &["layer_options.dit.resident_layers", "-2"],
        ),
        // Unknown choices.
        (
            json!({"diffusion_offload_config": {"mode": "block", "components": ["dit"]}}),
            &[
                "diffusion_offload_config.mode",
                "unknown variant `block`",
                "`module`",
                "`layer`",
            ],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["unet"]}}),
            &[
                "diffusion_offload_config.components",
                "unknown variant `unet`",
                "`dit`",
                "`text_encoder`",
                "`vae`",
            ],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                "layer_options": {"dit": {"weight_transfer": "p2p"}}}}),
            &[
                "weight_transfer",
                "unknown variant `p2p`",
                "`allgather`",
                "`rank-local`",
            ],
        ),
        // Required keys.
        (
            json!({"diffusion_offload_config": {"components": ["dit"]}}),
            &["missing field `mode`"],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer"}}),
            &["missing field `components`"],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                "layer_options": {"unet": {}}}}),
            &[
                "layer_options.unet",
                "unknown component `unet`",
                "`dit`",
                "`text_encoder`",
                "`vae`",
            ],
        ),
        // Components.
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": []}}),
            &["diffusion_offload_config.components", "[]", "non-empty"],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit", "vae", "dit"]}}),
            &[
                "diffusion_offload_config.components",
                "dit listed twice",
                "distinct",
            ],
        ),
        // layer_options.
        (
            json!({"diffusion_offload_config": {"mode": "module", "components": ["dit"],
                "layer_options": {"dit": {}}}}),
            &["layer_options.dit", "mode", "module", "layer"],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                "layer_options": {"vae": {}}}}),
            &["layer_options.vae", "not in `components`", "`dit`"],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"],
                "layer_options": {"text_encoder": {"resident_layers": 2}}}}),
            &[
                "layer_options.text_encoder.resident_layers",
                "2",
                "`dit` only",
            ],
        ),
        (
            json!({"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                "layer_options": {"dit": {"weight_transfer": "allgather", "resident_layers": 2}}}}),
            &[
                "layer_options.dit.resident_layers",
                "layer_options.dit.weight_transfer",
                "allgather",
                "rank-local",
            ],
        ),
        (
            json!({"enable_distributed_layerwise_offload": true, "dlo_resident_layers": 2}),
            &["dlo_resident_layers", "dlo_use_allgather", "rank-local"],
        ),
        // Compact form beside a flag of another strategy.
        (
            json!({"enable_cpu_offload": true, "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}),
            &[
                "enable_cpu_offload",
                "model-level",
                "diffusion_offload_config",
                "layerwise",
            ],
        ),
        (
            json!({"enable_layerwise_offload": true, "diffusion_offload_config": {"mode": "module", "components": ["dit"]}}),
            &[
                "enable_layerwise_offload",
                "diffusion_offload_config",
                "model-level",
            ],
        ),
        (
            json!({"enable_layerwise_offload": true, "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                "layer_options": {"dit": {"weight_transfer": "allgather"}}}}),
            &["enable_layerwise_offload", "distributed-layerwise"],
        ),
        (
            json!({"enable_distributed_layerwise_offload": true, "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}),
            &["enable_distributed_layerwise_offload", "layerwise"],
        ),
        (
            json!({"dlo_use_allgather": false, "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}),
            &["dlo_use_allgather", "layer_options"],
        ),
        (
            json!({"enable_layerwise_offload": true, "dlo_resident_layers": 0}),
            &[
                "dlo_resident_layers",
                "enable_distributed_layerwise_offload",
            ],
        ),
        (
            json!({"pin_cpu_memory": true, "diffusion_offload_config": {"mode": "layer", "components": ["dit"], "pin_memory": false}}),
            &["pin_cpu_memory", "diffusion_offload_config.pin_memory"],
        ),
        // HSDP with gathering DLO.
        (
            json!({"enable_distributed_layerwise_offload": true,
                "parallel": {"data_parallel_size": 2, "use_hsdp": true, "hsdp_shard_size": 2}}),
            &["dlo_use_allgather", "parallel.use_hsdp", "rank-local"],
        ),
        (
            json!({"parallel": {"data_parallel_size": 2, "use_hsdp": true, "hsdp_shard_size": 2},
                "diffusion_offload_config": {"mode": "layer", "components": ["dit"],
                    "layer_options": {"dit": {"weight_transfer": "allgather"}}}}),
            &["weight_transfer", "parallel.use_hsdp", "rank-local"],
        ),
        // Parallel facts.
        (
            json!({"parallel": {"data_parallel_size": 0}}),
            &["parallel.data_parallel_size", "≥ 1"],
        ),
        (
            json!({"parallel": {"tensor_parallel_size": 0}}),
            &["parallel.tensor_parallel_size", "≥ 1"],
        ),
        (
            json!({"parallel": {"data_parallel_size": 2, "rank": 2}}),
            &["parallel.rank", "2", "< dp × sp × tp = 2"],
        ),
        (
            json!({"parallel": {"data_parallel_size": 2, "use_hsdp": true, "hsdp_shard_size": 3}}),
            &["hsdp_shard_size", "3", "divisor of the world size 2"],
        ),
    ];
    for (doc, needles) in rows {
        check_rejects(doc, needles);
    }
}

#[test]
fn parse_errors_are_typed_with_the_key_path() {
    let err = OffloadConfig::from_json_str(
        r#"{"diffusion_offload_config": {"mode": 3, "components": ["dit"]}}"#,
    )
    .unwrap_err();
    match err {
        ConfigError::Parse { format, key, .. } => {
            assert_eq!(format, "JSON");
            assert_eq!(key, "diffusion_offload_config.mode");
        }
        other => panic!("expected a parse error, got {other:?}"),
    }
    let err = OffloadConfig::from_toml_str("enable_cpu_offload = 1\n").unwrap_err();
    assert!(
        matches!(err, ConfigError::Parse { format: "TOML", ref key, .. } if key == "enable_cpu_offload"),
        "{err:?}"
    );
    // Not TOML or JSON at all: the line, the column and a snippet (the
    // file too, when read from one).
    let err =
        OffloadConfig::from_toml_str("pin_cpu_memory = true\nenable_cpu_offload = \n").unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::Syntax {
                format: "TOML",
                line: 2,
                column: 22,
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("TOML configuration, line 2, column 22")
            && msg.contains("2 | enable_cpu_offload = ")
            && msg.contains("|                      ^"),
        "{msg}"
    );
    let err = OffloadConfig::from_json_str("{\"enable_cpu_offload\": tru}").unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::Syntax {
                format: "JSON",
                line: 1,
                ..
            }
        ),
        "{err:?}"
    );
    let dir = std::env::temp_dir().join(format!("offload-syntax-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("offload.toml");
    std::fs::write(
        &file,
        "enable_layerwise_offload = true\nprefetch_depth = \n",
    )
    .unwrap();
    let msg = OffloadConfig::from_path(&file).unwrap_err().to_string();
    assert!(
        msg.contains(&format!("configuration file `{}`, line 2", file.display()))
            && msg.contains("2 | prefetch_depth ="),
        "{msg}"
    );
    std::fs::write(&file, "enable_layerwise_offload = 1\n").unwrap();
    let msg = OffloadConfig::from_path(&file).unwrap_err().to_string();
    assert!(
        msg.contains(&format!(
            "configuration file `{}`, at `enable_layerwise_offload`",
            file.display()
        )),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let err =
        OffloadConfig::from_path(std::path::Path::new("/nonexistent/offload.toml")).unwrap_err();
    assert!(matches!(err, ConfigError::Io { .. }), "{err:?}");
}

/// Each flag a higher-priority one disabled gets one `info` line per
/// backend built (selection itself is pure: every backend selects again
/// while it resolves, and the line came three times per enable).
#[test]
fn every_disabled_flag_gets_an_info_line() {
    let doc = json!({"enable_cpu_offload": true, "enable_layerwise_offload": true, "enable_distributed_layerwise_offload": true});
    let config = OffloadConfig::from_json_str(&doc.to_string()).unwrap();
    let (sel, logs) = capture_logs(|| config.select().unwrap());
    assert_eq!(sel.strategy, Dlo);
    assert!(!logs.contains("disabled"), "selection is pure: {logs}");
    let mut rig = offload_sim::harness::Rig::quick(offload_tests::flux_like(2, 2)).unwrap();
    let ((), logs) = capture_logs(|| {
        rig.runtime.enable_selected(&config, &rig.platform).unwrap();
        let _ = rig.runtime.disable().unwrap();
    });
    let lines: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("INFO") && l.contains("disabled"))
        .collect();
    assert_eq!(lines.len(), 2, "{logs}");
    assert!(
        lines[0].contains("enable_layerwise_offload") && lines[0].contains("distributed-layerwise"),
        "{logs}"
    );
    assert!(lines[1].contains("enable_cpu_offload"), "{logs}");

    let config = OffloadConfig::from_json_str(r#"{"enable_layerwise_offload": true}"#).unwrap();
    let ((), logs) = capture_logs(|| {
        rig.runtime.enable_selected(&config, &rig.platform).unwrap();
    });
    assert!(!logs.contains("disabled"), "nothing was disabled: {logs}");
}

#[test]
fn gather_group_table() {
    fn check(dp: u32, sp: u32, tp: u32, allgather: bool, axis: GatherAxis, size: u32) {
        let parallel = ParallelConfig::sizes(dp, sp, tp);
        assert_eq!(
            gather_group(&parallel, allgather),
            GatherGroup { axis, size },
            "(dp {dp}, sp {sp}, tp {tp}, allgather {allgather})"
        );
    }
    // The rows of CONTRACT §2, then the axes in between.
    check(1, 1, 1, true, GatherAxis::None, 1);
    check(2, 1, 1, true, GatherAxis::DataParallel, 2);
    check(1, 4, 1, true, GatherAxis::SequenceParallel, 4);
    check(2, 2, 2, true, GatherAxis::DataParallel, 2);
    check(2, 2, 2, false, GatherAxis::None, 1);
    check(1, 1, 8, true, GatherAxis::None, 1);
    check(1, 2, 4, true, GatherAxis::SequenceParallel, 2);
    check(4, 1, 1, false, GatherAxis::None, 1);
    check(8, 1, 1, true, GatherAxis::DataParallel, 8);

    let hsdp = ParallelConfig {
        data_parallel_size: 4,
        use_hsdp: true,
        hsdp_shard_size: 2,
        hsdp_replicate_size: 2,
        ..ParallelConfig::single()
    };
    assert_eq!(
        gather_group(&hsdp, true),
        GatherGroup {
            axis: GatherAxis::DataParallel,
            size: 4
        }
    );

    // Selection derives the group from the parallel facts.
    let doc = json!({"enable_distributed_layerwise_offload": true,
        "parallel": {"data_parallel_size": 1, "sequence_parallel_size": 4, "rank": 3}});
    let sel = check_selects(doc, Dlo, &[], &[Dit]);
    assert_eq!(
        sel.gather_group,
        GatherGroup {
            axis: GatherAxis::SequenceParallel,
            size: 4
        }
    );
    let doc = json!({"enable_distributed_layerwise_offload": true, "dlo_use_allgather": false,
        "parallel": {"data_parallel_size": 2}});
    let sel = check_selects(doc, Dlo, &[], &[Dit]);
    assert_eq!(sel.gather_group, GatherGroup::NONE);
    assert_eq!(sel.layer[&Dit].weight_transfer, WeightTransfer::RankLocal);
}

/// `prefetch_depth` is a configuration key wherever a configuration is
/// read: 1 to 16, layer strategies only, never beside a budget (which
/// chooses its own), and it sets the ring's depth over the platform's.
#[test]
fn prefetch_depth_is_a_key_with_typed_errors() {
    for (doc, needles) in [
        (
            json!({"enable_layerwise_offload": true, "prefetch_depth": 0}),
            &["`prefetch_depth` = 0", "1 to 16"][..],
        ),
        (
            json!({"enable_layerwise_offload": true, "prefetch_depth": 17}),
            &["17", "1 to 16"][..],
        ),
        (
            json!({"device_budget": "8GiB", "prefetch_depth": 2}),
            &["`prefetch_depth` = 2", "device_budget", "chooses"][..],
        ),
        (
            json!({"enable_cpu_offload": true, "prefetch_depth": 2}),
            &["layerwise", "model-level"][..],
        ),
        (json!({"prefetch_depth": 2}), &["layerwise"][..]),
    ] {
        check_rejects(doc, needles);
    }
    // The key sets the ring's depth: depth + 1 slots of the largest block.
    let slots_bytes = |config: &str| {
        let mut rig = offload_sim::harness::Rig::quick(offload_tests::flux_like(3, 3)).unwrap();
        let config = OffloadConfig::from_toml_str(config).unwrap();
        rig.runtime.enable_selected(&config, &rig.platform).unwrap();
        let bytes = rig.runtime.backend().unwrap().device_weight_bytes();
        let _ = rig.runtime.disable().unwrap();
        bytes
    };
    let one = slots_bytes("enable_layerwise_offload = true");
    let three = slots_bytes("enable_layerwise_offload = true\nprefetch_depth = 3");
    let pipeline = offload_tests::flux_like(3, 3);
    let plan = offload_core::resolve(
        &pipeline,
        &OffloadConfig::from_toml_str("enable_layerwise_offload = true").unwrap(),
    )
    .unwrap();
    assert_eq!(
        three - one,
        2 * plan.largest_streamed_bytes(),
        "two more slots"
    );
}

/// A JSON syntax error's column counts characters (serde_json counts
/// bytes), and a long line is shown around the column, not whole.
#[test]
fn syntax_columns_count_characters_and_long_lines_are_cut() {
    let err = OffloadConfig::from_json_str(r#"{"a": "日本語", x}"#).unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::Syntax {
                line: 1,
                column: 14,
                ..
            }
        ),
        "{err:?}"
    );
    let long = format!(
        "{{\"pin_cpu_memory\": true, \"x\": \"{}\", oops}}",
        "y".repeat(10_000)
    );
    let msg = OffloadConfig::from_json_str(&long).unwrap_err().to_string();
    assert!(
        msg.len() < 600 && msg.contains('…') && msg.contains("oops"),
        "{} chars: {msg}",
        msg.len()
    );
}

/// INV-7's bound of a configuration is the bound of what it enables: the
/// configuration's prefetch_depth wins over the platform's in both.
#[test]
fn memory_bounds_take_the_configurations_prefetch_depth() {
    let p = offload_tests::flux_like(3, 3);
    let layerwise = OffloadConfig::from_toml_str("enable_layerwise_offload = true").unwrap();
    let deep = OffloadConfig::from_toml_str("enable_layerwise_offload = true\nprefetch_depth = 3")
        .unwrap();
    let one = offload_core::runtime::memory_bounds(&p, &layerwise, 1).unwrap();
    let three = offload_core::runtime::memory_bounds(&p, &deep, 1).unwrap();
    let slot = offload_core::resolve(&p, &layerwise)
        .unwrap()
        .largest_streamed_bytes();
    assert_eq!(
        three.device_weight_bytes - one.device_weight_bytes,
        2 * slot,
        "{one:?} {three:?}"
    );
}
