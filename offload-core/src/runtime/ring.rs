//! The layout of the streaming strategies' rings, as a pure function of the
//! plan, the partition and the gather group: which blocks stream, which
//! stay resident (DLO's resident leading layers, layerwise `resident_blocks`), which rings all-gather,
//! each rank's shard of each gathered block, and the sizes of the slots
//! and shard buffers. The ring engine (`layerwise.rs`) builds exactly this;
//! INV-7's bounds (`bounds.rs`) count exactly this.

use crate::config::{OffloadStrategy, WeightTransfer};
use crate::plan::ResolvedPlan;
use crate::runtime::layout::{Partition, Unit};

/// Shard buffers a gathering ring engine double-buffers through: the copy
/// of block i+1's shard overlaps the gather of block i's.
pub(crate) const SHARD_BUFFERS: u64 = 2;

/// One rank's part of a gathered block: bytes `start..end` of the block's
/// packed unit, zero-padded to `bytes` (CONTRACT §8: `s = ceil(total/G)`,
/// rank r owns `[r·s, min((r+1)·s, total))`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shard {
    /// First byte of the unit this rank owns.
    pub(crate) start: u64,
    /// One past the last (≤ the unit's bytes; `start` when this rank's
    /// part is all padding).
    pub(crate) end: u64,
    /// s: the shard's size, padding included.
    pub(crate) bytes: u64,
    /// G.
    pub(crate) group: u64,
}

impl Shard {
    /// Rank `rank`'s shard of a unit of `total` bytes in a group of `group`.
    pub(crate) fn of(total: u64, group: u32, rank: u32) -> Self {
        let g = u64::from(group.max(1));
        let s = total.div_ceil(g);
        let start = (u64::from(rank) * s).min(total);
        let end = (start + s).min(total);
        Self {
            start,
            end,
            bytes: s,
            group: g,
        }
    }

    /// G·s: the slot bytes the gather writes (the slot narrowed to this
    /// block).
    pub(crate) fn gathered_bytes(&self) -> u64 {
        self.group * self.bytes
    }
}

/// One streamed block.
#[derive(Clone, Debug)]
pub(crate) struct RingBlock {
    pub(crate) unit: Unit,
    /// This rank's shard, for a gathered ring.
    pub(crate) shard: Option<Shard>,
}

impl RingBlock {
    /// Slot bytes this block occupies: G·s gathered, its bytes otherwise.
    pub(crate) fn slot_bytes(&self) -> u64 {
        self.shard
            .map_or(self.unit.bytes, |s| s.gathered_bytes().max(self.unit.bytes))
    }

    /// Host master bytes on this rank: s gathered, the whole block otherwise.
    pub(crate) fn master_bytes(&self) -> u64 {
        self.shard.map_or(self.unit.bytes, |s| s.bytes)
    }
}

/// One ring: a stack's streamed blocks in forward order.
#[derive(Clone, Debug)]
pub(crate) struct RingSpec {
    /// The role of the component whose stack it is.
    pub(crate) role: crate::discovery::Role,
    /// Whether its blocks are all-gathered (DLO with G > 1 and weight
    /// transfer `allgather`); otherwise each rank copies whole blocks.
    pub(crate) gathered: bool,
    pub(crate) blocks: Vec<RingBlock>,
}

/// Every ring of a plan on one rank.
#[derive(Clone, Debug)]
pub(crate) struct RingLayout {
    pub(crate) rings: Vec<RingSpec>,
    /// Bytes of one slot: the largest slot footprint of any block.
    pub(crate) slot_bytes: u64,
    /// Bytes of one shard buffer: the largest shard (0 with no gathered
    /// ring).
    pub(crate) shard_bytes: u64,
}

impl RingLayout {
    /// The rings of `plan` (a layerwise or DLO plan) on rank `rank` of a
    /// gather group of `group` ranks.
    pub(crate) fn new(plan: &ResolvedPlan, partition: &Partition, group: u32, rank: u32) -> Self {
        let dlo = plan.strategy() == OffloadStrategy::DistributedLayerwise;
        let mut rings = Vec::new();
        for stack in &plan.stacks {
            let gathered = dlo && group > 1 && stack.weight_transfer == WeightTransfer::Allgather;
            let blocks = stack
                .streamed()
                .map(|b| {
                    let unit = partition.blocks[&b.module].clone();
                    let shard = gathered.then(|| Shard::of(unit.bytes, group, rank));
                    RingBlock { unit, shard }
                })
                .collect();
            rings.push(RingSpec {
                role: stack.role,
                gathered,
                blocks,
            });
        }
        let slot_bytes = rings
            .iter()
            .flat_map(|r| &r.blocks)
            .map(RingBlock::slot_bytes)
            .max()
            .unwrap_or(0);
        let shard_bytes = rings
            .iter()
            .flat_map(|r| &r.blocks)
            .filter_map(|b| b.shard.map(|s| s.bytes))
            .max()
            .unwrap_or(0);
        Self {
            rings,
            slot_bytes,
            shard_bytes,
        }
    }

    /// Whether any ring all-gathers.
    pub(crate) fn gathers(&self) -> bool {
        self.rings.iter().any(|r| r.gathered)
    }

    /// Shard buffers the engine allocates.
    pub(crate) fn shard_buffers(&self) -> u64 {
        if self.gathers() { SHARD_BUFFERS } else { 0 }
    }

    /// Every streamed block.
    pub(crate) fn blocks(&self) -> impl Iterator<Item = &RingBlock> {
        self.rings.iter().flat_map(|r| &r.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::Shard;

    #[test]
    fn shards_cover_the_unit_once_with_less_than_g_bytes_of_padding() {
        for total in [0u64, 1, 2, 7, 8, 9, 1000, 4097] {
            for g in 1u32..=5 {
                let shards: Vec<Shard> = (0..g).map(|r| Shard::of(total, g, r)).collect();
                let mut next = 0;
                for s in &shards {
                    assert_eq!(s.start, next, "contiguous: {total} / {g}");
                    assert!(s.end - s.start <= s.bytes);
                    next = s.end;
                }
                assert_eq!(next, total);
                let padding = shards[0].gathered_bytes() - total;
                assert!(padding < u64::from(g), "{total} / {g}: padding {padding}");
            }
        }
    }
}
