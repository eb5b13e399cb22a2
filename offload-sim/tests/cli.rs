//! The main job from the outside: tables and JSON, the config path, traces,
//! and bad input (exits non-zero with a typed error, never a panic).

use std::process::{Command, Output};

fn sim(args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_offload-sim"))
        .args(args)
        .output()
        .expect("the binary runs");
    // Not a terminal: no progress bar (its redraws, escapes, template), no
    // progress lines (`running …`, as the job printed before it had a bar).
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !err.contains('\r')
            && !err.contains('\u{1b}')
            && !err.contains(" runs: ")
            && !err.contains("running "),
        "a progress display on a pipe: {err:?}"
    );
    o
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn write(name: &str, content: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("offload-sim-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, content).unwrap();
    path
}

#[test]
fn json_reports_every_strategy_with_the_named_fields() {
    let o = sim(&["run", "--model", "tiny", "--steps", "3", "--json"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let rows = rows.as_array().expect("an array");
    let strategies: Vec<&str> = rows
        .iter()
        .map(|r| r["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(strategies, ["none", "model-level", "layerwise"]);
    for r in rows {
        for field in [
            "strategy",
            "model",
            "gpu",
            "steps",
            "step_time_ms",
            "resident_step_time_ms",
            "limit_ms",
            "ratio_to_limit",
            "peak_device_weight_bytes",
            "pinned_host_bytes",
            "h2d_bytes_per_step",
            "compute_wait_ms",
            "checker_violations",
        ] {
            assert!(!r[field].is_null(), "missing {field} in {r}");
        }
        assert_eq!(r["checker_violations"], 0, "{r}");
        assert_eq!(r["output_matches_resident"], true);
        assert_eq!(r["model"], "tiny");
        assert_eq!(r["steps"], 3);
    }
    for r in rows {
        // INV-7, from the device's own counters, within the exact bounds.
        assert!(r["peak_device_weight_bytes"].as_u64() <= r["device_bound_bytes"].as_u64());
        assert!(r["peak_host_bytes"].as_u64() <= r["host_bound_bytes"].as_u64());
        assert!(r["pinned_host_bytes"].as_u64() <= r["peak_host_bytes"].as_u64());
        assert_eq!(r["fits"], true);
    }
    // The bounds are exact, not loose: the offloading strategies reach them
    // to the byte (the peaks of device weights and of host memory, enable's
    // staging included).
    for r in &rows[1..] {
        assert_eq!(
            r["peak_device_weight_bytes"], r["device_bound_bytes"],
            "{r}"
        );
        assert_eq!(r["peak_host_bytes"], r["host_bound_bytes"], "{r}");
    }
    let lw = &rows[2];
    assert!(lw["streamed_weight_bytes"].as_u64().unwrap() > 0);
    assert_eq!(
        lw["pinned_host_bytes"], lw["streamed_weight_bytes"],
        "after enable, the host holds one copy of the streamed weights"
    );
}

#[test]
fn tables_by_default() {
    let o = sim(&[
        "run",
        "--model",
        "tiny",
        "--strategy",
        "layerwise",
        "--gpu",
        "rtx4090",
        "--prefetch-depth",
        "2",
        "--tokens",
        "128",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("── layerwise ── tiny on rtx4090, 128 tokens"),
        "{out}"
    );
    assert!(
        out.contains("ratio to limit") && out.contains("rules broken"),
        "{out}"
    );
}

/// Each row says whether the strategy fits the device, naming it and its
/// memory, or how much more it needs; and the time per image (steps ×
/// step time), null where the strategy did not run.
#[test]
fn rows_say_whether_they_fit_and_the_time_per_image() {
    let o = sim(&["run", "--model", "tiny", "--steps", "3", "--json"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    for r in rows.as_array().unwrap() {
        assert_eq!(r["fit"], "fits on h200 (141.00 GB)", "{r}");
        assert_eq!(r["device_memory_bytes"], 141_000_000_000u64, "{r}");
        assert!(r["needs_more_bytes"].is_null(), "{r}");
        let step = r["step_time_ms"].as_f64().unwrap();
        let image = r["image_time_ms"].as_f64().unwrap();
        assert!((image - 3.0 * step).abs() <= 1e-9 * image, "{r}");
    }
    // A device of 50 kB: nothing fits, and each row says by how much.
    let o = sim(&[
        "run",
        "--model",
        "tiny",
        "--steps",
        "3",
        "--json",
        "--device-memory-gb",
        "0.00005",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    for r in rows.as_array().unwrap() {
        assert_eq!(r["fits"], false, "{r}");
        let more = r["needs_more_bytes"].as_u64().expect("bytes needed");
        assert!(more > 0, "{r}");
        let fit = r["fit"].as_str().unwrap();
        assert!(
            fit.starts_with("does not fit on h200 (50.00 kB): needs ") && fit.ends_with(" more"),
            "{fit}"
        );
        assert!(r["image_time_ms"].is_null(), "{r}");
    }
    // The tables say the same.
    let o = sim(&[
        "run",
        "--model",
        "tiny",
        "--steps",
        "3",
        "--strategy",
        "layerwise",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("  fits on h200 (141.00 GB)\n"), "{out}");
    assert!(out.contains("time per image (3 steps)"), "{out}");
}

/// Two enabling flags: the selection's note (the lower flag disabled) is
/// in the row, printed with the table, and logged once, not once per
/// selection the job makes.
#[test]
fn the_selection_notes_are_shown_once() {
    let toml = write(
        "two-flags.toml",
        "enable_layerwise_offload = true\nenable_cpu_offload = true\n",
    );
    let note = "offload flag `enable_cpu_offload` disabled: `layerwise` offload has priority";
    let config = toml.to_str().unwrap();
    let o = sim(&[
        "run", "--model", "tiny", "--steps", "2", "--json", "--config", config,
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rows[0]["strategy"], "layerwise");
    assert_eq!(rows[0]["selection_notes"], serde_json::json!([note]));
    assert_eq!(err.matches(note).count(), 1, "{err}");
    let o = sim(&["run", "--model", "tiny", "--steps", "2", "--config", config]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains(&format!("  configuration: {note}\n")), "{out}");
}

#[test]
fn config_file_selects_the_strategy() {
    let toml = write(
        "layer.toml",
        "[diffusion_offload_config]\nmode = \"layer\"\ncomponents = [\"dit\"]\n",
    );
    let o = sim(&[
        "run",
        "--model",
        "tiny",
        "--json",
        "--config",
        toml.to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 1);
    assert_eq!(rows[0]["strategy"], "layerwise");
}

#[test]
fn trace_has_one_track_per_stream() {
    let path = write("trace.json", "");
    let o = sim(&[
        "run",
        "--model",
        "tiny",
        "--strategy",
        "layerwise",
        "--trace",
        path.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let names: Vec<&str> = doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(
        names.contains(&"copy") && names.contains(&"compute"),
        "{names:?}"
    );
}

#[test]
fn bad_input_exits_non_zero_with_a_typed_error() {
    let unknown_key = write("bad.json", r#"{"enable_layerwise_ofload": true}"#);
    let dlo = write(
        "dlo.json",
        r#"{"enable_distributed_layerwise_offload": true, "parallel": {"data_parallel_size": 2}}"#,
    );
    let conflict = write(
        "conflict.json",
        r#"{"enable_cpu_offload": true, "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#,
    );
    let syntax = write(
        "syntax.toml",
        "enable_layerwise_offload = true\nprefetch_depth =\n",
    );
    let syntax_named = format!("configuration file `{}`, line 2", syntax.display());
    let syntax_needles = [syntax_named.as_str(), "2 | prefetch_depth ="];
    // The file is named once (the job does not add it again).
    let o = sim(&[
        "run",
        "--model",
        "tiny",
        "--config",
        syntax.to_str().unwrap(),
    ]);
    let (_, err) = text(&o);
    assert_eq!(
        err.matches(&syntax.display().to_string()).count(),
        1,
        "{err}"
    );
    let depth = write(
        "depth.toml",
        "enable_layerwise_offload = true\nprefetch_depth = 2\n",
    );
    let rows: Vec<(Vec<&str>, &[&str])> = vec![
        (
            vec![
                "run",
                "--model",
                "tiny",
                "--config",
                syntax.to_str().unwrap(),
            ],
            &syntax_needles,
        ),
        (
            vec![
                "run",
                "--model",
                "tiny",
                "--prefetch-depth",
                "3",
                "--config",
                depth.to_str().unwrap(),
            ],
            &["--prefetch-depth `3`", "prefetch_depth = 2"],
        ),
        (
            vec![
                "run",
                "--model",
                "tiny",
                "--prefetch-depth",
                "1",
                "--config",
                depth.to_str().unwrap(),
            ],
            &["--prefetch-depth `1`", "prefetch_depth = 2"],
        ),
        (
            vec![
                "run",
                "--model",
                "tiny",
                "--config",
                unknown_key.to_str().unwrap(),
            ],
            &["unknown field `enable_layerwise_ofload`", "expected one of"],
        ),
        (
            vec![
                "run",
                "--model",
                "tiny",
                "--config",
                conflict.to_str().unwrap(),
            ],
            &["enable_cpu_offload", "diffusion_offload_config"],
        ),
        (
            vec!["run", "--model", "tiny", "--config", "/nonexistent.toml"],
            &["cannot read configuration file"],
        ),
        (
            vec!["run", "--model", "sdxl"],
            &["--model `sdxl` is not allowed", "flux1-dev"],
        ),
        (
            vec!["run", "--model", "tiny", "--gpu", "a100"],
            &["--gpu `a100` is not allowed", "h200"],
        ),
        (
            vec!["run", "--model", "tiny", "--payload-divisor", "3"],
            &["--payload-divisor `3`", "a power of two"],
        ),
        (
            vec!["run", "--model", "tiny", "--steps", "0"],
            &["--steps `0`", "1 to 10000"],
        ),
        (
            vec!["run", "--model", "tiny", "--requests", "0"],
            &["--requests `0`", "1 to 1000"],
        ),
        (
            vec!["run", "--model", "tiny", "--tokens", "0"],
            &["--tokens `0`", "1 to 1048576"],
        ),
        (
            vec!["run", "--model", "tiny", "--tokens", "18446744073709551615"],
            &["--tokens `18446744073709551615`", "1 to 1048576"],
        ),
        (
            vec!["run", "--model", "tiny", "--prefetch-depth", "0"],
            &["--prefetch-depth `0`", "1 to 16"],
        ),
        (
            vec![
                "run",
                "--model",
                "tiny",
                "--strategy",
                "layerwise",
                "--config",
                conflict.to_str().unwrap(),
            ],
            &["--strategy", "--config"],
        ),
        (
            vec![
                "run",
                "--model",
                "tiny",
                "--config",
                dlo.to_str().unwrap(),
                "--ranks",
                "3",
            ],
            &["--ranks `3`", "world of 2 ranks"],
        ),
        (
            vec![
                "run",
                "--model",
                "tiny",
                "--strategy",
                "layerwise",
                "--ranks",
                "2",
            ],
            &["--ranks `2`", "distributed layerwise offload only"],
        ),
        (
            vec!["run", "--model", "tiny", "--ranks", "0"],
            &["--ranks `0`", "allowed: 1 to 64"],
        ),
    ];
    for (args, needles) in rows {
        let o = sim(&args);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{args:?} must fail");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        for n in needles {
            assert!(err.contains(n), "{args:?}: `{err}` lacks `{n}`");
        }
    }
}

#[test]
fn distributed_layerwise_on_several_ranks_prints_a_row_per_rank() {
    let o = sim(&[
        "run",
        "--model",
        "tiny",
        "--strategy",
        "distributed-layerwise",
        "--ranks",
        "3",
        "--steps",
        "3",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("limit for 3 ranks"), "{out}");
    for r in 0..3 {
        assert!(
            out.lines()
                .any(|l| l.trim_start().starts_with(&format!("{r} "))
                    && l.trim_end().ends_with("true")),
            "no row for rank {r} matching resident: {out}"
        );
    }
    assert!(
        out.contains("rules broken                                        0"),
        "{out}"
    );
}

#[test]
fn plan_fits_flux_on_a_4090_with_offload() {
    let json = write("plan.json", "");
    let o = sim(&[
        "plan",
        "--gpu",
        "rtx4090",
        "--model",
        "flux1-dev",
        "--tokens",
        "4608",
        "--json",
        json.to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let first = out.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("flux1-dev (") && first.contains("on rtx4090 (25.77 GB"),
        "{out}"
    );
    assert!(first.ends_with("fits"), "{out}");
    for needle in [
        "estimated by the simulator's kernel and activation models",
        "budget auto = 25.77 GB free − 1.07 GB headroom",
        "transformer (dit, 23.80 GB): streamed",
        "text_encoder_2 (encoder, 9.52 GB)",
        "why:",
        "one strategy alone:",
        "least budget",
        "each phase's own minimum",
    ] {
        assert!(out.contains(needle), "`{needle}` missing: {out}");
    }
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(doc["fits"], true);
    let plan = &doc["plan"];
    assert!(plan["peak_bytes"].as_u64() <= plan["budget_bytes"].as_u64());
    assert_eq!(plan["budget_bytes"], (24u64 << 30) - (1 << 30));
    assert!(plan["components"].as_array().unwrap().len() == 4, "{plan}");
}

#[test]
fn plan_keeps_flux_resident_on_an_h200() {
    for budget in [None, Some("141GB")] {
        let mut args = vec!["plan", "--gpu", "h200", "--model", "flux1-dev"];
        args.extend(budget.iter().flat_map(|b| ["--budget", *b]));
        let o = sim(&args);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{args:?}: {out}\n{err}");
        for c in [
            "transformer (dit, 23.80 GB): resident",
            "text_encoder_2 (encoder, 9.52 GB): resident",
            "vae (vae, 0.07 GB): resident",
        ] {
            assert!(out.contains(c), "{c}: {out}");
        }
    }
}

#[test]
fn plan_below_the_minimum_fails_and_names_it() {
    let o = sim(&[
        "plan",
        "--gpu",
        "rtx4090",
        "--model",
        "flux1-dev",
        "--budget",
        "1GiB",
    ]);
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        out.contains("does not fit: needs at least 1.94 GB"),
        "{out}"
    );
    assert!(
        err.contains("does not fit")
            && err.contains("in the phase of `transformer`")
            && err.contains("allowed: device_budget ≥"),
        "{err}"
    );
}

/// A user's own pipeline description plans as a preset does; a bad one is
/// a typed error naming the file and the key.
#[test]
fn plan_takes_a_pipeline_description() {
    let good = write(
        "mine.json",
        r#"{"type": "Mine", "components": {"dit": ["dit"], "encoder": ["te"]},
            "modules": {
              "dit": {"tensors": {"embed.weight": {"dtype": "bf16", "shape": [256, 64]}},
                      "lists": {"blocks": {"count": 8, "tensors": {"fc.weight": {"dtype": "bf16", "shape": [1024, 256]}}}},
                      "block_containers": ["blocks"]},
              "te": {"lists": {"layers": {"count": 4, "tensors": {"fc.weight": {"dtype": "bf16", "shape": [512, 128]}}}},
                     "block_containers": ["layers"]}},
            "tokens": 1024, "steps": 20}"#,
    );
    let o = sim(&[
        "plan",
        "--gpu",
        "rtx4090",
        "--pipeline",
        good.to_str().unwrap(),
        "--budget",
        "12MiB",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.starts_with("Mine (") && out.contains("1024 tokens × 20 steps"),
        "{out}"
    );
    assert!(
        out.contains("dit (dit,") && out.contains("te (encoder,"),
        "{out}"
    );
    for (text_, needle) in [
        (
            r#"{"type": "X", "components": {}, "modules": {}, "bogus": 1}"#,
            "bogus",
        ),
        (
            r#"{"type": "X", "components": {"dit": ["d"]}, "modules": {"d": {"tensors": {"w": {"dtype": "bf17", "shape": [1]}}}}}"#,
            "bf17",
        ),
    ] {
        let bad = write("bad.json", text_);
        let o = sim(&["plan", "--gpu", "h200", "--pipeline", bad.to_str().unwrap()]);
        let (_, err) = text(&o);
        assert!(!o.status.success());
        assert!(err.contains("--pipeline") && err.contains(needle), "{err}");
    }
}

#[test]
fn plan_bad_input_exits_non_zero_with_a_typed_error() {
    let rows: Vec<(Vec<&str>, &[&str])> = vec![
        (
            vec!["plan", "--gpu", "a100", "--model", "flux1-dev"],
            &["--gpu `a100` is not allowed", "h200, h100, rtx4090, l20"],
        ),
        (
            vec!["plan", "--gpu", "h200", "--model", "sdxl"],
            &["--model `sdxl` is not allowed", "flux1-dev"],
        ),
        (
            vec![
                "plan",
                "--gpu",
                "h200",
                "--model",
                "flux1-dev",
                "--budget",
                "24 gigs",
            ],
            &["--budget `24 gigs` is not allowed", "GiB", "GB"],
        ),
        (
            vec!["plan", "--gpu", "h200", "--model", "tiny", "--budget", "0"],
            &["--budget `0` is not allowed", "a positive byte count"],
        ),
        (
            vec![
                "plan", "--gpu", "rtx4090", "--model", "tiny", "--budget", "32GB",
            ],
            &["more than the device's memory", "or \"auto\""],
        ),
        (
            vec![
                "plan",
                "--gpu",
                "h200",
                "--model",
                "tiny",
                "--budget",
                "1GiB",
                "--headroom",
                "1GiB",
            ],
            &["--headroom", "with --budget auto only"],
        ),
        (
            vec!["plan", "--gpu", "h200", "--model", "tiny", "--tokens", "0"],
            &["--tokens `0`", "1 to 1048576"],
        ),
        (
            vec!["plan", "--gpu", "h200", "--model", "tiny", "--steps", "0"],
            &["--steps `0` is not allowed", "1 to 10000"],
        ),
    ];
    for (args, needles) in rows {
        let o = sim(&args);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{args:?} must fail");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        for n in needles {
            assert!(err.contains(n), "{args:?}: `{err}` lacks `{n}`");
        }
    }
}

/// Numbers a pipeline description cannot hold are typed errors naming the
/// key (never a panic), a declared component the file lacks is refused,
/// and a one-block list (no stack: the component's own weights) plans.
#[test]
fn plan_refuses_a_description_out_of_range() {
    let dit = |blocks: &str, shape: &str, extra: &str| {
        format!(
            r#"{{"type": "M", "components": {{"dit": ["dit"]}},
                "modules": {{"dit": {{"lists": {{"blocks": {{"count": {blocks}, "tensors": {{"fc.weight": {{"dtype": "bf16", "shape": {shape}}}}}}}}}, "block_containers": ["blocks"]}}}}{extra}}}"#
        )
    };
    for (name, body, needle) in [
        (
            "big.json",
            dit("8", "[4294967296, 4294967296]", ""),
            "modules.dit.lists.blocks.tensors.fc.weight",
        ),
        (
            "text.json",
            dit("8", "[64, 64]", r#", "text_tokens": 18446744073709551615"#),
            "text_tokens",
        ),
        (
            "count.json",
            dit("100000000", "[2, 2]", ""),
            "modules.dit.lists.blocks.count",
        ),
        (
            "flops.json",
            dit("8", "[64, 64]", r#", "vae_flops": -1"#),
            "vae_flops",
        ),
        (
            "missing.json",
            r#"{"type": "M", "components": {"dit": ["nope"]}, "modules": {}}"#.to_owned(),
            "components.dit",
        ),
    ] {
        let f = write(name, &body);
        let o = sim(&[
            "plan",
            "--gpu",
            "rtx4090",
            "--pipeline",
            f.to_str().unwrap(),
            "--budget",
            "1GiB",
        ]);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{name}: {out}\n{err}");
        assert!(
            err.contains(needle) && err.contains("allowed") && !err.contains("panicked"),
            "{name}: {err}"
        );
    }
    let one = write("one.json", &dit("1", "[64, 64]", ""));
    let o = sim(&[
        "plan",
        "--gpu",
        "rtx4090",
        "--pipeline",
        one.to_str().unwrap(),
        "--budget",
        "1GiB",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
}

#[test]
fn weight_compression_in_the_jobs_configuration_codes_the_link() {
    let toml = write(
        "lossless.toml",
        "enable_layerwise_offload = true\nweight_compression = \"lossless\"\n",
    );
    let config = toml.to_str().unwrap();
    let o = sim(&[
        "run",
        "--model",
        "tiny-wide",
        "--steps",
        "2",
        "--json",
        "--config",
        config,
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let row = &rows.as_array().unwrap()[0];
    assert_eq!(row["weight_compression"], "lossless");
    let ratio = row["link_ratio"].as_f64().unwrap();
    assert!(ratio > 0.6 && ratio < 0.75, "link ratio {ratio}");
    assert!(row["decodes_per_step"].as_f64().unwrap() > 0.0);
    assert_eq!(row["output_matches_resident"], true);
    assert_eq!(row["checker_violations"], 0);
    let text_out = text(&sim(&[
        "run",
        "--model",
        "tiny-wide",
        "--steps",
        "2",
        "--config",
        config,
    ]))
    .0;
    assert!(
        text_out.contains("link bytes / bf16 block bytes"),
        "{text_out}"
    );
    // A value the key does not take, from the job's configuration: a typed
    // error naming the key and the file, exit non-zero.
    let bad = write(
        "bad.toml",
        "enable_layerwise_offload = true\nweight_compression = \"zstd\"\n",
    );
    let o = sim(&[
        "run",
        "--model",
        "tiny-wide",
        "--config",
        bad.to_str().unwrap(),
    ]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("weight_compression") && err.contains("lossless"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// `fit`: a bench JSON's resident rows fitted (the fitted figures and a
/// row per point), and bad input as typed errors naming the flag.
#[test]
fn fit_reads_a_bench_json_and_refuses_bad_input_by_name() {
    // Call G's H100 points at three token counts (BENCHMARKS.md).
    let good = write(
        "fit.json",
        r#"{"device": "NVIDIA H100 80GB HBM3", "elementwise_gbps": 2876.5, "rows": [
          {"run": "resident", "tokens": 1024, "timeline": {"block_compute_s": {"transformer_blocks": 0.001275129, "single_transformer_blocks": 0.0007812314}}},
          {"run": "resident", "tokens": 8192, "timeline": {"block_compute_s": {"transformer_blocks": 0.007601263, "single_transformer_blocks": 0.006862522}}},
          {"run": "resident", "tokens": 16896, "timeline": {"block_compute_s": {"transformer_blocks": 0.02272394, "single_transformer_blocks": 0.02186393}}}
        ]}"#,
    );
    let path = good.to_str().unwrap();
    let o = sim(&[
        "fit",
        "--measured",
        path,
        "--base",
        "h100",
        "--kernel-latency-us",
        "6",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("6 points") && out.contains("kernel_latency_us 6.00"),
        "{out}"
    );
    assert_eq!(out.matches("| transformer_blocks |").count(), 3, "{out}");
    let not_json = write("fit-bad.json", "{");
    for (args, needles) in [
        (
            vec!["fit", "--measured", "/nonexistent/bench.json"],
            &["--measured", "/nonexistent"][..],
        ),
        (
            vec!["fit", "--measured", not_json.to_str().unwrap()],
            &["not JSON"][..],
        ),
        (
            vec!["fit", "--measured", path, "--base", "a100"],
            &["--base `a100`", "h200, h100"][..],
        ),
        (
            vec!["fit", "--measured", path, "--hbm-gbps=-3"],
            &["--hbm-gbps", "allowed"][..],
        ),
        (
            vec!["fit", "--measured", path, "--kernel-latency-us", "1000"],
            &["kernel latency", "allowed"][..],
        ),
    ] {
        let o = sim(&args);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{args:?}");
        assert!(!err.contains("panicked"), "{err}");
        for n in needles {
            assert!(err.contains(n), "{args:?}: {err}");
        }
    }
}
