//! How storages are packed into units: one unit per block (the host master
//! of a block is one buffer and one copy) and one per top-level component
//! for everything outside blocks.
//!
//! Packing is exact (no padding: a block's host master is exactly its
//! weight bytes) and keeps every storage at its natural alignment by placing
//! storages in order of decreasing element size; every strategy uses the
//! same partition, so a tensor sits at the same offset in its unit whatever
//! the strategy.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::{ModuleId, Pipeline, StorageId};
use crate::plan::BlockStack;

/// Where a storage's bytes lie in a weight source that holds them in an
/// order of its own: which of its files, and the byte offset there (a
/// mapped checkpoint). Ordered as the source holds them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SourcePosition {
    /// The source's file (any numbering the source keeps).
    pub file: u32,
    /// The storage's first byte in that file.
    pub offset: u64,
}

/// One storage in a unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The storage.
    pub storage: StorageId,
    /// Its first byte in the unit.
    pub offset: u64,
    /// Its size.
    pub bytes: u64,
}

/// Storages packed into one buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// A name for reports (the block or component path).
    pub name: String,
    /// The module whose subtree it holds.
    pub module: ModuleId,
    /// Each storage, its offset and size.
    pub entries: Vec<Entry>,
    /// Total bytes (exact).
    pub bytes: u64,
}

impl Unit {
    /// Packs `storages` (duplicates ignored) in order of decreasing element
    /// size, then first appearance.
    pub fn pack(
        pipeline: &Pipeline,
        name: String,
        module: ModuleId,
        storages: impl IntoIterator<Item = StorageId>,
    ) -> Self {
        let align = alignments(pipeline);
        let mut seen = BTreeSet::new();
        let mut order: Vec<StorageId> = storages.into_iter().filter(|s| seen.insert(*s)).collect();
        order.sort_by_key(|s| std::cmp::Reverse(align.get(s).copied().unwrap_or(1)));
        Self::laid_out(pipeline, name, module, order)
    }

    /// The storages of `order` back to back, in that order.
    fn laid_out(
        pipeline: &Pipeline,
        name: String,
        module: ModuleId,
        order: Vec<StorageId>,
    ) -> Self {
        let mut offset = 0;
        let entries = order
            .into_iter()
            .map(|storage| {
                let bytes = pipeline.storage(storage).bytes;
                let entry = Entry {
                    storage,
                    offset,
                    bytes,
                };
                offset += bytes;
                entry
            })
            .collect();
        Self {
            name,
            module,
            entries,
            bytes: offset,
        }
    }

    /// This unit packed in the order its source holds its storages, when
    /// the source gives every one a position and that order keeps each
    /// storage at its natural alignment (no padding: the bytes are the
    /// same); else `None`, and the unit stays as it is.
    fn in_source_order(
        &self,
        pipeline: &Pipeline,
        align: &BTreeMap<StorageId, u64>,
        position: &dyn Fn(StorageId) -> Option<SourcePosition>,
    ) -> Option<Self> {
        let mut keyed: Vec<(SourcePosition, StorageId)> = self
            .entries
            .iter()
            .map(|e| position(e.storage).map(|p| (p, e.storage)))
            .collect::<Option<_>>()?;
        keyed.sort();
        let order: Vec<StorageId> = keyed.into_iter().map(|(_, s)| s).collect();
        if order.iter().eq(self.entries.iter().map(|e| &e.storage)) {
            return None;
        }
        let unit = Self::laid_out(pipeline, self.name.clone(), self.module, order);
        let aligned = unit
            .entries
            .iter()
            .all(|e| e.offset % align.get(&e.storage).copied().unwrap_or(1) == 0);
        aligned.then_some(unit)
    }
}

/// Each storage's alignment: the largest element size of a tensor viewing
/// it.
fn alignments(pipeline: &Pipeline) -> BTreeMap<StorageId, u64> {
    let mut align: BTreeMap<StorageId, u64> = BTreeMap::new();
    for (_, t) in pipeline.tensors() {
        let a = align.entry(t.storage).or_insert(1);
        *a = (*a).max(t.dtype.size_bytes());
    }
    align
}

/// Storages every tensor of which is bf16: the ones a lossless exponent
/// code takes (CONTRACT §7b).
pub fn bf16_storages(p: &Pipeline) -> BTreeSet<StorageId> {
    let mut other = BTreeSet::new();
    let mut bf16 = BTreeSet::new();
    for (_, t) in p.tensors() {
        if t.dtype == crate::model::DType::Bf16 {
            bf16.insert(t.storage);
        } else {
            other.insert(t.storage);
        }
    }
    bf16.difference(&other).copied().collect()
}

/// `unit`'s storages as a codec's spans, by offset (`bf16`: what
/// [`bf16_storages`] gives).
pub fn codec_spans(unit: &Unit, bf16: &BTreeSet<StorageId>) -> Vec<crate::device::CodecSpan> {
    let mut spans: Vec<crate::device::CodecSpan> = unit
        .entries
        .iter()
        .map(|e| crate::device::CodecSpan {
            offset: e.offset,
            bytes: e.bytes,
            bf16: bf16.contains(&e.storage),
        })
        .collect();
    spans.sort_by_key(|s| s.offset);
    spans
}

/// The whole pipeline in units.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    /// One unit per block module of the stacks.
    pub blocks: BTreeMap<ModuleId, Unit>,
    /// One unit per group (component) and per remaining top-level module
    /// (and one for the root's own tensors) for every storage outside the
    /// blocks.
    pub rest: Vec<Unit>,
}

impl Partition {
    /// The non-block unit of the group `module`, if it has one.
    pub fn rest_of(&self, module: ModuleId) -> Option<&Unit> {
        self.rest.iter().find(|u| u.module == module)
    }

    /// Every unit.
    pub fn all(&self) -> impl Iterator<Item = &Unit> {
        self.blocks.values().chain(&self.rest)
    }

    /// Every unit repacked in the order its source holds its storages
    /// ([`Unit`]'s order otherwise): what a weight source proposes through
    /// [`crate::runtime::WeightSource::position`], so that a block whose
    /// tensors lie back to back in one file is one window of it whatever
    /// order the pipeline declared them in. Sizes do not change.
    pub fn in_source_order(
        mut self,
        pipeline: &Pipeline,
        position: &dyn Fn(StorageId) -> Option<SourcePosition>,
    ) -> Self {
        let align = alignments(pipeline);
        for unit in self.blocks.values_mut().chain(self.rest.iter_mut()) {
            if let Some(ordered) = unit.in_source_order(pipeline, &align, position) {
                *unit = ordered;
            }
        }
        self
    }
}

/// Partitions the pipeline along the blocks of `stacks`; storages outside
/// blocks go to the first of `groups` (component modules) holding them, else
/// to their top-level module.
pub fn partition(pipeline: &Pipeline, stacks: &[BlockStack], groups: &[ModuleId]) -> Partition {
    let mut in_block: BTreeSet<StorageId> = BTreeSet::new();
    let mut blocks = BTreeMap::new();
    for stack in stacks {
        for b in &stack.blocks {
            let unit = Unit::pack(
                pipeline,
                b.path.clone(),
                b.module,
                b.storages.iter().copied(),
            );
            in_block.extend(b.storages.iter().copied());
            blocks.insert(b.module, unit);
        }
    }
    let root = pipeline.root();
    let mut rest = Vec::new();
    // Each storage outside blocks goes to the first unit that claims it:
    // groups, then the root's own tensors, then each top-level module.
    let mut claim = |name: String, module: ModuleId, tensors: Vec<crate::model::TensorId>| {
        let storages: Vec<StorageId> = tensors
            .into_iter()
            .map(|t| pipeline.tensor(t).storage)
            .filter(|s| in_block.insert(*s))
            .collect();
        if !storages.is_empty() {
            rest.push(Unit::pack(pipeline, name, module, storages));
        }
    };
    for group in groups {
        claim(
            pipeline.module(*group).path.clone(),
            *group,
            pipeline.subtree_tensors(*group),
        );
    }
    claim(
        "<root>".to_owned(),
        root,
        pipeline.module(root).tensors.clone(),
    );
    for child in &pipeline.module(root).children {
        claim(
            pipeline.module(*child).path.clone(),
            *child,
            pipeline.subtree_tensors(*child),
        );
    }
    Partition { blocks, rest }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DType, PipelineBuilder};

    /// A block whose source holds its storages in another order than the
    /// declaration is repacked in the source's order; an order that would
    /// misalign a storage (a 2-byte tensor before a 4-byte one) is not
    /// taken; a unit the source gives no position for stays as it is.
    /// (Seen red: with the alignment check removed, block 1 is repacked
    /// `b` first.)
    #[test]
    fn units_follow_the_source_order_where_alignment_allows() {
        let mut b = PipelineBuilder::new("Order");
        b.module("dit").list("blocks", 2, |i, blk| {
            blk.parameter("b", DType::Bf16, &[3usize]);
            blk.parameter(
                "a",
                if i == 0 { DType::Bf16 } else { DType::F32 },
                &[2usize],
            );
        });
        let p = b.build().unwrap();
        let block = |i: usize| p.module_id(&format!("dit.blocks.{i}")).unwrap();
        let storages = |i: usize| p.subtree_storages(block(i));
        let units: Vec<Unit> = (0..2)
            .map(|i| Unit::pack(&p, format!("b{i}"), block(i), storages(i)))
            .collect();
        let part = Partition {
            blocks: (0..2).map(|i| (block(i), units[i].clone())).collect(),
            rest: Vec::new(),
        };
        let name_of = |s: StorageId| {
            let (_, t) = p.tensors().find(|(_, t)| t.storage == s).unwrap();
            t.name.clone()
        };
        // The source holds `a` first, then `b`, in each block.
        let a_first = |s: StorageId| {
            Some(SourcePosition {
                file: 0,
                offset: u64::from(name_of(s) != "a"),
            })
        };
        let ordered = part.clone().in_source_order(&p, &a_first);
        let names = |u: &Unit| {
            u.entries
                .iter()
                .map(|e| name_of(e.storage))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(&part.blocks[&block(0)]),
            ["b", "a"],
            "declaration order"
        );
        assert_eq!(
            names(&ordered.blocks[&block(0)]),
            ["a", "b"],
            "the source's order"
        );
        assert_eq!(ordered.blocks[&block(0)].bytes, units[0].bytes);
        // Block 1: the f32 `a` is packed first by alignment already.
        assert_eq!(names(&ordered.blocks[&block(1)]), ["a", "b"]);
        // `b` first would put the f32 at offset 6: refused.
        let b_first = |s: StorageId| {
            Some(SourcePosition {
                file: 0,
                offset: u64::from(name_of(s) == "a"),
            })
        };
        let kept = part.clone().in_source_order(&p, &b_first);
        assert_eq!(names(&kept.blocks[&block(1)]), ["a", "b"], "alignment kept");
        assert_eq!(names(&kept.blocks[&block(0)]), ["b", "a"]);
        // No position: as declared.
        assert_eq!(part.clone().in_source_order(&p, &|_| None), part);
    }
}
