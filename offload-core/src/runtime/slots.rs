//! The host-side bookkeeping of the layerwise slot pool, shared by the hooks
//! of every ring: which (ring, block) each slot holds (its stamp), which
//! slot compute is reading, and the fill order. The device side (buffers,
//! ready and last-use events) lives beside it in the layerwise state.

/// One slot's bookkeeping.
#[derive(Clone, Debug, Default)]
struct SlotMeta {
    stamp: Option<(usize, usize)>,
    filled_seq: u64,
    in_use: bool,
}

/// Stamps, fill order and use of every slot.
#[derive(Clone, Debug)]
pub(crate) struct SlotTable {
    slots: Vec<SlotMeta>,
    seq: u64,
}

impl SlotTable {
    /// `n` empty slots.
    pub(crate) fn new(n: usize) -> Self {
        Self {
            slots: vec![SlotMeta::default(); n],
            seq: 0,
        }
    }

    /// Number of slots.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether compute reads any slot now.
    pub(crate) fn any_in_use(&self) -> bool {
        self.slots.iter().any(|s| s.in_use)
    }

    /// The (ring, block) of a slot in use now, if any.
    pub(crate) fn in_use_block(&self) -> Option<(usize, usize)> {
        self.slots.iter().find(|s| s.in_use).and_then(|s| s.stamp)
    }

    /// The slot holding (ring, block), if any.
    pub(crate) fn holding(&self, ring: usize, block: usize) -> Option<usize> {
        self.slots
            .iter()
            .position(|s| s.stamp == Some((ring, block)))
    }

    /// The slot to fill next, keeping `protected` slots (a gathered block
    /// in flight, which only a fill every rank makes may evict) unless
    /// `evict_protected`: the least recently filled free slot that is not
    /// protected, else (if allowed) the least recently filled protected one.
    pub(crate) fn victim_sparing(
        &self,
        protected: impl Fn(usize) -> bool,
        evict_protected: bool,
    ) -> Option<usize> {
        let free = || self.slots.iter().enumerate().filter(|(_, s)| !s.in_use);
        free()
            .filter(|(k, _)| !protected(*k))
            .min_by_key(|(_, s)| s.filled_seq)
            .or_else(|| {
                evict_protected
                    .then(|| free().min_by_key(|(_, s)| s.filled_seq))
                    .flatten()
            })
            .map(|(k, _)| k)
    }

    /// What slot `k` holds, if anything.
    pub(crate) fn stamp(&self, k: usize) -> Option<(usize, usize)> {
        self.slots[k].stamp
    }

    /// Empties slot `k` before it is refilled with (ring, block), which no
    /// other slot may then claim to hold; returns what `k` held.
    ///
    /// # Panics
    ///
    /// If `k` is in use: overwriting a slot compute reads is the bug this
    /// table exists to prevent.
    pub(crate) fn evict(&mut self, k: usize, ring: usize, block: usize) -> Option<(usize, usize)> {
        assert!(
            !self.slots[k].in_use,
            "slot {k} is in use and cannot be refilled"
        );
        self.evict_unchecked(k, ring, block)
    }

    /// [`Self::evict`] without the in-use check: only the `StaticSlot`
    /// planted bug calls it, to refill a slot compute may be reading.
    pub(crate) fn evict_unchecked(
        &mut self,
        k: usize,
        ring: usize,
        block: usize,
    ) -> Option<(usize, usize)> {
        for s in &mut self.slots {
            if s.stamp == Some((ring, block)) {
                s.stamp = None;
            }
        }
        self.slots[k].stamp.take()
    }

    /// Slot `k` now holds (ring, block), the newest fill.
    pub(crate) fn filled(&mut self, k: usize, ring: usize, block: usize) {
        self.seq += 1;
        let s = &mut self.slots[k];
        s.stamp = Some((ring, block));
        s.filled_seq = self.seq;
    }

    /// Compute reads slot `k` from now on.
    pub(crate) fn acquire(&mut self, k: usize) {
        self.slots[k].in_use = true;
    }

    /// Compute is done with the slot holding (ring, block); returns it.
    pub(crate) fn release(&mut self, ring: usize, block: usize) -> Option<usize> {
        let k = self
            .slots
            .iter()
            .position(|s| s.in_use && s.stamp == Some((ring, block)))?;
        self.slots[k].in_use = false;
        Some(k)
    }
}

#[cfg(test)]
mod tests {
    use super::SlotTable;

    #[test]
    fn victim_is_least_recently_filled_and_never_in_use() {
        let mut t = SlotTable::new(2);
        assert_eq!(t.victim_sparing(|_| false, true), Some(0));
        t.evict(0, 0, 0);
        t.filled(0, 0, 0);
        t.acquire(0);
        assert_eq!(
            t.victim_sparing(|_| false, true),
            Some(1),
            "slot 0 is in use"
        );
        t.evict(1, 0, 1);
        t.filled(1, 0, 1);
        assert_eq!(
            t.victim_sparing(|_| false, true),
            Some(1),
            "only slot 1 is free"
        );
        assert_eq!(t.release(0, 0), Some(0));
        assert_eq!(
            t.victim_sparing(|_| false, true),
            Some(0),
            "least recently filled"
        );
        assert_eq!(t.holding(0, 1), Some(1));
        // Refilling a slot with a block another slot holds clears that stamp.
        assert_eq!(t.evict(0, 0, 1), Some((0, 0)));
        assert_eq!(t.holding(0, 1), None);
    }
}

#[cfg(loom)]
mod loom_models {
    use super::SlotTable;
    use crate::sync::{Mutex, lock};
    use loom::sync::Arc;

    /// Forward of block 0 of `ring` as the hooks run it: find or fill a
    /// slot, take it, prefetch block 1 into the next free slot (if any),
    /// read, release. Returns whether the slot still held block 0 when
    /// compute finished.
    fn forward(table: &Mutex<SlotTable>, ring: usize) -> bool {
        let fill = |t: &mut SlotTable, block: usize| {
            let k = t.victim_sparing(|_| false, true)?;
            t.evict(k, ring, block);
            t.filled(k, ring, block);
            Some(k)
        };
        let k = {
            let mut t = lock(table);
            let k = match t.holding(ring, 0) {
                Some(k) => k,
                None => fill(&mut t, 0).expect("at most one slot is in use by the other ring"),
            };
            t.acquire(k);
            if t.holding(ring, 1).is_none() {
                fill(&mut t, 1);
            }
            k
        };
        loom::thread::yield_now();
        let mut t = lock(table);
        let intact = t.holding(ring, 0) == Some(k);
        t.release(ring, 0);
        intact
    }

    /// Two rings' blocks forward from two threads over one shared pool of
    /// two slots: a slot compute reads is never refilled under it.
    #[test]
    fn a_slot_in_use_is_never_refilled() {
        loom::model(|| {
            let table = Arc::new(Mutex::new(SlotTable::new(2)));
            let other = Arc::clone(&table);
            let t = loom::thread::spawn(move || forward(&other, 1));
            assert!(forward(&table, 0));
            assert!(t.join().unwrap());
            let t = lock(&table);
            assert!(
                t.victim_sparing(|_| false, true).is_some(),
                "nothing left in use"
            );
        });
    }
}
