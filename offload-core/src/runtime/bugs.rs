//! The planted-bug switches ([`PlantedBug`]): test-only mutations of the
//! strategies, read only where the `planted-bugs` feature is compiled in.

/// Bugs a test can plant in a backend (with the `planted-bugs` feature) to
/// see that the invariant checkers catch them. Never set otherwise: the
/// switches are read only where the feature is compiled in
/// (`CorePlatform::with_planted_bugs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum PlantedBug {
    /// INV-3 (layerwise): no fill's copy waits for its slot's last use.
    SkipLastUseWait,
    /// INV-3 (layerwise): compute does not wait for a slot's ready event.
    SkipReadyWait,
    /// INV-3 (layerwise): disable frees slots and masters without draining.
    FreeWithoutDrain,
    /// INV-8 (layerwise): views point into the wrong slot.
    WrongSlot,
    /// INV-7 (layerwise): one slot more than depth + 1.
    ExtraSlot,
    /// INV-2 (layerwise): a second pinned host copy of every block.
    SecondHostCopy,
    /// INV-7 (layerwise): host masters leak at disable.
    LeakHostMasters,
    /// INV-5 (layerwise): a failed enable leaves its hooks installed.
    NoRollback,
    /// INV-1 (layerwise): enable does not check for another strategy's hooks.
    IgnoreOtherOwner,
    /// INV-4 (layerwise): non-persistent buffers are not loaded.
    SkipNonPersistent,
    /// INV-3 (layerwise): a block's last use is recorded in its pre-forward,
    /// before its kernels, so the next fill of its slot does not wait for them.
    LastUseBeforeCompute,
    /// INV-3 (layerwise): the slot is chosen statically (block index modulo
    /// the slot count) instead of the least recently filled free slot; an
    /// odd ring wraps onto the slot compute is reading.
    StaticSlot,
    /// INV-3 (layerwise): the on-demand refill (a skipped predecessor) does
    /// not wait for the victim slot's last use.
    OnDemandSkipLastUseWait,
    /// INV-3 (layerwise): the wrap-around prefetch (the last block fetching
    /// block 0) does not wait for the victim slot's last use.
    WrapAroundSkipLastUseWait,
    /// INV-8 (layerwise): a fill copies the next block's host master.
    WrongMaster,
    /// INV-8 (layerwise): a prefetch stamps its slot and records ready
    /// without copying, so the slot keeps the bytes of what it held before.
    StaleSlot,
    /// INV-8 (layerwise): slot stamps ignore the ring, so a block of a
    /// second ring reads the slot of the first ring's block with its index.
    IgnoreRingStamp,
    /// INV-4 (layerwise): the second storage of each streamed block is
    /// placed two bytes off, overlapping its neighbour.
    ShiftedPlacement,
    /// INV-3 (model level): eviction frees after the bring-in's ready event
    /// only, not after the component's last use.
    EvictWithoutLastUse,
    /// INV-3 (model level): compute does not wait for a bring-in.
    BringInWithoutReady,
    /// INV-7 (model level): a component is brought in before the others
    /// are evicted.
    BringInBeforeEvict,
    /// INV-3 (model level): a failed bring-in frees what it allocated
    /// without waiting for the copies already enqueued.
    FailedBringInFreeWithoutWait,
    /// INV-3 (every strategy): dropping an enabled backend frees without
    /// draining.
    DropWithoutDrain,
    /// INV-9 (distributed layerwise): ranks of odd index issue the
    /// prefetches of one pre-forward farthest first, so their collectives
    /// run in another order than the even ranks'.
    DivergentCollectiveOrder,
    /// INV-9/INV-8 (distributed layerwise): the all-gather writes the whole
    /// slot (G × the largest shard) instead of the slot narrowed to this
    /// block's G·s bytes.
    WholeSlotGather,
    /// INV-3 (distributed layerwise): a shard copy does not wait for the
    /// gather that last read its shard buffer.
    ShardReuseBeforeGather,
    /// INV-9 (distributed layerwise): `enable` fills block 0 of its first
    /// ring (as layerwise does) instead of deferring every ring's first fill
    /// to its first forward; a rank whose first ring gathers then issues a
    /// collective at enable that a rank whose first ring is rank-local (an
    /// encoder only it runs) does not.
    EagerFirstFill,
    /// INV-7 (planned): a phase that streams nothing keeps the slot pool
    /// of the phase before instead of freeing it, so its peak holds slots
    /// the plan did not count.
    KeepPoolAcrossPhases,
    /// INV-7 (planned, `weight_compression`): a phase that decodes nothing
    /// keeps the decode staging buffers of the phase before instead of
    /// freeing them, so its peak holds staging the plan did not count.
    KeepDecodeStagingAcrossPhases,
    /// INV-7 (planned): a phase begins without evicting the held sets of
    /// the components that are not kept, so they stay beside its own.
    SkipPhaseEviction,
    /// The warm-up (planned) reports half the activation memory the
    /// denoising phases held, so a first request on a full device runs out
    /// of memory there and the backend re-plans.
    UnderstateActivations,
    /// INV-3 (decode transport): the decode does not wait for the copy of
    /// its coded bytes into the staging buffer.
    DecodeBeforeCopy,
    /// INV-3 (decode transport): a slot's ready event is recorded on the
    /// copy stream after the staging copy, so compute waits for the copy
    /// but not for the decode that writes the slot.
    ComputeBeforeDecode,
    /// INV-3 (decode transport): a staging copy does not wait for the
    /// decode that last read its staging buffer.
    StagingReuseBeforeDecode,
    /// INV-3 (decode transport): the decode does not wait for its slot's
    /// last use, so it writes a slot compute may still be reading.
    DecodeIntoSlotInUse,
    /// INV-3 (staging transport, CONTRACT §7c): the host refills a pinned
    /// staging buffer without waiting for the copy that last read it, so
    /// the copy may carry the next block's bytes into the slot.
    HostStagingReuseBeforeCopy,
    /// INV-3 (staging transport in parts, CONTRACT §7c): a staged block's
    /// slot `ready` is recorded after its first part's copy instead of its
    /// last, so compute may read the slot while its later parts land.
    StagedReadyAfterFirstPart,
    /// INV-3 (staging transport, CONTRACT §7c): a block's pre-forward does
    /// not issue its queued staged fill before compute waits for the
    /// slot's `ready`, so compute waits for the slot's previous `ready`
    /// and reads it before (or while) the block's parts land.
    StagedReadyUnrecorded,
    /// INV-8 (distributed layerwise, CONTRACT §8): a rank's shard registered
    /// in place ([`crate::runtime::WeightSource::take_shard_region`]) is
    /// asked for one bf16 element (2 bytes) past where the shard starts, so
    /// the gathered slot holds the checkpoint's bytes shifted.
    ShardWindowWrongOffset,
    /// INV-7 (layerwise, CONTRACT §7c): the host plan counts blocks a
    /// coded-block file holds at their coded size under `"auto"` too, whose
    /// measurement may turn a ring's coded masters back into raw ones, so
    /// the raw masters pinned exceed the host budget.
    HostPlanCodedUnderAuto,
    /// INV-7 (planned, CONTRACT §7c): the store pins every master, the
    /// streamed blocks and kept sets the plan's host side stages included,
    /// so the page-locked peak exceeds the host budget the plan was made
    /// within.
    PlannedPinsStagedBlocks,
    /// INV-7 (layerwise and planned, CONTRACT §7c): the masters keep every
    /// pin the device granted where it refused others, so the staging ring
    /// the refused blocks need (which a plan that pinned every streamed
    /// block did not hold) takes the page-locked peak over the host budget.
    KeepPinsBesideRefused,
    /// INV-7 (planned, CONTRACT §7c): the units outside every component
    /// upload through a pinned copy of their own while the kept sets'
    /// upload buffer is alive: two upload buffers where the plan counts
    /// the larger.
    OutsideUploadBesideBuffer,
    /// INV-8 (planned, CONTRACT §7c): a swapped held unit whose pin was
    /// refused is brought in as a fresh device buffer, its staged upload
    /// discarded, so its phase reads bytes nobody wrote.
    StagedBringInSkipsCopy,
    /// The budget (planned, CONTRACT §7a): the store follows a new plan
    /// without measuring what its masters' mappings grew device memory by,
    /// so the plan counts the mappings of the store before it (the
    /// warm-up's) while the device maps more.
    StoreMappingsUnmeasured,
    /// The budget (planned, CONTRACT §7a): the allocator's slack is the
    /// warm-up's sample of it (what its pool held beyond what was in use),
    /// not the chunk rounding any phase may carry, so a phase whose use
    /// rounds up further than the warm-up's did holds more than planned.
    SlackSampledNotChunked,
    /// The budget (planned, CONTRACT §7a): the page tables of the pinned
    /// staging ring and upload buffer a plan holds are not counted beside
    /// the masters' measured mappings.
    StagingTablesUncounted,
    /// The budget's timing (planned, CONTRACT §7b, §9): no check request
    /// runs after a warm-up whose plan streams coded blocks, so the plan
    /// prices each decode's cost to the kernels beside it at the assumed
    /// `DECODE_INTERFERENCE`, whatever this device's is.
    DecodeInterferenceAssumed,
    /// The staged look-ahead's timing (layerwise, CONTRACT §7c): the
    /// ring's last post-forward leaves the queue to the next forward's
    /// hooks even where the caller was seen waiting at a step's end, so
    /// the next pass's first staged blocks copy only after that wait.
    StepEndLeavesQueue,
    /// The staged look-ahead's timing (layerwise, CONTRACT §7c): the
    /// ring's last post-forward issues the queue's next part even where
    /// the host would first wait for the copy stream's backlog (a staging
    /// buffer whose last copy is queued behind other blocks' copies), so
    /// the wait outlasts the last block's kernels and the next step's
    /// launches wait for it.
    StepEndWaitsOnCopies,
}

impl PlantedBug {
    /// Every planted bug.
    pub const ALL: [PlantedBug; 50] = [
        PlantedBug::SkipLastUseWait,
        PlantedBug::SkipReadyWait,
        PlantedBug::FreeWithoutDrain,
        PlantedBug::WrongSlot,
        PlantedBug::ExtraSlot,
        PlantedBug::SecondHostCopy,
        PlantedBug::LeakHostMasters,
        PlantedBug::NoRollback,
        PlantedBug::IgnoreOtherOwner,
        PlantedBug::SkipNonPersistent,
        PlantedBug::LastUseBeforeCompute,
        PlantedBug::StaticSlot,
        PlantedBug::OnDemandSkipLastUseWait,
        PlantedBug::WrapAroundSkipLastUseWait,
        PlantedBug::WrongMaster,
        PlantedBug::StaleSlot,
        PlantedBug::IgnoreRingStamp,
        PlantedBug::ShiftedPlacement,
        PlantedBug::EvictWithoutLastUse,
        PlantedBug::BringInWithoutReady,
        PlantedBug::BringInBeforeEvict,
        PlantedBug::FailedBringInFreeWithoutWait,
        PlantedBug::DropWithoutDrain,
        PlantedBug::DivergentCollectiveOrder,
        PlantedBug::WholeSlotGather,
        PlantedBug::ShardReuseBeforeGather,
        PlantedBug::EagerFirstFill,
        PlantedBug::KeepPoolAcrossPhases,
        PlantedBug::KeepDecodeStagingAcrossPhases,
        PlantedBug::SkipPhaseEviction,
        PlantedBug::UnderstateActivations,
        PlantedBug::DecodeBeforeCopy,
        PlantedBug::ComputeBeforeDecode,
        PlantedBug::StagingReuseBeforeDecode,
        PlantedBug::DecodeIntoSlotInUse,
        PlantedBug::HostStagingReuseBeforeCopy,
        PlantedBug::StagedReadyAfterFirstPart,
        PlantedBug::StagedReadyUnrecorded,
        PlantedBug::ShardWindowWrongOffset,
        PlantedBug::HostPlanCodedUnderAuto,
        PlantedBug::PlannedPinsStagedBlocks,
        PlantedBug::KeepPinsBesideRefused,
        PlantedBug::OutsideUploadBesideBuffer,
        PlantedBug::StagedBringInSkipsCopy,
        PlantedBug::StoreMappingsUnmeasured,
        PlantedBug::SlackSampledNotChunked,
        PlantedBug::StagingTablesUncounted,
        PlantedBug::DecodeInterferenceAssumed,
        PlantedBug::StepEndLeavesQueue,
        PlantedBug::StepEndWaitsOnCopies,
    ];

    /// The bug's name on command lines (`skip-last-use-wait`).
    pub fn name(self) -> String {
        let mut out = String::new();
        for (i, c) in format!("{self:?}").chars().enumerate() {
            if c.is_ascii_uppercase() {
                if i > 0 {
                    out.push('-');
                }
                out.push(c.to_ascii_lowercase());
            } else {
                out.push(c);
            }
        }
        out
    }

    /// The bug called `name` (as [`Self::name`] spells it).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.name() == name)
    }
}

/// The planted bugs a backend carries: empty unless the `planted-bugs`
/// feature is compiled in and a test asked for some.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Bugs(Vec<PlantedBug>);

impl Bugs {
    pub(crate) fn new(bugs: &[PlantedBug]) -> Self {
        Self(if cfg!(feature = "planted-bugs") {
            bugs.to_vec()
        } else {
            Vec::new()
        })
    }

    /// Whether `bug` is planted.
    pub(crate) fn has(&self, bug: PlantedBug) -> bool {
        cfg!(feature = "planted-bugs") && self.0.contains(&bug)
    }
}
