//! The side channel over loopback: a rank that fails before, inside or
//! after a collective, or is killed, and every other rank returns a typed
//! error naming it within 10 s instead of hanging.
//!
//! The "communicator" here is a loopback transport ([`Loopback`]): an
//! all-gather that returns only once every rank has entered it, like
//! NCCL's, and that [`Abort`] releases, like `ncclCommAbort`. Each test's
//! waits are bounded (a collective gives up after [`STUCK`]), so a broken
//! side channel fails an assertion instead of hanging CI.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use offload_dist::{
    Abort, DistEnv, DistError, Joined, PeerFailure, RendezvousConfig, Secret, SideChannel,
    rendezvous,
};

/// The target: every other rank has its typed error within this.
const WITHIN: Duration = Duration::from_secs(10);
/// How long a loopback collective waits before it gives up on its own
/// (the stand-in for NCCL's watchdog timeout, and the tests' bound).
const STUCK: Duration = Duration::from_secs(15);

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

fn config() -> RendezvousConfig {
    RendezvousConfig::new(Duration::from_secs(10)).with_secret(Some(
        Secret::new(b"side-channel-test-secret".to_vec()).unwrap(),
    ))
}

/// The loopback transport: one per group, shared by its ranks' threads.
struct Loopback {
    world: u32,
    state: Mutex<LoopState>,
    changed: Condvar,
}

#[derive(Default)]
struct LoopState {
    /// Per collective number, how many ranks entered it.
    entered: std::collections::BTreeMap<u64, u32>,
    /// Per rank, why its communicator was aborted.
    aborted: std::collections::BTreeMap<u32, PeerFailure>,
}

/// How a loopback collective ended, if not completed.
#[derive(Debug)]
enum Stopped {
    Aborted(PeerFailure),
    /// Nobody released it within [`STUCK`]: the hang the side channel
    /// is there to prevent.
    Hung,
}

impl Loopback {
    fn new(world: u32) -> Arc<Self> {
        Arc::new(Self {
            world,
            state: Mutex::new(LoopState::default()),
            changed: Condvar::new(),
        })
    }

    /// Rank `rank`'s all-gather number `n`: returns once every rank has
    /// entered it, or this rank's communicator is aborted.
    fn all_gather(&self, rank: u32, n: u64) -> Result<(), Stopped> {
        let give_up = Instant::now() + STUCK;
        let mut st = self.state.lock().unwrap();
        *st.entered.entry(n).or_default() += 1;
        self.changed.notify_all();
        loop {
            if let Some(f) = st.aborted.get(&rank) {
                return Err(Stopped::Aborted(f.clone()));
            }
            if st.entered[&n] >= self.world {
                return Ok(());
            }
            let now = Instant::now();
            if now >= give_up {
                return Err(Stopped::Hung);
            }
            st = self.changed.wait_timeout(st, give_up - now).unwrap().0;
        }
    }

    /// Blocks until `count` ranks have entered collective `n`.
    fn wait_entered(&self, n: u64, count: u32) {
        let give_up = Instant::now() + STUCK;
        let mut st = self.state.lock().unwrap();
        while st.entered.get(&n).copied().unwrap_or(0) < count && Instant::now() < give_up {
            st = self
                .changed
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap()
                .0;
        }
    }
}

/// Rank `rank`'s abort hook: `ncclCommAbort` for the loopback transport.
struct LoopbackAbort {
    group: Arc<Loopback>,
    rank: u32,
}

impl Abort for LoopbackAbort {
    fn abort(&self, failure: &PeerFailure) {
        let mut st = self.group.state.lock().unwrap();
        st.aborted
            .entry(self.rank)
            .or_insert_with(|| failure.clone());
        self.group.changed.notify_all();
    }
}

/// Where the failing rank fails.
#[derive(Clone, Copy, Debug)]
enum When {
    /// Before its first collective (the others are inside it).
    Before,
    /// Inside its second collective: its call is refused locally once the
    /// others are blocked in it.
    Inside,
    /// After its second collective, while the others compute and then
    /// issue the third.
    After,
    /// Like `Inside`, but it reports nothing: its error is returned and
    /// its group dropped (what `?` does).
    Dropped,
}

/// What a surviving rank ended with, and when.
struct Survivor {
    rank: u32,
    error: DistError,
    at: Instant,
}

/// A group of `world` ranks in threads, with real TCP on 127.0.0.1; rank
/// `failing` fails `when`; the others run three collectives. Returns the
/// moment it failed and each survivor's outcome.
fn scenario(world: u32, failing: u32, when: When) -> (Instant, Vec<Survivor>) {
    let port = free_port();
    let group = Loopback::new(world);
    let failed_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let group = Arc::clone(&group);
            let failed_at = Arc::clone(&failed_at);
            thread::spawn(move || {
                let payload = (rank == 0).then_some(&b"id"[..]);
                let Joined { channel, .. } =
                    rendezvous(&env(rank, world, port), payload, &config())
                        .expect("the group forms");
                channel.on_failure(Arc::new(LoopbackAbort {
                    group: Arc::clone(&group),
                    rank,
                }));
                if rank == failing {
                    fail(&group, channel, rank, when, &failed_at);
                    return None;
                }
                Some(survive(&group, &channel, rank))
            })
        })
        .collect();
    let survivors: Vec<Survivor> = threads
        .into_iter()
        .filter_map(|t| t.join().unwrap())
        .collect();
    let failed_at = failed_at.lock().unwrap().expect("the failing rank failed");
    (failed_at, survivors)
}

fn fail(
    group: &Loopback,
    channel: SideChannel,
    rank: u32,
    when: When,
    at: &Mutex<Option<Instant>>,
) {
    let others = group.world - 1;
    let mark = || *at.lock().unwrap() = Some(Instant::now());
    match when {
        When::Before => {
            group.wait_entered(1, others);
            mark();
            channel.report(&format!(
                "planted failure of rank {rank} before collective #1"
            ));
        }
        When::Inside | When::Dropped => {
            group.all_gather(rank, 1).unwrap();
            group.wait_entered(2, others);
            mark();
            if matches!(when, When::Inside) {
                channel.report(&format!(
                    "planted failure of rank {rank}: all_gather #2 refused locally"
                ));
            }
        }
        When::After => {
            group.all_gather(rank, 1).unwrap();
            group.all_gather(rank, 2).unwrap();
            mark();
            channel.report(&format!(
                "planted failure of rank {rank} after collective #2"
            ));
        }
    }
    // The process would exit now (closing its connection); a thread
    // keeps its channel a little, so the report alone must do.
    thread::sleep(Duration::from_millis(200));
    drop(channel);
}

/// A surviving rank: three collectives with compute between them; the
/// first that stops gives this rank's typed error.
fn survive(group: &Loopback, channel: &SideChannel, rank: u32) -> Survivor {
    for n in 1..=3 {
        thread::sleep(Duration::from_millis(50)); // compute
        if let Err(stopped) = group.all_gather(rank, n) {
            let error = match stopped {
                Stopped::Aborted(f) => channel.error(f),
                Stopped::Hung => DistError::Usage {
                    what: format!("rank {rank}: collective #{n} hung for {STUCK:?}"),
                    allowed: "a typed error naming the failed rank within 10 s".to_owned(),
                },
            };
            return Survivor {
                rank,
                error,
                at: Instant::now(),
            };
        }
    }
    panic!("rank {rank}: every collective completed although a rank failed");
}

/// Every survivor's error names `failing` (and `said`, its error, when
/// it reported one) within [`WITHIN`]; returns the slowest time.
fn check(
    failing: u32,
    said: Option<&str>,
    (failed_at, survivors): (Instant, Vec<Survivor>),
) -> Duration {
    let mut slowest = Duration::ZERO;
    for s in &survivors {
        let took = s.at.saturating_duration_since(failed_at);
        slowest = slowest.max(took);
        let text = s.error.to_string();
        match &s.error {
            DistError::PeerFailed {
                this_rank, failure, ..
            } => {
                assert_eq!(*this_rank, s.rank);
                assert_eq!(failure.rank(), failing, "rank {}: {text}", s.rank);
                if let Some(said) = said {
                    assert!(
                        matches!(failure, PeerFailure::Failed { error, .. } if error.contains(said)),
                        "rank {}: the failed rank's own error is lost: {text}",
                        s.rank
                    );
                }
            }
            other => panic!("rank {}: not a typed peer failure: {other}", s.rank),
        }
        assert!(text.contains(&format!("rank {failing} ")), "{text}");
        assert!(
            took < WITHIN,
            "rank {}: {took:?} to its error: {text}",
            s.rank
        );
    }
    println!("slowest survivor: {slowest:?} after rank {failing} failed");
    slowest
}

#[test]
fn a_rank_failing_before_a_collective_is_named_at_once() {
    check(
        2,
        Some("before collective #1"),
        scenario(3, 2, When::Before),
    );
}

#[test]
fn a_rank_failing_inside_a_collective_is_named_at_once() {
    check(
        1,
        Some("all_gather #2 refused locally"),
        scenario(3, 1, When::Inside),
    );
}

#[test]
fn a_rank_failing_after_a_collective_is_named_at_once() {
    check(2, Some("after collective #2"), scenario(3, 2, When::After));
}

#[test]
fn rank_0_failing_inside_a_collective_is_named_at_once() {
    check(
        0,
        Some("all_gather #2 refused locally"),
        scenario(3, 0, When::Inside),
    );
}

#[test]
fn a_rank_that_drops_its_group_without_a_word_is_named() {
    check(2, Some("dropped its group"), scenario(3, 2, When::Dropped));
}

#[test]
fn a_finished_rank_is_no_failure() {
    let port = free_port();
    let ranks: Vec<_> = (0..3u32)
        .map(|rank| {
            thread::spawn(move || {
                let payload = (rank == 0).then_some(&b"id"[..]);
                rendezvous(&env(rank, 3, port), payload, &config())
                    .unwrap()
                    .channel
            })
        })
        .collect();
    let mut channels: Vec<SideChannel> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    let last = channels.pop().unwrap();
    let first = channels.remove(0);
    channels.pop().unwrap().finish();
    assert_eq!(first.wait_for_failure(Duration::from_millis(1500)), None);
    assert!(first.check().is_ok() && last.check().is_ok());
    last.finish();
    first.finish();
}

#[test]
fn a_hook_registered_after_the_failure_runs_at_once() {
    let port = free_port();
    let ranks: Vec<_> = (0..2u32)
        .map(|rank| {
            thread::spawn(move || {
                let payload = (rank == 0).then_some(&b"id"[..]);
                rendezvous(&env(rank, 2, port), payload, &config())
                    .unwrap()
                    .channel
            })
        })
        .collect();
    let mut channels: Vec<SideChannel> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    let rank1 = channels.pop().unwrap();
    let rank0 = channels.pop().unwrap();
    rank1.report(&"boom");
    let f = rank0.wait_for_failure(WITHIN).expect("rank 0 hears of it");
    assert_eq!(
        f,
        PeerFailure::Failed {
            rank: 1,
            error: "boom".to_owned()
        }
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = Mutex::new(tx);
    rank0.on_failure(Arc::new(move |f: &PeerFailure| {
        let _ = tx.lock().unwrap().send(f.rank());
    }));
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(1));
    rank1.finish();
    rank0.finish();
}

// ------------------------------------------------ killed rank processes

const CHILD: &str = "OFFLOAD_DIST_TEST_CHILD";

/// Not a test by itself: the body of one rank process of
/// [`a_killed_rank_is_named_by_every_other_process`] (the test binary
/// runs itself with `OFFLOAD_DIST_TEST_CHILD=1` and the torchrun
/// variables).
#[test]
fn child_rank_process() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let env = DistEnv::from_env().unwrap();
    let secret = Secret::from_env().unwrap();
    let has_secret = secret.is_some();
    let config = RendezvousConfig::new(Duration::from_secs(10)).with_secret(secret);
    let payload = (env.rank == 0).then_some(&b"id"[..]);
    let joined = rendezvous(&env, payload, &config).unwrap();
    if std::env::var(CHILD).as_deref() == Ok("form") {
        println!(
            "CHILD formed {} secret={has_secret} payload={:?}",
            env.rank, joined.payload
        );
        joined.channel.finish();
        std::process::exit(0);
    }
    let group = Loopback::new(2); // this rank and a peer that never comes
    joined.channel.on_failure(Arc::new(LoopbackAbort {
        group: Arc::clone(&group),
        rank: env.rank,
    }));
    println!("CHILD joined {}", env.rank);
    // Blocked in a collective that the killed rank never enters.
    let outcome = group.all_gather(env.rank, 1);
    match outcome {
        Err(Stopped::Aborted(f)) => println!("CHILD error {}", joined.channel.error(f)),
        other => println!("CHILD no-error {other:?}"),
    }
    joined.channel.finish();
    std::process::exit(0);
}

struct Rank {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

fn spawn_ranks(world: u32) -> Vec<Rank> {
    let port = free_port();
    let secret = Secret::generate().unwrap();
    (0..world)
        .map(|rank| {
            let mut child = Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "child_rank_process",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD, "1")
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OFFLOAD_DIST_SECRET", secret.to_env_value())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let out = BufReader::new(child.stdout.take().unwrap());
            let (tx, lines) = std::sync::mpsc::channel();
            thread::spawn(move || {
                for line in out.lines().map_while(Result::ok) {
                    // libtest may print "test … " before it on the line.
                    if let Some(at) = line.find("CHILD ") {
                        let _ = tx.send(line[at + 6..].to_owned());
                    }
                }
            });
            Rank { child, lines }
        })
        .collect()
}

/// Kills `victim` once every rank has joined; every other process must
/// print an error naming it within [`WITHIN`] of the kill.
fn kill_and_check(world: u32, victim: u32) -> Duration {
    let mut ranks = spawn_ranks(world);
    for (rank, r) in ranks.iter().enumerate() {
        let line = r.lines.recv_timeout(Duration::from_secs(20));
        assert_eq!(line.as_deref(), Ok(format!("joined {rank}").as_str()));
    }
    ranks[victim as usize].child.kill().unwrap();
    let killed = Instant::now();
    let mut slowest = Duration::ZERO;
    for (rank, r) in ranks.iter_mut().enumerate() {
        if rank as u32 == victim {
            let _ = r.child.wait();
            continue;
        }
        let line = r.lines.recv_timeout(WITHIN + Duration::from_secs(5));
        let took = killed.elapsed();
        if line.is_err() {
            let _ = r.child.kill();
        }
        let line = line.unwrap_or_else(|_| {
            panic!(
                "rank {rank}: no error within {:?}",
                WITHIN + Duration::from_secs(5)
            )
        });
        assert!(
            line.starts_with("error ")
                && line.contains(&format!("rank {victim} died without a word")),
            "rank {rank}: {line}"
        );
        assert!(took < WITHIN, "rank {rank}: {took:?} to its error");
        slowest = slowest.max(took);
    }
    // The survivors exit by themselves (a survivor killed early could
    // close its connection before it relayed what it knows).
    let give_up = Instant::now() + Duration::from_secs(5);
    for r in &mut ranks {
        while matches!(r.child.try_wait(), Ok(None)) && Instant::now() < give_up {
            thread::sleep(Duration::from_millis(10));
        }
        let _ = r.child.kill();
        let _ = r.child.wait();
    }
    println!("slowest survivor: {slowest:?} after rank {victim} was killed");
    slowest
}

#[test]
fn a_killed_rank_is_named_by_every_other_process() {
    kill_and_check(3, 2);
}

#[test]
fn a_killed_rank_0_is_named_by_every_other_process() {
    kill_and_check(3, 0);
}

#[test]
fn the_launchers_secret_lets_its_ranks_in() {
    let out = Command::new(env!("CARGO_BIN_EXE_offload-launch"))
        .args(["-n", "3", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_rank_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "form")
        .env_remove("OFFLOAD_DIST_SECRET")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut formed: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.find("CHILD formed ").map(|at| &l[at + 13..]))
        .collect();
    formed.sort();
    let expect: Vec<String> = (0..3)
        .map(|r| format!("{r} secret=true payload=[105, 100]"))
        .collect();
    assert_eq!(formed, expect, "{stdout}");
}

/// Collects what a tracing subscriber writes.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn an_open_rendezvous_warns_once() {
    // The only open rendezvous of this test binary (the warning is once
    // per process).
    let logs = Logs::default();
    let writer = logs.clone();
    let dispatch = tracing::Dispatch::new(
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish(),
    );
    for _ in 0..2 {
        let port = free_port();
        let ranks: Vec<_> = (0..2u32)
            .map(|rank| {
                let dispatch = dispatch.clone();
                thread::spawn(move || {
                    tracing::dispatcher::with_default(&dispatch, || {
                        let payload = (rank == 0).then_some(&b"id"[..]);
                        let open = RendezvousConfig::new(Duration::from_secs(5));
                        rendezvous(&env(rank, 2, port), payload, &open)
                            .unwrap()
                            .channel
                            .finish();
                    })
                })
            })
            .collect();
        for r in ranks {
            r.join().unwrap();
        }
    }
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert_eq!(text.matches("so it is open").count(), 1, "{text}");
    assert!(text.contains("OFFLOAD_DIST_SECRET"), "{text}");
}

/// Forwards one connection to `upstream` until `frozen` is set, then
/// swallows everything both ways while keeping both sockets open: a host
/// that vanished without closing anything.
fn freezing_proxy(upstream: u16, frozen: Arc<std::sync::atomic::AtomicBool>) -> u16 {
    use std::io::{Read, Write};
    use std::sync::atomic::Ordering;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        // Rank 0 may not listen yet.
        let give_up = Instant::now() + Duration::from_secs(5);
        let server = loop {
            match std::net::TcpStream::connect(("127.0.0.1", upstream)) {
                Ok(s) => break s,
                Err(e) if Instant::now() < give_up => {
                    let _ = e;
                    thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("rank 0 never listened: {e}"),
            }
        };
        for (mut from, mut to) in [
            (client.try_clone().unwrap(), server.try_clone().unwrap()),
            (server, client),
        ] {
            let frozen = Arc::clone(&frozen);
            thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if !frozen.load(Ordering::Relaxed) && to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}

#[test]
fn a_silent_rank_is_named_as_dead() {
    let port = free_port();
    let frozen = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let via = freezing_proxy(port, Arc::clone(&frozen));
    let silence = Duration::from_millis(800);
    let ranks: Vec<_> = [(0u32, port), (1, via)]
        .into_iter()
        .map(|(rank, port)| {
            thread::spawn(move || {
                let payload = (rank == 0).then_some(&b"id"[..]);
                let config = RendezvousConfig {
                    silence,
                    ..config()
                };
                rendezvous(&env(rank, 2, port), payload, &config)
                    .unwrap()
                    .channel
            })
        })
        .collect();
    let channels: Vec<SideChannel> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    // Pings keep a quiet but live group alive past the silence limit.
    assert_eq!(channels[0].wait_for_failure(silence * 2), None);
    frozen.store(true, std::sync::atomic::Ordering::Relaxed);
    let frozen_at = Instant::now();
    for (rank, c) in channels.iter().enumerate() {
        let other = 1 - rank as u32;
        let f = c.wait_for_failure(WITHIN).expect("the silence is noticed");
        assert!(
            matches!(&f, PeerFailure::Vanished { rank, detail } if *rank == other && detail.contains("silent")),
            "rank {rank}: {f}"
        );
    }
    let took = frozen_at.elapsed();
    assert!(took < silence * 3, "{took:?}");
    println!("both ranks named the silent other {took:?} after the link froze");
    for c in channels {
        c.finish();
    }
}

// ------------------------------------------------------ on the simulator

/// The simulated gather group (offload-sim) with a real side channel per
/// rank: rank 2 fails before collective #1 but its handle stays alive
/// (as a rank in another process would: it neither enters nor leaves),
/// so without the side channel the others would wait for the group's
/// last-resort hang limit (30 s here); with it, their hooks abort the
/// group and every gather returns a typed error naming rank 2.
#[test]
fn on_the_simulator_a_failed_rank_aborts_the_gathers_of_the_others() {
    use offload_core::device::{Collective, Device};
    use offload_sim::{DeviceProfile, SimConfig, SimDevice, SimGroup};

    let world = 3u32;
    let devices: Vec<SimDevice> = (0..world)
        .map(|_| {
            SimDevice::new(SimConfig::sampled(
                DeviceProfile::h200().for_ranks(world),
                1,
            ))
            .unwrap()
        })
        .collect();
    let ranks = SimGroup::new(&devices)
        .wait_limit(Duration::from_secs(30))
        .ranks()
        .unwrap();
    let port = free_port();
    let failed_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let threads: Vec<_> = ranks
        .into_iter()
        .enumerate()
        .map(|(rank, col)| {
            let failed_at = Arc::clone(&failed_at);
            let device = devices[rank].clone();
            thread::spawn(move || {
                let rank = rank as u32;
                let payload = (rank == 0).then_some(&b"id"[..]);
                let channel = rendezvous(&env(rank, world, port), payload, &config())
                    .unwrap()
                    .channel;
                let hook = col.clone();
                channel.on_failure(Arc::new(move |f: &PeerFailure| hook.abort(&f.to_string())));
                let stream = device.create_stream().unwrap();
                let shard = device.alloc_device(64).unwrap();
                let dst = device.alloc_device(64 * u64::from(world)).unwrap();
                if rank == 2 {
                    thread::sleep(Duration::from_millis(200));
                    *failed_at.lock().unwrap() = Some(Instant::now());
                    channel.report(&"planted failure before collective #1");
                    thread::sleep(Duration::from_millis(300));
                    channel.finish();
                    return (rank, None, col);
                }
                // SAFETY: both ranges lie within their buffers, which
                // outlive the gather (the stream is synchronised below).
                let gathered = unsafe { col.all_gather(&stream, &shard, 0, 64, &dst, 0) };
                let at = Instant::now();
                let _ = device.synchronize_stream(&stream);
                // Another rank's abort may fail the gather before this rank's own
                // channel has the relayed failure: ask it, waiting a little.
                let why = |_| channel.wait_for_failure(WITHIN).map(|f| channel.error(f));
                let error = gathered.err().map(|e| (e.to_string(), why(()), at));
                channel.finish();
                (rank, error, col)
            })
        })
        .collect();
    let outcomes: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let failed_at = failed_at.lock().unwrap().expect("rank 2 failed");
    for (rank, error, _col) in &outcomes {
        if *rank == 2 {
            continue;
        }
        let (sim, check, at) = error.as_ref().expect("the gather failed");
        let took = at.saturating_duration_since(failed_at);
        assert!(
            sim.contains("rank 2 failed: planted failure"),
            "rank {rank}: {sim}"
        );
        let e = check.as_ref().expect("the channel names the failure");
        assert!(
            matches!(e, DistError::PeerFailed { failure, .. } if failure.rank() == 2),
            "rank {rank}: {e}"
        );
        assert!(took < WITHIN, "rank {rank}: {took:?}");
        println!("rank {rank}: the simulated gather failed {took:?} after rank 2 did: {sim}");
    }
}
