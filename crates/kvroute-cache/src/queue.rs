//! LRU and FIFO: one queue of resident blocks, oldest at the front.
//!
//! They differ only in what a hit does (LRU moves the block to the back, FIFO
//! leaves it), so they are one type with that choice as a constant parameter
//! and no branch at run time.

use crate::list::{List, Slab, SlotMap};
use crate::{Access, BlockCache, BlockId, CacheError, check_capacity};

/// A queue cache; `MOVE_ON_HIT` makes it LRU, otherwise FIFO.
#[derive(Debug)]
pub struct QueueCache<const MOVE_ON_HIT: bool> {
    capacity: usize,
    map: SlotMap,
    slab: Slab,
    queue: List,
}

/// Least recently used: a hit moves the block to most-recent; a miss appends it
/// and evicts the least recent block when over capacity.
pub type Lru = QueueCache<true>;

/// First in, first out: a hit changes nothing; a miss appends and evicts the
/// oldest insertion.
pub type Fifo = QueueCache<false>;

impl<const MOVE_ON_HIT: bool> QueueCache<MOVE_ON_HIT> {
    pub fn new(capacity: usize) -> Result<Self, CacheError> {
        check_capacity(capacity)?;
        let reserve = capacity.min(1 << 20);
        Ok(QueueCache {
            capacity,
            map: SlotMap::with_capacity_and_hasher(reserve + 1, Default::default()),
            slab: Slab::with_capacity(reserve + 1),
            queue: List::default(),
        })
    }
}

impl<const MOVE_ON_HIT: bool> BlockCache for QueueCache<MOVE_ON_HIT> {
    #[inline]
    fn access(&mut self, block: BlockId, evicted: &mut Vec<BlockId>) -> Access {
        if let Some(&slot) = self.map.get(&block) {
            if MOVE_ON_HIT {
                self.slab.move_to_back(&mut self.queue, slot);
            }
            return Access::Hit;
        }
        if self.queue.len() >= self.capacity
            && let Some(victim) = self.evict_one()
        {
            evicted.push(victim);
        }
        let slot = self.slab.insert(block, 0, 0);
        self.slab.push_back(&mut self.queue, slot);
        self.map.insert(block, slot);
        Access::Miss
    }

    fn contains(&self, block: BlockId) -> bool {
        self.map.contains_key(&block)
    }

    fn remove(&mut self, block: BlockId) -> bool {
        let Some(slot) = self.map.remove(&block) else {
            return false;
        };
        self.slab.unlink(&mut self.queue, slot);
        self.slab.release(slot);
        true
    }

    fn evict_one(&mut self) -> Option<BlockId> {
        let slot = self.slab.pop_front(&mut self.queue)?;
        let victim = self.slab.get(slot).block;
        self.map.remove(&victim);
        self.slab.release(slot);
        Some(victim)
    }

    fn len(&self) -> usize {
        self.queue.len()
    }

    fn capacity(&self) -> Option<usize> {
        Some(self.capacity)
    }
}
