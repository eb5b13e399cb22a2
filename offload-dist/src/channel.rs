//! [`SideChannel`]: the rendezvous's TCP connections, kept open after it,
//! so that a rank that fails tells the others at once, and a rank that
//! dies without a word is seen by its closed connection; and [`Abort`],
//! the hook through which the others then abort their communicators.
//!
//! # Protocol (after the rendezvous's answer, on the same connections)
//!
//! A star: each peer keeps its one connection to rank 0; rank 0 keeps one
//! to each peer and relays. Every frame is `kind` (u8), `rank` (u32, big
//! endian), `len` (u16) and `len` bytes of UTF-8 (at most
//! [`MAX_REASON_BYTES`]):
//!
//! * `PING` (1): sent by both sides after a second without other frames;
//!   a connection silent for the silence limit ([`SILENCE`] unless the
//!   rendezvous's config says otherwise) counts as closed.
//! * `FAILED` (2): rank `rank` failed, the body says why. A peer sends it
//!   for itself ([`SideChannel::report`], or its dropped channel); rank 0
//!   sends it for itself and relays each peer's to every other peer.
//! * `VANISHED` (3): rank 0 saw rank `rank`'s connection close (or fall
//!   silent) without `BYE`: it died without a word. Relayed to every other
//!   peer; a peer whose connection to rank 0 closes records rank 0 so.
//! * `BYE` (4): this rank finished ([`SideChannel::finish`]); its closing
//!   connection is then no failure.
//!
//! Each rank records the first failure it learns of (rank 0 relays in the
//! order it learns them, so every peer records the same first one), wakes
//! every waiter, and runs its [`Abort`] hooks on a thread of their own.

use std::fmt;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};

use crate::DistError;

/// The longest reason a frame carries (longer ones are cut).
pub const MAX_REASON_BYTES: usize = 4096;
/// How long a side-channel connection may stay silent (no frame, not even
/// a ping) before it counts as closed, by default
/// ([`crate::RendezvousConfig::silence`]).
pub const SILENCE: Duration = Duration::from_secs(6);
/// How often an idle side-channel connection sends a ping (at most; a
/// quarter of the silence limit where that is shorter).
const HEARTBEAT: Duration = Duration::from_secs(1);
/// How long [`SideChannel::report`] and [`SideChannel::finish`] wait for
/// their frames to be written.
const FLUSH: Duration = Duration::from_secs(2);
/// How long one frame's write may take before the connection counts as
/// closed.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

const PING: u8 = 1;
const FAILED: u8 = 2;
const VANISHED: u8 = 3;
const BYE: u8 = 4;
const FRAME_HEADER: usize = 7;

/// Another rank of the group failed: what this rank learned through its
/// side channel.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerFailure {
    /// The rank said it failed, and why.
    #[error("rank {rank} failed: {error}")]
    Failed {
        /// The rank that failed.
        rank: u32,
        /// Its error, as it reported it.
        error: String,
    },
    /// The rank's connection closed, or fell silent, without a word: it
    /// was killed, crashed, or its host is gone.
    #[error("rank {rank} died without a word ({detail})")]
    Vanished {
        /// The rank that died.
        rank: u32,
        /// How it was seen (closed connection, silence).
        detail: String,
    },
}

impl PeerFailure {
    /// The rank that failed.
    pub fn rank(&self) -> u32 {
        match self {
            Self::Failed { rank, .. } | Self::Vanished { rank, .. } => *rank,
        }
    }
}

/// What a communicator does when another rank of its group fails: abort,
/// so that whatever this rank waits for (a collective blocked on the
/// failed rank) returns a typed error instead of hanging.
///
/// [`SideChannel::on_failure`] runs it once, on a thread of the channel's,
/// possibly while another thread of this rank is blocked inside a
/// collective: an implementation must be safe to call then, must not wait
/// for that collective, and should return within a second or so.
/// [`crate::NcclCollective::abort_handle`] gives NCCL's (`ncclCommAbort`).
pub trait Abort: Send + Sync {
    /// Aborts because of `failure`.
    fn abort(&self, failure: &PeerFailure);
}

impl<F: Fn(&PeerFailure) + Send + Sync> Abort for F {
    fn abort(&self, failure: &PeerFailure) {
        self(failure)
    }
}

/// One rank's side channel to the rest of its group, made by the
/// rendezvous ([`crate::rendezvous()`]); a thread of its own keeps its
/// connections. A group of one has no peer: its channel never fails.
///
/// Drop it only through [`Self::finish`] when this rank is done: dropping
/// it otherwise (an error returned, a panic) tells the others that this
/// rank failed, so that none of them waits for it.
pub struct SideChannel {
    shared: Arc<Shared>,
    commands: Option<mpsc::UnboundedSender<Command>>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for SideChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SideChannel")
            .field("rank", &self.shared.rank)
            .field("world_size", &self.shared.world_size)
            .field("failure", &self.failure())
            .finish()
    }
}

pub(crate) struct Shared {
    rank: u32,
    world_size: u32,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    failure: Option<PeerFailure>,
    hooks: Vec<Arc<dyn Abort>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Records `failure` if it is the first, wakes the waiters and runs
    /// the hooks (on a thread of their own).
    fn record(&self, failure: PeerFailure) {
        let mut st = lock(&self.state);
        if st.failure.is_some() {
            return;
        }
        tracing::error!(
            "rank {} of {}: {failure}; aborting this rank's communicator",
            self.rank,
            self.world_size
        );
        st.failure = Some(failure.clone());
        let hooks = st.hooks.clone();
        drop(st);
        self.changed.notify_all();
        run_hooks(hooks, failure);
    }
}

fn run_hooks(hooks: Vec<Arc<dyn Abort>>, failure: PeerFailure) {
    if hooks.is_empty() {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("offload-dist-abort".to_owned())
        .spawn({
            let failure = failure.clone();
            let hooks = hooks.clone();
            move || {
                for h in &hooks {
                    h.abort(&failure);
                }
            }
        });
    if spawned.is_err() {
        // No thread to be had: abort here rather than not at all.
        for h in &hooks {
            h.abort(&failure);
        }
    }
}

pub(crate) enum Command {
    /// This rank failed: tell the others, then acknowledge.
    Report(String, std_mpsc::Sender<()>),
    /// This rank is done: say BYE, acknowledge, stop.
    Finish(std_mpsc::Sender<()>),
}

impl SideChannel {
    /// A group of one: nobody to tell, nobody to lose.
    pub(crate) fn alone(rank: u32, world_size: u32) -> Self {
        Self {
            shared: Arc::new(Shared {
                rank,
                world_size,
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
            }),
            commands: None,
            thread: None,
        }
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.shared.rank
    }

    /// The group's size.
    pub fn world_size(&self) -> u32 {
        self.shared.world_size
    }

    /// The first failure of another rank this rank has learned of.
    pub fn failure(&self) -> Option<PeerFailure> {
        lock(&self.shared.state).failure.clone()
    }

    /// `Ok` while no other rank has failed, else
    /// [`DistError::PeerFailed`] naming the first that did.
    pub fn check(&self) -> Result<(), DistError> {
        match self.failure() {
            None => Ok(()),
            Some(failure) => Err(self.error(failure)),
        }
    }

    /// The typed error for `failure`, as this rank reports it.
    pub fn error(&self, failure: PeerFailure) -> DistError {
        DistError::PeerFailed {
            this_rank: self.shared.rank,
            world_size: self.shared.world_size,
            failure,
        }
    }

    /// Waits up to `timeout` for another rank to fail; the failure, or
    /// `None` if none did in that time.
    pub fn wait_for_failure(&self, timeout: Duration) -> Option<PeerFailure> {
        let deadline = Instant::now() + timeout;
        let mut st = lock(&self.shared.state);
        loop {
            if let Some(f) = &st.failure {
                return Some(f.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Runs `hook` when another rank fails (at once, on a thread of its
    /// own, if one already has). Hooks run once, in the order given.
    pub fn on_failure(&self, hook: Arc<dyn Abort>) {
        let mut st = lock(&self.shared.state);
        st.hooks.push(Arc::clone(&hook));
        if let Some(f) = st.failure.clone() {
            drop(st);
            run_hooks(vec![hook], f);
        }
    }

    /// Tells the other ranks that this one failed with `error`; returns
    /// once the message is written (at most 2 s), so that the process can
    /// exit right after. A group of one, or a channel already closed,
    /// does nothing.
    pub fn report(&self, error: &dyn fmt::Display) {
        self.send(|ack| Command::Report(error.to_string(), ack));
    }

    /// This rank is done: tells the others so (its closing connection is
    /// then no failure) and closes the channel. After rank 0 finishes,
    /// the peers still running no longer hear of each other's failures.
    pub fn finish(mut self) {
        self.send(Command::Finish);
        self.close();
    }

    fn send(&self, command: impl FnOnce(std_mpsc::Sender<()>) -> Command) {
        let Some(commands) = &self.commands else {
            return;
        };
        let (ack, acked) = std_mpsc::channel();
        if commands.send(command(ack)).is_ok() {
            let _ = acked.recv_timeout(FLUSH + Duration::from_millis(500));
        }
    }

    fn close(&mut self) {
        self.commands = None;
        if let Some(t) = self.thread.take() {
            // Its loop ends when the commands close; bounded by FLUSH.
            let give_up = Instant::now() + FLUSH * 2;
            while !t.is_finished() && Instant::now() < give_up {
                std::thread::sleep(Duration::from_millis(2));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for SideChannel {
    fn drop(&mut self) {
        if self.commands.is_some() {
            let how = if std::thread::panicking() {
                "while panicking"
            } else {
                "without finish() (an error returned?)"
            };
            let why = format!(
                "rank {} dropped its group {how}; it is gone",
                self.shared.rank
            );
            self.send(|ack| Command::Report(why, ack));
        }
        self.close();
    }
}

// ------------------------------------------------------- the thread's side

/// The connections the rendezvous leaves: rank 0's to each peer (by
/// rank), or a peer's to rank 0.
pub(crate) type Links = Vec<(u32, TcpStream)>;

/// A channel's shared state, and its command queue (the handle's end and
/// the loop's end).
pub(crate) fn parts(
    rank: u32,
    world_size: u32,
) -> (
    Arc<Shared>,
    mpsc::UnboundedSender<Command>,
    mpsc::UnboundedReceiver<Command>,
) {
    let shared = Arc::new(Shared {
        rank,
        world_size,
        state: Mutex::new(State::default()),
        changed: Condvar::new(),
    });
    let (tx, rx) = mpsc::unbounded_channel();
    (shared, tx, rx)
}

impl SideChannel {
    pub(crate) fn from_parts(
        shared: Arc<Shared>,
        commands: mpsc::UnboundedSender<Command>,
        thread: JoinHandle<()>,
    ) -> Self {
        Self {
            shared,
            commands: Some(commands),
            thread: Some(thread),
        }
    }
}

struct Frame {
    kind: u8,
    rank: u32,
    body: String,
}

fn frame_bytes(kind: u8, rank: u32, body: &str) -> Vec<u8> {
    let mut end = body.len().min(MAX_REASON_BYTES);
    while !body.is_char_boundary(end) {
        end -= 1;
    }
    let body = &body.as_bytes()[..end];
    let mut b = Vec::with_capacity(FRAME_HEADER + body.len());
    b.push(kind);
    b.extend_from_slice(&rank.to_be_bytes());
    // At most MAX_REASON_BYTES, below u16::MAX.
    b.extend_from_slice(&(body.len() as u16).to_be_bytes());
    b.extend_from_slice(body);
    b
}

async fn read_frame(r: &mut OwnedReadHalf) -> Result<Frame, String> {
    let mut h = [0u8; FRAME_HEADER];
    r.read_exact(&mut h).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            "its connection closed".to_owned()
        } else {
            format!("its connection failed: {e}")
        }
    })?;
    let kind = h[0];
    let rank = u32::from_be_bytes([h[1], h[2], h[3], h[4]]);
    let len = usize::from(u16::from_be_bytes([h[5], h[6]]));
    if !(PING..=BYE).contains(&kind) || len > MAX_REASON_BYTES {
        return Err(format!(
            "its connection sent a frame of kind {kind} with {len} bytes (kinds 1 to 4, at most {MAX_REASON_BYTES} bytes)"
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)
        .await
        .map_err(|e| format!("its connection failed inside a frame: {e}"))?;
    Ok(Frame {
        kind,
        rank,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

enum Event {
    Frame(u32, Frame),
    /// The link to this rank closed, failed or fell silent.
    Lost(u32, String),
}

/// A frame to write, and who waits for it to be written.
type Outgoing = (Vec<u8>, Option<oneshot::Sender<()>>);

async fn write_loop(
    mut w: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    heartbeat: Duration,
) {
    let ping = frame_bytes(PING, 0, "");
    loop {
        let (bytes, ack) = match tokio::time::timeout(heartbeat, rx.recv()).await {
            Ok(Some(out)) => out,
            Ok(None) => break,
            Err(_) => (ping.clone(), None),
        };
        match tokio::time::timeout(WRITE_TIMEOUT, w.write_all(&bytes)).await {
            Ok(Ok(())) => {
                if let Some(a) = ack {
                    let _ = a.send(());
                }
            }
            // The reader sees the failure too (or its silence).
            _ => break,
        }
    }
    let _ = w.shutdown().await;
}

async fn read_loop(
    rank: u32,
    mut r: OwnedReadHalf,
    tx: mpsc::UnboundedSender<Event>,
    silence: Duration,
) {
    loop {
        let event = match tokio::time::timeout(silence, read_frame(&mut r)).await {
            Ok(Ok(frame)) if frame.kind == PING => continue,
            Ok(Ok(frame)) => {
                let bye = frame.kind == BYE;
                let _ = tx.send(Event::Frame(rank, frame));
                if bye {
                    return;
                }
                continue;
            }
            Ok(Err(why)) => Event::Lost(rank, why),
            Err(_) => Event::Lost(rank, format!("its connection was silent for {silence:?}")),
        };
        let _ = tx.send(event);
        return;
    }
}

struct Link {
    writer: Option<mpsc::UnboundedSender<Outgoing>>,
    /// Said BYE, or lost: no failure to come from it.
    done: bool,
}

/// The channel's loop: runs on the rendezvous's thread until the handle
/// finishes or is dropped.
pub(crate) async fn run(
    shared: Arc<Shared>,
    links: Links,
    mut commands: mpsc::UnboundedReceiver<Command>,
    silence: Duration,
) {
    let heartbeat = HEARTBEAT.min(silence / 4);
    let me = shared.rank;
    let (events_tx, mut events) = mpsc::unbounded_channel::<Event>();
    let mut map: std::collections::BTreeMap<u32, Link> = std::collections::BTreeMap::new();
    for (rank, stream) in links {
        let _ = stream.set_nodelay(true);
        let (r, w) = stream.into_split();
        let (wtx, wrx) = mpsc::unbounded_channel();
        tokio::spawn(write_loop(w, wrx, heartbeat));
        tokio::spawn(read_loop(rank, r, events_tx.clone(), silence));
        map.insert(
            rank,
            Link {
                writer: Some(wtx),
                done: false,
            },
        );
    }
    drop(events_tx);
    // Sends `bytes` to every live link but `except`; the acks to wait for.
    let broadcast = |map: &std::collections::BTreeMap<u32, Link>,
                     bytes: &[u8],
                     except: Option<u32>|
     -> Vec<oneshot::Receiver<()>> {
        let mut acks = Vec::new();
        for (rank, link) in map {
            if Some(*rank) == except || link.done {
                continue;
            }
            if let Some(w) = &link.writer {
                let (atx, arx) = oneshot::channel();
                if w.send((bytes.to_vec(), Some(atx))).is_ok() {
                    acks.push(arx);
                }
            }
        }
        acks
    };
    loop {
        tokio::select! {
            command = commands.recv() => match command {
                Some(Command::Report(why, ack)) => {
                    let acks = broadcast(&map, &frame_bytes(FAILED, me, &why), None);
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(FLUSH, async {
                            for a in acks {
                                let _ = a.await;
                            }
                        })
                        .await;
                        let _ = ack.send(());
                    });
                }
                Some(Command::Finish(ack)) => {
                    let acks = broadcast(&map, &frame_bytes(BYE, me, ""), None);
                    let _ = tokio::time::timeout(FLUSH, async {
                        for a in acks {
                            let _ = a.await;
                        }
                    })
                    .await;
                    let _ = ack.send(());
                    return;
                }
                // The handle is gone (its drop reported first): stop.
                None => return,
            },
            event = events.recv() => match event {
                None => {
                    // Every link is done: wait for the handle alone.
                    match commands.recv().await {
                        Some(Command::Report(_, ack) | Command::Finish(ack)) => {
                            let _ = ack.send(());
                        }
                        None => return,
                    }
                }
                Some(Event::Frame(from, frame)) => match frame.kind {
                    FAILED => {
                        // A peer speaks only for itself; rank 0 relays.
                        let rank = if me == 0 { from } else { frame.rank };
                        if me == 0 {
                            let _ = broadcast(&map, &frame_bytes(FAILED, rank, &frame.body), Some(from));
                        }
                        shared.record(PeerFailure::Failed { rank, error: frame.body });
                    }
                    VANISHED if me != 0 => {
                        shared.record(PeerFailure::Vanished { rank: frame.rank, detail: frame.body });
                    }
                    BYE => {
                        if let Some(link) = map.get_mut(&from) {
                            link.done = true;
                            link.writer = None;
                        }
                    }
                    _ => {}
                },
                Some(Event::Lost(from, detail)) => {
                    let Some(link) = map.get_mut(&from) else { continue };
                    if link.done {
                        continue;
                    }
                    link.done = true;
                    link.writer = None;
                    if me == 0 {
                        let _ = broadcast(&map, &frame_bytes(VANISHED, from, &detail), Some(from));
                    }
                    shared.record(PeerFailure::Vanished { rank: from, detail });
                }
            },
        }
    }
}
