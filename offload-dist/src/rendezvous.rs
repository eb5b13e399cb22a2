//! The TCP rendezvous: rank 0 hands a byte payload (the NCCL unique id) to
//! every other rank, and every rank learns that the whole group is there.
//!
//! # Protocol (version 1)
//!
//! All integers are big-endian.
//!
//! * A peer (rank ≥ 1) connects to `MASTER_ADDR:MASTER_PORT`, retrying
//!   until the deadline, and sends a **hello**: `MAGIC` (`b"OFRV"`),
//!   `VERSION` (u16), its rank (u32), its world size (u32): 14 bytes.
//! * Rank 0 listens there and collects hellos. It answers no one until all
//!   `WORLD_SIZE - 1` peers have arrived (a barrier), then sends each an
//!   **answer**: `MAGIC`, `VERSION`, a status byte, a length (u32) and that
//!   many bytes. Status 0: the body is the payload. Status 1: world sizes
//!   differ, the body is rank 0's world size (u32). Status 2: rank 0 gave
//!   up, the body is its reason (UTF-8).
//! * Rank 0 gives up, tells every connected peer why, and returns a typed
//!   error on: a world-size mismatch, a rank claimed twice, a rank out of
//!   range, another protocol version, or the deadline passing with ranks
//!   missing (named in the error). A connection that does not start with
//!   the magic is not one of ours: it is dropped and the wait goes on.
//!
//! The payload is opaque and at most [`MAX_PAYLOAD`] bytes, so the
//! rendezvous is tested over loopback without NCCL.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::env::endpoint;
use crate::{DistEnv, DistError};

/// The first bytes of every message.
pub const MAGIC: [u8; 4] = *b"OFRV";
/// The protocol version.
pub const VERSION: u16 = 1;
/// The largest payload rank 0 may hand out.
pub const MAX_PAYLOAD: usize = 1 << 20;

const HELLO_LEN: usize = 14;
const ANSWER_HEADER_LEN: usize = 11;
const STATUS_OK: u8 = 0;
const STATUS_WORLD_MISMATCH: u8 = 1;
const STATUS_REJECTED: u8 = 2;
/// How long rank 0 spends telling peers it gave up.
const REJECT_GRACE: Duration = Duration::from_secs(2);
/// How long past its deadline a connected peer waits for rank 0's answer.
const ANSWER_GRACE: Duration = Duration::from_secs(2);
/// The longest single connection attempt of a peer.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);

/// Meets the rest of the group: rank 0 serves `payload` (it must be
/// `Some`, at most [`MAX_PAYLOAD`] bytes) to every other rank; the others
/// pass `None` and receive it. Returns the payload on every rank once the
/// whole group has arrived, or a typed error within about `timeout` (plus
/// up to 2 s: rank 0 to tell the peers why it failed, a connected peer to
/// hear it). With
/// `WORLD_SIZE = 1` it returns the payload at once, touching no network.
///
/// Runs its own current-thread tokio runtime: call it from a plain thread,
/// not from inside an async runtime.
pub fn rendezvous(
    env: &DistEnv,
    payload: Option<&[u8]>,
    timeout: Duration,
) -> Result<Vec<u8>, DistError> {
    let payload = match (env.rank, payload) {
        (0, None) => {
            return Err(DistError::Usage {
                what: "rank 0 passed no payload to the rendezvous".to_owned(),
                allowed: "rank 0 passes Some(payload), the other ranks None".to_owned(),
            });
        }
        (0, Some(p)) if p.len() > MAX_PAYLOAD => {
            return Err(DistError::Usage {
                what: format!("a rendezvous payload of {} bytes", p.len()),
                allowed: format!("at most {MAX_PAYLOAD} bytes"),
            });
        }
        (0, Some(p)) => Some(p),
        (rank, Some(_)) => {
            return Err(DistError::Usage {
                what: format!("rank {rank} passed a payload to the rendezvous"),
                allowed: "rank 0 passes Some(payload), the other ranks None".to_owned(),
            });
        }
        (_, None) => None,
    };
    if env.world_size == 1 {
        return Ok(payload.map(<[u8]>::to_vec).unwrap_or_default());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| DistError::Io {
            what: "starting the rendezvous runtime".to_owned(),
            source,
        })?;
    runtime.block_on(async {
        let deadline = Instant::now() + timeout;
        match payload {
            Some(p) => serve(env, p, timeout, deadline).await.map(|()| p.to_vec()),
            None => join(env, timeout, deadline).await,
        }
    })
}

fn hello_bytes(rank: u32, world_size: u32) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[..4].copy_from_slice(&MAGIC);
    b[4..6].copy_from_slice(&VERSION.to_be_bytes());
    b[6..10].copy_from_slice(&rank.to_be_bytes());
    b[10..14].copy_from_slice(&world_size.to_be_bytes());
    b
}

fn answer_bytes(status: u8, body: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(ANSWER_HEADER_LEN + body.len());
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&VERSION.to_be_bytes());
    b.push(status);
    // The body is at most MAX_PAYLOAD (or a short reason), far below u32.
    b.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_be_bytes());
    b.extend_from_slice(body);
    b
}

fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

// ---------------------------------------------------------------- rank 0

/// A peer's hello.
struct Hello {
    rank: u32,
    world_size: u32,
}

/// What a connection's first bytes said.
enum HelloOutcome {
    Hello(Hello),
    /// Not our magic (or closed early): not one of ours.
    Stray(String),
    /// Our magic, another version.
    Version(u16),
}

struct Arrival {
    stream: TcpStream,
    peer: SocketAddr,
    outcome: HelloOutcome,
}

async fn read_hello(stream: &mut TcpStream) -> HelloOutcome {
    let mut b = [0u8; HELLO_LEN];
    if let Err(e) = stream.read_exact(&mut b).await {
        return HelloOutcome::Stray(format!("no hello ({e})"));
    }
    if b[..4] != MAGIC {
        return HelloOutcome::Stray(format!("wrong magic {:?}", &b[..4]));
    }
    let version = be_u16(&b[4..6]);
    if version != VERSION {
        return HelloOutcome::Version(version);
    }
    HelloOutcome::Hello(Hello {
        rank: be_u32(&b[6..10]),
        world_size: be_u32(&b[10..14]),
    })
}

/// Rank 0 gives up: tells every arrived peer why (and `this`, the peer at
/// fault, with its own answer), concurrently and within [`REJECT_GRACE`]
/// (best effort: rank 0 is failing already).
async fn give_up(
    arrived: BTreeMap<u32, (TcpStream, SocketAddr)>,
    this: Option<(TcpStream, Vec<u8>)>,
    reason: &str,
) {
    let frame = answer_bytes(STATUS_REJECTED, reason.as_bytes());
    let mut tasks = tokio::task::JoinSet::new();
    let others = arrived.into_values().map(|(s, _)| (s, frame.clone()));
    for (mut stream, answer) in others.chain(this) {
        tasks.spawn(async move {
            let _ = stream.write_all(&answer).await;
            let _ = stream.shutdown().await;
        });
    }
    let _ = tokio::time::timeout(REJECT_GRACE, tasks.join_all()).await;
}

async fn serve(
    env: &DistEnv,
    payload: &[u8],
    timeout: Duration,
    deadline: Instant,
) -> Result<(), DistError> {
    let addr = env.master_endpoint();
    let world = env.world_size;
    let listener = TcpListener::bind((env.master_addr.as_str(), env.master_port))
        .await
        .map_err(|source| DistError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let expected = (world - 1) as usize;
    let (tx, mut rx) = mpsc::unbounded_channel::<Arrival>();
    let mut arrived: BTreeMap<u32, (TcpStream, SocketAddr)> = BTreeMap::new();
    let expiry = tokio::time::sleep_until(deadline);
    tokio::pin!(expiry);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((mut stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        let read = tokio::time::timeout_at(deadline, read_hello(&mut stream)).await;
                        let outcome = read.unwrap_or_else(|_| {
                            HelloOutcome::Stray("no hello before the deadline".to_owned())
                        });
                        let _ = tx.send(Arrival { stream, peer, outcome });
                    });
                }
                Err(e) => {
                    // Out of descriptors or similar: note it, pause, go on
                    // (the deadline still bounds the wait).
                    tracing::warn!("rendezvous: accept on {addr}: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
            Some(arrival) = rx.recv() => {
                let Arrival { stream, peer, outcome } = arrival;
                let hello = match outcome {
                    HelloOutcome::Hello(h) => h,
                    HelloOutcome::Stray(why) => {
                        tracing::warn!("rendezvous: ignoring a connection from {peer}: {why}");
                        continue;
                    }
                    HelloOutcome::Version(v) => {
                        let what = format!(
                            "speaks rendezvous protocol version {v}; rank 0 speaks version {VERSION} (run the same build on every rank)"
                        );
                        let own = answer_bytes(STATUS_REJECTED, format!("{peer} {what}").as_bytes());
                        give_up(arrived, Some((stream, own)), &format!("{peer} {what}")).await;
                        return Err(DistError::Protocol { peer: peer.to_string(), what });
                    }
                };
                if hello.world_size != world {
                    let err = DistError::WorldSizeMismatch {
                        rank: hello.rank,
                        rank0_world_size: world,
                        peer_world_size: hello.world_size,
                    };
                    let own = answer_bytes(STATUS_WORLD_MISMATCH, &world.to_be_bytes());
                    give_up(arrived, Some((stream, own)), &err.to_string()).await;
                    return Err(err);
                }
                if hello.rank == 0 || hello.rank >= world {
                    let what = format!(
                        "claims RANK={}; allowed for a peer: 1..={}",
                        hello.rank,
                        world - 1
                    );
                    let reason = format!("{peer} {what}");
                    let own = answer_bytes(STATUS_REJECTED, reason.as_bytes());
                    give_up(arrived, Some((stream, own)), &reason).await;
                    return Err(DistError::Protocol { peer: peer.to_string(), what });
                }
                if let Some((_, first)) = arrived.get(&hello.rank) {
                    let err = DistError::DuplicateRank {
                        rank: hello.rank,
                        first: first.to_string(),
                        second: peer.to_string(),
                    };
                    let own = answer_bytes(STATUS_REJECTED, err.to_string().as_bytes());
                    give_up(arrived, Some((stream, own)), &err.to_string()).await;
                    return Err(err);
                }
                arrived.insert(hello.rank, (stream, peer));
                if arrived.len() == expected {
                    return hand_out(arrived, payload).await;
                }
            },
            () = &mut expiry => {
                let missing: Vec<u32> = (1..world).filter(|r| !arrived.contains_key(r)).collect();
                let err = DistError::MissingRanks {
                    missing,
                    arrived: arrived.len(),
                    expected,
                    timeout,
                };
                give_up(arrived, None, &err.to_string()).await;
                return Err(err);
            },
        }
    }
}

/// Sends the payload to every peer (all have arrived).
async fn hand_out(
    arrived: BTreeMap<u32, (TcpStream, SocketAddr)>,
    payload: &[u8],
) -> Result<(), DistError> {
    let frame = answer_bytes(STATUS_OK, payload);
    let mut tasks = tokio::task::JoinSet::new();
    for (rank, (mut stream, peer)) in arrived {
        let frame = frame.clone();
        tasks.spawn(async move {
            let sent = tokio::time::timeout(REJECT_GRACE, async {
                stream.write_all(&frame).await?;
                stream.shutdown().await
            })
            .await;
            match sent {
                Ok(Ok(())) => Ok(()),
                Ok(Err(source)) => Err(DistError::Io {
                    what: format!("sending the payload to rank {rank} at {peer}"),
                    source,
                }),
                Err(_) => Err(DistError::Io {
                    what: format!("sending the payload to rank {rank} at {peer}"),
                    source: std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("not sent within {REJECT_GRACE:?}"),
                    ),
                }),
            }
        });
    }
    let mut first_error = None;
    while let Some(done) = tasks.join_next().await {
        if let Ok(Err(e)) = done {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

// ----------------------------------------------------------------- peers

async fn join(env: &DistEnv, timeout: Duration, deadline: Instant) -> Result<Vec<u8>, DistError> {
    let addr = endpoint(&env.master_addr, env.master_port);
    let mut stream = connect(env, &addr, timeout, deadline).await?;
    let _ = stream.set_nodelay(true);
    // Connected: wait a little past our own deadline for the answer, so
    // that rank 0's verdict (ranks missing at *its* deadline) reaches us.
    let deadline = deadline + ANSWER_GRACE;
    let no_answer = || DistError::NoAnswer {
        rank: env.rank,
        addr: addr.clone(),
        timeout,
    };
    let io = |what: &str, source| DistError::Io {
        what: format!("{what} rank 0 at {addr}"),
        source,
    };
    tokio::time::timeout_at(
        deadline,
        stream.write_all(&hello_bytes(env.rank, env.world_size)),
    )
    .await
    .map_err(|_| no_answer())?
    .map_err(|e| io("sending the hello to", e))?;

    let mut header = [0u8; ANSWER_HEADER_LEN];
    match tokio::time::timeout_at(deadline, stream.read_exact(&mut header)).await {
        Err(_) => return Err(no_answer()),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(DistError::Protocol {
                peer: addr.clone(),
                what: "rank 0 closed the connection without answering (not an offload rendezvous, or rank 0 failed)".to_owned(),
            });
        }
        Ok(Err(e)) => return Err(io("reading the answer of", e)),
        Ok(Ok(_)) => {}
    }
    if header[..4] != MAGIC {
        return Err(DistError::Protocol {
            peer: addr.clone(),
            what: format!(
                "answer starts with {:?}, not the rendezvous magic {MAGIC:?}",
                &header[..4]
            ),
        });
    }
    let version = be_u16(&header[4..6]);
    if version != VERSION {
        return Err(DistError::Protocol {
            peer: addr.clone(),
            what: format!(
                "rank 0 speaks rendezvous protocol version {version}, this rank version {VERSION} (run the same build on every rank)"
            ),
        });
    }
    let status = header[6];
    let len = be_u32(&header[7..11]) as usize;
    if len > MAX_PAYLOAD {
        return Err(DistError::Protocol {
            peer: addr.clone(),
            what: format!("announces {len} bytes; at most {MAX_PAYLOAD} allowed"),
        });
    }
    let mut body = vec![0u8; len];
    tokio::time::timeout_at(deadline, stream.read_exact(&mut body))
        .await
        .map_err(|_| no_answer())?
        .map_err(|e| io("reading the answer of", e))?;
    match status {
        STATUS_OK => Ok(body),
        STATUS_WORLD_MISMATCH if body.len() == 4 => Err(DistError::WorldSizeMismatch {
            rank: env.rank,
            rank0_world_size: be_u32(&body),
            peer_world_size: env.world_size,
        }),
        STATUS_REJECTED => Err(DistError::Rejected {
            addr,
            reason: String::from_utf8_lossy(&body).into_owned(),
        }),
        other => Err(DistError::Protocol {
            peer: addr,
            what: format!("unknown answer status {other} with {len} bytes"),
        }),
    }
}

/// Connects to rank 0, retrying (refused, unreachable, name not yet
/// resolvable) until the deadline.
async fn connect(
    env: &DistEnv,
    addr: &str,
    timeout: Duration,
    deadline: Instant,
) -> Result<TcpStream, DistError> {
    let mut attempts = 0u32;
    let mut last_error = "no attempt made".to_owned();
    let mut backoff = Duration::from_millis(10);
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(DistError::Connect {
                rank: env.rank,
                addr: addr.to_owned(),
                timeout,
                attempts,
                last_error,
            });
        }
        attempts += 1;
        let attempt = (deadline - now).min(CONNECT_ATTEMPT);
        let connecting = TcpStream::connect((env.master_addr.as_str(), env.master_port));
        match tokio::time::timeout(attempt, connecting).await {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(e)) => last_error = e.to_string(),
            Err(_) => last_error = format!("connect timed out after {attempt:?}"),
        }
        tokio::time::sleep_until((Instant::now() + backoff).min(deadline)).await;
        backoff = (backoff * 2).min(Duration::from_millis(200));
    }
}
