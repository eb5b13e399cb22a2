//! The rendezvous over loopback: ranks in threads, short deadlines.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use offload_dist::{DistEnv, DistError, MAGIC, rendezvous};

/// A port that was free a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn env(rank: u32, world_size: u32, port: u16) -> DistEnv {
    DistEnv {
        rank,
        world_size,
        local_rank: rank,
        master_addr: "127.0.0.1".to_owned(),
        master_port: port,
    }
}

/// Runs `ranks` (rank, world size) as threads; rank 0 serves `payload`.
fn run(
    ranks: &[(u32, u32)],
    port: u16,
    payload: &[u8],
    timeout: Duration,
) -> Vec<(u32, Result<Vec<u8>, DistError>)> {
    let handles: Vec<_> = ranks
        .iter()
        .map(|&(rank, world)| {
            let payload = payload.to_vec();
            thread::spawn(move || {
                let env = env(rank, world, port);
                let p = (rank == 0).then_some(payload.as_slice());
                (rank, rendezvous(&env, p, timeout))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn three_ranks_all_get_the_payload() {
    let payload: Vec<u8> = (0..128u8).collect();
    let port = free_port();
    let results = run(
        &[(1, 3), (2, 3), (0, 3)],
        port,
        &payload,
        Duration::from_secs(5),
    );
    for (rank, result) in results {
        assert_eq!(result.unwrap(), payload, "rank {rank}");
    }
}

#[test]
fn peers_may_start_before_rank_0() {
    let payload = b"early".to_vec();
    let port = free_port();
    let peer = thread::spawn(move || rendezvous(&env(1, 2, port), None, Duration::from_secs(5)));
    thread::sleep(Duration::from_millis(300));
    let served = rendezvous(&env(0, 2, port), Some(&payload), Duration::from_secs(5));
    assert_eq!(served.unwrap(), payload);
    assert_eq!(peer.join().unwrap().unwrap(), payload);
}

#[test]
fn a_single_rank_needs_no_network() {
    // Port 1 is never ours: nothing may be bound or connected.
    let got = rendezvous(&env(0, 1, 1), Some(b"id"), Duration::from_millis(10)).unwrap();
    assert_eq!(got, b"id");
}

#[test]
fn a_missing_rank_is_named_within_the_deadline() {
    let port = free_port();
    let timeout = Duration::from_millis(800);
    let start = Instant::now();
    let results = run(&[(0, 3), (1, 3)], port, b"payload", timeout);
    let elapsed = start.elapsed();
    assert!(
        elapsed < timeout + Duration::from_secs(3),
        "took {elapsed:?}"
    );
    for (rank, result) in results {
        let err = result.unwrap_err();
        let text = err.to_string();
        match rank {
            0 => {
                assert!(
                    matches!(&err, DistError::MissingRanks { missing, arrived: 1, expected: 2, .. } if missing == &[2]),
                    "{err:?}"
                );
                assert!(text.contains("rank(s) 2 did not arrive"), "{text}");
            }
            _ => {
                assert!(matches!(err, DistError::Rejected { .. }), "{err:?}");
                assert!(text.contains("rank(s) 2 did not arrive"), "{text}");
            }
        }
    }
}

#[test]
fn a_world_size_mismatch_fails_both_sides() {
    let port = free_port();
    let results = run(&[(0, 2), (1, 3)], port, b"payload", Duration::from_secs(5));
    for (rank, result) in results {
        let err = result.unwrap_err();
        assert!(
            matches!(
                err,
                DistError::WorldSizeMismatch {
                    rank: 1,
                    rank0_world_size: 2,
                    peer_world_size: 3
                }
            ),
            "rank {rank}: {err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("WORLD_SIZE=2") && text.contains("WORLD_SIZE=3"),
            "{text}"
        );
    }
}

#[test]
fn a_duplicate_rank_fails_the_group() {
    let port = free_port();
    let results = run(
        &[(0, 3), (1, 3), (1, 3)],
        port,
        b"payload",
        Duration::from_secs(5),
    );
    for (rank, result) in results {
        let err = result.unwrap_err();
        if rank == 0 {
            assert!(
                matches!(err, DistError::DuplicateRank { rank: 1, .. }),
                "{err:?}"
            );
        } else {
            assert!(matches!(err, DistError::Rejected { .. }), "{err:?}");
            assert!(err.to_string().contains("RANK=1"), "{err}");
        }
    }
}

#[test]
fn nobody_listening_is_a_connect_error_naming_the_address() {
    let port = free_port();
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let err = rendezvous(&env(1, 2, port), None, timeout).unwrap_err();
    assert!(start.elapsed() < timeout + Duration::from_secs(2));
    match &err {
        DistError::Connect {
            rank: 1,
            addr,
            attempts,
            last_error,
            ..
        } => {
            assert_eq!(addr, &format!("127.0.0.1:{port}"));
            assert!(*attempts >= 1);
            assert!(
                last_error.to_lowercase().contains("refused"),
                "{last_error}"
            );
        }
        other => panic!("expected Connect, got {other:?}"),
    }
    assert!(err.to_string().contains(&format!("127.0.0.1:{port}")));
}

#[test]
fn a_port_in_use_is_a_bind_error() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let err = rendezvous(&env(0, 2, port), Some(b"x"), Duration::from_secs(1)).unwrap_err();
    match &err {
        DistError::Bind { addr, source } => {
            assert_eq!(addr, &format!("127.0.0.1:{port}"));
            assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse);
        }
        other => panic!("expected Bind, got {other:?}"),
    }
}

#[test]
fn payloads_only_come_from_rank_0() {
    let none = rendezvous(&env(0, 2, 1), None, Duration::from_millis(10)).unwrap_err();
    assert!(matches!(none, DistError::Usage { .. }), "{none:?}");
    let some = rendezvous(&env(1, 2, 1), Some(b"x"), Duration::from_millis(10)).unwrap_err();
    assert!(matches!(some, DistError::Usage { .. }), "{some:?}");
    let big = vec![0u8; offload_dist::MAX_PAYLOAD + 1];
    let big = rendezvous(&env(0, 2, 1), Some(&big), Duration::from_millis(10)).unwrap_err();
    assert!(matches!(big, DistError::Usage { .. }), "{big:?}");
}

/// Connects to rank 0 at `port`, retrying until it listens.
fn raw_connect(port: u16) -> TcpStream {
    let start = Instant::now();
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => return s,
            Err(e) if start.elapsed() < Duration::from_secs(3) => {
                let _ = e;
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("cannot connect: {e}"),
        }
    }
}

#[test]
fn a_stray_connection_is_ignored() {
    let port = free_port();
    let server =
        thread::spawn(move || rendezvous(&env(0, 2, port), Some(b"id"), Duration::from_secs(5)));
    let mut stray = raw_connect(port);
    stray.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let peer = rendezvous(&env(1, 2, port), None, Duration::from_secs(5));
    assert_eq!(peer.unwrap(), b"id");
    assert_eq!(server.join().unwrap().unwrap(), b"id");
}

#[test]
fn another_protocol_version_is_refused_on_both_sides() {
    let port = free_port();
    let server =
        thread::spawn(move || rendezvous(&env(0, 2, port), Some(b"id"), Duration::from_secs(5)));
    let mut other = raw_connect(port);
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&99u16.to_be_bytes());
    hello.extend_from_slice(&1u32.to_be_bytes());
    hello.extend_from_slice(&2u32.to_be_bytes());
    other.write_all(&hello).unwrap();
    let mut answer = Vec::new();
    other
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    other.read_to_end(&mut answer).unwrap();
    assert_eq!(&answer[..4], &MAGIC);
    assert_eq!(answer[6], 2, "status: rejected");
    assert!(String::from_utf8_lossy(&answer[11..]).contains("version 99"));
    let err = server.join().unwrap().unwrap_err();
    assert!(matches!(err, DistError::Protocol { .. }), "{err:?}");
    assert!(err.to_string().contains("version 99"), "{err}");
}

#[test]
fn a_server_that_is_not_rank_0_is_a_protocol_error() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 14];
        s.read_exact(&mut hello).unwrap();
        s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
    });
    let err = rendezvous(&env(1, 2, port), None, Duration::from_secs(2)).unwrap_err();
    server.join().unwrap();
    assert!(matches!(err, DistError::Protocol { .. }), "{err:?}");
    assert!(err.to_string().contains("magic"), "{err}");
}
