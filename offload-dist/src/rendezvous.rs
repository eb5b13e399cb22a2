//! The TCP rendezvous: rank 0 hands a byte payload (the NCCL unique id) to
//! every other rank of its job, and only to them; every rank learns that
//! the whole group is there; and the connections stay open as the
//! group's [`SideChannel`].
//!
//! # Protocol (version 2)
//!
//! All integers are big-endian; `mac(…)` is HMAC-SHA256 under the job's
//! secret ([`Secret`], `OFFLOAD_DIST_SECRET`; the empty key where there is
//! none) over the parts named, one after the other.
//!
//! * A peer (rank ≥ 1) connects to `MASTER_ADDR:MASTER_PORT`, retrying
//!   until the deadline (also when the connection closes before the
//!   challenge: rank 0 sheds connections beyond [`MAX_PENDING`]).
//! * Rank 0 sends a **challenge** at once: `MAGIC` (`b"OFRV"`), `VERSION`
//!   (u16), flags (u8; bit 0: rank 0 has a secret) and a fresh random
//!   nonce `n0` (32 bytes): 39 bytes.
//! * The peer answers with a **hello**: `MAGIC`, `VERSION`, its rank
//!   (u32), its world size (u32), a random nonce `n1` (32 bytes) and
//!   `mac("offload-dist hello v2", n0, the 46 bytes before it)`: 78 bytes.
//!   A peer whose secret disagrees with the flag (one has a secret, the
//!   other not) fails at once, naming the variable.
//! * Rank 0 reads the hello within [`HELLO_TIMEOUT`] of the accept (a
//!   fixed size: nothing a stranger sends is a length to allocate), checks
//!   the proof in constant time, and only then looks at the rank. A
//!   connection that is not ours (no magic, another version, a wrong
//!   proof, a replayed hello: its proof is for another nonce, silent,
//!   short) is dropped and logged (tracing warn), and the wait goes on; it
//!   never takes a rank and never reads the payload.
//! * Rank 0 answers no one until all `WORLD_SIZE - 1` peers have proved
//!   their hello (a barrier), then sends each an **answer**: `MAGIC`,
//!   `VERSION`, a status byte, a length (u32), that many bytes, and
//!   `mac("offload-dist answer v2", n0, n1, the answer before it)`, which
//!   the peer checks (a stranger listening at `MASTER_ADDR` cannot hand
//!   out an id). Status 0: the body is the payload. Status 1: world sizes
//!   differ, the body is rank 0's world size (u32). Status 2: rank 0 gave
//!   up, the body is its reason (UTF-8).
//! * Rank 0 gives up, tells every proved peer why, and returns a typed
//!   error on: a world-size mismatch, a rank claimed twice, a rank out of
//!   range (each from a proved hello: with a secret, a stranger can cause
//!   none of them), or the deadline passing with ranks missing (named in
//!   the error, with the connections it dropped).
//! * Then the connections carry the side channel (`channel.rs`).
//!
//! Without a secret the proofs are made with the empty key, so anyone can
//! make them: the rendezvous is open, and says so once (tracing warn).
//! The payload is opaque and at most [`MAX_PAYLOAD`] bytes, so the
//! rendezvous is tested over loopback without NCCL.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::channel::{self, Links, SILENCE, SideChannel};
use crate::env::endpoint;
use crate::secret::{self, MAC_LEN, NONCE_LEN, SECRET_VAR, Secret};
use crate::{DistEnv, DistError};

/// The first bytes of every message.
pub const MAGIC: [u8; 4] = *b"OFRV";
/// The protocol version.
pub const VERSION: u16 = 2;
/// The largest payload rank 0 may hand out.
pub const MAX_PAYLOAD: usize = 1 << 20;
/// How long rank 0 waits for a connection's hello after accepting it.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// How many connections may await their hello at once; rank 0 sheds the
/// ones beyond (a peer so shed reconnects).
pub const MAX_PENDING: usize = 256;

const CHALLENGE_LEN: usize = 4 + 2 + 1 + NONCE_LEN;
const HELLO_SIGNED_LEN: usize = 4 + 2 + 4 + 4 + NONCE_LEN;
const HELLO_LEN: usize = HELLO_SIGNED_LEN + MAC_LEN;
const ANSWER_HEADER_LEN: usize = 11;
const FLAG_SECRET: u8 = 1;
const HELLO_DOMAIN: &[u8] = b"offload-dist hello v2";
const ANSWER_DOMAIN: &[u8] = b"offload-dist answer v2";
const STATUS_OK: u8 = 0;
const STATUS_WORLD_MISMATCH: u8 = 1;
const STATUS_REJECTED: u8 = 2;
/// How long rank 0 spends telling peers it gave up.
const REJECT_GRACE: Duration = Duration::from_secs(2);
/// How long past its deadline a connected peer waits for rank 0's answer.
const ANSWER_GRACE: Duration = Duration::from_secs(2);
/// The longest single connection attempt of a peer.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);
/// Dropped connections logged one by one (then one line for the rest).
const LOGGED_DROPS: usize = 16;
/// Dropped connections remembered, with their reasons.
const KEPT_DROPS: usize = 256;

/// How a rendezvous runs.
#[derive(Clone, Debug)]
pub struct RendezvousConfig {
    /// The deadline for the whole group to arrive (rank 0 answers within
    /// it, plus 2 s to tell the peers why it failed).
    pub timeout: Duration,
    /// The job's secret; `None`: an open rendezvous (a warning, once).
    pub secret: Option<Secret>,
    /// How long rank 0 waits for each connection's hello.
    pub hello_timeout: Duration,
    /// How long a side-channel connection may be silent before its rank
    /// counts as dead ([`SILENCE`]; pings go every second, or a quarter of
    /// this where that is shorter).
    pub silence: Duration,
}

impl RendezvousConfig {
    /// Open (no secret), with `timeout` and [`HELLO_TIMEOUT`].
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            secret: None,
            hello_timeout: HELLO_TIMEOUT,
            silence: SILENCE,
        }
    }

    /// With `secret` (`None`: open).
    pub fn with_secret(mut self, secret: Option<Secret>) -> Self {
        self.secret = secret;
        self
    }
}

/// What a rendezvous gives each rank.
#[derive(Debug)]
pub struct Joined {
    /// Rank 0's payload.
    pub payload: Vec<u8>,
    /// The group's side channel (the rendezvous's connections, kept).
    pub channel: SideChannel,
    /// On rank 0: the connections it dropped (not ours, or shed), each as
    /// "address: why", at most 256; empty on the other ranks.
    pub dropped: Vec<String>,
}

static OPEN_WARNED: AtomicBool = AtomicBool::new(false);

/// Meets the rest of the group: rank 0 serves `payload` (it must be
/// `Some`, at most [`MAX_PAYLOAD`] bytes) to every other rank that proves
/// the job's secret; the others pass `None` and receive it. Returns the
/// payload and the side channel on every rank once the whole group has
/// arrived, or a typed error within about `config.timeout` (plus up to
/// 2 s: rank 0 to tell the peers why it failed, a connected peer to hear
/// it). With `WORLD_SIZE = 1` it returns the payload at once, touching no
/// network.
///
/// Runs its own thread (a current-thread tokio runtime), which then keeps
/// the side channel: call it from anywhere.
pub fn rendezvous(
    env: &DistEnv,
    payload: Option<&[u8]>,
    config: &RendezvousConfig,
) -> Result<Joined, DistError> {
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
        (0, Some(p)) => Some(p.to_vec()),
        (rank, Some(_)) => {
            return Err(DistError::Usage {
                what: format!("rank {rank} passed a payload to the rendezvous"),
                allowed: "rank 0 passes Some(payload), the other ranks None".to_owned(),
            });
        }
        (_, None) => None,
    };
    if config.silence < Duration::from_millis(100) {
        return Err(DistError::Usage {
            what: format!("a side-channel silence limit of {:?}", config.silence),
            allowed: "at least 100 ms (pings go every second, or a quarter of it)".to_owned(),
        });
    }
    if env.world_size == 1 {
        return Ok(Joined {
            payload: payload.unwrap_or_default(),
            channel: SideChannel::alone(env.rank, env.world_size),
            dropped: Vec::new(),
        });
    }
    if config.secret.is_none() && !OPEN_WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "rendezvous on {}: no {SECRET_VAR} is set, so it is open: anyone who reaches it can take a rank or read the NCCL id (offload-launch sets one; under torchrun set the same value on every rank)",
            env.master_endpoint()
        );
    }
    let (shared, commands, command_rx) = channel::parts(env.rank, env.world_size);
    let handle_shared = Arc::clone(&shared);
    let (result_tx, result_rx) = std_mpsc::channel();
    let env_owned = env.clone();
    let config = config.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("offload-dist-rank-{}", env.rank))
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(source) => {
                    let _ = result_tx.send(Err(DistError::Io {
                        what: "starting the rendezvous runtime".to_owned(),
                        source,
                    }));
                    return;
                }
            };
            runtime.block_on(async move {
                let env = env_owned;
                let deadline = Instant::now() + config.timeout;
                let met = match payload {
                    Some(p) => serve(&env, &p, &config, deadline)
                        .await
                        .map(|(links, dropped)| (p, links, dropped)),
                    None => join(&env, &config, deadline)
                        .await
                        .map(|(p, links)| (p, links, Vec::new())),
                };
                match met {
                    Ok((payload, links, dropped)) => {
                        if result_tx.send(Ok((payload, dropped))).is_ok() {
                            channel::run(shared, links, command_rx, config.silence).await;
                        }
                    }
                    Err(e) => {
                        let _ = result_tx.send(Err(e));
                    }
                }
            });
        })
        .map_err(|source| DistError::Io {
            what: "starting the rendezvous thread".to_owned(),
            source,
        })?;
    match result_rx.recv() {
        Ok(Ok((payload, dropped))) => Ok(Joined {
            payload,
            channel: SideChannel::from_parts(handle_shared, commands, spawned),
            dropped,
        }),
        Ok(Err(e)) => {
            let _ = spawned.join();
            Err(e)
        }
        Err(_) => Err(DistError::Io {
            what: "the rendezvous thread".to_owned(),
            source: std::io::Error::other("it ended without an answer"),
        }),
    }
}

fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// One proved connection: the stream and both nonces.
struct Session {
    stream: TcpStream,
    peer: SocketAddr,
    n0: [u8; NONCE_LEN],
    n1: [u8; NONCE_LEN],
}

fn answer_bytes(
    key: &[u8],
    n0: &[u8; NONCE_LEN],
    n1: &[u8; NONCE_LEN],
    status: u8,
    body: &[u8],
) -> Result<Vec<u8>, DistError> {
    let mut b = Vec::with_capacity(ANSWER_HEADER_LEN + body.len() + MAC_LEN);
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&VERSION.to_be_bytes());
    b.push(status);
    // The body is at most MAX_PAYLOAD (or a short reason), far below u32.
    b.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_be_bytes());
    b.extend_from_slice(body);
    let proof = secret::mac(key, &[ANSWER_DOMAIN, n0, n1, &b])?;
    b.extend_from_slice(&proof);
    Ok(b)
}

// ---------------------------------------------------------------- rank 0

/// A peer's proved hello.
struct Hello {
    rank: u32,
    world_size: u32,
}

/// What a connection's first bytes said.
enum HelloOutcome {
    Hello(Hello, Session),
    /// Not one of ours (or a stranger's): dropped.
    Stray(SocketAddr, String),
}

/// Challenges a fresh connection and reads its hello (bounded by the
/// caller's deadline); only a hello whose proof holds comes back.
async fn greet(
    mut stream: TcpStream,
    peer: SocketAddr,
    key: &[u8],
    has_secret: bool,
) -> HelloOutcome {
    let stray = |why: String| HelloOutcome::Stray(peer, why);
    let n0: [u8; NONCE_LEN] = match secret::random_bytes() {
        Ok(n) => n,
        Err(e) => return stray(format!("no nonce for it: {e}")),
    };
    let mut challenge = Vec::with_capacity(CHALLENGE_LEN);
    challenge.extend_from_slice(&MAGIC);
    challenge.extend_from_slice(&VERSION.to_be_bytes());
    challenge.push(if has_secret { FLAG_SECRET } else { 0 });
    challenge.extend_from_slice(&n0);
    if let Err(e) = stream.write_all(&challenge).await {
        return stray(format!("sending the challenge: {e}"));
    }
    let mut b = [0u8; HELLO_LEN];
    if let Err(e) = stream.read_exact(&mut b[..6]).await {
        return stray(format!("no hello ({e})"));
    }
    if b[..4] != MAGIC {
        return stray(format!("wrong magic {:?}", &b[..4]));
    }
    let version = be_u16(&b[4..6]);
    if version != VERSION {
        return stray(format!(
            "speaks rendezvous protocol version {version}; rank 0 speaks version {VERSION} (run the same build on every rank)"
        ));
    }
    if let Err(e) = stream.read_exact(&mut b[6..]).await {
        return stray(format!("a short hello ({e})"));
    }
    let (signed, proof) = b.split_at(HELLO_SIGNED_LEN);
    if !secret::verify(key, &[HELLO_DOMAIN, &n0, signed], proof) {
        let why = if has_secret {
            format!(
                "its hello does not prove the job's secret (no {SECRET_VAR}, another one, or a replayed hello)"
            )
        } else {
            "its hello's proof is corrupt".to_owned()
        };
        return stray(why);
    }
    let mut n1 = [0u8; NONCE_LEN];
    n1.copy_from_slice(&signed[14..14 + NONCE_LEN]);
    HelloOutcome::Hello(
        Hello {
            rank: be_u32(&signed[6..10]),
            world_size: be_u32(&signed[10..14]),
        },
        Session {
            stream,
            peer,
            n0,
            n1,
        },
    )
}

/// Rank 0 gives up: tells every proved peer why (and `this`, the peer at
/// fault, with its own status and body), concurrently and within
/// [`REJECT_GRACE`] (best effort: rank 0 is failing already).
async fn give_up(
    key: &[u8],
    arrived: BTreeMap<u32, Session>,
    this: Option<(Session, u8, Vec<u8>)>,
    reason: &str,
) {
    let mut tasks = tokio::task::JoinSet::new();
    let others = arrived
        .into_values()
        .map(|s| (s, STATUS_REJECTED, reason.as_bytes().to_vec()));
    for (mut s, status, body) in others.chain(this) {
        let Ok(answer) = answer_bytes(key, &s.n0, &s.n1, status, &body) else {
            continue;
        };
        tasks.spawn(async move {
            let _ = s.stream.write_all(&answer).await;
            let _ = s.stream.shutdown().await;
        });
    }
    let _ = tokio::time::timeout(REJECT_GRACE, tasks.join_all()).await;
}

/// The connections rank 0 dropped, logged (the first ones one by one).
#[derive(Default)]
struct Drops {
    count: usize,
    kept: Vec<String>,
}

impl Drops {
    fn add(&mut self, peer: SocketAddr, why: &str) {
        self.count += 1;
        if self.count <= LOGGED_DROPS {
            tracing::warn!("rendezvous: dropped a connection from {peer}: {why}");
        } else if self.count == LOGGED_DROPS + 1 {
            tracing::warn!(
                "rendezvous: dropped a connection from {peer}: {why}; more dropped connections are not logged one by one"
            );
        }
        if self.kept.len() < KEPT_DROPS {
            self.kept.push(format!("{peer}: {why}"));
        }
    }
}

async fn serve(
    env: &DistEnv,
    payload: &[u8],
    config: &RendezvousConfig,
    deadline: Instant,
) -> Result<(Links, Vec<String>), DistError> {
    let addr = env.master_endpoint();
    let world = env.world_size;
    let timeout = config.timeout;
    let has_secret = config.secret.is_some();
    let key: Arc<[u8]> = Arc::from(secret::key(config.secret.as_ref()));
    let listener = TcpListener::bind((env.master_addr.as_str(), env.master_port))
        .await
        .map_err(|source| DistError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let expected = (world - 1) as usize;
    let (tx, mut rx) = mpsc::unbounded_channel::<HelloOutcome>();
    let pending = Arc::new(AtomicUsize::new(0));
    let mut arrived: BTreeMap<u32, Session> = BTreeMap::new();
    let mut drops = Drops::default();
    let expiry = tokio::time::sleep_until(deadline);
    tokio::pin!(expiry);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if pending.load(Ordering::Relaxed) >= MAX_PENDING {
                        drop(stream);
                        drops.add(peer, &format!("shed: {MAX_PENDING} connections already await their hello"));
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    pending.fetch_add(1, Ordering::Relaxed);
                    let (tx, key, pending) = (tx.clone(), Arc::clone(&key), Arc::clone(&pending));
                    let until = deadline.min(Instant::now() + config.hello_timeout);
                    let hello_timeout = config.hello_timeout;
                    tokio::spawn(async move {
                        let outcome = tokio::time::timeout_at(until, greet(stream, peer, &key, has_secret))
                            .await
                            .unwrap_or_else(|_| {
                                HelloOutcome::Stray(peer, format!("no hello within {hello_timeout:?} (or before the deadline)"))
                            });
                        pending.fetch_sub(1, Ordering::Relaxed);
                        let _ = tx.send(outcome);
                    });
                }
                Err(e) => {
                    // Out of descriptors or similar: note it, pause, go on
                    // (the deadline still bounds the wait).
                    tracing::warn!("rendezvous: accept on {addr}: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
            Some(outcome) = rx.recv() => {
                let (hello, session) = match outcome {
                    HelloOutcome::Hello(h, s) => (h, s),
                    HelloOutcome::Stray(peer, why) => {
                        drops.add(peer, &why);
                        continue;
                    }
                };
                let peer = session.peer;
                if hello.world_size != world {
                    let err = DistError::WorldSizeMismatch {
                        rank: hello.rank,
                        rank0_world_size: world,
                        peer_world_size: hello.world_size,
                    };
                    let own = (session, STATUS_WORLD_MISMATCH, world.to_be_bytes().to_vec());
                    give_up(&key, arrived, Some(own), &err.to_string()).await;
                    return Err(err);
                }
                if hello.rank == 0 || hello.rank >= world {
                    let what = format!(
                        "claims RANK={}; allowed for a peer: 1..={}",
                        hello.rank,
                        world - 1
                    );
                    let reason = format!("{peer} {what}");
                    let own = (session, STATUS_REJECTED, reason.clone().into_bytes());
                    give_up(&key, arrived, Some(own), &reason).await;
                    return Err(DistError::Protocol { peer: peer.to_string(), what });
                }
                if let Some(first) = arrived.get(&hello.rank) {
                    let err = DistError::DuplicateRank {
                        rank: hello.rank,
                        first: first.peer.to_string(),
                        second: peer.to_string(),
                    };
                    let own = (session, STATUS_REJECTED, err.to_string().into_bytes());
                    give_up(&key, arrived, Some(own), &err.to_string()).await;
                    return Err(err);
                }
                arrived.insert(hello.rank, session);
                if arrived.len() == expected {
                    let links = hand_out(&key, arrived, payload).await?;
                    return Ok((links, drops.kept));
                }
            },
            () = &mut expiry => {
                let missing: Vec<u32> = (1..world).filter(|r| !arrived.contains_key(r)).collect();
                let err = DistError::MissingRanks {
                    missing,
                    arrived: arrived.len(),
                    expected,
                    timeout,
                    dropped: drops.count,
                    first_dropped: drops.kept.first().cloned(),
                };
                give_up(&key, arrived, None, &err.to_string()).await;
                return Err(err);
            },
        }
    }
}

/// Sends the payload to every peer (all have arrived); their connections
/// become the side channel.
async fn hand_out(
    key: &[u8],
    arrived: BTreeMap<u32, Session>,
    payload: &[u8],
) -> Result<Links, DistError> {
    let mut tasks = tokio::task::JoinSet::new();
    for (rank, mut s) in arrived {
        let frame = answer_bytes(key, &s.n0, &s.n1, STATUS_OK, payload)?;
        tasks.spawn(async move {
            let sent = tokio::time::timeout(REJECT_GRACE, s.stream.write_all(&frame)).await;
            let what = || format!("sending the payload to rank {rank} at {}", s.peer);
            match sent {
                Ok(Ok(())) => Ok((rank, s.stream)),
                Ok(Err(source)) => Err(DistError::Io {
                    what: what(),
                    source,
                }),
                Err(_) => Err(DistError::Io {
                    what: what(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("not sent within {REJECT_GRACE:?}"),
                    ),
                }),
            }
        });
    }
    let mut first_error = None;
    let mut links = Vec::new();
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(Ok(link)) => links.push(link),
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(_) => {}
        }
    }
    links.sort_by_key(|(rank, _)| *rank);
    first_error.map_or(Ok(links), Err)
}

// ----------------------------------------------------------------- peers

async fn join(
    env: &DistEnv,
    config: &RendezvousConfig,
    deadline: Instant,
) -> Result<(Vec<u8>, Links), DistError> {
    let addr = endpoint(&env.master_addr, env.master_port);
    let timeout = config.timeout;
    let key = secret::key(config.secret.as_ref());
    let (mut stream, n0) = loop {
        let mut stream = connect(env, &addr, timeout, deadline).await?;
        let _ = stream.set_nodelay(true);
        match read_challenge(&mut stream, &addr, env, config, deadline).await? {
            Some(n0) => break (stream, n0),
            // Closed before the challenge (shed by rank 0): again.
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
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
    let n1: [u8; NONCE_LEN] = secret::random_bytes()?;
    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&VERSION.to_be_bytes());
    hello.extend_from_slice(&env.rank.to_be_bytes());
    hello.extend_from_slice(&env.world_size.to_be_bytes());
    hello.extend_from_slice(&n1);
    let proof = secret::mac(key, &[HELLO_DOMAIN, &n0, &hello])?;
    hello.extend_from_slice(&proof);
    tokio::time::timeout_at(deadline, stream.write_all(&hello))
        .await
        .map_err(|_| no_answer())?
        .map_err(|e| io("sending the hello to", e))?;

    let mut header = [0u8; ANSWER_HEADER_LEN];
    match tokio::time::timeout_at(deadline, stream.read_exact(&mut header)).await {
        Err(_) => return Err(no_answer()),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(DistError::Protocol {
                peer: addr.clone(),
                what: format!(
                    "rank 0 closed the connection without answering: it refused this rank's hello (a different {SECRET_VAR}?), or it failed"
                ),
            });
        }
        Ok(Err(e)) => return Err(io("reading the answer of", e)),
        Ok(Ok(_)) => {}
    }
    check_preamble(&header, &addr)?;
    let status = header[6];
    let len = be_u32(&header[7..11]) as usize;
    if len > MAX_PAYLOAD {
        return Err(DistError::Protocol {
            peer: addr.clone(),
            what: format!("announces {len} bytes; at most {MAX_PAYLOAD} allowed"),
        });
    }
    let mut body = vec![0u8; len + MAC_LEN];
    tokio::time::timeout_at(deadline, stream.read_exact(&mut body))
        .await
        .map_err(|_| no_answer())?
        .map_err(|e| io("reading the answer of", e))?;
    let proof = body.split_off(len);
    if !secret::verify(key, &[ANSWER_DOMAIN, &n0, &n1, &header, &body], &proof) {
        return Err(DistError::Protocol {
            peer: addr.clone(),
            what: format!(
                "rank 0's answer does not prove the job's secret ({SECRET_VAR}): not this job's rank 0"
            ),
        });
    }
    match status {
        STATUS_OK => Ok((body, vec![(0, stream)])),
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

/// Checks a message's magic and version.
fn check_preamble(b: &[u8], addr: &str) -> Result<(), DistError> {
    if b[..4] != MAGIC {
        return Err(DistError::Protocol {
            peer: addr.to_owned(),
            what: format!(
                "answer starts with {:?}, not the rendezvous magic {MAGIC:?}",
                &b[..4]
            ),
        });
    }
    let version = be_u16(&b[4..6]);
    if version != VERSION {
        return Err(DistError::Protocol {
            peer: addr.to_owned(),
            what: format!(
                "rank 0 speaks rendezvous protocol version {version}, this rank version {VERSION} (run the same build on every rank)"
            ),
        });
    }
    Ok(())
}

/// Reads rank 0's challenge: its nonce, or `None` where the connection
/// closed first (rank 0 shed it: connect again).
async fn read_challenge(
    stream: &mut TcpStream,
    addr: &str,
    env: &DistEnv,
    config: &RendezvousConfig,
    deadline: Instant,
) -> Result<Option<[u8; NONCE_LEN]>, DistError> {
    let mut c = [0u8; CHALLENGE_LEN];
    match tokio::time::timeout_at(deadline + ANSWER_GRACE, stream.read_exact(&mut c)).await {
        Err(_) => {
            return Err(DistError::NoAnswer {
                rank: env.rank,
                addr: addr.to_owned(),
                timeout: config.timeout,
            });
        }
        Ok(Err(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            if Instant::now() >= deadline {
                return Err(DistError::Protocol {
                    peer: addr.to_owned(),
                    what: "rank 0 closed every connection before its challenge until the deadline"
                        .to_owned(),
                });
            }
            return Ok(None);
        }
        Ok(Err(e)) => {
            return Err(DistError::Io {
                what: format!("reading the challenge of rank 0 at {addr}"),
                source: e,
            });
        }
        Ok(Ok(_)) => {}
    }
    check_preamble(&c, addr)?;
    let rank0_has_secret = c[6] & FLAG_SECRET != 0;
    match (rank0_has_secret, config.secret.is_some()) {
        (true, false) => {
            return Err(DistError::SecretMismatch {
                rank: env.rank,
                addr: addr.to_owned(),
                what: format!(
                    "rank 0 requires the job's secret, but {SECRET_VAR} is not set on this rank"
                ),
            });
        }
        (false, true) => {
            return Err(DistError::SecretMismatch {
                rank: env.rank,
                addr: addr.to_owned(),
                what: format!(
                    "{SECRET_VAR} is set on this rank, but rank 0 runs an open rendezvous (no secret)"
                ),
            });
        }
        _ => {}
    }
    let mut n0 = [0u8; NONCE_LEN];
    n0.copy_from_slice(&c[7..]);
    Ok(Some(n0))
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
