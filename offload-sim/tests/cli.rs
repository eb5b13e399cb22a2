//! The main job from the outside: tables and JSON, the config path, traces,
//! and bad input (exits non-zero with a typed error, never a panic).

use std::process::{Command, Output};

fn sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_offload-sim"))
        .args(args)
        .output()
        .expect("the binary runs")
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
    let lw = &rows[2];
    assert_eq!(
        lw["pinned_host_bytes"], lw["streamed_weight_bytes"],
        "no second host copy"
    );
    assert!(lw["peak_device_weight_bytes"].as_u64() <= lw["device_bound_bytes"].as_u64());
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
        out.contains("ratio to limit") && out.contains("checker violations"),
        "{out}"
    );
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
    let conflict = write(
        "conflict.json",
        r#"{"enable_cpu_offload": true, "diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#,
    );
    let rows: Vec<(Vec<&str>, &[&str])> = vec![
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
            &["unknown --model `sdxl`", "flux1-dev"],
        ),
        (
            vec!["run", "--model", "tiny", "--gpu", "a100"],
            &["unknown --gpu `a100`", "h200"],
        ),
        (
            vec!["run", "--model", "tiny", "--payload-divisor", "3"],
            &["not a power of two"],
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
