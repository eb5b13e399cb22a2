//! Simulated collectives: a gather group of G simulated devices, each used
//! from its own host thread, sharing one simulated all-gather.
//!
//! `SimGroup::new(&devices).ranks()` takes the G devices and gives back
//! one [`SimCollective`] per rank (move each to its rank's thread: a rank's
//! host thread blocks in each all-gather until every rank has entered it);
//! [`SimCollective::single`] is a group of one.
//!
//! # One all-gather, on rank r, collective number n
//!
//! * **Checks first.** Ranges, buffers of another device, payload-divisor
//!   alignment: a typed [`SimError`], nothing enqueued on the device. In a
//!   group of more than one this fails collective n for the group, as an
//!   injected fault does (below).
//! * **Rendezvous.** The rank enters n with its signature (kind and shard
//!   bytes) and its earliest start on its stream (stream tail, host time,
//!   jitter, as the device computes any start), then its host thread blocks
//!   until every rank has entered n. No device lock is held while it waits;
//!   simulated host time does not advance (the host enqueues a collective
//!   and goes on, as with NCCL; only the simulation waits).
//! * **Time.** n ends at `max over ranks of start + link time`
//!   ([`DeviceProfile::all_gather_ns`](crate::DeviceProfile::all_gather_ns),
//!   the largest any rank's profile gives). On every rank the gather
//!   occupies its stream and the device's collective engine from its own
//!   start to that end: a rank that enters late delays the others' streams.
//! * **Data.** Rank q contributes its shard bytes as they are at q's start
//!   (q's pending effects due by then, applied to a scratch copy); the
//!   assembled `G × shard_bytes` bytes land in each rank's destination
//!   range at the end, as a data effect of that rank's device.
//! * **Order (INV-3).** On each rank the gather is one operation of the
//!   calling stream that reads the shard range and writes the destination
//!   range, checked by that device's happens-before checker as copies are.
//! * **Agreement (INV-9).** Every rank must issue the same collectives in
//!   the same order with the same sizes: a disagreement at n is a violation
//!   recorded on every rank's device (naming n and each rank's signature),
//!   and every rank gets a typed error instead of hanging. And a gather may
//!   read only shard bytes that host→device copies wrote since that range
//!   was last gathered (the device checks it at the gather: a gather of the
//!   whole slot instead of the block is seen there).
//! * **Failure is never a hang.** A rank's failed collective n (an injected
//!   [`FaultPlan::fail_collective_at`](crate::FaultPlan), a refused call)
//!   gives that rank its own error and every other rank waiting on, or later
//!   entering, n an error naming the rank and n. A rank whose last handle is
//!   dropped, or that calls [`SimCollective::depart`], has left: every rank
//!   waiting on a collective it never entered gets an error naming it. After
//!   any failure the group is broken, as an aborted NCCL communicator is:
//!   every later collective on every rank fails at once
//!   ([`SimCollective::abort`] breaks it from any thread, as
//!   `ncclCommAbort` does: offload-dist's side channel calls it when
//!   another rank fails). Errors are of kind
//!   [`DeviceErrorKind::TransferFailed`] unless the failing rank's own error
//!   says otherwise. A group of one never breaks (it has no peer to lose
//!   track of): a failed gather fails alone, as it always did.
//! * **Last resort.** A rank that waits longer than the group's wait limit
//!   ([`DEFAULT_WAIT_LIMIT`], or [`SimGroup::wait_limit`]) for ranks
//!   that neither enter nor leave gets a typed error, an INV-9 "hang"
//!   violation goes to every device, and the group breaks. This is the only
//!   place the simulator reads the wall clock, and only while a rank
//!   actually waits; a correct run never reaches the limit.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use offload_core::device::{Collective, DeviceErrorKind};
use offload_core::invariants::Invariant;
use serde::Serialize;

use crate::device::{
    GatherCall, GatherEntry, Sim, SimDevice, SimDeviceBuffer, SimError, SimStream,
};

/// How long a rank waits (wall clock) for ranks that neither enter a
/// collective nor leave the group before the wait is called a hang.
pub const DEFAULT_WAIT_LIMIT: Duration = Duration::from_secs(60);

/// One completed collective of one rank, for reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GatherRecord {
    /// Its number on this rank (1-based, counting every call).
    pub n: u64,
    /// Bytes each rank contributed.
    pub shard_bytes: u64,
    /// When this rank's stream could start it, ns of simulated time.
    pub start_ns: u64,
    /// When it completed on every rank, ns.
    pub end_ns: u64,
    /// The link's share of `end_ns − start_ns` (the rest is waiting for
    /// later ranks), ns.
    pub link_ns: u64,
}

/// A gather group to build: `SimGroup::new(&devices).ranks()` gives one
/// [`SimCollective`] per device (rank r on `devices[r]`).
#[derive(Clone, Debug)]
pub struct SimGroup {
    devices: Vec<SimDevice>,
    wait_limit: Duration,
}

impl SimGroup {
    /// A group of `devices.len()` ranks, rank r on `devices[r]`, with the
    /// default wait limit ([`DEFAULT_WAIT_LIMIT`]).
    pub fn new(devices: &[SimDevice]) -> Self {
        Self {
            devices: devices.to_vec(),
            wait_limit: DEFAULT_WAIT_LIMIT,
        }
    }

    /// The last-resort hang limit: how long (wall clock) a rank waits for
    /// ranks that neither enter a collective nor leave the group.
    pub fn wait_limit(mut self, limit: Duration) -> Self {
        self.wait_limit = limit;
        self
    }

    /// The ranks, in order; move each to its own host thread. Errors: no
    /// device, the same device twice, devices with different payload
    /// divisors, more than `u32::MAX` ranks.
    pub fn ranks(self) -> Result<Vec<SimCollective>, SimError> {
        let devices = &self.devices;
        let refuse = |detail: String| SimError {
            operation: "SimGroup::ranks".to_owned(),
            kind: DeviceErrorKind::Other,
            detail,
            shortfall_bytes: None,
        };
        let size = u32::try_from(devices.len()).map_err(|_| refuse("too many ranks".to_owned()))?;
        if size == 0 {
            return Err(refuse("a group needs at least one device".to_owned()));
        }
        for (i, a) in devices.iter().enumerate() {
            if let Some(j) = devices[..i].iter().position(|b| a.is(b)) {
                return Err(refuse(format!("ranks {j} and {i} are the same device")));
            }
        }
        let divisors: Vec<u64> = devices.iter().map(SimDevice::payload_divisor).collect();
        if divisors.iter().any(|d| *d != divisors[0]) {
            return Err(refuse(format!(
                "the ranks' payload divisors differ: {divisors:?}"
            )));
        }
        Ok(Group::start(devices, self.wait_limit))
    }
}

/// One rank of a simulated gather group: its [`Collective`]. Clones share
/// the rank; the rank leaves the group when its last clone is dropped (or
/// at [`Self::depart`]).
#[derive(Clone)]
pub struct SimCollective {
    rank: Arc<Rank>,
}

impl fmt::Debug for SimCollective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimCollective")
            .field("rank", &self.rank.index)
            .field("size", &self.rank.group.size)
            .finish()
    }
}

impl SimCollective {
    /// A group of one on `device`: the gather is a device-local copy.
    pub fn single(device: &SimDevice) -> Self {
        let mut ranks = Group::start(std::slice::from_ref(device), DEFAULT_WAIT_LIMIT);
        ranks.remove(0)
    }

    /// This rank's device.
    pub fn device(&self) -> &SimDevice {
        &self.rank.device
    }

    /// This rank leaves the group: every rank waiting on, or later issuing,
    /// a collective this rank has not entered gets a typed error naming it,
    /// and so does this rank's own next call. Idempotent; dropping the last
    /// clone does the same.
    pub fn depart(&self) {
        self.rank.group.depart(self.rank.index);
    }

    /// Aborts the group from this rank, as `ncclCommAbort` does (for
    /// offload-dist's side channel, from any thread): every open
    /// collective, this rank's own blocked one included, fails with `why`,
    /// and the group is broken. Idempotent.
    pub fn abort(&self, why: &str) {
        let group = &self.rank.group;
        let mut st = lock(&group.state);
        let why = format!("rank {} aborted the group: {why}", self.rank.index);
        let open: Vec<u64> = st.rounds.keys().copied().collect();
        let n = open
            .first()
            .copied()
            .unwrap_or(st.ranks[self.rank.index as usize].issued);
        for m in open {
            group.fail(&mut st, m, why.clone());
        }
        group.fail(&mut st, n, why);
    }

    /// The collectives this rank completed, in order.
    pub fn log(&self) -> Vec<GatherRecord> {
        lock(&self.rank.log).clone()
    }
}

impl Collective<Sim> for SimCollective {
    fn rank(&self) -> u32 {
        self.rank.index
    }

    fn size(&self) -> u32 {
        self.rank.group.size
    }

    unsafe fn all_gather(
        &self,
        stream: &SimStream,
        shard: &SimDeviceBuffer,
        shard_offset: u64,
        shard_bytes: u64,
        dst: &SimDeviceBuffer,
        dst_offset: u64,
    ) -> Result<(), SimError> {
        let (group, r) = (&self.rank.group, self.rank.index);
        // As NCCL's (offload-dist): one debug span per collective, inside
        // the strategy's `offload.transfer` span naming the block.
        let _span = tracing::debug_span!(
            "offload.collective",
            op = "all-gather",
            bytes = shard_bytes * u64::from(group.size),
            shard_bytes,
            rank = r,
            ranks = group.size,
            stream = stream.id(),
        )
        .entered();
        let n = group.issue(r)?;
        let call = GatherCall {
            stream,
            shard,
            shard_offset,
            shard_bytes,
            dst,
            dst_offset,
            ranks: group.size,
            n,
        };
        let entered = self.rank.device.gather_enter(&call);
        let start_ns = entered.as_ref().map_or(0, |e| e.start_ns);
        let (end_ns, link_ns, data) = group.rendezvous(r, n, shard_bytes, entered)?;
        self.rank
            .device
            .gather_land(&call, start_ns, end_ns, data.to_vec());
        lock(&self.rank.log).push(GatherRecord {
            n,
            shard_bytes,
            start_ns,
            end_ns,
            link_ns,
        });
        Ok(())
    }
}

struct Rank {
    group: Arc<Group>,
    index: u32,
    device: SimDevice,
    log: Mutex<Vec<GatherRecord>>,
}

impl Drop for Rank {
    fn drop(&mut self) {
        self.group.depart(self.index);
    }
}

/// What the ranks share.
struct Group {
    size: u32,
    /// Every rank's device, to record group-level violations on all of them.
    devices: Vec<SimDevice>,
    wait_limit: Duration,
    state: Mutex<GroupState>,
    changed: Condvar,
}

struct GroupState {
    ranks: Vec<RankState>,
    /// Collectives some rank entered whose outcome not every entrant has
    /// collected yet.
    rounds: BTreeMap<u64, Round>,
    /// The first failure: (collective, why). Every later collective fails.
    broken: Option<(u64, String)>,
}

#[derive(Default)]
struct RankState {
    /// Collectives issued so far (the last one's number).
    issued: u64,
    left: bool,
}

/// One collective, across the ranks.
struct Round {
    entries: Vec<Option<Entered>>,
    outcome: Option<Outcome>,
    collected: Vec<bool>,
}

struct Entered {
    /// The signature: the only kind is an all-gather, so its size.
    shard_bytes: u64,
    start_ns: u64,
    link_ns: u64,
    contribution: Vec<u8>,
}

#[derive(Clone)]
enum Outcome {
    Done {
        end_ns: u64,
        link_ns: u64,
        data: Arc<Vec<u8>>,
    },
    Failed(String),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn signature(entry: Option<&Entered>) -> String {
    match entry {
        Some(e) => format!("all_gather of {} bytes", e.shard_bytes),
        None => "not entered yet".to_owned(),
    }
}

impl Group {
    fn start(devices: &[SimDevice], wait_limit: Duration) -> Vec<SimCollective> {
        let size = devices.len() as u32;
        let group = Arc::new(Group {
            size,
            devices: devices.to_vec(),
            wait_limit,
            state: Mutex::new(GroupState {
                ranks: devices.iter().map(|_| RankState::default()).collect(),
                rounds: BTreeMap::new(),
                broken: None,
            }),
            changed: Condvar::new(),
        });
        devices
            .iter()
            .enumerate()
            .map(|(i, device)| SimCollective {
                rank: Arc::new(Rank {
                    group: Arc::clone(&group),
                    index: i as u32,
                    device: device.clone(),
                    log: Mutex::new(Vec::new()),
                }),
            })
            .collect()
    }

    fn error(r: u32, n: u64, detail: String) -> SimError {
        SimError {
            operation: format!("all_gather #{n} on rank {r}"),
            kind: DeviceErrorKind::TransferFailed,
            detail,
            shortfall_bytes: None,
        }
    }

    /// Numbers rank `r`'s next collective; fails at once if the rank left
    /// or the group is broken.
    fn issue(&self, r: u32) -> Result<u64, SimError> {
        let mut st = lock(&self.state);
        let rank = &mut st.ranks[r as usize];
        rank.issued += 1;
        let n = rank.issued;
        if rank.left {
            return Err(Self::error(r, n, format!("rank {r} has left the group")));
        }
        if let Some((m, why)) = &st.broken {
            return Err(Self::error(
                r,
                n,
                format!("the group is broken since collective #{m}: {why}"),
            ));
        }
        Ok(n)
    }

    /// Fails collective `n` (if it is still open) and breaks the group.
    fn fail(&self, st: &mut GroupState, n: u64, why: String) {
        if let Some(round) = st.rounds.get_mut(&n)
            && round.outcome.is_none()
        {
            round.outcome = Some(Outcome::Failed(why.clone()));
        }
        if st.broken.is_none() {
            st.broken = Some((n, why));
        }
        self.changed.notify_all();
    }

    /// Rank `r` leaves: every open collective it never entered fails.
    fn depart(&self, r: u32) {
        let mut st = lock(&self.state);
        if std::mem::replace(&mut st.ranks[r as usize].left, true) {
            return;
        }
        let abandoned: Vec<u64> = st
            .rounds
            .iter()
            .filter(|(_, round)| round.outcome.is_none() && round.entries[r as usize].is_none())
            .map(|(n, _)| *n)
            .collect();
        for n in abandoned {
            self.fail(
                &mut st,
                n,
                format!("rank {r} left the group before collective #{n}"),
            );
        }
    }

    /// Records an INV-9 violation on every rank's device, then fails
    /// collective `n` with it. The violation is on every device before any
    /// rank can see the failure (device locks are taken under the group
    /// lock, never the reverse).
    fn fail_with_violation(&self, st: &mut GroupState, n: u64, why: String) {
        for device in &self.devices {
            device.report(Invariant::CollectiveAgreement, why.clone());
        }
        self.fail(st, n, why);
    }

    /// Decides collective `n` if it can be decided now.
    fn evaluate(&self, st: &mut GroupState, n: u64) {
        let Some(round) = st.rounds.get(&n) else {
            return;
        };
        if round.outcome.is_some() {
            return;
        }
        if let Some((m, why)) = &st.broken {
            let why = format!("the group is broken since collective #{m}: {why}");
            self.fail(st, n, why);
            return;
        }
        let entered: Vec<&Entered> = round.entries.iter().flatten().collect();
        if entered
            .iter()
            .any(|e| e.shard_bytes != entered[0].shard_bytes)
        {
            let each: Vec<String> = round
                .entries
                .iter()
                .enumerate()
                .map(|(q, e)| format!("rank {q} {}", signature(e.as_ref())))
                .collect();
            let why = format!(
                "collective #{n}: the ranks disagree ({}): every rank must issue the same collectives in the same order with the same sizes (CONTRACT §8)",
                each.join(", ")
            );
            self.fail_with_violation(st, n, why);
            return;
        }
        if let Some(q) =
            (0..self.size as usize).find(|&q| st.ranks[q].left && round.entries[q].is_none())
        {
            self.fail(
                st,
                n,
                format!("rank {q} left the group before collective #{n}"),
            );
            return;
        }
        if entered.len() < self.size as usize {
            return;
        }
        let start = entered.iter().map(|e| e.start_ns).max().unwrap_or(0);
        let link_ns = entered.iter().map(|e| e.link_ns).max().unwrap_or(0);
        let outcome = match start.checked_add(link_ns) {
            Some(end_ns) => Outcome::Done {
                end_ns,
                link_ns,
                data: Arc::new(
                    entered
                        .iter()
                        .flat_map(|e| e.contribution.iter().copied())
                        .collect(),
                ),
            },
            None => Outcome::Failed(format!(
                "collective #{n} overflows the simulated clock (the workload is too large to simulate)"
            )),
        };
        if let Some(round) = st.rounds.get_mut(&n) {
            round.outcome = Some(outcome);
        }
        self.changed.notify_all();
    }

    /// Rank `r` enters collective `n` (or reports that it failed inside it)
    /// and waits until every rank has entered; returns (end, link time, the
    /// assembled bytes) or this rank's typed error.
    fn rendezvous(
        &self,
        r: u32,
        n: u64,
        shard_bytes: u64,
        entered: Result<GatherEntry, SimError>,
    ) -> Result<(u64, u64, Arc<Vec<u8>>), SimError> {
        let mut st = lock(&self.state);
        let size = self.size as usize;
        let entry = match entered {
            Ok(e) => e,
            Err(e) => {
                if size > 1 {
                    let round = st.rounds.entry(n).or_insert_with(|| Round::new(size));
                    round.collected[r as usize] = true;
                    self.fail(&mut st, n, format!("rank {r} failed collective #{n}: {e}"));
                    Self::tidy(&mut st, n);
                }
                return Err(e);
            }
        };
        let round = st.rounds.entry(n).or_insert_with(|| Round::new(size));
        round.entries[r as usize] = Some(Entered {
            shard_bytes,
            start_ns: entry.start_ns,
            link_ns: entry.link_ns,
            contribution: entry.contribution,
        });
        self.evaluate(&mut st, n);
        let mut deadline: Option<Instant> = None;
        let outcome = loop {
            let Some(round) = st.rounds.get(&n) else {
                break Outcome::Failed(format!("collective #{n} vanished"));
            };
            if let Some(outcome) = &round.outcome {
                break outcome.clone();
            }
            // The wall clock, read only here: the last-resort hang limit.
            let now = Instant::now();
            let until = *deadline.get_or_insert(now + self.wait_limit);
            if now >= until {
                let missing: Vec<usize> =
                    (0..size).filter(|&q| round.entries[q].is_none()).collect();
                let why = format!(
                    "collective #{n}: a hang: rank {r} waited {:?} (wall clock) for ranks {missing:?}, which neither entered it nor left the group (a collective issued on a path only some ranks take?)",
                    self.wait_limit
                );
                self.fail_with_violation(&mut st, n, why);
                continue;
            }
            st = self
                .changed
                .wait_timeout(st, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        if let Some(round) = st.rounds.get_mut(&n) {
            round.collected[r as usize] = true;
        }
        Self::tidy(&mut st, n);
        match outcome {
            Outcome::Done {
                end_ns,
                link_ns,
                data,
            } => Ok((end_ns, link_ns, data)),
            Outcome::Failed(why) => Err(Self::error(r, n, why)),
        }
    }

    /// Forgets collective `n` once it is decided and every rank that
    /// entered it has collected its outcome.
    fn tidy(st: &mut GroupState, n: u64) {
        if let Some(round) = st.rounds.get(&n)
            && round.outcome.is_some()
            && round
                .entries
                .iter()
                .zip(&round.collected)
                .all(|(e, c)| e.is_none() || *c)
        {
            st.rounds.remove(&n);
        }
    }
}

impl Round {
    fn new(size: usize) -> Self {
        Self {
            entries: (0..size).map(|_| None).collect(),
            outcome: None,
            collected: vec![false; size],
        }
    }
}
