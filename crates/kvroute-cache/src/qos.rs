//! QoS eviction: low-priority blocks go before normal ones, normal before
//! high, LRU within a class.
//!
//! A block's class is the highest [`Priority`](crate::Priority) of the accesses that used it
//! while resident (a block a high-priority request shares stays protected even
//! if a low one touches it later); it is forgotten when the block leaves. One
//! LRU queue per class, in one slab, so every operation is O(1): a victim is
//! the front of the lowest non-empty queue.

use crate::list::{List, Slab, SlotMap};
use crate::{Access, AccessHint, BlockCache, BlockId, CacheError, check_capacity};

#[derive(Debug)]
pub struct Qos {
    capacity: usize,
    map: SlotMap,
    slab: Slab,
    /// One LRU queue per class, indexed by `Priority::class`; fronts are oldest.
    queues: [List; 3],
    next: AccessHint,
}

impl Qos {
    pub fn new(capacity: usize) -> Result<Self, CacheError> {
        check_capacity(capacity)?;
        let reserve = capacity.min(1 << 20) + 1;
        Ok(Qos {
            capacity,
            map: SlotMap::with_capacity_and_hasher(reserve, Default::default()),
            slab: Slab::with_capacity(reserve),
            queues: Default::default(),
            next: AccessHint::default(),
        })
    }

    /// Resident blocks per class, low first.
    pub fn class_lens(&self) -> [usize; 3] {
        self.queues.each_ref().map(List::len)
    }
}

impl BlockCache for Qos {
    fn access(&mut self, block: BlockId, evicted: &mut Vec<BlockId>) -> Access {
        let class = std::mem::take(&mut self.next).priority.class();
        if let Some(&slot) = self.map.get(&block) {
            let from = self.slab.get(slot).queue;
            let to = from.max(class);
            self.slab.unlink(&mut self.queues[from as usize], slot);
            self.slab.get_mut(slot).queue = to;
            self.slab.push_back(&mut self.queues[to as usize], slot);
            return Access::Hit;
        }
        if self.len() >= self.capacity
            && let Some(victim) = self.evict_one()
        {
            evicted.push(victim);
        }
        let slot = self.slab.insert(block, class, 0);
        self.slab.push_back(&mut self.queues[class as usize], slot);
        self.map.insert(block, slot);
        Access::Miss
    }

    fn hint(&mut self, hint: AccessHint) {
        self.next = hint;
    }

    fn contains(&self, block: BlockId) -> bool {
        self.map.contains_key(&block)
    }

    fn remove(&mut self, block: BlockId) -> bool {
        let Some(slot) = self.map.remove(&block) else {
            return false;
        };
        let class = self.slab.get(slot).queue;
        self.slab.unlink(&mut self.queues[class as usize], slot);
        self.slab.release(slot);
        true
    }

    fn evict_one(&mut self) -> Option<BlockId> {
        let queue = self.queues.iter_mut().find(|q| !q.is_empty())?;
        let slot = self.slab.pop_front(queue)?;
        let victim = self.slab.get(slot).block;
        self.map.remove(&victim);
        self.slab.release(slot);
        Some(victim)
    }

    fn len(&self) -> usize {
        self.queues.iter().map(List::len).sum()
    }

    fn capacity(&self) -> Option<usize> {
        Some(self.capacity)
    }
}
