//! The rendezvous over loopback: ranks in threads, short deadlines; and
//! strangers (no secret, a wrong one, a replayed hello, junk) that must
//! neither take a rank nor read the payload while the group still forms.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use offload_dist::{DistEnv, DistError, Joined, MAGIC, RendezvousConfig, Secret, VERSION};
use sha2::Sha256;

/// The rendezvous, open (no secret), its payload only (the channel is
/// finished at once).
fn rendezvous(
    env: &DistEnv,
    payload: Option<&[u8]>,
    timeout: Duration,
) -> Result<Vec<u8>, DistError> {
    meet(env, payload, &RendezvousConfig::new(timeout))
}

fn meet(
    env: &DistEnv,
    payload: Option<&[u8]>,
    config: &RendezvousConfig,
) -> Result<Vec<u8>, DistError> {
    offload_dist::rendezvous(env, payload, config).map(finish)
}

fn finish(j: Joined) -> Vec<u8> {
    j.channel.finish();
    j.payload
}

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
    let some = rendezvous(&env(1, 1, 1), Some(b"x"), Duration::from_millis(10)).unwrap_err();
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
fn another_protocol_version_is_dropped_and_named() {
    let port = free_port();
    let server = thread::spawn(move || {
        offload_dist::rendezvous(
            &env(0, 2, port),
            Some(b"id"),
            &RendezvousConfig::new(Duration::from_secs(5)),
        )
    });
    let mut other = raw_connect(port);
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&99u16.to_be_bytes());
    hello.extend_from_slice(&1u32.to_be_bytes());
    hello.extend_from_slice(&2u32.to_be_bytes());
    other.write_all(&hello).unwrap();
    let got = read_all(&mut other);
    assert_eq!(got.len(), CHALLENGE_LEN, "only the challenge: {got:?}");
    let peer = rendezvous(&env(1, 2, port), None, Duration::from_secs(5));
    assert_eq!(peer.unwrap(), b"id");
    let joined = server.join().unwrap().unwrap();
    assert!(
        joined.dropped.iter().any(|d| d.contains("version 99")),
        "{:?}",
        joined.dropped
    );
    finish(joined);
}

#[test]
fn a_server_that_is_not_rank_0_is_a_protocol_error() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.write_all(&b"HTTP/1.1 400 Bad Request\r\n".repeat(4))
            .unwrap();
        let _ = read_all(&mut s);
    });
    let err = rendezvous(&env(1, 2, port), None, Duration::from_secs(2)).unwrap_err();
    server.join().unwrap();
    assert!(matches!(err, DistError::Protocol { .. }), "{err:?}");
    assert!(err.to_string().contains("magic"), "{err}");
}

// ------------------------------------------------- the job's secret

const CHALLENGE_LEN: usize = 39;
const HELLO_LEN: usize = 78;
const SECRET: &[u8] = b"offload-dist-test-secret-0123456789";

fn secret() -> Option<Secret> {
    Some(Secret::new(SECRET.to_vec()).unwrap())
}

fn with_secret(timeout: Duration) -> RendezvousConfig {
    RendezvousConfig::new(timeout).with_secret(secret())
}

/// Everything the other side sends until it closes (or 5 s pass).
fn read_all(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// A hello for `challenge` (rank 0's 39 bytes) proved under `key`, as the
/// wire format says (the rendezvous module's docs).
fn forged_hello(challenge: &[u8], rank: u32, world: u32, key: &[u8]) -> Vec<u8> {
    assert_eq!(&challenge[..4], &MAGIC);
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&VERSION.to_be_bytes());
    h.extend_from_slice(&rank.to_be_bytes());
    h.extend_from_slice(&world.to_be_bytes());
    h.extend_from_slice(&[7u8; 32]);
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap();
    m.update(b"offload-dist hello v2");
    m.update(&challenge[7..39]);
    m.update(&h);
    h.extend_from_slice(&m.finalize().into_bytes());
    h
}

/// A stranger that reads the challenge and answers with `hello`: returns
/// what rank 0 sent after the challenge (nothing, if it was dropped).
fn stranger(port: u16, hello: impl FnOnce(&[u8]) -> Vec<u8>) -> Vec<u8> {
    let mut s = raw_connect(port);
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut challenge = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut challenge).unwrap();
    assert_eq!(challenge[6] & 1, 1, "rank 0 says it has a secret");
    s.write_all(&hello(&challenge)).unwrap();
    read_all(&mut s)
}

/// Rank 0 of `world` with the secret, in a thread.
fn serve(
    world: u32,
    port: u16,
    timeout: Duration,
) -> thread::JoinHandle<Result<Joined, DistError>> {
    thread::spawn(move || {
        offload_dist::rendezvous(&env(0, world, port), Some(b"the-id"), &with_secret(timeout))
    })
}

fn peer(
    rank: u32,
    world: u32,
    port: u16,
    config: RendezvousConfig,
) -> thread::JoinHandle<Result<Vec<u8>, DistError>> {
    thread::spawn(move || meet(&env(rank, world, port), None, &config))
}

/// Rank 0's outcome: the payload served and the connections it dropped.
fn served(h: thread::JoinHandle<Result<Joined, DistError>>) -> Vec<String> {
    let j = h.join().unwrap().unwrap();
    assert_eq!(j.payload, b"the-id");
    let dropped = j.dropped.clone();
    finish(j);
    dropped
}

#[test]
fn a_hello_without_the_secret_takes_no_rank_and_reads_no_id() {
    let port = free_port();
    let server = serve(2, port, Duration::from_secs(8));
    // A stranger proving the empty key (what an open rendezvous takes).
    let got = stranger(port, |c| forged_hello(c, 1, 2, b""));
    assert!(got.is_empty(), "the stranger was answered: {got:?}");
    // One of ours without the secret is told so at once, by name.
    let err = meet(
        &env(1, 2, port),
        None,
        &RendezvousConfig::new(Duration::from_secs(3)),
    )
    .unwrap_err();
    assert!(
        matches!(err, DistError::SecretMismatch { rank: 1, .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("OFFLOAD_DIST_SECRET is not set"),
        "{err}"
    );
    // The group still forms.
    let rank1 = peer(1, 2, port, with_secret(Duration::from_secs(5)));
    assert_eq!(rank1.join().unwrap().unwrap(), b"the-id");
    let dropped = served(server);
    assert!(
        dropped
            .iter()
            .any(|d| d.contains("does not prove the job's secret")),
        "{dropped:?}"
    );
}

#[test]
fn a_wrong_secret_takes_no_rank_and_reads_no_id() {
    let port = free_port();
    let server = serve(2, port, Duration::from_secs(8));
    let got = stranger(port, |c| {
        forged_hello(c, 1, 2, b"another-secret-0123456789")
    });
    assert!(got.is_empty(), "the stranger was answered: {got:?}");
    // A rank of another job (another secret) claiming rank 1 first.
    let other = RendezvousConfig::new(Duration::from_secs(3)).with_secret(Some(
        Secret::new(b"another-secret-0123456789".to_vec()).unwrap(),
    ));
    let err = meet(&env(1, 2, port), None, &other).unwrap_err();
    assert!(matches!(err, DistError::Protocol { .. }), "{err:?}");
    assert!(err.to_string().contains("OFFLOAD_DIST_SECRET"), "{err}");
    let rank1 = peer(1, 2, port, with_secret(Duration::from_secs(5)));
    assert_eq!(rank1.join().unwrap().unwrap(), b"the-id");
    let dropped = served(server);
    assert_eq!(dropped.len(), 2, "{dropped:?}");
}

#[test]
fn a_replayed_hello_is_dropped() {
    let port = free_port();
    let server = serve(3, port, Duration::from_secs(8));
    // Rank 1 reaches rank 0 through a proxy that records what it sends.
    let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_port = proxy.local_addr().unwrap().port();
    let (hello_tx, hello_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    thread::spawn(move || {
        let (mut client, _) = proxy.accept().unwrap();
        let mut upstream = raw_connect(port);
        let mut down = (upstream.try_clone().unwrap(), client.try_clone().unwrap());
        thread::spawn(move || {
            let _ = std::io::copy(&mut down.0, &mut down.1);
            let _ = down.1.shutdown(Shutdown::Write);
        });
        let mut hello = vec![0u8; HELLO_LEN];
        client.read_exact(&mut hello).unwrap();
        upstream.write_all(&hello).unwrap();
        hello_tx.send(hello).unwrap();
        let _ = std::io::copy(&mut client, &mut upstream);
        let _ = upstream.shutdown(Shutdown::Write);
    });
    let rank1 = peer(1, 3, proxy_port, with_secret(Duration::from_secs(8)));
    let captured = hello_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    // Replayed on a new connection (a new nonce), after rank 1 arrived:
    // taken, it would be "rank 1 claimed twice" and the group would fail.
    let got = stranger(port, |_| captured.clone());
    assert!(got.is_empty(), "the replay was answered: {got:?}");
    let rank2 = peer(2, 3, port, with_secret(Duration::from_secs(5)));
    assert_eq!(rank1.join().unwrap().unwrap(), b"the-id");
    assert_eq!(rank2.join().unwrap().unwrap(), b"the-id");
    let dropped = served(server);
    assert!(
        dropped.iter().any(|d| d.contains("replayed")),
        "{dropped:?}"
    );
}

#[test]
fn a_flood_of_junk_neither_stalls_the_group_nor_reads_the_id() {
    let port = free_port();
    let config = RendezvousConfig {
        hello_timeout: Duration::from_millis(500),
        ..with_secret(Duration::from_secs(10))
    };
    let server =
        thread::spawn(move || offload_dist::rendezvous(&env(0, 3, port), Some(b"the-id"), &config));
    let mut junk = Vec::new();
    for i in 0..100u32 {
        let mut s = raw_connect(port);
        let bytes: Vec<u8> = match i % 4 {
            // Random bytes.
            0 => (0..300u32)
                .map(|k| (k.wrapping_mul(2_654_435_761).wrapping_add(i) >> 7) as u8)
                .collect(),
            // Half-open: connected, never a byte.
            1 => Vec::new(),
            // Our magic and version, then lengths of 4 GiB.
            2 => [&MAGIC[..], &VERSION.to_be_bytes(), &[0xff; 8]].concat(),
            // A full-size hello with a random proof, claiming rank 1 or 2.
            _ => {
                let mut h = [
                    &MAGIC[..],
                    &VERSION.to_be_bytes(),
                    &(1 + i % 2).to_be_bytes(),
                    &3u32.to_be_bytes(),
                ]
                .concat();
                h.resize(HELLO_LEN, (i * 37) as u8);
                h
            }
        };
        if !bytes.is_empty() {
            let _ = s.write_all(&bytes);
        }
        junk.push(s);
    }
    let start = Instant::now();
    let rank1 = peer(1, 3, port, with_secret(Duration::from_secs(8)));
    let rank2 = peer(2, 3, port, with_secret(Duration::from_secs(8)));
    assert_eq!(rank1.join().unwrap().unwrap(), b"the-id");
    assert_eq!(rank2.join().unwrap().unwrap(), b"the-id");
    let formed = start.elapsed();
    let dropped = served(server);
    assert!(formed < Duration::from_secs(5), "formed after {formed:?}");
    println!("formed {formed:?} after the ranks started, through 100 junk connections");
    // Nothing but a challenge ever reached a junk connection.
    for (i, s) in junk.iter_mut().enumerate() {
        let got = read_all(s);
        assert!(
            got.len() <= CHALLENGE_LEN,
            "junk connection {i} got {} bytes",
            got.len()
        );
    }
    // The 50 that sent something whole were judged before the group
    // formed; the silent and the short ones are dropped at their hello
    // deadline, whether or not the group has formed by then.
    assert!(
        dropped.len() >= 50,
        "{} dropped: {dropped:?}",
        dropped.len()
    );
}

#[test]
fn a_secret_on_one_side_only_is_named() {
    let port = free_port();
    let open =
        thread::spawn(move || rendezvous(&env(0, 2, port), Some(b"x"), Duration::from_secs(3)));
    let err = meet(&env(1, 2, port), None, &with_secret(Duration::from_secs(2))).unwrap_err();
    assert!(
        matches!(err, DistError::SecretMismatch { rank: 1, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("open rendezvous"), "{err}");
    let _ = open.join().unwrap();
}

#[test]
fn an_answer_that_does_not_prove_the_secret_is_refused() {
    // A stranger listening at MASTER_ADDR:MASTER_PORT, pretending to be
    // rank 0 of a job with a secret, hands out an id of its own.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let fake = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut c = [&MAGIC[..], &VERSION.to_be_bytes(), &[1u8]].concat();
        c.extend_from_slice(&[9u8; 32]);
        s.write_all(&c).unwrap();
        let mut hello = [0u8; HELLO_LEN];
        s.read_exact(&mut hello).unwrap();
        let mut a = [
            &MAGIC[..],
            &VERSION.to_be_bytes(),
            &[0u8],
            &4u32.to_be_bytes(),
            b"evil",
        ]
        .concat();
        a.extend_from_slice(&[0u8; 32]);
        s.write_all(&a).unwrap();
        let _ = read_all(&mut s);
    });
    let err = meet(&env(1, 2, port), None, &with_secret(Duration::from_secs(3))).unwrap_err();
    assert!(matches!(err, DistError::Protocol { .. }), "{err:?}");
    assert!(
        err.to_string().contains("does not prove the job's secret"),
        "{err}"
    );
    fake.join().unwrap();
}

#[test]
fn secrets_are_checked() {
    assert!(Secret::new(b"short".to_vec()).is_err());
    assert!(Secret::new(vec![b'x'; 2000]).is_err());
    let e = Secret::from_value(Some(Vec::new())).unwrap_err();
    assert!(
        e.to_string().contains("OFFLOAD_DIST_SECRET") && e.to_string().contains("empty"),
        "{e}"
    );
    assert_eq!(Secret::from_value(None).unwrap(), None);
    let s = Secret::generate().unwrap();
    assert_eq!(s.to_env_value().len(), 64);
    assert_ne!(s, Secret::generate().unwrap());
    assert!(
        !format!("{s:?}").contains(&s.to_env_value()),
        "Debug shows no secret"
    );
}

#[test]
fn ranks_missing_at_the_deadline_name_the_connections_dropped() {
    let port = free_port();
    let server = serve(2, port, Duration::from_millis(1500));
    // One of ours with another secret: dropped, so rank 1 never arrives.
    let got = stranger(port, |c| forged_hello(c, 1, 2, b"yet-another-secret-0123"));
    assert!(got.is_empty(), "{got:?}");
    let err = server.join().unwrap().unwrap_err();
    assert!(
        matches!(&err, DistError::MissingRanks { missing, dropped: 1, first_dropped: Some(first), .. }
            if missing == &[1] && first.contains("does not prove the job's secret")),
        "{err:?}"
    );
    assert!(err.to_string().contains("1 connection(s) dropped"), "{err}");
}

#[test]
fn a_silence_limit_too_short_is_refused() {
    let config = RendezvousConfig {
        silence: Duration::from_millis(10),
        ..RendezvousConfig::new(Duration::from_secs(1))
    };
    let err = meet(&env(1, 2, 1), None, &config).unwrap_err();
    assert!(matches!(err, DistError::Usage { .. }), "{err:?}");
}
