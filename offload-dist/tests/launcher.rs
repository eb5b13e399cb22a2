//! `offload-launch` as a user runs it (and `offload-dist-check` under it
//! where there is no GPU).

use std::process::{Command, Output};
use std::time::{Duration, Instant};

const LAUNCH: &str = env!("CARGO_BIN_EXE_offload-launch");
const CHECK: &str = env!("CARGO_BIN_EXE_offload-dist-check");

fn launch(args: &[&str]) -> Output {
    Command::new(LAUNCH)
        .args(args)
        .env_remove("NCCL_NVLS_ENABLE")
        .env_remove("OFFLOAD_DIST_ALLOW_SKIP")
        .output()
        .expect("offload-launch runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn every_rank_gets_torchruns_variables() {
    let out = launch(&[
        "-n",
        "3",
        "--",
        "sh",
        "-c",
        r#"test "$WORLD_SIZE" = 3 && test "$LOCAL_RANK" = "$RANK" && test -n "$MASTER_PORT" && echo rank=$RANK addr=$MASTER_ADDR nvls=$NCCL_NVLS_ENABLE"#,
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            "rank=0 addr=127.0.0.1 nvls=0",
            "rank=1 addr=127.0.0.1 nvls=0",
            "rank=2 addr=127.0.0.1 nvls=0"
        ]
    );
}

#[test]
fn master_address_port_and_nvls_can_be_given() {
    let out = Command::new(LAUNCH)
        .args([
            "-n",
            "2",
            "--master-addr",
            "localhost",
            "--master-port",
            "29533",
            "--",
            "sh",
            "-c",
            "echo $MASTER_ADDR:$MASTER_PORT nvls=$NCCL_NVLS_ENABLE",
        ])
        .env("NCCL_NVLS_ENABLE", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        text(&out.stdout),
        "localhost:29533 nvls=1\nlocalhost:29533 nvls=1\n"
    );
}

#[test]
fn a_failing_rank_stops_the_others_and_is_named() {
    let start = Instant::now();
    let out = launch(&[
        "-n",
        "3",
        "--",
        "sh",
        "-c",
        r#"if [ "$RANK" = 1 ]; then exit 3; else sleep 30; echo survived; fi"#,
    ]);
    let elapsed = start.elapsed();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(stderr.contains("rank 1 exited with status 3"), "{stderr}");
    // The sleeping siblings (and their `sleep` children, which hold the
    // output pipe) are gone at once, not after 30 s.
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    assert!(!text(&out.stdout).contains("survived"));
}

#[test]
fn a_rank_killed_by_a_signal_is_named() {
    let out = launch(&[
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        r#"if [ "$RANK" = 0 ]; then kill -9 $$; fi; sleep 30"#,
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 9), "{out:?}");
    assert!(stderr.contains("rank 0 was killed by signal 9"), "{stderr}");
}

#[test]
fn a_missing_command_fails_cleanly() {
    let out = launch(&["-n", "2", "--", "/nonexistent/offload-command"]);
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    assert!(text(&out.stderr).contains("cannot start rank 0"));
}

#[test]
fn bad_flags_are_clap_errors() {
    for args in [
        &["-n", "0", "--", "true"][..],
        &["-n", "x", "--", "true"],
        &["-n", "2"],
        &["--", "true"],
        &["-n", "2", "--master-port", "0", "--", "true"],
        &["-n", "2", "--master-port", "70000", "--", "true"],
        &["-n", "2", "--bogus", "--", "true"],
    ] {
        let out = launch(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(text(&out.stderr).contains("error"), "{args:?}");
    }
}

#[test]
fn the_check_skips_only_when_allowed_where_there_is_no_gpu() {
    if offload_dist::nccl_present() && offload_cuda::driver_present() {
        println!("skipped: NCCL and a GPU are present; the GPU bundle runs the check");
        return;
    }
    let allowed = Command::new(LAUNCH)
        .args(["-n", "2", "--", CHECK])
        .env("OFFLOAD_DIST_ALLOW_SKIP", "1")
        .output()
        .unwrap();
    assert!(allowed.status.success(), "{allowed:?}");
    assert_eq!(text(&allowed.stdout).matches("SKIP: ").count(), 2);

    let refused = launch(&["-n", "2", "--", CHECK]);
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        text(&refused.stdout).contains("FAIL init: NCCL unavailable"),
        "{refused:?}"
    );
}

#[test]
fn every_rank_gets_the_same_fresh_secret() {
    let run = || {
        let out = Command::new(LAUNCH)
            .args(["-n", "3", "--", "sh", "-c", "echo \"$OFFLOAD_DIST_SECRET\""])
            .env_remove("OFFLOAD_DIST_SECRET")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let stdout = text(&out.stdout);
        let lines: Vec<String> = stdout.lines().map(str::to_owned).collect();
        assert_eq!(lines.len(), 3, "{stdout}");
        assert!(lines.iter().all(|l| l == &lines[0]), "{lines:?}");
        assert_eq!(lines[0].len(), 64, "{lines:?}");
        assert!(lines[0].bytes().all(|b| b.is_ascii_hexdigit()), "{lines:?}");
        // The launcher never prints it.
        assert!(!text(&out.stderr).contains(&lines[0]));
        lines[0].clone()
    };
    assert_ne!(run(), run(), "a fresh secret for each job");
    // One given to the launcher is passed on as it is; a bad one is refused.
    let given = Command::new(LAUNCH)
        .args(["-n", "2", "--", "sh", "-c", "echo \"$OFFLOAD_DIST_SECRET\""])
        .env("OFFLOAD_DIST_SECRET", "a-secret-of-my-own-choosing")
        .output()
        .unwrap();
    assert_eq!(
        text(&given.stdout),
        "a-secret-of-my-own-choosing\na-secret-of-my-own-choosing\n"
    );
    let short = Command::new(LAUNCH)
        .args(["-n", "2", "--", "true"])
        .env("OFFLOAD_DIST_SECRET", "short")
        .output()
        .unwrap();
    assert_eq!(short.status.code(), Some(2), "{short:?}");
    assert!(
        text(&short.stderr).contains("OFFLOAD_DIST_SECRET"),
        "{short:?}"
    );
}
