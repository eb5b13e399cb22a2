//! `DistEnv::from_vars`: every variable, missing and malformed.

use std::collections::HashMap;

use offload_dist::{DistEnv, DistError};

fn good() -> HashMap<&'static str, String> {
    [
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ]
    .into_iter()
    .map(|(k, v)| (k, v.to_owned()))
    .collect()
}

fn parse(vars: &HashMap<&'static str, String>) -> Result<DistEnv, DistError> {
    DistEnv::from_vars(|k| vars.get(k).cloned())
}

fn with(var: &'static str, value: &str) -> Result<DistEnv, DistError> {
    let mut vars = good();
    vars.insert(var, value.to_owned());
    parse(&vars)
}

fn without(var: &'static str) -> Result<DistEnv, DistError> {
    let mut vars = good();
    vars.remove(var);
    parse(&vars)
}

#[test]
fn a_complete_environment_parses() {
    let env = parse(&good()).unwrap();
    assert_eq!(
        env,
        DistEnv {
            rank: 1,
            world_size: 4,
            local_rank: 1,
            master_addr: "127.0.0.1".to_owned(),
            master_port: 29500,
        }
    );
    assert_eq!(env.master_endpoint(), "127.0.0.1:29500");
}

#[test]
fn ipv6_endpoints_are_bracketed() {
    let env = with("MASTER_ADDR", "::1").unwrap();
    assert_eq!(env.master_endpoint(), "[::1]:29500");
}

#[test]
fn each_missing_variable_is_named() {
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        let err = without(var).unwrap_err();
        match &err {
            DistError::MissingVar { var: v, allowed } => {
                assert_eq!(*v, var);
                assert!(!allowed.is_empty());
            }
            other => panic!("{var}: expected MissingVar, got {other:?}"),
        }
        let text = err.to_string();
        assert!(text.contains(var) && text.contains("not set"), "{text}");
    }
}

/// Asserts an InvalidVar for `var` holding `value`, whose message names
/// the value and the allowed range.
fn assert_invalid(result: Result<DistEnv, DistError>, var: &str, value: &str, allowed: &str) {
    let err = result.unwrap_err();
    match &err {
        DistError::InvalidVar {
            var: v, value: got, ..
        } => {
            assert_eq!(*v, var);
            assert_eq!(got, value);
        }
        other => panic!("{var}={value}: expected InvalidVar, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains(var) && text.contains(value) && text.contains(allowed),
        "{text}"
    );
}

#[test]
fn numbers_must_be_plain_decimal() {
    for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"] {
        for bad in ["abc", "-1", "1.5", " 1", "0x10"] {
            assert_invalid(with(var, bad), var, bad, "allowed");
        }
        assert_invalid(with(var, ""), var, "", "empty");
    }
}

#[test]
fn world_size_must_be_positive_and_bounded() {
    assert_invalid(
        with("WORLD_SIZE", "0"),
        "WORLD_SIZE",
        "0",
        "from 1 to 65536",
    );
    assert_invalid(
        with("WORLD_SIZE", "65537"),
        "WORLD_SIZE",
        "65537",
        "from 1 to 65536",
    );
    assert_invalid(
        with("WORLD_SIZE", "99999999999"),
        "WORLD_SIZE",
        "99999999999",
        "out of range",
    );
}

#[test]
fn rank_must_be_below_world_size() {
    let err = with("RANK", "4").unwrap_err();
    assert!(
        matches!(
            err,
            DistError::RankOutOfRange {
                rank: 4,
                world_size: 4
            }
        ),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.contains("RANK=4") && text.contains("WORLD_SIZE=4") && text.contains("0..=3"));
}

#[test]
fn local_rank_must_be_below_world_size() {
    assert_invalid(with("LOCAL_RANK", "4"), "LOCAL_RANK", "4", "from 0 to 3");
}

#[test]
fn master_port_must_be_a_usable_port() {
    assert_invalid(
        with("MASTER_PORT", "0"),
        "MASTER_PORT",
        "0",
        "from 1 to 65535",
    );
    assert_invalid(
        with("MASTER_PORT", "65536"),
        "MASTER_PORT",
        "65536",
        "out of range",
    );
    assert_invalid(
        with("MASTER_PORT", "70000"),
        "MASTER_PORT",
        "70000",
        "1 to 65535",
    );
}

#[test]
fn master_addr_must_be_a_plain_name() {
    assert_invalid(with("MASTER_ADDR", ""), "MASTER_ADDR", "", "empty");
    assert_invalid(
        with("MASTER_ADDR", "a host"),
        "MASTER_ADDR",
        "a host",
        "whitespace",
    );
    let long = "a".repeat(254);
    assert_invalid(with("MASTER_ADDR", &long), "MASTER_ADDR", &long, "253");
}

#[test]
fn a_single_process_group_parses() {
    let mut vars = good();
    vars.insert("RANK", "0".to_owned());
    vars.insert("WORLD_SIZE", "1".to_owned());
    vars.insert("LOCAL_RANK", "0".to_owned());
    let env = parse(&vars).unwrap();
    assert_eq!((env.rank, env.world_size), (0, 1));
}
