//! ARC, the Adaptive Replacement Cache (Megiddo & Modha, FAST'03), following
//! the paper's algorithm case by case.
//!
//! T1 holds blocks seen once recently, T2 blocks seen at least twice; B1 and B2
//! are ghost directories (ids only, not resident) of blocks recently evicted
//! from T1 and T2. A hit in B1 means T1 was too small, so the target size `p`
//! of T1 grows; a hit in B2 shrinks it. REPLACE evicts from T1 or T2 to steer
//! |T1| towards p.
//!
//! Layout and invariants: the four lists share one slab and one map whose slot
//! `queue` says which list holds a block. With only `access` (the replay), the
//! paper's invariants hold: |T1|+|T2| ≤ c, |T1|+|B1| ≤ c, all four ≤ 2c, and
//! the ghosts are empty until the cache is first full, so REPLACE always runs
//! on a full cache. The pool operations (`remove`, `evict_one`) can leave the
//! cache below c with ghosts present; REPLACE is then skipped while there is
//! room, so the cache never exceeds c and the replay's behaviour is unchanged.

use crate::list::{List, Slab, SlotMap};
use crate::{Access, BlockCache, BlockId, CacheError, check_capacity};

const T1: u8 = 0;
const T2: u8 = 1;
const B1: u8 = 2;
const B2: u8 = 3;

/// Adaptive Replacement Cache with capacity `c` and adaptive target `p` ∈ [0, c].
#[derive(Debug)]
pub struct ArcCache {
    capacity: usize,
    p: f64,
    map: SlotMap,
    slab: Slab,
    /// T1, T2, B1, B2, indexed by the queue tags; fronts are the LRU ends.
    lists: [List; 4],
}

impl ArcCache {
    pub fn new(capacity: usize) -> Result<Self, CacheError> {
        check_capacity(capacity)?;
        let reserve = capacity.saturating_mul(2).min(1 << 21) + 1;
        Ok(ArcCache {
            capacity,
            p: 0.0,
            map: SlotMap::with_capacity_and_hasher(reserve, Default::default()),
            slab: Slab::with_capacity(reserve),
            lists: Default::default(),
        })
    }

    /// The current target size of T1.
    pub fn target_t1(&self) -> f64 {
        self.p
    }

    /// Sizes of T1, T2, B1, B2.
    pub fn list_lens(&self) -> [usize; 4] {
        self.lists.each_ref().map(List::len)
    }

    fn len_of(&self, queue: u8) -> usize {
        self.lists[queue as usize].len()
    }

    /// Moves a linked slot to the MRU end of `to`.
    fn relink(&mut self, slot: u32, to: u8) {
        let from = self.slab.get(slot).queue;
        self.slab.unlink(&mut self.lists[from as usize], slot);
        self.slab.get_mut(slot).queue = to;
        self.slab.push_back(&mut self.lists[to as usize], slot);
    }

    /// Drops the LRU entry of `queue` from the directory entirely.
    fn delete_lru(&mut self, queue: u8) -> Option<BlockId> {
        let slot = self.slab.pop_front(&mut self.lists[queue as usize])?;
        let block = self.slab.get(slot).block;
        self.map.remove(&block);
        self.slab.release(slot);
        Some(block)
    }

    /// The paper's REPLACE(x, p): demote T1's LRU to B1 if T1 exceeds its
    /// target (or meets it and x is in B2), else T2's LRU to B2. Returns the
    /// evicted block. Only a pool operation can make the chosen list empty; the
    /// other one is used then.
    fn replace(&mut self, x_in_b2: bool) -> Option<BlockId> {
        let t1 = self.len_of(T1) as f64;
        let from_t1 = t1 >= 1.0 && ((x_in_b2 && t1 == self.p) || t1 > self.p);
        let (from, ghost) = if (from_t1 || self.len_of(T2) == 0) && self.len_of(T1) > 0 {
            (T1, B1)
        } else {
            (T2, B2)
        };
        let slot = self.lists[from as usize].head()?;
        self.relink(slot, ghost);
        Some(self.slab.get(slot).block)
    }

    /// REPLACE, but only when the cache is full (always so in the replay).
    fn replace_if_full(&mut self, x_in_b2: bool, evicted: &mut Vec<BlockId>) {
        if self.len() >= self.capacity
            && let Some(victim) = self.replace(x_in_b2)
        {
            evicted.push(victim);
        }
    }
}

impl BlockCache for ArcCache {
    fn access(&mut self, block: BlockId, evicted: &mut Vec<BlockId>) -> Access {
        let c = self.capacity as f64;
        let found = self
            .map
            .get(&block)
            .map(|&slot| (slot, self.slab.get(slot).queue));
        match found {
            // Case I: a hit in T1 or T2 moves the block to T2's MRU end.
            Some((slot, T1 | T2)) => {
                self.relink(slot, T2);
                Access::Hit
            }
            // Case II: a ghost hit in B1; T1 deserves more room.
            Some((slot, B1)) => {
                let (b1, b2) = (self.len_of(B1) as f64, self.len_of(B2) as f64);
                let delta = if b1 >= b2 { 1.0 } else { b2 / b1 };
                self.p = (self.p + delta).min(c);
                self.replace_if_full(false, evicted);
                self.relink(slot, T2);
                Access::Miss
            }
            // Case III: a ghost hit in B2; T2 deserves more room.
            Some((slot, _)) => {
                let (b1, b2) = (self.len_of(B1) as f64, self.len_of(B2) as f64);
                let delta = if b2 >= b1 { 1.0 } else { b1 / b2 };
                self.p = (self.p - delta).max(0.0);
                self.replace_if_full(true, evicted);
                self.relink(slot, T2);
                Access::Miss
            }
            // Case IV: not in the directory at all.
            None => {
                let l1 = self.len_of(T1) + self.len_of(B1);
                let total = l1 + self.len_of(T2) + self.len_of(B2);
                if l1 >= self.capacity {
                    if self.len_of(T1) < self.capacity {
                        self.delete_lru(B1);
                        self.replace_if_full(false, evicted);
                    } else if let Some(victim) = self.delete_lru(T1) {
                        evicted.push(victim);
                    }
                } else if total >= self.capacity {
                    if total >= self.capacity.saturating_mul(2) {
                        self.delete_lru(B2);
                    }
                    self.replace_if_full(false, evicted);
                }
                let slot = self.slab.insert(block, T1, 0);
                self.slab.push_back(&mut self.lists[T1 as usize], slot);
                self.map.insert(block, slot);
                Access::Miss
            }
        }
    }

    fn contains(&self, block: BlockId) -> bool {
        self.map
            .get(&block)
            .is_some_and(|&slot| matches!(self.slab.get(slot).queue, T1 | T2))
    }

    fn remove(&mut self, block: BlockId) -> bool {
        let Some(&slot) = self.map.get(&block) else {
            return false;
        };
        let queue = self.slab.get(slot).queue;
        if !matches!(queue, T1 | T2) {
            return false;
        }
        self.slab.unlink(&mut self.lists[queue as usize], slot);
        self.map.remove(&block);
        self.slab.release(slot);
        true
    }

    /// REPLACE as for a block that is in neither ghost directory.
    fn evict_one(&mut self) -> Option<BlockId> {
        self.replace(false)
    }

    fn len(&self) -> usize {
        self.len_of(T1) + self.len_of(T2)
    }

    fn capacity(&self) -> Option<usize> {
        Some(self.capacity)
    }
}
