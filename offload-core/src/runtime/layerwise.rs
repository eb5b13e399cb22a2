//! The ring engine of both streaming strategies: layerwise (CONTRACT §7)
//! and distributed layerwise (CONTRACT §8). Distributed layerwise is
//! layerwise whose transport gathers; everything else is one engine.
//!
//! * Host: each block's storages are packed into one unit. A ring that
//!   copies (layerwise, DLO's rank-local mode) holds each block's whole
//!   unit as its host master (pinned once, exact size, or the loader's
//!   memory registered in place). A ring that gathers (DLO, G > 1) holds
//!   only this rank's shard of each block: `s = ceil(bytes / G)` bytes,
//!   zero-padded (see `ring.rs`).
//! * Device: one slot pool of `depth + 1` buffers, each the largest slot
//!   footprint of any block (a gathered block occupies G·s bytes),
//!   allocated once and shared by every ring, plus (when a ring gathers)
//!   two shard buffers of the largest shard. Each slot owns a *ready*
//!   event (recorded after its fill) and a *last use* event (recorded on
//!   the compute stream after the forward that read it), and a stamp
//!   naming the (ring, block) it holds.
//! * Transport, per ring: **copy** — the copy stream waits for the slot's
//!   last use, copies the master into the slot, records ready; **gather** —
//!   the copy stream waits for the gather that last read the shard buffer
//!   (not for compute: it writes no slot), copies this rank's shard into
//!   it, records `copied`; the communication stream waits for `copied` and
//!   for the slot's last use, all-gathers every rank's shard into the slot
//!   narrowed to exactly G·s bytes, and records the slot's ready and the
//!   shard buffer's `consumed`.
//! * Pre-forward of block i: find the slot stamped (ring, i) or fill one on
//!   demand (its predecessor was skipped); make the compute stream wait for
//!   the slot's ready event; point the block's tensors into the slot; then
//!   make sure blocks i+1..=i+depth (wrapping to block 0) are filling. A fill
//!   takes the least recently filled free slot. The host never waits.
//! * Post-forward: record the slot's last use; the block's tensors go back
//!   to their host masters. Nothing is copied back.
//!
//! Multi-rank rules (CONTRACT §8): every rank must issue the same
//! collectives in the same order, so no gather is ever issued from a path
//! only some ranks take. Hence: the first fill of every ring is deferred to
//! its first forward (layerwise, single-rank, fills block 0 at enable); a
//! copy fill (a rank-local ring, which may run on one rank only) never
//! evicts a gathered block in flight, and a gathered fill evicts one only
//! when every rank must (no other free slot); any error in a gathering
//! backend's hook poisons it; failure cleanup runs no collective.

use crate::sync::Arc;
use std::collections::{BTreeSet, VecDeque};

use offload_hooks::{BoxError, Forwarded, ModelHook, PreForward};

use crate::config::{OffloadConfig, OffloadStrategy, WeightCompression, no_codec};
use crate::device::{
    Api, Codec, CodecSpan, Collective, Device, DeviceBuffer, HostBuffer, coded_bound,
};
use crate::discovery::{Role, log_warnings};
use crate::lifecycle::{
    DisableStep, EnableStep, Lifecycle, LifecycleState, OffloadBackend, OffloadError,
};
use crate::model::{ModuleId, StorageId};
use crate::residency::{Residency, Transition};
use crate::runtime::backend::{Backend, DeviceLocation, HostMasters, WeightSource};
use crate::runtime::bugs::{Bugs, PlantedBug};
use crate::runtime::filler::StagingRing;
use crate::runtime::hooks::{ForwardCtx, Model};
use crate::runtime::layout::Unit;
use crate::runtime::read::{Offset, ParallelUnitBytes, fill_threads};
use crate::runtime::ring::{RingLayout, Shard};
use crate::runtime::shared::{
    CodedFrom, CodedMaster, Handles, HostMaster, Placement, Shared, StrategyState, bytes_of,
    check_single_owner, dev_err, enable_span, install_hooks, plan_and_partition, remove_hooks,
    transfer_span,
};
use crate::runtime::slots::SlotTable;
use crate::runtime::timer::{Mark, Timer};

/// One block's host master: the whole unit, or this rank's shard of it.
struct Master<A: Api> {
    unit: Unit,
    /// Shared with the planned backend's store of masters, which outlives
    /// the rings it builds; otherwise the ring's own.
    host: Arc<HostMaster<A>>,
    shard: Option<Shard>,
    /// A coded master (CONTRACT §7b): its coded bytes and the decode's work
    /// items; `host` then holds the coded bytes.
    coded: Option<(u64, u64)>,
}

/// One ring: the streamed blocks of one stack, in forward order.
struct Ring<A: Api> {
    blocks: Vec<Master<A>>,
    gathered: bool,
    role: Role,
}

/// One device slot and the events that order its reuse.
struct Slot<A: Api> {
    buffer: Arc<A::DeviceBuffer>,
    ready: A::Event,
    last_use: A::Event,
}

/// A device buffer a transfer stages into before the stage that writes the
/// slot reads it (a rank's shard before its gather, coded bytes before
/// their decode), with the events that order its reuse.
struct Staging<A: Api> {
    buffer: Arc<A::DeviceBuffer>,
    /// Recorded on the copy stream after the copy into it.
    copied: A::Event,
    /// Recorded on the stream that read it (communication, decode) after
    /// the gather or decode that read it.
    consumed: A::Event,
}

/// What a gathering engine adds: the group and its shard buffers.
struct Gather<A: Api> {
    collective: Arc<dyn Collective<A>>,
    shards: Vec<Staging<A>>,
    next: usize,
}

/// What a decoding engine adds: the codec and its staging buffers.
struct Decoding<A: Api> {
    codec: Arc<dyn Codec<A>>,
    staging: Vec<Staging<A>>,
    next: usize,
}

/// What a staging engine adds (CONTRACT §7c): the pinned host buffers a
/// staged master passes through on its way to a slot, in parts of one
/// buffer each, and their filler.
struct HostStaging<A: Api> {
    ring: StagingRing<A>,
    /// The stage the next fill goes into: fills go round the ring in the
    /// order their parts are copied.
    next: usize,
    /// Whether each staged block's pages are released after it is read
    /// ([`WeightSource::release`]: the staged masters exceed the host
    /// budget's room, so a mapped checkpoint must not stay resident).
    release: bool,
    /// Fills of raw blocks (staged, or pinned behind a staged one) the copy
    /// stream takes in this order, not all issued yet: only the front one
    /// may have issued anything ([`pump`]).
    queue: VecDeque<Queued>,
    /// The ring whose pass ended last and the slot its last block was
    /// read from, until the next hook (some ring's first pre-forward)
    /// reads it: no hook of this engine runs between the two.
    pass_end: Option<(usize, usize)>,
    /// Per ring, whether its last pass's end was waited for: at the next
    /// hook (some ring's first pre-forward) the ring's last block's
    /// kernels had finished (its slot's `last_use` was done), so no hook
    /// ran while they did (the caller synchronised at the step's end, or
    /// its host work between the forwards outlasted them). The ring's
    /// last post-forward then issues the queue while that block's kernels
    /// run.
    end_waited: Vec<bool>,
}

/// A prefetch of block `block` of ring `ring` (the bytes of `source`) into
/// slot `k`, queued behind the staged blocks the copy stream takes first
/// (CONTRACT §7c): a raw staged block, its parts issued in order as their
/// fills land, or a pinned block, issued whole once the blocks before it
/// are. The hook's thread waits for it only where compute needs it (the
/// block's own pre-forward), where everything must be issued (a fill that
/// is not a prefetch, a pool change), and, where the caller was seen
/// waiting at the last step's end, in the ring's last post-forward while
/// that block's kernels run; anywhere else it issues what is
/// filled and goes on, so a block whose fill outlasts the compute before it
/// holds back no kernels of the blocks before it.
#[derive(Clone, Copy, Debug)]
struct Queued {
    ring: usize,
    block: usize,
    source: usize,
    k: usize,
    /// Whether the copy stream waits for the slot's last use (false only
    /// where a planted bug asks).
    wait_last_use: bool,
    /// The prefetch's kind (a pinned one is issued through
    /// [`Transport::transfer`] with it).
    kind: FillKind,
    /// `None`: a pinned block. `Some(None)`: a staged block nothing of
    /// which is issued yet (the copy stream's wait for its slot comes with
    /// its first part); `Some(Some(p))`: its parts from `p` on still to
    /// issue.
    staged: Option<Option<u64>>,
}

struct State<A: Api> {
    placement: Placement<A>,
    resident: Vec<Arc<A::DeviceBuffer>>,
    rings: Vec<Ring<A>>,
    slots: Vec<Slot<A>>,
    table: SlotTable,
    depth: usize,
    gather: Option<Gather<A>>,
    decoding: Option<Decoding<A>>,
    host_staging: Option<HostStaging<A>>,
    /// Extra host masters kept only when a planted bug asks for them.
    shadow_masters: Vec<HostMaster<A>>,
    /// The slot each block was last filled into (read only by the
    /// `IgnoreRingStamp` planted bug, which trusts it over the stamps).
    filled_into: Vec<Vec<Option<usize>>>,
    /// Device-timed marks around every fill, while a warm-up measures.
    timer: Option<Arc<Timer<A>>>,
}

impl<A: Api> State<A> {
    /// Whether slot `k` holds a gathered block in flight: only a fill every
    /// rank makes (a gathered one) may evict it.
    fn protected(&self, k: usize) -> bool {
        self.table.stamp(k).is_some_and(|(r, b)| {
            self.rings[r].gathered
                && self
                    .placement
                    .residency_of(self.rings[r].blocks[b].unit.entries[0].storage)
                    == Some(Residency::InFlight)
        })
    }

    /// The slot a fill of `ring` may take, if any.
    fn victim(&self, ring: usize) -> Option<usize> {
        self.table
            .victim_sparing(|k| self.protected(k), self.rings[ring].gathered)
    }

    fn in_flight(&self, ring: usize, block: usize) -> bool {
        self.placement
            .residency_of(self.rings[ring].blocks[block].unit.entries[0].storage)
            == Some(Residency::InFlight)
    }
}

impl<A: Api> StrategyState<A> for State<A> {
    fn placement(&self) -> &Placement<A> {
        &self.placement
    }

    fn device_weight_bytes(&self) -> u64 {
        let mut buffers: Vec<Arc<A::DeviceBuffer>> =
            self.slots.iter().map(|s| Arc::clone(&s.buffer)).collect();
        if let Some(g) = &self.gather {
            buffers.extend(g.shards.iter().map(|s| Arc::clone(&s.buffer)));
        }
        if let Some(d) = &self.decoding {
            buffers.extend(d.staging.iter().map(|s| Arc::clone(&s.buffer)));
        }
        bytes_of::<A>(&self.resident) + bytes_of::<A>(&buffers)
    }

    fn host_weight_bytes(&self) -> u64 {
        let masters: u64 = self
            .rings
            .iter()
            .flat_map(|r| &r.blocks)
            .map(|m| m.host.len_bytes())
            .sum();
        let shadows: u64 = self.shadow_masters.iter().map(HostMaster::len_bytes).sum();
        let staging: u64 = self.host_staging.iter().map(|s| s.ring.bytes()).sum();
        masters + shadows + staging
    }
}

/// What the hooks of one backend share.
struct Engine<A: Api> {
    shared: Shared<A, State<A>>,
    strategy: OffloadStrategy,
    /// This rank in the gather group, and G.
    rank: u32,
    group: u32,
}

impl<A: Api> std::ops::Deref for Engine<A> {
    type Target = Shared<A, State<A>>;

    fn deref(&self) -> &Self::Target {
        &self.shared
    }
}

impl<A: Api> Engine<A> {
    /// Whether a failure here can leave the ranks' collectives out of step
    /// (a gathering backend of more than one rank): then it poisons.
    fn multi_rank(&self) -> bool {
        self.group > 1 && self.handles.comm.is_some()
    }

    fn check_poison(&self) -> Result<(), OffloadError> {
        match self.poisoned() {
            Some(reason) => Err(OffloadError::Poisoned {
                strategy: self.strategy,
                reason,
            }),
            None => Ok(()),
        }
    }
}

/// Why a block is being filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FillKind {
    /// Block 0 of the first ring, at enable (layerwise only).
    Initial,
    /// A prefetch from the pre-forward of an earlier block (`wrap`: the
    /// ring's end fetching its start).
    Prefetch { wrap: bool },
    /// The block arrived unmaterialised: filled on demand.
    OnDemand,
    /// `disable` gathers it once more to hand it back.
    Restore,
}

/// How a block's bytes reach its slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Transport {
    /// The whole block, host master → slot, on the copy stream.
    Copy,
    /// This rank's shard → shard buffer on the copy stream, then an
    /// all-gather into the slot on the communication stream.
    Gather,
    /// The block's coded bytes → a staging buffer on the copy stream, then
    /// the codec's decode into the slot on the decode stream.
    Decode,
    /// A staged master (pageable, CONTRACT §7c) → a pinned host staging
    /// buffer by host threads, once the copy that last read the buffer
    /// has completed; then staging buffer → slot on the copy stream.
    Stage,
}

impl Transport {
    /// Moves block `block` of `ring` (the bytes of `source`, which only a
    /// planted bug makes differ) into slot `k` and records the slot's ready
    /// event. The stream that writes the slot (copy, or communication for a
    /// gather) first waits for the slot's last use (unless `wait_last_use`
    /// is false, which only planted bugs ask for): a gather's shard copy
    /// writes only the shard buffer, so it need not wait for compute and
    /// overlaps the previous block's forward.
    fn transfer<A: Api>(
        self,
        engine: &Engine<A>,
        st: &mut State<A>,
        (ring, block, source): (usize, usize, usize),
        k: usize,
        (kind, wait_last_use): (FillKind, bool),
    ) -> Result<(), OffloadError> {
        let h = &engine.handles;
        let wait = |stream: &A::Stream, name: &str| {
            if wait_last_use {
                h.device
                    .stream_wait_event(stream, &st.slots[k].last_use)
                    .map_err(|e| dev_err(format!("stream_wait_event({name}, last use)"), e))
            } else {
                Ok(())
            }
        };
        let stale = engine.bug(PlantedBug::StaleSlot) && matches!(kind, FillKind::Prefetch { .. });
        let master = &st.rings[ring].blocks[source];
        let bytes = master
            .unit
            .bytes
            .min(st.rings[ring].blocks[block].unit.bytes);
        let slot = &st.slots[k];
        let name = &st.rings[ring].blocks[block].unit.name;
        let timer = &st.timer;
        // The copy stream fills the slot from `source` (`None`: the planted
        // stale slot, no copy): it waits for the slot's last use and, where
        // rings decode, for its previous fill (a decode on the decode
        // stream, of a prefetch this fill evicts); compute waits for
        // `ready`, recorded after the copy. Its two sources: this block's
        // master (pinned or registered, exactly its unit's bytes, freed
        // only after draining) and a host staging buffer lent by
        // `StagingRing::with_filled` (the largest staged block, filled
        // before the lend, refilled only after its `copied`, which the
        // caller records after this copy).
        let copy_to_slot = |source: Option<crate::device::HostSource<'_, A>>,
                            kind: &str,
                            what: &str,
                            copied: Option<&A::Event>|
         -> Result<(), OffloadError> {
            copy_waits_for_slot(h, slot, wait_last_use)?;
            if let Some(t) = timer {
                t.mark(&h.copy, Mark::CopyStart { bytes })?;
            }
            if let Some(source) = source {
                let _span = transfer_span(name, bytes, "copy", kind).entered();
                // SAFETY: the slot holds the largest block (≥ `bytes`) and
                // either source at least `bytes`, unchanged until the copy
                // completes (above); the copy stream waits for the slot's
                // last use, so nothing reads the slot while it is
                // overwritten, and compute waits for `ready` (recorded
                // next) before reading.
                unsafe {
                    h.device
                        .copy_h2d(&h.copy, source, 0, &slot.buffer, 0, bytes)
                }
                .map_err(|e| dev_err(what, e))?;
            }
            // Right after the copy, before anything else can fail: the
            // source's next writer waits for it.
            if let Some(event) = copied {
                h.device
                    .record_event(event, &h.copy)
                    .map_err(|e| dev_err("record_event(host staging copied)", e))?;
            }
            if let Some(t) = timer {
                t.mark(&h.copy, Mark::CopyEnd)?;
            }
            h.device
                .record_event(&slot.ready, &h.copy)
                .map_err(|e| dev_err("record_event(ready)", e))
        };
        match self {
            Transport::Copy => {
                let what = format!("copy_h2d of `{}`", master.unit.name);
                let source = if stale {
                    None
                } else {
                    Some(master.host.copy_source(&what)?)
                };
                copy_to_slot(source, "h2d", &what, None)
            }
            Transport::Gather => {
                let comm = h
                    .comm
                    .as_ref()
                    .expect("a gathering engine has a comm stream");
                let shard = master.shard.expect("a gathered block has a shard");
                let gather = st.gather.as_mut().expect("a gathering engine");
                let j = gather.next;
                gather.next = (j + 1) % gather.shards.len();
                let buffer = &gather.shards[j];
                if !engine.bug(PlantedBug::ShardReuseBeforeGather) {
                    h.device
                        .stream_wait_event(&h.copy, &buffer.consumed)
                        .map_err(|e| dev_err("stream_wait_event(copy, shard consumed)", e))?;
                }
                if !stale {
                    let _span = transfer_span(name, shard.bytes, "copy", "h2d shard").entered();
                    let source = master
                        .host
                        .copy_source(&format!("copy_h2d of this rank's shard of `{name}`"))?;
                    // SAFETY: the master is exactly `shard.bytes` and the
                    // shard buffer holds the largest shard; the copy stream
                    // waits above for the gather that last read the buffer,
                    // and the gather reading it waits for `copied` (next).
                    unsafe {
                        h.device
                            .copy_h2d(&h.copy, source, 0, &buffer.buffer, 0, shard.bytes)
                    }
                    .map_err(|e| {
                        dev_err(
                            format!("copy_h2d of this rank's shard of `{}`", master.unit.name),
                            e,
                        )
                    })?;
                }
                h.device
                    .record_event(&buffer.copied, &h.copy)
                    .map_err(|e| dev_err("record_event(shard copied)", e))?;
                h.device
                    .stream_wait_event(comm, &buffer.copied)
                    .map_err(|e| dev_err("stream_wait_event(comm, shard copied)", e))?;
                wait(comm, "comm")?;
                // The slot narrowed to this block: G·s bytes, never the
                // whole slot (a planted bug gathers the whole slot).
                let shard_bytes = if engine.bug(PlantedBug::WholeSlotGather) {
                    slot.buffer.len_bytes() / shard.group
                } else {
                    shard.bytes
                };
                let _span =
                    transfer_span(name, shard_bytes * shard.group, "comm", "all-gather").entered();
                // SAFETY: `shard_bytes` ≤ the shard buffer (it holds the
                // largest shard, and a slot holds G of them) and G ×
                // `shard_bytes` ≤ the slot; the communication stream waits
                // for `copied` (the shard is in place) and for the slot's
                // last use (nothing reads the slot while it is written);
                // compute waits for `ready` and the next shard copy into
                // this buffer for `consumed`, both recorded next.
                unsafe {
                    gather.collective.all_gather(
                        comm,
                        &buffer.buffer,
                        0,
                        shard_bytes,
                        &slot.buffer,
                        0,
                    )
                }
                .map_err(|e| {
                    dev_err(
                        format!(
                            "all_gather of `{}` ({} × {shard_bytes} bytes)",
                            master.unit.name, shard.group
                        ),
                        e,
                    )
                })?;
                h.device
                    .record_event(&slot.ready, comm)
                    .map_err(|e| dev_err("record_event(ready)", e))?;
                h.device
                    .record_event(&buffer.consumed, comm)
                    .map_err(|e| dev_err("record_event(shard consumed)", e))
            }
            Transport::Decode => {
                let decode = h
                    .decode
                    .as_ref()
                    .expect("a decoding engine has a decode stream");
                let (coded_bytes, work) = master.coded.expect("a decoded block is coded");
                let decoded_bytes = master.unit.bytes;
                let Some(decoding) = st.decoding.as_mut() else {
                    return Err(OffloadError::Forward {
                        module: master.unit.name.clone(),
                        reason: "a coded block streamed where no decode staging buffers are held (its phase's pool has none)".to_owned(),
                    });
                };
                let j = decoding.next;
                decoding.next = (j + 1) % decoding.staging.len();
                let buffer = &decoding.staging[j];
                // The copy writes only the staging buffer: it waits for the
                // decode that last read it, never for compute.
                if !engine.bug(PlantedBug::StagingReuseBeforeDecode) {
                    h.device
                        .stream_wait_event(&h.copy, &buffer.consumed)
                        .map_err(|e| dev_err("stream_wait_event(copy, staging consumed)", e))?;
                }
                if let Some(t) = &st.timer {
                    t.mark(&h.copy, Mark::CopyStart { bytes: coded_bytes })?;
                }
                if !stale {
                    let _span = transfer_span(name, coded_bytes, "copy", "h2d coded").entered();
                    let copy = |source: crate::device::HostSource<'_, A>, at: u64, len: u64| {
                        // SAFETY: the source (the master, or the host
                        // staging buffer a part of it was staged into)
                        // holds `len` bytes of the coded blob from `at`
                        // (all `coded_bytes` of it from 0, or one part),
                        // and the device staging buffer the largest blob;
                        // the copy stream waits above for the decode that
                        // last read the device buffer, and the decode
                        // reading it waits for `copied` (recorded after the
                        // last part); a master is freed only after
                        // draining, a host staging buffer refilled only
                        // after its own `copied`.
                        unsafe {
                            h.device
                                .copy_h2d(&h.copy, source, 0, &buffer.buffer, at, len)
                        }
                        .map_err(|e| {
                            dev_err(format!("copy_h2d of the coded `{}`", master.unit.name), e)
                        })
                    };
                    if matches!(*master.host, HostMaster::Staged(_)) {
                        // A coded master left pageable (CONTRACT §7c):
                        // through the host staging buffers in parts, each
                        // part's stage refilled only after its `copied`;
                        // every part issued here (its decode follows).
                        let blocks = &st.rings[ring].blocks;
                        let staging = st
                            .host_staging
                            .as_mut()
                            .expect("a ring with a staged master has host staging");
                        issue_parts(
                            engine,
                            staging,
                            blocks,
                            (ring, source),
                            0,
                            u64::MAX,
                            |stage, offset, len| {
                                copy(
                                    crate::device::HostSource::Pinned(&stage.buffer),
                                    offset,
                                    len,
                                )?;
                                h.device
                                    .record_event(&stage.copied, &h.copy)
                                    .map_err(|e| dev_err("record_event(host staging copied)", e))
                            },
                        )?;
                    } else {
                        copy(
                            master
                                .host
                                .copy_source(&format!("copy_h2d of the coded `{name}`"))?,
                            0,
                            coded_bytes,
                        )?;
                    }
                }
                if let Some(t) = &st.timer {
                    t.mark(&h.copy, Mark::CopyEnd)?;
                }
                h.device
                    .record_event(&buffer.copied, &h.copy)
                    .map_err(|e| dev_err("record_event(staging copied)", e))?;
                if engine.bug(PlantedBug::ComputeBeforeDecode) {
                    h.device
                        .record_event(&slot.ready, &h.copy)
                        .map_err(|e| dev_err("record_event(ready)", e))?;
                }
                if !engine.bug(PlantedBug::DecodeBeforeCopy) {
                    h.device
                        .stream_wait_event(decode, &buffer.copied)
                        .map_err(|e| dev_err("stream_wait_event(decode, staging copied)", e))?;
                }
                if !engine.bug(PlantedBug::DecodeIntoSlotInUse) {
                    wait(decode, "decode")?;
                }
                if let Some(t) = &st.timer {
                    t.mark(decode, Mark::DecodeStart)?;
                }
                let _span = transfer_span(name, decoded_bytes, "decode", "decode").entered();
                // SAFETY: the staging buffer holds the coded bytes once the
                // decode stream reaches this call (it waits for `copied`
                // above) and is not rewritten before `consumed` (recorded
                // next, waited for by the next copy into it); the decode
                // writes `decoded_bytes` ≤ the slot after the slot's last
                // use, and compute waits for `ready` (recorded next).
                unsafe {
                    decoding.codec.decode(
                        decode,
                        &buffer.buffer,
                        coded_bytes,
                        work,
                        &slot.buffer,
                        decoded_bytes,
                    )
                }
                .map_err(|e| {
                    dev_err(
                        format!(
                            "decode of `{}` ({coded_bytes} → {decoded_bytes} bytes, {})",
                            master.unit.name,
                            decoding.codec.name()
                        ),
                        e,
                    )
                })?;
                if let Some(t) = &st.timer {
                    t.mark(decode, Mark::DecodeEnd)?;
                }
                if !engine.bug(PlantedBug::ComputeBeforeDecode) {
                    h.device
                        .record_event(&slot.ready, decode)
                        .map_err(|e| dev_err("record_event(ready)", e))?;
                }
                h.device
                    .record_event(&buffer.consumed, decode)
                    .map_err(|e| dev_err("record_event(staging consumed)", e))
            }
            Transport::Stage => {
                if stale {
                    return copy_to_slot(None, "h2d staged", "", None);
                }
                // Queued behind the blocks the copy stream takes first; the
                // caller pumps the queue once the slot holds the block. The
                // copy stream's wait for the slot's last use (and, where
                // rings decode, its previous fill) comes with the first part
                // ([`pump`]).
                let staging = st
                    .host_staging
                    .as_mut()
                    .expect("a ring with a staged master has host staging");
                staging.queue.push_back(Queued {
                    ring,
                    block,
                    source,
                    k,
                    wait_last_use,
                    kind,
                    staged: Some(None),
                });
                Ok(())
            }
        }
    }
}

/// The copy stream's waits before a copy into `slot`: its last use (unless
/// `wait_last_use` is false, which only planted bugs ask for) and, where
/// rings decode, its previous fill (a decode on the decode stream, of a
/// prefetch this fill evicts).
fn copy_waits_for_slot<A: Api>(
    h: &Handles<A>,
    slot: &Slot<A>,
    wait_last_use: bool,
) -> Result<(), OffloadError> {
    if wait_last_use {
        h.device
            .stream_wait_event(&h.copy, &slot.last_use)
            .map_err(|e| dev_err("stream_wait_event(copy, last use)", e))?;
    }
    if h.decode.is_some() {
        h.device
            .stream_wait_event(&h.copy, &slot.ready)
            .map_err(|e| dev_err("stream_wait_event(copy, previous fill)", e))?;
    }
    Ok(())
}

/// The bytes a staging buffer takes of `master` (its coded bytes for a
/// coded one); 0 for a master that is not staged.
fn staged_len<A: Api>(master: &Master<A>) -> u64 {
    match &*master.host {
        HostMaster::Staged(s) => s.bytes,
        _ => 0,
    }
}

/// The parts a staged master of `len` bytes passes through staging
/// buffers of `part_bytes` in (one at least).
fn parts_of(len: u64, part_bytes: u64) -> u64 {
    len.div_ceil(part_bytes.max(1)).max(1)
}

/// Offset and length of part `p` of `len` bytes in parts of `part_bytes`.
fn part_range(len: u64, part_bytes: u64, p: u64) -> (u64, u64) {
    let offset = (p * part_bytes).min(len);
    (offset, part_bytes.min(len - offset))
}

/// The staged blocks after block `b` in ring order, round to the one
/// before it.
fn staged_after<A: Api>(blocks: &[Master<A>], b: usize) -> impl Iterator<Item = usize> + '_ {
    let n = blocks.len();
    (1..n)
        .map(move |d| (b + d) % n)
        .filter(|&i| matches!(*blocks[i].host, HostMaster::Staged(_)))
}

/// The parts after part `part` of staged block `source`, in the order the
/// ring copies them (the rest of its own, then each staged block after it
/// in ring order, round to the one before it), at most `most`.
fn parts_after<A: Api>(
    blocks: &[Master<A>],
    (source, part): (usize, u64),
    part_bytes: u64,
    most: usize,
) -> Vec<(usize, u64)> {
    let own = parts_of(staged_len(&blocks[source]), part_bytes);
    let later = staged_after(blocks, source)
        .flat_map(|b| (0..parts_of(staged_len(&blocks[b]), part_bytes)).map(move |p| (b, p)));
    (part + 1..own)
        .map(|p| (source, p))
        .chain(later)
        .take(most)
        .collect()
}

/// Fills stage `j` with part `part` of staged block `block` of ring
/// `ring`: queued for the filler thread, or run now where `now`.
fn queue_part<A: Api>(
    staging: &HostStaging<A>,
    blocks: &[Master<A>],
    (ring, block, part): (usize, usize, u64),
    j: usize,
    skip_wait: bool,
    now: bool,
) {
    let HostMaster::Staged(s) = &*blocks[block].host else {
        return;
    };
    let part_bytes = staging.ring.part_bytes();
    let parts = parts_of(s.bytes, part_bytes);
    let last = part + 1 == parts;
    // The next staged unit, read ahead once this one's last part is in.
    let next = staged_after(blocks, block).next().map(|b| &blocks[b].unit);
    staging.ring.fill(
        j,
        crate::runtime::filler::Part {
            tag: (ring, block, part),
            unit: &blocks[block].unit,
            coded: s.coded.as_ref(),
            range: part_range(s.bytes, part_bytes, part),
            last,
        },
        (skip_wait, staging.release),
        next,
        now,
    );
}

/// Queues fills of the parts the ring copies after part `after` into the
/// stages that are free (copied out of since their fill, or empty), in
/// order round the ring, skipping parts a stage already holds: the filler
/// runs ahead of the copies by up to the whole ring. Nothing without a
/// filler thread (each part is then filled when its copy needs it).
fn top_up<A: Api>(
    staging: &mut HostStaging<A>,
    blocks: &[Master<A>],
    (ring, after): (usize, (usize, u64)),
    skip_wait: bool,
) {
    if !staging.ring.fills_ahead() {
        return;
    }
    let n = staging.ring.len();
    for (b, p) in parts_after(blocks, after, staging.ring.part_bytes(), n) {
        if staging.ring.holding((ring, b, p)).is_some() {
            continue;
        }
        let w = staging.next;
        if !staging.ring.is_free(w) {
            break;
        }
        queue_part(staging, blocks, (ring, b, p), w, skip_wait, false);
        staging.next = (w + 1) % n;
    }
}

/// Issues the copies of staged block `source`'s parts from `from` on, in
/// order, each through `copy(stage, offset, len)` out of the stage its
/// fill went into (which must record the stage's `copied` right after the
/// copy: the stage's next fill waits for it), queueing the following
/// parts' fills as stages free up (CONTRACT §7c). For its first
/// `blocking` parts (`u64::MAX`: all) it waits for each part's fill
/// (filling it now where no stage holds it); after them it stops at the
/// first part not yet filled. Returns the next part to issue, `None` once
/// every part is issued.
fn issue_parts<A: Api>(
    engine: &Engine<A>,
    staging: &mut HostStaging<A>,
    blocks: &[Master<A>],
    (ring, source): (usize, usize),
    from: u64,
    blocking: u64,
    mut copy: impl FnMut(&mut crate::runtime::filler::Stage<A>, u64, u64) -> Result<(), OffloadError>,
) -> Result<Option<u64>, OffloadError> {
    let skip_wait = engine.bug(PlantedBug::HostStagingReuseBeforeCopy);
    let part_bytes = staging.ring.part_bytes();
    let len = staged_len(&blocks[source]);
    let n = staging.ring.len();
    for p in from..parts_of(len, part_bytes) {
        let blocking = p - from < blocking;
        let tag = (ring, source, p);
        let j = match staging.ring.holding(tag) {
            Some(j) if blocking || staging.ring.is_filled(j) => j,
            Some(_) => return Ok(Some(p)),
            None if blocking => {
                let j = staging.next;
                queue_part(staging, blocks, tag, j, skip_wait, true);
                staging.next = (j + 1) % n;
                j
            }
            None => {
                let w = staging.next;
                if staging.ring.fills_ahead() && staging.ring.is_free(w) {
                    queue_part(staging, blocks, tag, w, skip_wait, false);
                    staging.next = (w + 1) % n;
                }
                return Ok(Some(p));
            }
        };
        let (offset, part_len) = part_range(len, part_bytes, p);
        staging
            .ring
            .with_filled(j, |stage| copy(stage, offset, part_len))?;
        top_up(staging, blocks, (ring, (source, p)), skip_wait);
    }
    Ok(None)
}

/// Issues the front of the queue's staged block (`front`, its parts from
/// `part` on; `None`: nothing of it yet, so first the copy stream's wait
/// for its slot): its first `blocking` parts waiting for their fills
/// (`u64::MAX`: all), then those that are filled. Once all are, records
/// its slot's `ready` after them and pops it; returns whether it did.
fn issue_staged<A: Api>(
    engine: &Engine<A>,
    st: &mut State<A>,
    front: Queued,
    part: Option<u64>,
    blocking: u64,
) -> Result<bool, OffloadError> {
    let h = &engine.handles;
    let slot = &st.slots[front.k];
    let Some(staging) = st.host_staging.as_mut() else {
        return Ok(true);
    };
    let from = match part {
        Some(p) => p,
        None => {
            copy_waits_for_slot(h, slot, front.wait_last_use)?;
            if let Some(q) = staging.queue.front_mut() {
                q.staged = Some(Some(0));
            }
            0
        }
    };
    let blocks = &st.rings[front.ring].blocks;
    let timer = &st.timer;
    let name = &blocks[front.block].unit.name;
    let early_ready = engine.bug(PlantedBug::StagedReadyAfterFirstPart);
    let next = issue_parts(
        engine,
        staging,
        blocks,
        (front.ring, front.source),
        from,
        blocking,
        |stage, offset, len| {
            if let Some(t) = timer {
                t.mark(&h.copy, Mark::CopyStart { bytes: len })?;
            }
            let _span = transfer_span(name, len, "copy", "h2d staged").entered();
            // SAFETY: the stage holds this part (`len` bytes, filled before
            // the lend) and the slot the largest block (≥ `offset + len`);
            // the copy stream waited for the slot's last use before the
            // block's first part, so nothing reads the slot while it is
            // written, and compute waits for `ready`, recorded after the
            // last part (the hook that reads the block pumps the queue
            // through it first); the stage is refilled only after
            // `copied`, recorded next.
            unsafe {
                h.device.copy_h2d(
                    &h.copy,
                    crate::device::HostSource::Pinned(&stage.buffer),
                    0,
                    &slot.buffer,
                    offset,
                    len,
                )
            }
            .map_err(|e| dev_err(format!("copy_h2d of the staged `{name}`"), e))?;
            h.device
                .record_event(&stage.copied, &h.copy)
                .map_err(|e| dev_err("record_event(host staging copied)", e))?;
            if let Some(t) = timer {
                t.mark(&h.copy, Mark::CopyEnd)?;
            }
            if early_ready && offset == 0 {
                h.device
                    .record_event(&slot.ready, &h.copy)
                    .map_err(|e| dev_err("record_event(ready)", e))?;
            }
            Ok(())
        },
    )?;
    if let Some(part) = next {
        if let Some(q) = staging.queue.front_mut() {
            q.staged = Some(Some(part));
        }
        return Ok(false);
    }
    if !early_ready {
        h.device
            .record_event(&slot.ready, &h.copy)
            .map_err(|e| dev_err("record_event(ready)", e))?;
    }
    staging.queue.pop_front();
    Ok(true)
}

/// Issues the queue's fills in order (CONTRACT §7c): the first `through`
/// entries whole, waiting for their staged parts' fills, then whatever
/// is filled of the rest, stopping at the first part that is not. A
/// pinned entry is issued whole once it is at the front.
fn pump_queue<A: Api>(
    engine: &Engine<A>,
    st: &mut State<A>,
    mut through: usize,
) -> Result<(), OffloadError> {
    loop {
        let Some(front) = st
            .host_staging
            .as_ref()
            .and_then(|s| s.queue.front().copied())
        else {
            return Ok(());
        };
        let blocking = if through > 0 { u64::MAX } else { 0 };
        let done = match front.staged {
            None => {
                Transport::Copy.transfer(
                    engine,
                    st,
                    (front.ring, front.block, front.source),
                    front.k,
                    (front.kind, front.wait_last_use),
                )?;
                if let Some(s) = st.host_staging.as_mut() {
                    s.queue.pop_front();
                }
                true
            }
            Some(part) => issue_staged(engine, st, front, part, blocking)?,
        };
        if !done {
            return Ok(());
        }
        through = through.saturating_sub(1);
    }
}

/// [`pump_queue`]; on an error every queued block's slot forgets it (the
/// front one's holds part of it; none behind it will be issued), each is
/// discarded, and the error returned.
fn pump<A: Api>(engine: &Engine<A>, st: &mut State<A>, through: usize) -> Result<(), OffloadError> {
    let issued = pump_queue(engine, st, through);
    forget_queue_on_error(st, issued)
}

/// One part of the queue's front entry, waiting for its fill (a pinned
/// entry whole), then what is filled after it: the last post-forward's
/// step, so that it returns at most one part's fill after the kernels it
/// runs beside. On an error see [`pump`].
fn pump_part<A: Api>(engine: &Engine<A>, st: &mut State<A>) -> Result<(), OffloadError> {
    let issued = match st
        .host_staging
        .as_ref()
        .and_then(|s| s.queue.front().copied())
    {
        Some(
            front @ Queued {
                staged: Some(part), ..
            },
        ) => issue_staged(engine, st, front, part, 1).and_then(|_| pump_queue(engine, st, 0)),
        Some(_) => pump_queue(engine, st, 1),
        None => Ok(()),
    };
    forget_queue_on_error(st, issued)
}

/// The most pauses ([`Device::host_pause`]) the last post-forward's loop
/// takes while it waits for a staging buffer or the last block's kernels:
/// about a second of pauses on a real device, far beyond a block's
/// kernels; it then leaves the queue to the next forward's hooks.
const MAX_STEP_END_PAUSES: u64 = 1_000_000 / crate::device::HOST_PAUSE_US;

/// Whether the queue's front part can be issued without the host waiting
/// for the copy stream ([`StagingRing::lands_without_copy_wait`]): a
/// pinned entry's copy is only enqueued. The last post-forward's loop
/// stops where it cannot: the wait would be for copies queued ahead of
/// that part's staging buffer, not for a fill, and would outlast the last
/// block's kernels (on the simulator 1.050 of the limit at 11,264 tokens
/// and 16 GiB, against 1.0015 for a caller that does not wait).
fn front_lands_without_copy_wait<A: Api>(st: &State<A>) -> bool {
    let Some(s) = st.host_staging.as_ref() else {
        return false;
    };
    match s.queue.front() {
        None => false,
        Some(Queued { staged: None, .. }) => true,
        Some(
            q @ Queued {
                staged: Some(part), ..
            },
        ) => s
            .ring
            .lands_without_copy_wait((q.ring, q.source, part.unwrap_or(0)), s.next),
    }
}

/// On an error every queued block's slot forgets it (the front one's
/// holds part of it; none behind it will be issued), each is discarded,
/// and the error returned.
fn forget_queue_on_error<A: Api>(
    st: &mut State<A>,
    issued: Result<(), OffloadError>,
) -> Result<(), OffloadError> {
    issued.inspect_err(|_| {
        let queued: Vec<Queued> = st
            .host_staging
            .as_mut()
            .map(|s| s.queue.drain(..).collect())
            .unwrap_or_default();
        for p in queued {
            if st.table.stamp(p.k) == Some((p.ring, p.block)) {
                if st.in_flight(p.ring, p.block) {
                    let unit = st.rings[p.ring].blocks[p.block].unit.clone();
                    let _ = st.placement.transition(&unit, Transition::Discard);
                }
                st.table.evict_unchecked(p.k, p.ring, p.block);
            }
        }
    })
}

/// The place in the queue of the entry `matches` picks, if any.
fn queued_at<A: Api>(st: &State<A>, matches: impl Fn(&Queued) -> bool) -> Option<usize> {
    st.host_staging
        .as_ref()
        .and_then(|s| s.queue.iter().position(matches))
}

/// Issues every queued fill, waiting for their fills, and records their
/// slots' `ready`: called before anything that is not queued is enqueued
/// on the copy stream, and wherever every block must be in (fills that
/// are not prefetches, a pool change). On an error see [`pump`].
fn settle<A: Api>(engine: &Engine<A>, st: &mut State<A>) -> Result<(), OffloadError> {
    pump(engine, st, usize::MAX)
}

/// Issues the queue through the entry `matches` picks, waiting for its
/// fills (and those before it), and whatever is filled after it: what
/// compute needs before it waits for that entry's slot's `ready`.
fn settle_through<A: Api>(
    engine: &Engine<A>,
    st: &mut State<A>,
    matches: impl Fn(&Queued) -> bool,
) -> Result<(), OffloadError> {
    let through = queued_at(st, matches).map_or(0, |at| at + 1);
    pump(engine, st, through)
}

/// Fills block `block` of `ring` into a slot through the ring's transport;
/// returns the slot.
fn fill<A: Api>(
    engine: &Engine<A>,
    st: &mut State<A>,
    ring: usize,
    block: usize,
    kind: FillKind,
) -> Result<usize, OffloadError> {
    let source = if engine.bug(PlantedBug::WrongMaster) {
        (block + 1) % st.rings[ring].blocks.len()
    } else {
        block
    };
    let transport = if st.rings[ring].gathered {
        Transport::Gather
    } else if st.rings[ring].blocks[source].coded.is_some() {
        // A coded master, pinned, registered or staged.
        Transport::Decode
    } else if matches!(*st.rings[ring].blocks[source].host, HostMaster::Staged(_)) {
        Transport::Stage
    } else {
        Transport::Copy
    };
    let prefetch = matches!(kind, FillKind::Prefetch { .. });
    // A raw prefetch joins the queue behind the staged blocks the copy
    // stream takes first (a pinned one only where something is queued),
    // so the hook goes on without waiting for their fills. Where the slot
    // it takes holds a queued block (discarded below), that block's copy
    // still runs first, and this one's overwrites it in the copy stream's
    // order, its `ready` recorded after. Anything else issues after every
    // queued block: the copy stream is in order.
    let queue = prefetch
        && matches!(transport, Transport::Stage | Transport::Copy)
        && !engine.bug(PlantedBug::StaticSlot)
        && st.host_staging.is_some();
    if !queue {
        settle(engine, st)?;
    }
    let (k, previous) = choose(engine, st, ring, block)?;
    // The slot's previous content is gone: a prefetch nobody consumed
    // is discarded.
    if let Some((r, b)) = previous
        && st.in_flight(r, b)
        && !engine.bug(PlantedBug::IgnoreRingStamp)
    {
        let old = st.rings[r].blocks[b].unit.clone();
        st.placement.transition(&old, Transition::Discard)?;
    }
    let skip_wait = engine.bug(PlantedBug::SkipLastUseWait)
        || (kind == FillKind::OnDemand && engine.bug(PlantedBug::OnDemandSkipLastUseWait))
        || (kind == (FillKind::Prefetch { wrap: true })
            && engine.bug(PlantedBug::WrapAroundSkipLastUseWait));
    let queued = st
        .host_staging
        .as_ref()
        .is_some_and(|s| !s.queue.is_empty());
    match (transport, st.host_staging.as_mut()) {
        (Transport::Copy, Some(staging)) if queue && queued => {
            staging.queue.push_back(Queued {
                ring,
                block,
                source,
                k,
                wait_last_use: !skip_wait,
                kind,
                staged: None,
            });
        }
        _ => transport.transfer(engine, st, (ring, block, source), k, (kind, !skip_wait))?,
    }
    let unit = st.rings[ring].blocks[block].unit.clone();
    if !(st.in_flight(ring, block) && engine.bug(PlantedBug::IgnoreRingStamp)) {
        st.placement.transition(&unit, Transition::IssueCopy)?;
    }
    st.table.filled(k, ring, block);
    st.filled_into[ring][block] = Some(k);
    // A prefetch issues what is filled and leaves the rest queued; any
    // other fill is read (or handed back) right after it.
    if prefetch {
        pump(engine, st, 0)?;
    } else {
        settle(engine, st)?;
    }
    Ok(k)
}

/// The slot to fill: the least recently filled free one that the ring's
/// transport may take (or, with the `StaticSlot` planted bug, the block's
/// index modulo the slot count, in use or not).
fn choose<A: Api>(
    engine: &Engine<A>,
    st: &mut State<A>,
    ring: usize,
    block: usize,
) -> Result<(usize, Option<(usize, usize)>), OffloadError> {
    if engine.bug(PlantedBug::StaticSlot) {
        let global = st.rings[..ring]
            .iter()
            .map(|r| r.blocks.len())
            .sum::<usize>()
            + block;
        let k = global % st.slots.len();
        return Ok((k, st.table.evict_unchecked(k, ring, block)));
    }
    if st.slots.is_empty() {
        return Err(OffloadError::Forward {
            module: st.rings[ring].blocks[block].unit.name.clone(),
            reason: "its ring has no slots now: a planned backend allocates a phase's slots when its component's forward begins; run a block's forward inside its component's".to_owned(),
        });
    }
    let k = st.victim(ring).ok_or_else(|| OffloadError::Forward {
        module: st.rings[ring].blocks[block].unit.name.clone(),
        reason: format!(
            "all {} slots are in use or hold gathered blocks in flight (nested block forwards?)",
            st.slots.len()
        ),
    })?;
    Ok((k, st.table.evict(k, ring, block)))
}

/// Frees everything `st` holds, after draining every stream (unless
/// `drain` is false, which only planted bugs ask for). If draining fails,
/// everything is leaked (the device may still touch it) and the error
/// returned; otherwise every free runs and the first error is returned.
/// Masters shared with a planned backend's store are left to the store.
fn release_state<A: Api>(
    engine: &Engine<A>,
    mut st: State<A>,
    drain: bool,
) -> Result<(), OffloadError> {
    let h = &engine.handles;
    // The filler thread first (its queued fills run to the end): a drain
    // that fails leaks the state, and would leave the thread parked in it.
    if let Some(staging) = st.host_staging.as_mut() {
        staging.ring.stop();
    }
    let leak = engine.bug(PlantedBug::LeakHostMasters);
    h.release(&engine.strategy.to_string(), st, drain, |st, first| {
        // Placement holds references to the buffers: drop it first.
        drop(st.placement);
        for slot in st.slots {
            if let Err(e) = h.free(slot.buffer, &[&slot.ready, &slot.last_use], "slot") {
                first.get_or_insert(e);
            }
        }
        for shard in st.gather.into_iter().flat_map(|g| g.shards) {
            if let Err(e) = h.free(shard.buffer, &[&shard.copied, &shard.consumed], "shard") {
                first.get_or_insert(e);
            }
        }
        for staging in st.decoding.into_iter().flat_map(|d| d.staging) {
            if let Err(e) = h.free(
                staging.buffer,
                &[&staging.copied, &staging.consumed],
                "staging",
            ) {
                first.get_or_insert(e);
            }
        }
        if let Some(staging) = st.host_staging {
            free_staging_ring(h, staging.ring, false, first);
        }
        h.free_all(st.resident, "resident unit", first);
        for master in st
            .rings
            .into_iter()
            .flat_map(|r| r.blocks)
            .map(|m| m.host)
            .chain(st.shadow_masters.into_iter().map(Arc::new))
        {
            if leak {
                std::mem::forget(master);
                continue;
            }
            // A master shared with a planned backend's store is freed
            // by the store, after its last ring is gone.
            let Ok(master) = Arc::try_unwrap(master) else {
                continue;
            };
            // SAFETY: every stream was drained (`release` runs this only
            // after a successful drain, or for a planted bug), so no copy
            // reads the master any more.
            if let Err(e) = unsafe { h.free_master(master) } {
                first.get_or_insert(e);
            }
        }
    })
}

/// Frees a staging ring's buffers: the filler stops first (its queued
/// fills run to the end), then each buffer is freed, after its `copied`
/// event where `wait` (else the caller drained every stream); the first
/// error is kept in `first`. A filler that still holds the buffers (it
/// panicked), or a buffer whose last copy cannot be waited for, leaks,
/// logged.
pub(crate) fn free_staging_ring<A: Api>(
    h: &Handles<A>,
    ring: StagingRing<A>,
    wait: bool,
    first: &mut Option<OffloadError>,
) {
    match ring.into_stages() {
        Some(stages) => {
            for (buffer, copied) in stages {
                if wait && let Err(e) = h.device.synchronize_event(&copied) {
                    first.get_or_insert(dev_err("synchronize_event(host staging copied)", e));
                    tracing::error!(
                        "a host staging buffer's last copy could not be waited for; leaking it"
                    );
                    std::mem::forget(buffer);
                    continue;
                }
                // SAFETY: its last copy completed (waited for above, or every
                // stream drained by the caller) and the filler has stopped,
                // so no copy or fill uses the buffer.
                if let Err(e) = unsafe { h.device.free_pinned(buffer) } {
                    first.get_or_insert(dev_err("free_pinned(host staging)", e));
                }
                drop(copied);
            }
        }
        None => {
            tracing::error!("the staging fill thread still holds its buffers; leaking them")
        }
    }
}

// The most pinned bytes a ring made only for refused uploads takes (the
// upload runs in chunks of it).
use crate::budget::host::UPLOAD_STAGING_BYTES;

/// The host plan of `layout`'s streamed blocks under `config`'s
/// `host_budget`, `transient` the largest resident unit (uploaded through
/// pinned memory at enable), `pin` false where every master is staged.
fn host_plan(
    config: &OffloadConfig,
    blocks: &[crate::budget::HostBlock],
    transient: u64,
    pin: bool,
) -> Result<crate::budget::HostPlan, OffloadError> {
    let limits = match config.host_budget {
        Some(budget) => Some(
            crate::budget::host_limits(budget, &crate::budget::host::ProcProbe::default())
                .map_err(|e| {
                    OffloadError::Config(Box::new(crate::config::ConfigError::Invalid {
                        key: "host_budget".to_owned(),
                        value: format!("\"{budget}\""),
                        allowed: format!("a size on this machine ({e})"),
                    }))
                })?,
        ),
        None => None,
    };
    let plan = crate::budget::plan_host(blocks, transient, limits.as_ref().map(|l| l.budget), pin)
        .map_err(|e| {
            OffloadError::Config(Box::new(crate::config::ConfigError::Invalid {
                key: "host_budget".to_owned(),
                value: config
                    .host_budget
                    .map_or_else(String::new, |b| format!("\"{b}\"")),
                allowed: format!("at least {} on this pipeline ({e})", e.least),
            }))
        })?;
    if let Some(l) = &limits {
        tracing::info!(
            budget = l.budget,
            pinned_bytes = plan.pinned_bytes,
            staged_bytes = plan.staged_bytes,
            staging_bytes = plan.staging_bytes,
            least_budget = plan.least_budget,
            "host budget {} ({}): {} of masters pinned or registered, {} staged through {} of staging buffers; the least host budget these blocks need is {}",
            crate::bytes::ByteSize::new(l.budget),
            l.source,
            crate::bytes::ByteSize::new(plan.pinned_bytes),
            crate::bytes::ByteSize::new(plan.staged_bytes),
            crate::bytes::ByteSize::new(plan.staging_bytes),
            crate::bytes::ByteSize::new(plan.least_budget),
        );
    }
    Ok(plan)
}

/// The staging ring of `rings`, where any master is staged: the pinned
/// buffers [`crate::budget::host::staging_layout`] gives for the largest
/// staged block (two whole blocks, or parts: eight under a host budget,
/// `budgeted`, else two blocks' worth), each staged block's pages
/// released after its read where `release`.
fn host_staging_of<A: Api>(
    h: &Handles<A>,
    rings: &[Ring<A>],
    (release, budgeted): (bool, bool),
) -> Result<Option<HostStaging<A>>, OffloadError> {
    let largest_staged = rings
        .iter()
        .flat_map(|r| &r.blocks)
        .filter_map(|m| match &*m.host {
            HostMaster::Staged(s) => Some(s.bytes),
            _ => None,
        })
        .max();
    let Some(bytes) = largest_staged else {
        return Ok(None);
    };
    let layout = crate::budget::host::staging_layout(bytes, budgeted);
    let ring = staging_ring(h, layout.part_bytes, layout.buffers as usize)?;
    // The fill rate forecasts read is the last pass's: a pass of a ring
    // fills each of its staged blocks once. The largest ring's pass, so
    // that a ring run once a request beside one run every step leaves no
    // cold first fills in the window.
    ring.set_fill_window(
        rings
            .iter()
            .map(|r| r.blocks.iter().map(|m| staged_len(m)).sum::<u64>())
            .max()
            .unwrap_or(0),
    );
    Ok(Some(HostStaging {
        ring,
        next: 0,
        release,
        queue: VecDeque::new(),
        pass_end: None,
        end_waited: vec![false; rings.len()],
    }))
}

/// Stages further pinned raw blocks of `rings` until the page-locked peak
/// (every master these handles hold, the staging ring of the largest
/// staged block, the `transient` upload buffer) fits `budget`
/// ([`crate::budget::host::restage_within`]); a typed error where no choice
/// fits. No engine holds the masters yet. Returns whether the store as
/// built must release its staged pages after each read
/// ([`crate::budget::host::built_release`]).
fn restage_rings<A: Api>(
    h: &Handles<A>,
    rings: &mut [Ring<A>],
    (budget, transient): (u64, u64),
    auto: bool,
    tally: &mut StagedTally,
) -> Result<bool, OffloadError> {
    use crate::budget::host::{BuiltBlock, built_release, restage_within};
    let blocks: Vec<BuiltBlock> = rings
        .iter()
        .flat_map(|r| &r.blocks)
        .map(|m| {
            let staged = match &*m.host {
                HostMaster::Staged(s) => Some(s.bytes),
                _ => None,
            };
            let len = m.host.len_bytes();
            BuiltBlock {
                // `"auto"` may turn a coded master raw after this.
                pinned: if auto && m.coded.is_some() && staged.is_none() {
                    len.max(m.unit.bytes)
                } else {
                    len
                },
                staged: staged.unwrap_or(m.unit.bytes),
                is_staged: staged.is_some(),
                // Only a pinned copy we made: a registered master is the
                // loader's memory, which a staged master could not read.
                may_stage: matches!(&*m.host, HostMaster::Pinned(_))
                    && Arc::strong_count(&m.host) == 1
                    && m.coded.is_none()
                    && m.shard.is_none(),
            }
        })
        .collect();
    let in_rings = rings
        .iter()
        .flat_map(|r| &r.blocks)
        .fold(0u64, |a, m| a.saturating_add(m.host.len_bytes()));
    let all = h.host_masters();
    let others = all
        .copied_bytes
        .saturating_add(all.in_place_bytes)
        .saturating_sub(in_rings);
    let more = restage_within(budget, others.saturating_add(transient), &blocks)
        .map_err(|e| OffloadError::Config(Box::new(e.into_config_error())))?;
    let release = built_release(budget, others.saturating_add(transient), &blocks, &more);
    for (k, m) in rings.iter_mut().flat_map(|r| &mut r.blocks).enumerate() {
        if !more.contains(&k) {
            continue;
        }
        // SAFETY: no engine is built yet: no copy reads the master.
        unsafe {
            h.restage(&mut m.host, &m.unit.name, || {
                staged_master(
                    h,
                    &m.unit,
                    None,
                    crate::budget::StageReason::Restaged,
                    tally,
                )
            })
        }?;
    }
    Ok(release)
}

/// The one pinned upload buffer that uploads from pageable memory go
/// through (CONTRACT §7c): a ring of one buffer of the largest unit it
/// carries, `largest`, at most [`UPLOAD_STAGING_BYTES`] (larger units go
/// in chunks).
pub(crate) fn upload_ring<A: Api>(
    h: &Handles<A>,
    largest: u64,
) -> Result<StagingRing<A>, OffloadError> {
    staging_ring(h, largest.clamp(1, UPLOAD_STAGING_BYTES), 1)
}

/// A staging ring of up to `buffers` pinned buffers of `bytes`, each
/// asked for up to three times (a platform that limits pinned memory may
/// refuse one request and grant the next); fewer where a later one is
/// refused (the host then waits for each staged copy before the next
/// fill, logged), an error where the first is.
pub(crate) fn staging_ring<A: Api>(
    h: &Handles<A>,
    bytes: u64,
    buffers: usize,
) -> Result<StagingRing<A>, OffloadError> {
    let mut stages = Vec::new();
    for j in 0..buffers {
        let copied = h
            .device
            .create_event()
            .map_err(|e| dev_err("create_event", e))?;
        let mut last = None;
        for _ in 0..3 {
            match h.device.alloc_pinned(bytes) {
                Ok(buffer) => {
                    stages.push((buffer, copied));
                    last = None;
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        if let Some(e) = last {
            if j == 0 {
                // Dropped buffers free themselves (after a device
                // synchronisation).
                return Err(dev_err(
                    format!(
                        "alloc_pinned({bytes} bytes) for a host staging buffer (staged masters and refused uploads stream through pinned staging buffers, CONTRACT §7c)"
                    ),
                    e,
                ));
            }
            tracing::warn!(
                "host staging buffer {} of {bytes} bytes was refused ({e}); staged blocks stream through {j} (each fill waits for the previous staged copy)",
                j + 1
            );
            break;
        }
    }
    Ok(StagingRing::new(
        Arc::clone(&h.device),
        Arc::clone(&h.weights),
        stages,
        fill_threads(),
    ))
}

/// What staging decided at enable, for its log lines.
#[derive(Default)]
struct StagedTally {
    units: usize,
    bytes: u64,
    /// Of them, coded (their coded bytes staged).
    coded_units: usize,
    refused: usize,
    /// A host budget is set: no master or upload registers a window of a
    /// mapping the device would lock whole.
    budget_set: bool,
    /// Layerwise (not DLO's rank-local rings): a refused pin stages.
    may_stage: bool,
    /// The host plan releases staged blocks' pages after each read.
    release: bool,
    /// `staged_reads = "in_place"`, on a device that reads pageable
    /// memory: a raw staged block that is a window of the weight source's
    /// mapping is read there by the device.
    in_place: bool,
    /// Of `units`, those read in place.
    read_in_place: usize,
}

impl StagedTally {
    fn log(&self, plan: &crate::budget::HostPlan) {
        if self.units > 0 {
            tracing::info!(
                staged_units = self.units,
                staged_bytes = self.bytes,
                coded_units = self.coded_units,
                refused = self.refused,
                read_in_place = self.read_in_place,
                "{} streamed blocks ({} bytes, {} of them coded) stay in pageable memory, {} read in place by the device and the rest streamed through pinned staging buffers ({} refused by the device; planned: {} pinned, {} staged)",
                self.units,
                self.bytes,
                self.coded_units,
                self.read_in_place,
                self.refused,
                plan.pinned_bytes,
                plan.staged_bytes
            );
        }
    }
}

/// Whether `staged_reads = "in_place"` (CONTRACT §7c) holds here; a typed
/// error where the device cannot read pageable memory.
pub(crate) fn in_place_reads<A: Api>(
    config: &OffloadConfig,
    device: &A::Device,
) -> Result<bool, OffloadError> {
    match config.staged_reads.unwrap_or_default() {
        crate::config::StagedReads::Fill => Ok(false),
        crate::config::StagedReads::InPlace if device.reads_pageable() => Ok(true),
        crate::config::StagedReads::InPlace => Err(OffloadError::Config(Box::new(
            crate::config::ConfigError::Invalid {
                key: "staged_reads".to_owned(),
                value: "\"in_place\"".to_owned(),
                allowed: "\"fill\" on this device: it does not read pageable memory where it lies (Device::reads_pageable; CUDA needs pageable memory access: HMM with the open kernel modules, or ATS)".to_owned(),
            },
        ))),
    }
}

/// The window of `unit` the device may read in place, where the weight
/// source lends one: a read-only file window of exactly the unit's bytes
/// (an anonymous page the device touches may migrate to device memory no
/// budget counts).
fn in_place_window<A: Api>(
    h: &Handles<A>,
    unit: &Unit,
) -> Option<std::sync::Arc<dyn crate::device::HostRegion>> {
    h.weights
        .pageable_window(unit)
        .filter(|w| w.read_only() && w.bytes().len() as u64 == unit.bytes)
}

/// The window the host plan took for a block under `staged_reads =
/// "in_place"` (CONTRACT §7c): `Some` holds its answer (`None` inside
/// where the source lent no window), so the weight source is asked once
/// for a block the plan stages; `None` where the plan's answer is not
/// carried (a block it coded first, and a block staged only after the
/// plan, refused or restaged, which asks again).
type PlannedWindow = Option<Option<std::sync::Arc<dyn crate::device::HostRegion>>>;

/// A staged master of `unit` (counted, logged with `why`), read in place
/// from `window` where the plan took one.
fn staged_master<A: Api>(
    h: &Handles<A>,
    unit: &Unit,
    window: PlannedWindow,
    why: crate::budget::StageReason,
    tally: &mut StagedTally,
) -> HostMaster<A> {
    staged_of(h, unit, None, window, why, tally)
}

/// A staged master of `unit`'s bytes, or of its coded bytes `coded`
/// (counted, logged with `why`); under `staged_reads = "in_place"` read
/// where it lies from the plan's `window`, or from the source's where the
/// plan took none.
fn staged_of<A: Api>(
    h: &Handles<A>,
    unit: &Unit,
    coded: Option<std::sync::Arc<dyn crate::device::HostRegion>>,
    window: PlannedWindow,
    why: crate::budget::StageReason,
    tally: &mut StagedTally,
) -> HostMaster<A> {
    let bytes = coded
        .as_ref()
        .map_or(unit.bytes, |c| c.bytes().len() as u64);
    tally.units += 1;
    tally.bytes += bytes;
    if tally.in_place && coded.is_none() {
        let window = match window {
            Some(planned) => planned,
            _ => in_place_window(h, unit),
        };
        match window {
            Some(window) => {
                tally.read_in_place += 1;
                tracing::info!(unit = %unit.name, bytes, reason = %why, "`{}` streams staged, read in place by the device ({why})", unit.name);
                return h.counted(HostMaster::Pageable(window));
            }
            None => {
                tracing::info!(unit = %unit.name, bytes, reason = %why, "`{}` streams staged through the staging ring ({why}): the weight source holds it in no mapped window the device could read in place", unit.name);
            }
        }
    }
    tally.coded_units += usize::from(coded.is_some());
    if coded.is_some() {
        tracing::info!(unit = %unit.name, bytes, reason = %why, "`{}` streams staged, coded ({bytes} of {} bytes; {why})", unit.name, unit.bytes);
    } else {
        tracing::info!(unit = %unit.name, bytes, reason = %why, "`{}` streams staged ({why})", unit.name);
    }
    h.counted(HostMaster::Staged(crate::runtime::shared::Staged {
        bytes,
        coded,
    }))
}

/// A staged master of `unit`'s coded bytes (CONTRACT §7b, §7c), where the
/// weight source holds them in `codec`'s format (a coded-block file) at no
/// more than the unit's own bytes (so the staging ring's bound holds): the
/// window stays pageable, never registered, and each fill copies it into
/// a host staging buffer; with the decode's work items. `None` otherwise
/// (the block then stages raw).
fn staged_coded_master<A: Api>(
    h: &Handles<A>,
    unit: &Unit,
    coded: Option<crate::runtime::backend::CodedRegion>,
    why: crate::budget::StageReason,
    tally: &mut StagedTally,
) -> Option<(HostMaster<A>, (u64, u64))> {
    let coded = coded?;
    let len = coded.region.bytes().len() as u64;
    if len > unit.bytes {
        tracing::debug!(unit = %unit.name, "the coded `{}` takes {len} bytes, more than its {} raw: it stages raw", unit.name, unit.bytes);
        return None;
    }
    let region: std::sync::Arc<dyn crate::device::HostRegion> = coded.region.into();
    Some((
        staged_of(h, unit, Some(region), None, why, tally),
        (len, coded.work),
    ))
}

/// Uploads `unit` to a new device buffer through the staging ring's first
/// buffer, a chunk at a time (enable only: the host waits for each chunk's
/// copy before refilling the buffer). Nothing is left allocated on failure.
pub(crate) fn upload_staged<A: Api>(
    h: &Handles<A>,
    unit: &Unit,
    staging: &StagingRing<A>,
) -> Result<A::DeviceBuffer, OffloadError> {
    let buffer = h.device.alloc_device(unit.bytes).map_err(|e| {
        dev_err(
            format!("alloc_device({} bytes) for `{}`", unit.bytes, unit.name),
            e,
        )
    })?;
    h.device.name_buffer(&buffer, &unit.name);
    let threads = fill_threads();
    let copy = |stage: &mut crate::runtime::filler::Stage<A>| -> Result<(), OffloadError> {
        let chunk = stage.buffer.len_bytes().max(1);
        let mut at = 0;
        while at < unit.bytes {
            let len = chunk.min(unit.bytes - at);
            h.device
                .synchronize_event(&stage.copied)
                .map_err(|e| dev_err("synchronize_event(host staging copied)", e))?;
            stage.buffer.write_from(
                0,
                len,
                &Offset(
                    &ParallelUnitBytes {
                        weights: &*h.weights,
                        unit,
                        threads,
                        pool: staging.pool(),
                        direct: false,
                    },
                    at,
                ),
            );
            // SAFETY: `len` ≤ the staging buffer and `at + len` ≤ the new
            // buffer of `unit.bytes`; the host filled the staging buffer
            // after its last copy completed and waits for `copied`
            // (recorded next) before refilling it; the device buffer is
            // lent only after the copy stream is synchronised below.
            unsafe {
                h.device.copy_h2d(
                    &h.copy,
                    crate::device::HostSource::Pinned(&stage.buffer),
                    0,
                    &buffer,
                    at,
                    len,
                )
            }
            .map_err(|e| dev_err(format!("copy_h2d of `{}` (staged upload)", unit.name), e))?;
            h.device
                .record_event(&stage.copied, &h.copy)
                .map_err(|e| dev_err("record_event(host staging copied)", e))?;
            at += len;
        }
        h.device
            .synchronize_stream(&h.copy)
            .map_err(|e| dev_err("synchronize_stream(copy)", e))
    };
    let copied = staging.with_filled(0, copy);
    // Its bytes are replaced: no staged part is held there any more.
    staging.forget(0);
    match copied {
        Ok(()) => Ok(buffer),
        Err(e) => {
            if h.device.synchronize_stream(&h.copy).is_ok() {
                // SAFETY: the copy stream is drained: nothing uses `buffer`.
                let _ = unsafe { h.device.free_device(buffer, &[]) };
            } else {
                tracing::error!(
                    "staged upload of `{}`: {e}; leaking its device buffer",
                    unit.name
                );
                std::mem::forget(buffer);
            }
            Err(e)
        }
    }
}

/// The pinned or registered master of `unit`, or a staged one where the
/// device refuses to pin it (out of memory, a platform that refuses):
/// the block then streams through the staging ring (CONTRACT §7c). A lost
/// device is still an error.
fn pinned_or_staged<A: Api>(
    h: &Handles<A>,
    unit: &Unit,
    skip: &BTreeSet<StorageId>,
    tally: &mut StagedTally,
) -> Result<HostMaster<A>, OffloadError> {
    // Under a host budget, a pinned block is never a window of a mapping
    // the device would lock whole (the checkpoint, staged blocks and all):
    // it is copied.
    match h.master_within(unit, skip, !tally.budget_set) {
        Ok(m) => {
            // A copy read from a mapped source: where staged pages are
            // released (a checkpoint larger than the budget), its pages go
            // too, the pinned copy holding its bytes.
            if tally.release && matches!(m, HostMaster::Pinned(_)) {
                h.weights.release(unit);
            }
            Ok(m)
        }
        Err(OffloadError::DeviceOp { kind, cause, .. })
            if kind != crate::device::DeviceErrorKind::DeviceLost
                && skip.is_empty()
                && tally.may_stage =>
        {
            tracing::warn!(unit = %unit.name, "pinning `{}` was refused ({cause}); it streams staged", unit.name);
            tally.refused += 1;
            Ok(staged_master(
                h,
                unit,
                None,
                crate::budget::StageReason::Refused,
                tally,
            ))
        }
        Err(e) => Err(e),
    }
}

/// What a ring engine's transports beyond the copy need: the gather
/// group, the codec.
pub(crate) type Transports<A> = (Option<Arc<dyn Collective<A>>>, Option<Arc<dyn Codec<A>>>);

/// Staging buffers of a decoding engine: a copy may run one block ahead of
/// the decode reading the other.
pub(crate) const STAGING_BUFFERS: usize = 2;

/// What encoding at enable did, for its log line.
#[derive(Default)]
pub(crate) struct CodingTally {
    blocks: usize,
    /// Of `blocks`, those registered in place from a packed checkpoint.
    in_place: usize,
    /// Of `blocks`, those copied from a packed checkpoint into pinned
    /// memory (under a host budget).
    copied: usize,
    raw: usize,
    decoded: u64,
    coded: u64,
    seconds: f64,
}

impl CodingTally {
    /// Counts a block encoded on the host (its blob kept from the decode
    /// measurement, or encoded by the caller just now) and pinned now.
    pub(crate) fn encoded_before(&mut self, bytes: u64, coded: u64) {
        self.blocks += 1;
        self.decoded += bytes;
        self.coded += coded;
    }

    /// Adds the seconds an encode took (the caller timed it).
    pub(crate) fn add_seconds(&mut self, seconds: f64) {
        self.seconds += seconds;
    }

    /// Whether it counted anything.
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks == 0 && self.raw == 0
    }

    /// One `info` line, where a codec is set and a block was coded or
    /// left raw (not when `"auto"` left every ring raw before encoding:
    /// its own lines say so).
    pub(crate) fn log(&self, codec: Option<&dyn Codec<impl Api>>) {
        let Some(codec) = codec else { return };
        if self.is_empty() {
            return;
        }
        tracing::info!(
            blocks = self.blocks,
            in_place = self.in_place,
            raw_blocks = self.raw,
            bytes = self.decoded,
            coded_bytes = self.coded,
            seconds = self.seconds,
            "weight_compression: {} blocks coded ({}), {} of them registered in place from a packed checkpoint, {} copied from it into pinned memory and {} encoded at enable: {} of {} bytes ({:.4}) in {:.2} s; {} stream raw",
            self.blocks,
            codec.name(),
            self.in_place,
            self.copied,
            self.blocks - self.in_place - self.copied,
            self.coded,
            self.decoded,
            self.coded as f64 / self.decoded.max(1) as f64,
            self.seconds,
            self.raw
        );
    }
}

/// The coded master of `unit` ([`Handles::coded_master`]), or
/// [`CodedMaster::Raw`] (logged) where the codec refused it or its blob
/// exceeds [`coded_bound`] (then it is freed and the block streams raw), or
/// the coded bytes back where the device refused to pin them.
pub(crate) fn coded_master<A: Api>(
    h: &Handles<A>,
    unit: &Unit,
    spans: &[CodecSpan],
    codec: &dyn Codec<A>,
    packed: Option<crate::runtime::backend::CodedRegion>,
    tally: &mut CodingTally,
    whole_mappings: bool,
) -> Result<CodedMaster<A>, OffloadError> {
    let start = std::time::Instant::now();
    let made = h.coded_master(unit, spans, codec, packed, whole_mappings)?;
    tally.seconds += start.elapsed().as_secs_f64();
    tally.decoded += unit.bytes;
    let bound = coded_bound(unit.bytes, spans.len());
    match made {
        CodedMaster::Made(master, work, from) if master.len_bytes() <= bound => {
            tally.blocks += 1;
            tally.in_place += usize::from(from == CodedFrom::InPlace);
            tally.copied += usize::from(from == CodedFrom::Copied);
            tally.coded += master.len_bytes();
            Ok(CodedMaster::Made(master, work, from))
        }
        CodedMaster::Made(master, _, _) => {
            tracing::warn!(unit = %unit.name, "the {} codec gave `{}` {} bytes, above the bound of {bound} for {} bytes; it streams raw", codec.name(), unit.name, master.len_bytes(), unit.bytes);
            // SAFETY: no copy has read the master yet.
            unsafe { h.free_master(master) }?;
            tally.raw += 1;
            tally.coded += unit.bytes;
            Ok(CodedMaster::Raw)
        }
        CodedMaster::Raw => {
            tally.raw += 1;
            tally.coded += unit.bytes;
            Ok(CodedMaster::Raw)
        }
        // Staged coded (or, where its caller cannot stage, an error):
        // counted as coded, at its coded bytes.
        CodedMaster::PinRefused { coded, error } => {
            tally.blocks += 1;
            tally.coded += coded.region.bytes().len() as u64;
            Ok(CodedMaster::PinRefused { coded, error })
        }
    }
}

/// Each of `blocks`' compute in `inputs` (by path), for what `purpose`
/// reads; a typed error naming the first block without one.
fn ring_compute<'u>(
    inputs: &crate::budget::PlannerInputs,
    units: impl IntoIterator<Item = &'u Unit>,
    purpose: &str,
) -> Result<Vec<f64>, OffloadError> {
    units
        .into_iter()
        .map(|unit| {
            let path = &unit.name;
            inputs
                .components
                .values()
                .find_map(|c| c.block_compute_s.get(path).copied())
                .ok_or_else(|| {
                    OffloadError::Budget(Box::new(crate::budget::BudgetError::Input {
                        input: "planner inputs".to_owned(),
                        value: format!("no compute for block `{path}`"),
                        allowed: format!(
                            "every streamed block's compute (`block_compute_s`), which {purpose}"
                        ),
                    }))
                })
        })
        .collect()
}

/// Each block's copy of `bytes` over the inputs' link, its latency
/// included: what the recurrence's `copy_s` reads.
fn ring_copies(
    inputs: &crate::budget::PlannerInputs,
    bytes: impl IntoIterator<Item = u64>,
) -> Vec<f64> {
    let link = inputs.link_bytes_per_s.max(1.0);
    bytes
        .into_iter()
        .map(|b| inputs.copy_latency_s + b as f64 / link)
        .collect()
}

/// At a ring's first pre-forward (the first hook after any ring's pass
/// ended), whether the pass that ended last was waited for
/// ([`HostStaging::end_waited`]): its last block's kernels finished before
/// this hook ran. Judged before this hook's own work (a fill here would
/// pass the time). Where the last post-forward's loop ran until they had
/// finished, this reads as waited whatever the caller did: such a loop
/// ends at most one part's fill after them.
fn observe_pass_end<A: Api>(h: &Handles<A>, st: &mut State<A>) -> Result<(), OffloadError> {
    let Some((r, k)) = st.host_staging.as_mut().and_then(|s| s.pass_end.take()) else {
        return Ok(());
    };
    let Some(slot) = st.slots.get(k) else {
        return Ok(());
    };
    let waited = h
        .device
        .event_done(&slot.last_use)
        .map_err(|e| dev_err("event_done(last use)", e))?;
    if let Some(w) = st
        .host_staging
        .as_mut()
        .and_then(|s| s.end_waited.get_mut(r))
    {
        if *w != waited {
            tracing::debug!(
                ring = r,
                waited,
                "the ring's last pass's end was {}waited for: its last post-forward {} the staged queue while its last block computes",
                if waited { "" } else { "not " },
                if waited {
                    "issues"
                } else {
                    "leaves the next forward's hooks"
                }
            );
        }
        *w = waited;
    }
    Ok(())
}

/// The hook on one block.
struct BlockHook<A: Api> {
    engine: Arc<Engine<A>>,
    ring: usize,
    block: usize,
}

impl<A: Api> BlockHook<A> {
    fn pre(&self) -> Result<(), OffloadError> {
        let engine = &*self.engine;
        engine.check_poison()?;
        let h = &engine.handles;
        let mut guard = engine.lock();
        let st = guard.as_mut().ok_or_else(|| disabled(engine.strategy))?;
        let (r, i) = (self.ring, self.block);
        if i == 0 {
            observe_pass_end(h, st)?;
        }
        // This block's queued fill (and those before it) in whole before
        // its compute waits for its slot's `ready`; what is filled of the
        // rest (a planted bug issues only that).
        if engine.bug(PlantedBug::StagedReadyUnrecorded) {
            pump(engine, st, 0)?;
        } else {
            settle_through(engine, st, |q| (q.ring, q.block) == (r, i))?;
        }
        let unit = st.rings[r].blocks[i].unit.clone();
        let stamped = st.table.holding(r, i);
        let k = match (stamped, st.in_flight(r, i)) {
            (Some(k), true) => k,
            // Planted: trust the slot the block was filled into, though
            // another ring may have refilled it since.
            (None, true) if engine.bug(PlantedBug::IgnoreRingStamp) => {
                let k = st.filled_into[r][i].expect("an in-flight block was filled");
                st.table.evict_unchecked(k, r, i);
                st.table.filled(k, r, i);
                k
            }
            // Not materialised (its ring's first forward, a hook skipped the
            // predecessor, another ring took the slot, or the block runs
            // twice): fill on demand.
            _ => fill(engine, st, r, i, FillKind::OnDemand)?,
        };
        let read_slot = if engine.bug(PlantedBug::WrongSlot) {
            (k + 1) % st.table.len()
        } else {
            k
        };
        st.table.acquire(k);
        if !engine.bug(PlantedBug::SkipReadyWait) {
            h.device
                .stream_wait_event(&h.compute, &st.slots[k].ready)
                .map_err(|e| dev_err("stream_wait_event(compute, ready)", e))?;
        }
        if engine.bug(PlantedBug::LastUseBeforeCompute) {
            h.device
                .record_event(&st.slots[k].last_use, &h.compute)
                .map_err(|e| dev_err("record_event(last use)", e))?;
        }
        st.placement.transition(&unit, Transition::CopyDone)?;
        let buffer = Arc::clone(&st.slots[read_slot].buffer);
        st.placement.place(&unit, &buffer);
        if engine.bug(PlantedBug::ShiftedPlacement) {
            st.placement.shift_second_entry(&unit, 2);
        }
        let n = st.rings[r].blocks.len();
        let mut ahead: Vec<usize> = (1..=st.depth.min(n - 1)).collect();
        if engine.bug(PlantedBug::DivergentCollectiveOrder) && engine.rank % 2 == 1 {
            ahead.reverse();
        }
        for j in ahead {
            let b = (i + j) % n;
            let ready = st.table.holding(r, b).is_some() && st.in_flight(r, b);
            // Prefetch only into a slot this ring's transport may take; with
            // none (another ring's block is being read, or gathered blocks
            // in flight fill the others) the block is filled on demand.
            if !ready && (st.victim(r).is_some() || engine.bug(PlantedBug::StaticSlot)) {
                fill(engine, st, r, b, FillKind::Prefetch { wrap: b < i })?;
            }
        }
        Ok(())
    }

    fn post(&self) -> Result<(), OffloadError> {
        let engine = &*self.engine;
        engine.check_poison()?;
        let h = &engine.handles;
        let mut guard = engine.lock();
        let st = guard.as_mut().ok_or_else(|| disabled(engine.strategy))?;
        let unit = st.rings[self.ring].blocks[self.block].unit.clone();
        let mut used = None;
        let released = match st.table.release(self.ring, self.block) {
            Some(k) => {
                if !engine.bug(PlantedBug::LastUseBeforeCompute) {
                    h.device
                        .record_event(&st.slots[k].last_use, &h.compute)
                        .map_err(|e| dev_err("record_event(last use)", e))?;
                    used = Some(k);
                }
                true
            }
            // Planted: a static slot choice refilled the slot under this
            // block; it no longer holds it, and its last use goes unrecorded.
            None if engine.bug(PlantedBug::StaticSlot) => true,
            None => false,
        };
        if released {
            st.placement.unplace(&unit);
            st.placement.transition(&unit, Transition::Release)?;
        }
        // The queued fills: what is filled is issued now, once this block's
        // kernels are enqueued, and after this block is released, so that
        // a failed part leaves it released. The rest wait for a later hook;
        // but the ring's last block is where the caller may wait for the
        // forward (a step's end), and then no hook runs until the next
        // forward starts. Where the last pass's end was seen to be waited
        // for ([`HostStaging::end_waited`]), the queue is issued part by
        // part as the fills land while this block's kernels run (the next
        // pass's first blocks copy beside them; on the simulator's one host
        // clock the fills run here, in host time the wait would idle), and
        // what is left once they have is left to the next forward's hooks
        // (waiting for it all idled the simulated device for a deep
        // look-ahead's fills: 1.06 at 12,288 tokens, depth 12). Where the
        // caller does not wait, the next forward's hooks issue the queue
        // as soon: a fill here would be host time taken from them (on the
        // simulator 1.3-1.4 % at 13,312-15,360 tokens, up to 3.5 % at
        // 8 GiB with fills at 35 GB/s), and on a filler thread the hook's
        // thread would spin while the host could issue kernels. Without
        // this loop a caller that waits (offload-bench) lost the deep
        // look-ahead's gain: an H100 at 10,752 tokens and 8 GiB ran
        // 1.116-1.129 of the limit at depths 4 and 8 with compute idle
        // 58 ms a step (a579936; 1.019-1.031 at depth 8 with it, 771b845),
        // and the simulator with a step-end wait up to 1.198 (planted
        // `StepEndLeavesQueue` in offload-sim's step-end sweep).
        if let Some(k) = used
            && self.block + 1 == st.rings[self.ring].blocks.len()
            && let Some(s) = st.host_staging.as_mut()
        {
            s.pass_end = Some((self.ring, k));
            if s.end_waited[self.ring] && !engine.bug(PlantedBug::StepEndLeavesQueue) {
                let waits_on_copies = engine.bug(PlantedBug::StepEndWaitsOnCopies);
                let mut pauses = 0u64;
                while st
                    .host_staging
                    .as_ref()
                    .is_some_and(|s| !s.queue.is_empty())
                    && !h
                        .device
                        .event_done(&st.slots[k].last_use)
                        .map_err(|e| dev_err("event_done(last use)", e))?
                {
                    if waits_on_copies || front_lands_without_copy_wait(st) {
                        pump_part(engine, st)?;
                    } else if pauses < MAX_STEP_END_PAUSES {
                        h.device.host_pause();
                        pauses += 1;
                    } else {
                        // A device whose kernels never finish while the
                        // host only polls: the next forward's hooks issue
                        // the rest.
                        break;
                    }
                }
            }
        }
        pump(engine, st, 0)
    }

    /// A failed hook of a multi-rank gathering backend leaves this rank's
    /// collectives out of step with the others': it poisons the backend.
    fn poison_on_error(&self, result: Result<(), OffloadError>) -> Result<(), OffloadError> {
        if let Err(e) = &result
            && self.engine.multi_rank()
            && !matches!(e, OffloadError::Poisoned { .. })
        {
            self.engine.set_poison(format!(
                "rank {} of {}: a forward failed ({e}); the ranks' collectives may be out of step",
                self.engine.rank, self.engine.group
            ));
        }
        result
    }
}

/// Storages only non-persistent buffers view.
fn non_persistent(p: &crate::model::Pipeline) -> BTreeSet<StorageId> {
    use crate::model::TensorKind;
    let persistent: BTreeSet<StorageId> = p
        .tensors()
        .filter(|(_, t)| t.kind != TensorKind::Buffer { persistent: false })
        .map(|(_, t)| t.storage)
        .collect();
    p.tensors()
        .map(|(_, t)| t.storage)
        .filter(|s| !persistent.contains(s))
        .collect()
}

fn disabled(strategy: OffloadStrategy) -> OffloadError {
    OffloadError::Disabled { strategy }
}

impl<A: Api> ModelHook<ForwardCtx> for BlockHook<A> {
    fn pre_forward(&mut self, _: &mut ForwardCtx) -> Result<PreForward, BoxError> {
        let result = self.pre();
        self.poison_on_error(result)?;
        Ok(PreForward::Continue)
    }

    fn post_forward(&mut self, _: &mut ForwardCtx, _: &Forwarded) -> Result<(), BoxError> {
        let result = self.post();
        Ok(self.poison_on_error(result)?)
    }
}

/// Streams DiT (and encoder) blocks through a ring of device slots: the
/// layerwise strategy, and (built with a collective) the distributed
/// layerwise strategy, whose gathered rings hold 1/G of each block per rank.
///
/// Dropping it while enabled (without [`OffloadBackend::disable`]) drains
/// its streams before freeing anything; if draining fails, the memory the
/// device may still touch is leaked with a logged error, never freed. It
/// never runs a collective from `Drop` or from failure cleanup.
pub struct LayerwiseBackend<A: Api> {
    config: OffloadConfig,
    depth: usize,
    lifecycle: Lifecycle,
    engine: Arc<Engine<A>>,
    collective: Option<Arc<dyn Collective<A>>>,
    /// The codec, when `weight_compression` is `"lossless"` or `"auto"`.
    codec: Option<Arc<dyn Codec<A>>>,
    /// What `"auto"` decides from (the platform's planner inputs).
    pub(crate) auto_inputs: Option<crate::budget::PlannerInputs>,
    /// What `"auto"` chose at the last enable, per ring (its first block's
    /// path).
    choices: crate::sync::Mutex<Vec<(String, crate::budget::CompressionChoice)>>,
    hooked: Vec<ModuleId>,
}

/// The distributed layerwise strategy: the same engine as
/// [`LayerwiseBackend`], built by [`LayerwiseBackend::distributed`].
pub type DistributedLayerwiseBackend<A> = LayerwiseBackend<A>;

impl<A: Api> LayerwiseBackend<A> {
    /// A layerwise backend with `depth` blocks prefetched (1 by default).
    pub fn new(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
        config: OffloadConfig,
        depth: usize,
    ) -> Result<Self, OffloadError> {
        Self::distributed(device, compute, weights, config, depth, None)
    }

    /// A distributed layerwise backend (CONTRACT §8) for `config` (which
    /// must select it). `collective` is this rank's handle on the gather
    /// group the configuration's `parallel` section derives (its size and
    /// this rank's place in it must match, see
    /// [`crate::config::GatherGroup::rank_of`]); with G = 1 (rank-local
    /// mode) it may be `None`.
    pub fn distributed(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
        config: OffloadConfig,
        depth: usize,
        collective: Option<Arc<dyn Collective<A>>>,
    ) -> Result<Self, OffloadError> {
        Self::build_backend(
            device,
            compute,
            weights,
            config,
            depth,
            (collective, None),
            Bugs::default(),
        )
    }

    /// A layerwise backend whose streamed blocks cross the link coded by
    /// `codec` when the configuration says `weight_compression =
    /// "lossless"` (CONTRACT §7b).
    pub fn with_codec(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
        config: OffloadConfig,
        depth: usize,
        codec: Arc<dyn Codec<A>>,
    ) -> Result<Self, OffloadError> {
        Self::build_backend(
            device,
            compute,
            weights,
            config,
            depth,
            (None, Some(codec)),
            Bugs::default(),
        )
    }

    pub(crate) fn build_backend(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
        config: OffloadConfig,
        depth: usize,
        (collective, codec): Transports<A>,
        bugs: Bugs,
    ) -> Result<Self, OffloadError> {
        let selection = config.select()?;
        if selection.strategy != OffloadStrategy::Layerwise {
            selection.require_pinned()?;
        }
        let strategy = match selection.strategy {
            s @ (OffloadStrategy::Layerwise | OffloadStrategy::DistributedLayerwise) => s,
            other => {
                return Err(OffloadError::Unsupported {
                    platform: "layerwise ring engine".to_owned(),
                    strategy: other,
                });
            }
        };
        let group = selection.gather_group;
        let rank = group.rank_of(&config.parallel);
        let gathers = strategy == OffloadStrategy::DistributedLayerwise && group.size > 1;
        let collective = if gathers {
            let c = collective.ok_or_else(|| OffloadError::GatherGroup {
                reason: format!(
                    "the configuration gathers over {:?} with G = {}, but no collective was given (CorePlatform::with_collective, or offload-dist's NCCL bootstrap)",
                    group.axis, group.size
                ),
            })?;
            if c.size() != group.size || c.rank() != rank {
                return Err(OffloadError::GatherGroup {
                    reason: format!(
                        "the configuration puts this process at rank {rank} of a group of {} ({:?}), but the collective is rank {} of {}",
                        group.size,
                        group.axis,
                        c.rank(),
                        c.size()
                    ),
                });
            }
            Some(c)
        } else {
            None
        };
        let coding = matches!(
            config.compression(),
            WeightCompression::Lossless | WeightCompression::Auto
        );
        let codec =
            if coding {
                Some(codec.ok_or_else(|| {
                    OffloadError::Config(Box::new(no_codec(config.compression())))
                })?)
            } else {
                None
            };
        let mut handles = Handles::new(device, compute, weights)?;
        if gathers {
            handles = handles.with_comm()?;
        }
        if coding {
            handles = handles.with_decode()?;
        }
        // The configuration's depth, else the platform's.
        let depth = config.prefetch_depth.map_or(depth, |d| d as usize);
        Ok(Self {
            config,
            depth: depth.max(1),
            lifecycle: Lifecycle::new(strategy),
            engine: Arc::new(Engine {
                shared: Shared::new(handles, bugs),
                strategy,
                rank,
                group: group.size,
            }),
            collective,
            codec,
            auto_inputs: None,
            choices: crate::sync::Mutex::new(Vec::new()),
            hooked: Vec::new(),
        })
    }

    fn new_state(&self, model: &Model, depth: usize) -> State<A> {
        State {
            placement: Placement::new(&model.pipeline, self.engine.strategy),
            resident: Vec::new(),
            rings: Vec::new(),
            slots: Vec::new(),
            table: SlotTable::new(0),
            depth,
            gather: None,
            decoding: None,
            host_staging: None,
            shadow_masters: Vec::new(),
            filled_into: Vec::new(),
            timer: None,
        }
    }

    /// Builds host masters, resident units and the slot pool into `st`; on
    /// error, `st` holds what was built, for [`Self::release`].
    fn build(
        &self,
        model: &Model,
        config: &OffloadConfig,
        st: &mut State<A>,
    ) -> Result<(), OffloadError> {
        let engine = &*self.engine;
        let (plan, partition) =
            plan_and_partition(&model.pipeline, config, Some(&*engine.handles.weights))?;
        if plan.strategy() != engine.strategy {
            return Err(OffloadError::Unsupported {
                platform: format!("{} backend", engine.strategy),
                strategy: plan.strategy(),
            });
        }
        log_warnings(&plan.warnings);
        let layout = RingLayout::new(&plan, &partition, engine.group, engine.rank);
        let h = &engine.handles;
        // Before anything is made: a device that cannot read in place.
        let in_place = in_place_reads::<A>(config, &*h.device)?;
        let skip = if engine.bug(PlantedBug::SkipNonPersistent) {
            non_persistent(&model.pipeline)
        } else {
            Default::default()
        };
        // Host masters, pinned once, exact size (or registered in place
        // where the weight source holds them: a block, or this rank's shard
        // of one, that is a window of a mapped checkpoint): whole blocks,
        // or this rank's shards, or (`weight_compression = "lossless"`) a block's
        // coded bytes.
        let bf16 = crate::runtime::layout::bf16_storages(&model.pipeline);
        let mut coding = CodingTally::default();
        // The host plan (CONTRACT §7c): which streamed blocks keep a pinned
        // or registered master within the host budget, which stay pageable
        // and stream through the staging ring.
        // Everything but the streamed blocks stays resident (resident
        // leading layers included), uploaded below; the largest is the
        // plan's transient pinned buffer.
        let streamed: BTreeSet<ModuleId> = layout.blocks().map(|b| b.unit.module).collect();
        let resident_units: Vec<&Unit> = partition
            .rest
            .iter()
            .chain(
                partition
                    .blocks
                    .iter()
                    .filter(|(m, _)| !streamed.contains(m))
                    .map(|(_, u)| u),
            )
            .collect();
        let transient = resident_units.iter().map(|u| u.bytes).max().unwrap_or(0);
        let pin = plan.selection.pin_memory || engine.strategy != OffloadStrategy::Layerwise;
        // The coded bytes a weight source holds of each streamed block (a
        // coded-block file, CONTRACT §7b), taken once, checked against the
        // weights: a block's coded master (pinned, registered or staged) is
        // made from them, and under `"lossless"` the host plan counts each
        // such block at its coded size, pinned or staged, so a budget holds
        // as many coded bytes as it can (`"auto"` may turn a ring's coded
        // masters back into raw ones after measuring: it plans raw sizes).
        let mut offers: Vec<Option<crate::runtime::backend::CodedRegion>> = layout
            .blocks()
            .map(|block| {
                let codec = self.codec.as_ref()?;
                let format = codec.format()?;
                if block.shard.is_some() || !skip.is_empty() {
                    return None;
                }
                let spans = crate::runtime::layout::codec_spans(&block.unit, &bf16).len();
                let bound = coded_bound(block.unit.bytes, spans).min(block.unit.bytes);
                h.weights
                    .take_coded(&block.unit, format)
                    .filter(|c| c.region.bytes().len() as u64 <= bound)
            })
            .collect();
        let lossless = config.compression() == crate::config::WeightCompression::Lossless;
        let coded_first = |offer: &Option<crate::runtime::backend::CodedRegion>| {
            offer.is_some() && (lossless || engine.bug(PlantedBug::HostPlanCodedUnderAuto))
        };
        // The window each block would be read in place from where staged,
        // asked once here: the plan sizes by it, the staged master takes it.
        let mut windows: Vec<PlannedWindow> = layout
            .blocks()
            .zip(&offers)
            .map(|(block, offer)| {
                (in_place && !coded_first(offer) && block.shard.is_none() && skip.is_empty())
                    .then(|| in_place_window(h, &block.unit))
            })
            .collect();
        let sized: Vec<crate::budget::HostBlock> = layout
            .blocks()
            .zip(&offers)
            .zip(&windows)
            .map(|((block, offer), window)| match (offer, window) {
                (Some(c), _) if coded_first(offer) => {
                    let len = c.region.bytes().len() as u64;
                    crate::budget::HostBlock {
                        pinned: len,
                        staged: len,
                    }
                }
                // Read in place where staged: no staging ring for it.
                (_, Some(Some(_))) => crate::budget::HostBlock {
                    pinned: block.unit.bytes,
                    staged: 0,
                },
                _ => crate::budget::HostBlock::raw(block.unit.bytes),
            })
            .collect();
        let host_plan = host_plan(config, &sized, transient, pin)?;
        let mut release = host_plan.release_after_read();
        let mut staged_at = host_plan.staged.iter().copied();
        let mut staged_log = StagedTally {
            budget_set: config.host_budget.is_some(),
            may_stage: engine.strategy == OffloadStrategy::Layerwise,
            release,
            in_place,
            ..StagedTally::default()
        };
        let masters_before = h.host_masters();
        let mut offers_at = offers.drain(..);
        let mut windows_at = windows.drain(..);
        let hidden = self.hidden_rings(config, &layout, st.depth);
        for (spec, hidden) in layout.rings.iter().zip(hidden.iter().map(Option::is_some)) {
            st.rings.push(Ring {
                blocks: Vec::new(),
                gathered: spec.gathered,
                role: spec.role,
            });
            st.filled_into.push(vec![None; spec.blocks.len()]);
            for block in &spec.blocks {
                let unit = block.unit.clone();
                let planned = staged_at.next().flatten();
                let offer = offers_at.next().flatten();
                let window = windows_at.next().flatten();
                let (host, coded) = match (&block.shard, &self.codec, planned) {
                    // `"auto"` measures and converts pinned or registered
                    // coded masters at enable: its staged blocks stage raw.
                    (None, Some(codec), Some(why))
                        if skip.is_empty()
                            && config.compression()
                                == crate::config::WeightCompression::Lossless =>
                    {
                        match staged_coded_master(h, &unit, offer, why, &mut staged_log) {
                            Some((master, coded)) => (master, Some(coded)),
                            None => (staged_master(h, &unit, window, why, &mut staged_log), None),
                        }
                    }
                    (None, _, Some(why)) => {
                        (staged_master(h, &unit, window, why, &mut staged_log), None)
                    }
                    (Some(shard), _, _) => (
                        h.shard_master(
                            &unit,
                            shard,
                            engine.bug(PlantedBug::ShardWindowWrongOffset),
                        )?,
                        None,
                    ),
                    (None, Some(codec), None) if skip.is_empty() && !hidden => {
                        let spans = crate::runtime::layout::codec_spans(&unit, &bf16);
                        match coded_master(
                            h,
                            &unit,
                            &spans,
                            &**codec,
                            offer,
                            &mut coding,
                            !staged_log.budget_set,
                        )? {
                            CodedMaster::Made(master, work, _) => {
                                let len = master.len_bytes();
                                (master, Some((len, work)))
                            }
                            CodedMaster::Raw => {
                                (pinned_or_staged(h, &unit, &skip, &mut staged_log)?, None)
                            }
                            // Pinning refused (CONTRACT §7c): its coded
                            // bytes stream staged, as a refused raw block
                            // does.
                            CodedMaster::PinRefused { coded, error } if staged_log.may_stage => {
                                tracing::warn!(unit = %unit.name, "pinning the coded `{}` was refused ({error}); it streams staged", unit.name);
                                staged_log.refused += 1;
                                let why = crate::budget::StageReason::Refused;
                                match staged_coded_master(
                                    h,
                                    &unit,
                                    Some(coded),
                                    why,
                                    &mut staged_log,
                                ) {
                                    Some((master, coded)) => (master, Some(coded)),
                                    None => {
                                        (staged_master(h, &unit, None, why, &mut staged_log), None)
                                    }
                                }
                            }
                            CodedMaster::PinRefused { error, .. } => return Err(error),
                        }
                    }
                    _ => (pinned_or_staged(h, &unit, &skip, &mut staged_log)?, None),
                };
                let host = Arc::new(host);
                st.placement.claim(&unit)?;
                st.rings
                    .last_mut()
                    .expect("pushed above")
                    .blocks
                    .push(Master {
                        unit,
                        host,
                        shard: block.shard,
                        coded,
                    });
                if engine.bug(PlantedBug::SecondHostCopy) {
                    // Counted: the report shows the second copy it plants.
                    st.shadow_masters
                        .push(h.counted(HostMaster::Pinned(h.fill_pinned(&block.unit, &skip)?)));
                }
            }
        }
        // Pins the device refused may need a staging ring the host plan did
        // not hold: further pinned blocks stage until the page-locked peak
        // fits the budget again (CONTRACT §7c).
        if let Some(budget) = host_plan.budget
            && staged_log.may_stage
            && staged_log.refused > 0
            && !engine.bug(PlantedBug::KeepPinsBesideRefused)
        {
            // Under `"auto"` a coded master may turn raw after the decode's
            // measurement (the plan sized it raw): counted at its raw bytes.
            let auto = config.compression() == crate::config::WeightCompression::Auto;
            let more_release =
                restage_rings(h, &mut st.rings, (budget, transient), auto, &mut staged_log)?;
            // The refused blocks' pages stay mapped beside the pins that
            // held: where they exceed the budget's room, they are released
            // after each read too, though the plan released nothing.
            if more_release && !release {
                tracing::info!(
                    "staged blocks' pages are released after each read: the pins the device refused left more staged than the host budget has room for"
                );
                release = true;
                staged_log.release = true;
                // As a plan that releases does at each pin: a pinned copy
                // holds its bytes, so its source's pages go too.
                for m in st.rings.iter().flat_map(|r| &r.blocks) {
                    if matches!(*m.host, HostMaster::Pinned(_)) && m.coded.is_none() {
                        h.weights.release(&m.unit);
                    }
                }
            }
        }
        staged_log.log(&host_plan);
        if staged_log.read_in_place > 0 && staged_log.release {
            tracing::warn!(
                read_in_place = staged_log.read_in_place,
                "staged_reads = \"in_place\": the {} blocks read in place keep their pages mapped, though the host budget releases staged pages after each read (a checkpoint larger than the budget): resident memory then holds them; staged_reads = \"fill\" bounds it",
                staged_log.read_in_place
            );
        }
        if layout.gathers() {
            // CONTRACT §8: this rank's masters (its shards of gathered
            // blocks, whole blocks of rank-local rings), registered in place
            // where the weight source holds them as windows, else copies.
            let now = h.host_masters();
            let (in_place, in_place_bytes) = (
                now.in_place_units
                    .saturating_sub(masters_before.in_place_units),
                now.in_place_bytes
                    .saturating_sub(masters_before.in_place_bytes),
            );
            let (copied, copied_bytes) = (
                now.copied_units.saturating_sub(masters_before.copied_units),
                now.copied_bytes.saturating_sub(masters_before.copied_bytes),
            );
            tracing::info!(
                rank = engine.rank,
                in_place,
                in_place_bytes,
                copied,
                copied_bytes,
                "rank {}'s host masters: {in_place} registered in place ({}), {copied} copied into pinned memory ({})",
                engine.rank,
                crate::bytes::ByteSize::new(in_place_bytes),
                crate::bytes::ByteSize::new(copied_bytes)
            );
        }
        st.host_staging = host_staging_of(h, &st.rings, (release, config.host_budget.is_some()))?;
        // A ring of one small buffer made for the uploads alone, where
        // pinning one is refused and no master stages: freed once they
        // are done.
        let mut upload_ring: Option<StagingRing<A>> = None;
        let uploaded = (|| -> Result<(), OffloadError> {
            for unit in resident_units {
                // Once a ring was made for a refused upload, the rest go
                // through it too (it is the plan's transient buffer): no
                // pin is asked again of a device that refused one.
                let buffer = if let Some(ring) = &upload_ring {
                    upload_staged(h, unit, ring)?
                } else {
                    // Only the pin (or registration) of the upload's
                    // transient master may be refused here: a failed device
                    // allocation or copy after it is the upload's own error.
                    match h.master_within(unit, &skip, !staged_log.budget_set) {
                        Ok(master) => h.upload_through(unit, master)?,
                        // Pinning refused for the upload: through the
                        // staging ring, or (layerwise) one made for it.
                        Err(OffloadError::DeviceOp { kind, cause, .. })
                            if kind != crate::device::DeviceErrorKind::DeviceLost
                                && skip.is_empty()
                                && (st.host_staging.is_some() || staged_log.may_stage) =>
                        {
                            tracing::warn!(unit = %unit.name, "pinning `{}` for its upload was refused ({cause}); uploading it through a staging buffer", unit.name);
                            let ring = match &st.host_staging {
                                Some(s) => &s.ring,
                                // Within the plan's transient pinned buffer
                                // (the largest resident unit), chunked.
                                None => &*upload_ring.insert(self::upload_ring(h, transient)?),
                            };
                            upload_staged(h, unit, ring)?
                        }
                        Err(e) => return Err(e),
                    }
                };
                let buffer = Arc::new(buffer);
                st.resident.push(Arc::clone(&buffer));
                st.placement.resident(unit, &buffer)?;
            }
            Ok(())
        })();
        if let Some(ring) = upload_ring {
            let mut first = None;
            free_staging_ring(h, ring, true, &mut first);
            if let (Ok(()), Some(e)) = (&uploaded, first) {
                return Err(e);
            }
        }
        uploaded?;
        // The slot pool: depth + 1 slots of the largest footprint, once
        // (none when every block stays resident).
        let slots = if layout.blocks().next().is_none() {
            0
        } else {
            st.depth + 1 + usize::from(engine.bug(PlantedBug::ExtraSlot))
        };
        st.table = SlotTable::new(slots);
        for k in 0..slots {
            let buffer = self.alloc(layout.slot_bytes, &format!("slot{k}"))?;
            st.slots.push(Slot {
                buffer,
                ready: self.event()?,
                last_use: self.event()?,
            });
        }
        coding.log(self.codec.as_deref());
        let staging_bytes = st
            .rings
            .iter()
            .flat_map(|r| &r.blocks)
            .filter_map(|m| m.coded.map(|(bytes, _)| bytes))
            .max();
        if let (Some(codec), Some(bytes)) = (&self.codec, staging_bytes) {
            let mut staging = Vec::new();
            for j in 0..STAGING_BUFFERS {
                staging.push(Staging {
                    buffer: self.alloc(bytes, &format!("staging{j}"))?,
                    copied: self.event()?,
                    consumed: self.event()?,
                });
            }
            st.decoding = Some(Decoding {
                codec: Arc::clone(codec),
                staging,
                next: 0,
            });
        }
        if let Some(collective) = &self.collective
            && layout.gathers()
        {
            let mut shards = Vec::new();
            for j in 0..layout.shard_buffers() {
                shards.push(Staging {
                    buffer: self.alloc(layout.shard_bytes, &format!("shard{j}"))?,
                    copied: self.event()?,
                    consumed: self.event()?,
                });
            }
            st.gather = Some(Gather {
                collective: Arc::clone(collective),
                shards,
                next: 0,
            });
        }
        // Layerwise materialises block 0 of the first ring before the first
        // forward; DLO defers every ring's first fill to its first forward
        // (a fill at enable on a rank whose rings differ from another's
        // would put a collective where that rank has none).
        let first = if engine.bug(PlantedBug::EagerFirstFill) {
            // Planted: prefill the ring that runs first (an encoder's, where
            // this rank streams one), at enable.
            Some(
                st.rings
                    .iter()
                    .position(|r| r.role == Role::Encoder)
                    .unwrap_or(0),
            )
        } else {
            (engine.strategy == OffloadStrategy::Layerwise).then_some(0)
        };
        if config.compression() == WeightCompression::Auto {
            self.choose_compression(st, &skip, hidden)?;
        }
        if let Some(r) = first
            && st.rings.get(r).is_some_and(|r| !r.blocks.is_empty())
        {
            fill(engine, st, r, 0, FillKind::Initial)?;
        }
        Ok(())
    }

    /// The configuration's `weight_compression`.
    pub(crate) fn compression(&self) -> WeightCompression {
        self.config.compression()
    }

    /// What `weight_compression = "auto"` chose at the last enable, per
    /// ring (named by its first block): whether it streams coded and the
    /// recurrence's forward either way (CONTRACT §7b).
    pub fn compression_choices(&self) -> Vec<(String, crate::budget::CompressionChoice)> {
        crate::sync::lock(&self.choices).clone()
    }

    /// What the ring engine forecasts of a step of each ring with staged
    /// masters (CONTRACT §7c), by its first block's path: the recurrence
    /// with the host stage ([`crate::budget::forecast_staged`]), each staged
    /// block filled at the rate this engine's own fills ran at over their
    /// last pass (`filler::FillLog`; timed on the host, beside the copies
    /// and compute), from the
    /// platform's planner inputs (each block's compute, the link, the copy
    /// latency and interference) at this engine's depth. A coded block's
    /// copy counts its coded bytes; its decode is not counted. Empty while
    /// disabled, where nothing is staged, or before the first staged fill
    /// (the first forward measures the rate); a typed error without planner
    /// inputs, or where they lack a streamed block's compute. `inputs`
    /// (another request's, say) replaces the platform's where given.
    pub fn staged_forecast(
        &self,
        inputs: Option<&crate::budget::PlannerInputs>,
    ) -> Result<Vec<(String, crate::budget::StagedForecast)>, OffloadError> {
        self.each_staged_ring(inputs, |shape, host, depth, _| host.forecast(shape, depth))
    }

    /// The look-ahead the recurrence chooses for each ring with staged
    /// masters, by its first block's path
    /// ([`crate::budget::choose_staged_lookahead`], depths 1 to
    /// `max_depth`, slots of the ring's largest block): from the same
    /// inputs as [`Self::staged_forecast`] (the platform's planner inputs
    /// or `inputs`, the host's fill rate its own fills ran at over their
    /// last pass). Where a staged block's fill outlasts the compute before
    /// it, the host must run its fills ahead and this depth can be deeper
    /// than a pinned ring's; a caller passes it as `prefetch_depth`. A typed
    /// error for a `max_depth` outside 1 to 64 (checked first); else empty
    /// and typed errors as [`Self::staged_forecast`]'s.
    pub fn staged_lookahead(
        &self,
        inputs: Option<&crate::budget::PlannerInputs>,
        max_depth: usize,
    ) -> Result<Vec<(String, crate::budget::Lookahead)>, OffloadError> {
        crate::budget::check_max_depth(max_depth).map_err(|e| OffloadError::Budget(Box::new(e)))?;
        self.each_staged_ring(inputs, |shape, host, _, slot_bytes| {
            crate::budget::choose_staged_lookahead(shape, host, slot_bytes, max_depth, None)
        })
    }

    /// `f` over each ring with staged masters (not gathered), by its first
    /// block's path: its shape from the planner inputs (`inputs`, else the
    /// platform's), its host stage at the rate this engine's fills ran at
    /// over their last pass, this engine's depth and the ring's largest
    /// block. Empty while disabled, where nothing is staged, or before the
    /// first staged fill.
    fn each_staged_ring<T>(
        &self,
        inputs: Option<&crate::budget::PlannerInputs>,
        f: impl Fn(
            &crate::budget::RingShape<'_>,
            crate::budget::StagedRing<'_>,
            usize,
            u64,
        ) -> Result<T, crate::budget::BudgetError>,
    ) -> Result<Vec<(String, T)>, OffloadError> {
        let guard = self.engine.lock();
        let Some(st) = guard.as_ref() else {
            return Ok(Vec::new());
        };
        let Some((rate, buffers, part_bytes)) = st.host_staging.as_ref().and_then(|s| {
            Some((
                s.ring.tally().bytes_per_s()?,
                s.ring.len(),
                s.ring.part_bytes(),
            ))
        }) else {
            return Ok(Vec::new());
        };
        let inputs = inputs.or(self.auto_inputs.as_ref()).ok_or_else(|| {
            OffloadError::Budget(Box::new(crate::budget::BudgetError::Input {
                input: "planner inputs".to_owned(),
                value: "none".to_owned(),
                allowed: "the platform's planner inputs (CorePlatform::with_planner), which the staged forecast reads each block's compute from".to_owned(),
            }))
        })?;
        let mut out = Vec::new();
        for ring in &st.rings {
            let staged_bytes: Vec<u64> = ring
                .blocks
                .iter()
                .map(|m| match &*m.host {
                    HostMaster::Staged(s) => s.bytes,
                    _ => 0,
                })
                .collect();
            let staged: Vec<bool> = ring
                .blocks
                .iter()
                .map(|m| matches!(&*m.host, HostMaster::Staged(_)))
                .collect();
            if ring.gathered || !staged.iter().any(|s| *s) {
                continue;
            }
            let compute_s = ring_compute(
                inputs,
                ring.blocks.iter().map(|m| &m.unit),
                "the staged forecast reads",
            )?;
            let other_s = inputs
                .components
                .values()
                .find(|c| c.block_compute_s.contains_key(&ring.blocks[0].unit.name))
                .map_or(0.0, |c| c.own_compute_s);
            let copy_s = ring_copies(
                inputs,
                ring.blocks
                    .iter()
                    .map(|m| m.coded.map_or(m.unit.bytes, |(b, _)| b)),
            );
            let resident = vec![false; ring.blocks.len()];
            let shape = crate::budget::RingShape {
                compute_s: &compute_s,
                copy_s: &copy_s,
                resident: &resident,
                other_s,
                interference: inputs.copy_interference,
            };
            let host = crate::budget::StagedRing {
                staged: &staged,
                staged_bytes: &staged_bytes,
                fill_bytes_per_s: rate,
                buffers,
                part_bytes,
                stream_bytes_per_s: inputs.staged_stream_bytes_per_s,
            };
            let slot_bytes = ring.blocks.iter().map(|m| m.unit.bytes).max().unwrap_or(0);
            let value = f(&shape, host, st.depth, slot_bytes)
                .map_err(|e| OffloadError::Budget(Box::new(e)))?;
            out.push((ring.blocks[0].unit.name.clone(), value));
        }
        Ok(out)
    }

    /// Under `weight_compression = "auto"` with planner inputs, the choice
    /// for each ring whose copies are hidden behind its compute at `depth`
    /// ([`crate::budget::hidden_choice`]): it streams raw and is never
    /// encoded (an H100's enable at 16,896 tokens spent 75 s encoding 57
    /// blocks that then streamed 1 % slower coded). `None` for a ring not
    /// judged here (exposed copies, a gathered ring, compute the inputs
    /// lack): it is encoded and decided after the decoder's measurement.
    fn hidden_rings(
        &self,
        config: &OffloadConfig,
        layout: &RingLayout,
        depth: usize,
    ) -> Vec<Option<(String, crate::budget::CompressionChoice)>> {
        let judge = |spec: &crate::runtime::ring::RingSpec| {
            let inputs = self.auto_inputs.as_ref()?;
            if config.compression() != WeightCompression::Auto || spec.gathered {
                return None;
            }
            // A block the inputs lack is `choose_compression`'s typed error
            // (the same purpose named): not judged here.
            let compute_s = ring_compute(
                inputs,
                spec.blocks.iter().map(|b| &b.unit),
                "weight_compression = \"auto\" decides from",
            )
            .ok()?;
            let copy_s = ring_copies(inputs, spec.blocks.iter().map(|b| b.unit.bytes));
            let resident = vec![false; compute_s.len()];
            let shape = crate::budget::RingShape {
                compute_s: &compute_s,
                copy_s: &copy_s,
                resident: &resident,
                other_s: 0.0,
                interference: inputs.copy_interference,
            };
            let choice = crate::budget::hidden_choice(&shape, depth)?;
            let name = spec.blocks[0].unit.name.clone();
            tracing::info!(
                ring = %name,
                none_s = choice.none_s,
                "weight_compression = \"auto\": the ring of `{name}` streams uncoded, not encoded: its copies are hidden behind its compute at depth {depth} (predicted forward {:.4} s)",
                choice.none_s
            );
            Some((name, choice))
        };
        layout.rings.iter().map(judge).collect()
    }

    /// `weight_compression = "auto"` (CONTRACT §7b) after the masters are
    /// built: with every ring not left raw by [`Self::hidden_rings`] coded,
    /// measures one decode on the device, then per ring asks the
    /// recurrence (`budget::choose_compression`, from the platform's
    /// planner inputs: each block's compute, the link) whether it is faster
    /// coded; a ring that is not streams its raw masters instead (the coded
    /// ones freed), and with no coded ring left the staging buffers go.
    /// `hidden` holds, by ring, the choices made before encoding, recorded
    /// in ring order with the others.
    fn choose_compression(
        &self,
        st: &mut State<A>,
        skip: &BTreeSet<StorageId>,
        mut hidden: Vec<Option<(String, crate::budget::CompressionChoice)>>,
    ) -> Result<(), OffloadError> {
        let inputs = self
            .auto_inputs
            .as_ref()
            .ok_or_else(|| OffloadError::Config(Box::new(crate::config::auto_without_inputs())))?;
        // The inputs' measured figure (a planned backend's check request
        // saved it), else the assumed one; one out of range names its key,
        // whether or not a ring is coded.
        let decode_k = crate::budget::checked_decode_interference(inputs)
            .map_err(|e| OffloadError::Budget(Box::new(e)))?;
        *crate::sync::lock(&self.choices) = hidden.iter().flatten().cloned().collect();
        // The decoder is measured on a coded master the device holds
        // (pinned or registered); where every coded master streams staged
        // (its pin refused), every ring stays coded, as below.
        let Some((r0, b0)) = st.rings.iter().enumerate().find_map(|(r, ring)| {
            ring.blocks
                .iter()
                .position(|m| m.coded.is_some() && !matches!(&*m.host, HostMaster::Staged(_)))
                .map(|b| (r, b))
        }) else {
            return Ok(());
        };
        let decode_bytes_per_s = self.measure_decode(st, r0, b0)?;
        let h = &self.engine.handles;
        let mut choices = Vec::new();
        for r in 0..st.rings.len() {
            if let Some(c) = hidden.get_mut(r).and_then(Option::take) {
                choices.push(c);
                continue;
            }
            let ring = &st.rings[r];
            if ring.gathered || ring.blocks.iter().all(|m| m.coded.is_none()) {
                continue;
            }
            let compute_s = ring_compute(
                inputs,
                ring.blocks.iter().map(|m| &m.unit),
                "weight_compression = \"auto\" decides from",
            )?;
            let copy_s = ring_copies(inputs, ring.blocks.iter().map(|m| m.unit.bytes));
            let coded_s = ring_copies(
                inputs,
                ring.blocks
                    .iter()
                    .map(|m| m.coded.map_or(m.unit.bytes, |(b, _)| b)),
            );
            let decode_s: Vec<f64> = ring
                .blocks
                .iter()
                .map(|m| {
                    if m.coded.is_some() {
                        m.unit.bytes as f64 / decode_bytes_per_s
                    } else {
                        0.0
                    }
                })
                .collect();
            let resident = vec![false; ring.blocks.len()];
            let shape = crate::budget::RingShape {
                compute_s: &compute_s,
                copy_s: &copy_s,
                resident: &resident,
                other_s: 0.0,
                interference: inputs.copy_interference,
            };
            let choice = crate::budget::choose_compression(
                &shape,
                &coded_s,
                crate::budget::DecodeStage {
                    decode_s: &decode_s,
                    interference: decode_k,
                },
                st.depth,
            )
            .map_err(|e| OffloadError::Budget(Box::new(e)))?;
            let name = ring.blocks[0].unit.name.clone();
            // A ring some of whose coded masters stream staged (pinning
            // them was refused, CONTRACT §7c) stays coded: streaming it
            // uncoded would ask the device again for the pins it refused.
            let refused = ring
                .blocks
                .iter()
                .filter(|m| m.coded.is_some() && matches!(&*m.host, HostMaster::Staged(_)))
                .count();
            let choice = if refused > 0 && !choice.lossless {
                tracing::warn!(
                    ring = %name,
                    refused,
                    "weight_compression = \"auto\": the ring of `{name}` would stream uncoded, but {refused} of its coded masters stream staged (pinning refused); it stays coded"
                );
                crate::budget::CompressionChoice {
                    lossless: true,
                    ..choice
                }
            } else {
                choice
            };
            tracing::info!(
                ring = %name,
                lossless = choice.lossless,
                none_s = choice.none_s,
                lossless_s = choice.lossless_s,
                "weight_compression = \"auto\": the ring of `{name}` streams {} (predicted forward {:.4} s coded, {:.4} s uncoded; decoder {:.0} GB/s measured)",
                if choice.lossless { "coded" } else { "uncoded" },
                choice.lossless_s,
                choice.none_s,
                decode_bytes_per_s / 1e9
            );
            if !choice.lossless {
                // Each coded master is freed before its raw one is made,
                // so host memory never holds both (INV-7's host bound).
                let mut rest = std::mem::take(&mut st.rings[r].blocks).into_iter();
                while let Some(m) = rest.next() {
                    if m.coded.is_none() {
                        st.rings[r].blocks.push(m);
                        continue;
                    }
                    let Master {
                        unit, host, shard, ..
                    } = m;
                    let raw = match Arc::try_unwrap(host) {
                        Ok(coded) => {
                            // SAFETY: the one decode that read a coded
                            // master (the measurement) was synchronised
                            // before.
                            let freed = unsafe { h.free_master(coded) };
                            // Under a host budget never by registering (and
                            // so locking) a whole mapping (CONTRACT §7c).
                            let whole = self.config.host_budget.is_none();
                            freed.and_then(|()| h.master_within(&unit, skip, whole))
                        }
                        Err(_) => Err(OffloadError::Forward {
                            module: unit.name.clone(),
                            reason: "its coded master is shared".to_owned(),
                        }),
                    };
                    match raw {
                        Ok(raw) => st.rings[r].blocks.push(Master {
                            unit,
                            host: Arc::new(raw),
                            shard,
                            coded: None,
                        }),
                        Err(e) => {
                            st.rings[r].blocks.extend(rest);
                            return Err(e);
                        }
                    }
                }
            }
            choices.push((name, choice));
        }
        *crate::sync::lock(&self.choices) = choices;
        if st
            .rings
            .iter()
            .flat_map(|r| &r.blocks)
            .all(|m| m.coded.is_none())
            && let Some(d) = st.decoding.take()
        {
            // Every free runs; the first error is returned.
            let mut first = None;
            for staging in d.staging {
                if let Err(e) = h.free(
                    staging.buffer,
                    &[&staging.copied, &staging.consumed],
                    "staging",
                ) {
                    first.get_or_insert(e);
                }
            }
            if let Some(e) = first {
                return Err(e);
            }
        }
        Ok(())
    }

    /// The decoder's rate on this device, bytes written per second: block
    /// `(ring, block)` copied to staging buffer 0 and decoded into slot 0
    /// four times (enable time: no slot holds a block yet), the last three
    /// timed with the device's events and the shortest taken, then
    /// synchronised and the decoder's check read.
    fn measure_decode(
        &self,
        st: &State<A>,
        ring: usize,
        block: usize,
    ) -> Result<f64, OffloadError> {
        let d = st.decoding.as_ref().expect("coded masters have staging");
        let m = &st.rings[ring].blocks[block];
        let slot = st.slots.first().ok_or_else(|| OffloadError::Forward {
            module: m.unit.name.clone(),
            reason: "no slot to measure a decode into".to_owned(),
        })?;
        time_decodes(
            &self.engine.handles,
            &*d.codec,
            (&m.unit, &m.host, m.coded.expect("a coded block")),
            &d.staging[0],
            &slot.buffer,
        )
    }

    fn alloc(&self, bytes: u64, name: &str) -> Result<Arc<A::DeviceBuffer>, OffloadError> {
        alloc_named(&self.engine.handles, bytes, name)
    }

    fn event(&self) -> Result<A::Event, OffloadError> {
        new_event(&self.engine.handles)
    }

    /// Gathers every gathered block once more and hands it to the weight
    /// source ([`WeightSource::restore`]): every rank does this in the same
    /// order at `disable`, so the collectives match. Stops at the first
    /// error (a failed collective leaves the group broken).
    fn restore(&self, st: &mut State<A>) -> Result<(), OffloadError> {
        let engine = &*self.engine;
        let h = &engine.handles;
        let largest = st
            .rings
            .iter()
            .filter(|r| r.gathered)
            .flat_map(|r| &r.blocks)
            .map(|m| m.unit.bytes)
            .max();
        let Some(largest) = largest.filter(|_| h.weights.wants_restore()) else {
            return Ok(());
        };
        let mut staging = h.device.alloc_pinned(largest).map_err(|e| {
            dev_err(
                format!("alloc_pinned({largest} bytes) to restore blocks"),
                e,
            )
        })?;
        let mut restore_all = || -> Result<(), OffloadError> {
            for r in 0..st.rings.len() {
                if !st.rings[r].gathered {
                    continue;
                }
                for b in 0..st.rings[r].blocks.len() {
                    // A prefetch still in flight already holds it.
                    let k = match (st.table.holding(r, b), st.in_flight(r, b)) {
                        (Some(k), true) => k,
                        _ => fill(engine, st, r, b, FillKind::Restore)?,
                    };
                    let unit = st.rings[r].blocks[b].unit.clone();
                    h.device
                        .stream_wait_event(&h.copy, &st.slots[k].ready)
                        .map_err(|e| dev_err("stream_wait_event(copy, ready)", e))?;
                    let _span = transfer_span(&unit.name, unit.bytes, "copy", "d2h").entered();
                    // SAFETY: the slot holds at least `unit.bytes` and the
                    // staging buffer the largest gathered block; the copy
                    // stream waits for the gather (ready) and is synchronised
                    // below before the host reads the staging buffer or
                    // anything is freed.
                    unsafe {
                        h.device.copy_d2h(
                            &h.copy,
                            &st.slots[k].buffer,
                            0,
                            &mut staging,
                            0,
                            unit.bytes,
                        )
                    }
                    .map_err(|e| dev_err(format!("copy_d2h of `{}`", unit.name), e))?;
                    h.device
                        .synchronize_stream(&h.copy)
                        .map_err(|e| dev_err("synchronize_stream(copy)", e))?;
                    let mut bytes = vec![0; unit.bytes as usize];
                    staging.read_into(0, &mut bytes);
                    h.weights.restore(&unit, &bytes);
                    // No forward runs at disable: the slot is free (a planted
                    // static slot choice may have left it marked in use).
                    st.table.evict_unchecked(k, usize::MAX, usize::MAX);
                    st.placement.transition(&unit, Transition::Discard)?;
                }
            }
            Ok(())
        };
        let result = restore_all();
        // The staging buffer is freed only once no copy may use it.
        match h.drain() {
            Ok(()) => {
                // SAFETY: every stream is drained: no copy reads or writes it.
                if let Err(e) = unsafe { h.device.free_pinned(staging) } {
                    tracing::error!("freeing the restore staging buffer: {e}");
                }
            }
            Err(e) => {
                tracing::error!("restore: {e}; leaking its staging buffer");
                std::mem::forget(staging);
            }
        }
        result
    }

    /// Frees everything `st` holds, after draining every stream (unless
    /// `drain` is false, which only planted bugs ask for). If draining
    /// fails, everything is leaked (the device may still touch it) and the
    /// error returned; otherwise every free runs and the first error is
    /// returned.
    fn release(&self, st: State<A>, drain: bool) -> Result<(), OffloadError> {
        release_state(&self.engine, st, drain)
    }

    /// Bytes of one slot, and the slot count.
    pub fn slots(&self) -> (u64, usize) {
        let guard = self.engine.lock();
        guard.as_ref().map_or((0, 0), |st| {
            (
                st.slots.first().map_or(0, |s| s.buffer.len_bytes()),
                st.slots.len(),
            )
        })
    }

    /// This rank's place in the gather group: (rank, G).
    pub fn group(&self) -> (u32, u32) {
        (self.engine.rank, self.engine.group)
    }

    /// A poisoned backend's lifecycle says so.
    fn sync_poison(&mut self) {
        if let Some(reason) = self.engine.poisoned() {
            self.lifecycle.poison(reason);
        }
    }
}

impl<A: Api> Drop for LayerwiseBackend<A> {
    fn drop(&mut self) {
        let st = self.engine.lock().take();
        if let Some(st) = st {
            let drain = !self.engine.bug(PlantedBug::DropWithoutDrain);
            if let Err(e) = self.release(st, drain) {
                tracing::error!("dropping an enabled {} backend: {e}", self.engine.strategy);
            }
        }
    }
}

impl<A: Api> OffloadBackend for LayerwiseBackend<A> {
    fn strategy(&self) -> OffloadStrategy {
        self.engine.strategy
    }

    fn enable(&mut self, model: &mut Model) -> Result<(), OffloadError> {
        let _span = enable_span(self.engine.strategy, model).entered();
        self.sync_poison();
        if self.lifecycle.begin_enable()? == EnableStep::AlreadyEnabled {
            return Ok(());
        }
        let strategy = self.engine.strategy;
        if !self.engine.bug(PlantedBug::IgnoreOtherOwner) {
            check_single_owner(model, strategy)?;
        }
        let (config, depth) = (self.config.clone(), self.depth);
        let mut st = self.new_state(model, depth);
        if let Err(e) = self.build(model, &config, &mut st) {
            // Local cleanup only: no collective (a failed peer may never
            // join); a multi-rank backend is then poisoned (CONTRACT §3).
            let _ = self.release(st, true);
            if self.engine.multi_rank() {
                self.engine
                    .set_poison(format!("enable failed on rank {} ({e})", self.engine.rank));
                self.sync_poison();
            }
            return Err(e);
        }
        let blocks: Vec<(usize, usize, ModuleId)> = st
            .rings
            .iter()
            .enumerate()
            .flat_map(|(r, ring)| {
                ring.blocks
                    .iter()
                    .enumerate()
                    .map(move |(i, m)| (r, i, m.unit.module))
            })
            .collect();
        *self.engine.lock() = Some(st);
        // Hooks last: nothing above touched the model.
        let hooks = blocks
            .into_iter()
            .map(|(r, i, module)| {
                let hook: Box<dyn ModelHook<ForwardCtx>> = Box::new(BlockHook {
                    engine: Arc::clone(&self.engine),
                    ring: r,
                    block: i,
                });
                (module, hook)
            })
            .collect();
        let rollback = !self.engine.bug(PlantedBug::NoRollback);
        match install_hooks(model, strategy, hooks, rollback) {
            Ok(installed) => self.hooked = installed,
            Err(e) => {
                let st = if rollback {
                    self.engine.lock().take()
                } else {
                    None
                };
                if let Some(st) = st {
                    let _ = self.release(st, true);
                }
                if self.engine.multi_rank() {
                    self.engine
                        .set_poison(format!("enable failed on rank {} ({e})", self.engine.rank));
                    self.sync_poison();
                }
                return Err(e);
            }
        }
        self.lifecycle.finish_enable();
        Ok(())
    }

    /// Removes the hooks, gathers every gathered block once more to hand it
    /// back to the weight source (unless poisoned: then no collective
    /// runs), then drains and frees. Every step runs; the first error is
    /// returned.
    fn disable(&mut self, model: &mut Model) -> Result<(), OffloadError> {
        let poisoned_before = self.engine.poisoned().is_some();
        if self.lifecycle.begin_disable() == DisableStep::NothingToDo && !poisoned_before {
            return Ok(());
        }
        let strategy = self.engine.strategy;
        remove_hooks(model, strategy, &mut self.hooked);
        let st = self.engine.lock().take();
        let mut first = None;
        let result = match st {
            None => Ok(()),
            Some(mut st) => {
                if !poisoned_before && let Err(e) = self.restore(&mut st) {
                    if self.engine.multi_rank() {
                        self.engine.set_poison(format!(
                            "restoring blocks at disable failed on rank {} ({e})",
                            self.engine.rank
                        ));
                    }
                    first = Some(e);
                }
                let drain = !self.engine.bug(PlantedBug::FreeWithoutDrain);
                self.release(st, drain).and_then(|()| {
                    // Drained: every decode has run; one that found no
                    // whole block fed compute other weights.
                    match &self.codec {
                        Some(c) => c.check().map_err(|e| {
                            dev_err("the decoder's check at disable (a decode found no whole coded block)", e)
                        }),
                        None => Ok(()),
                    }
                })
            }
        };
        self.lifecycle.finish_disable();
        self.sync_poison();
        match first {
            Some(e) => Err(e),
            None => result,
        }
    }

    fn is_enabled(&self) -> bool {
        self.lifecycle.is_enabled() && self.engine.poisoned().is_none()
    }

    fn state(&self) -> LifecycleState {
        match self.engine.poisoned() {
            Some(reason) => LifecycleState::Poisoned { reason },
            None => self.lifecycle.state().clone(),
        }
    }

    fn poison(&mut self, reason: &str) {
        if self.engine.multi_rank() {
            self.engine.set_poison(format!(
                "rank {} of {}: {reason}",
                self.engine.rank, self.engine.group
            ));
        }
    }
}

impl<A: Api> Backend<A> for LayerwiseBackend<A> {
    fn locate(&self, storage: StorageId) -> Option<DeviceLocation<A>> {
        self.engine.locate(storage)
    }

    fn residency(&self, storage: StorageId) -> Option<Residency> {
        self.engine.residency(storage)
    }

    fn device_weight_bytes(&self) -> u64 {
        self.engine.device_weight_bytes()
    }

    fn host_weight_bytes(&self) -> u64 {
        self.engine.host_weight_bytes()
    }

    fn host_masters(&self) -> HostMasters {
        self.engine.handles.host_masters()
    }

    fn staged_forecast(
        &self,
        inputs: Option<&crate::budget::PlannerInputs>,
    ) -> Result<Vec<(String, crate::budget::StagedForecast)>, OffloadError> {
        LayerwiseBackend::staged_forecast(self, inputs)
    }

    fn staged_lookahead(
        &self,
        inputs: Option<&crate::budget::PlannerInputs>,
        max_depth: usize,
    ) -> Result<Vec<(String, crate::budget::Lookahead)>, OffloadError> {
        LayerwiseBackend::staged_lookahead(self, inputs, max_depth)
    }
}

/// A block's module and the hook to install on it.
pub(crate) type BlockHookOf = (ModuleId, Box<dyn ModelHook<ForwardCtx>>);

/// The ring engine as a planned backend composes it: rings of the streamed
/// blocks of every component over host masters the planned backend owns,
/// and a slot pool sized per phase (allocated when a streaming phase
/// begins, freed when a phase that streams nothing begins), with the same
/// hooks, fills, stamps and events as layerwise.
/// The decoder's rate on this device, bytes written per second: `unit`'s
/// coded master (`coded`: its coded bytes and work items) copied to
/// `staging` and decoded into `out` four times on the decode stream, the
/// last three timed with the device's events and the shortest taken, then
/// synchronised and the decoder's check read. Nothing else may use
/// `staging` or `out` meanwhile (enable time).
fn time_decodes<A: Api>(
    h: &Handles<A>,
    codec: &dyn Codec<A>,
    (unit, host, (coded_bytes, work)): (&Unit, &HostMaster<A>, (u64, u64)),
    staging: &Staging<A>,
    out: &A::DeviceBuffer,
) -> Result<f64, OffloadError> {
    let decode = h
        .decode
        .as_ref()
        .expect("a coding engine has a decode stream");
    let timing = || {
        h.device
            .create_timing_event()
            .map_err(|e| dev_err("create_timing_event", e))
    };
    // Three timed decodes after an untimed one (the module's first
    // launch): the shortest is the rate, a delay on the stream (a
    // perturbation, another process) lengthening only one of them.
    const TIMED: usize = 3;
    let marks: Vec<A::Event> = (0..=TIMED).map(|_| timing()).collect::<Result<_, _>>()?;
    // SAFETY: at enable nothing else uses `staging` or `out`; the decode
    // stream waits for the copy (`copied`) and the host synchronises on
    // the last mark, after every decode, before anything else touches
    // either buffer or the master is freed.
    unsafe {
        h.device
            .copy_h2d(
                &h.copy,
                host.copy_source("copy_h2d (decode measurement)")?,
                0,
                &staging.buffer,
                0,
                coded_bytes,
            )
            .map_err(|e| dev_err("copy_h2d (decode measurement)", e))?;
        h.device
            .record_event(&staging.copied, &h.copy)
            .map_err(|e| dev_err("record_event(staging copied)", e))?;
        h.device
            .stream_wait_event(decode, &staging.copied)
            .map_err(|e| dev_err("stream_wait_event(decode, staging copied)", e))?;
        for k in 0..=TIMED {
            if k > 0 {
                h.device
                    .record_event(&marks[k - 1], decode)
                    .map_err(|e| dev_err("record_event(decode mark)", e))?;
            }
            codec
                .decode(decode, &staging.buffer, coded_bytes, work, out, unit.bytes)
                .map_err(|e| dev_err("decode (measurement)", e))?;
        }
        h.device
            .record_event(&marks[TIMED], decode)
            .map_err(|e| dev_err("record_event(decode end)", e))?;
        h.device
            .record_event(&staging.consumed, decode)
            .map_err(|e| dev_err("record_event(staging consumed)", e))?;
    }
    h.device
        .synchronize_event(&marks[TIMED])
        .map_err(|e| dev_err("synchronize_event(decode end)", e))?;
    codec
        .check()
        .map_err(|e| dev_err("the decoder's check after the measured decodes", e))?;
    let mut ns = u64::MAX;
    for k in 0..TIMED {
        let e = h
            .device
            .elapsed_ns(&marks[k], &marks[k + 1])
            .map_err(|e| dev_err("elapsed_ns(decode)", e))?;
        ns = ns.min(e.max(1));
    }
    Ok(unit.bytes as f64 / (ns as f64 / 1e9))
}

/// A device buffer of `bytes` named `name` (in the device's traces).
fn alloc_named<A: Api>(
    h: &Handles<A>,
    bytes: u64,
    name: &str,
) -> Result<Arc<A::DeviceBuffer>, OffloadError> {
    let buffer = h
        .device
        .alloc_device(bytes)
        .map_err(|e| dev_err(format!("alloc_device({bytes} bytes) for {name}"), e))?;
    h.device.name_buffer(&buffer, name);
    Ok(Arc::new(buffer))
}

/// A fresh event.
fn new_event<A: Api>(h: &Handles<A>) -> Result<A::Event, OffloadError> {
    h.device
        .create_event()
        .map_err(|e| dev_err("create_event", e))
}

/// A planned phase's slot pool ([`RingEngine::use_pool`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Pool {
    /// Slots (`depth + 1`; 0: none).
    pub(crate) slots: usize,
    /// Bytes of one slot.
    pub(crate) slot_bytes: u64,
    /// Prefetch depth.
    pub(crate) depth: usize,
    /// Bytes of each of the two decode staging buffers (0: none).
    pub(crate) staging_bytes: u64,
}

/// Whether `st`'s pool is `pool` (its depth aside).
fn pool_is<A: Api>(st: &State<A>, pool: Pool) -> bool {
    let staging = st
        .decoding
        .as_ref()
        .and_then(|d| d.staging.first())
        .map_or(0, |b| b.buffer.len_bytes());
    st.slots.len() == pool.slots
        && st
            .slots
            .first()
            .is_none_or(|s| s.buffer.len_bytes() == pool.slot_bytes)
        && staging == pool.staging_bytes
}

/// A streamed block's host master as the planned backend hands it to the
/// ring engine: the master, and (coded, CONTRACT §7b) its coded bytes and
/// the decode's work items.
pub(crate) type StoredMaster<A> = (Arc<HostMaster<A>>, Option<(u64, u64)>);

pub(crate) struct RingEngine<A: Api> {
    engine: Arc<Engine<A>>,
    /// The codec coded masters decode with (`weight_compression`).
    codec: Option<Arc<dyn Codec<A>>>,
}

impl<A: Api> RingEngine<A> {
    pub(crate) fn new(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
        bugs: Bugs,
        codec: Option<Arc<dyn Codec<A>>>,
    ) -> Result<Self, OffloadError> {
        let handles = Handles::new(device, compute, weights)?;
        let handles = if codec.is_some() {
            handles.with_decode()?
        } else {
            handles
        };
        Ok(Self {
            engine: Arc::new(Engine {
                shared: Shared::new(handles, bugs),
                strategy: OffloadStrategy::Planned,
                rank: 0,
                group: 1,
            }),
            codec,
        })
    }

    /// The decoder's rate (bf16 bytes written per second) on `unit`'s
    /// coded master (`coded`: coded bytes, work items), measured as
    /// layerwise's `"auto"` does ([`time_decodes`]) into a staging buffer
    /// and an output buffer allocated for it and freed after. Enable time:
    /// no ring is built.
    pub(crate) fn measure_decoder(
        &self,
        unit: &Unit,
        master: &HostMaster<A>,
        coded: (u64, u64),
    ) -> Result<f64, OffloadError> {
        let h = &self.engine.handles;
        let codec = self.codec.as_ref().ok_or_else(|| OffloadError::Forward {
            module: unit.name.clone(),
            reason: "no codec to measure a decode with".to_owned(),
        })?;
        let staging = Staging {
            buffer: alloc_named(h, coded.0.max(1), "the decode measurement's staging")?,
            copied: new_event(h)?,
            consumed: new_event(h)?,
        };
        let out = match alloc_named(h, unit.bytes.max(1), "the decode measurement's output") {
            Ok(out) => out,
            Err(e) => {
                let _ = h.free(
                    staging.buffer,
                    &[&staging.copied, &staging.consumed],
                    "staging",
                );
                return Err(e);
            }
        };
        let rate = time_decodes(h, &**codec, (unit, master, coded), &staging, &out);
        // A failed measurement may leave its copy or decodes in flight (the
        // events that order them perhaps never recorded): the streams are
        // drained first, and where that fails too the device may still
        // touch both buffers, which are leaked (logged).
        if rate.is_err() && h.drain().is_err() {
            tracing::error!(
                unit = %unit.name,
                "the decode measurement failed and its streams did not drain: leaking its staging and output buffers"
            );
            std::mem::forget(staging);
            std::mem::forget(out);
            return rate;
        }
        // Every free runs after the decodes (the measurement synchronised,
        // or drained after failing).
        let freed = h
            .free(
                staging.buffer,
                &[&staging.copied, &staging.consumed],
                "staging",
            )
            .and_then(|()| h.free(out, &[&staging.consumed], "decode output"));
        let rate = rate?;
        freed.map(|()| rate)
    }

    /// Waits for everything enqueued on its streams (never on the hot
    /// path): what a failed enable-time step must see done before it frees
    /// what that step's work may read.
    pub(crate) fn drain(&self) -> Result<(), OffloadError> {
        self.engine.handles.drain()
    }

    /// Builds the rings of `layout` over the masters `master_of` gives (no
    /// slots yet), with fills timed by `timer` while a warm-up measures,
    /// and returns the block hooks to install. Where a master is staged
    /// (CONTRACT §7c), the host staging ring of layerwise is made for them
    /// (`budget::host::staging_layout` of the largest), each staged block's pages
    /// released after its read where `release`. On error the state holds
    /// what was built, for [`Self::release`].
    pub(crate) fn build(
        &self,
        pipeline: &crate::model::Pipeline,
        layout: &RingLayout,
        master_of: &dyn Fn(&Unit) -> Option<StoredMaster<A>>,
        timer: Option<Arc<Timer<A>>>,
        (release, budgeted): (bool, bool),
    ) -> Result<Vec<BlockHookOf>, OffloadError> {
        let mut st = State {
            placement: Placement::new(pipeline, OffloadStrategy::Planned),
            resident: Vec::new(),
            rings: Vec::new(),
            slots: Vec::new(),
            table: SlotTable::new(0),
            depth: 1,
            gather: None,
            decoding: None,
            host_staging: None,
            shadow_masters: Vec::new(),
            filled_into: Vec::new(),
            timer,
        };
        let mut hooks: Vec<BlockHookOf> = Vec::new();
        let mut build = || -> Result<(), OffloadError> {
            for (r, spec) in layout.rings.iter().enumerate() {
                st.rings.push(Ring {
                    blocks: Vec::new(),
                    gathered: false,
                    role: spec.role,
                });
                st.filled_into.push(vec![None; spec.blocks.len()]);
                for (i, block) in spec.blocks.iter().enumerate() {
                    let unit = block.unit.clone();
                    let (host, coded) = master_of(&unit).ok_or_else(|| OffloadError::Forward {
                        module: unit.name.clone(),
                        reason: "the planned backend has no host master for this streamed block"
                            .to_owned(),
                    })?;
                    st.placement.claim(&unit)?;
                    hooks.push((
                        unit.module,
                        Box::new(BlockHook {
                            engine: Arc::clone(&self.engine),
                            ring: r,
                            block: i,
                        }),
                    ));
                    if coded.is_some() && self.codec.is_none() {
                        return Err(OffloadError::Forward {
                            module: unit.name.clone(),
                            reason: "a coded master on a ring engine without a codec".to_owned(),
                        });
                    }
                    st.rings[r].blocks.push(Master {
                        unit,
                        host,
                        shard: None,
                        coded,
                    });
                }
            }
            st.host_staging =
                host_staging_of(&self.engine.handles, &st.rings, (release, budgeted))?;
            Ok(())
        };
        let result = build();
        *self.engine.lock() = Some(st);
        result.map(|()| hooks)
    }

    /// The rate this engine's host fills of staged masters ran at over
    /// their last pass (bytes per second, timed on the host beside the
    /// copies and compute; at a planned `enable`, the warm-up's), where it
    /// has filled any.
    pub(crate) fn host_fill_rate(&self) -> Option<f64> {
        let guard = self.engine.lock();
        guard
            .as_ref()?
            .host_staging
            .as_ref()?
            .ring
            .tally()
            .bytes_per_s()
    }

    /// Whether the pool is `pool` now ([`Self::use_pool`]).
    pub(crate) fn has_pool(&self, pool: Pool) -> bool {
        self.engine
            .lock()
            .as_ref()
            .is_some_and(|st| pool_is(st, pool))
    }

    /// Makes the slot pool `pool.slots` slots of `pool.slot_bytes` at
    /// prefetch `pool.depth`, beside two decode staging buffers of
    /// `pool.staging_bytes` where its phase streams coded blocks (CONTRACT
    /// §7b; none where 0): kept when it already is (consecutive phases
    /// alike), otherwise the old pool is freed after its last uses (blocks
    /// in flight discarded, staging buffers after the decodes that read
    /// them) and the new one allocated; `slots == 0` frees it.
    pub(crate) fn use_pool(&self, pool: Pool) -> Result<(), OffloadError> {
        let Pool {
            slots,
            slot_bytes,
            depth,
            staging_bytes,
        } = pool;
        let engine = &*self.engine;
        let mut guard = engine.lock();
        let st = guard
            .as_mut()
            .ok_or_else(|| disabled(OffloadStrategy::Planned))?;
        settle(engine, st)?;
        st.depth = depth.max(1);
        if pool_is(st, pool) {
            return Ok(());
        }
        if staging_bytes > 0 && self.codec.is_none() {
            return Err(OffloadError::Forward {
                module: "decode staging".to_owned(),
                reason: "a pool with decode staging on a ring engine without a codec".to_owned(),
            });
        }
        if st.table.any_in_use() {
            let module = st
                .table
                .in_use_block()
                .and_then(|(r, b)| st.rings.get(r)?.blocks.get(b))
                .map_or_else(|| "a streamed block".to_owned(), |m| m.unit.name.clone());
            return Err(OffloadError::Forward {
                module,
                reason: "another component's forward began while this block's forward still runs (nested forwards?); run one component at a time".to_owned(),
            });
        }
        let h = &engine.handles;
        let slots_same = st.slots.len() == slots
            && st
                .slots
                .first()
                .is_none_or(|s| s.buffer.len_bytes() == slot_bytes);
        if !slots_same {
            for k in 0..st.slots.len() {
                if let Some((r, b)) = st.table.stamp(k)
                    && st.in_flight(r, b)
                {
                    let unit = st.rings[r].blocks[b].unit.clone();
                    st.placement.transition(&unit, Transition::Discard)?;
                }
            }
            let old = std::mem::take(&mut st.slots);
            st.table = SlotTable::new(0);
            for slot in old {
                h.free(slot.buffer, &[&slot.ready, &slot.last_use], "slot")?;
            }
            for k in 0..slots {
                st.slots.push(Slot {
                    buffer: alloc_named(h, slot_bytes, &format!("slot{k}"))?,
                    ready: new_event(h)?,
                    last_use: new_event(h)?,
                });
                st.table = SlotTable::new(st.slots.len());
            }
        }
        // The decode staging buffers (CONTRACT §7b): the old ones freed
        // after the decodes that read them, the new ones held as soon as
        // each is made (a failure leaves them to the state's release).
        let held = st
            .decoding
            .as_ref()
            .and_then(|d| d.staging.first())
            .map_or(0, |b| b.buffer.len_bytes());
        let keep = staging_bytes == 0 && engine.bug(PlantedBug::KeepDecodeStagingAcrossPhases);
        if held != staging_bytes && !keep {
            if let Some(d) = st.decoding.take() {
                for b in d.staging {
                    h.free(b.buffer, &[&b.copied, &b.consumed], "staging")?;
                }
            }
            if let (Some(codec), true) = (&self.codec, staging_bytes > 0) {
                let decoding = st.decoding.insert(Decoding {
                    codec: Arc::clone(codec),
                    staging: Vec::new(),
                    next: 0,
                });
                for j in 0..STAGING_BUFFERS {
                    decoding.staging.push(Staging {
                        buffer: alloc_named(h, staging_bytes, &format!("staging{j}"))?,
                        copied: new_event(h)?,
                        consumed: new_event(h)?,
                    });
                }
            }
        }
        Ok(())
    }

    /// Frees everything the rings hold (after draining; see
    /// [`release_state`]); the store's masters stay.
    pub(crate) fn release(&self, drain: bool) -> Result<(), OffloadError> {
        let st = self.engine.lock().take();
        let drain = drain && !self.engine.bug(PlantedBug::FreeWithoutDrain);
        st.map_or(Ok(()), |st| release_state(&self.engine, st, drain))
    }

    /// The device location of `storage`, if the rings hold it now.
    pub(crate) fn locate(&self, storage: StorageId) -> Option<DeviceLocation<A>> {
        self.engine.locate(storage)
    }

    /// Its residency, if the rings manage it.
    pub(crate) fn residency(&self, storage: StorageId) -> Option<Residency> {
        self.engine.residency(storage)
    }

    /// Device bytes the rings hold (the slot pool).
    pub(crate) fn device_weight_bytes(&self) -> u64 {
        self.engine.device_weight_bytes()
    }

    /// Pinned bytes of the host staging ring staged masters stream
    /// through (0 when none is staged).
    pub(crate) fn host_staging_bytes(&self) -> u64 {
        self.engine
            .lock()
            .as_ref()
            .map_or(0, |st| st.host_staging.iter().map(|s| s.ring.bytes()).sum())
    }
}
