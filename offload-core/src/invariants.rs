//! The invariants of CONTRACT §10 as named predicates. Each has exactly one
//! checker here; the simulator, the property tests, the GPU suite and
//! `cargo xtask ci` feed them observations and report the [`Violation`]s.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Serialize;

/// The invariants of CONTRACT §10.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Invariant {
    /// INV-1: at most one strategy owns offload hooks; one owner per tensor.
    SingleOwner,
    /// INV-2: one authoritative host representation per offloaded storage.
    OneHostMaster,
    /// INV-3: no free or overwrite before every reader completed; no read
    /// before the fill completed.
    NoEarlyFree,
    /// INV-4: buffers keep values, identity, dtype, strides and aliasing.
    BuffersStayCorrect,
    /// INV-5: a failed `enable` leaves the pipeline as it was.
    FailBeforeMutate,
    /// INV-6: strategies reach the device only through the device trait.
    PlatformAbstraction,
    /// INV-7: device weight memory ≤ resident + slots; host = one copy (1/G).
    BoundedMemory,
    /// INV-8: offloaded output bit-identical to resident output.
    Equivalence,
    /// INV-9: the ranks of a gather group issue the same collectives in the
    /// same order with the same sizes (CONTRACT §8), and a gather contributes
    /// only shard bytes a copy filled since that range was last gathered (a
    /// gather narrowed to its block, not the whole slot). Not in CONTRACT
    /// §10's list: it is §8's collective-order rule, checked where every
    /// rank is seen at once (the simulator's collective group).
    CollectiveAgreement,
}

impl Invariant {
    /// Every invariant.
    pub const ALL: [Invariant; 9] = [
        Invariant::SingleOwner,
        Invariant::OneHostMaster,
        Invariant::NoEarlyFree,
        Invariant::BuffersStayCorrect,
        Invariant::FailBeforeMutate,
        Invariant::PlatformAbstraction,
        Invariant::BoundedMemory,
        Invariant::Equivalence,
        Invariant::CollectiveAgreement,
    ];

    /// `INV-n`.
    pub const fn id(self) -> &'static str {
        match self {
            Invariant::SingleOwner => "INV-1",
            Invariant::OneHostMaster => "INV-2",
            Invariant::NoEarlyFree => "INV-3",
            Invariant::BuffersStayCorrect => "INV-4",
            Invariant::FailBeforeMutate => "INV-5",
            Invariant::PlatformAbstraction => "INV-6",
            Invariant::BoundedMemory => "INV-7",
            Invariant::Equivalence => "INV-8",
            Invariant::CollectiveAgreement => "INV-9",
        }
    }
}

impl fmt::Display for Invariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?}", self.id(), self)
    }
}

/// One broken invariant, with what was observed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("{invariant} violated: {detail}")]
pub struct Violation {
    /// Which invariant.
    pub invariant: Invariant,
    /// What was observed.
    pub detail: String,
}

fn violation(invariant: Invariant, detail: impl Into<String>) -> Violation {
    Violation {
        invariant,
        detail: detail.into(),
    }
}

/// A hook as seen on the pipeline: module path, hook name, owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookClaim<'a> {
    /// Module path.
    pub module: &'a str,
    /// Hook name.
    pub hook: &'a str,
    /// Owner name.
    pub owner: &'a str,
}

/// INV-1: the hooks named like offload strategies (`offload_hook_names`)
/// belong to at most one owner across the pipeline, and each managed key
/// has one owner.
pub fn single_owner<'a>(
    hooks: impl IntoIterator<Item = HookClaim<'a>>,
    offload_hook_names: &[&str],
    managed: impl IntoIterator<Item = (String, &'a str)>,
) -> Result<(), Violation> {
    let owners: BTreeSet<&str> = hooks
        .into_iter()
        .filter(|h| offload_hook_names.contains(&h.hook))
        .map(|h| h.owner)
        .collect();
    if owners.len() > 1 {
        return Err(violation(
            Invariant::SingleOwner,
            format!("offload hooks owned by {} owners: {owners:?}", owners.len()),
        ));
    }
    let mut by_key: BTreeMap<String, BTreeSet<&str>> = BTreeMap::new();
    for (key, owner) in managed {
        by_key.entry(key).or_default().insert(owner);
    }
    match by_key.iter().find(|(_, o)| o.len() > 1) {
        Some((key, o)) => Err(violation(
            Invariant::SingleOwner,
            format!("`{key}` is managed by {o:?}"),
        )),
        None => Ok(()),
    }
}

/// INV-2: every offloaded key has exactly one host master among `masters`
/// (a key may appear in `masters` once).
pub fn one_host_master<K: Ord + fmt::Debug>(
    offloaded: impl IntoIterator<Item = K>,
    masters: impl IntoIterator<Item = K>,
) -> Result<(), Violation> {
    let mut count: BTreeMap<K, usize> = BTreeMap::new();
    for m in masters {
        *count.entry(m).or_default() += 1;
    }
    for k in offloaded {
        match count.get(&k).copied().unwrap_or(0) {
            1 => {}
            n => {
                return Err(violation(
                    Invariant::OneHostMaster,
                    format!("{k:?} has {n} host masters"),
                ));
            }
        }
    }
    Ok(())
}

/// INV-2 where masters may be staged (CONTRACT §7c: a block whose pin was
/// refused, beyond a host budget, or with `pin_cpu_memory = false`): its
/// master is the weight source's pageable memory, which no device sees, so
/// the device's pinned and registered memory holds each offloaded key at
/// most once as a master plus once per staging buffer, never more.
pub fn staged_host_masters<K: Ord + fmt::Debug>(
    offloaded: impl IntoIterator<Item = K>,
    masters: impl IntoIterator<Item = K>,
    staging_buffers: usize,
) -> Result<(), Violation> {
    let mut count: BTreeMap<K, usize> = BTreeMap::new();
    for m in masters {
        *count.entry(m).or_default() += 1;
    }
    for k in offloaded {
        let n = count.get(&k).copied().unwrap_or(0);
        if n > 1 + staging_buffers {
            return Err(violation(
                Invariant::OneHostMaster,
                format!(
                    "{k:?} has {n} host copies (at most one master and {staging_buffers} staging buffers)"
                ),
            ));
        }
    }
    Ok(())
}

/// How an operation uses a buffer, for INV-3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Access {
    /// Reads it (compute, or a copy out of it).
    Read,
    /// Fills or overwrites it.
    Write,
    /// Frees it (the whole buffer).
    Free,
}

/// One access of a buffer range, in issue order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BufferOp {
    /// Operation id (its index in the happens-before oracle).
    pub op: usize,
    /// The buffer, by name.
    pub buffer: String,
    /// The byte range touched (ignored for `Free`).
    pub range: std::ops::Range<u64>,
    /// The stream or host thread that issued it.
    pub stream: String,
    /// What it does.
    pub access: Access,
    /// A description, for the report.
    pub what: String,
}

fn overlaps(a: &std::ops::Range<u64>, b: &std::ops::Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

fn covers(outer: &std::ops::Range<u64>, inner: &std::ops::Range<u64>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end
}

#[derive(Default, Debug)]
struct BufferHistory {
    /// Accesses a later conflicting access must be ordered after.
    live: Vec<BufferOp>,
    freed: Option<BufferOp>,
}

/// The INV-3 checker, fed one access at a time (the simulator feeds it as
/// it enqueues work) with a happens-before oracle `hb(a, b)`: operation `a`
/// completes before `b` starts.
///
/// Rules: a read must be ordered after every overlapping write; a write
/// must be ordered after every overlapping read and write; a free after
/// every access; nothing may touch a freed buffer (use after free, double
/// free). History is pruned so that it stays bounded: an access ordered
/// after an earlier one of the same kind over a covered range replaces it
/// (order is transitive).
#[derive(Default, Debug)]
pub struct BufferOrderChecker {
    buffers: BTreeMap<String, BufferHistory>,
}

impl BufferOrderChecker {
    /// An empty checker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks `op` against the history of its buffer and records it.
    pub fn observe(
        &mut self,
        op: BufferOp,
        hb: impl Fn(usize, usize) -> bool,
    ) -> Result<(), Violation> {
        let history = self.buffers.entry(op.buffer.clone()).or_default();
        if let Some(freed) = &history.freed {
            let rule = if op.access == Access::Free {
                "double free"
            } else {
                "use after free"
            };
            return Err(order_violation(&op, freed, rule));
        }
        let conflicts = |earlier: &BufferOp| match op.access {
            Access::Free => true,
            Access::Read => earlier.access == Access::Write && overlaps(&earlier.range, &op.range),
            Access::Write => overlaps(&earlier.range, &op.range),
        };
        if let Some(bad) = history
            .live
            .iter()
            .find(|e| conflicts(e) && !hb(e.op, op.op))
        {
            let rule = match (op.access, bad.access) {
                (Access::Read, _) => "read before the fill completed",
                (_, Access::Read) => "overwrite or free while a read may be in flight",
                _ => "overwrite or free while a write may be in flight",
            };
            return Err(order_violation(&op, bad, rule));
        }
        match op.access {
            Access::Free => {
                history.live.clear();
                history.freed = Some(op);
            }
            Access::Write => {
                history.live.retain(|e| !covers(&op.range, &e.range));
                history.live.push(op);
            }
            Access::Read => {
                history.live.retain(|e| {
                    !(e.access == Access::Read && covers(&op.range, &e.range) && hb(e.op, op.op))
                });
                history.live.push(op);
            }
        }
        Ok(())
    }

    /// Forgets `buffer` (a new allocation reuses its name).
    pub fn forget(&mut self, buffer: &str) {
        self.buffers.remove(buffer);
    }
}

fn order_violation(now: &BufferOp, before: &BufferOp, rule: &str) -> Violation {
    violation(
        Invariant::NoEarlyFree,
        format!(
            "{rule}: `{}` ({:?} of bytes {:?} on {}) is not ordered after `{}` ({:?} of bytes {:?} on {}) of buffer `{}`",
            now.what,
            now.access,
            now.range,
            now.stream,
            before.what,
            before.access,
            before.range,
            before.stream,
            now.buffer
        ),
    )
}

/// INV-3 over a whole log: feeds [`BufferOrderChecker`] and returns the
/// first violation.
pub fn no_early_free(ops: &[BufferOp], hb: impl Fn(usize, usize) -> bool) -> Result<(), Violation> {
    let mut checker = BufferOrderChecker::new();
    ops.iter()
        .try_for_each(|op| checker.observe(op.clone(), &hb))
}

/// What INV-4 compares of one tensor before and after movement.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct TensorFacts {
    /// Path.
    pub path: String,
    /// dtype, as text.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Strides.
    pub strides: Vec<u64>,
    /// Storage offset.
    pub storage_offset: u64,
    /// Bytes of device memory the lent view spans.
    pub view_bytes: u64,
    /// Alias class: tensors whose views share device memory share this
    /// number (numbered in order of first appearance).
    pub alias_class: u32,
    /// Checksum of the values.
    pub checksum: u64,
}

/// INV-4: every tensor keeps its facts (values, dtype, shape, strides,
/// offset, aliasing).
pub fn buffers_stay_correct(
    before: &[TensorFacts],
    after: &[TensorFacts],
) -> Result<(), Violation> {
    if before.len() != after.len() {
        return Err(violation(
            Invariant::BuffersStayCorrect,
            format!("{} tensors before, {} after", before.len(), after.len()),
        ));
    }
    for (b, a) in before.iter().zip(after) {
        if b != a {
            return Err(violation(
                Invariant::BuffersStayCorrect,
                format!("`{}` changed: before {b:?}, after {a:?}", b.path),
            ));
        }
    }
    Ok(())
}

/// INV-5: the observable state of the pipeline (its description, hooks and
/// placement, as a snapshot the caller takes) is the same after a failed
/// `enable` as before it.
pub fn fail_before_mutate<S: PartialEq + fmt::Debug>(
    before: &S,
    after: &S,
) -> Result<(), Violation> {
    if before == after {
        Ok(())
    } else {
        Err(violation(
            Invariant::FailBeforeMutate,
            format!("a failed enable changed the pipeline: before {before:?}, after {after:?}"),
        ))
    }
}

/// Crate names that only backends may depend on (INV-6).
pub const DEVICE_LIBRARIES: [&str; 4] = ["cudarc", "nccl", "cuda-sys", "nccl-sys"];

/// INV-6: `crate_name`'s dependency closure names no device library.
pub fn platform_abstraction<'a>(
    crate_name: &str,
    dependency_closure: impl IntoIterator<Item = &'a str>,
) -> Result<(), Violation> {
    let forbidden: Vec<&str> = dependency_closure
        .into_iter()
        .filter(|d| {
            DEVICE_LIBRARIES
                .iter()
                .any(|lib| d == lib || d.starts_with(&format!("{lib}-")) || d.contains("nccl"))
        })
        .collect();
    if forbidden.is_empty() {
        Ok(())
    } else {
        Err(violation(
            Invariant::PlatformAbstraction,
            format!("`{crate_name}` depends on device libraries {forbidden:?}"),
        ))
    }
}

/// What INV-7 bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MemoryObservation {
    /// Peak device bytes held for weights.
    pub peak_device_weight_bytes: u64,
    /// Bytes that stay resident by design.
    pub resident_bytes: u64,
    /// Bytes that come and go: the slot ring(s) of layerwise, the largest
    /// swapped component of model level.
    pub slot_bytes: u64,
    /// Host bytes held for weights (pinned, registered, shards).
    pub host_weight_bytes: u64,
    /// Bytes of the offloaded weights each rank holds 1/G of (one copy;
    /// all of them without DLO, with G = 1).
    pub offloaded_weight_bytes: u64,
    /// Gather group size G (1 without DLO).
    pub group_size: u32,
    /// Bytes of offloaded weights every rank holds whole (DLO's rank-local
    /// rings beside gathered ones).
    pub local_weight_bytes: u64,
    /// Declared host staging bytes.
    pub staging_bytes: u64,
    /// `host_budget` as a size (CONTRACT §7c): the page-locked peak never
    /// exceeds it.
    pub host_budget_bytes: Option<u64>,
    /// Peak page-locked host bytes as the device locks them: pinned
    /// buffers, and registrations, where a registered window of a larger
    /// mapping locks the whole mapping (once).
    pub host_locked_bytes: u64,
}

/// INV-7: device weight memory ≤ resident + slots, and host weight memory
/// ≤ one copy of the offloaded weights (1/G under DLO, rounded up per
/// shard) + declared staging.
pub fn bounded_memory(m: &MemoryObservation, padding_bytes: u64) -> Result<(), Violation> {
    let device_bound = m.resident_bytes + m.slot_bytes;
    if m.peak_device_weight_bytes > device_bound {
        return Err(violation(
            Invariant::BoundedMemory,
            format!(
                "peak device weight bytes {} > resident {} + slots {}",
                m.peak_device_weight_bytes, m.resident_bytes, m.slot_bytes
            ),
        ));
    }
    let g = u64::from(m.group_size.max(1));
    let host_bound = m.offloaded_weight_bytes.div_ceil(g)
        + padding_bytes
        + m.local_weight_bytes
        + m.staging_bytes;
    if m.host_weight_bytes > host_bound {
        return Err(violation(
            Invariant::BoundedMemory,
            format!(
                "host weight bytes {} > one copy {} / G {} + padding {} + rank-local {} + staging {}",
                m.host_weight_bytes,
                m.offloaded_weight_bytes,
                g,
                padding_bytes,
                m.local_weight_bytes,
                m.staging_bytes
            ),
        ));
    }
    if let Some(budget) = m.host_budget_bytes
        && m.host_locked_bytes > budget
    {
        return Err(violation(
            Invariant::BoundedMemory,
            format!(
                "page-locked host bytes {} (pinned, and registered as the device locks them: a window's whole mapping) > host_budget {budget}",
                m.host_locked_bytes
            ),
        ));
    }
    Ok(())
}

/// What a device measured while one phase of a request ran (a planned
/// backend's INV-7, phase by phase): its own peaks of weight bytes and of
/// everything it held (weights and activations).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PhaseObservation {
    /// The component whose phase it was.
    pub phase: String,
    /// Peak device bytes held for weights in the phase.
    pub peak_weight_bytes: u64,
    /// Peak device bytes of everything (weights, activations) in it.
    pub peak_total_bytes: u64,
    /// Peak of the device's own count of memory in use in it, where the
    /// observer reads one (its free memory's complement: what the
    /// allocator holds, chunks and all, and the page tables of page-locked
    /// host memory); 0 where not.
    pub peak_counted_bytes: u64,
}

/// INV-7 for a planned request, per phase: each phase's weight peak within
/// its own bound (the weights in no component, the kept sets, its held set
/// and its slots), and each phase's peak of everything within the budget.
/// `bounds` names each phase's weight bound; a phase observed without one
/// is a violation too.
pub fn bounded_phases<'a>(
    observed: impl IntoIterator<Item = &'a PhaseObservation>,
    bounds: &BTreeMap<String, u64>,
    budget_bytes: u64,
) -> Result<(), Violation> {
    for o in observed {
        let Some(bound) = bounds.get(&o.phase) else {
            return Err(violation(
                Invariant::BoundedMemory,
                format!("phase `{}` ran, but the plan has no such phase", o.phase),
            ));
        };
        if o.peak_weight_bytes > *bound {
            return Err(violation(
                Invariant::BoundedMemory,
                format!(
                    "phase `{}`: peak device weight bytes {} > its bound {bound} (outside + kept + held + slots + decode staging)",
                    o.phase, o.peak_weight_bytes
                ),
            ));
        }
        if o.peak_total_bytes > budget_bytes {
            return Err(violation(
                Invariant::BoundedMemory,
                format!(
                    "phase `{}`: peak device bytes {} (weights and activations) > the budget {budget_bytes}",
                    o.phase, o.peak_total_bytes
                ),
            ));
        }
        if o.peak_counted_bytes > budget_bytes {
            return Err(violation(
                Invariant::BoundedMemory,
                format!(
                    "phase `{}`: the device counts {} B in use at its peak (what the allocator holds, rounded up to its chunks, and the page tables of page-locked host memory) > the budget {budget_bytes}",
                    o.phase, o.peak_counted_bytes
                ),
            ));
        }
    }
    Ok(())
}

/// INV-8: the offloaded output equals the resident output bit for bit.
pub fn equivalence(resident: &[u8], offloaded: &[u8]) -> Result<(), Violation> {
    if resident.len() != offloaded.len() {
        return Err(violation(
            Invariant::Equivalence,
            format!(
                "output of {} bytes vs {} resident",
                offloaded.len(),
                resident.len()
            ),
        ));
    }
    match resident.iter().zip(offloaded).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(violation(
            Invariant::Equivalence,
            format!(
                "outputs differ first at byte {i}: resident {:#04x}, offloaded {:#04x}",
                resident[i], offloaded[i]
            ),
        )),
    }
}

/// A vector clock, the happens-before oracle the simulator feeds
/// [`no_early_free`] with: one component per stream (or host thread).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VectorClock(Vec<u64>);

impl VectorClock {
    /// A clock over `n` streams, all zero.
    pub fn new(n: usize) -> Self {
        Self(vec![0; n])
    }

    /// Advances component `i` (a new operation on stream `i`).
    pub fn tick(&mut self, i: usize) {
        if self.0.len() <= i {
            self.0.resize(i + 1, 0);
        }
        self.0[i] += 1;
    }

    /// Component-wise maximum with `other` (a wait).
    pub fn join(&mut self, other: &VectorClock) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a = (*a).max(*b);
        }
    }

    /// Whether `self` happened before or at `other` (every component ≤).
    pub fn le(&self, other: &VectorClock) -> bool {
        self.0
            .iter()
            .enumerate()
            .all(|(i, a)| *a <= other.0.get(i).copied().unwrap_or(0))
    }
}
